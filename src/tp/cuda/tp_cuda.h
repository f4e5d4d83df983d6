/* The CUDA tensor-parallel ops: declarations shared by the host side
 * (tp_cuda.c: the order of copies, GEMMs and waits) and the kernels
 * (tp_kernels.cu: flags, reductions, the fallback GEMM).
 *
 * Each tp owns one symmetric buffer, laid out the same on every rank:
 *
 *   [0, 4 KiB)  flags: word [kind * ML_TPC_MAX_RANKS + s] is written only by
 *               rank s (an epoch, only growing)
 *   G           gather rows [max_m, max(max_k, max_n)]: ag_gemm's gathered A
 *               rows (rank s pushes its shard to rows of shard s), gemm_ar's
 *               reduced C rows of the other ranks
 *   P           partials: slots [nranks][ceil(max_m / nranks)][max_n] that
 *               gemm_rs / gemm_ar's GEMMs store into (rank s into slot s of
 *               the rank owning the rows), or, for the one-shot gemm_ar, this
 *               rank's [m, n] partial that the peers read
 *
 * plus, in ordinary device memory, the epoch (one word: calls are numbered
 * 1, 2, ... on every rank, and CUDA graph replays continue the count) and a
 * ticket that tells the last CTA of a kernel.
 *
 * Reuse rule: a call first waits until every peer signalled DONE for the
 * previous call (it finished reading everything this rank wrote into it),
 * then writes into the peers' buffers; it signals DONE itself when it has
 * read what the peers wrote into its own. */
#ifndef MOELINK_TP_CUDA_H
#define MOELINK_TP_CUDA_H

#include "comm/cuda/comm_cuda.h"
#include "moelink_device.cuh"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ML_TPC_MAX_RANKS MOELINK_DEVICE_MAX_RANKS
#define ML_TPC_FLAG_BYTES ((size_t)4096)

/* Flag kinds. */
enum { ML_TPC_DONE = 0, ML_TPC_READY = 1, ML_TPC_GATHER = 2 };

/* Primitive ids of the waits, for timeout messages (moelink_device.cuh
 * leaves 16..255 to moelink; the communicator uses 16..31). */
#define ML_TPC_PRIM_BEGIN 40
#define ML_TPC_PRIM_READY 41
#define ML_TPC_PRIM_GATHER 42

typedef struct ml_tpc_sync {
  moelink_device_comm_t dc;
  uint64_t *flags[ML_TPC_MAX_RANKS]; /* each rank's flag words, as this rank addresses them */
  uint64_t *epoch;                   /* this rank's call counter */
  unsigned *ticket;                  /* zero between kernels */
} ml_tpc_sync;

/* epoch += 1; then wait until every peer's DONE >= the previous epoch. */
moelink_status_t ml_tpc_begin(const ml_tpc_sync *s, cudaStream_t stream);

/* Every peer's flag `kind` from this rank = the current epoch (release:
 * after everything the stream did before). */
moelink_status_t ml_tpc_signal(const ml_tpc_sync *s, int kind, cudaStream_t stream);

/* Waits until every peer's flag `kind` has reached the current epoch. */
moelink_status_t ml_tpc_wait(const ml_tpc_sync *s, int kind, cudaStream_t stream);

/* One reduction or copy pass over count elements of dt:
 *   before: signal_kind >= 0: peers' flag signal_kind = epoch (one thread);
 *           wait_kind >= 0: every CTA waits for all peers' flag wait_kind;
 *   body:   v[i] = fp32 sum of src[0][i] .. src[nsrc-1][i] in that order,
 *           rounded once; out[i] = v[i] and push[p][i] = v[i] for each
 *           non-NULL push[p] (p < ML_TPC_MAX_RANKS);
 *   after:  end_kind >= 0: the last CTA to finish signals peers' flag
 *           end_kind = epoch, once every CTA's stores are visible.
 * Sources may be other GPUs' memory (read through L2, never a stale L1). */
typedef struct ml_tpc_pass {
  const void *src[ML_TPC_MAX_RANKS];
  int nsrc;
  void *out;
  void *push[ML_TPC_MAX_RANKS];
  size_t count;
  int signal_kind, wait_kind, end_kind;
} ml_tpc_pass;

moelink_status_t ml_tpc_run_pass(const ml_tpc_sync *s, moelink_dtype_t dt,
                                 const ml_tpc_pass *p, int ctas, cudaStream_t stream);

/* out[r, j] = sum_k a[r, k] b[j, k] for r < rows, j < n (row-major, any
 * alignment, fp32 accumulation, one rounding): the GEMM for shapes the
 * tensor-core engines do not take (n or k not a multiple of 8). */
moelink_status_t ml_tpc_gemm_simple(moelink_dtype_t dt, const void *a, const void *b, void *out,
                                    int rows, int n, int k, cudaStream_t stream);

/* gemm_ar of up to ML_TPC_FUSED_MAX_M rows in one kernel (gemm_ar_fused.cu):
 * the GEMM streams b with the exchange of each finished 64-column block
 * through the tp's low-latency cells (ll) inside it. Takes bf16 / f16, n
 * and k multiples of 64 with n at most 64 x sms, 16-byte aligned pointers
 * and outputs of at most ll_words 4-byte words; ml_tpc_fused_ar_takes says
 * whether a call fits. */
#define ML_TPC_FUSED_MAX_M 16
int ml_tpc_fused_ar_takes(moelink_dtype_t dt, const void *a, const void *b, const void *c, int m,
                          int n, int k, size_t ll_words, int sms);
moelink_status_t ml_tpc_fused_ar(const ml_ccu_ll *ll, const moelink_device_comm_t *dc,
                                 moelink_dtype_t dt, const void *a, const void *b, void *c, int m,
                                 int n, int k, int sms, cudaStream_t stream);

/* Lets the one-kernel gemm_ar kernels of this file (both sizes; the 128-row
 * one with sm90) use their shared memory on the current device: once per tp
 * at create, so that calls launch without asking. */
moelink_status_t ml_tpc_fused_prepare(int sm90);

/* gemm_ar of up to ML_TPC_WIDE_MAX_M rows in one kernel
 * (gemm_ar_fused.cu, sm_90a): two CTAs per 128 rows of b, each over half of
 * k (wgmma, the rows of a as the MMA's N side), the halves summed through
 * `pair`, then each 64-column block's partial pushed to every peer's `data`
 * with a flag per block and summed in rank order on arrival. Takes bf16 /
 * f16, n a multiple of 128 with n / 64 <= sms, k a multiple of 128,
 * 16-byte aligned pointers and m x n x dtype size <= slot_bytes;
 * ml_tpc_wide_ar_takes says whether a call fits. The call number is the
 * low-latency exchange's (ll->epoch, ll->ticket). */
#define ML_TPC_WIDE_MAX_M 128
/* The tp sends gemm_ar calls of at least this many rows to it: below, the
 * GEMM + low-latency exchange was as fast or faster (docs/PERF.md, 32-64
 * rows at n = 8192, k = 4096). */
#define ML_TPC_WIDE_MIN_M 65
typedef struct ml_tpc_wide {
  /* every rank's symmetric part: flags [source rank][max_blocks] (call
   * numbers), then data [parity 2][source rank][slot_bytes] */
  char *base[ML_TPC_MAX_RANKS];
  size_t slot_bytes;                 /* one source's partial [m, n], m <= ML_TPC_WIDE_MAX_M */
  int max_blocks;                    /* 64-column blocks of the widest n */
  float *pair;                       /* [CTA][64 x 128] fp32 k halves (this GPU only) */
  uint64_t *pair_flags;              /* [CTA] call numbers */
  int ctas;                          /* CTAs pair and pair_flags hold */
} ml_tpc_wide;

/* Bytes of a rank's symmetric part (flags, then data) for these limits. */
size_t ml_tpc_wide_symm_bytes(int nranks, size_t slot_bytes, int max_blocks);
int ml_tpc_wide_ar_takes(const ml_tpc_wide *w, moelink_dtype_t dt, const void *a, const void *b,
                         const void *c, int m, int n, int k);
moelink_status_t ml_tpc_wide_ar(const ml_tpc_wide *w, const ml_ccu_ll *ll,
                                const moelink_device_comm_t *dc, moelink_dtype_t dt, const void *a,
                                const void *b, void *c, int m, int n, int k, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
