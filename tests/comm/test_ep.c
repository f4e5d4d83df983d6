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
 * poisoned with NaN, 100 iterations of one layer, and the error paths. */
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
  const size_t es = moelink_dtype_size(c->dtype), H = (size_t)c->hidden, I = (size_t)c->inter;
  moelink_moe_weights_t w = L->w;
  w.gate_up = (const char *)L->gate_up + (size_t)first * 2 * I * H * es;
  w.down = (const char *)L->down + (size_t)first * H * I * es;
  return w;
}

static void run_case(const ep_case *ec) {
  const moelink_moe_config_t *c = &ec->cfg;
  const moelink_dtype_t dt = c->dtype;
  const size_t es = moelink_dtype_size(dt), row = (size_t)c->hidden * es;
  ref_layer L;
  if (ref_layer_make(&L, c, ec->seed, ec->zipf) != 0) {
    CHECK(0, "%s: ref_layer_make", ec->name);
    return;
  }
  if (ec->exact) make_exact(&L);
  /* The single-rank layer, one call for all ranks' tokens. */
  moelink_moe_config_t rc = *c;
  rc.max_tokens = nranks * ec->max_t + 1;
  moelink_moe_t single = NULL;
  CHECK_OK(moelink_moe_create(ctx, &rc, &single), "single-rank layer");
  CHECK_OK(moelink_moe_set_weights(single, &L.w), "single-rank weights");

  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = *c;
  ecfg.recv_capacity = ec->recv_capacity;
  moelink_ep_t ep = NULL;
  CHECK_OK(moelink_ep_create(comm, &ecfg, &ep), ec->name);
  if (!ep || !single) {
    moelink_moe_destroy(single);
    ref_layer_free(&L);
    return;
  }
  int first = -1, El = 0;
  moelink_ep_config_t got_cfg;
  CHECK_OK(moelink_ep_get_config(ep, &got_cfg, &first, &El), "ep_get_config");
  CHECK(first == rank * (c->num_experts / nranks) && El == c->num_experts / nranks &&
            got_cfg.recv_capacity >= 1,
        "%s: rank %d owns experts [%d, %d + %d), recv_capacity %d", ec->name, rank, first, first,
        El, got_cfg.recv_capacity);
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
    int total = 0, mine_off = 0, mine = 0;
    for (int r = 0; r < nranks; ++r) {
      const int t = tokens_of(ec, it, r);
      if (r == rank) {
        mine_off = total;
        mine = t;
      }
      total += t;
    }
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
  e.moe.top_k = 0;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_INVALID_ARGUMENT, "moe.top_k 0");
  CHECK(strstr(moelink_last_error(), "config.moe") && strstr(moelink_last_error(), "top_k"),
        "the message names the field: %s", moelink_last_error());
  e = ecfg;
  e.moe.dtype = MOELINK_DTYPE_FP8_E4M3;
  CHECK_STATUS(moelink_ep_create(comm, &e, &ep), MOELINK_ERR_UNSUPPORTED, "fp8");
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
  ml_t_diag("%zu of %zu elements bitwise equal to the single-rank layer; largest |d| / allowed "
            "%.3g",
            bitwise_equal, compared, worst_ratio);
  ml_t_diag("took %.0f ms", ct_now_ms() - t0);
  CHECK_OK(moelink_comm_check(comm, NULL), "comm_check reports no failure");
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy");
  moelink_context_destroy(ctx);
  return ml_test_done();
}
