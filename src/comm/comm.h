/* Communicator internals: the front end (src/comm/comm.c) validates arguments
 * and calls one of these tables; the CPU table lives in src/comm/cpu/, the
 * CUDA/NCCL one in src/comm/cuda/. */
#ifndef MOELINK_COMM_H
#define MOELINK_COMM_H

#include "core/core.h"
#include "moe/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Default limit of every wait (MOELINK_COMM_TIMEOUT_MS). */
#define ML_COMM_TIMEOUT_MS_DEFAULT 10000

struct moelink_comm {
  moelink_context_t ctx;
  int rank, nranks;
  const struct ml_comm_ops *ops;
  void *impl;
};

typedef struct ml_comm_ops {
  const char *name;
  moelink_status_t (*unique_id)(moelink_context_t ctx, moelink_unique_id_t *id);
  moelink_status_t (*init)(moelink_comm_t comm, const moelink_unique_id_t *id);
  moelink_status_t (*init_from_nccl)(moelink_comm_t comm, void *nccl_comm); /* may be NULL */
  void (*destroy)(moelink_comm_t comm);
  moelink_status_t (*check)(moelink_comm_t comm, void *stream);
  moelink_status_t (*symm_alloc)(moelink_comm_t comm, size_t bytes, void **ptr);
  moelink_status_t (*symm_free)(moelink_comm_t comm, void *ptr);
  moelink_status_t (*allreduce)(moelink_comm_t comm, const void *send, void *recv, size_t count,
                                moelink_dtype_t dtype, void *stream);
  moelink_status_t (*allgather)(moelink_comm_t comm, const void *send, void *recv, size_t count,
                                moelink_dtype_t dtype, void *stream);
  moelink_status_t (*reduce_scatter)(moelink_comm_t comm, const void *send, void *recv,
                                     size_t count, moelink_dtype_t dtype, void *stream);
  /* Counts in the backend's memory; send_offsets may be NULL (packed). */
  moelink_status_t (*alltoallv)(moelink_comm_t comm, const void *send, const int64_t *send_counts,
                                const int64_t *send_offsets, void *recv, size_t recv_capacity,
                                int64_t *recv_counts, int64_t *recv_offsets,
                                moelink_dtype_t dtype, void *stream);
} ml_comm_ops;

const ml_comm_ops *ml_comm_cpu_ops(void);
/* NULL when built without CUDA/NCCL. */
const ml_comm_ops *ml_comm_cuda_ops(void);

#ifdef __cplusplus
}
#endif

#endif
