/* A kernel launch that may be a programmatic dependent of the stream's
 * previous kernel (programmatic dependent launch, PDL) or run in clusters:
 * the launch configuration every such call site needs, in one place. CUDA
 * only. */
#ifndef MOELINK_CORE_LAUNCH_CUH
#define MOELINK_CORE_LAUNCH_CUH

#include <cuda_runtime_api.h>
#include <string.h>

/* The configuration of a launch of grid x block with smem bytes of dynamic
 * shared memory on stream: with pdl, programmatic stream serialization
 * allowed (the kernel must wait, griddepcontrol.wait, before it touches what
 * the stream's earlier kernels write); with cluster_x > 1, clusters of
 * cluster_x CTAs along x. attrs: room for the two attributes, which cfg
 * points to. */
static inline void ml_launch_config(cudaLaunchConfig_t *cfg, cudaLaunchAttribute attrs[2],
                                    dim3 grid, dim3 block, size_t smem, int pdl, int cluster_x,
                                    cudaStream_t stream) {
  memset(cfg, 0, sizeof *cfg);
  memset(attrs, 0, 2 * sizeof *attrs);
  cfg->gridDim = grid;
  cfg->blockDim = block;
  cfg->dynamicSmemBytes = smem;
  cfg->stream = stream;
  cfg->attrs = attrs;
  unsigned n = 0;
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster_x > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = (unsigned)cluster_x;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg->numAttrs = n;
}

/* kernel launched as ml_launch_config describes; args holds a pointer to
 * each kernel parameter (as cudaLaunchKernel takes them). Returns the
 * launch's error. */
static inline cudaError_t ml_launch_kernel_ex(const void *kernel, dim3 grid, dim3 block,
                                              size_t smem, int pdl, int cluster_x,
                                              cudaStream_t stream, void **args) {
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attrs[2];
  ml_launch_config(&cfg, attrs, grid, block, smem, pdl, cluster_x, stream);
  return cudaLaunchKernelExC(&cfg, kernel, args);
}

/* The same without clusters: a programmatic dependent of the stream's
 * previous kernel when pdl. */
static inline cudaError_t ml_launch_kernel(const void *kernel, dim3 grid, dim3 block, size_t smem,
                                           int pdl, cudaStream_t stream, void **args) {
  return ml_launch_kernel_ex(kernel, grid, block, smem, pdl, 1, stream, args);
}

#endif
