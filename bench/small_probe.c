/* The one-kernel layer of a few tokens (ml_cuda_moe_small, src/cuda/moe_small.cu)
 * alone on the presets' routed experts (random weights, no shared expert):
 * CUDA-event time of one launch, the L2 flushed before each by a 256 MiB
 * memset, then the kernel's phase stamps (args.stamps): for each phase, the
 * earliest, median and latest CTA, in microseconds after the first CTA began
 * (%globaltimer), medians over the runs. Not a library tool: it drives an
 * internal launcher, so it links the static library.
 *   scripts/gpu-check.sh probe          (builds and runs it)
 *   small_probe [preset ...] [--tokens N] [--fp8]   (--fp8: FP8 experts, e4m3
 *   weights of random bytes with block scales) */
#include "cuda/pipeline.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(call)                                                                                  \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "small_probe: %s: %s\n", #call, cudaGetErrorString(e_));                     \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)
#define MTRY(call)                                                                                 \
  do {                                                                                             \
    if ((call) != MOELINK_SUCCESS) {                                                               \
      fprintf(stderr, "small_probe: %s: %s\n", #call, moelink_last_error());                       \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

#define RUNS 10

/* SMALL_PROBE_FLUSH=0: no flush (the weights and the kernel's code may stay in L2) */
static int g_flush = 1;
static int g_fp8 = 0;

static int cmp_d(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static const char *g_phase[ML_SMALL_PH_COUNT] = {
    "start",          "logits",     "barrier",   "sel: loaded",  "sel: scored",
    "sel: ranked",    "selected",   "first box", "gate/up done", "ready",
    "first down box", "last issue", "consumed",  "sums done"};

static void probe(const char *preset, int T, int sms) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  MTRY(moelink_moe_preset(preset, &c));
  c.shared_inter = 0;
  c.shared_gate = 0;
  c.max_tokens = 8;
  c.dtype = MOELINK_DTYPE_BF16;
  c.fp8_experts = g_fp8;
  int dev = 0, optin = 0;
  TRY(cudaGetDevice(&dev));
  TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (!ml_cuda_moe_small_fits(&c, T, optin)) {
    printf("%s T %d: not taken by the kernel\n", preset, T);
    return;
  }
  const size_t H = (size_t)c.hidden, I = (size_t)c.inter, E = (size_t)c.num_experts;
  const size_t wb = g_fp8 ? 1 : 2; /* bytes an expert weight */
  void *x, *wr, *gu, *dn, *out, *scratch, *flush;
  float *bias = NULL, *gus = NULL, *dns = NULL;
  int64_t *st;
  TRY(cudaMalloc(&x, (size_t)T * H * 2));
  TRY(cudaMalloc(&wr, E * H * 2));
  TRY(cudaMalloc(&gu, E * 2 * I * H * wb));
  TRY(cudaMalloc(&dn, E * H * I * wb));
  TRY(cudaMalloc(&out, (size_t)T * H * 2));
  if (c.correction_bias)
    TRY(cudaMalloc((void **)&bias, E * 4));
  MTRY(ml_cuda_fill(MOELINK_DTYPE_BF16, x, (size_t)T * H, 1, 1.0f, 0.0f, sms, NULL));
  MTRY(ml_cuda_fill(MOELINK_DTYPE_BF16, wr, E * H, 2, 0.02f, 0.0f, sms, NULL));
  /* (FP8: random bytes, NaN codes included: the time does not depend on them) */
  MTRY(ml_cuda_fill(MOELINK_DTYPE_BF16, gu, E * 2 * I * H * wb / 2, 3, 0.02f, 0.0f, sms, NULL));
  MTRY(ml_cuda_fill(MOELINK_DTYPE_BF16, dn, E * H * I * wb / 2, 4, 0.02f, 0.0f, sms, NULL));
  if (g_fp8) {
    const size_t ng = E * (2 * I / 128) * (H / 128), nd = E * (H / 128) * (I / 128);
    TRY(cudaMalloc((void **)&gus, ng * 4));
    TRY(cudaMalloc((void **)&dns, nd * 4));
    MTRY(ml_cuda_fill(MOELINK_DTYPE_F32, gus, ng, 6, 0.001f, 0.002f, sms, NULL));
    MTRY(ml_cuda_fill(MOELINK_DTYPE_F32, dns, nd, 7, 0.001f, 0.002f, sms, NULL));
  }
  if (bias)
    MTRY(ml_cuda_fill(MOELINK_DTYPE_F32, bias, E, 5, 0.01f, 0.0f, sms, NULL));
  size_t zero = 0;
  const size_t sb = ml_cuda_moe_small_scratch(&c, sms, &zero);
  TRY(cudaMalloc(&scratch, sb));
  TRY(cudaMemset(scratch, 0, zero));
  const size_t fb = (size_t)256 << 20;
  TRY(cudaMalloc(&flush, fb));
  TRY(cudaMalloc((void **)&st, (size_t)sms * ML_CUDA_SMALL_STAMPS * 8));
  int64_t *hs = malloc((size_t)sms * ML_CUDA_SMALL_STAMPS * 8);
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.router = wr;
  w.correction_bias = bias;
  w.gate_up = gu;
  w.down = dn;
  w.gate_up_scale = gus;
  w.down_scale = dns;
  ml_cuda_moe_small_args a = ml_cuda_moe_small_args_for(&c, &w, x, T, out, scratch, sb, sms);
  cudaEvent_t e0, e1;
  TRY(cudaEventCreate(&e0));
  TRY(cudaEventCreate(&e1));
  double ms[RUNS], ph[ML_SMALL_PH_COUNT][3][RUNS];
  for (int r = -2; r < 2 * RUNS; ++r) {
    const int stamped = r >= RUNS;
    a.stamps = stamped ? st : NULL;
    if (stamped)
      TRY(cudaMemset(st, 0, (size_t)sms * ML_CUDA_SMALL_STAMPS * 8));
    if (g_flush)
      TRY(cudaMemset(flush, r & 0xff, fb));
    TRY(cudaEventRecord(e0, NULL));
    MTRY(ml_cuda_moe_small(&a, NULL));
    TRY(cudaEventRecord(e1, NULL));
    TRY(cudaEventSynchronize(e1));
    if (r >= 0 && r < RUNS) {
      float f = 0.0f;
      TRY(cudaEventElapsedTime(&f, e0, e1));
      ms[r] = f;
    }
    if (!stamped)
      continue;
    TRY(cudaMemcpy(hs, st, (size_t)sms * ML_CUDA_SMALL_STAMPS * 8, cudaMemcpyDeviceToHost));
    int64_t t0 = -1;
    for (int b = 0; b < sms; ++b) {
      const int64_t v = hs[(size_t)b * ML_CUDA_SMALL_STAMPS + ML_SMALL_PH_START];
      if (v > 0 && (t0 < 0 || v < t0))
        t0 = v;
    }
    for (int q = 0; q < ML_SMALL_PH_COUNT; ++q) {
      double v[1024];
      int n = 0;
      for (int b = 0; b < sms && n < 1024; ++b) {
        const int64_t s = hs[(size_t)b * ML_CUDA_SMALL_STAMPS + q];
        if (s > 0)
          v[n++] = (double)(s - t0) * 1e-3;
      }
      const int i = r - RUNS;
      if (n == 0) {
        ph[q][0][i] = ph[q][1][i] = ph[q][2][i] = -1.0;
        continue;
      }
      qsort(v, (size_t)n, sizeof *v, cmp_d);
      ph[q][0][i] = v[0];
      ph[q][1][i] = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
      ph[q][2][i] = v[n - 1];
    }
  }
  const double weights = (double)T * c.top_k * 3.0 * (double)H * (double)I * (double)wb;
  const double t = median(ms, RUNS) * 1e3;
  printf("%s%s T %d (H %zu I %zu E %zu k %d): %.1f us a launch (%s), expert weights "
         "%.1f MB (at most), %.2f TB/s\n",
         preset, g_fp8 ? " fp8" : "", T, H, I, E, c.top_k, t, g_flush ? "memset flush" : "no flush",
         weights * 1e-6, weights / t * 1e-6);
  printf("  %-16s %9s %9s %9s   (us after the first CTA began; medians of %d runs)\n", "phase",
         "first", "median", "last", RUNS);
  for (int q = 0; q < ML_SMALL_PH_COUNT; ++q)
    printf("  %-16s %9.2f %9.2f %9.2f\n", g_phase[q], median(ph[q][0], RUNS),
           median(ph[q][1], RUNS), median(ph[q][2], RUNS));
  free(hs);
  cudaFree(x);
  cudaFree(wr);
  cudaFree(gu);
  cudaFree(dn);
  cudaFree(out);
  cudaFree(bias);
  cudaFree(gus);
  cudaFree(dns);
  cudaFree(scratch);
  cudaFree(flush);
  cudaFree(st);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

int main(int argc, char **argv) {
  const char *fl = getenv("SMALL_PROBE_FLUSH");
  g_flush = fl == NULL || atoi(fl) != 0;
  const char *presets[16];
  int np = 0, T = 1;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc)
      T = atoi(argv[++i]);
    else if (strcmp(argv[i], "--fp8") == 0)
      g_fp8 = 1;
    else if (np < 16)
      presets[np++] = argv[i];
  }
  if (np == 0) {
    presets[np++] = "qwen3-30b-a3b";
    presets[np++] = "mixtral-8x7b";
    presets[np++] = "deepseek-v3";
  }
  int dev = 0, sms = 0;
  TRY(cudaGetDevice(&dev));
  TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  for (int i = 0; i < np; ++i)
    probe(presets[i], T, sms);
  return 0;
}
