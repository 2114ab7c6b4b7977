"""Compare kernel timings of several builds measured in interleaved passes (A B B A ...): the gain of each build over a
baseline per (product, M), with the range over the passes.

    python -m benchmarks.ab_compare DIR [--prefix tma] [--base 0] [--md FILE]

``DIR`` holds one folder per run named ``<prefix>_<build>_<pass>`` (as ``scripts/gpu_bench.sh abk`` and
``desc40`` write them), each with a ``wgmma_profile_*.csv`` (``benchmarks.wgmma_profile``: columns fmt, N, K, M,
config, us, ...). For each build and pass, the gain over the baseline *of the same pass* is ``base_us / us - 1``
(positive: faster); the table shows the mean of the passes' gains and their range. A pass lacking a row for one of
the two builds (a run cut short) is left out of that row's mean, and the count of passes used is shown.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import sys
from collections import defaultdict

PRODUCTS = {(37888, 3584): "gate|up", (3584, 18944): "down", (4608, 3584): "q|k|v", (3584, 3584): "o"}  # 7B


def load(root: str, prefix: str) -> dict[str, dict[str, dict[tuple, float]]]:
    """{build: {pass: {(fmt, N, K, M, config): us}}} from ``root/<prefix>_<build>_<pass>/wgmma_profile_*.csv``."""
    pat = re.compile(rf"^{re.escape(prefix)}_(.+)_([^_]+)$")
    runs: dict[str, dict[str, dict[tuple, float]]] = defaultdict(dict)
    for d in sorted(os.listdir(root)):
        m = pat.match(d)
        files = glob.glob(os.path.join(root, d, "wgmma_profile_*.csv"))
        if not m or not files:
            continue
        rows = {}
        for f in files:
            with open(f) as fh:
                for r in csv.DictReader(fh):
                    key = (r["fmt"], int(r["N"]), int(r["K"]), int(r["M"]), r["config"])
                    rows[key] = float(r["us"])
        runs[m.group(1)][m.group(2)] = rows
    if not runs:
        raise SystemExit(f"no {prefix}_<build>_<pass>/wgmma_profile_*.csv under {root!r}")
    return runs


def compare(runs: dict, base: str) -> list[dict]:
    """One row per (key, build != base): the base's mean time, the build's, the mean gain and its range over passes."""
    if base not in runs:
        raise SystemExit(f"--base {base!r}: not among the builds found ({', '.join(sorted(runs))})")
    out = []
    keys = sorted({k for p in runs[base].values() for k in p})
    for build in sorted(b for b in runs if b != base):
        for key in keys:
            gains, tb, tx = [], [], []
            for pas, rows in runs[build].items():
                b_rows = runs[base].get(pas, {})
                if key in rows and key in b_rows:
                    gains.append(b_rows[key] / rows[key] - 1.0)
                    tb.append(b_rows[key])
                    tx.append(rows[key])
            if gains:
                out.append({"key": key, "build": build, "n": len(gains), "base_us": sum(tb) / len(tb),
                            "us": sum(tx) / len(tx), "gain": sum(gains) / len(gains),
                            "lo": min(gains), "hi": max(gains)})
    return out


def render(rows: list[dict], base: str) -> str:
    lines = [f"| build | product | M | config | {base} µs | build µs | gain (mean) | range | passes |",
             "|---|---|---:|---|---:|---:|---:|---|---:|"]
    for r in rows:
        fmt, n, k, m, cfg = r["key"]
        name = PRODUCTS.get((n, k), f"{n}x{k}").replace("|", "\\|")  # a pipe inside a markdown cell
        lines.append(f"| {r['build']} | {fmt} {name} | {m} | {cfg} | {r['base_us']:.1f} | {r['us']:.1f} | "
                     f"{100 * r['gain']:+.1f} % | {100 * r['lo']:+.1f}…{100 * r['hi']:+.1f} | {r['n']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--prefix", default="tma")
    ap.add_argument("--base", default="0", help="the baseline build's name in the folder names")
    ap.add_argument("--md", help="also write the table to this file")
    a = ap.parse_args(argv)
    text = render(compare(load(a.root, a.prefix), a.base), a.base)
    sys.stdout.write(text)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
