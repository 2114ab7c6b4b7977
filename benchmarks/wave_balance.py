"""Does a GEMM's time follow its CTAs per SM? Issue 10 (session 68): Nsight Compute showed the mma.sync GEMM's 7B gate
product at M = 32 (config (4, 2, 2, 2): 296 CTAs, all resident at once, 4 fit an SM) with its SMs active only 71% of
the time, and q (112 CTAs for 132 SMs) 61%. If CTAs are spread 2-3 per SM and an SM's throughput does not grow with a
third CTA, the busiest SMs set the time: the product would then cost about what ceil(CTAs / SMs) CTAs per SM cost,
not what its bytes do.

    python -m benchmarks.wave_balance [--fmt nvfp4] [--k 3584] [--m 32] [--config 4,2,2,2] [--ctas 132,264,296,...]
                                      [--kz 1,2,4]
    python -m benchmarks.wave_balance --products [--models 7b] [--m 17,32,48,64] [--kz 1,2,3,4]

For each CTA count the weight gets rows = CTAs x the config's rows per CTA (16 x sw x r), so the grid has exactly that
many row blocks (one token tile at M <= 8 nt), and the product is timed as the layer benches time it (CUDA-graph
replays over rotating weight copies). Printed per count: µs, µs per row block, and that against the first count's
(1.00: the time follows the work; above 1: the extra row blocks cost more than their share). ``--kz`` (a
``QERL_GEMM_KZ=1`` build) also times each count with K split across that many CTAs a row block.

``--products``: the decoder layer's linears (and the decode step's fused q|k|v and gate|up) at each M with the
device's pick for them, where it is an mma.sync config, at each kz: the question the split of K across CTAs answers
(do the SMs' idle 29-39% at M = 32, `results/speed/raw/h100_s68_ncu32`, turn into speed?). Writes
``wave_balance_<gpu>.csv`` under ``--out`` in this mode; ``--eager`` launches each once instead (for Nsight Compute:
``scripts/gpu_bench.sh kzab``). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks import cuda_gemm_bench as cgb
from benchmarks import kernel_bench as bench
from qerl.kernels import cuda_fp4 as cf


def parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{what} {text!r}: comma-separated positive integers") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"--{what} {text!r}: comma-separated positive integers")
    return vals


def rows_per_cta(config: tuple[int, int, int, int]) -> int:
    """Weight rows one CTA of an mma.sync config (nt, sw, r, ks) covers: 16 rows a strip, sw strips a warp, r warps a
    group (the ks groups of a CTA split K, not rows)."""
    nt, sw, r, ks = config
    if sw < 1:
        raise ValueError(f"config {config}: an mma.sync config (sw >= 1) is needed; wgmma configs split rows otherwise")
    return 16 * sw * r


def fitting(kzs: list[int], cfg: tuple[int, int, int, int], k: int) -> list[int]:
    """The kz of ``kzs`` that config ``cfg`` can split a contraction of ``k`` into (kz x its ks groups <= the chunks)."""
    return [kz for kz in kzs if kz * cfg[3] <= k // 64]


def products(fmt: str, models: list[str], ms: list[int], kzs: list[int], rep: float, out: str,
             eager: bool = False) -> list[dict]:
    """Each product of ``models``' layers (and the fused q|k|v, gate|up) at each M where the device's pick is an
    mma.sync config, timed at each kz that fits; one CSV row per (shape, M, kz). ``eager``: instead of timing, one
    plain launch each (after a warm-up call), named on stdout in launch order, for a profiler to catch."""
    import csv
    import os

    rows = []
    for mdl in models:
        for i, (n, k) in enumerate(cgb.product_shapes(mdl)):
            wts = bench._Weights(fmt, n, k, seed=6900 + i)
            cws = wts.cuda()
            for m in ms:
                cfg = tuple(cf._gemm_config(cws[0], m, torch.device("cuda")))
                if cfg[1] <= 0:
                    print(f"[kz] {mdl} {fmt} {n}x{k} M={m}: the pick {cfg} is a wgmma config; skipped", flush=True)
                    continue
                base = None
                x = torch.randn(m, k, device="cuda").bfloat16() if eager else None
                for kz in fitting(kzs, cfg, k):
                    if eager:
                        cf.gemm(x, cws[0], config=cfg, kz=kz)  # warm-up (the build, the workspace)
                        torch.cuda.synchronize()
                        print(f"[kz-eager] {mdl} {fmt} {n}x{k} M={m} {cfg} kz {kz}", flush=True)
                        cf.gemm(x, cws[0], config=cfg, kz=kz)
                        torch.cuda.synchronize()
                        continue
                    us = cgb._time_gemm(cws, m, rep, cfg, kz=kz) * 1e3
                    base = base or us
                    rows.append(dict(model=mdl, fmt=fmt, N=n, K=k, M=m, config=str(cfg), kz=kz, us=round(us, 3),
                                     vs_kz1=round(base / us, 4)))
                    print(f"[kz] {mdl} {fmt} {n}x{k} M={m} {cfg} kz {kz}: {us:8.2f} us ({base / us:5.3f}x the "
                          f"first kz)", flush=True)
            del wts, cws
            torch.cuda.empty_cache()
    if rows:
        os.makedirs(out, exist_ok=True)
        gpu = torch.cuda.get_device_name(0).split()[1].lower()
        with open(os.path.join(out, f"wave_balance_{gpu}.csv"), "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--m", default="32", help="tokens (with --products: a comma-separated list)")
    ap.add_argument("--config", default="4,2,2,2")
    ap.add_argument("--ctas", default="132,264,296,330,396")
    ap.add_argument("--rep", type=float, default=10.0, help="ms of graph replays per measurement")
    ap.add_argument("--kz", default="1", help="splits of K across CTAs to time (kz > 1: a QERL_GEMM_KZ=1 build)")
    ap.add_argument("--products", action="store_true", help="the layer's products at their picks (see above)")
    ap.add_argument("--models", default="7b")
    ap.add_argument("--eager", action="store_true",
                    help="with --products: one launch each instead of timing (for Nsight Compute)")
    ap.add_argument("--out", default="results/speed")
    a = ap.parse_args(argv)
    kzs = parse_ints(a.kz, "kz")
    if max(kzs) > 1 and not cf.gemm_kz():
        raise ValueError(f"--kz {a.kz!r}: kz > 1 needs a QERL_GEMM_KZ=1 build (set QERL_GEMM_KZ=1)")
    if a.eager and not a.products:
        raise ValueError("--eager: only with --products (the row-block sweep always times)")
    if a.products:
        ms = parse_ints(a.m, "m")
        models = [v for v in a.models.split(",") if v]
        bad = [v for v in models if v not in bench.MODELS]
        if bad:
            raise ValueError(f"--models {bad}: valid {sorted(bench.MODELS)}")
        if not torch.cuda.is_available():
            raise SystemExit("wave_balance needs a CUDA GPU")
        products(a.fmt, models, ms, kzs, a.rep, a.out, eager=a.eager)
        return
    a.m = parse_ints(a.m, "m")[0]
    config = tuple(parse_ints(a.config, "config"))
    if len(config) != 4:
        raise ValueError(f"--config {a.config!r}: four integers nt,sw,r,ks")
    rows = rows_per_cta(config)
    counts = parse_ints(a.ctas, "ctas")
    if a.m > 8 * config[0]:
        raise ValueError(f"--m {a.m}: more than one token tile of config {config} ({8 * config[0]} tokens)")
    if not torch.cuda.is_available():
        raise SystemExit("wave_balance needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = None
    for n_ctas in counts:
        n = n_ctas * rows
        wts = bench._Weights(a.fmt, n, a.k, seed=6800 + n_ctas)
        cws = wts.cuda()
        cfg = cf.check_gemm_config(config, n // 16, a.k // 64)
        for kz in fitting(kzs, cfg, a.k):
            us = cgb._time_gemm(cws, a.m, a.rep, cfg, kz=kz) * 1e3
            per = us / n_ctas
            base = base or per
            print(f"[balance] {a.fmt} M={a.m} K={a.k} config {cfg} kz {kz} row blocks {n_ctas:5d} ({n_ctas / sms:4.2f}"
                  f" per SM, max {math.ceil(n_ctas / sms)}) rows {n:6d}: {us:8.2f} us, {per:6.3f} us a row block, "
                  f"{per / base:5.2f}x the first's", flush=True)
        del wts, cws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
