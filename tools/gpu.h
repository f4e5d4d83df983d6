/* The CLI's thin layer over the CUDA runtime (tools/gpu.c) and the
 * benchmark floors (tools/floors.cu). Every function returns 0 on success or
 * -1 with the reason in gpu_error(). Built without CUDA, they all fail with
 * "built without CUDA" so callers need no #ifdefs. */
#ifndef MOELINK_CLI_GPU_H
#define MOELINK_CLI_GPU_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

const char *gpu_error(void);
/* Records a failure message (used by floors.cu too). Returns -1. */
int gpu_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

int gpu_device_name(char *buf, size_t n);
int gpu_malloc(void **p, size_t bytes, const char *what);
void gpu_free(void *p);
int gpu_h2d(void *dst, const void *src, size_t bytes);
int gpu_d2h(void *dst, const void *src, size_t bytes);
int gpu_stream_create(void **stream);
void gpu_stream_destroy(void *stream);
int gpu_stream_sync(void *stream);
/* Writes bytes of buf with cudaMemsetAsync. */
int gpu_memset_async(void *buf, int value, size_t bytes, void *stream);
/* Evicts what a timed call could find in L2 (tools/floors.cu), buf being a
 * device buffer of bytes >= 2 x the L2: GPU_FLUSH_READ reads it (the L2 is
 * left clean, as the read-bandwidth floor finds it), GPU_FLUSH_WRITE memsets
 * it to seq & 0xff (the L2 is left dirty: the timed call pays the write-back
 * of up to an L2 of lines; the benchmarks' flush before commit e958a9d). */
enum { GPU_FLUSH_READ = 0, GPU_FLUSH_WRITE = 1 };
int gpu_l2_flush_async(void *buf, size_t bytes, int mode, int seq, void *stream);

/* Stream capture into a CUDA graph: begin, then end with the instantiated
 * graph in *exec (launch with gpu_graph_launch, free with gpu_graph_destroy). */
int gpu_graph_begin(void *stream);
int gpu_graph_end(void *stream, void **exec);
int gpu_graph_launch(void *exec, void *stream);
void gpu_graph_destroy(void *exec);

typedef struct gpu_timer {
  void *start, *stop;
} gpu_timer;
int gpu_timer_create(gpu_timer *t);
void gpu_timer_destroy(gpu_timer *t);
int gpu_timer_start(gpu_timer *t, void *stream);
/* Records the stop event, waits for it and returns the elapsed milliseconds. */
int gpu_timer_stop(gpu_timer *t, void *stream, double *ms);

/* Up to GPU_MARKS time points of one stream: record them in order, then read
 * the n - 1 intervals between consecutive ones (waits for the last). */
#define GPU_MARKS 4
typedef struct gpu_marks {
  void *ev[GPU_MARKS];
  int n; /* recorded since the last read */
} gpu_marks;
int gpu_marks_create(gpu_marks *m);
void gpu_marks_destroy(gpu_marks *m);
int gpu_marks_record(gpu_marks *m, void *stream);
/* ms[i] = time from point i to point i + 1, i < n - 1; starts over. */
int gpu_marks_read(gpu_marks *m, double *ms);

/* ---- floors (tools/floors.cu) -------------------------------------------
 * Read bandwidth: one kernel streams a buffer of `bytes` once with 16-byte
 * loads; median over iters of GB/s (1e9 bytes/s). */
int fl_read_bandwidth(size_t bytes, int iters, double *gbps);
/* Dense bf16 GEMM n x n x n through cuBLAS (fp32 compute) on random data;
 * median over iters of TFLOP/s. */
int fl_matmul_rate(int n, int iters, double *tflops);

#ifdef __cplusplus
}
#endif

#endif
