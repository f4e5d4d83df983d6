/* gemm_ar at decode sizes in one kernel: c [m, n] = sum over ranks of
 * (a [m, k] b [n, k]^T rounded to the dtype), m <= ML_TPC_FUSED_MAX_M.
 *
 * The GEMM streams the weights: the MMA's M side is 64 rows of b (output
 * columns) per block, its N side the m <= 16 rows of a, and K is not split,
 * so a block's 64 x m partial is complete in its CTA. A cp.async ring of
 * ML_GAR_STAGES stages of 64 k keeps ~120 KiB of weights in flight per SM
 * (one CTA per SM). As soon as a block is done, its partial, rounded to the
 * dtype, goes to every peer through the low-latency cells of the tp
 * (comm/cuda/ll.cuh: each 4-byte word with the call's flag in one 8-byte
 * store), and the CTA sums the block's words of every rank in rank order
 * (fp32, one rounding) as they arrive: the exchange of early blocks hides
 * under the weight stream of later ones, and no second kernel follows.
 *
 * Progress: a CTA pushes its block before it waits for the peers' words of
 * that block, and the grid (at most one CTA per SM, blocks taken in the same
 * order on every rank) is resident at once on an otherwise idle GPU, so every
 * wait is on a CTA that has already pushed or will push without waiting.
 * Waits give up after the communicator's timeout (moelink_comm_check then
 * reports it), never hang.
 *
 * Cells and call numbers are those of the tp's low-latency all-reduce (the
 * one-shot path of larger outputs): the two kernels share one call count, so
 * they may follow each other in any order on the tp's calls. */
#include "tp/cuda/tp_cuda.h"

#include "comm/cuda/ll.cuh"
#include "core/dtype.cuh"
#include "cuda/gemm/ptx.cuh"

#include <string.h>

#define ML_GAR_THREADS 128
#define ML_GAR_BM 64 /* rows of b (output columns) a block: 4 warps x 16 */
#define ML_GAR_BK 64 /* k a stage: 128-byte rows */
#define ML_GAR_ROW 128
#define ML_GAR_STAGES 12
#define ML_GAR_W_BYTES (ML_GAR_BM * ML_GAR_ROW)
#define ML_GAR_X_BYTES (ML_TPC_FUSED_MAX_M * ML_GAR_ROW)
#define ML_GAR_STAGE_BYTES (ML_GAR_W_BYTES + ML_GAR_X_BYTES)
#define ML_GAR_SMEM (ML_GAR_STAGES * ML_GAR_STAGE_BYTES)

static_assert(ML_TPC_FUSED_MAX_M == 16, "one ldmatrix.x4 of a rows: two n8 fragments");
static_assert(ML_GAR_BM * ML_TPC_FUSED_MAX_M * 2 <= ML_GAR_SMEM, "partial tile overlays the ring");

typedef struct ml_gar_args {
  const char *a, *b;
  char *c;
  int m, n, k;
  uint64_t *cells[ML_TPC_MAX_RANKS]; /* every rank's cells */
  size_t par_cells;                  /* cells of one parity: nranks * row_cells */
  size_t row_cells;                  /* cells of one source rank */
  uint64_t *epoch;
  unsigned *ticket;
  moelink_device_comm_t dc;
} ml_gar_args;

/* Stage s of block n0 into ring slot `slot`: 64 rows of b and the m rows of
 * a (rows past m zero), k [s * 64, s * 64 + 64). 16-byte chunk q of row r
 * lands at chunk q ^ (r & 7): ldmatrix reads conflict-free. */
static __device__ __forceinline__ void ml_gar_load(const ml_gar_args &p, uint32_t slot, int n0,
                                                   int s) {
  const int t = (int)threadIdx.x;
  const size_t kb = (size_t)p.k * 2, k0 = (size_t)s * ML_GAR_ROW;
#pragma unroll
  for (int i = 0; i < ML_GAR_W_BYTES / 16 / ML_GAR_THREADS; ++i) {
    const int q = t + i * ML_GAR_THREADS, r = q >> 3, ch = q & 7;
    ml_cp_async16(slot + (uint32_t)(r * ML_GAR_ROW + ((ch ^ (r & 7)) << 4)),
                  p.b + (size_t)(n0 + r) * kb + k0 + (size_t)ch * 16, 16);
  }
  static_assert(ML_GAR_X_BYTES / 16 == ML_GAR_THREADS, "one a chunk per thread");
  const int r = t >> 3, ch = t & 7;
  const int ok = r < p.m;
  ml_cp_async16(slot + ML_GAR_W_BYTES + (uint32_t)(r * ML_GAR_ROW + ((ch ^ (r & 7)) << 4)),
                p.a + (ok ? (size_t)r * kb + k0 + (size_t)ch * 16 : 0), ok ? 16 : 0);
}

/* acc[f] (n8 fragment f: a rows 8f .. 8f + 7) += this warp's 16 rows of b x
 * the stage's a rows, four k16 steps. */
template <int DT>
static __device__ __forceinline__ void ml_gar_compute(uint32_t slot, float (*acc)[4], int two) {
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const uint32_t ar = slot + (uint32_t)(warp * 16 + (lane & 15)) * ML_GAR_ROW;
  const uint32_t xr = slot + ML_GAR_W_BYTES + (uint32_t)((lane & 7) + ((lane >> 4) << 3)) * ML_GAR_ROW;
  const int a_x = (lane >> 4) ^ (lane & 7);
  const int b_x = ((lane >> 3) & 1) ^ (lane & 7);
#pragma unroll
  for (int kk = 0; kk < ML_GAR_BK / 16; ++kk) {
    uint32_t af[4], t[4];
    ml_ldmatrix_x4(ar + (uint32_t)(((2 * kk) ^ a_x) << 4), af);
    ml_ldmatrix_x4(xr + (uint32_t)(((2 * kk) ^ b_x) << 4), t);
    const uint32_t b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
    ml_mma_16816<DT>(acc[0], af, b0);
    if (two) ml_mma_16816<DT>(acc[1], af, b1);
  }
}

template <int DT>
__global__ void __launch_bounds__(ML_GAR_THREADS, 1)
    ml_gar_kernel(const __grid_constant__ ml_gar_args p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t ring = ml_smem_u32(smem);
  const int me = p.dc.rank, nr = p.dc.nranks;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  /* One call number for all CTAs: the last CTA to finish stores it, after
   * every CTA has read the old one. */
  const uint64_t e = *(volatile uint64_t *)p.epoch + 1;
  const uint32_t flag = (uint32_t)e;
  const size_t half = (size_t)(e & 1) * p.par_cells;
  const int nk = p.k / ML_GAR_BK, blocks = p.n / ML_GAR_BM, two = p.m > 8;
  int ok = 1;

  for (int blk = (int)blockIdx.x; blk < blocks; blk += (int)gridDim.x) {
    const int n0 = blk * ML_GAR_BM;
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int s = 0; s < ML_GAR_STAGES - 1; ++s) {
      if (s < nk) ml_gar_load(p, ring + (uint32_t)(s * ML_GAR_STAGE_BYTES), n0, s);
      ml_cp_async_commit();
    }
    for (int s = 0; s < nk; ++s) {
      ml_cp_async_wait<ML_GAR_STAGES - 2>();
      __syncthreads(); /* stage s is in; every thread is done with stage s - 1 */
      const int nx = s + ML_GAR_STAGES - 1;
      if (nx < nk)
        ml_gar_load(p, ring + (uint32_t)((nx % ML_GAR_STAGES) * ML_GAR_STAGE_BYTES), n0, nx);
      ml_cp_async_commit();
      ml_gar_compute<DT>(ring + (uint32_t)((s % ML_GAR_STAGES) * ML_GAR_STAGE_BYTES), acc, two);
    }
    ml_cp_async_wait<0>();
    __syncthreads(); /* the ring is free: the partial tile overlays it */

    /* The partial rounded to the dtype, [a row][64 columns] in shared memory.
     * Fragment element (i, j): b row warp * 16 + lane / 4 + 8 * (i >> 1), a
     * row 8 * f + 2 * (lane % 4) + (i & 1). */
    uint16_t *tile = (uint16_t *)smem;
    for (int f = 0; f < 2; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = warp * 16 + (lane >> 2) + 8 * (i >> 1);
        const int row = 8 * f + 2 * (lane & 3) + (i & 1);
        tile[row * ML_GAR_BM + col] = ml_dt_f32_to_half<DT>(acc[f][i]);
      }
    __syncthreads();

    /* Push: the block's words (two columns each) to every peer. */
    const int words = p.m * (ML_GAR_BM / 2);
    for (int i = (int)threadIdx.x; i < words; i += ML_GAR_THREADS) {
      const int row = i / (ML_GAR_BM / 2), j = i % (ML_GAR_BM / 2);
      const uint32_t d = *(const uint32_t *)(tile + row * ML_GAR_BM + 2 * j);
      const size_t w = ((size_t)row * (size_t)p.n + (size_t)n0) / 2 + (size_t)j;
      const uint64_t v = ((uint64_t)flag << 32) | d;
      for (int q = 1; q < nr; ++q) {
        const int peer = (me + q) % nr;
        ml_ll_store(p.cells[peer] + half + (size_t)me * p.row_cells + w, v);
      }
    }
    /* Sum in rank order as the words arrive. */
    for (int i = (int)threadIdx.x; i < words && ok; i += ML_GAR_THREADS) {
      const int row = i / (ML_GAR_BM / 2), j = i % (ML_GAR_BM / 2);
      const uint32_t mine = *(const uint32_t *)(tile + row * ML_GAR_BM + 2 * j);
      const size_t w = ((size_t)row * (size_t)p.n + (size_t)n0) / 2 + (size_t)j;
      float s2[2] = {0.f, 0.f};
      for (int src = 0; src < nr && ok; ++src) {
        const uint32_t d = src == me ? mine
                                     : ml_ll_poll(&p.dc, p.cells[me] + half +
                                                             (size_t)src * p.row_cells + w,
                                                  flag, src, e, &ok);
        ml_ll_add<DT>(s2, d);
      }
      *(uint32_t *)(p.c + ((size_t)row * (size_t)p.n + (size_t)n0 + 2 * (size_t)j) * 2) =
          ml_ll_pack<DT>(s2);
    }
    __syncthreads(); /* the tile is read before the next block's loads */
  }
  if (threadIdx.x == 0 && atomicAdd(p.ticket, 1u) == gridDim.x - 1) {
    *p.ticket = 0;
    *(volatile uint64_t *)p.epoch = e;
  }
}

extern "C" int ml_tpc_fused_ar_takes(moelink_dtype_t dt, const void *a, const void *b,
                                     const void *c, int m, int n, int k, size_t ll_words) {
  if (dt != MOELINK_DTYPE_BF16 && dt != MOELINK_DTYPE_F16) return 0;
  if (m < 1 || m > ML_TPC_FUSED_MAX_M || n < ML_GAR_BM || n % ML_GAR_BM || k < ML_GAR_BK ||
      k % ML_GAR_BK)
    return 0;
  if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15) return 0;
  return (size_t)m * (size_t)n / 2 <= ll_words;
}

extern "C" moelink_status_t ml_tpc_fused_ar(const ml_ccu_ll *ll, const moelink_device_comm_t *dc,
                                            moelink_dtype_t dt, const void *a, const void *b,
                                            void *c, int m, int n, int k, int sms,
                                            cudaStream_t stream) {
  ml_gar_args p;
  memset(&p, 0, sizeof p);
  p.a = (const char *)a;
  p.b = (const char *)b;
  p.c = (char *)c;
  p.m = m;
  p.n = n;
  p.k = k;
  for (int r = 0; r < dc->nranks; ++r) p.cells[r] = ll->cells[r];
  p.row_cells = ll->max_words;
  p.par_cells = (size_t)dc->nranks * ll->max_words;
  p.epoch = ll->epoch;
  p.ticket = ll->ticket;
  p.dc = *dc;
  void (*kernel)(ml_gar_args) =
      dt == MOELINK_DTYPE_BF16 ? ml_gar_kernel<MOELINK_DTYPE_BF16> : ml_gar_kernel<MOELINK_DTYPE_F16>;
  cudaError_t err = cudaFuncSetAttribute((const void *)kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, ML_GAR_SMEM);
  const int blocks = n / ML_GAR_BM;
  const int grid = blocks < sms ? blocks : sms; /* one CTA per SM, all resident */
  if (err == cudaSuccess) {
    kernel<<<grid, ML_GAR_THREADS, ML_GAR_SMEM, stream>>>(p);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "tp: launch of the fused gemm_ar (%d CTAs) failed: %s", grid,
                   cudaGetErrorString(err));
  return MOELINK_SUCCESS;
}
