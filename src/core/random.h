/* u(seed, i) in [-1, 1): splitmix64 of a key mixed from seed and index, top 24
 * bits as a fraction. Pure integer arithmetic plus one exact float step, so
 * host and device (src/cuda/fill.cu) produce bitwise the same values. */
#ifndef MOELINK_RANDOM_H
#define MOELINK_RANDOM_H

#include <stdint.h>

#if defined(__CUDACC__)
#define ML_HD __host__ __device__ __forceinline__
#else
#define ML_HD static inline
#endif

ML_HD uint64_t ml_splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

ML_HD float ml_random_unit(uint64_t seed, uint64_t i) {
  uint64_t h = ml_splitmix64(ml_splitmix64(seed) ^ (i * 0xd1b54a32d192ed03ull));
  /* 24 bits -> [0, 2^24) exactly representable; scale to [-1, 1) exactly. */
  return (float)(uint32_t)(h >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

#endif
