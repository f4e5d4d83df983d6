/* moelink bench tp: the tensor-parallel GEMMs fused with their collective
 * (moelink_ag_gemm, moelink_gemm_rs, moelink_gemm_ar), one process per rank
 * under `moelink launch -n N`, per shape beside what the same ranks do in the
 * same run without moelink:
 *   gemm  cuBLAS GEMM alone on the rank's local problem (bf16/f16 in, fp32
 *         accumulate, same dtype out): cublasGemmEx and cuBLASLt (its
 *         heuristic's first algorithm, 32 MiB workspace) are both timed and
 *         the faster is the floor of a perfect overlap;
 *   seq   the faster GEMM and NCCL's collective one after the other on one stream
 *         (all-gather before the GEMM; reduce-scatter / all-reduce after).
 * Each rank times its own calls with CUDA events (host clock on the CPU
 * backend); every timed call starts right after a small NCCL all-reduce
 * that lines the ranks up, and after a 256 MiB write that evicts L2. A
 * shape's time is the slowest rank's median. Before the fused op is timed,
 * it is checked on the same inputs against the GEMM+NCCL result (sampled
 * rows) and against an fp64 host recomputation of sampled elements from the
 * generator; a fused op that fails gets no time. */
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

#if CLI_WORLD_GPU
#include <cublasLt.h>
#include <cublas_v2.h>
#define BT_BLAS(call)                                                          \
  do {                                                                         \
    cublasStatus_t bt_s_ = (call);                                             \
    if (bt_s_ != CUBLAS_STATUS_SUCCESS) cli_fail("%s: cuBLAS status %d", #call, (int)bt_s_); \
  } while (0)
/* The baselines' cuBLAS handle, on the world's stream. */
static cublasHandle_t bt_blas;
static cublasLtHandle_t bt_lt;
static void *bt_lt_ws;
/* The baseline's cuBLASLt workspace: MOELINK_TP_LT_WS_MIB MiB (default 32),
 * as the library's TP GEMMs use. */
static size_t bt_lt_ws_bytes = (size_t)32 << 20;
#endif

#define BT_MAX_SHAPES 32
#define BT_SAMPLE_ROWS 8
#define BT_SAMPLE_COLS 32

enum { BT_AG = 0, BT_RS = 1, BT_AR = 2, BT_NOPS = 3 };
static const char *const bt_op_names[BT_NOPS] = {"ag_gemm", "gemm_rs", "gemm_ar"};
static const char *const bt_op_short[BT_NOPS] = {"ag", "rs", "ar"};

typedef struct bt_shape {
  int m, n, k; /* as the user or the default list wrote them */
} bt_shape;

typedef struct bt_opts {
  moelink_backend_t backend;
  moelink_dtype_t dtype;
  int ops[BT_NOPS];
  bt_shape shapes[BT_MAX_SHAPES];
  int nshapes; /* 0: the default list */
  int layer;   /* --dims layer: the listed N (ag) / K (rs, ar) is the whole layer's */
  int iters, warmup, comm_ctas, threads;
  uint64_t seed;
  const char *json;
} bt_opts;

/* One measured (op, shape). Times are the slowest rank's median, us. */
typedef struct bt_row {
  int op, m, n, k;  /* n, k: this rank's local sizes, as the call gets them */
  int list_n, list_k;
  double flops;     /* per rank: 2 * rows * n * k of the rank's GEMM */
  double fused_us, gemm_us, seq_us;
  double gemm_ex_us, gemm_lt_us; /* the two cuBLAS calls alone; gemm_us is the faster */
  double verify_err;   /* max |fused - fp64 ref| / magnitude, over sampled elements */
  double verify_l2;    /* rel L2 of fused vs GEMM+NCCL on the sampled rows (cuda) */
  int verified;        /* every rank within tolerance */
} bt_row;

static const char bt_help_text[] =
    "moelink bench tp [options]   (run under: moelink launch -n N -- moelink bench tp)\n"
    "  Tensor-parallel GEMMs fused with their collective, every rank of the launch one\n"
    "  tensor-parallel rank (TP = N). Per shape: the median time of moelink's fused op,\n"
    "  of cuBLAS's GEMM alone on the rank's local problem (cublasGemmEx and cuBLASLt's\n"
    "  first heuristic algorithm with MOELINK_TP_LT_WS_MIB (32) MiB of workspace, both\n"
    "  timed; the faster is the floor) and of that GEMM\n"
    "  and NCCL's collective in sequence on one stream; TFLOP/s of each (per rank:\n"
    "  2 * M * N_local * K for ag, 2 * M * N * K_local for rs and ar); fused/gemm and\n"
    "  seq/fused. Each shape is first verified (sampled rows against the GEMM+NCCL\n"
    "  result, sampled elements against an fp64 recomputation of the inputs); a fused op\n"
    "  that fails verification gets no time and the command exits 1.\n"
    "  Shapes are per rank, as in issue 8's targets (--dims local, the default):\n"
    "    ag  a [M/TP, K] per rank, b [N, K] (N = this rank's N_local), c [M, N]\n"
    "    rs  a [M, K], b [N, K] (K = this rank's K_local), c [M/TP, N]\n"
    "    ar  a [M, K], b [N, K] (K = K_local), c [M, N] on every rank\n"
    "  --dims layer reads N (ag) or K (rs, ar) as the whole layer's: N_local = N/TP,\n"
    "  K_local = K/TP.\n"
    "  --backend cuda|cpu     (default cuda when built with it and a GPU is visible)\n"
    "  --ops ag,rs,ar         which ops (default all three)\n"
    "  --shapes default|MxNxK,...  (default, cuda: ag 8192x8192x8192, 2048x14336x8192,\n"
    "                         8192x14336x8192; rs 8192x8192x8192, 2048x8192x14336,\n"
    "                         8192x8192x14336; ar {1,16,128,8192}x8192x4096. cpu: small\n"
    "                         shapes: ag/rs 128x256x256, 64x448x256 / 64x256x448; ar\n"
    "                         {1,16,128}x256x128). Given shapes apply to every op in --ops\n"
    "  --dims local|layer     how N (ag) and K (rs, ar) are read (default local)\n"
    "  --dtype bf16|f16|f32   (default bf16; f32 on cpu only)\n"
    "  --iters N              timed iterations per variant (default cuda 50, cpu 5)\n"
    "  --warmup N             untimed iterations first (default cuda 5, cpu 1)\n"
    "  --comm-ctas N          moelink_tp_config_t.comm_ctas (default 0: the library's)\n"
    "  --threads N            CPU threads per rank (cpu; default cores / ranks)\n"
    "  --seed S               input generator seed (default 1)\n"
    "  --json FILE            rank 0 writes everything as JSON\n";

void cli_help_bench_tp(void) { fputs(bt_help_text, stdout); }

/* ---- options --------------------------------------------------------------- */

static void bt_parse_ops(const char *s, bt_opts *o) {
  memset(o->ops, 0, sizeof o->ops);
  const char *p = s;
  while (*p) {
    size_t len = strcspn(p, ",");
    int found = 0;
    for (int i = 0; i < BT_NOPS; ++i)
      if (len == strlen(bt_op_short[i]) && strncmp(p, bt_op_short[i], len) == 0) {
        o->ops[i] = 1;
        found = 1;
      }
    if (!found) cli_usage_error("--ops: expected a list of ag, rs, ar; got '%s'", s);
    p += len;
    if (*p == ',') ++p;
  }
  if (!o->ops[0] && !o->ops[1] && !o->ops[2]) cli_usage_error("--ops: empty list");
}

static void bt_parse_shapes(const char *s, bt_opts *o) {
  o->nshapes = 0;
  if (strcmp(s, "default") == 0) return;
  const char *p = s;
  while (*p) {
    char item[64];
    size_t len = strcspn(p, ",");
    if (len == 0 || len >= sizeof item)
      cli_usage_error("--shapes: expected 'default' or MxNxK,...; got '%s'", s);
    memcpy(item, p, len);
    item[len] = '\0';
    long long v[3];
    char *q = item, *end = NULL;
    for (int i = 0; i < 3; ++i) {
      errno = 0;
      v[i] = strtoll(q, &end, 10);
      if (end == q || errno || v[i] < 1 || v[i] > INT_MAX || (i < 2 && *end != 'x') ||
          (i == 2 && *end))
        cli_usage_error("--shapes: '%s' is not MxNxK with positive integers", item);
      q = end + 1;
    }
    if (o->nshapes == BT_MAX_SHAPES) cli_usage_error("--shapes: at most %d shapes", BT_MAX_SHAPES);
    o->shapes[o->nshapes].m = (int)v[0];
    o->shapes[o->nshapes].n = (int)v[1];
    o->shapes[o->nshapes].k = (int)v[2];
    ++o->nshapes;
    p += len;
    if (*p == ',') ++p;
  }
}

static void bt_parse(int argc, char **argv, bt_opts *o) {
  memset(o, 0, sizeof *o);
  o->backend = moelink_backend_available(MOELINK_BACKEND_CUDA) ? MOELINK_BACKEND_CUDA
                                                               : MOELINK_BACKEND_CPU;
  o->dtype = MOELINK_DTYPE_BF16;
  o->ops[0] = o->ops[1] = o->ops[2] = 1;
  o->iters = o->warmup = -1;
  o->seed = 1;
  for (int i = 0; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      cli_help_bench_tp();
      exit(0);
    }
    char name[64];
    const char *val = cli_option_value(argc, argv, &i, name,
                                       cli_option_split("bench tp", a, name, sizeof name));
#define IS(s) (strcmp(name, (s)) == 0)
    if (IS("--backend")) {
      o->backend = cli_backend(name, val);
    } else if (IS("--dtype")) {
      o->dtype = cli_dtype(name, val);
    } else if (IS("--ops")) {
      bt_parse_ops(val, o);
    } else if (IS("--shapes")) {
      bt_parse_shapes(val, o);
    } else if (IS("--dims")) {
      if (strcmp(val, "local") == 0)
        o->layer = 0;
      else if (strcmp(val, "layer") == 0)
        o->layer = 1;
      else
        cli_usage_error("--dims: expected local or layer, got '%s'", val);
    } else if (IS("--iters")) {
      o->iters = cli_int_arg(name, val, 1);
    } else if (IS("--warmup")) {
      o->warmup = cli_int_arg(name, val, 0);
    } else if (IS("--comm-ctas")) {
      o->comm_ctas = cli_int_arg(name, val, 0);
    } else if (IS("--threads")) {
      o->threads = cli_int_arg(name, val, 0);
    } else if (IS("--seed")) {
      o->seed = (uint64_t)cli_int_arg(name, val, 0);
    } else if (IS("--json")) {
      o->json = val;
    } else {
      cli_usage_error("bench tp: unknown option '%s' (moelink bench tp --help)", name);
    }
#undef IS
  }
  const int cuda = o->backend == MOELINK_BACKEND_CUDA;
  if (o->iters < 0) o->iters = cuda ? 50 : 5;
  if (o->warmup < 0) o->warmup = cuda ? 5 : 1;
  if (cuda && o->dtype == MOELINK_DTYPE_F32)
    cli_usage_error("--dtype f32: the cuda tensor-parallel ops take bf16 or f16");
}

/* The default shapes of one op (issue 8's targets on cuda; a few small ones a
 * 2-core machine runs in seconds on cpu). */
static int bt_default_shapes(int op, int cuda, bt_shape *out) {
  static const bt_shape ag_cuda[] = {{8192, 8192, 8192}, {2048, 14336, 8192}, {8192, 14336, 8192}};
  static const bt_shape rs_cuda[] = {{8192, 8192, 8192}, {2048, 8192, 14336}, {8192, 8192, 14336}};
  static const bt_shape ar_cuda[] = {{1, 8192, 4096}, {16, 8192, 4096}, {128, 8192, 4096},
                                     {8192, 8192, 4096}};
  static const bt_shape ag_cpu[] = {{128, 256, 256}, {64, 448, 256}};
  static const bt_shape rs_cpu[] = {{128, 256, 256}, {64, 256, 448}};
  static const bt_shape ar_cpu[] = {{1, 256, 128}, {16, 256, 128}, {128, 256, 128}};
  const bt_shape *src;
  int n;
  if (op == BT_AG) {
    src = cuda ? ag_cuda : ag_cpu;
    n = cuda ? 3 : 2;
  } else if (op == BT_RS) {
    src = cuda ? rs_cuda : rs_cpu;
    n = cuda ? 3 : 2;
  } else {
    src = cuda ? ar_cuda : ar_cpu;
    n = cuda ? 4 : 3;
  }
  memcpy(out, src, sizeof *src * (size_t)n);
  return n;
}

/* ---- the world: contexts, communicators, streams --------------------------- */

/* ---- one (op, shape) --------------------------------------------------------- */

typedef struct bt_case {
  int op, m, n, k, nr;
  moelink_dtype_t dt;
  size_t es;
  uint64_t seed_a, seed_b; /* of rank 0; rank r adds r */
  moelink_tp_t tp;
  void *a, *b, *c;         /* moelink's inputs and output */
  size_t a_elems, b_elems, c_elems;
#if CLI_WORLD_GPU
  void *a_full;            /* ag: the gathered a [m, k] */
  void *part;              /* rs, ar: the GEMM's [m, n] */
  void *ref;               /* GEMM then NCCL: the same shape as c */
  int use_lt;              /* the baselines' GEMM: 0 cublasGemmEx, 1 cuBLASLt */
  cublasLtMatmulDesc_t lt_desc;
  cublasLtMatrixLayout_t lt_w, lt_x, lt_out;
  cublasLtMatmulAlgo_t lt_algo;
#endif
} bt_case;

enum { BT_V_FUSED = 0, BT_V_GEMM = 1, BT_V_SEQ = 2 };

static uint64_t bt_seed(uint64_t base, int rank) { return base + 7919ull * (uint64_t)rank; }

static void bt_call_fused(cli_world *w, bt_case *c) {
  moelink_status_t s;
  if (c->op == BT_AG)
    s = moelink_ag_gemm(c->tp, c->a, c->b, c->c, c->m, c->n, c->k, w->stream);
  else if (c->op == BT_RS)
    s = moelink_gemm_rs(c->tp, c->a, c->b, c->c, c->m, c->n, c->k, w->stream);
  else
    s = moelink_gemm_ar(c->tp, c->a, c->b, c->c, c->m, c->n, c->k, w->stream);
  if (s != MOELINK_SUCCESS) cli_lib_fail(bt_op_names[c->op], s);
}

#if CLI_WORLD_GPU
static cudaDataType_t bt_cuda_type(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

static ncclDataType_t bt_nccl_type(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_BF16 ? ncclBfloat16 : ncclFloat16;
}

/* Row-major out [rows, n] = x [rows, k] * b [n, k]^T: in cuBLAS's column-major
 * terms out^T [n, rows] = b^T x^T, i.e. op(B) = T on b (k x n, ld k). */
static void bt_gemm(cli_world *w, const bt_case *c, const void *x, int rows, void *out) {
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t t = bt_cuda_type(c->dt);
  if (c->use_lt) {
    BT_BLAS(cublasLtMatmul(bt_lt, c->lt_desc, &one, c->b, c->lt_w, x, c->lt_x, &zero, out,
                           c->lt_out, out, c->lt_out, &c->lt_algo, bt_lt_ws, bt_lt_ws_bytes,
                           (cudaStream_t)w->stream));
    return;
  }
  BT_BLAS(cublasGemmEx(bt_blas, CUBLAS_OP_T, CUBLAS_OP_N, c->n, rows, c->k, &one, c->b, t, c->k,
                       x, t, c->k, &zero, out, t, c->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* cuBLASLt's descriptors and heuristic algorithm for the case's GEMM (rows = m). */
static void bt_lt_plan(bt_case *c) {
  const cudaDataType_t t = bt_cuda_type(c->dt);
  const cublasOperation_t opt = CUBLAS_OP_T, opn = CUBLAS_OP_N;
  const uint64_t ws = bt_lt_ws_bytes;
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulHeuristicResult_t res;
  int got = 0;
  BT_BLAS(cublasLtMatmulDescCreate(&c->lt_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  BT_BLAS(cublasLtMatmulDescSetAttribute(c->lt_desc, CUBLASLT_MATMUL_DESC_TRANSA, &opt, sizeof opt));
  BT_BLAS(cublasLtMatmulDescSetAttribute(c->lt_desc, CUBLASLT_MATMUL_DESC_TRANSB, &opn, sizeof opn));
  BT_BLAS(cublasLtMatrixLayoutCreate(&c->lt_w, t, c->k, c->n, c->k));
  BT_BLAS(cublasLtMatrixLayoutCreate(&c->lt_x, t, c->k, c->m, c->k));
  BT_BLAS(cublasLtMatrixLayoutCreate(&c->lt_out, t, c->n, c->m, c->n));
  BT_BLAS(cublasLtMatmulPreferenceCreate(&pref));
  BT_BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                               sizeof ws));
  BT_BLAS(cublasLtMatmulAlgoGetHeuristic(bt_lt, c->lt_desc, c->lt_w, c->lt_x, c->lt_out,
                                         c->lt_out, pref, 1, &res, &got));
  if (got < 1) cli_fail("cuBLASLt has no algorithm for %d x %d x %d", c->m, c->n, c->k);
  c->lt_algo = res.algo;
  cublasLtMatmulPreferenceDestroy(pref);
}

static void bt_lt_free(bt_case *c) {
  cublasLtMatrixLayoutDestroy(c->lt_out);
  cublasLtMatrixLayoutDestroy(c->lt_x);
  cublasLtMatrixLayoutDestroy(c->lt_w);
  cublasLtMatmulDescDestroy(c->lt_desc);
}

static void bt_call_gpu(cli_world *w, bt_case *c, int variant) {
  cudaStream_t st = (cudaStream_t)w->stream;
  const ncclDataType_t nt = bt_nccl_type(c->dt);
  if (variant == BT_V_FUSED) {
    bt_call_fused(w, c);
  } else if (c->op == BT_AG) {
    if (variant == BT_V_SEQ)
      CLI_NCCL(ncclAllGather(c->a, c->a_full, (size_t)(c->m / c->nr) * (size_t)c->k, nt, w->nccl,
                            st));
    bt_gemm(w, c, c->a_full, c->m, c->ref);
  } else {
    bt_gemm(w, c, c->a, c->m, c->part);
    if (variant == BT_V_SEQ && c->op == BT_RS)
      CLI_NCCL(ncclReduceScatter(c->part, c->ref, (size_t)(c->m / c->nr) * (size_t)c->n, nt,
                                ncclSum, w->nccl, st));
    else if (variant == BT_V_SEQ)
      CLI_NCCL(ncclAllReduce(c->part, c->ref, (size_t)c->m * (size_t)c->n, nt, ncclSum, w->nccl,
                            st));
  }
}
#endif

/* Median of iters timed calls of one variant, in us (this rank's). */
static double bt_time(cli_world *w, bt_case *c, int variant, const bt_opts *o) {
  double *t = (double *)cli_malloc(sizeof(double) * (size_t)o->iters, "times");
  for (int it = -o->warmup; it < o->iters; ++it) {
#if CLI_WORLD_GPU
    if (w->backend == MOELINK_BACKEND_CUDA) {
      double ms = 0.0;
      if (cli_l2_flush(w->flush, it, w->stream))
        cli_fail("%s", gpu_error());
      cli_world_barrier(w);
      if (gpu_timer_start(&w->timer, w->stream)) cli_fail("%s", gpu_error());
      bt_call_gpu(w, c, variant);
      if (gpu_timer_stop(&w->timer, w->stream, &ms)) cli_fail("%s", gpu_error());
      if (it >= 0) t[it] = ms * 1e3;
      continue;
    }
#endif
    cli_world_barrier(w);
    double t0 = cli_now();
    bt_call_fused(w, c);
    if (it >= 0) t[it] = (cli_now() - t0) * 1e6;
  }
  double med = cli_median(t, o->iters);
  free(t);
  return med;
}

/* ---- verification -------------------------------------------------------------- */

/* bf16 / f16 round-to-nearest-even of an fp32 value, back in fp32. */
static float bt_to_dtype(moelink_dtype_t dt, float f) {
  if (dt == MOELINK_DTYPE_F32 || !isfinite(f)) return f;
  uint32_t u;
  memcpy(&u, &f, 4);
  if (dt == MOELINK_DTYPE_BF16) {
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
  }
  /* f16: 11 significant bits; below 2^-14 the spacing is fixed at 2^-24. */
  const float a = fabsf(f);
  if (a >= 65520.0f) return f > 0 ? INFINITY : -INFINITY;
  int e;
  (void)frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  int exp = e - 1 < -14 ? -14 : e - 1;
  const float q = ldexpf(1.0f, exp - 10);
  return copysignf(nearbyintf(a / q) * q, f);
}

static float bt_input(moelink_dtype_t dt, uint64_t seed, size_t i) {
  return bt_to_dtype(dt, moelink_random_value(seed, i, 1.0f, 0.0f));
}

static double bt_elem(moelink_dtype_t dt, const void *p, size_t i) {
  if (dt == MOELINK_DTYPE_F32) return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  if (dt == MOELINK_DTYPE_BF16) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  const int sign = h >> 15, ex = (h >> 10) & 31, man = h & 1023;
  double v;
  if (ex == 0)
    v = ldexp((double)man, -24);
  else if (ex == 31)
    v = man ? NAN : INFINITY;
  else
    v = ldexp((double)(man | 1024), ex - 25);
  return sign ? -v : v;
}

/* Per-element tolerance relative to the element's magnitude (the sum over
 * ranks of |partial|, plus BT_ACC_EPS of the sum of |products|): each of the
 * roundings (the partials, the sum) may land one unit in the last place away
 * from the fp64 recomputation's. */
static double bt_tol(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_BF16 ? 2e-2 : dt == MOELINK_DTYPE_F16 ? 4e-3 : 1e-4;
}

/* What an fp32 accumulation in another order may differ by, relative to the
 * sum of |products| (far above the typical error, far below a lost term). */
#define BT_ACC_EPS (1.0 / 65536.0)

/* The exact value an output element should hold, with the documented
 * roundings: each rank's partial rounded to the dtype, summed over ranks in
 * rank order in fp32, rounded once. Row i, column j of this rank's c. */
static double bt_reference(const bt_case *c, int rank, int i, int j, double *mag) {
  const size_t k = (size_t)c->k;
  double dot = 0.0;
  *mag = 0.0;
  if (c->op == BT_AG) {
    const int rows = c->m / c->nr, s = i / rows, li = i % rows;
    const uint64_t sa = bt_seed(c->seed_a, s), sb = bt_seed(c->seed_b, rank);
    double abs_sum = 0.0;
    for (size_t q = 0; q < k; ++q) {
      const double x = (double)bt_input(c->dt, sa, (size_t)li * k + q) *
                       (double)bt_input(c->dt, sb, (size_t)j * k + q);
      dot += x;
      abs_sum += fabs(x);
    }
    *mag = fabs(dot) + BT_ACC_EPS * abs_sum;
    return bt_to_dtype(c->dt, (float)dot);
  }
  const int g = c->op == BT_RS ? rank * (c->m / c->nr) + i : i;
  float sum = 0.0f;
  for (int s = 0; s < c->nr; ++s) {
    const uint64_t sa = bt_seed(c->seed_a, s), sb = bt_seed(c->seed_b, s);
    double abs_sum = 0.0;
    dot = 0.0;
    for (size_t q = 0; q < k; ++q) {
      const double x = (double)bt_input(c->dt, sa, (size_t)g * k + q) *
                       (double)bt_input(c->dt, sb, (size_t)j * k + q);
      dot += x;
      abs_sum += fabs(x);
    }
    const float p = bt_to_dtype(c->dt, (float)dot);
    *mag += fabs((double)p) + BT_ACC_EPS * abs_sum;
    sum += p;
  }
  return bt_to_dtype(c->dt, sum);
}

/* Rows of c to look at: evenly spread, first and last included. */
static int bt_sample(int total, int want, int *idx) {
  if (total <= want) {
    for (int i = 0; i < total; ++i) idx[i] = i;
    return total;
  }
  for (int i = 0; i < want; ++i) idx[i] = (int)((long long)i * (total - 1) / (want - 1));
  return want;
}

/* Poisons c (and the baseline's output), runs the baseline and the fused op
 * once, and checks this rank's sampled rows. Returns 1 when within tolerance;
 * err = max |fused - reference| / magnitude, l2 = rel L2 vs GEMM+NCCL. */
static int bt_verify(cli_world *w, bt_case *c, double *err, double *l2) {
  const int c_rows = c->op == BT_RS ? c->m / c->nr : c->m;
  const size_t row_bytes = (size_t)c->n * c->es;
  int rows[BT_SAMPLE_ROWS], cols[BT_SAMPLE_COLS];
  const int nrows = bt_sample(c_rows, BT_SAMPLE_ROWS, rows);
  const int ncols = bt_sample(c->n, BT_SAMPLE_COLS, cols);
  unsigned char *got = (unsigned char *)cli_malloc(row_bytes * (size_t)nrows, "sample");
  unsigned char *base = NULL;
  const int cuda = w->backend == MOELINK_BACKEND_CUDA;
  *err = 0.0;
  *l2 = NAN;
  if (cuda) {
#if CLI_WORLD_GPU
    base = (unsigned char *)cli_malloc(row_bytes * (size_t)nrows, "sample");
    if (gpu_memset_async(c->c, 0xff, c->c_elems * c->es, w->stream) ||
        gpu_memset_async(c->ref, 0xff, c->c_elems * c->es, w->stream))
      cli_fail("%s", gpu_error());
    cli_world_barrier(w);
    bt_call_gpu(w, c, BT_V_SEQ);
    bt_call_gpu(w, c, BT_V_FUSED);
    if (gpu_stream_sync(w->stream)) cli_fail("%s", gpu_error());
    for (int r = 0; r < nrows; ++r)
      if (gpu_d2h(got + (size_t)r * row_bytes, (char *)c->c + (size_t)rows[r] * row_bytes,
                  row_bytes) ||
          gpu_d2h(base + (size_t)r * row_bytes, (char *)c->ref + (size_t)rows[r] * row_bytes,
                  row_bytes))
        cli_fail("%s", gpu_error());
#endif
  } else {
    memset(c->c, 0xff, c->c_elems * c->es);
    cli_world_barrier(w);
    bt_call_fused(w, c);
    for (int r = 0; r < nrows; ++r)
      memcpy(got + (size_t)r * row_bytes, (char *)c->c + (size_t)rows[r] * row_bytes, row_bytes);
  }
  int ok = 1;
  if (base) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < (size_t)nrows * (size_t)c->n; ++i) {
      const double x = bt_elem(c->dt, got, i), y = bt_elem(c->dt, base, i);
      num += (x - y) * (x - y);
      den += y * y;
    }
    *l2 = den > 0 ? sqrt(num / den) : sqrt(num);
    if (!(*l2 <= 1e-2)) ok = 0;
  }
  for (int r = 0; r < nrows; ++r)
    for (int q = 0; q < ncols; ++q) {
      double mag;
      const double ref = bt_reference(c, w->rank, rows[r], cols[q], &mag);
      const double x = bt_elem(c->dt, got, (size_t)r * (size_t)c->n + (size_t)cols[q]);
      const double e = fabs(x - ref) / (mag > 1e-30 ? mag : 1e-30);
      if (!(e <= *err)) *err = isnan(e) ? INFINITY : e;
      if (!(e <= bt_tol(c->dt))) {
        if (ok)
          fprintf(stderr, "bench tp: rank %d %s m %d n %d k %d: c[%d][%d] = %.9g, expected %.9g\n",
                  w->rank, bt_op_names[c->op], c->m, c->n, c->k, rows[r], cols[q], x, ref);
        ok = 0;
      }
    }
  free(got);
  free(base);
  return ok;
}

/* ---- the run ------------------------------------------------------------------ */

static void bt_run_case(cli_world *w, const bt_opts *o, int op, const bt_shape *sh, bt_row *row) {
  bt_case c;
  memset(&c, 0, sizeof c);
  c.op = op;
  c.nr = w->nranks;
  c.dt = o->dtype;
  c.es = moelink_dtype_size(o->dtype);
  c.m = sh->m;
  c.n = sh->n;
  c.k = sh->k;
  if (o->layer) {
    int *d = op == BT_AG ? &c.n : &c.k;
    if (*d % c.nr)
      cli_usage_error("--dims layer: %s %d of shape %dx%dx%d is not a multiple of %d ranks",
                      op == BT_AG ? "N" : "K", *d, sh->m, sh->n, sh->k, c.nr);
    *d /= c.nr;
  }
  if (op != BT_AR && c.m % c.nr)
    cli_usage_error("%s: M %d is not a multiple of the %d ranks", bt_op_names[op], c.m, c.nr);
  c.seed_a = o->seed * 1000003ull + 11ull * (uint64_t)(op + 1);
  c.seed_b = c.seed_a + 0x5151ull;
  const int a_rows = op == BT_AG ? c.m / c.nr : c.m;
  const int c_rows = op == BT_RS ? c.m / c.nr : c.m;
  c.a_elems = (size_t)a_rows * (size_t)c.k;
  c.b_elems = (size_t)c.n * (size_t)c.k;
  c.c_elems = (size_t)c_rows * (size_t)c.n;

  memset(row, 0, sizeof *row);
  row->op = op;
  row->m = c.m;
  row->n = c.n;
  row->k = c.k;
  row->list_n = sh->n;
  row->list_k = sh->k;
  row->flops = 2.0 * (double)c.m * (double)c.n * (double)c.k;
  row->fused_us = row->gemm_us = row->seq_us = row->gemm_ex_us = row->gemm_lt_us = NAN;

  moelink_tp_config_t cfg = MOELINK_TP_CONFIG_INIT;
  cfg.dtype = c.dt;
  cfg.max_m = c.m;
  cfg.max_n = c.n;
  cfg.max_k = c.k;
  cfg.comm_ctas = o->comm_ctas;
  CLI_CALL("moelink_tp_create", moelink_tp_create(w->comm, &cfg, &c.tp));
  c.a = cli_world_alloc(w, c.a_elems * c.es, "a");
  c.b = cli_world_alloc(w, c.b_elems * c.es, "b");
  c.c = cli_world_alloc(w, c.c_elems * c.es, "c");
  CLI_CALL("moelink_fill_random a",
           moelink_fill_random(w->ctx, c.dt, c.a, c.a_elems, bt_seed(c.seed_a, w->rank), 1.0f,
                               0.0f, w->stream));
  CLI_CALL("moelink_fill_random b",
           moelink_fill_random(w->ctx, c.dt, c.b, c.b_elems, bt_seed(c.seed_b, w->rank), 1.0f,
                               0.0f, w->stream));
  const int cuda = w->backend == MOELINK_BACKEND_CUDA;
#if CLI_WORLD_GPU
  if (cuda) {
    c.ref = cli_world_alloc(w, c.c_elems * c.es, "reference c");
    if (op == BT_AG)
      c.a_full = cli_world_alloc(w, (size_t)c.m * (size_t)c.k * c.es, "gathered a");
    else
      c.part = cli_world_alloc(w, (size_t)c.m * (size_t)c.n * c.es, "GEMM partial");
    bt_lt_plan(&c);
  }
#endif
  if (cuda && gpu_stream_sync(w->stream)) cli_fail("%s", gpu_error());

  double err = 0.0, l2 = NAN;
  const int ok = bt_verify(w, &c, &err, &l2);
  /* A device-side wait that gave up is reported here, not as a slow time. */
  CLI_CALL("moelink_comm_check after the verification call",
           moelink_comm_check(w->comm, w->stream));
  /* Everyone learns every rank's verdict: the times below are measured only
   * when all ranks passed, and every rank must issue the same calls. */
  float mine[3] = {(float)ok, (float)err, (float)l2}, *all;
  all = (float *)cli_malloc(sizeof(float) * 3 * (size_t)w->nranks, "verdicts");
  cli_world_allgather_f32(w, mine, 3, all);
  row->verified = 1;
  row->verify_err = 0.0;
  row->verify_l2 = cuda ? 0.0 : NAN;
  for (int r = 0; r < w->nranks; ++r) {
    row->verified &= all[3 * r] == 1.0f;
    if (!((double)all[3 * r + 1] <= row->verify_err)) row->verify_err = all[3 * r + 1];
    if (cuda && !((double)all[3 * r + 2] <= row->verify_l2)) row->verify_l2 = all[3 * r + 2];
  }
  free(all);

  /* fused, gemm (the faster cuBLAS call), seq, cublasGemmEx, cuBLASLt */
  double t[5] = {NAN, NAN, NAN, NAN, NAN};
  if (row->verified) t[BT_V_FUSED] = bt_time(w, &c, BT_V_FUSED, o);
#if CLI_WORLD_GPU
  if (cuda) {
    c.use_lt = 0;
    t[3] = bt_time(w, &c, BT_V_GEMM, o);
    c.use_lt = 1;
    t[4] = bt_time(w, &c, BT_V_GEMM, o);
    c.use_lt = t[4] < t[3];
    t[BT_V_GEMM] = c.use_lt ? t[4] : t[3];
    t[BT_V_SEQ] = bt_time(w, &c, BT_V_SEQ, o);
  }
#endif
  CLI_CALL("moelink_comm_check after the timed calls", moelink_comm_check(w->comm, w->stream));
  /* The slowest rank's median: a layer waits for its slowest rank. */
  float tm[5];
  for (int v = 0; v < 5; ++v) tm[v] = (float)t[v];
  float *tall = (float *)cli_malloc(sizeof(float) * 5 * (size_t)w->nranks, "times");
  cli_world_allgather_f32(w, tm, 5, tall);
  double *dst[5] = {&row->fused_us, &row->gemm_us, &row->seq_us, &row->gemm_ex_us,
                    &row->gemm_lt_us};
  for (int v = 0; v < 5; ++v) {
    double worst = -1.0;
    for (int r = 0; r < w->nranks; ++r) {
      const double x = tall[5 * r + v];
      if (isnan(x)) {
        worst = NAN;
        break;
      }
      if (x > worst) worst = x;
    }
    *dst[v] = worst;
  }
  free(tall);

#if CLI_WORLD_GPU
  if (cuda) {
    cli_world_free(w, c.ref);
    cli_world_free(w, c.a_full);
    cli_world_free(w, c.part);
    bt_lt_free(&c);
  }
#endif
  cli_world_free(w, c.a);
  cli_world_free(w, c.b);
  cli_world_free(w, c.c);
  CLI_CALL("moelink_tp_destroy", moelink_tp_destroy(c.tp));
}

/* ---- output ------------------------------------------------------------------ */


static void bt_print_row(const bt_row *r, int cuda) {
  char ver[48];
  snprintf(ver, sizeof ver, "%s %.1e", r->verified ? "ok" : "FAIL", r->verify_err);
  printf("%-8s %6d %6d %6d  %10.1f %8.1f", bt_op_names[r->op], r->m, r->n, r->k, r->fused_us,
         cli_tflops(r->flops, r->fused_us) * (cuda ? 1.0 : 1e3));
  if (cuda)
    printf("  %10.1f %8.1f  %10.1f %8.1f  %10.3f %10.3f", r->gemm_us,
           cli_tflops(r->flops, r->gemm_us), r->seq_us, cli_tflops(r->flops, r->seq_us),
           r->fused_us / r->gemm_us, r->seq_us / r->fused_us);
  printf("  %s", ver);
  if (cuda) printf(" / L2 %.1e", r->verify_l2);
  printf("\n");
  fflush(stdout);
}




static void bt_write_json(const char *path, const bt_opts *o, const cli_world *w,
                          const char *device, const bt_row *rows, int nrows) {
  const int cuda = o->backend == MOELINK_BACKEND_CUDA;
  FILE *f = fopen(path, "w");
  if (!f) cli_fail("--json: cannot open '%s' for writing", path);
  cli_json_begin(f, "moelink bench tp");
  fprintf(f, ",\n  \"backend\": \"%s\",\n  \"%s\": ", cuda ? "cuda" : "cpu", cuda ? "gpu" : "cpu");
  cli_json_str(f, device);
  fprintf(f, ",\n  \"nranks\": %d,\n  \"tp\": %d,\n  \"dtype\": \"%s\",\n", w->nranks, w->nranks,
          moelink_dtype_name(o->dtype));
  fprintf(f, "  \"dims\": \"%s\",\n  \"dims_meaning\": ", o->layer ? "layer" : "local");
  cli_json_str(f, "m, n, k of a row are what the moelink call gets on each rank: ag_gemm a "
                 "[m/tp, k], b [n, k] (n = this rank's N_local), c [m, n]; gemm_rs / gemm_ar a "
                 "[m, k], b [n, k] (k = this rank's K_local). list_n / list_k are the shape as "
                 "listed; with dims=layer the listed N (ag) or K (rs, ar) is the whole layer's "
                 "and n = N/tp or k = K/tp");
  fprintf(f, ",\n  \"iters\": %d,\n  \"warmup\": %d,\n  \"comm_ctas\": %d,\n  \"seed\": %llu,\n",
          o->iters, o->warmup, o->comm_ctas, (unsigned long long)o->seed);
  fprintf(f, "  \"timing\": ");
  cli_json_str(f, cuda ? "per rank: median of iters CUDA-event-timed calls after warmup, each "
                        "after a 256 MiB L2 flush (l2_flush) and a 1-element NCCL all-reduce "
                        "that lines the ranks up; a row's time is the slowest rank's median"
                      : "per rank: median of iters host-clock-timed calls after warmup, each "
                        "after a barrier; a row's time is the slowest rank's median");
  fprintf(f, ",\n  \"l2_flush\": ");
  cli_json_str(f, cuda ? cli_l2_flush_name() : NULL);
  fprintf(f, ",\n  \"baselines\": ");
  cli_json_str(f, cuda ? "gemm: the faster of cublasGemmEx (gemm_ex_us) and cuBLASLt with its "
                        "heuristic's first algorithm and MOELINK_TP_LT_WS_MIB (default 32) MiB "
                        "of workspace (gemm_lt_us), dtype "
                        "in/out, CUBLAS_COMPUTE_32F, on the rank's local problem; seq: "
                        "ncclAllGather then that GEMM (ag), the GEMM then ncclReduceScatter (rs) "
                        "or ncclAllReduce (ar), one stream"
                      : "none on the cpu backend");
  fprintf(f, ",\n  \"flops\": ");
  cli_json_str(f, "per rank: 2 * m * n * k (the rank's GEMM); TFLOPs = flops / time");
  fprintf(f, ",\n  \"verify\": ");
  cli_json_str(f, "before timing, outputs poisoned: verify_max_err = max over sampled elements "
                 "of |c - fp64 recomputation with the documented roundings| / (sum over ranks "
                 "of |partial|); verify_rel_l2_vs_nccl = rel L2 of c vs GEMM+NCCL over sampled "
                 "rows; worst rank");
  fprintf(f, ",\n  \"rows\": [\n");
  for (int i = 0; i < nrows; ++i) {
    const bt_row *r = &rows[i];
    fprintf(f, "    {\"op\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, \"list_n\": %d, "
               "\"list_k\": %d",
            bt_op_names[r->op], r->m, r->n, r->k, r->list_n, r->list_k);
    cli_json_field(f, "flops", r->flops);
    cli_json_field(f, "fused_us", r->fused_us);
    cli_json_field(f, "fused_TFLOPs", cli_tflops(r->flops, r->fused_us));
    if (cuda) {
      cli_json_field(f, "gemm_us", r->gemm_us);
      cli_json_field(f, "gemm_TFLOPs", cli_tflops(r->flops, r->gemm_us));
      cli_json_field(f, "gemm_ex_us", r->gemm_ex_us);
      cli_json_field(f, "gemm_lt_us", r->gemm_lt_us);
      cli_json_field(f, "seq_us", r->seq_us);
      cli_json_field(f, "seq_TFLOPs", cli_tflops(r->flops, r->seq_us));
      cli_json_field(f, "fused_over_gemm", r->fused_us / r->gemm_us);
      cli_json_field(f, "seq_over_fused", r->seq_us / r->fused_us);
      cli_json_field(f, "verify_rel_l2_vs_nccl", r->verify_l2);
    }
    cli_json_field(f, "verify_max_err", r->verify_err);
    fprintf(f, ", \"verified\": %s}%s\n", r->verified ? "true" : "false",
            i + 1 < nrows ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  if (fclose(f) != 0) cli_fail("--json: error writing '%s'", path);
}


int cli_cmd_bench_tp(int argc, char **argv) {
  bt_opts o;
  bt_parse(argc, argv, &o);
  (void)cli_l2_flush_name(); /* a bad MOELINK_BENCH_L2_FLUSH is a usage error on any backend */
  cli_world w;
  cli_world_open(&w, "bench tp", o.backend, o.threads);
#if CLI_WORLD_GPU
  if (w.backend == MOELINK_BACKEND_CUDA) {
    BT_BLAS(cublasCreate(&bt_blas));
    BT_BLAS(cublasSetStream(bt_blas, (cudaStream_t)w.stream));
    BT_BLAS(cublasLtCreate(&bt_lt));
    const char *wsv = getenv("MOELINK_TP_LT_WS_MIB");
    if (wsv && *wsv) {
      char *end = NULL;
      const long mib = strtol(wsv, &end, 10);
      if (*end || mib < 1 || mib > 1024)
        cli_usage_error("MOELINK_TP_LT_WS_MIB: expected 1..1024, got '%s'", wsv);
      bt_lt_ws_bytes = (size_t)mib << 20;
    }
    if (cudaMalloc(&bt_lt_ws, bt_lt_ws_bytes) != cudaSuccess)
      cli_fail("cudaMalloc of the cuBLASLt workspace failed");
  }
#endif
  const int cuda = o.backend == MOELINK_BACKEND_CUDA;
  char device[256] = "cpu";
  if (cuda && gpu_device_name(device, sizeof device)) cli_fail("%s", gpu_error());
  if (!cuda) cli_cpu_model(device, sizeof device);
  if (w.rank == 0) {
    printf("moelink bench tp: %d ranks (TP = %d), %s, %s, dims %s (n, k below are each "
           "rank's: ag n = N_local, rs/ar k = K_local)\n",
           w.nranks, w.nranks, device, moelink_dtype_name(o.dtype),
           o.layer ? "layer" : "local");
    printf("timing: median of %d after %d warm-up, %s%s%s; the slowest rank's median\n",
           o.iters, o.warmup, cuda ? "CUDA events, L2 flushed (256 MiB " : "host clock",
           cuda ? cli_l2_flush_name() : "", cuda ? ") and ranks lined up before each"
                                                : ", ranks lined up before each");
    printf("%-8s %6s %6s %6s  %10s %8s", "op", "M", "N", "K", "fused_us",
           cuda ? "TFLOP/s" : "GFLOP/s");
    if (cuda)
      printf("  %10s %8s  %10s %8s  %10s %10s", "gemm_us", "TFLOP/s", "seq_us", "TFLOP/s",
             "fused/gemm", "seq/fused");
    printf("  verify (max err%s)\n", cuda ? " / rel L2 vs GEMM+NCCL" : "");
    fflush(stdout);
  }
  bt_row *rows = (bt_row *)cli_malloc(sizeof(bt_row) * BT_NOPS * BT_MAX_SHAPES, "rows");
  int nrows = 0, failed = 0;
  for (int op = 0; op < BT_NOPS; ++op) {
    if (!o.ops[op]) continue;
    bt_shape sh[BT_MAX_SHAPES];
    int ns = o.nshapes;
    if (ns)
      memcpy(sh, o.shapes, sizeof sh[0] * (size_t)ns);
    else
      ns = bt_default_shapes(op, cuda, sh);
    for (int s = 0; s < ns; ++s) {
      bt_row *r = &rows[nrows++];
      bt_run_case(&w, &o, op, &sh[s], r);
      failed |= !r->verified;
      if (w.rank == 0) bt_print_row(r, cuda);
    }
  }
  if (w.rank == 0 && o.json) {
    bt_write_json(o.json, &o, &w, device, rows, nrows);
    printf("wrote %s\n", o.json);
  }
  free(rows);
  #if CLI_WORLD_GPU
  if (w.backend == MOELINK_BACKEND_CUDA) {
    cublasDestroy(bt_blas);
    cublasLtDestroy(bt_lt);
    cudaFree(bt_lt_ws);
  }
#endif
  cli_world_close(&w);
  if (failed && w.rank == 0)
    fprintf(stderr, "moelink: error: bench tp: a fused op failed verification (see 'FAIL')\n");
  return failed ? CLI_EXIT_FAIL : 0;
}
