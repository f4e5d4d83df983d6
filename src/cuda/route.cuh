/* Device pieces of the routing rule (DESIGN.md: top-k with ties toward the
 * lower index, groups scored by their two best) and the warp reductions of
 * its scores, shared by the router kernel (router.cu) and the one-kernel
 * layer of a few tokens (moe_small.cu). CUDA only. */
#ifndef MOELINK_CUDA_ROUTE_CUH
#define MOELINK_CUDA_ROUTE_CUH

#include <math.h>
#include <stddef.h>

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

#endif
