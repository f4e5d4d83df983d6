/* moelink bench comm: latency and bus bandwidth of moelink's collectives
 * beside NCCL's same op, in the same run, on the same buffers, per size.
 *
 * Every rank runs this (under `moelink launch`); rank 0 prints and writes the
 * JSON, with its own clock's times. On CUDA the CLI makes the NCCL
 * communicator itself and wraps it with moelink_comm_init_from_nccl, so both
 * columns run on one NCCL communicator, the same streams and buffers. */
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
#include <unistd.h>

#ifdef MOELINK_HAVE_CUDA
#include <cuda_runtime_api.h> /* the graph replay timing below (world.h has it only with NCCL) */
#endif


enum { BC_AR = 0, BC_AG = 1, BC_RS = 2, BC_A2A = 3, BC_NOPS = 4 };
static const char *const bc_op_names[BC_NOPS] = {"allreduce", "allgather", "reduce_scatter",
                                                 "alltoallv"};

/* Sizes off the powers of two (bytes of the larger buffer; rounded down to
 * whole elements per rank). */
static const size_t bc_odd_sizes[] = {1000, 100000, 10000000, 300000000};

#define BC_MAX_SIZES 96

typedef struct bc_opts {
  moelink_backend_t backend;
  int nops, ops[BC_NOPS];
  moelink_dtype_t dtype;
  size_t min, max;
  int ctas;      /* 0: the library's default */
  int ag_engine; /* -1: the library's default (MOELINK_COMM_ALLGATHER), 0 sm, 1 ce */
  int reps, warmup;
  int eager;
  const char *json;
} bc_opts;

typedef struct bc_stat {
  double med, min, max; /* microseconds per call; NAN: not measured */
} bc_stat;

typedef struct bc_row {
  int op;
  size_t size, count; /* bytes of the larger buffer; elements (per rank or per peer) */
  int iters;          /* calls per timed sample */
  bc_stat ml, nc;
  double ml_bw, nc_bw; /* bus bandwidth, GB/s (1e9 bytes/s); NAN: none */
} bc_row;

typedef struct bc_world {
  cli_world cw;               /* ranks, context, communicators, stream */
  char *send, *recv;          /* device (CUDA) or host (CPU) */
  int64_t *a2a_counts;        /* [3n] send counts, recv counts, recv offsets (device or host) */
  int64_t a2a_count;          /* what a2a_counts' send counts hold now */
} bc_world;

/* ---- options ---------------------------------------------------------------- */

static void bc_help_text(void) {
  printf(
      "moelink bench comm [options]     (every rank: moelink launch -n N -- moelink bench comm)\n"
      "  Median time per call and bus bandwidth of moelink's collectives beside NCCL's same\n"
      "  op in the same run (cuda), per size: powers of two from --min to --max plus a few\n"
      "  odd sizes. Rank 0 prints the table (its own clock) and writes the JSON; progress\n"
      "  goes to stderr.\n"
      "  size: bytes of the larger buffer, as nccl-tests counts it: all-reduce the buffer,\n"
      "        all-gather the output (nranks blocks), reduce-scatter the input, all-to-all-v\n"
      "        one rank's send buffer (equal counts to every rank)\n"
      "  bus bandwidth = size / time x factor (NCCL's convention): all-reduce 2(n-1)/n,\n"
      "        all-gather, reduce-scatter and all-to-all (n-1)/n\n"
      "  --backend cpu|cuda     (default cuda when built with NCCL and a GPU is visible)\n"
      "  --ops A,B,...          allreduce, allgather, reduce_scatter, alltoallv (default: all)\n"
      "  --dtype f32|bf16|f16   (default bf16)\n"
      "  --min SIZE --max SIZE  bytes, with K, M, G (powers of 1024) (default 8 .. 1G on cuda,\n"
      "                         8 .. 64M on cpu)\n"
      "  --ctas N               cuda: CTAs a moelink collective may use (MOELINK_COMM_MAX_CTAS)\n"
      "  --allgather sm|ce      cuda: moelink's all-gather engine, SM kernel or copy engines\n"
      "                         (MOELINK_COMM_ALLGATHER; default sm)\n"
      "  --iters N              timed samples per size and implementation; the median is\n"
      "                         reported (default cuda 10, cpu 5)\n"
      "  --warmup N             untimed samples first (default cuda 2, cpu 1)\n"
      "  --eager                cuda: time calls launched one by one instead of CUDA graphs\n"
      "  --json FILE            also write every number as JSON (rank 0)\n"
      "  timing: cuda: a sample is one replay of a CUDA graph of back-to-back calls (100 below\n"
      "  1 MiB, about 2 GiB of data above, 2..50 calls), CUDA events around it; cpu: a batch\n"
      "  of back-to-back calls after a barrier, host clock. Per call = sample / calls.\n");
}

void cli_help_bench_comm(void) { bc_help_text(); }

static size_t bc_size(const char *opt, const char *s) {
  char *end = NULL;
  errno = 0;
  if (!s || !*s || *s == '-') cli_usage_error("%s: expected a size in bytes (8, 64K, 1G), got '%s'", opt, s ? s : "");
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s) cli_usage_error("%s: expected a size in bytes (8, 64K, 1G), got '%s'", opt, s);
  unsigned long long mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1ull << 10;
  else if (*end == 'M' || *end == 'm') mul = 1ull << 20;
  else if (*end == 'G' || *end == 'g') mul = 1ull << 30;
  if (mul > 1) {
    ++end;
    if (*end == 'i') ++end;
  }
  if (*end == 'B') ++end;
  if (*end) cli_usage_error("%s: expected a size in bytes (8, 64K, 1G), got '%s'", opt, s);
  if (v == 0 || v > (1ull << 40) / mul)
    cli_usage_error("%s: %s is out of range (1 byte .. 1T)", opt, s);
  return (size_t)(v * mul);
}

static void bc_ops(const char *opt, const char *s, bc_opts *o) {
  o->nops = 0;
  const char *p = s;
  while (*p) {
    size_t len = strcspn(p, ",");
    int found = -1;
    for (int k = 0; k < BC_NOPS; ++k)
      if (strlen(bc_op_names[k]) == len && strncmp(p, bc_op_names[k], len) == 0) found = k;
    if (found < 0)
      cli_usage_error("%s: expected a comma-separated list of allreduce, allgather, "
                      "reduce_scatter, alltoallv, got '%s'",
                      opt, s);
    for (int k = 0; k < o->nops; ++k)
      if (o->ops[k] == found) cli_usage_error("%s: %s given twice", opt, bc_op_names[found]);
    o->ops[o->nops++] = found;
    p += len;
    if (*p == ',' && !*++p) cli_usage_error("%s: trailing comma in '%s'", opt, s);
  }
  if (o->nops == 0) cli_usage_error("%s: expected at least one op", opt);
}

static void bc_parse(int argc, char **argv, bc_opts *o) {
  memset(o, 0, sizeof *o);
  o->backend = MOELINK_BACKEND_CPU;
#if CLI_WORLD_GPU
  if (moelink_backend_available(MOELINK_BACKEND_CUDA)) o->backend = MOELINK_BACKEND_CUDA;
#endif
  o->dtype = MOELINK_DTYPE_BF16;
  o->ag_engine = -1;
  o->reps = -1;
  o->warmup = -1;
  int have_min = 0, have_max = 0;
  for (int i = 0; i < argc; ++i) {
    const char *arg = argv[i];
    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
      bc_help_text();
      exit(0);
    }
    char name[32];
    const char *val = cli_option_split("bench comm", arg, name, sizeof name);
#define IS(s) (strcmp(name, (s)) == 0)
    if (IS("--eager")) {
      if (val) cli_usage_error("--eager: takes no value, got '%s'", val);
      o->eager = 1;
      continue;
    }
    if (!(IS("--backend") || IS("--ops") || IS("--dtype") || IS("--min") || IS("--max") ||
          IS("--ctas") || IS("--allgather") || IS("--iters") || IS("--warmup") || IS("--json")))
      cli_usage_error("bench comm: unknown option '%s' (see moelink bench comm --help)", name);
    val = cli_option_value(argc, argv, &i, name, val);
    if (IS("--backend")) {
      o->backend = cli_backend(name, val);
    } else if (IS("--ops")) {
      bc_ops(name, val, o);
    } else if (IS("--dtype")) {
      o->dtype = cli_dtype(name, val);
    } else if (IS("--min")) {
      o->min = bc_size(name, val);
      have_min = 1;
    } else if (IS("--max")) {
      o->max = bc_size(name, val);
      have_max = 1;
    } else if (IS("--ctas")) {
      o->ctas = cli_int_arg(name, val, 1);
    } else if (IS("--allgather")) {
      if (strcmp(val, "sm") == 0) o->ag_engine = 0;
      else if (strcmp(val, "ce") == 0) o->ag_engine = 1;
      else cli_usage_error("--allgather: expected sm or ce, got '%s'", val);
    } else if (IS("--iters")) {
      o->reps = cli_int_arg(name, val, 1);
    } else if (IS("--warmup")) {
      o->warmup = cli_int_arg(name, val, 0);
    } else if (IS("--json")) {
      if (!*val) cli_usage_error("--json: expected a file name, got ''");
      o->json = val;
    }
#undef IS
  }
  const int cuda = o->backend == MOELINK_BACKEND_CUDA;
  if (!cuda && (o->ctas || o->ag_engine >= 0 || o->eager))
    cli_usage_error("--ctas, --allgather and --eager apply to --backend cuda only");
  if (o->nops == 0) {
    o->nops = BC_NOPS;
    for (int k = 0; k < BC_NOPS; ++k) o->ops[k] = k;
  }
  if (!have_min) o->min = 8;
  if (!have_max) o->max = cuda ? (size_t)1 << 30 : (size_t)64 << 20;
  if (o->min > o->max)
    cli_usage_error("--min %zu is above --max %zu", o->min, o->max);
  if (o->reps < 0) o->reps = cuda ? 10 : 5;
  if (o->warmup < 0) o->warmup = cuda ? 2 : 1;
}

/* ---- small helpers ---------------------------------------------------------- */

static void bc_fmt_size(size_t b, char *buf, size_t n) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024.0 && u < 3) {
    v /= 1024.0;
    ++u;
  }
  if (v == floor(v))
    snprintf(buf, n, "%.0f %s", v, unit[u]);
  else
    snprintf(buf, n, "%.1f %s", v, unit[u]);
}





static double bc_bus_factor(int op, int n) {
  const double nf = (double)n;
  return op == BC_AR ? 2.0 * (nf - 1.0) / nf : (nf - 1.0) / nf;
}

/* Elements per call for `size` bytes of the larger buffer (0: too small). */
static size_t bc_count(int op, size_t size, size_t es, int n) {
  return op == BC_AR ? size / es : size / es / (size_t)n;
}

static size_t bc_actual_size(int op, size_t count, size_t es, int n) {
  return op == BC_AR ? count * es : count * es * (size_t)n;
}

static int bc_cmp_size(const void *a, const void *b) {
  size_t x = *(const size_t *)a, y = *(const size_t *)b;
  return (x > y) - (x < y);
}

static int bc_sizes(const bc_opts *o, size_t *out) {
  int k = 0;
  for (size_t s = 1; s <= o->max && k < BC_MAX_SIZES; s *= 2)
    if (s >= o->min) out[k++] = s;
  for (size_t i = 0; i < sizeof bc_odd_sizes / sizeof bc_odd_sizes[0] && k < BC_MAX_SIZES; ++i)
    if (bc_odd_sizes[i] >= o->min && bc_odd_sizes[i] <= o->max) out[k++] = bc_odd_sizes[i];
  qsort(out, (size_t)k, sizeof *out, bc_cmp_size);
  return k;
}

/* ---- the world: context, communicators, buffers ----------------------------- */

static void bc_open(const bc_opts *o, bc_world *w, size_t buf_bytes) {
  memset(w, 0, sizeof *w);
  /* CPU collectives run on the calling thread: no pool per rank. */
  cli_world_open(&w->cw, "bench comm", o->backend, 1);
  const size_t counts_bytes = sizeof(int64_t) * 3 * (size_t)w->cw.nranks;
  w->send = (char *)cli_world_alloc(&w->cw, buf_bytes, "send buffer");
  w->recv = (char *)cli_world_alloc(&w->cw, buf_bytes, "recv buffer");
  w->a2a_counts = (int64_t *)cli_world_alloc(&w->cw, counts_bytes, "counts");
  int64_t *h = (int64_t *)cli_malloc(counts_bytes, "counts");
  memset(h, 0, counts_bytes);
  if (o->backend == MOELINK_BACKEND_CPU) {
    memcpy(w->a2a_counts, h, counts_bytes);
    memset(w->recv, 0, buf_bytes);
  } else if (gpu_h2d(w->a2a_counts, h, counts_bytes) ||
             gpu_memset_async(w->recv, 0, buf_bytes, w->cw.stream)) {
    cli_fail("%s", gpu_error());
  }
  free(h);
  CLI_CALL("moelink_fill_random", moelink_fill_random(w->cw.ctx, o->dtype, w->send,
                                                      buf_bytes / moelink_dtype_size(o->dtype),
                                                      (uint64_t)w->cw.rank + 1, 1.0f, 0.0f,
                                                      w->cw.stream));
  if (w->cw.stream && gpu_stream_sync(w->cw.stream) != 0) cli_fail("%s", gpu_error());
}

static void bc_close(bc_world *w) {
  CLI_CALL("moelink_comm_check", moelink_comm_check(w->cw.comm, w->cw.stream));
  cli_world_free(&w->cw, w->send);
  cli_world_free(&w->cw, w->recv);
  cli_world_free(&w->cw, w->a2a_counts);
  cli_world_close(&w->cw);
}

/* ---- one call ---------------------------------------------------------------- */

/* The all-to-all's counts: `count` elements to every rank, packed. */
static void bc_a2a_counts(bc_world *w, int64_t count) {
  if (w->a2a_count == count) return;
  int64_t *h = (int64_t *)cli_malloc(sizeof(int64_t) * (size_t)w->cw.nranks, "counts");
  for (int p = 0; p < w->cw.nranks; ++p) h[p] = count;
  if (w->cw.backend == MOELINK_BACKEND_CPU) {
    memcpy(w->a2a_counts, h, sizeof(int64_t) * (size_t)w->cw.nranks);
  } else if (gpu_h2d(w->a2a_counts, h, sizeof(int64_t) * (size_t)w->cw.nranks) != 0) {
    cli_fail("%s", gpu_error());
  }
  free(h);
  w->a2a_count = count;
}

/* One call of op by moelink (nccl 0) or NCCL (1). Returns the status (NCCL
 * failures end the program: they are not moelink's). */
static moelink_status_t bc_issue(bc_world *w, int op, int nccl, size_t count,
                                 moelink_dtype_t dt) {
  const size_t es = moelink_dtype_size(dt);
  if (!nccl) {
    switch (op) {
    case BC_AR: return moelink_allreduce(w->cw.comm, w->send, w->recv, count, dt, w->cw.stream);
    case BC_AG: return moelink_allgather(w->cw.comm, w->send, w->recv, count, dt, w->cw.stream);
    case BC_RS: return moelink_reduce_scatter(w->cw.comm, w->send, w->recv, count, dt, w->cw.stream);
    default: {
      int64_t *c = w->a2a_counts;
      return moelink_alltoallv(w->cw.comm, w->send, c, NULL, w->recv, count * (size_t)w->cw.nranks, c + w->cw.nranks,
                               c + 2 * w->cw.nranks, dt, w->cw.stream);
    }
    }
  }
#if CLI_WORLD_GPU
  const ncclDataType_t t = dt == MOELINK_DTYPE_F32 ? ncclFloat32
                           : dt == MOELINK_DTYPE_BF16 ? ncclBfloat16
                                                      : ncclFloat16;
  cudaStream_t s = (cudaStream_t)w->cw.stream;
  switch (op) {
  case BC_AR:
    CLI_NCCL(ncclAllReduce(w->send, w->recv, count, t, ncclSum, w->cw.nccl, s));
    break;
  case BC_AG:
    CLI_NCCL(ncclAllGather(w->send, w->recv, count, t, w->cw.nccl, s));
    break;
  case BC_RS:
    CLI_NCCL(ncclReduceScatter(w->send, w->recv, count, t, ncclSum, w->cw.nccl, s));
    break;
  default:
    CLI_NCCL(ncclGroupStart());
    for (int p = 0; p < w->cw.nranks; ++p) {
      CLI_NCCL(ncclSend(w->send + (size_t)p * count * es, count, t, p, w->cw.nccl, s));
      CLI_NCCL(ncclRecv(w->recv + (size_t)p * count * es, count, t, p, w->cw.nccl, s));
    }
    CLI_NCCL(ncclGroupEnd());
    break;
  }
#else
  (void)es;
#endif
  return MOELINK_SUCCESS;
}

/* ---- timing ------------------------------------------------------------------ */

static void bc_stats(double *v, int n, bc_stat *st) {
  st->min = st->max = v[0];
  for (int i = 1; i < n; ++i) {
    if (v[i] < st->min) st->min = v[i];
    if (v[i] > st->max) st->max = v[i];
  }
  st->med = cli_median(v, n);
}

static void bc_fail_call(int op, int nccl, size_t count, moelink_status_t s)
    __attribute__((noreturn));
static void bc_fail_call(int op, int nccl, size_t count, moelink_status_t s) {
  char what[96];
  snprintf(what, sizeof what, "%s %s (count %zu)", nccl ? "NCCL" : "moelink", bc_op_names[op],
           count);
  cli_lib_fail(what, s);
}

/* Host clock: `iters` calls after a barrier (a one-element all-reduce), per sample. */
static void bc_time_cpu(bc_world *w, const bc_opts *o, int op, size_t count, int iters,
                        bc_stat *st, double *buf) {
  float one = 1.0f, sum = 0.0f;
  for (int rep = -o->warmup; rep < o->reps; ++rep) {
    CLI_CALL("barrier", moelink_allreduce(w->cw.comm, &one, &sum, 1, MOELINK_DTYPE_F32, NULL));
    const double t0 = cli_now();
    for (int i = 0; i < iters; ++i) {
      moelink_status_t s = bc_issue(w, op, 0, count, o->dtype);
      if (s != MOELINK_SUCCESS) bc_fail_call(op, 0, count, s);
    }
    if (rep >= 0) buf[rep] = (cli_now() - t0) * 1e6 / iters;
  }
  bc_stats(buf, o->reps, st);
}

#ifdef MOELINK_HAVE_CUDA
#define BC_CUDA(call)                                                          \
  do {                                                                         \
    cudaError_t bc_e_ = (call);                                                \
    if (bc_e_ != cudaSuccess) cli_fail("%s: %s", #call, cudaGetErrorString(bc_e_)); \
  } while (0)

/* CUDA events around each sample: one replay of a graph of `iters` calls, or
 * (eager) `iters` calls launched one by one. */
static void bc_time_cuda(bc_world *w, const bc_opts *o, int op, int nccl, size_t count,
                         int iters, bc_stat *st, double *buf) {
  cudaStream_t s = (cudaStream_t)w->cw.stream;
  cudaGraph_t g = NULL;
  cudaGraphExec_t ge = NULL;
  if (!o->eager) {
    BC_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    moelink_status_t st_call = MOELINK_SUCCESS;
    for (int i = 0; i < iters && st_call == MOELINK_SUCCESS; ++i)
      st_call = bc_issue(w, op, nccl, count, o->dtype);
    cudaError_t e = cudaStreamEndCapture(s, &g);
    if (st_call != MOELINK_SUCCESS) bc_fail_call(op, nccl, count, st_call);
    if (e != cudaSuccess) cli_fail("capturing %s: %s", bc_op_names[op], cudaGetErrorString(e));
    BC_CUDA(cudaGraphInstantiate(&ge, g, 0));
  }
  cudaEvent_t *ev = (cudaEvent_t *)cli_malloc(sizeof(cudaEvent_t) * (size_t)(o->reps + 1), "events");
  for (int i = 0; i <= o->reps; ++i) BC_CUDA(cudaEventCreate(&ev[i]));
  for (int rep = -o->warmup; rep < o->reps; ++rep) {
    /* After the warm-up both ranks start the timed samples together. */
    if (rep == 0 && gpu_stream_sync(w->cw.stream) != 0) cli_fail("%s", gpu_error());
    if (rep >= 0) BC_CUDA(cudaEventRecord(ev[rep], s));
    if (ge) {
      BC_CUDA(cudaGraphLaunch(ge, s));
    } else {
      for (int i = 0; i < iters; ++i) {
        moelink_status_t r = bc_issue(w, op, nccl, count, o->dtype);
        if (r != MOELINK_SUCCESS) bc_fail_call(op, nccl, count, r);
      }
    }
  }
  BC_CUDA(cudaEventRecord(ev[o->reps], s));
  if (gpu_stream_sync(w->cw.stream) != 0)
    cli_fail("%s %s (count %zu): %s", nccl ? "NCCL" : "moelink", bc_op_names[op], count,
             gpu_error());
  for (int i = 0; i < o->reps; ++i) {
    float ms = 0.0f;
    BC_CUDA(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    buf[i] = 1e3 * (double)ms / iters;
  }
  for (int i = 0; i <= o->reps; ++i) (void)cudaEventDestroy(ev[i]);
  free(ev);
  if (ge) (void)cudaGraphExecDestroy(ge);
  if (g) (void)cudaGraphDestroy(g);
  bc_stats(buf, o->reps, st);
}
#endif

/* ---- output -------------------------------------------------------------------- */

static void bc_write_json(const bc_opts *o, const bc_world *w, const char *device,
                          const bc_row *rows, int nrows, const int *skipped) {
  FILE *f = fopen(o->json, "w");
  if (!f) cli_fail("--json: cannot open '%s' for writing", o->json);
  char host[256];
  if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "unknown");
  host[sizeof host - 1] = '\0';
  const int cuda = o->backend == MOELINK_BACKEND_CUDA;

  cli_json_begin(f, "moelink bench comm");
  fprintf(f, ",\n  \"host\": ");
  cli_json_str(f, host);
  fprintf(f, ",\n  \"backend\": \"%s\",\n  \"%s\": ", cuda ? "cuda" : "cpu", cuda ? "gpu" : "cpu");
  cli_json_str(f, device);
  fprintf(f, ",\n  \"nranks\": %d,\n  \"dtype\": \"%s\",\n", w->cw.nranks, moelink_dtype_name(o->dtype));
  fprintf(f, "  \"nccl_version\": ");
#if CLI_WORLD_GPU
  if (cuda) {
    int v = 0;
    (void)ncclGetVersion(&v);
    char vs[32];
    snprintf(vs, sizeof vs, "%d.%d.%d", v / 10000, v / 100 % 100, v % 100);
    cli_json_str(f, vs);
    int drv = 0, rt = 0;
    (void)cudaDriverGetVersion(&drv);
    (void)cudaRuntimeGetVersion(&rt);
    fprintf(f, ",\n  \"cuda_driver\": %d,\n  \"cuda_runtime\": %d", drv, rt);
  } else {
    fputs("null", f);
  }
#else
  fputs("null", f);
#endif
  fprintf(f, ",\n  \"env\": {\"NCCL_NVLS_ENABLE\": ");
  cli_json_str(f, getenv("NCCL_NVLS_ENABLE"));
  fprintf(f, ", \"MOELINK_COMM_MAX_CTAS\": ");
  cli_json_str(f, getenv("MOELINK_COMM_MAX_CTAS"));
  fprintf(f, ", \"MOELINK_COMM_ALLGATHER\": ");
  cli_json_str(f, getenv("MOELINK_COMM_ALLGATHER"));
  fprintf(f, ", \"MOELINK_COMM_ONESHOT_MAX_BYTES\": ");
  cli_json_str(f, getenv("MOELINK_COMM_ONESHOT_MAX_BYTES"));
  fprintf(f, "},\n  \"timing\": ");
  cli_json_str(f, !cuda ? "host clock around back-to-back calls after a barrier; rank 0"
                 : o->eager ? "CUDA events around back-to-back eager launches; rank 0"
                            : "CUDA events around one replay of a graph of back-to-back calls; rank 0");
  fprintf(f, ",\n  \"samples\": %d,\n  \"warmup\": %d,\n", o->reps, o->warmup);
  fprintf(f, "  \"size\": \"bytes of the larger buffer (nccl-tests): allreduce the buffer, "
             "allgather the output, reduce_scatter the input, alltoallv one rank's send "
             "buffer\",\n");
  fprintf(f, "  \"busbw\": \"size / time x 2(n-1)/n (allreduce) or (n-1)/n (others), 1e9 "
             "bytes/s\",\n");
  fprintf(f, "  \"ratio\": \"nccl_us / moelink_us (above 1: moelink faster)\",\n");
  fprintf(f, "  \"skipped_ops\": [");
  int first = 1;
  for (int k = 0; k < BC_NOPS; ++k)
    if (skipped[k]) {
      fprintf(f, "%s\"%s\"", first ? "" : ", ", bc_op_names[k]);
      first = 0;
    }
  fprintf(f, "],\n  \"rows\": [\n");
  for (int i = 0; i < nrows; ++i) {
    const bc_row *r = &rows[i];
    fprintf(f, "    {\"op\": \"%s\", \"size_bytes\": %zu, \"count\": %zu, \"calls_per_sample\": %d",
            bc_op_names[r->op], r->size, r->count, r->iters);
    if (r->op == BC_AG && cuda)
      fprintf(f, ", \"allgather_engine\": \"%s\"", o->ag_engine == 1 ? "ce" : o->ag_engine == 0 ? "sm" : "default");
    if (cuda && o->ctas) fprintf(f, ", \"ctas\": %d", o->ctas);
    fprintf(f, ", \"moelink_us\": ");
    cli_json_num(f, r->ml.med);
    fprintf(f, ", \"moelink_min_us\": ");
    cli_json_num(f, r->ml.min);
    fprintf(f, ", \"moelink_max_us\": ");
    cli_json_num(f, r->ml.max);
    fprintf(f, ", \"nccl_us\": ");
    cli_json_num(f, r->nc.med);
    fprintf(f, ", \"nccl_min_us\": ");
    cli_json_num(f, r->nc.min);
    fprintf(f, ", \"nccl_max_us\": ");
    cli_json_num(f, r->nc.max);
    fprintf(f, ", \"moelink_busbw_GBps\": ");
    cli_json_num(f, r->ml_bw);
    fprintf(f, ", \"nccl_busbw_GBps\": ");
    cli_json_num(f, r->nc_bw);
    fprintf(f, ", \"ratio\": ");
    cli_json_num(f, r->nc.med / r->ml.med);
    fprintf(f, "}%s\n", i + 1 < nrows ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  if (fclose(f) != 0) cli_fail("--json: error writing '%s'", o->json);
}

/* ---- the command ----------------------------------------------------------------- */

int cli_cmd_bench_comm(int argc, char **argv) {
  bc_opts o;
  bc_parse(argc, argv, &o);
  const int cuda = o.backend == MOELINK_BACKEND_CUDA;
  /* Read by the library when the communicator is made: set them first. */
  char tmp[32];
  if (o.ctas) {
    snprintf(tmp, sizeof tmp, "%d", o.ctas);
    setenv("MOELINK_COMM_MAX_CTAS", tmp, 1);
  }
  if (o.ag_engine >= 0) setenv("MOELINK_COMM_ALLGATHER", o.ag_engine ? "ce" : "sm", 1);

  const size_t es = moelink_dtype_size(o.dtype);
  size_t sizes[BC_MAX_SIZES];
  const int nsizes = bc_sizes(&o, sizes);
  size_t buf = 0;
  for (int i = 0; i < nsizes; ++i)
    if (sizes[i] > buf) buf = sizes[i];
  buf = (buf + 255) / 256 * 256;

  bc_world w;
  bc_open(&o, &w, buf);
  const int n = w.cw.nranks, root = w.cw.rank == 0;

  char device[256];
  if (cuda) {
    if (gpu_device_name(device, sizeof device) != 0) cli_fail("%s", gpu_error());
  } else {
    cli_cpu_model(device, sizeof device);
  }
  if (root) {
    printf("moelink bench comm: %d ranks, %s, %s on %s\n", n, moelink_dtype_name(o.dtype),
           cuda ? "cuda" : "cpu", device);
    if (cuda) {
      const char *ag = o.ag_engine == 1 ? "ce (copy engines)"
                       : o.ag_engine == 0 ? "sm"
                                          : (getenv("MOELINK_COMM_ALLGATHER") ? getenv("MOELINK_COMM_ALLGATHER") : "sm");
      printf("moelink    all-gather engine %s, CTAs %s; NCCL_NVLS_ENABLE=%s\n", ag,
             o.ctas ? tmp : (getenv("MOELINK_COMM_MAX_CTAS") ? getenv("MOELINK_COMM_MAX_CTAS") : "default"),
             getenv("NCCL_NVLS_ENABLE") ? getenv("NCCL_NVLS_ENABLE") : "(unset)");
      printf("timing     median of %d samples after %d warm-up, rank 0's CUDA events; a sample "
             "= %s of back-to-back calls\n",
             o.reps, o.warmup, o.eager ? "eager launches" : "one graph replay");
    } else {
      printf("timing     median of %d samples after %d warm-up, rank 0's host clock; a sample = "
             "back-to-back calls after a barrier (no NCCL on the cpu backend)\n",
             o.reps, o.warmup);
    }
    fflush(stdout);
  }

  bc_row *rows = (bc_row *)calloc((size_t)o.nops * (size_t)nsizes, sizeof *rows);
  double *samples = (double *)cli_malloc(sizeof(double) * (size_t)o.reps, "samples");
  if (!rows) cli_fail("out of host memory");
  int nrows = 0, skipped[BC_NOPS] = {0};
  cli_progress prog;
  cli_progress_start(&prog, "bench comm");
  const double total = (double)o.nops * nsizes;
  double done = 0.0;

  for (int oi = 0; oi < o.nops; ++oi) {
    const int op = o.ops[oi];
    if (op == BC_A2A) {
      /* The all-to-all may be missing from a backend: one small call (every
       * rank gets the same answer) decides before any timing. */
      bc_a2a_counts(&w, 1);
      moelink_status_t s = bc_issue(&w, op, 0, 1, o.dtype);
      if (s == MOELINK_SUCCESS) s = moelink_comm_check(w.cw.comm, w.cw.stream);
      if (s == MOELINK_ERR_UNSUPPORTED) {
        if (root)
          fprintf(stderr, "bench comm: skipping alltoallv: %s\n", moelink_last_error());
        skipped[op] = 1;
        done += nsizes;
        continue;
      }
      if (s != MOELINK_SUCCESS) bc_fail_call(op, 0, 1, s);
    }
    for (int si = 0; si < nsizes; ++si, ++done) {
      const size_t count = bc_count(op, sizes[si], es, n);
      if (count == 0) continue;
      bc_row *r = &rows[nrows++];
      r->op = op;
      r->count = count;
      r->size = bc_actual_size(op, count, es, n);
      if (op == BC_A2A) bc_a2a_counts(&w, (int64_t)count);
      const int big = r->size >= ((size_t)1 << 20);
      size_t it = ((size_t)2 << 30) / r->size;
      if (it < 2) it = 2;
      if (it > 50) it = 50;
      r->iters = big ? (int)it : 100;
      r->nc.med = r->nc.min = r->nc.max = NAN;
      r->nc_bw = NAN;
      if (cuda) {
#ifdef MOELINK_HAVE_CUDA
        bc_time_cuda(&w, &o, op, 0, count, r->iters, &r->ml, samples);
        if (w.cw.backend == MOELINK_BACKEND_CUDA)
          bc_time_cuda(&w, &o, op, 1, count, r->iters, &r->nc, samples);
#endif
      } else {
        if (!big) r->iters = 20;
        bc_time_cpu(&w, &o, op, count, r->iters, &r->ml, samples);
      }
      const double f = bc_bus_factor(op, n);
      r->ml_bw = (double)r->size / (r->ml.med * 1e-6) * f / 1e9;
      if (isfinite(r->nc.med)) r->nc_bw = (double)r->size / (r->nc.med * 1e-6) * f / 1e9;
      cli_progress_update(&prog, done + 1, total, "sizes");
    }
  }
  cli_progress_end(&prog);
  CLI_CALL("moelink_comm_check after the benchmark", moelink_comm_check(w.cw.comm, w.cw.stream));

  if (root) {
    printf("\n%-15s %10s %11s %11s %11s %13s %13s %7s\n", "op", "size", "count", "moelink us",
           "NCCL us", "moelink GB/s", "NCCL GB/s", "ratio");
    for (int i = 0; i < nrows; ++i) {
      const bc_row *r = &rows[i];
      char sz[32], nus[32], nbw[32], ratio[32];
      bc_fmt_size(r->size, sz, sizeof sz);
      if (isfinite(r->nc.med)) {
        snprintf(nus, sizeof nus, "%.2f", r->nc.med);
        snprintf(nbw, sizeof nbw, "%.1f", r->nc_bw);
        snprintf(ratio, sizeof ratio, "%.2f", r->nc.med / r->ml.med);
      } else {
        snprintf(nus, sizeof nus, "-");
        snprintf(nbw, sizeof nbw, "-");
        snprintf(ratio, sizeof ratio, "-");
      }
      printf("%-15s %10s %11zu %11.2f %11s %13.1f %13s %7s\n", bc_op_names[r->op], sz, r->count,
             r->ml.med, nus, r->ml_bw, nbw, ratio);
    }
    printf("\nsize: bytes of the larger buffer (nccl-tests); count: elements per rank (all-to-all: "
           "per peer; all-reduce: in total)\n"
           "GB/s: bus bandwidth = size / time x 2(n-1)/n (allreduce) or (n-1)/n (others)\n"
           "ratio: NCCL us / moelink us (above 1: moelink is faster)\n");
    fflush(stdout);
    if (o.json) {
      bc_write_json(&o, &w, device, rows, nrows, skipped);
      fprintf(stderr, "wrote %s\n", o.json);
    }
  }
  free(rows);
  free(samples);
  bc_close(&w);
  return 0;
}
