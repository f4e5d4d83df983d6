/* Presets, config validation and FLOP counts. */
#include "core/core.h"

#include <string.h>

typedef struct ml_preset {
  const char *name;
  int hidden, inter, experts, top_k;
  moelink_router_t router;
  int renormalize, n_group, topk_group;
  float scaling;
  int correction_bias, shared_inter, shared_gate;
} ml_preset;

/* Checked against each model's published config.json:
 * Mixtral: num_local_experts, num_experts_per_tok, softmax then top-k, renormalized.
 * Qwen2-57B-A14B: norm_topk_prob false, shared_expert_intermediate_size 20480 with
 * a sigmoid shared_expert_gate. Qwen3: norm_topk_prob true, no shared expert.
 * DeepSeek-V3: scoring_func sigmoid, noaux_tc with e_score_correction_bias,
 * n_group 8, topk_group 4, norm_topk_prob true, routed_scaling_factor 2.5,
 * n_shared_experts 1 of moe_intermediate_size 2048, not gated. */
static const ml_preset ml_presets[] = {
    {"mixtral-8x7b", 4096, 14336, 8, 2, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"mixtral-8x22b", 6144, 16384, 8, 2, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"qwen2-57b-a14b", 3584, 2560, 64, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 0, 1, 1, 1.0f, 0, 20480, 1},
    {"qwen3-30b-a3b", 2048, 768, 128, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"qwen3-235b-a22b", 4096, 1536, 128, 8, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0},
    {"deepseek-v3", 7168, 2048, 256, 8, MOELINK_ROUTER_SIGMOID_TOPK, 1, 8, 4, 2.5f, 1, 2048, 0},
};
#define ML_NPRESETS ((int)(sizeof ml_presets / sizeof ml_presets[0]))

int moelink_preset_count(void) { return ML_NPRESETS; }

const char *moelink_preset_name(int i) {
  return (i >= 0 && i < ML_NPRESETS) ? ml_presets[i].name : NULL;
}

moelink_status_t moelink_moe_preset(const char *name, moelink_moe_config_t *cfg) {
  ml_clear_error();
  if (!name) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "preset name is NULL");
  if (!cfg) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "config is NULL");
  for (int i = 0; i < ML_NPRESETS; ++i) {
    const ml_preset *p = &ml_presets[i];
    if (strcmp(p->name, name) != 0) continue;
    cfg->hidden = p->hidden;
    cfg->inter = p->inter;
    cfg->num_experts = p->experts;
    cfg->top_k = p->top_k;
    cfg->router = p->router;
    cfg->renormalize = p->renormalize;
    cfg->n_group = p->n_group;
    cfg->topk_group = p->topk_group;
    cfg->routed_scaling = p->scaling;
    cfg->correction_bias = p->correction_bias;
    cfg->shared_inter = p->shared_inter;
    cfg->shared_gate = p->shared_gate;
    return MOELINK_SUCCESS;
  }
  return ml_fail(MOELINK_ERR_NOT_FOUND, "unknown preset '%s' (see moelink presets)", name);
}

moelink_status_t moelink_moe_config_check(const moelink_moe_config_t *c) {
  ml_clear_error();
  const moelink_status_t bad = MOELINK_ERR_INVALID_ARGUMENT;
  if (!c) return ml_fail(bad, "config is NULL");
  if (c->size != sizeof(moelink_moe_config_t))
    return ml_fail(bad, "config size %zu != %zu: initialize with MOELINK_MOE_CONFIG_INIT", c->size,
                   sizeof(moelink_moe_config_t));
  if (c->hidden <= 0) return ml_fail(bad, "hidden %d must be > 0", c->hidden);
  if (c->inter <= 0) return ml_fail(bad, "inter %d must be > 0", c->inter);
  if (c->num_experts <= 0) return ml_fail(bad, "num_experts %d must be > 0", c->num_experts);
  if (c->num_experts > 4096) return ml_fail(bad, "num_experts %d > 4096", c->num_experts);
  if (c->top_k <= 0) return ml_fail(bad, "top_k %d must be > 0", c->top_k);
  if (c->top_k > c->num_experts)
    return ml_fail(bad, "top_k %d > num_experts %d", c->top_k, c->num_experts);
  if (c->router != MOELINK_ROUTER_SOFTMAX_TOPK && c->router != MOELINK_ROUTER_SIGMOID_TOPK &&
      c->router != MOELINK_ROUTER_TOPK_SOFTMAX)
    return ml_fail(bad, "router %d is not a moelink_router_t", (int)c->router);
  if (c->renormalize != 0 && c->renormalize != 1)
    return ml_fail(bad, "renormalize %d must be 0 or 1", c->renormalize);
  if (c->n_group <= 0) return ml_fail(bad, "n_group %d must be > 0", c->n_group);
  if (c->num_experts % c->n_group != 0)
    return ml_fail(bad, "n_group %d does not divide num_experts %d", c->n_group, c->num_experts);
  if (c->topk_group <= 0 || c->topk_group > c->n_group)
    return ml_fail(bad, "topk_group %d must be in [1, n_group %d]", c->topk_group, c->n_group);
  if (c->top_k > c->topk_group * (c->num_experts / c->n_group))
    return ml_fail(bad, "top_k %d > experts in the %d kept groups (%d)", c->top_k, c->topk_group,
                   c->topk_group * (c->num_experts / c->n_group));
  if (c->n_group > 1 && c->router == MOELINK_ROUTER_TOPK_SOFTMAX)
    return ml_fail(bad, "group-limited selection (n_group %d) needs a softmax or sigmoid router",
                   c->n_group);
  if (!(c->routed_scaling > 0.0f) || c->routed_scaling > 1e6f)
    return ml_fail(bad, "routed_scaling %g must be in (0, 1e6]", (double)c->routed_scaling);
  if (c->correction_bias != 0 && c->correction_bias != 1)
    return ml_fail(bad, "correction_bias %d must be 0 or 1", c->correction_bias);
  if (c->shared_inter < 0) return ml_fail(bad, "shared_inter %d must be >= 0", c->shared_inter);
  if (c->shared_gate != 0 && c->shared_gate != 1)
    return ml_fail(bad, "shared_gate %d must be 0 or 1", c->shared_gate);
  if (c->shared_gate && c->shared_inter == 0)
    return ml_fail(bad, "shared_gate set but shared_inter is 0 (no shared expert)");
  if (c->dtype == MOELINK_DTYPE_FP8_E4M3)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "dtype fp8_e4m3 is reserved and not supported yet");
  if (c->dtype != MOELINK_DTYPE_F32 && c->dtype != MOELINK_DTYPE_BF16 &&
      c->dtype != MOELINK_DTYPE_F16)
    return ml_fail(bad, "dtype %d is not a moelink_dtype_t", (int)c->dtype);
  if (c->max_tokens <= 0) return ml_fail(bad, "max_tokens %d must be > 0", c->max_tokens);
  if (c->fp8_experts != 0 && c->fp8_experts != 1)
    return ml_fail(bad, "fp8_experts %d must be 0 or 1", c->fp8_experts);
  if (c->fp8_experts && (c->hidden % 128 != 0 || c->inter % 128 != 0))
    return ml_fail(bad,
                   "fp8_experts needs hidden (%d) and inter (%d) to be multiples of 128 "
                   "(one weight scale per 128 x 128 block)",
                   c->hidden, c->inter);
  if (c->fp8_shared != 0 && c->fp8_shared != 1)
    return ml_fail(bad, "fp8_shared %d must be 0 or 1", c->fp8_shared);
  if (c->fp8_shared && c->shared_inter == 0)
    return ml_fail(bad, "fp8_shared set but shared_inter is 0 (no shared expert)");
  if (c->fp8_shared && (c->hidden % 128 != 0 || c->shared_inter % 128 != 0))
    return ml_fail(bad,
                   "fp8_shared needs hidden (%d) and shared_inter (%d) to be multiples of 128 "
                   "(one weight scale per 128 x 128 block)",
                   c->hidden, c->shared_inter);
  /* Indices into [T*k] and [T*k, max(H, I)] arrays are int32 in plans. */
  if ((int64_t)c->max_tokens * c->top_k > INT32_MAX / 4)
    return ml_fail(bad, "max_tokens %d * top_k %d is too large", c->max_tokens, c->top_k);
  return MOELINK_SUCCESS;
}

double moelink_moe_flops(const moelink_moe_config_t *c, int num_tokens) {
  if (!c || num_tokens <= 0) return 0.0;
  double T = num_tokens, H = c->hidden, I = c->inter, E = c->num_experts, k = c->top_k;
  double f = 2.0 * T * H * E;                 /* router logits */
  f += 2.0 * T * k * (3.0 * H * I);           /* gate+up and down per routed pair */
  f += 2.0 * T * 3.0 * H * c->shared_inter;   /* shared expert */
  if (c->shared_gate) f += 2.0 * T * H;
  return f;
}
