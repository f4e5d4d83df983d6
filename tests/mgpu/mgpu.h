/* Helpers of the multi-GPU tests (label mgpu). Every rank of `moelink launch
 * -n N -- TEST` runs the same program on GPU MOELINK_LOCAL_RANK and prints its
 * own TAP lines (the launcher prefixes them with the rank); the test passes
 * when every rank exits 0.
 *
 * References come from NCCL's own collectives on the NCCL communicator under
 * the moelink one, and from the inputs regenerated on the host
 * (moelink_random_value is bitwise what moelink_fill_random writes). These
 * tests run once, on a machine nobody watches: every failure prints sizes,
 * positions and values. */
#ifndef ML_MGPU_H
#define ML_MGPU_H

#include "comm/cuda/comm_cuda.h"
#include "core/core.h"
#include "harness.h"
#include "moelink.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MG_FN static __attribute__((unused))

MG_FN void mg_bail(const char *why) {
  printf("Bail out! %s\n", why);
  fflush(stdout);
  (void)ml_test_done();
  exit(1);
}

#define MG_CUDA(call)                                                          \
  do {                                                                         \
    cudaError_t mg_e_ = (call);                                                \
    if (mg_e_ != cudaSuccess) {                                                \
      CHECK(0, "%s: %s", #call, cudaGetErrorString(mg_e_));                     \
      mg_bail("CUDA runtime error");                                           \
    }                                                                          \
  } while (0)

#define MG_NCCL(comm, call)                                                    \
  do {                                                                         \
    ncclResult_t mg_r_ = (call);                                               \
    if (mg_r_ != ncclSuccess) {                                                \
      CHECK(0, "%s: %s (%s)", #call, ncclGetErrorString(mg_r_),                \
            ncclGetLastError(comm));                                           \
      mg_bail("NCCL error");                                                   \
    }                                                                          \
  } while (0)

#define MG_MUST(call, what)                                                    \
  do {                                                                         \
    moelink_status_t mg_s_ = (call);                                           \
    if (mg_s_ != MOELINK_SUCCESS) {                                            \
      CHECK(0, "%s: %s: %s", (what), moelink_status_string(mg_s_),             \
            moelink_last_error());                                             \
      mg_bail(what);                                                           \
    }                                                                          \
  } while (0)

MG_FN double mg_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

MG_FN int mg_env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

typedef struct mg_world {
  int rank, size, device;
  moelink_context_t ctx;
  moelink_comm_t comm;
  ncclComm_t nccl; /* under comm: the reference collectives run on it */
  cudaStream_t stream;
} mg_world;

/* Context on GPU MOELINK_LOCAL_RANK, communicator from the launcher's
 * environment. */
MG_FN void mg_init(mg_world *w) {
  memset(w, 0, sizeof *w);
  w->rank = mg_env_int("MOELINK_RANK", -1);
  w->size = mg_env_int("MOELINK_WORLD_SIZE", 0);
  w->device = mg_env_int("MOELINK_LOCAL_RANK", 0);
  if (w->rank < 0 || w->size < 1) mg_bail("run me under `moelink launch -n N -- TEST`");
  int ndev = 0;
  MG_CUDA(cudaGetDeviceCount(&ndev));
  if (w->device >= ndev) {
    printf("# rank %d wants GPU %d, %d visible\n", w->rank, w->device, ndev);
    mg_bail("not enough GPUs for one rank per GPU");
  }
  moelink_context_config_t cfg = MOELINK_CONTEXT_CONFIG_INIT;
  cfg.backend = MOELINK_BACKEND_CUDA;
  cfg.device = w->device;
  MG_MUST(moelink_context_create(&cfg, &w->ctx), "moelink_context_create (cuda)");
  MG_CUDA(cudaSetDevice(w->device));
  MG_CUDA(cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking));
  double t0 = mg_now();
  MG_MUST(moelink_comm_init_from_env(w->ctx, &w->comm), "moelink_comm_init_from_env");
  CHECK(moelink_comm_rank(w->comm) == w->rank && moelink_comm_size(w->comm) == w->size,
        "communicator: rank %d of %d on GPU %d (%.2f s)", moelink_comm_rank(w->comm),
        moelink_comm_size(w->comm), w->device, mg_now() - t0);
  w->nccl = ml_comm_cuda_nccl(w->comm);
  if (!w->nccl) mg_bail("no NCCL communicator under the moelink one");
}

/* The tests of a rank that stops taking part: every rank but 0 ends here,
 * with no destroy and no goodbye (the process just ends, as a crash
 * would); what: the call it leaves without. */
MG_FN void mg_leave_unless_rank0(const mg_world *w, const char *what) {
  if (w->rank == 0)
    return;
  ml_t_diag("rank %d leaves without %s", w->rank, what); /* (its checks so far count) */
  const int rc = ml_test_done();
  fflush(stdout);
  _exit(rc);
}

/* Rank 0, after it enqueued (at mg_now() == t0) a call the leavers never
 * join: moelink_comm_check reports MOELINK_ERR_TIMEOUT after about
 * MOELINK_COMM_TIMEOUT_MS; returns the message, for the caller's checks of
 * what it names. */
MG_FN const char *mg_expect_timeout(const mg_world *w, double t0) {
  const double limit_s = mg_env_int("MOELINK_COMM_TIMEOUT_MS", 10000) / 1000.0;
  moelink_status_t s = moelink_comm_check(w->comm, w->stream);
  const double waited = mg_now() - t0;
  const char *msg = moelink_last_error();
  CHECK(s == MOELINK_ERR_TIMEOUT, "check reports %s after %.2f s: %s", moelink_status_string(s),
        waited, msg);
  CHECK(waited >= 0.8 * limit_s && waited < limit_s + 15.0,
        "it gave up after the limit (%.2f s for a limit of %.1f s)", waited, limit_s);
  return msg;
}

MG_FN void mg_fini(mg_world *w) {
  CHECK_OK(moelink_comm_check(w->comm, w->stream), "moelink_comm_check at the end");
  CHECK_OK(moelink_comm_destroy(w->comm), "moelink_comm_destroy");
  cudaStreamDestroy(w->stream);
  CHECK_OK(moelink_context_destroy(w->ctx), "moelink_context_destroy");
}

/* fp32 value v rounded to dtype dt, back in fp32. */
MG_FN float mg_round(moelink_dtype_t dt, float v) {
  if (dt == MOELINK_DTYPE_BF16) return ml_bf16_to_f32(ml_f32_to_bf16(v));
  if (dt == MOELINK_DTYPE_F16) return ml_f16_to_f32(ml_f32_to_f16(v));
  return v;
}

/* Element i of a host copy of a dtype buffer as fp32. */
MG_FN float mg_get(moelink_dtype_t dt, const void *p, size_t i) {
  if (dt == MOELINK_DTYPE_F32) return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return dt == MOELINK_DTYPE_BF16 ? ml_bf16_to_f32(h) : ml_f16_to_f32(h);
}

/* The input element moelink_fill_random(seed, scale 1, offset 0) wrote at i. */
MG_FN float mg_input(moelink_dtype_t dt, uint64_t seed, size_t i) {
  return mg_round(dt, moelink_random_value(seed, i, 1.0f, 0.0f));
}

MG_FN double mg_tol(moelink_dtype_t dt) { return dt == MOELINK_DTYPE_F32 ? 1e-6 : 1e-2; }

/* Seed of rank r's input for test case c: every rank can regenerate any
 * rank's input. */
MG_FN uint64_t mg_seed(int r, int c) { return 0x5eed0000ull + 1000003ull * (uint64_t)c + (uint64_t)r; }

MG_FN uint64_t mg_hash(const void *p, size_t bytes) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* A deterministic generator shared by all ranks (so they issue the same
 * calls). */
MG_FN uint64_t mg_next(uint64_t *s) {
  *s += 0x9e3779b97f4a7c15ull;
  uint64_t z = *s;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

MG_FN void *mg_host(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) mg_bail("host allocation failed");
  return p;
}

MG_FN void *mg_dev(size_t bytes) {
  void *p = NULL;
  MG_CUDA(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}

#endif
