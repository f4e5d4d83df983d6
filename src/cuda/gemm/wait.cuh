/* The device side of ml_cuda_gemm_wait (cuda/cuda.h): a GEMM's wait for
 * problem rows that arrive while it runs, shared by the sm_90a and tile
 * engines. */
#ifndef MOELINK_CUDA_GEMM_WAIT_CUH
#define MOELINK_CUDA_GEMM_WAIT_CUH

#include "cuda/cuda.h"
#include "moelink_device.cuh"

#include <stdint.h>

/* Thread t of n waiting threads (0 <= t < n) waits for its share of the
 * chunks that problem rows [r0, r1) touch; the caller then synchronizes
 * the threads that read the rows with the waiting ones (a barrier after
 * the acquire makes the rows visible to all of them). A wait that gives up
 * is recorded in w->comm's control block; the rows are then read as they
 * are. */
static __device__ __forceinline__ void ml_gemm_wait_rows(const ml_cuda_gemm_wait *w, int r0, int r1,
                                                         int t, int n) {
  if (r1 <= r0)
    return;
  const int c1 = (r1 - 1) / w->rows;
  int c = r0 / w->rows + t;
  if (c > c1)
    return;
  uint64_t value;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(w->value) : "memory");
  /* (the out-of-line slow path: the inline poll's registers spill the FP8
   * producer's, which has few) */
  for (; c <= c1; c += n)
    moelink_signal_wait(&w->comm, w->signal + c, value, -1, ML_CUDA_PRIM_GEMM_ROWS);
}

/* An index entry that may have been written while the kernel runs (after
 * the wait above): a coherent load, not the read-only cache's. */
static __device__ __forceinline__ int32_t ml_gemm_ld_index(const int32_t *p) {
  int32_t v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

#endif /* MOELINK_CUDA_GEMM_WAIT_CUH */
