/* Internal declarations shared by the CUDA backend's files (C and CUDA).
 * Launchers are extern "C", take the stream last and never synchronize. */
#ifndef MOELINK_CUDA_H
#define MOELINK_CUDA_H

#include "core/core.h"
#include "moe/backend.h"
#include "moelink_device.cuh"

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA runtime call that must succeed; the message names the call and place. */
#define ML_CUDA_TRY(call)                                                      \
  do {                                                                         \
    cudaError_t ml_cuda_err_ = (call);                                         \
    if (ml_cuda_err_ != cudaSuccess)                                           \
      return ml_fail(MOELINK_ERR_CUDA, "%s failed: %s (%s:%d)", #call,         \
                     cudaGetErrorString(ml_cuda_err_), __FILE__, __LINE__);    \
  } while (0)

/* After a kernel launch: reports a bad launch configuration at once. */
#define ML_CUDA_LAUNCHED(what)                                                 \
  do {                                                                         \
    cudaError_t ml_cuda_err_ = cudaGetLastError();                             \
    if (ml_cuda_err_ != cudaSuccess)                                           \
      return ml_fail(MOELINK_ERR_CUDA, "launch of %s failed: %s", (what),      \
                     cudaGetErrorString(ml_cuda_err_));                        \
  } while (0)

/* Device guard of every CUDA entry point (src/cuda/backend.c): makes ctx's
 * device current, remembering the caller's in *prev; leave restores it and
 * passes s through (or reports a failed restore when s is a success). */
moelink_status_t ml_cuda_enter(moelink_context_t ctx, int *prev);
moelink_status_t ml_cuda_leave(moelink_context_t ctx, int prev, moelink_status_t s);

/* Forwards of CUDA layers on the calling thread that ran their shared expert
 * on the layer's side stream (MOELINK_SHARED_SIDE_SMS): for tests. */
int ml_cuda_layer_side_forwards(void);

/* Routed GEMM pairs of CUDA layers on the calling thread launched overlapped
 * (the down GEMM beside the gate/up GEMM's last wave, MOELINK_GEMM_OVERLAP):
 * for tests. */
int ml_cuda_layer_overlap_forwards(void);

/* Makes stream `to` wait for what `from` has enqueued so far (through event
 * ev); what: the caller, for the error message. */
moelink_status_t ml_cuda_stream_after(cudaEvent_t ev, cudaStream_t from, cudaStream_t to,
                                      const char *what);

/* moelink_moe_experts of a CUDA layer (arguments as checked by the front
 * end), except that the down GEMM stores pair p's output row (p = token * k
 * + slot, times its weight, rounded to the dtype: y's row for p) into the
 * 16-byte aligned row out_rows[p] instead of y (out_rows NULL: into y, as
 * moelink_moe_experts). Only pairs with an expert are stored; y is still
 * required. Used by the expert-parallel layer to put each output straight
 * into the buffer of the rank that waits for it. */
moelink_status_t ml_cuda_moe_experts_to(moelink_moe_t moe, const void *x, int T,
                                        const void *plan_buffer, const float *weights, void *y,
                                        void *const *out_rows, cudaStream_t stream);

/* Whether the current device runs sm_90a machine code (compute capability
 * 9.0 exactly) and its SM count; cached per device (cuda/experts.cu). */
moelink_status_t ml_cuda_sm90_device(int *is_sm90, int *sms);

/* Raises kernel's dynamic shared-memory limit to bytes (past the 48 KiB
 * default), with the largest carveout preferred, once per device: ready is
 * the caller's table of ML_CUDA_MAX_DEVICES x slots bytes whose entry
 * (device, which) remembers it; devices past the table set it at every call.
 * A function attribute lives in the device's context; a race between threads
 * sets it twice, which is harmless. */
#define ML_CUDA_MAX_DEVICES 64 /* devices the backend's per-device tables cover */
static inline moelink_status_t ml_cuda_allow_smem(const void *kernel, unsigned char *ready,
                                                  int slots, int which, int bytes) {
  int dev = 0;
  ML_CUDA_TRY(cudaGetDevice(&dev));
  unsigned char *flag =
      dev >= 0 && dev < ML_CUDA_MAX_DEVICES ? ready + (size_t)dev * (size_t)slots + which : NULL;
  if (flag != NULL && __atomic_load_n(flag, __ATOMIC_ACQUIRE))
    return MOELINK_SUCCESS;
  ML_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  ML_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   cudaSharedmemCarveoutMaxShared));
  if (flag != NULL)
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  return MOELINK_SUCCESS;
}

/* Whether p is off the 16-byte alignment the kernels' vector accesses need. */
static inline int ml_cuda_misaligned(const void *p) { return ((uintptr_t)p & 15u) != 0; }

/* A bump allocator over a workspace's offsets: the offset of a region of
 * bytes at the 256-byte boundary at or past *cursor, which moves past it. */
static inline size_t ml_cuda_take(size_t *cursor, size_t bytes) {
  const size_t at = (*cursor + 255) & ~(size_t)255;
  *cursor = at + bytes;
  return at;
}

/* Rows per tile of the grouped GEMMs; plans built by the CUDA backend use it. */
#define ML_CUDA_TILE_ROWS 64

/* Whether a kernel may be launched on stream with programmatic stream
 * serialization (PDL): not on the legacy default stream, which also orders
 * itself against every blocking stream, and not with MOELINK_DECODE_PDL=0
 * (docs/ENV.md). A kernel so launched waits (griddepcontrol.wait) before it
 * reads or writes anything of the stream's earlier kernels. */
int ml_cuda_pdl_allowed(cudaStream_t stream);

/* ---- grouped GEMM engine (src/cuda/gemm/, src/cuda/experts.cu) ----------
 * Problems are described by a tile list in the plan layout: tiles[3*i] =
 * expert, tiles[3*i+1] = first row, tiles[3*i+2] = rows (1..ML_CUDA_TILE_ROWS),
 * for i < *num_tiles (device memory, read on the device: no host sync).
 * The grid is sized for max_tiles (known on the host); tiles past *num_tiles
 * exit at once. With tiles == NULL the problem is dense: rows [0, dense_rows)
 * all belong to expert 0. Operands are bf16 or f16 (dt); accumulation fp32.
 * B is [E, n_rows_of_B, k] row-major (a linear layer's weight): out = A B^T.
 * opts: NULL (defaults), or how the sm_90a kernel schedules its work
 * (gemm/sm90.cuh; the other engines ignore those fields), where rows go,
 * and what to wait for before a tile's loads. */
#define ML_CUDA_GEMM_SCHED_INTS 2

/* Problem rows that land while a grouped GEMM runs (a peer's push over
 * NVLink, a copy engine's copy): the GEMM waits for them tile by tile
 * instead of the whole launch waiting for all of them. Rows are counted in
 * the problem's numbering (the plan row r of a tile list, whose a_index
 * entry names the A row; dense: the A row), in chunks of `rows`: chunk c =
 * rows [c rows, (c + 1) rows) is ready once signal[c] >= *value (a 64-bit
 * signal of moelink_device.cuh: whoever delivers the chunk's A rows, their
 * a_index entries and, for FP8, their A scales sets or adds to it with
 * release semantics; values only grow, e.g. an epoch). Before a tile's A
 * loads, the GEMM waits (acquire, system scope) for every chunk the tile's
 * rows touch, so a tile never reads a row of a chunk that is not ready.
 * Everything else (the tile list, the weights, row scales, scale_index,
 * out_rows) must be in place when the GEMM starts. A wait that runs past
 * comm's limit, or finds that a wait of comm gave up before, records it in
 * comm's control block (moelink_comm_check reports MOELINK_ERR_TIMEOUT,
 * primitive ML_CUDA_PRIM_GEMM_ROWS) and lets the GEMM finish on whatever
 * the rows hold. The rows must come without SMs the GEMM holds: from other
 * GPUs, copy engines, or kernels already running (the GEMM's CTAs occupy
 * every SM they get while they wait). */
typedef struct ml_cuda_gemm_wait {
  const uint64_t *signal; /* [chunks], device memory */
  const uint64_t *value;  /* one device word, read by the GEMM when it runs */
  int rows;               /* problem rows a chunk, >= 1 */
  moelink_device_comm_t comm;
} ml_cuda_gemm_wait;

/* The primitive id a GEMM's row wait records when it gives up. */
#define ML_CUDA_PRIM_GEMM_ROWS 60

typedef struct ml_cuda_gemm_opts {
  /* NULL, or ML_CUDA_GEMM_SCHED_INTS zeroed device ints that the kernel hands
   * its work items out from (dynamic schedule) and leaves zeroed; launches
   * that may run at the same time need their own. NULL, or
   * MOELINK_GEMM_SM90_DYNAMIC=0: the static schedule. */
  int32_t *counter;
  /* 2: clusters of two CTAs that take neighbouring units of an expert and
   * share each weight box (TMA multicast), where the device can run them
   * (not the FP8 SwiGLU with e4m3 output); anything else: one CTA. Pays, if
   * at all, where experts have two units (256 rows) or more: an expert's
   * odd unit gets no multicast (sm90.cuh). */
  int cluster;
  /* FP8 GEMMs: 256 the 128 x 256 tile, 128 the 128 x 128 one (the one that
   * runs in clusters and quantizes its output); 0: MOELINK_GEMM_FP8_TILE
   * (default 256). The two give the same bits. */
  int fp8_tile;
  /* The scaled GEMMs (bf16/f16 output, n % 8 == 0) only, NULL: rows go to
   * out. Else problem row r goes to the row out_rows[scale_index[r]]
   * (scale_index NULL: out_rows[r]; 16-byte aligned) instead of out's row r:
   * e.g. straight into the peer buffer that waits for it (the expert-parallel
   * layer's return). The SwiGLU GEMMs refuse it. */
  void *const *out_rows;
  /* NULL, or rows that arrive while the GEMM runs (ml_cuda_gemm_wait; the
   * sm_90a and tile engines, bf16/f16 and FP8 on sm_90a; the FP8 GEMMs'
   * decode-kernel fallback refuses it). */
  const ml_cuda_gemm_wait *wait;
  /* 0, or the most CTAs (SMs) the sm_90a engine's persistent grid takes, so
   * that a GEMM on another stream keeps the rest (clusters: an even count;
   * the tile engine ignores it). */
  int max_ctas;
  /* The routed gate/up GEMM and the down GEMM after it, overlapped (sm_90a
   * engine, bf16/f16, tile lists, dynamic schedule: ml_cuda_gemm_overlap_ok;
   * gemm/sm90.cuh, "Overlap"). ready: NULL, or one zeroed device word per
   * expert. ml_cuda_gemm_swiglu with ready counts its stored output in it
   * and lets the next kernel of the stream start early. ml_cuda_gemm_scaled
   * with ready and ready_n > 0 (the gate/up GEMM's n), launched right after
   * it on the same stream with the same tile list and a counter of its own,
   * reads an expert's A rows only once they are stored, and leaves the
   * ready_words words zeroed. */
  uint32_t *ready;
  int ready_n, ready_words;
  /* NULL, or a device word to which such a down GEMM adds 1 each time a
   * warp's wait finds its item's expert not yet complete: it ran beside the
   * gate/up GEMM (tests: the overlap happened; without a programmatic launch
   * it stays unchanged). */
  uint32_t *ready_spins;
} ml_cuda_gemm_opts;

/* Whether a gate/up GEMM (n, k) and a down GEMM (n_down, k_down) of dtype
 * dt both take the sm_90a engine with a dynamic schedule, so that they can
 * overlap (ml_cuda_gemm_opts.ready). */
int ml_cuda_gemm_overlap_ok(moelink_dtype_t dt, int n, int k, int n_down, int k_down);

/* The options a layer passes for a grouped GEMM of `rows` rows over
 * `experts` experts (dense: 1) and inner dimension k: the counter, and
 * clusters where the average expert has MOELINK_GEMM_SM90_CLUSTER_ROWS rows
 * or more (default 256: two full units, so that most units pair) and k is
 * at least MOELINK_GEMM_SM90_CLUSTER_K (default 4096: a short k loop pays
 * the pair's coupling at every item and gains little); fp8: the FP8 GEMMs,
 * MOELINK_GEMM_FP8_CLUSTER_ROWS, default 0: never; see docs/PERF.md. */
ml_cuda_gemm_opts ml_cuda_gemm_opts_for(int32_t *counter, long long rows, int experts, int k,
                                        int fp8);

/* The dense scaled GEMM out = a b^T of `rows` rows with fp32 output, k cut
 * into `parts` equal slices of whole 64-element steps (parts divides
 * ceil(k / 64)): slice s's sums go to out + s * rows * n, [parts][rows][n]
 * in all, and the caller adds the parts in order (deterministic). Where the
 * sm_90a engine does not run, part 0 gets the whole sum and the others
 * zeros. For GEMMs whose rows and columns give fewer work items than SMs
 * (the router's logits). opts: the counter (clusters never; no rows by
 * pointer, no row waits). parts <= 1: ml_cuda_gemm_scaled. */
moelink_status_t ml_cuda_gemm_splitk(moelink_dtype_t dt, const void *a, int lda, const void *b,
                                     int n, int k, int rows, float *out, int parts,
                                     const ml_cuda_gemm_opts *opts, cudaStream_t stream);
/* The parts ml_cuda_gemm_splitk should cut k into for that GEMM on the
 * current device: the most (up to max_parts) that still give every work
 * item an SM of its own, each part 4 or more steps, dividing ceil(k / 64);
 * 1 where the sm_90a engine does not run or MOELINK_GEMM_SPLITK=0. */
int ml_cuda_gemm_splitk_parts(int rows, int n, int k, int max_parts);
/* 1: a dense GEMM of k x n weights with fp32 out (ml_cuda_gemm_splitk) runs
 * on the sm_90a engine on this device, 0: on the tile engine. */
int ml_cuda_gemm_dense_on_sm90(int k, int n);

/* Gate+up with SwiGLU in the epilogue. A row r of the problem reads row
 * a_index[r] / a_div of a (a_index == NULL: row r), lda elements apart.
 * B = [E, 2n, k] (gate rows 0..n-1 first, then up rows). out [rows, n]
 * (ld n, dtype dt): out[r, j] = silu(g) * u with g, u the fp32 accumulators
 * of gate row j and up row j. */
moelink_status_t ml_cuda_gemm_swiglu(moelink_dtype_t dt, const void *a, int lda,
                                     const int32_t *a_index, int a_div, const void *b, int n, int k,
                                     const int32_t *tiles, const int32_t *num_tiles, int max_tiles,
                                     int dense_rows, void *out, const ml_cuda_gemm_opts *opts,
                                     cudaStream_t stream);

/* Plain grouped GEMM with a row scale: out[r, j] = s(r) * sum_k a[r, k] * B[e][j][k]
 * for j < n, a [rows, k] (ld lda, not gathered), B = [E, n, k]. s(r) =
 * row_scale[scale_index[r]] when row_scale != NULL (scale_index == NULL:
 * row_scale[r]), else 1. out [rows, n] (ld n): dtype dt, or fp32 if out_f32. */
moelink_status_t ml_cuda_gemm_scaled(moelink_dtype_t dt, const void *a, int lda, const void *b,
                                     int n, int k, const int32_t *tiles, const int32_t *num_tiles,
                                     int max_tiles, int dense_rows, const float *row_scale,
                                     const int32_t *scale_index, void *out, int out_f32,
                                     const ml_cuda_gemm_opts *opts, cudaStream_t stream);

/* FP8 operands (the formats of gemm/decode.h's ml_cuda_fp8_swiglu /
 * ml_cuda_fp8_scaled: e4m3 A with an fp32 scale per 128 of a row, e4m3 B with
 * one per 128 x 128 block; n, k, lda multiples of 128) for batches past the
 * decode path: the sm_90a FP8 kernel (gemm/sm90.cuh), or where it cannot run
 * the decode kernel with one split. rows is the problem's row count (dense:
 * the rows; tiled: the bound on the rows the tiles name). The SwiGLU output is
 * fp32 [rows, n] with out_scale NULL, else e4m3 rows [rows, n] with their
 * scales out_scale [rows, n / 128] exactly as moelink_quantize's FP8 would
 * make them from the fp32 output (the quantization in the GEMM's epilogue;
 * sm_90a engine only: MOELINK_ERR_UNSUPPORTED where
 * ml_cuda_gemm_swiglu_fp8_quantizes says no); the scaled output is out_dt or
 * fp32 (out_f32). */
moelink_status_t ml_cuda_gemm_swiglu_fp8(const uint8_t *a, const float *a_scale, int lda,
                                         const int32_t *a_index, int a_div, const uint8_t *b,
                                         const float *b_scale, int n, int k, const int32_t *tiles,
                                         const int32_t *num_tiles, int max_tiles, int rows,
                                         void *out, float *out_scale, const ml_cuda_gemm_opts *opts,
                                         cudaStream_t stream);
/* *yes = 1 when ml_cuda_gemm_swiglu_fp8 can quantize its output for this n, k
 * on the current device (the sm_90a engine runs it). */
moelink_status_t ml_cuda_gemm_swiglu_fp8_quantizes(int n, int k, int *yes);
moelink_status_t ml_cuda_gemm_scaled_fp8(moelink_dtype_t out_dt, const uint8_t *a,
                                         const float *a_scale, int lda, const uint8_t *b,
                                         const float *b_scale, int n, int k, const int32_t *tiles,
                                         const int32_t *num_tiles, int max_tiles, int rows,
                                         const float *row_scale, const int32_t *scale_index,
                                         void *out, int out_f32, const ml_cuda_gemm_opts *opts,
                                         cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
