/* moelink: the command-line tool. `moelink --help` lists the commands. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

static const char cli_usage_text[] =
    "usage: moelink <command> [options]\n"
    "\n"
    "commands:\n"
    "  run       run one MoE layer on generated weights, time it, optionally verify it\n"
    "  bench     median times over token counts beside this machine's floors\n"
    "  bench comm  collectives' latency and bus bandwidth beside NCCL's (under launch)\n"
    "  bench ep  the expert-parallel layer beside one device and NCCL (under launch)\n"
    "  bench tp  tensor-parallel GEMMs fused with their collective, beside cuBLAS + NCCL\n"
    "  presets   list the built-in model presets\n"
    "  launch    start N ranks of a command on this machine (one per GPU)\n"
    "\n"
    "  moelink --version     library and header versions\n"
    "  moelink --help, -h    this text; moelink <command> --help for one command\n";

static const char cli_shape_text[] =
    "layer (default without --preset: the small shape H 512, I 256, E 16, k 4; flags\n"
    "override the preset's or the small shape's fields):\n"
    "  --preset NAME          a model preset (moelink presets)\n"
    "  --hidden H --inter I --experts E --topk K\n"
    "  --router R             softmax | sigmoid | topk-softmax\n"
    "  --no-renorm            do not renormalize the k routing weights\n"
    "  --groups G --topk-group TG   group-limited selection (keep TG of G groups)\n"
    "  --scale S              routed scaling factor\n"
    "  --bias                 fp32 correction bias for selection\n"
    "  --shared-inter IS      shared expert of intermediate size IS (0: none)\n"
    "  --shared-gate          scale the shared expert by sigmoid(x . w_g)\n"
    "data:\n"
    "  --backend cpu|cuda     (default cpu)\n"
    "  --dtype f32|bf16|f16   (default bf16)\n"
    "  --fp8-experts          routed experts' weights in FP8 (e4m3, a scale per 128x128\n"
    "                         block; their inputs quantized per 128 on the fly); on cuda\n"
    "                         the weights are generated on the host and copied\n"
    "  --fp8-shared           the shared expert's weights in FP8 likewise\n"
    "  --seed S               weights and inputs generator seed (default 1)\n"
    "  --skew uniform|zipf:A  routing skew: expert e's logit gets log((e+1)^-A)\n"
    "  --max-tokens N         layer workspace size in tokens (default: the largest T)\n"
    "  --threads N            CPU threads (default: one per core; cpu backend only)\n";

static void cli_run_text(void);
static void cli_bench_text(void);

static void cli_help(void) {
  fputs(cli_usage_text, stdout);
  printf("\n");
  cli_run_text();
  printf("\n");
  cli_bench_text();
  printf("\noptions of both run and bench:\n");
  fputs(cli_shape_text, stdout);
  printf("\nmoelink presets\n  a table of the presets: shapes, router, groups, scaling, shared "
         "expert,\n  and the parameter count of the routed experts\n");
  printf("\n");
  cli_help_launch();
  printf("\nexit codes: 0 ok, 1 failure (library error, failed verification), 2 bad arguments\n");
}

static void cli_run_text(void) {
  printf("moelink run [options]\n"
         "  Generates deterministic weights and inputs (the reference's generator), runs the\n"
         "  layer once to warm up, then once timed; prints time, tokens/s and GFLOP/s.\n"
         "  With no options: the small shape, 64 tokens, bf16, cpu, verified.\n"
         "  --tokens T             tokens (default 64)\n"
         "  --verify               compare with the double-precision reference (default on\n"
         "                         for the small shape; --no-verify turns it off); exit 1 if\n"
         "                         the relative L2 error exceeds 1e-4 (f32) or 1e-2 (bf16, f16)\n"
         "  --verify-tokens N      tokens checked when checking all would be slow (default 32,\n"
         "                         spread evenly, first and last included)\n");
}

void cli_help_run(void) {
  cli_run_text();
  fputs(cli_shape_text, stdout);
}

static void cli_bench_text(void) {
  printf("moelink bench [options]\n"
         "  Median forward time per token count, tokens/s and FLOP rate, beside:\n"
         "  cpu:  OpenBLAS sgemm on the routed experts' GEMM shapes, in the same run;\n"
         "  cuda: measured read bandwidth and cuBLAS bf16 matmul rate, and the floor\n"
         "        max(weight bytes touched / bandwidth, FLOPs / matmul rate) per T.\n"
         "  --tokens T1,T2,...     token counts (default cpu 256; cuda 1,16,128,512,2048,8192)\n"
         "  --iters N              timed iterations per T (default cpu 5, cuda 20)\n"
         "  --warmup N             untimed iterations first (default cpu 1, cuda 3)\n"
         "  --json FILE            also write everything as JSON\n"
         "  --graph                cuda: capture each T's forward once in a CUDA graph and time\n"
         "                         its replays (what a serving engine does at decode)\n"
         "moelink bench tp [options]   tensor-parallel GEMMs fused with their collective,\n"
         "  under moelink launch -n N (moelink bench tp --help)\n"
         "moelink bench comm [options]   collectives beside NCCL's, per size, under moelink\n"
         "  launch -n N (moelink bench comm --help)\n"
         "moelink bench ep [options]   the expert-parallel layer beside the single-device\n"
         "  layer and NCCL, under moelink launch -n N (moelink bench ep --help)\n");
}

void cli_help_bench(void) {
  cli_bench_text();
  fputs(cli_shape_text, stdout);
}

static int cli_version(void) {
  printf("moelink %s (library version code %d; built against header %d.%d.%d, code %d)\n",
         moelink_version(), moelink_version_code(), MOELINK_VERSION_MAJOR, MOELINK_VERSION_MINOR,
         MOELINK_VERSION_PATCH, MOELINK_VERSION_CODE);
  if (moelink_version_code() != MOELINK_VERSION_CODE)
    printf("warning: the loaded library is not the version this tool was built against\n");
  return 0;
}

static int cli_presets(int argc, char **argv) {
  for (int i = 0; i < argc; ++i) {
    if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
      printf("moelink presets\n  lists the built-in model presets\n");
      return 0;
    }
    cli_usage_error("presets: unexpected argument '%s'", argv[i]);
  }
  printf("%-16s %6s %6s %5s %3s  %-13s %7s %7s  %-14s %12s\n", "name", "H", "I", "E", "k",
         "router", "groups", "scaling", "shared", "params (B)");
  for (int i = 0; i < moelink_preset_count(); ++i) {
    moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
    const char *name = moelink_preset_name(i);
    CLI_CALL("moelink_moe_preset", moelink_moe_preset(name, &c));
    char router[32], groups[16], shared[32];
    snprintf(router, sizeof router, "%s%s%s", cli_router_name(c.router),
             c.renormalize ? "" : " -norm", c.correction_bias ? " +bias" : "");
    if (c.n_group > 1)
      snprintf(groups, sizeof groups, "%d/%d", c.topk_group, c.n_group);
    else
      snprintf(groups, sizeof groups, "-");
    if (c.shared_inter > 0)
      snprintf(shared, sizeof shared, "%d%s", c.shared_inter, c.shared_gate ? " gated" : "");
    else
      snprintf(shared, sizeof shared, "-");
    double params = 3.0 * c.num_experts * (double)c.inter * (double)c.hidden / 1e9;
    printf("%-16s %6d %6d %5d %3d  %-13s %7s %7g  %-14s %12.2f\n", name, c.hidden, c.inter,
           c.num_experts, c.top_k, router, groups, (double)c.routed_scaling, shared, params);
  }
  printf("\nrouter: -norm = weights not renormalized, +bias = correction bias for selection;\n"
         "groups: kept/total for group-limited selection; params: routed experts only, per layer\n");
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fputs(cli_usage_text, stderr);
    return CLI_EXIT_USAGE;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
    if (argc > 2 && strcmp(argv[2], "run") == 0)
      cli_help_run();
    else if (argc > 3 && strcmp(argv[2], "bench") == 0 && strcmp(argv[3], "tp") == 0)
      cli_help_bench_tp();
    else if (argc > 3 && strcmp(argv[2], "bench") == 0 && strcmp(argv[3], "comm") == 0)
      cli_help_bench_comm();
    else if (argc > 3 && strcmp(argv[2], "bench") == 0 && strcmp(argv[3], "ep") == 0)
      cli_help_bench_ep();
    else if (argc > 2 && strcmp(argv[2], "bench") == 0)
      cli_help_bench();
    else if (argc > 2 && strcmp(argv[2], "launch") == 0)
      cli_help_launch();
    else
      cli_help();
    return 0;
  }
  if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "version") == 0) return cli_version();
  if (strcmp(cmd, "presets") == 0) return cli_presets(argc - 2, argv + 2);
  if (strcmp(cmd, "run") == 0) return cli_cmd_run(argc - 2, argv + 2);
  if (strcmp(cmd, "bench") == 0 && argc > 2 && strcmp(argv[2], "tp") == 0)
    return cli_cmd_bench_tp(argc - 3, argv + 3);
  if (strcmp(cmd, "bench") == 0 && argc > 2 && strcmp(argv[2], "comm") == 0)
    return cli_cmd_bench_comm(argc - 3, argv + 3);
  if (strcmp(cmd, "bench") == 0 && argc > 2 && strcmp(argv[2], "ep") == 0)
    return cli_cmd_bench_ep(argc - 3, argv + 3);
  if (strcmp(cmd, "bench") == 0) return cli_cmd_bench(argc - 2, argv + 2);
  if (strcmp(cmd, "launch") == 0) return cli_cmd_launch(argc - 2, argv + 2);
  cli_usage_error("unknown command '%s' (commands: run, bench, presets, launch; see moelink "
                  "--help)",
                  cmd);
}
