/* The counter-based generator behind moelink_fill_random. The CUDA backend
 * has the same arithmetic in src/cuda/fill.cu: keep the two identical. */
#include "core/core.h"
#include "core/random.h"

float moelink_random_value(uint64_t seed, size_t i, float scale, float offset) {
  return offset + scale * ml_random_unit(seed, (uint64_t)i);
}
