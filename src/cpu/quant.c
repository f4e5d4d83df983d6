/* 8-bit token rows on host memory: moelink_quantize / moelink_dequantize,
 * and the round trip dequantize(quantize(x)) that CPU expert-parallel ranks
 * apply to the rows they dispatch (src/ep/cpu/).
 *
 * Every element goes through the scalar definitions of core/fp8.h, which the
 * CUDA kernels share, so both backends write the same bits. Rows are
 * independent and each is done by one thread, block by block in a stack
 * buffer, so the results never depend on the thread count. The round trip
 * runs the very block functions quantize and dequantize run, so it is
 * bitwise dequantize(quantize(x)) without materializing q. */
#include "core/fp8.h"
#include "cpu/cpu.h"

#include <math.h>
#include <string.h>

/* Elements below which a call stays on the calling thread: a team costs more
 * than converting a few rows. */
#define ML_QUANT_PARALLEL_MIN (1 << 15)

/* One block of n fp32 values (n = the format's block) into e4m3 bytes and
 * its scale, written at sc (fp32 for FP8, one e8m0 byte for MXFP8). */
static void ml_quant_block(moelink_quant_t format, const float *v, int n, uint8_t *q,
                           unsigned char *sc) {
  /* amax with every NaN ignored (CUDA's fmaxf). Not the C library's fmaxf:
   * a signaling NaN (from bf16 0x7f81, say) makes glibc's return NaN, which
   * would drop the maximum seen so far. */
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = fabsf(v[i]);
    if (a > amax) amax = a;
  }
  if (format == MOELINK_QUANT_FP8) {
    const float s = ml_fp8_block_scale(amax);
    memcpy(sc, &s, 4);
    for (int i = 0; i < n; ++i) q[i] = ml_fp8_quant(v[i], s);
  } else {
    const uint8_t e = ml_mx_e8m0(amax);
    *sc = e;
    for (int i = 0; i < n; ++i) q[i] = ml_mx_quant(v[i], e);
  }
}

/* The inverse of one block: v[i] = e4m3 value * scale, in fp32. */
static void ml_dequant_block(moelink_quant_t format, const uint8_t *q, const unsigned char *sc,
                             int n, float *v) {
  float s;
  if (format == MOELINK_QUANT_FP8)
    memcpy(&s, sc, 4);
  else
    s = ml_mx_scale(*sc);
  for (int i = 0; i < n; ++i) v[i] = ml_e4m3_to_f32(q[i]) * s;
}

/* The block and the bytes of one block's scale. */
static int ml_quant_shape(moelink_quant_t format, size_t *scale_bytes) {
  *scale_bytes = format == MOELINK_QUANT_FP8 ? 4 : 1;
  return format == MOELINK_QUANT_FP8 ? ML_FP8_BLOCK : ML_MX_BLOCK;
}

static int ml_quant_threads(int nthreads, int rows, int cols) {
  const size_t n = (size_t)rows * (size_t)cols;
  return n < ML_QUANT_PARALLEL_MIN ? 1 : nthreads;
}

/* What ml_quant_walk does to each block. */
enum { ML_Q_QUANT, ML_Q_DEQUANT, ML_Q_QDQ };

/* The rows' blocks in order, each: x -> q + scale (quantize), q + scale ->
 * out (dequantize), or x -> out through both (qdq). */
static void ml_quant_walk(int op, moelink_quant_t format, moelink_dtype_t dtype, const void *x,
                          const uint8_t *q_in, const void *scales_in, uint8_t *q_out,
                          void *scales_out, void *out, int rows, int cols, int nthreads) {
  size_t sb;
  const int B = ml_quant_shape(format, &sb);
  const size_t es = moelink_dtype_size(dtype), nb = (size_t)(cols / B);
#pragma omp parallel for num_threads(ml_quant_threads(nthreads, rows, cols)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    float v[ML_FP8_BLOCK];
    for (size_t b = 0; b < nb; ++b) {
      const size_t at = (size_t)r * (size_t)cols + b * (size_t)B, sat = ((size_t)r * nb + b) * sb;
      if (op == ML_Q_DEQUANT)
        ml_dequant_block(format, q_in + at, (const unsigned char *)scales_in + sat, B, v);
      else
        ml_to_f32(dtype, (const char *)x + at * es, v, (size_t)B);
      if (op == ML_Q_QUANT) {
        ml_quant_block(format, v, B, q_out + at, (unsigned char *)scales_out + sat);
        continue;
      }
      if (op == ML_Q_QDQ) ml_cpu_qdq_f32(format, v, (size_t)B);
      ml_from_f32(dtype, v, (char *)out + at * es, (size_t)B);
    }
  }
}

void ml_cpu_quant_rows(moelink_quant_t format, moelink_dtype_t dtype, const void *x, int rows,
                       int cols, uint8_t *q, void *scales, int nthreads) {
  ml_quant_walk(ML_Q_QUANT, format, dtype, x, NULL, NULL, q, scales, NULL, rows, cols, nthreads);
}

void ml_cpu_dequant_rows(moelink_quant_t format, moelink_dtype_t dtype, const uint8_t *q,
                         const void *scales, int rows, int cols, void *x, int nthreads) {
  ml_quant_walk(ML_Q_DEQUANT, format, dtype, NULL, q, scales, NULL, NULL, x, rows, cols,
                nthreads);
}

void ml_cpu_qdq_f32(moelink_quant_t format, float *x, size_t n) {
  size_t sb;
  const size_t B = (size_t)ml_quant_shape(format, &sb);
  uint8_t q[ML_FP8_BLOCK];
  unsigned char sc[4];
  for (size_t at = 0; at + B <= n; at += B) {
    ml_quant_block(format, x + at, (int)B, q, sc);
    ml_dequant_block(format, q, sc, (int)B, x + at);
  }
}

void ml_cpu_qdq_rows(moelink_quant_t format, moelink_dtype_t dtype, const void *x, int rows,
                     int cols, void *out, int nthreads) {
  ml_quant_walk(ML_Q_QDQ, format, dtype, x, NULL, NULL, NULL, NULL, out, rows, cols, nthreads);
}

moelink_status_t ml_cpu_quantize(moelink_context_t ctx, moelink_quant_t format,
                                 moelink_dtype_t dtype, const void *x, int rows, int cols,
                                 uint8_t *q, void *scales, void *stream) {
  (void)stream;
  ml_cpu_quant_rows(format, dtype, x, rows, cols, q, scales, ctx->num_threads);
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_dequantize(moelink_context_t ctx, moelink_quant_t format,
                                   moelink_dtype_t dtype, const uint8_t *q, const void *scales,
                                   int rows, int cols, void *x, void *stream) {
  (void)stream;
  ml_cpu_dequant_rows(format, dtype, q, scales, rows, cols, x, ctx->num_threads);
  return MOELINK_SUCCESS;
}
