#!/usr/bin/env python3
"""Prints the A/B table of a `scripts/gpu-check.sh decode` run.

    python3 bench/decode_ab.py <folder with decode.log and summary.txt>

decode.log holds one `moelink bench` table a run, each starting with its "layer" line;
summary.txt names the runs in the same order ("decode PRESET DTYPE ... [with VAR=v]"). Each
row: a preset, dtype and token count, then the graph-replayed times (us) of every round,
one column a variant (the default first, then each AB_ENV word)."""
import collections
import os
import re
import sys

ROW = re.compile(r"^\s+(\d+)\s+([\d.]+)\s.*?([\d.]+)%$", re.M)


def main(folder):
    log = open(os.path.join(folder, "decode.log")).read()
    runs = re.split(r"(?m)^(?=layer )", log)[1:]
    names = [l for l in open(os.path.join(folder, "summary.txt")) if " decode " in l]
    if len(runs) != len(names):
        sys.exit("decode.log has %d runs, summary.txt names %d" % (len(runs), len(names)))
    times = collections.defaultdict(list)
    variants = []
    for run, name in zip(runs, names):
        variant = name.split(" with ", 1)[1].strip() if " with " in name else "default"
        if variant not in variants:
            variants.append(variant)
        preset, dtype = name.split(" decode ", 1)[1].split()[:2]
        for tokens, us, _ in ROW.findall(run):
            times[(preset, dtype, int(tokens), variant)].append(float(us))
    rows = sorted({k[:3] for k in times})
    print("%-16s %-5s %5s  " % ("preset", "dtype", "T") + " | ".join("%-26s" % v[:26] for v in variants))
    for r in rows:
        cells = [" ".join("%.1f" % t for t in times.get(r + (v,), [])) for v in variants]
        print("%-16s %-5s %5d  " % r + " | ".join("%-26s" % c for c in cells))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
