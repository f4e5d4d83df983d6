/* Low-latency all-reduce for small messages (up to ML_CCU_LL_MAX_BYTES):
 * one exchange with no separate signal. Every 4-byte word of data travels
 * with the call's flag in one 8-byte store (the largest store the memory
 * model makes visible all at once), so a receiver knows a word has arrived
 * when it sees the flag beside it: one one-way NVLink trip instead of a
 * push, a signal and its acknowledgement.
 *
 * Buffer (symmetric, one per communicator): [parity 2][source rank][word]
 * 8-byte cells; rank s writes cells [e & 1][s][*] of every peer in call e.
 * Two halves are enough: a rank starts call e + 2 only after it read every
 * peer's words of call e + 1, which each peer sent after it had finished
 * reading call e (the calls of one communicator are stream-ordered on every
 * rank). Flags are the call number (from 1, kept in device memory so that
 * graph replays continue it); a cell holding an older call's flag is simply
 * not ready yet.
 *
 * The sum is fp32 over ranks in rank order 0..n-1, rounded once, as in the
 * other all-reduce algorithms: every rank gets bitwise the same result. */
#include "comm/cuda/comm_cuda.h"
#include "comm/cuda/ll.cuh"
#include "core/dtype.cuh"
#include "core/launch.cuh"

#include <string.h>

#define ML_LL_THREADS 512

typedef struct ml_ll_args {
  const char *send;
  char *recv;
  size_t count;  /* elements */
  size_t words;  /* 4-byte data words: ceil(count * es / 4) */
  size_t per_cta;
  uint64_t *cells[ML_CCU_MAX_RANKS]; /* each rank's LL buffer */
  size_t par_cells;                  /* cells of one parity half: nranks * max_words */
  uint64_t *epoch;                   /* this rank's call count (device memory) */
  unsigned *ticket;                  /* zero between calls */
  moelink_device_comm_t dc;
} ml_ll_args;

/* The 4-byte data word w of src (bytes past the end read as zero). */
static __device__ __forceinline__ uint32_t ml_ll_word(const char *src, size_t bytes, size_t w) {
  const size_t off = w * 4;
  if (off + 4 <= bytes && (((uintptr_t)src + off) & 3) == 0)
    return *(const uint32_t *)(src + off);
  uint32_t v = 0;
  for (int b = 0; b < 4 && off + b < bytes; ++b) v |= (uint32_t)(uint8_t)src[off + b] << (8 * b);
  return v;
}

static __device__ __forceinline__ void ml_ll_put(char *dst, size_t bytes, size_t w, uint32_t v) {
  const size_t off = w * 4;
  if (off + 4 <= bytes && (((uintptr_t)dst + off) & 3) == 0) {
    *(uint32_t *)(dst + off) = v;
    return;
  }
  for (int b = 0; b < 4 && off + b < bytes; ++b) dst[off + b] = (char)(v >> (8 * b));
}

template <int DT>
__global__ void __launch_bounds__(ML_LL_THREADS)
    ml_ll_kernel(const __grid_constant__ ml_ll_args a) {
  const int me = a.dc.rank, n = a.dc.nranks;
  /* Launched early (ml_ccu_ll.pdl): nothing of the previous kernel's output,
   * the call count included, is read before it is complete. A no-op otherwise. */
  asm volatile("griddepcontrol.wait;" ::: "memory");
  /* One call number for all CTAs: the last CTA to finish stores it, after
   * every CTA has read the old one. */
  const uint64_t e = *(volatile uint64_t *)a.epoch + 1;
  const uint32_t flag = (uint32_t)e;
  const size_t es = DT == MOELINK_DTYPE_F32 ? 4 : 2;
  const size_t bytes = a.count * es;
  const size_t w0 = (size_t)blockIdx.x * a.per_cta;
  const size_t w1 = w0 + a.per_cta < a.words ? w0 + a.per_cta : a.words;
  const size_t half = (size_t)(e & 1) * a.par_cells;
  const size_t row = a.par_cells / (size_t)n; /* cells of one source */

  /* Push: this rank's words, tagged, into every peer's cells. */
  for (size_t w = w0 + threadIdx.x; w < w1; w += blockDim.x) {
    const uint64_t v = ((uint64_t)flag << 32) | ml_ll_word(a.send, bytes, w);
    for (int i = 1; i < n; ++i) {
      const int p = (me + i) % n;
      ml_ll_store(a.cells[p] + half + (size_t)me * row + w, v);
    }
  }
  /* Sum in rank order as the words arrive. */
  int ok = 1;
  for (size_t w = w0 + threadIdx.x; w < w1 && ok; w += blockDim.x) {
    float acc[2] = {0.f, 0.f};
    for (int s = 0; s < n && ok; ++s) {
      const uint32_t d = s == me ? ml_ll_word(a.send, bytes, w)
                                 : ml_ll_poll(&a.dc, a.cells[me] + half + (size_t)s * row + w,
                                              flag, s, e, &ok);
      ml_ll_add<DT>(acc, d);
    }
    ml_ll_put(a.recv, bytes, w, ml_ll_pack<DT>(acc));
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(a.ticket, 1u) == gridDim.x - 1) {
    *a.ticket = 0;
    *(volatile uint64_t *)a.epoch = e;
  }
}

extern "C" moelink_status_t ml_ccu_allreduce_ll(const ml_ccu_ll *ll, int rank, int nranks,
                                                const moelink_device_comm_t *dc,
                                                const void *send, void *recv, size_t count,
                                                moelink_dtype_t dt, cudaStream_t stream) {
  const size_t es = moelink_dtype_size(dt);
  ml_ll_args a;
  memset(&a, 0, sizeof a);
  a.send = (const char *)send;
  a.recv = (char *)recv;
  a.count = count;
  a.words = (count * es + 3) / 4;
  if (a.words > ll->max_words)
    return ml_fail(MOELINK_ERR_INTERNAL, "low-latency all-reduce of %zu bytes (max %zu)",
                   count * es, ll->max_words * 4);
  /* One CTA per 2 KiB of data (a word or two per thread), at most
   * ll->max_ctas: fewer CTAs keep the tiny cases to one CTA. */
  size_t ctas = (a.words + 511) / 512;
  if (ctas < 1) ctas = 1;
  if (ctas > (size_t)ll->max_ctas) ctas = (size_t)ll->max_ctas;
  a.per_cta = (a.words + ctas - 1) / ctas;
  for (int p = 0; p < nranks; ++p) a.cells[p] = ll->cells[p];
  a.par_cells = (size_t)nranks * ll->max_words;
  a.epoch = ll->epoch;
  a.ticket = ll->ticket;
  a.dc = *dc;
  (void)rank;
  const unsigned grid = (unsigned)ctas;
  unsigned threads = (unsigned)((a.per_cta + 31) / 32 * 32);
  if (threads > ML_LL_THREADS) threads = ML_LL_THREADS;
  void (*kernel)(ml_ll_args) = dt == MOELINK_DTYPE_F32    ? ml_ll_kernel<MOELINK_DTYPE_F32>
                               : dt == MOELINK_DTYPE_BF16 ? ml_ll_kernel<MOELINK_DTYPE_BF16>
                                                          : ml_ll_kernel<MOELINK_DTYPE_F16>;
  void *args[] = {&a};
  cudaError_t err =
      ml_launch_kernel((const void *)kernel, dim3(grid), dim3(threads), 0, ll->pdl, stream, args);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "launch of the low-latency all-reduce (%u CTAs) failed: %s",
                   grid, cudaGetErrorString(err));
  return MOELINK_SUCCESS;
}
