/* Kernels of the CUDA expert-parallel layer (ep_cuda.h; the protocol is in
 * ep_cuda.c). Rows move with 16-byte stores into the peers' symmetric
 * buffers, one warp a row; a signal follows once every CTA's stores are
 * visible. Four launches a forward move data: send and receive (dispatch),
 * return (with the wait for the peers' returns) and the combine. */
#include "ep/cuda/ep_cuda.h"

#include "core/dtype.cuh"
#include "cuda/combine.cuh"
#include "cuda/cuda.h"
#include "cuda/plan.cuh"
#include "cuda/quant.cuh"

#define ML_EPC_THREADS 256
#define ML_EPC_FULL 0xffffffffu

static __device__ __forceinline__ uint64_t *ml_epc_cell(const ml_epc_args *a, int rank,
                                                        size_t off, int slot) {
  return (uint64_t *)(a->base[rank] + off) + slot;
}

static __device__ __forceinline__ int32_t *ml_epc_meta(const ml_epc_args *a, int rank, int row) {
  return (int32_t *)(a->base[rank] + a->off_meta) + (size_t)row * (size_t)ML_EPC_META(a->k);
}

/* Rows move in chunks of ML_EPC_CHUNK 16-byte vectors, one chunk per warp
 * and work item, four per lane: all of a chunk's loads are in flight at once,
 * and a row is ceil(H * es / 2 KiB) items that different warps move side by
 * side, so even a few rows keep many warps (and the link) busy. */
#define ML_EPC_CHUNK 128

/* Work items of a row of `bytes` (a token row: H * es; a payload: H). */
static __host__ __device__ __forceinline__ int ml_epc_chunks_of(size_t bytes) {
  return (int)((bytes / 16 + ML_EPC_CHUNK - 1) / ML_EPC_CHUNK);
}

static __host__ __device__ __forceinline__ int ml_epc_chunks(const ml_epc_args *a) {
  return ml_epc_chunks_of((size_t)a->H * (size_t)a->es);
}

/* Chunk c of a row of `bytes` (16-byte aligned, both ends): dst = src, or
 * zeros for src NULL. Sources may be another GPU's writes: read through L2. */
static __device__ __forceinline__ void ml_epc_warp_chunk(char *dst, const char *src, size_t bytes,
                                                         int c, int lane) {
  const uint4 *s = (const uint4 *)src;
  uint4 *d = (uint4 *)dst;
  const size_t n = bytes / 16, i = (size_t)c * ML_EPC_CHUNK + (size_t)lane;
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

/* The part of a send work item (t, d, chunk c) that is not the row's bytes:
 * whether t goes to d (one of its experts lives there, and in rounds mode
 * one of those pairs is in this round; the warp agrees), slot_rows (once per
 * token, with slots, outside rounds mode: there ml_epc_order_kernel writes
 * it), and chunk 0's meta (source and token, call, local ids, weights).
 * Returns d's row for t, or -1: me * max_tokens + t, or in rounds mode the
 * place in the round of t's first pair in it (pairs have places of their own,
 * so tokens do too). lead >= 0 (an item per pair): -1 unless that first pair
 * is slot lead, so that one item of each token moves it. Lane j < k looks at
 * slot j. */
static __device__ __forceinline__ int ml_epc_item(const ml_epc_args *a, const int32_t *ids,
                                                  const float *weights, int t, int d, int c,
                                                  uint64_t e, int lane, int slots, int lead) {
  const int ex = lane < a->k ? ids[(size_t)t * a->k + lane] : -1;
  int here = ex >= 0 && ex / a->El == d; /* false for ex >= E: ex / El >= n */
  int p = 0;
  if (a->rounds && here) {
    p = a->offs[ex] + a->ord[(size_t)t * a->k + lane];
    here = p / a->cap == a->round;
  }
  if (slots && !a->rounds && lane < a->k)
    a->slot_rows[(size_t)t * a->k + lane] = ex >= 0 && ex < a->El * a->n ? t * a->k + lane : -1;
  const unsigned in = __ballot_sync(ML_EPC_FULL, here);
  const int first = __ffs(in) - 1;
  if (!in || (lead >= 0 && first != lead))
    return -1;
  const int row =
      a->rounds ? __shfl_sync(ML_EPC_FULL, p, first) % a->cap : a->me * a->max_tokens + t;
  if (c == 0) {
    int32_t *m = ml_epc_meta(a, d, row);
    if (lane == 0) {
      m[0] = a->me * a->max_tokens + t;
      m[1] = (int32_t)(uint32_t)e;
    }
    if (lane < a->k) {
      m[2 + lane] = here ? ex - d * a->El : -1;
      m[2 + a->k + lane] = __float_as_int(weights[(size_t)t * a->k + lane]);
      if (a->rounds)
        m[2 + 2 * a->k + lane] = p;
    }
  }
  return row;
}

/* The end of every send kernel: the last CTA stores the call, clears the
 * pair count for the receive kernel and signals every destination ARRIVE
 * (the clear ordered before the own ARRIVE: the one-kernel dispatch's CTAs
 * count pairs as soon as they see it). */
static __device__ __forceinline__ void ml_epc_send_done(const ml_epc_args *a, uint64_t e) {
  if (!ml_epc_last_cta(a)) return;
  if (threadIdx.x == 0) {
    *a->epoch = e;
    *a->npairs = 0;
  }
  __syncthreads();
  if ((int)threadIdx.x < a->n)
    moelink_signal_set(ml_epc_cell(a, (int)threadIdx.x, a->off_arrive, a->me), e);
}

/* Every thread of the CTA returns once each rank s has set this rank's cell
 * s of the `off` array to e or more (thread s waits for s); 0 if a wait gave
 * up. In a one-kernel exchange every CTA waits so, which is safe because
 * the whole grid is resident at once (ml_epc_ll_ok). */
static __device__ __forceinline__ int ml_epc_wait_all(const ml_epc_args *a, size_t off, uint64_t e,
                                                      int prim) {
  const int s = (int)threadIdx.x;
  int ok = 1;
  if (s < a->n)
    ok = moelink_signal_wait(&a->dc, ml_epc_cell(a, a->me, off, s), e, s, prim);
  return __syncthreads_and(ok);
}

/* The receive kernel's work after its wait (below). */
template <int DT, int FMT>
static __device__ __forceinline__ void ml_epc_receive_body(const ml_epc_args &a, uint64_t e);

/* The end of a send kernel: the signals, and in the one-kernel dispatch (LL)
 * the receive kernel's work right after, in every CTA. */
template <int DT, int FMT, int LL>
static __device__ __forceinline__ void ml_epc_send_end(const ml_epc_args &a, uint64_t e) {
  ml_epc_send_done(&a, e);
  if (LL && ml_epc_wait_all(&a, a.off_arrive, e, ML_EPC_PRIM_ARRIVE))
    ml_epc_receive_body<DT, FMT>(a, e);
}

#define ML_EPC_WARPS                                                                       \
  const int lane = (int)threadIdx.x & 31, wpb = (int)blockDim.x >> 5;                      \
  const int gw = (int)blockIdx.x * wpb + ((int)threadIdx.x >> 5), nw = (int)gridDim.x * wpb

/* Rows as they are: work item (token t, destination d, chunk c), one warp
 * each; the row lands in d's rows. Call c is epoch + 1 while the kernel
 * runs. */
template <int LL>
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_send_kernel(const __grid_constant__ ml_epc_args a, const char *x, const int32_t *ids,
                       const float *weights, int T) {
  const uint64_t e = *a.epoch + 1;
  const size_t row_bytes = (size_t)a.H * (size_t)a.es;
  const int nc = ml_epc_chunks(&a);
  ML_EPC_WARPS;
  const long long items = (long long)T * a.n * nc;
  for (long long i = gw; i < items; i += nw) {
    const int c = (int)(i % nc), td = (int)(i / nc);
    const int t = td / a.n, d = td % a.n;
    const int row = ml_epc_item(&a, ids, weights, t, d, c, e, lane, d == 0 && c == 0, -1);
    if (row < 0)
      continue;
    ml_epc_warp_chunk(a.base[d] + a.off_rows + (size_t)row * row_bytes,
                      x + (size_t)t * row_bytes, row_bytes, c, lane);
  }
  ml_epc_send_end<MOELINK_DTYPE_BF16, MOELINK_QUANT_NONE, LL>(a, e);
}

/* Rounds mode, rows as they are: only this round's pairs, from the sorted
 * list (slist[bounds[d][r] .. bounds[d][r + 1]) are this rank's pairs that
 * d receives in round r): work item (pair, chunk c), one warp each, the
 * token's row moved by the item of its first pair in the round on d (the
 * others skip). slot_rows was written by ml_epc_order_kernel. */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_send_list_kernel(const __grid_constant__ ml_epc_args a, const char *x,
                            const int32_t *ids, const float *weights) {
  const uint64_t e = *a.epoch + 1;
  const size_t row_bytes = (size_t)a.H * (size_t)a.es;
  const int nc = ml_epc_chunks(&a);
  __shared__ int first[ML_EPC_MAX_RANKS + 1], pre[ML_EPC_MAX_RANKS + 1];
  if (threadIdx.x == 0) {
    int run = 0;
    for (int d = 0; d < a.n; ++d) {
      const int32_t *b = a.bounds + (size_t)d * (a.maxr + 1) + a.round;
      first[d] = b[0];
      pre[d] = run;
      run += b[1] - b[0];
    }
    pre[a.n] = run;
  }
  __syncthreads();
  ML_EPC_WARPS;
  const long long items = (long long)pre[a.n] * nc;
  for (long long i = gw; i < items; i += nw) {
    const int c = (int)(i % nc), q = (int)(i / nc);
    int d = 0;
    while (q >= pre[d + 1])
      ++d;
    const int pair = a.slist[first[d] + q - pre[d]];
    const int t = pair / a.k, j = pair % a.k;
    const int row = ml_epc_item(&a, ids, weights, t, d, c, e, lane, 0, j);
    if (row < 0)
      continue;
    ml_epc_warp_chunk(a.base[d] + a.off_rows + (size_t)row * row_bytes, x + (size_t)t * row_bytes,
                      row_bytes, c, lane);
  }
  ml_epc_send_end<MOELINK_DTYPE_BF16, MOELINK_QUANT_NONE, 0>(a, e);
}

/* Rows quantized on the way (dispatch_quant FMT): work item (token t, group
 * g of 256 elements), 8 elements a lane, quantized once and stored into the
 * payload row (H e4m3 bytes, then the scales) of every destination that owns
 * one of t's experts. */
template <int DT, int FMT, int LL>
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_send_q_kernel(const __grid_constant__ ml_epc_args a, const char *x, const int32_t *ids,
                         const float *weights, int T) {
  const uint64_t e = *a.epoch + 1;
  const int ng = (a.H + 255) / 256;
  ML_EPC_WARPS;
  const long long items = (long long)T * ng;
  for (long long i = gw; i < items; i += nw) {
    const int g = (int)(i % ng), t = (int)(i / ng);
    const int col = g * 256 + lane * 8, live = col < a.H;
    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (live) ml_q_load8<DT>(x + ((size_t)t * a.H + col) * 2, f);
    /* The block's scale goes to a local first (every destination gets it). */
    float sc_f[256 / ML_MX_BLOCK];
    const uint2 b = ml_q_quantize8<FMT>(f, col - g * 256, live, sc_f, lane);
    for (int d = 0; d < a.n; ++d) {
      const int row = ml_epc_item(&a, ids, weights, t, d, g, e, lane, d == 0 && g == 0, -1);
      if (row < 0)
        continue;
      char *prow = a.base[d] + a.off_qrows + (size_t)row * a.qrow;
      if (live) *(uint2 *)(prow + col) = b;
      const int lanes = FMT == MOELINK_QUANT_FP8 ? ML_FP8_BLOCK / 8 : ML_MX_BLOCK / 8;
      if (live && (lane & (lanes - 1)) == 0) {
        const int blk = (col - g * 256) / (lanes * 8);
        if (FMT == MOELINK_QUANT_FP8)
          ((float *)(prow + a.H))[col / ML_FP8_BLOCK] = sc_f[blk];
        else
          ((uint8_t *)(prow + a.H))[col / ML_MX_BLOCK] = ((const uint8_t *)sc_f)[blk];
      }
    }
  }
  ml_epc_send_end<DT, FMT, LL>(a, e);
}

/* Rows quantized by the caller (xq [T][H] bytes, xs [T][sbytes] scales):
 * work item (t, d, chunk c of the H bytes) copies them into d's payload row;
 * chunk 0's warp also copies the scales, a byte a lane. */
template <int DT, int FMT, int LL>
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_send_pre_kernel(const __grid_constant__ ml_epc_args a, const uint8_t *xq,
                           const uint8_t *xs, const int32_t *ids, const float *weights, int T) {
  const uint64_t e = *a.epoch + 1;
  const int nc = ml_epc_chunks_of((size_t)a.H);
  ML_EPC_WARPS;
  const long long items = (long long)T * a.n * nc;
  for (long long i = gw; i < items; i += nw) {
    const int c = (int)(i % nc), td = (int)(i / nc);
    const int t = td / a.n, d = td % a.n;
    const int row = ml_epc_item(&a, ids, weights, t, d, c, e, lane, d == 0 && c == 0, -1);
    if (row < 0)
      continue;
    char *prow = a.base[d] + a.off_qrows + (size_t)row * a.qrow;
    ml_epc_warp_chunk(prow, (const char *)xq + (size_t)t * a.H, (size_t)a.H, c, lane);
    if (c == 0)
      for (int b = lane; b < a.sbytes; b += 32) prow[a.H + b] = (char)xs[(size_t)t * a.sbytes + b];
  }
  ml_epc_send_end<DT, FMT, LL>(a, e);
}

/* Every CTA waits for all sources (thread s waits for s), then each thread
 * prepares received rows: a row holds a token of this call when its meta
 * says so; its local expert ids compacted to kl slots in slot order and
 * their weights; other rows get none. Each valid (row, slot)
 * also goes into the return list (in no particular order: every entry has a
 * return row of its own). */
template <int DT, int FMT>
static __device__ __forceinline__ void ml_epc_receive_body(const ml_epc_args &a, uint64_t e) {
  const int cap = a.cap;
  for (int r = (int)(blockIdx.x * blockDim.x + threadIdx.x); r < cap;
       r += (int)(gridDim.x * blockDim.x)) {
    const int32_t *m = ml_epc_meta(&a, a.me, r);
    int q = 0;
    if ((uint32_t)__ldcg(m + 1) == (uint32_t)e) {
      const int st = __ldcg(m), t = st % a.max_tokens, src = st / a.max_tokens;
      const size_t row_bytes = (size_t)a.H * (size_t)a.es;
      int slots[ML_EPC_MAX_KL];
      for (int j = 0; j < a.k && q < a.kl; ++j) {
        const int le = __ldcg(m + 2 + j);
        if (le < 0) continue;
        a.lids[(size_t)r * a.kl + q] = le;
        a.lwts[(size_t)r * a.kl + q] = __int_as_float(__ldcg(m + 2 + a.k + j));
        if (a.direct_plan) {
          /* the pair's place in the round is its place in the plan's order */
          const int sp = __ldcg(m + 2 + 2 * a.k + j) - a.round * a.cap;
          a.plan.sorted_pairs[sp] = r * a.kl + q;
          a.plan.pair_rows[(size_t)r * a.kl + q] = sp;
        }
        slots[q] = j;
        ++q;
      }
      const int at = q ? atomicAdd(a.npairs, q) : 0;
      for (int u = 0; u < q; ++u) {
        const int ret = t * a.k + slots[u];
        a.plist[at + u] = make_int4(r * a.kl + u, src, ret, 0);
        if (a.fused)
          a.dst[(size_t)r * a.kl + u] = a.base[src] + a.off_ret + (size_t)ret * row_bytes;
      }
    }
    for (; q < a.kl; ++q) {
      a.lids[(size_t)r * a.kl + q] = -1;
      a.lwts[(size_t)r * a.kl + q] = 0.f;
      if (a.direct_plan)
        a.plan.pair_rows[(size_t)r * a.kl + q] = -1;
    }
  }
  if (FMT == MOELINK_QUANT_NONE) return;
  /* Quantized rows: the received payloads back to rows of the layer's dtype
   * for the experts; a warp per row (its call checked once), 8 elements a
   * lane, four groups of 256 elements in flight. */
  ML_EPC_WARPS;
  for (int r = gw; r < cap; r += nw) {
    if ((uint32_t)__ldcg(ml_epc_meta(&a, a.me, r) + 1) != (uint32_t)e) continue;
    const char *prow = a.base[a.me] + a.off_qrows + (size_t)r * a.qrow;
    char *out = a.base[a.me] + a.off_rows + (size_t)r * a.H * 2;
    for (int c0 = lane * 8; c0 < a.H; c0 += 4 * 256) {
      uint2 q[4];
      float sc[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int col = c0 + u * 256;
        q[u] = col < a.H ? __ldcg((const uint2 *)(prow + col)) : make_uint2(0u, 0u);
        sc[u] = col < a.H ? ml_q_scale_at<FMT>(prow + a.H, col) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int col = c0 + u * 256;
        if (col >= a.H) continue;
        float f[8];
        ml_q_unpack8(q[u], sc[u], f);
        ml_q_store8<DT>(out + (size_t)col * 2, f);
      }
    }
  }
}

template <int DT, int FMT>
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_receive_kernel(const __grid_constant__ ml_epc_args a) {
  const uint64_t e = *a.epoch;
  if (!ml_epc_wait_all(&a, a.off_arrive, e, ML_EPC_PRIM_ARRIVE))
    return;
  ml_epc_receive_body<DT, FMT>(a, e);
}

/* Work item i = (entry of the return list, chunk c), one warp each: chunk c
 * of the expert output of a received (row, slot) goes back to the source's
 * return row (token, slot). The last CTA signals every source RETURN, then
 * waits for every rank's RETURN to this one (the stream's next kernel, the
 * combine, may then read them). pushed: the rows are there already (stored by
 * an earlier kernel of the stream; the release of the signal orders them). */
template <int DT, int LL>
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_return_kernel(const __grid_constant__ ml_epc_args a, const char *y,
                         const int32_t *pair_rows, int pushed, void *out, int T) {
  const uint64_t e = *a.epoch;
  const size_t row_bytes = (size_t)a.H * (size_t)a.es;
  const int nc = ml_epc_chunks(&a);
  const int lane = (int)threadIdx.x & 31, wpb = (int)blockDim.x >> 5;
  const int gw = (int)blockIdx.x * wpb + ((int)threadIdx.x >> 5), nw = (int)gridDim.x * wpb;
  const long long items = pushed ? 0 : (long long)*a.npairs * nc;
  for (long long i = gw; i < items; i += nw) {
    const int c = (int)(i % nc);
    const int4 en = a.plist[i / nc];
    const int yr = pair_rows ? pair_rows[en.x] : en.x;
    if (yr < 0) continue;
    ml_epc_warp_chunk(a.base[en.y] + a.off_ret + (size_t)en.z * row_bytes,
                      y ? y + (size_t)yr * row_bytes : NULL, row_bytes, c, lane);
  }
  const int d = (int)threadIdx.x;
  if (ml_epc_last_cta(&a)) {
    if (d < a.n)
      moelink_signal_set(ml_epc_cell(&a, d, a.off_return, a.me), e);
    if (!LL && d < a.n)
      (void)moelink_signal_wait(&a.dc, ml_epc_cell(&a, a.me, a.off_return, d), e, d,
                                ML_EPC_PRIM_RETURN);
  }
  if (!LL || !ml_epc_wait_all(&a, a.off_return, e, ML_EPC_PRIM_RETURN))
    return;
  /* the one-kernel combine (LL): out[t] = sum of t's return rows in slot
   * order, fp32, one rounding (ml_cuda_combine without a shared expert, the
   * same bits); work item (token, 8 columns), a thread each */
  const int chunks = a.H / 8;
  const uint4 *ret = (const uint4 *)(a.base[a.me] + a.off_ret);
  const long long citems = (long long)T * chunks;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < citems;
       i += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(i / chunks), q = (int)(i % chunks);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    ml_combine_slots<DT, 1>(ret, a.slot_rows + (size_t)t * a.k, a.k, (size_t)chunks, q, acc);
    ((uint4 *)out)[(size_t)t * chunks + q] = ml_dt_pack16<DT>(acc);
  }
}

/* Rounds mode: CTA x counts the pairs of this rank's T tokens routed to
 * expert x and gives each its place among them in pair order (ord), eight
 * pairs a thread, a block-wide scan per pass; then stores the count into
 * every rank's cnt of the step's parity. The last CTA signals every rank's
 * csig. */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_count_kernel(const __grid_constant__ ml_epc_args a, const int32_t *ids, int T) {
  const uint64_t se = *a.sepoch + 1;
  const int ex = (int)blockIdx.x, P = T * a.k, tid = (int)threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  __shared__ int wsum[ML_EPC_THREADS / 32];
  int base = 0;
  for (int i0 = 0; i0 < P; i0 += ML_EPC_THREADS * 8) {
    const int first = i0 + tid * 8;
    unsigned hit = 0;
    for (int u = 0; u < 8; ++u)
      if (first + u < P && __ldg(ids + first + u) == ex)
        hit |= 1u << u;
    const int mine = __popc(hit);
    int incl = mine; /* inclusive scan over the warp */
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(ML_EPC_FULL, incl, o);
      if (lane >= o)
        incl += v;
    }
    if (lane == 31)
      wsum[warp] = incl;
    __syncthreads();
    int before = base, total = 0;
    for (int w = 0; w < ML_EPC_THREADS / 32; ++w) {
      if (w < warp)
        before += wsum[w];
      total += wsum[w];
    }
    before += incl - mine;
    for (int u = 0; u < 8; ++u)
      if (hit >> u & 1u)
        a.ord[first + u] = before++;
    base += total;
    __syncthreads(); /* wsum is rewritten by the next pass */
  }
  if (tid < a.n)
    ((int32_t *)(a.base[tid] + a.off_cnt))[((size_t)(se & 1) * a.n + a.me) * a.E + ex] = base;
  if (!ml_epc_last_cta(&a))
    return;
  if (tid < a.n)
    moelink_signal_set(ml_epc_cell(&a, tid, a.off_csig, a.me), se);
}

/* Rounds mode, one CTA: waits for every rank's counts of the step, then
 * lays each rank d's received pairs out in the order (d's local expert,
 * source rank, place): offs[e] is where this rank's pairs of e start, and
 * the step takes max over d of ceil(d's pairs / cap) rounds. */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_schedule_kernel(const __grid_constant__ ml_epc_args a) {
  extern __shared__ int32_t ml_epc_tot[]; /* [E] */
  const uint64_t se = *a.sepoch + 1;
  if (!ml_epc_wait_all(&a, a.off_csig, se, ML_EPC_PRIM_COUNTS)) {
    if (threadIdx.x == 0)
      *a.nrounds = -1; /* a peer never came: no rounds */
    return;
  }
  const int32_t *cnt = (const int32_t *)(a.base[a.me] + a.off_cnt) + (size_t)(se & 1) * a.n * a.E;
  for (int e = (int)threadIdx.x; e < a.E; e += (int)blockDim.x) {
    int tot = 0, before = 0;
    for (int s = 0; s < a.n; ++s) {
      const int c = __ldcg(cnt + (size_t)s * a.E + e);
      tot += c;
      if (s < a.me)
        before += c;
    }
    ml_epc_tot[e] = tot;
    a.offs[e] = before;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int mine = 0; /* where this rank's pairs of each expert start in slist */
    for (int ex = 0; ex < a.E; ++ex) {
      a.mstart[ex] = mine;
      mine += __ldcg(cnt + (size_t)a.me * a.E + ex);
    }
    a.mstart[a.E] = mine;
    int most = 0;
    for (int d = 0; d < a.n; ++d) {
      int run = 0;
      for (int le = 0; le < a.El; ++le) {
        const int e = d * a.El + le, c = ml_epc_tot[e];
        ml_epc_tot[e] = run;
        if (d == a.me)
          a.lbase[le] = run;
        run += c;
      }
      if (d == a.me)
        a.lbase[a.El] = run;
      const int r = (run + a.cap - 1) / a.cap;
      if (r > most)
        most = r;
    }
    *a.nrounds = most;
    *a.sepoch = se;
  }
  __syncthreads();
  for (int e = (int)threadIdx.x; e < a.E; e += (int)blockDim.x)
    a.offs[e] += ml_epc_tot[e];
}

/* Rounds mode, after the schedule, a thread per pair slot i = t*k + j of
 * this rank's T tokens: slot_rows; the pair's place in slist (this rank's
 * pairs by expert, then place); and for sorted place s, the bounds of the
 * rounds: bounds[d][r] = the first place of d's range whose pair moves in
 * round r or later (bounds[d][rounds] = the range's end). */
__global__ void __launch_bounds__(ML_EPC_THREADS)
    ml_epc_order_kernel(const __grid_constant__ ml_epc_args a, const int32_t *ids, int T) {
  const int P = T * a.k, nr = *a.nrounds > 0 ? *a.nrounds : 1;
  if (*a.nrounds < 0)
    return; /* a peer never came: no rounds */
  const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < P) {
    const int ex = ids[i];
    const int ok = ex >= 0 && ex < a.E;
    a.slot_rows[i] = ok ? i : -1;
    if (ok)
      a.slist[a.mstart[ex] + a.ord[i]] = i;
  }
  /* sorted place s = i: its expert by binary search over mstart */
  const int total = a.mstart[a.E];
  if (i < a.n && a.mstart[i * a.El] == a.mstart[(i + 1) * a.El])
    for (int r = 0; r <= nr; ++r)
      a.bounds[(size_t)i * (a.maxr + 1) + r] = a.mstart[i * a.El];
  if (i >= total)
    return;
  int lo = 0, hi = a.E - 1; /* the last ex with mstart[ex] <= i */
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.mstart[mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int ex = lo, d = ex / a.El;
  const int L = a.mstart[d * a.El], H = a.mstart[(d + 1) * a.El];
  const int round = (a.offs[ex] + i - a.mstart[ex]) / a.cap;
  int prev = -1;
  if (i > L) {
    int e2 = ex;
    while (a.mstart[e2] > i - 1)
      --e2;
    prev = (a.offs[e2] + i - 1 - a.mstart[e2]) / a.cap;
  }
  int32_t *b = a.bounds + (size_t)d * (a.maxr + 1);
  for (int r = prev + 1; r <= round; ++r)
    b[r] = i;
  if (i == H - 1)
    for (int r = round + 1; r <= nr; ++r)
      b[r] = H;
}

/* Rounds mode, one block: round r's pairs are places [r * cap, (r + 1) * cap)
 * of this rank's pair order, which runs by local expert, so local expert
 * le's pairs of the round are plan rows [lbase[le] - r * cap, lbase[le + 1] -
 * r * cap) clipped to [0, cap): the plan's offsets and tiles. */
__global__ void __launch_bounds__(ML_P_THREADS)
    ml_epc_round_plan_kernel(const __grid_constant__ ml_epc_args a) {
  __shared__ int scratch[ML_PLAN_SCRATCH_INTS];
  const int tid = (int)threadIdx.x, first = a.round * a.cap;
  int begin = 0, end = 0;
  if (tid < a.El) {
    begin = min(max(a.lbase[tid] - first, 0), a.cap);
    end = min(max(a.lbase[tid + 1] - first, 0), a.cap);
  }
  ml_plan_schedule(a.El, begin, end, a.plan, ml_plan_scratch_at(scratch));
}

/* ---- launchers ------------------------------------------------------------------ */

/* CTAs for `items` work items of `per` items a CTA: at most two per SM (the
 * copies: enough bytes in flight), or `per_sm` for the kernels that also
 * compute on the rows (more warps hide their latencies). */
static unsigned ml_epc_grid_n(const ml_epc_args *a, long long items, int per, int per_sm) {
  const long long most = (long long)per_sm * a->sms, want = (items + per - 1) / per;
  return (unsigned)(want < 1 ? 1 : want < most ? want : most);
}

static unsigned ml_epc_grid(const ml_epc_args *a, long long items, int per) {
  return ml_epc_grid_n(a, items, per, 2);
}

/* One send kernel's launch, LL or not. */
template <int LL>
static moelink_status_t ml_epc_send_launch(const ml_epc_args *a, const void *x, const uint8_t *xq,
                                           const void *xs, const int32_t *ids, const float *weights,
                                           int T, cudaStream_t stream) {
  const int bf = a->dtype == MOELINK_DTYPE_BF16;
  const int fp8 = a->quant == MOELINK_QUANT_FP8;
  if (a->quant == MOELINK_QUANT_NONE && a->rounds) {
    /* at most cap pairs to each destination in a round */
    const long long nc = ml_epc_chunks(a);
    ml_epc_send_list_kernel<<<ml_epc_grid(a, (long long)a->n * a->cap * nc, ML_EPC_THREADS / 32),
                              ML_EPC_THREADS, 0, stream>>>(*a, (const char *)x, ids, weights);
  } else if (a->quant == MOELINK_QUANT_NONE) {
    const long long nc = ml_epc_chunks(a);
    ml_epc_send_kernel<LL><<<ml_epc_grid(a, (long long)T * a->n * nc, ML_EPC_THREADS / 32),
                             ML_EPC_THREADS, 0, stream>>>(*a, (const char *)x, ids, weights, T);
  } else if (xq) {
    const long long nc = ml_epc_chunks_of((size_t)a->H);
    const unsigned grid = ml_epc_grid(a, (long long)T * a->n * nc, ML_EPC_THREADS / 32);
    const uint8_t *s = (const uint8_t *)xs;
    if (fp8 && bf)
      ml_epc_send_pre_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_FP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xq, s, ids, weights, T);
    else if (fp8)
      ml_epc_send_pre_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_FP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xq, s, ids, weights, T);
    else if (bf)
      ml_epc_send_pre_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_MXFP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xq, s, ids, weights, T);
    else
      ml_epc_send_pre_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_MXFP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xq, s, ids, weights, T);
  } else {
    const unsigned grid =
        ml_epc_grid_n(a, (long long)T * ((a->H + 255) / 256), ML_EPC_THREADS / 32, LL ? 2 : 8);
    const char *xc = (const char *)x;
    if (fp8 && bf)
      ml_epc_send_q_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_FP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xc, ids, weights, T);
    else if (fp8)
      ml_epc_send_q_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_FP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xc, ids, weights, T);
    else if (bf)
      ml_epc_send_q_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_MXFP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xc, ids, weights, T);
    else
      ml_epc_send_q_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_MXFP8, LL>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, xc, ids, weights, T);
  }
  ML_CUDA_LAUNCHED(LL ? "ml_epc_send_kernel (one-kernel dispatch)" : "ml_epc_send_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_send(const ml_epc_args *a, const void *x, const uint8_t *xq,
                                        const void *xs, const int32_t *ids, const float *weights,
                                        int T, int ll, cudaStream_t stream) {
  if (a->k > 32)
    return ml_fail(MOELINK_ERR_INTERNAL, "ep (cuda): top_k %d > 32 (a lane per slot)", a->k);
  if (a->kl > ML_EPC_MAX_KL)
    return ml_fail(MOELINK_ERR_INTERNAL, "ep (cuda): local top_k %d > %d", a->kl, ML_EPC_MAX_KL);
  return ll ? ml_epc_send_launch<1>(a, x, xq, xs, ids, weights, T, stream)
            : ml_epc_send_launch<0>(a, x, xq, xs, ids, weights, T, stream);
}

extern "C" moelink_status_t ml_epc_receive(const ml_epc_args *a, cudaStream_t stream) {
  const long long cap = a->cap;
  const int bf = a->dtype == MOELINK_DTYPE_BF16;
  if (a->quant == MOELINK_QUANT_NONE) {
    ml_epc_receive_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_NONE>
        <<<ml_epc_grid(a, cap, ML_EPC_THREADS), ML_EPC_THREADS, 0, stream>>>(*a);
  } else {
    const unsigned grid = ml_epc_grid_n(a, cap, ML_EPC_THREADS / 32, 8);
    if (a->quant == MOELINK_QUANT_FP8 && bf)
      ml_epc_receive_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_FP8>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a);
    else if (a->quant == MOELINK_QUANT_FP8)
      ml_epc_receive_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_FP8>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a);
    else if (bf)
      ml_epc_receive_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_MXFP8>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a);
    else
      ml_epc_receive_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_MXFP8>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a);
  }
  ML_CUDA_LAUNCHED("ml_epc_receive_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_return(const ml_epc_args *a, const void *y,
                                          const int32_t *pair_rows, int pushed, void *out, int T,
                                          cudaStream_t stream) {
  const long long nc = ml_epc_chunks(a);
  const long long pairs = pushed ? 0 : (long long)a->cap * a->kl;
  unsigned grid = ml_epc_grid(a, pairs * nc, ML_EPC_THREADS / 32);
  const char *yc = (const char *)y;
  if (out != NULL) {
    /* the one-kernel combine: also enough CTAs for its T * H / 8 items */
    const unsigned g2 = ml_epc_grid(a, (long long)T * (a->H / 8), ML_EPC_THREADS);
    if (g2 > grid)
      grid = g2;
    if (a->dtype == MOELINK_DTYPE_BF16)
      ml_epc_return_kernel<MOELINK_DTYPE_BF16, 1>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, yc, pair_rows, pushed, out, T);
    else
      ml_epc_return_kernel<MOELINK_DTYPE_F16, 1>
          <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, yc, pair_rows, pushed, out, T);
  } else {
    ml_epc_return_kernel<MOELINK_DTYPE_BF16, 0>
        <<<grid, ML_EPC_THREADS, 0, stream>>>(*a, yc, pair_rows, pushed, NULL, 0);
  }
  ML_CUDA_LAUNCHED(out != NULL ? "ml_epc_return_kernel (one-kernel combine)"
                               : "ml_epc_return_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_round_plan(const ml_epc_args *a, cudaStream_t stream) {
  if (a->El > ML_P_THREADS)
    return ml_fail(MOELINK_ERR_INTERNAL, "ep (cuda): %d local experts > %d", a->El, ML_P_THREADS);
  ml_epc_round_plan_kernel<<<1, ML_P_THREADS, 0, stream>>>(*a);
  ML_CUDA_LAUNCHED("ml_epc_round_plan_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_count(const ml_epc_args *a, const int32_t *ids, int T,
                                         cudaStream_t stream) {
  ml_epc_count_kernel<<<(unsigned)a->E, ML_EPC_THREADS, 0, stream>>>(*a, ids, T);
  ML_CUDA_LAUNCHED("ml_epc_count_kernel");
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_epc_schedule(const ml_epc_args *a, const int32_t *ids, int T,
                                            cudaStream_t stream) {
  ml_epc_schedule_kernel<<<1, ML_EPC_THREADS, (size_t)a->E * 4, stream>>>(*a);
  ML_CUDA_LAUNCHED("ml_epc_schedule_kernel");
  const long long threads = (long long)T * a->k > a->n ? (long long)T * a->k : a->n;
  ml_epc_order_kernel<<<(unsigned)((threads + ML_EPC_THREADS - 1) / ML_EPC_THREADS), ML_EPC_THREADS,
                        0, stream>>>(*a, ids, T);
  ML_CUDA_LAUNCHED("ml_epc_order_kernel");
  return MOELINK_SUCCESS;
}

/* See ep_cuda.h: every one-kernel exchange's grid (at most two CTAs an SM)
 * must be resident at once, since its CTAs wait for each other. */
extern "C" moelink_status_t ml_epc_ll_ok(int *ok) {
  const void *kernels[] = {
      (const void *)ml_epc_send_kernel<1>,
      (const void *)ml_epc_send_q_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_FP8, 1>,
      (const void *)ml_epc_send_q_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_FP8, 1>,
      (const void *)ml_epc_send_q_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_MXFP8, 1>,
      (const void *)ml_epc_send_q_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_MXFP8, 1>,
      (const void *)ml_epc_send_pre_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_FP8, 1>,
      (const void *)ml_epc_send_pre_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_FP8, 1>,
      (const void *)ml_epc_send_pre_kernel<MOELINK_DTYPE_BF16, MOELINK_QUANT_MXFP8, 1>,
      (const void *)ml_epc_send_pre_kernel<MOELINK_DTYPE_F16, MOELINK_QUANT_MXFP8, 1>,
      (const void *)ml_epc_return_kernel<MOELINK_DTYPE_BF16, 1>,
      (const void *)ml_epc_return_kernel<MOELINK_DTYPE_F16, 1>};
  *ok = 1;
  for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; ++i) {
    int per_sm = 0;
    const cudaError_t e =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernels[i], ML_EPC_THREADS, 0);
    if (e != cudaSuccess)
      return ml_fail(MOELINK_ERR_CUDA, "ep (cuda): occupancy of the one-kernel exchanges: %s",
                     cudaGetErrorString(e));
    if (per_sm < 2)
      *ok = 0;
  }
  return MOELINK_SUCCESS;
}
