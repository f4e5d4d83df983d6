/* moelink_fill_random on the device. The value of element i is
 * offset + scale * ml_random_unit(seed, i), computed with explicitly rounded
 * multiply and add (no fused multiply-add, which the host does not do
 * either), then rounded to the dtype to nearest even: bitwise what
 * moelink_random_value followed by the host conversion gives. */
#include "cuda/pipeline.h"
#include "core/random.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define ML_F_THREADS 256

template <int DT>
static __global__ void __launch_bounds__(ML_F_THREADS)
    ml_fill_kernel(void *p, size_t n, uint64_t seed, float scale, float offset) {
  const size_t stride = (size_t)gridDim.x * ML_F_THREADS;
  for (size_t i = (size_t)blockIdx.x * ML_F_THREADS + threadIdx.x; i < n; i += stride) {
    const float v = __fadd_rn(offset, __fmul_rn(scale, ml_random_unit(seed, (uint64_t)i)));
    if (DT == MOELINK_DTYPE_F32)
      ((float *)p)[i] = v;
    else if (DT == MOELINK_DTYPE_BF16)
      ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
    else
      ((__half *)p)[i] = __float2half_rn(v);
  }
}

extern "C" moelink_status_t ml_cuda_fill(moelink_dtype_t dt, void *p, size_t n, uint64_t seed,
                                         float scale, float offset, int sm_count,
                                         cudaStream_t stream) {
  if (n == 0) return MOELINK_SUCCESS;
  /* Enough CTAs to fill the GPU a few times over; the loop covers the rest. */
  const size_t cap = (size_t)(sm_count > 0 ? sm_count : 1) * 16;
  size_t blocks = (n + ML_F_THREADS - 1) / ML_F_THREADS;
  if (blocks > cap) blocks = cap;
  switch (dt) {
  case MOELINK_DTYPE_F32:
    ml_fill_kernel<MOELINK_DTYPE_F32><<<(unsigned)blocks, ML_F_THREADS, 0, stream>>>(
        p, n, seed, scale, offset);
    ML_CUDA_LAUNCHED("ml_fill_kernel<f32>");
    return MOELINK_SUCCESS;
  case MOELINK_DTYPE_BF16:
    ml_fill_kernel<MOELINK_DTYPE_BF16><<<(unsigned)blocks, ML_F_THREADS, 0, stream>>>(
        p, n, seed, scale, offset);
    ML_CUDA_LAUNCHED("ml_fill_kernel<bf16>");
    return MOELINK_SUCCESS;
  case MOELINK_DTYPE_F16:
    ml_fill_kernel<MOELINK_DTYPE_F16><<<(unsigned)blocks, ML_F_THREADS, 0, stream>>>(
        p, n, seed, scale, offset);
    ML_CUDA_LAUNCHED("ml_fill_kernel<f16>");
    return MOELINK_SUCCESS;
  default: break;
  }
  return ml_fail(MOELINK_ERR_UNSUPPORTED, "fill_random: dtype %s not supported on CUDA",
                 moelink_dtype_name(dt));
}
