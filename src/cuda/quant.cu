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
