/* The one-kernel layer of a few tokens (ml_cuda_moe_small) against the CPU
 * backend's forward of the same layer:
 *  - every router family (softmax with and without renormalization,
 *    top-k-then-softmax, sigmoid with bias and groups, softmax with groups),
 *    E from 8 to 512, k from 1 to 16, shapes that are not multiples of the
 *    kernel's 64 / 128 blocks, bf16 and f16; FP8 experts (e4m3 weights with
 *    block scales, the inputs quantized per 128) on bf16 and f16 layers,
 *    within the FP8 tolerance of one token;
 *  - T in {1, 2, 3, 8}, on every SM and on 1, 3 and 7 CTAs (units cut across
 *    CTAs in other places, partial sums through other tickets), and at 1 and
 *    2 tokens on as many CTAs as down units (one whole unit a CTA);
 *  - the kernel's own choice of experts and weights (CTA 0's) against the
 *    CPU router's; outputs poisoned before each run; a second run bitwise
 *    equal; the counters left zero; tokens whose routing is a near tie left
 *    out of the output comparison; router rows in equal pairs, whose exact
 *    ties must go to the lower expert;
 *  - beside the GPU pipeline's forward of the same tokens (T > 1, which the
 *    layer does not send to the kernel by default);
 *  - what it refuses: too many tokens, a shared expert, FP8 shapes off the
 *    128-blocks, NULL (FP8: missing scales) and misaligned operands. */
#include "cuda/pipeline.h"
#include "gpu_util.h"

static moelink_context_t g_gpu, g_cpu;
static int g_sms, g_optin;

/* With router rows 2i and 2i + 1 equal (and their biases), every selection
 * value comes twice, bit for bit, and a tie goes to the lower expert: 2i + 1
 * is chosen only right after 2i, and 2i in any slot but the last is followed
 * by 2i + 1. Checks that order in the kernel's choice (the CPU comparison
 * would let a tie pass as a near tie). */
static void check_pairs(const char *what, const int32_t *ids, int T, int k) {
  long bad = 0;
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t e = ids[(size_t)t * k + j];
      if (e & 1)
        bad += !(j > 0 && ids[(size_t)t * k + j - 1] == e - 1);
      else if (j + 1 < k)
        bad += ids[(size_t)t * k + j + 1] != e + 1;
    }
  CHECK(bad == 0, "%s: exact ties go to the lower expert (%ld slots out of order)", what, bad);
}

/* pairs: the router's rows come in equal pairs (test_exact_ties) */
static void run_case(const char *name, const ref_layer *L, const gu_dev_layer *D,
                     moelink_moe_t gmoe, moelink_moe_t cmoe, int T, int ctas, int pairs) {
  const moelink_moe_config_t *cfg = &L->cfg;
  const moelink_dtype_t dt = cfg->dtype;
  const size_t es = moelink_dtype_size(dt), H = (size_t)cfg->hidden, xb = (size_t)T * H * es;
  const int k = cfg->top_k;
  char what[400];
  snprintf(what, sizeof what, "%s T %d ctas %d", name, T, ctas);
  if (!ml_cuda_moe_small_fits(cfg, T, g_optin)) {
    CHECK(0, "%s: the kernel takes the layer", what);
    return;
  }

  size_t zero = 0;
  const size_t sb = ml_cuda_moe_small_scratch(cfg, g_sms, &zero);
  void *scratch = gu_dev(sb);
  GU_CUDA(cudaMemset(scratch, 0, zero));
  void *hx = gu_host(xb);
  ref_fill_x(L, hx, T, 3000u + (unsigned)T);
  void *dx = gu_dev(xb), *dout = gu_dev(xb), *dout2 = gu_dev(xb), *dpipe = gu_dev(xb);
  int32_t *dids = gu_dev((size_t)T * k * 4);
  float *dw = gu_dev((size_t)T * k * 4);
  gu_h2d(dx, hx, xb);
  gu_poison(dout, xb);
  gu_poison(dout2, xb);
  gu_poison(dids, (size_t)T * k * 4);

  ml_cuda_moe_small_args a =
      ml_cuda_moe_small_args_for(cfg, &D->w, dx, T, dout, scratch, sb, g_sms);
  a.ctas = ctas;
  a.ids = dids;
  a.weights = dw;
  CHECK_OK(ml_cuda_moe_small(&a, NULL), what);
  GU_CUDA(cudaDeviceSynchronize());
  a.out = dout2;
  a.ids = NULL;
  a.weights = NULL;
  CHECK_OK(ml_cuda_moe_small(&a, NULL), "second run");
  GU_CUDA(cudaDeviceSynchronize());

  void *go = gu_host(xb), *go2 = gu_host(xb), *co = gu_host(xb), *po = gu_host(xb);
  gu_d2h(go, dout, xb);
  gu_d2h(go2, dout2, xb);
  CHECK(memcmp(go, go2, xb) == 0, "%s: two runs bitwise equal", what);
  unsigned char *z = gu_host(zero);
  gu_d2h(z, scratch, zero);
  size_t nz = 0;
  for (size_t i = 0; i < zero; ++i)
    nz += z[i] != 0;
  CHECK(nz == 0, "%s: every counter back to zero (%zu bytes not)", what, nz);

  /* the kernel's routing against the CPU router's */
  int32_t *gi = gu_host((size_t)T * k * 4);
  unsigned char *tie = gu_host((size_t)T);
  const gu_route_stats rs = gu_routes_check(what, L, cmoe, hx, T, dids, dw, gi, tie);
  if (pairs)
    check_pairs(what, gi, T, k);

  CHECK_OK(moelink_moe_forward(cmoe, hx, T, co, NULL), "CPU forward");
  gu_err e = gu_compare(dt, go, co, (size_t)T, H, tie);
  /* FP8: a few tokens, each within one token's FP8 bound */
  const double tol = cfg->fp8_experts ? GU_FP8_TOL_ROW : GU_TOL;
  const double tol_row = cfg->fp8_experts ? GU_FP8_TOL_ROW : GU_TOL_ROW;
  gu_check_err_tol(what, e, dt, go, co, H, tol, tol_row);

  /* beside the GPU pipeline (T = 1 is this kernel itself there) */
  if (T > 1) {
    CHECK_OK(moelink_moe_forward(gmoe, dx, T, dpipe, NULL), "GPU forward");
    gu_d2h(po, dpipe, xb);
    gu_err ep = gu_compare(dt, go, po, (size_t)T, H, tie);
    char w2[440];
    snprintf(w2, sizeof w2, "%s beside the GPU pipeline", what);
    gu_check_err_tol(w2, ep, dt, go, po, H, tol, tol_row);
  }
  ml_t_diag("%s: rel L2 %.2e against the CPU, %d near ties", what, e.rel, rs.near_ties);

  free(hx);
  free(go);
  free(go2);
  free(co);
  free(po);
  free(z);
  free(gi);
  free(tie);
  gu_free(scratch);
  gu_free(dx);
  gu_free(dout);
  gu_free(dout2);
  gu_free(dpipe);
  gu_free(dids);
  gu_free(dw);
}

static void layer(const char *label, const moelink_moe_config_t *cfg, uint64_t seed) {
  char desc[200], name[320];
  gu_describe(desc, sizeof desc, cfg);
  snprintf(name, sizeof name, "%s (%s)", label, desc);
  ref_layer L;
  gu_dev_layer D;
  moelink_moe_t gmoe = NULL, cmoe = NULL;
  if (gu_layer_setup(name, cfg, seed, 0.0, g_gpu, g_cpu, &L, &D, &gmoe, &cmoe) != 0)
    return;
  const int Ts[] = {1, 2, 3, 8};
  const int ctas[] = {0, 7, 1, 3};
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      if (Ts[i] > 3 && j > 1)
        continue; /* the slow grids on the short batches */
      run_case(name, &L, &D, gmoe, cmoe, Ts[i], ctas[j], 0);
    }
    /* as many CTAs as down units (T k row blocks of 128): each takes one
     * whole unit (MOELINK_SMALL_LAYER_WHOLE_DOWN), no partial sums */
    const int units = Ts[i] * cfg->top_k * ((cfg->hidden + 127) / 128);
    if (Ts[i] <= 2 && units > 3 && units != 7 && units < g_sms)
      run_case(name, &L, &D, gmoe, cmoe, Ts[i], units, 0);
  }
  moelink_moe_destroy(gmoe);
  moelink_moe_destroy(cmoe);
  gu_dev_layer_free(&D);
  ref_layer_free(&L);
}

static moelink_moe_config_t base(const char *preset, int H, int I, moelink_dtype_t dt) {
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  GU_MUST(moelink_moe_preset(preset, &c), preset);
  c.hidden = H;
  c.inter = I;
  c.shared_inter = 0;
  c.shared_gate = 0;
  c.dtype = dt;
  c.max_tokens = 64;
  return c;
}

static void test_layers(void) {
  moelink_moe_config_t c;
  c = base("mixtral-8x7b", 256, 384, MOELINK_DTYPE_BF16);
  layer("mixtral-8x7b", &c, 900);
  c = base("qwen3-30b-a3b", 512, 192, MOELINK_DTYPE_F16);
  layer("qwen3-30b-a3b", &c, 901);
  /* softmax without renormalization, k = 1, shapes off the 64 / 128 blocks */
  c = base("mixtral-8x7b", 264, 200, MOELINK_DTYPE_BF16);
  c.num_experts = 24;
  c.top_k = 1;
  c.renormalize = 0;
  layer("k1-odd", &c, 902);
  /* top-k of the logits, softmax over the k */
  c = base("mixtral-8x7b", 384, 136, MOELINK_DTYPE_F16);
  c.num_experts = 32;
  c.top_k = 4;
  c.router = MOELINK_ROUTER_TOPK_SOFTMAX;
  c.renormalize = 0;
  layer("topk-softmax", &c, 903);
  /* softmax scores with a bias and group-limited selection */
  c = base("mixtral-8x7b", 256, 128, MOELINK_DTYPE_BF16);
  gu_softmax_groups(&c);
  layer("softmax-groups", &c, 904);
  /* DeepSeek's router (sigmoid, bias, 8 groups keep 4, scale 2.5) without
   * its shared expert */
  c = base("deepseek-v3", 256, 128, MOELINK_DTYPE_BF16);
  layer("deepseek-v3 routed", &c, 905);
  /* the widest selection: 512 experts, k = 16 */
  c = base("qwen3-30b-a3b", 128, 64, MOELINK_DTYPE_BF16);
  c.num_experts = 512;
  c.top_k = 16;
  layer("E512-k16", &c, 906);
  /* FP8 experts (hidden and inter multiples of 128): bf16 and f16, the
   * gate/up unit's two halves in different scale blocks (inter 384: odd
   * scale rows), DeepSeek's router */
  c = base("mixtral-8x7b", 256, 384, MOELINK_DTYPE_BF16);
  c.fp8_experts = 1;
  layer("mixtral-8x7b fp8", &c, 907);
  c = base("qwen3-30b-a3b", 512, 256, MOELINK_DTYPE_F16);
  c.fp8_experts = 1;
  layer("qwen3-30b-a3b fp8", &c, 908);
  c = base("deepseek-v3", 384, 128, MOELINK_DTYPE_BF16);
  c.fp8_experts = 1;
  layer("deepseek-v3 routed fp8", &c, 909);
}

/* Router rows (and biases) in equal pairs: exact ties in every token's
 * selection, on the softmax router and on DeepSeek's (groups of 32 hold
 * whole pairs), 1 and 3 tokens. */
static void test_exact_ties(void) {
  const char *presets[] = {"qwen3-30b-a3b", "deepseek-v3"};
  for (int pi = 0; pi < 2; ++pi) {
    moelink_moe_config_t c = base(presets[pi], 256, 128, MOELINK_DTYPE_BF16);
    char desc[200], name[320];
    gu_describe(desc, sizeof desc, &c);
    snprintf(name, sizeof name, "%s ties (%s)", presets[pi], desc);
    ref_layer L;
    if (ref_layer_make(&L, &c, 910u + (unsigned)pi, 0.0) != 0) {
      CHECK(0, "ref_layer_make for %s", name);
      continue;
    }
    const size_t row = (size_t)c.hidden * moelink_dtype_size(c.dtype);
    for (int e = 0; e + 1 < c.num_experts; e += 2) {
      memcpy((char *)L.router + (size_t)(e + 1) * row, (char *)L.router + (size_t)e * row, row);
      if (L.bias != NULL)
        L.bias[e + 1] = L.bias[e];
    }
    gu_dev_layer D;
    gu_dev_layer_upload(&D, &L);
    moelink_moe_t gmoe = NULL, cmoe = NULL;
    GU_MUST(moelink_moe_create(g_gpu, &c, &gmoe), "GPU layer");
    GU_MUST(moelink_moe_create(g_cpu, &c, &cmoe), "CPU layer");
    GU_MUST(moelink_moe_set_weights(gmoe, &D.w), "GPU weights");
    GU_MUST(moelink_moe_set_weights(cmoe, &L.w), "CPU weights");
    run_case(name, &L, &D, gmoe, cmoe, 1, 0, 1);
    run_case(name, &L, &D, gmoe, cmoe, 3, 0, 1);
    moelink_moe_destroy(gmoe);
    moelink_moe_destroy(cmoe);
    gu_dev_layer_free(&D);
    ref_layer_free(&L);
  }
}

static void test_refusals(void) {
  moelink_moe_config_t c = base("mixtral-8x7b", 256, 128, MOELINK_DTYPE_BF16);
  CHECK(!ml_cuda_moe_small_fits(&c, 9, g_optin), "nine tokens are refused");
  CHECK(!ml_cuda_moe_small_fits(&c, 0, g_optin), "no tokens: not the kernel's");
  moelink_moe_config_t sh = c;
  sh.shared_inter = 256;
  CHECK(!ml_cuda_moe_small_fits(&sh, 1, g_optin), "a shared expert is refused");
  moelink_moe_config_t f8 = c;
  f8.fp8_experts = 1;
  CHECK(ml_cuda_moe_small_fits(&f8, 1, g_optin), "FP8 experts are taken");
  f8.inter = 192;
  CHECK(!ml_cuda_moe_small_fits(&f8, 1, g_optin), "FP8 off the 128-blocks is refused");
  moelink_moe_config_t small = c;
  small.max_tokens = 2;
  CHECK(!ml_cuda_moe_small_fits(&small, 3, g_optin), "no more tokens than max_tokens");
  CHECK(ml_cuda_moe_small_fits(&c, 8, g_optin), "eight tokens are taken");

  size_t zero = 0;
  const size_t sb = ml_cuda_moe_small_scratch(&c, g_sms, &zero);
  char *scratch = gu_dev(sb + 16);
  GU_CUDA(cudaMemset(scratch, 0, zero));
  const size_t H = (size_t)c.hidden;
  char *x = gu_dev(H * 2 + 16), *out = gu_dev(H * 2 + 16);
  char *w = gu_dev(gu_elems_gate_up(&c) * 2);
  moelink_moe_weights_t ww = MOELINK_MOE_WEIGHTS_INIT;
  ww.router = w;
  ww.gate_up = w;
  ww.down = w;
  ml_cuda_moe_small_args a = ml_cuda_moe_small_args_for(&c, &ww, x, 1, NULL, scratch, sb, g_sms);
  CHECK(ml_cuda_moe_small(&a, NULL) == MOELINK_ERR_INVALID_ARGUMENT, "NULL out refused: %s",
        moelink_last_error());
  moelink_moe_config_t f8n = c;
  f8n.fp8_experts = 1;
  a.cfg = &f8n;
  a.out = out;
  CHECK(ml_cuda_moe_small(&a, NULL) == MOELINK_ERR_INVALID_ARGUMENT,
        "FP8 experts without block scales refused: %s", moelink_last_error());
  a.cfg = &c;
  a.out = out + 2;
  CHECK(ml_cuda_moe_small(&a, NULL) == MOELINK_ERR_UNSUPPORTED, "misaligned out refused: %s",
        moelink_last_error());
  a.out = out;
  a.num_tokens = 9;
  CHECK(ml_cuda_moe_small(&a, NULL) == MOELINK_ERR_UNSUPPORTED, "nine tokens refused: %s",
        moelink_last_error());
  a.num_tokens = 1;
  a.scratch_bytes = sb - 1;
  CHECK(ml_cuda_moe_small(&a, NULL) == MOELINK_ERR_INTERNAL, "short scratch refused: %s",
        moelink_last_error());
  GU_CUDA(cudaDeviceSynchronize());
  gu_free(scratch);
  gu_free(x);
  gu_free(out);
  gu_free(w);
}

int main(void) {
  gu_contexts(&g_gpu, &g_cpu);
  int dev = 0;
  GU_CUDA(cudaGetDevice(&dev));
  GU_CUDA(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, dev));
  GU_CUDA(cudaDeviceGetAttribute(&g_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  int major = 0, minor = 0;
  GU_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  GU_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major == 9 && minor == 0) {
    test_refusals();
    test_layers();
    test_exact_ties();
  } else {
    ml_t_diag("compute capability %d.%d: the kernel is sm_90a machine code only", major, minor);
  }
  moelink_context_destroy(g_gpu);
  moelink_context_destroy(g_cpu);
  return ml_test_done();
}
