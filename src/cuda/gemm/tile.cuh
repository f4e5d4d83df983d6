/* The tile GEMM engine: one CTA computes a BM x BN block of C = A B^T, where
 * A rows and B rows (B is a linear layer's weight, [n][k] row-major) each
 * come from a per-thread list of row pointers. The pieces a kernel combines:
 *
 *   ml_gemm_shape<...>      compile-time tile shape, warp layout, pipeline depth
 *   ml_gemm_tile_of(...)    which rows of the problem this CTA owns (tile list
 *                           on the device, or dense row blocks)
 *   row sources             fill an ml_gemm_rows with the global address of
 *                           each tile row this thread copies and a mask of the
 *                           rows inside the problem (the others read as
 *                           zeros): dense A, A gathered through an index,
 *                           plain B rows, B rows as gate/up pairs. A source
 *                           reading rows from a peer GPU, or one that first
 *                           waits on a signal, only has to produce the same
 *                           list.
 *   ml_gemm_mainloop(...)   cp.async ring of STAGES shared-memory stages,
 *                           ldmatrix + mma.sync m16n8k16, fp32 accumulators
 *   epilogues (epilogue.cuh) consume the accumulators in registers.
 *
 * Shared memory: each stage holds the A tile [BM][BK] then the B tile
 * [BN][BK], BK = 64 16-bit elements = 128 bytes a row = eight 16-byte chunks.
 * Chunk c of row r sits at chunk slot c ^ (r & 7): the eight rows an
 * ldmatrix phase reads (same logical chunk, consecutive rows) land in eight
 * different bank groups, and the copies of one row (eight consecutive
 * threads) still write one full 128-byte line. No padding is needed.
 *
 * Determinism: every output element belongs to one CTA, which sums k in a
 * fixed order (k tiles ascending, 16-wide steps ascending inside a tile). */
#ifndef MOELINK_CUDA_GEMM_TILE_CUH
#define MOELINK_CUDA_GEMM_TILE_CUH

#include "cuda/gemm/ptx.cuh"
#include "cuda/gemm/wait.cuh"

#include <stddef.h>
#include <stdint.h>

/* BM x BN x BK tile, WARPS_M x WARPS_N warps each owning a WTM x WTN block,
 * STAGES shared-memory stages. Element size is 2 bytes (bf16/f16). */
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct ml_gemm_shape {
  static constexpr int BM = BM_, BN = BN_, BK = BK_;
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
  static constexpr int MI = WTM / 16; /* m16 fragments per warp */
  static constexpr int NI = WTN / 8;  /* n8 fragments per warp */
  static constexpr int ROW_BYTES = BK * 2;
  static constexpr int CHUNKS = ROW_BYTES / 16; /* 16-byte copies per tile row */
  static constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
  static constexpr int A_LOADS = BM / ROWS_PER_PASS; /* A rows copied per thread */
  static constexpr int B_LOADS = BN / ROWS_PER_PASS;
  static constexpr int A_BYTES = BM * ROW_BYTES, B_BYTES = BN * ROW_BYTES;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;

  static_assert(BK == 64, "the XOR swizzle assumes 128-byte tile rows");
  static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile is whole ldmatrix.x4 blocks");
  static_assert(ROWS_PER_PASS % 8 == 0, "a thread's rows must share (row & 7)");
  static_assert(BM % ROWS_PER_PASS == 0 && BN % ROWS_PER_PASS == 0, "whole copy passes");
  static_assert(STAGES >= 2, "a pipeline needs two stages at least");
};

/* Global addresses of the N tile rows one thread copies (row
 * tid / CHUNKS + i * ROWS_PER_PASS for i < N). Bit i of valid clear: the row
 * lies outside the problem and reads as zeros; its ptr is then row 0 of the
 * same matrix, so that every address a copy carries is a readable one even
 * though a zero-filling copy reads nothing. The mask keeps the per-stage cost
 * of a row at one 64-bit add and one bit test. */
template <int N> struct ml_gemm_rows {
  static_assert(N <= 32, "one mask bit per row");
  const char *ptr[N];
  uint32_t valid;
};

/* ---- which rows a CTA owns ----------------------------------------------- */

/* Tile blockIdx.x of the problem. With a tile list (plan layout: expert,
 * first row, rows) tiles past *num_tiles own nothing; without one, rows
 * [0, dense_rows) form blocks of BM rows of expert 0. Returns 0 when this CTA
 * has no rows (the whole CTA exits: the test is uniform across it). Row
 * counts above BM are clamped so a bad plan cannot make a CTA write rows it
 * did not compute. */
template <int BM>
static __device__ __forceinline__ int ml_gemm_tile_of(const int32_t *tiles,
                                                      const int32_t *num_tiles, int dense_rows,
                                                      int *expert, int *row0, int *rows) {
  int t = (int)blockIdx.x;
  int r;
  if (tiles != NULL) {
    if (t >= __ldg(num_tiles)) return 0;
    *expert = __ldg(tiles + 3 * t);
    *row0 = __ldg(tiles + 3 * t + 1);
    r = __ldg(tiles + 3 * t + 2);
  } else {
    *expert = 0;
    *row0 = t * BM;
    r = dense_rows - t * BM;
  }
  r = r < BM ? r : BM;
  *rows = r;
  return r > 0;
}

/* ---- row sources ----------------------------------------------------------- */

/* First tile row this thread copies and its stride. */
template <class S> static __device__ __forceinline__ int ml_gemm_copy_row(int i) {
  return (int)threadIdx.x / S::CHUNKS + i * S::ROWS_PER_PASS;
}

/* A rows row0 .. row0 + rows - 1 of a dense matrix (ld elements apart). */
template <class S>
static __device__ __forceinline__ void ml_gemm_a_dense(ml_gemm_rows<S::A_LOADS> *src,
                                                       const void *a, int ld, int row0,
                                                       int rows) {
  const char *base = (const char *)a;
  src->valid = 0;
#pragma unroll
  for (int i = 0; i < S::A_LOADS; ++i) {
    int r = ml_gemm_copy_row<S>(i);
    int ok = r < rows;
    src->ptr[i] = ok ? base + (size_t)(row0 + r) * (size_t)ld * 2 : base;
    src->valid |= (uint32_t)ok << i;
  }
}

/* A row r of the problem is row index[r] / div of a: the permuted rows of a
 * MoE layer read the token they came from (index = token * top_k + slot,
 * div = top_k) without a permuted copy of the activations. index == NULL
 * means the identity. */
template <class S>
static __device__ __forceinline__ void
ml_gemm_a_gathered(ml_gemm_rows<S::A_LOADS> *src, const void *a, int ld, const int32_t *index,
                   int div, int row0, int rows, int fresh) {
  const char *base = (const char *)a;
  src->valid = 0;
#pragma unroll
  for (int i = 0; i < S::A_LOADS; ++i) {
    int r = ml_gemm_copy_row<S>(i);
    int ok = r < rows;
    const char *p = base;
    if (ok) {
      /* fresh: the index may have been written while the kernel runs */
      int g = index == NULL ? row0 + r
              : fresh       ? ml_gemm_ld_index(index + row0 + r) / div
                            : __ldg(index + row0 + r) / div;
      p = base + (size_t)g * (size_t)ld * 2;
    }
    src->ptr[i] = p;
    src->valid |= (uint32_t)ok << i;
  }
}

/* B rows n0 .. n0 + BN - 1 of w [n][k]; rows >= n read as zeros. */
template <class S>
static __device__ __forceinline__ void ml_gemm_b_plain(ml_gemm_rows<S::B_LOADS> *src,
                                                       const void *w, int n, int k, int n0) {
  const char *base = (const char *)w;
  src->valid = 0;
#pragma unroll
  for (int i = 0; i < S::B_LOADS; ++i) {
    int j = n0 + ml_gemm_copy_row<S>(i);
    int ok = j < n;
    src->ptr[i] = ok ? base + (size_t)j * (size_t)k * 2 : base;
    src->valid |= (uint32_t)ok << i;
  }
}

/* Gate/up pairs of w [2n][k] (gate rows 0..n-1, up rows n..2n-1) for output
 * columns j0 .. j0 + BN/2 - 1. Tile rows are ordered so that each warp column
 * block of WTN rows holds WTN/2 gate rows followed by the up rows of the same
 * columns: n-fragment f < NI/2 of a warp is gate column c and fragment
 * f + NI/2 is up column c, so a thread holds both factors of each output in
 * registers (see ml_gemm_gate_up_col). Columns >= n read as zeros. */
template <class S>
static __device__ __forceinline__ void ml_gemm_b_gate_up(ml_gemm_rows<S::B_LOADS> *src,
                                                         const void *w, int n, int k, int j0) {
  const char *base = (const char *)w;
  constexpr int HALF = S::WTN / 2;
  src->valid = 0;
#pragma unroll
  for (int i = 0; i < S::B_LOADS; ++i) {
    int s = ml_gemm_copy_row<S>(i);
    int within = s % S::WTN;
    int j = j0 + (s / S::WTN) * HALF + within % HALF;
    int row = within < HALF ? j : n + j;
    int ok = j < n;
    src->ptr[i] = ok ? base + (size_t)row * (size_t)k * 2 : base;
    src->valid |= (uint32_t)ok << i;
  }
}

/* ---- mainloop ---------------------------------------------------------- */

/* fp32 accumulators of one thread: v[mi][ni] is the m16n8 fragment (mi, ni)
 * of its warp; element 2h + c sits at warp row mi*16 + lane/4 + 8h and warp
 * column ni*8 + (lane%4)*2 + c. */
template <class S> struct ml_gemm_acc {
  float v[S::MI][S::NI][4];
};

/* Copies k tile kt of the A and B rows into stage slot (shared address). */
template <class S>
static __device__ __forceinline__ void ml_gemm_load_stage(uint32_t slot,
                                                          const ml_gemm_rows<S::A_LOADS> *a,
                                                          const ml_gemm_rows<S::B_LOADS> *b,
                                                          int k, int kt) {
  int c = (int)threadIdx.x % S::CHUNKS;
  int r0 = (int)threadIdx.x / S::CHUNKS;
  int kcol = kt * S::BK + c * 8;
  /* k is a multiple of 8, so a chunk is all inside k or all past it. A chunk
   * past k zero-fills every row and keeps its address at column 0. */
  int in_k = kcol < k;
  size_t off = in_k ? (size_t)kcol * 2 : 0;
  uint32_t a_ok = in_k ? a->valid : 0u, b_ok = in_k ? b->valid : 0u;
  /* every row this thread copies has the same (row & 7), so one swizzled
   * column serves all of them */
  uint32_t dst = slot + (uint32_t)r0 * S::ROW_BYTES + (uint32_t)((c ^ (r0 & 7)) << 4);
#pragma unroll
  for (int i = 0; i < S::A_LOADS; ++i)
    ml_cp_async16(dst + (uint32_t)(i * S::ROWS_PER_PASS * S::ROW_BYTES), a->ptr[i] + off,
                  (a_ok >> i) & 1 ? 16 : 0);
  dst += S::A_BYTES;
#pragma unroll
  for (int i = 0; i < S::B_LOADS; ++i)
    ml_cp_async16(dst + (uint32_t)(i * S::ROWS_PER_PASS * S::ROW_BYTES), b->ptr[i] + off,
                  (b_ok >> i) & 1 ? 16 : 0);
}

/* One stage: BK/16 steps of ldmatrix (A: one x4 per m16 fragment; B: one x4
 * per pair of n8 fragments) and MI x NI mma.sync each. */
template <class S, int DT>
static __device__ __forceinline__ void ml_gemm_compute_stage(uint32_t slot,
                                                             ml_gemm_acc<S> *acc) {
  int lane = (int)threadIdx.x & 31;
  int warp = (int)threadIdx.x >> 5;
  int wm = warp / S::WARPS_N, wn = warp % S::WARPS_N;
  /* ldmatrix lane roles. A (x4 = rows 0-15 x k 0-7, then k 8-15): lane gives
   * row lane % 16 at k half lane / 16. B (x4 = n 0-7 x k 0-7, n 0-7 x k 8-15,
   * n 8-15 x k 0-7, n 8-15 x k 8-15): lane gives n row (lane & 7) + 8 *
   * (lane / 16) at k half (lane / 8) % 2. All fragment rows start at a
   * multiple of 8, so a row's swizzle term is lane & 7. */
  uint32_t a_row = slot + (uint32_t)(wm * S::WTM + (lane & 15)) * S::ROW_BYTES;
  uint32_t b_row = slot + S::A_BYTES +
                   (uint32_t)(wn * S::WTN + (lane & 7) + ((lane >> 4) << 3)) * S::ROW_BYTES;
  int a_x = (lane >> 4) ^ (lane & 7);
  int b_x = ((lane >> 3) & 1) ^ (lane & 7);
#pragma unroll
  for (int kk = 0; kk < S::BK / 16; ++kk) {
    uint32_t af[S::MI][4];
    uint32_t bf[S::NI][2];
    /* logical chunk 2kk + h, h in {0, 1}: (2kk + h) ^ x == 2kk ^ (h ^ x) */
    uint32_t a_col = (uint32_t)(((2 * kk) ^ a_x) << 4);
    uint32_t b_col = (uint32_t)(((2 * kk) ^ b_x) << 4);
#pragma unroll
    for (int mi = 0; mi < S::MI; ++mi)
      ml_ldmatrix_x4(a_row + (uint32_t)(mi * 16 * S::ROW_BYTES) + a_col, af[mi]);
#pragma unroll
    for (int p = 0; p < S::NI / 2; ++p) {
      uint32_t t[4];
      ml_ldmatrix_x4(b_row + (uint32_t)(p * 16 * S::ROW_BYTES) + b_col, t);
      bf[2 * p][0] = t[0];
      bf[2 * p][1] = t[1];
      bf[2 * p + 1][0] = t[2];
      bf[2 * p + 1][1] = t[3];
    }
#pragma unroll
    for (int mi = 0; mi < S::MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < S::NI; ++ni) ml_mma_16816<DT>(acc->v[mi][ni], af[mi], bf[ni]);
  }
}

/* acc = A_tile B_tile^T over k (any multiple of 8, 0 included). smem holds
 * STAGES * STAGE_BYTES bytes, 16-byte aligned. On return every copy has
 * landed and every warp is past its last read of smem, so the caller may
 * reuse it (e.g. to stage an epilogue). */
template <class S, int DT>
static __device__ __forceinline__ void ml_gemm_mainloop(char *smem,
                                                        const ml_gemm_rows<S::A_LOADS> *a,
                                                        const ml_gemm_rows<S::B_LOADS> *b, int k,
                                                        ml_gemm_acc<S> *acc) {
#pragma unroll
  for (int mi = 0; mi < S::MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < S::NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc->v[mi][ni][e] = 0.0f;

  uint32_t base = ml_smem_u32(smem);
  int ktiles = (k + S::BK - 1) / S::BK;
  /* Prologue: STAGES - 1 tiles in flight. Every iteration commits one group
   * (empty past the end) so that "group kt is complete" is always
   * wait_group(STAGES - 2). */
#pragma unroll
  for (int s = 0; s < S::STAGES - 1; ++s) {
    if (s < ktiles) ml_gemm_load_stage<S>(base + (uint32_t)(s * S::STAGE_BYTES), a, b, k, s);
    ml_cp_async_commit();
  }
  int read_slot = 0, write_slot = S::STAGES - 1;
  for (int kt = 0; kt < ktiles; ++kt) {
    ml_cp_async_wait<S::STAGES - 2>();
    /* tile kt is visible to all warps, and all warps are done with tile
     * kt - 1, whose slot is refilled next */
    __syncthreads();
    int next = kt + S::STAGES - 1;
    if (next < ktiles)
      ml_gemm_load_stage<S>(base + (uint32_t)(write_slot * S::STAGE_BYTES), a, b, k, next);
    ml_cp_async_commit();
    ml_gemm_compute_stage<S, DT>(base + (uint32_t)(read_slot * S::STAGE_BYTES), acc);
    read_slot = read_slot + 1 == S::STAGES ? 0 : read_slot + 1;
    write_slot = write_slot + 1 == S::STAGES ? 0 : write_slot + 1;
  }
  ml_cp_async_wait<0>();
  __syncthreads();
}

#endif
