/* Tensor-parallel fused GEMMs on CPU ranks: the communicator's collective
 * and the GEMM one after the other (there is no copy engine to overlap with;
 * this backend exists so CI can check the semantics the GPU one must match).
 *
 * ag_gemm:  all-gather a's rows, then c = A b^T.
 * gemm_rs:  partial = a b^T rounded to the dtype, then reduce-scatter.
 * gemm_ar:  c = a b^T rounded to the dtype, then all-reduce in place.
 * The collectives sum in fp32 in rank order and round once (collectives.c),
 * which is exactly the documented semantics.
 *
 * The GEMM follows src/cpu/: a is converted to fp32 once, then one OpenMP
 * team of the context's num_threads runs work items (a block of rows times a
 * block of b's rows, whose bf16/f16 values the item converts into its
 * thread's buffer), each one single-threaded BLAS call. Item boundaries depend
 * on (m, n, k) alone and every output element is written by one item, so the
 * result does not depend on the thread count or the schedule. */
#include "cpu/cpu.h"
#include "tp/tp.h"

#include <stdlib.h>
#include <string.h>

/* b floats an item converts (256 KiB): stays in L2 while BLAS packs it. */
#define ML_TP_CONV_TARGET (64 * 1024)
/* Bounds of b rows per item; the upper one bounds the output scratch. */
#define ML_TP_MIN_COLS 8
#define ML_TP_MAX_COLS 256
/* Rows of a per item: enough items for a team even when n is one block. */
#define ML_TP_ROW_BLOCK 128

typedef struct ml_tp_cpu {
  void *base;
  size_t bytes;
  int nthreads;
  void *gathered;    /* [max_m, max_k] dtype: ag_gemm's all-gathered a (nranks > 1) */
  void *partial;     /* [max_m, max_n] dtype: gemm_rs's partial (nranks > 1) */
  float *a32;        /* [max_m, max_k]: a in fp32 (bf16/f16) */
  float *thread_buf; /* nthreads * per_thread floats */
  size_t conv_floats, tmp_floats, per_thread;
} ml_tp_cpu;

/* b rows per item for a reduction length k. */
static int ml_tp_cols(int k) {
  size_t c = (ML_TP_CONV_TARGET / (size_t)k) & ~(size_t)7;
  if (c < ML_TP_MIN_COLS) c = ML_TP_MIN_COLS;
  if (c > ML_TP_MAX_COLS) c = ML_TP_MAX_COLS;
  return (int)c;
}

static size_t ml_tp_min(size_t a, size_t b) { return a < b ? a : b; }
static size_t ml_tp_max(size_t a, size_t b) { return a > b ? a : b; }

/* Carves the workspace (base NULL: only sizes it); 0 on size_t overflow. */
static size_t ml_tp_layout(moelink_comm_t comm, const moelink_tp_config_t *cfg, int nthreads,
                           ml_tp_cpu *w, char *base) {
  const size_t M = (size_t)cfg->max_m, N = (size_t)cfg->max_n, K = (size_t)cfg->max_k;
  const size_t es = moelink_dtype_size(cfg->dtype);
  const int f32 = cfg->dtype == MOELINK_DTYPE_F32, multi = comm->nranks > 1;
  memset(w, 0, sizeof *w);
  w->nthreads = nthreads;
  /* An item's b block is min(cols(k), n) rows of k: bounded by both the
   * column cap times max_k and by max(target, MIN_COLS * max_k). */
  const size_t cols_cap = ml_tp_min(N, ML_TP_MAX_COLS);
  if (!f32)
    w->conv_floats = ml_tp_min(cols_cap * K, ml_tp_max(ML_TP_CONV_TARGET, ML_TP_MIN_COLS * K));
  w->tmp_floats = (size_t)ML_TP_ROW_BLOCK * cols_cap;
  w->per_thread = ml_cpu_round16(w->conv_floats) + ml_cpu_round16(w->tmp_floats);
  /* Each part: count elements of elem bytes, 64-byte aligned. The inputs are
   * ints, so M*K and M*N fit in 62 bits; only the byte totals can overflow. */
  const size_t parts[4][2] = {{multi ? M * K : 0, es},
                              {multi ? M * N : 0, es},
                              {f32 ? 0 : M * K, 4},
                              {(size_t)nthreads * w->per_thread, 4}};
  void **ptrs[4] = {&w->gathered, &w->partial, (void **)&w->a32, (void **)&w->thread_buf};
  size_t off = 0;
  for (int i = 0; i < 4; ++i) {
    const size_t count = parts[i][0], elem = parts[i][1];
    if (count && elem > (SIZE_MAX / 4) / count) return 0;
    const size_t bytes = (count * elem + 63) & ~(size_t)63;
    if (off > SIZE_MAX / 4 - bytes) return 0;
    *ptrs[i] = base && count ? base + off : NULL;
    off += bytes;
  }
  return off ? off : 64;
}

static moelink_status_t ml_tp_cpu_size(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                       size_t *bytes) {
  ml_tp_cpu w;
  const size_t n = ml_tp_layout(comm, cfg, comm->ctx->num_threads, &w, NULL);
  if (!n)
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY,
                   "tp: cpu workspace for max_m %d, max_n %d, max_k %d does not fit in memory",
                   cfg->max_m, cfg->max_n, cfg->max_k);
  *bytes = n;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_tp_cpu_init(moelink_tp_t tp) {
  const moelink_tp_config_t *cfg = &tp->cfg;
  size_t bytes = 0;
  ML_TRY(ml_tp_cpu_size(tp->comm, cfg, &bytes));
  ml_tp_cpu *w = (ml_tp_cpu *)calloc(1, sizeof *w);
  if (!w) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "tp: cpu state allocation failed");
  void *base = NULL;
  if (posix_memalign(&base, 64, bytes) != 0 || !base) {
    free(w);
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY,
                   "tp: cpu workspace of %zu bytes (max_m %d, max_n %d, max_k %d) could not be "
                   "allocated",
                   bytes, cfg->max_m, cfg->max_n, cfg->max_k);
  }
  ml_tp_layout(tp->comm, cfg, tp->comm->ctx->num_threads, w, (char *)base);
  w->base = base;
  w->bytes = bytes;
  tp->impl = w;
  /* No communication kernels on the CPU: comm_ctas has nothing to size. */
  return MOELINK_SUCCESS;
}

static void ml_tp_cpu_fini(moelink_tp_t tp) {
  ml_tp_cpu *w = (ml_tp_cpu *)tp->impl;
  if (!w) return;
  free(w->base);
  free(w);
  tp->impl = NULL;
}

/* out [m, n] of dtype = a [m, k] (dtype, row-major) . b [n, k]^T, fp32
 * accumulation, one rounding per element. */
static void ml_tp_gemm(ml_tp_cpu *w, moelink_dtype_t dt, const void *a, const void *b, void *out,
                       int m, int n, int k) {
  const size_t es = moelink_dtype_size(dt);
  const int f32 = dt == MOELINK_DTYPE_F32;
  const int cols = ml_tp_cols(k);
  const int row_blocks = (m + ML_TP_ROW_BLOCK - 1) / ML_TP_ROW_BLOCK;
  const int col_blocks = (n + cols - 1) / cols;
  const int items = row_blocks * col_blocks;
  const float *a32 = f32 ? (const float *)a : w->a32;
  int team = w->nthreads;
  if (team > items) team = items;

#pragma omp parallel num_threads(team)
  {
    const int tid = ml_cpu_team_thread();
    float *conv = w->thread_buf + (size_t)tid * w->per_thread;
    float *tmp = conv + ml_cpu_round16(w->conv_floats);

    if (!f32) {
#pragma omp for schedule(static)
      for (int rb = 0; rb < row_blocks; ++rb) {
        const size_t r0 = (size_t)rb * ML_TP_ROW_BLOCK;
        const size_t rows = ml_tp_min(ML_TP_ROW_BLOCK, (size_t)m - r0);
        ml_cpu_to_f32(dt, (const char *)a + r0 * (size_t)k * es, w->a32 + r0 * (size_t)k,
                      rows * (size_t)k);
      }
    }

    /* Column blocks outermost: consecutive items of a thread reuse b rows. */
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
      const int cb = it / row_blocks, rb = it % row_blocks;
      const int c0 = cb * cols, nc = n - c0 < cols ? n - c0 : cols;
      const int r0 = rb * ML_TP_ROW_BLOCK;
      const int mc = m - r0 < ML_TP_ROW_BLOCK ? m - r0 : ML_TP_ROW_BLOCK;
      const float *bw = ml_cpu_weight_rows(dt, b, (size_t)c0, nc, k, conv);
      const float *ar = a32 + (size_t)r0 * (size_t)k;
      char *o = (char *)out + ((size_t)r0 * (size_t)n + (size_t)c0) * es;
      if (ml_cpu_weights_first(mc)) {
        /* tmp is [nc, mc]: transpose while rounding. */
        ml_cpu_gemm_raw(ar, k, mc, k, bw, nc, tmp, mc);
        for (int r = 0; r < mc; ++r) {
          float line[ML_TP_MAX_COLS];
          for (int j = 0; j < nc; ++j) line[j] = tmp[(size_t)j * mc + r];
          ml_from_f32(dt, line, o + (size_t)r * (size_t)n * es, (size_t)nc);
        }
      } else if (f32) {
        ml_cpu_gemm_raw(ar, k, mc, k, bw, nc, (float *)(void *)o, n);
      } else {
        ml_cpu_gemm_raw(ar, k, mc, k, bw, nc, tmp, nc);
        for (int r = 0; r < mc; ++r)
          ml_from_f32(dt, tmp + (size_t)r * (size_t)nc, o + (size_t)r * (size_t)n * es,
                      (size_t)nc);
      }
    }
  }
}

static moelink_status_t ml_tp_cpu_run(moelink_tp_t tp, ml_tp_op op, const void *a, const void *b,
                                      void *c, int m, int n, int k, void *stream) {
  ml_tp_cpu *w = (ml_tp_cpu *)tp->impl;
  moelink_comm_t comm = tp->comm;
  const moelink_dtype_t dt = tp->cfg.dtype;
  const int nr = comm->nranks;
  switch (op) {
  case ML_TP_AG_GEMM: {
    const void *full = a;
    if (nr > 1) {
      ML_TRY(comm->ops->allgather(comm, a, w->gathered, (size_t)(m / nr) * (size_t)k, dt,
                                  stream));
      full = w->gathered;
    }
    ml_tp_gemm(w, dt, full, b, c, m, n, k);
    return MOELINK_SUCCESS;
  }
  case ML_TP_GEMM_RS:
    if (nr == 1) {
      ml_tp_gemm(w, dt, a, b, c, m, n, k);
      return MOELINK_SUCCESS;
    }
    ml_tp_gemm(w, dt, a, b, w->partial, m, n, k);
    return comm->ops->reduce_scatter(comm, w->partial, c, (size_t)(m / nr) * (size_t)n, dt,
                                     stream);
  case ML_TP_GEMM_AR:
    /* The partial goes to c itself: the CPU all-reduce stages each chunk
     * before it writes that chunk of the result, so in place is safe. */
    ml_tp_gemm(w, dt, a, b, c, m, n, k);
    if (nr == 1) return MOELINK_SUCCESS;
    return comm->ops->allreduce(comm, c, c, (size_t)m * (size_t)n, dt, stream);
  }
  return ml_fail(MOELINK_ERR_INTERNAL, "tp: unknown op %d", (int)op);
}

static const ml_tp_ops ml_tp_cpu_table = {
    "cpu", ml_tp_cpu_size, ml_tp_cpu_init, ml_tp_cpu_fini, ml_tp_cpu_run,
};

const ml_tp_ops *ml_tp_cpu_ops(void) { return &ml_tp_cpu_table; }
