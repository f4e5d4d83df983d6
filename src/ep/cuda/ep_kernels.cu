/* Kernels of the CUDA expert-parallel layer (ep_cuda.h; the protocol is in
 * ep_cuda.c). Rows move with 16-byte stores into the peers' symmetric
 * buffers, one warp a row; a signal follows once every CTA's stores are
 * visible. Four launches a forward move data: send and receive (dispatch),
 * return (with the wait for the peers' returns) and the combine. */
#include "ep/cuda/ep_cuda.h"

#include "cuda/cuda.h"

#define ML_EPC_THREADS 256
#define ML_EPC_FULL 0xffffffffu

static __device__ __forceinline__ uint64_t *ml_epc_cell(const ml_epc_args *a, int rank,
                                                        size_t off, int slot) {
  return (uint64_t *)(a->base[rank] + off) + slot;
}

static __device__ __forceinline__ int32_t *ml_epc_meta(const ml_epc_args *a, int rank, int row) {
  return (int32_t *)(a->base[rank] + a->off_meta) + (size_t)row * (size_t)ML_EPC_META(a->k);
}

/* dst[0, bytes) = src[0, bytes) by one warp, 16 bytes a lane (bytes and both
 * ends 16-byte aligned: H is a multiple of 8); src NULL: zeros. Sources may
 * be another GPU's writes: read through L2. A warp moves one row while the
 * other warps of the CTA are between rows (reading where the next row goes):
 * the stores of a CTA keep the link busy through those latencies. Four loads
 * are in flight per lane before the stores. */
static __device__ __forceinline__ void ml_epc_warp_copy(char *dst, const char *src, size_t bytes,
                                                        int lane) {
  const uint4 *s = (const uint4 *)src;
  uint4 *d = (uint4 *)dst;
  const size_t n = bytes / 16;
  for (size_t i = (size_t)lane; i < n; i += 4 * 32) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const size_t q = i + (size_t)u * 32;
      v[u] = s && q < n ? __ldcg(s + q) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const size_t q = i + (size_t)u * 32;
      if (q < n) d[q] = v[u];
    }
  }
}

/* Whether this CTA is the last of the grid to get here (after every CTA's
 * stores are visible system-wide); the last one also resets the ticket. */
static __device__ __forceinline__ int ml_epc_last_cta(const ml_epc_args *a) {
  __threadfence_system();
  __syncthreads();
  __shared__ unsigned last;
  if (threadIdx.x == 0) last = atomicAdd(a->ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return 0;
  if (threadIdx.x == 0) *a->ticket = 0;
  __threadfence_system();
  return 1;
}

/* Work item i = (token t, destination d), one warp each: when one of t's
 * experts lives on d, the row goes to d's row me * max_tokens + t with its
 * meta (token, call, local ids, weights). Call c is epoch + 1 while the
 * kernel runs; the last CTA stores it and signals every destination ARRIVE. */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_send_kernel(const __grid_constant__ ml_epc_args a, const char *x, const int32_t *ids,
                       const float *weights, int T) {
  const uint64_t e = *a.epoch + 1;
  const size_t row_bytes = (size_t)a.H * (size_t)a.es;
  const int lane = (int)threadIdx.x & 31, wpb = (int)blockDim.x >> 5;
  const int gw = (int)blockIdx.x * wpb + ((int)threadIdx.x >> 5), nw = (int)gridDim.x * wpb;
  for (int i = gw; i < T * a.n; i += nw) {
    const int t = i / a.n, d = i % a.n;
    /* Lane j < k looks at slot j (k <= 32: ML_CUDA_MAX_TOPK). */
    const int ex = lane < a.k ? ids[(size_t)t * a.k + lane] : -1;
    const int here = ex >= 0 && ex / a.El == d; /* false for ex >= E: ex / El >= n */
    if (d == 0 && lane < a.k)
      a.slot_rows[(size_t)t * a.k + lane] = ex >= 0 && ex < a.El * a.n ? t * a.k + lane : -1;
    if (!__any_sync(ML_EPC_FULL, here)) continue;
    const int row = a.me * a.max_tokens + t;
    ml_epc_warp_copy(a.base[d] + a.off_rows + (size_t)row * row_bytes, x + (size_t)t * row_bytes,
                     row_bytes, lane);
    int32_t *m = ml_epc_meta(&a, d, row);
    if (lane == 0) {
      m[0] = t;
      m[1] = (int32_t)(uint32_t)e;
    }
    if (lane < a.k) {
      m[2 + lane] = here ? ex - d * a.El : -1;
      m[2 + a.k + lane] = __float_as_int(weights[(size_t)t * a.k + lane]);
    }
  }
  if (!ml_epc_last_cta(&a)) return;
  if (threadIdx.x == 0) *a.epoch = e;
  if ((int)threadIdx.x < a.n)
    moelink_signal_set(ml_epc_cell(&a, (int)threadIdx.x, a.off_arrive, a.me), e);
}

/* Every CTA waits for all sources (thread s waits for s), then each thread
 * prepares received rows: a row holds a token of this call when its meta
 * says so; its local expert ids compacted to kl slots in slot order, the
 * weights and the source slots; other rows get none. */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_receive_kernel(const __grid_constant__ ml_epc_args a) {
  const uint64_t e = *a.epoch;
  const int s = (int)threadIdx.x;
  int ok = 1;
  if (s < a.n)
    ok = moelink_signal_wait(&a.dc, ml_epc_cell(&a, a.me, a.off_arrive, s), e, s,
                             ML_EPC_PRIM_ARRIVE);
  if (!__syncthreads_and(ok)) return;
  const int cap = a.n * a.max_tokens;
  for (int r = (int)(blockIdx.x * blockDim.x + threadIdx.x); r < cap;
       r += (int)(gridDim.x * blockDim.x)) {
    const int32_t *m = ml_epc_meta(&a, a.me, r);
    int q = 0;
    if ((uint32_t)__ldcg(m + 1) == (uint32_t)e) {
      for (int j = 0; j < a.k && q < a.kl; ++j) {
        const int le = __ldcg(m + 2 + j);
        if (le < 0) continue;
        a.lids[(size_t)r * a.kl + q] = le;
        a.lwts[(size_t)r * a.kl + q] = __int_as_float(__ldcg(m + 2 + a.k + j));
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

/* Work item p = (received row, local slot), one warp each: its expert output
 * row goes back to the source's return rows at (token, slot). The last CTA
 * signals every source RETURN, then waits for every rank's RETURN to this
 * one (the stream's next kernel, the combine, may then read them). */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_return_kernel(const __grid_constant__ ml_epc_args a, const char *y,
                         const int32_t *pair_rows) {
  const uint64_t e = *a.epoch;
  const size_t row_bytes = (size_t)a.H * (size_t)a.es;
  const int pairs = a.n * a.max_tokens * a.kl;
  const int lane = (int)threadIdx.x & 31, wpb = (int)blockDim.x >> 5;
  const int gw = (int)blockIdx.x * wpb + ((int)threadIdx.x >> 5), nw = (int)gridDim.x * wpb;
  for (int p = gw; p < pairs; p += nw) {
    if (a.lids[p] < 0) continue;
    const int yr = pair_rows ? pair_rows[p] : p;
    if (yr < 0) continue;
    const int r = p / a.kl, src = r / a.max_tokens;
    const int t = __ldcg(ml_epc_meta(&a, a.me, r));
    const int j = a.lslot[p];
    ml_epc_warp_copy(a.base[src] + a.off_ret + ((size_t)t * a.k + j) * row_bytes,
                     y ? y + (size_t)yr * row_bytes : NULL, row_bytes, lane);
  }
  if (!ml_epc_last_cta(&a)) return;
  const int d = (int)threadIdx.x;
  if (d < a.n) moelink_signal_set(ml_epc_cell(&a, d, a.off_return, a.me), e);
  if (d < a.n)
    (void)moelink_signal_wait(&a.dc, ml_epc_cell(&a, a.me, a.off_return, d), e, d,
                              ML_EPC_PRIM_RETURN);
}

/* ---- launchers ------------------------------------------------------------------ */

/* CTAs for `items` work items of `per` items a CTA: at most two per SM. */
static unsigned ml_epc_grid(const ml_epc_args *a, long long items, int per) {
  const long long most = 2LL * a->sms, want = (items + per - 1) / per;
  return (unsigned)(want < 1 ? 1 : want < most ? want : most);
}

extern "C" moelink_status_t ml_epc_send(const ml_epc_args *a, const void *x, const int32_t *ids,
                                        const float *weights, int T, cudaStream_t stream) {
  if (a->k > 32)
    return ml_fail(MOELINK_ERR_INTERNAL, "ep (cuda): top_k %d > 32 (a lane per slot)", a->k);
  ml_epc_send_kernel<<<ml_epc_grid(a, (long long)T * a->n, ML_EPC_THREADS / 32), ML_EPC_THREADS,
                       0, stream>>>(*a, (const char *)x, ids, weights, T);
  ML_CUDA_LAUNCHED("ml_epc_send_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_receive(const ml_epc_args *a, cudaStream_t stream) {
  const long long cap = (long long)a->n * a->max_tokens;
  ml_epc_receive_kernel<<<ml_epc_grid(a, cap, ML_EPC_THREADS), ML_EPC_THREADS, 0, stream>>>(*a);
  ML_CUDA_LAUNCHED("ml_epc_receive_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_return(const ml_epc_args *a, const void *y,
                                          const int32_t *pair_rows, cudaStream_t stream) {
  const long long pairs = (long long)a->n * a->max_tokens * a->kl;
  ml_epc_return_kernel<<<ml_epc_grid(a, pairs, ML_EPC_THREADS / 32), ML_EPC_THREADS, 0, stream>>>(
      *a, (const char *)y, pair_rows);
  ML_CUDA_LAUNCHED("ml_epc_return_kernel");
  return MOELINK_SUCCESS;
}
