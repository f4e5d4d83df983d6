/* The waits of the copy-engine all-gather (allgather_ce.c): one block of 32
 * threads, thread p < nranks watching peer p. Its data and its signals move
 * by copies; only a wait needs a thread, because a wait must be able to give
 * up (moelink_signal_wait's limit and abort word), which cuStreamWaitValue64
 * cannot: a peer that died would leave the stream blocked for good. */
#include "comm/cuda/comm_cuda.h"

typedef struct ml_ce_sync_args {
  moelink_device_comm_t dc;
  const uint64_t *ready;    /* this rank's ready words [source] */
  const uint64_t *released; /* this rank's released words [reader] */
  uint64_t *round;          /* this rank's round counter (device memory) */
} ml_ce_sync_args;

/* open:   round g = ++*round; wait until every peer has released this
 *         rank's region in it (released[p] >= g - 1: p finished copying
 *         out round g - 1).
 * arrive: wait until every peer's data of round g = *round is here
 *         (ready[p] >= g). */
static __global__ void ml_ce_sync_kernel(const __grid_constant__ ml_ce_sync_args a, int arrive) {
  __shared__ uint64_t s_g;
  const int t = (int)threadIdx.x;
  if (t == 0) {
    uint64_t g = *a.round;
    if (!arrive) {
      ++g;
      /* The copies that follow read this word as the signals' value: it
       * must be in memory before the kernel ends (kernel boundary orders it
       * before them). */
      *a.round = g;
    }
    s_g = g;
  }
  __syncthreads();
  const uint64_t g = s_g;
  if (t < a.dc.nranks && t != a.dc.rank) {
    if (arrive)
      (void)moelink_signal_wait(&a.dc, a.ready + t, g, t, ML_CCU_PRIM_AG_CE_READY);
    else if (g > 1)
      (void)moelink_signal_wait(&a.dc, a.released + t, g - 1, t, ML_CCU_PRIM_AG_CE_RELEASE);
  }
}

extern "C" moelink_status_t ml_ccu_ce_sync(const ml_ccu_coll *c, int arrive, cudaStream_t stream) {
  ml_ce_sync_args a;
  a.dc = c->dc;
  a.ready = c->ce.ready[c->rank];
  a.released = c->ce.released[c->rank];
  a.round = c->ce.round;
  ml_ce_sync_kernel<<<1, 32, 0, stream>>>(a, arrive);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "launch of the copy-engine all-gather's %s wait failed: %s",
                   arrive ? "data" : "release", cudaGetErrorString(e));
  return MOELINK_SUCCESS;
}
