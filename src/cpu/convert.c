/* Weight blocks as fp32 for the GEMMs, the GEMM call itself, and the SIMD
 * detection of the CPU backend. F32 weights are used where they lie; bf16/f16
 * weights bound for BLAS (blocks of many token rows, or a CPU without the
 * small-M kernel's instructions) are converted one block of rows at a time
 * into a per-thread buffer that stays in cache while BLAS packs it; FP8
 * expert weights are dequantized into that buffer the same way. */
#include "core/fp8.h"
#include "cpu/cpu.h"

#include <cblas.h>
#include <math.h>

/* Up to this many token rows the weights go in as BLAS's first operand and
 * the product comes out transposed: BLAS then holds the tokens in its
 * register tile and streams each weight through it once, which measured
 * faster with few tokens than the other orientation. */
#define ML_CPU_FEW_ROWS 48

static int ml_simd_cap = -1;

void ml_cpu_simd_limit(int mask) { __atomic_store_n(&ml_simd_cap, mask, __ATOMIC_RELAXED); }

#ifdef ML_CPU_X86
#include <cpuid.h>
#include <immintrin.h>

/* AVX2 (which the builtin also checks the OS enables), F16C and FMA, the last
 * two read from CPUID directly since not every compiler's builtin knows
 * "f16c". */
int ml_cpu_simd(void) {
  static int cached = -1;
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v < 0) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __builtin_cpu_init();
    v = 0;
    if (__builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C)) {
      v = ML_CPU_SIMD_AVX2;
      if (c & bit_FMA) v |= ML_CPU_SIMD_FMA;
    }
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  }
  return v & __atomic_load_n(&ml_simd_cap, __ATOMIC_RELAXED);
}

static int ml_cpu_has_simd(void) { return ml_cpu_simd() & ML_CPU_SIMD_AVX2; }

/* Both conversions are exact, so this matches ml_to_f32 bit for bit (a
 * signaling f16 NaN comes out quiet, still a NaN). */
__attribute__((target("avx2,f16c"))) static void ml_bf16_to_f32_simd(const uint16_t *src,
                                                                    float *dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  if (i < n) ml_to_f32(MOELINK_DTYPE_BF16, src + i, dst + i, n - i);
}

__attribute__((target("avx2,f16c"))) static void ml_f16_to_f32_simd(const uint16_t *src,
                                                                   float *dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
  if (i < n) ml_to_f32(MOELINK_DTYPE_F16, src + i, dst + i, n - i);
}
#endif

void ml_cpu_to_f32(moelink_dtype_t dtype, const void *src, float *dst, size_t n) {
#ifdef ML_CPU_X86
  if (dtype == MOELINK_DTYPE_BF16 && ml_cpu_has_simd()) {
    ml_bf16_to_f32_simd((const uint16_t *)src, dst, n);
    return;
  }
  if (dtype == MOELINK_DTYPE_F16 && ml_cpu_has_simd()) {
    ml_f16_to_f32_simd((const uint16_t *)src, dst, n);
    return;
  }
#endif
  ml_to_f32(dtype, src, dst, n);
}

#ifndef ML_CPU_X86
int ml_cpu_simd(void) { return 0; }
#endif

const float *ml_cpu_weight_rows(moelink_dtype_t dtype, const void *w, size_t row0, int rows,
                                int cols, float *conv) {
  const size_t first = row0 * (size_t)cols;
  if (dtype == MOELINK_DTYPE_F32) return (const float *)w + first;
  ml_cpu_to_f32(dtype, (const char *)w + first * moelink_dtype_size(dtype), conv,
                (size_t)rows * (size_t)cols);
  return conv;
}

const float *ml_cpu_fp8_weight_rows(const uint8_t *w, const float *scale, size_t row0, int rows,
                                    int cols, float *conv) {
  /* 256 codes: without the SIMD, decoding through a table keeps the
   * per-element cost at one load and one multiply. */
  const int simd = ml_cpu_fp8_simd();
  float lut[256];
  if (!simd)
    for (int b = 0; b < 256; ++b) lut[b] = ml_e4m3_to_f32((uint8_t)b);
  const size_t nb = (size_t)cols / ML_FP8_BLOCK;
  for (int r = 0; r < rows; ++r) {
    const size_t n = row0 + (size_t)r;
    const uint8_t *src = w + n * (size_t)cols;
    const float *sr = scale + (n / ML_FP8_BLOCK) * nb;
    float *dst = conv + (size_t)r * (size_t)cols;
    if (simd) {
      ml_cpu_fp8_row_simd(src, sr, cols, dst);
      continue;
    }
    for (size_t b = 0; b < nb; ++b) {
      const float s = sr[b];
      const size_t at = b * ML_FP8_BLOCK;
      for (int i = 0; i < ML_FP8_BLOCK; ++i) dst[at + i] = lut[src[at + i]] * s;
    }
  }
  return conv;
}

int ml_cpu_weights_first(int m) { return m <= ML_CPU_FEW_ROWS; }

void ml_cpu_gemm_raw(const float *a, int lda, int m, int K, const float *w, int n, float *c,
                     int ldc) {
  if (ml_cpu_weights_first(m))
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, K, 1.0f, w, K, a, lda, 0.0f, c,
                ldc);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, K, 1.0f, a, lda, w, K, 0.0f, c,
                ldc);
}

void ml_cpu_gemm(const float *a, int lda, int m, int K, const float *w, int n, float *c, int ldc,
                 float *tmp) {
  if (!ml_cpu_weights_first(m)) {
    ml_cpu_gemm_raw(a, lda, m, K, w, n, c, ldc);
    return;
  }
  ml_cpu_gemm_raw(a, lda, m, K, w, n, tmp, m);
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < n; ++j) c[(size_t)r * ldc + j] = tmp[(size_t)j * m + r];
}
