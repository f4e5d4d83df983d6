/* Errors, clocks, progress lines and small formatting helpers of the CLI. */
#include "cli.h"
#include "gpu.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void cli_vfail(int code, const char *fmt, va_list ap) __attribute__((noreturn));
static void cli_vfail(int code, const char *fmt, va_list ap) {
  fflush(stdout);
  fputs("moelink: error: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  exit(code);
}

void cli_usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  cli_vfail(CLI_EXIT_USAGE, fmt, ap);
}

void cli_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  cli_vfail(CLI_EXIT_FAIL, fmt, ap);
}

void cli_lib_fail(const char *what, moelink_status_t s) {
  const char *why = moelink_last_error();
  cli_fail("%s: %s%s%s", what, moelink_status_string(s), why && *why ? ": " : "",
           why ? why : "");
}

void *cli_malloc(size_t bytes, const char *what) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) cli_fail("out of host memory allocating %.3f GB for %s", (double)bytes / 1e9, what);
  return p;
}

double cli_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Work shorter than this stays silent: a quick command prints only its result. */
#define CLI_PROGRESS_QUIET_S 2.0

void cli_progress_start(cli_progress *p, const char *what) {
  p->what = what;
  p->t0 = p->last = cli_now();
  p->shown = 0;
  p->tty = isatty(fileno(stderr));
}

void cli_progress_update(cli_progress *p, double done, double total, const char *unit) {
  double t = cli_now();
  if (t - p->t0 < CLI_PROGRESS_QUIET_S) return;
  /* A terminal gets a line rewritten in place; a log gets a line now and then. */
  if (p->shown && t - p->last < (p->tty ? 0.5 : 10.0)) return;
  p->last = t;
  p->shown = 1;
  double el = t - p->t0;
  double eta = done > 0 ? el * (total - done) / done : 0.0;
  fprintf(stderr, "%s%s: %.0f/%.0f %s, %.0f s elapsed, ~%.0f s left%s", p->tty ? "\r" : "",
          p->what, done, total, unit, el, eta, p->tty ? "\033[K" : "\n");
  fflush(stderr);
}

void cli_progress_end(cli_progress *p) {
  if (!p->shown) return;
  fprintf(stderr, "%s%s: done in %.1f s%s\n", p->tty ? "\r" : "", p->what, cli_now() - p->t0,
          p->tty ? "\033[K" : "");
  fflush(stderr);
}

static int cli_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double cli_median(double *v, int n) {
  if (n <= 0) return 0.0;
  qsort(v, (size_t)n, sizeof *v, cli_cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void cli_fmt_bytes(double bytes, char *buf, size_t n) {
  if (bytes >= 1e9)
    snprintf(buf, n, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6)
    snprintf(buf, n, "%.1f MB", bytes / 1e6);
  else if (bytes >= 1e3)
    snprintf(buf, n, "%.1f kB", bytes / 1e3);
  else
    snprintf(buf, n, "%.0f B", bytes);
}

void cli_session_open(const cli_opts *o, cli_session *ss) {
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = o->backend;
  cc.num_threads = o->threads;
  ss->ctx = NULL;
  ss->stream = NULL;
  ss->moe = NULL;
  CLI_CALL("moelink_context_create", moelink_context_create(&cc, &ss->ctx));
  if (o->backend == MOELINK_BACKEND_CUDA && gpu_stream_create(&ss->stream) != 0)
    cli_fail("%s", gpu_error());
  CLI_CALL("moelink_moe_create", moelink_moe_create(ss->ctx, &o->cfg, &ss->moe));
}

void cli_session_close(cli_session *ss) {
  moelink_moe_destroy(ss->moe);
  gpu_stream_destroy(ss->stream);
  moelink_context_destroy(ss->ctx);
}

void cli_json_str(FILE *f, const char *s) {
  if (!s) {
    fputs("null", f);
    return;
  }
  fputc('"', f);
  for (; *s; ++s) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      fprintf(f, "\\%c", ch);
    else if (ch < 0x20)
      fprintf(f, "\\u%04x", ch);
    else
      fputc(ch, f);
  }
  fputc('"', f);
}

void cli_json_num(FILE *f, double v) {
  if (isfinite(v))
    fprintf(f, "%.6g", v);
  else
    fputs("null", f);
}

void cli_json_field(FILE *f, const char *key, double v) {
  fprintf(f, ", \"%s\": ", key);
  cli_json_num(f, v);
}

double cli_tflops(double flops, double us) { return flops / (us * 1e-6) / 1e12; }

static int cli_cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* "env": every MOELINK_* variable of the process, sorted by name: the
 * library's parameters (docs/ENV.md) that a run was made under. */
static void cli_json_env(FILE *f) {
  extern char **environ;
  size_t n = 0;
  for (char **e = environ; e && *e; ++e) n += strncmp(*e, "MOELINK_", 8) == 0;
  const char **v = n ? (const char **)malloc(n * sizeof *v) : NULL;
  size_t m = 0;
  if (v)
    for (char **e = environ; *e && m < n; ++e)
      if (strncmp(*e, "MOELINK_", 8) == 0) v[m++] = *e;
  qsort(v, m, sizeof *v, cli_cmp_str);
  fprintf(f, ",\n  \"env\": {");
  for (size_t i = 0; i < m; ++i) {
    const char *eq = strchr(v[i], '=');
    char name[256];
    const size_t len = eq ? (size_t)(eq - v[i]) : strlen(v[i]);
    snprintf(name, sizeof name, "%.*s", (int)(len < sizeof name ? len : sizeof name - 1), v[i]);
    fprintf(f, "%s", i ? ", " : "");
    cli_json_str(f, name);
    fprintf(f, ": ");
    cli_json_str(f, eq ? eq + 1 : "");
  }
  fprintf(f, "}");
  free(v);
}

void cli_json_begin(FILE *f, const char *tool) {
  char date[64], commit[64];
  time_t now = time(NULL);
  struct tm tmv;
  gmtime_r(&now, &tmv);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tmv);
  cli_commit(commit, sizeof commit);
  fprintf(f, "{\n  \"tool\": ");
  cli_json_str(f, tool);
  fprintf(f, ",\n  \"version\": ");
  cli_json_str(f, moelink_version());
  fprintf(f, ",\n  \"date\": ");
  cli_json_str(f, date);
  fprintf(f, ",\n  \"git_commit\": ");
  cli_json_str(f, commit[0] ? commit : NULL);
  cli_json_env(f);
}

static int cli_l2_flush_mode(void) {
  const char *v = getenv("MOELINK_BENCH_L2_FLUSH");
  if (v == NULL || *v == '\0' || strcmp(v, "read") == 0) return GPU_FLUSH_READ;
  if (strcmp(v, "write") == 0) return GPU_FLUSH_WRITE;
  cli_usage_error("MOELINK_BENCH_L2_FLUSH: '%s' is not read or write", v);
}

const char *cli_l2_flush_name(void) {
  return cli_l2_flush_mode() == GPU_FLUSH_WRITE ? "write" : "read";
}

int cli_l2_flush(void *buf, int seq, void *stream) {
  return gpu_l2_flush_async(buf, CLI_L2_FLUSH_BYTES, cli_l2_flush_mode(), seq, stream);
}

void cli_commit(char *buf, size_t n) {
  buf[0] = '\0';
  const char *env = getenv("MOELINK_COMMIT");
  if (env && *env) {
    snprintf(buf, n, "%s", env);
    return;
  }
  FILE *p = popen("git rev-parse HEAD 2>/dev/null", "r");
  if (!p) return;
  char line[128] = "";
  if (fgets(line, sizeof line, p) && strspn(line, "0123456789abcdef") == 40) {
    line[40] = '\0';
    snprintf(buf, n, "%s", line);
  }
  pclose(p);
}

void cli_cpu_model(char *buf, size_t n) {
  snprintf(buf, n, "unknown");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    char *v = strchr(line, ':');
    if (strncmp(line, "model name", 10) == 0 && v) {
      v += 1 + strspn(v + 1, " \t");
      v[strcspn(v, "\n")] = '\0';
      snprintf(buf, n, "%s", v);
      break;
    }
  }
  fclose(f);
}
