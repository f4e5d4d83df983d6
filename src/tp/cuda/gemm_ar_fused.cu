/* gemm_ar at decode sizes in one kernel: c [m, n] = sum over ranks of
 * (a [m, k] b [n, k]^T rounded to the dtype), m <= ML_TPC_FUSED_MAX_M.
 *
 * The GEMM streams the weights: the MMA's M side is 64 rows of b (output
 * columns) per block, its N side the m <= 16 rows of a, and K is not split,
 * so a block's 64 x m partial is complete in its CTA. A cp.async ring of
 * 120 KiB (stages of 64, 128 or 256 k) keeps ~100 KiB of weights in flight
 * per SM (one CTA per SM). As soon as a block is done, its partial, rounded to the
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
#include "cuda/cuda.h"
#include "cuda/gemm/ptx.cuh"
#include "cuda/gemm/sm90.cuh"

#include <string.h>

#define ML_GAR_THREADS 128
#define ML_GAR_BM 64 /* rows of b (output columns) a block: 4 warps x 16 */
#define ML_GAR_RING (120 * 1024) /* bytes of the cp.async ring */
#define ML_GAR_POLL 4            /* words a thread fetches at once while summing */

/* Tiles of a stage of BK k: 64 rows of b and 16 rows of a, BK * 2 bytes
 * each; as many stages as fit the ring. */
template <int BK> struct ml_gar_tile {
  static constexpr int ROW = BK * 2;
  static constexpr int W_BYTES = ML_GAR_BM * ROW;
  static constexpr int X_BYTES = ML_TPC_FUSED_MAX_M * ROW;
  static constexpr int STAGE = W_BYTES + X_BYTES;
  static constexpr int STAGES = ML_GAR_RING / STAGE;
  static constexpr int SMEM = STAGES * STAGE;
  static_assert(STAGES >= 3, "a ring of at least three stages");
  static_assert(W_BYTES % (16 * ML_GAR_THREADS) == 0 && X_BYTES % (16 * ML_GAR_THREADS) == 0,
                "whole 16-byte chunks per thread");
};

static_assert(ML_TPC_FUSED_MAX_M == 16, "one ldmatrix.x4 of a rows: two n8 fragments");
static_assert(ML_GAR_BM * ML_TPC_FUSED_MAX_M * 2 <= ML_GAR_RING, "partial tile overlays the ring");

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

/* Byte offset of 16-byte chunk ch of tile row r: the low three chunk bits
 * XOR the row's (ldmatrix reads of 8 rows hit 8 different bank groups). */
template <int BK> static __device__ __forceinline__ uint32_t ml_gar_at(int r, int ch) {
  return (uint32_t)(r * ml_gar_tile<BK>::ROW + ((ch ^ (r & 7)) << 4));
}

/* Stage s of block n0 into ring slot `slot`: 64 rows of b and the m rows of
 * a (rows past m zero), k [s * BK, s * BK + BK). */
template <int BK>
static __device__ __forceinline__ void ml_gar_load(const ml_gar_args &p, uint32_t slot, int n0,
                                                   int s) {
  typedef ml_gar_tile<BK> T;
  constexpr int CH = T::ROW / 16; /* chunks a row */
  const int t = (int)threadIdx.x;
  const size_t kb = (size_t)p.k * 2, k0 = (size_t)s * T::ROW;
#pragma unroll
  for (int i = 0; i < T::W_BYTES / 16 / ML_GAR_THREADS; ++i) {
    const int q = t + i * ML_GAR_THREADS, r = q / CH, ch = q % CH;
    ml_cp_async16(slot + ml_gar_at<BK>(r, ch), p.b + (size_t)(n0 + r) * kb + k0 + (size_t)ch * 16,
                  16);
  }
#pragma unroll
  for (int i = 0; i < T::X_BYTES / 16 / ML_GAR_THREADS; ++i) {
    const int q = t + i * ML_GAR_THREADS, r = q / CH, ch = q % CH;
    const int ok = r < p.m;
    ml_cp_async16(slot + T::W_BYTES + ml_gar_at<BK>(r, ch),
                  p.a + (ok ? (size_t)r * kb + k0 + (size_t)ch * 16 : 0), ok ? 16 : 0);
  }
}

/* acc[f] (n8 fragment f: a rows 8f .. 8f + 7) += this warp's 16 rows of b x
 * the stage's a rows, BK / 16 k16 steps. */
template <int DT, int BK>
static __device__ __forceinline__ void ml_gar_compute(uint32_t slot, float (*acc)[4], int two) {
  typedef ml_gar_tile<BK> T;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const int ra = warp * 16 + (lane & 15), rx = (lane & 7) + ((lane >> 4) << 3);
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    uint32_t af[4], t[4];
    ml_ldmatrix_x4(slot + ml_gar_at<BK>(ra, 2 * kk + (lane >> 4)), af);
    ml_ldmatrix_x4(slot + T::W_BYTES + ml_gar_at<BK>(rx, 2 * kk + ((lane >> 3) & 1)), t);
    const uint32_t b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
    ml_mma_16816<DT>(acc[0], af, b0);
    if (two) ml_mma_16816<DT>(acc[1], af, b1);
  }
}

template <int DT, int BK>
__global__ void __launch_bounds__(ML_GAR_THREADS, 1)
    ml_gar_kernel(const __grid_constant__ ml_gar_args p) {
  typedef ml_gar_tile<BK> T;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t ring = ml_smem_u32(smem);
  const int me = p.dc.rank, nr = p.dc.nranks;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  /* One call number for all CTAs: the last CTA to finish stores it, after
   * every CTA has read the old one. */
  const uint64_t e = *(volatile uint64_t *)p.epoch + 1;
  const uint32_t flag = (uint32_t)e;
  const size_t half = (size_t)(e & 1) * p.par_cells;
  const int nk = p.k / BK, blocks = p.n / ML_GAR_BM, two = p.m > 8;
  int ok = 1;

  for (int blk = (int)blockIdx.x; blk < blocks; blk += (int)gridDim.x) {
    const int n0 = blk * ML_GAR_BM;
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
      if (s < nk) ml_gar_load<BK>(p, ring + (uint32_t)(s * T::STAGE), n0, s);
      ml_cp_async_commit();
    }
    for (int s = 0; s < nk; ++s) {
      ml_cp_async_wait<T::STAGES - 2>();
      __syncthreads(); /* stage s is in; every thread is done with stage s - 1 */
      const int nx = s + T::STAGES - 1;
      if (nx < nk) ml_gar_load<BK>(p, ring + (uint32_t)((nx % T::STAGES) * T::STAGE), n0, nx);
      ml_cp_async_commit();
      ml_gar_compute<DT, BK>(ring + (uint32_t)((s % T::STAGES) * T::STAGE), acc, two);
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

    /* Push: the block's words (two columns each) to every peer. Word i of
     * the block is row i / 32, columns n0 + 2 * (i % 32) and the next. */
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
    /* Sum in rank order as the words arrive; a thread's words (up to
     * ML_GAR_POLL) are fetched together, then only the late ones polled. */
    for (int base = (int)threadIdx.x; base < words && ok; base += ML_GAR_POLL * ML_GAR_THREADS) {
      float s2[ML_GAR_POLL][2];
      size_t w[ML_GAR_POLL];
#pragma unroll
      for (int u = 0; u < ML_GAR_POLL; ++u) {
        const int i = base + u * ML_GAR_THREADS;
        s2[u][0] = s2[u][1] = 0.f;
        w[u] = ((size_t)(i / (ML_GAR_BM / 2)) * (size_t)p.n + (size_t)n0) / 2 +
               (size_t)(i % (ML_GAR_BM / 2));
      }
      for (int src = 0; src < nr; ++src) {
        uint32_t d[ML_GAR_POLL];
        if (src == me) {
#pragma unroll
          for (int u = 0; u < ML_GAR_POLL; ++u) {
            const int i = base + u * ML_GAR_THREADS;
            d[u] = i < words ? *(const uint32_t *)(tile + (i / (ML_GAR_BM / 2)) * ML_GAR_BM +
                                                   2 * (i % (ML_GAR_BM / 2)))
                             : 0u;
          }
        } else {
          const uint64_t *cells = p.cells[me] + half + (size_t)src * p.row_cells;
          uint64_t v[ML_GAR_POLL];
#pragma unroll
          for (int u = 0; u < ML_GAR_POLL; ++u)
            v[u] = base + u * ML_GAR_THREADS < words ? ml_ll_load(cells + w[u])
                                                     : (uint64_t)flag << 32;
#pragma unroll
          for (int u = 0; u < ML_GAR_POLL; ++u)
            d[u] = (uint32_t)(v[u] >> 32) == flag ? (uint32_t)v[u]
                                                  : ml_ll_poll(&p.dc, cells + w[u], flag, src, e, &ok);
        }
#pragma unroll
        for (int u = 0; u < ML_GAR_POLL; ++u) ml_ll_add<DT>(s2[u], d[u]);
      }
#pragma unroll
      for (int u = 0; u < ML_GAR_POLL; ++u) {
        const int i = base + u * ML_GAR_THREADS;
        if (i < words && ok)
          *(uint32_t *)(p.c + (2 * w[u]) * 2) = ml_ll_pack<DT>(s2[u]);
      }
    }
    __syncthreads(); /* the tile is read before the next block's loads */
  }
  if (threadIdx.x == 0 && atomicAdd(p.ticket, 1u) == gridDim.x - 1) {
    *p.ticket = 0;
    *(volatile uint64_t *)p.epoch = e;
  }
}

/* k a stage: MOELINK_TP_AR_FUSED_BK (64, 128 or 256) where it divides k,
 * else the largest of those that does. */
MOELINK_PARAM(TP_AR_FUSED_BK, 128)

static int ml_gar_bk(int k) {
  int bk = (int)ml_param_TP_AR_FUSED_BK();
  if (bk != 64 && bk != 128 && bk != 256) bk = 128;
  while (bk > 64 && k % bk) bk /= 2;
  return bk;
}

extern "C" int ml_tpc_fused_ar_takes(moelink_dtype_t dt, const void *a, const void *b,
                                     const void *c, int m, int n, int k, size_t ll_words,
                                     int sms) {
  if (dt != MOELINK_DTYPE_BF16 && dt != MOELINK_DTYPE_F16) return 0;
  /* One block per CTA, every CTA resident: the case measured and tested (a
   * CTA would take blocks blockIdx.x + i * gridDim.x past that). */
  if ((int64_t)n > (int64_t)ML_GAR_BM * sms) return 0;
  if (m < 1 || m > ML_TPC_FUSED_MAX_M || n < ML_GAR_BM || n % ML_GAR_BM || k < 64 || k % 64)
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
  const int bk = ml_gar_bk(k);
  void (*kernel)(ml_gar_args) = NULL;
  int smem = 0;
#define ML_GAR_PICK(BK)                                                                    \
  kernel = dt == MOELINK_DTYPE_BF16 ? ml_gar_kernel<MOELINK_DTYPE_BF16, BK>                 \
                                    : ml_gar_kernel<MOELINK_DTYPE_F16, BK>;                 \
  smem = ml_gar_tile<BK>::SMEM
  if (bk == 256) {
    ML_GAR_PICK(256);
  } else if (bk == 128) {
    ML_GAR_PICK(128);
  } else {
    ML_GAR_PICK(64);
  }
#undef ML_GAR_PICK
  const int blocks = n / ML_GAR_BM;
  const int grid = blocks < sms ? blocks : sms; /* one CTA per SM, all resident */
  kernel<<<grid, ML_GAR_THREADS, (size_t)smem, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "tp: launch of the fused gemm_ar (%d CTAs) failed: %s", grid,
                   cudaGetErrorString(err));
  return MOELINK_SUCCESS;
}

/* ---- up to 128 rows: wgmma, k split over a CTA pair, data + flag exchange ----
 *
 * At 128 rows of a the tile of a is as large as the tile of b, so a CTA that
 * read all of k for 64 rows of b would pull the whole of a (1 MiB at k =
 * 4096) through L2 for 512 KiB of weights. Instead two CTAs share 128 rows
 * of b, each over half of k: CTA 2j + h streams rows 128j .. 128j + 127 of
 * b and k [h k / 2, (h + 1) k / 2), and a once per pair-half. Each of its
 * two warpgroups holds 64 rows of b x 128 rows of a (wgmma m64n128k16, rows
 * of a past m zero); warpgroup 1 - h hands its fp32 sum to the partner
 * through `pair` (global, L2) with a flag, warpgroup h adds the partner's
 * (fp32 addition commutes: the order of the two halves does not change a
 * bit), so CTA 2j + h finishes the 64 columns 128j + 64h .. + 63 (its
 * 64-column block, numbered blockIdx.x).
 *
 * Ring: seven stages of 64 k (128 rows of b, then 128 rows of a, both
 * 128-byte rows in the 128-byte swizzle the wgmma descriptors read) on
 * full / empty mbarriers. A third warpgroup loads: its thread 0 starts one
 * TMA box of b per stage, its 128 threads copy a's rows with cp.async
 * (completion arriving on the full barrier); the two wgmma warpgroups never
 * issue a load. Measured alone on one H200 (bench/gemm_ar_probe.cu) it
 * streams b at 2.2-2.4 TB/s against cuBLAS's 2.7-3.1 on the same shape, and
 * neither the variants tried (docs/PERF.md) nor leaving out the wgmma moved
 * that: the limit is in how the loads are issued, not yet found.
 *
 * Exchange: the block's partial, rounded to the dtype, is stored into every
 * peer's data slot of this rank (parity e & 1 of the call number e, so a
 * call never overwrites what a peer may still read of the previous one),
 * then, after a system fence, flag [this rank][block] = e on the peer. The
 * CTA then waits for every peer's flag of its block and sums the block over
 * ranks in rank order (fp32, one rounding). Every CTA of the grid (n / 64
 * <= SMs, one per SM) is resident, pushes before it waits, and waits give
 * up after the communicator's timeout. */

#define ML_GAW_THREADS 384 /* warpgroups 0, 1: wgmma; 2: loads */
#define ML_GAW_BK 64       /* k a stage: one 128-byte swizzled row */
#define ML_GAW_X_BYTES (ML_TPC_WIDE_MAX_M * 128)
#define ML_GAW_FULL_COUNT 129 /* the loading warpgroup's cp.async arrivals + thread 0's */
#define ML_GAW_EMPTY_COUNT 8  /* one arrival per wgmma warp */

#define ML_GAW_W_BYTES (128 * 128)                     /* 128 rows of b */
#define ML_GAW_STAGE (ML_GAW_W_BYTES + ML_GAW_X_BYTES) /* then 128 rows of a */
#define ML_GAW_STAGES 7
#define ML_GAW_SMEM (ML_GAW_STAGES * ML_GAW_STAGE + 2 * ML_GAW_STAGES * 8 + 1024)
static_assert(ML_GAW_SMEM <= 227 * 1024, "ring exceeds shared memory");

static_assert(ML_TPC_WIDE_MAX_M == 128, "the wgmma's N side is 128 rows of a");

typedef struct ml_gaw_args {
  const char *a, *b;
  char *c;
  int m, n, k;
  char *data[ML_TPC_MAX_RANKS];
  uint64_t *flags[ML_TPC_MAX_RANKS];
  size_t slot_bytes;
  int max_blocks;
  float *pair;
  uint64_t *pair_flags;
  uint64_t *epoch;
  unsigned *ticket;
  moelink_device_comm_t dc;
} ml_gaw_args;

/* Built for sm_90a only; the host launches it on compute capability 9.0. */
template <int DT>
__global__ void __launch_bounds__(ML_GAW_THREADS, 1)
    ml_gaw_kernel(const __grid_constant__ CUtensorMap map_b, const __grid_constant__ ml_gaw_args p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char ml_gaw_smem[];
  const uint32_t raw = ml_smem_u32(ml_gaw_smem);
  const uint32_t ring = (raw + 1023u) & ~1023u;
  unsigned char *ring_p = ml_gaw_smem + (ring - raw);
  const uint32_t bars = ring + (uint32_t)(ML_GAW_STAGES * ML_GAW_STAGE);
  const int t = (int)threadIdx.x, g = t >> 7, tw = t & 127, warp = tw >> 5, lane = t & 31;
  const int me = p.dc.rank, nr = p.dc.nranks;
  const uint64_t e = *(volatile uint64_t *)p.epoch + 1;
  const int blk = (int)blockIdx.x, h = blk & 1, n0 = (blk >> 1) * 128;
  const int kh = p.k / 2, nk = kh / ML_GAW_BK, kbase = h * kh;

  if (t == 0) {
    for (int s = 0; s < ML_GAW_STAGES; ++s) {
      ml_mbar_init(bars + (uint32_t)(8 * s), ML_GAW_FULL_COUNT);
      ml_mbar_init(bars + (uint32_t)(8 * (ML_GAW_STAGES + s)), ML_GAW_EMPTY_COUNT);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_b) : "memory");
  }
  /* rows of a past m: zeros in every stage, written once (the loads never
   * touch them) */
  const int zrows = ML_TPC_WIDE_MAX_M - p.m;
  for (int q = t; q < ML_GAW_STAGES * zrows * 8; q += ML_GAW_THREADS) {
    const int s = q / (zrows * 8), rest = q % (zrows * 8);
    *(uint4 *)(ring_p + s * ML_GAW_STAGE + ML_GAW_W_BYTES + (p.m + rest / 8) * 128 +
               (rest % 8) * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
  ml_fence_proxy_async();
  __syncthreads();

  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  if (g == 2) {
    /* Loads: thread 0 starts the TMA box of b's 128 rows; all 128 threads
     * copy a's rows (cp.async), whose completion arrives on the stage's full
     * barrier. */
    const size_t kb = (size_t)p.k * 2;
    int stage = 0;
    uint32_t phase = 0;
    for (int s = 0; s < nk; ++s) {
      const uint32_t slot = ring + (uint32_t)(stage * ML_GAW_STAGE);
      const uint32_t full = bars + (uint32_t)(8 * stage);
      ml_mbar_wait(bars + (uint32_t)(8 * (ML_GAW_STAGES + stage)), phase ^ 1u);
      const int k0 = kbase + s * ML_GAW_BK;
      if (tw == 0) {
        ml_mbar_arrive_tx(full, ML_GAW_W_BYTES);
        ml_tma_load_4d(slot, &map_b, full, k0, n0, 0, 0);
      }
      for (int q = tw; q < p.m * 8; q += 128) {
        const int r = q >> 3, ch = q & 7;
        ml_cp_async16(slot + (uint32_t)(ML_GAW_W_BYTES + r * 128 + ((ch ^ (r & 7)) << 4)),
                      p.a + (size_t)r * kb + (size_t)k0 * 2 + (size_t)ch * 16, 16);
      }
      ml_cp_async_arrive(full);
      if (++stage == ML_GAW_STAGES) {
        stage = 0;
        phase ^= 1u;
      }
    }
    ml_cp_async_wait<0>();
  } else {
    /* wgmma: warpgroup g takes b rows 64 g .. 64 g + 63 of each stage; a
     * stage goes back once the wgmma reading it are done (wait_group 1 after
     * the next stage's). */
    int stage = 0, prev = 0;
    uint32_t phase = 0;
    for (int s = 0; s < nk; ++s) {
      ml_mbar_wait(bars + (uint32_t)(8 * stage), phase);
      /* a came through cp.async (generic proxy); wgmma reads through the async one */
      ml_fence_proxy_async();
      const uint32_t st = ring + (uint32_t)(stage * ML_GAW_STAGE);
      const uint64_t da = ml_wgmma_desc(st + (uint32_t)(g * 64 * 128));
      const uint64_t db = ml_wgmma_desc(st + ML_GAW_W_BYTES);
      ml_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < ML_GAW_BK / 16; ++kk)
        /* 16 k = 32 bytes further along the rows: +2 in the address field */
        ml_wgmma_128<DT>(d, da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk));
      ml_wgmma_commit();
      ml_wgmma_wait<1>();
      ml_acc_fence<64>(d);
      if (s > 0 && lane == 0) ml_mbar_arrive(bars + (uint32_t)(8 * (ML_GAW_STAGES + prev)));
      prev = stage;
      if (++stage == ML_GAW_STAGES) {
        stage = 0;
        phase ^= 1u;
      }
    }
    ml_wgmma_wait<0>();
    ml_acc_fence<64>(d);
  }
  __syncthreads(); /* the ring is free: the partial tile overlays stage 0 */

  /* The k halves: warpgroup 1 - h hands its rows to the partner CTA,
   * warpgroup h adds the partner's. Thread tw of the partner's warpgroup h
   * holds the same elements as thread tw here (same warpgroup number). */
  int ok = 1;
  float4 *pair = (float4 *)p.pair;
  if (g == 2) {
    /* the loading warpgroup has no rows */
  } else if (g != h) {
    float4 *mine = pair + (size_t)blk * (16 * 128);
#pragma unroll
    for (int j = 0; j < 16; ++j)
      __stcg(mine + j * 128 + tw, make_float4(d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]));
    __threadfence();
    ml_wg_sync(1 + g);
    if (tw == 0) moelink_signal_set(p.pair_flags + blk, e);
  } else {
    if (tw == 0) ok = moelink_signal_wait(&p.dc, p.pair_flags + (blk ^ 1), e, me, ML_CCU_PRIM_AR_LL);
    ml_wg_sync(1 + g);
    const float4 *other = pair + (size_t)(blk ^ 1) * (16 * 128);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float4 v = __ldcg(other + j * 128 + tw);
      d[4 * j] += v.x;
      d[4 * j + 1] += v.y;
      d[4 * j + 2] += v.z;
      d[4 * j + 3] += v.w;
    }
    /* the block's partial rounded to the dtype: tile [row of a][64 columns].
     * d[i]: b row 16 warp + lane / 4 + 8 ((i / 2) % 2), a row 8 (i / 4) +
     * 2 (lane % 4) + i % 2. */
    uint16_t *tile = (uint16_t *)ring_p;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int col = 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
      const int row = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      if (row < p.m) tile[row * 64 + col] = (uint16_t)ml_dt_f32_to_half<DT>(d[i]);
    }
  }
  ok = __syncthreads_and(ok);

  /* Push the block to every peer, then its flag. */
  const uint16_t *tile = (const uint16_t *)ring_p;
  const size_t par = (size_t)(e & 1) * (size_t)nr * p.slot_bytes;
  const size_t col0 = (size_t)blk * 64;
  const int chunks = p.m * 8;
  for (int q = t; q < chunks && ok; q += ML_GAW_THREADS) {
    const int r = q >> 3, ch = q & 7;
    const uint4 v = *(const uint4 *)(tile + r * 64 + ch * 8);
    const size_t off = par + (size_t)me * p.slot_bytes + ((size_t)r * (size_t)p.n + col0) * 2 +
                       (size_t)ch * 16;
    for (int j = 1; j < nr; ++j) *(uint4 *)(p.data[(me + j) % nr] + off) = v;
  }
  __threadfence_system();
  __syncthreads();
  if (t < nr && t != me && ok)
    moelink_signal_set(p.flags[t] + (size_t)me * (size_t)p.max_blocks + (size_t)blk, e);
  /* Every peer's block, then the sum in rank order. */
  int got = 1;
  if (t < nr && t != me && ok)
    got = moelink_signal_wait(&p.dc, p.flags[me] + (size_t)t * (size_t)p.max_blocks + (size_t)blk,
                              e, t, ML_CCU_PRIM_AR_LL);
  ok = __syncthreads_and(ok && got);
  for (int q = t; q < chunks && ok; q += ML_GAW_THREADS) {
    const int r = q >> 3, ch = q & 7;
    const size_t at = ((size_t)r * (size_t)p.n + col0) * 2 + (size_t)ch * 16;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int src = 0; src < nr; ++src) {
      const uint4 v = src == me ? *(const uint4 *)(tile + r * 64 + ch * 8)
                                : __ldcg((const uint4 *)(p.data[me] + par +
                                                          (size_t)src * p.slot_bytes + at));
      ml_ll_add<DT>(acc, v.x);
      ml_ll_add<DT>(acc + 2, v.y);
      ml_ll_add<DT>(acc + 4, v.z);
      ml_ll_add<DT>(acc + 6, v.w);
    }
    *(uint4 *)(p.c + at) = make_uint4(ml_ll_pack<DT>(acc), ml_ll_pack<DT>(acc + 2),
                                      ml_ll_pack<DT>(acc + 4), ml_ll_pack<DT>(acc + 6));
  }
  if (t == 0 && atomicAdd(p.ticket, 1u) == gridDim.x - 1) {
    *p.ticket = 0;
    *(volatile uint64_t *)p.epoch = e;
  }
#endif
}

static size_t ml_gaw_flag_bytes(int nranks, int max_blocks) {
  return ((size_t)nranks * (size_t)max_blocks * 8 + 255) & ~(size_t)255;
}

extern "C" size_t ml_tpc_wide_symm_bytes(int nranks, size_t slot_bytes, int max_blocks) {
  return ml_gaw_flag_bytes(nranks, max_blocks) + 2 * (size_t)nranks * slot_bytes;
}

extern "C" int ml_tpc_wide_ar_takes(const ml_tpc_wide *w, moelink_dtype_t dt, const void *a,
                                    const void *b, const void *c, int m, int n, int k) {
  if (w == NULL || w->pair == NULL) return 0;
  if (dt != MOELINK_DTYPE_BF16 && dt != MOELINK_DTYPE_F16) return 0;
  if (m < 1 || m > ML_TPC_WIDE_MAX_M || n < 128 || n % 128 || k < 128 || k % 128) return 0;
  if (n / 64 > w->ctas || n / 64 > w->max_blocks) return 0;
  if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15) return 0;
  return (size_t)m * (size_t)n * 2 <= w->slot_bytes;
}

extern "C" moelink_status_t ml_tpc_wide_ar(const ml_tpc_wide *w, const ml_ccu_ll *ll,
                                           const moelink_device_comm_t *dc, moelink_dtype_t dt,
                                           const void *a, const void *b, void *c, int m, int n,
                                           int k, cudaStream_t stream) {
  ml_gaw_args p;
  memset(&p, 0, sizeof p);
  p.a = (const char *)a;
  p.b = (const char *)b;
  p.c = (char *)c;
  p.m = m;
  p.n = n;
  p.k = k;
  const size_t fb = ml_gaw_flag_bytes(dc->nranks, w->max_blocks);
  for (int r = 0; r < dc->nranks; ++r) {
    p.flags[r] = (uint64_t *)w->base[r];
    p.data[r] = w->base[r] + fb;
  }
  p.slot_bytes = w->slot_bytes;
  p.max_blocks = w->max_blocks;
  p.pair = w->pair;
  p.pair_flags = w->pair_flags;
  p.epoch = ll->epoch;
  p.ticket = ll->ticket;
  p.dc = *dc;
  CUtensorMap map;
  ML_TRY(ml_sm90_map_b(&map, dt, b, k, n, 1, 1, 128, "tp: gemm_ar"));
  void (*kernel)(CUtensorMap, ml_gaw_args) =
      dt == MOELINK_DTYPE_BF16 ? ml_gaw_kernel<MOELINK_DTYPE_BF16> : ml_gaw_kernel<MOELINK_DTYPE_F16>;
  const int grid = n / 64;
  kernel<<<grid, ML_GAW_THREADS, (size_t)ML_GAW_SMEM, stream>>>(map, p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "tp: launch of the gemm_ar kernel of %d rows (%d CTAs) failed: %s",
                   m, grid, cudaGetErrorString(err));
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_tpc_fused_prepare(int sm90) {
  const struct {
    const void *kernel;
    int smem;
  } k[] = {
      {(const void *)ml_gar_kernel<MOELINK_DTYPE_BF16, 64>, ml_gar_tile<64>::SMEM},
      {(const void *)ml_gar_kernel<MOELINK_DTYPE_F16, 64>, ml_gar_tile<64>::SMEM},
      {(const void *)ml_gar_kernel<MOELINK_DTYPE_BF16, 128>, ml_gar_tile<128>::SMEM},
      {(const void *)ml_gar_kernel<MOELINK_DTYPE_F16, 128>, ml_gar_tile<128>::SMEM},
      {(const void *)ml_gar_kernel<MOELINK_DTYPE_BF16, 256>, ml_gar_tile<256>::SMEM},
      {(const void *)ml_gar_kernel<MOELINK_DTYPE_F16, 256>, ml_gar_tile<256>::SMEM},
      {(const void *)ml_gaw_kernel<MOELINK_DTYPE_BF16>, ML_GAW_SMEM},
      {(const void *)ml_gaw_kernel<MOELINK_DTYPE_F16>, ML_GAW_SMEM},
  };
  const int count = sm90 ? 8 : 6; /* the last two: sm_90a only */
  for (int i = 0; i < count; ++i)
    ML_CUDA_TRY(
        cudaFuncSetAttribute(k[i].kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k[i].smem));
  return MOELINK_SUCCESS;
}
