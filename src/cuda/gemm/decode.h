/* The decode (weight-streaming) expert GEMMs: the same math and output
 * layout as ml_cuda_gemm_swiglu / ml_cuda_gemm_scaled (cuda.h), for the case
 * where each expert has few rows. The weights are the MMA's M side (128
 * weight rows a CTA), the rows of one plan tile are its N side (up to 64 a
 * pass, or 16 in a deeper ring: max_rows, ML_DECODE_NARROW), and K is split
 * across CTAs when rows x column blocks alone would
 * leave SMs idle. Split partials go to an fp32 workspace and are summed in
 * split order by the last CTA of each output block to finish (an integer
 * ticket decides who is last), so results are bitwise reproducible.
 *
 * Grids are sized from host-known values (rows, experts, shapes); the real
 * tile count stays on the device. Host code: C11. */
#ifndef MOELINK_CUDA_GEMM_DECODE_H
#define MOELINK_CUDA_GEMM_DECODE_H

#include "cuda/cuda.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Token rows a pass of the narrow kernel (ml_decode_opts.max_rows). */
#define ML_DECODE_SMALL_ROWS 16

/* Launch flags. */
enum {
  /* Launch with programmatic stream serialization: the kernel may start
   * while the previous kernel of the stream drains. Before its grid
   * dependency wait it only reads weights (and, with ML_DECODE_PLAN_EARLY,
   * the tile list); every other read and every write comes after. */
  ML_DECODE_PDL = 1,
  /* The tile list was complete before the previous kernel of the stream
   * started its own dependent launch (true right after a decode launch on
   * the same plan, which waits before it lets dependents in): tile entries
   * and the weights they name may be read before the dependency wait. */
  ML_DECODE_PLAN_EARLY = 2,
  /* Benchmarks only: skip the MMAs (the output is wrong), so that the time of
   * the weight stream alone can be told from the compute. */
  ML_DECODE_PROBE_NO_MMA = 4,
  /* Tests and benchmarks: the kernel of 64-row passes even where every pass
   * has 16 rows or fewer (see max_rows). */
  ML_DECODE_WIDE = 8,
  /* A tile list of any tiles through the kernel of 16-row passes: each tile
   * in up to 4 passes of 16 rows, whose CTAs stream the same weights side by
   * side (DRAM once, L2 once a pass). Needs 4x the tickets of a plain launch
   * when K is split (ml_cuda_decode_scratch sizes them). Ignored for dense
   * problems and with ML_DECODE_WIDE. */
  ML_DECODE_NARROW = 16
};

/* Scratch and policy of a launch. */
typedef struct ml_decode_opts {
  int sm_count;          /* SMs of the device: the split policy aims at them */
  int flags;             /* ML_DECODE_* */
  int splits;            /* 0: the policy; >= 1: this many K splits (capped by K) */
  float *partials;       /* split-K partials; may be NULL when no split is used */
  size_t partial_floats; /* capacity of partials */
  uint32_t *tickets;     /* zero-initialized; every launch leaves them zero */
  size_t ticket_count;   /* capacity of tickets */
  /* scaled launches only (bf16/f16 output): as ml_cuda_gemm_opts.out_rows */
  void *const *out_rows;
  /* ml_cuda_fp8_swiglu with an fp32 output only (NULL: none): the output
   * also quantized per 128 columns as moelink_quantize's FP8 does it (the
   * same bytes and scales), e4m3 into q_out [rows][n] (16-byte aligned),
   * scales into q_scale [rows][n / 128], by the kernel itself (the second
   * CTA of each pair of 64-column blocks to finish). Its tickets follow the
   * split ones: tickets needs passes x column blocks x 3 / 2 of them
   * (ml_cuda_decode_scratch sizes them). */
  uint8_t *q_out;
  float *q_scale;
  /* An upper bound on the rows of one tile of the tile list (0: none known;
   * the problem's rows bound it anyway). Where the bound is 16 or less the
   * launch takes the kernel of 16-row passes, whose ring holds 6 stages of
   * weights instead of 4 (MOELINK_DECODE_SMALL=0: never). A layer whose
   * router picked k distinct experts a token passes its token count. */
  int max_rows;
} ml_decode_opts;

/* Upper bound on the tiles of a plan of `rows` valid rows over `experts`
 * experts with ML_CUDA_TILE_ROWS rows a tile: each non-empty expert has one
 * partial tile at most. For a dense problem (no tile list) pass experts = 1. */
int ml_cuda_decode_passes(int rows, int experts);

/* Whether the decode GEMMs should run for `rows` rows over `experts`
 * experts (the routed GEMMs: T*k and E; the shared expert: T and 1) whose
 * two GEMMs' k are at least min_k (min(hidden, inter)): up to
 * MOELINK_DECODE_MAX_PAIRS rows (default 256, measured; 0 = never), routed
 * GEMMs with min_k >= MOELINK_DECODE_LONG_K up to MOELINK_DECODE_LONG_K_PAIRS
 * (2048 and 8, measured), and for a dense problem (experts == 1) one pass of
 * ML_CUDA_TILE_ROWS at most. Monotone in rows. */
int ml_cuda_decode_wanted(int rows, int experts, int min_k);

/* The routed GEMMs of an FP8 layer: ml_cuda_decode_wanted, or an average of
 * at most MOELINK_DECODE_FP8_ROWS_PER_EXPERT rows (default 8, measured) an
 * expert. Past ml_cuda_decode_wanted the layer's split-K scratch was not
 * sized for the call: launch with opts.splits = 1. */
int ml_cuda_decode_wanted_fp8(int rows, int experts, int min_k);

/* Scratch a layer needs so that every decode launch it makes for up to
 * max_tokens tokens fits: fp32 partials and tickets (counts, not bytes).
 * shared_inter 0: no shared expert. */
void ml_cuda_decode_scratch(int max_tokens, int top_k, int num_experts, int hidden, int inter,
                            int shared_inter, int sm_count, size_t *partial_floats,
                            size_t *ticket_count);

/* h = swiglu(A Wg^T, A Wu^T). A row r of the problem reads row
 * a_index[r] / a_div of a (a_index NULL: row r). b = [E, 2n, k] (gate rows
 * first). Tile list as in cuda.h with at most max_passes real tiles
 * (ml_cuda_decode_passes), or tiles == NULL: rows [0, rows) of expert 0.
 * rows is the problem's row count either way (the partials are laid out by
 * it). out [rows, n], dtype dt. */
moelink_status_t ml_cuda_decode_swiglu(moelink_dtype_t dt, const void *a, int lda,
                                       const int32_t *a_index, int a_div, const void *b, int n,
                                       int k, const int32_t *tiles, const int32_t *num_tiles,
                                       int max_passes, int rows, void *out,
                                       const ml_decode_opts *o, cudaStream_t stream);

/* out[r, j] = s(r) * sum_k a[r, k] * B[e][j][k], as ml_cuda_gemm_scaled:
 * s(r) = row_scale[scale_index[r]] (scale_index NULL: row_scale[r]; row_scale
 * NULL: 1). out [rows, n], dtype dt or fp32 (out_f32). */
moelink_status_t ml_cuda_decode_scaled(moelink_dtype_t dt, const void *a, int lda, const void *b,
                                       int n, int k, const int32_t *tiles,
                                       const int32_t *num_tiles, int max_passes, int rows,
                                       const float *row_scale, const int32_t *scale_index,
                                       void *out, int out_f32, const ml_decode_opts *o,
                                       cudaStream_t stream);

/* FP8 operands (DeepSeek-V3's format, see moelink_moe_config_t.fp8_experts):
 * a holds e4m3 bytes, lda a multiple of 128, and a_scale one fp32 scale per
 * 128 elements of a row (a_scale[g * lda / 128 + kb] for row g, k block kb:
 * moelink_quantize's FP8 layout); b holds e4m3 bytes [E][rows_of_b][k] with
 * b_scale [E][rows_of_b / 128][k / 128] (one scale per 128 x 128 block). n
 * and k multiples of 128. Each 128-wide k block's products are summed in fp32
 * and added to the fp32 total times a_scale x b_scale of the block. Output,
 * tiles, gather, row scale, splits and flags as in the bf16 launchers above;
 * out_dt (bf16 or f16; for ml_cuda_fp8_swiglu also f32) is the output's
 * dtype. Any row count works (the
 * caller passes opts.splits = 1 where the layer's split scratch was not sized
 * for it). */
moelink_status_t ml_cuda_fp8_swiglu(moelink_dtype_t out_dt, const uint8_t *a,
                                    const float *a_scale, int lda, const int32_t *a_index,
                                    int a_div, const uint8_t *b, const float *b_scale, int n,
                                    int k, const int32_t *tiles, const int32_t *num_tiles,
                                    int max_passes, int rows, void *out, const ml_decode_opts *o,
                                    cudaStream_t stream);

moelink_status_t ml_cuda_fp8_scaled(moelink_dtype_t out_dt, const uint8_t *a,
                                    const float *a_scale, int lda, const uint8_t *b,
                                    const float *b_scale, int n, int k, const int32_t *tiles,
                                    const int32_t *num_tiles, int max_passes, int rows,
                                    const float *row_scale, const int32_t *scale_index,
                                    void *out, int out_f32, const ml_decode_opts *o,
                                    cudaStream_t stream);

/* Token rows a pass of the calling thread's last decode launch (16 or 64;
 * 0 before any): tests and benchmarks. */
int ml_cuda_decode_last_pass_rows(void);

/* Whether a layer's routed decode GEMMs over `rows` rows of `experts`
 * experts should cut their tiles into 16-row passes (ML_DECODE_NARROW): at
 * most MOELINK_DECODE_NARROW (default 8) rows an expert on average. Where
 * the experts' tiles average more, a tile's passes stream its weights more
 * than once (measured: docs/PERF.md). */
int ml_cuda_decode_narrow(int rows, int experts);

/* The split count the policy picks for a launch (tests and benchmarks). */
int ml_cuda_decode_policy_splits(int swiglu, int n, int k, int max_passes, int sm_count);

#ifdef __cplusplus
}
#endif

#endif
