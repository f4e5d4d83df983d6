/* The Hopper (sm_90a) grouped GEMM behind ml_cuda_gemm_swiglu and
 * ml_cuda_gemm_scaled for prefill-sized problems: wgmma from shared memory,
 * a warp-specialized producer/consumer pipeline on mbarriers, persistent
 * CTAs walking the plan's tile list.
 *
 * CTA tile 128 x 256 x 64, four 48 KiB stages (192 KiB of shared memory,
 * 224 KiB with the output buffers; one CTA per SM), three warpgroups of 128
 * threads:
 *   warpgroup 0   producer (setmaxnreg down to 88): each k step it waits
 *                 for a free stage, thread 0 starts one TMA box for the B
 *                 tile (256 weight rows x 64 k) and all 128 threads gather
 *                 the A tile (128 rows x 64 k) with cp.async, whose
 *                 completion arrives on the stage's "full" mbarrier (.noinc).
 *   warpgroups 1, 2  consumers (setmaxnreg up to 208): consumer c owns A
 *                 rows 64c .. 64c + 63 and all 256 B rows: four wgmma
 *                 m64n256k16 per k step (128 fp32 accumulators a thread),
 *                 then the stage goes back on its "empty" mbarrier once the
 *                 wgmma reading it have completed.
 * Not done, being slower on H200 for every layer shape measured: a
 * 256 x 128 tile (two m64n128 blocks per consumer), and an L2 prefetch of
 * the B box four steps ahead (cp.async.bulk.prefetch.tensor).
 *
 * Clusters of two (CL = 2, an option of the launchers): the two CTAs take
 * neighbouring units of one expert and column block, and each loads half of
 * the B box into both CTAs' stage (TMA multicast), halving the L2 reads of B.
 * An expert's odd last unit is not paired with nothing: the two CTAs take it
 * at two neighbouring column blocks, each with its own B box (a split item,
 * ml_sm90_next). Measured on H200 (docs/PERF.md) for bf16: the kernel runs
 * at a higher clock (less power) but takes more cycles (the pair waits on
 * each other); the layers use it where it pays (ml_cuda_gemm_opts_for).
 * The FP8 kernel (not its quantizing epilogue) runs in clusters the same way.
 *
 * Rows. The plan cuts each expert's rows into tiles of 64 (the last one
 * shorter), listed expert by expert. A work unit is two consecutive tiles of
 * one expert (or the expert's last, odd one): consumer c computes the unit's
 * tile c, whose rows need not follow the other tile's (only the tile list
 * says where rows are). A consumer whose tile is missing skips its wgmma but
 * still takes part in every barrier, so the pipeline's phases stay in step.
 *
 * Work items are (unit, column block) pairs numbered expert by expert. In an
 * expert, units go in groups of ML_SM90_GROUP, column blocks outer and the
 * group's units inner: the CTAs running at the same time share a slab of the
 * expert's weights and a bounded set of activation rows, which both stay in
 * L2, as long as the CTAs that take neighbouring items start them at about
 * the same time. CTA b takes item b first. Its later items come from a
 * counter in global memory (p->sched; dynamic schedule): the producer claims
 * the next item near the end of the current one (its last-but-one load), so
 * items start in the order they are numbered even when the CTAs' items take
 * different times (a unit with one tile computes half as much). Without a
 * counter (sched NULL: static schedule) CTA b takes b, b + grid, b + 2 grid,
 * ..., and CTAs drift apart over a long run. The producer finds an item by
 * walking the tile list (a warp-wide ballot finds where an expert's tiles
 * end) before the current item's loads are all issued, so that the walk and
 * the next item's index loads overlap the current item's k loop, and hands
 * each item to the consumers in a header beside its first stage (column
 * block, the unit's tile rows), published by the same full barrier; a header
 * with column block -1 tells them the work is done.
 *
 * The counter: sched[0] counts claims, sched[1] CTAs done (with clusters:
 * clusters; their rank 0 claims and counts). Both are zero when a launch
 * starts: the CTA that finishes last (its claims over, the other CTAs' too)
 * sets them back to zero, so a stream-ordered next launch finds them so.
 * Launches that may overlap need counters of their own.
 *
 * Shared memory tiles are 128-byte rows (64 16-bit elements) in the 128-byte
 * swizzle: 16-byte chunk c of row r sits at chunk c ^ (r & 7) of the row,
 * inside 1024-byte-aligned groups of eight rows. TMA writes B that way
 * (CU_TENSOR_MAP_SWIZZLE_128B), the producer's cp.async writes A that way,
 * and the wgmma descriptors read both that way.
 *
 * B goes through a 4D tensor map {k, J, H, experts} (innermost first): for
 * SwiGLU J = n and H = 2 (gate half, up half), box {64, 128, 2, 1}, so one
 * TMA lands 128 gate rows and then the 128 up rows of the same columns, and
 * accumulator column c < 128 (gate) pairs with column c + 128 (up) in the
 * same thread. For the scaled GEMM J = n, H = 1, box {64, 256, 1, 1}.
 * Columns past J and k past the end read as zeros, per expert.
 *
 * FP8 operands (ml_sm90_cfg<1>, DeepSeek-V3's format): e4m3 A rows with an
 * fp32 scale per 128 k, e4m3 B with an fp32 scale per 128 x 128 block. The
 * same 128-byte swizzled rows now hold 128 k, so a stage is one k block of
 * the scale grid. The tile is 128 x 128 (B box {128, 64, 2, 1} for SwiGLU,
 * {128, 128, 1, 1} plain) in six 32 KiB stages: each consumer keeps a k
 * block's sum (64 fp32, wgmma m64n128k32 e4m3) beside its running total (64
 * more) and adds sum x (row's A scale) x (column's B scale) to the total
 * before it issues the next block's wgmma; the other consumer's wgmma run
 * meanwhile. ml_sm90_cfg<3> is the same at 128 x 256 (the default: fewer
 * bytes a FLOP, see there). The producer's threads
 * that copy A rows also copy the rows' scales, one row each, up to four k
 * blocks' worth in one copy at the first stage of each group of k blocks
 * (scattered 4-byte copies every stage cost the load pipe as much as the A
 * rows), and two threads of the second warp the tile's two B scales each
 * stage (cp.async, same full barriers), so the consumers wait on no global
 * load. ml_sm90_cfg<2> and <4> (below) also quantize the SwiGLU output in
 * the epilogue.
 *
 * Output (bf16/f16 kernel, 16-bit output into out): a consumer whose tile
 * has all 64 rows writes its rounded output into a 16 KiB shared-memory
 * buffer of its own and sends it out with TMA stores (ml_sm90_store_tma),
 * which drain while it goes on to its next item; partial tiles, fp32
 * outputs and rows by pointer (out_rows) are stored by the threads.
 *
 * Overlap (bf16/f16, a layer's routed gate/up GEMM and the down GEMM that
 * reads its output): the down GEMM need not wait for the whole gate/up
 * GEMM, whose last wave of items leaves SMs idle while its last CTAs
 * finish. The SwiGLU kernel, given ready[], lets the stream's next kernel
 * launch (griddepcontrol.launch_dependents) once all its CTAs run, and
 * counts in ready[e] each (tile, column block) piece of expert e it has
 * stored (each consumer one item late: its TMA stores are complete by then;
 * the CTA's last at its end). The down GEMM, launched as a programmatic
 * dependent, takes SMs as the gate/up CTAs leave them; before an item's
 * loads its producer threads wait (acquire) until the item's expert has all
 * its pieces, (tiles) x (gate/up column blocks), and instead of
 * griddepcontrol.wait at its start it waits at its end, so that it never
 * completes before the gate/up GEMM. Its last CTA zeroes ready[] for the
 * next pair.
 *
 * Determinism: each output element is computed by one consumer, summing k
 * in a fixed order; no atomics. */
#ifndef MOELINK_CUDA_GEMM_SM90_CUH
#define MOELINK_CUDA_GEMM_SM90_CUH

#include "cuda/gemm/ptx.cuh"
#include "cuda/gemm/wait.cuh"
#include "cuda/quant.cuh"

#include <cuda.h>
#include <stdint.h>

/* Measurement probes, for the moelink_probeN builds of CMakeLists.txt only
 * (the library is built with 0; a probe's results are wrong by design): bit
 * 1, the producer loads the stages' bytes on its first pass over the ring
 * only, then runs the barriers alone (the MMAs go on over real bytes, those
 * of the first items: over never-written shared memory the FP8 wgmma ran
 * faster than its nominal rate on H200, so such bytes give no floor); bit
 * 2, the FP8 consumers skip the promotion of each k block's sums; bit 4, the
 * consumers skip the proxy fence before their wgmma; bit 8, the consumers
 * store nothing (every epilogue, bf16 and FP8, ends before its stores: its
 * arithmetic and global stores are gone, the wgmma stay); bit 16, a bf16/f16
 * consumer whose tile has fewer than 64 rows (an expert's last, partial one)
 * treats it as missing: no wgmma, no stores, while its loads stay. What is
 * left of the time under each says what the removed part costs. */
#ifndef ML_SM90_PROBE
#define ML_SM90_PROBE 0
#endif

enum {
  ML_SM90_BK = 64,
  ML_SM90_STAGES = 4,
  ML_SM90_THREADS = 384,
  ML_SM90_STAGE_BYTES = 48 * 1024, /* A + B */
  /* per stage: the item header (see ml_sm90_producer), 8 ints */
  ML_SM90_HEADER_INTS = 8,
  /* the TMA-store epilogue's buffers: 16 KiB a consumer (64 rows x 128
   * columns of 16-bit output, two 64 x 64 boxes in the 128-byte swizzle) */
  ML_SM90_OUT_BYTES = 2 * 16 * 1024,
  /* stages, output buffers, 2 x STAGES mbarriers, STAGES headers; 1 KiB of
   * slack to align the base */
  ML_SM90_SMEM_BYTES = ML_SM90_STAGES * ML_SM90_STAGE_BYTES + ML_SM90_OUT_BYTES +
                       2 * ML_SM90_STAGES * 8 + ML_SM90_STAGES * ML_SM90_HEADER_INTS * 4 + 1024,
  /* full barrier: 128 producer threads' cp.async arrivals + thread 0's
   * expect_tx arrival; empty barrier: one arrival per consumer warp */
  ML_SM90_FULL_COUNT = 129,
  ML_SM90_EMPTY_COUNT = 8,
  /* units per raster group (see above) */
  ML_SM90_GROUP = 8,
};

enum {
  ML_SM90_BM = 128,
  ML_SM90_BN = 256, /* B rows per tile: 128 gate/up column pairs, or 256 columns */
  ML_SM90_A_BYTES = ML_SM90_BM * 128,
  ML_SM90_B_BYTES = ML_SM90_BN * 128,
  ML_SM90_ROWS = ML_SM90_BM / 16, /* A rows each producer thread copies */
  ML_SM90_SWIGLU_COLS = ML_SM90_BN / 2,
  ML_SM90_SCALED_COLS = ML_SM90_BN,
};
static_assert(ML_SM90_A_BYTES + ML_SM90_B_BYTES == ML_SM90_STAGE_BYTES, "stage size");

/* Epilogues. */
enum { ML_SM90_SWIGLU = 0, ML_SM90_SCALED = 1 };

/* Tile configurations: FP8 = 0 the bf16/f16 kernel described above, FP8 = 1
 * the e4m3 one. Shared memory: stages, then the stages' A-row scales (FP8),
 * then 2 x STAGES mbarriers, then STAGES headers. Stages stay 1024-byte
 * aligned (the swizzle's unit). */
template <int FP8> struct ml_sm90_cfg;
/* Shared memory of an FP8 configuration: its stages with their scales, 2 x
 * stages mbarriers, stages headers, the stash, 1 KiB of slack to align the
 * base. */
constexpr int ml_sm90_fp8_smem(int stages, int stage_bytes, int scale_bytes, int stash_bytes) {
  return stages * (stage_bytes + scale_bytes) + 2 * stages * 8 + stages * ML_SM90_HEADER_INTS * 4 +
         stash_bytes + 1024;
}
template <> struct ml_sm90_cfg<0> {
  static constexpr int ES = 2, BK = ML_SM90_BK, BN = ML_SM90_BN, STAGES = ML_SM90_STAGES;
  static constexpr int A_BYTES = ML_SM90_A_BYTES, B_BYTES = ML_SM90_B_BYTES;
  static constexpr int STAGE_BYTES = ML_SM90_STAGE_BYTES, SCALE_BYTES = 0, A_SCALE_ROW = 0;
  static constexpr int SMEM_BYTES = ML_SM90_SMEM_BYTES, OUT_BYTES = ML_SM90_OUT_BYTES;
  /* registers a thread: producer, consumers (one 64 x 256 accumulator) */
  static constexpr int PRODUCER_REGS = 88, CONSUMER_REGS = 208;
  static constexpr int SUBS = 1, STASH_BYTES = 0; /* see ml_sm90_cfg<2> */
  static constexpr int QOUT = 0;                  /* 1: e4m3 output rows and scales */
};
template <> struct ml_sm90_cfg<1> {
  static constexpr int ES = 1, BK = 128, BN = 128, STAGES = 6;
  static constexpr int A_BYTES = ML_SM90_BM * 128, B_BYTES = BN * 128;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  /* per stage slot: 16 bytes of A scales a row, then the stage's two B
   * scales (16 bytes). The A scales go by scale group, not by stage: the
   * g-th group of up to four k blocks (ml_sm90_args.as_group) of the
   * kernel's run keeps its rows' scales in slot g % STAGES, written at the
   * group's first stage; the slot is rewritten STAGES groups later, so at
   * least STAGES stages later, after the producer has seen every block of
   * the group released. */
  static constexpr int A_SCALE_ROW = 16;
  static constexpr int SCALE_BYTES = ML_SM90_BM * A_SCALE_ROW + 16;
  static constexpr int OUT_BYTES = 0; /* no TMA-store epilogue */
  static constexpr int SMEM_BYTES = ml_sm90_fp8_smem(STAGES, STAGE_BYTES, SCALE_BYTES, 0);
  /* the consumers hold two 64 x 128 accumulators (total, block) */
  static constexpr int PRODUCER_REGS = 64, CONSUMER_REGS = 216;
  static constexpr int SUBS = 1, STASH_BYTES = 0, QOUT = 0;
};
/* FP8 SwiGLU with the output quantized in the epilogue (moelink_quantize's
 * FP8 rows: e4m3 and an fp32 scale per 128 columns). A work item covers 128
 * output columns, one quantization block, as SUBS = 2 sub-items of 64 (the
 * B rows of one tile) over the same A rows: the consumers keep the first
 * sub-item's SwiGLU values in a shared-memory stash (32 fp32 a thread) until
 * the second's are done, then quantize both. The stash costs a stage. */
template <> struct ml_sm90_cfg<2> : ml_sm90_cfg<1> {
  static constexpr int STAGES = 5, SUBS = 2, QOUT = 1;
  static constexpr int STASH_BYTES = 2 * 128 * 32 * 4;
  static constexpr int SMEM_BYTES = ml_sm90_fp8_smem(STAGES, STAGE_BYTES, SCALE_BYTES, STASH_BYTES);
};
/* The FP8 wide tile: 128 x 256, so a stage brings 48 KiB for twice the MMA
 * work of ml_sm90_cfg<1>'s 32 KiB (the bytes an SM takes in held the 128 x
 * 128 tile, docs/PERF.md). Each consumer runs a k block as two 64 x 128
 * halves through one block accumulator (64 fp32 a thread) beside its 64 x
 * 256 total (128): the first half's wgmma, its promotion, then the second
 * half's over the same registers. B box {128, 128, 2, 1} for SwiGLU (the
 * halves are the gate and the up rows, each one B-scale block), {128, 256,
 * 1, 1} plain (two B-scale blocks); accumulators as ml_sm90_cfg<0>'s. Four
 * stages, as the bf16 kernel. */
template <> struct ml_sm90_cfg<3> : ml_sm90_cfg<1> {
  static constexpr int BN = 256, STAGES = 4;
  static constexpr int B_BYTES = BN * 128;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int SMEM_BYTES = ml_sm90_fp8_smem(STAGES, STAGE_BYTES, SCALE_BYTES, 0);
  /* the consumers hold the 64 x 256 total and one 64 x 128 block */
  static constexpr int PRODUCER_REGS = 64, CONSUMER_REGS = 216;
};
/* The wide tile with ml_sm90_cfg<2>'s e4m3 output: a work item's 128
 * output columns are one quantization block already (no sub-items, no
 * stash). */
template <> struct ml_sm90_cfg<4> : ml_sm90_cfg<3> { static constexpr int QOUT = 1; };
/* The wide tile's scaled GEMM into a 16-bit out through the TMA-store
 * epilogue (ml_sm90_store_tma): the output buffers take a stage. */
template <> struct ml_sm90_cfg<5> : ml_sm90_cfg<3> {
  static constexpr int STAGES = 3, OUT_BYTES = ML_SM90_OUT_BYTES;
  static constexpr int SMEM_BYTES =
      ml_sm90_fp8_smem(STAGES, STAGE_BYTES, SCALE_BYTES, 0) + OUT_BYTES;
};
/* Register budget: the whole CTA starts at 65536 / 384 = 170, rounded down
 * to 168 a thread, and setmaxnreg only moves registers between warpgroups. */
template <class C> constexpr bool ml_sm90_regs_fit() {
  return C::PRODUCER_REGS * 128 + 2 * C::CONSUMER_REGS * 128 <= 168 * 384;
}
static_assert(ml_sm90_regs_fit<ml_sm90_cfg<0>>() && ml_sm90_regs_fit<ml_sm90_cfg<1>>() &&
                  ml_sm90_regs_fit<ml_sm90_cfg<2>>() && ml_sm90_regs_fit<ml_sm90_cfg<3>>() &&
                  ml_sm90_regs_fit<ml_sm90_cfg<4>>() && ml_sm90_regs_fit<ml_sm90_cfg<5>>(),
              "warpgroup register budgets exceed the register file");
static_assert(ml_sm90_cfg<0>::SMEM_BYTES <= 227 * 1024,
              "stages and output buffers exceed shared memory");
static_assert(ml_sm90_cfg<1>::SMEM_BYTES <= 227 * 1024, "FP8 stages exceed shared memory");
static_assert(ml_sm90_cfg<2>::SMEM_BYTES <= 227 * 1024,
              "FP8 stages and stash exceed shared memory");
static_assert(ml_sm90_cfg<3>::SMEM_BYTES <= 227 * 1024, "FP8 wide stages exceed shared memory");
static_assert(ml_sm90_cfg<5>::SMEM_BYTES <= 227 * 1024,
              "FP8 wide stages and output buffers exceed shared memory");
static_assert(ml_sm90_cfg<1>::STAGE_BYTES % 1024 == 0 && ml_sm90_cfg<3>::STAGE_BYTES % 1024 == 0,
              "FP8 stages must stay 1024-byte aligned");

typedef struct ml_sm90_args {
  const char *a;            /* A, rows lda elements apart */
  const int32_t *a_index;   /* problem row r reads A row a_index[r] / a_div; NULL: r */
  void *out;                /* [rows, n_out], ld n_out */
  const int32_t *tiles;     /* plan tile list; NULL: dense over dense_rows */
  const int32_t *num_tiles;
  const float *row_scale;   /* scaled epilogue only; NULL: 1 */
  const int32_t *scale_index;
  int a_div, lda, k, n_out, nblocks, max_tiles, dense_rows;
  /* FP8 only: a_scale[g * as_ld + kb] for A row g and k block kb,
   * b_scale[(e * b_rblocks + B row / 128) * kblocks + kb] */
  const float *a_scale;
  const float *b_scale;
  int as_ld, kblocks, b_rblocks;
  /* k blocks whose A scales one copy a row brings (4, 2 or 1: as many as
   * the rows' alignment allows), at the first stage of each group of that
   * many k blocks of an item */
  int as_group;
  /* ml_sm90_cfg<2>, <4> only: the e4m3 output's (out) scales, [rows][n_out / 128] */
  float *out_scale;
  /* dynamic schedule (see above): two counters, zero at launch; NULL: static */
  int32_t *sched;
  /* scaled epilogue with a DT output only; NULL: rows go to out. Else problem
   * row r goes to the row out_rows[scale_index[r]] (scale_index NULL:
   * out_rows[r]; 16-byte aligned, n_out % 8 == 0), e.g. a peer's buffer */
  void *const *out_rows;
  /* rows that arrive while the kernel runs (signal NULL: none): the
   * producer waits for an item's chunks before its A loads */
  ml_cuda_gemm_wait wait;
  /* bf16/f16 kernel, DT output into out: full 64-row tiles leave through
   * shared memory and TMA stores (the kernel's output map), others as
   * before */
  int tma_out;
  /* k in ksplit equal slices of whole k steps (1: none; dense scaled GEMM
   * with fp32 output only, one CTA): slice s of an item is an item of its
   * own whose sums go to rows s * dense_rows on (ml_cuda_gemm_splitk) */
  int ksplit;
  /* The gate/up GEMM and the down GEMM after it overlapped (bf16/f16
   * kernel, tile lists; see "Overlap" at the top): ready[e], zero when the
   * SwiGLU kernel starts, counts the (64-row tile, column block) pieces of
   * expert e's output it has stored; a scaled kernel with ready_blocks > 0
   * waits before an item's loads until its expert has (tiles) x
   * ready_blocks of them, and zeroes ready[0, ready_words) when done. */
  uint32_t *ready;
  int ready_blocks, ready_words;
  /* NULL, or a word that counts the waits that found their expert
   * incomplete (ml_cuda_gemm_opts.ready_spins) */
  uint32_t *ready_spins;
} ml_sm90_args;

/* Host (cuda/experts.cu): the 4D map {k, j_rows, halves, experts} of B =
 * [E][halves * j_rows][k] with boxes {128 bytes of k, box_rows, halves, 1}
 * in the 128-byte swizzle (box_rows <= j_rows). dt F32 stands for e4m3
 * bytes (the FP8 kernel: 128 k a box). `what` prefixes the error message. */
moelink_status_t ml_sm90_map_b(CUtensorMap *map, moelink_dtype_t dt, const void *b, int k,
                               int j_rows, int halves, int experts, int box_rows,
                               const char *what);
/* The same map with boxes {128 bytes of k, box_rows, box_halves, 1} (the
 * cluster kernel loads half a tile's B rows a CTA). */
moelink_status_t ml_sm90_map_b_box(CUtensorMap *map, moelink_dtype_t dt, const void *b, int k,
                                   int j_rows, int halves, int experts, int box_rows,
                                   int box_halves, const char *what);

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* ---- PTX: mbarriers, TMA, wgmma ---------------------------------------------- */

static __device__ __forceinline__ void ml_mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

static __device__ __forceinline__ void ml_mbar_arrive(uint32_t bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}

/* Arrives and adds bytes to the transaction count the phase waits for. */
static __device__ __forceinline__ void ml_mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

/* Returns once the phase of parity `parity` has completed. A fresh barrier is
 * in phase 0, so waiting for parity 1 returns at once: that is how a
 * producer starts with every stage free. CLUSTER = 1: with acquire at
 * cluster scope, for arrivals of other CTAs of the cluster released at that
 * scope. */
template <int CLUSTER = 0>
static __device__ __forceinline__ void ml_mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    if constexpr (CLUSTER)
      asm volatile("{\n .reg .pred p;\n"
                   " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(bar), "r"(parity)
                   : "memory");
    else
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(bar), "r"(parity)
                   : "memory");
  } while (!done);
}

/* ---- clusters ---- */

static __device__ __forceinline__ uint32_t ml_cluster_rank(void) {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

/* The shared::cluster address of this CTA's shared::cta address `addr` in
 * the cluster's CTA `rank`. */
static __device__ __forceinline__ uint32_t ml_mapa(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

/* One arrival on the mbarrier at a shared::cluster address (another
 * CTA's), default semantics (release, CTA scope): what it guards must need
 * no more (a stage's wgmma reads, complete before the arrival). */
static __device__ __forceinline__ void ml_mbar_arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}

/* The same, released at cluster scope: orders this thread's earlier
 * (shared::cluster) stores before the arrival (the claim hand-over). */
static __device__ __forceinline__ void ml_mbar_arrive_remote_release(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(
                   cluster_addr)
               : "memory");
}

static __device__ __forceinline__ void ml_st_cluster_u32(uint32_t cluster_addr, uint32_t v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(cluster_addr), "r"(v) : "memory");
}

/* Every thread of every CTA of the cluster (all warps, aligned). */
static __device__ __forceinline__ void ml_cluster_sync(void) {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}

/* One arrival on bar once every cp.async this thread issued so far has
 * landed; .noinc: the arrival is one of the count the barrier was made with. */
static __device__ __forceinline__ void ml_cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

static __device__ __forceinline__ void ml_tma_load_4d(uint32_t dst, const CUtensorMap *map,
                                                      uint32_t bar, int c0, int c1, int c2,
                                                      int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

/* An L2 policy for data read once: evict it first. */
static __device__ __forceinline__ uint64_t ml_l2_evict_first(void) {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

/* ml_tma_load_4d with an L2 cache policy (ml_l2_evict_first: a weight
 * stream read once). */
static __device__ __forceinline__ void ml_tma_load_4d_hint(uint32_t dst, const CUtensorMap *map,
                                                           uint32_t bar, int c0, int c1, int c2,
                                                           int c3, uint64_t pol) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
               "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(pol)
               : "memory");
}

/* ml_tma_load_4d into the same shared-memory offset of every CTA of the
 * cluster in mask, completing bytes on each one's mbarrier at bar's offset. */
static __device__ __forceinline__ void ml_tma_load_4d_mc(uint32_t dst, const CUtensorMap *map,
                                                         uint32_t bar, int c0, int c1, int c2,
                                                         int c3, uint16_t mask) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
               "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(mask)
               : "memory");
}

/* A 2D TMA store of the box at shared address src to coordinates (c0
 * innermost, c1) of map, in this thread's bulk-async group. */
static __device__ __forceinline__ void ml_tma_store_2d(const CUtensorMap *map, uint32_t src, int c0,
                                                       int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          (uint64_t)map),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}

static __device__ __forceinline__ void ml_bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/* This thread's bulk stores have read their shared memory (it may be
 * rewritten); _all: they are complete. */
static __device__ __forceinline__ void ml_bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
static __device__ __forceinline__ void ml_bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

/* The 128 threads of a warpgroup meet at named barrier id (1: the
 * producer's, 2 + c: consumer c's). */
static __device__ __forceinline__ void ml_wg_sync(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

/* Shared-memory matrix descriptor: K-major rows of 128 bytes in the 128-byte
 * swizzle, eight-row groups 1024 bytes apart (stride byte offset); the
 * leading byte offset is unused by this layout and set to 1 as customary. */
static __device__ __forceinline__ uint64_t ml_wgmma_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

static __device__ __forceinline__ void ml_wgmma_fence(void) {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void ml_wgmma_commit(void) {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> static __device__ __forceinline__ void ml_wgmma_wait(void) {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads or writes across the
 * point where it stands (wgmma writes them behind the compiler's back until
 * a wait_group says it is done). */
template <int N> static __device__ __forceinline__ void ml_acc_fence(float *d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define ML_D8(b)                                                                     \
  "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]),        \
      "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define ML_D64                                                                       \
  ML_D8(0), ML_D8(8), ML_D8(16), ML_D8(24), ML_D8(32), ML_D8(40), ML_D8(48), ML_D8(56)
#define ML_D128                                                                      \
  ML_D64, ML_D8(64), ML_D8(72), ML_D8(80), ML_D8(88), ML_D8(96), ML_D8(104), ML_D8(112), \
      ML_D8(120)
#define ML_R64                                                                                  \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ML_R128                                                                                 \
  ML_R64 ", "                                                                                   \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "            \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "            \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
/* d[64 x 256] += A[64 x 16] B[256 x 16]^T, both K-major in shared memory;
 * DT is the operand format. scale-d is a predicate set to 1: the caller
 * zeroes d before an item. Thread t of the warpgroup holds d[i] at row
 * 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2), column 8 (i / 4) +
 * 2 (t % 4) + i % 2. */
template <int DT>
static __device__ __forceinline__ void ml_wgmma_256(float *d, uint64_t da, uint64_t db) {
  if constexpr (DT == MOELINK_DTYPE_BF16)
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
                 " wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" ML_R128
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : ML_D128
                 : "l"(da), "l"(db), "r"(1));
  else
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
                 " wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" ML_R128
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : ML_D128
                 : "l"(da), "l"(db), "r"(1));
}

/* d[64 x 128] += A[64 x 16] B[128 x 16]^T, 16-bit operands K-major in shared
 * memory (the tensor-parallel gemm_ar kernel of up to 128 rows); d zeroed
 * by the caller. Accumulator layout as above. */
template <int DT>
static __device__ __forceinline__ void ml_wgmma_128(float *d, uint64_t da, uint64_t db) {
  if constexpr (DT == MOELINK_DTYPE_BF16)
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
                 " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" ML_R64
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : ML_D64
                 : "l"(da), "l"(db), "r"(1));
  else
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
                 " wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" ML_R64
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : ML_D64
                 : "l"(da), "l"(db), "r"(1));
}

/* d[64 x 128] (+)= A[64 x 32] B[128 x 32]^T, e4m3 operands K-major in shared
 * memory (the only layout 8-bit wgmma reads); accumulate 0 overwrites d.
 * Accumulator layout as above. */
static __device__ __forceinline__ void ml_wgmma_128_e4m3(float *d, uint64_t da, uint64_t db,
                                                         int accumulate) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
               " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" ML_R64
               "}, %64, %65, p, 1, 1;\n}\n"
               : ML_D64
               : "l"(da), "l"(db), "r"(accumulate));
}

#undef ML_D8
#undef ML_D64
#undef ML_D128
#undef ML_R64
#undef ML_R128

/* ---- the schedule ---------------------------------------------------------- */

/* The walker's position: the current segment (one expert's run of tiles). */
typedef struct ml_sm90_walk {
  int t0, nt;   /* first tile, tiles */
  int w0, work; /* first work item, work items */
  int num_tiles;
} ml_sm90_walk;

typedef struct ml_sm90_item {
  int expert, nb;       /* expert, column block */
  int nt;               /* tiles of the expert */
  int row0[2], rows[2]; /* the unit's tiles (rows 0: absent) */
  int split;            /* CL = 2: each CTA loads its own whole B box (no multicast) */
  int ks;               /* the k slice (ksplit > 1) */
} ml_sm90_item;

static __device__ __forceinline__ void ml_sm90_tile(const ml_sm90_args *p, int t, int *expert,
                                                    int *row0, int *rows) {
  int r;
  if (p->tiles != NULL) {
    *expert = __ldg(p->tiles + 3 * t);
    *row0 = __ldg(p->tiles + 3 * t + 1);
    r = __ldg(p->tiles + 3 * t + 2);
  } else {
    *expert = 0;
    *row0 = t * 64;
    r = p->dense_rows - t * 64;
  }
  /* a bad plan must not make a consumer write rows it did not compute */
  *rows = r < 0 ? 0 : (r > 64 ? 64 : r);
}

/* Tiles from t0 on that belong to t0's expert (warp-wide; all lanes get it). */
static __device__ __forceinline__ int ml_sm90_seg_len(const ml_sm90_args *p, int t0,
                                                      int num_tiles) {
  if (p->tiles == NULL) return num_tiles - t0;
  int lane = (int)threadIdx.x & 31;
  int e0 = __ldg(p->tiles + 3 * t0);
  for (int len = 0;; len += 32) {
    int t = t0 + len + lane;
    int other = t >= num_tiles || __ldg(p->tiles + 3 * t) != e0;
    unsigned m = __ballot_sync(0xffffffffu, other);
    if (m) return len + __ffs((int)m) - 1;
  }
}

static __device__ __forceinline__ void ml_sm90_walk_init(const ml_sm90_args *p,
                                                         ml_sm90_walk *s) {
  int n;
  if (p->tiles != NULL) {
    n = __ldg(p->num_tiles);
    n = n < p->max_tiles ? n : p->max_tiles;
  } else {
    n = (p->dense_rows + 63) / 64;
  }
  s->num_tiles = n < 0 ? 0 : n;
  s->t0 = 0;
  s->nt = 0;
  s->w0 = 0;
  s->work = 0;
}

/* Work items of one expert's segment of nt tiles (units of two tiles). CL =
 * 2: pairs of units, and an odd unit's split items (ml_sm90_next). */
template <int CL> static __device__ __forceinline__ int ml_sm90_seg_work(int nt, int nblocks) {
  const int units = (nt + 1) >> 1;
  if (CL == 1)
    return units * nblocks;
  return (units >> 1) * nblocks + (units & 1) * ((nblocks + 1) >> 1);
}

/* Work item w (w only grows from call to call). Returns 0 past the last.
 * CL = 2 (a cluster of two CTAs): an item is a pair of neighbouring units of
 * one expert at one column block, the CTA of cluster rank r taking unit
 * 2 q + r, both CTAs' B rows loaded half by each (multicast); an expert's
 * odd last unit goes in split items instead: the unit at column blocks 2 j
 * (rank 0) and 2 j + 1 (rank 1), each CTA loading its own B box (with an
 * odd number of column blocks the last split item has rank 1 absent: rows
 * 0, no loads). Ordering, within an expert: groups of ML_SM90_GROUP / CL
 * units (pairs), column blocks outer; in the last group of an expert with
 * an odd unit, column blocks go two at a time, each pair of blocks followed
 * by its split item, so the odd unit reads the B boxes its expert's pairs
 * have just brought into L2. */
template <int CL>
static __device__ __forceinline__ int ml_sm90_next(const ml_sm90_args *p, ml_sm90_walk *s, int w,
                                                   ml_sm90_item *it, int rank) {
  while (w >= s->w0 + s->work) {
    s->w0 += s->work;
    s->t0 += s->nt;
    if (s->t0 >= s->num_tiles) {
      s->nt = 0;
      s->work = 0;
      return 0;
    }
    s->nt = ml_sm90_seg_len(p, s->t0, s->num_tiles);
    s->work = ml_sm90_seg_work<CL>(s->nt, p->nblocks) * p->ksplit;
  }
  const int units = (s->nt + 1) >> 1;
  const int pairs = CL == 1 ? units : units >> 1; /* items of one column block, odd unit aside */
  const int odd = CL == 1 ? 0 : units & 1;
  constexpr int GROUP = ML_SM90_GROUP / CL;
  /* k slices innermost: an item's slices run side by side */
  const int local = (w - s->w0) / p->ksplit, nblocks = p->nblocks;
  const int full = pairs / GROUP, per_group = GROUP * nblocks;
  int u;
  it->ks = (w - s->w0) - local * p->ksplit;
  it->split = 0;
  it->row0[0] = it->rows[0] = it->row0[1] = it->rows[1] = 0;
  if (local < full * per_group) {
    const int g = local / per_group, rem = local - g * per_group;
    it->nb = rem / GROUP;
    u = (g * GROUP + rem % GROUP) * CL + rank;
  } else {
    const int gs = pairs - full * GROUP, rem = local - full * per_group;
    if (!odd) {
      it->nb = rem / gs;
      u = (full * GROUP + rem % gs) * CL + rank;
    } else {
      /* two column blocks' pairs, then their split item */
      const int j = rem / (2 * gs + 1), q = rem - j * (2 * gs + 1);
      const int in_pairs = (2 * j + 1 < nblocks ? 2 : 1) * gs;
      if (q < in_pairs) {
        it->nb = 2 * j + q / gs;
        u = (full * GROUP + q % gs) * CL + rank;
      } else {
        it->split = 1;
        it->nb = 2 * j + rank;
        u = units - 1;
        if (it->nb >= nblocks) {
          int r0, r;
          it->nt = s->nt;
          ml_sm90_tile(p, s->t0, &it->expert, &r0, &r);
          return 1; /* absent: no loads, no MMAs */
        }
      }
    }
  }
  const int ta = s->t0 + 2 * u;
  it->nt = s->nt;
  ml_sm90_tile(p, ta, &it->expert, &it->row0[0], &it->rows[0]);
  if (2 * u + 1 < s->nt) {
    int e;
    ml_sm90_tile(p, ta + 1, &e, &it->row0[1], &it->rows[1]);
  }
  return 1;
}

/* ---- roles ----------------------------------------------------------------- */

/* The next stage of a ring of C::STAGES, the phase flipping at each wrap. */
template <class C>
static __device__ __forceinline__ void ml_sm90_next_stage(int *stage, uint32_t *phase) {
  if (++*stage == C::STAGES) {
    *stage = 0;
    *phase ^= 1u;
  }
}

/* FP8: the A-scale group of k block kt (ml_sm90_cfg<1>): at a group's first
 * block (the returned offset in the group is 0) *gslot moves to the next of
 * the C::STAGES slots. The producer and the consumers step it alike, block
 * by block, so they agree on the slot. */
template <class C>
static __device__ __forceinline__ int ml_sm90_scale_group(int kt, int g, int *gslot) {
  const int j = kt & (g - 1);
  if (j == 0)
    *gslot = *gslot + 1 == C::STAGES ? 0 : *gslot + 1;
  return j;
}

/* silu(g) u of the wgmma epilogues; for very negative g the denominator
 * overflows to inf and the fast division gives -0, the right limit. */
static __device__ __forceinline__ float ml_sm90_silu_mul(float g, float u) {
  return __fdividef(g, 1.0f + __expf(-g)) * u;
}

static __device__ __forceinline__ uint32_t ml_sm90_full(uint32_t bars, int s) {
  return bars + (uint32_t)(8 * s);
}
template <class C> static __device__ __forceinline__ uint32_t ml_sm90_empty(uint32_t bars, int s) {
  return bars + (uint32_t)(8 * (C::STAGES + s));
}

/* A rows of an item this producer thread copies: rows r0 + 16 i, i < 8, row
 * r of the CTA in tile r / 64. src = A row index, valid bit i = the row
 * exists. */
static __device__ __forceinline__ uint32_t ml_sm90_rows(const ml_sm90_args *p,
                                                        const ml_sm90_item *it, int r0,
                                                        int32_t *src) {
  uint32_t valid = 0;
#pragma unroll
  for (int i = 0; i < ML_SM90_ROWS; ++i) {
    const int h = i >> 2, rr = r0 + 16 * (i & 3);
    const int ok = rr < it->rows[h];
    int g = 0;
    if (ok) {
      g = it->row0[h] + rr;
      if (p->a_index != NULL)
        g = (p->wait.signal != NULL ? ml_gemm_ld_index(p->a_index + g) : __ldg(p->a_index + g)) /
            p->a_div;
    }
    src[i] = g;
    valid |= (uint32_t)ok << i;
  }
  return valid;
}

/* Before an item's A loads (and its a_index reads): the chunks of rows its
 * unit's tiles touch are ready (ml_cuda_gemm_wait). Warp 0 of the producer
 * waits, then the producer warpgroup meets; every producer thread calls it
 * for the same items. */
static __device__ __forceinline__ void ml_sm90_wait_item(const ml_sm90_args *p,
                                                         const ml_sm90_item *it, int tid) {
  if (p->wait.signal == NULL)
    return;
  if (tid < 32)
    for (int h = 0; h < 2; ++h)
      ml_gemm_wait_rows(&p->wait, it->row0[h], it->row0[h] + it->rows[h], tid, 32);
  ml_wg_sync(1);
}

/* Overlap, the down GEMM's side: whether the item's expert's gate/up output
 * is all stored (an acquire: this thread's later loads see it). An item
 * without rows (an absent split item) loads no A and is ready. */
static __device__ __forceinline__ bool ml_sm90_ready_seen(const ml_sm90_args *p,
                                                          const ml_sm90_item *it) {
  if (p->ready_blocks <= 0 || it->rows[0] + it->rows[1] == 0)
    return true;
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n"
               : "=r"(v)
               : "l"(p->ready + it->expert)
               : "memory");
  return v >= (uint32_t)(it->nt * p->ready_blocks);
}

/* Waits for that, each producer thread for itself (its own acquire before
 * its own A loads; no producer barrier): one load a thread; where its warp
 * finds the pieces missing, lane 0 polls until they are there, then every
 * lane loads once more. The gate/up GEMM's CTAs all run (the down GEMM
 * launched once each of them had started), so the pieces come; past
 * ML_SM90_READY_NS the kernel traps (a plan or a launch gone wrong), which
 * the stream reports, instead of hanging. Every lane of the warp calls it
 * for the same item. */
#define ML_SM90_READY_NS 10000000000ull
static __device__ __noinline__ void ml_sm90_ready_spin(const ml_sm90_args *p,
                                                       const ml_sm90_item *it) {
  if ((threadIdx.x & 31) == 0) {
    if (p->ready_spins != NULL)
      atomicAdd(p->ready_spins, 1u);
    const uint64_t t0 = ml_globaltimer();
    while (!ml_sm90_ready_seen(p, it)) {
      __nanosleep(256);
      if (ml_globaltimer() - t0 > ML_SM90_READY_NS)
        __trap();
    }
  }
  __syncwarp();
  (void)ml_sm90_ready_seen(p, it);
}
/* Overlap, the gate/up GEMM's side: whether this launch counts its stored
 * pieces in p->ready (the bf16/f16 SwiGLU kernel given ready words). */
template <class C, int MODE>
static __device__ __forceinline__ bool ml_sm90_ready_counts(const ml_sm90_args *p) {
  return C::ES == 2 && MODE == ML_SM90_SWIGLU && p->ready != NULL;
}
/* Whether a kernel has the wait at all: the bf16/f16 scaled kernel only (the
 * FP8 producers have no registers to spare, and their GEMMs never overlap);
 * and whether this launch's producers wait (an overlapped down GEMM). */
template <class C, int MODE>
static __device__ __forceinline__ constexpr bool ml_sm90_ready_code(void) {
  return C::ES == 2 && MODE == ML_SM90_SCALED;
}
template <class C, int MODE>
static __device__ __forceinline__ bool ml_sm90_ready_waits(const ml_sm90_args *p) {
  return ml_sm90_ready_code<C, MODE>() && p->ready_blocks > 0;
}
template <class C, int MODE>
static __device__ __forceinline__ void ml_sm90_ready_wait(const ml_sm90_args *p,
                                                          const ml_sm90_item *it) {
  if (ml_sm90_ready_code<C, MODE>() && !__all_sync(0xffffffffu, ml_sm90_ready_seen(p, it)))
    ml_sm90_ready_spin(p, it);
}

/* Item header of a stage: [0] column block (-1: no more work), [1 + i] first
 * row and [3 + i] rows of the unit's tile i, [5] the k slice, [6] the
 * expert. Written by producer thread 0
 * before its arrival on the stage's full barrier (a release), read by the
 * consumers after their wait on it (an acquire).
 *
 * CL = 2: the two CTAs of a cluster walk the same items (pairs of units) in
 * step. Each loads its half of the item's B rows (box rank, 128 rows) into
 * both CTAs' stage at once (TMA multicast), so a stage is refilled only when
 * both CTAs' consumers have released it (their empty barriers count both);
 * each gathers its own unit's A rows. Rank 0 claims the dynamic schedule's
 * items and hands each claim to rank 1 through rank 1's claim slot: cbar[0]
 * (in rank 1) says the slot is full, cbar[1] (in rank 0) that rank 1 has
 * read it. */
template <class C, int MODE, int CL>
static __device__ __forceinline__ void
ml_sm90_producer(const ml_sm90_args *p, const CUtensorMap *map, uint32_t base, uint32_t scales,
                 uint32_t bars, int *headers, int *claim, uint32_t cbar) {
  const int tid = (int)threadIdx.x; /* 0..127 */
  const int c = tid & 7, r0 = tid >> 3;
  /* k steps of an item (of its k slice, ksplit > 1) */
  const int ktiles = (p->k + C::BK - 1) / C::BK / p->ksplit;
  const int cols = MODE == ML_SM90_SWIGLU ? C::BN / 2 : C::BN;
  const size_t lda_bytes = (size_t)p->lda * C::ES;
  const int rank = CL > 1 ? (int)ml_cluster_rank() : 0;
  const int grid = (int)gridDim.x / CL; /* clusters */
  /* every row this thread copies has (row & 7) == (r0 & 7): one swizzled
   * column for all of them */
  const uint32_t dst0 = (uint32_t)(r0 * 128 + ((c ^ (r0 & 7)) << 4));
  int stage = 0;
  uint32_t phase = 0;
  int gslot = -1; /* FP8: the A-scale slot of the current scale group (ml_sm90_scale_group) */
  bool loads_done = false; /* probe bit 1: the ring has had its first pass */
  ml_sm90_walk walk;
  ml_sm90_walk_init(p, &walk);
  int w = (int)blockIdx.x / CL;
  ml_sm90_item it;
  int have = ml_sm90_next<CL>(p, &walk, w, &it, rank);
  int32_t src[ML_SM90_ROWS];
  /* overlap: the expert whose pieces this thread last saw complete (an
   * expert's items follow each other: one wait for all of them) */
  int ready_e = -1;
  if (have) {
    ml_sm90_wait_item(p, &it, tid);
    ml_sm90_ready_wait<C, MODE>(p, &it);
    if (it.rows[0] + it.rows[1] > 0) /* (an item without rows waits for nothing) */
      ready_e = it.expert;
  }
  uint32_t valid = have ? ml_sm90_rows(p, &it, r0, src) : 0u;
  /* where in an item the next one is found: its first step (static), its
   * last-but-one load (dynamic: a claim as late as the loads allow) */
  const int steps = ktiles * C::SUBS; /* stages an item takes */
  const int kfind = p->sched != NULL && steps > 1 ? steps - 2 : 0;
  int claims = 0;
  static_assert(C::ES != 1 || ML_SM90_ROWS == 8, "FP8: one A-scale row for each of 8 threads");
  while (have) {
    /* the addresses of this thread's 16-byte chunk of the item's A rows,
     * moved along k in place step by step (rows past the unit: row 0, zero
     * bytes of it); a fresh register pair for each copy's address costs a
     * wait on the previous copy's operand read */
    const char *rp[ML_SM90_ROWS];
    const int kt0 = it.ks * ktiles; /* the item's first k step */
#pragma unroll
    for (int i = 0; i < ML_SM90_ROWS; ++i)
      rp[i] = p->a + (size_t)src[i] * lda_bytes + (size_t)kt0 * (C::BK * C::ES) + (size_t)(c * 16);
    /* FP8: the 8 threads that copy rows r0 + 16 i (i < 8) copy one row's A
     * scales each, thread c those of row r0 + 16 c (no divergent loop, no
     * run-time index into src) */
    const float *sc_src = p->a_scale;
    int sc_ok = 0;
    if (C::ES == 1) {
#pragma unroll
      for (int i = 0; i < ML_SM90_ROWS; ++i)
        if (i == c && ((valid >> i) & 1)) {
          sc_src = p->a_scale + (size_t)src[i] * (size_t)p->as_ld;
          sc_ok = 1;
        }
    }
    ml_sm90_item nx;
    int32_t src_n[ML_SM90_ROWS];
    uint32_t valid_n = 0;
    int have_n = 0, rows_n = 0, wait_n = 0;
    int w_n = w + grid;
    for (int st = 0; st < steps; ++st) {
      /* sub-item sub (ml_sm90_cfg<2>) of the item, its k block kt (kl in
       * the item); nbs the B tile (64 gate/up column pairs) it reads */
      const int sub = C::SUBS > 1 && st >= ktiles, kl = st - sub * ktiles, kt = kt0 + kl;
      const int nbs = it.nb * C::SUBS + sub;
      const uint32_t full = ml_sm90_full(bars, stage);
      const uint32_t a_s = base + (uint32_t)(stage * C::STAGE_BYTES);
      /* (with CL = 2 the other CTA's consumers arrive here too; what they
       * guard is their wgmma reads of the stage, complete before they
       * arrive, so no cluster-scope acquire is needed) */
      ml_mbar_wait(ml_sm90_empty<C>(bars, stage), phase ^ 1u);
      /* probe bit 1: loads for the first pass over the ring only (the MMAs
       * then run on real bytes, the first items' again and again) */
      const bool skip = (ML_SM90_PROBE & 1) && loads_done;
      if (tid == 0) {
        int *h = headers + stage * ML_SM90_HEADER_INTS;
        if (st == 0) {
          h[0] = it.nb;
          h[1] = it.row0[0];
          h[2] = it.row0[1];
          h[3] = it.rows[0];
          h[4] = it.rows[1];
          h[5] = it.ks;
          if (C::ES == 2 && MODE == ML_SM90_SWIGLU)
            h[6] = it.expert;
        }
        /* (an absent split item's CTA loads no B: nothing to expect) */
        const bool no_b = skip || (CL > 1 && it.split && it.rows[0] == 0);
        if (no_b)
          ml_mbar_arrive(full);
        else
          ml_mbar_arrive_tx(full, C::B_BYTES);
        if (no_b) {
        } else if (CL > 1 && it.split) {
          /* a split item: the whole B box into this CTA's stage only, as the
           * two halves the cluster's multicast would bring */
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t dst = a_s + C::A_BYTES + (uint32_t)(h * (C::B_BYTES / 2));
            if (MODE == ML_SM90_SWIGLU)
              ml_tma_load_4d(dst, map, full, kt * C::BK, it.nb * cols, h, it.expert);
            else
              ml_tma_load_4d(dst, map, full, kt * C::BK, it.nb * cols + h * (C::BN / 2), 0,
                             it.expert);
          }
        } else if (CL > 1) {
          /* this CTA's half of the B rows, into both CTAs' stage: SwiGLU the
           * gate (rank 0) or up (rank 1) rows, scaled rows 128 rank on */
          const uint32_t half = (uint32_t)(rank * (C::B_BYTES / 2));
          if (MODE == ML_SM90_SWIGLU)
            ml_tma_load_4d_mc(a_s + C::A_BYTES + half, map, full, kt * C::BK, it.nb * cols, rank,
                              it.expert, (uint16_t)3);
          else
            ml_tma_load_4d_mc(a_s + C::A_BYTES + half, map, full, kt * C::BK,
                              it.nb * cols + rank * (C::BN / 2), 0, it.expert, (uint16_t)3);
        } else {
          ml_tma_load_4d(a_s + C::A_BYTES, map, full, kt * C::BK, nbs * cols, 0, it.expert);
        }
      }
      /* k is a multiple of 8 (FP8: of 128): a 16-byte chunk is all inside k
       * or all past. A step wholly inside k (all but maybe the last) copies
       * from the row addresses as they are. */
      if (kl > 0) {
#pragma unroll
        for (int i = 0; i < ML_SM90_ROWS; ++i)
          rp[i] += C::BK * C::ES;
      } else if (st > 0) {
        /* the next sub-item: the same rows from k = 0 again */
#pragma unroll
        for (int i = 0; i < ML_SM90_ROWS; ++i)
          rp[i] -= (size_t)(ktiles - 1) * C::BK * C::ES;
      }
      if (skip) {
      } else if ((kt + 1) * C::BK <= p->k) {
#pragma unroll
        for (int i = 0; i < ML_SM90_ROWS; ++i)
          ml_cp_async16(a_s + dst0 + (uint32_t)(i * 16 * 128), rp[i], ((valid >> i) & 1) ? 16 : 0);
      } else {
        const uint32_t ok_k = kt * C::BK + c * (16 / C::ES) < p->k ? valid : 0u;
#pragma unroll
        for (int i = 0; i < ML_SM90_ROWS; ++i) {
          const int ok = (ok_k >> i) & 1;
          ml_cp_async16(a_s + dst0 + (uint32_t)(i * 16 * 128), ok ? rp[i] : p->a, ok ? 16 : 0);
        }
      }
      if (C::ES == 1 && !skip) {
        /* at the first k block of a scale group: the group's A scales of row
         * r0 + 16 c (row r of the CTA at 16 r; one copy of up to 16 bytes a
         * row instead of a scattered 4-byte copy every stage) */
        const uint32_t sc = scales + (uint32_t)(stage * C::SCALE_BYTES);
        const int g = p->as_group;
        if (ml_sm90_scale_group<C>(kt, g, &gslot) == 0) {
          const int left = p->kblocks - kt;
          const int bytes = sc_ok ? 4 * (left < g ? left : g) : 0;
          const uint32_t dst = scales + (uint32_t)(gslot * C::SCALE_BYTES) +
                               (uint32_t)((r0 + 16 * c) * C::A_SCALE_ROW);
          const float *src_s = sc_ok ? sc_src + kt : p->a_scale;
          if (g == 4)
            ml_cp_async16(dst, src_s, bytes);
          else if (g == 2)
            ml_cp_async8(dst, src_s, bytes);
          else
            ml_cp_async4(dst, src_s, bytes);
        }
        if ((unsigned)(tid - 32) < 2u) {
          /* and the tile's two B scales of this k block (SwiGLU: the gate
           * rows' block and the up rows'; plain: its one block twice, the
           * wide tile's two blocks), one
           * each, by two threads of a warp that issues no TMA */
          const int rb = (tid & 1) && MODE == ML_SM90_SWIGLU
                             ? (p->n_out + nbs * cols) / 128
                             : nbs * cols / 128 + ((tid & 1) && cols > 128);
          /* (a wide tile's second block may lie past B: a zero scale for
           * the zero rows TMA brings, columns that are never stored) */
          const int ok = rb < p->b_rblocks;
          const size_t eb = (size_t)it.expert * (size_t)p->b_rblocks;
          ml_cp_async4(sc + (uint32_t)(ML_SM90_BM * C::A_SCALE_ROW + 4 * (tid & 1)),
                       ok ? p->b_scale + (eb + (size_t)rb) * (size_t)p->kblocks + kt : p->b_scale,
                       ok ? 4 : 0);
        }
      }
      ml_cp_async_arrive(full);
      ml_sm90_next_stage<C>(&stage, &phase);
      if (stage == 0)
        loads_done = true;
      /* the next item's claim, walk and index loads, behind this step's loads */
      if (st == kfind) {
        if (p->sched != NULL) {
          const uint32_t cpar = (uint32_t)(claims & 1);
          if (CL == 1 || rank == 0) {
            /* thread 0 claims; two slots by parity, so a slot is rewritten
             * only after every producer thread passed the barrier that
             * follows its last read */
            if (tid == 0) {
              const int v = grid + atomicAdd(p->sched, 1);
              claim[cpar] = v;
              if (CL > 1) {
                /* rank 1 has read the previous claim: its slot is free */
                ml_mbar_wait<1>(cbar + 8u, cpar ^ 1u);
                ml_st_cluster_u32(ml_mapa(ml_smem_u32(claim + 2), 1), (uint32_t)v);
                ml_mbar_arrive_remote_release(ml_mapa(cbar, 1));
              }
            }
            ml_wg_sync(1);
            w_n = claim[cpar];
          } else {
            ml_mbar_wait<1>(cbar, cpar);
            w_n = *(volatile int *)(claim + 2);
            ml_wg_sync(1);
            if (tid == 0)
              ml_mbar_arrive_remote_release(ml_mapa(cbar + 8u, 0));
          }
          ++claims;
        }
        have_n = ml_sm90_next<CL>(p, &walk, w_n, &nx, rank);
        /* with a row wait, or one for the experts' pieces (an acquire, a
         * round trip), the next item's rows after this item's last load
         * (below), not with one of its stages unissued */
        wait_n = have_n && ml_sm90_ready_waits<C, MODE>(p) && nx.expert != ready_e;
        rows_n = have_n && p->wait.signal == NULL && !wait_n;
        if (rows_n)
          valid_n = ml_sm90_rows(p, &nx, r0, src_n);
      }
    }
    if (have_n && !rows_n) {
      ml_sm90_wait_item(p, &nx, tid);
      if (wait_n) {
        ml_sm90_ready_wait<C, MODE>(p, &nx);
        if (nx.rows[0] + nx.rows[1] > 0)
          ready_e = nx.expert;
      }
      valid_n = ml_sm90_rows(p, &nx, r0, src_n);
    }
    w = w_n;
    have = have_n;
    it = nx;
    valid = valid_n;
#pragma unroll
    for (int i = 0; i < ML_SM90_ROWS; ++i) src[i] = src_n[i];
  }
  /* The end: a stage whose header says so. Its full barrier completes on
   * plain arrivals (128 + thread 0's second one, as for a real stage). */
  ml_mbar_wait(ml_sm90_empty<C>(bars, stage), phase ^ 1u);
  if (tid == 0) headers[stage * ML_SM90_HEADER_INTS] = -1;
  ml_mbar_arrive(ml_sm90_full(bars, stage));
  if (tid == 0) ml_mbar_arrive(ml_sm90_full(bars, stage));
  /* this CTA's (cluster's) claims are over; the last one done zeroes the
   * counters for the next launch (every other one's claims are over too) */
  if (p->sched != NULL && tid == 0 && rank == 0) {
    __threadfence();
    if (atomicAdd(p->sched + 1, 1) == grid - 1) {
      atomicExch(p->sched, 0);
      atomicExch(p->sched + 1, 0);
      /* overlap: every CTA's waits are over, so every piece was counted */
      if (ml_sm90_ready_waits<C, MODE>(p))
        for (int e = 0; e < p->ready_words; ++e)
          p->ready[e] = 0u;
    }
  }
  /* the copies still in flight arrive on their own; wait for them anyway so
   * no thread leaves with shared-memory writes pending */
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

/* A consumer warp gives a stage back: to its own CTA's producer, and with
 * CL = 2 to the other CTA's, whose multicast also fills this stage. */
template <class C, int CL>
static __device__ __forceinline__ void ml_sm90_release(uint32_t bars, int s) {
  if ((threadIdx.x & 31) == 0) {
    ml_mbar_arrive(ml_sm90_empty<C>(bars, s));
    if (CL > 1)
      ml_mbar_arrive_remote(ml_mapa(ml_sm90_empty<C>(bars, s), ml_cluster_rank() ^ 1u));
  }
}

/* Row scales of the thread's rows rl and rl + 8 (scaled epilogue): index
 * loads first, the scales themselves a step later, so neither waits on the
 * other. */
static __device__ __forceinline__ void ml_sm90_scale_index(const ml_sm90_args *p, int row0,
                                                           int rows, int rl, int32_t sx[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rl + 8 * h;
    int x = -1;
    if (p->row_scale != NULL && r < rows) {
      x = row0 + r;
      if (p->scale_index != NULL) x = __ldg(p->scale_index + x);
    }
    sx[h] = x;
  }
}

/* The row scales themselves, from the indices ml_sm90_scale_index gave. */
static __device__ __forceinline__ void ml_sm90_scale_load(const ml_sm90_args *p,
                                                          const int32_t sx[2], float sc[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    sc[h] = sx[h] >= 0 ? __ldg(p->row_scale + sx[h]) : 1.0f;
}

/* v[i] for a runtime i < 4 without indexing registers. */
static __device__ __forceinline__ uint32_t ml_sm90_sel4(const uint32_t v[4], int i) {
  return i == 0 ? v[0] : i == 1 ? v[1] : i == 2 ? v[2] : v[3];
}

/* The scaled epilogue into rows named by p->out_rows (ml_sm90_args). Such
 * rows may live in another GPU's memory, where 4-byte stores waste most of
 * each write, so the four lanes of a quad (one row, 8 columns of each n8
 * block, two a lane) trade values: for every four n8 blocks lane q gathers
 * block q's 8 columns and stores them as 16 bytes, 64 contiguous bytes a
 * quad. Every lane of the warp runs the shuffles; only stores are skipped. */
template <class C, int DT>
static __device__ __forceinline__ void ml_sm90_store_rows(const ml_sm90_args *p, const float *d,
                                                          int nb, int row0, int rows, int rl,
                                                          int cq, const float sc[2]) {
  const int q = cq >> 1, quad = ((int)threadIdx.x & 31) & ~3;
  static_assert(C::BN % 32 == 0, "four n8 blocks at a time");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rl + 8 * h;
    char *orow = NULL;
    if (r < rows) {
      const int pr = row0 + r;
      orow = (char *)p->out_rows[p->scale_index != NULL ? __ldg(p->scale_index + pr) : pr];
    }
    const float s = sc[h];
#pragma unroll
    for (int i = 0; i < C::BN / 32; ++i) {
      uint32_t v[4], got[4], w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = 4 * i + u;
        v[u] = ml_pack2<DT>(d[4 * j + 2 * h] * s, d[4 * j + 2 * h + 1] * s);
      }
      /* round t: lane q sends its pair of block (q + t) & 3 and receives
       * lane (q - t) & 3's pair of block q */
#pragma unroll
      for (int t = 0; t < 4; ++t)
        got[t] = __shfl_sync(0xffffffffu, ml_sm90_sel4(v, (q + t) & 3), quad | ((q - t) & 3));
#pragma unroll
      for (int m = 0; m < 4; ++m)
        w[m] = ml_sm90_sel4(got, (q - m) & 3);
      const int col = nb * C::BN + 8 * (4 * i + q);
      if (orow != NULL && col < p->n_out)
        *(uint4 *)(orow + (size_t)col * 2) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

/* Stores the consumer's accumulators (C::BN / 2 of them a thread): rows rl
 * and rl + 8 of its tile. SwiGLU pairs accumulator column c (gate) with
 * c + BN / 2 (up). OUT_F32: fp32 output instead of DT. */
template <class C, int DT, int MODE, int OUT_F32>
static __device__ __forceinline__ void ml_sm90_store(const ml_sm90_args *p, const float *d,
                                                     int nb, int row0, int rows, int rl, int cq,
                                                     const float sc[2]) {
  if (ML_SM90_PROBE & 8) return;
  const size_t es = OUT_F32 ? 4 : 2;
  if (MODE == ML_SM90_SWIGLU) {
    constexpr int HALF = C::BN / 16; /* n8 blocks of gate columns */
    const int cb = nb * (C::BN / 2) + cq;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      if (r >= rows) continue;
      char *orow = (char *)p->out + (size_t)(row0 + r) * (size_t)p->n_out * es;
#pragma unroll
      for (int j = 0; j < HALF; ++j) {
        const int col = cb + 8 * j;
        if (col >= p->n_out) continue;
        const float g0 = d[4 * j + 2 * h], g1 = d[4 * j + 2 * h + 1];
        const float u0 = d[4 * (j + HALF) + 2 * h], u1 = d[4 * (j + HALF) + 2 * h + 1];
        const float v0 = ml_sm90_silu_mul(g0, u0), v1 = ml_sm90_silu_mul(g1, u1);
        if (OUT_F32)
          ((float2 *)orow)[col >> 1] = make_float2(v0, v1);
        else
          ((uint32_t *)orow)[col >> 1] = ml_pack2<DT>(v0, v1);
      }
    }
  } else if (!OUT_F32 && p->out_rows != NULL) {
    ml_sm90_store_rows<C, DT>(p, d, nb, row0, rows, rl, cq, sc);
  } else {
    const int cb = nb * C::BN + cq;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rl + 8 * h;
      if (r >= rows) continue;
      const float s = sc[h];
      char *orow = (char *)p->out + (size_t)(row0 + r) * (size_t)p->n_out * es;
#pragma unroll
      for (int j = 0; j < C::BN / 8; ++j) {
        const int col = cb + 8 * j;
        if (col >= p->n_out) continue;
        const float v0 = d[4 * j + 2 * h] * s, v1 = d[4 * j + 2 * h + 1] * s;
        if (OUT_F32)
          ((float2 *)orow)[col >> 1] = make_float2(v0, v1);
        else
          ((uint32_t *)orow)[col >> 1] = ml_pack2<DT>(v0, v1);
      }
    }
  }
}

/* The epilogue of a full 64-row tile (p->tma_out) through shared memory:
 * the consumer writes its output, rounded to DT, into its 16 KiB buffer
 * (64 rows x 128 columns as two 64 x 64 boxes in the 128-byte swizzle:
 * chunk c of row r at c ^ (r & 7), so a warp's 32 lanes hit 32 banks), and
 * its thread 0 sends each box out with one TMA store, which runs on while
 * the consumer goes on to its next item's wgmma. The scaled epilogue's 256
 * columns take two passes. Before a pass rewrites the buffer, the stores of
 * the one before (this item's or the previous item's) must have read it;
 * the kernel waits for them all before it ends. Columns past n_out are
 * clipped by the map. */
template <class C, int DT, int MODE>
static __device__ __forceinline__ void
ml_sm90_store_tma(const ml_sm90_args *p, const CUtensorMap *map, const float *d, int nb, int row0,
                  int rl, int cq, const float sc[2], uint32_t buf, int cw) {
  static_assert(C::BN == 256, "the TMA-store epilogue is written for tiles of 256 B rows");
  if (ML_SM90_PROBE & 8)
    return;
  const int t = (int)threadIdx.x & 127;
  constexpr int PASSES = MODE == ML_SM90_SWIGLU ? 1 : 2;
  constexpr int HALF = C::BN / 16; /* SwiGLU: n8 blocks of gate columns */
  const int col0 = MODE == ML_SM90_SWIGLU ? nb * (C::BN / 2) : nb * C::BN;
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    if (t == 0)
      ml_bulk_wait_read();
    ml_wg_sync(2 + cw);
    /* row rl's line, and rl + 8's 1024 bytes on; (rl + 8) & 7 == rl & 7 */
    const uint32_t rb = buf + (uint32_t)(rl * 128 + 2 * cq), x = (uint32_t)(rl & 7);
#pragma unroll
    for (int jb = 0; jb < 16; ++jb) {
      const uint32_t at = rb + (uint32_t)((jb >> 3) * 8192) + ((((uint32_t)jb & 7u) ^ x) << 4);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v0, v1;
        if (MODE == ML_SM90_SWIGLU) {
          v0 = ml_sm90_silu_mul(d[4 * jb + 2 * h], d[4 * (jb + HALF) + 2 * h]);
          v1 = ml_sm90_silu_mul(d[4 * jb + 2 * h + 1], d[4 * (jb + HALF) + 2 * h + 1]);
        } else {
          const int j = pass * 16 + jb;
          v0 = d[4 * j + 2 * h] * sc[h];
          v1 = d[4 * j + 2 * h + 1] * sc[h];
        }
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at + (uint32_t)(h * 1024)),
                     "r"(ml_pack2<DT>(v0, v1))
                     : "memory");
      }
    }
    /* the generic-proxy writes, visible to the TMA unit (async proxy) */
    ml_fence_proxy_async();
    ml_wg_sync(2 + cw);
    if (t == 0) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int c = col0 + pass * 128 + b * 64;
        if (c < p->n_out)
          ml_tma_store_2d(map, buf + (uint32_t)(b * 8192), c, row0);
      }
      ml_bulk_commit();
    }
  }
}

/* Whether the launch sends full 64-row tiles out by TMA stores: the
 * configuration has their buffers, the output is 16-bit and the launch has a
 * map for it (p->tma_out). */
template <class C, int OUT_F32>
static __device__ __forceinline__ bool ml_sm90_tma_stores(const ml_sm90_args *p) {
  return C::OUT_BYTES > 0 && !OUT_F32 && p->tma_out;
}

/* A consumer's output of an item: full 64-row tiles through the TMA-store
 * epilogue where the launch has it (ml_sm90_tma_stores), everything else by
 * the threads' stores. */
template <class C, int DT, int MODE, int OUT_F32>
static __device__ __forceinline__ void
ml_sm90_store_out(const ml_sm90_args *p, const CUtensorMap *map_o, const float *d, int nb, int row0,
                  int rows, int rl, int cq, const float sc[2], uint32_t obuf, int cw) {
  if constexpr (C::OUT_BYTES > 0 && !OUT_F32) {
    if (ml_sm90_tma_stores<C, OUT_F32>(p) && rows == 64) {
      ml_sm90_store_tma<C, DT, MODE>(p, map_o, d, nb, row0, rl, cq, sc,
                                     obuf + (uint32_t)(cw * (C::OUT_BYTES / 2)), cw);
      return;
    }
  }
  ml_sm90_store<C, DT, MODE, OUT_F32>(p, d, nb, row0, rows, rl, cq, sc);
}

/* A consumer's end: its TMA stores complete before the kernel ends. */
template <class C, int OUT_F32>
static __device__ __forceinline__ void ml_sm90_store_done(const ml_sm90_args *p) {
  if (ml_sm90_tma_stores<C, OUT_F32>(p) && ((int)threadIdx.x & 127) == 0)
    ml_bulk_wait_all();
}

/* Overlap, the gate/up GEMM's side: the consumer's last stored tile (expert
 * *pend, -1: none) is counted in ready[*pend]. Called one item later (or at
 * the end), so that a tile's TMA stores, long complete by then, cost no
 * wait: the warpgroup meets (every thread's own stores of the tile are
 * before the barrier), then its thread 0 waits for its bulk stores, orders
 * them (async proxy) before the generic release, and adds 1 with release
 * semantics. Every thread of the warpgroup calls it with the same *pend. */
template <class C, int OUT_F32>
static __device__ __forceinline__ void ml_sm90_ready_flush(const ml_sm90_args *p, int *pend,
                                                           int cw) {
  if (*pend < 0)
    return;
  ml_wg_sync(2 + cw);
  if (((int)threadIdx.x & 127) == 0) {
    if (ml_sm90_tma_stores<C, OUT_F32>(p)) {
      ml_bulk_wait_all();
      asm volatile("fence.proxy.async.global;\n" ::: "memory");
    }
    ml_red_add_release_gpu(p->ready + *pend, 1u);
  }
  *pend = -1;
}

/* The bf16/f16 consumer (see the top of the file). */
template <int DT, int MODE, int OUT_F32, int CL>
static __device__ __forceinline__ void ml_sm90_consumer(const ml_sm90_args *p, uint32_t base,
                                                        uint32_t bars, const int *headers, int cw,
                                                        const CUtensorMap *map_o, uint32_t obuf) {
  typedef ml_sm90_cfg<0> C;
  const int t = (int)threadIdx.x & 127;
  const int warp = t >> 5, lane = t & 31;
  const int rl = warp * 16 + (lane >> 2), cq = 2 * (lane & 3);
  const int ktiles = (p->k + ML_SM90_BK - 1) / ML_SM90_BK / p->ksplit; /* an item's */
  int stage = 0;
  uint32_t phase = 0;
  float d[128];
  /* overlap: the tile stored last, not yet counted (ml_sm90_ready_flush) */
  const bool signals = ml_sm90_ready_counts<C, MODE>(p);
  int pend = -1;
  for (;;) {
    ml_mbar_wait(ml_sm90_full(bars, stage), phase);
    const int *hd = headers + stage * ML_SM90_HEADER_INTS;
    const int nb = hd[0];
    if (nb < 0) break;
    const int row0 = hd[1 + cw], rows = hd[3 + cw], expert = hd[6];
    /* k slice s of a dense problem: its partial sums s * dense_rows rows on
     * (read now: the stage and its header are refilled once released) */
    const int orow0 = row0 + hd[5] * p->dense_rows;
    /* uniform over the warpgroup (probe bit 16: partial tiles skipped) */
    const int active = rows > 0 && !((ML_SM90_PROBE & 16) && rows < 64);
    int32_t sx[2];
    float sc[2] = {1.0f, 1.0f};
    if (MODE == ML_SM90_SCALED) ml_sm90_scale_index(p, row0, rows, rl, sx);
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    int prev = 0;
    for (int kt = 0; kt < ktiles; ++kt) {
      if (kt > 0) ml_mbar_wait(ml_sm90_full(bars, stage), phase);
      if (active) {
        const uint32_t a_s = base + (uint32_t)(stage * ML_SM90_STAGE_BYTES);
        const uint64_t da = ml_wgmma_desc(a_s + (uint32_t)(cw * 64 * 128));
        const uint64_t db = ml_wgmma_desc(a_s + ML_SM90_A_BYTES);
        /* A came through cp.async (generic proxy); wgmma reads through the
         * async proxy */
        ml_fence_proxy_async();
        ml_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < ML_SM90_BK / 16; ++kk)
          /* 16 k = 32 bytes further along the rows: +2 in the address field */
          ml_wgmma_256<DT>(d, da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk));
        ml_wgmma_commit();
        /* the previous step's wgmma are done: its stage can be refilled */
        ml_wgmma_wait<1>();
        ml_acc_fence<128>(d);
        if (kt > 0)
          ml_sm90_release<C, CL>(bars, prev);
      } else {
        ml_sm90_release<C, CL>(bars, stage);
      }
      prev = stage;
      ml_sm90_next_stage<C>(&stage, &phase);
      /* the scales, once their indices have had a step to arrive */
      if (MODE == ML_SM90_SCALED && kt == (ktiles > 1 ? 1 : 0))
        ml_sm90_scale_load(p, sx, sc);
    }
    ml_wgmma_wait<0>();
    ml_acc_fence<128>(d);
    if (active)
      ml_sm90_release<C, CL>(bars, prev);
    /* (after the release: the ring does not wait for the count's fence) */
    if (signals)
      ml_sm90_ready_flush<C, OUT_F32>(p, &pend, cw);
    if (!active)
      continue;
    ml_sm90_store_out<C, DT, MODE, OUT_F32>(p, map_o, d, nb, orow0, rows, rl, cq, sc, obuf, cw);
    if (signals)
      pend = expert;
  }
  if (signals)
    ml_sm90_ready_flush<C, OUT_F32>(p, &pend, cw);
  ml_sm90_store_done<C, OUT_F32>(p);
}

/* The FP8 consumer's steps of a k block. Issue: wgmma of its stage's A
 * rows and the half-th 128 B rows (ml_sm90_cfg<3> has two halves, the
 * others one) into blk, committed as one group (the stage's full barrier
 * already waited on). */
template <class C>
static __device__ __forceinline__ void ml_sm90_fp8_issue(float *blk, uint32_t base, int stage,
                                                         int cw, int half) {
  uint32_t a_s = base + (uint32_t)(stage * C::STAGE_BYTES);
  /* the stage address from lane 0: warp-uniform to ptxas, which then builds
   * the descriptors in uniform registers (fewer instructions a block) */
  a_s = __shfl_sync(0xffffffffu, a_s, 0);
  const uint64_t da = ml_wgmma_desc(a_s + (uint32_t)(cw * 64 * 128));
  const uint64_t db = ml_wgmma_desc(a_s + (uint32_t)(C::A_BYTES + half * 128 * 128));
  /* A came through cp.async (generic proxy); wgmma reads through the async
   * proxy */
  if (!(ML_SM90_PROBE & 4))
    ml_fence_proxy_async();
  ml_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < C::BK / 32; ++kk)
    /* 32 k = 32 bytes further along the rows: +2 in the address field */
    ml_wgmma_128_e4m3(blk, da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk), kk);
  ml_wgmma_commit();
}

/* Waits for the next stage to fill (unless the caller has), issues its
 * first half's wgmma into blk and moves the ring on; returns the stage. */
template <class C>
static __device__ __forceinline__ int ml_sm90_fp8_take(float *blk, uint32_t base, uint32_t bars,
                                                       int *stage, uint32_t *phase, int cw,
                                                       int wait) {
  const int s = *stage;
  if (wait)
    ml_mbar_wait(ml_sm90_full(bars, s), *phase);
  ml_sm90_fp8_issue<C>(blk, base, s, cw, 0);
  ml_sm90_next_stage<C>(stage, phase);
  return s;
}

/* The k block's scales (the producer copied them with the stage): as[h] the
 * A scale of row rl + 8 h (from the slot of the block's scale group, see
 * ml_sm90_cfg<1>), bs[i] the stage's two B scales. Steps the group slot:
 * once a block. */
template <class C>
static __device__ __forceinline__ void ml_sm90_fp8_scales(float as[2], float bs[2], uint32_t scales,
                                                          int stage, int cw, int rl, int kt, int g,
                                                          int *gslot) {
  const int j = ml_sm90_scale_group<C>(kt, g, gslot);
  const uint32_t a0 = scales + (uint32_t)(*gslot * C::SCALE_BYTES) +
                      (uint32_t)((cw * 64 + rl) * C::A_SCALE_ROW + 4 * j);
  const uint32_t b0 =
      scales + (uint32_t)(stage * C::SCALE_BYTES) + (uint32_t)(ML_SM90_BM * C::A_SCALE_ROW);
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(as[0]) : "r"(a0) : "memory");
  asm volatile("ld.shared.f32 %0, [%1];\n"
               : "=f"(as[1])
               : "r"(a0 + (uint32_t)(8 * C::A_SCALE_ROW))
               : "memory");
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(bs[0]) : "r"(b0) : "memory");
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(bs[1]) : "r"(b0 + 4u) : "memory");
}

/* Finish: once the wgmma in flight (blk's) are done, give the stage back
 * (unless more of its wgmma are to come: release 0) and add blk x A scale
 * of the row x B scale of the column to the 64 totals d. bsel: the B scale
 * of every column (0 or 1), or -1 for ml_sm90_cfg<1>'s tile, whose columns
 * c < 64 (i < 32) take bs[0], the others bs[1]. */
template <class C, int CL>
static __device__ __forceinline__ void ml_sm90_fp8_finish(float *d, float *blk, const float as[2],
                                                          const float bs[2], int bsel,
                                                          uint32_t bars, int stage, int release) {
  ml_wgmma_wait<0>();
  ml_acc_fence<64>(blk);
  if (release)
    ml_sm90_release<C, CL>(bars, stage);
  if (ML_SM90_PROBE & 2)
    return;
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    /* d[i]: row rl + 8 ((i / 2) % 2), column 8 (i / 4) + ... */
    const float f = as[(i >> 1) & 1] * bs[bsel >= 0 ? bsel : i < 32 ? 0 : 1];
    d[i] = fmaf(blk[i], f, d[i]);
  }
}

/* SwiGLU of 64 of the consumer's output columns (ml_sm90_store's values):
 * v[16 h + 2 j + e] is row rl + 8 h, output column 8 (J0 + j) + cq + e of
 * the tile, its gate accumulators d[4 (J0 + j) + ...] and up accumulators
 * UP n8 blocks further (ml_sm90_cfg<1>: J0 0, UP 8; the wide tile: J0 0 or
 * 8, UP 16). */
template <int J0, int UP>
static __device__ __forceinline__ void ml_sm90_swiglu32(const float *d, float *v) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float g = d[4 * (J0 + j) + 2 * h + e], u = d[4 * (J0 + j + UP) + 2 * h + e];
        v[16 * h + 2 * j + e] = ml_sm90_silu_mul(g, u);
      }
}

/* ml_sm90_cfg<2>'s and <4>'s epilogue: the SwiGLU values of an item's 128
 * output columns (cfg<2>: v0 its first sub-item's, from the stash, v1 the
 * second's; cfg<4>: columns 0-63, 64-127) quantized per row,
 * as moelink_quantize's FP8 does it (quant.cuh): the row's largest |value|
 * over the four threads that hold it, its scale, the e4m3 bytes. */
static __device__ __forceinline__ void ml_sm90_store_q(const ml_sm90_args *p, const float *v0,
                                                       const float *v1, int nb, int row0, int rows,
                                                       int rl, int cq) {
  if (ML_SM90_PROBE & 8) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      a = fmaxf(a, fmaxf(fabsf(v0[16 * h + i]), fabsf(v1[16 * h + i])));
    /* the quad of lanes holding the row (all lanes take part) */
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
    const float sc = ml_fp8_block_scale(a);
    const ml_q_div_t dv = ml_q_div_of(sc);
    const int r = rl + 8 * h;
    if (r >= rows)
      continue;
    const size_t row = (size_t)(row0 + r);
    uint8_t *q = (uint8_t *)p->out + row * (size_t)p->n_out + (size_t)nb * 128 + (size_t)cq;
    /* the scaled values first (the row's two halves of its block) */
    float x[32], z[32];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      x[i] = v0[16 * h + i];
      x[16 + i] = v1[16 * h + i];
    }
    ml_q_fp8_scale_n<32>(x, z, dv);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      *(uint16_t *)(q + 8 * j) = (uint16_t)ml_q_cvt2(z[2 * j], z[2 * j + 1]);
      *(uint16_t *)(q + 64 + 8 * j) = (uint16_t)ml_q_cvt2(z[16 + 2 * j], z[16 + 2 * j + 1]);
    }
    if (cq == 0)
      p->out_scale[row * (size_t)(p->n_out / 128) + (size_t)nb] = sc;
  }
}

/* The FP8 consumer: each k block's sum in the block accumulator blk, scaled
 * into the total d (the per-block promotion that keeps the sum's precision
 * out of the tensor cores' accumulation). C::SUBS = 2: an
 * item is two sub-items, the first one's SwiGLU values kept in the stash
 * (value i of consumer thread t at stash + 4 (256 i + t): no bank
 * conflicts) until the second's are quantized with them. */
template <class C, int DT, int MODE, int OUT_F32, int CL>
static __device__ __forceinline__ void
ml_sm90_consumer_fp8(const ml_sm90_args *p, uint32_t base, uint32_t scales, uint32_t bars,
                     const int *headers, uint32_t stash, int cw, const CUtensorMap *map_o,
                     uint32_t obuf) {
  const int t = (int)threadIdx.x & 127;
  const int warp = t >> 5, lane = t & 31;
  const int rl = warp * 16 + (lane >> 2), cq = 2 * (lane & 3);
  const int ktiles = (p->k + C::BK - 1) / C::BK;
  const uint32_t my_stash = stash + (uint32_t)((cw * 128 + t) * 4);
  const int g = p->as_group;
  int stage = 0;
  uint32_t phase = 0;
  constexpr int NH = C::BN / 128; /* 128-column halves of the tile */
  float d[64 * NH], blk[64];
  int gslot = -1; /* the A-scale slot of the current scale group (ml_sm90_fp8_scales) */
  for (;;) {
    ml_mbar_wait(ml_sm90_full(bars, stage), phase);
    const int *hd = headers + stage * ML_SM90_HEADER_INTS;
    const int nb = hd[0];
    if (nb < 0) break;
    const int row0 = hd[1 + cw], rows = hd[3 + cw];
    int32_t sx[2];
    float sc[2] = {1.0f, 1.0f};
    if (MODE == ML_SM90_SCALED) ml_sm90_scale_index(p, row0, rows, rl, sx);
    if (rows <= 0) {
      /* not this consumer's tile (uniform over the warpgroup): give the
       * item's stages back as they fill */
      for (int st = 0; st < ktiles * C::SUBS; ++st) {
        if (st > 0)
          ml_mbar_wait(ml_sm90_full(bars, stage), phase);
        ml_sm90_release<C, CL>(bars, stage);
        ml_sm90_next_stage<C>(&stage, &phase);
        /* the scale groups go on (the producer counts them the same way) */
        ml_sm90_scale_group<C>(st % ktiles, g, &gslot);
      }
      continue;
    }
    for (int sub = 0; sub < C::SUBS; ++sub) {
#pragma unroll
      for (int i = 0; i < 64 * NH; ++i)
        d[i] = 0.0f;
      /* per k block: the stage's wgmma of each 128-column half (one, or
       * two for the wide tile) into blk, then its promotion into d, the
       * stage given back after the last half's wgmma; the other consumer
       * warpgroup's wgmma keep the tensor cores busy while this one
       * promotes. (A second block accumulator, to issue the next wgmma
       * before the promotion, measured no faster: ptxas gives both the same
       * registers once their lives do not overlap.) The item's first
       * stage's full barrier was waited on for the header. */
      int s = ml_sm90_fp8_take<C>(blk, base, bars, &stage, &phase, cw, sub > 0);
      for (int kt = 0;; ++kt) {
        float as[2], bs[2];
        ml_sm90_fp8_scales<C>(as, bs, scales, s, cw, rl, kt, g, &gslot);
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          if (h > 0)
            ml_sm90_fp8_issue<C>(blk, base, s, cw, h);
          ml_sm90_fp8_finish<C, CL>(d + 64 * h, blk, as, bs, NH == 1 ? -1 : h, bars, s,
                                    h == NH - 1);
        }
        /* the row scales, once their indices have had a step to arrive */
        if (MODE == ML_SM90_SCALED && kt == 0)
          ml_sm90_scale_load(p, sx, sc);
        if (kt + 1 >= ktiles)
          break;
        s = ml_sm90_fp8_take<C>(blk, base, bars, &stage, &phase, cw, 1);
      }
      if constexpr (C::SUBS > 1) {
        float v[32];
        ml_sm90_swiglu32<0, 8>(d, v);
        if (sub == 0) {
#pragma unroll
          for (int i = 0; i < 32; ++i)
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(my_stash + (uint32_t)(i * 1024)),
                         "f"(v[i])
                         : "memory");
        } else {
          float v0[32];
#pragma unroll
          for (int i = 0; i < 32; ++i)
            asm volatile("ld.shared.f32 %0, [%1];\n"
                         : "=f"(v0[i])
                         : "r"(my_stash + (uint32_t)(i * 1024))
                         : "memory");
          ml_sm90_store_q(p, v0, v, nb, row0, rows, rl, cq);
        }
      }
    }
    if constexpr (C::SUBS == 1 && C::QOUT) {
      /* the wide tile's 128 output columns, quantized */
      float v0[32], v1[32];
      ml_sm90_swiglu32<0, 16>(d, v0);
      ml_sm90_swiglu32<8, 16>(d, v1);
      ml_sm90_store_q(p, v0, v1, nb, row0, rows, rl, cq);
    } else if constexpr (C::SUBS == 1) {
      ml_sm90_store_out<C, DT, MODE, OUT_F32>(p, map_o, d, nb, row0, rows, rl, cq, sc, obuf, cw);
    }
  }
  ml_sm90_store_done<C, OUT_F32>(p);
}

#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

/* The kernel. Built for sm_90a only: in any other device pass (the compute_90
 * PTX fallback) its body is empty and the host never launches it there.
 * FP8 = 1: e4m3 operands (ml_sm90_cfg<1>), DT the output's dtype; FP8 = 2
 * (SwiGLU only) the same with e4m3 output rows and scales (ml_sm90_cfg<2>);
 * FP8 = 3 the wide e4m3 tile (ml_sm90_cfg<3>, one CTA), FP8 = 4 the same
 * with e4m3 output (ml_sm90_cfg<4>), FP8 = 5 the wide tile's scaled GEMM
 * with TMA stores (ml_sm90_cfg<5>). */
template <int DT, int MODE, int OUT_F32, int FP8 = 0, int CL = 1>
static __global__ void __launch_bounds__(ML_SM90_THREADS, 1)
    ml_sm90_kernel(const __grid_constant__ CUtensorMap map_b,
                   const __grid_constant__ CUtensorMap map_o,
                   const __grid_constant__ ml_sm90_args p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  typedef ml_sm90_cfg<FP8> C;
  static_assert(CL == 1 || (CL == 2 && FP8 <= 1),
                "clusters of two: not with the quantizing epilogue (its sub-items) nor the "
                "wide FP8 tile");
  extern __shared__ __align__(1024) char ml_sm90_smem[];
  const uint32_t raw = ml_smem_u32(ml_sm90_smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  /* the TMA-store epilogue's buffers (bf16/f16 kernel), 1024-byte aligned */
  const uint32_t obuf = base + (uint32_t)(C::STAGES * C::STAGE_BYTES);
  const uint32_t scales = obuf + (uint32_t)C::OUT_BYTES;
  const uint32_t bars = scales + (uint32_t)(C::STAGES * C::SCALE_BYTES);
  int *headers = (int *)(ml_sm90_smem + (bars - raw) + 2 * C::STAGES * 8);
  /* ml_sm90_cfg<2>: the consumers' stash, after the headers */
  const uint32_t stash = bars + (uint32_t)(2 * C::STAGES * 8 + C::STAGES * ML_SM90_HEADER_INTS * 4);
  /* the dynamic schedule's claims: [0], [1] by parity, [2] rank 1's slot;
   * the claim hand-over's barriers (CL = 2) */
  __shared__ int claim[3];
  __shared__ __align__(8) uint64_t cbar_mem[2];
  const uint32_t cbar = ml_smem_u32(cbar_mem);
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      ml_mbar_init(ml_sm90_full(bars, s), ML_SM90_FULL_COUNT);
      ml_mbar_init(ml_sm90_empty<C>(bars, s), ML_SM90_EMPTY_COUNT * CL);
    }
    if (CL > 1) {
      ml_mbar_init(cbar, 1);
      ml_mbar_init(cbar + 8u, 1);
    }
    /* barrier initialization visible to the async proxy (TMA completes on it)
     * and to the cluster */
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_b) : "memory");
    if (p.tma_out)
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_o) : "memory");
  }
  if (CL > 1)
    ml_cluster_sync(); /* the other CTA's barriers exist before anyone uses them */
  else
    __syncthreads();
  /* overlap: the down GEMM after this one may launch now; its CTAs take the
   * SMs this grid's CTAs leave and wait for their experts' pieces */
  if (ml_sm90_ready_counts<C, MODE>(&p))
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int wg = (int)threadIdx.x >> 7;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::PRODUCER_REGS) : "memory");
    ml_sm90_producer<C, MODE, CL>(&p, &map_b, base, scales, bars, headers, claim, cbar);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::CONSUMER_REGS) : "memory");
    if constexpr (FP8)
      ml_sm90_consumer_fp8<C, DT, MODE, OUT_F32, CL>(&p, base, scales, bars, headers, stash, wg - 1,
                                                     &map_o, obuf);
    else
      ml_sm90_consumer<DT, MODE, OUT_F32, CL>(&p, base, bars, headers, wg - 1, &map_o, obuf);
  }
  /* no CTA leaves while the other may still arrive on its barriers */
  if (CL > 1)
    ml_cluster_sync();
  /* overlap, the down GEMM: it ends only after the gate/up GEMM has (which
   * it may outlive otherwise: it only waited for the pieces), so that what
   * follows it in the stream follows both */
  if (ml_sm90_ready_waits<C, MODE>(&p))
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#endif
