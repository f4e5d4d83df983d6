/* The vendor GEMM of the CUDA tensor-parallel ops: out [rows, n] = a [rows, k]
 * b [n, k]^T (row-major, bf16 or f16 in and out, fp32 accumulate) through
 * cuBLASLt (algorithm from its heuristic, chosen once per shape and kept) or
 * through cublasGemmEx. One object per tp; not thread-safe (a tp's calls come
 * from one thread). Every call is stream-ordered and graph-capturable: the
 * workspace is fixed at creation, and a shape's first call only asks the
 * heuristic (host work, no device synchronization). Host code: C11. */
#ifndef MOELINK_TP_BLAS_H
#define MOELINK_TP_BLAS_H

#include "moelink.h"

#include <cuda_runtime_api.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ml_tpc_blas ml_tpc_blas;

/* Which library call runs a GEMM. */
typedef enum {
  ML_TPC_BLAS_LT = 0,   /* cuBLASLt, heuristic algorithm number `lt_algo` (0: its first) */
  ML_TPC_BLAS_GEMMEX = 1 /* cublasGemmEx, CUBLAS_GEMM_DEFAULT */
} ml_tpc_blas_kind;

/* ws_bytes of device workspace shared by both calls. */
moelink_status_t ml_tpc_blas_create(ml_tpc_blas **out, size_t ws_bytes, ml_tpc_blas_kind kind,
                                    int lt_algo);
void ml_tpc_blas_destroy(ml_tpc_blas *b);

/* Pointers 16-byte aligned, n and k multiples of 8 (the caller's fallback
 * takes the rest). */
moelink_status_t ml_tpc_blas_gemm(ml_tpc_blas *b, moelink_dtype_t dt, const void *a,
                                  const void *w, void *out, int rows, int n, int k,
                                  cudaStream_t st);

#ifdef __cplusplus
}
#endif

#endif
