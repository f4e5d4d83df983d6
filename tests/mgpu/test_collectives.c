/* Collectives of the CUDA communicator against NCCL's own and against the
 * inputs regenerated on the host: all-reduce (low-latency, one-shot, two-shot, in place),
 * all-gather, reduce-scatter; f32, bf16, f16; 1 element to 256 MiB with odd
 * sizes; 200 back-to-back calls of random ops, sizes, offsets and
 * algorithms; an all-reduce captured in a CUDA graph and replayed between
 * eager calls; the copy-engine all-gather (the same sizes, and in a graph);
 * a communicator wrapped around the NCCL one.
 *
 *   moelink launch -n 2 -- mgpu_test_collectives
 * (latency and bandwidth beside NCCL: moelink launch -n 2 -- moelink bench comm,
 * the algorithms chosen with MOELINK_COMM_LL_MAX_BYTES and
 * MOELINK_COMM_ONESHOT_MAX_BYTES) */
#include "mgpu.h"

static mg_world W;

static ncclDataType_t nccl_type(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_F32 ? ncclFloat32 : dt == MOELINK_DTYPE_BF16 ? ncclBfloat16
                                                                          : ncclFloat16;
}

static void *to_host(const void *dev, size_t bytes) {
  void *h = mg_host(bytes);
  MG_CUDA(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
  return h;
}

static void fill(moelink_dtype_t dt, void *p, size_t n, uint64_t seed) {
  MG_MUST(moelink_fill_random(W.ctx, dt, p, n, seed, 1.0f, 0.0f, W.stream), "moelink_fill_random");
}

/* Unwritten outputs show up as NaN (0xff.. is NaN in all three dtypes). */
static void poison(void *p, size_t bytes) { MG_CUDA(cudaMemsetAsync(p, 0xff, bytes, W.stream)); }

static void sync_stream(void) { MG_CUDA(cudaStreamSynchronize(W.stream)); }

/* A reduction result against NCCL's and against the exact sum of the
 * inputs: element i sums, over ranks s, input(seed(s, c), off + i). The
 * tolerance is relative to the sum of magnitudes (no cancellation trap). */
static int check_sum_q(const char *what, moelink_dtype_t dt, const void *ours, const void *nccl,
                       size_t count, int c, size_t off, int quiet) {
  const double tol = mg_tol(dt);
  const int n = W.size;
  size_t bad = 0, first = (size_t)-1;
  double worst = 0.0;
#pragma omp parallel for reduction(+ : bad) reduction(max : worst) schedule(static)
  for (size_t i = 0; i < count; ++i) {
    double ref = 0.0, mag = 0.0;
    for (int s = 0; s < n; ++s) {
      const float x = mg_input(dt, mg_seed(s, c), off + i);
      ref += x;
      mag += fabs(x);
    }
    const double o = mg_get(dt, ours, i), r = mg_get(dt, nccl, i);
    const double lim = tol * mag + 1e-30;
    const double e = fabs(o - ref);
    if (!(e <= lim) || !(fabs(o - r) <= lim)) {
      ++bad;
#pragma omp critical
      if (i < first) first = i;
    }
    if (mag > 0 && e / mag > worst) worst = e / mag;
  }
  if (bad || !quiet)
    CHECK(bad == 0, "%s: %zu of %zu elements off (worst error / sum of |inputs| %.3g)", what,
          bad, count, worst);
  if (bad) {
    for (size_t i = first, shown = 0; i < count && shown < 4; ++i) {
      double ref = 0.0, mag = 0.0;
      for (int s = 0; s < n; ++s) {
        const float x = mg_input(dt, mg_seed(s, c), off + i);
        ref += x;
        mag += fabs(x);
      }
      const double o = mg_get(dt, ours, i), r = mg_get(dt, nccl, i);
      if (fabs(o - ref) <= tol * mag + 1e-30 && fabs(o - r) <= tol * mag + 1e-30) continue;
      ml_t_diag("  [%zu] moelink %.9g nccl %.9g exact %.9g (sum |x| %.3g)", i, o, r, ref, mag);
      ++shown;
    }
  }
  return bad == 0;
}

static int check_sum(const char *what, moelink_dtype_t dt, const void *ours, const void *nccl,
                     size_t count, int c, size_t off) {
  return check_sum_q(what, dt, ours, nccl, count, c, off, 0);
}

/* Bitwise equality of two host buffers; names the first difference. */
static int check_same(const char *what, moelink_dtype_t dt, const void *a, const void *b,
                      size_t count) {
  const size_t es = moelink_dtype_size(dt);
  if (memcmp(a, b, count * es) == 0) {
    CHECK(1, "%s", what);
    return 1;
  }
  size_t i = 0;
  while (memcmp((const char *)a + i * es, (const char *)b + i * es, es) == 0) ++i;
  CHECK(0, "%s: first difference at element %zu of %zu (%.9g vs %.9g)", what, i, count,
        mg_get(dt, a, i), mg_get(dt, b, i));
  return 0;
}

/* Every rank must hold bitwise the same all-reduce result. */
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

/* ---- one call of each op ---------------------------------------------------- */

static int g_case = 1;

static void run_allreduce(moelink_dtype_t dt, size_t count) {
  const int c = g_case++;
  const size_t bytes = count * moelink_dtype_size(dt);
  char what[160];
  void *send = mg_dev(bytes), *ours = mg_dev(bytes), *ref = mg_dev(bytes), *alt = mg_dev(bytes);
  fill(dt, send, count, mg_seed(W.rank, c));
  poison(ref, bytes);
  poison(ours, bytes);
  MG_NCCL(W.nccl, ncclAllReduce(send, ref, count, nccl_type(dt), ncclSum, W.nccl, W.stream));
  snprintf(what, sizeof what, "allreduce %s count %zu", moelink_dtype_name(dt), count);
  CHECK_OK(moelink_allreduce(W.comm, send, ours, count, dt, W.stream), what);
  sync_stream();
  void *h_ours = to_host(ours, bytes), *h_ref = to_host(ref, bytes);
  check_sum(what, dt, h_ours, h_ref, count, c, 0);
  check_ranks_agree(what, h_ours, bytes);

  /* One-shot, two-shot, low-latency and in place add in the same order:
   * same bits (low-latency only runs up to its size limit; above it the
   * forced mode falls back to the size rule, the same bits again). */
  static const char *const algo[] = {"", "one-shot", "two-shot", "low-latency"};
  for (int a = 1; a <= 3; ++a) {
    MG_MUST(ml_comm_cuda_force_allreduce(W.comm, a), "force all-reduce algorithm");
    poison(alt, bytes);
    CHECK_OK(moelink_allreduce(W.comm, send, alt, count, dt, W.stream), algo[a]);
    sync_stream();
    void *h_alt = to_host(alt, bytes);
    snprintf(what, sizeof what, "allreduce %s count %zu %s: same bits as the default",
             moelink_dtype_name(dt), count, algo[a]);
    check_same(what, dt, h_alt, h_ours, count);
    free(h_alt);
  }
  MG_MUST(ml_comm_cuda_force_allreduce(W.comm, 0), "default all-reduce algorithm");
  MG_CUDA(cudaMemcpyAsync(alt, send, bytes, cudaMemcpyDeviceToDevice, W.stream));
  CHECK_OK(moelink_allreduce(W.comm, alt, alt, count, dt, W.stream), "allreduce in place");
  sync_stream();
  void *h_alt = to_host(alt, bytes);
  snprintf(what, sizeof what, "allreduce %s count %zu in place: same bits",
           moelink_dtype_name(dt), count);
  check_same(what, dt, h_alt, h_ours, count);
  free(h_alt);
  free(h_ours);
  free(h_ref);
  cudaFree(send);
  cudaFree(ours);
  cudaFree(ref);
  cudaFree(alt);
}

/* " (copy engines)" while the CE all-gather is selected: names the checks. */
static const char *g_ag_engine = "";

static void run_allgather(moelink_dtype_t dt, size_t count) {
  const int c = g_case++;
  const int n = W.size;
  const size_t es = moelink_dtype_size(dt), bytes = count * es;
  char what[160];
  void *send = mg_dev(bytes), *ours = mg_dev(bytes * n), *ref = mg_dev(bytes * n);
  fill(dt, send, count, mg_seed(W.rank, c));
  poison(ours, bytes * n);
  poison(ref, bytes * n);
  MG_NCCL(W.nccl, ncclAllGather(send, ref, count, nccl_type(dt), W.nccl, W.stream));
  snprintf(what, sizeof what, "allgather%s %s count %zu per rank", g_ag_engine,
           moelink_dtype_name(dt), count);
  CHECK_OK(moelink_allgather(W.comm, send, ours, count, dt, W.stream), what);
  sync_stream();
  char *h_ours = (char *)to_host(ours, bytes * n), *h_ref = (char *)to_host(ref, bytes * n);
  char what2[200];
  snprintf(what2, sizeof what2, "%s: bitwise NCCL's", what);
  check_same(what2, dt, h_ours, h_ref, count * n);
  size_t bad = 0;
  for (int s = 0; s < n; ++s)
#pragma omp parallel for reduction(+ : bad)
    for (size_t i = 0; i < count; ++i)
      bad += mg_get(dt, h_ours + (size_t)s * bytes, i) != mg_input(dt, mg_seed(s, c), i);
  CHECK(bad == 0, "%s: every rank's block is its input (%zu wrong)", what, bad);
  free(h_ours);
  free(h_ref);
  cudaFree(send);
  cudaFree(ours);
  cudaFree(ref);
}

static void run_reduce_scatter(moelink_dtype_t dt, size_t count) {
  const int c = g_case++;
  const int n = W.size;
  const size_t es = moelink_dtype_size(dt), bytes = count * es;
  char what[160];
  void *send = mg_dev(bytes * n), *ours = mg_dev(bytes), *ref = mg_dev(bytes), *alt = mg_dev(bytes);
  fill(dt, send, count * n, mg_seed(W.rank, c));
  poison(ours, bytes);
  poison(ref, bytes);
  poison(alt, bytes);
  MG_NCCL(W.nccl,
          ncclReduceScatter(send, ref, count, nccl_type(dt), ncclSum, W.nccl, W.stream));
  snprintf(what, sizeof what, "reduce_scatter %s count %zu per rank", moelink_dtype_name(dt),
           count);
  CHECK_OK(moelink_reduce_scatter(W.comm, send, ours, count, dt, W.stream), what);
  CHECK_OK(moelink_reduce_scatter(W.comm, send, alt, count, dt, W.stream), "reduce_scatter again");
  sync_stream();
  void *h_ours = to_host(ours, bytes), *h_ref = to_host(ref, bytes), *h_alt = to_host(alt, bytes);
  check_sum(what, dt, h_ours, h_ref, count, c, (size_t)W.rank * count);
  char what2[200];
  snprintf(what2, sizeof what2, "%s: run twice, same bits", what);
  check_same(what2, dt, h_alt, h_ours, count);
  free(h_ours);
  free(h_ref);
  free(h_alt);
  cudaFree(send);
  cudaFree(ours);
  cudaFree(ref);
  cudaFree(alt);
}

/* ---- 200 back-to-back calls ------------------------------------------------- */

enum { OP_AR = 0, OP_AG = 1, OP_RS = 2 };

typedef struct stress_call {
  int op, algo, inplace, ctas;
  moelink_dtype_t dt;
  size_t count, off, out_off, out_bytes;
} stress_call;

static void run_stress(void) {
  const int calls = 200, n = W.size;
  const size_t arena = (size_t)1 << 22;
  static const moelink_dtype_t dts[3] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  void *in[3];
  for (int d = 0; d < 3; ++d) {
    in[d] = mg_dev(arena * 4);
    fill(dts[d], in[d], arena, mg_seed(W.rank, 900 + d));
  }
  stress_call *cs = (stress_call *)mg_host(sizeof *cs * (size_t)calls);
  uint64_t st = 20251130; /* the same on every rank: they must issue the same calls */
  size_t total = 0;
  for (int i = 0; i < calls; ++i) {
    stress_call *k = &cs[i];
    k->op = (int)(mg_next(&st) % 3);
    k->dt = dts[mg_next(&st) % 3];
    const int e = (int)(mg_next(&st) % 18);
    k->count = 1 + (size_t)(mg_next(&st) % ((uint64_t)1 << e));
    if (k->count > 150000) k->count = 150000;
    const size_t need = k->op == OP_RS ? k->count * n : k->count;
    k->off = (size_t)(mg_next(&st) % (arena - need + 1));
    if (mg_next(&st) % 2) k->off &= ~(size_t)7; /* half of them 16-byte aligned */
    k->algo = (int)(mg_next(&st) % 4);
    k->inplace = k->op == OP_AR && mg_next(&st) % 4 == 0;
    /* Grids of every width: a CTA index keeps its epochs and slots across them. */
    static const int ctas[] = {1, 3, 17, 64, 64, 128};
    k->ctas = ctas[mg_next(&st) % 6];
    const size_t es = moelink_dtype_size(k->dt);
    k->out_bytes = (k->op == OP_AG ? k->count * n : k->count) * es;
    k->out_off = total;
    total += (k->out_bytes + 255) / 256 * 256;
  }
  char *ours = (char *)mg_dev(total), *ref = (char *)mg_dev(total);
  poison(ours, total);
  poison(ref, total);
  sync_stream();
  const double t0 = mg_now();
  int enq_fail = 0;
  for (int i = 0; i < calls; ++i) {
    stress_call *k = &cs[i];
    const size_t es = moelink_dtype_size(k->dt);
    const char *src = (const char *)in[k->dt == MOELINK_DTYPE_F32 ? 0 : k->dt == MOELINK_DTYPE_BF16 ? 1 : 2] + k->off * es;
    char *dst = ours + k->out_off;
    moelink_status_t s;
    MG_MUST(ml_comm_cuda_set_ctas(W.comm, k->ctas), "set ctas");
    if (k->op == OP_AR) {
      MG_MUST(ml_comm_cuda_force_allreduce(W.comm, k->algo), "force all-reduce algorithm");
      if (k->inplace) {
        MG_CUDA(cudaMemcpyAsync(dst, src, k->count * es, cudaMemcpyDeviceToDevice, W.stream));
        s = moelink_allreduce(W.comm, dst, dst, k->count, k->dt, W.stream);
      } else {
        s = moelink_allreduce(W.comm, src, dst, k->count, k->dt, W.stream);
      }
    } else if (k->op == OP_AG) {
      s = moelink_allgather(W.comm, src, dst, k->count, k->dt, W.stream);
    } else {
      s = moelink_reduce_scatter(W.comm, src, dst, k->count, k->dt, W.stream);
    }
    if (s != MOELINK_SUCCESS && !enq_fail++)
      CHECK(0, "stress call %d: %s: %s", i, moelink_status_string(s), moelink_last_error());
  }
  MG_MUST(ml_comm_cuda_force_allreduce(W.comm, 0), "default all-reduce algorithm");
  MG_MUST(ml_comm_cuda_set_ctas(W.comm, ML_CCU_DEFAULT_CTAS), "default ctas");
  sync_stream();
  const double t_ours = mg_now() - t0;
  CHECK(enq_fail == 0, "stress: %d calls enqueued back to back (%.3f s)", calls, t_ours);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "stress: moelink_comm_check");
  for (int i = 0; i < calls; ++i) {
    stress_call *k = &cs[i];
    const size_t es = moelink_dtype_size(k->dt);
    const char *src = (const char *)in[k->dt == MOELINK_DTYPE_F32 ? 0 : k->dt == MOELINK_DTYPE_BF16 ? 1 : 2] + k->off * es;
    char *dst = ref + k->out_off;
    const ncclDataType_t t = nccl_type(k->dt);
    if (k->op == OP_AR)
      MG_NCCL(W.nccl, ncclAllReduce(src, dst, k->count, t, ncclSum, W.nccl, W.stream));
    else if (k->op == OP_AG)
      MG_NCCL(W.nccl, ncclAllGather(src, dst, k->count, t, W.nccl, W.stream));
    else
      MG_NCCL(W.nccl, ncclReduceScatter(src, dst, k->count, t, ncclSum, W.nccl, W.stream));
  }
  sync_stream();
  char *h_ours = (char *)to_host(ours, total), *h_ref = (char *)to_host(ref, total);
  int failed = 0;
  for (int i = 0; i < calls; ++i) {
    stress_call *k = &cs[i];
    const int d = k->dt == MOELINK_DTYPE_F32 ? 0 : k->dt == MOELINK_DTYPE_BF16 ? 1 : 2;
    char what[200];
    snprintf(what, sizeof what, "stress call %d: %s %s count %zu offset %zu, %d ctas%s%s", i,
             k->op == OP_AR ? "allreduce" : k->op == OP_AG ? "allgather" : "reduce_scatter",
             moelink_dtype_name(k->dt), k->count, k->off, k->ctas,
             k->op == OP_AR ? (k->algo == 1 ? " one-shot" : k->algo == 2 ? " two-shot" : k->algo == 3 ? " low-latency" : " auto")
                            : "",
             k->inplace ? " in place" : "");
    const char *o = h_ours + k->out_off, *r = h_ref + k->out_off;
    int ok;
    if (k->op == OP_AG) {
      ok = memcmp(o, r, k->out_bytes) == 0;
      if (!ok) CHECK(0, "%s: differs from NCCL's", what);
    } else {
      /* Quiet unless it fails: 200 lines of ok would drown the log. */
      ok = check_sum_q(what, k->dt, o, r, k->count, 900 + d,
                       k->off + (k->op == OP_RS ? (size_t)W.rank * k->count : 0), 1);
    }
    failed += !ok;
  }
  CHECK(failed == 0, "stress: %d of %d calls match NCCL", calls - failed, calls);
  free(h_ours);
  free(h_ref);
  free(cs);
  cudaFree(ours);
  cudaFree(ref);
  for (int d = 0; d < 3; ++d) cudaFree(in[d]);
}

/* ---- CUDA graph ------------------------------------------------------------- */

static void run_graph(void) {
  const size_t c1 = 1048579, c2 = 999, c3 = 70001; /* two-shot bf16, one-shot f32, f16 */
  void *s1 = mg_dev(c1 * 2), *o1 = mg_dev(c1 * 2), *r1 = mg_dev(c1 * 2);
  void *s2 = mg_dev(c2 * 4), *o2 = mg_dev(c2 * 4), *r2 = mg_dev(c2 * 4);
  void *ag_s = mg_dev(c3 * 2), *ag_o = mg_dev(c3 * 2 * W.size);
  fill(MOELINK_DTYPE_F16, ag_s, c3, 77);
  sync_stream();
  cudaGraph_t g = NULL;
  cudaGraphExec_t ge = NULL;
  MG_CUDA(cudaStreamBeginCapture(W.stream, cudaStreamCaptureModeGlobal));
  moelink_status_t a = moelink_allreduce(W.comm, s1, o1, c1, MOELINK_DTYPE_BF16, W.stream);
  moelink_status_t b = moelink_allreduce(W.comm, s2, o2, c2, MOELINK_DTYPE_F32, W.stream);
  cudaError_t e = cudaStreamEndCapture(W.stream, &g);
  CHECK(a == MOELINK_SUCCESS && b == MOELINK_SUCCESS && e == cudaSuccess,
        "graph: two all-reduces captured (%s, %s, %s)", moelink_status_string(a),
        moelink_status_string(b), cudaGetErrorString(e));
  if (e != cudaSuccess || a || b) mg_bail("capture failed");
  MG_CUDA(cudaGraphInstantiate(&ge, g, 0));
  for (int k = 0; k < 5; ++k) {
    const int ca = 700 + k, cb = 800 + k;
    fill(MOELINK_DTYPE_BF16, s1, c1, mg_seed(W.rank, ca));
    fill(MOELINK_DTYPE_F32, s2, c2, mg_seed(W.rank, cb));
    poison(o1, c1 * 2);
    poison(o2, c2 * 4);
    MG_CUDA(cudaGraphLaunch(ge, W.stream));
    /* Eager calls between replays continue the same epochs. */
    CHECK_OK(moelink_allgather(W.comm, ag_s, ag_o, c3, MOELINK_DTYPE_F16, W.stream),
             "graph: eager allgather between replays");
    MG_NCCL(W.nccl, ncclAllReduce(s1, r1, c1, ncclBfloat16, ncclSum, W.nccl, W.stream));
    MG_NCCL(W.nccl, ncclAllReduce(s2, r2, c2, ncclFloat32, ncclSum, W.nccl, W.stream));
    sync_stream();
    void *h1 = to_host(o1, c1 * 2), *hr1 = to_host(r1, c1 * 2);
    void *h2 = to_host(o2, c2 * 4), *hr2 = to_host(r2, c2 * 4);
    char what[120];
    snprintf(what, sizeof what, "graph replay %d: bf16 all-reduce of %zu", k, c1);
    check_sum(what, MOELINK_DTYPE_BF16, h1, hr1, c1, ca, 0);
    snprintf(what, sizeof what, "graph replay %d: f32 all-reduce of %zu", k, c2);
    check_sum(what, MOELINK_DTYPE_F32, h2, hr2, c2, cb, 0);
    free(h1);
    free(hr1);
    free(h2);
    free(hr2);
  }
  void *h_ag = to_host(ag_o, c3 * 2 * W.size);
  size_t bad = 0;
  for (int s = 0; s < W.size; ++s)
    for (size_t i = 0; i < c3; ++i)
      bad += mg_get(MOELINK_DTYPE_F16, (char *)h_ag + (size_t)s * c3 * 2, i) !=
             mg_input(MOELINK_DTYPE_F16, 77, i);
  CHECK(bad == 0, "graph: the eager allgathers between replays (%zu wrong)", bad);
  free(h_ag);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  void *bufs[] = {s1, o1, r1, s2, o2, r2, ag_s, ag_o};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) cudaFree(bufs[i]);
}

/* The copy-engine all-gather captured in a graph: replays between eager
 * calls continue its rounds (its counter lives in device memory). */
static void run_ce_graph(void) {
  const size_t c1 = 20000003, c2 = 4097; /* bf16: 2 rounds of 32 MiB regions at 2 ranks; small */
  const int n = W.size;
  void *s1 = mg_dev(c1 * 2), *o1 = mg_dev(c1 * 2 * n), *s2 = mg_dev(c2 * 4), *o2 = mg_dev(c2 * 4 * n);
  fill(MOELINK_DTYPE_F32, s2, c2, mg_seed(W.rank, 950));
  sync_stream();
  cudaGraph_t g = NULL;
  cudaGraphExec_t ge = NULL;
  MG_CUDA(cudaStreamBeginCapture(W.stream, cudaStreamCaptureModeGlobal));
  moelink_status_t a = moelink_allgather(W.comm, s1, o1, c1, MOELINK_DTYPE_BF16, W.stream);
  cudaError_t e = cudaStreamEndCapture(W.stream, &g);
  CHECK(a == MOELINK_SUCCESS && e == cudaSuccess, "CE graph: all-gather captured (%s, %s)",
        moelink_status_string(a), cudaGetErrorString(e));
  if (a || e != cudaSuccess) mg_bail("capture failed");
  MG_CUDA(cudaGraphInstantiate(&ge, g, 0));
  for (int k = 0; k < 3; ++k) {
    const int c = 960 + k;
    fill(MOELINK_DTYPE_BF16, s1, c1, mg_seed(W.rank, c));
    poison(o1, c1 * 2 * n);
    poison(o2, c2 * 4 * n);
    MG_CUDA(cudaGraphLaunch(ge, W.stream));
    CHECK_OK(moelink_allgather(W.comm, s2, o2, c2, MOELINK_DTYPE_F32, W.stream),
             "CE graph: eager all-gather after a replay");
    sync_stream();
    char *h1 = (char *)to_host(o1, c1 * 2 * n), *h2 = (char *)to_host(o2, c2 * 4 * n);
    size_t bad1 = 0, bad2 = 0;
    for (int s = 0; s < n; ++s) {
#pragma omp parallel for reduction(+ : bad1)
      for (size_t i = 0; i < c1; ++i)
        bad1 += mg_get(MOELINK_DTYPE_BF16, h1 + (size_t)s * c1 * 2, i) !=
                mg_input(MOELINK_DTYPE_BF16, mg_seed(s, c), i);
      for (size_t i = 0; i < c2; ++i)
        bad2 += mg_get(MOELINK_DTYPE_F32, h2 + (size_t)s * c2 * 4, i) !=
                mg_input(MOELINK_DTYPE_F32, mg_seed(s, 950), i);
    }
    CHECK(bad1 == 0 && bad2 == 0, "CE graph replay %d: replayed and eager blocks (%zu, %zu wrong)",
          k, bad1, bad2);
    free(h1);
    free(h2);
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  void *bufs[] = {s1, o1, s2, o2};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) cudaFree(bufs[i]);
}

/* ---- a communicator around the NCCL one ------------------------------------- */

static void run_wrapped(void) {
  moelink_comm_t cw = NULL;
  MG_MUST(moelink_comm_init_from_nccl(W.ctx, W.nccl, &cw), "moelink_comm_init_from_nccl");
  CHECK(moelink_comm_rank(cw) == W.rank && moelink_comm_size(cw) == W.size,
        "init_from_nccl: rank %d of %d", moelink_comm_rank(cw), moelink_comm_size(cw));
  const size_t count = 300007;
  const int c = g_case++;
  void *send = mg_dev(count * 2), *ours = mg_dev(count * 2), *ref = mg_dev(count * 2);
  fill(MOELINK_DTYPE_BF16, send, count, mg_seed(W.rank, c));
  poison(ours, count * 2);
  CHECK_OK(moelink_allreduce(cw, send, ours, count, MOELINK_DTYPE_BF16, W.stream),
           "init_from_nccl: allreduce");
  MG_NCCL(W.nccl, ncclAllReduce(send, ref, count, ncclBfloat16, ncclSum, W.nccl, W.stream));
  CHECK_OK(moelink_comm_check(cw, W.stream), "init_from_nccl: check");
  void *h = to_host(ours, count * 2), *hr = to_host(ref, count * 2);
  check_sum("init_from_nccl: bf16 all-reduce", MOELINK_DTYPE_BF16, h, hr, count, c, 0);
  free(h);
  free(hr);
  CHECK_OK(moelink_comm_destroy(cw), "init_from_nccl: destroy (keeps the NCCL communicator)");
  /* The NCCL communicator and the first moelink one still work. */
  poison(ours, count * 2);
  poison(ref, count * 2);
  MG_NCCL(W.nccl, ncclAllReduce(send, ref, count, ncclBfloat16, ncclSum, W.nccl, W.stream));
  CHECK_OK(moelink_allreduce(W.comm, send, ours, count, MOELINK_DTYPE_BF16, W.stream),
           "allreduce on the first communicator after the wrapper is gone");
  sync_stream();
  h = to_host(ours, count * 2);
  hr = to_host(ref, count * 2);
  check_sum("after the wrapper: bf16 all-reduce", MOELINK_DTYPE_BF16, h, hr, count, c, 0);
  free(h);
  free(hr);
  cudaFree(send);
  cudaFree(ours);
  cudaFree(ref);
}

int main(void) {
  mg_init(&W);
  const double t0 = mg_now();
  static const size_t ar_f32[] = {1,       3,       8,        33,       1000,     4097,
                                  65537,   262147,  1048583,  4194319,  33554467, 67108864};
  static const size_t ar_16[] = {1, 2, 9, 4099, 131075, 2097157};
  static const size_t ag_f32[] = {1, 5, 1000, 65539, 1048577, 33554432};
  static const size_t ag_16[] = {3, 4097, 1048579, 16777216};
  static const size_t rs_f32[] = {1, 7, 1001, 65541, 1048579, 33554432};
  static const size_t rs_16[] = {3, 4099, 1048583, 16777216};
#define EACH(a) for (size_t i_ = 0; i_ < sizeof a / sizeof a[0]; ++i_)
  EACH(ar_f32) run_allreduce(MOELINK_DTYPE_F32, ar_f32[i_]);
  EACH(ar_16) run_allreduce(MOELINK_DTYPE_BF16, ar_16[i_]);
  run_allreduce(MOELINK_DTYPE_BF16, (size_t)128 << 20); /* 256 MiB */
  EACH(ar_16) run_allreduce(MOELINK_DTYPE_F16, ar_16[i_]);
  EACH(ag_f32) run_allgather(MOELINK_DTYPE_F32, ag_f32[i_]);
  EACH(ag_16) run_allgather(MOELINK_DTYPE_BF16, ag_16[i_]);
  run_allgather(MOELINK_DTYPE_F16, 65537);
  /* The same all-gathers on the copy engines, one that ends in a short
   * round, then the SM kernel again (its epochs must not have moved). */
  MG_MUST(ml_comm_cuda_set_allgather(W.comm, ML_CCU_AG_CE), "select the CE all-gather");
  g_ag_engine = " (copy engines)";
  EACH(ag_f32) run_allgather(MOELINK_DTYPE_F32, ag_f32[i_]);
  EACH(ag_16) run_allgather(MOELINK_DTYPE_BF16, ag_16[i_]);
  run_allgather(MOELINK_DTYPE_F16, 65537);
  run_allgather(MOELINK_DTYPE_BF16, 33554433);
  run_ce_graph();
  MG_MUST(ml_comm_cuda_set_allgather(W.comm, ML_CCU_AG_SM), "select the SM all-gather");
  g_ag_engine = "";
  run_allgather(MOELINK_DTYPE_BF16, 1048579);
  EACH(rs_f32) run_reduce_scatter(MOELINK_DTYPE_F32, rs_f32[i_]);
  EACH(rs_16) run_reduce_scatter(MOELINK_DTYPE_BF16, rs_16[i_]);
  run_reduce_scatter(MOELINK_DTYPE_F16, 262147);
#undef EACH
  ml_t_diag("sizes done in %.1f s", mg_now() - t0);
  run_stress();
  run_graph();
  run_wrapped();
  ml_t_diag("all done in %.1f s", mg_now() - t0);
  mg_fini(&W);
  return ml_test_done();
}
