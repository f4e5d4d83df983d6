/* The experts and combine pieces against the reference: each plan row is
 * weight * expert(x_t); combine sums a token's k rows in slot order in fp32
 * with one rounding. */
#include "harness.h"
#include "moelink.h"
#include "ref.h"

#include <stdint.h>

static moelink_context_t ctx;

static double tol_for(moelink_dtype_t dt) { return dt == MOELINK_DTYPE_F32 ? 1e-4 : 1e-2; }

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint32_t rng_next(void) { return ml_t_rand(&rng_state); }

typedef struct {
  ref_layer L;
  moelink_moe_t m;
  int tr;
} setup;

static int setup_open(setup *S, const moelink_moe_config_t *cfg, uint64_t seed) {
  memset(S, 0, sizeof *S);
  if (ref_layer_make(&S->L, cfg, seed, 0.0) != 0) return -1;
  if (moelink_moe_create(ctx, cfg, &S->m) != MOELINK_SUCCESS) return -1;
  if (moelink_moe_set_weights(S->m, &S->L.w) != MOELINK_SUCCESS) return -1;
  S->tr = moelink_moe_tile_rows(S->m);
  return S->tr > 0 ? 0 : -1;
}

static void setup_close(setup *S) {
  moelink_moe_destroy(S->m);
  ref_layer_free(&S->L);
}

/* experts() with the given ids and weights (weights may be NULL), compared
 * row by row with the reference. */
static void check_experts(const char *what, setup *S, const void *x, int T, const int32_t *ids,
                          const float *wts) {
  const moelink_moe_config_t *cfg = &S->L.cfg;
  const moelink_dtype_t dt = cfg->dtype;
  const int H = cfg->hidden, k = cfg->top_k, E = cfg->num_experts;
  const size_t es = moelink_dtype_size(dt), P = (size_t)T * k;
  const size_t pbytes = moelink_plan_bytes(T, k, E, S->tr);
  int32_t *plan_buf = malloc(pbytes);
  unsigned char *y = malloc(P * H * es + 1);
  double *want = malloc(sizeof(double) * H);
  moelink_plan_t p;
  moelink_status_t s = moelink_moe_plan(S->m, ids, T, plan_buf, NULL);
  if (s == MOELINK_SUCCESS) s = moelink_plan_view(plan_buf, T, k, E, S->tr, &p);
  memset(y, 0xff, P * H * es); /* NaN in every dtype */
  if (s == MOELINK_SUCCESS) s = moelink_moe_experts(S->m, x, T, plan_buf, wts, y, NULL);
  CHECK(s == MOELINK_SUCCESS, "%s: plan + experts (%s)", what, s ? moelink_last_error() : "");
  if (s == MOELINK_SUCCESS) {
    double worst = 0.0;
    int worst_row = -1;
    for (int32_t r = 0; r < p.expert_offsets[E]; ++r) {
      int32_t q = p.sorted_pairs[r];
      int t = q / k, e = ids[q];
      ref_expert_token(cfg, &S->L.w, e, (const char *)x + (size_t)t * H * es, want);
      double wq = wts ? (double)wts[q] : 1.0;
      for (int h = 0; h < H; ++h) want[h] *= wq;
      double err = ref_rel_l2(dt, y + (size_t)r * H * es, want, (size_t)H);
      if (!(err <= worst)) {
        worst = err;
        worst_row = r;
      }
    }
    CHECK(worst <= tol_for(dt), "%s: %d rows match weight * expert(x) (worst rel L2 %.3g at row %d)",
          what, p.expert_offsets[E], worst, worst_row);
  }
  free(plan_buf);
  free(y);
  free(want);
}

/* combine() of arbitrary y against its definition, exactly: fp32 sums in
 * slot order, one rounding to the dtype. */
static void check_combine_exact(const char *what, setup *S, int T, const int32_t *ids,
                                const void *y, size_t y_rows) {
  const moelink_moe_config_t *cfg = &S->L.cfg;
  const moelink_dtype_t dt = cfg->dtype;
  const int H = cfg->hidden, k = cfg->top_k, E = cfg->num_experts;
  const size_t es = moelink_dtype_size(dt);
  int32_t *plan_buf = malloc(moelink_plan_bytes(T, k, E, S->tr));
  unsigned char *out = malloc((size_t)(T + 1) * H * es);
  unsigned char *want = malloc((size_t)T * H * es + 1);
  moelink_plan_t p;
  moelink_status_t s = moelink_moe_plan(S->m, ids, T, plan_buf, NULL);
  if (s == MOELINK_SUCCESS) s = moelink_plan_view(plan_buf, T, k, E, S->tr, &p);
  memset(out, 0xff, (size_t)(T + 1) * H * es);
  if (s == MOELINK_SUCCESS) s = moelink_moe_combine(S->m, y, T, plan_buf, out, NULL);
  CHECK(s == MOELINK_SUCCESS, "%s: combine (%s)", what, s ? moelink_last_error() : "");
  if (s == MOELINK_SUCCESS) {
    int mismatches = 0, first_t = -1, first_h = -1, rows_ok = 1;
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
          int32_t r = p.pair_rows[(size_t)t * k + j];
          if (r < 0) continue;
          if ((size_t)r >= y_rows) {
            rows_ok = 0;
            continue;
          }
          acc += (float)ref_load(dt, y, (size_t)r * H + h);
        }
        ref_store(dt, want, (size_t)t * H + h, acc);
        double g = ref_load(dt, out, (size_t)t * H + h);
        double wv = ref_load(dt, want, (size_t)t * H + h);
        if (!(g == wv)) {
          if (mismatches++ == 0) {
            first_t = t;
            first_h = h;
          }
        }
      }
    CHECK(rows_ok, "%s: plan rows inside y", what);
    if (mismatches)
      ml_t_diag("%s: first mismatch token %d h %d: got %.9g want %.9g", what, first_t, first_h,
                ref_load(dt, out, (size_t)first_t * H + first_h),
                ref_load(dt, want, (size_t)first_t * H + first_h));
    CHECK(mismatches == 0, "%s: combine is exactly the in-order fp32 sum (%d of %d differ)", what,
          mismatches, T * H);
    int tail = 1;
    for (size_t b = (size_t)T * H * es; b < (size_t)(T + 1) * H * es; ++b)
      if (out[b] != 0xff) tail = 0;
    CHECK(tail, "%s: combine writes nothing past token T-1", what);
  }
  free(plan_buf);
  free(out);
  free(want);
}

static void run_dtype(moelink_dtype_t dt, uint64_t seed) {
  const char *dn = moelink_dtype_name(dt);
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = 72;
  cfg.inter = 45;
  cfg.num_experts = 12;
  cfg.top_k = 3;
  cfg.dtype = dt;
  cfg.max_tokens = 200;
  setup S;
  if (setup_open(&S, &cfg, seed) != 0) {
    CHECK(0, "%s: setup: %s", dn, moelink_last_error());
    setup_close(&S);
    return;
  }
  const int H = cfg.hidden, k = cfg.top_k, E = cfg.num_experts;
  const size_t es = moelink_dtype_size(dt);
  char what[128];
  for (int round = 0; round < 2; ++round) {
    const int T = round == 0 ? 37 : 200;
    void *x = malloc((size_t)T * H * es);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
    float *wts = malloc(sizeof(float) * (size_t)T * k);
    ref_fill_x(&S.L, x, T, seed + 17 + (uint64_t)round);

    /* Routed ids and weights. */
    CHECK_OK(moelink_moe_route(S.m, x, T, ids, wts, NULL), "route");
    snprintf(what, sizeof what, "%s T=%d routed, weighted", dn, T);
    check_experts(what, &S, x, T, ids, wts);
    snprintf(what, sizeof what, "%s T=%d routed, weights NULL", dn, T);
    check_experts(what, &S, x, T, ids, NULL);

    /* Random ids with empty and out-of-range slots, random weights. */
    for (int q = 0; q < T * k; ++q) {
      uint32_t r = rng_next();
      ids[q] = (r % 7 == 0) ? -1 : (r % 11 == 0 ? E + 2 : (int32_t)((r >> 8) % (uint32_t)E));
      wts[q] = (float)((rng_next() >> 8) * (2.0 / 16777216.0)) - 0.5f;
    }
    snprintf(what, sizeof what, "%s T=%d random ids with holes, weighted", dn, T);
    check_experts(what, &S, x, T, ids, wts);

    /* Full routed pipeline: combine(experts) against the reference sum of
     * weighted experts (no shared expert in this layer). */
    {
      int32_t *plan_buf = malloc(moelink_plan_bytes(T, k, E, S.tr));
      unsigned char *y = malloc((size_t)T * k * H * es);
      unsigned char *out = malloc((size_t)T * H * es);
      double *ref = malloc(sizeof(double) * H);
      memset(out, 0xff, (size_t)T * H * es);
      moelink_status_t s = moelink_moe_route(S.m, x, T, ids, wts, NULL);
      if (s == MOELINK_SUCCESS) s = moelink_moe_plan(S.m, ids, T, plan_buf, NULL);
      if (s == MOELINK_SUCCESS) s = moelink_moe_experts(S.m, x, T, plan_buf, wts, y, NULL);
      if (s == MOELINK_SUCCESS) s = moelink_moe_combine(S.m, y, T, plan_buf, out, NULL);
      CHECK(s == MOELINK_SUCCESS, "%s T=%d: route, plan, experts, combine (%s)", dn, T,
            s ? moelink_last_error() : "");
      double worst = 0.0;
      int skipped = 0;
      for (int t = 0; t < T && s == MOELINK_SUCCESS; ++t) {
        const char *xt = (const char *)x + (size_t)t * H * es;
        if (ref_route_margin(&cfg, &S.L.w, xt) < 1e-6) {
          ++skipped;
          continue;
        }
        if (ref_forward_token(&cfg, &S.L.w, xt, ref) != 0) {
          worst = INFINITY;
          continue;
        }
        double err = ref_rel_l2(dt, out + (size_t)t * H * es, ref, (size_t)H);
        if (!(err <= worst)) worst = err;
      }
      CHECK(worst <= tol_for(dt) && skipped * 50 <= T,
            "%s T=%d: pieces reproduce the layer (worst token rel L2 %.3g, %d near-tie skips)",
            dn, T, worst, skipped);
      free(plan_buf);
      free(y);
      free(out);
      free(ref);
    }

    /* combine on arbitrary y values, exactly. */
    {
      for (int q = 0; q < T * k; ++q) {
        uint32_t r = rng_next();
        ids[q] = (r % 5 == 0) ? -1 : (int32_t)((r >> 8) % (uint32_t)E);
      }
      /* Make token 0 have every slot empty. */
      for (int j = 0; j < k; ++j) ids[j] = -1;
      const size_t rows = (size_t)T * k;
      void *y = malloc(rows * H * es);
      CHECK_OK(moelink_fill_random(ctx, dt, y, rows * H, seed * 31 + (uint64_t)T, 3.0f, 0.0f,
                                   NULL),
               "fill y");
      snprintf(what, sizeof what, "%s T=%d combine of random y", dn, T);
      check_combine_exact(what, &S, T, ids, y, rows);
      free(y);
    }
    free(x);
    free(ids);
    free(wts);
  }
  setup_close(&S);
}

/* Values chosen so that the slot order and the single fp32 rounding are
 * visible in the result. */
static void test_combine_order(moelink_dtype_t dt) {
  const char *dn = moelink_dtype_name(dt);
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = 4;
  cfg.inter = 4;
  cfg.num_experts = 4;
  cfg.top_k = 3;
  cfg.dtype = dt;
  cfg.max_tokens = 8;
  setup S;
  if (setup_open(&S, &cfg, 5) != 0) {
    CHECK(0, "%s: combine-order setup", dn);
    setup_close(&S);
    return;
  }
  const int T = 4, k = 3, H = 4, E = 4;
  const size_t es = moelink_dtype_size(dt);
  /* Token 0: slots -> experts 3, 1, 0 (slot order differs from expert
   * order); token 1: 0, 1, 2; token 2: 2, -1, 1; token 3: 1, 2, 3. */
  const int32_t ids[12] = {3, 1, 0, 0, 1, 2, 2, -1, 1, 1, 2, 3};
  /* Per token, per slot, one value for all h. */
  /* big + 1 rounds back to big in fp32 (but not in double) where the dtype
   * can hold such a big: 1e8 and 2^25. f16 stops at 65504, so there the
   * order is not visible, only the value. */
  double big = dt == MOELINK_DTYPE_F32 ? 1e8 : 33554432.0;
  if (dt == MOELINK_DTYPE_F16) big = 32768.0;
  const double half_ulp = dt == MOELINK_DTYPE_BF16 ? 1.0 / 256 : (dt == MOELINK_DTYPE_F16 ? 1.0 / 2048 : 0.0);
  double v[4][3] = {
      {1.0, big, -big},          /* in order: (1 + big) - big */
      {big, -big, 1.0},          /* in order: 1 */
      {0.5, 99.0, 0.25},         /* slot 1 empty */
      {1.0, half_ulp, half_ulp}, /* one rounding: 1 + 2 half ulps */
  };
  double want[4];
  for (int t = 0; t < 4; ++t) {
    float acc = 0.0f;
    for (int j = 0; j < 3; ++j)
      if (ids[t * 3 + j] >= 0) acc += (float)v[t][j];
    want[t] = acc;
  }
  int32_t *plan_buf = malloc(moelink_plan_bytes(T, k, E, S.tr));
  moelink_plan_t p;
  moelink_status_t s = moelink_moe_plan(S.m, ids, T, plan_buf, NULL);
  if (s == MOELINK_SUCCESS) s = moelink_plan_view(plan_buf, T, k, E, S.tr, &p);
  unsigned char *y = malloc((size_t)T * k * H * es);
  unsigned char *out = malloc((size_t)T * H * es);
  memset(y, 0, (size_t)T * k * H * es);
  memset(out, 0xff, (size_t)T * H * es);
  for (int t = 0; t < T && s == MOELINK_SUCCESS; ++t)
    for (int j = 0; j < k; ++j) {
      int32_t r = p.pair_rows[t * k + j];
      if (r < 0) continue;
      for (int h = 0; h < H; ++h) ref_store(dt, y, (size_t)r * H + h, v[t][j]);
    }
  if (s == MOELINK_SUCCESS) s = moelink_moe_combine(S.m, y, T, plan_buf, out, NULL);
  CHECK(s == MOELINK_SUCCESS, "%s: combine-order plan + combine", dn);
  for (int t = 0; t < T && s == MOELINK_SUCCESS; ++t) {
    int ok = 1;
    double g = 0.0;
    /* The dtype rounding of want: store and reload. */
    unsigned char tmp[4];
    ref_store(dt, tmp, 0, want[t]);
    double wr = ref_load(dt, tmp, 0);
    for (int h = 0; h < H; ++h) {
      g = ref_load(dt, out, (size_t)t * H + h);
      if (g != wr) ok = 0;
    }
    CHECK(ok, "%s: combine token %d = %.9g (in-order fp32 sum, one rounding: %.9g)", dn, t, g, wr);
  }
  free(plan_buf);
  free(y);
  free(out);
  setup_close(&S);
}

int main(void) {
  if (moelink_context_create(NULL, &ctx) != MOELINK_SUCCESS) {
    CHECK(0, "CPU context: %s", moelink_last_error());
    return ml_test_done();
  }
  test_combine_order(MOELINK_DTYPE_F32);
  test_combine_order(MOELINK_DTYPE_BF16);
  test_combine_order(MOELINK_DTYPE_F16);
  run_dtype(MOELINK_DTYPE_F32, 1001);
  run_dtype(MOELINK_DTYPE_BF16, 2002);
  run_dtype(MOELINK_DTYPE_F16, 3003);
  moelink_context_destroy(ctx);
  return ml_test_done();
}
