/* The CUDA backend: the MoE layer on one GPU as a sequence of stream-ordered
 * launches with no host synchronization (capturable in a CUDA graph):
 *
 *   router  x -> topk ids, weights                     (router.cu)
 *   plan    ids -> expert-major permutation + tiles     (plan.cu)
 *   experts h = swiglu(x[pairs] Wgu^T), y = w * h Wd^T  (experts.cu, gemm/)
 *   shared  sh = down(swiglu(x)) in fp32                (same GEMMs, dense)
 *   combine out = sum_j y[pair_rows] + gate * sh        (combine.cu)
 *
 * Grids come from host-known sizes only (T, max_tiles); the real tile count
 * stays on the device. All scratch lives in one cudaMalloc made at create,
 * sized for max_tokens. Every entry makes the context's device current and
 * puts back the caller's device on the way out. */
#include "core/fp8.h"
#include "cuda/cuda.h"
#include "cuda/gemm/decode.h"
#include "cuda/pipeline.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct ml_cu_ctx {
  int sm_count;
  int l2_bytes;
  int smem_optin;
  int cc_major, cc_minor;
} ml_cu_ctx;

/* Byte offsets of the workspace regions (each 256-byte aligned). */
typedef struct ml_cu_layout {
  size_t ids, wts, plan, plan_counts, h, y, sh_h, sh_out, partials, tickets;
  size_t xq, xs, hq, hs; /* fp8_experts: the experts' inputs quantized (e4m3 + scales) */
  size_t shq, shs;       /* fp8_shared: the shared expert's SwiGLU rows likewise */
  size_t dec_part, dec_tickets; /* decode GEMMs' split-K scratch (gemm/decode.h) */
  size_t sched;                 /* the grouped GEMMs' work counter (ML_CUDA_GEMM_SCHED_INTS) */
  size_t sched_side;            /* the same for the shared expert on its own stream */
  size_t sched_down, ready;     /* the overlapped routed down GEMM's counter; ready words */
  size_t logits;                /* router logits by the GEMM engine (large batches only) */
  size_t small;                 /* the one-kernel layer of a few tokens (moe_small.cu) */
  size_t small_bytes, small_zero;
  size_t plan_counts_bytes, tickets_bytes, dec_part_floats, dec_ticket_count, logits_floats, total;
} ml_cu_layout;

typedef struct ml_cu_moe {
  char *base;
  ml_cu_layout lay;
  int32_t *ids;
  float *wts;
  void *plan;
  ml_cuda_plan_ws plan_ws;
  void *h, *y, *sh_h;
  float *sh_out;
  float *partials;
  int32_t *tickets;
  float *dec_part;       /* decode GEMMs' split-K partials */
  uint32_t *dec_tickets; /* and their tickets (zero between launches) */
  int32_t *sched;        /* the sm_90a GEMMs' work counter (zero between launches) */
  int32_t *sched_side;   /* the shared expert's on the side stream (MOELINK_SHARED_SIDE_SMS) */
  int32_t *sched_down;   /* the routed down GEMM's, overlapped with the gate/up GEMM */
  uint32_t *ready;       /* [E] the routed gate/up GEMM's stored pieces (zero between launches) */
  cudaStream_t side;     /* the side stream, or NULL (the parameter was 0 at create) */
  cudaEvent_t side_fork, side_join;
  float *logits;         /* [max_tokens, E] router logits, or NULL (ml_cuda_router_gemm_wanted) */
  void *small;           /* ml_cuda_moe_small's scratch, or NULL where the layer never takes it */
  int small_tokens;      /* with it: the most tokens a forward gives it (the rest: none) */
  uint8_t *xq, *hq;      /* fp8_experts: token rows [T, H] and SwiGLU rows [T*k, I] */
  float *xs, *hs;        /* in e4m3, with their scales per 128 (xq, xs also fp8_shared's) */
  uint8_t *shq;          /* fp8_shared: the shared expert's SwiGLU rows [T, Is] in e4m3 */
  float *shs;            /* and their scales */
} ml_cu_moe;

static ml_cu_ctx *ml_cu_ctx_of(moelink_context_t ctx) { return (ml_cu_ctx *)ctx->impl; }

/* ---- device guard ------------------------------------------------------------ */

static __thread int ml_cu_side_forwards, ml_cu_overlap_forwards;

int ml_cuda_layer_side_forwards(void) { return ml_cu_side_forwards; }

int ml_cuda_layer_overlap_forwards(void) { return ml_cu_overlap_forwards; }

moelink_status_t ml_cuda_stream_after(cudaEvent_t ev, cudaStream_t from, cudaStream_t to,
                                      const char *what) {
  cudaError_t e = cudaEventRecord(ev, from);
  if (e == cudaSuccess)
    e = cudaStreamWaitEvent(to, ev, 0);
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "%s: ordering two streams: %s", what, cudaGetErrorString(e));
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cuda_enter(moelink_context_t ctx, int *prev) {
  /* A failed call made earlier on this thread (by anyone) leaves its error
   * behind; drop it so that the launch checks below report our own. Sticky
   * errors (a faulted context) come back from the next call anyway. */
  (void)cudaGetLastError();
  ML_CUDA_TRY(cudaGetDevice(prev));
  if (*prev != ctx->device) ML_CUDA_TRY(cudaSetDevice(ctx->device));
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cuda_leave(moelink_context_t ctx, int prev, moelink_status_t s) {
  if (prev != ctx->device) {
    cudaError_t e = cudaSetDevice(prev);
    if (e != cudaSuccess && s == MOELINK_SUCCESS)
      return ml_fail(MOELINK_ERR_CUDA, "cudaSetDevice(%d) to restore the caller's device: %s",
                     prev, cudaGetErrorString(e));
  }
  return s;
}

#define ML_CU_GUARDED(ctx, call)                                               \
  do {                                                                         \
    int ml_prev_ = 0;                                                          \
    ML_TRY(ml_cuda_enter((ctx), &ml_prev_));                                     \
    moelink_status_t ml_s_ = (call);                                           \
    return ml_cuda_leave((ctx), ml_prev_, ml_s_);                                \
  } while (0)

/* MOELINK_CUDA_SYNC_CHECK=1: after each step of a call, wait for the stream
 * and name the step whose kernels faulted. For debugging only: it costs a
 * host round trip per step (skipped while the stream is being captured). */
MOELINK_PARAM(CUDA_SYNC_CHECK, 0)
/* 0: a forward of one block of tokens builds its plan with the plan kernel
 * instead of in the router kernel (an A/B switch for the benchmarks). */
MOELINK_PARAM(ROUTER_PLAN, 1)
/* 0: a small batch's shared expert runs after the routed experts instead of
 * beside the router (an A/B switch for the benchmarks). */
MOELINK_PARAM(SHARED_FIRST, 1)
/* A batch whose shared expert takes the grouped GEMMs (past the decode
 * sizes) and has at most MOELINK_SHARED_SIDE_MAX_TOKENS tokens: the shared
 * expert's two GEMMs run on a stream of the layer's own, forked from the
 * caller's at the start of the forward and joined before the combine, in
 * grids of this many CTAs (even: its GEMMs may run in clusters of two; at
 * most a quarter of the device's SMs), beside the routed GEMMs: the routed
 * weights' stream is memory-bound there and the shared expert
 * compute-bound. 0: the shared expert after the routed experts on the
 * caller's stream. Read when a layer is created (the stream and its events
 * are made then). Measured on an H200 (deepseek-v3 graph replays, 2 to 32
 * SMs, 64 to 1024 tokens; docs/PERF.md, "The shared expert on a stream of
 * its own, measured"): with 16 and MOELINK_SHARED_SIDE_CAP 0, 70-77 us off
 * at 128 and 256 tokens, 42-44 at 512, 32-38 at 768, 10-15 at 1024. */
MOELINK_PARAM(SHARED_SIDE_SMS, 16)
MOELINK_PARAM(SHARED_SIDE_MAX_TOKENS, 1024)
/* 0: the routed sm_90a GEMMs' grids keep every SM while the shared expert
 * runs on its side stream (made with the greatest priority, so that its
 * CTAs take SMs as they free up, where the launch honours it): the routed
 * grids' last CTAs start on the SMs the shared expert leaves (their items
 * come from the dynamic schedule's counter). 1: the routed grids are short
 * of MOELINK_SHARED_SIDE_SMS SMs (kernels alone at 512 tokens, 8 SMs short:
 * ~52 us slower in bf16; the layer with 8 side SMs 21-28 us slower than the
 * default at 512-1024 tokens). Read when a layer is created. */
MOELINK_PARAM(SHARED_SIDE_CAP, 0)

/* The SMs of the shared expert's side stream on a device of sms SMs:
 * MOELINK_SHARED_SIDE_SMS rounded down to even, 0 (no side stream) where
 * that is 0 or more than a quarter of the SMs (a guard: measured on the
 * H200's 132 SMs only). */
static int ml_cu_side_sms(int sms) {
  const long long n = ml_param_SHARED_SIDE_SMS() & ~1LL;
  return n > 0 && n <= sms / 4 ? (int)n : 0;
}
/* Batches of up to this many tokens of a layer without a shared expert
 * (experts in the dtype or FP8) run as one kernel (ml_cuda_moe_small; at
 * most 8; 0: never). Measured on an H200 (graph replays, docs/PERF.md, "The
 * one-kernel layer's chain", commit 13e38b2), one kernel / pipeline at T = 1:
 * qwen3-30b-a3b 34.6-35.1 / 47.7-48.0 us, FP8 27.5-27.6 / 41.6-41.9;
 * mixtral-8x7b 184.2-184.6 / 189.4-189.9, FP8 107.6 / 115.6; at 4 tokens
 * slower, at 2 slower for qwen3-30b-a3b, not for mixtral-8x7b (bf16 the same,
 * FP8 193.4 / 199.3; 88bcd14's kernel). */
MOELINK_PARAM(SMALL_LAYER_TOKENS, 1)

static moelink_status_t ml_cu_step(cudaStream_t st, const char *step) {
  if (!ml_param_CUDA_SYNC_CHECK()) return MOELINK_SUCCESS;
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &cs) != cudaSuccess) {
    (void)cudaGetLastError();
    return MOELINK_SUCCESS;
  }
  if (cs != cudaStreamCaptureStatusNone) return MOELINK_SUCCESS;
  cudaError_t e = cudaStreamSynchronize(st);
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "%s failed on the device: %s (MOELINK_CUDA_SYNC_CHECK)", step,
                   cudaGetErrorString(e));
  return MOELINK_SUCCESS;
}

/* ---- context ------------------------------------------------------------------ */

static moelink_status_t ml_cu_context_init(moelink_context_t ctx) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "no usable CUDA device: cudaGetDeviceCount: %s",
                   cudaGetErrorString(e));
  }
  if (ctx->device >= n)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "CUDA device %d does not exist (%d visible)",
                   ctx->device, n);
  ml_cu_ctx c;
  memset(&c, 0, sizeof c);
  const int d = ctx->device;
  ML_CUDA_TRY(cudaDeviceGetAttribute(&c.cc_major, cudaDevAttrComputeCapabilityMajor, d));
  ML_CUDA_TRY(cudaDeviceGetAttribute(&c.cc_minor, cudaDevAttrComputeCapabilityMinor, d));
  if (c.cc_major < 9)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "needs sm_90 (Hopper), device %d is sm_%d%d", d,
                   c.cc_major, c.cc_minor);
  ML_CUDA_TRY(cudaDeviceGetAttribute(&c.sm_count, cudaDevAttrMultiProcessorCount, d));
  ML_CUDA_TRY(cudaDeviceGetAttribute(&c.l2_bytes, cudaDevAttrL2CacheSize, d));
  ML_CUDA_TRY(cudaDeviceGetAttribute(&c.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d));
  ml_cu_ctx *impl = (ml_cu_ctx *)malloc(sizeof *impl);
  if (!impl) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "CUDA context state allocation failed");
  *impl = c;
  ctx->impl = impl;
  return MOELINK_SUCCESS;
}

static void ml_cu_context_fini(moelink_context_t ctx) {
  free(ctx->impl);
  ctx->impl = NULL;
}

/* ---- layer shape and workspace ------------------------------------------------- */

static moelink_status_t ml_cu_check_config(const ml_cu_ctx *c, const moelink_moe_config_t *cfg) {
  const moelink_status_t no = MOELINK_ERR_UNSUPPORTED;
  if (cfg->dtype != MOELINK_DTYPE_BF16 && cfg->dtype != MOELINK_DTYPE_F16)
    return ml_fail(no, "dtype %s is not supported by the CUDA backend (bf16 or f16)",
                   moelink_dtype_name(cfg->dtype));
  if (cfg->num_experts > ML_CUDA_MAX_EXPERTS)
    return ml_fail(no, "num_experts %d > %d, the CUDA backend's limit", cfg->num_experts,
                   ML_CUDA_MAX_EXPERTS);
  if (cfg->top_k > ML_CUDA_MAX_TOPK)
    return ml_fail(no, "top_k %d > %d, the CUDA backend's limit", cfg->top_k, ML_CUDA_MAX_TOPK);
  if (cfg->hidden % 8 != 0)
    return ml_fail(no, "hidden %d is not a multiple of 8 (CUDA backend: 16-byte rows)",
                   cfg->hidden);
  if (cfg->inter % 8 != 0)
    return ml_fail(no, "inter %d is not a multiple of 8 (CUDA backend: 16-byte rows)",
                   cfg->inter);
  if (cfg->shared_inter % 8 != 0)
    return ml_fail(no, "shared_inter %d is not a multiple of 8 (CUDA backend: 16-byte rows)",
                   cfg->shared_inter);
  const size_t smem = ml_cuda_router_smem(cfg->num_experts);
  if (smem + 64 > (size_t)c->smem_optin)
    return ml_fail(no, "router needs %zu bytes of shared memory for %d experts, device allows %d",
                   smem, cfg->num_experts, c->smem_optin);
  return MOELINK_SUCCESS;
}

/* The workspace for T = max_tokens: everything grows with T*k*(H+I) or T*H,
 * plus router partials bounded by the SM count (host arithmetic only). */
static moelink_status_t ml_cu_layout_for(const ml_cu_ctx *c, const moelink_moe_config_t *cfg,
                                         ml_cu_layout *L) {
  memset(L, 0, sizeof *L);
  const size_t T = (size_t)cfg->max_tokens, k = (size_t)cfg->top_k, P = T * k;
  const size_t H = (size_t)cfg->hidden, I = (size_t)cfg->inter, Is = (size_t)cfg->shared_inter;
  const size_t ds = moelink_dtype_size(cfg->dtype);
  L->plan_counts_bytes = ml_cuda_plan_ws_bytes((int)P, cfg->num_experts);
  size_t cur = 0;
  L->ids = ml_cuda_take(&cur, P * sizeof(int32_t));
  L->wts = ml_cuda_take(&cur, P * sizeof(float));
  L->plan = ml_cuda_take(
      &cur, moelink_plan_bytes(cfg->max_tokens, cfg->top_k, cfg->num_experts, ML_CUDA_TILE_ROWS));
  L->plan_counts = ml_cuda_take(&cur, L->plan_counts_bytes);
  /* fp8_experts: h stays fp32 until it is quantized (what the layer's
   * definition and the CPU backend do) */
  L->h = ml_cuda_take(&cur, P * I * (cfg->fp8_experts ? sizeof(float) : ds));
  L->y = ml_cuda_take(&cur, P * H * ds);
  /* fp8_shared: the shared expert's h fp32 too, until quantized */
  L->sh_h = ml_cuda_take(&cur, Is > 0 ? T * Is * (cfg->fp8_shared ? sizeof(float) : ds) : 0);
  L->sh_out = ml_cuda_take(&cur, Is > 0 ? T * H * sizeof(float) : 0);
  L->partials = ml_cuda_take(&cur, ml_cuda_router_partial_floats(cfg->num_experts, c->sm_count) *
                                       sizeof(float));
  L->tickets_bytes = ml_cuda_router_tickets(c->sm_count) * sizeof(int32_t);
  L->tickets = ml_cuda_take(&cur, L->tickets_bytes);
  ml_cuda_decode_scratch(cfg->max_tokens, cfg->top_k, cfg->num_experts, cfg->hidden, cfg->inter,
                         cfg->shared_inter, c->sm_count, &L->dec_part_floats,
                         &L->dec_ticket_count);
  L->dec_part = ml_cuda_take(&cur, L->dec_part_floats * sizeof(float));
  L->dec_tickets = ml_cuda_take(&cur, L->dec_ticket_count * sizeof(uint32_t));
  L->sched = ml_cuda_take(&cur, ML_CUDA_GEMM_SCHED_INTS * sizeof(int32_t));
  L->sched_side = ml_cuda_take(&cur, ML_CUDA_GEMM_SCHED_INTS * sizeof(int32_t));
  L->sched_down = ml_cuda_take(&cur, ML_CUDA_GEMM_SCHED_INTS * sizeof(int32_t));
  L->ready = ml_cuda_take(&cur, (size_t)cfg->num_experts * sizeof(uint32_t));
  L->logits_floats = ml_cuda_router_logits_floats(cfg->max_tokens, cfg->num_experts, cfg->hidden);
  L->logits = ml_cuda_take(&cur, L->logits_floats * sizeof(float));
  /* only where asked for (sm_90a machine code: compute capability 9.0) */
  if (ml_param_SMALL_LAYER_TOKENS() > 0 && c->cc_major == 9 && c->cc_minor == 0 &&
      ml_cuda_moe_small_fits(cfg, 1, c->smem_optin)) {
    L->small_bytes = ml_cuda_moe_small_scratch(cfg, c->sm_count, &L->small_zero);
    L->small = ml_cuda_take(&cur, L->small_bytes);
  }
  if (cfg->fp8_experts || cfg->fp8_shared) {
    L->xq = ml_cuda_take(&cur, T * H);
    L->xs = ml_cuda_take(&cur, T * (H / ML_FP8_BLOCK) * sizeof(float));
  }
  if (cfg->fp8_experts) {
    L->hq = ml_cuda_take(&cur, P * I);
    L->hs = ml_cuda_take(&cur, P * (I / ML_FP8_BLOCK) * sizeof(float));
  }
  if (cfg->fp8_shared) {
    L->shq = ml_cuda_take(&cur, T * Is);
    L->shs = ml_cuda_take(&cur, T * (Is / ML_FP8_BLOCK) * sizeof(float));
  }
  L->total = (cur + 255) & ~(size_t)255;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cu_workspace_size_impl(moelink_context_t ctx,
                                                  const moelink_moe_config_t *cfg,
                                                  size_t *bytes) {
  const ml_cu_ctx *c = ml_cu_ctx_of(ctx);
  ML_TRY(ml_cu_check_config(c, cfg));
  ml_cu_layout L;
  ML_TRY(ml_cu_layout_for(c, cfg, &L));
  *bytes = L.total;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cu_workspace_size(moelink_context_t ctx,
                                             const moelink_moe_config_t *cfg, size_t *bytes) {
  ML_CU_GUARDED(ctx, ml_cu_workspace_size_impl(ctx, cfg, bytes));
}

static void ml_cu_side_destroy(ml_cu_moe *m) {
  if (m->side_join)
    (void)cudaEventDestroy(m->side_join);
  if (m->side_fork)
    (void)cudaEventDestroy(m->side_fork);
  if (m->side)
    (void)cudaStreamDestroy(m->side);
  m->side = NULL;
  m->side_fork = m->side_join = NULL;
}

static moelink_status_t ml_cu_moe_init_impl(moelink_moe_t moe) {
  const ml_cu_ctx *c = ml_cu_ctx_of(moe->ctx);
  const moelink_moe_config_t *cfg = &moe->cfg;
  ML_TRY(ml_cu_check_config(c, cfg));
  ml_cu_moe *m = (ml_cu_moe *)calloc(1, sizeof *m);
  if (!m) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "CUDA layer state allocation failed");
  moelink_status_t s = ml_cu_layout_for(c, cfg, &m->lay);
  if (s != MOELINK_SUCCESS) {
    free(m);
    return s;
  }
  s = ml_cuda_router_prepare(c->smem_optin);
  if (s != MOELINK_SUCCESS) {
    free(m);
    return s;
  }
  void *base = NULL;
  cudaError_t e = cudaMalloc(&base, m->lay.total);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    const size_t total = m->lay.total;
    free(m);
    return ml_fail(e == cudaErrorMemoryAllocation ? MOELINK_ERR_OUT_OF_MEMORY : MOELINK_ERR_CUDA,
                   "cudaMalloc of the %zu-byte layer workspace (max_tokens %d) on device %d: %s",
                   total, cfg->max_tokens, moe->ctx->device, cudaGetErrorString(e));
  }
  m->base = (char *)base;
  const ml_cu_layout *L = &m->lay;
  m->ids = (int32_t *)(m->base + L->ids);
  m->wts = (float *)(m->base + L->wts);
  m->plan = m->base + L->plan;
  m->plan_ws.counts = (int32_t *)(m->base + L->plan_counts);
  m->plan_ws.bytes = L->plan_counts_bytes;
  m->h = m->base + L->h;
  m->y = m->base + L->y;
  m->sh_h = m->base + L->sh_h;
  m->sh_out = (float *)(m->base + L->sh_out);
  m->partials = (float *)(m->base + L->partials);
  m->tickets = (int32_t *)(m->base + L->tickets);
  m->dec_part = (float *)(m->base + L->dec_part);
  m->dec_tickets = (uint32_t *)(m->base + L->dec_tickets);
  m->sched = (int32_t *)(m->base + L->sched);
  m->sched_side = (int32_t *)(m->base + L->sched_side);
  m->sched_down = (int32_t *)(m->base + L->sched_down);
  m->ready = (uint32_t *)(m->base + L->ready);
  m->logits = L->logits_floats > 0 ? (float *)(m->base + L->logits) : NULL;
  m->small = L->small_bytes > 0 ? m->base + L->small : NULL;
  /* (its token bound is the only part of ml_cuda_moe_small_fits a forward's
   * T changes: settled here, not at every forward) */
  for (int t = 1; m->small != NULL && t <= ml_param_SMALL_LAYER_TOKENS() &&
                  ml_cuda_moe_small_fits(cfg, t, c->smem_optin);
       ++t)
    m->small_tokens = t;
  if (cfg->fp8_experts || cfg->fp8_shared) {
    m->xq = (uint8_t *)(m->base + L->xq);
    m->xs = (float *)(m->base + L->xs);
  }
  if (cfg->fp8_experts) {
    m->hq = (uint8_t *)(m->base + L->hq);
    m->hs = (float *)(m->base + L->hs);
  }
  if (cfg->fp8_shared) {
    m->shq = (uint8_t *)(m->base + L->shq);
    m->shs = (float *)(m->base + L->shs);
  }
  /* The router's tickets must start at zero; every launch leaves them so. The
   * wait is at create, never on the hot path, and makes the zeros visible to
   * streams that do not synchronize with the legacy default stream. */
  e = cudaMemset(m->tickets, 0, L->tickets_bytes);
  if (e == cudaSuccess && L->dec_ticket_count > 0) /* the decode GEMMs' tickets, likewise */
    e = cudaMemset(m->dec_tickets, 0, L->dec_ticket_count * sizeof(uint32_t));
  if (e == cudaSuccess) /* and the grouped GEMMs' counters (one a stream) */
    e = cudaMemset(m->sched, 0, ML_CUDA_GEMM_SCHED_INTS * sizeof(int32_t));
  if (e == cudaSuccess)
    e = cudaMemset(m->sched_side, 0, ML_CUDA_GEMM_SCHED_INTS * sizeof(int32_t));
  if (e == cudaSuccess)
    e = cudaMemset(m->sched_down, 0, ML_CUDA_GEMM_SCHED_INTS * sizeof(int32_t));
  if (e == cudaSuccess)
    e = cudaMemset(m->ready, 0, (size_t)cfg->num_experts * sizeof(uint32_t));
  if (e == cudaSuccess && m->small != NULL) /* and the one-kernel layer's counters */
    e = cudaMemset(m->small, 0, L->small_zero);
  if (e == cudaSuccess) e = cudaStreamSynchronize(0);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFree(base);
    free(m);
    return ml_fail(MOELINK_ERR_CUDA, "clearing the router tickets: %s", cudaGetErrorString(e));
  }
  if (cfg->shared_inter > 0 && ml_cu_side_sms(c->sm_count) > 0) {
    /* the shared expert's stream of its own and the events that fork it
     * from the caller's stream and join it back */
    int least = 0, greatest = 0;
    e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (e == cudaSuccess)
      e = cudaStreamCreateWithPriority(&m->side, cudaStreamNonBlocking,
                                       ml_param_SHARED_SIDE_CAP() != 0 ? least : greatest);
    if (e == cudaSuccess)
      e = cudaEventCreateWithFlags(&m->side_fork, cudaEventDisableTiming);
    if (e == cudaSuccess)
      e = cudaEventCreateWithFlags(&m->side_join, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      ml_cu_side_destroy(m);
      cudaFree(base);
      free(m);
      return ml_fail(MOELINK_ERR_CUDA, "the shared expert's stream and events: %s",
                     cudaGetErrorString(e));
    }
  }
  moe->impl = m;
  moe->tile_rows = ML_CUDA_TILE_ROWS;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cu_moe_init(moelink_moe_t moe) {
  ML_CU_GUARDED(moe->ctx, ml_cu_moe_init_impl(moe));
}

static void ml_cu_moe_fini(moelink_moe_t moe) {
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  if (!m) return;
  int prev = 0;
  if (ml_cuda_enter(moe->ctx, &prev) == MOELINK_SUCCESS) {
    ml_cu_side_destroy(m);
    (void)cudaFree(m->base);
    (void)ml_cuda_leave(moe->ctx, prev, MOELINK_SUCCESS);
  }
  free(m);
  moe->impl = NULL;
}

/* ---- the pieces ------------------------------------------------------------------ */

static moelink_status_t ml_cu_route_impl(moelink_moe_t moe, const void *x, int T, int32_t *ids,
                                         float *weights, const moelink_plan_t *plan, int pdl,
                                         cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  const ml_cu_ctx *c = ml_cu_ctx_of(moe->ctx);
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  if (ml_cuda_misaligned(x))
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "x %p must be 16-byte aligned on the CUDA backend",
                   x);
  if (ml_cuda_misaligned(moe->w.router))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "weights.router %p must be 16-byte aligned on the CUDA backend",
                   moe->w.router);
  if (((uintptr_t)ids & 3u) || ((uintptr_t)weights & 3u))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "topk_ids %p / topk_weights %p not 4-byte aligned",
                   (void *)ids, (void *)weights);
  ml_cuda_router_args a =
      ml_cuda_router_args_for(cfg, x, moe->w.router, moe->w.correction_bias, T, ids, weights,
                              m->partials, m->tickets, c->sm_count);
  a.plan = plan;
  a.pdl = pdl;
  ML_TRY(ml_cuda_route(&a, m->logits, m->sched, st));
  return ml_cu_step(st, "router");
}

static moelink_status_t ml_cu_plan_impl(moelink_moe_t moe, const int32_t *ids, int T,
                                        void *plan_buffer, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view(plan_buffer, T, cfg->top_k, cfg->num_experts, ML_CUDA_TILE_ROWS,
                           &plan));
  if (T > 0 && ((uintptr_t)ids & 3u))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "topk_ids %p not 4-byte aligned",
                   (const void *)ids);
  ML_TRY(ml_cuda_plan(ids, T, cfg->top_k, cfg->num_experts, &m->plan_ws, &plan, st));
  return ml_cu_step(st, "plan");
}

/* Options of a decode GEMM launch on this layer's scratch. */
static ml_decode_opts ml_cu_decode_opts(moelink_moe_t moe, int flags) {
  const ml_cu_moe *m = (const ml_cu_moe *)moe->impl;
  ml_decode_opts o;
  memset(&o, 0, sizeof o);
  o.sm_count = ml_cu_ctx_of(moe->ctx)->sm_count;
  o.flags = flags;
  o.partials = m->dec_part;
  o.partial_floats = m->lay.dec_part_floats;
  o.tickets = m->dec_tickets;
  o.ticket_count = m->lay.dec_ticket_count;
  return o;
}

/* The options of a plan's routed decode GEMMs (flags as above; max_rows as
 * ml_decode_opts.max_rows: tiles cut into 16-row passes where the experts
 * have few rows, ml_cuda_decode_narrow) and their pass count (*passes). */
static ml_decode_opts ml_cu_routed_decode_opts(moelink_moe_t moe, const moelink_plan_t *plan,
                                               int flags, int max_rows, int *passes) {
  const int pairs = plan->num_tokens * plan->top_k, E = moe->cfg.num_experts;
  ml_decode_opts o = ml_cu_decode_opts(moe, flags);
  o.max_rows = max_rows;
  if (ml_cuda_decode_narrow(pairs, E))
    o.flags |= ML_DECODE_NARROW;
  *passes = ml_cuda_decode_passes(pairs, E);
  if (*passes > plan->max_tiles)
    *passes = plan->max_tiles;
  return o;
}

/* 1: an FP8 layer's h is quantized in the sm_90a gate/up GEMM's epilogue
 * (ml_cuda_gemm_swiglu_fp8 with out_scale) instead of by a kernel of its own
 * after the GEMM writes it in fp32; the same bytes either way. On since its
 * division became a reciprocal and two corrections: 2.2-2.5% faster layers
 * at 8192 tokens (docs/PERF.md, FP8 section). */
MOELINK_PARAM(GEMM_FP8_QUANT, 1)
/* 1: likewise in the decode gate/up GEMMs (ml_decode_opts.q_out), routed and
 * shared, where their passes have 16 rows (ml_cu_fp8_quant_in_gemm), instead
 * of a quantize kernel between the two GEMMs */
MOELINK_PARAM(DECODE_FP8_QUANT, 1)
/* 1: an FP8 layer whose router builds the plan (one block of tokens)
 * quantizes its token rows first and runs the router beside that kernel as
 * a programmatic dependent, instead of after the router */
MOELINK_PARAM(FP8_X_FIRST, 1)

/* Whether an FP8 decode gate/up GEMM over tiles of at most max_rows rows (0:
 * no bound known) quantizes its output itself. Measured together with the
 * token rows quantized first (FP8_X_FIRST; graph replays, docs/PERF.md):
 * T = 1 1-7 us faster, T = 16 the same, T = 128 0.7-2.5% slower, the two
 * not told apart (at T = 128 the plan comes from its own kernels and the
 * gate/up GEMM gave up reading it early): both are kept to where they were
 * measured faster, 16-row passes and a plan from the router. */
static int ml_cu_fp8_quant_in_gemm(int max_rows) {
  return ml_param_DECODE_FP8_QUANT() != 0 && max_rows > 0 && max_rows <= ML_DECODE_SMALL_ROWS;
}

/* The token rows x [T, H] in e4m3 with their scales per 128 (m->xq, m->xs),
 * what the FP8 GEMMs of the routed and the shared experts read. */
static moelink_status_t ml_cu_quantize_x(moelink_moe_t moe, const void *x, int T, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  if (ml_cuda_misaligned(x))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "x %p must be 16-byte aligned on the CUDA backend (fp8 weights)", x);
  ML_TRY(ml_cuda_quantize(MOELINK_QUANT_FP8, cfg->dtype, x, T, cfg->hidden, m->xq, m->xs,
                          ml_cu_ctx_of(moe->ctx)->sm_count, st));
  return ml_cu_step(st, "quantize x (fp8)");
}

/* The least k of a layer's two expert GEMMs (hidden for gate/up, inter for
 * down): the decode policy's long-k rule (ml_cuda_decode_wanted). */
static int ml_cu_least_k(const moelink_moe_config_t *cfg) {
  return cfg->hidden < cfg->inter ? cfg->hidden : cfg->inter;
}

/* The routed GEMMs of an FP8 layer (cfg.fp8_experts): the token rows (unless
 * x_ready: this call quantized them already) and then the fp32 SwiGLU rows
 * are quantized per 128 (moelink_quantize's FP8) and both GEMMs read e4m3
 * operands: the decode kernels while the experts have few rows each
 * (ml_cuda_decode_wanted_fp8), the sm_90a FP8 kernel past. x_ready 2: the
 * kernel before these let its dependents start only after the plan was
 * complete (as the quantize kernel here does), so the decode gate/up GEMM
 * may read the tile list before its dependency wait; 1: not known (the
 * router that builds the plan lets them start at once). */
static moelink_status_t ml_cu_routed_fp8(moelink_moe_t moe, const void *x,
                                         const moelink_plan_t *plan, const float *weights, void *y,
                                         void *const *out_rows, const int32_t *down_index,
                                         int x_ready, int max_rows, int max_ctas, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  const int T = plan->num_tokens, pairs = T * plan->top_k;
  const int sms = ml_cu_ctx_of(moe->ctx)->sm_count;
  if (pairs == 0) return MOELINK_SUCCESS;
  if (!x_ready)
    ML_TRY(ml_cu_quantize_x(moe, x, T, st));
  const int min_k = ml_cu_least_k(cfg);
  if (!ml_cuda_decode_wanted_fp8(pairs, cfg->num_experts, min_k)) {
    ml_cuda_gemm_opts go = ml_cuda_gemm_opts_for(m->sched, pairs, cfg->num_experts, cfg->hidden, 1);
    go.max_ctas = max_ctas;
    /* h quantized in the gate/up GEMM's epilogue when asked for and the
     * engine can (the same bytes and scales as quantizing its fp32 output),
     * else after it */
    int fused = 0;
    if (ml_param_GEMM_FP8_QUANT() != 0)
      ML_TRY(ml_cuda_gemm_swiglu_fp8_quantizes(cfg->inter, cfg->hidden, &fused));
    ML_TRY(ml_cuda_gemm_swiglu_fp8(
        m->xq, m->xs, cfg->hidden, plan->sorted_pairs, cfg->top_k, (const uint8_t *)moe->w.gate_up,
        moe->w.gate_up_scale, cfg->inter, cfg->hidden, plan->tiles, plan->num_tiles,
        plan->max_tiles, pairs, fused ? (void *)m->hq : m->h, fused ? m->hs : NULL, &go, st));
    ML_TRY(ml_cu_step(st, "routed gate/up GEMM (fp8)"));
    if (!fused)
      ML_TRY(ml_cuda_quantize(MOELINK_QUANT_FP8, MOELINK_DTYPE_F32, m->h, pairs, cfg->inter, m->hq,
                              m->hs, sms, st));
    ml_cuda_gemm_opts dgo = ml_cuda_gemm_opts_for(m->sched, pairs, cfg->num_experts, cfg->inter, 1);
    dgo.out_rows = out_rows;
    dgo.max_ctas = max_ctas;
    ML_TRY(ml_cuda_gemm_scaled_fp8(cfg->dtype, m->hq, m->hs, cfg->inter,
                                   (const uint8_t *)moe->w.down, moe->w.down_scale, cfg->hidden,
                                   cfg->inter, plan->tiles, plan->num_tiles, plan->max_tiles, pairs,
                                   weights, down_index, y, 0, &dgo, st));
    return ml_cu_step(st, "routed down GEMM (fp8)");
  }
  /* The plan was complete before the x quantize kernel started (a plain
   * launch), and that kernel lets the gate/up GEMM start at once: the GEMM
   * may read the tiles and stream weights before its dependency wait (so
   * with x_ready 2, not with 1). */
  int passes = 0;
  ml_decode_opts o = ml_cu_routed_decode_opts(
      moe, plan, ML_DECODE_PDL | (x_ready != 1 ? ML_DECODE_PLAN_EARLY : 0), max_rows, &passes);
  if (!ml_cuda_decode_wanted(pairs, cfg->num_experts, min_k))
    o.splits = 1; /* no scratch for it */
  /* h in e4m3 from the GEMM itself (its fp32 rows written too), or by a
   * quantize kernel after it */
  const int fused = ml_cu_fp8_quant_in_gemm(max_rows);
  o.q_out = fused ? m->hq : NULL;
  o.q_scale = fused ? m->hs : NULL;
  ML_TRY(ml_cuda_fp8_swiglu(MOELINK_DTYPE_F32, m->xq, m->xs, cfg->hidden, plan->sorted_pairs,
                            cfg->top_k, (const uint8_t *)moe->w.gate_up, moe->w.gate_up_scale,
                            cfg->inter, cfg->hidden, plan->tiles, plan->num_tiles, passes, pairs,
                            m->h, &o, st));
  ML_TRY(ml_cu_step(st, "routed gate/up GEMM (fp8)"));
  o.q_out = NULL;
  o.q_scale = NULL;
  if (!fused)
    ML_TRY(ml_cuda_quantize(MOELINK_QUANT_FP8, MOELINK_DTYPE_F32, m->h, pairs, cfg->inter, m->hq,
                            m->hs, sms, st));
  /* the down GEMM likewise streams its weights while the gate/up GEMM (or
   * the quantize kernel) drains; the kernel before it let it start only
   * after the plan was complete */
  o.flags |= ML_DECODE_PLAN_EARLY;
  o.out_rows = out_rows;
  ML_TRY(ml_cuda_fp8_scaled(cfg->dtype, m->hq, m->hs, cfg->inter, (const uint8_t *)moe->w.down,
                            moe->w.down_scale, cfg->hidden, cfg->inter, plan->tiles,
                            plan->num_tiles, passes, pairs, weights, down_index, y, 0, &o, st));
  return ml_cu_step(st, "routed down GEMM (fp8)");
}

/* Where the routed sm_90a bf16/f16 down GEMM starts on the SMs the gate/up
 * GEMM's last items leave, expert by expert (ml_cuda_gemm_opts.ready),
 * instead of after the whole gate/up GEMM: 2 (default) in forwards whose
 * shared expert does not run on the side stream meanwhile, 1 in every
 * forward, 0 never. Measured on the H200 (docs/PERF.md, "The down GEMM on
 * the gate/up GEMM's last wave"): qwen3-30b-a3b and mixtral-8x7b 0.5-2.4%
 * faster at 128-2048 tokens, deepseek-v3 0.5-1% at 2048; beside the side
 * stream (deepseek-v3 at 128-512 tokens) 17-22 us slower at 128, 3-11 us
 * faster at 512. */
MOELINK_PARAM(GEMM_OVERLAP, 2)

/* Both routed GEMMs over a plan: h = swiglu(x gathered by pair), y = w * h
 * Wd^T. x_ready: FP8 experts' token rows are in m->xq already. out_rows not
 * NULL: pair p's output row goes to out_rows[p] instead of y (see
 * ml_cuda_moe_experts_to). max_rows: a bound on an expert's rows (the token
 * count where each token's experts are distinct), 0 where none is known
 * (ml_decode_opts.max_rows). max_ctas: 0, or the most SMs the sm_90a
 * GEMMs' persistent grids take (ml_cuda_gemm_opts.max_ctas). overlap_ok: the
 * down GEMM may overlap the gate/up GEMM where the engine allows it (the
 * layer's forward, by MOELINK_GEMM_OVERLAP; not the expert-parallel steps,
 * where it was never measured). */
static moelink_status_t ml_cu_routed(moelink_moe_t moe, const void *x, const moelink_plan_t *plan,
                                     const float *weights, void *y, void *const *out_rows,
                                     int x_ready, int max_rows, int max_ctas, int overlap_ok,
                                     cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  const int pairs = plan->num_tokens * plan->top_k;
  /* the down GEMM's row scales and output rows are by pair */
  const int32_t *down_index = weights || out_rows ? plan->sorted_pairs : NULL;
  if (cfg->fp8_experts)
    return ml_cu_routed_fp8(moe, x, plan, weights, y, out_rows, down_index, x_ready, max_rows,
                            max_ctas, st);
  if (ml_cuda_decode_wanted(pairs, cfg->num_experts, ml_cu_least_k(cfg))) {
    /* A small batch: the weight-streaming GEMMs (gemm/decode.h; the row
     * threshold is measured there). The down GEMM may read the tiles before
     * its dependency wait: the gate/up GEMM lets it start only after the plan
     * is complete. */
    int passes = 0;
    ml_decode_opts o = ml_cu_routed_decode_opts(moe, plan, ML_DECODE_PDL, max_rows, &passes);
    ML_TRY(ml_cuda_decode_swiglu(cfg->dtype, x, cfg->hidden, plan->sorted_pairs, cfg->top_k,
                                 moe->w.gate_up, cfg->inter, cfg->hidden, plan->tiles,
                                 plan->num_tiles, passes, pairs, m->h, &o, st));
    ML_TRY(ml_cu_step(st, "routed gate/up GEMM (decode)"));
    o.flags |= ML_DECODE_PLAN_EARLY;
    o.out_rows = out_rows;
    ML_TRY(ml_cuda_decode_scaled(cfg->dtype, m->h, cfg->inter, moe->w.down, cfg->hidden, cfg->inter,
                                 plan->tiles, plan->num_tiles, passes, pairs, weights, down_index,
                                 y, 0, &o, st));
    return ml_cu_step(st, "routed down GEMM (decode)");
  }
  ml_cuda_gemm_opts go = ml_cuda_gemm_opts_for(m->sched, pairs, cfg->num_experts, cfg->hidden, 0);
  go.max_ctas = max_ctas;
  ml_cuda_gemm_opts dgo = ml_cuda_gemm_opts_for(m->sched, pairs, cfg->num_experts, cfg->inter, 0);
  dgo.out_rows = out_rows;
  dgo.max_ctas = max_ctas;
  /* the down GEMM starts on the SMs the gate/up GEMM's last items leave,
   * expert by expert as their rows are stored (MOELINK_GEMM_OVERLAP) */
  const int overlap =
      overlap_ok && out_rows == NULL &&
      ml_cuda_gemm_overlap_ok(cfg->dtype, cfg->inter, cfg->hidden, cfg->hidden, cfg->inter);
  if (overlap) {
    go.ready = m->ready;
    dgo.counter = m->sched_down;
    dgo.ready = m->ready;
    dgo.ready_n = cfg->inter;
    dgo.ready_words = cfg->num_experts;
  }
  moelink_status_t s = ml_cuda_gemm_swiglu(
      cfg->dtype, x, cfg->hidden, plan->sorted_pairs, cfg->top_k, moe->w.gate_up, cfg->inter,
      cfg->hidden, plan->tiles, plan->num_tiles, plan->max_tiles, 0, m->h, &go, st);
  if (s == MOELINK_SUCCESS)
    s = ml_cu_step(st, "routed gate/up GEMM");
  if (s == MOELINK_SUCCESS)
    s = ml_cuda_gemm_scaled(cfg->dtype, m->h, cfg->inter, moe->w.down, cfg->hidden, cfg->inter,
                            plan->tiles, plan->num_tiles, plan->max_tiles, 0, weights, down_index,
                            y, 0, &dgo, st);
  if (s != MOELINK_SUCCESS && overlap)
    /* without the down GEMM that zeroes them, the words the gate/up GEMM
     * may have counted in go back to zero for the next pair */
    (void)cudaMemsetAsync(m->ready, 0, (size_t)cfg->num_experts * sizeof(uint32_t), st);
  ML_TRY(s);
  if (overlap)
    ++ml_cu_overlap_forwards;
  return ml_cu_step(st, "routed down GEMM");
}

static moelink_status_t ml_cu_experts_impl(moelink_moe_t moe, const void *x, int T,
                                           const void *plan_buffer, const float *weights, void *y,
                                           void *const *out_rows, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view((void *)plan_buffer, T, cfg->top_k, cfg->num_experts,
                           ML_CUDA_TILE_ROWS, &plan));
  if (weights && ((uintptr_t)weights & 3u))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "topk_weights %p not 4-byte aligned",
                   (const void *)weights);
  /* (a caller's ids may name an expert twice in a token: no bound but the pairs) */
  return ml_cu_routed(moe, x, &plan, weights, y, out_rows, 0, 0, 0, 0, st);
}

static moelink_status_t ml_cu_combine_impl(moelink_moe_t moe, const void *y, int T,
                                           const void *plan_buffer, void *out, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view((void *)plan_buffer, T, cfg->top_k, cfg->num_experts,
                           ML_CUDA_TILE_ROWS, &plan));
  ML_TRY(ml_cuda_combine(cfg->dtype, y, plan.pair_rows, T, cfg->top_k, cfg->hidden, NULL, NULL,
                         NULL, out, st));
  return ml_cu_step(st, "combine");
}

/* fp8_shared: the shared expert's fp32 SwiGLU rows sh_h [T, Is] in e4m3 with
 * their scales (m->shq, m->shs), what its down GEMM reads. */
static moelink_status_t ml_cu_quantize_sh_h(moelink_moe_t moe, int T, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  return ml_cuda_quantize(MOELINK_QUANT_FP8, MOELINK_DTYPE_F32, m->sh_h, T, cfg->shared_inter,
                          m->shq, m->shs, ml_cu_ctx_of(moe->ctx)->sm_count, st);
}

/* The shared expert of a small batch on the decode GEMMs (dense rows):
 * gate/up into sh_h, then down into sh_out (fp32). fp8_shared: gate/up reads
 * the quantized token rows (m->xq, made by the caller), writes sh_h in fp32
 * and, with MOELINK_DECODE_FP8_QUANT, in e4m3 (m->shq) as well; else sh_h is
 * quantized before the down GEMM. */
static moelink_status_t ml_cu_shared_gate_up_decode(moelink_moe_t moe, const void *x, int T,
                                                    const ml_decode_opts *o, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  if (cfg->fp8_shared) {
    ml_decode_opts oq = *o;
    if (ml_cu_fp8_quant_in_gemm(T)) {
      oq.q_out = m->shq;
      oq.q_scale = m->shs;
    }
    return ml_cuda_fp8_swiglu(MOELINK_DTYPE_F32, m->xq, m->xs, cfg->hidden, NULL, 1,
                              (const uint8_t *)moe->w.shared_gate_up, moe->w.shared_gate_up_scale,
                              cfg->shared_inter, cfg->hidden, NULL, NULL,
                              ml_cuda_decode_passes(T, 1), T, m->sh_h, &oq, st);
  }
  return ml_cuda_decode_swiglu(cfg->dtype, x, cfg->hidden, NULL, 1, moe->w.shared_gate_up,
                               cfg->shared_inter, cfg->hidden, NULL, NULL, 0, T, m->sh_h, o, st);
}

static moelink_status_t ml_cu_shared_down_decode(moelink_moe_t moe, int T,
                                                 const ml_decode_opts *o, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  if (cfg->fp8_shared) {
    if (!ml_cu_fp8_quant_in_gemm(T))
      ML_TRY(ml_cu_quantize_sh_h(moe, T, st));
    return ml_cuda_fp8_scaled(MOELINK_DTYPE_BF16, m->shq, m->shs, cfg->shared_inter,
                              (const uint8_t *)moe->w.shared_down, moe->w.shared_down_scale,
                              cfg->hidden, cfg->shared_inter, NULL, NULL,
                              ml_cuda_decode_passes(T, 1), T, NULL, NULL, m->sh_out, 1, o, st);
  }
  return ml_cuda_decode_scaled(cfg->dtype, m->sh_h, cfg->shared_inter, moe->w.shared_down,
                               cfg->hidden, cfg->shared_inter, NULL, NULL, 0, T, NULL, NULL,
                               m->sh_out, 1, o, st);
}

/* The shared expert of a large batch on the grouped GEMMs (dense rows), as
 * above; fp8_shared: the token rows in m->xq already. sched: the work
 * counter of stream st; max_ctas as ml_cu_routed's. */
static moelink_status_t ml_cu_shared_gemms(moelink_moe_t moe, const void *x, int T, int32_t *sched,
                                           int max_ctas, cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  const moelink_moe_weights_t *w = &moe->w;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  /* gate/up (k = hidden) and down (k = shared_inter) */
  ml_cuda_gemm_opts go = ml_cuda_gemm_opts_for(sched, T, 1, cfg->hidden, cfg->fp8_shared);
  ml_cuda_gemm_opts dgo = ml_cuda_gemm_opts_for(sched, T, 1, cfg->shared_inter, cfg->fp8_shared);
  go.max_ctas = dgo.max_ctas = max_ctas;
  if (cfg->fp8_shared) {
    ML_TRY(ml_cuda_gemm_swiglu_fp8(m->xq, m->xs, cfg->hidden, NULL, 1,
                                   (const uint8_t *)w->shared_gate_up, w->shared_gate_up_scale,
                                   cfg->shared_inter, cfg->hidden, NULL, NULL, 0, T, m->sh_h, NULL,
                                   &go, st));
    ML_TRY(ml_cu_quantize_sh_h(moe, T, st));
    return ml_cuda_gemm_scaled_fp8(MOELINK_DTYPE_BF16, m->shq, m->shs, cfg->shared_inter,
                                   (const uint8_t *)w->shared_down, w->shared_down_scale,
                                   cfg->hidden, cfg->shared_inter, NULL, NULL, 0, T, NULL, NULL,
                                   m->sh_out, 1, &dgo, st);
  }
  ML_TRY(ml_cuda_gemm_swiglu(cfg->dtype, x, cfg->hidden, NULL, 1, w->shared_gate_up,
                             cfg->shared_inter, cfg->hidden, NULL, NULL, 0, T, m->sh_h, &go, st));
  return ml_cuda_gemm_scaled(cfg->dtype, m->sh_h, cfg->shared_inter, w->shared_down, cfg->hidden,
                             cfg->shared_inter, NULL, NULL, 0, T, NULL, NULL, m->sh_out, 1, &dgo,
                             st);
}

static moelink_status_t ml_cu_forward_impl(moelink_moe_t moe, const void *x, int T, void *out,
                                           cudaStream_t st) {
  const moelink_moe_config_t *cfg = &moe->cfg;
  const moelink_moe_weights_t *w = &moe->w;
  ml_cu_moe *m = (ml_cu_moe *)moe->impl;
  if (ml_cuda_misaligned(out))
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "out %p must be 16-byte aligned on the CUDA backend",
                   out);
  if (T >= 1 && T <= m->small_tokens) {
    const ml_cu_ctx *c = ml_cu_ctx_of(moe->ctx);
    ml_cuda_moe_small_args a =
        ml_cuda_moe_small_args_for(cfg, w, x, T, out, m->small, m->lay.small_bytes, c->sm_count);
    a.smem_optin = c->smem_optin;
    ML_TRY(ml_cuda_moe_small(&a, st));
    return ml_cu_step(st, "one-kernel layer");
  }
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view(m->plan, T, cfg->top_k, cfg->num_experts, ML_CUDA_TILE_ROWS, &plan));
  /* A small batch's shared expert takes the decode GEMMs. Its gate/up GEMM
   * goes first and the router runs beside it as a programmatic dependent
   * (the router's CTAs fit next to one decode CTA per SM): the router's
   * chain of round trips hides behind the shared weights' stream. The router
   * waits for the gate/up GEMM before it completes, so every later kernel's
   * wait still covers both. */
  const int shared_decode = cfg->shared_inter > 0 && ml_cuda_decode_wanted(T, 1, 0);
  const int shared_first = shared_decode && ml_param_SHARED_FIRST() != 0 &&
                           ml_cuda_pdl_allowed(st);
  const ml_decode_opts so = ml_cu_decode_opts(moe, ML_DECODE_PDL);
  /* fp8_shared: the token rows are quantized once, before the first FP8
   * GEMM that reads them (the shared expert's when it goes first) */
  int x_ready = 0;
  /* a single block of tokens gets its plan from the router kernel */
  const int fused_plan = ml_param_ROUTER_PLAN() != 0 && ml_cuda_router_builds_plan(T, cfg->top_k);
  /* FP8 experts on the decode GEMMs, a plan from the router: the token rows
   * quantized first, and the router (which reads x, not its e4m3 copy)
   * beside that kernel as a programmatic dependent that waits for it before
   * completing: the quantization leaves the chain between the router and the
   * GEMMs. (With a plan of its own kernels, the quantize kernel after them
   * lets the gate/up GEMM read the plan early and stream weights under it:
   * see ml_cu_fp8_quant_in_gemm for what was measured.) */
  const int x_first =
      cfg->fp8_experts && fused_plan && ml_param_FP8_X_FIRST() != 0 && ml_cuda_pdl_allowed(st) &&
      ml_cuda_decode_wanted_fp8(T * cfg->top_k, cfg->num_experts, ml_cu_least_k(cfg));
  /* the shared expert on its own stream beside everything up to the
   * combine (MOELINK_SHARED_SIDE_SMS), its SMs left out of the routed GEMMs' grids */
  const int sms = ml_cu_ctx_of(moe->ctx)->sm_count;
  const int side_sms = ml_cu_side_sms(sms);
  /* (m->side: the layer has a shared expert and side_sms > 0) */
  const int side = m->side != NULL && !shared_decode && T <= ml_param_SHARED_SIDE_MAX_TOKENS();
  if (x_first || (shared_first && cfg->fp8_shared) || (side && cfg->fp8_shared)) {
    ML_TRY(ml_cu_quantize_x(moe, x, T, st));
    x_ready = 1;
  }
  static const char *side_what = "the shared expert's stream";
  if (side) {
    /* fork; the join comes before the combine, also when a step between fails
     * (a capture then ends with both streams joined) */
    ML_TRY(ml_cuda_stream_after(m->side_fork, st, m->side, side_what));
    ++ml_cu_side_forwards;
    moelink_status_t ss = ml_cu_shared_gemms(moe, x, T, m->sched_side, side_sms, m->side);
    if (ss == MOELINK_SUCCESS)
      ss = ml_cu_step(m->side, "shared expert GEMMs (side stream)");
    if (ss != MOELINK_SUCCESS) {
      (void)ml_cuda_stream_after(m->side_join, m->side, st, side_what);
      return ss;
    }
  }
  /* (shared_first and side never both: decode sizes or not) */
  if (shared_first) {
    ML_TRY(ml_cu_shared_gate_up_decode(moe, x, T, &so, st));
    ML_TRY(ml_cu_step(st, "shared expert gate/up GEMM (decode)"));
  }
  moelink_status_t s = ml_cu_route_impl(moe, x, T, m->ids, m->wts, fused_plan ? &plan : NULL,
                                        shared_first || x_first, st);
  if (s == MOELINK_SUCCESS && shared_first) {
    ML_TRY(ml_cu_shared_down_decode(moe, T, &so, st));
    ML_TRY(ml_cu_step(st, "shared expert down GEMM (decode)"));
    /* a decode GEMM launched after the router: it lets the routed GEMMs
     * start only after its own wait, when the plan is complete */
    if (x_ready) x_ready = 2;
  }
  if (s == MOELINK_SUCCESS && !fused_plan) {
    s = ml_cuda_plan(m->ids, T, cfg->top_k, cfg->num_experts, &m->plan_ws, &plan, st);
    if (s == MOELINK_SUCCESS)
      s = ml_cu_step(st, "plan");
  }
  /* the router picks k distinct experts a token: no expert has more than T rows */
  const int64_t ov = ml_param_GEMM_OVERLAP();
  if (s == MOELINK_SUCCESS)
    s = ml_cu_routed(moe, x, &plan, m->wts, m->y, NULL, x_ready, T,
                     side && ml_param_SHARED_SIDE_CAP() != 0 ? sms - side_sms : 0,
                     ov == 1 || (ov == 2 && !side), st);
  if (side) {
    /* the join, whatever happened since the fork */
    const moelink_status_t j = ml_cuda_stream_after(m->side_join, m->side, st, side_what);
    if (s == MOELINK_SUCCESS)
      s = j;
  }
  ML_TRY(s);
  /* (the routed FP8 GEMMs quantize the token rows when they have not been) */
  x_ready |= cfg->fp8_experts;
  const float *sh = cfg->shared_inter > 0 ? m->sh_out : NULL;
  if (cfg->shared_inter > 0 && !shared_first && !side) {
    if (cfg->fp8_shared && !x_ready)
      ML_TRY(ml_cu_quantize_x(moe, x, T, st));
    if (shared_decode) {
      ML_TRY(ml_cu_shared_gate_up_decode(moe, x, T, &so, st));
      ML_TRY(ml_cu_shared_down_decode(moe, T, &so, st));
      ML_TRY(ml_cu_step(st, "shared expert GEMMs (decode)"));
    } else {
      ML_TRY(ml_cu_shared_gemms(moe, x, T, m->sched, 0, st));
      ML_TRY(ml_cu_step(st, "shared expert GEMMs"));
    }
  }
  ML_TRY(ml_cuda_combine(cfg->dtype, m->y, plan.pair_rows, T, cfg->top_k, cfg->hidden, sh, x,
                         cfg->shared_gate ? w->shared_gate : NULL, out, st));
  return ml_cu_step(st, "combine");
}

static moelink_status_t ml_cu_fill_impl(moelink_context_t ctx, moelink_dtype_t dtype, void *ptr,
                                        size_t n, uint64_t seed, float scale, float offset,
                                        cudaStream_t st) {
  const size_t es = moelink_dtype_size(dtype);
  if (es > 1 && ((uintptr_t)ptr % es) != 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "fill_random: ptr %p is not %zu-byte aligned",
                   ptr, es);
  ML_TRY(ml_cuda_fill(dtype, ptr, n, seed, scale, offset, ml_cu_ctx_of(ctx)->sm_count, st));
  return ml_cu_step(st, "fill_random");
}

static moelink_status_t ml_cu_quant_aligned(const char *fn, const void *x, const void *q,
                                             const void *scales) {
  if (((uintptr_t)x | (uintptr_t)q) & 15 || (uintptr_t)scales & 3)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: rows %p and bytes %p must be 16-byte aligned, scales %p 4-byte aligned",
                   fn, x, q, scales);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cu_quantize_impl(moelink_context_t ctx, moelink_quant_t format,
                                            moelink_dtype_t dtype, const void *x, int rows,
                                            int cols, uint8_t *q, void *scales, cudaStream_t st) {
  ML_TRY(ml_cu_quant_aligned("quantize", x, q, scales));
  ML_TRY(ml_cuda_quantize(format, dtype, x, rows, cols, q, scales, ml_cu_ctx_of(ctx)->sm_count,
                          st));
  return ml_cu_step(st, "quantize");
}

static moelink_status_t ml_cu_dequantize_impl(moelink_context_t ctx, moelink_quant_t format,
                                              moelink_dtype_t dtype, const uint8_t *q,
                                              const void *scales, int rows, int cols, void *x,
                                              cudaStream_t st) {
  ML_TRY(ml_cu_quant_aligned("dequantize", x, q, scales));
  ML_TRY(ml_cuda_dequantize(format, dtype, q, scales, rows, cols, x,
                            ml_cu_ctx_of(ctx)->sm_count, st));
  return ml_cu_step(st, "dequantize");
}

/* ---- the table -------------------------------------------------------------------- */

static moelink_status_t ml_cu_route(moelink_moe_t moe, const void *x, int T, int32_t *ids,
                                    float *weights, void *stream) {
  ML_CU_GUARDED(moe->ctx,
                ml_cu_route_impl(moe, x, T, ids, weights, NULL, 0, (cudaStream_t)stream));
}

static moelink_status_t ml_cu_plan(moelink_moe_t moe, const int32_t *ids, int T,
                                   void *plan_buffer, void *stream) {
  ML_CU_GUARDED(moe->ctx, ml_cu_plan_impl(moe, ids, T, plan_buffer, (cudaStream_t)stream));
}

static moelink_status_t ml_cu_experts(moelink_moe_t moe, const void *x, int T,
                                      const void *plan_buffer, const float *weights, void *y,
                                      void *stream) {
  ML_CU_GUARDED(moe->ctx,
                ml_cu_experts_impl(moe, x, T, plan_buffer, weights, y, NULL, (cudaStream_t)stream));
}

/* See cuda.h. */
moelink_status_t ml_cuda_moe_experts_to(moelink_moe_t moe, const void *x, int T,
                                        const void *plan_buffer, const float *weights, void *y,
                                        void *const *out_rows, cudaStream_t stream) {
  if (moe->ctx->backend != MOELINK_BACKEND_CUDA)
    return ml_fail(MOELINK_ERR_INTERNAL, "ml_cuda_moe_experts_to: not a CUDA layer");
  ML_CU_GUARDED(moe->ctx, ml_cu_experts_impl(moe, x, T, plan_buffer, weights, y, out_rows, stream));
}

static moelink_status_t ml_cu_combine(moelink_moe_t moe, const void *y, int T,
                                      const void *plan_buffer, void *out, void *stream) {
  ML_CU_GUARDED(moe->ctx, ml_cu_combine_impl(moe, y, T, plan_buffer, out, (cudaStream_t)stream));
}

static moelink_status_t ml_cu_forward(moelink_moe_t moe, const void *x, int T, void *out,
                                      void *stream) {
  ML_CU_GUARDED(moe->ctx, ml_cu_forward_impl(moe, x, T, out, (cudaStream_t)stream));
}

static moelink_status_t ml_cu_fill(moelink_context_t ctx, moelink_dtype_t dtype, void *ptr,
                                   size_t n, uint64_t seed, float scale, float offset,
                                   void *stream) {
  ML_CU_GUARDED(ctx, ml_cu_fill_impl(ctx, dtype, ptr, n, seed, scale, offset,
                                     (cudaStream_t)stream));
}

static moelink_status_t ml_cu_quantize(moelink_context_t ctx, moelink_quant_t format,
                                       moelink_dtype_t dtype, const void *x, int rows, int cols,
                                       uint8_t *q, void *scales, void *stream) {
  ML_CU_GUARDED(ctx, ml_cu_quantize_impl(ctx, format, dtype, x, rows, cols, q, scales,
                                         (cudaStream_t)stream));
}

static moelink_status_t ml_cu_dequantize(moelink_context_t ctx, moelink_quant_t format,
                                         moelink_dtype_t dtype, const uint8_t *q,
                                         const void *scales, int rows, int cols, void *x,
                                         void *stream) {
  ML_CU_GUARDED(ctx, ml_cu_dequantize_impl(ctx, format, dtype, q, scales, rows, cols, x,
                                           (cudaStream_t)stream));
}

static const ml_backend_ops ml_cuda_ops = {
    "cuda",
    ml_cu_context_init,
    ml_cu_context_fini,
    ml_cu_workspace_size,
    ml_cu_moe_init,
    ml_cu_moe_fini,
    ml_cu_route,
    ml_cu_plan,
    ml_cu_experts,
    ml_cu_combine,
    ml_cu_fill,
    ml_cu_quantize,
    ml_cu_dequantize,
    ml_cu_forward,
};

const ml_backend_ops *ml_cuda_backend(void) { return &ml_cuda_ops; }
