/* The plan on the device: a stable sort of the T*k (token, slot) pairs by
 * expert, then offsets, tiles, sorted_pairs and pair_rows, with no host round
 * trip.
 *
 * Keys are the expert ids with anything outside [0, E) mapped to E, values
 * the pair indices 0..P-1. A radix sort over the ceil(log2(E+1)) low bits is
 * stable, so pairs of one expert stay in ascending order (the CPU plan's
 * order) and invalid pairs gather after offsets[E]. cub's device radix sort
 * launches a fixed sequence of kernels and memsets on the stream, so it is
 * capturable; its temporary storage is sized at create for max_tokens * k.
 *
 * Up to ML_P_THREADS pairs (decode) take one block instead: a stable counting
 * sort in shared memory, then the same schedule.
 *
 * The finishing kernel has two roles: block 0 finds each expert's range in
 * the sorted keys by binary search (counts and offsets, no atomics), scans the
 * per-expert tile counts and writes the tile list; the other blocks copy the
 * sorted pair indices into the plan and invert them into pair_rows. */
#define CCCL_DISABLE_NVTX
#include <cub/device/device_radix_sort.cuh>

#include "cuda/plan.cuh"

#include <stdint.h>

static int ml_plan_key_bits(int num_experts) {
  int bits = 1;
  while (bits < 31 && (1 << bits) <= num_experts) ++bits; /* 2^bits > E: keys 0..E fit */
  return bits;
}

static __global__ void ml_plan_keys(const int32_t *__restrict__ ids, int pairs, int num_experts,
                                    uint32_t *__restrict__ keys, int32_t *__restrict__ vals) {
  const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < pairs) {
    const int32_t id = ids[i];
    keys[i] = (id >= 0 && id < num_experts) ? (uint32_t)id : (uint32_t)num_experts;
    vals[i] = i;
  }
}

/* First index of sorted keys[0..n) holding a key >= v. */
static __device__ __forceinline__ int ml_plan_lower_bound(const uint32_t *keys, int n, uint32_t v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (keys[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static __global__ void __launch_bounds__(ML_P_THREADS)
    ml_plan_finish(const uint32_t *__restrict__ keys, const int32_t *__restrict__ vals, int pairs,
                   int num_experts, ml_plan_ptrs plan) {
  const int tid = (int)threadIdx.x;
  if (blockIdx.x > 0) {
    const int r = ((int)blockIdx.x - 1) * ML_P_THREADS + tid;
    if (r < pairs) {
      const int32_t pair = vals[r];
      plan.sorted_pairs[r] = pair;
      plan.pair_rows[pair] = keys[r] < (uint32_t)num_experts ? r : -1;
    }
    return;
  }
  int begin = 0, end = 0;
  if (tid < num_experts) {
    begin = ml_plan_lower_bound(keys, pairs, (uint32_t)tid);
    end = ml_plan_lower_bound(keys, pairs, (uint32_t)tid + 1);
  }
  __shared__ int scratch[ML_PLAN_SCRATCH_INTS];
  ml_plan_schedule(num_experts, begin, end, plan, ml_plan_scratch_at(scratch));
}

/* The whole plan of at most ML_P_THREADS pairs in one block (decode sizes:
 * one launch instead of keys, sort and finish). */
static __global__ void __launch_bounds__(ML_P_THREADS)
    ml_plan_small(const int32_t *__restrict__ ids, int pairs, int num_experts, ml_plan_ptrs plan) {
  __shared__ int scratch[ML_PLAN_SCRATCH_INTS];
  const int tid = (int)threadIdx.x;
  ml_plan_block(tid < pairs ? ids[tid] : -1, pairs, num_experts, plan,
                ml_plan_scratch_at(scratch));
}

extern "C" moelink_status_t ml_cuda_plan_tmp_bytes(int max_pairs, int num_experts,
                                                   size_t *bytes) {
  *bytes = 0;
  if (max_pairs <= 0) return MOELINK_SUCCESS;
  size_t need = 0;
  ML_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
      (void *)NULL, need, (const uint32_t *)NULL, (uint32_t *)NULL, (const int32_t *)NULL,
      (int32_t *)NULL, max_pairs, 0, ml_plan_key_bits(num_experts), (cudaStream_t)0));
  *bytes = need;
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_cuda_plan(const int32_t *ids, int num_tokens, int top_k,
                                         int num_experts, const ml_cuda_sort_ws *ws,
                                         const moelink_plan_t *plan, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > ML_CUDA_MAX_EXPERTS || top_k < 1 || num_tokens < 0)
    return ml_fail(MOELINK_ERR_INTERNAL, "plan: T %d, k %d, E %d out of range", num_tokens,
                   top_k, num_experts);
  if (plan->tile_rows != ML_CUDA_TILE_ROWS)
    return ml_fail(MOELINK_ERR_INTERNAL, "plan: view has tile_rows %d, not %d", plan->tile_rows,
                   ML_CUDA_TILE_ROWS);
  const int pairs = num_tokens * top_k; /* the front end bounds max_tokens * k */
  const ml_plan_ptrs p = ml_plan_ptrs_of(plan);
  if (pairs <= ML_P_THREADS) {
    ml_plan_small<<<1, ML_P_THREADS, 0, stream>>>(ids, pairs, num_experts, p);
    ML_CUDA_LAUNCHED("ml_plan_small");
    return MOELINK_SUCCESS;
  }
  {
    ml_plan_keys<<<(unsigned)((pairs + 255) / 256), 256, 0, stream>>>(ids, pairs, num_experts,
                                                                     ws->keys_in, ws->vals_in);
    ML_CUDA_LAUNCHED("ml_plan_keys");
    /* cub checks the size it is given against what it needs: a too small
     * workspace is an error, never an overrun. */
    size_t tmp_bytes = ws->tmp_bytes;
    ML_CUDA_TRY(cub::DeviceRadixSort::SortPairs(ws->tmp, tmp_bytes,
                                                (const uint32_t *)ws->keys_in, ws->keys_out,
                                                (const int32_t *)ws->vals_in, ws->vals_out,
                                                pairs, 0, ml_plan_key_bits(num_experts), stream));
  }
  const unsigned blocks = 1u + (unsigned)((pairs + ML_P_THREADS - 1) / ML_P_THREADS);
  ml_plan_finish<<<blocks, ML_P_THREADS, 0, stream>>>(ws->keys_out, ws->vals_out, pairs,
                                                      num_experts, p);
  ML_CUDA_LAUNCHED("ml_plan_finish");
  return MOELINK_SUCCESS;
}
