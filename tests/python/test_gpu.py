#!/usr/bin/env python3
"""The Python binding on the CUDA backend, with PyTorch CUDA tensors, against
an independent float64 torch implementation of the layer (and against the
CPU backend on the same inputs).

Plain script: python3 tests/python/test_gpu.py [name-substring ...]
Skips (prints 'SKIP: reason', exits 0) when torch is missing, when torch sees
no GPU, or when the library was built without the CUDA backend; set
MOELINK_REQUIRE_GPU=1 to make those failures. A GPU that torch sees but
moelink cannot open is a failure. Last line: 'N passed, N failed, N skipped'.

MOELINK_GPU_TEST_ON_CPU=1 runs the same tests with torch CPU tensors on the
CPU backend (the CUDA-only ones skip): a check of the tests themselves on a
machine without a GPU.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))


def skip_all(reason):
    if os.environ.get("MOELINK_REQUIRE_GPU") == "1":
        print("FAIL: %s (MOELINK_REQUIRE_GPU=1)" % reason)
        print("0 passed, 1 failed, 0 skipped")
        sys.exit(1)
    print("SKIP: %s" % reason)
    print("0 passed, 0 failed, 1 skipped")
    sys.exit(0)


ON_CPU = os.environ.get("MOELINK_GPU_TEST_ON_CPU") == "1"

try:
    import torch
except ImportError:
    skip_all("torch is not installed")
if not ON_CPU and not torch.cuda.is_available():
    skip_all("torch sees no CUDA device")

import numpy as np  # noqa: E402

import moelink  # noqa: E402
from moelink import MoelinkError, Status  # noqa: E402
from harness import Skip, expect_raises, run, summary, test  # noqa: E402

BACKEND = "cpu" if ON_CPU else "cuda"
if not ON_CPU:
    try:
        _probe = moelink.Context("cuda", device=0)
        _probe.close()
    except MoelinkError as e:
        if e.status == Status.ERR_UNSUPPORTED and "not built" in e.message:
            skip_all("libmoelink was built without the CUDA backend: %s" % e.message)
        print("FAIL: torch sees %d GPU(s) but moelink cannot open cuda:0: %s" %
              (torch.cuda.device_count(), e))
        print("0 passed, 1 failed, 0 skipped")
        sys.exit(1)

DEV = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)


def sync():
    if not ON_CPU:
        torch.cuda.synchronize()


def need_cuda(what):
    if ON_CPU:
        raise Skip("%s needs CUDA" % what)


# ---------------------------------------------------------------------------
# Reference: float64 torch on the GPU
# ---------------------------------------------------------------------------

def ref_route(cfg, x, wr, bias):
    """(ids [T,k] int64, weights [T,k], margin [T], sel [T,E]) in float64;
    margin is the distance of each token's selection from a tie."""
    T = x.shape[0]
    E, k = cfg["experts"], cfg["top_k"]
    router = cfg.get("router", "softmax")
    logits = x @ wr.T
    if router == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif router == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = logits
    sel = scores + bias[None, :] if bias is not None else scores.clone()
    margin = torch.full((T,), float("inf"), dtype=torch.float64, device=x.device)
    ng, tg = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    rows = torch.arange(T, device=x.device)
    if ng > 1:
        gs = E // ng
        top = sel.view(T, ng, gs).sort(dim=-1, descending=True).values[:, :, :min(2, gs)].sum(-1)
        gorder = torch.sort(-top, dim=1, stable=True).indices
        keep = torch.zeros(T, ng, dtype=torch.bool, device=x.device)
        keep.scatter_(1, gorder[:, :tg], True)
        if tg < ng:
            margin = torch.minimum(margin, top[rows, gorder[:, tg - 1]] - top[rows, gorder[:, tg]])
        sel = sel.masked_fill(~keep.repeat_interleave(gs, dim=1), float("-inf"))
    order = torch.sort(-sel, dim=1, stable=True).indices
    ids = order[:, :k]
    if k < E:
        nxt = sel[rows, order[:, k]]
        gap = sel[rows, order[:, k - 1]] - nxt
        margin = torch.minimum(margin, torch.where(torch.isfinite(nxt), gap,
                                                   torch.full_like(gap, float("inf"))))
    if router == "topk_softmax":
        w = torch.softmax(logits.gather(1, ids), dim=-1)
    else:
        w = scores.gather(1, ids)
        if cfg.get("renormalize", True):
            w = w / w.sum(1, keepdim=True)
    return ids, w * cfg.get("routed_scaling", 1.0), margin, sel


def ref_experts_out(cfg, x, W, ids, w):
    I = cfg["inter"]
    out = torch.zeros(x.shape[0], cfg["hidden"], dtype=torch.float64, device=x.device)
    for e in range(cfg["experts"]):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        gu = x[t] @ W["gate_up"][e].T
        h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        out.index_add_(0, t, w[t, j][:, None] * (h @ W["down"][e].T))
    return out


def ref_shared(cfg, x, W):
    Is = cfg.get("shared_inter", 0)
    if not Is:
        return 0.0
    gu = x @ W["shared_gate_up"].T
    y = (torch.nn.functional.silu(gu[:, :Is]) * gu[:, Is:]) @ W["shared_down"].T
    if cfg.get("shared_gate"):
        y = y * torch.sigmoid(x @ W["shared_gate"])[:, None]
    return y


def ref_forward(cfg, x, W):
    ids, w, margin, _ = ref_route(cfg, x, W["router"], W.get("correction_bias"))
    return ref_experts_out(cfg, x, W, ids, w) + ref_shared(cfg, x, W), ids, w, margin


TDT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOL = {"f32": 1e-4, "f16": 1e-2, "bf16": 1e-2}
TIE_EPS = 1e-5


def make_weights(cfg, dtype, gen):
    H, I, E = cfg["hidden"], cfg["inter"], cfg["experts"]
    Is = cfg.get("shared_inter", 0)

    def u(shape, a):
        return (torch.rand(shape, generator=gen, dtype=torch.float64, device=DEV) * 2 - 1) * a

    raw = {"router": u((E, H), 4.5 / H ** 0.5), "gate_up": u((E, 2 * I, H), (3.0 / H) ** 0.5),
           "down": u((E, H, I), (3.0 / I) ** 0.5)}
    if Is:
        raw["shared_gate_up"] = u((2 * Is, H), (3.0 / H) ** 0.5)
        raw["shared_down"] = u((H, Is), (3.0 / Is) ** 0.5)
    if cfg.get("shared_gate"):
        raw["shared_gate"] = u((H,), 2.0 / H ** 0.5)
    dev, ref = {}, {}
    for n, a in raw.items():
        dev[n] = a.to(TDT[dtype]).contiguous()
        ref[n] = dev[n].double()
    if cfg.get("correction_bias"):
        dev["correction_bias"] = u((E,), 0.1).float()
        ref["correction_bias"] = dev["correction_bias"].double()
    return dev, ref


def make_x(cfg, T, dtype, gen):
    x = ((torch.rand(T, cfg["hidden"], generator=gen, dtype=torch.float64, device=DEV) * 2 - 1)
         .to(TDT[dtype]))
    return x, x.double()


def rel_l2(a, b):
    d = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a.double() - b).item() / (d if d > 0 else 1.0)


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
    dict(name="wide", hidden=256, inter=128, experts=64, top_k=8, router="sigmoid",
         renormalize=True, n_group=8, topk_group=4, routed_scaling=2.5, correction_bias=True,
         shared_inter=128),
]


def layer(ctx, cfg, dtype, max_tokens=512):
    kw = {k: v for k, v in cfg.items() if k != "name"}
    return moelink.MoE(ctx, dtype=dtype, max_tokens=max_tokens, **kw)


def check_forward(ctx, cfg, dtype, T, seed, max_tokens=512):
    gen = torch.Generator(device=DEV)
    gen.manual_seed(seed)
    dw, rw = make_weights(cfg, dtype, gen)
    x, xr = make_x(cfg, T, dtype, gen)
    with layer(ctx, cfg, dtype, max_tokens) as moe:
        moe.set_weights(**dw)
        out = torch.full_like(x, float("nan"))  # poisoned: unwritten rows show
        moe.forward(x, out=out)
        sync()
        ref, _, _, margin = ref_forward(cfg, xr, rw)
        ok = margin > TIE_EPS
        assert ok.double().mean().item() >= 0.9, "too many near-ties"
        err = rel_l2(out[ok], ref[ok])
        assert err <= TOL[dtype], "%s %s T=%d: rel L2 %.3g" % (cfg["name"], dtype, T, err)
        return moe, dw, x


@test
def test_forward():
    with moelink.Context(BACKEND) as ctx:
        # The CUDA backend runs bf16 and f16 only; f32 must be refused with a reason.
        dtypes = ("bf16", "f16", "f32") if BACKEND == "cpu" else ("bf16", "f16")
        for dtype in dtypes:
            for i, cfg in enumerate(CASES):
                for T in (1, 7, 129):
                    check_forward(ctx, cfg, dtype, T, seed=1000 * i + T)
        if BACKEND == "cuda":
            try:
                layer(ctx, CASES[0], "f32", 16)
            except moelink.MoelinkError as e:
                assert e.status_name == "MOELINK_ERR_UNSUPPORTED" and "f32" in e.message, str(e)
            else:
                raise AssertionError("f32 layer on CUDA was accepted")


@test
def test_forward_chunks_and_shapes():
    cfg = CASES[2]
    with moelink.Context(BACKEND) as ctx:
        check_forward(ctx, cfg, "bf16", T=300, seed=5, max_tokens=64)
        gen = torch.Generator(device=DEV)
        gen.manual_seed(9)
        dw, rw = make_weights(cfg, "bf16", gen)
        with layer(ctx, cfg, "bf16", 64) as moe:
            moe.set_weights(**dw)
            out = moe.forward(torch.empty(0, cfg["hidden"], dtype=torch.bfloat16, device=DEV))
            assert out.shape == (0, cfg["hidden"])
            x, xr = make_x(cfg, 12, "bf16", gen)
            y = moe.forward(x.view(3, 4, -1))
            assert y.shape == (3, 4, cfg["hidden"]) and y.device == DEV
            # a contiguous view at an offset: data_ptr() carries the offset
            y2 = moe.forward(x[4:])
            sync()
            assert torch.equal(y2, y.view(12, -1)[4:]), "offset view gave other results"


@test
def test_matches_cpu_backend():
    cfg = CASES[1]
    gen = torch.Generator(device=DEV)
    gen.manual_seed(77)
    dw, _ = make_weights(cfg, "bf16", gen)
    x, _ = make_x(cfg, 100, "bf16", gen)

    def to_np(t):
        if t.dtype == torch.bfloat16:
            return t.cpu().view(torch.int16).numpy().view(np.uint16)
        return t.cpu().numpy()

    with moelink.Context(BACKEND) as gctx, moelink.Context("cpu") as cctx:
        g = layer(gctx, cfg, "bf16")
        c = layer(cctx, cfg, "bf16")
        g.set_weights(**dw)
        c.set_weights(**{n: to_np(a) for n, a in dw.items()})
        yg = g.forward(x)
        yc = c.forward(to_np(x))
        a = moelink.from_bf16(to_np(yg)).astype(np.float64)
        b = moelink.from_bf16(yc).astype(np.float64)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err <= 1e-2, err
        ig, wg = g.route(x)
        ic, wc = c.route(to_np(x))
        same = (np.sort(ig.cpu().numpy(), 1) == np.sort(ic, 1)).all(1)
        assert same.mean() >= 0.95, "GPU and CPU routing differ on %d tokens" % (~same).sum()


@test
def test_deterministic_and_streams():
    cfg = CASES[5]
    with moelink.Context(BACKEND) as ctx:
        gen = torch.Generator(device=DEV)
        gen.manual_seed(3)
        dw, _ = make_weights(cfg, "bf16", gen)
        x, _ = make_x(cfg, 333, "bf16", gen)
        with layer(ctx, cfg, "bf16") as moe:
            moe.set_weights(**dw)
            a = moe.forward(x)
            b = moe.forward(x)
            assert torch.equal(a, b), "forward is not bitwise repeatable"
            need_cuda("the stream half of this test")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                c = moe.forward(x)  # current stream is s
            d = torch.empty_like(x)
            moe.forward(x, out=d, stream=s)  # explicit stream
            sync()
            assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d), \
                "forward is not bitwise repeatable across calls and streams"


@test
def test_cuda_graph():
    need_cuda("graph capture")
    cfg = CASES[0]
    with moelink.Context(BACKEND) as ctx:
        gen = torch.Generator(device=DEV)
        gen.manual_seed(4)
        dw, rw = make_weights(cfg, "bf16", gen)
        x, _ = make_x(cfg, 64, "bf16", gen)
        with layer(ctx, cfg, "bf16", 64) as moe:
            moe.set_weights(**dw)
            out = torch.empty_like(x)
            moe.forward(x, out=out)  # warm-up outside the capture
            sync()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                moe.forward(x, out=out)
            x2, x2r = make_x(cfg, 64, "bf16", gen)
            x.copy_(x2)
            graph.replay()
            sync()
            want = moe.forward(x2)
            sync()
            assert torch.equal(out, want), "graph replay differs from eager forward"


@test
def test_route_and_pieces():
    with moelink.Context(BACKEND) as ctx:
        for i, cfg in enumerate(CASES):
            gen = torch.Generator(device=DEV)
            gen.manual_seed(50 + i)
            dw, rw = make_weights(cfg, "bf16", gen)
            T = 200
            x, xr = make_x(cfg, T, "bf16", gen)
            with layer(ctx, cfg, "bf16") as moe:
                moe.set_weights(**dw)
                ids, w = moe.route(x)
                assert ids.dtype == torch.int32 and ids.device == DEV and w.dtype == torch.float32
                rid, rwt, margin, sel = ref_route(cfg, xr, rw["router"],
                                                  rw.get("correction_bias"))
                ok = margin > TIE_EPS
                gi, si = torch.sort(ids.long(), 1)
                ri, sr = torch.sort(rid, 1)
                assert torch.equal(gi[ok], ri[ok]), "%s: ids differ" % cfg["name"]
                err = (w.double().gather(1, si) - rwt.gather(1, sr))[ok].abs().max().item()
                assert err <= 1e-5 * max(1.0, cfg.get("routed_scaling", 1.0)), err
                s = sel.gather(1, ids.long())[ok]
                assert bool((s[:, 1:] - s[:, :-1] <= TIE_EPS).all()), "ids not by score"
                plan = moe.plan(ids)
                off = plan.expert_offsets.cpu().numpy()
                counts = np.bincount(ids.cpu().numpy().reshape(-1), minlength=cfg["experts"])
                assert off[0] == 0 and np.array_equal(np.diff(off), counts)
                pr = plan.pair_rows.cpu().numpy()
                sp = plan.sorted_pairs.cpu().numpy()
                assert np.array_equal(sp[pr], np.arange(T * cfg["top_k"]))
                nt = int(plan.num_tiles.cpu()[0])
                tiles = plan.tiles.cpu().numpy()[:nt]
                cover = np.zeros(T * cfg["top_k"], np.int32)
                for e, first, n in tiles:
                    assert off[e] <= first and first + n <= off[e + 1] and n >= 1
                    cover[first:first + n] += 1
                assert np.all(cover == 1), "tiles do not cover each row once"
                y = moe.experts(x, plan, w)
                routed = moe.combine(y, plan)
                sync()
                want = ref_experts_out(cfg, xr, rw, ids.long(), w.double())
                assert rel_l2(routed, want) <= 1e-2, rel_l2(routed, want)


def e4m3_blocks(w):
    """[E, N, K] float weights -> (e4m3 bytes, fp32 scales [E, N/128, K/128]):
    scale = amax / 448 per 128 x 128 block (the layout fp8_experts reads)."""
    E, N, K = w.shape
    b = w.double().reshape(E, N // 128, 128, K // 128, 128)
    s = (b.abs().amax(dim=(2, 4)).float() / 448.0)
    safe = torch.where(s > 0, s, torch.ones_like(s)).double()
    q = (b / safe[:, :, None, :, None]).float().to(torch.float8_e4m3fn)
    return q.view(torch.uint8).reshape(E, N, K).contiguous(), s.contiguous()


@test
def test_fp8_experts_matches_cpu():
    # An fp8_experts layer on this backend (torch uint8 weights and fp32 block
    # scales) against the CPU backend's on the same bytes: the GPU runs its
    # decode kernels at T = 3 and its large-batch FP8 GEMM at T = 300.
    cfg = dict(CASES[5])
    gen = torch.Generator(device=DEV)
    gen.manual_seed(31)
    dw, _ = make_weights(cfg, "bf16", gen)
    fw = dict(dw)
    fw["gate_up"], fw["gate_up_scale"] = e4m3_blocks(dw["gate_up"])
    fw["down"], fw["down_scale"] = e4m3_blocks(dw["down"])

    def to_np(t):
        if t.dtype == torch.bfloat16:
            return t.cpu().view(torch.int16).numpy().view(np.uint16)
        return t.cpu().numpy()

    kw = {k: v for k, v in cfg.items() if k != "name"}
    with moelink.Context(BACKEND) as gctx, moelink.Context("cpu") as cctx:
        g = moelink.MoE(gctx, dtype="bf16", max_tokens=512, fp8_experts=True, **kw)
        c = moelink.MoE(cctx, dtype="bf16", max_tokens=512, fp8_experts=True, **kw)
        assert g.fp8_experts and c.fp8_experts
        g.set_weights(**fw)
        c.set_weights(**{n: to_np(a) for n, a in fw.items()})
        for T in (3, 300):
            x, _ = make_x(cfg, T, "bf16", gen)
            out = torch.full_like(x, float("nan"))
            g.forward(x, out=out)
            sync()
            a = moelink.from_bf16(to_np(out)).astype(np.float64)
            b = moelink.from_bf16(c.forward(to_np(x))).astype(np.float64)
            assert np.isfinite(a).all(), "T=%d: unwritten or non-finite outputs" % T
            err = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert err <= 1e-2, "T=%d: rel L2 %.3g" % (T, err)


@test
def test_quantize_matches_cpu():
    # The 8-bit rows on this backend against the CPU backend: the same bytes,
    # scales and dequantized values, for bf16 rows with a zero block and
    # wide magnitudes.
    gen = torch.Generator(device=DEV)
    gen.manual_seed(5)
    x = torch.randn(7, 384, generator=gen, device=DEV, dtype=torch.float32)
    x = (x * torch.exp(torch.linspace(-8, 8, 7, device=DEV))[:, None]).to(torch.bfloat16)
    x[2, :128] = 0
    xn = x.cpu().view(torch.int16).numpy().view(np.uint16)
    with moelink.Context(BACKEND) as gctx, moelink.Context("cpu") as cctx:
        for fmt in ("fp8", "mxfp8"):
            q, s = gctx.quantize(x, fmt)
            qc, sc = cctx.quantize(xn, fmt)
            assert q.dtype == torch.uint8 and tuple(q.shape) == (7, 384)
            assert np.array_equal(q.cpu().numpy(), qc), fmt
            assert np.array_equal(s.cpu().numpy(), sc), fmt
            back = gctx.dequantize(q, s, fmt, dtype="bf16")
            backc = cctx.dequantize(qc, sc, fmt, dtype="bf16")
            assert np.array_equal(back.cpu().view(torch.int16).numpy().view(np.uint16), backc)


@test
def test_library_memory_views():
    # moelink._arrays.view: an array over memory the library owns (what
    # EP.dispatch returns), here over a tensor's own memory.
    from moelink import _arrays
    t = torch.arange(24, device=DEV, dtype=torch.float32).reshape(4, 6)
    where = ("cpu", 0) if ON_CPU else ("cuda", 0)
    for code, src in (("f32", t), ("bf16", t.to(torch.bfloat16)), ("i32", t.to(torch.int32)),
                      ("u8", t.to(torch.uint8))):
        v = _arrays.view(src.data_ptr(), (4, 6), code, where)
        if ON_CPU:
            v = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if code == "bf16" \
                else torch.from_numpy(v)
        assert v.dtype == src.dtype and tuple(v.shape) == (4, 6), (code, v.dtype)
        assert torch.equal(v.cpu(), src.cpu()), code


@test
def test_argument_errors():
    cfg = CASES[0]
    with moelink.Context(BACKEND) as ctx:
        gen = torch.Generator(device=DEV)
        gen.manual_seed(6)
        dw, _ = make_weights(cfg, "bf16", gen)
        moe = layer(ctx, cfg, "bf16")
        x, _ = make_x(cfg, 4, "bf16", gen)
        e = expect_raises(MoelinkError, moe.forward, x)
        assert e.status == Status.ERR_INVALID_STATE, e
        moe.set_weights(**dw)
        if not ON_CPU:
            e = expect_raises(ValueError, moe.forward, x.cpu())
            assert "torch CUDA tensor" in str(e), e
            e = expect_raises(ValueError, moe.forward,
                              np.zeros((4, cfg["hidden"]), np.uint16))
            assert "CUDA" in str(e), e
        e = expect_raises(TypeError, moe.forward, x.float())
        assert "bf16" in str(e), e
        e = expect_raises(ValueError, moe.forward, x.t().contiguous().t())
        e = expect_raises(ValueError, moe.set_weights, **dict(dw, down=dw["down"].transpose(1, 2)))
        e = expect_raises(MoelinkError, moe.set_weights,
                          **{n: a.float() for n, a in dw.items()})
        assert e.status == Status.ERR_DTYPE_MISMATCH, e
        if not ON_CPU and torch.cuda.device_count() > 1:
            e = expect_raises(ValueError, moe.forward, x.to("cuda:1"))
            assert "cuda:1" in str(e), e
        moe.close()


def main(argv):
    pick = argv[1:]
    print("device: %s, torch %s, moelink %s (%s)" % (
        "cpu (MOELINK_GPU_TEST_ON_CPU=1)" if ON_CPU else torch.cuda.get_device_name(DEV),
        torch.__version__, moelink.version(), moelink.library_path()))
    passed, failed, skipped = run(pick)
    return summary(passed, failed, skipped)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
