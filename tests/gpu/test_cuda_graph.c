/* CUDA graphs and determinism: moelink_moe_forward (and the pieces) captured
 * on a non-blocking stream in cudaStreamCaptureModeGlobal (which refuses
 * synchronizing and allocating calls, so a successful capture shows the
 * forward has neither), replayed with new inputs copied into the same x
 * buffer, and compared bitwise with eager runs; eager runs bitwise equal to
 * each other; a forward queued behind a sleeping host callback returns at
 * once (it does not wait for the stream). */
#include "cuda/cuda.h"
#include "gpu_util.h"

#include <time.h>

static moelink_context_t g_gpu, g_cpu;

static void CUDART_CB sleep_200ms(void *arg) {
  (void)arg;
  struct timespec ts = {0, 200 * 1000 * 1000};
  nanosleep(&ts, NULL);
}

/* Output of the GPU (device out, copied here) against the CPU for host x,
 * leaving out near-tie tokens. */
static void against_cpu(const char *what, const ref_layer *L, moelink_moe_t gmoe,
                        moelink_moe_t cmoe, const void *hx, const void *dx, const void *gout,
                        int T) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const size_t es = moelink_dtype_size(cfg->dtype), H = (size_t)cfg->hidden;
  const int k = cfg->top_k;
  void *co = gu_host((size_t)T * H * es);
  int32_t *gi = gu_host((size_t)T * k * 4);
  int32_t *dids = gu_dev((size_t)T * k * 4);
  float *dw = gu_dev((size_t)T * k * 4);
  CHECK_OK(moelink_moe_forward(cmoe, hx, T, co, NULL), "CPU forward");
  /* the GPU route piece works on max_tokens at most: go in slices */
  moelink_moe_config_t gc;
  moelink_moe_get_config(gmoe, &gc);
  for (int t0 = 0; t0 < T; t0 += gc.max_tokens) {
    const int n = T - t0 < gc.max_tokens ? T - t0 : gc.max_tokens;
    CHECK_OK(moelink_moe_route(gmoe, (const char *)dx + (size_t)t0 * H * es, n,
                               dids + (size_t)t0 * k, dw + (size_t)t0 * k, NULL),
             "GPU route");
  }
  unsigned char *tie = gu_host((size_t)T);
  (void)gu_routes_check(what, L, cmoe, hx, T, dids, dw, gi, tie);
  gu_err e = gu_compare(cfg->dtype, gout, co, (size_t)T, H, tie);
  /* FP8 experts: the bound of one token's FP8 output (gpu_util.h) */
  gu_check_err_tol(what, e, cfg->dtype, gout, co, H, cfg->fp8_experts ? GU_FP8_TOL_ROW : GU_TOL,
                   cfg->fp8_experts ? GU_FP8_TOL_ROW : GU_TOL_ROW);
  free(co);
  free(gi);
  free(tie);
  gu_free(dids);
  gu_free(dw);
}

static void graph_case(const char *label, moelink_moe_config_t cfg, double zipf, int T,
                       int replays, uint64_t seed, int check_async) {
  char desc[200], name[320];
  gu_describe(desc, sizeof desc, &cfg);
  snprintf(name, sizeof name, "%s (%s, max_tokens %d, T %d)", label, desc, cfg.max_tokens, T);
  ref_layer L;
  if (ref_layer_make(&L, &cfg, seed, zipf) != 0) {
    CHECK(0, "ref_layer_make for %s", name);
    return;
  }
  const size_t es = moelink_dtype_size(cfg.dtype), H = (size_t)cfg.hidden;
  const size_t xb = (size_t)T * H * es;
  gu_dev_layer D;
  gu_dev_layer_upload(&D, &L);
  moelink_moe_t gmoe = NULL, cmoe = NULL;
  GU_MUST(moelink_moe_create(g_gpu, &cfg, &gmoe), "GPU layer");
  GU_MUST(moelink_moe_set_weights(gmoe, &D.w), "GPU weights");
  moelink_moe_config_t ccfg = cfg;
  ccfg.max_tokens = T;
  GU_MUST(moelink_moe_create(g_cpu, &ccfg, &cmoe), "CPU layer");
  GU_MUST(moelink_moe_set_weights(cmoe, &L.w), "CPU weights");

  cudaStream_t s;
  GU_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *x1 = gu_host(xb), *x2 = gu_host(xb);
  ref_fill_x(&L, x1, T, 11);
  ref_fill_x(&L, x2, T, 12);
  void *dx = gu_dev(xb), *de = gu_dev(xb), *dg = gu_dev(xb);
  void *e1 = gu_host(xb), *e1b = gu_host(xb), *e2 = gu_host(xb), *g = gu_host(xb);

  /* Eager, twice, on the stream. */
  GU_CUDA(cudaMemcpyAsync(dx, x1, xb, cudaMemcpyHostToDevice, s));
  GU_CUDA(cudaMemsetAsync(de, 0xFF, xb, s));
  CHECK_OK(moelink_moe_forward(gmoe, dx, T, de, s), "eager forward");
  GU_CUDA(cudaMemcpyAsync(e1, de, xb, cudaMemcpyDeviceToHost, s));
  GU_CUDA(cudaMemsetAsync(de, 0xFF, xb, s));
  CHECK_OK(moelink_moe_forward(gmoe, dx, T, de, s), "eager forward again");
  GU_CUDA(cudaMemcpyAsync(e1b, de, xb, cudaMemcpyDeviceToHost, s));
  GU_CUDA(cudaStreamSynchronize(s));
  CHECK(memcmp(e1, e1b, xb) == 0, "%s: two eager forwards bitwise equal", name);
  char what[400];
  snprintf(what, sizeof what, "%s: eager vs CPU", name);
  against_cpu(what, &L, gmoe, cmoe, x1, dx, e1, T);

  if (check_async) {
    /* A forward behind 200 ms of host callback must not wait for it. */
    GU_CUDA(cudaLaunchHostFunc(s, sleep_200ms, NULL));
    const double t0 = gu_now();
    moelink_status_t st = moelink_moe_forward(gmoe, dx, T, de, s);
    const double dt = gu_now() - t0;
    CHECK(st == MOELINK_SUCCESS && dt < 0.1,
          "%s: forward returns without waiting for the stream (%.1f ms, %s)", name, 1e3 * dt,
          moelink_status_string(st));
    GU_CUDA(cudaStreamSynchronize(s));
  }

  /* Capture. */
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  GU_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  moelink_status_t st = moelink_moe_forward(gmoe, dx, T, dg, s);
  const char *err = moelink_last_error();
  cudaError_t ce = cudaStreamEndCapture(s, &graph);
  CHECK(st == MOELINK_SUCCESS, "%s: forward under global-mode capture (%s: %s)", name,
        moelink_status_string(st), err);
  CHECK(ce == cudaSuccess && graph != NULL, "%s: capture ends cleanly (%s)", name,
        cudaGetErrorString(ce));
  if (st != MOELINK_SUCCESS || ce != cudaSuccess || graph == NULL) {
    (void)cudaGetLastError();
    goto done;
  }
  size_t nodes = 0;
  GU_CUDA(cudaGraphGetNodes(graph, NULL, &nodes));
  ml_t_diag("%s: graph of %zu nodes", name, nodes);
  GU_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  /* Replay on the captured input. */
  GU_CUDA(cudaMemsetAsync(dg, 0xFF, xb, s));
  GU_CUDA(cudaGraphLaunch(exec, s));
  GU_CUDA(cudaMemcpyAsync(g, dg, xb, cudaMemcpyDeviceToHost, s));
  GU_CUDA(cudaStreamSynchronize(s));
  CHECK(memcmp(g, e1, xb) == 0, "%s: replay bitwise equal to eager", name);

  /* New input in the same buffer. */
  GU_CUDA(cudaMemcpyAsync(dx, x2, xb, cudaMemcpyHostToDevice, s));
  GU_CUDA(cudaMemsetAsync(dg, 0xFF, xb, s));
  GU_CUDA(cudaGraphLaunch(exec, s));
  GU_CUDA(cudaMemcpyAsync(g, dg, xb, cudaMemcpyDeviceToHost, s));
  GU_CUDA(cudaMemsetAsync(de, 0xFF, xb, s));
  CHECK_OK(moelink_moe_forward(gmoe, dx, T, de, s), "eager forward of the new input");
  GU_CUDA(cudaMemcpyAsync(e2, de, xb, cudaMemcpyDeviceToHost, s));
  GU_CUDA(cudaStreamSynchronize(s));
  CHECK(memcmp(g, e2, xb) == 0, "%s: replay on a new input bitwise equal to eager", name);
  CHECK(memcmp(e1, e2, xb) != 0, "%s: the new input gives a new output", name);
  snprintf(what, sizeof what, "%s: replay vs CPU", name);
  against_cpu(what, &L, gmoe, cmoe, x2, dx, g, T);

  /* Many replays, inputs alternating: every one bitwise equal. */
  int mism = 0;
  for (int r = 0; r < replays; ++r) {
    const void *hx = (r & 1) ? x2 : x1;
    const void *want = (r & 1) ? e2 : e1;
    GU_CUDA(cudaMemcpyAsync(dx, hx, xb, cudaMemcpyHostToDevice, s));
    GU_CUDA(cudaMemsetAsync(dg, 0xFF, xb, s));
    GU_CUDA(cudaGraphLaunch(exec, s));
    GU_CUDA(cudaMemcpyAsync(g, dg, xb, cudaMemcpyDeviceToHost, s));
    GU_CUDA(cudaStreamSynchronize(s));
    if (memcmp(g, want, xb) != 0 && mism++ < 3) {
      size_t i = 0;
      while (i < xb && ((const char *)g)[i] == ((const char *)want)[i]) ++i;
      ml_t_diag("  replay %d differs first at byte %zu (token %zu)", r, i, i / (H * es));
    }
  }
  CHECK(mism == 0, "%s: %d replays bitwise equal to eager (%d differ)", name, replays, mism);

done:
  if (exec) GU_CUDA(cudaGraphExecDestroy(exec));
  if (graph) GU_CUDA(cudaGraphDestroy(graph));
  GU_CUDA(cudaStreamDestroy(s));
  free(x1);
  free(x2);
  free(e1);
  free(e1b);
  free(e2);
  free(g);
  gu_free(dx);
  gu_free(de);
  gu_free(dg);
  moelink_moe_destroy(gmoe);
  moelink_moe_destroy(cmoe);
  gu_dev_layer_free(&D);
  ref_layer_free(&L);
}

/* route -> plan -> experts -> combine captured as one graph. */
static void pieces_case(const char *label, moelink_moe_config_t cfg, int T, uint64_t seed) {
  char desc[200], name[320];
  gu_describe(desc, sizeof desc, &cfg);
  snprintf(name, sizeof name, "%s pieces (%s, T %d)", label, desc, T);
  ref_layer L;
  if (ref_layer_make(&L, &cfg, seed, 0.0) != 0) {
    CHECK(0, "ref_layer_make for %s", name);
    return;
  }
  const size_t es = moelink_dtype_size(cfg.dtype), H = (size_t)cfg.hidden;
  const int k = cfg.top_k, E = cfg.num_experts;
  const size_t xb = (size_t)T * H * es;
  gu_dev_layer D;
  gu_dev_layer_upload(&D, &L);
  moelink_moe_t gmoe = NULL;
  GU_MUST(moelink_moe_create(g_gpu, &cfg, &gmoe), "GPU layer");
  GU_MUST(moelink_moe_set_weights(gmoe, &D.w), "GPU weights");
  const size_t pb = moelink_plan_bytes(T, k, E, moelink_moe_tile_rows(gmoe));
  void *hx = gu_host(xb);
  ref_fill_x(&L, hx, T, 21);
  void *dx = gu_dev(xb), *dout = gu_dev(xb), *dplan = gu_dev(pb);
  void *dy = gu_dev((size_t)T * k * H * es);
  int32_t *dids = gu_dev((size_t)T * k * 4);
  float *dw = gu_dev((size_t)T * k * 4);
  void *eager = gu_host(xb), *rep = gu_host(xb);
  cudaStream_t s;
  GU_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  gu_h2d(dx, hx, xb);

  moelink_status_t st[4];
  for (int pass = 0; pass < 2; ++pass) {
    cudaGraph_t graph = NULL;
    if (pass == 1) GU_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    st[0] = moelink_moe_route(gmoe, dx, T, dids, dw, s);
    st[1] = moelink_moe_plan(gmoe, dids, T, dplan, s);
    st[2] = moelink_moe_experts(gmoe, dx, T, dplan, dw, dy, s);
    st[3] = moelink_moe_combine(gmoe, dy, T, dplan, dout, s);
    const int ok = st[0] == 0 && st[1] == 0 && st[2] == 0 && st[3] == 0;
    CHECK(ok, "%s: route/plan/experts/combine %s (%d %d %d %d: %s)", name,
          pass ? "under capture" : "eager", st[0], st[1], st[2], st[3], moelink_last_error());
    if (pass == 0) {
      GU_CUDA(cudaMemcpyAsync(eager, dout, xb, cudaMemcpyDeviceToHost, s));
      GU_CUDA(cudaStreamSynchronize(s));
      continue;
    }
    cudaError_t ce = cudaStreamEndCapture(s, &graph);
    CHECK(ce == cudaSuccess, "%s: capture ends cleanly (%s)", name, cudaGetErrorString(ce));
    if (!ok || ce != cudaSuccess) {
      (void)cudaGetLastError();
      if (graph) cudaGraphDestroy(graph);
      break;
    }
    cudaGraphExec_t exec = NULL;
    GU_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    int mism = 0;
    for (int r = 0; r < 10; ++r) {
      GU_CUDA(cudaMemsetAsync(dout, 0xFF, xb, s));
      GU_CUDA(cudaMemsetAsync(dplan, 0xFF, pb, s));
      GU_CUDA(cudaGraphLaunch(exec, s));
      GU_CUDA(cudaMemcpyAsync(rep, dout, xb, cudaMemcpyDeviceToHost, s));
      GU_CUDA(cudaStreamSynchronize(s));
      mism += memcmp(rep, eager, xb) != 0;
    }
    CHECK(mism == 0, "%s: 10 replays bitwise equal to eager (%d differ)", name, mism);
    GU_CUDA(cudaGraphExecDestroy(exec));
    GU_CUDA(cudaGraphDestroy(graph));
  }
  GU_CUDA(cudaStreamDestroy(s));
  free(hx);
  free(eager);
  free(rep);
  gu_free(dx);
  gu_free(dout);
  gu_free(dplan);
  gu_free(dy);
  gu_free(dids);
  gu_free(dw);
  moelink_moe_destroy(gmoe);
  gu_dev_layer_free(&D);
  ref_layer_free(&L);
}

static moelink_moe_config_t reduced(const char *preset, moelink_dtype_t dt, int max_tokens) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  if (moelink_moe_preset(preset, &c) != MOELINK_SUCCESS) {
    CHECK(0, "preset %s: %s", preset, moelink_last_error());
    gu_bail("unknown preset");
  }
  c.hidden = 256;
  c.inter = 128;
  if (c.shared_inter > 0) c.shared_inter = 256;
  c.dtype = dt;
  c.max_tokens = max_tokens;
  return c;
}

int main(void) {
  gu_contexts(&g_gpu, &g_cpu);
  /* Three chunks; the first two sort 8192 pairs (cub's multi-pass path), the
   * last fewer (its single-tile path). */
  const int side_before = ml_cuda_layer_side_forwards();
  const int overlap_before = ml_cuda_layer_overlap_forwards();
  graph_case("deepseek-v3 reduced", reduced("deepseek-v3", MOELINK_DTYPE_BF16, 1024), 0.0, 2500,
             5, 31, 0);
  /* its chunks (1024, 1024 and 452 tokens) take the shared expert's side
   * stream exactly when MOELINK_SHARED_SIDE_SMS (default 16, rounded down to
   * even) asks for it and the device has 4 times that many SMs
   * (gpu_test_cuda_graph_inline runs it with 0, gpu_test_cuda_graph_side_cap
   * with the routed GEMMs' grids short of the side stream's SMs) */
  const char *side_env = getenv("MOELINK_SHARED_SIDE_SMS");
  const int side_sms = (side_env != NULL ? atoi(side_env) : 16) & ~1;
  int dev = 0, sms = 0;
  GU_CUDA(cudaGetDevice(&dev));
  GU_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int side_on = side_sms >= 2 && side_sms <= sms / 4;
  const int side_runs = ml_cuda_layer_side_forwards() - side_before;
  CHECK(side_on ? side_runs > 0 : side_runs == 0,
        "deepseek-v3 reduced: %d forwards on the shared expert's side stream (asked: %s)",
        side_runs, side_on ? "yes" : "no");
  /* and their routed GEMMs overlap (the down GEMM on the gate/up GEMM's last
   * wave) where both take the sm_90a engine and MOELINK_GEMM_OVERLAP asks
   * for it: 1 always, 2 (the default) when the shared expert is not on the
   * side stream, 0 never (gpu_test_cuda_graph_overlap runs it with 1) */
  const char *ov_env = getenv("MOELINK_GEMM_OVERLAP");
  const int ov_mode = ov_env != NULL ? atoi(ov_env) : 2;
  const moelink_moe_config_t ds = reduced("deepseek-v3", MOELINK_DTYPE_BF16, 1024);
  const int ov_engine = ml_cuda_gemm_overlap_ok(ds.dtype, ds.inter, ds.hidden, ds.hidden, ds.inter);
  const int ov_on = ov_engine && (ov_mode == 1 || (ov_mode == 2 && !side_on));
  const int overlap_runs = ml_cuda_layer_overlap_forwards() - overlap_before;
  CHECK(ov_on ? overlap_runs > 0 : overlap_runs == 0,
        "deepseek-v3 reduced: %d routed GEMM pairs overlapped (asked: %s; the sm_90a engine "
        "takes both: %s)",
        overlap_runs, ov_on ? "yes" : "no", ov_engine ? "yes" : "no");
  /* Decode size: the router splits the hidden dimension over CTAs and uses
   * tickets that every run must leave at zero: 50 replays. */
  graph_case("qwen2-57b-a14b reduced", reduced("qwen2-57b-a14b", MOELINK_DTYPE_F16, 64), 0.0, 7,
             50, 32, 1);
  /* A decode step of deepseek-v3's routing (groups, bias, shared expert):
   * the shared gate/up GEMM first, the router beside it as a programmatic
   * dependent, the plan built by the router (T <= 16). */
  graph_case("deepseek-v3 reduced, decode", reduced("deepseek-v3", MOELINK_DTYPE_BF16, 16), 0.0,
             1, 20, 36, 0);
  graph_case("deepseek-v3 reduced, 16 tokens", reduced("deepseek-v3", MOELINK_DTYPE_BF16, 16),
             0.0, 16, 20, 37, 0);
  /* One token of layers without a shared expert (FP8 experts too): by default the one-kernel
   * layer (a cooperative launch whose counters every replay must leave at
   * zero), the kernel-per-step pipeline in the variant
   * gpu_test_cuda_graph_pipeline (MOELINK_SMALL_LAYER_TOKENS=0). */
  graph_case("mixtral-8x7b reduced, one token", reduced("mixtral-8x7b", MOELINK_DTYPE_BF16, 16),
             0.0, 1, 20, 38, 0);
  graph_case("qwen3-30b-a3b reduced, one token", reduced("qwen3-30b-a3b", MOELINK_DTYPE_F16, 16),
             0.0, 1, 20, 39, 0);
  moelink_moe_config_t f8 = reduced("qwen3-30b-a3b", MOELINK_DTYPE_BF16, 16);
  f8.fp8_experts = 1;
  graph_case("qwen3-30b-a3b reduced fp8, one token", f8, 0.0, 1, 20, 40, 0);
  /* Every token on experts 0 and 1: long tile lists for two experts. */
  graph_case("mixtral-8x7b reduced, skewed", reduced("mixtral-8x7b", MOELINK_DTYPE_BF16, 4097),
             30.0, 4097, 3, 33, 0);
  pieces_case("qwen2-57b-a14b reduced", reduced("qwen2-57b-a14b", MOELINK_DTYPE_F16, 64), 7, 34);
  pieces_case("deepseek-v3 reduced", reduced("deepseek-v3", MOELINK_DTYPE_BF16, 1024), 1024, 35);
  moelink_context_destroy(g_gpu);
  moelink_context_destroy(g_cpu);
  return ml_test_done();
}
