/* moelink_moe_forward against the reference for every preset (reduced H and
 * I, same experts, top-k, groups and shared structure), all dtypes, T in
 * {0, 1, 7, 4097} with chunking, skewed routing, one hot expert, empty
 * experts; poisoned outputs, determinism. */
#include "harness.h"
#include "moelink.h"
#include "ref.h"

#include <stdint.h>

#define NEAR_TIE 1e-6

static moelink_context_t ctx;

static double tol_for(moelink_dtype_t dt) { return dt == MOELINK_DTYPE_F32 ? 1e-4 : 1e-2; }

typedef struct {
  const char *preset;
  int H, I, Is; /* reduced sizes; Is only where the preset has a shared expert */
} reduced;

static const reduced reduced_presets[] = {
    {"mixtral-8x7b", 95, 79, 0},    {"mixtral-8x22b", 72, 64, 0},
    {"qwen2-57b-a14b", 87, 41, 161}, {"qwen3-30b-a3b", 64, 33, 0},
    {"qwen3-235b-a22b", 128, 47, 0}, {"deepseek-v3", 113, 37, 37},
};

/* Outcome of comparing some tokens of a forward with the reference. */
typedef struct {
  double worst;
  int worst_token, compared, skipped, nonfinite;
} cmp_result;

/* Compares tokens list[0..n) of out against the reference; tokens the
 * reference finds on a near tie are skipped (and counted). */
static cmp_result compare_tokens(const ref_layer *L, const void *x, const void *out,
                                 const int *list, int n) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const size_t H = (size_t)cfg->hidden, es = moelink_dtype_size(cfg->dtype);
  cmp_result r = {0.0, -1, 0, 0, 0};
  double *want = malloc(sizeof(double) * H);
  for (int i = 0; i < n; ++i) {
    const int t = list[i];
    const char *xt = (const char *)x + (size_t)t * H * es;
    if (ref_route_margin(cfg, &L->w, xt) < NEAR_TIE) {
      ++r.skipped;
      continue;
    }
    double err = ref_forward_token(cfg, &L->w, xt, want) == 0
                     ? ref_rel_l2(cfg->dtype, (const char *)out + (size_t)t * H * es, want, H)
                     : INFINITY;
    ++r.compared;
    if (!(err <= r.worst)) {
      r.worst = isnan(err) ? INFINITY : err;
      r.worst_token = t;
    }
  }
  free(want);
  return r;
}

/* Every element of rows [0, T) is finite (unwritten poison is NaN). */
static int count_nonfinite(moelink_dtype_t dt, const void *out, size_t n) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i)
    if (!isfinite(ref_load(dt, out, i))) ++bad;
  return bad;
}

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != v) return 0;
  return 1;
}

static moelink_moe_t make_moe(const ref_layer *L, int max_tokens) {
  moelink_moe_config_t cfg = L->cfg;
  cfg.max_tokens = max_tokens;
  moelink_moe_t m = NULL;
  if (moelink_moe_create(ctx, &cfg, &m) != MOELINK_SUCCESS) return NULL;
  if (moelink_moe_set_weights(m, &L->w) != MOELINK_SUCCESS) {
    moelink_moe_destroy(m);
    return NULL;
  }
  return m;
}

/* One forward of T tokens through m: poisoned output with a guard row,
 * checks the guard, x unchanged, every output element written, then the
 * reference on `list` (all tokens when list is NULL). Returns the output
 * (caller frees) or NULL. */
static unsigned char *forward_and_check(const char *what, const ref_layer *L, moelink_moe_t m,
                                        const void *x, int T, const int *list, int n) {
  const moelink_dtype_t dt = L->cfg.dtype;
  const size_t H = (size_t)L->cfg.hidden, es = moelink_dtype_size(dt);
  const size_t row = H * es, nbytes = (size_t)T * row;
  unsigned char *out = malloc(nbytes + row);
  unsigned char *xcopy = malloc(nbytes + 1);
  memcpy(xcopy, x, nbytes);
  memset(out, 0xff, nbytes + row);
  moelink_status_t s = moelink_moe_forward(m, x, T, out, NULL);
  CHECK(s == MOELINK_SUCCESS, "%s: forward (%s)", what, s ? moelink_last_error() : "");
  if (s != MOELINK_SUCCESS) {
    free(out);
    free(xcopy);
    return NULL;
  }
  CHECK(all_bytes(out + nbytes, row, 0xff), "%s: nothing written past token T-1", what);
  CHECK(memcmp(xcopy, x, nbytes) == 0, "%s: x is left unchanged", what);
  free(xcopy);
  if (T == 0) return out;
  int nonfinite = count_nonfinite(dt, out, (size_t)T * H);
  CHECK(nonfinite == 0, "%s: every output element written and finite (%d are not)", what,
        nonfinite);
  int *all = NULL;
  if (!list) {
    all = malloc(sizeof(int) * (size_t)T);
    for (int t = 0; t < T; ++t) all[t] = t;
    list = all;
    n = T;
  }
  cmp_result r = compare_tokens(L, x, out, list, n);
  free(all);
  CHECK(r.worst <= tol_for(dt), "%s: %d tokens match the reference (worst rel L2 %.3g at token %d, tol %.0e)",
        what, r.compared, r.worst, r.worst_token, tol_for(dt));
  CHECK(r.skipped * 50 <= n || r.skipped <= 1, "%s: near-tie skips are rare (%d of %d)", what,
        r.skipped, n);
  ml_t_diag("%s: worst rel L2 %.3g over %d tokens, %d near-tie skips", what, r.worst, r.compared,
            r.skipped);
  return out;
}

static void run_preset(const reduced *rp, moelink_dtype_t dt, uint64_t seed) {
  const char *dn = moelink_dtype_name(dt);
  moelink_moe_config_t cfg;
  if (ref_preset_reduced(rp->preset, rp->H, rp->I, rp->Is, dt, &cfg) != 0) {
    CHECK(0, "preset %s: %s", rp->preset, moelink_last_error());
    return;
  }
  cfg.max_tokens = 3;
  ref_layer L;
  if (ref_layer_make(&L, &cfg, seed, 0.0) != 0) {
    CHECK(0, "%s/%s: reference layer", rp->preset, dn);
    return;
  }
  moelink_moe_t small = make_moe(&L, 3), big = make_moe(&L, 1000);
  CHECK(small && big, "%s/%s: layers with max_tokens 3 and 1000 (%s)", rp->preset, dn,
        moelink_last_error());
  if (!small || !big) {
    moelink_moe_destroy(small);
    moelink_moe_destroy(big);
    ref_layer_free(&L);
    return;
  }
  const size_t H = (size_t)cfg.hidden, es = moelink_dtype_size(dt), row = H * es;
  const int TB = 4097;
  unsigned char *x = malloc((size_t)TB * row);
  ref_fill_x(&L, x, TB, seed ^ 0x5555);
  char what[160];

  /* T = 0: success, nothing touched. */
  {
    unsigned char *out = malloc(row);
    memset(out, 0xff, row);
    CHECK_OK(moelink_moe_forward(small, x, 0, out, NULL), "forward T=0");
    CHECK(all_bytes(out, row, 0xff), "%s/%s T=0: output untouched", rp->preset, dn);
    free(out);
  }
  /* T = 1 and T = 7 (chunks of 3, 3, 1), every token checked. */
  snprintf(what, sizeof what, "%s/%s T=1", rp->preset, dn);
  free(forward_and_check(what, &L, small, x, 1, NULL, 0));
  snprintf(what, sizeof what, "%s/%s T=7 (max_tokens 3)", rp->preset, dn);
  unsigned char *o7 = forward_and_check(what, &L, small, x, 7, NULL, 0);
  if (o7) {
    unsigned char *again = malloc(7 * row);
    memset(again, 0xff, 7 * row);
    CHECK(moelink_moe_forward(small, x, 7, again, NULL) == MOELINK_SUCCESS &&
              memcmp(again, o7, 7 * row) == 0,
          "%s/%s T=7: a second forward is bitwise identical", rp->preset, dn);
    free(again);
  }

  /* T = 4097 in chunks of 1000 (and a last chunk of 97); the sample includes
   * both sides of every chunk boundary. */
  int list[160], n = 0;
  for (int t = 0; t < 4; ++t) list[n++] = t;
  for (int t = 61; t < TB - 4; t += 61) list[n++] = t;
  for (int b = 1000; b < TB; b += 1000) {
    list[n++] = b - 1;
    list[n++] = b;
    list[n++] = b + 1;
  }
  for (int t = TB - 4; t < TB; ++t) list[n++] = t;
  /* f32 is checked on every token (the reference is fast enough for one
   * dtype); bf16/f16 on the sample. */
  snprintf(what, sizeof what, "%s/%s T=4097 (max_tokens 1000)", rp->preset, dn);
  unsigned char *ob = dt == MOELINK_DTYPE_F32 ? forward_and_check(what, &L, big, x, TB, NULL, 0)
                                              : forward_and_check(what, &L, big, x, TB, list, n);
  if (ob) {
    unsigned char *again = malloc((size_t)TB * row);
    memset(again, 0xff, (size_t)TB * row);
    CHECK(moelink_moe_forward(big, x, TB, again, NULL) == MOELINK_SUCCESS &&
              memcmp(again, ob, (size_t)TB * row) == 0,
          "%s/%s T=4097: a second forward is bitwise identical", rp->preset, dn);
    /* Not promised, so only reported: does a prefix reproduce the first rows
     * of a longer call, and does the chunk size change results? */
    memset(again, 0xff, 7 * row);
    int prefix_same = moelink_moe_forward(big, x, 7, again, NULL) == MOELINK_SUCCESS &&
                      memcmp(again, ob, 7 * row) == 0;
    int chunk_same = o7 && memcmp(o7, ob, 7 * row) == 0;
    ml_t_diag("%s/%s: prefix of 7 == first rows of 4097: %s; max_tokens 3 vs 1000 equal: %s",
              rp->preset, dn, prefix_same ? "yes" : "no", chunk_same ? "yes" : "no");
    free(again);
  }
  free(o7);
  free(ob);
  free(x);
  moelink_moe_destroy(small);
  moelink_moe_destroy(big);
  ref_layer_free(&L);
}

/* A skewed layer: routing statistics through route(), then forward against
 * the reference on every token. want_single_expert >= 0: every token must
 * pick that expert (k = 1). */
static void run_skewed(const char *name, moelink_moe_config_t cfg, double alpha, int T,
                       uint64_t seed, const float *bias_override, int want_single_expert) {
  const char *dn = moelink_dtype_name(cfg.dtype);
  ref_layer L;
  if (ref_layer_make(&L, &cfg, seed, alpha) != 0) {
    CHECK(0, "%s/%s: reference layer", name, dn);
    return;
  }
  if (bias_override && L.bias) memcpy(L.bias, bias_override, sizeof(float) * cfg.num_experts);
  moelink_moe_t m = make_moe(&L, cfg.max_tokens);
  CHECK(m != NULL, "%s/%s: layer (%s)", name, dn, moelink_last_error());
  if (!m) {
    ref_layer_free(&L);
    return;
  }
  const size_t H = (size_t)cfg.hidden, es = moelink_dtype_size(cfg.dtype);
  const int k = cfg.top_k, E = cfg.num_experts;
  unsigned char *x = malloc((size_t)T * H * es);
  ref_fill_x(&L, x, T, seed + 3);
  /* Routing statistics from the pieces API (chunked by hand). */
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
  float *w = malloc(sizeof(float) * (size_t)T * k);
  int *count = calloc((size_t)E, sizeof(int));
  moelink_status_t s = MOELINK_SUCCESS;
  for (int t0 = 0; t0 < T && s == MOELINK_SUCCESS; t0 += cfg.max_tokens) {
    int n = T - t0 < cfg.max_tokens ? T - t0 : cfg.max_tokens;
    s = moelink_moe_route(m, x + (size_t)t0 * H * es, n, ids + (size_t)t0 * k,
                          w + (size_t)t0 * k, NULL);
  }
  CHECK(s == MOELINK_SUCCESS, "%s/%s: route (%s)", name, dn, s ? moelink_last_error() : "");
  int empty = 0, hot = 0;
  for (int q = 0; q < T * k && s == MOELINK_SUCCESS; ++q)
    if (ids[q] >= 0 && ids[q] < E) ++count[ids[q]];
  for (int e = 0; e < E; ++e) {
    if (count[e] == 0) ++empty;
    if (count[e] > count[hot]) hot = e;
  }
  ml_t_diag("%s/%s: %d of %d experts get no token; expert %d gets %d of %d pairs", name, dn,
            empty, E, hot, count[hot], T * k);
  if (want_single_expert >= 0)
    CHECK(count[want_single_expert] == T, "%s/%s: every token goes to expert %d (%d of %d)", name,
          dn, want_single_expert, count[want_single_expert], T);
  else
    CHECK(count[0] * E > 2 * T * k && (E < 64 || empty > 0),
          "%s/%s: skewed: expert 0 gets %d of %d pairs; %d experts get none", name, dn, count[0],
          T * k, empty);
  char what[160];
  snprintf(what, sizeof what, "%s/%s T=%d (max_tokens %d)", name, dn, T, cfg.max_tokens);
  unsigned char *out = forward_and_check(what, &L, m, x, T, NULL, 0);
  free(out);
  free(ids);
  free(w);
  free(count);
  free(x);
  moelink_moe_destroy(m);
  ref_layer_free(&L);
}

static void test_skew(moelink_dtype_t dt, uint64_t seed) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  c.dtype = dt;

  /* Mixtral-like, zipf 1.2. */
  c.hidden = 70;
  c.inter = 52;
  c.num_experts = 8;
  c.top_k = 2;
  c.max_tokens = 128;
  run_skewed("zipf1.2 E8 k2", c, 1.2, 300, seed + 1, NULL, -1);

  /* Qwen3-like, zipf 1.5: many empty experts. */
  c.hidden = 64;
  c.inter = 24;
  c.num_experts = 128;
  c.top_k = 8;
  c.max_tokens = 100;
  run_skewed("zipf1.5 E128 k8", c, 1.5, 250, seed + 2, NULL, -1);

  /* Every token on expert 0 (k = 1): one expert with more rows than a tile. */
  c.hidden = 66;
  c.inter = 40;
  c.num_experts = 8;
  c.top_k = 1;
  c.max_tokens = 256;
  run_skewed("all to expert 0", c, 30.0, 300, seed + 3, NULL, 0);

  /* DeepSeek-like groups, a bias that sends every token to expert 37. */
  float bias[64];
  for (int e = 0; e < 64; ++e) bias[e] = e == 37 ? 5.0f : -0.1f;
  c.hidden = 80;
  c.inter = 30;
  c.num_experts = 64;
  c.top_k = 1;
  c.router = MOELINK_ROUTER_SIGMOID_TOPK;
  c.n_group = 4;
  c.topk_group = 2;
  c.correction_bias = 1;
  c.routed_scaling = 2.5f;
  c.shared_inter = 30;
  c.max_tokens = 200;
  run_skewed("bias to expert 37", c, 0.0, 333, seed + 4, bias, 37);
}

int main(void) {
  if (moelink_context_create(NULL, &ctx) != MOELINK_SUCCESS) {
    CHECK(0, "CPU context: %s", moelink_last_error());
    return ml_test_done();
  }
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  uint64_t seed = 7;
  for (size_t p = 0; p < sizeof reduced_presets / sizeof reduced_presets[0]; ++p)
    for (int d = 0; d < 3; ++d) run_preset(&reduced_presets[p], dts[d], seed++ * 1000003);
  for (int d = 0; d < 3; ++d) test_skew(dts[d], 900 + (uint64_t)d * 10);
  moelink_context_destroy(ctx);
  return ml_test_done();
}
