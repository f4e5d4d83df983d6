/* Tensor-parallel fused GEMMs, internals: the front end (src/tp/tp.c) checks
 * every argument and calls one of these tables; the CPU table lives in
 * src/tp/cpu/, the CUDA one in src/tp/cuda/ (built with the NCCL
 * communicator). */
#ifndef MOELINK_TP_H
#define MOELINK_TP_H

#include "comm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ML_TP_AG_GEMM = 0, ML_TP_GEMM_RS = 1, ML_TP_GEMM_AR = 2 } ml_tp_op;

struct moelink_tp {
  moelink_comm_t comm;
  moelink_tp_config_t cfg; /* checked; comm_ctas resolved by the backend's init */
  const struct ml_tp_ops *ops;
  void *impl;
};

typedef struct ml_tp_ops {
  const char *name;
  /* Per-rank workspace bytes for a checked cfg on comm. */
  moelink_status_t (*workspace_size)(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                     size_t *bytes);
  /* Allocates tp->impl (collective). */
  moelink_status_t (*init)(moelink_tp_t tp);
  void (*fini)(moelink_tp_t tp);
  /* One op; the front end guarantees: non-NULL, non-overlapping buffers,
   * 1 <= m <= max_m, 1 <= n <= max_n, 1 <= k <= max_k, m % nranks == 0 for
   * AG and RS. */
  moelink_status_t (*run)(moelink_tp_t tp, ml_tp_op op, const void *a, const void *b, void *c,
                          int m, int n, int k, void *stream);
} ml_tp_ops;

const ml_tp_ops *ml_tp_cpu_ops(void);
/* NULL when built without the CUDA communicator. */
const ml_tp_ops *ml_tp_cuda_ops(void);

#ifdef __cplusplus
}
#endif

#endif
