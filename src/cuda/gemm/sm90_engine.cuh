/* Which engine runs the grouped GEMMs of cuda.h (ml_cuda_gemm_swiglu,
 * ml_cuda_gemm_scaled): the sm_90a wgmma kernel (sm90.cuh) or the portable
 * mma.sync tile engine (tile.cuh). Plain C declarations, so that C tests can
 * pin one engine and check which one ran.
 *
 * Left alone, the launchers take the sm_90a kernel on a compute capability
 * 9.0 device when the shape suits it (see experts.cu) and
 * MOELINK_GEMM_SM90 is not 0; the tile engine otherwise. */
#ifndef MOELINK_CUDA_GEMM_SM90_ENGINE_CUH
#define MOELINK_CUDA_GEMM_SM90_ENGINE_CUH

#ifdef __cplusplus
extern "C" {
#endif

enum { ML_GEMM_ENGINE_AUTO = -1, ML_GEMM_ENGINE_TILE = 0, ML_GEMM_ENGINE_SM90 = 1 };

/* Process-wide choice for the launches that follow: AUTO (the default:
 * MOELINK_GEMM_SM90 decides), TILE (always the tile engine) or SM90 (the
 * sm_90a kernel whenever the device and shape allow it). */
void ml_cuda_gemm_set_engine(int engine);

/* Engine of the calling thread's last launch that did work (TILE or SM90),
 * or AUTO if it has launched none. */
int ml_cuda_gemm_last_engine(void);

/* Columns of the tile (B rows a work item reads: 256 or 128) of the calling
 * thread's last sm_90a launch, 0 if it has launched none: which FP8 tile ran
 * (ml_cuda_gemm_opts.fp8_tile). */
int ml_cuda_gemm_last_sm90_tile(void);

/* CTAs of the calling thread's last sm_90a launch (clusters: both CTAs of
 * each), 0 if it has launched none: what ml_cuda_gemm_opts.max_ctas left. */
int ml_cuda_gemm_last_sm90_grid(void);

/* Process-wide choice of the sm_90a kernel's output path for the launches
 * that follow: -1 (the default: MOELINK_GEMM_SM90_TMA_STORE decides), 0
 * (every row by the consumer threads' stores) or 1 (full tiles through
 * shared memory and TMA stores), so that a test can compare the two. */
void ml_cuda_gemm_set_tma_store(int on);

/* Whether the calling thread's last sm_90a launch sent its full tiles out
 * with TMA stores (0 if it has launched none). */
int ml_cuda_gemm_last_tma_store(void);

#ifdef __cplusplus
}
#endif

#endif
