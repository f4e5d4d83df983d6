/* The two grouped GEMMs of a MoE layer's experts:
 *
 *   ml_cuda_gemm_swiglu  h = silu(x_perm Wg^T) * (x_perm Wu^T), x_perm rows
 *                        gathered from x through the plan's index
 *   ml_cuda_gemm_scaled  y = diag(s) h Wd^T, s the routing weight of each row
 *
 * Two engines. On a compute capability 9.0 device, shapes with k >= 64 and
 * at least one full column block go to the sm_90a kernel of
 * src/cuda/gemm/sm90.cuh (wgmma, TMA for the weights, persistent CTAs over
 * the tile list, a 128 x 256 tile per work item). Everything else runs on
 * the portable tile engine of src/cuda/gemm/tile.cuh (mma.sync, cp.async):
 *
 * One tile-engine CTA = one plan tile (<= 64 rows of one expert) x one block
 * of output columns; its index in the tile list is blockIdx.x, so the grid is
 * sized from max_tiles on the host and the count of real tiles is read on the
 * device (no host round trip, graph capturable). blockIdx.x varies fastest,
 * so CTAs resident together share a column block of the weights. */
#include "core/launch.cuh"
#include "cuda/cuda.h"
#include "cuda/gemm/decode.h"
#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/sm90.cuh"
#include "cuda/gemm/sm90_engine.cuh"
#include "cuda/gemm/tile.cuh"

#include <cudaTypedefs.h>
#include <stdint.h>
#include <string.h>

/* 64 x 128 x 64 tiles, 4 warps of 32 x 64, 3 stages: 72 KiB of shared memory,
 * three CTAs per SM. For SwiGLU the 128 B rows are 64 gate/up column pairs,
 * so a CTA writes 64 output columns; the scaled GEMM writes 128. */
typedef ml_gemm_shape<ML_CUDA_TILE_ROWS, 128, 64, 2, 2, 3> ml_xs;

#define ML_SWIGLU_COLS (ml_xs::BN / 2)
#define ML_SCALED_COLS (ml_xs::BN)

typedef struct ml_swiglu_args {
  const void *a;
  const int32_t *a_index;
  const void *b;
  void *out;
  const int32_t *tiles;
  const int32_t *num_tiles;
  int lda, a_div, n, k, dense_rows;
  ml_cuda_gemm_wait wait; /* signal NULL: rows in place at launch */
} ml_swiglu_args;

typedef struct ml_scaled_args {
  const void *a;
  const void *b;
  void *out;
  const int32_t *tiles;
  const int32_t *num_tiles;
  const float *row_scale;
  const int32_t *scale_index;
  void *const *out_rows; /* see ml_cuda_gemm_opts */
  int lda, n, k, dense_rows;
  ml_cuda_gemm_wait wait; /* signal NULL: rows in place at launch */
} ml_scaled_args;

/* A tile-engine CTA's wait for its rows (ml_cuda_gemm_wait), before any of
 * its A loads: warp 0 waits, then the CTA meets. */
static __device__ __forceinline__ void ml_tile_wait(const ml_cuda_gemm_wait *w, int row0,
                                                    int rows) {
  if (w->signal == NULL)
    return;
  if (threadIdx.x < 32)
    ml_gemm_wait_rows(w, row0, row0 + rows, (int)threadIdx.x, 32);
  __syncthreads();
}

template <int DT>
static __global__ void __launch_bounds__(ml_xs::THREADS)
    ml_swiglu_kernel(const __grid_constant__ ml_swiglu_args p) {
  extern __shared__ __align__(128) char ml_gemm_smem[];
  int expert, row0, rows;
  if (!ml_gemm_tile_of<ml_xs::BM>(p.tiles, p.num_tiles, p.dense_rows, &expert, &row0, &rows))
    return;
  ml_tile_wait(&p.wait, row0, rows);
  int j0 = (int)blockIdx.y * ML_SWIGLU_COLS;
  ml_gemm_rows<ml_xs::A_LOADS> a;
  ml_gemm_a_gathered<ml_xs>(&a, p.a, p.lda, p.a_index, p.a_div, row0, rows, p.wait.signal != NULL);
  ml_gemm_rows<ml_xs::B_LOADS> b;
  const char *w = (const char *)p.b + (size_t)expert * 2 * (size_t)p.n * (size_t)p.k * 2;
  ml_gemm_b_gate_up<ml_xs>(&b, w, p.n, p.k, j0);
  ml_gemm_acc<ml_xs> acc;
  ml_gemm_mainloop<ml_xs, DT>(ml_gemm_smem, &a, &b, p.k, &acc);
  ml_gemm_store_swiglu<ml_xs, DT>(&acc, p.out, p.n, row0, rows, j0, p.n);
}

template <int DT, int OUT_F32>
static __global__ void __launch_bounds__(ml_xs::THREADS)
    ml_scaled_kernel(const __grid_constant__ ml_scaled_args p) {
  extern __shared__ __align__(128) char ml_gemm_smem[];
  int expert, row0, rows;
  if (!ml_gemm_tile_of<ml_xs::BM>(p.tiles, p.num_tiles, p.dense_rows, &expert, &row0, &rows))
    return;
  ml_tile_wait(&p.wait, row0, rows);
  int n0 = (int)blockIdx.y * ML_SCALED_COLS;
  ml_gemm_rows<ml_xs::A_LOADS> a;
  ml_gemm_a_dense<ml_xs>(&a, p.a, p.lda, row0, rows);
  ml_gemm_rows<ml_xs::B_LOADS> b;
  const char *w = (const char *)p.b + (size_t)expert * (size_t)p.n * (size_t)p.k * 2;
  ml_gemm_b_plain<ml_xs>(&b, w, p.n, p.k, n0);
  ml_gemm_acc<ml_xs> acc;
  ml_gemm_mainloop<ml_xs, DT>(ml_gemm_smem, &a, &b, p.k, &acc);
  ml_gemm_store_scaled<ml_xs, DT, OUT_F32>(&acc, p.out, p.n, row0, rows, n0, p.n, p.row_scale,
                                           p.scale_index, p.out_rows);
}

/* ---- host side ----------------------------------------------------------- */

/* Kernels whose dynamic shared memory has been allowed past 48 KiB, per
 * device (the attribute belongs to the function in the device's context).
 * Setting it twice is harmless, so a race between threads costs one extra
 * call and nothing else. */
enum {
  ML_K_SWIGLU_BF16,
  ML_K_SWIGLU_F16,
  ML_K_SCALED_BF16,
  ML_K_SCALED_BF16_F32,
  ML_K_SCALED_F16,
  ML_K_SCALED_F16_F32,
  ML_K_SM90,                                  /* 6 sm_90a kernels from here: see ml_sm90_which */
  ML_K_SM90_FP8 = ML_K_SM90 + 6,              /* 5 FP8 ones: see ml_sm90_which */
  ML_K_SM90_CL = ML_K_SM90_FP8 + 5,           /* 6 in clusters of two: see ml_sm90_which */
  ML_K_SM90_FP8_CL = ML_K_SM90_CL + 6,        /* 4 FP8 ones in clusters of two */
  ML_K_SM90_FP8_WIDE = ML_K_SM90_FP8_CL + 4,  /* 5 with the wide FP8 tile */
  ML_K_SM90_FP8_TMA = ML_K_SM90_FP8_WIDE + 5, /* 2: its scaled GEMM with TMA stores */
  ML_K_COUNT = ML_K_SM90_FP8_TMA + 2
};
static unsigned char ml_gemm_smem_ready[ML_CUDA_MAX_DEVICES * ML_K_COUNT];

/* (the carveout hint matters: three 72 KiB tile-engine CTAs, or one 193 KiB
 * sm_90a CTA, per SM need the largest one) */
static moelink_status_t ml_gemm_allow_smem(const void *kernel, int which, int bytes) {
  return ml_cuda_allow_smem(kernel, ml_gemm_smem_ready, ML_K_COUNT, which, bytes);
}

/* Checks shared by both GEMMs; sets *grid_x (0: nothing to do). */
static moelink_status_t ml_gemm_check(const char *what, moelink_dtype_t dt, const void *a,
                                      int lda, const void *b, int n, int k,
                                      const int32_t *tiles, const int32_t *num_tiles,
                                      int max_tiles, int dense_rows, const void *out,
                                      int cols_per_cta, unsigned *grid_x, unsigned *grid_y) {
  if (dt != MOELINK_DTYPE_BF16 && dt != MOELINK_DTYPE_F16)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: dtype %s not supported (bf16 or f16)", what,
                   moelink_dtype_name(dt));
  if (n < 0 || k < 0 || lda < k)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: n %d, k %d, lda %d (need n, k >= 0, lda >= k)",
                   what, n, k, lda);
  if (n % 8 || k % 8 || lda % 8)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: n %d, k %d, lda %d must be multiples of 8 (16-byte rows)", what, n, k,
                   lda);
  if (tiles != NULL) {
    if (num_tiles == NULL)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: tiles given without num_tiles", what);
    if (max_tiles < 0)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: max_tiles %d < 0", what, max_tiles);
    *grid_x = (unsigned)max_tiles;
  } else {
    if (dense_rows < 0)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: dense_rows %d < 0", what, dense_rows);
    *grid_x = (unsigned)((dense_rows + ML_CUDA_TILE_ROWS - 1) / ML_CUDA_TILE_ROWS);
  }
  *grid_y = (unsigned)((n + cols_per_cta - 1) / cols_per_cta);
  if (*grid_x == 0 || *grid_y == 0) return MOELINK_SUCCESS;
  if (*grid_y > 65535)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: n %d needs %u column blocks (max 65535)", what,
                   n, *grid_y);
  if (a == NULL || b == NULL || out == NULL)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: NULL operand (a %p, b %p, out %p)", what,
                   a, b, out);
  if (ml_cuda_misaligned(a) || ml_cuda_misaligned(b) || ml_cuda_misaligned(out))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: operands must be 16-byte aligned (a %p, b %p, out %p)", what, a, b, out);
  return MOELINK_SUCCESS;
}

/* ---- the sm_90a engine ------------------------------------------------------ */

MOELINK_PARAM(GEMM_SM90, 1)
/* 0: the sm_90a kernel's static schedule even where a counter is given */
MOELINK_PARAM(GEMM_SM90_DYNAMIC, 1)

static int ml_engine_choice = ML_GEMM_ENGINE_AUTO;
static __thread int ml_engine_last = ML_GEMM_ENGINE_AUTO;

extern "C" void ml_cuda_gemm_set_engine(int engine) {
  __atomic_store_n(&ml_engine_choice, engine, __ATOMIC_RELAXED);
}

extern "C" int ml_cuda_gemm_last_engine(void) { return ml_engine_last; }

static int ml_tma_store_choice = -1;
static __thread int ml_tma_store_last = 0;

extern "C" void ml_cuda_gemm_set_tma_store(int on) {
  __atomic_store_n(&ml_tma_store_choice, on, __ATOMIC_RELAXED);
}

extern "C" int ml_cuda_gemm_last_tma_store(void) { return ml_tma_store_last; }

static __thread int ml_sm90_last_tile = 0;

extern "C" int ml_cuda_gemm_last_sm90_tile(void) { return ml_sm90_last_tile; }

static __thread int ml_sm90_last_grid = 0;

extern "C" int ml_cuda_gemm_last_sm90_grid(void) { return ml_sm90_last_grid; }

/* Per device: 0 not yet asked, else 1 + (SM count << 1 | compute capability is 9.0). */
static int ml_sm90_device_info[ML_CUDA_MAX_DEVICES];

extern "C" moelink_status_t ml_cuda_sm90_device(int *is_sm90, int *sms) {
  int dev = 0;
  ML_CUDA_TRY(cudaGetDevice(&dev));
  int cached = dev >= 0 && dev < ML_CUDA_MAX_DEVICES;
  int v = cached ? __atomic_load_n(&ml_sm90_device_info[dev], __ATOMIC_ACQUIRE) : 0;
  if (v == 0) {
    int major = 0, minor = 0, count = 0;
    ML_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    ML_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    ML_CUDA_TRY(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    /* sm_90a machine code runs on 9.0 only; later GPUs take the tile engine's PTX */
    v = 1 + ((count << 1) | (major == 9 && minor == 0));
    if (cached) __atomic_store_n(&ml_sm90_device_info[dev], v, __ATOMIC_RELEASE);
  }
  *is_sm90 = (v - 1) & 1;
  *sms = (v - 1) >> 1;
  return MOELINK_SUCCESS;
}

/* Whether the sm_90a kernel takes this problem: k and the B rows of one TMA
 * box (j_rows >= box_rows) must exist, so that no box is larger than its
 * tensor; the rest of the shape (odd n, k, row counts) the kernel handles. */
static moelink_status_t ml_sm90_pick(int k, int j_rows, int box_rows, int *use, int *sms) {
  *use = 0;
  int choice = __atomic_load_n(&ml_engine_choice, __ATOMIC_RELAXED);
  if (choice == ML_GEMM_ENGINE_TILE) return MOELINK_SUCCESS;
  if (choice == ML_GEMM_ENGINE_AUTO && ml_param_GEMM_SM90() == 0) return MOELINK_SUCCESS;
  if (k < ML_SM90_BK || j_rows < box_rows) return MOELINK_SUCCESS;
  int is_sm90 = 0;
  ML_TRY(ml_cuda_sm90_device(&is_sm90, sms));
  *use = is_sm90 && *sms > 0;
  return MOELINK_SUCCESS;
}

/* ml_sm90_pick as a number: the SMs the sm_90a kernel runs on, 0 where it
 * does not take the problem (an error asking the device is cleared: the GEMM
 * itself reports it). */
static int ml_sm90_takes(int k, int j_rows, int box_rows) {
  int sm90 = 0, sms = 0;
  if (ml_sm90_pick(k, j_rows, box_rows, &sm90, &sms) != MOELINK_SUCCESS) {
    ml_clear_error();
    return 0;
  }
  return sm90 && sms > 0 ? sms : 0;
}

/* cuTensorMapEncodeTiled from the driver the runtime already loaded, so the
 * library needs no link against libcuda. */
static void *ml_encode_tiled;

static moelink_status_t ml_sm90_encoder(PFN_cuTensorMapEncodeTiled_v12000 *fn) {
  void *f = __atomic_load_n(&ml_encode_tiled, __ATOMIC_ACQUIRE);
  if (f == NULL) {
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    ML_CUDA_TRY(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                 cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || f == NULL)
      return ml_fail(MOELINK_ERR_CUDA,
                     "cuTensorMapEncodeTiled not found in the CUDA driver (query result %d)",
                     (int)q);
    __atomic_store_n(&ml_encode_tiled, f, __ATOMIC_RELEASE);
  }
  *fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
  return MOELINK_SUCCESS;
}

/* 1: full 64-row tiles of the bf16/f16 kernel leave through shared memory
 * and TMA stores (ml_sm90_store_tma); 0: every row by the consumers' own
 * stores. */
MOELINK_PARAM(GEMM_SM90_TMA_STORE, 1)

/* Rows of the output map: a bound no tile reaches (only the kernel's own
 * tiles' coordinates are ever written). */
#define ML_SM90_OUT_MAP_ROWS (1u << 30)

/* The TMA-store epilogue's map of out [rows][n] (16-bit dt): boxes of 64
 * rows x 64 columns in the 128-byte swizzle. Returns 1, or 0 (the kernel
 * then stores as before) where MOELINK_GEMM_SM90_TMA_STORE is 0 or the
 * driver does not take the map. */
static int ml_sm90_map_out(CUtensorMap *map, moelink_dtype_t dt, void *out, int n) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
  const int choice = __atomic_load_n(&ml_tma_store_choice, __ATOMIC_RELAXED);
  const int on = choice >= 0 ? choice != 0 : ml_param_GEMM_SM90_TMA_STORE() != 0;
  if (!on || ml_sm90_encoder(&encode) != MOELINK_SUCCESS)
    return 0;
  cuuint64_t dims[2] = {(cuuint64_t)n, (cuuint64_t)ML_SM90_OUT_MAP_ROWS};
  cuuint64_t strides[1] = {(cuuint64_t)n * 2};
  cuuint32_t box[2] = {64, 64};
  cuuint32_t unit[2] = {1, 1};
  const CUresult r = encode(
      map,
      dt == MOELINK_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      2, out, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    memset(map, 0, sizeof *map);
    return 0;
  }
  return 1;
}

/* Experts a tile list may name: the map's outermost extent. Only coordinates
 * the kernel asks for are ever read, so a generous bound costs nothing. */
#define ML_SM90_MAX_EXPERTS 65536

/* (declared in cuda/gemm/sm90.cuh) */
moelink_status_t ml_sm90_map_b(CUtensorMap *map, moelink_dtype_t dt, const void *b, int k,
                               int j_rows, int halves, int experts, int box_rows,
                               const char *what) {
  return ml_sm90_map_b_box(map, dt, b, k, j_rows, halves, experts, box_rows, halves, what);
}

moelink_status_t ml_sm90_map_b_box(CUtensorMap *map, moelink_dtype_t dt, const void *b, int k,
                                   int j_rows, int halves, int experts, int box_rows,
                                   int box_halves, const char *what) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
  ML_TRY(ml_sm90_encoder(&encode));
  const int fp8 = dt == MOELINK_DTYPE_F32;
  const cuuint64_t row = (cuuint64_t)k * (fp8 ? 1 : 2);
  cuuint64_t dims[4] = {(cuuint64_t)k, (cuuint64_t)j_rows, (cuuint64_t)halves,
                        (cuuint64_t)experts};
  cuuint64_t strides[3] = {row, row * (cuuint64_t)j_rows,
                           row * (cuuint64_t)j_rows * (cuuint64_t)halves};
  cuuint32_t box[4] = {fp8 ? 128u : (cuuint32_t)ML_SM90_BK, (cuuint32_t)box_rows,
                       (cuuint32_t)box_halves, 1};
  cuuint32_t unit[4] = {1, 1, 1, 1};
  CUresult r = encode(map,
                      fp8                        ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                      : dt == MOELINK_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                      4, (void *)b, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return ml_fail(MOELINK_ERR_CUDA,
                   "%s: cuTensorMapEncodeTiled failed (CUresult %d) for B %p [%d x %d x %d x %d]",
                   what, (int)r, b, experts, halves, j_rows, k);
  return MOELINK_SUCCESS;
}

/* Persistent grid: one CTA per SM (at most opts->max_ctas where it asks for
 * fewer), fewer when there are fewer work items than that. A unit holds at
 * least one tile, so there are at most max_tiles units (dense: the row
 * blocks). */
static unsigned ml_sm90_grid(const int32_t *tiles, int max_tiles, int dense_rows, int nblocks,
                             int sms, const ml_cuda_gemm_opts *opts) {
  if (opts != NULL && opts->max_ctas > 0 && opts->max_ctas < sms)
    sms = opts->max_ctas;
  long long units = tiles != NULL ? (long long)max_tiles : ((long long)dense_rows + 63) / 64;
  long long items = units * (long long)nblocks;
  return (unsigned)(items < sms ? items : sms);
}

/* Slot of an sm_90a kernel in ml_gemm_smem_ready. FP8: SwiGLU has an fp32
 * output (FP8 = 1, 3) or an e4m3 one (FP8 = 2, 4); the scaled GEMM bf16, f16 or
 * fp32. CL 2: the cluster ones (the cluster slots, ML_K_SM90_CL up to
 * ML_K_SM90_FP8_WIDE, are also ml_sm90_cluster_room's). */
template <int DT, int MODE, int OUT_F32, int FP8, int CL = 1> static int ml_sm90_which(void) {
  if (FP8 == 5) /* the wide scaled GEMM with TMA stores: bf16 or f16 out */
    return ML_K_SM90_FP8_TMA + (DT == MOELINK_DTYPE_F16);
  if (FP8 == 2 || FP8 == 4) /* SwiGLU, e4m3 output */
    return FP8 == 2 ? ML_K_SM90_FP8 + 4 : ML_K_SM90_FP8_WIDE + 4;
  if (FP8)
    return (FP8 == 3 ? ML_K_SM90_FP8_WIDE
            : CL > 1 ? ML_K_SM90_FP8_CL
                     : ML_K_SM90_FP8) +
           (MODE == ML_SM90_SWIGLU ? 0
            : OUT_F32              ? 3
                                   : 1 + (DT == MOELINK_DTYPE_F16));
  return (CL > 1 ? ML_K_SM90_CL : ML_K_SM90) +
         (MODE == ML_SM90_SWIGLU ? 0
          : OUT_F32              ? 4
                                 : 2) +
         (DT == MOELINK_DTYPE_F16);
}

/* Clusters of two of a cluster kernel the device holds at once (0: it cannot
 * run them), cached per device and kernel as value + 1. */
static int ml_sm90_cluster_room_cache[ML_CUDA_MAX_DEVICES][ML_K_SM90_FP8_WIDE - ML_K_SM90_CL];

template <int DT, int MODE, int OUT_F32, int FP8 = 0>
static moelink_status_t ml_sm90_cluster_room(int *room) {
  const int which = ml_sm90_which<DT, MODE, OUT_F32, FP8, 2>();
  const void *kernel = (const void *)ml_sm90_kernel<DT, MODE, OUT_F32, FP8, 2>;
  int dev = 0;
  ML_CUDA_TRY(cudaGetDevice(&dev));
  const int cached = dev >= 0 && dev < ML_CUDA_MAX_DEVICES;
  int *slot = cached ? &ml_sm90_cluster_room_cache[dev][which - ML_K_SM90_CL] : NULL;
  int v = slot ? __atomic_load_n(slot, __ATOMIC_ACQUIRE) : 0;
  if (v == 0) {
    const int smem = ml_sm90_cfg<FP8>::SMEM_BYTES;
    ML_TRY(ml_gemm_allow_smem(kernel, which, smem));
    int sms = 0, is_sm90 = 0;
    ML_TRY(ml_cuda_sm90_device(&is_sm90, &sms));
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attrs[2];
    ml_launch_config(&cfg, attrs, dim3((unsigned)(2 * (sms > 0 ? sms : 1)), 1, 1),
                     dim3(ML_SM90_THREADS, 1, 1), (size_t)smem, 0, 2, 0);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError(); /* no clusters here: the one-CTA kernel runs */
      n = 0;
    }
    v = n + 1;
    if (slot)
      __atomic_store_n(slot, v, __ATOMIC_RELEASE);
  }
  *room = v - 1;
  return MOELINK_SUCCESS;
}

/* Clusters of two the kernel <DT, MODE, OUT_F32, FP8> runs in for these
 * options (2), else 1. */
template <int DT, int MODE, int OUT_F32, int FP8 = 0>
static moelink_status_t ml_sm90_cl(const ml_cuda_gemm_opts *opts, int *cl) {
  *cl = 1;
  if (opts == NULL || opts->cluster != 2)
    return MOELINK_SUCCESS;
  int room = 0;
  ML_TRY((ml_sm90_cluster_room<DT, MODE, OUT_F32, FP8>(&room)));
  if (room > 0)
    *cl = 2;
  return MOELINK_SUCCESS;
}

/* The same for the bf16 or f16 kernel of an epilogue. */
template <int MODE, int OUT_F32>
static moelink_status_t ml_sm90_cl_dt(moelink_dtype_t dt, const ml_cuda_gemm_opts *opts, int *cl) {
  if (dt == MOELINK_DTYPE_BF16)
    return ml_sm90_cl<MOELINK_DTYPE_BF16, MODE, OUT_F32>(opts, cl);
  return ml_sm90_cl<MOELINK_DTYPE_F16, MODE, OUT_F32>(opts, cl);
}

/* map: the kernel's two maps, B's then the output's (zeros unless
 * p->tma_out). pdl: a programmatic dependent of the stream's previous
 * kernel (the overlapped down GEMM, which waits by itself). */
template <int DT, int MODE, int OUT_F32, int FP8 = 0, int CL = 1>
static moelink_status_t ml_sm90_launch(const CUtensorMap *map, const ml_sm90_args *p, unsigned grid,
                                       cudaStream_t stream, int pdl = 0) {
  const int smem = ml_sm90_cfg<FP8>::SMEM_BYTES;
  const char *name = MODE == ML_SM90_SWIGLU
                         ? (FP8 == 2        ? "ml_sm90_kernel (fp8, swiglu, fp8 out)"
                            : FP8 == 3      ? "ml_sm90_kernel (fp8 wide, swiglu)"
                            : FP8 == 4      ? "ml_sm90_kernel (fp8 wide, swiglu, fp8 out)"
                            : FP8 && CL > 1 ? "ml_sm90_kernel (fp8, swiglu, clusters of 2)"
                            : FP8           ? "ml_sm90_kernel (fp8, swiglu)"
                            : CL > 1        ? "ml_sm90_kernel (swiglu, clusters of 2)"
                                            : "ml_sm90_kernel (swiglu)")
                         : (FP8 == 5        ? "ml_sm90_kernel (fp8 wide, scaled, TMA stores)"
                            : FP8 == 3      ? "ml_sm90_kernel (fp8 wide, scaled)"
                            : FP8 && CL > 1 ? "ml_sm90_kernel (fp8, scaled, clusters of 2)"
                            : FP8           ? "ml_sm90_kernel (fp8, scaled)"
                            : CL > 1        ? "ml_sm90_kernel (scaled, clusters of 2)"
                                            : "ml_sm90_kernel (scaled)");
  ML_TRY(ml_gemm_allow_smem((const void *)ml_sm90_kernel<DT, MODE, OUT_F32, FP8, CL>,
                            ml_sm90_which<DT, MODE, OUT_F32, FP8, CL>(), smem));
  unsigned ctas = grid;
  if constexpr (CL > 1) {
    /* grid CTAs' worth of clusters, no more than the device holds at once
     * (persistent clusters; the work comes from the schedule) */
    int room = 0;
    ML_TRY((ml_sm90_cluster_room<DT, MODE, OUT_F32, FP8>(&room)));
    unsigned clusters = (grid + 1) / 2;
    if (room > 0 && clusters > (unsigned)room)
      clusters = (unsigned)room;
    ctas = 2 * clusters;
  }
  if (CL > 1 || pdl) {
    /* clusters or a programmatic dependent: a launch with attributes */
    void *args[] = {(void *)map, (void *)(map + 1), (void *)p};
    const cudaError_t e = ml_launch_kernel_ex(
        (const void *)ml_sm90_kernel<DT, MODE, OUT_F32, FP8, CL>, dim3(ctas, 1, 1),
        dim3(ML_SM90_THREADS, 1, 1), (size_t)smem, pdl, CL, stream, args);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return ml_fail(MOELINK_ERR_CUDA, "launch of %s (%u CTAs) failed: %s", name, ctas,
                     cudaGetErrorString(e));
    }
  } else {
    ml_sm90_kernel<DT, MODE, OUT_F32, FP8, CL>
        <<<grid, ML_SM90_THREADS, smem, stream>>>(map[0], map[1], *p);
    ML_CUDA_LAUNCHED(name);
  }
  ml_sm90_last_grid = (int)ctas;
  ml_engine_last = ML_GEMM_ENGINE_SM90;
  ml_tma_store_last = p->tma_out;
  ml_sm90_last_tile = ml_sm90_cfg<FP8>::BN;
  return MOELINK_SUCCESS;
}

/* ml_sm90_launch in one CTA (cl 1) or clusters of two (cl 2). */
template <int DT, int MODE, int OUT_F32, int FP8 = 0>
static moelink_status_t ml_sm90_launch_cl(int cl, const CUtensorMap *map, const ml_sm90_args *p,
                                          unsigned grid, cudaStream_t stream, int pdl = 0) {
  return cl > 1 ? ml_sm90_launch<DT, MODE, OUT_F32, FP8, 2>(map, p, grid, stream, pdl)
                : ml_sm90_launch<DT, MODE, OUT_F32, FP8>(map, p, grid, stream, pdl);
}

/* The bf16 or f16 instantiation of an epilogue, one CTA or clusters of two. */
template <int MODE, int OUT_F32>
static moelink_status_t ml_sm90_dispatch(moelink_dtype_t dt, const CUtensorMap *map,
                                         const ml_sm90_args *p, unsigned grid, int cl, int pdl,
                                         cudaStream_t stream) {
  if (dt == MOELINK_DTYPE_BF16)
    return ml_sm90_launch_cl<MOELINK_DTYPE_BF16, MODE, OUT_F32>(cl, map, p, grid, stream, pdl);
  return ml_sm90_launch_cl<MOELINK_DTYPE_F16, MODE, OUT_F32>(cl, map, p, grid, stream, pdl);
}

/* See cuda.h. */
MOELINK_PARAM(GEMM_SM90_CLUSTER_ROWS, 256)
MOELINK_PARAM(GEMM_SM90_CLUSTER_K, 4096)
MOELINK_PARAM(GEMM_FP8_CLUSTER_ROWS, 0)
MOELINK_PARAM(GEMM_FP8_TILE, 256)

/* The FP8 kernel's tile width for these options: 256 (ml_sm90_cfg<3>) or
 * 128 (ml_sm90_cfg<1>, also the one that runs in clusters). */
static int ml_sm90_fp8_tile(const ml_cuda_gemm_opts *opts) {
  const int t =
      opts != NULL && opts->fp8_tile != 0 ? opts->fp8_tile : (int)ml_param_GEMM_FP8_TILE();
  return t == 128 ? 128 : 256;
}

extern "C" ml_cuda_gemm_opts ml_cuda_gemm_opts_for(int32_t *counter, long long rows, int experts,
                                                   int k, int fp8) {
  ml_cuda_gemm_opts o;
  o.counter = counter;
  o.fp8_tile = 0;
  o.out_rows = NULL;
  o.wait = NULL;
  o.max_ctas = 0;
  o.ready = NULL;
  o.ready_n = 0;
  o.ready_words = 0;
  o.ready_spins = NULL;
  const long long min_rows = (long long)(fp8 ? ml_param_GEMM_FP8_CLUSTER_ROWS()
                                             : ml_param_GEMM_SM90_CLUSTER_ROWS());
  o.cluster = min_rows > 0 && experts > 0 && rows >= min_rows * (long long)experts &&
                      k >= (int)ml_param_GEMM_SM90_CLUSTER_K()
                  ? 2
                  : 1;
  return o;
}

/* opts->out_rows of a scaled GEMM (NULL where none), checked: rows of the
 * output dtype (not fp32) and n a multiple of 8 (16-byte rows). */
static moelink_status_t ml_out_rows_of(const char *what, const ml_cuda_gemm_opts *opts, int n,
                                       int out_f32, void *const **rows) {
  *rows = opts != NULL ? opts->out_rows : NULL;
  if (*rows != NULL && (out_f32 || n % 8 != 0))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: output rows by pointer need a bf16/f16 output and n %% 8 == 0 (n %d, %s "
                   "output)",
                   what, n, out_f32 ? "fp32" : "dtype");
  return MOELINK_SUCCESS;
}

/* The FP8 GEMMs do not overlap (ml_cuda_gemm_opts.ready). */
static moelink_status_t ml_no_ready(const char *what, const ml_cuda_gemm_opts *opts) {
  if (opts != NULL && opts->ready != NULL)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: ready (overlapped GEMMs) is for the bf16/f16 GEMMs only", what);
  return MOELINK_SUCCESS;
}

/* opts->ready of a bf16/f16 GEMM, checked: only where the sm_90a engine runs
 * it (sm90; q its arguments, NULL where it does not) over a tile list with a
 * dynamic schedule (the scaled GEMM's waits end by zeroing the words: its
 * counter's last CTA), and not with a row wait. */
static moelink_status_t ml_ready_of(const char *what, const ml_cuda_gemm_opts *opts, int sm90,
                                    const int32_t *tiles, const ml_sm90_args *q) {
  if (opts == NULL || opts->ready == NULL)
    return MOELINK_SUCCESS;
  if (!sm90 || tiles == NULL || q->wait.signal != NULL || q->ksplit != 1 ||
      ((uintptr_t)opts->ready & 3u) ||
      (opts->ready_n > 0 && (q->sched == NULL || opts->ready_words < 1)))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: ready (overlapped GEMMs) needs the sm_90a engine, a tile list, a dynamic "
                   "schedule, no row wait, 4-byte aligned words (ready %p, %d words) "
                   "(ml_cuda_gemm_overlap_ok)",
                   what, (void *)opts->ready, opts->ready_words);
  return MOELINK_SUCCESS;
}

extern "C" int ml_cuda_gemm_overlap_ok(moelink_dtype_t dt, int n, int k, int n_down, int k_down) {
  if ((dt != MOELINK_DTYPE_BF16 && dt != MOELINK_DTYPE_F16) || ml_param_GEMM_SM90_DYNAMIC() == 0)
    return 0;
  return ml_sm90_takes(k, n, ML_SM90_SWIGLU_COLS) > 0 &&
         ml_sm90_takes(k_down, n_down, ML_SM90_SCALED_COLS) > 0;
}

/* The SwiGLU GEMMs have no output rows by pointer. */
static moelink_status_t ml_no_out_rows(const char *what, const ml_cuda_gemm_opts *opts) {
  if (opts != NULL && opts->out_rows != NULL)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: out_rows is for the scaled GEMMs only", what);
  return MOELINK_SUCCESS;
}

/* opts->wait, checked (ml_cuda_gemm_wait): *w = the rows to wait for, or
 * a wait with signal NULL where there are none. */
static moelink_status_t ml_wait_of(const char *what, const ml_cuda_gemm_opts *opts,
                                   ml_cuda_gemm_wait *w) {
  memset(w, 0, sizeof *w);
  if (opts == NULL || opts->wait == NULL)
    return MOELINK_SUCCESS;
  const ml_cuda_gemm_wait *x = opts->wait;
  if (x->signal == NULL || x->value == NULL || x->rows < 1 ||
      (((uintptr_t)x->signal | (uintptr_t)x->value) & 7u))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: a wait needs 8-byte aligned signals and value word and rows >= 1 "
                   "(signal %p, value %p, rows %d)",
                   what, (const void *)x->signal, (const void *)x->value, x->rows);
  const moelink_device_comm_t *c = &x->comm;
  int ctl_ok = c->nranks >= 1 && c->nranks <= MOELINK_DEVICE_MAX_RANKS && c->rank >= 0 &&
               c->rank < c->nranks && c->timeout_ns > 0;
  for (int r = 0; ctl_ok && r < c->nranks; ++r)
    ctl_ok = c->ctl[r] != NULL;
  if (!ctl_ok)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: the wait's device communicator is not filled in (rank %d of %d, limit "
                   "%llu ns, a control block for every rank)",
                   what, c->rank, c->nranks, (unsigned long long)c->timeout_ns);
  *w = *x;
  return MOELINK_SUCCESS;
}

/* The fields of an sm_90a launch every GEMM fills alike (FP8 fields: see
 * ml_sm90_fp8_args). cols: output columns of a work item. opts->out_rows was
 * checked by the caller (ml_out_rows_of, ml_no_out_rows); its rows are
 * indexed like the row scales, so scale_index stays for either. */
static void ml_sm90_args_fill(ml_sm90_args *q, const void *a, const int32_t *a_index, int a_div,
                              void *out, const int32_t *tiles, const int32_t *num_tiles,
                              const float *row_scale, const int32_t *scale_index, int lda, int k,
                              int n, int cols, int max_tiles, int dense_rows,
                              const ml_cuda_gemm_opts *opts) {
  memset(q, 0, sizeof *q);
  q->a = (const char *)a;
  q->a_index = a_index;
  q->out = out;
  q->tiles = tiles;
  q->num_tiles = num_tiles;
  q->row_scale = row_scale;
  q->out_rows = opts != NULL ? opts->out_rows : NULL;
  q->scale_index = row_scale != NULL || q->out_rows != NULL ? scale_index : NULL;
  q->a_div = a_index != NULL ? a_div : 1;
  q->lda = lda;
  q->k = k;
  q->n_out = n;
  q->nblocks = (n + cols - 1) / cols;
  q->max_tiles = max_tiles;
  q->dense_rows = dense_rows;
  q->ksplit = 1;
  q->sched = opts != NULL && ml_param_GEMM_SM90_DYNAMIC() != 0 ? opts->counter : NULL;
  if (opts != NULL && opts->wait != NULL)
    q->wait = *opts->wait;
}

extern "C" moelink_status_t
ml_cuda_gemm_swiglu(moelink_dtype_t dt, const void *a, int lda, const int32_t *a_index, int a_div,
                    const void *b, int n, int k, const int32_t *tiles, const int32_t *num_tiles,
                    int max_tiles, int dense_rows, void *out, const ml_cuda_gemm_opts *opts,
                    cudaStream_t stream) {
  const char *what = "ml_cuda_gemm_swiglu";
  ML_TRY(ml_no_out_rows(what, opts));
  ml_cuda_gemm_wait wait;
  ML_TRY(ml_wait_of(what, opts, &wait));
  unsigned gx = 0, gy = 0;
  ML_TRY(ml_gemm_check(what, dt, a, lda, b, n, k, tiles, num_tiles, max_tiles, dense_rows, out,
                       ML_SWIGLU_COLS, &gx, &gy));
  if (a_index != NULL && a_div < 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: a_div %d < 1", what, a_div);
  if (gx == 0 || gy == 0) return MOELINK_SUCCESS;

  int sm90 = 0, sms = 0;
  ML_TRY(ml_sm90_pick(k, n, ML_SM90_SWIGLU_COLS, &sm90, &sms));
  if (sm90) {
    const int cols = ML_SM90_SWIGLU_COLS; /* output columns (gate/up pairs) of a work item */
    int cl = 1;
    ML_TRY((ml_sm90_cl_dt<ML_SM90_SWIGLU, 0>(dt, opts, &cl)));
    /* clusters: a CTA's box is the gate or the up half of the tile's rows */
    CUtensorMap map[2] = {}; /* B, and the output (zeros unless TMA stores) */
    ML_TRY(ml_sm90_map_b_box(map, dt, b, k, n, 2, tiles != NULL ? ML_SM90_MAX_EXPERTS : 1, cols,
                             cl > 1 ? 1 : 2, what));
    ml_sm90_args q;
    ml_sm90_args_fill(&q, a, a_index, a_div, out, tiles, num_tiles, NULL, NULL, lda, k, n, cols,
                      max_tiles, dense_rows, opts);
    ML_TRY(ml_ready_of(what, opts, 1, tiles, &q));
    q.ready = opts != NULL ? opts->ready : NULL;
    q.tma_out = ml_sm90_map_out(&map[1], dt, out, n);
    return ml_sm90_dispatch<ML_SM90_SWIGLU, 0>(
        dt, map, &q, ml_sm90_grid(tiles, max_tiles, dense_rows, q.nblocks, sms, opts), cl, 0,
        stream);
  }
  ML_TRY(ml_ready_of(what, opts, 0, tiles, NULL));

  ml_swiglu_args p;
  p.a = a;
  p.a_index = a_index;
  p.b = b;
  p.out = out;
  p.tiles = tiles;
  p.num_tiles = num_tiles;
  p.lda = lda;
  p.a_div = a_index != NULL ? a_div : 1;
  p.n = n;
  p.k = k;
  p.dense_rows = dense_rows;
  p.wait = wait;
  dim3 grid(gx, gy);
  if (dt == MOELINK_DTYPE_BF16) {
    ML_TRY(ml_gemm_allow_smem((const void *)ml_swiglu_kernel<MOELINK_DTYPE_BF16>,
                              ML_K_SWIGLU_BF16, ml_xs::SMEM_BYTES));
    ml_swiglu_kernel<MOELINK_DTYPE_BF16><<<grid, ml_xs::THREADS, ml_xs::SMEM_BYTES, stream>>>(p);
    ML_CUDA_LAUNCHED("ml_swiglu_kernel<bf16>");
  } else {
    ML_TRY(ml_gemm_allow_smem((const void *)ml_swiglu_kernel<MOELINK_DTYPE_F16>,
                              ML_K_SWIGLU_F16, ml_xs::SMEM_BYTES));
    ml_swiglu_kernel<MOELINK_DTYPE_F16><<<grid, ml_xs::THREADS, ml_xs::SMEM_BYTES, stream>>>(p);
    ML_CUDA_LAUNCHED("ml_swiglu_kernel<f16>");
  }
  ml_engine_last = ML_GEMM_ENGINE_TILE;
  return MOELINK_SUCCESS;
}

/* Launches one instantiation of the scaled kernel. */
template <int DT, int OUT_F32>
static moelink_status_t ml_scaled_launch(const ml_scaled_args *p, dim3 grid, int which,
                                         const char *name, cudaStream_t stream) {
  ML_TRY(ml_gemm_allow_smem((const void *)ml_scaled_kernel<DT, OUT_F32>, which,
                            ml_xs::SMEM_BYTES));
  ml_scaled_kernel<DT, OUT_F32><<<grid, ml_xs::THREADS, ml_xs::SMEM_BYTES, stream>>>(*p);
  ML_CUDA_LAUNCHED(name);
  ml_engine_last = ML_GEMM_ENGINE_TILE;
  return MOELINK_SUCCESS;
}

/* ml_cuda_gemm_scaled, and with ksplit > 1 (sm_90a only; checked by the
 * caller) ml_cuda_gemm_splitk's k slices. */
static moelink_status_t
ml_gemm_scaled_run(const char *what, moelink_dtype_t dt, const void *a, int lda, const void *b,
                   int n, int k, const int32_t *tiles, const int32_t *num_tiles, int max_tiles,
                   int dense_rows, const float *row_scale, const int32_t *scale_index, void *out,
                   int out_f32, const ml_cuda_gemm_opts *opts, int ksplit, cudaStream_t stream) {
  unsigned gx = 0, gy = 0;
  ML_TRY(ml_gemm_check(what, dt, a, lda, b, n, k, tiles, num_tiles, max_tiles, dense_rows, out,
                       ML_SCALED_COLS, &gx, &gy));
  void *const *out_rows;
  ML_TRY(ml_out_rows_of(what, opts, n, out_f32, &out_rows));
  ml_cuda_gemm_wait wait;
  ML_TRY(ml_wait_of(what, opts, &wait));
  if (gx == 0 || gy == 0) return MOELINK_SUCCESS;

  int sm90 = 0, sms = 0;
  ML_TRY(ml_sm90_pick(k, n, ML_SM90_SCALED_COLS, &sm90, &sms));
  if (sm90) {
    const int cols = ML_SM90_SCALED_COLS; /* output columns of a work item */
    int cl = 1;
    if (ksplit > 1) {
      /* (k slices run one CTA each) */
    } else if (out_f32) {
      ML_TRY((ml_sm90_cl_dt<ML_SM90_SCALED, 1>(dt, opts, &cl)));
    } else {
      ML_TRY((ml_sm90_cl_dt<ML_SM90_SCALED, 0>(dt, opts, &cl)));
    }
    /* clusters: a CTA's box is half the tile's rows */
    CUtensorMap map[2] = {}; /* B, and the output (zeros unless TMA stores) */
    ML_TRY(ml_sm90_map_b(map, dt, b, k, n, 1, tiles != NULL ? ML_SM90_MAX_EXPERTS : 1,
                         cl > 1 ? cols / 2 : cols, what));
    ml_sm90_args q;
    ml_sm90_args_fill(&q, a, NULL, 1, out, tiles, num_tiles, row_scale, scale_index, lda, k, n,
                      cols, max_tiles, dense_rows, opts);
    q.ksplit = ksplit;
    ML_TRY(ml_ready_of(what, opts, 1, tiles, &q));
    /* overlapped with the gate/up GEMM before it: a programmatic dependent
     * of it that waits for its experts' pieces (without PDL it simply runs
     * after it, every piece there) */
    int pdl = 0;
    if (opts != NULL && opts->ready != NULL && opts->ready_n > 0) {
      q.ready = opts->ready;
      q.ready_blocks = (opts->ready_n + ML_SM90_SWIGLU_COLS - 1) / ML_SM90_SWIGLU_COLS;
      q.ready_words = opts->ready_words;
      q.ready_spins = opts->ready_spins;
      pdl = ml_cuda_pdl_allowed(stream);
    }
    unsigned grid = ml_sm90_grid(tiles, max_tiles, dense_rows, q.nblocks * ksplit, sms, opts);
    if (!out_f32 && out_rows == NULL)
      q.tma_out = ml_sm90_map_out(&map[1], dt, out, n);
    return out_f32 ? ml_sm90_dispatch<ML_SM90_SCALED, 1>(dt, map, &q, grid, cl, pdl, stream)
                   : ml_sm90_dispatch<ML_SM90_SCALED, 0>(dt, map, &q, grid, cl, pdl, stream);
  }
  ML_TRY(ml_ready_of(what, opts, 0, tiles, NULL));

  ml_scaled_args p;
  p.a = a;
  p.b = b;
  p.out = out;
  p.tiles = tiles;
  p.num_tiles = num_tiles;
  p.row_scale = row_scale;
  p.scale_index = row_scale != NULL || out_rows != NULL ? scale_index : NULL;
  p.out_rows = out_rows;
  p.lda = lda;
  p.n = n;
  p.k = k;
  p.dense_rows = dense_rows;
  p.wait = wait;
  dim3 grid(gx, gy);
  if (dt == MOELINK_DTYPE_BF16)
    return out_f32 ? ml_scaled_launch<MOELINK_DTYPE_BF16, 1>(&p, grid, ML_K_SCALED_BF16_F32,
                                                             "ml_scaled_kernel<bf16, f32 out>",
                                                             stream)
                   : ml_scaled_launch<MOELINK_DTYPE_BF16, 0>(&p, grid, ML_K_SCALED_BF16,
                                                             "ml_scaled_kernel<bf16>", stream);
  return out_f32 ? ml_scaled_launch<MOELINK_DTYPE_F16, 1>(&p, grid, ML_K_SCALED_F16_F32,
                                                          "ml_scaled_kernel<f16, f32 out>", stream)
                 : ml_scaled_launch<MOELINK_DTYPE_F16, 0>(&p, grid, ML_K_SCALED_F16,
                                                          "ml_scaled_kernel<f16>", stream);
}

extern "C" moelink_status_t
ml_cuda_gemm_scaled(moelink_dtype_t dt, const void *a, int lda, const void *b, int n, int k,
                    const int32_t *tiles, const int32_t *num_tiles, int max_tiles, int dense_rows,
                    const float *row_scale, const int32_t *scale_index, void *out, int out_f32,
                    const ml_cuda_gemm_opts *opts, cudaStream_t stream) {
  return ml_gemm_scaled_run("ml_cuda_gemm_scaled", dt, a, lda, b, n, k, tiles, num_tiles, max_tiles,
                            dense_rows, row_scale, scale_index, out, out_f32, opts, 1, stream);
}

/* ---- k split into slices (dense, fp32 out) ----------------------------------- */

/* The SMs the sm_90a engine runs a dense k x n GEMM with fp32 output on, 0
 * where the tile engine takes it. */
static int ml_sm90_dense_sms(int k, int n) { return ml_sm90_takes(k, n, ML_SM90_SCALED_COLS); }

extern "C" int ml_cuda_gemm_dense_on_sm90(int k, int n) { return ml_sm90_dense_sms(k, n) > 0; }

MOELINK_PARAM(GEMM_SPLITK, 1)
enum { ML_SPLITK_MIN_STEPS = 4 };

extern "C" int ml_cuda_gemm_splitk_parts(int rows, int n, int k, int max_parts) {
  if (ml_param_GEMM_SPLITK() == 0 || rows <= 0 || n <= 0 || k <= 0)
    return 1;
  const int sms = ml_sm90_dense_sms(k, n);
  if (sms <= 0)
    return 1;
  const long long items =
      (((long long)rows + 127) / 128) * ((n + ML_SM90_SCALED_COLS - 1) / ML_SM90_SCALED_COLS);
  const int ktiles = (k + ML_SM90_BK - 1) / ML_SM90_BK;
  /* the most parts that leave no SM without an item, each part at least
   * ML_SPLITK_MIN_STEPS k steps (the ring's fill and the epilogue amortized),
   * whole k steps each */
  int best = 1;
  for (int s = 2; s <= max_parts && s <= ktiles / ML_SPLITK_MIN_STEPS; ++s)
    if (ktiles % s == 0 && items * s <= (long long)sms)
      best = s;
  return best;
}

extern "C" moelink_status_t ml_cuda_gemm_splitk(moelink_dtype_t dt, const void *a, int lda,
                                                const void *b, int n, int k, int rows, float *out,
                                                int parts, const ml_cuda_gemm_opts *opts,
                                                cudaStream_t stream) {
  const char *what = "ml_cuda_gemm_splitk";
  if (parts <= 1)
    return ml_gemm_scaled_run(what, dt, a, lda, b, n, k, NULL, NULL, 0, rows, NULL, NULL, out, 1,
                              opts, 1, stream);
  const int ktiles = (k + ML_SM90_BK - 1) / ML_SM90_BK;
  if (k <= 0 || ktiles % parts != 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: %d parts do not divide k %d's %d steps of %d",
                   what, parts, k, ktiles, ML_SM90_BK);
  if (opts != NULL && (opts->out_rows != NULL || opts->wait != NULL))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: no rows by pointer nor row waits", what);
  if (rows < 0 || (size_t)rows * (size_t)parts > (size_t)INT32_MAX)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: %d rows x %d parts out of range", what, rows,
                   parts);
  int sm90 = 0, sms = 0;
  ML_TRY(ml_sm90_pick(k, n, ML_SM90_SCALED_COLS, &sm90, &sms));
  if (sm90) /* (k slices run one CTA each, whatever opts->cluster says) */
    return ml_gemm_scaled_run(what, dt, a, lda, b, n, k, NULL, NULL, 0, rows, NULL, NULL, out, 1,
                              opts, parts, stream);
  /* another engine: the whole sum in part 0, zeros in the others */
  ML_TRY(ml_gemm_scaled_run(what, dt, a, lda, b, n, k, NULL, NULL, 0, rows, NULL, NULL, out, 1,
                            opts, 1, stream));
  if (rows > 0 && n > 0)
    ML_CUDA_TRY(cudaMemsetAsync(out + (size_t)rows * (size_t)n, 0,
                                (size_t)(parts - 1) * (size_t)rows * (size_t)n * sizeof(float),
                                stream));
  return MOELINK_SUCCESS;
}

/* ---- FP8 operands ----------------------------------------------------------- */

/* Fills the FP8 fields of q and checks what both FP8 GEMMs need. */
static moelink_status_t ml_sm90_fp8_args(const char *what, const void *a, const float *a_scale,
                                         int lda, const void *b, const float *b_scale, int n,
                                         int k, int b_rows, const void *out, ml_sm90_args *q) {
  if (n % 128 || k % 128 || lda % 128 || lda < k)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: n %d, k %d, lda %d must be multiples of 128 (the FP8 scale blocks), "
                   "lda >= k",
                   what, n, k, lda);
  if (a == NULL || b == NULL || out == NULL || a_scale == NULL || b_scale == NULL)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: NULL operand (a %p, a_scale %p, b %p, b_scale %p, out %p)", what, a,
                   (const void *)a_scale, b, (const void *)b_scale, out);
  if (ml_cuda_misaligned(a) || ml_cuda_misaligned(b) || ml_cuda_misaligned(out) ||
      (((uintptr_t)a_scale | (uintptr_t)b_scale) & 3u))
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: operands must be 16-byte aligned and scales 4-byte aligned", what);
  q->a_scale = a_scale;
  q->b_scale = b_scale;
  q->as_ld = lda / 128;
  /* one copy a row brings the A scales of as many k blocks as the rows'
   * alignment allows (a 16- or 8-byte copy from a row start + a multiple) */
  const uintptr_t sa = (uintptr_t)a_scale;
  q->as_group = q->as_ld % 4 == 0 && sa % 16 == 0 ? 4 : q->as_ld % 2 == 0 && sa % 8 == 0 ? 2 : 1;
  q->kblocks = k / 128;
  q->b_rblocks = b_rows / 128;
  return MOELINK_SUCCESS;
}

/* The decode-kernel fallback of the FP8 GEMMs has no row wait. */
static moelink_status_t ml_fp8_fallback_no_wait(const char *what, const ml_cuda_gemm_wait *w) {
  if (w->signal != NULL)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "%s: a row wait needs the sm_90a engine (this device or shape runs the "
                   "decode kernel)",
                   what);
  return MOELINK_SUCCESS;
}

/* Options of a decode-kernel fallback: one split, so no scratch. */
static ml_decode_opts ml_fp8_fallback_opts(void) {
  ml_decode_opts o;
  memset(&o, 0, sizeof o);
  o.splits = 1;
  return o;
}

/* See cuda.h. */
extern "C" moelink_status_t ml_cuda_gemm_swiglu_fp8_quantizes(int n, int k, int *yes) {
  *yes = 0;
  int sm90 = 0, sms = 0;
  ML_TRY(ml_sm90_pick(k, n, ml_sm90_cfg<2>::BN / 2, &sm90, &sms));
  *yes = sm90;
  return MOELINK_SUCCESS;
}

extern "C" moelink_status_t
ml_cuda_gemm_swiglu_fp8(const uint8_t *a, const float *a_scale, int lda, const int32_t *a_index,
                        int a_div, const uint8_t *b, const float *b_scale, int n, int k,
                        const int32_t *tiles, const int32_t *num_tiles, int max_tiles, int rows,
                        void *out, float *out_scale, const ml_cuda_gemm_opts *opts,
                        cudaStream_t stream) {
  const char *what = "ml_cuda_gemm_swiglu_fp8";
  ML_TRY(ml_no_out_rows(what, opts));
  ML_TRY(ml_no_ready(what, opts));
  ml_cuda_gemm_wait wait;
  ML_TRY(ml_wait_of(what, opts, &wait));
  if (rows < 0 || max_tiles < 0 || (tiles != NULL && num_tiles == NULL))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: rows %d, max_tiles %d, tiles %p, num_tiles %p",
                   what, rows, max_tiles, (const void *)tiles, (const void *)num_tiles);
  if (a_index != NULL && a_div < 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: a_div %d < 1", what, a_div);
  if (rows == 0 || n == 0 || (tiles != NULL && max_tiles == 0)) return MOELINK_SUCCESS;
  if (out_scale != NULL && ((uintptr_t)out_scale & 3u))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: out_scale %p not 4-byte aligned", what,
                   (const void *)out_scale);
  int sm90 = 0, sms = 0;
  ML_TRY(ml_sm90_pick(k, n, ml_sm90_cfg<1>::BN / 2, &sm90, &sms));
  if (!sm90) {
    if (out_scale != NULL)
      return ml_fail(MOELINK_ERR_UNSUPPORTED,
                     "%s: an e4m3 output needs the sm_90a engine (n %d, k %d; see "
                     "ml_cuda_gemm_swiglu_fp8_quantizes)",
                     what, n, k);
    ML_TRY(ml_fp8_fallback_no_wait(what, &wait));
    const ml_decode_opts o = ml_fp8_fallback_opts();
    const int passes = tiles != NULL ? max_tiles : ml_cuda_decode_passes(rows, 1);
    ML_TRY(ml_cuda_fp8_swiglu(MOELINK_DTYPE_F32, a, a_scale, lda, a_index, a_div, b, b_scale, n,
                              k, tiles, num_tiles, passes, rows, out, &o, stream));
    ml_engine_last = ML_GEMM_ENGINE_TILE;
    return MOELINK_SUCCESS;
  }
  int cl = 1; /* (the quantizing epilogue never runs in clusters) */
  if (out_scale == NULL)
    ML_TRY((ml_sm90_cl<MOELINK_DTYPE_BF16, ML_SM90_SWIGLU, 1, 1>(opts, &cl)));
  /* the wide tile (n is a multiple of 128: one gate and one up block) unless
   * clusters run */
  const int wide = cl == 1 && ml_sm90_fp8_tile(opts) == 256;
  /* B rows of a tile: 64 (wide: 128) gate/up column pairs; output columns of
   * a work item: as many, or 128 (one quantization block) with the e4m3
   * output */
  const int cols = wide ? ml_sm90_cfg<3>::BN / 2 : ml_sm90_cfg<1>::BN / 2;
  ml_sm90_args q;
  ml_sm90_args_fill(&q, a, a_index, a_div, out, tiles, num_tiles, NULL, NULL, lda, k, n,
                    out_scale != NULL ? 128 : cols, max_tiles, tiles != NULL ? 0 : rows, opts);
  ML_TRY(ml_sm90_fp8_args(what, a, a_scale, lda, b, b_scale, n, k, 2 * n, out, &q));
  q.out_scale = out_scale;
  /* clusters: a CTA's box is the gate or the up half of the tile's rows */
  CUtensorMap map[2] = {}; /* B, and the output (zeros unless TMA stores) */
  ML_TRY(ml_sm90_map_b_box(map, MOELINK_DTYPE_F32, b, k, n, 2,
                           tiles != NULL ? ML_SM90_MAX_EXPERTS : 1, cols, cl > 1 ? 1 : 2, what));
  const unsigned grid = ml_sm90_grid(tiles, max_tiles, q.dense_rows, q.nblocks, sms, opts);
  if (out_scale != NULL)
    return wide ? ml_sm90_launch<MOELINK_DTYPE_BF16, ML_SM90_SWIGLU, 0, 4>(map, &q, grid, stream)
                : ml_sm90_launch<MOELINK_DTYPE_BF16, ML_SM90_SWIGLU, 0, 2>(map, &q, grid, stream);
  if (wide)
    return ml_sm90_launch<MOELINK_DTYPE_BF16, ML_SM90_SWIGLU, 1, 3>(map, &q, grid, stream);
  return ml_sm90_launch_cl<MOELINK_DTYPE_BF16, ML_SM90_SWIGLU, 1, 1>(cl, map, &q, grid, stream);
}

extern "C" moelink_status_t
ml_cuda_gemm_scaled_fp8(moelink_dtype_t out_dt, const uint8_t *a, const float *a_scale, int lda,
                        const uint8_t *b, const float *b_scale, int n, int k, const int32_t *tiles,
                        const int32_t *num_tiles, int max_tiles, int rows, const float *row_scale,
                        const int32_t *scale_index, void *out, int out_f32,
                        const ml_cuda_gemm_opts *opts, cudaStream_t stream) {
  const char *what = "ml_cuda_gemm_scaled_fp8";
  if (out_dt != MOELINK_DTYPE_BF16 && out_dt != MOELINK_DTYPE_F16)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: dtype %s not supported (bf16 or f16)", what,
                   moelink_dtype_name(out_dt));
  if (rows < 0 || max_tiles < 0 || (tiles != NULL && num_tiles == NULL))
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: rows %d, max_tiles %d, tiles %p, num_tiles %p",
                   what, rows, max_tiles, (const void *)tiles, (const void *)num_tiles);
  if (rows == 0 || n == 0 || (tiles != NULL && max_tiles == 0)) return MOELINK_SUCCESS;
  void *const *out_rows;
  ML_TRY(ml_out_rows_of(what, opts, n, out_f32, &out_rows));
  ML_TRY(ml_no_ready(what, opts));
  ml_cuda_gemm_wait wait;
  ML_TRY(ml_wait_of(what, opts, &wait));
  int sm90 = 0, sms = 0;
  ML_TRY(ml_sm90_pick(k, n, ml_sm90_cfg<1>::BN, &sm90, &sms));
  if (!sm90) {
    ML_TRY(ml_fp8_fallback_no_wait(what, &wait));
    ml_decode_opts o = ml_fp8_fallback_opts();
    o.out_rows = out_rows;
    const int passes = tiles != NULL ? max_tiles : ml_cuda_decode_passes(rows, 1);
    ML_TRY(ml_cuda_fp8_scaled(out_dt, a, a_scale, lda, b, b_scale, n, k, tiles, num_tiles,
                              passes, rows, row_scale, scale_index, out, out_f32, &o, stream));
    ml_engine_last = ML_GEMM_ENGINE_TILE;
    return MOELINK_SUCCESS;
  }
  int cl = 1;
  if (out_f32)
    ML_TRY((ml_sm90_cl<MOELINK_DTYPE_BF16, ML_SM90_SCALED, 1, 1>(opts, &cl)));
  else if (out_dt == MOELINK_DTYPE_BF16)
    ML_TRY((ml_sm90_cl<MOELINK_DTYPE_BF16, ML_SM90_SCALED, 0, 1>(opts, &cl)));
  else
    ML_TRY((ml_sm90_cl<MOELINK_DTYPE_F16, ML_SM90_SCALED, 0, 1>(opts, &cl)));
  /* the wide tile where there are 256 columns for it and no clusters run */
  const int wide = cl == 1 && n >= ml_sm90_cfg<3>::BN && ml_sm90_fp8_tile(opts) == 256;
  /* output columns of a work item */
  const int cols = wide ? ml_sm90_cfg<3>::BN : ml_sm90_cfg<1>::BN;
  ml_sm90_args q;
  ml_sm90_args_fill(&q, a, NULL, 1, out, tiles, num_tiles, row_scale, scale_index, lda, k, n, cols,
                    max_tiles, tiles != NULL ? 0 : rows, opts);
  ML_TRY(ml_sm90_fp8_args(what, a, a_scale, lda, b, b_scale, n, k, n, out, &q));
  /* clusters: a CTA's box is half the tile's rows */
  CUtensorMap map[2] = {}; /* B, and the output (zeros unless TMA stores) */
  ML_TRY(ml_sm90_map_b(map, MOELINK_DTYPE_F32, b, k, n, 1, tiles != NULL ? ML_SM90_MAX_EXPERTS : 1,
                       cl > 1 ? cols / 2 : cols, what));
  const unsigned grid = ml_sm90_grid(tiles, max_tiles, q.dense_rows, q.nblocks, sms, opts);
  /* a 16-bit output into out: the TMA-store epilogue's kernel (a stage
   * fewer) */
  if (wide && !out_f32 && out_rows == NULL && ml_sm90_map_out(&map[1], out_dt, out, n)) {
    q.tma_out = 1;
    return out_dt == MOELINK_DTYPE_BF16
               ? ml_sm90_launch<MOELINK_DTYPE_BF16, ML_SM90_SCALED, 0, 5>(map, &q, grid, stream)
               : ml_sm90_launch<MOELINK_DTYPE_F16, ML_SM90_SCALED, 0, 5>(map, &q, grid, stream);
  }
  if (wide)
    return out_f32 ? ml_sm90_launch<MOELINK_DTYPE_BF16, ML_SM90_SCALED, 1, 3>(map, &q, grid, stream)
           : out_dt == MOELINK_DTYPE_BF16
               ? ml_sm90_launch<MOELINK_DTYPE_BF16, ML_SM90_SCALED, 0, 3>(map, &q, grid, stream)
               : ml_sm90_launch<MOELINK_DTYPE_F16, ML_SM90_SCALED, 0, 3>(map, &q, grid, stream);
  if (out_f32)
    return ml_sm90_launch_cl<MOELINK_DTYPE_BF16, ML_SM90_SCALED, 1, 1>(cl, map, &q, grid, stream);
  if (out_dt == MOELINK_DTYPE_BF16)
    return ml_sm90_launch_cl<MOELINK_DTYPE_BF16, ML_SM90_SCALED, 0, 1>(cl, map, &q, grid, stream);
  return ml_sm90_launch_cl<MOELINK_DTYPE_F16, ML_SM90_SCALED, 0, 1>(cl, map, &q, grid, stream);
}
