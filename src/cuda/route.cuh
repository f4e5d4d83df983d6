/* Device pieces of the routing rule (DESIGN.md: top-k with ties toward the
 * lower index, groups scored by their two best), the warp reductions of its
 * scores and a token's selection by one warp in registers, shared by the
 * router kernel (router.cu) and the one-kernel layer of a few tokens
 * (moe_small.cu). CUDA only. */
#ifndef MOELINK_CUDA_ROUTE_CUH
#define MOELINK_CUDA_ROUTE_CUH

#include "moelink.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* The largest v over the warp, in every lane. */
static __device__ __forceinline__ float ml_r_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* Butterfly sum: both partners add the same two values, so every lane ends
 * with bitwise the same total, and the tree is fixed: deterministic. */
static __device__ __forceinline__ float ml_r_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* A group's score: the sum of its two best selection scores (its best alone
 * for groups of one), -inf rather than NaN. The scan starts g elements in,
 * so that the lanes scanning neighbouring groups of 32 read distinct banks
 * (the best two do not depend on the order). */
static __device__ __forceinline__ float ml_r_group_score(const float *S, int g, int gsize) {
  float best = -INFINITY, second = -INFINITY;
  const float *grp = S + (size_t)g * gsize;
  int j = g % gsize;
  for (int q = 0; q < gsize; ++q) {
    const float s = grp[j];
    j = j + 1 == gsize ? 0 : j + 1;
    if (s > best) {
      second = best;
      best = s;
    } else if (s > second) {
      second = s;
    }
  }
  const float gs = gsize >= 2 ? best + second : best;
  return isnan(gs) ? -INFINITY : gs;
}

/* ml_r_rank's counts r[4] for a[j..j + M): the M loads in flight first, then
 * element m's comparison into count m % 4. */
template <int M>
static __device__ __forceinline__ void ml_r_rank_part(const float *a, int j, float v, int i,
                                                      int r[4]) {
  float u[M];
#pragma unroll
  for (int m = 0; m < M; ++m)
    u[m] = a[j + m];
#pragma unroll
  for (int m = 0; m < M; ++m)
    r[m & 3] += (u[m] > v) | ((u[m] == v) & (j + m < i));
}

/* Where element i of a[0..n) ranks: how many come before it in decreasing
 * order with ties to the lower index (the order the
 * router's warp-wide top-k picks in). Sixteen loads in flight, then four
 * independent counts (one chain of dependent adds waited a load's latency
 * for every element); the rest (all of a short array: the router's groups,
 * mixtral's 8 experts) four loads at a time, then one. */
static __device__ __forceinline__ int ml_r_rank(const float *a, int n, int i) {
  const float v = a[i];
  int r[4] = {0, 0, 0, 0};
  int j = 0;
#pragma unroll 1
  for (; j + 16 <= n; j += 16)
    ml_r_rank_part<16>(a, j, v, i, r);
#pragma unroll 1
  for (; j + 4 <= n; j += 4)
    ml_r_rank_part<4>(a, j, v, i, r);
#pragma unroll 1
  for (; j < n; ++j)
    ml_r_rank_part<1>(a, j, v, i, r);
  return (r[0] + r[1]) + (r[2] + r[3]);
}

/* Order-preserving 32-bit key of a score (no NaN: ml_r_scores turned those
 * into -inf): a > b as floats exactly when key(a) > key(b), -0 and +0 the
 * same key; every key is above 0, which stands for "no element". */
static __device__ __forceinline__ uint32_t ml_r_key(float v) {
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The score of a key (0 excluded): ml_r_key's inverse, +0 for both zeros. */
static __device__ __forceinline__ float ml_r_unkey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* The k largest of a warp's keys (ml_r_key; 0: no element) in decreasing
 * order, ties to the lower index: lane l holds element l + 32 i in key[i],
 * i < NL, and taken has the bits of its slots out of the running (no
 * element). Returns the lane's mask of chosen elements (bit i = element
 * lane + 32 i); lane 0 writes the winners to out[0..k) when out != NULL.
 * Each round: every lane's best free element by a tree of NL - 1
 * comparisons (the lower slot, the lower index, on ties), the warp's
 * largest key and then the lowest index holding it, both by redux.sync. */
template <int NL>
static __device__ __forceinline__ unsigned
ml_r_warp_topk_keys(const uint32_t (&key)[NL], unsigned taken, int k, int *out, int lane) {
  static_assert(NL <= 32 && (NL & (NL - 1)) == 0, "a lane's slots (one bit each of taken)");
  unsigned chosen = 0;
  for (int j = 0; j < k; ++j) {
    uint32_t tk[NL];
    int ti[NL];
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      tk[i] = ((taken >> i) & 1u) ? 0u : key[i];
      ti[i] = i;
    }
    /* level d keeps the better of slots i and i + 2^d at i (a multiple of
     * 2^(d+1)), the lower one on ties */
#pragma unroll
    for (int d = 1; d < NL; d *= 2)
#pragma unroll
      for (int i = 0; i < NL; i += 2 * d) {
        const bool right = tk[i + d] > tk[i];
        tk[i] = right ? tk[i + d] : tk[i];
        ti[i] = right ? ti[i + d] : ti[i];
      }
    const uint32_t bk = tk[0];
    const uint32_t m = __reduce_max_sync(0xffffffffu, bk);
    /* m > 0 while k <= n: some element is free */
    const uint32_t w = __reduce_min_sync(
        0xffffffffu, bk == m && m != 0u ? (uint32_t)(lane + 32 * ti[0]) : 0xffffffffu);
    const int be = w == 0xffffffffu ? 0 : (int)w; /* cannot happen with k <= n */
    if ((be & 31) == lane) {
      taken |= 1u << (be >> 5);
      chosen |= 1u << (be >> 5);
    }
    if (out != NULL && lane == 0)
      out[j] = be;
  }
  return chosen;
}

/* A group's score (the sum of its best two, -inf rather than NaN) from each
 * lane's best two keys b1 >= b2 of it (0: none): the warp's best, the
 * lowest lane holding it, and the best of the other lanes' bests and that
 * lane's second, by three redux.sync. Every lane of the warp calls it. */
static __device__ __forceinline__ float ml_r_group_pair(uint32_t b1, uint32_t b2, int lane) {
  const uint32_t best = __reduce_max_sync(0xffffffffu, b1);
  const uint32_t at = __reduce_min_sync(0xffffffffu, b1 == best ? (uint32_t)lane : 32u);
  const uint32_t second = __reduce_max_sync(0xffffffffu, (uint32_t)lane == at ? b2 : b1);
  const float x = ml_r_unkey(best) + ml_r_unkey(second);
  return isnan(x) ? -INFINITY : x;
}

/* The rule a selection follows (moelink_moe_config_t's router fields). */
typedef struct ml_r_rule {
  int E, k, router, n_group, topk_group;
} ml_r_rule;

/* Whether a token's warp can select in registers (ml_r_select_vals): at
 * most 256 experts (8 a lane: more would spill) and no groups, or groups
 * of a multiple of 32 experts (lane l's slots i of group g are then
 * g m <= i < (g + 1) m, m = E / n_group / 32). */
static __host__ __device__ __forceinline__ bool ml_r_regs_fit(int E, int n_group) {
  return E <= 256 && (n_group <= 1 || (E % n_group == 0 && (E / n_group) % 32 == 0));
}

/* One token's scores and k winners by its warp, held in registers: lane l
 * holds the logit of expert l + 32 i in v[i], i < NL (32 NL >= E), and gets
 * back its unbiased score (for the weights); B: the correction bias (NULL:
 * none), O: the winners, written by lane 0. A group's score (the sum of its
 * best two) comes from each lane's best two keys of the group's slots by
 * three warp reductions; lane g ranks group g. Scores that differ only in
 * the sign of a zero may give a group score of the other sign, which ranks
 * the same. ml_r_regs_fit(E, n_group) must hold; every lane of the warp
 * calls it. */
template <int NL>
static __device__ void ml_r_select_vals(float (&v)[NL], const ml_r_rule &rule, const float *B,
                                        int *O, int lane) {
  const int E = rule.E;
  if (rule.router == MOELINK_ROUTER_SOFTMAX_TOPK) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (lane + 32 * i < E)
        m = fmaxf(m, v[i]);
    m = ml_r_warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (lane + 32 * i < E) {
        v[i] = expf(v[i] - m);
        sum += v[i];
      }
    sum = ml_r_warp_sum(sum);
#pragma unroll
    for (int i = 0; i < NL; ++i)
      v[i] = v[i] / sum;
  } else if (rule.router == MOELINK_ROUTER_SIGMOID_TOPK) {
#pragma unroll
    for (int i = 0; i < NL; ++i)
      v[i] = 1.0f / (1.0f + expf(-v[i]));
  }
  uint32_t key[NL];
  unsigned taken = 0u;
#pragma unroll
  for (int i = 0; i < NL; ++i) {
    const int e = lane + 32 * i;
    const float x = B != NULL && e < E ? v[i] + B[e] : v[i];
    key[i] = e < E ? ml_r_key(isnan(x) ? -INFINITY : x) : 0u;
    if (e >= E)
      taken |= 1u << i;
  }
  if (rule.n_group > 1) {
    const int ng = rule.n_group, m = E / ng / 32;
    /* group g's score from each lane's best two keys of its m slots of the
     * group (ml_r_group_pair); lane g keeps it */
    float own = -INFINITY;
    if (m == 1) {
      /* slot g holds group g's experts: no pass over the lane's slots, and
       * the groups' reductions independent of each other */
#pragma unroll
      for (int g = 0; g < NL; ++g) {
        const float x = ml_r_group_pair(key[g], 0u, lane);
        if (lane == g)
          own = x;
      }
    } else {
#pragma unroll
      for (int g = 0; g < NL; ++g) {
        if (g >= ng)
          break;
        uint32_t b1 = 0u, b2 = 0u;
#pragma unroll
        for (int i = 0; i < NL; ++i)
          if (i >= g * m && i < (g + 1) * m) {
            if (key[i] > b1) {
              b2 = b1;
              b1 = key[i];
            } else if (key[i] > b2) {
              b2 = key[i];
            }
          }
        const float x = ml_r_group_pair(b1, b2, lane);
        if (lane == g)
          own = x;
      }
    }
    /* the groups ranked (ties to the lower index), each by its lane, the
     * topk_group first kept; the others' experts out of the running as
     * -inf (never 0) */
    int r = 0;
#pragma unroll
    for (int h = 0; h < NL; ++h) {
      const float x = __shfl_sync(0xffffffffu, own, h);
      r += h < ng && ((x > own) | ((x == own) & (h < lane)));
    }
    const unsigned kept = __ballot_sync(0xffffffffu, lane < ng && r < rule.topk_group);
    unsigned keep = 0u;
#pragma unroll
    for (int g = 0; g < NL; ++g)
      if ((kept >> g) & 1u)
        keep |= ((1u << m) - 1u) << (g * m);
    const uint32_t dropped = ml_r_key(-INFINITY);
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (!((keep >> i) & 1u) && !((taken >> i) & 1u))
        key[i] = dropped;
  }
  (void)ml_r_warp_topk_keys<NL>(key, taken, rule.k, O, lane);
}

#endif
