/* The plan of a small batch built by one block of ML_P_THREADS threads, as
 * device functions: the plan kernels (plan.cu) call them, and so does the
 * router (router.cu), which for a single block of tokens builds the plan
 * right after choosing the experts and saves a launch.
 *
 * Scratch is passed in, not declared __shared__ here, so that a kernel with
 * a large dynamic shared memory (the router's) can lay it over memory it no
 * longer needs instead of adding static shared memory to its limit. */
#ifndef MOELINK_CUDA_PLAN_CUH
#define MOELINK_CUDA_PLAN_CUH

#include "cuda/pipeline.h"

#include <stdint.h>

#define ML_P_THREADS 512
#define ML_P_FULL 0xffffffffu

static_assert(ML_P_THREADS >= ML_CUDA_MAX_EXPERTS, "a thread for each expert");

/* Shared-memory scratch of ml_plan_block / ml_plan_schedule. */
typedef struct ml_plan_scratch {
  uint32_t *key;  /* [ML_P_THREADS] */
  int *count;     /* [E + 1] pairs of each key */
  int *first;     /* [E + 1] first sorted row of each key */
  int *off;       /* [E + 1] row offsets */
  int *tile;      /* [E + 1] first tile of each expert */
  int *warp;      /* [ML_P_THREADS / 32] */
} ml_plan_scratch;

#define ML_PLAN_SCRATCH_INTS (ML_P_THREADS + 4 * (ML_CUDA_MAX_EXPERTS + 1) + ML_P_THREADS / 32)

/* The scratch laid over ML_PLAN_SCRATCH_INTS ints at base. */
static __device__ __forceinline__ ml_plan_scratch ml_plan_scratch_at(int *base) {
  ml_plan_scratch s;
  s.key = (uint32_t *)base;
  s.count = base + ML_P_THREADS;
  s.first = s.count + ML_CUDA_MAX_EXPERTS + 1;
  s.off = s.first + ML_CUDA_MAX_EXPERTS + 1;
  s.tile = s.off + ML_CUDA_MAX_EXPERTS + 1;
  s.warp = s.tile + ML_CUDA_MAX_EXPERTS + 1;
  return s;
}

/* Offsets, tile counts and the tile list: thread e < E passes expert e's
 * rows [begin, end) of the sorted order (the others anything); every thread
 * of the block must call it. */
static __device__ void ml_plan_schedule(int E, int begin, int end, ml_plan_ptrs plan,
                                        const ml_plan_scratch &s) {
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int tiles = 0;
  if (tid < E) {
    s.off[tid] = begin;
    plan.offsets[tid] = begin;
    if (tid == E - 1) {
      s.off[E] = end;
      plan.offsets[E] = end;
    }
    tiles = (end - begin + ML_CUDA_TILE_ROWS - 1) / ML_CUDA_TILE_ROWS;
  }
  /* Exclusive scan of the per-expert tile counts over the block. */
  int incl = tiles;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(ML_P_FULL, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) s.warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < ML_P_THREADS / 32 ? s.warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(ML_P_FULL, w, o);
      if (lane >= o) w += v;
    }
    if (lane < ML_P_THREADS / 32) s.warp[lane] = w;
  }
  __syncthreads();
  incl += warp > 0 ? s.warp[warp - 1] : 0;
  const int total = s.warp[ML_P_THREADS / 32 - 1];
  if (tid < E) s.tile[tid] = incl - tiles;
  if (tid == 0) {
    s.tile[E] = total;
    *plan.num_tiles = total;
  }
  __syncthreads();

  /* Tile i belongs to the last expert whose first tile is <= i: the experts
   * after it with the same first tile have none, and the next one with tiles
   * starts past i. */
  for (int i = tid; i < total; i += ML_P_THREADS) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (s.tile[mid] <= i)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int first = s.off[lo] + (i - s.tile[lo]) * ML_CUDA_TILE_ROWS;
    const int left = s.off[lo + 1] - first;
    plan.tiles[3 * i] = lo;
    plan.tiles[3 * i + 1] = first;
    plan.tiles[3 * i + 2] = left < ML_CUDA_TILE_ROWS ? left : ML_CUDA_TILE_ROWS;
  }
}

/* s.first[e] = the first sorted row of key e (0..E), from s.count: an
 * exclusive scan by the block's first warp, E+1 <= 513 entries in 17 steps
 * of 32. Every thread may call it; s.first is complete after a barrier. */
static __device__ __forceinline__ void ml_plan_first_rows(int E, const ml_plan_scratch &s) {
  const int tid = (int)threadIdx.x;
  if (tid < 32) {
    int carry = 0;
    for (int e0 = 0; e0 <= E; e0 += 32) {
      const int e = e0 + tid;
      const int c = e <= E ? s.count[e] : 0;
      int incl = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(ML_P_FULL, incl, o);
        if (tid >= o) incl += v;
      }
      if (e <= E) s.first[e] = carry + incl - c;
      carry += __shfl_sync(ML_P_FULL, incl, 31);
    }
  }
}

/* The whole plan of pairs <= ML_P_THREADS pairs: thread i passes pair i's
 * expert id (anything past pairs); an id outside [0, E) sorts last, as key
 * E, with no row. A pair's row is the rows of smaller keys plus the pairs
 * before it with its key: a stable counting sort, the order of the large
 * path's (plan.cu). Every thread of the block must call it. */
static __device__ void ml_plan_block(int32_t id, int pairs, int E, ml_plan_ptrs plan,
                                     const ml_plan_scratch &s) {
  const int tid = (int)threadIdx.x;
  const uint32_t key = tid < pairs && id >= 0 && id < E ? (uint32_t)id : (uint32_t)E;
  s.key[tid] = key;
  for (int e = tid; e <= E; e += ML_P_THREADS)
    s.count[e] = 0;
  __syncthreads();
  if (tid < pairs)
    atomicAdd(&s.count[key], 1);
  __syncthreads();
  ml_plan_first_rows(E, s);
  __syncthreads();
  if (tid < pairs) {
    int before = 0;
    for (int j = 0; j < tid; ++j) before += s.key[j] == key;
    const int r = s.first[key] + before;
    plan.sorted_pairs[r] = tid;
    plan.pair_rows[tid] = key < (uint32_t)E ? r : -1;
  }
  int begin = 0, end = 0;
  if (tid < E) {
    begin = s.first[tid];
    end = begin + s.count[tid];
  }
  ml_plan_schedule(E, begin, end, plan, s);
}

/* The same plan for pairs <= 32 (the router's one block of T <= 16 tokens
 * with T*k <= 32): each pair's row and each key's first row and count by
 * direct counts over the <= 32 keys, and one tile a present expert (it has
 * at most 32 rows), numbered in expert order by one warp's ballot: two
 * barriers instead of ml_plan_block's scans. The same entries and values as
 * ml_plan_block. Every thread of the block must call it. */
#define ML_PLAN_SMALL_PAIRS 32
static_assert(ML_PLAN_SMALL_PAIRS <= ML_CUDA_TILE_ROWS, "an expert's rows fit one tile");

static __device__ void ml_plan_small(int32_t id, int pairs, int E, ml_plan_ptrs plan,
                                     const ml_plan_scratch &s) {
  const int tid = (int)threadIdx.x;
  const uint32_t key = tid < pairs && id >= 0 && id < E ? (uint32_t)id : (uint32_t)E;
  if (tid < ML_PLAN_SMALL_PAIRS)
    s.key[tid] = key;
  __syncthreads();
  /* key e's first row (the keys below it) and count; offsets[E] = the valid pairs */
  for (int e = tid; e <= E; e += ML_P_THREADS) {
    int below = 0, same = 0;
    for (int j = 0; j < pairs; ++j) {
      const uint32_t kj = s.key[j];
      below += kj < (uint32_t)e;
      same += kj == (uint32_t)e;
    }
    plan.offsets[e] = below;
    s.first[e] = below;
    s.count[e] = same;
  }
  int row = 0;
  if (tid < pairs) {
    for (int j = 0; j < pairs; ++j) {
      const uint32_t kj = s.key[j];
      row += (kj < key) | ((kj == key) & (j < tid));
    }
    plan.sorted_pairs[row] = tid;
    plan.pair_rows[tid] = key < (uint32_t)E ? row : -1;
  }
  __syncthreads();
  if (tid < 32) {
    /* a present expert's first pair leads it; its tile is its rank among the leaders */
    const bool lead = tid < pairs && key < (uint32_t)E && row == s.first[key];
    const unsigned leads = __ballot_sync(ML_P_FULL, lead);
    int t = 0;
    for (int j = 0; j < 32; ++j) {
      const uint32_t kj = __shfl_sync(ML_P_FULL, key, j);
      t += ((leads >> j) & 1u) && kj < key;
    }
    if (lead) {
      plan.tiles[3 * t] = (int32_t)key;
      plan.tiles[3 * t + 1] = s.first[key];
      plan.tiles[3 * t + 2] = s.count[key]; /* <= 32 rows: one tile (the assert above) */
    }
    if (tid == 0)
      *plan.num_tiles = __popc(leads);
  }
}

#endif
