#!/usr/bin/env python3
"""Prints the docs/PERF.md table of one GPU run from its JSON files.

    python3 bench/perf_table.py bench/results/<run>/

Reads bench_<preset>.json and bench_graph_<preset>.json (moelink bench, eager and
CUDA-graph replays: time beside the floors measured in the same process) and torch_<preset>.json (bench/compare_torch.py: moelink and the two PyTorch
pipelines timed in one process; the speedups come from that file alone)."""
import glob
import json
import os
import sys


def main(folder):
    for path in sorted(glob.glob(os.path.join(folder, "bench_*.json"))):
        preset = os.path.basename(path)[len("bench_"):-len(".json")].replace("graph_", "")
        b = json.load(open(path))
        if "floors" not in b:  # bench comm / bench tp: tables of their own
            continue
        if b.get("timing") == "cuda graph replay":
            preset += ", CUDA-graph replay"
        tpath = os.path.join(folder, "torch_%s.json" % preset.split(",")[0])
        if "graph" in preset:
            tpath = ""
        torch_rows = {}
        if os.path.exists(tpath):
            for r in json.load(open(tpath))["results"]:
                torch_rows[r["tokens"]] = r
        f = b["floors"]
        print("### %s (%s, %s)\n" % (preset, b["gpu"], b["config"]["dtype"]))
        print("floors measured in the run: read %.0f GB/s, cuBLAS bf16 %.0f TFLOP/s\n"
              % (f["read_GBps"], f["matmul_TFLOPs"]))
        print("| T | moelink us | TFLOP/s | GB/s (weights) | floor us | % of floor "
              "| moelink us (torch run) | grouped_mm us | speedup | loop us | speedup |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in b["rows"]:
            t = torch_rows.get(r["tokens"])
            tm = tg = tl = sg = sl = "-"
            if t:
                tm = "%.1f" % (t["moelink_ms"] * 1e3)
                tg = "%.1f" % (t["grouped_mm_ms"] * 1e3)
                tl = "%.1f" % (t["loop_ms"] * 1e3)
                sg = "%.2fx" % (t["grouped_mm_ms"] / t["moelink_ms"])
                sl = "%.2fx" % (t["loop_ms"] / t["moelink_ms"])
            print("| %d | %.1f | %.1f | %.0f | %.1f | %.1f%% | %s | %s | %s | %s | %s |" % (
                r["tokens"], r["median_ms"] * 1e3, r["TFLOPs"], r["GBps"], r["floor_ms"] * 1e3,
                r["pct_of_floor"], tm, tg, sg, tl, sl))
        print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
