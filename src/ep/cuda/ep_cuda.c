/* The expert-parallel layer on CUDA ranks (one GPU each, all in one NVLink
 * domain): one stream-ordered sequence of launches per forward, no host
 * synchronization, capturable in a CUDA graph (but rounds mode, below).
 *
 * Each rank holds one CUDA layer of its own, `local`: its El = E / n experts
 * with top_k kl = min(k, El) and max_tokens = cap received rows (n *
 * max_tokens, or in rounds mode, below, recv_capacity), run on
 * the rows it receives. Routing calls the CUDA backend's router kernel
 * directly (a whole layer's workspace would be mostly expert buffers it never
 * uses: ~0.7 GB per rank for deepseek-v3 at max_tokens 4096). And one
 * symmetric buffer, laid out the same on every rank:
 *   arrive[n]        8-byte cells: arrive[s] = call: s's rows of the call are in
 *   return[n]        return[d] = call: d has pushed back its outputs of the call
 *   meta[cap][2+3k]  per received row: source * max_tokens + token, call (low
 *                    32 bits), the k expert ids as local ids (-1: another
 *                    rank's or, in rounds mode, another round's), the k
 *                    routing weights (fp32 bits), then (rounds mode) each
 *                    pair's place in the receiver's pair order
 *   rows[cap][H]     received token rows; token t of source s lands in row
 *                    s * max_tokens + t (rounds mode: below) (rows of tokens
 *                    not sent keep an older call in their meta)
 *   ret[max_tokens * k][H]  the output of slot j of token t (already times its
 *                    routing weight, rounded to the dtype) at row t*k + j,
 *                    written by the rank that owns that expert
 *   qrows[cap][qrow] with dispatch_quant only: the rows as they travel (H e4m3
 *                    bytes, then the scales), turned back into `rows` by
 *                    the receive kernel
 *   csig[n], cnt[2][n][E]  rounds mode only: csig[s] = step: s's pair counts
 *                    per expert of the step are in cnt[step & 1][s]
 *
 * A forward runs ceil(call_tokens / max_tokens) steps, every rank the same
 * (a rank out of tokens takes part with none); a step (T <= max_tokens
 * tokens on this rank; the call number counts steps, in device memory):
 *  1. route (the router kernel, on this rank's scratch);
 *  2. push each token's row and meta into every rank that owns one of its
 *     experts (once per rank); the last CTA signals each destination ARRIVE;
 *  3. wait for every source's ARRIVE; lay the received rows' local experts out
 *     as a [cap, kl] id list (-1 for rows without a token of this call and
 *     for empty slots);
 *  4. plan + expert GEMMs of the local layer on the cap rows (empty ones cost
 *     nothing: the plan drops them); the down GEMM's epilogue stores each
 *     (row, slot) output straight into its source's ret at (token, slot)
 *     (the receive kernel wrote each pair's address, dst), so the return
 *     traffic runs under the GEMM (from MOELINK_EP_FUSED_RETURN tokens on
 *     this rank, default 512; fewer, or 0: the outputs go to y and step 5
 *     pushes them);
 *  5. (unfused) push each (row, slot) output into its source's ret at
 *     (token, slot); the last CTA signals every source RETURN and waits for
 *     every rank's;
 *  6. (this rank's shared expert ran during 2-3) combine out[t] = sum_j
 *     ret[t*k + j] in slot order (+ gated shared expert), fp32, one
 *     rounding: the single-GPU layer's combine kernel.
 * moelink_ep_dispatch is steps 1 (from the caller's routing) to 3, with the
 * received rows left in `rows` and their local ids and weights in the
 * scratch; moelink_ep_combine is steps 5 (unfused) and 6 without the shared
 * expert, on the caller's expert outputs. An id outside [0, E) is an empty
 * slot: not sent, and (slot_rows -1) not added.
 *
 * Rounds mode (recv_capacity below n * max_tokens; R rows a round): after
 * step 1 every rank counts its pairs (token, slot) per expert, giving each
 * its place among its expert's pairs in pair order, and stores the counts
 * into every rank's cnt; one kernel then waits for all counts and orders each
 * rank d's incoming pairs by (d's local expert, source, place): pair p of
 * that order moves in round p / R, its token's row at p % R (the row of its
 * first pair in the round: pairs, hence rows, never share a place). The host
 * reads the rounds, max over d of ceil(pairs / R), the same on every rank
 * (one stream synchronization a step), then runs steps 2-5 once per round,
 * each round a call of the protocol below with only that round's pairs in
 * the meta, and step 6 once. Each pair's output lands in its own ret row in
 * exactly one round, so the sums and their order do not change. With P pipes
 * (MOELINK_EP_ROUND_PIPES, default 2) R is recv_capacity / P: pipe p owns
 * rows [p R, (p + 1) R) of the receive arrays, signal cells, call count,
 * plan, outputs and local layer of its own, and runs rounds r = p mod P on a
 * stream of its own (pipes >= 1 on internal ones, forked from and joined
 * into the caller's), each pipe its own sequence of calls. A dispatch uses
 * the whole buffer as one round.
 *
 * Reuse is safe without further handshakes: a source writes a destination's
 * rows, meta and ARRIVE cell for call c + 1 only after it saw that
 * destination's RETURN of call c, which the destination sends after it has
 * read them; a destination writes a source's ret for call c + 1 only after
 * that source's rows of call c + 1 arrived, which it sends after its combine
 * of call c. In rounds mode a rank writes the counts of step i + 2 into the
 * cnt that held step i's only after its schedule kernel of step i + 1 saw
 * every rank's counts of step i + 1, which each rank sends after it read
 * step i's (hence two cnt by parity). Every wait gives up after
 * MOELINK_COMM_TIMEOUT_MS.
 *
 * Memory: the local layer's workspace, the symmetric buffer and the scratch
 * below, all from the config (cap rows: n * max_tokens fits every source's
 * whole step, whatever the routing; a smaller recv_capacity takes rounds,
 * more of them under skew, never more memory). */
#include "ep/ep.h"

#include "comm/cuda/comm_cuda.h"
#include "cuda/cuda.h"
#include "cuda/pipeline.h"
#include "ep/cuda/ep_cuda.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct ml_epc {
  moelink_moe_t local;  /* the experts of pipe 0 (the only one outside rounds mode) */
  moelink_moe_t plocal[ML_EPC_PIPES]; /* rounds mode: pipe p >= 1's experts ([0] unused) */
  ml_epc_args a;        /* the whole receive buffer (cap rows): one round a step, dispatch */
  ml_epc_args pipe[ML_EPC_PIPES]; /* rounds mode: pipe p's view, rows [p * cap / pipes, ...) */
  int pipes;                      /* rounds mode: rounds in flight at once, each pipe on a stream */
  cudaStream_t ps[ML_EPC_PIPES];  /* pipe p >= 1's stream (pipe 0: the caller's) */
  cudaEvent_t fork, pjoin[ML_EPC_PIPES];
  /* pipe p >= 1's plan, expert outputs, call count, ticket, pair count and signal cells */
  void *pplan[ML_EPC_PIPES], *py[ML_EPC_PIPES];
  uint64_t *pepoch[ML_EPC_PIPES];
  unsigned *pticket[ML_EPC_PIPES];
  int32_t *pnpairs[ML_EPC_PIPES];
  size_t parrive[ML_EPC_PIPES], preturn[ML_EPC_PIPES];
  char *symm;           /* this rank's symmetric buffer */
  char *dev;            /* one cudaMalloc for the scratch below */
  int32_t *ids;         /* [max_tokens * k] */
  float *wts;           /* [max_tokens * k] */
  void *plan;           /* the local layer's plan for its rows (pipe 0's in rounds mode) */
  void *y;              /* [rows * kl][H] expert outputs, permuted (pipe 0's) */
  void *sh_h;           /* [max_tokens][Is] */
  float *sh_out;        /* [max_tokens][H] */
  float *r_partials;    /* the router's split-K partial logits */
  int32_t *r_tickets;   /* ml_cuda_router_tickets(sms), zero between router launches */
  int32_t *sched;       /* the shared expert's GEMM work counter, zero between launches */
  float *logits;        /* [max_tokens][E] router logits of large batches, or NULL */
} ml_epc;

static size_t ml_epc_up(size_t v) { return (v + 255) & ~(size_t)255; }

/* See docs/ENV.md. */
MOELINK_PARAM(EP_LL, 1)
MOELINK_PARAM(EP_FUSED_RETURN, 512)
MOELINK_PARAM(EP_ROUND_PIPES, 2)

/* Received rows a step, whether it takes rounds (recv_capacity below the
 * whole step's n * max_tokens rows) and in how many pipes: rounds of cap /
 * pipes rows, MOELINK_EP_ROUND_PIPES (1 to ML_EPC_PIPES, at most one a row)
 * of them in flight. */
static int ml_epc_cap(const moelink_ep_config_t *cfg, int n, int *rounds, int *pipes) {
  const int64_t whole = (int64_t)n * cfg->moe.max_tokens;
  *rounds = cfg->recv_capacity < whole;
  long long want = ml_param_EP_ROUND_PIPES();
  want = want < 1 ? 1 : want > ML_EPC_PIPES ? ML_EPC_PIPES : want;
  if (want > cfg->recv_capacity)
    want = cfg->recv_capacity;
  *pipes = *rounds ? (int)want : 1;
  return *rounds ? cfg->recv_capacity : (int)whole;
}

/* The most rounds a step can take: every source's max_tokens tokens with
 * min(k, E / n) experts each on one rank. */
static size_t ml_epc_max_rounds(const moelink_ep_config_t *cfg, int n, int cap) {
  const int El = cfg->moe.num_experts / n;
  const size_t kl = (size_t)(cfg->moe.top_k < El ? cfg->moe.top_k : El);
  const size_t pairs = (size_t)n * (size_t)cfg->moe.max_tokens * kl;
  return (pairs + (size_t)cap - 1) / (size_t)cap;
}

/* Symmetric layout (offsets into a) and its size. */
static size_t ml_epc_symm_layout(const moelink_ep_config_t *cfg, int n, ml_epc_args *a,
                                 size_t *parrive, size_t *preturn) {
  const moelink_moe_config_t *c = &cfg->moe;
  const size_t k = (size_t)c->top_k, H = (size_t)c->hidden, es = moelink_dtype_size(c->dtype);
  int rounds, pipes;
  const size_t cap = (size_t)ml_epc_cap(cfg, n, &rounds, &pipes);
  size_t off = 0;
  a->off_arrive = off;
  off = ml_epc_up(off + (size_t)n * 8);
  a->off_return = off;
  off = ml_epc_up(off + (size_t)n * 8);
  for (int p = 1; p < pipes; ++p) { /* the other pipes' cells */
    parrive[p] = off;
    off = ml_epc_up(off + (size_t)n * 8);
    preturn[p] = off;
    off = ml_epc_up(off + (size_t)n * 8);
  }
  a->off_meta = off;
  off = ml_epc_up(off + cap * ML_EPC_META(k) * 4);
  a->off_rows = off;
  off = ml_epc_up(off + cap * H * es);
  a->off_ret = off;
  off = ml_epc_up(off + (size_t)c->max_tokens * k * H * es);
  a->quant = (int)cfg->dispatch_quant;
  a->sbytes = (int)moelink_quant_scale_bytes(cfg->dispatch_quant, c->hidden);
  a->qrow = a->quant ? (H + (size_t)a->sbytes + 15) & ~(size_t)15 : 0;
  a->off_qrows = off;
  off = ml_epc_up(off + cap * a->qrow);
  a->off_csig = off;
  off = ml_epc_up(off + (rounds ? (size_t)n * 8 : 0));
  a->off_cnt = off;
  off = ml_epc_up(off + (rounds ? 2 * (size_t)n * (size_t)c->num_experts * 4 : 0));
  return off;
}

/* Device scratch layout (base NULL: only sizes it). */
static size_t ml_epc_dev_layout(const moelink_ep_config_t *cfg, int n, ml_epc *w, char *base) {
  const moelink_moe_config_t *c = &cfg->moe;
  int rounds, pipes;
  const int cap_rows = ml_epc_cap(cfg, n, &rounds, &pipes);
  const int rows_p = cap_rows / pipes; /* a pipe's rows: its plan, outputs and layer */
  const moelink_moe_config_t l = ml_ep_local_config(cfg, n, cap_rows);
  const size_t T = (size_t)c->max_tokens, k = (size_t)c->top_k, H = (size_t)c->hidden;
  const size_t cap = (size_t)cap_rows, kl = (size_t)l.top_k, es = moelink_dtype_size(c->dtype);
  const size_t E = (size_t)c->num_experts;
  const size_t Is = (size_t)c->shared_inter;
  size_t off = 0;
#define ML_EPC_TAKE(ptr, type, bytes)                                          \
  do {                                                                         \
    if (base) ptr = (type)(void *)(base + off);                                \
    off = ml_epc_up(off + (size_t)(bytes));                                    \
  } while (0)
  ML_EPC_TAKE(w->a.epoch, uint64_t *, 64);
  ML_EPC_TAKE(w->a.ticket, unsigned *, 64);
  ML_EPC_TAKE(w->a.lids, int32_t *, cap * kl * 4);
  ML_EPC_TAKE(w->a.lwts, float *, cap * kl * 4);
  ML_EPC_TAKE(w->a.plist, int4 *, cap * kl * 16);
  ML_EPC_TAKE(w->a.npairs, int32_t *, 64);
  for (int p = 1; p < pipes; ++p) {
    ML_EPC_TAKE(w->pepoch[p], uint64_t *, 64);
    ML_EPC_TAKE(w->pticket[p], unsigned *, 64);
    ML_EPC_TAKE(w->pnpairs[p], int32_t *, 64);
  }
  ML_EPC_TAKE(w->a.dst, void **, cap * kl * sizeof(void *));
  ML_EPC_TAKE(w->ids, int32_t *, T * k * 4);
  ML_EPC_TAKE(w->wts, float *, T * k * 4);
  ML_EPC_TAKE(w->a.slot_rows, int32_t *, T * k * 4);
  ML_EPC_TAKE(w->a.sepoch, uint64_t *, rounds ? 64 : 0);
  ML_EPC_TAKE(w->a.ord, int32_t *, rounds ? T * k * 4 : 0);
  ML_EPC_TAKE(w->a.offs, int32_t *, rounds ? E * 4 : 0);
  ML_EPC_TAKE(w->a.nrounds, int32_t *, rounds ? 64 : 0);
  const size_t maxr = rounds ? ml_epc_max_rounds(cfg, n, rows_p) : 0;
  ML_EPC_TAKE(w->a.mstart, int32_t *, rounds ? (E + 1) * 4 : 0);
  ML_EPC_TAKE(w->a.slist, int32_t *, rounds ? T * k * 4 : 0);
  ML_EPC_TAKE(w->a.bounds, int32_t *, rounds ? (size_t)n * (maxr + 1) * 4 : 0);
  ML_EPC_TAKE(w->a.lbase, int32_t *, rounds ? ((size_t)l.num_experts + 1) * 4 : 0);
  w->a.maxr = (int)maxr;
  const size_t plan_bytes = moelink_plan_bytes(rows_p, l.top_k, l.num_experts, ML_CUDA_TILE_ROWS);
  ML_EPC_TAKE(w->plan, void *, plan_bytes);
  ML_EPC_TAKE(w->y, void *, (size_t)rows_p *kl *H *es);
  for (int p = 1; p < pipes; ++p) {
    ML_EPC_TAKE(w->pplan[p], void *, plan_bytes);
    ML_EPC_TAKE(w->py[p], void *, (size_t)rows_p *kl *H *es);
  }
  ML_EPC_TAKE(w->sh_h, void *, T * Is * es);
  ML_EPC_TAKE(w->sh_out, float *, Is > 0 ? T * H * 4 : 0);
  ML_EPC_TAKE(w->r_partials, float *,
              ml_cuda_router_partial_floats(c->num_experts, w->a.sms) * sizeof(float));
  ML_EPC_TAKE(w->r_tickets, int32_t *, ml_cuda_router_tickets(w->a.sms) * 4);
  ML_EPC_TAKE(w->sched, int32_t *, ML_CUDA_GEMM_SCHED_INTS * 4);
  const size_t nlogits = ml_cuda_router_logits_floats(c->max_tokens, c->num_experts, c->hidden);
  ML_EPC_TAKE(w->logits, float *, nlogits * 4);
  if (nlogits == 0)
    w->logits = NULL;
#undef ML_EPC_TAKE
  return off;
}

static moelink_status_t ml_epc_check(moelink_comm_t comm, const moelink_ep_config_t *cfg) {
  const moelink_moe_config_t *c = &cfg->moe;
  if (comm->nranks > ML_EPC_MAX_RANKS)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "ep (cuda): %d ranks (at most %d, one NVLink domain)",
                   comm->nranks, ML_EPC_MAX_RANKS);
  if ((int64_t)comm->nranks * c->max_tokens * c->top_k > INT32_MAX / 4)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "ep (cuda): %d ranks x max_tokens %d x top_k %d received pairs is too many",
                   comm->nranks, c->max_tokens, c->top_k);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_epc_sms(moelink_comm_t comm, int *sms) {
  if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, comm->ctx->device) !=
      cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "ep (cuda): cannot read device %d's SM count",
                   comm->ctx->device);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_epc_size(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                    size_t *bytes) {
  ML_TRY(ml_epc_check(comm, cfg));
  ml_epc w;
  memset(&w, 0, sizeof w);
  ML_TRY(ml_epc_sms(comm, &w.a.sms));
  size_t a = 0, b = 0;
  int rounds, pipes;
  const int cap = ml_epc_cap(cfg, comm->nranks, &rounds, &pipes);
  const moelink_moe_config_t lc = ml_ep_local_config(cfg, comm->nranks, cap / pipes);
  /* The whole layer's size is asked only for the CUDA backend's checks of
   * the config (E, k, sizes, the router's shared memory); nothing of it is
   * allocated. */
  ML_TRY(moelink_moe_workspace_size(comm->ctx, &cfg->moe, &a));
  ML_TRY(moelink_moe_workspace_size(comm->ctx, &lc, &b));
  size_t pa[ML_EPC_PIPES], pr[ML_EPC_PIPES];
  *bytes = b * (size_t)pipes + ml_epc_symm_layout(cfg, comm->nranks, &w.a, pa, pr) +
           ml_epc_dev_layout(cfg, comm->nranks, &w, NULL);
  return MOELINK_SUCCESS;
}

static void ml_epc_fini(moelink_ep_t ep) {
  ml_epc *w = (ml_epc *)ep->impl;
  if (!w) return;
  int prev;
  if (ml_cuda_enter(ep->comm->ctx, &prev) == MOELINK_SUCCESS) {
    (void)cudaDeviceSynchronize();
    if (w->dev) (void)cudaFree(w->dev);
    for (int p = 1; p < ML_EPC_PIPES; ++p) {
      if (w->ps[p])
        (void)cudaStreamDestroy(w->ps[p]);
      if (w->pjoin[p])
        (void)cudaEventDestroy(w->pjoin[p]);
    }
    if (w->fork)
      (void)cudaEventDestroy(w->fork);
    (void)ml_cuda_leave(ep->comm->ctx, prev, MOELINK_SUCCESS);
  }
  if (w->symm) (void)moelink_symm_free(ep->comm, w->symm);
  moelink_moe_destroy(w->local);
  for (int p = 1; p < ML_EPC_PIPES; ++p)
    moelink_moe_destroy(w->plocal[p]);
  free(w);
  ep->impl = NULL;
}

/* Every rank compares the hash of its config with the others' (collective):
 * ranks with different configs would mix rows or run different steps. */
static moelink_status_t ml_epc_same_config(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                           int pipes) {
  int same = 0;
  /* the pipes (MOELINK_EP_ROUND_PIPES) lay out the buffers too */
  ML_TRY(ml_comm_cuda_same(comm, ml_ep_config_hash(cfg) ^ (uint64_t)pipes * 0x9e3779b97f4a7c15ull,
                           &same));
  if (!same)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "ep_create: rank %d's config (or MOELINK_EP_ROUND_PIPES) differs from another "
                   "rank's: every rank must pass the same config",
                   comm->rank);
  return MOELINK_SUCCESS;
}

/* Pipe p's local layer, plan and expert outputs (pipe 0: the layer's own). */
static moelink_moe_t ml_epc_local_of(const ml_epc *w, int p) { return p ? w->plocal[p] : w->local; }
static void *ml_epc_plan_of(const ml_epc *w, int p) { return p ? w->pplan[p] : w->plan; }
static void *ml_epc_y_of(const ml_epc *w, int p) { return p ? w->py[p] : w->y; }

/* Rounds mode: each pipe's view of the layer (rows [p * rows, (p + 1) *
 * rows) of every receive array, its own signal cells, counters, plan and
 * outputs), and the streams and events of pipes >= 1. Outside rounds mode
 * the layer runs on w->a alone. */
static moelink_status_t ml_epc_pipes_init(ml_epc *w) {
  const ml_epc_args *a = &w->a;
  const int rows = a->cap / w->pipes;
  for (int p = 0; p < w->pipes; ++p) {
    ml_epc_args *v = &w->pipe[p];
    *v = *a;
    v->cap = rows;
    v->direct_plan = 1;
    const size_t r0 = (size_t)p * (size_t)rows, pairs0 = r0 * (size_t)a->kl;
    v->off_meta += r0 * ML_EPC_META(a->k) * 4;
    v->off_rows += r0 * (size_t)a->H * (size_t)a->es;
    v->off_qrows += r0 * a->qrow;
    v->lids += pairs0;
    v->lwts += pairs0;
    v->plist += pairs0;
    v->dst += pairs0;
    if (p > 0) {
      v->off_arrive = w->parrive[p];
      v->off_return = w->preturn[p];
      v->epoch = w->pepoch[p];
      v->ticket = w->pticket[p];
      v->npairs = w->pnpairs[p];
    }
    moelink_plan_t lp;
    ML_TRY(moelink_plan_view(ml_epc_plan_of(w, p), rows, a->kl, a->El,
                             moelink_moe_tile_rows(ml_epc_local_of(w, p)), &lp));
    v->plan = ml_plan_ptrs_of(&lp);
  }
  if (w->pipes < 2)
    return MOELINK_SUCCESS;
  cudaError_t e = cudaEventCreateWithFlags(&w->fork, cudaEventDisableTiming);
  for (int p = 1; p < w->pipes && e == cudaSuccess; ++p) {
    e = cudaStreamCreateWithFlags(&w->ps[p], cudaStreamNonBlocking);
    if (e == cudaSuccess)
      e = cudaEventCreateWithFlags(&w->pjoin[p], cudaEventDisableTiming);
  }
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "ep (cuda): the round pipes' streams: %s",
                   cudaGetErrorString(e));
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_epc_init_inner(moelink_ep_t ep, ml_epc *w) {
  moelink_comm_t comm = ep->comm;
  const moelink_ep_config_t *cfg = &ep->cfg;
  const moelink_moe_config_t *c = &cfg->moe;
  ML_TRY(ml_epc_check(comm, cfg));
  int rounds, pipes;
  const int cap = ml_epc_cap(cfg, comm->nranks, &rounds, &pipes);
  const moelink_moe_config_t lc = ml_ep_local_config(cfg, comm->nranks, cap / pipes);
  size_t whole = 0; /* the CUDA backend's checks of the whole config (see ml_epc_size) */
  ML_TRY(moelink_moe_workspace_size(comm->ctx, c, &whole));
  ML_TRY(moelink_moe_create(comm->ctx, &lc, &w->local));
  for (int p = 1; p < pipes; ++p)
    ML_TRY(moelink_moe_create(comm->ctx, &lc, &w->plocal[p]));
  w->pipes = pipes;
  ml_epc_args *a = &w->a;
  ML_TRY(moelink_comm_device(comm, &a->dc));
  a->n = comm->nranks;
  a->me = comm->rank;
  a->k = c->top_k;
  a->kl = lc.top_k;
  a->El = ep->local_experts;
  a->H = c->hidden;
  a->es = (int)moelink_dtype_size(c->dtype);
  a->dtype = (int)c->dtype;
  a->max_tokens = c->max_tokens;
  a->E = c->num_experts;
  a->cap = cap;
  a->rounds = rounds;
  ML_TRY(ml_epc_sms(comm, &a->sms));
  {
    int prev, fits = 0;
    ML_TRY(ml_cuda_enter(comm->ctx, &prev));
    ML_TRY(ml_cuda_leave(comm->ctx, prev, ml_epc_ll_ok(&fits)));
    a->ll = fits && !rounds && c->max_tokens <= ML_EPC_LL_MAX_TOKENS && ml_param_EP_LL() != 0;
  }

  const size_t symm_bytes = ml_epc_symm_layout(cfg, comm->nranks, a, w->parrive, w->preturn);
  ML_TRY(moelink_symm_alloc(comm, symm_bytes, (void **)&w->symm));
  moelink_symm_view_t v;
  ML_TRY(moelink_symm_view(comm, w->symm, &v));
  for (int r = 0; r < comm->nranks; ++r) a->base[r] = v.base[r];
  ML_TRY(ml_epc_same_config(comm, cfg, pipes));

  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  const size_t dev_bytes = ml_epc_dev_layout(cfg, comm->nranks, w, NULL);
  cudaError_t e = cudaMalloc((void **)&w->dev, dev_bytes);
  if (e == cudaSuccess) e = cudaMemset(w->dev, 0, dev_bytes);
  moelink_status_t s = MOELINK_SUCCESS;
  if (e != cudaSuccess)
    s = ml_fail(e == cudaErrorMemoryAllocation ? MOELINK_ERR_OUT_OF_MEMORY : MOELINK_ERR_CUDA,
                "ep (cuda): %zu bytes of scratch: %s", dev_bytes, cudaGetErrorString(e));
  if (s == MOELINK_SUCCESS) {
    (void)ml_epc_dev_layout(cfg, comm->nranks, w, w->dev);
    if (rounds)
      s = ml_epc_pipes_init(w);
  }
  if (s == MOELINK_SUCCESS && cudaDeviceSynchronize() != cudaSuccess)
    s = ml_fail(MOELINK_ERR_CUDA, "ep (cuda): setting up the scratch failed");
  return ml_cuda_leave(comm->ctx, prev, s);
}

static moelink_status_t ml_epc_init(moelink_ep_t ep) {
  ml_epc *w = (ml_epc *)calloc(1, sizeof *w);
  if (!w) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "ep (cuda): state allocation failed");
  ep->impl = w;
  moelink_status_t s = ml_epc_init_inner(ep, w);
  if (s != MOELINK_SUCCESS) {
    ml_saved_error e; /* the cleanup's public calls clear the message */
    ml_error_save(&e);
    ml_epc_fini(ep);
    return ml_error_restore(&e, s);
  }
  return s;
}

static moelink_status_t ml_epc_set_weights(moelink_ep_t ep) {
  ml_epc *w = (ml_epc *)ep->impl;
  if (((uintptr_t)ep->w.router) & 15)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "ep_set_weights (cuda): router %p must be 16-byte aligned", ep->w.router);
  ML_TRY(ml_ep_bind_layers(ep, NULL, w->local));
  for (int p = 1; p < w->pipes; ++p)
    ML_TRY(ml_ep_bind_layers(ep, NULL, w->plocal[p]));
  return MOELINK_SUCCESS;
}

/* This rank's shared expert on its T tokens, into sh_out. */
static moelink_status_t ml_epc_shared(moelink_ep_t ep, ml_epc *w, const void *x, int T,
                                      cudaStream_t st) {
  const moelink_moe_config_t *c = &ep->cfg.moe;
  const moelink_moe_weights_t *wt = &ep->w;
  if (T == 0 || c->shared_inter == 0)
    return MOELINK_SUCCESS;
  const ml_cuda_gemm_opts go = ml_cuda_gemm_opts_for(w->sched, T, 1, c->hidden, 0);
  const ml_cuda_gemm_opts dgo = ml_cuda_gemm_opts_for(w->sched, T, 1, c->shared_inter, 0);
  ML_TRY(ml_cuda_gemm_swiglu(c->dtype, x, c->hidden, NULL, 1, wt->shared_gate_up, c->shared_inter,
                             c->hidden, NULL, NULL, 0, T, w->sh_h, &go, st));
  return ml_cuda_gemm_scaled(c->dtype, w->sh_h, c->shared_inter, wt->shared_down, c->hidden,
                             c->shared_inter, NULL, NULL, 0, T, NULL, NULL, w->sh_out, 1, &dgo, st);
}

/* Rounds mode learns each step's rounds on the host: refused while the
 * stream captures, before anything is enqueued. */
static moelink_status_t ml_epc_not_capturing(moelink_ep_t ep, ml_epc *w, cudaStream_t st) {
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (!w->a.rounds)
    return MOELINK_SUCCESS;
  if (cudaStreamIsCapturing(st, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "ep (cuda) on rank %d: recv_capacity %d is below the step's %d rows, so each "
                   "step learns its rounds on the host: not capturable (a recv_capacity of "
                   "ranks * max_tokens is)",
                   ep->comm->rank, w->a.cap, ep->comm->nranks * ep->cfg.moe.max_tokens);
  return MOELINK_SUCCESS;
}

/* Rounds mode, before a step's exchanges (a: the view whose rounds count,
 * pipe 0's for a forward, the whole buffer's for a dispatch): the pairs counted and placed on
 * every rank (this rank's shared expert, when x, runs while the counts
 * travel), then the host learns the step's rounds (*rounds >= 1, the same
 * on every rank): the one host synchronization of the mode. */
static moelink_status_t ml_epc_plan_rounds(moelink_ep_t ep, ml_epc *w, const ml_epc_args *a,
                                           const int32_t *ids, const void *x, int T,
                                           cudaStream_t st, int *rounds) {
  ML_TRY(ml_epc_count(a, ids, T, st));
  if (x)
    ML_TRY(ml_epc_shared(ep, w, x, T, st));
  ML_TRY(ml_epc_schedule(a, ids, T, st));
  int32_t n = -1;
  const cudaError_t e = cudaMemcpyAsync(&n, a->nrounds, sizeof n, cudaMemcpyDeviceToHost, st);
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "ep (cuda): reading the step's rounds: %s",
                   cudaGetErrorString(e));
  ML_TRY(moelink_comm_check(ep->comm, st)); /* synchronizes; a peer that never came: TIMEOUT */
  if (n < 0)
    return ml_fail(MOELINK_ERR_TIMEOUT, "ep (cuda) on rank %d: a peer's pair counts never came",
                   ep->comm->rank);
  *rounds = n > 0 ? n : 1; /* one exchange even with no pairs: combine's protocol */
  return MOELINK_SUCCESS;
}

/* Steps 1 (after routing) to 3 of one exchange (a: the layer's arguments, or
 * a round's copy): the rows go out; this rank's shared expert (when shared)
 * runs while the peers' rows come in. Without it a layer of few tokens
 * (a->ll) sends and receives in one kernel. */
static moelink_status_t ml_epc_dispatch_inner(moelink_ep_t ep, ml_epc *w, const ml_epc_args *a,
                                              const void *x, const uint8_t *xq, const void *xs,
                                              const int32_t *ids, const float *wts, int T,
                                              int shared, cudaStream_t st) {
  const int ll = a->ll && !shared;
  ML_TRY(ml_epc_send(a, x, xq, xs, ids, wts, T, ll, st));
  if (ll)
    return MOELINK_SUCCESS;
  if (shared)
    ML_TRY(ml_epc_shared(ep, w, x, T, st));
  return ml_epc_receive(a, st);
}

/* Step 6: this rank's T tokens summed from its ret rows (with the shared
 * expert when shared). */
static moelink_status_t ml_epc_sum(moelink_ep_t ep, ml_epc *w, int shared, const void *x, int T,
                                   void *out, cudaStream_t st) {
  const moelink_moe_config_t *c = &ep->cfg.moe;
  const ml_epc_args *a = &w->a;
  if (T == 0 || !out)
    return MOELINK_SUCCESS;
  return ml_cuda_combine(c->dtype, a->base[a->me] + a->off_ret, a->slot_rows, T, c->top_k,
                         c->hidden, shared ? w->sh_out : NULL, x,
                         shared && c->shared_gate ? ep->w.shared_gate : NULL, out, st);
}

/* Steps 5 and 6: outputs back (pushed: they are there already), then this
 * rank's T tokens summed (with the shared expert when x is given). out NULL:
 * nothing written. Without a shared expert a layer of few tokens (a->ll)
 * does both in one kernel. */
static moelink_status_t ml_epc_combine_inner(moelink_ep_t ep, ml_epc *w, const void *y,
                                             const int32_t *pair_rows, int pushed, const void *x,
                                             int T, void *out, cudaStream_t st) {
  const ml_epc_args *a = &w->a;
  const int shared = x && ep->cfg.moe.shared_inter > 0;
  if (a->ll && !shared && out)
    return ml_epc_return(a, y, pair_rows, pushed, out, T, st);
  ML_TRY(ml_epc_return(a, y, pair_rows, pushed, NULL, 0, st));
  return ml_epc_sum(ep, w, shared, x, T, out, st);
}

/* This rank's T tokens routed as the whole layer routes them: ids, wts. */
static moelink_status_t ml_epc_route(moelink_ep_t ep, ml_epc *w, const void *x, int T,
                                     cudaStream_t st) {
  ml_cuda_router_args r =
      ml_cuda_router_args_for(&ep->cfg.moe, x, ep->w.router, ep->w.correction_bias, T, w->ids,
                              w->wts, w->r_partials, w->r_tickets, w->a.sms);
  return ml_cuda_route(&r, w->logits, w->sched, st);
}

/* Step 4 of one exchange (a: the layer's arguments, or a round's copy) whose
 * rows are in: plan and the local experts (fused: the down GEMM stores each
 * output row into its source's ret); *pair_rows: where y holds each pair. */
static moelink_status_t ml_epc_experts(ml_epc *w, int pipe, const ml_epc_args *a, int fused,
                                       const int32_t **pair_rows, cudaStream_t st) {
  moelink_moe_t local = ml_epc_local_of(w, pipe);
  void *plan = ml_epc_plan_of(w, pipe), *y = ml_epc_y_of(w, pipe);
  if (a->direct_plan) /* the receive kernel wrote the pair order; the rest here */
    ML_TRY(ml_epc_round_plan(a, st));
  else
    ML_TRY(moelink_moe_plan(local, a->lids, a->cap, plan, st));
  ML_TRY(ml_cuda_moe_experts_to(local, a->base[a->me] + a->off_rows, a->cap, plan, a->lwts, y,
                                fused ? (void *const *)a->dst : NULL, st));
  moelink_plan_t lp;
  ML_TRY(moelink_plan_view(plan, a->cap, a->kl, a->El, moelink_moe_tile_rows(local), &lp));
  *pair_rows = lp.pair_rows;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_epc_forward_inner(moelink_ep_t ep, ml_epc *w, const void *x, int T,
                                             void *out, cudaStream_t st) {
  const ml_epc_args *a = &w->a;
  if (T > 0)
    ML_TRY(ml_epc_route(ep, w, x, T, st));
  /* fused: the down GEMM stores every output row into its source's ret;
   * from MOELINK_EP_FUSED_RETURN tokens on this rank (a step of 128 tokens
   * measured 1-2% slower fused, 512 and 4096 faster: docs/PERF.md) */
  const long long from = ml_param_EP_FUSED_RETURN();
  const int fused = from > 0 && T >= from;
  const int32_t *pair_rows = NULL;
  if (!a->rounds) {
    ml_epc_args fa = *a;
    fa.fused = fused;
    ML_TRY(ml_epc_dispatch_inner(ep, w, &fa, x, NULL, NULL, w->ids, w->wts, T, 1, st));
    ML_TRY(ml_epc_experts(w, 0, a, fused, &pair_rows, st));
    return ml_epc_combine_inner(ep, w, w->y, pair_rows, fused, x, T, out, st);
  }
  /* rounds mode: the shared expert runs under the count exchange; round r
   * on pipe r % pipes, pipe p >= 1 on a stream of its own, so that pipes'
   * exchanges and plans run beside the others' GEMMs */
  int rounds = 0;
  ML_TRY(ml_epc_plan_rounds(ep, w, &w->pipe[0], w->ids, x, T, st, &rounds));
  const int used = w->pipes < rounds ? w->pipes : rounds; /* rounds >= 1 */
  for (int p = 1; p < used; ++p)
    ML_TRY(ml_cuda_stream_after(w->fork, st, w->ps[p], "ep (cuda), the round pipes"));
  for (int r = 0; r < rounds; ++r) {
    const int p = r % used;
    const cudaStream_t sp = p ? w->ps[p] : st;
    ml_epc_args ra = w->pipe[p];
    ra.round = r;
    ra.fused = fused;
    ML_TRY(ml_epc_dispatch_inner(ep, w, &ra, x, NULL, NULL, w->ids, w->wts, T, 0, sp));
    ML_TRY(ml_epc_experts(w, p, &ra, fused, &pair_rows, sp));
    ML_TRY(ml_epc_return(&ra, ml_epc_y_of(w, p), pair_rows, fused, NULL, 0, sp));
  }
  for (int p = 1; p < used; ++p)
    ML_TRY(ml_cuda_stream_after(w->pjoin[p], w->ps[p], st, "ep (cuda), the round pipes"));
  return ml_epc_sum(ep, w, x && ep->cfg.moe.shared_inter > 0, x, T, out, st);
}

static moelink_status_t ml_epc_aligned(const char *what, const void *p, int rank) {
  if (((uintptr_t)p) & 15)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "ep (cuda) on rank %d: %s %p must be 16-byte aligned",
                   rank, what, p);
  return MOELINK_SUCCESS;
}

/* Steps of max_tokens tokens: ceil(call_tokens / max_tokens) of them on every
 * rank (the front end refused num_tokens > call_tokens), so that all ranks
 * run the same exchanges without learning each other's counts on the host;
 * a rank out of tokens takes part with none. */
static moelink_status_t ml_epc_forward(moelink_ep_t ep, const void *x, int num_tokens, void *out,
                                       void *stream) {
  ml_epc *w = (ml_epc *)ep->impl;
  const int M = ep->cfg.moe.max_tokens;
  const int steps = (ep->cfg.call_tokens + M - 1) / M;
  if (num_tokens > 0) {
    ML_TRY(ml_epc_aligned("x", x, ep->comm->rank));
    ML_TRY(ml_epc_aligned("out", out, ep->comm->rank));
  }
  const size_t row = (size_t)ep->cfg.moe.hidden * moelink_dtype_size(ep->cfg.moe.dtype);
  int prev;
  ML_TRY(ml_cuda_enter(ep->comm->ctx, &prev));
  moelink_status_t s = ml_epc_not_capturing(ep, w, (cudaStream_t)stream);
  for (int i = 0; i < steps && s == MOELINK_SUCCESS; ++i) {
    const int64_t t0 = (int64_t)i * M, left = num_tokens - t0;
    const int T = left <= 0 ? 0 : left < M ? (int)left : M;
    s = ml_epc_forward_inner(ep, w, T ? (const char *)x + (size_t)t0 * row : NULL, T,
                             T ? (char *)out + (size_t)t0 * row : NULL, (cudaStream_t)stream);
  }
  return ml_cuda_leave(ep->comm->ctx, prev, s);
}

static moelink_status_t ml_epc_dispatch(moelink_ep_t ep, const void *x, const uint8_t *xq,
                                        const void *xs, const int32_t *ids, const float *weights,
                                        int num_tokens, moelink_ep_recv_t *recv, void *stream) {
  ml_epc *w = (ml_epc *)ep->impl;
  if (num_tokens > 0) ML_TRY(ml_epc_aligned(x ? "x" : "xq", x ? x : (const void *)xq,
                                            ep->comm->rank));
  int prev;
  ML_TRY(ml_cuda_enter(ep->comm->ctx, &prev));
  const cudaStream_t st = (cudaStream_t)stream;
  moelink_status_t s = ml_epc_not_capturing(ep, w, st);
  int rounds = 1;
  if (w->a.rounds) {
    /* the caller gets the rows at once: they must fit in one round (every
     * rank counts the same rounds, so all refuse alike) */
    if (s == MOELINK_SUCCESS)
      s = ml_epc_plan_rounds(ep, w, &w->a, ids, NULL, num_tokens, st, &rounds);
    if (s == MOELINK_SUCCESS && rounds > 1)
      s = ml_fail(MOELINK_ERR_UNSUPPORTED,
                  "ep_dispatch on rank %d: the ranks' pairs need %d rounds of recv_capacity %d "
                  "rows; a dispatch is one round (use moelink_ep_forward, or raise "
                  "recv_capacity up to ranks * max_tokens = %d)",
                  ep->comm->rank, rounds, w->a.cap, ep->comm->nranks * ep->cfg.moe.max_tokens);
  }
  if (s == MOELINK_SUCCESS)
    s = ml_epc_dispatch_inner(ep, w, &w->a, x, xq, xs, ids, weights, num_tokens, 0, st);
  s = ml_cuda_leave(ep->comm->ctx, prev, s);
  if (s != MOELINK_SUCCESS) return s;
  recv->capacity = w->a.cap;
  recv->top_k = w->a.kl;
  recv->rows = w->a.base[w->a.me] + w->a.off_rows;
  recv->expert_ids = w->a.lids;
  recv->weights = w->a.lwts;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_epc_combine(moelink_ep_t ep, const void *y, const int32_t *pair_rows,
                                       void *out, void *stream) {
  ml_epc *w = (ml_epc *)ep->impl;
  const int T = ep->dispatch_tokens;
  if (y) ML_TRY(ml_epc_aligned("y", y, ep->comm->rank));
  if (out && T > 0) ML_TRY(ml_epc_aligned("out", out, ep->comm->rank));
  int prev;
  ML_TRY(ml_cuda_enter(ep->comm->ctx, &prev));
  moelink_status_t s =
      ml_epc_combine_inner(ep, w, y, pair_rows, 0, NULL, T, out, (cudaStream_t)stream);
  return ml_cuda_leave(ep->comm->ctx, prev, s);
}

static const ml_ep_ops ml_epc_ops = {"cuda",          1,              ml_epc_size,
                                     ml_epc_init,     ml_epc_fini,    ml_epc_set_weights,
                                     ml_epc_forward,  ml_epc_dispatch, ml_epc_combine};

const ml_ep_ops *ml_ep_cuda_ops(void) { return &ml_epc_ops; }
