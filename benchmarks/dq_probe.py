"""Where the in-loop dequantizing GEMM's outputs land: a diagnostic for a failing GPU test of ``qerl.kernels.cuda_dq``.

    python -m benchmarks.dq_probe [--fmt mxfp4] [--out FILE]

With one-hot activations (rows of the identity), output row i of the backward g @ Ŵ is Ŵ's row i and of the forward
x @ Ŵᵀ is Ŵᵀ's row i, so every wrong output's value can be looked up in Ŵ: the (row, column) it came from tells which
index map is off (the tile's swizzle, the matrix descriptor's strides, the order of the weight blocks in a stage).
Per product, shape and launch config: the count of wrong outputs and, for the first few, where their values are found.
Exact reference values come from :func:`exact_weight` (the format's pure-torch dequantization; no other CUDA
extension is built), the oracle of tests/test_cuda_dq.py too.
"""

from __future__ import annotations

import argparse
import sys

import torch

#: (op, N, K): one 256-column tile each way, a 64-row contraction, a 128-column tile, two output tiles
CASES = (("fwd", 256, 256), ("bwd", 256, 256), ("bwd", 64, 256), ("bwd", 128, 128), ("fwd", 512, 128),
         ("bwd", 128, 512))


def exact_weight(fmt: str, q, rounded: bool = True) -> torch.Tensor:
    """Ŵ (N, K) as float32 holding its bf16 values, from the pure-torch reference (the format's ``dequantize``: the
    float32 products e2m1 x scale, rounded once to bf16), no kernel involved: the values every CUDA path must
    produce bit for bit (``cuda_fp4.relayout_is_exact`` holds for random weights; tests/test_cuda_fp4.py checks the
    CUDA dequantization against the compressed-tensors one). NVFP4 without ``weight_global_scale``: its scales alone
    (a global scale of 1). ``rounded=False``: the float32 products themselves, not rounded to bf16 -- the weight
    ``QERL_DQ_DECODE=mma``'s build multiplies by (e2m1 x scale exact, the global scale applied to the accumulators)."""
    from qerl.quant import FORMATS
    if fmt == "nvfp4" and q.get("weight_global_scale") is None:
        q = {**q, "weight_global_scale": torch.ones((), device=q["weight_packed"].device)}
    return FORMATS[fmt].dequantize(q, torch.bfloat16 if rounded else torch.float32).float()


def locate(y: torch.Tensor, mat: torch.Tensor, tol: float = 1e-3, first: int = 6) -> tuple[int, list[str]]:
    """(wrong outputs, lines): y against the rows of ``mat`` it should equal (y (R, C) = mat[:R]). The lines give the
    wrong outputs' pattern (counts by 64-column block, by column within a block's 16-byte units, by row mod 16: a
    swizzle or stride error shows as a regular pattern) and, for the first ``first`` of them, where in ``mat`` their
    value appears (up to four places: FP4 values repeat, so a list, not a proof)."""
    ref = mat[: y.shape[0]]
    bad = (y - ref).abs() > tol * ref.abs().max()
    lines = []
    if bad.any():
        i, j = bad.nonzero().unbind(1)
        by = lambda v, n: torch.bincount(v, minlength=n).tolist()  # noqa: E731
        lines.append(f"  by 64-column block {by(j // 64, (y.shape[1] + 63) // 64)}; by unit (col % 64 // 8) "
                     f"{by(j % 64 // 8, 8)}; by row % 16 {by(i % 16, 16)}")
    for i, j in bad.nonzero()[:first].tolist():
        v = y[i, j]
        hits = (mat == v).nonzero()[:4].tolist()
        lines.append(f"  out {(i, j)} = {float(v):.6g}, expected {float(ref[i, j]):.6g}; that value is at {hits}")
    return int(bad.sum()), lines


def probe(fmt: str) -> list[str]:
    from qerl.kernels import cuda_dq as dq
    from qerl.kernels import cuda_fp4 as cf
    from qerl.quant import FORMATS
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for op, n, k in CASES:
        q = FORMATS[fmt].quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        w = cf.prepare(fmt, q["weight_packed"], q["weight_scale"], q.get("weight_global_scale"))
        whole = exact_weight(fmt, q)
        mat = whole if op == "bwd" else whole.t().contiguous()
        r, c = mat.shape
        a = torch.eye(r, device="cuda")[: min(r, 128)].bfloat16()
        for cfg in dq.configs(a.shape[0], r, c):
            y = (dq.gemm_t if op == "bwd" else dq.gemm)(a, w, None, cfg).float()
            nbad, lines = locate(y, mat)
            out.append(f"{op} N={n} K={k} config {cfg}: {nbad} of {y.numel()} outputs wrong")
            out.extend(lines)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="mxfp4", choices=("nvfp4", "mxfp4"))
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from qerl.kernels import cuda_dq as dq
    if not dq.available():
        sys.exit(f"[dq_probe] needs an sm_90 GPU and the dq extension ({dq._STATE.get('error')})")
    text = "\n".join(probe(a.fmt)) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
