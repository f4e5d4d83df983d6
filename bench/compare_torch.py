#!/usr/bin/env python3
"""moelink's MoE forward against two PyTorch pipelines of the same layer, on one GPU.

For each preset and token count T the script makes one set of random weights
and inputs with torch on the GPU and runs, on the same tensors:

  moelink    moelink.MoE.forward through the Python binding (zero-copy,
             torch's current stream)
  grouped_mm a PyTorch pipeline on torch._grouped_mm: fp32 router (x @ Wr^T,
             softmax or sigmoid, correction bias for selection, group-limited
             top-k, renormalization, scaling, as the preset says), tokens sorted
             by expert, offsets = cumsum of counts (int32), gathered rows, one
             grouped GEMM for gate+up and one for down, SwiGLU between, the k
             expert outputs of each token summed in slot order (a batched GEMM
             with the routing weights: no atomics), plus the shared expert
  loop       the same router, then a Python loop over the experts that got
             tokens: F.linear for gate+up and down, index_add_ back (one expert
             at a time, so the sum order is fixed)

Every output is compared with an fp32 torch reference of the same math (the
bf16 weights and inputs upcast, fp32 accumulation), per token. The moelink
router and the torch router may pick different experts for a token whose
k-th and (k+1)-th scores are nearly tied in fp32; such tokens are counted and
reported, and the error is judged on the tokens where both routers agree:
rel L2 <= --tol, and at most --max-bad-frac of all tokens beyond --tol.

Timing: CUDA events around each call, the median of --iters iterations after
--warmup, with a 256 MiB buffer written before each timed iteration so that
no weights stay in L2 between iterations.

Weights use moelink's layouts: router [E, H], gate_up [E, 2I, H] (the I gate
rows of an expert first), down [E, H, I], shared [2Is, H] / [H, Is], shared
gate [H]; torch._grouped_mm gets the transposed views [E, H, 2I] / [E, I, H]
(mat_b [E, K, N] with stride 1 along K), which it accepts without a copy.
Only one preset's weights are alive at a time (deepseek-v3 is about 22 GB in
bf16).

  python3 bench/compare_torch.py --preset deepseek-v3 --tokens 1,128,2048 --json out.json

MOELINK_LIBRARY names the library (a CUDA build); otherwise the binding looks
in build*/ at the repository root. --device cpu runs the same script with the
moelink CPU backend and torch on the CPU (host timers, no L2 flush): a dry run
for small --hidden/--inter/--experts overrides, not a benchmark.
"""

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

DEFAULT_PRESETS = "mixtral-8x7b,qwen3-30b-a3b,deepseek-v3"

# Used only when the library cannot be loaded (--skip-moelink); the library's
# own presets win otherwise. Same fields as moelink.preset_config().
FALLBACK_PRESETS = {
    "mixtral-8x7b": dict(hidden=4096, inter=14336, num_experts=8, top_k=2, router="softmax",
                         renormalize=True, n_group=1, topk_group=1, routed_scaling=1.0,
                         correction_bias=False, shared_inter=0, shared_gate=False),
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, num_experts=128, top_k=8, router="softmax",
                          renormalize=True, n_group=1, topk_group=1, routed_scaling=1.0,
                          correction_bias=False, shared_inter=0, shared_gate=False),
    "deepseek-v3": dict(hidden=7168, inter=2048, num_experts=256, top_k=8, router="sigmoid",
                        renormalize=True, n_group=8, topk_group=4, routed_scaling=2.5,
                        correction_bias=True, shared_inter=2048, shared_gate=False),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="moelink forward vs torch._grouped_mm and per-expert-loop pipelines",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[-1])
    p.add_argument("--preset", default=DEFAULT_PRESETS,
                   help="comma-separated preset names, or 'custom' to start from the "
                        "defaults (default: %(default)s)")
    p.add_argument("--tokens", default="1,16,128,512,2048,8192",
                   help="comma-separated token counts (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"],
                   help="activations and weights (default: %(default)s; torch._grouped_mm's "
                        "fast path is bf16 only)")
    p.add_argument("--iters", type=int, default=30, help="timed iterations (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default: 5)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tol", type=float, default=2e-2,
                   help="rel L2 tolerance vs the fp32 reference (default: %(default)s)")
    p.add_argument("--max-bad-frac", type=float, default=0.01,
                   help="largest fraction of tokens allowed beyond --tol (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="moelink layer max_tokens (default: the largest --tokens)")
    p.add_argument("--flush-mib", type=int, default=256,
                   help="MiB written before each timed iteration (default: %(default)s)")
    p.add_argument("--flush", choices=("read", "write"),
                   default=os.environ.get("MOELINK_BENCH_L2_FLUSH") or "read",
                   help="how the L2 is flushed: a read of the flush buffer (clean L2, default) "
                        "or a write (dirty lines the timed call writes back); "
                        "default from MOELINK_BENCH_L2_FLUSH as for moelink bench")
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert loop pipeline")
    p.add_argument("--skip-moelink", action="store_true",
                   help="run only the torch pipelines (e.g. with a library without CUDA)")
    p.add_argument("--device", default="cuda",
                   help="'cuda', 'cuda:N' or 'cpu' (a dry run; default: cuda)")
    g = p.add_argument_group("shape overrides (applied to every preset)")
    for name, typ in (("hidden", int), ("inter", int), ("experts", int), ("top-k", int),
                      ("n-group", int), ("topk-group", int), ("routed-scaling", float),
                      ("shared-inter", int)):
        g.add_argument("--" + name, type=typ)
    g.add_argument("--router", choices=["softmax", "sigmoid", "topk_softmax"])
    for name in ("renormalize", "correction-bias", "shared-gate"):
        g.add_argument("--" + name, type=int, choices=[0, 1])
    a = p.parse_args(argv)
    try:
        a.tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        p.error("--tokens must be comma-separated integers")
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens needs positive integers")
    a.presets = [s.strip() for s in a.preset.split(",") if s.strip()]
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return a


OVERRIDES = {"hidden": "hidden", "inter": "inter", "experts": "num_experts", "top_k": "top_k",
             "n_group": "n_group", "topk_group": "topk_group",
             "routed_scaling": "routed_scaling", "shared_inter": "shared_inter",
             "router": "router", "renormalize": "renormalize",
             "correction_bias": "correction_bias", "shared_gate": "shared_gate"}


def layer_config(args, name, moelink):
    """The model fields for a preset (+ overrides) as a dict."""
    if name == "custom":
        cfg = dict(hidden=0, inter=0, num_experts=0, top_k=0, router="softmax",
                   renormalize=True, n_group=1, topk_group=1, routed_scaling=1.0,
                   correction_bias=False, shared_inter=0, shared_gate=False)
    elif moelink is not None:
        cfg = moelink.preset_config(name)
        cfg.pop("dtype", None)
        cfg.pop("max_tokens", None)
    elif name in FALLBACK_PRESETS:
        cfg = dict(FALLBACK_PRESETS[name])
    else:
        raise SystemExit("unknown preset %r (the library is not loaded: known here: %s)" %
                         (name, ", ".join(FALLBACK_PRESETS)))
    changed = False
    for arg, field in OVERRIDES.items():
        v = getattr(args, arg)
        if v is not None:
            cfg[field] = type(cfg[field])(v) if not isinstance(cfg[field], bool) else bool(v)
            changed = True
    label = name + ("*" if changed and name != "custom" else "")
    return label, cfg


# ---------------------------------------------------------------------------
# The torch side
# ---------------------------------------------------------------------------

def make_weights(torch, cfg, dtype, device, seed):
    """Random weights in moelink's layouts, ~unit-variance activations."""
    H, I, E = cfg["hidden"], cfg["inter"], cfg["num_experts"]
    Is = cfg["shared_inter"]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(shape, scale, dt=dtype):
        t = torch.randn(shape, generator=gen, dtype=dt, device=device)
        return t.mul_(scale)

    W = {"router": randn((E, H), 1.0 / math.sqrt(H)),
         "gate_up": randn((E, 2 * I, H), 1.0 / math.sqrt(H)),
         "down": randn((E, H, I), 1.0 / math.sqrt(I))}
    if cfg["correction_bias"]:
        W["correction_bias"] = randn((E,), 0.1, torch.float32)
    if Is:
        W["shared_gate_up"] = randn((2 * Is, H), 1.0 / math.sqrt(H))
        W["shared_down"] = randn((H, Is), 1.0 / math.sqrt(Is))
        if cfg["shared_gate"]:
            W["shared_gate"] = randn((H,), 1.0 / math.sqrt(H))
    return W


class TorchMoE:
    """The layer in eager PyTorch, in two flavours sharing one router."""

    def __init__(self, torch, cfg, W):
        import torch.nn.functional as F
        self.torch, self.F, self.cfg, self.W = torch, F, cfg, W
        self.router32 = W["router"].float()
        self.bias = W.get("correction_bias")
        # mat_b for torch._grouped_mm: [E, K, N] views with stride 1 along K
        self.gate_up_t = W["gate_up"].transpose(1, 2)
        self.down_t = W["down"].transpose(1, 2)
        self.grouped_mm = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)

    def route(self, x):
        """(ids [T, k] int64, weights [T, k] fp32) as the config says."""
        torch, c = self.torch, self.cfg
        T, E, k = x.shape[0], c["num_experts"], c["top_k"]
        logits = x.float() @ self.router32.t()
        if c["router"] == "softmax":
            scores = logits.softmax(dim=-1)
        elif c["router"] == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits
        sel = scores + self.bias if self.bias is not None else scores
        ng, tg = c["n_group"], c["topk_group"]
        if ng > 1:
            gs = E // ng
            gscore = sel.view(T, ng, gs).topk(min(2, gs), dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(gscore, dtype=torch.bool)
            keep.scatter_(1, gscore.topk(tg, dim=-1).indices, True)
            keep = keep.unsqueeze(-1).expand(T, ng, gs).reshape(T, E)
            sel = sel.masked_fill(~keep, float("-inf"))
        ids = sel.topk(k, dim=-1).indices
        if c["router"] == "topk_softmax":
            w = logits.gather(1, ids).softmax(dim=-1)
        else:
            w = scores.gather(1, ids)
            if c["renormalize"]:
                w = w / w.sum(dim=-1, keepdim=True)
        if c["routed_scaling"] != 1.0:
            w = w * c["routed_scaling"]
        return ids, w

    def shared(self, x):
        F, W, Is = self.F, self.W, self.cfg["shared_inter"]
        gu = F.linear(x, W["shared_gate_up"])
        y = F.linear(F.silu(gu[:, :Is]) * gu[:, Is:], W["shared_down"])
        if "shared_gate" in W:
            y = y * self.torch.sigmoid(F.linear(x, W["shared_gate"].view(1, -1)))
        return y

    def grouped(self, x):
        torch, F, c = self.torch, self.F, self.cfg
        T, E, k, I = x.shape[0], c["num_experts"], c["top_k"], c["inter"]
        ids, w = self.route(x)
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)  # pairs in expert-major order
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0, dtype=torch.int32)
        xs = x.index_select(0, order // k)
        gu = self.grouped_mm(xs, self.gate_up_t, offs=offs)
        h = F.silu(gu[:, :I]) * gu[:, I:]
        y = self.grouped_mm(h, self.down_t, offs=offs)
        inv = torch.empty_like(order)
        inv.scatter_(0, order, torch.arange(order.numel(), device=x.device))
        # token-major [T, k, H]; out[t] = sum_j w[t, j] * y[t, j] in one batched GEMM
        y_tok = y.index_select(0, inv).view(T, k, -1)
        out = torch.bmm(w.to(x.dtype).unsqueeze(1), y_tok).squeeze(1)
        if c["shared_inter"]:
            out = out + self.shared(x)
        return out

    def loop(self, x):
        torch, F, c = self.torch, self.F, self.cfg
        T, E, k, I = x.shape[0], c["num_experts"], c["top_k"], c["inter"]
        ids, w = self.route(x)
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()  # the loop needs them on the host
        tok = order // k
        ws = w.view(-1)[order]
        out = torch.zeros(T, c["hidden"], dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t = tok[start:start + n]
            gu = F.linear(x.index_select(0, t), self.W["gate_up"][e])
            y = F.linear(F.silu(gu[:, :I]) * gu[:, I:], self.W["down"][e])
            # a token meets an expert at most once: no two rows of one call collide
            out.index_add_(0, t, y.float() * ws[start:start + n, None])
            start += n
        if c["shared_inter"]:
            out += self.shared(x).float()
        return out.to(x.dtype)

    def reference(self, x, ids, w):
        """fp32 math of the layer for given routing: weights upcast one expert at
        a time, so the reference never holds an fp32 copy of all experts."""
        torch, F, c = self.torch, self.F, self.cfg
        I, Is = c["inter"], c["shared_inter"]
        xf = x.float()
        out = torch.zeros(x.shape[0], c["hidden"], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            t, j = torch.nonzero(ids == e, as_tuple=True)
            gu = xf[t] @ self.W["gate_up"][e].float().t()
            y = (F.silu(gu[:, :I]) * gu[:, I:]) @ self.W["down"][e].float().t()
            out.index_add_(0, t, y * w[t, j, None])
        if Is:
            gu = xf @ self.W["shared_gate_up"].float().t()
            y = (F.silu(gu[:, :Is]) * gu[:, Is:]) @ self.W["shared_down"].float().t()
            if "shared_gate" in self.W:
                y = y * torch.sigmoid(xf @ self.W["shared_gate"].float())[:, None]
            out += y
        return out


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, device, iters, warmup, flush_mib, flush_mode="read"):
        self.torch, self.device = torch, device
        self.flush_mode = flush_mode
        self.iters, self.warmup = iters, warmup
        self.cuda = device.type == "cuda"
        self.flush = None
        if self.cuda and flush_mib > 0:
            self.flush = torch.empty(flush_mib * (1 << 20) // 4, dtype=torch.float32,
                                     device=device)

    def __call__(self, fn):
        """Median, min and max milliseconds of fn()."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            ts = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts), min(ts), max(ts)
        torch.cuda.synchronize(self.device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(self.iters)]
        for i, (s, e) in enumerate(ev):
            if self.flush is not None:
                if self.flush_mode == "write":
                    self.flush.fill_(float(i))
                else:
                    self.flush.sum()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        ts = [s.elapsed_time(e) for s, e in ev]
        return statistics.median(ts), min(ts), max(ts)


def compare(torch, out, ref, agree, tol):
    """Per-token and overall error of out vs the fp32 reference."""
    o, r = out.float(), ref
    tok_err = (o - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-30)
    bad = tok_err > tol
    n = o.shape[0]
    n_agree = int(agree.sum().item())
    if n_agree:
        ra = r[agree]
        rel_agree = ((o[agree] - ra).norm() / ra.norm().clamp_min(1e-30)).item()
    else:
        rel_agree = float("nan")
    return {
        "rel_l2": ((o - r).norm() / r.norm().clamp_min(1e-30)).item(),
        "rel_l2_agreeing": rel_agree,
        "tokens_beyond_tol": int(bad.sum().item()),
        "frac_beyond_tol": float(bad.sum().item()) / n,
        "routing_disagreements": n - n_agree,
        "max_token_err": tok_err.max().item(),
        "finite": bool(torch.isfinite(o).all().item()),
    }


def verdict(c, tol, max_bad):
    return (c["finite"] and c["rel_l2_agreeing"] <= tol and c["frac_beyond_tol"] <= max_bad)


def fmt_ms(v):
    return "-" if v is None else ("%.3f" % v if v < 100 else "%.1f" % v)


def fmt_x(a, b):
    return "-" if a is None or b is None or a <= 0 else "%.2fx" % (b / a)


def describe(label, cfg):
    return "%s: H %d, I %d, E %d, k %d, router %s%s%s%s%s, shared %d%s" % (
        label, cfg["hidden"], cfg["inter"], cfg["num_experts"], cfg["top_k"], cfg["router"],
        " renorm" if cfg["renormalize"] else "",
        " groups %d/%d" % (cfg["topk_group"], cfg["n_group"]) if cfg["n_group"] > 1 else "",
        " bias" if cfg["correction_bias"] else "",
        " scale %g" % cfg["routed_scaling"] if cfg["routed_scaling"] != 1.0 else "",
        cfg["shared_inter"], " gated" if cfg["shared_gate"] else "")


def run_preset(env, pi, name):
    """All token counts of one preset; its weights die when this returns.
    Returns (rows, all checks passed)."""
    args, torch, moelink, ctx = env["args"], env["torch"], env["moelink"], env["ctx"]
    device, dtype, timer = env["device"], env["dtype"], env["timer"]
    label, cfg = layer_config(args, name, moelink)
    H, I, E, k = cfg["hidden"], cfg["inter"], cfg["num_experts"], cfg["top_k"]
    Is = cfg["shared_inter"]
    print("\n## " + describe(label, cfg))
    W = make_weights(torch, cfg, dtype, device, args.seed + pi)
    tm = TorchMoE(torch, cfg, W)
    gmm_ok = tm.grouped_mm is not None and all((d * 2) % 16 == 0 for d in (H, I, 2 * I))
    if not gmm_ok:
        print("(grouped_mm skipped: %s)" % ("torch has no _grouped_mm" if tm.grouped_mm is None
                                             else "H and I must be multiples of 8"))
    moe = None
    if ctx is not None:
        mkw = {f: cfg[f] for f in ("hidden", "inter", "top_k", "router", "renormalize",
                                   "n_group", "topk_group", "routed_scaling", "correction_bias",
                                   "shared_inter", "shared_gate")}
        moe = moelink.MoE(ctx, experts=E, dtype=args.dtype, max_tokens=env["max_tokens"], **mkw)
        moe.set_weights(**W)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 1000 + pi)
    x_all = torch.randn(max(args.tokens), H, generator=gen, dtype=dtype, device=device)
    esz = torch.tensor([], dtype=dtype).element_size()
    every_ok = True
    rows = []
    print("%7s %11s %11s %11s %10s %10s %9s %9s  %s" % (
        "T", "moelink ms", "grouped ms", "loop ms", "vs grouped", "vs loop", "TFLOP/s", "GB/s",
        "check: rel L2 vs fp32 ref (routing disagreements)"))
    try:
        for T in args.tokens:
            x = x_all[:T]
            flops = 2.0 * T * (H * E + k * 3 * H * I + 3 * H * Is)
            ids_ref, w_ref = tm.route(x)
            ref = tm.reference(x, ids_ref, w_ref)
            n_used = int(torch.unique(ids_ref).numel())
            # the least a forward reads and writes: the experts it uses, router,
            # shared expert, x and out
            min_bytes = esz * (n_used * 3 * H * I + E * H + 3 * H * Is + 2 * T * H)
            row = {"preset": label, "config": cfg, "tokens": T, "flops": flops,
                   "experts_used": n_used, "min_bytes": min_bytes}
            checks = {}
            every = torch.ones(T, dtype=torch.bool, device=device)
            if moe is not None:
                out_ml = torch.empty_like(x)
                moe.forward(x, out=out_ml)
                ids_ml, _ = moe.route(x)
                agree = (torch.sort(ids_ml.long(), 1).values ==
                         torch.sort(ids_ref, 1).values).all(1)
                checks["moelink"] = compare(torch, out_ml, ref, agree, args.tol)
                row["moelink_ms"] = timer(lambda: moe.forward(x, out=out_ml))[0]
            if gmm_ok:
                checks["grouped_mm"] = compare(torch, tm.grouped(x), ref, every, args.tol)
                row["grouped_mm_ms"] = timer(lambda: tm.grouped(x))[0]
            if not args.no_loop:
                checks["loop"] = compare(torch, tm.loop(x), ref, every, args.tol)
                row["loop_ms"] = timer(lambda: tm.loop(x))[0]
            for c in checks.values():
                c["ok"] = verdict(c, args.tol, args.max_bad_frac)
                every_ok = every_ok and c["ok"]
            row["checks"] = checks
            ml, gm, lp = row.get("moelink_ms"), row.get("grouped_mm_ms"), row.get("loop_ms")
            if ml:
                row["speedup_vs_grouped_mm"] = gm / ml if gm else None
                row["speedup_vs_loop"] = lp / ml if lp else None
                row["moelink_tflops"] = flops / (ml * 1e-3) / 1e12
                row["moelink_gbps"] = min_bytes / (ml * 1e-3) / 1e9
            best = ml or gm or lp
            note = "; ".join("%s %.1e%s%s" % (
                impl, c["rel_l2_agreeing"],
                " (%d)" % c["routing_disagreements"] if c["routing_disagreements"] else "",
                "" if c["ok"] else " FAIL: %d tokens > tol" % c["tokens_beyond_tol"])
                for impl, c in checks.items())
            print("%7d %11s %11s %11s %10s %10s %9.2f %9.0f  %s" % (
                T, fmt_ms(ml), fmt_ms(gm), fmt_ms(lp), fmt_x(ml, gm), fmt_x(ml, lp),
                flops / (best * 1e-3) / 1e12 if best else 0.0,
                min_bytes / (best * 1e-3) / 1e9 if best else 0.0, note))
            sys.stdout.flush()
            rows.append(row)
    finally:
        if moe is not None:
            moe.close()
    return rows, every_ok


def main(argv=None):
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("torch sees no CUDA device (use --device cpu for a dry run)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
        torch.backends.cudnn.allow_tf32 = False
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]

    moelink = ctx = None
    if not args.skip_moelink:
        import moelink
        try:
            ctx = moelink.Context("cuda" if device.type == "cuda" else "cpu",
                                  device=device.index or 0)
        except moelink.MoelinkError as e:
            raise SystemExit("moelink (%s) cannot run on %s: %s\n(--skip-moelink runs the torch "
                             "pipelines alone)" % (moelink.library_path(), device, e))
    else:
        try:
            import moelink
            moelink.load()
        except (ImportError, OSError):
            moelink = None

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {
        "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
        "moelink": moelink.version() if moelink else None,
        "library": moelink.library_path() if moelink else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": args.dtype, "iters": args.iters, "warmup": args.warmup,
        "flush_mib": args.flush_mib if device.type == "cuda" else 0,
        "l2_flush": args.flush if device.type == "cuda" else None,
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("MOELINK_")},
        "tol": args.tol, "max_bad_frac": args.max_bad_frac, "seed": args.seed,
        "timing": "median of CUDA-event times" if device.type == "cuda" else "host timer (dry run)",
        "results": [],
    }
    print("# %s | torch %s | moelink %s | %s | iters %d (median), warmup %d, L2 flush %d MiB (%s)" %
          (gpu, torch.__version__, meta["moelink"] or "-", args.dtype, args.iters, args.warmup,
           meta["flush_mib"], meta["l2_flush"]))
    env = {"args": args, "torch": torch, "moelink": moelink, "ctx": ctx, "device": device,
           "dtype": dtype, "max_tokens": args.max_tokens or max(args.tokens),
           "timer": Timer(torch, device, args.iters, args.warmup, args.flush_mib, args.flush)}
    all_ok = True
    for pi, name in enumerate(args.presets):
        rows, ok = run_preset(env, pi, name)
        meta["results"].extend(rows)
        all_ok = all_ok and ok
        if device.type == "cuda":
            torch.cuda.empty_cache()  # give the preset's weights back before the next one

    print("\nTFLOP/s and GB/s are moelink's (the first torch pipeline's when moelink is "
          "skipped); GB/s counts the weights of the experts used, the router, the shared "
          "expert, x and out once.\nRouting disagreements (in parentheses) are tokens whose "
          "top-k set differs between moelink's router and torch's: near-ties of fp32 scores, "
          "where either choice is right. They are reported, not failed: the rel L2 shown is "
          "over the tokens where the routers agree, and at most %g of all tokens may exceed "
          "the tolerance %g." % (args.max_bad_frac, args.tol))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
        print("wrote %s" % args.json)
    if ctx is not None:
        ctx.close()
    print("all checks passed" if all_ok else "SOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
