/* The CUDA expert-parallel layer: declarations shared by its host side
 * (ep_cuda.c) and its kernels (ep_kernels.cu). Protocol and layout are in
 * ep_cuda.c's header comment. */
#ifndef MOELINK_EP_CUDA_H
#define MOELINK_EP_CUDA_H

#include "cuda/pipeline.h"
#include "moelink_device.cuh"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ML_EPC_MAX_RANKS MOELINK_DEVICE_MAX_RANKS
/* Local slots per received row, at most (the CUDA layer's top_k bound). */
#define ML_EPC_MAX_KL 16
/* Layers of at most this many max_tokens run moelink_ep_dispatch and
 * moelink_ep_combine as one kernel each (the low-latency mode). */
#define ML_EPC_LL_MAX_TOKENS 256

/* Rounds in flight at most in rounds mode (MOELINK_EP_ROUND_PIPES). */
#define ML_EPC_PIPES 4

/* Primitive ids of the waits, for timeout messages. */
#define ML_EPC_PRIM_ARRIVE 48
#define ML_EPC_PRIM_RETURN 49
#define ML_EPC_PRIM_COUNTS 50

/* Ints of a received row's meta for top_k k: source * max_tokens + token, call, k
 * local ids, k weights, and (rounds mode) k places in the receiver's pair order. */
#define ML_EPC_META(k) (2 + 3 * (k))

/* Everything a kernel needs about the layer and this rank. */
typedef struct ml_epc_args {
  moelink_device_comm_t dc;
  int n, me, k, kl, El, H, es, max_tokens;
  int cap;    /* received rows: n * max_tokens, or in rounds mode recv_capacity (the
                 whole buffer's view) or recv_capacity / pipes (a pipe's) */
  int rounds; /* 1: rounds mode (recv_capacity below n * max_tokens; see ep_cuda.c) */
  int round;  /* rounds mode: the round this launch moves (set per launch) */
  int direct_plan; /* rounds mode, a pipe's view: the receive kernel writes the plan */
  int fused;       /* set per launch: the down GEMM stores through dst (the receive
                      kernel writes dst only then) */
  int E;
  int sms;           /* the device's SMs: grids take at most two CTAs each */
  int ll;            /* 1: the one-kernel exchanges may run (ml_epc_ll_ok, max_tokens at
                        most ML_EPC_LL_MAX_TOKENS, MOELINK_EP_LL) */
  int dtype;         /* moe.dtype (bf16 or f16) */
  int quant;         /* dispatch_quant: rows travel as H e4m3 bytes + sbytes of
                        scales in payload rows of qrow bytes (off_qrows) */
  int sbytes;
  size_t qrow;
  /* Each rank's symmetric buffer, as this rank addresses it, and the offsets
   * of its parts (the same on every rank). */
  char *base[ML_EPC_MAX_RANKS];
  size_t off_arrive, off_return, off_meta, off_rows, off_ret, off_qrows;
  size_t off_csig, off_cnt; /* rounds mode: csig[n] 8-byte cells (csig[s] = step: s's
                               counts of the step are in), cnt[2][n][E] pairs of each
                               source per expert, by the step's parity */
  uint64_t *epoch;   /* this rank's call count */
  uint64_t *sepoch;  /* rounds mode: this rank's count of scheduled steps */
  int32_t *ord;      /* rounds mode: [max_tokens * k] pair t*k+j's place among this
                        rank's pairs of its expert, in pair order */
  int32_t *offs;     /* rounds mode: [E] where this rank's pairs of expert e start in
                        the pair order of e's rank (so pair p goes in round p / cap) */
  int32_t *nrounds;  /* rounds mode: the step's rounds, the same on every rank */
  int32_t *mstart;   /* rounds mode: [E + 1] where this rank's pairs of expert e start
                        in slist */
  int32_t *slist;    /* rounds mode: [max_tokens * k] this rank's pairs t*k+j by expert,
                        then place */
  int32_t *bounds;   /* rounds mode: [n][maxr + 1] bounds[d][r]: the first place in slist
                        of d's pairs of round r or later (see ml_epc_order_kernel) */
  int maxr;          /* rounds mode: the most rounds a step can take */
  int32_t *lbase;    /* rounds mode: [El + 1] where each local expert's pairs start in
                        this rank's pair order (the last: all its pairs) */
  /* rounds mode: the local layer's plan over cap rows, which the receive
   * kernel and ml_epc_round_plan write directly (a round's pairs arrive in
   * expert order: no sort) */
  ml_plan_ptrs plan;
  unsigned *ticket;  /* zero between kernels */
  /* this rank's device scratch */
  int32_t *slot_rows; /* [max_tokens][k]: t*k+j, or -1 for an empty slot (its
                         ret row is never written): the combine's pair rows */
  int32_t *lids;     /* [cap][kl] local expert ids of the received rows (-1: none) */
  float *lwts;       /* [cap][kl] */
  int4 *plist;       /* [cap * kl] the valid received (row, slot) pairs:
                        {pair r*kl+q, source rank, its return row t*k+j} */
  int32_t *npairs;   /* entries of plist (the send kernel clears it) */
  void **dst;        /* [cap * kl] of each valid received pair r * kl + q: its
                        return row in its source's ret (the down GEMM's output
                        row when the return is fused into it; written only
                        then, fused) */
} ml_epc_args;

/* Rounds mode, before a step's rounds: counts this rank's pairs per expert
 * (and each pair's place, ord), sends the counts to every rank and signals
 * its csig. */
moelink_status_t ml_epc_count(const ml_epc_args *a, const int32_t *ids, int T, cudaStream_t stream);

/* Rounds mode, after ml_epc_count: waits for every rank's counts, then
 * writes offs and nrounds = max over ranks d of ceil(pairs d receives /
 * cap) (every rank computes the same), slot_rows, and this rank's pairs
 * sorted with the bounds of each round (the send kernel's lists). */
moelink_status_t ml_epc_schedule(const ml_epc_args *a, const int32_t *ids, int T,
                                 cudaStream_t stream);

/* Call c = epoch + 1 (stored by the kernel's end): pushes the rows of the T
 * tokens, and their meta, into every destination that owns one of their
 * experts (an id outside [0, E) is an empty slot), writes slot_rows, then
 * signals each destination ARRIVE = c. The rows are x (quantized on the way
 * when quant is set) or, quantized by the caller, xq + xs. ll (a->ll only):
 * the same kernel then does ml_epc_receive's work (one-kernel dispatch). */
moelink_status_t ml_epc_send(const ml_epc_args *a, const void *x, const uint8_t *xq, const void *xs,
                             const int32_t *ids, const float *weights, int T, int ll,
                             cudaStream_t stream);

/* Waits for every source's ARRIVE, then builds lids / lwts and the return
 * list for the cap received rows (with direct_plan, the plan's pair order
 * too; with quant, turns the received payloads into rows). */
moelink_status_t ml_epc_receive(const ml_epc_args *a, cudaStream_t stream);

/* Rounds mode: the local plan's expert offsets and tile list for round
 * a->round (the receive kernel writes its pair order). */
moelink_status_t ml_epc_round_plan(const ml_epc_args *a, cudaStream_t stream);

/* Pushes each valid (row, local slot) output, y row pair_rows[p] (pair_rows
 * NULL: row p; y NULL: zeros), into its source's return rows, signals every
 * source RETURN, and waits until every rank has signalled its RETURN here.
 * pushed: the outputs are there already (the expert GEMM stored them through
 * dst, in an earlier kernel of the stream): only the signals and the wait.
 * out not NULL (a->ll only): the same kernel then sums this rank's T tokens
 * into out as ml_cuda_combine without a shared expert would (one-kernel
 * combine). */
moelink_status_t ml_epc_return(const ml_epc_args *a, const void *y, const int32_t *pair_rows,
                               int pushed, void *out, int T, cudaStream_t stream);

/* *ok = 1 when every one-kernel exchange's grid fits on the device at once
 * (two CTAs an SM). */
moelink_status_t ml_epc_ll_ok(int *ok);

#ifdef __cplusplus
}
#endif

#endif
