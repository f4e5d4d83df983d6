/* Host side of the decode expert GEMMs (decode.h; kernels in gemm/decode.cuh):
 * the path policy (which GEMM path, how many K splits), the scratch a layer
 * reserves for them, argument checks and launches. */
#include "core/launch.cuh"
#include "cuda/gemm/decode.cuh"
#include "cuda/gemm/decode.h"

#include <limits.h>
#include <stdint.h>

/* Routed GEMMs: the decode path runs up to this many (token, slot) rows per
 * call (0: never). Measured on an H200 (bf16 layer, moelink bench): at 2..256
 * rows it is as fast or faster than the tile engine (mixtral-8x7b T = 1:
 * 248 us against 386; deepseek-v3 T = 16: 1297 against 1329; mixtral T = 128,
 * 256 rows: 777 against 774), at 1024 rows slower (qwen3-30b-a3b T = 128: 386
 * against 364; deepseek-v3: 1937 against 1869). */
MOELINK_PARAM(DECODE_MAX_PAIRS, 256)
/* Routed GEMMs whose k are all at least DECODE_LONG_K (the gate/up GEMM's
 * hidden and the down GEMM's inter; 0: no such rule) take the decode path up
 * to DECODE_LONG_K_PAIRS rows only: past a few experts the tile engine's
 * persistent CTAs stream those long rows faster. Measured on an H200 (graph
 * replays, two alternations, docs/PERF.md): the tile engine instead of the
 * decode GEMMs made deepseek-v3 (k 7168 / 2048) T = 4 / 8 / 16 / 32 1.4 /
 * 2.1 / 2.0 / 2.9% faster, T = 2 the same, T = 1 3% slower; mixtral-8x7b
 * (4096 / 14336) T = 8 / 16 / 32 / 64 / 128 1.3 / 1.5 / 2.7 / 5.5 / 7.5%
 * faster, T = 2 and 4 the same within the spread, T = 1 21-24% slower;
 * qwen3-30b-a3b (2048 / 768) 9-28% slower at every T from 1 to 32. */
MOELINK_PARAM(DECODE_LONG_K, 2048)
MOELINK_PARAM(DECODE_LONG_K_PAIRS, 8)
/* FP8 routed GEMMs: the decode path also runs while the experts average at
 * most this many rows (0: the bf16 rule alone). Measured on an H200 (graph
 * replays, 8 against 32, docs/PERF.md): mixtral-8x7b T = 64 / 128 (16 / 32
 * rows an expert) 371 / 379 us on the sm_90a FP8 GEMM against 404 / 440 on
 * the decode GEMMs, deepseek-v3 T = 512 (16 rows) 2846 against 3193,
 * qwen3-30b-a3b T = 512 (32 rows) 260 against 276, but qwen3 T = 256 (16
 * rows) 245 against 236. (32 came from commit 1e4a3dc, before the FP8 GEMM's
 * wide tile: deepseek-v3 T = 64..512 2669-3527 us against 3727-4565 then.) */
MOELINK_PARAM(DECODE_FP8_ROWS_PER_EXPERT, 8)
/* Programmatic dependent launch of the decode GEMMs (0: plain launches). */
MOELINK_PARAM(DECODE_PDL, 1)
/* CTAs per SM the split policy aims for. 1 (fewer, longer K splits: each
 * CTA fills and drains its cp.async ring once) measured best on the H200
 * (graph replay, commit 7e75c9f): qwen3-30b-a3b T = 1 70.5 -> 62.7 us,
 * mixtral-8x7b T = 1 240.8 -> 225.2, deepseek-v3 T = 1 298.4 -> 289.1,
 * T = 8..128 within 1% (4 before). */
MOELINK_PARAM(DECODE_CTAS_PER_SM, 1)
/* 1: where a routed launch's K is long (splits of 16 k tiles or more), the
 * split count may grow past the policy's to the one whose CTAs fill their
 * last wave of two an SM best (mixtral-8x7b T = 1: 448 gate/up CTAs fill 85% of
 * two waves of 264, four splits' 1792 fill 97%). 0: the policy alone. */
MOELINK_PARAM(DECODE_WAVES, 1)
/* Measurements only: a K split count for every decode launch whose caller
 * left opts.splits at 0 (0: the policy); the layers size their split scratch
 * for it (ml_cuda_decode_scratch). */
MOELINK_PARAM(DECODE_SPLITS, 0)
/* FP8 launches of 16-row passes whose CTAs stream at most this many 128-wide
 * k tiles take the kernel of the short-k ring (four stages, three CTAs an SM;
 * mld_cfg); 0: never. Measured on an H200 (graph replays, same call, docs/PERF.md
 * "The short-k FP8 ring"): at 6 only qwen3-30b-a3b's down GEMM (6 k tiles a
 * CTA) takes it, T = 16 / 128 3% / 6% faster; at 16 its gate/up and
 * deepseek-v3's down too, T = 128 another 1% and 0.4% but deepseek-v3 T = 1
 * 3% slower; with no limit mixtral-8x7b T = 16 and deepseek-v3 T = 1 lose
 * 3% and 7%. A second H200: 6 against 0, qwen3 T = 16 / 128 2% / 6% faster. */
MOELINK_PARAM(DECODE_FP8_SHORT_K, 6)
/* 0: never the kernel of 16-row passes (see ml_decode_opts.max_rows) */
MOELINK_PARAM(DECODE_SMALL, 1)
/* ml_cuda_decode_narrow: rows an expert on average up to which a layer's
 * tiles are cut into 16-row passes (0: never). 8 measured: docs/PERF.md */
MOELINK_PARAM(DECODE_NARROW, 8)

extern "C" int ml_cuda_decode_narrow(int rows, int experts) {
  const int64_t per = ml_param_DECODE_NARROW();
  return per > 0 && experts > 0 && rows > 0 && (int64_t)rows <= per * experts;
}

static __thread int mld_last_bn = 0;

extern "C" int ml_cuda_decode_last_pass_rows(void) { return mld_last_bn; }

/* A split streams at least this many 64-wide k tiles (128 weight rows x 256
 * columns = 64 KiB), and there are at most this many splits. */
#define MLD_MIN_SPLIT_KTILES 4
#define MLD_MAX_SPLITS 16
/* k tiles a split keeps at least where MOELINK_DECODE_WAVES moves the count */
#define MLD_WAVE_SPLIT_KTILES 16

static int mld_ceil_div(int a, int b) { return (a + b - 1) / b; }

extern "C" int ml_cuda_decode_passes(int rows, int experts) {
  if (rows <= 0 || experts <= 0) return 0;
  const int busy = rows < experts ? rows : experts;
  /* sum over busy experts of ceil(n_e / R) <= busy + (rows - busy) / R */
  return busy + (rows - busy) / ML_CUDA_TILE_ROWS;
}

extern "C" int ml_cuda_decode_wanted(int rows, int experts, int min_k) {
  if (rows <= 0 || experts <= 0) return 0;
  int64_t limit = ml_param_DECODE_MAX_PAIRS();
  /* A dense problem (the shared expert) past one pass would stream its
   * weights once per pass: the tile engine takes it from there. */
  if (experts == 1 && limit > ML_CUDA_TILE_ROWS) limit = ML_CUDA_TILE_ROWS;
  const int64_t long_k = ml_param_DECODE_LONG_K();
  if (experts > 1 && long_k > 0 && min_k >= long_k && limit > ml_param_DECODE_LONG_K_PAIRS())
    limit = ml_param_DECODE_LONG_K_PAIRS();
  return (int64_t)rows <= limit;
}

extern "C" int ml_cuda_decode_wanted_fp8(int rows, int experts, int min_k) {
  if (ml_cuda_decode_wanted(rows, experts, min_k))
    return 1;
  if (rows <= 0 || experts <= 1) return 0;
  return (int64_t)rows <= ml_param_DECODE_FP8_ROWS_PER_EXPERT() * (int64_t)experts;
}

/* Splits of k for a launch of max_passes passes x mblocks column blocks:
 * enough CTAs for every SM to stream weights (DECODE_CTAS_PER_SM per SM)
 * while each split keeps a useful length. Returns the count with no empty
 * split; *kt_per gets the k tiles of each. */
static int mld_splits(int mblocks, int ktiles, int max_passes, int sm_count, int forced, int routed,
                      int *kt_per) {
  int s = 1;
  if (forced > 0) {
    s = forced;
  } else if (ktiles > 1 && mblocks > 0 && max_passes > 0) {
    const int64_t base = (int64_t)max_passes * mblocks;
    int64_t per_sm = ml_param_DECODE_CTAS_PER_SM();
    if (per_sm < 1) per_sm = 1;
    const int64_t target = per_sm * (sm_count > 0 ? sm_count : 1);
    if (base < target) {
      int64_t want = (target + base - 1) / base;
      const int most = ktiles / MLD_MIN_SPLIT_KTILES;
      if (want > MLD_MAX_SPLITS) want = MLD_MAX_SPLITS;
      if (want > most) want = most;
      s = want > 1 ? (int)want : 1;
    }
    if (routed && ml_param_DECODE_WAVES() != 0) {
      /* the fullest last wave among the counts that keep 16 k tiles a split
       * (the first of equals) */
      const int64_t slots = 2 * (int64_t)(sm_count > 0 ? sm_count : 1);
      int hi = ktiles / MLD_WAVE_SPLIT_KTILES;
      if (hi > MLD_MAX_SPLITS)
        hi = MLD_MAX_SPLITS;
      double best = -1.0;
      int pick = s;
      for (int c = s; c <= hi; ++c) {
        const int64_t ctas = base * c, waves = (ctas + slots - 1) / slots;
        const double eff = (double)ctas / (double)(waves * slots);
        if (eff > best + 1e-9) {
          best = eff;
          pick = c;
        }
      }
      s = pick;
    }
  }
  if (ktiles <= 0) {
    *kt_per = 0;
    return 1;
  }
  if (s > ktiles) s = ktiles;
  *kt_per = mld_ceil_div(ktiles, s);
  return mld_ceil_div(ktiles, *kt_per);
}

static int mld_mblocks(int swiglu, int n) {
  return mld_ceil_div(n, swiglu ? mld_cols<MLD_SWIGLU>::N : mld_cols<MLD_SCALED>::N);
}

extern "C" int ml_cuda_decode_policy_splits(int swiglu, int n, int k, int max_passes,
                                            int sm_count) {
  int kt_per = 0;
  return mld_splits(mld_mblocks(swiglu, n), mld_ceil_div(k, MLD_BK), max_passes, sm_count, 0, 1,
                    &kt_per);
}

/* The tickets of a launch of `passes` passes x mb column blocks: one a
 * (pass, column block) for the split sums, then, with an FP8 output (q), one
 * a pair of column blocks for its quantization (mld_args.q_tickets). */
static size_t mld_tickets(int passes, int mb, int q) {
  const size_t split = (size_t)passes * (size_t)mb;
  return q ? split + (size_t)passes * (size_t)(mb / 2) : split;
}

/* The fp32 partials of a launch of `splits` K splits over `rows` rows. */
static size_t mld_partials(int swiglu, int n, int rows, int splits) {
  return (size_t)splits * (size_t)rows * (size_t)(swiglu ? 2 * n : n);
}

/* Scratch of one launch shape under the policy (or MOELINK_DECODE_SPLITS;
 * unsplit 1: the launch runs one K split; sub: passes a tile). */
static void mld_need(int swiglu, int n, int k, int rows, int passes, int sub, int unsplit,
                     int routed, int sm_count, size_t *floats, size_t *tickets) {
  const int mb = mld_mblocks(swiglu, n);
  int kt_per = 0;
  const int s = unsplit ? 1
                        : mld_splits(mb, mld_ceil_div(k, MLD_BK), passes, sm_count,
                                     (int)ml_param_DECODE_SPLITS(), routed, &kt_per);
  /* a SwiGLU may have an FP8 output (ml_decode_opts.q_out), split or not */
  const size_t t = mld_tickets(passes * sub, mb, swiglu);
  if (swiglu && t > *tickets) *tickets = t;
  if (s <= 1) return;
  const size_t f = mld_partials(swiglu, n, rows, s);
  if (f > *floats) *floats = f;
  if (t > *tickets) *tickets = t;
}

extern "C" void ml_cuda_decode_scratch(int max_tokens, int top_k, int num_experts, int hidden,
                                       int inter, int shared_inter, int sm_count,
                                       size_t *partial_floats, size_t *ticket_count) {
  *partial_floats = 0;
  *ticket_count = 0;
  const int min_k = hidden < inter ? hidden : inter;
  for (int T = 1; T <= max_tokens; ++T) {
    const int64_t P64 = (int64_t)T * top_k;
    if (P64 > INT_MAX) break;
    const int P = (int)P64;
    const int routed = ml_cuda_decode_wanted(P, num_experts, min_k);
    /* an FP8 layer's routed GEMMs go on past that, unsplit (no partials),
     * but the e4m3 output of their gate/up GEMM takes tickets */
    const int routed_fp8 = ml_cuda_decode_wanted_fp8(P, num_experts, min_k);
    const int shared = shared_inter > 0 && ml_cuda_decode_wanted(T, 1, 0);
    /* all are monotone in T: once none runs, no larger T does */
    if (!routed && !routed_fp8 && !shared)
      break;
    /* (tickets for tiles cut into 16-row passes: ML_DECODE_NARROW) */
    const int sub = ML_CUDA_TILE_ROWS / MLD_BN_SMALL;
    if (routed || routed_fp8) {
      const int passes = ml_cuda_decode_passes(P, num_experts);
      mld_need(1, inter, hidden, P, passes, sub, !routed, 1, sm_count, partial_floats,
               ticket_count);
      mld_need(0, hidden, inter, P, passes, sub, !routed, 1, sm_count, partial_floats,
               ticket_count);
    }
    if (shared) {
      const int passes = ml_cuda_decode_passes(T, 1);
      mld_need(1, shared_inter, hidden, T, passes, 1, 0, 0, sm_count, partial_floats, ticket_count);
      mld_need(0, hidden, shared_inter, T, passes, 1, 0, 0, sm_count, partial_floats, ticket_count);
    }
  }
}

/* ---- launches ------------------------------------------------------------------ */

enum { MLD_K_SWIGLU_BF16, MLD_K_SWIGLU_F16, MLD_K_SCALED_BF16, MLD_K_SCALED_BF16_F32,
       MLD_K_SCALED_F16, MLD_K_SCALED_F16_F32,
       /* FP8 operands, output dtype as named */
       MLD_K_FP8_SWIGLU_BF16, MLD_K_FP8_SWIGLU_F16, MLD_K_FP8_SCALED_BF16, MLD_K_FP8_SCALED_F16,
       MLD_K_FP8_SCALED_F32, MLD_K_FP8_SWIGLU_F32, MLD_K_COUNT };
/* [device][kernel of 64-row passes, then of 16-row ones] */
/* [device][kernel of 64-row passes, of 16-row ones, of the short-k FP8 ring] */
static unsigned char mld_smem_ready[ML_CUDA_MAX_DEVICES * 3 * MLD_K_COUNT];

/* The ring is past the 48 KiB default: the kernel's limit raised once per device. */
static moelink_status_t mld_allow_smem(const void *kernel, int which, int bytes) {
  return ml_cuda_allow_smem(kernel, mld_smem_ready, 3 * MLD_K_COUNT, which, bytes);
}

template <int DT, int MODE, int OUT_F32, int FP8, int BN, int SHORT = 0>
static moelink_status_t mld_launch_bn(const mld_args *p, unsigned grid, int which, int pdl,
                                      const char *name, cudaStream_t stream) {
  void (*kernel)(const mld_args) = mld_kernel<DT, MODE, OUT_F32, FP8, BN, SHORT>;
  const int smem = FP8 ? mld_cfg<BN>::fp8_smem_bytes(SHORT) : mld_cfg<BN>::SMEM_BYTES;
  const int slot = SHORT ? 2 : BN == MLD_BN ? 0 : 1;
  ML_TRY(mld_allow_smem((const void *)kernel, which + slot * MLD_K_COUNT, smem));
  void *args[] = {(void *)p};
  const cudaError_t e = ml_launch_kernel((const void *)kernel, dim3(grid, 1, 1),
                                         dim3(MLD_THREADS, 1, 1), (size_t)smem, pdl, stream, args);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ml_fail(MOELINK_ERR_CUDA, "launch of %s (%d-row passes, %u CTAs%s) failed: %s", name, BN,
                   grid, pdl ? ", programmatic dependent launch" : "", cudaGetErrorString(e));
  }
  ML_CUDA_LAUNCHED(name);
  mld_last_bn = BN;
  return MOELINK_SUCCESS;
}

/* The kernel of p->small's pass rows and, FP8, p->short_k's ring
 * (mld_prepare). */
template <int DT, int MODE, int OUT_F32, int FP8 = 0>
static moelink_status_t mld_launch(const mld_args *p, unsigned grid, int which, int pdl,
                                   const char *name, cudaStream_t stream) {
  if (FP8 && p->small && p->short_k)
    return mld_launch_bn<DT, MODE, OUT_F32, FP8, MLD_BN_SMALL, FP8>(p, grid, which, pdl, name,
                                                                    stream);
  if (p->small)
    return mld_launch_bn<DT, MODE, OUT_F32, FP8, MLD_BN_SMALL>(p, grid, which, pdl, name, stream);
  return mld_launch_bn<DT, MODE, OUT_F32, FP8, MLD_BN>(p, grid, which, pdl, name, stream);
}

/* Checks and fills everything but the mode-specific fields; *grid 0 means
 * there is nothing to do. fp8: e4m3 operands (dt is the output's dtype),
 * stages of 128 k. */
static moelink_status_t mld_prepare(const char *what, int swiglu, int fp8, moelink_dtype_t dt,
                                    const void *a, int lda, const void *b, int n, int k,
                                    const int32_t *tiles, const int32_t *num_tiles,
                                    int max_passes, int rows, void *out, const ml_decode_opts *o,
                                    mld_args *p, unsigned *grid) {
  *grid = 0;
  if (o == NULL) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: options are NULL", what);
  if (swiglu && o->out_rows != NULL)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: out_rows is for the scaled GEMMs only", what);
  if (dt != MOELINK_DTYPE_BF16 && dt != MOELINK_DTYPE_F16 &&
      !(fp8 && swiglu && dt == MOELINK_DTYPE_F32))
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: dtype %s not supported (bf16 or f16%s)", what,
                   moelink_dtype_name(dt), fp8 && swiglu ? ", or f32 out" : "");
  if (n < 0 || k < 0 || lda < k || rows < 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: n %d, k %d, lda %d, rows %d (need n, k, rows >= 0, lda >= k)", what, n, k,
                   lda, rows);
  if (n % 8 || k % 8 || lda % 8)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: n %d, k %d, lda %d must be multiples of 8 (16-byte rows)", what, n, k,
                   lda);
  if (fp8 && (n % MLD_FP8_BLOCK || k % MLD_FP8_BLOCK || lda % MLD_FP8_BLOCK))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: n %d, k %d, lda %d must be multiples of %d (the FP8 scale blocks)", what,
                   n, k, lda, MLD_FP8_BLOCK);
  int passes;
  if (tiles != NULL) {
    if (num_tiles == NULL)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: tiles given without num_tiles", what);
    if (max_passes < 0)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: max_passes %d < 0", what, max_passes);
    passes = max_passes;
  } else {
    passes = ml_cuda_decode_passes(rows, 1);
  }
  const int mb = mld_mblocks(swiglu, n);
  const int ktiles = mld_ceil_div(k, fp8 ? MLD_ROW_BYTES : MLD_BK);
  int kt_per = 0;
  const int forced = o->splits > 0 ? o->splits : (int)ml_param_DECODE_SPLITS();
  /* (the split policy counts tiles: a tile's further row blocks add CTAs
   * only where the tile has the rows) */
  const int splits = mld_splits(mb, ktiles, passes, o->sm_count, forced, tiles != NULL, &kt_per);
  if (passes == 0 || mb == 0 || rows == 0) return MOELINK_SUCCESS;
  /* 16-row passes where no tile can have more rows (the problem's rows, or
   * the caller's bound on a tile's), or where asked to cut tiles into them */
  const int wide = (o->flags & ML_DECODE_WIDE) != 0 || ml_param_DECODE_SMALL() == 0;
  const int bound = tiles != NULL && o->max_rows > 0 && o->max_rows < rows ? o->max_rows : rows;
  p->small = !wide && bound <= MLD_BN_SMALL;
  p->sub = 1;
  if (!wide && !p->small && tiles != NULL && (o->flags & ML_DECODE_NARROW) != 0) {
    p->small = 1;
    p->sub =
        (bound < ML_CUDA_TILE_ROWS ? bound + MLD_BN_SMALL - 1 : ML_CUDA_TILE_ROWS) / MLD_BN_SMALL;
    passes *= p->sub;
  }
  /* FP8, 16-row passes: the short-k ring where a CTA's k range is short */
  const int64_t short_k = ml_param_DECODE_FP8_SHORT_K();
  p->short_k = fp8 && p->small && short_k > 0 && (int64_t)kt_per <= short_k;
  const int64_t ctas = (int64_t)passes * mb * splits;
  if (ctas > INT_MAX)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: %d passes x %d column blocks x %d splits is "
                   "too many CTAs", what, passes, mb, splits);
  if (a == NULL || b == NULL || out == NULL)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: NULL operand (a %p, b %p, out %p)", what,
                   a, b, out);
  if (ml_cuda_misaligned(a) || ml_cuda_misaligned(b) || ml_cuda_misaligned(out))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: operands must be 16-byte aligned (a %p, b %p, out %p)", what, a, b, out);
  const int q = o->q_out != NULL || o->q_scale != NULL;
  if (q) {
    if (!(swiglu && fp8 && dt == MOELINK_DTYPE_F32))
      return ml_fail(MOELINK_ERR_UNSUPPORTED,
                     "%s: an FP8 copy of the output (q_out) is for the FP8 SwiGLU with an fp32 "
                     "output", what);
    if (o->q_out == NULL || o->q_scale == NULL || ml_cuda_misaligned(o->q_out) ||
        ((uintptr_t)o->q_scale & 3u))
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "%s: q_out %p and q_scale %p go together (16- and 4-byte aligned)", what,
                     (void *)o->q_out, (void *)o->q_scale);
    const size_t need_t = mld_tickets(passes, mb, 1);
    if (o->tickets == NULL || o->ticket_count < need_t)
      return ml_fail(MOELINK_ERR_INTERNAL, "%s: %zu tickets for the FP8 output, have %zu", what,
                     need_t, o->tickets ? o->ticket_count : (size_t)0);
  }
  if (splits > 1) {
    const size_t need_f = mld_partials(swiglu, n, rows, splits);
    const size_t need_t = mld_tickets(passes, mb, 0);
    if (o->partials == NULL || o->partial_floats < need_f || o->tickets == NULL ||
        o->ticket_count < need_t)
      return ml_fail(MOELINK_ERR_INTERNAL,
                     "%s: split-K scratch too small (%d splits need %zu partial floats and %zu "
                     "tickets, have %zu and %zu)", what, splits, need_f, need_t,
                     o->partials ? o->partial_floats : (size_t)0,
                     o->tickets ? o->ticket_count : (size_t)0);
    if (ml_cuda_misaligned(o->partials))
      return ml_fail(MOELINK_ERR_INTERNAL, "%s: partials %p not 16-byte aligned", what,
                     (void *)o->partials);
  }
  p->a = (const char *)a;
  p->a_index = NULL;
  p->b = (const char *)b;
  p->out = out;
  p->tiles = tiles;
  p->num_tiles = tiles != NULL ? num_tiles : NULL;
  p->row_scale = NULL;
  p->scale_index = NULL;
  p->out_rows = NULL;
  p->partials = o->partials;
  p->tickets = o->tickets;
  p->lda = lda;
  p->a_div = 1;
  p->n = n;
  p->k = k;
  p->rows = rows;
  p->passes = passes;
  p->mblocks = mb;
  p->splits = splits;
  p->kt_per = kt_per;
  /* A dense problem names its expert without the plan; a tiled one only
   * when the caller says the plan is complete. */
  p->early = tiles == NULL || (o->flags & ML_DECODE_PLAN_EARLY) != 0;
  p->no_mma = (o->flags & ML_DECODE_PROBE_NO_MMA) != 0;
  p->q = q ? o->q_out : NULL;
  p->q_scale = q ? o->q_scale : NULL;
  p->q_tickets = q ? o->tickets + mld_tickets(passes, mb, 0) : NULL; /* after the split ones */
  p->a_scale = NULL;
  p->b_scale = NULL;
  p->as_ld = lda / MLD_FP8_BLOCK;
  p->kblocks = k / MLD_FP8_BLOCK;
  p->b_rblocks = (swiglu ? 2 * n : n) / MLD_FP8_BLOCK;
  *grid = (unsigned)ctas;
  return MOELINK_SUCCESS;
}

extern "C" int ml_cuda_pdl_allowed(cudaStream_t stream) {
  return ml_param_DECODE_PDL() != 0 && stream != NULL && stream != cudaStreamLegacy;
}

static int mld_pdl(const ml_decode_opts *o, cudaStream_t stream) {
  return (o->flags & ML_DECODE_PDL) != 0 && ml_cuda_pdl_allowed(stream);
}

/* The gathered rows of a SwiGLU launch: row r reads a_index[r] / a_div. */
static moelink_status_t mld_gather(const char *what, const int32_t *a_index, int a_div,
                                   mld_args *p) {
  if (a_index != NULL && a_div < 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: a_div %d < 1", what, a_div);
  p->a_index = a_index;
  p->a_div = a_index != NULL ? a_div : 1;
  return MOELINK_SUCCESS;
}

/* The row scale of a scaled launch (NULL: 1; scale_index NULL: by row) and
 * its output rows by pointer (o->out_rows, indexed like the scales). */
static moelink_status_t mld_row_scales(const char *what, const float *row_scale,
                                       const int32_t *scale_index, int out_f32,
                                       const ml_decode_opts *o, mld_args *p) {
  if (o->out_rows != NULL && out_f32)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: output rows by pointer need a bf16/f16 output",
                   what);
  p->row_scale = row_scale;
  p->out_rows = o->out_rows;
  p->scale_index = row_scale != NULL || o->out_rows != NULL ? scale_index : NULL;
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_cuda_decode_swiglu(moelink_dtype_t dt, const void *a, int lda,
                                                  const int32_t *a_index, int a_div,
                                                  const void *b, int n, int k,
                                                  const int32_t *tiles, const int32_t *num_tiles,
                                                  int max_passes, int rows, void *out,
                                                  const ml_decode_opts *o, cudaStream_t stream) {
  const char *what = "ml_cuda_decode_swiglu";
  mld_args p;
  unsigned grid = 0;
  ML_TRY(mld_prepare(what, 1, 0, dt, a, lda, b, n, k, tiles, num_tiles, max_passes, rows, out, o,
                     &p, &grid));
  ML_TRY(mld_gather(what, a_index, a_div, &p));
  if (grid == 0) return MOELINK_SUCCESS;
  const int pdl = mld_pdl(o, stream);
  if (dt == MOELINK_DTYPE_BF16)
    return mld_launch<MOELINK_DTYPE_BF16, MLD_SWIGLU, 0>(&p, grid, MLD_K_SWIGLU_BF16, pdl,
                                                         "mld_kernel<bf16, swiglu>", stream);
  return mld_launch<MOELINK_DTYPE_F16, MLD_SWIGLU, 0>(&p, grid, MLD_K_SWIGLU_F16, pdl,
                                                      "mld_kernel<f16, swiglu>", stream);
}

extern "C" moelink_status_t ml_cuda_decode_scaled(moelink_dtype_t dt, const void *a, int lda,
                                                  const void *b, int n, int k,
                                                  const int32_t *tiles,
                                                  const int32_t *num_tiles, int max_passes,
                                                  int rows, const float *row_scale,
                                                  const int32_t *scale_index, void *out,
                                                  int out_f32, const ml_decode_opts *o,
                                                  cudaStream_t stream) {
  const char *what = "ml_cuda_decode_scaled";
  mld_args p;
  unsigned grid = 0;
  ML_TRY(mld_prepare(what, 0, 0, dt, a, lda, b, n, k, tiles, num_tiles, max_passes, rows, out, o,
                     &p, &grid));
  if (grid == 0) return MOELINK_SUCCESS;
  ML_TRY(mld_row_scales(what, row_scale, scale_index, out_f32, o, &p));
  const int pdl = mld_pdl(o, stream);
  if (dt == MOELINK_DTYPE_BF16)
    return out_f32 ? mld_launch<MOELINK_DTYPE_BF16, MLD_SCALED, 1>(
                         &p, grid, MLD_K_SCALED_BF16_F32, pdl, "mld_kernel<bf16, scaled, f32 out>",
                         stream)
                   : mld_launch<MOELINK_DTYPE_BF16, MLD_SCALED, 0>(
                         &p, grid, MLD_K_SCALED_BF16, pdl, "mld_kernel<bf16, scaled>", stream);
  return out_f32 ? mld_launch<MOELINK_DTYPE_F16, MLD_SCALED, 1>(
                       &p, grid, MLD_K_SCALED_F16_F32, pdl, "mld_kernel<f16, scaled, f32 out>",
                       stream)
                 : mld_launch<MOELINK_DTYPE_F16, MLD_SCALED, 0>(
                       &p, grid, MLD_K_SCALED_F16, pdl, "mld_kernel<f16, scaled>", stream);
}

/* ---- FP8 operands ------------------------------------------------------------------ */

static moelink_status_t mld_fp8_scales(const char *what, const float *a_scale,
                                       const float *b_scale, mld_args *p) {
  if (a_scale == NULL || b_scale == NULL)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: NULL scales (a_scale %p, b_scale %p)", what,
                   (const void *)a_scale, (const void *)b_scale);
  if (((uintptr_t)a_scale | (uintptr_t)b_scale) & 3u)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: scales must be 4-byte aligned (a_scale %p, b_scale %p)", what,
                   (const void *)a_scale, (const void *)b_scale);
  p->a_scale = a_scale;
  p->b_scale = b_scale;
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_cuda_fp8_swiglu(moelink_dtype_t out_dt, const uint8_t *a,
                                               const float *a_scale, int lda,
                                               const int32_t *a_index, int a_div,
                                               const uint8_t *b, const float *b_scale, int n,
                                               int k, const int32_t *tiles,
                                               const int32_t *num_tiles, int max_passes,
                                               int rows, void *out, const ml_decode_opts *o,
                                               cudaStream_t stream) {
  const char *what = "ml_cuda_fp8_swiglu";
  mld_args p;
  unsigned grid = 0;
  ML_TRY(mld_prepare(what, 1, 1, out_dt, a, lda, b, n, k, tiles, num_tiles, max_passes, rows,
                     out, o, &p, &grid));
  ML_TRY(mld_gather(what, a_index, a_div, &p));
  if (grid == 0) return MOELINK_SUCCESS;
  ML_TRY(mld_fp8_scales(what, a_scale, b_scale, &p));
  const int pdl = mld_pdl(o, stream);
  if (out_dt == MOELINK_DTYPE_F32)
    return mld_launch<MOELINK_DTYPE_BF16, MLD_SWIGLU, 1, 1>(
        &p, grid, MLD_K_FP8_SWIGLU_F32, pdl, "mld_kernel<e4m3 -> f32, swiglu>", stream);
  if (out_dt == MOELINK_DTYPE_BF16)
    return mld_launch<MOELINK_DTYPE_BF16, MLD_SWIGLU, 0, 1>(
        &p, grid, MLD_K_FP8_SWIGLU_BF16, pdl, "mld_kernel<e4m3 -> bf16, swiglu>", stream);
  return mld_launch<MOELINK_DTYPE_F16, MLD_SWIGLU, 0, 1>(
      &p, grid, MLD_K_FP8_SWIGLU_F16, pdl, "mld_kernel<e4m3 -> f16, swiglu>", stream);
}

extern "C" moelink_status_t ml_cuda_fp8_scaled(moelink_dtype_t out_dt, const uint8_t *a,
                                               const float *a_scale, int lda, const uint8_t *b,
                                               const float *b_scale, int n, int k,
                                               const int32_t *tiles, const int32_t *num_tiles,
                                               int max_passes, int rows, const float *row_scale,
                                               const int32_t *scale_index, void *out,
                                               int out_f32, const ml_decode_opts *o,
                                               cudaStream_t stream) {
  const char *what = "ml_cuda_fp8_scaled";
  mld_args p;
  unsigned grid = 0;
  ML_TRY(mld_prepare(what, 0, 1, out_dt, a, lda, b, n, k, tiles, num_tiles, max_passes, rows,
                     out, o, &p, &grid));
  if (grid == 0) return MOELINK_SUCCESS;
  ML_TRY(mld_fp8_scales(what, a_scale, b_scale, &p));
  ML_TRY(mld_row_scales(what, row_scale, scale_index, out_f32, o, &p));
  const int pdl = mld_pdl(o, stream);
  /* fp32 output: the output dtype plays no part, one kernel serves both */
  if (out_f32)
    return mld_launch<MOELINK_DTYPE_BF16, MLD_SCALED, 1, 1>(
        &p, grid, MLD_K_FP8_SCALED_F32, pdl, "mld_kernel<e4m3 -> f32, scaled>", stream);
  if (out_dt == MOELINK_DTYPE_BF16)
    return mld_launch<MOELINK_DTYPE_BF16, MLD_SCALED, 0, 1>(
        &p, grid, MLD_K_FP8_SCALED_BF16, pdl, "mld_kernel<e4m3 -> bf16, scaled>", stream);
  return mld_launch<MOELINK_DTYPE_F16, MLD_SCALED, 0, 1>(
      &p, grid, MLD_K_FP8_SCALED_F16, pdl, "mld_kernel<e4m3 -> f16, scaled>", stream);
}
