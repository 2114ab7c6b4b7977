"""Benchmark of the CUDA FP4 decode GEMV (``cuda_fp4``) against BF16 ``F.linear`` and the Triton path (``qmm``), and
of the same GEMV over the BF16 weight (``cuda_fp4.dense_weight``: the BF16 baseline's decode products) against cuBLAS.

    python -m benchmarks.cuda_bench --out DIR [--models 7b,14b,32b] [--m 1,2,4,8,16] [--sweep]

The Triton path is ``qmm`` with ``QERL_CUDA_GEMV=0`` (its own CUDA-GEMV dispatch off). Timed exactly as
``bench.py`` does: per linear, one CUDA graph over rotating weight copies (>= 160 MB, so every
weight read comes from HBM) replayed; median replay / copies. Per layer: the sum over the 7 linears, and the 7
run back to back over consecutive layer copies in one graph. Effective TB/s counts the weight bytes the path
reads (packed + scales, or BF16) plus x and out, once. ``--sweep`` also times launch configurations of the CUDA
kernel on the 7B shapes at M = 1 and 16 (table printed; the dispatcher's pick is marked). Writes
``cuda_fp4_<gpu>.csv`` / ``.md`` (and ``cuda_fp4_sweep_<gpu>.csv``) under ``--out``; prints the markdown last.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
import sys

import torch

from benchmarks import kernel_bench as bench
from qerl.kernels import cuda_fp4 as cf

PATHS = ("bf16", "triton", "cuda", "cuda_pdl")


def _nvcc_version() -> str:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.strip().splitlines()[-1]
    except Exception as e:  # no compiler on PATH
        return f"n/a ({type(e).__name__})"


def _time_cuda(cws: list[cf.CudaFP4Weight], m: int, rep_ms: float, config=None, pdl=False) -> float:
    """Per-call ms of ``gemv`` over the rotating copies inside one graph."""
    x = torch.randn(m, cws[0].k, device="cuda").bfloat16()
    calls = [lambda w=w: cf.gemv(x, w, config=config, pdl=pdl) for w in cws]
    return bench._graph_ms(calls, rep_ms)[0]


@contextlib.contextmanager
def _triton_only(on: bool):
    """qmm without its CUDA-GEMV dispatch (``QERL_CUDA_GEMV=0``): the Triton decode path."""
    old = os.environ.get("QERL_CUDA_GEMV")
    if on:
        os.environ["QERL_CUDA_GEMV"] = "0"
    try:
        yield
    finally:
        if on:
            if old is None:
                os.environ.pop("QERL_CUDA_GEMV", None)
            else:
                os.environ["QERL_CUDA_GEMV"] = old


def _time_qmm(fmt: str, w, m: int, k: int, n: int, rep_ms: float, path: str) -> float:
    with _triton_only(path == "triton"):
        return bench._time_fn(fmt, w, m, k, n, "fwd", rep_ms)


def _layer_cuda_ms(lins, cws: dict, m: int, rep_ms: float, pdl: bool) -> float:
    """Per-layer ms of the 7 linears back to back (one graph over consecutive layer copies)."""
    xs, calls = {}, []
    layers = min(64, max(len(v) for v in cws.values()))
    for r in range(layers):
        for _name, n, k in lins:
            if k not in xs:
                xs[k] = torch.randn(m, k, device="cuda").bfloat16()
            ws = cws[(n, k)]
            calls.append(lambda x=xs[k], w=ws[r % len(ws)]: cf.gemv(x, w, pdl=pdl))
    return bench._graph_ms(calls, rep_ms)[0] * len(lins)


def _sweep_configs(s: int, c: int, fmt: str = "nvfp4") -> list[tuple[int, int, int, int]]:
    out = []
    variants = cf.gemv_variants(fmt) if fmt == "bf16" else ((4, 1), (8, 1), (2, 2), (4, 2), (2, 4))
    for unroll, sw in variants:
        maxw = cf.gemv_warp_cap(unroll, sw, cf.gemv_words(fmt))
        for splits in (1, 2, 4, 6, 8, 12, 16):
            if splits > maxw or (splits > 1 and c // splits < 2):
                continue
            out.append((splits, max(1, min(maxw // splits, 4 // splits)), unroll, sw))
    return out


def run(models, ms, fmts, paths, rep_ms, sweep: bool) -> tuple[list[dict], list[dict]]:
    rows, sweep_rows = [], []
    for mdl in models:
        lins = bench.layer_linears(mdl)
        shapes = list(dict.fromkeys((n, k) for _, n, k in lins))
        for fmt in (["bf16"] if "bf16" in paths else []) + list(fmts):
            wts = {(n, k): bench._Weights(fmt, n, k, seed=1000 + i) for i, (n, k) in enumerate(shapes)}
            kinds = ([p for p in ("bf16", "cuda", "cuda_pdl") if p in paths] if fmt == "bf16" else
                     [p for p in ("triton", "cuda", "cuda_pdl") if p in paths])
            cuda = [p for p in kinds if p.startswith("cuda")]
            cws = {key: w.cuda() for key, w in wts.items()} if cuda else {}
            for path in kinds:
                for m in ms:
                    total_t, total_b = 0.0, 0
                    for name, n, k in lins:
                        w = wts[(n, k)]
                        if path.startswith("cuda"):
                            t = _time_cuda(cws[(n, k)], m, rep_ms, pdl=path == "cuda_pdl")
                            nb = cws[(n, k)][0].nbytes
                            cfg = cf._config(cws[(n, k)][0], m, torch.device("cuda"))
                        else:
                            t = _time_qmm(fmt, w, m, k, n, rep_ms, path)
                            nb, cfg = w.nbytes, ""
                        nbytes = nb + 2 * m * (n + k)
                        total_t += t
                        total_b += nbytes
                        rows.append(dict(model=mdl, fmt=fmt, path=path, M=m, linear=name, N=n, K=k,
                                         us=round(t * 1e3, 3), bytes=nbytes,
                                         TBps=round(nbytes / (t * 1e-3) / 1e12, 3), config=str(cfg)))
                    if path.startswith("cuda"):
                        tg = _layer_cuda_ms(lins, cws, m, rep_ms, path == "cuda_pdl")
                    else:
                        with _triton_only(path == "triton"):
                            tg = bench._layer_graph_ms(fmt, lins, wts, m, "fwd", rep_ms)
                    rows.append(dict(model=mdl, fmt=fmt, path=path, M=m, linear="layer", N=0, K=0,
                                     us=round(total_t * 1e3, 3), bytes=total_b,
                                     TBps=round(total_b / (total_t * 1e-3) / 1e12, 3),
                                     layer_graph_us=round(tg * 1e3, 3)))
                    print(f"[cuda_bench] {mdl} {fmt:6s} {path:6s} M={m:3d}: {total_t * 1e3:8.1f} us/layer "
                          f"{total_b / (total_t * 1e-3) / 1e12:5.2f} TB/s; layer graph {tg * 1e3:8.1f} us",
                          flush=True)
            if sweep and mdl == models[0] and cuda and fmt in ("nvfp4", "bf16"):
                for (n, k), ws in cws.items():
                    for m in (1, 4, 8, 16):
                        pick = cf._config(ws[0], m, torch.device("cuda"))
                        res = []
                        for cfg in _sweep_configs(n // 16, k // 64, fmt):
                            t = _time_cuda(ws, m, rep_ms / 2, config=cfg)
                            res.append((t, cfg))
                            sweep_rows.append(dict(model=mdl, fmt=fmt, N=n, K=k, M=m, config=str(cfg),
                                                   picked=cfg == pick, us=round(t * 1e3, 3),
                                                   TBps=round((ws[0].nbytes + 2 * m * (n + k)) / (t * 1e-3)
                                                              / 1e12, 3)))
                        res.sort()
                        tp = next(t for t, c in res if c == pick) if any(c == pick for _, c in res) else None
                        print(f"[sweep] {fmt} {n}x{k} M={m}: best {res[0][1]} {res[0][0] * 1e3:.2f}us; "
                              f"2nd {res[1][1]} {res[1][0] * 1e3:.2f}us; picked {pick} "
                              f"{'' if tp is None else f'{tp * 1e3:.2f}us'}", flush=True)
            del wts, cws
            torch.cuda.empty_cache()
    layer = {(r["model"], r["fmt"], r["path"], r["M"]): r for r in rows if r["linear"] == "layer"}
    for r in rows:
        if r["linear"] != "layer":
            continue
        base = layer.get((r["model"], "bf16", "bf16", r["M"]))
        tri = layer.get((r["model"], r["fmt"], "triton", r["M"]))
        if base is not None:
            r["speedup_vs_bf16"] = round(base["us"] / r["us"], 3)
        if tri is not None and r["path"].startswith("cuda"):
            r["speedup_vs_triton"] = round(tri["us"] / r["us"], 3)
    return rows, sweep_rows


def markdown(rows, header: str) -> str:
    layer = [r for r in rows if r["linear"] == "layer"]
    out = [header, ""]
    for mdl in dict.fromkeys(r["model"] for r in layer):
        out += [f"### Qwen2.5-{mdl.upper()} decoder linears (µs per layer = sum of the 7 per-linear medians)", "",
                "Cell: µs/layer (speed-up vs BF16) effective TB/s · whole-layer graph µs.", ""]
        cols = [("bf16", "bf16"), ("bf16", "cuda"), ("bf16", "cuda_pdl")] + [
            (f, p) for f in ("nvfp4", "mxfp4") for p in ("triton", "cuda", "cuda_pdl")]
        cols = [c for c in cols if any(r["model"] == mdl and (r["fmt"], r["path"]) == c for r in layer)]
        out.append("| M | " + " | ".join(f"{f} {p}" if f != p else "BF16 (cuBLAS)" for f, p in cols) + " |")
        out.append("|---:|" + "---:|" * len(cols))
        for m in sorted({r["M"] for r in layer if r["model"] == mdl}):
            cells = []
            for f, p in cols:
                r = next((x for x in layer if x["model"] == mdl and x["M"] == m and (x["fmt"], x["path"]) == (f, p)),
                         None)
                if r is None:
                    cells.append("–")
                    continue
                sp = "" if (f, p) == ("bf16", "bf16") else f" ({r.get('speedup_vs_bf16', float('nan')):.2f}×)"
                cells.append(f"{r['us']:.1f}{sp} {r['TBps']:.2f} · {r['layer_graph_us']:.1f}")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        out.append("")
        per = [r for r in rows if r["model"] == mdl and r["linear"] != "layer" and r["path"] == "cuda"]
        if per:
            out += ["Per linear, CUDA kernel without PDL (µs · TB/s · config: splits, strip groups per CTA, "
                    "unroll, strips per warp):", "",
                    "| fmt | M | " + " | ".join(n for n, _, _ in bench.layer_linears(mdl)) + " |",
                    "|---|---:|" + "---:|" * 7]
            for f in ("bf16", "nvfp4", "mxfp4"):
                for m in sorted({r["M"] for r in per}):
                    sel = [r for r in per if r["fmt"] == f and r["M"] == m]
                    if sel:
                        out.append(f"| {f} | {m} | " + " | ".join(
                            f"{r['us']:.1f} · {r['TBps']:.2f} · {r['config']}" for r in sel) + " |")
            out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b,14b,32b")
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--fmts", default="nvfp4,mxfp4")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--rep", type=float, default=20.0, help="time spent replaying per measurement (ms)")
    ap.add_argument("--sweep", action="store_true", help="also time CUDA launch configurations on the 7B shapes")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    if not cf.available():
        sys.exit(f"[cuda_bench] CUDA FP4 kernel unavailable: {cf.build_error()}")
    name = torch.cuda.get_device_name()
    tag = bench.gpu_tag(a.tag)
    os.makedirs(a.out, exist_ok=True)
    bw = bench.copy_bandwidth()
    attrs = {(f, nt, u, sw): cf.kernel_attributes(f, 1 if nt == 1 else 16, u, sw)
             for f in ("bf16", "nvfp4", "mxfp4") for nt in (1, 2) for u, sw in cf.gemv_variants(f)}
    print(f"[cuda_bench] {name}: copy {bw / 1e12:.2f} TB/s; kernel (regs, local bytes): {attrs}", flush=True)
    hdr = _header(name, bw, attrs, argv)
    rows, sweep_rows = [], []
    for i, mdl in enumerate(a.models.split(",")):  # files rewritten after each model (partial runs keep data)
        fmts = [f for f in a.fmts.split(",") if f]
        r, sr = run([mdl], [int(v) for v in a.m.split(",")], fmts, a.paths.split(","), a.rep, a.sweep and i == 0)
        rows += r
        sweep_rows += sr
        _write(a.out, tag, rows, sweep_rows, hdr)
    print(markdown(rows, hdr))


def _write(out: str, tag: str, rows: list[dict], sweep_rows: list[dict], header: str) -> None:
    keys = ["model", "fmt", "path", "M", "linear", "N", "K", "us", "bytes", "TBps", "speedup_vs_bf16",
            "speedup_vs_triton", "layer_graph_us", "config"]
    bench.write_csv(os.path.join(out, f"cuda_fp4_{tag}.csv"), rows, keys)
    if sweep_rows:
        bench.write_csv(os.path.join(out, f"cuda_fp4_sweep_{tag}.csv"), sweep_rows)
    with open(os.path.join(out, f"cuda_fp4_{tag}.md"), "w") as fh:
        fh.write(markdown(rows, header) + "\n")


def _header(name: str, bw: float, attrs: dict, argv) -> str:
    import triton
    return (f"## CUDA FP4 decode GEMV vs BF16 and Triton: {name}\n\n"
            f"torch {torch.__version__}, triton {triton.__version__}, nvcc: {_nvcc_version()}, python "
            f"{platform.python_version()}; device-to-device copy {bw / 1e12:.2f} TB/s (read+write). Kernel "
            f"registers/local bytes per (fmt, n8 tiles, unroll, strips per warp): {attrs}. Per linear: median over CUDA-graph "
            f"replays over rotating weight copies (>= 160 MB). Command: `python -m benchmarks.cuda_bench "
            f"{' '.join(sys.argv[1:] if argv is None else argv)}`")


if __name__ == "__main__":
    main()
