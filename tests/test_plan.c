/* Plan invariants: permutation, inverse, offsets, tile schedule, buffer
 * layout, on random ids with empty slots and out-of-range ids. */
#include "harness.h"
#include "moelink.h"

#include <stdint.h>

static moelink_context_t ctx;

static uint64_t rng_state;
static uint32_t rng_next(void) { return ml_t_rand(&rng_state); }

enum { ID_UNIFORM, ID_HOLES, ID_ONE_EXPERT, ID_SKEWED, ID_ALL_EMPTY };

static const char *mode_name(int mode) {
  switch (mode) {
  case ID_UNIFORM: return "uniform";
  case ID_HOLES: return "with empty/out-of-range slots";
  case ID_ONE_EXPERT: return "all on one expert";
  case ID_SKEWED: return "skewed";
  case ID_ALL_EMPTY: return "all slots empty";
  }
  return "?";
}

static void make_ids(int32_t *ids, int T, int k, int E, int mode) {
  static const int32_t invalid[] = {-1, -1, -1, -7, 0x7fffffff, (int32_t)0x80000000};
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      int32_t v;
      uint32_t r = rng_next();
      switch (mode) {
      case ID_HOLES:
        if (r % 8 == 0)
          v = invalid[(r >> 8) % 6];
        else if (r % 8 == 1)
          v = E + (int32_t)((r >> 8) % 5); /* E .. E+4: out of range */
        else
          v = (int32_t)((r >> 8) % (uint32_t)E);
        break;
      case ID_ONE_EXPERT: v = E / 2; break;
      case ID_SKEWED: {
        /* Roughly geometric over experts: most on the first few. */
        int e = 0;
        while (e + 1 < E && (r & 1u)) {
          r >>= 1;
          ++e;
        }
        v = e;
        break;
      }
      case ID_ALL_EMPTY: v = -1; break;
      default: v = (int32_t)(r % (uint32_t)E); break;
      }
      ids[(size_t)t * k + j] = v;
    }
}

/* Checks every documented invariant of a plan; returns the number of
 * violations and describes the first. */
static int check_plan(const moelink_plan_t *p, const int32_t *ids, int T, int k, int E, int tr,
                      char *why, size_t why_len) {
  const size_t P = (size_t)T * (size_t)k;
  int bad = 0;
#define FAIL(...)                                                              \
  do {                                                                         \
    if (bad++ == 0) snprintf(why, why_len, __VA_ARGS__);                       \
  } while (0)
  int32_t *count = calloc((size_t)E + 1, sizeof(int32_t));
  char *seen = calloc(P + 1, 1);
  size_t valid = 0;
  for (size_t q = 0; q < P; ++q)
    if (ids[q] >= 0 && ids[q] < E) {
      ++count[ids[q]];
      ++valid;
    }
  /* Offsets: prefix sums of per-expert counts. */
  if (p->expert_offsets[0] != 0) FAIL("offsets[0] = %d", p->expert_offsets[0]);
  for (int e = 0; e < E; ++e)
    if (p->expert_offsets[e + 1] - p->expert_offsets[e] != count[e])
      FAIL("expert %d has %d rows, %d pairs", e, p->expert_offsets[e + 1] - p->expert_offsets[e],
           count[e]);
  if ((size_t)p->expert_offsets[E] != valid)
    FAIL("offsets[E] = %d, valid pairs %zu", p->expert_offsets[E], valid);
  if (bad) goto out;
  /* Rows: each holds a valid pair of its expert, ascending within the expert. */
  for (int e = 0; e < E; ++e)
    for (int32_t r = p->expert_offsets[e]; r < p->expert_offsets[e + 1]; ++r) {
      int32_t q = p->sorted_pairs[r];
      if (q < 0 || (size_t)q >= P) {
        FAIL("row %d holds pair %d (out of range)", r, q);
        continue;
      }
      if (ids[q] != e) FAIL("row %d of expert %d holds pair %d of expert %d", r, e, q, ids[q]);
      if (seen[q]++) FAIL("pair %d appears twice", q);
      if (p->pair_rows[q] != r) FAIL("pair_rows[%d] = %d, but row %d holds it", q, p->pair_rows[q], r);
      if (r > p->expert_offsets[e] && p->sorted_pairs[r - 1] >= q)
        FAIL("expert %d: pairs do not ascend at row %d (%d then %d)", e, r, p->sorted_pairs[r - 1],
             q);
    }
  for (size_t q = 0; q < P; ++q) {
    int valid_q = ids[q] >= 0 && ids[q] < E;
    if (valid_q && !seen[q]) FAIL("valid pair %zu (expert %d) has no row", q, ids[q]);
    if (!valid_q && p->pair_rows[q] != -1)
      FAIL("empty pair %zu (id %d) has pair_rows %d, not -1", q, ids[q], p->pair_rows[q]);
  }
  /* Tiles: in row order, contiguous, each 1..tile_rows rows of one expert. */
  {
    int32_t nt = p->num_tiles[0];
    if (nt < 0 || nt > p->max_tiles) {
      FAIL("num_tiles %d outside [0, %d]", nt, p->max_tiles);
      goto out;
    }
    int32_t next_row = 0, prev_e = -1;
    for (int32_t i = 0; i < nt; ++i) {
      int32_t e = p->tiles[3 * i], first = p->tiles[3 * i + 1], rows = p->tiles[3 * i + 2];
      if (e < 0 || e >= E) {
        FAIL("tile %d: expert %d", i, e);
        break;
      }
      if (rows < 1 || rows > tr) FAIL("tile %d: %d rows (tile_rows %d)", i, rows, tr);
      if (first != next_row) FAIL("tile %d starts at row %d, expected %d", i, first, next_row);
      if (first < p->expert_offsets[e] || first + rows > p->expert_offsets[e + 1])
        FAIL("tile %d rows [%d, %d) outside expert %d's [%d, %d)", i, first, first + rows, e,
             p->expert_offsets[e], p->expert_offsets[e + 1]);
      if (e < prev_e) FAIL("tile %d: expert %d after expert %d", i, e, prev_e);
      prev_e = e;
      next_row = first + rows;
    }
    if (!bad && next_row != p->expert_offsets[E])
      FAIL("tiles end at row %d, rows end at %d", next_row, p->expert_offsets[E]);
  }
out:
  free(count);
  free(seen);
#undef FAIL
  return bad;
}

static void run_plan_case(int E, int k, int T, int mode) {
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = 8;
  cfg.inter = 4;
  cfg.num_experts = E;
  cfg.top_k = k;
  cfg.dtype = MOELINK_DTYPE_F32;
  cfg.max_tokens = T > 0 ? T : 1;
  moelink_moe_t m = NULL;
  if (moelink_moe_create(ctx, &cfg, &m) != MOELINK_SUCCESS) {
    CHECK(0, "E %d k %d T %d: create: %s", E, k, T, moelink_last_error());
    return;
  }
  const int tr = moelink_moe_tile_rows(m);
  const size_t bytes = moelink_plan_bytes(T, k, E, tr);
  const size_t guard = 64;
  int32_t *ids = malloc(sizeof(int32_t) * ((size_t)T * k + 1));
  unsigned char *buf = malloc(bytes + guard);
  make_ids(ids, T, k, E, mode);
  memset(buf, 0xA5, bytes + guard); /* garbage the plan must overwrite */
  moelink_plan_t p;
  moelink_status_t s = moelink_moe_plan(m, ids, T, buf, NULL);
  CHECK(s == MOELINK_SUCCESS, "E %d k %d T %d %s: plan (%s)", E, k, T, mode_name(mode),
        s ? moelink_last_error() : "");
  if (s == MOELINK_SUCCESS && moelink_plan_view(buf, T, k, E, tr, &p) == MOELINK_SUCCESS) {
    char why[256] = "";
    int bad = check_plan(&p, ids, T, k, E, tr, why, sizeof why);
    CHECK(bad == 0, "E %d k %d T %d %s: plan invariants hold (%d violations%s%s)", E, k, T,
          mode_name(mode), bad, bad ? ": " : "", why);
    int guard_ok = 1;
    for (size_t i = 0; i < guard; ++i)
      if (buf[bytes + i] != 0xA5) guard_ok = 0;
    CHECK(guard_ok, "E %d k %d T %d: nothing written past plan_bytes", E, k, T);
  }
  free(ids);
  free(buf);
  moelink_moe_destroy(m);
}

static void test_layout(void) {
  const int sizes[][4] = {{0, 1, 1, 64}, {1, 1, 1, 1}, {7, 2, 8, 64}, {4097, 8, 256, 64},
                          {100, 3, 60, 16}, {5, 5, 5, 3}};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
    const int T = sizes[i][0], k = sizes[i][1], E = sizes[i][2], tr = sizes[i][3];
    const size_t P = (size_t)T * k;
    const size_t max_tiles = (P + (size_t)tr - 1) / (size_t)tr + (size_t)E;
    const size_t want = 4 * ((size_t)E + 1 + 2 * P + 3 * max_tiles + 1);
    const size_t bytes = moelink_plan_bytes(T, k, E, tr);
    CHECK(bytes == want, "plan_bytes(T %d, k %d, E %d, tile %d) = %zu (arrays need %zu)", T, k,
          E, tr, bytes, want);
    unsigned char *buf = malloc(bytes + 16);
    memset(buf, 0x5A, bytes + 16);
    moelink_plan_t p;
    memset(&p, 0, sizeof p);
    CHECK_OK(moelink_plan_view(buf, T, k, E, tr, &p), "plan_view");
    int untouched = 1;
    for (size_t b = 0; b < bytes + 16; ++b)
      if (buf[b] != 0x5A) untouched = 0;
    CHECK(untouched, "plan_view touches no memory");
    const int32_t *base = (const int32_t *)buf;
    const int32_t *end = (const int32_t *)(buf + bytes);
    CHECK(p.num_tokens == T && p.top_k == k && p.num_experts == E && p.tile_rows == tr &&
              (size_t)p.max_tiles == max_tiles,
          "plan_view sizes (max_tiles %d, want %zu)", p.max_tiles, max_tiles);
    /* The arrays are disjoint, in bounds, and together fill the buffer. */
    struct {
      const int32_t *a;
      size_t n;
    } arr[5] = {{p.expert_offsets, (size_t)E + 1},
                {p.sorted_pairs, P},
                {p.pair_rows, P},
                {p.tiles, 3 * max_tiles},
                {p.num_tiles, 1}};
    int inside = 1, disjoint = 1;
    size_t total = 0;
    for (int a = 0; a < 5; ++a) {
      if (arr[a].a < base || arr[a].a + arr[a].n > end) inside = 0;
      total += arr[a].n;
      for (int b = a + 1; b < 5; ++b)
        if (arr[a].n && arr[b].n && arr[a].a < arr[b].a + arr[b].n && arr[b].a < arr[a].a + arr[a].n)
          disjoint = 0;
    }
    CHECK(inside && disjoint && total * 4 == bytes,
          "T %d k %d E %d: plan arrays are in bounds, disjoint, and fill the buffer", T, k, E);
    free(buf);
  }
}

static void test_t0(void) {
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = 8;
  cfg.inter = 4;
  cfg.num_experts = 6;
  cfg.top_k = 2;
  cfg.dtype = MOELINK_DTYPE_F32;
  cfg.max_tokens = 4;
  moelink_moe_t m = NULL;
  if (moelink_moe_create(ctx, &cfg, &m) != MOELINK_SUCCESS) {
    CHECK(0, "T=0 layer: %s", moelink_last_error());
    return;
  }
  const int tr = moelink_moe_tile_rows(m);
  size_t bytes = moelink_plan_bytes(0, 2, 6, tr);
  int32_t *buf = malloc(bytes);
  memset(buf, 0x7f, bytes);
  CHECK_OK(moelink_moe_plan(m, NULL, 0, buf, NULL), "plan of 0 tokens (ids may be NULL)");
  moelink_plan_t p;
  if (moelink_plan_view(buf, 0, 2, 6, tr, &p) == MOELINK_SUCCESS) {
    int zero = 1;
    for (int e = 0; e <= 6; ++e)
      if (p.expert_offsets[e] != 0) zero = 0;
    CHECK(zero, "T=0: all offsets are 0");
    CHECK(p.num_tiles[0] == 0, "T=0: no tiles (%d)", p.num_tiles[0]);
  }
  free(buf);
  moelink_moe_destroy(m);
}

int main(void) {
  if (moelink_context_create(NULL, &ctx) != MOELINK_SUCCESS) {
    CHECK(0, "CPU context: %s", moelink_last_error());
    return ml_test_done();
  }
  rng_state = 0x9e3779b97f4a7c15ull;
  test_layout();
  test_t0();
  const int cases[][3] = {/* E, k, T */
                          {1, 1, 1},    {1, 1, 200},  {5, 2, 7},    {8, 2, 1},  {8, 2, 333},
                          {6, 6, 50},   {60, 4, 97},  {128, 8, 1},  {256, 8, 7}, {256, 8, 1000},
                          {12, 3, 4097}, {3, 2, 129}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c)
    for (int mode = ID_UNIFORM; mode <= ID_ALL_EMPTY; ++mode)
      run_plan_case(cases[c][0], cases[c][1], cases[c][2], mode);
  moelink_context_destroy(ctx);
  return ml_test_done();
}
