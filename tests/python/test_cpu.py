#!/usr/bin/env python3
"""The Python binding on the CPU backend, with numpy, against an independent
float64 numpy implementation of the layer.

Plain script: python3 tests/python/test_cpu.py [name-substring ...]
Needs numpy, the package on PYTHONPATH (python/) and the library (found as the
binding finds it; CTest sets MOELINK_LIBRARY). Exits non-zero on a failure;
the last line is 'N passed, N failed, N skipped'.
"""

import ctypes
import gc
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import moelink  # noqa: E402
from moelink import Status  # noqa: E402
from harness import Skip, expect_moelink_error, expect_raises, run, summary, test  # noqa: E402



# ---------------------------------------------------------------------------
# Reference: float64 numpy, written from the header's description of the layer
# ---------------------------------------------------------------------------

def softmax(z, axis=-1):
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def silu(z):
    return z * sigmoid(z)


def ref_route(cfg, x, wr, bias):
    """(ids [T,k], weights [T,k], margin [T], sel [T,E]): margin is how far
    each token's selection is from a tie (selection-score units); near-ties
    may go either way in fp32 and are left out of comparisons. sel holds the
    selection scores (bias added, masked groups -inf)."""
    T = x.shape[0]
    E, k = cfg["experts"], cfg["top_k"]
    router = cfg.get("router", "softmax")
    logits = x @ wr.T
    if router == "softmax":
        scores = softmax(logits)
    elif router == "sigmoid":
        scores = sigmoid(logits)
    else:
        scores = logits
    sel = scores + bias[None, :] if bias is not None else scores.copy()
    margin = np.full(T, np.inf)
    ng, tg = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    if ng > 1:
        gs = E // ng
        top = -np.sort(-sel.reshape(T, ng, gs), axis=-1)[:, :, :min(2, gs)].sum(-1)
        gorder = np.argsort(-top, axis=1, kind="stable")
        keep = np.zeros((T, ng), bool)
        keep[np.arange(T)[:, None], gorder[:, :tg]] = True
        if tg < ng:
            rows = np.arange(T)
            margin = np.minimum(margin, top[rows, gorder[:, tg - 1]] - top[rows, gorder[:, tg]])
        sel = np.where(np.repeat(keep, gs, axis=1), sel, -np.inf)
    order = np.argsort(-sel, axis=1, kind="stable")
    ids = order[:, :k]
    if k < E:
        rows = np.arange(T)
        nxt = sel[rows, order[:, k]]
        gap = sel[rows, order[:, k - 1]] - nxt
        margin = np.minimum(margin, np.where(np.isfinite(nxt), gap, np.inf))
    # ties inside the top k change the order of ids, not the output
    if router == "topk_softmax":
        w = softmax(np.take_along_axis(logits, ids, 1))
    else:
        w = np.take_along_axis(scores, ids, 1)
        if cfg.get("renormalize", True):
            w = w / w.sum(1, keepdims=True)
    w = w * cfg.get("routed_scaling", 1.0)
    return ids, w, margin, sel


def ref_experts_out(cfg, x, W, ids, w):
    """sum over slots of w * expert(x); ids < 0 are empty slots."""
    I = cfg["inter"]
    out = np.zeros((x.shape[0], cfg["hidden"]))
    for e in range(cfg["experts"]):
        t, j = np.nonzero(ids == e)
        if t.size == 0:
            continue
        gu = x[t] @ W["gate_up"][e].T
        h = silu(gu[:, :I]) * gu[:, I:]
        y = h @ W["down"][e].T
        np.add.at(out, t, w[t, j][:, None] * y)
    return out


def ref_shared(cfg, x, W):
    Is = cfg.get("shared_inter", 0)
    if not Is:
        return 0.0
    gu = x @ W["shared_gate_up"].T
    y = (silu(gu[:, :Is]) * gu[:, Is:]) @ W["shared_down"].T
    if cfg.get("shared_gate", False):
        y = y * sigmoid(x @ W["shared_gate"])[:, None]
    return y


def ref_forward(cfg, x, W):
    ids, w, margin, _ = ref_route(cfg, x, W["router"], W.get("correction_bias"))
    return ref_experts_out(cfg, x, W, ids, w) + ref_shared(cfg, x, W), ids, w, margin


# ---------------------------------------------------------------------------
# Test data
# ---------------------------------------------------------------------------

NP_DTYPE = {"f32": np.float32, "f16": np.float16}


def quantize(a, dtype):
    """(array for C, float64 values it holds)."""
    if dtype == "bf16":
        bits = moelink.to_bf16(a)
        return bits, moelink.from_bf16(bits).astype(np.float64)
    q = np.ascontiguousarray(a, dtype=NP_DTYPE[dtype])
    return q, q.astype(np.float64)


def make_weights(cfg, dtype, rng):
    H, I, E = cfg["hidden"], cfg["inter"], cfg["experts"]
    Is = cfg.get("shared_inter", 0)

    def u(shape, a):
        return rng.uniform(-a, a, size=shape)

    raw = {
        "router": u((E, H), 4.5 / np.sqrt(H)),
        "gate_up": u((E, 2 * I, H), np.sqrt(3.0 / H)),
        "down": u((E, H, I), np.sqrt(3.0 / I)),
    }
    if Is:
        raw["shared_gate_up"] = u((2 * Is, H), np.sqrt(3.0 / H))
        raw["shared_down"] = u((H, Is), np.sqrt(3.0 / Is))
    if cfg.get("shared_gate"):
        raw["shared_gate"] = u((H,), 2.0 / np.sqrt(H))
    c_arrays, ref = {}, {}
    for name, a in raw.items():
        c_arrays[name], ref[name] = quantize(a, dtype)
    if cfg.get("correction_bias"):
        b = rng.uniform(-0.1, 0.1, size=E).astype(np.float32)
        c_arrays["correction_bias"] = b
        ref["correction_bias"] = b.astype(np.float64)
    return c_arrays, ref


def make_x(cfg, T, dtype, rng):
    return quantize(rng.uniform(-1.0, 1.0, size=(T, cfg["hidden"])), dtype)


def layer(ctx, cfg, dtype, max_tokens=256):
    kw = {k: v for k, v in cfg.items() if k != "name"}
    return moelink.MoE(ctx, dtype=dtype, max_tokens=max_tokens, **kw)


def as_f64(a):
    if a.dtype == np.uint16 or (moelink.BF16_NUMPY is not None and a.dtype == moelink.BF16_NUMPY):
        return moelink.from_bf16(a).astype(np.float64)
    return a.astype(np.float64)


def rel_l2(a, b):
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (den if den > 0 else 1.0)


TIE_EPS = 1e-5
TOL = {"f32": 1e-4, "f16": 1e-2, "bf16": 1e-2}

CASES = [
    dict(name="mixtral-like", hidden=64, inter=32, experts=8, top_k=2, router="softmax",
         renormalize=True),
    dict(name="qwen2-like", hidden=48, inter=24, experts=12, top_k=4, router="softmax",
         renormalize=False, shared_inter=40, shared_gate=True),
    dict(name="deepseek-like", hidden=64, inter=40, experts=16, top_k=4, router="sigmoid",
         renormalize=True, n_group=4, topk_group=2, routed_scaling=2.5, correction_bias=True,
         shared_inter=32),
    dict(name="gpt-oss-like", hidden=32, inter=48, experts=10, top_k=3, router="topk_softmax",
         renormalize=True, correction_bias=True),
    dict(name="softmax-groups", hidden=40, inter=16, experts=12, top_k=3, router="softmax",
         renormalize=True, n_group=3, topk_group=2, routed_scaling=1.5),
    dict(name="sigmoid-k-eq-E", hidden=16, inter=8, experts=4, top_k=4, router="sigmoid",
         renormalize=False, shared_inter=8, shared_gate=True),
]


def check_forward(ctx, cfg, dtype, T, seed, max_tokens=256):
    rng = np.random.default_rng(seed)
    cw, rw = make_weights(cfg, dtype, rng)
    xc, xr = make_x(cfg, T, dtype, rng)
    with layer(ctx, cfg, dtype, max_tokens) as moe:
        moe.set_weights(**cw)
        out = moe.forward(xc)
        assert out.shape == xc.shape and out.dtype == xc.dtype, (out.shape, out.dtype)
        ref, ids, w, margin = ref_forward(cfg, xr, rw)
        ok = margin > TIE_EPS
        assert ok.mean() >= 0.9, "too many near-ties (%d of %d)" % ((~ok).sum(), T)
        err = rel_l2(as_f64(out)[ok], ref[ok])
        assert err <= TOL[dtype], "%s %s T=%d: rel L2 %.3g > %g" % (cfg["name"], dtype, T, err,
                                                                   TOL[dtype])
        return err


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

@test
def test_version_and_library():
    v = moelink.version()
    parts = v.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts), v
    code = moelink.version_code()
    assert code == int(parts[0]) * 10000 + int(parts[1]) * 100 + int(parts[2]), (v, code)
    assert tuple(int(p) for p in parts[:2]) == moelink.HEADER_VERSION[:2], v
    path = moelink.library_path()
    assert path, path
    if os.environ.get("MOELINK_LIBRARY"):
        assert path == os.environ["MOELINK_LIBRARY"], path


@test
def test_struct_sizes():
    C = ctypes.sizeof
    if C(ctypes.c_void_p) == 8 and C(ctypes.c_size_t) == 8:
        # LP64: what gcc lays out for the header's structs
        assert C(moelink.ContextConfig) == 24, C(moelink.ContextConfig)
        assert C(moelink.MoeConfig) == 72, C(moelink.MoeConfig)
        assert C(moelink.MoeWeights) == 104, C(moelink.MoeWeights)
        assert C(moelink.PlanStruct) == 64, C(moelink.PlanStruct)
    lib = moelink.load()
    # The library checks the size field of each config struct against its own sizeof.
    cfg = moelink.ContextConfig.init()
    h = ctypes.c_void_p()
    moelink._capi.check(lib.moelink_context_create(ctypes.byref(cfg), ctypes.byref(h)))
    moelink._capi.check(lib.moelink_context_destroy(h))
    cfg.size += 8
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "context config size",
                         lambda: moelink._capi.check(
                             lib.moelink_context_create(ctypes.byref(cfg), ctypes.byref(h))))
    mc = moelink.MoeConfig.init()
    mc.hidden, mc.inter, mc.num_experts, mc.top_k = 8, 8, 4, 2
    moelink._capi.check(lib.moelink_moe_config_check(ctypes.byref(mc)))
    mc.size -= 4
    expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "config size",
                         lambda: moelink._capi.check(lib.moelink_moe_config_check(
                             ctypes.byref(mc))))
    with moelink.Context("cpu") as ctx, \
            moelink.MoE(ctx, hidden=8, inter=8, experts=4, top_k=2, dtype="f32") as moe:
        rng = np.random.default_rng(0)
        cw, _ = make_weights(dict(hidden=8, inter=8, experts=4), "f32", rng)
        moe.set_weights(**cw)  # MoeWeights.size accepted
        w = moelink.MoeWeights.init()
        w.size = C(moelink.MoeWeights) + 8
        w.dtype = moelink.Dtype.F32
        w.router, w.gate_up, w.down = (cw[n].ctypes.data for n in ("router", "gate_up", "down"))
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "weights size",
                             lambda: moelink._capi.check(lib.moelink_moe_set_weights(
                                 moe.handle, ctypes.byref(w))))
        w.size = C(moelink.MoeWeights)
        moelink._capi.check(lib.moelink_moe_set_weights(moe.handle, ctypes.byref(w)))
    # moelink_plan_t has no size field: check where plan_view puts each array.
    T, k, E, tr = 5, 3, 7, 4
    nbytes = lib.moelink_plan_bytes(T, k, E, tr)
    P, max_tiles = T * k, -(-T * k // tr) + E
    assert nbytes == 4 * ((E + 1) + 2 * P + 3 * max_tiles + 1), nbytes
    buf = np.zeros(nbytes // 4, np.int32)
    base = buf.ctypes.data
    view = moelink.PlanStruct()
    moelink._capi.check(lib.moelink_plan_view(base, T, k, E, tr, ctypes.byref(view)))
    assert (view.num_tokens, view.top_k, view.num_experts, view.tile_rows,
            view.max_tiles) == (T, k, E, tr, max_tiles)
    a = moelink._capi.address_of
    assert a(view.expert_offsets) == base
    assert a(view.sorted_pairs) == base + 4 * (E + 1)
    assert a(view.pair_rows) == base + 4 * (E + 1 + P)
    assert a(view.tiles) == base + 4 * (E + 1 + 2 * P)
    assert a(view.num_tiles) == base + nbytes - 4


@test
def test_config_field_order():
    d = moelink.preset_config("deepseek-v3")
    assert d == dict(hidden=7168, inter=2048, num_experts=256, top_k=8, router="sigmoid",
                     renormalize=True, n_group=8, topk_group=4, routed_scaling=2.5,
                     correction_bias=True, shared_inter=2048, shared_gate=False, dtype="bf16",
                     max_tokens=1024, fp8_experts=False, fp8_shared=False), d
    q = moelink.preset_config("qwen2-57b-a14b")
    assert (q["hidden"], q["inter"], q["num_experts"], q["top_k"], q["renormalize"],
            q["shared_inter"], q["shared_gate"]) == (3584, 2560, 64, 8, False, 20480, True), q
    with moelink.Context("cpu") as ctx:
        kw = dict(hidden=40, inter=24, experts=12, top_k=3, router="sigmoid", renormalize=False,
                  n_group=4, topk_group=2, routed_scaling=1.5, correction_bias=True,
                  shared_inter=16, shared_gate=True)
        moe = moelink.MoE(ctx, dtype="f16", max_tokens=77, **kw)
        want = dict(kw, dtype="f16", max_tokens=77, fp8_experts=False, fp8_shared=False)
        want["num_experts"] = want.pop("experts")
        assert moe.config == want, moe.config
        assert moe.flops(10) > 0
        assert moe.workspace_size() > 0
        assert moe.tile_rows >= 1
        # a preset with an override
        m2 = moelink.MoE(ctx, "mixtral-8x7b", hidden=64, inter=32, dtype="f32", max_tokens=8)
        assert (m2.hidden, m2.inter, m2.num_experts, m2.top_k) == (64, 32, 8, 2), m2.config


@test
def test_presets():
    names = moelink.presets()
    for n in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"):
        assert n in names, names
    for n in names:
        c = moelink.preset_config(n)
        assert c["hidden"] > 0 and c["top_k"] <= c["num_experts"], (n, c)
    m = moelink.preset_config("mixtral-8x7b")
    assert (m["hidden"], m["inter"], m["num_experts"], m["top_k"]) == (4096, 14336, 8, 2), m
    expect_moelink_error(Status.ERR_NOT_FOUND, "unknown preset 'nope'",
                         moelink.preset_config, "nope")
    assert moelink.dtype_size("bf16") == 2 and moelink.dtype_size("f32") == 4
    assert moelink.backend_available("cpu") is True


def _forward_test(dtype):
    with moelink.Context("cpu") as ctx:
        for i, cfg in enumerate(CASES):
            for T in (1, 37):
                check_forward(ctx, cfg, dtype, T, seed=100 * i + T)


@test
def test_forward_f32():
    _forward_test("f32")


@test
def test_forward_f16():
    _forward_test("f16")


@test
def test_forward_bf16():
    _forward_test("bf16")


@test
def test_forward_bf16_ml_dtypes():
    if moelink.BF16_NUMPY is None:
        raise Skip("ml_dtypes is not installed (bf16 as uint16 bits is tested)")
    cfg = CASES[2]
    rng = np.random.default_rng(7)
    cw, rw = make_weights(cfg, "bf16", rng)
    xc, xr = make_x(cfg, 23, "bf16", rng)
    with moelink.Context("cpu") as ctx, layer(ctx, cfg, "bf16") as moe:
        moe.set_weights(**cw)
        ref_bits = moe.forward(xc)
        cw2 = {n: (a.view(moelink.BF16_NUMPY) if a.dtype == np.uint16 else a)
               for n, a in cw.items()}
        moe.set_weights(**cw2)
        out = moe.forward(xc.view(moelink.BF16_NUMPY))
        assert out.dtype == moelink.BF16_NUMPY, out.dtype
        assert np.array_equal(out.view(np.uint16), ref_bits), "ml_dtypes and uint16 paths differ"


@test
def test_forward_shapes_and_chunks():
    cfg = CASES[1]
    with moelink.Context("cpu", threads=2) as ctx:
        # T > max_tokens: the library chunks
        check_forward(ctx, cfg, "f32", T=150, seed=3, max_tokens=32)
        rng = np.random.default_rng(5)
        cw, rw = make_weights(cfg, "f32", rng)
        with layer(ctx, cfg, "f32", 16) as moe:
            moe.set_weights(**cw)
            # T = 0
            out = moe.forward(np.zeros((0, cfg["hidden"]), np.float32))
            assert out.shape == (0, cfg["hidden"])
            # leading dims [2, 5, H], into a given out
            xc, xr = make_x(cfg, 10, "f32", rng)
            out = np.full((2, 5, cfg["hidden"]), np.nan, np.float32)
            r = moe.forward(xc.reshape(2, 5, -1), out=out)
            assert r is out
            ref, _, _, margin = ref_forward(cfg, xr, rw)
            ok = margin > TIE_EPS
            assert rel_l2(out.reshape(10, -1)[ok].astype(np.float64), ref[ok]) <= 1e-4
            # calling the layer is forward
            assert np.array_equal(moe(xc), out.reshape(10, -1))


@test
def test_deterministic():
    cfg = CASES[2]
    rng = np.random.default_rng(11)
    cw, _ = make_weights(cfg, "bf16", rng)
    xc, _ = make_x(cfg, 200, "bf16", rng)
    with moelink.Context("cpu") as ctx, layer(ctx, cfg, "bf16", 64) as moe:
        moe.set_weights(**cw)
        a = moe.forward(xc)
        b = moe.forward(xc)
        assert np.array_equal(a, b), "forward is not bitwise repeatable"


@test
def test_route():
    with moelink.Context("cpu") as ctx:
        for i, cfg in enumerate(CASES):
            for dtype in ("f32", "bf16"):
                rng = np.random.default_rng(40 + i)
                cw, rw = make_weights(cfg, dtype, rng)
                xc, xr = make_x(cfg, 61, dtype, rng)
                with layer(ctx, cfg, dtype) as moe:
                    moe.set_weights(**cw)
                    ids, w = moe.route(xc)
                    assert ids.dtype == np.int32 and ids.shape == (61, cfg["top_k"])
                    assert w.dtype == np.float32 and w.shape == (61, cfg["top_k"])
                    rid, rwt, margin, sel = ref_route(cfg, xr, rw["router"],
                                                      rw.get("correction_bias"))
                    ok = margin > TIE_EPS
                    # order within the k is by selection score; compare as sets
                    # plus weights per expert
                    si, sr = np.argsort(ids, 1), np.argsort(rid, 1)
                    got_i = np.take_along_axis(ids, si, 1)[ok]
                    want_i = np.take_along_axis(rid, sr, 1)[ok]
                    bad = np.nonzero((got_i != want_i).any(1))[0]
                    assert bad.size == 0, "%s %s: ids differ at %d tokens, e.g. %s vs %s" % (
                        cfg["name"], dtype, bad.size, got_i[bad[0]], want_i[bad[0]])
                    got_w = np.take_along_axis(w, si, 1)[ok].astype(np.float64)
                    want_w = np.take_along_axis(rwt, sr, 1)[ok]
                    err = np.abs(got_w - want_w).max()
                    assert err <= 1e-5 * max(1.0, cfg.get("routed_scaling", 1.0)), (
                        cfg["name"], dtype, err)
                    # ids come in decreasing order of selection score
                    s = np.take_along_axis(sel, ids.astype(np.int64), 1)[ok]
                    assert np.all(np.diff(s, axis=1) <= TIE_EPS), cfg["name"]


def _check_plan(plan, ids, E):
    T, k = ids.shape
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    off = plan.expert_offsets
    counts = np.bincount(flat[valid], minlength=E)
    assert off[0] == 0 and np.array_equal(np.diff(off), counts), (off, counts)
    nv = int(off[E])
    assert nv == valid.sum()
    sp = plan.sorted_pairs[:nv]
    for e in range(E):
        rows = sp[off[e]:off[e + 1]]
        assert np.all(flat[rows] == e), e
        assert np.all(np.diff(rows) > 0), "pairs of expert %d not ascending" % e
    pr = plan.pair_rows
    assert np.all(pr[~valid] == -1)
    assert np.array_equal(sp[pr[valid]], np.nonzero(valid)[0]), "pair_rows is not the inverse"
    nt = int(plan.num_tiles[0])
    assert 0 <= nt <= plan.max_tiles, nt
    covered = np.zeros(nv, np.int32)
    for e, first, n in plan.tiles[:nt]:
        assert 0 <= e < E and 1 <= n <= plan.tile_rows, (e, first, n)
        assert off[e] <= first and first + n <= off[e + 1], (e, first, n)
        covered[first:first + n] += 1
    assert np.all(covered == 1), "tiles do not cover each row once"


@test
def test_pieces():
    cfg = CASES[2]
    with moelink.Context("cpu") as ctx:
        for dtype in ("f32", "bf16"):
            rng = np.random.default_rng(21)
            cw, rw = make_weights(cfg, dtype, rng)
            T = 150  # several CPU tiles for the busy experts
            xc, xr = make_x(cfg, T, dtype, rng)
            with layer(ctx, cfg, dtype) as moe:
                moe.set_weights(**cw)
                ids, w = moe.route(xc)
                plan = moe.plan(ids)
                assert plan.tile_rows == moe.tile_rows and plan.num_tokens == T
                _check_plan(plan, ids, cfg["experts"])
                y = moe.experts(xc, plan, w)
                assert y.shape == (T * cfg["top_k"], cfg["hidden"]) and y.dtype == xc.dtype
                routed = moe.combine(y, plan)
                want = ref_experts_out(cfg, xr, rw, ids, w.astype(np.float64))
                assert rel_l2(as_f64(routed), want) <= TOL[dtype], rel_l2(as_f64(routed), want)
                # experts without weights: w = 1
                y1 = moe.experts(xc, plan)
                r1 = moe.combine(y1, plan)
                want1 = ref_experts_out(cfg, xr, rw, ids, np.ones_like(w, np.float64))
                assert rel_l2(as_f64(r1), want1) <= TOL[dtype]
                # forward = routed part + shared expert
                full = moe.forward(xc)
                shared = ref_shared(cfg, xr, rw)
                assert rel_l2(as_f64(full), want + shared) <= TOL[dtype]


@test
def test_plan_empty_slots():
    cfg = CASES[0]
    rng = np.random.default_rng(8)
    cw, rw = make_weights(cfg, "f32", rng)
    T = 29
    xc, xr = make_x(cfg, T, "f32", rng)
    with moelink.Context("cpu") as ctx, layer(ctx, cfg, "f32") as moe:
        moe.set_weights(**cw)
        ids, w = moe.route(xc)
        ids[::3, 1] = -1
        ids[5, :] = -1
        ids[7, 0] = cfg["experts"]  # out of range: also empty
        plan = moe.plan(ids)
        _check_plan(plan, ids, cfg["experts"])
        y = moe.experts(xc, plan, w)
        out = moe.combine(y, plan)
        masked = np.where((ids >= 0) & (ids < cfg["experts"]), ids, -1)
        want = ref_experts_out(cfg, xr, rw, masked, w.astype(np.float64))
        assert np.all(out[5] == 0), "a token with only empty slots must get zeros"
        assert rel_l2(out.astype(np.float64), want) <= 1e-4


@test
def test_weights_kept_alive():
    cfg = CASES[1]
    rng = np.random.default_rng(13)
    cw, rw = make_weights(cfg, "f32", rng)
    xc, xr = make_x(cfg, 17, "f32", rng)
    with moelink.Context("cpu") as ctx, layer(ctx, cfg, "f32") as moe:
        # only the layer holds these copies
        moe.set_weights(**{n: a.copy() for n, a in cw.items()})
        del cw
        gc.collect()
        junk = [np.full(1 << 16, 7.0, np.float32) for _ in range(64)]  # reuse freed memory
        out = moe.forward(xc)
        del junk
        ref, _, _, margin = ref_forward(cfg, xr, rw)
        ok = margin > TIE_EPS
        assert rel_l2(out[ok].astype(np.float64), ref[ok]) <= 1e-4
        assert set(moe.weights) == {"router", "gate_up", "down", "shared_gate_up",
                                    "shared_down", "shared_gate"}


@test
def test_errors_from_library():
    with moelink.Context("cpu") as ctx:
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "top_k 9 > num_experts 8",
                             moelink.MoE, ctx, hidden=16, inter=16, experts=8, top_k=9)
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "n_group 3 does not divide",
                             moelink.MoE, ctx, hidden=16, inter=16, experts=8, top_k=2,
                             n_group=3, topk_group=1)
        expect_moelink_error(Status.ERR_UNSUPPORTED, "fp8",
                             moelink.MoE, ctx, hidden=16, inter=16, experts=8, top_k=2,
                             dtype="fp8_e4m3")
        expect_moelink_error(Status.ERR_NOT_FOUND, "unknown preset", moelink.MoE, ctx,
                             "no-such-model")
        cfg = CASES[2]
        rng = np.random.default_rng(1)
        with layer(ctx, cfg, "bf16", 16) as moe:
            xc, _ = make_x(cfg, 4, "bf16", rng)
            e = expect_moelink_error(Status.ERR_INVALID_STATE, "before moelink_moe_set_weights",
                                     moe.forward, xc)
            assert "forward" in e.message, e.message
            expect_moelink_error(Status.ERR_INVALID_STATE, "route before", moe.route, xc)
            cw32, _ = make_weights(cfg, "f32", rng)
            expect_moelink_error(Status.ERR_DTYPE_MISMATCH, "weights dtype f32 != layer dtype "
                                 "bf16", moe.set_weights, **cw32)
            cw, _ = make_weights(cfg, "bf16", rng)
            nobias = {n: a for n, a in cw.items() if n != "correction_bias"}
            expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "correction_bias",
                                 moe.set_weights, **nobias)
            extra = dict(cw, shared_gate=cw["router"][0].copy())
            expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "shared_gate",
                                 moe.set_weights, **extra)
            assert moe.weights == {}, "a refused set_weights must not bind anything"
            moe.set_weights(**cw)
            big, _ = make_x(cfg, 17, "bf16", rng)
            expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "max_tokens", moe.route, big)
            moe.forward(big)  # forward chunks
            expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "overlap", moe.forward, xc, xc)
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "num_threads", moelink.Context, "cpu",
                             threads=-1)
    if not moelink.backend_available("cuda"):
        expect_moelink_error(Status.ERR_UNSUPPORTED, "cuda", moelink.Context, "cuda")


@test
def test_errors_in_python():
    cfg = CASES[0]
    rng = np.random.default_rng(2)
    with moelink.Context("cpu") as ctx:
        expect_raises(ValueError, moelink.MoE, ctx, hidden=16, inter=8, experts=4, top_k=2,
                      dtype="int8")
        expect_raises(ValueError, moelink.MoE, ctx, hidden=16, inter=8, experts=4, top_k=2,
                      router="argmax")
        expect_raises(ValueError, moelink.Context, "tpu")
        expect_raises(TypeError, moelink.MoE, "not a context", hidden=16)
        moe = layer(ctx, cfg, "f32")
        cw, _ = make_weights(cfg, "f32", rng)
        bad = dict(cw, gate_up=cw["gate_up"][:, :-1].copy())
        e = expect_raises(ValueError, moe.set_weights, **bad)
        assert "gate_up" in str(e) and "expected" in str(e), e
        mixed = dict(cw, down=cw["down"].astype(np.float16))
        e = expect_raises(TypeError, moe.set_weights, **mixed)
        assert "one dtype" in str(e), e
        e = expect_raises(ValueError, moe.set_weights, **dict(cw, router=np.asfortranarray(
            cw["router"])))
        assert "contiguous" in str(e), e
        moe.set_weights(**cw)
        H = cfg["hidden"]
        xc, _ = make_x(cfg, 6, "f32", rng)
        e = expect_raises(ValueError, moe.forward, xc[:, :-1].copy())
        assert "shape" in str(e), e
        e = expect_raises(ValueError, moe.forward, np.zeros((H, 6), np.float32).T)
        assert "contiguous" in str(e) or "shape" in str(e), e
        e = expect_raises(TypeError, moe.forward, xc.astype(np.float64))
        assert "float64" in str(e) and "f32" in str(e), e
        e = expect_raises(TypeError, moe.forward, xc.tolist())
        assert "numpy array" in str(e), e
        expect_raises(ValueError, moe.forward, xc, out=np.empty((5, H), np.float32))
        ro = np.empty_like(xc)
        ro.flags.writeable = False
        expect_raises(ValueError, moe.forward, xc, out=ro)
        ids, w = moe.route(xc)
        expect_raises(TypeError, moe.plan, ids.astype(np.int64))
        plan = moe.plan(ids)
        expect_raises(ValueError, moe.experts, xc[:5].copy(), plan)
        expect_raises(TypeError, moe.experts, xc, "plan")
        moe.close()
        e = expect_raises(ValueError, moe.forward, xc)
        assert "closed" in str(e), e
        f16 = layer(ctx, cfg, "f16")
        e = expect_raises(TypeError, f16.forward, moelink.to_bf16(xc))
        assert "bf16 bits" in str(e), e
    e = expect_raises(ValueError, f16.forward, xc.astype(np.float16))
    assert "closed" in str(e), "closing a context must close its layers: %s" % e


@test
def test_fill_random_and_bf16_helpers():
    n = 1000
    with moelink.Context("cpu") as ctx:
        want = moelink.random_values(42, n, scale=2.0, offset=0.5)
        assert np.all(want >= -1.5) and np.all(want < 2.5), (want.min(), want.max())
        a = ctx.fill_random(np.empty(n, np.float32), 42, scale=2.0, offset=0.5)
        assert np.array_equal(a, want)
        h = ctx.fill_random(np.empty(n, np.float16), 42, scale=2.0, offset=0.5)
        assert np.array_equal(h, want.astype(np.float16))
        b = ctx.fill_random(np.empty((10, 100), np.uint16), 42, scale=2.0, offset=0.5)
        assert np.array_equal(b.reshape(-1), moelink.to_bf16(want)), "to_bf16 != library"
    # round to nearest even, NaN and infinity
    v = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, np.inf, -np.inf, np.nan, 3.4e38],
                 np.float32)
    bits = moelink.to_bf16(v)
    back = moelink.from_bf16(bits)
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.0 + 2 ** -6, back
    assert back[3] == -2.5 and back[4] == np.inf and back[5] == -np.inf, back
    assert np.isnan(back[6]) and back[7] == np.inf, back


@test
def test_torch_cpu_tensors():
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed")
    cfg = CASES[0]
    rng = np.random.default_rng(4)
    cw, rw = make_weights(cfg, "bf16", rng)
    xc, xr = make_x(cfg, 9, "bf16", rng)
    with moelink.Context("cpu") as ctx, layer(ctx, cfg, "bf16") as moe:
        moe.set_weights(**{n: (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                               if a.dtype == np.uint16 else torch.from_numpy(a))
                           for n, a in cw.items()})
        out = moe.forward(torch.from_numpy(xc.view(np.int16)).view(torch.bfloat16))
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        ref, _, _, margin = ref_forward(cfg, xr, rw)
        ok = margin > TIE_EPS
        assert rel_l2(out.double().numpy()[ok], ref[ok]) <= 1e-2


E4M3_MAGS = np.array([m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                      for e in range(16) for m in range(8)])[:0x7f]  # codes 0x00..0x7e


def e4m3_round(v):
    """(bytes, values): the nearest e4m3 (ties to the even code, saturating at
    448) of each element of v (float64 holding fp32 values)."""
    mags = E4M3_MAGS
    a = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(mags, a), 1, len(mags) - 1)
    lo = hi - 1
    dlo, dhi = a - mags[lo], mags[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    q = (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)
    return q, np.where(np.signbit(v), -mags[code], mags[code])


def e4m3_blocks(w):
    """w [E, N, K] float64 (N, K multiples of 128) as e4m3 bytes and fp32
    scales per 128 x 128 block, written here from the format: s = amax / 448,
    each value the nearest e4m3 (ties to the even code) of w / s."""
    E, N, K = w.shape
    blocks = w.reshape(E, N // 128, 128, K // 128, 128)
    amax = np.abs(blocks).max(axis=(2, 4)).astype(np.float32)
    s = (amax / np.float32(448.0)).astype(np.float32)
    v = (blocks.astype(np.float32) / s[:, :, None, :, None]).astype(np.float64)
    q, val = e4m3_round(v)
    deq = val * s[:, :, None, :, None]
    return (np.ascontiguousarray(q.reshape(E, N, K)), np.ascontiguousarray(s),
            deq.reshape(E, N, K))


def e4m3_qdq_rows(x):
    """x [T, n] (n a multiple of 128) rounded to fp32, then quantized and
    dequantized per 128 elements as moelink_quantize's FP8 does (s = amax /
    448 in fp32, q = e4m3(x / s), back as q * s; a zero block stays zero)."""
    T, n = x.shape
    b = np.asarray(x, np.float32).reshape(T, n // 128, 128)
    s = (np.abs(b).max(axis=2) / np.float32(448.0)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0))
    _, val = e4m3_round((b / safe[:, :, None]).astype(np.float64))
    deq = (val.astype(np.float32) * s[:, :, None]).astype(np.float64)
    return deq.reshape(T, n)


@test
def test_fp8_experts():
    # FP8 expert weights on the CPU: against the same layer holding the
    # dequantized weights in f32, the only difference left is the on-the-fly
    # quantization of the experts' inputs (per 128 elements): small, not zero.
    cfg = dict(hidden=256, inter=128, experts=4, top_k=2)
    rng = np.random.default_rng(7)
    c, _ = make_weights(cfg, "f32", rng)
    gq, gs, gdq = e4m3_blocks(c["gate_up"].astype(np.float64))
    dq, ds, ddq = e4m3_blocks(c["down"].astype(np.float64))
    x = rng.standard_normal((9, 256)).astype(np.float32)
    with moelink.Context("cpu") as ctx:
        fp8 = moelink.MoE(ctx, dtype="f32", max_tokens=16, fp8_experts=True, **cfg)
        assert fp8.fp8_experts and fp8.config["fp8_experts"]
        fp8.set_weights(router=c["router"], gate_up=gq, down=dq, gate_up_scale=gs,
                        down_scale=ds)
        ref = moelink.MoE(ctx, dtype="f32", max_tokens=16, **cfg)
        ref.set_weights(router=c["router"], gate_up=gdq.astype(np.float32),
                        down=ddq.astype(np.float32))
        a, b = fp8.forward(x).astype(np.float64), ref.forward(x).astype(np.float64)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert 0 < rel < 0.08, rel
        assert np.array_equal(fp8.forward(x).view(np.uint32), a.astype(np.float32).view(np.uint32))
        expect_raises(TypeError, fp8.set_weights, router=c["router"], gate_up=c["gate_up"],
                      down=dq, gate_up_scale=gs, down_scale=ds)
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "gate_up_scale", fp8.set_weights,
                             router=c["router"], gate_up=gq, down=dq, down_scale=ds)
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "multiples of 128", moelink.MoE, ctx,
                             dtype="f32", fp8_experts=True, **dict(cfg, inter=96))


@test
def test_fp8_shared():
    # An FP8 shared expert (fp8_shared) on the CPU, routed experts in f32.
    # Two checks: (1) against a float64 numpy reference whose shared expert
    # uses the dequantized weights (e4m3 value * block scale) and reads its
    # input rows and its SwiGLU output quantize-dequantized per 128 elements;
    # (2) against the same layer holding the dequantized shared weights in f32
    # (no fp8_shared), where only that activation quantization differs.
    cfg = dict(hidden=256, inter=128, experts=4, top_k=2, shared_inter=256)
    H, Is = cfg["hidden"], cfg["shared_inter"]
    rng = np.random.default_rng(11)
    c, rw = make_weights(cfg, "f32", rng)
    sgq, sgs, sgdq = (a[0] for a in e4m3_blocks(rw["shared_gate_up"][None]))
    sdq, sds, sddq = (a[0] for a in e4m3_blocks(rw["shared_down"][None]))
    assert sgq.dtype == np.uint8 and sgs.shape == (2 * Is // 128, H // 128), sgs.shape
    assert sds.shape == (H // 128, Is // 128), sds.shape
    x = rng.standard_normal((9, H)).astype(np.float32)
    xr = x.astype(np.float64)
    routed = dict(router=c["router"], gate_up=c["gate_up"], down=c["down"])
    fp8_w = dict(routed, shared_gate_up=sgq, shared_down=sdq, shared_gate_up_scale=sgs,
                 shared_down_scale=sds)
    deq_w = dict(routed, shared_gate_up=sgdq.astype(np.float32),
                 shared_down=sddq.astype(np.float32))

    # numpy reference
    ids, w, margin, _ = ref_route(cfg, xr, rw["router"], None)
    ok = margin > TIE_EPS
    assert ok.mean() >= 0.8, "too many near-ties (%d of %d)" % ((~ok).sum(), len(ok))
    routed_ref = ref_experts_out(cfg, xr, rw, ids, w)

    def shared_ref(xin, qdq):
        gu = (e4m3_qdq_rows(xin) if qdq else xin) @ sgdq.T
        h = silu(gu[:, :Is]) * gu[:, Is:]
        return (e4m3_qdq_rows(h) if qdq else h) @ sddq.T

    ref = routed_ref + shared_ref(xr, True)
    ref_noq = routed_ref + shared_ref(xr, False)  # weights fp8, activations not

    with moelink.Context("cpu") as ctx:
        fp8 = moelink.MoE(ctx, dtype="f32", max_tokens=16, fp8_shared=True, **cfg)
        assert fp8.fp8_shared and fp8.config["fp8_shared"], fp8.config
        assert not fp8.fp8_experts and not fp8.config["fp8_experts"], fp8.config
        fp8.set_weights(**fp8_w)
        assert set(fp8.weights) == set(fp8_w), sorted(fp8.weights)
        a = fp8.forward(x).astype(np.float64)
        assert np.array_equal(fp8.forward(x).view(np.uint32), a.astype(np.float32).view(np.uint32))
        sh = ref[ok] - routed_ref[ok]  # the shared expert's part of the reference
        assert rel_l2(ref_noq[ok], ref[ok]) > 0.005, "the shared expert barely matters"
        err = np.linalg.norm(a[ok] - ref[ok]) / np.linalg.norm(sh)
        err_noq = np.linalg.norm(a[ok] - ref_noq[ok]) / np.linalg.norm(sh)
        # the quantized activations are what the layer computes with: it is
        # much closer to the reference that quantizes them than to one that doesn't
        assert err < 2e-3 and err < 0.2 * err_noq, (err, err_noq)

        # the same layer with the dequantized shared weights in f32
        deq = moelink.MoE(ctx, dtype="f32", max_tokens=16, **cfg)
        assert not deq.fp8_shared and not deq.config["fp8_shared"]
        deq.set_weights(**deq_w)
        b = deq.forward(x).astype(np.float64)
        none = moelink.MoE(ctx, dtype="f32", max_tokens=16, **dict(cfg, shared_inter=0))
        none.set_weights(**routed)
        r = none.forward(x).astype(np.float64)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b - r)  # relative to the shared part
        assert 0 < rel < 0.1, rel
        assert np.linalg.norm(b - r) > 0.05 * np.linalg.norm(b), "the shared expert barely matters"

        # fp8_experts and fp8_shared together: independent, both apply
        both = moelink.MoE(ctx, dtype="f32", max_tokens=16, fp8_experts=True, fp8_shared=True,
                           **cfg)
        assert both.fp8_experts and both.fp8_shared
        gq, gs, gdq = e4m3_blocks(rw["gate_up"])
        dq, ds, ddq = e4m3_blocks(rw["down"])
        both.set_weights(**dict(fp8_w, gate_up=gq, down=dq, gate_up_scale=gs, down_scale=ds))
        all_deq = moelink.MoE(ctx, dtype="f32", max_tokens=16, **cfg)
        all_deq.set_weights(**dict(deq_w, gate_up=gdq.astype(np.float32),
                                   down=ddq.astype(np.float32)))
        a2, b2 = both.forward(x).astype(np.float64), all_deq.forward(x).astype(np.float64)
        rel2 = np.linalg.norm(a2 - b2) / np.linalg.norm(b2)
        assert 0 < rel2 < 0.08, rel2

        # set_weights: the shared weights must be e4m3 bytes, the scales float32
        # of their shapes, both scales given with fp8_shared and none without
        e = expect_raises(TypeError, fp8.set_weights, **dict(fp8_w, shared_gate_up=c[
            "shared_gate_up"]))
        assert "shared_gate_up" in str(e), e
        expect_raises(TypeError, fp8.set_weights, **dict(fp8_w, shared_down_scale=sds.astype(
            np.float64)))
        expect_raises(ValueError, fp8.set_weights, **dict(fp8_w, shared_down_scale=sgs))
        for missing in ("shared_gate_up_scale", "shared_down_scale"):
            kw = dict(fp8_w)
            del kw[missing]
            expect_moelink_error(Status.ERR_INVALID_ARGUMENT, missing, fp8.set_weights, **kw)
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "fp8_shared", deq.set_weights,
                             **dict(deq_w, shared_gate_up_scale=sgs, shared_down_scale=sds))
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "fp8_shared", deq.set_weights,
                             **dict(deq_w, shared_down_scale=sds))
        # the failed calls left the last good weights bound
        assert set(fp8.weights) == set(fp8_w)
        assert np.array_equal(fp8.forward(x).view(np.uint32), a.astype(np.float32).view(np.uint32))

        # config: fp8_shared needs a shared expert, with hidden and shared_inter
        # multiples of 128
        nosh = dict(cfg)
        del nosh["shared_inter"]
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "shared_inter", moelink.MoE, ctx,
                             dtype="f32", fp8_shared=True, **nosh)
        expect_moelink_error(Status.ERR_INVALID_ARGUMENT, "multiples of 128", moelink.MoE, ctx,
                             dtype="f32", fp8_shared=True, **dict(cfg, shared_inter=192))

def main(argv):
    pick = argv[1:]
    passed, failed, skipped = run(pick)
    return summary(passed, failed, skipped)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
