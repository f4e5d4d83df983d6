/* Shared pieces of the moelink command-line tool: options, errors, clocks,
 * progress, the test layer (weights made by the reference generator) and
 * verification against the reference. The CLI does all the printing; the
 * library only returns statuses. */
#ifndef MOELINK_CLI_H
#define MOELINK_CLI_H

#include "moelink.h"
#include "ref.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Exit codes: 1 for a failed run or library error, 2 for bad arguments. */
enum { CLI_EXIT_FAIL = 1, CLI_EXIT_USAGE = 2 };

#define CLI_MAX_TOKEN_LIST 64
/* Bytes the GPU benchmarks write before each timed call to evict L2. */
#define CLI_L2_FLUSH_BYTES ((size_t)256 << 20)

typedef struct cli_opts {
  moelink_moe_config_t cfg;
  const char *preset;            /* NULL: the embedded small shape */
  int shape_given;               /* any shape or router flag was given */
  moelink_backend_t backend;
  int tokens;                    /* run: T */
  int token_list[CLI_MAX_TOKEN_LIST]; /* bench: the T values */
  int ntokens;
  uint64_t seed;
  double zipf;                   /* 0: uniform routing */
  int max_tokens;                /* 0: as many as the largest call */
  int threads;                   /* 0: one per core */
  int verify;                    /* run: -1 = default */
  int verify_tokens;
  int iters, warmup;             /* bench: -1 = backend default */
  int graph;                     /* bench (cuda): time CUDA-graph replays of the forward */
  const char *json;
  int argc;                      /* 0: the command had no arguments at all */
} cli_opts;

/* ---- option parsing shared by the commands (args.c) ---------------------
 * Options are --name VALUE or --name=VALUE; every mistake is a usage error
 * (one line naming the option, exit code 2). */
/* The name of option arg (truncated to n - 1) into name; its "=value" part,
 * or NULL. Anything not starting with "--" is a usage error of cmd. */
const char *cli_option_split(const char *cmd, const char *arg, char *name, size_t n);
/* The value of option name: val when it came with '=', else the next
 * argument (*i advances over it). */
const char *cli_option_value(int argc, char **argv, int *i, const char *name, const char *val);
/* An integer in [lo, INT_MAX]. */
int cli_int_arg(const char *opt, const char *s, long long lo);
/* A comma-separated list of positive integers into out (at most max);
 * returns the count (>= 1). */
int cli_int_list(const char *opt, const char *s, int *out, int max);
moelink_backend_t cli_backend(const char *opt, const char *s);
moelink_dtype_t cli_dtype(const char *opt, const char *s);

/* ---- errors (all print one line on stderr and exit) --------------------- */
void cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void cli_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* A failed library call: "moelink: error: what: STATUS: last error", exit 1. */
void cli_lib_fail(const char *what, moelink_status_t s) __attribute__((noreturn));
#define CLI_CALL(what, expr)                                                   \
  do {                                                                         \
    moelink_status_t cli_s_ = (expr);                                          \
    if (cli_s_ != MOELINK_SUCCESS) cli_lib_fail((what), cli_s_);               \
  } while (0)
void *cli_malloc(size_t bytes, const char *what);

/* ---- options ------------------------------------------------------------ */
/* Parses the arguments of `run` (bench = 0) or `bench` (bench = 1) after the
 * command word; exits 2 on anything wrong. */
void cli_parse(int argc, char **argv, int bench, cli_opts *o);
const char *cli_router_name(moelink_router_t r);
/* "mixtral-8x7b" or "custom" / "small". */
const char *cli_shape_name(const cli_opts *o);
void cli_print_config(const cli_opts *o, int tokens);
void cli_skew_string(double zipf, char *buf, size_t n);

/* ---- clock and progress ------------------------------------------------- */
double cli_now(void);                 /* seconds, monotonic */
typedef struct cli_progress {
  const char *what;
  double t0, last;
  int shown, tty;
} cli_progress;
/* Silent during the first ~2 s; then shows done/total on stderr. */
void cli_progress_start(cli_progress *p, const char *what);
void cli_progress_update(cli_progress *p, double done, double total, const char *unit);
void cli_progress_end(cli_progress *p);
double cli_median(double *v, int n);  /* sorts v */
void cli_fmt_bytes(double bytes, char *buf, size_t n);

/* ---- the test layer ----------------------------------------------------- */
typedef struct cli_layer {
  moelink_moe_config_t cfg;
  moelink_backend_t backend;
  uint64_t seed;
  double zipf;
  ref_layer host;        /* CPU: the weights. CUDA: only cfg/seed/alpha unless
                            cli_layer_make_host ran (verification) or the
                            experts are FP8 (made here, then copied) */
  int have_host;
  void *dev[REF_T_X];    /* CUDA device buffers, indexed by REF_T_* */
  void *dev_scale[4];    /* CUDA, FP8 block scales: gate_up, down (fp8_experts),
                            shared gate_up, shared down (fp8_shared) */
  moelink_moe_weights_t w; /* what set_weights gets (host or device) */
  double weight_bytes;
} cli_layer;

/* Generates the layer's weights on the context's backend: on the host with
 * the reference generator, on the GPU with moelink_fill_random (same values);
 * FP8 experts on the GPU are generated on the host and copied. */
void cli_layer_make(cli_layer *L, moelink_context_t ctx, const moelink_moe_config_t *cfg,
                    uint64_t seed, double zipf, void *stream);
/* The host copy of a CUDA layer, for the reference; checks that the device
 * tensors hold the same values (a prefix of each). */
void cli_layer_make_host(cli_layer *L);
void cli_layer_free(cli_layer *L);
/* Bytes of one routed expert's gate_up and down as stored: dtype elements, or
 * FP8 bytes plus their fp32 block scales. */
double cli_expert_bytes(const moelink_moe_config_t *c);
/* Bytes of the shared expert's gate_up and down as stored (0: none). */
double cli_shared_bytes(const moelink_moe_config_t *c);
/* x [T, H] in the layer's dtype on the host. */
void cli_make_x(const cli_layer *L, void *x, int num_tokens);

typedef struct cli_verify_result {
  int checked, total;
  double rel_l2, max_abs, tol;
  int pass;
} cli_verify_result;
/* Compares out [T, H] (host, layer dtype) with the reference on a sample of
 * tokens: all of them when that is cheap, else max_sample spread evenly. */
void cli_verify(const cli_layer *L, const void *x, const void *out, int num_tokens,
                int max_sample, cli_verify_result *r);
double cli_tolerance(moelink_dtype_t dt);

/* ---- commands ----------------------------------------------------------- */
/* The context (backend and threads of the options), a stream on CUDA, and the
 * layer of o->cfg that run and bench work on; failures end the program. */
typedef struct cli_session {
  moelink_context_t ctx;
  void *stream; /* NULL on the CPU */
  moelink_moe_t moe;
} cli_session;
void cli_session_open(const cli_opts *o, cli_session *ss);
void cli_session_close(cli_session *ss);

int cli_cmd_run(int argc, char **argv);
int cli_cmd_bench(int argc, char **argv);
/* `moelink bench tp`: tensor-parallel fused GEMMs (tools/bench_tp.c). */
int cli_cmd_bench_tp(int argc, char **argv);
void cli_help_bench_tp(void);
int cli_cmd_launch(int argc, char **argv);
/* `moelink bench comm` (tools/bench_comm.c): collectives beside NCCL's. */
int cli_cmd_bench_comm(int argc, char **argv);
void cli_help_bench_comm(void);
/* `moelink bench ep` (tools/bench_ep.c): the expert-parallel layer beside the
 * single-device layer and NCCL moving the same rows. */
int cli_cmd_bench_ep(int argc, char **argv);
void cli_help_bench_ep(void);
void cli_help_run(void);
void cli_help_bench(void);
void cli_help_launch(void);

/* JSON output of the benchmarks: a string (NULL: null) with escapes, a
 * number (not finite: null). */
void cli_json_str(FILE *f, const char *s);
void cli_json_num(FILE *f, double v);
/* `, "key": number` (null when not finite), for the members after the first. */
void cli_json_field(FILE *f, const char *key, double v);
/* TFLOP/s of `flops` done in `us` microseconds. */
double cli_tflops(double flops, double us);
/* The commit the numbers belong to: MOELINK_COMMIT (a copy of the tree
 * without .git, as on a lent GPU machine), else git's HEAD, else "". */
void cli_commit(char *buf, size_t n);
/* Opens a benchmark's JSON object: "tool", "version", "date" (UTC),
 * "git_commit" (cli_commit, null when unknown) and "env" (every MOELINK_*
 * variable of the process, name to value, sorted); the caller goes on with
 * ",\n  \"key\": ..." members and closes the object. */
void cli_json_begin(FILE *f, const char *tool);
/* The CPU's model name from /proc/cpuinfo ("unknown" if none). */
void cli_cpu_model(char *buf, size_t n);
/* The benchmarks' L2 flush before each timed call on CUDA, over a device
 * buffer of CLI_L2_FLUSH_BYTES: a read of it (MOELINK_BENCH_L2_FLUSH=read,
 * the default: the L2 is left clean, as for the read-bandwidth floor) or a
 * memset (=write: dirty lines the timed call writes back; the benchmarks'
 * flush before this option existed). A bad value is a usage error. Returns
 * gpu_l2_flush_async's result; cli_l2_flush_name gives "read" or "write". */
int cli_l2_flush(void *buf, int seq, void *stream);
const char *cli_l2_flush_name(void);

#endif
