/* All-to-all-v of the CUDA communicator, counts on the device: one kernel,
 * no host round trip, graph-capturable. It runs on the staging protocol of
 * collectives.cu (read its header first): CTA index b exchanges rounds with
 * the CTAs of index b on the other ranks, round e pushes into the peers'
 * slots [e & 1][b][rank] and ends with a full signal exchange, epochs per
 * CTA index in device memory.
 *
 * Round 1 of every CTA carries the counts: each CTA pushes this rank's row
 * (send count and the source address mod 16, per destination) to every
 * peer, so after the exchange every CTA of every rank holds the whole count
 * matrix M[s][d] and derives the same schedule from it: pieces of `chunk`
 * elements (a multiple of 16 bytes, sized from the largest count between
 * two different ranks so the pieces spread over all CTAs), piece j of
 * every pair in the data round of CTA j % grid. The counts decide how many
 * rounds run; every rank computes the same number, so nobody waits for a
 * round that a peer skips.
 *
 * A sender writes each piece into the slot at the same offset mod 16 as its
 * source address, so the remote stores (what NVLink bandwidth depends on)
 * are always 16-byte vectors; the receiver's local copy from staging into
 * recv takes the widest access both ends allow. A rank's own data goes
 * straight from send to recv, interleaved with the rounds so that it
 * overlaps the NVLink traffic.
 *
 * Bad input never breaks the exchange: a negative count or offset is sent
 * as count 0, elements past recv_capacity are not copied, and the first such
 * event is recorded in this rank's status words (ML_CCU_A2A_STATUS), which
 * moelink_comm_check reports and clears. */
#include "comm/cuda/comm_cuda.h"
#include "comm/cuda/stage.cuh"

#include <stdint.h>
#include <string.h>

#define ML_A2A_NT ML_CCU_THREADS
#define ML_A2A_UNROLL 4
#define ML_A2A_MIN_CHUNK_BYTES 4096

/* Status words (this rank's, in its control block). */
#define ML_A2A_ST_VALID (1ull << 63)
enum { ML_A2A_CAPACITY = 1, ML_A2A_NEG_COUNT = 2, ML_A2A_NEG_OFFSET = 3 };

typedef struct ml_a2a_args {
  const char *send;
  const int64_t *send_counts, *send_offsets; /* send_offsets NULL: packed */
  char *recv;
  uint64_t capacity; /* elements */
  int64_t *recv_counts, *recv_offsets;
  int es;
  size_t slot_bytes, par_stride;
  char *stage[ML_CCU_MAX_RANKS];
  uint64_t *sig[ML_CCU_MAX_RANKS];
  uint64_t *epoch;
  uint64_t *status; /* 3 words */
  moelink_device_comm_t dc;
} ml_a2a_args;

/* ---- copies ------------------------------------------------------------------- */

/* Vector types of W bytes, and their loads (staging: from L2, ld.cg, never a
 * stale L1 line of an earlier round). */
template <int W> struct ml_a2a_vec;
template <> struct ml_a2a_vec<16> { typedef uint4 T; };
template <> struct ml_a2a_vec<8> { typedef uint2 T; };
template <> struct ml_a2a_vec<4> { typedef unsigned int T; };
template <> struct ml_a2a_vec<2> { typedef unsigned short T; };
template <> struct ml_a2a_vec<1> { typedef unsigned char T; };

template <typename T, bool STAGE>
static __device__ __forceinline__ T ml_a2a_ld(const T *p) {
  return STAGE ? __ldcg(p) : *p;
}

/* dst[0, bytes) = src[0, bytes) by the whole block in W-byte accesses, for
 * (dst - src) % W == 0: single bytes up to dst's W alignment and after the
 * last whole vector. */
template <int W, bool STAGE>
static __device__ __forceinline__ void ml_a2a_copy_w(char *dst, const char *src, size_t bytes) {
  typedef typename ml_a2a_vec<W>::T V;
  const int t = (int)threadIdx.x;
  size_t head = (size_t)((W - ((uintptr_t)dst & (W - 1))) & (W - 1));
  if (head > bytes) head = bytes;
  if ((size_t)t < head)
    dst[t] = (char)ml_a2a_ld<unsigned char, STAGE>((const unsigned char *)src + t);
  const size_t nv = (bytes - head) / W;
  const V *s = (const V *)(src + head);
  V *d = (V *)(dst + head);
  size_t i = (size_t)t;
  for (; i + (ML_A2A_UNROLL - 1) * ML_A2A_NT < nv; i += ML_A2A_UNROLL * ML_A2A_NT) {
    V v[ML_A2A_UNROLL];
#pragma unroll
    for (int u = 0; u < ML_A2A_UNROLL; ++u) v[u] = ml_a2a_ld<V, STAGE>(s + i + u * ML_A2A_NT);
#pragma unroll
    for (int u = 0; u < ML_A2A_UNROLL; ++u) d[i + u * ML_A2A_NT] = v[u];
  }
  for (; i < nv; i += ML_A2A_NT) d[i] = ml_a2a_ld<V, STAGE>(s + i);
  const size_t done = head + nv * W;
  if ((size_t)t < bytes - done)
    dst[done + t] =
        (char)ml_a2a_ld<unsigned char, STAGE>((const unsigned char *)src + done + t);
}

template <bool STAGE>
static __device__ __forceinline__ void ml_a2a_copy(char *dst, const char *src, size_t bytes) {
  if (bytes == 0) return;
  const unsigned diff = (unsigned)(((uintptr_t)dst - (uintptr_t)src) & 15);
  if (diff == 0)
    ml_a2a_copy_w<16, STAGE>(dst, src, bytes);
  else if ((diff & 7) == 0)
    ml_a2a_copy_w<8, STAGE>(dst, src, bytes);
  else if ((diff & 3) == 0)
    ml_a2a_copy_w<4, STAGE>(dst, src, bytes);
  else if ((diff & 1) == 0)
    ml_a2a_copy_w<2, STAGE>(dst, src, bytes);
  else
    ml_a2a_copy_w<1, STAGE>(dst, src, bytes);
}

/* ---- helpers ------------------------------------------------------------------ */

/* Elements of piece j (pieces of chunk) of a run of total elements. */
static __device__ __forceinline__ int64_t ml_a2a_piece(int64_t total, int64_t j, int64_t chunk) {
  const int64_t lo = j * chunk;
  if (total <= lo) return 0;
  return total - lo < chunk ? total - lo : chunk;
}

/* Keeps the first record (the host clears the words once it reported it). */
static __device__ void ml_a2a_record(const ml_a2a_args *a, int kind, int peer, uint64_t value,
                                     uint64_t capacity) {
  const uint64_t w = ML_A2A_ST_VALID | ((uint64_t)kind << 48) |
                     ((uint64_t)(peer & 0xffff) << 16) | (uint64_t)(a->dc.rank & 0xffff);
  if (atomicCAS((unsigned long long *)a->status, 0ull, (unsigned long long)w) == 0ull) {
    a->status[1] = value;
    a->status[2] = capacity;
  }
}

/* Copies len elements to element position pos of recv, dropping what would
 * land at or past the capacity. */
template <bool STAGE>
static __device__ __forceinline__ void ml_a2a_put(const ml_a2a_args *a, int64_t pos,
                                                  const char *src, int64_t len) {
  if (len <= 0 || pos < 0 || (uint64_t)pos >= a->capacity) return;
  const uint64_t room = a->capacity - (uint64_t)pos;
  const uint64_t m = (uint64_t)len < room ? (uint64_t)len : room;
  ml_a2a_copy<STAGE>(a->recv + (size_t)pos * a->es, src, (size_t)m * a->es);
}

/* ---- the kernel --------------------------------------------------------------- */

static __global__ void __launch_bounds__(ML_A2A_NT, 1)
    ml_a2a_kernel(const __grid_constant__ ml_a2a_args a) {
  const int R = ML_CCU_MAX_RANKS;
  __shared__ char *s_stage[R];
  __shared__ uint64_t *s_sig[R];
  __shared__ int64_t s_row[2 * R];   /* this rank's counts, then source address mod 16 */
  __shared__ int64_t s_off[R];       /* this rank's send offsets (elements) */
  __shared__ int64_t s_bad[R];       /* per destination: 0, or kind << 56 | ... */
  __shared__ int64_t s_m[R][R];      /* M[s][d] */
  __shared__ int64_t s_align[R];     /* source s's address mod 16 for its run to this rank */
  __shared__ uint64_t s_epoch;
  __shared__ int s_ok;
  const int t = (int)threadIdx.x, b = (int)blockIdx.x, grid = (int)gridDim.x;
  const int n = a.dc.nranks, r = a.dc.rank;
  const int es = a.es;
  if (t < n) {
    s_stage[t] = a.stage[t];
    s_sig[t] = a.sig[t];
    /* This rank's row; a negative count or offset goes out as count 0. */
    int64_t k = a.send_counts[t], o = 0;
    if (a.send_offsets) {
      o = a.send_offsets[t];
    } else {
      for (int q = 0; q < t; ++q) {
        const int64_t kq = a.send_counts[q];
        o += kq > 0 ? kq : 0;
      }
    }
    s_bad[t] = k < 0 ? ML_A2A_NEG_COUNT : o < 0 ? ML_A2A_NEG_OFFSET : 0;
    if (k < 0 || o < 0) {
      /* The record keeps the value passed. */
      s_off[t] = k < 0 ? k : o;
      k = 0;
      o = 0;
    } else {
      s_off[t] = o;
    }
    s_row[t] = k;
    s_row[n + t] = (int64_t)(((uintptr_t)a.send + (uintptr_t)o * (uintptr_t)es) & 15);
  }
  if (t == 0) s_epoch = a.epoch[b];
  __syncthreads();
  if (b == 0 && t == 0)
    for (int p = 0; p < n; ++p)
      if (s_bad[p]) {
        ml_a2a_record(&a, (int)s_bad[p], p, (uint64_t)s_off[p], 0);
        break;
      }
  __syncthreads();
  if (t < n && s_bad[t]) s_off[t] = 0;

  uint64_t ep = s_epoch;
  const size_t SB = a.slot_bytes;
  const size_t cta_off = (size_t)b * (size_t)n * SB;

  /* Round 1: the counts. */
  {
    const uint64_t e = ++ep;
    const size_t off = (size_t)(e & 1) * a.par_stride + cta_off + (size_t)r * SB;
    for (int i = t; i < (n - 1) * 2 * n; i += ML_A2A_NT) {
      const int k = 1 + i / (2 * n), w = i % (2 * n);
      const int p = r + k < n ? r + k : r + k - n;
      ((int64_t *)(s_stage[p] + off))[w] = s_row[w];
    }
    const bool ok = ml_ccu_exchange(&a.dc, s_sig, b, e, ML_CCU_PRIM_A2A_COUNTS);
    if (t == 0) s_ok = ok;
    if (ok) {
      const size_t mine = (size_t)(e & 1) * a.par_stride + cta_off;
      for (int i = t; i < n * n; i += ML_A2A_NT) {
        const int s = i / n, d = i % n;
        s_m[s][d] = s == r ? s_row[d]
                           : __ldcg((const long long *)(s_stage[r] + mine + (size_t)s * SB) + d);
      }
      if (t < n)
        s_align[t] = t == r ? s_row[n + r]
                            : __ldcg((const long long *)(s_stage[r] + mine + (size_t)t * SB) +
                                     n + r);
    }
    __syncthreads();
  }
  if (!s_ok) {
    if (t == 0) a.epoch[b] = ep;
    return;
  }

  /* The schedule, the same on every rank. */
  int64_t max_peer = 0, total = 0;
  for (int s = 0; s < n; ++s) {
    total += s_m[s][r];
    for (int d = 0; d < n; ++d)
      if (d != s && s_m[s][d] > max_peer) max_peer = s_m[s][d];
  }
  const int64_t vec = 16 / es;
  const int64_t max_chunk = (int64_t)((SB - 16) / 16 * 16) / es;
  int64_t chunk = (max_peer + grid - 1) / grid;
  chunk = (chunk + vec - 1) / vec * vec;
  if (chunk < ML_A2A_MIN_CHUNK_BYTES / es) chunk = ML_A2A_MIN_CHUNK_BYTES / es;
  if (chunk > max_chunk) chunk = max_chunk;
  const int64_t peer_pieces = (max_peer + chunk - 1) / chunk;
  const int64_t rounds = peer_pieces > 0 ? (peer_pieces + grid - 1) / grid : 1;
  /* This rank's own data, one piece per round of every CTA. */
  const int64_t self = s_m[r][r];
  int64_t self_chunk = (self + (int64_t)grid * rounds - 1) / ((int64_t)grid * rounds);
  self_chunk = (self_chunk + vec - 1) / vec * vec;
  if (self_chunk < 1) self_chunk = 1;
  /* Where each source's elements land: packed in source-rank order. */
  int64_t at_self = 0;
  for (int s = 0; s < r; ++s) at_self += s_m[s][r];

  if (b == 0) {
    if (t < n) {
      int64_t at = 0;
      for (int s = 0; s < t; ++s) at += s_m[s][r];
      a.recv_counts[t] = s_m[t][r];
      if (a.recv_offsets) a.recv_offsets[t] = at;
    }
    if (t == 0 && (uint64_t)total > a.capacity)
      ml_a2a_record(&a, ML_A2A_CAPACITY, -1, (uint64_t)total, a.capacity);
  }

  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t j = (int64_t)b + k * grid;
    const bool peer_round = j < peer_pieces;
    const uint64_t e = peer_round ? ep + 1 : ep;
    const size_t off = (size_t)(e & 1) * a.par_stride + cta_off;
    if (peer_round) {
      for (int q = 1; q < n; ++q) {
        const int p = r + q < n ? r + q : r + q - n;
        const int64_t len = ml_a2a_piece(s_row[p], j, chunk);
        if (len) {
          const char *src = a.send + (size_t)(s_off[p] + j * chunk) * es;
          ml_a2a_copy<false>(s_stage[p] + off + (size_t)r * SB + (size_t)s_row[n + p], src,
                             (size_t)len * es);
        }
      }
    }
    {
      const int64_t len = ml_a2a_piece(self, j, self_chunk);
      if (len)
        ml_a2a_put<false>(&a, at_self + j * self_chunk,
                          a.send + (size_t)(s_off[r] + j * self_chunk) * es, len);
    }
    if (!peer_round) continue;
    ep = e;
    if (!ml_ccu_exchange(&a.dc, s_sig, b, e, ML_CCU_PRIM_A2A_DATA)) break;
    int64_t at = 0;
    for (int s = 0; s < n; ++s) {
      const int64_t len = ml_a2a_piece(s_m[s][r], j, chunk);
      if (s != r && len)
        ml_a2a_put<true>(&a, at + j * chunk,
                         s_stage[r] + off + (size_t)s * SB + (size_t)s_align[s], len);
      at += s_m[s][r];
    }
  }
  if (t == 0) a.epoch[b] = ep;
}

/* ---- host side ---------------------------------------------------------------- */

extern "C" moelink_status_t ml_ccu_alltoallv(const ml_ccu_coll *c, const void *send,
                                            const int64_t *send_counts,
                                            const int64_t *send_offsets, void *recv,
                                            size_t recv_capacity, int64_t *recv_counts,
                                            int64_t *recv_offsets, moelink_dtype_t dtype,
                                            cudaStream_t stream) {
  const size_t es = moelink_dtype_size(dtype);
  if (es != 4 && es != 2)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "cuda alltoallv: dtype %s not supported",
                   moelink_dtype_name(dtype));
  ml_a2a_args a;
  memset(&a, 0, sizeof a);
  a.send = (const char *)send;
  a.send_counts = send_counts;
  a.send_offsets = send_offsets;
  a.recv = (char *)recv;
  a.capacity = recv_capacity;
  a.recv_counts = recv_counts;
  a.recv_offsets = recv_offsets;
  a.es = (int)es;
  a.slot_bytes = c->slot_bytes;
  a.par_stride = (size_t)c->alloc_ctas * (size_t)c->nranks * c->slot_bytes;
  for (int p = 0; p < ML_CCU_MAX_RANKS; ++p) {
    a.stage[p] = c->stage[p];
    a.sig[p] = c->sig[p];
  }
  a.epoch = c->epoch;
  a.status = (uint64_t *)((char *)c->dc.ctl[c->rank] + ML_CCU_A2A_STATUS);
  a.dc = c->dc;
  /* The sizes are on the device: always the full width (a CTA with nothing
   * to move only exchanges the counts). */
  const unsigned grid = (unsigned)c->max_ctas;
  ml_a2a_kernel<<<grid, ML_A2A_NT, 0, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "launch of the alltoallv kernel (%u CTAs, %s) failed: %s",
                   grid, moelink_dtype_name(dtype), cudaGetErrorString(e));
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_ccu_alltoallv_report(const ml_ccu_coll *c) {
  uint64_t w[3] = {0, 0, 0};
  uint64_t *dev = (uint64_t *)((char *)c->dc.ctl[c->rank] + ML_CCU_A2A_STATUS);
  cudaError_t e = cudaMemcpy(w, dev, sizeof w, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "reading the alltoallv status: %s", cudaGetErrorString(e));
  if (!(w[0] & ML_A2A_ST_VALID)) return MOELINK_SUCCESS;
  /* Reported once: clear it so that later calls start clean. */
  e = cudaMemset(dev, 0, sizeof w);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "clearing the alltoallv status: %s", cudaGetErrorString(e));
  const int kind = (int)((w[0] >> 48) & 0xff);
  const int peer = (int)((w[0] >> 16) & 0xffff);
  const int rank = (int)(w[0] & 0xffff);
  if (kind == ML_A2A_CAPACITY)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "rank %d: alltoallv received %llu elements, recv_capacity is %llu: the %llu "
                   "past it were dropped (recv_counts has the full counts)",
                   rank, (unsigned long long)w[1], (unsigned long long)w[2],
                   (unsigned long long)(w[1] - w[2]));
  return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                 "rank %d: alltoallv %s[%d] is %lld (negative): sent a count of 0 to rank %d",
                 rank, kind == ML_A2A_NEG_COUNT ? "send_counts" : "send_offsets", peer,
                 (long long)w[1], peer);
}
