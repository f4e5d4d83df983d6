/* `moelink launch -n N -- CMD ARGS...`: N local ranks of one command.
 *
 * Each rank is a child in its own process group (so ending a rank ends what
 * it started too), with MOELINK_RANK, MOELINK_WORLD_SIZE, MOELINK_LOCAL_RANK
 * and MOELINK_UNIQUE_ID in its environment and stdin from /dev/null. Its
 * stdout and stderr come back through pipes and are written line by line,
 * each line prefixed with "[rank R] ", to the launcher's stdout and stderr.
 * The first rank that fails (non-zero exit or a signal), the --timeout, or a
 * signal to the launcher ends the others: SIGTERM, then SIGKILL after a
 * grace period. */
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define LAUNCH_MAX_RANKS 256
/* Seconds a rank gets between SIGTERM and SIGKILL. */
#define LAUNCH_GRACE_S 3.0
/* After the last rank exited, output may still come from processes it left
 * behind holding the pipes; it is read for at most this long. */
#define LAUNCH_DRAIN_S 1.0
/* A line longer than this is passed on in pieces. */
#define LAUNCH_LINE_MAX 65536
#define LAUNCH_POLL_MS 50

static const char launch_usage_text[] =
    "moelink launch -n N [--timeout S] [--backend cpu|cuda] -- CMD [ARGS...]\n"
    "  Starts N processes of CMD on this machine, one per rank (one per GPU on cuda),\n"
    "  with MOELINK_RANK (0..N-1), MOELINK_WORLD_SIZE (N), MOELINK_LOCAL_RANK (the\n"
    "  rank: ranks pick their GPU by it; CUDA_VISIBLE_DEVICES is passed unchanged) and\n"
    "  MOELINK_UNIQUE_ID (a fresh communicator id in hex) set, for\n"
    "  moelink_comm_init_from_env. Each line a rank writes to stdout or stderr comes\n"
    "  out on the same stream prefixed with \"[rank R] \"; ranks read stdin from\n"
    "  /dev/null. When a rank fails, or --timeout passes, the other ranks get SIGTERM\n"
    "  and, 3 s later, SIGKILL.\n"
    "  -n, --nranks N         ranks to start (1..256)\n"
    "  --timeout S            end all ranks after S seconds (default: no limit)\n"
    "  --backend cpu|cuda     backend of the communicator id (default cpu)\n"
    "  exit code: 0 when every rank exits 0; else the exit code of the first rank that\n"
    "  failed (128 + signal number if a signal ended it, 127 if CMD could not be run),\n"
    "  124 when --timeout passed, 2 for bad arguments\n";

void cli_help_launch(void) { fputs(launch_usage_text, stdout); }

typedef struct launch_stream {
  int fd;  /* read end of the rank's pipe, -1 once closed */
  int out; /* 1 or 2 */
  char *buf;
  size_t len;
} launch_stream;

typedef struct launch_rank {
  pid_t pid;
  int running;
  launch_stream s[2];
  char **env;
} launch_rank;

static volatile sig_atomic_t launch_signal, launch_signals;

static void launch_on_signal(int sig) {
  launch_signal = sig;
  ++launch_signals;
}

static void launch_write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return; /* a closed stdout (| head) must not stop the ranks */
    p += w;
    n -= (size_t)w;
  }
}

/* One line (without its newline) with the rank prefix, in one write so that
 * lines of different ranks never mix. */
static void launch_emit(int rank, int out, const char *line, size_t n) {
  static char buf[LAUNCH_LINE_MAX + 32];
  int p = snprintf(buf, 32, "[rank %d] ", rank);
  memcpy(buf + p, line, n);
  buf[(size_t)p + n] = '\n';
  launch_write_all(out, buf, (size_t)p + n + 1);
}

static void launch_close_stream(int rank, launch_stream *s) {
  if (s->len) launch_emit(rank, s->out, s->buf, s->len);
  s->len = 0;
  if (s->fd >= 0) close(s->fd);
  s->fd = -1;
}

static void launch_read(int rank, launch_stream *s) {
  ssize_t n = read(s->fd, s->buf + s->len, LAUNCH_LINE_MAX - s->len);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {
    launch_close_stream(rank, s);
    return;
  }
  s->len += (size_t)n;
  size_t start = 0;
  for (size_t i = s->len - (size_t)n; i < s->len; ++i) {
    if (s->buf[i] != '\n') continue;
    launch_emit(rank, s->out, s->buf + start, i - start);
    start = i + 1;
  }
  if (start == 0 && s->len == LAUNCH_LINE_MAX) {
    launch_emit(rank, s->out, s->buf, s->len);
    start = s->len;
  }
  memmove(s->buf, s->buf + start, s->len - start);
  s->len -= start;
}

static double launch_parse_seconds(const char *opt, const char *v) {
  char *end = NULL;
  errno = 0;
  double x = v && *v ? strtod(v, &end) : NAN;
  if (!v || !*v || errno || *end || !(x > 0.0) || !isfinite(x) || x > 1e9)
    cli_usage_error("launch: %s: expected a positive number of seconds, got '%s'", opt,
                    v ? v : "");
  return x;
}

static int launch_parse_ranks(const char *opt, const char *v) {
  char *end = NULL;
  errno = 0;
  long x = v && *v ? strtol(v, &end, 10) : 0;
  if (!v || !*v || errno || *end || x < 1 || x > LAUNCH_MAX_RANKS)
    cli_usage_error("launch: %s: expected a number of ranks in 1..%d, got '%s'", opt,
                    LAUNCH_MAX_RANKS, v ? v : "");
  return (int)x;
}

/* The value of an option given as "--opt V", "--opt=V" or (short) "-nV". */
static const char *launch_value(int argc, char **argv, int *i, const char *opt) {
  const char *a = argv[*i];
  size_t len = strlen(opt);
  if (a[len] == '=') return a + len + 1;
  if (a[len] != '\0') return a + len; /* -n4 */
  if (*i + 1 >= argc) cli_usage_error("launch: %s needs a value", opt);
  return argv[++*i];
}

static int launch_is(const char *arg, const char *opt, int short_glued) {
  size_t len = strlen(opt);
  if (strncmp(arg, opt, len) != 0) return 0;
  return arg[len] == '\0' || arg[len] == '=' || (short_glued && arg[len] != '\0');
}

static char **launch_env(int rank, int nranks, const char *hex) {
  static const char *const ours[] = {"MOELINK_RANK=", "MOELINK_WORLD_SIZE=",
                                     "MOELINK_LOCAL_RANK=", "MOELINK_UNIQUE_ID="};
  size_t n = 0;
  while (environ[n]) ++n;
  char **env = (char **)cli_malloc((n + 5) * sizeof *env, "the ranks' environment");
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    int skip = 0;
    for (size_t j = 0; j < sizeof ours / sizeof ours[0]; ++j)
      if (strncmp(environ[i], ours[j], strlen(ours[j])) == 0) skip = 1;
    if (!skip) env[k++] = environ[i];
  }
  char tmp[2 * MOELINK_UNIQUE_ID_BYTES + 64];
  snprintf(tmp, sizeof tmp, "MOELINK_RANK=%d", rank);
  env[k++] = strdup(tmp);
  snprintf(tmp, sizeof tmp, "MOELINK_WORLD_SIZE=%d", nranks);
  env[k++] = strdup(tmp);
  snprintf(tmp, sizeof tmp, "MOELINK_LOCAL_RANK=%d", rank);
  env[k++] = strdup(tmp);
  snprintf(tmp, sizeof tmp, "MOELINK_UNIQUE_ID=%s", hex);
  env[k++] = strdup(tmp);
  env[k] = NULL;
  for (size_t i = k - 4; i < k; ++i)
    if (!env[i]) cli_fail("out of host memory building the ranks' environment");
  return env;
}

/* Between fork and exec only async-signal-safe calls. */
static void launch_child(launch_rank *r, int out_w, int err_w, char **cmd, pid_t launcher) {
  /* A launcher that is killed outright (a test harness timeout) must not
   * leave its ranks running. */
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != launcher) _exit(128 + SIGTERM);
  signal(SIGPIPE, SIG_DFL); /* an ignored signal would stay ignored across exec */
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
  setpgid(0, 0);
  int in = open("/dev/null", O_RDONLY);
  if (in >= 0) dup2(in, 0);
  dup2(out_w, 1);
  dup2(err_w, 2);
  execvpe(cmd[0], cmd, r->env);
  int e = errno;
  static const char pre[] = "moelink: launch: cannot run '";
  launch_write_all(2, pre, sizeof pre - 1);
  launch_write_all(2, cmd[0], strlen(cmd[0]));
  launch_write_all(2, "': ", 3);
  const char *why = strerror(e);
  launch_write_all(2, why, strlen(why));
  launch_write_all(2, "\n", 1);
  _exit(127);
}

/* "rank 2" or "ranks 0, 3": the ranks still running. */
static void launch_list(const launch_rank *ranks, int n, char *buf, size_t size) {
  int count = 0;
  for (int i = 0; i < n; ++i) count += ranks[i].running;
  int len = snprintf(buf, size, "%s", count == 1 ? "rank " : "ranks ");
  for (int i = 0, shown = 0; i < n; ++i) {
    if (!ranks[i].running) continue;
    int w = snprintf(buf + len, size - (size_t)len, "%s%d", shown++ ? ", " : "", i);
    if (w < 0 || (size_t)w >= size - (size_t)len) break;
    len += w;
  }
}

static void launch_signal_all(launch_rank *ranks, int n, int sig) {
  for (int i = 0; i < n; ++i) {
    if (!ranks[i].running) continue;
    /* The group reaches what the rank started; the pid covers a child that
     * had not made its group yet. Both stay ours while it is unreaped. */
    kill(-ranks[i].pid, sig);
    kill(ranks[i].pid, sig);
  }
}

int cli_cmd_launch(int argc, char **argv) {
  int nranks = 0;
  double timeout_s = 0.0;
  moelink_backend_t backend = MOELINK_BACKEND_CPU;
  int i = 0;
  for (; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "--") == 0) {
      ++i;
      break;
    }
    if (a[0] != '-') break;
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      cli_help_launch();
      return 0;
    } else if (launch_is(a, "--nranks", 0)) {
      nranks = launch_parse_ranks("--nranks", launch_value(argc, argv, &i, "--nranks"));
    } else if (launch_is(a, "-n", 1)) {
      nranks = launch_parse_ranks("-n", launch_value(argc, argv, &i, "-n"));
    } else if (launch_is(a, "--timeout", 0)) {
      timeout_s = launch_parse_seconds("--timeout", launch_value(argc, argv, &i, "--timeout"));
    } else if (launch_is(a, "--backend", 0)) {
      const char *v = launch_value(argc, argv, &i, "--backend");
      if (strcmp(v, "cpu") == 0)
        backend = MOELINK_BACKEND_CPU;
      else if (strcmp(v, "cuda") == 0)
        backend = MOELINK_BACKEND_CUDA;
      else
        cli_usage_error("launch: --backend: expected cpu or cuda, got '%s'", v);
    } else {
      cli_usage_error("launch: unknown option '%s' (moelink launch --help)", a);
    }
  }
  if (nranks == 0) cli_usage_error("launch: -n N is required (moelink launch -n N -- CMD ARGS...)");
  if (i >= argc)
    cli_usage_error("launch: no command given (moelink launch -n %d -- CMD ARGS...)", nranks);
  char **cmd = argv + i;

  /* The id: through the public API, so a CUDA build makes an NCCL one. */
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = backend;
  cc.num_threads = 1;
  moelink_context_t ctx = NULL;
  CLI_CALL("moelink_context_create", moelink_context_create(&cc, &ctx));
  moelink_unique_id_t id;
  char hex[2 * MOELINK_UNIQUE_ID_BYTES + 1];
  CLI_CALL("moelink_get_unique_id", moelink_get_unique_id(ctx, &id));
  CLI_CALL("moelink_unique_id_to_hex", moelink_unique_id_to_hex(&id, hex, sizeof hex));
  moelink_context_destroy(ctx);

  launch_rank *ranks = (launch_rank *)cli_malloc((size_t)nranks * sizeof *ranks, "ranks");
  for (int r = 0; r < nranks; ++r) {
    ranks[r].pid = -1;
    ranks[r].running = 0;
    ranks[r].env = launch_env(r, nranks, hex);
    for (int k = 0; k < 2; ++k) {
      ranks[r].s[k].fd = -1;
      ranks[r].s[k].out = k + 1;
      ranks[r].s[k].len = 0;
      ranks[r].s[k].buf = (char *)cli_malloc(LAUNCH_LINE_MAX, "output buffers");
    }
  }

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = launch_on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  fflush(stdout);
  fflush(stderr);

  int code = 0, terminating = 0, killed = 0, running = 0;
  double t0 = cli_now(), kill_at = 0.0, drain_until = 0.0;
  char list[1024];

  for (int r = 0; r < nranks; ++r) {
    int po[2], pe[2];
    if (pipe2(po, O_CLOEXEC) != 0 || pipe2(pe, O_CLOEXEC) != 0) {
      fprintf(stderr, "moelink: launch: cannot make pipes for rank %d: %s\n", r, strerror(errno));
      code = CLI_EXIT_FAIL;
      break;
    }
    pid_t self = getpid();
    pid_t pid = fork();
    if (pid == 0) launch_child(&ranks[r], po[1], pe[1], cmd, self);
    close(po[1]);
    close(pe[1]);
    if (pid < 0) {
      fprintf(stderr, "moelink: launch: cannot start rank %d: %s\n", r, strerror(errno));
      close(po[0]);
      close(pe[0]);
      code = CLI_EXIT_FAIL;
      break;
    }
    setpgid(pid, pid); /* also in the child: whichever runs first */
    ranks[r].pid = pid;
    ranks[r].running = 1;
    ranks[r].s[0].fd = po[0];
    ranks[r].s[1].fd = pe[0];
    ++running;
  }
  if (code != 0) {
    terminating = 1;
    kill_at = cli_now() + LAUNCH_GRACE_S;
    launch_signal_all(ranks, nranks, SIGTERM);
  }

  struct pollfd *fds = (struct pollfd *)cli_malloc((size_t)nranks * 2 * sizeof *fds, "poll");
  int *owner = (int *)cli_malloc((size_t)nranks * 2 * sizeof *owner, "poll");
  for (;;) {
    int nfds = 0;
    for (int r = 0; r < nranks; ++r)
      for (int k = 0; k < 2; ++k)
        if (ranks[r].s[k].fd >= 0) {
          fds[nfds].fd = ranks[r].s[k].fd;
          fds[nfds].events = POLLIN;
          fds[nfds].revents = 0;
          owner[nfds++] = r * 2 + k;
        }
    double now = cli_now();
    if (running == 0) {
      if (nfds == 0) break;
      if (drain_until == 0.0) drain_until = now + LAUNCH_DRAIN_S;
      if (now >= drain_until) break;
    }
    int got = poll(fds, (nfds_t)nfds, LAUNCH_POLL_MS);
    for (int f = 0; got > 0 && f < nfds; ++f)
      if (fds[f].revents) launch_read(owner[f] / 2, &ranks[owner[f] / 2].s[owner[f] % 2]);

    for (int r = 0; r < nranks; ++r) {
      if (!ranks[r].running) continue;
      int st;
      pid_t w = waitpid(ranks[r].pid, &st, WNOHANG);
      if (w != ranks[r].pid) continue;
      ranks[r].running = 0;
      --running;
      int failed = !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
      if (!failed || terminating) continue;
      /* Output already read shows before the verdict. */
      for (int k = 0; k < 2; ++k)
        if (ranks[r].s[k].len) {
          launch_emit(r, ranks[r].s[k].out, ranks[r].s[k].buf, ranks[r].s[k].len);
          ranks[r].s[k].len = 0;
        }
      launch_list(ranks, nranks, list, sizeof list);
      if (WIFEXITED(st)) {
        code = WEXITSTATUS(st);
        fprintf(stderr, "moelink: launch: rank %d exited with code %d%s%s\n", r, code,
                running ? "; ending " : "", running ? list : "");
      } else {
        int sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
        code = 128 + sig;
        fprintf(stderr, "moelink: launch: rank %d was killed by signal %d (%s)%s%s\n", r, sig,
                strsignal(sig), running ? "; ending " : "", running ? list : "");
      }
      terminating = 1;
      kill_at = cli_now() + LAUNCH_GRACE_S;
      launch_signal_all(ranks, nranks, SIGTERM);
    }

    now = cli_now();
    if (!terminating && timeout_s > 0.0 && now - t0 >= timeout_s && running > 0) {
      launch_list(ranks, nranks, list, sizeof list);
      fprintf(stderr, "moelink: launch: --timeout %g s passed; ending %s\n", timeout_s,
              list);
      code = 124;
      terminating = 1;
      kill_at = now + LAUNCH_GRACE_S;
      launch_signal_all(ranks, nranks, SIGTERM);
    }
    if (!terminating && launch_signal) {
      int sig = (int)launch_signal;
      launch_list(ranks, nranks, list, sizeof list);
      fprintf(stderr, "moelink: launch: got signal %d (%s); ending %s\n", sig,
              strsignal(sig), list);
      code = 128 + sig;
      terminating = 1;
      kill_at = now + LAUNCH_GRACE_S;
      launch_signal_all(ranks, nranks, SIGTERM);
    }
    /* A second interrupt does not wait for the grace period. */
    if (terminating && !killed && launch_signals >= 2) kill_at = now;
    if (terminating && !killed && running > 0 && now >= kill_at) {
      launch_list(ranks, nranks, list, sizeof list);
      fprintf(stderr, "moelink: launch: %s still running %g s after SIGTERM; sending SIGKILL\n",
              list, LAUNCH_GRACE_S);
      launch_signal_all(ranks, nranks, SIGKILL);
      killed = 1;
    }
  }
  for (int r = 0; r < nranks; ++r) {
    for (int k = 0; k < 2; ++k) {
      launch_close_stream(r, &ranks[r].s[k]);
      free(ranks[r].s[k].buf);
    }
    size_t n = 0;
    while (ranks[r].env[n]) ++n;
    for (size_t k = n - 4; k < n; ++k) free(ranks[r].env[k]); /* the strdup'ed four */
    free(ranks[r].env);
  }
  free(ranks);
  free(fds);
  free(owner);
  return code;
}
