/* Expert parallelism, front end: every public ep entry point checks its
 * arguments here, so a backend (src/ep/cpu/, src/ep/cuda/) only sees a
 * valid config, bound weights and usable buffers. Nothing here knows how
 * ranks talk. */
#include "ep/ep.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The CUDA implementation (src/ep/cuda/) is built with the NCCL communicator. */
#ifndef MOELINK_HAVE_NCCL
const ml_ep_ops *ml_ep_cuda_ops(void) { return NULL; }
#endif

moelink_moe_config_t ml_ep_local_config(const moelink_ep_config_t *cfg, int nranks, int max_rows) {
  const moelink_moe_config_t *c = &cfg->moe;
  moelink_moe_config_t l = MOELINK_MOE_CONFIG_INIT;
  const int El = c->num_experts / nranks;
  l.hidden = c->hidden;
  l.inter = c->inter;
  l.num_experts = El;
  l.top_k = c->top_k < El ? c->top_k : El;
  l.dtype = c->dtype;
  l.max_tokens = max_rows;
  l.fp8_experts = c->fp8_experts;
  return l;
}

uint64_t ml_ep_config_hash(const moelink_ep_config_t *cfg) {
  const moelink_moe_config_t *c = &cfg->moe;
  uint32_t scaling;
  memcpy(&scaling, &c->routed_scaling, 4);
  const int64_t f[] = {c->hidden,     c->inter,        c->num_experts,     c->top_k,
                       c->router,     c->renormalize,  c->n_group,         c->topk_group,
                       scaling,       c->correction_bias, c->shared_inter, c->shared_gate,
                       c->dtype,      c->max_tokens,   c->fp8_experts,     cfg->recv_capacity,
                       cfg->dispatch_quant, cfg->call_tokens};
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < sizeof f / sizeof f[0]; ++i)
    h = (h ^ (uint64_t)f[i]) * 1099511628211ull;
  return h;
}

moelink_status_t ml_ep_bind_layers(moelink_ep_t ep, moelink_moe_t front, moelink_moe_t local) {
  if (front) ML_TRY(moelink_moe_set_weights(front, &ep->w));
  moelink_moe_weights_t lw = MOELINK_MOE_WEIGHTS_INIT;
  lw.dtype = ep->w.dtype;
  lw.router = ep->w.router; /* the local layer never routes: rows arrive routed */
  lw.gate_up = ep->w.gate_up;
  lw.down = ep->w.down;
  lw.gate_up_scale = ep->w.gate_up_scale;
  lw.down_scale = ep->w.down_scale;
  return moelink_moe_set_weights(local, &lw);
}

static moelink_status_t ml_ep_table(moelink_comm_t comm, const ml_ep_ops **ops) {
  *ops = NULL;
  switch (comm->ctx->backend) {
  case MOELINK_BACKEND_CPU: *ops = ml_ep_cpu_ops(); break;
  case MOELINK_BACKEND_CUDA: *ops = ml_ep_cuda_ops(); break;
  }
  if (!*ops)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "ep: expert parallelism is not available for the %s backend in this build "
                   "(the cuda one needs the NCCL communicator)",
                   comm->ctx->backend == MOELINK_BACKEND_CUDA ? "cuda" : "given");
  return MOELINK_SUCCESS;
}

/* Checks cfg for comm, picks the backend's table (*ops) and copies cfg into
 * *out with recv_capacity and call_tokens resolved. */
static moelink_status_t ml_ep_config_check(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                           moelink_ep_config_t *out, const ml_ep_ops **ops) {
  if (!comm) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep: communicator is NULL");
  if (!cfg) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep: config is NULL");
  if (cfg->size != sizeof *cfg)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "ep: config size %zu != %zu: initialize with MOELINK_EP_CONFIG_INIT",
                   cfg->size, sizeof *cfg);
  moelink_status_t s = moelink_moe_config_check(&cfg->moe);
  if (s != MOELINK_SUCCESS) {
    char why[400];
    snprintf(why, sizeof why, "%s", moelink_last_error());
    return ml_fail(s, "ep: config.moe: %s", why);
  }
  if (cfg->moe.fp8_shared)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "ep: config.moe.fp8_shared is not supported by the expert-parallel layer "
                   "(its shared expert runs in dtype: fp8_shared 0)");
  const int n = comm->nranks, E = cfg->moe.num_experts;
  if (E % n != 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "ep: num_experts %d is not a multiple of the %d ranks: experts are split "
                   "evenly (E / ranks per rank)",
                   E, n);
  if (cfg->recv_capacity < 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep: recv_capacity %d must be >= 0 (0: default)",
                   cfg->recv_capacity);
  if (cfg->call_tokens < 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "ep: call_tokens %d must be >= 0 (0: moe.max_tokens)", cfg->call_tokens);
  if (cfg->dispatch_quant != MOELINK_QUANT_NONE) {
    const int b = moelink_quant_block(cfg->dispatch_quant);
    if (b == 0)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "ep: dispatch_quant %d is not NONE (0), FP8 (1) or MXFP8 (2)",
                     (int)cfg->dispatch_quant);
    if (cfg->moe.hidden % b != 0)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "ep: hidden %d is not a multiple of the %s block of %d elements",
                     cfg->moe.hidden, cfg->dispatch_quant == MOELINK_QUANT_FP8 ? "FP8" : "MXFP8",
                     b);
  }
  ML_TRY(ml_ep_table(comm, ops));
  *out = *cfg;
  if (out->call_tokens == 0) out->call_tokens = cfg->moe.max_tokens;
  if (out->recv_capacity == 0) {
    /* CUDA ranks (steps from the config): every source's whole step, one
     * round whatever the routing (capturable); CPU ranks: about one round
     * with balanced routing */
    const int64_t spread = (*ops)->steps_from_config ? n : n < cfg->moe.top_k ? n : cfg->moe.top_k;
    const int64_t cap = (int64_t)cfg->moe.max_tokens * spread;
    out->recv_capacity = cap > INT32_MAX / 4 / cfg->moe.top_k
                             ? (int)(INT32_MAX / 4 / cfg->moe.top_k)
                             : (int)cap;
  }
  /* Received rows times slots index int32 plans on the expert side. */
  if ((int64_t)out->recv_capacity * cfg->moe.top_k > INT32_MAX / 4)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep: recv_capacity %d * top_k %d is too large",
                   out->recv_capacity, cfg->moe.top_k);
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_ep_workspace_size(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                           size_t *bytes) {
  ml_clear_error();
  if (!bytes) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep_workspace_size: bytes is NULL");
  *bytes = 0;
  moelink_ep_config_t c;
  const ml_ep_ops *ops;
  ML_TRY(ml_ep_config_check(comm, cfg, &c, &ops));
  return ops->workspace_size(comm, &c, bytes);
}

moelink_status_t moelink_ep_create(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                   moelink_ep_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep_create: out is NULL");
  *out = NULL;
  moelink_ep_config_t c;
  const ml_ep_ops *ops;
  ML_TRY(ml_ep_config_check(comm, cfg, &c, &ops));
  moelink_ep_t ep = (moelink_ep_t)calloc(1, sizeof *ep);
  if (!ep) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "ep_create: out of host memory");
  ep->comm = comm;
  ep->cfg = c;
  ep->local_experts = c.moe.num_experts / comm->nranks;
  ep->first_expert = comm->rank * ep->local_experts;
  ep->ops = ops;
  moelink_status_t s = ops->init(ep);
  if (s != MOELINK_SUCCESS) {
    free(ep);
    return s;
  }
  *out = ep;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_ep_destroy(moelink_ep_t ep) {
  ml_clear_error();
  if (!ep) return MOELINK_SUCCESS;
  ep->ops->fini(ep);
  free(ep);
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_ep_get_config(moelink_ep_t ep, moelink_ep_config_t *cfg,
                                       int *first_expert, int *local_experts) {
  ml_clear_error();
  if (!ep) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep_get_config: ep is NULL");
  if (cfg) *cfg = ep->cfg;
  if (first_expert) *first_expert = ep->first_expert;
  if (local_experts) *local_experts = ep->local_experts;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_ep_set_weights(moelink_ep_t ep, const moelink_moe_weights_t *w) {
  ml_clear_error();
  const moelink_status_t bad = MOELINK_ERR_INVALID_ARGUMENT;
  if (!ep) return ml_fail(bad, "ep_set_weights: ep is NULL");
  if (!w) return ml_fail(bad, "ep_set_weights: weights is NULL");
  if (w->size != sizeof *w)
    return ml_fail(bad, "ep_set_weights: weights size %zu != %zu: initialize with "
                        "MOELINK_MOE_WEIGHTS_INIT",
                   w->size, sizeof *w);
  const moelink_moe_config_t *c = &ep->cfg.moe;
  if (w->dtype != c->dtype)
    return ml_fail(MOELINK_ERR_DTYPE_MISMATCH, "ep_set_weights: weights dtype %s != layer dtype %s",
                   moelink_dtype_name(w->dtype), moelink_dtype_name(c->dtype));
  if (!w->router) return ml_fail(bad, "ep_set_weights: router [E, H] is NULL");
  if (!w->gate_up)
    return ml_fail(bad, "ep_set_weights: gate_up (this rank's %d experts) is NULL",
                   ep->local_experts);
  if (!w->down)
    return ml_fail(bad, "ep_set_weights: down (this rank's %d experts) is NULL",
                   ep->local_experts);
  if (c->correction_bias != !!w->correction_bias)
    return ml_fail(bad, "ep_set_weights: correction_bias %s but config.correction_bias is %d",
                   w->correction_bias ? "given" : "is NULL", c->correction_bias);
  const int has_shared = w->shared_gate_up || w->shared_down;
  if (c->shared_inter > 0 && (!w->shared_gate_up || !w->shared_down))
    return ml_fail(bad, "ep_set_weights: shared_gate_up/shared_down are NULL but shared_inter is %d",
                   c->shared_inter);
  if (c->shared_inter == 0 && has_shared)
    return ml_fail(bad, "ep_set_weights: shared expert weights given but config.shared_inter is 0");
  if (c->shared_gate != !!w->shared_gate)
    return ml_fail(bad, "ep_set_weights: shared_gate %s but config.shared_gate is %d",
                   w->shared_gate ? "given" : "is NULL", c->shared_gate);
  ep->w = *w;
  moelink_status_t s = ep->ops->set_weights(ep);
  ep->has_weights = s == MOELINK_SUCCESS;
  return s;
}

moelink_status_t moelink_ep_forward(moelink_ep_t ep, const void *x, int num_tokens, void *out,
                                    void *stream) {
  ml_clear_error();
  if (!ep) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep_forward: ep is NULL");
  if (ep->dispatched)
    return ml_fail(MOELINK_ERR_INVALID_STATE,
                   "ep_forward on rank %d between moelink_ep_dispatch and its moelink_ep_combine",
                   ep->comm->rank);
  if (!ep->has_weights)
    return ml_fail(MOELINK_ERR_INVALID_STATE, "ep_forward before moelink_ep_set_weights on rank %d",
                   ep->comm->rank);
  /* A bad argument is this rank's alone: it still serves its experts with no
   * tokens of its own, so the peers finish the call. */
  char why[200] = "";
  const size_t row = (size_t)ep->cfg.moe.hidden * moelink_dtype_size(ep->cfg.moe.dtype);
  if (num_tokens < 0) {
    snprintf(why, sizeof why, "num_tokens %d must be >= 0", num_tokens);
  } else if (num_tokens > 0 && (!x || !out)) {
    snprintf(why, sizeof why, "%s is NULL with num_tokens %d", !x ? "x" : "out", num_tokens);
  } else if (num_tokens > ep->cfg.call_tokens && ep->ops->steps_from_config) {
    /* The steps of the call come from call_tokens (every rank the same). */
    snprintf(why, sizeof why, "num_tokens %d > the config's call_tokens %d", num_tokens,
             ep->cfg.call_tokens);
  } else if (num_tokens > 0) {
    const uintptr_t xs = (uintptr_t)x, os = (uintptr_t)out, len = row * (size_t)num_tokens;
    if (xs < os + len && os < xs + len) snprintf(why, sizeof why, "x and out overlap");
  }
  if (why[0]) {
    moelink_status_t s = ep->ops->forward(ep, NULL, 0, NULL, stream);
    if (s != MOELINK_SUCCESS) return s;
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "ep_forward on rank %d: %s (took part with no tokens)", ep->comm->rank, why);
  }
  return ep->ops->forward(ep, x, num_tokens, out, stream);
}

/* Both dispatch calls: x, or (quantized) xq + xs. */
static moelink_status_t ml_ep_dispatch_any(moelink_ep_t ep, int quantized, const void *x,
                                           const uint8_t *xq, const void *xs,
                                           const int32_t *topk_ids, const float *topk_weights,
                                           int num_tokens, moelink_ep_recv_t *recv,
                                           void *stream) {
  const char *fn = quantized ? "ep_dispatch_quantized" : "ep_dispatch";
  ml_clear_error();
  if (!ep) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: ep is NULL", fn);
  if (ep->dispatched)
    return ml_fail(MOELINK_ERR_INVALID_STATE,
                   "%s on rank %d: the previous dispatch has not been combined "
                   "(call moelink_ep_combine first)",
                   fn, ep->comm->rank);
  /* As in forward, a bad argument is this rank's alone: it takes part with
   * no tokens, and the peers finish (the caller must still combine). */
  char why[200] = "";
  const int max = ep->cfg.moe.max_tokens;
  const int blind = !recv || recv->size != sizeof *recv;
  if (!recv) {
    snprintf(why, sizeof why, "recv is NULL");
  } else if (blind) {
    snprintf(why, sizeof why, "recv size %zu != %zu: initialize with MOELINK_EP_RECV_INIT",
             recv->size, sizeof *recv);
  } else if (num_tokens < 0 || num_tokens > max) {
    snprintf(why, sizeof why, "num_tokens %d outside [0, max_tokens %d]", num_tokens, max);
  } else if (quantized && ep->cfg.dispatch_quant == MOELINK_QUANT_NONE) {
    snprintf(why, sizeof why, "the layer's dispatch_quant is NONE: rows travel unquantized");
  } else if (num_tokens > 0) {
    const char *miss = quantized ? (!xq ? "xq" : !xs ? "scales" : NULL) : !x ? "x" : NULL;
    if (!miss) miss = !topk_ids ? "topk_ids" : !topk_weights ? "topk_weights" : NULL;
    if (miss) snprintf(why, sizeof why, "%s is NULL with num_tokens %d", miss, num_tokens);
  }
  /* With a bad argument its experts still serve the peers' rows: a usable
   * recv gets them. */
  moelink_ep_recv_t scratch = MOELINK_EP_RECV_INIT;
  moelink_ep_recv_t *rv = blind ? &scratch : recv;
  const size_t sz = rv->size;
  memset(rv, 0, sizeof *rv);
  rv->size = sz;
  const int T = why[0] ? 0 : num_tokens;
  ML_TRY(ep->ops->dispatch(ep, T ? x : NULL, T ? xq : NULL, T ? xs : NULL, T ? topk_ids : NULL,
                           T ? topk_weights : NULL, T, rv, stream));
  ep->dispatched = 1;
  ep->dispatch_tokens = T;
  ep->dispatch_blind = blind;
  if (!why[0]) return MOELINK_SUCCESS;
  return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                 "%s on rank %d: %s (took part with no tokens%s; call combine next)", fn,
                 ep->comm->rank, why, blind ? " and sends zeros for its experts at combine" : "");
}

moelink_status_t moelink_ep_dispatch(moelink_ep_t ep, const void *x, const int32_t *topk_ids,
                                     const float *topk_weights, int num_tokens,
                                     moelink_ep_recv_t *recv, void *stream) {
  return ml_ep_dispatch_any(ep, 0, x, NULL, NULL, topk_ids, topk_weights, num_tokens, recv,
                            stream);
}

moelink_status_t moelink_ep_dispatch_quantized(moelink_ep_t ep, const uint8_t *xq,
                                               const void *scales, const int32_t *topk_ids,
                                               const float *topk_weights, int num_tokens,
                                               moelink_ep_recv_t *recv, void *stream) {
  return ml_ep_dispatch_any(ep, 1, NULL, xq, scales, topk_ids, topk_weights, num_tokens, recv,
                            stream);
}

moelink_status_t moelink_ep_combine(moelink_ep_t ep, const void *y, const int32_t *pair_rows,
                                    void *out, void *stream) {
  ml_clear_error();
  if (!ep) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ep_combine: ep is NULL");
  if (!ep->dispatched)
    return ml_fail(MOELINK_ERR_INVALID_STATE,
                   "ep_combine on rank %d without a moelink_ep_dispatch before it", ep->comm->rank);
  const int T = ep->dispatch_tokens;
  ep->dispatched = 0;
  const char *why = !y ? "y is NULL" : T > 0 && !out ? "out is NULL" : NULL;
  /* A bad argument still takes part (zeros for this rank's experts' outputs);
   * so does a rank whose dispatch had no recv (it cannot know its rows). */
  const int zeros = why || ep->dispatch_blind;
  moelink_status_t s = ep->ops->combine(ep, zeros ? NULL : y, zeros ? NULL : pair_rows,
                                        why ? NULL : out, stream);
  if (s != MOELINK_SUCCESS || !why) return s;
  return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                 "ep_combine on rank %d: %s (took part, sending zeros for its experts)",
                 ep->comm->rank, why);
}
