/* Combine: each token sums its k result rows in slot order in fp32 and is
 * rounded once; a token is one thread's work, so the order never varies. */
#include "cpu/cpu.h"

#include <string.h>

moelink_status_t ml_cpu_combine_rows(moelink_moe_t moe, const void *y, moelink_dtype_t y_dtype,
                                     int num_tokens, const moelink_plan_t *plan, const float *add,
                                     void *out) {
  const moelink_moe_config_t *c = &moe->cfg;
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const int H = c->hidden, k = c->top_k;
  const size_t yes = moelink_dtype_size(y_dtype), oes = moelink_dtype_size(c->dtype);
  const int32_t *pair_rows = plan->pair_rows;
#pragma omp parallel num_threads(ws->nthreads)
  {
    float *acc = ml_cpu_misc(ws, omp_get_thread_num());
    float *row = acc + H;
#pragma omp for schedule(static)
    for (int t = 0; t < num_tokens; ++t) {
      for (int i = 0; i < H; ++i) acc[i] = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int r = pair_rows[(size_t)t * k + j];
        if (r < 0) continue;
        const float *src;
        if (y_dtype == MOELINK_DTYPE_F32) {
          src = (const float *)y + (size_t)r * H;
        } else {
          ml_cpu_to_f32(y_dtype, (const char *)y + (size_t)r * H * yes, row, (size_t)H);
          src = row;
        }
        for (int i = 0; i < H; ++i) acc[i] += src[i];
      }
      if (add) {
        const float *a = add + (size_t)t * H;
        for (int i = 0; i < H; ++i) acc[i] += a[i];
      }
      ml_from_f32(c->dtype, acc, (char *)out + (size_t)t * H * oes, (size_t)H);
    }
  }
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_combine(moelink_moe_t moe, const void *y, int num_tokens,
                                const void *plan_buffer, void *out, void *stream) {
  (void)stream;
  const moelink_moe_config_t *c = &moe->cfg;
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view((void *)(uintptr_t)plan_buffer, num_tokens, c->top_k, c->num_experts,
                           moe->tile_rows, &plan));
  ML_TRY(ml_cpu_check_plan(&plan, 1));
  return ml_cpu_combine_rows(moe, y, c->dtype, num_tokens, &plan, NULL, out);
}
