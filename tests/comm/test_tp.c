/* Tensor-parallel fused GEMMs (moelink_ag_gemm, moelink_gemm_rs,
 * moelink_gemm_ar) on CPU ranks. Every rank regenerates every rank's inputs
 * from the counter-based generator and computes its expected result in double
 * with the documented roundings: each rank's partial rounded to the dtype,
 * partials summed in fp32 in rank order 0..n-1, one rounding at the end.
 *
 * Two kinds of inputs:
 * - exact: small non-negative integers (0..7), so every fp32 dot product is
 *   exact whatever the summation order. The result is then fixed bit for bit
 *   by the documented roundings (bf16 partials above 256 and f16 ones above
 *   2048 do round), and is compared bitwise: this pins down "round the
 *   partial, sum in fp32 in rank order, round once".
 * - random in [-1, 1): compared within a bound derived from those roundings
 *   (see tolerance()).
 * Plus m = 0, m = max_m, several shapes in a row on tps of every dtype,
 * outputs poisoned with NaN, bitwise equality across ranks and runs, gemm_rs
 * against gemm_ar on the same inputs, and the error paths. */
#include "comm_test.h"

#include <math.h>
#include <stddef.h>

enum { OP_AG, OP_RS, OP_AR, OP_COUNT };
static const char *const op_names[] = {"ag_gemm", "gemm_rs", "gemm_ar"};
static const moelink_dtype_t dtypes[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16,
                                         MOELINK_DTYPE_F16};

/* The tps' maxima (max_m depends on the rank count, set in main). */
#define MAX_N 129
#define MAX_K 1001

static moelink_context_t ctx;
static moelink_comm_t comm;
static int rank, nranks, max_m;
static moelink_tp_t tps[3];
/* The largest |c - reference| / tolerance seen per dtype (random inputs). */
static double worst[3];

typedef struct job {
  int op;
  moelink_dtype_t dt;
  int m, n, k;
  int exact;
  uint64_t call;
} job_t;

static int dtype_index(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_F32 ? 0 : dt == MOELINK_DTYPE_BF16 ? 1 : 2;
}

/* v rounded to the dtype as the reference's own conversions do it. */
static double rd(moelink_dtype_t dt, double v) {
  unsigned char tmp[4];
  ref_store(dt, tmp, 0, v);
  return ref_load(dt, tmp, 0);
}

/* n inputs of seed as stored in dtype: into d (doubles) and, when store is
 * not NULL, into store (dtype), the buffer this rank passes to the op. */
static void gen(moelink_dtype_t dt, int exact, uint64_t seed, size_t n, void *store, double *d) {
  for (size_t i = 0; i < n; ++i) {
    double u = (double)moelink_random_value(seed, i, 1.0f, 0.0f);
    double v = exact ? floor(4.0 + 4.0 * u) : u;
    d[i] = rd(dt, v);
    if (store) ref_store(dt, store, i, v);
  }
}

/* How far a correct result may be from the reference for bf16/f16/f32
 * inputs that are not exact. The reference rounds the exact partials x_p;
 * the library rounds its fp32 GEMM results y_p, |y_p - x_p| <= G_p with
 * G_p = gamma_k * sum |a b| (the classic bound for a k-term fp32 dot product,
 * any order, FMA or not). A rounding to the dtype moves a value by at most
 * half a unit in the last place, ulp(v) <= eps * |v| (eps: 2^-23, 2^-7, 2^-10
 * for f32, bf16, f16). So per partial the two rounded values differ by at
 * most eps (|x_p| + G_p) + G_p (one ulp where the two land on either side
 * of a rounding boundary, plus the GEMM's own error); the fp32 sums over
 * ranks add at most 2 (nr - 1) u (sum |P|) on each side, and the final
 * rounding another ulp. With T = sum |x_p|, G = sum G_p:
 *   D   = eps (T + G) + G + u T + 2 (nr - 1) u (2 T + G)
 *   tol = D + eps (2 T + D) + a few of the dtype's smallest subnormals,
 * i.e. three to six ulps of the dtype at the result's scale for bf16/f16
 * and, for f32, a relative bound of k u on the sum of |a b|. */
static double tolerance(moelink_dtype_t dt, int terms, int k, double T, double S) {
  const double u = ldexp(1.0, -24);
  const double eps = dt == MOELINK_DTYPE_F32 ? ldexp(1.0, -23)
                     : dt == MOELINK_DTYPE_BF16 ? ldexp(1.0, -7)
                                                : ldexp(1.0, -10);
  const double tiny = dt == MOELINK_DTYPE_F16 ? ldexp(1.0, -24) : ldexp(1.0, -149);
  const double G = 1.01 * k * u * S;
  const double D = eps * (T + G) + G + u * T + 2.0 * (terms - 1) * u * (2.0 * T + G);
  return D + eps * (2.0 * T + D) + (terms + 2) * tiny;
}

/* The op's shapes on this rank. */
static int a_rows(const job_t *j) { return j->op == OP_AG ? j->m / nranks : j->m; }
static int c_rows(const job_t *j) { return j->op == OP_RS ? j->m / nranks : j->m; }

/* want (dtype) and tol for this rank's c from all ranks' inputs ad [nr][a
 * rows, k] and bd [nr][n, k]. */
static void reference(const job_t *j, const double *ad, const double *bd, void *want,
                      double *tol) {
  const int n = j->n, k = j->k, ar = a_rows(j), cr = c_rows(j);
  const int row0 = j->op == OP_RS ? rank * cr : 0;
  for (int i = 0; i < cr; ++i)
    for (int c = 0; c < n; ++c) {
      const size_t e = (size_t)i * n + c;
      if (j->op == OP_AG) {
        /* All ranks' rows in rank order are A [m, k]; b is this rank's. */
        const double *arow = ad + (size_t)i * k, *brow = bd + ((size_t)rank * n + c) * k;
        double x = 0, s = 0;
        for (int l = 0; l < k; ++l) {
          x += arow[l] * brow[l];
          s += fabs(arow[l] * brow[l]);
        }
        ref_store(j->dt, want, e, x);
        tol[e] = tolerance(j->dt, 1, k, fabs(x), s);
        continue;
      }
      float sum = 0.0f;
      double T = 0, S = 0;
      for (int p = 0; p < nranks; ++p) {
        const double *arow = ad + ((size_t)p * ar + row0 + i) * k;
        const double *brow = bd + ((size_t)p * n + c) * k;
        double x = 0;
        for (int l = 0; l < k; ++l) {
          x += arow[l] * brow[l];
          S += fabs(arow[l] * brow[l]);
        }
        T += fabs(x);
        sum = p == 0 ? (float)rd(j->dt, x) : sum + (float)rd(j->dt, x);
      }
      ref_store(j->dt, want, e, (double)sum);
      tol[e] = tolerance(j->dt, nranks, k, T, S);
    }
}

static moelink_status_t call_op(int op, moelink_tp_t tp, const void *a, const void *b, void *c,
                                int m, int n, int k) {
  switch (op) {
  case OP_AG: return moelink_ag_gemm(tp, a, b, c, m, n, k, NULL);
  case OP_RS: return moelink_gemm_rs(tp, a, b, c, m, n, k, NULL);
  default: return moelink_gemm_ar(tp, a, b, c, m, n, k, NULL);
  }
}

/* One op with fresh inputs, c poisoned first; 1 if it succeeded and
 * matched. c_out, when given, receives c (caller frees). */
static int run_job(const job_t *j, char *why, size_t why_size, void **c_out) {
  const size_t es = moelink_dtype_size(j->dt);
  const size_t an = (size_t)a_rows(j) * j->k, bn = (size_t)j->n * j->k;
  const size_t cn = (size_t)c_rows(j) * j->n;
  double *ad = (double *)ct_alloc((size_t)nranks * an * sizeof *ad);
  double *bd = (double *)ct_alloc((size_t)nranks * bn * sizeof *bd);
  double *tol = (double *)ct_alloc(cn * sizeof *tol);
  void *a = ct_alloc(an * es), *b = ct_alloc(bn * es), *c = ct_alloc(cn * es);
  void *want = ct_alloc(cn * es);
  int ok = 0;
  for (int p = 0; p < nranks; ++p) {
    gen(j->dt, j->exact, ct_seed(2 * j->call, p), an, p == rank ? a : NULL, ad + (size_t)p * an);
    gen(j->dt, j->exact, ct_seed(2 * j->call + 1, p), bn, p == rank ? b : NULL,
        bd + (size_t)p * bn);
  }
  reference(j, ad, bd, want, tol);
  memset(c, 0xff, cn * es); /* NaN in every dtype: an element left unwritten shows */
  moelink_status_t s =
      call_op(j->op, tps[dtype_index(j->dt)], a, b, c, j->m, j->n, j->k);
  if (s != MOELINK_SUCCESS) {
    snprintf(why, why_size, "%s: %s", moelink_status_string(s), moelink_last_error());
    goto out;
  }
  if (j->exact) {
    long d = ct_first_diff(c, want, cn, es);
    if (d >= 0) {
      snprintf(why, why_size, "element %ld of %zu is %.9g, reference %.9g (bitwise)", d, cn,
               ref_load(j->dt, c, (size_t)d), ref_load(j->dt, want, (size_t)d));
      goto out;
    }
  } else {
    for (size_t e = 0; e < cn; ++e) {
      const double got = ref_load(j->dt, c, e), w = ref_load(j->dt, want, e);
      const double r = fabs(got - w) / tol[e];
      if (r > worst[dtype_index(j->dt)]) worst[dtype_index(j->dt)] = r;
      if (!(fabs(got - w) <= tol[e])) {
        snprintf(why, why_size, "element %zu of %zu is %.9g, reference %.9g, tolerance %.3g", e,
                 cn, got, w, tol[e]);
        goto out;
      }
    }
  }
  ok = 1;
  if (c_out) {
    *c_out = ct_alloc(cn * es);
    memcpy(*c_out, c, cn * es);
  }
out:
  free(ad);
  free(bd);
  free(tol);
  free(a);
  free(b);
  free(c);
  free(want);
  return ok;
}

static void job_check(const job_t *j) {
  char why[320] = "";
  int ok = run_job(j, why, sizeof why, NULL);
  CHECK(ok, "%s %s m %d n %d k %d %s, %d ranks: matches the reference%s%s", op_names[j->op],
        moelink_dtype_name(j->dt), j->m, j->n, j->k, j->exact ? "exact inputs" : "random inputs",
        nranks, ok ? "" : ": ", why);
}

/* Shapes in a row, the three dtypes' tps interleaved: odd sizes, one and
 * several row blocks, one and several column blocks (k = 1001), m = max_m. */
static void test_shapes(void) {
  const int nr = nranks;
  typedef struct {
    int per_rank, n, k, exact;
  } shape_t;
  /* per_rank 0: m = max_m (two row blocks); k = MAX_K: two column blocks. */
  const shape_t shapes[] = {
      {1, 1, 1, 0},  {7, 37, 7, 0},     {3, MAX_N, 37, 0}, {0, 7, 129, 0},
      {3, 67, MAX_K, 0}, {0, MAX_N, 129, 0}, {7, 37, 129, 1},   {0, MAX_N, 65, 1},
  };
  uint64_t call = 1000;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s)
    for (int op = 0; op < OP_COUNT; ++op)
      for (int d = 0; d < 3; ++d) {
        const int m = shapes[s].per_rank ? shapes[s].per_rank * nr : max_m;
        job_t j = {op, dtypes[d], m, shapes[s].n, shapes[s].k, shapes[s].exact, ++call};
        /* gemm_ar takes any m: one row fewer than the multiple, where there is one. */
        if (op == OP_AR && m > 1 && m < max_m) j.m -= 1;
        job_check(&j);
      }
}

/* gemm_ar: bitwise the same c on every rank and on a second run; gemm_rs:
 * bitwise this rank's rows of gemm_ar's c on the same inputs. */
static void test_consistency(void) {
  for (int d = 0; d < 3; ++d) {
    const moelink_dtype_t dt = dtypes[d];
    const size_t es = moelink_dtype_size(dt);
    const int m = 5 * nranks, n = 37, k = 129;
    job_t ar = {OP_AR, dt, m, n, k, 0, 7000 + (uint64_t)d};
    job_t rs = ar;
    rs.op = OP_RS;
    void *c1 = NULL, *c2 = NULL, *cr = NULL;
    char why[320] = "";
    int ok = run_job(&ar, why, sizeof why, &c1) && run_job(&ar, why, sizeof why, &c2) &&
             run_job(&rs, why, sizeof why, &cr);
    const size_t cn = (size_t)m * n, rows = (size_t)(m / nranks) * n;
    CHECK(ok && memcmp(c1, c2, cn * es) == 0, "gemm_ar %s: two runs are bitwise equal%s%s",
          moelink_dtype_name(dt), ok ? "" : ": ", why);
    CHECK(ok && memcmp(cr, (char *)c1 + (size_t)rank * rows * es, rows * es) == 0,
          "gemm_rs %s: bitwise rank %d's rows of gemm_ar on the same inputs",
          moelink_dtype_name(dt), rank);
    uint64_t h = c1 ? ct_hash(c1, cn * es) : 0;
    uint64_t *all = (uint64_t *)ct_alloc((size_t)nranks * sizeof *all);
    moelink_status_t s = moelink_allgather(comm, &h, all, 2, MOELINK_DTYPE_F32, NULL);
    int same = s == MOELINK_SUCCESS;
    for (int p = 0; same && p < nranks; ++p) same = all[p] == h;
    CHECK(same, "gemm_ar %s: all %d ranks hold bitwise the same c (hash %016llx)",
          moelink_dtype_name(dt), nranks, (unsigned long long)h);
    free(all);
    free(c1);
    free(c2);
    free(cr);
  }
}

static void test_empty(void) {
  float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8}, c[4];
  memset(c, 0xff, sizeof c);
  int untouched = 1;
  for (int op = 0; op < OP_COUNT; ++op) {
    char what[64];
    snprintf(what, sizeof what, "%s m 0, NULL buffers", op_names[op]);
    CHECK_OK(call_op(op, tps[0], NULL, NULL, NULL, 0, 3, 5), what);
    snprintf(what, sizeof what, "%s m 0", op_names[op]);
    CHECK_OK(call_op(op, tps[0], a, b, c, 0, 1, 1), what);
    for (int i = 0; i < 4; ++i) untouched &= isnan(c[i]) != 0;
  }
  CHECK(untouched && a[0] == 1 && b[3] == 8, "m = 0 is a no-op (NULL buffers too), c untouched");
}

/* A call that must fail locally with `want` and a message containing `part`. */
#define CHECK_ERR(call, want, part, what)                                             \
  do {                                                                                \
    moelink_status_t s_ = (call);                                                     \
    CHECK(s_ == (want) && strstr(moelink_last_error(), (part)) != NULL,               \
          "%s -> %s (%s)", (what), moelink_status_string(s_), moelink_last_error()); \
  } while (0)

static void test_config_errors(void) {
  moelink_tp_config_t cfg = MOELINK_TP_CONFIG_INIT;
  cfg.max_m = 4;
  cfg.max_n = 4;
  cfg.max_k = 4;
  size_t bytes = 1;
  moelink_tp_t tp = (moelink_tp_t)&bytes; /* not NULL: a failed create must clear it */
  CHECK_ERR(moelink_tp_workspace_size(NULL, &cfg, &bytes), MOELINK_ERR_INVALID_ARGUMENT,
            "communicator is NULL", "workspace_size with a NULL comm");
  CHECK(bytes == 0, "a failed workspace_size sets *bytes to 0");
  CHECK_ERR(moelink_tp_workspace_size(comm, NULL, &bytes), MOELINK_ERR_INVALID_ARGUMENT,
            "config is NULL", "workspace_size with a NULL config");
  CHECK_ERR(moelink_tp_workspace_size(comm, &cfg, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "bytes is NULL", "workspace_size with NULL bytes");
  CHECK_ERR(moelink_tp_create(comm, &cfg, NULL), MOELINK_ERR_INVALID_ARGUMENT, "out is NULL",
            "tp_create with NULL out");
  CHECK_ERR(moelink_tp_create(NULL, &cfg, &tp), MOELINK_ERR_INVALID_ARGUMENT,
            "communicator is NULL", "tp_create with a NULL comm");
  CHECK(tp == NULL, "a failed tp_create sets *out to NULL");

  moelink_tp_config_t bad = cfg;
  bad.size = 0;
  CHECK_ERR(moelink_tp_create(comm, &bad, &tp), MOELINK_ERR_INVALID_ARGUMENT, "config size 0",
            "config size 0");
  bad.size = sizeof bad + 8;
  CHECK_ERR(moelink_tp_workspace_size(comm, &bad, &bytes), MOELINK_ERR_INVALID_ARGUMENT,
            "config size", "config size larger than the library's");
  bad = cfg;
  bad.dtype = MOELINK_DTYPE_FP8_E4M3;
  CHECK_ERR(moelink_tp_create(comm, &bad, &tp), MOELINK_ERR_UNSUPPORTED, "dtype 3",
            "fp8 config");
  bad.dtype = (moelink_dtype_t)99;
  CHECK_ERR(moelink_tp_create(comm, &bad, &tp), MOELINK_ERR_INVALID_ARGUMENT, "dtype 99",
            "dtype 99");
  bad = cfg;
  bad.max_m = 0;
  CHECK_ERR(moelink_tp_create(comm, &bad, &tp), MOELINK_ERR_INVALID_ARGUMENT, "max_m 0",
            "max_m 0");
  bad = cfg;
  bad.max_k = -3;
  CHECK_ERR(moelink_tp_workspace_size(comm, &bad, &bytes), MOELINK_ERR_INVALID_ARGUMENT,
            "max_k -3", "max_k -3");
  bad = cfg;
  bad.max_n = 0;
  CHECK_ERR(moelink_tp_create(comm, &bad, &tp), MOELINK_ERR_INVALID_ARGUMENT, "max_n 0",
            "max_n 0");
  bad = cfg;
  bad.comm_ctas = -1;
  CHECK_ERR(moelink_tp_create(comm, &bad, &tp), MOELINK_ERR_INVALID_ARGUMENT, "comm_ctas -1",
            "comm_ctas -1");
  bad = cfg;
  bad.max_m = bad.max_n = bad.max_k = 2147483647;
  CHECK_ERR(moelink_tp_workspace_size(comm, &bad, &bytes), MOELINK_ERR_OUT_OF_MEMORY,
            "does not fit", "workspace_size for maxima of INT_MAX");
  CHECK_OK(moelink_tp_destroy(NULL), "tp_destroy(NULL) is a no-op");

  /* A caller built against a struct that ended at max_k keeps comm_ctas's
   * default. */
  bad = cfg;
  bad.size = offsetof(moelink_tp_config_t, max_k) + sizeof bad.max_k;
  bad.comm_ctas = -1; /* past the given size: never read */
  moelink_tp_t old = NULL;
  CHECK_OK(moelink_tp_create(comm, &bad, &old), "tp_create with a config without comm_ctas");
  CHECK_OK(moelink_tp_destroy(old), "tp_destroy");

  /* The workspace holds what the largest call needs: it grows with the maxima. */
  size_t small = 0, big = 0, f32 = 0;
  CHECK_OK(moelink_tp_workspace_size(comm, &cfg, &small), "workspace_size bf16 4x4x4");
  moelink_tp_config_t larger = cfg;
  larger.max_m = 400;
  larger.max_n = 300;
  larger.max_k = 200;
  CHECK_OK(moelink_tp_workspace_size(comm, &larger, &big), "workspace_size bf16 400x300x200");
  larger.dtype = MOELINK_DTYPE_F32;
  CHECK_OK(moelink_tp_workspace_size(comm, &larger, &f32), "workspace_size f32 400x300x200");
  /* At least c's partial [max_m, max_n] when ranks reduce, and a's fp32 copy for bf16. */
  const size_t floor_bytes =
      (nranks > 1 ? (size_t)400 * 300 * 2 : 0) + (size_t)400 * 200 * 4;
  CHECK(small > 0 && big > small && big >= floor_bytes && f32 > 0,
        "workspace sizes: %zu (4x4x4), %zu (400x300x200, >= %zu), %zu (f32)", small, big,
        floor_bytes, f32);
}

static void test_call_errors(void) {
  /* bf16 tp: max_m, MAX_N, MAX_K. */
  moelink_tp_t tp = tps[1];
  const int nr = nranks;
  uint16_t *buf = (uint16_t *)ct_alloc((size_t)4 * MAX_N * MAX_K * 2);
  /* c first, so a c placed just before a stays inside buf. */
  uint16_t *c = buf, *a = buf + (size_t)MAX_N * MAX_K, *b = buf + (size_t)2 * MAX_N * MAX_K;
  memset(buf, 0, (size_t)4 * MAX_N * MAX_K * 2);
  for (int op = 0; op < OP_COUNT; ++op) {
    const char *nm = op_names[op];
    char what[96];
    snprintf(what, sizeof what, "%s with a NULL tp", nm);
    CHECK_ERR(call_op(op, NULL, a, b, c, nr, 1, 1), MOELINK_ERR_INVALID_ARGUMENT, "tp is NULL",
              what);
    snprintf(what, sizeof what, "%s with a NULL a", nm);
    CHECK_ERR(call_op(op, tp, NULL, b, c, nr, 1, 1), MOELINK_ERR_INVALID_ARGUMENT, "a is NULL",
              what);
    snprintf(what, sizeof what, "%s with a NULL b", nm);
    CHECK_ERR(call_op(op, tp, a, NULL, c, nr, 1, 1), MOELINK_ERR_INVALID_ARGUMENT, "b is NULL",
              what);
    snprintf(what, sizeof what, "%s with a NULL c", nm);
    CHECK_ERR(call_op(op, tp, a, b, NULL, nr, 1, 1), MOELINK_ERR_INVALID_ARGUMENT, "c is NULL",
              what);
    snprintf(what, sizeof what, "%s with m -1", nm);
    CHECK_ERR(call_op(op, tp, a, b, c, -1, 1, 1), MOELINK_ERR_INVALID_ARGUMENT, "m -1", what);
    snprintf(what, sizeof what, "%s with n 0", nm);
    CHECK_ERR(call_op(op, tp, a, b, c, nr, 0, 1), MOELINK_ERR_INVALID_ARGUMENT, "n 0", what);
    snprintf(what, sizeof what, "%s with k 0", nm);
    CHECK_ERR(call_op(op, tp, a, b, c, nr, 1, 0), MOELINK_ERR_INVALID_ARGUMENT, "k 0", what);
    snprintf(what, sizeof what, "%s with m over max_m", nm);
    CHECK_ERR(call_op(op, tp, a, b, c, max_m + nr, 1, 1), MOELINK_ERR_INVALID_ARGUMENT,
              "exceed", what);
    snprintf(what, sizeof what, "%s with n over max_n", nm);
    CHECK_ERR(call_op(op, tp, a, b, c, nr, MAX_N + 1, 1), MOELINK_ERR_INVALID_ARGUMENT,
              "exceed", what);
    snprintf(what, sizeof what, "%s with k over max_k", nm);
    CHECK_ERR(call_op(op, tp, a, b, c, nr, 1, MAX_K + 1), MOELINK_ERR_INVALID_ARGUMENT,
              "exceed", what);
    if (op != OP_AR && nr > 1) {
      snprintf(what, sizeof what, "%s with m %d not a multiple of %d ranks", nm, nr + 1, nr);
      CHECK_ERR(call_op(op, tp, a, b, c, nr + 1, 1, 1), MOELINK_ERR_INVALID_ARGUMENT,
                "not a multiple", what);
    }
    /* c's last element on a's first (c [rows, 3], a [rows', 5]). */
    const int m = nr, crow = op == OP_RS ? 1 : m;
    snprintf(what, sizeof what, "%s with c overlapping a", nm);
    CHECK_ERR(call_op(op, tp, a, b, a - (size_t)crow * 3 + 1, m, 3, 5),
              MOELINK_ERR_INVALID_ARGUMENT, "c overlaps a", what);
    snprintf(what, sizeof what, "%s with c overlapping b", nm);
    CHECK_ERR(call_op(op, tp, a, b, b + 2, m, 3, 5), MOELINK_ERR_INVALID_ARGUMENT,
              "c overlaps b", what);
    snprintf(what, sizeof what, "%s with a misaligned c", nm);
    CHECK_ERR(call_op(op, tp, a, b, (char *)c + 1, m, 3, 5), MOELINK_ERR_INVALID_ARGUMENT,
              "aligned", what);
  }
  job_t j = {OP_AR, MOELINK_DTYPE_BF16, 2 * nr + 1, 3, 5, 1, 9000};
  job_check(&j); /* the tp still works after all those refusals */
  free(buf);
}

static void start(void) {
  /* Two OpenMP threads per rank where the ranks leave cores for them: the
   * GEMM's items then run on a team of two. */
  const char *ws = getenv("MOELINK_WORLD_SIZE");
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.num_threads = ws && atoi(ws) <= 2 ? 2 : 1;
  moelink_status_t s = moelink_context_create(&cc, &ctx);
  if (s == MOELINK_SUCCESS) s = moelink_comm_init_from_env(ctx, &comm);
  if (s != MOELINK_SUCCESS) {
    printf("Bail out! cannot start: %s: %s\n", moelink_status_string(s), moelink_last_error());
    exit(1);
  }
}

int main(void) {
  start();
  rank = moelink_comm_rank(comm);
  nranks = moelink_comm_size(comm);
  /* An odd number of rows per rank, just over the backend's 128-row block
   * in all (129..136), so m = max_m spans two row blocks at every rank count. */
  int per_rank = (129 + nranks - 1) / nranks;
  max_m = nranks * (per_rank | 1);
  ml_t_diag("rank %d of %d", rank, nranks);
  double t0 = ct_now_ms();
  for (int d = 0; d < 3; ++d) {
    moelink_tp_config_t cfg = MOELINK_TP_CONFIG_INIT;
    cfg.dtype = dtypes[d];
    cfg.max_m = max_m;
    cfg.max_n = MAX_N;
    cfg.max_k = MAX_K;
    CHECK_OK(moelink_tp_create(comm, &cfg, &tps[d]), "tp_create");
    if (!tps[d]) {
      printf("Bail out! no tp\n");
      return 1;
    }
  }
  test_config_errors();
  test_call_errors();
  test_empty();
  test_shapes();
  test_consistency();
  ml_t_diag("largest error / tolerance: f32 %.3f, bf16 %.3f, f16 %.3f", worst[0], worst[1],
            worst[2]);
  ml_t_diag("took %.0f ms", ct_now_ms() - t0);
  for (int d = 0; d < 3; ++d) CHECK_OK(moelink_tp_destroy(tps[d]), "tp_destroy");
  CHECK_OK(moelink_comm_check(comm, NULL), "comm_check reports no failure");
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy");
  moelink_context_destroy(ctx);
  return ml_test_done();
}
