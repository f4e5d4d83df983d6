/* Expert parallelism, internals: the front end (src/ep/ep.c) checks every
 * argument and calls one of these tables; the CPU table lives in src/ep/cpu/,
 * a CUDA one will live in src/ep/cuda/ (built with the NCCL communicator). */
#ifndef MOELINK_EP_H
#define MOELINK_EP_H

#include "comm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moelink_ep {
  moelink_comm_t comm;
  moelink_ep_config_t cfg; /* checked; recv_capacity resolved (>= 1) */
  int first_expert;        /* rank * local_experts */
  int local_experts;       /* E / nranks */
  moelink_moe_weights_t w; /* as bound by set_weights (checked) */
  int has_weights;
  int dispatched;          /* 1 between a dispatch and its combine */
  int dispatch_tokens;     /* T of that dispatch (0 after a bad-argument one) */
  int dispatch_blind;      /* that dispatch had no usable recv: the caller cannot
                              know its rows, so combine sends zeros for them */
  const struct ml_ep_ops *ops;
  void *impl;
};

typedef struct ml_ep_ops {
  const char *name;
  /* 1: every forward runs ceil(call_tokens / moe.max_tokens) steps, so the
   * front end refuses num_tokens > call_tokens (the rank takes part with
   * none); 0: the ranks agree on the steps of any count by themselves. */
  int steps_from_config;
  /* Per-rank bytes for a checked cfg on comm. */
  moelink_status_t (*workspace_size)(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                     size_t *bytes);
  /* Allocates ep->impl (collective). */
  moelink_status_t (*init)(moelink_ep_t ep);
  void (*fini)(moelink_ep_t ep);
  /* Binds checked weights (ep->w is already set). */
  moelink_status_t (*set_weights)(moelink_ep_t ep);
  /* The layer; the front end guarantees weights are bound, num_tokens >= 0,
   * x and out non-NULL and apart when num_tokens > 0 (and num_tokens <=
   * call_tokens with steps_from_config). num_tokens may exceed
   * moe.max_tokens (the backend steps through it). */
  moelink_status_t (*forward)(moelink_ep_t ep, const void *x, int num_tokens, void *out,
                              void *stream);
  /* The pieces. dispatch: num_tokens in [0, max_tokens]; the rows are x (of
   * moe.dtype) or, with the config's dispatch_quant, xq + xs (moelink_quantize
   * output), exactly one of the two given when num_tokens > 0, ids and
   * weights too; fills every field of *recv but size. combine:
   * after a dispatch that returned SUCCESS; the T is ep->dispatch_tokens; y
   * NULL (this rank's bad arguments) means: take part, send zeros for this
   * rank's experts' outputs and write no out; otherwise out is non-NULL when
   * T > 0; pair_rows may be NULL (identity). */
  moelink_status_t (*dispatch)(moelink_ep_t ep, const void *x, const uint8_t *xq,
                               const void *xs, const int32_t *ids, const float *weights,
                               int num_tokens, moelink_ep_recv_t *recv, void *stream);
  moelink_status_t (*combine)(moelink_ep_t ep, const void *y, const int32_t *pair_rows, void *out,
                              void *stream);
} ml_ep_ops;

/* The backends run the layer through MoE layers of their context: `local`,
 * this rank's E / n experts with top_k min(k, E / n) on up to max_rows
 * received rows (ml_ep_local_config), and on CPU ranks `front`, the whole
 * config (routing, the shared expert, the combine). ml_ep_bind_layers binds
 * ep->w to both (front, when not NULL, gets the local expert slices only
 * because a layer needs expert pointers; it never runs them). */
moelink_moe_config_t ml_ep_local_config(const moelink_ep_config_t *cfg, int nranks, int max_rows);
moelink_status_t ml_ep_bind_layers(moelink_ep_t ep, moelink_moe_t front, moelink_moe_t local);

/* A hash of every field of cfg (recv_capacity and call_tokens as resolved):
 * the ranks compare theirs at create, since ranks with different configs
 * would mix data or run different steps. */
uint64_t ml_ep_config_hash(const moelink_ep_config_t *cfg);

const ml_ep_ops *ml_ep_cpu_ops(void);
/* NULL while there is no CUDA implementation (or no NCCL communicator). */
const ml_ep_ops *ml_ep_cuda_ops(void);

#ifdef __cplusplus
}
#endif

#endif
