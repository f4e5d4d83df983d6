/* CPU ranks: the primitives a distributed algorithm on CPU ranks is written
 * with, the host twin of include/moelink_device.cuh. Ranks are processes of
 * one machine; symmetric buffers are POSIX shared memory mapped by every rank,
 * so a peer's buffer is a plain pointer.
 *
 * Memory ordering: ml_cpu_signal_set/add are release operations and
 * ml_cpu_wait an acquire, so everything a rank wrote (to any memory) before it
 * signalled is visible to a rank whose wait saw that signal's value. Signal
 * words are uint64_t in symmetric memory, 8-byte aligned, only ever touched
 * through these functions (or moelink_device.cuh's on the GPU). */
#ifndef MOELINK_COMM_CPU_H
#define MOELINK_COMM_CPU_H

#include "comm/comm.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Each rank stages collectives through two halves of this many bytes (one
 * is filled while peers still read the other), so any count runs in bounded
 * memory. Tests use it to pick sizes that span several chunks. */
#define ML_CPU_STAGE_BYTES ((size_t)128 << 10)

/* More ranks than this would need more processes than a machine runs well. */
#define ML_CPU_MAX_RANKS 1024

/* MOELINK_COMM_TIMEOUT_MS (defined by the front end, src/comm/comm.c). */
int64_t ml_comm_timeout_ms(void);
int64_t ml_comm_init_timeout_ms(void);

/* The address of `peer`'s copy of a symmetric address of this rank (any
 * address inside a buffer from moelink_symm_alloc on comm), or NULL when ptr
 * is not inside one. peer == own rank gives ptr back. */
void *ml_cpu_peer_ptr(moelink_comm_t comm, const void *ptr, int peer);

/* Signals: a 64-bit counter in symmetric memory (usually a peer's, through
 * ml_cpu_peer_ptr), written with release semantics. */
void ml_cpu_signal_set(uint64_t *signal, uint64_t value);
void ml_cpu_signal_add(uint64_t *signal, uint64_t value);

/* Waits until *signal >= value (acquire). `from` is the rank expected to
 * write it and `primitive` names what is awaited, for the message. Gives up
 * after MOELINK_COMM_TIMEOUT_MS, or as soon as rank `from` is found dead or
 * another rank reported a failure: MOELINK_ERR_TIMEOUT with
 * "rank R: waited T ms for PRIMITIVE (value V) from rank P". A failure is
 * recorded (moelink_comm_check reports it, later calls fail at once) and
 * announced to the other ranks, whose waits stop too. */
moelink_status_t ml_cpu_wait(moelink_comm_t comm, const uint64_t *signal, uint64_t value,
                             int from, const char *primitive);

/* Every rank reaches it before any leaves (same timeout rules as a wait). */
moelink_status_t ml_cpu_barrier(moelink_comm_t comm);

#ifdef __cplusplus
}
#endif

#endif
