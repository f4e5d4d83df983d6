/* `moelink launch`: the environment each rank gets, the "[rank R] " prefix on
 * both streams (partial and over-long lines included), exit codes (first
 * failing rank, signals, a command that cannot run, --timeout = 124, bad
 * arguments = 2 with one line), and that a failing rank or the timeout ends
 * the others: SIGTERM, then SIGKILL for a rank that ignores it. Runs the
 * launcher as a child process; the ranks are small shell commands. */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef ML_LAUNCHER
#error "ML_LAUNCHER (the moelink executable) must be defined by the build"
#endif

typedef struct result {
  int code; /* exit code, or 128 + signal */
  double seconds;
  char out[1 << 18], err[1 << 16];
  size_t out_len, err_len;
} result;

static result R;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Runs `moelink launch ARGS...` (NULL-terminated) and collects everything. */
static void launch(const char *first, ...) {
  const char *argv[64];
  int n = 0;
  argv[n++] = ML_LAUNCHER;
  argv[n++] = "launch";
  va_list ap;
  va_start(ap, first);
  for (const char *a = first; a && n < 63; a = va_arg(ap, const char *)) argv[n++] = a;
  va_end(ap);
  argv[n] = NULL;
  memset(&R, 0, sizeof R);
  int po[2], pe[2];
  if (pipe(po) || pipe(pe)) {
    printf("Bail out! pipe: %s\n", strerror(errno));
    exit(1);
  }
  double t0 = now_s();
  pid_t pid = fork();
  if (pid == 0) {
    dup2(po[1], 1);
    dup2(pe[1], 2);
    close(po[0]);
    close(pe[0]);
    execv(argv[0], (char *const *)argv);
    _exit(126);
  }
  close(po[1]);
  close(pe[1]);
  struct pollfd fds[2] = {{po[0], POLLIN, 0}, {pe[0], POLLIN, 0}};
  int open_fds = 2;
  while (open_fds > 0) {
    if (poll(fds, 2, 30000) <= 0) break; /* a launcher that hangs fails the checks below */
    for (int k = 0; k < 2; ++k) {
      if (fds[k].fd < 0 || !fds[k].revents) continue;
      char *buf = k ? R.err : R.out;
      size_t *len = k ? &R.err_len : &R.out_len;
      size_t cap = (k ? sizeof R.err : sizeof R.out) - 1;
      char scratch[4096];
      ssize_t got = *len < cap ? read(fds[k].fd, buf + *len, cap - *len)
                               : read(fds[k].fd, scratch, sizeof scratch);
      if (got <= 0) {
        close(fds[k].fd);
        fds[k].fd = -1;
        --open_fds;
      } else if (*len < cap) {
        *len += (size_t)got;
      }
    }
  }
  int st = 0;
  waitpid(pid, &st, 0);
  R.seconds = now_s() - t0;
  R.out[R.out_len] = '\0';
  R.err[R.err_len] = '\0';
  R.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static int count_lines(const char *s) {
  int n = 0;
  for (; *s; ++s) n += *s == '\n';
  return n;
}

/* Every line of s starts with "[rank " and s ends with a newline. */
static int all_prefixed(const char *s) {
  if (!*s) return 1;
  if (s[strlen(s) - 1] != '\n') return 0;
  for (const char *line = s; *line; line = strchr(line, '\n') + 1)
    if (strncmp(line, "[rank ", 6) != 0) return 0;
  return 1;
}

static void test_env_and_prefix(void) {
  setenv("CUDA_VISIBLE_DEVICES", "3,1", 1);
  setenv("MOELINK_RANK", "99", 1); /* the launcher's own values win */
  launch("-n", "3", "--", "sh", "-c",
         "echo \"env $MOELINK_RANK $MOELINK_WORLD_SIZE $MOELINK_LOCAL_RANK $CUDA_VISIBLE_DEVICES "
         "${#MOELINK_UNIQUE_ID} $MOELINK_UNIQUE_ID\"; echo \"err $MOELINK_RANK\" >&2",
         NULL);
  unsetenv("MOELINK_RANK");
  unsetenv("CUDA_VISIBLE_DEVICES");
  CHECK(R.code == 0, "3 ranks that exit 0 -> exit code %d", R.code);
  int env_ok = 1;
  char id0[300] = "";
  for (int r = 0; r < 3; ++r) {
    char want[128];
    snprintf(want, sizeof want, "[rank %d] env %d 3 %d 3,1 256 ", r, r, r);
    const char *at = strstr(R.out, want);
    if (!at) {
      env_ok = 0;
      ml_t_diag("missing '%s'", want);
      continue;
    }
    char id[300];
    sscanf(at + strlen(want), "%299s", id);
    if (r == 0) snprintf(id0, sizeof id0, "%s", id);
    if (strcmp(id, id0) != 0) env_ok = 0;
  }
  CHECK(env_ok, "each rank gets MOELINK_RANK, MOELINK_WORLD_SIZE, MOELINK_LOCAL_RANK, the same "
                "256-digit MOELINK_UNIQUE_ID, and CUDA_VISIBLE_DEVICES unchanged");
  CHECK(all_prefixed(R.out) && count_lines(R.out) == 3, "stdout: 3 lines, each '[rank R] ...'");
  CHECK(strstr(R.err, "[rank 0] err 0\n") && strstr(R.err, "[rank 2] err 2\n") &&
            all_prefixed(R.err) && count_lines(R.err) == 3,
        "stderr lines come out on stderr, prefixed");
}

static void test_lines(void) {
  launch("-n", "2", "--", "sh", "-c",
         "printf 'a\\nb\\n\\nno newline'; head -c 70000 /dev/zero | tr '\\0' x", NULL);
  CHECK(R.code == 0, "exit code %d", R.code);
  CHECK(all_prefixed(R.out), "every piece of output is on a prefixed line");
  CHECK(strstr(R.out, "[rank 1] a\n[rank 1] b\n[rank 1] \n") != NULL,
        "lines keep their order within a rank, empty lines included");
  size_t xs = 0;
  for (const char *p = R.out; *p; ++p) xs += *p == 'x';
  CHECK(xs == 140000, "a 70000-byte line without newline arrives whole, in pieces (%zu x)", xs);
  CHECK(strstr(R.out, "no newlinexxx") != NULL, "the partial line is continued, not lost");
}

static void test_failures(void) {
  launch("-n", "3", "--", "sh", "-c",
         "if [ $MOELINK_RANK = 1 ]; then sleep 0.3; exit 3; fi; exec sleep 30", NULL);
  CHECK(R.code == 3, "rank 1 exits 3 while the others sleep -> exit code %d", R.code);
  CHECK(R.seconds < 5.0, "the others are ended at once (%.1f s)", R.seconds);
  CHECK(strstr(R.err, "rank 1 exited with code 3") != NULL, "stderr names rank 1 and its code");

  launch("-n", "2", "--", "sh", "-c", "if [ $MOELINK_RANK = 0 ]; then kill -9 $$; fi; exit 0",
         NULL);
  CHECK(R.code == 128 + 9, "a rank killed by SIGKILL -> exit code %d (137)", R.code);
  CHECK(strstr(R.err, "rank 0 was killed by signal 9") != NULL, "stderr says so");

  launch("-n", "2", "--", "/nonexistent/moelink-test-command", NULL);
  CHECK(R.code == 127, "a command that cannot run -> exit code %d (127)", R.code);
  CHECK(strstr(R.err, "cannot run '/nonexistent/moelink-test-command'") != NULL,
        "stderr says it cannot run it");

  launch("-n", "2", "--timeout", "0.5", "--", "sleep", "30", NULL);
  CHECK(R.code == 124, "--timeout 0.5 on ranks that sleep 30 s -> exit code %d (124)", R.code);
  CHECK(R.seconds < 3.0, "ended soon after the timeout (%.1f s)", R.seconds);
  CHECK(strstr(R.err, "--timeout 0.5 s passed") != NULL, "stderr says the timeout passed");

  /* SIG_IGN survives exec, so sleep ignores SIGTERM too: only SIGKILL ends it. */
  launch("-n", "2", "--timeout", "0.3", "--", "sh", "-c", "trap '' TERM; sleep 20; exit 0", NULL);
  CHECK(R.code == 124, "ranks ignoring SIGTERM -> exit code %d (124)", R.code);
  CHECK(R.seconds >= 3.0 && R.seconds < 6.0,
        "SIGKILL follows SIGTERM after the 3 s grace period (%.1f s)", R.seconds);
  CHECK(strstr(R.err, "sending SIGKILL") != NULL, "stderr says SIGKILL was sent");
}

static void usage_case(const char *what, const char *needle, const char *a, const char *b,
                       const char *c, const char *d) {
  launch(a, b, c, d, NULL);
  CHECK(R.code == 2 && R.out_len == 0 && count_lines(R.err) == 1 &&
            strncmp(R.err, "moelink: error: launch: ", 24) == 0 && strstr(R.err, needle),
        "%s -> exit %d, one line: %.*s", what, R.code, (int)strcspn(R.err, "\n"), R.err);
}

static void test_usage(void) {
  usage_case("no -n", "-n N is required", "--", "true", NULL, NULL);
  usage_case("-n 0", "expected a number of ranks in 1..256, got '0'", "-n", "0", "true", NULL);
  usage_case("-n x", "got 'x'", "-n", "x", "--", "true");
  usage_case("-n 257", "got '257'", "-n", "257", "true", NULL);
  usage_case("no command", "no command given", "-n", "2", "--", NULL);
  usage_case("--timeout -1", "--timeout: expected a positive number of seconds", "-n2",
             "--timeout=-1", "true", NULL);
  usage_case("--backend tpu", "expected cpu or cuda, got 'tpu'", "-n", "1", "--backend", "tpu");
  usage_case("unknown option", "unknown option '--frobnicate'", "-n", "1", "--frobnicate",
             "true");
  usage_case("-n without value", "-n needs a value", "-n", NULL, NULL, NULL);
  launch("--help", NULL);
  CHECK(R.code == 0 && strstr(R.out, "moelink launch -n N") != NULL, "--help -> exit %d, usage",
        R.code);
  launch("--nranks=2", "true", NULL);
  CHECK(R.code == 0 && R.out_len == 0 && R.err_len == 0,
        "--nranks=2 and a command without '--' work (exit %d)", R.code);
}

int main(void) {
  test_env_and_prefix();
  test_lines();
  test_failures();
  test_usage();
  return ml_test_done();
}
