/* dtype sizes, names and conversions to and from fp32. */
#include "core/core.h"

#include <math.h>
#include <string.h>

size_t moelink_dtype_size(moelink_dtype_t dtype) {
  switch (dtype) {
  case MOELINK_DTYPE_F32: return 4;
  case MOELINK_DTYPE_BF16: return 2;
  case MOELINK_DTYPE_F16: return 2;
  case MOELINK_DTYPE_FP8_E4M3: return 1;
  }
  return 0;
}

const char *moelink_dtype_name(moelink_dtype_t dtype) {
  switch (dtype) {
  case MOELINK_DTYPE_F32: return "f32";
  case MOELINK_DTYPE_BF16: return "bf16";
  case MOELINK_DTYPE_F16: return "f16";
  case MOELINK_DTYPE_FP8_E4M3: return "fp8_e4m3";
  }
  return "unknown";
}

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float ml_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t ml_f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

float ml_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24 */
    float v = (float)man * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t ml_f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {
    /* result is subnormal or zero: round a * 2^24 to an integer, ties to even */
    float v = bits_f32(a) * 16777216.0f;
    float r = nearbyintf(v); /* default rounding mode: to nearest even */
    return (uint16_t)(sign | (uint16_t)r);
  }
  /* normal: rebias the exponent and round the 13 dropped bits to nearest even */
  uint32_t m = a + ((uint32_t)(15 - 127) << 23);
  m += 0xfffu + ((m >> 13) & 1u);
  return (uint16_t)(sign | (m >> 13));
}

void ml_to_f32(moelink_dtype_t dtype, const void *src, float *dst, size_t n) {
  switch (dtype) {
  case MOELINK_DTYPE_F32: memcpy(dst, src, n * 4); return;
  case MOELINK_DTYPE_BF16: {
    const uint16_t *s = (const uint16_t *)src;
    for (size_t i = 0; i < n; ++i) dst[i] = bits_f32((uint32_t)s[i] << 16);
    return;
  }
  case MOELINK_DTYPE_F16: {
    const uint16_t *s = (const uint16_t *)src;
    for (size_t i = 0; i < n; ++i) dst[i] = ml_f16_to_f32(s[i]);
    return;
  }
  default: return;
  }
}

void ml_from_f32(moelink_dtype_t dtype, const float *src, void *dst, size_t n) {
  switch (dtype) {
  case MOELINK_DTYPE_F32: memcpy(dst, src, n * 4); return;
  case MOELINK_DTYPE_BF16: {
    uint16_t *d = (uint16_t *)dst;
    for (size_t i = 0; i < n; ++i) d[i] = ml_f32_to_bf16(src[i]);
    return;
  }
  case MOELINK_DTYPE_F16: {
    uint16_t *d = (uint16_t *)dst;
    for (size_t i = 0; i < n; ++i) d[i] = ml_f32_to_f16(src[i]);
    return;
  }
  default: return;
  }
}

int moelink_quant_block(moelink_quant_t format) {
  switch (format) {
  case MOELINK_QUANT_FP8: return 128;
  case MOELINK_QUANT_MXFP8: return 32;
  default: return 0;
  }
}

size_t moelink_quant_scale_bytes(moelink_quant_t format, int cols) {
  const int b = moelink_quant_block(format);
  if (b == 0 || cols <= 0) return 0;
  return (size_t)(cols / b) * (format == MOELINK_QUANT_FP8 ? 4u : 1u);
}
