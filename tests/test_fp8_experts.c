/* FP8 routed experts (cfg.fp8_experts) and shared expert (cfg.fp8_shared,
 * with and without FP8 routed experts) on the CPU backend: the layer against
 * the naive reference (tests/ref, its own e4m3 codec and activation
 * quantizer) for reduced mixtral-, deepseek- and qwen3-like layers, f32 and
 * bf16, T in {0, 1, 7, 130} (130 also in chunks of 64), and the pieces
 * (route, plan, experts) row by row against the reference's expert; poisoned
 * outputs;
 * bitwise determinism across runs and thread counts; the activation
 * quantization really changes the result; the config/weights error paths.
 *
 * The expert weights are drawn here in fp32 and quantized here per 128 x 128
 * block (s = amax / 448, byte = e4m3(w / s)), with a different magnitude per
 * block so that a scale read from the wrong block shows. */
#include "harness.h"
#include "moelink.h"
#include "ref.h"

#include <stdint.h>

#define NEAR_TIE 1e-6
#define BLK 128

static moelink_context_t ctx; /* default threads */

/* Tolerances. Both sides quantize the same weight bytes and follow the same
 * activation definition (the token row is the same fp32 values on both
 * sides, so its quantization is bit for bit the same), so what is left is
 * fp32 vs double arithmetic: the sum order and the fp32 rounding of each
 * dequantized weight (~1e-6 relative), and, rarely, an element of the SwiGLU
 * output within that ~1e-6 of an e4m3 rounding midpoint that lands on the
 * neighbouring code on one side only (measured worst per token ~1.5e-5 here).
 * f32: 1e-3 per token leaves room for such a flip, while a wrong scale block
 * or a missed quantization step shows at 1e-2 and more (the unquantized
 * activations alone differ by ~4e-2, checked below). bf16 adds the output's
 * rounding (2^-9, measured ~2e-3): 1e-2 as in the other layer tests. The
 * aggregate over all tokens of a call is held to a tenth for f32. */
static double tol_token(moelink_dtype_t dt) { return dt == MOELINK_DTYPE_F32 ? 1e-3 : 1e-2; }
static double tol_all(moelink_dtype_t dt) { return dt == MOELINK_DTYPE_F32 ? 1e-4 : 1e-2; }

typedef struct {
  const char *preset;
  int H, I, Is; /* H, I multiples of 128; Is any (a multiple of 128 with FP8_SHARED) */
  int fp8;      /* FP8_EXPERTS | FP8_SHARED */
} reduced;
enum { FP8_EXPERTS = 1, FP8_SHARED = 2 };

static const reduced presets[] = {
    {"mixtral-8x7b", 256, 128, 0, FP8_EXPERTS},  /* softmax, k = 2 */
    {"deepseek-v3", 256, 128, 72, FP8_EXPERTS},  /* sigmoid + bias + groups, shared expert */
    {"qwen3-30b-a3b", 128, 256, 0, FP8_EXPERTS}, /* softmax, k = 8 of 128 */
    /* the shared expert in FP8 too (its weights from the reference generator,
     * quantized by ref_fp8_quantize), and alone */
    {"deepseek-v3", 256, 128, 128, FP8_EXPERTS | FP8_SHARED},
    {"deepseek-v3", 128, 128, 256, FP8_SHARED},
};

/* FP8 expert weights: bytes and block scales for [E, rows, cols] matrices. */
typedef struct {
  uint8_t *gu, *dn;
  float *gu_s, *dn_s;
} fp8_w;

/* Quantizes one expert's [rows, cols] fp32 matrix per 128 x 128 block (the
 * reference's quantizer). */
static void quantize_matrix(const float *w, int rows, int cols, uint8_t *q, float *sc) {
  ref_fp8_quantize(MOELINK_DTYPE_F32, w, rows, cols, q, sc);
}

/* Draws [rows, cols] uniform in [-scale, scale), each 128 x 128 block times a
 * factor in {1/4, 1/2, 1, 2, 4}; block (0, 0) of expert 0 is all zeros
 * (scale 0) when zero_block. */
static void draw_matrix(float *w, int rows, int cols, float scale, uint64_t *st, int zero_block) {
  for (int br = 0; br < rows / BLK; ++br)
    for (int bc = 0; bc < cols / BLK; ++bc) {
      const float f = ldexpf(1.0f, (int)(ml_t_rand(st) % 5) - 2);
      const int zero = zero_block && br == 0 && bc == 0;
      for (int r = br * BLK; r < (br + 1) * BLK; ++r)
        for (int c = bc * BLK; c < (bc + 1) * BLK; ++c)
          w[(size_t)r * cols + c] =
              zero ? 0.0f : (float)((2.0 * ml_t_unit(st) - 1.0) * scale * f);
    }
}

static int make_fp8(const moelink_moe_config_t *c, uint64_t seed, fp8_w *f) {
  const int H = c->hidden, I = c->inter, E = c->num_experts;
  const size_t gu = 2 * (size_t)I * H, dn = (size_t)H * I, nsg = gu / (BLK * BLK);
  f->gu = malloc(gu * E);
  f->dn = malloc(dn * E);
  f->gu_s = malloc(sizeof(float) * nsg * E);
  f->dn_s = malloc(sizeof(float) * (nsg / 2) * E);
  float *tmp = malloc(sizeof(float) * gu);
  if (!f->gu || !f->dn || !f->gu_s || !f->dn_s || !tmp) {
    free(tmp);
    return -1;
  }
  uint64_t st = seed * 2654435761u + 12345u;
  for (int e = 0; e < E; ++e) {
    draw_matrix(tmp, 2 * I, H, 2.0f / sqrtf((float)H), &st, e == 0);
    quantize_matrix(tmp, 2 * I, H, f->gu + (size_t)e * gu, f->gu_s + (size_t)e * nsg);
    draw_matrix(tmp, H, I, 2.0f / sqrtf((float)I), &st, 0);
    quantize_matrix(tmp, H, I, f->dn + (size_t)e * dn, f->dn_s + (size_t)e * (nsg / 2));
  }
  free(tmp);
  return 0;
}

static void free_fp8(fp8_w *f) {
  free(f->gu);
  free(f->dn);
  free(f->gu_s);
  free(f->dn_s);
}

static moelink_moe_t make_moe(moelink_context_t cx, const moelink_moe_config_t *c,
                              const moelink_moe_weights_t *w, int max_tokens) {
  moelink_moe_config_t cfg = *c;
  cfg.max_tokens = max_tokens;
  moelink_moe_t m = NULL;
  moelink_status_t s = moelink_moe_create(cx, &cfg, &m);
  if (s == MOELINK_SUCCESS) s = moelink_moe_set_weights(m, w);
  if (s != MOELINK_SUCCESS) {
    ml_t_diag("layer setup: %s", moelink_last_error());
    moelink_moe_destroy(m);
    return NULL;
  }
  return m;
}

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != v) return 0;
  return 1;
}

/* Forward into a poisoned buffer with a guard row; NULL on failure. */
static unsigned char *forward(const char *what, moelink_moe_t m, const moelink_moe_config_t *c,
                              const void *x, int T) {
  const size_t row = (size_t)c->hidden * moelink_dtype_size(c->dtype), n = (size_t)T * row;
  unsigned char *out = malloc(n + row);
  memset(out, 0xff, n + row);
  moelink_status_t s = moelink_moe_forward(m, x, T, out, NULL);
  CHECK(s == MOELINK_SUCCESS, "%s: forward (%s)", what, s ? moelink_last_error() : "");
  CHECK(all_bytes(out + n, row, 0xff), "%s: nothing written past token T-1", what);
  if (s != MOELINK_SUCCESS) {
    free(out);
    return NULL;
  }
  return out;
}

/* Every token against the reference; near routing ties skipped. */
static void compare(const char *what, const moelink_moe_config_t *c,
                    const moelink_moe_weights_t *w, const void *x, const void *out, int T) {
  const size_t H = (size_t)c->hidden, es = moelink_dtype_size(c->dtype);
  double *want = malloc(sizeof(double) * H);
  double worst = 0.0, diff = 0.0, norm = 0.0;
  int worst_t = -1, skipped = 0, nonfinite = 0;
  for (int t = 0; t < T; ++t) {
    const char *xt = (const char *)x + (size_t)t * H * es;
    const char *ot = (const char *)out + (size_t)t * H * es;
    for (size_t i = 0; i < H; ++i)
      if (!isfinite(ref_load(c->dtype, ot, i))) ++nonfinite;
    if (ref_route_margin(c, w, xt) < NEAR_TIE) {
      ++skipped;
      continue;
    }
    if (ref_forward_token(c, w, xt, want) != 0) {
      worst = INFINITY;
      continue;
    }
    const double err = ref_rel_l2(c->dtype, ot, want, H);
    if (!(err <= worst)) {
      worst = isnan(err) ? INFINITY : err;
      worst_t = t;
    }
    for (size_t i = 0; i < H; ++i) {
      const double g = ref_load(c->dtype, ot, i);
      diff += (g - want[i]) * (g - want[i]);
      norm += want[i] * want[i];
    }
  }
  free(want);
  const double all = norm > 0.0 ? sqrt(diff / norm) : sqrt(diff);
  CHECK(nonfinite == 0, "%s: every output element written and finite (%d are not)", what,
        nonfinite);
  CHECK(worst <= tol_token(c->dtype),
        "%s: each token matches the reference (worst rel L2 %.3g at token %d, tol %.0e)", what,
        worst, worst_t, tol_token(c->dtype));
  CHECK(all <= tol_all(c->dtype), "%s: all tokens together: rel L2 %.3g (tol %.0e)", what, all,
        tol_all(c->dtype));
  CHECK(skipped * 20 <= T || skipped <= 1, "%s: near-tie skips are rare (%d of %d)", what,
        skipped, T);
}

/* Relative L2 distance of two outputs of dtype. */
static double rel_dist(moelink_dtype_t dt, const void *a, const void *b, size_t n) {
  double d = 0.0, s = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double x = ref_load(dt, a, i), y = ref_load(dt, b, i);
    d += (x - y) * (x - y);
    s += y * y;
  }
  return s > 0.0 ? sqrt(d / s) : sqrt(d);
}

/* The same layer with the fp8 weights dequantized into dtype and
 * fp8_experts 0: its output must differ clearly from the fp8 layer's, which
 * shows the activations are quantized (the weights are the same values up to
 * their dtype rounding). */
static void check_activation_quant(const char *what, const ref_layer *L, const fp8_w *f,
                                   const void *x, int T, const void *out_fp8) {
  moelink_moe_config_t c = L->cfg;
  c.fp8_experts = 0;
  const moelink_dtype_t dt = c.dtype;
  const int H = c.hidden, I = c.inter, E = c.num_experts;
  const size_t gu = 2 * (size_t)I * H, dn = (size_t)H * I, es = moelink_dtype_size(dt);
  void *wgu = malloc(gu * E * es), *wdn = malloc(dn * E * es);
  const int nbh = H / BLK, nbi = I / BLK;
  for (size_t e = 0; e < (size_t)E; ++e) {
    for (int r = 0; r < 2 * I; ++r)
      for (int k = 0; k < H; ++k) {
        const size_t at = e * gu + (size_t)r * H + k;
        const float s = f->gu_s[e * (gu / (BLK * BLK)) + (size_t)(r / BLK) * nbh + k / BLK];
        ref_store(dt, wgu, at, ref_load(MOELINK_DTYPE_FP8_E4M3, f->gu, at) * s);
      }
    for (int r = 0; r < H; ++r)
      for (int k = 0; k < I; ++k) {
        const size_t at = e * dn + (size_t)r * I + k;
        const float s = f->dn_s[e * (dn / (BLK * BLK)) + (size_t)(r / BLK) * nbi + k / BLK];
        ref_store(dt, wdn, at, ref_load(MOELINK_DTYPE_FP8_E4M3, f->dn, at) * s);
      }
  }
  moelink_moe_weights_t w = L->w;
  w.gate_up = wgu;
  w.down = wdn;
  w.gate_up_scale = NULL;
  w.down_scale = NULL;
  moelink_moe_t m = make_moe(ctx, &c, &w, 1024);
  CHECK(m != NULL, "%s: the same layer with dequantized weights", what);
  if (m) {
    unsigned char *out = forward(what, m, &c, x, T);
    if (out) {
      const double d = rel_dist(dt, out_fp8, out, (size_t)T * H);
      /* e4m3 keeps 3 mantissa bits: quantizing x and h moves the output by
       * a few percent; 5e-3 is far above both tolerances' noise. */
      CHECK(d > 5e-3 && d < 0.2,
            "%s: fp8 activations change the output vs unquantized (rel L2 %.3g)", what, d);
    }
    free(out);
    moelink_moe_destroy(m);
  }
  free(wgu);
  free(wdn);
}

/* Two forwards on one layer, and layers on 1, 2 and 3 threads: all bitwise
 * equal. */
static void check_determinism(const char *what, const moelink_moe_config_t *c,
                              const moelink_moe_weights_t *w, const void *x, int T,
                              const void *ref_out) {
  const size_t n = (size_t)T * c->hidden * moelink_dtype_size(c->dtype);
  for (int nt = 1; nt <= 3; ++nt) {
    moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
    cc.num_threads = nt;
    moelink_context_t cx = NULL;
    if (moelink_context_create(&cc, &cx) != MOELINK_SUCCESS) {
      CHECK(0, "context of %d threads: %s", nt, moelink_last_error());
      continue;
    }
    moelink_moe_t m = make_moe(cx, c, w, 1024);
    if (m) {
      unsigned char *a = forward(what, m, c, x, T);
      unsigned char *b = forward(what, m, c, x, T);
      CHECK(a && b && memcmp(a, b, n) == 0 && memcmp(a, ref_out, n) == 0,
            "%s: %d threads, two runs: bitwise equal to the default context's output", what,
            nt);
      free(a);
      free(b);
    } else {
      CHECK(0, "%s: layer on %d threads", what, nt);
    }
    moelink_moe_destroy(m);
    moelink_context_destroy(cx);
  }
}

/* The pieces: route, plan, then moelink_moe_experts (token rows read in the
 * layer dtype) row by row against the reference's expert on that token,
 * times the routing weight. */
static void check_pieces(const char *what, moelink_moe_t m, const moelink_moe_config_t *c,
                         const moelink_moe_weights_t *w, const void *x, int T) {
  const int k = c->top_k, E = c->num_experts;
  const size_t H = (size_t)c->hidden, es = moelink_dtype_size(c->dtype);
  const int tile = moelink_moe_tile_rows(m);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
  float *wts = malloc(sizeof(float) * (size_t)T * k);
  void *pb = malloc(moelink_plan_bytes(T, k, E, tile));
  unsigned char *y = malloc((size_t)T * k * H * es + H * es);
  double *want = malloc(sizeof(double) * H);
  memset(y, 0xff, (size_t)T * k * H * es + H * es);
  moelink_plan_t plan;
  moelink_status_t s = moelink_moe_route(m, x, T, ids, wts, NULL);
  if (s == MOELINK_SUCCESS) s = moelink_moe_plan(m, ids, T, pb, NULL);
  if (s == MOELINK_SUCCESS) s = moelink_moe_experts(m, x, T, pb, wts, y, NULL);
  if (s == MOELINK_SUCCESS) s = moelink_plan_view(pb, T, k, E, tile, &plan);
  CHECK(s == MOELINK_SUCCESS, "%s: route, plan, experts (%s)", what,
        s ? moelink_last_error() : "");
  if (s == MOELINK_SUCCESS) {
    const int R = plan.expert_offsets[E];
    double worst = 0.0;
    int worst_r = -1;
    for (int r = 0; r < R; ++r) {
      const int p = plan.sorted_pairs[r], t = p / k;
      ref_expert_token(c, w, ids[p], (const char *)x + (size_t)t * H * es, want);
      for (size_t i = 0; i < H; ++i) want[i] *= (double)wts[p];
      const double err = ref_rel_l2(c->dtype, y + (size_t)r * H * es, want, H);
      if (!(err <= worst)) {
        worst = isnan(err) ? INFINITY : err;
        worst_r = r;
      }
    }
    CHECK(R == T * k && worst <= tol_token(c->dtype),
          "%s: moelink_moe_experts rows match the reference's experts (%d rows, worst rel L2 "
          "%.3g at row %d)", what, R, worst, worst_r);
    CHECK(all_bytes(y + (size_t)R * H * es, H * es, 0xff), "%s: nothing written past row R-1",
          what);
  }
  free(ids);
  free(wts);
  free(pb);
  free(y);
  free(want);
}

static void run_preset(const reduced *rp, moelink_dtype_t dt, uint64_t seed) {
  moelink_moe_config_t cfg;
  if (ref_preset_reduced(rp->preset, rp->H, rp->I, rp->Is, dt, &cfg) != 0) {
    CHECK(0, "preset %s: %s", rp->preset, moelink_last_error());
    return;
  }
  cfg.fp8_shared = (rp->fp8 & FP8_SHARED) != 0;
  const int experts = (rp->fp8 & FP8_EXPERTS) != 0;
  ref_layer L;
  fp8_w f;
  memset(&f, 0, sizeof f);
  if (ref_layer_make(&L, &cfg, seed, 0.0) != 0 || (experts && make_fp8(&cfg, seed, &f) != 0)) {
    CHECK(0, "%s: test data", rp->preset);
    free_fp8(&f);
    return;
  }
  CHECK(!cfg.fp8_shared || (L.w.shared_gate_up_scale && L.w.shared_down_scale),
        "%s: the reference generator made FP8 shared weights", rp->preset);
  if (experts) {
    L.cfg.fp8_experts = 1;
    L.w.gate_up = f.gu;
    L.w.down = f.dn;
    L.w.gate_up_scale = f.gu_s;
    L.w.down_scale = f.dn_s;
  }

  moelink_moe_t m = make_moe(ctx, &L.cfg, &L.w, 1024);
  moelink_moe_t chunked = make_moe(ctx, &L.cfg, &L.w, 64);
  CHECK(m && chunked, "%s %s: fp8 layer created, weights set", rp->preset,
        moelink_dtype_name(dt));
  static const int Ts[] = {0, 1, 7, 130};
  const size_t es = moelink_dtype_size(dt);
  for (size_t ti = 0; m && chunked && ti < sizeof Ts / sizeof Ts[0]; ++ti) {
    const int T = Ts[ti];
    char what[128];
    snprintf(what, sizeof what, "%s%s%s %s T=%d", rp->preset, experts ? "" : " (dtype experts)",
             cfg.fp8_shared ? " fp8 shared" : "", moelink_dtype_name(dt), T);
    void *x = malloc((size_t)(T ? T : 1) * cfg.hidden * es);
    ref_fill_x(&L, x, T, seed + 7 + (uint64_t)T);
    unsigned char *out = forward(what, m, &L.cfg, x, T);
    if (out && T > 0) {
      compare(what, &L.cfg, &L.w, x, out, T);
      if (T >= 7) check_pieces(what, m, &L.cfg, &L.w, x, T);
      if (T == 130) {
        char w2[160];
        snprintf(w2, sizeof w2, "%s (chunks of 64)", what);
        unsigned char *oc = forward(w2, chunked, &L.cfg, x, T);
        if (oc) compare(w2, &L.cfg, &L.w, x, oc, T);
        free(oc);
        check_determinism(what, &L.cfg, &L.w, x, T, out);
        if (experts)
          check_activation_quant(what, &L, &f, x, T, out);
      }
    }
    free(out);
    free(x);
  }
  moelink_moe_destroy(m);
  moelink_moe_destroy(chunked);
  free_fp8(&f);
  ref_layer_free(&L);
}

/* The checks of create and set_weights. */
static void check_errors(void) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  moelink_moe_preset("mixtral-8x7b", &c);
  c.hidden = 256;
  c.inter = 128;
  c.dtype = MOELINK_DTYPE_F32;
  c.max_tokens = 16;
  c.fp8_experts = 1;
  moelink_moe_t m = NULL;
  moelink_moe_config_t bad = c;
  bad.hidden = 200;
  CHECK_STATUS(moelink_moe_create(ctx, &bad, &m), MOELINK_ERR_INVALID_ARGUMENT,
               "fp8_experts with hidden 200");
  CHECK(m == NULL, "no layer made for hidden 200");
  bad = c;
  bad.inter = 192;
  CHECK_STATUS(moelink_moe_create(ctx, &bad, &m), MOELINK_ERR_INVALID_ARGUMENT,
               "fp8_experts with inter 192");
  CHECK_STATUS(moelink_moe_config_check(&bad), MOELINK_ERR_INVALID_ARGUMENT,
               "config_check: fp8_experts with inter 192");
  bad = c;
  bad.fp8_experts = 2;
  CHECK_STATUS(moelink_moe_create(ctx, &bad, &m), MOELINK_ERR_INVALID_ARGUMENT,
               "fp8_experts 2");
  bad = c;
  bad.fp8_experts = 0;
  bad.hidden = 200;
  CHECK_OK(moelink_moe_config_check(&bad), "hidden 200 without fp8_experts is fine");

  ref_layer L;
  fp8_w f;
  memset(&f, 0, sizeof f);
  moelink_moe_config_t c0 = c;
  c0.fp8_experts = 0;
  if (ref_layer_make(&L, &c0, 99, 0.0) != 0 || make_fp8(&c, 99, &f) != 0) {
    CHECK(0, "error-path test data");
    free_fp8(&f);
    return;
  }
  moelink_moe_weights_t w = L.w;
  w.gate_up = f.gu;
  w.down = f.dn;
  w.gate_up_scale = f.gu_s;
  w.down_scale = f.dn_s;
  CHECK_OK(moelink_moe_create(ctx, &c, &m), "fp8 layer H 256, I 128");
  if (m) {
    moelink_moe_weights_t ww = w;
    ww.gate_up_scale = NULL;
    CHECK_STATUS(moelink_moe_set_weights(m, &ww), MOELINK_ERR_INVALID_ARGUMENT,
                 "fp8_experts with gate_up_scale NULL");
    CHECK(strstr(moelink_last_error(), "gate_up_scale") != NULL, "the message names gate_up_scale");
    ww = w;
    ww.down_scale = NULL;
    CHECK_STATUS(moelink_moe_set_weights(m, &ww), MOELINK_ERR_INVALID_ARGUMENT,
                 "fp8_experts with down_scale NULL");
    CHECK(strstr(moelink_last_error(), "down_scale") != NULL, "the message names down_scale");
    float xo[2 * 256] = {0};
    CHECK_STATUS(moelink_moe_forward(m, xo, 1, xo + 256, NULL), MOELINK_ERR_INVALID_STATE,
                 "forward after only rejected weights");
    CHECK_OK(moelink_moe_set_weights(m, &w), "fp8 weights with both scales");
    moelink_moe_destroy(m);
    m = NULL;
  }
  CHECK_OK(moelink_moe_create(ctx, &c0, &m), "the same layer without fp8_experts");
  if (m) {
    CHECK_STATUS(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT,
                 "scales given without fp8_experts");
    moelink_moe_weights_t ww = w;
    ww.gate_up_scale = NULL;
    CHECK_STATUS(moelink_moe_set_weights(m, &ww), MOELINK_ERR_INVALID_ARGUMENT,
                 "down_scale alone given without fp8_experts");
    moelink_moe_destroy(m);
  }
  free_fp8(&f);
  ref_layer_free(&L);
}

/* The checks of fp8_shared in create and set_weights. */
static void check_shared_errors(void) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  moelink_moe_preset("deepseek-v3", &c);
  c.hidden = 256;
  c.inter = 128;
  c.num_experts = 16;
  c.n_group = 4;
  c.topk_group = 2;
  c.shared_inter = 128;
  c.dtype = MOELINK_DTYPE_F32;
  c.max_tokens = 16;
  c.fp8_shared = 1;
  moelink_moe_t m = NULL;
  moelink_moe_config_t bad = c;
  bad.shared_inter = 0;
  CHECK_STATUS(moelink_moe_config_check(&bad), MOELINK_ERR_INVALID_ARGUMENT,
               "fp8_shared without a shared expert");
  CHECK(strstr(moelink_last_error(), "fp8_shared") != NULL, "the message names fp8_shared");
  bad = c;
  bad.shared_inter = 192;
  CHECK_STATUS(moelink_moe_create(ctx, &bad, &m), MOELINK_ERR_INVALID_ARGUMENT,
               "fp8_shared with shared_inter 192");
  CHECK(m == NULL, "no layer made for shared_inter 192");
  bad = c;
  bad.fp8_shared = 2;
  CHECK_STATUS(moelink_moe_config_check(&bad), MOELINK_ERR_INVALID_ARGUMENT, "fp8_shared 2");

  ref_layer L;
  if (ref_layer_make(&L, &c, 98, 0.0) != 0) {
    CHECK(0, "fp8_shared error-path test data");
    return;
  }
  CHECK_OK(moelink_moe_create(ctx, &c, &m), "fp8_shared layer");
  if (m) {
    moelink_moe_weights_t ww = L.w;
    ww.shared_down_scale = NULL;
    CHECK_STATUS(moelink_moe_set_weights(m, &ww), MOELINK_ERR_INVALID_ARGUMENT,
                 "fp8_shared with shared_down_scale NULL");
    CHECK(strstr(moelink_last_error(), "shared_down_scale") != NULL,
          "the message names shared_down_scale");
    CHECK_OK(moelink_moe_set_weights(m, &L.w), "fp8_shared weights with both scales");
    moelink_moe_destroy(m);
    m = NULL;
  }
  moelink_moe_config_t c0 = c;
  c0.fp8_shared = 0;
  CHECK_OK(moelink_moe_create(ctx, &c0, &m), "the same layer without fp8_shared");
  if (m) {
    CHECK_STATUS(moelink_moe_set_weights(m, &L.w), MOELINK_ERR_INVALID_ARGUMENT,
                 "shared scales given without fp8_shared");
    moelink_moe_destroy(m);
  }
  ref_layer_free(&L);
}

int main(void) {
  if (moelink_context_create(NULL, &ctx) != MOELINK_SUCCESS) {
    CHECK(0, "CPU context: %s", moelink_last_error());
    return ml_test_done();
  }
  check_errors();
  static const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16};
  for (size_t p = 0; p < sizeof presets / sizeof presets[0]; ++p)
    for (size_t d = 0; d < 2; ++d) run_preset(&presets[p], dts[d], 1000 + 17 * p + d);
  check_shared_errors();
  moelink_context_destroy(ctx);
  return ml_test_done();
}
