"""`moelink bench ep` on CPU ranks: it must exit 0 and write JSON that parses
and holds one row per token count with positive times, no NCCL column on the
cpu backend, row counts inside what T tokens of top-k routing allow, and
bytes and rates that follow from them, and the --steps / --rounds rows. Also:
outside the launcher it fails (exit 1) and a bad option is a usage error (exit 2).

usage: bench_ep_smoke.py MOELINK_EXE JSON_PATH [NRANKS (default 2)]"""
import json
import os
import subprocess
import sys

exe, path = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 2
if os.path.exists(path):
    os.remove(path)
tokens = [16, 37]
cmd = [exe, "launch", "-n", str(n), "--timeout", "120", "--", exe, "bench", "ep",
       "--backend", "cpu", "--tokens", ",".join(map(str, tokens)), "--iters", "2",
       "--steps", "3", "--rounds", "4", "--json", path]
p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=180)
sys.stdout.write(p.stdout)
sys.stderr.write(p.stderr)
assert p.returncode == 0, f"exit code {p.returncode}"
assert "[rank 1]" not in p.stdout, "only rank 0 prints the table"
with open(path) as f:
    d = json.load(f)
assert d["tool"] == "moelink bench ep" and d["backend"] == "cpu" and d["nranks"] == n
c = d["config"]
H, k, E = c["hidden"], c["top_k"], c["experts"]
assert d["experts_per_rank"] * n == E
assert [r["tokens"] for r in d["rows"]] == tokens
for r in d["rows"]:
    T = r["tokens"]
    assert r["single_tokens"] == n * T, r
    assert r["ep_us"] > 0 and r["single_us"] > 0, r
    assert r["nccl_us"] is None and r["nccl_GBps_per_rank"] is None, r
    # a token goes to each peer at most once, to at most k of them; a rank
    # returns one row per (token, slot) of its peers' tokens on its experts
    assert 0 <= r["dispatch_rows"] <= T * min(n - 1, k), r
    assert 0 <= r["combine_rows"] <= (n - 1) * T * min(k, d["experts_per_rank"]), r
    if n == 2:
        # one peer: each token sent has at least one of its slots there
        assert r["dispatch_rows"] <= r["combine_rows"], r
    # bytes: the busiest rank's rows; the row counts are each the most over ranks
    assert 0 < r["bytes_sent_per_rank"] <= (r["dispatch_rows"] + r["combine_rows"]) * H * 2, r
    assert r["bytes_sent_per_rank"] % (H * 2) == 0, r
    assert r["bytes_sent_per_rank"] <= r["bytes_sent_total"] <= n * r["bytes_sent_per_rank"], r
    assert r["flops_per_rank"] >= 2 * T * k * 3 * H * c["inter"], r
    tf = r["flops_per_rank"] / (r["ep_us"] * 1e-6) / 1e12
    assert abs(tf - r["ep_TFLOPs"]) <= 1e-3 * tf + 1e-12, (r, tf)
    # the compute-only time: the local experts + routing + the shared expert alone
    assert r["route_us"] > 0 and r["shared_expert_us"] > 0, r
    comp = r["experts_us"] + r["route_us"] + r["shared_expert_us"]
    assert abs(r["compute_us"] - comp) <= 1e-3 * comp, r
    m = max(comp, r["dispatch_combine_us"])
    assert abs(r["forward_over_max_compute_comm"] - r["ep_us"] / m) <= 1e-3 * r["ep_us"] / m, r
    # --steps 3: the same call in steps of ceil(T / 3) tokens
    assert r["step_tokens"] == (T + 2) // 3 and r["steps_us"] > 0, r
    assert abs(r["steps_throughput_of_ep"] - r["ep_us"] / r["steps_us"]) <= 1e-3, r
    # --rounds 4: one step with recv_capacity ceil(ranks * T / 4)
    assert r["rounds_capacity"] == (n * T + 3) // 4 and r["rounds_us"] > 0, r
    assert abs(r["rounds_throughput_of_ep"] - r["ep_us"] / r["rounds_us"]) <= 1e-3, r
    # the layers' memory: smaller receive buffers, smaller workspaces
    assert 0 < r["rounds_workspace_bytes"] < r["workspace_bytes"], r
    assert 0 < r["steps_workspace_bytes"] < r["workspace_bytes"], r

p = subprocess.run([exe, "bench", "ep", "--backend", "cpu"], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True, timeout=60,
                   env={k: v for k, v in os.environ.items() if not k.startswith("MOELINK_")})
assert p.returncode == 1 and "launch" in p.stderr, (p.returncode, p.stderr)
p = subprocess.run([exe, "bench", "ep", "--tokens", "0"], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True, timeout=60)
assert p.returncode == 2 and "--tokens" in p.stderr, (p.returncode, p.stderr)
print(f"ok: {len(d['rows'])} rows")
