/* NCCL device-API objects of the CUDA communicator. NCCL's device headers are
 * C++17, so the ncclDevComm lives here and the C side holds it as a void *. */
#include "comm/cuda/comm_cuda.h"

#include <nccl_device.h>
#include <stdlib.h>
#include <string.h>

static moelink_status_t ml_ccu_nccl_fail(ncclComm_t comm, ncclResult_t r, const char *call) {
  const char *detail = comm ? ncclGetLastError(comm) : NULL;
  return ml_fail(MOELINK_ERR_NCCL, "%s failed: %s%s%s", call, ncclGetErrorString(r),
                 detail && *detail ? ": " : "", detail && *detail ? detail : "");
}

extern "C" moelink_status_t ml_ccu_devcomm_create(ncclComm_t comm, int lsa_barriers, void **out,
                                                  int *lsa_rank, int *lsa_size) {
  *out = NULL;
  ncclDevComm *dc = (ncclDevComm *)calloc(1, sizeof(ncclDevComm));
  if (!dc) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "device communicator allocation failed");
  /* NCCL 2.28 gives this struct no initializer: every field we do not set
   * must be zero (no multimem, no GIN, no extra resources). */
  ncclDevCommRequirements req;
  memset(&req, 0, sizeof req);
  req.lsaBarrierCount = lsa_barriers;
  ncclResult_t r = ncclDevCommCreate(comm, &req, dc);
  if (r != ncclSuccess) {
    free(dc);
    return ml_ccu_nccl_fail(comm, r, "ncclDevCommCreate");
  }
  *lsa_rank = dc->lsaRank;
  *lsa_size = dc->lsaSize;
  *out = dc;
  return MOELINK_SUCCESS;
}

extern "C" void ml_ccu_devcomm_destroy(ncclComm_t comm, void *devcomm) {
  if (!devcomm) return;
  (void)ncclDevCommDestroy(comm, (const ncclDevComm *)devcomm);
  free(devcomm);
}

/* The window handle is device memory, so its peers' addresses are read on
 * the device once per buffer and kept on the host. */
static __global__ void ml_ccu_bases_kernel(ncclWindow_t win, int n, uint64_t *out) {
  const int p = (int)threadIdx.x;
  if (p < n) out[p] = (uint64_t)(uintptr_t)ncclGetLsaPointer(win, 0, p);
}

extern "C" moelink_status_t ml_ccu_window_bases(ncclWindow_t win, int lsa_size, uint64_t *scratch,
                                                uint64_t *host_out, cudaStream_t stream) {
  if (lsa_size < 1 || lsa_size > ML_CCU_MAX_RANKS)
    return ml_fail(MOELINK_ERR_INTERNAL, "window bases for %d LSA ranks", lsa_size);
  ml_ccu_bases_kernel<<<1, 32, 0, stream>>>(win, lsa_size, scratch);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(host_out, scratch, sizeof(uint64_t) * (size_t)lsa_size,
                        cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess)
    return ml_fail(MOELINK_ERR_CUDA, "reading the peer addresses of a symmetric window: %s",
                   cudaGetErrorString(e));
  for (int p = 0; p < lsa_size; ++p)
    if (host_out[p] == 0)
      return ml_fail(MOELINK_ERR_NCCL, "NCCL gave no address for LSA rank %d of a window", p);
  return MOELINK_SUCCESS;
}
