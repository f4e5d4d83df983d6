/* Contexts: a backend table plus its state. */
#include "core/core.h"
#include "moe/backend.h"

#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static const ml_backend_ops *ml_backend_table(moelink_backend_t b) {
  switch (b) {
  case MOELINK_BACKEND_CPU: return ml_cpu_backend();
  case MOELINK_BACKEND_CUDA: return ml_cuda_backend();
  }
  return NULL;
}

int moelink_backend_available(moelink_backend_t backend) {
  if (backend == MOELINK_BACKEND_CPU) return 1;
  if (backend != MOELINK_BACKEND_CUDA || !ml_cuda_backend()) return 0;
  /* Try a context on device 0: this answers "is a usable GPU here". */
  moelink_context_config_t cfg = MOELINK_CONTEXT_CONFIG_INIT;
  cfg.backend = MOELINK_BACKEND_CUDA;
  moelink_context_t ctx = NULL;
  if (moelink_context_create(&cfg, &ctx) != MOELINK_SUCCESS) return 0;
  moelink_context_destroy(ctx);
  return 1;
}

moelink_status_t moelink_context_create(const moelink_context_config_t *cfg,
                                        moelink_context_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "out is NULL");
  *out = NULL;
  moelink_context_config_t c = MOELINK_CONTEXT_CONFIG_INIT;
  if (cfg) {
    if (cfg->size != sizeof(moelink_context_config_t))
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "context config size %zu != %zu: initialize with MOELINK_CONTEXT_CONFIG_INIT",
                     cfg->size, sizeof(moelink_context_config_t));
    c = *cfg;
  }
  if (c.backend != MOELINK_BACKEND_CPU && c.backend != MOELINK_BACKEND_CUDA)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "backend %d is not a moelink_backend_t",
                   (int)c.backend);
  if (c.num_threads < 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "num_threads %d must be >= 0", c.num_threads);
  if (c.device < 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "device %d must be >= 0", c.device);
  const ml_backend_ops *ops = ml_backend_table(c.backend);
  if (!ops)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "backend cuda is not built into this library (configure with MOELINK_CUDA=ON)");
  moelink_context_t ctx = (moelink_context_t)calloc(1, sizeof *ctx);
  if (!ctx) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "context allocation failed");
  ctx->backend = c.backend;
  ctx->device = c.device;
  ctx->num_threads = c.num_threads;
  if (ctx->num_threads == 0) {
#ifdef _OPENMP
    ctx->num_threads = omp_get_num_procs();
#else
    ctx->num_threads = 1;
#endif
  }
  ctx->ops = ops;
  moelink_status_t s = ops->context_init ? ops->context_init(ctx) : MOELINK_SUCCESS;
  if (s != MOELINK_SUCCESS) {
    free(ctx);
    return s;
  }
  *out = ctx;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_context_destroy(moelink_context_t ctx) {
  ml_clear_error();
  if (!ctx) return MOELINK_SUCCESS;
  if (ctx->ops->context_fini) ctx->ops->context_fini(ctx);
  free(ctx);
  return MOELINK_SUCCESS;
}

moelink_backend_t moelink_context_backend(moelink_context_t ctx) {
  return ctx ? ctx->backend : MOELINK_BACKEND_CPU;
}

moelink_status_t moelink_fill_random(moelink_context_t ctx, moelink_dtype_t dtype, void *ptr,
                                     size_t n, uint64_t seed, float scale, float offset,
                                     void *stream) {
  ml_clear_error();
  if (!ctx) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "context is NULL");
  if (dtype != MOELINK_DTYPE_F32 && dtype != MOELINK_DTYPE_BF16 && dtype != MOELINK_DTYPE_F16)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "fill_random: dtype %s not supported",
                   moelink_dtype_name(dtype));
  if (n == 0) return MOELINK_SUCCESS;
  if (!ptr) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "fill_random: ptr is NULL");
  return ctx->ops->fill_random(ctx, dtype, ptr, n, seed, scale, offset, stream);
}

/* The checks moelink_quantize and moelink_dequantize share. */
static moelink_status_t ml_quant_check(const char *fn, moelink_context_t ctx,
                                       moelink_quant_t format, moelink_dtype_t dtype,
                                       const void *in, int rows, int cols, const void *out,
                                       const void *scales) {
  if (!ctx) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
  const int b = moelink_quant_block(format);
  if (b == 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: format %d is not FP8 (1) or MXFP8 (2)", fn,
                   (int)format);
  if (dtype != MOELINK_DTYPE_F32 && dtype != MOELINK_DTYPE_BF16 && dtype != MOELINK_DTYPE_F16)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: dtype %s not supported (f32, bf16, f16)", fn,
                   moelink_dtype_name(dtype));
  if (rows < 0) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: rows %d < 0", fn, rows);
  if (cols <= 0 || cols % b != 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: cols %d must be a positive multiple of the %s block %d", fn, cols,
                   format == MOELINK_QUANT_FP8 ? "FP8" : "MXFP8", b);
  if (rows > 0 && (!in || !out || !scales))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn,
                   !in ? "the input" : !out ? "the output" : "scales");
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_quantize(moelink_context_t ctx, moelink_quant_t format,
                                  moelink_dtype_t dtype, const void *x, int rows, int cols,
                                  uint8_t *q, void *scales, void *stream) {
  ml_clear_error();
  ML_TRY(ml_quant_check("quantize", ctx, format, dtype, x, rows, cols, q, scales));
  if (rows == 0) return MOELINK_SUCCESS;
  return ctx->ops->quantize(ctx, format, dtype, x, rows, cols, q, scales, stream);
}

moelink_status_t moelink_dequantize(moelink_context_t ctx, moelink_quant_t format,
                                    moelink_dtype_t dtype, const uint8_t *q, const void *scales,
                                    int rows, int cols, void *x, void *stream) {
  ml_clear_error();
  ML_TRY(ml_quant_check("dequantize", ctx, format, dtype, q, rows, cols, x, scales));
  if (rows == 0) return MOELINK_SUCCESS;
  return ctx->ops->dequantize(ctx, format, dtype, q, scales, rows, cols, x, stream);
}
