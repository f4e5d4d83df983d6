"""Arrays handed to C: numpy arrays (host memory, CPU backend) and PyTorch
tensors (CUDA tensors for the CUDA backend; CPU tensors also work on the CPU
backend). Nothing is copied: the C side gets the data pointer, so every
array must be C-contiguous, of the element type the layer expects, and in
the memory the context's backend reads.

Element types are named "f32", "f16", "bf16", "i32", "i64" and "u8". numpy has no
bfloat16 of its own: a bf16 array is either a uint16 array holding the bf16
bit patterns (see to_bf16 / from_bf16) or, when the ml_dtypes package is
installed, an array of ml_dtypes.bfloat16.
"""

import sys

import numpy as np

try:  # optional: a real numpy bfloat16
    import ml_dtypes as _ml_dtypes

    BF16_NUMPY = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
    BF16_NUMPY = None

_NP_CODES = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(np.uint16): "bf16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    np.dtype(np.uint8): "u8",
}
if BF16_NUMPY is not None:
    _NP_CODES[BF16_NUMPY] = "bf16"

_CODE_NP = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
            "bf16": np.dtype(np.uint16), "i32": np.dtype(np.int32),
            "i64": np.dtype(np.int64), "u8": np.dtype(np.uint8)}

_TORCH_CODES = None


def _torch():
    """torch if the program imported it; a tensor cannot exist otherwise."""
    return sys.modules.get("torch")


def _torch_codes(torch):
    global _TORCH_CODES
    if _TORCH_CODES is None:
        _TORCH_CODES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                        torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}
    return _TORCH_CODES


def _torch_dtype(torch, code):
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
            "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8}[code]


class Buf:
    """What the binding needs to know about one array."""

    __slots__ = ("obj", "kind", "ptr", "shape", "code", "dtype_name", "device", "contiguous",
                 "writeable")

    def describe_device(self):
        return "cpu" if self.device[0] == "cpu" else "%s:%d" % self.device


def describe(a, name):
    """A Buf for a numpy array or a torch tensor; TypeError for anything else."""
    if isinstance(a, np.ndarray):
        b = Buf()
        b.obj = a
        b.kind = "numpy"
        b.ptr = a.__array_interface__["data"][0]
        b.shape = a.shape
        b.code = _NP_CODES.get(a.dtype)
        b.dtype_name = str(a.dtype)
        b.device = ("cpu", 0)
        b.contiguous = a.flags.c_contiguous
        b.writeable = a.flags.writeable
        return b
    torch = _torch()
    if torch is not None and isinstance(a, torch.Tensor):
        b = Buf()
        b.obj = a
        b.kind = "torch"
        b.ptr = a.data_ptr()
        b.shape = tuple(a.shape)
        b.code = _torch_codes(torch).get(a.dtype)
        b.dtype_name = str(a.dtype)
        dev = a.device
        b.device = (dev.type, dev.index if dev.index is not None else 0)
        b.contiguous = a.is_contiguous()
        b.writeable = True
        return b
    raise TypeError("%s must be a numpy array or a torch tensor, not %s" %
                    (name, type(a).__name__))


def empty(like, shape, code):
    """A new uninitialized array of `shape` and element type `code`, of the same
    kind and on the same device as the Buf `like`."""
    if like.kind == "numpy":
        if code == "bf16" and BF16_NUMPY is not None and like.obj.dtype == BF16_NUMPY:
            return np.empty(shape, BF16_NUMPY)
        return np.empty(shape, _CODE_NP[code])
    torch = _torch()
    return torch.empty(shape, dtype=_torch_dtype(torch, code), device=like.obj.device)


def to_bf16(a):
    """bf16 bit patterns (a uint16 array) of `a`, rounded to nearest even.
    NaNs stay NaNs; values past the bf16 range become infinities."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def from_bf16(bits):
    """float32 values of a uint16 array of bf16 bit patterns (or of an
    ml_dtypes.bfloat16 array)."""
    b = np.asarray(bits)
    if BF16_NUMPY is not None and b.dtype == BF16_NUMPY:
        return b.astype(np.float32)
    if b.dtype != np.uint16:
        raise TypeError("from_bf16 needs a uint16 array of bf16 bits, got %s" % b.dtype)
    return (b.astype(np.uint32) << 16).view(np.float32)


_TYPESTR = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i32": "<i4", "i64": "<i8", "u8": "|u1"}


class _DeviceMemory:
    """Memory the library owns on a CUDA device, as __cuda_array_interface__."""

    def __init__(self, ptr, shape, code):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[code],
                                         "data": (ptr, False), "version": 3, "strides": None}


def view(ptr, shape, code, device):
    """An array over memory the library owns (no copy): numpy on the CPU, a
    torch tensor on ("cuda", index). It stays valid only as long as the
    library says that memory is."""
    n = int(np.prod(shape, dtype=np.int64))
    if device[0] == "cpu":
        dt = _CODE_NP[code]
        if n == 0 or not ptr:
            return np.empty(shape, dt)
        import ctypes
        raw = (ctypes.c_char * (n * dt.itemsize)).from_address(ptr)
        return np.frombuffer(raw, dt).reshape(shape)
    torch = _torch()
    if torch is None:
        import torch  # noqa: F811 - a CUDA context works on torch tensors
    if n == 0 or not ptr:
        return torch.empty(shape, dtype=_torch_dtype(torch, code), device="cuda:%d" % device[1])
    # bf16 travels as f16 (same two bytes) and is viewed back.
    t = torch.as_tensor(_DeviceMemory(ptr, shape, "f16" if code == "bf16" else code),
                        device="cuda:%d" % device[1])
    return t.view(torch.bfloat16) if code == "bf16" else t
