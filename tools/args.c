/* Argument parsing for `run` and `bench`. Options take their value as the
 * next word or after '=' (--tokens 64, --tokens=64). Every mistake ends in
 * one line naming the option, exit code 2. */
#include "cli.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The embedded shape `moelink run` uses with no preset: small enough that a
 * 2-core machine generates, runs and verifies it in a few seconds. */
#define CLI_SMALL_H 512
#define CLI_SMALL_I 256
#define CLI_SMALL_E 16
#define CLI_SMALL_K 4

static int cli_parse_long(const char *s, long long lo, long long hi, long long *out) {
  char *end = NULL;
  if (!s || !*s) return -1;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || *end || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

/* A number that parses but does not fit is named as such, not as garbage. */
int cli_int_arg(const char *opt, const char *s, long long lo) {
  long long v;
  if (cli_parse_long(s, lo, INT_MAX, &v) == 0) return (int)v;
  if (cli_parse_long(s, lo, LLONG_MAX, &v) == 0)
    cli_usage_error("%s: %s is out of range (at most %d)", opt, s, INT_MAX);
  if (lo == 0 || lo == 1)
    cli_usage_error("%s: expected a %s integer, got '%s'", opt, lo ? "positive" : "non-negative",
                    s ? s : "");
  cli_usage_error("%s: expected an integer >= %lld, got '%s'", opt, lo, s ? s : "");
}

static int cli_pos_int(const char *opt, const char *s) { return cli_int_arg(opt, s, 1); }

static int cli_nonneg_int(const char *opt, const char *s) { return cli_int_arg(opt, s, 0); }

static double cli_pos_double(const char *opt, const char *s) {
  char *end = NULL;
  errno = 0;
  double v = s && *s ? strtod(s, &end) : NAN;
  if (!s || !*s || errno || *end || !(v > 0.0) || !isfinite(v))
    cli_usage_error("%s: expected a positive number, got '%s'", opt, s ? s : "");
  return v;
}

static uint64_t cli_u64(const char *opt, const char *s) {
  char *end = NULL;
  errno = 0;
  unsigned long long v = (s && *s && *s != '-') ? strtoull(s, &end, 0) : 0;
  if (!s || !*s || *s == '-' || errno || *end)
    cli_usage_error("%s: expected a non-negative integer, got '%s'", opt, s ? s : "");
  return (uint64_t)v;
}

int cli_int_list(const char *opt, const char *s, int *out, int max) {
  const char *p = s;
  int n = 0;
  if (!*p) cli_usage_error("%s: expected a comma-separated list of positive integers, got ''", opt);
  while (*p) {
    char item[32];
    size_t len = strcspn(p, ",");
    long long v;
    if (len == 0 || len >= sizeof item)
      cli_usage_error("%s: expected a comma-separated list of positive integers, got '%s'", opt,
                      s);
    memcpy(item, p, len);
    item[len] = '\0';
    if (cli_parse_long(item, 1, INT_MAX, &v))
      cli_usage_error("%s: expected a comma-separated list of positive integers, got '%s' in '%s'",
                      opt, item, s);
    if (n == max) cli_usage_error("%s: at most %d values", opt, max);
    out[n++] = (int)v;
    p += len;
    if (*p == ',') {
      ++p;
      if (!*p)
        cli_usage_error("%s: expected a comma-separated list of positive integers, got '%s'",
                        opt, s);
    }
  }
  return n;
}

static double cli_skew(const char *opt, const char *s) {
  if (strcmp(s, "uniform") == 0) return 0.0;
  if (strncmp(s, "zipf:", 5) == 0) {
    char *end = NULL;
    errno = 0;
    double a = strtod(s + 5, &end);
    if (s[5] && !errno && !*end && a > 0.0 && isfinite(a)) return a;
  }
  cli_usage_error("%s: expected 'uniform' or 'zipf:ALPHA' with ALPHA > 0, got '%s'", opt, s);
}

void cli_skew_string(double zipf, char *buf, size_t n) {
  if (zipf > 0.0)
    snprintf(buf, n, "zipf:%g", zipf);
  else
    snprintf(buf, n, "uniform");
}

const char *cli_router_name(moelink_router_t r) {
  switch (r) {
  case MOELINK_ROUTER_SOFTMAX_TOPK: return "softmax";
  case MOELINK_ROUTER_SIGMOID_TOPK: return "sigmoid";
  case MOELINK_ROUTER_TOPK_SOFTMAX: return "topk-softmax";
  }
  return "unknown";
}

static moelink_router_t cli_router(const char *opt, const char *s) {
  if (strcmp(s, "softmax") == 0) return MOELINK_ROUTER_SOFTMAX_TOPK;
  if (strcmp(s, "sigmoid") == 0) return MOELINK_ROUTER_SIGMOID_TOPK;
  if (strcmp(s, "topk-softmax") == 0) return MOELINK_ROUTER_TOPK_SOFTMAX;
  cli_usage_error("%s: expected softmax, sigmoid or topk-softmax, got '%s'", opt, s);
}

moelink_dtype_t cli_dtype(const char *opt, const char *s) {
  if (strcmp(s, "f32") == 0) return MOELINK_DTYPE_F32;
  if (strcmp(s, "bf16") == 0) return MOELINK_DTYPE_BF16;
  if (strcmp(s, "f16") == 0) return MOELINK_DTYPE_F16;
  cli_usage_error("%s: expected f32, bf16 or f16, got '%s'", opt, s);
}

moelink_backend_t cli_backend(const char *opt, const char *s) {
  if (strcmp(s, "cpu") == 0) return MOELINK_BACKEND_CPU;
  if (strcmp(s, "cuda") == 0) return MOELINK_BACKEND_CUDA;
  cli_usage_error("%s: expected cpu or cuda, got '%s'", opt, s);
}

static void cli_unknown_preset(const char *name) __attribute__((noreturn));
static void cli_unknown_preset(const char *name) {
  char known[512];
  size_t len = 0;
  known[0] = '\0';
  for (int i = 0; i < moelink_preset_count() && len < sizeof known; ++i) {
    int w = snprintf(known + len, sizeof known - len, "%s%s", i ? ", " : "",
                     moelink_preset_name(i));
    if (w < 0) break;
    len += (size_t)w;
  }
  cli_usage_error("--preset: unknown preset '%s' (known: %s)", name, known);
}

/* Shape and router flags, kept apart so they override the preset (or the
 * small shape) whatever their order on the command line. -1 = not given. */
typedef struct cli_shape {
  int hidden, inter, experts, topk, router, renorm, groups, topk_group, bias, shared_inter,
      shared_gate;
  double scale;
} cli_shape;

const char *cli_option_split(const char *cmd, const char *arg, char *name, size_t n) {
  if (strncmp(arg, "--", 2) != 0)
    cli_usage_error("%s: unexpected argument '%s' (see moelink %s --help)", cmd, arg, cmd);
  const char *eq = strchr(arg, '=');
  size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
  if (len >= n) len = n - 1; /* a name this long is unknown anyway */
  memcpy(name, arg, len);
  name[len] = '\0';
  return eq ? eq + 1 : NULL;
}

const char *cli_option_value(int argc, char **argv, int *i, const char *name, const char *val) {
  if (val) return val;
  if (*i + 1 >= argc) cli_usage_error("%s: missing value", name);
  return argv[++*i];
}

/* " (experts fp8)" and the like for the data line. */
static const char *cli_fp8_note(const moelink_moe_config_t *c) {
  return c->fp8_experts && c->fp8_shared ? " (experts and shared expert fp8)"
         : c->fp8_experts                ? " (experts fp8)"
         : c->fp8_shared                 ? " (shared expert fp8)"
                                         : "";
}

void cli_parse(int argc, char **argv, int bench, cli_opts *o) {
  const char *cmd = bench ? "bench" : "run";
  cli_shape sh = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1.0};
  moelink_dtype_t dtype = MOELINK_DTYPE_BF16;
  int fp8_experts = 0, fp8_shared = 0;
  moelink_moe_config_t init = MOELINK_MOE_CONFIG_INIT;

  memset(o, 0, sizeof *o);
  o->cfg = init;
  o->backend = MOELINK_BACKEND_CPU;
  o->tokens = 64;
  o->seed = 1;
  o->verify = -1;
  o->verify_tokens = 32;
  o->iters = -1;
  o->warmup = -1;
  o->argc = argc;

  for (int i = 0; i < argc; ++i) {
    const char *arg = argv[i];
    char name[64];
    const char *val = NULL;
    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
      if (bench)
        cli_help_bench();
      else
        cli_help_run();
      exit(0);
    }
    val = cli_option_split(cmd, arg, name, sizeof name);

#define IS(s) (strcmp(name, (s)) == 0)
    /* Options that take no value. */
    if (IS("--fp8-experts")) {
      if (val) cli_usage_error("%s: takes no value, got '%s'", name, val);
      fp8_experts = 1;
      continue;
    }
    if (IS("--fp8-shared")) {
      if (val)
        cli_usage_error("%s: takes no value, got '%s'", name, val);
      fp8_shared = 1;
      continue;
    }
    if (IS("--no-renorm") || IS("--bias") || IS("--shared-gate") ||
        (!bench && (IS("--verify") || IS("--no-verify"))) || (bench && IS("--graph"))) {
      if (val) cli_usage_error("%s: takes no value, got '%s'", name, val);
      if (IS("--graph")) {
        o->graph = 1;
        continue;
      }
      if (IS("--no-renorm")) sh.renorm = 0;
      else if (IS("--bias")) sh.bias = 1;
      else if (IS("--shared-gate")) sh.shared_gate = 1;
      else if (IS("--verify")) o->verify = 1;
      else o->verify = 0;
      if (!IS("--verify") && !IS("--no-verify")) o->shape_given = 1;
      continue;
    }
    int known = IS("--preset") || IS("--hidden") || IS("--inter") || IS("--experts") ||
                IS("--topk") || IS("--router") || IS("--groups") || IS("--topk-group") ||
                IS("--scale") || IS("--shared-inter") || IS("--tokens") || IS("--backend") ||
                IS("--dtype") || IS("--seed") || IS("--skew") || IS("--max-tokens") ||
                IS("--threads") || (!bench && IS("--verify-tokens")) ||
                (bench && (IS("--iters") || IS("--warmup") || IS("--json")));
    if (!known)
      cli_usage_error("%s: unknown option '%s' (see moelink %s --help)", cmd, name, cmd);
    val = cli_option_value(argc, argv, &i, name, val);
    if (IS("--preset")) o->preset = val;
    else if (IS("--hidden")) sh.hidden = cli_pos_int(name, val);
    else if (IS("--inter")) sh.inter = cli_pos_int(name, val);
    else if (IS("--experts")) sh.experts = cli_pos_int(name, val);
    else if (IS("--topk")) sh.topk = cli_pos_int(name, val);
    else if (IS("--router")) sh.router = (int)cli_router(name, val);
    else if (IS("--groups")) sh.groups = cli_pos_int(name, val);
    else if (IS("--topk-group")) sh.topk_group = cli_pos_int(name, val);
    else if (IS("--scale")) sh.scale = cli_pos_double(name, val);
    else if (IS("--shared-inter")) sh.shared_inter = cli_nonneg_int(name, val);
    else if (IS("--tokens")) {
      if (bench)
        o->ntokens = cli_int_list(name, val, o->token_list, CLI_MAX_TOKEN_LIST);
      else
        o->tokens = cli_pos_int(name, val);
    } else if (IS("--backend")) o->backend = cli_backend(name, val);
    else if (IS("--dtype")) dtype = cli_dtype(name, val);
    else if (IS("--seed")) o->seed = cli_u64(name, val);
    else if (IS("--skew")) o->zipf = cli_skew(name, val);
    else if (IS("--max-tokens")) o->max_tokens = cli_pos_int(name, val);
    else if (IS("--threads")) o->threads = cli_nonneg_int(name, val);
    else if (IS("--verify-tokens")) o->verify_tokens = cli_pos_int(name, val);
    else if (IS("--iters")) o->iters = cli_pos_int(name, val);
    else if (IS("--warmup")) o->warmup = cli_nonneg_int(name, val);
    else if (IS("--json")) {
      if (!*val) cli_usage_error("--json: expected a file name, got ''");
      o->json = val;
    }
    if (!IS("--preset") && !IS("--tokens") && !IS("--backend") && !IS("--dtype") &&
        !IS("--seed") && !IS("--skew") && !IS("--max-tokens") && !IS("--threads") &&
        !IS("--verify-tokens") && !IS("--iters") && !IS("--warmup") && !IS("--json"))
      o->shape_given = 1;
#undef IS
  }

  moelink_moe_config_t *c = &o->cfg;
  if (o->preset) {
    moelink_status_t s = moelink_moe_preset(o->preset, c);
    if (s == MOELINK_ERR_NOT_FOUND) cli_unknown_preset(o->preset);
    if (s != MOELINK_SUCCESS) cli_lib_fail("moelink_moe_preset", s);
  } else {
    c->hidden = CLI_SMALL_H;
    c->inter = CLI_SMALL_I;
    c->num_experts = CLI_SMALL_E;
    c->top_k = CLI_SMALL_K;
  }
  if (sh.groups > 0 && sh.topk_group < 0)
    cli_usage_error("--groups: needs --topk-group (how many of the %d groups each token keeps)",
                    sh.groups);
  if (sh.hidden > 0) c->hidden = sh.hidden;
  if (sh.inter > 0) c->inter = sh.inter;
  if (sh.experts > 0) c->num_experts = sh.experts;
  if (sh.topk > 0) c->top_k = sh.topk;
  if (sh.router >= 0) c->router = (moelink_router_t)sh.router;
  if (sh.renorm >= 0) c->renormalize = sh.renorm;
  if (sh.groups > 0) c->n_group = sh.groups;
  if (sh.topk_group > 0) c->topk_group = sh.topk_group;
  if (sh.scale > 0.0) c->routed_scaling = (float)sh.scale;
  if (sh.bias >= 0) c->correction_bias = sh.bias;
  if (sh.shared_inter >= 0) {
    c->shared_inter = sh.shared_inter;
    if (sh.shared_inter == 0) c->shared_gate = 0;
  }
  if (sh.shared_gate >= 0) c->shared_gate = sh.shared_gate;
  c->dtype = dtype;
  c->fp8_experts = fp8_experts;
  c->fp8_shared = fp8_shared && c->shared_inter > 0;
  if (fp8_shared && c->shared_inter == 0)
    cli_usage_error("--fp8-shared: the layer has no shared expert (--shared-inter)");

  if (bench) {
    if (o->ntokens == 0) {
      static const int gpu_default[] = {1, 16, 128, 512, 2048, 8192};
      if (o->backend == MOELINK_BACKEND_CUDA) {
        o->ntokens = (int)(sizeof gpu_default / sizeof gpu_default[0]);
        memcpy(o->token_list, gpu_default, sizeof gpu_default);
      } else {
        o->ntokens = 1;
        o->token_list[0] = 256;
      }
    }
  } else {
    o->ntokens = 1;
    o->token_list[0] = o->tokens;
    if (o->verify < 0) o->verify = (!o->preset && !o->shape_given) ? 1 : 0;
  }
  int tmax = 0;
  for (int i = 0; i < o->ntokens; ++i)
    if (o->token_list[i] > tmax) tmax = o->token_list[i];
  c->max_tokens = o->max_tokens ? o->max_tokens : tmax;

  if (moelink_moe_config_check(c) != MOELINK_SUCCESS)
    cli_usage_error("invalid layer configuration: %s", moelink_last_error());
}

const char *cli_shape_name(const cli_opts *o) {
  static char buf[96];
  if (!o->preset) return o->shape_given ? "custom" : "small (embedded)";
  if (!o->shape_given) return o->preset;
  snprintf(buf, sizeof buf, "%s (modified)", o->preset);
  return buf;
}

void cli_print_config(const cli_opts *o, int tokens) {
  const moelink_moe_config_t *c = &o->cfg;
  char skew[32], shared[64], threads[32];
  cli_skew_string(o->zipf, skew, sizeof skew);
  if (c->shared_inter > 0)
    snprintf(shared, sizeof shared, "%d%s", c->shared_inter, c->shared_gate ? " (gated)" : "");
  else
    snprintf(shared, sizeof shared, "none");
  if (o->threads > 0)
    snprintf(threads, sizeof threads, "%d thread%s", o->threads, o->threads == 1 ? "" : "s");
  else
    snprintf(threads, sizeof threads, "all cores");
  printf("layer      %s\n", cli_shape_name(o));
  printf("shape      H %d  I %d  E %d  k %d\n", c->hidden, c->inter, c->num_experts, c->top_k);
  char groups[32];
  if (c->n_group > 1)
    snprintf(groups, sizeof groups, "keep %d of %d", c->topk_group, c->n_group);
  else
    snprintf(groups, sizeof groups, "off");
  printf("router     %s%s%s  groups %s  scale %g  shared %s\n", cli_router_name(c->router),
         c->renormalize ? " renorm" : "", c->correction_bias ? " +bias" : "", groups,
         (double)c->routed_scaling, shared);
  printf("backend    %s%s%s%s\n", o->backend == MOELINK_BACKEND_CUDA ? "cuda" : "cpu",
         o->backend == MOELINK_BACKEND_CPU ? " (" : "",
         o->backend == MOELINK_BACKEND_CPU ? threads : "",
         o->backend == MOELINK_BACKEND_CPU ? ")" : "");
  if (tokens > 0)
    printf("data       %s%s  tokens %d  max_tokens %d  seed %llu  skew %s\n",
           moelink_dtype_name(c->dtype), cli_fp8_note(c), tokens, c->max_tokens,
           (unsigned long long)o->seed, skew);
  else
    printf("data       %s%s  max_tokens %d  seed %llu  skew %s\n", moelink_dtype_name(c->dtype),
           cli_fp8_note(c), c->max_tokens, (unsigned long long)o->seed, skew);
}
