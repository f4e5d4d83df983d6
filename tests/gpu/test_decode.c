/* The decode expert GEMMs (ml_cuda_decode_swiglu, ml_cuda_decode_scaled)
 * against a double-precision host computation, on plan-shaped tile lists:
 * experts with 0, 1, 7, 64, 65 and 200 rows, rows between experts that no
 * tile owns, all rows on one expert, one row on each of k experts (a decode
 * step), a random routing of 16 tokens, and the dense form of the shared
 * expert; bf16 and f16; K splits off, forced and chosen by the policy;
 * programmatic dependent launch on and off; one pair replayed from a CUDA
 * graph. Outputs are filled with 0xFF bytes before each run (NaN in every
 * output dtype): owned rows are checked element by element, every other byte
 * must still be 0xFF. Each configuration runs twice and must be bitwise equal,
 * then once more on the other kernel (16-row passes where the launch took
 * 64-row ones with a tile list, and the other way round), bitwise equal too;
 * odd configurations pass the exact bound on a tile's rows (max_rows), and
 * the kernel of the pass rows the rules call for must have run. The split-K
 * tickets must be back at zero afterwards. Tile entries past
 * *num_tiles name another expert's rows, so running them would show.
 *
 * Inputs are multiples of 2^-8 times a power of two with 8 significant bits,
 * exact in bf16 and f16, so the host computes with the very values the GPU
 * reads.
 *
 * The FP8 launchers (ml_cuda_fp8_swiglu, ml_cuda_fp8_scaled) run the same
 * way on random e4m3 codes (never NaN) with fp32 block scales of varied size,
 * some zero, against the host's double computation from code value x scale:
 * experts with 0, 1, 5, 63, 64, 65, 200 and 1000 rows, the dense form with 1
 * and 1000 rows, gathered rows (a_div = top_k), splits 1, 2, 3, 16 and the
 * policy, bf16, f16 and fp32 outputs of both GEMMs, row scales by pair and by
 * row, NaN codes and NaN scales in padding and unowned rows; the fp32
 * SwiGLU again with its e4m3 copy made by the kernel (q_out), bitwise
 * moelink_quantize's of that output; and their argument checks.
 *
 * With --bench (not run by ctest): the decode GEMMs beside the tile engine's
 * on full-size presets (weights filled on the device, routing and plan from
 * the library), K-split sweeps, and the whole layer eager and replayed from a
 * CUDA graph (DECODE_BENCH_TOKENS=1,2,4: these token counts instead of
 * 1, 16, 64, .. 2048). Times are medians with the L2 flushed before each run by a
 * 256 MiB memset (the CLI benchmarks read instead since commit e958a9d: see
 * docs/PERF.md; this tool keeps the memset so its numbers stay comparable). */
#include "core/core.h"
#include "cuda/cuda.h"
#include "cuda/gemm/decode.h"
#include "cuda/pipeline.h"
#include "gpu_util.h"
#include "harness.h"
#include "moelink.h"
#include "ref.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD_ROWS 3
#define EL_REL (1.0 / 128) /* per element: bf16 output rounding is 2^-9 relative */
#define EL_ABS 1e-4        /* times the sum of |terms|: fp32 accumulation */
#define L2_TOL 4e-3

#define CUDA_CHECK(call)                                                       \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      printf("Bail out! %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__,  \
             __LINE__);                                                        \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

static int g_sm_count;

/* ---- host data --------------------------------------------------------------- */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint32_t rng_next(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 20);
}
/* m / 256 * scale, |m| <= 255 */
static double rng_value(double scale) { return ((int)(rng_next() % 511) - 255) / 256.0 * scale; }
/* a power of two near 1 / sqrt(k): dot products of order 1 */
static double pow2_scale(int k) {
  return ldexp(1.0, -(int)floor(log2(sqrt((double)(k > 0 ? k : 1))) + 0.5));
}

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    printf("Bail out! host allocation of %zu bytes\n", bytes);
    exit(2);
  }
  return p;
}

static void *dev_alloc(size_t bytes) {
  void *d = NULL;
  CUDA_CHECK(cudaMalloc(&d, bytes ? bytes : 16));
  return d;
}

static void *dev_copy(const void *h, size_t bytes) {
  void *d = dev_alloc(bytes);
  if (bytes) CUDA_CHECK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
  return d;
}

/* ---- problems ---------------------------------------------------------------------- */

/* Plan rows expert by expert, each expert's rows cut into tiles of up to
 * ML_CUDA_TILE_ROWS (as the plan does), `gap` unowned rows after each expert.
 * Owned row r holds pair index[r] (a random permutation of the pairs), i.e.
 * token index[r] / top_k. tiles == NULL: dense rows of expert 0. */
typedef struct problem {
  int E, R, top_k, pairs, tokens;
  int num_tiles, max_passes;
  int32_t *tiles;
  int *row_expert; /* [R], -1: no tile owns the row */
  int32_t *index;  /* [R] or NULL */
} problem;

static void problem_routed(problem *p, int E, const int *counts, int gap, int top_k,
                           int max_passes) {
  memset(p, 0, sizeof *p);
  p->E = E;
  p->top_k = top_k;
  int R = 0, nt = 0;
  for (int e = 0; e < E; ++e) {
    R += counts[e] + gap;
    p->pairs += counts[e];
    nt += (counts[e] + ML_CUDA_TILE_ROWS - 1) / ML_CUDA_TILE_ROWS;
  }
  p->R = R;
  p->tokens = (p->pairs + top_k - 1) / top_k;
  p->num_tiles = nt;
  /* the caller's bound (the real grid), else two entries past the real ones */
  p->max_passes = max_passes > 0 ? (max_passes > nt ? max_passes : nt) : nt + 2;
  p->tiles = xmalloc((size_t)3 * p->max_passes * sizeof(int32_t));
  p->row_expert = xmalloc((size_t)(R ? R : 1) * sizeof(int));
  p->index = xmalloc((size_t)(R ? R : 1) * sizeof(int32_t));
  int32_t *perm = xmalloc((size_t)(p->pairs ? p->pairs : 1) * sizeof(int32_t));
  for (int i = 0; i < p->pairs; ++i) perm[i] = i;
  for (int i = p->pairs - 1; i > 0; --i) {
    const int j = (int)(rng_next() % (uint32_t)(i + 1));
    const int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  int row = 0, t = 0, q = 0, first_real = -1, first_expert = 0;
  for (int e = 0; e < E; ++e) {
    for (int done = 0; done < counts[e];) {
      const int n = counts[e] - done < ML_CUDA_TILE_ROWS ? counts[e] - done : ML_CUDA_TILE_ROWS;
      p->tiles[3 * t] = e;
      p->tiles[3 * t + 1] = row;
      p->tiles[3 * t + 2] = n;
      if (first_real < 0) {
        first_real = row;
        first_expert = e;
      }
      for (int r = 0; r < n; ++r) {
        p->row_expert[row + r] = e;
        p->index[row + r] = perm[q++];
      }
      row += n;
      done += n;
      ++t;
    }
    for (int g = 0; g < gap; ++g) {
      p->row_expert[row] = -1;
      p->index[row++] = 0;
    }
  }
  /* entries past num_tiles: another expert over real rows */
  for (; t < p->max_passes; ++t) {
    p->tiles[3 * t] = (first_expert + 1) % E;
    p->tiles[3 * t + 1] = first_real > 0 ? first_real : 0;
    p->tiles[3 * t + 2] = 3;
  }
  free(perm);
}

/* Rows per expert when each of `tokens` tokens picks k distinct experts of E
 * at random (counts zeroed by the caller). */
static void count_distinct_routes(int *counts, int E, int tokens, int k) {
  for (int t = 0; t < tokens; ++t) {
    int chosen[16], nc = 0;
    while (nc < k) {
      const int e = (int)(rng_next() % (uint32_t)E);
      int dup = 0;
      for (int j = 0; j < nc; ++j) dup |= chosen[j] == e;
      if (!dup) chosen[nc++] = e, ++counts[e];
    }
  }
}


static void problem_dense(problem *p, int rows) {
  memset(p, 0, sizeof *p);
  p->E = 1;
  p->R = rows;
  p->top_k = 1;
  p->pairs = rows;
  p->tokens = rows;
  p->row_expert = xmalloc((size_t)(rows ? rows : 1) * sizeof(int));
  for (int r = 0; r < rows; ++r) p->row_expert[r] = 0;
}

static void problem_free(problem *p) {
  free(p->tiles);
  free(p->row_expert);
  free(p->index);
}

/* ---- checks ------------------------------------------------------------------------- */

/* got [R + GUARD_ROWS, n] (dtype or fp32) against ref/tol [R, n], and the
 * relative L2 over the owned rows within l2_tol. */
static void check_output(const char *what, const problem *p, int n, const unsigned char *got,
                         moelink_dtype_t dt, int f32, const double *ref, const double *tol,
                         double l2_tol) {
  const size_t es = f32 ? 4 : 2;
  long bad = 0, nonfinite = 0, poison = 0, first_bad = -1;
  double e2 = 0, r2 = 0, worst = 0;
  for (int r = 0; r < p->R + GUARD_ROWS; ++r) {
    const int owned = r < p->R && p->row_expert[r] >= 0;
    for (int j = 0; j < n; ++j) {
      const size_t i = (size_t)r * n + j;
      if (!owned) {
        for (size_t b = 0; b < es; ++b) poison += got[i * es + b] != 0xFF;
        continue;
      }
      const double g = ref_load(f32 ? MOELINK_DTYPE_F32 : dt, got, i);
      if (!isfinite(g)) {
        ++nonfinite;
        continue;
      }
      const double d = fabs(g - ref[i]);
      e2 += d * d;
      r2 += ref[i] * ref[i];
      if (d > tol[i]) {
        if (bad++ == 0) first_bad = (long)i;
        if (d / tol[i] > worst) worst = d / tol[i];
      }
    }
  }
  const double rel = r2 > 0 ? sqrt(e2 / r2) : sqrt(e2);
  CHECK(nonfinite == 0 && bad == 0 && rel <= l2_tol,
        "%s: every owned element within tolerance (rel L2 %.2e, %ld off by up to %.1fx tol, %ld "
        "non-finite)", what, rel, bad, worst, nonfinite);
  if (first_bad >= 0)
    ml_t_diag("  first off: row %ld col %ld: got %.6g want %.6g (tol %.3g)", first_bad / n,
              first_bad % n, ref_load(f32 ? MOELINK_DTYPE_F32 : dt, got, (size_t)first_bad),
              ref[first_bad], tol[first_bad]);
  CHECK(poison == 0, "%s: rows no tile owns stay poisoned (%ld bytes changed)", what, poison);
}

/* ---- one problem through both GEMMs ------------------------------------------------------ */

typedef struct dcase {
  const char *name;
  moelink_dtype_t dt;
  int n, k;       /* swiglu: out [R, n], W1 [E, 2n, k]; scaled: out [R, k], W2 [E, k, n] */
  int lda_pad;    /* extra elements per activation row (NaN) */
  int scaled_f32; /* also run the scaled GEMM with fp32 output */
  int graph;      /* also replay the pair from a captured graph */
} dcase;

typedef struct run_cfg {
  int splits; /* 0: policy */
  int flags;  /* ML_DECODE_PDL */
} run_cfg;

/* The rows of the problem's largest tile (dense: all its rows): the exact
 * bound a caller may pass as ml_decode_opts.max_rows. */
static int max_tile_rows(const problem *p) {
  if (p->tiles == NULL)
    return p->R;
  int m = 0;
  for (int t = 0; t < p->num_tiles; ++t)
    m = p->tiles[3 * t + 2] > m ? p->tiles[3 * t + 2] : m;
  return m;
}

/* The pass rows a launch over p with options o must take: 64 with
 * ML_DECODE_WIDE (or MOELINK_DECODE_SMALL=0), else 16 where no tile can have
 * more (the problem's rows, or o->max_rows of a tile list) or a tile list is
 * cut into 16-row passes (ML_DECODE_NARROW). */
static int want_pass_rows(const problem *p, const ml_decode_opts *o) {
  if ((o->flags & ML_DECODE_WIDE) != 0 || ml_env_int("MOELINK_DECODE_SMALL", 1) == 0)
    return 64;
  const int bound = p->tiles != NULL && o->max_rows > 0 && o->max_rows < p->R ? o->max_rows : p->R;
  if (bound <= 16)
    return 16;
  return p->tiles != NULL && (o->flags & ML_DECODE_NARROW) != 0 ? 16 : 64;
}

/* Run rep of a GEMM's launches in a configuration: runs 0 and 1 as
 * configured, run 2 on the other kernel where there is one (16-row passes:
 * ML_DECODE_WIDE; 64-row passes of a tile list: ML_DECODE_NARROW). Returns 0
 * for a run 2 with nothing to do, else fills *ou. */
static int pass_run(const problem *p, const ml_decode_opts *o, int rep, ml_decode_opts *ou) {
  *ou = *o;
  if (rep < 2)
    return 1;
  if (want_pass_rows(p, o) == 16)
    ou->flags |= ML_DECODE_WIDE;
  else if (p->tiles != NULL)
    ou->flags |= ML_DECODE_NARROW;
  else
    return 0;
  return want_pass_rows(p, ou) != want_pass_rows(p, o);
}

/* After run rep (its output in rep ? got : first): the pass rows it took,
 * and run 2 (the other kernel) bitwise run 0: each output element is the
 * same MMA sums in the same order whatever the pass rows (FP8 too: wgmma of
 * N = 16 and of N = 64 gave the same bits in every case here, H200). */
static void pass_check(const char *label, const problem *p, const ml_decode_opts *ou, int rep,
                       const unsigned char *first, const unsigned char *got, size_t bytes) {
  const int want = want_pass_rows(p, ou);
  CHECK(ml_cuda_decode_last_pass_rows() == want, "%s: %d-row passes (max_rows %d, rows %d)", label,
        want, ou->max_rows, p->R);
  if (rep == 2)
    CHECK(memcmp(first, got, bytes) == 0, "%s: the %d-row kernel's output bitwise the other's",
          label, want);
}

static void run_case(const dcase *c, const problem *p, const run_cfg *cfgs, int ncfg) {
  const moelink_dtype_t dt = c->dt;
  const int n = c->n, k = c->k, R = p->R, E = p->E;
  const int lda1 = k + c->lda_pad, lda2 = n + c->lda_pad;
  const int dense = p->tiles == NULL;
  const int xrows = dense ? R : (p->tokens > 0 ? p->tokens : 1);
  char label[256];

  /* x [xrows, lda1], h [R, lda2]: padding NaN */
  double *x = xmalloc((size_t)xrows * k * sizeof(double));
  void *xh = xmalloc((size_t)xrows * lda1 * 2);
  for (int r = 0; r < xrows; ++r)
    for (int i = 0; i < lda1; ++i) {
      const double v = i < k ? rng_value(1.0) : NAN;
      if (i < k) x[(size_t)r * k + i] = v;
      ref_store(dt, xh, (size_t)r * lda1 + i, v);
    }
  double *h = xmalloc((size_t)(R ? R : 1) * n * sizeof(double));
  void *hh = xmalloc((size_t)(R ? R : 1) * lda2 * 2);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < lda2; ++i) {
      const int real = i < n && p->row_expert[r] >= 0;
      const double v = real ? rng_value(1.0) : NAN;
      if (i < n) h[(size_t)r * n + i] = real ? v : 0.0;
      ref_store(dt, hh, (size_t)r * lda2 + i, v);
    }
  const size_t w1n = (size_t)E * 2 * n * k, w2n = (size_t)E * k * n;
  double *w1 = xmalloc(w1n * sizeof(double)), *w2 = xmalloc(w2n * sizeof(double));
  void *w1h = xmalloc(w1n * 2), *w2h = xmalloc(w2n * 2);
  const double s1 = pow2_scale(k), s2 = pow2_scale(n);
  for (size_t i = 0; i < w1n; ++i) ref_store(dt, w1h, i, w1[i] = rng_value(s1));
  for (size_t i = 0; i < w2n; ++i) ref_store(dt, w2h, i, w2[i] = rng_value(s2));
  /* routing weights per pair (dense: per row), scale s(r) = w[index[r]] */
  const int nscale = dense ? (R ? R : 1) : (p->pairs ? p->pairs : 1);
  float *wts = xmalloc((size_t)nscale * sizeof(float));
  for (int i = 0; i < nscale; ++i) wts[i] = (float)((rng_next() % 1000 + 1) / 1024.0);

  /* references and tolerances */
  double *ref1 = xmalloc((size_t)(R ? R : 1) * n * sizeof(double));
  double *tol1 = xmalloc((size_t)(R ? R : 1) * n * sizeof(double));
  double *ref2 = xmalloc((size_t)(R ? R : 1) * k * sizeof(double));
  double *tol2 = xmalloc((size_t)(R ? R : 1) * k * sizeof(double));
  for (int r = 0; r < R; ++r) {
    const int e = p->row_expert[r];
    if (e < 0) continue;
    const double *xr = x + (size_t)(dense ? r : p->index[r] / p->top_k) * k;
    for (int j = 0; j < n; ++j) {
      const double *g = w1 + ((size_t)e * 2 * n + j) * k, *u = g + (size_t)n * k;
      double sg = 0, su = 0, mg = 0, mu = 0;
      for (int i = 0; i < k; ++i) {
        sg += xr[i] * g[i];
        su += xr[i] * u[i];
        mg += fabs(xr[i] * g[i]);
        mu += fabs(xr[i] * u[i]);
      }
      const double silu = sg / (1.0 + exp(-sg)), v = silu * su;
      ref1[(size_t)r * n + j] = v;
      tol1[(size_t)r * n + j] = EL_REL * fabs(v) + EL_ABS * (mg * (fabs(su) + mu) + mu * fabs(silu));
    }
    const double sc = dense ? 1.0 : wts[p->index[r]];
    const double *hr = h + (size_t)r * n;
    for (int j = 0; j < k; ++j) {
      const double *w = w2 + ((size_t)e * k + j) * n;
      double s = 0, m = 0;
      for (int i = 0; i < n; ++i) {
        s += hr[i] * w[i];
        m += fabs(hr[i] * w[i]);
      }
      ref2[(size_t)r * k + j] = sc * s;
      tol2[(size_t)r * k + j] = EL_REL * fabs(sc * s) + EL_ABS * sc * m;
    }
  }

  /* device */
  void *d_x = dev_copy(xh, (size_t)xrows * lda1 * 2), *d_h = dev_copy(hh, (size_t)R * lda2 * 2);
  void *d_w1 = dev_copy(w1h, w1n * 2), *d_w2 = dev_copy(w2h, w2n * 2);
  float *d_wts = dev_copy(wts, (size_t)nscale * sizeof(float));
  int32_t *d_index = NULL, *d_tiles = NULL, *d_num = NULL;
  if (!dense) {
    d_index = dev_copy(p->index, (size_t)R * sizeof(int32_t));
    d_tiles = dev_copy(p->tiles, (size_t)3 * p->max_passes * sizeof(int32_t));
    d_num = dev_copy(&p->num_tiles, sizeof(int32_t));
  }
  /* scratch for up to 16 splits */
  const int passes = dense ? ml_cuda_decode_passes(R, 1) : p->max_passes;
  const size_t pfloats = (size_t)16 * (R ? R : 1) * (size_t)(2 * n > k ? 2 * n : k);
  /* (x 4: tiles cut into 16-row passes, ML_DECODE_NARROW) */
  const size_t nticket = (size_t)4 * passes * (size_t)((2 * n + k) / 64 + 2);
  float *d_part = dev_alloc(pfloats * sizeof(float));
  uint32_t *d_tick = dev_alloc(nticket * sizeof(uint32_t));
  CUDA_CHECK(cudaMemset(d_tick, 0, nticket * sizeof(uint32_t)));
  const size_t o1 = (size_t)(R + GUARD_ROWS) * n * 2, o2 = (size_t)(R + GUARD_ROWS) * k * 4;
  void *d_o1 = dev_alloc(o1), *d_o2 = dev_alloc(o2);
  unsigned char *got = xmalloc(o2 > o1 ? o2 : o1), *first = xmalloc(o2 > o1 ? o2 : o1);
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int32_t *ai = dense ? NULL : d_index;
  const float *rs = dense ? NULL : d_wts;

  for (int ci = 0; ci < ncfg; ++ci) {
    ml_decode_opts o;
    memset(&o, 0, sizeof o);
    o.sm_count = g_sm_count;
    o.flags = cfgs[ci].flags;
    o.splits = cfgs[ci].splits;
    o.partials = d_part;
    o.partial_floats = pfloats;
    o.tickets = d_tick;
    o.ticket_count = nticket;
    /* odd configurations give the exact bound on a tile's rows */
    o.max_rows = (ci & 1) ? max_tile_rows(p) : 0;
    const int pol1 = ml_cuda_decode_policy_splits(1, n, k, passes, g_sm_count);
    const int pol2 = ml_cuda_decode_policy_splits(0, k, n, passes, g_sm_count);
    char cfgname[96];
    snprintf(cfgname, sizeof cfgname, "splits %d%s%s, max_rows %d", o.splits,
             o.splits ? "" : " (policy)", (o.flags & ML_DECODE_PDL) ? ", PDL" : "", o.max_rows);
    if (o.splits == 0)
      ml_t_diag("%s: policy splits gate/up %d, down %d", c->name, pol1, pol2);

    /* swiglu, twice (and with 64-row passes: pass_run) */
    for (int rep = 0; rep < 3; ++rep) {
      ml_decode_opts ou;
      if (!pass_run(p, &o, rep, &ou))
        break;
      CUDA_CHECK(cudaMemsetAsync(d_o1, 0xFF, o1, st));
      snprintf(label, sizeof label, "%s swiglu %s run %d", c->name, cfgname, rep);
      CHECK_OK(ml_cuda_decode_swiglu(dt, d_x, lda1, ai, p->top_k, d_w1, n, k, d_tiles, d_num,
                                     passes, R, d_o1, &ou, st),
               label);
      CUDA_CHECK(cudaStreamSynchronize(st));
      CUDA_CHECK(cudaMemcpy(rep ? got : first, d_o1, o1, cudaMemcpyDeviceToHost));
      pass_check(label, p, &ou, rep, first, got, o1);
      if (rep == 1)
        CHECK(memcmp(first, got, o1) == 0, "%s: two runs bitwise equal", label);
    }
    snprintf(label, sizeof label, "%s swiglu (%s, n %d, k %d, %s)", c->name,
             moelink_dtype_name(dt), n, k, cfgname);
    check_output(label, p, n, first, dt, 0, ref1, tol1, L2_TOL);

    /* scaled (after the swiglu of the same stream: the tile list may be
     * read early under PDL) */
    ml_decode_opts oe = o;
    oe.flags |= ML_DECODE_PLAN_EARLY;
    for (int f32 = 0; f32 <= c->scaled_f32; ++f32) {
      const size_t bytes = (size_t)(R + GUARD_ROWS) * k * (f32 ? 4 : 2);
      for (int rep = 0; rep < 3; ++rep) {
        ml_decode_opts ou;
        if (!pass_run(p, &oe, rep, &ou))
          break;
        CUDA_CHECK(cudaMemsetAsync(d_o2, 0xFF, bytes, st));
        snprintf(label, sizeof label, "%s scaled%s %s run %d", c->name, f32 ? " f32" : "", cfgname,
                 rep);
        CHECK_OK(ml_cuda_decode_scaled(dt, d_h, lda2, d_w2, k, n, d_tiles, d_num, passes, R, rs, ai,
                                       d_o2, f32, &ou, st),
                 label);
        CUDA_CHECK(cudaStreamSynchronize(st));
        CUDA_CHECK(cudaMemcpy(rep ? got : first, d_o2, bytes, cudaMemcpyDeviceToHost));
        pass_check(label, p, &ou, rep, first, got, bytes);
        if (rep == 1)
          CHECK(memcmp(first, got, bytes) == 0, "%s: two runs bitwise equal", label);
      }
      snprintf(label, sizeof label, "%s scaled%s (%s, n %d, k %d, %s)", c->name,
               f32 ? " f32" : "", moelink_dtype_name(dt), k, n, cfgname);
      check_output(label, p, k, first, dt, f32, ref2, tol2, L2_TOL);
      if (f32)
        continue;
      /* the same launch with its rows stored through out_rows (row r to row
       * R - 1 - r of another buffer): the plain run's rows, nothing else */
      gu_rows t = gu_rows_make(p->row_expert, dense ? NULL : p->index, 0, R, (size_t)k * 2);
      ml_decode_opts orow = oe;
      orow.out_rows = (void *const *)t.d_table;
      gu_rows_poison(&t, d_o2, bytes, st);
      snprintf(label, sizeof label, "%s scaled into rows by pointer (%s)", c->name, cfgname);
      CHECK_OK(ml_cuda_decode_scaled(dt, d_h, lda2, d_w2, k, n, d_tiles, d_num, passes, R, rs, ai,
                                     d_o2, 0, &orow, st),
               label);
      gu_rows_verify(label, &t, p->row_expert, first, d_o2, got, bytes, st);
      gu_rows_free(&t);
    }

    if (c->graph && ci == ncfg - 1) {
      /* the pair as the layer issues it, captured, replayed: same bits as
       * the direct runs above (first holds the scaled output of the last
       * direct run in the dtype) */
      unsigned char *g1 = xmalloc(o1), *g2 = xmalloc(o2);
      unsigned char *d1 = xmalloc(o1);
      CUDA_CHECK(cudaMemsetAsync(d_o1, 0xFF, o1, st));
      CHECK_OK(ml_cuda_decode_swiglu(dt, d_x, lda1, ai, p->top_k, d_w1, n, k, d_tiles, d_num,
                                     passes, R, d_o1, &o, st),
               "direct swiglu before the graph");
      CUDA_CHECK(cudaStreamSynchronize(st));
      CUDA_CHECK(cudaMemcpy(d1, d_o1, o1, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemsetAsync(d_o1, 0xFF, o1, st));
      CUDA_CHECK(cudaMemsetAsync(d_o2, 0xFF, o2, st));
      CUDA_CHECK(cudaStreamSynchronize(st));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      moelink_status_t c1 = ml_cuda_decode_swiglu(dt, d_x, lda1, ai, p->top_k, d_w1, n, k,
                                                  d_tiles, d_num, passes, R, d_o1, &o, st);
      moelink_status_t c2 = ml_cuda_decode_scaled(dt, d_h, lda2, d_w2, k, n, d_tiles, d_num,
                                                  passes, R, rs, ai, d_o2, 0, &oe, st);
      CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      CHECK(c1 == MOELINK_SUCCESS && c2 == MOELINK_SUCCESS, "%s: both GEMMs captured (%s)",
            c->name, c1 || c2 ? moelink_last_error() : "ok");
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int rep = 0; rep < 3; ++rep) CUDA_CHECK(cudaGraphLaunch(exec, st));
      CUDA_CHECK(cudaStreamSynchronize(st));
      CUDA_CHECK(cudaMemcpy(g1, d_o1, o1, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(g2, d_o2, (size_t)(R + GUARD_ROWS) * k * 2, cudaMemcpyDeviceToHost));
      CHECK(memcmp(g1, d1, o1) == 0, "%s: graph replay of swiglu bitwise equal to a direct run",
            c->name);
      /* the direct scaled output in the dtype was the last f32 == 0 run: redo it */
      CUDA_CHECK(cudaMemsetAsync(d_o2, 0xFF, o2, st));
      CHECK_OK(ml_cuda_decode_scaled(dt, d_h, lda2, d_w2, k, n, d_tiles, d_num, passes, R, rs,
                                     ai, d_o2, 0, &oe, st),
               "direct scaled after the graph");
      CUDA_CHECK(cudaStreamSynchronize(st));
      CUDA_CHECK(cudaMemcpy(got, d_o2, (size_t)(R + GUARD_ROWS) * k * 2,
                            cudaMemcpyDeviceToHost));
      CHECK(memcmp(g2, got, (size_t)(R + GUARD_ROWS) * k * 2) == 0,
            "%s: graph replay of scaled bitwise equal to a direct run", c->name);
      CUDA_CHECK(cudaGraphExecDestroy(exec));
      CUDA_CHECK(cudaGraphDestroy(graph));
      free(g1);
      free(g2);
      free(d1);
    }
  }

  /* every launch leaves its tickets at zero */
  uint32_t *tick = xmalloc(nticket * sizeof(uint32_t));
  CUDA_CHECK(cudaMemcpy(tick, d_tick, nticket * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  long nonzero = 0;
  for (size_t i = 0; i < nticket; ++i) nonzero += tick[i] != 0;
  CHECK(nonzero == 0, "%s: split-K tickets back at zero (%ld are not)", c->name, nonzero);
  free(tick);

  CUDA_CHECK(cudaStreamDestroy(st));
  cudaFree(d_x), cudaFree(d_h), cudaFree(d_w1), cudaFree(d_w2), cudaFree(d_wts);
  cudaFree(d_index), cudaFree(d_tiles), cudaFree(d_num), cudaFree(d_part), cudaFree(d_tick);
  cudaFree(d_o1), cudaFree(d_o2);
  free(x), free(xh), free(h), free(hh), free(w1), free(w2), free(w1h), free(w2h), free(wts);
  free(ref1), free(tol1), free(ref2), free(tol2), free(got), free(first);
}

/* ---- FP8 operands (ml_cuda_fp8_swiglu, ml_cuda_fp8_scaled) ------------------------------ */

/* Tolerances. The fp8 MMA adds its products keeping about 13 fraction bits
 * below the largest addend (published models of the H100's tensor cores:
 * truncated toward zero) before a 128-wide block sum reaches fp32, and random
 * codes span 35 binades, so the largest products swallow the low bits of the
 * rest. A host model of that arithmetic on codes like these (k 384..2048,
 * 4000 dot products) gave at most 3.7e-4 x the sum of |terms| and rel L2
 * 2.3e-4; run through this file's cases (an emulation of both launchers) it
 * stayed at 0.5x the bounds of the bf16 cases, bf16 output rounding
 * dominating the L2 (1.8e-3). Were the truncation toward -inf instead, its
 * bias would add up: 3.4e-3 x the sum of |terms| and rel L2 7.5e-3 in the
 * same runs. The bounds cover that too (2.3x and 2x): per element EL_REL
 * (output rounding) plus 2^-7 x the sum of |terms|, and 1.5e-2 over all
 * owned elements. A misread scale block, split, tile or row scale is off by
 * far more (one k block's scale taken from another block: rel L2 ~0.9). */
#define FP8_EL_ABS (1.0 / 128)
#define FP8_L2_TOL 1.5e-2

static double g_e4m3[256]; /* code -> value (the reference's decoder) */
static double g_e4m3_rms;  /* rms over the finite codes */

static void fp8_tables(void) {
  double s2 = 0.0;
  for (int b = 0; b < 256; ++b) {
    const uint8_t c = (uint8_t)b;
    g_e4m3[b] = ref_load(MOELINK_DTYPE_FP8_E4M3, &c, 0);
    if ((b & 0x7f) != 0x7f) s2 += g_e4m3[b] * g_e4m3[b];
  }
  g_e4m3_rms = sqrt(s2 / 254.0);
}

/* Any code but the two NaNs. */
static uint8_t rng_e4m3(void) {
  uint8_t b;
  do b = (uint8_t)(rng_next() & 0xff);
  while ((b & 0x7f) == 0x7f);
  return b;
}

/* A block scale around base: base x 2^[-2, 2] x (1 + m / 256), fp32, and
 * one block in 13 zero. */
static float rng_fp8_scale(double base) {
  if (rng_next() % 13 == 0) return 0.0f;
  return (float)(ldexp(base, (int)(rng_next() % 5) - 2) * (1.0 + (rng_next() % 256) / 256.0));
}

/* sum over 128-wide blocks of sa[kb] x sb[kb] x dot(qa, qb) of the block, and
 * the sum of |terms| beside it. */
static double fp8_dot(const uint8_t *qa, const float *sa, const uint8_t *qb, const float *sb,
                      int k, double *mag) {
  double s = 0.0, m = 0.0;
  for (int kb = 0; kb < k / 128; ++kb) {
    const double sc = (double)sa[kb] * (double)sb[kb];
    double d = 0.0, a = 0.0;
    for (int i = kb * 128; i < (kb + 1) * 128; ++i) {
      const double t = g_e4m3[qa[i]] * g_e4m3[qb[i]];
      d += t;
      a += fabs(t);
    }
    s += sc * d;
    m += fabs(sc) * a;
  }
  *mag = m;
  return s;
}

typedef struct fcase {
  const char *name;
  moelink_dtype_t dt; /* output dtype */
  int n, k;           /* swiglu: out [R, n], W1 [E, 2n, k]; scaled: out [R, k], W2 [E, k, n] */
  int lda_pad;        /* 0 or 128: extra bytes per activation row (NaN codes, NaN scale) */
  int f32;            /* also run both GEMMs with fp32 output */
  int dense_scale;    /* dense problems: row_scale[r] without scale_index */
} fcase;

/* The device operands of an FP8 case. */
typedef struct fp8_dev {
  const uint8_t *x, *w1;
  const float *xs, *w1s;
  const int32_t *index, *tiles, *num;
  int lda1;
} fp8_dev;

/* The fp32 SwiGLU (first: its output, bytes long) again with its FP8 copy
 * made by the kernel (ml_decode_opts.q_out): the fp32 output bitwise as
 * before; on the owned rows the e4m3 bytes and scales bitwise those of
 * ml_cuda_quantize on that output; the other rows' bytes and scales still
 * poisoned. */
static void check_q_out(const fcase *c, const problem *p, const ml_decode_opts *o,
                        const fp8_dev *d, void *d_out, const unsigned char *first, size_t bytes,
                        int passes, cudaStream_t st) {
  const int n = c->n, k = c->k, R = p->R, rows = R + GUARD_ROWS;
  const size_t qn = (size_t)rows * n, sn = (size_t)rows * (n / 128);
  uint8_t *d_q = dev_alloc(qn), *d_qr = dev_alloc(qn);
  float *d_s = dev_alloc(sn * 4), *d_sr = dev_alloc(sn * 4);
  uint8_t *q = xmalloc(qn), *qr = xmalloc(qn);
  float *s = xmalloc(sn * 4), *sr = xmalloc(sn * 4);
  unsigned char *got = xmalloc(bytes);
  char label[256];
  snprintf(label, sizeof label, "%s fp8 swiglu with its e4m3 copy (n %d, k %d, splits %d%s%s)",
           c->name, n, k, o->splits, (o->flags & ML_DECODE_PDL) ? ", PDL" : "",
           (o->flags & ML_DECODE_NARROW) ? ", 16-row passes" : "");
  ml_decode_opts oq = *o;
  oq.q_out = d_q;
  oq.q_scale = d_s;
  gu_q_diff qd = {0, 0, 0, 0};
  for (int rep = 0; rep < 2; ++rep) {
    CUDA_CHECK(cudaMemsetAsync(d_q, 0xA5, qn, st));
    CUDA_CHECK(cudaMemsetAsync(d_s, 0xFF, sn * 4, st));
    CUDA_CHECK(cudaMemsetAsync(d_out, 0xFF, bytes, st));
    CHECK_OK(ml_cuda_fp8_swiglu(MOELINK_DTYPE_F32, d->x, d->xs, d->lda1, d->index, p->top_k,
                                d->w1, d->w1s, n, k, d->tiles, d->num, passes, R, d_out, &oq, st),
             label);
    CUDA_CHECK(cudaStreamSynchronize(st));
    CUDA_CHECK(cudaMemcpy(got, d_out, bytes, cudaMemcpyDeviceToHost));
    CHECK(memcmp(got, first, bytes) == 0, "%s run %d: the fp32 output bitwise as without it",
          label, rep);
    CHECK_OK(ml_cuda_quantize(MOELINK_QUANT_FP8, MOELINK_DTYPE_F32, d_out, R, n, d_qr, d_sr,
                              g_sm_count, st),
             "quantize the fp32 output");
    CUDA_CHECK(cudaStreamSynchronize(st));
    CUDA_CHECK(cudaMemcpy(q, d_q, qn, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(qr, d_qr, qn, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(s, d_s, sn * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(sr, d_sr, sn * 4, cudaMemcpyDeviceToHost));
    gu_q_compare(p->row_expert, R, rows, n, q, qr, s, sr, &qd);
  }
  CHECK(qd.owned > 0 && qd.bad_q == 0 && qd.bad_s == 0,
        "%s: bytes and scales of the owned rows bitwise moelink_quantize's of the fp32 output, "
        "two runs (%ld owned rows compared, %ld bytes, %ld scales differ)",
        label, qd.owned, qd.bad_q, qd.bad_s);
  CHECK(qd.poison == 0, "%s: rows no tile owns keep their poison (%ld changed)", label, qd.poison);
  cudaFree(d_q), cudaFree(d_qr), cudaFree(d_s), cudaFree(d_sr);
  free(q), free(qr), free(s), free(sr), free(got);
}

static void run_fp8_case(const fcase *c, const problem *p, const run_cfg *cfgs, int ncfg) {
  const moelink_dtype_t dt = c->dt;
  const int n = c->n, k = c->k, R = p->R, E = p->E;
  const int lda1 = k + c->lda_pad, lda2 = n + c->lda_pad;
  const int ls1 = lda1 / 128, ls2 = lda2 / 128; /* scales per activation row */
  const int dense = p->tiles == NULL;
  const int xrows = dense ? R : (p->tokens > 0 ? p->tokens : 1);
  const int hrows = R ? R : 1;
  char label[256];

  /* activations: codes around 1 after scaling; padding and the rows no tile
   * owns (h) are NaN codes with NaN scales */
  const double abase = 1.0 / g_e4m3_rms;
  uint8_t *xq = xmalloc((size_t)xrows * lda1), *hq = xmalloc((size_t)hrows * lda2);
  float *xs = xmalloc((size_t)xrows * ls1 * sizeof(float));
  float *hs = xmalloc((size_t)hrows * ls2 * sizeof(float));
  for (int r = 0; r < xrows; ++r) {
    for (int i = 0; i < lda1; ++i) xq[(size_t)r * lda1 + i] = i < k ? rng_e4m3() : 0x7f;
    for (int b = 0; b < ls1; ++b)
      xs[(size_t)r * ls1 + b] = b < k / 128 ? rng_fp8_scale(abase) : NAN;
  }
  for (int r = 0; r < hrows; ++r) {
    const int real = r < R && p->row_expert[r] >= 0;
    for (int i = 0; i < lda2; ++i) hq[(size_t)r * lda2 + i] = real && i < n ? rng_e4m3() : 0xff;
    for (int b = 0; b < ls2; ++b)
      hs[(size_t)r * ls2 + b] = real && b < n / 128 ? rng_fp8_scale(abase) : NAN;
  }
  /* weights: dot products of order 1 over k (n) */
  const size_t w1n = (size_t)E * 2 * n * k, w2n = (size_t)E * k * n;
  const size_t s1n = w1n / (128 * 128), s2n = w2n / (128 * 128);
  uint8_t *w1q = xmalloc(w1n), *w2q = xmalloc(w2n);
  float *w1s = xmalloc(s1n * sizeof(float)), *w2s = xmalloc(s2n * sizeof(float));
  for (size_t i = 0; i < w1n; ++i) w1q[i] = rng_e4m3();
  for (size_t i = 0; i < w2n; ++i) w2q[i] = rng_e4m3();
  for (size_t i = 0; i < s1n; ++i) w1s[i] = rng_fp8_scale(abase / sqrt((double)k));
  for (size_t i = 0; i < s2n; ++i) w2s[i] = rng_fp8_scale(abase / sqrt((double)n));
  const int nscale = dense ? hrows : (p->pairs ? p->pairs : 1);
  float *wts = xmalloc((size_t)nscale * sizeof(float));
  for (int i = 0; i < nscale; ++i) wts[i] = (float)((rng_next() % 1000 + 1) / 1024.0);
  const int use_rs = !dense || c->dense_scale;

  /* references from the dequantized operands (code value x scale) */
  double *ref1 = xmalloc((size_t)hrows * n * sizeof(double));
  double *tol1 = xmalloc((size_t)hrows * n * sizeof(double));
  double *ref2 = xmalloc((size_t)hrows * k * sizeof(double));
  double *tol2 = xmalloc((size_t)hrows * k * sizeof(double));
  for (int r = 0; r < R; ++r) {
    const int e = p->row_expert[r];
    if (e < 0) continue;
    const int g = dense ? r : p->index[r] / p->top_k;
    const uint8_t *xr = xq + (size_t)g * lda1;
    const float *xsr = xs + (size_t)g * ls1;
    for (int j = 0; j < n; ++j) {
      /* the b scales of gate row j and up row n + j */
      const uint8_t *gq = w1q + ((size_t)e * 2 * n + j) * k, *uq = gq + (size_t)n * k;
      const float *gs = w1s + ((size_t)e * (2 * n / 128) + j / 128) * (k / 128);
      const float *us = w1s + ((size_t)e * (2 * n / 128) + (n + j) / 128) * (k / 128);
      double mg = 0, mu = 0;
      const double sg = fp8_dot(xr, xsr, gq, gs, k, &mg), su = fp8_dot(xr, xsr, uq, us, k, &mu);
      const double silu = sg / (1.0 + exp(-sg)), v = silu * su;
      ref1[(size_t)r * n + j] = v;
      tol1[(size_t)r * n + j] =
          EL_REL * fabs(v) + FP8_EL_ABS * (mg * (fabs(su) + mu) + mu * fabs(silu));
    }
    const double sc = use_rs ? wts[dense ? r : p->index[r]] : 1.0;
    const uint8_t *hr = hq + (size_t)r * lda2;
    const float *hsr = hs + (size_t)r * ls2;
    for (int j = 0; j < k; ++j) {
      const uint8_t *wq = w2q + ((size_t)e * k + j) * n;
      const float *ws = w2s + ((size_t)e * (k / 128) + j / 128) * (n / 128);
      double m = 0;
      const double s = fp8_dot(hr, hsr, wq, ws, n, &m);
      ref2[(size_t)r * k + j] = sc * s;
      tol2[(size_t)r * k + j] = EL_REL * fabs(sc * s) + FP8_EL_ABS * sc * m;
    }
  }

  /* device */
  uint8_t *d_x = dev_copy(xq, (size_t)xrows * lda1), *d_h = dev_copy(hq, (size_t)hrows * lda2);
  float *d_xs = dev_copy(xs, (size_t)xrows * ls1 * sizeof(float));
  float *d_hs = dev_copy(hs, (size_t)hrows * ls2 * sizeof(float));
  uint8_t *d_w1 = dev_copy(w1q, w1n), *d_w2 = dev_copy(w2q, w2n);
  float *d_w1s = dev_copy(w1s, s1n * sizeof(float)), *d_w2s = dev_copy(w2s, s2n * sizeof(float));
  float *d_wts = dev_copy(wts, (size_t)nscale * sizeof(float));
  int32_t *d_index = NULL, *d_tiles = NULL, *d_num = NULL;
  if (!dense) {
    d_index = dev_copy(p->index, (size_t)R * sizeof(int32_t));
    d_tiles = dev_copy(p->tiles, (size_t)3 * p->max_passes * sizeof(int32_t));
    d_num = dev_copy(&p->num_tiles, sizeof(int32_t));
  }
  /* scratch for up to 16 splits */
  const int passes = dense ? ml_cuda_decode_passes(R, 1) : p->max_passes;
  const size_t pfloats = (size_t)16 * hrows * (size_t)(2 * n > k ? 2 * n : k);
  const size_t nticket = (size_t)4 * (passes > 0 ? passes : 1) * (size_t)((2 * n + k) / 64 + 2);
  float *d_part = dev_alloc(pfloats * sizeof(float));
  uint32_t *d_tick = dev_alloc(nticket * sizeof(uint32_t));
  CUDA_CHECK(cudaMemset(d_tick, 0, nticket * sizeof(uint32_t)));
  const size_t o1 = (size_t)(R + GUARD_ROWS) * n * 4, o2 = (size_t)(R + GUARD_ROWS) * k * 4;
  void *d_o1 = dev_alloc(o1), *d_o2 = dev_alloc(o2);
  unsigned char *got = xmalloc(o2 > o1 ? o2 : o1), *first = xmalloc(o2 > o1 ? o2 : o1);
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int32_t *ai = dense ? NULL : d_index;
  const float *rs = use_rs ? d_wts : NULL;
  const fp8_dev fd = {d_x, d_w1, d_xs, d_w1s, ai, d_tiles, d_num, lda1};

  for (int ci = 0; ci < ncfg; ++ci) {
    ml_decode_opts o;
    memset(&o, 0, sizeof o);
    o.sm_count = g_sm_count;
    o.flags = cfgs[ci].flags;
    o.splits = cfgs[ci].splits;
    o.partials = d_part;
    o.partial_floats = pfloats;
    o.tickets = d_tick;
    o.ticket_count = nticket;
    o.max_rows = (ci & 1) ? max_tile_rows(p) : 0;
    char cfgname[96];
    snprintf(cfgname, sizeof cfgname, "splits %d%s%s, max_rows %d", o.splits,
             o.splits ? "" : " (policy)", (o.flags & ML_DECODE_PDL) ? ", PDL" : "", o.max_rows);

    /* swiglu into the dtype, and into fp32 (out_dt f32, as the FP8 layer
     * keeps its SwiGLU rows until they are quantized) */
    for (int f32 = 0; f32 <= c->f32; ++f32) {
      const moelink_dtype_t odt = f32 ? MOELINK_DTYPE_F32 : dt;
      const size_t bytes = (size_t)(R + GUARD_ROWS) * n * (f32 ? 4 : 2);
      for (int rep = 0; rep < 3; ++rep) {
        ml_decode_opts ou;
        if (!pass_run(p, &o, rep, &ou))
          break;
        CUDA_CHECK(cudaMemsetAsync(d_o1, 0xFF, bytes, st));
        snprintf(label, sizeof label, "%s fp8 swiglu%s %s run %d", c->name, f32 ? " f32" : "",
                 cfgname, rep);
        CHECK_OK(ml_cuda_fp8_swiglu(odt, d_x, d_xs, lda1, ai, p->top_k, d_w1, d_w1s, n, k, d_tiles,
                                    d_num, passes, R, d_o1, &ou, st),
                 label);
        CUDA_CHECK(cudaStreamSynchronize(st));
        CUDA_CHECK(cudaMemcpy(rep ? got : first, d_o1, bytes, cudaMemcpyDeviceToHost));
        pass_check(label, p, &ou, rep, first, got, bytes);
        if (rep == 1)
          CHECK(memcmp(first, got, bytes) == 0, "%s: two runs bitwise equal", label);
      }
      snprintf(label, sizeof label, "%s fp8 swiglu (-> %s, n %d, k %d, lda %d, %s)", c->name,
               moelink_dtype_name(odt), n, k, lda1, cfgname);
      check_output(label, p, n, first, dt, f32, ref1, tol1, FP8_L2_TOL);
      if (f32) check_q_out(c, p, &o, &fd, d_o1, first, bytes, passes, st);
    }

    /* the tile list may be read early: a decode launch on it came first */
    ml_decode_opts oe = o;
    oe.flags |= ML_DECODE_PLAN_EARLY;
    for (int f32 = 0; f32 <= c->f32; ++f32) {
      const size_t bytes = (size_t)(R + GUARD_ROWS) * k * (f32 ? 4 : 2);
      for (int rep = 0; rep < 3; ++rep) {
        ml_decode_opts ou;
        if (!pass_run(p, &oe, rep, &ou))
          break;
        CUDA_CHECK(cudaMemsetAsync(d_o2, 0xFF, bytes, st));
        snprintf(label, sizeof label, "%s fp8 scaled%s %s run %d", c->name, f32 ? " f32" : "",
                 cfgname, rep);
        CHECK_OK(ml_cuda_fp8_scaled(dt, d_h, d_hs, lda2, d_w2, d_w2s, k, n, d_tiles, d_num, passes,
                                    R, rs, ai, d_o2, f32, &ou, st),
                 label);
        CUDA_CHECK(cudaStreamSynchronize(st));
        CUDA_CHECK(cudaMemcpy(rep ? got : first, d_o2, bytes, cudaMemcpyDeviceToHost));
        pass_check(label, p, &ou, rep, first, got, bytes);
        if (rep == 1)
          CHECK(memcmp(first, got, bytes) == 0, "%s: two runs bitwise equal", label);
      }
      snprintf(label, sizeof label, "%s fp8 scaled (-> %s, n %d, k %d, lda %d, %s%s)", c->name,
               f32 ? "f32" : moelink_dtype_name(dt), k, n, lda2, cfgname,
               rs ? (ai ? ", row scale by pair" : ", row scale by row") : "");
      check_output(label, p, k, first, dt, f32, ref2, tol2, FP8_L2_TOL);
    }
  }

  uint32_t *tick = xmalloc(nticket * sizeof(uint32_t));
  CUDA_CHECK(cudaMemcpy(tick, d_tick, nticket * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  long nonzero = 0;
  for (size_t i = 0; i < nticket; ++i) nonzero += tick[i] != 0;
  CHECK(nonzero == 0, "%s fp8: split-K tickets back at zero (%ld are not)", c->name, nonzero);
  free(tick);

  CUDA_CHECK(cudaStreamDestroy(st));
  cudaFree(d_x), cudaFree(d_h), cudaFree(d_xs), cudaFree(d_hs), cudaFree(d_w1), cudaFree(d_w2);
  cudaFree(d_w1s), cudaFree(d_w2s), cudaFree(d_wts), cudaFree(d_index), cudaFree(d_tiles);
  cudaFree(d_num), cudaFree(d_part), cudaFree(d_tick), cudaFree(d_o1), cudaFree(d_o2);
  free(xq), free(hq), free(xs), free(hs), free(w1q), free(w2q), free(w1s), free(w2s), free(wts);
  free(ref1), free(tol1), free(ref2), free(tol2), free(got), free(first);
}

static void check_fp8_rejections(void) {
  char *d = dev_alloc(1 << 16);
  const uint8_t *q = (const uint8_t *)d;
  const float *sc = (const float *)(d + 32768);
  int32_t *num = (int32_t *)(d + 60000);
  ml_decode_opts o;
  memset(&o, 0, sizeof o);
  o.sm_count = g_sm_count;
  const moelink_dtype_t bf = MOELINK_DTYPE_BF16;
  /* shapes: the scale blocks need n, k and lda in multiples of 128 */
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, sc, 256, NULL, 1, q, sc, 128, 136, NULL, NULL, 0, 4, d,
                                  &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 swiglu k 136");
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, sc, 128, NULL, 1, q, sc, 136, 128, NULL, NULL, 0, 4, d,
                                  &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 swiglu n 136");
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, sc, 128, q, sc, 128, 64, NULL, NULL, 0, 4, NULL, NULL, d,
                                  0, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 scaled k 64");
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, sc, 128, q, sc, 200, 128, NULL, NULL, 0, 4, NULL, NULL,
                                  d, 0, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 scaled n 200");
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, sc, 200, q, sc, 128, 128, NULL, NULL, 0, 4, NULL, NULL,
                                  d, 0, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 scaled lda 200");
  /* an FP8 copy of the output (q_out): the SwiGLU into fp32 only, with its
   * scales and tickets */
  {
    const moelink_dtype_t f32 = MOELINK_DTYPE_F32;
    ml_decode_opts oq = o;
    oq.q_out = (uint8_t *)d + 4096;
    oq.q_scale = (float *)(d + 40960);
    CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, d,
                                    &oq, 0),
                 MOELINK_ERR_UNSUPPORTED, "fp8 swiglu into bf16 with q_out");
    CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, sc, 128, q, sc, 128, 128, NULL, NULL, 0, 4, NULL, NULL,
                                    d, 0, &oq, 0),
                 MOELINK_ERR_UNSUPPORTED, "fp8 scaled with q_out");
    CHECK_STATUS(ml_cuda_fp8_swiglu(f32, q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, d,
                                    &oq, 0),
                 MOELINK_ERR_INTERNAL, "fp8 swiglu with q_out and no tickets");
    oq.q_scale = NULL;
    CHECK_STATUS(ml_cuda_fp8_swiglu(f32, q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, d,
                                    &oq, 0),
                 MOELINK_ERR_INVALID_ARGUMENT, "fp8 swiglu with q_out and no q_scale");
    oq.q_scale = (float *)(d + 40960);
    oq.q_out = (uint8_t *)d + 4100;
    CHECK_STATUS(ml_cuda_fp8_swiglu(f32, q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, d,
                                    &oq, 0),
                 MOELINK_ERR_INVALID_ARGUMENT, "fp8 swiglu with a misaligned q_out");
  }
  /* scales are required */
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, NULL, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, d,
                                  &o, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "fp8 swiglu without a_scale");
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, sc, 128, NULL, 1, q, NULL, 128, 128, NULL, NULL, 0, 4, d,
                                  &o, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "fp8 swiglu without b_scale");
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, NULL, 128, q, sc, 128, 128, NULL, NULL, 0, 4, NULL, NULL,
                                  d, 0, &o, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "fp8 scaled without a_scale");
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, sc, 128, q, NULL, 128, 128, NULL, NULL, 0, 4, NULL, NULL,
                                  d, 0, &o, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "fp8 scaled without b_scale");
  /* alignment: operands 16 bytes, scales 4 */
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q + 8, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4,
                                  d, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 swiglu with a misaligned a");
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, sc, 128, NULL, 1, q + 4, sc, 128, 128, NULL, NULL, 0, 4,
                                  d, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 swiglu with a misaligned b");
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, sc, 128, q, sc, 128, 128, NULL, NULL, 0, 4, NULL, NULL,
                                  d + 2, 1, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 scaled with a misaligned out");
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, (const float *)(d + 32770), 128, q, sc, 128, 128, NULL,
                                  NULL, 0, 4, NULL, NULL, d, 0, &o, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "fp8 scaled with a misaligned a_scale");
  /* output dtype, options, gather, scratch */
  CHECK_STATUS(ml_cuda_fp8_scaled(MOELINK_DTYPE_F32, q, sc, 128, q, sc, 128, 128, NULL, NULL, 0,
                                  4, NULL, NULL, d, 0, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 scaled with out dtype f32 (fp32 output is out_f32)");
  CHECK_STATUS(ml_cuda_fp8_swiglu(MOELINK_DTYPE_FP8_E4M3, q, sc, 128, NULL, 1, q, sc, 128, 128,
                                  NULL, NULL, 0, 4, d, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "fp8 swiglu into e4m3");
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 4, d,
                                  NULL, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "fp8 swiglu without options");
  CHECK_STATUS(ml_cuda_fp8_swiglu(bf, q, sc, 128, num, 0, q, sc, 128, 128, NULL, NULL, 0, 4, d,
                                  &o, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "fp8 swiglu gathered with a_div 0");
  o.splits = 3;
  CHECK_STATUS(ml_cuda_fp8_scaled(bf, q, sc, 512, q, sc, 128, 512, (const int32_t *)d, num, 1, 4,
                                  NULL, NULL, d, 0, &o, 0),
               MOELINK_ERR_INTERNAL, "fp8 scaled with 3 splits and no scratch");
  o.splits = 0;
  CHECK_OK(ml_cuda_fp8_swiglu(bf, q, sc, 128, NULL, 1, q, sc, 128, 128, NULL, NULL, 0, 0, d, &o,
                              0),
           "fp8 swiglu with no rows does nothing");
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaFree(d);
}

static void fp8_cases(void) {
  fp8_tables();
  const run_cfg splits[] = {{1, 0}, {2, ML_DECODE_PDL}, {3, 0}, {0, ML_DECODE_PDL}};
  const run_cfg three[] = {{1, 0}, {3, ML_DECODE_PDL}, {0, ML_DECODE_PDL}};
  problem p;
  {
    /* odd expert sizes, an empty one first, unowned rows between experts;
     * k = 3 scale blocks, so 1, 2 and 3 splits all differ */
    const int counts[] = {0, 1, 5, 63, 64, 65, 200};
    problem_routed(&p, 7, counts, 2, 4, 0);
    const fcase bf = {"experts 0/1/5/63/64/65/200", MOELINK_DTYPE_BF16, 384, 384, 128, 1, 0};
    run_fp8_case(&bf, &p, splits, 4);
    const fcase f16 = {"experts 0/1/5/63/64/65/200", MOELINK_DTYPE_F16, 384, 384, 0, 1, 0};
    run_fp8_case(&f16, &p, three, 3);
    problem_free(&p);
  }
  {
    /* 1000 rows over five experts, two of them empty */
    const int counts[] = {0, 700, 0, 299, 1};
    problem_routed(&p, 5, counts, 0, 2, 0);
    const fcase c = {"1000 rows on 3 of 5 experts", MOELINK_DTYPE_BF16, 256, 256, 0, 1, 0};
    run_fp8_case(&c, &p, three, 3);
    problem_free(&p);
  }
  {
    /* one decode step of a k = 8 layer: 16 k blocks, the policy splits */
    const int counts[] = {1, 1, 1, 1, 1, 1, 1, 1};
    problem_routed(&p, 8, counts, 0, 8, ml_cuda_decode_passes(8, 8));
    const fcase bf = {"decode step k 8", MOELINK_DTYPE_BF16, 512, 2048, 0, 1, 0};
    const run_cfg cf[] = {{1, 0}, {3, ML_DECODE_PDL}, {0, ML_DECODE_PDL}, {16, 0}};
    run_fp8_case(&bf, &p, cf, 4);
    const fcase f16 = {"decode step k 8", MOELINK_DTYPE_F16, 512, 2048, 128, 0, 0};
    run_fp8_case(&f16, &p, three, 3);
    problem_free(&p);
  }
  {
    /* 16 tokens x 8 distinct experts of 64 (most experts empty) */
    int counts[64] = {0};
    count_distinct_routes(counts, 64, 16, 8);
    problem_routed(&p, 64, counts, 0, 8, ml_cuda_decode_passes(128, 64));
    const fcase c = {"16 tokens over 64 experts", MOELINK_DTYPE_BF16, 256, 512, 0, 1, 0};
    run_fp8_case(&c, &p, three, 3);
    problem_free(&p);
  }
  {
    /* up to 16 rows an expert (a 16-row pass full, one of 9: two n8
     * fragments), unowned rows between; the 16-row kernel where max_rows
     * says so, and for 13 dense rows */
    const int counts[] = {16, 9, 0, 13, 1};
    problem_routed(&p, 5, counts, 1, 2, 0);
    const fcase c = {"experts of 16/9/0/13/1 rows", MOELINK_DTYPE_BF16, 256, 384, 0, 1, 1};
    run_fp8_case(&c, &p, splits, 4);
    problem_free(&p);
    problem_dense(&p, 13);
    const fcase c2 = {"dense 13 rows", MOELINK_DTYPE_F16, 128, 512, 128, 1, 1};
    run_fp8_case(&c2, &p, three, 3);
    problem_free(&p);
  }
  {
    /* the dense form: 1 and 1000 rows, the second with a per-row scale */
    problem_dense(&p, 1);
    const fcase c = {"dense 1 row", MOELINK_DTYPE_BF16, 128, 1024, 0, 1, 0};
    run_fp8_case(&c, &p, three, 3);
    problem_free(&p);
    problem_dense(&p, 1000);
    const fcase c2 = {"dense 1000 rows", MOELINK_DTYPE_F16, 256, 384, 128, 1, 1};
    run_fp8_case(&c2, &p, splits, 4);
    problem_free(&p);
  }
}

/* ---- host policy -------------------------------------------------------------------------- */

static void check_policy(void) {
  CHECK(ml_cuda_decode_passes(8, 8) == 8 && ml_cuda_decode_passes(1, 1) == 1 &&
            ml_cuda_decode_passes(64, 1) == 1 && ml_cuda_decode_passes(65, 1) == 2 &&
            ml_cuda_decode_passes(256, 8) == 11 && ml_cuda_decode_passes(0, 8) == 0,
        "pass bounds of small cases");
  /* the bound holds for any way of spreading rows over experts */
  int worst_gap = 0, ok = 1;
  for (int trial = 0; trial < 2000; ++trial) {
    const int E = 1 + (int)(rng_next() % 40), rows = (int)(rng_next() % 600);
    int cnt[40] = {0};
    for (int i = 0; i < rows; ++i) {
      /* sometimes piled on few experts */
      const int e = (trial & 1) ? (int)(rng_next() % (uint32_t)E) : (int)(rng_next() % 2) % E;
      ++cnt[e];
    }
    int tiles = 0;
    for (int e = 0; e < E; ++e) tiles += (cnt[e] + ML_CUDA_TILE_ROWS - 1) / ML_CUDA_TILE_ROWS;
    const int bound = ml_cuda_decode_passes(rows, E);
    if (tiles > bound) ok = 0;
    if (bound - tiles > worst_gap) worst_gap = bound - tiles;
  }
  CHECK(ok, "tile count never exceeds ml_cuda_decode_passes (2000 random spreads, slack <= %d)",
        worst_gap);
  if (getenv("MOELINK_DECODE_NARROW") == NULL)
    CHECK(ml_cuda_decode_narrow(64, 8) && !ml_cuda_decode_narrow(65, 8) &&
              ml_cuda_decode_narrow(1024, 256) && ml_cuda_decode_narrow(1, 128) &&
              ml_cuda_decode_narrow(2048, 256) && !ml_cuda_decode_narrow(2049, 256) &&
              !ml_cuda_decode_narrow(0, 8) && !ml_cuda_decode_narrow(8, 0),
          "tiles in 16-row passes up to 8 rows an expert on average");
  if (getenv("MOELINK_DECODE_MAX_PAIRS") == NULL) {
    CHECK(ml_cuda_decode_wanted(8, 128, 768) && ml_cuda_decode_wanted(1, 1, 0) &&
              ml_cuda_decode_wanted(256, 8, 768) && !ml_cuda_decode_wanted(257, 8, 768) &&
              ml_cuda_decode_wanted(64, 1, 0) && !ml_cuda_decode_wanted(65, 1, 0) &&
              !ml_cuda_decode_wanted(100000, 8, 768) && !ml_cuda_decode_wanted(0, 8, 768),
          "decode path up to 256 routed rows and one dense pass, not for a large batch");
  }
  if (getenv("MOELINK_DECODE_MAX_PAIRS") == NULL && getenv("MOELINK_DECODE_LONG_K") == NULL &&
      getenv("MOELINK_DECODE_LONG_K_PAIRS") == NULL &&
      getenv("MOELINK_DECODE_FP8_ROWS_PER_EXPERT") == NULL) {
    CHECK(ml_cuda_decode_wanted(8, 8, 4096) && !ml_cuda_decode_wanted(9, 8, 4096) &&
              !ml_cuda_decode_wanted(16, 256, 2048) && ml_cuda_decode_wanted(16, 256, 2047) &&
              ml_cuda_decode_wanted(64, 1, 8192) && ml_cuda_decode_wanted_fp8(64, 8, 4096) &&
              !ml_cuda_decode_wanted_fp8(65, 8, 4096) && ml_cuda_decode_wanted_fp8(8, 8, 4096),
          "routed GEMMs of k >= 2048 on the decode path up to 8 rows (FP8: 8 an expert)");
  }
  size_t pf = 0, tk = 0;
  ml_cuda_decode_scratch(16, 8, 256, 7168, 2048, 2048, 132, &pf, &tk);
  CHECK(pf > 0 && tk > 0, "a deepseek-like layer reserves split-K scratch (%zu floats, %zu "
        "tickets)", pf, tk);
  /* the reserve covers every routed launch of the layer: any token count
   * up to its bound, at the pass count the layer gives (its plan's tile
   * bound is never lower) */
  if (getenv("MOELINK_DECODE_SPLITS") == NULL) {
    static const int shapes[][5] = {/* max_tokens, k, E, H, I */
                                    {4, 2, 8, 4096, 14336},
                                    {32, 8, 128, 2048, 768},
                                    {16, 8, 256, 7168, 2048},
                                    {64, 4, 64, 1536, 4096}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; ++i) {
      const int *c = shapes[i], H = c[3], I = c[4];
      pf = tk = 0;
      ml_cuda_decode_scratch(c[0], c[1], c[2], H, I, 0, g_sm_count, &pf, &tk);
      size_t most = 0;
      for (int T = 1; T <= c[0]; ++T) {
        const int P = T * c[1], ps = ml_cuda_decode_passes(P, c[2]);
        if (!ml_cuda_decode_wanted(P, c[2], H < I ? H : I))
          break;
        const int s1 = ml_cuda_decode_policy_splits(1, I, H, ps, g_sm_count);
        const int s2 = ml_cuda_decode_policy_splits(0, H, I, ps, g_sm_count);
        const size_t f1 = s1 > 1 ? (size_t)s1 * P * 2 * I : 0;
        const size_t f2 = s2 > 1 ? (size_t)s2 * P * H : 0;
        most = f1 > most ? f1 : most;
        most = f2 > most ? f2 : most;
      }
      CHECK(pf >= most,
            "scratch of a layer (T <= %d, k %d, E %d, H %d, I %d): %zu partial "
            "floats for launches that need up to %zu",
            c[0], c[1], c[2], H, I, pf, most);
    }
  }
}

static void check_rejections(void) {
  char *d = dev_alloc(1 << 16);
  int32_t *num = (int32_t *)(d + 60000);
  ml_decode_opts o;
  memset(&o, 0, sizeof o);
  o.sm_count = g_sm_count;
  const moelink_dtype_t bf = MOELINK_DTYPE_BF16;
  CHECK_STATUS(ml_cuda_decode_swiglu(bf, d, 16, NULL, 1, d, 12, 16, NULL, NULL, 0, 4, d, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "decode swiglu n 12");
  CHECK_STATUS(ml_cuda_decode_scaled(bf, d + 8, 16, d, 16, 16, NULL, NULL, 0, 4, NULL, NULL, d, 0,
                                     &o, 0),
               MOELINK_ERR_UNSUPPORTED, "decode scaled with a misaligned a");
  CHECK_STATUS(ml_cuda_decode_scaled(MOELINK_DTYPE_F32, d, 16, d, 16, 16, NULL, NULL, 0, 4, NULL,
                                     NULL, d, 0, &o, 0),
               MOELINK_ERR_UNSUPPORTED, "decode scaled f32 operands");
  CHECK_STATUS(ml_cuda_decode_swiglu(bf, d, 16, NULL, 1, d, 16, 16, NULL, NULL, 0, 4, d, NULL, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "decode swiglu without options");
  CHECK_STATUS(ml_cuda_decode_swiglu(bf, d, 16, NULL, 1, d, 16, 16, (const int32_t *)d, NULL, 1,
                                     4, d, &o, 0),
               MOELINK_ERR_INVALID_ARGUMENT, "decode swiglu tiles without num_tiles");
  o.splits = 3;
  CHECK_STATUS(ml_cuda_decode_scaled(bf, d, 512, d, 16, 512, (const int32_t *)d, num, 1, 4, NULL,
                                     NULL, d, 0, &o, 0),
               MOELINK_ERR_INTERNAL, "decode scaled with 3 splits and no scratch");
  o.splits = 0;
  CHECK_OK(ml_cuda_decode_swiglu(bf, d, 16, NULL, 1, d, 16, 16, NULL, NULL, 0, 0, d, &o, 0),
           "decode swiglu with no rows does nothing");
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaFree(d);
}

/* ---- benchmark mode ------------------------------------------------------------------------- */

#define BENCH_ITERS 15
#define FLUSH_BYTES ((size_t)256 << 20)
#define READ_GBPS 4570.0 /* the H200's measured read floor (moelink bench) */

typedef enum { OP_OLD_GU, OP_NEW_GU, OP_OLD_DN, OP_NEW_DN, OP_NEW_PAIR, OP_OLD_SH, OP_NEW_SH,
               OP_FWD, OP_GRAPH } bench_op;

typedef struct bench_ctx {
  moelink_moe_config_t cfg;
  moelink_moe_t moe;
  moelink_moe_weights_t w;
  void *x, *h, *y, *out, *flush, *plan_buf, *sh_h;
  float *wts, *sh_out, *part;
  int32_t *ids;
  uint32_t *tick;
  size_t pfloats, nticket;
  moelink_plan_t plan;
  int T, pairs, passes, splits, pdl, probe;
  cudaStream_t st;
  cudaGraphExec_t graph;
} bench_ctx;

static ml_decode_opts bench_opts(const bench_ctx *b, int flags) {
  ml_decode_opts o;
  memset(&o, 0, sizeof o);
  o.sm_count = g_sm_count;
  o.flags = flags;
  o.splits = b->splits;
  o.partials = b->part;
  o.partial_floats = b->pfloats;
  o.tickets = b->tick;
  o.ticket_count = b->nticket;
  /* the routing comes from the library's router: k distinct experts a token;
   * tiles in 16-row passes as the layer cuts them */
  o.max_rows = b->T;
  if (ml_cuda_decode_narrow(b->pairs, b->cfg.num_experts))
    o.flags |= ML_DECODE_NARROW;
  return o;
}

static moelink_status_t bench_run(bench_ctx *b, bench_op op) {
  const moelink_moe_config_t *c = &b->cfg;
  const moelink_plan_t *p = &b->plan;
  const int pdl = (b->pdl ? ML_DECODE_PDL : 0) | (b->probe ? ML_DECODE_PROBE_NO_MMA : 0);
  ml_decode_opts o = bench_opts(b, pdl);
  ml_decode_opts oe = bench_opts(b, pdl | ML_DECODE_PLAN_EARLY);
  switch (op) {
  case OP_OLD_GU:
    return ml_cuda_gemm_swiglu(c->dtype, b->x, c->hidden, p->sorted_pairs, c->top_k, b->w.gate_up,
                               c->inter, c->hidden, p->tiles, p->num_tiles, p->max_tiles, 0, b->h,
                               NULL, b->st);
  case OP_NEW_GU:
    return ml_cuda_decode_swiglu(c->dtype, b->x, c->hidden, p->sorted_pairs, c->top_k,
                                 b->w.gate_up, c->inter, c->hidden, p->tiles, p->num_tiles,
                                 b->passes, b->pairs, b->h, &o, b->st);
  case OP_OLD_DN:
    return ml_cuda_gemm_scaled(c->dtype, b->h, c->inter, b->w.down, c->hidden, c->inter, p->tiles,
                               p->num_tiles, p->max_tiles, 0, b->wts, p->sorted_pairs, b->y, 0,
                               NULL, b->st);
  case OP_NEW_DN:
    return ml_cuda_decode_scaled(c->dtype, b->h, c->inter, b->w.down, c->hidden, c->inter,
                                 p->tiles, p->num_tiles, b->passes, b->pairs, b->wts,
                                 p->sorted_pairs, b->y, 0, &o, b->st);
  case OP_NEW_PAIR: {
    moelink_status_t s = ml_cuda_decode_swiglu(c->dtype, b->x, c->hidden, p->sorted_pairs,
                                               c->top_k, b->w.gate_up, c->inter, c->hidden,
                                               p->tiles, p->num_tiles, b->passes, b->pairs, b->h,
                                               &o, b->st);
    if (s != MOELINK_SUCCESS) return s;
    return ml_cuda_decode_scaled(c->dtype, b->h, c->inter, b->w.down, c->hidden, c->inter,
                                 p->tiles, p->num_tiles, b->passes, b->pairs, b->wts,
                                 p->sorted_pairs, b->y, 0, &oe, b->st);
  }
  case OP_OLD_SH: {
    moelink_status_t s =
        ml_cuda_gemm_swiglu(c->dtype, b->x, c->hidden, NULL, 1, b->w.shared_gate_up,
                            c->shared_inter, c->hidden, NULL, NULL, 0, b->T, b->sh_h, NULL, b->st);
    if (s != MOELINK_SUCCESS) return s;
    return ml_cuda_gemm_scaled(c->dtype, b->sh_h, c->shared_inter, b->w.shared_down, c->hidden,
                               c->shared_inter, NULL, NULL, 0, b->T, NULL, NULL, b->sh_out, 1, NULL,
                               b->st);
  }
  case OP_NEW_SH: {
    moelink_status_t s = ml_cuda_decode_swiglu(c->dtype, b->x, c->hidden, NULL, 1,
                                               b->w.shared_gate_up, c->shared_inter, c->hidden,
                                               NULL, NULL, 0, b->T, b->sh_h, &o, b->st);
    if (s != MOELINK_SUCCESS) return s;
    return ml_cuda_decode_scaled(c->dtype, b->sh_h, c->shared_inter, b->w.shared_down, c->hidden,
                                 c->shared_inter, NULL, NULL, 0, b->T, NULL, NULL, b->sh_out, 1,
                                 &o, b->st);
  }
  case OP_FWD:
    return moelink_moe_forward(b->moe, b->x, b->T, b->out, b->st);
  case OP_GRAPH:
    return cudaGraphLaunch(b->graph, b->st) == cudaSuccess ? MOELINK_SUCCESS : MOELINK_ERR_CUDA;
  }
  return MOELINK_ERR_INTERNAL;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median microseconds of op, L2 flushed before each run (outside the events). */
static double bench_time(bench_ctx *b, bench_op op) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  double t[BENCH_ITERS];
  for (int it = -3; it < BENCH_ITERS; ++it) {
    CUDA_CHECK(cudaMemsetAsync(b->flush, it & 0xff, FLUSH_BYTES, b->st));
    CUDA_CHECK(cudaEventRecord(e0, b->st));
    moelink_status_t s = bench_run(b, op);
    if (s != MOELINK_SUCCESS) {
      printf("Bail out! bench op %d: %s\n", (int)op, moelink_last_error());
      exit(2);
    }
    CUDA_CHECK(cudaEventRecord(e1, b->st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (it >= 0) t[it] = ms * 1e3;
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  qsort(t, BENCH_ITERS, sizeof t[0], cmp_double);
  return t[BENCH_ITERS / 2];
}

/* Mean microseconds of back-to-back graph replays (no flush between). */
static double bench_graph_b2b(bench_ctx *b) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) CUDA_CHECK(cudaGraphLaunch(b->graph, b->st));
  CUDA_CHECK(cudaEventRecord(e0, b->st));
  for (int i = 0; i < 50; ++i) CUDA_CHECK(cudaGraphLaunch(b->graph, b->st));
  CUDA_CHECK(cudaEventRecord(e1, b->st));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return ms * 1e3 / 50;
}

static void bench_preset(moelink_context_t ctx, const char *preset, const int *Ts, int nT,
                         int fwd_max_T) {
  bench_ctx B;
  memset(&B, 0, sizeof B);
  moelink_moe_config_t c = MOELINK_MOE_CONFIG_INIT;
  if (moelink_moe_preset(preset, &c) != MOELINK_SUCCESS) {
    printf("# unknown preset %s\n", preset);
    return;
  }
  c.dtype = MOELINK_DTYPE_BF16;
  int Tmax = 1;
  for (int i = 0; i < nT; ++i) Tmax = Ts[i] > Tmax ? Ts[i] : Tmax;
  c.max_tokens = Tmax;
  B.cfg = c;
  const size_t H = (size_t)c.hidden, I = (size_t)c.inter, E = (size_t)c.num_experts;
  const size_t Is = (size_t)c.shared_inter, k = (size_t)c.top_k, P = (size_t)Tmax * k;
  if (moelink_moe_create(ctx, &c, &B.moe) != MOELINK_SUCCESS) {
    printf("# %s: create failed: %s\n", preset, moelink_last_error());
    return;
  }
  CUDA_CHECK(cudaStreamCreateWithFlags(&B.st, cudaStreamNonBlocking));
  const uint64_t seed = 99;
  void *router = dev_alloc(E * H * 2), *gu = dev_alloc(E * 2 * I * H * 2);
  void *dn = dev_alloc(E * H * I * 2), *sgu = NULL, *sdn = NULL, *sg = NULL;
  float *bias = NULL;
  moelink_fill_random(ctx, c.dtype, router, E * H, ref_tensor_seed(seed, REF_T_ROUTER),
                      ref_tensor_scale(&c, REF_T_ROUTER), 0.0f, B.st);
  moelink_fill_random(ctx, c.dtype, gu, E * 2 * I * H, ref_tensor_seed(seed, REF_T_GATE_UP),
                      ref_tensor_scale(&c, REF_T_GATE_UP), 0.0f, B.st);
  moelink_fill_random(ctx, c.dtype, dn, E * H * I, ref_tensor_seed(seed, REF_T_DOWN),
                      ref_tensor_scale(&c, REF_T_DOWN), 0.0f, B.st);
  if (Is > 0) {
    sgu = dev_alloc(2 * Is * H * 2);
    sdn = dev_alloc(H * Is * 2);
    moelink_fill_random(ctx, c.dtype, sgu, 2 * Is * H, ref_tensor_seed(seed, REF_T_SH_GATE_UP),
                        ref_tensor_scale(&c, REF_T_SH_GATE_UP), 0.0f, B.st);
    moelink_fill_random(ctx, c.dtype, sdn, H * Is, ref_tensor_seed(seed, REF_T_SH_DOWN),
                        ref_tensor_scale(&c, REF_T_SH_DOWN), 0.0f, B.st);
  }
  if (c.shared_gate) {
    sg = dev_alloc(H * 2);
    moelink_fill_random(ctx, c.dtype, sg, H, 7, ref_tensor_scale(&c, REF_T_SH_GATE), 0.0f, B.st);
  }
  if (c.correction_bias) {
    bias = dev_alloc(E * 4);
    moelink_fill_random(ctx, MOELINK_DTYPE_F32, bias, E, ref_tensor_seed(seed, REF_T_BIAS),
                        ref_tensor_scale(&c, REF_T_BIAS), 0.0f, B.st);
  }
  moelink_moe_weights_t w = MOELINK_MOE_WEIGHTS_INIT;
  w.dtype = c.dtype;
  w.router = router;
  w.correction_bias = bias;
  w.gate_up = gu;
  w.down = dn;
  w.shared_gate_up = sgu;
  w.shared_down = sdn;
  w.shared_gate = sg;
  B.w = w;
  if (moelink_moe_set_weights(B.moe, &w) != MOELINK_SUCCESS) {
    printf("# %s: set_weights: %s\n", preset, moelink_last_error());
    return;
  }
  B.x = dev_alloc((size_t)Tmax * H * 2);
  moelink_fill_random(ctx, c.dtype, B.x, (size_t)Tmax * H, 5, 1.0f, 0.0f, B.st);
  B.out = dev_alloc((size_t)Tmax * H * 2);
  B.h = dev_alloc(P * I * 2);
  B.y = dev_alloc(P * H * 2);
  B.ids = dev_alloc(P * 4);
  B.wts = dev_alloc(P * 4);
  B.plan_buf = dev_alloc(moelink_plan_bytes(Tmax, (int)k, (int)E, ML_CUDA_TILE_ROWS));
  B.flush = dev_alloc(FLUSH_BYTES);
  if (Is > 0) {
    B.sh_h = dev_alloc((size_t)Tmax * Is * 2);
    B.sh_out = dev_alloc((size_t)Tmax * H * 4);
  }
  size_t pf = 0, tk = 0;
  ml_cuda_decode_scratch(Tmax, (int)k, (int)E, (int)H, (int)I, (int)Is, g_sm_count, &pf, &tk);
  /* room for the split sweep too */
  /* room for the split sweep (T = 1) and the shared expert forced onto the
   * decode path up to T = 128 */
  size_t widest = 2 * I > H ? 2 * I : H;
  widest = 2 * Is > widest ? 2 * Is : widest;
  const size_t sweep_f = (size_t)16 * (k > 128 ? k : 128) * widest;
  B.pfloats = pf > sweep_f ? pf : sweep_f;
  /* and the routed launches forced onto the decode path at every T of the
   * list, past the layer's own bound (the waves rule can split them) */
  for (int i = 0; i < nT; ++i) {
    const int pairs = Ts[i] * (int)k, ps = ml_cuda_decode_passes(pairs, (int)E);
    const int s1 = ml_cuda_decode_policy_splits(1, (int)I, (int)H, ps, g_sm_count);
    const int s2 = ml_cuda_decode_policy_splits(0, (int)H, (int)I, ps, g_sm_count);
    const size_t f = (size_t)(s1 > s2 ? s1 : s2) * (size_t)pairs * widest;
    if (f > B.pfloats)
      B.pfloats = f;
  }
  B.nticket = (tk > 0 ? tk : 1) + (size_t)(ml_cuda_decode_passes((int)P, (int)E) + 2) *
                                      (size_t)(widest / 64 + 2);
  B.part = dev_alloc(B.pfloats * 4);
  B.tick = dev_alloc(B.nticket * 4);
  CUDA_CHECK(cudaMemset(B.tick, 0, B.nticket * 4));
  CUDA_CHECK(cudaDeviceSynchronize());

  printf("\n## %s (H %zu, I %zu, E %zu, k %zu, shared %zu), bf16, read floor %.0f GB/s\n", preset,
         H, I, E, k, Is, READ_GBPS);
  printf("%6s %5s | %10s %9s %9s %6s | %10s %9s %9s %6s | %9s %9s | %9s %9s %9s\n", "T",
         "exp", "gu floor", "gu old", "gu new", "split", "dn floor", "dn old", "dn new", "split",
         "pair", "pair PDL", "fwd", "graph", "graph b2b");
  for (int ti = 0; ti < nT; ++ti) {
    const int T = Ts[ti];
    B.T = T;
    B.pairs = T * (int)k;
    if (moelink_moe_route(B.moe, B.x, T, B.ids, B.wts, B.st) != MOELINK_SUCCESS ||
        moelink_moe_plan(B.moe, B.ids, T, B.plan_buf, B.st) != MOELINK_SUCCESS) {
      printf("# %s T %d: route/plan: %s\n", preset, T, moelink_last_error());
      continue;
    }
    moelink_plan_view(B.plan_buf, T, (int)k, (int)E, ML_CUDA_TILE_ROWS, &B.plan);
    B.passes = ml_cuda_decode_passes(B.pairs, (int)E);
    if (B.passes > B.plan.max_tiles) B.passes = B.plan.max_tiles;
    int32_t *offs = xmalloc((E + 1) * 4);
    CUDA_CHECK(cudaStreamSynchronize(B.st));
    CUDA_CHECK(cudaMemcpy(offs, B.plan.expert_offsets, (E + 1) * 4, cudaMemcpyDeviceToHost));
    int touched = 0;
    for (size_t e = 0; e < E; ++e) touched += offs[e + 1] > offs[e];
    free(offs);
    const double gu_floor = (double)touched * 2 * I * H * 2 / (READ_GBPS * 1e3);
    const double dn_floor = (double)touched * H * I * 2 / (READ_GBPS * 1e3);
    B.splits = 0;
    B.pdl = 0;
    const double old_gu = bench_time(&B, OP_OLD_GU), new_gu = bench_time(&B, OP_NEW_GU);
    const double old_dn = bench_time(&B, OP_OLD_DN), new_dn = bench_time(&B, OP_NEW_DN);
    const double pair = bench_time(&B, OP_NEW_PAIR);
    B.pdl = 1;
    const double pair_pdl = bench_time(&B, OP_NEW_PAIR);
    B.pdl = 0;
    double fwd = NAN, graph = NAN, b2b = NAN;
    if (T <= fwd_max_T) {
      fwd = bench_time(&B, OP_FWD);
      cudaGraph_t g;
      CUDA_CHECK(cudaStreamBeginCapture(B.st, cudaStreamCaptureModeGlobal));
      moelink_status_t s = moelink_moe_forward(B.moe, B.x, T, B.out, B.st);
      CUDA_CHECK(cudaStreamEndCapture(B.st, &g));
      if (s == MOELINK_SUCCESS) {
        CUDA_CHECK(cudaGraphInstantiate(&B.graph, g, 0));
        graph = bench_time(&B, OP_GRAPH);
        b2b = bench_graph_b2b(&B);
        CUDA_CHECK(cudaGraphExecDestroy(B.graph));
      } else {
        printf("# capture failed: %s\n", moelink_last_error());
      }
      CUDA_CHECK(cudaGraphDestroy(g));
    }
    printf("%6d %5d | %10.1f %9.1f %9.1f %6d | %10.1f %9.1f %9.1f %6d | %9.1f %9.1f | %9.1f "
           "%9.1f %9.1f\n",
           T, touched, gu_floor, old_gu, new_gu,
           ml_cuda_decode_policy_splits(1, (int)I, (int)H, B.passes, g_sm_count), dn_floor,
           old_dn, new_dn, ml_cuda_decode_policy_splits(0, (int)H, (int)I, B.passes, g_sm_count),
           pair, pair_pdl, fwd, graph, b2b);
    printf("       %% of floor: gate/up old %.0f%% new %.0f%%, down old %.0f%% new %.0f%%, pair "
           "(PDL) %.0f%%\n",
           100 * gu_floor / old_gu, 100 * gu_floor / new_gu, 100 * dn_floor / old_dn,
           100 * dn_floor / new_dn, 100 * (gu_floor + dn_floor) / pair_pdl);
    if (Is > 0 && T <= fwd_max_T) {
      const double sh_floor = 3.0 * Is * H * 2 / (READ_GBPS * 1e3);
      const double o = bench_time(&B, OP_OLD_SH);
      B.pdl = 1;
      const double nw = bench_time(&B, OP_NEW_SH);
      B.pdl = 0;
      printf("       shared expert (dense T %d): floor %.1f us, old %.1f us, new %.1f us (%.0f%%)\n",
             T, sh_floor, o, nw, 100 * sh_floor / nw);
    }
    if (T == 1 || T == 128 || T == 512) {
      /* the same grids without the MMAs: the weight stream alone */
      B.probe = 1;
      const double pg = bench_time(&B, OP_NEW_GU), pd = bench_time(&B, OP_NEW_DN);
      B.probe = 0;
      printf("       stream only (no MMA): gate/up %.1f us (%.0f%%), down %.1f us (%.0f%%)\n", pg,
             100 * gu_floor / pg, pd, 100 * dn_floor / pd);
    }
    if (T == 1) {
      /* K-split sweep of each decode GEMM alone */
      printf("       split sweep (us):");
      const int sp[] = {1, 2, 3, 4, 6, 8, 12, 16};
      for (int i = 0; i < 8; ++i) {
        B.splits = sp[i];
        const double a = bench_time(&B, OP_NEW_GU), d = bench_time(&B, OP_NEW_DN);
        printf(" s%d %.1f/%.1f", sp[i], a, d);
      }
      B.splits = 0;
      printf("  (gate-up/down)\n");
    }
    fflush(stdout);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  moelink_moe_destroy(B.moe);
  cudaFree(router), cudaFree(gu), cudaFree(dn), cudaFree(sgu), cudaFree(sdn), cudaFree(sg);
  cudaFree(bias), cudaFree(B.x), cudaFree(B.out), cudaFree(B.h), cudaFree(B.y), cudaFree(B.ids);
  cudaFree(B.wts), cudaFree(B.plan_buf), cudaFree(B.flush), cudaFree(B.sh_h);
  cudaFree(B.sh_out), cudaFree(B.part), cudaFree(B.tick);
  CUDA_CHECK(cudaStreamDestroy(B.st));
}

static int bench_main(int argc, char **argv) {
  moelink_context_t ctx = NULL;
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = MOELINK_BACKEND_CUDA;
  if (moelink_context_create(&cc, &ctx) != MOELINK_SUCCESS) {
    printf("Bail out! CUDA context: %s\n", moelink_last_error());
    return 2;
  }
  int Ts[16] = {1, 16, 64, 128, 256, 512, 1024, 2048}, nT = 8;
  /* DECODE_BENCH_TOKENS=1,2,4: these token counts instead (at most 16) */
  const char *tl = getenv("DECODE_BENCH_TOKENS");
  if (tl != NULL && *tl) {
    nT = 0;
    for (const char *c = tl; *c && nT < 16;) {
      char *end;
      const long v = strtol(c, &end, 10);
      if (end == c)
        break;
      if (v >= 1 && v <= 65536)
        Ts[nT++] = (int)v;
      c = *end == ',' ? end + 1 : end;
    }
    if (nT == 0) {
      printf("Bail out! DECODE_BENCH_TOKENS=%s: no token count\n", tl);
      moelink_context_destroy(ctx);
      return 2;
    }
  }
  const char *def[] = {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"};
  if (argc > 2) {
    for (int i = 2; i < argc; ++i)
      bench_preset(ctx, argv[i], Ts, nT, 128);
  } else {
    for (int i = 0; i < 3; ++i)
      bench_preset(ctx, def[i], Ts, nT, 128);
  }
  moelink_context_destroy(ctx);
  return 0;
}

/* ---- main -------------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("Bail out! no CUDA device\n");
    return 2;
  }
  CUDA_CHECK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, 0));
  if (argc > 1 && strcmp(argv[1], "--bench") == 0) return bench_main(argc, argv);

  check_policy();
  check_rejections();
  check_fp8_rejections();

  const run_cfg all[] = {{1, 0}, {3, ML_DECODE_PDL}, {0, ML_DECODE_PDL}, {16, 0}};
  const run_cfg three[] = {{1, 0}, {3, ML_DECODE_PDL}, {0, ML_DECODE_PDL}};

  problem p;
  {
    const int counts[] = {0, 1, 7, 64, 65, 200};
    problem_routed(&p, 6, counts, 2, 4, 0);
    const dcase bf = {"experts 0/1/7/64/65/200", MOELINK_DTYPE_BF16, 200, 328, 8, 1, 0};
    run_case(&bf, &p, all, 4);
    const dcase f16 = {"experts 0/1/7/64/65/200", MOELINK_DTYPE_F16, 200, 328, 0, 0, 0};
    run_case(&f16, &p, three, 3);
    problem_free(&p);
  }
  {
    const int counts[] = {0, 0, 150, 0};
    problem_routed(&p, 4, counts, 0, 2, 0);
    const dcase c = {"all rows on one expert", MOELINK_DTYPE_BF16, 136, 264, 0, 0, 0};
    run_case(&c, &p, three, 3);
    problem_free(&p);
  }
  {
    /* one decode step of a k = 8 layer: the policy splits K */
    const int counts[] = {1, 1, 1, 1, 1, 1, 1, 1};
    problem_routed(&p, 8, counts, 0, 8, ml_cuda_decode_passes(8, 8));
    const dcase bf = {"decode step k 8", MOELINK_DTYPE_BF16, 512, 2048, 0, 0, 1};
    run_case(&bf, &p, three, 3);
    const dcase f16 = {"decode step k 8", MOELINK_DTYPE_F16, 512, 2048, 0, 0, 0};
    run_case(&f16, &p, three, 3);
    problem_free(&p);
  }
  {
    /* 16 tokens x 8 distinct experts of 64, grid sized by the pass bound */
    int counts[64] = {0};
    count_distinct_routes(counts, 64, 16, 8);
    problem_routed(&p, 64, counts, 0, 8, ml_cuda_decode_passes(128, 64));
    const dcase c = {"16 tokens over 64 experts", MOELINK_DTYPE_BF16, 256, 512, 0, 0, 0};
    run_case(&c, &p, three, 3);
    problem_free(&p);
  }
  {
    /* up to 16 rows an expert (one 16-row pass full, one of 9), unowned rows
     * between; then 13 dense rows (see fp8_cases) */
    const int counts[] = {16, 9, 0, 13, 1};
    problem_routed(&p, 5, counts, 1, 2, 0);
    const dcase c = {"experts of 16/9/0/13/1 rows", MOELINK_DTYPE_BF16, 264, 392, 8, 1, 1};
    run_case(&c, &p, all, 4);
    problem_free(&p);
    problem_dense(&p, 13);
    const dcase c2 = {"dense 13 rows", MOELINK_DTYPE_F16, 136, 520, 0, 1, 0};
    run_case(&c2, &p, three, 3);
    problem_free(&p);
  }
  {
    problem_dense(&p, 1);
    const dcase c = {"dense 1 row", MOELINK_DTYPE_BF16, 192, 1032, 0, 1, 0};
    run_case(&c, &p, three, 3);
    problem_free(&p);
    problem_dense(&p, 65);
    const dcase c2 = {"dense 65 rows", MOELINK_DTYPE_F16, 192, 1032, 8, 1, 0};
    run_case(&c2, &p, three, 3);
    problem_free(&p);
  }
  fp8_cases();
  return ml_test_done();
}
