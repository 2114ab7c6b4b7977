"""What each part of the wgmma GEMM's main loop costs (issue 10, session 40): the tuned launch of each product timed
with builds that leave one part out (GPU, sm_90a).

    python -m benchmarks.wgmma_ablate [--variants 0,1,3,4,7,8] [--shapes 37888x3584,3584x18944] [--m 64,128,256]
                                      [--fmt nvfp4] [--rep 10] [--out results/speed]
    python -m benchmarks.wgmma_ablate --build-only 3      (compile one variant's module, e.g. in parallel beforehand)

A variant is the bit set ``QFP4_WGMMA_ABLATE`` (``csrc/fp4_wgmma_gemm.cu``) compiled into a module of its own
(prefix ``qerl_fp4_ablate``; the library never loads it): 1 = the token tile staged for the pipeline's first chunks
only, 2 = the same for the weight words and scales, 4 = no decode (one XOR per A register), 8 = no group barrier when
a chunk is acquired, 16 = the MMAs' A operand from shared memory (SS MMAs reading the token tile's first 64 rows; the
decoded fragments computed and kept alive, read by no MMA: with 4, what the MMAs cost with no register operand, the
bound on a design that decodes the weights into shared memory); 0 = the library's own build. Bits 1 and 2 act on the
cp.async staging only: the variants that stage by tensor copies (``QERL_WGMMA_TMA=1``, the default, 128+ tokens a
CTA; session 40 measured before it) stage every chunk with them set. **An ablated build computes wrong results**: this script only
times it. While one variant is timed, ``cuda_fp4._ext`` returns that variant's module, so ``cuda_fp4.gemm`` launches
it through the library's own dispatch (the token permutation's launch included, as ``cuda_gemm_bench._time_gemm``
times it: CUDA-graph replays over weight copies larger than L2). Each (shape, M) runs at the configuration the device's
table picks (skipped where that is not a wgmma one), every variant twice in the order A B C ... C B A; columns ``us``
(the mean), ``us_passes`` and ``vs_full`` (the variant's time over variant 0's). The gap between variant 0 and a
variant is what that part costs on the critical path, not its instruction count: parts that overlap others cost
less than they issue.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

BITS = {1: "tokens staged once", 2: "weights staged once", 4: "no decode", 8: "no group barrier",
        16: "A from shared memory"}
MAX_BITS = sum(BITS)
_STATE: dict = {}  # the ablated modules' build cache (not the library's: an ablated build's error is not its error)


def parse_variants(text: str) -> list[int]:
    """``"0,1,3"`` -> [0, 1, 3]: bit sets of ``BITS``, 0 first (the reference every other is compared with)."""
    try:
        vs = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--variants {text!r}: expected comma-separated integers, e.g. 0,1,3") from None
    bad = [v for v in vs if not 0 <= v <= MAX_BITS]
    if bad or not vs:
        raise ValueError(f"--variants {text!r}: each must be a bit set of {BITS} (0..{MAX_BITS})")
    return [0] + [v for v in dict.fromkeys(vs) if v != 0]


def describe(v: int) -> str:
    return "full kernel" if v == 0 else " + ".join(BITS[b] for b in BITS if v & b)


def module(v: int, define: str = "QFP4_WGMMA_ABLATE"):
    """The extension module of variant ``v`` (0: the library's; others: built with -D``define``=v, a module of its own
    that the library never loads: ``QFP4_WGMMA_ABLATE`` here, ``QFP4_LORA_ABLATE`` for benchmarks.lora_gemv_bench)."""
    from qerl.kernels import cuda_build
    from qerl.kernels import cuda_fp4 as cf
    if v == 0:
        return cf._ext()
    return cuda_build.load_extension("qerl_fp4_ablate", cf._CU, cf._HEADERS, cf._BINDING,
                                     [*cf._build_flags(), f"-D{define}={v}"], _STATE)


@contextlib.contextmanager
def using(mod):
    """``cuda_fp4._ext`` returns ``mod`` inside the block (the library's dispatch launches that module)."""
    from qerl.kernels import cuda_fp4 as cf
    saved = cf._ext
    cf._ext = lambda: mod
    try:
        yield
    finally:
        cf._ext = saved


def run(variants, shapes, ms, fmt: str, rep_ms: float) -> list[dict]:
    from benchmarks import cuda_gemm_bench as cgb
    from benchmarks import kernel_bench as kb
    from qerl.kernels import cuda_fp4 as cf
    mods = {v: module(v) for v in variants}
    order = variants + variants[::-1]
    rows = []
    for i, (n, k) in enumerate(shapes):
        wts = kb._Weights(fmt, n, k, seed=5000 + i)
        cws = wts.cuda()
        for m in ms:
            cfg = tuple(cf._gemm_config(cws[0], m, torch.device("cuda")))
            if cfg[1] > 0:
                print(f"[ablate] {fmt} {n}x{k} M={m}: the device's pick {cfg} is not a wgmma config; skipped")
                continue
            times: dict[int, list[float]] = {v: [] for v in variants}
            for v in order:
                with using(mods[v]):
                    times[v].append(cgb._time_gemm(cws, m, rep_ms, cfg) * 1e3)  # µs
            full = sum(times[0]) / len(times[0])
            for v in variants:
                us = sum(times[v]) / len(times[v])
                rows.append(dict(bench="wgmma_ablate", fmt=fmt, N=n, K=k, M=m, config=str(cfg), variant=v,
                                 leaves_out=describe(v), us=round(us, 2),
                                 us_passes=" / ".join(f"{t:.2f}" for t in times[v]), vs_full=round(us / full, 3),
                                 device=torch.cuda.get_device_name(0)))
                print(f"[ablate] {fmt} {n}x{k} M={m:4d} {cfg!s:18s} v{v:<2d} {describe(v):45s} {us:8.2f} us "
                      f"({us / full:.3f} of the full kernel)", flush=True)
        del wts, cws
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| N×K | M | config | variant | leaves out | µs (pass 1 / 2) | of the full kernel |",
           "|---|---:|---|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['N']}×{r['K']} | {r['M']} | {r['config']} | {r['variant']} | {r['leaves_out']} | "
                   f"{r['us']:.2f} ({r['us_passes']}) | {r['vs_full']:.3f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    from benchmarks import kernel_bench as kb
    from benchmarks import wgmma_profile as wp
    from qerl.kernels import cuda_fp4 as cf
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="0,1,3,4,7,8")
    ap.add_argument("--build-only", type=int, default=None, metavar="V", help="compile variant V's module and exit")
    ap.add_argument("--shapes", default="37888x3584,3584x18944")
    ap.add_argument("--m", default="64,128,256")
    ap.add_argument("--fmt", default="nvfp4", choices=list(cf.FORMATS))
    ap.add_argument("--rep", type=float, default=10.0, help="time spent replaying per measurement (ms)")
    ap.add_argument("--out", default="results/speed")
    a = ap.parse_args(argv)
    if a.build_only is not None:
        parse_variants(str(a.build_only))
    variants = parse_variants(a.variants)
    shapes = wp.parse_shapes(a.shapes)
    ms = [int(v) for v in a.m.split(",")]
    if any(m < 17 for m in ms):
        raise ValueError(f"--m {a.m}: the wgmma GEMM serves M > 16")
    if not (torch.cuda.is_available() and cf.wgmma_supported()):
        sys.exit("needs a CUDA device of compute capability 9.0 (the wgmma GEMM is sm_90a only)")
    if a.build_only is not None:
        module(a.build_only)
        print(f"[ablate] variant {a.build_only} ({describe(a.build_only)}) built")
        return
    rows = run(variants, shapes, ms, a.fmt, a.rep)
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"wgmma_ablate_{kb.gpu_tag()}")
    kb.write_csv(base + ".csv", rows)
    with open(base + ".md", "w") as f:
        f.write(f"## wgmma GEMM main loop, one part left out at a time ({torch.cuda.get_device_name(0)})\n\n"
                f"Command: `python -m benchmarks.wgmma_ablate {' '.join(argv if argv is not None else sys.argv[1:])}`"
                f". Ablated variants compute wrong results; only their time means something.\n\n"
                + markdown(rows))
    print(f"wrote {base}.csv / .md")


if __name__ == "__main__":
    main()
