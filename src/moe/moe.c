/* The MoE front end: argument checks, weights, chunking, plan layout; the
 * work itself goes to the context's backend. */
#include "core/core.h"
#include "moe/backend.h"

#include <stdlib.h>
#include <string.h>

#define ML_BAD MOELINK_ERR_INVALID_ARGUMENT

moelink_status_t moelink_moe_workspace_size(moelink_context_t ctx, const moelink_moe_config_t *cfg,
                                            size_t *bytes) {
  ml_clear_error();
  if (!ctx) return ml_fail(ML_BAD, "context is NULL");
  if (!bytes) return ml_fail(ML_BAD, "bytes is NULL");
  ML_TRY(moelink_moe_config_check(cfg));
  return ctx->ops->moe_workspace_size(ctx, cfg, bytes);
}

moelink_status_t moelink_moe_create(moelink_context_t ctx, const moelink_moe_config_t *cfg,
                                    moelink_moe_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(ML_BAD, "out is NULL");
  *out = NULL;
  if (!ctx) return ml_fail(ML_BAD, "context is NULL");
  ML_TRY(moelink_moe_config_check(cfg));
  moelink_moe_t moe = (moelink_moe_t)calloc(1, sizeof *moe);
  if (!moe) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "layer allocation failed");
  moe->ctx = ctx;
  moe->cfg = *cfg;
  moelink_status_t s = ctx->ops->moe_init(moe);
  if (s != MOELINK_SUCCESS) {
    free(moe);
    return s;
  }
  if (moe->tile_rows <= 0) {
    ctx->ops->moe_fini(moe);
    free(moe);
    return ml_fail(MOELINK_ERR_INTERNAL, "backend %s set no tile size", ctx->ops->name);
  }
  *out = moe;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_moe_destroy(moelink_moe_t moe) {
  ml_clear_error();
  if (!moe) return MOELINK_SUCCESS;
  moe->ctx->ops->moe_fini(moe);
  free(moe);
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_moe_get_config(moelink_moe_t moe, moelink_moe_config_t *cfg) {
  ml_clear_error();
  if (!moe) return ml_fail(ML_BAD, "layer is NULL");
  if (!cfg) return ml_fail(ML_BAD, "cfg is NULL");
  *cfg = moe->cfg;
  return MOELINK_SUCCESS;
}

int moelink_moe_tile_rows(moelink_moe_t moe) { return moe ? moe->tile_rows : 0; }

moelink_status_t moelink_moe_set_weights(moelink_moe_t moe, const moelink_moe_weights_t *w) {
  ml_clear_error();
  if (!moe) return ml_fail(ML_BAD, "layer is NULL");
  if (!w) return ml_fail(ML_BAD, "weights is NULL");
  if (w->size != sizeof(moelink_moe_weights_t))
    return ml_fail(ML_BAD, "weights size %zu != %zu: initialize with MOELINK_MOE_WEIGHTS_INIT",
                   w->size, sizeof(moelink_moe_weights_t));
  const moelink_moe_config_t *c = &moe->cfg;
  if (w->dtype != c->dtype)
    return ml_fail(MOELINK_ERR_DTYPE_MISMATCH, "weights dtype %s != layer dtype %s",
                   moelink_dtype_name(w->dtype), moelink_dtype_name(c->dtype));
  if (!w->router) return ml_fail(ML_BAD, "weights.router is NULL");
  if (!w->gate_up) return ml_fail(ML_BAD, "weights.gate_up is NULL");
  if (!w->down) return ml_fail(ML_BAD, "weights.down is NULL");
  if (c->correction_bias && !w->correction_bias)
    return ml_fail(ML_BAD, "weights.correction_bias is NULL but the config uses a correction bias");
  if (!c->correction_bias && w->correction_bias)
    return ml_fail(ML_BAD, "weights.correction_bias given but config.correction_bias is 0");
  if (c->shared_inter > 0 && (!w->shared_gate_up || !w->shared_down))
    return ml_fail(ML_BAD, "weights.shared_gate_up/shared_down are NULL but shared_inter is %d",
                   c->shared_inter);
  if (c->shared_inter == 0 && (w->shared_gate_up || w->shared_down))
    return ml_fail(ML_BAD, "shared expert weights given but config.shared_inter is 0");
  if (c->shared_gate && !w->shared_gate)
    return ml_fail(ML_BAD, "weights.shared_gate is NULL but config.shared_gate is 1");
  if (!c->shared_gate && w->shared_gate)
    return ml_fail(ML_BAD, "weights.shared_gate given but config.shared_gate is 0");
  if (c->fp8_experts && (!w->gate_up_scale || !w->down_scale))
    return ml_fail(ML_BAD, "weights.%s is NULL but config.fp8_experts is 1",
                   !w->gate_up_scale ? "gate_up_scale" : "down_scale");
  if (!c->fp8_experts && (w->gate_up_scale || w->down_scale))
    return ml_fail(ML_BAD, "weight scales given but config.fp8_experts is 0");
  if (c->fp8_shared && (!w->shared_gate_up_scale || !w->shared_down_scale))
    return ml_fail(ML_BAD, "weights.%s is NULL but config.fp8_shared is 1",
                   !w->shared_gate_up_scale ? "shared_gate_up_scale" : "shared_down_scale");
  if (!c->fp8_shared && (w->shared_gate_up_scale || w->shared_down_scale))
    return ml_fail(ML_BAD, "shared expert weight scales given but config.fp8_shared is 0");
  moe->w = *w;
  moe->has_weights = 1;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_check_tokens(const moelink_moe_t moe, int num_tokens, int chunked) {
  if (num_tokens < 0) return ml_fail(ML_BAD, "num_tokens %d must be >= 0", num_tokens);
  if (!chunked && num_tokens > moe->cfg.max_tokens)
    return ml_fail(ML_BAD, "num_tokens %d > max_tokens %d of the layer (forward chunks, the "
                           "pieces do not)", num_tokens, moe->cfg.max_tokens);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_need_weights(const moelink_moe_t moe, const char *op) {
  if (!moe->has_weights)
    return ml_fail(MOELINK_ERR_INVALID_STATE, "%s before moelink_moe_set_weights", op);
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_moe_forward(moelink_moe_t moe, const void *x, int num_tokens, void *out,
                                     void *stream) {
  ml_clear_error();
  if (!moe) return ml_fail(ML_BAD, "layer is NULL");
  ML_TRY(ml_check_tokens(moe, num_tokens, 1));
  if (num_tokens == 0) return MOELINK_SUCCESS;
  if (!x) return ml_fail(ML_BAD, "x is NULL");
  if (!out) return ml_fail(ML_BAD, "out is NULL");
  ML_TRY(ml_need_weights(moe, "forward"));
  size_t row = (size_t)moe->cfg.hidden * moelink_dtype_size(moe->cfg.dtype);
  const char *xs = (const char *)x, *xe = xs + row * (size_t)num_tokens;
  const char *os = (const char *)out, *oe = os + row * (size_t)num_tokens;
  if (xs < oe && os < xe) return ml_fail(ML_BAD, "x and out overlap");
  for (int t0 = 0; t0 < num_tokens; t0 += moe->cfg.max_tokens) {
    int n = num_tokens - t0 < moe->cfg.max_tokens ? num_tokens - t0 : moe->cfg.max_tokens;
    ML_TRY(moe->ctx->ops->forward(moe, xs + row * (size_t)t0, n, (char *)out + row * (size_t)t0,
                                  stream));
  }
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_moe_route(moelink_moe_t moe, const void *x, int num_tokens,
                                   int32_t *topk_ids, float *topk_weights, void *stream) {
  ml_clear_error();
  if (!moe) return ml_fail(ML_BAD, "layer is NULL");
  ML_TRY(ml_check_tokens(moe, num_tokens, 0));
  if (num_tokens == 0) return MOELINK_SUCCESS;
  if (!x) return ml_fail(ML_BAD, "x is NULL");
  if (!topk_ids) return ml_fail(ML_BAD, "topk_ids is NULL");
  if (!topk_weights) return ml_fail(ML_BAD, "topk_weights is NULL");
  ML_TRY(ml_need_weights(moe, "route"));
  return moe->ctx->ops->route(moe, x, num_tokens, topk_ids, topk_weights, stream);
}

size_t moelink_plan_bytes(int num_tokens, int top_k, int num_experts, int tile_rows) {
  if (num_tokens < 0 || top_k <= 0 || num_experts <= 0 || tile_rows <= 0) return 0;
  size_t pairs = (size_t)num_tokens * (size_t)top_k;
  size_t max_tiles = (pairs + (size_t)tile_rows - 1) / (size_t)tile_rows + (size_t)num_experts;
  size_t ints = (size_t)num_experts + 1 + 2 * pairs + 3 * max_tiles + 1;
  return ints * sizeof(int32_t);
}

moelink_status_t moelink_plan_view(void *buffer, int num_tokens, int top_k, int num_experts,
                                   int tile_rows, moelink_plan_t *plan) {
  ml_clear_error();
  if (!plan) return ml_fail(ML_BAD, "plan is NULL");
  if (!buffer) return ml_fail(ML_BAD, "plan buffer is NULL");
  if (((uintptr_t)buffer & 3u) != 0) return ml_fail(ML_BAD, "plan buffer is not 4-byte aligned");
  if (num_tokens < 0 || top_k <= 0 || num_experts <= 0 || tile_rows <= 0)
    return ml_fail(ML_BAD, "plan sizes T %d k %d E %d tile_rows %d out of range", num_tokens,
                   top_k, num_experts, tile_rows);
  size_t pairs = (size_t)num_tokens * (size_t)top_k;
  size_t max_tiles = (pairs + (size_t)tile_rows - 1) / (size_t)tile_rows + (size_t)num_experts;
  int32_t *p = (int32_t *)buffer;
  plan->num_tokens = num_tokens;
  plan->top_k = top_k;
  plan->num_experts = num_experts;
  plan->tile_rows = tile_rows;
  plan->max_tiles = (int)max_tiles;
  plan->expert_offsets = p;
  p += num_experts + 1;
  plan->sorted_pairs = p;
  p += pairs;
  plan->pair_rows = p;
  p += pairs;
  plan->tiles = p;
  p += 3 * max_tiles;
  plan->num_tiles = p;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_moe_plan(moelink_moe_t moe, const int32_t *topk_ids, int num_tokens,
                                  void *plan_buffer, void *stream) {
  ml_clear_error();
  if (!moe) return ml_fail(ML_BAD, "layer is NULL");
  ML_TRY(ml_check_tokens(moe, num_tokens, 0));
  if (!plan_buffer) return ml_fail(ML_BAD, "plan_buffer is NULL");
  if (((uintptr_t)plan_buffer & 3u) != 0)
    return ml_fail(ML_BAD, "plan_buffer is not 4-byte aligned");
  if (num_tokens > 0 && !topk_ids) return ml_fail(ML_BAD, "topk_ids is NULL");
  return moe->ctx->ops->plan(moe, topk_ids, num_tokens, plan_buffer, stream);
}

moelink_status_t moelink_moe_experts(moelink_moe_t moe, const void *x, int num_tokens,
                                     const void *plan_buffer, const float *topk_weights, void *y,
                                     void *stream) {
  ml_clear_error();
  if (!moe) return ml_fail(ML_BAD, "layer is NULL");
  ML_TRY(ml_check_tokens(moe, num_tokens, 0));
  if (num_tokens == 0) return MOELINK_SUCCESS;
  if (!x) return ml_fail(ML_BAD, "x is NULL");
  if (!plan_buffer) return ml_fail(ML_BAD, "plan_buffer is NULL");
  if (!y) return ml_fail(ML_BAD, "y is NULL");
  ML_TRY(ml_need_weights(moe, "experts"));
  return moe->ctx->ops->experts(moe, x, num_tokens, plan_buffer, topk_weights, y, stream);
}

moelink_status_t moelink_moe_combine(moelink_moe_t moe, const void *y, int num_tokens,
                                     const void *plan_buffer, void *out, void *stream) {
  ml_clear_error();
  if (!moe) return ml_fail(ML_BAD, "layer is NULL");
  ML_TRY(ml_check_tokens(moe, num_tokens, 0));
  if (num_tokens == 0) return MOELINK_SUCCESS;
  if (!y) return ml_fail(ML_BAD, "y is NULL");
  if (!plan_buffer) return ml_fail(ML_BAD, "plan_buffer is NULL");
  if (!out) return ml_fail(ML_BAD, "out is NULL");
  return moe->ctx->ops->combine(moe, y, num_tokens, plan_buffer, out, stream);
}
