/* The CUDA grouped GEMMs (ml_cuda_gemm_swiglu, ml_cuda_gemm_scaled) against a
 * double-precision host computation, on tile lists shaped like a MoE plan:
 * tiles of 1, 7, 13, 64 rows, an expert with no tile, rows between experts
 * that no tile covers, entries past *num_tiles that would overwrite those
 * rows if they ran, n and k that are not multiples of the CTA tile, row
 * strides wider than k (the padding holds NaN, so reading it shows), and the
 * dense form. Outputs are filled with 0xFF bytes (NaN in every output dtype)
 * before each run: every row that must be written is checked element by
 * element, every other byte must still be 0xFF. Each run is done twice and
 * must be bitwise equal; one is replayed from a captured CUDA graph.
 *
 * Inputs are multiples of 2^-8 (times a power of two) with at most 8
 * significant bits, exact in bf16 and f16, so the host computation uses the
 * very values the GPU sees without any conversion code in common.
 *
 * Both engines behind the launchers run every case: the mma.sync tile
 * engine and, on a compute capability 9.0 device, the sm_90a wgmma kernel,
 * pinned in turn through ml_cuda_gemm_set_engine. After each launch the test
 * checks which engine ran, so a shape meant for the sm_90a kernel that
 * silently fell back would fail. Cases for the sm_90a kernel: odd n and k
 * (partial column blocks and k steps, TMA zero fill), the two tiles of a
 * unit whose rows do not follow each other, an expert's odd last tile alone
 * in its unit, and a many-expert list where every CTA walks past several
 * experts and takes several work items. Every scaled case with a dtype output
 * and k % 8 == 0 runs again with its rows stored through a pointer table
 * (ml_cuda_gemm_opts.out_rows, the expert-parallel return's hook), rows
 * reversed: bitwise the plain run's rows, nothing else written. On the
 * sm_90a engine every GEMM with a 16-bit output runs once more with its
 * rows stored by the consumer threads instead of TMA stores: the same bits.
 * Four cases run both GEMMs again with their A rows (and index entries)
 * landing while the GEMM runs (ml_cuda_gemm_opts.wait, check_wait): bitwise
 * the plain run's output, and a wait whose rows never come gives up and
 * says so. */
#include "cuda/cuda.h"
#include "cuda/gemm/sm90_engine.cuh"
#include "gpu_util.h"
#include "harness.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1e-2
#define GUARD_ROWS 3 /* poisoned rows after the last problem row */

/* ---- host helpers ---------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng_next(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 16);
}
/* m / 256 * scale with |m| <= 255: at most 8 significant bits. */
static double rng_value(double scale) {
  int m = (int)(rng_next() % 511) - 255;
  return m / 256.0 * scale;
}

/* Exact encoders (the values are representable by construction). */
static uint16_t enc_bf16(double v) {
  float f = (float)v;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}
static uint16_t enc_f16(double v) {
  uint16_t sign = v < 0 ? 0x8000 : 0;
  double a = fabs(v);
  if (a == 0) return sign;
  int e;
  frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  int E = e - 1 + 15;
  if (E >= 1) return (uint16_t)(sign | (E << 10) | (uint16_t)((ldexp(a, -(e - 1)) - 1.0) * 1024.0));
  return (uint16_t)(sign | (uint16_t)ldexp(a, 24)); /* subnormal */
}
static uint16_t enc(moelink_dtype_t dt, double v) {
  return dt == MOELINK_DTYPE_BF16 ? enc_bf16(v) : enc_f16(v);
}
static double dec(moelink_dtype_t dt, uint16_t h) {
  if (dt == MOELINK_DTYPE_BF16) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  int s = h >> 15, E = (h >> 10) & 31, m = h & 1023;
  double v;
  if (E == 31) v = m ? NAN : INFINITY;
  else if (E == 0) v = ldexp(m, -24);
  else v = ldexp(1024 + m, E - 25);
  return s ? -v : v;
}

/* A power of two near 1 / sqrt(k), so dot products stay of order 1. */
static double weight_scale(int k) {
  return ldexp(1.0, -(int)floor(log2(sqrt((double)(k > 0 ? k : 1))) + 0.5));
}

#define CUDA_CHECK(call)                                                       \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      printf("# %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

static void *dev_copy(const void *host, size_t bytes) {
  void *d = NULL;
  CUDA_CHECK(cudaMalloc(&d, bytes ? bytes : 16));
  if (bytes) CUDA_CHECK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

/* ---- problems ------------------------------------------------------------ */

/* A tile list over R problem rows; row_expert[r] = -1 for rows no tile owns. */
typedef struct problem {
  int E, R;           /* experts, problem rows (gaps included) */
  int num_tiles, max_tiles;
  int32_t *tiles;     /* 3 * max_tiles; NULL: dense over R rows */
  int *row_expert;    /* [R] */
  int real_rows;
} problem;

/* Builds a tile list from per-expert tile sizes: sizes[e] is a 0-terminated
 * list of tile row counts for expert e, gap[e] rows follow the expert. The
 * entries past num_tiles (extra of them) point at gap rows, so running them
 * would be caught. */
static void problem_make(problem *p, int E, const int sizes[][4], const int *gap, int extra) {
  memset(p, 0, sizeof *p);
  p->E = E;
  int nt = 0, R = 0;
  for (int e = 0; e < E; ++e) {
    for (int i = 0; i < 4 && sizes[e][i]; ++i) ++nt, R += sizes[e][i];
    R += gap[e];
  }
  p->R = R;
  p->num_tiles = nt;
  p->max_tiles = nt + extra;
  p->tiles = calloc((size_t)3 * (p->max_tiles ? p->max_tiles : 1), sizeof(int32_t));
  p->row_expert = malloc((size_t)R * sizeof(int));
  int t = 0, row = 0, first_gap = -1;
  for (int e = 0; e < E; ++e) {
    for (int i = 0; i < 4 && sizes[e][i]; ++i) {
      p->tiles[3 * t] = e;
      p->tiles[3 * t + 1] = row;
      p->tiles[3 * t + 2] = sizes[e][i];
      for (int r = 0; r < sizes[e][i]; ++r) p->row_expert[row + r] = e;
      row += sizes[e][i];
      p->real_rows += sizes[e][i];
      ++t;
    }
    for (int r = 0; r < gap[e]; ++r) {
      if (first_gap < 0) first_gap = row;
      p->row_expert[row++] = -1;
    }
  }
  for (; t < p->max_tiles; ++t) {
    p->tiles[3 * t] = E - 1;
    p->tiles[3 * t + 1] = first_gap >= 0 ? first_gap : 0;
    p->tiles[3 * t + 2] = 1;
  }
}

/* A plan-like tile list from per-expert row counts: tiles of 64 rows and
 * the remainder last, gap[e] unowned rows after expert e, extra dead
 * entries past num_tiles (pointing at a gap row when there is one). */
static void problem_counts(problem *p, int E, const int *count, const int *gap, int extra) {
  memset(p, 0, sizeof *p);
  p->E = E;
  int nt = 0, R = 0;
  for (int e = 0; e < E; ++e) {
    nt += (count[e] + 63) / 64;
    R += count[e] + gap[e];
  }
  p->R = R;
  p->num_tiles = nt;
  p->max_tiles = nt + extra;
  p->tiles = calloc((size_t)3 * (p->max_tiles ? p->max_tiles : 1), sizeof(int32_t));
  p->row_expert = malloc((size_t)(R ? R : 1) * sizeof(int));
  int t = 0, row = 0, first_gap = -1;
  for (int e = 0; e < E; ++e) {
    for (int done = 0; done < count[e]; done += 64) {
      int rows = count[e] - done < 64 ? count[e] - done : 64;
      p->tiles[3 * t] = e;
      p->tiles[3 * t + 1] = row;
      p->tiles[3 * t + 2] = rows;
      for (int r = 0; r < rows; ++r) p->row_expert[row + r] = e;
      row += rows;
      p->real_rows += rows;
      ++t;
    }
    for (int r = 0; r < gap[e]; ++r) {
      if (first_gap < 0) first_gap = row;
      p->row_expert[row++] = -1;
    }
  }
  for (; t < p->max_tiles; ++t) {
    p->tiles[3 * t] = E - 1;
    p->tiles[3 * t + 1] = first_gap >= 0 ? first_gap : 0;
    p->tiles[3 * t + 2] = 1;
  }
}

static void problem_dense(problem *p, int rows) {
  memset(p, 0, sizeof *p);
  p->E = 1;
  p->R = rows;
  p->real_rows = rows;
  p->row_expert = malloc((size_t)(rows ? rows : 1) * sizeof(int));
  for (int r = 0; r < rows; ++r) p->row_expert[r] = 0;
}

static void problem_free(problem *p) {
  free(p->tiles);
  free(p->row_expert);
}

/* ---- output checks --------------------------------------------------------- */

/* Compares a device output [R + GUARD_ROWS, n] (elements of esize bytes)
 * with ref [R, n]: rows owned by a tile against ref, every other byte 0xFF. */
static void check_output(const char *what, const problem *p, int n, const void *host_out,
                         moelink_dtype_t dt, int out_f32, const double *ref) {
  size_t esize = out_f32 ? 4 : 2;
  double err2 = 0, ref2 = 0, maxabs = 0;
  long bad_poison = 0, nonfinite = 0;
  const unsigned char *bytes = host_out;
  for (int r = 0; r < p->R + GUARD_ROWS; ++r) {
    int owned = r < p->R && p->row_expert[r] >= 0;
    for (int j = 0; j < n; ++j) {
      size_t i = (size_t)r * n + j;
      if (!owned) {
        for (size_t b = 0; b < esize; ++b) bad_poison += bytes[i * esize + b] != 0xFF;
        continue;
      }
      double got;
      if (out_f32) {
        float f;
        memcpy(&f, bytes + i * 4, 4);
        got = f;
      } else {
        uint16_t h;
        memcpy(&h, bytes + i * 2, 2);
        got = dec(dt, h);
      }
      if (!isfinite(got)) {
        ++nonfinite;
        continue;
      }
      double d = got - ref[i];
      err2 += d * d;
      ref2 += ref[i] * ref[i];
      if (fabs(d) > maxabs) maxabs = fabs(d);
    }
  }
  double rel = ref2 > 0 ? sqrt(err2 / ref2) : sqrt(err2);
  ml_t_diag("%s: rel L2 %.3e, max |err| %.3e, %ld non-finite, %ld poison bytes changed", what,
            rel, maxabs, nonfinite, bad_poison);
  CHECK(nonfinite == 0 && rel <= TOL, "%s: every owned element finite, rel L2 %.2e <= %.0e",
        what, rel, TOL);
  CHECK(bad_poison == 0, "%s: rows no tile owns stay poisoned (%ld bytes changed)", what,
        bad_poison);
}

/* ---- one case: both GEMMs on one problem ------------------------------------ */

typedef struct gemm_case {
  const char *name;
  moelink_dtype_t dt;
  int n, k;        /* swiglu: out [R, n], B [E, 2n, k]; scaled: out [R, k], B [E, k, n] */
  int lda_pad;     /* extra elements per row of both A operands */
  int top_k;       /* a_div; 0: no gather */
  int scale_mode;  /* 0: no row_scale, 1: row_scale[r], 2: row_scale[scale_index[r]] */
  int graph;       /* replay the swiglu GEMM from a captured graph too */
  int wait;        /* run both GEMMs again with rows that land while they run */
} gemm_case;

/* Set when the device runs the sm_90a kernel (compute capability 9.0). */
static int have_sm90;

/* The engine a launch must have used when `engine` was pinned: the sm_90a
 * kernel takes k >= 64 with at least one full column block of B rows (128
 * gate/up pairs for SwiGLU, 256 columns for the scaled GEMM). */
static int expected_engine(int engine, int swiglu, int n_out, int k) {
  if (engine != ML_GEMM_ENGINE_SM90 || !have_sm90) return ML_GEMM_ENGINE_TILE;
  int ok = k >= 64 && n_out >= (swiglu ? 128 : 256);
  return ok ? ML_GEMM_ENGINE_SM90 : ML_GEMM_ENGINE_TILE;
}

static const char *engine_name(int e) {
  return e == ML_GEMM_ENGINE_SM90 ? "sm90" : e == ML_GEMM_ENGINE_TILE ? "tile" : "none";
}

static void run_case_engine(const gemm_case *c, const problem *p, int engine, const void *d_x,
                            const void *d_w1, const void *d_w2, const void *d_h,
                            const int32_t *d_index, const int32_t *h_index, const float *d_scale,
                            const int32_t *d_tiles, const int32_t *d_num, const double *ref1,
                            const double *ref2);

static void run_case(const gemm_case *c, const problem *p) {
  moelink_dtype_t dt = c->dt;
  int n = c->n, k = c->k, R = p->R, E = p->E;
  int lda1 = k + c->lda_pad, lda2 = n + c->lda_pad;
  int tokens = c->top_k ? (p->real_rows + c->top_k - 1) / c->top_k : R;
  int xrows = c->top_k ? tokens : R;

  /* x [xrows, lda1]; padding NaN (0xFFFF) */
  double *x = malloc((size_t)xrows * k * sizeof(double) + 8);
  uint16_t *xh = malloc((size_t)xrows * lda1 * 2 + 16);
  for (int r = 0; r < xrows; ++r)
    for (int i = 0; i < lda1; ++i) {
      if (i < k) {
        double v = rng_value(1.0);
        x[(size_t)r * k + i] = v;
        xh[(size_t)r * lda1 + i] = enc(dt, v);
      } else {
        xh[(size_t)r * lda1 + i] = 0xFFFF;
      }
    }
  /* a_index: a permutation of the real rows' (token, slot) pairs */
  int32_t *a_index = malloc((size_t)(R ? R : 1) * sizeof(int32_t));
  int32_t *perm = malloc((size_t)(p->real_rows ? p->real_rows : 1) * sizeof(int32_t));
  for (int i = 0; i < p->real_rows; ++i) perm[i] = i;
  for (int i = p->real_rows - 1; i > 0; --i) {
    int j = (int)(rng_next() % (uint32_t)(i + 1));
    int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int r = 0, q = 0; r < R; ++r)
    a_index[r] = p->row_expert[r] >= 0 ? perm[q++] : 0;
  /* w1 [E, 2n, k], w2 [E, k, n] */
  double s1 = weight_scale(k), s2 = weight_scale(n);
  size_t w1n = (size_t)E * 2 * n * k, w2n = (size_t)E * k * n;
  double *w1 = malloc(w1n * sizeof(double) + 8), *w2 = malloc(w2n * sizeof(double) + 8);
  uint16_t *w1h = malloc(w1n * 2 + 16), *w2h = malloc(w2n * 2 + 16);
  for (size_t i = 0; i < w1n; ++i) w1h[i] = enc(dt, w1[i] = rng_value(s1));
  for (size_t i = 0; i < w2n; ++i) w2h[i] = enc(dt, w2[i] = rng_value(s2));
  /* h [R, lda2]: the scaled GEMM's own input (independent of swiglu's output) */
  double *h = malloc((size_t)R * n * sizeof(double) + 8);
  uint16_t *hh = malloc((size_t)R * lda2 * 2 + 16);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < lda2; ++i) {
      int real = p->row_expert[r] >= 0 && i < n;
      double v = real ? rng_value(1.0) : 0;
      if (i < n) h[(size_t)r * n + i] = v;
      hh[(size_t)r * lda2 + i] = real ? enc(dt, v) : 0xFFFF;
    }
  int nscale = c->scale_mode == 2 ? p->real_rows : R;
  float *row_scale = malloc((size_t)(nscale ? nscale : 1) * sizeof(float));
  for (int i = 0; i < nscale; ++i) row_scale[i] = (float)((rng_next() % 1000 + 1) / 1000.0);

  /* references */
  double *ref1 = calloc((size_t)R * n + 1, sizeof(double));
  double *ref2 = calloc((size_t)R * k + 1, sizeof(double));
  for (int r = 0; r < R; ++r) {
    int e = p->row_expert[r];
    if (e < 0) continue;
    const double *xr = x + (size_t)(c->top_k ? a_index[r] / c->top_k : r) * k;
    for (int j = 0; j < n; ++j) {
      const double *g = w1 + ((size_t)e * 2 * n + j) * k, *u = g + (size_t)n * k;
      double sg = 0, su = 0;
      for (int i = 0; i < k; ++i) {
        sg += xr[i] * g[i];
        su += xr[i] * u[i];
      }
      ref1[(size_t)r * n + j] = sg / (1.0 + exp(-sg)) * su;
    }
    double sc = c->scale_mode == 0   ? 1.0
                : c->scale_mode == 1 ? row_scale[r]
                                     : row_scale[a_index[r]];
    const double *hr = h + (size_t)r * n;
    for (int j = 0; j < k; ++j) {
      const double *w = w2 + ((size_t)e * k + j) * n;
      double s = 0;
      for (int i = 0; i < n; ++i) s += hr[i] * w[i];
      ref2[(size_t)r * k + j] = sc * s;
    }
  }

  /* device buffers */
  void *d_x = dev_copy(xh, (size_t)xrows * lda1 * 2);
  void *d_w1 = dev_copy(w1h, w1n * 2), *d_w2 = dev_copy(w2h, w2n * 2);
  void *d_h = dev_copy(hh, (size_t)R * lda2 * 2);
  int32_t *d_index = dev_copy(a_index, (size_t)R * sizeof(int32_t));
  float *d_scale = dev_copy(row_scale, (size_t)nscale * sizeof(float));
  int32_t *d_tiles = NULL, *d_num = NULL;
  if (p->tiles) {
    d_tiles = dev_copy(p->tiles, (size_t)3 * p->max_tiles * sizeof(int32_t));
    d_num = dev_copy(&p->num_tiles, sizeof(int32_t));
  }
  run_case_engine(c, p, ML_GEMM_ENGINE_TILE, d_x, d_w1, d_w2, d_h, d_index, a_index, d_scale,
                  d_tiles, d_num, ref1, ref2);
  if (have_sm90)
    run_case_engine(c, p, ML_GEMM_ENGINE_SM90, d_x, d_w1, d_w2, d_h, d_index, a_index, d_scale,
                    d_tiles, d_num, ref1, ref2);
  ml_cuda_gemm_set_engine(ML_GEMM_ENGINE_AUTO);

  cudaFree(d_x);
  cudaFree(d_w1);
  cudaFree(d_w2);
  cudaFree(d_h);
  cudaFree(d_index);
  cudaFree(d_scale);
  cudaFree(d_tiles);
  cudaFree(d_num);
  free(x), free(xh), free(a_index), free(perm), free(w1), free(w2), free(w1h), free(w2h);
  free(h), free(hh), free(row_scale), free(ref1), free(ref2);
}

/* The scaled GEMM (dtype output) with its rows stored through out_rows
 * (gu_rows_table: row r to row R - 1 - r of another buffer), static and
 * dynamic schedule, against `want` (the plain run's output) by
 * gu_rows_check. */
static void check_out_rows(const gemm_case *c, const problem *p, const char *en, int want_engine,
                           const void *d_h, const void *d_w2, const int32_t *d_tiles,
                           const int32_t *d_num, const float *rs, const int32_t *si,
                           int32_t *d_sched, const unsigned char *want, cudaStream_t stream) {
  const int n = c->n, k = c->k, R = p->R, lda2 = n + c->lda_pad;
  const size_t row = (size_t)k * 2, out_bytes = (size_t)(R + GUARD_ROWS) * row;
  gu_rows t = gu_rows_make(p->row_expert, si, 1, R, row);
  char *d_out = gu_dev(out_bytes);
  unsigned char *out = malloc(out_bytes);
  for (int rep = 0; rep < 2; ++rep) {
    const ml_cuda_gemm_opts o = {
        .counter = rep ? d_sched : NULL, .cluster = 1, .out_rows = (void *const *)t.d_table};
    gu_rows_poison(&t, d_out, out_bytes, stream);
    char label[200];
    snprintf(label, sizeof label, "%s [%s] scaled into rows by pointer (%s schedule)", c->name, en,
             rep ? "dynamic" : "static");
    CHECK_OK(ml_cuda_gemm_scaled(c->dt, d_h, lda2, d_w2, k, n, d_tiles, d_num, p->max_tiles, R, rs,
                                 si, d_out, 0, &o, stream),
             label);
    CHECK(ml_cuda_gemm_last_engine() == want_engine, "%s: ran on the %s engine (%s)", label,
          engine_name(want_engine), engine_name(ml_cuda_gemm_last_engine()));
    gu_rows_verify(label, &t, p->row_expert, want, d_out, out, out_bytes, stream);
  }
  gu_rows_free(&t);
  gu_free(d_out);
  free(out);
}

/* ---- rows that land while the GEMM runs ------------------------------------ */

/* One GEMM of a case (swiglu, or the scaled one with a dtype output) whose
 * A rows (and, gathered, a_index entries) land while it runs, delivered by
 * gu_feed in chunks of 24 problem rows after a 2 ms pause, over A filled
 * with NaN and an index of zeros: the static schedule, then the dynamic one
 * in clusters of two; each must give the bits of the plain run (`want`).
 * Then a wait whose rows never come: the GEMM gives up after its 2 ms limit,
 * records why in the control block and finishes; a second launch on the
 * same control block stops at once. */
static void check_wait(const gemm_case *c, const problem *p, const char *en, int swiglu,
                       int want_engine, const void *d_a_real, size_t a_rows, size_t row_bytes,
                       const int32_t *d_index, const int32_t *h_index, const void *d_w,
                       const int32_t *d_tiles, const int32_t *d_num, const float *rs,
                       const int32_t *si, int32_t *d_sched, const unsigned char *want,
                       size_t out_bytes, cudaStream_t stream) {
  const int n = c->n, k = c->k, R = p->R;
  const int gathered = swiglu && c->top_k;
  char *d_a = gu_dev(a_rows * row_bytes);
  int32_t *d_idx = gathered ? gu_dev((size_t)R * sizeof(int32_t)) : NULL;
  void *d_out = gu_dev(out_bytes);
  unsigned char *got = malloc(out_bytes);
  gu_feed f = gu_feed_make(R, 24, 7);
  ml_cuda_gemm_wait w = {f.d_signal, f.d_value, f.rows, gu_feed_comm(&f, 10000000000ull)};
  /* the rows come from pinned host copies: a copy between two buffers of
   * the device may run as a kernel, which would need the SMs the waiting
   * GEMM holds */
  char *h_a = gu_pinned_copy(d_a_real, a_rows * row_bytes);
  int32_t *h_idx = gathered ? gu_pinned_copy(d_index, (size_t)R * sizeof(int32_t)) : NULL;
  const gu_row_copy cp = {.dst = d_a,
                          .src = h_a,
                          .row_bytes = row_bytes,
                          .dst_index = d_idx,
                          .src_index = h_idx,
                          .h_index = h_index,
                          .div = c->top_k,
                          .row_expert = p->row_expert};
  const char *gemm = swiglu ? "swiglu" : "scaled";
  char label[240];
  for (int rep = 0; rep < 4; ++rep) {
    /* 0 static, 1 dynamic in clusters, 2 no rows ever (limit 2 ms), 3 the
     * same control block again */
    const ml_cuda_gemm_opts o = {
        .counter = rep == 1 ? d_sched : NULL, .cluster = rep == 1 ? 2 : 1, .wait = &w};
    if (rep < 3) {
      gu_feed_reset(&f);
      GU_CUDA(cudaMemset(d_a, 0xFF, a_rows * row_bytes));
      if (d_idx)
        GU_CUDA(cudaMemset(d_idx, 0, (size_t)R * sizeof(int32_t)));
    }
    /* rep 2 gives up after 2 ms; rep 3 would wait 10 s but must stop at
     * once, the control block saying that a wait gave up */
    w.comm.timeout_ns = rep == 2 ? 2000000ull : 10000000000ull;
    GU_CUDA(cudaMemsetAsync(d_out, 0xFF, out_bytes, stream));
    static const char *const what[4] = {"static", "dynamic, clusters of 2", "rows never come",
                                        "after a wait gave up"};
    snprintf(label, sizeof label, "%s [%s] %s, rows arriving while it runs (%s)", c->name, en, gemm,
             what[rep]);
    const double t0 = gu_now();
    if (swiglu)
      CHECK_OK(ml_cuda_gemm_swiglu(c->dt, d_a, k + c->lda_pad, d_idx, c->top_k, d_w, n, k, d_tiles,
                                   d_num, p->max_tiles, R, d_out, &o, stream),
               label);
    else
      CHECK_OK(ml_cuda_gemm_scaled(c->dt, d_a, n + c->lda_pad, d_w, k, n, d_tiles, d_num,
                                   p->max_tiles, R, rs, si, d_out, 0, &o, stream),
               label);
    CHECK(ml_cuda_gemm_last_engine() == want_engine, "%s: ran on the %s engine (%s)", label,
          engine_name(want_engine), engine_name(ml_cuda_gemm_last_engine()));
    if (rep < 2)
      gu_feed_run(&f, R, gu_row_copy_rows, (void *)&cp, (uint32_t)(rep + 1));
    GU_CUDA(cudaStreamSynchronize(stream));
    const double dt = gu_now() - t0;
    if (rep < 2) {
      gu_feed_check(&f, label);
      gu_d2h(got, d_out, out_bytes);
      CHECK(memcmp(got, want, out_bytes) == 0, "%s: bitwise the plain run's output (%.1f ms)",
            label, dt * 1e3);
      continue;
    }
    uint64_t ctl[4];
    gu_d2h(ctl, f.d_ctl, sizeof ctl);
    const unsigned prim = (unsigned)((ctl[0] >> 32) & 0xffffu);
    CHECK((ctl[0] & MOELINK_CTL_INFO_VALID) && prim == ML_CUDA_PRIM_GEMM_ROWS && ctl[1] == 7 &&
              ctl[2] == 1 && dt < 1.0,
          "%s: the wait gave up and said so (info %#llx: primitive %u, value %llu; abort %llu; "
          "%.1f ms)",
          label, (unsigned long long)ctl[0], prim, (unsigned long long)ctl[1],
          (unsigned long long)ctl[2], dt * 1e3);
  }
  gu_feed_free(&f);
  gu_pinned_free(h_a);
  gu_pinned_free(h_idx);
  gu_free(d_a);
  gu_free(d_idx);
  gu_free(d_out);
  free(got);
}

/* The gate/up GEMM and the down GEMM on its output, overlapped
 * (ml_cuda_gemm_opts.ready; sm_90a, tile lists): against the same pair run
 * one after the other, bitwise, for both outputs; the down GEMM's rows come
 * from the SwiGLU GEMM's output, rows n apart. Runs: the default grid, the
 * gate/up GEMM on 3 CTAs (the down GEMM's CTAs start at once on the free
 * SMs and wait for the pieces), clusters of two, TMA stores off, and a
 * captured graph replayed three times; 23 runs in all. After each, the
 * ready words and both counters must be back at zero. Also: an overlapped
 * down GEMM without a work counter, or an FP8 GEMM with ready words, is
 * refused. */
static void check_overlap(const gemm_case *c, const problem *p, const char *en, const void *d_x,
                          const int32_t *ai, const void *d_w1, const void *d_w2,
                          const int32_t *d_tiles, const int32_t *d_num, const float *rs,
                          const int32_t *si, cudaStream_t stream) {
  const moelink_dtype_t dt = c->dt;
  const int n = c->n, k = c->k, R = p->R, lda1 = k + c->lda_pad;
  const size_t hb = (size_t)(R + GUARD_ROWS) * n * 2, yb = (size_t)(R + GUARD_ROWS) * k * 2;
  CHECK(ml_cuda_gemm_overlap_ok(dt, n, k, k, n), "%s [%s] overlap: both GEMMs take sm_90a", c->name,
        en);
  void *d_h = NULL, *d_y = NULL;
  CUDA_CHECK(cudaMalloc(&d_h, hb));
  CUDA_CHECK(cudaMalloc(&d_y, yb));
  unsigned char *ref_h = malloc(hb), *ref_y = malloc(yb), *got_h = malloc(hb), *got_y = malloc(yb);
  int32_t *s1 = gu_counter_new(ML_CUDA_GEMM_SCHED_INTS),
          *s2 = gu_counter_new(ML_CUDA_GEMM_SCHED_INTS);
  int32_t *ready = gu_counter_new(p->E);
  int32_t *spins = gu_counter_new(1); /* the down GEMM's waits that found work missing */
  char label[240];
  /* the reference: one after the other */
  ml_cuda_gemm_opts go = ml_cuda_gemm_opts_for(s1, R, p->E, k, 0);
  go.cluster = 1;
  ml_cuda_gemm_opts dgo = ml_cuda_gemm_opts_for(s2, R, p->E, n, 0);
  dgo.cluster = 1;
  CUDA_CHECK(cudaMemsetAsync(d_h, 0xFF, hb, stream));
  CUDA_CHECK(cudaMemsetAsync(d_y, 0xFF, yb, stream));
  CHECK_OK(ml_cuda_gemm_swiglu(dt, d_x, lda1, ai, c->top_k, d_w1, n, k, d_tiles, d_num,
                               p->max_tiles, R, d_h, &go, stream),
           "overlap reference: swiglu");
  CHECK_OK(ml_cuda_gemm_scaled(dt, d_h, n, d_w2, k, n, d_tiles, d_num, p->max_tiles, R, rs, si, d_y,
                               0, &dgo, stream),
           "overlap reference: scaled");
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpy(ref_h, d_h, hb, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(ref_y, d_y, yb, cudaMemcpyDeviceToHost));
  go.ready = dgo.ready = (uint32_t *)ready;
  dgo.ready_n = n;
  dgo.ready_words = p->E;
  dgo.ready_spins = (uint32_t *)spins;
  /* refused: the down GEMM's waits end with its counter's last CTA */
  ml_cuda_gemm_opts bad = dgo;
  bad.counter = NULL;
  CHECK_STATUS(ml_cuda_gemm_scaled(dt, d_h, n, d_w2, k, n, d_tiles, d_num, p->max_tiles, R, rs, si,
                                   d_y, 0, &bad, stream),
               MOELINK_ERR_UNSUPPORTED, "overlapped down GEMM without a work counter");
  CHECK_STATUS(ml_cuda_gemm_scaled_fp8(MOELINK_DTYPE_BF16, (const uint8_t *)d_h, (const float *)d_y,
                                       n, (const uint8_t *)d_w2, (const float *)d_y, k, n, d_tiles,
                                       d_num, p->max_tiles, R, NULL, NULL, d_y, 0, &dgo, stream),
               MOELINK_ERR_UNSUPPORTED, "FP8 GEMM with ready words");
  static const char *const run_name[5] = {"default", "gate/up on 3 CTAs", "clusters of 2",
                                          "threads' stores", "graph"};
  for (int run = 0; run < 5; ++run) {
    ml_cuda_gemm_opts g = go, d = dgo;
    if (run == 1)
      g.max_ctas = 3;
    if (run == 2)
      g.cluster = d.cluster = 2;
    ml_cuda_gemm_set_tma_store(run == 3 ? 0 : 1);
    cudaGraphExec_t exec = NULL;
    if (run == 4) {
      cudaGraph_t graph;
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      moelink_status_t a = ml_cuda_gemm_swiglu(dt, d_x, lda1, ai, c->top_k, d_w1, n, k, d_tiles,
                                               d_num, p->max_tiles, R, d_h, &g, stream);
      moelink_status_t b = ml_cuda_gemm_scaled(dt, d_h, n, d_w2, k, n, d_tiles, d_num, p->max_tiles,
                                               R, rs, si, d_y, 0, &d, stream);
      CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      CHECK(a == MOELINK_SUCCESS && b == MOELINK_SUCCESS, "%s [%s] overlap captured: %s", c->name,
            en, a || b ? moelink_last_error() : "ok");
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      CUDA_CHECK(cudaGraphDestroy(graph));
    }
    const int reps = run == 4 ? 3 : 5;
    for (int rep = 0; rep < reps; ++rep) {
      CUDA_CHECK(cudaMemsetAsync(d_h, 0xFF, hb, stream));
      CUDA_CHECK(cudaMemsetAsync(d_y, 0xFF, yb, stream));
      snprintf(label, sizeof label, "%s [%s] overlap, %s, run %d", c->name, en, run_name[run], rep);
      if (exec != NULL) {
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
      } else {
        CHECK_OK(ml_cuda_gemm_swiglu(dt, d_x, lda1, ai, c->top_k, d_w1, n, k, d_tiles, d_num,
                                     p->max_tiles, R, d_h, &g, stream),
                 label);
        CHECK_OK(ml_cuda_gemm_scaled(dt, d_h, n, d_w2, k, n, d_tiles, d_num, p->max_tiles, R, rs,
                                     si, d_y, 0, &d, stream),
                 label);
      }
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaMemcpy(got_h, d_h, hb, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(got_y, d_y, yb, cudaMemcpyDeviceToHost));
      CHECK(memcmp(got_h, ref_h, hb) == 0 && memcmp(got_y, ref_y, yb) == 0,
            "%s: both outputs bitwise the sequential pair's", label);
      gu_counter_check_zero(ready, p->E, label);
      gu_counter_check_zero(s1, ML_CUDA_GEMM_SCHED_INTS, label);
      gu_counter_check_zero(s2, ML_CUDA_GEMM_SCHED_INTS, label);
    }
    /* that the down GEMM ran beside the gate/up GEMM at all: with the
     * gate/up GEMM on 3 CTAs its CTAs start on the free SMs at once and must
     * find experts incomplete (where programmatic launches are allowed; the
     * other runs may or may not overlap, so they are only reported) */
    int32_t nspins = 0;
    gu_d2h(&nspins, spins, sizeof nspins);
    CUDA_CHECK(cudaMemset(spins, 0, sizeof(int32_t)));
    if (run == 1 && ml_cuda_pdl_allowed(stream))
      CHECK(nspins > 0,
            "%s [%s] overlap, %s: the down GEMM's warps found experts incomplete %d times in %d "
            "runs (it ran beside the gate/up GEMM)",
            c->name, en, run_name[run], (int)nspins, reps);
    else
      printf("# %s [%s] overlap, %s: the down GEMM's waits found experts incomplete %d times in "
             "%d runs%s\n",
             c->name, en, run_name[run], (int)nspins, reps,
             ml_cuda_pdl_allowed(stream) ? "" : " (no programmatic launches)");
    if (exec != NULL)
      CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  ml_cuda_gemm_set_tma_store(1);
  gu_free(ready);
  gu_free(spins);
  gu_free(s1);
  gu_free(s2);
  cudaFree(d_h);
  cudaFree(d_y);
  free(ref_h);
  free(ref_y);
  free(got_h);
  free(got_y);
}

/* Both GEMMs of one case on one engine, checked against the references. */
static void run_case_engine(const gemm_case *c, const problem *p, int engine, const void *d_x,
                            const void *d_w1, const void *d_w2, const void *d_h,
                            const int32_t *d_index, const int32_t *h_index, const float *d_scale,
                            const int32_t *d_tiles, const int32_t *d_num, const double *ref1,
                            const double *ref2) {
  moelink_dtype_t dt = c->dt;
  int n = c->n, k = c->k, R = p->R;
  int lda1 = k + c->lda_pad, lda2 = n + c->lda_pad;
  char label[200];
  const char *en = engine_name(engine);
  const int want1 = expected_engine(engine, 1, n, k), want2 = expected_engine(engine, 0, k, n);
  ml_cuda_gemm_set_engine(engine);
  ml_cuda_gemm_set_tma_store(1); /* (whatever MOELINK_GEMM_SM90_TMA_STORE says) */
  size_t out1_bytes = (size_t)(R + GUARD_ROWS) * n * 2;
  size_t out2_bytes = (size_t)(R + GUARD_ROWS) * k * 4;
  void *d_out1 = NULL, *d_out2 = NULL;
  CUDA_CHECK(cudaMalloc(&d_out1, out1_bytes));
  CUDA_CHECK(cudaMalloc(&d_out2, out2_bytes));
  unsigned char *got = malloc(out2_bytes > out1_bytes ? out2_bytes : out1_bytes);
  unsigned char *first = malloc(out2_bytes > out1_bytes ? out2_bytes : out1_bytes);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  /* The sm_90a kernel's schedules: run 0 of each GEMM the static one (no
   * options), run 1 the dynamic one (a work counter) on at most 5 CTAs
   * (ml_cuda_gemm_opts.max_ctas), run 2 and the graph the
   * dynamic one in clusters of two CTAs; all must give the same bits, and the
   * counter must be left at zero. */
  int32_t *d_sched = gu_counter_new(ML_CUDA_GEMM_SCHED_INTS);
  const ml_cuda_gemm_opts run_opts[3] = {{.cluster = 1},
                                         {.counter = d_sched, .cluster = 1, .max_ctas = 5},
                                         {.counter = d_sched, .cluster = 2}};
  static const char *const run_name[3] = {"static", "dynamic on at most 5 CTAs",
                                          "dynamic, clusters of 2"};
  const int32_t *ai = c->top_k ? d_index : NULL;
  const float *rs = c->scale_mode ? d_scale : NULL;
  const int32_t *si = c->scale_mode == 2 ? d_index : NULL;

  /* Graph capture first, in global mode, so that the launcher's first call
   * in this process (when it sets the kernel's shared-memory limit) is the
   * one being captured. */
  unsigned char *graph_out = NULL;
  if (c->graph) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    graph_out = malloc(out1_bytes);
    CUDA_CHECK(cudaMemsetAsync(d_out1, 0xFF, out1_bytes, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    moelink_status_t st = ml_cuda_gemm_swiglu(dt, d_x, lda1, ai, c->top_k, d_w1, n, k, d_tiles,
                                              d_num, p->max_tiles, R, d_out1, &run_opts[2], stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(st == MOELINK_SUCCESS, "%s [%s] swiglu captured in a CUDA graph%s%s", c->name, en,
          st ? ": " : "", st ? moelink_last_error() : "");
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaMemcpy(graph_out, d_out1, out1_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }

  /* swiglu: three runs, bitwise equal */
  int tma0 = 0;  /* run 0 sent its full tiles out with TMA stores */
  int grid0 = 0; /* and on this many CTAs (sm_90a) */
  for (int rep = 0; rep < 3; ++rep) {
    CUDA_CHECK(cudaMemsetAsync(d_out1, 0xFF, out1_bytes, stream));
    snprintf(label, sizeof label, "%s [%s] swiglu run %d (%s)", c->name, en, rep, run_name[rep]);
    CHECK_OK(ml_cuda_gemm_swiglu(dt, d_x, lda1, ai, c->top_k, d_w1, n, k, d_tiles, d_num,
                                 p->max_tiles, R, d_out1, rep ? &run_opts[rep] : NULL, stream),
             label);
    if (rep == 0) {
      CHECK(ml_cuda_gemm_last_engine() == want1, "%s [%s] swiglu ran on the %s engine (%s)",
            c->name, en, engine_name(want1), engine_name(ml_cuda_gemm_last_engine()));
      tma0 = ml_cuda_gemm_last_tma_store();
      grid0 = ml_cuda_gemm_last_sm90_grid();
    }
    if (rep == 1 && want1 == ML_GEMM_ENGINE_SM90) {
      /* max_ctas 5: the static run's grid, but no more than 5 CTAs */
      const int g = ml_cuda_gemm_last_sm90_grid(), want = grid0 < 5 ? grid0 : 5;
      CHECK(g == want, "%s [%s] swiglu on at most 5 CTAs: %d CTAs (want %d; the static run %d)",
            c->name, en, g, want, grid0);
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaMemcpy(rep ? got : first, d_out1, out1_bytes, cudaMemcpyDeviceToHost));
    if (rep > 0)
      CHECK(memcmp(first, got, out1_bytes) == 0,
            "%s [%s] swiglu: the %s schedule bitwise equal to the static one", c->name, en,
            run_name[rep]);
  }
  snprintf(label, sizeof label, "%s [%s] swiglu (%s, n %d, k %d, lda %d)", c->name, en,
           moelink_dtype_name(dt), n, k, lda1);
  check_output(label, p, n, first, dt, 0, ref1);
  if (want1 == ML_GEMM_ENGINE_SM90) {
    /* the same run with every row stored by the consumer threads: the bits
     * of the TMA stores */
    CHECK(tma0 == 1, "%s [%s] swiglu: full tiles went out by TMA stores (%d)", c->name, en, tma0);
    ml_cuda_gemm_set_tma_store(0);
    CUDA_CHECK(cudaMemsetAsync(d_out1, 0xFF, out1_bytes, stream));
    CHECK_OK(ml_cuda_gemm_swiglu(dt, d_x, lda1, ai, c->top_k, d_w1, n, k, d_tiles, d_num,
                                 p->max_tiles, R, d_out1, NULL, stream),
             "swiglu with the threads' stores");
    const int off = ml_cuda_gemm_last_tma_store();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaMemcpy(got, d_out1, out1_bytes, cudaMemcpyDeviceToHost));
    ml_cuda_gemm_set_tma_store(1);
    CHECK(off == 0 && memcmp(first, got, out1_bytes) == 0,
          "%s [%s] swiglu: the threads' stores bitwise the TMA stores", c->name, en);
  }
  if (c->wait) {
    const int xrows = c->top_k ? (p->real_rows + c->top_k - 1) / c->top_k : R;
    check_wait(c, p, en, 1, want1, d_x, (size_t)xrows, (size_t)lda1 * 2, d_index, h_index, d_w1,
               d_tiles, d_num, NULL, NULL, d_sched, first, out1_bytes, stream);
  }
  if (graph_out) {
    CHECK(memcmp(first, graph_out, out1_bytes) == 0,
          "%s [%s] swiglu: graph replay bitwise equal to a direct run", c->name, en);
    free(graph_out);
  }

  /* scaled, dtype out and fp32 out */
  for (int f32 = 0; f32 < 2; ++f32) {
    size_t bytes = (size_t)(R + GUARD_ROWS) * k * (f32 ? 4 : 2);
    for (int rep = 0; rep < 3; ++rep) {
      CUDA_CHECK(cudaMemsetAsync(d_out2, 0xFF, bytes, stream));
      snprintf(label, sizeof label, "%s [%s] scaled%s run %d (%s)", c->name, en, f32 ? " f32" : "",
               rep, run_name[rep]);
      CHECK_OK(ml_cuda_gemm_scaled(dt, d_h, lda2, d_w2, k, n, d_tiles, d_num, p->max_tiles, R, rs,
                                   si, d_out2, f32, rep ? &run_opts[rep] : NULL, stream),
               label);
      if (rep == 0) {
        CHECK(ml_cuda_gemm_last_engine() == want2, "%s [%s] scaled%s ran on the %s engine (%s)",
              c->name, en, f32 ? " f32" : "", engine_name(want2),
              engine_name(ml_cuda_gemm_last_engine()));
        tma0 = ml_cuda_gemm_last_tma_store();
      }
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaMemcpy(rep ? got : first, d_out2, bytes, cudaMemcpyDeviceToHost));
      if (rep > 0)
        CHECK(memcmp(first, got, bytes) == 0,
              "%s [%s] scaled%s: the %s schedule bitwise equal to the static one", c->name, en,
              f32 ? " f32" : "", run_name[rep]);
    }
    snprintf(label, sizeof label, "%s [%s] scaled (%s%s, n %d, k %d, lda %d, scale %d)",
             c->name, en, moelink_dtype_name(dt), f32 ? " -> f32" : "", k, n, lda2,
             c->scale_mode);
    check_output(label, p, k, first, dt, f32, ref2);
    if (want2 == ML_GEMM_ENGINE_SM90) {
      /* fp32 outputs never take TMA stores; 16-bit ones do, and the
       * threads' stores give the same bits */
      CHECK(tma0 == !f32, "%s [%s] scaled%s: TMA stores %s (%d)", c->name, en, f32 ? " f32" : "",
            f32 ? "not used" : "used", tma0);
      ml_cuda_gemm_set_tma_store(0);
      CUDA_CHECK(cudaMemsetAsync(d_out2, 0xFF, bytes, stream));
      CHECK_OK(ml_cuda_gemm_scaled(dt, d_h, lda2, d_w2, k, n, d_tiles, d_num, p->max_tiles, R, rs,
                                   si, d_out2, f32, NULL, stream),
               "scaled with the threads' stores");
      const int off = ml_cuda_gemm_last_tma_store();
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaMemcpy(got, d_out2, bytes, cudaMemcpyDeviceToHost));
      ml_cuda_gemm_set_tma_store(1);
      CHECK(off == 0 && memcmp(first, got, bytes) == 0,
            "%s [%s] scaled%s: the threads' stores bitwise the default run", c->name, en,
            f32 ? " f32" : "");
    }
    if (!f32 && c->wait)
      check_wait(c, p, en, 0, want2, d_h, (size_t)R, (size_t)lda2 * 2, NULL, NULL, d_w2, d_tiles,
                 d_num, rs, si, d_sched, first, bytes, stream);
    if (!f32 && k % 8 == 0)
      check_out_rows(c, p, en, want2, d_h, d_w2, d_tiles, d_num, rs, si, d_sched, first, stream);
  }
  if (want1 == ML_GEMM_ENGINE_SM90 && want2 == ML_GEMM_ENGINE_SM90 && d_tiles != NULL)
    check_overlap(c, p, en, d_x, ai, d_w1, d_w2, d_tiles, d_num, rs, si, stream);
  snprintf(label, sizeof label, "%s [%s]", c->name, en);
  gu_counter_check_zero(d_sched, ML_CUDA_GEMM_SCHED_INTS, label);
  gu_free(d_sched);
  ml_cuda_gemm_set_tma_store(-1);

  CUDA_CHECK(cudaStreamDestroy(stream));
  cudaFree(d_out1);
  cudaFree(d_out2);
  free(got);
  free(first);
}

/* ---- argument checks (no launch) ------------------------------------------ */

static void check_rejections(void) {
  void *d = NULL;
  CUDA_CHECK(cudaMalloc(&d, 1 << 16));
  char *b = d;
  int32_t *num = (int32_t *)(b + 60000);
  moelink_dtype_t bf = MOELINK_DTYPE_BF16;
  CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b, 16, NULL, 1, b, 12, 16, NULL, NULL, 0, 4, b, NULL, 0),
               MOELINK_ERR_UNSUPPORTED, "swiglu n 12");
  CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b, 24, NULL, 1, b, 16, 20, NULL, NULL, 0, 4, b, NULL, 0),
               MOELINK_ERR_UNSUPPORTED, "swiglu k 20");
  CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b, 20, NULL, 1, b, 16, 16, NULL, NULL, 0, 4, b, NULL, 0),
               MOELINK_ERR_UNSUPPORTED, "swiglu lda 20");
  CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b + 8, 16, NULL, 1, b, 16, 16, NULL, NULL, 0, 4, b, NULL, 0),
               MOELINK_ERR_UNSUPPORTED, "swiglu a 8 bytes off 16-byte alignment");
  CHECK_STATUS(ml_cuda_gemm_swiglu(MOELINK_DTYPE_F32, b, 16, NULL, 1, b, 16, 16, NULL, NULL, 0, 4,
                                   b, NULL, 0),
               MOELINK_ERR_UNSUPPORTED, "swiglu f32");
  CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b, 8, NULL, 1, b, 16, 16, NULL, NULL, 0, 4, b, NULL, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "swiglu lda < k");
  CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b, 16, (const int32_t *)b, 0, b, 16, 16, NULL, NULL, 0, 4, b,
                                   NULL, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "swiglu a_div 0");
  CHECK_STATUS(
      ml_cuda_gemm_scaled(bf, b, 16, b, 36, 16, NULL, NULL, 0, 4, NULL, NULL, b, 0, NULL, 0),
      MOELINK_ERR_UNSUPPORTED, "scaled n 36");
  CHECK_STATUS(
      ml_cuda_gemm_scaled(bf, b, 16, b + 4, 16, 16, NULL, NULL, 0, 4, NULL, NULL, b, 1, NULL, 0),
      MOELINK_ERR_UNSUPPORTED, "scaled b misaligned");
  CHECK_STATUS(
      ml_cuda_gemm_scaled(bf, b, 16, b, 16, 16, NULL, NULL, 0, 4, NULL, NULL, b + 2, 0, NULL, 0),
      MOELINK_ERR_UNSUPPORTED, "scaled out misaligned");
  CHECK_STATUS(ml_cuda_gemm_scaled(bf, b, 16, b, 16, 16, (const int32_t *)b, NULL, 4, 4, NULL, NULL,
                                   b, 0, NULL, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "scaled tiles without num_tiles");
  {
    /* output rows by pointer: the scaled GEMMs with a dtype output only */
    const ml_cuda_gemm_opts ro = {.cluster = 1, .out_rows = (void *const *)(b + 40000)};
    CHECK_STATUS(
        ml_cuda_gemm_scaled(bf, b, 16, b, 16, 16, NULL, NULL, 0, 4, NULL, NULL, b, 1, &ro, 0),
        MOELINK_ERR_UNSUPPORTED, "scaled f32 out with out_rows");
    CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b, 16, NULL, 1, b, 16, 16, NULL, NULL, 0, 4, b, &ro, 0),
                 MOELINK_ERR_INVALID_ARGUMENT, "swiglu with out_rows");
  }
  {
    /* row waits: signals, a value word, rows >= 1 and a filled-in device
     * communicator, or INVALID_ARGUMENT before anything runs */
    uint64_t *sig = (uint64_t *)(b + 48000);
    moelink_device_comm_t dc;
    memset(&dc, 0, sizeof dc);
    dc.nranks = 1;
    dc.timeout_ns = 1000000;
    dc.ctl[0] = sig + 8;
    const ml_cuda_gemm_wait bad_rows = {sig, sig + 4, 0, dc};
    const ml_cuda_gemm_wait bad_value = {sig, NULL, 16, dc};
    ml_cuda_gemm_wait bad_comm = {sig, sig + 4, 16, dc};
    bad_comm.comm.ctl[0] = NULL;
    const ml_cuda_gemm_wait *bad[3] = {&bad_rows, &bad_value, &bad_comm};
    static const char *const why[3] = {"rows 0", "no value word", "no control block"};
    for (int i = 0; i < 3; ++i) {
      const ml_cuda_gemm_opts wo = {.cluster = 1, .wait = bad[i]};
      char what[80];
      snprintf(what, sizeof what, "swiglu with a row wait of %s", why[i]);
      CHECK_STATUS(ml_cuda_gemm_swiglu(bf, b, 16, NULL, 1, b, 16, 16, NULL, NULL, 0, 4, b, &wo, 0),
                   MOELINK_ERR_INVALID_ARGUMENT, what);
      snprintf(what, sizeof what, "scaled with a row wait of %s", why[i]);
      CHECK_STATUS(
          ml_cuda_gemm_scaled(bf, b, 16, b, 16, 16, NULL, NULL, 0, 4, NULL, NULL, b, 0, &wo, 0),
          MOELINK_ERR_INVALID_ARGUMENT, what);
    }
  }
  /* nothing to do: succeeds without touching out */
  CUDA_CHECK(cudaMemset(b, 0xFF, 4096));
  CUDA_CHECK(cudaMemset(num, 0, sizeof(int32_t)));
  CHECK_OK(ml_cuda_gemm_swiglu(bf, b, 16, NULL, 1, b, 16, 16, (const int32_t *)(b + 50000), num, 0,
                               0, b, NULL, 0),
           "swiglu with max_tiles 0");
  CHECK_OK(ml_cuda_gemm_scaled(bf, b, 16, b, 16, 16, NULL, NULL, 0, 0, NULL, NULL, b, 0, NULL, 0),
           "scaled with dense_rows 0");
  CUDA_CHECK(cudaDeviceSynchronize());
  unsigned char host[4096];
  CUDA_CHECK(cudaMemcpy(host, b, sizeof host, cudaMemcpyDeviceToHost));
  int untouched = 1;
  for (size_t i = 0; i < sizeof host; ++i) untouched &= host[i] == 0xFF;
  CHECK(untouched, "empty problems write nothing");
  cudaFree(d);
}

int main(void) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("# no CUDA device\n");
    CHECK(0, "a CUDA device is present");
    return ml_test_done();
  }
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  have_sm90 = major == 9 && minor == 0;
  printf("# compute capability %d.%d: %s\n", major, minor,
         have_sm90 ? "tile engine and sm_90a kernel" : "tile engine only");
  check_rejections();

  /* A plan-like tile list: experts of 1, 7, 0, 64, 13 + 64, 64 + 64 + 2 rows;
   * gaps of 3 and 5 rows; 3 dead entries past num_tiles. */
  static const int sizes_a[6][4] = {{1}, {7}, {0}, {64}, {13, 64}, {64, 64, 2}};
  static const int gaps_a[6] = {0, 3, 0, 0, 5, 0};
  problem pa;
  problem_make(&pa, 6, sizes_a, gaps_a, 3);
  /* Qwen3-30B-A3B-sized layer (H 2048, I 768), fewer experts. */
  static const int sizes_b[5][4] = {{64, 64, 37}, {0}, {5}, {64, 1}, {64, 64, 64, 64}};
  static const int gaps_b[5] = {3, 0, 0, 8, 0};
  problem pb;
  problem_make(&pb, 5, sizes_b, gaps_b, 2);
  problem pd;
  problem_dense(&pd, 77);

  static const gemm_case cases[] = {
      {"tiles bf16", MOELINK_DTYPE_BF16, 200, 136, 8, 2, 2, 1, 1},
      {"tiles f16", MOELINK_DTYPE_F16, 200, 136, 8, 2, 2, 1, 0},
      {"tiles bf16 n 8 k 8", MOELINK_DTYPE_BF16, 8, 8, 0, 1, 1, 0, 0},
      {"qwen3 bf16", MOELINK_DTYPE_BF16, 768, 2048, 0, 8, 2, 0, 1},
      {"qwen3 f16", MOELINK_DTYPE_F16, 768, 2048, 16, 8, 2, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i)
    run_case(&cases[i], i < 3 ? &pa : &pb);

  /* Odd shapes for the sm_90a kernel on the plan-like list: swiglu n 200
   * (a full and a partial column block), k 328 (five k steps and a partial
   * one); scaled n 328, k 200. Expert 4's tiles (13 + 64 rows) share a
   * unit although the second does not start 64 rows after the first;
   * expert 5's third tile (2 rows) is alone in its unit. */
  static const gemm_case odd[] = {
      {"odd bf16", MOELINK_DTYPE_BF16, 200, 328, 8, 2, 2, 1, 0},
      {"odd f16", MOELINK_DTYPE_F16, 200, 328, 0, 4, 1, 0, 0},
  };
  for (size_t i = 0; i < sizeof odd / sizeof odd[0]; ++i) run_case(&odd[i], &pa);

  /* Many experts (64, 0 to 420 rows each, a few gaps): a few hundred work
   * items, so every persistent CTA takes several and walks past many
   * experts between two of them; in clusters, experts with an odd number of
   * units (up to 4 units here) add split items to their pairs, and the
   * swiglu's 3 and the scaled GEMM's 3 column blocks leave the last split
   * item half absent. */
  {
    enum { ME = 64 };
    int count[ME], gap[ME];
    for (int e = 0; e < ME; ++e) {
      count[e] = (int)(rng_next() % 421u);
      gap[e] = e % 16 == 5 ? 3 : 0;
    }
    count[7] = 0;
    count[8] = 64;
    count[9] = 128;
    count[10] = 320; /* five tiles: a pair and an odd unit of one tile */
    count[11] = 384; /* three full units */
    problem pm;
    problem_counts(&pm, ME, count, gap, 4);
    static const gemm_case many = {
        "many experts bf16", MOELINK_DTYPE_BF16, 384, 640, 0, 8, 2, 0, 1};
    run_case(&many, &pm);
    problem_free(&pm);
  }

  static const gemm_case dense[] = {
      {"dense bf16", MOELINK_DTYPE_BF16, 328, 264, 0, 0, 1, 0, 1},
      {"dense f16", MOELINK_DTYPE_F16, 64, 64, 8, 0, 0, 0, 0},
  };
  for (size_t i = 0; i < sizeof dense / sizeof dense[0]; ++i) run_case(&dense[i], &pd);

  problem_free(&pa);
  problem_free(&pb);
  problem_free(&pd);
  return ml_test_done();
}
