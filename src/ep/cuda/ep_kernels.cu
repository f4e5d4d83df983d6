/* Kernels of the CUDA expert-parallel layer (ep_cuda.h; the protocol is in
 * ep_cuda.c). Rows move with 16-byte stores into the peers' symmetric
 * buffers; a signal follows once every CTA's stores are visible. */
#include "ep/cuda/ep_cuda.h"

#include "cuda/cuda.h"

#define ML_EPC_THREADS 256
#define ML_EPC_SCAN 1024

static __device__ __forceinline__ uint64_t *ml_epc_cell(const ml_epc_args *a, int rank,
                                                        size_t off, int slot) {
  return (uint64_t *)(a->base[rank] + off) + slot;
}

static __device__ __forceinline__ int32_t *ml_epc_meta(const ml_epc_args *a, int rank, int row) {
  return (int32_t *)(a->base[rank] + a->off_meta) + (size_t)row * (size_t)(1 + 2 * a->k);
}

/* dst[0, bytes) = src[0, bytes) by the block, 16 bytes a thread (bytes and
 * both ends 16-byte aligned: H is a multiple of 8). Sources may be another
 * GPU's writes: read through L2. */
static __device__ __forceinline__ void ml_epc_copy(char *dst, const char *src, size_t bytes) {
  const uint4 *s = (const uint4 *)src;
  uint4 *d = (uint4 *)dst;
  for (size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = __ldcg(s + i);
}

/* The last CTA of the grid to get here sets flag `off` slot `me` of every
 * rank to value, after all CTAs' stores are visible system-wide. */
static __device__ __forceinline__ void ml_epc_last_signal(const ml_epc_args *a, size_t off,
                                                          uint64_t value) {
  __threadfence_system();
  __syncthreads();
  __shared__ unsigned last;
  if (threadIdx.x == 0) last = atomicAdd(a->ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) *a->ticket = 0;
  __threadfence_system();
  if ((int)threadIdx.x < a->n)
    moelink_signal_set(ml_epc_cell(a, (int)threadIdx.x, off, a->me), value);
}

__global__ void ml_epc_begin_kernel(const __grid_constant__ ml_epc_args a) { *a.epoch += 1; }

/* Block d: a scan over the tokens of "goes to rank d" (one row per token and
 * destination, whatever the number of its experts there), in token order. */
__global__ void __launch_bounds__(ML_EPC_SCAN)
    ml_epc_dest_kernel(const __grid_constant__ ml_epc_args a, const int32_t *ids, int T) {
  const int d = (int)blockIdx.x, tid = (int)threadIdx.x;
  __shared__ int s_warp[ML_EPC_SCAN / 32];
  __shared__ int s_base;
  if (tid == 0) s_base = 0;
  __syncthreads();
  for (int t0 = 0; t0 < T; t0 += ML_EPC_SCAN) {
    const int t = t0 + tid;
    int f = 0;
    if (t < T)
      for (int j = 0; j < a.k; ++j) {
        const int e = ids[(size_t)t * a.k + j];
        f |= e >= 0 && e / a.El == d;
      }
    /* block-wide exclusive scan of f */
    const int lane = tid & 31, warp = tid >> 5;
    int incl = f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int w = s_warp[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += v;
      }
      s_warp[lane] = w;
    }
    __syncthreads();
    const int before = s_base + (warp > 0 ? s_warp[warp - 1] : 0) + incl - f;
    if (t < T) a.pos[(size_t)t * a.n + d] = f ? before : -1;
    __syncthreads();
    if (tid == 0) s_base += s_warp[ML_EPC_SCAN / 32 - 1];
    __syncthreads();
  }
  if (tid == 0) a.count[d] = s_base;
}

/* Work item i = (token, destination); a block copies the row, one thread
 * writes the meta. */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_send_kernel(const __grid_constant__ ml_epc_args a, const char *x, const int32_t *ids,
                       const float *weights, int T) {
  const uint64_t e = *a.epoch;
  const size_t row_bytes = (size_t)a.H * (size_t)a.es;
  for (int i = (int)blockIdx.x; i < T * a.n; i += (int)gridDim.x) {
    const int t = i / a.n, d = i % a.n;
    const int p = a.pos[(size_t)t * a.n + d];
    if (p < 0) continue;
    const int row = a.me * a.max_tokens + p;
    ml_epc_copy(a.base[d] + a.off_rows + (size_t)row * row_bytes, x + (size_t)t * row_bytes,
                row_bytes);
    if (threadIdx.x == 0) {
      int32_t *m = ml_epc_meta(&a, d, row);
      m[0] = t;
      for (int j = 0; j < a.k; ++j) {
        const int ex = ids[(size_t)t * a.k + j];
        m[1 + j] = ex >= 0 && ex / a.El == d ? ex - d * a.El : -1;
        m[1 + a.k + j] = __float_as_int(weights[(size_t)t * a.k + j]);
      }
    }
  }
  /* ARRIVE, by the last CTA once every CTA's rows are visible: the call
   * number in the high half, the row count in the low. */
  __threadfence_system();
  __syncthreads();
  __shared__ unsigned last;
  if (threadIdx.x == 0) last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) *a.ticket = 0;
  __threadfence_system();
  const int d = (int)threadIdx.x;
  if (d < a.n)
    moelink_signal_set(ml_epc_cell(&a, d, a.off_arrive, a.me),
                       (e << 32) | (uint64_t)(uint32_t)a.count[d]);
}

/* Every CTA waits for all sources (thread s waits for s), then each thread
 * prepares received rows: their local expert ids compacted to kl slots in
 * slot order, the weights and the source slots; rows past a source's count
 * get none. */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_receive_kernel(const __grid_constant__ ml_epc_args a) {
  const uint64_t e = *a.epoch;
  __shared__ int s_count[ML_EPC_MAX_RANKS];
  const int s = (int)threadIdx.x;
  int ok = 1;
  if (s < a.n) {
    uint64_t *cell = ml_epc_cell(&a, a.me, a.off_arrive, s);
    ok = moelink_signal_wait(&a.dc, cell, e << 32, s, ML_EPC_PRIM_ARRIVE);
    s_count[s] = ok ? (int)(uint32_t)moelink_signal_load(cell) : 0;
  }
  __syncthreads_and(ok);
  const int cap = a.n * a.max_tokens;
  for (int r = (int)(blockIdx.x * blockDim.x + threadIdx.x); r < cap;
       r += (int)(gridDim.x * blockDim.x)) {
    const int src = r / a.max_tokens, i = r % a.max_tokens;
    int q = 0;
    if (i < s_count[src]) {
      const int32_t *m = ml_epc_meta(&a, a.me, r);
      for (int j = 0; j < a.k && q < a.kl; ++j) {
        const int le = __ldcg(m + 1 + j);
        if (le < 0) continue;
        a.lids[(size_t)r * a.kl + q] = le;
        a.lwts[(size_t)r * a.kl + q] = __int_as_float(__ldcg(m + 1 + a.k + j));
        a.lslot[(size_t)r * a.kl + q] = j;
        ++q;
      }
    }
    for (; q < a.kl; ++q) {
      a.lids[(size_t)r * a.kl + q] = -1;
      a.lwts[(size_t)r * a.kl + q] = 0.f;
      a.lslot[(size_t)r * a.kl + q] = -1;
    }
  }
}

/* Work item p = (received row, local slot): its expert output row goes back
 * to the source's return rows at (token, slot). */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_return_kernel(const __grid_constant__ ml_epc_args a, const char *y,
                         const int32_t *pair_rows) {
  const uint64_t e = *a.epoch;
  const size_t row_bytes = (size_t)a.H * (size_t)a.es;
  const int pairs = a.n * a.max_tokens * a.kl;
  for (int p = (int)blockIdx.x; p < pairs; p += (int)gridDim.x) {
    if (a.lids[p] < 0) continue;
    const int yr = pair_rows[p];
    if (yr < 0) continue;
    const int r = p / a.kl, src = r / a.max_tokens;
    const int t = __ldcg(ml_epc_meta(&a, a.me, r));
    const int j = a.lslot[p];
    ml_epc_copy(a.base[src] + a.off_ret + ((size_t)t * a.k + j) * row_bytes,
                y + (size_t)yr * row_bytes, row_bytes);
  }
  ml_epc_last_signal(&a, a.off_return, e);
}

__global__ void ml_epc_wait_kernel(const __grid_constant__ ml_epc_args a) {
  const uint64_t e = *a.epoch;
  const int d = (int)threadIdx.x;
  if (d < a.n)
    moelink_signal_wait(&a.dc, ml_epc_cell(&a, a.me, a.off_return, d), e, d, ML_EPC_PRIM_RETURN);
}

__global__ void ml_epc_iota_kernel(int32_t *ids, int n) {
  const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) ids[i] = i;
}

/* ---- launchers ------------------------------------------------------------------ */

static unsigned ml_epc_grid(const ml_epc_args *a, long long items) {
  const long long most = 2LL * a->sms;
  return (unsigned)(items < 1 ? 1 : items < most ? items : most);
}

extern "C" moelink_status_t ml_epc_begin(const ml_epc_args *a, cudaStream_t stream) {
  ml_epc_begin_kernel<<<1, 1, 0, stream>>>(*a);
  ML_CUDA_LAUNCHED("ml_epc_begin_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_destinations(const ml_epc_args *a, const int32_t *ids, int T,
                                                cudaStream_t stream) {
  ml_epc_dest_kernel<<<(unsigned)a->n, ML_EPC_SCAN, 0, stream>>>(*a, ids, T);
  ML_CUDA_LAUNCHED("ml_epc_dest_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_send(const ml_epc_args *a, const void *x, const int32_t *ids,
                                        const float *weights, int T, cudaStream_t stream) {
  ml_epc_send_kernel<<<ml_epc_grid(a, (long long)T * a->n), ML_EPC_THREADS, 0, stream>>>(
      *a, (const char *)x, ids, weights, T);
  ML_CUDA_LAUNCHED("ml_epc_send_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_receive(const ml_epc_args *a, cudaStream_t stream) {
  const long long cap = (long long)a->n * a->max_tokens;
  ml_epc_receive_kernel<<<ml_epc_grid(a, (cap + ML_EPC_THREADS - 1) / ML_EPC_THREADS),
                          ML_EPC_THREADS, 0, stream>>>(*a);
  ML_CUDA_LAUNCHED("ml_epc_receive_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_return(const ml_epc_args *a, const void *y,
                                          const int32_t *pair_rows, cudaStream_t stream) {
  const long long pairs = (long long)a->n * a->max_tokens * a->kl;
  ml_epc_return_kernel<<<ml_epc_grid(a, pairs), ML_EPC_THREADS, 0, stream>>>(*a, (const char *)y,
                                                                         pair_rows);
  ML_CUDA_LAUNCHED("ml_epc_return_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_wait_returns(const ml_epc_args *a, cudaStream_t stream) {
  ml_epc_wait_kernel<<<1, 32, 0, stream>>>(*a);
  ML_CUDA_LAUNCHED("ml_epc_wait_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_iota(int32_t *ids, int n, cudaStream_t stream) {
  if (n <= 0) return MOELINK_SUCCESS;
  ml_epc_iota_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(ids, n);
  ML_CUDA_LAUNCHED("ml_epc_iota_kernel");
  return MOELINK_SUCCESS;
}
