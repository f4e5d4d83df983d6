"""moelink: Mixture-of-Experts layers, from Python, through ctypes.

No compiled extension: the package loads libmoelink.so (environment variable
MOELINK_LIBRARY first, then next to the package, then a build*/ folder beside
it or at the repository root, then the system loader) and calls its C API.

Arrays are passed zero-copy:

* CPU backend: C-contiguous numpy arrays (torch CPU tensors work too).
  float32 and float16 are themselves; bf16 is a uint16 array holding the
  bf16 bit patterns (``moelink.to_bf16`` / ``moelink.from_bf16`` convert), or
  an ``ml_dtypes.bfloat16`` array when that package is installed.
* CUDA backend: contiguous PyTorch CUDA tensors on the context's device
  (torch.float32 / float16 / bfloat16), passed through ``data_ptr()``; work is
  queued on ``torch.cuda.current_stream()`` unless a stream is given. torch is
  imported only when a CUDA context needs it.

Shapes and dtypes are checked in Python (ValueError / TypeError) before a
call; a failure inside the library raises ``MoelinkError`` with the status
and the library's own message.

    import numpy as np, moelink
    with moelink.Context("cpu") as ctx:
        moe = moelink.MoE(ctx, hidden=64, inter=32, experts=8, top_k=2, dtype="f32")
        moe.set_weights(router=wr, gate_up=wgu, down=wd)
        y = moe.forward(x)            # x [T, 64] float32
        ids, w = moe.route(x)         # [T, 2] int32, [T, 2] float32

Under ``moelink launch -n N -- python3 prog.py`` each process joins its
group with ``moelink.Comm.from_env(ctx)``: collectives (allreduce,
allgather, reduce_scatter, alltoallv), ``moelink.TP`` (GEMMs fused with
their collective) and ``moelink.EP`` (the expert-parallel layer, whole or as
its two exchanges: EP.dispatch, your experts, EP.combine).
"""

from ._arrays import BF16_NUMPY, from_bf16, to_bf16
from ._capi import (HEADER_VERSION, Backend, ContextConfig, Dtype, MoeConfig, MoelinkError,
                    MoeWeights, Router, Status, library_path, load)
from ._capi import Plan as PlanStruct
from ._core import (Context, MoE, Plan, backend_available, dtype_size, preset_config, presets,
                    random_values, version, version_code)
from ._comm import EP, TP, Comm, Received, unique_id

__version__ = "%d.%d.%d" % HEADER_VERSION

__all__ = [
    "BF16_NUMPY", "Backend", "Comm", "Context", "ContextConfig", "Dtype", "EP", "MoE",
    "MoeConfig", "MoeWeights", "MoelinkError", "Plan", "PlanStruct", "Received", "Router",
    "Status", "TP",
    "backend_available", "dtype_size", "from_bf16", "library_path", "load", "preset_config",
    "presets", "random_values", "to_bf16", "unique_id", "version", "version_code",
]
