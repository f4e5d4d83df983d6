/* Expert parallelism (moelink_ep_*) on GPU ranks, against the single-GPU
 * layer. Every rank builds the whole layer on its own GPU from the
 * counter-based generator (the same seeds everywhere, so the same weights),
 * binds its slice of the experts to the EP layer, and runs
 * moelink_moe_forward of a single-GPU layer with all E experts over the
 * concatenation of all ranks' tokens in rank order (it regenerates the other
 * ranks' x from their seeds): its own rows of that output are the reference
 * for its EP output.
 *
 * The EP combine adds the same terms in the same order as the single-GPU
 * layer, but its GEMMs see other batches (a rank's own tokens, what arrived
 * from the peers), so the last bits may differ: outputs must agree to a
 * relative L2 of 1e-2 (a wrong routing decision, a lost or doubled
 * contribution, a wrong expert's weights are all O(1)); the test reports how
 * many elements match bitwise and the largest absolute difference. One config
 * is also checked row by row against the fp64 host reference (tests/ref), so
 * the two GPU paths cannot share a bug unseen.
 *
 * Cases: reduced Mixtral (softmax top-2), DeepSeek (sigmoid, correction bias,
 * groups, scaling, ungated shared expert), Qwen2 (gated shared expert, no
 * renormalization; also in f16), Qwen3 (k = 8), top-k-then-softmax; token
 * counts per rank 0 / max_tokens / 1 / odd / random, different on each rank,
 * and with call_tokens = 3 x max_tokens up to three steps a call;
 * every token routed to rank 0's experts (skew); two calls bitwise equal;
 * outputs poisoned with 0xff bytes and guard rows past the end; 1000
 * back-to-back calls; one call captured in a CUDA graph and replayed with new
 * x; argument errors (rank-symmetric where a rank might not take part; more
 * than call_tokens tokens: taken part with none); rounds mode (recv_capacity
 * below the whole step: 1/8 of it, 3 rows, with steps, FP8 rows, FP8 experts
 * and skew; a dispatch that fits one round, one that does not, a capture).
 *
 *   moelink launch -n 2 -- mgpu_test_ep */
#include "mgpu.h"
#include "ref.h"

static mg_world W;

/* Rows past the largest call, poisoned and checked untouched. */
#define GUARD_ROWS 3

static size_t bitwise_equal, compared;
/* dispatch_quant of the EP layers layer_make creates (NONE but in the fp8
 * cases). */
static moelink_quant_t layer_quant = MOELINK_QUANT_NONE;
/* Layers made next take calls of up to layer_steps * max_tokens tokens a rank
 * (the EP config's call_tokens; 1: left at 0, the default). */
static int layer_steps = 1;
/* The EP config's recv_capacity of the layers made next (0: the default, one
 * round a step; below ranks * max_tokens: rounds by expert). */
static int layer_capacity = 0;
static double worst_rel, worst_abs;

/* One layer: the full weights on this GPU, the single-GPU reference layer,
 * the EP layer with this rank's experts, and the buffers of a call. */
typedef struct layer {
  const char *name;
  moelink_moe_config_t cfg; /* max_tokens: the most tokens per rank per step */
  int call;                 /* M: the most tokens per rank per call (call_tokens) */
  uint64_t seed;
  void *router, *gate_up, *down, *sh_gu, *sh_down, *sh_gate;
  float *bias;
  float *gu_scale, *dn_scale; /* cfg.fp8_experts: gate_up / down hold e4m3 bytes */
  moelink_moe_weights_t full;
  moelink_moe_t ref;
  moelink_ep_t ep;
  int first, El;
  size_t row;          /* bytes of one token row */
  void *x_all, *ref_out; /* [ranks * (M + GUARD_ROWS), H] */
  void *x, *out, *out2;  /* [M + GUARD_ROWS, H] */
  int32_t *ids;          /* [ranks * M, k] (device) */
  float *wts;
  unsigned char *h_out, *h_out2, *h_ref;
} layer;

static void fill(moelink_dtype_t dt, void *p, size_t n, uint64_t seed, float scale,
                 float offset) {
  if (n == 0) return;
  MG_MUST(moelink_fill_random(W.ctx, dt, p, n, seed, scale, offset, W.stream),
          "moelink_fill_random");
}

static void poison(void *p, size_t bytes) { MG_CUDA(cudaMemsetAsync(p, 0xff, bytes, W.stream)); }

static void sync_stream(void) { MG_CUDA(cudaStreamSynchronize(W.stream)); }

static void to_host(void *h, const void *dev, size_t bytes) {
  if (bytes) MG_CUDA(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
}

/* Seed of rank r's x in call `it` of case c: every rank can regenerate any
 * rank's tokens. */
static uint64_t x_seed(int c, int it, int r) {
  return ref_tensor_seed(mg_seed(r, 1000 * c + it), REF_T_X);
}

static void fill_x(const layer *L, void *x, int num_tokens, uint64_t seed) {
  fill(L->cfg.dtype, x, (size_t)num_tokens * (size_t)L->cfg.hidden, seed,
       ref_tensor_scale(&L->cfg, REF_T_X), 0.0f);
}

static moelink_moe_config_t make_config(const char *preset, moelink_dtype_t dt, int H, int I,
                                        int E, int k, int shared_inter, int M) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  if (preset) MG_MUST(moelink_moe_preset(preset, &c), preset);
  c.hidden = H;
  c.inter = I;
  c.num_experts = E;
  c.top_k = k;
  if (c.n_group > 1) {
    c.n_group = 4;
    c.topk_group = 2;
  }
  c.shared_inter = shared_inter;
  if (shared_inter == 0) c.shared_gate = 0;
  c.dtype = dt;
  c.max_tokens = M;
  return c;
}

/* skew: the correction bias of rank 0's experts is +10, so every token
 * selects only them (sigmoid scores are in (0, 1)). */
static void layer_make(layer *L, const char *name, const moelink_moe_config_t *cfg,
                       uint64_t seed, int skew) {
  memset(L, 0, sizeof *L);
  L->name = name;
  L->cfg = *cfg;
  L->seed = seed;
  const moelink_moe_config_t *c = &L->cfg;
  const moelink_dtype_t dt = c->dtype;
  const size_t es = moelink_dtype_size(dt), H = (size_t)c->hidden, I = (size_t)c->inter;
  const size_t E = (size_t)c->num_experts, Is = (size_t)c->shared_inter;
  const size_t M = (size_t)c->max_tokens * (size_t)layer_steps;
  L->call = (int)M;
  const size_t n_router = E * H, n_gu = E * 2 * I * H, n_down = E * H * I;
  /* expert weight bytes an element: e4m3 with fp8_experts */
  const size_t wes = c->fp8_experts ? 1 : es;
  L->row = H * es;
  L->router = mg_dev(n_router * es);
  L->gate_up = mg_dev(n_gu * wes);
  L->down = mg_dev(n_down * wes);
  fill(dt, L->router, n_router, ref_tensor_seed(seed, REF_T_ROUTER),
       ref_tensor_scale(c, REF_T_ROUTER), 0.0f);
  if (c->fp8_experts) {
    /* e4m3 codes and 128 x 128 block scales as the host reference makes
     * them (the library has no device-side weight quantizer) */
    ref_layer R;
    if (ref_layer_make(&R, c, seed, 0.0) != 0) mg_bail("fp8 expert weights (host)");
    const size_t n_gus = E * (2 * I / 128) * (H / 128), n_dns = E * (H / 128) * (I / 128);
    L->gu_scale = (float *)mg_dev(n_gus * sizeof(float));
    L->dn_scale = (float *)mg_dev(n_dns * sizeof(float));
    MG_CUDA(cudaMemcpy(L->gate_up, R.gate_up, n_gu, cudaMemcpyHostToDevice));
    MG_CUDA(cudaMemcpy(L->down, R.down, n_down, cudaMemcpyHostToDevice));
    MG_CUDA(cudaMemcpy(L->gu_scale, R.gate_up_scale, n_gus * sizeof(float),
                       cudaMemcpyHostToDevice));
    MG_CUDA(cudaMemcpy(L->dn_scale, R.down_scale, n_dns * sizeof(float),
                       cudaMemcpyHostToDevice));
    ref_layer_free(&R);
  } else {
    fill(dt, L->gate_up, n_gu, ref_tensor_seed(seed, REF_T_GATE_UP),
         ref_tensor_scale(c, REF_T_GATE_UP), 0.0f);
    fill(dt, L->down, n_down, ref_tensor_seed(seed, REF_T_DOWN),
         ref_tensor_scale(c, REF_T_DOWN), 0.0f);
  }
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.dtype = dt;
  w.router = L->router;
  w.gate_up = L->gate_up;
  w.down = L->down;
  w.gate_up_scale = L->gu_scale;
  w.down_scale = L->dn_scale;
  if (Is > 0) {
    L->sh_gu = mg_dev(2 * Is * H * es);
    L->sh_down = mg_dev(H * Is * es);
    fill(dt, L->sh_gu, 2 * Is * H, ref_tensor_seed(seed, REF_T_SH_GATE_UP),
         ref_tensor_scale(c, REF_T_SH_GATE_UP), 0.0f);
    fill(dt, L->sh_down, H * Is, ref_tensor_seed(seed, REF_T_SH_DOWN),
         ref_tensor_scale(c, REF_T_SH_DOWN), 0.0f);
    w.shared_gate_up = L->sh_gu;
    w.shared_down = L->sh_down;
  }
  if (c->shared_gate) {
    L->sh_gate = mg_dev(H * es);
    fill(dt, L->sh_gate, H, ref_tensor_seed(seed, REF_T_SH_GATE),
         ref_tensor_scale(c, REF_T_SH_GATE), 0.0f);
    w.shared_gate = L->sh_gate;
  }
  if (c->correction_bias) {
    L->bias = (float *)mg_dev(E * sizeof(float));
    const uint64_t bs = ref_tensor_seed(seed, REF_T_BIAS);
    const float bscale = ref_tensor_scale(c, REF_T_BIAS);
    fill(MOELINK_DTYPE_F32, L->bias, E, bs, bscale, 0.0f);
    if (skew) fill(MOELINK_DTYPE_F32, L->bias, E / (size_t)W.size, bs, bscale, 10.0f);
    w.correction_bias = L->bias;
  }
  L->full = w;

  /* The single-GPU layer: all ranks' tokens in one chunk. */
  moelink_moe_config_t rc = *c;
  rc.max_tokens = W.size * L->call;
  MG_MUST(moelink_moe_create(W.ctx, &rc, &L->ref), "single-GPU layer (reference)");
  MG_MUST(moelink_moe_set_weights(L->ref, &L->full), "single-GPU layer weights");

  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = *c;
  ecfg.dispatch_quant = layer_quant;
  ecfg.call_tokens = layer_steps > 1 ? L->call : 0;
  ecfg.recv_capacity = layer_capacity;
  size_t ws = 0;
  CHECK_OK(moelink_ep_workspace_size(W.comm, &ecfg, &ws), "ep_workspace_size");
  const double t0 = mg_now();
  MG_MUST(moelink_ep_create(W.comm, &ecfg, &L->ep), "moelink_ep_create");
  moelink_ep_config_t got;
  memset(&got, 0, sizeof got);
  L->first = -1;
  CHECK_OK(moelink_ep_get_config(L->ep, &got, &L->first, &L->El), "ep_get_config");
  CHECK(L->first == W.rank * c->num_experts / W.size && L->El == c->num_experts / W.size &&
            got.moe.hidden == c->hidden && got.moe.num_experts == c->num_experts &&
            got.moe.max_tokens == c->max_tokens &&
            got.recv_capacity == (layer_capacity ? layer_capacity : W.size * c->max_tokens) &&
            got.call_tokens == L->call,
        "%s: ep created (%.2f s, %zu bytes of workspace): rank %d owns experts [%d, %d), "
        "recv_capacity %d, call_tokens %d",
        name, mg_now() - t0, ws, W.rank, L->first, L->first + L->El, got.recv_capacity,
        got.call_tokens);
  if (L->first < 0 || L->El != c->num_experts / W.size) mg_bail("ep_get_config disagrees");
  moelink_moe_weights_t lw = w;
  lw.gate_up = (const char *)L->gate_up + (size_t)L->first * 2 * I * H * wes;
  lw.down = (const char *)L->down + (size_t)L->first * H * I * wes;
  if (c->fp8_experts) {
    lw.gate_up_scale = L->gu_scale + (size_t)L->first * (2 * I / 128) * (H / 128);
    lw.down_scale = L->dn_scale + (size_t)L->first * (H / 128) * (I / 128);
  }
  MG_MUST(moelink_ep_set_weights(L->ep, &lw), "moelink_ep_set_weights");

  const size_t rows = M + GUARD_ROWS, all_rows = (size_t)W.size * rows;
  L->x_all = mg_dev(all_rows * L->row);
  L->ref_out = mg_dev(all_rows * L->row);
  L->x = mg_dev(rows * L->row);
  L->out = mg_dev(rows * L->row);
  L->out2 = mg_dev(rows * L->row);
  L->ids = (int32_t *)mg_dev(all_rows * (size_t)c->top_k * sizeof(int32_t));
  L->wts = (float *)mg_dev(all_rows * (size_t)c->top_k * sizeof(float));
  L->h_out = (unsigned char *)mg_host(rows * L->row);
  L->h_out2 = (unsigned char *)mg_host(rows * L->row);
  L->h_ref = (unsigned char *)mg_host(rows * L->row);
}

static void layer_free(layer *L) {
  sync_stream();
  CHECK_OK(moelink_ep_destroy(L->ep), "ep_destroy");
  CHECK_OK(moelink_moe_destroy(L->ref), "moe_destroy (reference)");
  void *bufs[] = {L->router, L->gate_up, L->down,  L->sh_gu, L->sh_down, L->sh_gate,
                  L->bias,   L->x_all,   L->ref_out, L->x,   L->out,     L->out2,
                  L->ids,    L->wts,     L->gu_scale, L->dn_scale};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i)
    if (bufs[i]) cudaFree(bufs[i]);
  free(L->h_out);
  free(L->h_out2);
  free(L->h_ref);
}

/* The single-GPU layer over every rank's tokens of call (c, it), on the
 * stream; returns the row where this rank's tokens start. */
static int reference(layer *L, const int *counts, int c, int it) {
  int total = 0, mine = 0;
  for (int r = 0; r < W.size; ++r) {
    if (r == W.rank) mine = total;
    fill_x(L, (char *)L->x_all + (size_t)total * L->row, counts[r], x_seed(c, it, r));
    total += counts[r];
  }
  if (total > 0)
    MG_MUST(moelink_moe_forward(L->ref, L->x_all, total, L->ref_out, W.stream),
            "single-GPU forward (reference)");
  return mine;
}

/* This rank's output (host, max_tokens + GUARD_ROWS rows) against the
 * reference rows (host); quiet: print only a failure. Returns 1 when good. */
static int compare(const layer *L, const char *what, const unsigned char *got,
                   const unsigned char *ref, int T, int quiet) {
  const moelink_dtype_t dt = L->cfg.dtype;
  const size_t n = (size_t)T * (size_t)L->cfg.hidden, es = moelink_dtype_size(dt);
  double ss = 0.0, sd = 0.0, mx = 0.0;
  size_t nonfinite = 0, same = 0, first_bad = (size_t)-1;
  for (size_t i = 0; i < n; ++i) {
    const double g = mg_get(dt, got, i), r = mg_get(dt, ref, i);
    if (!isfinite(g)) {
      if (!nonfinite++) first_bad = i;
      continue;
    }
    same += memcmp(got + i * es, ref + i * es, es) == 0;
    ss += r * r;
    sd += (g - r) * (g - r);
    if (fabs(g - r) > mx) mx = fabs(g - r);
  }
  const double rel = ss > 0 ? sqrt(sd / ss) : sqrt(sd);
  /* Every row past the T written ones stays poisoned (got holds
   * max_tokens + GUARD_ROWS rows). */
  size_t guard_bad = 0;
  const size_t end = (size_t)(L->call + GUARD_ROWS) * L->row;
  for (size_t i = n * es; i < end; ++i) guard_bad += got[i] != 0xff;
  const int ok = nonfinite == 0 && rel <= mg_tol(dt) && guard_bad == 0;
  bitwise_equal += same;
  compared += n;
  if (rel > worst_rel) worst_rel = rel;
  if (mx > worst_abs) worst_abs = mx;
  if (!ok || !quiet) {
    if (nonfinite) {
      const size_t t = first_bad / (size_t)L->cfg.hidden, j = first_bad % (size_t)L->cfg.hidden;
      printf("# %s: %zu non-finite outputs, first at token %zu column %zu (reference %g)\n", what,
             nonfinite, t, j, mg_get(dt, ref, first_bad));
    }
    CHECK(ok, "%s: rel L2 %.3g, max |d| %.3g, %zu of %zu bitwise equal, %zu bytes past row T changed",
          what, rel, mx, same, n, guard_bad);
  }
  return ok;
}

/* This rank's output (device, `bytes` from out) against its T rows of the
 * reference (from row mine of ref_out), on host copies: compare(). */
static int compare_out(layer *L, const char *what, const void *out, size_t bytes, int mine, int T,
                       int quiet) {
  to_host(L->h_out, out, bytes);
  to_host(L->h_ref, (const char *)L->ref_out + (size_t)mine * L->row, (size_t)T * L->row);
  return compare(L, what, L->h_out, L->h_ref, T, quiet);
}

/* One EP call with these per-rank counts, checked against the reference and
 * (twice) against itself. Returns 1 when good. */
static int run_call(layer *L, const int *counts, int c, int it, int quiet) {
  const int T = counts[W.rank], M = L->call;
  const size_t bytes = (size_t)(M + GUARD_ROWS) * L->row, own = (size_t)T * L->row;
  char what[200];
  snprintf(what, sizeof what, "%s %s: call %d, tokens", L->name, moelink_dtype_name(L->cfg.dtype),
           it);
  for (int r = 0; r < W.size; ++r)
    snprintf(what + strlen(what), sizeof what - strlen(what), "%s%d%s", r ? " " : " [",
             counts[r], r == W.size - 1 ? "]" : "");
  fill_x(L, L->x, T, x_seed(c, it, W.rank));
  poison(L->out, bytes);
  poison(L->out2, bytes);
  /* NULL x and out are fine with no tokens. */
  const void *x = T ? L->x : NULL;
  void *out = T ? L->out : NULL;
  const moelink_status_t s1 = moelink_ep_forward(L->ep, x, T, out, W.stream);
  const moelink_status_t s2 = moelink_ep_forward(L->ep, L->x, T, L->out2, W.stream);
  if (s1 != MOELINK_SUCCESS || s2 != MOELINK_SUCCESS) {
    CHECK(0, "%s: ep_forward twice: %s: %s", what, moelink_status_string(s1 ? s1 : s2),
          moelink_last_error());
    return 0;
  }
  const int mine = reference(L, counts, c, it);
  sync_stream();
  to_host(L->h_out, L->out, bytes);
  to_host(L->h_out2, L->out2, bytes);
  memset(L->h_ref, 0, own);
  to_host(L->h_ref, (const char *)L->ref_out + (size_t)mine * L->row, own);
  int ok = compare(L, what, L->h_out, L->h_ref, T, quiet);
  const int same = memcmp(L->h_out, L->h_out2, bytes) == 0;
  if (!same || !quiet) CHECK(same, "%s: a second call gives the same bits", what);
  return ok && same;
}

/* Per-rank token counts of call pattern p (the same on every rank). */
static void counts_of(int p, int M, uint64_t *st, int *counts) {
  const int odd = (M - 1) | 1;
  for (int r = 0; r < W.size; ++r) {
    switch (p) {
    case 0: counts[r] = r == 0 ? 0 : M; break;       /* none here, all there */
    case 1: counts[r] = r == 0 ? M : 1; break;       /* all here, one there */
    case 2: counts[r] = odd - 10 * r > 0 ? odd - 10 * r : 1; break; /* odd, different */
    case 3: counts[r] = 0; break;                    /* nobody has tokens */
    default: counts[r] = (int)(mg_next(st) % (uint64_t)(M + 1)); break;
    }
  }
}

/* fp64 host reference (tests/ref) on this rank's rows of one call: up to 16
 * tokens, relative L2 per token. */
static void host_check(layer *L, const int *counts, int c, int it) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const moelink_dtype_t dt = cfg->dtype;
  const size_t es = moelink_dtype_size(dt), H = (size_t)cfg->hidden, I = (size_t)cfg->inter;
  const size_t E = (size_t)cfg->num_experts, Is = (size_t)cfg->shared_inter;
  const int T = counts[W.rank];
  if (T == 0) return;
  moelink_moe_weights_t hw = L->full;
  void *router = mg_host(E * H * es), *gu = mg_host(E * 2 * I * H * es), *dn = mg_host(E * H * I * es);
  void *sgu = NULL, *sdn = NULL, *sg = NULL;
  float *bias = NULL;
  to_host(router, L->router, E * H * es);
  to_host(gu, L->gate_up, E * 2 * I * H * es);
  to_host(dn, L->down, E * H * I * es);
  hw.router = router;
  hw.gate_up = gu;
  hw.down = dn;
  if (Is) {
    sgu = mg_host(2 * Is * H * es);
    sdn = mg_host(H * Is * es);
    to_host(sgu, L->sh_gu, 2 * Is * H * es);
    to_host(sdn, L->sh_down, H * Is * es);
    hw.shared_gate_up = sgu;
    hw.shared_down = sdn;
  }
  if (cfg->shared_gate) {
    sg = mg_host(H * es);
    to_host(sg, L->sh_gate, H * es);
    hw.shared_gate = sg;
  }
  if (cfg->correction_bias) {
    bias = (float *)mg_host(E * sizeof(float));
    to_host(bias, L->bias, E * sizeof(float));
    hw.correction_bias = bias;
  }
  /* The EP output of this call (run_call left it in h_out) and x. */
  unsigned char *hx = (unsigned char *)mg_host((size_t)T * L->row);
  fill_x(L, L->x, T, x_seed(c, it, W.rank));
  sync_stream();
  to_host(hx, L->x, (size_t)T * L->row);
  double *want = (double *)mg_host(H * sizeof(double));
  const int n = T < 16 ? T : 16;
  double worst = 0.0;
  int bad = -1;
  for (int i = 0; i < n; ++i) {
    const int t = (int)((size_t)i * (size_t)T / (size_t)n);
    if (ref_forward_token(cfg, &hw, hx + (size_t)t * L->row, want) != 0) {
      bad = t;
      break;
    }
    const double e = ref_rel_l2(dt, L->h_out + (size_t)t * L->row, want, H);
    if (!(e <= worst)) worst = e;
    if (!(e <= 3e-2) && bad < 0) bad = t;
  }
  CHECK(bad < 0, "%s: %d of this rank's %d tokens against the fp64 host reference: worst "
                 "rel L2 %.3g (bound 3e-2 per token), first bad token %d",
        L->name, n, T, worst, bad);
  free(want);
  free(hx);
  free(router);
  free(gu);
  free(dn);
  free(sgu);
  free(sdn);
  free(sg);
  free(bias);
}

static int g_case = 1;

/* A layer through the fixed count patterns and a few random ones. */
static void run_layer(const char *name, const moelink_moe_config_t *cfg, int host_ref) {
  const int c = g_case++;
  layer L;
  const double t0 = mg_now();
  layer_make(&L, name, cfg, 0x1a7e0000ull + (uint64_t)c, 0);
  uint64_t st = 77 + (uint64_t)c; /* the same on every rank */
  int counts[MOELINK_DEVICE_MAX_RANKS];
  int good = 0, calls = 7;
  for (int p = 0; p < calls; ++p) {
    counts_of(p, L.call, &st, counts);
    good += run_call(&L, counts, c, p, 0);
    if (p == 2 && host_ref) host_check(&L, counts, c, p);
  }
  CHECK(good == calls, "%s: %d of %d calls good (%.2f s)", name, good, calls, mg_now() - t0);
  layer_free(&L);
}

/* Every token of every rank selects only rank 0's experts: rank 0 receives
 * all ranks' tokens (up to ranks * max_tokens rows), the others none. */
static void run_skew(void) {
  const int c = g_case++;
  moelink_moe_config_t cfg =
      make_config("deepseek-v3", MOELINK_DTYPE_BF16, 512, 256, 16, 4, 128, 96);
  layer L;
  layer_make(&L, layer_capacity ? "skew to rank 0, rounds" : "skew to rank 0", &cfg, 0x5e30000ull,
             1);
  int counts[MOELINK_DEVICE_MAX_RANKS];
  uint64_t st = 5;
  const int pats[] = {-1, 0, 1, 4};
  for (size_t i = 0; i < sizeof pats / sizeof pats[0]; ++i) {
    if (pats[i] < 0)
      for (int r = 0; r < W.size; ++r) counts[r] = cfg.max_tokens; /* all full */
    else
      counts_of(pats[i], cfg.max_tokens, &st, counts);
    int total = 0;
    for (int r = 0; r < W.size; ++r) total += counts[r];
    if (i == 0) {
      /* The setup, not the code under test: the single-GPU router sends
       * every slot of every token to rank 0's experts. */
      (void)reference(&L, counts, c, (int)i);
      MG_MUST(moelink_moe_route(L.ref, L.x_all, total, L.ids, L.wts, W.stream), "route (skew)");
      const size_t n = (size_t)total * (size_t)cfg.top_k;
      int32_t *ids = (int32_t *)mg_host(n * sizeof(int32_t));
      sync_stream();
      to_host(ids, L.ids, n * sizeof(int32_t));
      size_t off = 0;
      for (size_t q = 0; q < n; ++q) off += ids[q] < 0 || ids[q] >= L.El;
      CHECK(off == 0, "skew: all %zu slots of %d tokens select rank 0's experts [0, %d) (%zu "
                      "elsewhere)",
            n, total, L.El, off);
      free(ids);
    }
    run_call(&L, counts, c, (int)i, 0);
  }
  layer_free(&L);
}

/* One layer, 1000 calls with new counts and inputs enqueued back to back, each
 * into its own output; then all of them against the reference. */
static void run_stress(void) {
  const int c = g_case++, iters = 1000;
  moelink_moe_config_t cfg =
      make_config("qwen3-30b-a3b", MOELINK_DTYPE_BF16, 256, 128, 32, 8, 0, 64);
  layer L;
  layer_make(&L, "1000 calls", &cfg, 0x57e55ull, 0);
  const int M = cfg.max_tokens;
  const size_t slot = (size_t)(M + GUARD_ROWS) * L.row;
  char *xs = (char *)mg_dev((size_t)iters * slot), *outs = (char *)mg_dev((size_t)iters * slot);
  int *counts = (int *)mg_host(sizeof(int) * (size_t)iters * (size_t)W.size);
  uint64_t st = 100;
  for (int it = 0; it < iters; ++it)
    for (int r = 0; r < W.size; ++r) {
      const uint64_t z = mg_next(&st);
      counts[it * W.size + r] = z % 6 == 0 ? 0 : (int)((z >> 8) % (uint64_t)(M + 1));
    }
  for (int it = 0; it < iters; ++it)
    fill_x(&L, xs + (size_t)it * slot, counts[it * W.size + W.rank], x_seed(c, it, W.rank));
  poison(outs, (size_t)iters * slot);
  sync_stream();
  const double t0 = mg_now();
  int fails = 0;
  for (int it = 0; it < iters; ++it) {
    const moelink_status_t s = moelink_ep_forward(L.ep, xs + (size_t)it * slot,
                                                  counts[it * W.size + W.rank],
                                                  outs + (size_t)it * slot, W.stream);
    if (s != MOELINK_SUCCESS && !fails++)
      CHECK(0, "stress call %d: %s: %s", it, moelink_status_string(s), moelink_last_error());
  }
  sync_stream();
  CHECK(fails == 0, "stress: %d calls enqueued back to back, all SUCCESS (%.3f s)", iters,
        mg_now() - t0);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "stress: moelink_comm_check");
  int good = 0;
  for (int it = 0; it < iters; ++it) {
    const int *cn = counts + it * W.size, T = cn[W.rank];
    const int mine = reference(&L, cn, c, it);
    sync_stream();
    char what[96];
    snprintf(what, sizeof what, "stress call %d (%d tokens here)", it, T);
    good += compare_out(&L, what, outs + (size_t)it * slot, slot, mine, T, 1);
  }
  CHECK(good == iters, "stress: %d of %d calls match the single-GPU layer", good, iters);
  free(counts);
  cudaFree(xs);
  cudaFree(outs);
  layer_free(&L);
}

/* Whether every rank says yes (NCCL all-reduce of the flag, min). */
static int all_agree(int yes) {
  int32_t *d = (int32_t *)mg_dev(2 * sizeof(int32_t)), h = yes ? 1 : 0;
  MG_CUDA(cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice));
  MG_NCCL(W.nccl, ncclAllReduce(d, d + 1, 1, ncclInt32, ncclMin, W.nccl, W.stream));
  sync_stream();
  MG_CUDA(cudaMemcpy(&h, d + 1, sizeof h, cudaMemcpyDeviceToHost));
  cudaFree(d);
  return h == 1;
}

/* One call captured in a CUDA graph, replayed three times with new x written
 * into the same buffer (outside the graph), an eager call after each. */
static void run_graph(void) {
  const int c = g_case++;
  moelink_moe_config_t cfg =
      make_config("deepseek-v3", MOELINK_DTYPE_BF16, 384, 256, 16, 4, 128, 77);
  layer L;
  layer_make(&L, "graph", &cfg, 0x6a9b0ull, 0);
  int counts[MOELINK_DEVICE_MAX_RANKS];
  for (int r = 0; r < W.size; ++r) counts[r] = 37 + 13 * r < cfg.max_tokens ? 37 + 13 * r : 1;
  const int T = counts[W.rank];
  const size_t bytes = (size_t)(cfg.max_tokens + GUARD_ROWS) * L.row;
  fill_x(&L, L.x, T, x_seed(c, 0, W.rank));
  sync_stream();
  cudaGraph_t g = NULL;
  cudaGraphExec_t ge = NULL;
  MG_CUDA(cudaStreamBeginCapture(W.stream, cudaStreamCaptureModeGlobal));
  const moelink_status_t s = moelink_ep_forward(L.ep, L.x, T, L.out, W.stream);
  char why[300];
  snprintf(why, sizeof why, "%s", s ? moelink_last_error() : "");
  const cudaError_t ce = cudaStreamEndCapture(W.stream, &g);
  cudaError_t ie = cudaErrorUnknown;
  if (s == MOELINK_SUCCESS && ce == cudaSuccess) ie = cudaGraphInstantiate(&ge, g, 0);
  (void)cudaGetLastError();
  CHECK(s == MOELINK_SUCCESS && ce == cudaSuccess && ie == cudaSuccess,
        "graph: ep_forward of %d tokens captured (%s%s%s; end capture: %s; instantiate: %s)", T,
        moelink_status_string(s), s ? ": " : "", why, cudaGetErrorString(ce),
        cudaGetErrorString(ie));
  /* Replays only where every rank has a graph: a lone replay would wait for
   * its peers forever. */
  if (all_agree(s == MOELINK_SUCCESS && ce == cudaSuccess && ie == cudaSuccess)) {
    for (int rep = 1; rep <= 3; ++rep) {
      fill_x(&L, L.x, T, x_seed(c, rep, W.rank));
      poison(L.out, bytes);
      poison(L.out2, bytes);
      MG_CUDA(cudaGraphLaunch(ge, W.stream));
      CHECK_OK(moelink_ep_forward(L.ep, L.x, T, L.out2, W.stream), "graph: eager call after it");
      const int mine = reference(&L, counts, c, rep);
      sync_stream();
      to_host(L.h_out, L.out, bytes);
      to_host(L.h_out2, L.out2, bytes);
      to_host(L.h_ref, (const char *)L.ref_out + (size_t)mine * L.row, (size_t)T * L.row);
      char what[96];
      snprintf(what, sizeof what, "graph replay %d (new x, %d tokens here)", rep, T);
      compare(&L, what, L.h_out, L.h_ref, T, 0);
      CHECK(memcmp(L.h_out, L.h_out2, bytes) == 0, "%s: the eager call gives the same bits",
            what);
    }
  } else {
    CHECK(0, "graph: not replayed (a rank failed to capture)");
  }
  if (ge) cudaGraphExecDestroy(ge);
  if (g) cudaGraphDestroy(g);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "graphs: moelink_comm_check");
  layer_free(&L);
}

/* Argument errors. Only cases where either every rank or no rank fails
 * before taking part: a rank that skips a call would leave its peers
 * waiting. */
static void run_errors(void) {
  /* Create-time limits of the CUDA layer (every rank gets the same cfg). */
  moelink_ep_config_t e = MOELINK_EP_CONFIG_INIT;
  e.moe = make_config("mixtral-8x7b", MOELINK_DTYPE_F32, 256, 128, 8, 2, 0, 16);
  moelink_ep_t bad = (moelink_ep_t)(uintptr_t)1;
  CHECK_STATUS(moelink_ep_create(W.comm, &e, &bad), MOELINK_ERR_UNSUPPORTED, "ep_create f32 on cuda");
  CHECK(bad == NULL, "a failed create leaves *out NULL");
  e.moe.dtype = MOELINK_DTYPE_BF16;
  e.moe.hidden = 44;
  CHECK_STATUS(moelink_ep_create(W.comm, &e, &bad), MOELINK_ERR_UNSUPPORTED,
               "ep_create hidden 44 (not a multiple of 8) on cuda");
  e.moe.hidden = 256;
  e.moe.num_experts = 2 * W.size + 1;
  e.moe.top_k = 2;
  if (W.size > 1) /* every count is a multiple of one rank */
    CHECK_STATUS(moelink_ep_create(W.comm, &e, &bad), MOELINK_ERR_INVALID_ARGUMENT,
                 "ep_create with num_experts not a multiple of the ranks");
  else
    ml_t_diag("one rank: no expert count that is not a multiple of the ranks (check skipped)");
  CHECK_OK(moelink_ep_destroy(NULL), "ep_destroy(NULL)");

  const int c = g_case++;
  moelink_moe_config_t cfg =
      make_config("mixtral-8x7b", MOELINK_DTYPE_BF16, 256, 128, 8, 2, 0, 40);
  layer L;
  layer_make(&L, "errors", &cfg, 0xe770ull, 0);
  const int M = cfg.max_tokens;

  /* Before set_weights, on every rank: the front end refuses it. */
  moelink_ep_t fresh = NULL;
  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = cfg;
  CHECK_OK(moelink_ep_create(W.comm, &ecfg, &fresh), "ep_create (no weights yet)");
  if (fresh) {
    CHECK_STATUS(moelink_ep_forward(fresh, L.x, 4, L.out, W.stream), MOELINK_ERR_INVALID_STATE,
                 "ep_forward before set_weights (every rank)");
    sync_stream();
    CHECK_OK(moelink_ep_destroy(fresh), "ep_destroy (no weights)");
  }

  /* Ranks with different configs (here call_tokens) all refuse the create. */
  if (W.size > 1) {
    ecfg.call_tokens = M * (1 + W.rank);
    moelink_ep_t odd = NULL;
    const moelink_status_t sc = moelink_ep_create(W.comm, &ecfg, &odd);
    CHECK(sc == MOELINK_ERR_INVALID_ARGUMENT && odd == NULL &&
              strstr(moelink_last_error(), "differs"),
          "ep_create with call_tokens %d on rank %d (different on every rank) -> %s (%s)",
          ecfg.call_tokens, W.rank, moelink_status_string(sc), moelink_last_error());
    if (odd) moelink_ep_destroy(odd);
    ecfg.call_tokens = 0;
  }

  /* More than call_tokens (here max_tokens) on every rank: each takes part
   * with no tokens and says why. */
  int counts[MOELINK_DEVICE_MAX_RANKS];
  const size_t bytes = (size_t)(M + GUARD_ROWS) * L.row;
  fill_x(&L, L.x, M + 1, x_seed(c, 0, W.rank));
  poison(L.out, bytes);
  const double t0 = mg_now();
  const moelink_status_t s = moelink_ep_forward(L.ep, L.x, M + 1, L.out, W.stream);
  char why[300];
  snprintf(why, sizeof why, "%s", moelink_last_error());
  sync_stream();
  to_host(L.h_out, L.out, bytes);
  size_t touched = 0;
  for (size_t i = 0; i < bytes; ++i) touched += L.h_out[i] != 0xff;
  CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(why, "call_tokens") &&
            strstr(why, "took part") && touched == 0,
        "ep_forward of call_tokens + 1 = %d tokens on every rank -> %s (%s) in %.3f s, %zu "
        "output bytes written",
        M + 1, moelink_status_string(s), why, mg_now() - t0, touched);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "comm_check after the refused call");

  /* x NULL with tokens on every rank: each takes part with none. */
  CHECK(moelink_ep_forward(L.ep, NULL, 5, L.out, W.stream) == MOELINK_ERR_INVALID_ARGUMENT &&
            strstr(moelink_last_error(), "took part"),
        "ep_forward with x NULL on every rank -> INVALID_ARGUMENT (%s)", moelink_last_error());

  /* One rank's x overlaps its out: it takes part with no tokens, the others
   * get their rows as if it had none. */
  const int badr = W.size - 1;
  for (int r = 0; r < W.size; ++r) counts[r] = r == badr ? 0 : 11 + 6 * r;
  if (W.rank == badr) {
    const moelink_status_t sb = moelink_ep_forward(L.ep, L.out, 9, L.out, W.stream);
    CHECK(sb == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "took part"),
          "ep_forward with x overlapping out on rank %d -> %s (%s)", W.rank,
          moelink_status_string(sb), moelink_last_error());
    (void)reference(&L, counts, c, 1); /* same calls on every rank: none here */
    sync_stream();
  } else {
    const int T = counts[W.rank];
    fill_x(&L, L.x, T, x_seed(c, 1, W.rank));
    poison(L.out, bytes);
    CHECK_OK(moelink_ep_forward(L.ep, L.x, T, L.out, W.stream), "ep_forward beside a bad rank");
    const int mine = reference(&L, counts, c, 1);
    sync_stream();
    compare_out(&L, "beside a rank with a bad argument", L.out, bytes, mine, T, 0);
  }
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "comm_check after the bad arguments");

  /* And the layer still works for everyone. */
  for (int r = 0; r < W.size; ++r) counts[r] = 17 + 4 * r;
  run_call(&L, counts, c, 2, 0);
  layer_free(&L);
}

/* ---- the pieces: moelink_ep_dispatch, this rank's experts, moelink_ep_combine ---- */

/* What one rank runs between the two exchanges: its own experts (a plain
 * moelink_moe layer of E / ranks experts) on the received rows. */
typedef struct pieces {
  moelink_moe_t local;
  int cap, kl;
  void *plan, *y, *ydense;   /* y: [cap * kl, H] permuted; ydense: by pair */
  void *ref_plan, *ref_y;    /* the single-GPU layer's pieces (reference) */
  int32_t *ref_ids;          /* [ranks * M, k] the reference's ids (device) */
  int32_t *h_ids, *h_ref_ids, *h_rids, *h_prows;
  float *h_wts, *h_rw;
  unsigned char *h_x, *h_rows, *h_y;
} pieces;

static void pieces_make(pieces *P, layer *L) {
  memset(P, 0, sizeof *P);
  const moelink_moe_config_t *c = &L->cfg;
  const int M = c->max_tokens, k = c->top_k;
  P->cap = layer_capacity && layer_capacity < W.size * M ? layer_capacity : W.size * M;
  P->kl = k < L->El ? k : L->El;
  moelink_moe_config_t lc = MOELINK_MOE_CONFIG_INIT;
  lc.hidden = c->hidden;
  lc.inter = c->inter;
  lc.num_experts = L->El;
  lc.top_k = P->kl;
  lc.dtype = c->dtype;
  lc.max_tokens = P->cap;
  MG_MUST(moelink_moe_create(W.ctx, &lc, &P->local), "local experts layer");
  const size_t es = moelink_dtype_size(c->dtype), H = (size_t)c->hidden, I = (size_t)c->inter;
  moelink_moe_weights_t lw = MOELINK_MOE_WEIGHTS_INIT;
  lw.dtype = c->dtype;
  lw.router = L->router; /* never used */
  lw.gate_up = (const char *)L->gate_up + (size_t)L->first * 2 * I * H * es;
  lw.down = (const char *)L->down + (size_t)L->first * H * I * es;
  MG_MUST(moelink_moe_set_weights(P->local, &lw), "local experts weights");
  const size_t pairs = (size_t)P->cap * (size_t)P->kl, all = (size_t)W.size * (size_t)M;
  P->plan = mg_dev(moelink_plan_bytes(P->cap, P->kl, L->El, moelink_moe_tile_rows(P->local)));
  P->y = mg_dev(pairs * L->row);
  P->ydense = mg_dev(pairs * L->row);
  P->ref_plan =
      mg_dev(moelink_plan_bytes((int)all, k, c->num_experts, moelink_moe_tile_rows(L->ref)));
  P->ref_y = mg_dev(all * (size_t)k * L->row);
  P->ref_ids = (int32_t *)mg_dev(all * (size_t)k * sizeof(int32_t));
  P->h_ids = (int32_t *)mg_host(all * (size_t)k * sizeof(int32_t));
  P->h_ref_ids = (int32_t *)mg_host(all * (size_t)k * sizeof(int32_t));
  P->h_wts = (float *)mg_host(all * (size_t)k * sizeof(float));
  P->h_x = (unsigned char *)mg_host(all * L->row);
  P->h_rows = (unsigned char *)mg_host((size_t)P->cap * L->row);
  P->h_rids = (int32_t *)mg_host(pairs * sizeof(int32_t));
  P->h_rw = (float *)mg_host(pairs * sizeof(float));
  P->h_prows = (int32_t *)mg_host(pairs * sizeof(int32_t));
  P->h_y = (unsigned char *)mg_host(pairs * L->row);
}

static void pieces_free(pieces *P) {
  sync_stream();
  CHECK_OK(moelink_moe_destroy(P->local), "moe_destroy (local experts)");
  void *d[] = {P->plan, P->y, P->ydense, P->ref_plan, P->ref_y, P->ref_ids};
  for (size_t i = 0; i < sizeof d / sizeof d[0]; ++i) cudaFree(d[i]);
  void *h[] = {P->h_ids, P->h_ref_ids, P->h_wts, P->h_x, P->h_rows,
               P->h_rids, P->h_rw,      P->h_prows, P->h_y};
  for (size_t i = 0; i < sizeof h / sizeof h[0]; ++i) free(h[i]);
}

/* Inputs of call (c, it): every rank's tokens into x_all, routed by the
 * single-GPU layer (the same batch on every rank, so every rank sees the same
 * ids), then holes: some slots get -1 or an id >= E (empty slots). The
 * reference ids are those, with rank `drop`'s experts also removed (>= 0:
 * that rank's combine sends zeros). Returns where this rank's tokens start. */
static int pieces_inputs(layer *L, pieces *P, const int *counts, int c, int it, int holes,
                         int drop) {
  const int k = L->cfg.top_k, E = L->cfg.num_experts;
  int total = 0, mine = 0;
  for (int r = 0; r < W.size; ++r) {
    if (r == W.rank) mine = total;
    fill_x(L, (char *)L->x_all + (size_t)total * L->row, counts[r], x_seed(c, it, r));
    total += counts[r];
  }
  fill_x(L, L->x, counts[W.rank], x_seed(c, it, W.rank));
  const size_t n = (size_t)total * (size_t)k;
  if (total > 0)
    MG_MUST(moelink_moe_route(L->ref, L->x_all, total, L->ids, L->wts, W.stream), "route x_all");
  sync_stream();
  to_host(P->h_ids, L->ids, n * sizeof(int32_t));
  to_host(P->h_wts, L->wts, n * sizeof(float));
  to_host(P->h_x, L->x_all, (size_t)total * L->row);
  for (int g = 0; g < total && holes; ++g) {
    if (g % 5 == 1) P->h_ids[(size_t)g * k] = -1;
    if (g % 7 == 3) P->h_ids[(size_t)g * k + k - 1] = E + 3;
  }
  const int El = E / W.size;
  for (size_t i = 0; i < n; ++i) {
    const int e = P->h_ids[i];
    P->h_ref_ids[i] = drop >= 0 && e >= drop * El && e < (drop + 1) * El ? -1 : e;
  }
  if (n) {
    MG_CUDA(cudaMemcpy(L->ids, P->h_ids, n * sizeof(int32_t), cudaMemcpyHostToDevice));
    MG_CUDA(cudaMemcpy(P->ref_ids, P->h_ref_ids, n * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  return mine;
}

/* The single-GPU layer's pieces on all ranks' tokens with the reference ids:
 * plan (empty slots dropped), experts on xe, combine, into ref_out. */
static void pieces_reference_on(layer *L, pieces *P, int total, const void *xe) {
  if (total == 0) return;
  MG_MUST(moelink_moe_plan(L->ref, P->ref_ids, total, P->ref_plan, W.stream), "reference plan");
  MG_MUST(moelink_moe_experts(L->ref, xe, total, P->ref_plan, L->wts, P->ref_y, W.stream),
          "reference experts");
  MG_MUST(moelink_moe_combine(L->ref, P->ref_y, total, P->ref_plan, L->ref_out, W.stream),
          "reference combine");
}

static void pieces_reference(layer *L, pieces *P, int total) {
  pieces_reference_on(L, P, total, L->x_all);
}

/* What this rank received against what it must have: per source rank s and
 * token t of s with at least one expert here, one row with t's bytes and its
 * local ids and weights in slot order; nothing else. Layout-free: rows are
 * matched by content. */
static int pieces_check_recv(layer *L, pieces *P, const moelink_ep_recv_t *rv, const int *counts,
                             const char *what) {
  const int k = L->cfg.top_k, kl = P->kl, first = L->first, El = L->El;
  CHECK(rv->capacity == P->cap && rv->top_k == kl && rv->rows && rv->expert_ids && rv->weights,
        "%s: recv capacity %d (want %d), top_k %d (want %d)", what, rv->capacity, P->cap,
        rv->top_k, kl);
  if (rv->capacity != P->cap || rv->top_k != kl) return 0;
  to_host(P->h_rows, rv->rows, (size_t)P->cap * L->row);
  to_host(P->h_rids, rv->expert_ids, (size_t)P->cap * kl * sizeof(int32_t));
  to_host(P->h_rw, rv->weights, (size_t)P->cap * kl * sizeof(float));
  int total = 0;
  for (int r = 0; r < W.size; ++r) total += counts[r];
  char *used = (char *)calloc((size_t)P->cap, 1);
  int expected = 0, found = 0, malformed = 0;
  for (int g = 0; g < total; ++g) {
    int want[64], nq = 0;
    float ww[64];
    for (int j = 0; j < k; ++j) {
      const int e = P->h_ids[(size_t)g * k + j];
      if (e >= first && e < first + El && nq < kl) {
        want[nq] = e - first;
        ww[nq++] = P->h_wts[(size_t)g * k + j];
      }
    }
    if (nq == 0) continue;
    ++expected;
    for (int r = 0; r < P->cap; ++r) {
      if (used[r]) continue;
      const int32_t *ri = P->h_rids + (size_t)r * kl;
      const float *rw = P->h_rw + (size_t)r * kl;
      int same = 1;
      for (int q = 0; q < kl && same; ++q)
        same = q < nq ? ri[q] == want[q] && memcmp(&rw[q], &ww[q], 4) == 0 : ri[q] == -1;
      if (!same || memcmp(P->h_rows + (size_t)r * L->row, P->h_x + (size_t)g * L->row, L->row))
        continue;
      used[r] = 1;
      ++found;
      break;
    }
  }
  int extra = 0;
  for (int r = 0; r < P->cap; ++r) {
    const int32_t *ri = P->h_rids + (size_t)r * kl;
    const float *rw = P->h_rw + (size_t)r * kl;
    int seen_empty = 0;
    for (int q = 0; q < kl; ++q) {
      if (ri[q] < 0) {
        seen_empty = 1;
        malformed += ri[q] != -1 || rw[q] != 0.0f;
      } else {
        malformed += seen_empty || ri[q] >= El;
      }
    }
    extra += !used[r] && ri[0] >= 0;
  }
  free(used);
  const int ok = found == expected && extra == 0 && malformed == 0;
  CHECK(ok, "%s: received %d of the %d expected rows (bytes, local ids, weights), %d unexpected, "
            "%d malformed slots",
        what, found, expected, extra, malformed);
  return ok;
}

/* This rank's experts on what a dispatch left in rv: plan, experts into
 * P->y; the plan's view (pair_rows: where y holds each pair). */
static moelink_plan_t pieces_experts(layer *L, pieces *P, const moelink_ep_recv_t *rv) {
  MG_MUST(moelink_moe_plan(P->local, rv->expert_ids, rv->capacity, P->plan, W.stream),
          "local plan");
  MG_MUST(moelink_moe_experts(P->local, rv->rows, rv->capacity, P->plan, rv->weights, P->y,
                              W.stream),
          "local experts");
  moelink_plan_t pv;
  MG_MUST(moelink_plan_view(P->plan, rv->capacity, P->kl, L->El, moelink_moe_tile_rows(P->local),
                            &pv),
          "plan view");
  return pv;
}

/* dispatch; local plan + experts; combine (y NULL on rank `drop`). */
static moelink_status_t pieces_layer(layer *L, pieces *P, int T, int drop, moelink_ep_recv_t *rv,
                                     const int32_t *ids, const float *wts) {
  moelink_status_t s = moelink_ep_dispatch(L->ep, T ? L->x : NULL, ids, wts, T, rv, W.stream);
  if (s != MOELINK_SUCCESS)
    return s;
  const moelink_plan_t pv = pieces_experts(L, P, rv);
  return moelink_ep_combine(L->ep, W.rank == drop ? NULL : P->y, pv.pair_rows,
                            T ? L->out : NULL, W.stream);
}

static void run_pieces(const char *name, const moelink_moe_config_t *cfg) {
  const int c = g_case++;
  layer L;
  layer_make(&L, name, cfg, 0x9e7e0000ull + (uint64_t)c, 0);
  pieces P;
  pieces_make(&P, &L);
  const int M = cfg->max_tokens, k = cfg->top_k;
  const size_t bytes = (size_t)(M + GUARD_ROWS) * L.row;
  uint64_t st = mg_seed(0, 4242 + c); /* the same on every rank: counts agree */
  int counts[MOELINK_DEVICE_MAX_RANKS];
  for (int it = 0; it < 8; ++it) {
    counts_of(it < 4 ? it : 4, M, &st, counts);
    const int holes = it % 2, T = counts[W.rank];
    const int mine = pieces_inputs(&L, &P, counts, c, it, holes, -1);
    char what[200];
    snprintf(what, sizeof what, "%s pieces call %d (%s), tokens here %d", name, it,
             holes ? "with empty slots" : "routed", T);
    poison(L.out, bytes);
    moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
    moelink_status_t s = moelink_ep_dispatch(L.ep, T ? L.x : NULL, L.ids + (size_t)mine * k,
                                             L.wts + (size_t)mine * k, T, &rv, W.stream);
    CHECK_OK(s, "ep_dispatch");
    if (s != MOELINK_SUCCESS) mg_bail("dispatch failed");
    sync_stream();
    pieces_check_recv(&L, &P, &rv, counts, what);
    moelink_plan_t pv = pieces_experts(&L, &P, &rv);
    /* The same outputs laid out by pair, for the pair_rows NULL call. */
    sync_stream();
    const size_t pairs = (size_t)P.cap * P.kl;
    to_host(P.h_prows, pv.pair_rows, pairs * sizeof(int32_t));
    to_host(P.h_y, P.y, pairs * L.row);
    MG_CUDA(cudaMemset(P.ydense, 0x7f, pairs * L.row));
    for (size_t q = 0; q < pairs; ++q)
      if (P.h_prows[q] >= 0)
        MG_CUDA(cudaMemcpy((char *)P.ydense + q * L.row, P.h_y + (size_t)P.h_prows[q] * L.row,
                           L.row, cudaMemcpyHostToDevice));
    CHECK_OK(moelink_ep_combine(L.ep, P.y, pv.pair_rows, T ? L.out : NULL, W.stream),
             "ep_combine");
    int total = 0;
    for (int r = 0; r < W.size; ++r) total += counts[r];
    pieces_reference(&L, &P, total);
    sync_stream();
    to_host(L.h_out, L.out, bytes);
    memset(L.h_ref, 0, (size_t)T * L.row);
    to_host(L.h_ref, (const char *)L.ref_out + (size_t)mine * L.row, (size_t)T * L.row);
    compare(&L, what, L.h_out, L.h_ref, T, 0);

    /* Again by pair (pair_rows NULL): bitwise the same out. */
    poison(L.out2, bytes);
    rv = (moelink_ep_recv_t)MOELINK_EP_RECV_INIT;
    CHECK_OK(moelink_ep_dispatch(L.ep, T ? L.x : NULL, L.ids + (size_t)mine * k,
                                 L.wts + (size_t)mine * k, T, &rv, W.stream),
             "ep_dispatch (again)");
    CHECK_OK(moelink_ep_combine(L.ep, P.ydense, NULL, T ? L.out2 : NULL, W.stream),
             "ep_combine (outputs by pair)");
    sync_stream();
    to_host(L.h_out2, L.out2, bytes);
    CHECK(memcmp(L.h_out, L.h_out2, (size_t)T * L.row) == 0,
          "%s: combine with outputs by pair (pair_rows NULL) is bitwise the same", what);
  }

  /* Interleaved with forward on the same layer, and a rank whose combine has
   * y NULL: it reports INVALID_ARGUMENT, the others' outputs lack exactly its
   * experts' contributions. */
  for (int r = 0; r < W.size; ++r) counts[r] = M - 3 * r;
  run_call(&L, counts, c, 20, 1);
  const int drop = W.size - 1;
  {
    const int mine = pieces_inputs(&L, &P, counts, c, 21, 1, drop), T = counts[W.rank];
    poison(L.out, bytes);
    moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
    const moelink_status_t s = pieces_layer(&L, &P, T, drop, &rv, L.ids + (size_t)mine * k,
                                            L.wts + (size_t)mine * k);
    if (W.rank == drop) {
      CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "zeros"),
            "%s: combine with y NULL on rank %d -> %s (%s)", name, W.rank,
            moelink_status_string(s), moelink_last_error());
      sync_stream();
    } else {
      CHECK_OK(s, "dispatch + experts + combine beside a rank with y NULL");
      int total = 0;
      for (int r = 0; r < W.size; ++r) total += counts[r];
      pieces_reference(&L, &P, total);
      sync_stream();
      compare_out(&L, "beside a rank whose combine had y NULL (its experts' terms are zero)", L.out,
                  bytes, mine, T, 0);
    }
  }
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "pieces: comm_check");

  /* A captured graph of dispatch + experts + combine, replayed on new inputs
   * (the token counts are part of the graph). */
  for (int r = 0; r < W.size; ++r) counts[r] = M / 2 + r;
  const int T = counts[W.rank];
  int mine = pieces_inputs(&L, &P, counts, c, 30, 0, -1), gtotal = 0;
  for (int r = 0; r < W.size; ++r) gtotal += counts[r];
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
  MG_CUDA(cudaStreamBeginCapture(W.stream, cudaStreamCaptureModeThreadLocal));
  const moelink_status_t sc = pieces_layer(&L, &P, T, -1, &rv, L.ids + (size_t)mine * k,
                                           L.wts + (size_t)mine * k);
  const cudaError_t ec = cudaStreamEndCapture(W.stream, &graph);
  CHECK(sc == MOELINK_SUCCESS && ec == cudaSuccess, "%s: dispatch + experts + combine captured "
        "(%s; %s)", name, moelink_status_string(sc), cudaGetErrorString(ec));
  if (sc == MOELINK_SUCCESS && ec == cudaSuccess) {
    MG_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; ++rep) {
      mine = pieces_inputs(&L, &P, counts, c, 31 + rep, rep, -1);
      poison(L.out, bytes);
      MG_CUDA(cudaGraphLaunch(exec, W.stream));
      pieces_reference(&L, &P, gtotal);
      sync_stream();
      char what[160];
      snprintf(what, sizeof what, "%s: graph replay %d of the pieces", name, rep);
      compare_out(&L, what, L.out, bytes, mine, T, 0);
    }
    MG_CUDA(cudaGraphExecDestroy(exec));
  }
  if (graph) MG_CUDA(cudaGraphDestroy(graph));
  (void)cudaGetLastError();

  /* Order errors, every rank alike (nothing is sent). */
  CHECK_STATUS(moelink_ep_combine(L.ep, P.y, NULL, L.out, W.stream), MOELINK_ERR_INVALID_STATE,
               "ep_combine without a dispatch");
  rv = (moelink_ep_recv_t)MOELINK_EP_RECV_INIT;
  CHECK_OK(moelink_ep_dispatch(L.ep, L.x, L.ids, L.wts, 4, &rv, W.stream), "ep_dispatch");
  CHECK_STATUS(moelink_ep_dispatch(L.ep, L.x, L.ids, L.wts, 4, &rv, W.stream),
               MOELINK_ERR_INVALID_STATE, "ep_dispatch twice");
  CHECK_STATUS(moelink_ep_forward(L.ep, L.x, 4, L.out, W.stream), MOELINK_ERR_INVALID_STATE,
               "ep_forward between dispatch and combine");
  CHECK_OK(moelink_ep_combine(L.ep, P.ydense, NULL, L.out, W.stream), "ep_combine after them");
  /* A bad argument on one rank: it takes part with no tokens. */
  rv = (moelink_ep_recv_t)MOELINK_EP_RECV_INIT;
  const moelink_status_t sb =
      moelink_ep_dispatch(L.ep, L.x, L.ids, L.wts, W.rank == 0 ? M + 1 : 3, &rv, W.stream);
  if (W.rank == 0)
    CHECK(sb == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "took part"),
          "ep_dispatch of max_tokens + 1 on rank 0 -> %s (%s)", moelink_status_string(sb),
          moelink_last_error());
  else
    CHECK_OK(sb, "ep_dispatch beside a rank with a bad argument");
  CHECK_OK(moelink_ep_combine(L.ep, P.ydense, NULL, L.out, W.stream), "ep_combine after it");
  sync_stream();
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "pieces: comm_check after the errors");
  pieces_free(&P);
  layer_free(&L);
}

/* ---- rows that travel as FP8 / MXFP8 (dispatch_quant) ----------------------------- */

/* The fused path (moelink_ep_dispatch quantizes on the way) against the
 * caller-quantized one (moelink_quantize, then moelink_ep_dispatch_quantized):
 * bitwise the same received rows and outputs, ranks mixing the two; the
 * CUDA moelink_quantize against the CPU one, bitwise; the outputs against the
 * single-GPU layer's pieces with the experts on dequantize(quantize(x)). */
static void run_quant(const char *name, const moelink_moe_config_t *cfg, moelink_quant_t fmt) {
  const int c = g_case++;
  layer_quant = fmt;
  layer L;
  layer_make(&L, name, cfg, 0x0f8e0000ull + (uint64_t)c, 0);
  layer_quant = MOELINK_QUANT_NONE;
  pieces P;
  pieces_make(&P, &L);
  const int M = cfg->max_tokens, k = cfg->top_k, H = cfg->hidden;
  const size_t sb = moelink_quant_scale_bytes(fmt, H), all = (size_t)W.size * M;
  uint8_t *xq = (uint8_t *)mg_dev(all * (size_t)H);
  void *xs = mg_dev(all * sb + 16);
  void *xdq = mg_dev(all * L.row);
  unsigned char *h_rows1 = (unsigned char *)mg_host((size_t)P.cap * L.row);
  int32_t *h_ids1 = (int32_t *)mg_host((size_t)P.cap * P.kl * sizeof(int32_t));
  uint8_t *h_q = (uint8_t *)mg_host(all * (size_t)H), *c_q = (uint8_t *)mg_host(all * (size_t)H);
  unsigned char *h_s = (unsigned char *)mg_host(all * sb + 16),
                *c_s = (unsigned char *)mg_host(all * sb + 16);
  moelink_context_t cpu = NULL;
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = MOELINK_BACKEND_CPU;
  cc.num_threads = 1;
  MG_MUST(moelink_context_create(&cc, &cpu), "cpu context");
  const size_t bytes = (size_t)(M + GUARD_ROWS) * L.row;
  uint64_t st = mg_seed(0, 9191 + c);
  int counts[MOELINK_DEVICE_MAX_RANKS];
  for (int it = 0; it < 4; ++it) {
    counts_of(it < 2 ? it + 1 : 4, M, &st, counts);
    const int T = counts[W.rank];
    const int mine = pieces_inputs(&L, &P, counts, c, it, it & 1, -1);
    int total = 0;
    for (int r = 0; r < W.size; ++r) total += counts[r];
    char what[200];
    snprintf(what, sizeof what, "%s %s call %d, tokens here %d", name,
             fmt == MOELINK_QUANT_FP8 ? "FP8" : "MXFP8", it, T);
    /* Everyone's rows quantized on the GPU and on the CPU: the same bits. */
    if (total > 0) {
      MG_MUST(moelink_quantize(W.ctx, fmt, cfg->dtype, L.x_all, total, H, xq, xs, W.stream),
              "moelink_quantize (cuda)");
      MG_MUST(moelink_dequantize(W.ctx, fmt, cfg->dtype, xq, xs, total, H, xdq, W.stream),
              "moelink_dequantize (cuda)");
      sync_stream();
      to_host(h_q, xq, (size_t)total * H);
      to_host(h_s, xs, (size_t)total * sb);
      MG_MUST(moelink_quantize(cpu, fmt, cfg->dtype, P.h_x, total, H, c_q, c_s, NULL),
              "moelink_quantize (cpu)");
      CHECK(memcmp(h_q, c_q, (size_t)total * H) == 0 && memcmp(h_s, c_s, (size_t)total * sb) == 0,
            "%s: moelink_quantize on the GPU gives the CPU's bytes and scales", what);
    }
    /* Fused: x quantized on the way. */
    poison(L.out, bytes);
    moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
    const moelink_status_t s1 = pieces_layer(&L, &P, T, -1, &rv, L.ids + (size_t)mine * k,
                                             L.wts + (size_t)mine * k);
    CHECK_OK(s1, "fused-quantize dispatch + experts + combine");
    sync_stream();
    to_host(h_rows1, rv.rows, (size_t)P.cap * L.row);
    to_host(h_ids1, rv.expert_ids, (size_t)P.cap * P.kl * sizeof(int32_t));
    to_host(L.h_out, L.out, bytes);
    /* Caller-quantized on odd ranks, fused on even ones. */
    poison(L.out2, bytes);
    moelink_ep_recv_t rv2 = MOELINK_EP_RECV_INIT;
    moelink_status_t s2;
    if (W.rank % 2)
      s2 = moelink_ep_dispatch_quantized(L.ep, xq + (size_t)mine * H,
                                         (char *)xs + (size_t)mine * sb, L.ids + (size_t)mine * k,
                                         L.wts + (size_t)mine * k, T, &rv2, W.stream);
    else
      s2 = moelink_ep_dispatch(L.ep, L.x, L.ids + (size_t)mine * k, L.wts + (size_t)mine * k, T,
                               &rv2, W.stream);
    CHECK_OK(s2, W.rank % 2 ? "ep_dispatch_quantized" : "ep_dispatch (beside quantized peers)");
    sync_stream();
    to_host(P.h_rows, rv2.rows, (size_t)P.cap * L.row);
    to_host(P.h_rids, rv2.expert_ids, (size_t)P.cap * P.kl * sizeof(int32_t));
    size_t diff = 0;
    for (int r = 0; r < P.cap; ++r)
      if (h_ids1[(size_t)r * P.kl] >= 0)
        diff += memcmp(h_rows1 + (size_t)r * L.row, P.h_rows + (size_t)r * L.row, L.row) != 0;
    CHECK(diff == 0 && memcmp(h_ids1, P.h_rids, (size_t)P.cap * P.kl * 4) == 0,
          "%s: caller-quantized and fused dispatch receive the same rows (%zu differ)", what,
          diff);
    MG_MUST(moelink_moe_plan(P.local, rv2.expert_ids, rv2.capacity, P.plan, W.stream), "plan");
    MG_MUST(moelink_moe_experts(P.local, rv2.rows, rv2.capacity, P.plan, rv2.weights, P.y,
                                W.stream),
            "experts");
    moelink_plan_t pv;
    MG_MUST(moelink_plan_view(P.plan, rv2.capacity, P.kl, L.El, moelink_moe_tile_rows(P.local),
                              &pv),
            "plan view");
    CHECK_OK(moelink_ep_combine(L.ep, P.y, pv.pair_rows, T ? L.out2 : NULL, W.stream),
             "ep_combine");
    sync_stream();
    to_host(L.h_out2, L.out2, bytes);
    CHECK(memcmp(L.h_out, L.h_out2, bytes) == 0, "%s: and the same outputs", what);
    /* Against the single-GPU layer with its experts on dequantize(quantize(x)). */
    pieces_reference_on(&L, &P, total, xdq);
    sync_stream();
    memset(L.h_ref, 0, (size_t)T * L.row);
    to_host(L.h_ref, (const char *)L.ref_out + (size_t)mine * L.row, (size_t)T * L.row);
    compare(&L, what, L.h_out, L.h_ref, T, 0);
  }
  /* dispatch_quantized on a layer whose rows travel unquantized is a bad
   * argument of this rank's: it takes part with no tokens. */
  CHECK_OK(moelink_context_destroy(cpu), "cpu context destroy");
  cudaFree(xq);
  cudaFree(xs);
  cudaFree(xdq);
  free(h_rows1);
  free(h_ids1);
  free(h_q);
  free(c_q);
  free(h_s);
  free(c_s);
  pieces_free(&P);
  layer_free(&L);
}

static void run_quant_errors(void) {
  moelink_moe_config_t cfg = make_config("mixtral-8x7b", MOELINK_DTYPE_BF16, 256, 128, 8, 2, 0, 16);
  layer L;
  layer_make(&L, "quant errors", &cfg, 0xe7e7ull, 0);
  moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
  uint8_t *xq = (uint8_t *)mg_dev(16 * 256);
  float *xs = (float *)mg_dev(16 * 8);
  const moelink_status_t s = moelink_ep_dispatch_quantized(L.ep, W.rank == 0 ? xq : NULL, xs,
                                                           L.ids, L.wts, 4, &rv, W.stream);
  CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "took part"),
        "ep_dispatch_quantized on a layer with dispatch_quant NONE -> %s (%s)",
        moelink_status_string(s), moelink_last_error());
  CHECK_OK(moelink_ep_combine(L.ep, L.out, NULL, L.out2, W.stream), "ep_combine after it");
  moelink_ep_config_t e = MOELINK_EP_CONFIG_INIT;
  e.moe = cfg;
  e.moe.hidden = 96;
  e.dispatch_quant = MOELINK_QUANT_FP8;
  moelink_ep_t bad = NULL;
  CHECK_STATUS(moelink_ep_create(W.comm, &e, &bad), MOELINK_ERR_INVALID_ARGUMENT,
               "ep_create FP8 dispatch with hidden 96 (not a multiple of 128)");
  e.moe.hidden = 256;
  e.dispatch_quant = (moelink_quant_t)7;
  CHECK_STATUS(moelink_ep_create(W.comm, &e, &bad), MOELINK_ERR_INVALID_ARGUMENT,
               "ep_create with dispatch_quant 7");
  sync_stream();
  cudaFree(xq);
  cudaFree(xs);
  layer_free(&L);
}

/* Rounds mode with rows that travel as FP8 (recv_capacity 1/8 of the whole
 * step): the forward against the single-GPU layer's pieces with the experts
 * on dequantize(quantize(x)) (routing on x; no shared expert). */
static void run_rounds_quant(void) {
  const int c = g_case++;
  moelink_moe_config_t cfg =
      make_config("qwen3-30b-a3b", MOELINK_DTYPE_BF16, 256, 128, 32, 8, 0, 40);
  const int M = cfg.max_tokens, H = cfg.hidden;
  const moelink_quant_t fmt = MOELINK_QUANT_FP8;
  layer_quant = fmt;
  layer_capacity = W.size * M / 8;
  layer L;
  layer_make(&L, "rounds qwen3-like E=32 k=8, FP8 rows", &cfg, 0x20d80000ull, 0);
  pieces P;
  pieces_make(&P, &L);
  layer_quant = MOELINK_QUANT_NONE;
  layer_capacity = 0;
  const size_t sb = moelink_quant_scale_bytes(fmt, H), all = (size_t)W.size * M;
  uint8_t *xq = (uint8_t *)mg_dev(all * (size_t)H);
  void *xs = mg_dev(all * sb + 16);
  void *xdq = mg_dev(all * L.row);
  const size_t bytes = (size_t)(M + GUARD_ROWS) * L.row;
  uint64_t st = mg_seed(0, 7171 + c);
  int counts[MOELINK_DEVICE_MAX_RANKS], good = 0;
  const int calls = 4;
  for (int it = 0; it < calls; ++it) {
    counts_of(it < 2 ? it + 1 : 4, M, &st, counts);
    const int T = counts[W.rank];
    const int mine = pieces_inputs(&L, &P, counts, c, it, 0, -1);
    int total = 0;
    for (int r = 0; r < W.size; ++r)
      total += counts[r];
    if (total > 0) {
      MG_MUST(moelink_quantize(W.ctx, fmt, cfg.dtype, L.x_all, total, H, xq, xs, W.stream),
              "moelink_quantize");
      MG_MUST(moelink_dequantize(W.ctx, fmt, cfg.dtype, xq, xs, total, H, xdq, W.stream),
              "moelink_dequantize");
    }
    pieces_reference_on(&L, &P, total, xdq);
    poison(L.out, bytes);
    CHECK_OK(moelink_ep_forward(L.ep, T ? L.x : NULL, T, T ? L.out : NULL, W.stream),
             "rounds: ep_forward with FP8 rows");
    sync_stream();
    char what[160];
    snprintf(what, sizeof what, "rounds FP8 rows: call %d, tokens here %d", it, T);
    good += compare_out(&L, what, L.out, bytes, mine, T, 0);
  }
  CHECK(good == calls, "rounds FP8 rows: %d of %d calls good", good, calls);
  cudaFree(xq);
  cudaFree(xs);
  cudaFree(xdq);
  pieces_free(&P);
  layer_free(&L);
}

/* Rounds mode (recv_capacity below ranks * max_tokens), the parts the
 * forward cases above do not reach: a dispatch whose pairs fit one round
 * (received rows and combine as with the whole step), one that needs more
 * (every rank refuses, nothing sent, the layer still works), and a capture
 * (refused before anything is enqueued: the step needs the host). */
static void run_rounds_errors(void) {
  const int c = g_case++;
  moelink_moe_config_t cfg = make_config("deepseek-v3", MOELINK_DTYPE_BF16, 256, 128, 32, 8, 0, 24);
  const int M = cfg.max_tokens, k = cfg.top_k;
  layer_capacity = W.size * M / 2;
  layer L;
  layer_make(&L, "rounds pieces", &cfg, 0x20d50000ull, 0);
  pieces P;
  pieces_make(&P, &L);
  layer_capacity = 0;
  const size_t bytes = (size_t)(M + GUARD_ROWS) * L.row;
  int counts[MOELINK_DEVICE_MAX_RANKS];

  /* one token a rank: at most ranks * k pairs reach a rank, within
   * recv_capacity (>= 12): one round */
  for (int r = 0; r < W.size; ++r)
    counts[r] = 1;
  {
    const int mine = pieces_inputs(&L, &P, counts, c, 0, 0, -1), T = counts[W.rank];
    poison(L.out, bytes);
    moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
    const moelink_status_t s = moelink_ep_dispatch(L.ep, L.x, L.ids + (size_t)mine * k,
                                                   L.wts + (size_t)mine * k, T, &rv, W.stream);
    CHECK_OK(s, "rounds: ep_dispatch of one token a rank (one round)");
    if (s != MOELINK_SUCCESS)
      mg_bail("dispatch failed");
    sync_stream();
    pieces_check_recv(&L, &P, &rv, counts, "rounds: one token a rank");
    moelink_plan_t pv = pieces_experts(&L, &P, &rv);
    CHECK_OK(moelink_ep_combine(L.ep, P.y, pv.pair_rows, L.out, W.stream), "rounds: ep_combine");
    int total = 0;
    for (int r = 0; r < W.size; ++r)
      total += counts[r];
    pieces_reference(&L, &P, total);
    sync_stream();
    compare_out(&L, "rounds: dispatch + experts + combine of one token a rank", L.out, bytes, mine,
                T, 0);
  }

  /* max_tokens a rank: about M * k pairs reach each rank, far over
   * recv_capacity: every rank refuses alike, with no combine owed */
  for (int r = 0; r < W.size; ++r)
    counts[r] = M;
  {
    const int mine = pieces_inputs(&L, &P, counts, c, 1, 0, -1), T = counts[W.rank];
    moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
    const double t0 = mg_now();
    const moelink_status_t s = moelink_ep_dispatch(L.ep, L.x, L.ids + (size_t)mine * k,
                                                   L.wts + (size_t)mine * k, T, &rv, W.stream);
    char why[400];
    snprintf(why, sizeof why, "%s", moelink_last_error());
    const double took = mg_now() - t0;
    const int refused = s == MOELINK_ERR_UNSUPPORTED && strstr(why, "rounds") != NULL;
    CHECK(all_agree(refused),
          "rounds: ep_dispatch of max_tokens a rank -> %s (%s) in %.3f s, "
          "the same on every rank",
          moelink_status_string(s), why, took);
  }
  for (int r = 0; r < W.size; ++r)
    counts[r] = M - 5 * r;
  run_call(&L, counts, c, 2, 0);

  /* capture: refused before anything is enqueued, on every rank */
  {
    cudaGraph_t g = NULL;
    MG_CUDA(cudaStreamBeginCapture(W.stream, cudaStreamCaptureModeThreadLocal));
    const moelink_status_t s = moelink_ep_forward(L.ep, L.x, 3, L.out, W.stream);
    char why[400];
    snprintf(why, sizeof why, "%s", moelink_last_error());
    MG_CUDA(cudaStreamEndCapture(W.stream, &g));
    size_t nodes = 99;
    MG_CUDA(cudaGraphGetNodes(g, NULL, &nodes));
    MG_CUDA(cudaGraphDestroy(g));
    CHECK(s == MOELINK_ERR_UNSUPPORTED && strstr(why, "capturable") && nodes == 0,
          "rounds: ep_forward under stream capture -> %s (%s), %zu nodes captured",
          moelink_status_string(s), why, nodes);
  }
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "rounds: comm_check after the refusals");
  for (int r = 0; r < W.size; ++r)
    counts[r] = 7 + r;
  run_call(&L, counts, c, 3, 0);
  pieces_free(&P);
  layer_free(&L);
}

int main(void) {
  mg_init(&W);
  const double t0 = mg_now();
  const moelink_dtype_t bf = MOELINK_DTYPE_BF16, f16 = MOELINK_DTYPE_F16;
  run_errors();
  ml_t_diag("errors done in %.1f s", mg_now() - t0);

  /* Mixtral-like: softmax, renormalized, top-2 of 8. Also checked against
   * the fp64 host reference. */
  moelink_moe_config_t mx = make_config("mixtral-8x7b", bf, 512, 256, 8, 2, 0, 96);
  run_layer("mixtral-like E=8 k=2", &mx, 1);
  /* DeepSeek-like: sigmoid + bias + 4 groups keep 2 + scaling 2.5 +
   * ungated shared expert; E = 32, k = 8, the widest shapes. */
  moelink_moe_config_t ds = make_config("deepseek-v3", bf, 1024, 512, 32, 8, 256, 64);
  run_layer("deepseek-like E=32 k=8", &ds, 0);
  /* The same family smaller, odd max_tokens. */
  moelink_moe_config_t ds2 = make_config("deepseek-v3", bf, 256, 128, 16, 4, 128, 77);
  run_layer("deepseek-like E=16 k=4", &ds2, 1);
  /* Qwen2-like: softmax, not renormalized, gated shared expert. */
  moelink_moe_config_t q2 = make_config("qwen2-57b-a14b", bf, 768, 384, 16, 4, 512, 128);
  run_layer("qwen2-like E=16 k=4", &q2, 0);
  moelink_moe_config_t q2h = make_config("qwen2-57b-a14b", f16, 256, 128, 8, 2, 256, 50);
  run_layer("qwen2-like E=8 k=2", &q2h, 1);
  /* Top-k of the logits, then softmax over the k. */
  moelink_moe_config_t ts = make_config(NULL, bf, 384, 256, 16, 4, 0, 100);
  ts.router = MOELINK_ROUTER_TOPK_SOFTMAX;
  run_layer("topk-softmax E=16 k=4", &ts, 0);
  /* Qwen3-like: k = 8 of 32 (16 local experts, more than k). */
  moelink_moe_config_t q3 = make_config("qwen3-30b-a3b", bf, 512, 128, 32, 8, 0, 72);
  run_layer("qwen3-like E=32 k=8", &q3, 0);
  /* FP8 experts (e4m3 weights, 128 x 128 block scales; token rows quantized
   * per 128 on the expert's rank), deepseek-like with the shared expert, and
   * a mixtral-like f16 one: against the single-GPU FP8 layer */
  moelink_moe_config_t f8 = make_config("deepseek-v3", bf, 512, 256, 16, 4, 128, 70);
  f8.fp8_experts = 1;
  run_layer("fp8 experts deepseek-like E=16 k=4", &f8, 0);
  moelink_moe_config_t f8m = make_config("mixtral-8x7b", f16, 256, 384, 8, 2, 0, 40);
  f8m.fp8_experts = 1;
  run_layer("fp8 experts mixtral-like f16 E=8 k=2", &f8m, 0);
  /* Calls of up to 3 steps (call_tokens = 3 * max_tokens, odd max_tokens):
   * counts 0 / 3M / 1 / odd / random, each rank its own number of steps' worth. */
  layer_steps = 3;
  moelink_moe_config_t st = make_config("deepseek-v3", bf, 256, 128, 16, 4, 128, 29);
  run_layer("deepseek-like E=16 k=4, 3 steps a call", &st, 1);
  layer_steps = 1;
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "layers: moelink_comm_check");
  ml_t_diag("layers done in %.1f s", mg_now() - t0);

  run_skew();
  ml_t_diag("skew done in %.1f s", mg_now() - t0);
  run_stress();
  ml_t_diag("stress done in %.1f s", mg_now() - t0);
  run_graph();
  ml_t_diag("graph done in %.1f s", mg_now() - t0);

  /* The pieces, without a shared expert (combine adds none). */
  moelink_moe_config_t pm = make_config("mixtral-8x7b", bf, 512, 256, 8, 2, 0, 60);
  run_pieces("pieces mixtral-like E=8 k=2", &pm);
  moelink_moe_config_t pd = make_config("deepseek-v3", bf, 256, 128, 32, 8, 0, 45);
  run_pieces("pieces deepseek-like E=32 k=8", &pd);
  ml_t_diag("pieces done in %.1f s", mg_now() - t0);

  /* Rows that travel as FP8 / MXFP8. */
  moelink_moe_config_t qd = make_config("deepseek-v3", bf, 512, 128, 32, 8, 0, 40);
  run_quant("quant deepseek-like E=32 k=8", &qd, MOELINK_QUANT_FP8);
  run_quant("quant deepseek-like E=32 k=8", &qd, MOELINK_QUANT_MXFP8);
  moelink_moe_config_t qm = make_config("mixtral-8x7b", f16, 256, 128, 8, 2, 0, 33);
  run_quant("quant mixtral-like f16 E=8 k=2", &qm, MOELINK_QUANT_MXFP8);
  run_quant_errors();
  ml_t_diag("quant done in %.1f s", mg_now() - t0);

  /* Rounds mode: recv_capacity 1/8 of the whole step (deepseek-like, k = 8:
   * tens of rounds a step), with 3 steps a call, with FP8 rows, FP8 experts
   * (e4m3 weights), an odd tiny capacity of 3 rows, and every token on rank
   * 0's experts (the rounds grow, the memory does not) */
  moelink_moe_config_t rd = make_config("deepseek-v3", bf, 256, 128, 32, 8, 128, 48);
  layer_capacity = W.size * 48 / 8;
  run_layer("rounds deepseek-like E=32 k=8, recv_capacity 1/8", &rd, 1);
  layer_steps = 3;
  moelink_moe_config_t rs = make_config("deepseek-v3", bf, 256, 128, 16, 4, 128, 29);
  layer_capacity = W.size * 29 / 8;
  run_layer("rounds deepseek-like E=16 k=4, 3 steps a call", &rs, 0);
  layer_steps = 1;
  run_rounds_quant();
  moelink_moe_config_t rf = make_config("deepseek-v3", bf, 512, 256, 16, 4, 128, 40);
  rf.fp8_experts = 1;
  layer_capacity = W.size * 40 / 8;
  run_layer("rounds fp8 experts deepseek-like E=16 k=4", &rf, 0);
  moelink_moe_config_t rt = make_config("mixtral-8x7b", f16, 256, 128, 8, 2, 0, 20);
  layer_capacity = 3;
  run_layer("rounds mixtral-like f16 E=8 k=2, recv_capacity 3", &rt, 0);
  layer_capacity = W.size * 96 / 8; /* run_skew's max_tokens */
  run_skew();
  layer_capacity = 0;
  run_rounds_errors();
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "rounds: moelink_comm_check");
  ml_t_diag("rounds done in %.1f s", mg_now() - t0);

  ml_t_diag("%zu of %zu compared elements bitwise equal to the single-GPU layer; worst rel L2 "
            "%.3g, worst |d| %.3g; all done in %.1f s",
            bitwise_equal, compared, worst_rel, worst_abs, mg_now() - t0);
  mg_fini(&W);
  return ml_test_done();
}
