/* The interface every backend implements. The front end (src/moe/) validates
 * all arguments before calling in, so a backend sees: non-NULL pointers,
 * 1 <= num_tokens <= cfg.max_tokens, weights bound where an op needs them,
 * and a config that passed moelink_moe_config_check. Adding a backend means
 * adding a folder that fills one of these tables. */
#ifndef MOELINK_BACKEND_H
#define MOELINK_BACKEND_H

#include "moelink.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moelink_context {
  moelink_backend_t backend;
  int device;
  int num_threads;                 /* resolved: >= 1 */
  const struct ml_backend_ops *ops;
  void *impl;                      /* backend state */
};

struct moelink_moe {
  moelink_context_t ctx;
  moelink_moe_config_t cfg;
  moelink_moe_weights_t w;
  int has_weights;
  int tile_rows;                   /* set by the backend's moe_init */
  void *impl;                      /* backend state: workspace etc. */
};

typedef struct ml_backend_ops {
  const char *name;
  moelink_status_t (*context_init)(moelink_context_t ctx);
  void (*context_fini)(moelink_context_t ctx);
  /* Workspace bytes for cfg (what moe_init will allocate). */
  moelink_status_t (*moe_workspace_size)(moelink_context_t ctx, const moelink_moe_config_t *cfg,
                                         size_t *bytes);
  /* Sets moe->tile_rows and allocates moe->impl. */
  moelink_status_t (*moe_init)(moelink_moe_t moe);
  void (*moe_fini)(moelink_moe_t moe);
  moelink_status_t (*route)(moelink_moe_t moe, const void *x, int num_tokens, int32_t *ids,
                            float *weights, void *stream);
  moelink_status_t (*plan)(moelink_moe_t moe, const int32_t *ids, int num_tokens,
                           void *plan_buffer, void *stream);
  moelink_status_t (*experts)(moelink_moe_t moe, const void *x, int num_tokens,
                              const void *plan_buffer, const float *weights, void *y,
                              void *stream);
  moelink_status_t (*combine)(moelink_moe_t moe, const void *y, int num_tokens,
                              const void *plan_buffer, void *out, void *stream);
  /* moelink_fill_random on this backend's memory (n >= 1). */
  moelink_status_t (*fill_random)(moelink_context_t ctx, moelink_dtype_t dtype, void *ptr,
                                  size_t n, uint64_t seed, float scale, float offset,
                                  void *stream);
  /* moelink_quantize / moelink_dequantize on this backend's memory, checked:
   * format FP8 or MXFP8, dtype F32/BF16/F16, rows >= 1, cols a positive
   * multiple of the block, pointers non-NULL. */
  moelink_status_t (*quantize)(moelink_context_t ctx, moelink_quant_t format,
                               moelink_dtype_t dtype, const void *x, int rows, int cols,
                               uint8_t *q, void *scales, void *stream);
  moelink_status_t (*dequantize)(moelink_context_t ctx, moelink_quant_t format,
                                 moelink_dtype_t dtype, const uint8_t *q, const void *scales,
                                 int rows, int cols, void *x, void *stream);
  /* The whole layer for 1 <= num_tokens <= max_tokens (the front end chunks). */
  moelink_status_t (*forward)(moelink_moe_t moe, const void *x, int num_tokens, void *out,
                              void *stream);
} ml_backend_ops;

const ml_backend_ops *ml_cpu_backend(void);
/* NULL when the library was built without CUDA. */
const ml_backend_ops *ml_cuda_backend(void);

#ifdef __cplusplus
}
#endif

#endif
