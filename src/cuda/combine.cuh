/* Device side of the combine (combine.cu), shared with the expert-parallel
 * layer's one-kernel combine (src/ep/cuda): a token's expert rows summed in
 * slot order. CUDA only. */
#ifndef MOELINK_CUDA_COMBINE_CUH
#define MOELINK_CUDA_COMBINE_CUH

#include "core/dtype.cuh"

#include <stdint.h>

/* acc (8 fp32, zero or a running sum) += chunk q (8 columns) of each of a
 * token's k expert rows of y (rows of row_chunks 16-byte chunks), in slot
 * order: rows[j] is slot j's row, -1 an empty slot (not added). Up to 8
 * slots' loads are issued together before their adds: at decode sizes the
 * combine is a chain of memory latencies. COHERENT: y is read through L2
 * (rows another GPU stored during this kernel); else by the read-only path. */
template <int DT, int COHERENT>
static __device__ __forceinline__ void ml_combine_slots(const uint4 *y, const int *rows, int k,
                                                        size_t row_chunks, int q, float *acc) {
  for (int j0 = 0; j0 < k; j0 += 8) {
    uint4 raw[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int r = j0 + u < k ? rows[j0 + u] : -1;
      if (COHERENT)
        raw[u] = r >= 0 ? __ldcg(y + (size_t)r * row_chunks + q) : make_uint4(0u, 0u, 0u, 0u);
      else
        raw[u] = r >= 0 ? __ldg(y + (size_t)r * row_chunks + q) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (j0 + u >= k || rows[j0 + u] < 0)
        continue; /* empty slot: not added */
      float v[8];
      ml_dt_unpack16<DT>(raw[u], v);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        acc[i] += v[i];
    }
  }
}

#endif
