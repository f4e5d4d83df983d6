/* Combine: CTA (t, s) owns token t's columns of part s (a small batch is
 * split along H so that it still fills the GPU), each thread 8-element
 * (16-byte) chunks. A thread adds the token's k expert rows in slot order,
 * then the (gated) shared expert, all in fp32, and rounds once: every output
 * element has one fixed summation order, so the result is bitwise
 * reproducible. The k row numbers are read once per CTA, and a thread's loads
 * of up to 8 slots are issued together before their adds: at decode sizes
 * the kernel is a chain of memory latencies, not of bandwidth.
 *
 * The shared expert's gate sigmoid(x . w_g) is computed here too, by each
 * CTA of the token, with a fixed-shape tree reduction; it saves a launch and
 * a [T] buffer.
 *
 * Where the stream allows it the kernel is launched as a programmatic
 * dependent of the previous one (the expert GEMMs let it launch once they
 * have all started) and waits for it before touching memory: its launch
 * latency hides behind their tail. */
#include "core/dtype.cuh"
#include "core/launch.cuh"
#include "cuda/combine.cuh"
#include "cuda/pipeline.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#define ML_C_THREADS 128

typedef struct ml_combine_params {
  const void *y;
  const int32_t *pair_rows;
  const float *shared_out;
  const void *x;
  const void *shared_gate;
  void *out;
  int k, H;
} ml_combine_params;

template <int DT>
static __global__ void __launch_bounds__(ML_C_THREADS) ml_combine_kernel(const ml_combine_params p) {
  const int t = (int)blockIdx.x, tid = (int)threadIdx.x;
  const int chunks = p.H / 8;
  /* a no-op unless launched as a programmatic dependent */
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int per = (chunks + (int)gridDim.y - 1) / (int)gridDim.y;
  const int q0 = (int)blockIdx.y * per, q1 = q0 + per < chunks ? q0 + per : chunks;
  __shared__ int s_rows[ML_CUDA_MAX_TOPK];
  if (tid < p.k) s_rows[tid] = __ldg(p.pair_rows + (size_t)t * p.k + tid);
  float gate = 1.0f;
  if (p.shared_gate != NULL) {
    __shared__ float red[ML_C_THREADS];
    const uint4 *xr = (const uint4 *)((const char *)p.x + (size_t)t * p.H * 2);
    const uint4 *gr = (const uint4 *)p.shared_gate;
    float part = 0.0f;
    for (int q = tid; q < chunks; q += ML_C_THREADS) {
      float xv[8], gv[8];
      ml_dt_unpack16<DT>(__ldg(xr + q), xv);
      ml_dt_unpack16<DT>(__ldg(gr + q), gv);
#pragma unroll
      for (int i = 0; i < 8; ++i) part += xv[i] * gv[i];
    }
    red[tid] = part;
    __syncthreads();
#pragma unroll
    for (int s = ML_C_THREADS / 2; s > 0; s >>= 1) {
      if (tid < s) red[tid] += red[tid + s];
      __syncthreads();
    }
    gate = 1.0f / (1.0f + expf(-red[0]));
  }

  __syncthreads(); /* s_rows */
  const uint4 *y = (const uint4 *)p.y;
  const size_t row_chunks = (size_t)chunks;
  for (int q = q0 + tid; q < q1; q += ML_C_THREADS) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    ml_combine_slots<DT, 0>(y, s_rows, p.k, row_chunks, q, acc);
    if (p.shared_out != NULL) {
      const float4 *s = (const float4 *)(p.shared_out + (size_t)t * p.H) + 2 * q;
      const float4 a = __ldg(s), b = __ldg(s + 1);
      const float sv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += gate * sv[i];
    }
    ((uint4 *)p.out)[(size_t)t * row_chunks + q] = ml_dt_pack16<DT>(acc);
  }
}

extern "C" moelink_status_t ml_cuda_combine(moelink_dtype_t dt, const void *y,
                                            const int32_t *pair_rows, int num_tokens, int top_k,
                                            int hidden, const float *shared_out, const void *x,
                                            const void *shared_gate, void *out,
                                            cudaStream_t stream) {
  if (num_tokens <= 0) return MOELINK_SUCCESS;
  if (dt != MOELINK_DTYPE_BF16 && dt != MOELINK_DTYPE_F16)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "combine: dtype %s not supported (bf16 or f16)",
                   moelink_dtype_name(dt));
  if (hidden % 8 != 0 || top_k < 1 || top_k > ML_CUDA_MAX_TOPK)
    return ml_fail(MOELINK_ERR_INTERNAL, "combine: H %d, k %d out of range", hidden, top_k);
  if (shared_gate != NULL && (x == NULL || shared_out == NULL))
    return ml_fail(MOELINK_ERR_INTERNAL, "combine: a shared gate without x or shared output");
  if (ml_cuda_misaligned(y) || ml_cuda_misaligned(out) || ml_cuda_misaligned(shared_out) ||
      ml_cuda_misaligned(x) || ml_cuda_misaligned(shared_gate))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "combine: y %p, out %p, x %p, shared gate %p must be 16-byte aligned", y, out,
                   x, shared_gate);
  ml_combine_params p;
  p.y = y;
  p.pair_rows = pair_rows;
  p.shared_out = shared_out;
  p.x = x;
  p.shared_gate = shared_gate;
  p.out = out;
  p.k = top_k;
  p.H = hidden;
  /* Parts along H: about 256 CTAs in all (two per SM), one chunk a thread at
   * most, none for a batch that fills the GPU by itself. */
  const int chunks = hidden / 8;
  int parts = 256 / num_tokens;
  const int most = (chunks + ML_C_THREADS - 1) / ML_C_THREADS;
  if (parts > most) parts = most;
  if (parts < 1) parts = 1;
  void (*kernel)(const ml_combine_params) = dt == MOELINK_DTYPE_BF16
                                                ? ml_combine_kernel<MOELINK_DTYPE_BF16>
                                                : ml_combine_kernel<MOELINK_DTYPE_F16>;
  void *args[] = {&p};
  const cudaError_t e =
      ml_launch_kernel((const void *)kernel, dim3((unsigned)num_tokens, (unsigned)parts, 1),
                       dim3(ML_C_THREADS, 1, 1), 0, ml_cuda_pdl_allowed(stream), stream, args);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ml_fail(MOELINK_ERR_CUDA, "launch of the combine kernel (%d x %d CTAs) failed: %s",
                   num_tokens, parts, cudaGetErrorString(e));
  }
  return MOELINK_SUCCESS;
}
