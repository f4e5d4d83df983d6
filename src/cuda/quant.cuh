/* Device side of the 8-bit row formats (src/core/fp8.h has the scalar
 * definitions): a lane holds 8 consecutive elements of a row, so an FP8
 * block of 128 is 16 adjacent lanes and an MXFP8 block of 32 is 4; the
 * block's amax is a shuffle reduction over them. Used by moelink_quantize /
 * moelink_dequantize (quant.cu) and by the expert-parallel dispatch, which
 * quantizes rows on their way out (src/ep/cuda). CUDA only. */
#ifndef MOELINK_CUDA_QUANT_CUH
#define MOELINK_CUDA_QUANT_CUH

#include "core/dtype.cuh"
#include "core/fp8.h"

#include <cuda_fp8.h>

#define ML_Q_FULL 0xffffffffu

/* 8 elements of DT at p (16-byte aligned; 32 bytes for F32) as fp32. */
template <int DT>
static __device__ __forceinline__ void ml_q_load8(const void *p, float *f) {
  const uint4 *v = (const uint4 *)p;
  if (DT == MOELINK_DTYPE_F32) {
    ml_dt_unpack16<DT>(__ldg(v), f);
    ml_dt_unpack16<DT>(__ldg(v + 1), f + 4);
  } else {
    ml_dt_unpack16<DT>(__ldg(v), f);
  }
}

template <int DT>
static __device__ __forceinline__ void ml_q_store8(void *p, const float *f) {
  uint4 *v = (uint4 *)p;
  if (DT == MOELINK_DTYPE_F32) {
    v[0] = ml_dt_pack16<DT>(f);
    v[1] = ml_dt_pack16<DT>(f + 4);
  } else {
    v[0] = ml_dt_pack16<DT>(f);
  }
}

/* The largest |f[i]| of this lane's 8 (NaN ignored), then of its block's
 * `lanes` lanes (16 or 4, aligned groups; every lane of the warp calls it). */
static __device__ __forceinline__ float ml_q_block_amax(const float *f, int lanes) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(f[i]));
  for (int o = lanes >> 1; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(ML_Q_FULL, a, o));
  return a;
}

/* Two fp32 values to e4m3 (a in the low byte): the hardware conversion
 * (round to nearest even, finite saturation), with NaN as src/core/fp8.h
 * writes it (the hardware drops its sign). */
static __device__ __forceinline__ uint32_t ml_q_cvt2(float a, float b) {
  uint32_t r = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  /* ml_e4m3_from_f32 writes every NaN as 0x7f: a select, not an inline copy
   * of the software conversion at every call (they bloated the quantizing
   * GEMM epilogue by ~3,000 instructions) */
  r = isnan(a) ? (r & 0xff00u) | 0x7fu : r;
  r = isnan(b) ? (r & 0x00ffu) | 0x7f00u : r;
  return r;
}

/* x as the FP8 block format scales it before the e4m3 conversion (s: the
 * block's scale; a zero block stays zero), as ml_fp8_quant does. */
static __device__ __forceinline__ float ml_q_fp8_scaled(float x, float s) {
  return s > 0.0f ? x / s : 0.0f;
}

/* The same e4m3 bytes for a whole block, cheaper: a block's elements all
 * divide by one scale, so its reciprocal is taken once (ml_q_div_of) and each
 * element costs a multiply and four FMAs (ml_q_fp8_scaled_by) instead of an
 * IEEE division (a reciprocal approximation, its refinement, a range check
 * and a slow-path call, per element). q0 = x r is within a few ulp of x / s;
 * two corrections q + (x - q s) r, the residual exact by FMA, give the
 * correctly rounded quotient (Markstein's theorem: r the rounded reciprocal,
 * q within one ulp before the last step), the bits of x / s, for s in
 * [2^-60, 2^60] and |x| >= 2^-80 (the residual stays normal). Smaller |x|
 * give |x / s| < 2^-20, a signed zero in e4m3 either way; s outside that
 * range runs the division itself. ml_cuda_q_div_check compares both ways on
 * the GPU over random and edge-case pairs. */
typedef struct ml_q_div_t {
  float s, r;
  int fast; /* 1: the corrections are exact for this s */
} ml_q_div_t;

static __device__ __forceinline__ ml_q_div_t ml_q_div_of(float s) {
  ml_q_div_t d;
  d.s = s;
  d.fast = s >= 0x1p-60f && s <= 0x1p60f;
  d.r = d.fast ? __frcp_rn(s) : 0.0f;
  return d;
}

/* ml_q_fp8_scaled out of line: the rare scales outside the fast range,
 * kept from unrolled loops (an inline IEEE division is ~20 instructions). */
static __device__ __noinline__ float ml_q_fp8_scaled_slow(float x, float s) {
  return ml_q_fp8_scaled(x, s);
}

/* For d.fast only. */
static __device__ __forceinline__ float ml_q_fp8_scaled_fast(float x, const ml_q_div_t &d) {
  float q = x * d.r;
  q = fmaf(fmaf(-q, d.s, x), d.r, q);
  q = fmaf(fmaf(-q, d.s, x), d.r, q);
  /* a zero x keeps its sign (the corrections would add +0 to -0) */
  return copysignf(q, x);
}

static __device__ __forceinline__ float ml_q_fp8_scaled_by(float x, const ml_q_div_t &d) {
  return d.fast ? ml_q_fp8_scaled_fast(x, d) : ml_q_fp8_scaled_slow(x, d.s);
}

/* z[i] = ml_q_fp8_scaled_by(x[i], d) for N values of one block, with one
 * branch for all of them (unrolled loops with a branch an element keep every
 * element's slow call site in the hot code). */
template <int N>
static __device__ __forceinline__ void ml_q_fp8_scale_n(const float *x, float *z,
                                                        const ml_q_div_t &d) {
  if (d.fast) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      z[i] = ml_q_fp8_scaled_fast(x[i], d);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      z[i] = ml_q_fp8_scaled_slow(x[i], d.s);
  }
}

/* 8 elements to e4m3 bytes (lowest address in the low byte). FMT is
 * MOELINK_QUANT_FP8 (s: the block's fp32 scale) or MXFP8 (e: its e8m0); the
 * scaled values are those of ml_fp8_quant / ml_mx_quant. */
template <int FMT>
static __device__ __forceinline__ uint2 ml_q_pack8(const float *f, float s, uint8_t e) {
  float v[8];
  const float m = FMT == MOELINK_QUANT_FP8 ? 0.0f : ml_fp8_pow2(127 - (int)e);
  if (FMT == MOELINK_QUANT_FP8) {
    ml_q_fp8_scale_n<8>(f, v, ml_q_div_of(s));
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i] = f[i] * m;
  }
  const uint32_t w0 = ml_q_cvt2(v[0], v[1]) | (ml_q_cvt2(v[2], v[3]) << 16);
  const uint32_t w1 = ml_q_cvt2(v[4], v[5]) | (ml_q_cvt2(v[6], v[7]) << 16);
  return make_uint2(w0, w1);
}

/* 8 e4m3 bytes times scale, in fp32 (e4m3 -> f16 -> f32 is exact). */
static __device__ __forceinline__ void ml_q_unpack8(uint2 q, float scale, float *f) {
  const uint32_t w[2] = {q.x, q.y};
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(w[h >> 1] >> (16 * (h & 1)));
    const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    __half2 hh;
    memcpy(&hh, &raw, 4);
    const float2 p = __half22float2(hh);
    f[2 * h] = p.x * scale;
    f[2 * h + 1] = p.y * scale;
  }
}

/* This lane's 8 elements f (at element offset col of a row whose scales
 * start at sc): the block's amax over the lanes of its block, the scale
 * written by the block's first lane, the 8 bytes returned. Lanes past the
 * row (live = 0) take part in the shuffles only. */
template <int FMT>
static __device__ __forceinline__ uint2 ml_q_quantize8(const float *f, int col, int live,
                                                       void *sc, int lane) {
  const int lanes = FMT == MOELINK_QUANT_FP8 ? ML_FP8_BLOCK / 8 : ML_MX_BLOCK / 8;
  float z[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) z[i] = live ? f[i] : 0.0f;
  const float amax = ml_q_block_amax(z, lanes);
  const float s = FMT == MOELINK_QUANT_FP8 ? ml_fp8_block_scale(amax) : 0.0f;
  const uint8_t e = FMT == MOELINK_QUANT_FP8 ? (uint8_t)0 : ml_mx_e8m0(amax);
  if (live && (lane & (lanes - 1)) == 0) {
    if (FMT == MOELINK_QUANT_FP8)
      ((float *)sc)[col / ML_FP8_BLOCK] = s;
    else
      ((uint8_t *)sc)[col / ML_MX_BLOCK] = e;
  }
  return ml_q_pack8<FMT>(z, s, e);
}

/* The scale of the block holding element col (scales of one row at sc). */
template <int FMT>
static __device__ __forceinline__ float ml_q_scale_at(const void *sc, int col) {
  if (FMT == MOELINK_QUANT_FP8) return __ldcg((const float *)sc + col / ML_FP8_BLOCK);
  return ml_mx_scale(((const uint8_t *)sc)[col / ML_MX_BLOCK]);
}

#endif
