/* The router kernel (ml_cuda_router, src/cuda/router.cu) on its own:
 *
 * - For one block of tokens (T <= 16) it can build the plan itself. That plan
 *   must be bitwise the plan ml_cuda_plan builds from the same ids, and the
 *   ids and weights bitwise those of the same launch without the plan. Plan
 *   buffers are poisoned (0xFF) the same way before both, so entries neither
 *   writes must stay equal too.
 * - With splits > 1 the logits are partial sums added by the last CTA. The
 *   result must match one CTA per block (splits = 1): the same experts, where
 *   the token is not within fp32 rounding of another choice (ref_route_margin
 *   below GU_TIE), and weights within 1e-4 relative. Two launches must be
 *   bitwise equal, and the tickets must be back at zero after each. Partial
 *   volumes past 512 KiB (deepseek-like T 16) take the two-level sum, the
 *   others one level.
 * - The experts are chosen by the whole CTA (ranks: T * E^2 <= 65536, e.g.
 *   qwen3-like T 1 and 3) or by one warp per token (group limit, then k
 *   rounds of a warp-wide argmax); both against one CTA, and the ids against the
 *   double-precision reference's routing (ref_route_token) where no near
 *   tie; and through exact ties (equal router rows), where the winners must
 *   be the reference's in its order (ties to the lower index).
 *
 * - Logits given (large batches: the layer computes them with the grouped GEMM
 *   engine, ml_cuda_gemm_scaled with fp32 out, and the kernel only selects):
 *   the experts of the kernel's own logits where no near tie, weights within
 *   1e-4 relative, at T 16 and 333 (21 blocks, the last one short); E not a
 *   multiple of 8 is never sent that way.
 *
 * Shapes: the routing of mixtral-8x7b, qwen3-30b-a3b (E 128, k 8) and
 * deepseek-v3 (sigmoid, correction bias, 8 groups keep 4, scale 2.5) at their
 * full hidden sizes, so the split counts are the real ones (up to 56 for
 * deepseek's H 7168), E 512 with k 16 (top-k softmax), an odd shape
 * (E 37, H 520: padded experts, a short last chunk), and groups of 64 and
 * of 16 experts; T 1, 3, 8, 16. A token's warp selects in registers where
 * E <= 256 and groups are a multiple of 32 experts, else through shared
 * memory (E 512, groups of 16; the variant gpu_test_router_smem runs every
 * case that way, MOELINK_ROUTER_REGS=0). */
#include "core/core.h"
#include "core/random.h"
#include "cuda/cuda.h"
#include "cuda/gemm/sm90_engine.cuh"
#include "cuda/pipeline.h"
#include "gpu_util.h"

static int g_sms, g_optin;

typedef struct rcase {
  const char *name;
  int E, k, H;
  moelink_router_t router;
  int renorm, groups, keep, bias;
  float scale;
} rcase;

static const rcase g_cases[] = {
    {"mixtral-like", 8, 2, 4096, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 0, 1.0f},
    {"qwen3-like", 128, 8, 2048, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 0, 1.0f},
    {"deepseek-like", 256, 8, 7168, MOELINK_ROUTER_SIGMOID_TOPK, 1, 8, 4, 1, 2.5f},
    {"wide", 512, 16, 1024, MOELINK_ROUTER_TOPK_SOFTMAX, 0, 1, 1, 0, 1.0f},
    {"odd", 37, 5, 520, MOELINK_ROUTER_SOFTMAX_TOPK, 0, 1, 1, 0, 1.0f},
    /* groups of 64 (two register slots a lane a group) and of 16 (not a
     * multiple of 32: the shared-memory selection) */
    {"groups-of-64", 256, 8, 1024, MOELINK_ROUTER_SIGMOID_TOPK, 1, 4, 2, 1, 1.0f},
    {"groups-of-16", 128, 6, 1024, MOELINK_ROUTER_SIGMOID_TOPK, 1, 8, 3, 1, 1.0f},
};

/* n values scale * u(seed, i) (the library's generator), as dt (bf16
 * rounded to nearest even by the library's conversion, or f32). */
static void fill(moelink_dtype_t dt, void *dst, size_t n, uint64_t seed, float scale) {
  float *f = gu_host(n * sizeof(float));
  for (size_t i = 0; i < n; ++i) f[i] = scale * ml_random_unit(seed, i);
  if (dt == MOELINK_DTYPE_F32)
    memcpy(dst, f, n * sizeof(float));
  else
    ml_from_f32(dt, f, dst, n);
  free(f);
}

/* The layer config of a case at T tokens (bf16). */
static moelink_moe_config_t case_config(const rcase *c, int T) {
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = c->H;
  cfg.inter = 64;
  cfg.num_experts = c->E;
  cfg.top_k = c->k;
  cfg.router = c->router;
  cfg.renormalize = c->renorm;
  cfg.n_group = c->groups;
  cfg.topk_group = c->keep;
  cfg.routed_scaling = c->scale;
  cfg.correction_bias = c->bias;
  cfg.dtype = MOELINK_DTYPE_BF16;
  cfg.max_tokens = T;
  return cfg;
}

/* Host inputs of a case: x [T, H] and the router weight [E, H] in bf16, the
 * bias [E] in fp32 (freed by the caller). */
static void case_inputs(const rcase *c, int T, uint64_t seed, uint16_t **hx, uint16_t **hw,
                        float **hb) {
  const int E = c->E, H = c->H;
  *hx = gu_host((size_t)T * H * 2);
  *hw = gu_host((size_t)E * H * 2);
  *hb = gu_host((size_t)E * 4);
  fill(MOELINK_DTYPE_BF16, *hx, (size_t)T * H, 3 * seed, 1.0f);
  fill(MOELINK_DTYPE_BF16, *hw, (size_t)E * H, 3 * seed + 1, 3.0f / sqrtf((float)H));
  fill(MOELINK_DTYPE_F32, *hb, (size_t)E, 3 * seed + 2, 0.05f);
}

typedef struct routed {
  int32_t *ids;
  float *w;
  void *plan; /* host copy of the plan buffer, or NULL */
} routed;

/* One launch on the device buffers; copies ids, weights and (with plan_buf)
 * the plan back, and checks the tickets came back to zero. */
static void launch(const char *what, ml_cuda_router_args a, int T, int k, int E, int splits,
                   void *plan_buf, size_t plan_bytes, int fused, int via_plan, int32_t *tickets,
                   routed *out) {
  moelink_plan_t view;
  a.splits = splits;
  a.plan = NULL;
  if (plan_buf != NULL) {
    GU_MUST(moelink_plan_view(plan_buf, T, k, E, ML_CUDA_TILE_ROWS, &view), "plan view");
    gu_poison(plan_buf, plan_bytes);
    if (fused) a.plan = &view;
  }
  gu_poison(a.ids, (size_t)T * k * 4);
  gu_poison(a.weights, (size_t)T * k * 4);
  CHECK_OK(ml_cuda_router(&a, NULL), what);
  if (via_plan) {
    /* no workspace at these sizes: one block sorts */
    CHECK_OK(ml_cuda_plan(a.ids, T, k, E, NULL, &view, NULL), what);
  }
  GU_CUDA(cudaDeviceSynchronize());
  gu_d2h(out->ids, a.ids, (size_t)T * k * 4);
  gu_d2h(out->w, a.weights, (size_t)T * k * 4);
  if (plan_buf != NULL) gu_d2h(out->plan, plan_buf, plan_bytes);
  const size_t nt = ml_cuda_router_tickets(g_sms);
  int32_t *t = gu_host(nt * 4);
  gu_d2h(t, tickets, nt * 4);
  size_t left = 0;
  for (size_t i = 0; i < nt; ++i) left += t[i] != 0;
  CHECK(left == 0, "%s: tickets back at zero (%zu of %zu are not)", what, left, nt);
  free(t);
}

/* Two routings of the same tokens compared: tokens whose experts differ,
 * split into near ties of the reference (margin below GU_TIE) and real
 * flips; over the tokens that agree, weights beyond 1e-4 relative of b's
 * and the worst relative difference. */
typedef struct route_diff {
  int flipped, ties, off;
  double worst;
} route_diff;

static route_diff compare_routes(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                                 const uint16_t *hx, const routed *a, const routed *b, int T) {
  const int k = cfg->top_k, H = cfg->hidden;
  route_diff d = {0, 0, 0, 0.0};
  for (int t = 0; t < T; ++t) {
    if (memcmp(a->ids + (size_t)t * k, b->ids + (size_t)t * k, (size_t)k * 4) != 0) {
      const double m = ref_route_margin(cfg, w, hx + (size_t)t * H);
      if (m >= 0 && m < GU_TIE)
        ++d.ties;
      else
        ++d.flipped;
      continue;
    }
    for (int j = 0; j < k; ++j) {
      const double x = a->w[(size_t)t * k + j], y = b->w[(size_t)t * k + j];
      const double r = fabs(x - y) / (fabs(y) > 1e-30 ? fabs(y) : 1e-30);
      if (r > d.worst)
        d.worst = r;
      d.off += !(r <= 1e-4);
    }
  }
  return d;
}

/* The router weights of a case as the reference takes them (host copies). */
static moelink_moe_weights_t case_weights(const rcase *c, const uint16_t *hw, const float *hb) {
  moelink_moe_weights_t w;
  memset(&w, 0, sizeof w);
  w.size = sizeof w;
  w.dtype = MOELINK_DTYPE_BF16;
  w.router = hw;
  w.correction_bias = c->bias ? hb : NULL;
  return w;
}

/* A case's device buffers: x, the router weight and bias uploaded, ids,
 * weights, the split scratch and zeroed tickets, and the router's arguments
 * over them (the layer's splits for T tokens). */
typedef struct rdev {
  void *x, *w;
  float *b, *wts, *parts;
  int32_t *ids, *tickets;
  ml_cuda_router_args a;
} rdev;

static rdev rdev_make(const moelink_moe_config_t *cfg, int T, const uint16_t *hx,
                      const uint16_t *hw, const float *hb) {
  const int E = cfg->num_experts, k = cfg->top_k, H = cfg->hidden;
  rdev d;
  d.x = gu_dev((size_t)T * H * 2);
  d.w = gu_dev((size_t)E * H * 2);
  d.b = gu_dev((size_t)E * 4);
  gu_h2d(d.x, hx, (size_t)T * H * 2);
  gu_h2d(d.w, hw, (size_t)E * H * 2);
  gu_h2d(d.b, hb, (size_t)E * 4);
  d.ids = gu_dev((size_t)T * k * 4);
  d.wts = gu_dev((size_t)T * k * 4);
  d.parts = gu_dev(ml_cuda_router_partial_floats(E, g_sms) * sizeof(float));
  const size_t ntickets = ml_cuda_router_tickets(g_sms);
  d.tickets = gu_dev(ntickets * 4);
  GU_CUDA(cudaMemset(d.tickets, 0, ntickets * 4));
  d.a = ml_cuda_router_args_for(cfg, d.x, d.w, d.b, T, d.ids, d.wts, d.parts, d.tickets, g_sms);
  return d;
}

static void rdev_free(rdev *d) {
  gu_free(d->x);
  gu_free(d->w);
  gu_free(d->b);
  gu_free(d->ids);
  gu_free(d->wts);
  gu_free(d->parts);
  gu_free(d->tickets);
}

static void run_case(const rcase *c, int T, uint64_t seed) {
  char what[200];
  const int E = c->E, k = c->k, H = c->H;
  const moelink_moe_config_t cfg = case_config(c, T);

  uint16_t *hx, *hw;
  float *hb;
  case_inputs(c, T, seed, &hx, &hw, &hb);
  rdev dv = rdev_make(&cfg, T, hx, hw, hb);
  int32_t *tickets = dv.tickets;
  const size_t pb = moelink_plan_bytes(T, k, E, ML_CUDA_TILE_ROWS);
  void *dplan = gu_dev(pb);

  const ml_cuda_router_args a = dv.a;
  const int splits = a.splits;
  routed A, B, C, D;
  routed *all[4] = {&A, &B, &C, &D};
  for (int i = 0; i < 4; ++i) {
    all[i]->ids = gu_host((size_t)T * k * 4);
    all[i]->w = gu_host((size_t)T * k * 4);
    all[i]->plan = gu_host(pb);
  }
  snprintf(what, sizeof what, "%s T %d (H %d, E %d, k %d, %d splits)", c->name, T, H, E, k,
           splits);
  CHECK(ml_cuda_router_builds_plan(T, k), "%s: one block builds its plan", what);

  /* A: the plan from the router; B: the router, then ml_cuda_plan */
  launch(what, a, T, k, E, splits, dplan, pb, 1, 0, tickets, &A);
  launch(what, a, T, k, E, splits, dplan, pb, 0, 1, tickets, &B);
  CHECK(memcmp(A.ids, B.ids, (size_t)T * k * 4) == 0, "%s: ids bitwise equal with the plan",
        what);
  CHECK(memcmp(A.w, B.w, (size_t)T * k * 4) == 0, "%s: weights bitwise equal with the plan",
        what);
  size_t diff = pb;
  for (size_t i = 0; i < pb; ++i)
    if (((unsigned char *)A.plan)[i] != ((unsigned char *)B.plan)[i]) {
      diff = i;
      break;
    }
  CHECK(diff == pb, "%s: the router's plan is bitwise ml_cuda_plan's (first difference at byte "
        "%zu of %zu)", what, diff, pb);
  moelink_plan_t v;
  moelink_plan_view(A.plan, T, k, E, ML_CUDA_TILE_ROWS, &v);
  int want_tiles = 0, valid = 1;
  for (int e = 0; e < E; ++e) {
    const int n = v.expert_offsets[e + 1] - v.expert_offsets[e];
    valid &= n >= 0;
    want_tiles += (n + ML_CUDA_TILE_ROWS - 1) / ML_CUDA_TILE_ROWS;
  }
  CHECK(valid && v.expert_offsets[0] == 0 && v.expert_offsets[E] == T * k &&
            *v.num_tiles == want_tiles,
        "%s: offsets 0..%d (%d) and %d tiles (%d)", what, T * k, v.expert_offsets[E],
        want_tiles, *v.num_tiles);

  /* C: the same launch again, bitwise; D: one CTA per block */
  launch(what, a, T, k, E, splits, NULL, 0, 0, 0, tickets, &C);
  CHECK(memcmp(A.ids, C.ids, (size_t)T * k * 4) == 0 &&
            memcmp(A.w, C.w, (size_t)T * k * 4) == 0,
        "%s: two launches bitwise equal", what);
  launch(what, a, T, k, E, 1, NULL, 0, 0, 0, tickets, &D);
  const moelink_moe_weights_t w = case_weights(c, hw, hb);
  const route_diff df = compare_routes(&cfg, &w, hx, &A, &D, T);
  CHECK(df.flipped == 0, "%s: %d splits choose the experts of one CTA (%d differ, %d near ties)",
        what, splits, df.flipped, df.ties);
  CHECK(df.off == 0, "%s: weights within 1e-4 of one CTA's (worst %.2e)", what, df.worst);

  /* against the double-precision reference, tokens clear of a near tie */
  int32_t rid[ML_CUDA_MAX_TOPK];
  double rw[ML_CUDA_MAX_TOPK];
  int checked = 0, wrong = 0, wbad = 0;
  double wworst = 0.0;
  for (int t = 0; t < T; ++t) {
    const double m = ref_route_margin(&cfg, &w, hx + (size_t)t * H);
    if (m >= 0 && m < GU_TIE) continue;
    if (ref_route_token(&cfg, &w, hx + (size_t)t * H, rid, rw) != 0) {
      ++wrong;
      continue;
    }
    ++checked;
    wrong += memcmp(rid, A.ids + (size_t)t * k, (size_t)k * 4) != 0;
    for (int j = 0; j < k; ++j) {
      const double d = fabs(A.w[(size_t)t * k + j] - rw[j]);
      const double r = d / (fabs(rw[j]) > 1e-30 ? fabs(rw[j]) : 1e-30);
      if (r > wworst) wworst = r;
      wbad += !(r <= 1e-4);
    }
  }
  CHECK(wrong == 0 && wbad == 0 && checked > 0,
        "%s: the reference's experts in its order (%d of %d tokens differ) and weights within "
        "1e-4 (worst %.2e)", what, wrong, checked, wworst);

  for (int i = 0; i < 4; ++i) {
    free(all[i]->ids);
    free(all[i]->w);
    free(all[i]->plan);
  }
  free(hx);
  free(hw);
  free(hb);
  rdev_free(&dv);
  gu_free(dplan);
}

/* Exact ties: router rows whose every element is q_e 2^-13 (q_e = 1 + 7e mod
 * 5, five values repeating), token rows of 1, 2 and -1, no bias: the logits
 * are exact (multiples of 2^-13 well inside fp32's mantissa, in any order of
 * summation), so experts of equal q tie exactly, in fp32 as in the
 * reference's double. The winners must be the reference's, in its order
 * (ties to the lower index, groups too), with the default splits and with
 * one CTA. */
static void run_tie_case(const rcase *c) {
  char what[200];
  const int E = c->E, k = c->k, H = c->H, T = 3;
  const moelink_moe_config_t cfg = case_config(c, T);
  float *fx = gu_host((size_t)T * H * sizeof(float)), *fw = gu_host((size_t)E * H * sizeof(float));
  const float xv[3] = {1.0f, 2.0f, -1.0f};
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      fx[(size_t)t * H + h] = xv[t];
  for (int e = 0; e < E; ++e)
    for (int h = 0; h < H; ++h)
      fw[(size_t)e * H + h] = (float)(1 + (7 * e) % 5) * 0x1p-13f;
  uint16_t *hx = gu_host((size_t)T * H * 2), *hw = gu_host((size_t)E * H * 2);
  ml_from_f32(MOELINK_DTYPE_BF16, fx, hx, (size_t)T * H);
  ml_from_f32(MOELINK_DTYPE_BF16, fw, hw, (size_t)E * H);
  float *hb = gu_host((size_t)E * 4);
  memset(hb, 0, (size_t)E * 4);
  rdev dv = rdev_make(&cfg, T, hx, hw, hb);
  int32_t *tickets = dv.tickets;
  const ml_cuda_router_args a = dv.a;
  const moelink_moe_weights_t w = case_weights(c, hw, hb);
  const int split_counts[2] = {a.splits, 1};
  for (int si = 0; si < 2; ++si) {
    routed R;
    R.ids = gu_host((size_t)T * k * 4);
    R.w = gu_host((size_t)T * k * 4);
    R.plan = NULL;
    snprintf(what, sizeof what, "%s ties T %d (%d splits)", c->name, T, split_counts[si]);
    launch(what, a, T, k, E, split_counts[si], NULL, 0, 0, 0, tickets, &R);
    int wrong = 0, wbad = 0;
    for (int t = 0; t < T; ++t) {
      int32_t rid[ML_CUDA_MAX_TOPK];
      double rw[ML_CUDA_MAX_TOPK];
      if (ref_route_token(&cfg, &w, hx + (size_t)t * H, rid, rw) != 0) {
        ++wrong;
        continue;
      }
      wrong += memcmp(rid, R.ids + (size_t)t * k, (size_t)k * 4) != 0;
      for (int j = 0; j < k; ++j) {
        const double d = fabs(R.w[(size_t)t * k + j] - rw[j]);
        wbad += !(d <= 1e-4 * fmax(fabs(rw[j]), 1e-30));
      }
    }
    CHECK(wrong == 0 && wbad == 0,
          "%s: the reference's experts in its order through exact ties (%d tokens differ, %d "
          "weights off)",
          what, wrong, wbad);
    free(R.ids);
    free(R.w);
  }
  free(fx);
  free(fw);
  free(hx);
  free(hw);
  free(hb);
  rdev_free(&dv);
}

/* Logits from the GEMM engine, the kernel selecting only, against the
 * kernel's own logits (one CTA per block). */
static void run_logits_case(const rcase *c, int T, uint64_t seed) {
  char what[200];
  const int E = c->E, k = c->k, H = c->H;
  snprintf(what, sizeof what, "%s T %d logits given (H %d, E %d, k %d)", c->name, T, H, E, k);
  if (E % 8 != 0) {
    CHECK(!ml_cuda_router_gemm_wanted(1 << 20, E, H) &&
              ml_cuda_router_logits_floats(1 << 20, E, H) == 0,
          "%s: E %% 8 != 0 never takes the GEMM route", what);
    return;
  }
  const moelink_moe_config_t cfg = case_config(c, T);
  uint16_t *hx, *hw;
  float *hb;
  case_inputs(c, T, seed, &hx, &hw, &hb);
  void *dx = gu_dev((size_t)T * H * 2), *dw = gu_dev((size_t)E * H * 2);
  float *db = gu_dev((size_t)E * 4), *dl = gu_dev((size_t)T * E * 4);
  gu_h2d(dx, hx, (size_t)T * H * 2);
  gu_h2d(dw, hw, (size_t)E * H * 2);
  gu_h2d(db, hb, (size_t)E * 4);
  int32_t *dids = gu_dev((size_t)T * k * 4);
  float *dwts = gu_dev((size_t)T * k * 4);
  const size_t ntickets = ml_cuda_router_tickets(g_sms);
  int32_t *tickets = gu_dev(ntickets * 4);
  GU_CUDA(cudaMemset(tickets, 0, ntickets * 4));
  ml_cuda_router_args a =
      ml_cuda_router_args_for(&cfg, dx, dw, db, T, dids, dwts, NULL, tickets, g_sms);
  routed R, G;
  R.ids = gu_host((size_t)T * k * 4);
  R.w = gu_host((size_t)T * k * 4);
  G.ids = gu_host((size_t)T * k * 4);
  G.w = gu_host((size_t)T * k * 4);
  R.plan = G.plan = NULL;
  launch(what, a, T, k, E, 1, NULL, 0, 0, 0, tickets, &R);
  gu_poison(dl, (size_t)T * E * 4);
  CHECK_OK(ml_cuda_gemm_scaled(MOELINK_DTYPE_BF16, dx, H, dw, E, H, NULL, NULL, 0, T, NULL, NULL,
                               dl, 1, NULL, NULL),
           what);
  a.logits = dl;
  launch(what, a, T, k, E, 1, NULL, 0, 0, 0, tickets, &G);
  const moelink_moe_weights_t w = case_weights(c, hw, hb);
  const route_diff df = compare_routes(&cfg, &w, hx, &G, &R, T);
  CHECK(df.flipped == 0, "%s: the experts of the kernel's own logits (%d differ, %d near ties)",
        what, df.flipped, df.ties);
  CHECK(df.off == 0, "%s: weights within 1e-4 of the kernel's own logits' (worst %.2e)", what,
        df.worst);
  /* The logits with k in parts (ml_cuda_gemm_splitk), added by the kernel:
   * the parts sum to the whole GEMM's logits, the same experts are chosen;
   * on the engine the layers use (sm_90a from 256 columns) and on the
   * mma.sync tile engine (the whole sum in part 0, zeros in the rest). */
  const int ktiles = (H + 63) / 64;
  enum { NPC = 3 };
  const int part_counts[NPC] = {2, 4, 7};
  float *hl = gu_host((size_t)T * E * 4);
  gu_d2h(hl, dl, (size_t)T * E * 4);
  for (int run = 0; run < 2 * NPC; ++run) {
    const int tile = run >= NPC, parts = part_counts[run % NPC];
    if (ktiles % parts != 0)
      continue;
    char pw[240];
    snprintf(pw, sizeof pw, "%s, k in %d parts%s", what, parts, tile ? ", tile engine" : "");
    ml_cuda_gemm_set_engine(tile ? ML_GEMM_ENGINE_TILE : ML_GEMM_ENGINE_AUTO);
    if (tile)
      CHECK(ml_cuda_gemm_splitk_parts(T, E, H, 8) == 1, "%s: no parts asked for", pw);
    float *dp = gu_dev((size_t)parts * T * E * 4);
    gu_poison(dp, (size_t)parts * T * E * 4);
    CHECK_OK(ml_cuda_gemm_splitk(MOELINK_DTYPE_BF16, dx, H, dw, E, H, T, dp, parts, NULL, NULL),
             pw);
    if (tile)
      CHECK(ml_cuda_gemm_last_engine() == ML_GEMM_ENGINE_TILE, "%s: ran on the tile engine", pw);
    GU_CUDA(cudaDeviceSynchronize());
    float *hp = gu_host((size_t)parts * T * E * 4);
    gu_d2h(hp, dp, (size_t)parts * T * E * 4);
    double worst = 0.0;
    for (size_t i = 0; i < (size_t)T * E; ++i) {
      float s = hp[i];
      for (int q = 1; q < parts; ++q)
        s += hp[(size_t)q * T * E + i];
      const double d = fabs((double)s - (double)hl[i]) / (1.0 + fabs((double)hl[i]));
      if (!(d <= worst))
        worst = d; /* NaN (poison left) counts as worst */
    }
    /* (fp32 sums of up to 7168 products in another order: ~1e-5 apart) */
    CHECK(worst < 1e-4, "%s: the parts add up to the whole GEMM's logits (worst %.2e)", pw, worst);
    a.logits = dp;
    a.logit_parts = parts;
    routed P2;
    P2.ids = gu_host((size_t)T * k * 4);
    P2.w = gu_host((size_t)T * k * 4);
    P2.plan = NULL;
    launch(pw, a, T, k, E, 1, NULL, 0, 0, 0, tickets, &P2);
    const route_diff dp2 = compare_routes(&cfg, &w, hx, &P2, &R, T);
    CHECK(dp2.flipped == 0 && dp2.off == 0,
          "%s: the experts and weights of the kernel's own logits (%d differ, %d near ties, "
          "worst weight %.2e)",
          pw, dp2.flipped, dp2.ties, dp2.worst);
    free(P2.ids), free(P2.w), free(hp);
    gu_free(dp);
    a.logits = dl;
    a.logit_parts = 0;
  }
  ml_cuda_gemm_set_engine(ML_GEMM_ENGINE_AUTO);
  free(hl);
  CHECK(ml_cuda_gemm_splitk(MOELINK_DTYPE_BF16, dx, H, dw, E, H, T, dl, ktiles + 1, NULL, NULL) ==
            MOELINK_ERR_INVALID_ARGUMENT,
        "%s: k in %d parts (not dividing its %d steps) refused", what, ktiles + 1, ktiles);
  /* bad combinations are refused, not run */
  a.logit_parts = 9;
  CHECK(ml_cuda_router(&a, NULL) == MOELINK_ERR_INTERNAL, "%s: logits in 9 parts refused", what);
  a.logit_parts = 0;
  a.splits = 1;
  a.pdl = 1;
  CHECK(ml_cuda_router(&a, NULL) == MOELINK_ERR_INTERNAL,
        "%s: logits with a programmatic-dependent launch refused", what);
  free(R.ids), free(R.w), free(G.ids), free(G.w), free(hx), free(hw), free(hb);
  gu_free(dx), gu_free(dw), gu_free(db), gu_free(dl), gu_free(dids), gu_free(dwts);
  gu_free(tickets);
}

int main(void) {
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major < 9) {
    printf("Bail out! no sm_90 GPU\n");
    return 1;
  }
  g_sms = prop.multiProcessorCount;
  g_optin = (int)prop.sharedMemPerBlockOptin;
  GU_MUST(ml_cuda_router_prepare(g_optin), "router shared memory");
  ml_t_diag("device 0: %s, %d SMs", prop.name, g_sms);
  const int Ts[] = {1, 3, 8, 16};
  for (size_t c = 0; c < sizeof g_cases / sizeof g_cases[0]; ++c)
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; ++i)
      run_case(&g_cases[c], Ts[i], 100 * c + i);
  for (size_t c = 0; c < sizeof g_cases / sizeof g_cases[0]; ++c)
    run_tie_case(&g_cases[c]);
  for (size_t c = 0; c < sizeof g_cases / sizeof g_cases[0]; ++c) {
    run_logits_case(&g_cases[c], 16, 1000 + 10 * c);
    run_logits_case(&g_cases[c], 333, 1001 + 10 * c);
  }
  return ml_test_done();
}
