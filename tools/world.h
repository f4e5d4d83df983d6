/* The ranks of a distributed benchmark (`moelink bench comm|tp|ep`, one
 * process per rank under `moelink launch`): the context, the moelink
 * communicator and, on CUDA, the NCCL communicator the baselines use, which
 * the moelink communicator wraps, plus an L2-flush buffer and a CUDA-event
 * timer. Everything exits with a message on failure, like the rest of the CLI. */
#ifndef MOELINK_CLI_WORLD_H
#define MOELINK_CLI_WORLD_H

#include "cli.h"
#include "gpu.h"

#if defined(MOELINK_HAVE_CUDA) && defined(MOELINK_HAVE_NCCL)
#define CLI_WORLD_GPU 1
#include <cuda_runtime_api.h>
#include <nccl.h>
#define CLI_CUDA(call)                                                         \
  do {                                                                         \
    cudaError_t cli_e_ = (call);                                               \
    if (cli_e_ != cudaSuccess) cli_fail("%s: %s", #call, cudaGetErrorString(cli_e_)); \
  } while (0)
#define CLI_NCCL(call)                                                         \
  do {                                                                         \
    ncclResult_t cli_r_ = (call);                                              \
    if (cli_r_ != ncclSuccess)                                                 \
      cli_fail("%s: %s (%s)", #call, ncclGetErrorString(cli_r_), ncclGetLastError(NULL)); \
  } while (0)
#else
#define CLI_WORLD_GPU 0
#endif

typedef struct cli_world {
  int rank, nranks, local_rank; /* from `moelink launch` */
  moelink_backend_t backend;
  moelink_context_t ctx;
  moelink_comm_t comm;
  void *stream;                 /* cuda: the rank's stream; cpu: NULL */
#if CLI_WORLD_GPU
  ncclComm_t nccl;              /* cuda: the baselines' communicator, under comm */
  void *flush;                  /* cuda: CLI_L2_FLUSH_BYTES */
  float *barrier;               /* cuda: one element */
  gpu_timer timer;
  gpu_marks marks;              /* cuda: for timings split into phases */
#endif
} cli_world;

/* Joins the ranks of the launch: `cmd` names the command in messages
 * ("bench tp"); cpu_threads is the CPU context's thread count (<= 0: the
 * cores shared among the ranks). On CUDA, rank r takes GPU MOELINK_LOCAL_RANK,
 * NCCL runs with NCCL_NVLS_ENABLE=0, and the moelink communicator
 * is made on the NCCL one. */
void cli_world_open(cli_world *w, const char *cmd, moelink_backend_t backend, int cpu_threads);
void cli_world_close(cli_world *w);
/* Lines the ranks up: every rank leaves it at about the same moment. */
void cli_world_barrier(cli_world *w);
/* Every rank's n floats, rank-major into all[nranks * n] (host arrays). */
void cli_world_allgather_f32(cli_world *w, const float *mine, int n, float *all);
/* Memory of the world's backend (host on cpu, device on cuda). */
void *cli_world_alloc(cli_world *w, size_t bytes, const char *what);
void cli_world_free(cli_world *w, void *p);

#endif
