/* The routed-expert layer of a few tokens in one kernel (pipeline.h,
 * ml_cuda_moe_small).
 *
 * At one token the layer is a stream over the k chosen experts' weights, and
 * what the kernel-per-step pipeline adds to that stream is the chain before
 * it (the router's logits, a ticket, the selection, the plan) and the gaps
 * between its kernels (a GEMM's stream drains before the next one's fills).
 * Here one persistent grid, one CTA an SM, all resident (a cooperative
 * launch), does everything:
 *
 *   logits   every warp of the grid takes some (token, expert, part) dot
 *            products (each cut into lsplit parts of H, so that the grid's
 *            warps all have one: the barrier waits for the slowest warp)
 *            of the router, x . w_e in fp32, into a small global array;
 *   barrier  one grid-wide arrival counter;
 *   select   every CTA selects each token's experts and weights itself, from
 *            the same logits with the same code (so all CTAs agree), as the
 *            CPU backend's router does: scores, correction bias, group limit,
 *            top-k with ties toward the lower index, renormalization, scale;
 *   stream   one producer thread an SM streams TMA boxes of 128 weight rows x
 *            64 k (16 KiB, 128-byte swizzle) through a ring of stages in
 *            shared memory, gate/up boxes first, then down boxes, without a
 *            pause between the two; four consumer warps multiply each box by
 *            the token's vector on tensor cores (mma m16n8k16 with the weight
 *            rows as M and the token as the one live column of N);
 *   finish   a sixth warp takes each run's sums (a run: the steps of one
 *            unit in a CTA's range; all but the CTA's last, which the
 *            consumers finish) from the consumers through a two-slot
 *            stage in shared memory and does the run's round trips (partial
 *            sums and their ticket, SwiGLU, the pair's ready count) while
 *            the consumers go on with the next run's boxes
 *            (MOELINK_SMALL_LAYER_EPILOGUE_WARP);
 *   combine  finished output rows are weighted, rounded like the pipeline's
 *            y rows, and summed over the token's k experts in order.
 *
 * FP8 experts (cfg.fp8_experts, e4m3 weights with a scale per 128 x 128
 * block): a box is 128 rows x 128 k, exactly one block of the scale grid
 * (a gate/up box's two halves: one gate and one up block). The consumers
 * quantize the k range of the token row (or of the fp32 SwiGLU row) they
 * need into shared memory as moelink_quantize's FP8 does, e4m3 bytes and a
 * scale per 128, and multiply with wgmma m64n8k32 (sm_90 has no 8-bit
 * mma.sync): the box as A, the vector as B (mls_vec_desc), each box's sums
 * promoted in fp32 times its weight scale and the vector's.
 *
 * Work is shared out stream-K: the units of a phase (gate/up: a pair's 64
 * output columns, whose 64 gate and 64 up rows make one box; down: a pair's
 * 128 output rows) are cut into k steps of a box (64; FP8 128), and CTA b takes the steps
 * [b W / G, (b + 1) W / G) of the W of the phase, so every SM streams the
 * same number of bytes whatever the shapes. A unit cut between CTAs leaves
 * fp32 partial sums in global memory, one slot per part, added in part order
 * (results are bitwise reproducible) by the CTA of part 0, whose range ends
 * in the unit: the other parts' CTAs reach theirs sooner (a range that starts
 * in the unit) or as late; they store their sums and count themselves in
 * without waiting (MOELINK_SMALL_LAYER_PART0; 0: every part takes a ticket
 * and waits for it, and the last one adds the sums). A down unit
 * needs its pair's SwiGLU row complete: a counter per pair says how many of
 * its column units are stored, and the consumers wait on it before the first
 * box of such a unit (the producer never waits on those: the down weights
 * stream while the last gate/up units finish elsewhere). The output rows of a (token,
 * 128-row block) are summed by whichever of its k units is stored last
 * (a second ticket).
 *
 * Every counter is zero between launches: tickets are reset by the CTA that
 * takes the last one, the pair counters and the barrier by the last CTA to
 * leave. A wait that outlives MLS_WAIT_NS (a bug, never the schedule: every
 * CTA is resident) traps, so the launch fails instead of hanging.
 *
 * Where the down units number 90-100% of the CTAs (qwen3-30b-a3b at one
 * token: 128 units, 132 SMs), CTA b takes down unit b whole instead
 * (MOELINK_SMALL_LAYER_WHOLE_DOWN): no partial sums and no ticket between
 * CTAs in the phase whose chain of round trips ends the kernel. At one token
 * the token's row is loaded into the vector region once, while the grid
 * meets, for every gate/up run.
 *
 * Measured on an H200 (docs/PERF.md, "The layer in one kernel", "The
 * router's plan of a few pairs", "FP8 experts in the one-kernel layer", "The
 * one-kernel layer's chain"): with a ring of 6 stages it beats the pipeline
 * at one token (qwen3-30b-a3b -27%, FP8 -34%; mixtral-8x7b -3%, FP8 -7%); with the
 * deepest ring shared memory holds (11-13 stages) it was slower, and at 4
 * tokens it is (the stream's tail across SMs). So the layer takes it for one
 * token unless MOELINK_SMALL_LAYER_TOKENS says otherwise. */
#include "core/dtype.cuh"
#include "core/launch.cuh"
#include "cuda/cuda.h"
#include "cuda/gemm/decode.cuh"
#include "cuda/gemm/ptx.cuh"
#include "cuda/gemm/sm90.cuh"
#include "cuda/pipeline.h"
#include "cuda/quant.cuh"
#include "cuda/route.cuh"

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MLS_CONSUMERS 4                        /* warps that multiply */
#define MLS_THREADS ((MLS_CONSUMERS + 2) * 32) /* one that loads, one that finishes runs */
#define MLS_BK 64                              /* k a box (16-bit weights) */
#define MLS_BK8 128                            /* k a box (e4m3 weights): one scale block */
#define MLS_ROWS 128                           /* weight rows a box */
#define MLS_BOX (MLS_ROWS * MLS_BK * 2)        /* bytes a box: 16 KiB (both kinds) */
#define MLS_COLS_A 64                          /* output columns of a gate/up unit */
#define MLS_MIN_STAGES 4
#define MLS_SEL_FLOATS 1560       /* a warp's selection scratch (in the ring) */
#define MLS_WAIT_NS 4000000000ull /* 4 s */
#define MLS_MAX_TOKENS 8          /* tokens a launch */
#define MLS_STATIC_SMEM 4096      /* room left for the kernel's static shared memory */
#define MLS_VEC_PAD 128           /* e4m3 vector: bytes the wgmma operand reads past its end */

static_assert(MLS_BK8 == ML_FP8_BLOCK, "an e4m3 box is one k block of the scale grid");

static_assert(MLS_THREADS / 32 * MLS_SEL_FLOATS * 4 <= MLS_MIN_STAGES * MLS_BOX,
              "the selection scratch fits the ring");
static_assert(ML_CUDA_MAX_EXPERTS <= 512 && ML_CUDA_MAX_TOPK <= 16,
              "the selection scratch's layout");

typedef struct mls_params {
  const char *x;                                     /* [T, H] */
  const char *wr;                                    /* router [E, H] */
  const float *bias;                                 /* [E] or NULL */
  void *out;                                         /* [T, H] */
  float *logits;                                     /* [T, E, lsplit] parts */
  const float *gs, *ds; /* FP8: the weights' block scales (moelink_moe_weights_t's layout) */
  char *h;              /* [P, I] SwiGLU rows (dtype; FP8: fp32, quantized by their readers) */
  char *y;                                           /* [P, H] weighted expert outputs (dtype) */
  float *part_a, *part_b;                            /* [units][maxp][128] partial sums */
  uint32_t *tick_a, *tick_b, *tick_g, *ready, *sync; /* zero between launches */
  int64_t *stamps;  /* measurements: [G][ML_CUDA_SMALL_STAMPS] %globaltimer, or NULL */
  int32_t *ids_out; /* [T, k] or NULL: CTA 0's selection */
  float *wts_out;
  int T, H, I, E, k;
  int router, renormalize, n_group, topk_group;
  float scaling;
  int ncb, nob, ks_a, ks_b; /* column units a pair, row units a pair, k steps */
  int whole_b;              /* 1: down unit b to CTA b (no unit cut between CTAs) */
  int lsplit;               /* parts of H a router dot product is cut into */
  int row_once;             /* 1: one token's row into the vector region once, at the barrier */
  int epi_warp;             /* 1: runs' sums finished by the epilogue warp, 0: by the consumers */
  int part0;                /* 1: part 0 of a cut unit finishes it, the others publish and go on */
  long long w_a, w_b;       /* k steps of each phase */
  int maxp_a, maxp_b;       /* partial slots a unit */
  int stages;               /* ring stages (the vector region follows the ring and its barriers) */
  int vec_elems;            /* the vector region's elements (FP8: its e4m3 bytes, then
                               MLS_VEC_PAD, a scale per 128, two weight scales per 128) */
} mls_params;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* (sm_90a machine code only: the mbarrier and TMA helpers of gemm/sm90.cuh) */

/* ---- PTX ------------------------------------------------------------------------ */

static __device__ __forceinline__ uint32_t mls_ld_acquire(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/* Measurements: %globaltimer of phase ph of this CTA (args.stamps). */
static __device__ __forceinline__ void mls_stamp(const mls_params &p, int ph) {
  if (p.stamps != NULL)
    p.stamps[(size_t)blockIdx.x * ML_CUDA_SMALL_STAMPS + ph] = (int64_t)ml_globaltimer();
}

/* Spins until *p >= want (acquire); traps past MLS_WAIT_NS. */
static __device__ __forceinline__ void mls_wait_count(const uint32_t *p, uint32_t want) {
  if (mls_ld_acquire(p) >= want)
    return;
  const uint64_t t0 = ml_globaltimer();
  while (mls_ld_acquire(p) < want)
    if (ml_globaltimer() - t0 > MLS_WAIT_NS)
      __trap();
}

/* The consumer warps meet (named barrier 1 of one warpgroup's 128 threads,
 * sm90.cuh's; the producer warp never joins). */
static_assert(MLS_CONSUMERS * 32 == 128, "the consumers are one warpgroup");
static __device__ __forceinline__ void mls_consumers_sync(void) { ml_wg_sync(1); }

/* The group's barrier: the consumer warps', or with WARP the epilogue warp's. */
template <bool WARP> static __device__ __forceinline__ void mls_group_sync(void) {
  if (WARP)
    __syncwarp();
  else
    mls_consumers_sync();
}

/* The group's stores so far are published, then one arrival on ticket t:
 * whether it was the one that made the count `last` + 1 (which then puts it
 * back to zero and may read what the others published). One acquire-release
 * add by one thread after the group's barrier (no sequentially consistent
 * fence: that one also waited for the loads in flight). The group:
 * the consumer warps (flag: a shared word), or with WARP the epilogue warp.
 * Every thread of the group calls it. */
template <bool WARP>
static __device__ __forceinline__ bool mls_ticket(uint32_t *t, uint32_t last, int *flag) {
  mls_group_sync<WARP>();
  int mine = 0;
  if ((threadIdx.x & (WARP ? 31 : ~0u)) == 0) {
    mine = ml_ticket_take(t, last);
    if (!WARP)
      *flag = mine;
  }
  if (WARP)
    return __shfl_sync(0xffffffffu, mine, 0) != 0;
  mls_consumers_sync();
  return *flag != 0;
}

/* The group's stores so far published with one release add to *count (by
 * its thread me == 0). Every thread of the group calls it. */
template <bool WARP>
static __device__ __forceinline__ void mls_group_release(uint32_t *count, int me) {
  mls_group_sync<WARP>();
  if (me == 0)
    ml_red_add_release_gpu(count, 1u);
}

/* ---- the schedule --------------------------------------------------------------- */

/* The CTA of G whose range [b W / G, (b + 1) W / G) holds step c < W. */
static __device__ __forceinline__ int mls_owner(long long c, long long W, int G) {
  return (int)(((c + 1) * (long long)G + W - 1) / W) - 1;
}

static __device__ __forceinline__ long long mls_start(int b, long long W, int G) {
  return (long long)b * W / G;
}

/* One run: the steps of one unit in a CTA's range, from its step i (na:
 * the CTA's gate/up steps; [a0, a1) and [b0, b1) its ranges of the phases).
 * parts: the CTAs that hold some of the unit (with W >= G every CTA from the
 * owner of its first step to the owner of its last; with W < G a CTA holds
 * one step at most and CTAs between hold none: one part a step), pidx this
 * CTA's part. */
typedef struct mls_run {
  int pa, u, kk0, kk1, pair, blk, parts, pidx;
} mls_run;

static __device__ __forceinline__ mls_run mls_run_at(const mls_params &p, int i, int na, int a0,
                                                     int a1, int b0, int b1) {
  const int G = (int)gridDim.x, b = (int)blockIdx.x;
  mls_run r;
  r.pa = i < na;
  const int c0 = r.pa ? a0 + i : b0 + (i - na);
  const int ks = r.pa ? p.ks_a : p.ks_b;
  const long long W = r.pa ? p.w_a : p.w_b;
  const int end = r.pa ? a1 : b1;
  r.u = c0 / ks;
  r.kk0 = c0 - r.u * ks;
  const int ue = (r.u + 1) * ks;
  r.kk1 = (ue < end ? ue : end) - r.u * ks;
  const int per = r.pa ? p.ncb : p.nob;
  r.pair = r.u / per;
  r.blk = r.u - r.pair * per;
  const long long us = (long long)r.u * ks, uend = us + ks;
  if (!r.pa && p.whole_b) {
    r.parts = 1;
    r.pidx = 0;
  } else if (W >= G) {
    const int first = mls_owner(us, W, G);
    r.parts = mls_owner(uend - 1, W, G) - first + 1;
    r.pidx = b - first;
  } else {
    r.parts = ks;
    r.pidx = r.kk0;
  }
  return r;
}

/* ---- selection ------------------------------------------------------------------ */

/* A sum or a max over the CTA's threads, in a fixed order (each warp's tree,
 * then the warps in order). red: MLS_THREADS / 32 floats of shared memory. */
static __device__ __forceinline__ float mls_cta_reduce(float v, bool is_max, float *red) {
  v = is_max ? ml_r_warp_max(v) : ml_r_warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0)
    red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll 1
  for (int w = 1; w < MLS_THREADS / 32; ++w)
    r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

/* One token's experts and weights by the whole CTA, as the CPU backend's
 * router chooses them (src/cpu/router.c): scores, correction bias, groups
 * kept by their rank, and the k winners by their rank (each expert counts
 * the experts ahead of it: a larger selection value, or an equal one at a
 * lower index), no rounds. scratch: MLS_SEL_FLOATS floats of shared memory:
 * scores [0, 512), selection values [512, 1024) (NaN: out of the running),
 * group scores [1024, 1536), the winners' scores [1536, 1552), the reduction
 * [1552, 1560). The groups' scores and every rank are the router kernel's
 * (route.cuh); the rest of the loops are rolled (once a launch). */
static __device__ __forceinline__ void mls_select(const mls_params &p, int t, float *scratch,
                                                  int *ids, float *wts) {
  /* the arguments in registers once (a callee reading them through a
   * reference would reload them from local memory after every shared store) */
  const int tid = (int)threadIdx.x, E = p.E, k = p.k, router = p.router;
  const int n_group = p.n_group, topk_group = p.topk_group, renormalize = p.renormalize;
  const float scaling = p.scaling;
  const float *__restrict__ bias = p.bias;
  float *sc = scratch, *q = scratch + 512, *gs = scratch + 1024, *ws = scratch + 1536;
  float *red = scratch + 1552;
  const int ls = p.lsplit;
  const float *lg = p.logits + (size_t)t * E * ls;
  float mx = -INFINITY;
  if (ls > 1) {
    /* the parts, all in flight at once, into the (not yet used) selection
     * values' and group scores' room (the host keeps E ls <= 1024) */
    float *raw = scratch + 512;
#pragma unroll 4
    for (int j = tid; j < E * ls; j += MLS_THREADS)
      raw[j] = __ldcg(lg + j);
    __syncthreads();
#pragma unroll 1
    for (int e = tid; e < E; e += MLS_THREADS) {
      /* a logit's parts in order */
      float v = raw[e * ls];
#pragma unroll 1
      for (int j = 1; j < ls; ++j)
        v += raw[e * ls + j];
      sc[e] = v;
      mx = fmaxf(mx, v);
    }
    __syncthreads(); /* (raw is the selection values' room) */
  } else {
#pragma unroll 1
    for (int e = tid; e < E; e += MLS_THREADS) {
      const float v = __ldcg(lg + e);
      sc[e] = v;
      mx = fmaxf(mx, v);
    }
  }
  if (t == 0 && tid == 0)
    mls_stamp(p, ML_SMALL_PH_SEL_LOADED);
  if (router == MOELINK_ROUTER_SOFTMAX_TOPK) {
    mx = mls_cta_reduce(mx, true, red);
    float sum = 0.0f;
#pragma unroll 1
    for (int e = tid; e < E; e += MLS_THREADS) {
      const float v = expf(sc[e] - mx);
      sc[e] = v;
      sum += v;
    }
    sum = mls_cta_reduce(sum, false, red);
#pragma unroll 1
    for (int e = tid; e < E; e += MLS_THREADS)
      sc[e] = sc[e] / sum;
  } else if (router == MOELINK_ROUTER_SIGMOID_TOPK) {
#pragma unroll 1
    for (int e = tid; e < E; e += MLS_THREADS)
      sc[e] = 1.0f / (1.0f + expf(-sc[e]));
  }
#pragma unroll 1
  for (int e = tid; e < E; e += MLS_THREADS)
    q[e] = bias != NULL ? sc[e] + __ldg(bias + e) : sc[e];
  __syncthreads();
  if (t == 0 && tid == 0)
    mls_stamp(p, ML_SMALL_PH_SEL_SCORED);
  if (n_group > 1) {
    /* group g scores the sum of its top two (one: its best); kept by rank */
    const int G = E / n_group, ng = n_group;
#pragma unroll 1
    for (int g = tid; g < ng; g += MLS_THREADS)
      gs[g] = ml_r_group_score(q, g, G);
    __syncthreads();
    int keep[4] = {0, 0, 0, 0}; /* ng <= 512: four groups a thread at most */
#pragma unroll 1
    for (int i = 0, g = tid; g < ng; ++i, g += MLS_THREADS)
      keep[i & 3] = ml_r_rank(gs, ng, g) < topk_group;
    __syncthreads();
#pragma unroll 1
    for (int i = 0, g = tid; g < ng; ++i, g += MLS_THREADS)
      gs[g] = keep[i & 3] ? 1.0f : 0.0f;
    __syncthreads();
#pragma unroll 1
    for (int e = tid; e < E; e += MLS_THREADS)
      if (gs[e / G] == 0.0f)
        q[e] = NAN;
    __syncthreads();
  }
#pragma unroll 1
  for (int e = tid; e < E; e += MLS_THREADS) {
    const float v = q[e];
    if (isnan(v))
      continue;
    /* (NaN, out of the running, is neither larger nor equal: never counted) */
    const int r = ml_r_rank(q, E, e);
    if (r < k) {
      ids[r] = e;
      ws[r] = sc[e];
    }
  }
  __syncthreads();
  if (t == 0 && tid == 0)
    mls_stamp(p, ML_SMALL_PH_SEL_RANKED);
  /* the weights: lane j < k of warp 0 computes winner j's, each lane with
   * the same sums in the same order (k <= 16) */
  if (tid < k) {
    const float own = ws[tid];
    float w = own;
    if (router == MOELINK_ROUTER_TOPK_SOFTMAX) {
      float m = ws[0];
#pragma unroll 4
      for (int j = 1; j < k; ++j)
        m = ws[j] > m ? ws[j] : m;
      float sum = 0.0f;
#pragma unroll 4
      for (int j = 0; j < k; ++j)
        sum += expf(ws[j] - m);
      w = expf(own - m) / sum;
    } else if (renormalize) {
      float sum = 0.0f;
#pragma unroll 4
      for (int j = 0; j < k; ++j)
        sum += ws[j];
      if (sum > 0.0f)
        w = own / sum;
    }
    wts[tid] = scaling != 1.0f ? w * scaling : w;
  }
  __syncthreads();
}

/* ---- the multiply ------------------------------------------------------------- */

/* One box (128 rows x 64 k at slot, 128-byte swizzle) times the vector's k
 * steps kb .. kb + 63 in shared memory (vec, 16-bit): warp w's two m16
 * fragments. The vector is the MMA's one live column of N: lanes 0-3 hold
 * it, the rest zero. Rows of fragment mi: row0[mi] + 0..15. */
template <int DT>
static __device__ __forceinline__ void mls_box(uint32_t slot, const uint32_t *vec32, int kb,
                                               const int row0[2], float acc[2][4]) {
  const int lane = (int)threadIdx.x & 31;
  const int a_x = (lane >> 4) ^ (lane & 7);
  const uint32_t a0 = slot + (uint32_t)(row0[0] + (lane & 15)) * 128u;
  const uint32_t a1 = slot + (uint32_t)(row0[1] + (lane & 15)) * 128u;
#pragma unroll
  for (int kk = 0; kk < MLS_BK / 16; ++kk) {
    uint32_t af[2][4], bf[2];
    const uint32_t col = (uint32_t)(((2 * kk) ^ a_x) << 4);
    ml_ldmatrix_x4(a0 + col, af[0]);
    ml_ldmatrix_x4(a1 + col, af[1]);
    const int kw = (kb + kk * 16) / 2 + (lane & 3);
    bf[0] = lane < 4 ? vec32[kw] : 0u;
    bf[1] = lane < 4 ? vec32[kw + 4] : 0u;
    ml_mma_16816<DT>(acc[0], af[0], bf);
    ml_mma_16816<DT>(acc[1], af[1], bf);
  }
}

/* wgmma's descriptor of the e4m3 vector at addr as the B operand of N = 8
 * rows, K-major, no swizzle: core matrices of 8 rows x 16 bytes with rows 16
 * bytes apart and the second 16 bytes of k 16 bytes on (LBO 16). Row 0 is the
 * vector's 32 bytes of the k32 step; rows 1-7 overlap the bytes after them,
 * products that land in the accumulator's columns 1-7, which nobody reads. */
static __device__ __forceinline__ uint64_t mls_vec_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(16 >> 4) << 16) |
         ((uint64_t)(128 >> 4) << 32);
}

/* One e4m3 box (128 rows x 128 k at slot, 128-byte swizzle, as TMA stored
 * it) times the vector's k block at vq (128 bytes in shared memory, scale
 * sx), wgmma m64n8k32 for the warpgroup's two 64-row halves, promoted in
 * fp32 as the FP8 GEMMs do: acc[h] += block sum x (sw[h] x sx). The eight
 * wgmma write eight accumulators (no chain of four through one: the box
 * waits for one wgmma's latency, not four), added in k order after. The
 * accumulator of half h sits where mls_box's fragment h would for rows
 * 64 h + 16 warp + lane / 4 (+ 8): column 0 in lanes 4j, values 0 and 2. */
static __device__ __forceinline__ void mls_box8(uint32_t slot, uint32_t vq, float sx,
                                                const float sw[2], float acc[2][4]) {
  float blk[MLS_BK8 / 32][2][4];
  ml_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < MLS_BK8 / 32; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      mld_wgmma_e4m3<8>(blk[kk][h],
                        ml_wgmma_desc(slot + (uint32_t)(h * 64 * 128)) + (uint64_t)(2 * kk),
                        mls_vec_desc(vq + (uint32_t)(32 * kk)), 0);
  ml_wgmma_commit();
  ml_wgmma_wait<0>();
  ml_acc_fence<MLS_BK8 / 32 * 8>(&blk[0][0][0]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float f = sw[h] * sx;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float b = blk[0][h][e];
#pragma unroll
      for (int kk = 1; kk < MLS_BK8 / 32; ++kk)
        b += blk[kk][h][e];
      acc[h][e] = fmaf(b, f, acc[h][e]);
    }
  }
}

template <int DT> static __device__ __forceinline__ float mls_to_f32(uint16_t v) {
  return ml_dt_half_to_f32<DT>((uint32_t)v);
}

template <int DT> static __device__ __forceinline__ uint16_t mls_round(float f) {
  return (uint16_t)ml_dt_f32_to_half<DT>(f);
}

/* ---- the vector ------------------------------------------------------------------ */

/* k steps kk0 .. kk1 - 1 of a vector into the vector region vec (16-bit:
 * the values, zeros past len; FP8: e4m3 bytes and a scale a 128 in vsc,
 * quantized as moelink_quantize's FP8, two blocks a warp at a time, 8 values
 * a lane) by the consumer warps (tid < 128). src: with x_src the token row
 * (dtype, read-only: __ldg), else a SwiGLU row (FP8: fp32, 16-bit: dtype)
 * stored by other CTAs in this launch (__ldcg). */
template <int DT, int FP8>
static __device__ __forceinline__ void mls_vec_load(const char *src, bool x_src, int kk0, int kk1,
                                                    int len, char *vec, float *vsc) {
  const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (FP8) {
#pragma unroll 1
    for (int j = 2 * warp; j < kk1 - kk0; j += 2 * MLS_CONSUMERS) {
      const int live = j + (lane >> 4) < kk1 - kk0;
      const int col = (kk0 + j + (lane >> 4)) * MLS_BK8 + (lane & 15) * 8;
      float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (live && x_src) {
        ml_dt_unpack16<DT>(__ldg((const uint4 *)(src + (size_t)col * 2)), f);
      } else if (live) {
        const float4 lo = __ldcg((const float4 *)(src + (size_t)col * 4));
        const float4 hi = __ldcg((const float4 *)(src + (size_t)col * 4) + 1);
        f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w;
        f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
      }
      const uint2 q = ml_q_quantize8<MOELINK_QUANT_FP8>(f, col, live, vsc, lane);
      if (live)
        *(uint2 *)(vec + col) = q;
    }
    /* the vector's generic writes before wgmma's async-proxy reads */
    ml_fence_proxy_async();
  } else {
    const uint4 *s4 = (const uint4 *)src;
    const int q0 = kk0 * (MLS_BK / 8), q1 = kk1 * (MLS_BK / 8), lim = len / 8;
#pragma unroll 1
    for (int q = q0 + tid; q < q1; q += MLS_CONSUMERS * 32) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (q < lim)
        v = x_src ? __ldg(s4 + q) : __ldcg(s4 + q);
      ((uint4 *)vec)[q] = v;
    }
  }
}

/* ---- a run's sums ---------------------------------------------------------------- */

/* FP8: the weight scales of run R's boxes, contiguous in k from w0 + kk and
 * w1 + kk (a gate/up box's halves sit in two 128-row blocks: gate, up; a down
 * box in one). */
static __device__ __forceinline__ void mls_run_scales(const mls_params &p, const mls_run &R,
                                                      const int *ids, const float **w0,
                                                      const float **w1) {
  const int e = ids[R.pair];
  if (R.pa) {
    const size_t rb = (size_t)e * (size_t)(2 * p.I / MLS_BK8) + (size_t)(R.blk / 2);
    *w0 = p.gs + rb * (size_t)p.ks_a;
    *w1 = p.gs + (rb + (size_t)(p.I / MLS_BK8)) * (size_t)p.ks_a;
  } else {
    *w0 = *w1 = p.ds + ((size_t)e * (size_t)p.nob + (size_t)R.blk) * (size_t)p.ks_b;
  }
}

/* FP8: scale q of a run's 2 nk (its k steps kk0 .. kk0 + nk - 1 from w0,
 * then the same from w1). */
static __device__ __forceinline__ const float *mls_scale_at(const float *w0, const float *w1,
                                                            int kk0, int nk, int q) {
  return q >= nk ? w1 + kk0 + q - nk : w0 + kk0 + q;
}

/* sum + p0[q MLS_ROWS] for q < n added in q order, four loads in flight at a
 * time. */
static __device__ __forceinline__ float mls_sum_parts(float sum, const float *p0, int n) {
#pragma unroll 1
  for (int q = 0; q < n; q += 4) {
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      x[j] = q + j < n ? __ldcg(p0 + (size_t)(q + j) * MLS_ROWS) : 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (q + j < n)
        sum += x[j];
  }
  return sum;
}

/* Unit R.u's partial slots (slot q at q MLS_ROWS). */
static __device__ __forceinline__ float *mls_part_slots(const mls_params &p, const mls_run &R) {
  return (R.pa ? p.part_a : p.part_b) +
         (size_t)R.u * (size_t)(R.pa ? p.maxp_a : p.maxp_b) * MLS_ROWS;
}

/* This part's sums into its slot (the holders' four each). */
static __device__ __forceinline__ void mls_part_store(const mls_run &R, float *part,
                                                      const int trow[2][2], const float v[2][2],
                                                      bool holder) {
  if (holder)
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        __stcg(part + (size_t)R.pidx * MLS_ROWS + trow[mi][hh], v[mi][hh]);
}

/* With p.part0, a part of a cut unit other than part 0 only stores its sums
 * and counts itself in: nothing for it to wait on. */
static __device__ __forceinline__ bool mls_publishes_only(const mls_params &p, const mls_run &R) {
  return p.part0 && R.parts > 1 && R.pidx > 0;
}

/* Run R's 128 sums to where they go. The thread holds (when holder) the
 * sums v[mi][hh] of the unit's tile rows trow[mi][hh]; at gate/up mi 0 holds
 * gate rows and mi 1 their up rows. With more parts than one they go through
 * the unit's partial slots and ticket and the last part's CTA goes on with
 * the whole sums: gate/up: h = SwiGLU, then the pair's ready count; down: the
 * weighted rows y and, by the last of the token's k units of this row block,
 * the token's output rows. With p.part0, part 0's CTA goes on (once the
 * others counted themselves in) and the others return after their count.
 * The group: the consumer warps (128 threads, flag a shared word) or with
 * WARP the epilogue warp. */
template <int DT, int FP8, bool WARP>
static __device__ __forceinline__ void mls_finish(const mls_params &p, const mls_run &R,
                                                  const int trow[2][2], float v[2][2], bool holder,
                                                  const float *wts, int *flag) {
  const int me = WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
  const int nth = WARP ? 32 : MLS_CONSUMERS * 32;
  if (R.parts > 1) {
    float *part = mls_part_slots(p, R);
    uint32_t *tick = (R.pa ? p.tick_a : p.tick_b) + R.u;
    if (p.part0) {
      /* part 0 (the end of its CTA's range, the last to be reached) waits
       * for the others' counts and adds their sums after its own */
      if (mls_publishes_only(p, R)) {
        mls_part_store(R, part, trow, v, holder);
        mls_group_release<WARP>(tick, me);
        return;
      }
      if (me == 0) {
        mls_wait_count(tick, (uint32_t)(R.parts - 1));
        *tick = 0u; /* (every count of this launch is in) */
      }
      mls_group_sync<WARP>();
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          v[mi][hh] =
              holder ? mls_sum_parts(v[mi][hh], part + MLS_ROWS + trow[mi][hh], R.parts - 1) : 0.0f;
    } else {
      mls_part_store(R, part, trow, v, holder);
      if (!mls_ticket<WARP>(tick, (uint32_t)(R.parts - 1), flag))
        return;
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          v[mi][hh] = holder ? mls_sum_parts(0.0f, part + trow[mi][hh], R.parts) : 0.0f;
    }
  }
  if (R.pa) {
    /* h = silu(gate) * up, rounded to the dtype as the pipeline stores it
     * (FP8: kept in fp32 until its readers quantize it) */
    if (holder)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int col = R.blk * MLS_COLS_A + trow[0][hh];
        const float hv = mld_swiglu(v[0][hh], v[1][hh]);
        if (col < p.I && FP8)
          ((float *)p.h)[(size_t)R.pair * p.I + col] = hv;
        else if (col < p.I)
          ((uint16_t *)p.h)[(size_t)R.pair * p.I + col] = mls_round<DT>(hv);
      }
    mls_group_release<WARP>(p.ready + R.pair, me);
  } else {
    /* y = w * rows, rounded as the pipeline's y rows; the token's row block
     * is summed by the last of its k units */
    const float w = wts[R.pair];
    uint16_t *y = (uint16_t *)p.y + (size_t)R.pair * p.H;
    if (holder)
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int o = R.blk * MLS_ROWS + trow[mi][hh];
          if (o < p.H)
            y[o] = mls_round<DT>(w * v[mi][hh]);
        }
    const int t = R.pair / p.k;
    if (mls_ticket<WARP>(p.tick_g + (size_t)t * p.nob + R.blk, (uint32_t)(p.k - 1), flag)) {
      /* every row's k values in flight at once, then added in order */
      constexpr int RPT = WARP ? MLS_ROWS / 32 : 1;
      static_assert(WARP || MLS_CONSUMERS * 32 == MLS_ROWS, "a consumer thread a row");
      uint16_t yv[RPT][ML_CUDA_MAX_TOPK];
#pragma unroll
      for (int rr = 0; rr < RPT; ++rr) {
        const int o = R.blk * MLS_ROWS + me + rr * nth;
        const uint16_t *yt = (const uint16_t *)p.y + (size_t)t * p.k * p.H + o;
#pragma unroll
        for (int j = 0; j < ML_CUDA_MAX_TOPK; ++j)
          yv[rr][j] = o < p.H && j < p.k ? __ldcg(yt + (size_t)j * p.H) : (uint16_t)0;
      }
#pragma unroll
      for (int rr = 0; rr < RPT; ++rr) {
        const int o = R.blk * MLS_ROWS + me + rr * nth;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < ML_CUDA_MAX_TOPK; ++j)
          if (j < p.k)
            sum += mls_to_f32<DT>(yv[rr][j]);
        if (o < p.H)
          ((uint16_t *)p.out)[(size_t)t * p.H + o] = mls_round<DT>(sum);
      }
    }
  }
}

/* ---- the kernel ------------------------------------------------------------------ */

template <int DT, int FP8>
static __device__ __forceinline__ void mls_body(const CUtensorMap *map_gu_p,
                                                const CUtensorMap *map_d_p, const mls_params &p) {
  const CUtensorMap &map_gu = *map_gu_p, &map_d = *map_d_p;
  extern __shared__ __align__(1024) char mls_smem[];
  __shared__ int s_ids[MLS_MAX_TOKENS * ML_CUDA_MAX_TOPK];
  __shared__ float s_wts[MLS_MAX_TOKENS * ML_CUDA_MAX_TOPK];
  __shared__ int s_flag;
  __shared__ float s_stage[2 * MLS_ROWS]; /* runs' sums on their way to the epilogue warp */
  __shared__ __align__(8) uint64_t s_ebar[4];
  const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = (int)gridDim.x, b = (int)blockIdx.x;
  const uint32_t raw = ml_smem_u32(mls_smem);
  const uint32_t ring = (raw + 1023u) & ~1023u;
  char *ring_p = mls_smem + (ring - raw);
  const int S = p.stages;
  const uint32_t full = ring + (uint32_t)(S * MLS_BOX), empty = full + 8u * (uint32_t)S;
  const uint32_t efull = ml_smem_u32(s_ebar), efree = efull + 16u; /* two slots each */
  constexpr int BK = FP8 ? MLS_BK8 : MLS_BK;
  char *vec_p = ring_p + (size_t)S * MLS_BOX + 16 * (size_t)S;
  uint16_t *vec = (uint16_t *)vec_p;                                 /* 16-bit vector */
  float *vsc = (float *)(vec_p + (size_t)p.vec_elems + MLS_VEC_PAD); /* FP8: its scales */
  float *wsc = vsc + p.vec_elems / MLS_BK8; /* FP8: a run's weight scales, [2][vec_elems / 128] */

  if (tid == MLS_CONSUMERS * 32) {
    /* the boxes' descriptors on their way while the router works */
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_gu) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_d) : "memory");
  }
  if (tid == 0) {
    mls_stamp(p, ML_SMALL_PH_START);
    for (int s = 0; s < S; ++s) {
      ml_mbar_init(full + 8u * (uint32_t)s, 1);
      ml_mbar_init(empty + 8u * (uint32_t)s, MLS_CONSUMERS);
    }
    for (int q = 0; q < 2; ++q) {
      ml_mbar_init(efull + 8u * (uint32_t)q, MLS_CONSUMERS * 32);
      ml_mbar_init(efree + 8u * (uint32_t)q, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  /* ---- logits: the grid's warps share the T x E x lsplit dot products ---- */
  {
    const int nw = G * (MLS_THREADS / 32), H8 = p.H / 8, ls = p.lsplit;
    for (int d = b * (MLS_THREADS / 32) + warp; d < p.T * p.E * ls; d += nw) {
      const int te = d / ls, part = d - te * ls, t = te / p.E, e = te - t * p.E;
      const uint4 *xr = (const uint4 *)(p.x + (size_t)t * p.H * 2);
      const uint4 *wr = (const uint4 *)(p.wr + (size_t)e * p.H * 2);
      const int q0 = (int)((long long)part * H8 / ls), q1 = (int)((long long)(part + 1) * H8 / ls);
      float acc = 0.0f;
#pragma unroll 4
      for (int q = q0 + lane; q < q1; q += 32) {
        float xv[8], wv[8];
        ml_dt_unpack16<DT>(__ldg(xr + q), xv);
        ml_dt_unpack16<DT>(__ldg(wr + q), wv);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          acc = fmaf(xv[i], wv[i], acc);
      }
      acc = ml_r_warp_sum(acc);
      if (lane == 0)
        p.logits[d] = acc;
    }
  }
  __syncthreads();
  if (tid == 0) {
    mls_stamp(p, ML_SMALL_PH_LOGITS);
    ml_red_add_release_gpu(p.sync, 1u);
  }
  /* one token: its whole row into the vector region while the grid meets,
   * once for every gate/up run (the down runs overwrite it after) */
  const bool x_once = p.row_once && p.T == 1;
  if (x_once && tid < MLS_CONSUMERS * 32)
    mls_vec_load<DT, FP8>(p.x, true, 0, p.ks_a, p.H, vec_p, vsc);
  if (tid == 0) {
    mls_wait_count(p.sync, (uint32_t)G);
    mls_stamp(p, ML_SMALL_PH_BARRIER);
  }
  __syncthreads();

  /* (the host keeps every step count below 2^31) */
  const int a0 = (int)mls_start(b, p.w_a, G), a1 = (int)mls_start(b + 1, p.w_a, G);
  int b0 = (int)mls_start(b, p.w_b, G), b1 = (int)mls_start(b + 1, p.w_b, G);
  if (p.whole_b) {
    const int units = (int)(p.w_b / p.ks_b);
    b0 = (b < units ? b : units) * p.ks_b;
    b1 = (b + 1 < units ? b + 1 : units) * p.ks_b;
  }
  const int na = a1 - a0, n = na + (b1 - b0);

  /* ---- selection: every CTA for itself (scratch in the idle ring) ---- */
  for (int t = 0; t < p.T; ++t)
    mls_select(p, t, (float *)ring_p, s_ids + t * p.k, s_wts + t * p.k);
  /* the scratch's generic writes before the boxes' async-proxy ones */
  ml_fence_proxy_async();
  __syncthreads();
  if (b == 0 && p.ids_out != NULL)
    for (int q = tid; q < p.T * p.k; q += MLS_THREADS) {
      p.ids_out[q] = s_ids[q];
      p.wts_out[q] = s_wts[q];
    }

  if (warp == MLS_CONSUMERS) {
    /* ---- producer: one thread streams every box of this CTA's steps ---- */
    if (lane == 0) {
      mls_stamp(p, ML_SMALL_PH_SELECTED);
      const uint64_t pol = ml_l2_evict_first();
      int s = 0, u = a0 / p.ks_a, kk = a0 - u * p.ks_a;
      uint32_t ph = 0; /* parity of slot s's current round */
      for (int i = 0; i < n; ++i) {
        if (i == na) { /* the down steps from here */
          u = b0 / p.ks_b;
          kk = b0 - u * p.ks_b;
        }
        if (i >= S)
          ml_mbar_wait(empty + 8u * (uint32_t)s, ph ^ 1u);
        const uint32_t dst = ring + (uint32_t)(s * MLS_BOX), bar = full + 8u * (uint32_t)s;
        if (i + 1 == n)
          mls_stamp(p, ML_SMALL_PH_LAST_ISSUE);
        ml_mbar_arrive_tx(bar, MLS_BOX);
        if (i < na) {
          const int pair = u / p.ncb, cb = u - pair * p.ncb;
          ml_tma_load_4d_hint(dst, &map_gu, bar, kk * BK, cb * MLS_COLS_A, 0, s_ids[pair], pol);
          if (++kk == p.ks_a) {
            kk = 0;
            ++u;
          }
        } else {
          const int pair = u / p.nob, ob = u - pair * p.nob;
          ml_tma_load_4d_hint(dst, &map_d, bar, kk * BK, ob * MLS_ROWS, 0, s_ids[pair], pol);
          if (++kk == p.ks_b) {
            kk = 0;
            ++u;
          }
        }
        if (++s == S) {
          s = 0;
          ph ^= 1u;
        }
      }
    }
  } else if (warp < MLS_CONSUMERS) {
    /* ---- consumers ---- */
    const uint32_t *vec32 = (const uint32_t *)vec;
    const int fr = lane >> 2;            /* accumulator row within a fragment's 8 */
    const bool holder = (lane & 3) == 0; /* lanes holding the live column */
    int i = 0, s = 0, run = 0, pub = 0;
    uint32_t ph = 0;    /* parity of slot s's current round */
    float w_next = 0.f; /* FP8: this thread's first scale of the next run, on its way */
    bool have_next = false;
    while (i < n) {
      const mls_run R = mls_run_at(p, i, na, a0, a1, b0, b1);
      const bool pa = R.pa;
      const int kk0 = R.kk0, kk1 = R.kk1, pair = R.pair;
      const int len = pa ? p.H : p.I;

      /* the vector's k range of this run into shared memory */
      mls_consumers_sync(); /* everyone is done with the last run's */
      /* FP8: the run's weight scales, one a box and half, loaded once a run,
       * not a round trip a box: each thread's first one (loaded while the
       * last run streamed) stored after the vector's loads (down: by warps
       * 1-3, while thread 0 waits for the SwiGLU row), the rest, if any,
       * loaded here */
      const float *w0 = NULL, *w1 = NULL;
      const int nk = kk1 - kk0, t0 = pa ? 0 : 32, wstride = MLS_CONSUMERS * 32 - t0;
      const int q1st = tid - t0;
      float w1st = 0.0f;
      if (FP8) {
        mls_run_scales(p, R, s_ids, &w0, &w1);
        if (q1st >= 0 && q1st < 2 * nk)
          w1st = have_next ? w_next : __ldg(mls_scale_at(w0, w1, kk0, nk, q1st));
      }
      if (!pa && tid == 0) {
        if (i == na)
          mls_stamp(p, ML_SMALL_PH_GATE_UP_DONE);
        mls_wait_count(p.ready + pair, (uint32_t)p.ncb);
        if (i == na)
          mls_stamp(p, ML_SMALL_PH_READY);
      }
      if (!pa)
        mls_consumers_sync();
      if (!(pa && x_once))
        mls_vec_load<DT, FP8>(pa ? p.x + (size_t)(pair / p.k) * p.H * 2
                                 : p.h + (size_t)pair * p.I * (FP8 ? sizeof(float) : 2),
                              pa, kk0, kk1, len, vec_p, vsc);
      if (FP8) {
        const int vb = p.vec_elems / MLS_BK8;
        if (q1st >= 0 && q1st < 2 * nk)
          wsc[(q1st >= nk) * vb + kk0 + (q1st >= nk ? q1st - nk : q1st)] = w1st;
#pragma unroll 1
        for (int q = q1st + wstride; q >= wstride && q < 2 * nk; q += wstride) {
          const int hf = q >= nk, kk = kk0 + (hf ? q - nk : q);
          wsc[hf * vb + kk] = __ldg((hf ? w1 : w0) + kk);
        }
        /* the next run's first scales on their way while this run streams */
        have_next = i + nk < n;
        if (have_next) {
          const mls_run Rn = mls_run_at(p, i + nk, na, a0, a1, b0, b1);
          const int nkn = Rn.kk1 - Rn.kk0, qn = tid - (Rn.pa ? 0 : 32);
          const float *n0, *n1;
          mls_run_scales(p, Rn, s_ids, &n0, &n1);
          if (qn >= 0 && qn < 2 * nkn)
            w_next = __ldg(mls_scale_at(n0, n1, Rn.kk0, nkn, qn));
        }
      }
      mls_consumers_sync();

      int row0[2];
      if (FP8 || pa) {
        /* gate/up: the gate rows of the warp's 16 columns, then their up
         * rows; FP8 down alike (wgmma's two 64-row halves) */
        row0[0] = warp * 16;
        row0[1] = 64 + warp * 16;
      } else {
        row0[0] = warp * 32;
        row0[1] = warp * 32 + 16;
      }
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      for (int kk = kk0; kk < kk1; ++kk, ++i) {
        ml_mbar_wait(full + 8u * (uint32_t)s, ph);
        if (tid == 0 && i == 0)
          mls_stamp(p, ML_SMALL_PH_FIRST_BOX);
        if (tid == 0 && i == na)
          mls_stamp(p, ML_SMALL_PH_FIRST_DOWN_BOX);
        if (FP8) {
          const float sw[2] = {wsc[kk], wsc[p.vec_elems / MLS_BK8 + kk]};
          mls_box8(ring + (uint32_t)(s * MLS_BOX), ml_smem_u32(vec_p) + (uint32_t)(kk * MLS_BK8),
                   vsc[kk], sw, acc);
        } else {
          mls_box<DT>(ring + (uint32_t)(s * MLS_BOX), vec32, kk * MLS_BK, row0, acc);
        }
        __syncwarp();
        if (lane == 0)
          ml_mbar_arrive(empty + 8u * (uint32_t)s);
        if (++s == S) {
          s = 0;
          ph ^= 1u;
        }
      }

      /* tile rows of this thread's four sums: [mi][h] */
      int trow[2][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          trow[mi][hh] = row0[mi] + fr + 8 * hh;
      float v[2][2] = {{acc[0][0], acc[0][2]}, {acc[1][0], acc[1][2]}};
      if (!p.epi_warp && i < n && mls_publishes_only(p, R)) {
        /* a part that only publishes, before the CTA's last run: its sums
         * stored, its count released by the epilogue warp once every
         * consumer thread arrived on stage slot pub & 1 (no data there) */
        mls_part_store(R, mls_part_slots(p, R), trow, v, holder);
        const int slot = pub & 1, use = pub >> 1;
        if (use > 0)
          ml_mbar_wait(efree + 8u * (uint32_t)slot, (uint32_t)((use - 1) & 1));
        ml_mbar_arrive(efull + 8u * (uint32_t)slot);
        ++pub;
      } else if (p.epi_warp && i < n) {
        /* to the epilogue warp through stage slot run & 1 (free again once
         * it took what the run two before left there); the CTA's last run
         * the consumers finish themselves, four times the threads with
         * nothing else left to do */
        const int slot = run & 1, use = run >> 1;
        if (use > 0)
          ml_mbar_wait(efree + 8u * (uint32_t)slot, (uint32_t)((use - 1) & 1));
        if (holder)
#pragma unroll
          for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
              s_stage[slot * MLS_ROWS + trow[mi][hh]] = v[mi][hh];
        ml_mbar_arrive(efull + 8u * (uint32_t)slot);
      } else {
        mls_finish<DT, FP8, false>(p, R, trow, v, holder, s_wts, &s_flag);
      }
      ++run;
    }
  } else if (p.epi_warp) {
    /* ---- epilogue warp: each run's sums, in run order, while the consumers
     * go on with the next run (lane l: tile rows l + 32 hh + 64 mi) ---- */
    int i = 0, run = 0;
    while (i < n) {
      const mls_run R = mls_run_at(p, i, na, a0, a1, b0, b1);
      if (i + (R.kk1 - R.kk0) >= n)
        break; /* the last run: the consumers' */
      const int slot = run & 1, use = run >> 1;
      ml_mbar_wait(efull + 8u * (uint32_t)slot, (uint32_t)(use & 1));
      int trow[2][2];
      float v[2][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          trow[mi][hh] = 64 * mi + 32 * hh + lane;
          v[mi][hh] = s_stage[slot * MLS_ROWS + trow[mi][hh]];
        }
      __syncwarp();
      if (lane == 0)
        ml_mbar_arrive(efree + 8u * (uint32_t)slot);
      mls_finish<DT, FP8, true>(p, R, trow, v, true, s_wts, NULL);
      i += R.kk1 - R.kk0;
      ++run;
    }
  } else if (p.part0) {
    /* ---- epilogue warp, the consumers finishing: it releases the counts of
     * the parts that only publish (but in the CTA's last run), so that the
     * consumers do not wait for their stores ---- */
    int i = 0, pub = 0;
    while (i < n) {
      const mls_run R = mls_run_at(p, i, na, a0, a1, b0, b1);
      const int len = R.kk1 - R.kk0;
      if (i + len >= n)
        break;
      if (mls_publishes_only(p, R)) {
        const int slot = pub & 1, use = pub >> 1;
        ml_mbar_wait(efull + 8u * (uint32_t)slot, (uint32_t)(use & 1));
        if (lane == 0) {
          /* the consumers' stores, acquired through the stage barrier,
           * released with the count */
          ml_red_add_release_gpu((R.pa ? p.tick_a : p.tick_b) + R.u, 1u);
          ml_mbar_arrive(efree + 8u * (uint32_t)slot);
        }
        ++pub;
      }
      i += len;
    }
  }

  /* ---- leave: the last CTA out puts the counters back to zero ---- */
  if (tid == 0)
    mls_stamp(p, ML_SMALL_PH_CONSUMED);
  __syncthreads();
  if (tid == 0) {
    mls_stamp(p, ML_SMALL_PH_SUMS_DONE);
    /* the CTA's uses of the counters (behind the barrier above) released, the
     * other CTAs' acquired by the last one out; its zeros need no fence of
     * their own: the launch's end publishes them to the next one */
    if (ml_atom_add_acq_rel_gpu(p.sync + 1, 1u) == (uint32_t)(G - 1)) {
      for (int q = 0; q < p.T * p.k; ++q)
        p.ready[q] = 0u;
      p.sync[0] = 0u;
      p.sync[1] = 0u;
    }
  }
}
#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

template <int DT, int FP8>
static __global__ void __launch_bounds__(MLS_THREADS, 1)
    mls_kernel(const __grid_constant__ CUtensorMap map_gu,
               const __grid_constant__ CUtensorMap map_d, const mls_params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  mls_body<DT, FP8>(&map_gu, &map_d, p);
#else
  /* the host launches it on compute capability 9.0 only */
  __trap();
#endif
}

/* ---- host ------------------------------------------------------------------------ */

/* 1: where the down units number between 90% and 100% of the CTAs, each
 * CTA takes one whole unit (no partial sums, no ticket between CTAs) instead
 * of a stream-K share (qwen3-30b-a3b at one token: 128 units, 132 SMs). */
MOELINK_PARAM(SMALL_LAYER_WHOLE_DOWN, 1)

/* 1: each router dot product of the logits phase is cut into as many parts
 * of H (at least 256 elements each) as keep every warp of the grid busy,
 * instead of one warp a (token, expert); 0: one part. */
MOELINK_PARAM(SMALL_LAYER_LOGIT_SPLIT, 1)

/* 1: at one token, its row is loaded (FP8: quantized) into the vector region
 * once, while the grid meets, for every gate/up run; 0: each run loads its k
 * range as the runs of more tokens do. */
MOELINK_PARAM(SMALL_LAYER_ROW_ONCE, 1)

/* Which layers have a sixth warp finish each run but a CTA's last (the
 * partial sums' ticket, SwiGLU, the ready count, the weighted rows and the
 * output's ticket) while the consumers go on with the next run's boxes:
 * 1: FP8 experts only, 2: every layer, 0: none (the consumers finish every
 * run themselves, every round trip of it on their way). At one token it
 * took 1.9 us off qwen3-30b-a3b's FP8 layer and put 1-2.5 us on its bf16 one
 * (docs/PERF.md). */
MOELINK_PARAM(SMALL_LAYER_EPILOGUE_WARP, 1)

/* 1: a unit cut between CTAs is finished by the CTA of its part 0 (whose
 * range ends in it), which waits for the other parts' counts; the others
 * store their sums and count themselves in without waiting (consumers that
 * finish their own runs hand that count to the epilogue warp); 0: every part
 * takes a ticket and waits for it, the last one finishes. */
MOELINK_PARAM(SMALL_LAYER_PART0, 1)

/* At most this many ring stages (0: as many as shared memory holds). More
 * requests in flight made the stream slower: 6 measured fastest (4-8 within
 * 1.5 us of each other at one token, 11-13 3.4-4.5 us slower for
 * qwen3-30b-a3b). */
MOELINK_PARAM(SMALL_LAYER_STAGES, 6)

typedef struct mls_layout {
  size_t logits, h, y, part_a, part_b, tick_a, tick_b, tick_g, ready, sync;
  size_t zero_bytes, total;
  size_t part_a_floats, part_b_floats;
} mls_layout;

static long long mls_div_up(long long a, long long b) { return (a + b - 1) / b; }

/* Partial slots a unit of ks steps needs when W steps go to G CTAs. */
static int mls_maxp(int ks, long long W, int G) {
  const long long per = W / G;
  if (per < 1)
    return ks;
  const long long m = mls_div_up(ks, per) + 1;
  return (int)(m < ks ? m : ks);
}

typedef struct mls_shape {
  int P, ncb, nob, ks_a, ks_b;
  long long w_a, w_b;
} mls_shape;

/* k a box: 64 bf16/f16 values or 128 e4m3 ones (128 bytes either way) */
static int mls_bk(const moelink_moe_config_t *c) { return c->fp8_experts ? MLS_BK8 : MLS_BK; }

static mls_shape mls_shape_of(const moelink_moe_config_t *c, int T) {
  mls_shape s;
  s.P = T * c->top_k;
  s.ncb = (int)mls_div_up(c->inter, MLS_COLS_A);
  s.nob = (int)mls_div_up(c->hidden, MLS_ROWS);
  s.ks_a = (int)mls_div_up(c->hidden, mls_bk(c));
  s.ks_b = (int)mls_div_up(c->inter, mls_bk(c));
  s.w_a = (long long)s.P * s.ncb * s.ks_a;
  s.w_b = (long long)s.P * s.nob * s.ks_b;
  return s;
}

static int mls_max_tokens(const moelink_moe_config_t *c) {
  return c->max_tokens < MLS_MAX_TOKENS ? c->max_tokens : MLS_MAX_TOKENS;
}

/* The scratch of a layer: sized for every T up to mls_max_tokens on up to
 * sm_count CTAs; the counters first (the zero region). */
static void mls_layout_of(const moelink_moe_config_t *c, int sm_count, mls_layout *L) {
  memset(L, 0, sizeof *L);
  const int Tm = mls_max_tokens(c);
  const mls_shape m = mls_shape_of(c, Tm);
  for (int T = 1; T <= Tm; ++T) {
    const mls_shape s = mls_shape_of(c, T);
    const size_t fa = (size_t)s.P * s.ncb * mls_maxp(s.ks_a, s.w_a, sm_count) * MLS_ROWS;
    const size_t fb = (size_t)s.P * s.nob * mls_maxp(s.ks_b, s.w_b, sm_count) * MLS_ROWS;
    if (fa > L->part_a_floats)
      L->part_a_floats = fa;
    if (fb > L->part_b_floats)
      L->part_b_floats = fb;
  }
  size_t cur = 0;
  L->tick_a = ml_cuda_take(&cur, (size_t)m.P * m.ncb * 4);
  L->tick_b = ml_cuda_take(&cur, (size_t)m.P * m.nob * 4);
  L->tick_g = ml_cuda_take(&cur, (size_t)Tm * m.nob * 4);
  L->ready = ml_cuda_take(&cur, (size_t)m.P * 4);
  L->sync = ml_cuda_take(&cur, 2 * 4);
  L->zero_bytes = (cur + 255) & ~(size_t)255;
  /* T E lsplit floats: lsplit is 1, or keeps T E lsplit within the grid's
   * warps (at most sm_count of them a warp each) */
  const size_t dots = (size_t)Tm * c->num_experts, warps = (size_t)sm_count * (MLS_THREADS / 32);
  L->logits = ml_cuda_take(&cur, (dots > warps ? dots : warps) * 4);
  L->h = ml_cuda_take(&cur, (size_t)m.P * c->inter * (c->fp8_experts ? 4 : 2));
  L->y = ml_cuda_take(&cur, (size_t)m.P * c->hidden * 2);
  L->part_a = ml_cuda_take(&cur, L->part_a_floats * 4);
  L->part_b = ml_cuda_take(&cur, L->part_b_floats * 4);
  L->total = (cur + 255) & ~(size_t)255;
}

static int mls_vec_elems(const moelink_moe_config_t *c) {
  const int m = c->hidden > c->inter ? c->hidden : c->inter;
  return (int)mls_div_up(m, mls_bk(c)) * mls_bk(c);
}

/* Shared memory a launch asks for: the ring, its barriers, the vector (FP8:
 * its e4m3 bytes, the bytes wgmma reads past them, its scales, a run's two
 * rows of weight scales). */
static size_t mls_smem_bytes(const moelink_moe_config_t *c, int stages) {
  const size_t v = (size_t)mls_vec_elems(c);
  const size_t vec = c->fp8_experts ? v + MLS_VEC_PAD + 3 * (v / MLS_BK8) * sizeof(float) : v * 2;
  return 1024 + (size_t)stages * (MLS_BOX + 16) + vec;
}

/* Ring stages for the device's shared memory (0: not even the least). */
static int mls_stages(const moelink_moe_config_t *c, int smem_optin) {
  const size_t fixed = mls_smem_bytes(c, 0) + MLS_STATIC_SMEM;
  if ((size_t)smem_optin <= fixed)
    return 0;
  int s = (int)(((size_t)smem_optin - fixed) / (MLS_BOX + 16));
  const int64_t want = ml_param_SMALL_LAYER_STAGES();
  if (want > 0 && want < s)
    s = (int)want;
  return s >= MLS_MIN_STAGES ? s : 0;
}

extern "C" int ml_cuda_moe_small_fits(const moelink_moe_config_t *c, int num_tokens,
                                      int smem_optin) {
  if (num_tokens < 1 || num_tokens > mls_max_tokens(c))
    return 0;
  if (c->dtype != MOELINK_DTYPE_BF16 && c->dtype != MOELINK_DTYPE_F16)
    return 0;
  if (c->fp8_shared || c->shared_inter > 0)
    return 0;
  /* FP8: the scale grid's 128 x 128 blocks are the boxes' */
  if (c->fp8_experts && (c->hidden % MLS_BK8 || c->inter % MLS_BK8))
    return 0;
  if (c->num_experts > ML_CUDA_MAX_EXPERTS || c->top_k > ML_CUDA_MAX_TOPK)
    return 0;
  if (c->n_group > 1 &&
      (c->num_experts % c->n_group != 0 || c->topk_group < 1 || c->topk_group > c->n_group))
    return 0;
  /* TMA: 16-byte rows; boxes no larger than the tensors */
  if (c->hidden % 8 || c->inter % 8 || c->hidden < MLS_ROWS || c->inter < MLS_COLS_A)
    return 0;
  return mls_stages(c, smem_optin) > 0;
}

extern "C" size_t ml_cuda_moe_small_scratch(const moelink_moe_config_t *c, int sm_count,
                                            size_t *zero_bytes) {
  mls_layout L;
  mls_layout_of(c, sm_count, &L);
  if (zero_bytes)
    *zero_bytes = L.zero_bytes;
  return L.total;
}

/* [device][bf16, f16, then their FP8-expert kernels]: the kernel's shared
 * memory raised to the device's opt-in limit (less the static part) */
static unsigned char mls_ready[ML_CUDA_MAX_DEVICES * 4];

template <int DT, int FP8>
static moelink_status_t mls_launch(const CUtensorMap *gu, const CUtensorMap *d, const mls_params *p,
                                   int ctas, size_t smem, int optin, cudaStream_t st) {
  const int which = (DT == MOELINK_DTYPE_BF16 ? 0 : 1) + 2 * FP8;
  const moelink_status_t ps = ml_cuda_allow_smem((const void *)mls_kernel<DT, FP8>, mls_ready, 4,
                                                 which, optin - MLS_STATIC_SMEM);
  if (ps != MOELINK_SUCCESS)
    return ps;
  /* (a grid that cannot be resident at once fails the cooperative launch) */
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attrs[2];
  ml_launch_config(&cfg, attrs, dim3((unsigned)ctas, 1, 1), dim3(MLS_THREADS, 1, 1), smem, 0, 1,
                   st);
  /* every CTA resident at once, or the launch fails (the grid waits on itself) */
  attrs[cfg.numAttrs].id = cudaLaunchAttributeCooperative;
  attrs[cfg.numAttrs].val.cooperative = 1;
  cfg.numAttrs += 1;
  void *args[] = {(void *)gu, (void *)d, (void *)p};
  const cudaError_t e = cudaLaunchKernelExC(&cfg, (const void *)mls_kernel<DT, FP8>, args);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ml_fail(MOELINK_ERR_CUDA,
                   "launch of the small-batch layer kernel (%d CTAs, %zu bytes "
                   "of shared memory) failed: %s",
                   ctas, smem, cudaGetErrorString(e));
  }
  ML_CUDA_LAUNCHED("small-batch layer kernel");
  return MOELINK_SUCCESS;
}

extern "C" ml_cuda_moe_small_args ml_cuda_moe_small_args_for(const moelink_moe_config_t *cfg,
                                                             const moelink_moe_weights_t *w,
                                                             const void *x, int num_tokens,
                                                             void *out, void *scratch,
                                                             size_t scratch_bytes, int sm_count) {
  ml_cuda_moe_small_args a;
  memset(&a, 0, sizeof a);
  a.cfg = cfg;
  a.x = x;
  a.num_tokens = num_tokens;
  a.w = w;
  a.out = out;
  a.scratch = scratch;
  a.scratch_bytes = scratch_bytes;
  a.sm_count = sm_count;
  return a;
}

extern "C" moelink_status_t ml_cuda_moe_small(const ml_cuda_moe_small_args *a, cudaStream_t st) {
  const moelink_moe_config_t *c = a->cfg;
  const int T = a->num_tokens;
  if (T == 0)
    return MOELINK_SUCCESS;
  int optin = a->smem_optin;
  if (optin <= 0) {
    int dev = 0;
    ML_CUDA_TRY(cudaGetDevice(&dev));
    ML_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  }
  if (!ml_cuda_moe_small_fits(c, T, optin))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "small-batch layer kernel: %d tokens of this layer are not supported "
                   "(ml_cuda_moe_small_fits)",
                   T);
  const moelink_moe_weights_t *w = a->w;
  if (w == NULL || a->x == NULL || w->router == NULL || w->gate_up == NULL || w->down == NULL ||
      a->out == NULL || a->scratch == NULL || (c->correction_bias && w->correction_bias == NULL) ||
      (c->fp8_experts && (w->gate_up_scale == NULL || w->down_scale == NULL)))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "small-batch layer kernel: a NULL operand");
  if (ml_cuda_misaligned(a->x) || ml_cuda_misaligned(w->router) || ml_cuda_misaligned(w->gate_up) ||
      ml_cuda_misaligned(w->down) || ml_cuda_misaligned(a->out) || ml_cuda_misaligned(a->scratch))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "small-batch layer kernel: operands must be 16-byte aligned");
  const int ctas = a->ctas > 0 && a->ctas < a->sm_count ? a->ctas : a->sm_count;
  if (ctas < 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "small-batch layer kernel: no SMs");
  mls_layout L;
  mls_layout_of(c, a->sm_count, &L);
  if (a->scratch_bytes < L.total)
    return ml_fail(MOELINK_ERR_INTERNAL, "small-batch layer kernel: scratch %zu bytes < %zu",
                   a->scratch_bytes, L.total);
  const mls_shape s = mls_shape_of(c, T);
  mls_params p;
  memset(&p, 0, sizeof p);
  char *base = (char *)a->scratch;
  p.x = (const char *)a->x;
  p.wr = (const char *)w->router;
  p.bias = c->correction_bias ? w->correction_bias : NULL;
  p.gs = c->fp8_experts ? w->gate_up_scale : NULL;
  p.ds = c->fp8_experts ? w->down_scale : NULL;
  p.out = a->out;
  p.logits = (float *)(base + L.logits);
  p.h = base + L.h;
  p.y = base + L.y;
  p.part_a = (float *)(base + L.part_a);
  p.part_b = (float *)(base + L.part_b);
  p.tick_a = (uint32_t *)(base + L.tick_a);
  p.tick_b = (uint32_t *)(base + L.tick_b);
  p.tick_g = (uint32_t *)(base + L.tick_g);
  p.ready = (uint32_t *)(base + L.ready);
  p.sync = (uint32_t *)(base + L.sync);
  p.stamps = a->stamps;
  p.ids_out = a->ids;
  p.wts_out = a->weights;
  p.T = T;
  p.H = c->hidden;
  p.I = c->inter;
  p.E = c->num_experts;
  p.k = c->top_k;
  p.router = (int)c->router;
  p.renormalize = c->renormalize;
  p.n_group = c->n_group;
  p.topk_group = c->topk_group;
  p.scaling = c->routed_scaling;
  p.ncb = s.ncb;
  p.nob = s.nob;
  p.ks_a = s.ks_a;
  p.ks_b = s.ks_b;
  p.w_a = s.w_a;
  p.w_b = s.w_b;
  if (s.w_a >= INT_MAX / 2 || s.w_b >= INT_MAX / 2)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "small-batch layer kernel: %lld / %lld k steps", s.w_a,
                   s.w_b);
  p.maxp_a = mls_maxp(s.ks_a, s.w_a, ctas);
  p.maxp_b = mls_maxp(s.ks_b, s.w_b, ctas);
  const long long units_b = (long long)s.P * s.nob;
  {
    const int warps = ctas * (MLS_THREADS / 32), dots = T * c->num_experts;
    int ls = dots < warps ? warps / dots : 1;
    /* parts of at least 256 elements; the selection gathers a token's
     * E ls parts in 1024 floats of its scratch */
    int most = c->hidden / 256 > 1 ? c->hidden / 256 : 1;
    most = most < 1024 / c->num_experts ? most : 1024 / c->num_experts;
    p.lsplit = ml_param_SMALL_LAYER_LOGIT_SPLIT() != 0 ? (ls < most ? ls : most) : 1;
  }
  p.row_once = ml_param_SMALL_LAYER_ROW_ONCE() != 0;
  {
    const int64_t ew = ml_param_SMALL_LAYER_EPILOGUE_WARP();
    p.epi_warp = ew >= 2 || (ew == 1 && c->fp8_experts);
  }
  p.part0 = ml_param_SMALL_LAYER_PART0() != 0;
  p.whole_b =
      ml_param_SMALL_LAYER_WHOLE_DOWN() != 0 && units_b <= ctas && units_b * 10 >= 9LL * ctas;
  if ((size_t)s.P * s.ncb * p.maxp_a * MLS_ROWS > L.part_a_floats ||
      (size_t)s.P * s.nob * p.maxp_b * MLS_ROWS > L.part_b_floats)
    return ml_fail(MOELINK_ERR_INTERNAL, "small-batch layer kernel: partial slots too few");
  p.stages = mls_stages(c, optin);
  p.vec_elems = mls_vec_elems(c);
  const size_t smem = mls_smem_bytes(c, p.stages);
  /* (the maps' F32 stands for e4m3 bytes: boxes of 128 k) */
  const moelink_dtype_t wdt = c->fp8_experts ? MOELINK_DTYPE_F32 : c->dtype;
  CUtensorMap gu, d;
  ML_TRY(ml_sm90_map_b_box(&gu, wdt, w->gate_up, c->hidden, c->inter, 2, c->num_experts, MLS_COLS_A,
                           2, "small-batch layer kernel (gate/up)"));
  ML_TRY(ml_sm90_map_b_box(&d, wdt, w->down, c->inter, c->hidden, 1, c->num_experts, MLS_ROWS, 1,
                           "small-batch layer kernel (down)"));
  const int bf = c->dtype == MOELINK_DTYPE_BF16;
  if (c->fp8_experts)
    return bf ? mls_launch<MOELINK_DTYPE_BF16, 1>(&gu, &d, &p, ctas, smem, optin, st)
              : mls_launch<MOELINK_DTYPE_F16, 1>(&gu, &d, &p, ctas, smem, optin, st);
  return bf ? mls_launch<MOELINK_DTYPE_BF16, 0>(&gu, &d, &p, ctas, smem, optin, st)
            : mls_launch<MOELINK_DTYPE_F16, 0>(&gu, &d, &p, ctas, smem, optin, st);
}
