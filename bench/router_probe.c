/* The CUDA router kernel alone (ml_cuda_router, src/cuda/router.cu) on the
 * routing shapes of the presets at small token counts: CUDA-event time of
 * one launch (launch overhead included), the L2 flushed before each by a
 * 256 MiB memset, 10 timed runs after 2 untimed. Not a library tool: it
 * drives an internal launcher, so it links the static library.
 *   scripts/gpu-check.sh probe          (builds and runs it)
 * MOELINK_ROUTER_TWO_LEVEL=0 times the one-level sum of the split logits.
 * Then 10 more runs with the kernel's phase stamps (args.stamps): medians,
 * in microseconds after the first CTA began (%globaltimer), of when the last
 * CTA had its logits, had stored them, and when the CTA that took the last
 * ticket had summed, selected and planned; and the same CTA's own clock64
 * intervals (at the SM clock) of its sum, selection and plan. Then the
 * selection-only kernel of large batches (logits given) at 128-8192 tokens:
 * with and without the L2 flush, and its phases. */
#include "cuda/pipeline.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(call)                                                                      \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "router_probe: %s: %s\n", #call, cudaGetErrorString(e_));        \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

typedef struct shape {
  const char *name;
  int E, k, H;
  moelink_router_t router;
  int groups, keep, bias;
} shape;

static int cmp_f(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

static float median(float *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_f);
  return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

#define RUNS 10
/* The stamp columns: globaltimer microseconds after the first CTA's start. */
enum {
  C_STARTS,
  C_LOGITS,
  C_STORED,
  C_GROUP,
  C_LAST,
  C_SUMMED,
  C_SELECTED,
  C_PLANNED,
  C_SUM_CLK,
  C_SCORE_CLK,
  C_CHOOSE_CLK,
  C_WEIGHT_CLK,
  C_SEL_CLK,
  C_PLAN_CLK,
  C_N
};
static const char *col_name[C_N] = {
    "starts",  "logits",  "stored",    "group",      "last",        "summed",     "selected",
    "planned", "sum@clk", "score@clk", "choose@clk", "weights@clk", "select@clk", "plan@clk"};

/* One run's phases from the stamps of n CTAs (0: not reached). */
static void phases(const int64_t *st, int n, double ghz, float *out) {
  int64_t t0 = INT64_MAX, mx[ML_R_PH_COUNT];
  memset(mx, 0, sizeof mx);
  int win = -1;
  for (int c = 0; c < n; ++c) {
    const int64_t *q = st + (size_t)c * ML_CUDA_ROUTER_STAMPS;
    if (q[ML_R_PH_START] > 0 && q[ML_R_PH_START] < t0)
      t0 = q[ML_R_PH_START];
    for (int ph = 0; ph < ML_R_PH_COUNT; ++ph)
      if (q[ph] > mx[ph])
        mx[ph] = q[ph];
    if (q[ML_R_PH_SUMMED] > 0)
      win = c;
  }
  for (int i = 0; i < C_N; ++i)
    out[i] = -1.0f;
  if (t0 == INT64_MAX)
    return;
  const int map[] = {ML_R_PH_START, ML_R_PH_LOGITS, ML_R_PH_STORED,   ML_R_PH_GROUP,
                     ML_R_PH_LAST,  ML_R_PH_SUMMED, ML_R_PH_SELECTED, ML_R_PH_PLANNED};
  for (int i = 0; i < 8; ++i)
    out[i] = mx[map[i]] > 0 ? (float)(mx[map[i]] - t0) * 1e-3f : -1.0f;
  if (win >= 0) {
    const int64_t *k = st + (size_t)win * ML_CUDA_ROUTER_STAMPS + ML_R_PH_COUNT;
    const int64_t *g = st + (size_t)win * ML_CUDA_ROUTER_STAMPS;
    /* the sum starts at the last ticket (split launches) or at the logits
     * (the selection kernel: at its start, the logits' loads included) */
    const int from = g[ML_R_PH_LAST] > 0     ? ML_R_PH_LAST
                     : g[ML_R_PH_LOGITS] > 0 ? ML_R_PH_LOGITS
                                             : ML_R_PH_START;
    out[C_SUM_CLK] = (float)((double)(k[ML_R_PH_SUMMED] - k[from]) / ghz * 1e-3);
    const double us = 1e-3 / ghz;
    out[C_SCORE_CLK] = (float)((double)(k[ML_R_PH_SCORED] - k[ML_R_PH_SUMMED]) * us);
    out[C_CHOOSE_CLK] = (float)((double)(k[ML_R_PH_CHOSEN] - k[ML_R_PH_SCORED]) * us);
    out[C_WEIGHT_CLK] = (float)((double)(k[ML_R_PH_SELECTED] - k[ML_R_PH_CHOSEN]) * us);
    out[C_SEL_CLK] = (float)((double)(k[ML_R_PH_SELECTED] - k[ML_R_PH_SUMMED]) * us);
    if (g[ML_R_PH_PLANNED] > 0)
      out[C_PLAN_CLK] = (float)((double)(k[ML_R_PH_PLANNED] - k[ML_R_PH_SELECTED]) / ghz * 1e-3);
  }
}

/* The routing config of shape s at T tokens. */
static moelink_moe_config_t shape_config(const shape *s, int T) {
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = s->H;
  cfg.inter = 64;
  cfg.num_experts = s->E;
  cfg.top_k = s->k;
  cfg.router = s->router;
  cfg.n_group = s->groups;
  cfg.topk_group = s->keep;
  cfg.correction_bias = s->bias;
  cfg.max_tokens = T;
  return cfg;
}

static void launch(ml_cuda_router_args *a) {
  if (ml_cuda_router(a, 0) != MOELINK_SUCCESS) {
    fprintf(stderr, "router_probe: %s\n", moelink_last_error());
    exit(1);
  }
}

/* n launches of a, each after an L2 flush when flush is not NULL: their
 * event times in us. */
static void timed(ml_cuda_router_args *a, void *flush, int n, float *us) {
  cudaEvent_t e0, e1;
  TRY(cudaEventCreate(&e0));
  TRY(cudaEventCreate(&e1));
  for (int it = 0; it < n; ++it) {
    if (flush != NULL)
      TRY(cudaMemset(flush, it, (size_t)256 << 20));
    TRY(cudaEventRecord(e0, 0));
    launch(a);
    TRY(cudaEventRecord(e1, 0));
    TRY(cudaEventSynchronize(e1));
    float ms;
    TRY(cudaEventElapsedTime(&ms, e0, e1));
    us[it] = 1e3f * ms;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

/* RUNS launches of a with the phase stamps of its ctas CTAs, each after an
 * L2 flush; prints the phases' medians after the label. */
static void stamped(ml_cuda_router_args *a, int ctas, double ghz, void *flush, const char *label) {
  const size_t sbytes = (size_t)ctas * ML_CUDA_ROUTER_STAMPS * sizeof(int64_t);
  int64_t *dst, *hst = malloc(sbytes);
  TRY(cudaMalloc((void **)&dst, sbytes));
  a->stamps = dst;
  float cols[C_N][RUNS];
  for (int it = 0; it < RUNS; ++it) {
    TRY(cudaMemset(flush, it, (size_t)256 << 20));
    TRY(cudaMemset(dst, 0, sbytes));
    launch(a);
    TRY(cudaMemcpy(hst, dst, sbytes, cudaMemcpyDeviceToHost));
    float out[C_N];
    phases(hst, ctas, ghz, out);
    for (int c = 0; c < C_N; ++c)
      cols[c][it] = out[c];
  }
  printf("  %s (us, medians of %d):", label, RUNS);
  for (int c = 0; c < C_N; ++c) {
    const float m = median(cols[c], RUNS);
    if (m >= 0.0f)
      printf(" %s %.2f", col_name[c], m);
  }
  printf("\n");
  a->stamps = NULL;
  cudaFree(dst);
  free(hst);
}

static void probe(const shape *s, int T, int sms, double ghz, void *flush) {
  moelink_moe_config_t cfg = shape_config(s, T);
  void *x, *w, *plan;
  float *bias, *wts, *parts;
  int32_t *ids, *tickets;
  TRY(cudaMalloc(&x, (size_t)T * s->H * 2));
  TRY(cudaMemset(x, 0x3c, (size_t)T * s->H * 2)); /* bf16 ~1.0: every logit equal */
  TRY(cudaMalloc(&w, (size_t)s->E * s->H * 2));
  TRY(cudaMemset(w, 0x3c, (size_t)s->E * s->H * 2));
  TRY(cudaMalloc((void **)&bias, (size_t)s->E * 4));
  TRY(cudaMemset(bias, 0, (size_t)s->E * 4));
  TRY(cudaMalloc((void **)&ids, (size_t)T * s->k * 4));
  TRY(cudaMalloc((void **)&wts, (size_t)T * s->k * 4));
  TRY(cudaMalloc((void **)&parts, ml_cuda_router_partial_floats(s->E, sms) * 4));
  TRY(cudaMalloc((void **)&tickets, ml_cuda_router_tickets(sms) * 4));
  TRY(cudaMemset(tickets, 0, ml_cuda_router_tickets(sms) * 4));
  const size_t pb = moelink_plan_bytes(T, s->k, s->E, ML_CUDA_TILE_ROWS);
  TRY(cudaMalloc(&plan, pb));
  moelink_plan_t view;
  moelink_plan_view(plan, T, s->k, s->E, ML_CUDA_TILE_ROWS, &view);
  ml_cuda_router_args a =
      ml_cuda_router_args_for(&cfg, x, w, bias, T, ids, wts, parts, tickets, sms);
  if (ml_cuda_router_builds_plan(T, s->k)) a.plan = &view; /* as the layer's forward does */
  float times[12], best = 1e30f;
  timed(&a, flush, 12, times);
  for (int it = 2; it < 12; ++it)
    if (times[it] < best)
      best = times[it];
  printf("%-14s T %2d  splits %2d  min %6.1f us  runs", s->name, T, a.splits, best);
  for (int it = 2; it < 12; ++it) printf(" %.1f", times[it]);
  printf("\n");
  /* the same launches with the phase stamps */
  stamped(&a, ((T + 15) / 16) * a.splits, ghz, flush, "phases");
  cudaFree(x);
  cudaFree(w);
  cudaFree(bias);
  cudaFree(ids);
  cudaFree(wts);
  cudaFree(parts);
  cudaFree(tickets);
  cudaFree(plan);
}

/* The selection-only kernel (the path of large batches: logits given, from
 * the GEMM engine) on random fp32 logits in `parts` parts: event times with
 * the L2 flushed before each launch and back to back without a flush (code
 * and logits in the L2), then the phases of flushed launches. */
static void probe_select(const shape *s, int T, int parts, int sms, double ghz, void *flush) {
  moelink_moe_config_t cfg = shape_config(s, T);
  const size_t nl = (size_t)parts * T * s->E;
  float *h = malloc(nl * sizeof(float)), *logits, *bias, *wts;
  uint32_t r = 12345u;
  for (size_t i = 0; i < nl; ++i) {
    r = r * 1664525u + 1013904223u;
    h[i] = ((float)(r >> 8) / 16777216.0f * 6.0f - 3.0f) / (float)parts;
  }
  int32_t *ids;
  TRY(cudaMalloc((void **)&logits, nl * sizeof(float)));
  TRY(cudaMemcpy(logits, h, nl * sizeof(float), cudaMemcpyHostToDevice));
  for (int e = 0; e < s->E; ++e) {
    r = r * 1664525u + 1013904223u;
    h[e] = (float)(r >> 8) / 16777216.0f * 0.2f - 0.1f;
  }
  TRY(cudaMalloc((void **)&bias, (size_t)s->E * 4));
  TRY(cudaMemcpy(bias, h, (size_t)s->E * 4, cudaMemcpyHostToDevice));
  TRY(cudaMalloc((void **)&ids, (size_t)T * s->k * 4));
  TRY(cudaMalloc((void **)&wts, (size_t)T * s->k * 4));
  /* (x and w are not read when the logits are given: any pointer) */
  ml_cuda_router_args a =
      ml_cuda_router_args_for(&cfg, logits, logits, bias, T, ids, wts, NULL, NULL, sms);
  a.splits = 1;
  a.logits = logits;
  a.logit_parts = parts;
  float cold[12], hot[12];
  timed(&a, flush, 12, cold);
  timed(&a, NULL, 12, hot);
  printf("%-14s select T %4d  parts %d  L2 flushed: median %6.1f us, back to back: %6.1f us\n",
         s->name, T, parts, median(cold + 2, 10), median(hot + 2, 10));
  stamped(&a, (T + 15) / 16, ghz, flush, "phases, L2 flushed");
  free(h);
  cudaFree(logits);
  cudaFree(bias);
  cudaFree(ids);
  cudaFree(wts);
}

int main(void) {
  struct cudaDeviceProp prop;
  TRY(cudaGetDeviceProperties(&prop, 0));
  if (ml_cuda_router_prepare((int)prop.sharedMemPerBlockOptin) != MOELINK_SUCCESS) {
    fprintf(stderr, "router_probe: %s\n", moelink_last_error());
    return 1;
  }
  void *flush;
  TRY(cudaMalloc(&flush, (size_t)256 << 20));
  int khz = 0;
  TRY(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const double ghz = khz > 0 ? khz * 1e-6 : 1.98; /* the SM clock the stamps' cycles count */
  printf("router_probe: %s, %d SMs; event time of one launch, L2 flushed (memset) before each\n",
         prop.name, prop.multiProcessorCount);
  const shape shapes[] = {
      {"mixtral-8x7b", 8, 2, 4096, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 0},
      {"qwen3-30b-a3b", 128, 8, 2048, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 0},
      {"deepseek-v3", 256, 8, 7168, MOELINK_ROUTER_SIGMOID_TOPK, 8, 4, 1},
      /* deepseek-v3's selection without the correction bias, without the groups */
      {"ds3-no-bias", 256, 8, 7168, MOELINK_ROUTER_SIGMOID_TOPK, 8, 4, 0},
      {"ds3-no-groups", 256, 8, 7168, MOELINK_ROUTER_SIGMOID_TOPK, 1, 1, 1},
  };
  const int Ts[] = {1, 4, 16};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; ++i)
    for (size_t j = 0; j < sizeof Ts / sizeof Ts[0]; ++j)
      probe(&shapes[i], Ts[j], prop.multiProcessorCount, ghz, flush);
  /* the selection kernel at the sizes where the layers take it, in the
   * parts the layer's logits GEMM writes and in one */
  const int sel_T[] = {128, 512, 2048, 8192};
  for (size_t i = 0; i < 3; ++i)
    for (size_t j = 0; j < sizeof sel_T / sizeof sel_T[0]; ++j) {
      const shape *sh = &shapes[i];
      const int room = ML_CUDA_ROUTER_PART_ROWS / sel_T[j];
      const int parts = ml_cuda_gemm_splitk_parts(sel_T[j], sh->E, sh->H, room < 8 ? room : 8);
      probe_select(sh, sel_T[j], 1, prop.multiProcessorCount, ghz, flush);
      if (parts > 1)
        probe_select(sh, sel_T[j], parts, prop.multiProcessorCount, ghz, flush);
    }
  cudaFree(flush);
  return 0;
}
