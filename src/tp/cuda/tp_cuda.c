/* The CUDA tensor-parallel ops: each call is a short, fixed sequence of
 * stream-ordered launches (no host synchronization, capturable) that lets
 * the GEMM run while the data moves:
 *
 * ag_gemm  a side stream pushes this rank's shard into every peer's gather
 *          rows with the copy engine (no SMs) and then signals READY; the
 *          stream multiplies the own shard meanwhile, then, per peer in
 *          rank order starting after this one, waits for its READY and
 *          multiplies its rows.
 * gemm_rs  the GEMM is split by the rank that owns the output rows, the
 *          peers' blocks first; the copy engine moves each finished block
 *          into its owner's partial slot while the next block computes (no
 *          SMs taken from the GEMM), then signals READY. One pass waits for
 *          the peers' READY and sums the slots in rank order.
 * gemm_ar  small outputs (MOELINK_TP_AR_LL_MAX_BYTES): the GEMM writes
 *          this rank's partial locally and the communicator's low-latency
 *          all-reduce kernel (comm/cuda/allreduce_ll.cu, on this op's own
 *          cells) sums it: each word travels with its call number, so there
 *          is no separate signal and no begin/DONE handshake. Up to
 *          MOELINK_TP_AR_ONESHOT_MAX_BYTES: the GEMM writes the partial into
 *          P, one pass reads every rank's partial and sums them. Larger:
 *          gemm_rs's exchange, then the sum of the own rows is stored
 *          locally and pushed into every peer's gather rows (GATHER), and a
 *          last pass copies the peers' rows out.
 *
 * Every call starts by waiting for the peers' DONE of the previous call
 * (tp_cuda.h: the reuse rule) and ends by signalling its own. */
#include "tp/tp.h"

#include "comm/cuda/comm_cuda.h"
#include "cuda/cuda.h"
#include "cuda/gemm/decode.h"
#include "tp/cuda/tp_blas.h"
#include "tp/cuda/tp_cuda.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Largest gemm_ar output (bytes) that takes the low-latency exchange, and
 * the largest that takes the one-shot pull (measured: docs/PERF.md). */
MOELINK_PARAM(TP_AR_LL_MAX_BYTES, 1 << 20)
MOELINK_PARAM(TP_AR_ONESHOT_MAX_BYTES, 4 << 20)
/* Which GEMM the ops run: 0 cuBLASLt with its heuristic's algorithm number
 * MOELINK_TP_LT_ALGO (0: the first), 1 moelink's engines (decode GEMM up to
 * one tile of rows, the tile engines above), 2 cublasGemmEx. cuBLAS was
 * measured faster than the engines on every shape of docs/PERF.md, decode
 * sizes included. Shapes the tensor-core paths refuse always take the
 * fallback. */
MOELINK_PARAM(TP_GEMM, 0)
MOELINK_PARAM(TP_LT_ALGO, 0)

/* 1: the one-shot exchange is launched while the GEMM drains (PDL). */
MOELINK_PARAM(TP_AR_PDL, 1)
/* 1: gemm_ar of at most ML_TPC_FUSED_MAX_M rows (n, k multiples of 64) runs
 * as one kernel with the exchange inside (gemm_ar_fused.cu); 0: the GEMM,
 * then the low-latency all-reduce. */
MOELINK_PARAM(TP_AR_FUSED, 1)
/* 1: gemm_ar of ML_TPC_WIDE_MIN_M .. ML_TPC_WIDE_MAX_M rows (n, k
 * multiples of 128, n / 64 <= SMs) runs as one kernel with the exchange
 * inside (gemm_ar_fused.cu, compute capability 9.0); 0: the GEMM, then the
 * exchange. */
MOELINK_PARAM(TP_AR_WIDE, 1)


typedef struct ml_tpc {
  char *ws;                /* symmetric workspace */
  moelink_symm_view_t view;
  size_t g_off, p_off;     /* offsets of the gather rows and the partials */
  ml_tpc_sync sync;
  void *dev;               /* epoch, ticket (cudaMalloc) */
  float *partials;         /* decode GEMM split-K scratch */
  uint32_t *tickets;
  size_t partial_floats, ticket_count;
  int sms, ctas;
  ml_tpc_blas *blas;       /* cuBLAS(Lt) calls and their workspace */
  cudaStream_t side;
  cudaEvent_t fork, join;
  cudaEvent_t chunk[ML_TPC_MAX_RANKS]; /* a block of the scatter GEMM is done */
  ml_ccu_ll ll;                        /* the one-shot gemm_ar's exchange */
  char *ll_cells;                      /* its symmetric cells */
  void *ll_state;                      /* its call count and ticket */
  char *ll_scratch;                    /* this rank's partial [m, n] */
  size_t ll_bytes;                     /* the largest output it takes */
  ml_tpc_wide wide;                    /* gemm_ar of 65 to 128 rows in one kernel */
  char *wide_symm;                     /* its symmetric flags and data */
} ml_tpc;

static size_t ml_tpc_align(size_t x) { return (x + 255) & ~(size_t)255; }

static void ml_tpc_layout(int nranks, const moelink_tp_config_t *cfg, size_t *g_off,
                          size_t *p_off, size_t *total) {
  const size_t es = moelink_dtype_size(cfg->dtype);
  const size_t gcols = (size_t)(cfg->max_k > cfg->max_n ? cfg->max_k : cfg->max_n);
  const size_t ms = ((size_t)cfg->max_m + (size_t)nranks - 1) / (size_t)nranks;
  *g_off = ML_TPC_FLAG_BYTES;
  *p_off = ml_tpc_align(*g_off + (size_t)cfg->max_m * gcols * es);
  size_t p_bytes = (size_t)nranks * ms * (size_t)cfg->max_n * es;
  const size_t own = (size_t)cfg->max_m * (size_t)cfg->max_n * es; /* one-shot partial */
  if (own > p_bytes) p_bytes = own;
  *total = ml_tpc_align(*p_off + p_bytes);
}

/* Bytes of the largest gemm_ar output the one-shot path takes (a multiple of 4). */
static size_t ml_tpc_ll_bytes(const moelink_tp_config_t *cfg) {
  int64_t lim = ml_param_TP_AR_LL_MAX_BYTES();
  if (lim < 0) lim = 0;
  const size_t most = (size_t)cfg->max_m * (size_t)cfg->max_n * moelink_dtype_size(cfg->dtype);
  const size_t b = (size_t)lim < most ? (size_t)lim : most;
  return (b + 3) & ~(size_t)3;
}

/* Whether the comm's device runs sm_90a machine code. */
static moelink_status_t ml_tpc_is_sm90(moelink_comm_t comm, int *yes) {
  int prev, sms = 0;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev, ml_cuda_sm90_device(yes, &sms));
}

/* The limits of the one-kernel gemm_ar of up to ML_TPC_WIDE_MAX_M rows:
 * zero slot bytes when it cannot run (one rank, no low-latency state, rows
 * that the smaller kernel takes, columns fewer than its 128, a device other
 * than compute capability 9.0). */
static moelink_status_t ml_tpc_wide_limits(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                           size_t *slot, int *blocks) {
  *slot = 0;
  *blocks = cfg->max_n / 64;
  if (comm->nranks < 2 || ml_tpc_ll_bytes(cfg) == 0 || cfg->max_m < ML_TPC_WIDE_MIN_M ||
      cfg->max_n < 128)
    return MOELINK_SUCCESS;
  int sm90 = 0;
  ML_TRY(ml_tpc_is_sm90(comm, &sm90));
  if (!sm90) return MOELINK_SUCCESS;
  const int rows = cfg->max_m < ML_TPC_WIDE_MAX_M ? cfg->max_m : ML_TPC_WIDE_MAX_M;
  *slot = (size_t)rows * (size_t)cfg->max_n * moelink_dtype_size(cfg->dtype);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_tpc_workspace_size(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                              size_t *bytes) {
  size_t g, p;
  ml_tpc_layout(comm->nranks, cfg, &g, &p, bytes);
  const size_t ll = ml_tpc_ll_bytes(cfg);
  if (comm->nranks > 1 && ll > 0) *bytes += ML_CCU_LL_BYTES(comm->nranks, ll / 4) + ll;
  size_t slot;
  int blocks;
  ML_TRY(ml_tpc_wide_limits(comm, cfg, &slot, &blocks));
  if (slot > 0) *bytes += ml_tpc_wide_symm_bytes(comm->nranks, slot, blocks);
  return MOELINK_SUCCESS;
}

/* MiB of cuBLAS(Lt) workspace (the heuristic chooses among algorithms that
 * fit it). */
MOELINK_PARAM(TP_LT_WS_MIB, 32)

static void ml_tpc_release(moelink_tp_t tp, ml_tpc *t) {
  ml_tpc_blas_destroy(t->blas);
  if (t->side) cudaStreamDestroy(t->side);
  if (t->fork) cudaEventDestroy(t->fork);
  if (t->join) cudaEventDestroy(t->join);
  for (int i = 0; i < ML_TPC_MAX_RANKS; ++i)
    if (t->chunk[i]) cudaEventDestroy(t->chunk[i]);
  if (t->dev) cudaFree(t->dev);
  if (t->partials) cudaFree(t->partials);
  if (t->tickets) cudaFree(t->tickets);
  if (t->ll_state) cudaFree(t->ll_state);
  if (t->ll_scratch) cudaFree(t->ll_scratch);
  if (t->ll_cells) moelink_symm_free(tp->comm, t->ll_cells);
  if (t->wide.pair) cudaFree(t->wide.pair);
  if (t->wide.pair_flags) cudaFree(t->wide.pair_flags);
  if (t->wide_symm) moelink_symm_free(tp->comm, t->wide_symm);
  if (t->ws) moelink_symm_free(tp->comm, t->ws);
  free(t);
}

static moelink_status_t ml_tpc_init_inner(moelink_tp_t tp, ml_tpc *t) {
  moelink_comm_t comm = tp->comm;
  const moelink_tp_config_t *cfg = &tp->cfg;
  if (cfg->dtype != MOELINK_DTYPE_BF16 && cfg->dtype != MOELINK_DTYPE_F16)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "tp_create: dtype %s is not supported on the cuda backend (bf16, f16)",
                   moelink_dtype_name(cfg->dtype));
  if (comm->nranks > ML_TPC_MAX_RANKS)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "tp_create: %d ranks (the cuda ops take at most %d)",
                   comm->nranks, ML_TPC_MAX_RANKS);
  int dev = 0;
  ML_CUDA_TRY(cudaGetDevice(&dev));
  ML_CUDA_TRY(cudaDeviceGetAttribute(&t->sms, cudaDevAttrMultiProcessorCount, dev));
  t->ctas = cfg->comm_ctas > 0 ? cfg->comm_ctas : t->sms;
  tp->cfg.comm_ctas = t->ctas;

  size_t total;
  ml_tpc_layout(comm->nranks, cfg, &t->g_off, &t->p_off, &total);
  ML_TRY(moelink_symm_alloc(comm, total, (void **)&t->ws));
  ML_TRY(moelink_symm_view(comm, t->ws, &t->view));
  ML_TRY(moelink_comm_device(comm, &t->sync.dc));
  for (int r = 0; r < comm->nranks; ++r) t->sync.flags[r] = (uint64_t *)t->view.base[r];

  ML_CUDA_TRY(cudaMalloc(&t->dev, 256));
  ML_CUDA_TRY(cudaMemset(t->dev, 0, 256));
  t->sync.epoch = (uint64_t *)t->dev;
  t->sync.ticket = (unsigned *)((char *)t->dev + 64);

  t->ll_bytes = comm->nranks > 1 ? ml_tpc_ll_bytes(cfg) : 0;
  if (t->ll_bytes > 0) {
    const size_t words = t->ll_bytes / 4;
    ML_TRY(moelink_symm_alloc(comm, ML_CCU_LL_BYTES(comm->nranks, words), (void **)&t->ll_cells));
    moelink_symm_view_t v;
    ML_TRY(moelink_symm_view(comm, t->ll_cells, &v));
    for (int r = 0; r < comm->nranks; ++r) t->ll.cells[r] = (uint64_t *)v.base[r];
    ML_CUDA_TRY(cudaMalloc(&t->ll_state, 64));
    ML_CUDA_TRY(cudaMemset(t->ll_state, 0, 64));
    t->ll.epoch = (uint64_t *)t->ll_state;
    t->ll.ticket = (unsigned *)((char *)t->ll_state + 32);
    t->ll.max_words = words;
    /* Nothing to overlap with: the exchange may take every SM it can use,
     * and it is launched while the GEMM drains. */
    t->ll.max_ctas = t->ctas;
    t->ll.pdl = ml_param_TP_AR_PDL() != 0;
    ML_CUDA_TRY(cudaMalloc((void **)&t->ll_scratch, t->ll_bytes));
  }
  size_t wslot;
  int wblocks;
  ML_TRY(ml_tpc_wide_limits(comm, cfg, &wslot, &wblocks));
  if (t->ll_bytes > 0) ML_TRY(ml_tpc_fused_prepare(wslot > 0));
  if (wslot > 0) {
    ML_TRY(moelink_symm_alloc(comm, ml_tpc_wide_symm_bytes(comm->nranks, wslot, wblocks),
                              (void **)&t->wide_symm));
    moelink_symm_view_t v;
    ML_TRY(moelink_symm_view(comm, t->wide_symm, &v));
    for (int r = 0; r < comm->nranks; ++r) t->wide.base[r] = v.base[r];
    t->wide.slot_bytes = wslot;
    t->wide.max_blocks = wblocks;
    t->wide.ctas = t->sms;
    ML_CUDA_TRY(cudaMalloc((void **)&t->wide.pair_flags, (size_t)t->sms * sizeof(uint64_t)));
    ML_CUDA_TRY(cudaMemset(t->wide.pair_flags, 0, (size_t)t->sms * sizeof(uint64_t)));
    ML_CUDA_TRY(cudaMalloc((void **)&t->wide.pair, (size_t)t->sms * 64 * 128 * sizeof(float)));
  }
  /* Split-K scratch of the decode GEMM for every n it may see (rows <= one
   * pass; k up to max_k only lowers the split count); only when it may run. */
  for (int n = 8; ml_param_TP_GEMM() == 1 && n <= cfg->max_n; n += 8) {
    size_t f = 0, c = 0;
    ml_cuda_decode_scratch(ML_CUDA_TILE_ROWS, 1, 1, n, cfg->max_k, 0, t->sms, &f, &c);
    if (f > t->partial_floats) t->partial_floats = f;
    if (c > t->ticket_count) t->ticket_count = c;
  }
  if (t->partial_floats > 0) {
    ML_CUDA_TRY(cudaMalloc((void **)&t->partials, t->partial_floats * sizeof(float)));
    ML_CUDA_TRY(cudaMalloc((void **)&t->tickets, t->ticket_count * sizeof(uint32_t)));
    ML_CUDA_TRY(cudaMemset(t->tickets, 0, t->ticket_count * sizeof(uint32_t)));
  }
  int64_t ws_mib = ml_param_TP_LT_WS_MIB();
  if (ws_mib < 1) ws_mib = 1;
  if (ws_mib > 1024) ws_mib = 1024;
  ML_TRY(ml_tpc_blas_create(&t->blas, (size_t)ws_mib << 20,
                            ml_param_TP_GEMM() == 2 ? ML_TPC_BLAS_GEMMEX : ML_TPC_BLAS_LT,
                            (int)ml_param_TP_LT_ALGO()));
  ML_CUDA_TRY(cudaStreamCreateWithFlags(&t->side, cudaStreamNonBlocking));
  ML_CUDA_TRY(cudaEventCreateWithFlags(&t->fork, cudaEventDisableTiming));
  ML_CUDA_TRY(cudaEventCreateWithFlags(&t->join, cudaEventDisableTiming));
  for (int i = 0; i < ML_TPC_MAX_RANKS; ++i)
    ML_CUDA_TRY(cudaEventCreateWithFlags(&t->chunk[i], cudaEventDisableTiming));
  /* The symmetric buffer comes back zeroed (flags at 0 = nothing signalled):
   * make sure that memset is done before a peer's first signal can land. */
  ML_CUDA_TRY(cudaDeviceSynchronize());
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_tpc_init(moelink_tp_t tp) {
  int prev;
  ML_TRY(ml_cuda_enter(tp->comm->ctx, &prev));
  ml_tpc *t = (ml_tpc *)calloc(1, sizeof *t);
  moelink_status_t s = t ? ml_tpc_init_inner(tp, t)
                         : ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "tp_create: out of host memory");
  if (s == MOELINK_SUCCESS) {
    tp->impl = t;
  } else if (t) {
    ml_saved_error e; /* the cleanup's public calls clear the message */
    ml_error_save(&e);
    ml_tpc_release(tp, t);
    s = ml_error_restore(&e, s);
  }
  return ml_cuda_leave(tp->comm->ctx, prev, s);
}

static void ml_tpc_fini(moelink_tp_t tp) {
  int prev;
  if (ml_cuda_enter(tp->comm->ctx, &prev) != MOELINK_SUCCESS) return;
  ml_tpc *t = (ml_tpc *)tp->impl;
  if (t) {
    cudaDeviceSynchronize();
    ml_tpc_release(tp, t);
  }
  tp->impl = NULL;
  ml_cuda_leave(tp->comm->ctx, prev, MOELINK_SUCCESS);
}

/* out [rows, n] = a [rows, k] b^T on the engine that suits the shape. */
static moelink_status_t ml_tpc_gemm(const ml_tpc *t, moelink_dtype_t dt, const void *a,
                                    const void *b, void *out, int rows, int n, int k,
                                    cudaStream_t st) {
  if (rows <= 0) return MOELINK_SUCCESS;
  if (n % 8 || k % 8 || (((uintptr_t)a | (uintptr_t)b | (uintptr_t)out) & 15))
    return ml_tpc_gemm_simple(dt, a, b, out, rows, n, k, st);
  if (ml_param_TP_GEMM() != 1) return ml_tpc_blas_gemm(t->blas, dt, a, b, out, rows, n, k, st);
  if (t->partials && ml_cuda_decode_wanted(rows, 1, 0)) {
    ml_decode_opts o;
    memset(&o, 0, sizeof o);
    o.sm_count = t->sms;
    o.partials = t->partials;
    o.partial_floats = t->partial_floats;
    o.tickets = t->tickets;
    o.ticket_count = t->ticket_count;
    return ml_cuda_decode_scaled(dt, a, k, b, n, k, NULL, NULL, 1, rows, NULL, NULL, out, 0, &o,
                                 st);
  }
  return ml_cuda_gemm_scaled(dt, a, k, b, n, k, NULL, NULL, 0, rows, NULL, NULL, out, 0, NULL, st);
}

static ml_tpc_pass ml_tpc_pass_none(void) {
  ml_tpc_pass p;
  memset(&p, 0, sizeof p);
  p.signal_kind = p.wait_kind = p.end_kind = -1;
  return p;
}

static moelink_status_t ml_tpc_ag(moelink_tp_t tp, ml_tpc *t, const char *a, const char *b,
                                  char *c, int m, int n, int k, cudaStream_t st) {
  const int nr = tp->comm->nranks, me = tp->comm->rank;
  const moelink_dtype_t dt = tp->cfg.dtype;
  const size_t es = moelink_dtype_size(dt);
  const int ms = m / nr;
  const size_t shard = (size_t)ms * (size_t)k * es;
  ML_TRY(ml_tpc_begin(&t->sync, st));
  ML_CUDA_TRY(cudaEventRecord(t->fork, st));
  ML_CUDA_TRY(cudaStreamWaitEvent(t->side, t->fork, 0));
  for (int i = 1; i < nr; ++i) {
    const int p = (me + i) % nr;
    char *dst = t->view.base[p] + t->g_off + (size_t)me * shard;
    ML_CUDA_TRY(cudaMemcpyAsync(dst, a, shard, cudaMemcpyDeviceToDevice, t->side));
  }
  ML_TRY(ml_tpc_signal(&t->sync, ML_TPC_READY, t->side));
  ML_CUDA_TRY(cudaEventRecord(t->join, t->side));

  ML_TRY(ml_tpc_gemm(t, dt, a, b, c + (size_t)me * ms * n * es, ms, n, k, st));
  for (int i = 1; i < nr; ++i) {
    const int p = (me + i) % nr;
    /* One wait for all peers: their shards left at the same time. */
    if (i == 1) ML_TRY(ml_tpc_wait(&t->sync, ML_TPC_READY, st));
    ML_TRY(ml_tpc_gemm(t, dt, t->ws + t->g_off + (size_t)p * shard, b,
                       c + (size_t)p * ms * n * es, ms, n, k, st));
  }
  ML_CUDA_TRY(cudaStreamWaitEvent(st, t->join, 0));
  return ml_tpc_signal(&t->sync, ML_TPC_DONE, st);
}

/* The exchange of gemm_rs and the large gemm_ar: rows [r0(d), r0(d+1)) of
 * the product belong to rank d's slot `me` (slots of ms_max rows). The
 * peers' blocks are computed first, each into this rank's own gather rows,
 * and the copy engine moves each to its owner (side stream) while the next
 * block computes; READY follows the last copy. The own block goes straight
 * into the own slot; the stream then joins the side stream.
 * The gather rows are free for this: peers write into them (gemm_ar's
 * gathered result) only after this rank's READY, when its copies are done. */
static moelink_status_t ml_tpc_scatter_gemm(moelink_tp_t tp, ml_tpc *t, const char *a,
                                            const char *b, int m, int n, int k, int ms_max,
                                            cudaStream_t st) {
  const int nr = tp->comm->nranks, me = tp->comm->rank;
  const moelink_dtype_t dt = tp->cfg.dtype;
  const size_t es = moelink_dtype_size(dt);
  const size_t slot = (size_t)ms_max * (size_t)n * es;
  for (int i = 1; i < nr; ++i) {
    const int d = (me + i) % nr;
    const int r0 = (int)((int64_t)m * d / nr), r1 = (int)((int64_t)m * (d + 1) / nr);
    char *stage = t->ws + t->g_off + (size_t)r0 * n * es;
    ML_TRY(ml_tpc_gemm(t, dt, a + (size_t)r0 * k * es, b, stage, r1 - r0, n, k, st));
    ML_CUDA_TRY(cudaEventRecord(t->chunk[i], st));
    ML_CUDA_TRY(cudaStreamWaitEvent(t->side, t->chunk[i], 0));
    ML_CUDA_TRY(cudaMemcpyAsync(t->view.base[d] + t->p_off + (size_t)me * slot, stage,
                                (size_t)(r1 - r0) * n * es, cudaMemcpyDeviceToDevice, t->side));
  }
  ML_TRY(ml_tpc_signal(&t->sync, ML_TPC_READY, t->side));
  ML_CUDA_TRY(cudaEventRecord(t->join, t->side));
  const int r0 = (int)((int64_t)m * me / nr), r1 = (int)((int64_t)m * (me + 1) / nr);
  ML_TRY(ml_tpc_gemm(t, dt, a + (size_t)r0 * k * es, b, t->ws + t->p_off + (size_t)me * slot,
                     r1 - r0, n, k, st));
  ML_CUDA_TRY(cudaStreamWaitEvent(st, t->join, 0));
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_tpc_rs(moelink_tp_t tp, ml_tpc *t, const char *a, const char *b,
                                  char *c, int m, int n, int k, cudaStream_t st) {
  const int nr = tp->comm->nranks;
  const size_t es = moelink_dtype_size(tp->cfg.dtype);
  const int ms = m / nr;
  ML_TRY(ml_tpc_begin(&t->sync, st));
  ML_TRY(ml_tpc_scatter_gemm(tp, t, a, b, m, n, k, ms, st));
  ml_tpc_pass p = ml_tpc_pass_none();
  for (int q = 0; q < nr; ++q) p.src[q] = t->ws + t->p_off + (size_t)q * ms * n * es;
  p.nsrc = nr;
  p.out = c;
  p.count = (size_t)ms * (size_t)n;
  p.wait_kind = ML_TPC_READY;
  p.end_kind = ML_TPC_DONE;
  return ml_tpc_run_pass(&t->sync, tp->cfg.dtype, &p, t->ctas, st);
}

/* The one-shot gemm_ar: the partial goes to local scratch, the low-latency
 * all-reduce sums it into c. (Splitting N into column blocks whose exchange
 * overlaps the next block's GEMM measured slower with cuBLAS: docs/PERF.md.) */
static moelink_status_t ml_tpc_ar_oneshot(moelink_tp_t tp, ml_tpc *t, const char *a,
                                          const char *b, char *c, int m, int n, int k,
                                          cudaStream_t st) {
  const moelink_comm_t comm = tp->comm;
  ML_TRY(ml_tpc_gemm(t, tp->cfg.dtype, a, b, t->ll_scratch, m, n, k, st));
  return ml_ccu_allreduce_ll(&t->ll, comm->rank, comm->nranks, &t->sync.dc, t->ll_scratch, c,
                             (size_t)m * (size_t)n, tp->cfg.dtype, st);
}

static moelink_status_t ml_tpc_ar(moelink_tp_t tp, ml_tpc *t, const char *a, const char *b,
                                  char *c, int m, int n, int k, cudaStream_t st) {
  const int nr = tp->comm->nranks, me = tp->comm->rank;
  const moelink_dtype_t dt = tp->cfg.dtype;
  const size_t es = moelink_dtype_size(dt);
  const size_t bytes = (size_t)m * (size_t)n * es;
  if (t->ll_bytes > 0 && ml_param_TP_AR_FUSED() != 0 &&
      ml_tpc_fused_ar_takes(dt, a, b, c, m, n, k, t->ll.max_words, t->sms))
    return ml_tpc_fused_ar(&t->ll, &t->sync.dc, dt, a, b, c, m, n, k, t->sms, st);
  if (t->ll_bytes > 0 && ml_param_TP_AR_WIDE() != 0 && m >= ML_TPC_WIDE_MIN_M &&
      ml_tpc_wide_ar_takes(&t->wide, dt, a, b, c, m, n, k))
    return ml_tpc_wide_ar(&t->wide, &t->ll, &t->sync.dc, dt, a, b, c, m, n, k, st);
  if (bytes <= t->ll_bytes) return ml_tpc_ar_oneshot(tp, t, a, b, c, m, n, k, st);
  ML_TRY(ml_tpc_begin(&t->sync, st));
  ml_tpc_pass p = ml_tpc_pass_none();
  if (bytes <= (size_t)ml_param_TP_AR_ONESHOT_MAX_BYTES()) {
    /* Every rank reads every rank's partial (P, this call's [m, n]). */
    ML_TRY(ml_tpc_gemm(t, dt, a, b, t->ws + t->p_off, m, n, k, st));
    for (int q = 0; q < nr; ++q) p.src[q] = t->view.base[q] + t->p_off;
    p.nsrc = nr;
    p.out = c;
    p.count = (size_t)m * (size_t)n;
    p.signal_kind = ML_TPC_READY;
    p.wait_kind = ML_TPC_READY;
    p.end_kind = ML_TPC_DONE;
    return ml_tpc_run_pass(&t->sync, dt, &p, t->ctas, st);
  }
  const int ms_max = (m + nr - 1) / nr;
  ML_TRY(ml_tpc_scatter_gemm(tp, t, a, b, m, n, k, ms_max, st));
  const size_t slot = (size_t)ms_max * (size_t)n * es;
  const int r0 = (int)((int64_t)m * me / nr), r1 = (int)((int64_t)m * (me + 1) / nr);
  const size_t row0 = (size_t)r0 * (size_t)n * es;
  for (int q = 0; q < nr; ++q) p.src[q] = t->ws + t->p_off + (size_t)q * slot;
  p.nsrc = nr;
  p.out = c + row0;
  for (int q = 0; q < nr; ++q)
    if (q != me) p.push[q] = t->view.base[q] + t->g_off + row0;
  p.count = (size_t)(r1 - r0) * (size_t)n;
  p.wait_kind = ML_TPC_READY;
  p.end_kind = ML_TPC_GATHER;
  ML_TRY(ml_tpc_run_pass(&t->sync, dt, &p, t->ctas, st));
  /* The peers' rows, gathered here; the last copy tells them this call is over. */
  int first = 1, copies = nr - 1;
  for (int q = 0; q < nr; ++q) {
    if (q == me) continue;
    const size_t q0 = (size_t)((int64_t)m * q / nr), q1 = (size_t)((int64_t)m * (q + 1) / nr);
    ml_tpc_pass g = ml_tpc_pass_none();
    g.src[0] = t->ws + t->g_off + q0 * (size_t)n * es;
    g.nsrc = 1;
    g.out = c + q0 * (size_t)n * es;
    g.count = (q1 - q0) * (size_t)n;
    g.wait_kind = first ? ML_TPC_GATHER : -1;
    g.end_kind = --copies == 0 ? ML_TPC_DONE : -1;
    first = 0;
    ML_TRY(ml_tpc_run_pass(&t->sync, dt, &g, t->ctas, st));
  }
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_tpc_run_inner(moelink_tp_t tp, ml_tp_op op, const void *a,
                                         const void *b, void *c, int m, int n, int k,
                                         cudaStream_t st) {
  ml_tpc *t = (ml_tpc *)tp->impl;
  if (tp->comm->nranks == 1) /* one partial, nothing to exchange: the GEMM is the op */
    return ml_tpc_gemm(t, tp->cfg.dtype, a, b, c, m, n, k, st);
  switch (op) {
  case ML_TP_AG_GEMM: return ml_tpc_ag(tp, t, a, b, c, m, n, k, st);
  case ML_TP_GEMM_RS: return ml_tpc_rs(tp, t, a, b, c, m, n, k, st);
  case ML_TP_GEMM_AR: return ml_tpc_ar(tp, t, a, b, c, m, n, k, st);
  }
  return ml_fail(MOELINK_ERR_INTERNAL, "tp: unknown op %d", (int)op);
}

static moelink_status_t ml_tpc_run(moelink_tp_t tp, ml_tp_op op, const void *a, const void *b,
                                   void *c, int m, int n, int k, void *stream) {
  int prev;
  ML_TRY(ml_cuda_enter(tp->comm->ctx, &prev));
  moelink_status_t s = ml_tpc_run_inner(tp, op, a, b, c, m, n, k, (cudaStream_t)stream);
  return ml_cuda_leave(tp->comm->ctx, prev, s);
}

static const ml_tp_ops ml_tpc_ops = {"cuda", ml_tpc_workspace_size, ml_tpc_init, ml_tpc_fini,
                                     ml_tpc_run};

const ml_tp_ops *ml_tp_cuda_ops(void) { return &ml_tpc_ops; }
