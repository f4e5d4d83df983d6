/* The layer the CLI runs: deterministic weights from the reference's
 * generator (host) or the same values made on the GPU with
 * moelink_fill_random (FP8 weights: made on the host and copied), inputs from
 * ref_fill_x, and verification of an output against ref_forward_token. */
#include "cli.h"
#include "gpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Below this much generated data the user waits too little to be told. */
#define CLI_NOTE_BYTES 1e9
/* Reference multiply-adds (double, one token at a time) checked in full
 * before sampling kicks in: about a second or two on a small machine. */
#define CLI_VERIFY_BUDGET 1e9

static const char *const cli_tensor_names[REF_T_X + 1] = {
    "", "router", "correction bias", "gate_up", "down", "shared gate_up", "shared down",
    "shared gate", "x"};

static size_t cli_tensor_elems(const moelink_moe_config_t *c, int t) {
  size_t H = (size_t)c->hidden, I = (size_t)c->inter, E = (size_t)c->num_experts;
  size_t Is = (size_t)c->shared_inter;
  switch (t) {
  case REF_T_ROUTER: return E * H;
  case REF_T_BIAS: return c->correction_bias ? E : 0;
  case REF_T_GATE_UP: return E * 2 * I * H;
  case REF_T_DOWN: return E * H * I;
  case REF_T_SH_GATE_UP: return 2 * Is * H;
  case REF_T_SH_DOWN: return H * Is;
  case REF_T_SH_GATE: return c->shared_gate ? H : 0;
  default: return 0;
  }
}

/* Whether tensor t is FP8 bytes (with fp32 block scales). */
static int cli_tensor_fp8(const moelink_moe_config_t *c, int t) {
  return (c->fp8_experts && (t == REF_T_GATE_UP || t == REF_T_DOWN)) ||
         (c->fp8_shared && (t == REF_T_SH_GATE_UP || t == REF_T_SH_DOWN));
}

static size_t cli_tensor_esize(const moelink_moe_config_t *c, int t) {
  if (cli_tensor_fp8(c, t))
    return 1; /* + scales */
  return t == REF_T_BIAS ? sizeof(float) : moelink_dtype_size(c->dtype);
}

/* fp32 block scales of tensor t: one per 128 x 128 block of an FP8 one. */
static size_t cli_scale_count(const moelink_moe_config_t *c, int t) {
  return cli_tensor_fp8(c, t) ? cli_tensor_elems(c, t) / (128 * 128) : 0;
}

/* Slot of an FP8 tensor's scales in cli_layer.dev_scale (-1: none). */
static int cli_scale_slot(int t) {
  switch (t) {
  case REF_T_GATE_UP:
    return 0;
  case REF_T_DOWN:
    return 1;
  case REF_T_SH_GATE_UP:
    return 2;
  case REF_T_SH_DOWN:
    return 3;
  default:
    return -1;
  }
}

/* Bytes of tensors t0..t1 as stored, block scales included. */
static double cli_stored_bytes(const moelink_moe_config_t *c, int t0, int t1) {
  double b = 0.0;
  for (int t = t0; t <= t1; ++t)
    b += (double)cli_tensor_elems(c, t) * (double)cli_tensor_esize(c, t) +
         (double)cli_scale_count(c, t) * sizeof(float);
  return b;
}

double cli_shared_bytes(const moelink_moe_config_t *c) {
  return cli_stored_bytes(c, REF_T_SH_GATE_UP, REF_T_SH_DOWN);
}

double cli_expert_bytes(const moelink_moe_config_t *c) {
  const double E = c->num_experts > 0 ? c->num_experts : 1;
  return cli_stored_bytes(c, REF_T_GATE_UP, REF_T_DOWN) / E;
}

/* The big tensors are generated where they live; the small ones on the host,
 * where the router's zipf skew is applied, then copied. */
static int cli_tensor_is_big(int t) {
  return t == REF_T_GATE_UP || t == REF_T_DOWN || t == REF_T_SH_GATE_UP || t == REF_T_SH_DOWN;
}

static const void *cli_host_tensor(const ref_layer *h, int t) {
  switch (t) {
  case REF_T_ROUTER: return h->router;
  case REF_T_BIAS: return h->bias;
  case REF_T_GATE_UP: return h->gate_up;
  case REF_T_DOWN: return h->down;
  case REF_T_SH_GATE_UP: return h->shared_gate_up;
  case REF_T_SH_DOWN: return h->shared_down;
  case REF_T_SH_GATE: return h->shared_gate;
  default: return NULL;
  }
}

static void cli_host_make(cli_layer *L) {
  char b[32];
  double t0 = cli_now();
  int note = L->weight_bytes >= CLI_NOTE_BYTES;
  size_t pieces = 0;
  cli_fmt_bytes(L->weight_bytes, b, sizeof b);
  if (note) {
    fprintf(stderr, "weights: generating %s on the host...\n", b);
    fflush(stderr);
  }
  if (ref_layer_begin(&L->host, &L->cfg, L->seed, L->zipf, &pieces) != 0)
    cli_fail("could not make the host weights (%s): out of memory or a config the reference "
             "does not handle",
             b);
  /* FP8 experts are encoded piece by piece (128 rows of one matrix), on every
   * core: the single-threaded generator would take minutes on DeepSeek-V3. */
  if (pieces > 0) {
    cli_progress p;
    int failed = 0;
    long long done = 0;
    cli_progress_start(&p, "fp8 experts");
#pragma omp parallel for schedule(dynamic, 1)
    for (long long i = 0; i < (long long)pieces; ++i) {
      if (ref_layer_fp8_piece(&L->host, (size_t)i) != 0) {
#pragma omp atomic write
        failed = 1;
      }
      long long d;
#pragma omp atomic capture
      d = ++done;
#ifdef _OPENMP
      if (omp_get_thread_num() == 0)
#endif
        cli_progress_update(&p, (double)d, (double)pieces, "pieces");
    }
    cli_progress_end(&p);
    if (failed) {
      ref_layer_free(&L->host);
      cli_fail("could not make the host weights (%s): out of memory", b);
    }
  }
  L->have_host = 1;
  if (note) fprintf(stderr, "weights: done in %.1f s\n", cli_now() - t0);
}

/* FP8 weights cannot be made by moelink_fill_random: the whole layer comes
 * from the host generator (the values the CPU backend and --verify use) and
 * is copied, the block scales too. The host copy stays for verification. */
static void cli_device_from_host(cli_layer *L) {
  const moelink_moe_config_t *cfg = &L->cfg;
  cli_host_make(L);
  char b[32];
  double t0 = cli_now();
  int note = L->weight_bytes >= CLI_NOTE_BYTES;
  cli_fmt_bytes(L->weight_bytes, b, sizeof b);
  if (note) {
    fprintf(stderr, "weights: copying %s to the GPU...\n", b);
    fflush(stderr);
  }
  for (int t = REF_T_ROUTER; t < REF_T_X; ++t) {
    size_t n = cli_tensor_elems(cfg, t), esz = cli_tensor_esize(cfg, t);
    if (n == 0) continue;
    if (gpu_malloc(&L->dev[t], n * esz, cli_tensor_names[t]) != 0 ||
        gpu_h2d(L->dev[t], cli_host_tensor(&L->host, t), n * esz) != 0)
      cli_fail("%s", gpu_error());
  }
  const float *hs[4] = {L->host.gate_up_scale, L->host.down_scale, L->host.shared_gate_up_scale,
                        L->host.shared_down_scale};
  for (int t = REF_T_ROUTER; t < REF_T_X; ++t) {
    const int m = cli_scale_slot(t);
    size_t n = cli_scale_count(cfg, t);
    if (n == 0 || m < 0)
      continue;
    if (gpu_malloc(&L->dev_scale[m], n * sizeof(float), cli_tensor_names[t]) != 0 ||
        gpu_h2d(L->dev_scale[m], hs[m], n * sizeof(float)) != 0)
      cli_fail("%s", gpu_error());
  }
  /* Pageable copies may still be landing when cudaMemcpy returns; the
   * forward runs on another stream. */
  if (gpu_stream_sync(NULL) != 0) cli_fail("copying weights to the GPU: %s", gpu_error());
  if (note) fprintf(stderr, "weights: copied in %.1f s\n", cli_now() - t0);
}

/* The dtype layer on the GPU: big tensors generated there, small ones on the
 * host (where the router's skew is applied) and copied. */
static void cli_device_make(cli_layer *L, moelink_context_t ctx, void *stream) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const uint64_t seed = L->seed;
  const double zipf = L->zipf;
  moelink_context_t hctx = NULL;
  moelink_context_config_t hc = MOELINK_CONTEXT_CONFIG_INIT;
  hc.num_threads = 1; /* small tensors only */
  CLI_CALL("moelink_context_create (host, for the small tensors)", moelink_context_create(&hc, &hctx));
  for (int t = REF_T_ROUTER; t < REF_T_X; ++t) {
    size_t n = cli_tensor_elems(cfg, t), esz = cli_tensor_esize(cfg, t);
    moelink_dtype_t dt = t == REF_T_BIAS ? MOELINK_DTYPE_F32 : cfg->dtype;
    if (n == 0) continue;
    if (gpu_malloc(&L->dev[t], n * esz, cli_tensor_names[t]) != 0) cli_fail("%s", gpu_error());
    uint64_t ts = ref_tensor_seed(seed, t);
    float scale = ref_tensor_scale(cfg, t);
    if (cli_tensor_is_big(t)) {
      CLI_CALL("moelink_fill_random", moelink_fill_random(ctx, dt, L->dev[t], n, ts, scale, 0.0f, stream));
    } else {
      void *h = cli_malloc(n * esz, cli_tensor_names[t]);
      CLI_CALL("moelink_fill_random (host)", moelink_fill_random(hctx, dt, h, n, ts, scale, 0.0f, NULL));
      if (t == REF_T_ROUTER && zipf > 0.0) ref_apply_skew(cfg, h, zipf);
      if (gpu_h2d(L->dev[t], h, n * esz) != 0) cli_fail("%s", gpu_error());
      free(h);
    }
  }
  if (gpu_stream_sync(stream) != 0) cli_fail("generating weights on the GPU: %s", gpu_error());
  moelink_context_destroy(hctx);
}

void cli_layer_make(cli_layer *L, moelink_context_t ctx, const moelink_moe_config_t *cfg,
                    uint64_t seed, double zipf, void *stream) {
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  memset(L, 0, sizeof *L);
  L->cfg = *cfg;
  L->backend = moelink_context_backend(ctx);
  L->seed = seed;
  L->zipf = zipf;
  /* Without host weights, host.cfg/seed/zipf_alpha still serve ref_fill_x. */
  L->host.cfg = *cfg;
  L->host.seed = seed;
  L->host.zipf_alpha = zipf;
  L->weight_bytes = cli_stored_bytes(cfg, REF_T_ROUTER, REF_T_X - 1);

  if (L->backend == MOELINK_BACKEND_CPU) {
    cli_host_make(L);
    L->w = L->host.w;
    return;
  }
  if (cfg->fp8_experts || cfg->fp8_shared)
    cli_device_from_host(L);
  else
    cli_device_make(L, ctx, stream);

  w.dtype = cfg->dtype;
  w.router = L->dev[REF_T_ROUTER];
  w.correction_bias = (const float *)L->dev[REF_T_BIAS];
  w.gate_up = L->dev[REF_T_GATE_UP];
  w.down = L->dev[REF_T_DOWN];
  w.shared_gate_up = L->dev[REF_T_SH_GATE_UP];
  w.shared_down = L->dev[REF_T_SH_DOWN];
  w.shared_gate = L->dev[REF_T_SH_GATE];
  w.gate_up_scale = (const float *)L->dev_scale[0];
  w.down_scale = (const float *)L->dev_scale[1];
  w.shared_gate_up_scale = (const float *)L->dev_scale[2];
  w.shared_down_scale = (const float *)L->dev_scale[3];
  L->w = w;
}

void cli_layer_make_host(cli_layer *L) {
  if (L->have_host) return;
  cli_host_make(L);
  if (L->backend != MOELINK_BACKEND_CUDA) return;
  /* The reference reads the host copy; make sure it is what the GPU holds,
   * so a generator mismatch is named as such, not as a wrong forward. */
  for (int t = REF_T_ROUTER; t < REF_T_X; ++t) {
    size_t n = cli_tensor_elems(&L->cfg, t), esz = cli_tensor_esize(&L->cfg, t);
    if (n == 0) continue;
    size_t m = n < ((size_t)1 << 16) ? n : ((size_t)1 << 16);
    unsigned char *d = (unsigned char *)cli_malloc(m * esz, "device check");
    const unsigned char *h = (const unsigned char *)cli_host_tensor(&L->host, t);
    if (gpu_d2h(d, L->dev[t], m * esz) != 0) cli_fail("%s", gpu_error());
    for (size_t i = 0; i < m * esz; ++i)
      if (d[i] != h[i])
        cli_fail("the GPU-generated %s differs from the host generator at element %zu",
                 cli_tensor_names[t], i / esz);
    free(d);
  }
}

void cli_layer_free(cli_layer *L) {
  if (L->have_host) ref_layer_free(&L->host);
  L->have_host = 0;
  for (int t = 0; t < REF_T_X; ++t) {
    gpu_free(L->dev[t]);
    L->dev[t] = NULL;
  }
  for (int m = 0; m < 4; ++m) {
    gpu_free(L->dev_scale[m]);
    L->dev_scale[m] = NULL;
  }
}

void cli_make_x(const cli_layer *L, void *x, int num_tokens) {
  ref_fill_x(&L->host, x, num_tokens, L->seed);
}

double cli_tolerance(moelink_dtype_t dt) { return dt == MOELINK_DTYPE_F32 ? 1e-4 : 1e-2; }

void cli_verify(const cli_layer *L, const void *x, const void *out, int num_tokens,
                int max_sample, cli_verify_result *r) {
  const moelink_moe_config_t *c = &L->host.cfg;
  const moelink_moe_weights_t *w = &L->host.w;
  const moelink_dtype_t dt = c->dtype;
  const size_t H = (size_t)c->hidden, ds = moelink_dtype_size(dt);
  const double cost = (double)c->top_k * 3.0 * c->inter * c->hidden +
                      (double)c->num_experts * c->hidden + 3.0 * c->shared_inter * c->hidden;
  int ns = num_tokens;
  if ((double)num_tokens * cost > CLI_VERIFY_BUDGET && max_sample < num_tokens) ns = max_sample;
  if (!L->have_host) cli_fail("internal: verification without host weights");

  int *idx = (int *)cli_malloc(sizeof(int) * (size_t)ns, "verify");
  double *err2 = (double *)cli_malloc(sizeof(double) * (size_t)ns, "verify");
  double *ref2 = (double *)cli_malloc(sizeof(double) * (size_t)ns, "verify");
  double *mabs = (double *)cli_malloc(sizeof(double) * (size_t)ns, "verify");
  int *bad = (int *)cli_malloc(sizeof(int) * (size_t)ns, "verify");
  /* Evenly spread, first and last included: chunk edges and the tail of the
   * token range are where indexing goes wrong. */
  for (int j = 0; j < ns; ++j)
    idx[j] = ns == 1 ? 0 : (int)(((long long)j * (num_tokens - 1) + (ns - 1) / 2) / (ns - 1));

  cli_progress p;
  int done = 0, failed = 0;
  cli_progress_start(&p, "verify");
#pragma omp parallel
  {
    double *ref = (double *)malloc(sizeof(double) * H);
#pragma omp for schedule(dynamic, 1)
    for (int j = 0; j < ns; ++j) {
      size_t t = (size_t)idx[j];
      double e2 = 0.0, r2 = 0.0, ma = 0.0;
      int nonfinite = 0;
      if (!ref || ref_forward_token(c, w, (const char *)x + t * H * ds, ref) != 0) {
#pragma omp atomic write
        failed = 1;
      } else {
        for (size_t i = 0; i < H; ++i) {
          double g = ref_load(dt, out, t * H + i);
          double d = g - ref[i];
          if (!isfinite(g)) nonfinite = 1;
          e2 += d * d;
          r2 += ref[i] * ref[i];
          if (fabs(d) > ma) ma = fabs(d);
        }
      }
      err2[j] = e2;
      ref2[j] = r2;
      mabs[j] = ma;
      bad[j] = nonfinite;
#pragma omp atomic update
      done++;
#ifdef _OPENMP
      if (omp_get_thread_num() == 0)
#endif
      {
        int d;
#pragma omp atomic read
        d = done;
        cli_progress_update(&p, d, ns, "tokens");
      }
    }
    free(ref);
  }
  cli_progress_end(&p);
  if (failed) cli_fail("the reference cannot evaluate this configuration (or is out of memory)");

  /* Summed in token order so the reported error does not depend on threads. */
  double e2 = 0.0, r2 = 0.0, ma = 0.0;
  int nonfinite = 0;
  for (int j = 0; j < ns; ++j) {
    e2 += err2[j];
    r2 += ref2[j];
    if (mabs[j] > ma) ma = mabs[j];
    nonfinite |= bad[j];
  }
  r->checked = ns;
  r->total = num_tokens;
  r->rel_l2 = nonfinite ? INFINITY : (r2 > 0.0 ? sqrt(e2 / r2) : sqrt(e2));
  r->max_abs = nonfinite ? INFINITY : ma;
  r->tol = cli_tolerance(dt);
  r->pass = r->rel_l2 <= r->tol;
  free(idx);
  free(err2);
  free(ref2);
  free(mabs);
  free(bad);
}
