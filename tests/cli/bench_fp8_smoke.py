"""`moelink bench` and `moelink run` with --fp8-experts on the CPU backend: the
bench exits 0 and its JSON records fp8_experts (1 with the flag, 0 without)
with one row per token count, and its MOELINK_* environment (a quote in a
value included); run verifies an f16 layer of odd shape whose
FP8 experts the CLI generates on all cores; a hidden size that is not a
multiple of 128 is a usage error (exit 2), and so is a MOELINK_BENCH_L2_FLUSH
that is neither read nor write (on any backend).

usage: bench_fp8_smoke.py MOELINK_EXE JSON_PATH"""
import json
import os
import subprocess
import sys

exe, path = sys.argv[1], sys.argv[2]
shape = ["--hidden", "384", "--inter", "128", "--experts", "7", "--topk", "3"]
tokens = [3, 19]


def bench(extra, env=None):
    if os.path.exists(path):
        os.remove(path)
    cmd = [exe, "bench", "--backend", "cpu", *shape, "--tokens", ",".join(map(str, tokens)),
           "--iters", "1", "--warmup", "0", "--json", path, *extra]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=120, env=env)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    assert p.returncode == 0, f"{cmd}: exit code {p.returncode}"
    with open(path) as f:
        d = json.load(f)
    assert d["tool"] == "moelink bench" and d["backend"] == "cpu", d
    c = d["config"]
    assert (c["hidden"], c["inter"], c["experts"], c["top_k"]) == (384, 128, 7, 3), c
    assert [r["tokens"] for r in d["rows"]] == tokens, d["rows"]
    for r in d["rows"]:
        assert r["median_ms"] > 0, r
    # the JSON records the run's MOELINK_* environment, and nothing else of it
    want = {k: v for k, v in (env or os.environ).items() if k.startswith("MOELINK_")}
    assert d["env"] == want, (d["env"], want)
    return c


assert bench(["--fp8-experts"])["fp8_experts"] == 1
base = {k: v for k, v in os.environ.items() if not k.startswith("MOELINK_")}
assert bench([], env=dict(base, MOELINK_SHARED_FIRST="0", MOELINK_ZZ_TEST='a "b"',
                          HOME_NOT_MOELINK="x"))["fp8_experts"] == 0

p = subprocess.run([exe, "run", "--backend", "cpu", *shape, "--dtype", "f16", "--fp8-experts",
                    "--tokens", "19", "--verify"], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True, timeout=120)
sys.stdout.write(p.stdout)
sys.stderr.write(p.stderr)
assert p.returncode == 0 and "PASS" in p.stdout, p.returncode
assert "(experts fp8)" in p.stdout and "f16" in p.stdout, p.stdout

p = subprocess.run([exe, "run", "--fp8-experts", "--hidden", "200"], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True, timeout=60)
assert p.returncode == 2 and "128" in p.stderr, (p.returncode, p.stderr)
env = dict(os.environ, MOELINK_BENCH_L2_FLUSH="sometimes")
p = subprocess.run([exe, "bench", "--backend", "cpu", *shape, "--tokens", "3", "--iters", "1"],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60, env=env)
assert p.returncode == 2 and "MOELINK_BENCH_L2_FLUSH" in p.stderr, (p.returncode, p.stderr)
print("ok")
