/* moelink bench: the layer's median time per token count, beside what the
 * same machine does on the work that bounds it, measured in the same run:
 *  - CPU: two dense OpenBLAS sgemm calls with the routed experts' shapes;
 *  - CUDA: read bandwidth and the cuBLAS bf16 matmul rate (tools/floors.cu),
 *    turned into a floor per T from the weight bytes the tokens touch. */
#include "cli.h"
#include "gpu.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* A buffer larger than the H200's 50 MB L2, written before each timed
 * iteration so the weights come from HBM as they would between layers. */
/* Floor measurements: >= 2 GiB streamed, 8192^3 bf16 GEMM, median of 10. */
#define CLI_READ_BYTES ((size_t)2 << 30)
#define CLI_MATMUL_N 8192
#define CLI_FLOOR_ITERS 10

typedef struct bench_row {
  int tokens;
  double ms_med, ms_min, flops, tokens_s, flop_s;
  /* CUDA */
  int touched;
  double bytes, gbps, floor_ms, pct_floor;
  /* CPU */
  double blas_ms, blas_flops, blas_flop_s, pct_blas;
} bench_row;

typedef struct bench_floors {
  double read_gbps, matmul_tflops;
} bench_floors;





static void write_json(const char *path, const cli_opts *o, const char *device, int threads,
                       const bench_floors *fl, const bench_row *rows, int nrows) {
  const moelink_moe_config_t *c = &o->cfg;
  const int cuda = o->backend == MOELINK_BACKEND_CUDA;
  FILE *f = fopen(path, "w");
  if (!f) cli_fail("--json: cannot open '%s' for writing", path);
  char skew[32];
  cli_skew_string(o->zipf, skew, sizeof skew);

  cli_json_begin(f, "moelink bench");
  fprintf(f, ",\n  \"backend\": \"%s\",\n  \"%s\": ", cuda ? "cuda" : "cpu", cuda ? "gpu" : "cpu");
  cli_json_str(f, device);
  if (!cuda) fprintf(f, ",\n  \"threads\": %d", threads);
  if (cuda) fprintf(f, ",\n  \"timing\": \"%s\"", o->graph ? "cuda graph replay" : "eager");
  fprintf(f, ",\n  \"config\": {\"layer\": ");
  cli_json_str(f, cli_shape_name(o));
  fprintf(f,
          ", \"hidden\": %d, \"inter\": %d, \"experts\": %d, \"top_k\": %d, \"router\": \"%s\", "
          "\"renormalize\": %d, \"n_group\": %d, \"topk_group\": %d, \"routed_scaling\": ",
          c->hidden, c->inter, c->num_experts, c->top_k, cli_router_name(c->router),
          c->renormalize, c->n_group, c->topk_group);
  cli_json_num(f, c->routed_scaling);
  fprintf(f,
          ", \"correction_bias\": %d, \"shared_inter\": %d, \"shared_gate\": %d, \"dtype\": "
          "\"%s\", \"fp8_experts\": %d, \"fp8_shared\": %d, \"max_tokens\": %d, \"seed\": "
          "%llu, \"skew\": \"%s\"},\n",
          c->correction_bias, c->shared_inter, c->shared_gate, moelink_dtype_name(c->dtype),
          c->fp8_experts, c->fp8_shared, c->max_tokens, (unsigned long long)o->seed, skew);
  fprintf(f, "  \"iters\": %d,\n  \"warmup\": %d,\n", o->iters, o->warmup);
  if (cuda) {
    fprintf(f, "  \"floors\": {\"read_GBps\": ");
    cli_json_num(f, fl->read_gbps);
    fprintf(f, ", \"read_buffer_bytes\": %zu, \"matmul_TFLOPs\": ", CLI_READ_BYTES);
    cli_json_num(f, fl->matmul_tflops);
    fprintf(f, ", \"matmul\": \"cublasGemmEx bf16 %d^3, fp32 compute\", \"iters\": %d, "
               "\"l2_flush_bytes\": %zu, \"l2_flush\": \"%s\"},\n",
            CLI_MATMUL_N, CLI_FLOOR_ITERS, CLI_L2_FLUSH_BYTES, cli_l2_flush_name());
  } else {
    fprintf(f, "  \"baseline\": \"cblas_sgemm [T*k,H]x[H,2I] + [T*k,I]x[I,H]\",\n");
  }
  fprintf(f, "  \"rows\": [\n");
  for (int i = 0; i < nrows; ++i) {
    const bench_row *r = &rows[i];
    fprintf(f, "    {\"tokens\": %d, \"median_ms\": ", r->tokens);
    cli_json_num(f, r->ms_med);
    fprintf(f, ", \"min_ms\": ");
    cli_json_num(f, r->ms_min);
    fprintf(f, ", \"flops\": ");
    cli_json_num(f, r->flops);
    fprintf(f, ", \"tokens_per_s\": ");
    cli_json_num(f, r->tokens_s);
    if (cuda) {
      fprintf(f, ", \"TFLOPs\": ");
      cli_json_num(f, r->flop_s / 1e12);
      fprintf(f, ", \"experts_touched\": %d, \"bytes\": ", r->touched);
      cli_json_num(f, r->bytes);
      fprintf(f, ", \"GBps\": ");
      cli_json_num(f, r->gbps);
      fprintf(f, ", \"floor_ms\": ");
      cli_json_num(f, r->floor_ms);
      fprintf(f, ", \"pct_of_floor\": ");
      cli_json_num(f, r->pct_floor);
    } else {
      fprintf(f, ", \"GFLOPs\": ");
      cli_json_num(f, r->flop_s / 1e9);
      fprintf(f, ", \"sgemm_ms\": ");
      cli_json_num(f, r->blas_ms);
      fprintf(f, ", \"sgemm_GFLOPs\": ");
      cli_json_num(f, r->blas_flop_s / 1e9);
      fprintf(f, ", \"pct_of_sgemm\": ");
      cli_json_num(f, r->pct_blas);
    }
    fprintf(f, "}%s\n", i + 1 < nrows ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  if (fclose(f) != 0) cli_fail("--json: error writing '%s'", path);
}

/* Experts that at least one of the T tokens routes to: the weights a
 * forward must read. Routed once into device buffers, outside the timing. */
static int count_touched(moelink_moe_t moe, const moelink_moe_config_t *c, const void *dx,
                         int T, int32_t *d_ids, float *d_w, void *stream) {
  size_t n = (size_t)T * (size_t)c->top_k;
  int32_t *ids = (int32_t *)cli_malloc(n * sizeof *ids, "routing ids");
  unsigned char *seen = (unsigned char *)calloc((size_t)c->num_experts, 1);
  if (!seen) cli_fail("out of host memory");
  CLI_CALL("moelink_moe_route", moelink_moe_route(moe, dx, T, d_ids, d_w, stream));
  if (gpu_stream_sync(stream) || gpu_d2h(ids, d_ids, n * sizeof *ids))
    cli_fail("route: %s", gpu_error());
  int touched = 0;
  for (size_t i = 0; i < n; ++i) {
    int32_t e = ids[i];
    if (e < 0 || e >= c->num_experts)
      cli_fail("moelink_moe_route returned expert id %d outside [0, %d) for pair %zu", (int)e,
               c->num_experts, i);
    if (!seen[e]) {
      seen[e] = 1;
      ++touched;
    }
  }
  free(ids);
  free(seen);
  return touched;
}

int cli_cmd_bench(int argc, char **argv) {
  cli_opts o;
  cli_parse(argc, argv, 1, &o);
  (void)cli_l2_flush_name(); /* a bad MOELINK_BENCH_L2_FLUSH is a usage error on any backend */
  const moelink_moe_config_t *c = &o.cfg;
  const int cuda = o.backend == MOELINK_BACKEND_CUDA;
  if (!cuda && o.graph) cli_usage_error("--graph: CUDA graphs need --backend cuda");
  if (o.iters < 0) o.iters = cuda ? 20 : 5;
  if (o.warmup < 0) o.warmup = cuda ? 3 : 1;
  const size_t ds = moelink_dtype_size(c->dtype);
  /* Not I: cblas.h pulls in complex.h, where I is the imaginary unit. */
  const size_t H = (size_t)c->hidden, In = (size_t)c->inter, k = (size_t)c->top_k;
  int tmax = 0;
  for (int i = 0; i < o.ntokens; ++i)
    if (o.token_list[i] > tmax) tmax = o.token_list[i];

  cli_session ss;
  cli_session_open(&o, &ss);
  moelink_context_t ctx = ss.ctx;
  void *stream = ss.stream;
  moelink_moe_t moe = ss.moe;

  char device[256];
  int threads = 0;
  bench_floors fl = {0.0, 0.0};
  if (cuda) {
    if (gpu_device_name(device, sizeof device) != 0) cli_fail("%s", gpu_error());
  } else {
    cli_cpu_model(device, sizeof device);
#ifdef _OPENMP
    threads = o.threads > 0 ? o.threads : omp_get_num_procs();
#else
    threads = 1;
#endif
    /* The baseline gets the same number of cores as the layer. */
    openblas_set_num_threads(threads);
  }
  cli_print_config(&o, 0);
  printf("device     %s\n", device);
  printf("timing     median of %d after %d warm-up%s%s\n", o.iters, o.warmup,
         cuda ? ", CUDA events, L2 flushed before each by a 256 MiB " : ", host clock",
         cuda ? cli_l2_flush_name() : "");
  fflush(stdout);

  if (cuda) {
    fprintf(stderr, "floors: measuring read bandwidth and bf16 matmul rate...\n");
    if (fl_read_bandwidth(CLI_READ_BYTES, CLI_FLOOR_ITERS, &fl.read_gbps) != 0)
      cli_fail("read bandwidth floor: %s", gpu_error());
    if (fl_matmul_rate(CLI_MATMUL_N, CLI_FLOOR_ITERS, &fl.matmul_tflops) != 0)
      cli_fail("matmul floor: %s", gpu_error());
    printf("floors     read %.0f GB/s (one pass over %.1f GiB)  matmul %.0f TFLOP/s (cuBLAS "
           "bf16 %d^3)\n",
           fl.read_gbps, (double)CLI_READ_BYTES / (1 << 30), fl.matmul_tflops, CLI_MATMUL_N);
    fflush(stdout);
  }

  cli_layer L;
  cli_layer_make(&L, ctx, c, o.seed, o.zipf, stream);
  CLI_CALL("moelink_moe_set_weights", moelink_moe_set_weights(moe, &L.w));
  const size_t act_bytes = (size_t)tmax * H * ds;
  void *x = cli_malloc(act_bytes, "x");
  cli_make_x(&L, x, tmax);
  void *dx = x, *dout = NULL, *flush = NULL;
  int32_t *d_ids = NULL;
  float *d_w = NULL;
  float *A = NULL, *B = NULL, *C = NULL, *A2 = NULL, *B2 = NULL, *C2 = NULL;
  gpu_timer tm = {NULL, NULL};
  if (cuda) {
    if (gpu_malloc(&dx, act_bytes, "x") || gpu_malloc(&dout, act_bytes, "out") ||
        gpu_malloc((void **)&d_ids, (size_t)tmax * k * sizeof(int32_t), "routing ids") ||
        gpu_malloc((void **)&d_w, (size_t)tmax * k * sizeof(float), "routing weights") ||
        gpu_malloc(&flush, CLI_L2_FLUSH_BYTES, "L2 flush buffer") || gpu_h2d(dx, x, act_bytes) ||
        gpu_timer_create(&tm))
      cli_fail("%s", gpu_error());
  } else {
    size_t M = (size_t)tmax * k;
    dout = cli_malloc(act_bytes, "out");
    /* Same operand layout as the experts: activations [rows, K] times a
     * weight stored [N, K] (a linear layer), so B is transposed. */
    A = (float *)cli_malloc(M * H * sizeof(float), "sgemm A");
    B = (float *)cli_malloc(2 * In * H * sizeof(float), "sgemm B");
    C = (float *)cli_malloc(M * 2 * In * sizeof(float), "sgemm C");
    A2 = (float *)cli_malloc(M * In * sizeof(float), "sgemm A2");
    B2 = (float *)cli_malloc(H * In * sizeof(float), "sgemm B2");
    C2 = (float *)cli_malloc(M * H * sizeof(float), "sgemm C2");
    CLI_CALL("moelink_fill_random", moelink_fill_random(ctx, MOELINK_DTYPE_F32, A, M * H, 11, 1.0f, 0.0f, NULL));
    CLI_CALL("moelink_fill_random", moelink_fill_random(ctx, MOELINK_DTYPE_F32, B, 2 * In * H, 12, 0.05f, 0.0f, NULL));
    CLI_CALL("moelink_fill_random", moelink_fill_random(ctx, MOELINK_DTYPE_F32, A2, M * In, 13, 1.0f, 0.0f, NULL));
    CLI_CALL("moelink_fill_random", moelink_fill_random(ctx, MOELINK_DTYPE_F32, B2, H * In, 14, 0.05f, 0.0f, NULL));
  }

  bench_row *rows = (bench_row *)calloc((size_t)o.ntokens, sizeof *rows);
  double *ms = (double *)cli_malloc(sizeof(double) * (size_t)o.iters, "timings");
  if (!rows) cli_fail("out of host memory");
  double steps = 0.0, done = 0.0;
  for (int i = 0; i < o.ntokens; ++i) steps += (o.warmup + o.iters) * (cuda ? 1 : 2);
  cli_progress prog;
  cli_progress_start(&prog, "bench");

  for (int ti = 0; ti < o.ntokens; ++ti) {
    const int T = o.token_list[ti];
    bench_row *r = &rows[ti];
    r->tokens = T;
    r->flops = moelink_moe_flops(c, T);
    if (cuda) {
      r->touched = count_touched(moe, c, dx, T, d_ids, d_w, stream);
      /* Routed and shared experts as stored (FP8: a byte a weight plus
       * the block scales); router and shared gate in the dtype. */
      r->bytes =
          (double)r->touched * cli_expert_bytes(c) + cli_shared_bytes(c) +
          (double)ds * ((double)c->num_experts * (double)H + (c->shared_gate ? (double)H : 0.0)) +
          (c->correction_bias ? 4.0 * c->num_experts : 0.0);
    }
    void *graph = NULL;
    if (cuda && o.graph) {
      /* One forward captured; replays run the same kernels with no launch
       * work on the host (what a decode loop in a serving engine does). */
      if (gpu_graph_begin(stream) != 0) cli_fail("%s", gpu_error());
      moelink_status_t s = moelink_moe_forward(moe, dx, T, dout, stream);
      if (gpu_graph_end(stream, &graph) != 0) cli_fail("graph capture (T=%d): %s", T, gpu_error());
      if (s != MOELINK_SUCCESS)
        cli_fail("moelink_moe_forward under capture: %s: %s", moelink_status_string(s),
                 moelink_last_error());
    }
    for (int it = -o.warmup; it < o.iters; ++it) {
      double t_ms;
      if (cuda) {
        if (cli_l2_flush(flush, it, stream) ||
            gpu_timer_start(&tm, stream))
          cli_fail("%s", gpu_error());
        if (graph) {
          if (gpu_graph_launch(graph, stream) != 0) cli_fail("%s", gpu_error());
        } else {
          CLI_CALL("moelink_moe_forward", moelink_moe_forward(moe, dx, T, dout, stream));
        }
        if (gpu_timer_stop(&tm, stream, &t_ms) != 0)
          cli_fail("forward (T=%d): %s", T, gpu_error());
      } else {
        double a = cli_now();
        CLI_CALL("moelink_moe_forward", moelink_moe_forward(moe, x, T, dout, NULL));
        t_ms = (cli_now() - a) * 1e3;
      }
      if (it >= 0) ms[it] = t_ms;
      cli_progress_update(&prog, ++done, steps, "runs");
    }
    gpu_graph_destroy(graph);
    r->ms_med = cli_median(ms, o.iters);
    r->ms_min = ms[0];
    r->tokens_s = r->ms_med > 0 ? T / (r->ms_med * 1e-3) : 0.0;
    r->flop_s = r->ms_med > 0 ? r->flops / (r->ms_med * 1e-3) : 0.0;
    if (cuda) {
      double s = r->ms_med * 1e-3;
      r->gbps = s > 0 ? r->bytes / s / 1e9 : 0.0;
      double floor_s = fmax(r->bytes / (fl.read_gbps * 1e9), r->flops / (fl.matmul_tflops * 1e12));
      r->floor_ms = floor_s * 1e3;
      r->pct_floor = s > 0 ? 100.0 * floor_s / s : 0.0;
    } else {
      const int M = T * (int)k, N1 = 2 * (int)In, Kh = (int)H, Ki = (int)In;
      for (int it = -o.warmup; it < o.iters; ++it) {
        double a = cli_now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N1, Kh, 1.0f, A, Kh, B, Kh, 0.0f,
                    C, N1);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, Kh, Ki, 1.0f, A2, Ki, B2, Ki,
                    0.0f, C2, Kh);
        double t_ms = (cli_now() - a) * 1e3;
        if (it >= 0) ms[it] = t_ms;
        cli_progress_update(&prog, ++done, steps, "runs");
      }
      r->blas_ms = cli_median(ms, o.iters);
      r->blas_flops = 2.0 * (double)M * (double)H * 3.0 * (double)In;
      r->blas_flop_s = r->blas_ms > 0 ? r->blas_flops / (r->blas_ms * 1e-3) : 0.0;
      r->pct_blas = r->blas_flop_s > 0 ? 100.0 * r->flop_s / r->blas_flop_s : 0.0;
    }
  }
  cli_progress_end(&prog);

  printf("\n");
  if (cuda) {
    printf("%7s %11s %11s %9s %8s %11s %9s %11s %8s\n", "T", "median us", "tokens/s", "TFLOP/s",
           "experts", "weights GB", "GB/s", "floor us", "% floor");
    for (int i = 0; i < o.ntokens; ++i) {
      const bench_row *r = &rows[i];
      printf("%7d %11.1f %11.0f %9.1f %8d %11.3f %9.0f %11.1f %7.1f%%\n", r->tokens,
             r->ms_med * 1e3, r->tokens_s, r->flop_s / 1e12, r->touched, r->bytes / 1e9, r->gbps,
             r->floor_ms * 1e3, r->pct_floor);
    }
    printf("\nfloor = max(weight bytes touched / read bandwidth, FLOPs / matmul rate); "
           "%% floor = floor / time\n");
    if (c->fp8_experts || c->fp8_shared)
      printf("fp8 %s: 1 byte per weight + an fp32 scale per 128x128 block; the matmul "
             "rate is still cuBLAS bf16's\n",
             c->fp8_experts && c->fp8_shared ? "experts and shared expert"
             : c->fp8_experts                ? "experts"
                                             : "shared expert");
  } else {
    printf("%7s %11s %11s %11s %9s %15s %12s\n", "T", "median ms", "min ms", "tokens/s",
           "GFLOP/s", "sgemm GFLOP/s", "% of sgemm");
    for (int i = 0; i < o.ntokens; ++i) {
      const bench_row *r = &rows[i];
      printf("%7d %11.3f %11.3f %11.1f %9.1f %15.1f %11.1f%%\n", r->tokens, r->ms_med,
             r->ms_min, r->tokens_s, r->flop_s / 1e9, r->blas_flop_s / 1e9, r->pct_blas);
    }
    printf("\nsgemm = cblas_sgemm [T*k,H]x[H,2I] then [T*k,I]x[I,H] (fp32, same cores), "
           "timed like the layer\n");
  }
  fflush(stdout);

  if (o.json) {
    write_json(o.json, &o, device, threads, &fl, rows, o.ntokens);
    fprintf(stderr, "wrote %s\n", o.json);
  }

  free(rows);
  free(ms);
  free(x);
  if (cuda) {
    gpu_timer_destroy(&tm);
    gpu_free(dx);
    gpu_free(dout);
    gpu_free(d_ids);
    gpu_free(d_w);
    gpu_free(flush);
  } else {
    free(dout);
    free(A);
    free(B);
    free(C);
    free(A2);
    free(B2);
    free(C2);
  }
  cli_layer_free(&L);
  cli_session_close(&ss);
  return 0;
}
