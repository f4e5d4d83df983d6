/* CPU backend internals shared by the files of src/cpu/.
 *
 * Threading: every op opens one OpenMP team of the context's num_threads and
 * splits its work into items whose boundaries depend only on the shapes, never
 * on the thread count or on which thread takes an item; every output element
 * is written by exactly one item with a fixed reduction order. That makes the
 * results bitwise reproducible whatever the scheduling. BLAS calls are made
 * inside the team, where the OpenMP build of OpenBLAS runs them on the calling
 * thread only. */
#ifndef ML_CPU_H
#define ML_CPU_H

#include "core/core.h"
#include "moe/backend.h"

#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#define ML_CPU_TILE_ROWS 64

#if defined(__x86_64__) || defined(__i386__)
#define ML_CPU_X86 1
#endif

/* Up to this many token rows a bf16/f16 expert block goes through
 * ml_cpu_gemm_small instead of conversion + BLAS: measured on the development
 * machine, the small kernel is ahead up to ~56 rows on qwen3-30b-a3b shapes
 * and even at 64 (~15%) on mixtral's long K; BLAS catches up at 64-80. */
#define ML_CPU_SMALL_ROWS 64

/* Block sizes of the work items, derived from the config alone (see
 * ml_cpu_blocks_for in backend.c). */
typedef struct ml_cpu_blocks {
  int router_rows;  /* router experts converted and multiplied per item */
  int gu_cols;      /* routed gate/up: columns of I per item */
  int down_cols;    /* routed down: columns of H per item */
  int sgu_cols;     /* shared gate/up: columns of Is per item */
  int sdown_cols;   /* shared down: columns of H per item */
  int row_chunk;    /* token rows per GEMM call */
  size_t conv_floats;   /* per-thread weight conversion buffer (0 for F32) */
  size_t tmp_floats;    /* per-thread GEMM output buffer */
  size_t misc_floats;   /* per-thread combine / router scratch */
} ml_cpu_blocks;

/* The workspace of a layer, carved from one 64-byte aligned allocation sized
 * for cfg.max_tokens. */
typedef struct ml_cpu_moe {
  void *base;
  size_t bytes;
  int nthreads;
  ml_cpu_blocks blk;
  float *xf;         /* [T, H] x in fp32 (non-F32 layers) */
  float *logits;     /* [T, E] router logits, then scores */
  int32_t *ids;      /* [T, k] forward's routing */
  float *wts;        /* [T, k] */
  void *plan;        /* plan buffer for max_tokens */
  int64_t *order;    /* [E] experts with rows, heaviest first (sort keys) */
  float *xg;         /* [T*k, H] gathered x rows; reused for the fp32 y rows */
  float *h;          /* [T*k, I] silu(gate) * up */
  float *sh_h;       /* [T, Is] shared expert hidden */
  float *sh_out;     /* [T, H] shared expert output, gated */
  float *sh_gate;    /* [T] sigmoid(x . w_g) */
  float *sh_gw;      /* [H] shared gate weights in fp32 */
  float *sh_xq;      /* [T, H] fp8_shared: x rows quantize-dequantized per 128 */
  float *thread_buf; /* nthreads * per_thread floats */
  size_t per_thread; /* floats, a multiple of 16 */
} ml_cpu_moe;

static inline ml_cpu_moe *ml_cpu_ws(moelink_moe_t moe) { return (ml_cpu_moe *)moe->impl; }

/* First call in every team that makes BLAS calls: returns the thread's index
 * and keeps BLAS single-threaded on it. OpenBLAS sizes its own threading from
 * omp_get_max_threads() unless a team of several threads is active; a team of
 * one is not, so without this a one-thread context would still get BLAS
 * threads. The setting is local to the team's task and ends with it. */
static inline int ml_cpu_team_thread(void) {
  omp_set_num_threads(1);
  return omp_get_thread_num();
}

/* A thread's scratch: [conv | tmp | misc], each part 64-byte aligned. */
static inline size_t ml_cpu_round16(size_t n) { return (n + 15) & ~(size_t)15; }
static inline float *ml_cpu_conv(const ml_cpu_moe *ws, int tid) {
  return ws->thread_buf + (size_t)tid * ws->per_thread;
}
static inline float *ml_cpu_tmp(const ml_cpu_moe *ws, int tid) {
  return ml_cpu_conv(ws, tid) + ml_cpu_round16(ws->blk.conv_floats);
}
static inline float *ml_cpu_misc(const ml_cpu_moe *ws, int tid) {
  return ml_cpu_tmp(ws, tid) + ml_cpu_round16(ws->blk.tmp_floats);
}

void ml_cpu_blocks_for(const moelink_moe_config_t *cfg, ml_cpu_blocks *b);

/* Router (router.c): logits of x [T, H] (fp32 rows, lda H) then selection into
 * ids/weights [T, k]. */
moelink_status_t ml_cpu_route_f32(moelink_moe_t moe, const float *x32, int num_tokens,
                                  int32_t *ids, float *weights);
/* x of the layer dtype to fp32 rows: x itself for F32, ws->xf otherwise. */
const float *ml_cpu_x_f32(moelink_moe_t moe, const void *x, int num_tokens);

/* Plan (plan.c): builds plan arrays for ids [T, k]. */
void ml_cpu_build_plan(const int32_t *ids, int num_tokens, int top_k, int num_experts,
                       int tile_rows, const moelink_plan_t *plan);
/* Checks what experts/combine read from a caller's plan buffer. */
moelink_status_t ml_cpu_check_plan(const moelink_plan_t *plan, int check_rows);

/* Routed (and optionally shared) experts (experts.c). */
typedef struct ml_cpu_ffn {
  const void *x;            /* [T, H] token rows */
  moelink_dtype_t x_dtype;  /* F32 for fp32 rows */
  int num_tokens;
  const moelink_plan_t *plan;
  const float *weights;     /* [T, k] or NULL */
  float *y32;               /* [R, H] fp32 results, may be ws->xg */
  void *y_out;              /* NULL, or [T*k, H] of the layer dtype: rows also stored here */
  const float *x32;         /* [T, H] fp32 rows for the shared expert, or NULL: no shared */
} ml_cpu_ffn;
moelink_status_t ml_cpu_run_ffn(moelink_moe_t moe, const ml_cpu_ffn *job);

/* Shared expert items (shared.c), called from inside the experts' team. */
int ml_cpu_shared_gu_items(const moelink_moe_config_t *cfg, const ml_cpu_blocks *b);
int ml_cpu_shared_down_items(const moelink_moe_config_t *cfg, const ml_cpu_blocks *b);
void ml_cpu_shared_gate_token(moelink_moe_t moe, const float *x32, int t);
void ml_cpu_shared_gu_item(moelink_moe_t moe, const float *x32, int num_tokens, int item, int tid);
void ml_cpu_shared_down_item(moelink_moe_t moe, int num_tokens, int item, int tid);

/* Conversions and GEMM (convert.c). */
/* The SIMD the running CPU offers, detected once: ML_CPU_SIMD_AVX2 (AVX2 and
 * F16C), with ML_CPU_SIMD_FMA when FMA is there too; 0 off x86. */
#define ML_CPU_SIMD_AVX2 1
#define ML_CPU_SIMD_FMA 2
int ml_cpu_simd(void);
/* Tests only: what ml_cpu_simd reports is ANDed with mask from now on (-1,
 * the default, leaves it as detected; 0 takes the scalar and BLAS paths). */
void ml_cpu_simd_limit(int mask);
/* ml_to_f32 with a SIMD path for bf16/f16 (exact, same values). */
void ml_cpu_to_f32(moelink_dtype_t dtype, const void *src, float *dst, size_t n);

/* Rows [row0, row0 + rows) of a [*, cols] weight matrix of dtype as fp32
 * [rows, cols]: in place for F32, else converted into conv. */
const float *ml_cpu_weight_rows(moelink_dtype_t dtype, const void *w, size_t row0, int rows,
                                int cols, float *conv);

/* Rows [row0, row0 + rows) of an FP8 weight matrix [*, cols] (e4m3 bytes,
 * cols a multiple of 128) as fp32 [rows, cols] in conv: each byte's value
 * times its 128 x 128 block's scale; scale is [N / 128, cols / 128] fp32 for
 * an N-row matrix. */
const float *ml_cpu_fp8_weight_rows(const uint8_t *w, const float *scale, size_t row0, int rows,
                                    int cols, float *conv);
/* x[0, n) = dequantize(quantize(x)) in format, in place, on the calling
 * thread (n a multiple of the block; quant.c): what ml_cpu_qdq_rows does to
 * each row. */
void ml_cpu_qdq_f32(moelink_quant_t format, float *x, size_t n);

/* Whether a GEMM with m token rows puts the weights first, making its
 * product come out transposed, [n, m]. */
int ml_cpu_weights_first(int m);
/* The BLAS call for a . w^T, a [m, K] (lda), w [n, K]: c is [m, n] (ldc), or
 * [n, m] (ldc) when ml_cpu_weights_first(m). */
void ml_cpu_gemm_raw(const float *a, int lda, int m, int K, const float *w, int n, float *c,
                     int ldc);
/* c[m, n] (ldc) = a . w^T in that layout always; tmp: m*n floats. */
void ml_cpu_gemm(const float *a, int lda, int m, int K, const float *w, int n, float *c, int ldc,
                 float *tmp);

/* The small-M GEMM (gemm_small.c). */
/* Whether ml_cpu_gemm_small runs weights of dtype here: bf16 or f16 on a CPU
 * with AVX2, FMA and F16C. */
int ml_cpu_small_ready(moelink_dtype_t dtype);
/* Whether a block of m token rows takes ml_cpu_gemm_small: a function of the
 * shape and the CPU only, so the choice never depends on scheduling. */
int ml_cpu_use_small(moelink_dtype_t dtype, int m);
/* c[m, n] (ldc) = a . w^T, a [m, K] fp32 (lda), w [n, K] of dtype read where
 * it lies, fp32 sums in an order fixed by K alone. Only when
 * ml_cpu_small_ready(dtype), or for f32 weights (the FP8 experts' widened
 * rows) when ml_cpu_small_fp8_ready(); does nothing otherwise. */
void ml_cpu_gemm_small(const float *a, int lda, int m, int K, moelink_dtype_t dtype,
                       const void *w, int n, float *c, int ldc);
/* FP8 experts: whether blocks of m token rows take ml_cpu_gemm_small on their
 * widened weight rows (the CPU of ml_cpu_small_ready, m <= ML_CPU_SMALL_ROWS). */
int ml_cpu_small_fp8_ready(void);
int ml_cpu_use_small_fp8(int m);
/* Whether ml_cpu_fp8_row_simd runs here (AVX2, F16C); it widens a row of
 * cols e4m3 codes (cols a multiple of 128, scale[i / 128] for code i) to
 * value x scale in fp32, bitwise what the table decode gives. */
int ml_cpu_fp8_simd(void);
void ml_cpu_fp8_row_simd(const uint8_t *src, const float *scale, int cols, float *dst);

/* Expert blocks (experts.c), shared by the routed and the shared expert. */
/* h[m, ldh] columns [0, nc) = silu(a . wg^T) * (a . wu^T), a [m, K] (lda),
 * wg and wu [nc, K]; tmp: 2 * row_chunk * nc floats. */
void ml_cpu_swiglu_block(const float *a, int lda, int m, int K, const float *wg, const float *wu,
                         int nc, float *h, int ldh, int row_chunk, float *tmp);
/* y[m, ldy] columns [0, nc) = scale[r] * (a . wd^T), a [m, K] (lda), wd
 * [nc, K]; row_scale NULL means 1; row r's scale is
 * row_scale[map ? map[r] : r]; tmp: row_chunk * nc floats. */
void ml_cpu_down_block(const float *a, int lda, int m, int K, const float *wd, int nc, float *y,
                       int ldy, const float *row_scale, const int32_t *map, int row_chunk,
                       float *tmp);

/* Combine (combine.c): out[t] = sum_j y[pair_rows[t*k+j]] (+ add[t] when add is
 * not NULL), fp32 sums, one rounding to the layer dtype. y rows of y_dtype. */
moelink_status_t ml_cpu_combine_rows(moelink_moe_t moe, const void *y, moelink_dtype_t y_dtype,
                                     int num_tokens, const moelink_plan_t *plan, const float *add,
                                     void *out);

/* Backend entry points (one file each). */
moelink_status_t ml_cpu_route(moelink_moe_t moe, const void *x, int num_tokens, int32_t *ids,
                              float *weights, void *stream);
moelink_status_t ml_cpu_plan(moelink_moe_t moe, const int32_t *ids, int num_tokens,
                             void *plan_buffer, void *stream);
moelink_status_t ml_cpu_experts(moelink_moe_t moe, const void *x, int num_tokens,
                                const void *plan_buffer, const float *weights, void *y,
                                void *stream);
moelink_status_t ml_cpu_combine(moelink_moe_t moe, const void *y, int num_tokens,
                                const void *plan_buffer, void *out, void *stream);
moelink_status_t ml_cpu_fill_random(moelink_context_t ctx, moelink_dtype_t dtype, void *ptr,
                                    size_t n, uint64_t seed, float scale, float offset,
                                    void *stream);
moelink_status_t ml_cpu_quantize(moelink_context_t ctx, moelink_quant_t format,
                                 moelink_dtype_t dtype, const void *x, int rows, int cols,
                                 uint8_t *q, void *scales, void *stream);
moelink_status_t ml_cpu_dequantize(moelink_context_t ctx, moelink_quant_t format,
                                   moelink_dtype_t dtype, const uint8_t *q, const void *scales,
                                   int rows, int cols, void *x, void *stream);

/* 8-bit rows (quant.c), for checked arguments (format FP8 or MXFP8, dtype
 * F32/BF16/F16, cols a multiple of the block), on up to nthreads threads with
 * the same results on any count: moelink_quantize, moelink_dequantize, and
 * out = dequantize(quantize(x)) in x's dtype, bitwise the two in sequence
 * (out may be x). */
void ml_cpu_quant_rows(moelink_quant_t format, moelink_dtype_t dtype, const void *x, int rows,
                       int cols, uint8_t *q, void *scales, int nthreads);
void ml_cpu_dequant_rows(moelink_quant_t format, moelink_dtype_t dtype, const uint8_t *q,
                         const void *scales, int rows, int cols, void *x, int nthreads);
void ml_cpu_qdq_rows(moelink_quant_t format, moelink_dtype_t dtype, const void *x, int rows,
                     int cols, void *out, int nthreads);

#endif
