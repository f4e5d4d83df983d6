/* Tensor-parallel fused GEMMs (moelink_ag_gemm, moelink_gemm_rs,
 * moelink_gemm_ar) on GPU ranks, each call checked two ways on the same
 * inputs:
 *   - against cuBLAS's GEMM and NCCL's collective (all-gather before the
 *     GEMM; reduce-scatter / all-reduce after it), run on the NCCL
 *     communicator under the moelink one;
 *   - element by element against an fp64 recomputation on the host from the
 *     generator (every rank regenerates every rank's inputs), with the
 *     roundings the header documents: each rank's partial rounded to the
 *     dtype, the partials summed over ranks in rank order in fp32, rounded
 *     once.
 * Odd shapes (m = nranks * odd, n and k in {1, 7, 129, 1000}), bf16 and f16,
 * outputs poisoned with NaN bytes and guarded past their end before each
 * call, a second call giving the same bits, gemm_ar bitwise the same on every
 * rank, 200 back-to-back calls of random ops, dtypes and shapes, each op
 * captured in a CUDA graph and replayed with new inputs; gemm_ar at decode
 * sizes (the fused kernel: m <= 16, n and k multiples of 64, and its
 * neighbours that are not), 120 back-to-back such calls mixing both paths,
 * two of them in graphs; gemm_ar of 17 to 128 rows (65 and more with n and
 * k multiples of 128: the wgmma kernel; and neighbours that are not), 120
 * back-to-back calls of 1 to 128 rows mixing all gemm_ar paths, one in a
 * graph; M = N = K = 8192 for
 * each op against cuBLAS + NCCL (relative L2), and the argument errors.
 *
 *   moelink launch -n 2 -- mgpu_test_tp */
#include "mgpu.h"

#include <cublas_v2.h>

static mg_world W;
static cublasHandle_t g_blas;

enum { OP_AG = 0, OP_RS = 1, OP_AR = 2 };
static const char *const op_name[3] = {"ag_gemm", "gemm_rs", "gemm_ar"};

#define GUARD_BYTES 256
#define GUARD_BYTE 0xa5

/* Relative to an element's magnitude (sum over ranks of |partial| plus
 * ACC_EPS of the sum of |products|): each rounding may land one unit in the
 * last place away from the fp64 recomputation's; ACC_EPS covers fp32
 * accumulation in another order. */
#define ACC_EPS (1.0 / 65536.0)
static double elem_tol(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_BF16 ? 2e-2 : dt == MOELINK_DTYPE_F16 ? 4e-3 : 1e-4;
}

static ncclDataType_t nccl_type(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_BF16 ? ncclBfloat16 : ncclFloat16;
}

static int a_rows(int op, int m) { return op == OP_AG ? m / W.size : m; }
static int c_rows(int op, int m) { return op == OP_RS ? m / W.size : m; }

/* Seeds of rank r's a and b in case c. */
static uint64_t seed_a(int r, int c) { return mg_seed(r, 2 * c); }
static uint64_t seed_b(int r, int c) { return mg_seed(r, 2 * c + 1); }

static void fill(moelink_dtype_t dt, void *p, size_t n, uint64_t seed) {
  MG_MUST(moelink_fill_random(W.ctx, dt, p, n, seed, 1.0f, 0.0f, W.stream), "moelink_fill_random");
}

static void poison(void *p, size_t bytes) { MG_CUDA(cudaMemsetAsync(p, 0xff, bytes, W.stream)); }

static void sync_stream(void) { MG_CUDA(cudaStreamSynchronize(W.stream)); }

static void *to_host(const void *dev, size_t bytes) {
  void *h = mg_host(bytes);
  MG_CUDA(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
  return h;
}

static moelink_status_t run_op(moelink_tp_t tp, int op, const void *a, const void *b, void *c,
                               int m, int n, int k) {
  if (op == OP_AG) return moelink_ag_gemm(tp, a, b, c, m, n, k, W.stream);
  if (op == OP_RS) return moelink_gemm_rs(tp, a, b, c, m, n, k, W.stream);
  return moelink_gemm_ar(tp, a, b, c, m, n, k, W.stream);
}

/* Row-major out [rows, n] = x [rows, k] b[n, k]^T through cuBLAS (fp32
 * compute): column-major out^T = b^T x^T. */
static void gemm(moelink_dtype_t dt, const void *x, const void *b, void *out, int rows, int n,
                 int k) {
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t t = dt == MOELINK_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
  cublasStatus_t s = cublasGemmEx(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &one, b, t, k, x,
                                  t, k, &zero, out, t, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    CHECK(0, "cublasGemmEx %dx%dx%d: status %d", rows, n, k, (int)s);
    mg_bail("cuBLAS error");
  }
}

/* The unfused reference on the device: cuBLAS + NCCL into ref (c's shape).
 * scratch: [m, k] for ag (the gathered a), [m, n] for rs and ar. */
static void baseline(int op, moelink_dtype_t dt, const void *a, const void *b, void *ref,
                     void *scratch, int m, int n, int k) {
  const ncclDataType_t t = nccl_type(dt);
  if (op == OP_AG) {
    MG_NCCL(W.nccl, ncclAllGather(a, scratch, (size_t)(m / W.size) * (size_t)k, t, W.nccl,
                                  W.stream));
    gemm(dt, scratch, b, ref, m, n, k);
    return;
  }
  gemm(dt, a, b, scratch, m, n, k);
  if (op == OP_RS)
    MG_NCCL(W.nccl, ncclReduceScatter(scratch, ref, (size_t)(m / W.size) * (size_t)n, t, ncclSum,
                                      W.nccl, W.stream));
  else
    MG_NCCL(W.nccl, ncclAllReduce(scratch, ref, (size_t)m * (size_t)n, t, ncclSum, W.nccl,
                                  W.stream));
}

/* ---- the host reference ------------------------------------------------------ */

/* Every rank's a and b of a case as the generator wrote them (fp32 values
 * of the dtype). */
typedef struct inputs {
  float *a[MOELINK_DEVICE_MAX_RANKS], *b[MOELINK_DEVICE_MAX_RANKS];
} inputs;

static void make_inputs(inputs *in, int op, moelink_dtype_t dt, int m, int n, int k,
                        uint64_t (*sa)(int, int), uint64_t (*sb)(int, int), int c) {
  const size_t an = (size_t)a_rows(op, m) * (size_t)k, bn = (size_t)n * (size_t)k;
  for (int s = 0; s < W.size; ++s) {
    in->a[s] = (float *)mg_host(an * sizeof(float));
    in->b[s] = (float *)mg_host(bn * sizeof(float));
    const uint64_t ua = sa(s, c), ub = sb(s, c);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < an; ++i) in->a[s][i] = mg_input(dt, ua, i);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < bn; ++i) in->b[s][i] = mg_input(dt, ub, i);
  }
}

static void free_inputs(inputs *in) {
  for (int s = 0; s < W.size; ++s) {
    free(in->a[s]);
    free(in->b[s]);
  }
}

static double dot(const float *x, const float *y, int k, double *abs_sum) {
  double d = 0.0, m = 0.0;
  for (int q = 0; q < k; ++q) {
    const double p = (double)x[q] * (double)y[q];
    d += p;
    m += fabs(p);
  }
  *abs_sum = m;
  return d;
}

/* Element (i, j) of this rank's c: the value (with the documented roundings)
 * and its magnitude for the tolerance. */
static double expect(const inputs *in, int op, moelink_dtype_t dt, int m, int k, int i, int j,
                     double *mag) {
  double abs_sum;
  if (op == OP_AG) {
    const int rows = m / W.size, s = i / rows;
    const double d = dot(in->a[s] + (size_t)(i % rows) * k, in->b[W.rank] + (size_t)j * k, k,
                         &abs_sum);
    *mag = fabs(d) + ACC_EPS * abs_sum;
    return mg_round(dt, (float)d);
  }
  const int g = op == OP_RS ? W.rank * (m / W.size) + i : i;
  float sum = 0.0f;
  *mag = 0.0;
  for (int s = 0; s < W.size; ++s) {
    const double d = dot(in->a[s] + (size_t)g * k, in->b[s] + (size_t)j * k, k, &abs_sum);
    const float p = mg_round(dt, (float)d);
    *mag += fabs((double)p) + ACC_EPS * abs_sum;
    sum += p;
  }
  return mg_round(dt, sum);
}

/* out (host, c's shape) against the host reference; all elements, or every
 * stride-th row when the shape is large. Returns the number of bad ones. */
static size_t check_exact(const char *what, const inputs *in, int op, moelink_dtype_t dt, int m,
                          int n, int k, const void *out, int row_stride, int quiet) {
  const int rows = c_rows(op, m);
  const double tol = elem_tol(dt);
  size_t bad = 0, first = (size_t)-1, checked = 0;
  double worst = 0.0;
#pragma omp parallel for reduction(+ : bad, checked) reduction(max : worst) schedule(dynamic)
  for (int i = 0; i < rows; i += row_stride)
    for (int j = 0; j < n; ++j) {
      double mag;
      const double r = expect(in, op, dt, m, k, i, j, &mag);
      const double x = mg_get(dt, out, (size_t)i * n + j);
      const double e = fabs(x - r) / (mag > 1e-30 ? mag : 1e-30);
      ++checked;
      if (!(e <= tol)) {
        ++bad;
#pragma omp critical
        if ((size_t)i * n + j < first) first = (size_t)i * n + j;
      }
      if (e > worst || e != e) worst = e != e ? INFINITY : e;
    }
  if (bad || !quiet)
    CHECK(bad == 0, "%s: %zu of %zu elements off the fp64 reference (worst err/magnitude %.3g)",
          what, bad, checked, worst);
  if (bad) {
    const size_t i = first / (size_t)n, j = first % (size_t)n;
    double mag;
    const double r = expect(in, op, dt, m, k, (int)i, (int)j, &mag);
    ml_t_diag("  first: c[%zu][%zu] = %.9g, expected %.9g (magnitude %.3g)", i, j,
              mg_get(dt, out, first), r, mag);
  }
  return bad;
}

/* Relative L2 of x against y over count elements (NaN anywhere: infinite). */
static double rel_l2(moelink_dtype_t dt, const void *x, const void *y, size_t count) {
  double num = 0.0, den = 0.0;
#pragma omp parallel for reduction(+ : num, den) schedule(static)
  for (size_t i = 0; i < count; ++i) {
    const double a = mg_get(dt, x, i), b = mg_get(dt, y, i);
    num += (a - b) * (a - b);
    den += b * b;
  }
  const double r = den > 0 ? sqrt(num / den) : sqrt(num);
  return r == r ? r : INFINITY;
}

/* Every rank must hold bitwise the same bytes. */
static void check_ranks_agree(const char *what, const void *host, size_t bytes) {
  uint64_t h = mg_hash(host, bytes);
  uint64_t *d = (uint64_t *)mg_dev(sizeof(uint64_t) * (size_t)(W.size + 1));
  MG_CUDA(cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice));
  MG_NCCL(W.nccl, ncclAllGather(d, d + 1, 1, ncclUint64, W.nccl, W.stream));
  uint64_t *all = (uint64_t *)mg_host(sizeof(uint64_t) * (size_t)W.size);
  MG_CUDA(cudaMemcpyAsync(all, d + 1, sizeof(uint64_t) * (size_t)W.size, cudaMemcpyDeviceToHost,
                          W.stream));
  sync_stream();
  int same = 1;
  for (int s = 0; s < W.size; ++s) same &= all[s] == h;
  CHECK(same, "%s: every rank holds the same bits", what);
  free(all);
  cudaFree(d);
}

static int guard_intact(const unsigned char *p) {
  for (int i = 0; i < GUARD_BYTES; ++i)
    if (p[i] != GUARD_BYTE) return 0;
  return 1;
}

/* ---- one call, checked every way ---------------------------------------------- */

static int g_case = 1;

static void run_case(moelink_tp_t tp, int op, moelink_dtype_t dt, int m, int n, int k) {
  const int c = g_case++;
  const size_t es = moelink_dtype_size(dt);
  const size_t an = (size_t)a_rows(op, m) * k, bn = (size_t)n * k, cn = (size_t)c_rows(op, m) * n;
  const size_t sn = op == OP_AG ? (size_t)m * k : (size_t)m * n;
  char what[160];
  snprintf(what, sizeof what, "%s %s m %d n %d k %d", op_name[op], moelink_dtype_name(dt), m, n,
           k);
  void *a = mg_dev(an * es), *b = mg_dev(bn * es), *ref = mg_dev(cn * es), *scr = mg_dev(sn * es);
  unsigned char *cbuf = (unsigned char *)mg_dev(cn * es + GUARD_BYTES);
  unsigned char *c2 = (unsigned char *)mg_dev(cn * es);
  fill(dt, a, an, seed_a(W.rank, c));
  fill(dt, b, bn, seed_b(W.rank, c));
  poison(cbuf, cn * es);
  poison(c2, cn * es);
  poison(ref, cn * es);
  MG_CUDA(cudaMemsetAsync(cbuf + cn * es, GUARD_BYTE, GUARD_BYTES, W.stream));
  baseline(op, dt, a, b, ref, scr, m, n, k);
  const moelink_status_t s1 = run_op(tp, op, a, b, cbuf, m, n, k);
  const moelink_status_t s2 = run_op(tp, op, a, b, c2, m, n, k);
  CHECK(s1 == MOELINK_SUCCESS && s2 == MOELINK_SUCCESS, "%s: two calls (%s%s%s)", what,
        moelink_status_string(s1 ? s1 : s2), s1 || s2 ? ": " : "",
        s1 || s2 ? moelink_last_error() : "");
  sync_stream();
  unsigned char *h = (unsigned char *)to_host(cbuf, cn * es + GUARD_BYTES);
  void *h2 = to_host(c2, cn * es), *hr = to_host(ref, cn * es);
  inputs in;
  make_inputs(&in, op, dt, m, n, k, seed_a, seed_b, c);
  check_exact(what, &in, op, dt, m, n, k, h, 1, 0);
  char w2[200];
  snprintf(w2, sizeof w2, "%s: cuBLAS + NCCL", what);
  check_exact(w2, &in, op, dt, m, n, k, hr, 1, 1);
  const double l2 = rel_l2(dt, h, hr, cn);
  CHECK(l2 <= mg_tol(dt), "%s: rel L2 vs cuBLAS + NCCL %.3g", what, l2);
  CHECK(guard_intact(h + cn * es), "%s: nothing written past c", what);
  CHECK(memcmp(h, h2, cn * es) == 0, "%s: a second call gives the same bits", what);
  if (op == OP_AR) check_ranks_agree(what, h, cn * es);
  free_inputs(&in);
  free(h);
  free(h2);
  free(hr);
  void *bufs[] = {a, b, ref, scr, cbuf, c2};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) cudaFree(bufs[i]);
}

static moelink_tp_t make_tp(moelink_dtype_t dt, int max_m, int max_n, int max_k) {
  moelink_tp_config_t cfg = MOELINK_TP_CONFIG_INIT;
  cfg.dtype = dt;
  cfg.max_m = max_m;
  cfg.max_n = max_n;
  cfg.max_k = max_k;
  size_t ws = 0;
  CHECK_OK(moelink_tp_workspace_size(W.comm, &cfg, &ws), "moelink_tp_workspace_size");
  moelink_tp_t tp = NULL;
  MG_MUST(moelink_tp_create(W.comm, &cfg, &tp), "moelink_tp_create");
  ml_t_diag("tp %s max m %d n %d k %d: %zu bytes of workspace per rank", moelink_dtype_name(dt),
            max_m, max_n, max_k, ws);
  return tp;
}

/* ---- 200 back-to-back calls ---------------------------------------------------- */

typedef struct stress_call {
  int op, dti, m, n, k;
  size_t out_off, out_bytes;
} stress_call;

static uint64_t stress_seed_a(int r, int d) { return mg_seed(r, 9000 + d); }
static uint64_t stress_seed_b(int r, int d) { return mg_seed(r, 9100 + d); }

/* decode 1: gemm_ar only, up to 20 rows, n and k mostly multiples of 64
 * (the fused kernel) and otherwise the GEMM + low-latency exchange: the two
 * share the tp's cells and call count, in any order. decode 2: gemm_ar of 1
 * to 128 rows, n and k mostly multiples of 128 (the wgmma kernel from 65
 * rows, the fused one up to 16), the rest through the GEMM + exchange. */
static void run_stress(moelink_tp_t tp[2], int decode) {
  static const moelink_dtype_t dts[2] = {MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  const int calls = decode ? 120 : 200;
  const char *tag = tag;
  const int max_f = decode == 2 ? 128 : decode ? 20 : 48;
  const int max_nk = decode == 2 ? 768 : decode ? 512 : 160, unit = decode == 2 ? 128 : 64;
  const size_t a_elems = (size_t)W.size * max_f * max_nk, b_elems = (size_t)max_nk * max_nk;
  void *a[2], *b[2];
  for (int d = 0; d < 2; ++d) {
    a[d] = mg_dev(a_elems * 2);
    b[d] = mg_dev(b_elems * 2);
    fill(dts[d], a[d], a_elems, stress_seed_a(W.rank, d));
    fill(dts[d], b[d], b_elems, stress_seed_b(W.rank, d));
  }
  stress_call *cs = (stress_call *)mg_host(sizeof *cs * (size_t)calls);
  uint64_t st = decode == 2 ? 28 : decode ? 18 : 8; /* the same on every rank: they must issue the same calls */
  size_t total = 0;
  for (int i = 0; i < calls; ++i) {
    stress_call *q = &cs[i];
    q->op = (int)(mg_next(&st) % 3);
    q->dti = (int)(mg_next(&st) % 2);
    q->m = q->op == OP_AR ? 1 + (int)(mg_next(&st) % (uint64_t)(W.size * max_f))
                          : W.size * (1 + (int)(mg_next(&st) % (uint64_t)max_f));
    q->n = 1 + (int)(mg_next(&st) % (uint64_t)max_nk);
    q->k = 1 + (int)(mg_next(&st) % (uint64_t)max_nk);
    if (decode) {
      q->op = OP_AR;
      q->m = 1 + (int)(mg_next(&st) % (uint64_t)max_f);
      if (mg_next(&st) % 4 != 0) {
        q->n = unit * (1 + (int)(mg_next(&st) % (uint64_t)(max_nk / unit)));
        q->k = unit * (1 + (int)(mg_next(&st) % (uint64_t)(max_nk / unit)));
      }
    }
    q->out_bytes = (size_t)c_rows(q->op, q->m) * q->n * 2;
    q->out_off = total;
    total += (q->out_bytes + 255) / 256 * 256;
  }
  char *out = (char *)mg_dev(total);
  poison(out, total);
  sync_stream();
  const double t0 = mg_now();
  int enq_fail = 0;
  for (int i = 0; i < calls; ++i) {
    const stress_call *q = &cs[i];
    moelink_status_t s = run_op(tp[q->dti], q->op, a[q->dti], b[q->dti], out + q->out_off, q->m,
                                q->n, q->k);
    if (s != MOELINK_SUCCESS && !enq_fail++)
      CHECK(0, "stress call %d (%s m %d n %d k %d): %s: %s", i, op_name[q->op], q->m, q->n, q->k,
            moelink_status_string(s), moelink_last_error());
  }
  sync_stream();
  CHECK(enq_fail == 0, "stress%s: %d calls enqueued back to back (%.3f s)", tag,
        calls, mg_now() - t0);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "stress: moelink_comm_check");
  char *h = (char *)to_host(out, total);
  /* One input set per dtype (the a and b of a call are prefixes of the
   * arenas, so element (row, q) sits at row * k + q whatever k is). */
  int failed = 0;
  for (int i = 0; i < calls; ++i) {
    const stress_call *q = &cs[i];
    inputs in;
    make_inputs(&in, q->op, dts[q->dti], q->m, q->n, q->k, stress_seed_a, stress_seed_b, q->dti);
    char what[160];
    snprintf(what, sizeof what, "stress%s call %d: %s %s m %d n %d k %d",
             tag, i, op_name[q->op],
             moelink_dtype_name(dts[q->dti]), q->m, q->n, q->k);
    if (check_exact(what, &in, q->op, dts[q->dti], q->m, q->n, q->k, h + q->out_off, 1, 1))
      ++failed;
    free_inputs(&in);
    if (failed > 4) break;
  }
  CHECK(failed == 0, "stress%s: every one of %d calls matches the fp64 reference",
        tag, calls);
  free(h);
  free(cs);
  cudaFree(out);
  for (int d = 0; d < 2; ++d) {
    cudaFree(a[d]);
    cudaFree(b[d]);
  }
}

/* ---- CUDA graphs ----------------------------------------------------------------- */

/* One call of op captured, then replayed three times with new inputs written
 * into the same buffers (outside the graph), an eager call after each. */
static void run_graph(moelink_tp_t tp, int op, int m, int n, int k) {
  const moelink_dtype_t dt = MOELINK_DTYPE_BF16;
  const size_t an = (size_t)a_rows(op, m) * k, bn = (size_t)n * k, cn = (size_t)c_rows(op, m) * n;
  void *a = mg_dev(an * 2), *b = mg_dev(bn * 2), *c = mg_dev(cn * 2), *e = mg_dev(cn * 2);
  fill(dt, a, an, seed_a(W.rank, g_case));
  fill(dt, b, bn, seed_b(W.rank, g_case));
  sync_stream();
  cudaGraph_t g = NULL;
  cudaGraphExec_t ge = NULL;
  MG_CUDA(cudaStreamBeginCapture(W.stream, cudaStreamCaptureModeGlobal));
  const moelink_status_t s = run_op(tp, op, a, b, c, m, n, k);
  const cudaError_t ce = cudaStreamEndCapture(W.stream, &g);
  CHECK(s == MOELINK_SUCCESS && ce == cudaSuccess, "graph: %s m %d n %d k %d captured (%s%s%s, %s)",
        op_name[op], m, n, k, moelink_status_string(s), s ? ": " : "", s ? moelink_last_error() : "",
        cudaGetErrorString(ce));
  if (s != MOELINK_SUCCESS || ce != cudaSuccess) mg_bail("capture failed");
  MG_CUDA(cudaGraphInstantiate(&ge, g, 0));
  for (int rep = 0; rep < 3; ++rep) {
    const int cid = g_case++;
    fill(dt, a, an, seed_a(W.rank, cid));
    fill(dt, b, bn, seed_b(W.rank, cid));
    poison(c, cn * 2);
    poison(e, cn * 2);
    MG_CUDA(cudaGraphLaunch(ge, W.stream));
    CHECK_OK(run_op(tp, op, a, b, e, m, n, k), "graph: eager call after the replay");
    sync_stream();
    void *hc = to_host(c, cn * 2), *he = to_host(e, cn * 2);
    inputs in;
    make_inputs(&in, op, dt, m, n, k, seed_a, seed_b, cid);
    char what[160];
    snprintf(what, sizeof what, "graph replay %d of %s (new inputs)", rep, op_name[op]);
    check_exact(what, &in, op, dt, m, n, k, hc, 1, 0);
    CHECK(memcmp(hc, he, cn * 2) == 0, "%s: the eager call gives the same bits", what);
    free_inputs(&in);
    free(hc);
    free(he);
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaFree(e);
}

/* ---- M = N = K = 8192 ---------------------------------------------------------------- */

static void run_large(moelink_tp_t tp, int op) {
  const moelink_dtype_t dt = MOELINK_DTYPE_BF16;
  const int m = 8192, n = 8192, k = 8192, cid = g_case++;
  const size_t an = (size_t)a_rows(op, m) * k, bn = (size_t)n * k, cn = (size_t)c_rows(op, m) * n;
  const size_t sn = op == OP_AG ? (size_t)m * k : (size_t)m * n;
  void *a = mg_dev(an * 2), *b = mg_dev(bn * 2), *c = mg_dev(cn * 2), *ref = mg_dev(cn * 2);
  void *scr = mg_dev(sn * 2);
  fill(dt, a, an, seed_a(W.rank, cid));
  fill(dt, b, bn, seed_b(W.rank, cid));
  poison(c, cn * 2);
  poison(ref, cn * 2);
  baseline(op, dt, a, b, ref, scr, m, n, k);
  char what[120];
  snprintf(what, sizeof what, "%s bf16 m %d n %d k %d", op_name[op], m, n, k);
  CHECK_OK(run_op(tp, op, a, b, c, m, n, k), what);
  sync_stream();
  void *h = to_host(c, cn * 2), *hr = to_host(ref, cn * 2);
  const double l2 = rel_l2(dt, h, hr, cn);
  CHECK(l2 <= 1e-2, "%s: rel L2 vs cuBLAS + NCCL %.3g (all %zu elements)", what, l2, cn);
  /* A few rows against the fp64 reference too (k = 8192 per element). */
  inputs in;
  make_inputs(&in, op, dt, m, n, k, seed_a, seed_b, cid);
  check_exact(what, &in, op, dt, m, n, k, h, c_rows(op, m) / 7, 0);
  if (op == OP_AR) check_ranks_agree(what, h, cn * 2);
  free_inputs(&in);
  free(h);
  free(hr);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaFree(ref);
  cudaFree(scr);
}

/* ---- argument errors ------------------------------------------------------------------ */

static void run_errors(moelink_tp_t tp) {
  moelink_tp_config_t cfg = MOELINK_TP_CONFIG_INIT;
  moelink_tp_t bad = NULL;
  cfg.max_m = 0;
  cfg.max_n = cfg.max_k = 8;
  CHECK_STATUS(moelink_tp_create(W.comm, &cfg, &bad), MOELINK_ERR_INVALID_ARGUMENT,
               "tp_create with max_m 0");
  cfg.max_m = 8;
  cfg.dtype = MOELINK_DTYPE_F32;
  CHECK_STATUS(moelink_tp_create(W.comm, &cfg, &bad), MOELINK_ERR_UNSUPPORTED,
               "tp_create with f32 on cuda");
  CHECK(bad == NULL, "failed creates leave *out NULL");
  const int m = 2 * W.size, n = 7, k = 9;
  void *a = mg_dev((size_t)m * k * 2), *b = mg_dev((size_t)n * k * 2);
  char *c = (char *)mg_dev((size_t)m * n * 2);
  poison(c, (size_t)m * n * 2);
  sync_stream();
  CHECK_STATUS(moelink_ag_gemm(tp, a, b, c, W.size + 1, n, k, W.stream),
               MOELINK_ERR_INVALID_ARGUMENT, "ag_gemm with m not a multiple of the ranks");
  CHECK_STATUS(moelink_gemm_rs(tp, a, b, c, 1 << 30, n, k, W.stream),
               MOELINK_ERR_INVALID_ARGUMENT, "gemm_rs with m above max_m");
  CHECK_STATUS(moelink_gemm_ar(tp, a, b, (char *)a + 2, m, n, k, W.stream),
               MOELINK_ERR_INVALID_ARGUMENT, "gemm_ar with c overlapping a");
  CHECK_STATUS(moelink_gemm_ar(tp, a, b, NULL, m, n, k, W.stream), MOELINK_ERR_INVALID_ARGUMENT,
               "gemm_ar with c NULL");
  CHECK_STATUS(moelink_gemm_ar(NULL, a, b, c, m, n, k, W.stream), MOELINK_ERR_INVALID_ARGUMENT,
               "gemm_ar with tp NULL");
  CHECK_STATUS(moelink_gemm_rs(tp, a, b, c, m, 0, k, W.stream), MOELINK_ERR_INVALID_ARGUMENT,
               "gemm_rs with n 0");
  for (int op = 0; op < 3; ++op)
    CHECK_OK(run_op(tp, op, a, b, c, 0, n, k), "m = 0 is a no-op");
  sync_stream();
  unsigned char *h = (unsigned char *)to_host(c, (size_t)m * n * 2);
  size_t touched = 0;
  for (size_t i = 0; i < (size_t)m * n * 2; ++i) touched += h[i] != 0xff;
  CHECK(touched == 0, "m = 0 and the failed calls wrote nothing (%zu bytes changed)", touched);
  CHECK_OK(moelink_tp_destroy(NULL), "tp_destroy(NULL)");
  free(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
}

int main(void) {
  mg_init(&W);
  if (cublasCreate(&g_blas) != CUBLAS_STATUS_SUCCESS) mg_bail("cublasCreate failed");
  if (cublasSetStream(g_blas, W.stream) != CUBLAS_STATUS_SUCCESS) mg_bail("cublasSetStream failed");
  const double t0 = mg_now();
  static const moelink_dtype_t dts[2] = {MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  /* (odd factor of m, n, k): m = nranks * factor for every op; gemm_ar also
   * gets odd m itself. */
  static const int shapes[][3] = {{1, 1, 1},      {1, 7, 129},     {7, 1000, 7},
                                  {129, 129, 1000}, {7, 1, 1000},  {129, 1000, 1},
                                  {1, 1000, 129}, {65, 129, 7}};
  static const int ar_odd[][3] = {{1, 129, 1000}, {7, 1000, 1}, {129, 7, 129}, {1000, 1, 7}};
  const int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
  moelink_tp_t small[2];
  for (int d = 0; d < 2; ++d) small[d] = make_tp(dts[d], W.size * 1000, 1000, 1000);
  run_errors(small[0]);
  for (int d = 0; d < 2; ++d)
    for (int op = 0; op < 3; ++op) {
      for (int i = 0; i < nshapes; ++i)
        run_case(small[d], op, dts[d], W.size * shapes[i][0], shapes[i][1], shapes[i][2]);
      if (op == OP_AR)
        for (size_t i = 0; i < sizeof ar_odd / sizeof ar_odd[0]; ++i)
          run_case(small[d], op, dts[d], ar_odd[i][0], ar_odd[i][1], ar_odd[i][2]);
    }
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "odd shapes: moelink_comm_check");
  ml_t_diag("odd shapes done in %.1f s", mg_now() - t0);
  run_stress(small, 0);
  ml_t_diag("stress done in %.1f s", mg_now() - t0);
  for (int op = 0; op < 3; ++op) run_graph(small[0], op, W.size * 65, 385, 257);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "graphs: moelink_comm_check");
  ml_t_diag("graphs done in %.1f s", mg_now() - t0);
  for (int d = 0; d < 2; ++d) CHECK_OK(moelink_tp_destroy(small[d]), "moelink_tp_destroy");

  /* Decode sizes of gemm_ar: up to 16 rows with n and k multiples of 64 take
   * the fused kernel, the rest the GEMM + low-latency exchange. */
  static const int dec[][3] = {{1, 8192, 4096}, {16, 8192, 4096}, {5, 192, 1088}, {16, 64, 64},
                               {9, 1024, 320},  {8, 576, 128},    {17, 1024, 320}, {3, 1000, 64}};
  moelink_tp_t dtp[2];
  for (int d = 0; d < 2; ++d) {
    dtp[d] = make_tp(dts[d], 32, 8192, 4096);
    for (size_t i = 0; i < sizeof dec / sizeof dec[0]; ++i)
      run_case(dtp[d], OP_AR, dts[d], dec[i][0], dec[i][1], dec[i][2]);
  }
  run_stress(dtp, 1);
  run_graph(dtp[0], OP_AR, 16, 1024, 512);
  run_graph(dtp[0], OP_AR, 1, 8192, 4096);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "decode sizes: moelink_comm_check");
  for (int d = 0; d < 2; ++d) CHECK_OK(moelink_tp_destroy(dtp[d]), "moelink_tp_destroy (decode)");
  ml_t_diag("decode sizes done in %.1f s", mg_now() - t0);

  /* 17 to 128 rows: from 65 rows with n and k multiples of 128 the wgmma
   * kernel, the rest the GEMM + exchange. */
  static const int wide[][3] = {{128, 2048, 4096}, {17, 1024, 256}, {100, 384, 1152},
                                {64, 128, 128},    {33, 8192, 128}, {128, 1000, 512},
                                {127, 640, 200},   {16, 256, 256}};
  moelink_tp_t wtp[2];
  for (int d = 0; d < 2; ++d) {
    wtp[d] = make_tp(dts[d], 128, 8192, 4096);
    for (size_t i = 0; i < sizeof wide / sizeof wide[0]; ++i)
      run_case(wtp[d], OP_AR, dts[d], wide[i][0], wide[i][1], wide[i][2]);
  }
  run_case(wtp[0], OP_AR, dts[0], 128, 8192, 4096);
  run_stress(wtp, 2);
  run_graph(wtp[0], OP_AR, 128, 1024, 512);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "up to 128 rows: moelink_comm_check");
  for (int d = 0; d < 2; ++d) CHECK_OK(moelink_tp_destroy(wtp[d]), "moelink_tp_destroy (wide)");
  ml_t_diag("up to 128 rows done in %.1f s", mg_now() - t0);
  moelink_tp_t large = make_tp(MOELINK_DTYPE_BF16, 8192, 8192, 8192);
  for (int op = 0; op < 3; ++op) run_large(large, op);
  CHECK_OK(moelink_tp_destroy(large), "moelink_tp_destroy (large)");
  ml_t_diag("all done in %.1f s", mg_now() - t0);
  cublasDestroy(g_blas);
  mg_fini(&W);
  return ml_test_done();
}
