/* Device pieces of the low-latency exchange (allreduce_ll.cu; also the
 * tensor-parallel GEMM + all-reduce kernel): every 4-byte data word travels
 * with its call's flag in one 8-byte store, so a receiver knows a word has
 * arrived when it sees the flag beside it. Cells: [parity 2][source
 * rank][word], 8 bytes each (ML_CCU_LL_BYTES); call e uses parity e & 1. */
#ifndef MOELINK_COMM_CUDA_LL_CUH
#define MOELINK_COMM_CUDA_LL_CUH

#include "comm/cuda/comm_cuda.h"
#include "core/dtype.cuh"
#include "moelink_device.cuh"

#include <stdint.h>

static __device__ __forceinline__ uint64_t ml_ll_load(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ void ml_ll_store(uint64_t *p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Polls a cell until it carries `flag`. Returns its data word, or 0 with
 * *ok = 0 once the wait gave up (recorded as moelink_signal_wait would). */
static __device__ __noinline__ uint32_t ml_ll_poll(const moelink_device_comm_t *c,
                                                   const uint64_t *cell, uint32_t flag, int from,
                                                   uint64_t value, int *ok) {
  const uint64_t *abort_word = c->ctl[c->rank] + MOELINK_CTL_ABORT;
  const uint64_t start = moelink__now_ns();
  for (uint32_t spin = 1;; ++spin) {
    const uint64_t v = ml_ll_load(cell);
    if ((uint32_t)(v >> 32) == flag) return (uint32_t)v;
    if ((spin & 255) == 0) {
      if (moelink__relaxed_load(abort_word) != 0) {
        moelink__record(c, ML_CCU_PRIM_AR_LL, from, value, 1);
        *ok = 0;
        return 0;
      }
      if (moelink__now_ns() - start > c->timeout_ns) {
        moelink__record(c, ML_CCU_PRIM_AR_LL, from, value, 0);
        for (int r = 0; r < c->nranks; ++r)
          moelink__relaxed_store(c->ctl[r] + MOELINK_CTL_ABORT, (uint64_t)c->rank + 1);
        *ok = 0;
        return 0;
      }
    }
  }
}

/* acc[0..1] += the element(s) of DT in the 4-byte word w (one f32, or two
 * 16-bit values, the lower address first). */
template <int DT> static __device__ __forceinline__ void ml_ll_add(float *acc, uint32_t w) {
  if (DT == MOELINK_DTYPE_F32) {
    acc[0] += __uint_as_float(w);
  } else {
    acc[0] += ml_dt_half_to_f32<DT>(w & 0xffffu);
    acc[1] += ml_dt_half_to_f32<DT>(w >> 16);
  }
}

/* acc[0..1] rounded to DT, packed like ml_ll_add reads them. */
template <int DT> static __device__ __forceinline__ uint32_t ml_ll_pack(const float *acc) {
  if (DT == MOELINK_DTYPE_F32) return __float_as_uint(acc[0]);
  return ml_dt_f32_to_half<DT>(acc[0]) | (ml_dt_f32_to_half<DT>(acc[1]) << 16);
}

#endif
