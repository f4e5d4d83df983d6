/* moelink run: one layer on generated weights, timed once after a warm-up,
 * optionally checked against the reference. */
#include "cli.h"
#include "gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void cli_print_time(const char *label, double ms) {
  if (ms < 1.0)
    printf("%-10s %.1f us\n", label, ms * 1e3);
  else
    printf("%-10s %.3f ms\n", label, ms);
}

int cli_cmd_run(int argc, char **argv) {
  cli_opts o;
  cli_parse(argc, argv, 0, &o);
  const moelink_moe_config_t *c = &o.cfg;
  const int T = o.tokens;
  const int cuda = o.backend == MOELINK_BACKEND_CUDA;
  const size_t ds = moelink_dtype_size(c->dtype);
  const size_t act_bytes = (size_t)T * (size_t)c->hidden * ds;

  cli_session ss;
  cli_session_open(&o, &ss);
  moelink_context_t ctx = ss.ctx;
  void *stream = ss.stream;
  moelink_moe_t moe = ss.moe;

  cli_print_config(&o, T);
  if (cuda) {
    char name[256];
    if (gpu_device_name(name, sizeof name) != 0) cli_fail("%s", gpu_error());
    printf("device     %s\n", name);
  }
  fflush(stdout);

  cli_layer L;
  double t0 = cli_now();
  cli_layer_make(&L, ctx, c, o.seed, o.zipf, stream);
  double gen_s = cli_now() - t0;
  CLI_CALL("moelink_moe_set_weights", moelink_moe_set_weights(moe, &L.w));
  char wb[32];
  cli_fmt_bytes(L.weight_bytes, wb, sizeof wb);
  /* FP8 weights on the GPU are generated on the host and copied. */
  printf("weights    %s (generated in %.2f s on the %s)\n", wb, gen_s,
         cuda && !c->fp8_experts && !c->fp8_shared ? "GPU" : "host");

  void *x = cli_malloc(act_bytes, "x");
  void *out = cli_malloc(act_bytes, "out");
  cli_make_x(&L, x, T);
  void *dx = x, *dout = out;
  if (cuda) {
    if (gpu_malloc(&dx, act_bytes, "x") || gpu_malloc(&dout, act_bytes, "out") ||
        gpu_h2d(dx, x, act_bytes))
      cli_fail("%s", gpu_error());
  }

  double ms = 0.0;
  CLI_CALL("moelink_moe_forward (warm-up)", moelink_moe_forward(moe, dx, T, dout, stream));
  /* All-ones bytes are NaN in every dtype: an element the timed run does
   * not write fails verification. */
  if (cuda) {
    gpu_timer tm;
    if (gpu_stream_sync(stream) || gpu_memset_async(dout, 0xff, act_bytes, stream) ||
        gpu_timer_create(&tm) || gpu_timer_start(&tm, stream))
      cli_fail("%s", gpu_error());
    CLI_CALL("moelink_moe_forward", moelink_moe_forward(moe, dx, T, dout, stream));
    if (gpu_timer_stop(&tm, stream, &ms) || gpu_d2h(out, dout, act_bytes))
      cli_fail("forward: %s", gpu_error());
    gpu_timer_destroy(&tm);
  } else {
    memset(out, 0xff, act_bytes);
    double a = cli_now();
    CLI_CALL("moelink_moe_forward", moelink_moe_forward(moe, x, T, out, NULL));
    ms = (cli_now() - a) * 1e3;
  }

  double flops = moelink_moe_flops(c, T);
  cli_print_time("time", ms);
  printf("tokens/s   %.1f\n", ms > 0.0 ? T / (ms * 1e-3) : 0.0);
  printf("GFLOP/s    %.2f  (%.4g GFLOP per forward)\n", ms > 0.0 ? flops / (ms * 1e-3) / 1e9 : 0.0,
         flops / 1e9);
  fflush(stdout);

  int rc = 0;
  if (o.verify) {
    cli_verify_result r;
    cli_layer_make_host(&L);
    cli_verify(&L, x, out, T, o.verify_tokens, &r);
    printf("verify     %d of %d tokens  rel L2 %.3e  max abs %.3e  (tol %.0e)  %s\n", r.checked,
           r.total, r.rel_l2, r.max_abs, r.tol, r.pass ? "PASS" : "FAIL");
    if (!r.pass) rc = CLI_EXIT_FAIL;
  }

  if (cuda) {
    gpu_free(dx);
    gpu_free(dout);
  }
  free(x);
  free(out);
  cli_layer_free(&L);
  cli_session_close(&ss);
  fflush(stdout);
  if (rc) fprintf(stderr, "moelink: error: verification failed: relative L2 error above the tolerance\n");
  return rc;
}
