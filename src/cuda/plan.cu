/* The plan on the device: a stable sort of the T*k (token, slot) pairs by
 * expert, then offsets, tiles, sorted_pairs and pair_rows, with no host round
 * trip.
 *
 * Keys are the expert ids with anything outside [0, E) mapped to E; pairs of
 * one key keep their index order (the CPU plan's order) and invalid pairs
 * gather after offsets[E]. A counting sort in two kernels:
 *   ml_plan_count    one block per chunk of consecutive pairs: the chunk's
 *                    count of each key into counts[chunk][E + 1].
 *   ml_plan_scatter  one block per chunk: each key's first row (all chunks'
 *                    counts before it) plus the rows of the earlier chunks'
 *                    pairs with that key; each warp takes a consecutive part
 *                    of the chunk, counts it, and after a prefix over the
 *                    warps writes its pairs in index order, 32 at a time
 *                    (lanes with the same key rank themselves among each
 *                    other with a match). Block 0 then writes offsets and
 *                    the tile list from the keys' totals.
 * No atomics on global memory and no ordering between blocks: the same plan
 * whatever the scheduling. Up to ML_P_THREADS pairs (decode) take one block
 * instead (ml_plan_small). Both kernels launch as programmatic dependents
 * where the stream allows it and wait (griddepcontrol.wait) before they read
 * the ids or the counts. */
#include "core/launch.cuh"
#include "cuda/plan.cuh"

#include <stdint.h>

/* Pairs of a chunk: at least ML_P_CHUNK_MIN and a multiple of ML_P_THREADS
 * (each warp's part a multiple of 32), so that there are at most
 * ML_P_MAX_CHUNKS chunks: each scatter block reads (E + 1) counts of every
 * chunk. */
#define ML_P_CHUNK_MIN 1024
#define ML_P_MAX_CHUNKS 64
#define ML_P_WARPS (ML_P_THREADS / 32)

static int ml_plan_chunk(int pairs) {
  int c = (pairs + ML_P_MAX_CHUNKS - 1) / ML_P_MAX_CHUNKS;
  c = (c + ML_P_THREADS - 1) / ML_P_THREADS * ML_P_THREADS;
  return c < ML_P_CHUNK_MIN ? ML_P_CHUNK_MIN : c;
}

/* Bytes of the per-chunk key counts of `chunks` chunks. */
static size_t ml_plan_counts_bytes(int chunks, int num_experts) {
  return (size_t)chunks * (size_t)(num_experts + 1) * sizeof(int32_t);
}

static __device__ __forceinline__ uint32_t ml_plan_key(int32_t id, int E) {
  return id >= 0 && id < E ? (uint32_t)id : (uint32_t)E;
}

/* The lanes of the warp holding the same key (lanes past the data pass a key
 * no real pair has, ~0u), and whether this lane is the lowest of them. */
static __device__ __forceinline__ uint32_t ml_plan_peers(uint32_t key, int lane, int *leader) {
  const uint32_t peers = __match_any_sync(ML_P_FULL, key);
  *leader = (int)(__ffs(peers) - 1) == lane;
  return peers;
}

static __global__ void __launch_bounds__(ML_P_THREADS)
    ml_plan_count(const int32_t *__restrict__ ids, int pairs, int E, int chunk,
                  int32_t *__restrict__ counts) {
  __shared__ int cnt[ML_CUDA_MAX_EXPERTS + 1];
  const int tid = (int)threadIdx.x, lane = tid & 31;
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  for (int e = tid; e <= E; e += ML_P_THREADS)
    cnt[e] = 0;
  __syncthreads();
  asm volatile("griddepcontrol.wait;\n" ::: "memory"); /* the ids are written */
  const int p0 = (int)blockIdx.x * chunk;
  const int p1 = pairs - p0 < chunk ? pairs : p0 + chunk;
  /* whole warps go round the loop together (match needs every lane) */
  for (int i0 = p0 + (tid & ~31); i0 < p1; i0 += ML_P_THREADS) {
    const int i = i0 + lane;
    const uint32_t key = i < p1 ? ml_plan_key(ids[i], E) : ~0u;
    int leader;
    const uint32_t peers = ml_plan_peers(key, lane, &leader);
    if (i < p1 && leader)
      atomicAdd(&cnt[key], __popc(peers));
  }
  __syncthreads();
  for (int e = tid; e <= E; e += ML_P_THREADS)
    counts[(size_t)blockIdx.x * (size_t)(E + 1) + (size_t)e] = cnt[e];
}

static __global__ void __launch_bounds__(ML_P_THREADS)
    ml_plan_scatter(const int32_t *__restrict__ ids, int pairs, int E, int chunk,
                    const int32_t *__restrict__ counts, ml_plan_ptrs plan) {
  __shared__ int scratch[ML_PLAN_SCRATCH_INTS];
  __shared__ int wrow[ML_P_WARPS][ML_CUDA_MAX_EXPERTS + 1]; /* each warp's next row of a key */
  const ml_plan_scratch s = ml_plan_scratch_at(scratch);
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = (int)blockIdx.x, chunks = (int)gridDim.x;
  const int part = chunk / ML_P_WARPS;
  const int p0 = c * chunk + warp * part;
  const int p1 = pairs - p0 < part ? pairs : p0 + part;
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  for (int e = lane; e <= E; e += 32)
    wrow[warp][e] = 0;
  /* the counts are written, and so are the ids: this kernel may start
   * before whatever wrote them (the router) has finished, the counts kernel
   * waited for it */
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  __syncwarp();
  /* this warp's part, counted */
  for (int i0 = p0; i0 < p1; i0 += 32) {
    const int i = i0 + lane;
    const uint32_t key = i < p1 ? ml_plan_key(ids[i], E) : ~0u;
    int leader;
    const uint32_t peers = ml_plan_peers(key, lane, &leader);
    if (i < p1 && leader)
      wrow[warp][key] += __popc(peers);
  }
  /* each key's total (s.count) and the rows of the earlier chunks' pairs
   * with it (s.off, for now): all chunks' counts of the key loaded at once
   * (one load latency, not one a chunk), then summed in chunk order */
  for (int e = tid; e <= E; e += ML_P_THREADS) {
    int v[ML_P_MAX_CHUNKS];
#pragma unroll
    for (int q = 0; q < ML_P_MAX_CHUNKS; ++q)
      v[q] = q < chunks ? counts[(size_t)q * (size_t)(E + 1) + (size_t)e] : 0;
    int before = 0, after = 0;
#pragma unroll
    for (int q = 0; q < ML_P_MAX_CHUNKS; ++q) {
      before += q < c ? v[q] : 0;
      after += q < c ? 0 : v[q];
    }
    s.count[e] = before + after;
    s.off[e] = before;
  }
  __syncthreads();
  ml_plan_first_rows(E, s);
  __syncthreads();
  /* warp w's first row of each key: the key's first row, the earlier
   * chunks', then the earlier warps' of this chunk */
  for (int e = tid; e <= E; e += ML_P_THREADS) {
    int row = s.first[e] + s.off[e];
    for (int w = 0; w < ML_P_WARPS; ++w) {
      const int n = wrow[w][e];
      wrow[w][e] = row;
      row += n;
    }
  }
  __syncthreads();
  const uint32_t below = (1u << lane) - 1u;
  for (int i0 = p0; i0 < p1; i0 += 32) {
    const int i = i0 + lane;
    const uint32_t key = i < p1 ? ml_plan_key(ids[i], E) : ~0u;
    int leader;
    const uint32_t peers = ml_plan_peers(key, lane, &leader);
    const int r = i < p1 ? wrow[warp][key] + __popc(peers & below) : 0;
    __syncwarp();
    if (i < p1) {
      if (leader)
        wrow[warp][key] += __popc(peers);
      plan.sorted_pairs[r] = i;
      plan.pair_rows[i] = key < (uint32_t)E ? r : -1;
    }
    __syncwarp();
  }
  if (c == 0) {
    int begin = 0, end = 0;
    if (tid < E) {
      begin = s.first[tid];
      end = begin + s.count[tid];
    }
    /* (s.off is rewritten there: every thread passed the barrier after its
     * last read above) */
    ml_plan_schedule(E, begin, end, plan, s);
  }
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

extern "C" size_t ml_cuda_plan_ws_bytes(int max_pairs, int num_experts) {
  if (max_pairs <= ML_P_THREADS)
    return 0;
  /* the most chunks of any call up to max_pairs pairs: not max_pairs' own
   * count (65537 pairs make 43 chunks of 1536, 65536 make 64 of 1024), but
   * at most one per ML_P_CHUNK_MIN pairs and at most ML_P_MAX_CHUNKS */
  int chunks = (max_pairs + ML_P_CHUNK_MIN - 1) / ML_P_CHUNK_MIN;
  if (chunks > ML_P_MAX_CHUNKS)
    chunks = ML_P_MAX_CHUNKS;
  return ml_plan_counts_bytes(chunks, num_experts);
}

extern "C" moelink_status_t ml_cuda_plan(const int32_t *ids, int num_tokens, int top_k,
                                         int num_experts, const ml_cuda_plan_ws *ws,
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
  const int chunk = ml_plan_chunk(pairs);
  const int chunks = (pairs + chunk - 1) / chunk;
  const size_t need = ml_plan_counts_bytes(chunks, num_experts);
  if (ws == NULL || ws->counts == NULL || ws->bytes < need)
    return ml_fail(MOELINK_ERR_INTERNAL, "plan: %zu workspace bytes for %d pairs, %zu needed",
                   ws != NULL ? ws->bytes : (size_t)0, pairs, need);
  const int pdl = ml_cuda_pdl_allowed(stream);
  int32_t *counts = ws->counts;
  int E = num_experts, P = pairs, ch = chunk;
  void *cargs[] = {(void *)&ids, &P, &E, &ch, &counts};
  cudaError_t e = ml_launch_kernel((const void *)ml_plan_count, dim3((unsigned)chunks),
                                   dim3(ML_P_THREADS), 0, pdl, stream, cargs);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ml_fail(MOELINK_ERR_CUDA, "launch of ml_plan_count (%d blocks) failed: %s", chunks,
                   cudaGetErrorString(e));
  }
  /* (counts: the scatter's const int32_t * has the same representation) */
  void *sargs[] = {(void *)&ids, &P, &E, &ch, &counts, (void *)&p};
  e = ml_launch_kernel((const void *)ml_plan_scatter, dim3((unsigned)chunks), dim3(ML_P_THREADS), 0,
                       pdl, stream, sargs);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ml_fail(MOELINK_ERR_CUDA, "launch of ml_plan_scatter (%d blocks) failed: %s", chunks,
                   cudaGetErrorString(e));
  }
  return MOELINK_SUCCESS;
}
