/* moelink_moe_forward on the GPU against the CPU backend:
 *  - every preset at reduced H/I (router family, groups, bias, scaling and
 *    shared expert kept), plus top-k-then-softmax, softmax with groups, zipf
 *    skew, all tokens on one or two experts (the others empty), a chunked
 *    forward; T in {1, 7, 128, 4097}; every output token compared;
 *  - FP8 routed experts (cfg.fp8_experts) on reduced mixtral-8x7b,
 *    qwen3-30b-a3b (also skewed) and deepseek-v3 layers, bf16 and f16, the
 *    same batches, against the CPU backend's FP8 forward and the double
 *    reference on up to 256 tokens a batch (tolerances: layer_tol_for);
 *  - every preset at full size, weights filled on the device, the CPU
 *    reference on a sample of tokens (weights copied back to the host, so both
 *    sides hold the same values by construction).
 * Outputs are poisoned before each run; tokens whose routing is a near tie
 * (fp32 summation order may flip it) are reported and left out. */
#include "gpu_util.h"

static moelink_context_t g_gpu, g_cpu;

static const int g_Ts[] = {1, 7, 128, 4097};
#define NTS ((int)(sizeof g_Ts / sizeof g_Ts[0]))

/* ---- FP8 experts: tolerances, the reference on many tokens ------------------------- */

/* Tolerances of a layer's GPU output against the CPU backend's (and the
 * double reference's): a batch, one token. */
typedef struct layer_tol {
  double all, row;
} layer_tol;

/* FP8 experts. Both backends quantize each expert's inputs per 128 elements
 * (s = amax / 448, e4m3 codes) from the same values (token rows in the
 * dtype, SwiGLU rows in fp32) and read the same weight bytes. What differs is
 * the arithmetic before the SwiGLU rows are quantized: the GPU's fp8 MMA adds
 * its products keeping about 13 fraction bits inside each k32 step (~1e-4
 * relative on these block sums), the CPU sums dequantized fp32 weights. e4m3
 * has 3 mantissa bits, codes about 9% of a value apart, so such a relative
 * move d changes an element's code with probability ~d / 0.09 (~1e-3 of the
 * elements of h), and each changed code moves its element by ~9%: h, and each
 * expert's output after the down projection, differ by ~sqrt(1e-3) x 0.09 =
 * 3e-3 relative L2. Over a batch that is within GU_TOL. A host model of the
 * layer on these very layers (reduced presets, T 4097, ref_layer_make's data,
 * tests/ref's codec; 1e-4 relative noise on gate/up) measured 2.3e-3..4.0e-3
 * over the batch (3e-4 noise: 4.0e-3..6.3e-3), at most 5.7e-3 (7.7e-3) over
 * any 128 consecutive tokens. But one token's 128-element h holds only a
 * Poisson handful of changed codes, and a changed code of a large element
 * moves that token by a few percent: 0.2..3% of the tokens (3e-4: 1.4..9%)
 * were past 1e-2, the worst of 4097 at 1.3e-2..4.0e-2 (4.3e-2). Hence for
 * fp8: GU_TOL over batches of FP8_MIN_AGG tokens or more, GU_FP8_TOL_ROW for a
 * token and for smaller batches. A layer that skipped quantizing h would be
 * off by 1.5e-2..2.3e-2 over a batch, one that skipped quantizing the token
 * rows by 3e-2..5e-2. The bf16/f16 layers keep GU_TOL / GU_TOL_ROW. */
#define FP8_MIN_AGG 100
/* fp8_ref_check compares at most this many tokens of a batch (evenly spaced). */
#define FP8_REF_TOKENS 256

static layer_tol layer_tol_for(const moelink_moe_config_t *c, int tokens) {
  layer_tol t = {GU_TOL, GU_TOL_ROW};
  if (c->fp8_experts || c->fp8_shared) {
    t.all = tokens >= FP8_MIN_AGG ? GU_TOL : GU_FP8_TOL_ROW;
    t.row = GU_FP8_TOL_ROW;
  }
  return t;
}

/* The GPU's output go [T, H] against the double reference (ref_forward_token,
 * the layer's FP8 definition) on evenly spaced tokens, the first and the last
 * among them, near ties left out: the aggregate within layer_tol_for's batch
 * bound for the number compared, every token within GU_FP8_TOL_ROW. The CPU's
 * distance (co) is printed beside it. */
static void fp8_ref_check(const char *what, const ref_layer *L, const void *hx, int T,
                          const void *go, const void *co, const unsigned char *tie) {
  const moelink_moe_config_t *c = &L->cfg;
  const moelink_dtype_t dt = c->dtype;
  const size_t H = (size_t)c->hidden, row = H * moelink_dtype_size(dt);
  const int step = T > FP8_REF_TOKENS ? (T + FP8_REF_TOKENS - 1) / FP8_REF_TOKENS : 1;
  double *want = gu_host(H * sizeof(double));
  double dg = 0.0, dc = 0.0, nw = 0.0, worst = 0.0;
  long worst_at = -1, n = 0, failed = 0;
  for (int t = 0; t < T; t += step) {
    if (t + step >= T) t = T - 1; /* the last token too */
    if (tie[t]) continue;
    if (ref_forward_token(c, &L->w, (const char *)hx + (size_t)t * row, want) != 0) {
      ++failed;
      continue;
    }
    double d = 0.0, nn = 0.0;
    for (size_t i = 0; i < H; ++i) {
      const double g = ref_load(dt, (const char *)go + (size_t)t * row, i);
      const double cv = ref_load(dt, (const char *)co + (size_t)t * row, i);
      d += (g - want[i]) * (g - want[i]);
      dc += (cv - want[i]) * (cv - want[i]);
      nn += want[i] * want[i];
    }
    const double rel = isfinite(d) ? (nn > 0.0 ? sqrt(d / nn) : sqrt(d)) : INFINITY;
    if (!(rel <= worst)) {
      worst = rel;
      worst_at = t;
    }
    dg += d;
    nw += nn;
    ++n;
  }
  const double agg = nw > 0.0 ? sqrt(dg / nw) : sqrt(dg);
  const double cpu = nw > 0.0 ? sqrt(dc / nw) : sqrt(dc);
  const layer_tol tol = layer_tol_for(c, (int)n);
  CHECK(failed == 0, "%s: reference forward of every sampled token (%ld failed)", what, failed);
  CHECK(agg <= tol.all, "%s: GPU vs double reference over %ld tokens: relative L2 %.3g <= %g "
        "(CPU %.3g)", what, n, agg, tol.all, cpu);
  CHECK(worst <= tol.row, "%s: GPU vs double reference, worst token %ld: relative L2 %.3g <= %g",
        what, worst_at, worst, tol.row);
  free(want);
}

/* ---- reduced sizes ------------------------------------------------------------------ */

/* One batch of T tokens through both backends. */
static void layer_batch(const char *name, const ref_layer *L, moelink_moe_t gmoe,
                        moelink_moe_t cmoe, int T, int check_top1_zero) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const moelink_dtype_t dt = cfg->dtype;
  const size_t es = moelink_dtype_size(dt), H = (size_t)cfg->hidden, xb = (size_t)T * H * es;
  const int k = cfg->top_k;
  char what[300];
  snprintf(what, sizeof what, "%s T %d", name, T);

  void *hx = gu_host(xb);
  ref_fill_x(L, hx, T, 2000u + (unsigned)T);
  void *dx = gu_dev(xb), *dout = gu_dev(xb), *dout2 = gu_dev(xb);
  gu_h2d(dx, hx, xb);
  gu_poison(dout, xb);
  gu_poison(dout2, xb);
  const double t0 = gu_now();
  CHECK_OK(moelink_moe_forward(gmoe, dx, T, dout, NULL), what);
  GU_CUDA(cudaDeviceSynchronize());
  const double t1 = gu_now();
  CHECK_OK(moelink_moe_forward(gmoe, dx, T, dout2, NULL), "second forward");
  void *go = gu_host(xb), *go2 = gu_host(xb), *co = gu_host(xb);
  gu_d2h(go, dout, xb);
  gu_d2h(go2, dout2, xb);
  CHECK(memcmp(go, go2, xb) == 0, "%s: two forwards bitwise equal", what);

  const double t2 = gu_now();
  CHECK_OK(moelink_moe_forward(cmoe, hx, T, co, NULL), "CPU forward");
  const double t3 = gu_now();

  /* Routing of both sides, to tell near ties from errors. */
  int32_t *dids = gu_dev((size_t)T * k * 4);
  float *dw = gu_dev((size_t)T * k * 4);
  /* the route piece takes max_tokens at most: slices */
  moelink_moe_config_t gc;
  moelink_moe_get_config(gmoe, &gc);
  for (int t0r = 0; t0r < T; t0r += gc.max_tokens) {
    const int n = T - t0r < gc.max_tokens ? T - t0r : gc.max_tokens;
    CHECK_OK(moelink_moe_route(gmoe, (const char *)dx + (size_t)t0r * H * es, n,
                               dids + (size_t)t0r * k, dw + (size_t)t0r * k, NULL),
             "GPU route");
  }
  int32_t *gi = gu_host((size_t)T * k * 4);
  unsigned char *tie = gu_host((size_t)T);
  const gu_route_stats rs = gu_routes_check(what, L, cmoe, hx, T, dids, dw, gi, tie);
  if (check_top1_zero) {
    int off = 0;
    for (int t = 0; t < T; ++t) off += gi[(size_t)t * k] != 0;
    CHECK(off == 0, "%s: every token's first expert is 0 (%d are not)", what, off);
  }

  const layer_tol tol = layer_tol_for(cfg, T);
  gu_err e = gu_compare(dt, go, co, (size_t)T, H, tie);
  gu_check_err_tol(what, e, dt, go, co, H, tol.all, tol.row);

  /* The independent double-precision reference on the first and last token
   * (FP8: on many tokens). */
  const int fp8 = cfg->fp8_experts || cfg->fp8_shared;
  if (fp8)
    fp8_ref_check(what, L, hx, T, go, co, tie);
  double *ref = gu_host(H * sizeof(double));
  const int probe[2] = {0, T - 1};
  for (int i = 0; i < (T > 1 ? 2 : 1) && !fp8; ++i) {
    const int t = probe[i];
    if (tie[t]) continue;
    if (ref_forward_token(cfg, &L->w, (const char *)hx + (size_t)t * H * es, ref) != 0) {
      CHECK(0, "%s: reference forward of token %d", what, t);
      continue;
    }
    const double eg = ref_rel_l2(dt, (const char *)go + (size_t)t * H * es, ref, H);
    const double ec = ref_rel_l2(dt, (const char *)co + (size_t)t * H * es, ref, H);
    CHECK(eg <= GU_TOL, "%s: token %d vs double reference: GPU %.3g (CPU %.3g) <= %g", what, t,
          eg, ec, GU_TOL);
  }
  ml_t_diag("%s: GPU forward %.2f ms (first call incl.), CPU %.1f ms, rel L2 %.2e, %d near ties",
            what, 1e3 * (t1 - t0), 1e3 * (t3 - t2), e.rel, rs.near_ties);

  free(ref);
  free(tie);
  free(gi);
  free(hx);
  free(go);
  free(go2);
  free(co);
  gu_free(dids);
  gu_free(dw);
  gu_free(dx);
  gu_free(dout);
  gu_free(dout2);
}

static moelink_moe_config_t reduced(const char *preset, moelink_dtype_t dt) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  if (moelink_moe_preset(preset, &c) != MOELINK_SUCCESS) {
    CHECK(0, "preset %s: %s", preset, moelink_last_error());
    gu_bail("unknown preset");
  }
  c.hidden = 256;
  c.inter = 128;
  if (c.shared_inter > 0) c.shared_inter = 256;
  c.dtype = dt;
  c.max_tokens = 4097;
  return c;
}

static void layer_reduced(const char *label, const moelink_moe_config_t *cfg, double zipf,
                          uint64_t seed, int check_top1_zero) {
  char desc[200], skew[40] = "", name[320];
  gu_describe(desc, sizeof desc, cfg);
  if (zipf > 0) snprintf(skew, sizeof skew, ", zipf %.1f", zipf);
  snprintf(name, sizeof name, "%s (%s%s)", label, desc, skew);
  ref_layer L;
  gu_dev_layer D;
  moelink_moe_t gmoe = NULL, cmoe = NULL;
  if (gu_layer_setup(name, cfg, seed, zipf, g_gpu, g_cpu, &L, &D, &gmoe, &cmoe) != 0)
    return;
  for (int i = 0; i < NTS; ++i) layer_batch(name, &L, gmoe, cmoe, g_Ts[i], check_top1_zero);
  moelink_moe_destroy(gmoe);

  /* A forward longer than max_tokens runs in chunks. */
  moelink_moe_config_t small = *cfg;
  small.max_tokens = 100;
  GU_MUST(moelink_moe_create(g_gpu, &small, &gmoe), "GPU layer with max_tokens 100");
  GU_MUST(moelink_moe_set_weights(gmoe, &D.w), "GPU weights");
  char cname[360];
  snprintf(cname, sizeof cname, "%s, chunks of 100", name);
  layer_batch(cname, &L, gmoe, cmoe, 257, check_top1_zero);
  moelink_moe_destroy(gmoe);

  moelink_moe_destroy(cmoe);
  gu_dev_layer_free(&D);
  ref_layer_free(&L);
}

static void test_reduced(void) {
  const double t0 = gu_now();
  const char *presets[] = {"mixtral-8x7b",  "mixtral-8x22b",   "qwen2-57b-a14b",
                           "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"};
  for (int i = 0; i < 6; ++i) {
    /* Alternate the dtypes so that both go through every router family. */
    const moelink_dtype_t dt = (i % 2) ? MOELINK_DTYPE_F16 : MOELINK_DTYPE_BF16;
    moelink_moe_config_t c = reduced(presets[i], dt);
    layer_reduced(presets[i], &c, 0.0, 500 + (uint64_t)i, 0);
  }
  moelink_moe_config_t c;
  /* gpt-oss style: top-k of the logits, softmax over the k. */
  c = reduced("mixtral-8x7b", MOELINK_DTYPE_BF16);
  c.num_experts = 32;
  c.top_k = 4;
  c.router = MOELINK_ROUTER_TOPK_SOFTMAX;
  c.renormalize = 0;
  layer_reduced("topk-softmax", &c, 0.0, 600, 0);
  /* Softmax scores with a bias and group-limited selection. */
  c = reduced("mixtral-8x7b", MOELINK_DTYPE_F16);
  gu_softmax_groups(&c);
  layer_reduced("softmax-groups", &c, 0.0, 601, 0);
  /* Skewed routing: a zipf-like load over 128 experts. */
  c = reduced("qwen3-30b-a3b", MOELINK_DTYPE_BF16);
  layer_reduced("qwen3-30b-a3b skewed", &c, 1.2, 602, 0);
  /* All tokens on expert 0 (k = 1), the other seven empty. */
  c = reduced("mixtral-8x7b", MOELINK_DTYPE_BF16);
  c.top_k = 1;
  layer_reduced("one expert", &c, 30.0, 603, 1);
  /* All tokens on experts 0 and 1. */
  c = reduced("mixtral-8x7b", MOELINK_DTYPE_F16);
  layer_reduced("two experts", &c, 30.0, 604, 1);
  /* DeepSeek's groups and bias under skew. Not a heavy one: with sigmoid
   * scores far below zero the renormalized weights become ratios of values
   * that underflow in fp32, and no fp32 backend can match the reference. */
  c = reduced("deepseek-v3", MOELINK_DTYPE_BF16);
  layer_reduced("deepseek-v3 skewed", &c, 1.2, 605, 0);
  ml_t_diag("reduced presets: %.1f s", gu_now() - t0);
}

/* FP8 routed experts: the router, the shared expert and DeepSeek's bias and
 * groups stay in the layer dtype. */
static void test_fp8(void) {
  const double t0 = gu_now();
  const char *presets[] = {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"};
  char label[64];
  for (int i = 0; i < 3; ++i)
    for (int d = 0; d < 2; ++d) {
      moelink_moe_config_t c = reduced(presets[i], d ? MOELINK_DTYPE_F16 : MOELINK_DTYPE_BF16);
      c.fp8_experts = 1;
      snprintf(label, sizeof label, "%s fp8", presets[i]);
      layer_reduced(label, &c, 0.0, 800 + 2 * (uint64_t)i + (uint64_t)d, 0);
    }
  moelink_moe_config_t c;
  /* Skewed routing: a few experts hold most rows (many tiles each). */
  c = reduced("qwen3-30b-a3b", MOELINK_DTYPE_BF16);
  c.fp8_experts = 1;
  layer_reduced("qwen3-30b-a3b fp8 skewed", &c, 1.2, 806, 0);
  /* All tokens on expert 0 (k = 1), the other seven empty. */
  c = reduced("mixtral-8x7b", MOELINK_DTYPE_F16);
  c.top_k = 1;
  c.fp8_experts = 1;
  layer_reduced("one expert fp8", &c, 30.0, 807, 1);
  /* The shared expert in FP8 too (T 4097: its sm_90a GEMMs; T <= 128: the
   * decode ones, shared expert first), and alone with bf16 routed experts. */
  c = reduced("deepseek-v3", MOELINK_DTYPE_BF16);
  c.fp8_experts = 1;
  c.fp8_shared = 1;
  layer_reduced("deepseek-v3 fp8 + fp8 shared", &c, 0.0, 808, 0);
  c.fp8_experts = 0;
  layer_reduced("deepseek-v3 fp8 shared only", &c, 0.0, 809, 0);

  /* The configuration and weight checks hold on the CUDA backend too. */
  c = reduced("mixtral-8x7b", MOELINK_DTYPE_BF16);
  c.fp8_experts = 1;
  c.max_tokens = 16;
  moelink_moe_t m = NULL;
  moelink_moe_config_t bad = c;
  bad.inter = 192;
  CHECK_STATUS(moelink_moe_create(g_gpu, &bad, &m), MOELINK_ERR_INVALID_ARGUMENT,
               "GPU fp8 layer with inter 192");
  CHECK(m == NULL, "no GPU layer made for inter 192");
  ref_layer L;
  if (ref_layer_make(&L, &c, 808, 0.0) != 0) {
    CHECK(0, "fp8 error-path layer data");
    return;
  }
  gu_dev_layer D;
  gu_dev_layer_upload(&D, &L);
  GU_MUST(moelink_moe_create(g_gpu, &c, &m), "GPU fp8 layer");
  moelink_moe_weights_t w = D.w;
  w.down_scale = NULL;
  CHECK_STATUS(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT,
               "GPU fp8 layer without down_scale");
  CHECK_OK(moelink_moe_set_weights(m, &D.w), "GPU fp8 layer with both scales");
  moelink_moe_destroy(m);
  m = NULL;
  c.fp8_experts = 0;
  GU_MUST(moelink_moe_create(g_gpu, &c, &m), "GPU bf16 layer");
  CHECK_STATUS(moelink_moe_set_weights(m, &D.w), MOELINK_ERR_INVALID_ARGUMENT,
               "GPU bf16 layer given FP8 scales");
  moelink_moe_destroy(m);
  gu_dev_layer_free(&D);
  ref_layer_free(&L);
  ml_t_diag("fp8 reduced presets: %.1f s", gu_now() - t0);
}

/* ---- full size ------------------------------------------------------------------------ */

typedef struct full_tensor {
  const char *name;
  int id;            /* REF_T_* */
  moelink_dtype_t dt;
  size_t n;
  void *dev, *host;
} full_tensor;

/* Sample tokens of a batch of T: first, last, and two in between. */
static int sample_tokens(int T, int *out) {
  const int cand[4] = {0, T - 1, T / 3, (2 * T) / 3};
  int n = 0;
  for (int i = 0; i < 4; ++i) {
    int dup = 0;
    for (int j = 0; j < n; ++j) dup |= out[j] == cand[i];
    if (!dup) out[n++] = cand[i];
  }
  return n;
}

static void full_preset(const char *preset, uint64_t seed) {
  const double t_start = gu_now();
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  GU_MUST(moelink_moe_preset(preset, &cfg), preset);
  cfg.dtype = MOELINK_DTYPE_BF16;
  cfg.max_tokens = g_Ts[NTS - 1];
  const moelink_dtype_t dt = cfg.dtype;
  const size_t es = moelink_dtype_size(dt), H = (size_t)cfg.hidden;
  const size_t Is = (size_t)cfg.shared_inter;
  const int Tmax = cfg.max_tokens, k = cfg.top_k;
  char desc[200], name[300];
  gu_describe(desc, sizeof desc, &cfg);
  snprintf(name, sizeof name, "%s full (%s)", preset, desc);

  full_tensor ts[8];
  int nt = 0;
  ts[nt++] = (full_tensor){"router", REF_T_ROUTER, dt, gu_elems_router(&cfg), NULL, NULL};
  ts[nt++] = (full_tensor){"gate_up", REF_T_GATE_UP, dt, gu_elems_gate_up(&cfg), NULL, NULL};
  ts[nt++] = (full_tensor){"down", REF_T_DOWN, dt, gu_elems_down(&cfg), NULL, NULL};
  if (Is > 0) {
    ts[nt++] = (full_tensor){"shared_gate_up", REF_T_SH_GATE_UP, dt, 2 * Is * H, NULL, NULL};
    ts[nt++] = (full_tensor){"shared_down", REF_T_SH_DOWN, dt, H * Is, NULL, NULL};
  }
  if (cfg.shared_gate)
    ts[nt++] = (full_tensor){"shared_gate", REF_T_SH_GATE, dt, H, NULL, NULL};
  if (cfg.correction_bias)
    ts[nt++] = (full_tensor){"bias", REF_T_BIAS, MOELINK_DTYPE_F32,
                             (size_t)cfg.num_experts, NULL, NULL};
  ts[nt++] = (full_tensor){"x", REF_T_X, dt, (size_t)Tmax * H, NULL, NULL};

  /* Say so, loudly, if the GPU cannot hold it. */
  size_t need = 0, ws = 0, fr = 0, tot = 0;
  for (int i = 0; i < nt; ++i) need += ts[i].n * moelink_dtype_size(ts[i].dt);
  GU_MUST(moelink_moe_workspace_size(g_gpu, &cfg, &ws), "workspace size");
  need += ws + 2 * (size_t)Tmax * H * es + ((size_t)Tmax * k * 8);
  GU_CUDA(cudaMemGetInfo(&fr, &tot));
  if (need + ((size_t)1 << 30) > fr) {
    CHECK(0, "%s: NOT RUN: needs %.1f GiB of device memory, %.1f GiB free", name,
          (double)need / (1 << 30), (double)fr / (1 << 30));
    return;
  }

  /* Weights and x on the device with ref_layer_make's seeds and scales. */
  double t0 = gu_now();
  for (int i = 0; i < nt; ++i) {
    const size_t bytes = ts[i].n * moelink_dtype_size(ts[i].dt);
    ts[i].dev = gu_dev(bytes);
    GU_MUST(moelink_fill_random(g_gpu, ts[i].dt, ts[i].dev, ts[i].n,
                                ref_tensor_seed(seed, ts[i].id), ref_tensor_scale(&cfg, ts[i].id),
                                0.0f, NULL),
            ts[i].name);
  }
  GU_CUDA(cudaDeviceSynchronize());
  const double t_fill = gu_now() - t0;

  /* Host copies of all weights (x: only the sampled rows below). */
  t0 = gu_now();
  size_t host_bytes = 0;
  for (int i = 0; i < nt; ++i) {
    if (ts[i].id == REF_T_X) continue;
    const size_t bytes = ts[i].n * moelink_dtype_size(ts[i].dt);
    ts[i].host = gu_host(bytes);
    gu_d2h(ts[i].host, ts[i].dev, bytes);
    host_bytes += bytes;
  }
  const double t_copy = gu_now() - t0;

  gu_dev_layer D;
  memset(&D, 0, sizeof D);
  moelink_moe_weights_t hw = MOELINK_MOE_WEIGHTS_INIT;
  hw.dtype = dt;
  void *dx = NULL;
  for (int i = 0; i < nt; ++i) {
    switch (ts[i].id) {
    case REF_T_ROUTER: D.router = ts[i].dev; hw.router = ts[i].host; break;
    case REF_T_GATE_UP: D.gate_up = ts[i].dev; hw.gate_up = ts[i].host; break;
    case REF_T_DOWN: D.down = ts[i].dev; hw.down = ts[i].host; break;
    case REF_T_SH_GATE_UP: D.sh_gate_up = ts[i].dev; hw.shared_gate_up = ts[i].host; break;
    case REF_T_SH_DOWN: D.sh_down = ts[i].dev; hw.shared_down = ts[i].host; break;
    case REF_T_SH_GATE: D.sh_gate = ts[i].dev; hw.shared_gate = ts[i].host; break;
    case REF_T_BIAS: D.bias = ts[i].dev; hw.correction_bias = ts[i].host; break;
    case REF_T_X: dx = ts[i].dev; break;
    }
  }
  gu_dev_layer_bind(&D, dt);

  /* The sampled tokens of all batch sizes (x rows depend on the token only). */
  int U[4 * NTS], nu = 0;
  for (int i = 0; i < NTS; ++i) {
    int s[4];
    const int n = sample_tokens(g_Ts[i], s);
    for (int j = 0; j < n; ++j) {
      int dup = 0;
      for (int q = 0; q < nu; ++q) dup |= U[q] == s[j];
      if (!dup) U[nu++] = s[j];
    }
  }
  char *hxs = gu_host((size_t)nu * H * es);
  for (int u = 0; u < nu; ++u)
    gu_d2h(hxs + (size_t)u * H * es, (const char *)dx + (size_t)U[u] * H * es, H * es);

  /* CPU reference on the samples. */
  t0 = gu_now();
  moelink_moe_config_t ccfg = cfg;
  ccfg.max_tokens = nu;
  moelink_moe_t cmoe = NULL;
  GU_MUST(moelink_moe_create(g_cpu, &ccfg, &cmoe), "CPU layer");
  GU_MUST(moelink_moe_set_weights(cmoe, &hw), "CPU weights");
  char *co = gu_host((size_t)nu * H * es);
  int32_t *ci = gu_host((size_t)nu * k * 4);
  float *cw = gu_host((size_t)nu * k * 4);
  GU_MUST(moelink_moe_forward(cmoe, hxs, nu, co, NULL), "CPU forward of the samples");
  GU_MUST(moelink_moe_route(cmoe, hxs, nu, ci, cw, NULL), "CPU route of the samples");
  const double t_cpu = gu_now() - t0;

  /* The double reference on the first and the last token of the largest
   * batch (U[0] = 0; the last token of 4097 is in U too). */
  t0 = gu_now();
  int ref_u[2] = {-1, -1};
  for (int u = 0; u < nu; ++u) {
    if (U[u] == 0) ref_u[0] = u;
    if (U[u] == Tmax - 1) ref_u[1] = u;
  }
  double *ref = gu_host(2 * H * sizeof(double));
  int ref_rc[2] = {-1, -1};
#ifdef _OPENMP
#pragma omp parallel for num_threads(2)
#endif
  for (int i = 0; i < 2; ++i)
    if (ref_u[i] >= 0)
      ref_rc[i] = ref_forward_token(&cfg, &hw, hxs + (size_t)ref_u[i] * H * es, ref + i * H);
  const double t_ref = gu_now() - t0;
  for (int i = 0; i < 2; ++i) {
    if (ref_u[i] < 0) continue;
    CHECK(ref_rc[i] == 0, "%s: reference forward of token %d", name, U[ref_u[i]]);
    const double ec = ref_rel_l2(dt, co + (size_t)ref_u[i] * H * es, ref + i * H, H);
    ml_t_diag("%s: CPU vs double reference, token %d: %.3g", name, U[ref_u[i]], ec);
  }

  /* The GPU layer, each batch size. */
  moelink_moe_t gmoe = NULL;
  GU_MUST(moelink_moe_create(g_gpu, &cfg, &gmoe), "GPU layer");
  GU_MUST(moelink_moe_set_weights(gmoe, &D.w), "GPU weights");
  void *dout = gu_dev((size_t)Tmax * H * es);
  int32_t *dids = gu_dev((size_t)Tmax * k * 4);
  float *dw = gu_dev((size_t)Tmax * k * 4);
  char *go = gu_host((size_t)Tmax * H * es);
  int32_t *gi = gu_host((size_t)Tmax * k * 4);
  float *gw = gu_host((size_t)Tmax * k * 4);
  for (int ti = 0; ti < NTS; ++ti) {
    const int T = g_Ts[ti];
    char what[360];
    snprintf(what, sizeof what, "%s T %d", name, T);
    gu_poison(dout, (size_t)T * H * es);
    GU_CUDA(cudaDeviceSynchronize());
    t0 = gu_now();
    CHECK_OK(moelink_moe_forward(gmoe, dx, T, dout, NULL), what);
    GU_CUDA(cudaDeviceSynchronize());
    const double t_fwd = gu_now() - t0;
    gu_d2h(go, dout, (size_t)T * H * es);
    CHECK_OK(moelink_moe_route(gmoe, dx, T, dids, dw, NULL), "GPU route");
    gu_d2h(gi, dids, (size_t)T * k * 4);
    gu_d2h(gw, dw, (size_t)T * k * 4);

    /* Every element of the batch was written. */
    long nonfinite = 0, first_bad = -1;
    for (size_t i = 0; i < (size_t)T * H; ++i)
      if (!isfinite(ref_load(dt, go, i)) && nonfinite++ == 0) first_bad = (long)i;
    CHECK(nonfinite == 0, "%s: all %zu outputs finite (%ld not, first at token %ld)", what,
          (size_t)T * H, nonfinite, first_bad < 0 ? -1 : first_bad / (long)H);

    /* Sampled tokens against the CPU. */
    int s[4];
    const int ns = sample_tokens(T, s);
    char *gs = gu_host((size_t)ns * H * es), *cs = gu_host((size_t)ns * H * es);
    char *xs = gu_host((size_t)ns * H * es);
    int32_t *gsi = gu_host((size_t)ns * k * 4), *csi = gu_host((size_t)ns * k * 4);
    float *gsw = gu_host((size_t)ns * k * 4), *csw = gu_host((size_t)ns * k * 4);
    for (int j = 0; j < ns; ++j) {
      int u = 0;
      while (U[u] != s[j]) ++u;
      memcpy(gs + (size_t)j * H * es, go + (size_t)s[j] * H * es, H * es);
      memcpy(cs + (size_t)j * H * es, co + (size_t)u * H * es, H * es);
      memcpy(xs + (size_t)j * H * es, hxs + (size_t)u * H * es, H * es);
      memcpy(gsi + (size_t)j * k, gi + (size_t)s[j] * k, (size_t)k * 4);
      memcpy(gsw + (size_t)j * k, gw + (size_t)s[j] * k, (size_t)k * 4);
      memcpy(csi + (size_t)j * k, ci + (size_t)u * k, (size_t)k * 4);
      memcpy(csw + (size_t)j * k, cw + (size_t)u * k, (size_t)k * 4);
    }
    unsigned char tie[4];
    gu_route_stats rs = gu_compare_routes(what, &cfg, &hw, xs, ns, gsi, gsw, csi, csw, tie);
    gu_check_routes(what, rs);
    gu_err e = gu_compare(dt, gs, cs, (size_t)ns, H, tie);
    gu_check_err(what, e, dt, gs, cs, H);
    for (int j = 0; j < ns; ++j)
      for (int i = 0; i < 2; ++i)
        if (ref_u[i] >= 0 && s[j] == U[ref_u[i]] && !tie[j] && ref_rc[i] == 0) {
          const double eg = ref_rel_l2(dt, gs + (size_t)j * H * es, ref + i * H, H);
          CHECK(eg <= GU_TOL, "%s: token %d vs double reference %.3g <= %g", what, s[j], eg,
                GU_TOL);
        }
    ml_t_diag("%s: forward %.2f ms, sampled tokens rel L2 %.2e (%d near ties)", what,
              1e3 * t_fwd, e.rel, rs.near_ties);
    free(gs);
    free(cs);
    free(xs);
    free(gsi);
    free(csi);
    free(gsw);
    free(csw);
  }
  ml_t_diag("%s: fill %.2f s, %.1f GiB to host %.1f s, CPU on %d tokens %.1f s, double ref %.1f s, "
            "total %.1f s",
            name, t_fill, (double)host_bytes / (1 << 30), t_copy, nu, t_cpu, t_ref,
            gu_now() - t_start);

  moelink_moe_destroy(gmoe);
  moelink_moe_destroy(cmoe);
  free(ref);
  free(hxs);
  free(co);
  free(ci);
  free(cw);
  free(go);
  free(gi);
  free(gw);
  gu_free(dout);
  gu_free(dids);
  gu_free(dw);
  for (int i = 0; i < nt; ++i) {
    gu_free(ts[i].dev);
    free(ts[i].host);
  }
}

int main(void) {
  gu_contexts(&g_gpu, &g_cpu);
  test_reduced();
  test_fp8();
  const int np = moelink_preset_count();
  for (int i = 0; i < np; ++i) full_preset(moelink_preset_name(i), 700 + (uint64_t)i);
  moelink_context_destroy(g_gpu);
  moelink_context_destroy(g_cpu);
  return ml_test_done();
}
