/* Device side of the decode expert GEMMs (declared in decode.h, launched by
 * src/cuda/experts_decode.cu).
 *
 * With few rows per expert an expert GEMM is a stream over its weights: every
 * weight byte is used by only a handful of rows. So the weights take the MMA's
 * M side (m16 fragments of weight rows) and the rows of one plan tile its N
 * side (n8 fragments of tokens), which wastes nothing when a tile has 1..8
 * rows, and the grid is cut so that every SM streams weights:
 *
 *   CTA = (pass, column block, K split), pass fastest in blockIdx.x
 *     pass          BN rows of one tile of the plan (a tile: <= 64 rows of one
 *                   expert; BN = 64, or 16 with the tile's rows in up to
 *                   four passes), or BN rows of a dense problem
 *     column block  128 weight rows: 128 output columns of the plain GEMM, or
 *                   64 gate rows + the 64 up rows of the same columns
 *     K split       a range of 64-wide k tiles
 *
 * Passes of one expert are adjacent, so the CTAs that read the same weight
 * block run side by side and the second read is served by L2.
 *
 * Each CTA runs a cp.async ring of stages of [128 weight rows x 64] + [BN
 * tokens x 64] bf16/f16 (mld_cfg: BN = 64 in 4 stages, or BN = 16 in 6: the
 * token rows a 64-row pass leaves empty hold two more stages of weights, and
 * a CTA's stages in flight are what limits a weight stream whose tiles have
 * few rows; the launcher takes BN = 16 where no tile has more than 16 rows,
 * or where the experts' tiles are cut into 16-row passes, ML_DECODE_NARROW),
 * 128-byte rows with the chunk swizzle of the tile engine (chunk c of row r at slot c ^ (r & 7):
 * ldmatrix phases and the copies of one row are both conflict free). Four warps each own 32 weight
 * rows (two m16 fragments) against all the tokens of the pass; only the n8
 * fragments that hold rows of the pass are loaded and multiplied.
 *
 * Epilogue: accumulators go through shared memory (transposed to [token]
 * [weight row]) so that global stores are 16-byte and row-contiguous. With
 * one K split the CTA applies SwiGLU or the row scale and stores the output.
 * With several, each CTA stores its fp32 partial block, takes a ticket, and
 * the last CTA of the output block sums the partials in split order (so the
 * sum does not depend on which CTA came last) and stores the output.
 *
 * FP8 operands (FP8 = 1): the same ring of 128-byte rows, now 128 e4m3
 * values of k a row, so a stage is exactly one 128-wide k block of the
 * scale grid (hence n and k multiples of 128). The stage's products go into
 * an fp32 block sum, which is added to the running total times the block's
 * weight scale (one per 64-row half: its rows sit in one 128-row scale
 * block) and each token's activation scale (BN fp32 values copied with the
 * stage's token rows, and the two weight scales with them). On sm_90a the
 * block sum comes from wgmma (m64nNk32 e4m3, N = 8..BN tokens, the
 * warpgroup's two 64-row halves; the ring's chunk swizzle is wgmma's 128-byte
 * swizzle once the stages are 1024-byte aligned): sm_90 has no 8-bit
 * mma.sync, which it emulates by unpacking to f16 at a cost that halved the
 * weight stream. Elsewhere (the compute_90 PTX) the m16n8k32 mma.sync path
 * stays as the portable fallback.
 *
 * Programmatic dependent launch: a kernel reads nothing a previous kernel of
 * the stream may still be writing before griddepcontrol.wait, and writes
 * nothing before it either. Weights may be streamed before the wait when the
 * expert is known without reading the plan (dense problems) or the plan is
 * known complete (ML_DECODE_PLAN_EARLY). */
#ifndef MOELINK_CUDA_GEMM_DECODE_CUH
#define MOELINK_CUDA_GEMM_DECODE_CUH

#include "cuda/cuda.h"
#include "cuda/gemm/decode.h"
#include "cuda/gemm/ptx.cuh"
#include "cuda/gemm/sm90.cuh"

#include <stddef.h>
#include <stdint.h>

#define MLD_THREADS 128
#define MLD_BM 128 /* weight rows a CTA */
#define MLD_BN 64  /* token rows a pass (the wide kernel; see mld_cfg) */
#define MLD_BN_SMALL ML_DECODE_SMALL_ROWS /* the narrow kernel's */
#define MLD_BK 64       /* k elements a stage: 128-byte rows */
#define MLD_ROW_BYTES (MLD_BK * 2)
#define MLD_W_BYTES (MLD_BM * MLD_ROW_BYTES)
#define MLD_FP8_BLOCK 128 /* k (and weight rows) per scale */
#define MLD_W_LOADS (MLD_BM / 16) /* weight rows one thread copies a stage */
/* fp32 epilogue tile [BN][MLD_CS_LD]: a row stride of 132 words puts the
 * 8 weight rows x 4 token pairs of one accumulator store in 32 banks */
#define MLD_CS_LD (MLD_BM + 4)

enum { MLD_SWIGLU = 0, MLD_SCALED = 1 };

/* The ring of a kernel whose passes have up to BN token rows: stages of 128
 * weight rows and BN token rows, as many as keep two CTAs on an SM (the FP8
 * kernel: the stages' token and weight scales after them, and 1 KiB of slack
 * to align the stages to 1024 bytes, wgmma's swizzle unit). SHORT (FP8 with
 * 16-row passes only): the ring of the kernel for short k ranges, four
 * stages, which keep three CTAs on an SM: a CTA's start and end then overlap
 * the streams of two others, at the cost of a shallower ring. */
template <int BN> struct mld_cfg {
  static constexpr int NF = BN / 8;       /* n8 token fragments */
  static constexpr int X_LOADS = BN / 16; /* token rows one thread copies a stage */
  static constexpr int X_BYTES = BN * MLD_ROW_BYTES;
  static constexpr int STAGE_BYTES = MLD_W_BYTES + X_BYTES;
  static constexpr int STAGES = BN == MLD_BN ? 4 : 6;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
  static constexpr int SCALE_BYTES = BN * 4;
  static constexpr int WSCALE_BYTES = 16; /* the stage's two weight scales, padded */
  static constexpr int fp8_stages(int short_k) { return short_k ? 4 : STAGES; }
  static constexpr int fp8_ctas(int short_k) { return short_k ? 3 : 2; } /* an SM */
  static constexpr int fp8_smem_bytes(int short_k) {
    return fp8_stages(short_k) * (STAGE_BYTES + SCALE_BYTES + WSCALE_BYTES) + 1024;
  }
  static constexpr int FP8_SMEM_BYTES = fp8_smem_bytes(0);
};

static_assert(MLD_BN >= ML_CUDA_TILE_ROWS, "a plan tile must fit one pass of the wide kernel");
static_assert(MLD_BN * MLD_CS_LD * 4 <= mld_cfg<MLD_BN>::SMEM_BYTES &&
                  MLD_BN_SMALL * MLD_CS_LD * 4 <= mld_cfg<MLD_BN_SMALL>::SMEM_BYTES,
              "epilogue tile overlays the ring");
static_assert(2 * (mld_cfg<MLD_BN_SMALL>::FP8_SMEM_BYTES + 1024) <= 228 * 1024 &&
                  2 * (mld_cfg<MLD_BN>::FP8_SMEM_BYTES + 1024) <= 228 * 1024,
              "two CTAs an SM");
static_assert(3 * (mld_cfg<MLD_BN_SMALL>::fp8_smem_bytes(1) + 1024) <= 228 * 1024 &&
                  MLD_BN_SMALL * MLD_CS_LD * 4 <= 4 * mld_cfg<MLD_BN_SMALL>::STAGE_BYTES,
              "the short-k FP8 kernel: three CTAs an SM, the epilogue tile over its ring");
static_assert(mld_cfg<MLD_BN_SMALL>::STAGE_BYTES % 1024 == 0 &&
                  mld_cfg<MLD_BN>::STAGE_BYTES % 1024 == 0,
              "FP8 stages stay 1024-byte aligned");
static_assert(MLD_THREADS == 128 && MLD_BM == 128, "warp layout: 4 warps x 32 weight rows");

/* Output columns a CTA covers. */
template <int MODE> struct mld_cols {
  static constexpr int N = MODE == MLD_SWIGLU ? MLD_BM / 2 : MLD_BM;
};

typedef struct mld_args {
  const char *a;             /* activations, lda elements a row */
  const int32_t *a_index;    /* gather index or NULL */
  const char *b;             /* weights [E][rows_of_b][k] */
  void *out;                 /* [rows][n] */
  const int32_t *tiles;      /* plan tiles or NULL (dense) */
  const int32_t *num_tiles;
  const float *row_scale;    /* MLD_SCALED only; NULL: 1 */
  const int32_t *scale_index;
  void *const *out_rows;     /* MLD_SCALED only: see ml_decode_opts */
  float *partials;           /* [splits][rows][ncols] fp32 (splits > 1) */
  uint32_t *tickets;         /* [passes][mblocks] (splits > 1) */
  int lda, a_div, n, k, rows;
  int passes, mblocks, splits, kt_per;
  int early;                 /* tile list and weights readable before the wait */
  int no_mma;                /* ML_DECODE_PROBE_NO_MMA */
  /* SwiGLU into fp32 only, NULL: none. The output also quantized per 128
   * columns (moelink_quantize's FP8) into q [rows][n] and q_scale [rows][n /
   * 128] by the second CTA of each pair of column blocks to finish (its
   * ticket in q_tickets [passes][mblocks / 2]) */
  uint8_t *q;
  float *q_scale;
  uint32_t *q_tickets;
  int sub;                   /* passes a tile (passes = tiles x sub): row block j of
                              * BN rows of tile t is pass t x sub + j */
  int small;                 /* host only: the kernel of MLD_BN_SMALL-row passes */
  int short_k;               /* host only: with small, FP8: the short-k ring (mld_cfg) */
  /* FP8 only: a_scale[g * as_ld + kb] for A row g, b_scale[(e * b_rblocks
   * + weight row / 128) * kblocks + kb] */
  const float *a_scale;
  const float *b_scale;
  int as_ld, kblocks, b_rblocks;
} mld_args;

/* ---- small device helpers -------------------------------------------------- */

/* Grid dependency control (sm_90); both are no-ops in a kernel launched
 * without programmatic stream serialization. */
static __device__ __forceinline__ void mld_grid_wait(void) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
static __device__ __forceinline__ void mld_grid_launch_dependents(void) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

static __device__ __forceinline__ float mld_swiglu(float g, float u) {
  /* __expf overflows to inf for very negative g: g / inf = -0, the limit */
  return g / (1.0f + __expf(-g)) * u;
}

/* Tile row of the first row of m16 fragment mi of warp w. SwiGLU: gate rows
 * are tile rows 0..63 and the up rows of the same columns 64..127, so
 * fragment 0 (gate) and fragment 1 (up) of a warp hold the two factors of
 * the same 16 output columns in the same accumulator slots. */
template <int MODE> static __device__ __forceinline__ int mld_frag_row(int warp, int mi) {
  return MODE == MLD_SWIGLU ? mi * 64 + warp * 16 : warp * 32 + mi * 16;
}

/* Output column and row of the expert's weight matrix that tile row tr of
 * column block col0 stands for; false past n. */
template <int MODE>
static __device__ __forceinline__ bool mld_weight_row(int tr, int col0, int n, int *col,
                                                      int *wrow) {
  if (MODE == MLD_SWIGLU) {
    *col = col0 + (tr & 63);
    *wrow = tr < 64 ? *col : n + *col;
  } else {
    *col = col0 + tr;
    *wrow = *col;
  }
  return *col < n;
}

/* 16-byte copies of one stage's weight rows (k tile kt). dst is this
 * thread's swizzled slot in row r0 of the stage; its rows are r0 + 16i,
 * which share (row & 7) and so the swizzle. Chunks past k zero-fill. */
template <int ES>
static __device__ __forceinline__ void mld_load_w(uint32_t dst, const char *const *wp,
                                                  uint32_t valid, int kcol, int k) {
  const int in_k = kcol < k;
  const size_t off = in_k ? (size_t)kcol * ES : 0;
#pragma unroll
  for (int i = 0; i < MLD_W_LOADS; ++i)
    ml_cp_async16(dst + (uint32_t)(i * 16 * MLD_ROW_BYTES), wp[i] + off,
                  in_k && ((valid >> i) & 1) ? 16 : 0);
}

/* Token rows: rows the pass does not have are zero-filled up to a multiple
 * of 16 (one ldmatrix.x4 group) and not touched past it. */
template <int ES, int XL>
static __device__ __forceinline__ void mld_load_x(uint32_t dst, const char *const *xp,
                                                  uint32_t valid, uint32_t issue, int kcol, int k) {
  const int in_k = kcol < k;
  const size_t off = in_k ? (size_t)kcol * ES : 0;
#pragma unroll
  for (int i = 0; i < XL; ++i)
    if ((issue >> i) & 1)
      ml_cp_async16(dst + (uint32_t)(i * 16 * MLD_ROW_BYTES), xp[i] + off,
                    in_k && ((valid >> i) & 1) ? 16 : 0);
}

/* FP8: the activation scales of k block kb for the rows r0 + 16 i this
 * thread copies, into the stage's scale array dst (zeros for missing rows,
 * nothing past the last 16-row group). */
template <int XL>
static __device__ __forceinline__ void mld_load_scales(uint32_t dst, int r0, const float *const *sp,
                                                       uint32_t valid, uint32_t issue, int kb) {
#pragma unroll
  for (int i = 0; i < XL; ++i)
    if ((issue >> i) & 1)
      ml_cp_async4(dst + (uint32_t)((r0 + 16 * i) * 4), sp[i] + kb, ((valid >> i) & 1) ? 4 : 0);
}

/* FP8: the weight scales of k block kb for the two m16 fragments' row blocks
 * (swp[0], swp[1]) into the stage's pair at dst. */
static __device__ __forceinline__ void mld_load_wscales(uint32_t dst, const float *const *swp,
                                                        int kb) {
  ml_cp_async4(dst, swp[0] + kb, 4);
  ml_cp_async4(dst + 4, swp[1] + kb, 4);
}

/* One stage: four k16 steps (FP8: k32 steps of e4m3, the same 32 bytes of a
 * row, whose fragments sit where the 16-bit ones do); per step two
 * ldmatrix.x4 of weights, one per 16 tokens in use, and 2 x (n8 fragments in
 * use) MMAs into acc. nv and np are the n8 fragments and 16-token groups in
 * use (uniform over the CTA). */
template <int MODE, int DT, int FP8, int NF>
static __device__ __forceinline__ void mld_compute_stage(uint32_t slot, float (*acc)[NF][4], int nv,
                                                         int np) {
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const uint32_t a0 =
      slot + (uint32_t)(mld_frag_row<MODE>(warp, 0) + (lane & 15)) * MLD_ROW_BYTES;
  const uint32_t a1 =
      slot + (uint32_t)(mld_frag_row<MODE>(warp, 1) + (lane & 15)) * MLD_ROW_BYTES;
  const uint32_t xr =
      slot + MLD_W_BYTES + (uint32_t)((lane & 7) + ((lane >> 4) << 3)) * MLD_ROW_BYTES;
  const int a_x = (lane >> 4) ^ (lane & 7);
  const int b_x = ((lane >> 3) & 1) ^ (lane & 7);
#pragma unroll
  for (int kk = 0; kk < MLD_BK / 16; ++kk) {
    uint32_t af[2][4], bf[NF][2];
    const uint32_t a_col = (uint32_t)(((2 * kk) ^ a_x) << 4);
    const uint32_t b_col = (uint32_t)(((2 * kk) ^ b_x) << 4);
    ml_ldmatrix_x4(a0 + a_col, af[0]);
    ml_ldmatrix_x4(a1 + a_col, af[1]);
#pragma unroll
    for (int q = 0; q < NF / 2; ++q) {
      if (q < np) {
        uint32_t t[4];
        ml_ldmatrix_x4(xr + (uint32_t)(q * 16 * MLD_ROW_BYTES) + b_col, t);
        bf[2 * q][0] = t[0];
        bf[2 * q][1] = t[1];
        bf[2 * q + 1][0] = t[2];
        bf[2 * q + 1][1] = t[3];
      } else {
        bf[2 * q][0] = bf[2 * q][1] = bf[2 * q + 1][0] = bf[2 * q + 1][1] = 0u;
      }
    }
#pragma unroll
    for (int ni = 0; ni < NF; ++ni)
      if (ni < nv) {
        if (FP8) {
          ml_mma_16832_e4m3(acc[0][ni], af[0], bf[ni]);
          ml_mma_16832_e4m3(acc[1][ni], af[1], bf[ni]);
        } else {
          ml_mma_16816<DT>(acc[0][ni], af[0], bf[ni]);
          ml_mma_16816<DT>(acc[1][ni], af[1], bf[ni]);
        }
      }
  }
}

/* FP8: acc += blk x (weight scale of the fragment) x (token scale), the
 * token scales of the stage at sx in shared memory. */
template <int NB, int NF>
static __device__ __forceinline__ void mld_promote_fp8(float (*acc)[NF][4], float (*blk)[NB][4],
                                                       const float *sx, const float sw[2], int nv) {
  const int ft = ((int)threadIdx.x & 3) * 2;
#pragma unroll
  for (int ni = 0; ni < NB; ++ni) {
    if (ni >= nv) continue;
    const float2 s = *(const float2 *)(sx + ni * 8 + ft);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const float f0 = sw[mi] * s.x, f1 = sw[mi] * s.y;
      acc[mi][ni][0] = fmaf(blk[mi][ni][0], f0, acc[mi][ni][0]);
      acc[mi][ni][1] = fmaf(blk[mi][ni][1], f1, acc[mi][ni][1]);
      acc[mi][ni][2] = fmaf(blk[mi][ni][2], f0, acc[mi][ni][2]);
      acc[mi][ni][3] = fmaf(blk[mi][ni][3], f1, acc[mi][ni][3]);
    }
  }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* d[64 x N] (+)= W[64 x 32] X[N x 32]^T, e4m3 from shared memory (wgmma),
 * for the token counts a pass rounds up to. */
template <int N>
static __device__ __forceinline__ void mld_wgmma_e4m3(float *d, uint64_t da, uint64_t db,
                                                      int accumulate);
template <>
__device__ __forceinline__ void mld_wgmma_e4m3<8>(float *d, uint64_t da, uint64_t db,
                                                  int accumulate) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %6, 0;\n"
               " wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5,"
               " p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "l"(da), "l"(db), "r"(accumulate));
}
template <>
__device__ __forceinline__ void mld_wgmma_e4m3<16>(float *d, uint64_t da, uint64_t db,
                                                   int accumulate) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
               " wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"
               " {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7])
               : "l"(da), "l"(db), "r"(accumulate));
}
template <>
__device__ __forceinline__ void mld_wgmma_e4m3<32>(float *d, uint64_t da, uint64_t db,
                                                   int accumulate) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
               " wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3"
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15},"
               " %16, %17, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(da), "l"(db), "r"(accumulate));
}
template <>
__device__ __forceinline__ void mld_wgmma_e4m3<64>(float *d, uint64_t da, uint64_t db,
                                                   int accumulate) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
               " wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
               " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},"
               " %32, %33, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                 "+f"(d[30]), "+f"(d[31])
               : "l"(da), "l"(db), "r"(accumulate));
}

/* One FP8 stage through wgmma, promoted: blk[h] = the stage's sums of weight
 * rows 64 h .. 64 h + 63 against the first N tokens, then acc += blk x
 * scales (mld_promote_fp8). blk[h][ni][e] is where the mma.sync path keeps
 * the same (row, token): wgmma's accumulator of row 16 warp + lane / 4 +
 * 8 (e / 2), token 8 ni + 2 (lane % 4) + e % 2. Each N has its own blk:
 * one array shared by the four token counts made ptxas serialize the wgmma
 * (warning C7511). */
template <int N, int NF>
static __device__ __forceinline__ void mld_wgmma_stage(uint32_t slot, float (*acc)[NF][4],
                                                       const float *sx, const float sw[2]) {
  static_assert(N <= 8 * NF, "the token count fits the accumulators");
  float blk[2][N / 8][4];
  const uint64_t dx = ml_wgmma_desc(slot + MLD_W_BYTES);
  ml_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < MLD_ROW_BYTES / 32; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      mld_wgmma_e4m3<N>(&blk[h][0][0],
                        ml_wgmma_desc(slot + (uint32_t)(h * 64 * MLD_ROW_BYTES)) + (uint64_t)(2 * kk),
                        dx + (uint64_t)(2 * kk), kk);
  ml_wgmma_commit();
  ml_wgmma_wait<0>();
  ml_acc_fence<N / 2>(&blk[0][0][0]);
  ml_acc_fence<N / 2>(&blk[1][0][0]);
  mld_promote_fp8<N / 8, NF>(acc, blk, sx, sw, N / 8);
}
#endif

/* Tile row of accumulator half (or fragment) mi's first row for warp w: the
 * wgmma path's halves are rows 64 mi .., the mma.sync path's fragments
 * mld_frag_row. */
template <int MODE, int FP8> static __device__ __forceinline__ int mld_acc_row(int warp, int mi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (FP8) return mi * 64 + warp * 16;
#endif
  return mld_frag_row<MODE>(warp, mi);
}


/* Eight fp32 values rounded to DT, stored as one 16-byte write. */
template <int DT>
static __device__ __forceinline__ void mld_store8(void *dst, const float *v) {
  uint4 w;
  w.x = ml_pack2<DT>(v[0], v[1]);
  w.y = ml_pack2<DT>(v[2], v[3]);
  w.z = ml_pack2<DT>(v[4], v[5]);
  w.w = ml_pack2<DT>(v[6], v[7]);
  *(uint4 *)dst = w;
}

/* out[row, col .. col+7] from eight fp32 results (dtype or fp32); with
 * p.out_rows (dtype output) into the row p.out_rows[scale_index[row]]. */
template <int DT, int OUT_F32>
static __device__ __forceinline__ void mld_store_out(const mld_args &p, int row, int col,
                                                     const float *v) {
  void *out = p.out;
  const int n = p.n;
  if (!OUT_F32 && p.out_rows != NULL) {
    char *d = (char *)p.out_rows[p.scale_index != NULL ? __ldcg(p.scale_index + row) : row];
    mld_store8<DT>(d + (size_t)col * 2, v);
  } else if (OUT_F32) {
    float4 *d = (float4 *)((char *)out + ((size_t)row * (size_t)n + (size_t)col) * 4);
    d[0] = make_float4(v[0], v[1], v[2], v[3]);
    d[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    mld_store8<DT>((char *)out + ((size_t)row * (size_t)n + (size_t)col) * 2, v);
  }
}

static __device__ __forceinline__ float mld_row_scale(const mld_args &p, int row) {
  if (p.row_scale == NULL) return 1.0f;
  return __ldcg(p.row_scale + (p.scale_index != NULL ? __ldcg(p.scale_index + row) : row));
}

static __device__ __forceinline__ void mld_add8(float *acc, const float *src) {
  const float4 lo = __ldcg((const float4 *)src), hi = __ldcg((const float4 *)src + 1);
  acc[0] += lo.x;
  acc[1] += lo.y;
  acc[2] += lo.z;
  acc[3] += lo.w;
  acc[4] += hi.x;
  acc[5] += hi.y;
  acc[6] += hi.z;
  acc[7] += hi.w;
}

/* The FP8 output of a SwiGLU launch (mld_args.q): once this CTA's fp32
 * output block (rows row0 .. row0 + rows - 1, column block mb of 64) is
 * stored, the CTA that finishes the second of the pair of column blocks
 * making a 128-column quantization block reads both back and quantizes them
 * as moelink_quantize's FP8 does (ml_q_quantize8: the same bytes and scales):
 * two rows a warp, 8 values a lane. Every thread of the CTA calls it. */
static __device__ void mld_quantize_out(const mld_args &p, int pass, int mb, int row0,
                                        int rows) {
  __shared__ int s_second;
  /* this CTA's output published with its ticket; the second CTA of the pair
   * also sees the first's */
  if (!ml_cta_ticket(p.q_tickets + (size_t)pass * (size_t)(p.mblocks / 2) + (size_t)(mb / 2), 1u,
                     &s_second))
    return;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const int col = (mb / 2) * MLD_FP8_BLOCK + (lane & 15) * 8;
  const float *out = (const float *)p.out;
  for (int r2 = 2 * warp; r2 < rows; r2 += 2 * (MLD_THREADS / 32)) {
    const int r = r2 + (lane >> 4), live = r < rows;
    const size_t row = (size_t)(row0 + (live ? r : 0));
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (live) {
      const float4 lo = __ldcg((const float4 *)(out + row * (size_t)p.n + col));
      const float4 hi = __ldcg((const float4 *)(out + row * (size_t)p.n + col) + 1);
      f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w;
      f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
    }
    const uint2 b = ml_q_quantize8<MOELINK_QUANT_FP8>(
        f, col, live, p.q_scale + row * (size_t)(p.n / MLD_FP8_BLOCK), lane);
    if (live) *(uint2 *)(p.q + row * (size_t)p.n + col) = b;
  }
}

/* ---- the kernel ---------------------------------------------------------------- */

/* DT: the operands' dtype and the output's, or with FP8 = 1 the output's
 * (operands e4m3). BN: token rows a pass (mld_cfg): 64, or 16 where no tile
 * has more rows or tiles are cut into passes (p.sub > 1). SHORT: the FP8
 * ring for short k ranges (mld_cfg). */
template <int DT, int MODE, int OUT_F32, int FP8, int BN, int SHORT = 0>
static __global__ void __launch_bounds__(MLD_THREADS, mld_cfg<BN>::fp8_ctas(FP8 &&SHORT))
    mld_kernel(const mld_args p) {
  static_assert(!SHORT || (FP8 && BN == MLD_BN_SMALL), "the short-k ring: FP8, 16-row passes");
  extern __shared__ __align__(128) char mld_smem[];
  __shared__ int s_last;
  typedef mld_cfg<BN> C;
  constexpr int COLS = mld_cols<MODE>::N;
  constexpr int ES = FP8 ? 1 : 2;                   /* operand bytes */
  constexpr int KT = MLD_ROW_BYTES / ES;            /* k of a stage */
  constexpr int SB = C::STAGE_BYTES;
  constexpr int STAGES = FP8 ? C::fp8_stages(SHORT) : C::STAGES, NF = C::NF, XL = C::X_LOADS;
  const int tid = (int)threadIdx.x;
  int item = (int)blockIdx.x;
  const int pass = item % p.passes;
  item /= p.passes;
  const int split = item % p.splits;
  const int mb = item / p.splits;

  if (!p.early) mld_grid_wait();
  int expert = 0, row0, rows;
  if (p.tiles != NULL) {
    /* row block j of tile t (p.sub blocks a tile, adjacent: their CTAs read
     * the same weights side by side) */
    const int t = pass / p.sub, j = pass - t * p.sub;
    if (t >= __ldcg(p.num_tiles)) {
      if (p.early) mld_grid_wait();
      return;
    }
    expert = __ldcg(p.tiles + 3 * t);
    row0 = __ldcg(p.tiles + 3 * t + 1) + j * BN;
    rows = __ldcg(p.tiles + 3 * t + 2) - j * BN;
  } else {
    row0 = pass * BN;
    rows = p.rows - row0;
  }
  /* a pass never holds more than BN rows, nor rows past the problem's (the
   * partials are laid out by p.rows) */
  rows = rows < BN ? rows : BN;
  if (row0 < 0 || row0 >= p.rows || rows <= 0) {
    if (p.early) mld_grid_wait();
    return;
  }
  rows = rows < p.rows - row0 ? rows : p.rows - row0;

  const int col0 = mb * COLS;
  const int ktiles = (p.k + KT - 1) / KT;
  const int kt0 = split * p.kt_per;
  int nkt = ktiles - kt0 < p.kt_per ? ktiles - kt0 : p.kt_per;
  nkt = nkt > 0 ? nkt : 0;

  /* this thread's copy slots: chunk c of rows r0 + 16i */
  const int c = tid & 7, r0 = tid >> 3;
  const uint32_t swz = (uint32_t)(r0 * MLD_ROW_BYTES + ((c ^ (r0 & 7)) << 4));
  const uint32_t raw = ml_smem_u32(mld_smem);
  /* FP8: stages 1024-byte aligned (wgmma's swizzle), token scales after them,
   * then the weight scales */
  const uint32_t base = FP8 ? (raw + 1023u) & ~1023u : raw;
  const uint32_t scl = base + (uint32_t)(STAGES * SB);
  const uint32_t wsc = scl + (uint32_t)(STAGES * C::SCALE_BYTES); /* FP8: weight scales */

  const size_t wrows = (size_t)(MODE == MLD_SWIGLU ? 2 * p.n : p.n);
  const char *wbase = p.b + (size_t)expert * wrows * (size_t)p.k * ES;
  const char *wp[MLD_W_LOADS];
  uint32_t wvalid = 0;
#pragma unroll
  for (int i = 0; i < MLD_W_LOADS; ++i) {
    int col, wrow;
    const bool ok = mld_weight_row<MODE>(r0 + 16 * i, col0, p.n, &col, &wrow);
    wp[i] = ok ? wbase + (size_t)wrow * (size_t)p.k * ES : wbase;
    wvalid |= (uint32_t)ok << i;
  }

  /* The weights of the first stages go out as soon as the expert is known,
   * ahead of the gather index round trip (and, when early, of the wait). */
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < nkt)
      mld_load_w<ES>(base + (uint32_t)(s * SB) + swz, wp, wvalid, (kt0 + s) * KT + c * (16 / ES),
                     p.k);
  if (p.early) mld_grid_wait();
  /* Everything this grid waits for is complete: dependents may take the SMs
   * that free up (they stream their own weights until their own wait). */
  mld_grid_launch_dependents();

  const char *xp[XL];
  const float *sp[XL]; /* FP8: the rows' activation scales */
  uint32_t xvalid = 0, xissue = 0;
  const int rows16 = (rows + 15) & ~15;
#pragma unroll
  for (int i = 0; i < XL; ++i) {
    const int t = r0 + 16 * i;
    const int ok = t < rows;
    int g = 0;
    if (ok) g = p.a_index != NULL ? __ldcg(p.a_index + row0 + t) / p.a_div : row0 + t;
    xp[i] = p.a + (size_t)g * (size_t)p.lda * ES;
    sp[i] = FP8 ? p.a_scale + (size_t)g * (size_t)p.as_ld : NULL;
    xvalid |= (uint32_t)ok << i;
    xissue |= (uint32_t)(t < rows16) << i;
  }
  /* FP8: thread c == 0 of each row group also copies its rows' scales of the
   * stage's k block, in the same commit group as the rows; thread 1 the
   * stage's weight scales */
  const bool scale_copier = FP8 && c == 0;
  const bool wscale_copier = FP8 && tid == 1;
  /* FP8: weight scale blocks of the two m16 fragments (SwiGLU: the gate
   * rows' and the up rows'; plain: one block holds all 128 rows) */
  const float *swp[2] = {NULL, NULL};
  if (FP8) {
    const int blk0 = col0 / MLD_FP8_BLOCK;
    const int blk1 = MODE == MLD_SWIGLU ? (p.n + col0) / MLD_FP8_BLOCK : blk0;
    swp[0] = p.b_scale + ((size_t)expert * (size_t)p.b_rblocks + (size_t)blk0) * (size_t)p.kblocks;
    swp[1] = p.b_scale + ((size_t)expert * (size_t)p.b_rblocks + (size_t)blk1) * (size_t)p.kblocks;
  }

  /* Prologue: stages 0..STAGES-2 in flight, one commit group each; the
   * weights issued above all sit in group 0, older than any stage's tokens,
   * so "group kt complete" still means stage kt has landed. */
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nkt) {
      const uint32_t slot = base + (uint32_t)(s * SB);
      mld_load_x<ES, XL>(slot + MLD_W_BYTES + swz, xp, xvalid, xissue,
                         (kt0 + s) * KT + c * (16 / ES), p.k);
      if (scale_copier)
        mld_load_scales<XL>(scl + (uint32_t)(s * C::SCALE_BYTES), r0, sp, xvalid, xissue, kt0 + s);
      if (wscale_copier)
        mld_load_wscales(wsc + (uint32_t)(s * C::WSCALE_BYTES), swp, kt0 + s);
    }
    ml_cp_async_commit();
  }

  float acc[2][NF][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < NF; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
  const int nv = (rows + 7) >> 3, np = (rows + 15) >> 4;

  int rd = 0, wr = STAGES - 1;
  for (int kt = 0; kt < nkt; ++kt) {
    ml_cp_async_wait<STAGES - 2>();
    if (FP8)
      ml_fence_proxy_async();
    /* stage kt landed for every thread, and every warp is done with the
     * slot refilled below (it held stage kt - 1) */
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < nkt) {
      const uint32_t slot = base + (uint32_t)(wr * SB);
      const int kcol = (kt0 + next) * KT + c * (16 / ES);
      mld_load_w<ES>(slot + swz, wp, wvalid, kcol, p.k);
      mld_load_x<ES, XL>(slot + MLD_W_BYTES + swz, xp, xvalid, xissue, kcol, p.k);
      if (scale_copier)
        mld_load_scales<XL>(scl + (uint32_t)(wr * C::SCALE_BYTES), r0, sp, xvalid, xissue,
                            kt0 + next);
      if (wscale_copier)
        mld_load_wscales(wsc + (uint32_t)(wr * C::WSCALE_BYTES), swp, kt0 + next);
    }
    ml_cp_async_commit();
    const uint32_t cur = base + (uint32_t)(rd * SB);
    if (FP8) {
      /* the stage's weight scales came with it through the ring (a load a
       * stage ahead waited for its L2 round trip at every stage) */
      const float2 swv =
          *(const float2 *)(mld_smem + (wsc - raw) + (uint32_t)(rd * C::WSCALE_BYTES));
      const float sw[2] = {swv.x, swv.y};
      if (!p.no_mma) {
        const float *sx = (const float *)(mld_smem + (scl - raw) + (uint32_t)(rd * C::SCALE_BYTES));
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        /* the stage's cp.async writes (generic proxy) before wgmma's reads
         * (async proxy): every thread fenced its own before the barrier */
        if (nv <= 1)
          mld_wgmma_stage<8, NF>(cur, acc, sx, sw);
        else if (NF <= 2 || nv <= 2)
          mld_wgmma_stage<16, NF>(cur, acc, sx, sw);
        else if constexpr (NF >= 8) {
          if (nv <= 4)
            mld_wgmma_stage<32, NF>(cur, acc, sx, sw);
          else
            mld_wgmma_stage<64, NF>(cur, acc, sx, sw);
        }
#else
        float blk[2][NF][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int ni = 0; ni < NF; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) blk[mi][ni][e] = 0.0f;
        mld_compute_stage<MODE, DT, 1, NF>(cur, blk, nv, np);
        mld_promote_fp8<NF, NF>(acc, blk, sx, sw, nv);
#endif
      }
    } else if (!p.no_mma) {
      mld_compute_stage<MODE, DT, 0, NF>(cur, acc, nv, np);
    }
    rd = rd + 1 == STAGES ? 0 : rd + 1;
    wr = wr + 1 == STAGES ? 0 : wr + 1;
  }
  ml_cp_async_wait<0>();
  __syncthreads();

  /* ---- accumulators -> shared [token][tile row] ---- */
  float *cs = (float *)mld_smem;
  const int lane = tid & 31, warp = tid >> 5;
  const int fr = lane >> 2, ft = (lane & 3) * 2;
  const bool fused = MODE == MLD_SWIGLU && p.splits == 1;
#pragma unroll
  for (int ni = 0; ni < NF; ++ni) {
    if (ni >= nv) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = ni * 8 + ft + e;
        if (fused) {
          cs[tok * MLD_CS_LD + warp * 16 + fr + 8 * h] =
              mld_swiglu(acc[0][ni][2 * h + e], acc[1][ni][2 * h + e]);
        } else {
#pragma unroll
          for (int mi = 0; mi < 2; ++mi)
            cs[tok * MLD_CS_LD + mld_acc_row<MODE, FP8>(warp, mi) + fr + 8 * h] =
                acc[mi][ni][2 * h + e];
        }
      }
  }
  __syncthreads();

  /* ---- one split: the output ---- */
  constexpr int OCH = COLS / 8; /* 8-column chunks of a row */
  if (p.splits == 1) {
    for (int i = tid; i < rows * OCH; i += MLD_THREADS) {
      const int tok = i / OCH, q = i % OCH, col = col0 + 8 * q;
      if (col >= p.n) continue;
      const float4 *src = (const float4 *)(cs + tok * MLD_CS_LD + 8 * q);
      const float4 lo = src[0], hi = src[1];
      float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      if (MODE == MLD_SCALED) {
        const float s = mld_row_scale(p, row0 + tok);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] *= s;
      }
      mld_store_out<DT, OUT_F32>(p, row0 + tok, col, v);
    }
    if (MODE == MLD_SWIGLU && OUT_F32 && p.q != NULL) mld_quantize_out(p, pass, mb, row0, rows);
    return;
  }

  /* ---- several splits: partial block, ticket, fixed-order sum ---- */
  const size_t ncols = (size_t)(MODE == MLD_SWIGLU ? 2 * p.n : p.n);
  constexpr int PCH = MLD_BM / 4; /* float4 chunks of a tile row */
  for (int i = tid; i < rows * PCH; i += MLD_THREADS) {
    const int tok = i / PCH, q = i % PCH;
    int col, wrow;
    if (!mld_weight_row<MODE>(4 * q, col0, p.n, &col, &wrow)) continue;
    const float4 v = *(const float4 *)(cs + tok * MLD_CS_LD + 4 * q);
    __stcg((float4 *)(p.partials + ((size_t)split * (size_t)p.rows + (size_t)(row0 + tok)) * ncols +
                      (size_t)wrow),
           v);
  }
  /* this CTA's partials published with its ticket; the last split's CTA
   * also sees the others' */
  if (!ml_cta_ticket(p.tickets + (size_t)pass * (size_t)p.mblocks + (size_t)mb,
                     (uint32_t)(p.splits - 1), &s_last))
    return;
  const size_t split_stride = (size_t)p.rows * ncols;
  for (int i = tid; i < rows * OCH; i += MLD_THREADS) {
    const int tok = i / OCH, q = i % OCH, col = col0 + 8 * q;
    if (col >= p.n) continue;
    const float *src = p.partials + (size_t)(row0 + tok) * ncols + (size_t)col;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (MODE == MLD_SWIGLU) {
      float u[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int s = 0; s < p.splits; ++s) {
        mld_add8(v, src + (size_t)s * split_stride);
        mld_add8(u, src + (size_t)s * split_stride + (size_t)p.n);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = mld_swiglu(v[j], u[j]);
    } else {
      for (int s = 0; s < p.splits; ++s) mld_add8(v, src + (size_t)s * split_stride);
      const float sc = mld_row_scale(p, row0 + tok);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] *= sc;
    }
    mld_store_out<DT, OUT_F32>(p, row0 + tok, col, v);
  }
  if (MODE == MLD_SWIGLU && OUT_F32 && p.q != NULL) mld_quantize_out(p, pass, mb, row0, rows);
}

#endif
