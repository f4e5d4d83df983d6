/* FP8 (E4M3, the "fn" variant: no infinities, one NaN code per sign, largest
 * finite 448) and the two scaled row formats of moelink_quantize, as scalar
 * functions that the host (C) and the device (CUDA) share, so both produce
 * the same bits:
 *   FP8 (block 128): s = amax / 448 (fp32) over each 128 elements,
 *     q = e4m3(x / s); amax 0: s = 0, q = 0.
 *   MXFP8 (OCP MX, block 32): X = floor(log2(amax)) - 8 clamped to
 *     [-127, 127] (amax 0: X = 0), stored as the e8m0 byte X + 127,
 *     q = e4m3(x * 2^-X) (exact scaling; values past 448 saturate).
 * e4m3() rounds to nearest even, saturates to +-448 (infinities too) and
 * writes every NaN as 0x7f. An infinite amax counts as 2^128 (X = 120).
 * Dequantized: e4m3 value * scale, in fp32. */
#ifndef MOELINK_CORE_FP8_H
#define MOELINK_CORE_FP8_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define ML_FP8_FN static __host__ __device__ __forceinline__
#else
#define ML_FP8_FN static inline
#endif

#define ML_FP8_MAX 448.0f
#define ML_FP8_BLOCK 128 /* elements per fp32 scale (MOELINK_QUANT_FP8) */
#define ML_MX_BLOCK 32   /* elements per e8m0 scale (MOELINK_QUANT_MXFP8) */

ML_FP8_FN uint32_t ml_fp8_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

ML_FP8_FN float ml_fp8_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* fp32 -> e4m3fn, round to nearest even, saturating. */
ML_FP8_FN uint8_t ml_e4m3_from_f32(float f) {
  const uint32_t u = ml_fp8_bits(f);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)0x7fu; /* NaN: one code, as the hardware writes it */
  if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu); /* >= 448 (inf too): 448 */
  const int e = (int)(a >> 23) - 127;
  if (e < -6) {
    /* Below the smallest normal 2^-6: multiples of 2^-9, rounded to nearest
     * even (2^-6 itself, 8 * 2^-9, is the same code as the normal). The
     * product is exact (a power-of-two scaling of a value < 2^-6). */
    const float m = ml_fp8_float(a) * 512.0f;
    uint32_t n = (uint32_t)m; /* floor: m >= 0 */
    const float rest = m - (float)n;
    if (rest > 0.5f || (rest == 0.5f && (n & 1u))) ++n;
    return (uint8_t)(sign | n);
  }
  const uint32_t mant = a & 0x7fffffu;
  uint32_t r = (mant + 0x7ffffu + ((mant >> 20) & 1u)) >> 20; /* 3 bits, nearest even */
  int ex = e;
  if (r == 8u) {
    r = 0u;
    ++ex;
  }
  if (ex > 8 || (ex == 8 && r == 7u)) return (uint8_t)(sign | 0x7eu);
  return (uint8_t)(sign | (uint32_t)((ex + 7) << 3) | r);
}

ML_FP8_FN float ml_e4m3_to_f32(uint8_t b) {
  const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
  const uint32_t E = (b >> 3) & 15u, m = b & 7u;
  if (E == 15u && m == 7u) return ml_fp8_float(sign | 0x7fc00000u);
  if (E == 0u) {
    const float v = (float)m * 0.001953125f; /* m * 2^-9, exact */
    return sign ? -v : v;
  }
  return ml_fp8_float(sign | ((E - 7u + 127u) << 23) | (m << 20));
}

/* floor(log2(a)) for a finite a > 0 (fp32 subnormals included). */
ML_FP8_FN int ml_fp8_floor_log2(float a) {
  const uint32_t u = ml_fp8_bits(a) & 0x7fffffffu;
  const int ex = (int)(u >> 23);
  if (ex != 0) return ex - 127;
  uint32_t m = u & 0x7fffffu;
  int msb = -1;
  while (m) {
    ++msb;
    m >>= 1;
  }
  return msb - 149;
}

/* 2^x as fp32 for x in [-127, 127] (2^-127 is subnormal, still exact). */
ML_FP8_FN float ml_fp8_pow2(int x) {
  if (x >= -126) return ml_fp8_float((uint32_t)(x + 127) << 23);
  return ml_fp8_float(0x00400000u);
}

/* The e8m0 byte of a 32-element block with this amax (finite or not). */
ML_FP8_FN uint8_t ml_mx_e8m0(float amax) {
  int x = 0;
  if (amax > 0.0f) {
    x = (amax > 3.4028234e38f ? 128 : ml_fp8_floor_log2(amax)) - 8;
    if (x < -127) x = -127;
    if (x > 127) x = 127;
  }
  return (uint8_t)(x + 127);
}

/* The fp32 scale of an e8m0 byte (0..254 as written by ml_mx_e8m0). */
ML_FP8_FN float ml_mx_scale(uint8_t e8m0) { return ml_fp8_pow2((int)e8m0 - 127); }

/* The fp32 scale of a 128-element block with this amax. */
ML_FP8_FN float ml_fp8_block_scale(float amax) { return amax / ML_FP8_MAX; }

/* One element: FP8 block (s = the block's scale) and MXFP8 (inv = 2^-X). */
ML_FP8_FN uint8_t ml_fp8_quant(float x, float s) {
  return s > 0.0f ? ml_e4m3_from_f32(x / s) : (uint8_t)0;
}
ML_FP8_FN uint8_t ml_mx_quant(float x, uint8_t e8m0) {
  return ml_e4m3_from_f32(x * ml_fp8_pow2(127 - (int)e8m0));
}

#endif
