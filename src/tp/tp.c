/* Tensor-parallel fused GEMMs, front end: every public tp entry point checks
 * its arguments here, so a backend (src/tp/cpu/, src/tp/cuda/) only sees a
 * valid state, shapes inside the configured maxima, divisible row counts and
 * non-overlapping buffers. Nothing here knows how ranks talk. */
#include "tp/tp.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOELINK_HAVE_NCCL
const ml_tp_ops *ml_tp_cuda_ops(void) { return NULL; }
#endif

static moelink_status_t ml_tp_table(moelink_comm_t comm, const ml_tp_ops **ops) {
  *ops = NULL;
  switch (comm->ctx->backend) {
  case MOELINK_BACKEND_CPU: *ops = ml_tp_cpu_ops(); break;
  case MOELINK_BACKEND_CUDA: *ops = ml_tp_cuda_ops(); break;
  }
  if (!*ops)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "tp: no tensor-parallel ops for this communicator's backend in this build");
  return MOELINK_SUCCESS;
}

/* Checks cfg and copies it into *out (a caller's older, shorter struct keeps
 * the defaults of the fields it lacks). */
static moelink_status_t ml_tp_config_check(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                           moelink_tp_config_t *out) {
  if (!comm) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "tp: communicator is NULL");
  if (!cfg) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "tp: config is NULL");
  const moelink_tp_config_t defaults = MOELINK_TP_CONFIG_INIT;
  if (cfg->size < offsetof(moelink_tp_config_t, max_k) + sizeof cfg->max_k ||
      cfg->size > sizeof *cfg)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "tp: config size %zu is not one this library knows (%zu; use "
                   "MOELINK_TP_CONFIG_INIT)",
                   cfg->size, sizeof *cfg);
  *out = defaults;
  memcpy(out, cfg, cfg->size);
  out->size = sizeof *out;
  if (out->dtype != MOELINK_DTYPE_BF16 && out->dtype != MOELINK_DTYPE_F16 &&
      out->dtype != MOELINK_DTYPE_F32)
    return ml_fail(out->dtype == MOELINK_DTYPE_FP8_E4M3 ? MOELINK_ERR_UNSUPPORTED
                                                        : MOELINK_ERR_INVALID_ARGUMENT,
                   "tp: dtype %d is not supported (bf16, f16, f32)", (int)out->dtype);
  if (out->max_m < 1 || out->max_n < 1 || out->max_k < 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "tp: max_m %d, max_n %d and max_k %d must all be >= 1", out->max_m,
                   out->max_n, out->max_k);
  if (out->comm_ctas < 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "tp: comm_ctas %d < 0", out->comm_ctas);
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_tp_workspace_size(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                           size_t *bytes) {
  ml_clear_error();
  if (!bytes) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "tp_workspace_size: bytes is NULL");
  *bytes = 0;
  moelink_tp_config_t c;
  ML_TRY(ml_tp_config_check(comm, cfg, &c));
  const ml_tp_ops *ops;
  ML_TRY(ml_tp_table(comm, &ops));
  return ops->workspace_size(comm, &c, bytes);
}

moelink_status_t moelink_tp_create(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                   moelink_tp_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "tp_create: out is NULL");
  *out = NULL;
  moelink_tp_config_t c;
  ML_TRY(ml_tp_config_check(comm, cfg, &c));
  const ml_tp_ops *ops;
  ML_TRY(ml_tp_table(comm, &ops));
  moelink_tp_t tp = (moelink_tp_t)calloc(1, sizeof *tp);
  if (!tp) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "tp_create: out of host memory");
  tp->comm = comm;
  tp->cfg = c;
  tp->ops = ops;
  moelink_status_t s = ops->init(tp);
  if (s != MOELINK_SUCCESS) {
    free(tp);
    return s;
  }
  *out = tp;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_tp_destroy(moelink_tp_t tp) {
  ml_clear_error();
  if (!tp) return MOELINK_SUCCESS;
  tp->ops->fini(tp);
  free(tp);
  return MOELINK_SUCCESS;
}

static const char *const ml_tp_names[] = {"ag_gemm", "gemm_rs", "gemm_ar"};

/* Whether [p, p + bytes) and [q, q + qbytes) share a byte. */
static int ml_tp_overlap(const void *p, size_t bytes, const void *q, size_t qbytes) {
  uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
  return a < b + qbytes && b < a + bytes;
}

static moelink_status_t ml_tp_call(ml_tp_op op, moelink_tp_t tp, const void *a, const void *b,
                                   void *c, int m, int n, int k, void *stream) {
  ml_clear_error();
  const char *what = ml_tp_names[op];
  if (!tp) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: tp is NULL", what);
  const moelink_tp_config_t *cfg = &tp->cfg;
  const int nr = tp->comm->nranks;
  if (m < 0 || n < 1 || k < 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: m %d must be >= 0, n %d and k %d >= 1",
                   what, m, n, k);
  if (m > cfg->max_m || n > cfg->max_n || k > cfg->max_k)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: m %d, n %d, k %d exceed the tp's max_m %d, max_n %d, max_k %d", what, m,
                   n, k, cfg->max_m, cfg->max_n, cfg->max_k);
  if (op != ML_TP_GEMM_AR && m % nr)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: m %d is not a multiple of the %d ranks",
                   what, m, nr);
  if (m == 0) return MOELINK_SUCCESS;
  if (!a || !b || !c)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: %s is NULL", what,
                   !a ? "a" : !b ? "b" : "c");
  const size_t es = moelink_dtype_size(cfg->dtype);
  const size_t a_rows = op == ML_TP_AG_GEMM ? (size_t)(m / nr) : (size_t)m;
  const size_t c_rows = op == ML_TP_GEMM_RS ? (size_t)(m / nr) : (size_t)m;
  const size_t a_bytes = a_rows * (size_t)k * es, b_bytes = (size_t)n * (size_t)k * es;
  const size_t c_bytes = c_rows * (size_t)n * es;
  if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % es)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: a, b and c must be aligned to the %zu bytes of a %s element", what, es,
                   moelink_dtype_name(cfg->dtype));
  if (ml_tp_overlap(c, c_bytes, a, a_bytes) || ml_tp_overlap(c, c_bytes, b, b_bytes))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: c overlaps %s", what,
                   ml_tp_overlap(c, c_bytes, a, a_bytes) ? "a" : "b");
  return tp->ops->run(tp, op, a, b, c, m, n, k, stream);
}

moelink_status_t moelink_ag_gemm(moelink_tp_t tp, const void *a, const void *b, void *c, int m,
                                 int n, int k, void *stream) {
  return ml_tp_call(ML_TP_AG_GEMM, tp, a, b, c, m, n, k, stream);
}

moelink_status_t moelink_gemm_rs(moelink_tp_t tp, const void *a, const void *b, void *c, int m,
                                 int n, int k, void *stream) {
  return ml_tp_call(ML_TP_GEMM_RS, tp, a, b, c, m, n, k, stream);
}

moelink_status_t moelink_gemm_ar(moelink_tp_t tp, const void *a, const void *b, void *c, int m,
                                 int n, int k, void *stream) {
  return ml_tp_call(ML_TP_GEMM_AR, tp, a, b, c, m, n, k, stream);
}
