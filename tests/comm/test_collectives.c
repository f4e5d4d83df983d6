/* All-reduce, all-gather and reduce-scatter of CPU ranks against a reference
 * every rank computes from the generator seeds of all ranks: the sums are fp32
 * in rank order 0..n-1 rounded once to the dtype (the CPU communicator's
 * documented order), so results must match bitwise. Sizes 1, 7, 1000 and an
 * odd size larger than a rank's whole staging area, every dtype, in place,
 * 200 back-to-back calls of random kind, dtype and size, and bitwise
 * determinism across ranks and across repeated runs. */
#include "comm/cpu/comm_cpu.h"
#include "comm_test.h"

typedef enum { OP_AR, OP_AR_INPLACE, OP_AG, OP_RS, OP_COUNT } op_t;

static const char *const op_names[] = {"allreduce", "allreduce in place", "allgather",
                                       "reduce_scatter"};
static const moelink_dtype_t dtypes[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16,
                                         MOELINK_DTYPE_F16};

/* Odd, and more elements than both staging halves hold even at 2 bytes each. */
#define BIG_COUNT (ML_CPU_STAGE_BYTES + 4097)

static moelink_context_t ctx;
static moelink_comm_t comm;
static int rank, nranks;

/* The reference result of one call into ref (recv's dtype and size). */
static void reference(op_t op, moelink_dtype_t dt, size_t count, uint64_t call, void *ref) {
  if (op == OP_AG) {
    for (int p = 0; p < nranks; ++p)
      for (size_t i = 0; i < count; ++i)
        ref_store(dt, ref, (size_t)p * count + i, (double)ct_value(dt, ct_seed(call, p), i));
    return;
  }
  size_t base = op == OP_RS ? (size_t)rank * count : 0;
  for (size_t i = 0; i < count; ++i) {
    float s = ct_value(dt, ct_seed(call, 0), base + i);
    for (int p = 1; p < nranks; ++p) s += ct_value(dt, ct_seed(call, p), base + i);
    ref_store(dt, ref, i, (double)s);
  }
}

/* One call with fresh inputs; 1 if it succeeded and matched. recv_out, when
 * given, receives a copy of the result (caller frees). */
static int run_one(op_t op, moelink_dtype_t dt, size_t count, uint64_t call, char *why,
                   size_t why_size, void **recv_out) {
  size_t es = moelink_dtype_size(dt);
  size_t send_n = op == OP_RS ? (size_t)nranks * count : count;
  size_t recv_n = op == OP_AG ? (size_t)nranks * count : count;
  unsigned char *send = (unsigned char *)ct_alloc(send_n * es);
  unsigned char *recv = op == OP_AR_INPLACE ? send : (unsigned char *)ct_alloc(recv_n * es);
  unsigned char *ref = (unsigned char *)ct_alloc(recv_n * es);
  int ok = 0;
  moelink_status_t s =
      moelink_fill_random(ctx, dt, send, send_n, ct_seed(call, rank), 1.0f, 0.0f, NULL);
  if (s != MOELINK_SUCCESS) {
    snprintf(why, why_size, "fill_random: %s", moelink_last_error());
    goto out;
  }
  if (recv != send) memset(recv, 0xff, recv_n * es); /* NaN: unwritten elements show */
  switch (op) {
  case OP_AR:
  case OP_AR_INPLACE: s = moelink_allreduce(comm, send, recv, count, dt, NULL); break;
  case OP_AG: s = moelink_allgather(comm, send, recv, count, dt, NULL); break;
  case OP_RS: s = moelink_reduce_scatter(comm, send, recv, count, dt, NULL); break;
  default: break;
  }
  if (s != MOELINK_SUCCESS) {
    snprintf(why, why_size, "%s: %s", moelink_status_string(s), moelink_last_error());
    goto out;
  }
  reference(op, dt, count, call, ref);
  long d = ct_first_diff(recv, ref, recv_n, es);
  if (d >= 0) {
    snprintf(why, why_size, "element %ld of %zu is %.9g, reference %.9g", d, recv_n,
             ref_load(dt, recv, (size_t)d), ref_load(dt, ref, (size_t)d));
    goto out;
  }
  ok = 1;
  if (recv_out) {
    *recv_out = ct_alloc(recv_n * es);
    memcpy(*recv_out, recv, recv_n * es);
  }
out:
  if (recv != send) free(recv);
  free(send);
  free(ref);
  return ok;
}

static void test_generator(void) {
  /* The reference regenerates peers' inputs element by element: it must
   * agree with what moelink_fill_random wrote, or every comparison is moot. */
  int ok = 1;
  for (size_t d = 0; d < 3; ++d) {
    moelink_dtype_t dt = dtypes[d];
    size_t es = moelink_dtype_size(dt);
    unsigned char *buf = (unsigned char *)ct_alloc(1000 * es), *want = ct_alloc(1000 * es);
    moelink_fill_random(ctx, dt, buf, 1000, ct_seed(5, rank), 1.0f, 0.0f, NULL);
    for (size_t i = 0; i < 1000; ++i) ref_store(dt, want, i, ct_value(dt, ct_seed(5, rank), i));
    if (memcmp(buf, want, 1000 * es) != 0) ok = 0;
    free(buf);
    free(want);
  }
  CHECK(ok, "the reference regenerates fill_random's inputs bitwise (all dtypes)");
}

static void test_matrix(void) {
  const size_t counts[] = {1, 7, 1000, BIG_COUNT};
  uint64_t call = 100;
  for (size_t d = 0; d < 3; ++d)
    for (size_t c = 0; c < 4; ++c)
      for (int op = 0; op < OP_COUNT; ++op) {
        char why[256] = "";
        int ok = run_one((op_t)op, dtypes[d], counts[c], ++call, why, sizeof why, NULL);
        CHECK(ok, "%s %s count %zu, %d ranks: bitwise the reference%s%s", op_names[op],
              moelink_dtype_name(dtypes[d]), counts[c], nranks, ok ? "" : ": ", why);
      }
}

static void test_back_to_back(void) {
  /* Same sequence on every rank: the choice depends only on the call index. */
  int fails = 0, first = -1;
  char why[256] = "", first_why[300] = "";
  double t0 = ct_now_ms();
  for (int k = 0; k < 200; ++k) {
    uint64_t r = ct_mix(777, (uint64_t)k);
    op_t op = (op_t)(r % OP_COUNT);
    moelink_dtype_t dt = dtypes[(r >> 8) % 3];
    size_t count = 1 + (size_t)((r >> 16) % (k % 25 == 0 ? 70000 : 3000));
    if (!run_one(op, dt, count, 10000 + (uint64_t)k, why, sizeof why, NULL)) {
      if (first < 0) {
        first = k;
        snprintf(first_why, sizeof first_why, "call %d (%s %s count %zu): %s", k, op_names[op],
                 moelink_dtype_name(dt), count, why);
      }
      ++fails;
    }
  }
  CHECK(fails == 0, "200 back-to-back calls of random kind, dtype and size: %d wrong%s%s", fails,
        fails ? "; first: " : "", first_why);
  ml_t_diag("200 back-to-back calls took %.0f ms", ct_now_ms() - t0);
}

static void test_determinism(void) {
  for (size_t d = 0; d < 3; ++d) {
    moelink_dtype_t dt = dtypes[d];
    size_t es = moelink_dtype_size(dt);
    void *a = NULL, *b = NULL;
    char why[256] = "";
    int ok = run_one(OP_AR, dt, BIG_COUNT, 50000 + d, why, sizeof why, &a) &&
             run_one(OP_AR, dt, BIG_COUNT, 50000 + d, why, sizeof why, &b);
    CHECK(ok && memcmp(a, b, BIG_COUNT * es) == 0,
          "allreduce %s: two runs on the same inputs are bitwise equal%s%s",
          moelink_dtype_name(dt), ok ? "" : ": ", why);
    /* Every rank holds the same bits: compare hashes through the comm. */
    uint64_t h = a ? ct_hash(a, BIG_COUNT * es) : 0;
    uint64_t *all = (uint64_t *)ct_alloc((size_t)nranks * sizeof *all);
    moelink_status_t s = moelink_allgather(comm, &h, all, 2, MOELINK_DTYPE_F32, NULL);
    int same = s == MOELINK_SUCCESS;
    for (int p = 0; same && p < nranks; ++p) same = all[p] == h;
    CHECK(same, "allreduce %s: all %d ranks hold bitwise the same result (hash %016llx)",
          moelink_dtype_name(dt), nranks, (unsigned long long)h);
    free(all);
    free(a);
    free(b);
  }
}

static void test_empty(void) {
  float x[4] = {1, 2, 3, 4}, y[4] = {5, 6, 7, 8};
  CHECK_OK(moelink_allreduce(comm, NULL, NULL, 0, MOELINK_DTYPE_F32, NULL),
           "allreduce of 0 elements with NULL buffers is a no-op");
  CHECK_OK(moelink_allgather(comm, x, y, 0, MOELINK_DTYPE_BF16, NULL), "allgather of 0 elements");
  CHECK_OK(moelink_reduce_scatter(comm, x, y, 0, MOELINK_DTYPE_F16, NULL),
           "reduce_scatter of 0 elements");
  CHECK(x[0] == 1 && x[3] == 4 && y[0] == 5 && y[3] == 8, "count 0 touches no buffer");
}

int main(void) {
  ct_start(&ctx, &comm);
  rank = moelink_comm_rank(comm);
  nranks = moelink_comm_size(comm);
  ml_t_diag("rank %d of %d", rank, nranks);
  test_generator();
  test_matrix();
  test_back_to_back();
  test_determinism();
  test_empty();
  CHECK_OK(moelink_comm_check(comm, NULL), "comm_check reports no failure");
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy");
  moelink_context_destroy(ctx);
  return ml_test_done();
}
