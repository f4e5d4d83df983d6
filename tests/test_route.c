/* moelink_moe_route against the reference router, for every router family,
 * with groups, biases, scaling, odd expert counts, all dtypes and exact ties. */
#include "harness.h"
#include "moelink.h"
#include "ref.h"

#include <stdint.h>

/* A token whose deciding scores are closer than this (relative) may be routed
 * differently by fp32 arithmetic; its ids are not compared (counted as a
 * skip; skips must stay rare). */
#define NEAR_TIE 1e-6

static moelink_context_t ctx;

typedef struct {
  const char *name;
  int H, E, k;
  moelink_router_t router;
  int renormalize, n_group, topk_group;
  float scaling;
  int bias;
} route_case;

static double weight_tol(moelink_dtype_t dt) { return dt == MOELINK_DTYPE_F32 ? 1e-5 : 1e-3; }

/* Routes T tokens through the library and the reference; returns the number
 * of tokens whose ids differ (outside near ties) and reports the worst weight
 * error. */
static void run_case(const route_case *rc, moelink_dtype_t dt, int T, uint64_t seed) {
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = rc->H;
  cfg.inter = 3;
  cfg.num_experts = rc->E;
  cfg.top_k = rc->k;
  cfg.router = rc->router;
  cfg.renormalize = rc->renormalize;
  cfg.n_group = rc->n_group;
  cfg.topk_group = rc->topk_group;
  cfg.routed_scaling = rc->scaling;
  cfg.correction_bias = rc->bias;
  cfg.dtype = dt;
  cfg.max_tokens = T;
  const char *dn = moelink_dtype_name(dt);

  ref_layer L;
  if (ref_layer_make(&L, &cfg, seed, 0.0) != 0) {
    CHECK(0, "%s/%s: reference layer", rc->name, dn);
    return;
  }
  moelink_moe_t m = NULL;
  moelink_status_t s = moelink_moe_create(ctx, &cfg, &m);
  if (s == MOELINK_SUCCESS) s = moelink_moe_set_weights(m, &L.w);
  if (s != MOELINK_SUCCESS) {
    CHECK(0, "%s/%s: create + set_weights: %s", rc->name, dn, moelink_last_error());
    moelink_moe_destroy(m);
    ref_layer_free(&L);
    return;
  }
  const size_t es = moelink_dtype_size(dt), H = (size_t)rc->H;
  const int k = rc->k;
  char *x = malloc((size_t)T * H * es);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * (size_t)k);
  float *wts = malloc(sizeof(float) * (size_t)T * (size_t)k);
  int32_t *rids = malloc(sizeof(int32_t) * (size_t)k);
  double *rw = malloc(sizeof(double) * (size_t)k);
  ref_fill_x(&L, x, T, seed + 1000);
  for (size_t i = 0; i < (size_t)T * (size_t)k; ++i) {
    ids[i] = -12345;
    wts[i] = NAN;
  }
  CHECK_OK(moelink_moe_route(m, x, T, ids, wts, NULL), "route");

  int bad_ids = 0, skips = 0, first_bad = -1, ref_fail = 0;
  double worst = 0.0, min_margin = INFINITY;
  for (int t = 0; t < T; ++t) {
    const char *xt = x + (size_t)t * H * es;
    if (ref_route_token(&cfg, &L.w, xt, rids, rw) != 0) {
      ref_fail = 1;
      break;
    }
    double margin = ref_route_margin(&cfg, &L.w, xt);
    if (margin < min_margin) min_margin = margin;
    int same = 1;
    for (int j = 0; j < k; ++j)
      if (ids[(size_t)t * k + j] != rids[j]) same = 0;
    if (!same) {
      if (margin < NEAR_TIE) {
        ++skips;
        continue;
      }
      if (first_bad < 0) first_bad = t;
      ++bad_ids;
      continue;
    }
    for (int j = 0; j < k; ++j) {
      double g = wts[(size_t)t * k + j];
      double err = fabs(g - rw[j]) / fmax(1.0, fabs(rw[j]));
      if (!(err <= worst)) worst = isnan(err) ? INFINITY : fmax(worst, err);
    }
  }
  CHECK(!ref_fail, "%s/%s: reference routes the config", rc->name, dn);
  if (first_bad >= 0) {
    const size_t t = (size_t)first_bad;
    const char *xt = x + t * H * es;
    ref_route_token(&cfg, &L.w, xt, rids, rw);
    char got[256] = "", want[256] = "";
    for (int j = 0; j < k && j < 16; ++j) {
      char b[32];
      snprintf(b, sizeof b, " %d(%.6f)", ids[t * k + j], (double)wts[t * k + j]);
      strncat(got, b, sizeof got - strlen(got) - 1);
      snprintf(b, sizeof b, " %d(%.6f)", rids[j], rw[j]);
      strncat(want, b, sizeof want - strlen(want) - 1);
    }
    ml_t_diag("%s/%s: token %zu got ids%s, reference%s (margin %.3g)", rc->name, dn, t, got,
              want, ref_route_margin(&cfg, &L.w, xt));
  }
  CHECK(bad_ids == 0, "%s/%s: T=%d ids match the reference (%d mismatches, %d near-tie skips)",
        rc->name, dn, T, bad_ids, skips);
  CHECK(skips * 100 <= T, "%s/%s: near-tie skips are rare (%d of %d)", rc->name, dn, skips, T);
  CHECK(worst <= weight_tol(dt), "%s/%s: weights match the reference (max err %.3g, tol %.0e)",
        rc->name, dn, worst, weight_tol(dt));
  ml_t_diag("%s/%s: max weight err %.3g, smallest routing margin %.3g", rc->name, dn, worst,
            min_margin);

  free(x);
  free(ids);
  free(wts);
  free(rids);
  free(rw);
  moelink_moe_destroy(m);
  ref_layer_free(&L);
}

static void test_families(void) {
  static const route_case cases[] = {
      /* name, H, E, k, router, renorm, n_group, topk_group, scaling, bias */
      {"softmax E8 k2 renorm", 96, 8, 2, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0},
      {"softmax E60 k4 no-renorm", 77, 60, 4, MOELINK_ROUTER_SOFTMAX_TOPK, 0, 1, 1, 1.0f, 0},
      {"softmax E6 k1", 65, 6, 1, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0},
      {"softmax E6 k1 no-renorm", 65, 6, 1, MOELINK_ROUTER_SOFTMAX_TOPK, 0, 1, 1, 1.0f, 0},
      {"softmax E12 k=E renorm", 70, 12, 12, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0},
      {"softmax E12 k=E no-renorm", 70, 12, 12, MOELINK_ROUTER_SOFTMAX_TOPK, 0, 1, 1, 1.0f, 0},
      {"softmax E128 k8 scale2.5", 64, 128, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 2.5f, 0},
      {"softmax E60 k6 bias", 81, 60, 6, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 1},
      {"softmax E64 groups4/2", 72, 64, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 0, 4, 2, 1.0f, 0},
      {"softmax E64 groups4/2 bias", 72, 64, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 4, 2, 1.0f, 1},
      {"sigmoid E16 k4 renorm", 66, 16, 4, MOELINK_ROUTER_SIGMOID_TOPK, 1, 1, 1, 1.0f, 0},
      {"sigmoid E12 k3 no-renorm s2.5", 50, 12, 3, MOELINK_ROUTER_SIGMOID_TOPK, 0, 1, 1, 2.5f, 0},
      {"sigmoid E12 k=E", 50, 12, 12, MOELINK_ROUTER_SIGMOID_TOPK, 1, 1, 1, 1.0f, 1},
      {"sigmoid E64 groups4/2", 72, 64, 8, MOELINK_ROUTER_SIGMOID_TOPK, 1, 4, 2, 1.0f, 0},
      {"sigmoid E64 groups4/2 bias", 72, 64, 8, MOELINK_ROUTER_SIGMOID_TOPK, 1, 4, 2, 2.5f, 1},
      {"sigmoid E60 groups4/2 bias k1", 72, 60, 1, MOELINK_ROUTER_SIGMOID_TOPK, 1, 4, 2, 1.0f, 1},
      {"sigmoid E256 groups8/4 bias (dsv3)", 96, 256, 8, MOELINK_ROUTER_SIGMOID_TOPK, 1, 8, 4,
       2.5f, 1},
      {"sigmoid E8 groups of 1, keep 3", 40, 8, 2, MOELINK_ROUTER_SIGMOID_TOPK, 1, 8, 3, 1.0f, 1},
      {"sigmoid E12 groups6/2 k=4", 40, 12, 4, MOELINK_ROUTER_SIGMOID_TOPK, 0, 6, 2, 1.0f, 1},
      {"topk_softmax E12 k3", 88, 12, 3, MOELINK_ROUTER_TOPK_SOFTMAX, 1, 1, 1, 1.0f, 0},
      {"topk_softmax E12 k3 no-renorm", 88, 12, 3, MOELINK_ROUTER_TOPK_SOFTMAX, 0, 1, 1, 1.0f, 0},
      {"topk_softmax E32 k4 bias s2.5", 60, 32, 4, MOELINK_ROUTER_TOPK_SOFTMAX, 1, 1, 1, 2.5f, 1},
      {"topk_softmax E6 k1", 33, 6, 1, MOELINK_ROUTER_TOPK_SOFTMAX, 0, 1, 1, 1.0f, 0},
  };
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  uint64_t seed = 101;
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c)
    for (int d = 0; d < 3; ++d) run_case(&cases[c], dts[d], 257 + (int)c * 3, seed++ * 7919);
}

/* ---- exact ties -------------------------------------------------------------- */

typedef struct {
  moelink_moe_t m;
  moelink_moe_config_t cfg;
  float *router, *gate_up, *down, *bias;
  moelink_moe_weights_t w;
} tiny_layer;

/* An f32 layer whose router rows and inputs are small dyadic numbers, so every
 * logit is exact in any summation order and equal rows tie exactly. */
static int tiny_open(tiny_layer *L, moelink_moe_config_t cfg, const float *router,
                     const float *bias) {
  memset(L, 0, sizeof *L);
  L->cfg = cfg;
  size_t H = (size_t)cfg.hidden, E = (size_t)cfg.num_experts, I = (size_t)cfg.inter;
  L->router = malloc(sizeof(float) * E * H);
  memcpy(L->router, router, sizeof(float) * E * H);
  L->gate_up = calloc(E * 2 * I * H, sizeof(float));
  L->down = calloc(E * H * I, sizeof(float));
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.dtype = MOELINK_DTYPE_F32;
  w.router = L->router;
  w.gate_up = L->gate_up;
  w.down = L->down;
  if (bias) {
    L->bias = malloc(sizeof(float) * E);
    memcpy(L->bias, bias, sizeof(float) * E);
    w.correction_bias = L->bias;
  }
  L->w = w;
  if (moelink_moe_create(ctx, &cfg, &L->m) != MOELINK_SUCCESS) return -1;
  return moelink_moe_set_weights(L->m, &L->w) == MOELINK_SUCCESS ? 0 : -1;
}

static void tiny_close(tiny_layer *L) {
  moelink_moe_destroy(L->m);
  free(L->router);
  free(L->gate_up);
  free(L->down);
  free(L->bias);
}

/* Routes one token x and checks ids exactly and weights against `want`. */
static void check_tie(const char *what, tiny_layer *L, const float *x, const int32_t *want_ids,
                      const double *want_w) {
  const int k = L->cfg.top_k;
  int32_t ids[16], rids[16];
  float w[16];
  double rw[16];
  for (int j = 0; j < 16; ++j) ids[j] = -99;
  moelink_status_t s = moelink_moe_route(L->m, x, 1, ids, w, NULL);
  CHECK(s == MOELINK_SUCCESS, "%s: route (%s)", what, moelink_last_error());
  int ok = ref_route_token(&L->cfg, &L->w, x, rids, rw) == 0;
  char got[128] = "", exp[128] = "";
  for (int j = 0; j < k; ++j) {
    char b[24];
    snprintf(b, sizeof b, " %d", ids[j]);
    strncat(got, b, sizeof got - strlen(got) - 1);
    snprintf(b, sizeof b, " %d", want_ids[j]);
    strncat(exp, b, sizeof exp - strlen(exp) - 1);
    if (ids[j] != want_ids[j] || rids[j] != want_ids[j]) ok = 0;
  }
  CHECK(ok, "%s: ids [%s ] (want [%s ], reference agrees)", what, got, exp);
  int wok = 1;
  for (int j = 0; j < k; ++j)
    if (fabs(w[j] - want_w[j]) > 1e-6 || fabs(rw[j] - want_w[j]) > 1e-12) wok = 0;
  CHECK(wok, "%s: weights %.7f %.7f ... (want %.7f %.7f ...)", what, (double)w[0],
        k > 1 ? (double)w[1] : 0.0, want_w[0], k > 1 ? want_w[1] : 0.0);
}

static void test_ties(void) {
  enum { H = 4 };
  const float x[H] = {1.0f, 0.5f, -0.25f, 0.0f};
  /* Softmax, E = 8, k = 3: experts 1, 3, 5 share the best row, 6 is next. */
  {
    moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
    cfg.hidden = H;
    cfg.inter = 2;
    cfg.num_experts = 8;
    cfg.top_k = 3;
    cfg.dtype = MOELINK_DTYPE_F32;
    cfg.max_tokens = 4;
    float r[8 * H];
    for (int e = 0; e < 8; ++e) {
      float v = (e == 1 || e == 3 || e == 5) ? 1.0f : (e == 6 ? 0.5f : -0.5f);
      r[e * H + 0] = v;
      r[e * H + 1] = 0.25f * v;
      r[e * H + 2] = -0.125f;
      r[e * H + 3] = 0.75f;
    }
    tiny_layer L;
    if (tiny_open(&L, cfg, r, NULL) == 0) {
      const int32_t want[3] = {1, 3, 5};
      const double ww[3] = {1.0 / 3, 1.0 / 3, 1.0 / 3};
      check_tie("softmax 3-way tie, renormalized", &L, x, want, ww);
    } else {
      CHECK(0, "tie layer: %s", moelink_last_error());
    }
    tiny_close(&L);

    /* The tie straddles the k boundary: four equal best rows, k = 2. */
    for (int e = 0; e < 8; ++e) {
      float v = (e == 2 || e == 4 || e == 6 || e == 7) ? 1.0f : -1.0f;
      r[e * H + 0] = v;
      r[e * H + 1] = 0.5f * v;
    }
    cfg.top_k = 2;
    cfg.renormalize = 0;
    if (tiny_open(&L, cfg, r, NULL) == 0) {
      const int32_t want[2] = {2, 4};
      /* logits: 1 + 0.25 - 0.25*(-0.125)... computed in double below. */
      double lg[8], mx = -INFINITY, sum = 0.0;
      for (int e = 0; e < 8; ++e) {
        lg[e] = 0.0;
        for (int h = 0; h < H; ++h) lg[e] += (double)x[h] * r[e * H + h];
        mx = fmax(mx, lg[e]);
      }
      for (int e = 0; e < 8; ++e) sum += exp(lg[e] - mx);
      const double p = exp(lg[2] - mx) / sum;
      const double ww[2] = {p, p};
      check_tie("softmax 4-way tie across the k boundary", &L, x, want, ww);
    } else {
      CHECK(0, "tie layer: %s", moelink_last_error());
    }
    tiny_close(&L);

    /* Every expert equal, k = E: ids are 0..E-1 in order. */
    for (int i = 0; i < 8 * H; ++i) r[i] = 0.5f;
    cfg.top_k = 8;
    cfg.renormalize = 1;
    if (tiny_open(&L, cfg, r, NULL) == 0) {
      const int32_t want[8] = {0, 1, 2, 3, 4, 5, 6, 7};
      double ww[8];
      for (int j = 0; j < 8; ++j) ww[j] = 1.0 / 8;
      check_tie("all experts equal, k = E", &L, x, want, ww);
    } else {
      CHECK(0, "tie layer: %s", moelink_last_error());
    }
    tiny_close(&L);
  }
  /* Sigmoid with groups: groups 1 and 3 tie for the best group score; with
   * one group kept, group 1 (the lower index) wins. */
  {
    moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
    cfg.hidden = H;
    cfg.inter = 2;
    cfg.num_experts = 8;
    cfg.top_k = 2;
    cfg.router = MOELINK_ROUTER_SIGMOID_TOPK;
    cfg.renormalize = 0;
    cfg.n_group = 4;
    cfg.topk_group = 1;
    cfg.dtype = MOELINK_DTYPE_F32;
    cfg.max_tokens = 4;
    const float lv[8] = {0.0f, 0.0f, 1.0f, 0.5f, 0.0f, 0.0f, 1.0f, 0.5f};
    float r[8 * H];
    memset(r, 0, sizeof r);
    for (int e = 0; e < 8; ++e) r[e * H + 0] = lv[e]; /* x[0] = 1: logit = lv */
    tiny_layer L;
    if (tiny_open(&L, cfg, r, NULL) == 0) {
      const int32_t want[2] = {2, 3};
      const double ww[2] = {1.0 / (1.0 + exp(-1.0)), 1.0 / (1.0 + exp(-0.5))};
      check_tie("sigmoid group tie -> lower group", &L, x, want, ww);
    } else {
      CHECK(0, "group tie layer: %s", moelink_last_error());
    }
    tiny_close(&L);

    /* Two groups kept of four equal ones, k = 3: groups 0 and 1. Inside,
     * experts 1 and 3 are equal and best (lower first), then 0 and 2 tie for
     * the third slot: 0 wins. */
    const float lv2[8] = {0.5f, 1.0f, 0.5f, 1.0f, 0.5f, 1.0f, 0.5f, 1.0f};
    for (int e = 0; e < 8; ++e) r[e * H + 0] = lv2[e];
    cfg.top_k = 3;
    cfg.topk_group = 2;
    if (tiny_open(&L, cfg, r, NULL) == 0) {
      const int32_t want[3] = {1, 3, 0};
      const double a = 1.0 / (1.0 + exp(-1.0)), b = 1.0 / (1.0 + exp(-0.5));
      const double ww[3] = {a, a, b};
      check_tie("equal groups and equal experts", &L, x, want, ww);
    } else {
      CHECK(0, "group tie layer: %s", moelink_last_error());
    }
    tiny_close(&L);

    /* A bias can move a group's score into a tie: it decides, the weights
     * stay the unbiased sigmoid. Bias 0.25 on experts 4, 5 (group 2). */
    for (int e = 0; e < 8; ++e) r[e * H + 0] = 0.0f;
    r[2 * H] = 1.0f; /* group 1: expert 2 best */
    const float bias[8] = {0, 0, 0, 0, 0.25f, 0.25f, 0, 0};
    cfg.top_k = 2;
    cfg.topk_group = 1;
    cfg.correction_bias = 1;
    if (tiny_open(&L, cfg, r, bias) == 0) {
      /* group scores: g0 = 1.0, g1 = s(1) + 0.5 = 1.2311, g2 = 0.5+0.25+0.5+0.25 = 1.5,
       * g3 = 1.0 -> group 2 wins; experts 4, 5 tie -> 4 first. */
      const int32_t want[2] = {4, 5};
      const double ww[2] = {0.5, 0.5};
      check_tie("bias picks the group, weights unbiased", &L, x, want, ww);
    } else {
      CHECK(0, "group bias layer: %s", moelink_last_error());
    }
    tiny_close(&L);
  }
}

/* ---- the bias selects but does not weigh ------------------------------------- */

static void test_bias_selection_only(void) {
  const int H = 48, E = 16, k = 4, T = 64;
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = H;
  cfg.inter = 4;
  cfg.num_experts = E;
  cfg.top_k = k;
  cfg.router = MOELINK_ROUTER_SIGMOID_TOPK;
  cfg.renormalize = 0;
  cfg.correction_bias = 1;
  cfg.dtype = MOELINK_DTYPE_F32;
  cfg.max_tokens = T;
  ref_layer L;
  if (ref_layer_make(&L, &cfg, 4242, 0.0) != 0) {
    CHECK(0, "bias layer");
    return;
  }
  /* Large positive bias on 13 and 14: always selected first. */
  for (int e = 0; e < E; ++e) L.bias[e] = (e == 13 || e == 14) ? 10.0f : -0.01f * (float)e;
  moelink_moe_t m = NULL;
  moelink_status_t s = moelink_moe_create(ctx, &cfg, &m);
  if (s == MOELINK_SUCCESS) s = moelink_moe_set_weights(m, &L.w);
  CHECK(s == MOELINK_SUCCESS, "biased layer (%s)", moelink_last_error());
  float *x = malloc(sizeof(float) * (size_t)T * H);
  ref_fill_x(&L, x, T, 99);
  int32_t ids[64 * 4];
  float w[64 * 4];
  if (s == MOELINK_SUCCESS) s = moelink_moe_route(m, x, T, ids, w, NULL);
  CHECK(s == MOELINK_SUCCESS, "route (%s)", moelink_last_error());
  int forced = 1, unbiased = 1;
  double worst = 0.0;
  for (int t = 0; t < T && s == MOELINK_SUCCESS; ++t) {
    int a = ids[t * k], b = ids[t * k + 1];
    if (!((a == 13 && b == 14) || (a == 14 && b == 13))) forced = 0;
    for (int j = 0; j < k; ++j) {
      int e = ids[t * k + j];
      if (e < 0 || e >= E) {
        unbiased = 0;
        continue;
      }
      double lg = 0.0;
      for (int h = 0; h < H; ++h)
        lg += (double)x[t * H + h] * (double)((float *)L.router)[e * H + h];
      double want = 1.0 / (1.0 + exp(-lg));
      double err = fabs(w[t * k + j] - want);
      if (err > worst) worst = err;
      if (!(w[t * k + j] > 0.0f && w[t * k + j] < 1.0f)) unbiased = 0;
    }
  }
  CHECK(forced, "a +10 bias puts experts 13 and 14 first for every token");
  CHECK(unbiased && worst <= 1e-5,
        "weights are the unbiased sigmoid scores, in (0, 1) (max err %.3g)", worst);
  /* The same layer without the big bias routes differently. */
  int differs = 0;
  for (int e = 0; e < E; ++e) L.bias[e] = 0.0f;
  int32_t ids0[64 * 4];
  float w0[64 * 4];
  if (moelink_moe_route(m, x, T, ids0, w0, NULL) == MOELINK_SUCCESS) {
    for (int t = 0; t < T * k; ++t)
      if (ids0[t] != ids[t]) differs = 1;
    /* An expert picked in both runs gets the same weight. */
    int same_w = 1;
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j)
        for (int i = 0; i < k; ++i)
          if (ids0[t * k + i] == ids[t * k + j] && fabsf(w0[t * k + i] - w[t * k + j]) > 1e-6f)
            same_w = 0;
    CHECK(same_w, "an expert's weight does not depend on the bias");
  }
  CHECK(differs, "the bias changes the selection");
  free(x);
  moelink_moe_destroy(m);
  ref_layer_free(&L);
}

/* Correction bias with negative values: every token's selection moves with it. */
static void test_negative_bias(void) {
  route_case rc = {"softmax E8 k2 strong negative bias", 64, 8, 2, MOELINK_ROUTER_SOFTMAX_TOPK,
                   1, 1, 1, 1.0f, 1};
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = rc.H;
  cfg.inter = 4;
  cfg.num_experts = rc.E;
  cfg.top_k = rc.k;
  cfg.correction_bias = 1;
  cfg.dtype = MOELINK_DTYPE_F32;
  cfg.max_tokens = 128;
  ref_layer L;
  if (ref_layer_make(&L, &cfg, 777, 0.0) != 0) {
    CHECK(0, "negative bias layer");
    return;
  }
  /* Experts 0..5 pushed below -1: only 6 and 7 can be chosen. */
  for (int e = 0; e < 6; ++e) L.bias[e] = -1.5f - 0.1f * (float)e;
  L.bias[6] = -0.25f;
  L.bias[7] = -0.5f;
  moelink_moe_t m = NULL;
  moelink_status_t s = moelink_moe_create(ctx, &cfg, &m);
  if (s == MOELINK_SUCCESS) s = moelink_moe_set_weights(m, &L.w);
  float *x = malloc(sizeof(float) * 128 * (size_t)rc.H);
  ref_fill_x(&L, x, 128, 5);
  int32_t ids[256];
  float w[256];
  if (s == MOELINK_SUCCESS) s = moelink_moe_route(m, x, 128, ids, w, NULL);
  CHECK(s == MOELINK_SUCCESS, "route with negative biases (%s)", moelink_last_error());
  int ok = s == MOELINK_SUCCESS, wok = 1;
  for (int t = 0; t < 128 && ok; ++t) {
    int32_t rids[2];
    double rw[2];
    ref_route_token(&cfg, &L.w, x + (size_t)t * rc.H, rids, rw);
    int a = ids[2 * t], b = ids[2 * t + 1];
    if (!((a == 6 || a == 7) && (b == 6 || b == 7) && a != b)) ok = 0;
    if (a != rids[0] || b != rids[1]) ok = 0;
    if (fabs(w[2 * t] - rw[0]) > 1e-5 || fabs(w[2 * t + 1] - rw[1]) > 1e-5) wok = 0;
  }
  CHECK(ok, "only experts 6 and 7 survive the negative biases, ordered as the reference");
  CHECK(wok, "renormalized unbiased softmax weights match the reference");
  free(x);
  moelink_moe_destroy(m);
  ref_layer_free(&L);
}

int main(void) {
  if (moelink_context_create(NULL, &ctx) != MOELINK_SUCCESS) {
    CHECK(0, "CPU context: %s", moelink_last_error());
    return ml_test_done();
  }
  test_ties();
  test_bias_selection_only();
  test_negative_bias();
  test_families();
  moelink_context_destroy(ctx);
  return ml_test_done();
}
