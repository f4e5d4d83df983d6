/* Collectives of the CUDA communicator: SM kernels that push data into the
 * peers' symmetric staging with plain stores, then signal (moelink_device.cuh
 * primitives). Nothing is pulled from a peer.
 *
 * Protocol. Every CTA index b runs a sequence of rounds with its counterparts
 * of the same index on the other ranks; round e (an epoch, counted per CTA
 * index in device memory across calls, so graph replays continue it) is:
 *   push   store this rank's data for peer p into p's slot [e & 1][b][rank]
 *   signal __syncthreads, then thread p sets p's signal word [b][rank] = e
 *          (release) and waits for this rank's word [b][p] >= e (acquire)
 *   use    read this rank's slots [e & 1][b][*] (reduce or copy out)
 * Every round is a full exchange: a CTA signals and waits on every peer.
 * That is what makes two staging halves enough: when rank r pushes round e
 * into p's half e & 1, it has seen p's signal of round e - 1, which p sends
 * only after it finished using round e - 2, the last one in that half.
 * Signal words have one writer each and only grow, so nothing is ever reset.
 *
 * Reductions add the ranks' values in rank order 0..n-1 in fp32 and round
 * once to the dtype: every rank computes bitwise the same result, run after
 * run. All-reduce is one-shot (every rank gets every other rank's block and
 * reduces it itself: one round per block) up to ml_ccu_coll.oneshot_max
 * bytes, two-shot above (reduce-scatter round: rank p reduces piece p and
 * pushes the result to every peer; all-gather round: copy the pieces out). */
#include "comm/cuda/comm_cuda.h"
#include "comm/cuda/stage.cuh"
#include "core/dtype.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define ML_CC_NT ML_CCU_THREADS
#define ML_CC_UNROLL 4
/* Vectors per thread per pass of a reduction (fp32 accumulators: 8 each). */
#define ML_CC_RUNROLL 2

enum { ML_CC_AR1 = 0, ML_CC_AR2 = 1, ML_CC_AG = 2, ML_CC_RS = 3 };

typedef struct ml_cc_args {
  const char *send;
  char *recv;
  size_t count;      /* all-reduce: elements; all-gather, reduce-scatter: per rank */
  size_t chunk;      /* elements per slot per round (a multiple of 8) */
  size_t slot_bytes; /* bytes between the slots of two sources */
  size_t par_stride; /* bytes between the two staging halves */
  char *stage[ML_CCU_MAX_RANKS];
  uint64_t *sig[ML_CCU_MAX_RANKS];
  uint64_t *epoch;
  moelink_device_comm_t dc;
} ml_cc_args;

/* ---- element access -------------------------------------------------------- */

/* Staging was written by other GPUs: read it from L2 (ld.cg), never from a
 * possibly stale L1 line of an earlier round. */
template <bool STAGE>
static __device__ __forceinline__ uint4 ml_cc_ld16(const uint4 *p) {
  return STAGE ? __ldcg(p) : *p;
}

template <bool STAGE>
static __device__ __forceinline__ uint32_t ml_cc_ld4(const uint32_t *p) {
  return STAGE ? __ldcg((const unsigned int *)p) : *p;
}

template <bool STAGE>
static __device__ __forceinline__ uint16_t ml_cc_ld2(const uint16_t *p) {
  return STAGE ? __ldcg((const unsigned short *)p) : *p;
}

/* One element of dtype DT at p[i] as fp32. */
template <int DT, bool STAGE>
static __device__ __forceinline__ float ml_cc_ld1(const char *p, size_t i) {
  if (DT == MOELINK_DTYPE_F32) return __uint_as_float(ml_cc_ld4<STAGE>((const uint32_t *)p + i));
  return ml_dt_half_to_f32<DT>(ml_cc_ld2<STAGE>((const uint16_t *)p + i));
}

template <int DT>
static __device__ __forceinline__ void ml_cc_st1(char *p, size_t i, float v) {
  if (DT == MOELINK_DTYPE_F32)
    ((uint32_t *)p)[i] = __float_as_uint(v);
  else
    ((uint16_t *)p)[i] = (uint16_t)ml_dt_f32_to_half<DT>(v);
}

/* ---- block-wide moves ------------------------------------------------------ */

/* dst[0, bytes) = src[0, bytes) by the whole block: 16-byte vectors when both
 * ends allow it, elements of ES bytes otherwise (and for the tail). */
template <int ES, bool STAGE>
static __device__ __forceinline__ void ml_cc_copy(char *dst, const char *src, size_t bytes) {
  size_t done = 0;
  if ((((uintptr_t)dst | (uintptr_t)src) & 15) == 0) {
    const size_t nv = bytes >> 4;
    const uint4 *s = (const uint4 *)src;
    uint4 *d = (uint4 *)dst;
    size_t i = threadIdx.x;
    for (; i + (ML_CC_UNROLL - 1) * ML_CC_NT < nv; i += ML_CC_UNROLL * ML_CC_NT) {
      uint4 v[ML_CC_UNROLL];
#pragma unroll
      for (int u = 0; u < ML_CC_UNROLL; ++u) v[u] = ml_cc_ld16<STAGE>(s + i + u * ML_CC_NT);
#pragma unroll
      for (int u = 0; u < ML_CC_UNROLL; ++u) d[i + u * ML_CC_NT] = v[u];
    }
    for (; i < nv; i += ML_CC_NT) d[i] = ml_cc_ld16<STAGE>(s + i);
    done = nv << 4;
  }
  const size_t rest = (bytes - done) / ES;
  if (ES == 4) {
    const uint32_t *s = (const uint32_t *)(src + done);
    uint32_t *d = (uint32_t *)(dst + done);
    for (size_t j = threadIdx.x; j < rest; j += ML_CC_NT) d[j] = ml_cc_ld4<STAGE>(s + j);
  } else {
    const uint16_t *s = (const uint16_t *)(src + done);
    uint16_t *d = (uint16_t *)(dst + done);
    for (size_t j = threadIdx.x; j < rest; j += ML_CC_NT) d[j] = ml_cc_ld2<STAGE>(s + j);
  }
}

/* out[i] = sum over s = 0..n-1, in that order, of (s == r ? own[i] : slot s
 * of this rank's staging [i]) for i < len, accumulated in fp32. With fwd,
 * the result also goes to offset fwd_off of every peer's staging. */
template <int DT>
static __device__ __forceinline__ void ml_cc_reduce(char *out, const char *own, const char *slot0,
                                                    size_t slot_bytes, int n, int r, size_t len,
                                                    char *const *stage, size_t fwd_off,
                                                    bool fwd) {
  const int EV = DT == MOELINK_DTYPE_F32 ? 4 : 8;
  size_t nv = 0;
  if ((((uintptr_t)out | (uintptr_t)own) & 15) == 0) {
    nv = len / EV;
    for (size_t i0 = threadIdx.x; i0 < nv; i0 += ML_CC_RUNROLL * ML_CC_NT) {
      float acc[ML_CC_RUNROLL][8];
      for (int s = 0; s < n; ++s) {
        const uint4 *src = s == r ? (const uint4 *)own : (const uint4 *)(slot0 + s * slot_bytes);
        uint4 v[ML_CC_RUNROLL];
#pragma unroll
        for (int u = 0; u < ML_CC_RUNROLL; ++u) {
          const size_t i = i0 + (size_t)u * ML_CC_NT;
          v[u] = make_uint4(0, 0, 0, 0);
          if (i < nv) v[u] = s == r ? ml_cc_ld16<false>(src + i) : ml_cc_ld16<true>(src + i);
        }
#pragma unroll
        for (int u = 0; u < ML_CC_RUNROLL; ++u) {
          float f[8];
          ml_dt_unpack16<DT>(v[u], f);
#pragma unroll
          for (int k = 0; k < EV; ++k) acc[u][k] = s == 0 ? f[k] : acc[u][k] + f[k];
        }
      }
#pragma unroll
      for (int u = 0; u < ML_CC_RUNROLL; ++u) {
        const size_t i = i0 + (size_t)u * ML_CC_NT;
        if (i >= nv) continue;
        const uint4 w = ml_dt_pack16<DT>(acc[u]);
        ((uint4 *)out)[i] = w;
        if (fwd)
          for (int k = 1; k < n; ++k) {
            const int p = r + k < n ? r + k : r + k - n;
            ((uint4 *)(stage[p] + fwd_off))[i] = w;
          }
      }
    }
  }
  for (size_t i = nv * EV + threadIdx.x; i < len; i += ML_CC_NT) {
    float acc = 0.0f;
    for (int s = 0; s < n; ++s) {
      const float x = s == r ? ml_cc_ld1<DT, false>(own, i)
                             : ml_cc_ld1<DT, true>(slot0 + s * slot_bytes, i);
      acc = s == 0 ? x : acc + x;
    }
    ml_cc_st1<DT>(out, i, acc);
    if (fwd)
      for (int k = 1; k < n; ++k) {
        const int p = r + k < n ? r + k : r + k - n;
        ml_cc_st1<DT>(stage[p] + fwd_off, i, acc);
      }
  }
}

/* Elements of piece p (length chunk, starting at base + p * chunk) below count. */
static __device__ __forceinline__ size_t ml_cc_piece(size_t base, int p, size_t chunk,
                                                     size_t count) {
  const size_t lo = base + (size_t)p * chunk;
  if (lo >= count) return 0;
  return count - lo < chunk ? count - lo : chunk;
}

template <int DT, int MODE>
static __global__ void __launch_bounds__(ML_CC_NT, 1)
    ml_cc_kernel(const __grid_constant__ ml_cc_args a) {
  __shared__ char *s_stage[ML_CCU_MAX_RANKS];
  __shared__ uint64_t *s_sig[ML_CCU_MAX_RANKS];
  __shared__ uint64_t s_epoch;
  const int t = (int)threadIdx.x, b = (int)blockIdx.x;
  const int n = a.dc.nranks, r = a.dc.rank;
  if (t < n) {
    s_stage[t] = a.stage[t];
    s_sig[t] = a.sig[t];
  }
  if (t == 0) s_epoch = a.epoch[b];
  __syncthreads();
  uint64_t ep = s_epoch;
  constexpr int ES = DT == MOELINK_DTYPE_F32 ? 4 : 2;
  const size_t chunk = a.chunk, SB = a.slot_bytes;
  const size_t cta_off = (size_t)b * (size_t)n * SB;
  const size_t blk = MODE == ML_CC_AR2 ? (size_t)n * chunk : chunk;
  const size_t step = (size_t)gridDim.x * blk;

  for (size_t base = (size_t)b * blk; base < a.count; base += step) {
    const uint64_t e = ++ep;
    const size_t off = (size_t)(e & 1) * a.par_stride + cta_off;
    if (MODE == ML_CC_AR1) {
      const size_t len = a.count - base < chunk ? a.count - base : chunk;
      const char *src = a.send + base * ES;
      for (int k = 1; k < n; ++k) {
        const int p = r + k < n ? r + k : r + k - n;
        ml_cc_copy<ES, false>(s_stage[p] + off + (size_t)r * SB, src, len * ES);
      }
      if (!ml_ccu_exchange(&a.dc, s_sig, b, e, ML_CCU_PRIM_AR_ONESHOT)) break;
      ml_cc_reduce<DT>(a.recv + base * ES, src, s_stage[r] + off, SB, n, r, len, s_stage, 0,
                       false);
    } else if (MODE == ML_CC_AR2) {
      for (int k = 1; k < n; ++k) {
        const int p = r + k < n ? r + k : r + k - n;
        const size_t lp = ml_cc_piece(base, p, chunk, a.count);
        if (lp)
          ml_cc_copy<ES, false>(s_stage[p] + off + (size_t)r * SB,
                                a.send + (base + (size_t)p * chunk) * ES, lp * ES);
      }
      if (!ml_ccu_exchange(&a.dc, s_sig, b, e, ML_CCU_PRIM_AR_RS)) break;
      /* The reduced piece goes straight into round e + 1's slots of the
       * peers: their signal of round e says they are done with that half. */
      const uint64_t e2 = ++ep;
      const size_t off2 = (size_t)(e2 & 1) * a.par_stride + cta_off;
      const size_t lr = ml_cc_piece(base, r, chunk, a.count);
      if (lr)
        ml_cc_reduce<DT>(a.recv + (base + (size_t)r * chunk) * ES,
                         a.send + (base + (size_t)r * chunk) * ES, s_stage[r] + off, SB, n, r,
                         lr, s_stage, off2 + (size_t)r * SB, true);
      if (!ml_ccu_exchange(&a.dc, s_sig, b, e2, ML_CCU_PRIM_AR_AG)) break;
      for (int k = 1; k < n; ++k) {
        const int s = r + k < n ? r + k : r + k - n;
        const size_t ls = ml_cc_piece(base, s, chunk, a.count);
        if (ls)
          ml_cc_copy<ES, true>(a.recv + (base + (size_t)s * chunk) * ES,
                               s_stage[r] + off2 + (size_t)s * SB, ls * ES);
      }
    } else if (MODE == ML_CC_AG) {
      const size_t len = a.count - base < chunk ? a.count - base : chunk;
      const char *src = a.send + base * ES;
      for (int k = 1; k < n; ++k) {
        const int p = r + k < n ? r + k : r + k - n;
        ml_cc_copy<ES, false>(s_stage[p] + off + (size_t)r * SB, src, len * ES);
      }
      ml_cc_copy<ES, false>(a.recv + ((size_t)r * a.count + base) * ES, src, len * ES);
      if (!ml_ccu_exchange(&a.dc, s_sig, b, e, ML_CCU_PRIM_ALLGATHER)) break;
      for (int k = 1; k < n; ++k) {
        const int s = r + k < n ? r + k : r + k - n;
        ml_cc_copy<ES, true>(a.recv + ((size_t)s * a.count + base) * ES,
                             s_stage[r] + off + (size_t)s * SB, len * ES);
      }
    } else {
      const size_t len = a.count - base < chunk ? a.count - base : chunk;
      for (int k = 1; k < n; ++k) {
        const int p = r + k < n ? r + k : r + k - n;
        ml_cc_copy<ES, false>(s_stage[p] + off + (size_t)r * SB,
                              a.send + ((size_t)p * a.count + base) * ES, len * ES);
      }
      if (!ml_ccu_exchange(&a.dc, s_sig, b, e, ML_CCU_PRIM_REDUCE_SCATTER)) break;
      ml_cc_reduce<DT>(a.recv + base * ES, a.send + ((size_t)r * a.count + base) * ES,
                       s_stage[r] + off, SB, n, r, len, s_stage, 0, false);
    }
  }
  if (t == 0) a.epoch[b] = ep;
}

template <int DT>
static cudaError_t ml_cc_launch(int mode, unsigned grid, const ml_cc_args *a, cudaStream_t stream) {
  switch (mode) {
  case ML_CC_AR1: ml_cc_kernel<DT, ML_CC_AR1><<<grid, ML_CC_NT, 0, stream>>>(*a); break;
  case ML_CC_AR2: ml_cc_kernel<DT, ML_CC_AR2><<<grid, ML_CC_NT, 0, stream>>>(*a); break;
  case ML_CC_AG: ml_cc_kernel<DT, ML_CC_AG><<<grid, ML_CC_NT, 0, stream>>>(*a); break;
  default: ml_cc_kernel<DT, ML_CC_RS><<<grid, ML_CC_NT, 0, stream>>>(*a); break;
  }
  return cudaGetLastError();
}

extern "C" size_t ml_ccu_internal_bytes(int nranks, int alloc_ctas) {
  return ML_CCU_STAGE_OFFSET + 2 * (size_t)alloc_ctas * (size_t)nranks * ML_CCU_SLOT_BYTES;
}

extern "C" moelink_status_t ml_ccu_collective(const ml_ccu_coll *c, ml_ccu_op op, const void *send,
                                              void *recv, size_t count, moelink_dtype_t dtype,
                                              cudaStream_t stream) {
  const size_t es = moelink_dtype_size(dtype);
  if (es != 4 && es != 2)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "cuda collectives: dtype %s not supported",
                   moelink_dtype_name(dtype));
  const int n = c->nranks;
  int mode = op == ML_CCU_ALLGATHER ? ML_CC_AG : op == ML_CCU_REDUCE_SCATTER ? ML_CC_RS : ML_CC_AR1;
  if (op == ML_CCU_ALLREDUCE) {
    int two = count * es > c->oneshot_max;
    if (c->force_allreduce == 1) two = 0;
    if (c->force_allreduce == 2) two = 1;
    if (two && n > 1) mode = ML_CC_AR2;
  }
  /* Split the work over as many CTAs as allowed, but give each at least
   * 4 KiB per round (below that the rounds cost more than the data) and at
   * most one staging slot. The numbers depend only on sizes every rank
   * shares, so every rank launches the same grid with the same rounds. */
  const size_t vec = 16 / es;
  const size_t slot_elems = c->slot_bytes / es;
  const size_t per_block = mode == ML_CC_AR2 ? (size_t)n : 1;
  const size_t min_chunk = 4096 / es;
  size_t chunk = (count + per_block * (size_t)c->max_ctas - 1) / (per_block * (size_t)c->max_ctas);
  chunk = (chunk + vec - 1) / vec * vec;
  if (chunk < min_chunk) chunk = min_chunk;
  if (chunk > slot_elems) chunk = slot_elems;
  size_t blocks = (count + per_block * chunk - 1) / (per_block * chunk);
  const unsigned grid = (unsigned)(blocks < (size_t)c->max_ctas ? blocks : (size_t)c->max_ctas);

  ml_cc_args a;
  a.send = (const char *)send;
  a.recv = (char *)recv;
  a.count = count;
  a.chunk = chunk;
  a.slot_bytes = c->slot_bytes;
  a.par_stride = (size_t)c->alloc_ctas * (size_t)n * c->slot_bytes;
  for (int p = 0; p < ML_CCU_MAX_RANKS; ++p) {
    a.stage[p] = c->stage[p];
    a.sig[p] = c->sig[p];
  }
  a.epoch = c->epoch;
  a.dc = c->dc;

  cudaError_t e;
  switch (dtype) {
  case MOELINK_DTYPE_F32: e = ml_cc_launch<MOELINK_DTYPE_F32>(mode, grid, &a, stream); break;
  case MOELINK_DTYPE_BF16: e = ml_cc_launch<MOELINK_DTYPE_BF16>(mode, grid, &a, stream); break;
  default: e = ml_cc_launch<MOELINK_DTYPE_F16>(mode, grid, &a, stream); break;
  }
  if (e != cudaSuccess) {
    static const char *const names[] = {"one-shot all-reduce", "two-shot all-reduce",
                                        "all-gather", "reduce-scatter"};
    return ml_fail(MOELINK_ERR_CUDA, "launch of the %s kernel (%u CTAs, %zu %s) failed: %s",
                   names[mode], grid, count, moelink_dtype_name(dtype), cudaGetErrorString(e));
  }
  return MOELINK_SUCCESS;
}
