/* CUDA runtime wrappers for the CLI. The C side talks to the runtime API
 * directly (it is a C API); only kernels live in .cu files. */
#include "gpu.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static char gpu_msg[512];

const char *gpu_error(void) { return gpu_msg; }

int gpu_set_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(gpu_msg, sizeof gpu_msg, fmt, ap);
  va_end(ap);
  return -1;
}

#ifdef MOELINK_HAVE_CUDA
#include <cuda_runtime_api.h>

#define GPU_TRY(call)                                                          \
  do {                                                                         \
    cudaError_t gpu_e_ = (call);                                               \
    if (gpu_e_ != cudaSuccess)                                                 \
      return gpu_set_error("%s: %s", #call, cudaGetErrorString(gpu_e_));       \
  } while (0)

int gpu_device_name(char *buf, size_t n) {
  int dev = 0;
  struct cudaDeviceProp prop;
  GPU_TRY(cudaGetDevice(&dev));
  GPU_TRY(cudaGetDeviceProperties(&prop, dev));
  snprintf(buf, n, "%s", prop.name);
  return 0;
}

int gpu_malloc(void **p, size_t bytes, const char *what) {
  *p = NULL;
  cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    *p = NULL;
    return gpu_set_error("cudaMalloc of %.3f GB for %s: %s", (double)bytes / 1e9, what,
                         cudaGetErrorString(e));
  }
  return 0;
}

void gpu_free(void *p) {
  if (p) (void)cudaFree(p);
}

int gpu_h2d(void *dst, const void *src, size_t bytes) {
  GPU_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return 0;
}

int gpu_d2h(void *dst, const void *src, size_t bytes) {
  GPU_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return 0;
}

int gpu_stream_create(void **stream) {
  cudaStream_t s = NULL;
  GPU_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *stream = (void *)s;
  return 0;
}

void gpu_stream_destroy(void *stream) {
  if (stream) (void)cudaStreamDestroy((cudaStream_t)stream);
}

int gpu_stream_sync(void *stream) {
  GPU_TRY(cudaStreamSynchronize((cudaStream_t)stream));
  /* A kernel fault surfaces on the next call; ask now so it is blamed here. */
  GPU_TRY(cudaGetLastError());
  return 0;
}

int gpu_memset_async(void *buf, int value, size_t bytes, void *stream) {
  GPU_TRY(cudaMemsetAsync(buf, value, bytes, (cudaStream_t)stream));
  return 0;
}

int gpu_timer_create(gpu_timer *t) {
  cudaEvent_t a = NULL, b = NULL;
  t->start = t->stop = NULL;
  GPU_TRY(cudaEventCreate(&a));
  cudaError_t e = cudaEventCreate(&b);
  if (e != cudaSuccess) {
    (void)cudaEventDestroy(a);
    return gpu_set_error("cudaEventCreate: %s", cudaGetErrorString(e));
  }
  t->start = (void *)a;
  t->stop = (void *)b;
  return 0;
}

void gpu_timer_destroy(gpu_timer *t) {
  if (t->start) (void)cudaEventDestroy((cudaEvent_t)t->start);
  if (t->stop) (void)cudaEventDestroy((cudaEvent_t)t->stop);
  t->start = t->stop = NULL;
}

int gpu_timer_start(gpu_timer *t, void *stream) {
  GPU_TRY(cudaEventRecord((cudaEvent_t)t->start, (cudaStream_t)stream));
  return 0;
}

int gpu_timer_stop(gpu_timer *t, void *stream, double *ms) {
  float f = 0.0f;
  GPU_TRY(cudaEventRecord((cudaEvent_t)t->stop, (cudaStream_t)stream));
  GPU_TRY(cudaEventSynchronize((cudaEvent_t)t->stop));
  GPU_TRY(cudaGetLastError());
  GPU_TRY(cudaEventElapsedTime(&f, (cudaEvent_t)t->start, (cudaEvent_t)t->stop));
  *ms = (double)f;
  return 0;
}

int gpu_marks_create(gpu_marks *m) {
  memset(m, 0, sizeof *m);
  for (int i = 0; i < GPU_MARKS; ++i) {
    cudaEvent_t e = NULL;
    cudaError_t r = cudaEventCreate(&e);
    if (r != cudaSuccess) {
      gpu_marks_destroy(m);
      return gpu_set_error("cudaEventCreate: %s", cudaGetErrorString(r));
    }
    m->ev[i] = (void *)e;
  }
  return 0;
}

void gpu_marks_destroy(gpu_marks *m) {
  for (int i = 0; i < GPU_MARKS; ++i)
    if (m->ev[i]) (void)cudaEventDestroy((cudaEvent_t)m->ev[i]);
  memset(m, 0, sizeof *m);
}

int gpu_marks_record(gpu_marks *m, void *stream) {
  if (m->n >= GPU_MARKS) return gpu_set_error("gpu_marks: more than %d points", GPU_MARKS);
  GPU_TRY(cudaEventRecord((cudaEvent_t)m->ev[m->n], (cudaStream_t)stream));
  ++m->n;
  return 0;
}

int gpu_marks_read(gpu_marks *m, double *ms) {
  const int n = m->n;
  m->n = 0;
  if (n < 2) return gpu_set_error("gpu_marks: %d points recorded (need 2)", n);
  GPU_TRY(cudaEventSynchronize((cudaEvent_t)m->ev[n - 1]));
  GPU_TRY(cudaGetLastError());
  for (int i = 0; i + 1 < n; ++i) {
    float f = 0.0f;
    GPU_TRY(cudaEventElapsedTime(&f, (cudaEvent_t)m->ev[i], (cudaEvent_t)m->ev[i + 1]));
    ms[i] = (double)f;
  }
  return 0;
}

int gpu_graph_begin(void *stream) {
  GPU_TRY(cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal));
  return 0;
}

int gpu_graph_end(void *stream, void **exec) {
  cudaGraph_t g = NULL;
  cudaGraphExec_t x = NULL;
  *exec = NULL;
  GPU_TRY(cudaStreamEndCapture((cudaStream_t)stream, &g));
  cudaError_t e = cudaGraphInstantiate(&x, g, 0);
  (void)cudaGraphDestroy(g);
  if (e != cudaSuccess) return gpu_set_error("cudaGraphInstantiate: %s", cudaGetErrorString(e));
  *exec = (void *)x;
  return 0;
}

int gpu_graph_launch(void *exec, void *stream) {
  GPU_TRY(cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream));
  return 0;
}

void gpu_graph_destroy(void *exec) {
  if (exec) (void)cudaGraphExecDestroy((cudaGraphExec_t)exec);
}

#else /* built without CUDA: every entry fails the same way */

#define GPU_NONE() gpu_set_error("this moelink was built without CUDA (configure with -DMOELINK_CUDA=ON)")

int gpu_device_name(char *buf, size_t n) {
  if (n) buf[0] = '\0';
  return GPU_NONE();
}
int gpu_malloc(void **p, size_t bytes, const char *what) {
  *p = NULL;
  return GPU_NONE();
}
void gpu_free(void *p) {}
int gpu_h2d(void *dst, const void *src, size_t bytes) { return GPU_NONE(); }
int gpu_d2h(void *dst, const void *src, size_t bytes) { return GPU_NONE(); }
int gpu_stream_create(void **stream) {
  *stream = NULL;
  return GPU_NONE();
}
void gpu_stream_destroy(void *stream) {}
int gpu_stream_sync(void *stream) { return GPU_NONE(); }
int gpu_memset_async(void *buf, int value, size_t bytes, void *stream) { return GPU_NONE(); }
int gpu_marks_create(gpu_marks *m) {
  memset(m, 0, sizeof *m);
  return GPU_NONE();
}
void gpu_marks_destroy(gpu_marks *m) {}
int gpu_marks_record(gpu_marks *m, void *stream) { return GPU_NONE(); }
int gpu_marks_read(gpu_marks *m, double *ms) { return GPU_NONE(); }
int gpu_graph_begin(void *stream) { return GPU_NONE(); }
int gpu_graph_end(void *stream, void **exec) {
  *exec = NULL;
  return GPU_NONE();
}
int gpu_graph_launch(void *exec, void *stream) { return GPU_NONE(); }
void gpu_graph_destroy(void *exec) {}
int gpu_timer_create(gpu_timer *t) {
  t->start = t->stop = NULL;
  return GPU_NONE();
}
void gpu_timer_destroy(gpu_timer *t) {}
int gpu_timer_start(gpu_timer *t, void *stream) { return GPU_NONE(); }
int gpu_timer_stop(gpu_timer *t, void *stream, double *ms) {
  *ms = 0.0;
  return GPU_NONE();
}
int gpu_l2_flush_async(void *buf, size_t bytes, int mode, int seq, void *stream) {
  return GPU_NONE();
}
int fl_read_bandwidth(size_t bytes, int iters, double *gbps) {
  *gbps = 0.0;
  return GPU_NONE();
}
int fl_matmul_rate(int n, int iters, double *tflops) {
  *tflops = 0.0;
  return GPU_NONE();
}
#endif
