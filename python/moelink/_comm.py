"""Communicators, collectives, tensor-parallel GEMMs and the expert-parallel
layer over the C API (the "Communicators" to "Expert parallelism" parts of
include/moelink.h).

Every call here is a collective: each rank makes the same calls in the same
order. Python-side argument checks (ValueError / TypeError) raise before the
C call, so a rank that fails one does not take part and its peers end with
MOELINK_ERR_TIMEOUT; the library's own checks either fail on every rank
alike (sizes against the config) or let the rank take part and report
afterwards (see moelink_alltoallv and moelink_ep_forward).
"""

import ctypes
import os
import weakref

import numpy as np

from . import _arrays
from ._capi import (UNIQUE_ID_BYTES, EpConfig, EpRecv, MoelinkError, Status, TpConfig, UniqueId,
                    check, load)
from ._core import (_DTYPE_CODE, _QUANT, Context, _Closable, _config_dict, _dtype_enum,
                    _need_code, check_arg, moe_config, weights_struct)

_DATA = ("f32", "f16", "bf16")


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _data_buf(ctx, a, name, out=False):
    """A Buf for a collective's data array: ctx's memory, f32/f16/bf16, C layout."""
    b = _arrays.describe(a, name)
    ctx._check_location(b, name)
    if b.code not in _DATA:
        raise TypeError("%s has dtype %s; collectives take f32, f16 or bf16" %
                        (name, b.dtype_name))
    if not b.contiguous:
        raise ValueError("%s is not C-contiguous (moelink reads it in place: pass a contiguous "
                         "array, e.g. .copy() / .contiguous())" % name)
    if out and not b.writeable:
        raise ValueError("%s is read-only" % name)
    return b


def _same_kind(b, ref, name, ref_name):
    """b must hold the same element type as ref (bf16 as uint16 and as
    ml_dtypes.bfloat16 count as one)."""
    if b.code != ref.code:
        raise TypeError("%s has dtype %s but %s has %s" % (name, b.dtype_name, ref_name,
                                                         ref.dtype_name))


def _out_buf(ctx, out, like, shape, name):
    """out (allocated like `like` when None) checked to be `shape` of like's type."""
    if out is None:
        out = _arrays.empty(like, shape, like.code)
    bo = _data_buf(ctx, out, name, out=True)
    _same_kind(bo, like, name, "send")
    if tuple(bo.shape) != tuple(shape):
        raise ValueError("%s has shape %s; expected %s" % (name, list(bo.shape), list(shape)))
    return out, bo


def unique_id(ctx):
    """A new communicator id for ctx's backend, as the hex text
    moelink_unique_id_to_hex writes (what `moelink launch` puts in
    MOELINK_UNIQUE_ID). Rank 0 makes it and hands it to the others."""
    if not isinstance(ctx, Context):
        raise TypeError("ctx must be a moelink.Context, not %s" % type(ctx).__name__)
    ctx._alive()
    lib = load()
    uid = UniqueId()
    check(lib.moelink_get_unique_id(ctx._h, ctypes.byref(uid)))
    buf = ctypes.create_string_buffer(2 * UNIQUE_ID_BYTES + 1)
    check(lib.moelink_unique_id_to_hex(ctypes.byref(uid), buf, len(buf)))
    return buf.value.decode()


class Comm(_Closable):
    """A communicator: one rank of a group of processes (see moelink_comm_t).

    Comm.from_env(ctx) joins the group `moelink launch -n N -- python3 ...`
    started (MOELINK_RANK, MOELINK_WORLD_SIZE, MOELINK_UNIQUE_ID);
    Comm(ctx, rank, size, uid) joins one whose id (unique_id()) was passed
    by other means. Closing is collective: close it (or leave its `with`
    block) on every rank; TP and EP objects made on it are closed first."""

    _what = "communicator"

    def __init__(self, ctx, rank=None, size=None, uid=None, _from_env=False):
        if not isinstance(ctx, Context):
            raise TypeError("ctx must be a moelink.Context, not %s" % type(ctx).__name__)
        ctx._alive()
        self._lib = ctx._lib
        self._h = None
        self.ctx = ctx
        self._objects = weakref.WeakSet()
        h = ctypes.c_void_p()
        if _from_env:
            check(self._lib.moelink_comm_init_from_env(ctx._h, ctypes.byref(h)))
        else:
            if rank is None or size is None or uid is None:
                raise ValueError("Comm(ctx, rank, size, uid) needs all three; use "
                                 "Comm.from_env(ctx) under `moelink launch`")
            ident = UniqueId()
            if isinstance(uid, str):
                check(self._lib.moelink_unique_id_from_hex(uid.encode(), ctypes.byref(ident)))
            elif isinstance(uid, (bytes, bytearray)) and len(uid) == UNIQUE_ID_BYTES:
                ctypes.memmove(ident.bytes, bytes(uid), UNIQUE_ID_BYTES)
            else:
                raise TypeError("uid must be the hex text of unique_id() or %d bytes" %
                                UNIQUE_ID_BYTES)
            check(self._lib.moelink_comm_init(ctx._h, int(rank), int(size), ctypes.byref(ident),
                                              ctypes.byref(h)))
        self._h = h
        self.rank = self._lib.moelink_comm_rank(h)
        self.size = self._lib.moelink_comm_size(h)
        # The context destroys its communicators (and so their TP/EP) before itself.
        ctx._layers.add(self)

    @classmethod
    def from_env(cls, ctx):
        """Joins the communicator `moelink launch` set up for this process."""
        return cls(ctx, _from_env=True)

    @staticmethod
    def in_launch():
        """Whether this process was started by `moelink launch` (its variables are set)."""
        return all(os.environ.get(v) for v in ("MOELINK_RANK", "MOELINK_WORLD_SIZE",
                                               "MOELINK_UNIQUE_ID"))

    # -- lifetime --------------------------------------------------------

    def close(self):
        """Destroys the TP and EP objects made on it, then leaves the group
        (collective: every rank closes, in the same order)."""
        if self._h is None:
            return
        for obj in list(self._objects):
            obj.close()
        _sync(self.ctx)
        h, self._h = self._h, None
        check(self._lib.moelink_comm_destroy(h))

    def __repr__(self):
        return "<moelink.Comm rank %d of %d%s>" % (self.rank, self.size,
                                                   "" if self._h is not None else " closed")

    def check(self, stream=None):
        """Waits for this communicator's work queued on `stream` (the host
        synchronizes) and raises MoelinkError for a device-side wait that timed
        out (TIMEOUT) or an alltoallv overflow found on the device."""
        self._alive()
        check(self._lib.moelink_comm_check(self._h, self.ctx._stream(stream)))

    # -- collectives (sum) -------------------------------------------------

    def allreduce(self, send, out=None, stream=None):
        """out = the elementwise sum of every rank's `send` (same shape; fp32
        accumulation). out may be send itself (in place). Returns out."""
        self._alive()
        bs = _data_buf(self.ctx, send, "send")
        out, bo = _out_buf(self.ctx, out, bs, bs.shape, "out")
        check(self._lib.moelink_allreduce(self._h, bs.ptr, bo.ptr, _numel(bs.shape),
                                          _dtype_enum(bs.code), self.ctx._stream(stream)))
        return out

    def allgather(self, send, out=None, stream=None):
        """out = every rank's `send` concatenated along the first axis in rank
        order: send [n, ...] gives out [size * n, ...]. Returns out."""
        self._alive()
        bs = _data_buf(self.ctx, send, "send")
        if len(bs.shape) < 1:
            raise ValueError("send must have at least one dimension")
        shape = (self.size * bs.shape[0],) + tuple(bs.shape[1:])
        out, bo = _out_buf(self.ctx, out, bs, shape, "out")
        check(self._lib.moelink_allgather(self._h, bs.ptr, bo.ptr, _numel(bs.shape),
                                          _dtype_enum(bs.code), self.ctx._stream(stream)))
        return out

    def reduce_scatter(self, send, out=None, stream=None):
        """out = this rank's block of the sum over ranks: send [size * n, ...]
        (the first axis a multiple of size) gives out [n, ...], rows
        rank*n .. rank*n + n - 1 of the sum. Returns out."""
        self._alive()
        bs = _data_buf(self.ctx, send, "send")
        if len(bs.shape) < 1 or bs.shape[0] % self.size:
            raise ValueError("send has shape %s; its first axis must be a multiple of the %d "
                             "ranks" % (list(bs.shape), self.size))
        shape = (bs.shape[0] // self.size,) + tuple(bs.shape[1:])
        out, bo = _out_buf(self.ctx, out, bs, shape, "out")
        check(self._lib.moelink_reduce_scatter(self._h, bs.ptr, bo.ptr, _numel(shape),
                                               _dtype_enum(bs.code), self.ctx._stream(stream)))
        return out

    def alltoallv(self, send, send_counts, recv_capacity=None, recv=None, recv_counts=None,
                  send_offsets=None, recv_offsets=None, stream=None):
        """All-to-all with per-peer element counts (a bitwise copy).

        send is 1-D (f32/f16/bf16); send_counts [size] int64: elements for
        each rank, packed in rank order unless send_offsets [size] int64 says
        where each range starts. recv is 1-D of recv_capacity elements
        (allocated when None). Returns (recv, recv_counts): recv_counts [size]
        int64 are the elements that came from each rank, packed in source
        rank order from recv[0]; recv_offsets [size] int64, if given, is
        filled with their starts. On CUDA the count and offset arrays are
        int64 tensors on the device (read and written on the stream; the host
        never waits); on the CPU numpy arrays.

        Elements past recv_capacity are dropped: on the CPU this call raises
        MoelinkError (INVALID_ARGUMENT) after the exchange, on CUDA the next
        check() does; pass recv_counts to read the full counts then."""
        self._alive()
        ctx, P = self.ctx, self.size
        bs = _data_buf(ctx, send, "send")
        if len(bs.shape) != 1:
            raise ValueError("send has shape %s; alltoallv takes 1-D arrays (reshape(-1) a "
                             "contiguous one)" % list(bs.shape))
        bc = check_arg(ctx, send_counts, "send_counts", (P,), "i64")
        bso = None
        if send_offsets is not None:
            bso = check_arg(ctx, send_offsets, "send_offsets", (P,), "i64")
        if recv is None:
            if recv_capacity is None:
                raise ValueError("alltoallv needs recv_capacity or recv")
            if int(recv_capacity) < 0:
                raise ValueError("recv_capacity %d < 0" % int(recv_capacity))
            recv = _arrays.empty(bs, (int(recv_capacity),), bs.code)
        br = _data_buf(ctx, recv, "recv", out=True)
        _same_kind(br, bs, "recv", "send")
        if len(br.shape) != 1:
            raise ValueError("recv has shape %s; alltoallv takes 1-D arrays" % list(br.shape))
        cap = br.shape[0]
        if recv_capacity is not None and int(recv_capacity) != cap:
            raise ValueError("recv holds %d elements but recv_capacity is %d" %
                             (cap, int(recv_capacity)))
        if recv_counts is None:
            recv_counts = _arrays.empty(bc, (P,), "i64")
        brc = check_arg(ctx, recv_counts, "recv_counts", (P,), "i64", out=True)
        bro = None
        if recv_offsets is not None:
            bro = check_arg(ctx, recv_offsets, "recv_offsets", (P,), "i64", out=True)
        if ctx.backend == "cpu":
            # Host counts: the ranges must lie inside send, which only Python
            # knows the length of (negative counts are the library's to report).
            counts = np.asarray(send_counts)
            if bso is not None:
                starts = np.asarray(send_offsets)
            else:
                starts = np.concatenate(([0], np.cumsum(np.maximum(counts, 0))[:-1]))
            live = counts > 0
            if np.any(live & ((starts < 0) | (starts + counts > bs.shape[0]))):
                p = int(np.argmax(live & ((starts < 0) | (starts + counts > bs.shape[0]))))
                raise ValueError("send range for rank %d (offset %d, count %d) is outside send "
                                 "(%d elements)" % (p, starts[p], counts[p], bs.shape[0]))
        check(self._lib.moelink_alltoallv(
            self._h, bs.ptr, bc.ptr, bso.ptr if bso is not None else None,
            br.ptr if cap else None, cap, brc.ptr, bro.ptr if bro is not None else None,
            _dtype_enum(bs.code), ctx._stream(stream)))
        return recv, recv_counts


def _sync(ctx):
    """On CUDA, waits for the device: queued work may still use what is freed."""
    if ctx._h is not None and ctx.backend == "cuda":
        torch = _arrays._torch()
        if torch is not None:
            torch.cuda.synchronize(ctx.device)


class _OnComm(_Closable):
    """Lifetime of an object made on a communicator (collective destroy)."""

    _destroy = None

    def _attach(self, comm):
        if not isinstance(comm, Comm):
            raise TypeError("comm must be a moelink.Comm, not %s" % type(comm).__name__)
        comm._alive()
        self.comm = comm
        self.ctx = comm.ctx
        self._lib = comm._lib
        self._h = None

    def close(self):
        """Frees it (collective: every rank closes it, in the same order). On
        CUDA, waits for the device first."""
        if getattr(self, "_h", None) is None:
            return
        _sync(self.ctx)
        h, self._h = self._h, None
        self._keep = {}
        check(getattr(self._lib, self._destroy)(h))


class TP(_OnComm):
    """The fused tensor-parallel GEMMs (moelink_tp_t) of one dtype:
    TP(comm, "f32", max_m, max_n, max_k). F32 runs on the CPU backend only.
    max_m bounds all ranks' rows together, max_k the k a call passes (the full
    k for ag_gemm, this rank's slice for gemm_rs / gemm_ar). b is a linear
    layer's weight [n, k]: C = A b^T. The GEMM accumulates in fp32 and rounds
    each rank's partial to the dtype; partials are summed in rank order in
    fp32 and rounded once, so every rank gets bitwise the same result."""

    _destroy = "moelink_tp_destroy"
    _what = "TP"

    def __init__(self, comm, dtype, max_m, max_n, max_k, comm_ctas=0):
        self._attach(comm)
        self._keep = {}
        c = TpConfig.init()
        c.dtype = _dtype_enum(dtype)
        c.max_m, c.max_n, c.max_k = int(max_m), int(max_n), int(max_k)
        c.comm_ctas = int(comm_ctas)
        h = ctypes.c_void_p()
        check(self._lib.moelink_tp_create(comm._h, ctypes.byref(c), ctypes.byref(h)))
        self._h = h
        self._cfg = c
        self.dtype = _DTYPE_CODE[c.dtype]
        self.max_m, self.max_n, self.max_k = c.max_m, c.max_n, c.max_k
        comm._objects.add(self)


    def __repr__(self):
        return "<moelink.TP %s max m %d n %d k %d%s>" % (
            self.dtype, self.max_m, self.max_n, self.max_k,
            "" if self._h is not None else " closed")

    def workspace_size(self):
        """Bytes of workspace (per rank) this object allocated."""
        n = ctypes.c_size_t()
        check(self._lib.moelink_tp_workspace_size(self.comm._h, ctypes.byref(self._cfg),
                                                  ctypes.byref(n)))
        return n.value

    def _ab(self, a, b):
        ba = check_arg(self.ctx, a, "a", (None, None), self.dtype)
        k = ba.shape[1]
        bb = check_arg(self.ctx, b, "b", (None, k), self.dtype)
        return ba, bb, bb.shape[0], k

    def _run(self, fn, ba, bb, out, c_shape, m, n, k, stream):
        if out is None:
            out = _arrays.empty(ba, c_shape, self.dtype)
        bo = check_arg(self.ctx, out, "out", c_shape, self.dtype, out=True)
        check(getattr(self._lib, fn)(self._h, ba.ptr, bb.ptr, bo.ptr, m, n, k,
                                     self.ctx._stream(stream)))
        return out

    def ag_gemm(self, a, b, out=None, stream=None):
        """All-gather + GEMM (column-parallel): a [m / size, k] is this rank's
        rows, b [n, k]; returns out [m, n] = (all ranks' rows in rank order) b^T."""
        self._alive()
        ba, bb, n, k = self._ab(a, b)
        m = ba.shape[0] * self.comm.size
        return self._run("moelink_ag_gemm", ba, bb, out, (m, n), m, n, k, stream)

    def gemm_rs(self, a, b, out=None, stream=None):
        """GEMM + reduce-scatter (row-parallel): a [m, k] and b [n, k] are this
        rank's slices of the reduction dimension, m a multiple of size; returns
        out [m / size, n] = this rank's rows of the sum over ranks of a b^T."""
        self._alive()
        ba, bb, n, k = self._ab(a, b)
        m = ba.shape[0]
        if m % self.comm.size:
            raise ValueError("a has %d rows; gemm_rs needs a multiple of the %d ranks" %
                             (m, self.comm.size))
        return self._run("moelink_gemm_rs", ba, bb, out, (m // self.comm.size, n), m, n, k,
                         stream)

    def gemm_ar(self, a, b, out=None, stream=None):
        """GEMM + all-reduce: a [m, k], b [n, k] as in gemm_rs; returns out
        [m, n] = the sum over ranks of a b^T, the same on every rank."""
        self._alive()
        ba, bb, n, k = self._ab(a, b)
        m = ba.shape[0]
        return self._run("moelink_gemm_ar", ba, bb, out, (m, n), m, n, k, stream)


class EP(_OnComm):
    """An expert-parallel MoE layer (moelink_ep_t) over a communicator.

    EP(comm, preset=None, hidden=..., inter=..., experts=..., top_k=..., ...,
    dtype="bf16", max_tokens=1024, recv_capacity=0, dispatch_quant="none",
    call_tokens=0) takes the keywords of
    moelink.MoE (the whole layer: experts counts all ranks' experts, a
    multiple of the rank count; fp8_shared is not supported, the library
    refuses it with ERR_UNSUPPORTED). Rank r owns experts first_expert ..
    first_expert + local_experts - 1. forward() on every rank gives what
    MoE.forward gives on all ranks' tokens concatenated in rank order.
    dispatch_quant "fp8" or "mxfp8" sends the token rows to the experts'
    ranks as E4M3 with block scales (the routed experts then compute on the
    dequantized rows; hidden a multiple of 128 or 32). call_tokens bounds the
    tokens one forward() takes on a CUDA rank (0: max_tokens; each call runs
    ceil(call_tokens / max_tokens) steps); CPU ranks take any count."""

    _destroy = "moelink_ep_destroy"
    _what = "EP layer"

    def __init__(self, comm, preset=None, *, recv_capacity=0, dtype="bf16", max_tokens=1024,
                 dispatch_quant="none", call_tokens=0, **fields):
        if dispatch_quant not in _QUANT:
            raise ValueError("dispatch_quant: expected none, fp8 or mxfp8, got %r"
                             % (dispatch_quant,))
        self._attach(comm)
        self._keep = {}
        c = EpConfig.init()
        c.moe = moe_config(preset, dtype=dtype, max_tokens=max_tokens, **fields)
        c.recv_capacity = int(recv_capacity)
        c.dispatch_quant = _QUANT[dispatch_quant]
        c.call_tokens = int(call_tokens)
        h = ctypes.c_void_p()
        check(self._lib.moelink_ep_create(comm._h, ctypes.byref(c), ctypes.byref(h)))
        self._h = h
        got = EpConfig.init()
        first, local = ctypes.c_int(), ctypes.c_int()
        check(self._lib.moelink_ep_get_config(h, ctypes.byref(got), ctypes.byref(first),
                                              ctypes.byref(local)))
        self._cfg = got
        self.config = _config_dict(got.moe)
        self.recv_capacity = got.recv_capacity
        self.call_tokens = got.call_tokens
        self.first_expert = first.value
        self.local_experts = local.value
        m = got.moe
        self.hidden, self.inter, self.num_experts = m.hidden, m.inter, m.num_experts
        self.top_k, self.shared_inter, self.max_tokens = m.top_k, m.shared_inter, m.max_tokens
        self.dtype = _DTYPE_CODE[m.dtype]
        self.dispatch_quant = dispatch_quant
        comm._objects.add(self)


    def __repr__(self):
        c = self.config
        return ("<moelink.EP H=%d I=%d E=%d (%d..%d here) k=%d %s%s>" %
                (c["hidden"], c["inter"], c["num_experts"], self.first_expert,
                 self.first_expert + self.local_experts - 1, c["top_k"], c["dtype"],
                 "" if self._h is not None else " closed"))

    def workspace_size(self):
        """Bytes this rank allocated for the layer at create."""
        n = ctypes.c_size_t()
        check(self._lib.moelink_ep_workspace_size(self.comm._h, ctypes.byref(self._cfg),
                                                  ctypes.byref(n)))
        return n.value

    def set_weights(self, router, gate_up, down, correction_bias=None, shared_gate_up=None,
                    shared_down=None, shared_gate=None, gate_up_scale=None, down_scale=None):
        """Binds this rank's weights without copying (not collective). router
        [E, H], correction_bias [E] float32 and the shared expert's arrays are
        the whole layer's; gate_up [El, 2I, H] and down [El, H, I] hold only
        this rank's experts (full[first_expert:first_expert + El], made
        contiguous), and with fp8_experts their scales likewise
        (gate_up_scale [El, 2I/128, H/128], down_scale [El, H/128, I/128])."""
        self._alive()
        H, I, E, Is, El = (self.hidden, self.inter, self.num_experts, self.shared_inter,
                           self.local_experts)
        shapes = {
            "router": (E, H), "gate_up": (El, 2 * I, H), "down": (El, H, I),
            "shared_gate_up": (2 * Is, H), "shared_down": (H, Is), "shared_gate": (H,),
            "gate_up_scale": (El, 2 * I // 128, H // 128),
            "down_scale": (El, H // 128, I // 128),
        }
        given = {"router": router, "gate_up": gate_up, "down": down,
                 "shared_gate_up": shared_gate_up, "shared_down": shared_down,
                 "shared_gate": shared_gate, "gate_up_scale": gate_up_scale,
                 "down_scale": down_scale}
        w, keep = weights_struct(self.ctx, shapes, given, correction_bias, E, self._cfg.moe.dtype,
                                 bool(self._cfg.moe.fp8_experts))
        check(self._lib.moelink_ep_set_weights(self._h, ctypes.byref(w)))
        self._keep = keep

    @property
    def weights(self):
        """The arrays bound by the last successful set_weights (by name)."""
        return dict(self._keep)

    def forward(self, x, out=None, stream=None):
        """out [..., H] for this rank's tokens x [..., H] (any count, 0
        included; collective: every rank calls it the same number of times).
        Returns out."""
        self._alive()
        bx = _arrays.describe(x, "x")
        self.ctx._check_location(bx, "x")
        _need_code(bx, "x", self.dtype)
        if len(bx.shape) < 2 or bx.shape[-1] != self.hidden:
            raise ValueError("x has shape %s; expected [T, %d] (or [..., %d])" %
                             (list(bx.shape), self.hidden, self.hidden))
        if not bx.contiguous:
            raise ValueError("x is not C-contiguous")
        T = _numel(bx.shape[:-1])
        if T > 0x7FFFFFFF:
            raise ValueError("x has %d tokens; at most 2^31-1 per call" % T)
        if out is None:
            out = _arrays.empty(bx, bx.shape, self.dtype)
        bo = check_arg(self.ctx, out, "out", bx.shape, self.dtype, out=True)
        check(self._lib.moelink_ep_forward(self._h, bx.ptr if T else None, T,
                                           bo.ptr if T else None, self.ctx._stream(stream)))
        return out

    __call__ = forward

    def _routing(self, ids, weights, T):
        bi = check_arg(self.ctx, ids, "ids", (T, self.top_k), "i32")
        bw = check_arg(self.ctx, weights, "weights", (T, self.top_k), "f32")
        return bi, bw

    def _dispatched(self, status, rv, T):
        """After a dispatch call: a bad argument of this rank's still took part
        (the library then expects a combine), any other failure did not."""
        try:
            check(status)
        except MoelinkError as e:
            if e.status == Status.ERR_INVALID_ARGUMENT:
                self._pending = 0
            raise
        return self._received(rv, T)

    def _received(self, rv, T):
        r = Received()
        r.num_tokens = T
        r.capacity, r.top_k = rv.capacity, rv.top_k
        dev = ("cpu", 0) if self.ctx.backend == "cpu" else ("cuda", self.ctx.device)
        r.rows = _arrays.view(rv.rows, (rv.capacity, self.hidden), self.dtype, dev)
        r.expert_ids = _arrays.view(rv.expert_ids, (rv.capacity, rv.top_k), "i32", dev)
        r.weights = _arrays.view(rv.weights, (rv.capacity, rv.top_k), "f32", dev)
        self._pending = T
        return r

    def dispatch(self, x, ids, weights, stream=None):
        """Sends this rank's tokens x [T, H] by their routing (ids [T, k] int32
        global expert ids, weights [T, k] float32, e.g. from MoE.route) to the
        ranks that own their experts (moelink_ep_dispatch; collective, and
        combine() must follow). Returns a Received: the rows this rank's
        experts must process, as views of the layer's memory valid until
        combine() returns."""
        self._alive()
        bx = check_arg(self.ctx, x, "x", (None, self.hidden), self.dtype)
        T = bx.shape[0]
        bi, bw = self._routing(ids, weights, T)
        rv = EpRecv.init()
        st = self._lib.moelink_ep_dispatch(self._h, bx.ptr if T else None, bi.ptr if T else None,
                                           bw.ptr if T else None, T, ctypes.byref(rv),
                                           self.ctx._stream(stream))
        return self._dispatched(st, rv, T)

    def dispatch_quantized(self, q, scales, ids, weights, stream=None):
        """dispatch() of rows already quantized with Context.quantize in the
        layer's dispatch_quant format (q [T, H] uint8, scales as quantize
        returns them): the same rows arrive."""
        self._alive()
        if self.dispatch_quant == "none":
            raise ValueError("dispatch_quantized: this layer's rows travel unquantized "
                             "(create it with dispatch_quant='fp8' or 'mxfp8')")
        bq = check_arg(self.ctx, q, "q", (None, self.hidden), "u8")
        T = bq.shape[0]
        block, code = (128, "f32") if self.dispatch_quant == "fp8" else (32, "u8")
        bs = check_arg(self.ctx, scales, "scales", (T, self.hidden // block), code)
        bi, bw = self._routing(ids, weights, T)
        rv = EpRecv.init()
        st = self._lib.moelink_ep_dispatch_quantized(
            self._h, bq.ptr if T else None, bs.ptr if T else None, bi.ptr if T else None,
            bw.ptr if T else None, T, ctypes.byref(rv), self.ctx._stream(stream))
        return self._dispatched(st, rv, T)

    def combine(self, y, pair_rows=None, out=None, stream=None):
        """Sends this rank's expert outputs back and sums each of its own tokens'
        k contributions in slot order (moelink_ep_combine; collective, after
        dispatch()). y [rows, H]: the (already weighted) output of received row
        r's local slot q at row pair_rows[r * top_k + q] (pair_rows None: row
        r * top_k + q), e.g. MoE.experts' output and its plan's pair_rows.
        Returns out [T, H] for the T tokens of the dispatch."""
        self._alive()
        T = getattr(self, "_pending", None)
        if T is None:
            raise ValueError("combine() without a dispatch() before it")
        by = check_arg(self.ctx, y, "y", (None, self.hidden), self.dtype)
        bp = None
        if pair_rows is not None:
            bp = check_arg(self.ctx, pair_rows, "pair_rows", (None,), "i32")
        if out is None:
            out = _arrays.empty(by, (T, self.hidden), self.dtype)
        bo = check_arg(self.ctx, out, "out", (T, self.hidden), self.dtype, out=True)
        self._pending = None
        check(self._lib.moelink_ep_combine(self._h, by.ptr, bp.ptr if bp else None,
                                           bo.ptr if T else None, self.ctx._stream(stream)))
        return out


class Received:
    """What EP.dispatch delivered to this rank: capacity rows, each with top_k
    local slots; expert_ids [capacity, top_k] int32 (local ids, -1: empty;
    a row with no id >= 0 holds no token), weights [capacity, top_k] float32,
    rows [capacity, H]. Views of the layer's memory, valid until combine()
    returns."""

    __slots__ = ("num_tokens", "capacity", "top_k", "rows", "expert_ids", "weights")
