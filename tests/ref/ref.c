/* The naive reference: model semantics of DESIGN.md section 2 in double
 * precision, one token at a time, with its own dtype decoding. Nothing here
 * shares code with the backends; keep it slow and obvious. */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- dtype decoding and encoding ----------------------------------------- */

static double ref_bf16_value(uint16_t h) {
  /* bf16 is the upper half of an IEEE single. */
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return (double)f;
}

static double ref_f16_value(uint16_t h) {
  int negative = (h >> 15) & 1;
  int exponent = (h >> 10) & 0x1f;
  int mantissa = h & 0x3ff;
  double v;
  if (exponent == 0)
    v = ldexp((double)mantissa, -24);
  else if (exponent == 31)
    v = mantissa ? NAN : INFINITY;
  else
    v = ldexp((double)(mantissa + 1024), exponent - 25);
  return negative ? -v : v;
}

static double ref_e4m3_value(uint8_t b) {
  /* OCP fp8 e4m3 ("fn"): bias 7, no infinities, S.1111.111 is NaN. */
  int negative = (b >> 7) & 1;
  int exponent = (b >> 3) & 0xf;
  int mantissa = b & 0x7;
  double v;
  if (exponent == 15 && mantissa == 7)
    v = NAN;
  else if (exponent == 0)
    v = ldexp((double)mantissa, -9);
  else
    v = ldexp((double)(mantissa + 8), exponent - 10);
  return negative ? -v : v;
}

double ref_load(moelink_dtype_t dtype, const void *p, size_t i) {
  switch (dtype) {
  case MOELINK_DTYPE_F32: {
    float f;
    memcpy(&f, (const char *)p + 4 * i, 4);
    return (double)f;
  }
  case MOELINK_DTYPE_BF16: {
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return ref_bf16_value(h);
  }
  case MOELINK_DTYPE_F16: {
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return ref_f16_value(h);
  }
  case MOELINK_DTYPE_FP8_E4M3: return ref_e4m3_value(((const uint8_t *)p)[i]);
  }
  return NAN;
}

static uint16_t ref_bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x0040u);
  /* Add just under half an ulp, plus one when the kept part is odd: ties go
   * to even. Overflow carries into the exponent and lands on infinity. */
  uint32_t lsb = (u >> 16) & 1u;
  return (uint16_t)((u + 0x7fffu + lsb) >> 16);
}

static uint16_t ref_f16_bits(float f) {
  uint16_t sign = signbit(f) ? 0x8000u : 0u;
  double a = fabs((double)f);
  if (isnan(f)) return (uint16_t)(sign | 0x7e00u);
  /* 65520 is halfway between the largest f16 (65504) and 2^16: ties to even
   * go up, so everything from there on is infinity. */
  if (a >= 65520.0) return (uint16_t)(sign | 0x7c00u);
  if (a < ldexp(1.0, -14)) {
    /* Subnormal range: a multiple of 2^-24. rint rounds ties to even; 1024
     * comes out as the smallest normal, which is the right encoding. */
    double m = rint(a * ldexp(1.0, 24));
    return (uint16_t)(sign | (uint16_t)m);
  }
  int e2;
  (void)frexp(a, &e2);                /* a in [2^(e2-1), 2^e2) */
  int unbiased = e2 - 1;
  double m = rint(ldexp(a, 10 - unbiased)); /* in [1024, 2048] */
  if (m >= 2048.0) {
    m = 1024.0;
    ++unbiased;
  }
  if (unbiased > 15) return (uint16_t)(sign | 0x7c00u);
  return (uint16_t)(sign | (uint16_t)((unbiased + 15) << 10) | (uint16_t)(m - 1024.0));
}

void ref_store(moelink_dtype_t dtype, void *p, size_t i, double v) {
  float f = (float)v;
  switch (dtype) {
  case MOELINK_DTYPE_F32: memcpy((char *)p + 4 * i, &f, 4); return;
  case MOELINK_DTYPE_BF16: {
    uint16_t h = ref_bf16_bits(f);
    memcpy((char *)p + 2 * i, &h, 2);
    return;
  }
  case MOELINK_DTYPE_F16: {
    uint16_t h = ref_f16_bits(f);
    memcpy((char *)p + 2 * i, &h, 2);
    return;
  }
  case MOELINK_DTYPE_FP8_E4M3: return;
  }
}

/* Row [offset, offset + n) of a dtype buffer as doubles. */
static void ref_load_row(moelink_dtype_t dtype, const void *p, size_t offset, size_t n,
                         double *dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = ref_load(dtype, p, offset + i);
}

static double ref_dot(const double *a, const double *b, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static double ref_sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

static double ref_silu(double v) { return v / (1.0 + exp(-v)); }

/* ---- router --------------------------------------------------------------- */

static int ref_cfg_routable(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w) {
  if (!cfg || !w || !w->router) return 0;
  int E = cfg->num_experts;
  if (cfg->hidden <= 0 || E <= 0 || cfg->top_k < 1 || cfg->top_k > E) return 0;
  if (cfg->n_group < 1 || E % cfg->n_group != 0) return 0;
  if (cfg->topk_group < 1 || cfg->topk_group > cfg->n_group) return 0;
  if (cfg->n_group > 1 && cfg->top_k > cfg->topk_group * (E / cfg->n_group)) return 0;
  if (cfg->router != MOELINK_ROUTER_SOFTMAX_TOPK && cfg->router != MOELINK_ROUTER_SIGMOID_TOPK &&
      cfg->router != MOELINK_ROUTER_TOPK_SOFTMAX)
    return 0;
  if (cfg->correction_bias && !w->correction_bias) return 0;
  return 1;
}

/* Relative gap between two competing values, measured against the larger of
 * the values and of what they were derived from (scale), so that a selection
 * score that nearly cancels its bias is not judged against its own tiny size. */
static double ref_gap(double a, double b, double scale) {
  double d = fabs(a);
  if (fabs(b) > d) d = fabs(b);
  if (scale > d) d = scale;
  if (d == 0.0) return 0.0;
  return fabs(a - b) / d;
}

/* Routes one token. margin (may be NULL) receives the smallest relative gap
 * between two scores whose order decides the result (see ref_route_margin). */
static int ref_route_core(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                          const void *x_row, int32_t *ids, double *weights, double *margin) {
  if (!ref_cfg_routable(cfg, w) || !x_row) return -1;
  const int H = cfg->hidden, E = cfg->num_experts, k = cfg->top_k;
  const moelink_dtype_t dt = cfg->dtype;
  double *x = calloc((size_t)H, sizeof(double));
  double *row = malloc(sizeof(double) * (size_t)H);
  double *logit = malloc(sizeof(double) * (size_t)E);
  double *score = malloc(sizeof(double) * (size_t)E);
  double *sel = malloc(sizeof(double) * (size_t)E);
  double *gscore = malloc(sizeof(double) * (size_t)cfg->n_group);
  char *eligible = malloc((size_t)E);
  char *taken = malloc((size_t)E);
  char *gkept = malloc((size_t)cfg->n_group);
  int rc = -1;
  if (!x || !row || !logit || !score || !sel || !gscore || !eligible || !taken || !gkept)
    goto done;

  ref_load_row(dt, x_row, 0, (size_t)H, x);
  for (int e = 0; e < E; ++e) {
    ref_load_row(dt, w->router, (size_t)e * (size_t)H, (size_t)H, row);
    logit[e] = ref_dot(x, row, (size_t)H);
  }

  switch (cfg->router) {
  case MOELINK_ROUTER_SOFTMAX_TOPK: {
    double mx = logit[0];
    for (int e = 1; e < E; ++e)
      if (logit[e] > mx) mx = logit[e];
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += (score[e] = exp(logit[e] - mx));
    for (int e = 0; e < E; ++e) score[e] /= sum;
    break;
  }
  case MOELINK_ROUTER_SIGMOID_TOPK:
    for (int e = 0; e < E; ++e) score[e] = ref_sigmoid(logit[e]);
    break;
  case MOELINK_ROUTER_TOPK_SOFTMAX:
    for (int e = 0; e < E; ++e) score[e] = logit[e];
    break;
  }
  for (int e = 0; e < E; ++e)
    sel[e] = score[e] + (cfg->correction_bias ? (double)w->correction_bias[e] : 0.0);

  /* Raw logits can sit near zero while their error does not shrink with
   * them: give that family an absolute floor. */
  const double floor_scale = cfg->router == MOELINK_ROUTER_TOPK_SOFTMAX ? 1e-3 : 0.0;
  double min_gap = INFINITY;

  memset(eligible, 1, (size_t)E);
  if (cfg->n_group > 1) {
    const int G = cfg->n_group, gs = E / G;
    for (int g = 0; g < G; ++g) {
      /* Top-2 of the group (top-1 when the group has one expert). */
      double best = -INFINITY, second = -INFINITY;
      for (int e = g * gs; e < (g + 1) * gs; ++e) {
        if (sel[e] > best) {
          second = best;
          best = sel[e];
        } else if (sel[e] > second) {
          second = sel[e];
        }
      }
      gscore[g] = gs >= 2 ? best + second : best;
    }
    memset(gkept, 0, (size_t)G);
    double last_kept = 0.0;
    for (int n = 0; n < cfg->topk_group; ++n) {
      int pick = -1;
      for (int g = 0; g < G; ++g)
        if (!gkept[g] && (pick < 0 || gscore[g] > gscore[pick])) pick = g;
      gkept[pick] = 1;
      last_kept = gscore[pick];
    }
    if (cfg->topk_group < G) {
      int next = -1;
      for (int g = 0; g < G; ++g)
        if (!gkept[g] && (next < 0 || gscore[g] > gscore[next])) next = g;
      double gap = ref_gap(last_kept, gscore[next], floor_scale);
      if (gap < min_gap) min_gap = gap;
    }
    for (int e = 0; e < E; ++e) eligible[e] = gkept[e / gs];
  }

  memset(taken, 0, (size_t)E);
  for (int j = 0; j < k; ++j) {
    int pick = -1;
    for (int e = 0; e < E; ++e)
      if (eligible[e] && !taken[e] && (pick < 0 || sel[e] > sel[pick])) pick = e;
    if (pick < 0) goto done;
    taken[pick] = 1;
    ids[j] = pick;
  }
  /* Gaps that decide order within the k and membership of the k-th. */
  for (int j = 0; j + 1 < k; ++j) {
    int a = ids[j], b = ids[j + 1];
    double scale = fmax(fmax(fabs(score[a]), fabs(score[b])), floor_scale);
    double gap = ref_gap(sel[a], sel[b], scale);
    if (gap < min_gap) min_gap = gap;
  }
  {
    int next = -1;
    for (int e = 0; e < E; ++e)
      if (eligible[e] && !taken[e] && (next < 0 || sel[e] > sel[next])) next = e;
    if (next >= 0) {
      int a = ids[k - 1];
      double scale = fmax(fmax(fabs(score[a]), fabs(score[next])), floor_scale);
      double gap = ref_gap(sel[a], sel[next], scale);
      if (gap < min_gap) min_gap = gap;
    }
  }

  if (cfg->router == MOELINK_ROUTER_TOPK_SOFTMAX) {
    double mx = logit[ids[0]];
    for (int j = 1; j < k; ++j)
      if (logit[ids[j]] > mx) mx = logit[ids[j]];
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += (weights[j] = exp(logit[ids[j]] - mx));
    for (int j = 0; j < k; ++j) weights[j] /= sum;
  } else {
    for (int j = 0; j < k; ++j) weights[j] = score[ids[j]];
  }
  if (cfg->renormalize) {
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += weights[j];
    for (int j = 0; j < k; ++j) weights[j] /= sum;
  }
  for (int j = 0; j < k; ++j) weights[j] *= (double)cfg->routed_scaling;
  if (margin) *margin = min_gap;
  rc = 0;

done:
  free(x);
  free(row);
  free(logit);
  free(score);
  free(sel);
  free(gscore);
  free(eligible);
  free(taken);
  free(gkept);
  return rc;
}

int ref_route_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                    const void *x_row, int32_t *ids, double *weights) {
  return ref_route_core(cfg, w, x_row, ids, weights, NULL);
}

double ref_route_margin(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                        const void *x_row) {
  if (!ref_cfg_routable(cfg, w)) return -1.0;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)cfg->top_k);
  double *wt = malloc(sizeof(double) * (size_t)cfg->top_k);
  double margin = -1.0;
  if (ids && wt && ref_route_core(cfg, w, x_row, ids, wt, &margin) != 0) margin = -1.0;
  free(ids);
  free(wt);
  return margin;
}

/* ---- experts -------------------------------------------------------------- */

/* down(silu(gate x) * up x) for one MLP: its inter gate rows start at element
 * gate_up_offset, its inter up rows follow them, its [H, inter] down matrix
 * starts at element down_offset. */
static void ref_mlp(moelink_dtype_t dt, int H, int inter, const double *x, const void *gate_up,
                    size_t gate_up_offset, const void *down, size_t down_offset, double *out) {
  double *row = malloc(sizeof(double) * (size_t)(H > inter ? H : inter));
  double *act = malloc(sizeof(double) * (size_t)inter);
  if (!row || !act) {
    for (int h = 0; h < H; ++h) out[h] = NAN;
    free(row);
    free(act);
    return;
  }
  for (int i = 0; i < inter; ++i) {
    ref_load_row(dt, gate_up, gate_up_offset + (size_t)i * (size_t)H, (size_t)H, row);
    double g = ref_dot(x, row, (size_t)H);
    ref_load_row(dt, gate_up, gate_up_offset + (size_t)(inter + i) * (size_t)H, (size_t)H, row);
    double u = ref_dot(x, row, (size_t)H);
    act[i] = ref_silu(g) * u;
  }
  for (int h = 0; h < H; ++h) {
    ref_load_row(dt, down, down_offset + (size_t)h * (size_t)inter, (size_t)inter, row);
    out[h] = ref_dot(act, row, (size_t)inter);
  }
  free(row);
  free(act);
}

/* ---- FP8 experts --------------------------------------------------------- */

#define REF_FP8_BLOCK 128

/* fp32 -> e4m3fn byte: round to nearest even, saturating at +-448 (infinity
 * too), NaN as 0x7f. Normal results are cut from the fp32 bits (generating a
 * large FP8 layer encodes billions of values); the result is the same as
 * rint(a * 2^(3 - exponent)) worked out in double, checked on every fp32. */
static uint8_t ref_e4m3_bits(float f) {
  if (isnan(f)) return 0x7f;
  const uint8_t sign = signbit(f) ? 0x80 : 0x00;
  const double a = fabs((double)f);
  /* Past 448 nearest-even would give 480, which e4m3fn lacks: saturate. */
  if (a >= 448.0) return (uint8_t)(sign | 0x7e);
  if (a < ldexp(1.0, -6)) {
    /* Subnormals are multiples of 2^-9; 8 * 2^-9 is the smallest normal's
     * code as it stands. */
    return (uint8_t)(sign | (uint8_t)rint(a * 512.0));
  }
  /* |f| in [2^-6, 448): fp32 exponent field 121..135, 23 mantissa bits of
   * which e4m3 keeps 3. Rounding the dropped 20 to nearest even may carry
   * into the exponent, which is then the right code; the fp32 bias 127 is
   * e4m3's 7 plus 120. */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u &= 0x7fffffffu;
  const uint32_t r = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
  return (uint8_t)(sign | (uint8_t)(r - (120u << 3)));
}

/* v[0, n) = dequantize(quantize(v)) per 128 elements, by the definition: the
 * values as fp32, s = amax / 448 in fp32, q = e4m3(x / s) with the division
 * in fp32, result q * s (exact in double). amax 0: all zeros. */
static void ref_fp8_qdq(double *v, int n) {
  for (int b0 = 0; b0 < n; b0 += REF_FP8_BLOCK) {
    float amax = 0.0f;
    for (int i = b0; i < b0 + REF_FP8_BLOCK; ++i) {
      const float a = fabsf((float)v[i]);
      if (a > amax) amax = a;
    }
    const float s = amax / 448.0f;
    for (int i = b0; i < b0 + REF_FP8_BLOCK; ++i)
      v[i] = s > 0.0f ? ref_e4m3_value(ref_e4m3_bits((float)v[i] / s)) * (double)s : 0.0;
  }
}

/* Row n of an FP8 matrix [rows, cols] as doubles: byte * scale[n/128][k/128]. */
static void ref_fp8_row(const uint8_t *q, const float *scale, int cols, int n, double *dst) {
  const int nb = cols / REF_FP8_BLOCK;
  for (int k = 0; k < cols; ++k)
    dst[k] = ref_e4m3_value(q[(size_t)n * (size_t)cols + (size_t)k]) *
             (double)scale[(size_t)(n / REF_FP8_BLOCK) * (size_t)nb + (size_t)(k / REF_FP8_BLOCK)];
}

/* One routed expert with FP8 weights: x and the SwiGLU output quantized per
 * 128 before their products. */
static void ref_mlp_fp8(int H, int inter, const double *x_in, const uint8_t *gate_up,
                        const float *gu_scale, const uint8_t *down, const float *dn_scale,
                        double *out) {
  double *x = malloc(sizeof(double) * (size_t)H);
  double *row = malloc(sizeof(double) * (size_t)(H > inter ? H : inter));
  double *act = malloc(sizeof(double) * (size_t)inter);
  if (!x || !row || !act) {
    for (int h = 0; h < H; ++h) out[h] = NAN;
    goto done;
  }
  memcpy(x, x_in, sizeof(double) * (size_t)H);
  ref_fp8_qdq(x, H);
  for (int i = 0; i < inter; ++i) {
    ref_fp8_row(gate_up, gu_scale, H, i, row);
    double g = ref_dot(x, row, (size_t)H);
    ref_fp8_row(gate_up, gu_scale, H, inter + i, row);
    double u = ref_dot(x, row, (size_t)H);
    act[i] = ref_silu(g) * u;
  }
  ref_fp8_qdq(act, inter);
  for (int h = 0; h < H; ++h) {
    ref_fp8_row(down, dn_scale, inter, h, row);
    out[h] = ref_dot(act, row, (size_t)inter);
  }
done:
  free(x);
  free(row);
  free(act);
}

void ref_expert_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w, int e,
                      const void *x_row, double *out) {
  const int H = cfg->hidden, I = cfg->inter;
  double *x = calloc((size_t)H, sizeof(double));
  if (!x) {
    for (int h = 0; h < H; ++h) out[h] = NAN;
    return;
  }
  ref_load_row(cfg->dtype, x_row, 0, (size_t)H, x);
  if (cfg->fp8_experts) {
    const size_t gu_blocks = (size_t)(2 * I / REF_FP8_BLOCK) * (size_t)(H / REF_FP8_BLOCK);
    ref_mlp_fp8(H, I, x, (const uint8_t *)w->gate_up + (size_t)e * 2 * (size_t)I * (size_t)H,
                w->gate_up_scale + (size_t)e * gu_blocks,
                (const uint8_t *)w->down + (size_t)e * (size_t)H * (size_t)I,
                w->down_scale + (size_t)e * (gu_blocks / 2), out);
  } else {
    ref_mlp(cfg->dtype, H, I, x, w->gate_up, (size_t)e * 2 * (size_t)I * (size_t)H, w->down,
            (size_t)e * (size_t)H * (size_t)I, out);
  }
  free(x);
}

uint8_t ref_e4m3_encode(float f) { return ref_e4m3_bits(f); }

void ref_fp8_quantize(moelink_dtype_t dtype, const void *w, int rows, int cols, uint8_t *q,
                      float *sc) {
  const int nb = cols / 128;
  float v[128 * 128]; /* one block, decoded once for its amax and its bytes */
  for (int br = 0; br < rows / 128; ++br)
    for (int bc = 0; bc < nb; ++bc) {
      float amax = 0.0f;
      for (int r = 0; r < 128; ++r)
        for (int c = 0; c < 128; ++c) {
          const float x = (float)ref_load(dtype, w, (size_t)(br * 128 + r) * cols + bc * 128 + c);
          const float a = fabsf(x);
          v[r * 128 + c] = x;
          if (a > amax) amax = a;
        }
      const float s = amax / 448.0f;
      sc[(size_t)br * nb + bc] = s;
      for (int r = 0; r < 128; ++r)
        for (int c = 0; c < 128; ++c)
          q[(size_t)(br * 128 + r) * cols + bc * 128 + c] =
              s > 0.0f ? ref_e4m3_bits(v[r * 128 + c] / s) : 0;
    }
}

void ref_shared_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                      const void *x_row, double *out) {
  const int H = cfg->hidden, Is = cfg->shared_inter;
  for (int h = 0; h < H; ++h) out[h] = 0.0;
  if (Is <= 0) return;
  double *x = calloc((size_t)H, sizeof(double));
  if (!x) {
    for (int h = 0; h < H; ++h) out[h] = NAN;
    return;
  }
  ref_load_row(cfg->dtype, x_row, 0, (size_t)H, x);
  if (cfg->fp8_shared)
    ref_mlp_fp8(H, Is, x, (const uint8_t *)w->shared_gate_up, w->shared_gate_up_scale,
                (const uint8_t *)w->shared_down, w->shared_down_scale, out);
  else
    ref_mlp(cfg->dtype, H, Is, x, w->shared_gate_up, 0, w->shared_down, 0, out);
  if (cfg->shared_gate) {
    double g = 0.0;
    for (int h = 0; h < H; ++h) g += x[h] * ref_load(cfg->dtype, w->shared_gate, (size_t)h);
    double s = ref_sigmoid(g);
    for (int h = 0; h < H; ++h) out[h] *= s;
  }
  free(x);
}

int ref_forward_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                      const void *x_row, double *out) {
  const int H = cfg->hidden, k = cfg->top_k;
  if (k < 1) return -1;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)k);
  double *wt = malloc(sizeof(double) * (size_t)k);
  double *tmp = malloc(sizeof(double) * (size_t)H);
  int rc = -1;
  if (!ids || !wt || !tmp) goto done;
  if (ref_route_token(cfg, w, x_row, ids, wt) != 0) goto done;
  ref_shared_token(cfg, w, x_row, out);
  for (int j = 0; j < k; ++j) {
    ref_expert_token(cfg, w, ids[j], x_row, tmp);
    for (int h = 0; h < H; ++h) out[h] += wt[j] * tmp[h];
  }
  rc = 0;
done:
  free(ids);
  free(wt);
  free(tmp);
  return rc;
}

double ref_rel_l2(moelink_dtype_t dtype, const void *got, const double *ref, size_t n) {
  double diff = 0.0, norm = 0.0, gnorm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    double g = ref_load(dtype, got, i);
    if (!isfinite(g)) return INFINITY;
    diff += (g - ref[i]) * (g - ref[i]);
    norm += ref[i] * ref[i];
    gnorm += g * g;
  }
  if (norm == 0.0) return sqrt(gnorm);
  return sqrt(diff / norm);
}
