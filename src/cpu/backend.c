/* The CPU backend's table, its workspace and the fused forward. */
#include "cpu/cpu.h"

#include <stdlib.h>
#include <string.h>

/* Weight floats per work item (2 MiB of fp32). Measured on qwen3-30b-a3b
 * shapes: per-call BLAS costs (packing the token rows, call overhead) fall
 * with bigger blocks faster than the cache misses of a block beyond L2 rise,
 * up to about this size; the block still sits in L3 while BLAS packs it. */
#define ML_CPU_CONV_TARGET (512 * 1024)
#define ML_CPU_ROW_CHUNK 256

static int ml_cols_for(size_t target, int k_dim, int lo, int full) {
  size_t c = target / (size_t)k_dim;
  if (c < (size_t)lo) c = (size_t)lo;
  c &= ~(size_t)7; /* whole SIMD groups per block */
  if (c == 0) c = 8;
  return c >= (size_t)full ? full : (int)c;
}

static size_t ml_max_sz(size_t a, size_t b) { return a > b ? a : b; }

void ml_cpu_blocks_for(const moelink_moe_config_t *c, ml_cpu_blocks *b) {
  const int H = c->hidden, I = c->inter, Is = c->shared_inter;
  memset(b, 0, sizeof *b);
  b->row_chunk = ML_CPU_ROW_CHUNK;
  /* About eight router items, so the logits GEMM is spread over the team
   * even when the whole router would fit one block. */
  const int router_share = ((c->num_experts + 7) / 8 + 7) & ~7;
  b->router_rows = ml_cols_for(ML_CPU_CONV_TARGET, H, 8, c->num_experts);
  if (b->router_rows > router_share) b->router_rows = router_share;
  b->gu_cols = ml_cols_for(ML_CPU_CONV_TARGET / 2, H, 8, I);
  b->down_cols = ml_cols_for(ML_CPU_CONV_TARGET, I, 16, H);
  if (Is > 0) {
    b->sgu_cols = ml_cols_for(ML_CPU_CONV_TARGET / 2, H, 8, Is);
    b->sdown_cols = ml_cols_for(ML_CPU_CONV_TARGET, Is, 16, H);
  }
  /* FP8 experts and shared expert are dequantized into the same buffer, whatever the dtype. */
  if (c->dtype != MOELINK_DTYPE_F32 || c->fp8_experts || c->fp8_shared) {
    size_t conv = (size_t)b->router_rows * (size_t)H;
    conv = ml_max_sz(conv, 2 * (size_t)b->gu_cols * (size_t)H);
    conv = ml_max_sz(conv, (size_t)b->down_cols * (size_t)I);
    if (Is > 0) {
      conv = ml_max_sz(conv, 2 * (size_t)b->sgu_cols * (size_t)H);
      conv = ml_max_sz(conv, (size_t)b->sdown_cols * (size_t)Is);
    }
    b->conv_floats = conv;
  }
  size_t widest = ml_max_sz(2 * (size_t)b->gu_cols, (size_t)b->down_cols);
  widest = ml_max_sz(widest, ml_max_sz(2 * (size_t)b->sgu_cols, (size_t)b->sdown_cols));
  widest = ml_max_sz(widest, (size_t)b->router_rows);
  b->tmp_floats = (size_t)b->row_chunk * widest;
  /* combine: an accumulator row and a converted row; router: group scores,
   * kept-group flags and the top-k list. */
  size_t router = 2 * (size_t)c->n_group + 2 * (size_t)c->top_k + 16;
  b->misc_floats = ml_max_sz(2 * (size_t)H, router);
}

/* One pass computes the size (base NULL) or carves the pointers. */
typedef struct ml_carver {
  char *base;
  size_t off;
  int overflow;
} ml_carver;

static void *ml_take(ml_carver *cv, size_t count, size_t elem) {
  if (count != 0 && elem > (SIZE_MAX / 4) / count) {
    cv->overflow = 1;
    return NULL;
  }
  size_t bytes = (count * elem + 63) & ~(size_t)63;
  if (cv->off > SIZE_MAX / 4 - bytes) {
    cv->overflow = 1;
    return NULL;
  }
  void *p = cv->base && count ? cv->base + cv->off : NULL;
  cv->off += bytes;
  return p;
}

static size_t ml_cpu_layout(const moelink_moe_config_t *c, int nthreads, ml_cpu_moe *m,
                            char *base, int *overflow) {
  ml_cpu_moe tmp;
  if (!m) m = &tmp;
  memset(m, 0, sizeof *m);
  ml_cpu_blocks_for(c, &m->blk);
  m->nthreads = nthreads;
  ml_carver cv = {base, 0, 0};
  const size_t T = (size_t)c->max_tokens, H = (size_t)c->hidden, I = (size_t)c->inter;
  const size_t E = (size_t)c->num_experts, k = (size_t)c->top_k, Is = (size_t)c->shared_inter;
  const size_t pairs = T * k;
  if (c->dtype != MOELINK_DTYPE_F32) m->xf = (float *)ml_take(&cv, T * H, 4);
  m->logits = (float *)ml_take(&cv, T * E, 4);
  m->ids = (int32_t *)ml_take(&cv, pairs, 4);
  m->wts = (float *)ml_take(&cv, pairs, 4);
  m->plan = ml_take(&cv, moelink_plan_bytes(c->max_tokens, c->top_k, c->num_experts,
                                            ML_CPU_TILE_ROWS), 1);
  m->order = (int64_t *)ml_take(&cv, E, 8);
  m->xg = (float *)ml_take(&cv, pairs * H, 4);
  m->h = (float *)ml_take(&cv, pairs * I, 4);
  if (Is > 0) {
    m->sh_h = (float *)ml_take(&cv, T * Is, 4);
    m->sh_out = (float *)ml_take(&cv, T * H, 4);
    m->sh_gate = (float *)ml_take(&cv, T, 4);
    m->sh_gw = (float *)ml_take(&cv, H, 4);
    if (c->fp8_shared)
      m->sh_xq = (float *)ml_take(&cv, T * H, 4);
  }
  m->per_thread = ml_cpu_round16(m->blk.conv_floats) + ml_cpu_round16(m->blk.tmp_floats) +
                  ml_cpu_round16(m->blk.misc_floats);
  m->thread_buf = (float *)ml_take(&cv, (size_t)nthreads * m->per_thread, 4);
  *overflow = cv.overflow;
  return cv.off;
}

static moelink_status_t ml_cpu_context_init(moelink_context_t ctx) {
  if (ctx->num_threads < 1)
    return ml_fail(MOELINK_ERR_INTERNAL, "cpu backend: num_threads %d < 1", ctx->num_threads);
  return MOELINK_SUCCESS;
}

static void ml_cpu_context_fini(moelink_context_t ctx) { (void)ctx; }

static moelink_status_t ml_cpu_workspace_size(moelink_context_t ctx,
                                              const moelink_moe_config_t *cfg, size_t *bytes) {
  int overflow = 0;
  size_t n = ml_cpu_layout(cfg, ctx->num_threads, NULL, NULL, &overflow);
  if (overflow)
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY,
                   "cpu workspace for max_tokens %d, top_k %d, hidden %d, inter %d does not fit "
                   "in memory", cfg->max_tokens, cfg->top_k, cfg->hidden, cfg->inter);
  *bytes = n;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cpu_moe_init(moelink_moe_t moe) {
  const moelink_moe_config_t *c = &moe->cfg;
  size_t bytes = 0;
  ML_TRY(ml_cpu_workspace_size(moe->ctx, c, &bytes));
  ml_cpu_moe *ws = (ml_cpu_moe *)calloc(1, sizeof *ws);
  if (!ws) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "cpu layer state allocation failed");
  void *base = NULL;
  if (posix_memalign(&base, 64, bytes ? bytes : 64) != 0 || !base) {
    free(ws);
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY,
                   "cpu workspace of %zu bytes (max_tokens %d) could not be allocated", bytes,
                   c->max_tokens);
  }
  int overflow = 0;
  ml_cpu_layout(c, moe->ctx->num_threads, ws, (char *)base, &overflow);
  ws->base = base;
  ws->bytes = bytes;
  moe->impl = ws;
  moe->tile_rows = ML_CPU_TILE_ROWS;
  return MOELINK_SUCCESS;
}

static void ml_cpu_moe_fini(moelink_moe_t moe) {
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  if (!ws) return;
  free(ws->base);
  free(ws);
  moe->impl = NULL;
}

/* route -> plan -> experts (+ shared) -> combine, all intermediates in fp32
 * in the workspace, one rounding to the layer dtype at the end. */
static moelink_status_t ml_cpu_forward(moelink_moe_t moe, const void *x, int num_tokens,
                                       void *out, void *stream) {
  (void)stream;
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const moelink_moe_config_t *c = &moe->cfg;
  const float *x32 = ml_cpu_x_f32(moe, x, num_tokens);
  ML_TRY(ml_cpu_route_f32(moe, x32, num_tokens, ws->ids, ws->wts));
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view(ws->plan, num_tokens, c->top_k, c->num_experts, ML_CPU_TILE_ROWS,
                           &plan));
  ml_cpu_build_plan(ws->ids, num_tokens, c->top_k, c->num_experts, ML_CPU_TILE_ROWS, &plan);
  ml_cpu_ffn job;
  memset(&job, 0, sizeof job);
  job.x = x32;
  job.x_dtype = MOELINK_DTYPE_F32;
  job.num_tokens = num_tokens;
  job.plan = &plan;
  job.weights = ws->wts;
  job.y32 = ws->xg;
  job.x32 = c->shared_inter > 0 ? x32 : NULL;
  ML_TRY(ml_cpu_run_ffn(moe, &job));
  return ml_cpu_combine_rows(moe, ws->xg, MOELINK_DTYPE_F32, num_tokens, &plan,
                             c->shared_inter > 0 ? ws->sh_out : NULL, out);
}

static const ml_backend_ops ml_cpu_ops = {
    "cpu",
    ml_cpu_context_init,
    ml_cpu_context_fini,
    ml_cpu_workspace_size,
    ml_cpu_moe_init,
    ml_cpu_moe_fini,
    ml_cpu_route,
    ml_cpu_plan,
    ml_cpu_experts,
    ml_cpu_combine,
    ml_cpu_fill_random,
    ml_cpu_quantize,
    ml_cpu_dequantize,
    ml_cpu_forward,
};

const ml_backend_ops *ml_cpu_backend(void) { return &ml_cpu_ops; }
