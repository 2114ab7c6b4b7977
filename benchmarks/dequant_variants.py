"""The CUDA dequantization (``csrc/fp4_dequant.cu``) in build variants, against the library's own build (GPU).

    python -m benchmarks.dequant_variants [--variants base,lines,...] [--passes 5] [--out DIR]

Why: dequantize + cuBLAS is the FP4 path at large M and in the backward, and the rebuild of Ŵ is what the layer
pays over BF16 there (issue 10's M = 2048 and backward targets). The kernel writes Ŵ at 2.15 TB/s on an H100 (a 7B
gate_proj in 80.7 µs, ``results/speed/dequant.csv``) against the device's 3.02 TB/s copy bandwidth; its first
version wrote half of every sector per store and ran at 1.35 TB/s, so the store pattern is known to matter. Each
variant (:data:`VARIANTS`: the file's ``QFP4_DQ_*`` switches) is built alone by nvcc into a shared library and
called through ctypes (``qfp4_dequant``: no torch extension, a few seconds a build; the builds run at once).

Per variant: its output against the Triton kernel's (``dequantize_relaid(backend="triton")``) bit for bit on the
7B shapes (NVFP4 with its global scale, MXFP4), a shape whose chunks do not divide into the variant's batches, and
a column slice of a weight (strips read where they lie); then the 7B linears timed as CUDA graphs of one launch per
rotating weight copy (>= 160 MB, so L2 holds none), the variants interleaved per pass (order reversed every other
pass, so a drift over the run cancels in the medians). Rows (median µs, TB/s of packed bytes read + BF16 written,
the ratio to ``base`` per pass and its median) go to ``dequant_variants.csv`` and a table to
``dequant_variants.md`` in ``--out``. ``base`` is the library's kernel (the switches unset, the extension's nvcc
flags: the same machine code, checked on the CPU by tests/test_dequant_variants.py).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[1] / "qerl" / "kernels" / "csrc"
SOURCE = CSRC / "fp4_dequant.cu"
# name -> the -D switches of csrc/fp4_dequant.cu (see its header); base: none, the library's kernel
VARIANTS = {
    "base": (),
    "vec": ("QFP4_DQ_VEC=1",),
    "lines": ("QFP4_DQ_LINES=1",),
    "stcs": ("QFP4_DQ_STCS=1",),
    "lines_stcs": ("QFP4_DQ_LINES=1", "QFP4_DQ_STCS=1"),
    "vec_cpw8": ("QFP4_DQ_VEC=1", "QFP4_DQ_CPW=8"),
    "vec_warps4": ("QFP4_DQ_VEC=1", "QFP4_DQ_WARPS=4"),
    "vec_persist2": ("QFP4_DQ_VEC=1", "QFP4_DQ_PERSIST=2"),
    "vec_persist3": ("QFP4_DQ_VEC=1", "QFP4_DQ_PERSIST=3"),
    "lines_persist2": ("QFP4_DQ_LINES=1", "QFP4_DQ_PERSIST=2"),
    "bulk": ("QFP4_DQ_BULK=1", "QFP4_DQ_WARPS=4"),
    "bulk_persist4": ("QFP4_DQ_BULK=1", "QFP4_DQ_WARPS=4", "QFP4_DQ_PERSIST=4"),
}
DEFAULT = ",".join(VARIANTS)
FMT_ID = {"nvfp4": 0, "mxfp4": 1}


def parse_variants(text: str) -> list[str]:
    """The comma-separated variant names, ``base`` first (added when missing: every ratio is against it)."""
    names = [v for v in text.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown dequant variant(s) {bad}; valid: {', '.join(VARIANTS)}")
    return ["base"] + [v for v in dict.fromkeys(names) if v != "base"]


def nvcc_command(name: str, out: Path, arch: list[str], shared: bool = True) -> list[str]:
    """nvcc's command line for variant ``name``: a shared library (or, ``shared=False``, an object file, for the
    CPU tests' machine-code comparison) of csrc/fp4_dequant.cu with the variant's switches."""
    flags = [f"-D{d}" for d in VARIANTS[name]]
    kind = ["-shared", "-Xcompiler", "-fPIC"] if shared else ["-c"]
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # as the library's extension build passes them
    return ["nvcc", "-O3", *kind, *COMMON_NVCC_FLAGS, *arch, f"-I{CSRC}", *flags, "-o", str(out), str(SOURCE)]


def build(names: list[str], workdir: Path, arch: list[str]) -> dict[str, ctypes.CDLL]:
    """Every variant's shared library, built at once (one nvcc each); a failed build raises with its stderr."""
    procs = {n: (subprocess.Popen(nvcc_command(n, workdir / f"dq_{n}.so", arch), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)) for n in names}
    libs = {}
    for n, p in procs.items():
        _, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"dequant variant {n} did not build:\n{err[-3000:]}")
        lib = ctypes.CDLL(str(workdir / f"dq_{n}.so"))
        lib.qfp4_dequant.restype = ctypes.c_int
        lib.qfp4_dequant.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int,
                                     ctypes.c_void_p]
        libs[n] = lib
    return libs


def run(lib: ctypes.CDLL, w, out: torch.Tensor) -> torch.Tensor:
    """out = Ŵ of the re-laid-out weight ``w`` (whole, or a column slice of strided strips) by ``lib``'s kernel on
    the current stream: the library binding's argument rules (``fp4_mma_binding.cpp``'s ``dequant``)."""
    qw, sc = w.qweight, w.scales
    s, c = qw.shape[0], qw.shape[1]
    cs = qw.stride(0) // 128
    if not (qw.stride(1) == 128 and qw.stride(2) == 4 and qw.stride(3) == 1 and cs >= c
            and sc.stride(0) == cs * sc.shape[2] and out.shape == (16 * s, 64 * c) and out.stride(1) == 1):
        raise ValueError("dequant_variants.run: qweight/scales must be a weight's strips (whole or a column slice) "
                         "and out bf16 (16 S, 64 C) with unit column stride")
    gs = w.global_scale.data_ptr() if w.global_scale is not None else None
    err = lib.qfp4_dequant(qw.data_ptr(), sc.data_ptr(), gs, out.data_ptr(), out.stride(0), s, c, cs,
                           FMT_ID[w.fmt], torch.cuda.current_stream().cuda_stream)
    if err:
        raise RuntimeError(f"qfp4_dequant returned {err}")
    return out


def check(libs: dict, shapes: list[tuple[str, int, int]], formats: list[str]) -> list[str]:
    """Each variant's output against the Triton kernel's, bit for bit: the timed shapes, a 144 x 832 weight (13
    chunks: a short last batch for every chunks-per-warp value) and a column slice (chunks 2..10 of it). Returns
    the failures ("variant fmt shape"), empty when all are equal."""
    from benchmarks.dequant_bench import weight
    from qerl.kernels import dequantize_relaid
    from qerl.kernels.dequant import _relaid_cols
    bad = []
    for fmt in formats:
        for i, (name, n, k) in enumerate([*shapes, ("odd", 144, 832)]):
            w = weight(fmt, n, k, seed=1000 + i)
            ref = dequantize_relaid(w, torch.empty((n, k), device="cuda", dtype=torch.bfloat16), backend="triton")
            views = [(name, w, ref)]
            if name == "odd":
                views.append(("slice", _relaid_cols(w, 128, 704), ref[:, 128:704]))
            for label, wv, r in views:
                for v, lib in libs.items():
                    got = run(lib, wv, torch.full(r.shape, float("nan"), device="cuda", dtype=torch.bfloat16))
                    if not torch.equal(got, r):
                        bad.append(f"{v} {fmt} {label}")
    return bad


def _graph(lib, ws: list, out: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one launch per weight copy in ``ws``, all into ``out``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in ws:  # warm: the first launch of a library outside capture
            run(lib, w, out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            run(lib, w, out)
    return g


def time_graph(g: torch.cuda.CUDAGraph, launches: int, reps: int = 5) -> float:
    """µs per launch: the median over ``reps`` replays of ``g`` (``launches`` launches each), after one warm-up."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    ts = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(ts)


def table(rows: list[dict]) -> str:
    """Markdown: per (format, linear) the base's µs and TB/s, then each variant's µs and its median ratio to base."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    head = "| fmt | linear | N × K | " + " | ".join(f"{v} µs (TB/s, vs base)" for v in variants) + " |"
    lines = [head, "|" + "---|" * (3 + len(variants))]
    keys = list(dict.fromkeys((r["fmt"], r["linear"], r["n"], r["k"]) for r in rows))
    for fmt, lin, n, k in keys:
        cells = []
        for v in variants:
            r = next((r for r in rows if (r["fmt"], r["linear"], r["variant"]) == (fmt, lin, v)), None)
            cells.append("" if r is None else f"{r['us']:.1f} ({r['tb_s']:.2f}, {r['vs_base']:.3f}×)")
        lines.append(f"| {fmt} | {lin} | {n} × {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=DEFAULT, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--models", default="7b")
    p.add_argument("--formats", default="nvfp4,mxfp4")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--out", default="results/speed")
    a = p.parse_args(argv)
    names = parse_variants(a.variants)
    formats = [f for f in a.formats.split(",") if f]
    bad_fmt = [f for f in formats if f not in FMT_ID]
    if bad_fmt:
        raise ValueError(f"unknown format(s) {bad_fmt}; valid: {', '.join(FMT_ID)}")
    if not torch.cuda.is_available():
        raise SystemExit("dequant_variants needs a CUDA GPU")
    from benchmarks.dequant_bench import linears, rotating_copies, weight
    from qerl.bench_common import _env, _write_csv
    from qerl.kernels import cuda_build
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = _env()
    with tempfile.TemporaryDirectory() as tmp:
        libs = build(names, Path(tmp), cuda_build.arch_flags())
        shapes = [(f"{m}:{lin}", n, k) for m in a.models.split(",") for lin, n, k in linears(m)]
        bad = check(libs, shapes, formats)
        print(f"bits equal to the Triton kernel: {'all' if not bad else 'NOT ' + ', '.join(bad)}", flush=True)
        rows = []
        for fmt in formats:
            for i, (name, n, k) in enumerate(shapes):
                w0 = weight(fmt, n, k, seed=2000 + i)
                ws = rotating_copies(w0)
                out = torch.empty((n, k), device="cuda", dtype=torch.bfloat16)
                graphs = {v: _graph(libs[v], ws, out) for v in names}
                per = {v: [] for v in names}
                for pss in range(a.passes):
                    for v in (names if pss % 2 == 0 else names[::-1]):
                        per[v].append(time_graph(graphs[v], len(ws)))
                moved = w0.nbytes + 2 * n * k
                new = []
                for v in names:
                    us = statistics.median(per[v])
                    ratio = statistics.median(b / x for b, x in zip(per["base"], per[v], strict=True))  # base µs / variant µs
                    new.append(dict(bench="dequant_variants", model=name.split(":")[0], fmt=fmt,
                                    linear=name.split(":")[1], n=n, k=k, variant=v, flags=" ".join(VARIANTS[v]),
                                    us=us, us_min=min(per[v]), us_max=max(per[v]), tb_s=moved / us / 1e6,
                                    vs_base=ratio, passes=a.passes, launches=len(ws), bits_ok=not any(
                                        b.startswith(f"{v} ") for b in bad), **env))
                    print(f"{fmt} {name:14s} {n:6d}x{k:<6d} {v:15s} {us:8.2f} us ({moved / us / 1e6:.2f} TB/s) "
                          f"x{ratio:.3f} vs base", flush=True)
                _write_csv(new, out_dir / "dequant_variants.csv",
                           ("bench", "model", "fmt", "linear", "n", "k", "variant", "device"))
                rows += new
                del graphs, ws, out
                torch.cuda.empty_cache()
    (out_dir / "dequant_variants.md").write_text(
        f"## The CUDA dequantization's build variants ({env['device']}, {a.passes} passes, git {env['git_sha']})\n\n"
        f"µs per launch (median over passes; each pass the median of 5 graph replays), TB/s of packed bytes read "
        f"+ BF16 written, and the median over passes of base's time / the variant's (> 1: faster). Bits equal to "
        f"the Triton kernel: {'all variants' if not bad else 'NOT ' + ', '.join(bad)}.\n\n" + table(rows))


if __name__ == "__main__":
    main()
