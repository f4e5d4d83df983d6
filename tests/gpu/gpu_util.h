/* Helpers shared by the GPU tests (header-only: each test is one file).
 *
 * The GPU tests run on a machine the author cannot watch, so every failure
 * prints what is needed to debug it from the log alone: sizes, the first
 * offending elements with both values, and timings. */
#ifndef ML_GPU_UTIL_H
#define ML_GPU_UTIL_H

#include "harness.h"
#include "moelink.h"
#include "moelink_device.cuh"
#include "ref.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define GU_FN static __attribute__((unused))

/* Routing decisions closer than this (ref_route_margin: relative gap of the
 * two deciding scores) may flip between fp32 summation orders; anything
 * farther apart must agree. Real selection bugs give gaps of 1e-2 and more. */
#define GU_TIE 1e-4
/* Output tolerances (DESIGN.md section 7: bf16 1e-2 relative L2); one token
 * may be somewhat worse than the whole batch. */
#define GU_TOL 1e-2
#define GU_TOL_ROW 3e-2
/* FP8 experts: a token, and a batch of fewer than ~100 (a changed e4m3 code
 * of a large element moves one token by a few percent: test_cuda_layer.c
 * says how this was measured) */
#define GU_FP8_TOL_ROW 8e-2

GU_FN void gu_bail(const char *why) {
  printf("Bail out! %s\n", why);
  fflush(stdout);
  (void)ml_test_done();
  exit(1);
}

/* A CUDA runtime call that must work; otherwise the test cannot go on. */
#define GU_CUDA(call)                                                          \
  do {                                                                         \
    cudaError_t gu_e_ = (call);                                                \
    if (gu_e_ != cudaSuccess) {                                                \
      CHECK(0, "%s: %s (%s)", #call, cudaGetErrorName(gu_e_),                  \
            cudaGetErrorString(gu_e_));                                        \
      gu_bail("CUDA runtime error");                                           \
    }                                                                          \
  } while (0)

/* A moelink call whose failure makes the rest meaningless. */
#define GU_MUST(call, what)                                                    \
  do {                                                                         \
    moelink_status_t gu_s_ = (call);                                           \
    if (gu_s_ != MOELINK_SUCCESS) {                                            \
      CHECK(0, "%s: %s: %s", (what), moelink_status_string(gu_s_),             \
            moelink_last_error());                                             \
      gu_bail(what);                                                           \
    }                                                                          \
  } while (0)

GU_FN double gu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

GU_FN void *gu_host(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    CHECK(0, "host allocation of %zu bytes", bytes);
    gu_bail("out of host memory");
  }
  return p;
}

GU_FN void *gu_dev(size_t bytes) {
  void *p = NULL;
  if (bytes == 0) bytes = 16;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    size_t fr = 0, tot = 0;
    (void)cudaGetLastError();
    cudaMemGetInfo(&fr, &tot);
    CHECK(0, "cudaMalloc of %zu bytes: %s (%zu of %zu bytes free)", bytes, cudaGetErrorString(e),
          fr, tot);
    gu_bail("out of device memory");
  }
  return p;
}

GU_FN void gu_free(void *d) {
  if (d) GU_CUDA(cudaFree(d));
}

GU_FN void gu_h2d(void *d, const void *h, size_t bytes) {
  if (bytes) GU_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
}

GU_FN void gu_d2h(void *h, const void *d, size_t bytes) {
  if (bytes) GU_CUDA(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

/* n zeroed device ints (a GEMM work counter, ml_cuda_gemm_opts.counter). */
GU_FN int32_t *gu_counter_new(int n) {
  int32_t *d = (int32_t *)gu_dev((size_t)n * sizeof(int32_t));
  GU_CUDA(cudaMemset(d, 0, (size_t)n * sizeof(int32_t)));
  return d;
}

/* Checks that the launches before left the n ints of a work counter at zero
 * (what: the label). */
GU_FN void gu_counter_check_zero(const int32_t *d, int n, const char *what) {
  int32_t h[8];
  int bad = -1;
  for (int i0 = 0; i0 < n; i0 += 8) {
    const int m = n - i0 < 8 ? n - i0 : 8;
    gu_d2h(h, d + i0, (size_t)m * sizeof(int32_t));
    for (int i = 0; i < m && bad < 0; ++i)
      if (h[i] != 0)
        bad = i0 + i;
  }
  CHECK(bad < 0, "%s: the work counter is left at zero (int %d is not)", what, bad);
}

/* ---- output rows by pointer (ml_cuda_gemm_opts.out_rows) --------------------- */

/* A device table that sends each owned problem row r (row_expert[r] >= 0) of
 * R to row R - 1 - r of dst (rows of `row` bytes), indexed as the GEMMs read
 * it: by index[r] (host copy; NULL: by r). Entries nothing names are NULL. */
GU_FN void **gu_rows_table(const int *row_expert, const int32_t *index, int R, char *dst,
                           size_t row) {
  int nx = R;
  for (int r = 0; r < R; ++r)
    if (index && row_expert[r] >= 0 && index[r] + 1 > nx)
      nx = index[r] + 1;
  void **t = (void **)calloc((size_t)nx + 1, sizeof(void *));
  if (!t)
    exit(2);
  for (int r = 0; r < R; ++r)
    if (row_expert[r] >= 0)
      t[index ? index[r] : r] = dst + (size_t)(R - 1 - r) * row;
  void **d = (void **)gu_dev(((size_t)nx + 1) * sizeof(void *));
  GU_CUDA(cudaMemcpy(d, t, ((size_t)nx + 1) * sizeof(void *), cudaMemcpyHostToDevice));
  free(t);
  return d;
}

/* Checks a run through gu_rows_table's table: got (dst, R + 1 rows) holds
 * each owned row r of want (the plain run's output, rows of `row` bytes) at
 * row R - 1 - r bit for bit, every other byte of got is still 0xFF, and so
 * is every byte of out (out_bytes, the GEMM's own output, never written). */
GU_FN void gu_rows_check(const char *what, const int *row_expert, int R, const unsigned char *got,
                         const unsigned char *want, size_t row, const unsigned char *out,
                         size_t out_bytes) {
  long bad_rows = 0, bad_poison = 0;
  for (int r = 0; r < R; ++r) {
    const unsigned char *g = got + (size_t)(R - 1 - r) * row;
    if (row_expert[r] >= 0)
      bad_rows += memcmp(g, want + (size_t)r * row, row) != 0;
    else
      for (size_t i = 0; i < row; ++i)
        bad_poison += g[i] != 0xFF;
  }
  for (size_t i = (size_t)R * row; i < (size_t)(R + 1) * row; ++i)
    bad_poison += got[i] != 0xFF;
  for (size_t i = 0; i < out_bytes; ++i)
    bad_poison += out[i] != 0xFF;
  CHECK(bad_rows == 0, "%s: every stored row bitwise equal to the plain run's (%ld differ)", what,
        bad_rows);
  CHECK(bad_poison == 0, "%s: no other byte written, out untouched (%ld changed)", what,
        bad_poison);
}

/* One run into rows by pointer, set up, poisoned and checked by the tests of
 * every scaled GEMM engine alike: dst (R + 1 rows of `row` bytes, device and
 * host) and gu_rows_table's table into it. */
typedef struct gu_rows {
  int R;
  size_t row, bytes;
  char *d_dst;
  void **d_table;
  unsigned char *dst;
} gu_rows;

/* index: the row index the GEMM reads (NULL: by row), in device memory when
 * index_on_device. */
GU_FN gu_rows gu_rows_make(const int *row_expert, const int32_t *index, int index_on_device, int R,
                           size_t row) {
  gu_rows t;
  t.R = R;
  t.row = row;
  t.bytes = (size_t)(R + 1) * row;
  int32_t *h = NULL;
  if (index && index_on_device) {
    h = (int32_t *)malloc((size_t)(R ? R : 1) * sizeof(int32_t));
    if (!h)
      exit(2);
    GU_CUDA(cudaMemcpy(h, index, (size_t)R * sizeof(int32_t), cudaMemcpyDeviceToHost));
    index = h;
  }
  t.d_dst = (char *)gu_dev(t.bytes);
  t.d_table = gu_rows_table(row_expert, index, R, t.d_dst, row);
  t.dst = (unsigned char *)malloc(t.bytes);
  if (!t.dst)
    exit(2);
  free(h);
  return t;
}

/* Before a run on st: dst and the GEMM's own output (out_bytes at d_out) to
 * 0xFF bytes. */
GU_FN void gu_rows_poison(const gu_rows *t, void *d_out, size_t out_bytes, cudaStream_t st) {
  GU_CUDA(cudaMemsetAsync(t->d_dst, 0xFF, t->bytes, st));
  GU_CUDA(cudaMemsetAsync(d_out, 0xFF, out_bytes, st));
}

/* After a run on st: dst and the GEMM's output (into the host buffer out)
 * back, then gu_rows_check against want (the plain run's output). */
GU_FN void gu_rows_verify(const char *what, gu_rows *t, const int *row_expert,
                          const unsigned char *want, const void *d_out, unsigned char *out,
                          size_t out_bytes, cudaStream_t st) {
  GU_CUDA(cudaStreamSynchronize(st));
  GU_CUDA(cudaMemcpy(t->dst, t->d_dst, t->bytes, cudaMemcpyDeviceToHost));
  GU_CUDA(cudaMemcpy(out, d_out, out_bytes, cudaMemcpyDeviceToHost));
  gu_rows_check(what, row_expert, t->R, t->dst, want, t->row, out, out_bytes);
}

GU_FN void gu_rows_free(gu_rows *t) {
  gu_free(t->d_dst);
  gu_free(t->d_table);
  free(t->dst);
}

/* A pinned host copy of `bytes` of device memory (a copy engine's source:
 * host-to-device copies need no SM); free with gu_pinned_free. */
GU_FN void *gu_pinned_copy(const void *d, size_t bytes) {
  void *h = NULL;
  GU_CUDA(cudaMallocHost(&h, bytes ? bytes : 1));
  gu_d2h(h, d, bytes);
  return h;
}

GU_FN void gu_pinned_free(void *h) {
  if (h)
    GU_CUDA(cudaFreeHost(h));
}

/* Rows that land while a GEMM runs (ml_cuda_gemm_wait of cuda/cuda.h): one
 * 64-bit signal per chunk of `rows` problem rows, the awaited value in a
 * device word, a control block for the waits' records, and a side stream
 * that delivers the rows after a pause, chunk by chunk in a shuffled order,
 * each chunk's signal copied in after its rows (stream order). Nothing of
 * the delivery may need an SM, which the waiting GEMM may hold all of: the
 * signals come from pinned host memory, and the caller's row copies must
 * too (a copy between two buffers of the device may run as a kernel). The
 * signals start one below the value, as if left by the previous use. */
typedef struct gu_feed {
  int chunks, rows;
  uint64_t value;
  uint64_t *d_signal; /* [chunks] */
  uint64_t *d_value;
  uint64_t *d_ctl;   /* MOELINK_CTL_* words */
  uint64_t *h_value; /* pinned: the value, source of the signal copies */
  cudaStream_t side;
} gu_feed;

GU_FN void gu_feed_reset(gu_feed *f) {
  uint64_t *h = (uint64_t *)gu_host((size_t)f->chunks * sizeof(uint64_t));
  for (int c = 0; c < f->chunks; ++c)
    h[c] = f->value - 1;
  gu_h2d(f->d_signal, h, (size_t)f->chunks * sizeof(uint64_t));
  free(h);
  GU_CUDA(cudaMemset(f->d_ctl, 0, 4 * sizeof(uint64_t)));
}

/* For R problem rows in chunks of `rows`; the GEMM waits for `value`. */
GU_FN gu_feed gu_feed_make(int R, int rows, uint64_t value) {
  gu_feed f;
  memset(&f, 0, sizeof f);
  f.rows = rows;
  f.chunks = R > 0 ? (R + rows - 1) / rows : 1;
  f.value = value;
  f.d_signal = (uint64_t *)gu_dev((size_t)f.chunks * sizeof(uint64_t));
  f.d_value = (uint64_t *)gu_dev(sizeof(uint64_t));
  f.d_ctl = (uint64_t *)gu_dev(4 * sizeof(uint64_t));
  gu_h2d(f.d_value, &value, sizeof value);
  GU_CUDA(cudaMallocHost((void **)&f.h_value, sizeof(uint64_t)));
  *f.h_value = value;
  GU_CUDA(cudaStreamCreateWithFlags(&f.side, cudaStreamNonBlocking));
  gu_feed_reset(&f);
  return f;
}

/* The one-rank device communicator whose control block the waits use. */
GU_FN moelink_device_comm_t gu_feed_comm(const gu_feed *f, uint64_t timeout_ns) {
  moelink_device_comm_t c;
  memset(&c, 0, sizeof c);
  c.rank = 0;
  c.nranks = 1;
  c.timeout_ns = timeout_ns;
  c.ctl[0] = f->d_ctl;
  return c;
}

static void CUDART_CB gu_feed_pause(void *arg) {
  (void)arg;
  struct timespec ts = {0, 2000000}; /* 2 ms: the GEMM is well under way */
  nanosleep(&ts, NULL);
}

/* A copy of problem rows [r0, r1) into place, enqueued on stream s. */
typedef void (*gu_feed_copy_fn)(void *ctx, int r0, int r1, cudaStream_t s);

/* The copies of a GEMM's A rows for gu_feed_run (gu_row_copy_rows): dense
 * (dst_index NULL), A rows r0 .. r1 - 1; gathered, the index entries
 * [r0, r1) and the A rows they name (h_index[r] / div; a row of no expert,
 * row_expert[r] < 0, names none). Each A row may bring the row of a second
 * array (FP8: its scales; dst2 NULL: none). Sources in pinned host memory:
 * a copy between two buffers of the device may run as a kernel, which would
 * need the SMs the waiting GEMM holds. */
typedef struct gu_row_copy {
  char *dst;
  const char *src;
  size_t row_bytes;
  char *dst2;
  const char *src2;
  size_t row2_bytes;
  int32_t *dst_index;
  const int32_t *src_index;
  const int32_t *h_index;
  int div;
  const int *row_expert;
} gu_row_copy;

/* Row r of a (dst, src) pair of arrays, from host to device on s. */
GU_FN void gu_row_copy_one(char *dst, const char *src, size_t row_bytes, size_t r, size_t rows,
                           cudaStream_t s) {
  GU_CUDA(cudaMemcpyAsync(dst + r * row_bytes, src + r * row_bytes, rows * row_bytes,
                          cudaMemcpyHostToDevice, s));
}

/* A gu_feed_copy_fn over a gu_row_copy. */
GU_FN void gu_row_copy_rows(void *ctx, int r0, int r1, cudaStream_t s) {
  const gu_row_copy *w = (const gu_row_copy *)ctx;
  if (w->dst_index == NULL) {
    gu_row_copy_one(w->dst, w->src, w->row_bytes, (size_t)r0, (size_t)(r1 - r0), s);
    if (w->dst2)
      gu_row_copy_one(w->dst2, w->src2, w->row2_bytes, (size_t)r0, (size_t)(r1 - r0), s);
    return;
  }
  GU_CUDA(cudaMemcpyAsync(w->dst_index + r0, w->src_index + r0, (size_t)(r1 - r0) * sizeof(int32_t),
                          cudaMemcpyHostToDevice, s));
  for (int r = r0; r < r1; ++r) {
    if (w->row_expert[r] < 0)
      continue;
    const size_t g = (size_t)(w->h_index[r] / w->div);
    gu_row_copy_one(w->dst, w->src, w->row_bytes, g, 1, s);
    if (w->dst2)
      gu_row_copy_one(w->dst2, w->src2, w->row2_bytes, g, 1, s);
  }
}

/* Enqueues the delivery of R rows on the side stream (call it after the
 * GEMM's launch): the pause, then every chunk in a shuffled order, its
 * rows by copy(), then its signal. */
GU_FN void gu_feed_run(gu_feed *f, int R, gu_feed_copy_fn copy, void *ctx, uint32_t seed) {
  int *order = (int *)gu_host((size_t)f->chunks * sizeof(int));
  for (int c = 0; c < f->chunks; ++c)
    order[c] = c;
  uint32_t x = seed * 2654435761u + 1u;
  for (int c = f->chunks - 1; c > 0; --c) {
    x = x * 1664525u + 1013904223u;
    const int j = (int)((x >> 8) % (uint32_t)(c + 1));
    const int t = order[c];
    order[c] = order[j];
    order[j] = t;
  }
  GU_CUDA(cudaLaunchHostFunc(f->side, gu_feed_pause, NULL));
  for (int i = 0; i < f->chunks; ++i) {
    const int c = order[i], r0 = c * f->rows, r1 = r0 + f->rows < R ? r0 + f->rows : R;
    if (r1 > r0)
      copy(ctx, r0, r1, f->side);
    GU_CUDA(cudaMemcpyAsync(f->d_signal + c, f->h_value, sizeof(uint64_t), cudaMemcpyHostToDevice,
                            f->side));
  }
  free(order);
}

/* After the GEMM's stream was synchronized: the delivery is done and no
 * wait gave up (the control block is untouched). */
GU_FN void gu_feed_check(gu_feed *f, const char *what) {
  GU_CUDA(cudaStreamSynchronize(f->side));
  uint64_t ctl[4];
  gu_d2h(ctl, f->d_ctl, sizeof ctl);
  CHECK(ctl[0] == 0 && ctl[2] == 0, "%s: no row wait gave up (control block %#llx %#llx)", what,
        (unsigned long long)ctl[0], (unsigned long long)ctl[2]);
}

GU_FN void gu_feed_free(gu_feed *f) {
  GU_CUDA(cudaStreamSynchronize(f->side));
  GU_CUDA(cudaStreamDestroy(f->side));
  GU_CUDA(cudaFreeHost(f->h_value));
  gu_free(f->d_signal);
  gu_free(f->d_value);
  gu_free(f->d_ctl);
}

/* 0xFF bytes: NaN in bf16, f16 and f32, -1 in int32: unwritten output shows. */
GU_FN void gu_poison(void *d, size_t bytes) {
  if (bytes) GU_CUDA(cudaMemset(d, 0xFF, bytes));
}

/* Both contexts, or a bail-out that says why the GPU is not usable. */
GU_FN void gu_contexts(moelink_context_t *gpu, moelink_context_t *cpu) {
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = MOELINK_BACKEND_CUDA;
  cc.device = 0;
  moelink_status_t s = moelink_context_create(&cc, gpu);
  CHECK(s == MOELINK_SUCCESS, "CUDA context on device 0%s%s", s ? ": " : "",
        s ? moelink_last_error() : "");
  if (s != MOELINK_SUCCESS) gu_bail("no CUDA context: the GPU tests need an sm_90 GPU");
  GU_MUST(moelink_context_create(NULL, cpu), "CPU context");
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    ml_t_diag("device 0: %s, sm_%d%d, %d SMs, %.1f GiB", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
}

GU_FN const char *gu_router_name(moelink_router_t r) {
  switch (r) {
  case MOELINK_ROUTER_SOFTMAX_TOPK: return "softmax_topk";
  case MOELINK_ROUTER_SIGMOID_TOPK: return "sigmoid_topk";
  case MOELINK_ROUTER_TOPK_SOFTMAX: return "topk_softmax";
  }
  return "?";
}

GU_FN void gu_describe(char *buf, size_t n, const moelink_moe_config_t *c) {
  snprintf(buf, n,
           "H %d I %d E %d k %d %s renorm %d groups %d/%d scale %g bias %d Is %d gate %d %s%s%s",
           c->hidden, c->inter, c->num_experts, c->top_k, gu_router_name(c->router), c->renormalize,
           c->topk_group, c->n_group, (double)c->routed_scaling, c->correction_bias,
           c->shared_inter, c->shared_gate, moelink_dtype_name(c->dtype),
           c->fp8_experts ? ", fp8 experts" : "", c->fp8_shared ? ", fp8 shared" : "");
}

/* The softmax router with a correction bias and group-limited selection (64
 * experts in 8 groups, 3 kept, k 6, scale 1.5): a router case the presets do
 * not have, which the layer tests share. */
GU_FN void gu_softmax_groups(moelink_moe_config_t *c) {
  c->num_experts = 64;
  c->top_k = 6;
  c->n_group = 8;
  c->topk_group = 3;
  c->correction_bias = 1;
  c->routed_scaling = 1.5f;
}

/* ---- a layer's weights on the device ------------------------------------------ */

typedef struct gu_dev_layer {
  void *router, *gate_up, *down, *sh_gate_up, *sh_down, *sh_gate;
  float *bias;
  float *gate_up_scale, *down_scale; /* cfg.fp8_experts only, else NULL */
  float *sh_gate_up_scale, *sh_down_scale; /* cfg.fp8_shared only, else NULL */
  moelink_moe_weights_t w;
} gu_dev_layer;

GU_FN size_t gu_elems_router(const moelink_moe_config_t *c) {
  return (size_t)c->num_experts * (size_t)c->hidden;
}
GU_FN size_t gu_elems_gate_up(const moelink_moe_config_t *c) {
  return (size_t)c->num_experts * 2 * (size_t)c->inter * (size_t)c->hidden;
}
GU_FN size_t gu_elems_down(const moelink_moe_config_t *c) {
  return (size_t)c->num_experts * (size_t)c->hidden * (size_t)c->inter;
}
/* Bytes of one routed expert weight: e4m3 bytes with cfg.fp8_experts (the
 * router, shared expert and shared gate stay in the layer dtype). */
GU_FN size_t gu_expert_weight_size(const moelink_moe_config_t *c) {
  return c->fp8_experts ? 1 : moelink_dtype_size(c->dtype);
}
/* fp32 block scales of an FP8 layer: [E, 2I/128, H/128] and [E, H/128, I/128]. */
GU_FN size_t gu_elems_gate_up_scale(const moelink_moe_config_t *c) {
  return c->fp8_experts ? gu_elems_gate_up(c) / (128 * 128) : 0;
}
GU_FN size_t gu_elems_down_scale(const moelink_moe_config_t *c) {
  return c->fp8_experts ? gu_elems_down(c) / (128 * 128) : 0;
}

GU_FN void gu_dev_layer_bind(gu_dev_layer *D, moelink_dtype_t dt) {
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.dtype = dt;
  w.router = D->router;
  w.correction_bias = D->bias;
  w.gate_up = D->gate_up;
  w.down = D->down;
  w.shared_gate_up = D->sh_gate_up;
  w.shared_down = D->sh_down;
  w.shared_gate = D->sh_gate;
  w.gate_up_scale = D->gate_up_scale;
  w.down_scale = D->down_scale;
  w.shared_gate_up_scale = D->sh_gate_up_scale;
  w.shared_down_scale = D->sh_down_scale;
  D->w = w;
}

/* Device copy of a host test layer (an FP8 one too: its e4m3 expert weights
 * and their block scales). */
GU_FN void gu_dev_layer_upload(gu_dev_layer *D, const ref_layer *L) {
  const moelink_moe_config_t *c = &L->cfg;
  const size_t es = moelink_dtype_size(c->dtype), wes = gu_expert_weight_size(c);
  const size_t H = (size_t)c->hidden, Is = (size_t)c->shared_inter;
  memset(D, 0, sizeof *D);
  D->router = gu_dev(gu_elems_router(c) * es);
  gu_h2d(D->router, L->router, gu_elems_router(c) * es);
  D->gate_up = gu_dev(gu_elems_gate_up(c) * wes);
  gu_h2d(D->gate_up, L->gate_up, gu_elems_gate_up(c) * wes);
  D->down = gu_dev(gu_elems_down(c) * wes);
  gu_h2d(D->down, L->down, gu_elems_down(c) * wes);
  if (c->fp8_experts) {
    if (!L->gate_up_scale || !L->down_scale) {
      CHECK(0, "FP8 test layer without block scales");
      gu_bail("FP8 test layer without block scales");
    }
    const size_t ngs = gu_elems_gate_up_scale(c), nds = gu_elems_down_scale(c);
    D->gate_up_scale = (float *)gu_dev(ngs * sizeof(float));
    gu_h2d(D->gate_up_scale, L->gate_up_scale, ngs * sizeof(float));
    D->down_scale = (float *)gu_dev(nds * sizeof(float));
    gu_h2d(D->down_scale, L->down_scale, nds * sizeof(float));
  }
  if (Is > 0) {
    /* fp8_shared: e4m3 bytes and their block scales */
    const size_t ses = c->fp8_shared ? 1 : es, nb = 128 * 128;
    D->sh_gate_up = gu_dev(2 * Is * H * ses);
    gu_h2d(D->sh_gate_up, L->shared_gate_up, 2 * Is * H * ses);
    D->sh_down = gu_dev(H * Is * ses);
    gu_h2d(D->sh_down, L->shared_down, H * Is * ses);
    if (c->fp8_shared) {
      if (!L->shared_gate_up_scale || !L->shared_down_scale) {
        CHECK(0, "FP8 shared expert without block scales");
        gu_bail("FP8 shared expert without block scales");
      }
      D->sh_gate_up_scale = (float *)gu_dev(2 * Is * H / nb * sizeof(float));
      gu_h2d(D->sh_gate_up_scale, L->shared_gate_up_scale, 2 * Is * H / nb * sizeof(float));
      D->sh_down_scale = (float *)gu_dev(H * Is / nb * sizeof(float));
      gu_h2d(D->sh_down_scale, L->shared_down_scale, H * Is / nb * sizeof(float));
    }
  }
  if (c->shared_gate) {
    D->sh_gate = gu_dev(H * es);
    gu_h2d(D->sh_gate, L->shared_gate, H * es);
  }
  if (c->correction_bias) {
    D->bias = (float *)gu_dev((size_t)c->num_experts * sizeof(float));
    gu_h2d(D->bias, L->bias, (size_t)c->num_experts * sizeof(float));
  }
  gu_dev_layer_bind(D, c->dtype);
}

GU_FN void gu_dev_layer_free(gu_dev_layer *D) {
  gu_free(D->router);
  gu_free(D->gate_up);
  gu_free(D->down);
  gu_free(D->sh_gate_up);
  gu_free(D->sh_down);
  gu_free(D->sh_gate);
  gu_free(D->bias);
  gu_free(D->gate_up_scale);
  gu_free(D->down_scale);
  gu_free(D->sh_gate_up_scale);
  gu_free(D->sh_down_scale);
  memset(D, 0, sizeof *D);
}

/* A test layer on both backends: ref_layer_make's weights (zipf: its routing
 * skew), a device copy of them, and a GPU and a CPU layer on contexts gpu and
 * cpu holding them. Returns 0, or -1 (a failed check is recorded, nothing is
 * left allocated) when ref_layer_make fails; a failed create bails out. */
GU_FN int gu_layer_setup(const char *name, const moelink_moe_config_t *cfg, uint64_t seed,
                         double zipf, moelink_context_t gpu, moelink_context_t cpu, ref_layer *L,
                         gu_dev_layer *D, moelink_moe_t *gmoe, moelink_moe_t *cmoe) {
  if (ref_layer_make(L, cfg, seed, zipf) != 0) {
    CHECK(0, "ref_layer_make for %s", name);
    return -1;
  }
  gu_dev_layer_upload(D, L);
  *gmoe = NULL;
  *cmoe = NULL;
  GU_MUST(moelink_moe_create(gpu, cfg, gmoe), "GPU layer");
  GU_MUST(moelink_moe_create(cpu, cfg, cmoe), "CPU layer");
  GU_MUST(moelink_moe_set_weights(*gmoe, &D->w), "GPU weights");
  GU_MUST(moelink_moe_set_weights(*cmoe, &L->w), "CPU weights");
  return 0;
}

/* ---- comparisons ------------------------------------------------------------------ */

/* Position of a 16-bit float in the total order of its bit patterns, so that
 * neighbouring values differ by 1. */
GU_FN int gu_ord16(uint16_t h) { return (h & 0x8000u) ? -(int)(h & 0x7fffu) : (int)h; }

/* Relative L2 over rows [0, rows) of width H between got and want (both
 * dtype), leaving out rows with skip[r] != 0 (skip may be NULL). Also the
 * worst single row, and the number of non-finite values in got (poison that
 * was never overwritten shows up here). Rows of a zero reference count their
 * own norm, as ref_rel_l2 does. */
typedef struct gu_err {
  double rel;        /* over all compared rows */
  double worst_row;  /* worst per-row relative L2 */
  long worst_at;     /* its row */
  long nonfinite;    /* NaN/Inf values in got (all rows, skipped ones too) */
  long first_nonfinite;
  long rows;         /* rows compared */
} gu_err;

GU_FN gu_err gu_compare(moelink_dtype_t dt, const void *got, const void *want, size_t rows,
                        size_t H, const unsigned char *skip) {
  gu_err r;
  memset(&r, 0, sizeof r);
  r.worst_at = -1;
  r.first_nonfinite = -1;
  double dsum = 0.0, nsum = 0.0;
  for (size_t t = 0; t < rows; ++t) {
    double d = 0.0, n = 0.0;
    int bad = 0;
    for (size_t i = 0; i < H; ++i) {
      const double g = ref_load(dt, got, t * H + i), w = ref_load(dt, want, t * H + i);
      if (!isfinite(g)) {
        if (r.nonfinite++ == 0) r.first_nonfinite = (long)(t * H + i);
        bad = 1;
        continue;
      }
      d += (g - w) * (g - w);
      n += w * w;
    }
    if (skip && skip[t]) continue;
    ++r.rows;
    dsum += d;
    nsum += n;
    double rel = bad ? INFINITY : (n > 0.0 ? sqrt(d / n) : sqrt(d));
    if (rel > r.worst_row || r.worst_at < 0) {
      r.worst_row = rel;
      r.worst_at = (long)t;
    }
  }
  r.rel = r.nonfinite ? INFINITY : (nsum > 0.0 ? sqrt(dsum / nsum) : sqrt(dsum));
  return r;
}

/* Prints the first few differing elements of row `row` (for a failed check). */
GU_FN void gu_show_row(const char *what, moelink_dtype_t dt, const void *got, const void *want,
                       size_t row, size_t H) {
  int shown = 0;
  for (size_t i = 0; i < H && shown < 6; ++i) {
    const double g = ref_load(dt, got, row * H + i), w = ref_load(dt, want, row * H + i);
    if (!(fabs(g - w) <= 1e-2 * fabs(w) + 1e-3)) {
      ml_t_diag("  %s row %zu col %zu: got %.6g want %.6g", what, row, i, g, w);
      ++shown;
    }
  }
  if (!shown && H > 0)
    ml_t_diag("  %s row %zu: col 0 got %.6g want %.6g (no single element off by > 1%%)", what,
              row, ref_load(dt, got, row * H), ref_load(dt, want, row * H));
}

/* Checks an error report against the given tolerances (whole batch, worst
 * row), with diagnostics. */
GU_FN void gu_check_err_tol(const char *what, gu_err e, moelink_dtype_t dt, const void *got,
                            const void *want, size_t H, double tol, double tol_row) {
  CHECK(e.nonfinite == 0, "%s: all outputs finite (%ld non-finite, first at element %ld)", what,
        e.nonfinite, e.first_nonfinite);
  CHECK(e.rel <= tol, "%s: relative L2 %.3g <= %g over %ld rows", what, e.rel, tol, e.rows);
  CHECK(e.worst_row <= tol_row, "%s: worst row %ld relative L2 %.3g <= %g", what, e.worst_at,
        e.worst_row, tol_row);
  if ((e.rel > tol || e.worst_row > tol_row) && e.worst_at >= 0)
    gu_show_row(what, dt, got, want, (size_t)e.worst_at, H);
}

/* Checks an error report against GU_TOL / GU_TOL_ROW. */
GU_FN void gu_check_err(const char *what, gu_err e, moelink_dtype_t dt, const void *got,
                        const void *want, size_t H) {
  gu_check_err_tol(what, e, dt, got, want, H, GU_TOL, GU_TOL_ROW);
}

/* ---- routing ------------------------------------------------------------------------ */

typedef struct gu_route_stats {
  int tokens, exact, near_ties, bad, bad_ids, weight_bad;
  double max_wrel;
} gu_route_stats;

GU_FN void gu_print_ids(const char *label, const int32_t *ids, int k) {
  char buf[512];
  int n = 0;
  for (int j = 0; j < k && n < (int)sizeof buf - 16; ++j)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "%s%d", j ? " " : "", ids[j]);
  ml_t_diag("    %s [%s]", label, buf);
}

/* Compares GPU routing (gi, gw) with the CPU's (ci, cw) for host x [T, H] and
 * host weights hw. A token whose ids differ is accepted only as a near tie
 * (ref_route_margin < GU_TIE); such tokens get tie[t] = 1 (tie may be NULL) so
 * that output comparisons leave them out. GPU ids must be valid and distinct. */
GU_FN gu_route_stats gu_compare_routes(const char *what, const moelink_moe_config_t *cfg,
                                       const moelink_moe_weights_t *hw, const void *hx, int T,
                                       const int32_t *gi, const float *gw, const int32_t *ci,
                                       const float *cw, unsigned char *tie) {
  const int k = cfg->top_k, E = cfg->num_experts;
  const size_t row = (size_t)cfg->hidden * moelink_dtype_size(cfg->dtype);
  gu_route_stats st;
  memset(&st, 0, sizeof st);
  st.tokens = T;
  int shown_bad = 0, shown_tie = 0, shown_w = 0;
  for (int t = 0; t < T; ++t) {
    const int32_t *g = gi + (size_t)t * k, *c = ci + (size_t)t * k;
    if (tie) tie[t] = 0;
    int valid = 1;
    for (int j = 0; j < k; ++j) {
      if (g[j] < 0 || g[j] >= E) valid = 0;
      for (int q = 0; q < j; ++q)
        if (g[q] == g[j]) valid = 0;
    }
    if (!valid) {
      ++st.bad_ids;
      if (tie) tie[t] = 1;
      if (shown_bad++ < 8) {
        ml_t_diag("  %s token %d: invalid or repeated GPU ids", what, t);
        gu_print_ids("gpu", g, k);
      }
      continue;
    }
    if (memcmp(g, c, sizeof(int32_t) * (size_t)k) == 0) {
      ++st.exact;
      for (int j = 0; j < k; ++j) {
        const double a = gw[(size_t)t * k + j], b = cw[(size_t)t * k + j];
        const double rel = fabs(a - b) / fmax(fabs(b), 1e-30);
        if (!(rel <= st.max_wrel)) st.max_wrel = isnan(rel) ? INFINITY : rel;
        if (!(rel <= 1e-3)) {
          ++st.weight_bad;
          if (shown_w++ < 8)
            ml_t_diag("  %s token %d slot %d expert %d: gpu weight %.9g cpu weight %.9g", what,
                      t, j, g[j], a, b);
        }
      }
      continue;
    }
    const double margin = ref_route_margin(cfg, hw, (const char *)hx + row * (size_t)t);
    if (margin >= 0.0 && margin < GU_TIE) {
      ++st.near_ties;
      if (tie) tie[t] = 1;
      if (shown_tie++ < 3) {
        ml_t_diag("  %s token %d: near tie (margin %.3g), ids differ", what, t, margin);
        gu_print_ids("gpu", g, k);
        gu_print_ids("cpu", c, k);
      }
    } else {
      ++st.bad;
      if (tie) tie[t] = 1;
      if (shown_bad++ < 8) {
        ml_t_diag("  %s token %d: ids differ, margin %.3g is no tie", what, t, margin);
        gu_print_ids("gpu", g, k);
        gu_print_ids("cpu", c, k);
        int32_t rid[64];
        double rw[64];
        if (k <= 64 && ref_route_token(cfg, hw, (const char *)hx + row * (size_t)t, rid, rw) == 0)
          gu_print_ids("ref", rid, k);
      }
    }
  }
  return st;
}

GU_FN void gu_check_routes(const char *what, gu_route_stats st) {
  const int allowed = st.tokens / 50 > 3 ? st.tokens / 50 : 3;
  CHECK(st.bad_ids == 0, "%s: GPU ids valid and distinct (%d bad tokens of %d)", what, st.bad_ids,
        st.tokens);
  CHECK(st.bad == 0, "%s: ids equal the CPU's but for near ties (%d equal, %d near ties, %d wrong "
                     "of %d)", what, st.exact, st.near_ties, st.bad, st.tokens);
  CHECK(st.near_ties <= allowed, "%s: near ties %d <= %d", what, st.near_ties, allowed);
  CHECK(st.weight_bad == 0, "%s: weights within 1e-3 relative (worst %.3g, %d off)", what,
        st.max_wrel, st.weight_bad);
}

/* The GPU's routing of host tokens hx [T, H] (dids, dw: [T, k] on the
 * device) against the CPU layer cmoe's, checked as gu_check_routes does: gi
 * gets the GPU's ids ([T, k] on the host), tie the near ties
 * (gu_compare_routes). */
GU_FN gu_route_stats gu_routes_check(const char *what, const ref_layer *L, moelink_moe_t cmoe,
                                     const void *hx, int T, const int32_t *dids, const float *dw,
                                     int32_t *gi, unsigned char *tie) {
  const size_t n = (size_t)T * (size_t)L->cfg.top_k;
  int32_t *ci = gu_host(n * 4);
  float *gw = gu_host(n * 4), *cw = gu_host(n * 4);
  gu_d2h(gi, dids, n * 4);
  gu_d2h(gw, dw, n * 4);
  CHECK_OK(moelink_moe_route(cmoe, hx, T, ci, cw, NULL), "CPU route");
  const gu_route_stats rs = gu_compare_routes(what, &L->cfg, &L->w, hx, T, gi, gw, ci, cw, tie);
  gu_check_routes(what, rs);
  free(ci);
  free(gw);
  free(cw);
  return rs;
}

/* An e4m3 copy q [rows][n] with its scales s [rows][n / 128] against a
 * reference (qr, sr): on the owned rows (r < R and row_expert[r] >= 0) byte
 * for byte and scale for scale, elsewhere the poison (bytes 0xA5, scales of
 * all-one bits) unchanged. Adds to the counts. */
typedef struct gu_q_diff {
  long owned, bad_q, bad_s, poison;
} gu_q_diff;

GU_FN void gu_q_compare(const int *row_expert, int R, int rows, int n, const uint8_t *q,
                        const uint8_t *qr, const float *s, const float *sr, gu_q_diff *d) {
  for (int r = 0; r < rows; ++r) {
    const int own = r < R && row_expert[r] >= 0;
    d->owned += own;
    for (int i = 0; i < n; ++i) {
      const size_t at = (size_t)r * n + i;
      if (own)
        d->bad_q += q[at] != qr[at];
      else
        d->poison += q[at] != 0xA5;
    }
    for (int b = 0; b < n / 128; ++b) {
      const size_t at = (size_t)r * (n / 128) + b;
      uint32_t u;
      memcpy(&u, s + at, 4);
      if (own)
        d->bad_s += memcmp(s + at, sr + at, 4) != 0;
      else
        d->poison += u != 0xFFFFFFFFu;
    }
  }
}

#endif
