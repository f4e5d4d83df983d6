/* Which backends are built in. */
#include "moe/backend.h"

#ifndef MOELINK_HAVE_CUDA
const ml_backend_ops *ml_cuda_backend(void) { return 0; }
#endif
