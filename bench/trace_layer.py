#!/usr/bin/env python3
"""Where a moelink layer call's time goes when calls run back to back.

Nsight Compute times each kernel alone (its own clock, nothing before it);
the benchmark times whole calls after an L2 flush. This script records the
kernels of moelink.MoE.forward calls as they run in the benchmark's pattern
(flush, call, flush, call, ...) with the PyTorch profiler (CUPTI), and
prints, per kernel of a call in start order, the median duration, the
median idle time before it (negative: it overlaps the kernel before, on
another stream or as a programmatic dependent) and its median start after
the call's first kernel, the sum of the kernels, the span of the call
(first kernel's start to last kernel's end) and the CUDA-event time around
it. Beside it, nvidia-smi samples the SM clock and the power every 20 ms
(from the warm-up on; the number of samples is printed: few samples say little).

  python3 bench/trace_layer.py --preset deepseek-v3 --tokens 8192 --iters 10

Options as bench/compare_torch.py (the torch pipelines are not run; --json
writes the per-kernel table). MOELINK_LIBRARY names the library.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_torch as ct  # noqa: E402  (the presets, weights and options)


def sample_clocks(path):
    """nvidia-smi writing SM clock, power and temperature every 20 ms to path."""
    q = "timestamp,clocks.sm,power.draw,temperature.gpu"
    try:
        return subprocess.Popen(["nvidia-smi", "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0")
                                 .split(",")[0], "--query-gpu=" + q, "--format=csv,noheader,nounits",
                                 "-lms", "20"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    except OSError:
        return None


def clock_summary(path):
    sm, pw = [], []
    try:
        for line in open(path):
            f = [s.strip() for s in line.split(",")]
            if len(f) >= 3:
                try:
                    sm.append(float(f[1]))
                    pw.append(float(f[2]))
                except ValueError:
                    pass
    except OSError:
        pass
    if not sm:
        return None
    # the samples while the GPU is busy: the upper half by power
    busy = sorted(zip(pw, sm))[len(sm) // 2:]
    return {"samples": len(sm), "sm_mhz_busy_median": statistics.median(s for _, s in busy),
            "sm_mhz_min": min(sm), "sm_mhz_max": max(sm),
            "power_w_busy_median": statistics.median(p for p, _ in busy), "power_w_max": max(pw)}


def kernels_of(trace_path):
    ev = json.load(open(trace_path))["traceEvents"]
    ks = [e for e in ev if e.get("cat") == "kernel"]
    ks.sort(key=lambda e: e["ts"])
    return ks


def calls_between_flushes(ks, flush_name):
    """Split the kernel list into calls: the kernels after each flush kernel."""
    calls, cur = [], None
    for e in ks:
        if flush_name in e["name"]:
            if cur:
                calls.append(cur)
            cur = []
        elif cur is not None:
            cur.append(e)
    if cur:
        calls.append(cur)
    return calls


def short(name):
    n = name.replace("void ", "")
    return n[:n.index("(")] if "(" in n else n


def main(argv=None):
    args = ct.parse_args(argv)
    import torch
    import moelink
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    ctx = moelink.Context("cuda", device=device.index or 0)
    flush = torch.empty(args.flush_mib * (1 << 20) // 4, dtype=torch.float32, device=device)
    stream = torch.cuda.Stream(device=device)
    results = []
    for pi, name in enumerate(args.presets):
        label, cfg = ct.layer_config(args, name, moelink)
        W = ct.make_weights(torch, cfg, dtype, device, args.seed + pi)
        mkw = {f: cfg[f] for f in ("hidden", "inter", "top_k", "router", "renormalize",
                                   "n_group", "topk_group", "routed_scaling", "correction_bias",
                                   "shared_inter", "shared_gate")}
        moe = moelink.MoE(ctx, experts=cfg["num_experts"], dtype=args.dtype,
                          max_tokens=args.max_tokens or max(args.tokens), **mkw)
        moe.set_weights(**W)
        x_all = torch.randn(max(args.tokens), cfg["hidden"], dtype=dtype, device=device)
        for T in args.tokens:
            x = x_all[:T]
            out = torch.empty_like(x)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.iters)]
            with tempfile.TemporaryDirectory() as td:
                cpath, tpath = os.path.join(td, "clocks.csv"), os.path.join(td, "trace.json")
                # the sampler takes a while to start: before the warm-up, so that its
                # samples cover the warm-up's calls and the traced ones
                smi = sample_clocks(cpath)
                time.sleep(0.5)
                # on a stream of its own, as a server would run it: the library launches
                # with programmatic dependent launch (PDL) only off the legacy default stream
                with torch.cuda.stream(stream):
                    for _ in range(args.warmup):
                        flush.sum()
                        moe.forward(x, out=out)
                    torch.cuda.synchronize()
                    with torch.profiler.profile(
                            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for s, e in ev:
                            flush.sum()
                            s.record()
                            moe.forward(x, out=out)
                            e.record()
                        torch.cuda.synchronize()
                if smi is not None:
                    smi.terminate()
                    smi.wait()
                prof.export_chrome_trace(tpath)
                ks = kernels_of(tpath)
                clocks = clock_summary(cpath)
            # the flush is torch's reduction kernel: its name is whatever launched last
            # before the first moelink kernel of the first call
            flush_name = next((k["name"] for k in ks if "ml" not in short(k["name"])[:4]), None)
            calls = calls_between_flushes(ks, flush_name) if flush_name else []
            calls = [c for c in calls if c]
            ev_ms = statistics.median(s.elapsed_time(e) for s, e in ev)
            n = min(len(c) for c in calls) if calls else 0
            same = all(len(c) == n for c in calls)
            rows = []
            for i in range(n if same else 0):
                # kernels of two streams may start in either order: each position is named
                # by its most frequent kernel, and only the calls that agree are counted
                names = [c[i]["name"] for c in calls]
                name = max(set(names), key=names.count)
                agree = [c for c in calls if c[i]["name"] == name]
                durs = [c[i]["dur"] for c in agree]
                gaps = [c[i]["ts"] - (c[i - 1]["ts"] + c[i - 1]["dur"]) if i else 0.0
                        for c in agree]
                starts = [c[i]["ts"] - c[0]["ts"] for c in agree]
                rows.append({"kernel": short(name), "calls": len(agree),
                             "grid": agree[0][i].get("args", {}).get("grid"),
                             "stream": agree[0][i].get("args", {}).get("stream"),
                             "us": statistics.median(durs), "gap_before_us":
                             statistics.median(gaps), "start_us": statistics.median(starts)})
            span = statistics.median(c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls) \
                if calls else 0.0
            ksum = statistics.median(sum(k["dur"] for k in c) for c in calls) if calls else 0.0
            print("\n## %s, T = %d: %d calls traced, %d kernels a call%s" %
                  (label, T, len(calls), n, "" if same else " (calls differ: no table)"))
            print("%3s %-44s %-14s %6s %5s %10s %10s %10s" % ("#", "kernel", "grid", "stream",
                                                              "calls", "us", "idle us",
                                                              "start us"))
            for i, r in enumerate(rows):
                print("%3d %-44s %-14s %6s %5d %10.1f %10.1f %10.1f" % (
                    i, r["kernel"][:44], str(r["grid"]), str(r["stream"]), r["calls"], r["us"],
                    r["gap_before_us"], r["start_us"]))
            print("kernels %.1f us, span %.1f us, CUDA events %.1f us" % (ksum, span,
                                                                       ev_ms * 1e3))
            if clocks:
                print("SM clock %.0f MHz (busy median; %.0f-%.0f), power %.0f W (busy median; "
                      "max %.0f), %d samples" % (clocks["sm_mhz_busy_median"], clocks["sm_mhz_min"],
                                                 clocks["sm_mhz_max"],
                                                 clocks["power_w_busy_median"],
                                                 clocks["power_w_max"], clocks["samples"]))
            results.append({"preset": label, "tokens": T, "kernels": rows, "kernel_sum_us": ksum,
                            "span_us": span, "event_us": ev_ms * 1e3, "clocks": clocks})
        del moe, W
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(device), "iters": args.iters,
                       "results": results}, f, indent=1)
        print("wrote " + args.json)
    ctx.close()


if __name__ == "__main__":
    main()
