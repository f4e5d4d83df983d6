/* A communicator never hangs: failures of one rank reach the others as
 * errors, quickly. Run under `moelink launch -n N` (N >= 2) with
 * MOELINK_COMM_TIMEOUT_MS=1000 and one mode:
 *   exit      rank 1 exits (status 0) before a collective: the others get
 *             MOELINK_ERR_TIMEOUT naming rank 1 well within 2 s
 *   hang      rank 1 is alive but late by more than the timeout: the others
 *             get MOELINK_ERR_TIMEOUT after about 1 s, rank 1 then fails at
 *             once instead of waiting for peers that gave up
 *   mismatch  rank 1 calls allreduce with another count: every rank gets
 *             MOELINK_ERR_INVALID_ARGUMENT saying so, without waiting
 *   init      rank 1 joins with another nranks: it is told so, the others
 *             time out of init naming rank 1, and no shared memory is left
 *   noroot    rank 0 never calls init: the others time out of init after
 *             about 1 s, naming rank 0
 *   ep-exit   every rank runs two expert-parallel forwards (checked against
 *             the naive reference), then the last rank exits (status 0): the
 *             others' next forward gets MOELINK_ERR_TIMEOUT naming it well
 *             within 2 s, and the layer and the communicator still go away
 *   tp-exit   the same with moelink_gemm_ar (exact integer inputs) */
#include "comm_test.h"

#include <dirent.h>
#include <math.h>
#include <unistd.h>

static moelink_context_t ctx;
static moelink_comm_t comm;
static int rank, nranks;

/* Shared memory segments this launch's id names ("moelink-<launcher pid>-"). */
static int leftover_segments(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "moelink-%d-", (int)getppid());
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) {
      ml_t_diag("left over: /dev/shm/%s", e->d_name);
      ++n;
    }
  closedir(d);
  return n;
}

static moelink_status_t allreduce8(size_t count, double *ms) {
  float x[16], y[16];
  for (int i = 0; i < 16; ++i) x[i] = (float)(rank + i);
  double t0 = ct_now_ms();
  moelink_status_t s = moelink_allreduce(comm, x, y, count, MOELINK_DTYPE_F32, NULL);
  *ms = ct_now_ms() - t0;
  return s;
}

static void expect_failed(moelink_status_t want, const char *needle) {
  moelink_status_t s = moelink_comm_check(comm, NULL);
  CHECK(s == want && strstr(moelink_last_error(), needle) != NULL,
        "comm_check reports the recorded failure: %s: %s", moelink_status_string(s),
        moelink_last_error());
  double ms;
  s = allreduce8(8, &ms);
  CHECK(s == want && ms < 100.0, "a later collective fails at once (%.0f ms): %s",
        ms, moelink_status_string(s));
  double t0 = ct_now_ms();
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy of a failed communicator");
  CHECK(ct_now_ms() - t0 < 500.0, "and it does not wait for the missing rank (%.0f ms)",
        ct_now_ms() - t0);
}

static void mode_exit(void) {
  double ms;
  CHECK_OK(allreduce8(8, &ms), "a first allreduce with every rank");
  if (rank == 1) {
    CHECK(1, "rank 1 leaves without a word");
    int rc = ml_test_done();
    fflush(stdout);
    _exit(rc);
  }
  moelink_status_t s = allreduce8(8, &ms);
  const char *m = moelink_last_error();
  CHECK(s == MOELINK_ERR_TIMEOUT, "allreduce without rank 1 -> %s: %s",
        moelink_status_string(s), m);
  CHECK(strstr(m, "from rank 1") != NULL && strstr(m, "allreduce") != NULL,
        "the message names the collective and rank 1");
  CHECK(ms < 2000.0, "within 2 s of the collective (%.0f ms; limit 1000 ms)", ms);
  expect_failed(MOELINK_ERR_TIMEOUT, "rank 1");
}

static void mode_hang(void) {
  double ms;
  CHECK_OK(allreduce8(8, &ms), "a first allreduce with every rank");
  if (rank == 1) {
    usleep(1600 * 1000);
    moelink_status_t s = allreduce8(8, &ms);
    CHECK(s == MOELINK_ERR_TIMEOUT && ms < 100.0,
          "late rank 1 fails at once (%.0f ms) since its peers gave up: %s: %s", ms,
          moelink_status_string(s), moelink_last_error());
    expect_failed(MOELINK_ERR_TIMEOUT, "from rank 1");
    return;
  }
  moelink_status_t s = allreduce8(8, &ms);
  const char *m = moelink_last_error();
  CHECK(s == MOELINK_ERR_TIMEOUT, "allreduce while rank 1 sleeps -> %s: %s",
        moelink_status_string(s), m);
  CHECK(strstr(m, "waited") != NULL && strstr(m, "for allreduce data (value 2) from rank 1"),
        "the message says who waited how long for which signal value from rank 1");
  CHECK(ms >= 950.0 && ms < 2000.0, "after the 1000 ms limit, not much later (%.0f ms)", ms);
  expect_failed(MOELINK_ERR_TIMEOUT, "from rank 1");
}

static void mode_mismatch(void) {
  double ms;
  moelink_status_t s = allreduce8(rank == 1 ? 9 : 8, &ms);
  const char *m = moelink_last_error();
  CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(m, "does not match"),
        "allreduce count %d on rank 1, 8 elsewhere -> %s: %s", 9, moelink_status_string(s), m);
  CHECK(ms < 900.0, "found without waiting for the timeout (%.0f ms)", ms);
  expect_failed(MOELINK_ERR_INVALID_ARGUMENT, "does not match");
}

static void mode_init(void) {
  const char *hex = getenv("MOELINK_UNIQUE_ID");
  moelink_unique_id_t id;
  CHECK_OK(moelink_unique_id_from_hex(hex ? hex : "", &id), "the launcher's id parses");
  int r = atoi(getenv("MOELINK_RANK"));
  int n = atoi(getenv("MOELINK_WORLD_SIZE"));
  double t0 = ct_now_ms();
  moelink_status_t s = moelink_comm_init(ctx, r, r == 1 ? n + 1 : n, &id, &comm);
  double ms = ct_now_ms() - t0;
  const char *m = moelink_last_error();
  if (r == 1) {
    char want[96];
    snprintf(want, sizeof want, "nranks %d does not match rank 0's nranks %d", n + 1, n);
    CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && strstr(m, want),
          "rank 1 with nranks %d -> %s: %s", n + 1, moelink_status_string(s), m);
  } else {
    CHECK(s == MOELINK_ERR_TIMEOUT && strstr(m, "init") && strstr(m, "rank 1"),
          "rank %d: init without rank 1 -> %s: %s", r, moelink_status_string(s), m);
    CHECK(ms < 2500.0, "gives up after the 1000 ms limit (%.0f ms)", ms);
  }
  CHECK(comm == NULL, "no communicator comes out of a failed init");
  if (r == 0) CHECK(leftover_segments() == 0, "rank 0 left no shared memory behind");
}

static void mode_noroot(void) {
  int r = atoi(getenv("MOELINK_RANK"));
  if (r == 0) {
    CHECK(1, "rank 0 stays away");
    usleep(1500 * 1000);
    return;
  }
  double t0 = ct_now_ms();
  moelink_status_t s = moelink_comm_init_from_env(ctx, &comm);
  double ms = ct_now_ms() - t0;
  const char *m = moelink_last_error();
  CHECK(s == MOELINK_ERR_TIMEOUT && strstr(m, "for init (value") && strstr(m, "from rank 0"),
        "init without rank 0 -> %s: %s", moelink_status_string(s), m);
  CHECK(ms >= 950.0 && ms < 2500.0, "after the 1000 ms limit (%.0f ms)", ms);
  CHECK(comm == NULL, "no communicator comes out of it");
}

/* The last rank dies between two calls without a word; its own checks so
 * far decide its exit status, so a pass means the survivors' checks held. */
static void last_rank_leaves(const char *what) {
  CHECK(1, "rank %d leaves before the next %s", rank, what);
  int rc = ml_test_done();
  fflush(stdout);
  _exit(rc);
}

/* A survivor's call (s, taking ms) after the last rank left: it failed in
 * time, naming that rank as gone and what the call awaited. A second call
 * fails at once, destroy (the object's own, then expect_failed's) too. */
static void expect_dead_last(moelink_status_t s, double ms, const char *call, const char *awaited,
                             moelink_status_t (*again)(double *),
                             moelink_status_t (*destroy)(void)) {
  const char *m = moelink_last_error();
  char gone[32];
  snprintf(gone, sizeof gone, "rank %d (pid", nranks - 1);
  CHECK(s == MOELINK_ERR_TIMEOUT, "%s without rank %d -> %s: %s", call, nranks - 1,
        moelink_status_string(s), m);
  CHECK(strstr(m, gone) && strstr(m, "has exited") && strstr(m, awaited),
        "the message says rank %d exited and names what was awaited (%s)", nranks - 1, awaited);
  CHECK(ms < 2000.0, "within 2 s of the call (%.0f ms; limit 1000 ms)", ms);
  s = again(&ms);
  CHECK(s == MOELINK_ERR_TIMEOUT && ms < 100.0, "a later %s fails at once (%.0f ms): %s", call, ms,
        moelink_status_string(s));
  double t0 = ct_now_ms();
  CHECK_OK(destroy(), "destroy after the failure");
  CHECK(ct_now_ms() - t0 < 500.0, "and it does not wait for rank %d (%.0f ms)", nranks - 1,
        ct_now_ms() - t0);
  expect_failed(MOELINK_ERR_TIMEOUT, gone);
  if (rank == 0) CHECK(leftover_segments() == 0, "no shared memory is left behind");
}

static moelink_ep_t ep;
static ref_layer layer;
static float ep_x[8 * 64], ep_out[8 * 64];

/* One forward of this rank's tokens of call `call` (0 to 8 of them). */
static moelink_status_t ep_call(int call, int *tokens, double *ms) {
  const int H = layer.cfg.hidden, t = (3 * rank + 5 * call) % 9;
  if (t > 0 && moelink_fill_random(ctx, MOELINK_DTYPE_F32, ep_x, (size_t)t * H,
                                   ct_seed((uint64_t)call, rank), 1.0f, 0.0f,
                                   NULL) != MOELINK_SUCCESS)
    CHECK(0, "fill x: %s", moelink_last_error());
  for (size_t i = 0; i < sizeof ep_out / sizeof *ep_out; ++i) ep_out[i] = NAN;
  *tokens = t;
  double t0 = ct_now_ms();
  moelink_status_t s = moelink_ep_forward(ep, ep_x, t, ep_out, NULL);
  *ms = ct_now_ms() - t0;
  return s;
}

static moelink_status_t ep_again(double *ms) {
  int t;
  return ep_call(3, &t, ms);
}

static moelink_status_t ep_gone(void) { return moelink_ep_destroy(ep); }

static void mode_ep_exit(void) {
  moelink_ep_config_t cfg = MOELINK_EP_CONFIG_INIT;
  moelink_moe_config_t *c = &cfg.moe;
  c->hidden = 64;
  c->inter = 32;
  c->num_experts = 24;
  c->top_k = 2;
  c->dtype = MOELINK_DTYPE_F32;
  c->max_tokens = 8;
  if (ref_layer_make(&layer, c, 77, 0.0) != 0) {
    printf("Bail out! ref_layer_make\n");
    exit(1);
  }
  CHECK_OK(moelink_ep_create(comm, &cfg, &ep), "ep_create (E 24, k 2, H 64, I 32, f32)");
  const int first = rank * (24 / nranks);
  moelink_moe_weights_t w = layer.w;
  w.gate_up = (const float *)layer.gate_up + (size_t)first * 2 * 32 * 64;
  w.down = (const float *)layer.down + (size_t)first * 64 * 32;
  CHECK_OK(moelink_ep_set_weights(ep, &w), "ep_set_weights (this rank's slice of the experts)");
  for (int call = 0; call < 2; ++call) {
    int t;
    double ms, want[8 * 64];
    moelink_status_t s = ep_call(call, &t, &ms);
    CHECK(s == MOELINK_SUCCESS, "forward %d with every rank%s%s", call, s ? ": " : "",
          s ? moelink_last_error() : "");
    for (int i = 0; i < t; ++i)
      if (ref_forward_token(c, &layer.w, ep_x + (size_t)i * 64, want + (size_t)i * 64) != 0)
        CHECK(0, "ref_forward_token");
    const double rel = ref_rel_l2(MOELINK_DTYPE_F32, ep_out, want, (size_t)t * 64);
    CHECK(rel <= 1e-5, "forward %d: %d tokens match the reference (rel L2 %.2g)", call, t, rel);
  }
  if (rank == nranks - 1) last_rank_leaves("ep_forward");
  int t;
  double ms;
  moelink_status_t s = ep_call(2, &t, &ms);
  expect_dead_last(s, ms, "ep_forward", "ep: ", ep_again, ep_gone);
  ref_layer_free(&layer);
}

static moelink_tp_t tp;
static float tp_a[5 * 9], tp_b[7 * 9], tp_c[5 * 7];

/* gemm_ar of [5, 9] by [7, 9]^T: small integers, so every sum is exact. */
static double tp_in(int r, int mat, int i, int l) {
  return mat ? (double)((3 * i + l + 2 * r) % 4 - 1) : (double)((i + 2 * l + r) % 5 - 2);
}

static moelink_status_t tp_call(double *ms) {
  for (int i = 0; i < 5 * 9; ++i) tp_a[i] = (float)tp_in(rank, 0, i / 9, i % 9);
  for (int i = 0; i < 7 * 9; ++i) tp_b[i] = (float)tp_in(rank, 1, i / 9, i % 9);
  for (int i = 0; i < 5 * 7; ++i) tp_c[i] = NAN;
  double t0 = ct_now_ms();
  moelink_status_t s = moelink_gemm_ar(tp, tp_a, tp_b, tp_c, 5, 7, 9, NULL);
  *ms = ct_now_ms() - t0;
  return s;
}

static moelink_status_t tp_gone(void) { return moelink_tp_destroy(tp); }

static void mode_tp_exit(void) {
  moelink_tp_config_t cfg = MOELINK_TP_CONFIG_INIT;
  cfg.dtype = MOELINK_DTYPE_F32;
  cfg.max_m = 8;
  cfg.max_n = 16;
  cfg.max_k = 16;
  CHECK_OK(moelink_tp_create(comm, &cfg, &tp), "tp_create (f32)");
  for (int call = 0; call < 2; ++call) {
    double ms;
    moelink_status_t s = tp_call(&ms);
    CHECK(s == MOELINK_SUCCESS, "gemm_ar %d with every rank%s%s", call, s ? ": " : "",
          s ? moelink_last_error() : "");
    int bad = -1;
    for (int e = 0; e < 5 * 7 && bad < 0; ++e) {
      double want = 0.0;
      for (int r = 0; r < nranks; ++r)
        for (int l = 0; l < 9; ++l) want += tp_in(r, 0, e / 7, l) * tp_in(r, 1, e % 7, l);
      if (!(tp_c[e] == (float)want)) bad = e;
    }
    CHECK(bad < 0, "gemm_ar %d: c is the exact sum over ranks (first wrong element %d)", call,
          bad);
  }
  if (rank == nranks - 1) last_rank_leaves("gemm_ar");
  double ms;
  moelink_status_t s = tp_call(&ms);
  expect_dead_last(s, ms, "gemm_ar", "allreduce", tp_call, tp_gone);
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  const char *limit = getenv("MOELINK_COMM_TIMEOUT_MS");
  if (!limit || strcmp(limit, "1000") != 0) {
    printf("Bail out! run with MOELINK_COMM_TIMEOUT_MS=1000 (got %s)\n", limit ? limit : "none");
    return 1;
  }
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.num_threads = 1;
  if (moelink_context_create(&cc, &ctx) != MOELINK_SUCCESS) return 1;
  if (strcmp(mode, "init") == 0) {
    mode_init();
  } else if (strcmp(mode, "noroot") == 0) {
    mode_noroot();
  } else {
    if (moelink_comm_init_from_env(ctx, &comm) != MOELINK_SUCCESS) {
      printf("Bail out! comm_init_from_env: %s\n", moelink_last_error());
      return 1;
    }
    rank = moelink_comm_rank(comm);
    nranks = moelink_comm_size(comm);
    if (nranks < 2) {
      printf("Bail out! mode %s needs at least 2 ranks\n", mode);
      return 1;
    }
    if (strcmp(mode, "exit") == 0)
      mode_exit();
    else if (strcmp(mode, "hang") == 0)
      mode_hang();
    else if (strcmp(mode, "mismatch") == 0)
      mode_mismatch();
    else if (strcmp(mode, "ep-exit") == 0)
      mode_ep_exit();
    else if (strcmp(mode, "tp-exit") == 0)
      mode_tp_exit();
    else {
      printf("Bail out! unknown mode '%s' (exit, hang, mismatch, init, noroot, ep-exit, "
             "tp-exit)\n", mode);
      return 1;
    }
  }
  moelink_context_destroy(ctx);
  return ml_test_done();
}
