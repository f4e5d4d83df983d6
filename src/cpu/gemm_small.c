/* A GEMM for the routed experts' common case: few token rows against a block
 * of bf16 or f16 weight rows. The BLAS path converts the block to fp32, lets
 * BLAS pack it and then multiplies ~16 rows; each of those passes reads the
 * whole block while the multiply itself is short, so at these sizes the
 * passes cost as much as the arithmetic. Here every weight vector is loaded
 * once from the caller's buffer, widened to fp32 in a register and used for
 * all the token rows of a register tile; the token rows (fp32, a few hundred
 * KiB at most) are re-read from cache instead.
 *
 * Layout: both operands are K-contiguous, so the vector runs along K and each
 * output is a horizontal sum at the end. Per output the order of the sums is
 * fixed (eight lanes over k = lane mod 8, a fixed lane reduction, then the
 * K % 8 tail in order), whatever tile the output falls in: results depend on
 * the shapes only.
 *
 * FP8 weights (e4m3 bytes, an fp32 scale per 128 x 128 block) are widened
 * once per work item into fp32 rows (ml_cpu_fp8_weight_rows, a row at a
 * time through ml_cpu_fp8_row_simd: bitwise the table's values) and multiplied here as fp32 weights:
 * widening inside the tile would redo it for every 4 token rows, and the
 * conversion costs more than the 4 multiply-adds it feeds. */
#include "core/fp8.h"
#include "cpu/cpu.h"

#ifdef ML_CPU_X86
#include <immintrin.h>

/* Register tile: 4 token rows x 3 weight rows = 12 accumulators, plus 3
 * widened weight vectors and a token vector, the 16 ymm registers of AVX2.
 * Measured with the data in cache (one thread, 24 rows x 48 weight rows,
 * K 2048, GFLOP/s): 4x3 73, 3x3 72, 2x4 54, 6x2 53, 3x4 42 and 2x6 41 (both
 * spill). */
#define ML_GS_MR 4
#define ML_GS_NR 3

#define ML_GS_TARGET __attribute__((target("avx2,fma,f16c")))
#define ML_GS_INLINE static inline __attribute__((always_inline)) ML_GS_TARGET

/* Weight formats of a tile. */
enum { ML_GS_BF16 = 0, ML_GS_F16 = 1, ML_GS_F32 = 2 };

ML_GS_INLINE __m256 ml_gs_load(const char *p, int fmt) {
  if (fmt == ML_GS_F32) return _mm256_loadu_ps((const float *)p);
  const __m128i h = _mm_loadu_si128((const __m128i *)p);
  if (fmt == ML_GS_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ML_GS_INLINE float ml_gs_scalar(const char *p, int fmt) {
  if (fmt == ML_GS_F32) {
    float f;
    memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, p, 2);
  if (fmt == ML_GS_F16) return _cvtsh_ss(h);
  union {
    uint32_t u;
    float f;
  } v;
  v.u = (uint32_t)h << 16;
  return v.f;
}

/* (l0 + l4) + (l2 + l6) + ((l1 + l5) + (l3 + l7)), the same for every output. */
ML_GS_INLINE float ml_gs_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* One tile of mr <= ML_GS_MR token rows by nr <= ML_GS_NR weight rows (w:
 * the first, rows K elements apart); mr, nr and fmt are constants at every
 * call, so the loops unroll and the accumulators stay in registers. pf:
 * ML_GS_NR row pointers to prefetch along with the rows at hand, one cache
 * line each per 64 bytes of k. */
ML_GS_INLINE void ml_gs_tile(const float *a, size_t lda, const char *w, int K, float *c,
                             size_t ldc, const int mr, const int nr, const int fmt,
                             const char *const *pf) {
  const size_t es = fmt == ML_GS_F32 ? 4 : 2;
  __m256 acc[ML_GS_MR][ML_GS_NR];
#pragma GCC unroll 4
  for (int i = 0; i < mr; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[ML_GS_NR];
    if (((size_t)k * es & 63) == 0) {
#pragma GCC unroll 3
      for (int j = 0; j < ML_GS_NR; ++j) _mm_prefetch(pf[j] + (size_t)k * es, _MM_HINT_T0);
    }
#pragma GCC unroll 3
    for (int j = 0; j < nr; ++j) wv[j] = ml_gs_load(w + ((size_t)j * K + k) * es, fmt);
#pragma GCC unroll 4
    for (int i = 0; i < mr; ++i) {
      const __m256 av = _mm256_loadu_ps(a + (size_t)i * lda + k);
#pragma GCC unroll 3
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(av, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < mr; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < nr; ++j) {
      float s = ml_gs_hsum(acc[i][j]);
      for (int kk = k; kk < K; ++kk)
        s += a[(size_t)i * lda + kk] * ml_gs_scalar(w + ((size_t)j * K + kk) * es, fmt);
      c[(size_t)i * ldc + j] = s;
    }
}

/* The tile shape picked by (rows left, weight rows left), each case its own
 * unrolled copy. */
#define ML_GS_CASE(MR, NR)                                 \
  case (MR) * 4 + (NR):                                    \
    ml_gs_tile(a, lda, w, K, c, ldc, (MR), (NR), fmt, pf); \
    return;

ML_GS_INLINE void ml_gs_tile_any(const float *a, size_t lda, const char *w, int K, float *c,
                                 size_t ldc, int mr, int nr, const int fmt,
                                 const char *const *pf) {
  switch (mr * 4 + nr) {
    ML_GS_CASE(4, 3) ML_GS_CASE(4, 2) ML_GS_CASE(4, 1)
    ML_GS_CASE(3, 3) ML_GS_CASE(3, 2) ML_GS_CASE(3, 1)
    ML_GS_CASE(2, 3) ML_GS_CASE(2, 2) ML_GS_CASE(2, 1)
    ML_GS_CASE(1, 3) ML_GS_CASE(1, 2) ML_GS_CASE(1, 1)
    default: return;
  }
}
#undef ML_GS_CASE

/* Weight rows outer: a tile's 3 weight rows are read from memory once and
 * stay in L1 while every group of token rows passes over them. Each row is a
 * page or so apart from the next, where the hardware prefetchers stop, so the
 * next tile's rows are prefetched while this one computes (at the last tile,
 * this tile's own rows again); measured 15-20% faster when streaming the
 * weights from DRAM. */
ML_GS_INLINE void ml_gs_run(const float *a, int lda, int m, int K, const char *w, int n,
                            float *c, int ldc, const int fmt) {
  const size_t row = (size_t)K * (fmt == ML_GS_F32 ? 4 : 2);
  for (int j0 = 0; j0 < n; j0 += ML_GS_NR) {
    const int nr = n - j0 < ML_GS_NR ? n - j0 : ML_GS_NR;
    const char *wj = w + (size_t)j0 * row;
    const int next = j0 + nr < n ? j0 + nr : j0, next_rows = j0 + nr < n ? n - next : nr;
    const char *pf[ML_GS_NR];
    for (int j = 0; j < ML_GS_NR; ++j)
      pf[j] = w + (size_t)(next + (j < next_rows ? j : next_rows - 1)) * row;
    for (int i0 = 0; i0 < m; i0 += ML_GS_MR) {
      const int mr = m - i0 < ML_GS_MR ? m - i0 : ML_GS_MR;
      ml_gs_tile_any(a + (size_t)i0 * lda, (size_t)lda, wj, K, c + (size_t)i0 * ldc + j0,
                     (size_t)ldc, mr, nr, fmt, pf);
    }
  }
}

ML_GS_TARGET static void ml_gs_bf16(const float *a, int lda, int m, int K, const char *w, int n,
                                    float *c, int ldc) {
  ml_gs_run(a, lda, m, K, w, n, c, ldc, ML_GS_BF16);
}

ML_GS_TARGET static void ml_gs_f16(const float *a, int lda, int m, int K, const char *w, int n,
                                   float *c, int ldc) {
  ml_gs_run(a, lda, m, K, w, n, c, ldc, ML_GS_F16);
}

ML_GS_TARGET static void ml_gs_f32(const float *a, int lda, int m, int K, const char *w, int n,
                                   float *c, int ldc) {
  ml_gs_run(a, lda, m, K, w, n, c, ldc, ML_GS_F32);
}

/* e4m3 codes as f16 bits are their values / 256 (subnormals included), so
 * value x scale = f16 x (scale x 256), both factors exact: the same fp32 as
 * the table decode times the scale. The NaN codes stay NaN. */
ML_GS_TARGET static void ml_gs_fp8_row(const uint8_t *src, const float *scale, int cols,
                                       float *dst) {
  for (int b = 0; b < cols; b += ML_FP8_BLOCK) {
    const __m256 s256 = _mm256_set1_ps(scale[b / ML_FP8_BLOCK] * 256.0f); /* once a block */
    for (int i = b; i < b + ML_FP8_BLOCK; i += 8) {
      const __m128i q = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + i)));
      const __m128i mag = _mm_and_si128(q, _mm_set1_epi16(0x7f));
      __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(q, _mm_set1_epi16(0x80)), 8),
                               _mm_slli_epi16(mag, 7));
      h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)),
                                        _mm_set1_epi16(0x7e00)));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), s256));
    }
  }
}
#endif

int ml_cpu_small_ready(moelink_dtype_t dtype) {
#ifdef ML_CPU_X86
  return (dtype == MOELINK_DTYPE_BF16 || dtype == MOELINK_DTYPE_F16) &&
         (ml_cpu_simd() & ML_CPU_SIMD_FMA);
#else
  (void)dtype;
  return 0;
#endif
}

int ml_cpu_use_small(moelink_dtype_t dtype, int m) {
  return m <= ML_CPU_SMALL_ROWS && ml_cpu_small_ready(dtype);
}

int ml_cpu_small_fp8_ready(void) {
#ifdef ML_CPU_X86
  return (ml_cpu_simd() & ML_CPU_SIMD_FMA) != 0;
#else
  return 0;
#endif
}

int ml_cpu_use_small_fp8(int m) { return m <= ML_CPU_SMALL_ROWS && ml_cpu_small_fp8_ready(); }

void ml_cpu_gemm_small(const float *a, int lda, int m, int K, moelink_dtype_t dtype,
                       const void *w, int n, float *c, int ldc) {
#ifdef ML_CPU_X86
  if (dtype == MOELINK_DTYPE_BF16)
    ml_gs_bf16(a, lda, m, K, (const char *)w, n, c, ldc);
  else if (dtype == MOELINK_DTYPE_F16)
    ml_gs_f16(a, lda, m, K, (const char *)w, n, c, ldc);
  else if (dtype == MOELINK_DTYPE_F32 && (ml_cpu_simd() & ML_CPU_SIMD_FMA))
    ml_gs_f32(a, lda, m, K, (const char *)w, n, c, ldc);
#else
  (void)a, (void)lda, (void)m, (void)K, (void)dtype, (void)w, (void)n, (void)c, (void)ldc;
#endif
}

int ml_cpu_fp8_simd(void) {
#ifdef ML_CPU_X86
  return (ml_cpu_simd() & ML_CPU_SIMD_FMA) != 0;
#else
  return 0;
#endif
}

void ml_cpu_fp8_row_simd(const uint8_t *src, const float *scale, int cols, float *dst) {
#ifdef ML_CPU_X86
  ml_gs_fp8_row(src, scale, cols, dst);
#else
  (void)src, (void)scale, (void)cols, (void)dst;
#endif
}
