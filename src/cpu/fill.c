/* fill_random on host memory: the value of element i is exactly
 * moelink_random_value(seed, i, scale, offset) rounded to the dtype, so it
 * does not depend on how the range is split among threads. */
#include "cpu/cpu.h"
#include "core/random.h"

#define ML_FILL_BLOCK 4096

moelink_status_t ml_cpu_fill_random(moelink_context_t ctx, moelink_dtype_t dtype, void *ptr,
                                    size_t n, uint64_t seed, float scale, float offset,
                                    void *stream) {
  (void)stream;
  const size_t es = moelink_dtype_size(dtype);
  const int64_t blocks = (int64_t)((n + ML_FILL_BLOCK - 1) / ML_FILL_BLOCK);
#pragma omp parallel for num_threads(ctx->num_threads) schedule(static)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    float buf[ML_FILL_BLOCK];
    const size_t i0 = (size_t)bi * ML_FILL_BLOCK;
    const size_t cnt = n - i0 < ML_FILL_BLOCK ? n - i0 : ML_FILL_BLOCK;
    float *dst = dtype == MOELINK_DTYPE_F32 ? (float *)ptr + i0 : buf;
    for (size_t i = 0; i < cnt; ++i) {
      const float u = ml_random_unit(seed, (uint64_t)(i0 + i));
      dst[i] = offset + scale * u;
    }
    if (dtype != MOELINK_DTYPE_F32) ml_from_f32(dtype, buf, (char *)ptr + i0 * es, cnt);
  }
  return MOELINK_SUCCESS;
}
