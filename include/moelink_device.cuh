/*
 * moelink_device.cuh: communication primitives for kernels that talk to the
 * GPUs of the other ranks of a moelink communicator (CUDA backend, NCCL
 * symmetric memory over NVLink).
 *
 * Host side (plain C, this header can be included from C):
 *   moelink_comm_device() fills a moelink_device_comm_t (rank, size, the wait
 *   limit, the control blocks where a wait that gives up records why);
 *   moelink_symm_view() fills a moelink_symm_view_t for one buffer from
 *   moelink_symm_alloc (the address of every rank's copy of it). Both are
 *   plain structs: pass them to kernels by value, ideally as
 *   `const __grid_constant__` parameters so that taking their address
 *   (every primitive takes a pointer) costs no copy.
 *
 * Device side (CUDA only): moelink_peer_ptr, moelink_signal_set/add,
 * moelink_signal_wait, moelink_barrier, moelink_device_failed.
 *
 * Memory-ordering contract
 * ------------------------
 * - moelink_signal_set and moelink_signal_add are release operations at
 *   system scope: every memory write made by the calling thread before them,
 *   and every write of another thread of its block that is ordered before
 *   them by __syncthreads(), is visible to any thread of any rank that has
 *   observed the new signal value through an acquire (moelink_signal_wait).
 *   The usual pattern: all threads store data into a peer's buffer
 *   (moelink_peer_ptr), __syncthreads(), one thread sets the peer's signal.
 * - moelink_signal_wait is an acquire at system scope: once it returns 1,
 *   the calling thread sees everything the signalling rank wrote before its
 *   release. Other threads of the block see it after a __syncthreads() that
 *   follows the wait (moelink_barrier does both).
 * - Signals are 64-bit words in symmetric memory (8-byte aligned), zero when
 *   moelink_symm_alloc returns. Use values that only grow (an epoch that
 *   counts uses, kept in device memory so that CUDA graph replays continue
 *   it); "wait until >= value" then never confuses one use with the next,
 *   and 64 bits never wrap.
 * - Address a rank's own copy of a symmetric buffer only through the
 *   pointer moelink_symm_alloc returned (moelink_peer_ptr with the own rank
 *   gives exactly that pointer back): NCCL also maps the same memory at a
 *   second address, and mixing two addresses of one location on one GPU is
 *   outside the ordering guarantees above.
 * - Reuse of a buffer is the caller's protocol: before writing into a
 *   peer's buffer again, know (from a signal) that the peer has finished
 *   reading what was there.
 *
 * Nothing here spins forever: a wait gives up after the communicator's
 * limit (MOELINK_COMM_TIMEOUT_MS, default 10000), or at once when any rank
 * of the communicator gave up before. It then records (rank, primitive,
 * value awaited, rank awaited) in the rank's control block, tells the other
 * ranks, and returns 0; the kernel should return soon after. On the host,
 * moelink_comm_check() turns the record into MOELINK_ERR_TIMEOUT with that
 * message. A communicator on which a wait gave up is unusable: destroy it.
 */
#ifndef MOELINK_DEVICE_CUH
#define MOELINK_DEVICE_CUH

#include "moelink.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Ranks a device view covers: the GPUs of one NVLink domain (one node). */
#define MOELINK_DEVICE_MAX_RANKS 8

/* Primitive ids recorded when a wait gives up (moelink_comm_check names
 * them). Ids below MOELINK_PRIM_USER are moelink's; kernels may pass
 * MOELINK_PRIM_USER + k to moelink_signal_wait to tell their waits apart. */
#define MOELINK_PRIM_SIGNAL_WAIT 1
#define MOELINK_PRIM_BARRIER 2
#define MOELINK_PRIM_USER 256

/* Words of a control block (one per rank, in symmetric memory). */
#define MOELINK_CTL_INFO 0  /* 0, or the record of the first wait that gave up */
#define MOELINK_CTL_VALUE 1 /* the value that wait awaited */
#define MOELINK_CTL_ABORT 2 /* 0, or 1 + the rank that gave up first (set on every rank) */

/* Layout of MOELINK_CTL_INFO once set. */
#define MOELINK_CTL_INFO_VALID (1ull << 63)
#define MOELINK_CTL_INFO_ABORTED (1ull << 48) /* stopped because another rank gave up */

typedef struct moelink_device_comm {
  int rank;
  int nranks;
  uint64_t timeout_ns; /* MOELINK_COMM_TIMEOUT_MS in nanoseconds */
  /* ctl[r]: rank r's control block as this rank's kernels address it. */
  uint64_t *ctl[MOELINK_DEVICE_MAX_RANKS];
} moelink_device_comm_t;

typedef struct moelink_symm_view {
  /* base[r]: rank r's copy of the buffer as this rank's kernels address it;
   * base[rank] == local. Entries at and past nranks are NULL. */
  char *base[MOELINK_DEVICE_MAX_RANKS];
  char *local; /* the pointer moelink_symm_alloc returned */
  size_t bytes;
} moelink_symm_view_t;

/* Fills *out for comm. Errors: INVALID_ARGUMENT (NULL), UNSUPPORTED (not a
 * communicator of a CUDA context, or its ranks are not all on one NVLink
 * domain of at most MOELINK_DEVICE_MAX_RANKS GPUs). */
MOELINK_API moelink_status_t moelink_comm_device(moelink_comm_t comm, moelink_device_comm_t *out);

/* Fills *out for the symmetric buffer of comm that contains ptr (any address
 * inside a buffer from moelink_symm_alloc). Errors: INVALID_ARGUMENT (NULL,
 * or ptr is in no symmetric buffer of comm), UNSUPPORTED (as above). */
MOELINK_API moelink_status_t moelink_symm_view(moelink_comm_t comm, const void *ptr,
                                               moelink_symm_view_t *out);

#ifdef __cplusplus
}
#endif

#if defined(__CUDACC__)

/* The address of rank `peer`'s copy of ptr, an address inside this rank's
 * copy of v's buffer (v->local .. v->local + v->bytes; not checked). */
static __device__ __forceinline__ void *moelink_peer_ptr(const moelink_symm_view_t *v,
                                                         const void *ptr, int peer) {
  return v->base[peer] + ((const char *)ptr - v->local);
}

/* *signal = value, release at system scope. */
static __device__ __forceinline__ void moelink_signal_set(uint64_t *signal, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(signal), "l"(value) : "memory");
}

/* *signal += value, release at system scope. */
static __device__ __forceinline__ void moelink_signal_add(uint64_t *signal, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(signal), "l"(value) : "memory");
}

/* The current value of a signal, acquire at system scope. */
static __device__ __forceinline__ uint64_t moelink_signal_load(const uint64_t *signal) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(signal) : "memory");
  return v;
}

static __device__ __forceinline__ uint64_t moelink__relaxed_load(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ void moelink__relaxed_store(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ uint64_t moelink__now_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* Whether a wait of this communicator has given up on any rank (seen by
 * this rank so far). Kernels with long loops may poll it to stop early. */
static __device__ __forceinline__ int moelink_device_failed(const moelink_device_comm_t *c) {
  return moelink__relaxed_load(c->ctl[c->rank] + MOELINK_CTL_ABORT) != 0;
}

/* Records the first failure of this rank (later ones keep the first). */
static __device__ __forceinline__ void moelink__record(const moelink_device_comm_t *c, int primitive,
                                                    int from, uint64_t value, int aborted) {
  uint64_t info = MOELINK_CTL_INFO_VALID | (aborted ? MOELINK_CTL_INFO_ABORTED : 0ull) |
                  ((uint64_t)(primitive & 0xffff) << 32) | ((uint64_t)(from & 0xffff) << 16) |
                  (uint64_t)(c->rank & 0xffff);
  uint64_t *own = c->ctl[c->rank];
  if (atomicCAS((unsigned long long *)(own + MOELINK_CTL_INFO), 0ull,
                (unsigned long long)info) == 0ull)
    moelink__relaxed_store(own + MOELINK_CTL_VALUE, value);
}

/* The slow part of a wait: poll with the clock running. */
static __device__ __forceinline__ int moelink__wait_poll(const moelink_device_comm_t *c,
                                                         const uint64_t *signal, uint64_t value,
                                                         int from, int primitive) {
  const uint64_t *abort_word = c->ctl[c->rank] + MOELINK_CTL_ABORT;
  const uint64_t start = moelink__now_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (moelink_signal_load(signal) >= value) return 1;
    if ((spin & 63) == 0) {
      if (moelink__relaxed_load(abort_word) != 0) {
        moelink__record(c, primitive, from, value, 1);
        return 0;
      }
      if (moelink__now_ns() - start > c->timeout_ns) {
        moelink__record(c, primitive, from, value, 0);
        /* Tell every rank (this one included) so that their waits stop now
         * instead of each running into its own limit. */
        for (int r = 0; r < c->nranks; ++r)
          moelink__relaxed_store(c->ctl[r] + MOELINK_CTL_ABORT, (uint64_t)c->rank + 1);
        return 0;
      }
      /* A peer that is late by more than a few microseconds is busy with
       * other work: back off a little to leave memory bandwidth to it. */
      if (spin >= 4096) __nanosleep(128);
    }
  }
}

/* Out of line, so that kernels pay for its registers only when a signal is
 * late (kernels short of registers for the call may use the inline one). */
static __device__ __noinline__ int moelink__wait_slow(const moelink_device_comm_t *c,
                                                      const uint64_t *signal, uint64_t value,
                                                      int from, int primitive) {
  return moelink__wait_poll(c, signal, value, from, primitive);
}

/* Waits until *signal >= value (acquire at system scope). signal is this
 * rank's own word, written by rank `from` (-1 when any rank may write it; it
 * only names the awaited rank in the failure message). Returns 1, or 0 when
 * the wait gave up (see the top of this file). `primitive` is recorded on
 * failure: MOELINK_PRIM_SIGNAL_WAIT or MOELINK_PRIM_USER + k. */
static __device__ __forceinline__ int moelink_signal_wait(const moelink_device_comm_t *c,
                                                          const uint64_t *signal, uint64_t value,
                                                          int from, int primitive) {
  if (moelink_signal_load(signal) >= value) return 1;
  return moelink__wait_slow(c, signal, value, from, primitive);
}

/* A barrier of this thread block with the blocks that call it with the same
 * `slots` on every other rank. slots: this rank's copy (inside v's buffer)
 * of nranks 64-bit words reserved for this barrier and this block; epoch:
 * 1 on the first use of those slots, then 2, 3, ... Needs
 * blockDim.x * blockDim.y * blockDim.z >= nranks and every thread of the
 * block to call it. Orders like a release + acquire on every pair of ranks:
 * writes made by the block before the barrier are visible to the peer
 * blocks after it. Returns 1, or 0 (in every thread) when a wait gave up. */
static __device__ __forceinline__ int moelink_barrier(const moelink_device_comm_t *c,
                                                      const moelink_symm_view_t *v,
                                                      uint64_t *slots, uint64_t epoch) {
  const int t = (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
  int ok = 1;
  __syncthreads();
  if (t < c->nranks && t != c->rank) {
    moelink_signal_set((uint64_t *)moelink_peer_ptr(v, slots + c->rank, t), epoch);
    ok = moelink_signal_wait(c, slots + t, epoch, t, MOELINK_PRIM_BARRIER);
  }
  return __syncthreads_and(ok) != 0;
}

#endif /* __CUDACC__ */

#endif /* MOELINK_DEVICE_CUH */
