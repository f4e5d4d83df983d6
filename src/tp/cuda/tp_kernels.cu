/* Kernels of the CUDA tensor-parallel ops (tp_cuda.h): the flag kernels that
 * order one call's steps across ranks, the reduction/copy pass, and a plain
 * GEMM for shapes the tensor-core engines refuse. */
#include "tp/cuda/tp_cuda.h"

#include "core/dtype.cuh"
#include "cuda/cuda.h"


#define ML_TPC_THREADS 512

/* ---- flags ------------------------------------------------------------------ */

__global__ void ml_tpc_begin_kernel(const __grid_constant__ ml_tpc_sync s) {
  const uint64_t e = *s.epoch + 1;
  __syncthreads();
  if (threadIdx.x == 0) *s.epoch = e;
  const int p = (int)threadIdx.x;
  if (p < s.dc.nranks && p != s.dc.rank)
    moelink_signal_wait(&s.dc, s.flags[s.dc.rank] + ML_TPC_DONE * ML_TPC_MAX_RANKS + p, e - 1, p,
                        ML_TPC_PRIM_BEGIN);
}

static __device__ __forceinline__ void ml_tpc_signal_all(const ml_tpc_sync *s, int kind,
                                                         uint64_t e) {
  __threadfence_system();
  for (int p = 0; p < s->dc.nranks; ++p)
    if (p != s->dc.rank)
      moelink_signal_set(s->flags[p] + kind * ML_TPC_MAX_RANKS + s->dc.rank, e);
}

/* Every thread p < nranks waits for peer p's flag; 1 when all arrived. */
static __device__ __forceinline__ int ml_tpc_wait_all(const ml_tpc_sync *s, int kind,
                                                      uint64_t e) {
  int ok = 1;
  const int p = (int)threadIdx.x;
  if (p < s->dc.nranks && p != s->dc.rank)
    ok = moelink_signal_wait(&s->dc, s->flags[s->dc.rank] + kind * ML_TPC_MAX_RANKS + p, e, p,
                             kind == ML_TPC_GATHER ? ML_TPC_PRIM_GATHER : ML_TPC_PRIM_READY);
  return __syncthreads_and(ok);
}

__global__ void ml_tpc_signal_kernel(const __grid_constant__ ml_tpc_sync s, int kind) {
  ml_tpc_signal_all(&s, kind, *s.epoch);
}

__global__ void ml_tpc_wait_kernel(const __grid_constant__ ml_tpc_sync s, int kind) {
  ml_tpc_wait_all(&s, kind, *s.epoch);
}

extern "C" moelink_status_t ml_tpc_begin(const ml_tpc_sync *s, cudaStream_t stream) {
  ml_tpc_begin_kernel<<<1, 32, 0, stream>>>(*s);
  ML_CUDA_LAUNCHED("ml_tpc_begin_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_tpc_signal(const ml_tpc_sync *s, int kind, cudaStream_t stream) {
  ml_tpc_signal_kernel<<<1, 1, 0, stream>>>(*s, kind);
  ML_CUDA_LAUNCHED("ml_tpc_signal_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_tpc_wait(const ml_tpc_sync *s, int kind, cudaStream_t stream) {
  ml_tpc_wait_kernel<<<1, 32, 0, stream>>>(*s, kind);
  ML_CUDA_LAUNCHED("ml_tpc_wait_kernel");
  return MOELINK_SUCCESS;
}

/* ---- the reduction / copy pass ----------------------------------------------- */

typedef struct ml_tpc_pass_args {
  ml_tpc_pass p;
  int vec; /* every pointer 16-byte aligned: 8 elements a step */
} ml_tpc_pass_args;

template <int DT>
__global__ void __launch_bounds__(ML_TPC_THREADS)
    ml_tpc_pass_kernel(const __grid_constant__ ml_tpc_sync s,
                       const __grid_constant__ ml_tpc_pass_args a) {
  const ml_tpc_pass *p = &a.p;
  const uint64_t e = *s.epoch;
  if (p->signal_kind >= 0 && blockIdx.x == 0 && threadIdx.x == 0)
    ml_tpc_signal_all(&s, p->signal_kind, e);
  if (p->wait_kind >= 0) ml_tpc_wait_all(&s, p->wait_kind, e);

  const size_t nthreads = (size_t)gridDim.x * blockDim.x;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (a.vec) {
    const size_t nv = p->count / 8;
    for (size_t v = tid; v < nv; v += nthreads) {
      float acc[8], f[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.f;
      for (int q = 0; q < p->nsrc; ++q) {
        ml_dt_unpack16<DT>(__ldcg((const uint4 *)p->src[q] + v), f);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += f[j];
      }
      const uint4 ov = ml_dt_pack16<DT>(acc);
      ((uint4 *)p->out)[v] = ov;
      for (int r = 0; r < ML_TPC_MAX_RANKS; ++r)
        if (p->push[r]) ((uint4 *)p->push[r])[v] = ov;
    }
    done = nv * 8;
  }
  for (size_t i = done + tid; i < p->count; i += nthreads) {
    float acc = 0.f;
    for (int q = 0; q < p->nsrc; ++q)
      acc += ml_dt_half_to_f32<DT>(__ldcg((const unsigned short *)p->src[q] + i));
    const unsigned short o = (unsigned short)ml_dt_f32_to_half<DT>(acc);
    ((unsigned short *)p->out)[i] = o;
    for (int r = 0; r < ML_TPC_MAX_RANKS; ++r)
      if (p->push[r]) ((unsigned short *)p->push[r])[i] = o;
  }

  if (p->end_kind >= 0) {
    /* Last CTA out signals: each CTA makes its stores visible system-wide
     * before it takes its ticket. */
    __threadfence_system();
    __syncthreads();
    __shared__ unsigned last;
    if (threadIdx.x == 0) last = atomicAdd(s.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last && threadIdx.x == 0) {
      *s.ticket = 0;
      ml_tpc_signal_all(&s, p->end_kind, e);
    }
  }
}

extern "C" moelink_status_t ml_tpc_run_pass(const ml_tpc_sync *s, moelink_dtype_t dt,
                                            const ml_tpc_pass *p, int ctas,
                                            cudaStream_t stream) {
  ml_tpc_pass_args a;
  a.p = *p;
  uintptr_t bits = (uintptr_t)p->out;
  for (int q = 0; q < p->nsrc; ++q) bits |= (uintptr_t)p->src[q];
  for (int r = 0; r < ML_TPC_MAX_RANKS; ++r) bits |= (uintptr_t)p->push[r];
  a.vec = (bits & 15) == 0;
  const size_t units = a.vec ? p->count / 8 + p->count % 8 : p->count;
  size_t want = (units + ML_TPC_THREADS - 1) / ML_TPC_THREADS;
  if (want < 1) want = 1;
  const unsigned grid = (unsigned)(want < (size_t)ctas ? want : (size_t)ctas);
  if (dt == MOELINK_DTYPE_BF16)
    ml_tpc_pass_kernel<MOELINK_DTYPE_BF16><<<grid, ML_TPC_THREADS, 0, stream>>>(*s, a);
  else
    ml_tpc_pass_kernel<MOELINK_DTYPE_F16><<<grid, ML_TPC_THREADS, 0, stream>>>(*s, a);
  ML_CUDA_LAUNCHED("ml_tpc_pass_kernel");
  return MOELINK_SUCCESS;
}

/* ---- the fallback GEMM ---------------------------------------------------------- */

#define ML_TPC_GT 16 /* output tile edge; k staged ML_TPC_GT at a time */

/* One 16 x 16 output tile per block, k in shared-memory steps. Only for
 * shapes the tensor-core engines refuse, where correctness is the point. */
template <int DT>
__global__ void ml_tpc_gemm_simple_kernel(const unsigned short *a, const unsigned short *b,
                                          unsigned short *out, int rows, int n, int k) {
  __shared__ float as[ML_TPC_GT][ML_TPC_GT + 1], bs[ML_TPC_GT][ML_TPC_GT + 1];
  const int tx = (int)threadIdx.x, ty = (int)threadIdx.y;
  const int r = (int)blockIdx.y * ML_TPC_GT + ty, j = (int)blockIdx.x * ML_TPC_GT + tx;
  const int jb = (int)blockIdx.x * ML_TPC_GT + ty; /* the B row this thread stages */
  float acc = 0.f;
  for (int k0 = 0; k0 < k; k0 += ML_TPC_GT) {
    const int kk = k0 + tx;
    as[ty][tx] = r < rows && kk < k ? ml_dt_half_to_f32<DT>(a[(size_t)r * k + kk]) : 0.f;
    bs[ty][tx] = jb < n && kk < k ? ml_dt_half_to_f32<DT>(b[(size_t)jb * k + kk]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int q = 0; q < ML_TPC_GT; ++q) acc += as[ty][q] * bs[tx][q];
    __syncthreads();
  }
  if (r < rows && j < n) out[(size_t)r * n + j] = (unsigned short)ml_dt_f32_to_half<DT>(acc);
}

extern "C" moelink_status_t ml_tpc_gemm_simple(moelink_dtype_t dt, const void *a, const void *b,
                                               void *out, int rows, int n, int k,
                                               cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return MOELINK_SUCCESS;
  const dim3 block(ML_TPC_GT, ML_TPC_GT);
  const dim3 grid((unsigned)((n + ML_TPC_GT - 1) / ML_TPC_GT),
                  (unsigned)((rows + ML_TPC_GT - 1) / ML_TPC_GT));
  if (grid.y > 65535)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "tp: %d rows are too many for the fallback GEMM",
                   rows);
  if (dt == MOELINK_DTYPE_BF16)
    ml_tpc_gemm_simple_kernel<MOELINK_DTYPE_BF16><<<grid, block, 0, stream>>>(
        (const unsigned short *)a, (const unsigned short *)b, (unsigned short *)out, rows, n, k);
  else
    ml_tpc_gemm_simple_kernel<MOELINK_DTYPE_F16><<<grid, block, 0, stream>>>(
        (const unsigned short *)a, (const unsigned short *)b, (unsigned short *)out, rows, n, k);
  ML_CUDA_LAUNCHED("ml_tpc_gemm_simple_kernel");
  return MOELINK_SUCCESS;
}
