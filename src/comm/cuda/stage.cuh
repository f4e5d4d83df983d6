/* The round step of the staging protocol (collectives.cu's header comment
 * describes it), shared by the kernels that run on it (collectives.cu,
 * alltoall.cu). CUDA only. */
#ifndef MOELINK_COMM_CUDA_STAGE_CUH
#define MOELINK_COMM_CUDA_STAGE_CUH

#include "comm/cuda/comm_cuda.h"

/* The signal step of a round of CTA index b: thread p sets peer p's word
 * [b][rank] = e and waits for this rank's word [b][p] >= e. Returns false (in
 * every thread) when a wait gave up. */
static __device__ __forceinline__ bool ml_ccu_exchange(const moelink_device_comm_t *dc,
                                                       uint64_t *const *sig, int b, uint64_t e,
                                                       int prim) {
  const int t = (int)threadIdx.x, n = dc->nranks, r = dc->rank;
  int ok = 1;
  __syncthreads();
  if (t < n && t != r) {
    moelink_signal_set(sig[t] + (size_t)b * ML_CCU_SIG_STRIDE + r, e);
    const uint64_t *w = sig[r] + (size_t)b * ML_CCU_SIG_STRIDE + t;
    if (moelink_signal_load(w) < e) ok = moelink__wait_poll(dc, w, e, t, prim);
  }
  return __syncthreads_and(ok) != 0;
}

#endif
