#!/usr/bin/env python3
"""Warp stall samples of a kernel from Nsight Compute's source page.

Input: the CSV that `ncu --import R.ncu-rep --page source --print-source sass --csv` writes
(scripts/gpu-check.sh ncudecode leaves one per preset and dtype in json/ncudecode/). Prints,
for each kernel in it (once per distinct name and size):
  - the samples by stall reason, as shares of the kernel's samples;
  - the instructions with the most samples, with their three largest reasons;
  - with --cuts a,b,...: the shares of instruction ranges [0,a), [a,b), ... (e.g. a main
    loop's first and last instruction index, to weigh prologue, loop and epilogue); given
    several times, the n-th applies to the n-th kernel printed;
  - with --dis F --kernel S: the samples (of --reason, default all) summed by source line,
    from F = `nvdisasm -g -c` of a cubin built with -lineinfo and the same flags as the
    profiled one, S a substring of the kernel's mangled name there.

Example: python3 bench/ncu_stalls.py json/ncudecode/qwen3-30b-a3b_fp8.sass.csv --top 20
"""
import argparse
import collections
import csv
import re
import sys


def kernels(path):
    """[(name, header, rows)] in file order; rows are the instruction rows."""
    out, cur = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur = [row[1], None, []]
                out.append(cur)
            elif row[0] == "Address" and cur is not None:
                cur[1] = row
            elif cur is not None and cur[1] is not None:
                cur[2].append(row)
    return [tuple(k) for k in out if k[1] is not None]


def num(s):
    try:
        return int(s)
    except ValueError:
        return 0


def line_map(dis_path, kernel_part):
    """Byte offset -> (file, line) for the kernel whose section name holds kernel_part."""
    lines, cur, inside = {}, None, False
    with open(dis_path) as f:
        for l in f:
            if l.startswith("//---"):
                inside = kernel_part in l
                continue
            if not inside:
                continue
            m = re.search(r'//## File "([^"]+)", line (\d+)', l)
            if m:
                cur = (m.group(1).rsplit("/", 1)[-1], int(m.group(2)))
                continue
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", l)
            if m:
                lines[int(m.group(1), 16)] = cur
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20, help="instructions to list")
    ap.add_argument("--cuts", action="append", default=[],
                    help="instruction indices a,b,... (ranges' shares); once per kernel")
    ap.add_argument("--dis", help="nvdisasm -g -c output of the same code, built -lineinfo")
    ap.add_argument("--kernel", default="", help="substring of the kernel's name in --dis")
    ap.add_argument("--reason", default="all", help="with --dis: a stall reason (no_inst, ...)")
    a = ap.parse_args()

    lmap = line_map(a.dis, a.kernel) if a.dis else None
    found = kernels(a.csv)
    if not found:
        sys.exit(f"{a.csv}: no kernel's source page in it")
    seen = set()
    for name, hdr, rows in found:
        if (name, len(rows)) in seen:
            continue
        seen.add((name, len(rows)))
        ix = {k: i for i, k in enumerate(hdr)}
        sc = ix.get("Warp Stall Sampling (All Samples)")
        if sc is None:
            sys.exit("no 'Warp Stall Sampling (All Samples)' column: profile with SourceCounters")
        reasons = [k for k in hdr if k.startswith("stall_") and "Not Issued" not in k]
        samples = [num(r[sc]) for r in rows]
        total = sum(samples) or 1
        by = collections.Counter()
        for r in rows:
            for k in reasons:
                by[k] += num(r[ix[k]])
        print(f"== {name}: {len(rows)} instructions, {sum(samples)} samples")
        print("  by reason: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%"
                                         for k, v in by.most_common(10) if v))
        cuts = a.cuts[len(seen) - 1] if len(seen) <= len(a.cuts) else ""
        if cuts:
            edges = [0] + [int(c) for c in cuts.split(",")] + [len(rows)]
            print("  ranges: " + ", ".join(f"[{lo},{hi}) {100 * sum(samples[lo:hi]) / total:.1f}%"
                                          for lo, hi in zip(edges, edges[1:])))
        execd = ix.get("Instructions Executed")
        for i in sorted(sorted(range(len(rows)), key=lambda j: -samples[j])[:a.top]):
            r = rows[i]
            top3 = sorted(((num(r[ix[k]]), k[6:]) for k in reasons), reverse=True)[:3]
            print(f"  {i:6d} {100 * samples[i] / total:5.1f}%  exec {r[execd] if execd else '-':>8}  "
                  f"{r[1].strip()[:60]:60s} " + " ".join(f"{k}:{v}" for v, k in top3 if v))
        if lmap is not None:
            col = sc if a.reason == "all" else ix.get("stall_" + a.reason)
            if col is None:
                sys.exit(f"no stall reason {a.reason}")
            agg = collections.Counter()
            for i, r in enumerate(rows):
                v = num(r[col])
                if v:
                    agg[lmap.get(16 * i, ("?", 0))] += v
            print(f"  {a.reason} samples by source line:")
            for (fn, ln), v in agg.most_common(a.top):
                print(f"    {v:6d}  {fn}:{ln}")


if __name__ == "__main__":
    main()
