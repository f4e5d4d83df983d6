/* Test data: layers and inputs filled through moelink_fill_random, so that a
 * device copy generated with the same seeds holds the same values. */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

uint64_t ref_tensor_seed(uint64_t layer_seed, int tensor) {
  /* A finalizer of the 64-bit murmur kind over (seed, tensor): distinct
   * tensors of one layer and nearby layer seeds land far apart. */
  uint64_t z = layer_seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(tensor + 1));
  z ^= z >> 33;
  z *= 0xff51afd7ed558ccdull;
  z ^= z >> 33;
  z *= 0xc4ceb9fe1a85ec53ull;
  z ^= z >> 33;
  return z;
}

int ref_preset_reduced(const char *preset, int H, int I, int Is, moelink_dtype_t dt,
                       moelink_moe_config_t *cfg) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  if (moelink_moe_preset(preset, &c) != MOELINK_SUCCESS) return -1;
  c.hidden = H;
  c.inter = I;
  if (c.shared_inter > 0) c.shared_inter = Is;
  c.dtype = dt;
  *cfg = c;
  return 0;
}

float ref_tensor_scale(const moelink_moe_config_t *cfg, int tensor) {
  /* Entries are uniform in [-scale, scale), variance scale^2 / 3; x has
   * variance 1/3. Router 3/sqrt(H): logits of standard deviation 1, so the
   * top-k of a few hundred experts are separated by O(0.1-1). Gate/up
   * 2/sqrt(H) and down 2/sqrt(I): activations and outputs of order 0.3,
   * far from both f16 limits. */
  const double H = cfg->hidden > 0 ? cfg->hidden : 1;
  const double I = cfg->inter > 0 ? cfg->inter : 1;
  const double Is = cfg->shared_inter > 0 ? cfg->shared_inter : 1;
  switch (tensor) {
  case REF_T_ROUTER: return (float)(3.0 / sqrt(H));
  /* The bias nudges selection (sigmoid scores spread by ~0.2) without
   * dominating it: a bias as wide as the scores would pin most tokens to the
   * same few experts, which is neither what a trained load-balancing bias
   * does nor a fair benchmark of uniform routing. */
  case REF_T_BIAS: return 0.05f;
  case REF_T_GATE_UP: return (float)(2.0 / sqrt(H));
  case REF_T_DOWN: return (float)(2.0 / sqrt(I));
  case REF_T_SH_GATE_UP: return (float)(2.0 / sqrt(H));
  case REF_T_SH_DOWN: return (float)(2.0 / sqrt(Is));
  case REF_T_SH_GATE: return (float)(1.0 / sqrt(H));
  case REF_T_X: return 1.0f;
  }
  return 0.0f;
}

void ref_apply_skew(const moelink_moe_config_t *cfg, void *router, double zipf_alpha) {
  if (!(zipf_alpha > 0.0) || !router) return;
  for (int e = 0; e < cfg->num_experts; ++e)
    ref_store(cfg->dtype, router, (size_t)e * (size_t)cfg->hidden, -zipf_alpha * log(e + 1.0));
}

void ref_layer_free(ref_layer *L) {
  if (!L) return;
  free(L->router);
  free(L->gate_up);
  free(L->down);
  free(L->shared_gate_up);
  free(L->shared_down);
  free(L->shared_gate);
  free(L->bias);
  free(L->gate_up_scale);
  free(L->down_scale);
  free(L->shared_gate_up_scale);
  free(L->shared_down_scale);
  memset(L, 0, sizeof *L);
}

static int ref_fill(moelink_context_t ctx, moelink_dtype_t dt, void *p, size_t n, uint64_t seed,
                    float scale) {
  if (n == 0) return 0;
  if (!p) return -1;
  return moelink_fill_random(ctx, dt, p, n, seed, scale, 0.0f, NULL) == MOELINK_SUCCESS ? 0 : -1;
}

/* FP8 experts are generated a piece at a time (128 rows of one expert's
 * gate_up or down), never as a whole dtype tensor: DeepSeek-V3's 11 G
 * elements would need 22 GB in bf16 next to their 11 GB of bytes. */
#define REF_GEN_BLOCK 128

/* Rows of gate_up and of down in one expert, in pieces of 128. */
static size_t ref_gen_pieces_gu(const moelink_moe_config_t *c) {
  return (size_t)(2 * c->inter / REF_GEN_BLOCK);
}
static size_t ref_gen_pieces_per_expert(const moelink_moe_config_t *c) {
  return ref_gen_pieces_gu(c) + (size_t)(c->hidden / REF_GEN_BLOCK);
}

int ref_layer_begin(ref_layer *L, const moelink_moe_config_t *cfg, uint64_t seed,
                    double zipf_alpha, size_t *pieces) {
  if (pieces) *pieces = 0;
  if (!L) return -1;
  memset(L, 0, sizeof *L);
  if (!cfg || cfg->hidden <= 0 || cfg->inter <= 0 || cfg->num_experts <= 0 ||
      cfg->shared_inter < 0)
    return -1;
  if (cfg->dtype != MOELINK_DTYPE_F32 && cfg->dtype != MOELINK_DTYPE_BF16 &&
      cfg->dtype != MOELINK_DTYPE_F16)
    return -1;
  if (cfg->fp8_experts && (cfg->hidden % REF_GEN_BLOCK || cfg->inter % REF_GEN_BLOCK)) return -1;
  if (cfg->fp8_shared &&
      (cfg->shared_inter <= 0 || cfg->hidden % REF_GEN_BLOCK || cfg->shared_inter % REF_GEN_BLOCK))
    return -1;
  L->cfg = *cfg;
  L->seed = seed;
  L->zipf_alpha = zipf_alpha;
  const moelink_dtype_t dt = cfg->dtype;
  const size_t es = moelink_dtype_size(dt);
  const size_t H = (size_t)cfg->hidden, I = (size_t)cfg->inter, E = (size_t)cfg->num_experts;
  const size_t Is = (size_t)cfg->shared_inter;
  const size_t n_router = E * H, n_gate_up = E * 2 * I * H, n_down = E * H * I;
  const size_t n_sh_gate_up = 2 * Is * H, n_sh_down = H * Is;
  /* FP8: one byte per weight, one fp32 scale per 128 x 128 block. */
  const size_t ees = cfg->fp8_experts ? 1 : es;
  const size_t blk = (size_t)REF_GEN_BLOCK * REF_GEN_BLOCK;

  L->router = malloc(n_router * es);
  L->gate_up = malloc(n_gate_up * ees);
  L->down = malloc(n_down * ees);
  if (!L->router || !L->gate_up || !L->down) goto fail;
  if (cfg->fp8_experts) {
    L->gate_up_scale = malloc(sizeof(float) * (n_gate_up / blk));
    L->down_scale = malloc(sizeof(float) * (n_down / blk));
    if (!L->gate_up_scale || !L->down_scale) goto fail;
  }
  /* FP8 shared expert: bytes and scales here, the dtype values in a
   * scratch tensor while they are quantized */
  const size_t ses = cfg->fp8_shared ? 1 : es;
  if (Is > 0) {
    L->shared_gate_up = malloc(n_sh_gate_up * ses);
    L->shared_down = malloc(n_sh_down * ses);
    if (!L->shared_gate_up || !L->shared_down) goto fail;
  }
  if (cfg->fp8_shared) {
    L->shared_gate_up_scale = malloc(sizeof(float) * (n_sh_gate_up / blk));
    L->shared_down_scale = malloc(sizeof(float) * (n_sh_down / blk));
    if (!L->shared_gate_up_scale || !L->shared_down_scale)
      goto fail;
  }
  if (cfg->shared_gate) {
    L->shared_gate = malloc(H * es);
    if (!L->shared_gate) goto fail;
  }
  if (cfg->correction_bias) {
    L->bias = malloc(E * sizeof(float));
    if (!L->bias) goto fail;
  }

  moelink_context_t ctx = NULL;
  if (moelink_context_create(NULL, &ctx) != MOELINK_SUCCESS) goto fail;
  int bad = 0;
  bad |= ref_fill(ctx, dt, L->router, n_router, ref_tensor_seed(seed, REF_T_ROUTER),
                  ref_tensor_scale(cfg, REF_T_ROUTER));
  if (!cfg->fp8_experts) {
    bad |= ref_fill(ctx, dt, L->gate_up, n_gate_up, ref_tensor_seed(seed, REF_T_GATE_UP),
                    ref_tensor_scale(cfg, REF_T_GATE_UP));
    bad |= ref_fill(ctx, dt, L->down, n_down, ref_tensor_seed(seed, REF_T_DOWN),
                    ref_tensor_scale(cfg, REF_T_DOWN));
  }
  if (Is > 0 && !cfg->fp8_shared) {
    bad |= ref_fill(ctx, dt, L->shared_gate_up, n_sh_gate_up,
                    ref_tensor_seed(seed, REF_T_SH_GATE_UP), ref_tensor_scale(cfg, REF_T_SH_GATE_UP));
    bad |= ref_fill(ctx, dt, L->shared_down, n_sh_down, ref_tensor_seed(seed, REF_T_SH_DOWN),
                    ref_tensor_scale(cfg, REF_T_SH_DOWN));
  } else if (Is > 0) {
    /* the bytes and scales of quantizing the dtype tensors ref_fill makes */
    void *v = malloc((n_sh_gate_up > n_sh_down ? n_sh_gate_up : n_sh_down) * es);
    bad |= v == NULL;
    for (int m = 0; m < 2 && v; ++m) {
      const int t = m ? REF_T_SH_DOWN : REF_T_SH_GATE_UP;
      const int rows = m ? (int)H : (int)(2 * Is), cols = m ? (int)Is : (int)H;
      bad |= ref_fill(ctx, dt, v, (size_t)rows * (size_t)cols, ref_tensor_seed(seed, t),
                      ref_tensor_scale(cfg, t));
      ref_fp8_quantize(dt, v, rows, cols, (uint8_t *)(m ? L->shared_down : L->shared_gate_up),
                       m ? L->shared_down_scale : L->shared_gate_up_scale);
    }
    free(v);
  }
  if (cfg->shared_gate)
    bad |= ref_fill(ctx, dt, L->shared_gate, H, ref_tensor_seed(seed, REF_T_SH_GATE),
                    ref_tensor_scale(cfg, REF_T_SH_GATE));
  if (cfg->correction_bias)
    bad |= ref_fill(ctx, MOELINK_DTYPE_F32, L->bias, E, ref_tensor_seed(seed, REF_T_BIAS),
                    ref_tensor_scale(cfg, REF_T_BIAS));
  moelink_context_destroy(ctx);
  if (bad) goto fail;

  ref_apply_skew(cfg, L->router, zipf_alpha);

  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.dtype = dt;
  w.router = L->router;
  w.correction_bias = L->bias;
  w.gate_up = L->gate_up;
  w.down = L->down;
  w.shared_gate_up = L->shared_gate_up;
  w.shared_down = L->shared_down;
  w.shared_gate = L->shared_gate;
  w.gate_up_scale = L->gate_up_scale;
  w.down_scale = L->down_scale;
  w.shared_gate_up_scale = L->shared_gate_up_scale;
  w.shared_down_scale = L->shared_down_scale;
  L->w = w;
  if (pieces && cfg->fp8_experts) *pieces = E * ref_gen_pieces_per_expert(cfg);
  return 0;

fail:
  ref_layer_free(L);
  return -1;
}

int ref_layer_fp8_piece(const ref_layer *L, size_t p) {
  if (!L || !L->cfg.fp8_experts || !L->gate_up || !L->down) return -1;
  const moelink_moe_config_t *c = &L->cfg;
  const size_t per_expert = ref_gen_pieces_per_expert(c), gu = ref_gen_pieces_gu(c);
  if (p >= (size_t)c->num_experts * per_expert) return -1;
  const size_t e = p / per_expert, j = p % per_expert;
  const int down = j >= gu;
  const int tensor = down ? REF_T_DOWN : REF_T_GATE_UP;
  const size_t rows = down ? (size_t)c->hidden : 2 * (size_t)c->inter;
  const size_t cols = down ? (size_t)c->inter : (size_t)c->hidden;
  const size_t br = down ? j - gu : j, nb = cols / REF_GEN_BLOCK;
  const uint64_t ts = ref_tensor_seed(L->seed, tensor);
  const float scale = ref_tensor_scale(c, tensor);
  uint8_t *q = (uint8_t *)(down ? L->down : L->gate_up) + e * rows * cols;
  float *sc = (down ? L->down_scale : L->gate_up_scale) +
              e * (rows / REF_GEN_BLOCK) * nb + br * nb;
  /* One 128 x 128 block at a time, generated as moelink_fill_random would
   * (moelink_random_value rounded to nearest even, as ref_store does) and
   * quantized by ref_fp8_quantize: the bytes and scale of quantizing the
   * whole dtype tensor. */
  const size_t es = moelink_dtype_size(c->dtype);
  void *v = malloc(es * REF_GEN_BLOCK * REF_GEN_BLOCK);
  uint8_t *qb = malloc((size_t)REF_GEN_BLOCK * REF_GEN_BLOCK);
  if (!v || !qb) {
    free(v);
    free(qb);
    return -1;
  }
  for (size_t bc = 0; bc < nb; ++bc) {
    for (size_t r = 0; r < REF_GEN_BLOCK; ++r) {
      const size_t i0 = e * rows * cols + (br * REF_GEN_BLOCK + r) * cols + bc * REF_GEN_BLOCK;
      for (size_t k = 0; k < REF_GEN_BLOCK; ++k)
        ref_store(c->dtype, v, r * REF_GEN_BLOCK + k,
                  (double)moelink_random_value(ts, i0 + k, scale, 0.0f));
    }
    ref_fp8_quantize(c->dtype, v, REF_GEN_BLOCK, REF_GEN_BLOCK, qb, &sc[bc]);
    for (size_t r = 0; r < REF_GEN_BLOCK; ++r)
      memcpy(q + (br * REF_GEN_BLOCK + r) * cols + bc * REF_GEN_BLOCK, qb + r * REF_GEN_BLOCK,
             REF_GEN_BLOCK);
  }
  free(v);
  free(qb);
  return 0;
}

int ref_layer_make(ref_layer *L, const moelink_moe_config_t *cfg, uint64_t seed, double zipf_alpha) {
  size_t pieces = 0;
  if (ref_layer_begin(L, cfg, seed, zipf_alpha, &pieces) != 0) return -1;
  int bad = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
#endif
  for (size_t p = 0; p < pieces; ++p) bad |= ref_layer_fp8_piece(L, p) != 0;
  if (bad) {
    ref_layer_free(L);
    return -1;
  }
  return 0;
}

void ref_fill_x(const ref_layer *L, void *x, int num_tokens, uint64_t seed) {
  if (!L || !x || num_tokens <= 0) return;
  const moelink_dtype_t dt = L->cfg.dtype;
  const size_t H = (size_t)L->cfg.hidden, n = (size_t)num_tokens * H;
  moelink_context_t ctx = NULL;
  int ok = moelink_context_create(NULL, &ctx) == MOELINK_SUCCESS &&
           ref_fill(ctx, dt, x, n, ref_tensor_seed(seed, REF_T_X),
                    ref_tensor_scale(&L->cfg, REF_T_X)) == 0;
  moelink_context_destroy(ctx);
  if (!ok) {
    /* No silent garbage: a test using this input fails on NaN. */
    for (size_t i = 0; i < n; ++i) ref_store(dt, x, i, NAN);
    return;
  }
  if (L->zipf_alpha > 0.0)
    for (int t = 0; t < num_tokens; ++t) ref_store(dt, x, (size_t)t * H, 1.0);
}
