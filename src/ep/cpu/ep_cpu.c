/* Expert parallelism on CPU ranks: the protocol the GPU implementation is to
 * follow, with the layer math of the CPU backend (src/cpu/) on each rank.
 *
 * Each rank holds two CPU layers of its own: `front`, the whole layer's
 * config, used for routing, the shared expert and the final combine of this
 * rank's tokens; `local`, its El = E / n experts with max_tokens =
 * recv_capacity, run on the rows it receives. And one symmetric allocation
 * (peers write into it with plain stores, then signal):
 *   hash                  the config's hash, compared once at create
 *   sig_count[n]          sig_count[s] = step epoch: s's counts row is in
 *   sig_arrive[n]         sig_arrive[s] = round epoch: s's rows of the round are in
 *   sig_back[n]           sig_back[d] = round epoch: d is done with the round:
 *                         its receive buffer may be refilled and its expert
 *                         outputs for this rank's tokens are in `ret`
 *   counts[2][n][n+1]     row s of a step (parity): tokens s sends to each rank,
 *                         then 1 if s has tokens left for a further step (a
 *                         dispatch: 1 + a token of s that no row can hold)
 *   meta[cap][2+2k]       per received row: source rank, source token (within
 *                         the step), the k expert ids (-1: not this rank's
 *                         expert), the k routing weights (fp32 bits)
 *   rows[cap][H]          received token rows, layer dtype
 *   ret[max_tokens*k][H]  fp32 expert output of slot j of token t (already
 *                         times its routing weight) at row t*k + j, written by
 *                         the rank that owns that expert
 *
 * A forward is a sequence of steps, each of at most max_tokens tokens per
 * rank; every rank runs every step (with 0 tokens once it has none left)
 * until no rank has tokens left. A step:
 *  1. route this rank's tokens; list, per destination rank, the tokens with at
 *     least one expert there (ascending: each token once per destination);
 *  2. push the row of counts into every rank's counts[parity][me]; wait for
 *     all rows: every rank now knows the whole matrix M[s][d];
 *  3. rank d's incoming rows are ordered by source rank, then token; round j
 *     carries incoming positions [j*cap, (j+1)*cap) of every destination, so
 *     the rounds of a step are max_d ceil(sum_s M[s][d] / cap), the same on
 *     every rank, and a source knows where its rows land without asking;
 *  4. per round: push this round's rows (+ meta) into each destination's
 *     buffer (once its previous round is done: sig_back), signal arrival;
 *     wait for all sources; run the local experts on the received rows; push
 *     each (row, slot) result into its source's ret; signal sig_back to all;
 *  5. wait for sig_back of the step's last round from every rank, then
 *     combine: out[t] = sum_j ret[t*k+j] in slot order (+ shared expert),
 *     fp32, one rounding: the CPU backend's own combine.
 * Every counter only grows. Reuse is safe by causality: a source refills a
 * destination's buffer only after that destination's sig_back of the round
 * before; peers write a source's ret in step s+1 only for rows that source
 * sent in step s+1, after its combine of step s; counts alternate between two
 * parities, and a rank can be at most one step ahead of any other.
 *
 * The pieces (moelink_ep_dispatch / moelink_ep_combine) are one step of one
 * round cut after the arrival wait of 4.: dispatch lists destinations from
 * the caller's ids (an id outside [0, E) goes nowhere) and exchanges counts.
 * When some rank's incoming rows exceed cap, or a source flagged a token
 * with more slots on one rank than a row has (min(k, E / n): only repeated
 * ids can do that), every rank (all hold the same matrix) refuses before
 * anything is sent, UNSUPPORTED; the step
 * epoch has advanced everywhere alike, as after a step with no rounds.
 * Otherwise it pushes the round, waits for it and hands out the received
 * rows with their local ids and weights. Combine pushes the caller's y rows (fp32) into
 * the sources' ret, signals sig_back of that round, waits for every rank's,
 * and adds ret rows of the valid slots only (cpairs: -1 for an empty slot,
 * whose ret row holds whatever an earlier call left there). The received
 * rows, meta and lids stay untouched in between: no source refills this
 * rank's buffer before its sig_back, and forward refuses to run (ep.c).
 *
 * 8-bit dispatch (dispatch_quant FP8 / MXFP8): the experts must compute on
 * dequantize(quantize(x)) rounded to the layer dtype. On CPU ranks the rows
 * travel as exactly that: a source turns its step's rows into xdq (one
 * round trip per token, whatever its destinations, this rank included) and
 * sends xdq as it would send x; moelink_ep_dispatch_quantized dequantizes
 * the caller's q + scales into xdq instead. Shipping the 8-bit bytes plus
 * scales and dequantizing on arrival would give the same bits (the round
 * trip is deterministic) for less traffic, which shared memory does not need.
 * Routing and the shared expert read x itself.
 *
 * Memory: the two layers' workspaces (max_tokens and recv_capacity rows), the
 * symmetric buffer above, O(max_tokens * k + cap * k + n^2) host ints and,
 * with dispatch_quant, xdq [max_tokens][H] of the layer dtype: set by the
 * config, never by a call's token count or routing. */
#include "comm/cpu/comm_cpu.h"
#include "cpu/cpu.h"
#include "ep/ep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ml_ep_cpu {
  moelink_moe_t front, local;
  int n, me, E, El, k, kl, H, cap, max_tokens;
  size_t row_bytes; /* H * dtype size */
  size_t meta_ints; /* 2 + 2k */
  /* symmetric memory: this rank's copy, and every rank's base */
  unsigned char *symm;
  unsigned char **peer;
  size_t off_hash, off_count, off_arrive, off_back, off_counts, off_meta, off_rows, off_ret;
  /* host scratch */
  int32_t *dest_off; /* [n+1] */
  int32_t *dest_tok; /* [max_tokens * min(k, n)] */
  int64_t *mat;      /* [n][n+1] copy of the step's counts */
  int64_t *pre;      /* [n] position of this rank's rows among each destination's incoming */
  int32_t *lids;     /* [cap * kl] local expert ids of the received rows (-1: none) */
  float *lwts;       /* [cap * kl] */
  int32_t *lslot;    /* [cap * kl] slot j of the source token (-1: none) */
  int32_t *ident;    /* [max_tokens * k]: pair p's result is ret row p */
  int32_t *cpairs;   /* [max_tokens * k]: as ident, -1 for a dispatch's empty slots */
  unsigned char *xdq; /* [max_tokens][H] layer dtype: the rows sent (dispatch_quant) */
  void *host;
  uint64_t steps, rounds; /* epochs, equal on every rank */
  int d_tokens, d_recv;   /* the last dispatch: this rank's tokens, rows received */
} ml_ep_cpu;

static size_t ml_ep_up(size_t v) { return (v + 63) & ~(size_t)63; }

/* Offsets of the symmetric layout; returns its size. */
static size_t ml_ep_symm_layout(const moelink_ep_config_t *cfg, int n, ml_ep_cpu *w) {
  const moelink_moe_config_t *c = &cfg->moe;
  const size_t k = (size_t)c->top_k, H = (size_t)c->hidden, cap = (size_t)cfg->recv_capacity;
  const size_t es = moelink_dtype_size(c->dtype), nn = (size_t)n;
  size_t off = 0;
  w->off_hash = off;
  off += 64;
  w->off_count = off;
  off = ml_ep_up(off + nn * 8);
  w->off_arrive = off;
  off = ml_ep_up(off + nn * 8);
  w->off_back = off;
  off = ml_ep_up(off + nn * 8);
  w->off_counts = off;
  off = ml_ep_up(off + 2 * nn * (nn + 1) * 8);
  w->off_meta = off;
  off = ml_ep_up(off + cap * (2 + 2 * k) * 4);
  w->off_rows = off;
  off = ml_ep_up(off + cap * H * es);
  w->off_ret = off;
  off = ml_ep_up(off + (size_t)c->max_tokens * k * H * 4);
  return off;
}

/* Host scratch, carved from one block (base NULL: only sizes it). */
static size_t ml_ep_host_layout(const moelink_ep_config_t *cfg, int n, ml_ep_cpu *w, char *base) {
  const moelink_moe_config_t *c = &cfg->moe;
  const size_t k = (size_t)c->top_k, T = (size_t)c->max_tokens, cap = (size_t)cfg->recv_capacity;
  const size_t El = (size_t)(c->num_experts / n), nn = (size_t)n;
  const size_t kl = k < El ? k : El, spread = k < nn ? k : nn;
  size_t off = 0;
#define ML_EP_TAKE(field, type, count)                                                         \
  do {                                                                                         \
    if (base) w->field = (type *)(void *)(base + off);                                        \
    off = ml_ep_up(off + (size_t)(count) * sizeof(type));                                     \
  } while (0)
  ML_EP_TAKE(dest_off, int32_t, nn + 1);
  ML_EP_TAKE(dest_tok, int32_t, T * spread);
  ML_EP_TAKE(mat, int64_t, nn * (nn + 1));
  ML_EP_TAKE(pre, int64_t, nn);
  ML_EP_TAKE(lids, int32_t, cap * kl);
  ML_EP_TAKE(lwts, float, cap * kl);
  ML_EP_TAKE(lslot, int32_t, cap * kl);
  ML_EP_TAKE(ident, int32_t, T * k);
  ML_EP_TAKE(cpairs, int32_t, T * k);
  ML_EP_TAKE(peer, unsigned char *, nn);
  ML_EP_TAKE(xdq, unsigned char,
             cfg->dispatch_quant != MOELINK_QUANT_NONE
                 ? T * (size_t)c->hidden * moelink_dtype_size(c->dtype)
                 : 0);
#undef ML_EP_TAKE
  return off;
}

static moelink_status_t ml_ep_cpu_size(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                       size_t *bytes) {
  ml_ep_cpu w;
  memset(&w, 0, sizeof w);
  size_t a = 0, b = 0;
  moelink_moe_config_t lc = ml_ep_local_config(cfg, comm->nranks, cfg->recv_capacity);
  ML_TRY(moelink_moe_workspace_size(comm->ctx, &cfg->moe, &a));
  ML_TRY(moelink_moe_workspace_size(comm->ctx, &lc, &b));
  *bytes = a + b + ml_ep_symm_layout(cfg, comm->nranks, &w) +
           ml_ep_host_layout(cfg, comm->nranks, &w, NULL);
  return MOELINK_SUCCESS;
}

static void ml_ep_cpu_fini(moelink_ep_t ep) {
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  if (!w) return;
  if (w->symm) ep->comm->ops->symm_free(ep->comm, w->symm);
  moelink_moe_destroy(w->front);
  moelink_moe_destroy(w->local);
  free(w->host);
  free(w);
  ep->impl = NULL;
}

static moelink_status_t ml_ep_cpu_init(moelink_ep_t ep) {
  moelink_comm_t comm = ep->comm;
  const moelink_ep_config_t *cfg = &ep->cfg;
  const moelink_moe_config_t *c = &cfg->moe;
  ml_ep_cpu *w = (ml_ep_cpu *)calloc(1, sizeof *w);
  if (!w) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "ep: cpu state allocation failed");
  ep->impl = w;
  w->n = comm->nranks;
  w->me = comm->rank;
  w->E = c->num_experts;
  w->El = ep->local_experts;
  w->k = c->top_k;
  w->kl = w->k < w->El ? w->k : w->El;
  w->H = c->hidden;
  w->cap = cfg->recv_capacity;
  w->max_tokens = c->max_tokens;
  w->row_bytes = (size_t)c->hidden * moelink_dtype_size(c->dtype);
  w->meta_ints = 2 + 2 * (size_t)w->k;
  moelink_status_t s = MOELINK_SUCCESS;
  /* Local failures still go through the collective allocation below, so the
   * other ranks do not wait for a rank that gave up. */
  const size_t host = ml_ep_host_layout(cfg, w->n, w, NULL);
  w->host = malloc(host);
  if (!w->host)
    s = ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "ep: %zu bytes of host scratch could not be allocated",
                host);
  else
    ml_ep_host_layout(cfg, w->n, w, (char *)w->host);
  if (s == MOELINK_SUCCESS) s = moelink_moe_create(comm->ctx, c, &w->front);
  moelink_moe_config_t lc = ml_ep_local_config(cfg, w->n, cfg->recv_capacity);
  if (s == MOELINK_SUCCESS) s = moelink_moe_create(comm->ctx, &lc, &w->local);
  char why[400] = "";
  if (s != MOELINK_SUCCESS) snprintf(why, sizeof why, "%s", moelink_last_error());

  void *symm = NULL;
  const size_t symm_bytes = ml_ep_symm_layout(cfg, w->n, w);
  moelink_status_t a = comm->ops->symm_alloc(comm, symm_bytes, &symm);
  if (a != MOELINK_SUCCESS) {
    ml_ep_cpu_fini(ep);
    return a;
  }
  w->symm = (unsigned char *)symm;
  for (int p = 0; s == MOELINK_SUCCESS && p < w->n; ++p) {
    w->peer[p] = (unsigned char *)ml_cpu_peer_ptr(comm, symm, p);
    if (!w->peer[p]) {
      s = ml_fail(MOELINK_ERR_INTERNAL, "ep: no address of rank %d's symmetric buffer", p);
      snprintf(why, sizeof why, "%s", moelink_last_error());
    }
  }
  if (s == MOELINK_SUCCESS)
    for (int64_t i = 0; i < (int64_t)w->max_tokens * w->k; ++i) w->ident[i] = (int32_t)i;

  /* Every rank posts its config's hash (0: it failed above) and reads all:
   * ranks with different configs would mix data (sizes alone may agree), and
   * a rank that failed alone must not leave the others waiting later. */
  const uint64_t h = s == MOELINK_SUCCESS ? (ml_ep_config_hash(cfg) | 1) : 0;
  memcpy(w->symm + w->off_hash, &h, 8);
  moelink_status_t b = ml_cpu_barrier(comm);
  if (b != MOELINK_SUCCESS) {
    ml_ep_cpu_fini(ep);
    return b;
  }
  for (int p = 0; s == MOELINK_SUCCESS && p < w->n; ++p) {
    uint64_t hp;
    memcpy(&hp, (unsigned char *)ml_cpu_peer_ptr(comm, symm, p) + w->off_hash, 8);
    if (hp == 0)
      s = ml_fail(MOELINK_ERR_INVALID_STATE, "ep_create: rank %d failed to create its part",
                  p);
    else if (hp != h)
      s = ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                  "ep_create: rank %d's config differs from rank %d's: every rank must pass the "
                  "same config",
                  p, w->me);
    if (s != MOELINK_SUCCESS) snprintf(why, sizeof why, "%s", moelink_last_error());
  }
  if (s != MOELINK_SUCCESS) {
    ml_ep_cpu_fini(ep);
    return ml_fail(s, "%s", why);
  }
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ep_cpu_set_weights(moelink_ep_t ep) {
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  return ml_ep_bind_layers(ep, w->front, w->local);
}

static inline uint64_t *ml_ep_sig(const ml_ep_cpu *w, int rank, size_t off) {
  return (uint64_t *)(void *)(w->peer[rank] + off);
}

/* The rank that owns expert id, or -1 for an empty slot (an id outside
 * [0, E); C's division would put -1 on rank 0). */
static inline int ml_ep_owner(const ml_ep_cpu *w, int32_t id) {
  return id >= 0 && id < w->E ? id / w->El : -1;
}

/* lids / lwts / lslot of the nrecv received rows, from their meta: each
 * row's slots of this rank's experts, compacted in the source's slot order,
 * then -1 / 0 / -1. */
static moelink_status_t ml_ep_prepare(ml_ep_cpu *w, int nrecv) {
  const int k = w->k, kl = w->kl, first = w->me * w->El;
  const int32_t *meta = (const int32_t *)(const void *)(w->symm + w->off_meta);
  for (int i = 0; i < nrecv; ++i) {
    const int32_t *m = meta + (size_t)i * w->meta_ints;
    int jj = 0;
    for (int j = 0; j < k; ++j) {
      const int id = m[2 + j];
      if (id < 0) continue;
      if (id < first || id >= first + w->El || jj == kl || m[0] < 0 || m[0] >= w->n ||
          m[1] < 0 || m[1] >= w->max_tokens)
        return ml_fail(MOELINK_ERR_INTERNAL,
                       "ep: rank %d received row %d (source rank %d, token %d) with expert %d, "
                       "not one of its experts [%d, %d)",
                       w->me, i, (int)m[0], (int)m[1], id, first, first + w->El);
      const size_t p = (size_t)i * kl + jj++;
      w->lids[p] = id - first;
      memcpy(&w->lwts[p], &m[2 + k + j], 4);
      w->lslot[p] = j;
    }
    for (; jj < kl; ++jj) {
      const size_t p = (size_t)i * kl + jj;
      w->lids[p] = -1;
      w->lwts[p] = 0.0f;
      w->lslot[p] = -1;
    }
  }
  return MOELINK_SUCCESS;
}

/* Runs the local experts on the nrecv rows of this round and pushes each
 * (row, slot) result into its source rank's ret. */
static moelink_status_t ml_ep_serve(ml_ep_cpu *w, int nrecv) {
  const int k = w->k, kl = w->kl;
  const int32_t *meta = (const int32_t *)(const void *)(w->symm + w->off_meta);
  ML_TRY(ml_ep_prepare(w, nrecv));
  moelink_moe_t local = w->local;
  ml_cpu_moe *lws = ml_cpu_ws(local);
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view(lws->plan, nrecv, kl, w->El, local->tile_rows, &plan));
  ml_cpu_build_plan(w->lids, nrecv, kl, w->El, local->tile_rows, &plan);
  ml_cpu_ffn job;
  memset(&job, 0, sizeof job);
  job.x = w->symm + w->off_rows;
  job.x_dtype = local->cfg.dtype;
  job.num_tokens = nrecv;
  job.plan = &plan;
  job.weights = w->lwts;
  job.y32 = lws->xg;
  ML_TRY(ml_cpu_run_ffn(local, &job));
  const size_t hb = (size_t)w->H * sizeof(float);
  for (size_t p = 0; p < (size_t)nrecv * kl; ++p) {
    if (w->lslot[p] < 0) continue;
    const int32_t *m = meta + (p / kl) * w->meta_ints;
    float *dst = (float *)(void *)(w->peer[m[0]] + w->off_ret) +
                 ((size_t)m[1] * k + (size_t)w->lslot[p]) * w->H;
    memcpy(dst, lws->xg + (size_t)plan.pair_rows[p] * w->H, hb);
  }
  return MOELINK_SUCCESS;
}

/* Lists this step's ts tokens per destination rank by their ids [ts, k].
 * Returns 1 + the first token with more slots on one rank than a received
 * row has (kl: only repeated ids can do that, when E / n < k), else 0. */
static int ml_ep_list(ml_ep_cpu *w, const int32_t *ids_all, int ts) {
  const int n = w->n, k = w->k;
  int over = 0;
  memset(w->dest_off, 0, sizeof(int32_t) * ((size_t)n + 1));
  /* Twice over the tokens: count per destination, then place. A token goes
   * to d once, at its first slot whose expert d owns. */
  for (int pass = 0; pass < 2; ++pass) {
    int32_t cursor[ML_CPU_MAX_RANKS];
    if (pass == 1) {
      for (int d = 0; d < n; ++d) w->dest_off[d + 1] += w->dest_off[d];
      memcpy(cursor, w->dest_off, sizeof(int32_t) * (size_t)n);
    }
    for (int t = 0; t < ts; ++t) {
      const int32_t *ids = ids_all + (size_t)t * k;
      for (int j = 0; j < k; ++j) {
        const int d = ml_ep_owner(w, ids[j]);
        if (d < 0) continue;
        int seen = 0;
        for (int q = 0; q < j; ++q) seen += ml_ep_owner(w, ids[q]) == d;
        if (seen == w->kl && !over) over = t + 1;
        if (seen) continue;
        if (pass == 0)
          ++w->dest_off[d + 1];
        else
          w->dest_tok[cursor[d]++] = t;
      }
    }
  }
  return over;
}

/* Routes this step's tokens and lists them per destination rank. */
static moelink_status_t ml_ep_route_step(ml_ep_cpu *w, const void *x, int ts, const float **x32) {
  moelink_moe_t front = w->front;
  ml_cpu_moe *fws = ml_cpu_ws(front);
  *x32 = NULL;
  if (ts > 0) {
    *x32 = ml_cpu_x_f32(front, x, ts);
    ML_TRY(ml_cpu_route_f32(front, *x32, ts, fws->ids, fws->wts));
  }
  (void)ml_ep_list(w, fws->ids, ts); /* the router's ids are distinct */
  return MOELINK_SUCCESS;
}

/* The counts of step w->steps: pushes this rank's row (tokens per
 * destination from dest_off, then last_col: forward's "tokens left",
 * dispatch's "bad token + 1") into every rank's matrix and waits for all
 * rows; fills mat and pre. Out: the rows this rank receives, the most any
 * rank receives and the lowest rank that does, and the lowest rank whose
 * last column is not 0 (-1: none). */
static moelink_status_t ml_ep_counts(moelink_ep_t ep, int last_col, int64_t *in_me,
                                     int64_t *in_max, int *max_rank, int *flagged) {
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  const int n = w->n, me = w->me;
  const size_t row = (size_t)n + 1;
  const uint64_t st = w->steps;
  int64_t mine[ML_CPU_MAX_RANKS + 1];
  for (int d = 0; d < n; ++d) mine[d] = w->dest_off[d + 1] - w->dest_off[d];
  mine[n] = last_col;
  const size_t counts_at = w->off_counts + ((st & 1) * (size_t)n + (size_t)me) * row * 8;
  for (int p = 0; p < n; ++p) {
    memcpy(w->peer[p] + counts_at, mine, row * 8);
    ml_cpu_signal_set(ml_ep_sig(w, p, w->off_count) + me, st);
  }
  for (int s = 0; s < n; ++s)
    if (s != me)
      ML_TRY(ml_cpu_wait(ep->comm, ml_ep_sig(w, me, w->off_count) + s, st, s, "ep: token counts"));
  memcpy(w->mat, w->symm + w->off_counts + (st & 1) * (size_t)n * row * 8, (size_t)n * row * 8);
  *in_me = 0;
  *in_max = 0;
  *max_rank = 0;
  *flagged = -1;
  for (int d = 0; d < n; ++d) {
    int64_t in = 0;
    for (int s = 0; s < n; ++s) {
      if (s == me) w->pre[d] = in;
      in += w->mat[(size_t)s * row + d];
    }
    if (in > *in_max) {
      *in_max = in;
      *max_rank = d;
    }
    if (d == me) *in_me = in;
  }
  for (int s = n - 1; s >= 0; --s)
    if (w->mat[(size_t)s * row + (size_t)n] != 0) *flagged = s;
  return MOELINK_SUCCESS;
}

/* Pushes this round's rows of every destination (incoming positions
 * [lo, lo + cap) of each), with meta from ids / wts [*, k]. */
static moelink_status_t ml_ep_send_round(moelink_ep_t ep, const void *x, const int32_t *ids_all,
                                         const float *wts_all, int64_t lo, uint64_t re) {
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  const int n = w->n, k = w->k, me = w->me;
  for (int d = 0; d < n; ++d) {
    const int64_t p0 = w->pre[d], cnt = w->mat[(size_t)me * (n + 1) + d];
    const int64_t i0 = lo - p0 > 0 ? lo - p0 : 0;
    const int64_t i1 = lo + w->cap - p0 < cnt ? lo + w->cap - p0 : cnt;
    if (i1 > i0) {
      if (re > 1)
        ML_TRY(ml_cpu_wait(ep->comm, ml_ep_sig(w, me, w->off_back) + d, re - 1, d,
                           "ep: receive buffer free (previous round done)"));
      unsigned char *rows = w->peer[d] + w->off_rows;
      int32_t *meta = (int32_t *)(void *)(w->peer[d] + w->off_meta);
      for (int64_t i = i0; i < i1; ++i) {
        const int t = w->dest_tok[w->dest_off[d] + i];
        const size_t pos = (size_t)(p0 + i - lo);
        memcpy(rows + pos * w->row_bytes, (const char *)x + (size_t)t * w->row_bytes,
               w->row_bytes);
        int32_t *m = meta + pos * w->meta_ints;
        const int32_t *ids = ids_all + (size_t)t * k;
        m[0] = me;
        m[1] = t;
        for (int j = 0; j < k; ++j) {
          m[2 + j] = ml_ep_owner(w, ids[j]) == d ? ids[j] : -1;
          memcpy(&m[2 + k + j], &wts_all[(size_t)t * k + j], 4);
        }
      }
    }
    ml_cpu_signal_set(ml_ep_sig(w, d, w->off_arrive) + me, re);
  }
  return MOELINK_SUCCESS;
}

/* The ts token rows a step sends: x itself; with dispatch_quant, xdq =
 * dequantize(quantize(x)) or, from xq + scales, dequantize(xq, scales). */
static const void *ml_ep_rows_to_send(moelink_ep_t ep, const void *x, const uint8_t *xq,
                                      const void *scales, int ts) {
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  const moelink_quant_t f = ep->cfg.dispatch_quant;
  const moelink_dtype_t dt = ep->cfg.moe.dtype;
  const int nt = ep->comm->ctx->num_threads;
  if (ts <= 0) return NULL;
  if (xq) {
    ml_cpu_dequant_rows(f, dt, xq, scales, ts, w->H, w->xdq, nt);
    return w->xdq;
  }
  if (f == MOELINK_QUANT_NONE) return x;
  ml_cpu_qdq_rows(f, dt, x, ts, w->H, w->xdq, nt);
  return w->xdq;
}

/* Waits until every source's rows of round re are in. */
static moelink_status_t ml_ep_wait_arrivals(moelink_ep_t ep, uint64_t re) {
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  for (int s = 0; s < w->n; ++s)
    if (s != w->me)
      ML_TRY(ml_cpu_wait(ep->comm, ml_ep_sig(w, w->me, w->off_arrive) + s, re, s,
                         "ep: dispatched token rows"));
  return MOELINK_SUCCESS;
}

/* Signals this rank done with round re to every rank, then waits for every
 * rank's: all expert outputs for this rank's tokens are in ret. */
static moelink_status_t ml_ep_close_round(moelink_ep_t ep, uint64_t re) {
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  for (int s = 0; s < w->n; ++s) ml_cpu_signal_set(ml_ep_sig(w, s, w->off_back) + w->me, re);
  for (int d = 0; d < w->n; ++d)
    if (d != w->me)
      ML_TRY(ml_cpu_wait(ep->comm, ml_ep_sig(w, w->me, w->off_back) + d, re, d,
                         "ep: expert outputs returned"));
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ep_cpu_forward(moelink_ep_t ep, const void *x, int num_tokens,
                                          void *out, void *stream) {
  (void)stream;
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  const moelink_moe_config_t *c = &ep->cfg.moe;
  const int n = w->n, me = w->me;
  ml_cpu_moe *fws = ml_cpu_ws(w->front);
  int done = 0;
  for (;;) {
    const int left = num_tokens - done;
    const int ts = left < w->max_tokens ? left : w->max_tokens;
    ++w->steps;
    const char *xs = ts ? (const char *)x + (size_t)done * w->row_bytes : NULL;
    const float *x32 = NULL;
    ML_TRY(ml_ep_route_step(w, xs, ts, &x32));
    int64_t in_me = 0, in_max = 0;
    int max_rank = 0, more = -1; /* more: the lowest rank with tokens left */
    ML_TRY(ml_ep_counts(ep, left > ts, &in_me, &in_max, &max_rank, &more));
    const int64_t rounds = (in_max + w->cap - 1) / w->cap;
    const void *rows = ml_ep_rows_to_send(ep, xs, NULL, NULL, ts);

    /* The shared expert of this rank's tokens (into front's sh_out). */
    if (ts > 0 && c->shared_inter > 0) {
      moelink_plan_t none;
      ML_TRY(moelink_plan_view(fws->plan, 0, w->k, w->E, w->front->tile_rows, &none));
      memset(none.expert_offsets, 0, sizeof(int32_t) * ((size_t)w->E + 1));
      ml_cpu_ffn job;
      memset(&job, 0, sizeof job);
      job.x = x32;
      job.x_dtype = MOELINK_DTYPE_F32;
      job.num_tokens = ts;
      job.plan = &none;
      job.y32 = fws->xg;
      job.x32 = x32;
      ML_TRY(ml_cpu_run_ffn(w->front, &job));
    }

    for (int64_t j = 0; j < rounds; ++j) {
      const uint64_t re = ++w->rounds;
      const int64_t lo = j * w->cap;
      ML_TRY(ml_ep_send_round(ep, rows, fws->ids, fws->wts, lo, re));
      ML_TRY(ml_ep_wait_arrivals(ep, re));
      const int64_t nrecv = in_me - lo < w->cap ? in_me - lo : w->cap;
      if (nrecv > 0) ML_TRY(ml_ep_serve(w, (int)nrecv));
      for (int s = 0; s < n; ++s) ml_cpu_signal_set(ml_ep_sig(w, s, w->off_back) + me, re);
    }
    if (rounds > 0)
      for (int d = 0; d < n; ++d)
        if (d != me)
          ML_TRY(ml_cpu_wait(ep->comm, ml_ep_sig(w, me, w->off_back) + d, w->rounds, d,
                             "ep: expert outputs returned"));

    if (ts > 0) {
      moelink_plan_t ident;
      memset(&ident, 0, sizeof ident);
      ident.pair_rows = w->ident;
      ML_TRY(ml_cpu_combine_rows(w->front, w->symm + w->off_ret, MOELINK_DTYPE_F32, ts, &ident,
                                 c->shared_inter > 0 ? fws->sh_out : NULL,
                                 (char *)out + (size_t)done * w->row_bytes));
    }
    done += ts;
    if (more < 0) break;
  }
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ep_cpu_dispatch(moelink_ep_t ep, const void *x, const uint8_t *xq,
                                           const void *xs, const int32_t *ids,
                                           const float *weights, int num_tokens,
                                           moelink_ep_recv_t *recv, void *stream) {
  (void)stream;
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  const int k = w->k, kl = w->kl;
  ++w->steps;
  const int over = ml_ep_list(w, ids, num_tokens);
  int64_t in_me = 0, in_max = 0;
  int max_rank = 0, bad = -1;
  ML_TRY(ml_ep_counts(ep, over, &in_me, &in_max, &max_rank, &bad));
  /* Every rank holds the same matrix, so all refuse together, before any
   * row moves; the next call starts from consistent epochs. */
  if (bad >= 0)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "ep_dispatch: rank %d's token %d has more than %d slots on one rank's %d "
                   "experts (repeated expert ids): every rank refuses, nothing was sent and no "
                   "combine follows",
                   bad, (int)w->mat[(size_t)bad * (w->n + 1) + (size_t)w->n] - 1, kl, w->El);
  if (in_max > w->cap)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "ep_dispatch: rank %d would receive %lld token rows, more than its "
                   "recv_capacity %d: on CPU ranks a dispatch is one round (raise recv_capacity, "
                   "or send fewer tokens per call; moelink_ep_forward takes any count)",
                   max_rank, (long long)in_max, w->cap);
  for (int64_t p = 0; p < (int64_t)num_tokens * k; ++p)
    w->cpairs[p] = ml_ep_owner(w, ids[p]) >= 0 ? (int32_t)p : -1;
  const uint64_t re = ++w->rounds;
  const void *rows = ml_ep_rows_to_send(ep, x, xq, xs, num_tokens);
  ML_TRY(ml_ep_send_round(ep, rows, ids, weights, 0, re));
  ML_TRY(ml_ep_wait_arrivals(ep, re));
  ML_TRY(ml_ep_prepare(w, (int)in_me));
  for (size_t p = (size_t)in_me * kl; p < (size_t)w->cap * kl; ++p) {
    w->lids[p] = -1;
    w->lwts[p] = 0.0f;
    w->lslot[p] = -1;
  }
  w->d_tokens = num_tokens;
  w->d_recv = (int)in_me;
  recv->capacity = w->cap;
  recv->top_k = kl;
  recv->rows = w->symm + w->off_rows;
  recv->expert_ids = w->lids;
  recv->weights = w->lwts;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ep_cpu_combine(moelink_ep_t ep, const void *y, const int32_t *pair_rows,
                                          void *out, void *stream) {
  (void)stream;
  ml_ep_cpu *w = (ml_ep_cpu *)ep->impl;
  const int k = w->k, kl = w->kl, H = w->H;
  const moelink_dtype_t dt = ep->cfg.moe.dtype;
  const size_t pairs = (size_t)w->d_recv * kl, y_rows = (size_t)w->cap * kl;
  const int32_t *meta = (const int32_t *)(const void *)(w->symm + w->off_meta);
  /* A pair_rows entry that points outside y [cap * top_k, H] is this rank's
   * bad argument: like a NULL y, it still answers, with zeros. */
  size_t bad = pairs;
  if (y && pair_rows)
    for (size_t p = 0; p < pairs && bad == pairs; ++p)
      if (w->lslot[p] >= 0 && (pair_rows[p] < 0 || (size_t)pair_rows[p] >= y_rows)) bad = p;
  const int zeros = !y || bad < pairs;
  for (size_t p = 0; p < pairs; ++p) {
    if (w->lslot[p] < 0) continue;
    const int32_t *m = meta + (p / kl) * w->meta_ints;
    float *dst = (float *)(void *)(w->peer[m[0]] + w->off_ret) +
                 ((size_t)m[1] * k + (size_t)w->lslot[p]) * H;
    if (zeros) {
      memset(dst, 0, (size_t)H * sizeof(float));
    } else {
      const size_t r = pair_rows ? (size_t)pair_rows[p] : p;
      ml_cpu_to_f32(dt, (const char *)y + r * w->row_bytes, dst, (size_t)H);
    }
  }
  ML_TRY(ml_ep_close_round(ep, w->rounds));
  if (bad < pairs)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "ep_combine on rank %d: pair_rows[%zu] = %d for a valid pair is outside y's "
                   "%zu rows (took part, sending zeros for its experts; no out written)",
                   w->me, bad, (int)pair_rows[bad], y_rows);
  if (w->d_tokens > 0 && out) {
    moelink_plan_t cp;
    memset(&cp, 0, sizeof cp);
    cp.pair_rows = w->cpairs;
    ML_TRY(ml_cpu_combine_rows(w->front, w->symm + w->off_ret, MOELINK_DTYPE_F32, w->d_tokens,
                               &cp, NULL, out));
  }
  return MOELINK_SUCCESS;
}

static const ml_ep_ops ml_ep_cpu_table = {
    "cpu",
    0, /* steps of any count agreed on the host */
    ml_ep_cpu_size,
    ml_ep_cpu_init,
    ml_ep_cpu_fini,
    ml_ep_cpu_set_weights,
    ml_ep_cpu_forward,
    ml_ep_cpu_dispatch,
    ml_ep_cpu_combine,
};

const ml_ep_ops *ml_ep_cpu_ops(void) { return &ml_ep_cpu_table; }
