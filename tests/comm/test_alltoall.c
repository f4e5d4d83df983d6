/* moelink_alltoallv of CPU ranks against a reference every rank computes on
 * its own: the count matrix and every element are functions of (call,
 * source, destination, index), so each rank knows what every peer sent it.
 * It is a copy: results must match bitwise, NaN payloads included. Random
 * per-pair counts with zeros, odd sizes, pairs longer than many staging
 * rounds, scattered send offsets and packed ones (send_offsets NULL), every
 * dtype, outputs poisoned (elements past the received total stay poison),
 * a too small recv (error, nothing written past the capacity, the full
 * counts reported, the communicator still usable), a negative count, the
 * front end's argument checks, and 100 back-to-back calls. */
#include "comm/cpu/comm_cpu.h"
#include "comm_test.h"

static const moelink_dtype_t dtypes[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16,
                                         MOELINK_DTYPE_F16};

static moelink_context_t ctx;
static moelink_comm_t comm;
static int rank, nranks;

/* Poison byte: 0xa5a5 / 0xa5a5a5a5 are ordinary numbers, and the data below
 * never produces the pattern (its top byte is never 0xa5), so a stray
 * write of data shows, and an unwritten element shows as poison. */
#define POISON 0xa5

/* Count kinds: how large the elements of a call's matrix may be. */
typedef enum { SMALL, MIXED, LARGE } size_kind;

/* Elements rank s sends rank d in call `call`: zeros about a quarter of the
 * time; LARGE spans several staging rounds of the largest rank count. */
static int64_t pair_count(uint64_t call, size_kind kind, int s, int d) {
  uint64_t r = ct_mix(call * 7919 + (uint64_t)s, (uint64_t)d + 77);
  if (r % 4 == 0) return 0;
  switch (kind) {
  case SMALL: return (int64_t)((r >> 8) % 17);
  case MIXED: return (int64_t)((r >> 8) % ((r >> 40) % 3 == 0 ? 5000 : 300));
  default: return (int64_t)(ML_CPU_STAGE_BYTES / 2 + 1 + (r >> 8) % (ML_CPU_STAGE_BYTES / 2));
  }
}

/* Element i of what s sends d, as the raw bits of one dtype element. */
static uint32_t elem_bits(uint64_t call, int s, int d, int64_t i, size_t es) {
  uint64_t r = ct_mix(ct_mix(call, (uint64_t)s * 1024 + (uint64_t)d), (uint64_t)i);
  uint32_t v = (uint32_t)r;
  if (es == 2) {
    v &= 0xffff;
    if ((v >> 8) == POISON) v ^= 0x100;
  } else if ((v >> 24) == POISON) {
    v ^= 0x1000000;
  }
  return v;
}

static void put_bits(void *p, size_t i, uint32_t v, size_t es) {
  if (es == 2) {
    uint16_t h = (uint16_t)v;
    memcpy((char *)p + i * 2, &h, 2);
  } else {
    memcpy((char *)p + i * 4, &v, 4);
  }
}

static uint32_t get_bits(const void *p, size_t i, size_t es) {
  if (es == 2) {
    uint16_t h;
    memcpy(&h, (const char *)p + i * 2, 2);
    return h;
  }
  uint32_t v;
  memcpy(&v, (const char *)p + i * 4, 4);
  return v;
}

typedef struct a2a_case {
  uint64_t call;
  size_kind kind;
  moelink_dtype_t dt;
  int packed;         /* send_offsets NULL */
  int64_t cap_delta;  /* recv_capacity = received total + cap_delta (clamped at 0) */
  int bad_sender;     /* >= 0: that rank passes send_counts[bad_target] = -3 */
  int bad_target;
} a2a_case;

/* One call; 1 when everything matched. why: the first mismatch. */
static int run_case(const a2a_case *k, char *why, size_t why_size) {
  const size_t es = moelink_dtype_size(k->dt);
  int64_t *send_counts = (int64_t *)ct_alloc(sizeof(int64_t) * (size_t)nranks);
  int64_t *send_offsets = (int64_t *)ct_alloc(sizeof(int64_t) * (size_t)nranks);
  int64_t *recv_counts = (int64_t *)ct_alloc(sizeof(int64_t) * (size_t)nranks);
  int64_t *recv_offsets = (int64_t *)ct_alloc(sizeof(int64_t) * (size_t)nranks);
  int64_t *want_counts = (int64_t *)ct_alloc(sizeof(int64_t) * (size_t)nranks);
  int ok = 0;
  why[0] = '\0';

  /* Send layout: destinations in reverse rank order with gaps, so offsets
   * are neither sorted nor packed (unless k->packed). */
  size_t send_n = 0;
  for (int d = nranks - 1; d >= 0; --d) {
    send_counts[d] = pair_count(k->call, k->kind, rank, d);
    if (!k->packed) send_n += (size_t)(ct_mix(k->call, (uint64_t)d) % 5);
    send_offsets[d] = (int64_t)send_n;
    send_n += (size_t)send_counts[d];
  }
  if (k->packed) {
    send_n = 0;
    for (int d = 0; d < nranks; ++d) {
      send_offsets[d] = (int64_t)send_n;
      send_n += (size_t)send_counts[d];
    }
  }
  unsigned char *send = (unsigned char *)ct_alloc(send_n * es);
  memset(send, POISON, send_n * es);
  for (int d = 0; d < nranks; ++d)
    for (int64_t i = 0; i < send_counts[d]; ++i)
      put_bits(send, (size_t)(send_offsets[d] + i), elem_bits(k->call, rank, d, i, es), es);
  if (rank == k->bad_sender) send_counts[k->bad_target] = -3;

  size_t total = 0;
  for (int s = 0; s < nranks; ++s) {
    int64_t c = pair_count(k->call, k->kind, s, rank);
    /* A negative count arrives as 0. */
    if (s == k->bad_sender && rank == k->bad_target) c = 0;
    want_counts[s] = c;
    total += (size_t)c;
  }
  int64_t cap = (int64_t)total + k->cap_delta;
  if (cap < 0) cap = 0;
  const size_t guard = 64; /* poison past the capacity: must stay untouched */
  const size_t alloc_n = (size_t)cap + guard;
  unsigned char *recv = (unsigned char *)ct_alloc(alloc_n * es);
  memset(recv, POISON, alloc_n * es);
  for (int p = 0; p < nranks; ++p) recv_counts[p] = recv_offsets[p] = -12345;

  moelink_status_t st =
      moelink_alltoallv(comm, send, send_counts, k->packed ? NULL : send_offsets, recv,
                        (size_t)cap, recv_counts, recv_offsets, k->dt, NULL);
  const char *msg = moelink_last_error();
  const int overflow = (int64_t)total > cap;
  const int negative = rank == k->bad_sender;
  if (negative || overflow) {
    if (st != MOELINK_ERR_INVALID_ARGUMENT ||
        !strstr(msg, negative ? "send_counts" : "recv_capacity")) {
      snprintf(why, why_size, "expected INVALID_ARGUMENT about %s, got %s: %s",
               negative ? "send_counts" : "recv_capacity", moelink_status_string(st), msg);
      goto out;
    }
  } else if (st != MOELINK_SUCCESS) {
    snprintf(why, why_size, "%s: %s", moelink_status_string(st), msg);
    goto out;
  }
  int64_t at = 0;
  for (int s = 0; s < nranks; ++s) {
    if (recv_counts[s] != want_counts[s] || recv_offsets[s] != at) {
      snprintf(why, why_size, "from rank %d: count %lld offset %lld, want %lld at %lld", s,
               (long long)recv_counts[s], (long long)recv_offsets[s], (long long)want_counts[s],
               (long long)at);
      goto out;
    }
    for (int64_t i = 0; i < want_counts[s] && at + i < cap; ++i) {
      uint32_t got = get_bits(recv, (size_t)(at + i), es);
      uint32_t want = elem_bits(k->call, s, rank, i, es);
      if (got != want) {
        snprintf(why, why_size, "element %lld from rank %d (recv[%lld]): bits %08x, want %08x",
                 (long long)i, s, (long long)(at + i), got, want);
        goto out;
      }
    }
    at += want_counts[s];
  }
  size_t from = total < (size_t)cap ? total : (size_t)cap;
  for (size_t b = from * es; b < alloc_n * es; ++b)
    if (recv[b] != POISON) {
      snprintf(why, why_size, "byte %zu past the %zu elements received (capacity %lld) written",
               b, total, (long long)cap);
      goto out;
    }
  ok = 1;
out:
  free(send);
  free(recv);
  free(send_counts);
  free(send_offsets);
  free(recv_counts);
  free(recv_offsets);
  free(want_counts);
  return ok;
}

static void test_matrix(void) {
  uint64_t call = 1;
  static const char *const kinds[] = {"small", "mixed", "large (several staging rounds)"};
  for (size_t d = 0; d < 3; ++d)
    for (int kind = SMALL; kind <= LARGE; ++kind)
      for (int packed = 0; packed < 2; ++packed) {
        a2a_case k = {++call, (size_kind)kind, dtypes[d], packed, 7, -1, -1};
        char why[300];
        int ok = run_case(&k, why, sizeof why);
        CHECK(ok, "alltoallv %s, %s counts, %s offsets, %d ranks: bitwise the reference%s%s",
              moelink_dtype_name(dtypes[d]), kinds[kind], packed ? "packed" : "scattered",
              nranks, ok ? "" : ": ", why);
      }
}

static void test_exact_capacity(void) {
  a2a_case k = {500, MIXED, MOELINK_DTYPE_BF16, 0, 0, -1, -1};
  char why[300];
  int ok = run_case(&k, why, sizeof why);
  CHECK(ok, "alltoallv with recv_capacity exactly the received total%s%s", ok ? "" : ": ", why);
}

static void test_overflow(void) {
  /* Only the last rank's recv is short (by 5 elements, or everything), the
   * others must see a normal call. */
  for (int c = 0; c < 2; ++c) {
    a2a_case k = {600 + (uint64_t)c, c ? LARGE : MIXED, MOELINK_DTYPE_F32, 0, 16, -1, -1};
    if (rank == nranks - 1) k.cap_delta = c ? -1000000000 : -5;
    char why[300];
    int ok = run_case(&k, why, sizeof why);
    CHECK(ok,
          "alltoallv, rank %d's recv %s: %s, the rest intact, nothing past the capacity%s%s",
          nranks - 1, c ? "of capacity 0" : "5 elements short",
          rank == nranks - 1 ? "INVALID_ARGUMENT with the full counts" : "others unaffected",
          ok ? "" : ": ", why);
  }
  a2a_case k = {610, MIXED, MOELINK_DTYPE_F16, 0, 3, -1, -1};
  char why[300];
  int ok = run_case(&k, why, sizeof why);
  CHECK(ok, "alltoallv after a capacity error: the communicator still works%s%s", ok ? "" : ": ",
        why);
}

static void test_negative(void) {
  a2a_case k = {700, MIXED, MOELINK_DTYPE_F32, 0, 0, 0, nranks - 1};
  char why[300];
  int ok = run_case(&k, why, sizeof why);
  CHECK(ok,
        "alltoallv with rank 0's send_counts[%d] = -3: INVALID_ARGUMENT on rank 0, a count of 0 "
        "arrives, everything else intact%s%s",
        nranks - 1, ok ? "" : ": ", why);
}

static void test_back_to_back(void) {
  int fails = 0;
  char first_why[400] = "";
  double t0 = ct_now_ms();
  for (int i = 0; i < 100; ++i) {
    uint64_t r = ct_mix(4242, (uint64_t)i);
    a2a_case k = {10000 + (uint64_t)i, (size_kind)(r % 8 == 0 ? LARGE : r % 2 ? MIXED : SMALL),
                  dtypes[(r >> 8) % 3], (int)((r >> 12) & 1), (int64_t)((r >> 16) % 9), -1, -1};
    char why[300];
    if (!run_case(&k, why, sizeof why)) {
      if (!fails)
        snprintf(first_why, sizeof first_why, "call %d (%s): %s", i, moelink_dtype_name(k.dt),
                 why);
      ++fails;
    }
  }
  CHECK(fails == 0, "100 back-to-back alltoallv calls of random counts and dtypes: %d wrong%s%s",
        fails, fails ? "; first: " : "", first_why);
  ml_t_diag("100 back-to-back calls took %.0f ms", ct_now_ms() - t0);
}

/* The front end's checks fail on the calling rank alone, before any
 * exchange, so every rank can run them without the others. */
static void test_arguments(void) {
  float send[8] = {0}, recv[8];
  int64_t sc[64] = {0}, rc[64], ro[64];
  if (nranks > 64) return;
  const moelink_dtype_t f = MOELINK_DTYPE_F32;
  CHECK_STATUS(moelink_alltoallv(NULL, send, sc, NULL, recv, 8, rc, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: NULL communicator");
  CHECK_STATUS(moelink_alltoallv(comm, send, NULL, NULL, recv, 8, rc, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: NULL send_counts");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, recv, 8, NULL, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: NULL recv_counts");
  CHECK_STATUS(moelink_alltoallv(comm, NULL, sc, NULL, recv, 8, rc, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: NULL send");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, NULL, 8, rc, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: NULL recv with capacity 8");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, recv, 8, rc, ro, MOELINK_DTYPE_FP8_E4M3,
                                 NULL),
               MOELINK_ERR_UNSUPPORTED, "alltoallv: fp8");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, recv, 8, rc, ro, (moelink_dtype_t)9, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: unknown dtype");
  CHECK_STATUS(moelink_alltoallv(comm, (char *)send + 2, sc, NULL, recv, 8, rc, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: misaligned send");
  CHECK_STATUS(moelink_alltoallv(comm, recv + 3, sc, NULL, recv, 8, rc, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: send inside recv (in place)");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, recv, 8, sc, ro, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: recv_counts is send_counts");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, recv, 8, rc, rc, f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: recv_offsets is recv_counts");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, recv, 8, (int64_t *)(void *)recv, ro, f,
                                 NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: recv_counts inside recv");
  CHECK_STATUS(moelink_alltoallv(comm, send, sc, NULL, recv, 8, (int64_t *)((char *)rc + 4), ro,
                                 f, NULL),
               MOELINK_ERR_INVALID_ARGUMENT, "alltoallv: misaligned recv_counts");
  const char *msg = moelink_last_error();
  CHECK(strstr(msg, "aligned") != NULL, "the message says why: %s", msg);
}

int main(void) {
  ct_start(&ctx, &comm);
  rank = moelink_comm_rank(comm);
  nranks = moelink_comm_size(comm);
  ml_t_diag("rank %d of %d", rank, nranks);
  test_arguments();
  test_matrix();
  test_exact_capacity();
  test_overflow();
  test_negative();
  test_back_to_back();
  CHECK_OK(moelink_comm_check(comm, NULL), "comm_check reports no failure");
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy");
  moelink_context_destroy(ctx);
  return ml_test_done();
}
