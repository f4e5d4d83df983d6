/* The CUDA router kernel alone (ml_cuda_router, src/cuda/router.cu) on the
 * routing shapes of the presets at small token counts: CUDA-event time of
 * one launch (launch overhead included), the L2 flushed before each by a
 * 256 MiB memset, 10 timed runs after 2 untimed. Not a library tool: it
 * drives an internal launcher, so it links the static library.
 *   scripts/gpu-check.sh probe          (builds and runs it)
 * MOELINK_ROUTER_CTA_SELECT=0 times the previous selection and sum. */
#include "cuda/pipeline.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

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

static void probe(const shape *s, int T, int sms, void *flush) {
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
  cudaEvent_t e0, e1;
  TRY(cudaEventCreate(&e0));
  TRY(cudaEventCreate(&e1));
  float times[12], best = 1e30f;
  for (int it = 0; it < 12; ++it) {
    TRY(cudaMemset(flush, it, (size_t)256 << 20));
    TRY(cudaEventRecord(e0, 0));
    if (ml_cuda_router(&a, 0) != MOELINK_SUCCESS) {
      fprintf(stderr, "router_probe: %s\n", moelink_last_error());
      exit(1);
    }
    TRY(cudaEventRecord(e1, 0));
    TRY(cudaEventSynchronize(e1));
    float ms;
    TRY(cudaEventElapsedTime(&ms, e0, e1));
    times[it] = 1e3f * ms;
    if (it >= 2 && times[it] < best) best = times[it];
  }
  printf("%-14s T %2d  splits %2d  min %6.1f us  runs", s->name, T, a.splits, best);
  for (int it = 2; it < 12; ++it) printf(" %.1f", times[it]);
  printf("\n");
  cudaFree(x);
  cudaFree(w);
  cudaFree(bias);
  cudaFree(ids);
  cudaFree(wts);
  cudaFree(parts);
  cudaFree(tickets);
  cudaFree(plan);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
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
  printf("router_probe: %s, %d SMs; event time of one launch, L2 flushed (memset) before each\n",
         prop.name, prop.multiProcessorCount);
  const shape shapes[] = {
      {"mixtral-8x7b", 8, 2, 4096, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 0},
      {"qwen3-30b-a3b", 128, 8, 2048, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 0},
      {"deepseek-v3", 256, 8, 7168, MOELINK_ROUTER_SIGMOID_TOPK, 8, 4, 1},
  };
  const int Ts[] = {1, 4, 16};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; ++i)
    for (size_t j = 0; j < sizeof Ts / sizeof Ts[0]; ++j)
      probe(&shapes[i], Ts[j], prop.multiProcessorCount, flush);
  cudaFree(flush);
  return 0;
}
