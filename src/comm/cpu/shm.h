/* Private to the CPU communicator: the layout of the shared control segment
 * and the per-process state.
 *
 * Control segment (one per communicator, created by rank 0, unlinked as soon
 * as every rank has mapped it):
 *   [header: 4 KiB][slot of rank 0]...[slot of rank n-1][pad to 4 KiB]
 *   [staging of rank 0: 2 halves]...[staging of rank n-1]
 * Every counter only grows, so "wait until >= v" never misses a value and no
 * counter is ever reset while a peer may read it. */
#ifndef MOELINK_COMM_CPU_SHM_H
#define MOELINK_COMM_CPU_SHM_H

#include "comm/cpu/comm_cpu.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define ML_CPU_LINE 64
#define ML_CPU_PAGE 4096
#define ML_CPU_HEADER_BYTES ML_CPU_PAGE
#define ML_CPU_NAME_MAX 64
#define ML_CPU_MSG_MAX 400

/* The unique id: magic, nonce, shm name (NUL-terminated); the rest zero. */
#define ML_CPU_ID_MAGIC 0x3144495550434c4dull /* "MLCPUID1" as little-endian bytes */
typedef struct ml_cpu_id {
  uint64_t magic;
  uint64_t nonce;
  char name[ML_CPU_NAME_MAX];
} ml_cpu_id;

_Static_assert(sizeof(ml_cpu_id) <= MOELINK_UNIQUE_ID_BYTES, "id fits the public id");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free (address-free across processes)");

/* What a rank posted in a staging half, checked by every reader so ranks
 * that call different collectives fail at once instead of mixing data. */
typedef struct ml_cpu_desc {
  uint32_t op;    /* ml_cpu_op */
  uint32_t dtype;
  uint64_t count;
  uint64_t round; /* global round number, a consistency check */
} ml_cpu_desc;

typedef struct ml_cpu_slot {
  _Alignas(ML_CPU_LINE) _Atomic uint64_t ready;   /* rounds whose data is staged */
  _Alignas(ML_CPU_LINE) _Atomic uint64_t done;    /* rounds this rank finished reading */
  _Alignas(ML_CPU_LINE) _Atomic uint64_t barrier; /* barriers reached */
  _Alignas(ML_CPU_LINE) _Atomic int pid;          /* 0 until the rank joined */
  int32_t status;                                 /* exchanged by symm_alloc */
  int32_t err;                                    /* errno with a failed status */
  uint64_t value;
  ml_cpu_desc desc[2];
} ml_cpu_slot;

typedef struct ml_cpu_header {
  _Atomic uint64_t state; /* 0 while rank 0 builds the segment, then the id's nonce */
  uint64_t magic;
  int32_t nranks;
  int32_t pad_;
  uint64_t stage_bytes;
  uint64_t total_bytes;
  _Atomic int joined;      /* ranks that mapped the segment */
  _Atomic int all_joined;  /* set by rank 0 once the name is unlinked */
  _Atomic int abort_claim; /* rank + 1 of the first rank that failed */
  _Atomic int abort_rank;  /* the same, published after the message */
  int32_t abort_status;
  char abort_msg[ML_CPU_MSG_MAX];
} ml_cpu_header;

_Static_assert(sizeof(ml_cpu_header) <= ML_CPU_HEADER_BYTES, "header fits its page");

/* One symmetric allocation: a segment of nranks slices of `stride` bytes. */
typedef struct ml_cpu_symm {
  unsigned char *base;
  size_t stride, bytes, map_bytes;
  struct ml_cpu_symm *next;
} ml_cpu_symm;

typedef struct ml_cpu_comm {
  int rank, nranks;
  int64_t timeout_ms;
  int64_t init_timeout_ms; /* waits for the others at init */
  unsigned char *map;
  size_t map_bytes;
  ml_cpu_header *hdr;
  ml_cpu_slot *slots;
  unsigned char *stage; /* rank r's two halves start at stage + r * 2 * stage_bytes */
  size_t stage_bytes;
  char name[ML_CPU_NAME_MAX];
  uint64_t round;      /* staging rounds this rank started */
  uint64_t barriers;   /* barriers this rank reached */
  uint64_t symm_count; /* symmetric allocations made */
  ml_cpu_symm *symm;
  moelink_status_t err; /* first failure, sticky */
  char err_msg[ML_CPU_MSG_MAX];
} ml_cpu_comm;

typedef enum {
  ML_CPU_OP_ALLREDUCE = 1,
  ML_CPU_OP_ALLGATHER,
  ML_CPU_OP_REDUCE_SCATTER,
  ML_CPU_OP_ALLTOALLV
} ml_cpu_op;

static inline ml_cpu_comm *ml_cpu_of(moelink_comm_t comm) { return (ml_cpu_comm *)comm->impl; }

static inline unsigned char *ml_cpu_stage(ml_cpu_comm *c, int rank, uint64_t round) {
  return c->stage + ((size_t)rank * 2 + (size_t)(round & 1)) * c->stage_bytes;
}

/* ---- sync.c ------------------------------------------------------------- */

/* Milliseconds on the monotonic clock. */
int64_t ml_cpu_now_ms(void);

/* A waiting loop: spin briefly, then yield, then sleep in short naps, so
 * more ranks than cores still make progress. */
typedef struct ml_cpu_backoff {
  int64_t start_ms, last_live_ms;
  unsigned iter;
} ml_cpu_backoff;
void ml_cpu_backoff_init(ml_cpu_backoff *b);
/* One pause; returns the milliseconds waited so far. */
int64_t ml_cpu_backoff_pause(ml_cpu_backoff *b);

/* 1 when the process of `pid` is gone (or a zombie). */
int ml_cpu_pid_dead(int pid);

/* Records the first failure of this rank (sticky), announces it to the
 * other ranks through the header, and returns status with msg as the thread's
 * last error. */
moelink_status_t ml_cpu_fail(ml_cpu_comm *c, moelink_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The failure that stops this communicator: this rank's, or another rank's
 * announced one; MOELINK_SUCCESS when none. Sets the last error. */
moelink_status_t ml_cpu_failed(ml_cpu_comm *c);

/* Waits until *w >= value; the message names `what` and rank `from`. */
moelink_status_t ml_cpu_wait_word(ml_cpu_comm *c, _Atomic uint64_t *w, uint64_t value, int from,
                                  const char *what);

moelink_status_t ml_cpu_barrier_impl(ml_cpu_comm *c, const char *what);

/* ---- collectives.c ------------------------------------------------------ */

/* Staging rounds (the protocol is described at the top of collectives.c);
 * every collective is a sequence of them:
 *   open (wait until this rank's half may be refilled), fill the half,
 *   publish, await peers' halves (checks they run the same call), read,
 *   close. */
typedef struct ml_cpu_call {
  ml_cpu_comm *c;
  ml_cpu_op op;
  moelink_dtype_t dtype;
  size_t count;             /* posted with each round; every rank must post the same */
  const char *data_what;    /* what a rank waits for when it reads a peer's half */
  const char *release_what; /* what it waits for before refilling its own */
} ml_cpu_call;

void ml_cpu_call_init(ml_cpu_call *k, moelink_comm_t comm, ml_cpu_op op, moelink_dtype_t dtype,
                      size_t count);
/* Waits until this rank's half of `round` may be overwritten. */
moelink_status_t ml_cpu_round_open(const ml_cpu_call *k, uint64_t round);
void ml_cpu_round_publish(const ml_cpu_call *k, uint64_t round);
/* Waits for peer p's half of `round` (nothing for p == own rank) and checks
 * it holds the same call (op, dtype, count, round). */
moelink_status_t ml_cpu_round_await(const ml_cpu_call *k, uint64_t round, int p);
moelink_status_t ml_cpu_round_await_all(const ml_cpu_call *k, uint64_t round);
void ml_cpu_round_close(const ml_cpu_call *k, uint64_t round);

moelink_status_t ml_cpu_allreduce(moelink_comm_t comm, const void *send, void *recv,
                                  size_t count, moelink_dtype_t dtype, void *stream);
moelink_status_t ml_cpu_allgather(moelink_comm_t comm, const void *send, void *recv,
                                  size_t count, moelink_dtype_t dtype, void *stream);
moelink_status_t ml_cpu_reduce_scatter(moelink_comm_t comm, const void *send, void *recv,
                                       size_t count, moelink_dtype_t dtype, void *stream);

/* ---- alltoall.c --------------------------------------------------------- */

moelink_status_t ml_cpu_alltoallv(moelink_comm_t comm, const void *send,
                                  const int64_t *send_counts, const int64_t *send_offsets,
                                  void *recv, size_t recv_capacity, int64_t *recv_counts,
                                  int64_t *recv_offsets, moelink_dtype_t dtype, void *stream);

#endif
