"""The first table a user looks at: bits per weight and round-to-nearest error of every weight format.

    python -m qerl.quant.report [--out results/quant/report.md] [--rows 512] [--full]

For each format (and MXFP4 under each shared-exponent rule) it reports bits per weight at the Qwen2.5-7B
q_proj shape and the relative Frobenius error ||W - W_hat|| / ||W|| of quantize -> dequantize on
(i) Gaussian weights and (ii) synthetic "real-layer-like" weights shaped like Qwen2.5-7B's q_proj
(3584 x 3584) and down_proj (3584 x 18944): Student-t (df 5) entries, log-normal per-row and per-input-channel
scales, and a few input channels with 20x outliers. All weights are bfloat16, as in a checkpoint.
Blocks run along K, so rows are independent: by default ``--rows`` rows of each matrix are drawn (the
error estimate does not depend on N); ``--full`` uses every row.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import torch

from qerl.quant import FORMATS, MXFP4Format
from qerl.quant.mxfp4 import SCALE_RULES

QWEN7B_SHAPES = {"q_proj": (3584, 3584), "down_proj": (3584, 18944)}
DEFAULT_OUT = "results/quant/report.md"


def gaussian_weights(n: int, k: int, seed: int, std: float = 0.02) -> torch.Tensor:
    """N(0, std^2) weights (n, k) in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * std).to(torch.bfloat16)


def layer_like_weights(n: int, k: int, seed: int, std: float = 0.02, df: float = 5.0,
                       n_outlier_channels: int = 8, outlier_gain: float = 20.0) -> torch.Tensor:
    """Heavy-tailed weights (n, k) in bfloat16: Student-t entries x per-row x per-input-channel log-normal scales,
    with ``n_outlier_channels`` input channels multiplied by ``outlier_gain`` (the channels that carry massive
    activations in real LLM layers). The column structure depends only on (k, seed), so fewer rows are a
    subsample of the same matrix family."""
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's RNG state
        torch.manual_seed(seed)
        col = torch.exp(0.3 * torch.randn(k))  # (K,)
        col[torch.randperm(k)[:n_outlier_channels]] *= outlier_gain
        row = torch.exp(0.3 * torch.randn(n))  # (N,)
        t = torch.distributions.StudentT(df).sample((n, k)) / math.sqrt(df / (df - 2))  # unit variance
    return (t * row[:, None] * col[None, :] * std).to(torch.bfloat16)


def relative_error(fmt, w: torch.Tensor) -> float:
    """||W - dequantize(quantize(W))||_F / ||W||_F, accumulated in float64."""
    w_hat = fmt.dequantize(fmt.quantize(w), torch.float32).double()
    w64 = w.double()
    return ((w64 - w_hat).norm() / w64.norm()).item()


def _handlers() -> list[tuple[str, str, object]]:
    """(format, MXFP4 rule, handler) for every registered format; MXFP4 once per shared-exponent rule."""
    rows = []
    for name, f in FORMATS.items():
        if not isinstance(f, MXFP4Format):
            rows.append((name, "-", f))
            continue
        for rule in SCALE_RULES:
            label = f"{rule} (default)" if rule == f.scale_rule else rule
            rows.append((name, label, f if rule == f.scale_rule else MXFP4Format(scale_rule=rule)))
    return rows


def build_report(rows: int | None = 512, shapes: dict[str, tuple[int, int]] | None = None, seed: int = 0) -> str:
    """The markdown report (title, notes, table). ``rows=None`` uses every row of each shape."""
    shapes = dict(QWEN7B_SHAPES if shapes is None else shapes)
    t0 = time.perf_counter()
    q_n, q_k = shapes["q_proj"]
    mats = {}
    n = q_n if rows is None else min(rows, q_n)
    mats[f"Gaussian {q_n}x{q_k}"] = gaussian_weights(n, q_k, seed)
    for i, (name, (full_n, k)) in enumerate(shapes.items()):
        n = full_n if rows is None else min(rows, full_n)
        mats[f"{name}-like {full_n}x{k}"] = layer_like_weights(n, k, seed + 1 + i)
    used = {name: w.shape[0] for name, w in mats.items()}

    header = ["format", "MXFP4 scale rule", f"bits/weight ({q_n}x{q_k})"] + [f"rel. error: {m}" for m in mats]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for fmt_name, rule, handler in _handlers():
        errs = [f"{relative_error(handler, w):.4f}" for w in mats.values()]
        bits = f"{handler.bits_per_weight(q_n, q_k):.3f}"
        lines.append("| " + " | ".join([fmt_name, rule, bits, *errs]) + " |")
    elapsed = time.perf_counter() - t0

    sampled = ", ".join(f"{name}: {r} rows" for name, r in used.items())
    notes = [
        "# Weight formats: storage and round-to-nearest error",
        "",
        "Relative Frobenius error ||W - W_hat|| / ||W|| of quantize -> dequantize (round to nearest, no calibration),",
        "bfloat16 weights. Gaussian: N(0, 0.02^2). *-like: Student-t (df 5) entries with log-normal per-row and",
        "per-input-channel scales (sigma 0.3) and 8 input channels with 20x outliers, shaped like Qwen2.5-7B's layers.",
        f"Rows sampled ({'all rows' if rows is None else f'--rows {rows}'}; blocks run along K, so the error does not depend",
        f"on N): {sampled}. Seed {seed}.",
        "bits/weight counts every stored tensor (elements, block scales, NVFP4's per-tensor scale, NF4's nested",
        "absmax and offset, INT4's bfloat16 scales and shape; NF4/MXFP4 code tables excluded). MXFP4 rules: ct = compressed-tensors 0.20 (default,",
        "significand >= 1.75 rounds the block max up), floor = OCP MX spec, ceil = 2^ceil(log2 amax)/4,",
        "rceil = smallest power of two with amax/scale <= 6. bf16 is the checkpoint itself (error 0 by construction).",
        "",
        *lines,
        "",
        f"torch {torch.__version__}, {platform.machine()} CPU, {elapsed:.1f} s.",
        "",
    ]
    return "\n".join(notes)


def main(argv: list[str] | None = None) -> str:
    """CLI entry point: print the report and write it to ``--out``."""
    p = argparse.ArgumentParser(prog="python -m qerl.quant.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"markdown file to write (default {DEFAULT_OUT})")
    p.add_argument("--rows", type=int, default=512, help="rows sampled per matrix (default 512)")
    p.add_argument("--full", action="store_true", help="use every row (slower)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    report = build_report(rows=None if args.full else args.rows, seed=args.seed)
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    return report


if __name__ == "__main__":
    main()
