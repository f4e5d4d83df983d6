/* The router in one kernel: logits on tensor cores, then scores, correction
 * bias, group limit, top-k and final weights.
 *
 * A CTA owns 16 tokens (the M of mma.m16n8k16) and all E <= 512 experts (E
 * padded to a multiple of 8 with copies of the last row, whose columns are
 * never read). The hidden dimension streams through a 3-stage cp.async ring
 * of 64-element chunks: 16 x rows and E router rows per stage, each row 144
 * bytes apart so that the fragment loads (8 rows x 4 words per warp) hit 32
 * distinct banks. Warp w accumulates the 8-expert column tiles w, w+16, w+32,
 * w+48. After the last chunk the ring's memory is reused for the fp32 logits
 * and the selection scratch.
 *
 * Small batches leave most SMs idle, and the router's weights (up to 7 MiB)
 * then stream through one SM. With splits > 1 the chunks of a block are cut
 * into ranges, one CTA per range; each writes its fp32 partial logits to
 * global memory and takes a ticket; the CTA that takes the last ticket adds
 * the partials, resets the ticket and does the selection. Its sum has a
 * fixed shape, whichever CTA finishes last (deterministic results): one
 * thread per 4 logits and group of consecutive ranges, with up to ML_R_BATCH
 * loads in flight, then the groups in order. When that one CTA would read
 * more than 512 KiB, the sum takes two levels: the last CTA of each group of
 * ~sqrt(splits) ranges sums them, then the last of those sums the groups.
 * Nobody waits for anybody, so there is no deadlock whatever the scheduling.
 *
 * Selection: each token's warp computes its scores; the winners come from
 * the whole CTA (every (token, expert) computes its rank) while rows * E^2
 * is small, else each token's warp keeps the best groups (group limit) and
 * takes its k winners in k rounds of a warp-wide argmax (redux.sync of
 * order-preserving keys), holding the token's scores and keys in registers
 * where E <= 256 and groups are absent or multiples of 32 experts
 * (ml_r_select_regs), else in shared memory; each token's warp writes its
 * ids and weights
 * (given logits, from the GEMM engine at large batches:
 * ml_router_select_kernel, selection only). A single block of tokens
 * (T <= 16) also gets its plan from this kernel: the CTA that selected the
 * experts sorts the T*k pairs (plan.cuh), which saves the plan's launch.
 *
 * The kernel lets the next one launch at once: a kernel launched after it
 * with programmatic stream serialization waits (griddepcontrol.wait) before
 * it reads anything written here. Launched itself as a programmatic
 * dependent (args.pdl), it runs beside the previous kernel and its finishing
 * CTAs wait for that kernel before they exit, so that this grid completes
 * after it. */
#include "core/launch.cuh"
#include "cuda/cuda.h"
#include "cuda/gemm/ptx.cuh"
#include "cuda/plan.cuh"
#include "cuda/route.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ML_R_TOKENS 16
#define ML_R_WARPS 16
#define ML_R_THREADS (ML_R_WARPS * 32)
#define ML_R_KC 64                  /* hidden elements per stage */
#define ML_R_ROW 144                /* bytes between staged rows (128 + 16) */
#define ML_R_STAGES 3
#define ML_R_TILES_PER_WARP 4       /* ML_CUDA_MAX_EXPERTS / 8 / ML_R_WARPS */
#define ML_R_PER_LANE 16            /* ML_CUDA_MAX_EXPERTS / 32 */
#define ML_R_BATCH 8                /* partial loads in flight per thread */
#define ML_R_MAX_PARTS 8            /* parts of given logits (ml_cuda_gemm_splitk) */
#define ML_FULL 0xffffffffu

static_assert(ML_R_TILES_PER_WARP * 8 * ML_R_WARPS == ML_CUDA_MAX_EXPERTS, "tile ownership");
static_assert(ML_R_PER_LANE * 32 == ML_CUDA_MAX_EXPERTS, "selection registers");
static_assert(ML_CUDA_MAX_TOPK <= 32, "a lane keeps one winner");
static_assert(ML_R_THREADS == ML_P_THREADS, "the router's CTA builds the plan");
static_assert(ML_R_TOKENS * ML_CUDA_MAX_TOPK <= ML_P_THREADS, "a thread for each pair");

typedef struct ml_router_params {
  const void *x;
  const void *w;
  const float *bias;
  int32_t *ids;
  float *weights;
  float *partials;
  int32_t *tickets;
  const float *logits; /* NULL, or [parts][T, E] computed before: select only */
  int parts;           /* logits: their parts, added in order */
  ml_plan_ptrs plan;
  int build_plan;             /* one block of tokens: this CTA builds the plan too */
  int two_level;              /* split sums in two levels past 512 KiB (ml_r_group_splits) */
  int T, H, E, k;
  int router, renormalize, n_group, topk_group;
  float scaling;
  int64_t *stamps; /* measurements: ml_cuda_router_args.stamps */
  int regs;        /* a token's warp selects in registers (ml_r_select_regs) */
} ml_router_params;

static __host__ __device__ __forceinline__ int ml_r_epad(int E) { return (E + 7) & ~7; }

/* ---- small PTX wrappers ------------------------------------------------------ */

/* Thread 0 records the time of phase ph (args.stamps: measurements only). */
static __device__ __forceinline__ void ml_r_stamp(const ml_router_params &p, int ph) {
  if (p.stamps == NULL || threadIdx.x != 0)
    return;
  int64_t *s = p.stamps + ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * ML_CUDA_ROUTER_STAMPS;
  s[ph] = (int64_t)ml_globaltimer();
  s[ML_R_PH_COUNT + ph] = (int64_t)clock64();
}

static __device__ __forceinline__ void ml_r_cp16(void *smem, const void *gmem, int src_bytes) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  /* src_bytes 0 zero-fills the 16 bytes: chunks past H contribute nothing. */
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

static __device__ __forceinline__ void ml_r_commit(void) {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
static __device__ __forceinline__ void ml_r_wait(void) {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

static __device__ __forceinline__ uint32_t ml_r_lds(const char *p) {
  return *(const uint32_t *)p;
}

template <int DT>
static __device__ __forceinline__ void ml_r_mma(float *d, uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1) {
  if (DT == MOELINK_DTYPE_BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* ---- logits ---------------------------------------------------------------- */

/* Issues the copies of chunk `chunk` into one stage: 16 token rows (tokens
 * past T repeat the last one; their results are never used), then E_pad
 * router rows (rows past E repeat the last expert). */
static __device__ __forceinline__ void ml_r_load_stage(char *stage, const ml_router_params &p,
                                                       int t0, int chunk, int E_pad) {
  const int rows = ML_R_TOKENS + E_pad;
  const int k0 = chunk * ML_R_KC;
  for (int q = (int)threadIdx.x; q < rows * 8; q += ML_R_THREADS) {
    const int row = q >> 3, piece = q & 7;
    const int kk = k0 + piece * 8;
    const char *src;
    if (row < ML_R_TOKENS) {
      int t = t0 + row < p.T ? t0 + row : p.T - 1;
      src = (const char *)p.x + (size_t)t * (size_t)p.H * 2;
    } else {
      int e = row - ML_R_TOKENS < p.E ? row - ML_R_TOKENS : p.E - 1;
      src = (const char *)p.w + (size_t)e * (size_t)p.H * 2;
    }
    /* H is a multiple of 8: a 16-byte piece is wholly inside or past it. */
    const int inside = kk < p.H;
    ml_r_cp16(stage + row * ML_R_ROW + piece * 16, src + (inside ? (size_t)kk * 2 : 0),
              inside ? 16 : 0);
  }
}

/* acc += the 16 x 64 chunk of x times the warp's expert tiles.
 * m16n8k16 fragments (g = lane / 4, c = lane % 4): A regs {row g, k 2c..2c+1},
 * {row g+8, same k}, {row g, k +8}, {row g+8, k +8}; B regs {k 2c..2c+1,
 * expert g}, {k +8, expert g}. Both read as 32-bit words of staged rows. */
template <int DT>
static __device__ __forceinline__ void ml_r_mma_stage(const char *stage, float (*acc)[4],
                                                      int warp, int g, int c, int n_tiles) {
  const char *A = stage;
  const char *B = stage + ML_R_TOKENS * ML_R_ROW;
#pragma unroll
  for (int ks = 0; ks < ML_R_KC / 16; ++ks) {
    const int off = ks * 32 + c * 4;
    const uint32_t a0 = ml_r_lds(A + g * ML_R_ROW + off);
    const uint32_t a1 = ml_r_lds(A + (g + 8) * ML_R_ROW + off);
    const uint32_t a2 = ml_r_lds(A + g * ML_R_ROW + off + 16);
    const uint32_t a3 = ml_r_lds(A + (g + 8) * ML_R_ROW + off + 16);
#pragma unroll
    for (int m = 0; m < ML_R_TILES_PER_WARP; ++m) {
      const int j = warp + ML_R_WARPS * m;
      if (j < n_tiles) {
        const char *bp = B + (j * 8 + g) * ML_R_ROW + off;
        ml_r_mma<DT>(acc[m], a0, a1, a2, a3, ml_r_lds(bp), ml_r_lds(bp + 16));
      }
    }
  }
}

/* Writes the warp's accumulators for token rows < rows into a [16][E_pad]
 * fp32 array (C fragment: {row g, cols 2c, 2c+1}, {row g+8, same cols}). */
static __device__ __forceinline__ void ml_r_store_acc(float *dst, int E_pad, float (*acc)[4],
                                                      int warp, int g, int c, int n_tiles,
                                                      int rows) {
#pragma unroll
  for (int m = 0; m < ML_R_TILES_PER_WARP; ++m) {
    const int j = warp + ML_R_WARPS * m;
    if (j < n_tiles) {
      const int col = j * 8 + c * 2;
      if (g < rows) {
        dst[g * E_pad + col] = acc[m][0];
        dst[g * E_pad + col + 1] = acc[m][1];
      }
      if (g + 8 < rows) {
        dst[(g + 8) * E_pad + col] = acc[m][2];
        dst[(g + 8) * E_pad + col + 1] = acc[m][3];
      }
    }
  }
}

/* ---- selection --------------------------------------------------------------- */

/* Order-preserving 32-bit key of a score (no NaN: ml_r_scores turned those
 * into -inf): a > b as floats exactly when key(a) > key(b), -0 and +0 the
 * same key; every key is above 0, which stands for "no element". */
static __device__ __forceinline__ uint32_t ml_r_key(float v) {
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The score of a key (0 excluded): ml_r_key's inverse, +0 for both zeros. */
static __device__ __forceinline__ float ml_r_unkey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* The k largest of a warp's keys (ml_r_key; 0: no element) in decreasing
 * order, ties to the lower index: lane l holds element l + 32 i in key[i],
 * i < NL, and taken has the bits of its slots out of the running (no
 * element). Returns the lane's mask of chosen elements (bit i = element
 * lane + 32 i); lane 0 writes the winners to out[0..k) when out != NULL.
 * Each round: every lane's best free element by a tree of NL - 1
 * comparisons (the lower slot, the lower index, on ties), the warp's
 * largest key and then the lowest index holding it, both by redux.sync. */
template <int NL>
static __device__ __forceinline__ unsigned
ml_r_warp_topk_keys(const uint32_t (&key)[NL], unsigned taken, int k, int *out, int lane) {
  static_assert(NL <= ML_R_PER_LANE && (NL & (NL - 1)) == 0, "a lane's slots");
  unsigned chosen = 0;
  for (int j = 0; j < k; ++j) {
    uint32_t tk[NL];
    int ti[NL];
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      tk[i] = ((taken >> i) & 1u) ? 0u : key[i];
      ti[i] = i;
    }
    /* level d keeps the better of slots i and i + 2^d at i (a multiple of
     * 2^(d+1)), the lower one on ties */
#pragma unroll
    for (int d = 1; d < NL; d *= 2)
#pragma unroll
      for (int i = 0; i < NL; i += 2 * d) {
        const bool right = tk[i + d] > tk[i];
        tk[i] = right ? tk[i + d] : tk[i];
        ti[i] = right ? ti[i + d] : ti[i];
      }
    const uint32_t bk = tk[0];
    const uint32_t m = __reduce_max_sync(ML_FULL, bk);
    /* m > 0 while k <= n: some element is free */
    const uint32_t w = __reduce_min_sync(ML_FULL, bk == m && m != 0u ? (uint32_t)(lane + 32 * ti[0])
                                                                     : 0xffffffffu);
    const int be = w == 0xffffffffu ? 0 : (int)w; /* cannot happen with k <= n */
    if ((be & 31) == lane) {
      taken |= 1u << (be >> 5);
      chosen |= 1u << (be >> 5);
    }
    if (out != NULL && lane == 0)
      out[j] = be;
  }
  return chosen;
}

/* The same for the values a[0..n) (n <= 32 NL <= 512, no NaN). */
template <int NL>
static __device__ unsigned ml_r_warp_topk_n(const float *a, int n, int k, int *out, int lane) {
  uint32_t key[NL];
  unsigned taken = 0;
#pragma unroll
  for (int i = 0; i < NL; ++i) {
    const int e = lane + 32 * i;
    key[i] = e < n ? ml_r_key(a[e]) : 0u;
    if (e >= n)
      taken |= 1u << i;
  }
  return ml_r_warp_topk_keys<NL>(key, taken, k, out, lane);
}

/* The same with as few slots a lane as n needs: each of the k rounds finds
 * a lane's best slot by a tree over its slots, so fewer slots make a
 * shallower tree of fewer comparisons for E <= 256. */
static __device__ __forceinline__ unsigned ml_r_warp_topk(const float *a, int n, int k, int *out,
                                                          int lane) {
  if (n <= 128)
    return ml_r_warp_topk_n<4>(a, n, k, out, lane);
  if (n <= 256)
    return ml_r_warp_topk_n<8>(a, n, k, out, lane);
  return ml_r_warp_topk_n<ML_R_PER_LANE>(a, n, k, out, lane);
}

/* One token's scores, by one warp: L holds its fp32 logits and becomes the
 * unbiased scores, S gets the selection scores (bias added, NaN as -inf: a
 * total order). */
static __device__ void ml_r_scores(const ml_router_params &p, float *L, float *S, const float *B,
                                   int lane) {
  const int E = p.E;
  if (p.router == MOELINK_ROUTER_SOFTMAX_TOPK) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, L[e]);
    m = ml_r_warp_max(m);
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) sum += expf(L[e] - m);
    sum = ml_r_warp_sum(sum);
    for (int e = lane; e < E; e += 32) L[e] = expf(L[e] - m) / sum;
  } else if (p.router == MOELINK_ROUTER_SIGMOID_TOPK) {
    for (int e = lane; e < E; e += 32) L[e] = 1.0f / (1.0f + expf(-L[e]));
  }
  for (int e = lane; e < E; e += 32) {
    const float s = p.bias != NULL ? L[e] + B[e] : L[e];
    S[e] = isnan(s) ? -INFINITY : s;
  }
}

/* One token's k winners into O, by one warp: group limit (each group's
 * score by one lane, then its rank among the groups), then k rounds of a
 * warp-wide argmax. */
static __device__ void ml_r_choose_warp(const ml_router_params &p, float *S, float *G, int *O,
                                        int lane) {
  const int E = p.E;
  if (p.n_group > 1) {
    const int gsize = E / p.n_group;
    for (int g = lane; g < p.n_group; g += 32)
      G[g] = ml_r_group_score(S, g, gsize);
    __syncwarp();
    /* the topk_group best groups: those of rank < topk_group */
    unsigned kept = 0;
#pragma unroll
    for (int i = 0; i < ML_R_PER_LANE; ++i) {
      const int g = lane + 32 * i;
      if (g < p.n_group && ml_r_rank(G, p.n_group, g) < p.topk_group)
        kept |= 1u << i;
    }
    __syncwarp(); /* every lane has read G before it turns into flags */
#pragma unroll
    for (int i = 0; i < ML_R_PER_LANE; ++i) {
      const int g = lane + 32 * i;
      if (g < p.n_group) G[g] = ((kept >> i) & 1u) ? 1.0f : 0.0f;
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32)
      if (G[e / gsize] == 0.0f) S[e] = -INFINITY; /* dropped groups: excluded, never 0 */
    __syncwarp();
  }
  (void)ml_r_warp_topk(S, E, p.k, O, lane);
}

/* Whether a token's warp can select in registers (ml_r_select_regs): at
 * most 256 experts (8 a lane: more would spill) and no groups, or groups
 * of a multiple of 32 experts (lane l's slots i of group g are then
 * g m <= i < (g + 1) m, m = E / n_group / 32). */
static __device__ __forceinline__ bool ml_r_regs_ok(const ml_router_params &p) {
  return p.regs && p.E <= 256 &&
         (p.n_group <= 1 || (p.E % p.n_group == 0 && (p.E / p.n_group) % 32 == 0));
}

/* A group's score (the sum of its best two, -inf rather than NaN) from each
 * lane's best two keys b1 >= b2 of it (0: none): the warp's best, the
 * lowest lane holding it, and the best of the other lanes' bests and that
 * lane's second, by three redux.sync. Every lane of the warp calls it. */
static __device__ __forceinline__ float ml_r_group_pair(uint32_t b1, uint32_t b2, int lane) {
  const uint32_t best = __reduce_max_sync(ML_FULL, b1);
  const uint32_t at = __reduce_min_sync(ML_FULL, b1 == best ? (uint32_t)lane : 32u);
  const uint32_t second = __reduce_max_sync(ML_FULL, (uint32_t)lane == at ? b2 : b1);
  const float x = ml_r_unkey(best) + ml_r_unkey(second);
  return isnan(x) ? -INFINITY : x;
}

/* One token's scores and k winners by its warp, held in registers from the
 * logits' one load to the last round: the same scores (bitwise), groups and
 * winners as ml_r_scores + ml_r_choose_warp, without their shared-memory
 * round trips and serial scans. Lane l holds experts l + 32 i, i < NL
 * (32 NL >= E). L: the token's logits, which become its unbiased scores (for
 * ml_r_weights); B: the correction bias; O: the winners. A group's score
 * (the sum of its best two) comes from each lane's best two keys of the
 * group's slots by three warp reductions; lane g ranks group g. Scores that
 * differ only in the sign of a zero may give a group score of the other
 * sign, which ranks the same. ml_r_regs_ok(p) must hold. */
template <int NL>
static __device__ void ml_r_select_regs(const ml_router_params &p, float *L, const float *B, int *O,
                                        int lane) {
  const int E = p.E;
  float v[NL];
#pragma unroll
  for (int i = 0; i < NL; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? L[e] : 0.0f;
  }
  if (p.router == MOELINK_ROUTER_SOFTMAX_TOPK) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (lane + 32 * i < E)
        m = fmaxf(m, v[i]);
    m = ml_r_warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (lane + 32 * i < E) {
        v[i] = expf(v[i] - m);
        sum += v[i];
      }
    sum = ml_r_warp_sum(sum);
#pragma unroll
    for (int i = 0; i < NL; ++i)
      v[i] = v[i] / sum;
  } else if (p.router == MOELINK_ROUTER_SIGMOID_TOPK) {
#pragma unroll
    for (int i = 0; i < NL; ++i)
      v[i] = 1.0f / (1.0f + expf(-v[i]));
  }
  uint32_t key[NL];
  unsigned taken = 0u;
#pragma unroll
  for (int i = 0; i < NL; ++i) {
    const int e = lane + 32 * i;
    if (e < E)
      L[e] = v[i];
    const float x = p.bias != NULL && e < E ? v[i] + B[e] : v[i];
    key[i] = e < E ? ml_r_key(isnan(x) ? -INFINITY : x) : 0u;
    if (e >= E)
      taken |= 1u << i;
  }
  if (p.n_group > 1) {
    const int ng = p.n_group, m = E / ng / 32;
    /* group g's score from each lane's best two keys of its m slots of the
     * group (ml_r_group_pair); lane g keeps it */
    float own = -INFINITY;
    if (m == 1) {
      /* slot g holds group g's experts: no pass over the lane's slots, and
       * the groups' reductions independent of each other */
#pragma unroll
      for (int g = 0; g < NL; ++g) {
        const float x = ml_r_group_pair(key[g], 0u, lane);
        if (lane == g)
          own = x;
      }
    } else {
#pragma unroll
      for (int g = 0; g < NL; ++g) {
        if (g >= ng)
          break;
        uint32_t b1 = 0u, b2 = 0u;
#pragma unroll
        for (int i = 0; i < NL; ++i)
          if (i >= g * m && i < (g + 1) * m) {
            if (key[i] > b1) {
              b2 = b1;
              b1 = key[i];
            } else if (key[i] > b2) {
              b2 = key[i];
            }
          }
        const float x = ml_r_group_pair(b1, b2, lane);
        if (lane == g)
          own = x;
      }
    }
    /* the groups ranked (ties to the lower index), each by its lane, the
     * topk_group first kept; the others' experts out of the running as
     * -inf (never 0) */
    int r = 0;
#pragma unroll
    for (int h = 0; h < NL; ++h) {
      const float x = __shfl_sync(ML_FULL, own, h);
      r += h < ng && ((x > own) | ((x == own) & (h < lane)));
    }
    const unsigned kept = __ballot_sync(ML_FULL, lane < ng && r < p.topk_group);
    unsigned keep = 0u;
#pragma unroll
    for (int g = 0; g < NL; ++g)
      if ((kept >> g) & 1u)
        keep |= ((1u << m) - 1u) << (g * m);
    const uint32_t dropped = ml_r_key(-INFINITY);
#pragma unroll
    for (int i = 0; i < NL; ++i)
      if (!((keep >> i) & 1u) && !((taken >> i) & 1u))
        key[i] = dropped;
  }
  (void)ml_r_warp_topk_keys<NL>(key, taken, p.k, O, lane);
}

/* All tokens' k winners, by the whole CTA (every thread calls it): each
 * (token, group) finds its group's rank, each (token, expert) its rank
 * among the kept experts, and the k first write themselves into O. The same
 * winners in the same order as the warp path. Its work grows as rows * E^2,
 * the warp path's as k dependent rounds per token, so it is taken while
 * rows * E^2 <= ML_R_RANK_WORK. Measured on the H200 (graph replays): with
 * the warp path's argmax by shuffles it made the layers 4-7 us faster at
 * T = 1 (qwen3-30b-a3b, deepseek-v3) and 6-38 us slower at T = 16 and 128;
 * against the warp path by redux.sync (same run, two rounds) deepseek-v3
 * T = 1 224.0 against 228.4 us (the router beside the shared expert's
 * GEMM: eight warps in parallel instead of one warp's chain), qwen3-30b-a3b
 * and mixtral-8x7b T = 1 the same. */
#define ML_R_RANK_WORK 65536

static __device__ void ml_r_choose_block(const ml_router_params &p, float *S, float *G, int *O,
                                         int E_pad, int rows) {
  const int E = p.E, tid = (int)threadIdx.x;
  if (p.n_group > 1) {
    const int ng = p.n_group, gsize = E / ng;
    for (int u = tid; u < rows * ng; u += ML_R_THREADS) {
      const int t = u / ng, g = u % ng;
      G[t * E_pad + g] = ml_r_group_score(S + t * E_pad, g, gsize);
    }
    __syncthreads();
    /* experts of groups past the topk_group best: excluded, never 0 */
    for (int u = tid; u < rows * E; u += ML_R_THREADS) {
      const int t = u / E, e = u % E;
      if (ml_r_rank(G + t * E_pad, ng, e / gsize) >= p.topk_group)
        S[t * E_pad + e] = -INFINITY;
    }
    __syncthreads();
  }
  for (int u = tid; u < rows * E; u += ML_R_THREADS) {
    const int t = u / E, e = u % E;
    const int r = ml_r_rank(S + t * E_pad, E, e);
    if (r < p.k)
      O[t * ML_CUDA_MAX_TOPK + r] = e;
  }
}

/* One token's routing weights from its winners O and unbiased scores L, by
 * one warp, written out with the ids. */
static __device__ void ml_r_weights(const ml_router_params &p, const float *L, const int *O, int t,
                                    int lane) {
  const int k = p.k;
  int id = 0;
  float w = 0.0f;
  if (lane < k) {
    id = O[lane];
    w = L[id];
  }
  if (p.router == MOELINK_ROUTER_TOPK_SOFTMAX) {
    const float m = ml_r_warp_max(lane < k ? w : -INFINITY);
    const float ex = lane < k ? expf(w - m) : 0.0f;
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += __shfl_sync(ML_FULL, ex, j);
    w = ex / sum; /* sums to 1 already: renormalize has nothing to do */
  } else if (p.renormalize) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += __shfl_sync(ML_FULL, w, j);
    /* all-zero scores (sigmoids underflowed) stay zero rather than NaN */
    if (sum > 0.0f) w = w / sum;
  }
  w = w * p.scaling;
  if (lane < k) {
    p.ids[(size_t)t * k + lane] = id;
    p.weights[(size_t)t * k + lane] = w;
  }
}

/* ---- the sum of the partial logits ---------------------------------------------- */

/* L4[i] = the sum over ranges q < splits of part[q * stride4 + i], i < n4,
 * in the fixed shape described above; P is scratch for ML_R_THREADS float4.
 * Every thread of the CTA must call it. */
static __device__ void ml_r_sum_partials(const float4 *part, int splits, int stride4, int n4,
                                         float4 *L4, float4 *P) {
  const int tid = (int)threadIdx.x;
  int G = 1;
  if (n4 < ML_R_THREADS) {
    G = ML_R_THREADS / n4;
    if (G > splits) G = splits;
  }
  for (int u = tid; u < n4 * G; u += ML_R_THREADS) {
    const int i = u % n4, grp = u / n4;
    const int q0 = (int)((long long)grp * splits / G);
    const int q1 = (int)((long long)(grp + 1) * splits / G);
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int q = q0; q < q1; q += ML_R_BATCH) {
      float4 b[ML_R_BATCH];
#pragma unroll
      for (int j = 0; j < ML_R_BATCH; ++j)
        b[j] = q + j < q1 ? __ldcg(part + (size_t)(q + j) * stride4 + i)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int j = 0; j < ML_R_BATCH; ++j) {
        if (q + j < q1) {
          v.x += b[j].x;
          v.y += b[j].y;
          v.z += b[j].z;
          v.w += b[j].w;
        }
      }
    }
    if (G == 1)
      L4[i] = v;
    else
      P[grp * n4 + i] = v;
  }
  if (G == 1) return;
  __syncthreads();
  for (int i = tid; i < n4; i += ML_R_THREADS) {
    float4 v = P[i];
    for (int grp = 1; grp < G; ++grp) {
      const float4 b = P[grp * n4 + i];
      v.x += b.x;
      v.y += b.y;
      v.z += b.z;
      v.w += b.w;
    }
    L4[i] = v;
  }
}

/* Whether this CTA is the last of count to get here (ml_cta_ticket). */
static __device__ __forceinline__ bool ml_r_ticket(int32_t *ticket, int count, int *flag) {
  return ml_cta_ticket((uint32_t *)ticket, (uint32_t)(count - 1), flag);
}

/* Ranges per group of the two-level sum: all of them (one level) while the
 * last CTA's read is at most 512 KiB, else about sqrt(splits). Measured on
 * the H200 (router alone, L2 flushed): deepseek-v3's 56 ranges of 16 tokens
 * (917 KB) 36.1 -> 31.5 us with two levels; at 131-229 KB (qwen3-30b-a3b
 * T = 16, deepseek-v3 T = 4) the second ticket cost more than it saved
 * (+1.9 and +0.7 us). */
static __device__ __forceinline__ int ml_r_group_splits(int splits, int n4) {
  if (splits < 8 || (long long)splits * n4 * 16 <= 512 * 1024) return splits;
  int gs = 1;
  while (gs * gs < splits) ++gs;
  return gs;
}

/* Bytes of the scratch that follows the selection's: the partial sums'
 * groups, then the plan's. */
#define ML_R_SUM_BYTES (ML_R_THREADS * 16)
#define ML_R_PLAN_BYTES (ML_PLAN_SCRATCH_INTS * 4)

/* The selection's scratch: logits L, selection scores S, group scratch G
 * (each [16][E_pad] fp32), the winners O [16][ML_CUDA_MAX_TOPK], then the
 * correction bias B [E_pad]. */
static __host__ __device__ __forceinline__ size_t ml_r_select_bytes(int E_pad) {
  return 3 * (size_t)ML_R_TOKENS * (size_t)E_pad * sizeof(float) +
         (size_t)ML_R_TOKENS * ML_CUDA_MAX_TOPK * sizeof(int) + (size_t)E_pad * sizeof(float);
}

/* B, the last E_pad floats of the selection's scratch */
static __device__ __forceinline__ float *ml_r_bias_smem(float *L, int E_pad) {
  return (float *)((char *)L + ml_r_select_bytes(E_pad)) - E_pad;
}

/* The CTA that will select copies the correction bias (if any) into its
 * scratch while it sums the logits: cp.async copies in a group of their
 * own, which the cp.async wait before ml_r_select completes. */
static __device__ __forceinline__ void ml_r_fetch_bias(const ml_router_params &p, float *L,
                                                       int E_pad) {
  if (p.bias == NULL)
    return;
  float *B = ml_r_bias_smem(L, E_pad);
  for (int e = (int)threadIdx.x; e < p.E; e += ML_R_THREADS)
    ml_cp_async4(ml_smem_u32(B + e), p.bias + e, 4);
  ml_r_commit();
}

/* The selection of a block's rows t0 .. t0 + rows - 1, whose fp32 logits
 * are in L (rows E_pad floats apart, the scratch of ml_r_select_bytes after
 * them; the plan's scratch after ML_R_SUM_BYTES more): warp w scores token
 * t0 + w; the winners come from the whole CTA (small rows * E^2) or from the
 * token's warp; warp w then writes token t0 + w's ids and weights; with
 * p.build_plan the CTA then builds the plan. Every thread of the CTA calls
 * it. */
static __device__ void ml_r_select(const ml_router_params &p, float *L, int t0, int rows,
                                   int E_pad) {
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
  float *S = L + ML_R_TOKENS * E_pad;
  float *G = S + ML_R_TOKENS * E_pad;
  int *O = (int *)(G + ML_R_TOKENS * E_pad);
  const int t = t0 + warp;
  const bool block = (long long)rows * p.E * p.E <= ML_R_RANK_WORK;
  const bool regs = !block && ml_r_regs_ok(p);
  if (warp < rows) {
    float *Lw = L + warp * E_pad, *B = ml_r_bias_smem(L, E_pad);
    int *Ow = O + warp * ML_CUDA_MAX_TOPK;
    if (!regs)
      ml_r_scores(p, Lw, S + warp * E_pad, B, lane);
    else if (p.E <= 128)
      ml_r_select_regs<4>(p, Lw, B, Ow, lane);
    else
      ml_r_select_regs<8>(p, Lw, B, Ow, lane);
  }
  ml_r_stamp(p, ML_R_PH_SCORED); /* (in registers: chosen too) */
  if (block) {
    __syncthreads();
    ml_r_choose_block(p, S, G, O, E_pad, rows);
    __syncthreads();
  } else if (regs) {
    __syncwarp();
  } else if (warp < rows) {
    __syncwarp();
    ml_r_choose_warp(p, S + warp * E_pad, G + warp * E_pad, O + warp * ML_CUDA_MAX_TOPK, lane);
    __syncwarp();
  }
  ml_r_stamp(p, ML_R_PH_CHOSEN);
  if (warp < rows)
    ml_r_weights(p, L + warp * E_pad, O + warp * ML_CUDA_MAX_TOPK, t, lane);
  ml_r_stamp(p, ML_R_PH_SELECTED); /* thread 0's warp: its token's */
  if (p.build_plan) {
    /* the host asks for it only with one block of tokens (t0 = 0) */
    __syncthreads(); /* every token's winners are in O */
    const int pairs = p.T * p.k, tid = (int)threadIdx.x;
    const int32_t id = tid < pairs ? O[(tid / p.k) * ML_CUDA_MAX_TOPK + tid % p.k] : -1;
    const ml_plan_scratch ps =
        ml_plan_scratch_at((int *)((char *)L + ml_r_select_bytes(E_pad) + ML_R_SUM_BYTES));
    if (pairs <= ML_PLAN_SMALL_PAIRS)
      ml_plan_small(id, pairs, p.E, p.plan, ps);
    else
      ml_plan_block(id, pairs, p.E, p.plan, ps);
    ml_r_stamp(p, ML_R_PH_PLANNED);
  }
}

/* ---- the kernel ---------------------------------------------------------------- */

template <int DT>
static __global__ void __launch_bounds__(ML_R_THREADS, 1) ml_router_kernel(const ml_router_params p) {
  extern __shared__ __align__(16) char ml_r_smem[];
  __shared__ int ml_r_last;
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int E_pad = ml_r_epad(p.E), n_tiles = E_pad >> 3;
  const int t0 = (int)blockIdx.x * ML_R_TOKENS;
  const int splits = (int)gridDim.y, s = (int)blockIdx.y;
  const int chunks = (p.H + ML_R_KC - 1) / ML_R_KC;
  const int c0 = (int)((long long)s * chunks / splits);
  const int nc = (int)((long long)(s + 1) * chunks / splits) - c0;
  const int stage_bytes = (ML_R_TOKENS + E_pad) * ML_R_ROW;
  /* Dependents may launch now; they wait for this grid before reading. */
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  ml_r_stamp(p, ML_R_PH_START);

  float acc[ML_R_TILES_PER_WARP][4];
#pragma unroll
  for (int m = 0; m < ML_R_TILES_PER_WARP; ++m)
    acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;

    /* One commit group per stage slot, empty ones included, so that
     * wait_group<STAGES-2> always means "chunk i has landed". */
#pragma unroll
  for (int st = 0; st < ML_R_STAGES - 1; ++st) {
    if (st < nc)
      ml_r_load_stage(ml_r_smem + st * stage_bytes, p, t0, c0 + st, E_pad);
    ml_r_commit();
  }
  for (int i = 0; i < nc; ++i) {
    ml_r_wait<ML_R_STAGES - 2>();
    /* Chunk i is visible to all, and everyone is done with chunk i-1, whose
     * slot the next copies overwrite. */
    __syncthreads();
    const int next = i + ML_R_STAGES - 1;
    if (next < nc)
      ml_r_load_stage(ml_r_smem + (next % ML_R_STAGES) * stage_bytes, p, t0, c0 + next, E_pad);
    ml_r_commit();
    ml_r_mma_stage<DT>(ml_r_smem + (i % ML_R_STAGES) * stage_bytes, acc, warp, g, c, n_tiles);
  }
  ml_r_wait<0>();
  __syncthreads(); /* the ring is dead from here: its memory becomes the logits */
  ml_r_stamp(p, ML_R_PH_LOGITS);

  float *L = (float *)ml_r_smem;
  /* Rows of tokens past T are padding: never stored, summed or selected. */
  const int rows = p.T - t0 < ML_R_TOKENS ? p.T - t0 : ML_R_TOKENS;
  if (splits > 1) {
    const int stride4 = ML_R_TOKENS * E_pad / 4, n4 = rows * E_pad / 4;
    float4 *part = (float4 *)(p.partials + (size_t)blockIdx.x * splits * ML_R_TOKENS * E_pad);
    float4 *P = (float4 *)(ml_r_smem + ml_r_select_bytes(E_pad));
    ml_r_store_acc((float *)(part + (size_t)s * stride4), E_pad, acc, warp, g, c, n_tiles, rows);
    ml_r_stamp(p, ML_R_PH_STORED);
    const int gs = p.two_level ? ml_r_group_splits(splits, n4) : splits;
    if (gs < splits) {
      /* Two levels: the last CTA of each group of gs ranges sums them into
       * the group's first range, then the last group sums the groups. */
      const int ng = (splits + gs - 1) / gs, grp = s / gs, q0 = grp * gs;
      const int q1 = q0 + gs < splits ? q0 + gs : splits;
      if (!ml_r_ticket(p.tickets + gridDim.x + blockIdx.x * ng + grp, q1 - q0, &ml_r_last))
        return;
      ml_r_stamp(p, ML_R_PH_GROUP);
      ml_r_sum_partials(part + (size_t)q0 * stride4, q1 - q0, stride4, n4,
                        part + (size_t)q0 * stride4, P);
      ml_r_stamp(p, ML_R_PH_GROUP_SUM);
      if (!ml_r_ticket(p.tickets + blockIdx.x, ng, &ml_r_last)) return;
      ml_r_stamp(p, ML_R_PH_LAST);
      ml_r_fetch_bias(p, L, E_pad);
      ml_r_sum_partials(part, ng, gs * stride4, n4, (float4 *)L, P);
    } else {
      if (!ml_r_ticket(p.tickets + blockIdx.x, splits, &ml_r_last)) return;
      ml_r_stamp(p, ML_R_PH_LAST);
      ml_r_fetch_bias(p, L, E_pad);
      ml_r_sum_partials(part, splits, stride4, n4, (float4 *)L, P);
    }
  } else {
    ml_r_fetch_bias(p, L, E_pad);
    ml_r_store_acc(L, E_pad, acc, warp, g, c, n_tiles, rows);
  }
  ml_r_wait<0>(); /* the bias */
  __syncthreads();
  ml_r_stamp(p, ML_R_PH_SUMMED);
  ml_r_select(p, L, t0, rows, E_pad);
  /* a no-op unless launched as a programmatic dependent */
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

/* The large-batch path (p.logits given, from the GEMM engine): selection
 * only. Without the MMA ring's registers and shared memory two CTAs fit on
 * an SM, so a wave covers twice the tokens of ml_router_kernel's (measured on
 * H200 at 8192 tokens: docs/PERF.md). */
static __global__ void __launch_bounds__(ML_R_THREADS, 2)
    ml_router_select_kernel(const ml_router_params p) {
  extern __shared__ __align__(16) char ml_r_smem[];
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  ml_r_stamp(p, ML_R_PH_START);
  const int E_pad = ml_r_epad(p.E);
  const int t0 = (int)blockIdx.x * ML_R_TOKENS;
  const int rows = p.T - t0 < ML_R_TOKENS ? p.T - t0 : ML_R_TOKENS;
  float *L = (float *)ml_r_smem;
  /* the block's rows are rows * E consecutive floats (E % 4 == 0, checked by
   * the host): 16-byte loads, all of a thread's in flight together, then
   * the stores (one load latency, not one a float) */
  const float4 *src = (const float4 *)(p.logits + (size_t)t0 * (size_t)p.E);
  const int n4 = rows * p.E / 4;
  ml_r_fetch_bias(p, L, E_pad);
  if (p.parts <= 1) {
    for (int i0 = (int)threadIdx.x; i0 < n4; i0 += ML_R_BATCH * ML_R_THREADS) {
      float4 v[ML_R_BATCH];
#pragma unroll
      for (int j = 0; j < ML_R_BATCH; ++j) {
        const int i = i0 + j * ML_R_THREADS;
        if (i < n4)
          v[j] = __ldg(src + i);
      }
#pragma unroll
      for (int j = 0; j < ML_R_BATCH; ++j) {
        const int i = i0 + j * ML_R_THREADS;
        if (i < n4) {
          const int r = 4 * i / p.E, e = 4 * i - r * p.E;
          *(float4 *)(L + r * E_pad + e) = v[j];
        }
      }
    }
  } else {
    /* the parts of a split k (at most ML_R_MAX_PARTS): every part's float4
     * of a position loaded at once, then added in part order */
    const size_t part4 = (size_t)p.T * (size_t)p.E / 4; /* float4s a part */
    for (int i = (int)threadIdx.x; i < n4; i += ML_R_THREADS) {
      float4 u[ML_R_MAX_PARTS];
#pragma unroll
      for (int q = 0; q < ML_R_MAX_PARTS; ++q)
        if (q < p.parts)
          u[q] = __ldg(src + (size_t)q * part4 + i);
      float4 v = u[0];
#pragma unroll
      for (int q = 1; q < ML_R_MAX_PARTS; ++q)
        if (q < p.parts) {
          v.x += u[q].x;
          v.y += u[q].y;
          v.z += u[q].z;
          v.w += u[q].w;
        }
      const int r = 4 * i / p.E, e = 4 * i - r * p.E;
      *(float4 *)(L + r * E_pad + e) = v;
    }
  }
  ml_r_wait<0>(); /* the bias */
  __syncthreads();
  ml_r_stamp(p, ML_R_PH_SUMMED);
  ml_r_select(p, L, t0, rows, E_pad);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

/* ---- host side ------------------------------------------------------------------ */

/* 0: one CTA sums all split partial logits of a token block, however many
 * (for A/B measurements; ml_r_group_splits). */
MOELINK_PARAM(ROUTER_TWO_LEVEL, 1)

/* 0: a token's warp scores and selects through shared memory
 * (ml_r_scores, ml_r_choose_warp) instead of in registers (ml_r_select_regs;
 * for A/B measurements). */
MOELINK_PARAM(ROUTER_REGS, 1)

extern "C" size_t ml_cuda_router_smem(int num_experts) {
  const int E_pad = ml_r_epad(num_experts);
  const size_t ring = (size_t)ML_R_STAGES * (ML_R_TOKENS + (size_t)E_pad) * ML_R_ROW;
  const size_t after = ml_r_select_bytes(E_pad) + ML_R_SUM_BYTES + ML_R_PLAN_BYTES;
  return ring > after ? ring : after;
}

extern "C" size_t ml_cuda_router_tickets(int sm_count) {
  /* a block ticket per token block and one per range group: blocks *
   * splits <= sm_count, so both together need at most 2 * sm_count */
  return 2 * (size_t)(sm_count > 0 ? sm_count : 1);
}

extern "C" int ml_cuda_router_builds_plan(int num_tokens, int top_k) {
  return num_tokens >= 1 && num_tokens <= ML_R_TOKENS && num_tokens * top_k <= ML_P_THREADS;
}

extern "C" ml_cuda_router_args ml_cuda_router_args_for(const moelink_moe_config_t *cfg,
                                                       const void *x, const void *w,
                                                       const float *bias, int num_tokens,
                                                       int32_t *ids, float *weights,
                                                       float *partials, int32_t *tickets,
                                                       int sm_count) {
  ml_cuda_router_args a;
  memset(&a, 0, sizeof a);
  a.dtype = cfg->dtype;
  a.x = x;
  a.w = w;
  a.bias = cfg->correction_bias ? bias : NULL;
  a.num_tokens = num_tokens;
  a.hidden = cfg->hidden;
  a.num_experts = cfg->num_experts;
  a.top_k = cfg->top_k;
  a.router = cfg->router;
  a.renormalize = cfg->renormalize;
  a.n_group = cfg->n_group;
  a.topk_group = cfg->topk_group;
  a.routed_scaling = cfg->routed_scaling;
  a.ids = ids;
  a.weights = weights;
  a.splits = ml_cuda_router_splits(num_tokens, cfg->hidden, sm_count);
  a.partials = partials;
  a.tickets = tickets;
  return a;
}

extern "C" size_t ml_cuda_router_partial_floats(int num_experts, int sm_count) {
  return (size_t)(sm_count > 0 ? sm_count : 1) * ML_R_TOKENS * (size_t)ml_r_epad(num_experts);
}

extern "C" int ml_cuda_router_splits(int num_tokens, int hidden, int sm_count) {
  const int blocks = (num_tokens + ML_R_TOKENS - 1) / ML_R_TOKENS;
  const int chunks = (hidden + ML_R_KC - 1) / ML_R_KC;
  if (sm_count <= 0 || blocks <= 0 || blocks * 2 > sm_count) return 1;
  int s = sm_count / blocks;
  /* Two chunks per CTA at least: with one, its copies cannot overlap math. */
  const int cap = (chunks + 1) / 2;
  if (s > cap) s = cap;
  return s < 1 ? 1 : s;
}

/* Tokens from which the layer computes the logits with the grouped GEMM
 * engine and lets the router kernel select only (0: never). */
MOELINK_PARAM(ROUTER_GEMM_MIN_TOKENS, 2048)

/* The same from fewer tokens where the sm_90a engine takes the logits GEMM
 * (E >= 256: k in parts, ml_cuda_gemm_splitk); 0: no such rule. At 128, 256
 * and 512 tokens of deepseek-v3 the layer measured 7, 14 and 33 us faster;
 * qwen3-30b-a3b's and mixtral-8x7b's logits (E 128, 8) go to the tile engine,
 * where the same change cost 9-53 us (docs/PERF.md). */
MOELINK_PARAM(ROUTER_GEMM_MIN_TOKENS_SM90, 128)

extern "C" int ml_cuda_router_gemm_wanted(int num_tokens, int num_experts, int hidden) {
  const int64_t min_t = ml_param_ROUTER_GEMM_MIN_TOKENS();
  if (min_t <= 0 || num_experts % 8 != 0 || hidden % 8 != 0)
    return 0;
  if (num_tokens >= min_t)
    return 1;
  const int64_t min_90 = ml_param_ROUTER_GEMM_MIN_TOKENS_SM90();
  return min_90 > 0 && num_tokens >= min_90 && ml_cuda_gemm_dense_on_sm90(hidden, num_experts);
}

extern "C" size_t ml_cuda_router_logits_floats(int max_tokens, int num_experts, int hidden) {
  const int rows = max_tokens > ML_CUDA_ROUTER_PART_ROWS ? max_tokens : ML_CUDA_ROUTER_PART_ROWS;
  return ml_cuda_router_gemm_wanted(max_tokens, num_experts, hidden)
             ? (size_t)rows * (size_t)num_experts
             : 0;
}

extern "C" moelink_status_t ml_cuda_router_prepare(int smem_optin) {
  size_t want = ml_cuda_router_smem(ML_CUDA_MAX_EXPERTS);
  /* Leave room for the kernel's static shared memory (one int). */
  const size_t room = smem_optin > 64 ? (size_t)smem_optin - 64 : 0;
  if (want > room) want = room;
  ML_CUDA_TRY(cudaFuncSetAttribute((const void *)ml_router_kernel<MOELINK_DTYPE_BF16>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)want));
  ML_CUDA_TRY(cudaFuncSetAttribute((const void *)ml_router_kernel<MOELINK_DTYPE_F16>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)want));
  ML_CUDA_TRY(cudaFuncSetAttribute((const void *)ml_router_select_kernel,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)ml_r_select_bytes(ml_r_epad(ML_CUDA_MAX_EXPERTS))));
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_cuda_router(const ml_cuda_router_args *a, cudaStream_t stream) {
  if (a->num_tokens <= 0) return MOELINK_SUCCESS;
  if (a->dtype != MOELINK_DTYPE_BF16 && a->dtype != MOELINK_DTYPE_F16)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "router: dtype %s not supported (bf16 or f16)",
                   moelink_dtype_name(a->dtype));
  if (a->num_experts < 1 || a->num_experts > ML_CUDA_MAX_EXPERTS || a->top_k < 1 ||
      a->top_k > ML_CUDA_MAX_TOPK || a->top_k > a->num_experts || a->hidden % 8 != 0 ||
      a->splits < 1 || a->splits > 65535)
    return ml_fail(MOELINK_ERR_INTERNAL, "router: E %d, k %d, H %d, splits %d out of range",
                   a->num_experts, a->top_k, a->hidden, a->splits);
  if (a->splits > 1 && (a->partials == NULL || a->tickets == NULL))
    return ml_fail(MOELINK_ERR_INTERNAL, "router: splits %d without partials/tickets",
                   a->splits);
  if (a->logits != NULL && (a->splits != 1 || a->pdl || a->plan != NULL ||
                            a->num_experts % 4 != 0 || ((uintptr_t)a->logits & 15u)))
    return ml_fail(MOELINK_ERR_INTERNAL,
                   "router: logits given with splits %d, pdl %d, a plan (%d), E %d (not a "
                   "multiple of 4) or misaligned (%p)",
                   a->splits, a->pdl, a->plan != NULL, a->num_experts, (const void *)a->logits);
  if (a->plan != NULL && (!ml_cuda_router_builds_plan(a->num_tokens, a->top_k) ||
                          a->plan->tile_rows != ML_CUDA_TILE_ROWS))
    return ml_fail(MOELINK_ERR_INTERNAL, "router: cannot build the plan of T %d, k %d here",
                   a->num_tokens, a->top_k);
  ml_router_params p;
  p.x = a->x;
  p.w = a->w;
  p.bias = a->bias;
  p.ids = a->ids;
  p.weights = a->weights;
  p.partials = a->partials;
  p.tickets = a->tickets;
  p.logits = a->logits;
  p.parts = a->logit_parts > 1 ? a->logit_parts : 1;
  if (a->logits != NULL && p.parts > ML_R_MAX_PARTS)
    return ml_fail(MOELINK_ERR_INTERNAL, "router: logits in %d parts (at most %d)", p.parts,
                   ML_R_MAX_PARTS);
  memset(&p.plan, 0, sizeof p.plan);
  p.build_plan = a->plan != NULL;
  p.two_level = ml_param_ROUTER_TWO_LEVEL() != 0;
  p.regs = ml_param_ROUTER_REGS() != 0;
  if (a->plan != NULL) p.plan = ml_plan_ptrs_of(a->plan);
  p.T = a->num_tokens;
  p.H = a->hidden;
  p.E = a->num_experts;
  p.k = a->top_k;
  p.router = (int)a->router;
  p.renormalize = a->renormalize;
  p.n_group = a->n_group;
  p.topk_group = a->topk_group;
  p.scaling = a->routed_scaling;
  p.stamps = a->stamps;
  const dim3 grid((unsigned)((a->num_tokens + ML_R_TOKENS - 1) / ML_R_TOKENS),
                  (unsigned)a->splits, 1);
  void (*kernel)(const ml_router_params) = a->logits != NULL ? ml_router_select_kernel
                                           : a->dtype == MOELINK_DTYPE_BF16
                                               ? ml_router_kernel<MOELINK_DTYPE_BF16>
                                               : ml_router_kernel<MOELINK_DTYPE_F16>;
  const size_t smem = a->logits != NULL ? ml_r_select_bytes(ml_r_epad(a->num_experts))
                                        : ml_cuda_router_smem(a->num_experts);
  void *args[] = {&p};
  const cudaError_t e = ml_launch_kernel((const void *)kernel, grid, dim3(ML_R_THREADS, 1, 1), smem,
                                         a->pdl && ml_cuda_pdl_allowed(stream), stream, args);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return ml_fail(MOELINK_ERR_CUDA, "launch of the router kernel (%u x %u CTAs) failed: %s",
                   grid.x, grid.y, cudaGetErrorString(e));
  }
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t ml_cuda_route(ml_cuda_router_args *a, float *logits, int32_t *counter,
                                          cudaStream_t stream) {
  if (logits != NULL && a->plan == NULL &&
      ml_cuda_router_gemm_wanted(a->num_tokens, a->num_experts, a->hidden)) {
    /* a large batch: the logits from the GEMM engine, the kernel selects
     * (not when the router kernel is to build the plan too: one block of
     * tokens, the kernel's own logits) */
    const ml_cuda_gemm_opts go = ml_cuda_gemm_opts_for(counter, a->num_tokens, 1, a->hidden, 0);
    /* k in parts where the rows alone leave SMs without work (the scratch
     * holds ML_CUDA_ROUTER_PART_ROWS rows of parts) */
    const int room = ML_CUDA_ROUTER_PART_ROWS / a->num_tokens;
    const int parts = ml_cuda_gemm_splitk_parts(a->num_tokens, a->num_experts, a->hidden,
                                                room < ML_R_MAX_PARTS ? room : ML_R_MAX_PARTS);
    ML_TRY(ml_cuda_gemm_splitk(a->dtype, a->x, a->hidden, a->w, a->num_experts, a->hidden,
                               a->num_tokens, logits, parts, &go, stream));
    a->logits = logits;
    a->logit_parts = parts;
    a->splits = 1;
    a->pdl = 0;
  }
  return ml_cuda_router(a, stream);
}
