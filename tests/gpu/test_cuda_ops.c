/* Each CUDA op against the CPU backend on the same weights and fresh random
 * inputs: route, plan, experts, combine, fill_random; the backend's limits;
 * odd sizes (T = 0, 1, 7, 4097; E not a power of two; k = 1 and k = E). */
#include "gpu_util.h"

#include <limits.h>

static moelink_context_t g_gpu, g_cpu;

/* ---- limits ---------------------------------------------------------------------- */

static moelink_moe_config_t small_cfg(void) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  c.hidden = 64;
  c.inter = 32;
  c.num_experts = 8;
  c.top_k = 2;
  c.max_tokens = 64;
  return c;
}

static void expect_unsupported(const moelink_moe_config_t *c, const char *needle,
                               const char *what) {
  moelink_moe_t moe = NULL;
  moelink_status_t s = moelink_moe_create(g_gpu, c, &moe);
  const char *msg = moelink_last_error();
  CHECK(s == MOELINK_ERR_UNSUPPORTED && strstr(msg, needle) != NULL,
        "%s: create -> %s (\"%s\"), want UNSUPPORTED naming \"%s\"", what,
        moelink_status_string(s), msg, needle);
  if (s == MOELINK_SUCCESS) moelink_moe_destroy(moe);
  size_t bytes = 0;
  s = moelink_moe_workspace_size(g_gpu, c, &bytes);
  CHECK(s == MOELINK_ERR_UNSUPPORTED, "%s: workspace_size -> %s (%s)", what,
        moelink_status_string(s), moelink_last_error());
}

static void test_limits(void) {
  moelink_moe_config_t c = small_cfg();
  c.dtype = MOELINK_DTYPE_F32;
  expect_unsupported(&c, "f32", "f32 layer");
  c = small_cfg();
  c.num_experts = 513;
  expect_unsupported(&c, "513", "513 experts");
  c = small_cfg();
  c.num_experts = 32;
  c.top_k = 17;
  expect_unsupported(&c, "17", "top_k 17");
  c = small_cfg();
  c.hidden = 100;
  expect_unsupported(&c, "hidden 100", "hidden 100");
  c = small_cfg();
  c.inter = 36;
  expect_unsupported(&c, "inter 36", "inter 36");
  c = small_cfg();
  c.shared_inter = 20;
  expect_unsupported(&c, "shared_inter 20", "shared_inter 20");

  /* The limits themselves are accepted. */
  c = small_cfg();
  c.num_experts = 512;
  c.top_k = 16;
  moelink_moe_t moe = NULL;
  CHECK_OK(moelink_moe_create(g_gpu, &c, &moe), "512 experts, top_k 16: create");
  CHECK(moe == NULL || moelink_moe_tile_rows(moe) == 64, "tile rows %d == 64",
        moe ? moelink_moe_tile_rows(moe) : -1);
  moelink_moe_destroy(moe);

  /* Workspace grows with max_tokens * k * (H + I), not with the experts. */
  c = small_cfg();
  c.hidden = 1024;
  c.inter = 512;
  c.top_k = 8;
  c.num_experts = 64;
  size_t w1 = 0, w2 = 0, w3 = 0;
  c.max_tokens = 1024;
  CHECK_OK(moelink_moe_workspace_size(g_gpu, &c, &w1), "workspace_size(max_tokens 1024)");
  c.max_tokens = 2048;
  CHECK_OK(moelink_moe_workspace_size(g_gpu, &c, &w2), "workspace_size(max_tokens 2048)");
  c.num_experts = 512;
  CHECK_OK(moelink_moe_workspace_size(g_gpu, &c, &w3), "workspace_size(512 experts)");
  const double per_token = 8.0 * (1024 + 512) * 2;
  ml_t_diag("workspace: %zu bytes at 1024 tokens, %zu at 2048, %zu at 2048 with 512 experts", w1,
            w2, w3);
  CHECK(w2 > w1 && (double)(w2 - w1) >= 1024 * per_token && (double)(w2 - w1) <= 1024 * per_token * 1.5,
        "workspace grows by %.0f bytes per token (want %.0f..%.0f)", (double)(w2 - w1) / 1024.0,
        per_token, per_token * 1.5);
  CHECK(w3 >= w2 && w3 - w2 < ((size_t)32 << 20), "512 experts add %zu bytes (< 32 MiB)",
        w3 - w2);

  /* Device that does not exist. */
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = MOELINK_BACKEND_CUDA;
  cc.device = 999;
  moelink_context_t bad = NULL;
  CHECK_STATUS(moelink_context_create(&cc, &bad), MOELINK_ERR_UNSUPPORTED, "device 999");
}

/* ---- fill_random ------------------------------------------------------------------- */

static void fill_case(moelink_dtype_t dt, size_t n, uint64_t seed, float scale, float offset) {
  const size_t es = moelink_dtype_size(dt);
  void *d = gu_dev(n * es + 16);
  gu_poison(d, n * es + 16);
  /* one element in, to exercise an offset start (the index restarts at 0) */
  char *dptr = (char *)d + es;
  char what[160];
  snprintf(what, sizeof what, "fill %s n %zu seed %llu scale %g offset %g", moelink_dtype_name(dt),
           n, (unsigned long long)seed, (double)scale, (double)offset);
  CHECK_OK(moelink_fill_random(g_gpu, dt, dptr, n, seed, scale, offset, NULL), what);
  GU_CUDA(cudaDeviceSynchronize());
  unsigned char *got = gu_host(n * es + 2 * es);
  gu_d2h(got, d, n * es + 2 * es);
  unsigned char *cpu = gu_host(n * es);
  CHECK_OK(moelink_fill_random(g_cpu, dt, cpu, n, seed, scale, offset, NULL), "CPU fill");
  unsigned char *mine = gu_host(n * es);
  for (size_t i = 0; i < n; ++i)
    ref_store(dt, mine, i, (double)moelink_random_value(seed, i, scale, offset));
  size_t diff_cpu = 0, diff_ref = 0, first = (size_t)-1;
  for (size_t i = 0; i < n; ++i) {
    const int dc = memcmp(got + es + i * es, cpu + i * es, es) != 0;
    const int dr = memcmp(got + es + i * es, mine + i * es, es) != 0;
    diff_cpu += (size_t)dc;
    diff_ref += (size_t)dr;
    if ((dc || dr) && first == (size_t)-1) first = i;
  }
  CHECK(diff_cpu == 0, "%s: bitwise equal to the CPU backend (%zu differ)", what, diff_cpu);
  CHECK(diff_ref == 0, "%s: bitwise equal to moelink_random_value + RNE (%zu differ)", what,
        diff_ref);
  if (first != (size_t)-1) {
    uint32_t g = 0, c = 0, m = 0;
    memcpy(&g, got + es + first * es, es);
    memcpy(&c, cpu + first * es, es);
    memcpy(&m, mine + first * es, es);
    ml_t_diag("  first difference at %zu: gpu 0x%x cpu 0x%x ref 0x%x (value %.9g)", first, g, c, m,
              (double)moelink_random_value(seed, first, scale, offset));
  }
  /* The neighbours of the range stay untouched. */
  int guard = 1;
  for (size_t b = 0; b < es; ++b)
    guard &= got[b] == 0xFF && got[es + n * es + b] == 0xFF;
  CHECK(guard, "%s: writes nothing outside [ptr, ptr + n)", what);
  free(got);
  free(cpu);
  free(mine);
  gu_free(d);
}

static void test_fill(void) {
  fill_case(MOELINK_DTYPE_BF16, 1, 1, 1.0f, 0.0f);
  fill_case(MOELINK_DTYPE_BF16, 1000003, 42, 0.37f, 0.25f);
  fill_case(MOELINK_DTYPE_F16, 1000003, 7, 1.0f, 0.0f);
  fill_case(MOELINK_DTYPE_F16, 100003, 8, 70000.0f, 0.0f);    /* overflow to inf */
  fill_case(MOELINK_DTYPE_F16, 100003, 9, 3e-6f, 1e-7f);      /* subnormals */
  fill_case(MOELINK_DTYPE_BF16, 100003, 10, 3.4e38f, 0.0f);   /* near the top: some round to inf */
  fill_case(MOELINK_DTYPE_F32, 1000003, 11, 2.5f, -1.0f);
  fill_case(MOELINK_DTYPE_BF16, 77, 0xffffffffffffffffull, 1.0f / 3.0f, 1.0f / 7.0f);

  /* Indices past 2^32: the tail of a 2^32 + 4099 element bf16 fill. */
  const size_t n = ((size_t)1 << 32) + 4099, tail = 8192;
  void *d = NULL;
  if (cudaMalloc(&d, n * 2) != cudaSuccess) {
    (void)cudaGetLastError();
    CHECK(0, "fill past 2^32: cannot allocate %zu bytes", n * 2);
    return;
  }
  CHECK_OK(moelink_fill_random(g_gpu, MOELINK_DTYPE_BF16, d, n, 5, 1.0f, 0.0f, NULL),
           "fill of 2^32 + 4099 bf16");
  uint16_t *got = gu_host(tail * 2);
  gu_d2h(got, (char *)d + (n - tail) * 2, tail * 2);
  size_t bad = 0;
  for (size_t i = 0; i < tail; ++i) {
    uint16_t want;
    ref_store(MOELINK_DTYPE_BF16, &want, 0, (double)moelink_random_value(5, n - tail + i, 1.0f, 0.0f));
    if (want != got[i] && bad++ < 4)
      ml_t_diag("  element %zu: gpu 0x%04x want 0x%04x", n - tail + i, got[i], want);
  }
  CHECK(bad == 0, "fill past 2^32: last %zu elements match the host values (%zu differ)", tail,
        bad);
  free(got);
  gu_free(d);

  /* A pointer that is not element-aligned is refused, not faulted on. */
  void *d2 = gu_dev(64);
  CHECK_STATUS(moelink_fill_random(g_gpu, MOELINK_DTYPE_BF16, (char *)d2 + 1, 8, 1, 1.0f, 0.0f,
                                   NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "fill at an odd address");
  gu_free(d2);
}

/* ---- plans -------------------------------------------------------------------------- */

/* Invariants of a plan for ids [P]: offsets, the permutation and its inverse,
 * tiles covering each expert's rows exactly once. Returns the number of
 * violations and prints the first. */
static int plan_invariants(const char *what, const moelink_plan_t *p, const int32_t *ids,
                           int minimal_tiles) {
  const int E = p->num_experts, P = p->num_tokens * p->top_k;
  int errs = 0;
#define PLAN_BAD(...)                                                          \
  do {                                                                         \
    if (errs++ < 5) ml_t_diag(__VA_ARGS__);                                    \
  } while (0)
  int valid = 0;
  for (int i = 0; i < P; ++i) valid += ids[i] >= 0 && ids[i] < E;
  if (p->expert_offsets[0] != 0) PLAN_BAD("  %s: offsets[0] = %d", what, p->expert_offsets[0]);
  for (int e = 0; e < E; ++e)
    if (p->expert_offsets[e + 1] < p->expert_offsets[e])
      PLAN_BAD("  %s: offsets[%d] = %d > offsets[%d] = %d", what, e, p->expert_offsets[e], e + 1,
               p->expert_offsets[e + 1]);
  if (p->expert_offsets[E] != valid)
    PLAN_BAD("  %s: offsets[E] = %d, %d valid pairs", what, p->expert_offsets[E], valid);
  if (errs) return errs;
  for (int e = 0; e < E; ++e)
    for (int r = p->expert_offsets[e]; r < p->expert_offsets[e + 1]; ++r) {
      const int pair = p->sorted_pairs[r];
      if (pair < 0 || pair >= P || ids[pair] != e)
        PLAN_BAD("  %s: row %d of expert %d holds pair %d (id %d)", what, r, e, pair,
                 pair >= 0 && pair < P ? ids[pair] : -999);
      else if (r > p->expert_offsets[e] && pair <= p->sorted_pairs[r - 1])
        PLAN_BAD("  %s: row %d pair %d after pair %d: not ascending", what, r, pair,
                 p->sorted_pairs[r - 1]);
      else if (p->pair_rows[pair] != r)
        PLAN_BAD("  %s: pair_rows[%d] = %d, want %d", what, pair, p->pair_rows[pair], r);
    }
  for (int i = 0; i < P; ++i)
    if ((ids[i] < 0 || ids[i] >= E) && p->pair_rows[i] != -1)
      PLAN_BAD("  %s: pair %d (id %d) has row %d, want -1", what, i, ids[i], p->pair_rows[i]);
  const int nt = *p->num_tiles;
  if (nt < 0 || nt > p->max_tiles) {
    PLAN_BAD("  %s: num_tiles %d outside [0, %d]", what, nt, p->max_tiles);
    return errs;
  }
  const int rows = p->expert_offsets[E];
  unsigned char *cover = calloc((size_t)rows + 1, 1);
  long want_tiles = 0;
  for (int e = 0; e < E; ++e)
    want_tiles += (p->expert_offsets[e + 1] - p->expert_offsets[e] + p->tile_rows - 1) / p->tile_rows;
  for (int i = 0; i < nt; ++i) {
    const int e = p->tiles[3 * i], r0 = p->tiles[3 * i + 1], n = p->tiles[3 * i + 2];
    if (e < 0 || e >= E || n < 1 || n > p->tile_rows || r0 < p->expert_offsets[e] ||
        r0 + n > p->expert_offsets[e + 1]) {
      PLAN_BAD("  %s: tile %d = (expert %d, row %d, %d rows) outside the expert's rows", what, i,
               e, r0, n);
      continue;
    }
    for (int r = r0; r < r0 + n; ++r)
      if (cover[r]++) PLAN_BAD("  %s: row %d in two tiles (tile %d)", what, r, i);
  }
  for (int r = 0; r < rows; ++r)
    if (!cover[r]) {
      PLAN_BAD("  %s: row %d in no tile", what, r);
      break;
    }
  free(cover);
  if (minimal_tiles && nt != want_tiles)
    PLAN_BAD("  %s: %d tiles, want %ld (one per %d rows of each expert)", what, nt, want_tiles,
             p->tile_rows);
#undef PLAN_BAD
  return errs;
}

/* GPU plan of ids vs the CPU plan of the same ids. */
static void compare_plans(const char *what, moelink_moe_t gmoe, moelink_moe_t cmoe,
                          const moelink_moe_config_t *cfg, int T, const int32_t *ids) {
  const int k = cfg->top_k, E = cfg->num_experts, P = T * k;
  const size_t bytes = moelink_plan_bytes(T, k, E, moelink_moe_tile_rows(gmoe));
  CHECK(bytes == moelink_plan_bytes(T, k, E, moelink_moe_tile_rows(cmoe)),
        "%s: CPU and GPU plans have the same size (tile rows %d and %d)", what,
        moelink_moe_tile_rows(cmoe), moelink_moe_tile_rows(gmoe));
  int32_t *dids = gu_dev((size_t)P * 4 + 4);
  gu_h2d(dids, ids, (size_t)P * 4);
  void *dplan = gu_dev(bytes);
  gu_poison(dplan, bytes);
  CHECK_OK(moelink_moe_plan(gmoe, dids, T, dplan, NULL), what);
  void *gp = gu_host(bytes), *cp = gu_host(bytes);
  gu_d2h(gp, dplan, bytes);
  memset(cp, 0xFF, bytes);
  CHECK_OK(moelink_moe_plan(cmoe, ids, T, cp, NULL), "CPU plan");
  moelink_plan_t g, c;
  moelink_plan_view(gp, T, k, E, moelink_moe_tile_rows(gmoe), &g);
  moelink_plan_view(cp, T, k, E, moelink_moe_tile_rows(cmoe), &c);
  const int ginv = plan_invariants(what, &g, ids, 1);
  CHECK(ginv == 0, "%s: GPU plan invariants (%d violations)", what, ginv);
  const int cinv = plan_invariants("cpu", &c, ids, 0);
  CHECK(cinv == 0, "%s: CPU plan invariants (%d violations)", what, cinv);
  if (ginv == 0 && cinv == 0) {
    const int off_eq = memcmp(g.expert_offsets, c.expert_offsets, 4 * (size_t)(E + 1)) == 0;
    const int rows = g.expert_offsets[E];
    const int sp_eq = off_eq && memcmp(g.sorted_pairs, c.sorted_pairs, 4 * (size_t)rows) == 0;
    const int pr_eq = memcmp(g.pair_rows, c.pair_rows, 4 * (size_t)P) == 0;
    CHECK(off_eq && sp_eq && pr_eq,
          "%s: offsets, sorted_pairs, pair_rows bitwise equal to the CPU's (%d %d %d)", what,
          off_eq, sp_eq, pr_eq);
    const int tiles_eq = *g.num_tiles == *c.num_tiles &&
                         memcmp(g.tiles, c.tiles, 12 * (size_t)*g.num_tiles) == 0;
    ml_t_diag("%s: %d valid rows, %d tiles (CPU %d, %s)", what, rows, *g.num_tiles, *c.num_tiles,
              tiles_eq ? "same tiles" : "tiles differ, both valid");
  }
  free(gp);
  free(cp);
  gu_free(dplan);
  gu_free(dids);
}

/* Plans of many pairs without a layer's weights: more chunks than the
 * sort's first size allows (the chunk grows), all pairs on one expert (one
 * key's count from every lane of every warp), holes, a single chunk just
 * past the one-block path, and a call of fewer pairs than the layer's
 * maximum that needs more chunks than the maximum does (65536 pairs: 64
 * chunks; 65538: 43). */
static void test_large_plans(void) {
  static const struct {
    int E, k, T, max_T, skew;
  } cases[] = {{512, 8, 40000, 40000, 0},
               {8, 2, 33000, 33000, 1},
               {1, 1, 700, 700, 0},
               {256, 8, 8192, 8192, 2},
               {64, 2, 32768, 32769, 0}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ++ci) {
    moelink_moe_config_t c = small_cfg();
    c.num_experts = cases[ci].E;
    c.top_k = cases[ci].k;
    c.max_tokens = cases[ci].max_T;
    moelink_moe_t gmoe = NULL, cmoe = NULL;
    GU_MUST(moelink_moe_create(g_gpu, &c, &gmoe), "GPU layer (plans)");
    GU_MUST(moelink_moe_create(g_cpu, &c, &cmoe), "CPU layer (plans)");
    const int T = cases[ci].T, P = T * c.top_k, E = c.num_experts;
    int32_t *ids = gu_host((size_t)P * 4);
    uint64_t st = 0x9e3779b97f4a7c15ull * (ci + 1);
    for (int i = 0; i < P; ++i) {
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      const uint32_t r = (uint32_t)(st >> 33);
      if (cases[ci].skew == 1)
        ids[i] = i % 97 == 0 ? (int32_t)(r % (uint32_t)E) : E - 1; /* nearly all on one */
      else if (cases[ci].skew == 2)
        ids[i] = r % 13 == 0 ? -1 : (int32_t)((r >> 4) % 16u); /* 16 of 256 experts, holes */
      else
        ids[i] = (int32_t)(r % (uint32_t)E);
    }
    char what[160];
    snprintf(what, sizeof what, "plan of %d pairs (E %d, k %d, %s)", P, E, c.top_k,
             cases[ci].skew == 1   ? "nearly all on one expert"
             : cases[ci].skew == 2 ? "16 experts and holes"
                                   : "uniform");
    compare_plans(what, gmoe, cmoe, &c, T, ids);
    free(ids);
    moelink_moe_destroy(gmoe);
    moelink_moe_destroy(cmoe);
  }
}

/* ---- one config at one T --------------------------------------------------------------- */

static void ops_case(const ref_layer *L, moelink_moe_t gmoe, moelink_moe_t cmoe, int T,
                     const char *name) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const moelink_dtype_t dt = cfg->dtype;
  const int k = cfg->top_k, E = cfg->num_experts, P = T * k;
  const size_t es = moelink_dtype_size(dt), H = (size_t)cfg->hidden;
  char what[256];

  void *hx = gu_host((size_t)T * H * es);
  ref_fill_x(L, hx, T, 1000u + (unsigned)T);
  void *dx = gu_dev((size_t)T * H * es);
  gu_h2d(dx, hx, (size_t)T * H * es);

  /* route */
  int32_t *dids = gu_dev((size_t)P * 4);
  float *dw = gu_dev((size_t)P * 4);
  gu_poison(dids, (size_t)P * 4);
  gu_poison(dw, (size_t)P * 4);
  snprintf(what, sizeof what, "%s T %d: route", name, T);
  CHECK_OK(moelink_moe_route(gmoe, dx, T, dids, dw, NULL), what);
  int32_t *gi = gu_host((size_t)P * 4), *ci = gu_host((size_t)P * 4);
  float *gw = gu_host((size_t)P * 4), *cw = gu_host((size_t)P * 4);
  gu_d2h(gi, dids, (size_t)P * 4);
  gu_d2h(gw, dw, (size_t)P * 4);
  CHECK_OK(moelink_moe_route(cmoe, hx, T, ci, cw, NULL), "CPU route");
  gu_route_stats rs = gu_compare_routes(what, cfg, &L->w, hx, T, gi, gw, ci, cw, NULL);
  gu_check_routes(what, rs);

  /* plan: of the CPU's ids (both sides see the same ids), then with empty
   * and out-of-range slots */
  snprintf(what, sizeof what, "%s T %d: plan", name, T);
  compare_plans(what, gmoe, cmoe, cfg, T, ci);
  int32_t *holes = gu_host((size_t)P * 4);
  memcpy(holes, ci, (size_t)P * 4);
  for (int i = 0; i < P; ++i) {
    if (i % 11 == 3) holes[i] = -1;
    if (i % 17 == 5) holes[i] = E;
    if (i % 23 == 9) holes[i] = E + 7;
    if (i % 29 == 1) holes[i] = INT_MIN;
  }
  snprintf(what, sizeof what, "%s T %d: plan with empty slots", name, T);
  compare_plans(what, gmoe, cmoe, cfg, T, holes);

  /* experts + combine, twice: full plan with the CPU's weights, and the
   * plan with holes without weights */
  for (int variant = 0; variant < 2; ++variant) {
    const int32_t *ids = variant == 0 ? ci : holes;
    const float *hwts = variant == 0 ? cw : NULL;
    const char *vname = variant == 0 ? "weighted" : "holes, unweighted";
    const size_t pbytes = moelink_plan_bytes(T, k, E, moelink_moe_tile_rows(gmoe));
    void *gplan = gu_dev(pbytes);
    void *cplan = gu_host(pbytes);
    int32_t *dpids = gu_dev((size_t)P * 4);
    gu_h2d(dpids, ids, (size_t)P * 4);
    float *dwts = NULL;
    if (hwts) {
      dwts = gu_dev((size_t)P * 4);
      gu_h2d(dwts, hwts, (size_t)P * 4);
    }
    GU_MUST(moelink_moe_plan(gmoe, dpids, T, gplan, NULL), "GPU plan");
    GU_MUST(moelink_moe_plan(cmoe, ids, T, cplan, NULL), "CPU plan");
    moelink_plan_t cp;
    moelink_plan_view(cplan, T, k, E, moelink_moe_tile_rows(cmoe), &cp);
    const int rows = cp.expert_offsets[E];

    void *dy = gu_dev((size_t)P * H * es);
    gu_poison(dy, (size_t)P * H * es);
    snprintf(what, sizeof what, "%s T %d: experts (%s)", name, T, vname);
    CHECK_OK(moelink_moe_experts(gmoe, dx, T, gplan, dwts, dy, NULL), what);
    void *gy = gu_host((size_t)P * H * es), *cy = gu_host((size_t)P * H * es);
    gu_d2h(gy, dy, (size_t)P * H * es);
    CHECK_OK(moelink_moe_experts(cmoe, hx, T, cplan, hwts, cy, NULL), "CPU experts");
    gu_err ey = gu_compare(dt, gy, cy, (size_t)rows, H, NULL);
    gu_check_err(what, ey, dt, gy, cy, H);

    void *dout = gu_dev((size_t)T * H * es);
    gu_poison(dout, (size_t)T * H * es);
    snprintf(what, sizeof what, "%s T %d: combine of the GPU's y (%s)", name, T, vname);
    CHECK_OK(moelink_moe_combine(gmoe, dy, T, gplan, dout, NULL), what);
    void *go = gu_host((size_t)T * H * es), *co = gu_host((size_t)T * H * es);
    gu_d2h(go, dout, (size_t)T * H * es);
    CHECK_OK(moelink_moe_combine(cmoe, cy, T, cplan, co, NULL), "CPU combine");
    gu_err eo = gu_compare(dt, go, co, (size_t)T, H, NULL);
    gu_check_err(what, eo, dt, go, co, H);

    /* The same y on both sides: fp32 sums in slot order and one rounding on
     * both, so at most one unit in the last place apart. */
    gu_h2d(dy, cy, (size_t)P * H * es);
    gu_poison(dout, (size_t)T * H * es);
    snprintf(what, sizeof what, "%s T %d: combine of the CPU's y (%s)", name, T, vname);
    CHECK_OK(moelink_moe_combine(gmoe, dy, T, gplan, dout, NULL), what);
    gu_d2h(go, dout, (size_t)T * H * es);
    size_t far = 0;
    for (size_t i = 0; i < (size_t)T * H; ++i) {
      uint16_t a, b;
      memcpy(&a, (char *)go + 2 * i, 2);
      memcpy(&b, (char *)co + 2 * i, 2);
      const int d = gu_ord16(a) - gu_ord16(b);
      if ((d > 1 || d < -1) && far++ < 4)
        ml_t_diag("  element %zu (token %zu): gpu 0x%04x %.6g cpu 0x%04x %.6g", i, i / H, a,
                  ref_load(dt, go, i), b, ref_load(dt, co, i));
    }
    CHECK(far == 0, "%s: within 1 ulp of the CPU's combine (%zu further)", what, far);

    free(gy);
    free(cy);
    free(go);
    free(co);
    free(cplan);
    gu_free(dy);
    gu_free(dout);
    gu_free(gplan);
    gu_free(dpids);
    gu_free(dwts);
  }
  free(holes);
  free(gi);
  free(ci);
  free(gw);
  free(cw);
  free(hx);
  gu_free(dids);
  gu_free(dw);
  gu_free(dx);
}

/* Nothing is read or written for T = 0. */
static void zero_tokens(moelink_moe_t gmoe, const moelink_moe_config_t *cfg, const char *name) {
  const size_t es = moelink_dtype_size(cfg->dtype), H = (size_t)cfg->hidden;
  const int k = cfg->top_k, E = cfg->num_experts;
  void *buf = gu_dev(4096 + H * es);
  gu_poison(buf, 4096 + H * es);
  char what[300];
  snprintf(what, sizeof what, "%s T 0: route, experts, combine, forward succeed", name);
  int ok = moelink_moe_route(gmoe, buf, 0, buf, buf, NULL) == MOELINK_SUCCESS;
  ok &= moelink_moe_experts(gmoe, buf, 0, buf, NULL, buf, NULL) == MOELINK_SUCCESS;
  ok &= moelink_moe_combine(gmoe, buf, 0, buf, buf, NULL) == MOELINK_SUCCESS;
  ok &= moelink_moe_forward(gmoe, buf, 0, (char *)buf + 2048, NULL) == MOELINK_SUCCESS;
  CHECK(ok, "%s (%s)", what, moelink_last_error());
  unsigned char *h = gu_host(4096 + H * es);
  gu_d2h(h, buf, 4096 + H * es);
  int untouched = 1;
  for (size_t i = 0; i < 4096 + H * es; ++i) untouched &= h[i] == 0xFF;
  CHECK(untouched, "%s T 0: nothing written", name);

  /* An empty plan: all offsets 0, no tiles. */
  const size_t pb = moelink_plan_bytes(0, k, E, moelink_moe_tile_rows(gmoe));
  void *dplan = gu_dev(pb);
  gu_poison(dplan, pb);
  CHECK_OK(moelink_moe_plan(gmoe, NULL, 0, dplan, NULL), "plan of T 0");
  int32_t *hp = gu_host(pb);
  gu_d2h(hp, dplan, pb);
  moelink_plan_t p;
  moelink_plan_view(hp, 0, k, E, moelink_moe_tile_rows(gmoe), &p);
  int zeros = *p.num_tiles == 0;
  for (int e = 0; e <= E; ++e) zeros &= p.expert_offsets[e] == 0;
  CHECK(zeros, "%s T 0: plan has zero offsets and no tiles (num_tiles %d)", name, *p.num_tiles);
  free(hp);
  free(h);
  gu_free(dplan);
  gu_free(buf);
}

static void ops_config(const moelink_moe_config_t *cfg, uint64_t seed) {
  char name[200];
  gu_describe(name, sizeof name, cfg);
  const double t0 = gu_now();
  ref_layer L;
  gu_dev_layer D;
  moelink_moe_t gmoe = NULL, cmoe = NULL;
  if (gu_layer_setup(name, cfg, seed, 0.0, g_gpu, g_cpu, &L, &D, &gmoe, &cmoe) != 0)
    return;
  zero_tokens(gmoe, cfg, name);
  const int Ts[] = {1, 7, 4097};
  for (int i = 0; i < 3; ++i) ops_case(&L, gmoe, cmoe, Ts[i], name);
  moelink_moe_destroy(gmoe);
  moelink_moe_destroy(cmoe);
  gu_dev_layer_free(&D);
  ref_layer_free(&L);
  ml_t_diag("%s: %.1f s", name, gu_now() - t0);
}

int main(void) {
  gu_contexts(&g_gpu, &g_cpu);
  test_limits();
  test_fill();
  test_large_plans();

  moelink_moe_config_t c;
  /* Mixtral-like, small. */
  c = small_cfg();
  c.hidden = 128;
  c.inter = 64;
  c.max_tokens = 4097;
  ops_config(&c, 101);
  /* k = 1, E = 6, sigmoid without renormalization, f16, H = 200 (a partial
   * last 64-wide chunk in the router). */
  c = small_cfg();
  c.hidden = 200;
  c.inter = 40;
  c.num_experts = 6;
  c.top_k = 1;
  c.router = MOELINK_ROUTER_SIGMOID_TOPK;
  c.renormalize = 0;
  c.dtype = MOELINK_DTYPE_F16;
  c.max_tokens = 4097;
  ops_config(&c, 102);
  /* k = E = 12, top-k then softmax. */
  c = small_cfg();
  c.hidden = 96;
  c.inter = 56;
  c.num_experts = 12;
  c.top_k = 12;
  c.router = MOELINK_ROUTER_TOPK_SOFTMAX;
  c.renormalize = 0;
  c.max_tokens = 4097;
  ops_config(&c, 103);
  /* E = 60, no renormalization, shared expert with a gate, f16; H = 1024
   * makes small batches split the router's hidden dimension. */
  c = small_cfg();
  c.hidden = 1024;
  c.inter = 128;
  c.num_experts = 60;
  c.top_k = 4;
  c.renormalize = 0;
  c.shared_inter = 64;
  c.shared_gate = 1;
  c.dtype = MOELINK_DTYPE_F16;
  c.max_tokens = 4097;
  ops_config(&c, 104);
  /* DeepSeek-like: sigmoid, bias, 8 groups keep 4, scaling, shared expert. */
  c = small_cfg();
  c.hidden = 512;
  c.inter = 64;
  c.num_experts = 256;
  c.top_k = 8;
  c.router = MOELINK_ROUTER_SIGMOID_TOPK;
  c.n_group = 8;
  c.topk_group = 4;
  c.routed_scaling = 2.5f;
  c.correction_bias = 1;
  c.shared_inter = 128;
  c.max_tokens = 4097;
  ops_config(&c, 105);
  /* The limits: 512 experts, k = 16, softmax with groups and a bias. */
  c = small_cfg();
  c.hidden = 64;
  c.inter = 32;
  c.num_experts = 512;
  c.top_k = 16;
  c.n_group = 16;
  c.topk_group = 4;
  c.correction_bias = 1;
  c.max_tokens = 4097;
  ops_config(&c, 106);

  moelink_context_destroy(g_gpu);
  moelink_context_destroy(g_cpu);
  return ml_test_done();
}
