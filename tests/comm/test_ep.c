/* Expert parallelism (moelink_ep_*) on CPU ranks, against the single-rank
 * layer: every rank builds the whole layer from the counter-based generator
 * (same seed: same weights everywhere), binds its slice of the experts to the
 * EP layer, and also runs moelink_moe_forward on a CPU context over the
 * concatenation of all ranks' tokens (rank order); its rows of that output
 * are the reference for its own EP output.
 *
 * What must hold, and how strongly it is checked:
 * - The EP combine adds the same fp32 values in the same order as the
 *   single-rank combine (slot order j = 0..k-1, then the shared expert, one
 *   rounding), so any difference can only come from the GEMMs themselves:
 *   BLAS sees an expert's rows (and the router's and the shared expert's) in
 *   batches of other sizes (a rank's own tokens; rounds of recv_capacity),
 *   and OpenBLAS picks kernels (and the backend picks the operand order) by
 *   batch size, so the last bit of a dot product may differ. Hence:
 *   - exact cases (make_exact): every GEMM is exact in fp32 whatever its
 *     batch or order, so everything left is elementwise and the outputs must
 *     be bitwise equal, at every rank count, capacity and step size. This
 *     pins down the combine order and the values sent back;
 *   - random cases: f32 |d| <= 1e-5 * (|ref| + rms(ref)); bf16/f16 at most
 *     2 units in the last place of the reference, or relative L2 <= 1e-2
 *     (a value near a rounding boundary may land one ulp off after a last-
 *     bit GEMM difference). The test also reports how many elements match
 *     bitwise (at one rank with one round and step, all: the BLAS calls are
 *     then the same).
 * - A different routing decision would change an output by O(1), far outside
 *   those bounds, so matching outputs also show the routing is the same.
 * - Bitwise: two EP runs on the same inputs (determinism).
 * Cases: random token counts per rank (0 included), several reduced presets
 * (E = 24 divides 1, 2, 3 and 8 ranks; E = 8 where it divides, with fewer
 * local experts than top_k at 8 ranks), shared experts with and without a
 * gate, several steps (tokens > max_tokens), skew (every token routed to
 * rank 0's experts with a recv_capacity that forces many rounds), outputs
 * poisoned with NaN, 100 iterations of one layer, and the error paths.
 *
 * The pieces (moelink_ep_dispatch / moelink_ep_combine):
 * - protocol, with synthetic experts (pc_g: small integers, so every sum is
 *   exact and compared bitwise): each rank rebuilds every rank's tokens and
 *   routing from the seed and checks what it received (the set of (source,
 *   token) rows by their bytes, local ids and weights in slot order, -1 in
 *   empty rows, capacity and top_k) and what it combined (the sum over the
 *   valid slots only: ids outside [0, E) are skipped, never read from an
 *   earlier call's results); y by pair and through pair_rows; a bad argument
 *   on one rank (dispatch: x NULL, num_tokens > max_tokens, recv NULL or
 *   mis-sized; combine: y NULL, out NULL, pair_rows outside y) fails there
 *   while its peers finish without that rank's experts; misuse (dispatch
 *   twice, forward in between, combine without dispatch): INVALID_STATE;
 *   a routing over recv_capacity, or repeated ids no row can hold: every
 *   rank refuses, and forward and dispatch/combine work afterwards;
 * - with real experts: dispatch, moelink_moe_plan / moelink_moe_experts on
 *   a local layer, combine, against the single-rank layer's expert outputs
 *   combined on the host (exact cases bitwise, also with empty slots) and
 *   its forward (no shared expert), interleaved with moelink_ep_forward. */
#include "comm_test.h"

#include <math.h>

static moelink_context_t ctx;
static moelink_comm_t comm;
static int rank, nranks;
static size_t bitwise_equal, compared;
static double worst_ratio; /* largest |d| / allowed seen */

typedef struct ep_case {
  const char *name;
  moelink_moe_config_t cfg;
  int recv_capacity;
  double zipf;  /* > 0: skew */
  int max_t;    /* tokens per rank are drawn from [0, max_t] */
  int iters;
  uint64_t seed;
  int exact;    /* integer inputs with inter = shared_inter = 1: bitwise */
} ep_case;

static moelink_moe_config_t base_config(const char *preset, moelink_dtype_t dt, int E, int k,
                                        int shared_inter) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  if (preset && moelink_moe_preset(preset, &c) != MOELINK_SUCCESS) {
    printf("Bail out! no preset %s\n", preset);
    exit(1);
  }
  c.hidden = 40;
  c.inter = 24;
  c.num_experts = E;
  c.top_k = k;
  if (c.n_group > 1) {
    c.n_group = 4;
    c.topk_group = 2;
  }
  if (c.shared_inter > 0 || shared_inter > 0) c.shared_inter = shared_inter;
  if (c.shared_inter == 0) c.shared_gate = 0;
  c.dtype = dt;
  c.max_tokens = 32;
  return c;
}

/* Tokens of rank r in iteration it: some ranks get none. */
static int tokens_of(const ep_case *ec, int it, int r) {
  uint64_t z = ct_mix(ec->seed * 131 + (uint64_t)it, (uint64_t)r);
  if (z % 5 == 0) return 0;
  return (int)((z >> 8) % (uint64_t)(ec->max_t + 1));
}

/* Tokens of all ranks in iteration it; *off and *mine: where this rank's
 * start in the concatenation and how many there are. */
static int iteration_rows(const ep_case *ec, int it, int *off, int *mine) {
  int total = 0;
  for (int r = 0; r < nranks; ++r) {
    const int t = tokens_of(ec, it, r);
    if (r == rank) {
      *off = total;
      *mine = t;
    }
    total += t;
  }
  return total;
}

/* |got - ref| against the dtype's bound; counts bitwise matches. */
static int compare(moelink_dtype_t dt, const void *got, const void *ref, size_t n,
                   const char *what) {
  const size_t es = moelink_dtype_size(dt);
  double ss = 0.0, sd = 0.0;
  for (size_t i = 0; i < n; ++i) {
    double r = ref_load(dt, ref, i);
    ss += r * r;
  }
  const double rms = n ? sqrt(ss / (double)n) : 0.0;
  long bad = -1;
  for (size_t i = 0; i < n; ++i) {
    const double g = ref_load(dt, got, i), r = ref_load(dt, ref, i);
    if (memcmp((const char *)got + i * es, (const char *)ref + i * es, es) == 0) ++bitwise_equal;
    ++compared;
    const double d = fabs(g - r);
    sd += d * d;
    double allowed;
    if (dt == MOELINK_DTYPE_F32) {
      allowed = 1e-5 * (fabs(r) + rms);
    } else {
      /* 2 ulps of the reference value (bf16: 8 significant bits; f16: 11). */
      const int bits = dt == MOELINK_DTYPE_BF16 ? 8 : 11;
      int e2;
      frexp(r == 0.0 ? rms : r, &e2);
      allowed = 2.0 * ldexp(1.0, e2 - bits);
    }
    if (!(d <= allowed) && bad < 0) bad = (long)i;
    if (d / (allowed > 0 ? allowed : 1e-30) > worst_ratio) worst_ratio = d / allowed;
  }
  const double rel = ss > 0 ? sqrt(sd / ss) : sqrt(sd);
  const int ok = bad < 0 || (dt != MOELINK_DTYPE_F32 && rel <= 1e-2);
  if (!ok)
    CHECK(0, "%s: element %ld is %g, reference %g (rel L2 %.3g)", what, bad,
          ref_load(dt, got, (size_t)bad), ref_load(dt, ref, (size_t)bad), rel);
  return ok;
}

/* ref_fill_x's values, generated on this rank's one-thread context: a team
 * of several OpenMP threads per call would keep spinning after it and starve
 * the other rank processes sharing the cores. */
static void fill_x(const ref_layer *L, void *x, int num_tokens, uint64_t seed) {
  if (num_tokens <= 0) return;
  const size_t H = (size_t)L->cfg.hidden;
  if (moelink_fill_random(ctx, L->cfg.dtype, x, (size_t)num_tokens * H,
                          ref_tensor_seed(seed, REF_T_X), ref_tensor_scale(&L->cfg, REF_T_X),
                          0.0f, NULL) != MOELINK_SUCCESS)
    CHECK(0, "fill x: %s", moelink_last_error());
  if (L->zipf_alpha > 0.0)
    for (int t = 0; t < num_tokens; ++t) ref_store(L->cfg.dtype, x, (size_t)t * H, 1.0);
}

/* n values of dtype: integers in [-m, m] times scale, from the generator. */
static void exact_values(moelink_dtype_t dt, void *p, size_t n, uint64_t seed, int m,
                         double scale) {
  for (size_t i = 0; i < n; ++i) {
    const double u = (double)moelink_random_value(seed, i, 1.0f, 0.0f);
    double v = floor((u + 1.0) * 0.5 * (2 * m + 1)) - m;
    if (v > m) v = m;
    ref_store(dt, p, i, v * scale);
  }
}

/* Makes every GEMM of the layer exact in fp32, whatever its summation order
 * or batch: router, gate/up and the shared gate get integers times powers of
 * two (x gets integers), and inter = shared_inter = 1 leaves the down GEMMs
 * one product each. What remains (scores, top-k, SiLU, routing weights, the
 * combine) is elementwise, so EP and the single-rank layer must agree bit for
 * bit at any rank count, capacity and step size. */
static void make_exact(ref_layer *L) {
  const moelink_moe_config_t *c = &L->cfg;
  const size_t H = (size_t)c->hidden, E = (size_t)c->num_experts, I = (size_t)c->inter;
  exact_values(c->dtype, L->router, E * H, L->seed + 1, 2, 0.25);
  exact_values(c->dtype, L->gate_up, E * 2 * I * H, L->seed + 2, 2, 0.125);
  if (c->shared_inter > 0)
    exact_values(c->dtype, L->shared_gate_up, 2 * (size_t)c->shared_inter * H, L->seed + 3, 2,
                 0.125);
  if (c->shared_gate) exact_values(c->dtype, L->shared_gate, H, L->seed + 4, 2, 0.0625);
}

/* Binds this rank's slice of L's experts. */
static moelink_moe_weights_t local_weights(const ref_layer *L, int first) {
  const moelink_moe_config_t *c = &L->cfg;
  const size_t es = c->fp8_experts ? 1 : moelink_dtype_size(c->dtype);
  const size_t H = (size_t)c->hidden, I = (size_t)c->inter;
  moelink_moe_weights_t w = L->w;
  w.gate_up = (const char *)L->gate_up + (size_t)first * 2 * I * H * es;
  w.down = (const char *)L->down + (size_t)first * H * I * es;
  if (c->fp8_experts) { /* e4m3 bytes, one scale per 128 x 128 block */
    w.gate_up_scale = L->gate_up_scale + (size_t)first * (2 * I / 128) * (H / 128);
    w.down_scale = L->down_scale + (size_t)first * (H / 128) * (I / 128);
  }
  return w;
}

/* What every case starts from: the weights (L), the single-rank layer over
 * all ranks' tokens (*single) and the EP layer (*ep, rows travelling as
 * quant). Either layer may come back NULL (the failure is a CHECK). */
static int case_layers(const ep_case *ec, int zipf, moelink_quant_t quant, ref_layer *L,
                       moelink_moe_t *single, moelink_ep_t *ep) {
  const moelink_moe_config_t *c = &ec->cfg;
  *single = NULL;
  *ep = NULL;
  if (ref_layer_make(L, c, ec->seed, zipf ? ec->zipf : 0) != 0) {
    CHECK(0, "%s: ref_layer_make", ec->name);
    return 0;
  }
  if (ec->exact) make_exact(L);
  moelink_moe_config_t rc = *c;
  rc.max_tokens = nranks * ec->max_t + 1;
  CHECK_OK(moelink_moe_create(ctx, &rc, single), "single-rank layer");
  if (*single) CHECK_OK(moelink_moe_set_weights(*single, &L->w), "single-rank weights");
  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = *c;
  ecfg.recv_capacity = ec->recv_capacity;
  ecfg.dispatch_quant = quant;
  CHECK_OK(moelink_ep_create(comm, &ecfg, ep), ec->name);
  return 1;
}

static void run_case(const ep_case *ec) {
  const moelink_moe_config_t *c = &ec->cfg;
  const moelink_dtype_t dt = c->dtype;
  const size_t es = moelink_dtype_size(dt), row = (size_t)c->hidden * es;
  ref_layer L;
  moelink_moe_t single;
  moelink_ep_t ep;
  if (!case_layers(ec, 1, MOELINK_QUANT_NONE, &L, &single, &ep)) return;
  if (!ep || !single) {
    moelink_ep_destroy(ep);
    moelink_moe_destroy(single);
    ref_layer_free(&L);
    return;
  }
  int first = -1, El = 0;
  moelink_ep_config_t got_cfg;
  CHECK_OK(moelink_ep_get_config(ep, &got_cfg, &first, &El), "ep_get_config");
  CHECK(first == rank * (c->num_experts / nranks) && El == c->num_experts / nranks &&
            got_cfg.recv_capacity >= 1 && got_cfg.call_tokens == c->max_tokens,
        "%s: rank %d owns experts [%d, %d + %d), recv_capacity %d, call_tokens %d (0 resolved "
        "to max_tokens)",
        ec->name, rank, first, first, El, got_cfg.recv_capacity, got_cfg.call_tokens);
  moelink_moe_weights_t w = local_weights(&L, first);
  CHECK_OK(moelink_ep_set_weights(ep, &w), "ep_set_weights");

  const size_t cap_all = (size_t)nranks * (size_t)ec->max_t + 1;
  unsigned char *x_all = (unsigned char *)ct_alloc(cap_all * row);
  unsigned char *ref_out = (unsigned char *)ct_alloc(cap_all * row);
  unsigned char *out = (unsigned char *)ct_alloc(cap_all * row);
  unsigned char *out2 = (unsigned char *)ct_alloc(cap_all * row);
  int32_t *ids = (int32_t *)ct_alloc(cap_all * (size_t)c->top_k * 4);
  float *wts = (float *)ct_alloc(cap_all * (size_t)c->top_k * 4);
  int failures = 0;
  const double t_start = ct_now_ms();
  const size_t eq0 = bitwise_equal, cmp0 = compared;
  for (int it = 0; it < ec->iters; ++it) {
    int mine_off = 0, mine = 0;
    const int total = iteration_rows(ec, it, &mine_off, &mine);
    fill_x(&L, x_all, total, ec->seed * 7919 + (uint64_t)it);
    if (ec->exact) exact_values(dt, x_all, (size_t)total * c->hidden, ec->seed * 7919 + it, 2, 1.0);
    if (total > 0 && moelink_moe_forward(single, x_all, total, ref_out, NULL) != MOELINK_SUCCESS) {
      CHECK(0, "%s: single-rank forward: %s", ec->name, moelink_last_error());
      break;
    }
    if (ec->zipf > 0 && it == 0 && total > 0) {
      /* The setup, not the code under test: every token picks rank 0's experts. */
      CHECK_OK(moelink_moe_route(single, x_all, total, ids, wts, NULL), "route (skew setup)");
      int off_rank0 = 0;
      for (size_t p = 0; p < (size_t)total * (size_t)c->top_k; ++p)
        off_rank0 += ids[p] / El != 0;
      CHECK(off_rank0 == 0, "%s: skew routes all %d tokens to rank 0's experts (%d slots elsewhere)",
            ec->name, total, off_rank0);
    }
    for (size_t i = 0; i < (size_t)mine * (size_t)c->hidden; ++i) ref_store(dt, out, i, NAN);
    moelink_status_t s =
        moelink_ep_forward(ep, mine ? x_all + (size_t)mine_off * row : NULL, mine, out, NULL);
    if (s != MOELINK_SUCCESS) {
      CHECK(0, "%s iteration %d: ep_forward: %s", ec->name, it, moelink_last_error());
      break;
    }
    char what[160];
    snprintf(what, sizeof what, "%s iteration %d (%d of %d tokens)", ec->name, it, mine, total);
    if (ec->exact) {
      const long at = ct_first_diff(out, ref_out + (size_t)mine_off * row, (size_t)mine * c->hidden, es);
      if (at >= 0) {
        CHECK(0, "%s: element %ld is %.9g, single-rank layer %.9g (must be bitwise equal)", what, at,
              ref_load(dt, out, (size_t)at), ref_load(dt, ref_out + (size_t)mine_off * row, (size_t)at));
        ++failures;
      }
      bitwise_equal += (size_t)mine * c->hidden;
      compared += (size_t)mine * c->hidden;
    } else if (!compare(dt, out, ref_out + (size_t)mine_off * row, (size_t)mine * c->hidden,
                        what)) {
      ++failures;
    }
    if (it == 0) {
      for (size_t i = 0; i < (size_t)mine * (size_t)c->hidden; ++i) ref_store(dt, out2, i, NAN);
      CHECK_OK(moelink_ep_forward(ep, mine ? x_all + (size_t)mine_off * row : NULL, mine, out2,
                                  NULL),
               "ep_forward again");
      CHECK(ct_first_diff(out, out2, (size_t)mine * c->hidden, es) < 0,
            "%s: two runs are bitwise equal", ec->name);
    }
  }
  CHECK(failures == 0, "%s: %d iterations of %d match the single-rank layer (%s, %d tokens max "
                       "per rank, recv_capacity %d)",
        ec->name, ec->iters - failures, ec->iters, moelink_dtype_name(dt), ec->max_t,
        got_cfg.recv_capacity);
  ml_t_diag("%s (%s): %zu of %zu elements bitwise equal, %.0f ms", ec->name,
            moelink_dtype_name(dt), bitwise_equal - eq0, compared - cmp0,
            ct_now_ms() - t_start);
  free(x_all);
  free(ref_out);
  free(out);
  free(out2);
  free(ids);
  free(wts);
  CHECK_OK(moelink_ep_destroy(ep), "ep_destroy");
  moelink_moe_destroy(single);
  ref_layer_free(&L);
}

static void test_layers(void) {
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  for (int d = 0; d < 3; ++d) {
    const moelink_dtype_t dt = dts[d];
    const uint64_t sd = (uint64_t)d;
    ep_case cases[8];
    int nc = 0;
    /* Mixtral-like: softmax, renormalized, k = 2. */
    cases[nc++] = (ep_case){"mixtral", base_config("mixtral-8x7b", dt, 24, 2, 0), 0, 0, 21, 2,
                            11 + sd, 0};
    /* Qwen2-like: no renormalization, gated shared expert; a small capacity
     * and max_tokens, so calls take several steps and rounds. */
    moelink_moe_config_t q2 = base_config("qwen2-57b-a14b", dt, 24, 4, 40);
    q2.max_tokens = 7;
    cases[nc++] = (ep_case){"qwen2 (steps, rounds)", q2, 5, 0, 19, 2, 21 + sd, 0};
    if (dt != MOELINK_DTYPE_F16) {
      /* DeepSeek-like: sigmoid, bias, groups, scaling, ungated shared expert. */
      cases[nc++] = (ep_case){"deepseek", base_config("deepseek-v3", dt, 24, 6, 16), 0, 0, 17,
                              2, 31 + sd, 0};
      /* Qwen3-like, k = 8 over 24 experts. */
      cases[nc++] = (ep_case){"qwen3", base_config("qwen3-30b-a3b", dt, 24, 8, 0), 0, 0, 13, 2,
                              41 + sd, 0};
      /* gpt-oss-like top-k then softmax; E = 8: at 8 ranks one local expert,
       * fewer than top_k. */
      if (8 % nranks == 0) {
        moelink_moe_config_t g = base_config(NULL, dt, 8, 2, 0);
        g.router = MOELINK_ROUTER_TOPK_SOFTMAX;
        cases[nc++] = (ep_case){"topk-softmax E=8", g, 0, 0, 15, 2, 51 + sd, 0};
      }
      /* Exact GEMMs: bitwise against the single-rank layer, through steps
       * and rounds (see make_exact). */
      moelink_moe_config_t xq = base_config("qwen2-57b-a14b", dt, 24, 4, 1);
      xq.inter = 1;
      xq.max_tokens = 6;
      cases[nc++] = (ep_case){"exact qwen2 (steps, rounds)", xq, 4, 0, 17, 2, 91 + sd, 1};
      moelink_moe_config_t xd = base_config("deepseek-v3", dt, 24, 6, 1);
      xd.inter = 1;
      cases[nc++] = (ep_case){"exact deepseek", xd, 0, 0, 19, 2, 93 + sd, 1};
    }
    for (int i = 0; i < nc; ++i) run_case(&cases[i]);
  }
  /* FP8 expert weights (bytes and scales sliced per rank), DeepSeek-like with
   * a shared expert, through steps and rounds. bf16 only: the single-rank
   * layer's GEMMs see other batches, and a last-bit difference in a SwiGLU
   * output can move its FP8 rounding by one step, which f32's 1e-5 bound
   * would not allow. */
  moelink_moe_config_t f8 = base_config("deepseek-v3", MOELINK_DTYPE_BF16, 24, 6, 16);
  f8.hidden = 256;
  f8.inter = 128;
  f8.fp8_experts = 1;
  f8.max_tokens = 9;
  ep_case fc = {"fp8 experts deepseek (steps, rounds)", f8, 7, 0, 19, 2, 97, 0};
  run_case(&fc);
}

/* Every token of every rank to rank 0's experts, through a receive buffer of
 * 3 rows: rank 0 receives about 20 * nranks rows per call, in that many / 3
 * rounds, in the same memory as a balanced call. */
static void test_skew(void) {
  moelink_moe_config_t c = base_config("mixtral-8x7b", MOELINK_DTYPE_BF16, 24, 2, 24);
  ep_case ec = {"skew to rank 0", c, 3, 40.0, 24, 2, 61, 0};
  run_case(&ec);
  c.dtype = MOELINK_DTYPE_F32;
  c.max_tokens = 5;
  ec = (ep_case){"skew to rank 0, steps", c, 2, 40.0, 24, 1, 63, 0};
  run_case(&ec);
}

/* One layer, 100 calls with new token counts and inputs each. */
static void test_iterations(void) {
  moelink_moe_config_t c = base_config("qwen3-30b-a3b", MOELINK_DTYPE_BF16, 24, 4, 0);
  ep_case ec = {"100 iterations", c, 0, 0, 20, 100, 71, 0};
  run_case(&ec);
}

/* A rank with a bad argument takes part with no tokens: the others finish
 * and get right results. */
static void test_bad_rank(void) {
  moelink_moe_config_t c = base_config("mixtral-8x7b", MOELINK_DTYPE_F32, 24, 2, 0);
  ref_layer L;
  if (ref_layer_make(&L, &c, 81, 0) != 0) {
    CHECK(0, "ref_layer_make");
    return;
  }
  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = c;
  moelink_ep_t ep = NULL;
  CHECK_OK(moelink_ep_create(comm, &ecfg, &ep), "ep_create (bad rank)");
  const int El = c.num_experts / nranks;
  moelink_moe_weights_t w = local_weights(&L, rank * El);
  CHECK_STATUS(moelink_ep_forward(ep, NULL, 0, NULL, NULL), MOELINK_ERR_INVALID_STATE,
               "ep_forward before set_weights (every rank)");
  CHECK_OK(moelink_ep_set_weights(ep, &w), "ep_set_weights");
  const int T = 9, bad = nranks - 1;
  const size_t row = (size_t)c.hidden * 4;
  float *x_all = (float *)ct_alloc((size_t)T * (size_t)nranks * row);
  float *ref_out = (float *)ct_alloc((size_t)T * (size_t)nranks * row);
  float *out = (float *)ct_alloc((size_t)T * row);
  /* The reference: the good ranks' tokens only. */
  const int total = T * (nranks - 1);
  fill_x(&L, x_all, T * nranks, 82);
  moelink_moe_config_t rc = c;
  rc.max_tokens = T * nranks;
  moelink_moe_t single = NULL;
  CHECK_OK(moelink_moe_create(ctx, &rc, &single), "single-rank layer");
  CHECK_OK(moelink_moe_set_weights(single, &L.w), "single-rank weights");
  if (total > 0) CHECK_OK(moelink_moe_forward(single, x_all, total, ref_out, NULL), "reference");
  for (int mode = 0; mode < 3; ++mode) {
    for (size_t i = 0; i < (size_t)T * c.hidden; ++i) out[i] = NAN;
    if (rank == bad) {
      static const char *const what[] = {"num_tokens -1", "x NULL", "x and out overlap"};
      moelink_status_t s = mode == 0   ? moelink_ep_forward(ep, x_all, -1, out, NULL)
                           : mode == 1 ? moelink_ep_forward(ep, NULL, T, out, NULL)
                                       : moelink_ep_forward(ep, out, T, out, NULL);
      CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "took part"),
            "ep_forward with %s on rank %d -> %s (%s)", what[mode], rank,
            moelink_status_string(s), moelink_last_error());
    } else {
      CHECK_OK(moelink_ep_forward(ep, x_all + (size_t)rank * T * c.hidden, T, out, NULL),
               "ep_forward beside a rank with a bad argument");
      char what[96];
      snprintf(what, sizeof what, "beside a bad rank, mode %d", mode);
      CHECK(compare(MOELINK_DTYPE_F32, out, ref_out + (size_t)rank * T * c.hidden,
                    (size_t)T * c.hidden, what),
            "results beside a rank with a bad argument (mode %d)", mode);
    }
  }
  free(x_all);
  free(ref_out);
  free(out);
  moelink_moe_destroy(single);
  CHECK_OK(moelink_ep_destroy(ep), "ep_destroy");
  ref_layer_free(&L);
}

static void test_errors(void) {
  moelink_moe_config_t c = base_config("mixtral-8x7b", MOELINK_DTYPE_BF16, 24, 2, 0);
  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = c;
  moelink_ep_t ep = (moelink_ep_t)(uintptr_t)1;
  size_t bytes = 0;
  CHECK_STATUS(moelink_ep_create(NULL, &ecfg, &ep), MOELINK_ERR_INVALID_ARGUMENT, "NULL comm");
  CHECK(ep == NULL, "out is NULL after a failed create");
  CHECK_STATUS(moelink_ep_create(comm, NULL, &ep), MOELINK_ERR_INVALID_ARGUMENT, "NULL cfg");
  CHECK_STATUS(moelink_ep_create(comm, &ecfg, NULL), MOELINK_ERR_INVALID_ARGUMENT, "NULL out");
  CHECK_STATUS(moelink_ep_workspace_size(comm, &ecfg, NULL), MOELINK_ERR_INVALID_ARGUMENT,
               "NULL bytes");
  CHECK_OK(moelink_ep_workspace_size(comm, &ecfg, &bytes), "ep_workspace_size");
  CHECK(bytes > 0, "workspace %zu bytes", bytes);
  /* Memory is the config's: a smaller receive buffer is a smaller workspace. */
  moelink_ep_config_t small = ecfg;
  small.recv_capacity = 2;
  size_t small_bytes = 0;
  CHECK_OK(moelink_ep_workspace_size(comm, &small, &small_bytes), "ep_workspace_size (cap 2)");
  CHECK(small_bytes < bytes, "recv_capacity 2 takes less (%zu) than the default (%zu)",
        small_bytes, bytes);
  moelink_ep_config_t e = ecfg;
  e.size = 8;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT, "bad size field");
  e = ecfg;
  e.recv_capacity = -1;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
               "recv_capacity -1");
  e = ecfg;
  e.call_tokens = -1;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT, "call_tokens -1");
  CHECK(strstr(moelink_last_error(), "call_tokens") != NULL, "the message names call_tokens: %s",
        moelink_last_error());
  e = ecfg;
  e.moe.top_k = 0;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT, "moe.top_k 0");
  CHECK(strstr(moelink_last_error(), "config.moe") && strstr(moelink_last_error(), "top_k"),
        "the message names the field: %s", moelink_last_error());
  e = ecfg;
  e.moe.dtype = MOELINK_DTYPE_FP8_E4M3;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_UNSUPPORTED, "fp8");
  e = ecfg;
  e.moe.hidden = 128;
  e.moe.shared_inter = 128;
  e.moe.fp8_shared = 1;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_UNSUPPORTED, "moe.fp8_shared");
  CHECK(strstr(moelink_last_error(), "fp8_shared") != NULL, "the message names fp8_shared: %s",
        moelink_last_error());
  if (nranks > 1) {
    e = ecfg;
    e.moe.num_experts = 4 * nranks + 1;
    CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
                 "num_experts not a multiple of the ranks");
    CHECK(strstr(moelink_last_error(), "multiple"), "the message says why: %s",
          moelink_last_error());
    /* Same sizes, another scaling on rank 0: every rank refuses. */
    e = ecfg;
    if (rank == 0) e.moe.routed_scaling = 2.0f;
    CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
                 "configs that differ between ranks");
  }
  CHECK_OK(moelink_ep_destroy(NULL), "ep_destroy(NULL)");
  CHECK_STATUS(moelink_ep_forward(NULL, NULL, 0, NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT,
               "forward on NULL");
  CHECK_STATUS(moelink_ep_set_weights(NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT,
               "set_weights on NULL");

  /* Weights. */
  ep = NULL;
  c.shared_inter = 0;
  ecfg.moe = c;
  CHECK_OK(moelink_ep_create(comm, &ecfg, &ep), "ep_create");
  if (!ep) return;
  static uint16_t dummy[64];
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.dtype = MOELINK_DTYPE_BF16;
  w.router = dummy;
  w.gate_up = dummy;
  w.down = dummy;
  moelink_moe_weights_t b = w;
  CHECK_STATUS(moelink_ep_set_weights(ep, NULL), MOELINK_ERR_INVALID_ARGUMENT, "NULL weights");
  b.size = 3;
  CHECK_STATUS(moelink_ep_set_weights(ep, &b), MOELINK_ERR_INVALID_ARGUMENT, "weights size");
  b = w;
  b.dtype = MOELINK_DTYPE_F32;
  CHECK_STATUS(moelink_ep_set_weights(ep, &b), MOELINK_ERR_DTYPE_MISMATCH, "weights dtype");
  b = w;
  b.gate_up = NULL;
  CHECK_STATUS(moelink_ep_set_weights(ep, &b), MOELINK_ERR_INVALID_ARGUMENT, "no gate_up");
  b = w;
  b.router = NULL;
  CHECK_STATUS(moelink_ep_set_weights(ep, &b), MOELINK_ERR_INVALID_ARGUMENT, "no router");
  b = w;
  b.shared_gate_up = dummy;
  b.shared_down = dummy;
  CHECK_STATUS(moelink_ep_set_weights(ep, &b), MOELINK_ERR_INVALID_ARGUMENT,
               "shared expert the config does not have");
  b = w;
  b.correction_bias = (const float *)(const void *)dummy;
  CHECK_STATUS(moelink_ep_set_weights(ep, &b), MOELINK_ERR_INVALID_ARGUMENT,
               "correction bias the config does not use");
  CHECK_STATUS(moelink_ep_forward(ep, NULL, 0, NULL, NULL), MOELINK_ERR_INVALID_STATE,
               "forward after failed set_weights (every rank)");
  CHECK_OK(moelink_ep_set_weights(ep, &w), "ep_set_weights");
  /* All ranks with no tokens: nothing moves, nothing hangs. */
  CHECK_OK(moelink_ep_forward(ep, NULL, 0, NULL, NULL), "ep_forward with 0 tokens everywhere");
  CHECK_OK(moelink_ep_destroy(ep), "ep_destroy");
}

/* ---- dispatch / combine ------------------------------------------------- */

/* An id that marks an empty slot: outside [0, E) in several ways. */
static int32_t empty_id(int E, uint64_t h) {
  switch (h % 6) {
  case 0: return -1;
  case 1: return E;
  case 2: return E + 5;
  case 3: return -9;
  case 4: return INT32_MIN;
  default: return INT32_MAX;
  }
}

static int valid_id(int32_t id, int E) { return id >= 0 && id < E; }

/* Tokens of rank r in call it of a case: 0 now and then. */
static int pc_tokens(uint64_t seed, int it, int r, int max_t) {
  const uint64_t z = ct_mix(seed * 977 + (uint64_t)it, (uint64_t)r);
  if (z % 5 == 0) return 0;
  return (int)((z >> 8) % (uint64_t)(max_t + 1));
}

/* Routing of T tokens as a router would write it (k distinct experts per
 * token, weights in (0, 1)), then empty_pct percent of the slots made empty.
 * own_rank >= 0: only that rank's experts (slots beyond them empty). */
static void pc_routing(const moelink_moe_config_t *c, int own_rank, uint64_t seed, int T,
                       int empty_pct, int32_t *ids, float *wts) {
  const int E = c->num_experts, k = c->top_k, El = E / nranks;
  const int lo = own_rank >= 0 ? own_rank * El : 0, span = own_rank >= 0 ? El : E;
  uint64_t ctr = 0;
  for (int t = 0; t < T; ++t) {
    int32_t *id = ids + (size_t)t * k;
    for (int j = 0; j < k; ++j) {
      const uint64_t p = (uint64_t)t * k + (uint64_t)j;
      id[j] = -1;
      while (j < span) {
        const int32_t cand = lo + (int32_t)(ct_mix(seed, ctr++) % (uint64_t)span);
        int dup = 0;
        for (int q = 0; q < j; ++q) dup |= id[q] == cand;
        if (!dup) {
          id[j] = cand;
          break;
        }
      }
      wts[p] = (float)(1 + ct_mix(seed + 1, p) % 997) / 1024.0f;
    }
    for (int j = 0; j < k; ++j) {
      const uint64_t p = (uint64_t)t * k + (uint64_t)j;
      if (empty_pct > 0 && ct_mix(seed + 2, p) % 100 < (uint64_t)empty_pct)
        id[j] = empty_id(E, ct_mix(seed + 3, p));
    }
  }
}

/* The synthetic expert output of the protocol rounds: what rank d's "expert
 * e" answers for token t of source s, element i. Small integers, so every
 * sum is exact in every dtype and any wrong, missing or extra term shows. */
static double pc_g(int e, int s, int t, int i) {
  return (double)((e * 7 + s * 5 + t * 3 + i) % 9 - 4);
}

typedef struct pc_opts {
  int max_t;      /* tokens per rank drawn from [0, max_t] */
  int empty_pct;  /* share of slots made empty */
  int own;        /* every token picks its own rank's experts only */
  int permute;    /* y laid out through a reversed pair_rows, not by pair */
  int bad_rank;   /* -1, or the rank whose dispatch gets a bad argument */
  int bad_mode;   /* 0: x NULL with T > 0; 1: num_tokens > max_tokens; 2: recv NULL;
                     3: recv size field; 4: dispatch_quantized (on a NONE layer);
                     5: dispatch_quantized with xq NULL; 6: with scales NULL */
  int y_rank;     /* -1, or the rank whose combine gets a bad argument */
  int y_mode;     /* 0: y NULL; 1: out NULL; 2: a pair_rows entry outside y */
  int misuse;     /* a second dispatch and a forward before the combine */
  int quant;      /* the layer's dispatch_quant */
  int qcall;      /* who calls moelink_ep_dispatch_quantized (the others moelink_ep_dispatch):
                     0 nobody, 1 every rank, 2 rank 0, 3 every rank but 0 */
} pc_opts;

/* Whether this rank dispatches already quantized rows under o. */
static int pc_quantized_here(const pc_opts *o) {
  return o->qcall == 1 || (o->qcall == 2 && rank == 0) || (o->qcall == 3 && rank != 0);
}

/* One dispatch + combine with synthetic experts (pc_g), checked on every
 * rank against what it computes from every rank's inputs: the rows it
 * received (set of (source, token), bytes, local ids and weights in slot
 * order, empty rows), then its combined output. With o->quant the rows a
 * token arrives as are moelink_dequantize(moelink_quantize(x)) of its
 * source's x, whichever dispatch call the source made. Returns the
 * failures; digest (may be NULL) gets a hash of the rows received, their
 * ids and weights, and the combined output. */
static int pieces_round(moelink_ep_t ep, const moelink_moe_config_t *c, int cap, uint64_t seed,
                        int it, const pc_opts *o, const char *name, uint64_t *digest) {
  const int E = c->num_experts, k = c->top_k, H = c->hidden, El = E / nranks;
  const int kl = k < El ? k : El, first = rank * El, maxT = o->max_t;
  const moelink_dtype_t dt = c->dtype;
  const size_t es = moelink_dtype_size(dt), row = (size_t)H * es;
  int failures = 0;
  int *Ts = (int *)ct_alloc(sizeof(int) * (size_t)nranks);
  unsigned char *xs = (unsigned char *)ct_alloc((size_t)nranks * maxT * row);
  int32_t *ids = (int32_t *)ct_alloc((size_t)nranks * maxT * k * 4);
  float *wts = (float *)ct_alloc((size_t)nranks * maxT * k * 4);
  /* With a quantized layer: every rank's q, scales and the rows they stand
   * for (what the experts' ranks must receive). */
  const moelink_quant_t qf = (moelink_quant_t)o->quant;
  const size_t sbytes = moelink_quant_scale_bytes(qf, H);
  uint8_t *xq = (uint8_t *)ct_alloc((size_t)nranks * maxT * H);
  uint8_t *xsc = (uint8_t *)ct_alloc((size_t)nranks * maxT * sbytes + 1);
  unsigned char *xdq = (unsigned char *)ct_alloc((size_t)nranks * maxT * row);
  for (int r = 0; r < nranks; ++r) {
    const uint64_t sr = ct_seed(seed * 1000 + (uint64_t)it, r);
    Ts[r] = pc_tokens(seed, it, r, maxT);
    pc_routing(c, o->own ? r : -1, sr, Ts[r], o->empty_pct, ids + (size_t)r * maxT * k,
               wts + (size_t)r * maxT * k);
    unsigned char *xr = xs + (size_t)r * maxT * row;
    if (Ts[r] > 0 &&
        moelink_fill_random(ctx, dt, xr, (size_t)Ts[r] * H, sr ^ 0x55, 1.0f, 0.0f, NULL) !=
            MOELINK_SUCCESS)
      CHECK(0, "fill x: %s", moelink_last_error());
    if (Ts[r] > 0 && qf != MOELINK_QUANT_NONE) {
      uint8_t *qr = xq + (size_t)r * maxT * H, *sr8 = xsc + (size_t)r * maxT * sbytes;
      if (moelink_quantize(ctx, qf, dt, xr, Ts[r], H, qr, sr8, NULL) != MOELINK_SUCCESS ||
          moelink_dequantize(ctx, qf, dt, qr, sr8, Ts[r], H, xdq + (size_t)r * maxT * row,
                             NULL) != MOELINK_SUCCESS)
        CHECK(0, "quantize x: %s", moelink_last_error());
    } else if (Ts[r] > 0) {
      memcpy(xdq + (size_t)r * maxT * row, xr, (size_t)Ts[r] * row);
    }
  }
  const int bad = rank == o->bad_rank;
  const int T = Ts[rank];
  const unsigned char *xm = xs + (size_t)rank * maxT * row;
  const uint8_t *qm = xq + (size_t)rank * maxT * H, *sm = xsc + (size_t)rank * maxT * sbytes;
  const int32_t *im = ids + (size_t)rank * maxT * k;
  const float *wm = wts + (size_t)rank * maxT * k;
  char what[200];
  snprintf(what, sizeof what, "%s call %d (%s, %d tokens here)", name, it, moelink_dtype_name(dt),
           T);

  moelink_ep_recv_t recv = MOELINK_EP_RECV_INIT;
  moelink_status_t s;
  if (bad) {
    moelink_ep_recv_t sized = recv;
    sized.size = 7;
    static const char *const why[] = {"x NULL",      "num_tokens > max_tokens",
                                      "recv NULL",   "recv size 7",
                                      "dispatch_quantized on a NONE layer",
                                      "xq NULL",     "scales NULL"};
    static const char *const says[] = {"x is NULL",    "max_tokens", "recv is NULL", "recv size",
                                       "NONE",         "xq is NULL", "scales is NULL"};
    const int T1 = T > 0 ? T : 1;
    switch (o->bad_mode) {
    case 0: s = moelink_ep_dispatch(ep, NULL, im, wm, T1, &recv, NULL); break;
    case 1: s = moelink_ep_dispatch(ep, xm, im, wm, c->max_tokens + 1, &recv, NULL); break;
    case 2: s = moelink_ep_dispatch(ep, xm, im, wm, T, NULL, NULL); break;
    case 3: s = moelink_ep_dispatch(ep, xm, im, wm, T, &sized, NULL); break;
    case 4: s = moelink_ep_dispatch_quantized(ep, qm, sm, im, wm, T, &recv, NULL); break;
    case 5: s = moelink_ep_dispatch_quantized(ep, NULL, sm, im, wm, T1, &recv, NULL); break;
    default: s = moelink_ep_dispatch_quantized(ep, qm, NULL, im, wm, T1, &recv, NULL); break;
    }
    CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "took part") &&
              strstr(moelink_last_error(), says[o->bad_mode]),
          "%s: dispatch with %s on rank %d -> %s (%s)", what, why[o->bad_mode], rank,
          moelink_status_string(s), moelink_last_error());
  } else if (pc_quantized_here(o)) {
    s = moelink_ep_dispatch_quantized(ep, T ? qm : NULL, T ? sm : NULL, T ? im : NULL,
                                      T ? wm : NULL, T, &recv, NULL);
    if (s != MOELINK_SUCCESS) {
      CHECK(0, "%s: dispatch_quantized: %s", what, moelink_last_error());
      ++failures;
    }
  } else {
    s = moelink_ep_dispatch(ep, T ? xm : NULL, T ? im : NULL, T ? wm : NULL, T, &recv, NULL);
    if (s != MOELINK_SUCCESS) {
      CHECK(0, "%s: dispatch: %s", what, moelink_last_error());
      ++failures;
    }
  }
  if (o->misuse) {
    moelink_ep_recv_t r2 = MOELINK_EP_RECV_INIT;
    CHECK_STATUS(moelink_ep_dispatch(ep, NULL, NULL, NULL, 0, &r2, NULL),
                 MOELINK_ERR_INVALID_STATE, "a second dispatch before the combine");
    CHECK(r2.capacity == 0 && r2.rows == NULL, "the refused dispatch left its recv alone");
    CHECK_STATUS(moelink_ep_forward(ep, NULL, 0, NULL, NULL), MOELINK_ERR_INVALID_STATE,
                 "forward between dispatch and combine");
  }

  /* What this rank must have received: every good source's tokens with a
   * slot of this rank's experts, their local ids and weights in slot order. */
  typedef struct { int s, t, n, found; int32_t lid[64]; float lw[64]; } want_t;
  want_t *want = (want_t *)ct_alloc(sizeof(want_t) * ((size_t)nranks * maxT + 1));
  int nwant = 0;
  for (int r = 0; r < nranks; ++r) {
    if (r == o->bad_rank) continue;
    for (int t = 0; t < Ts[r]; ++t) {
      want_t *wt = &want[nwant];
      wt->s = r;
      wt->t = t;
      wt->n = 0;
      wt->found = 0;
      for (int j = 0; j < k; ++j) {
        const int32_t id = ids[((size_t)r * maxT + t) * k + j];
        if (valid_id(id, E) && id / El == rank && wt->n < 64) {
          wt->lid[wt->n] = id - first;
          wt->lw[wt->n++] = wts[((size_t)r * maxT + t) * k + j];
        }
      }
      nwant += wt->n > 0;
    }
  }
  const size_t yrows = (size_t)cap * kl;
  unsigned char *y = (unsigned char *)ct_alloc(yrows * row);
  int32_t *pr = (int32_t *)ct_alloc(yrows * 4);
  for (size_t i = 0; i < yrows * H; ++i) ref_store(dt, y, i, NAN);
  for (size_t p = 0; p < yrows; ++p) pr[p] = -1;
  int any_pair = 0;
  uint64_t h = 1469598103934665603ull;
  if (!bad && s == MOELINK_SUCCESS) {
    int ok = recv.capacity == cap && recv.top_k == kl && recv.rows && recv.expert_ids &&
             recv.weights && recv.size == sizeof recv;
    CHECK(ok, "%s: recv capacity %d (want %d), top_k %d (want %d), pointers set", what,
          recv.capacity, cap, recv.top_k, kl);
    int rows_held = 0, wrong = 0;
    for (int r = 0; ok && r < recv.capacity; ++r) {
      const int32_t *li = recv.expert_ids + (size_t)r * kl;
      const float *lw = recv.weights + (size_t)r * kl;
      int holds = 0;
      for (int q = 0; q < kl; ++q) holds |= li[q] >= 0;
      if (!holds) {
        for (int q = 0; q < kl; ++q)
          if (li[q] != -1 && !wrong++)
            CHECK(0, "%s: empty row %d slot %d holds %d, not -1", what, r, q, (int)li[q]);
        continue;
      }
      ++rows_held;
      const unsigned char *rb = (const unsigned char *)recv.rows + (size_t)r * row;
      h = ct_mix(h, ct_hash(rb, row));
      h = ct_mix(h, ct_hash(li, (size_t)kl * 4) ^ ct_hash(lw, (size_t)kl * 4));
      want_t *m = NULL;
      for (int i = 0; i < nwant && !m; ++i)
        if (!want[i].found &&
            memcmp(rb, xdq + ((size_t)want[i].s * maxT + want[i].t) * row, row) == 0)
          m = &want[i];
      if (!m) {
        if (!wrong++) CHECK(0, "%s: row %d matches no token sent to rank %d", what, r, rank);
        continue;
      }
      m->found = 1;
      int same = 1;
      for (int q = 0; q < kl; ++q) {
        const int32_t wl = q < m->n ? m->lid[q] : -1;
        const float ww = q < m->n ? m->lw[q] : 0.0f;
        same &= li[q] == wl && memcmp(&lw[q], &ww, 4) == 0;
      }
      if (!same && !wrong++)
        CHECK(0, "%s: row %d (rank %d's token %d): local ids %d.. weights %g.., want %d.. %g..",
              what, r, m->s, m->t, (int)li[0], (double)lw[0], (int)m->lid[0], (double)m->lw[0]);
      for (int q = 0; q < m->n; ++q) {
        const size_t p = (size_t)r * kl + q;
        const size_t at = o->permute ? yrows - 1 - p : p;
        pr[p] = (int32_t)at;
        any_pair = 1;
        for (int i = 0; i < H; ++i)
          ref_store(dt, y, at * H + i, pc_g(first + m->lid[q], m->s, m->t, i));
      }
    }
    int missing = 0;
    for (int i = 0; i < nwant; ++i) missing += !want[i].found;
    CHECK(ok && !wrong && !missing && rows_held == nwant,
          "%s: rank %d received %d token rows, wants %d (%d missing), all bytes, ids, weights "
          "and empty rows right",
          what, rank, rows_held, nwant, missing);
    failures += !ok || wrong || missing || rows_held != nwant;
  }

  /* Combine. A rank with a bad dispatch answers with y NULL (it was never
   * told what it received). */
  unsigned char *out = (unsigned char *)ct_alloc((size_t)(maxT + 1) * row);
  for (size_t i = 0; i < (size_t)(maxT + 1) * H; ++i) ref_store(dt, out, i, NAN);
  const int ybad = rank == o->y_rank;
  int expect_bad = bad;
  if (bad) {
    s = moelink_ep_combine(ep, NULL, NULL, out, NULL);
  } else if (ybad && o->y_mode == 0) {
    s = moelink_ep_combine(ep, NULL, o->permute ? pr : NULL, out, NULL);
    expect_bad = 1;
  } else if (ybad && o->y_mode == 1) {
    s = moelink_ep_combine(ep, y, o->permute ? pr : NULL, NULL, NULL);
    expect_bad = T > 0;
  } else if (ybad) {
    for (size_t p = 0; p < yrows; ++p)
      if (pr[p] >= 0) {
        pr[p] = (int32_t)(yrows + 3);
        break;
      }
    s = moelink_ep_combine(ep, y, pr, out, NULL);
    expect_bad = any_pair;
  } else {
    s = moelink_ep_combine(ep, y, o->permute ? pr : NULL, out, NULL);
  }
  if (expect_bad) {
    CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "zeros"),
          "%s: combine with a bad argument on rank %d -> %s (%s)", what, rank,
          moelink_status_string(s), moelink_last_error());
    size_t touched = 0;
    for (size_t i = 0; i < (size_t)(maxT + 1) * H; ++i) touched += !isnan(ref_load(dt, out, i));
    CHECK(touched == 0, "%s: a refused combine writes no out (%zu elements written)", what,
          touched);
  } else {
    if (s != MOELINK_SUCCESS) {
      CHECK(0, "%s: combine: %s", what, moelink_last_error());
      ++failures;
    }
  }
  /* The expected sums: every valid slot whose expert answered; a rank with a
   * bad argument sends zeros, which add nothing. */
  const int y_zero = o->y_rank >= 0 && (o->y_mode != 1 || Ts[o->y_rank] > 0) ? o->y_rank : -1;
  if (!expect_bad && !(ybad && o->y_mode == 1)) {
    unsigned char *want_out = (unsigned char *)ct_alloc((size_t)(T + 1) * row);
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < H; ++i) {
        double acc = 0.0;
        for (int j = 0; j < k; ++j) {
          const int32_t id = im[(size_t)t * k + j];
          if (!valid_id(id, E) || id / El == o->bad_rank || id / El == y_zero) continue;
          acc += pc_g(id, rank, t, i);
        }
        ref_store(dt, want_out, (size_t)t * H + i, acc);
      }
    const long at = ct_first_diff(out, want_out, (size_t)T * H, es);
    if (at >= 0)
      CHECK(0, "%s: combined output (y %s): element %ld is %g, want %g", what,
            o->permute ? "through pair_rows" : "by pair", at, ref_load(dt, out, (size_t)at),
            ref_load(dt, want_out, (size_t)at));
    else
      CHECK(1, "%s: combined output (y %s) bitwise the expected sums%s", what,
            o->permute ? "through pair_rows" : "by pair",
            y_zero >= 0 || o->bad_rank >= 0 ? ", without the experts of the rank with a bad "
                                              "argument"
                                            : "");
    failures += at >= 0;
    free(want_out);
  }
  if (digest) *digest = ct_mix(h, ct_hash(out, (size_t)T * row));
  free(out);
  free(y);
  free(pr);
  free(want);
  free(Ts);
  free(xs);
  free(xq);
  free(xsc);
  free(xdq);
  free(ids);
  free(wts);
  return failures;
}

/* The protocol of the pieces, with synthetic experts: odd sizes, every dtype,
 * fewer local experts than top_k (E = 8 at 8 ranks), empty slots, both y
 * layouts, each kind of bad argument on one rank, misuse. No weights are
 * ever bound: dispatch and combine need none. */
static void test_pieces_protocol(void) {
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  for (int d = 0; d < 3; ++d) {
    for (int v = 0; v < 2; ++v) {
      const int E = v == 0 ? 24 : 8;
      if (E % nranks != 0) continue;
      moelink_moe_config_t c = base_config(NULL, dts[d], E, v == 0 ? 5 : 4, 0);
      c.hidden = 13;
      c.max_tokens = 9;
      moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
      ecfg.moe = c;
      ecfg.recv_capacity = nranks * c.max_tokens;
      moelink_ep_t ep = NULL;
      CHECK_OK(moelink_ep_create(comm, &ecfg, &ep), "ep_create (pieces)");
      if (!ep) continue;
      char name[64];
      snprintf(name, sizeof name, "pieces E=%d k=%d", E, c.top_k);
      const int last = nranks - 1, mid = nranks / 2;
      const pc_opts plan[] = {
          /* max_t empty own permute bad_rank bad_mode y_rank y_mode misuse quant qcall */
          {9, 0, 0, 0, -1, 0, -1, 0, 0, 0, 0},    {9, 30, 0, 1, -1, 0, -1, 0, 0, 0, 0},
          {9, 25, 0, 0, last, 0, -1, 0, 0, 0, 0}, {9, 0, 0, 1, last, 1, -1, 0, 0, 0, 0},
          {9, 25, 0, 0, -1, 0, mid, 0, 0, 0, 0},  {7, 20, 0, 1, 0, 2, -1, 0, 1, 0, 0},
          {9, 0, 0, 0, last, 3, 0, 1, 0, 0, 0},   {9, 20, 0, 1, -1, 0, mid, 2, 0, 0, 0},
          {9, 100, 0, 0, -1, 0, -1, 0, 0, 0, 0},  {9, 40, 0, 1, -1, 0, -1, 0, 0, 0, 0},
          {9, 0, 1, 0, -1, 0, -1, 0, 0, 0, 0},    {9, 10, 0, 0, -1, 0, -1, 0, 0, 0, 0},
          {9, 20, 0, 1, last, 4, -1, 0, 0, 0, 0},
      };
      const int n_plan = (int)(sizeof plan / sizeof plan[0]);
      int failures = 0;
      for (int it = 0; it < n_plan; ++it)
        failures += pieces_round(ep, &c, ecfg.recv_capacity, 500 + (uint64_t)(d * 2 + v), it,
                                 &plan[it], name, NULL);
      CHECK(failures == 0, "%s (%s): %d dispatch/combine calls with synthetic experts right",
            name, moelink_dtype_name(dts[d]), n_plan - failures);
      const int El = E / nranks;
      if (El < c.top_k) {
        /* More slots on rank 0 than a received row has (repeated ids): every
         * rank refuses, and the layer still works. */
        int32_t ids[8];
        float wts[8];
        for (int j = 0; j < c.top_k; ++j) {
          ids[j] = j % El;
          wts[j] = 0.125f;
        }
        float x[13] = {0};
        const int T = rank == last ? 1 : 0;
        moelink_ep_recv_t recv = MOELINK_EP_RECV_INIT;
        const moelink_status_t s = moelink_ep_dispatch(ep, T ? x : NULL, T ? ids : NULL,
                                                       T ? wts : NULL, T, &recv, NULL);
        char who[64];
        snprintf(who, sizeof who, "rank %d's token 0", last);
        CHECK(s == MOELINK_ERR_UNSUPPORTED && strstr(moelink_last_error(), who),
              "%s: a token with %d slots on rank 0 (%d per row) -> %s on every rank (%s)", name,
              c.top_k, El, moelink_status_string(s), moelink_last_error());
        CHECK_STATUS(moelink_ep_combine(ep, NULL, NULL, NULL, NULL), MOELINK_ERR_INVALID_STATE,
                     "combine after the refused dispatch");
        CHECK(pieces_round(ep, &c, ecfg.recv_capacity, 599, 0, &plan[1], name, NULL) == 0,
              "%s: dispatch/combine after the refused dispatch", name);
      }
      CHECK_OK(moelink_ep_destroy(ep), "ep_destroy (pieces)");
    }
  }
}

/* The local layer an engine would run on what arrived: this rank's E / n
 * experts, top_k min(k, E / n), max_tokens = the receive capacity. */
static moelink_moe_t local_layer(const ref_layer *L, int first, int El, int cap) {
  const moelink_moe_config_t *c = &L->cfg;
  moelink_moe_config_t lc = MOELINK_MOE_CONFIG_INIT;
  lc.hidden = c->hidden;
  lc.inter = c->inter;
  lc.num_experts = El;
  lc.top_k = c->top_k < El ? c->top_k : El;
  lc.dtype = c->dtype;
  lc.max_tokens = cap;
  moelink_moe_t m = NULL;
  CHECK_OK(moelink_moe_create(ctx, &lc, &m), "local layer");
  if (!m) return NULL;
  moelink_moe_weights_t w = local_weights(L, first);
  w.correction_bias = NULL;
  w.router = L->router; /* never used: rows arrive routed */
  CHECK_OK(moelink_moe_set_weights(m, &w), "local layer weights");
  return m;
}

/* out[T, H] = the sum over the valid slots j of y[pair_rows[t*k + j]] in
 * slot order, fp32, one rounding: the combine done here from the single
 * layer's per-(token, slot) expert outputs, skipping the masked slots. */
static void host_combine(moelink_dtype_t dt, const void *y, const int32_t *pair_rows,
                         const int32_t *ids, int E, int T, int k, int H, void *out) {
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < H; ++i) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) {
        if (!valid_id(ids[(size_t)t * k + j], E)) continue;
        acc += (float)ref_load(dt, y, (size_t)pair_rows[(size_t)t * k + j] * H + i);
      }
      ref_store(dt, out, (size_t)t * H + i, acc);
    }
}

/* What one dispatch received (cap rows, kl local slots), kept to compare a
 * second dispatch with it. */
typedef struct recv_copy {
  unsigned char *rows;
  int32_t *ids;
  float *w;
  int cap, kl;
  size_t row;
} recv_copy;

static void recv_copy_init(recv_copy *c, int cap, int kl, size_t row) {
  c->cap = cap;
  c->kl = kl;
  c->row = row;
  c->rows = (unsigned char *)ct_alloc((size_t)cap * row);
  c->ids = (int32_t *)ct_alloc((size_t)cap * kl * 4);
  c->w = (float *)ct_alloc((size_t)cap * kl * 4);
}

static void recv_copy_free(recv_copy *c) {
  free(c->rows);
  free(c->ids);
  free(c->w);
}

static void recv_copy_save(recv_copy *c, const moelink_ep_recv_t *r) {
  memcpy(c->rows, r->rows, (size_t)c->cap * c->row);
  memcpy(c->ids, r->expert_ids, (size_t)c->cap * c->kl * 4);
  memcpy(c->w, r->weights, (size_t)c->cap * c->kl * 4);
}

/* Whether r holds bitwise the saved ids, weights and token rows (rows that
 * hold no token may differ); *held: the rows that hold a token. */
static int recv_copy_same(const recv_copy *c, const moelink_ep_recv_t *r, int *held) {
  int same = memcmp(c->ids, r->expert_ids, (size_t)c->cap * c->kl * 4) == 0 &&
             memcmp(c->w, r->weights, (size_t)c->cap * c->kl * 4) == 0;
  *held = 0;
  for (int q = 0; same && q < c->cap; ++q)
    if (c->ids[(size_t)q * c->kl] >= 0) {
      ++*held;
      same = memcmp(c->rows + (size_t)q * c->row, (const char *)r->rows + (size_t)q * c->row,
                    c->row) == 0;
    }
  return same;
}

/* dispatch, the engine's own plan and experts on a local layer, combine:
 * against the single-rank layer's pieces (its experts' outputs, combined on
 * the host, empty slots skipped) and, without empty slots, its forward (no
 * shared expert in these configs); interleaved with moelink_ep_forward on
 * the same ep. Exact cases bitwise; random cases within compare()'s bounds.
 * Also: pair_rows NULL (y by pair) is bitwise the path through the plan. */
static void run_pieces_layer(const ep_case *ec) {
  const moelink_moe_config_t *c = &ec->cfg;
  const moelink_dtype_t dt = c->dtype;
  const int E = c->num_experts, k = c->top_k, H = c->hidden, El = E / nranks;
  const int kl = k < El ? k : El;
  const size_t es = moelink_dtype_size(dt), row = (size_t)H * es;
  ref_layer L;
  moelink_moe_t single;
  moelink_ep_t ep;
  if (!case_layers(ec, 0, MOELINK_QUANT_NONE, &L, &single, &ep)) return;
  const int first = rank * El, cap = ec->recv_capacity;
  moelink_moe_t local = ep ? local_layer(&L, first, El, cap) : NULL;
  if (!ep || !single || !local) {
    moelink_ep_destroy(ep);
    moelink_moe_destroy(single);
    moelink_moe_destroy(local);
    ref_layer_free(&L);
    return;
  }
  moelink_moe_weights_t w = local_weights(&L, first);
  CHECK_OK(moelink_ep_set_weights(ep, &w), "ep_set_weights");

  const size_t all = (size_t)nranks * ec->max_t + 1;
  unsigned char *x_all = (unsigned char *)ct_alloc(all * row);
  int32_t *ids = (int32_t *)ct_alloc(all * k * 4), *masked = (int32_t *)ct_alloc(all * k * 4);
  float *wts = (float *)ct_alloc(all * k * 4);
  unsigned char *y_single = (unsigned char *)ct_alloc(all * k * row);
  const int tile = moelink_moe_tile_rows(single), ltile = moelink_moe_tile_rows(local);
  void *plan_single = ct_alloc(moelink_plan_bytes((int)all, k, E, tile));
  void *plan_local = ct_alloc(moelink_plan_bytes(cap, kl, El, ltile));
  unsigned char *ref_pieces = (unsigned char *)ct_alloc(all * row);
  unsigned char *ref_fwd = (unsigned char *)ct_alloc(all * row);
  unsigned char *y = (unsigned char *)ct_alloc((size_t)cap * kl * row);
  unsigned char *y_pair = (unsigned char *)ct_alloc((size_t)cap * kl * row);
  unsigned char *out = (unsigned char *)ct_alloc(all * row);
  unsigned char *out2 = (unsigned char *)ct_alloc(all * row);
  recv_copy saved;
  recv_copy_init(&saved, cap, kl, row);
  int failures = 0;
  for (int it = 0; it < ec->iters; ++it) {
    int total = 0, off = 0, T = 0;
    for (int r = 0; r < nranks; ++r) {
      const int t = pc_tokens(ec->seed, it, r, ec->max_t);
      if (r == rank) {
        off = total;
        T = t;
      }
      total += t;
    }
    const int mask = it % 2 == 1; /* odd calls: some slots empty */
    fill_x(&L, x_all, total, ec->seed * 7919 + (uint64_t)it);
    if (ec->exact) exact_values(dt, x_all, (size_t)total * H, ec->seed * 7919 + it, 2, 1.0);
    moelink_plan_t ps;
    moelink_plan_view(plan_single, total, k, E, tile, &ps);
    if (total > 0) {
      CHECK_OK(moelink_moe_route(single, x_all, total, ids, wts, NULL), "single route");
      CHECK_OK(moelink_moe_plan(single, ids, total, plan_single, NULL), "single plan");
      CHECK_OK(moelink_moe_experts(single, x_all, total, plan_single, wts, y_single, NULL),
               "single experts");
      CHECK_OK(moelink_moe_forward(single, x_all, total, ref_fwd, NULL), "single forward");
    }
    memcpy(masked, ids, (size_t)total * k * 4);
    for (size_t p = 0; mask && p < (size_t)total * k; ++p)
      if (ct_mix(ec->seed + (uint64_t)it, p) % 3 == 0) masked[p] = empty_id(E, ct_mix(it, p));
    host_combine(dt, y_single, ps.pair_rows, masked, E, total, k, H, ref_pieces);

    /* Twice the same dispatch when checking the layouts: the second must
     * hand out the same rows. */
    const int passes = it == 0 || it == 1 ? 2 : 1;
    for (int pass = 0; pass < passes; ++pass) {
      moelink_ep_recv_t recv = MOELINK_EP_RECV_INIT;
      const moelink_status_t s =
          moelink_ep_dispatch(ep, T ? x_all + (size_t)off * row : NULL,
                              T ? masked + (size_t)off * k : NULL,
                              T ? wts + (size_t)off * k : NULL, T, &recv, NULL);
      if (s != MOELINK_SUCCESS) {
        CHECK(0, "%s call %d: dispatch: %s", ec->name, it, moelink_last_error());
        ++failures;
        break;
      }
      if (pass == 0) {
        recv_copy_save(&saved, &recv);
      } else {
        int held = 0;
        const int same = recv_copy_same(&saved, &recv, &held);
        CHECK(same, "%s call %d: the same dispatch again hands out the same rows (%d hold a "
              "token)", ec->name, it, held);
      }
      CHECK_OK(moelink_moe_plan(local, recv.expert_ids, cap, plan_local, NULL), "local plan");
      CHECK_OK(moelink_moe_experts(local, recv.rows, cap, plan_local, recv.weights, y, NULL),
               "local experts");
      moelink_plan_t pl;
      moelink_plan_view(plan_local, cap, kl, El, ltile, &pl);
      unsigned char *o = pass == 0 ? out : out2;
      for (size_t i = 0; i < (size_t)T * H; ++i) ref_store(dt, o, i, NAN);
      if (pass == 0) {
        CHECK_OK(moelink_ep_combine(ep, y, pl.pair_rows, o, NULL), "combine (plan's pair_rows)");
      } else {
        /* y by pair; rows of empty pairs poisoned: they must never be read. */
        for (size_t p = 0; p < (size_t)cap * kl; ++p) {
          if (pl.pair_rows[p] >= 0)
            memcpy(y_pair + p * row, y + (size_t)pl.pair_rows[p] * row, row);
          else
            for (int i = 0; i < H; ++i) ref_store(dt, y_pair, p * H + i, NAN);
        }
        CHECK_OK(moelink_ep_combine(ep, y_pair, NULL, o, NULL), "combine (pair_rows NULL)");
        CHECK(ct_first_diff(out, out2, (size_t)T * H, es) < 0,
              "%s call %d: combine by pair and through pair_rows are bitwise equal", ec->name, it);
      }
    }
    char what[200];
    snprintf(what, sizeof what, "%s call %d pieces%s (%d of %d tokens)", ec->name, it,
             mask ? ", empty slots" : "", T, total);
    const unsigned char *rp = ref_pieces + (size_t)off * row, *rf = ref_fwd + (size_t)off * row;
    if (ec->exact) {
      const long at = ct_first_diff(out, rp, (size_t)T * H, es);
      CHECK(at < 0, "%s: bitwise the single layer's pieces (first difference at %ld)", what, at);
      failures += at >= 0;
    } else if (!compare(dt, out, rp, (size_t)T * H, what)) {
      ++failures;
    }
    if (!mask && ec->exact && dt == MOELINK_DTYPE_F32) {
      const long at = ct_first_diff(out, rf, (size_t)T * H, es);
      CHECK(at < 0, "%s: bitwise the single layer's forward (first difference at %ld)", what, at);
      failures += at >= 0;
    } else if (!mask && !compare(dt, out, rf, (size_t)T * H, what)) {
      ++failures;
    }
    /* The fused forward on the same ep, same tokens. */
    for (size_t i = 0; i < (size_t)T * H; ++i) ref_store(dt, out2, i, NAN);
    const moelink_status_t s =
        moelink_ep_forward(ep, T ? x_all + (size_t)off * row : NULL, T, out2, NULL);
    CHECK(s == MOELINK_SUCCESS, "%s call %d: forward after the pieces: %s", ec->name, it,
          s ? moelink_last_error() : "ok");
    snprintf(what, sizeof what, "%s call %d forward (%d of %d tokens)", ec->name, it, T, total);
    if (ec->exact) {
      const long at = ct_first_diff(out2, rf, (size_t)T * H, es);
      CHECK(at < 0, "%s: bitwise the single layer (first difference at %ld)", what, at);
      failures += at >= 0;
      if (!mask && dt == MOELINK_DTYPE_F32)
        CHECK(ct_first_diff(out, out2, (size_t)T * H, es) < 0,
              "%s: pieces and forward bitwise equal", what);
    } else if (!compare(dt, out2, rf, (size_t)T * H, what)) {
      ++failures;
    }
  }
  CHECK(failures == 0, "%s: %d calls of dispatch + experts + combine right (%s, recv_capacity %d)",
        ec->name, ec->iters, moelink_dtype_name(dt), cap);
  free(x_all);
  free(ids);
  free(masked);
  free(wts);
  free(y_single);
  free(plan_single);
  free(plan_local);
  free(ref_pieces);
  free(ref_fwd);
  free(y);
  free(y_pair);
  free(out);
  free(out2);
  recv_copy_free(&saved);
  CHECK_OK(moelink_ep_destroy(ep), "ep_destroy");
  moelink_moe_destroy(local);
  moelink_moe_destroy(single);
  ref_layer_free(&L);
}

static void test_pieces_layers(void) {
  /* recv_capacity: every rank's max_tokens, so no routing overflows it. */
  moelink_moe_config_t m = base_config("mixtral-8x7b", MOELINK_DTYPE_F32, 24, 2, 0);
  m.max_tokens = 11;
  ep_case a = {"pieces mixtral", m, nranks * 11, 0, 11, 4, 301, 0};
  run_pieces_layer(&a);
  moelink_moe_config_t d = base_config("deepseek-v3", MOELINK_DTYPE_F32, 24, 6, 0);
  d.inter = 1;
  d.max_tokens = 9;
  ep_case b = {"pieces exact deepseek", d, nranks * 9, 0, 9, 4, 303, 1};
  run_pieces_layer(&b);
  moelink_moe_config_t q = base_config("qwen3-30b-a3b", MOELINK_DTYPE_BF16, 24, 8, 0);
  q.inter = 1;
  q.max_tokens = 8;
  ep_case e = {"pieces exact qwen3", q, nranks * 8, 0, 8, 4, 305, 1};
  run_pieces_layer(&e);
  if (8 % nranks == 0) {
    moelink_moe_config_t g = base_config(NULL, MOELINK_DTYPE_F16, 8, 3, 0);
    g.router = MOELINK_ROUTER_TOPK_SOFTMAX;
    g.max_tokens = 10;
    ep_case f = {"pieces topk-softmax E=8", g, nranks * 10, 0, 10, 4, 307, 0};
    run_pieces_layer(&f);
  }
}

/* Errors of the pieces: combine without dispatch; a routing that overflows a
 * rank's receive buffer is refused on every rank, and afterwards forward and
 * dispatch/combine still work. */
static void test_pieces_errors(void) {
  CHECK_STATUS(moelink_ep_dispatch(NULL, NULL, NULL, NULL, 0, NULL, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "dispatch on NULL");
  CHECK_STATUS(moelink_ep_combine(NULL, NULL, NULL, NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT,
               "combine on NULL");
  moelink_moe_config_t c = base_config("mixtral-8x7b", MOELINK_DTYPE_F32, 24, 2, 0);
  c.max_tokens = 6;
  ref_layer L;
  if (ref_layer_make(&L, &c, 401, 0) != 0) {
    CHECK(0, "ref_layer_make");
    return;
  }
  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = c;
  ecfg.recv_capacity = 3;
  moelink_ep_t ep = NULL;
  CHECK_OK(moelink_ep_create(comm, &ecfg, &ep), "ep_create (capacity 3)");
  if (!ep) {
    ref_layer_free(&L);
    return;
  }
  CHECK_STATUS(moelink_ep_combine(ep, NULL, NULL, NULL, NULL), MOELINK_ERR_INVALID_STATE,
               "combine without a dispatch");
  const int El = c.num_experts / nranks;
  moelink_moe_weights_t w = local_weights(&L, rank * El);
  CHECK_OK(moelink_ep_set_weights(ep, &w), "ep_set_weights");
  const int H = c.hidden, T = 4, F = 6;
  const size_t row = (size_t)H * 4;
  float *x_all = (float *)ct_alloc((size_t)nranks * F * row);
  float *ref_out = (float *)ct_alloc((size_t)nranks * F * row);
  float *out = (float *)ct_alloc((size_t)F * row);
  int32_t ids[2 * 6];
  float wts[2 * 6];
  for (int t = 0; t < T; ++t) {
    ids[2 * t] = 0; /* every token of every rank to rank 0's first expert */
    ids[2 * t + 1] = -1;
    wts[2 * t] = 0.5f;
    wts[2 * t + 1] = 0.25f;
  }
  fill_x(&L, x_all, nranks * F, 402);
  moelink_moe_config_t rc = c;
  rc.max_tokens = nranks * F;
  moelink_moe_t single = NULL;
  CHECK_OK(moelink_moe_create(ctx, &rc, &single), "single-rank layer");
  CHECK_OK(moelink_moe_set_weights(single, &L.w), "single-rank weights");
  CHECK_OK(moelink_moe_forward(single, x_all, nranks * F, ref_out, NULL), "reference");
  for (int round = 0; round < 2; ++round) {
    moelink_ep_recv_t recv = MOELINK_EP_RECV_INIT;
    moelink_status_t s =
        moelink_ep_dispatch(ep, x_all + (size_t)rank * F * H, ids, wts, T, &recv, NULL);
    char rows[48];
    snprintf(rows, sizeof rows, "%d token rows", T * nranks);
    CHECK(s == MOELINK_ERR_UNSUPPORTED && strstr(moelink_last_error(), "rank 0") &&
              strstr(moelink_last_error(), rows) &&
              strstr(moelink_last_error(), "recv_capacity 3"),
          "dispatch of %d rows to rank 0 with recv_capacity 3 -> %s on every rank (%s)",
          T * nranks, moelink_status_string(s), moelink_last_error());
    CHECK_STATUS(moelink_ep_combine(ep, NULL, NULL, NULL, NULL), MOELINK_ERR_INVALID_STATE,
                 "combine after a refused dispatch");
    /* Forward takes any count in rounds; the layer still works. */
    for (size_t i = 0; i < (size_t)F * H; ++i) out[i] = NAN;
    CHECK_OK(moelink_ep_forward(ep, x_all + (size_t)rank * F * H, F, out, NULL),
             "forward after a refused dispatch");
    char what[80];
    snprintf(what, sizeof what, "forward after a refused dispatch (%d)", round);
    compare(MOELINK_DTYPE_F32, out, ref_out + (size_t)rank * F * H, (size_t)F * H, what);
    /* And dispatch/combine of a routing that fits. */
    const pc_opts fits = {3, 20, 1, round, -1, 0, -1, 0, 0, 0, 0};
    CHECK(pieces_round(ep, &c, 3, 403, round, &fits, "fitting pieces after a refused dispatch",
                       NULL) == 0,
          "dispatch/combine after a refused dispatch (%d)", round);
  }
  free(x_all);
  free(ref_out);
  free(out);
  moelink_moe_destroy(single);
  CHECK_OK(moelink_ep_destroy(ep), "ep_destroy");
  ref_layer_free(&L);
}

/* ---- 8-bit dispatch (dispatch_quant) ------------------------------------ */

/* The pieces on FP8 and MXFP8 layers, with synthetic experts: every rank
 * receives moelink_dequantize(moelink_quantize(x)) of each source's token
 * rows (bytes, ids, weights and the combined sums checked as in
 * pieces_round), and the same calls made with moelink_ep_dispatch, with
 * moelink_ep_dispatch_quantized, and with the two mixed (rank 0 one, the
 * others the other) hand out bitwise the same rows and combine to bitwise
 * the same outputs. Bad quantized arguments on one rank: that rank fails,
 * its peers finish. */
static void test_pieces_quant(void) {
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  const moelink_quant_t fmts[] = {MOELINK_QUANT_FP8, MOELINK_QUANT_MXFP8};
  for (int d = 0; d < 3; ++d)
    for (int f = 0; f < 2; ++f) {
      const moelink_quant_t qf = fmts[f];
      const int E = f == 0 ? 24 : 8;
      if (E % nranks != 0) continue;
      moelink_moe_config_t c = base_config(NULL, dts[d], E, f == 0 ? 5 : 3, 0);
      c.hidden = qf == MOELINK_QUANT_FP8 ? 256 : 96;
      c.max_tokens = 9;
      moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
      ecfg.moe = c;
      ecfg.recv_capacity = nranks * c.max_tokens;
      ecfg.dispatch_quant = qf;
      moelink_ep_t ep = NULL;
      CHECK_OK(moelink_ep_create(comm, &ecfg, &ep), "ep_create (pieces, dispatch_quant)");
      if (!ep) continue;
      char name[96];
      snprintf(name, sizeof name, "pieces %s E=%d k=%d H=%d",
               qf == MOELINK_QUANT_FP8 ? "FP8" : "MXFP8", E, c.top_k, c.hidden);
      const int q = (int)qf, last = nranks - 1;
      int failures = 0, calls = 0;
      for (int it = 0; it < 4; ++it) {
        /* The same inputs (seed, it) through every combination of calls. */
        uint64_t dg[4] = {0, 0, 0, 0};
        for (int qc = 0; qc < 4; ++qc) {
          const pc_opts o = {9, it * 15, 0, it & 1, -1, 0, -1, 0, 0, q, qc};
          failures += pieces_round(ep, &c, ecfg.recv_capacity, 700 + (uint64_t)(d * 2 + f), it,
                                   &o, name, &dg[qc]);
          ++calls;
        }
        CHECK(dg[0] == dg[1] && dg[0] == dg[2] && dg[0] == dg[3],
              "%s (%s) call %d: dispatch, dispatch_quantized, and the two mixed give bitwise "
              "the same received rows, ids, weights and combined output",
              name, moelink_dtype_name(dts[d]), it);
      }
      const pc_opts bad[] = {{9, 10, 0, 0, last, 5, -1, 0, 0, q, 1},
                             {9, 10, 0, 1, last, 6, -1, 0, 0, q, 3},
                             {9, 10, 0, 0, 0, 0, -1, 0, 0, q, 1},
                             {9, 10, 0, 0, -1, 0, last, 0, 0, q, 2}};
      for (int b = 0; b < 4; ++b, ++calls)
        failures += pieces_round(ep, &c, ecfg.recv_capacity, 790, b, &bad[b], name, NULL);
      CHECK(failures == 0, "%s (%s): %d dispatch/combine calls right", name,
            moelink_dtype_name(dts[d]), calls);
      CHECK_OK(moelink_ep_destroy(ep), "ep_destroy (pieces, dispatch_quant)");
    }
}

/* L's weights in fp32 (exact copies) in w32, the buffers in bufs[6]: a
 * single-rank f32 layer on them computes what a layer of L's dtype does
 * inside (fp32 products and sums of the same values) but hands out its
 * expert outputs unrounded, as the EP ranks send them back. */
static void widen_weights(const ref_layer *L, moelink_moe_weights_t *w32, float **bufs) {
  const moelink_moe_config_t *c = &L->cfg;
  const size_t H = (size_t)c->hidden, I = (size_t)c->inter, E = (size_t)c->num_experts;
  const size_t Is = (size_t)c->shared_inter;
  const void *src[6] = {L->router, L->gate_up, L->down, L->shared_gate_up, L->shared_down,
                        L->shared_gate};
  const size_t n[6] = {E * H, E * 2 * I * H, E * H * I, 2 * Is * H, H * Is, H};
  for (int b = 0; b < 6; ++b) {
    bufs[b] = NULL;
    if (!src[b]) continue;
    bufs[b] = (float *)ct_alloc(n[b] * sizeof(float));
    for (size_t i = 0; i < n[b]; ++i) bufs[b][i] = (float)ref_load(c->dtype, src[b], i);
  }
  *w32 = L->w;
  w32->dtype = MOELINK_DTYPE_F32;
  w32->router = bufs[0];
  w32->gate_up = bufs[1];
  w32->down = bufs[2];
  w32->shared_gate_up = bufs[3];
  w32->shared_down = bufs[4];
  w32->shared_gate = bufs[5];
}

/* out [T, H] = sum_j y[pair_rows[t*k + j]] in slot order in fp32, plus (with
 * a shared expert) the reference's shared expert of x in double rounded to
 * fp32, one rounding to L's dtype: the EP combine's order, with the routed
 * experts' outputs y (of y_dt) from a single-rank layer. */
static void quant_combine(const ref_layer *L, const void *x, moelink_dtype_t y_dt, const void *y,
                          const int32_t *pair_rows, int T, void *out) {
  const moelink_moe_config_t *c = &L->cfg;
  const moelink_dtype_t dt = c->dtype;
  const int H = c->hidden, k = c->top_k;
  const size_t row = (size_t)H * moelink_dtype_size(dt);
  double *sh = (double *)ct_alloc(sizeof(double) * (size_t)H);
  for (int t = 0; t < T; ++t) {
    if (c->shared_inter > 0) ref_shared_token(c, &L->w, (const char *)x + (size_t)t * row, sh);
    for (int i = 0; i < H; ++i) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j)
        acc += (float)ref_load(y_dt, y, (size_t)pair_rows[(size_t)t * k + j] * H + i);
      if (c->shared_inter > 0) acc += (float)sh[i];
      ref_store(dt, out, (size_t)t * H + i, acc);
    }
  }
  free(sh);
}

/* A forward on a dispatch_quant layer against the single-rank layer run as
 * route(x) -> plan -> experts on dequantize(quantize(x)) -> combine (+ the
 * shared expert of x), within compare()'s bounds; bitwise the same twice;
 * measurably not the unquantized layer (f32). The experts of the reference
 * run on an f32 copy of the layer (exact), so their outputs reach the
 * combine unrounded, as on the EP ranks. Without a shared expert and when
 * every rank's step fits recv_capacity, also the pieces: dispatch of x and
 * dispatch_quantized of its q + scales (each call alternately by rank 0 or
 * by the others) hand out bitwise the same rows, which the engine's own
 * local layer turns into outputs that combine within compare()'s bounds of
 * the single-rank layer's pieces (its dtype's expert outputs, as in
 * run_pieces_layer), and to bitwise the same out for both calls. */
static void run_quant_case(const ep_case *ec, moelink_quant_t qf) {
  const moelink_moe_config_t *c = &ec->cfg;
  const moelink_dtype_t dt = c->dtype;
  const int E = c->num_experts, k = c->top_k, H = c->hidden, El = E / nranks;
  const int kl = k < El ? k : El;
  const size_t es = moelink_dtype_size(dt), row = (size_t)H * es;
  const size_t sbytes = moelink_quant_scale_bytes(qf, H);
  const char *qn = qf == MOELINK_QUANT_FP8 ? "FP8" : "MXFP8";
  ref_layer L;
  moelink_moe_t single, single32 = NULL;
  moelink_ep_t ep;
  if (!case_layers(ec, 1, qf, &L, &single, &ep)) return;
  float *wide[6];
  moelink_moe_weights_t w32;
  widen_weights(&L, &w32, wide);
  moelink_moe_config_t rc = *c;
  rc.max_tokens = nranks * ec->max_t + 1;
  rc.dtype = MOELINK_DTYPE_F32;
  CHECK_OK(moelink_moe_create(ctx, &rc, &single32), "single-rank layer (f32 copy)");
  if (single32) CHECK_OK(moelink_moe_set_weights(single32, &w32), "single-rank weights (f32)");
  moelink_ep_config_t got = MOELINK_EP_CONFIG_INIT;
  if (ep) CHECK_OK(moelink_ep_get_config(ep, &got, NULL, NULL), "ep_get_config");
  CHECK(!ep || got.dispatch_quant == qf, "%s: get_config reports dispatch_quant %d",
        ec->name, (int)got.dispatch_quant);
  const int cap = got.recv_capacity, first = rank * El;
  const int pieces = c->shared_inter == 0 && ec->max_t <= c->max_tokens &&
                     cap >= nranks * ec->max_t;
  moelink_moe_t local = ep && pieces ? local_layer(&L, first, El, cap) : NULL;
  if (!ep || !single || !single32 || (pieces && !local)) {
    moelink_ep_destroy(ep);
    moelink_moe_destroy(single);
    moelink_moe_destroy(single32);
    moelink_moe_destroy(local);
    for (int b = 0; b < 6; ++b) free(wide[b]);
    ref_layer_free(&L);
    return;
  }
  moelink_moe_weights_t w = local_weights(&L, first);
  CHECK_OK(moelink_ep_set_weights(ep, &w), "ep_set_weights");

  const size_t all = (size_t)nranks * ec->max_t + 1;
  unsigned char *x_all = (unsigned char *)ct_alloc(all * row);
  unsigned char *xdq = (unsigned char *)ct_alloc(all * row);
  uint8_t *xq = (uint8_t *)ct_alloc(all * H), *xsc = (uint8_t *)ct_alloc(all * sbytes);
  int32_t *ids = (int32_t *)ct_alloc(all * k * 4);
  float *wts = (float *)ct_alloc(all * k * 4);
  unsigned char *y_single = (unsigned char *)ct_alloc(all * k * row);
  float *xdq32 = (float *)ct_alloc(all * H * 4), *y32 = (float *)ct_alloc(all * k * H * 4);
  const int tile = moelink_moe_tile_rows(single), tile32 = moelink_moe_tile_rows(single32);
  void *plan_single = ct_alloc(moelink_plan_bytes((int)all, k, E, tile));
  void *plan32 = ct_alloc(moelink_plan_bytes((int)all, k, E, tile32));
  unsigned char *ref_out = (unsigned char *)ct_alloc(all * row);
  unsigned char *ref_pc = (unsigned char *)ct_alloc(all * row);
  unsigned char *plain = (unsigned char *)ct_alloc(all * row);
  unsigned char *out = (unsigned char *)ct_alloc(all * row);
  unsigned char *out2 = (unsigned char *)ct_alloc(all * row);
  const int ltile = local ? moelink_moe_tile_rows(local) : 1;
  void *plan_local = pieces ? ct_alloc(moelink_plan_bytes(cap, kl, El, ltile)) : NULL;
  unsigned char *y = pieces ? (unsigned char *)ct_alloc((size_t)cap * kl * row) : NULL;
  recv_copy saved;
  memset(&saved, 0, sizeof saved);
  if (pieces) recv_copy_init(&saved, cap, kl, row);
  int failures = 0;
  double off_plain = 0.0;
  int plain_rows = 0;
  for (int it = 0; it < ec->iters; ++it) {
    int off = 0, T = 0;
    const int total = iteration_rows(ec, it, &off, &T);
    fill_x(&L, x_all, total, ec->seed * 7919 + (uint64_t)it);
    if (total > 0) {
      CHECK_OK(moelink_quantize(ctx, qf, dt, x_all, total, H, xq, xsc, NULL), "quantize x");
      CHECK_OK(moelink_dequantize(ctx, qf, dt, xq, xsc, total, H, xdq, NULL), "dequantize x");
      for (size_t i = 0; i < (size_t)total * H; ++i) xdq32[i] = (float)ref_load(dt, xdq, i);
      CHECK_OK(moelink_moe_route(single, x_all, total, ids, wts, NULL), "single route (x)");
      CHECK_OK(moelink_moe_plan(single32, ids, total, plan32, NULL), "single plan (f32)");
      CHECK_OK(moelink_moe_experts(single32, xdq32, total, plan32, wts, y32, NULL),
               "single experts (f32, on dequantize(quantize(x)))");
      if (pieces) {
        CHECK_OK(moelink_moe_plan(single, ids, total, plan_single, NULL), "single plan");
        CHECK_OK(moelink_moe_experts(single, xdq, total, plan_single, wts, y_single, NULL),
                 "single experts (on dequantize(quantize(x)))");
      }
      CHECK_OK(moelink_moe_forward(single, x_all, total, plain, NULL), "single forward (x)");
    }
    moelink_plan_t p32, ps;
    moelink_plan_view(plan32, total, k, E, tile32, &p32);
    moelink_plan_view(plan_single, total, k, E, tile, &ps);
    quant_combine(&L, x_all + (size_t)off * row, MOELINK_DTYPE_F32, y32,
                  p32.pair_rows + (size_t)off * k, T, ref_out);
    if (pieces)
      quant_combine(&L, x_all + (size_t)off * row, dt, y_single, ps.pair_rows + (size_t)off * k,
                    T, ref_pc);

    char what[200];
    snprintf(what, sizeof what, "%s %s iteration %d (%d of %d tokens)", ec->name, qn, it, T,
             total);
    const void *xm = T ? x_all + (size_t)off * row : NULL;
    for (size_t i = 0; i < (size_t)T * H; ++i) ref_store(dt, out, i, NAN);
    moelink_status_t s = moelink_ep_forward(ep, xm, T, out, NULL);
    if (s != MOELINK_SUCCESS) {
      CHECK(0, "%s: ep_forward: %s", what, moelink_last_error());
      ++failures;
      break;
    }
    if (!compare(dt, out, ref_out, (size_t)T * H, what)) ++failures;
    if (dt == MOELINK_DTYPE_F32 && T > 0) {
      double sd = 0.0, ss = 0.0;
      for (size_t i = 0; i < (size_t)T * H; ++i) {
        const double a = ref_load(dt, out, i), b = ref_load(dt, plain + (size_t)off * row, i);
        sd += (a - b) * (a - b);
        ss += b * b;
      }
      if (ss > 0 && sqrt(sd / ss) > off_plain) off_plain = sqrt(sd / ss);
      plain_rows += T;
    }
    if (it == 0) {
      for (size_t i = 0; i < (size_t)T * H; ++i) ref_store(dt, out2, i, NAN);
      CHECK_OK(moelink_ep_forward(ep, xm, T, out2, NULL), "ep_forward again");
      CHECK(ct_first_diff(out, out2, (size_t)T * H, es) < 0, "%s: two runs bitwise equal", what);
    }
    if (!pieces) continue;

    /* The pieces: dispatch (x) then dispatch_quantized (q + scales), and the
     * reverse on odd iterations, rank 0 making the other call than its
     * peers in the second one; the engine's local experts in between. */
    for (int pass = 0; pass < 2; ++pass) {
      const int quantized = (it & 1) ^ pass ^ (pass == 1 && rank == 0);
      moelink_ep_recv_t recv = MOELINK_EP_RECV_INIT;
      s = quantized ? moelink_ep_dispatch_quantized(ep, T ? xq + (size_t)off * H : NULL,
                                                    T ? xsc + (size_t)off * sbytes : NULL,
                                                    T ? ids + (size_t)off * k : NULL,
                                                    T ? wts + (size_t)off * k : NULL, T, &recv,
                                                    NULL)
                    : moelink_ep_dispatch(ep, xm, T ? ids + (size_t)off * k : NULL,
                                          T ? wts + (size_t)off * k : NULL, T, &recv, NULL);
      if (s != MOELINK_SUCCESS) {
        CHECK(0, "%s pass %d: %s: %s", what, pass, quantized ? "dispatch_quantized" : "dispatch",
              moelink_last_error());
        ++failures;
        break;
      }
      if (pass == 0) {
        recv_copy_save(&saved, &recv);
      } else {
        int held = 0;
        const int same = recv_copy_same(&saved, &recv, &held);
        CHECK(same, "%s: rank %d's %d received rows, ids and weights bitwise the same from "
              "dispatch and dispatch_quantized (rank 0 %s, the others %s)",
              what, rank, held, (it & 1) ? "dispatch_quantized" : "dispatch",
              (it & 1) ? "dispatch" : "dispatch_quantized");
        failures += !same;
      }
      CHECK_OK(moelink_moe_plan(local, recv.expert_ids, cap, plan_local, NULL), "local plan");
      CHECK_OK(moelink_moe_experts(local, recv.rows, cap, plan_local, recv.weights, y, NULL),
               "local experts");
      moelink_plan_t pl;
      moelink_plan_view(plan_local, cap, kl, El, ltile, &pl);
      unsigned char *o = pass == 0 ? out : out2;
      for (size_t i = 0; i < (size_t)T * H; ++i) ref_store(dt, o, i, NAN);
      CHECK_OK(moelink_ep_combine(ep, y, pl.pair_rows, o, NULL), "combine");
    }
    char pw[220];
    snprintf(pw, sizeof pw, "%s pieces", what);
    if (!compare(dt, out, ref_pc, (size_t)T * H, pw)) ++failures;
    const long at = ct_first_diff(out, out2, (size_t)T * H, es);
    CHECK(at < 0, "%s: combined outputs of the two dispatch calls bitwise equal (first "
          "difference at %ld)", pw, at);
    failures += at >= 0;
  }
  CHECK(failures == 0,
        "%s %s: %d iterations match route(x) -> experts(dequantize(quantize(x))) -> combine%s "
        "(%s, recv_capacity %d%s)",
        ec->name, qn, ec->iters, c->shared_inter > 0 ? " + shared(x)" : "",
        moelink_dtype_name(dt), cap, pieces ? ", pieces too" : "");
  if (dt == MOELINK_DTYPE_F32 && plain_rows > 0)
    CHECK(off_plain > 1e-4, "%s %s: the experts did see quantized rows (relative L2 %.3g from "
          "the unquantized layer)", ec->name, qn, off_plain);
  free(x_all);
  free(xdq);
  free(xq);
  free(xsc);
  free(ids);
  free(wts);
  free(y_single);
  free(xdq32);
  free(y32);
  free(plan_single);
  free(plan32);
  free(ref_out);
  free(ref_pc);
  free(plain);
  free(out);
  free(out2);
  free(plan_local);
  free(y);
  recv_copy_free(&saved);
  CHECK_OK(moelink_ep_destroy(ep), "ep_destroy");
  moelink_moe_destroy(local);
  moelink_moe_destroy(single);
  moelink_moe_destroy(single32);
  for (int b = 0; b < 6; ++b) free(wide[b]);
  ref_layer_free(&L);
}

static void test_quant_layers(void) {
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  for (int d = 0; d < 3; ++d) {
    const moelink_dtype_t dt = dts[d];
    const uint64_t sd = (uint64_t)d;
    /* Mixtral-like, FP8 (H = 128, one block per row); pieces too. */
    moelink_moe_config_t m = base_config("mixtral-8x7b", dt, 24, 2, 0);
    m.hidden = 128;
    m.max_tokens = 13;
    ep_case a = {"quant mixtral", m, nranks * 13, 0, 13, 3, 811 + sd, 0};
    run_quant_case(&a, MOELINK_QUANT_FP8);
    /* Qwen3-like k = 8, MXFP8 (H = 96, three blocks); pieces too. */
    moelink_moe_config_t q = base_config("qwen3-30b-a3b", dt, 24, 8, 0);
    q.hidden = 96;
    q.max_tokens = 11;
    ep_case b = {"quant qwen3", q, nranks * 11, 0, 11, 3, 821 + sd, 0};
    run_quant_case(&b, MOELINK_QUANT_MXFP8);
    /* Steps and rounds (max_tokens 5, recv_capacity 4) through the buffer
     * of dequantized rows, both formats, H = 256. */
    moelink_moe_config_t r = base_config("qwen2-57b-a14b", dt, 24, 4, 0);
    r.hidden = 256;
    r.max_tokens = 5;
    ep_case e = {"quant qwen2 (steps, rounds)", r, 4, 0, 17, 2, 831 + sd, 0};
    run_quant_case(&e, MOELINK_QUANT_FP8);
    run_quant_case(&e, MOELINK_QUANT_MXFP8);
  }
  /* A shared expert (gated, ungated) takes x itself: f32, against the
   * reference's shared expert (double) added in the combine's order. */
  moelink_moe_config_t g = base_config("qwen2-57b-a14b", MOELINK_DTYPE_F32, 24, 4, 40);
  g.hidden = 128;
  g.max_tokens = 7;
  ep_case s1 = {"quant qwen2 + gated shared", g, 0, 0, 15, 2, 841, 0};
  run_quant_case(&s1, MOELINK_QUANT_MXFP8);
  moelink_moe_config_t ds = base_config("deepseek-v3", MOELINK_DTYPE_F32, 24, 6, 16);
  ds.hidden = 256;
  ep_case s2 = {"quant deepseek + shared", ds, 0, 0, 17, 2, 843, 0};
  run_quant_case(&s2, MOELINK_QUANT_FP8);
}

/* Config errors of dispatch_quant, and dispatch_quantized on a NONE layer. */
static void test_quant_errors(void) {
  moelink_moe_config_t c = base_config("mixtral-8x7b", MOELINK_DTYPE_BF16, 24, 2, 0);
  moelink_ep_config_t e = MOELINK_EP_CONFIG_INIT;
  CHECK(e.dispatch_quant == MOELINK_QUANT_NONE, "MOELINK_EP_CONFIG_INIT: dispatch_quant NONE");
  e.moe = c;
  moelink_ep_t ep = (moelink_ep_t)(uintptr_t)1;
  size_t bytes = 0;
  e.dispatch_quant = MOELINK_QUANT_FP8; /* hidden 40 */
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
               "FP8 with hidden 40");
  CHECK(ep == NULL && strstr(moelink_last_error(), "multiple") &&
            strstr(moelink_last_error(), "128"),
        "the message names the block: %s", moelink_last_error());
  CHECK_STATUS(moelink_ep_workspace_size(comm, &e, &bytes), MOELINK_ERR_INVALID_ARGUMENT,
               "workspace_size, FP8 with hidden 40");
  e.moe.hidden = 96;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
               "FP8 with hidden 96");
  e.dispatch_quant = MOELINK_QUANT_MXFP8;
  e.moe.hidden = 80;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
               "MXFP8 with hidden 80");
  CHECK(strstr(moelink_last_error(), "32") != NULL, "the message names the block: %s",
        moelink_last_error());
  e.moe.hidden = 128;
  e.dispatch_quant = (moelink_quant_t)5;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
               "dispatch_quant 5");
  CHECK(strstr(moelink_last_error(), "dispatch_quant") != NULL, "the message names the field: %s",
        moelink_last_error());
  e.dispatch_quant = (moelink_quant_t)-1;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
               "dispatch_quant -1");
  /* Memory stays the config's: the quantized layer adds one buffer of
   * max_tokens rows, whatever the calls. */
  size_t none_b = 0, fp8_b = 0, mx_b = 0;
  e.dispatch_quant = MOELINK_QUANT_NONE;
  CHECK_OK(moelink_ep_workspace_size(comm, &e, &none_b), "workspace_size NONE");
  e.dispatch_quant = MOELINK_QUANT_FP8;
  CHECK_OK(moelink_ep_workspace_size(comm, &e, &fp8_b), "workspace_size FP8");
  e.dispatch_quant = MOELINK_QUANT_MXFP8;
  CHECK_OK(moelink_ep_workspace_size(comm, &e, &mx_b), "workspace_size MXFP8");
  const size_t extra = (size_t)c.max_tokens * 128 * 2;
  CHECK(fp8_b == mx_b && fp8_b >= none_b && fp8_b <= none_b + extra + 64,
        "workspace: NONE %zu, FP8 %zu, MXFP8 %zu bytes (at most %zu more)", none_b, fp8_b, mx_b,
        extra + 64);
  if (nranks > 1) {
    /* dispatch_quant differs between ranks: every rank refuses. */
    e.dispatch_quant = rank == 0 ? MOELINK_QUANT_FP8 : MOELINK_QUANT_NONE;
    CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
                 "dispatch_quant differs between ranks");
    CHECK(ep == NULL, "no layer after a refused create");
    /* call_tokens differs between ranks: every rank refuses (on CUDA ranks
     * the steps of a call would differ). */
    e.dispatch_quant = MOELINK_QUANT_NONE;
    e.call_tokens = c.max_tokens * (1 + rank);
    CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT,
                 "call_tokens differs between ranks");
    CHECK(ep == NULL && strstr(moelink_last_error(), "differs"), "no layer, and the message: %s",
          moelink_last_error());
    e.call_tokens = 0;
  }
  CHECK_STATUS(moelink_ep_dispatch_quantized(NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "dispatch_quantized on NULL");
}

int main(void) {
  ct_start(&ctx, &comm);
  rank = moelink_comm_rank(comm);
  nranks = moelink_comm_size(comm);
  ml_t_diag("rank %d of %d", rank, nranks);
  const double t0 = ct_now_ms();
  test_errors();
  test_bad_rank();
  test_layers();
  test_skew();
  test_iterations();
  test_pieces_errors();
  test_pieces_protocol();
  test_pieces_layers();
  test_quant_errors();
  test_pieces_quant();
  test_quant_layers();
  ml_t_diag("%zu of %zu elements bitwise equal to the single-rank layer; largest |d| / allowed "
            "%.3g",
            bitwise_equal, compared, worst_ratio);
  ml_t_diag("took %.0f ms", ct_now_ms() - t0);
  CHECK_OK(moelink_comm_check(comm, NULL), "comm_check reports no failure");
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy");
  moelink_context_destroy(ctx);
  return ml_test_done();
}
