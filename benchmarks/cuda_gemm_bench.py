"""Benchmark and tuner of the CUDA FP4 GEMM (``cuda_fp4.gemm``, M > 16) against BF16 cuBLAS and the FP4 paths it
replaces (issue 10: FP4 faster than BF16 at the batch sizes RL runs).

    python -m benchmarks.cuda_gemm_bench --out results/speed [--models 7b] [--m 24,32,...] [--sweep-m 24,...]
                                         [--write-table]

1. **Sweep** (per format, decoder-linear shape -- the 7 linears and the fused q|k|v and gate|up of the sampler's
   decode step -- and M in ``--sweep-m``): every launch configuration (nt, sw, r, ks) of
   the kernel is checked against the emulator once and timed; the best is kept with ``wins`` = faster than the FP4
   path the dispatcher would take without it (``QERL_CUDA_GEMM=0``) on the weights as ``--prev-layout`` holds them:
   ``kernel`` (default), the kernels' layout alone, as rollouts and the update hold every linear after
   ``relayout_model`` (the CUDA dequantization + cuBLAS, or with ``QERL_DQ_GEMM`` the in-loop dequantizing GEMM);
   ``compressed``, the compressed-tensors layout (Triton GEMM or Triton dequantization + cuBLAS; before session 65
   the only choice, so tables swept then compared with a path training no longer takes).
   ``--write-table`` installs the result as ``qerl/kernels/tuned/cuda_gemm_<device>.json`` (what the dispatcher
   reads); it is also written under ``--out``.
2. **Layer table** (M in ``--m``): µs per decoder layer (the 7 linears' per-linear medians summed) of BF16
   ``F.linear``, the previous FP4 path and the dispatcher (both on ``--prev-layout``'s weights), and the CUDA GEMM
   at its tuned configuration, with speed-ups against BF16 measured in the same run.

Timing as in ``cuda_bench``: per linear, one CUDA graph over rotating weight copies (>= 160 MB, every weight read
from HBM) replayed; median replay / copies. Writes ``cuda_gemm_<gpu>.csv`` / ``.md`` and ``cuda_gemm_sweep_<gpu>.csv``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from benchmarks import kernel_bench as bench
from qerl.kernels import cuda_fp4 as cf

SWEEP_M = (24, 32, 64, 128, 256, 512)
LAYER_M = (17, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
TARGETS = {32: 2.3, 64: 1.6, 128: 1.15, 256: 0.95, 512: 0.95}  # issue 10's forward targets vs BF16 (7B)
LAYOUTS = ("kernel", "compressed")  # --prev-layout: how the "prev" path's weights are held


def prev_weights(fmt: str, n: int, k: int, seed: int, layout: str) -> bench._Weights:
    """The weight the "prev" path and the dispatcher are timed on: the kernels' layout alone (``fmt`` + ``-kernel``,
    what training holds) or the compressed-tensors layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"--prev-layout {layout!r}: valid: {', '.join(LAYOUTS)}")
    return bench._Weights(fmt + bench.KL if layout == "kernel" else fmt, n, k, seed=seed)


class _env:
    """Set an environment variable for a block (the dispatcher reads QERL_CUDA_GEMM per call)."""

    def __init__(self, key: str, value: str):
        self.key, self.value, self.old = key, value, None

    def __enter__(self):
        self.old = os.environ.get(self.key)
        os.environ[self.key] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.key, None)
        else:
            os.environ[self.key] = self.old


def configs(s: int, c: int, m: int, fmt: str = "nvfp4") -> list[tuple[int, int, int, int]]:
    """Candidate (nt, sw, r, ks) for S strips, C chunks, M tokens: the two token-tile widths that suit M, every
    split of at most 8 warps into r along the strips x ks along K (each K range >= 4 chunks); on sm_90 also the
    wgmma kernel's variants (sw <= 0: 1 - sw splits of K across CTAs) with the two token tiles that suit M. Splits
    of K across CTAs where the grid leaves SMs idle; a ``QERL_WGMMA_TAIL=1`` build's tail splits
    (:func:`cf.wgmma_tail_sw`) only where the grid fills at least one wave of ``fmt``'s variant (no LoRA) and leaves
    a partial one, the case they are for (:func:`cf.wgmma_tail_pick`). Below one wave a tail split splits every
    tile, the work of the split-K config of as many splits: the sweep without LoRA timed such pairs as ties, and
    with LoRA under PDL the tail form slowed the x·Aᵀ launch before it (session 52, `raw/h200_s52_tune`)."""
    nts = (2,) if m <= 16 else (2, 4) if m <= 32 else (4, 8) if m <= 64 else (8, 16)
    out = []
    for nt in nts:
        for sw in cf.GEMM_SW:
            for r in (1, 2, 4, 8):
                for ks in (1, 2, 4, 8):
                    if (ks > 1 and c // ks < 4) or not cf.gemm_variant_ok(nt, sw, r):
                        continue
                    try:
                        cf.check_gemm_config((nt, sw, r, ks), s, c)
                    except ValueError:
                        continue
                    out.append((nt, sw, r, ks))
    if cf.wgmma_supported():  # the sm_90a wgmma kernel (sw <= 0): token tiles that suit M
        ntoks = (32,) if m <= 32 else (32, 64) if m <= 64 else (64, 128) if m <= 128 else (128, 256)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for cfg in cf.wgmma_configs(s, c):
            nt, sw, r, ks = cfg
            if 8 * nt not in ntoks:
                continue
            tiles = cf.wgmma_tiles(m, s, nt, r)
            if cf.wgmma_tail_kt(sw):  # a tail split: where a partial wave follows whole ones
                wave = cf.wgmma_ctas(fmt, 8 * nt, r, ks, lora=False)
                if tiles >= wave and tiles % wave:
                    out.append(cfg)
            elif sw in (0, cf.WGMMA_SK) or tiles < sms:  # splits of K: where the grid without them leaves SMs idle
                out.append(cfg)
    return out


def product_shapes(mdl: str) -> list[tuple[int, int]]:
    """(N, K) of a model's decoder-layer linears, then the fused q|k|v and gate|up projections the sampler's decode
    step runs as one matmul each (qerl.fastdecode): rollouts dispatch on those shapes."""
    h, inter, nh, nkv, hd = bench.MODELS[mdl]
    return list(dict.fromkeys([(n, k) for _, n, k in bench.layer_linears(mdl)]
                              + [((nh + 2 * nkv) * hd, h), (2 * inter, h)]))


def _time_gemm(cws, m: int, rep_ms: float, config, lora=None, kz: int = 1) -> float:
    """ms per cf.gemm call at ``config`` (with the LoRA operand ``lora``, its x·Aᵀ launch included; ``kz``: K split
    across that many CTAs, a ``QERL_GEMM_KZ=1`` build), graph-replayed over the weight copies ``cws``."""
    x = torch.randn(m, cws[0].k, device="cuda").bfloat16()
    outs = [torch.empty(m, w.n, device="cuda", dtype=torch.bfloat16) for w in cws]
    calls = [lambda w=w, o=o: cf.gemm(x, w, out=o, config=config, lora=lora, kz=kz)
             for w, o in zip(cws, outs, strict=True)]
    return bench._graph_ms(calls, rep_ms)[0]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |y - ref| relative to the output's scale (a wrong kernel shows up as O(1), a correct one ~1e-3)."""
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def sweep(models, fmts, ms, rep_ms, layout: str = "kernel") -> tuple[list[dict], list[dict]]:
    rows, table = [], []
    for mdl in models:
        shapes = product_shapes(mdl)
        for fmt in fmts:
            for i, (n, k) in enumerate(shapes):
                wts = bench._Weights(fmt, n, k, seed=2000 + i)
                cws = wts.cuda()
                prev = prev_weights(fmt, n, k, 2000 + i, layout)
                s, c = n // 16, k // 64
                for m in ms:
                    with _env("QERL_CUDA_GEMM", "0"):
                        t_prev = bench._time_fn(prev.fmt, prev, m, k, n, "fwd", rep_ms)
                    res = []
                    x = torch.randn(m, k, device="cuda").bfloat16()
                    ref = cf.emulate(x, cws[0]).float()
                    for cfg in configs(s, c, m, fmt):
                        err = _rel_err(cf.gemm(x, cws[0], config=cfg), ref)
                        if not err < 2e-2:
                            raise AssertionError(f"gemm {fmt} {n}x{k} M={m} config {cfg}: relative error {err}")
                        t = _time_gemm(cws, m, rep_ms, cfg)
                        res.append((t, cfg))
                        rows.append(dict(model=mdl, fmt=fmt, N=n, K=k, M=m, config=str(cfg), us=round(t * 1e3, 3),
                                         prev_us=round(t_prev * 1e3, 3)))
                    res.sort()
                    best_t, best = res[0]
                    table.append(dict(fmt=fmt, N=n, K=k, M=m, config=list(best), us=round(best_t * 1e3, 3),
                                      prev_us=round(t_prev * 1e3, 3), wins=best_t < t_prev))
                    heur = cf.pick_gemm_config(s, c, m, torch.cuda.get_device_properties(0).multi_processor_count)
                    th = next((t for t, cfg in res if cfg == heur), None)
                    print(f"[sweep] {fmt} {n}x{k} M={m}: best {best} {best_t * 1e3:.1f}us, prev path "
                          f"{t_prev * 1e3:.1f}us, heuristic {heur} {'' if th is None else f'{th * 1e3:.1f}us'}",
                          flush=True)
                del wts, cws, prev
                torch.cuda.empty_cache()
    return rows, table


def layer_table(models, fmts, ms, rep_ms, layout: str = "kernel") -> list[dict]:
    rows = []
    for mdl in models:
        lins = bench.layer_linears(mdl)
        shapes = list(dict.fromkeys((n, k) for _, n, k in lins))
        for fmt in ["bf16", *fmts]:
            wts = {(n, k): bench._Weights(fmt, n, k, seed=3000 + i) if fmt == "bf16"
                   else prev_weights(fmt, n, k, 3000 + i, layout) for i, (n, k) in enumerate(shapes)}
            paths = ["bf16"] if fmt == "bf16" else ["prev", "cuda_gemm", "qmm"]
            cws = {} if fmt == "bf16" else {(n, k): bench._Weights(fmt, n, k, seed=3000 + i).cuda()
                                             for i, (n, k) in enumerate(shapes)}
            for path in paths:
                for m in ms:
                    total, cfgs = 0.0, []
                    for name, n, k in lins:
                        if path == "cuda_gemm":
                            cfg = cf._gemm_config(cws[(n, k)][0], m, torch.device("cuda"))
                            t = _time_gemm(cws[(n, k)], m, rep_ms, cfg)
                            cfgs.append(f"{name}:{cfg}")
                        else:
                            mode = {"prev": "0", "qmm": "auto", "bf16": "auto"}[path]
                            with _env("QERL_CUDA_GEMM", mode):
                                t = bench._time_fn(wts[(n, k)].fmt, wts[(n, k)], m, k, n, "fwd", rep_ms)
                        total += t
                    rows.append(dict(model=mdl, fmt=fmt, path=path, M=m, us=round(total * 1e3, 2),
                                     configs=" ".join(cfgs)))
                    print(f"[layer] {mdl} {fmt:6s} {path:9s} M={m:4d}: {total * 1e3:8.1f} us/layer", flush=True)
            del wts, cws
            torch.cuda.empty_cache()
    base = {(r["model"], r["M"]): r["us"] for r in rows if r["fmt"] == "bf16"}
    for r in rows:
        b = base.get((r["model"], r["M"]))
        if b:
            r["speedup_vs_bf16"] = round(b / r["us"], 3)
    return rows


def markdown(rows: list[dict], header: str) -> str:
    out = [header, ""]
    for mdl in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == mdl]
        cols = [(f, p) for f, p in dict.fromkeys((r["fmt"], r["path"]) for r in sel)]
        out += [f"### Qwen2.5-{mdl.upper()} decoder linears, forward (µs per layer, speed-up vs BF16 in the same run)",
                "", "| M | " + " | ".join("BF16 cuBLAS" if f == "bf16" else f"{f} {p}" for f, p in cols)
                + " | issue-10 target |", "|---:|" + "---:|" * (len(cols) + 1)]
        for m in sorted({r["M"] for r in sel}):
            cells = []
            for f, p in cols:
                r = next((x for x in sel if x["M"] == m and (x["fmt"], x["path"]) == (f, p)), None)
                cells.append("–" if r is None else f"{r['us']:.1f}" if f == "bf16"
                             else f"{r['us']:.1f} ({r.get('speedup_vs_bf16', float('nan')):.2f}×)")
            tgt = TARGETS.get(m)
            out.append(f"| {m} | " + " | ".join(cells) + f" | {'' if tgt is None else f'≥ {tgt}×'} |")
        out += ["", "Paths: `prev` = the FP4 path without this kernel (as dispatched with QERL_CUDA_GEMM=0 on the "
                "layout in the header); `cuda_gemm` = the CUDA GEMM at its tuned configuration; `qmm` = the "
                "dispatcher now (the faster of the two by the tuned table).", ""]
    return "\n".join(out)


def _header(name: str, argv, layout: str = "kernel") -> str:
    import triton
    attrs = {(f, *v): cf.gemm_kernel_attributes(f, *v) for f in cf.FORMATS for v in cf.gemm_variants()}
    if cf.wgmma_supported():
        attrs.update({(f, "wgmma", *v): cf.gemm_kernel_attributes(f, v[0] // 8, 0, v[1], v[2])
                      for f in cf.FORMATS for v in cf.WGMMA_VARIANTS})
    return (f"## CUDA FP4 GEMM (M > 16) vs BF16 cuBLAS and the previous FP4 path: {name}\n\n"
            f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}. "
            f"Registers/local bytes per (fmt, n8 tiles, strips per warp, warps per group): {attrs}. Per linear: median over CUDA-graph "
            f"replays over rotating weight copies (>= 160 MB). The `prev` and `qmm` paths hold the weights in "
            f"the {'kernels' if layout == 'kernel' else 'compressed-tensors'} layout (--prev-layout {layout}). Command: `python -m benchmarks.cuda_gemm_bench "
            f"{' '.join(sys.argv[1:] if argv is None else argv)}`")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b")
    ap.add_argument("--fmts", default="nvfp4,mxfp4")
    ap.add_argument("--m", default=",".join(map(str, LAYER_M)))
    ap.add_argument("--sweep-m", default=",".join(map(str, SWEEP_M)))
    ap.add_argument("--rep", type=float, default=10.0, help="time spent replaying per measurement (ms)")
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--write-table", action="store_true", help="install the tuned table for the dispatcher")
    ap.add_argument("--no-sweep", action="store_true", help="use the installed table / heuristic as they are")
    ap.add_argument("--prev-layout", default="kernel", choices=LAYOUTS,
                    help="the layout the path without this kernel (and the dispatcher) is timed on")
    a = ap.parse_args(argv)
    if not cf.available():
        sys.exit(f"[cuda_gemm_bench] CUDA FP4 kernel unavailable: {cf.build_error()}")
    name = torch.cuda.get_device_name()
    tag = bench.gpu_tag()
    os.makedirs(a.out, exist_ok=True)
    models, fmts = a.models.split(","), a.fmts.split(",")
    hdr = _header(name, argv, a.prev_layout)
    print(hdr, flush=True)
    if not a.no_sweep:
        rows, table = sweep(models, fmts, [int(v) for v in a.sweep_m.split(",")], a.rep / 2, a.prev_layout)
        bench.write_csv(os.path.join(a.out, f"cuda_gemm_sweep_{tag}.csv"), rows)
        doc = {"device": name, "torch": torch.__version__, "command": "python -m benchmarks.cuda_gemm_bench "
               + " ".join(sys.argv[1:] if argv is None else argv), "tail_splits": cf.wgmma_tail(),
               "prev_layout": a.prev_layout, "entries": table}
        text = json.dumps(doc, indent=1) + "\n"
        with open(os.path.join(a.out, f"cuda_gemm_table_{tag}.json"), "w") as fh:
            fh.write(text)
        if a.write_table:
            path = cf.install_gemm_table(name, text)
            print(f"[cuda_gemm_bench] installed {path}", flush=True)
    rows = layer_table(models, fmts, [int(v) for v in a.m.split(",")], a.rep, a.prev_layout)
    bench.write_csv(os.path.join(a.out, f"cuda_gemm_{tag}.csv"), rows,
                    ["model", "fmt", "path", "M", "us", "speedup_vs_bf16", "configs"])
    md = markdown(rows, hdr)
    with open(os.path.join(a.out, f"cuda_gemm_{tag}.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
