"""Ŵ in BF16 from the CUDA kernels' re-laid-out weight (``dequantize_relaid``: the CUDA kernel or Triton, the same
bits), whole or in slices of rows (the forward) or columns (the backward) each followed by its cuBLAS product
(``_relaid_dequant_mm``), and the reference off the GPU: the dequantize + cuBLAS path of a base held in the kernels'
layout (``quant.layout=kernel``). Re-exported by ``qerl.kernels``, whose dispatcher calls them."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from qerl.kernels import relaid
from qerl.kernels.base import _k, _triton_ok, _workspace, cuda_gemv_enabled, triton


def cuda_dequant_enabled(dev: torch.device) -> bool:
    """True when ``dequantize_relaid`` writes BF16 weights with the CUDA kernel (``cuda_fp4.dequantize``) on
    ``dev``: the CUDA FP4 extension serves it (``cuda_gemv_enabled``) and ``QERL_CUDA_DEQUANT`` is not "0"."""
    return os.environ.get("QERL_CUDA_DEQUANT", "1") != "0" and cuda_gemv_enabled(dev)


def dequantize_relaid(w, out: torch.Tensor | None = None, bn: int = 32, bk: int = 128,
                      backend: str = "auto") -> torch.Tensor | None:
    """Ŵ (N, K) from the CUDA kernels' re-laid-out copy alone (``cuda_fp4.prepare``'s ``CudaFP4Weight``): the
    same values as ``dequantize_into`` of the compressed-tensors tensors wherever ``cuda_fp4.relayout_is_exact``
    holds (float32 products, then ``out``'s dtype). ``out``: a contiguous (N, K) float tensor (bfloat16 (N, K)
    when None); None off the Triton path (no Triton, or CPU tensors without ``TRITON_INTERPRET=1``). So a layer
    whose decode kernels read the re-laid-out copy can rebuild the dense weight for cuBLAS (large M, the backward)
    without keeping the compressed-tensors copy as well. ``backend``: "auto" (the CUDA kernel ``cuda_fp4.dequantize``
    for a bfloat16 ``out`` where ``cuda_dequant_enabled``, else Triton), "triton" (``_relaid_dequant_kernel``, any
    float dtype; ``bn``/``bk`` its tile) or "cuda". The two give the same bits; on an H100 the Triton kernel wrote a
    7B layer at ~0.7 TB/s (``python -m qerl.bench update``)."""
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"dequantize_relaid: backend={backend!r}; valid: 'auto', 'triton', 'cuda'")
    if not _triton_ok(w.qweight):
        return None
    if out is None:
        out = torch.empty((w.n, w.k), device=w.qweight.device, dtype=torch.bfloat16)
    if out.shape != (w.n, w.k) or not out.is_contiguous():
        raise ValueError(f"dequantize_relaid: out must be contiguous {(w.n, w.k)}, got {tuple(out.shape)}")
    from qerl.kernels import cuda_fp4
    if backend == "cuda" or (backend == "auto" and out.dtype == torch.bfloat16 and out.is_cuda
                             and out.data_ptr() % 16 == 0 and cuda_dequant_enabled(out.device)):
        return cuda_fp4.dequantize(w, out)
    if not (w.qweight.is_contiguous() and w.scales.is_contiguous()):  # a column slice (_relaid_cols): the Triton
        w = cuda_fp4.weight_from(w.fmt, w.qweight.contiguous(), w.scales.contiguous(), w.global_scale, w.bexp)
    gs = w.global_scale if w.global_scale is not None else w.qweight  # dummy pointer when HAS_G is off
    grid = (triton.cdiv(w.n, bn), triton.cdiv(w.k, bk))
    _k._relaid_dequant_kernel[grid](w.qweight, w.scales, gs, out, w.n, w.k, FMT=int(w.fmt == "mxfp4"),
                                    G=cuda_fp4._GROUP[w.fmt],
                                    HAS_G=w.global_scale is not None, BN=bn, BK=bk, num_warps=4)
    return out


def _relaid_reference(fmt, q: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Ŵ of a re-laid-out ``q`` off the Triton path (CPU): converted back, then the format's reference."""
    return fmt.dequantize(relaid.to_compressed(fmt, q), dtype)


def _relaid_dense(fmt, q: Mapping[str, torch.Tensor], out: torch.Tensor | None, dtype=torch.bfloat16) -> torch.Tensor:
    """Ŵ of a re-laid-out ``q`` (into ``out``; else, on the GPU, the per-device workspace of ``dtype``)."""
    w = relaid.weight(fmt, q)
    if _triton_ok(w.qweight):
        if out is None:
            out = _workspace(w.qweight.device, dtype, w.n * w.k).view(w.n, w.k)
        return dequantize_relaid(w, out)
    ref = _relaid_reference(fmt, q, dtype if out is None else out.dtype)
    return ref if out is None else out.copy_(ref)


def _relaid_rows(w, r0: int, r1: int):
    """Rows ``r0:r1`` (multiples of 16) of a re-laid-out weight, as views of its tensors."""
    from qerl.kernels import cuda_fp4
    return cuda_fp4.weight_from(w.fmt, w.qweight[r0 // 16:r1 // 16], w.scales[r0 // 16:r1 // 16], w.global_scale,
                                w.bexp)


def _relaid_cols(w, c0: int, c1: int):
    """Columns ``c0:c1`` (multiples of 64) of a re-laid-out weight, as strided views of its tensors (its strips
    keep the whole weight's stride; ``cuda_fp4.dequantize`` reads them where they lie)."""
    from qerl.kernels import cuda_fp4
    return cuda_fp4.weight_from(w.fmt, w.qweight[:, c0 // 64:c1 // 64], w.scales[:, c0 // 64:c1 // 64],
                                w.global_scale, w.bexp)


def _relaid_dequant_mm(a: torch.Tensor, w, out: torch.Tensor, size: int, t: bool = False) -> None:
    """out = a @ Ŵᵀ (``t`` False: a (M, K), out (M, N)) or a @ Ŵ (``t``: the backward, a (M, N), out (M, K)) from the
    kernels' layout by ``dequantize_relaid`` + cuBLAS, in slices of ``size`` rows of Ŵ (forward) or columns (the
    backward), rounded down to the layout's 16-row strips / 64-column chunks; 0: the whole weight at once. Each
    slice's product is one cuBLAS call into its columns of ``out`` (every output element one whole product), and
    the slices share one slice-sized buffer. Where slices pay is measured per device (``configs.dequant_slice``)."""
    unit, total, other = (64, w.k, w.n) if t else (16, w.n, w.k)
    size -= size % unit
    if not size or size >= total:
        size = total
    buf = _workspace(a.device, a.dtype, size * other)
    for s0 in range(0, total, size):
        c = min(size, total - s0)
        if t:
            part = buf[:c * other].view(other, c)
            dequantize_relaid(_relaid_cols(w, s0, s0 + c), part)
            torch.mm(a, part, out=out[:, s0:s0 + c])
        else:
            part = buf[:c * other].view(c, other)
            dequantize_relaid(_relaid_rows(w, s0, s0 + c), part)
            torch.mm(a, part.t(), out=out[:, s0:s0 + c])


def sliced_rows(chunk: int, m: int, n: int) -> int:
    """The weight-row slice of dequantize + cuBLAS for M tokens and N rows, 0 = the whole weight at once. Slicing
    keeps each dequantized slice in L2 (saves the full BF16 weight's write + read, 2 N K bf16) but re-reads x for
    every slice after the first ((slices - 1) M K bf16): worth it only while (slices - 1) M < 2 N. The tuned tables
    stop at M = 2048; applied to a GRPO micro-batch (M ~ 16 K rows) their slices re-read x, up to 644 MB per call."""
    if not chunk or chunk >= n:
        return 0
    return chunk if (-(-n // chunk) - 1) * m < 2 * n else 0
