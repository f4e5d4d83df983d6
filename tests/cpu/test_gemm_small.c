/* The CPU backend's small-M GEMM (src/cpu/gemm_small.c) on its own, against a
 * double-precision product of independently decoded weights, and the routed
 * experts with it and without it (the BLAS path every CPU without AVX2, FMA
 * and F16C takes), against the reference layer. */
#include "cpu/cpu.h"
#include "harness.h"
#include "ref.h"

#include <stdint.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng_next(void) { return ml_t_rand(&rng_state); }
static double rng_unit(void) { return ml_t_unit(&rng_state); }

/* A random weight of either sign: bf16 of magnitude 2^-8 up to 2^4; f16 from
 * its subnormals up to 2^4, so both of its decodings are exercised. */
static uint16_t rand_weight(moelink_dtype_t dt) {
  const uint32_t r = rng_next();
  const uint16_t sign = (uint16_t)((r & 1u) << 15);
  if (dt == MOELINK_DTYPE_BF16)
    return (uint16_t)(sign | (uint16_t)((119u + (r >> 1) % 12u) << 7) | ((r >> 8) & 0x7fu));
  return (uint16_t)(sign | (uint16_t)(((r >> 1) % 19u) << 10) | ((r >> 8) & 0x3ffu));
}

/* Own decoding of the two formats (finite values only). */
static double decode(moelink_dtype_t dt, uint16_t h) {
  const double s = (h & 0x8000u) ? -1.0 : 1.0;
  if (dt == MOELINK_DTYPE_BF16) {
    const int e = (h >> 7) & 0xff, m = h & 0x7f;
    return e == 0 ? s * ldexp(m, -133) : s * ldexp(128 + m, e - 134);
  }
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  return e == 0 ? s * ldexp(m, -24) : s * ldexp(1024 + m, e - 25);
}

static int is_nan_bits(float v) { return v != v; }

/* c [m, n] (ldc) against sum_k a[i, k] wd[j, k] in double, wd the weights'
 * exact values. Every fp32 sum of the K products (each exact in an FMA) is
 * within K * 2^-24 * sum |a w| of the exact one, whatever the order; a lost
 * or doubled term is far outside. Row m and columns n.. of c must still be
 * NaN. */
static void check_product(const char *what, const float *a, int lda, int m, int K,
                          const double *wd, int n, const float *c, int ldc) {
  int bad = 0, untouched = 1, bi = -1, bj = -1;
  double worst = 0.0;
  for (int i = 0; i < m + 1; ++i)
    for (int j = 0; j < ldc; ++j) {
      const float got = c[(size_t)i * ldc + j];
      if (i >= m || j >= n) {
        if (!is_nan_bits(got)) untouched = 0;
        continue;
      }
      double exact = 0.0, mag = 0.0;
      for (int k = 0; k < K; ++k) {
        const double p = (double)a[(size_t)i * lda + k] * wd[(size_t)j * K + k];
        exact += p;
        mag += fabs(p);
      }
      const double err = fabs((double)got - exact), bound = 1.01 * K * ldexp(mag, -24) + 1e-30;
      if (!(err <= bound) && bad++ == 0) {
        bi = i;
        bj = j;
      }
      if (mag > 0 && err / mag > worst) worst = err / mag;
    }
  CHECK(bad == 0, "%s m=%d n=%d K=%d: every element within K*2^-24*sum|aw| of the exact sum "
        "(%d off, first at %d,%d; worst err/sum|aw| %.2g)", what, m, n, K, bad, bi, bj, worst);
  CHECK(untouched, "%s m=%d n=%d K=%d: nothing written outside [m, n]", what, m, n, K);
}

static void check_case(moelink_dtype_t dt, int m, int n, int K) {
  const int lda = K + 3, ldc = n + 2;
  float *a = malloc(sizeof(float) * (size_t)m * lda);
  uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(n + 1) * K);
  float *c = malloc(sizeof(float) * (size_t)(m + 1) * ldc);
  for (int i = 0; i < m; ++i)
    for (int k = 0; k < lda; ++k)
      a[(size_t)i * lda + k] = k < K ? (float)(2.0 * rng_unit() - 1.0) : NAN;
  for (size_t q = 0; q < (size_t)n * K; ++q) w[q] = rand_weight(dt);
  /* A NaN row after the block: reading past it shows. */
  for (int k = 0; k < K; ++k)
    w[(size_t)n * K + k] = dt == MOELINK_DTYPE_BF16 ? 0x7fc0 : 0x7e00;
  for (size_t q = 0; q < (size_t)(m + 1) * ldc; ++q) c[q] = NAN;

  ml_cpu_gemm_small(a, lda, m, K, dt, w, n, c, ldc);

  double *wd = malloc(sizeof(double) * (size_t)n * K);
  for (size_t q = 0; q < (size_t)n * K; ++q) wd[q] = decode(dt, w[q]);
  check_product(moelink_dtype_name(dt), a, lda, m, K, wd, n, c, ldc);
  free(wd);
  free(a);
  free(w);
  free(c);
}

/* An output's value depends on K alone, not on which register tile holds it:
 * any window of the operands reproduces the full product's elements bitwise.
 * (This is what keeps the layer's results independent of work items.) */
static void check_windows(moelink_dtype_t dt) {
  const int m = 37, n = 11, K = 203;
  float *a = malloc(sizeof(float) * (size_t)m * K);
  uint16_t *w = malloc(sizeof(uint16_t) * (size_t)n * K);
  float *full = malloc(sizeof(float) * (size_t)m * n);
  float *part = malloc(sizeof(float) * (size_t)m * n);
  for (size_t q = 0; q < (size_t)m * K; ++q) a[q] = (float)(2.0 * rng_unit() - 1.0);
  for (size_t q = 0; q < (size_t)n * K; ++q) w[q] = rand_weight(dt);
  ml_cpu_gemm_small(a, K, m, K, dt, w, n, full, n);
  const int win[][4] = {{1, 0, 5, 4}, {3, 2, 1, 7}, {5, 1, 30, 2}, {0, 10, 37, 1}, {13, 4, 3, 3}};
  int same = 1;
  for (size_t t = 0; t < sizeof win / sizeof win[0]; ++t) {
    const int i0 = win[t][0], j0 = win[t][1], mm = win[t][2], nn = win[t][3];
    for (size_t q = 0; q < (size_t)m * n; ++q) part[q] = NAN;
    ml_cpu_gemm_small(a + (size_t)i0 * K, K, mm, K, dt, w + (size_t)j0 * K, nn, part, n);
    for (int i = 0; i < mm; ++i)
      for (int j = 0; j < nn; ++j)
        if (memcmp(&part[(size_t)i * n + j], &full[(size_t)(i0 + i) * n + j0 + j],
                   sizeof(float)) != 0)
          same = 0;
  }
  CHECK(same, "%s: sub-blocks of the operands give bitwise the same elements",
        moelink_dtype_name(dt));
  free(a);
  free(w);
  free(full);
  free(part);
}

static void test_kernel(moelink_dtype_t dt) {
  static const int nk[][2] = {{1, 1},  {3, 7},   {5, 9},    {2, 17},  {7, 33},
                              {3, 100}, {13, 15}, {1, 263}, {5, 1031}, {31, 23}};
  const int ncase = (int)(sizeof nk / sizeof nk[0]);
  for (int m = 1; m <= 40; ++m)
    for (int t = 0; t < 2; ++t) {
      const int *c = nk[(m * 2 + t) % ncase];
      check_case(dt, m, c[0], c[1]);
    }
  check_case(dt, 16, 5, 2048 + 3);
  check_case(dt, ML_CPU_SMALL_ROWS, 7, 777);
  check_windows(dt);
}

/* ---- FP8 weights: widened rows (ml_cpu_fp8_weight_rows) and fp32 weights -- */

/* Own decoding of an e4m3 code (finite codes only). */
static double decode_e4m3(uint8_t b) {
  const double s = (b & 0x80u) ? -1.0 : 1.0;
  const int e = (b >> 3) & 15, m = b & 7;
  return e == 0 ? s * ldexp(m, -9) : s * ldexp(8 + m, e - 10);
}

/* Any finite code: subnormals, the largest (0x7e / 0xfe) and zeros too. */
static uint8_t rand_code(void) {
  uint8_t b;
  do b = (uint8_t)rng_next(); while ((b & 0x7fu) == 0x7fu);
  return b;
}

/* n weight rows from row0 of a [rows, K] e4m3 matrix with random block scales
 * (one block zero): widened, each must be the fp32 product of its value and
 * its block's scale (one rounding), with the SIMD and without; then through
 * ml_cpu_gemm_small as fp32 weights against the double sum; then a window of
 * rows and token rows gives the same bits; a NaN code widens to NaN. */
static void check_case_fp8(int m, int n, int K, int rows, int row0) {
  const int lda = K + 5, ldc = n + 1, kb = K / 128;
  float *a = malloc(sizeof(float) * (size_t)m * lda);
  uint8_t *w = malloc((size_t)rows * K);
  float *sc = malloc(sizeof(float) * (size_t)(rows / 128) * kb);
  float *wf = malloc(sizeof(float) * (size_t)n * K), *wf0 = malloc(sizeof(float) * (size_t)n * K);
  float *c = malloc(sizeof(float) * (size_t)(m + 1) * ldc);
  float *part = malloc(sizeof(float) * (size_t)(m + 1) * ldc);
  for (int i = 0; i < m; ++i)
    for (int k = 0; k < lda; ++k)
      a[(size_t)i * lda + k] = k < K ? (float)(2.0 * rng_unit() - 1.0) : NAN;
  for (size_t q = 0; q < (size_t)rows * K; ++q) w[q] = rand_code();
  for (int q = 0; q < (rows / 128) * kb; ++q)
    sc[q] = (float)ldexp(0.5 + rng_unit(), (int)(rng_next() % 9) - 8);
  sc[(rows / 128) * kb / 2] = 0.0f;

  int widened = 1;
  ml_cpu_fp8_weight_rows(w, sc, (size_t)row0, n, K, wf);
  for (int j = 0; j < n; ++j)
    for (int k = 0; k < K; ++k) {
      const int r = row0 + j;
      const float want = (float)decode_e4m3(w[(size_t)r * K + k]) * sc[(r / 128) * kb + k / 128];
      if (memcmp(&want, &wf[(size_t)j * K + k], sizeof want) != 0) widened = 0;
    }
  ml_cpu_simd_limit(0);
  ml_cpu_fp8_weight_rows(w, sc, (size_t)row0, n, K, wf0);
  ml_cpu_simd_limit(-1);
  CHECK(widened && memcmp(wf, wf0, sizeof(float) * (size_t)n * K) == 0,
        "e4m3 rows %d..%d x K %d: widened to value x scale in fp32, the same with and without "
        "the SIMD", row0, row0 + n - 1, K);

  for (size_t q = 0; q < (size_t)(m + 1) * ldc; ++q) c[q] = NAN;
  ml_cpu_gemm_small(a, lda, m, K, MOELINK_DTYPE_F32, wf, n, c, ldc);
  double *wd = malloc(sizeof(double) * (size_t)n * K);
  for (size_t q = 0; q < (size_t)n * K; ++q) wd[q] = wf[q];
  check_product("f32 weights", a, lda, m, K, wd, n, c, ldc);
  free(wd);

  int same = 1;
  const int i0 = m / 3, j0 = n / 2, mm = m - i0, nn = n - j0;
  for (size_t q = 0; q < (size_t)(m + 1) * ldc; ++q) part[q] = NAN;
  ml_cpu_gemm_small(a + (size_t)i0 * lda, lda, mm, K, MOELINK_DTYPE_F32, wf + (size_t)j0 * K, nn,
                    part, ldc);
  for (int i = 0; i < mm; ++i)
    for (int j = 0; j < nn; ++j)
      if (memcmp(&part[(size_t)i * ldc + j], &c[(size_t)(i0 + i) * ldc + j0 + j],
                 sizeof(float)) != 0)
        same = 0;
  CHECK(same, "f32 weights m=%d n=%d K=%d: a window of rows and token rows gives the same bits",
        m, n, K);

  w[(size_t)(row0 + j0) * K + K / 2] = 0xffu;
  w[(size_t)(row0 + j0) * K + K / 2 + 1] = 0x7fu;
  ml_cpu_fp8_weight_rows(w, sc, (size_t)row0, n, K, wf);
  int nan_ok = 1;
  for (int j = 0; j < n; ++j)
    for (int k = 0; k < K; ++k)
      if (is_nan_bits(wf[(size_t)j * K + k]) != (j == j0 && (k == K / 2 || k == K / 2 + 1)))
        nan_ok = 0;
  CHECK(nan_ok, "e4m3 rows %d..%d: the NaN codes widen to NaN, nothing else does", row0,
        row0 + n - 1);
  free(a);
  free(w);
  free(sc);
  free(wf);
  free(wf0);
  free(c);
  free(part);
}

static void test_kernel_fp8(void) {
  check_case_fp8(1, 1, 128, 128, 0);
  check_case_fp8(3, 7, 256, 256, 5);
  check_case_fp8(4, 3, 128, 256, 126);   /* rows across two scale blocks */
  check_case_fp8(13, 20, 640, 384, 120); /* and three */
  check_case_fp8(40, 11, 2048, 128, 100);
  check_case_fp8(ML_CPU_SMALL_ROWS, 9, 384, 256, 130);
}

/* The routed experts of a small bf16/f16 layer, some experts under
 * ML_CPU_SMALL_ROWS rows and one over it, against the reference; then the
 * same with the SIMD switched off (conversion in C, BLAS for every block).
 * Both must match the reference, and with a context of 1 and of 3 threads
 * give bitwise the same rows. */
static void experts_rows(moelink_context_t ctx, const ref_layer *L, const void *x, int T,
                         const int32_t *ids, const float *wts, void *y, moelink_plan_t *pv,
                         int32_t *plan_buf, const char *what) {
  const moelink_moe_config_t *cfg = &L->cfg;
  moelink_moe_t moe = NULL;
  moelink_status_t s = moelink_moe_create(ctx, cfg, &moe);
  if (s == MOELINK_SUCCESS) s = moelink_moe_set_weights(moe, &L->w);
  const int tr = s == MOELINK_SUCCESS ? moelink_moe_tile_rows(moe) : 0;
  if (s == MOELINK_SUCCESS) s = moelink_moe_plan(moe, ids, T, plan_buf, NULL);
  if (s == MOELINK_SUCCESS)
    s = moelink_plan_view(plan_buf, T, cfg->top_k, cfg->num_experts, tr, pv);
  if (s == MOELINK_SUCCESS) s = moelink_moe_experts(moe, x, T, plan_buf, wts, y, NULL);
  CHECK(s == MOELINK_SUCCESS, "%s: create, plan and experts (%s)", what,
        s ? moelink_last_error() : "");
  moelink_moe_destroy(moe);
}

static double worst_vs_ref(const ref_layer *L, const void *x, const int32_t *ids,
                           const float *wts, const void *y, const moelink_plan_t *p) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const int H = cfg->hidden, k = cfg->top_k;
  const size_t es = moelink_dtype_size(cfg->dtype);
  double *want = malloc(sizeof(double) * H), worst = 0.0;
  for (int32_t r = 0; r < p->expert_offsets[cfg->num_experts]; ++r) {
    const int32_t q = p->sorted_pairs[r];
    ref_expert_token(cfg, &L->w, ids[q], (const char *)x + (size_t)(q / k) * H * es, want);
    for (int h = 0; h < H; ++h) want[h] *= wts[q];
    const double err =
        ref_rel_l2(cfg->dtype, (const char *)y + (size_t)r * H * es, want, (size_t)H);
    if (!(err <= worst)) worst = err;
  }
  free(want);
  return worst;
}

static void test_layer(moelink_dtype_t dt) {
  const char *dn = moelink_dtype_name(dt);
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = 67;
  cfg.inter = 45;
  cfg.num_experts = 6;
  cfg.top_k = 2;
  cfg.dtype = dt;
  const int T = ML_CPU_SMALL_ROWS + 21;
  cfg.max_tokens = T;
  ref_layer L;
  if (ref_layer_make(&L, &cfg, 4242 + (uint64_t)dt, 0.0) != 0) {
    CHECK(0, "%s: reference layer", dn);
    return;
  }
  const int H = cfg.hidden, k = cfg.top_k, E = cfg.num_experts;
  const size_t es = moelink_dtype_size(dt), ybytes = (size_t)T * k * H * es;
  void *x = malloc((size_t)T * H * es);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
  float *wts = malloc(sizeof(float) * (size_t)T * k);
  int32_t *plan_buf = malloc(moelink_plan_bytes(T, k, E, ML_CPU_TILE_ROWS));
  unsigned char *y[4];
  for (int v = 0; v < 4; ++v) y[v] = malloc(ybytes);
  ref_fill_x(&L, x, T, 99);
  /* Slot 0 of the first 40 tokens goes to expert 0 (over ML_CPU_SMALL_ROWS
   * rows, the BLAS path), the other slots spread over experts 1..5 (under it),
   * one hole. */
  for (int t = 0; t < T; ++t) {
    ids[t * k] = t < ML_CPU_SMALL_ROWS + 8 ? 0 : 1 + (int32_t)(rng_next() % 5u);
    ids[t * k + 1] = 1 + (int32_t)(((uint32_t)ids[t * k] + rng_next() % 4u) % 5u); /* != slot 0 */
    wts[t * k] = (float)rng_unit();
    wts[t * k + 1] = (float)(rng_unit() - 0.5);
  }
  ids[7 * k + 1] = -1;
  moelink_plan_t p;
  int max_small = 0, big = 0;
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  moelink_context_t c1 = NULL, c3 = NULL;
  cc.num_threads = 1;
  moelink_status_t s = moelink_context_create(&cc, &c1);
  cc.num_threads = 3;
  if (s == MOELINK_SUCCESS) s = moelink_context_create(&cc, &c3);
  CHECK(s == MOELINK_SUCCESS, "%s: contexts of 1 and 3 threads (%s)", dn,
        s ? moelink_last_error() : "");
  if (s == MOELINK_SUCCESS) {
    for (int v = 0; v < 4; ++v) {
      char what[64];
      snprintf(what, sizeof what, "%s, SIMD %s, %d thread(s)", dn, v < 2 ? "on" : "off",
               v % 2 ? 3 : 1);
      memset(y[v], 0xff, ybytes);
      ml_cpu_simd_limit(v < 2 ? -1 : 0);
      experts_rows(v % 2 ? c3 : c1, &L, x, T, ids, wts, y[v], &p, plan_buf, what);
    }
    ml_cpu_simd_limit(-1);
    for (int e = 0; e < E; ++e) {
      const int rows = p.expert_offsets[e + 1] - p.expert_offsets[e];
      if (rows > ML_CPU_SMALL_ROWS) ++big;
      else if (rows > max_small) max_small = rows;
    }
    CHECK(big == 1 && max_small > 1, "%s: one expert over %d rows, the others up to %d rows", dn,
          ML_CPU_SMALL_ROWS, max_small);
    const double tol = 1e-2;
    const double e_small = worst_vs_ref(&L, x, ids, wts, y[0], &p);
    const double e_blas = worst_vs_ref(&L, x, ids, wts, y[2], &p);
    CHECK(e_small <= tol, "%s: experts with the small-M GEMM match the reference (worst rel L2 "
          "%.3g; small-M kernel %s)", dn, e_small, ml_cpu_small_ready(dt) ? "used" : "unavailable");
    CHECK(e_blas <= tol, "%s: experts with SIMD off (BLAS only) match the reference (worst rel "
          "L2 %.3g)", dn, e_blas);
    CHECK(memcmp(y[0], y[1], ybytes) == 0, "%s: small-M path, 1 and 3 threads bitwise equal", dn);
    CHECK(memcmp(y[2], y[3], ybytes) == 0, "%s: BLAS path, 1 and 3 threads bitwise equal", dn);
    /* The expert over the threshold takes BLAS either way: its rows are
     * the same bits with the SIMD on or off (conversion is exact). */
    const size_t row = (size_t)H * es, r0 = (size_t)p.expert_offsets[0];
    const size_t r1 = (size_t)p.expert_offsets[1];
    CHECK(memcmp(y[0] + r0 * row, y[2] + r0 * row, (r1 - r0) * row) == 0,
          "%s: the big expert's rows are the same bits with the SIMD on and off", dn);
  }
  moelink_context_destroy(c1);
  moelink_context_destroy(c3);
  for (int v = 0; v < 4; ++v) free(y[v]);
  free(x);
  free(ids);
  free(wts);
  free(plan_buf);
  ref_layer_free(&L);
}

int main(void) {
  const int simd = ml_cpu_simd();
  ml_t_diag("SIMD: AVX2+F16C %s, FMA %s", simd & ML_CPU_SIMD_AVX2 ? "yes" : "no",
            simd & ML_CPU_SIMD_FMA ? "yes" : "no");
  const int ready = (simd & ML_CPU_SIMD_FMA) != 0;
  CHECK(!ml_cpu_small_ready(MOELINK_DTYPE_F32) && !ml_cpu_use_small(MOELINK_DTYPE_F32, 1),
        "f32 never takes the small-M kernel");
  CHECK(ml_cpu_small_ready(MOELINK_DTYPE_BF16) == ready &&
            ml_cpu_small_ready(MOELINK_DTYPE_F16) == ready,
        "bf16 and f16 take it exactly when the CPU has AVX2, FMA and F16C (%d)", ready);
  CHECK(ml_cpu_use_small(MOELINK_DTYPE_BF16, ML_CPU_SMALL_ROWS) == ready &&
            !ml_cpu_use_small(MOELINK_DTYPE_BF16, ML_CPU_SMALL_ROWS + 1),
        "up to %d rows only", ML_CPU_SMALL_ROWS);
  ml_cpu_simd_limit(0);
  CHECK(!ml_cpu_small_ready(MOELINK_DTYPE_BF16) && ml_cpu_simd() == 0,
        "with the SIMD capped to none, no small-M kernel");
  ml_cpu_simd_limit(-1);
  CHECK(ml_cpu_small_fp8_ready() == ready && ml_cpu_use_small_fp8(ML_CPU_SMALL_ROWS) == ready &&
            !ml_cpu_use_small_fp8(ML_CPU_SMALL_ROWS + 1),
        "FP8 experts take it on the same CPUs (%d), up to %d rows", ready, ML_CPU_SMALL_ROWS);
  if (ready) {
    test_kernel(MOELINK_DTYPE_BF16);
    test_kernel(MOELINK_DTYPE_F16);
    test_kernel_fp8();
  } else {
    ml_t_diag("no AVX2/FMA/F16C here: the kernel itself is not tested, only the BLAS path");
  }
  test_layer(MOELINK_DTYPE_BF16);
  test_layer(MOELINK_DTYPE_F16);
  return ml_test_done();
}
