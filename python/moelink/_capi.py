"""The C side: finding libmoelink, the structs of include/moelink.h, the
prototypes of the functions the binding calls, and the error type.

Every struct below mirrors its C declaration field for field; the library
checks the leading ``size`` field of the three config structs, so a layout
that drifted from the header is refused with a message instead of being
misread.
"""

import ctypes
import ctypes.util
import enum
import glob
import os
import threading

# The header this binding mirrors (MOELINK_VERSION_* of include/moelink.h).
HEADER_VERSION = (0, 1, 0)
HEADER_VERSION_CODE = HEADER_VERSION[0] * 10000 + HEADER_VERSION[1] * 100 + HEADER_VERSION[2]


class Status(enum.IntEnum):
    SUCCESS = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_DTYPE_MISMATCH = 2
    ERR_NOT_FOUND = 3
    ERR_INVALID_STATE = 4
    ERR_UNSUPPORTED = 5
    ERR_OUT_OF_MEMORY = 6
    ERR_CUDA = 7
    ERR_NCCL = 8
    ERR_TIMEOUT = 9
    ERR_INTERNAL = 10


class Dtype(enum.IntEnum):
    F32 = 0
    BF16 = 1
    F16 = 2
    FP8_E4M3 = 3


class Backend(enum.IntEnum):
    CPU = 0
    CUDA = 1


class Router(enum.IntEnum):
    SOFTMAX_TOPK = 0
    SIGMOID_TOPK = 1
    TOPK_SOFTMAX = 2


class MoelinkError(RuntimeError):
    """A moelink call returned a status other than MOELINK_SUCCESS.

    ``status`` is the numeric moelink_status_t (compare with ``Status``),
    ``status_name`` its moelink_status_string and ``message`` the library's
    moelink_last_error at the time of the failure.
    """

    def __init__(self, status, message, status_name=None):
        self.status = int(status)
        self.message = message or ""
        if status_name is None:
            try:
                status_name = Status(self.status).name
                status_name = "MOELINK_" + status_name
            except ValueError:
                status_name = "MOELINK_STATUS_%d" % self.status
        self.status_name = status_name
        text = status_name + (": " + self.message if self.message else "")
        super().__init__(text)


# C enums are int-sized with GCC and Clang on every ABI moelink targets.
c_enum = ctypes.c_int


class ContextConfig(ctypes.Structure):
    """moelink_context_config_t"""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("backend", c_enum),
        ("device", ctypes.c_int),
        ("num_threads", ctypes.c_int),
    ]

    @classmethod
    def init(cls):
        """MOELINK_CONTEXT_CONFIG_INIT"""
        return cls(ctypes.sizeof(cls), Backend.CPU, 0, 0)


class MoeConfig(ctypes.Structure):
    """moelink_moe_config_t"""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("hidden", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("router", c_enum),
        ("renormalize", ctypes.c_int),
        ("n_group", ctypes.c_int),
        ("topk_group", ctypes.c_int),
        ("routed_scaling", ctypes.c_float),
        ("correction_bias", ctypes.c_int),
        ("shared_inter", ctypes.c_int),
        ("shared_gate", ctypes.c_int),
        ("dtype", c_enum),
        ("max_tokens", ctypes.c_int),
        ("fp8_experts", ctypes.c_int),
        ("fp8_shared", ctypes.c_int),
    ]

    @classmethod
    def init(cls):
        """MOELINK_MOE_CONFIG_INIT"""
        return cls(ctypes.sizeof(cls), 0, 0, 0, 0, Router.SOFTMAX_TOPK, 1, 1, 1, 1.0, 0, 0, 0,
                   Dtype.BF16, 1024, 0, 0)


class MoeWeights(ctypes.Structure):
    """moelink_moe_weights_t"""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("dtype", c_enum),
        ("router", ctypes.c_void_p),
        ("correction_bias", ctypes.POINTER(ctypes.c_float)),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("shared_gate_up", ctypes.c_void_p),
        ("shared_down", ctypes.c_void_p),
        ("shared_gate", ctypes.c_void_p),
        ("gate_up_scale", ctypes.POINTER(ctypes.c_float)),
        ("down_scale", ctypes.POINTER(ctypes.c_float)),
        ("shared_gate_up_scale", ctypes.POINTER(ctypes.c_float)),
        ("shared_down_scale", ctypes.POINTER(ctypes.c_float)),
    ]

    @classmethod
    def init(cls):
        """MOELINK_MOE_WEIGHTS_INIT"""
        return cls(ctypes.sizeof(cls), Dtype.BF16)


_P_I32 = ctypes.POINTER(ctypes.c_int32)


class Plan(ctypes.Structure):
    """moelink_plan_t"""

    _fields_ = [
        ("num_tokens", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("tile_rows", ctypes.c_int),
        ("max_tiles", ctypes.c_int),
        ("expert_offsets", _P_I32),
        ("sorted_pairs", _P_I32),
        ("pair_rows", _P_I32),
        ("tiles", _P_I32),
        ("num_tiles", _P_I32),
    ]


UNIQUE_ID_BYTES = 128  # MOELINK_UNIQUE_ID_BYTES


class UniqueId(ctypes.Structure):
    """moelink_unique_id_t"""

    _fields_ = [("bytes", ctypes.c_ubyte * UNIQUE_ID_BYTES)]


class TpConfig(ctypes.Structure):
    """moelink_tp_config_t"""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("dtype", c_enum),
        ("max_m", ctypes.c_int),
        ("max_n", ctypes.c_int),
        ("max_k", ctypes.c_int),
        ("comm_ctas", ctypes.c_int),
    ]

    @classmethod
    def init(cls):
        """MOELINK_TP_CONFIG_INIT"""
        return cls(ctypes.sizeof(cls), Dtype.BF16, 0, 0, 0, 0)


class EpRecv(ctypes.Structure):
    """moelink_ep_recv_t"""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("capacity", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("rows", ctypes.c_void_p),
        ("expert_ids", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
    ]

    @classmethod
    def init(cls):
        """MOELINK_EP_RECV_INIT"""
        return cls(ctypes.sizeof(cls), 0, 0, None, None, None)


class EpConfig(ctypes.Structure):
    """moelink_ep_config_t"""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("moe", MoeConfig),
        ("recv_capacity", ctypes.c_int),
        ("dispatch_quant", c_enum),
        ("call_tokens", ctypes.c_int),
    ]

    @classmethod
    def init(cls):
        """MOELINK_EP_CONFIG_INIT"""
        return cls(ctypes.sizeof(cls), MoeConfig.init(), 0, 0, 0)


def address_of(ptr):
    """The address a ctypes pointer holds, as an int (0 for NULL)."""
    return ctypes.cast(ptr, ctypes.c_void_p).value or 0


_vp = ctypes.c_void_p
_int = ctypes.c_int
_st = c_enum  # moelink_status_t

# name: (restype, argtypes)
_PROTOTYPES = {
    "moelink_status_string": (ctypes.c_char_p, [_st]),
    "moelink_last_error": (ctypes.c_char_p, []),
    "moelink_version": (ctypes.c_char_p, []),
    "moelink_version_code": (_int, []),
    "moelink_dtype_size": (ctypes.c_size_t, [c_enum]),
    "moelink_dtype_name": (ctypes.c_char_p, [c_enum]),
    "moelink_backend_available": (_int, [c_enum]),
    "moelink_context_create": (_st, [ctypes.POINTER(ContextConfig), ctypes.POINTER(_vp)]),
    "moelink_context_destroy": (_st, [_vp]),
    "moelink_context_backend": (c_enum, [_vp]),
    "moelink_preset_count": (_int, []),
    "moelink_preset_name": (ctypes.c_char_p, [_int]),
    "moelink_moe_preset": (_st, [ctypes.c_char_p, ctypes.POINTER(MoeConfig)]),
    "moelink_moe_config_check": (_st, [ctypes.POINTER(MoeConfig)]),
    "moelink_moe_flops": (ctypes.c_double, [ctypes.POINTER(MoeConfig), _int]),
    "moelink_moe_workspace_size": (_st, [_vp, ctypes.POINTER(MoeConfig),
                                         ctypes.POINTER(ctypes.c_size_t)]),
    "moelink_moe_create": (_st, [_vp, ctypes.POINTER(MoeConfig), ctypes.POINTER(_vp)]),
    "moelink_moe_destroy": (_st, [_vp]),
    "moelink_moe_set_weights": (_st, [_vp, ctypes.POINTER(MoeWeights)]),
    "moelink_moe_get_config": (_st, [_vp, ctypes.POINTER(MoeConfig)]),
    "moelink_moe_forward": (_st, [_vp, _vp, _int, _vp, _vp]),
    "moelink_moe_route": (_st, [_vp, _vp, _int, _vp, _vp, _vp]),
    "moelink_plan_bytes": (ctypes.c_size_t, [_int, _int, _int, _int]),
    "moelink_plan_view": (_st, [_vp, _int, _int, _int, _int, ctypes.POINTER(Plan)]),
    "moelink_moe_tile_rows": (_int, [_vp]),
    "moelink_moe_plan": (_st, [_vp, _vp, _int, _vp, _vp]),
    "moelink_moe_experts": (_st, [_vp, _vp, _int, _vp, _vp, _vp, _vp]),
    "moelink_moe_combine": (_st, [_vp, _vp, _int, _vp, _vp, _vp]),
    "moelink_get_unique_id": (_st, [_vp, ctypes.POINTER(UniqueId)]),
    "moelink_unique_id_to_hex": (_st, [ctypes.POINTER(UniqueId), ctypes.c_char_p,
                                       ctypes.c_size_t]),
    "moelink_unique_id_from_hex": (_st, [ctypes.c_char_p, ctypes.POINTER(UniqueId)]),
    "moelink_comm_init": (_st, [_vp, _int, _int, ctypes.POINTER(UniqueId), ctypes.POINTER(_vp)]),
    "moelink_comm_init_from_env": (_st, [_vp, ctypes.POINTER(_vp)]),
    "moelink_comm_destroy": (_st, [_vp]),
    "moelink_comm_rank": (_int, [_vp]),
    "moelink_comm_size": (_int, [_vp]),
    "moelink_comm_check": (_st, [_vp, _vp]),
    "moelink_allreduce": (_st, [_vp, _vp, _vp, ctypes.c_size_t, c_enum, _vp]),
    "moelink_allgather": (_st, [_vp, _vp, _vp, ctypes.c_size_t, c_enum, _vp]),
    "moelink_reduce_scatter": (_st, [_vp, _vp, _vp, ctypes.c_size_t, c_enum, _vp]),
    "moelink_alltoallv": (_st, [_vp, _vp, _vp, _vp, _vp, ctypes.c_size_t, _vp, _vp, c_enum,
                                _vp]),
    "moelink_tp_workspace_size": (_st, [_vp, ctypes.POINTER(TpConfig),
                                        ctypes.POINTER(ctypes.c_size_t)]),
    "moelink_tp_create": (_st, [_vp, ctypes.POINTER(TpConfig), ctypes.POINTER(_vp)]),
    "moelink_tp_destroy": (_st, [_vp]),
    "moelink_ag_gemm": (_st, [_vp, _vp, _vp, _vp, _int, _int, _int, _vp]),
    "moelink_gemm_rs": (_st, [_vp, _vp, _vp, _vp, _int, _int, _int, _vp]),
    "moelink_gemm_ar": (_st, [_vp, _vp, _vp, _vp, _int, _int, _int, _vp]),
    "moelink_ep_workspace_size": (_st, [_vp, ctypes.POINTER(EpConfig),
                                        ctypes.POINTER(ctypes.c_size_t)]),
    "moelink_ep_create": (_st, [_vp, ctypes.POINTER(EpConfig), ctypes.POINTER(_vp)]),
    "moelink_ep_destroy": (_st, [_vp]),
    "moelink_ep_get_config": (_st, [_vp, ctypes.POINTER(EpConfig), ctypes.POINTER(_int),
                                    ctypes.POINTER(_int)]),
    "moelink_ep_set_weights": (_st, [_vp, ctypes.POINTER(MoeWeights)]),
    "moelink_ep_forward": (_st, [_vp, _vp, _int, _vp, _vp]),
    "moelink_ep_dispatch": (_st, [_vp, _vp, _vp, _vp, _int, ctypes.POINTER(EpRecv), _vp]),
    "moelink_ep_dispatch_quantized": (_st, [_vp, _vp, _vp, _vp, _vp, _int,
                                            ctypes.POINTER(EpRecv), _vp]),
    "moelink_ep_combine": (_st, [_vp, _vp, _vp, _vp, _vp]),
    "moelink_quant_block": (_int, [c_enum]),
    "moelink_quant_scale_bytes": (ctypes.c_size_t, [c_enum, _int]),
    "moelink_quantize": (_st, [_vp, c_enum, c_enum, _vp, _int, _int, _vp, _vp, _vp]),
    "moelink_dequantize": (_st, [_vp, c_enum, c_enum, _vp, _vp, _int, _int, _vp, _vp]),
    "moelink_fill_random": (_st, [_vp, c_enum, _vp, ctypes.c_size_t, ctypes.c_uint64,
                                  ctypes.c_float, ctypes.c_float, _vp]),
    "moelink_random_value": (ctypes.c_float, [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_float,
                                              ctypes.c_float]),
}

_LIB_NAMES = ("libmoelink.so", "libmoelink.dylib")


def _candidates():
    """Where to look for the library, best first (see load())."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    found = []
    for name in _LIB_NAMES:
        found.append(os.path.join(pkg, name))
    # Build trees beside the package (python/build*) and at the repository root.
    builds = []
    for root in (os.path.dirname(pkg), os.path.dirname(os.path.dirname(pkg))):
        for d in glob.glob(os.path.join(root, "build*")):
            for name in _LIB_NAMES:
                p = os.path.join(d, name)
                if os.path.exists(p):
                    builds.append(p)
    # Several build trees may exist (one per configuration): the newest build wins.
    builds.sort(key=lambda p: os.path.getmtime(os.path.realpath(p)), reverse=True)
    found.extend(builds)
    return [p for p in found if os.path.exists(p)]


_lock = threading.Lock()
_lib = None
_lib_path = None


def _declare(lib):
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load():
    """The loaded library (a ctypes.CDLL with every prototype declared).

    Search order: the file named by the environment variable MOELINK_LIBRARY
    (an error if it does not load); libmoelink.so next to this package; the
    newest libmoelink.so in a build*/ folder beside the package or at the
    repository root above it; the system loader (LD_LIBRARY_PATH, ldconfig).
    """
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        env = os.environ.get("MOELINK_LIBRARY")
        if env:
            try:
                lib = ctypes.CDLL(env)
            except OSError as e:
                raise OSError("MOELINK_LIBRARY=%s could not be loaded: %s" % (env, e)) from None
            path = env
        else:
            lib = path = None
            for p in _candidates():
                try:
                    lib = ctypes.CDLL(p)
                    path = p
                    break
                except OSError as e:
                    tried.append("%s (%s)" % (p, e))
            if lib is None:
                names = [ctypes.util.find_library("moelink")] + ["libmoelink.so",
                                                                "libmoelink.so.0"]
                for n in names:
                    if not n:
                        continue
                    try:
                        lib = ctypes.CDLL(n)
                        path = n
                        break
                    except OSError as e:
                        tried.append("%s (%s)" % (n, e))
            if lib is None:
                raise OSError("libmoelink not found: set MOELINK_LIBRARY to its path, or build "
                              "it into build*/ at the repository root; tried: " +
                              ("; ".join(tried) or "nothing"))
        try:
            _declare(lib)
        except AttributeError as e:
            raise OSError("%s is not a matching libmoelink (%s)" % (path, e)) from None
        code = lib.moelink_version_code()
        if code // 10000 != HEADER_VERSION[0] or (HEADER_VERSION[0] == 0 and
                                                  code // 100 != HEADER_VERSION_CODE // 100):
            raise OSError("%s is libmoelink %s; this binding mirrors the %d.%d.x header" %
                          (path, lib.moelink_version().decode(), HEADER_VERSION[0],
                           HEADER_VERSION[1]))
        _lib, _lib_path = lib, path
        return lib


def library_path():
    """The path (or loader name) libmoelink was loaded from."""
    load()
    return _lib_path


def error(status):
    """The MoelinkError for a failed call, carrying the library's message."""
    lib = load()
    # last_error is only valid until the next moelink call: read it first.
    msg = lib.moelink_last_error()
    name = lib.moelink_status_string(status)
    return MoelinkError(status, msg.decode("utf-8", "replace") if msg else "",
                        name.decode() if name else None)


def check(status):
    """Raises MoelinkError unless status is MOELINK_SUCCESS."""
    if status != 0:
        raise error(status)
