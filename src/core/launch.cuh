/* A kernel launch that may be a programmatic dependent of the stream's
 * previous kernel (programmatic dependent launch, PDL): the launch
 * configuration every such call site needs, in one place. CUDA only. */
#ifndef MOELINK_CORE_LAUNCH_CUH
#define MOELINK_CORE_LAUNCH_CUH

#include <cuda_runtime_api.h>
#include <string.h>

/* kernel on grid x block with smem bytes of dynamic shared memory; args
 * holds a pointer to each kernel parameter (as cudaLaunchKernel takes them).
 * With pdl the launch allows programmatic stream serialization: the kernel
 * must wait (griddepcontrol.wait) before it touches what the stream's
 * earlier kernels write. Returns the launch's error. */
static inline cudaError_t ml_launch_kernel(const void *kernel, dim3 grid, dim3 block, size_t smem,
                                           int pdl, cudaStream_t stream, void **args) {
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[1];
  memset(&cfg, 0, sizeof cfg);
  memset(attr, 0, sizeof attr);
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelExC(&cfg, kernel, args);
}

#endif
