/* Device-side element conversions of the 16- and 32-bit dtypes, shared by the
 * CUDA kernels that move or sum data of any dtype (src/comm/cuda, src/tp/cuda).
 * fp32 <- bf16/f16 is exact; fp32 -> bf16/f16 rounds to nearest even. CUDA only. */
#ifndef MOELINK_CORE_DTYPE_CUH
#define MOELINK_CORE_DTYPE_CUH

#include "moelink.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

/* The 16-bit element h (low half of the word) of DT (bf16 or f16) as fp32. */
template <int DT>
static __device__ __forceinline__ float ml_dt_half_to_f32(uint32_t h) {
  if (DT == MOELINK_DTYPE_BF16) return __uint_as_float(h << 16);
  return __half2float(__ushort_as_half((unsigned short)h));
}

/* f rounded to one 16-bit element of DT (bf16 or f16), in the low half. */
template <int DT>
static __device__ __forceinline__ uint32_t ml_dt_f32_to_half(float f) {
  if (DT == MOELINK_DTYPE_BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  return __half_as_ushort(__float2half_rn(f));
}

/* 16 bytes of DT as fp32 values: 4 (f32) or 8 (bf16, f16), lowest address first. */
template <int DT>
static __device__ __forceinline__ void ml_dt_unpack16(uint4 v, float *f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (DT == MOELINK_DTYPE_F32) {
      f[k] = __uint_as_float(w[k]);
    } else if (DT == MOELINK_DTYPE_BF16) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      __half2 h;
      memcpy(&h, &w[k], 4);
      const float2 p = __half22float2(h);
      f[2 * k] = p.x;
      f[2 * k + 1] = p.y;
    }
  }
}

/* The inverse of ml_dt_unpack16, rounding each value once (16-bit pairs
 * with one paired conversion). */
template <int DT>
static __device__ __forceinline__ uint4 ml_dt_pack16(const float *f) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (DT == MOELINK_DTYPE_F32) {
      w[k] = __float_as_uint(f[k]);
    } else if (DT == MOELINK_DTYPE_BF16) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
      memcpy(&w[k], &b, 4);
    } else {
      const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
      memcpy(&w[k], &h, 4);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

#endif
