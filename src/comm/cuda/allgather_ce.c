/* All-gather on the copy engines: the data crosses NVLink by DMA copies, no
 * SM moves a byte of it (the waits are a one-block kernel, see
 * allgather_ce_sync.cu).
 *
 * Each rank owns a CE buffer (symmetric, made when the engine is selected):
 * ready and released signal words, then one staging region per source rank.
 * A call moves its block in rounds of at most one region; round g (counted
 * in device memory across calls, so CUDA graph replays continue it):
 *   open     ++round; wait until every peer p released round g - 1
 *            (p's released word [this rank] >= g - 1)
 *   push     copy this rank's piece into region [this rank] of every peer
 *   signal   copy the round number into every peer's ready word [this rank]
 *   arrive   wait until every peer's ready word here >= g
 *   pull     copy region [p] of this rank's staging to recv, for every peer
 *   release  copy the round number into every peer's released word [this rank]
 * A region has one writer and one buffer: a rank pushes round g into p only
 * after p finished copying out round g - 1, which is what "open" waits for.
 * Signal words only grow, so nothing is ever reset, and a stream-ordered copy
 * of a signal starts only after the data copies before it completed (NCCL's
 * copy-engine collectives rely on the same order).
 *
 * The copies go out as one cudaMemcpyBatchAsync per step (the copies of a
 * batch may run at the same time, and the batch asks the driver to keep
 * local copies off the SMs); while a stream is being captured, where batches
 * are not supported, as plain cudaMemcpyAsync calls. The own block goes
 * straight from send to recv. */
#include "comm/cuda/comm_cuda.h"

#include <string.h>

static moelink_status_t ml_ce_copies(void *const *dst, const void *const *src, const size_t *size,
                                     size_t n, cudaStream_t stream, const char *what) {
  if (n == 0) return MOELINK_SUCCESS;
  cudaError_t e = cudaSuccess;
  int batch = 0;
#if CUDART_VERSION >= 13000
  if (stream) {
    enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    e = cudaStreamIsCapturing(stream, &cap);
    /* Batches refuse the legacy default stream (NULL) and capture. */
    batch = e == cudaSuccess && cap == cudaStreamCaptureStatusNone;
  }
  if (batch) {
    struct cudaMemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
    e = cudaMemcpyBatchAsync((void *const *)dst, (const void *const *)src, size, n, &attr, &first,
                             1, stream);
  }
#endif
  for (size_t i = 0; !batch && e == cudaSuccess && i < n; ++i)
    e = cudaMemcpyAsync(dst[i], src[i], size[i], cudaMemcpyDeviceToDevice, stream);
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "copy-engine all-gather: %s (%zu copies) failed: %s", what,
                   n, cudaGetErrorString(e));
  return MOELINK_SUCCESS;
}

moelink_status_t ml_ccu_allgather_ce(const ml_ccu_coll *c, const void *send, void *recv,
                                     size_t bytes, cudaStream_t stream) {
  const int n = c->nranks, r = c->rank;
  const ml_ccu_ce *ce = &c->ce;
  const char *in = (const char *)send;
  char *out = (char *)recv;
  void *dst[ML_CCU_MAX_RANKS];
  const void *src[ML_CCU_MAX_RANKS];
  size_t len[ML_CCU_MAX_RANKS];

  dst[0] = out + (size_t)r * bytes;
  src[0] = in;
  len[0] = bytes;
  ML_TRY(ml_ce_copies(dst, src, len, 1, stream, "the own block"));
  if (n == 1) return MOELINK_SUCCESS;
  if (!ce->round || ce->region == 0)
    return ml_fail(MOELINK_ERR_INTERNAL, "copy-engine all-gather selected without its buffer");

  for (size_t off = 0; off < bytes; off += ce->region) {
    const size_t m = bytes - off < ce->region ? bytes - off : ce->region;
    size_t k;
    ML_TRY(ml_ccu_ce_sync(c, 0, stream));
    k = 0;
    for (int i = 1; i < n; ++i, ++k) {
      const int p = (r + i) % n;
      dst[k] = ce->stage[p] + (size_t)r * ce->region;
      src[k] = in + off;
      len[k] = m;
    }
    ML_TRY(ml_ce_copies(dst, src, len, k, stream, "the push to the peers"));
    k = 0;
    for (int i = 1; i < n; ++i, ++k) {
      const int p = (r + i) % n;
      dst[k] = ce->ready[p] + r;
      src[k] = ce->round;
      len[k] = sizeof(uint64_t);
    }
    ML_TRY(ml_ce_copies(dst, src, len, k, stream, "the ready signals"));
    ML_TRY(ml_ccu_ce_sync(c, 1, stream));
    k = 0;
    for (int i = 1; i < n; ++i, ++k) {
      const int s = (r + i) % n;
      dst[k] = out + (size_t)s * bytes + off;
      src[k] = ce->stage[r] + (size_t)s * ce->region;
      len[k] = m;
    }
    ML_TRY(ml_ce_copies(dst, src, len, k, stream, "the copy out of the staging"));
    k = 0;
    for (int i = 1; i < n; ++i, ++k) {
      const int p = (r + i) % n;
      dst[k] = ce->released[p] + r;
      src[k] = ce->round;
      len[k] = sizeof(uint64_t);
    }
    ML_TRY(ml_ce_copies(dst, src, len, k, stream, "the release signals"));
  }
  return MOELINK_SUCCESS;
}
