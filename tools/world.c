/* The ranks of a distributed benchmark (world.h). */
#include "world.h"

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static int cli_env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

void cli_world_allgather_f32(cli_world *w, const float *mine, int n, float *all) {
  if (w->backend == MOELINK_BACKEND_CPU) {
    CLI_CALL("moelink_allgather", moelink_allgather(w->comm, mine, all, (size_t)n,
                                                    MOELINK_DTYPE_F32, NULL));
    return;
  }
  void *d = NULL;
  const size_t b = sizeof(float) * (size_t)n;
  if (gpu_malloc(&d, b * (size_t)(w->nranks + 1), "gather") || gpu_h2d(d, mine, b))
    cli_fail("%s", gpu_error());
  CLI_CALL("moelink_allgather", moelink_allgather(w->comm, d, (char *)d + b, (size_t)n,
                                                  MOELINK_DTYPE_F32, w->stream));
  if (gpu_stream_sync(w->stream) || gpu_d2h(all, (char *)d + b, b * (size_t)w->nranks))
    cli_fail("%s", gpu_error());
  gpu_free(d);
}

#if CLI_WORLD_GPU
/* The NCCL id of this run. A cuda id from `moelink launch --backend cuda` is
 * NCCL's id tagged in its last 16 bytes (src/comm/cuda/comm_cuda.c); with the
 * launcher's default cpu id the ranks meet on the CPU instead, where rank 0
 * hands out a fresh NCCL id. */
static void cli_world_nccl_id(cli_world *w, ncclUniqueId *out) {
  static const char tag[16] = "moelink:nccl-id";
  const char *hex = getenv("MOELINK_UNIQUE_ID");
  moelink_unique_id_t id;
  CLI_CALL("MOELINK_UNIQUE_ID", moelink_unique_id_from_hex(hex, &id));
  _Static_assert(sizeof(ncclUniqueId) == MOELINK_UNIQUE_ID_BYTES, "unique id sizes differ");
  if (memcmp(id.bytes + MOELINK_UNIQUE_ID_BYTES - 16, tag, 16) == 0) {
    memcpy(out->internal, id.bytes, MOELINK_UNIQUE_ID_BYTES - 16);
    memset(out->internal + MOELINK_UNIQUE_ID_BYTES - 16, 0, 16);
    return;
  }
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.num_threads = 1;
  moelink_context_t cctx = NULL;
  moelink_comm_t cpu = NULL;
  CLI_CALL("moelink_context_create (cpu, for the NCCL id)", moelink_context_create(&cc, &cctx));
  CLI_CALL("moelink_comm_init_from_env (cpu, for the NCCL id)",
           moelink_comm_init_from_env(cctx, &cpu));
  unsigned char mine[MOELINK_UNIQUE_ID_BYTES];
  memset(mine, 0, sizeof mine);
  if (w->rank == 0) CLI_NCCL(ncclGetUniqueId((ncclUniqueId *)mine));
  unsigned char *all =
      (unsigned char *)cli_malloc((size_t)w->nranks * MOELINK_UNIQUE_ID_BYTES, "ids");
  CLI_CALL("handing out the NCCL id",
           moelink_allgather(cpu, mine, all, MOELINK_UNIQUE_ID_BYTES / 4, MOELINK_DTYPE_F32, NULL));
  memcpy(out->internal, all, MOELINK_UNIQUE_ID_BYTES);
  free(all);
  CLI_CALL("moelink_comm_destroy (cpu)", moelink_comm_destroy(cpu));
  moelink_context_destroy(cctx);
}

static void cli_world_open_gpu(cli_world *w) {
  /* NVLink multicast stays off (DESIGN.md, section 5), for NCCL's baselines
   * too: the targets compare with NCCL without it. */
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (cudaSetDevice(w->local_rank) != cudaSuccess)
    cli_fail("rank %d: cudaSetDevice(%d) failed (one GPU per rank: MOELINK_LOCAL_RANK)", w->rank,
             w->local_rank);
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = MOELINK_BACKEND_CUDA;
  cc.device = w->local_rank;
  CLI_CALL("moelink_context_create (cuda)", moelink_context_create(&cc, &w->ctx));
  if (gpu_stream_create(&w->stream)) cli_fail("%s", gpu_error());
  ncclUniqueId uid;
  cli_world_nccl_id(w, &uid);
  CLI_NCCL(ncclCommInitRank(&w->nccl, w->nranks, uid, w->rank));
  CLI_CALL("moelink_comm_init_from_nccl", moelink_comm_init_from_nccl(w->ctx, w->nccl, &w->comm));
  if (gpu_malloc(&w->flush, CLI_L2_FLUSH_BYTES, "L2 flush") ||
      gpu_malloc((void **)&w->barrier, sizeof(float), "barrier") || gpu_timer_create(&w->timer) ||
      gpu_marks_create(&w->marks))
    cli_fail("%s", gpu_error());
  CLI_CUDA(cudaMemset(w->barrier, 0, sizeof(float)));
}
#endif

void cli_world_open(cli_world *w, const char *cmd, moelink_backend_t backend, int cpu_threads) {
  memset(w, 0, sizeof *w);
  w->rank = cli_env_int("MOELINK_RANK", -1);
  w->nranks = cli_env_int("MOELINK_WORLD_SIZE", 0);
  w->local_rank = cli_env_int("MOELINK_LOCAL_RANK", w->rank);
  w->backend = backend;
  if (w->rank < 0 || w->nranks < 1 || !getenv("MOELINK_UNIQUE_ID"))
    cli_fail("%s: run me under the launcher: moelink launch -n 2 -- moelink %s", cmd, cmd);
  if (backend == MOELINK_BACKEND_CUDA) {
#if CLI_WORLD_GPU
    cli_world_open_gpu(w);
    return;
#else
    cli_fail("%s --backend cuda: unsupported, this moelink CLI was built without %s (the cpu "
             "backend works: --backend cpu)",
             cmd,
#ifdef MOELINK_HAVE_CUDA
             "NCCL"
#else
             "CUDA"
#endif
    );
#endif
  }
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = MOELINK_BACKEND_CPU;
  int threads = cpu_threads;
#ifdef _OPENMP
  if (threads <= 0) threads = omp_get_num_procs() / w->nranks;
#endif
  cc.num_threads = threads > 0 ? threads : 1;
  CLI_CALL("moelink_context_create (cpu)", moelink_context_create(&cc, &w->ctx));
  CLI_CALL("moelink_comm_init_from_env", moelink_comm_init_from_env(w->ctx, &w->comm));
}

void cli_world_close(cli_world *w) {
  CLI_CALL("moelink_comm_destroy", moelink_comm_destroy(w->comm));
#if CLI_WORLD_GPU
  if (w->backend == MOELINK_BACKEND_CUDA) {
    gpu_timer_destroy(&w->timer);
    gpu_marks_destroy(&w->marks);
    gpu_free(w->flush);
    gpu_free(w->barrier);
    (void)ncclCommDestroy(w->nccl);
  }
#endif
  gpu_stream_destroy(w->stream);
  moelink_context_destroy(w->ctx);
}

void cli_world_barrier(cli_world *w) {
#if CLI_WORLD_GPU
  if (w->backend == MOELINK_BACKEND_CUDA) {
    CLI_NCCL(ncclAllReduce(w->barrier, w->barrier, 1, ncclFloat32, ncclSum, w->nccl,
                           (cudaStream_t)w->stream));
    return;
  }
#endif
  float x = 0.0f, y = 0.0f;
  CLI_CALL("moelink_allreduce (barrier)",
           moelink_allreduce(w->comm, &x, &y, 1, MOELINK_DTYPE_F32, NULL));
}

void *cli_world_alloc(cli_world *w, size_t bytes, const char *what) {
  if (w->backend == MOELINK_BACKEND_CPU) return cli_malloc(bytes ? bytes : 1, what);
  void *p = NULL;
  if (gpu_malloc(&p, bytes ? bytes : 1, what)) cli_fail("%s", gpu_error());
  return p;
}

void cli_world_free(cli_world *w, void *p) {
  if (w->backend == MOELINK_BACKEND_CPU)
    free(p);
  else
    gpu_free(p);
}
