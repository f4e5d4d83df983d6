/* Presets, config validation and every argument check of the public API:
 * the right status and a message that names the problem. */
#include "harness.h"
#include "moelink.h"

#include <ctype.h>
#include <stdint.h>

/* Case-insensitive substring search: messages must name the field, the
 * capitalization is theirs. */
static int has_word(const char *msg, const char *word) {
  if (!msg || !word) return 0;
  size_t n = strlen(word);
  for (const char *p = msg; *p; ++p) {
    size_t i = 0;
    while (i < n && p[i] && tolower((unsigned char)p[i]) == tolower((unsigned char)word[i])) ++i;
    if (i == n) return 1;
  }
  return 0;
}

/* A call that must fail with `want` and a message containing `word`. */
#define EXPECT_FAIL(call, want, word, what)                                    \
  do {                                                                         \
    moelink_status_t s_ = (call);                                              \
    const char *m_ = moelink_last_error();                                     \
    CHECK(s_ == (want) && m_[0] != 0 && has_word(m_, (word)),                  \
          "%s -> %s, message names '%s' ('%s')", (what), moelink_status_string(s_), (word), \
          m_);                                                                 \
  } while (0)

/* ---- presets ------------------------------------------------------------- */

typedef struct {
  const char *name;
  int H, I, E, k;
  moelink_router_t router;
  int renormalize, n_group, topk_group;
  float scaling;
  int bias, shared_inter, shared_gate;
} preset_want;

/* DESIGN.md section 2, checked against each model's published config:
 * Mixtral 8x7B/8x22B: 8 experts, 2 per token, softmax then top-k, weights
 * renormalized. Qwen2-57B-A14B: 64 experts, 8 per token, no renormalization
 * (norm_topk_prob false), shared expert of 20480 gated by a sigmoid. Qwen3:
 * 128 experts, 8 per token, renormalized, no shared expert. DeepSeek-V3: 256
 * experts, 8 per token, sigmoid scores with a correction bias, 8 groups of
 * which 4 are kept, renormalized, scaled by 2.5, one shared expert of 2048
 * (not gated). */
static const preset_want presets[] = {
    {"mixtral-8x7b", 4096, 14336, 8, 2, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"mixtral-8x22b", 6144, 16384, 8, 2, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"qwen2-57b-a14b", 3584, 2560, 64, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 0, 1, 1, 1.0f, 0, 20480, 1},
    {"qwen3-30b-a3b", 2048, 768, 128, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"qwen3-235b-a22b", 4096, 1536, 128, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"deepseek-v3", 7168, 2048, 256, 8, MOELINK_ROUTER_SIGMOID_TOPK, 1, 8, 4, 2.5f, 1, 2048, 0},
};
#define NPRESETS ((int)(sizeof presets / sizeof presets[0]))

static void test_presets(void) {
  CHECK(moelink_preset_count() == NPRESETS, "%d presets (got %d)", NPRESETS,
        moelink_preset_count());
  CHECK(moelink_preset_name(-1) == NULL, "preset_name(-1) is NULL");
  CHECK(moelink_preset_name(moelink_preset_count()) == NULL, "preset_name(count) is NULL");
  for (int i = 0; i < moelink_preset_count(); ++i) {
    const char *n = moelink_preset_name(i);
    int known = 0;
    for (int j = 0; j < NPRESETS; ++j)
      if (n && strcmp(n, presets[j].name) == 0) known = 1;
    CHECK(known, "preset %d '%s' is one of the documented presets", i, n ? n : "(null)");
  }
  for (int j = 0; j < NPRESETS; ++j) {
    const preset_want *p = &presets[j];
    int listed = 0;
    for (int i = 0; i < moelink_preset_count(); ++i)
      if (moelink_preset_name(i) && strcmp(moelink_preset_name(i), p->name) == 0) listed = 1;
    CHECK(listed, "preset %s is listed by preset_name", p->name);

    moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
    c.dtype = MOELINK_DTYPE_F16;
    c.max_tokens = 77;
    CHECK_OK(moelink_moe_preset(p->name, &c), p->name);
    CHECK(c.hidden == p->H && c.inter == p->I && c.num_experts == p->E && c.top_k == p->k,
          "%s: H %d I %d E %d k %d (want %d %d %d %d)", p->name, c.hidden, c.inter,
          c.num_experts, c.top_k, p->H, p->I, p->E, p->k);
    CHECK(c.router == p->router && c.renormalize == p->renormalize,
          "%s: router %d renormalize %d (want %d %d)", p->name, (int)c.router, c.renormalize,
          (int)p->router, p->renormalize);
    CHECK(c.n_group == p->n_group && c.topk_group == p->topk_group,
          "%s: n_group %d topk_group %d (want %d %d)", p->name, c.n_group, c.topk_group,
          p->n_group, p->topk_group);
    CHECK(c.routed_scaling == p->scaling && c.correction_bias == p->bias,
          "%s: routed_scaling %g correction_bias %d (want %g %d)", p->name,
          (double)c.routed_scaling, c.correction_bias, (double)p->scaling, p->bias);
    CHECK(c.shared_inter == p->shared_inter && c.shared_gate == p->shared_gate,
          "%s: shared_inter %d shared_gate %d (want %d %d)", p->name, c.shared_inter,
          c.shared_gate, p->shared_inter, p->shared_gate);
    CHECK(c.size == sizeof(moelink_moe_config_t) && c.dtype == MOELINK_DTYPE_F16 &&
              c.max_tokens == 77,
          "%s: size, dtype and max_tokens left alone", p->name);
    CHECK_OK(moelink_moe_config_check(&c), "config_check accepts the preset");
    c.dtype = MOELINK_DTYPE_BF16;
    CHECK_OK(moelink_moe_config_check(&c), "config_check accepts the preset in bf16");
  }
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  moelink_moe_config_t before = c;
  EXPECT_FAIL(moelink_moe_preset("mixtral-8x7", &c), MOELINK_ERR_NOT_FOUND, "mixtral-8x7",
              "unknown preset");
  CHECK(memcmp(&c, &before, sizeof c) == 0, "an unknown preset leaves the config alone");
  EXPECT_FAIL(moelink_moe_preset("", &c), MOELINK_ERR_NOT_FOUND, "preset", "empty preset name");
  EXPECT_FAIL(moelink_moe_preset(NULL, &c), MOELINK_ERR_INVALID_ARGUMENT, "name",
              "preset(NULL name)");
  EXPECT_FAIL(moelink_moe_preset("deepseek-v3", NULL), MOELINK_ERR_INVALID_ARGUMENT, "config",
              "preset(NULL cfg)");
}

/* ---- config validation --------------------------------------------------- */

static moelink_moe_config_t small_cfg(void) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  c.hidden = 16;
  c.inter = 8;
  c.num_experts = 8;
  c.top_k = 2;
  c.dtype = MOELINK_DTYPE_F32;
  c.max_tokens = 8;
  return c;
}

static void test_config_check(void) {
  moelink_moe_config_t c = small_cfg();
  CHECK_OK(moelink_moe_config_check(&c), "small config is valid");
  EXPECT_FAIL(moelink_moe_config_check(NULL), MOELINK_ERR_INVALID_ARGUMENT, "config",
              "config_check(NULL)");

  struct {
    const char *what, *word;
    moelink_status_t want;
    moelink_moe_config_t c;
  } bad[40];
  int n = 0;
#define BAD(WHAT, WORD, WANT, STMT)                                            \
  do {                                                                         \
    bad[n].what = (WHAT);                                                      \
    bad[n].word = (WORD);                                                      \
    bad[n].want = (WANT);                                                      \
    bad[n].c = small_cfg();                                                    \
    moelink_moe_config_t *p = &bad[n].c;                                       \
    STMT;                                                                      \
    ++n;                                                                       \
  } while (0)
  const moelink_status_t IA = MOELINK_ERR_INVALID_ARGUMENT;
  BAD("size 0", "size", IA, p->size = 0);
  BAD("size too small", "size", IA, p->size = sizeof(moelink_moe_config_t) - 4);
  BAD("hidden 0", "hidden", IA, p->hidden = 0);
  BAD("hidden -5", "hidden", IA, p->hidden = -5);
  BAD("inter 0", "inter", IA, p->inter = 0);
  BAD("inter -1", "inter", IA, p->inter = -1);
  BAD("num_experts 0", "num_experts", IA, p->num_experts = 0);
  BAD("num_experts -3", "num_experts", IA, p->num_experts = -3);
  BAD("top_k 0", "top_k", IA, p->top_k = 0);
  BAD("top_k -1", "top_k", IA, p->top_k = -1);
  BAD("top_k 9 > E 8", "top_k", IA, p->top_k = 9);
  BAD("max_tokens 0", "max_tokens", IA, p->max_tokens = 0);
  BAD("max_tokens -2", "max_tokens", IA, p->max_tokens = -2);
  BAD("n_group 3 does not divide 8", "n_group", IA, (p->n_group = 3, p->topk_group = 1));
  BAD("n_group 0", "n_group", IA, p->n_group = 0);
  BAD("topk_group 5 > n_group 4", "topk_group", IA, (p->n_group = 4, p->topk_group = 5));
  BAD("topk_group 0", "topk_group", IA, (p->n_group = 4, p->topk_group = 0));
  BAD("top_k beyond the kept groups", "top_k", IA,
      (p->n_group = 4, p->topk_group = 1, p->top_k = 3));
  BAD("shared_gate without shared expert", "shared", IA, (p->shared_gate = 1, p->shared_inter = 0));
  BAD("shared_inter -4", "shared_inter", IA, p->shared_inter = -4);
  BAD("router 7", "router", IA, p->router = (moelink_router_t)7);
  BAD("renormalize 2", "renormalize", IA, p->renormalize = 2);
  BAD("routed_scaling 0", "routed_scaling", IA, p->routed_scaling = 0.0f);
  BAD("routed_scaling -1", "routed_scaling", IA, p->routed_scaling = -1.0f);
  BAD("routed_scaling NaN", "routed_scaling", IA, p->routed_scaling = NAN);
  BAD("dtype 9", "dtype", IA, p->dtype = (moelink_dtype_t)9);
  BAD("dtype fp8", "fp8", MOELINK_ERR_UNSUPPORTED, p->dtype = MOELINK_DTYPE_FP8_E4M3);
#undef BAD
  for (int i = 0; i < n; ++i) {
    EXPECT_FAIL(moelink_moe_config_check(&bad[i].c), bad[i].want, bad[i].word, bad[i].what);
  }

  /* Boundaries that are fine. */
  c = small_cfg();
  c.top_k = c.num_experts;
  CHECK_OK(moelink_moe_config_check(&c), "top_k == num_experts is valid");
  c = small_cfg();
  c.n_group = 4;
  c.topk_group = 4;
  CHECK_OK(moelink_moe_config_check(&c), "topk_group == n_group is valid");
  c = small_cfg();
  c.num_experts = 6;
  c.top_k = 1;
  CHECK_OK(moelink_moe_config_check(&c), "E = 6, k = 1 is valid");
  c = small_cfg();
  c.shared_inter = 24;
  c.shared_gate = 1;
  CHECK_OK(moelink_moe_config_check(&c), "gated shared expert is valid");

  /* create must apply the same checks. */
  moelink_context_t ctx = NULL;
  CHECK_OK(moelink_context_create(NULL, &ctx), "context");
  c = small_cfg();
  c.top_k = 9;
  moelink_moe_t m = NULL;
  EXPECT_FAIL(moelink_moe_create(ctx, &c, &m), MOELINK_ERR_INVALID_ARGUMENT, "top_k",
              "create with top_k > E");
  CHECK(m == NULL, "failed create leaves no handle");
  c = small_cfg();
  c.dtype = MOELINK_DTYPE_FP8_E4M3;
  EXPECT_FAIL(moelink_moe_create(ctx, &c, &m), MOELINK_ERR_UNSUPPORTED, "fp8", "create with fp8");
  size_t bytes = 0;
  c = small_cfg();
  c.hidden = 0;
  EXPECT_FAIL(moelink_moe_workspace_size(ctx, &c, &bytes), MOELINK_ERR_INVALID_ARGUMENT, "hidden",
              "workspace_size with hidden 0");
  moelink_context_destroy(ctx);
}

/* ---- contexts -------------------------------------------------------------- */

static void test_context_args(void) {
  moelink_context_t ctx = NULL;
  EXPECT_FAIL(moelink_context_create(NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT, "out",
              "context_create(NULL out)");
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.size = 3;
  EXPECT_FAIL(moelink_context_create(&cc, &ctx), MOELINK_ERR_INVALID_ARGUMENT, "size",
              "context config with a bad size");
  cc = (moelink_context_config_t)MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = (moelink_backend_t)5;
  EXPECT_FAIL(moelink_context_create(&cc, &ctx), MOELINK_ERR_INVALID_ARGUMENT, "backend",
              "unknown backend");
  cc = (moelink_context_config_t)MOELINK_CONTEXT_CONFIG_INIT;
  cc.num_threads = -1;
  EXPECT_FAIL(moelink_context_create(&cc, &ctx), MOELINK_ERR_INVALID_ARGUMENT, "thread",
              "negative num_threads");
  if (!moelink_backend_available(MOELINK_BACKEND_CUDA)) {
    cc = (moelink_context_config_t)MOELINK_CONTEXT_CONFIG_INIT;
    cc.backend = MOELINK_BACKEND_CUDA;
    ctx = NULL;
    EXPECT_FAIL(moelink_context_create(&cc, &ctx), MOELINK_ERR_UNSUPPORTED, "cuda",
                "CUDA context where CUDA is not available");
    CHECK(ctx == NULL, "no handle for an unavailable backend");
  } else {
    ml_t_diag("CUDA is available here: the UNSUPPORTED case is not reachable");
  }
}

/* ---- layer arguments and state -------------------------------------------- */

typedef struct {
  moelink_context_t ctx;
  moelink_moe_t m;
  moelink_moe_config_t cfg;
  float *router, *gate_up, *down, *sgu, *sdown, *sgate, *bias;
  moelink_moe_weights_t w;
} layer;

static int layer_open(layer *L, moelink_moe_config_t cfg) {
  memset(L, 0, sizeof *L);
  L->cfg = cfg;
  size_t H = (size_t)cfg.hidden, I = (size_t)cfg.inter, E = (size_t)cfg.num_experts;
  size_t Is = (size_t)cfg.shared_inter;
  L->router = calloc(E * H, sizeof(float));
  L->gate_up = calloc(E * 2 * I * H, sizeof(float));
  L->down = calloc(E * H * I, sizeof(float));
  L->sgu = calloc(2 * Is * H + 1, sizeof(float));
  L->sdown = calloc(Is * H + 1, sizeof(float));
  L->sgate = calloc(H, sizeof(float));
  L->bias = calloc(E, sizeof(float));
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.dtype = cfg.dtype;
  w.router = L->router;
  w.gate_up = L->gate_up;
  w.down = L->down;
  if (cfg.correction_bias) w.correction_bias = L->bias;
  if (Is > 0) {
    w.shared_gate_up = L->sgu;
    w.shared_down = L->sdown;
  }
  if (cfg.shared_gate) w.shared_gate = L->sgate;
  L->w = w;
  if (moelink_context_create(NULL, &L->ctx) != MOELINK_SUCCESS) return -1;
  return moelink_moe_create(L->ctx, &cfg, &L->m) == MOELINK_SUCCESS ? 0 : -1;
}

static void layer_close(layer *L) {
  moelink_moe_destroy(L->m);
  moelink_context_destroy(L->ctx);
  free(L->router);
  free(L->gate_up);
  free(L->down);
  free(L->sgu);
  free(L->sdown);
  free(L->sgate);
  free(L->bias);
}

static void test_layer_args(void) {
  moelink_moe_config_t cfg = small_cfg();
  layer L;
  int ok = layer_open(&L, cfg) == 0;
  CHECK(ok, "small f32 layer created (%s)", ok ? "" : moelink_last_error());
  if (!ok) {
    layer_close(&L);
    return;
  }
  moelink_moe_t m = L.m;
  const int H = cfg.hidden, k = cfg.top_k, E = cfg.num_experts, T = 4;
  float *x = calloc((size_t)(cfg.max_tokens + 4) * H, sizeof(float));
  float *out = calloc((size_t)(cfg.max_tokens + 4) * H, sizeof(float));
  int32_t *ids = calloc((size_t)(cfg.max_tokens + 4) * k, sizeof(int32_t));
  float *wts = calloc((size_t)(cfg.max_tokens + 4) * k, sizeof(float));
  float *y = calloc((size_t)(cfg.max_tokens + 4) * k * H, sizeof(float));
  const int tr = moelink_moe_tile_rows(m);
  CHECK(tr == 64, "CPU tile rows are 64 (got %d)", tr);
  size_t pb = moelink_plan_bytes(cfg.max_tokens + 4, k, E, tr > 0 ? tr : 1);
  int32_t *plan = calloc(pb / 4 + 2, sizeof(int32_t));
  CHECK(moelink_moe_tile_rows(NULL) <= 0, "tile_rows(NULL) is not a tile size");

  /* Before set_weights. */
  EXPECT_FAIL(moelink_moe_forward(m, x, T, out, NULL), MOELINK_ERR_INVALID_STATE, "weights",
              "forward before set_weights");
  EXPECT_FAIL(moelink_moe_route(m, x, T, ids, wts, NULL), MOELINK_ERR_INVALID_STATE, "weights",
              "route before set_weights");
  for (int t = 0; t < T * k; ++t) ids[t] = t % E;
  CHECK_OK(moelink_moe_plan(m, ids, T, plan, NULL), "plan needs no weights");
  EXPECT_FAIL(moelink_moe_experts(m, x, T, plan, wts, y, NULL), MOELINK_ERR_INVALID_STATE,
              "weights", "experts before set_weights");

  /* set_weights. */
  EXPECT_FAIL(moelink_moe_set_weights(NULL, &L.w), MOELINK_ERR_INVALID_ARGUMENT, "layer",
              "set_weights(NULL layer)");
  EXPECT_FAIL(moelink_moe_set_weights(m, NULL), MOELINK_ERR_INVALID_ARGUMENT, "weights",
              "set_weights(NULL weights)");
  moelink_moe_weights_t w = L.w;
  w.size = 8;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT, "size",
              "weights with a bad size");
  w = L.w;
  w.dtype = MOELINK_DTYPE_BF16;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_DTYPE_MISMATCH, "dtype",
              "bf16 weights on an f32 layer");
  w = L.w;
  w.router = NULL;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT, "router",
              "NULL router");
  w = L.w;
  w.gate_up = NULL;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT, "gate_up",
              "NULL gate_up");
  w = L.w;
  w.down = NULL;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT, "down", "NULL down");
  w = L.w;
  w.correction_bias = L.bias;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT, "correction_bias",
              "bias given to a layer without correction_bias");
  w = L.w;
  w.shared_gate_up = L.sgu;
  w.shared_down = L.sdown;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT, "shared",
              "shared weights given to a layer without a shared expert");
  w = L.w;
  w.shared_gate = L.sgate;
  EXPECT_FAIL(moelink_moe_set_weights(m, &w), MOELINK_ERR_INVALID_ARGUMENT, "shared_gate",
              "shared gate given to a layer without one");
  EXPECT_FAIL(moelink_moe_forward(m, x, T, out, NULL), MOELINK_ERR_INVALID_STATE, "weights",
              "rejected weights leave the layer without weights");
  CHECK_OK(moelink_moe_set_weights(m, &L.w), "set_weights");

  /* get_config. */
  moelink_moe_config_t got;
  memset(&got, 0, sizeof got);
  CHECK_OK(moelink_moe_get_config(m, &got), "get_config");
  CHECK(memcmp(&got, &cfg, sizeof got) == 0, "get_config returns the create config");
  EXPECT_FAIL(moelink_moe_get_config(NULL, &got), MOELINK_ERR_INVALID_ARGUMENT, "layer",
              "get_config(NULL layer)");
  EXPECT_FAIL(moelink_moe_get_config(m, NULL), MOELINK_ERR_INVALID_ARGUMENT, "cfg",
              "get_config(NULL cfg)");

  /* forward. */
  CHECK_OK(moelink_moe_forward(m, x, T, out, NULL), "forward");
  EXPECT_FAIL(moelink_moe_forward(NULL, x, T, out, NULL), MOELINK_ERR_INVALID_ARGUMENT, "layer",
              "forward(NULL layer)");
  EXPECT_FAIL(moelink_moe_forward(m, NULL, T, out, NULL), MOELINK_ERR_INVALID_ARGUMENT, "x",
              "forward(NULL x)");
  EXPECT_FAIL(moelink_moe_forward(m, x, T, NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT, "out",
              "forward(NULL out)");
  EXPECT_FAIL(moelink_moe_forward(m, x, -1, out, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "num_tokens", "forward with -1 tokens");
  EXPECT_FAIL(moelink_moe_forward(m, x, T, x, NULL), MOELINK_ERR_INVALID_ARGUMENT, "overlap",
              "forward with out == x");
  EXPECT_FAIL(moelink_moe_forward(m, x, T, x + H * 2, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "overlap", "forward with out overlapping the tail of x");
  EXPECT_FAIL(moelink_moe_forward(m, x + 1, T, x, NULL), MOELINK_ERR_INVALID_ARGUMENT, "overlap",
              "forward with x one element past out");
  CHECK_OK(moelink_moe_forward(m, x, T, x + (size_t)H * T, NULL),
           "forward with out right after x (adjacent, no overlap)");
  CHECK_OK(moelink_moe_forward(m, x, 0, out, NULL), "forward with 0 tokens");
  CHECK_OK(moelink_moe_forward(m, x, cfg.max_tokens + 3, out, NULL),
           "forward with more tokens than max_tokens (chunked)");

  /* route. */
  CHECK_OK(moelink_moe_route(m, x, T, ids, wts, NULL), "route");
  EXPECT_FAIL(moelink_moe_route(NULL, x, T, ids, wts, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "layer", "route(NULL layer)");
  EXPECT_FAIL(moelink_moe_route(m, NULL, T, ids, wts, NULL), MOELINK_ERR_INVALID_ARGUMENT, "x",
              "route(NULL x)");
  EXPECT_FAIL(moelink_moe_route(m, x, T, NULL, wts, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "topk_ids", "route(NULL ids)");
  EXPECT_FAIL(moelink_moe_route(m, x, T, ids, NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "topk_weights", "route(NULL weights)");
  EXPECT_FAIL(moelink_moe_route(m, x, -2, ids, wts, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "num_tokens", "route with -2 tokens");
  EXPECT_FAIL(moelink_moe_route(m, x, cfg.max_tokens + 1, ids, wts, NULL),
              MOELINK_ERR_INVALID_ARGUMENT, "max_tokens", "route with T > max_tokens");
  CHECK_OK(moelink_moe_route(m, x, 0, ids, wts, NULL), "route with 0 tokens");

  /* plan. */
  for (int t = 0; t < T * k; ++t) ids[t] = t % E;
  CHECK_OK(moelink_moe_plan(m, ids, T, plan, NULL), "plan");
  EXPECT_FAIL(moelink_moe_plan(NULL, ids, T, plan, NULL), MOELINK_ERR_INVALID_ARGUMENT, "layer",
              "plan(NULL layer)");
  EXPECT_FAIL(moelink_moe_plan(m, NULL, T, plan, NULL), MOELINK_ERR_INVALID_ARGUMENT, "topk_ids",
              "plan(NULL ids)");
  EXPECT_FAIL(moelink_moe_plan(m, ids, T, NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT, "plan",
              "plan(NULL buffer)");
  EXPECT_FAIL(moelink_moe_plan(m, ids, T, (char *)plan + 2, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "align", "plan with a misaligned buffer");
  EXPECT_FAIL(moelink_moe_plan(m, ids, -1, plan, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "num_tokens", "plan with -1 tokens");
  EXPECT_FAIL(moelink_moe_plan(m, ids, cfg.max_tokens + 1, plan, NULL),
              MOELINK_ERR_INVALID_ARGUMENT, "max_tokens", "plan with T > max_tokens");

  /* plan_view. */
  moelink_plan_t pv;
  CHECK_OK(moelink_plan_view(plan, T, k, E, tr, &pv), "plan_view");
  EXPECT_FAIL(moelink_plan_view(NULL, T, k, E, tr, &pv), MOELINK_ERR_INVALID_ARGUMENT, "buffer",
              "plan_view(NULL buffer)");
  EXPECT_FAIL(moelink_plan_view(plan, T, k, E, tr, NULL), MOELINK_ERR_INVALID_ARGUMENT, "plan",
              "plan_view(NULL plan)");
  EXPECT_FAIL(moelink_plan_view((char *)plan + 1, T, k, E, tr, &pv),
              MOELINK_ERR_INVALID_ARGUMENT, "align", "plan_view of a misaligned buffer");
  EXPECT_FAIL(moelink_plan_view(plan, -1, k, E, tr, &pv), MOELINK_ERR_INVALID_ARGUMENT, "-1",
              "plan_view with -1 tokens");
  EXPECT_FAIL(moelink_plan_view(plan, T, 0, E, tr, &pv), MOELINK_ERR_INVALID_ARGUMENT, "k 0",
              "plan_view with k 0");
  EXPECT_FAIL(moelink_plan_view(plan, T, k, 0, tr, &pv), MOELINK_ERR_INVALID_ARGUMENT, "E 0",
              "plan_view with 0 experts");
  EXPECT_FAIL(moelink_plan_view(plan, T, k, E, 0, &pv), MOELINK_ERR_INVALID_ARGUMENT,
              "tile_rows", "plan_view with tile_rows 0");

  /* experts. */
  CHECK_OK(moelink_moe_plan(m, ids, T, plan, NULL), "plan again");
  CHECK_OK(moelink_moe_experts(m, x, T, plan, wts, y, NULL), "experts");
  CHECK_OK(moelink_moe_experts(m, x, T, plan, NULL, y, NULL), "experts without weights (NULL)");
  EXPECT_FAIL(moelink_moe_experts(NULL, x, T, plan, wts, y, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "layer", "experts(NULL layer)");
  EXPECT_FAIL(moelink_moe_experts(m, NULL, T, plan, wts, y, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "x", "experts(NULL x)");
  EXPECT_FAIL(moelink_moe_experts(m, x, T, NULL, wts, y, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "plan", "experts(NULL plan)");
  EXPECT_FAIL(moelink_moe_experts(m, x, T, plan, wts, NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "y", "experts(NULL y)");
  EXPECT_FAIL(moelink_moe_experts(m, x, -3, plan, wts, y, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "num_tokens", "experts with -3 tokens");
  EXPECT_FAIL(moelink_moe_experts(m, x, cfg.max_tokens + 1, plan, wts, y, NULL),
              MOELINK_ERR_INVALID_ARGUMENT, "max_tokens", "experts with T > max_tokens");

  /* combine. */
  CHECK_OK(moelink_moe_combine(m, y, T, plan, out, NULL), "combine");
  EXPECT_FAIL(moelink_moe_combine(NULL, y, T, plan, out, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "layer", "combine(NULL layer)");
  EXPECT_FAIL(moelink_moe_combine(m, NULL, T, plan, out, NULL), MOELINK_ERR_INVALID_ARGUMENT, "y",
              "combine(NULL y)");
  EXPECT_FAIL(moelink_moe_combine(m, y, T, NULL, out, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "plan", "combine(NULL plan)");
  EXPECT_FAIL(moelink_moe_combine(m, y, T, plan, NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "out", "combine(NULL out)");
  EXPECT_FAIL(moelink_moe_combine(m, y, -1, plan, out, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "num_tokens", "combine with -1 tokens");
  EXPECT_FAIL(moelink_moe_combine(m, y, cfg.max_tokens + 1, plan, out, NULL),
              MOELINK_ERR_INVALID_ARGUMENT, "max_tokens", "combine with T > max_tokens");

  /* workspace_size / create. */
  size_t bytes = 0;
  CHECK_OK(moelink_moe_workspace_size(L.ctx, &cfg, &bytes), "workspace_size");
  CHECK(bytes > 0, "workspace is not empty (%zu bytes)", bytes);
  moelink_moe_config_t big = cfg;
  big.max_tokens = cfg.max_tokens * 16;
  size_t big_bytes = 0;
  CHECK_OK(moelink_moe_workspace_size(L.ctx, &big, &big_bytes), "workspace_size, 16x tokens");
  CHECK(big_bytes > bytes, "workspace grows with max_tokens (%zu -> %zu)", bytes, big_bytes);
  EXPECT_FAIL(moelink_moe_workspace_size(NULL, &cfg, &bytes), MOELINK_ERR_INVALID_ARGUMENT,
              "context", "workspace_size(NULL ctx)");
  EXPECT_FAIL(moelink_moe_workspace_size(L.ctx, NULL, &bytes), MOELINK_ERR_INVALID_ARGUMENT,
              "config", "workspace_size(NULL cfg)");
  EXPECT_FAIL(moelink_moe_workspace_size(L.ctx, &cfg, NULL), MOELINK_ERR_INVALID_ARGUMENT,
              "bytes", "workspace_size(NULL bytes)");
  moelink_moe_t m2 = NULL;
  EXPECT_FAIL(moelink_moe_create(NULL, &cfg, &m2), MOELINK_ERR_INVALID_ARGUMENT, "context",
              "create(NULL ctx)");
  EXPECT_FAIL(moelink_moe_create(L.ctx, NULL, &m2), MOELINK_ERR_INVALID_ARGUMENT, "config",
              "create(NULL cfg)");
  EXPECT_FAIL(moelink_moe_create(L.ctx, &cfg, NULL), MOELINK_ERR_INVALID_ARGUMENT, "out",
              "create(NULL out)");

  /* fill_random. */
  EXPECT_FAIL(moelink_fill_random(NULL, MOELINK_DTYPE_F32, x, 4, 1, 1.0f, 0.0f, NULL),
              MOELINK_ERR_INVALID_ARGUMENT, "context", "fill_random(NULL ctx)");
  EXPECT_FAIL(moelink_fill_random(L.ctx, MOELINK_DTYPE_F32, NULL, 4, 1, 1.0f, 0.0f, NULL),
              MOELINK_ERR_INVALID_ARGUMENT, "ptr", "fill_random(NULL ptr)");
  EXPECT_FAIL(moelink_fill_random(L.ctx, MOELINK_DTYPE_FP8_E4M3, x, 4, 1, 1.0f, 0.0f, NULL),
              MOELINK_ERR_UNSUPPORTED, "fp8", "fill_random of fp8");
  CHECK_OK(moelink_fill_random(L.ctx, MOELINK_DTYPE_F32, x, 4, 7, 2.0f, 1.0f, NULL),
           "fill_random");
  int same = 1;
  for (int i = 0; i < 4; ++i)
    if (x[i] != moelink_random_value(7, (size_t)i, 2.0f, 1.0f) || x[i] < -1.0f || x[i] >= 3.0f)
      same = 0;
  CHECK(same, "fill_random writes moelink_random_value's values, in [offset-scale, offset+scale)");

  free(x);
  free(out);
  free(ids);
  free(wts);
  free(y);
  free(plan);
  layer_close(&L);
}

/* Layers with a correction bias and a gated shared expert: the pointers they
 * require. */
static void test_required_weights(void) {
  moelink_moe_config_t cfg = small_cfg();
  cfg.router = MOELINK_ROUTER_SIGMOID_TOPK;
  cfg.correction_bias = 1;
  cfg.shared_inter = 12;
  cfg.shared_gate = 1;
  layer L;
  int ok = layer_open(&L, cfg) == 0;
  CHECK(ok, "layer with bias and gated shared expert created (%s)", ok ? "" : moelink_last_error());
  if (ok) {
    moelink_moe_weights_t w = L.w;
    w.correction_bias = NULL;
    EXPECT_FAIL(moelink_moe_set_weights(L.m, &w), MOELINK_ERR_INVALID_ARGUMENT, "correction_bias",
                "missing correction bias");
    w = L.w;
    w.shared_gate_up = NULL;
    EXPECT_FAIL(moelink_moe_set_weights(L.m, &w), MOELINK_ERR_INVALID_ARGUMENT, "shared",
                "missing shared gate_up");
    w = L.w;
    w.shared_down = NULL;
    EXPECT_FAIL(moelink_moe_set_weights(L.m, &w), MOELINK_ERR_INVALID_ARGUMENT, "shared",
                "missing shared down");
    w = L.w;
    w.shared_gate = NULL;
    EXPECT_FAIL(moelink_moe_set_weights(L.m, &w), MOELINK_ERR_INVALID_ARGUMENT, "shared_gate",
                "missing shared gate");
    CHECK_OK(moelink_moe_set_weights(L.m, &L.w), "complete weights accepted");
  }
  layer_close(&L);

  /* A bf16 layer rejects f32 weights with DTYPE_MISMATCH. */
  cfg = small_cfg();
  cfg.dtype = MOELINK_DTYPE_BF16;
  ok = layer_open(&L, cfg) == 0;
  CHECK(ok, "bf16 layer created");
  if (ok) {
    moelink_moe_weights_t w = L.w;
    w.dtype = MOELINK_DTYPE_F32;
    EXPECT_FAIL(moelink_moe_set_weights(L.m, &w), MOELINK_ERR_DTYPE_MISMATCH, "dtype",
                "f32 weights on a bf16 layer");
    w.dtype = MOELINK_DTYPE_F16;
    EXPECT_FAIL(moelink_moe_set_weights(L.m, &w), MOELINK_ERR_DTYPE_MISMATCH, "dtype",
                "f16 weights on a bf16 layer");
  }
  layer_close(&L);
}

/* ---- FLOP count -------------------------------------------------------------- */

static void test_flops(void) {
  for (int j = 0; j < NPRESETS; ++j) {
    const preset_want *p = &presets[j];
    moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
    if (moelink_moe_preset(p->name, &c) != MOELINK_SUCCESS) continue;
    /* Per token: router E*H multiply-adds; per routed expert gate and up
     * (2*I*H) and down (H*I); shared expert 3*Is*H plus its gate (H). */
    double T = 37;
    double mads = (double)p->E * p->H + (double)p->k * 3.0 * p->I * p->H +
                  3.0 * (double)p->shared_inter * p->H + (p->shared_gate ? (double)p->H : 0.0);
    double want = 2.0 * T * mads;
    double got = moelink_moe_flops(&c, 37);
    CHECK(fabs(got - want) <= 1e-12 * want, "%s: flops(37) = %.6g (hand count %.6g)", p->name,
          got, want);
    double g1 = moelink_moe_flops(&c, 1);
    CHECK(fabs(g1 * 37 - got) <= 1e-9 * got, "%s: flops is linear in tokens", p->name);
    CHECK(moelink_moe_flops(&c, 0) == 0.0, "%s: flops(0) = 0", p->name);
  }
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  c.hidden = 10;
  c.inter = 3;
  c.num_experts = 4;
  c.top_k = 2;
  /* 2 * (4*10 + 2*3*3*10) = 2 * 220 = 440 */
  CHECK(moelink_moe_flops(&c, 1) == 440.0, "tiny layer: 440 flops per token (got %g)",
        moelink_moe_flops(&c, 1));
  CHECK(!(moelink_moe_flops(NULL, 5) > 0.0), "flops(NULL cfg) counts nothing");
  CHECK(!(moelink_moe_flops(&c, -3) > 0.0), "flops of -3 tokens counts nothing");
}

int main(void) {
  test_presets();
  test_config_check();
  test_context_args();
  test_layer_args();
  test_required_weights();
  test_flops();
  return ml_test_done();
}
