"""Does a GEMM's time follow its CTAs per SM? Issue 10 (session 68): Nsight Compute showed the mma.sync GEMM's 7B gate
product at M = 32 (config (4, 2, 2, 2): 296 CTAs, all resident at once, 4 fit an SM) with its SMs active only 71% of
the time, and q (112 CTAs for 132 SMs) 61%. If CTAs are spread 2-3 per SM and an SM's throughput does not grow with a
third CTA, the busiest SMs set the time: the product would then cost about what ceil(CTAs / SMs) CTAs per SM cost,
not what its bytes do.

    python -m benchmarks.wave_balance [--fmt nvfp4] [--k 3584] [--m 32] [--config 4,2,2,2] [--ctas 132,264,296,...]

For each CTA count the weight gets rows = CTAs x the config's rows per CTA (16 x sw x r), so the grid has exactly that
many CTAs (one token tile at M <= 8 nt), and the product is timed as the layer benches time it (CUDA-graph replays over
rotating weight copies). Printed per count: µs, µs per CTA-row-block, and the time against the smallest count scaled
by the work (1.00: the time follows the work; above 1: the extra CTAs cost more than their share). Needs a CUDA GPU.
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--config", default="4,2,2,2")
    ap.add_argument("--ctas", default="132,264,296,330,396")
    ap.add_argument("--rep", type=float, default=10.0, help="ms of graph replays per measurement")
    a = ap.parse_args(argv)
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
        us = cgb._time_gemm(cws, a.m, a.rep, cfg) * 1e3
        per = us / n_ctas
        base = base or per
        print(f"[balance] {a.fmt} M={a.m} K={a.k} config {cfg} CTAs {n_ctas:5d} ({n_ctas / sms:4.2f} per SM, "
              f"max {math.ceil(n_ctas / sms)}) rows {n:6d}: {us:8.2f} us, {per:6.3f} us a CTA, "
              f"{per / base:5.2f}x the first count's", flush=True)
        del wts, cws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
