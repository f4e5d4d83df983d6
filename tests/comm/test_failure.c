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
 *             about 1 s, naming rank 0 */
#include "comm_test.h"

#include <dirent.h>
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
    else {
      printf("Bail out! unknown mode '%s' (exit, hang, mismatch, init, noroot)\n", mode);
      return 1;
    }
  }
  moelink_context_destroy(ctx);
  return ml_test_done();
}
