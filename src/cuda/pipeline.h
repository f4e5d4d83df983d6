/* Launchers of the CUDA MoE pipeline's own kernels (router, plan, combine,
 * fill), called by src/cuda/backend.c. The grouped GEMMs are in cuda.h.
 * Every launcher takes the stream last, never synchronizes, and sizes its
 * grid from host-known values only (token count, layer shape), so a forward
 * built from them is capturable in a CUDA graph. */
#ifndef MOELINK_CUDA_PIPELINE_H
#define MOELINK_CUDA_PIPELINE_H

#include "cuda/cuda.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Limits of the router kernel: a warp holds a token's scores as 16 values per
 * lane, and a lane keeps one of the k winners. */
#define ML_CUDA_MAX_EXPERTS 512
#define ML_CUDA_MAX_TOPK 16

/* ---- router (router.cu) ----------------------------------------------------
 * logits = x router^T (tensor cores, fp32 accumulation), scores, correction
 * bias, group-limited top-k and final weights, one kernel. Tokens go in blocks
 * of 16; with splits > 1 each block's hidden dimension is cut into `splits`
 * ranges computed by separate CTAs whose fp32 partial logits are summed in a
 * fixed order by the last CTA to finish (tickets), so small batches use more
 * than one SM per block and the result stays deterministic. */
typedef struct ml_cuda_router_args {
  moelink_dtype_t dtype;     /* bf16 or f16 */
  const void *x;             /* [T, H], 16-byte aligned */
  const void *w;             /* [E, H] router weight, 16-byte aligned */
  const float *bias;         /* [E] or NULL */
  int num_tokens, hidden, num_experts, top_k;
  moelink_router_t router;
  int renormalize, n_group, topk_group;
  float routed_scaling;
  int32_t *ids;              /* [T, k] out */
  float *weights;            /* [T, k] out */
  int splits;                /* >= 1, from ml_cuda_router_splits */
  float *partials;           /* splits > 1: ml_cuda_router_partial_floats() floats */
  int32_t *tickets;          /* splits > 1: ml_cuda_router_tickets() zero-initialized,
                                left zero */
  /* NULL, or a plan view (tile_rows ML_CUDA_TILE_ROWS) that the kernel fills
   * from the ids it chose, as ml_cuda_plan would; only where
   * ml_cuda_router_builds_plan(num_tokens, top_k) */
  const moelink_plan_t *plan;
  /* 1: launched as a programmatic dependent of the stream's previous kernel
   * (where ml_cuda_pdl_allowed): it runs beside it, reads only x, w and
   * bias (which that kernel must not write), and waits for it before it
   * completes */
  int pdl;
  /* NULL, or the fp32 logits [T, E] (x W^T) computed before, e.g. by the
   * grouped GEMM engine (ml_cuda_router_gemm_wanted): the kernel then only
   * selects; splits 1 and pdl 0 */
  const float *logits;
  /* logits given: in this many parts [logit_parts][T][E] that the kernel
   * adds in order (ml_cuda_gemm_splitk); 0 or 1: one */
  int logit_parts;
  /* Measurements only (bench/router_probe.c; the library leaves it NULL):
   * ML_CUDA_ROUTER_STAMPS int64 a CTA (CTA (bx, by) at (bx * splits + by)),
   * thread 0's %globaltimer at each ml_cuda_router_phase it reaches, then
   * the same CTA's clock64 at each; phases not reached keep their value */
  int64_t *stamps;
} ml_cuda_router_args;

/* The arguments that route T tokens of x as the layer cfg does, with router
 * weights w and correction bias (used when cfg->correction_bias), into ids
 * and weights, splits chosen for sm_count SMs over the scratch partials /
 * tickets. */
ml_cuda_router_args ml_cuda_router_args_for(const moelink_moe_config_t *cfg, const void *x,
                                            const void *w, const float *bias, int num_tokens,
                                            int32_t *ids, float *weights, float *partials,
                                            int32_t *tickets, int sm_count);
/* Hidden-dimension splits for T tokens: 1 when the token blocks alone fill
 * the GPU; never more than sm_count / blocks, so blocks * splits <= sm_count. */
int ml_cuda_router_splits(int num_tokens, int hidden, int sm_count);
/* Whether the router kernel can build the plan of T tokens (one block). */
int ml_cuda_router_builds_plan(int num_tokens, int top_k);
/* Whether T tokens' logits are better computed by the grouped GEMM engine
 * (ml_cuda_gemm_scaled, fp32 out) and passed to the router kernel as
 * logits: from MOELINK_ROUTER_GEMM_MIN_TOKENS tokens (docs/ENV.md), where
 * the kernel's 16-token blocks each stream all of W through L2. */
int ml_cuda_router_gemm_wanted(int num_tokens, int num_experts, int hidden);
/* Floats of logits scratch a layer of max_tokens needs for that (0: none):
 * room for the parts of ml_cuda_gemm_splitk too, parts * T <=
 * max(max_tokens, ML_CUDA_ROUTER_PART_ROWS). */
#define ML_CUDA_ROUTER_PART_ROWS 16384
size_t ml_cuda_router_logits_floats(int max_tokens, int num_experts, int hidden);
/* Tickets the router may use with sm_count SMs. */
size_t ml_cuda_router_tickets(int sm_count);
/* Floats of partial logits that blocks * splits <= sm_count CTAs may write. */
size_t ml_cuda_router_partial_floats(int num_experts, int sm_count);
/* Dynamic shared memory of the router kernel for E experts. */
size_t ml_cuda_router_smem(int num_experts);
/* Allows the router kernels the shared memory of E = ML_CUDA_MAX_EXPERTS on
 * the current device (bounded by smem_optin). */
moelink_status_t ml_cuda_router_prepare(int smem_optin);
moelink_status_t ml_cuda_router(const ml_cuda_router_args *a, cudaStream_t stream);
/* The points of the router kernel that args.stamps records. */
typedef enum ml_cuda_router_phase {
  ML_R_PH_START,     /* the CTA began */
  ML_R_PH_LOGITS,    /* its chunks are in and multiplied */
  ML_R_PH_STORED,    /* its partial logits written (split launches) */
  ML_R_PH_GROUP,     /* it took the last ticket of its group (two-level sums) */
  ML_R_PH_GROUP_SUM, /* the group's sum written */
  ML_R_PH_LAST,      /* it took the block's last ticket */
  ML_R_PH_SUMMED,    /* the block's logits summed into shared memory */
  ML_R_PH_SCORED,    /* thread 0's token scored */
  ML_R_PH_CHOSEN,    /* its experts chosen */
  ML_R_PH_SELECTED,  /* ids and weights written */
  ML_R_PH_PLANNED,   /* the plan written (build_plan) */
  ML_R_PH_COUNT
} ml_cuda_router_phase;
#define ML_CUDA_ROUTER_STAMPS (2 * ML_R_PH_COUNT)
/* The router as a layer runs it: where ml_cuda_router_gemm_wanted, logits
 * (ml_cuda_router_logits_floats of the layer's max_tokens) is given and the
 * kernel builds no plan (a->plan NULL), the logits first by the grouped GEMM
 * engine (its work counter: counter, see ml_cuda_gemm_opts) and the kernel
 * then selects only (a's logits, splits and pdl set so); else
 * ml_cuda_router(a) as it is. */
moelink_status_t ml_cuda_route(ml_cuda_router_args *a, float *logits, int32_t *counter,
                               cudaStream_t stream);

/* ---- plan (plan.cu) ---------------------------------------------------------
 * A stable counting sort of the T*k pairs by expert id (invalid ids sort last
 * as key E) in two kernels that also write offsets, tiles, sorted_pairs and
 * pair_rows; up to ML_P_THREADS pairs in one. */
/* A plan's device pointers, as the plan kernels (plan.cuh) and the
 * expert-parallel layer's round plans write them. */
typedef struct ml_plan_ptrs {
  int32_t *offsets, *sorted_pairs, *pair_rows, *tiles, *num_tiles;
} ml_plan_ptrs;

/* The device pointers of a plan view. */
static inline ml_plan_ptrs ml_plan_ptrs_of(const moelink_plan_t *plan) {
  ml_plan_ptrs p;
  p.offsets = plan->expert_offsets;
  p.sorted_pairs = plan->sorted_pairs;
  p.pair_rows = plan->pair_rows;
  p.tiles = plan->tiles;
  p.num_tiles = plan->num_tiles;
  return p;
}

typedef struct ml_cuda_plan_ws {
  int32_t *counts; /* ml_cuda_plan_ws_bytes: each chunk's count of each key */
  size_t bytes;
} ml_cuda_plan_ws;

/* Workspace bytes of plans of up to max_pairs pairs (0 where one block
 * sorts). */
size_t ml_cuda_plan_ws_bytes(int max_pairs, int num_experts);
/* Builds the plan of ids [T, k] (T may be 0) into plan (a view with
 * tile_rows = ML_CUDA_TILE_ROWS). ws may be NULL while T * k <=
 * ML_P_THREADS (plan.cuh); a too small one is an error, never an overrun. */
moelink_status_t ml_cuda_plan(const int32_t *ids, int num_tokens, int top_k, int num_experts,
                              const ml_cuda_plan_ws *ws, const moelink_plan_t *plan,
                              cudaStream_t stream);

/* ---- combine (combine.cu) ---------------------------------------------------
 * out[t] = sum_{j<k, in order} y[pair_rows[t*k+j]] (rows < 0 skipped)
 *          + gate(t) * shared_out[t]        (when shared_out != NULL)
 * in fp32, rounded once to dt. gate(t) = sigmoid(x[t] . shared_gate) when
 * shared_gate != NULL (x needed then), else 1. y, out, x, shared_gate,
 * shared_out 16-byte aligned; H a multiple of 8. */
moelink_status_t ml_cuda_combine(moelink_dtype_t dt, const void *y, const int32_t *pair_rows,
                                 int num_tokens, int top_k, int hidden, const float *shared_out,
                                 const void *x, const void *shared_gate, void *out,
                                 cudaStream_t stream);

/* ---- the layer of a few tokens in one kernel (moe_small.cu) --------------------
 * moelink_moe_forward's output for num_tokens tokens of a layer with routed
 * experts only (no shared expert), bf16 or f16 (the experts' weights in the
 * dtype or, with cfg->fp8_experts, e4m3 with block scales): the router's
 * logits, the selection (as the CPU backend's, every CTA for itself), both
 * expert GEMMs and the combine in one persistent kernel of one CTA an SM
 * (a cooperative launch: every CTA resident). Its rounding points are the
 * pipeline's: h and the weighted y rows in the dtype, the k rows summed in
 * fp32 in order; FP8: each expert's inputs (the token row, the fp32 SwiGLU
 * row) quantized per 128 elements as moelink_quantize's FP8, each 128 x 128
 * block's products promoted in fp32. Deterministic. */
typedef struct ml_cuda_moe_small_args {
  const moelink_moe_config_t *cfg;
  const void *x; /* [num_tokens, H], 16-byte aligned (as every pointer here) */
  int num_tokens;
  /* the layer's weights on the device (moelink_moe_weights_t's layout): the
   * router, gate_up, down and, where cfg asks for them, the correction bias
   * and the FP8 block scales */
  const moelink_moe_weights_t *w;
  void *out;           /* [num_tokens, H] */
  void *scratch;       /* ml_cuda_moe_small_scratch bytes; its first zero_bytes zero
                          before the first launch, and every launch leaves them zero */
  size_t scratch_bytes;
  int sm_count;   /* the device's SMs (the scratch was sized for them) */
  int smem_optin; /* its shared memory a block (opt-in); 0: asked of the device */
  int ctas;       /* 0: one CTA an SM; tests: fewer */
  int32_t *ids;   /* NULL, or [num_tokens, k]: the experts chosen (tests) */
  float *weights; /* with ids: their weights */
  /* Measurements only (bench/small_probe.c; the library leaves it NULL):
   * ML_CUDA_SMALL_STAMPS int64 a CTA, the %globaltimer at which its thread 0
   * (the producer's: SELECTED, LAST_ISSUE) reached each ml_cuda_small_phase;
   * phases not reached keep their value */
  int64_t *stamps;
} ml_cuda_moe_small_args;

enum ml_cuda_small_phase {
  ML_SMALL_PH_START,          /* the CTA began */
  ML_SMALL_PH_LOGITS,         /* its share of the router's logits stored */
  ML_SMALL_PH_BARRIER,        /* every CTA's logits stored */
  ML_SMALL_PH_SEL_LOADED,     /* token 0's logits read back */
  ML_SMALL_PH_SEL_SCORED,     /* its scores and selection values stored */
  ML_SMALL_PH_SEL_RANKED,     /* its groups and winners ranked */
  ML_SMALL_PH_SELECTED,       /* experts chosen (every token) */
  ML_SMALL_PH_FIRST_BOX,      /* the first weight box landed */
  ML_SMALL_PH_GATE_UP_DONE,   /* its gate/up steps and their sums done */
  ML_SMALL_PH_READY,          /* the SwiGLU rows of its first down unit ready */
  ML_SMALL_PH_FIRST_DOWN_BOX, /* the first down box landed */
  ML_SMALL_PH_LAST_ISSUE,     /* the producer issued its last box */
  ML_SMALL_PH_CONSUMED,       /* the consumers used every box */
  ML_SMALL_PH_SUMS_DONE,      /* every run's sums stored (the epilogue warp's too) */
  ML_SMALL_PH_COUNT
};
#define ML_CUDA_SMALL_STAMPS ML_SMALL_PH_COUNT

/* The arguments of a launch for num_tokens tokens of x through layer cfg's
 * weights w into out, over scratch (scratch_bytes, sized for sm_count SMs);
 * the rest zero (the device's shared memory asked of it, one CTA an SM, no
 * ids, no stamps). */
ml_cuda_moe_small_args ml_cuda_moe_small_args_for(const moelink_moe_config_t *cfg,
                                                  const moelink_moe_weights_t *w, const void *x,
                                                  int num_tokens, void *out, void *scratch,
                                                  size_t scratch_bytes, int sm_count);

/* Whether the kernel takes num_tokens tokens of layer cfg on a device with
 * smem_optin bytes of shared memory a block (at most 8 tokens, and never
 * past cfg->max_tokens). */
int ml_cuda_moe_small_fits(const moelink_moe_config_t *cfg, int num_tokens, int smem_optin);
/* Scratch bytes for every launch that fits the layer on up to sm_count CTAs;
 * *zero_bytes: the leading part that must start zeroed. */
size_t ml_cuda_moe_small_scratch(const moelink_moe_config_t *cfg, int sm_count, size_t *zero_bytes);
moelink_status_t ml_cuda_moe_small(const ml_cuda_moe_small_args *args, cudaStream_t stream);

/* ---- fill (fill.cu) -----------------------------------------------------------
 * p[i] = dtype(offset + scale * ml_random_unit(seed, i)), bitwise what the
 * CPU writes. dt is F32, BF16 or F16. */
moelink_status_t ml_cuda_fill(moelink_dtype_t dt, void *p, size_t n, uint64_t seed, float scale,
                              float offset, int sm_count, cudaStream_t stream);

/* ---- 8-bit rows (quant.cu) ----------------------------------------------------
 * moelink_quantize / moelink_dequantize, arguments checked by the caller
 * (rows >= 1, cols a multiple of the block, 16-byte aligned x and q). */
moelink_status_t ml_cuda_quantize(moelink_quant_t format, moelink_dtype_t dtype, const void *x,
                                  int rows, int cols, uint8_t *q, void *scales, int sms,
                                  cudaStream_t stream);
moelink_status_t ml_cuda_dequantize(moelink_quant_t format, moelink_dtype_t dtype,
                                    const uint8_t *q, const void *scales, int rows, int cols,
                                    void *x, int sms, cudaStream_t stream);
/* Tests: n generated (x, s) pairs of FP8 quantization (s a block scale, x of
 * its block, a quarter near e4m3 rounding midpoints) scaled by the cheap
 * division of quant.cuh and by x / s; counts the pairs whose e4m3 bytes
 * differ and those (|x| >= 2^-80) whose fp32 quotients differ. Synchronous,
 * on the current device. */
moelink_status_t ml_cuda_q_div_check(uint64_t seed, long long n,
                                     unsigned long long *byte_mismatches,
                                     unsigned long long *bit_mismatches);

#ifdef __cplusplus
}
#endif

#endif
