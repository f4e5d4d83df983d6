/* The one-kernel gemm_ar GEMMs (src/tp/cuda/gemm_ar_fused.cu) on one GPU,
 * without their exchange: each kernel run with a one-rank device view (no
 * peer to push to or wait for), beside cuBLAS(Lt) on the same shape, so the
 * weight stream of each kernel can be told apart from the exchange that
 * mgpu runs add. Shape: c [m, n] = a [m, k] b [n, k]^T, bf16, n = 8192,
 * k = 4096 by default (the decode gemm_ar of docs/PERF.md); m in 1, 16, 32,
 * 64, 128. The L2 is flushed by a 256 MiB read before each timed call;
 * median of 30 after 3 untimed. Each kernel's output is checked against
 * cuBLAS's (relative L2). Not a library tool: it drives internal launchers,
 * so it links the static library.
 *   scripts/gpu-check.sh tpprobe     (builds and runs it, and ncu on it)
 *   gemm_ar_probe [n k [m]]          (m alone: only that row count) */
#include "comm/cuda/comm_cuda.h"
#include "tp/cuda/tp_blas.h"
#include "tp/cuda/tp_cuda.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(call)                                                                      \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "gemm_ar_probe: %s: %s\n", #call, cudaGetErrorString(e_));       \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)
#define TRY_ML(call)                                                                   \
  do {                                                                                 \
    moelink_status_t s_ = (call);                                                      \
    if (s_ != MOELINK_SUCCESS) {                                                       \
      fprintf(stderr, "gemm_ar_probe: %s: %s\n", #call, moelink_last_error());         \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

#define FLUSH_BYTES (256u << 20)

static __global__ void flush_read(const uint4 *p, size_t n, unsigned *sink) {
  unsigned x = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x; /* keeps the loads */
}

static uint16_t bf16_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float f32_of(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static void *dev_random(size_t elems, uint64_t seed) {
  uint16_t *h = (uint16_t *)malloc(elems * 2);
  for (size_t i = 0; i < elems; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    h[i] = bf16_of((float)((double)(seed >> 40) / (double)(1ull << 24) - 0.5));
  }
  void *d;
  TRY(cudaMalloc(&d, elems * 2));
  TRY(cudaMemcpy(d, h, elems * 2, cudaMemcpyHostToDevice));
  free(h);
  return d;
}

static double rel_l2(const void *x, const void *y, size_t n) {
  uint16_t *hx = (uint16_t *)malloc(n * 2), *hy = (uint16_t *)malloc(n * 2);
  TRY(cudaMemcpy(hx, x, n * 2, cudaMemcpyDeviceToHost));
  TRY(cudaMemcpy(hy, y, n * 2, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = f32_of(hx[i]), b = f32_of(hy[i]);
    num += (a - b) * (a - b);
    den += b * b;
  }
  free(hx);
  free(hy);
  const double r = den > 0 ? sqrt(num / den) : sqrt(num);
  return r == r ? r : INFINITY;
}

typedef struct probe {
  cudaStream_t st;
  void *flush;
  unsigned *sink;
  cudaEvent_t e0, e1;
  ml_tpc_blas *blas;
  ml_ccu_ll ll;
  ml_tpc_wide wide;
  moelink_device_comm_t dc;
  int sms;
} probe;

enum { OP_CUBLAS, OP_FUSED16, OP_WIDE };
static const char *const op_names[] = {"cuBLAS", "fused<=16", "wide<=128"};

static void run_op(probe *p, int op, const void *a, const void *b, void *c, int m, int n, int k) {
  if (op == OP_CUBLAS)
    TRY_ML(ml_tpc_blas_gemm(p->blas, MOELINK_DTYPE_BF16, a, b, c, m, n, k, p->st));
  else if (op == OP_FUSED16)
    TRY_ML(ml_tpc_fused_ar(&p->ll, &p->dc, MOELINK_DTYPE_BF16, a, b, c, m, n, k, p->sms, p->st));
  else
    TRY_ML(ml_tpc_wide_ar(&p->wide, &p->ll, &p->dc, MOELINK_DTYPE_BF16, a, b, c, m, n, k, p->st));
}

static int cmp_float(const void *x, const void *y) {
  const float a = *(const float *)x, b = *(const float *)y;
  return (a > b) - (a < b);
}

static float time_op(probe *p, int op, const void *a, const void *b, void *c, int m, int n, int k) {
  enum { WARM = 3, ITERS = 30 };
  float ms[ITERS];
  for (int i = 0; i < WARM + ITERS; ++i) {
    flush_read<<<4 * p->sms, 512, 0, p->st>>>((const uint4 *)p->flush, FLUSH_BYTES / 16, p->sink);
    TRY(cudaEventRecord(p->e0, p->st));
    run_op(p, op, a, b, c, m, n, k);
    TRY(cudaEventRecord(p->e1, p->st));
    TRY(cudaEventSynchronize(p->e1));
    if (i >= WARM) TRY(cudaEventElapsedTime(&ms[i - WARM], p->e0, p->e1));
  }
  qsort(ms, ITERS, sizeof ms[0], cmp_float);
  return ms[ITERS / 2] * 1000.f;
}

int main(int argc, char **argv) {
  const int n = argc > 2 ? atoi(argv[1]) : 8192, k = argc > 2 ? atoi(argv[2]) : 4096;
  const int only = argc > 3 ? atoi(argv[3]) : 0;
  probe p;
  memset(&p, 0, sizeof p);
  TRY(cudaSetDevice(0));
  TRY(cudaDeviceGetAttribute(&p.sms, cudaDevAttrMultiProcessorCount, 0));
  TRY(cudaStreamCreateWithFlags(&p.st, cudaStreamNonBlocking));
  TRY(cudaEventCreate(&p.e0));
  TRY(cudaEventCreate(&p.e1));
  TRY(cudaMalloc(&p.flush, FLUSH_BYTES));
  TRY(cudaMemset(p.flush, 1, FLUSH_BYTES));
  TRY(cudaMalloc((void **)&p.sink, 4));
  TRY_ML(ml_tpc_blas_create(&p.blas, (size_t)32 << 20, ML_TPC_BLAS_LT, 0));
  TRY_ML(ml_tpc_fused_prepare(1)); /* the kernels' shared memory, as a tp's create does */

  /* One rank: no peers, so neither kernel pushes or waits; the control
   * block only serves a wait that never happens. */
  p.dc.rank = 0;
  p.dc.nranks = 1;
  p.dc.timeout_ns = 10ull * 1000 * 1000 * 1000;
  TRY(cudaMalloc((void **)&p.dc.ctl[0], 256));
  TRY(cudaMemset(p.dc.ctl[0], 0, 256));
  const size_t words = (size_t)ML_TPC_WIDE_MAX_M * (size_t)n / 2;
  TRY(cudaMalloc((void **)&p.ll.cells[0], ML_CCU_LL_BYTES(1, words)));
  TRY(cudaMalloc((void **)&p.ll.epoch, 64));
  TRY(cudaMemset(p.ll.epoch, 0, 64));
  p.ll.ticket = (unsigned *)(p.ll.epoch + 4);
  p.ll.max_words = words;
  p.wide.slot_bytes = (size_t)ML_TPC_WIDE_MAX_M * (size_t)n * 2;
  p.wide.max_blocks = n / 64;
  p.wide.ctas = p.sms;
  char *symm;
  const size_t sb = ml_tpc_wide_symm_bytes(1, p.wide.slot_bytes, p.wide.max_blocks);
  TRY(cudaMalloc((void **)&symm, sb));
  TRY(cudaMemset(symm, 0, sb));
  p.wide.base[0] = symm;
  TRY(cudaMalloc((void **)&p.wide.pair, (size_t)p.sms * 64 * 128 * 4));
  TRY(cudaMalloc((void **)&p.wide.pair_flags, (size_t)p.sms * 8));
  TRY(cudaMemset(p.wide.pair_flags, 0, (size_t)p.sms * 8));

  void *a = dev_random((size_t)ML_TPC_WIDE_MAX_M * k, 11), *b = dev_random((size_t)n * k, 12);
  void *ref, *out;
  TRY(cudaMalloc(&ref, (size_t)ML_TPC_WIDE_MAX_M * n * 2));
  TRY(cudaMalloc(&out, (size_t)ML_TPC_WIDE_MAX_M * n * 2));
  const double wbytes = (double)n * k * 2;
  printf("gemm_ar_probe: one GPU (%d SMs), bf16, n %d, k %d, weights %.1f MiB; L2 flushed "
         "(256 MiB read) before each call; median of 30\n",
         p.sms, n, k, wbytes / (1 << 20));
  printf("%-10s %5s %10s %10s %12s\n", "kernel", "m", "us", "TB/s", "rel L2");
  static const int ms[] = {1, 16, 32, 64, 128};
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; ++i) {
    const int m = ms[i];
    if (only && m != only) continue;
    for (int op = OP_CUBLAS; op <= OP_WIDE; ++op) {
      if (op == OP_FUSED16 && !ml_tpc_fused_ar_takes(MOELINK_DTYPE_BF16, a, b, out, m, n, k,
                                                     words, p.sms))
        continue;
      if (op == OP_WIDE && !ml_tpc_wide_ar_takes(&p.wide, MOELINK_DTYPE_BF16, a, b, out, m, n, k))
        continue;
      void *dst = op == OP_CUBLAS ? ref : out;
      TRY(cudaMemsetAsync(dst, 0xff, (size_t)m * n * 2, p.st));
      const float us = time_op(&p, op, a, b, dst, m, n, k);
      TRY(cudaStreamSynchronize(p.st));
      const double err = op == OP_CUBLAS ? 0.0 : rel_l2(out, ref, (size_t)m * n);
      printf("%-10s %5d %10.1f %10.2f %12.2e\n", op_names[op], m, us,
             (wbytes + (double)m * k * 2) / (us * 1e-6) / 1e12, err);
      if (err > 1e-2) {
        fprintf(stderr, "gemm_ar_probe: %s at m %d is off cuBLAS (rel L2 %.3g)\n", op_names[op], m,
                err);
        return 1;
      }
    }
  }
  return 0;
}
