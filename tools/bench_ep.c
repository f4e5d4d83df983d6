/* moelink bench ep: the expert-parallel layer (moelink_ep_forward), one
 * process per rank under `moelink launch -n N`, per token count T (tokens
 * per rank; the layer is created with moe.max_tokens = T) beside what the
 * same ranks do in the same run without it:
 *   single  the single-device layer (moelink_moe_forward) with all E experts
 *           on every rank's own device, over the n*T tokens of all ranks:
 *           the EP layer's whole work on one device, n times a rank's share;
 *   nccl    (cuda) the rows the EP layer moves, as NCCL grouped send/recv:
 *           dispatch (each token once to every peer that owns one of its
 *           experts) then combine (one row per (token, slot) whose expert is
 *           on the peer: what the CUDA layer pushes back), counted from this
 *           run's routing of the same tokens, timed per phase;
 *   pieces  moelink_ep_dispatch and moelink_ep_combine on the same routing,
 *           each timed (bandwidth: the token rows a rank sends / time);
 *   seq     dispatch, this rank's experts on the received rows (a local
 *           moelink_moe layer: plan + experts, timed on their own), combine;
 *   extra   the forward's other compute on this rank's T tokens: routing
 *           (the single layer's moelink_moe_route) and the shared expert (a
 *           one-expert layer holding its weights, moelink_moe_forward); with
 *           the experts' time, the compute-only time of the forward.
 * Each rank times its own calls with CUDA events (host clock on the CPU
 * backend), each after a 256 MiB L2-evicting write and a 1-element NCCL
 * all-reduce that lines the ranks up; a T's time is the slowest rank's
 * median. The weights come from the counter-based generator, the same on
 * every rank: each rank binds the full tensors to the single layer and its
 * expert slices to the EP layer. No verification here (tests/mgpu/test_ep.c
 * checks the EP layer against the single-device one). */
#include "cli.h"
#include "gpu.h"
#include "world.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BE_MAX_T 64

typedef struct be_opts {
  moelink_backend_t backend;
  const char *preset; /* NULL: the small cpu shape */
  int hidden, inter, experts, topk, shared_inter; /* -1: the preset's */
  moelink_dtype_t dtype;
  int tokens[BE_MAX_T];
  int ntokens;
  int iters, warmup, threads;
  uint64_t seed;
  const char *json;
  moelink_quant_t quant; /* --dispatch-quant */
  int steps;             /* --steps: also a layer of max_tokens ceil(T / steps) */
  int rounds;            /* --rounds: also a layer of recv_capacity ceil(ranks * T / rounds) */
} be_opts;

/* One T. Times are the slowest rank's median, us. */
typedef struct be_row {
  int tokens;
  double ep_us, single_us, nccl_us;
  double disp_us, comb_us, dc_us;         /* pieces: dispatch, combine, both */
  double nccl_disp_us, nccl_comb_us;
  double seq_us, experts_us;              /* dispatch; local experts; combine */
  double route_us, shared_us;             /* the forward's other compute (extra) */
  double steps_us;        /* --steps: moelink_ep_forward in that many steps */
  int step_tokens;        /* their max_tokens (0: not run) */
  double rounds_us;       /* --rounds: moelink_ep_forward in rounds by expert */
  int rounds_capacity;    /* its recv_capacity (0: not run) */
  double ws_bytes;        /* moelink_ep_workspace_size of the one-step layer, */
  double steps_ws_bytes;  /* of the --steps layer */
  double rounds_ws_bytes; /* and of the --rounds layer (0: not run) */
  double flops_rank;      /* moelink_moe_flops(cfg, T): one rank's share */
  double dispatch_rows;   /* sent per rank, the most over ranks */
  double combine_rows;
  double bytes_rank;      /* (dispatch + combine rows) * H * dtype size, the most over ranks */
  double bytes_total;     /* summed over ranks */
  size_t row_bytes;       /* hidden * dtype size */
  size_t drow_bytes;      /* a dispatched row on the wire: row_bytes, or hidden + its
                             scales with --dispatch-quant */
} be_row;

static const char be_help_text[] =
    "moelink bench ep [options]   (run under: moelink launch -n N -- moelink bench ep)\n"
    "  The expert-parallel MoE layer, every rank of the launch one EP rank owning E/N\n"
    "  experts. Per T (tokens per rank; the layer is created with max_tokens = T): the\n"
    "  median time of moelink_ep_forward with T random tokens on every rank; of the\n"
    "  single-device layer (moelink_moe_forward, all experts) on the N*T tokens of all\n"
    "  ranks on each rank's own device (the whole EP work on one device: N times a\n"
    "  rank's share); and (cuda) of NCCL grouped send/recv moving the rows the EP layer\n"
    "  moves (dispatch: each token once to every peer owning one of its experts; combine:\n"
    "  one row per (token, slot) whose expert is on the peer), counted from the routing of\n"
    "  the same tokens. TFLOP/s of the EP layer: moelink_moe_flops(T) per rank / time.\n"
    "  Then the exchanges alone: moelink_ep_dispatch and moelink_ep_combine, each timed,\n"
    "  with the bandwidth of the token rows a rank sends (beside NCCL's two phases), and\n"
    "  the sequential layer: dispatch, this rank's experts (moelink_moe_plan + _experts\n"
    "  on the received rows, timed alone), combine; and the forward's other compute\n"
    "  (routing, the shared expert alone): with the experts' time, the compute-only time\n"
    "  the forward is set against (fwd/comp). With --steps S > 1, also\n"
    "  moelink_ep_forward of a layer with max_tokens ceil(T / S) and call_tokens T: the\n"
    "  same call in S steps, in 1/S of the receive memory (chunked mode); with --rounds\n"
    "  R > 1, one step with recv_capacity ceil(ranks * T / R): rounds by expert in 1/R\n"
    "  of the receive memory (CUDA; CPU ranks take rounds by token). Their tables give\n"
    "  moelink_ep_workspace_size of both layers (ws_MiB: one step; chunk_MiB).\n"
    "  --backend cuda|cpu     (default cuda when built with it and a GPU is visible)\n"
    "  --preset NAME          (default cuda: deepseek-v3 (H 7168, I 2048, E 256, k 8,\n"
    "                         sigmoid, 4 of 8 groups, shared expert 2048); cpu: a small\n"
    "                         DeepSeek-like shape H 256, I 128, E 16, k 4, 2 of 4 groups,\n"
    "                         shared 128)\n"
    "  --hidden H --inter I --experts E --topk K --shared-inter IS   override the preset's\n"
    "                         (--shared-inter 0: no shared expert)\n"
    "  --dtype bf16|f16       (default bf16)\n"
    "  --tokens T1,T2,...     tokens per rank (default cuda 128,512,2048,4096; cpu 16,64)\n"
    "  --iters N              timed iterations per variant (default cuda 20, cpu 3)\n"
    "  --warmup N             untimed iterations first (default cuda 3, cpu 1)\n"
    "  --threads N            CPU threads per rank (cpu; default cores / ranks)\n"
    "  --seed S               weights and inputs generator seed (default 1)\n"
    "  --steps S              also time the layer in S steps of ceil(T / S) tokens (default 1:\n"
    "                         not)\n"
    "  --rounds R             also time it with recv_capacity ceil(ranks * T / R) (default 1:\n"
    "                         not)\n"
    "  --dispatch-quant none|fp8|mxfp8   how token rows travel to the experts' ranks\n"
    "                         (default none: the layer's dtype; fp8: e4m3 + an fp32 scale\n"
    "                         per 128 elements; mxfp8: e4m3 + an e8m0 scale per 32)\n"
    "  --json FILE            rank 0 writes everything as JSON\n";

void cli_help_bench_ep(void) { fputs(be_help_text, stdout); }

/* ---- options --------------------------------------------------------------- */

static void be_parse(int argc, char **argv, be_opts *o) {
  memset(o, 0, sizeof *o);
  o->backend = moelink_backend_available(MOELINK_BACKEND_CUDA) ? MOELINK_BACKEND_CUDA
                                                               : MOELINK_BACKEND_CPU;
  o->hidden = o->inter = o->experts = o->topk = o->shared_inter = -1;
  o->dtype = MOELINK_DTYPE_BF16;
  o->iters = o->warmup = -1;
  o->seed = 1;
  for (int i = 0; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      cli_help_bench_ep();
      exit(0);
    }
    char name[64];
    const char *val = cli_option_value(argc, argv, &i, name,
                                       cli_option_split("bench ep", a, name, sizeof name));
#define IS(s) (strcmp(name, (s)) == 0)
    if (IS("--backend")) {
      o->backend = cli_backend(name, val);
    } else if (IS("--preset")) {
      o->preset = val;
    } else if (IS("--hidden")) {
      o->hidden = cli_int_arg(name, val, 1);
    } else if (IS("--inter")) {
      o->inter = cli_int_arg(name, val, 1);
    } else if (IS("--experts")) {
      o->experts = cli_int_arg(name, val, 1);
    } else if (IS("--topk")) {
      o->topk = cli_int_arg(name, val, 1);
    } else if (IS("--shared-inter")) {
      o->shared_inter = cli_int_arg(name, val, 0);
    } else if (IS("--dtype")) {
      if (strcmp(val, "bf16") == 0)
        o->dtype = MOELINK_DTYPE_BF16;
      else if (strcmp(val, "f16") == 0)
        o->dtype = MOELINK_DTYPE_F16;
      else
        cli_usage_error("--dtype: expected bf16 or f16, got '%s'", val);
    } else if (IS("--tokens")) {
      o->ntokens = cli_int_list(name, val, o->tokens, BE_MAX_T);
    } else if (IS("--iters")) {
      o->iters = cli_int_arg(name, val, 1);
    } else if (IS("--warmup")) {
      o->warmup = cli_int_arg(name, val, 0);
    } else if (IS("--threads")) {
      o->threads = cli_int_arg(name, val, 0);
    } else if (IS("--seed")) {
      o->seed = (uint64_t)cli_int_arg(name, val, 0);
    } else if (IS("--json")) {
      o->json = val;
    } else if (IS("--steps")) {
      o->steps = cli_int_arg(name, val, 1);
    } else if (IS("--rounds")) {
      o->rounds = cli_int_arg(name, val, 1);
    } else if (IS("--dispatch-quant")) {
      if (strcmp(val, "none") == 0)
        o->quant = MOELINK_QUANT_NONE;
      else if (strcmp(val, "fp8") == 0)
        o->quant = MOELINK_QUANT_FP8;
      else if (strcmp(val, "mxfp8") == 0)
        o->quant = MOELINK_QUANT_MXFP8;
      else
        cli_usage_error("--dispatch-quant: expected none, fp8 or mxfp8, got '%s'", val);
    } else {
      cli_usage_error("bench ep: unknown option '%s' (moelink bench ep --help)", name);
    }
#undef IS
  }
  const int cuda = o->backend == MOELINK_BACKEND_CUDA;
  if (o->iters < 0) o->iters = cuda ? 20 : 3;
  if (o->warmup < 0) o->warmup = cuda ? 3 : 1;
  if (o->ntokens == 0) {
    static const int tc[] = {128, 512, 2048, 4096}, tp[] = {16, 64};
    o->ntokens = cuda ? 4 : 2;
    memcpy(o->tokens, cuda ? tc : tp, sizeof(int) * (size_t)o->ntokens);
  }
  if (!o->preset && cuda) o->preset = "deepseek-v3";
}

/* The layer of the options (max_tokens left for the caller); *custom is set
 * when a flag or the cpu default changed the preset's shape. */
static moelink_moe_config_t be_config(const be_opts *o, int *custom) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  CLI_CALL("moelink_moe_preset", moelink_moe_preset(o->preset ? o->preset : "deepseek-v3", &c));
  *custom = 0;
  if (!o->preset) {
    /* Small enough for a 2-core machine in seconds, DeepSeek's routing. */
    c.hidden = 256;
    c.inter = 128;
    c.num_experts = 16;
    c.top_k = 4;
    c.n_group = 4;
    c.topk_group = 2;
    c.shared_inter = 128;
    *custom = 1;
  }
  if (o->hidden >= 0) c.hidden = o->hidden, *custom = 1;
  if (o->inter >= 0) c.inter = o->inter, *custom = 1;
  if (o->experts >= 0) c.num_experts = o->experts, *custom = 1;
  if (o->topk >= 0) c.top_k = o->topk, *custom = 1;
  if (o->shared_inter >= 0) {
    c.shared_inter = o->shared_inter;
    if (c.shared_inter == 0) c.shared_gate = 0;
    *custom = 1;
  }
  c.dtype = o->dtype;
  return c;
}

/* ---- the world: context, communicators, stream ----------------------------- */

/* ---- one T ------------------------------------------------------------------- */

/* Variants. pieces: moelink_ep_dispatch | moelink_ep_combine (expert
 * outputs: whatever a buffer holds, one row per received (row, slot)); seq:
 * dispatch | the local experts (moelink_moe_plan + moelink_moe_experts of a
 * layer with this rank's experts on the received rows) | combine; nccl:
 * dispatch rows | combine rows. "|" marks a split of the timing. */
enum {
  BE_V_EP = 0,
  BE_V_SINGLE,
  BE_V_PIECES,
  BE_V_SEQ,
  BE_V_NCCL,
  BE_V_STEPS,
  BE_V_ROUNDS,
  BE_V_EXTRA,
  BE_NV
};
#define BE_SEGS 3

typedef struct be_case {
  int T, n, me;
  size_t row;             /* bytes of a token row */
  size_t drow;            /* bytes of a dispatched row (quantized: H + scales) */
  moelink_ep_t ep;
  moelink_ep_t ep_steps;  /* --steps: the same layer in steps (NULL: not run) */
  moelink_ep_t ep_rounds; /* --rounds: the same layer in rounds (NULL: not run) */
  moelink_moe_t single;
  moelink_moe_t local;    /* this rank's experts, max_tokens = the receive capacity */
  moelink_moe_t shared;   /* the shared expert as a one-expert layer (NULL: none) */
  void *sh_out;           /* [T, H] its output */
  void *x_all, *out_all;  /* [n*T, H]; this rank's EP x is its slice of x_all */
  void *out;              /* [T, H] */
  int32_t *ids;           /* [T, k] this rank's routing (backend memory) */
  float *wts;
  void *y;                /* [capacity * local top_k, H]: expert outputs */
  void *plan;             /* the local layer's plan over capacity rows */
  int capacity, ltopk, El;
  /* NCCL: rows per peer, rank-major cnt[src * n + dst] */
  int *disp, *comb;       /* dispatch: tokens src sends dst; combine: (token, slot)
                             pairs of src's tokens on dst's experts (dst sends back) */
  void *sbuf, *rbuf;
} be_case;

/* Time points of one timed call: CUDA events on the stream, or the host clock. */
typedef struct be_clock {
  cli_world *w;
  int n;
  double host[GPU_MARKS];
} be_clock;

static void be_mark(be_clock *k) {
#if CLI_WORLD_GPU
  if (k->w->backend == MOELINK_BACKEND_CUDA) {
    if (gpu_marks_record(&k->w->marks, k->w->stream)) cli_fail("%s", gpu_error());
    ++k->n;
    return;
  }
#endif
  k->host[k->n++] = cli_now();
}

static void be_dispatch(cli_world *w, be_case *c, moelink_ep_recv_t *recv) {
  CLI_CALL("moelink_ep_dispatch",
           moelink_ep_dispatch(c->ep, (const char *)c->x_all + (size_t)c->me * c->T * c->row,
                               c->ids, c->wts, c->T, recv, w->stream));
}

static void be_call(cli_world *w, be_case *c, int variant, be_clock *k) {
  moelink_ep_recv_t recv = MOELINK_EP_RECV_INIT;
  if (variant == BE_V_EP || variant == BE_V_STEPS || variant == BE_V_ROUNDS) {
    CLI_CALL("moelink_ep_forward",
             moelink_ep_forward(variant == BE_V_EP      ? c->ep
                                : variant == BE_V_STEPS ? c->ep_steps
                                                        : c->ep_rounds,
                                (const char *)c->x_all + (size_t)c->me * c->T * c->row, c->T,
                                c->out, w->stream));
  } else if (variant == BE_V_SINGLE) {
    CLI_CALL("moelink_moe_forward",
             moelink_moe_forward(c->single, c->x_all, c->n * c->T, c->out_all, w->stream));
  } else if (variant == BE_V_PIECES) {
    be_dispatch(w, c, &recv);
    be_mark(k);
    CLI_CALL("moelink_ep_combine", moelink_ep_combine(c->ep, c->y, NULL, c->out, w->stream));
  } else if (variant == BE_V_EXTRA) {
    CLI_CALL("moelink_moe_route",
             moelink_moe_route(c->single, (const char *)c->x_all + (size_t)c->me * c->T * c->row,
                               c->T, c->ids, c->wts, w->stream));
    be_mark(k);
    if (c->shared)
      CLI_CALL("moelink_moe_forward (shared expert)",
               moelink_moe_forward(c->shared,
                                   (const char *)c->x_all + (size_t)c->me * c->T * c->row, c->T,
                                   c->sh_out, w->stream));
  } else if (variant == BE_V_SEQ) {
    be_dispatch(w, c, &recv);
    be_mark(k);
    CLI_CALL("moelink_moe_plan",
             moelink_moe_plan(c->local, recv.expert_ids, recv.capacity, c->plan, w->stream));
    CLI_CALL("moelink_moe_experts", moelink_moe_experts(c->local, recv.rows, recv.capacity,
                                                        c->plan, recv.weights, c->y, w->stream));
    be_mark(k);
    moelink_plan_t pv;
    CLI_CALL("moelink_plan_view",
             moelink_plan_view(c->plan, recv.capacity, c->ltopk, c->El,
                               moelink_moe_tile_rows(c->local), &pv));
    CLI_CALL("moelink_ep_combine",
             moelink_ep_combine(c->ep, c->y, pv.pair_rows, c->out, w->stream));
  }
#if CLI_WORLD_GPU
  else {
    /* Dispatch there, then combine back: two grouped exchanges, each row a
     * contiguous run of bytes (ncclChar: the dtype does not matter). */
    cudaStream_t st = (cudaStream_t)w->stream;
    for (int phase = 0; phase < 2; ++phase) {
      size_t so = 0, ro = 0;
      if (phase == 1) be_mark(k);
      CLI_NCCL(ncclGroupStart());
      for (int p = 0; p < c->n; ++p) {
        if (p == c->me) continue;
        /* dispatch: me -> p disp[me][p], p -> me disp[p][me];
         * combine: me -> p comb[p][me], p -> me comb[me][p] */
        const size_t sr = (size_t)(phase == 0 ? c->disp[c->me * c->n + p] : c->comb[p * c->n + c->me]);
        const size_t rr = (size_t)(phase == 0 ? c->disp[p * c->n + c->me] : c->comb[c->me * c->n + p]);
        const size_t rb = phase == 0 ? c->drow : c->row; /* the bytes the EP layer moves */
        if (sr)
          CLI_NCCL(ncclSend((char *)c->sbuf + so * rb, sr * rb, ncclChar, p, w->nccl, st));
        if (rr)
          CLI_NCCL(ncclRecv((char *)c->rbuf + ro * rb, rr * rb, ncclChar, p, w->nccl, st));
        so += sr;
        ro += rr;
      }
      CLI_NCCL(ncclGroupEnd());
    }
  }
#endif
}

/* Medians over iters timed calls of one variant, in us (this rank's):
 * med[0] the whole call, med[1 + i] its i-th segment (NAN when the variant
 * has fewer). */
static void be_time(cli_world *w, be_case *c, int variant, const be_opts *o,
                    double med[1 + BE_SEGS]) {
  double *t = (double *)cli_malloc(sizeof(double) * (size_t)o->iters * (1 + BE_SEGS), "times");
  int nseg = 0;
  for (int it = -o->warmup; it < o->iters; ++it) {
    be_clock k;
    memset(&k, 0, sizeof k);
    k.w = w;
#if CLI_WORLD_GPU
    if (w->backend == MOELINK_BACKEND_CUDA &&
        cli_l2_flush(w->flush, it, w->stream))
      cli_fail("%s", gpu_error());
#endif
    cli_world_barrier(w);
    be_mark(&k);
    be_call(w, c, variant, &k);
    be_mark(&k);
    double seg[GPU_MARKS] = {0};
#if CLI_WORLD_GPU
    if (w->backend == MOELINK_BACKEND_CUDA) {
      if (gpu_marks_read(&w->marks, seg)) cli_fail("%s", gpu_error());
    } else
#endif
    {
      for (int i = 0; i + 1 < k.n; ++i) seg[i] = (k.host[i + 1] - k.host[i]) * 1e3;
    }
    nseg = k.n - 1;
    if (it < 0) continue;
    double total = 0.0;
    for (int i = 0; i < nseg; ++i) total += seg[i];
    t[it] = total * 1e3;
    for (int i = 0; i < BE_SEGS; ++i)
      t[(size_t)(1 + i) * o->iters + it] = i < nseg ? seg[i] * 1e3 : NAN;
  }
  for (int i = 0; i <= BE_SEGS; ++i)
    med[i] = i == 0 || (nseg > 1 && i <= nseg) ? cli_median(t + (size_t)i * o->iters, o->iters)
                                              : NAN;
  free(t);
}

/* Per destination rank, this rank's tokens with an expert there and its
 * (token, slot) pairs there, from the single layer's routing of the same x;
 * then every rank's counts (disp, comb: [n * n], rank-major by source). */
static void be_count(cli_world *w, be_case *c, const moelink_moe_config_t *cfg) {
  const int T = c->T, k = cfg->top_k, n = c->n, per = cfg->num_experts / n;
  const size_t pairs = (size_t)T * (size_t)k;
  int32_t *ids = c->ids = (int32_t *)cli_world_alloc(w, pairs * sizeof(int32_t), "topk ids");
  float *wts = c->wts = (float *)cli_world_alloc(w, pairs * sizeof(float), "topk weights");
  CLI_CALL("moelink_moe_route",
           moelink_moe_route(c->single, (const char *)c->x_all + (size_t)c->me * T * c->row, T,
                             ids, wts, w->stream));
  int32_t *h = ids;
  if (w->backend == MOELINK_BACKEND_CUDA) {
    h = (int32_t *)cli_malloc(pairs * sizeof(int32_t), "topk ids (host)");
    if (gpu_stream_sync(w->stream) || gpu_d2h(h, ids, pairs * sizeof(int32_t)))
      cli_fail("%s", gpu_error());
  }
  float *mine = (float *)cli_malloc(sizeof(float) * 2 * (size_t)n, "counts");
  int *hit = (int *)cli_malloc(sizeof(int) * (size_t)n, "hit");
  memset(mine, 0, sizeof(float) * 2 * (size_t)n);
  for (int t = 0; t < T; ++t) {
    memset(hit, 0, sizeof(int) * (size_t)n);
    for (int j = 0; j < k; ++j) {
      const int e = h[(size_t)t * k + j];
      if (e < 0 || e >= cfg->num_experts) continue;
      hit[e / per] = 1;
      mine[2 * (e / per) + 1] += 1.0f;
    }
    for (int d = 0; d < n; ++d) mine[2 * d] += (float)hit[d];
  }
  float *all = (float *)cli_malloc(sizeof(float) * 2 * (size_t)n * (size_t)n, "all counts");
  cli_world_allgather_f32(w, mine, 2 * n, all);
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < n; ++d) {
      c->disp[s * n + d] = (int)all[2 * (s * n + d)];
      c->comb[s * n + d] = (int)all[2 * (s * n + d) + 1];
    }
  free(all);
  free(hit);
  free(mine);
  if (h != ids) free(h);
}

static void be_run_case(cli_world *w, const be_opts *o, const moelink_moe_config_t *base,
                        const cli_layer *L, int T, be_row *row) {
  be_case c;
  memset(&c, 0, sizeof c);
  c.T = T;
  c.n = w->nranks;
  c.me = w->rank;
  const size_t es = moelink_dtype_size(base->dtype);
  const size_t H = (size_t)base->hidden, I = (size_t)base->inter;
  c.row = H * es;
  c.drow = o->quant ? H + moelink_quant_scale_bytes(o->quant, (int)H) : c.row;
  const int cuda = w->backend == MOELINK_BACKEND_CUDA;

  moelink_ep_config_t ecfg = MOELINK_EP_CONFIG_INIT;
  ecfg.moe = *base;
  ecfg.moe.max_tokens = T;
  /* Every rank's whole step fits at once: the pieces need it on CPU ranks. */
  ecfg.recv_capacity = w->nranks * T;
  ecfg.dispatch_quant = o->quant;
  CLI_CALL("moelink_ep_create", moelink_ep_create(w->comm, &ecfg, &c.ep));
  size_t ws = 0, ws_steps = 0, ws_rounds = 0;
  CLI_CALL("moelink_ep_workspace_size", moelink_ep_workspace_size(w->comm, &ecfg, &ws));
  int first = 0, El = 0;
  CLI_CALL("moelink_ep_get_config", moelink_ep_get_config(c.ep, NULL, &first, &El));
  c.El = El;
  moelink_moe_weights_t lw = L->w;
  lw.gate_up = (const char *)L->w.gate_up + (size_t)first * 2 * I * H * es;
  lw.down = (const char *)L->w.down + (size_t)first * H * I * es;
  CLI_CALL("moelink_ep_set_weights", moelink_ep_set_weights(c.ep, &lw));
  const int step_tokens = o->steps > 1 && T > 1 ? (T + o->steps - 1) / o->steps : 0;
  if (step_tokens) {
    moelink_ep_config_t scfg_ep = ecfg;
    scfg_ep.moe.max_tokens = step_tokens;
    scfg_ep.call_tokens = T;
    scfg_ep.recv_capacity = w->nranks * step_tokens;
    CLI_CALL("moelink_ep_create (steps)", moelink_ep_create(w->comm, &scfg_ep, &c.ep_steps));
    CLI_CALL("moelink_ep_workspace_size (steps)",
             moelink_ep_workspace_size(w->comm, &scfg_ep, &ws_steps));
    CLI_CALL("moelink_ep_set_weights (steps)", moelink_ep_set_weights(c.ep_steps, &lw));
  }
  const int64_t whole = (int64_t)w->nranks * T;
  const int rounds_capacity =
      o->rounds > 1 && whole >= o->rounds ? (int)((whole + o->rounds - 1) / o->rounds) : 0;
  if (rounds_capacity) {
    moelink_ep_config_t rcfg = ecfg;
    rcfg.recv_capacity = rounds_capacity;
    CLI_CALL("moelink_ep_create (rounds)", moelink_ep_create(w->comm, &rcfg, &c.ep_rounds));
    CLI_CALL("moelink_ep_workspace_size (rounds)",
             moelink_ep_workspace_size(w->comm, &rcfg, &ws_rounds));
    CLI_CALL("moelink_ep_set_weights (rounds)", moelink_ep_set_weights(c.ep_rounds, &lw));
  }

  moelink_moe_config_t scfg = *base;
  scfg.max_tokens = c.n * T;
  CLI_CALL("moelink_moe_create (single-device layer)", moelink_moe_create(w->ctx, &scfg, &c.single));
  CLI_CALL("moelink_moe_set_weights", moelink_moe_set_weights(c.single, &L->w));

  const size_t all_rows = (size_t)c.n * (size_t)T;
  c.x_all = cli_world_alloc(w, all_rows * c.row, "x (all ranks)");
  c.out_all = cli_world_alloc(w, all_rows * c.row, "single-device out");
  c.out = cli_world_alloc(w, (size_t)T * c.row, "ep out");
  /* The same tokens on every rank: rank r's EP tokens are rows [r*T, (r+1)*T). */
  CLI_CALL("moelink_fill_random x",
           moelink_fill_random(w->ctx, base->dtype, c.x_all, all_rows * H,
                               ref_tensor_seed(o->seed + 1000003ull * (uint64_t)T, REF_T_X),
                               ref_tensor_scale(base, REF_T_X), 0.0f, w->stream));

  c.disp = (int *)cli_malloc(sizeof(int) * (size_t)c.n * (size_t)c.n, "dispatch counts");
  c.comb = (int *)cli_malloc(sizeof(int) * (size_t)c.n * (size_t)c.n, "combine counts");
  be_count(w, &c, base);
  /* Rows each rank sends over the wire (its own ranks' rows stay local). */
  double drows_max = 0, crows_max = 0, bytes_max = 0, bytes_total = 0;
  size_t s_need = 0, r_need = 0;
  for (int r = 0; r < c.n; ++r) {
    double dr = 0, cr = 0, dr_in = 0, cr_in = 0;
    for (int p = 0; p < c.n; ++p) {
      if (p == r) continue;
      dr += c.disp[r * c.n + p];
      cr += c.comb[p * c.n + r];
      dr_in += c.disp[p * c.n + r];
      cr_in += c.comb[r * c.n + p];
    }
    if (dr > drows_max) drows_max = dr;
    if (cr > crows_max) crows_max = cr;
    const double b = dr * (double)c.drow + cr * (double)c.row;
    if (b > bytes_max) bytes_max = b;
    bytes_total += b;
    if (r == c.me) {
      s_need = (size_t)(dr > cr ? dr : cr);
      r_need = (size_t)(dr_in > cr_in ? dr_in : cr_in);
    }
  }

  /* One dispatch tells the receive capacity: the expert-output buffer and the
   * local layer (this rank's experts on the received rows) are sized by it. */
  {
    moelink_ep_recv_t recv = MOELINK_EP_RECV_INIT;
    be_dispatch(w, &c, &recv);
    c.capacity = recv.capacity;
    c.ltopk = recv.top_k;
    c.y = cli_world_alloc(w, (size_t)c.capacity * (size_t)c.ltopk * c.row, "expert outputs");
    CLI_CALL("moelink_ep_combine", moelink_ep_combine(c.ep, c.y, NULL, c.out, w->stream));
    moelink_moe_config_t lc = MOELINK_MOE_CONFIG_INIT;
    lc.hidden = base->hidden;
    lc.inter = base->inter;
    lc.num_experts = El;
    lc.top_k = c.ltopk;
    lc.dtype = base->dtype;
    lc.max_tokens = c.capacity;
    CLI_CALL("moelink_moe_create (local experts)", moelink_moe_create(w->ctx, &lc, &c.local));
    moelink_moe_weights_t xw = MOELINK_MOE_WEIGHTS_INIT;
    xw.dtype = base->dtype;
    xw.router = L->w.router; /* never used: the rows arrive routed */
    xw.gate_up = lw.gate_up;
    xw.down = lw.down;
    CLI_CALL("moelink_moe_set_weights (local experts)", moelink_moe_set_weights(c.local, &xw));
    c.plan = cli_world_alloc(w, moelink_plan_bytes(c.capacity, c.ltopk, El,
                                                   moelink_moe_tile_rows(c.local)),
                             "local plan");
  }
  /* The shared expert alone: a layer of one expert with its weights (top-1
   * of one: weight 1, the expert's output; no shared gate) */
  if (base->shared_inter > 0) {
    moelink_moe_config_t sc = MOELINK_MOE_CONFIG_INIT;
    sc.hidden = base->hidden;
    sc.inter = base->shared_inter;
    sc.num_experts = 1;
    sc.top_k = 1;
    sc.dtype = base->dtype;
    sc.max_tokens = T;
    CLI_CALL("moelink_moe_create (shared expert)", moelink_moe_create(w->ctx, &sc, &c.shared));
    moelink_moe_weights_t sw = MOELINK_MOE_WEIGHTS_INIT;
    sw.dtype = base->dtype;
    sw.router = L->w.router; /* its first row: the one expert's */
    sw.gate_up = L->w.shared_gate_up;
    sw.down = L->w.shared_down;
    CLI_CALL("moelink_moe_set_weights (shared expert)", moelink_moe_set_weights(c.shared, &sw));
    c.sh_out = cli_world_alloc(w, (size_t)T * c.row, "shared expert out");
  }

  memset(row, 0, sizeof *row);
  row->tokens = T;
  row->ws_bytes = (double)ws;
  row->steps_ws_bytes = (double)ws_steps;
  row->rounds_ws_bytes = (double)ws_rounds;
  row->flops_rank = moelink_moe_flops(base, T);
  row->dispatch_rows = drows_max;
  row->combine_rows = crows_max;
  row->bytes_rank = bytes_max;
  row->bytes_total = bytes_total;
  row->row_bytes = c.row;
  row->drow_bytes = c.drow;

  double t[BE_NV][1 + BE_SEGS];
  for (int v = 0; v < BE_NV; ++v)
    for (int q = 0; q <= BE_SEGS; ++q) t[v][q] = NAN;
  be_time(w, &c, BE_V_EP, o, t[BE_V_EP]);
  be_time(w, &c, BE_V_PIECES, o, t[BE_V_PIECES]);
  be_time(w, &c, BE_V_SEQ, o, t[BE_V_SEQ]);
  be_time(w, &c, BE_V_EXTRA, o, t[BE_V_EXTRA]);
  if (c.ep_steps) be_time(w, &c, BE_V_STEPS, o, t[BE_V_STEPS]);
  if (c.ep_rounds)
    be_time(w, &c, BE_V_ROUNDS, o, t[BE_V_ROUNDS]);
  CLI_CALL("moelink_comm_check after the EP calls", moelink_comm_check(w->comm, w->stream));
  be_time(w, &c, BE_V_SINGLE, o, t[BE_V_SINGLE]);
#if CLI_WORLD_GPU
  if (cuda) {
    c.sbuf = cli_world_alloc(w, s_need * c.row, "nccl send rows");
    c.rbuf = cli_world_alloc(w, r_need * c.row, "nccl recv rows");
    be_time(w, &c, BE_V_NCCL, o, t[BE_V_NCCL]);
    cli_world_free(w, c.sbuf);
    cli_world_free(w, c.rbuf);
  }
#else
  (void)s_need;
  (void)r_need;
#endif
  if (cuda && gpu_stream_sync(w->stream)) cli_fail("%s", gpu_error());

  /* The slowest rank's median: a layer waits for its slowest rank. */
  enum { NV = BE_NV * (1 + BE_SEGS) };
  float tm[NV];
  for (int v = 0; v < BE_NV; ++v)
    for (int q = 0; q <= BE_SEGS; ++q) tm[v * (1 + BE_SEGS) + q] = (float)t[v][q];
  float *tall = (float *)cli_malloc(sizeof(float) * NV * (size_t)c.n, "times");
  cli_world_allgather_f32(w, tm, NV, tall);
  double worst[NV];
  for (int v = 0; v < NV; ++v) {
    worst[v] = -1.0;
    for (int r = 0; r < c.n; ++r) {
      const double x = tall[NV * r + v];
      if (isnan(x)) {
        worst[v] = NAN;
        break;
      }
      if (x > worst[v]) worst[v] = x;
    }
  }
  free(tall);
#define BE_W(v, q) worst[(v) * (1 + BE_SEGS) + (q)]
  row->ep_us = BE_W(BE_V_EP, 0);
  row->single_us = BE_W(BE_V_SINGLE, 0);
  row->dc_us = BE_W(BE_V_PIECES, 0);
  row->disp_us = BE_W(BE_V_PIECES, 1);
  row->comb_us = BE_W(BE_V_PIECES, 2);
  row->seq_us = BE_W(BE_V_SEQ, 0);
  row->experts_us = BE_W(BE_V_SEQ, 2);
  row->route_us = c.shared ? BE_W(BE_V_EXTRA, 1) : BE_W(BE_V_EXTRA, 0);
  row->shared_us = c.shared ? BE_W(BE_V_EXTRA, 2) : 0.0;
  row->nccl_us = BE_W(BE_V_NCCL, 0);
  row->nccl_disp_us = BE_W(BE_V_NCCL, 1);
  row->nccl_comb_us = BE_W(BE_V_NCCL, 2);
  row->steps_us = BE_W(BE_V_STEPS, 0);
  row->step_tokens = step_tokens;
  row->rounds_us = BE_W(BE_V_ROUNDS, 0);
  row->rounds_capacity = rounds_capacity;
#undef BE_W

  free(c.disp);
  free(c.comb);
  cli_world_free(w, c.x_all);
  cli_world_free(w, c.out_all);
  cli_world_free(w, c.out);
  cli_world_free(w, c.ids);
  cli_world_free(w, c.wts);
  cli_world_free(w, c.y);
  cli_world_free(w, c.plan);
  CLI_CALL("moelink_moe_destroy", moelink_moe_destroy(c.local));
  CLI_CALL("moelink_moe_destroy", moelink_moe_destroy(c.shared));
  cli_world_free(w, c.sh_out);
  CLI_CALL("moelink_moe_destroy", moelink_moe_destroy(c.single));
  CLI_CALL("moelink_ep_destroy", moelink_ep_destroy(c.ep));
  CLI_CALL("moelink_ep_destroy", moelink_ep_destroy(c.ep_steps));
  CLI_CALL("moelink_ep_destroy", moelink_ep_destroy(c.ep_rounds));
}

/* ---- output ------------------------------------------------------------------ */

/* The forward's compute without its exchanges: local experts, routing and
 * the shared expert, each timed alone. */
static double be_compute_us(const be_row *r) { return r->experts_us + r->route_us + r->shared_us; }

/* The forward against max(compute_us, its exchanges): fwd/max with the
 * experts alone, fwd/comp with be_compute_us. */
static double be_fwd_over(const be_row *r, double compute_us) {
  return r->ep_us / fmax(compute_us, r->dc_us);
}

/* The chunked table: --steps (rounds 0) or --rounds rows against one step. */
static void be_print_chunked(const be_row *rows, int nrows, int rounds) {
  printf("%7s %11s %11s %11s %9s %11s %11s\n", "T", rounds ? "capacity" : "step_tok", "ep_us",
         rounds ? "rounds_us" : "steps_us", "kept", "ws_MiB", "chunk_MiB");
  for (int i = 0; i < nrows; ++i) {
    const be_row *r = &rows[i];
    const int size = rounds ? r->rounds_capacity : r->step_tokens;
    const double us = rounds ? r->rounds_us : r->steps_us;
    const double ws = rounds ? r->rounds_ws_bytes : r->steps_ws_bytes;
    if (size)
      printf("%7d %11d %11.1f %11.1f %8.1f%% %11.1f %11.1f\n", r->tokens, size, r->ep_us, us,
             100.0 * r->ep_us / us, r->ws_bytes / 1048576.0, ws / 1048576.0);
  }
}

static void be_write_json(const char *path, const be_opts *o, const cli_world *w,
                          const char *device, const moelink_moe_config_t *c, const char *shape,
                          const be_row *rows, int nrows) {
  const int cuda = o->backend == MOELINK_BACKEND_CUDA;
  FILE *f = fopen(path, "w");
  if (!f) cli_fail("--json: cannot open '%s' for writing", path);
  cli_json_begin(f, "moelink bench ep");
  fprintf(f, ",\n  \"backend\": \"%s\",\n  \"%s\": ", cuda ? "cuda" : "cpu", cuda ? "gpu" : "cpu");
  cli_json_str(f, device);
  fprintf(f, ",\n  \"nranks\": %d,\n  \"shape\": ", w->nranks);
  cli_json_str(f, shape);
  fprintf(f, ",\n  \"config\": {\"hidden\": %d, \"inter\": %d, \"experts\": %d, \"top_k\": %d, "
             "\"router\": \"%s\", \"renormalize\": %s, \"n_group\": %d, \"topk_group\": %d, "
             "\"routed_scaling\": %g, \"correction_bias\": %s, \"shared_inter\": %d, "
             "\"shared_gate\": %s, \"dtype\": \"%s\"}",
          c->hidden, c->inter, c->num_experts, c->top_k, cli_router_name(c->router),
          c->renormalize ? "true" : "false", c->n_group, c->topk_group, (double)c->routed_scaling,
          c->correction_bias ? "true" : "false", c->shared_inter,
          c->shared_gate ? "true" : "false", moelink_dtype_name(c->dtype));
  fprintf(f, ",\n  \"dispatch_quant\": \"%s\"",
          o->quant == MOELINK_QUANT_FP8     ? "fp8"
          : o->quant == MOELINK_QUANT_MXFP8 ? "mxfp8"
                                            : "none");
  fprintf(f, ",\n  \"experts_per_rank\": %d,\n  \"iters\": %d,\n  \"warmup\": %d,\n"
             "  \"seed\": %llu,\n  \"timing\": ",
          c->num_experts / w->nranks, o->iters, o->warmup, (unsigned long long)o->seed);
  cli_json_str(f, cuda ? "per rank: median of iters CUDA-event-timed calls after warmup, each "
                        "after a 256 MiB L2 flush (l2_flush) and a 1-element NCCL all-reduce "
                        "that lines the ranks up; a row's time is the slowest rank's median"
                      : "per rank: median of iters host-clock-timed calls after warmup, each "
                        "after a barrier; a row's time is the slowest rank's median");
  fprintf(f, ",\n  \"l2_flush\": ");
  cli_json_str(f, cuda ? cli_l2_flush_name() : NULL);
  fprintf(f, ",\n  \"variants\": ");
  cli_json_str(f, "ep: moelink_ep_forward, tokens random on every rank, the layer created with "
                  "max_tokens = tokens; single: moelink_moe_forward with all experts on "
                  "nranks * tokens tokens on each rank's own device (the EP layer's total work "
                  "on one device, nranks times a rank's share); nccl (cuda only): ncclSend/"
                  "ncclRecv in two groups, dispatch then combine, of the rows the EP layer "
                  "moves between ranks for the same tokens (dispatch: a token once to each peer "
                  "owning one of its experts; combine: one row per (token, slot) whose expert "
                  "is on the peer, as the CUDA layer returns them), rows only (not the EP "
                  "layer's per-row routing metadata of (1 + 2k) * 4 bytes), timed per phase; "
                  "dispatch / combine: moelink_ep_dispatch then moelink_ep_combine on the same "
                  "routing (expert outputs: an unwritten buffer), timed per call, and "
                  "dispatch_combine_us both; sequential: moelink_ep_dispatch, then "
                  "moelink_moe_plan + moelink_moe_experts of a layer with this rank's experts "
                  "on the received rows (experts_us), then moelink_ep_combine; extra: "
                  "moelink_moe_route of the single layer on this rank's tokens (route_us), then "
                  "the shared expert as a one-expert layer's moelink_moe_forward "
                  "(shared_expert_us); compute_us = experts_us + route_us + shared_expert_us, "
                  "the forward's compute without its exchanges; forward_over_max_compute_comm "
                  "= ep_us / max(compute_us, dispatch_combine_us), "
                  "forward_over_max_experts_comm the same with experts_us");
  fprintf(f, ",\n  \"bytes\": ");
  cli_json_str(f, "bytes_sent_per_rank: (dispatch_rows + combine_rows) * hidden * dtype size "
                 "sent by a rank to its peers, the most over ranks; dispatch_rows / "
                 "combine_rows likewise (most over ranks); bytes_sent_total: summed over "
                 "ranks; dispatch_GBps / combine_GBps (and nccl_*): dispatch_rows (combine_rows) "
                 "* hidden * dtype size / that phase's time: a rank's bandwidth per direction "
                 "(it receives about as much as it sends), token rows only");
  fprintf(f, ",\n  \"flops\": ");
  cli_json_str(f, "flops_per_rank = moelink_moe_flops(cfg, tokens); ep_TFLOPs = flops_per_rank "
                 "/ ep time; single_TFLOPs = moelink_moe_flops(cfg, nranks * tokens) / single "
                 "time");
  fprintf(f, ",\n  \"rows\": [\n");
  for (int i = 0; i < nrows; ++i) {
    const be_row *r = &rows[i];
    fprintf(f, "    {\"tokens\": %d, \"single_tokens\": %d", r->tokens, r->tokens * w->nranks);
    cli_json_field(f, "ep_us", r->ep_us);
    cli_json_field(f, "ep_TFLOPs", cli_tflops(r->flops_rank, r->ep_us));
    cli_json_field(f, "single_us", r->single_us);
    cli_json_field(f, "single_TFLOPs", cli_tflops(moelink_moe_flops(c, r->tokens * w->nranks),
                                              r->single_us));
    cli_json_field(f, "nccl_us", cuda ? r->nccl_us : NAN);
    cli_json_field(f, "flops_per_rank", r->flops_rank);
    cli_json_field(f, "dispatch_rows", r->dispatch_rows);
    cli_json_field(f, "combine_rows", r->combine_rows);
    cli_json_field(f, "bytes_sent_per_rank", r->bytes_rank);
    cli_json_field(f, "bytes_sent_total", r->bytes_total);
    cli_json_field(f, "nccl_GBps_per_rank", cuda ? r->bytes_rank / (r->nccl_us * 1e-6) / 1e9 : NAN);
    const double db = r->dispatch_rows * (double)r->drow_bytes;
    const double cb = r->combine_rows * (double)r->row_bytes;
    cli_json_field(f, "dispatch_us", r->disp_us);
    cli_json_field(f, "dispatch_GBps", db / (r->disp_us * 1e-6) / 1e9);
    cli_json_field(f, "combine_us", r->comb_us);
    cli_json_field(f, "combine_GBps", cb / (r->comb_us * 1e-6) / 1e9);
    cli_json_field(f, "dispatch_combine_us", r->dc_us);
    cli_json_field(f, "nccl_dispatch_us", cuda ? r->nccl_disp_us : NAN);
    cli_json_field(f, "nccl_dispatch_GBps", cuda ? db / (r->nccl_disp_us * 1e-6) / 1e9 : NAN);
    cli_json_field(f, "nccl_combine_us", cuda ? r->nccl_comb_us : NAN);
    cli_json_field(f, "nccl_combine_GBps", cuda ? cb / (r->nccl_comb_us * 1e-6) / 1e9 : NAN);
    cli_json_field(f, "sequential_us", r->seq_us);
    cli_json_field(f, "experts_us", r->experts_us);
    cli_json_field(f, "route_us", r->route_us);
    cli_json_field(f, "shared_expert_us", r->shared_us);
    cli_json_field(f, "compute_us", be_compute_us(r));
    cli_json_field(f, "forward_over_max_experts_comm", be_fwd_over(r, r->experts_us));
    cli_json_field(f, "forward_over_max_compute_comm", be_fwd_over(r, be_compute_us(r)));
    cli_json_field(f, "workspace_bytes", r->ws_bytes);
    if (r->step_tokens) {
      fprintf(f, ", \"step_tokens\": %d", r->step_tokens);
      cli_json_field(f, "steps_workspace_bytes", r->steps_ws_bytes);
      cli_json_field(f, "steps_us", r->steps_us);
      cli_json_field(f, "steps_throughput_of_ep", r->ep_us / r->steps_us);
    }
    if (r->rounds_capacity) {
      fprintf(f, ", \"rounds_capacity\": %d", r->rounds_capacity);
      cli_json_field(f, "rounds_workspace_bytes", r->rounds_ws_bytes);
      cli_json_field(f, "rounds_us", r->rounds_us);
      cli_json_field(f, "rounds_throughput_of_ep", r->ep_us / r->rounds_us);
    }
    fprintf(f, "}%s\n", i + 1 < nrows ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  if (fclose(f) != 0) cli_fail("--json: error writing '%s'", path);
}

int cli_cmd_bench_ep(int argc, char **argv) {
  be_opts o;
  be_parse(argc, argv, &o);
  (void)cli_l2_flush_name(); /* a bad MOELINK_BENCH_L2_FLUSH is a usage error on any backend */
  int custom = 0;
  const moelink_moe_config_t cfg = be_config(&o, &custom);
  cli_world w;
  cli_world_open(&w, "bench ep", o.backend, o.threads);
  const int cuda = o.backend == MOELINK_BACKEND_CUDA;
  if (cfg.num_experts % w.nranks)
    cli_usage_error("bench ep: %d experts do not split over %d ranks", cfg.num_experts, w.nranks);
  char device[256] = "cpu";
  if (cuda && gpu_device_name(device, sizeof device)) cli_fail("%s", gpu_error());
  if (!cuda) cli_cpu_model(device, sizeof device);
  char shape[96];
  snprintf(shape, sizeof shape, "%s%s", o.preset ? o.preset : "small",
           custom ? (o.preset ? " (custom: flags changed the preset)" : " (custom, DeepSeek-like)")
                  : " (preset)");
  char groups[16] = "-";
  if (cfg.n_group > 1) snprintf(groups, sizeof groups, "%d/%d", cfg.topk_group, cfg.n_group);

  if (w.rank == 0) {
    printf("moelink bench ep: %d ranks (EP = %d, %d experts each), %s\n", w.nranks, w.nranks,
           cfg.num_experts / w.nranks, device);
    char shared[32] = "none";
    if (cfg.shared_inter > 0)
      snprintf(shared, sizeof shared, "inter %d%s", cfg.shared_inter,
               cfg.shared_gate ? " gated" : "");
    printf("layer %s: H %d, I %d, E %d, k %d, %s router, groups %s, shared expert %s, %s\n",
           shape, cfg.hidden, cfg.inter, cfg.num_experts, cfg.top_k, cli_router_name(cfg.router),
           groups, shared, moelink_dtype_name(cfg.dtype));
    if (o.quant)
      printf("dispatched rows travel as %s (e4m3 + %s)\n",
             o.quant == MOELINK_QUANT_FP8 ? "FP8" : "MXFP8",
             o.quant == MOELINK_QUANT_FP8 ? "an fp32 scale per 128 elements"
                                          : "an e8m0 scale per 32 elements");
    printf("timing: median of %d after %d warm-up, %s%s%s; the slowest rank's median\n",
           o.iters, o.warmup, cuda ? "CUDA events, L2 flushed (256 MiB " : "host clock",
           cuda ? cli_l2_flush_name() : "", cuda ? ") and ranks lined up before each"
                                                : ", ranks lined up before each");
    printf("T = tokens per rank; single = one device, all experts, %d*T tokens (%dx a rank's "
           "work)%s\n",
           w.nranks, w.nranks,
           cuda ? "; nccl = send/recv of the same rows (dispatch there + combine back)" : "");
    printf("%7s %11s %9s %12s %9s", "T", "ep_us", cuda ? "TFLOP/s" : "GFLOP/s", "single_us",
           cuda ? "TFLOP/s" : "GFLOP/s");
    if (cuda) printf(" %11s", "nccl_us");
    printf(" %14s %10s %10s\n", "sent/rank", "disp_rows", "comb_rows");
    fflush(stdout);
  }

  cli_layer L;
  cli_layer_make(&L, w.ctx, &cfg, o.seed, 0.0, w.stream);
  if (cuda && gpu_stream_sync(w.stream)) cli_fail("%s", gpu_error());
  be_row *rows = (be_row *)cli_malloc(sizeof(be_row) * (size_t)o.ntokens, "rows");
  const double unit = cuda ? 1.0 : 1e3;
  for (int i = 0; i < o.ntokens; ++i) {
    be_row *r = &rows[i];
    be_run_case(&w, &o, &cfg, &L, o.tokens[i], r);
    if (w.rank == 0) {
      char b[32];
      cli_fmt_bytes(r->bytes_rank, b, sizeof b);
      printf("%7d %11.1f %9.2f %12.1f %9.2f", r->tokens, r->ep_us,
             cli_tflops(r->flops_rank, r->ep_us) * unit, r->single_us,
             cli_tflops(moelink_moe_flops(&cfg, r->tokens * w.nranks), r->single_us) * unit);
      if (cuda) printf(" %11.1f", r->nccl_us);
      printf(" %14s %10.0f %10.0f\n", b, r->dispatch_rows, r->combine_rows);
      fflush(stdout);
    }
  }
  if (w.rank == 0) {
    /* The exchanges on their own, bandwidth per direction (rows sent by a rank / time). */
    printf("\nthe exchanges (moelink_ep_dispatch / moelink_ep_combine%s), GB/s = token-row "
           "bytes a rank sends / time;\nseq = dispatch, the local experts (experts_us), "
           "combine; extra = routing + the shared expert alone (the forward's other compute);\n"
           "fwd/max = ep_us / max(experts_us, d+c_us); fwd/comp = ep_us / max(experts_us + "
           "extra_us, d+c_us)\n",
           cuda ? " beside NCCL send/recv of the same rows" : "");
    printf("%7s %11s %7s", "T", "dispatch_us", "GB/s");
    if (cuda) printf(" %10s %7s", "nccl_us", "GB/s");
    printf(" %11s %7s", "combine_us", "GB/s");
    if (cuda) printf(" %10s %7s", "nccl_us", "GB/s");
    printf(" %9s %11s %11s %9s %8s %9s\n", "d+c_us", "seq_us", "experts_us", "extra_us", "fwd/max",
           "fwd/comp");
    for (int i = 0; i < o.ntokens; ++i) {
      const be_row *r = &rows[i];
      const double db = r->dispatch_rows * (double)r->drow_bytes;
      const double cb = r->combine_rows * (double)r->row_bytes;
      printf("%7d %11.1f %7.1f", r->tokens, r->disp_us, db / r->disp_us * 1e-3);
      if (cuda) printf(" %10.1f %7.1f", r->nccl_disp_us, db / r->nccl_disp_us * 1e-3);
      printf(" %11.1f %7.1f", r->comb_us, cb / r->comb_us * 1e-3);
      if (cuda) printf(" %10.1f %7.1f", r->nccl_comb_us, cb / r->nccl_comb_us * 1e-3);
      printf(" %9.1f %11.1f %11.1f %9.1f %8.3f %9.3f\n", r->dc_us, r->seq_us, r->experts_us,
             r->route_us + r->shared_us, be_fwd_over(r, r->experts_us),
             be_fwd_over(r, be_compute_us(r)));
    }
    if (o.steps > 1) {
      printf("\nchunked (--steps %d): moelink_ep_forward of T tokens in steps of max_tokens "
             "ceil(T / %d) (receive memory 1/%d of one step's), throughput against one step\n",
             o.steps, o.steps, o.steps);
      be_print_chunked(rows, o.ntokens, 0);
    }
    if (o.rounds > 1) {
      printf("\nchunked (--rounds %d): moelink_ep_forward of T tokens with recv_capacity "
             "ceil(ranks * T / %d) (receive memory 1/%d of one step's), throughput against one "
             "step\n",
             o.rounds, o.rounds, o.rounds);
      be_print_chunked(rows, o.ntokens, 1);
    }
    fflush(stdout);
  }
  if (w.rank == 0 && o.json) {
    be_write_json(o.json, &o, &w, device, &cfg, shape, rows, o.ntokens);
    printf("wrote %s\n", o.json);
  }
  free(rows);
  if (cuda && gpu_stream_sync(w.stream)) cli_fail("%s", gpu_error());
  cli_layer_free(&L);
  cli_world_close(&w);
  return 0;
}
