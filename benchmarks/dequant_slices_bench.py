"""Dequantize + cuBLAS at large M in L2-sized slices: what slicing the dense weight saves, forward and backward.

    python -m benchmarks.dequant_slices_bench [--models 7b] [--fmts nvfp4] [--m 512,1024,2048,4096]
                                              [--rows 0,1024,...] [--cols 0,512,...] [--ops fwd,bwd] [--out DIR]

At M above the CUDA GEMM's range the FP4 linears rebuild the dense BF16 weight from the kernels' layout
(``dequantize_relaid``) and call cuBLAS: the forward ``x Ŵᵀ`` and the backward ``grad_input = g Ŵ``. Rebuilding the
whole weight writes 2 N K bytes to HBM and cuBLAS reads them back. In slices small enough to stay in L2 (the
forward: ``rows`` weight rows a slice, cuBLAS writing its columns of the output; the backward: ``cols`` weight
columns a slice, cuBLAS writing those columns of grad_input) the slice is read back from L2, and one slice-sized
buffer is reused. Each slice re-reads x (or g) instead.

Per linear of the model's decoder layer and per M: BF16 cuBLAS (``F.linear`` / ``g @ W``), and the FP4 path at
each slice size (0 = the whole weight at once, today's backward), timed as ``kernel_bench`` times (one CUDA graph over
rotating weight copies >= 160 MB, median replay / copies), summed over the layer: the library's own functions
(``_relaid_dequant_mm``, forward and backward) at a given slice. Rows in ``dequant_slices_<gpu>.csv`` (one per
measurement, written as they finish) and a markdown summary. ``--write-table`` installs, per (op, N, K, M), the
fastest slice where it beat the whole weight by at least ``--margin`` in this run (else 0: the whole weight) as
``qerl/kernels/tuned/dequant_slices_<gpu>.json``, what ``configs.dequant_slice`` serves the dispatcher; a linear shape
met twice in the layer (q/o, gate/up) is timed twice and averaged. ``--ops bwd`` times and tabulates the backward
alone: the table then names the products it covers (``ops``), and the forward keeps the dispatcher's rule without a
table (the H100's: its Triton-era ``cublas_chN`` row slices, which session 55's sweep table did not beat there).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import kernel_bench as kb
from qerl.kernels import configs

#: The table slices only up to this M by default. Session 54 (one H200): slices gained 4-7% a layer at M = 2048-4096
#: in a second run (the backward, and the forward's down_proj), but the first sweep's slices at M = 8192-16384 lost
#: 0.5-3% when re-measured (above a few waves of output tiles cuBLAS's shapes matter less, and every slice re-reads
#: x or g).
MAX_M = 4096


def _fp4_call(wts, i: int, a: torch.Tensor, size: int, t: bool):
    """One product of copy i of the weight through the library's slice loop: a @ Ŵᵀ in slices of ``size`` rows, or
    (``t``, the backward) a @ Ŵ in slices of ``size`` columns."""
    from qerl import kernels as qk
    from qerl.kernels import relaid
    from qerl.quant import FORMATS
    w = relaid.weight(FORMATS[kb._base(wts.fmt)], wts.qs[i])
    out = torch.empty(a.shape[0], w.k if t else w.n, device=a.device, dtype=torch.bfloat16)
    return lambda: qk._relaid_dequant_mm(a, w, out, size, t=t)


def measure(models, fmts, ms, rows_list, cols_list, rep_ms, csv_path, ops=configs.SLICE_OPS) -> list[dict]:
    res = []
    for mdl in models:
        lins = kb.layer_linears(mdl)
        shapes = list(dict.fromkeys((n, k) for _, n, k in lins))
        for fmt in ["bf16"] + [f + kb.KL for f in fmts]:
            wts = {s: kb._Weights(fmt, s[0], s[1], seed=1000 + j) for j, s in enumerate(shapes)}
            for m in ms:
                for op in ops:
                    sizes = [0] if fmt == "bf16" else (rows_list if op == "fwd" else cols_list)
                    for size in sizes:
                        for name, n, k in lins:
                            if size and size >= (n if op == "fwd" else k):
                                continue
                            w = wts[(n, k)]
                            x = torch.randn(m, n if op == "bwd" else k, device="cuda").bfloat16()
                            calls = [kb._call(fmt, w, i, x, op) if fmt == "bf16" else
                                     _fp4_call(w, i, x, size, op == "bwd") for i in range(len(w.qs))]
                            t, mode = kb._graph_ms(calls, rep_ms)
                            row = dict(model=mdl, fmt=fmt, op=op, M=m, slice=size, linear=name, N=n, K=k,
                                       us=round(t * 1e3, 2), mode=mode, device=torch.cuda.get_device_name())
                            res.append(row)
                            kb.write_csv(csv_path, res)
                            print(f"[slices] {mdl} {fmt} {op} M={m} slice={size} {name}: {t * 1e3:.1f} us", flush=True)
                            del calls
            del wts
            torch.cuda.empty_cache()
    return res


def summary(rows: list[dict]) -> str:
    """Per (model, format, op, M): the layer's µs with the whole weight, with the best slice per linear, and BF16's."""
    out = ["| model | op | M | BF16 µs | FP4 | whole weight µs (vs BF16) | best slice per linear µs (vs BF16) | slices |",
           "|---|---|---:|---:|---|---:|---:|---|"]
    keys = dict.fromkeys((r["model"], r["op"], r["M"]) for r in rows)
    for mdl, op, m in keys:
        sel = [r for r in rows if (r["model"], r["op"], r["M"]) == (mdl, op, m)]
        bf = sum(r["us"] for r in sel if r["fmt"] == "bf16")
        for fmt in dict.fromkeys(r["fmt"] for r in sel if r["fmt"] != "bf16"):
            f = [r for r in sel if r["fmt"] == fmt]
            lins = list(dict.fromkeys(r["linear"] for r in f))
            whole = sum(r["us"] for r in f if r["slice"] == 0)
            best = [min((r for r in f if r["linear"] == li), key=lambda r: r["us"]) for li in lins]
            tb = sum(r["us"] for r in best)
            picks = ", ".join(f"{r['linear']} {r['slice']}" for r in best)
            out.append(f"| {mdl} | {op} | {m} | {bf:.1f} | {fmt} | {whole:.1f} ({bf / whole:.2f}×) | "
                       f"{tb:.1f} ({bf / tb:.2f}×) | {picks} |")
    return "\n".join(out)


def table(rows: list[dict], margin: float, max_m: int = 0, ops=configs.SLICE_OPS) -> list[dict]:
    """The slice table's entries from the FP4 rows of ``ops``: per (op, N, K, M) the mean µs of each slice over the
    linears (and formats) of that shape, and the fastest slice if it beats the whole weight's (0) by ``margin`` (a
    fraction), else 0; above ``max_m`` (> 0) always 0 (the whole weight)."""
    acc: dict = {}
    for r in rows:
        if r["fmt"] != "bf16" and r["op"] in ops:
            key = (r["op"], int(r["N"]), int(r["K"]), int(r["M"]))
            acc.setdefault(key, {}).setdefault(int(r["slice"]), []).append(float(r["us"]))
    out = []
    for (op, n, k, m), by in sorted(acc.items()):
        mean = {sz: sum(v) / len(v) for sz, v in by.items()}
        if 0 not in mean:
            continue
        best = min(mean, key=mean.get)
        pick = best if mean[best] < (1 - margin) * mean[0] and not (max_m and m > max_m) else 0
        out.append(dict(op=op, N=n, K=k, M=m, slice=pick, us=round(mean[pick], 2), whole_us=round(mean[0], 2),
                        timed={str(sz): round(v, 2) for sz, v in sorted(mean.items())}))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b")
    ap.add_argument("--fmts", default="nvfp4,mxfp4")
    ap.add_argument("--m", default="512,1024,2048,4096")
    ap.add_argument("--rows", default="0,1024,2048,4096,8192")
    ap.add_argument("--cols", default="0,512,1024,2048,4096")
    ap.add_argument("--rep", type=float, default=10.0)
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--write-table", action="store_true", help="install the measured slice table for the dispatcher")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="a slice must beat the whole weight by this fraction to enter the table")
    ap.add_argument("--max-m", type=int, default=MAX_M,
                    help="no slices above this M in the table (0: no limit); see MAX_M")
    ap.add_argument("--ops", default="fwd,bwd",
                    help="the products to time and tabulate; the table covers only these, the others keep the "
                         "dispatcher's rule without a table")
    ap.add_argument("--table-from", default="",
                    help="no measurement: the table from an earlier run's dequant_slices_<gpu>.csv (its device)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    try:
        ops = configs.slice_ops(o for o in a.ops.split(",") if o)
    except ValueError as e:
        ap.error(f"--ops {a.ops!r}: {e}")
    if a.table_from:
        import csv
        with open(a.table_from) as f:
            rows = list(csv.DictReader(f))
        device = rows[0]["device"]
        tag = kb.gpu_tag("", device)
    else:
        device, tag = torch.cuda.get_device_name(), kb.gpu_tag("")
        rows = measure(a.models.split(","), a.fmts.split(","), ints(a.m), ints(a.rows), ints(a.cols), a.rep,
                       os.path.join(a.out, f"dequant_slices_{tag}.csv"), ops)
        md = summary(rows)
        with open(os.path.join(a.out, f"dequant_slices_{tag}.md"), "w") as f:
            f.write(f"## Dequantize + cuBLAS in L2-sized slices: {device}\n\n{md}\n")
        print(md)
    if a.write_table or a.table_from:
        import json
        import sys

        doc = dict(device=device, torch=None if a.table_from else torch.__version__, fmts=a.fmts, margin=a.margin,
                   max_m=a.max_m, ops=list(ops),
                   command="python -m benchmarks.dequant_slices_bench " + " ".join(sys.argv[1:]),
                   entries=table(rows, a.margin, a.max_m, ops))
        text = json.dumps(doc, indent=1) + "\n"
        with open(os.path.join(a.out, f"dequant_slices_table_{tag}.json"), "w") as f:
            f.write(text)
        print(f"[slices] installed {configs.install_slice_table(device, text)}", flush=True)


if __name__ == "__main__":
    main()
