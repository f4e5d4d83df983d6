"""Context, MoE layer and plan objects over the C API."""

import ctypes
import weakref

import numpy as np

from . import _arrays
from ._capi import (Backend, ContextConfig, Dtype, MoeConfig, MoeWeights, Plan as _CPlan,
                    Router, address_of, check, load)

_DTYPES = {
    "f32": Dtype.F32, "fp32": Dtype.F32, "float32": Dtype.F32, "float": Dtype.F32,
    "bf16": Dtype.BF16, "bfloat16": Dtype.BF16,
    "f16": Dtype.F16, "fp16": Dtype.F16, "float16": Dtype.F16, "half": Dtype.F16,
    "fp8_e4m3": Dtype.FP8_E4M3, "fp8": Dtype.FP8_E4M3,
}
_DTYPE_CODE = {Dtype.F32: "f32", Dtype.BF16: "bf16", Dtype.F16: "f16", Dtype.FP8_E4M3: "fp8_e4m3"}
# moelink_quant_t
_QUANT = {"none": 0, "fp8": 1, "mxfp8": 2}

_ROUTERS = {
    "softmax": Router.SOFTMAX_TOPK, "softmax_topk": Router.SOFTMAX_TOPK,
    "sigmoid": Router.SIGMOID_TOPK, "sigmoid_topk": Router.SIGMOID_TOPK,
    "topk_softmax": Router.TOPK_SOFTMAX,
}
_ROUTER_NAME = {Router.SOFTMAX_TOPK: "softmax", Router.SIGMOID_TOPK: "sigmoid",
                Router.TOPK_SOFTMAX: "topk_softmax"}


def _dtype_enum(dtype):
    """A moelink_dtype_t from a name ("bf16"), a Dtype, a numpy or a torch dtype."""
    if isinstance(dtype, Dtype):
        return dtype
    if isinstance(dtype, str):
        d = _DTYPES.get(dtype.lower())
        if d is None:
            raise ValueError("unknown dtype %r (use 'f32', 'bf16' or 'f16')" % dtype)
        return d
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    d = _DTYPES.get(name.lower())
    if d is None:
        raise ValueError("unknown dtype %r (use 'f32', 'bf16' or 'f16')" % (dtype,))
    return d


def _router_enum(router):
    if isinstance(router, Router):
        return router
    if isinstance(router, str):
        r = _ROUTERS.get(router.lower())
        if r is None:
            raise ValueError("unknown router %r (use 'softmax', 'sigmoid' or 'topk_softmax')" %
                             router)
        return r
    return int(router)  # the C side checks the value


def _config_dict(c):
    return {
        "hidden": c.hidden, "inter": c.inter, "num_experts": c.num_experts, "top_k": c.top_k,
        "router": _ROUTER_NAME.get(c.router, int(c.router)), "renormalize": bool(c.renormalize),
        "n_group": c.n_group, "topk_group": c.topk_group,
        "routed_scaling": float(c.routed_scaling), "correction_bias": bool(c.correction_bias),
        "shared_inter": c.shared_inter, "shared_gate": bool(c.shared_gate),
        "dtype": _DTYPE_CODE.get(c.dtype, int(c.dtype)), "max_tokens": c.max_tokens,
        "fp8_experts": bool(c.fp8_experts), "fp8_shared": bool(c.fp8_shared),
    }


def version():
    """Version string of the loaded library ("0.1.0")."""
    return load().moelink_version().decode()


def version_code():
    """MOELINK_VERSION_CODE of the loaded library."""
    return load().moelink_version_code()


def presets():
    """Names of the built-in layer presets."""
    lib = load()
    return [lib.moelink_preset_name(i).decode() for i in range(lib.moelink_preset_count())]


def preset_config(name):
    """The model fields of a preset as a dict (dtype and max_tokens at their defaults)."""
    c = MoeConfig.init()
    check(load().moelink_moe_preset(name.encode(), ctypes.byref(c)))
    return _config_dict(c)


def _backend_enum(backend):
    if isinstance(backend, Backend):
        return backend
    b = {"cpu": Backend.CPU, "cuda": Backend.CUDA}.get(str(backend).lower())
    if b is None:
        raise ValueError("unknown backend %r (use 'cpu' or 'cuda')" % (backend,))
    return b


def backend_available(backend):
    """Whether a backend ('cpu' or 'cuda') is built in and usable here."""
    return bool(load().moelink_backend_available(_backend_enum(backend)))


def dtype_size(dtype):
    """Bytes per element of a dtype."""
    return int(load().moelink_dtype_size(_dtype_enum(dtype)))


def random_values(seed, n, scale=1.0, offset=0.0, start=0):
    """float32 values moelink_fill_random writes at indices start..start+n-1
    (before rounding to the dtype). One C call per element: for tests."""
    lib = load()
    return np.array([lib.moelink_random_value(seed, start + i, scale, offset) for i in range(n)],
                    dtype=np.float32)


class _Closable:
    """`with` support and a best-effort close at garbage collection for the
    objects that own a library handle (their close() frees it), and the
    handle itself: self._h, None once closed; _what names the object in the
    error a closed one raises."""

    _what = "object"

    @property
    def handle(self):
        """The library handle (moelink_*_t) as an int, for other C code."""
        self._alive()
        return self._h.value

    def _alive(self):
        if self._h is None:
            raise ValueError("%s is closed" % self._what)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Context(_Closable):
    """A backend and a device: Context("cpu", threads=0) or Context("cuda", device=0).

    Destroying a context destroys the layers made on it first. Use it as a
    context manager or call close()."""

    _what = "context"

    def __init__(self, backend="cpu", device=0, threads=0):
        self._lib = load()
        self._h = None
        cfg = ContextConfig.init()
        cfg.backend = _backend_enum(backend)
        cfg.device = int(device)
        cfg.num_threads = int(threads)
        h = ctypes.c_void_p()
        check(self._lib.moelink_context_create(ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h
        self.backend = "cuda" if cfg.backend == Backend.CUDA else "cpu"
        self.device = cfg.device
        self.threads = cfg.num_threads
        self._layers = weakref.WeakSet()


    def _check_location(self, b, name):
        """b (a Buf) must live where this context's backend reads memory."""
        if self.backend == "cpu":
            if b.device[0] != "cpu":
                raise ValueError("%s is on %s but the context runs on the CPU: pass a numpy "
                                 "array" % (name, b.describe_device()))
        else:
            if b.kind != "torch" or b.device[0] != "cuda":
                raise ValueError("%s is a %s %s array but the context runs on cuda:%d: pass a "
                                 "torch CUDA tensor" %
                                 (name, b.describe_device(), b.kind, self.device))
            if b.device[1] != self.device:
                raise ValueError("%s is on cuda:%d but the context runs on cuda:%d" %
                                 (name, b.device[1], self.device))

    def _stream(self, stream):
        """The cudaStream_t to pass: None on the CPU; on CUDA the given stream (a
        torch.cuda.Stream, anything with .cuda_stream or .ptr, or a raw int),
        else torch's current stream on the context's device."""
        if self.backend == "cpu":
            return None
        if stream is None:
            torch = _arrays._torch()
            if torch is None:
                import torch  # noqa: F811 - CUDA contexts take torch tensors
            return torch.cuda.current_stream(self.device).cuda_stream or None
        if isinstance(stream, int):
            return stream or None
        for attr in ("cuda_stream", "ptr", "handle"):
            v = getattr(stream, attr, None)
            if isinstance(v, int):
                return v or None
        raise TypeError("stream must be None, an int handle or a torch.cuda.Stream, not %s" %
                        type(stream).__name__)

    def fill_random(self, a, seed, scale=1.0, offset=0.0, stream=None):
        """Fills `a` (f32/f16/bf16, contiguous, in this context's memory) with
        offset + scale * u, u uniform in [-1, 1) from a counter-based generator:
        element i depends only on (seed, i), the same on every backend."""
        self._alive()
        b = _arrays.describe(a, "a")
        self._check_location(b, "a")
        if not b.contiguous:
            raise ValueError("a must be C-contiguous")
        if b.code not in ("f32", "f16", "bf16"):
            raise TypeError("fill_random: a has dtype %s; need f32, f16 or bf16" % b.dtype_name)
        n = int(np.prod(b.shape, dtype=np.int64))
        check(self._lib.moelink_fill_random(self._h, _dtype_enum(b.code), b.ptr, n, int(seed),
                                            float(scale), float(offset), self._stream(stream)))
        return a

    @staticmethod
    def _quant_rows(a, name, fmt):
        """(description, rows, cols, scales shape, scales dtype code) of the
        [rows, cols] array a for 8-bit rows of format fmt."""
        if fmt not in ("fp8", "mxfp8"):
            raise ValueError("format: expected fp8 or mxfp8, got %r" % (fmt,))
        b = _arrays.describe(a, name)
        if len(b.shape) != 2:
            raise ValueError("%s has shape %s; expected [rows, cols]" % (name, list(b.shape)))
        rows, cols = b.shape
        block = 128 if fmt == "fp8" else 32
        if cols % block:
            raise ValueError("%s rows need a multiple of %d columns, got %d" % (fmt, block, cols))
        return b, rows, cols, (rows, cols // block), ("f32" if fmt == "fp8" else "u8")

    def quantize(self, x, fmt="fp8", q=None, scales=None, stream=None):
        """x [rows, cols] (f32, f16 or bf16, this context's memory) as 8-bit rows
        (moelink_quantize): returns (q, scales), q uint8 [rows, cols] of e4m3
        bytes and scales [rows, cols/128] float32 ("fp8") or [rows, cols/32]
        uint8 e8m0 ("mxfp8")."""
        self._alive()
        bx, rows, cols, sshape, scode = self._quant_rows(x, "x", fmt)
        if bx.code not in ("f32", "f16", "bf16"):
            raise TypeError("quantize: x has dtype %s; need f32, f16 or bf16" % bx.dtype_name)
        bx = check_arg(self, x, "x", (rows, cols), bx.code)
        if q is None:
            q = _arrays.empty(bx, (rows, cols), "u8")
        if scales is None:
            scales = _arrays.empty(bx, sshape, scode)
        bq = check_arg(self, q, "q", (rows, cols), "u8", out=True)
        bs = check_arg(self, scales, "scales", sshape, scode, out=True)
        check(self._lib.moelink_quantize(self._h, _QUANT[fmt], _dtype_enum(bx.code), bx.ptr,
                                         rows, cols, bq.ptr, bs.ptr, self._stream(stream)))
        return q, scales

    def dequantize(self, q, scales, fmt="fp8", dtype="bf16", out=None, stream=None):
        """The rows of quantize back (moelink_dequantize): out [rows, cols] of
        dtype = e4m3 value times its block's scale, rounded once."""
        self._alive()
        _, rows, cols, sshape, scode = self._quant_rows(q, "q", fmt)
        bq = check_arg(self, q, "q", (rows, cols), "u8")
        bs = check_arg(self, scales, "scales", sshape, scode)
        if out is None:
            out = _arrays.empty(bq, (rows, cols), dtype)
        bo = check_arg(self, out, "out", (rows, cols), dtype, out=True)
        check(self._lib.moelink_dequantize(self._h, _QUANT[fmt], _dtype_enum(dtype), bq.ptr,
                                           bs.ptr, rows, cols, bo.ptr, self._stream(stream)))
        return out

    def close(self):
        if self._h is None:
            return
        for layer in list(self._layers):
            layer.close()
        h, self._h = self._h, None
        check(self._lib.moelink_context_destroy(h))

    def __repr__(self):
        where = "cpu" if self.backend == "cpu" else "cuda:%d" % self.device
        return "<moelink.Context %s%s>" % (where, "" if self._h is not None else " closed")


class Plan:
    """A routing plan: the C plan buffer (an int32 array in the layer's memory)
    and views of the arrays moelink_plan_view cuts it into. The views are
    numpy arrays on the CPU and torch tensors on CUDA; they alias the buffer."""

    def __init__(self, buffer, num_tokens, top_k, num_experts, tile_rows):
        self.buffer = buffer
        self.num_tokens = num_tokens
        self.top_k = top_k
        self.num_experts = num_experts
        self.tile_rows = tile_rows
        b = _arrays.describe(buffer, "plan buffer")
        view = _CPlan()
        check(load().moelink_plan_view(b.ptr, num_tokens, top_k, num_experts, tile_rows,
                                       ctypes.byref(view)))
        self.max_tiles = view.max_tiles
        # Element offsets of each array within the buffer, as the C side cut it.
        self._off = {}
        for f in ("expert_offsets", "sorted_pairs", "pair_rows", "tiles", "num_tiles"):
            self._off[f] = (address_of(getattr(view, f)) - b.ptr) // 4

    def _slice(self, field, n):
        o = self._off[field]
        return self.buffer[o:o + n]

    @property
    def expert_offsets(self):
        """[E+1]: rows of expert e are [offsets[e], offsets[e+1])."""
        return self._slice("expert_offsets", self.num_experts + 1)

    @property
    def sorted_pairs(self):
        """[T*k]: the pair t*k+j held by each row of the permuted order."""
        return self._slice("sorted_pairs", self.num_tokens * self.top_k)

    @property
    def pair_rows(self):
        """[T*k]: the row of pair t*k+j (-1 for an empty slot)."""
        return self._slice("pair_rows", self.num_tokens * self.top_k)

    @property
    def tiles(self):
        """[max_tiles, 3]: (expert, first row, row count); the first num_tiles are used."""
        return self._slice("tiles", 3 * self.max_tiles).reshape(self.max_tiles, 3)

    @property
    def num_tiles(self):
        """[1]: the number of tiles used."""
        return self._slice("num_tiles", 1)


def _need_code(b, name, code):
    """TypeError unless the Buf b holds elements of type `code`."""
    if b.code == code:
        return
    extra = ""
    if code == "f16" and b.code == "bf16" and b.kind == "numpy":
        extra = " (a uint16 numpy array is read as bf16 bits)"
    elif code == "bf16" and b.kind == "numpy":
        extra = " (give bf16 as uint16 bits from moelink.to_bf16, or as ml_dtypes.bfloat16)"
    what = "the layer needs" if code != "i32" else "expected"
    raise TypeError("%s has dtype %s; %s %s%s" % (name, b.dtype_name, what, code, extra))


def moe_config(preset=None, *, hidden=None, inter=None, experts=None, top_k=None, router=None,
               renormalize=None, n_group=None, topk_group=None, routed_scaling=None,
               correction_bias=None, shared_inter=None, shared_gate=None, dtype="bf16",
               max_tokens=1024, fp8_experts=False, fp8_shared=False):
    """A MoeConfig from a preset (or MOELINK_MOE_CONFIG_INIT) and the keywords
    given; the library checks it when a layer is created from it."""
    c = MoeConfig.init()
    if preset is not None:
        check(load().moelink_moe_preset(str(preset).encode(), ctypes.byref(c)))
    for field, value in (("hidden", hidden), ("inter", inter), ("num_experts", experts),
                         ("top_k", top_k), ("n_group", n_group), ("topk_group", topk_group),
                         ("shared_inter", shared_inter)):
        if value is not None:
            setattr(c, field, int(value))
    for field, value in (("renormalize", renormalize), ("correction_bias", correction_bias),
                         ("shared_gate", shared_gate)):
        if value is not None:
            setattr(c, field, int(value))
    if router is not None:
        c.router = _router_enum(router)
    if routed_scaling is not None:
        c.routed_scaling = float(routed_scaling)
    c.dtype = _dtype_enum(dtype)
    c.max_tokens = int(max_tokens)
    c.fp8_experts = int(bool(fp8_experts))
    c.fp8_shared = int(bool(fp8_shared))
    return c


def weights_struct(ctx, shapes, given, correction_bias, num_experts, default_dtype,
                   fp8_experts=False, fp8_shared=False):
    """(MoeWeights, {name: array}) for the arrays in `given` (None: not given),
    each checked against ctx's memory, one shared f32/f16/bf16 dtype, the
    shape in `shapes` and C layout; correction_bias is [num_experts] float32.
    With fp8_experts, gate_up and down are uint8 (e4m3 bytes) and
    gate_up_scale / down_scale float32; with fp8_shared, likewise
    shared_gate_up and shared_down, with shared_gate_up_scale /
    shared_down_scale. Which ones are required is the library's to say."""
    w = MoeWeights.init()
    keep = {}
    wcode = None
    fp8 = set()
    if fp8_experts:
        fp8.update(("gate_up", "down"))
    if fp8_shared:
        fp8.update(("shared_gate_up", "shared_down"))
    for name in ("gate_up_scale", "down_scale", "shared_gate_up_scale", "shared_down_scale"):
        a = given.get(name)
        if a is None:
            continue
        b = check_arg(ctx, a, name, shapes[name], "f32")
        setattr(w, name, ctypes.cast(ctypes.c_void_p(b.ptr), ctypes.POINTER(ctypes.c_float)))
        keep[name] = a
    for name in ("router", "gate_up", "down", "shared_gate_up", "shared_down", "shared_gate"):
        a = given[name]
        if a is None:
            continue
        if name in fp8:
            b = check_arg(ctx, a, name, shapes[name], "u8")
            setattr(w, name, b.ptr)
            keep[name] = a
            continue
        b = _arrays.describe(a, name)
        ctx._check_location(b, name)
        if b.code not in ("f32", "f16", "bf16"):
            raise TypeError("%s has dtype %s; weights are f32, f16 or bf16" %
                            (name, b.dtype_name))
        if wcode is None:
            wcode = b.code
        elif b.code != wcode:
            raise TypeError("%s has dtype %s but router has %s: all weights share one dtype"
                            % (name, b.dtype_name, wcode))
        if tuple(b.shape) != shapes[name]:
            raise ValueError("%s has shape %s; expected %s" %
                             (name, list(b.shape), list(shapes[name])))
        if not b.contiguous:
            raise ValueError("%s is not C-contiguous" % name)
        setattr(w, name, b.ptr)
        keep[name] = a
    if correction_bias is not None:
        b = check_arg(ctx, correction_bias, "correction_bias", (num_experts,), "f32")
        w.correction_bias = ctypes.cast(ctypes.c_void_p(b.ptr), ctypes.POINTER(ctypes.c_float))
        keep["correction_bias"] = correction_bias
    w.dtype = _dtype_enum(wcode) if wcode is not None else default_dtype
    return w, keep


def check_arg(ctx, a, name, shape, code, out=False):
    """A Buf for argument `a`, after checking kind, place (ctx's memory), dtype,
    shape and layout; shape entries of None match any size."""
    b = _arrays.describe(a, name)
    ctx._check_location(b, name)
    _need_code(b, name, code)
    if len(b.shape) != len(shape) or any(w is not None and w != s
                                         for s, w in zip(b.shape, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError("%s has shape %s; expected %s" % (name, list(b.shape), want))
    if not b.contiguous:
        raise ValueError("%s is not C-contiguous (moelink reads it in place: pass "
                         "a contiguous array, e.g. .copy() / .contiguous())" % name)
    if out and not b.writeable:
        raise ValueError("%s is read-only" % name)
    return b


class MoE(_Closable):
    """A routed-expert layer (see moelink_moe_config_t in include/moelink.h).

    MoE(ctx, preset="mixtral-8x7b", dtype="bf16", max_tokens=1024) starts from
    a preset; any keyword given (hidden, inter, experts, top_k, router,
    renormalize, n_group, topk_group, routed_scaling, correction_bias,
    shared_inter, shared_gate) overrides it. router is 'softmax', 'sigmoid' or
    'topk_softmax'. fp8_experts=True takes the routed experts' weights as FP8
    (e4m3 bytes with fp32 128 x 128 block scales); fp8_shared=True the shared
    expert's likewise (needs shared_inter > 0; independent of fp8_experts).
    Weights are bound with set_weights(); the layer keeps references to them
    so they stay alive while it may use them.
    """

    _what = "layer"

    def __init__(self, ctx, preset=None, *, hidden=None, inter=None, experts=None, top_k=None,
                 router=None, renormalize=None, n_group=None, topk_group=None,
                 routed_scaling=None, correction_bias=None, shared_inter=None, shared_gate=None,
                 dtype="bf16", max_tokens=1024, fp8_experts=False, fp8_shared=False):
        if not isinstance(ctx, Context):
            raise TypeError("ctx must be a moelink.Context, not %s" % type(ctx).__name__)
        ctx._alive()
        self._lib = ctx._lib
        self._h = None
        self._weights = {}
        self.ctx = ctx
        c = moe_config(preset, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                       router=router, renormalize=renormalize, n_group=n_group,
                       topk_group=topk_group, routed_scaling=routed_scaling,
                       correction_bias=correction_bias, shared_inter=shared_inter,
                       shared_gate=shared_gate, dtype=dtype, max_tokens=max_tokens,
                       fp8_experts=fp8_experts, fp8_shared=fp8_shared)
        h = ctypes.c_void_p()
        check(self._lib.moelink_moe_create(ctx._h, ctypes.byref(c), ctypes.byref(h)))
        self._h = h
        got = MoeConfig.init()
        check(self._lib.moelink_moe_get_config(h, ctypes.byref(got)))
        self._cfg = got
        self.config = _config_dict(got)
        self.hidden = got.hidden
        self.inter = got.inter
        self.num_experts = got.num_experts
        self.top_k = got.top_k
        self.shared_inter = got.shared_inter
        self.max_tokens = got.max_tokens
        self.dtype = _DTYPE_CODE[got.dtype]
        self.fp8_experts = bool(got.fp8_experts)
        self.fp8_shared = bool(got.fp8_shared)
        self.tile_rows = self._lib.moelink_moe_tile_rows(h)
        ctx._layers.add(self)

    # -- lifetime --------------------------------------------------------


    def close(self):
        """Destroys the layer. On CUDA, waits for the device first, since queued
        work may still use the layer's workspace."""
        if self._h is None:
            return
        if self.ctx.backend == "cuda":
            torch = _arrays._torch()
            if torch is not None:
                torch.cuda.synchronize(self.ctx.device)
        h, self._h = self._h, None
        self._weights = {}
        check(self._lib.moelink_moe_destroy(h))

    def __repr__(self):
        c = self.config
        return ("<moelink.MoE H=%d I=%d E=%d k=%d %s %s%s>" %
                (c["hidden"], c["inter"], c["num_experts"], c["top_k"], c["router"], c["dtype"],
                 "" if self._h is not None else " closed"))

    # -- facts -----------------------------------------------------------

    def workspace_size(self):
        """Bytes of workspace this layer allocated at create."""
        n = ctypes.c_size_t()
        check(self._lib.moelink_moe_workspace_size(self.ctx._h, ctypes.byref(self._cfg),
                                                   ctypes.byref(n)))
        return n.value

    def flops(self, num_tokens):
        """FLOPs of one forward over num_tokens tokens."""
        return self._lib.moelink_moe_flops(ctypes.byref(self._cfg), int(num_tokens))

    # -- argument checks -------------------------------------------------

    def _arg(self, a, name, shape, code, out=False):
        """check_arg against this layer's context."""
        return check_arg(self.ctx, a, name, shape, code, out)

    def _plan_arg(self, plan, num_tokens):
        if not isinstance(plan, Plan):
            raise TypeError("plan must be a moelink.Plan from MoE.plan(), not %s" %
                            type(plan).__name__)
        if plan.num_tokens != num_tokens:
            raise ValueError("plan was built for %d tokens, not %d" %
                             (plan.num_tokens, num_tokens))
        if (plan.top_k, plan.num_experts, plan.tile_rows) != (self.top_k, self.num_experts,
                                                              self.tile_rows):
            raise ValueError("plan was built for another layer (k %d, E %d, tile_rows %d)" %
                             (plan.top_k, plan.num_experts, plan.tile_rows))
        b = _arrays.describe(plan.buffer, "plan.buffer")
        self.ctx._check_location(b, "plan.buffer")
        return b

    # -- weights ---------------------------------------------------------

    def set_weights(self, router, gate_up, down, correction_bias=None, shared_gate_up=None,
                    shared_down=None, shared_gate=None, gate_up_scale=None, down_scale=None,
                    shared_gate_up_scale=None, shared_down_scale=None):
        """Binds the weights without copying them. Shapes: router [E, H],
        gate_up [E, 2I, H] (gate rows of each expert first), down [E, H, I],
        correction_bias [E] float32, shared_gate_up [2Is, H], shared_down
        [H, Is], shared_gate [H]. All but the bias, the scales and the FP8
        weights share one dtype, which must be the layer's (the library
        reports DTYPE_MISMATCH otherwise). With fp8_experts, gate_up and down
        are uint8 e4m3 bytes and gate_up_scale [E, 2I/128, H/128] / down_scale
        [E, H/128, I/128] float32 their block scales. With fp8_shared,
        shared_gate_up and shared_down are uint8 e4m3 bytes and
        shared_gate_up_scale [2Is/128, H/128] / shared_down_scale
        [H/128, Is/128] float32 their block scales. The library decides which
        are required: it rejects a missing one the config needs and one given
        that the config does not use."""
        self._alive()
        H, I, E, Is = self.hidden, self.inter, self.num_experts, self.shared_inter
        shapes = {
            "router": (E, H), "gate_up": (E, 2 * I, H), "down": (E, H, I),
            "shared_gate_up": (2 * Is, H), "shared_down": (H, Is), "shared_gate": (H,),
            "gate_up_scale": (E, 2 * I // 128, H // 128), "down_scale": (E, H // 128, I // 128),
            "shared_gate_up_scale": (2 * Is // 128, H // 128),
            "shared_down_scale": (H // 128, Is // 128),
        }
        given = {"router": router, "gate_up": gate_up, "down": down,
                 "shared_gate_up": shared_gate_up, "shared_down": shared_down,
                 "shared_gate": shared_gate, "gate_up_scale": gate_up_scale,
                 "down_scale": down_scale, "shared_gate_up_scale": shared_gate_up_scale,
                 "shared_down_scale": shared_down_scale}
        w, keep = weights_struct(self.ctx, shapes, given, correction_bias, E, self._cfg.dtype,
                                 self.fp8_experts, self.fp8_shared)
        check(self._lib.moelink_moe_set_weights(self._h, ctypes.byref(w)))
        self._weights = keep

    @property
    def weights(self):
        """The arrays bound by the last successful set_weights (by name)."""
        return dict(self._weights)

    # -- the layer -------------------------------------------------------

    def forward(self, x, out=None, stream=None):
        """out = the layer applied to x. x is [..., H] (any leading dims, T =
        their product) of the layer's dtype; out, if given, has x's shape. Any
        T works (the library chunks over max_tokens). Returns out. On CUDA the
        call is stream-ordered (torch's current stream unless `stream` is given)
        and returns before the device finishes."""
        self._alive()
        bx = _arrays.describe(x, "x")
        self.ctx._check_location(bx, "x")
        _need_code(bx, "x", self.dtype)
        if len(bx.shape) < 2 or bx.shape[-1] != self.hidden:
            raise ValueError("x has shape %s; expected [T, %d] (or [..., %d])" %
                             (list(bx.shape), self.hidden, self.hidden))
        if not bx.contiguous:
            raise ValueError("x is not C-contiguous")
        T = 1
        for s in bx.shape[:-1]:
            T *= s
        if T > 0x7FFFFFFF:
            raise ValueError("x has %d tokens; at most 2^31-1 per call" % T)
        if out is None:
            out = _arrays.empty(bx, bx.shape, self.dtype)
            bo = _arrays.describe(out, "out")
        else:
            bo = self._arg(out, "out", bx.shape, self.dtype, out=True)
        check(self._lib.moelink_moe_forward(self._h, bx.ptr, T, bo.ptr, self.ctx._stream(stream)))
        return out

    __call__ = forward

    def route(self, x, ids=None, weights=None, stream=None):
        """Routing of x [T, H] (T <= max_tokens): returns (ids [T, k] int32,
        weights [T, k] float32), ids in decreasing order of selection score."""
        self._alive()
        bx = self._arg(x, "x", (None, self.hidden), self.dtype)
        T, k = bx.shape[0], self.top_k
        if ids is None:
            ids = _arrays.empty(bx, (T, k), "i32")
        if weights is None:
            weights = _arrays.empty(bx, (T, k), "f32")
        bi = self._arg(ids, "ids", (T, k), "i32", out=True)
        bw = self._arg(weights, "weights", (T, k), "f32", out=True)
        check(self._lib.moelink_moe_route(self._h, bx.ptr, T, bi.ptr, bw.ptr,
                                          self.ctx._stream(stream)))
        return ids, weights

    def plan_size(self, num_tokens):
        """Bytes of a plan buffer for num_tokens tokens of this layer."""
        return int(self._lib.moelink_plan_bytes(int(num_tokens), self.top_k, self.num_experts,
                                                self.tile_rows))

    def plan(self, ids, out=None, stream=None):
        """The plan for ids [T, k] int32 (an id outside [0, E) is an empty slot).
        out, if given, is a contiguous int32 array of at least plan_size(T)/4
        elements in the layer's memory. Returns a Plan."""
        self._alive()
        bi = self._arg(ids, "ids", (None, self.top_k), "i32")
        T = bi.shape[0]
        n = self.plan_size(T) // 4
        if out is None:
            out = _arrays.empty(bi, (n,), "i32")
        bo = _arrays.describe(out, "out")
        self.ctx._check_location(bo, "out")
        if bo.code != "i32" or len(bo.shape) != 1 or bo.shape[0] < n or not bo.contiguous:
            raise ValueError("plan out must be a contiguous 1-D int32 array of >= %d elements, "
                             "got %s %s" % (n, bo.dtype_name, list(bo.shape)))
        check(self._lib.moelink_moe_plan(self._h, bi.ptr, T, bo.ptr, self.ctx._stream(stream)))
        return Plan(out, T, self.top_k, self.num_experts, self.tile_rows)

    def experts(self, x, plan, weights=None, out=None, stream=None):
        """The routed experts in plan order: y [T*k, H] of the layer's dtype, row r
        (r < plan.expert_offsets[E]) = w * expert(x[t]) for the pair it holds;
        later rows are not written. weights [T, k] float32 or None (w = 1)."""
        self._alive()
        bx = self._arg(x, "x", (None, self.hidden), self.dtype)
        T, k = bx.shape[0], self.top_k
        bp = self._plan_arg(plan, T)
        wp = None
        if weights is not None:
            wp = self._arg(weights, "weights", (T, k), "f32").ptr
        if out is None:
            out = _arrays.empty(bx, (T * k, self.hidden), self.dtype)
        by = self._arg(out, "out", (T * k, self.hidden), self.dtype, out=True)
        check(self._lib.moelink_moe_experts(self._h, bx.ptr, T, bp.ptr, wp, by.ptr,
                                            self.ctx._stream(stream)))
        return out

    def combine(self, y, plan, out=None, stream=None):
        """out [T, H] = per token, the sum over its k slots (in slot order) of
        the rows of y [T*k, H] the plan gives them. Returns out."""
        self._alive()
        T = plan.num_tokens if isinstance(plan, Plan) else None
        by = self._arg(y, "y", (None, self.hidden), self.dtype)
        if T is None:
            self._plan_arg(plan, 0)  # raises the TypeError
        if by.shape[0] != T * self.top_k:
            raise ValueError("y has %d rows; the plan has %d tokens * k %d = %d pairs" %
                             (by.shape[0], T, self.top_k, T * self.top_k))
        bp = self._plan_arg(plan, T)
        if out is None:
            out = _arrays.empty(by, (T, self.hidden), self.dtype)
        bo = self._arg(out, "out", (T, self.hidden), self.dtype, out=True)
        check(self._lib.moelink_moe_combine(self._h, by.ptr, T, bp.ptr, bo.ptr,
                                            self.ctx._stream(stream)))
        return out
