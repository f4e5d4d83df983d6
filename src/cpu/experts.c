/* Routed experts: gather each expert's token rows into one fp32 matrix, then
 * two phases of work items, each a block of one expert's weight rows (gate/up
 * with SwiGLU on the fly, then down with the routing weight), every item one
 * BLAS call on the calling thread per chunk of token rows, or, for bf16/f16
 * experts with few rows, ml_cpu_gemm_small on the weights as they lie. Items
 * are handed out dynamically, heaviest experts first; their boundaries depend
 * only on the shapes, so the results do not depend on scheduling.
 *
 * FP8 experts (cfg.fp8_experts): each weight block is dequantized into the
 * conversion buffer (e4m3 value * its 128 x 128 block's scale) where a
 * bf16/f16 block would be converted, and the GEMM inputs are replaced by
 * dequantize(quantize(row)) per 128 elements: the gathered token rows right
 * after the gather, each SwiGLU row once all its gate/up items are done (an
 * item covers only some columns of I, a block of 128 may span two). Blocks
 * with few token rows then go through the small-M kernel on those widened
 * fp32 rows (ml_cpu_use_small_fp8), the others through BLAS. */
#include "core/fp8.h"
#include "cpu/cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline float ml_silu(float g) { return g / (1.0f + expf(-g)); }

/* h[r, 0..nc) = silu(gate) * up for m rows of tmp [m, 2*nc] (gate columns,
 * then up columns). */
static void ml_silu_mul_rows(const float *tmp, int m, int nc, float *h, int ldh) {
  for (int r = 0; r < m; ++r) {
    const float *g = tmp + (size_t)r * 2 * nc, *u = g + nc;
    float *o = h + (size_t)r * ldh;
    for (int j = 0; j < nc; ++j) o[j] = ml_silu(g[j]) * u[j];
  }
}

/* y[r, 0..nc) *= row_scale[map ? map[r] : r] for m rows. */
static void ml_scale_rows(float *y, int ldy, int m, int nc, const float *row_scale,
                          const int32_t *map) {
  for (int r = 0; r < m; ++r) {
    float *o = y + (size_t)r * ldy;
    const float sc = row_scale[map ? map[r] : r];
    for (int j = 0; j < nc; ++j) o[j] = sc * o[j];
  }
}

void ml_cpu_swiglu_block(const float *a, int lda, int m, int K, const float *wg, const float *wu,
                         int nc, float *h, int ldh, int row_chunk, float *tmp) {
  /* Gate and up products land side by side as if from one GEMM over 2*nc
   * weight rows; converted blocks are adjacent and take one call. */
  const int fused = wu == wg + (size_t)nc * K;
  for (int r0 = 0; r0 < m; r0 += row_chunk) {
    const int mc = m - r0 < row_chunk ? m - r0 : row_chunk;
    const float *ar = a + (size_t)r0 * (size_t)lda;
    float *hr = h + (size_t)r0 * (size_t)ldh;
    if (ml_cpu_weights_first(mc)) {
      /* tmp is [2*nc, mc]: gate rows, then up rows. */
      if (fused) {
        ml_cpu_gemm_raw(ar, lda, mc, K, wg, 2 * nc, tmp, mc);
      } else {
        ml_cpu_gemm_raw(ar, lda, mc, K, wg, nc, tmp, mc);
        ml_cpu_gemm_raw(ar, lda, mc, K, wu, nc, tmp + (size_t)nc * mc, mc);
      }
      for (int r = 0; r < mc; ++r) {
        float *o = hr + (size_t)r * ldh;
        for (int j = 0; j < nc; ++j)
          o[j] = ml_silu(tmp[(size_t)j * mc + r]) * tmp[(size_t)(nc + j) * mc + r];
      }
    } else {
      /* tmp is [mc, 2*nc]: gate columns, then up columns. */
      if (fused) {
        ml_cpu_gemm_raw(ar, lda, mc, K, wg, 2 * nc, tmp, 2 * nc);
      } else {
        ml_cpu_gemm_raw(ar, lda, mc, K, wg, nc, tmp, 2 * nc);
        ml_cpu_gemm_raw(ar, lda, mc, K, wu, nc, tmp + nc, 2 * nc);
      }
      ml_silu_mul_rows(tmp, mc, nc, hr, ldh);
    }
  }
}

void ml_cpu_down_block(const float *a, int lda, int m, int K, const float *wd, int nc, float *y,
                       int ldy, const float *row_scale, const int32_t *map, int row_chunk,
                       float *tmp) {
  for (int r0 = 0; r0 < m; r0 += row_chunk) {
    const int mc = m - r0 < row_chunk ? m - r0 : row_chunk;
    const float *ar = a + (size_t)r0 * (size_t)lda;
    float *yr = y + (size_t)r0 * (size_t)ldy;
    if (ml_cpu_weights_first(mc)) {
      ml_cpu_gemm_raw(ar, lda, mc, K, wd, nc, tmp, mc);
      for (int r = 0; r < mc; ++r) {
        float *o = yr + (size_t)r * ldy;
        const float sc = row_scale ? row_scale[map ? map[r0 + r] : r0 + r] : 1.0f;
        for (int j = 0; j < nc; ++j) o[j] = sc * tmp[(size_t)j * mc + r];
      }
    } else {
      ml_cpu_gemm_raw(ar, lda, mc, K, wd, nc, yr, ldy);
      if (row_scale)
        ml_scale_rows(yr, ldy, mc, nc, map ? row_scale : row_scale + r0, map ? map + r0 : NULL);
    }
  }
}

/* The routed blocks of few token rows, bf16/f16 weights multiplied where they
 * lie (ml_cpu_gemm_small): the same results as above up to the order of the
 * fp32 sums. wg, wu, wd: the blocks' first rows in the layer dtype. */
static void ml_swiglu_small(const float *a, int lda, int m, int K, moelink_dtype_t dt,
                            const void *wg, const void *wu, int nc, float *h, int ldh,
                            float *tmp) {
  /* tmp is [m, 2*nc]: gate columns, then up columns (it holds row_chunk
   * such rows, and m <= ML_CPU_SMALL_ROWS < row_chunk). */
  ml_cpu_gemm_small(a, lda, m, K, dt, wg, nc, tmp, 2 * nc);
  ml_cpu_gemm_small(a, lda, m, K, dt, wu, nc, tmp + nc, 2 * nc);
  ml_silu_mul_rows(tmp, m, nc, h, ldh);
}

static void ml_down_small(const float *a, int lda, int m, int K, moelink_dtype_t dt,
                          const void *wd, int nc, float *y, int ldy, const float *row_scale,
                          const int32_t *map) {
  ml_cpu_gemm_small(a, lda, m, K, dt, wd, nc, y, ldy);
  if (row_scale) ml_scale_rows(y, ldy, m, nc, row_scale, map);
}

static int ml_cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Experts with rows, heaviest first (then by index), so the big items are
 * handed out early and the small ones fill the gaps at the end. */
static int ml_active_experts(const int32_t *off, int E, int64_t *order) {
  int n = 0;
  for (int e = 0; e < E; ++e) {
    const int rows = off[e + 1] - off[e];
    if (rows > 0) order[n++] = ((int64_t)(INT32_MAX - rows) << 32) | (int64_t)e;
  }
  qsort(order, (size_t)n, sizeof *order, ml_cmp_i64);
  return n;
}

static inline int ml_order_expert(const int64_t *order, int i) {
  return (int)(order[i] & 0xffffffff);
}

moelink_status_t ml_cpu_run_ffn(moelink_moe_t moe, const ml_cpu_ffn *job) {
  const moelink_moe_config_t *c = &moe->cfg;
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const ml_cpu_blocks *b = &ws->blk;
  const moelink_dtype_t dt = c->dtype;
  const size_t es = moelink_dtype_size(dt), xes = moelink_dtype_size(job->x_dtype);
  const int fp8 = c->fp8_experts;
  const size_t wes = fp8 ? 1 : es; /* bytes per routed expert weight */
  const float *gu_scale = moe->w.gate_up_scale, *dn_scale = moe->w.down_scale;
  const int H = c->hidden, inter = c->inter, E = c->num_experts, k = c->top_k;
  const int T = job->num_tokens;
  const moelink_plan_t *plan = job->plan;
  const int32_t *off = plan->expert_offsets, *pairs = plan->sorted_pairs;
  const int R = off[E];
  const int shared = job->x32 && c->shared_inter > 0;
  if (R == 0 && !shared) return MOELINK_SUCCESS;
  if (shared && c->shared_gate) ml_cpu_to_f32(dt, moe->w.shared_gate, ws->sh_gw, (size_t)H);

  const int nact = ml_active_experts(off, E, ws->order);
  const int gu_blk = (inter + b->gu_cols - 1) / b->gu_cols;
  const int dn_blk = (H + b->down_cols - 1) / b->down_cols;
  const int s_gu = shared ? ml_cpu_shared_gu_items(c, b) : 0;
  const int s_dn = shared ? ml_cpu_shared_down_items(c, b) : 0;
  const int n_gu = s_gu + nact * gu_blk, n_dn = s_dn + nact * dn_blk;
  const char *gate_up = (const char *)moe->w.gate_up, *down = (const char *)moe->w.down;
  float *xg = ws->xg, *hbuf = ws->h, *y32 = job->y32;
  /* FP8 routed and shared experts reading the same fp32 token rows: the
   * routed experts' rows are the shared expert's quantized ones (sh_xq),
   * gathered, not quantized again per pair */
  const float *xq_rows = fp8 && shared && c->fp8_shared && job->x_dtype == MOELINK_DTYPE_F32 &&
                                 job->x == (const void *)job->x32
                             ? ws->sh_xq
                             : NULL;

#pragma omp parallel num_threads(ws->nthreads)
  {
    const int tid = ml_cpu_team_thread();
    float *conv = ml_cpu_conv(ws, tid), *tmp = ml_cpu_tmp(ws, tid);

    if (shared && c->fp8_shared) {
      /* the FP8 shared expert's input rows, as the routed experts' */
#pragma omp for schedule(static)
      for (int t = 0; t < T; ++t) {
        memcpy(ws->sh_xq + (size_t)t * H, job->x32 + (size_t)t * H, (size_t)H * sizeof(float));
        ml_cpu_qdq_f32(MOELINK_QUANT_FP8, ws->sh_xq + (size_t)t * H, (size_t)H);
      }
    }
#pragma omp for schedule(static)
    for (int r = 0; r < R; ++r) {
      const int t = pairs[r] / k;
      if (xq_rows) {
        memcpy(xg + (size_t)r * H, xq_rows + (size_t)t * H, (size_t)H * sizeof(float));
        continue;
      }
      ml_cpu_to_f32(job->x_dtype, (const char *)job->x + (size_t)t * H * xes,
                    xg + (size_t)r * H, (size_t)H);
      if (fp8) ml_cpu_qdq_f32(MOELINK_QUANT_FP8, xg + (size_t)r * H, (size_t)H);
    }
    if (shared && c->shared_gate) {
#pragma omp for schedule(static)
      for (int t = 0; t < T; ++t) ml_cpu_shared_gate_token(moe, job->x32, t);
    }

    /* Shared items first: they have all T rows, the biggest items of all. */
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_gu; ++it) {
      if (it < s_gu) {
        ml_cpu_shared_gu_item(moe, job->x32, T, it, tid);
        continue;
      }
      const int i = it - s_gu, e = ml_order_expert(ws->order, i / gu_blk);
      const int c0 = (i % gu_blk) * b->gu_cols;
      const int nc = inter - c0 < b->gu_cols ? inter - c0 : b->gu_cols;
      const char *we = gate_up + (size_t)e * 2 * inter * H * wes;
      const int m = off[e + 1] - off[e];
      const float *a = xg + (size_t)off[e] * H;
      float *h = hbuf + (size_t)off[e] * inter + c0;
      if (!fp8 && ml_cpu_use_small(dt, m)) {
        ml_swiglu_small(a, H, m, H, dt, we + (size_t)c0 * H * es,
                        we + ((size_t)inter + c0) * H * es, nc, h, inter, tmp);
        continue;
      }
      const float *wg, *wu;
      if (fp8) {
        const float *se = gu_scale + (size_t)e * (size_t)(2 * inter / ML_FP8_BLOCK) *
                                         (size_t)(H / ML_FP8_BLOCK);
        wg = ml_cpu_fp8_weight_rows((const uint8_t *)we, se, (size_t)c0, nc, H, conv);
        wu = ml_cpu_fp8_weight_rows((const uint8_t *)we, se, (size_t)inter + c0, nc, H,
                                    conv + (size_t)nc * H);
        /* widened once for the item; few token rows: the small GEMM on them */
        if (ml_cpu_use_small_fp8(m)) {
          ml_swiglu_small(a, H, m, H, MOELINK_DTYPE_F32, wg, wu, nc, h, inter, tmp);
          continue;
        }
      } else {
        wg = ml_cpu_weight_rows(dt, we, (size_t)c0, nc, H, conv);
        wu = ml_cpu_weight_rows(dt, we, (size_t)inter + c0, nc, H, conv + (size_t)nc * H);
      }
      ml_cpu_swiglu_block(a, H, m, H, wg, wu, nc, h, inter, b->row_chunk, tmp);
    }

    if (fp8) {
#pragma omp for schedule(static)
      for (int r = 0; r < R; ++r)
        ml_cpu_qdq_f32(MOELINK_QUANT_FP8, hbuf + (size_t)r * inter, (size_t)inter);
    }
    if (shared && c->fp8_shared) {
#pragma omp for schedule(static)
      for (int t = 0; t < T; ++t)
        ml_cpu_qdq_f32(MOELINK_QUANT_FP8, ws->sh_h + (size_t)t * c->shared_inter,
                       (size_t)c->shared_inter);
    }

#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_dn; ++it) {
      if (it < s_dn) {
        ml_cpu_shared_down_item(moe, T, it, tid);
        continue;
      }
      const int i = it - s_dn, e = ml_order_expert(ws->order, i / dn_blk);
      const int c0 = (i % dn_blk) * b->down_cols;
      const int nc = H - c0 < b->down_cols ? H - c0 : b->down_cols;
      const char *we = down + (size_t)e * H * inter * wes;
      const int r0 = off[e], m = off[e + 1] - off[e];
      /* FP8: the item's weight rows widened once, for either GEMM */
      const float *wd8 =
          fp8 ? ml_cpu_fp8_weight_rows((const uint8_t *)we,
                                       dn_scale + (size_t)e * (size_t)(H / ML_FP8_BLOCK) *
                                                      (size_t)(inter / ML_FP8_BLOCK),
                                       (size_t)c0, nc, inter, conv)
              : NULL;
      if (fp8 ? ml_cpu_use_small_fp8(m) : ml_cpu_use_small(dt, m)) {
        ml_down_small(hbuf + (size_t)r0 * inter, inter, m, inter,
                      fp8 ? MOELINK_DTYPE_F32 : dt,
                      fp8 ? (const void *)wd8 : we + (size_t)c0 * inter * es, nc,
                      y32 + (size_t)r0 * H + c0, H, job->weights, pairs + r0);
      } else {
        const float *wd = fp8 ? wd8 : ml_cpu_weight_rows(dt, we, (size_t)c0, nc, inter, conv);
        ml_cpu_down_block(hbuf + (size_t)r0 * inter, inter, m, inter, wd, nc,
                          y32 + (size_t)r0 * H + c0, H, job->weights, pairs + r0, b->row_chunk,
                          tmp);
      }
      if (job->y_out)
        for (int r = r0; r < r0 + m; ++r)
          ml_from_f32(dt, y32 + (size_t)r * H + c0,
                      (char *)job->y_out + ((size_t)r * H + (size_t)c0) * es, (size_t)nc);
    }
  }
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_experts(moelink_moe_t moe, const void *x, int num_tokens,
                                const void *plan_buffer, const float *weights, void *y,
                                void *stream) {
  (void)stream;
  const moelink_moe_config_t *c = &moe->cfg;
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view((void *)(uintptr_t)plan_buffer, num_tokens, c->top_k, c->num_experts,
                           moe->tile_rows, &plan));
  ML_TRY(ml_cpu_check_plan(&plan, 0));
  ml_cpu_ffn job;
  memset(&job, 0, sizeof job);
  job.x = x;
  job.x_dtype = c->dtype;
  job.num_tokens = num_tokens;
  job.plan = &plan;
  job.weights = weights;
  if (c->dtype == MOELINK_DTYPE_F32) {
    job.y32 = (float *)y;
  } else {
    /* The gathered rows of an expert are dead once its gate/up items are
     * done, so the fp32 results reuse that buffer. */
    job.y32 = ml_cpu_ws(moe)->xg;
    job.y_out = y;
  }
  return ml_cpu_run_ffn(moe, &job);
}
