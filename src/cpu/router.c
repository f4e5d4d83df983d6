/* Router: logits by BLAS over blocks of router rows, then per-token scoring,
 * group-limited top-k selection and the final weights. */
#include "cpu/cpu.h"

#include <math.h>
#include <string.h>

const float *ml_cpu_x_f32(moelink_moe_t moe, const void *x, int num_tokens) {
  const moelink_moe_config_t *c = &moe->cfg;
  if (c->dtype == MOELINK_DTYPE_F32) return (const float *)x;
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const size_t H = (size_t)c->hidden, row = H * moelink_dtype_size(c->dtype);
#pragma omp parallel for num_threads(ws->nthreads) schedule(static)
  for (int t = 0; t < num_tokens; ++t)
    ml_cpu_to_f32(c->dtype, (const char *)x + row * (size_t)t, ws->xf + H * (size_t)t, H);
  return ws->xf;
}

/* Places expert e with selection value v into the list (ids, vals) of n
 * entries sorted by decreasing value, capacity k. An entry only moves ahead
 * of strictly smaller values, and experts arrive in increasing index, so ties
 * keep the lower index first. */
static int ml_topk_insert(int32_t *ids, float *vals, int n, int k, int e, float v) {
  int pos;
  if (n < k) {
    pos = n++;
  } else {
    if (!(v > vals[k - 1])) return n;
    pos = k - 1;
  }
  while (pos > 0 && v > vals[pos - 1]) {
    ids[pos] = ids[pos - 1];
    vals[pos] = vals[pos - 1];
    --pos;
  }
  ids[pos] = e;
  vals[pos] = v;
  return n;
}

/* One token. s holds its E logits and is turned into scores in place. */
static void ml_route_token(const moelink_moe_config_t *c, float *s, const float *bias,
                           int32_t *ids, float *w, float *misc) {
  const int E = c->num_experts, k = c->top_k;
  if (c->router == MOELINK_ROUTER_SOFTMAX_TOPK) {
    float mx = s[0];
    for (int e = 1; e < E; ++e)
      if (s[e] > mx) mx = s[e];
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) {
      s[e] = expf(s[e] - mx);
      sum += s[e];
    }
    for (int e = 0; e < E; ++e) s[e] = s[e] / sum;
  } else if (c->router == MOELINK_ROUTER_SIGMOID_TOPK) {
    for (int e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + expf(-s[e]));
  }

  /* misc: [n_group group scores][n_group keep flags][k selection values] */
  float *gscore = misc;
  float *gkeep = misc + c->n_group;
  float *vals = gkeep + c->n_group;
  const int G = E / c->n_group;
  if (c->n_group > 1) {
    for (int g = 0; g < c->n_group; ++g) {
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int e = g * G; e < (g + 1) * G; ++e) {
        float v = bias ? s[e] + bias[e] : s[e];
        if (v > m1) {
          m2 = m1;
          m1 = v;
        } else if (v > m2) {
          m2 = v;
        }
      }
      gscore[g] = G == 1 ? m1 : m1 + m2;
      gkeep[g] = 0.0f;
    }
    for (int i = 0; i < c->topk_group; ++i) {
      int best = -1;
      for (int g = 0; g < c->n_group; ++g)
        if (gkeep[g] == 0.0f && (best < 0 || gscore[g] > gscore[best])) best = g;
      gkeep[best] = 1.0f;
    }
  }
  int n = 0;
  for (int e = 0; e < E; ++e) {
    if (c->n_group > 1 && gkeep[e / G] == 0.0f) continue; /* excluded, as if -inf */
    n = ml_topk_insert(ids, vals, n, k, e, bias ? s[e] + bias[e] : s[e]);
  }

  if (c->router == MOELINK_ROUTER_TOPK_SOFTMAX) {
    float mx = s[ids[0]];
    for (int j = 1; j < k; ++j)
      if (s[ids[j]] > mx) mx = s[ids[j]];
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      w[j] = expf(s[ids[j]] - mx);
      sum += w[j];
    }
    for (int j = 0; j < k; ++j) w[j] = w[j] / sum;
  } else {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      w[j] = s[ids[j]];
      sum += w[j];
    }
    if (c->renormalize && sum > 0.0f)
      for (int j = 0; j < k; ++j) w[j] = w[j] / sum;
  }
  if (c->routed_scaling != 1.0f)
    for (int j = 0; j < k; ++j) w[j] = w[j] * c->routed_scaling;
}

moelink_status_t ml_cpu_route_f32(moelink_moe_t moe, const float *x32, int num_tokens,
                                  int32_t *ids, float *weights) {
  const moelink_moe_config_t *c = &moe->cfg;
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const int H = c->hidden, E = c->num_experts, k = c->top_k;
  const int rb = ws->blk.router_rows;
  const int items = (E + rb - 1) / rb;
  const float *bias = c->correction_bias ? moe->w.correction_bias : NULL;
  float *logits = ws->logits;
#pragma omp parallel num_threads(ws->nthreads)
  {
    const int tid = ml_cpu_team_thread();
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
      const int e0 = it * rb, ne = E - e0 < rb ? E - e0 : rb;
      const float *w =
          ml_cpu_weight_rows(c->dtype, moe->w.router, (size_t)e0, ne, H, ml_cpu_conv(ws, tid));
      ml_cpu_gemm(x32, H, num_tokens, H, w, ne, logits + e0, E, ml_cpu_tmp(ws, tid));
    }
    float *misc = ml_cpu_misc(ws, tid);
#pragma omp for schedule(static)
    for (int t = 0; t < num_tokens; ++t)
      ml_route_token(c, logits + (size_t)t * E, bias, ids + (size_t)t * k,
                     weights + (size_t)t * k, misc);
  }
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_route(moelink_moe_t moe, const void *x, int num_tokens, int32_t *ids,
                              float *weights, void *stream) {
  (void)stream;
  return ml_cpu_route_f32(moe, ml_cpu_x_f32(moe, x, num_tokens), num_tokens, ids, weights);
}
