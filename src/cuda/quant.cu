/* moelink_quantize / moelink_dequantize on the device (formats in
 * include/moelink.h, scalars in src/core/fp8.h, lane helpers in quant.cuh):
 * work item (row, group of 256 elements), one warp each, 8 elements a lane. */
#include "cuda/pipeline.h"
#include "cuda/quant.cuh"

#define ML_QK_THREADS 256
#define ML_QK_GROUP 256 /* elements a warp item covers */

template <int DT, int FMT>
static __global__ void __launch_bounds__(ML_QK_THREADS, 8)
    ml_quantize_kernel(const char *x, int rows, int cols, uint8_t *q, char *scales,
                       size_t scale_row) {
  /* A kernel launched after this one with programmatic stream serialization
   * (the FP8 layer's decode GEMMs) may start now and stream its weights: it
   * reads q and the scales only after its grid dependency wait, which waits
   * for this whole grid. */
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int lane = (int)threadIdx.x & 31;
  const int groups = (cols + ML_QK_GROUP - 1) / ML_QK_GROUP;
  const long long items = (long long)rows * groups;
  const int wpb = (int)blockDim.x >> 5;
  const size_t es = DT == MOELINK_DTYPE_F32 ? 4 : 2;
  for (long long i = (long long)blockIdx.x * wpb + ((int)threadIdx.x >> 5); i < items;
       i += (long long)gridDim.x * wpb) {
    const int r = (int)(i / groups), col = (int)(i % groups) * ML_QK_GROUP + lane * 8;
    const int live = col < cols;
    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (live) ml_q_load8<DT>(x + ((size_t)r * cols + col) * es, f);
    const uint2 b =
        ml_q_quantize8<FMT>(f, col, live, scales + (size_t)r * scale_row, lane);
    if (live) *(uint2 *)(q + (size_t)r * cols + col) = b;
  }
}

template <int DT, int FMT>
static __global__ void __launch_bounds__(ML_QK_THREADS)
    ml_dequantize_kernel(const uint8_t *q, const char *scales, size_t scale_row, int rows,
                         int cols, char *x) {
  const size_t es = DT == MOELINK_DTYPE_F32 ? 4 : 2;
  const long long items = (long long)rows * (cols / 8);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < items;
       i += (long long)gridDim.x * blockDim.x) {
    const int r = (int)(i / (cols / 8)), col = (int)(i % (cols / 8)) * 8;
    float f[8];
    ml_q_unpack8(__ldg((const uint2 *)(q + (size_t)r * cols + col)),
                 ml_q_scale_at<FMT>(scales + (size_t)r * scale_row, col), f);
    ml_q_store8<DT>(x + ((size_t)r * cols + col) * es, f);
  }
}

/* Blocks for items (per a block each pass): up to 8 a SM, a full SM of
 * 256-thread blocks, so enough loads are in flight to stream at the memory's
 * rate (each warp has one item's 0.5-1 KiB in flight at a time). */
static unsigned ml_qk_grid(long long items, int per, int sms) {
  const long long want = (items + per - 1) / per, most = 8LL * (sms > 0 ? sms : 1);
  return (unsigned)(want < 1 ? 1 : want < most ? want : most);
}

extern "C" moelink_status_t ml_cuda_quantize(moelink_quant_t format, moelink_dtype_t dtype,
                                             const void *x, int rows, int cols, uint8_t *q,
                                             void *scales, int sms, cudaStream_t stream) {
  const size_t srow = moelink_quant_scale_bytes(format, cols);
  const int groups = (cols + ML_QK_GROUP - 1) / ML_QK_GROUP;
  const unsigned grid = ml_qk_grid((long long)rows * groups, ML_QK_THREADS / 32, sms);
  const char *xs = (const char *)x;
  char *sc = (char *)scales;
#define ML_QK_Q(DT)                                                                        \
  if (format == MOELINK_QUANT_FP8)                                                         \
    ml_quantize_kernel<DT, MOELINK_QUANT_FP8>                                              \
        <<<grid, ML_QK_THREADS, 0, stream>>>(xs, rows, cols, q, sc, srow);                 \
  else                                                                                     \
    ml_quantize_kernel<DT, MOELINK_QUANT_MXFP8>                                            \
        <<<grid, ML_QK_THREADS, 0, stream>>>(xs, rows, cols, q, sc, srow)
  if (dtype == MOELINK_DTYPE_F32)
    ML_QK_Q(MOELINK_DTYPE_F32);
  else if (dtype == MOELINK_DTYPE_BF16)
    ML_QK_Q(MOELINK_DTYPE_BF16);
  else
    ML_QK_Q(MOELINK_DTYPE_F16);
#undef ML_QK_Q
  ML_CUDA_LAUNCHED("ml_quantize_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_cuda_dequantize(moelink_quant_t format, moelink_dtype_t dtype,
                                               const uint8_t *q, const void *scales, int rows,
                                               int cols, void *x, int sms, cudaStream_t stream) {
  const size_t srow = moelink_quant_scale_bytes(format, cols);
  const unsigned grid = ml_qk_grid((long long)rows * (cols / 8), ML_QK_THREADS, sms);
  const char *sc = (const char *)scales;
  char *xd = (char *)x;
#define ML_QK_D(DT)                                                                        \
  if (format == MOELINK_QUANT_FP8)                                                         \
    ml_dequantize_kernel<DT, MOELINK_QUANT_FP8>                                            \
        <<<grid, ML_QK_THREADS, 0, stream>>>(q, sc, srow, rows, cols, xd);                 \
  else                                                                                     \
    ml_dequantize_kernel<DT, MOELINK_QUANT_MXFP8>                                          \
        <<<grid, ML_QK_THREADS, 0, stream>>>(q, sc, srow, rows, cols, xd)
  if (dtype == MOELINK_DTYPE_F32)
    ML_QK_D(MOELINK_DTYPE_F32);
  else if (dtype == MOELINK_DTYPE_BF16)
    ML_QK_D(MOELINK_DTYPE_BF16);
  else
    ML_QK_D(MOELINK_DTYPE_F16);
#undef ML_QK_D
  ML_CUDA_LAUNCHED("ml_dequantize_kernel");
  return MOELINK_SUCCESS;
}

/* ---- ml_cuda_q_div_check: the cheap FP8 division against x / s ----------------- */

static __device__ __forceinline__ uint64_t ml_qd_mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Pair i: a block amax with a random exponent in [-70, 70) and mantissa, its
 * scale s = amax / 448 (as quantization makes it), and an x of that block:
 * in a quarter of the pairs the value that lands within a few ulp of the
 * midpoint between two e4m3 values (the quotients where one ulp changes the
 * byte), else random bits of magnitude below amax (exponents down to 2^-100
 * under it, denormals and zeros of both signs included), and now and then
 * NaN or x = +-amax. Counts (atomically into bad[0..1]) the pairs whose e4m3
 * bytes differ and those with |x| >= 2^-80 whose fp32 quotients differ. */
static __global__ void ml_qd_check_kernel(uint64_t seed, long long n, unsigned long long *bad) {
  unsigned long long b0 = 0, b1 = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const uint64_t h = ml_qd_mix(seed ^ ml_qd_mix((uint64_t)i)), g = ml_qd_mix(h);
    const int ea = (int)(h % 140) - 70;
    const float amax = ldexpf(1.0f + (float)(h >> 40 & 0x7fffff) * 0x1p-23f, ea);
    const float s = ml_fp8_block_scale(amax);
    float x;
    const int kind = (int)(g & 15);
    if (kind < 4) {
      /* an e4m3 midpoint m (codes 1..125: between code c and c + 1), times s,
       * nudged by -3..3 ulp */
      const int c = 1 + (int)((g >> 8) % 125);
      const float lo = ml_e4m3_to_f32((uint8_t)c), hi = ml_e4m3_to_f32((uint8_t)(c + 1));
      float v = (0.5f * (lo + hi)) * s;
      const int nudge = (int)((g >> 20) % 7) - 3;
      uint32_t u = __float_as_uint(v);
      u = (uint32_t)((int)u + nudge);
      x = __uint_as_float(u);
      if (g & 0x10000000000ull)
        x = -x;
    } else if (kind == 4) {
      x = (g & 32) ? __uint_as_float(0x7fc00000u | (uint32_t)(g >> 40 & 0xffff)) : amax;
      if (g & 64)
        x = -x;
    } else if (kind == 5) {
      x = (g & 32) ? 0.0f : __uint_as_float((uint32_t)(g >> 40) & 0x7fffffu); /* denormal */
      if (g & 64)
        x = -x;
    } else {
      const int ex = (int)((g >> 8) % 101); /* 2^-100 .. 1 times amax */
      x = ldexpf(1.0f + (float)(g >> 24 & 0x7fffff) * 0x1p-23f, -ex) * amax;
      if (fabsf(x) > amax)
        x = amax;
      if (g & 0x10000000000ull)
        x = -x;
    }
    const float want = ml_q_fp8_scaled(x, s);
    const float got = ml_q_fp8_scaled_by(x, ml_q_div_of(s));
    const uint32_t w2 = ml_q_cvt2(want, want), g2 = ml_q_cvt2(got, got);
    if (w2 != g2)
      ++b0;
    if (fabsf(x) >= 0x1p-80f && !isnan(x) && __float_as_uint(want) != __float_as_uint(got))
      ++b1;
  }
  if (b0)
    atomicAdd(bad, b0);
  if (b1)
    atomicAdd(bad + 1, b1);
}

extern "C" moelink_status_t ml_cuda_q_div_check(uint64_t seed, long long n,
                                                unsigned long long *byte_mismatches,
                                                unsigned long long *bit_mismatches) {
  unsigned long long *d = NULL, h[2] = {0, 0};
  cudaError_t e = cudaMalloc((void **)&d, sizeof h);
  if (e == cudaSuccess)
    e = cudaMemset(d, 0, sizeof h);
  if (e == cudaSuccess) {
    ml_qd_check_kernel<<<1024, 256>>>(seed, n, d);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess)
    e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  if (d)
    (void)cudaFree(d);
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "ml_cuda_q_div_check: %s", cudaGetErrorString(e));
  *byte_mismatches = h[0];
  *bit_mismatches = h[1];
  return MOELINK_SUCCESS;
}
