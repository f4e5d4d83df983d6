/* Weight-stream probe: how fast can a decode-shaped GEMM read its weights?
 *
 * The decode expert GEMMs read a [rows][K] bf16 matrix as blocks of 128 rows,
 * one CTA a block, 128 bytes of every row a stage (see src/cuda/gemm/decode.cuh).
 * This program reads the same bytes in the same CTA/row-block layout but
 * changes one thing at a time, so that the read rate of each variant can be
 * told apart from the floor (a grid-stride read of the whole buffer):
 *   - run: contiguous bytes of one row a step (128 .. 2048); a step is 16 KiB
 *     of the block either way (128 rows x 128 B, 32 x 512 B, 8 x 2048 B);
 *     runs that do not divide a row are skipped;
 *   - depth: steps in flight per CTA (loads issued before the oldest is used);
 *   - CTAs per SM (occupancy) and a persistent grid (one CTA per SM looping
 *     over blocks) against one CTA per block.
 * Nothing is computed; every loaded word is folded into a checksum so no load
 * can be dropped. Standalone: nvcc -O3 -arch=sm_90a bench/stream_probe.cu.
 * Before each timed run the L2 is flushed by a 256 MiB memset (as the
 * benchmarks do; it leaves the L2 full of dirty lines that the timed kernel
 * then writes back), by a 256 MiB read, or not at all (argv[3] = 0, 1, 2).
 * Usage: stream_probe [rows (multiple of 128)] [k (bf16 elements a row, multiple of 64)]
 * [flush]; an FP8 row of K bytes is k = K / 2.
 * Output: one line per variant, GB/s = bytes / median time of 20 runs. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(call)                                                               \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,             \
              cudaGetErrorString(e_));                                         \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

#define THREADS 256
#define STEP_BYTES 16384 /* bytes of a block a step */
#define PER_THREAD (STEP_BYTES / 16 / THREADS) /* 16-byte loads a thread a step */

static __device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

/* Block b = rows [128 b, 128 b + 128) of a [rows][row_bytes] matrix. Step s
 * of a block reads `run` contiguous bytes of (STEP_BYTES / run) rows. */
template <int RUN>
static __device__ __forceinline__ const uint4 *step_addr(const char *base, size_t row_bytes,
                                                         int block, int s, int j) {
  constexpr int ROWS_PER_STEP = STEP_BYTES / RUN; /* 128, 32, 8 */
  constexpr int GROUPS = 128 / ROWS_PER_STEP;     /* row groups of the block */
  constexpr int CH = RUN / 16;                    /* 16-byte chunks of a run */
  const int q = j * THREADS + (int)threadIdx.x;   /* chunk of the step */
  const int row = (s % GROUPS) * ROWS_PER_STEP + q / CH;
  const size_t col = (size_t)(s / GROUPS) * RUN + (size_t)(q % CH) * 16;
  return (const uint4 *)(base + ((size_t)block * 128 + (size_t)row) * row_bytes + col);
}

template <int RUN, int DEPTH>
static __global__ void __launch_bounds__(THREADS) k_blocks(const char *base, size_t row_bytes,
                                                           int nblocks, int persistent,
                                                           unsigned *sink) {
  extern __shared__ char pad[]; /* only there to cap CTAs per SM */
  const int steps = (int)(row_bytes * 128 / STEP_BYTES);
  unsigned acc = 0;
  for (int b = (int)blockIdx.x; b < nblocks; b += persistent ? (int)gridDim.x : nblocks) {
    uint4 r[DEPTH][PER_THREAD];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j)
        r[d][j] = __ldcs(step_addr<RUN>(base, row_bytes, b, d < steps ? d : 0, j));
    for (int s = 0; s < steps; s += DEPTH) {
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) {
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) acc ^= fold(r[d][j]);
        const int nx = s + d + DEPTH;
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j)
          if (nx < steps) r[d][j] = __ldcs(step_addr<RUN>(base, row_bytes, b, nx, j));
      }
    }
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc + pad[0];
}

static __global__ void k_flat(const uint4 *p, size_t n, unsigned *sink) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned acc = 0;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride)
    acc ^= fold(__ldcs(p + i)) ^ fold(__ldcs(p + i + stride)) ^ fold(__ldcs(p + i + 2 * stride)) ^
           fold(__ldcs(p + i + 3 * stride));
  for (; i < n; i += stride) acc ^= fold(__ldcs(p + i));
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;
}

/* the flush as tools/floors.cu does it: plain loads (default cache policy) */
static __global__ void k_flush(const uint4 *p, size_t n, unsigned *sink) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned acc = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    acc ^= fold(p[i]);
  if (acc == 0x12345678u) sink[0] = acc;
}

static int cmpf(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

static char *g_flush;
static unsigned *g_sink;
static int g_flush_mode; /* 0: memset (leaves L2 lines dirty), 1: read, 2: none */
#define FLUSH (256u << 20)

template <typename F> static double time_us(F launch) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float t[20];
  for (int it = -2; it < 20; ++it) {
    if (g_flush_mode == 0) CK(cudaMemsetAsync(g_flush, it & 0xff, FLUSH));
    if (g_flush_mode == 1) k_flush<<<528, 512>>>((const uint4 *)g_flush, FLUSH / 16, g_sink);
    CK(cudaEventRecord(e0));
    launch();
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (it >= 0) t[it] = ms * 1000.0f;
  }
  qsort(t, 20, sizeof t[0], cmpf);
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return t[10];
}

template <int RUN, int DEPTH>
static void variant(const char *buf, size_t row_bytes, int nblocks, int per_sm, int persistent,
                    int sms, unsigned *sink, double bytes) {
  if (row_bytes % RUN != 0) { /* a step's runs would cross into the next row */
    printf("run %5d B  depth %d: skipped (rows of %zu bytes)\n", RUN, DEPTH, row_bytes);
    return;
  }
  auto kern = k_blocks<RUN, DEPTH>;
  int smem = 0;
  if (per_sm > 0) {
    smem = 227 * 1024 / per_sm - 1024;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, THREADS, smem));
  const int grid = persistent ? sms * occ : nblocks;
  const double us = time_us([&] { kern<<<grid, THREADS, smem>>>(buf, row_bytes, nblocks, persistent, sink); });
  /* smem: sized for per_sm CTAs an SM (the L1 keeps the rest); occ: how many fit */
  printf("run %5d B  depth %d (%3d KiB in flight/CTA)  %d CTA/SM (smem for %d)  %-10s  %8.1f us  "
         "%7.0f GB/s\n",
         RUN, DEPTH, DEPTH * STEP_BYTES / 1024, occ, per_sm,
         persistent ? "persistent" : "per-block", us, bytes / us / 1e3);
}

int main(int argc, char **argv) {
  /* default: mixtral-8x7b's gate/up of two experts, [2 x 28672][4096] bf16 */
  const size_t rows = argc > 1 ? strtoull(argv[1], NULL, 10) : 57344;
  const size_t k = argc > 2 ? strtoull(argv[2], NULL, 10) : 4096;
  const size_t row_bytes = k * 2, bytes = rows * row_bytes;
  if (rows % 128 != 0 || row_bytes * 128 % STEP_BYTES != 0) {
    fprintf(stderr, "rows (%zu) must be a multiple of 128 and k (%zu) of 64\n", rows, k);
    return 2;
  }
  const int nblocks = (int)(rows / 128);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  char *buf;
  unsigned *sink;
  CK(cudaMalloc(&buf, bytes));
  CK(cudaMalloc(&g_flush, FLUSH));
  CK(cudaMalloc(&sink, 1 << 20));
  g_sink = sink;
  CK(cudaMemset(buf, 1, bytes));
  printf("stream probe: %zu rows x %zu bytes (%.1f MiB), %d blocks of 128 rows, %d SMs\n", rows,
         row_bytes, bytes / 1048576.0, nblocks, sms);
  CK(cudaMemset(g_flush, 1, FLUSH));
  const char *fname[3] = {"memset flush", "read flush", "no flush"};
  for (g_flush_mode = 0; g_flush_mode < 3; ++g_flush_mode) {
    const double flat =
        time_us([&] { k_flat<<<sms * 4, 512>>>((const uint4 *)buf, bytes / 16, sink); });
    printf("flat grid-stride read, %-12s                           %8.1f us  %7.0f GB/s\n",
           fname[g_flush_mode], flat, bytes / flat / 1e3);
  }
  /* does the read flush evict? a 32 MiB read (fits the L2) with plain loads
   * (lines kept in L2, as the decode GEMMs' cp.async keeps the weights) after
   * each kind: without a flush it is served by L2 */
  for (g_flush_mode = 0; g_flush_mode < 3; ++g_flush_mode) {
    const size_t small = (size_t)32 << 20;
    const double us =
        time_us([&] { k_flush<<<sms * 4, 512>>>((const uint4 *)buf, small / 16, sink); });
    printf("32 MiB read (fits the L2), %-12s                       %8.1f us  %7.0f GB/s\n",
           fname[g_flush_mode], us, small / us / 1e3);
  }
  g_flush_mode = argc > 3 ? atoi(argv[3]) : 0;
  printf("variants below: %s before each run\n", fname[g_flush_mode]);
  for (int per_sm = 1; per_sm <= 2; per_sm *= 2) {
    variant<128, 3>(buf, row_bytes, nblocks, per_sm, 0, sms, sink, bytes);
    variant<512, 3>(buf, row_bytes, nblocks, per_sm, 0, sms, sink, bytes);
    variant<2048, 3>(buf, row_bytes, nblocks, per_sm, 0, sms, sink, bytes);
    variant<128, 6>(buf, row_bytes, nblocks, per_sm, 0, sms, sink, bytes);
    variant<512, 6>(buf, row_bytes, nblocks, per_sm, 0, sms, sink, bytes);
    variant<128, 3>(buf, row_bytes, nblocks, per_sm, 1, sms, sink, bytes);
    variant<512, 3>(buf, row_bytes, nblocks, per_sm, 1, sms, sink, bytes);
    variant<128, 6>(buf, row_bytes, nblocks, per_sm, 1, sms, sink, bytes);
    variant<512, 6>(buf, row_bytes, nblocks, per_sm, 1, sms, sink, bytes);
  }
  CK(cudaFree(buf));
  CK(cudaFree(g_flush));
  CK(cudaFree(sink));
  return 0;
}
