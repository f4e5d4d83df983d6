/* The FP8 grouped GEMMs (ml_cuda_gemm_swiglu_fp8, ml_cuda_gemm_scaled_fp8)
 * against a double-precision host computation from the dequantized
 * operands: e4m3 A with an fp32 scale per 128 of a row, e4m3 B with one per
 * 128 x 128 block. Tile lists shaped like a MoE plan and beyond it: tiles of
 * 1, 7, 13 and 64 rows, an expert with no tile, rows between tiles that no
 * tile owns (also between the two tiles of one expert, so a unit's second
 * tile does not follow its first), an expert's odd last tile alone in its
 * unit, entries past *num_tiles that would overwrite unowned or guard rows
 * if they ran, a list of over a hundred tiles on nine experts (more work
 * items than SMs, so persistent CTAs take several), and the dense form.
 * Row strides wider than k (the padding holds NaN codes and NaN scales, so
 * reading it shows). Outputs are filled with 0xFF bytes (NaN in every output
 * dtype) before each run: every owned element is checked against its own
 * bound, every other byte must still be 0xFF. Each launch runs twice and must
 * be bitwise equal.
 *
 * Operands are random e4m3 codes (every finite one, so values span 2^-9 to
 * 448) and block scales of a few powers of two, some times arbitrary
 * fractions; one B block in 13 is zero, and where a row has more than one
 * k block a zero B block is always there.
 *
 * Both engines run every case: pinned to the tile engine the launchers fall
 * back to the decode kernel; pinned to SM90 on a compute capability 9.0
 * device they run the sm_90a FP8 kernel. After each launch the test checks
 * which one ran. Error paths: shapes that are not multiples of 128, NULL
 * scales, an unsupported output dtype, and launches with nothing to do. On
 * the sm_90a engine every case's swiglu GEMM also runs with its A rows,
 * scales and index entries landing while it runs (ml_cuda_gemm_opts.wait):
 * bitwise the plain run; the decode-kernel fallback refuses such a wait. */
#include "core/fp8.h"
#include "cuda/cuda.h"
#include "cuda/gemm/sm90_engine.cuh"
#include "cuda/pipeline.h"
#include "gpu_util.h"
#include "harness.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD_ROWS 3 /* poisoned rows after the last problem row */

/* Tolerances. The e4m3 MMAs (wgmma m64n128k32 and mma.sync m16n8k32) do not
 * keep fp32 while they add up a 128-wide block: published models of
 * Hopper's tensor cores align the products of a k32 step and the
 * accumulator to the largest of them and keep about 13 fraction bits,
 * truncated, before the block sum reaches fp32 (the kernels promote each
 * block's sum with its scales in fp32). A host model of that, on codes and
 * scales drawn as here (k 128 to 640, 200000 dot products a k): truncation
 * toward zero gave at most 1.0e-3 x the sum of |terms| and a relative L2 of
 * 2.4e-4; truncation toward -inf (whose bias adds up; it matches the ~2%
 * DeepSeek-V3 reports for K = 4096 without promotion better) 5.9e-3 and
 * 4.7e-3, and up to 5.9e-3 of L2 through SwiGLU in this file's cases. Exact
 * fp32 sums would give 1.3e-7 and 6e-8: the ~1e-5 of fp32 is not what the
 * hardware gives. Bounds: per element ACC_TOL times the sum of |terms|,
 * propagated through SwiGLU, plus twice the output's unit roundoff; over all
 * owned elements a relative L2 of L2_TOL (bf16 output rounding alone adds an
 * rms of ~1.6e-3). First set to cover either model (2^-6 and 1.2e-2); on an
 * H200 (commit 5c57c83, both engines) the kernels reached at most 0.162 of
 * the 2^-6 bound per element and a relative L2 of 1.69e-3 (bf16 output;
 * fp32 outputs 2-3e-4), the toward-zero model, so the bounds are now ~3x
 * the measurement. The diagnostics print both measures. A wrong block
 * scale, a misread k block, tile, gather index or row scale is off by ~1e-1
 * and more. */
#define ACC_TOL (1.0 / 128)
#define L2_TOL 5e-3
#define SILU_SLOPE 1.1 /* max |silu'(x)| = 1.0998 */

/* Relative error per element the output's rounding adds: twice the unit
 * roundoff (bf16 2^-8, f16 2^-11 for normal values); fp32 allows some ulp
 * for SwiGLU's __expf and __fdividef. */
static double out_rel(moelink_dtype_t dt, int f32) {
  if (f32) return 1.0 / 65536;
  return dt == MOELINK_DTYPE_BF16 ? 1.0 / 128 : 1.0 / 1024;
}
/* f16 subnormals (below 2^-14) are 2^-24 apart. */
static double out_abs(moelink_dtype_t dt, int f32) {
  return !f32 && dt == MOELINK_DTYPE_F16 ? ldexp(1.0, -24) : 0.0;
}
/* ---- host helpers ---------------------------------------------------------- */

static uint64_t rng_state = 0x6a09e667f3bcc909ull;
static uint32_t rng_next(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 16);
}

static double g_e4m3[256]; /* code -> value, from ml_e4m3_to_f32 */
static double g_e4m3_rms;  /* over the 254 finite codes */

static void e4m3_table(void) {
  double s2 = 0;
  for (int b = 0; b < 256; ++b) {
    g_e4m3[b] = ml_e4m3_to_f32((uint8_t)b);
    if ((b & 0x7f) != 0x7f) s2 += g_e4m3[b] * g_e4m3[b];
  }
  g_e4m3_rms = sqrt(s2 / 254.0);
}

/* Any code but the two NaNs (0x7f, 0xff). */
static uint8_t rng_e4m3(void) {
  uint8_t b;
  do b = (uint8_t)(rng_next() & 0xff);
  while ((b & 0x7f) == 0x7f);
  return b;
}

/* base x 2^[-2, 2], two times in three further times (1 + m / 1000) (not a
 * short binary fraction), and zero one time in zero_one_in (0: never). */
static float rng_scale(double base, unsigned zero_one_in) {
  if (zero_one_in && rng_next() % zero_one_in == 0) return 0.0f;
  double v = ldexp(base, (int)(rng_next() % 5) - 2);
  if (rng_next() % 3) v *= 1.0 + (rng_next() % 1000) / 1000.0;
  return (float)v;
}

/* sum over 128-wide k blocks of sa[kb] sb[kb] (a . b over the block), and the
 * same sum of |terms| in *mag. a and b hold e4m3 values: their products have
 * at most 8 significant bits and are multiples of 2^-18 below 2^18, so each
 * block's sum is exact in double whatever the order (two accumulators). */
static double fp8_dot(const double *a, const float *sa, const double *b, const float *sb, int k,
                      double *mag) {
  double s = 0, m = 0;
  for (int kb = 0; kb < k / 128; ++kb) {
    const double *x = a + kb * 128, *y = b + kb * 128;
    double d0 = 0, d1 = 0, m0 = 0, m1 = 0;
    for (int i = 0; i < 128; i += 2) {
      const double p0 = x[i] * y[i], p1 = x[i + 1] * y[i + 1];
      d0 += p0;
      d1 += p1;
      m0 += fabs(p0);
      m1 += fabs(p1);
    }
    const double sc = (double)sa[kb] * (double)sb[kb];
    s += sc * (d0 + d1);
    m += fabs(sc) * (m0 + m1);
  }
  *mag = m;
  return s;
}

#define CUDA_CHECK(call)                                                       \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      printf("# %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 16);
  if (p == NULL) {
    printf("# out of host memory (%zu bytes)\n", bytes);
    exit(2);
  }
  return p;
}

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

/* One tile of a list: its expert, its rows, and the unowned rows after it. */
typedef struct tspec {
  int expert, rows, gap;
} tspec;

/* Builds the list in order, then `dead` entries past num_tiles (of expert
 * E - 1 and E / 2 in turn): the first names the first unowned row (1 row),
 * the others the guard rows after the problem. Running any of them would
 * change a poisoned byte. */
static void problem_build(problem *p, int E, const tspec *t, int nt, int dead) {
  memset(p, 0, sizeof *p);
  p->E = E;
  int R = 0;
  for (int i = 0; i < nt; ++i) R += t[i].rows + t[i].gap;
  p->R = R;
  p->num_tiles = nt;
  p->max_tiles = nt + dead;
  p->tiles = calloc((size_t)3 * (size_t)(p->max_tiles ? p->max_tiles : 1), sizeof(int32_t));
  p->row_expert = xmalloc((size_t)R * sizeof(int));
  int row = 0, first_gap = -1;
  for (int i = 0; i < nt; ++i) {
    p->tiles[3 * i] = t[i].expert;
    p->tiles[3 * i + 1] = row;
    p->tiles[3 * i + 2] = t[i].rows;
    for (int r = 0; r < t[i].rows; ++r) p->row_expert[row++] = t[i].expert;
    p->real_rows += t[i].rows;
    for (int r = 0; r < t[i].gap; ++r) {
      if (first_gap < 0) first_gap = row;
      p->row_expert[row++] = -1;
    }
  }
  for (int i = nt; i < p->max_tiles; ++i) {
    const int first = i == nt && first_gap >= 0;
    p->tiles[3 * i] = (i - nt) % 2 ? E / 2 : E - 1;
    p->tiles[3 * i + 1] = first ? first_gap : R;
    p->tiles[3 * i + 2] = first ? 1 : GUARD_ROWS;
  }
}

static void problem_dense(problem *p, int rows) {
  memset(p, 0, sizeof *p);
  p->E = 1;
  p->R = rows;
  p->real_rows = rows;
  p->row_expert = xmalloc((size_t)rows * sizeof(int));
  for (int r = 0; r < rows; ++r) p->row_expert[r] = 0;
}

static void problem_free(problem *p) {
  free(p->tiles);
  free(p->row_expert);
}

/* ---- output checks --------------------------------------------------------- */

static double dec_half(moelink_dtype_t dt, uint16_t h) {
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

/* A device output [R + GUARD_ROWS, n] (dtype dt, or fp32) against ref and
 * tol [R, n]: owned rows element by element and by relative L2, every other
 * byte still 0xFF. */
static void check_output(const char *what, const problem *p, int n, const void *host_out,
                         moelink_dtype_t dt, int f32, const double *ref, const double *tol) {
  const size_t esize = f32 ? 4 : 2;
  const double l2_tol = L2_TOL;
  double err2 = 0, ref2 = 0, worst = 0;
  long bad_poison = 0, nonfinite = 0, off = 0, owned_n = 0, nonzero = 0;
  size_t first_off = 0, worst_at = 0;
  double first_got = 0;
  const unsigned char *bytes = host_out;
  for (int r = 0; r < p->R + GUARD_ROWS; ++r) {
    const int owned = r < p->R && p->row_expert[r] >= 0;
    for (int j = 0; j < n; ++j) {
      const size_t i = (size_t)r * n + j;
      if (!owned) {
        for (size_t b = 0; b < esize; ++b) bad_poison += bytes[i * esize + b] != 0xFF;
        continue;
      }
      double got;
      if (f32) {
        float f;
        memcpy(&f, bytes + i * 4, 4);
        got = f;
      } else {
        uint16_t h;
        memcpy(&h, bytes + i * 2, 2);
        got = dec_half(dt, h);
      }
      if (!isfinite(got)) {
        if (nonfinite++ == 0 && off == 0) first_off = i, first_got = got;
        continue;
      }
      ++owned_n;
      nonzero += ref[i] != 0.0;
      const double d = fabs(got - ref[i]);
      err2 += d * d;
      ref2 += ref[i] * ref[i];
      if (d > tol[i]) {
        if (off++ == 0 && nonfinite == 0) first_off = i, first_got = got;
      }
      const double q = tol[i] > 0 ? d / tol[i] : (d > 0 ? INFINITY : 0);
      if (q > worst) worst = q, worst_at = i;
    }
  }
  const double rel = ref2 > 0 ? sqrt(err2 / ref2) : sqrt(err2);
  ml_t_diag("%s: rel L2 %.3e (bound %.1e), worst |err| / bound %.3f at row %zu col %zu; %ld of "
            "%ld references nonzero",
            what, rel, l2_tol, worst, worst_at / (size_t)n, worst_at % (size_t)n, nonzero,
            owned_n);
  CHECK(nonfinite == 0 && off == 0 && rel <= l2_tol,
        "%s: every owned element finite and in bounds (%ld non-finite, %ld off), rel L2 %.2e <= "
        "%.1e",
        what, nonfinite, off, rel, l2_tol);
  if (nonfinite || off)
    ml_t_diag("  first off: row %zu col %zu: got %.9g want %.9g (bound %.3g)",
              first_off / (size_t)n, first_off % (size_t)n, first_got, ref[first_off],
              tol[first_off]);
  CHECK(bad_poison == 0, "%s: rows no tile owns stay poisoned (%ld bytes changed)", what,
        bad_poison);
  /* the draw itself: zero B blocks must not leave (almost) nothing to compare */
  CHECK(2 * nonzero >= owned_n, "%s: most references nonzero (%ld of %ld)", what, nonzero,
        owned_n);
}

/* ---- one case: both GEMMs on one problem ------------------------------------ */

typedef struct fcase {
  const char *name;
  moelink_dtype_t dt; /* the scaled GEMM's output dtype (also run with fp32 out) */
  int n, k;           /* swiglu: out [R, n], B [E, 2n, k]; scaled: out [R, k], B [E, k, n] */
  int lda_pad;        /* 0 or 128: extra codes per A row (NaN codes, NaN scales) */
  int top_k;          /* swiglu a_div; 0: no gather */
  int scale_mode;     /* 0: no row_scale, 1: row_scale[r], 2: row_scale[scale_index[r]] */
} fcase;

/* Device operands of a case. */
typedef struct dev_ops {
  const uint8_t *x, *w1, *h, *w2;
  const float *xs, *w1s, *hs, *w2s;
  const int32_t *index, *tiles, *num;
  const float *row_scale;
  const int32_t *h_index; /* index on the host */
  int xrows;              /* rows of x */
} dev_ops;

/* Set when the device runs the sm_90a kernel (compute capability 9.0). */
static int have_sm90;

/* The engine a launch must have used when `engine` was pinned: the sm_90a
 * FP8 kernel needs one full column block of B rows (64 gate/up pairs for
 * SwiGLU, 128 columns for the scaled GEMM), which every valid FP8 shape has
 * but the scaled GEMM's n of 64 (rejected either way). */
static int expected_engine(int engine, int swiglu, int n_out) {
  if (engine != ML_GEMM_ENGINE_SM90 || !have_sm90) return ML_GEMM_ENGINE_TILE;
  return n_out >= (swiglu ? 64 : 128) ? ML_GEMM_ENGINE_SM90 : ML_GEMM_ENGINE_TILE;
}

static const char *engine_name(int e) {
  return e == ML_GEMM_ENGINE_SM90 ? "sm90" : e == ML_GEMM_ENGINE_TILE ? "tile" : "none";
}

/* Runs of each GEMM in run_case_engine: schedules, clusters, tiles. */
#define RUNS 5

/* A run on the sm_90a engine with an FP8 tile asked for (o->fp8_tile) ran
 * that tile: 256 columns, or 128 where the GEMM has fewer output columns
 * than that (the scaled GEMM's n_out; SwiGLU: 0, its n is a multiple of
 * 128 gate/up pairs, always enough). */
static void check_tile(const char *what, const ml_cuda_gemm_opts *o, int engine, int n_out) {
  if (o == NULL || o->fp8_tile == 0 || engine != ML_GEMM_ENGINE_SM90)
    return;
  const int want = o->fp8_tile == 256 && n_out < 256 && n_out > 0 ? 128 : o->fp8_tile;
  CHECK(ml_cuda_gemm_last_sm90_tile() == want, "%s: the %d-column tile ran (%d)", what, want,
        ml_cuda_gemm_last_sm90_tile());
}

/* ---- rows that land while the GEMM runs ------------------------------------ */

/* The FP8 swiglu GEMM (fp32 out, sm_90a engine) with its A rows, their
 * scales and (gathered) index entries landing while it runs (ml_cuda_gemm_
 * opts.wait; gu_feed, chunks of 24 rows after a 2 ms pause, over NaN codes,
 * NaN scales and an index of zeros), static schedule and dynamic: bitwise
 * the plain run's output (want). */
static void check_wait(const fcase *c, const problem *p, const char *en, const dev_ops *d,
                       int32_t *d_sched, const unsigned char *want, size_t out_bytes,
                       cudaStream_t stream) {
  const int n = c->n, k = c->k, R = p->R, lda = k + c->lda_pad, ls = lda / 128;
  uint8_t *x = gu_dev((size_t)d->xrows * lda);
  float *xs = gu_dev((size_t)d->xrows * ls * sizeof(float));
  int32_t *index = c->top_k ? gu_dev((size_t)R * sizeof(int32_t)) : NULL;
  void *out = gu_dev(out_bytes);
  unsigned char *got = xmalloc(out_bytes);
  gu_feed f = gu_feed_make(R, 24, 7);
  const ml_cuda_gemm_wait w = {f.d_signal, f.d_value, f.rows, gu_feed_comm(&f, 10000000000ull)};
  uint8_t *hx = gu_pinned_copy(d->x, (size_t)d->xrows * lda);
  float *hxs = gu_pinned_copy(d->xs, (size_t)d->xrows * ls * sizeof(float));
  int32_t *hindex = index ? gu_pinned_copy(d->index, (size_t)R * sizeof(int32_t)) : NULL;
  const gu_row_copy cp = {.dst = (char *)x,
                          .src = (const char *)hx,
                          .row_bytes = (size_t)lda,
                          .dst2 = (char *)xs,
                          .src2 = (const char *)hxs,
                          .row2_bytes = (size_t)ls * sizeof(float),
                          .dst_index = index,
                          .src_index = hindex,
                          .h_index = d->h_index,
                          .div = c->top_k,
                          .row_expert = p->row_expert};
  for (int rep = 0; rep < 2; ++rep) {
    const ml_cuda_gemm_opts o = {.counter = rep ? d_sched : NULL, .cluster = 1, .wait = &w};
    gu_feed_reset(&f);
    GU_CUDA(cudaMemset(x, 0x7f, (size_t)d->xrows * lda));
    GU_CUDA(cudaMemset(xs, 0xFF, (size_t)d->xrows * ls * sizeof(float)));
    if (index)
      GU_CUDA(cudaMemset(index, 0, (size_t)R * sizeof(int32_t)));
    GU_CUDA(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
    char label[240];
    snprintf(label, sizeof label, "%s [%s] swiglu, rows arriving while it runs (%s)", c->name, en,
             rep ? "dynamic" : "static");
    CHECK_OK(ml_cuda_gemm_swiglu_fp8(x, xs, lda, index, c->top_k, d->w1, d->w1s, n, k, d->tiles,
                                     d->num, p->max_tiles, R, (float *)out, NULL, &o, stream),
             label);
    CHECK(ml_cuda_gemm_last_engine() == ML_GEMM_ENGINE_SM90, "%s: ran on the sm90 engine (%s)",
          label, engine_name(ml_cuda_gemm_last_engine()));
    gu_feed_run(&f, R, gu_row_copy_rows, (void *)&cp, (uint32_t)(rep + 11));
    GU_CUDA(cudaStreamSynchronize(stream));
    gu_feed_check(&f, label);
    gu_d2h(got, out, out_bytes);
    CHECK(memcmp(got, want, out_bytes) == 0, "%s: bitwise the plain run's output", label);
  }
  gu_feed_free(&f);
  gu_pinned_free(hx);
  gu_pinned_free(hxs);
  gu_pinned_free(hindex);
  gu_free(x);
  gu_free(xs);
  gu_free(index);
  gu_free(out);
  free(got);
}

/* Both GEMMs of one case on one engine, checked against the references. */
static void run_case_engine(const fcase *c, const problem *p, int engine, const dev_ops *d,
                            const double *ref1, const double *tol1, const double *ref2,
                            const double *tol2, const double *tol2_f32) {
  const int n = c->n, k = c->k, R = p->R;
  const int lda1 = k + c->lda_pad, lda2 = n + c->lda_pad;
  char label[240];
  const char *en = engine_name(engine);
  const int want1 = expected_engine(engine, 1, n), want2 = expected_engine(engine, 0, k);
  ml_cuda_gemm_set_engine(engine);
  const size_t out1_bytes = (size_t)(R + GUARD_ROWS) * n * 4;
  const size_t out2_bytes = (size_t)(R + GUARD_ROWS) * k * 4;
  const size_t most = out1_bytes > out2_bytes ? out1_bytes : out2_bytes;
  void *d_out = NULL;
  CUDA_CHECK(cudaMalloc(&d_out, most));
  unsigned char *got = xmalloc(most), *first = xmalloc(most);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  /* run 0 of each GEMM on the static schedule (default tile), run 1 on the
   * dynamic one (a work counter), run 2 on the dynamic one in clusters of
   * two CTAs (where the device runs them; the 128-column tile; the
   * quantizing epilogue runs one CTA regardless), runs 3 and 4 with the
   * 128- and the 256-column tile (run 3 on at most 6 CTAs:
   * ml_cuda_gemm_opts.max_ctas): the same bits, and the counter left at
   * zero */
  int32_t *d_sched = gu_counter_new(ML_CUDA_GEMM_SCHED_INTS);
  const ml_cuda_gemm_opts run_opts[RUNS] = {
      {.cluster = 1},
      {.counter = d_sched, .cluster = 1},
      {.counter = d_sched, .cluster = 2},
      {.counter = d_sched, .cluster = 1, .fp8_tile = 128, .max_ctas = 6},
      {.counter = d_sched, .cluster = 1, .fp8_tile = 256}};
  static const char *const run_name[RUNS] = {"static", "dynamic", "dynamic, clusters of 2",
                                             "dynamic, 128-column tile, at most 6 CTAs",
                                             "dynamic, 256-column tile"};
  const ml_cuda_gemm_opts dyn = run_opts[2];
  const int32_t *ai = c->top_k ? d->index : NULL;
  const float *rs = c->scale_mode ? d->row_scale : NULL;
  const int32_t *si = c->scale_mode == 2 ? d->index : NULL;

  /* swiglu (fp32 out): RUNS runs, bitwise equal */
  for (int rep = 0; rep < RUNS; ++rep) {
    CUDA_CHECK(cudaMemsetAsync(d_out, 0xFF, out1_bytes, stream));
    snprintf(label, sizeof label, "%s [%s] swiglu run %d", c->name, en, rep);
    CHECK_OK(ml_cuda_gemm_swiglu_fp8(d->x, d->xs, lda1, ai, c->top_k, d->w1, d->w1s, n, k, d->tiles,
                                     d->num, p->max_tiles, R, (float *)d_out, NULL,
                                     rep ? &run_opts[rep] : NULL, stream),
             label);
    CHECK(ml_cuda_gemm_last_engine() == want1, "%s [%s] swiglu run %d on the %s engine (%s)",
          c->name, en, rep, engine_name(want1), engine_name(ml_cuda_gemm_last_engine()));
    check_tile(label, rep ? &run_opts[rep] : NULL, want1, 0);
    if (want1 == ML_GEMM_ENGINE_SM90 && run_opts[rep].max_ctas > 0) {
      const int g = ml_cuda_gemm_last_sm90_grid();
      CHECK(g >= 1 && g <= run_opts[rep].max_ctas, "%s: %d CTAs (at most %d asked)", label, g,
            run_opts[rep].max_ctas);
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaMemcpy(rep ? got : first, d_out, out1_bytes, cudaMemcpyDeviceToHost));
    if (rep == 0) {
      snprintf(label, sizeof label, "%s [%s] swiglu (n %d, k %d, lda %d, a_div %d)", c->name, en,
               n, k, lda1, c->top_k);
      check_output(label, p, n, first, MOELINK_DTYPE_F32, 1, ref1, tol1);
    } else {
      CHECK(memcmp(first, got, out1_bytes) == 0,
            "%s [%s] swiglu: static schedule and %s bitwise equal", c->name, en, run_name[rep]);
    }
  }
  if (want1 == ML_GEMM_ENGINE_SM90) {
    check_wait(c, p, en, d, d_sched, first, out1_bytes, stream);
  } else {
    /* the decode-kernel fallback has no row wait: refused, nothing run */
    gu_feed f = gu_feed_make(R, 24, 7);
    const ml_cuda_gemm_wait w = {f.d_signal, f.d_value, f.rows, gu_feed_comm(&f, 1000000ull)};
    const ml_cuda_gemm_opts o = {.cluster = 1, .wait = &w};
    snprintf(label, sizeof label, "%s [%s] swiglu with a row wait off the sm_90a engine", c->name,
             en);
    CHECK_STATUS(ml_cuda_gemm_swiglu_fp8(d->x, d->xs, lda1, ai, c->top_k, d->w1, d->w1s, n, k,
                                         d->tiles, d->num, p->max_tiles, R, (float *)d_out, NULL,
                                         &o, stream),
                 MOELINK_ERR_UNSUPPORTED, label);
    gu_feed_free(&f);
  }

  /* swiglu with the output quantized in the epilogue (sm_90a engine): the
   * bytes and scales moelink_quantize's FP8 makes of the fp32 output above
   * (d_out holds it), on the owned rows; the other rows stay poisoned */
  {
    int fuses = -1;
    CHECK_OK(ml_cuda_gemm_swiglu_fp8_quantizes(n, k, &fuses), "swiglu_fp8_quantizes");
    CHECK(fuses == (want1 == ML_GEMM_ENGINE_SM90),
          "%s [%s] the quantizing epilogue offered (%d) exactly where the sm_90a engine runs",
          c->name, en, fuses);
    const size_t qn = (size_t)(R + GUARD_ROWS) * n, sn = (size_t)(R + GUARD_ROWS) * (n / 128);
    uint8_t *d_q = NULL, *d_qr = NULL;
    float *d_s = NULL, *d_sr = NULL;
    CUDA_CHECK(cudaMalloc((void **)&d_q, qn));
    CUDA_CHECK(cudaMalloc((void **)&d_qr, qn));
    CUDA_CHECK(cudaMalloc((void **)&d_s, sn * sizeof(float)));
    CUDA_CHECK(cudaMalloc((void **)&d_sr, sn * sizeof(float)));
    uint8_t *q = xmalloc(qn), *qr = xmalloc(qn), *q1 = xmalloc(qn);
    float *sc = xmalloc(sn * sizeof(float)), *sr = xmalloc(sn * sizeof(float));
    float *sc1 = xmalloc(sn * sizeof(float));
    if (!fuses) {
      snprintf(label, sizeof label, "%s [%s] swiglu, e4m3 out off the sm_90a engine", c->name, en);
      CHECK_STATUS(ml_cuda_gemm_swiglu_fp8(d->x, d->xs, lda1, ai, c->top_k, d->w1, d->w1s, n, k,
                                           d->tiles, d->num, p->max_tiles, R, d_q, d_s, NULL,
                                           stream),
                   MOELINK_ERR_UNSUPPORTED, label);
    } else {
      CHECK_OK(ml_cuda_quantize(MOELINK_QUANT_FP8, MOELINK_DTYPE_F32, d_out, R, n, d_qr, d_sr, 132,
                                stream),
               "quantize the fp32 swiglu output");
      /* run 0 static, default tile; 1 dynamic (clusters asked for: the
       * quantizing epilogue runs one CTA); 2 dynamic, the 128-column tile;
       * 3 dynamic, the 256-column tile: runs 1-3 bitwise run 0's */
      const ml_cuda_gemm_opts *qopts[4] = {NULL, &dyn, &run_opts[3], &run_opts[4]};
      long q_differ = 0;
      for (int rep = 0; rep < 4; ++rep) {
        CUDA_CHECK(cudaMemsetAsync(d_q, 0xA5, qn, stream));
        CUDA_CHECK(cudaMemsetAsync(d_s, 0xFF, sn * sizeof(float), stream));
        snprintf(label, sizeof label, "%s [%s] swiglu e4m3 out run %d", c->name, en, rep);
        CHECK_OK(ml_cuda_gemm_swiglu_fp8(d->x, d->xs, lda1, ai, c->top_k, d->w1, d->w1s, n, k,
                                         d->tiles, d->num, p->max_tiles, R, d_q, d_s, qopts[rep],
                                         stream),
                 label);
        check_tile(label, qopts[rep], want1, 0);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaMemcpy(rep ? q1 : q, d_q, qn, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(rep ? sc1 : sc, d_s, sn * sizeof(float), cudaMemcpyDeviceToHost));
        if (rep > 0)
          q_differ += memcmp(q, q1, qn) != 0 || memcmp(sc, sc1, sn * sizeof(float)) != 0;
      }
      CUDA_CHECK(cudaMemcpy(qr, d_qr, qn, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(sr, d_sr, sn * sizeof(float), cudaMemcpyDeviceToHost));
      gu_q_diff qd = {0, 0, 0, 0};
      gu_q_compare(p->row_expert, R, R + GUARD_ROWS, n, q, qr, sc, sr, &qd);
      CHECK(qd.owned > 0 && qd.bad_q == 0 && qd.bad_s == 0,
            "%s [%s] swiglu e4m3 out: bytes and scales of %ld owned rows bitwise those of "
            "quantizing the fp32 output (%ld bytes, %ld scales differ)",
            c->name, en, qd.owned, qd.bad_q, qd.bad_s);
      CHECK(qd.poison == 0, "%s [%s] swiglu e4m3 out: unowned rows stay poisoned (%ld changed)",
            c->name, en, qd.poison);
      CHECK(q_differ == 0,
            "%s [%s] swiglu e4m3 out: static schedule, dynamic schedule and both tiles bitwise "
            "equal (%ld of 3 runs differ)",
            c->name, en, q_differ);
    }
    free(q);
    free(qr);
    free(q1);
    free(sc);
    free(sr);
    free(sc1);
    cudaFree(d_q);
    cudaFree(d_qr);
    cudaFree(d_s);
    cudaFree(d_sr);
  }

  /* scaled: the dtype out, then fp32 out */
  for (int f32 = 0; f32 < 2; ++f32) {
    const size_t bytes = (size_t)(R + GUARD_ROWS) * k * (f32 ? 4 : 2);
    for (int rep = 0; rep < RUNS; ++rep) {
      CUDA_CHECK(cudaMemsetAsync(d_out, 0xFF, bytes, stream));
      snprintf(label, sizeof label, "%s [%s] scaled%s run %d", c->name, en, f32 ? " f32" : "",
               rep);
      CHECK_OK(ml_cuda_gemm_scaled_fp8(c->dt, d->h, d->hs, lda2, d->w2, d->w2s, k, n, d->tiles,
                                       d->num, p->max_tiles, R, rs, si, d_out, f32,
                                       rep ? &run_opts[rep] : NULL, stream),
               label);
      CHECK(ml_cuda_gemm_last_engine() == want2, "%s [%s] scaled%s run %d on the %s engine (%s)",
            c->name, en, f32 ? " f32" : "", rep, engine_name(want2),
            engine_name(ml_cuda_gemm_last_engine()));
      check_tile(label, rep ? &run_opts[rep] : NULL, want2, k);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaMemcpy(rep ? got : first, d_out, bytes, cudaMemcpyDeviceToHost));
      if (rep == 0) {
        snprintf(label, sizeof label, "%s [%s] scaled (-> %s, n %d, k %d, lda %d, scale %d)",
                 c->name, en, f32 ? "f32" : moelink_dtype_name(c->dt), k, n, lda2, c->scale_mode);
        check_output(label, p, k, first, c->dt, f32, ref2, f32 ? tol2_f32 : tol2);
      } else {
        CHECK(memcmp(first, got, bytes) == 0,
              "%s [%s] scaled%s: static schedule and %s bitwise equal", c->name, en,
              f32 ? " f32" : "", run_name[rep]);
      }
    }
    if (f32)
      continue;
    /* every run again with its rows stored through out_rows (gu_rows_table:
     * row r to row R - 1 - r of another buffer): the plain run's rows */
    gu_rows t = gu_rows_make(p->row_expert, si, 1, R, (size_t)k * 2);
    for (int rep = 0; rep < RUNS; ++rep) {
      ml_cuda_gemm_opts o = run_opts[rep];
      o.out_rows = (void *const *)t.d_table;
      gu_rows_poison(&t, d_out, bytes, stream);
      snprintf(label, sizeof label, "%s [%s] scaled into rows by pointer (%s)", c->name, en,
               run_name[rep]);
      CHECK_OK(ml_cuda_gemm_scaled_fp8(c->dt, d->h, d->hs, lda2, d->w2, d->w2s, k, n, d->tiles,
                                       d->num, p->max_tiles, R, rs, si, d_out, 0, &o, stream),
               label);
      CHECK(ml_cuda_gemm_last_engine() == want2, "%s: on the %s engine (%s)", label,
            engine_name(want2), engine_name(ml_cuda_gemm_last_engine()));
      gu_rows_verify(label, &t, p->row_expert, first, d_out, got, bytes, stream);
    }
    gu_rows_free(&t);
  }
  snprintf(label, sizeof label, "%s [%s]", c->name, en);
  gu_counter_check_zero(d_sched, ML_CUDA_GEMM_SCHED_INTS, label);
  gu_free(d_sched);

  CUDA_CHECK(cudaStreamDestroy(stream));
  cudaFree(d_out);
  free(got);
  free(first);
}

static void run_case(const fcase *c, const problem *p) {
  const int n = c->n, k = c->k, R = p->R, E = p->E;
  const int lda1 = k + c->lda_pad, lda2 = n + c->lda_pad;
  const int ls1 = lda1 / 128, ls2 = lda2 / 128; /* scales per A row */
  const int tokens = c->top_k ? (p->real_rows + c->top_k - 1) / c->top_k : R;
  const int xrows = tokens > 0 ? tokens : 1;
  const double abase = 1.0 / g_e4m3_rms; /* dequantized A of rms ~1 */

  /* x: the swiglu GEMM's A [xrows, lda1], padding NaN codes and scales */
  uint8_t *xq = xmalloc((size_t)xrows * lda1);
  float *xs = xmalloc((size_t)xrows * ls1 * sizeof(float));
  double *xv = xmalloc((size_t)xrows * k * sizeof(double));
  for (int r = 0; r < xrows; ++r) {
    for (int i = 0; i < lda1; ++i) {
      const uint8_t q = i < k ? rng_e4m3() : 0x7f;
      xq[(size_t)r * lda1 + i] = q;
      if (i < k) xv[(size_t)r * k + i] = g_e4m3[q];
    }
    for (int b = 0; b < ls1; ++b) xs[(size_t)r * ls1 + b] = b < k / 128 ? rng_scale(abase, 0) : NAN;
  }
  /* a_index: a permutation of the owned rows' (token, slot) pairs */
  int32_t *a_index = xmalloc((size_t)R * sizeof(int32_t));
  int32_t *perm = xmalloc((size_t)p->real_rows * sizeof(int32_t));
  for (int i = 0; i < p->real_rows; ++i) perm[i] = i;
  for (int i = p->real_rows - 1; i > 0; --i) {
    const int j = (int)(rng_next() % (uint32_t)(i + 1));
    const int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int r = 0, q = 0; r < R; ++r) a_index[r] = p->row_expert[r] >= 0 ? perm[q++] : 0;

  /* w1 [E, 2n, k] with scales [E, 2n / 128, k / 128]; w2 [E, k, n] with
   * [E, k / 128, n / 128]; dequantized B rms ~1 / sqrt(depth) */
  const int rb1 = 2 * n / 128, kb1 = k / 128, rb2 = k / 128, kb2 = n / 128;
  const size_t w1n = (size_t)E * 2 * n * k, w2n = (size_t)E * k * n;
  const size_t s1n = (size_t)E * rb1 * kb1, s2n = (size_t)E * rb2 * kb2;
  uint8_t *w1q = xmalloc(w1n), *w2q = xmalloc(w2n);
  double *w1v = xmalloc(w1n * sizeof(double)), *w2v = xmalloc(w2n * sizeof(double));
  float *w1s = xmalloc(s1n * sizeof(float)), *w2s = xmalloc(s2n * sizeof(float));
  for (size_t i = 0; i < w1n; ++i) w1v[i] = g_e4m3[w1q[i] = rng_e4m3()];
  for (size_t i = 0; i < w2n; ++i) w2v[i] = g_e4m3[w2q[i] = rng_e4m3()];
  for (size_t i = 0; i < s1n; ++i) w1s[i] = rng_scale(abase / sqrt((double)k), 13);
  for (size_t i = 0; i < s2n; ++i) w2s[i] = rng_scale(abase / sqrt((double)n), 13);
  /* Zero blocks for sure, where other blocks of the same rows remain:
   * expert 0's first gate block at the last k block, the last expert's last
   * up block at k block 0, expert 0's first row block at the last k block
   * (or, with one k block, its last row block). */
  if (kb1 > 1) {
    w1s[(size_t)kb1 - 1] = 0.0f;
    w1s[((size_t)(E - 1) * rb1 + rb1 - 1) * kb1] = 0.0f;
  }
  if (kb2 > 1) w2s[kb2 - 1] = 0.0f;
  else if (rb2 > 1) w2s[rb2 - 1] = 0.0f;

  /* h: the scaled GEMM's own A [R, lda2] (unowned rows all NaN) */
  uint8_t *hq = xmalloc((size_t)R * lda2);
  float *hs = xmalloc((size_t)R * ls2 * sizeof(float));
  double *hv = xmalloc((size_t)R * n * sizeof(double));
  for (int r = 0; r < R; ++r) {
    const int owned = p->row_expert[r] >= 0;
    for (int i = 0; i < lda2; ++i) {
      const uint8_t q = owned && i < n ? rng_e4m3() : 0x7f;
      hq[(size_t)r * lda2 + i] = q;
      if (i < n) hv[(size_t)r * n + i] = owned ? g_e4m3[q] : 0.0;
    }
    for (int b = 0; b < ls2; ++b)
      hs[(size_t)r * ls2 + b] = owned && b < n / 128 ? rng_scale(abase, 0) : NAN;
  }
  const int nscale = c->scale_mode == 2 ? p->real_rows : R;
  float *row_scale = xmalloc((size_t)nscale * sizeof(float));
  for (int i = 0; i < nscale; ++i) row_scale[i] = (float)((rng_next() % 1000 + 1) / 1000.0);

  /* references and per-element bounds */
  double *ref1 = calloc((size_t)R * n + 1, sizeof(double));
  double *tol1 = calloc((size_t)R * n + 1, sizeof(double));
  double *ref2 = calloc((size_t)R * k + 1, sizeof(double));
  double *tol2 = calloc((size_t)R * k + 1, sizeof(double));
  double *tol2f = calloc((size_t)R * k + 1, sizeof(double));
  const double rel1 = out_rel(MOELINK_DTYPE_F32, 1);
  const double rel2 = out_rel(c->dt, 0), abs2 = out_abs(c->dt, 0), rel2f = out_rel(c->dt, 1);
  for (int r = 0; r < R; ++r) {
    const int e = p->row_expert[r];
    if (e < 0) continue;
    const int xr = c->top_k ? a_index[r] / c->top_k : r;
    const double *xa = xv + (size_t)xr * k;
    const float *xsa = xs + (size_t)xr * ls1;
    for (int j = 0; j < n; ++j) {
      const double *gw = w1v + ((size_t)e * 2 * n + j) * k, *uw = gw + (size_t)n * k;
      const float *gs = w1s + ((size_t)e * rb1 + j / 128) * kb1;
      const float *us = w1s + ((size_t)e * rb1 + (n + j) / 128) * kb1;
      double mg, mu;
      const double g = fp8_dot(xa, xsa, gw, gs, k, &mg), u = fp8_dot(xa, xsa, uw, us, k, &mu);
      const double silu = g / (1.0 + exp(-g)), v = silu * u;
      const size_t i = (size_t)r * n + j;
      ref1[i] = v;
      /* |silu(g') u' - silu(g) u| <= 1.1 dg (|u| + du) + |silu(g)| du */
      const double dg = ACC_TOL * mg, du = ACC_TOL * mu;
      tol1[i] = rel1 * fabs(v) + SILU_SLOPE * dg * (fabs(u) + du) + fabs(silu) * du;
    }
    const double sc = c->scale_mode == 0   ? 1.0
                      : c->scale_mode == 1 ? row_scale[r]
                                           : row_scale[a_index[r]];
    const double *ha = hv + (size_t)r * n;
    const float *hsa = hs + (size_t)r * ls2;
    for (int j = 0; j < k; ++j) {
      const double *w = w2v + ((size_t)e * k + j) * n;
      const float *ws = w2s + ((size_t)e * rb2 + j / 128) * kb2;
      double m;
      const double v = sc * fp8_dot(ha, hsa, w, ws, n, &m);
      const size_t i = (size_t)r * k + j;
      ref2[i] = v;
      tol2[i] = rel2 * fabs(v) + abs2 + ACC_TOL * sc * m;
      tol2f[i] = rel2f * fabs(v) + ACC_TOL * sc * m;
    }
  }

  dev_ops d;
  d.x = dev_copy(xq, (size_t)xrows * lda1);
  d.xs = dev_copy(xs, (size_t)xrows * ls1 * sizeof(float));
  d.w1 = dev_copy(w1q, w1n);
  d.w1s = dev_copy(w1s, s1n * sizeof(float));
  d.h = dev_copy(hq, (size_t)R * lda2);
  d.hs = dev_copy(hs, (size_t)R * ls2 * sizeof(float));
  d.w2 = dev_copy(w2q, w2n);
  d.w2s = dev_copy(w2s, s2n * sizeof(float));
  d.index = dev_copy(a_index, (size_t)R * sizeof(int32_t));
  d.row_scale = dev_copy(row_scale, (size_t)nscale * sizeof(float));
  d.h_index = a_index;
  d.xrows = xrows;
  d.tiles = NULL;
  d.num = NULL;
  if (p->tiles) {
    d.tiles = dev_copy(p->tiles, (size_t)3 * p->max_tiles * sizeof(int32_t));
    d.num = dev_copy(&p->num_tiles, sizeof(int32_t));
  }
  run_case_engine(c, p, ML_GEMM_ENGINE_TILE, &d, ref1, tol1, ref2, tol2, tol2f);
  if (have_sm90) run_case_engine(c, p, ML_GEMM_ENGINE_SM90, &d, ref1, tol1, ref2, tol2, tol2f);
  ml_cuda_gemm_set_engine(ML_GEMM_ENGINE_AUTO);

  cudaFree((void *)d.x), cudaFree((void *)d.xs), cudaFree((void *)d.w1), cudaFree((void *)d.w1s);
  cudaFree((void *)d.h), cudaFree((void *)d.hs), cudaFree((void *)d.w2), cudaFree((void *)d.w2s);
  cudaFree((void *)d.index), cudaFree((void *)d.row_scale);
  cudaFree((void *)d.tiles), cudaFree((void *)d.num);
  free(xq), free(xs), free(xv), free(a_index), free(perm);
  free(w1q), free(w2q), free(w1v), free(w2v), free(w1s), free(w2s);
  free(hq), free(hs), free(hv), free(row_scale);
  free(ref1), free(tol1), free(ref2), free(tol2), free(tol2f);
}

/* ---- argument checks and launches with nothing to do ------------------------ */

static void check_rejections(int engine) {
  const char *en = engine_name(engine);
  ml_cuda_gemm_set_engine(engine);
  char *d = NULL, *o = NULL;
  CUDA_CHECK(cudaMalloc((void **)&d, 1 << 20));
  CUDA_CHECK(cudaMemset(d, 0, 1 << 20));
  CUDA_CHECK(cudaMalloc((void **)&o, 1 << 16));
  const uint8_t *q = (const uint8_t *)d;                /* codes (zeros) */
  const float *sc = (const float *)(d + (1 << 19));     /* scales (zeros) */
  int32_t *tl = (int32_t *)(d + (1 << 19) + (1 << 18)); /* a tile list */
  int32_t *num = tl + 64;
  float *of = (float *)o;
  const moelink_dtype_t bf = MOELINK_DTYPE_BF16;
  char what[160];
#define REJECT(call, want, ...)                                                \
  do {                                                                         \
    snprintf(what, sizeof what, __VA_ARGS__);                                  \
    CHECK_STATUS(call, want, what);                                            \
  } while (0)

  /* n, k, lda not multiples of 128 */
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 128, NULL, 1, q, sc, 192, 128, NULL, NULL, 0, 4, of, NULL,
                                 NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] swiglu fp8 n 192", en);
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 256, NULL, 1, q, sc, 128, 200, NULL, NULL, 0, 4, of, NULL,
                                 NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] swiglu fp8 k 200", en);
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 192, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, of, NULL,
                                 NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] swiglu fp8 lda 192", en);
  REJECT(ml_cuda_gemm_scaled_fp8(bf, q, sc, 128, q, sc, 64, 128, NULL, NULL, 0, 4, NULL, NULL, o, 0,
                                 NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] scaled fp8 n 64", en);
  REJECT(ml_cuda_gemm_scaled_fp8(bf, q, sc, 256, q, sc, 256, 136, NULL, NULL, 0, 4, NULL, NULL, o,
                                 1, NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] scaled fp8 k 136", en);
  REJECT(ml_cuda_gemm_scaled_fp8(bf, q, sc, 200, q, sc, 384, 128, NULL, NULL, 0, 4, NULL, NULL, o,
                                 0, NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] scaled fp8 lda 200", en);
  /* NULL scales */
  REJECT(ml_cuda_gemm_swiglu_fp8(q, NULL, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, of, NULL,
                                 NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] swiglu fp8 a_scale NULL", en);
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 128, NULL, 1, q, NULL, 128, 128, NULL, NULL, 0, 4, of, NULL,
                                 NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] swiglu fp8 b_scale NULL", en);
  REJECT(ml_cuda_gemm_scaled_fp8(bf, q, NULL, 128, q, sc, 128, 128, NULL, NULL, 0, 4, NULL, NULL, o,
                                 0, NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] scaled fp8 a_scale NULL", en);
  REJECT(ml_cuda_gemm_scaled_fp8(bf, q, sc, 128, q, NULL, 128, 128, NULL, NULL, 0, 4, NULL, NULL, o,
                                 1, NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] scaled fp8 b_scale NULL (f32 out)", en);
  /* output dtypes: fp32 only through out_f32 */
  REJECT(ml_cuda_gemm_scaled_fp8(MOELINK_DTYPE_F32, q, sc, 128, q, sc, 128, 128, NULL, NULL, 0, 4,
                                 NULL, NULL, o, 0, NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] scaled fp8 out dtype f32", en);
  REJECT(ml_cuda_gemm_scaled_fp8(MOELINK_DTYPE_FP8_E4M3, q, sc, 128, q, sc, 128, 128, NULL, NULL, 0,
                                 4, NULL, NULL, o, 0, NULL, 0),
         MOELINK_ERR_UNSUPPORTED, "[%s] scaled fp8 out dtype e4m3", en);
  /* malformed problems */
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 128, NULL, 1, q, sc, 128, 128, tl, NULL, 2, 4, of, NULL,
                                 NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] swiglu fp8 tiles without num_tiles", en);
  REJECT(ml_cuda_gemm_scaled_fp8(bf, q, sc, 128, q, sc, 128, 128, tl, NULL, 2, 4, NULL, NULL, o, 0,
                                 NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] scaled fp8 tiles without num_tiles", en);
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 128, (const int32_t *)tl, 0, q, sc, 128, 128, NULL, NULL, 0,
                                 4, of, NULL, NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] swiglu fp8 a_div 0", en);
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, -1, of, NULL,
                                 NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] swiglu fp8 rows -1", en);
  /* an e4m3 output's scales must be 4-byte aligned */
  REJECT(ml_cuda_gemm_swiglu_fp8(q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, o,
                                 (float *)(o + 2), NULL, 0),
         MOELINK_ERR_INVALID_ARGUMENT, "[%s] swiglu fp8 e4m3 out, out_scale misaligned", en);
#undef REJECT
  CUDA_CHECK(cudaDeviceSynchronize());

  /* Nothing to do: no rows, no tile entries, or a tile list whose
   * *num_tiles is 0 (launched: its three entries name rows 0..3). The
   * output stays poisoned. */
  const int32_t host_tiles[9] = {0, 0, 4, 0, 0, 4, 0, 0, 4}, zero = 0;
  CUDA_CHECK(cudaMemcpy(tl, host_tiles, sizeof host_tiles, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(num, &zero, sizeof zero, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(o, 0xFF, 1 << 16));
  CHECK_OK(ml_cuda_gemm_swiglu_fp8(q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 0, of, NULL,
                                   NULL, 0),
           "swiglu fp8 with 0 dense rows");
  CHECK_OK(ml_cuda_gemm_scaled_fp8(bf, q, sc, 128, q, sc, 128, 128, tl, num, 0, 4, NULL, NULL, o, 0,
                                   NULL, 0),
           "scaled fp8 with max_tiles 0");
  CHECK_OK(ml_cuda_gemm_swiglu_fp8(q, sc, 128, NULL, 1, q, sc, 128, 128, tl, num, 3, 4, of, NULL,
                                   NULL, 0),
           "swiglu fp8 with *num_tiles 0");
  CHECK(ml_cuda_gemm_last_engine() == expected_engine(engine, 1, 128),
        "[%s] swiglu fp8 with *num_tiles 0 launched on the %s engine (%s)", en,
        engine_name(expected_engine(engine, 1, 128)), engine_name(ml_cuda_gemm_last_engine()));
  CHECK_OK(ml_cuda_gemm_scaled_fp8(MOELINK_DTYPE_F16, q, sc, 128, q, sc, 128, 128, tl, num, 3, 4,
                                   NULL, NULL, o, 0, NULL, 0),
           "scaled fp8 with *num_tiles 0");
  CHECK(ml_cuda_gemm_last_engine() == expected_engine(engine, 0, 128),
        "[%s] scaled fp8 with *num_tiles 0 launched on the %s engine (%s)", en,
        engine_name(expected_engine(engine, 0, 128)), engine_name(ml_cuda_gemm_last_engine()));
  CUDA_CHECK(cudaDeviceSynchronize());
  unsigned char *host = xmalloc(1 << 16);
  CUDA_CHECK(cudaMemcpy(host, o, 1 << 16, cudaMemcpyDeviceToHost));
  long changed = 0;
  for (size_t i = 0; i < (1u << 16); ++i) changed += host[i] != 0xFF;
  CHECK(changed == 0, "[%s] launches with nothing to do write nothing (%ld bytes changed)", en,
        changed);
  free(host);
  cudaFree(d);
  cudaFree(o);
  ml_cuda_gemm_set_engine(ML_GEMM_ENGINE_AUTO);
}

int main(void) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("# no CUDA device\n");
    CHECK(0, "a CUDA device is present");
    return ml_test_done();
  }
  int major = 0, minor = 0, sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  have_sm90 = major == 9 && minor == 0;
  printf("# compute capability %d.%d, %d SMs: %s\n", major, minor, sms,
         have_sm90 ? "decode fallback and sm_90a FP8 kernel" : "decode fallback only");
  e4m3_table();
  {
    /* the cheap per-block division of the FP8 quantization (quant.cuh) gives
     * x / s's e4m3 bytes on every pair, and its fp32 bits where |x| >= 2^-80 */
    const long long n = 1LL << 28;
    unsigned long long bytes = 0, bits = 0;
    const double t0 = gu_now();
    CHECK_OK(ml_cuda_q_div_check(0x5eed, n, &bytes, &bits), "ml_cuda_q_div_check");
    CHECK(bytes == 0 && bits == 0,
          "FP8 scaling by the reciprocal and two corrections: %lld pairs (a quarter near e4m3 "
          "midpoints), %llu e4m3 bytes and %llu fp32 quotients differ from x / s (%.2f s)",
          n, bytes, bits, gu_now() - t0);
  }
  check_rejections(ML_GEMM_ENGINE_TILE);
  if (have_sm90) check_rejections(ML_GEMM_ENGINE_SM90);

  /* Five experts, expert 2 without a tile. Expert 1: tiles of 7 and 64 rows
   * with 3 unowned rows between them (one unit, rows not adjacent), then 13
   * alone in its unit. Expert 3: a unit of two full tiles and an odd third
   * alone. Expert 4: 13 and 64 (the second starts 13 rows after the first),
   * then 1 alone. Three dead entries: the first unowned row, the guard rows. */
  static const tspec plan[] = {
      {0, 1, 2},  {1, 7, 3},  {1, 64, 0}, {1, 13, 1}, {3, 64, 0},
      {3, 64, 0}, {3, 64, 4}, {4, 13, 0}, {4, 64, 0}, {4, 1, 0},
  };
  problem pa;
  problem_build(&pa, 5, plan, (int)(sizeof plan / sizeof plan[0]), 3);
  static const fcase plan_cases[] = {
      {"plan n 128 k 256", MOELINK_DTYPE_BF16, 128, 256, 128, 2, 2},
      {"plan n 256 k 640", MOELINK_DTYPE_F16, 256, 640, 0, 4, 1},
      {"plan n 384 k 128", MOELINK_DTYPE_BF16, 384, 128, 128, 1, 0},
      /* A-scale groups of four k blocks (rows 512 or 1536 scales apart):
       * 11 blocks (4 + 4 + 3) in the gate/up GEMM, 8 in the down one */
      {"plan n 512 k 1408", MOELINK_DTYPE_BF16, 512, 1408, 128, 2, 1},
      {"plan n 1024 k 512", MOELINK_DTYPE_F16, 1024, 512, 0, 2, 2},
  };
  for (size_t i = 0; i < sizeof plan_cases / sizeof plan_cases[0]; ++i)
    run_case(&plan_cases[i], &pa);
  problem_free(&pa);

  /* Nine experts (expert 5 empty), 10 to 18 tiles each of 64 rows or fewer,
   * a few unowned rows here and there: over a hundred tiles, ~60 units, so
   * a few hundred work items at these widths (swiglu 6 column blocks,
   * scaled 5): every persistent CTA takes two or three and walks past
   * several experts between them. */
  {
    tspec many[9 * 18];
    int nt = 0;
    for (int e = 0; e < 9; ++e) {
      if (e == 5) continue;
      const int tiles = 10 + (int)(rng_next() % 9);
      for (int t = 0; t < tiles; ++t) {
        many[nt].expert = e;
        many[nt].rows = rng_next() % 3 == 0 ? 64 : 1 + (int)(rng_next() % 64);
        many[nt].gap = rng_next() % 7 == 0 ? 1 + (int)(rng_next() % 3) : 0;
        ++nt;
      }
    }
    problem pm;
    problem_build(&pm, 9, many, nt, 2);
    ml_t_diag("many tiles: %d tiles, %d rows (%d owned)", pm.num_tiles, pm.R, pm.real_rows);
    static const fcase many_case = {"many tiles", MOELINK_DTYPE_BF16, 384, 640, 0, 8, 2};
    run_case(&many_case, &pm);
    problem_free(&pm);
  }

  /* The dense form (no tile list): 1 row, 70 (a full and a partial tile in
   * one unit), 200 (two units, the second's tiles 64 and 8 rows). */
  static const struct {
    int rows;
    fcase c;
  } dense[] = {
      {1, {"dense 1 row", MOELINK_DTYPE_F16, 128, 256, 0, 0, 1}},
      {70, {"dense 70 rows", MOELINK_DTYPE_BF16, 256, 640, 0, 2, 0}},
      {200, {"dense 200 rows", MOELINK_DTYPE_F16, 384, 256, 128, 0, 1}},
  };
  for (size_t i = 0; i < sizeof dense / sizeof dense[0]; ++i) {
    problem pd;
    problem_dense(&pd, dense[i].rows);
    run_case(&dense[i].c, &pd);
    problem_free(&pd);
  }
  return ml_test_done();
}
