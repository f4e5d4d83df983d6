/* The CUDA communicator (host side): NCCL bootstrap, symmetric buffers as
 * NCCL windows, the device communicator, failure reports, and the dispatch
 * of collectives to the kernels of collectives.cu.
 *
 * Every entry makes the context's device current and puts the caller's
 * back. Collectives never synchronize; init, symmetric allocation, check and
 * destroy do (they are not on the hot path). */
#include "comm/cuda/comm_cuda.h"
#include "cuda/cuda.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* MOELINK_COMM_TIMEOUT_MS, read once per process by the front end. */
int64_t ml_comm_timeout_ms(void);

/* CTAs one collective may use, and the all-reduce size where two-shot takes
 * over. Every rank must see the same values (they shape the kernels' rounds). */
MOELINK_PARAM(COMM_MAX_CTAS, ML_CCU_DEFAULT_CTAS)
MOELINK_PARAM(COMM_ONESHOT_MAX_BYTES, (int64_t)ML_CCU_ONESHOT_MAX_DEFAULT)
/* All-reduces up to this size take the low-latency path (0: never). */
MOELINK_PARAM(COMM_LL_MAX_BYTES, (int64_t)ML_CCU_LL_MAX_WORDS * 4)

_Static_assert(sizeof(ncclUniqueId) == MOELINK_UNIQUE_ID_BYTES, "unique id sizes differ");

/* moelink_get_unique_id on CUDA is NCCL's id with this tag in its last bytes
 * (which NCCL leaves zero), so that init can tell it from an id made on the
 * CPU backend (what `moelink launch` hands out), which it resolves through a
 * CPU rendezvous instead. */
#define ML_CCU_TAG "moelink:nccl-id"
#define ML_CCU_TAG_BYTES 16
#define ML_CCU_TAG_AT (MOELINK_UNIQUE_ID_BYTES - ML_CCU_TAG_BYTES)

typedef struct ml_ccu_symm {
  struct ml_ccu_symm *next;
  char *ptr;
  size_t bytes;
  ncclWindow_t win;
  char *base[ML_CCU_MAX_RANKS]; /* base[rank] == ptr */
} ml_ccu_symm;

typedef struct ml_ccu_comm {
  ncclComm_t nccl;
  int owned;         /* we made nccl (else the caller owns it) */
  void *devcomm;     /* ncclDevComm (devcomm.cu) */
  int lsa_rank, lsa_size;
  int lsa_ok;        /* every rank shares this rank's NVLink domain: kernels run */
  cudaStream_t setup;
  uint64_t *scratch; /* ML_CCU_MAX_RANKS words, for window addresses */
  uint64_t *epoch;   /* ML_CCU_MAX_CTAS words */
  ml_ccu_symm internal;
  ml_ccu_symm ll;      /* the low-latency all-reduce's cells */
  void *ll_state;      /* its call count and ticket (device memory) */
  ml_ccu_symm ce;      /* the copy-engine all-gather's buffer, once selected */
  uint64_t *ce_round;  /* its round counter */
  ml_ccu_symm *user; /* moelink_symm_alloc buffers */
  ml_ccu_coll coll;
  int broken;
  char broken_msg[400];
} ml_ccu_comm;

static const ml_comm_ops ml_ccu_ops;

static ml_ccu_comm *ml_ccu(moelink_comm_t comm) { return (ml_ccu_comm *)comm->impl; }

/* ---- errors, device guard, NCCL environment -------------------------------- */

static moelink_status_t ml_ccu_nccl_fail(ncclComm_t comm, ncclResult_t r, const char *what) {
  const char *detail = comm ? ncclGetLastError(comm) : ncclGetLastError(NULL);
  return ml_fail(MOELINK_ERR_NCCL, "%s failed: %s%s%s", what, ncclGetErrorString(r),
                 detail && *detail ? ": " : "", detail && *detail ? detail : "");
}

static moelink_status_t ml_ccu_cuda_fail(cudaError_t e, const char *what) {
  return ml_fail(e == cudaErrorMemoryAllocation ? MOELINK_ERR_OUT_OF_MEMORY : MOELINK_ERR_CUDA,
                 "%s failed: %s", what, cudaGetErrorString(e));
}


static void ml_ccu_version_text(int code, char *buf, size_t size) {
  if (code >= 10000)
    snprintf(buf, size, "%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
  else
    snprintf(buf, size, "%d.%d.%d", code / 1000, code / 100 % 10, code % 100);
}

/* The NCCL headers this file was compiled with and the libnccl loaded at run
 * time must be the same release: the device API's structs are shared
 * between them. */
static moelink_status_t ml_ccu_check_version(void) {
  int v = 0;
  ncclResult_t r = ncclGetVersion(&v);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(NULL, r, "ncclGetVersion");
  if (v == NCCL_VERSION_CODE) return MOELINK_SUCCESS;
  char built[32], running[32];
  ml_ccu_version_text(NCCL_VERSION_CODE, built, sizeof built);
  ml_ccu_version_text(v, running, sizeof running);
  Dl_info info;
  const char *where = "an unknown file";
  if (dladdr((void *)ncclGetVersion, &info) && info.dli_fname) where = info.dli_fname;
  return ml_fail(MOELINK_ERR_NCCL,
                 "built against NCCL %s, running %s (loaded from %s): run with the libnccl "
                 "moelink was built against, or rebuild with -DNCCL_ROOT set to this one",
                 built, running, where);
}

/* NVLink multicast is never used: keep NCCL from setting it up. */
static void ml_ccu_nccl_env(void) { setenv("NCCL_NVLS_ENABLE", "0", 1); }

/* ---- symmetric buffers ------------------------------------------------------ */

/* Collective: every rank allocates the same size in the same order. The
 * buffer is zeroed before the registration, whose barrier guarantees no peer
 * writes into it before that. */
/* Every rank says whether its local part worked (1) or not (0); returns the
 * minimum over ranks in *ok (host round trip: setup calls only). So a rank
 * that failed alone does not leave its peers inside NCCL's collective window
 * registration, which has no time limit. */
static moelink_status_t ml_ccu_agree(ml_ccu_comm *c, int *ok) {
  int32_t v = *ok ? 1 : 0;
  int32_t *d = (int32_t *)c->scratch;
  cudaError_t e = cudaMemcpyAsync(d, &v, sizeof v, cudaMemcpyHostToDevice, c->setup);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "agreeing on a symmetric allocation");
  ncclResult_t r = ncclAllReduce(d, d, 1, ncclInt32, ncclMin, c->nccl, c->setup);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(c->nccl, r, "ncclAllReduce (agreement)");
  e = cudaMemcpyAsync(&v, d, sizeof v, cudaMemcpyDeviceToHost, c->setup);
  if (e == cudaSuccess) e = cudaStreamSynchronize(c->setup);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "agreeing on a symmetric allocation");
  *ok = v == 1;
  return MOELINK_SUCCESS;
}

/* *same = 1 when every rank passed the same v (the maximum of v and of ~v in
 * one all-reduce: equal exactly when min = max); setup calls only. */
static moelink_status_t ml_ccu_same(ml_ccu_comm *c, uint64_t v, int *same) {
  uint64_t h[2] = {v, ~v};
  uint64_t *d = c->scratch; /* ML_CCU_MAX_RANKS >= 2 words */
  cudaError_t e = cudaMemcpyAsync(d, h, sizeof h, cudaMemcpyHostToDevice, c->setup);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "comparing a value across ranks");
  ncclResult_t r = ncclAllReduce(d, d, 2, ncclUint64, ncclMax, c->nccl, c->setup);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(c->nccl, r, "ncclAllReduce (same value)");
  e = cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, c->setup);
  if (e == cudaSuccess) e = cudaStreamSynchronize(c->setup);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "comparing a value across ranks");
  *same = h[0] == ~h[1];
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_symm_make(moelink_comm_t comm, ml_ccu_comm *c, size_t bytes,
                                         ml_ccu_symm *m) {
  memset(m, 0, sizeof *m);
  void *p = NULL;
  moelink_status_t own = MOELINK_SUCCESS;
  ncclResult_t r = ncclMemAlloc(&p, bytes);
  if (r != ncclSuccess || !p) {
    size_t free_b = 0, total_b = 0;
    p = NULL;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && bytes > free_b)
      own = ml_fail(MOELINK_ERR_OUT_OF_MEMORY,
                    "symmetric buffer of %zu bytes: only %zu bytes of device memory free", bytes,
                    free_b);
    else
      own = ml_ccu_nccl_fail(c->nccl, r, "ncclMemAlloc");
  } else {
    cudaError_t e = cudaMemsetAsync(p, 0, bytes, c->setup);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->setup);
    if (e != cudaSuccess) own = ml_ccu_cuda_fail(e, "zeroing a symmetric buffer");
  }
  ml_saved_error why; /* the agreement's calls must not lose this rank's own reason */
  ml_error_save(&why);
  int ok = own == MOELINK_SUCCESS;
  const moelink_status_t agreed = ml_ccu_agree(c, &ok);
  if (agreed != MOELINK_SUCCESS || !ok) {
    if (p) (void)ncclMemFree(p);
    if (agreed != MOELINK_SUCCESS) return agreed;
    if (own != MOELINK_SUCCESS) return ml_error_restore(&why, own);
    return ml_fail(MOELINK_ERR_INVALID_STATE,
                   "symmetric buffer of %zu bytes: another rank could not allocate its part "
                   "(its own call says why)",
                   bytes);
  }
  ncclWindow_t win = NULL;
  r = ncclCommWindowRegister(c->nccl, p, bytes, &win, NCCL_WIN_COLL_SYMMETRIC);
  if (r != ncclSuccess) {
    moelink_status_t s = ml_ccu_nccl_fail(c->nccl, r, "ncclCommWindowRegister");
    (void)ncclMemFree(p);
    return s;
  }
  if (!win) {
    (void)ncclMemFree(p);
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "NCCL made no symmetric window for a buffer of %zu bytes: this communicator "
                   "has no symmetric memory support (it needs CUDA VMM, NCCL_CUMEM_ENABLE not 0)",
                   bytes);
  }
  m->ptr = (char *)p;
  m->bytes = bytes;
  m->win = win;
  if (c->lsa_ok) {
    uint64_t b[ML_CCU_MAX_RANKS];
    moelink_status_t s = ml_ccu_window_bases(win, comm->nranks, c->scratch, b, c->setup);
    if (s != MOELINK_SUCCESS) {
      (void)ncclCommWindowDeregister(c->nccl, win);
      (void)ncclMemFree(p);
      memset(m, 0, sizeof *m);
      return s;
    }
    for (int q = 0; q < comm->nranks; ++q) m->base[q] = (char *)(uintptr_t)b[q];
    /* A GPU addresses its own copy only through the allocation's address
     * (see moelink_device.cuh), never through NCCL's second mapping. */
    m->base[comm->rank] = m->ptr;
  }
  return MOELINK_SUCCESS;
}

/* Deregisters and frees (this rank only: NCCL unmaps its own view of the
 * peers' copies; theirs stay until they free). */
static moelink_status_t ml_ccu_symm_release(ml_ccu_comm *c, ml_ccu_symm *m) {
  if (!m->ptr) return MOELINK_SUCCESS;
  moelink_status_t s = MOELINK_SUCCESS;
  ncclResult_t r = ncclCommWindowDeregister(c->nccl, m->win);
  if (r != ncclSuccess) s = ml_ccu_nccl_fail(c->nccl, r, "ncclCommWindowDeregister");
  r = ncclMemFree(m->ptr);
  if (r != ncclSuccess && s == MOELINK_SUCCESS) s = ml_ccu_nccl_fail(c->nccl, r, "ncclMemFree");
  m->ptr = NULL;
  m->win = NULL;
  return s;
}

/* ---- failure reports -------------------------------------------------------- */

static const char *ml_ccu_prim_name(unsigned prim, char *buf, size_t size) {
  switch (prim) {
  case MOELINK_PRIM_SIGNAL_WAIT: return "a signal (moelink_signal_wait)";
  case MOELINK_PRIM_BARRIER: return "a barrier (moelink_barrier)";
  case ML_CCU_PRIM_AR_ONESHOT: return "one-shot all-reduce data";
  case ML_CCU_PRIM_AR_LL: return "low-latency all-reduce data";
  case ML_CUDA_PRIM_GEMM_ROWS:
    return "a GEMM's rows (ml_cuda_gemm_wait)";
  case ML_CCU_PRIM_AR_RS: return "two-shot all-reduce data (reduce-scatter round)";
  case ML_CCU_PRIM_AR_AG: return "two-shot all-reduce data (all-gather round)";
  case ML_CCU_PRIM_ALLGATHER: return "all-gather data";
  case ML_CCU_PRIM_REDUCE_SCATTER: return "reduce-scatter data";
  case ML_CCU_PRIM_A2A_COUNTS: return "alltoallv counts";
  case ML_CCU_PRIM_A2A_DATA: return "alltoallv data";
  case ML_CCU_PRIM_AG_CE_READY: return "copy-engine all-gather data";
  case ML_CCU_PRIM_AG_CE_RELEASE: return "copy-engine all-gather staging release";
  default: break;
  }
  if (prim >= MOELINK_PRIM_USER)
    snprintf(buf, size, "user primitive %u (MOELINK_PRIM_USER + %u)", prim,
             prim - MOELINK_PRIM_USER);
  else
    snprintf(buf, size, "primitive %u", prim);
  return buf;
}

/* Reads this rank's control block (after the caller synchronized) and, when
 * a wait gave up, marks the communicator broken with the reason. Returns 1
 * when broken. */
static int ml_ccu_read_failure(moelink_comm_t comm, ml_ccu_comm *c) {
  if (c->broken) return 1;
  if (!c->lsa_ok || !c->internal.ptr) return 0;
  uint64_t w[3] = {0, 0, 0};
  if (cudaMemcpy(w, c->internal.ptr + ML_CCU_CTL_OFFSET, sizeof w, cudaMemcpyDeviceToHost) !=
      cudaSuccess)
    return 0;
  if (!(w[MOELINK_CTL_INFO] & MOELINK_CTL_INFO_VALID)) return 0;
  const uint64_t info = w[MOELINK_CTL_INFO];
  const int rank = (int)(info & 0xffff);
  const int from = (int)((info >> 16) & 0xffff);
  const unsigned prim = (unsigned)((info >> 32) & 0xffff);
  const unsigned long long value = (unsigned long long)w[MOELINK_CTL_VALUE];
  const int first = w[MOELINK_CTL_ABORT] ? (int)w[MOELINK_CTL_ABORT] - 1 : -1;
  char pbuf[64], frombuf[32];
  const char *what = ml_ccu_prim_name(prim, pbuf, sizeof pbuf);
  if (from == 0xffff)
    snprintf(frombuf, sizeof frombuf, "a peer");
  else
    snprintf(frombuf, sizeof frombuf, "rank %d", from);
  if (info & MOELINK_CTL_INFO_ABORTED)
    snprintf(c->broken_msg, sizeof c->broken_msg,
             "rank %d: stopped waiting for %s (value %llu) from %s because rank %d gave up "
             "first; the communicator is unusable: destroy it",
             rank, what, value, frombuf, first);
  else
    snprintf(c->broken_msg, sizeof c->broken_msg,
             "rank %d: waited %lld ms for %s (value %llu) from %s; the communicator is "
             "unusable: destroy it",
             rank, (long long)(c->coll.dc.timeout_ns / 1000000ull), what, value, frombuf);
  (void)comm;
  c->broken = 1;
  return 1;
}

/* ---- setup and teardown ----------------------------------------------------- */

static void ml_ccu_teardown(ml_ccu_comm *c) {
  /* Kernels still queued may use the buffers; none waits forever. */
  int failed = c->broken;
  if (cudaDeviceSynchronize() != cudaSuccess) failed = 1;
  (void)cudaGetLastError();
  if (!failed && c->lsa_ok && c->internal.ptr) {
    uint64_t info = 0;
    if (cudaMemcpy(&info, c->internal.ptr + ML_CCU_CTL_OFFSET, sizeof info,
                   cudaMemcpyDeviceToHost) != cudaSuccess ||
        (info & MOELINK_CTL_INFO_VALID))
      failed = 1;
  }
  if (c->nccl) {
    ncclResult_t ae = ncclSuccess;
    if (ncclCommGetAsyncError(c->nccl, &ae) != ncclSuccess ||
        (ae != ncclSuccess && ae != ncclInProgress))
      failed = 1;
  }
  while (c->user) {
    ml_ccu_symm *m = c->user;
    c->user = m->next;
    (void)ml_ccu_symm_release(c, m);
    free(m);
  }
  (void)ml_ccu_symm_release(c, &c->internal);
  (void)ml_ccu_symm_release(c, &c->ce);
  if (c->ce_round) (void)cudaFree(c->ce_round);
  (void)ml_ccu_symm_release(c, &c->ll);
  if (c->ll_state) (void)cudaFree(c->ll_state);
  if (c->devcomm) ml_ccu_devcomm_destroy(c->nccl, c->devcomm);
  c->devcomm = NULL;
  if (c->epoch) (void)cudaFree(c->epoch);
  if (c->scratch) (void)cudaFree(c->scratch);
  if (c->setup) (void)cudaStreamDestroy(c->setup);
  if (c->nccl && c->owned) {
    /* A peer that gave up or died would never join a clean shutdown. */
    if (failed)
      (void)ncclCommAbort(c->nccl);
    else
      (void)ncclCommDestroy(c->nccl);
  }
  (void)cudaGetLastError();
  free(c);
}

/* MOELINK_COMM_ALLGATHER: "sm" (default) or "ce"; read once per process like
 * the MOELINK_PARAM knobs, anything else keeps the default. Every rank must
 * see the same value (choosing CE allocates a symmetric buffer). */
static int ml_ccu_allgather_knob(void) {
  static int cached = -1;
  int v = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
  if (v < 0) {
    const char *e = getenv("MOELINK_COMM_ALLGATHER");
    v = e && strcmp(e, "ce") == 0 ? ML_CCU_AG_CE : ML_CCU_AG_SM;
    __atomic_store_n(&cached, v, __ATOMIC_RELEASE);
  }
  return v;
}

/* The copy-engine all-gather's buffer and round counter (collective: a
 * symmetric allocation). */
static moelink_status_t ml_ccu_ce_make(moelink_comm_t comm, ml_ccu_comm *c) {
  if (c->ce.ptr) return MOELINK_SUCCESS;
  const int n = comm->nranks;
  const size_t region = ML_CCU_CE_STAGE_BYTES / (size_t)n / 4096 * 4096;
  if (!c->ce_round) {
    cudaError_t e = cudaMalloc((void **)&c->ce_round, sizeof(uint64_t));
    if (e == cudaSuccess) e = cudaMemsetAsync(c->ce_round, 0, sizeof(uint64_t), c->setup);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->setup);
    if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "the copy-engine all-gather's round counter");
  }
  ML_TRY(ml_ccu_symm_make(comm, c, ML_CCU_CE_STAGE_OFFSET + (size_t)n * region, &c->ce));
  ml_ccu_ce *ce = &c->coll.ce;
  for (int q = 0; q < n; ++q) {
    ce->stage[q] = c->ce.base[q] + ML_CCU_CE_STAGE_OFFSET;
    ce->ready[q] = (uint64_t *)(c->ce.base[q] + ML_CCU_CE_READY_OFFSET);
    ce->released[q] = (uint64_t *)(c->ce.base[q] + ML_CCU_CE_RELEASED_OFFSET);
  }
  ce->round = c->ce_round;
  ce->region = region;
  return MOELINK_SUCCESS;
}

/* Everything after the NCCL communicator exists (collective). */
static moelink_status_t ml_ccu_setup(moelink_comm_t comm, ml_ccu_comm *c) {
  const int n = comm->nranks;
  int64_t ctas = ml_param_COMM_MAX_CTAS();
  if (ctas < 1) ctas = 1;
  if (ctas > ML_CCU_MAX_CTAS) ctas = ML_CCU_MAX_CTAS;
  int64_t oneshot = ml_param_COMM_ONESHOT_MAX_BYTES();
  if (oneshot < 0) oneshot = 0;

  cudaError_t e = cudaStreamCreateWithFlags(&c->setup, cudaStreamNonBlocking);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "cudaStreamCreateWithFlags");
  e = cudaMalloc((void **)&c->scratch, sizeof(uint64_t) * ML_CCU_MAX_RANKS);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "cudaMalloc of the communicator scratch");
  e = cudaMalloc((void **)&c->epoch, sizeof(uint64_t) * ML_CCU_MAX_CTAS);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "cudaMalloc of the epoch counters");
  e = cudaMemsetAsync(c->epoch, 0, sizeof(uint64_t) * ML_CCU_MAX_CTAS, c->setup);
  if (e == cudaSuccess) e = cudaStreamSynchronize(c->setup);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "zeroing the epoch counters");

  ML_TRY(ml_ccu_devcomm_create(c->nccl, (int)ctas, &c->devcomm, &c->lsa_rank, &c->lsa_size));
  /* LSA teams are consecutive world ranks, so a team of all ranks has
   * LSA rank == world rank. */
  c->lsa_ok = c->lsa_size == n && c->lsa_rank == comm->rank && n <= ML_CCU_MAX_RANKS;
  if (!c->lsa_ok) return MOELINK_SUCCESS; /* collectives go through NCCL's own */

  ML_TRY(ml_ccu_symm_make(comm, c, ml_ccu_internal_bytes(n, ML_CCU_MAX_CTAS), &c->internal));
  ml_ccu_coll *k = &c->coll;
  memset(k, 0, sizeof *k);
  k->rank = comm->rank;
  k->nranks = n;
  k->alloc_ctas = ML_CCU_MAX_CTAS;
  k->max_ctas = (int)ctas;
  k->slot_bytes = ML_CCU_SLOT_BYTES;
  k->oneshot_max = (size_t)oneshot;
  k->epoch = c->epoch;
  k->dc.rank = comm->rank;
  k->dc.nranks = n;
  k->dc.timeout_ns = (uint64_t)ml_comm_timeout_ms() * 1000000ull;
  for (int q = 0; q < n; ++q) {
    k->stage[q] = c->internal.base[q] + ML_CCU_STAGE_OFFSET;
    k->sig[q] = (uint64_t *)(c->internal.base[q] + ML_CCU_SIG_OFFSET);
    k->dc.ctl[q] = (uint64_t *)(c->internal.base[q] + ML_CCU_CTL_OFFSET);
  }
  int64_t ll_max = ml_param_COMM_LL_MAX_BYTES();
  if (ll_max < 0) ll_max = 0;
  if (ll_max > (int64_t)ML_CCU_LL_MAX_WORDS * 4) ll_max = (int64_t)ML_CCU_LL_MAX_WORDS * 4;
  if (n > 1 && ll_max > 0) {
    ML_TRY(ml_ccu_symm_make(comm, c, ML_CCU_LL_BYTES(n, ML_CCU_LL_MAX_WORDS), &c->ll));
    e = cudaMalloc(&c->ll_state, 64);
    if (e == cudaSuccess) e = cudaMemsetAsync(c->ll_state, 0, 64, c->setup);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->setup);
    if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "the low-latency all-reduce's counters");
    for (int q = 0; q < n; ++q) k->ll.cells[q] = (uint64_t *)c->ll.base[q];
    k->ll.epoch = (uint64_t *)c->ll_state;
    k->ll.ticket = (unsigned *)((char *)c->ll_state + 32);
    k->ll.max_words = ML_CCU_LL_MAX_WORDS;
    k->ll.max_ctas = ML_CCU_LL_MAX_CTAS;
    k->ll_max = (size_t)ll_max;
  }
  if (ml_ccu_allgather_knob() == ML_CCU_AG_CE && n > 1) {
    ML_TRY(ml_ccu_ce_make(comm, c));
    k->allgather_engine = ML_CCU_AG_CE;
  }
  return MOELINK_SUCCESS;
}

/* ---- bootstrap -------------------------------------------------------------- */

static moelink_status_t ml_ccu_unique_id(moelink_context_t ctx, moelink_unique_id_t *id) {
  (void)ctx;
  ML_TRY(ml_ccu_check_version());
  ml_ccu_nccl_env();
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(NULL, r, "ncclGetUniqueId");
  memcpy(id->bytes, u.internal, MOELINK_UNIQUE_ID_BYTES);
  for (int i = ML_CCU_TAG_AT; i < MOELINK_UNIQUE_ID_BYTES; ++i)
    if (id->bytes[i] != 0)
      return ml_fail(MOELINK_ERR_INTERNAL,
                     "this NCCL fills all %d bytes of its unique id; moelink cannot tag it",
                     MOELINK_UNIQUE_ID_BYTES);
  memcpy(id->bytes + ML_CCU_TAG_AT, ML_CCU_TAG, ML_CCU_TAG_BYTES);
  return MOELINK_SUCCESS;
}

/* An id from the CPU backend (ranks on one machine, as `moelink launch`
 * starts them): meet on the CPU, where rank 0 hands out a fresh NCCL id. */
static moelink_status_t ml_ccu_rendezvous(moelink_comm_t comm, const moelink_unique_id_t *id,
                                          ncclUniqueId *out) {
  const ml_comm_ops *cpu = ml_comm_cpu_ops();
  if (!cpu)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "the unique id was not made by moelink_get_unique_id on a cuda context");
  moelink_context_config_t cfg = MOELINK_CONTEXT_CONFIG_INIT;
  cfg.num_threads = 1;
  moelink_context_t cctx = NULL;
  ML_TRY(moelink_context_create(&cfg, &cctx));
  struct moelink_comm tmp;
  memset(&tmp, 0, sizeof tmp);
  tmp.ctx = cctx;
  tmp.rank = comm->rank;
  tmp.nranks = comm->nranks;
  tmp.ops = cpu;
  moelink_status_t s = cpu->init(&tmp, id);
  unsigned char *all = NULL;
  if (s == MOELINK_SUCCESS) {
    unsigned char mine[MOELINK_UNIQUE_ID_BYTES];
    memset(mine, 0, sizeof mine);
    ncclResult_t r = ncclSuccess;
    /* Rank 0 still joins the exchange when NCCL fails, so that the others
     * learn it at once instead of waiting out their limit. */
    if (comm->rank == 0) r = ncclGetUniqueId((ncclUniqueId *)mine);
    all = (unsigned char *)calloc((size_t)comm->nranks, MOELINK_UNIQUE_ID_BYTES);
    if (!all) {
      s = ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "unique id exchange buffer");
    } else {
      s = cpu->allgather(&tmp, mine, all, MOELINK_UNIQUE_ID_BYTES / 4, MOELINK_DTYPE_F32, NULL);
      if (s == MOELINK_SUCCESS && r != ncclSuccess) s = ml_ccu_nccl_fail(NULL, r, "ncclGetUniqueId");
      if (s == MOELINK_SUCCESS) {
        int zero = 1;
        for (int i = 0; i < MOELINK_UNIQUE_ID_BYTES; ++i) zero &= all[i] == 0;
        if (zero)
          s = ml_fail(MOELINK_ERR_NCCL, "rank 0 could not make an NCCL unique id");
        else
          memcpy(out->internal, all, MOELINK_UNIQUE_ID_BYTES);
      }
    }
    cpu->destroy(&tmp);
  }
  free(all);
  /* Destroying the context clears the thread's message: keep ours. */
  char msg[512];
  snprintf(msg, sizeof msg, "%s", s == MOELINK_SUCCESS ? "" : moelink_last_error());
  (void)moelink_context_destroy(cctx);
  if (s != MOELINK_SUCCESS)
    return ml_fail(s, "meeting the other ranks through the cpu backend's id: %s", msg);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_init_inner(moelink_comm_t comm, const moelink_unique_id_t *id) {
  ML_TRY(ml_ccu_check_version());
  ml_ccu_nccl_env();
  ncclUniqueId u;
  if (memcmp(id->bytes + ML_CCU_TAG_AT, ML_CCU_TAG, ML_CCU_TAG_BYTES) == 0) {
    memcpy(u.internal, id->bytes, ML_CCU_TAG_AT);
    memset(u.internal + ML_CCU_TAG_AT, 0, ML_CCU_TAG_BYTES);
  } else {
    ML_TRY(ml_ccu_rendezvous(comm, id, &u));
  }
  ncclComm_t nc = NULL;
  ncclResult_t r = ncclCommInitRank(&nc, comm->nranks, u, comm->rank);
  if (r != ncclSuccess) {
    char what[96];
    snprintf(what, sizeof what, "ncclCommInitRank(rank %d of %d, device %d)", comm->rank,
             comm->nranks, comm->ctx->device);
    return ml_ccu_nccl_fail(NULL, r, what);
  }
  ml_ccu_comm *c = (ml_ccu_comm *)calloc(1, sizeof *c);
  if (!c) {
    (void)ncclCommAbort(nc);
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "communicator state allocation failed");
  }
  c->nccl = nc;
  c->owned = 1;
  moelink_status_t s = ml_ccu_setup(comm, c);
  if (s != MOELINK_SUCCESS) {
    c->broken = 1; /* the peers may be stuck elsewhere: abort, do not wait */
    ml_ccu_teardown(c);
    return s;
  }
  comm->impl = c;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_init(moelink_comm_t comm, const moelink_unique_id_t *id) {
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev, ml_ccu_init_inner(comm, id));
}

static moelink_status_t ml_ccu_from_nccl_inner(moelink_comm_t comm, ncclComm_t nc) {
  ML_TRY(ml_ccu_check_version());
  ml_ccu_nccl_env();
  int dev = -1, rank = -1, n = 0;
  ncclResult_t r = ncclCommCuDevice(nc, &dev);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(nc, r, "ncclCommCuDevice");
  if (dev != comm->ctx->device)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "comm_init_from_nccl: the NCCL communicator is on device %d, the context on "
                   "device %d",
                   dev, comm->ctx->device);
  r = ncclCommUserRank(nc, &rank);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(nc, r, "ncclCommUserRank");
  r = ncclCommCount(nc, &n);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(nc, r, "ncclCommCount");
  comm->rank = rank;
  comm->nranks = n;
  ml_ccu_comm *c = (ml_ccu_comm *)calloc(1, sizeof *c);
  if (!c) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "communicator state allocation failed");
  c->nccl = nc;
  c->owned = 0;
  moelink_status_t s = ml_ccu_setup(comm, c);
  if (s != MOELINK_SUCCESS) {
    ml_ccu_teardown(c);
    return s;
  }
  comm->impl = c;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_init_from_nccl(moelink_comm_t comm, void *nccl_comm) {
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev, ml_ccu_from_nccl_inner(comm, (ncclComm_t)nccl_comm));
}

static void ml_ccu_destroy(moelink_comm_t comm) {
  ml_ccu_comm *c = ml_ccu(comm);
  if (!c) return;
  int prev = comm->ctx->device;
  moelink_status_t s = ml_cuda_enter(comm->ctx, &prev);
  (void)ml_ccu_read_failure(comm, c);
  ml_ccu_teardown(c);
  comm->impl = NULL;
  if (s == MOELINK_SUCCESS) (void)ml_cuda_leave(comm->ctx, prev, s);
}

static moelink_status_t ml_ccu_check_inner(moelink_comm_t comm, ml_ccu_comm *c,
                                           cudaStream_t stream) {
  cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "waiting for the communicator's work");
  if (ml_ccu_read_failure(comm, c)) return ml_fail(MOELINK_ERR_TIMEOUT, "%s", c->broken_msg);
  if (c->lsa_ok && c->internal.ptr) ML_TRY(ml_ccu_alltoallv_report(&c->coll));
  ncclResult_t ae = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(c->nccl, &ae);
  if (r != ncclSuccess) return ml_ccu_nccl_fail(c->nccl, r, "ncclCommGetAsyncError");
  if (ae != ncclSuccess && ae != ncclInProgress)
    return ml_ccu_nccl_fail(c->nccl, ae, "the NCCL communicator");
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_check(moelink_comm_t comm, void *stream) {
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev, ml_ccu_check_inner(comm, ml_ccu(comm), (cudaStream_t)stream));
}

/* ---- symmetric memory ------------------------------------------------------- */

static moelink_status_t ml_ccu_symm_alloc_inner(moelink_comm_t comm, size_t bytes, void **ptr) {
  ml_ccu_comm *c = ml_ccu(comm);
  ml_ccu_symm *m = (ml_ccu_symm *)calloc(1, sizeof *m);
  if (!m) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "symmetric buffer record allocation failed");
  moelink_status_t s = ml_ccu_symm_make(comm, c, bytes, m);
  if (s != MOELINK_SUCCESS) {
    free(m);
    return s;
  }
  m->next = c->user;
  c->user = m;
  *ptr = m->ptr;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_symm_alloc(moelink_comm_t comm, size_t bytes, void **ptr) {
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev, ml_ccu_symm_alloc_inner(comm, bytes, ptr));
}

static ml_ccu_symm *ml_ccu_find(ml_ccu_comm *c, const void *ptr, ml_ccu_symm ***link) {
  for (ml_ccu_symm **l = &c->user; *l; l = &(*l)->next) {
    ml_ccu_symm *m = *l;
    if ((const char *)ptr >= m->ptr && (const char *)ptr < m->ptr + m->bytes) {
      if (link) *link = l;
      return m;
    }
  }
  return NULL;
}

static moelink_status_t ml_ccu_symm_free_inner(moelink_comm_t comm, void *ptr) {
  ml_ccu_comm *c = ml_ccu(comm);
  ml_ccu_symm **link = NULL;
  ml_ccu_symm *m = ml_ccu_find(c, ptr, &link);
  if (!m)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "symm_free: %p is not a symmetric buffer of this communicator", ptr);
  if (m->ptr != (char *)ptr)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "symm_free: %p is inside the symmetric buffer %p, not its start", ptr,
                   (void *)m->ptr);
  /* Kernels still queued may use it; none waits forever. */
  cudaError_t e = cudaDeviceSynchronize();
  *link = m->next;
  moelink_status_t s = ml_ccu_symm_release(c, m);
  free(m);
  if (e != cudaSuccess) return ml_ccu_cuda_fail(e, "waiting for work before symm_free");
  return s;
}

static moelink_status_t ml_ccu_symm_free(moelink_comm_t comm, void *ptr) {
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev, ml_ccu_symm_free_inner(comm, ptr));
}

/* ---- collectives ------------------------------------------------------------ */

static ncclDataType_t ml_ccu_nccl_type(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_F32 ? ncclFloat32 : dt == MOELINK_DTYPE_BF16 ? ncclBfloat16
                                                                          : ncclFloat16;
}

/* Ranks that do not all share one NVLink domain: NCCL's own collectives. */
static moelink_status_t ml_ccu_nccl_coll(ml_ccu_comm *c, ml_ccu_op op, const void *send,
                                         void *recv, size_t count, moelink_dtype_t dt,
                                         cudaStream_t stream) {
  ncclResult_t r;
  const char *what;
  switch (op) {
  case ML_CCU_ALLREDUCE:
    what = "ncclAllReduce";
    r = ncclAllReduce(send, recv, count, ml_ccu_nccl_type(dt), ncclSum, c->nccl, stream);
    break;
  case ML_CCU_ALLGATHER:
    what = "ncclAllGather";
    r = ncclAllGather(send, recv, count, ml_ccu_nccl_type(dt), c->nccl, stream);
    break;
  default:
    what = "ncclReduceScatter";
    r = ncclReduceScatter(send, recv, count, ml_ccu_nccl_type(dt), ncclSum, c->nccl, stream);
    break;
  }
  if (r != ncclSuccess) return ml_ccu_nccl_fail(c->nccl, r, what);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_coll_run(moelink_comm_t comm, ml_ccu_op op, const void *send,
                                        void *recv, size_t count, moelink_dtype_t dt,
                                        void *stream) {
  ml_ccu_comm *c = ml_ccu(comm);
  if (c->broken)
    return ml_fail(MOELINK_ERR_INVALID_STATE, "the communicator failed earlier: %s",
                   c->broken_msg);
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  moelink_status_t s;
  if (!c->lsa_ok)
    s = ml_ccu_nccl_coll(c, op, send, recv, count, dt, (cudaStream_t)stream);
  else if (op == ML_CCU_ALLREDUCE && c->coll.ll_max > 0 &&
           count * moelink_dtype_size(dt) <= c->coll.ll_max &&
           (c->coll.force_allreduce == 0 || c->coll.force_allreduce == 3))
    s = ml_ccu_allreduce_ll(&c->coll.ll, comm->rank, comm->nranks, &c->coll.dc, send, recv,
                            count, dt, (cudaStream_t)stream);
  else if (op == ML_CCU_ALLGATHER && c->coll.allgather_engine == ML_CCU_AG_CE)
    s = ml_ccu_allgather_ce(&c->coll, send, recv, count * moelink_dtype_size(dt),
                            (cudaStream_t)stream);
  else
    s = ml_ccu_collective(&c->coll, op, send, recv, count, dt, (cudaStream_t)stream);
  return ml_cuda_leave(comm->ctx, prev, s);
}

static moelink_status_t ml_ccu_allreduce(moelink_comm_t comm, const void *send, void *recv,
                                         size_t count, moelink_dtype_t dt, void *stream) {
  return ml_ccu_coll_run(comm, ML_CCU_ALLREDUCE, send, recv, count, dt, stream);
}

static moelink_status_t ml_ccu_allgather(moelink_comm_t comm, const void *send, void *recv,
                                         size_t count, moelink_dtype_t dt, void *stream) {
  return ml_ccu_coll_run(comm, ML_CCU_ALLGATHER, send, recv, count, dt, stream);
}

static moelink_status_t ml_ccu_reduce_scatter(moelink_comm_t comm, const void *send, void *recv,
                                              size_t count, moelink_dtype_t dt, void *stream) {
  return ml_ccu_coll_run(comm, ML_CCU_REDUCE_SCATTER, send, recv, count, dt, stream);
}

/* Counts must be device memory: a host array would fault in the kernel.
 * Skipped while capturing (a capture is made once; the replays reuse it). */
static moelink_status_t ml_ccu_device_array(const char *name, const void *p,
                                            cudaStream_t stream) {
  if (!p) return MOELINK_SUCCESS;
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    (void)cudaGetLastError();
    return MOELINK_SUCCESS;
  }
  if (cs != cudaStreamCaptureStatusNone) return MOELINK_SUCCESS;
  struct cudaPointerAttributes at;
  cudaError_t e = cudaPointerGetAttributes(&at, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return MOELINK_SUCCESS;
  }
  if (at.type == cudaMemoryTypeUnregistered)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "alltoallv: %s %p is host memory: on a cuda communicator the counts live in "
                   "device memory",
                   name, p);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_ccu_alltoallv_inner(moelink_comm_t comm, ml_ccu_comm *c,
                                               const void *send, const int64_t *send_counts,
                                               const int64_t *send_offsets, void *recv,
                                               size_t recv_capacity, int64_t *recv_counts,
                                               int64_t *recv_offsets, moelink_dtype_t dt,
                                               cudaStream_t stream) {
  if (!c->lsa_ok)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "alltoallv: only %d of the %d ranks share this rank's NVLink domain (NCCL's "
                   "send/recv would need the counts on the host)",
                   c->lsa_size, comm->nranks);
  ML_TRY(ml_ccu_device_array("send_counts", send_counts, stream));
  ML_TRY(ml_ccu_device_array("send_offsets", send_offsets, stream));
  ML_TRY(ml_ccu_device_array("recv_counts", recv_counts, stream));
  ML_TRY(ml_ccu_device_array("recv_offsets", recv_offsets, stream));
  return ml_ccu_alltoallv(&c->coll, send, send_counts, send_offsets, recv, recv_capacity,
                          recv_counts, recv_offsets, dt, stream);
}

static moelink_status_t ml_ccu_alltoallv_op(moelink_comm_t comm, const void *send,
                                            const int64_t *send_counts,
                                            const int64_t *send_offsets, void *recv,
                                            size_t recv_capacity, int64_t *recv_counts,
                                            int64_t *recv_offsets, moelink_dtype_t dt,
                                            void *stream) {
  ml_ccu_comm *c = ml_ccu(comm);
  if (c->broken)
    return ml_fail(MOELINK_ERR_INVALID_STATE, "the communicator failed earlier: %s",
                   c->broken_msg);
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev,
                       ml_ccu_alltoallv_inner(comm, c, send, send_counts, send_offsets, recv,
                                              recv_capacity, recv_counts, recv_offsets, dt,
                                              (cudaStream_t)stream));
}

static const ml_comm_ops ml_ccu_ops = {
    "cuda",           ml_ccu_unique_id, ml_ccu_init,      ml_ccu_init_from_nccl,
    ml_ccu_destroy,   ml_ccu_check,     ml_ccu_symm_alloc, ml_ccu_symm_free,
    ml_ccu_allreduce, ml_ccu_allgather, ml_ccu_reduce_scatter, ml_ccu_alltoallv_op};

const ml_comm_ops *ml_comm_cuda_ops(void) { return &ml_ccu_ops; }

/* ---- device views (moelink_device.cuh) -------------------------------------- */

static moelink_status_t ml_ccu_device_ready(moelink_comm_t comm, const char *fn) {
  if (!comm) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: communicator is NULL", fn);
  if (comm->ops != &ml_ccu_ops)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s needs a communicator of a cuda context (this one runs on %s)", fn,
                   comm->ops ? comm->ops->name : "nothing");
  ml_ccu_comm *c = ml_ccu(comm);
  if (!c->lsa_ok)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: only %d of the %d ranks share this rank's NVLink domain (device views "
                   "need all of them, at most %d)",
                   fn, c->lsa_size, comm->nranks, ML_CCU_MAX_RANKS);
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_comm_device(moelink_comm_t comm, moelink_device_comm_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_device: out is NULL");
  ML_TRY(ml_ccu_device_ready(comm, "comm_device"));
  *out = ml_ccu(comm)->coll.dc;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_symm_view(moelink_comm_t comm, const void *ptr,
                                   moelink_symm_view_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "symm_view: out is NULL");
  if (!ptr) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "symm_view: ptr is NULL");
  ML_TRY(ml_ccu_device_ready(comm, "symm_view"));
  const ml_ccu_symm *m = ml_ccu_find(ml_ccu(comm), ptr, NULL);
  if (!m)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "symm_view: %p is in no symmetric buffer of this communicator", ptr);
  memset(out, 0, sizeof *out);
  for (int q = 0; q < comm->nranks; ++q) out->base[q] = m->base[q];
  out->local = m->ptr;
  out->bytes = m->bytes;
  return MOELINK_SUCCESS;
}

/* ---- hooks for tests -------------------------------------------------------- */

moelink_status_t ml_comm_cuda_force_allreduce(moelink_comm_t comm, int algorithm) {
  if (!comm || comm->ops != &ml_ccu_ops)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "not a cuda communicator");
  if (algorithm < 0 || algorithm > 3)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "all-reduce algorithm %d (0, 1, 2 or 3)",
                   algorithm);
  ml_ccu(comm)->coll.force_allreduce = algorithm;
  return MOELINK_SUCCESS;
}

moelink_status_t ml_comm_cuda_same(moelink_comm_t comm, uint64_t value, int *same) {
  if (!comm || comm->ops != &ml_ccu_ops)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "not a cuda communicator");
  int prev;
  ML_TRY(ml_cuda_enter(comm->ctx, &prev));
  return ml_cuda_leave(comm->ctx, prev, ml_ccu_same(ml_ccu(comm), value, same));
}

moelink_status_t ml_comm_cuda_set_ctas(moelink_comm_t comm, int ctas) {
  if (!comm || comm->ops != &ml_ccu_ops)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "not a cuda communicator");
  if (ctas < 1 || ctas > ML_CCU_MAX_CTAS)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "ctas %d out of range [1, %d]", ctas,
                   ML_CCU_MAX_CTAS);
  ml_ccu(comm)->coll.max_ctas = ctas;
  return MOELINK_SUCCESS;
}

moelink_status_t ml_comm_cuda_set_allgather(moelink_comm_t comm, int engine) {
  if (!comm || comm->ops != &ml_ccu_ops)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "not a cuda communicator");
  if (engine != ML_CCU_AG_SM && engine != ML_CCU_AG_CE)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "all-gather engine %d (0 sm or 1 ce)", engine);
  ml_ccu_comm *c = ml_ccu(comm);
  if (!c->lsa_ok)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "the all-gather engine cannot be chosen: only %d of the %d ranks share this "
                   "rank's NVLink domain, so NCCL's all-gather runs",
                   c->lsa_size, comm->nranks);
  if (engine == ML_CCU_AG_CE && comm->nranks > 1) {
    int prev;
    ML_TRY(ml_cuda_enter(comm->ctx, &prev));
    ML_TRY(ml_cuda_leave(comm->ctx, prev, ml_ccu_ce_make(comm, c)));
  }
  c->coll.allgather_engine = engine;
  return MOELINK_SUCCESS;
}

ncclComm_t ml_comm_cuda_nccl(moelink_comm_t comm) {
  if (!comm || comm->ops != &ml_ccu_ops || !comm->impl) return NULL;
  return ml_ccu(comm)->nccl;
}
