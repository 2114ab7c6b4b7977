"""The decode linears with LoRA: the FP4 GEMV alone, with the LoRA in the same launch, and with the LoRA as its own
launches — what the LoRA costs at decode, against what its bytes cost.

    python -m benchmarks.lora_gemv_bench [--models 7b] [--m 1,2,8,16] [--fmts nvfp4,mxfp4] [--rank 32]
                                         [--chunks 2] [--pdl] [--ablate 1,2,4] [--out results/speed] [--tag NAME]
                                         [--ncu [--linears "q|k|v,o"]]

For the four linears of one decoder layer as the rollout's sampler runs them (q|k|v and gate|up fused, o, down;
every member with LoRA rank ``--rank``), each timed as in ``kernel_bench``: one CUDA graph over rotating copies of
the weight and its LoRA (>= 160 MB, so every read comes from HBM), median replay per call. Modes:

* ``plain``: ``cuda_fp4.gemv`` without LoRA (the floor the LoRA adds to);
* ``one-launch``: ``gemv(..., lora=LoraOperand)`` (what ``FusedLinear`` / ``QuantLoRALinear`` run at decode);
* ``split``: ``gemv`` + ``lora_a`` (Triton x·Aᵀ) + one cuBLAS addmm (the sampler with ``QERL_CUDA_LORA=0``).

Per linear and per layer (the four back to back over consecutive layer copies, one graph): µs, the LoRA's overhead
(mode − plain) and its bytes-floor (A and Bn read once at the device-to-device copy bandwidth measured in the same
run). ``--chunks`` sets ``lora_parts``' K chunks per LoRA warp (one value per timed variant). The one-launch output
is checked against the split path on the first copy (max |difference| printed and saved). ``--pdl``: every launch of
a chain but the first under programmatic dependent launch, as the decode step runs them (the split mode's GEMV too).
``--ablate``: modes ``ablate-V``, the one-launch path through a build with ``-DQFP4_LORA_ABLATE=V``
(``csrc/fp4_mma_gemv.cu``: 1 = the output warps add no LoRA term, 2 = the LoRA CTAs only count themselves done, 4 =
the output warps do not wait for them, 8 = the output warps add the term before their main loop, without waiting: with
2, a launch whose t the kernel before it wrote), a module of its own that the library never loads; **its results are wrong**
(not checked), only its time counts: what that part of the LoRA costs on the launch's critical path. Writes
``lora_gemv_<gpu><tag>.csv`` / ``.md`` under ``--out``; prints the markdown last. ``--ncu``: no timing and no report,
only two eager launches per selected linear (``--linears``) and mode (plain, one-launch) for Nsight Compute, each
batch named on stdout in launch order (``scripts/gpu_bench.sh ncu32``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch

from benchmarks import kernel_bench as bench
from qerl.kernels import cuda_fp4 as cf

MODES = ("plain", "one-launch", "split")
ABLATE_BITS = {1: "no LoRA term in the output warps", 2: "LoRA CTAs only count", 4: "no wait for the LoRA CTAs",
               8: "the term before the main loop, no wait"}


def groups(model: str, rank: int) -> list[tuple[str, list[tuple[int, int]], int]]:
    """(name, members as (rows, rank), K) of the four decode linears of one layer."""
    h, inter, nh, nkv, hd = bench.MODELS[model]
    return [("q|k|v", [(nh * hd, rank), (nkv * hd, rank), (nkv * hd, rank)], h),
            ("o", [(h, rank)], nh * hd),
            ("gate|up", [(inter, rank), (inter, rank)], h),
            ("down", [(h, rank)], inter)]


class _Linear:
    """Rotating copies of one (fused) linear: CUDA FP4 weights (or BF16 ones as stored), LoRA operands and the
    split path's A, Bᵀ (no LoRA when every member's rank is 0: ``ops`` then holds None per copy)."""

    def __init__(self, fmt: str, members, k: int, seed: int):
        n = sum(rows for rows, _ in members)
        wts = bench._Weights(fmt, n, k, seed)
        self.ws = wts.cuda()
        del wts
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        r = sum(rk for _, rk in members)
        self.ops, self.bts = [], []
        for _ in self.ws if r else ():
            a = (torch.randn(r, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
            bts = [(0.05 * torch.randn(rk, rows, generator=gen, device="cuda")).bfloat16() for rows, rk in members]
            self.ops.append(cf.LoraOperand(a, cf.lora_bn(bts, members), members))
            bt = torch.zeros(r, n, dtype=torch.bfloat16, device="cuda")  # block-diagonal, as FusedLinear's Bt
            r0 = c0 = 0
            for (rows, rk), b in zip(members, bts, strict=True):
                bt[r0:r0 + rk, c0:c0 + rows] = b
                r0, c0 = r0 + rk, c0 + rows
            self.bts.append(bt)
        if not r:
            self.ops = [None] * len(self.ws)
        self.n, self.k = n, k
        self.lora_bytes = r * k * 2 + (self.ops[0].bn.numel() * 2 if r else 0)

    def call(self, mode: str, i: int, x: torch.Tensor, out: torch.Tensor, pdl: bool = False):
        """The launch(es) of ``mode`` on copy i (``pdl``: the GEMV under programmatic dependent launch); an
        ``ablate-V`` mode is the one-launch call, timed while that variant's module is the extension."""
        w, op = self.ws[i], self.ops[i]
        if mode == "plain":
            return lambda: cf.gemv(x, w, out=out, pdl=pdl)
        if mode == "one-launch" or mode.startswith("ablate-"):
            return lambda: cf.gemv(x, w, out=out, lora=op, pdl=pdl)
        from qerl.kernels.fused import lora_a
        bt = self.bts[i]
        return lambda: cf.gemv(x, w, out=out, pdl=pdl).addmm_(lora_a(x, op.a), bt)


def _check(lin: _Linear, m: int) -> float:
    """max |one-launch − split| on the first copy for a random x (bf16 outputs, relative to max |split|)."""
    x = torch.randn(m, lin.k, device="cuda").bfloat16()
    a = torch.empty(m, lin.n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    lin.call("one-launch", 0, x, a)()
    lin.call("split", 0, x, b)()
    torch.cuda.synchronize()
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def parse_ablate(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]: bit sets of ``ABLATE_BITS`` (each > 0), in order, no repeats."""
    try:
        vs = list(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        raise ValueError(f"--ablate {text!r}: expected comma-separated integers, e.g. 1,2,4") from None
    bad = [v for v in vs if not 1 <= v <= sum(ABLATE_BITS)]
    if bad:
        raise ValueError(f"--ablate {text!r}: {bad} not a bit set of {ABLATE_BITS} (1..{sum(ABLATE_BITS)})")
    return vs


def run(models, ms, fmts, rank: int, chunks, rep_ms: float, copy_bw: float, pdl: bool = False,
        ablate: list[int] | None = None) -> list[dict]:
    from benchmarks import wgmma_ablate as wa
    rows = []
    orig = cf.lora_parts
    mods = {v: wa.module(v, "QFP4_LORA_ABLATE") for v in ablate or ()}
    for mdl in models:
        gs = groups(mdl, rank)
        for fmt in fmts:
            lins = [_Linear(fmt, members, k, seed=2000 + 10 * j) for j, (_, members, k) in enumerate(gs)]
            for m in ms:
                xs = {k: torch.randn(m, k, device="cuda").bfloat16() for _, _, k in gs}
                outs = [torch.empty(m, lin.n, device="cuda", dtype=torch.bfloat16) for lin in lins]
                variants = [("plain", None), *[("one-launch", c) for c in chunks], ("split", None),
                            *[(f"ablate-{v}", None) for v in ablate or ()]]
                for mode, c in variants:
                    cf.lora_parts = orig if c is None else functools.partial(orig, chunks_per_warp=c)
                    cf.forget_gemv_configs()  # LoRA launch configs depend on lora_parts: pick them again
                    ext = contextlib.ExitStack()  # an ablated mode launches its variant's module
                    if mode.startswith("ablate-"):
                        ext.enter_context(wa.using(mods[int(mode.split("-")[1])]))
                    try:
                        total = 0.0
                        for (name, _, k), lin, out in zip(gs, lins, outs, strict=True):
                            calls = [lin.call(mode, i, xs[k], out, pdl and i > 0) for i in range(len(lin.ws))]
                            t = bench._graph_ms(calls, rep_ms)[0] * 1e3
                            total += t
                            err = _check(lin, m) if mode == "one-launch" else None  # ablated: wrong by design
                            rows.append(dict(model=mdl, fmt=fmt, M=m, linear=name, N=lin.n, K=k, mode=mode,
                                             chunks=c or "", us=round(t, 3), lora_bytes=lin.lora_bytes,
                                             floor_us=round(lin.lora_bytes / copy_bw * 1e6, 3),
                                             rel_diff_vs_split="" if err is None else f"{err:.2e}"))
                        layers = min(64, min(len(lin.ws) for lin in lins))
                        calls = [lin.call(mode, r % len(lin.ws), xs[k], out, pdl and (r, j) != (0, 0))
                                 for r in range(layers) for j, ((_, _, k), lin, out) in enumerate(zip(gs, lins, outs,
                                                                                                       strict=True))]
                        tl = bench._graph_ms(calls, rep_ms)[0] * 1e3 * len(gs)
                        rows.append(dict(model=mdl, fmt=fmt, M=m, linear="layer (sum)", N=0, K=0, mode=mode,
                                         chunks=c or "", us=round(total, 3),
                                         lora_bytes=sum(lin.lora_bytes for lin in lins),
                                         floor_us=round(sum(lin.lora_bytes for lin in lins) / copy_bw * 1e6, 3),
                                         rel_diff_vs_split=""))
                        rows.append(dict(rows[-1], linear="layer (graph)", us=round(tl, 3)))
                        print(f"[lora_gemv] {mdl} {fmt} M={m:2d} {mode:10s} chunks={c or '-'}: layer {total:7.1f} us "
                              f"(graph {tl:7.1f})", flush=True)
                    finally:
                        cf.lora_parts = orig
                        ext.close()
                        if mode.startswith("ablate-"):  # an ablated launch may leave the LoRA counters set
                            torch.cuda.synchronize()
                            cf.zero_lora_counters()
            del lins
            torch.cuda.empty_cache()
    for r in rows:  # overhead of the LoRA: the mode minus the plain GEMV of the same (model, fmt, M, linear)
        base = next(b for b in rows if b["mode"] == "plain" and all(b[f] == r[f] for f in ("model", "fmt", "M",
                                                                                         "linear")))
        r["overhead_us"] = round(r["us"] - base["us"], 3)
    return rows


def markdown(rows, header: str) -> str:
    out = [header, ""]
    keys = list(dict.fromkeys((r["model"], r["fmt"], r["M"]) for r in rows))
    variants = list(dict.fromkeys((r["mode"], r["chunks"]) for r in rows if r["mode"] != "plain"))
    for mdl, fmt, m in keys:
        sel = [r for r in rows if (r["model"], r["fmt"], r["M"]) == (mdl, fmt, m)]
        out += [f"### {mdl} {fmt}, M = {m}", ""]
        head = ["linear", "plain µs"] + [f"{md}{f' c{c}' if c else ''} µs (+LoRA)" for md, c in variants]
        out += ["| " + " | ".join(head + ["LoRA bytes-floor µs"]) + " |", "|" + "---|" * (len(head) + 1)]
        for lin in dict.fromkeys(r["linear"] for r in sel):
            lr = [r for r in sel if r["linear"] == lin]
            plain = next(r for r in lr if r["mode"] == "plain")
            cells = [lin, f"{plain['us']:.1f}"]
            for md, c in variants:
                r = next(r for r in lr if (r["mode"], r["chunks"]) == (md, c))
                cells.append(f"{r['us']:.1f} (+{r['overhead_us']:.1f})")
            out.append("| " + " | ".join(cells + [f"{plain['floor_us']:.2f}"]) + " |")
        out.append("")
    return "\n".join(out)


def ncu_launches(models, ms, fmts, rank: int, linears, copies: int = 2) -> None:
    """``--ncu``: no timing, no report. Each selected linear's plain and one-launch GEMV, ``copies`` eager launches
    each on distinct weight copies, for a profiler to catch (``scripts/gpu_bench.sh ncu32`` runs this under Nsight
    Compute, ``--kernel-name regex:fp4_gemv``). Prints which launches are which, in launch order."""
    n = 0
    for mdl in models:
        for fmt in fmts:
            sel = [(name, members, k) for name, members, k in groups(mdl, rank) if name in linears]
            lins = [_Linear(fmt, members, k, seed=3000 + 10 * j) for j, (_, members, k) in enumerate(sel)]
            for m in ms:
                for (name, _, k), lin in zip(sel, lins, strict=True):
                    x = torch.randn(m, k, device="cuda").bfloat16()
                    out = torch.empty(m, lin.n, device="cuda", dtype=torch.bfloat16)
                    c = min(copies, len(lin.ws))
                    for mode in ("plain", "one-launch"):
                        for i in range(c):
                            lin.call(mode, i, x, out)()
                        torch.cuda.synchronize()
                        print(f"[ncu] GEMV launches {n}..{n + c - 1}: {mdl} {fmt} M={m} {name} ({lin.n} x {k}) {mode}",
                              flush=True)
                        n += c
            del lins
            torch.cuda.empty_cache()


def parse_linears(text: str) -> list[str]:
    """``"q|k|v,o"`` -> the named linears of :func:`groups`, in order, no repeats; a bad name names the choices."""
    names = [g[0] for g in groups("7b", 16)]
    got = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [v for v in got if v not in names]
    if bad or not got:
        raise ValueError(f"--linears {text!r}: {bad or 'nothing'} not among {names}")
    return got


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b")
    ap.add_argument("--m", default="1,2,8,16")
    ap.add_argument("--fmts", default="nvfp4,mxfp4")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--chunks", default="2", help="lora_parts chunks per LoRA warp, one timed variant each")
    ap.add_argument("--pdl", action="store_true", help="every launch of a chain but the first under PDL")
    ap.add_argument("--ablate", default="", help="QFP4_LORA_ABLATE variants to time (timing only: wrong results), "
                                                 "e.g. 1,2,4")
    ap.add_argument("--rep", type=float, default=20.0, help="time spent replaying per measurement (ms)")
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--tag", default="")
    ap.add_argument("--ncu", action="store_true", help="no timing: a few eager launches per linear and mode for "
                                                       "Nsight Compute (scripts/gpu_bench.sh ncu32)")
    ap.add_argument("--linears", default=None, help="with --ncu: which linears to launch (default: all four)")
    a = ap.parse_args(argv)
    models = [s for s in a.models.split(",") if s]
    bad = [s for s in models if s not in bench.MODELS]
    if bad:
        raise SystemExit(f"unknown --models {bad}; choose from {sorted(bench.MODELS)}")
    fmts = [s for s in a.fmts.split(",") if s]
    if any(f not in ("nvfp4", "mxfp4") for f in fmts):
        raise SystemExit(f"--fmts must be among nvfp4, mxfp4 (the CUDA FP4 GEMV's formats), got {fmts}")
    ms = [int(s) for s in a.m.split(",") if s]
    if any(not 1 <= m <= 16 for m in ms):
        raise SystemExit(f"--m must be decode sizes in [1, 16], got {ms}")
    chunks = [int(s) for s in a.chunks.split(",") if s]
    if not chunks or any(c < 1 for c in chunks):
        raise SystemExit(f"--chunks must be positive integers, got {a.chunks!r}")
    ablate = parse_ablate(a.ablate)
    if a.linears is not None and not a.ncu:
        raise SystemExit(f"--linears {a.linears!r} applies only with --ncu (the timed run covers the whole layer)")
    try:
        linears = parse_linears(a.linears or "q|k|v,o,gate|up,down")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not torch.cuda.is_available() or not cf.available():
        raise SystemExit("lora_gemv_bench needs a CUDA GPU (sm_80+) and the cuda_fp4 extension")
    if a.ncu:
        return ncu_launches(models, ms, fmts, a.rank, linears)
    copy_bw = bench.copy_bandwidth()
    rows = run(models, ms, fmts, a.rank, chunks, a.rep, copy_bw, a.pdl, ablate)
    header = (f"## LoRA at decode: FP4 GEMV alone / LoRA in the same launch / LoRA as its own launches\n\n"
              f"{bench.run_line(copy_bw)}, rank {a.rank}, `{' '.join(sys.argv)}`. "
              f"(+x) = µs over the plain GEMV of the same run."
              + "".join(f" ablate-{v}: {' + '.join(t for b, t in ABLATE_BITS.items() if v & b)} (timing only: "
                        f"wrong results)." for v in ablate))
    bench.write_report(a.out, f"lora_gemv_{bench.gpu_tag()}{a.tag}", rows, markdown(rows, header))


if __name__ == "__main__":
    main()
