#!/usr/bin/env python3
"""PyTorch's tensor-parallel GEMMs beside moelink's `moelink bench tp`, on the same shapes.

One process per GPU, started by moelink's launcher (no torchrun):

  moelink launch -n 2 -- python3 bench/compare_tp.py --json tp_torch.json

Each rank reads MOELINK_RANK, MOELINK_WORLD_SIZE and MOELINK_LOCAL_RANK, and the
ranks meet through a file store under /tmp named after MOELINK_UNIQUE_ID (the
same on every rank of one launch), then run torch.distributed with NCCL. Per
shape, on bf16 inputs from torch.randn (--init uniform: uniform in [-1, 1), as
moelink bench tp draws them) on each rank:

  gemm   torch.matmul alone on the rank's local problem (the floor)
  seq    that matmul and the torch.distributed collective in sequence:
         all_gather_into_tensor then matmul (ag), matmul then
         reduce_scatter_tensor (rs) or all_reduce (ar)
  fused  torch.ops.symm_mem.fused_all_gather_matmul (ag) and
         torch.ops.symm_mem.fused_matmul_reduce_scatter (rs), after importing
         torch.distributed._symmetric_memory and enabling it for the group
         (PyTorch has no fused matmul + all-reduce: ar gets none)

Shapes and their meaning are those of `moelink bench tp` (per rank; see its
--help): ag a [M/TP, K], weight [N, K] (N = this rank's N_local), c [M, N];
rs and ar a [M, K], weight [N, K] (K = K_local). --dims layer divides the
listed N (ag) or K (rs, ar) by TP. The weight is a linear layer's [N, K]; the
matmuls get its transposed view, as F.linear would.

Timing: CUDA events around each call, median of --iters after --warmup, a
256 MiB buffer written and a one-element all-reduce (lining the ranks up)
before each timed call; a row's time is the slowest rank's median. The fused
op's output is compared with the seq output (relative L2) before it is timed.
An op this torch does not have, or that fails, is recorded with the reason and
the run goes on. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import traceback
import warnings

# Before torch (and NCCL) start: multicast must never be set up on the shared machine.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

OPS = ("ag", "rs", "ar")
OP_NAMES = {"ag": "ag_gemm", "rs": "gemm_rs", "ar": "gemm_ar"}
DEFAULT_SHAPES = {
    "ag": [(8192, 8192, 8192), (2048, 14336, 8192), (8192, 14336, 8192)],
    "rs": [(8192, 8192, 8192), (2048, 8192, 14336), (8192, 8192, 14336)],
    "ar": [(1, 8192, 4096), (16, 8192, 4096), (128, 8192, 4096), (8192, 8192, 4096)],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="torch matmul / matmul + collective / symm_mem fused ops, per rank",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[1])
    p.add_argument("--ops", default="ag,rs,ar", help="comma-separated subset of ag,rs,ar")
    p.add_argument("--shapes", default="default",
                   help="'default' (issue 8's shapes) or MxNxK,... applied to every op")
    p.add_argument("--dims", default="local", choices=["local", "layer"],
                   help="local: N (ag) / K (rs, ar) are per rank; layer: divided by TP")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--flush-mib", type=int, default=256)
    p.add_argument("--flush", choices=("read", "write"),
                   default=os.environ.get("MOELINK_BENCH_L2_FLUSH") or "read",
                   help="L2 flush by a read (default) or a write of the flush buffer, as for "
                        "moelink bench (MOELINK_BENCH_L2_FLUSH)")
    p.add_argument("--init", choices=("normal", "uniform"), default="normal",
                   help="inputs from torch.randn (default) or uniform in [-1, 1) as moelink "
                        "bench tp's generator draws them")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the results here")
    a = p.parse_args(argv)
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    for o in a.ops:
        if o not in OPS:
            p.error("--ops: unknown op %r (ag, rs, ar)" % o)
    if a.shapes == "default":
        a.shape_list = None
    else:
        a.shape_list = []
        for item in a.shapes.split(","):
            try:
                m, n, k = (int(x) for x in item.lower().split("x"))
            except ValueError:
                p.error("--shapes: %r is not MxNxK" % item)
            if min(m, n, k) < 1:
                p.error("--shapes: %r has a size < 1" % item)
            a.shape_list.append((m, n, k))
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return a


def world_from_env():
    def env(names, dflt=None):
        for n in names:
            v = os.environ.get(n)
            if v not in (None, ""):
                return v
        return dflt

    rank = env(["MOELINK_RANK", "RANK"])
    size = env(["MOELINK_WORLD_SIZE", "WORLD_SIZE"])
    if rank is None or size is None:
        sys.exit("compare_tp.py: run me under the launcher: "
                 "moelink launch -n 2 -- python3 bench/compare_tp.py")
    local = env(["MOELINK_LOCAL_RANK", "LOCAL_RANK"], rank)
    key = env(["MOELINK_UNIQUE_ID"], "") or env(["MASTER_PORT"], "nokey")
    return int(rank), int(size), int(local), hashlib.sha1(key.encode()).hexdigest()[:16]


def main(argv=None):
    args = parse_args(argv)
    rank, world, local, key = world_from_env()
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    store_path = "/tmp/moelink-compare-tp-%s" % key
    init = dict(backend="nccl", init_method="file://" + store_path, rank=rank,
                world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        dist.init_process_group(device_id=dev, **init)
    except TypeError:  # a torch without device_id
        dist.init_process_group(**init)
    group = dist.group.WORLD
    group_name = getattr(group, "group_name", None)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    notes = {}
    symm_ok = False
    try:
        import torch.distributed._symmetric_memory as symm_mem
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group_name)
        symm_ok = True
    except Exception as e:  # noqa: BLE001 - any failure is a result to record
        notes["symm_mem"] = "import/enable failed: %s: %s" % (type(e).__name__, e)
    fused_ops = {}
    if symm_ok:
        for op, name in (("ag", "fused_all_gather_matmul"), ("rs", "fused_matmul_reduce_scatter")):
            try:
                fused_ops[op] = getattr(torch.ops.symm_mem, name)
            except (AttributeError, RuntimeError) as e:
                notes[op] = "torch.ops.symm_mem.%s missing: %s" % (name, e)
    notes["ar"] = "PyTorch has no fused matmul + all-reduce: no fused column"

    flush = torch.empty(args.flush_mib << 20, dtype=torch.uint8, device=dev)
    line_up = torch.zeros(1, device=dev)
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)

    def slowest(us):
        t = torch.tensor([us if us is not None else float("nan")], dtype=torch.float64,
                         device=dev)
        all_t = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(all_t, t)
        vals = [float(x.item()) for x in all_t]
        return None if any(v != v for v in vals) else max(vals)

    def time_us(fn):
        times = []
        for it in range(-args.warmup, args.iters):
            if args.flush == "write":
                flush.fill_(it & 0xFF)
            else:
                flush.sum()
            dist.all_reduce(line_up)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            if it >= 0:
                times.append(start.elapsed_time(stop) * 1e3)
        return statistics.median(times)

    def rel_l2(x, y):
        x = x.float()
        y = y.float()
        den = torch.linalg.vector_norm(y).item()
        num = torch.linalg.vector_norm(x - y).item()
        return num / den if den > 0 else num

    gen = torch.Generator(device=dev)
    rows = []
    name = torch.cuda.get_device_name(dev)
    if rank == 0:
        print("compare_tp: %d ranks (TP = %d), %s, torch %s, %s, dims %s" %
              (world, world, name, torch.__version__, args.dtype, args.dims))
        print("%-8s %6s %6s %6s  %10s %8s  %10s %8s  %10s %8s  %10s %10s  %s" %
              ("op", "M", "N", "K", "fused_us", "TFLOP/s", "gemm_us", "TFLOP/s", "seq_us",
               "TFLOP/s", "fused/gemm", "seq/fused", "fused rel L2 vs seq"))
        sys.stdout.flush()

    for op in args.ops:
        shapes = args.shape_list or DEFAULT_SHAPES[op]
        for (m, n_list, k_list) in shapes:
            n, k = n_list, k_list
            row = {"op": OP_NAMES[op], "m": m, "list_n": n_list, "list_k": k_list}
            if args.dims == "layer":
                if op == "ag":
                    n = n_list // world
                else:
                    k = k_list // world
            if (op != "ar" and m % world) or min(n, k) < 1:
                row["error"] = "shape does not divide over %d ranks" % world
                rows.append(row)
                continue
            row.update(n=n, k=k, flops=2.0 * m * n * k)
            gen.manual_seed(args.seed * 1000003 + 7919 * rank + OPS.index(op))
            a_rows = m // world if op == "ag" else m
            try:
                if args.init == "uniform":
                    a = (torch.rand(a_rows, k, generator=gen, device=dev) * 2 - 1).to(dtype)
                    w = (torch.rand(n, k, generator=gen, device=dev) * 2 - 1).to(dtype)
                else:
                    a = torch.randn(a_rows, k, generator=gen, device=dev, dtype=dtype)
                    w = torch.randn(n, k, generator=gen, device=dev, dtype=dtype)
                if op == "ag":
                    a_full = torch.empty(m, k, device=dev, dtype=dtype)
                    c = torch.empty(m, n, device=dev, dtype=dtype)

                    def gemm():
                        torch.matmul(a_full, w.t(), out=c)

                    def seq():
                        dist.all_gather_into_tensor(a_full, a)
                        torch.matmul(a_full, w.t(), out=c)
                else:
                    part = torch.empty(m, n, device=dev, dtype=dtype)
                    c = torch.empty(m // world, n, device=dev, dtype=dtype) if op == "rs" else part

                    def gemm():
                        torch.matmul(a, w.t(), out=part)

                    if op == "rs":
                        def seq():
                            torch.matmul(a, w.t(), out=part)
                            dist.reduce_scatter_tensor(c, part)
                    else:
                        def seq():
                            torch.matmul(a, w.t(), out=part)
                            dist.all_reduce(part)
            except Exception as e:  # noqa: BLE001
                row["error"] = "%s: %s" % (type(e).__name__, e)
                rows.append(row)
                continue

            seq()
            torch.cuda.synchronize()
            ref = c.clone()
            fused = None
            if op in fused_ops:
                f = fused_ops[op]
                if op == "ag":
                    def call_ag():
                        try:
                            return f(a, [w.t()], 0, group_name, return_A=False)[1][0]
                        except TypeError:  # a torch without return_A
                            return f(a, [w.t()], 0, group_name)[1][0]
                    fused = call_ag
                else:
                    def fused():
                        return f(a, w.t(), "sum", 0, group_name)
            if fused is not None:
                try:
                    out = fused()
                    torch.cuda.synchronize()
                    row["fused_rel_l2_vs_seq"] = rel_l2(out, ref)
                    del out
                    row["fused_us"] = time_us(fused)
                except Exception as e:  # noqa: BLE001
                    row["fused_error"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0]
                                                     if str(e) else "")
                    if rank == 0:
                        traceback.print_exc()
            elif op in notes:
                row["fused_error"] = notes[op]
            row["gemm_us"] = time_us(gemm)
            row["seq_us"] = time_us(seq)
            for key_ in ("fused_us", "gemm_us", "seq_us"):
                row[key_] = slowest(row.get(key_))
            for key_ in ("fused", "gemm", "seq"):
                t = row.get(key_ + "_us")
                row[key_ + "_TFLOPs"] = row["flops"] / (t * 1e-6) / 1e12 if t else None
            f_us, g_us, s_us = row.get("fused_us"), row["gemm_us"], row["seq_us"]
            row["fused_over_gemm"] = f_us / g_us if f_us and g_us else None
            row["seq_over_fused"] = s_us / f_us if f_us and s_us else None
            rows.append(row)
            if rank == 0:
                def fmt(v, spec):
                    return spec % v if v is not None else "%*s" % (len(spec % 0.0), "-")
                print("%-8s %6d %6d %6d  %s %s  %s %s  %s %s  %s %s  %s" % (
                    OP_NAMES[op], m, n, k, fmt(f_us, "%10.1f"), fmt(row["fused_TFLOPs"], "%8.1f"),
                    fmt(g_us, "%10.1f"), fmt(row["gemm_TFLOPs"], "%8.1f"), fmt(s_us, "%10.1f"),
                    fmt(row["seq_TFLOPs"], "%8.1f"), fmt(row["fused_over_gemm"], "%10.3f"),
                    fmt(row["seq_over_fused"], "%10.3f"),
                    ("%.2e" % row["fused_rel_l2_vs_seq"]) if "fused_rel_l2_vs_seq" in row
                    else row.get("fused_error", "-")))
                sys.stdout.flush()
            del a, w, c, ref
            if op == "ag":
                del a_full
            else:
                del part
            torch.cuda.empty_cache()

    if rank == 0 and args.json:
        meta = {
            "tool": "bench/compare_tp.py",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_commit": os.environ.get("MOELINK_COMMIT") or None,
            "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("MOELINK_")},
            "gpu": name,
            "nranks": world,
            "tp": world,
            "torch": torch.__version__,
            "nccl": ".".join(str(x) for x in torch.cuda.nccl.version())
            if hasattr(torch.cuda, "nccl") else None,
            "dtype": args.dtype,
            "init": args.init,
            "dims": args.dims,
            "iters": args.iters,
            "warmup": args.warmup,
            "l2_flush": args.flush,
            "timing": "per rank: median of iters CUDA-event-timed calls after warmup, each after "
                      "a %d MiB L2 flush (l2_flush) and a 1-element all-reduce; a row's time is the "
                      "slowest rank's median" % args.flush_mib,
            "flops": "per rank: 2 * m * n * k of the rank's matmul",
            "notes": notes,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
        print("wrote %s" % args.json)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        try:
            os.unlink(store_path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
