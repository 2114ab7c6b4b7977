"""FP4 products at large M with the weight dequantized inside the GEMM (``qerl.kernels.cuda_dq``) against the library's
path without it and BF16 cuBLAS, per decoder-layer linear: the backward g @ Ŵ and the forward x @ Ŵᵀ.

    python -m benchmarks.dq_gemm_bench [--models 7b] [--fmts nvfp4,mxfp4] [--ops bwd,fwd] [--m 512,2048]
                                       [--kz 0,1,2,3,4,6,8] [--rep 10] [--out DIR] [--write-table]

Per model, op, format, M and linear of one decoder layer (``kernel_bench.layer_linears``): BF16 (``g @ W`` /
``F.linear``), the library's product with ``QERL_DQ_GEMM=0`` (``prev``: dequantize + cuBLAS, with the device's slice
table; for the forward, the wgmma GEMM where its tuned table picks it) and with the switch on for the op (``rule``: the
dq kernel at ``cuda_dq.pick_config``'s config wherever the library would dequantize), and the dq kernel at every
(nb, kz) of ``--kz`` (``cfg``; kz 0: stream-K), timed as ``kernel_bench`` times (one CUDA graph over rotating weight copies >= 160 MB,
median replay / copies). Before timing, each linear's dq output at every config is compared with the ``prev`` path's
on the same inputs (the same Ŵ values; only the fp32 summation order differs): the largest |difference| over the
largest |reference| goes into the rows (``rel_err``), and a config above ``--tol`` stops the run (a wrong kernel is
not timed). Rows in ``dq_gemm_<gpu>.csv`` (written as they finish), the per-layer summary (sums over the 7 linears;
speed-ups against BF16 in the same run) in ``dq_gemm_<gpu>.md``. ``--write-table`` installs per (op, shape, M) the
config of the least mean time as ``qerl/kernels/tuned/dq_gemm_<gpu>.json`` (``cuda_dq.tuned_config`` serves it;
copy it back from a device run).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks import kernel_bench as kb
from qerl.bench import _environ

PATHS = ("bf16", "prev", "rule")
TOL = 2e-2  # |dq - prev| / max |prev|: bf16 rounding of the outputs (2^-8) plus the summation order, with margin


def _weight(wts, i: int):
    from qerl.kernels import relaid
    from qerl.quant import FORMATS
    return relaid.weight(FORMATS[kb._base(wts.fmt)], wts.qs[i])


def _library(wts, i: int, g: torch.Tensor, dq: str, op: str):
    """A closure of the library's product ``op`` on copy i with ``QERL_DQ_GEMM=dq`` (read when the closure runs, so
    the capture takes the route it names)."""
    from qerl import kernels as qk
    base, q = kb._base(wts.fmt), wts.qs[i]
    _weight(wts, i)  # its one host read, before any capture
    f = qk.qmm_t if op == "bwd" else qk.qmm

    def run():
        with _environ({"QERL_DQ_GEMM": dq}):
            return f(g, base, q)
    return run


def _dq(wts, i: int, g: torch.Tensor, cfg, op: str):
    from qerl.kernels import cuda_dq
    w = _weight(wts, i)
    f = cuda_dq.gemm_t if op == "bwd" else cuda_dq.gemm
    out = torch.empty(g.shape[0], cuda_dq.dims(w, op)[1], device=g.device, dtype=torch.bfloat16)
    f(g, w, out, cfg)  # grows the split workspace before any capture
    return lambda: f(g, w, out, cfg)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def measure(models, fmts, ms, kzs, rep_ms, csv_path, tol: float = TOL, ops=("bwd", "fwd")) -> list[dict]:
    from qerl.kernels import cuda_dq
    res = []
    dev = torch.cuda.get_device_name()
    for mdl in models:
        lins = kb.layer_linears(mdl)
        shapes = list(dict.fromkeys((n, k) for _, n, k in lins))
        for fmt in ["bf16"] + [f + kb.KL for f in fmts]:
            wts = {s: kb._Weights(fmt, s[0], s[1], seed=2000 + j) for j, s in enumerate(shapes)}
            for op, m in ((op, m) for op in ops for m in ms):
                for name, n, k in lins:
                    w = wts[(n, k)]
                    r, c = (n, k) if op == "bwd" else (k, n)
                    g = torch.randn(m, r, device="cuda").bfloat16()
                    if fmt == "bf16":
                        jobs = [("bf16", None, [kb._call("bf16", w, i, g, op) for i in range(len(w.qs))])]
                    else:
                        if not cuda_dq.supported(_weight(w, 0), op):
                            print(f"[dq] {mdl} {op} {name} {(n, k)}: not a shape the kernel takes", flush=True)
                            continue
                        cfgs = [cf for cf in cuda_dq.configs(m, r, c) if cf[1] in kzs]
                        ref = _library(w, 0, g, "0", op)()
                        errs = {}
                        for cf in cfgs:
                            errs[cf] = rel_err(_dq(w, 0, g, cf, op)(), ref)
                            if errs[cf] > tol:
                                raise SystemExit(f"[dq] {mdl} {op} {fmt} M={m} {name} config {cf}: |dq - prev| / "
                                                 f"max|prev| = {errs[cf]:.3g} > {tol}: the kernel is wrong, not timed")
                        rule = cuda_dq.pick_config(m, r, c, torch.cuda.get_device_properties(0).multi_processor_count)
                        jobs = [("prev", None, [_library(w, i, g, "0", op) for i in range(len(w.qs))]),
                                ("rule", rule, [_library(w, i, g, op, op) for i in range(len(w.qs))])]
                        jobs += [("cfg", cf, [_dq(w, i, g, cf, op) for i in range(len(w.qs))]) for cf in cfgs]
                    for path, cfg, calls in jobs:
                        t, mode = kb._graph_ms(calls, rep_ms)
                        row = dict(model=mdl, op=op, fmt=kb._base(fmt), M=m, linear=name, N=n, K=k, path=path,
                                   nb=cfg[0] if cfg else "", kz=cfg[1] if cfg else "", us=round(t * 1e3, 2),
                                   rel_err=(f"{errs[cfg]:.2e}" if path == "cfg" else ""), mode=mode, device=dev)
                        res.append(row)
                        kb.write_csv(csv_path, res)
                        print(f"[dq] {mdl} {op} {row['fmt']} M={m} {name} {path} {cfg or ''}: {row['us']} us",
                              flush=True)
                    del jobs
            del wts
            torch.cuda.empty_cache()
    return res


def _vs(t: float, bf: float) -> str:
    return f"{t:.1f} ({bf / t:.2f}×)" if t else "—"


def prev_note(environ=os.environ) -> str:
    """What the ``prev`` column ran in this environment: the library's default, or, with the CUDA FP4 extension off
    (``QERL_CUDA_GEMV=0`` or ``QERL_CUDA_DEQUANT=0``: ``scripts/gpu_bench.sh dqlean``, which skips its build), the
    Triton dequantization + cuBLAS."""
    if environ.get("QERL_CUDA_GEMV", "1") == "0" or environ.get("QERL_CUDA_DEQUANT", "1") == "0":
        return ("prev: Triton dequantization + cuBLAS (QERL_CUDA_GEMV=0 or QERL_CUDA_DEQUANT=0 in this run), not the "
                "library's default path (the CUDA dequantization, and the wgmma GEMM where its table picks it); the "
                "BF16 and dq columns do not depend on it.")
    return "prev: the library's default path (the CUDA dequantization + cuBLAS; the wgmma GEMM where its table picks it)."


def summary(rows: list[dict]) -> str:
    """Per (model, op, format, M): the layer's µs (sum of its linears) by BF16, prev, rule and the best config per
    linear, with speed-ups against BF16 in the same run."""
    out = ["| model | op | FP4 | M | BF16 µs | prev µs (vs BF16) | dq rule µs (vs BF16) | dq best µs (vs BF16) | "
           "best (nb, kz) per linear | max rel err |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for mdl, op, m in dict.fromkeys((r["model"], r["op"], int(r["M"])) for r in rows):
        sel = [r for r in rows if r["model"] == mdl and r["op"] == op and int(r["M"]) == m]
        bf = sum(float(r["us"]) for r in sel if r["path"] == "bf16")
        for fmt in dict.fromkeys(r["fmt"] for r in sel if r["path"] != "bf16"):
            f = [r for r in sel if r["fmt"] == fmt]
            prev = sum(float(r["us"]) for r in f if r["path"] == "prev")
            rule = sum(float(r["us"]) for r in f if r["path"] == "rule")
            best, picks = 0.0, []
            for li in dict.fromkeys(r["linear"] for r in f):
                c = [r for r in f if r["linear"] == li and r["path"] == "cfg"]
                if c:
                    b = min(c, key=lambda r: float(r["us"]))
                    best += float(b["us"])
                    picks.append(f"{li} ({b['nb']}, {b['kz']})")
            err = max((float(r["rel_err"]) for r in f if r["rel_err"] not in ("", None)), default=float("nan"))
            out.append(f"| {mdl} | {op} | {fmt} | {m} | {bf:.1f} | {_vs(prev, bf)} | {_vs(rule, bf)} | "
                       f"{_vs(best, bf)} | "
                       f"{', '.join(picks)} | {err:.1e} |")
    return "\n".join(out)


def table(rows: list[dict]) -> list[dict]:
    """The config table's entries: per (op, r, c, M) the (nb, kz) of the least mean µs over the linears (and formats)
    of that shape (r: the contraction, c: the output width)."""
    acc: dict = {}
    for r in rows:
        if r["path"] != "cfg":
            continue
        n, k = int(r["N"]), int(r["K"])
        rc = (n, k) if r["op"] == "bwd" else (k, n)
        acc.setdefault((r["op"], *rc, int(r["M"])), {}).setdefault((int(r["nb"]), int(r["kz"])), []).append(
            float(r["us"]))
    out = []
    for (op, rr, c, m), by in sorted(acc.items()):
        mean = {cfg: sum(v) / len(v) for cfg, v in by.items()}
        nb, kz = min(mean, key=mean.get)
        out.append(dict(op=op, r=rr, c=c, M=m, nb=nb, kz=kz, us=round(mean[(nb, kz)], 2)))
    return out


def parse_ints(text: str, name: str, least: int = 1) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} {text!r}: comma-separated integers expected") from None
    if not vals or any(v < least for v in vals):
        raise ValueError(f"--{name} {text!r}: integers >= {least} expected")
    return vals


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b")
    ap.add_argument("--fmts", default="nvfp4,mxfp4")
    ap.add_argument("--m", default="512,2048")
    ap.add_argument("--ops", default="bwd,fwd")
    ap.add_argument("--kz", default="0,1,2,3,4,6,8", help="splits of the contraction; 0: stream-K over the SMs")
    ap.add_argument("--rep", type=float, default=10.0)
    ap.add_argument("--tol", type=float, default=TOL)
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--write-table", action="store_true",
                    help="install the fastest config per (op, shape, M) as qerl/kernels/tuned/dq_gemm_<gpu>.json")
    a = ap.parse_args(argv)
    from qerl.kernels import cuda_dq
    try:
        ms, kzs = parse_ints(a.m, "m"), parse_ints(a.kz, "kz", least=0)
    except ValueError as e:
        ap.error(str(e))
    bad = [f for f in a.fmts.split(",") if f not in ("nvfp4", "mxfp4")]
    if bad:
        ap.error(f"--fmts {a.fmts!r}: {bad} not FP4 formats; valid: nvfp4, mxfp4")
    ops = [o for o in a.ops.split(",") if o]
    if not ops or any(o not in cuda_dq.OPS for o in ops):
        ap.error(f"--ops {a.ops!r}: valid: {', '.join(cuda_dq.OPS)}")
    if any(kz > cuda_dq.MAX_KZ for kz in kzs):
        ap.error(f"--kz {a.kz!r}: at most {cuda_dq.MAX_KZ}")
    try:
        abl = cuda_dq.ablate()
        cuda_dq.decode()
        cuda_dq.loop()
        cuda_dq.stages()
    except ValueError as e:
        ap.error(str(e))
    if abl and a.write_table:
        ap.error(f"QERL_DQ_ABLATE={abl} times a kernel that computes wrong results: no --write-table")
    if not cuda_dq.available():
        sys.exit(f"[dq] the dq GEMM needs an sm_90 GPU and its extension build ({cuda_dq._STATE.get('error')})")
    os.makedirs(a.out, exist_ok=True)
    tag = kb.gpu_tag("")
    rows = measure(a.models.split(","), a.fmts.split(","), ms, kzs, a.rep,
                   os.path.join(a.out, f"dq_gemm_{tag}.csv"), float("inf") if abl else a.tol, ops)
    md = summary(rows)
    if abl:  # the parts left out; the error column then measures the ablation, not the kernel
        md = (f"**Ablation QERL_DQ_ABLATE={abl}** (timing only, wrong results): "
              + ", ".join(w for b, w in cuda_dq.ABLATE_BITS.items() if abl & b) + ".\n\n" + md)
    with open(os.path.join(a.out, f"dq_gemm_{tag}.md"), "w") as f:
        f.write(f"## FP4 products with the weight dequantized inside the GEMM: {torch.cuda.get_device_name()}"
                f"\n\ntorch {torch.__version__}, QERL_DQ_DECODE={cuda_dq.decode()}, QERL_DQ_LOOP={cuda_dq.loop()}, "
                f"QERL_DQ_STAGES={cuda_dq.stages()}. Command: `python -m benchmarks.dq_gemm_bench "
                f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{prev_note()}\n\n{md}\n")
    print(md)
    if a.write_table:
        import json
        doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, decode=cuda_dq.decode(),
                   command="python -m benchmarks.dq_gemm_bench " + " ".join(sys.argv[1:] if argv is None else argv),
                   entries=table(rows))
        text = json.dumps(doc, indent=1) + "\n"
        with open(os.path.join(a.out, f"dq_gemm_table_{tag}.json"), "w") as f:
            f.write(text)
        print(f"[dq] installed {cuda_dq.install_table(torch.cuda.get_device_name(), text)}", flush=True)


if __name__ == "__main__":
    main()
