/* Epilogues of the tile GEMM engine: they read the fp32 accumulators of
 * ml_gemm_mainloop in registers and store straight to global memory, two
 * adjacent columns (4 or 8 bytes) per store. Columns come in pairs that never
 * straddle n because n is a multiple of 8 and a pair starts at an even
 * column; rows at or past the tile's row count are never stored.
 *
 * Row r of a tile is problem row row0 + r; the output row is the problem row
 * (outputs are in the plan's permuted order, ld = ldo elements). */
#ifndef MOELINK_CUDA_GEMM_EPILOGUE_CUH
#define MOELINK_CUDA_GEMM_EPILOGUE_CUH

#include "cuda/gemm/tile.cuh"

/* Position of accumulator element (mi, ni, 2h + c) inside the CTA tile. */
template <class S> static __device__ __forceinline__ int ml_gemm_acc_row(int mi, int h) {
  int lane = (int)threadIdx.x & 31;
  int wm = ((int)threadIdx.x >> 5) / S::WARPS_N;
  return wm * S::WTM + mi * 16 + (lane >> 2) + 8 * h;
}
template <class S> static __device__ __forceinline__ int ml_gemm_acc_col(int ni) {
  int lane = (int)threadIdx.x & 31;
  int wn = ((int)threadIdx.x >> 5) % S::WARPS_N;
  return wn * S::WTN + ni * 8 + (lane & 3) * 2;
}

/* Output column (relative to j0) of gate fragment ni < NI/2 under the
 * ml_gemm_b_gate_up row order; its up partner is fragment ni + NI/2. */
template <class S> static __device__ __forceinline__ int ml_gemm_gate_up_col(int ni) {
  int lane = (int)threadIdx.x & 31;
  int wn = ((int)threadIdx.x >> 5) % S::WARPS_N;
  return wn * (S::WTN / 2) + ni * 8 + (lane & 3) * 2;
}

/* silu(g) * u in fp32; __expf overflows to inf for very negative g, which
 * gives g / inf = -0, the right limit. */
static __device__ __forceinline__ float ml_swiglu(float g, float u) {
  return g / (1.0f + __expf(-g)) * u;
}

/* out[row0 + r, j0 + c] = silu(gate) * up, rounded once to DT. */
template <class S, int DT>
static __device__ __forceinline__ void ml_gemm_store_swiglu(const ml_gemm_acc<S> *acc, void *out,
                                                            int ldo, int row0, int rows, int j0,
                                                            int n) {
  constexpr int HALF = S::NI / 2;
#pragma unroll
  for (int mi = 0; mi < S::MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int r = ml_gemm_acc_row<S>(mi, h);
      if (r >= rows) continue;
      uint32_t *orow = (uint32_t *)((char *)out + (size_t)(row0 + r) * (size_t)ldo * 2);
#pragma unroll
      for (int ni = 0; ni < HALF; ++ni) {
        int j = j0 + ml_gemm_gate_up_col<S>(ni);
        if (j >= n) continue;
        const float *g = &acc->v[mi][ni][2 * h];
        const float *u = &acc->v[mi][ni + HALF][2 * h];
        orow[j >> 1] = ml_pack2<DT>(ml_swiglu(g[0], u[0]), ml_swiglu(g[1], u[1]));
      }
    }
}

/* out[row0 + r, n0 + c] = scale(r) * acc, as DT or (OUT_F32) as fp32. The
 * scale of problem row p is row_scale[scale_index[p]] (scale_index NULL:
 * row_scale[p]); row_scale NULL means 1. out_rows (DT output only) not NULL:
 * row p goes to the row out_rows[scale_index[p]] (scale_index NULL:
 * out_rows[p]) instead of out's row p. */
template <class S, int DT, int OUT_F32>
static __device__ __forceinline__ void
ml_gemm_store_scaled(const ml_gemm_acc<S> *acc, void *out, int ldo, int row0, int rows, int n0,
                     int n, const float *row_scale, const int32_t *scale_index,
                     void *const *out_rows) {
#pragma unroll
  for (int mi = 0; mi < S::MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int r = ml_gemm_acc_row<S>(mi, h);
      if (r >= rows) continue;
      int p = row0 + r;
      const int x = scale_index != NULL ? __ldg(scale_index + p) : p;
      float s = 1.0f;
      if (row_scale != NULL)
        s = __ldg(row_scale + x);
      char *orow = !OUT_F32 && out_rows != NULL
                       ? (char *)out_rows[x]
                       : (char *)out + (size_t)p * (size_t)ldo * (OUT_F32 ? 4 : 2);
#pragma unroll
      for (int ni = 0; ni < S::NI; ++ni) {
        int j = n0 + ml_gemm_acc_col<S>(ni);
        if (j >= n) continue;
        float v0 = acc->v[mi][ni][2 * h] * s, v1 = acc->v[mi][ni][2 * h + 1] * s;
        if (OUT_F32)
          ((float2 *)orow)[j >> 1] = make_float2(v0, v1);
        else
          ((uint32_t *)orow)[j >> 1] = ml_pack2<DT>(v0, v1);
      }
    }
}

#endif
