"""`moelink bench comm` on CPU ranks: it must exit 0 and write JSON that
parses and holds one row per (op, size) with positive times, no NCCL column
on the cpu backend, and bus bandwidths that follow from the times.

usage: bench_comm_smoke.py MOELINK_EXE JSON_PATH [NRANKS (default 2)]"""
import json
import os
import subprocess
import sys

exe, path = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 2
if os.path.exists(path):
    os.remove(path)
cmd = [exe, "launch", "-n", str(n), "--timeout", "120", "--", exe, "bench", "comm",
       "--backend", "cpu", "--max", "64K", "--iters", "3", "--json", path]
p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=180)
sys.stdout.write(p.stdout)
sys.stderr.write(p.stderr)
assert p.returncode == 0, f"exit code {p.returncode}"
assert "[rank 1]" not in p.stdout, "only rank 0 prints the table"
with open(path) as f:
    d = json.load(f)
assert d["tool"] == "moelink bench comm" and d["backend"] == "cpu" and d["nranks"] == n
rows = d["rows"]
ops = {r["op"] for r in rows} | set(d["skipped_ops"])
assert {"allreduce", "allgather", "reduce_scatter", "alltoallv"} <= ops, ops
for r in rows:
    assert 0 < r["size_bytes"] <= 64 * 1024, r
    assert r["moelink_us"] > 0 and r["moelink_min_us"] <= r["moelink_us"] <= r["moelink_max_us"], r
    assert r["nccl_us"] is None and r["ratio"] is None, r
    factor = (2.0 if r["op"] == "allreduce" else 1.0) * (n - 1) / n  # 2(n-1)/n, (n-1)/n
    bw = r["size_bytes"] / (r["moelink_us"] * 1e-6) * factor / 1e9
    assert abs(bw - r["moelink_busbw_GBps"]) <= 1e-3 * bw + 1e-6, (r, bw)
# powers of two from 8 B plus the odd sizes below 64 KiB, per op that ran
sizes = sorted(r["size_bytes"] for r in rows if r["op"] == "allreduce")
assert sizes[0] == 8 and sizes[-1] == 65536 and 1000 in sizes, sizes
print(f"ok: {len(rows)} rows")
