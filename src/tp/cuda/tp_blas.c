/* The vendor GEMM of the CUDA tensor-parallel ops (tp_blas.h). */
#include "tp/cuda/tp_blas.h"

#include "core/core.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Shapes whose cuBLASLt layouts and algorithm are kept; past that the oldest
 * entry is replaced (a tp usually sees a handful of shapes). */
#define ML_TPB_CACHE 32
/* Heuristic results asked for (lt_algo picks among them). */
#define ML_TPB_ALGOS 8

typedef struct ml_tpb_entry {
  int used;
  moelink_dtype_t dt;
  int rows, n, k;
  cublasLtMatrixLayout_t la, lb, lc; /* weight (k x n), activations (k x rows), out (n x rows) */
  cublasLtMatmulAlgo_t algo;
} ml_tpb_entry;

struct ml_tpc_blas {
  ml_tpc_blas_kind kind;
  int lt_algo;
  void *ws;
  size_t ws_bytes;
  cublasHandle_t blas;
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t desc;
  cublasLtMatmulPreference_t pref;
  ml_tpb_entry cache[ML_TPB_CACHE];
  int next; /* the entry replaced next when the cache is full */
};

static moelink_status_t ml_tpb_fail(const char *what, cublasStatus_t s) {
  return ml_fail(MOELINK_ERR_CUDA, "tp: %s failed (cuBLAS status %d)", what, (int)s);
}

#define ML_TPB_TRY(what, call)                    \
  do {                                            \
    cublasStatus_t ml_tpb_s_ = (call);            \
    if (ml_tpb_s_ != CUBLAS_STATUS_SUCCESS)       \
      return ml_tpb_fail(what, ml_tpb_s_);        \
  } while (0)

static void ml_tpb_entry_clear(ml_tpb_entry *e) {
  if (e->la) cublasLtMatrixLayoutDestroy(e->la);
  if (e->lb) cublasLtMatrixLayoutDestroy(e->lb);
  if (e->lc) cublasLtMatrixLayoutDestroy(e->lc);
  memset(e, 0, sizeof *e);
}

void ml_tpc_blas_destroy(ml_tpc_blas *b) {
  if (!b) return;
  for (int i = 0; i < ML_TPB_CACHE; ++i) ml_tpb_entry_clear(&b->cache[i]);
  if (b->pref) cublasLtMatmulPreferenceDestroy(b->pref);
  if (b->desc) cublasLtMatmulDescDestroy(b->desc);
  if (b->lt) cublasLtDestroy(b->lt);
  if (b->blas) cublasDestroy(b->blas);
  if (b->ws) cudaFree(b->ws);
  free(b);
}

static moelink_status_t ml_tpb_init(ml_tpc_blas *b, size_t ws_bytes) {
  cudaError_t ce = cudaMalloc(&b->ws, ws_bytes);
  if (ce != cudaSuccess) {
    b->ws = NULL;
    return ml_fail(MOELINK_ERR_CUDA, "tp: cudaMalloc of the cuBLAS workspace (%zu bytes): %s",
                   ws_bytes, cudaGetErrorString(ce));
  }
  b->ws_bytes = ws_bytes;
  /* A create that fails leaves its handle NULL here, so that destroy skips it. */
  cublasStatus_t cs = cublasCreate(&b->blas);
  if (cs != CUBLAS_STATUS_SUCCESS) {
    b->blas = NULL;
    return ml_tpb_fail("cublasCreate", cs);
  }
  ML_TPB_TRY("cublasSetWorkspace", cublasSetWorkspace(b->blas, b->ws, ws_bytes));
  cs = cublasLtCreate(&b->lt);
  if (cs != CUBLAS_STATUS_SUCCESS) {
    b->lt = NULL;
    return ml_tpb_fail("cublasLtCreate", cs);
  }
  cs = cublasLtMatmulDescCreate(&b->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (cs != CUBLAS_STATUS_SUCCESS) {
    b->desc = NULL;
    return ml_tpb_fail("cublasLtMatmulDescCreate", cs);
  }
  const cublasOperation_t opt = CUBLAS_OP_T, opn = CUBLAS_OP_N;
  ML_TPB_TRY("cublasLtMatmulDescSetAttribute",
             cublasLtMatmulDescSetAttribute(b->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opt,
                                            sizeof opt));
  ML_TPB_TRY("cublasLtMatmulDescSetAttribute",
             cublasLtMatmulDescSetAttribute(b->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opn,
                                            sizeof opn));
  cs = cublasLtMatmulPreferenceCreate(&b->pref);
  if (cs != CUBLAS_STATUS_SUCCESS) {
    b->pref = NULL;
    return ml_tpb_fail("cublasLtMatmulPreferenceCreate", cs);
  }
  const uint64_t wsb = ws_bytes;
  ML_TPB_TRY("cublasLtMatmulPreferenceSetAttribute",
             cublasLtMatmulPreferenceSetAttribute(b->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &wsb, sizeof wsb));
  /* The algorithm is kept per shape and reused for other pointers: ask for
   * one that needs no more than the 16-byte alignment every call has. */
  const uint32_t align = 16;
  const cublasLtMatmulPreferenceAttributes_t al[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    ML_TPB_TRY("cublasLtMatmulPreferenceSetAttribute",
               cublasLtMatmulPreferenceSetAttribute(b->pref, al[i], &align, sizeof align));
  return MOELINK_SUCCESS;
}

moelink_status_t ml_tpc_blas_create(ml_tpc_blas **out, size_t ws_bytes, ml_tpc_blas_kind kind,
                                    int lt_algo) {
  *out = NULL;
  ml_tpc_blas *b = (ml_tpc_blas *)calloc(1, sizeof *b);
  if (!b) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "tp: out of host memory");
  b->kind = kind;
  b->lt_algo = lt_algo < 0 ? 0 : lt_algo >= ML_TPB_ALGOS ? ML_TPB_ALGOS - 1 : lt_algo;
  moelink_status_t s = ml_tpb_init(b, ws_bytes);
  if (s != MOELINK_SUCCESS) {
    ml_tpc_blas_destroy(b);
    return s;
  }
  *out = b;
  return MOELINK_SUCCESS;
}

/* The layouts and the heuristic's algorithm for a new shape, into e. */
static moelink_status_t ml_tpb_plan(ml_tpc_blas *b, ml_tpb_entry *e, moelink_dtype_t dt,
                                    int rows, int n, int k) {
  const cudaDataType_t ty = dt == MOELINK_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
  /* Column-major view of row-major out = a w^T: out^T [n, rows] = w^T a^T,
   * w stored as [k, n] (ld k) and transposed, a as [k, rows] (ld k). */
  cublasLtMatrixLayout_t *l[3] = {&e->la, &e->lb, &e->lc};
  const int dims[3][3] = {{k, n, k}, {k, rows, k}, {n, rows, n}};
  for (int i = 0; i < 3; ++i) {
    const cublasStatus_t cs =
        cublasLtMatrixLayoutCreate(l[i], ty, (uint64_t)dims[i][0], (uint64_t)dims[i][1],
                                   (int64_t)dims[i][2]);
    if (cs != CUBLAS_STATUS_SUCCESS) {
      *l[i] = NULL;
      return ml_tpb_fail("cublasLtMatrixLayoutCreate", cs);
    }
  }
  cublasLtMatmulHeuristicResult_t res[ML_TPB_ALGOS];
  int got = 0;
  memset(res, 0, sizeof res);
  ML_TPB_TRY("cublasLtMatmulAlgoGetHeuristic",
             cublasLtMatmulAlgoGetHeuristic(b->lt, b->desc, e->la, e->lb, e->lc, e->lc, b->pref,
                                            ML_TPB_ALGOS, res, &got));
  if (got <= 0)
    return ml_fail(MOELINK_ERR_CUDA, "tp: cuBLASLt has no algorithm for %d x %d x %d", rows, n,
                   k);
  const int pick = b->lt_algo < got ? b->lt_algo : got - 1;
  e->algo = res[pick].algo;
  e->dt = dt;
  e->rows = rows;
  e->n = n;
  e->k = k;
  e->used = 1;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_tpb_find(ml_tpc_blas *b, moelink_dtype_t dt, int rows, int n, int k,
                                    ml_tpb_entry **out) {
  for (int i = 0; i < ML_TPB_CACHE; ++i) {
    ml_tpb_entry *e = &b->cache[i];
    if (e->used && e->dt == dt && e->rows == rows && e->n == n && e->k == k) {
      *out = e;
      return MOELINK_SUCCESS;
    }
  }
  ml_tpb_entry *e = &b->cache[b->next];
  b->next = (b->next + 1) % ML_TPB_CACHE;
  ml_tpb_entry_clear(e);
  moelink_status_t s = ml_tpb_plan(b, e, dt, rows, n, k);
  if (s != MOELINK_SUCCESS) {
    ml_tpb_entry_clear(e);
    return s;
  }
  *out = e;
  return MOELINK_SUCCESS;
}

moelink_status_t ml_tpc_blas_gemm(ml_tpc_blas *b, moelink_dtype_t dt, const void *a,
                                  const void *w, void *out, int rows, int n, int k,
                                  cudaStream_t st) {
  const float one = 1.f, zero = 0.f;
  if (b->kind == ML_TPC_BLAS_GEMMEX) {
    const cudaDataType_t ty = dt == MOELINK_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    ML_TPB_TRY("cublasSetStream", cublasSetStream(b->blas, st));
    cublasStatus_t s = cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &one, w, ty,
                                    k, a, ty, k, &zero, out, ty, n, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
      return ml_fail(MOELINK_ERR_CUDA, "tp: cublasGemmEx (%d x %d x %d) failed (status %d)", rows,
                     n, k, (int)s);
    return MOELINK_SUCCESS;
  }
  ml_tpb_entry *e;
  ML_TRY(ml_tpb_find(b, dt, rows, n, k, &e));
  cublasStatus_t s = cublasLtMatmul(b->lt, b->desc, &one, w, e->la, a, e->lb, &zero, out, e->lc,
                                    out, e->lc, &e->algo, b->ws, b->ws_bytes, st);
  if (s != CUBLAS_STATUS_SUCCESS)
    return ml_fail(MOELINK_ERR_CUDA, "tp: cublasLtMatmul (%d x %d x %d) failed (status %d)", rows,
                   n, k, (int)s);
  return MOELINK_SUCCESS;
}
