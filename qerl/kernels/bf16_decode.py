"""The BF16 baseline's decode products (``BF16Kernels``): the FP4 GEMV's CUDA kernel over the stored weight at
M <= 16, base + LoRA (+ SwiGLU) in one launch, under programmatic dependent launch by ``QERL_BF16_GEMV``'s mode and
M. Registered for the BF16 format by ``qerl.kernels``."""

from __future__ import annotations

import os

import torch

from qerl.kernels.base import _cuda_gemv_ok, pdl_enabled

BF16_GEMV_MODES = ("auto", "0", "1", "pdl")
# auto: the BF16 GEMV under PDL up to this M, without above (H100, 7B, 256 + 512, same process, two pairs each, with
# / without PDL: batch 1 170 / 165, batch 2 337 / 326, batch 4 659 / 640 tokens/s (raw/h100_s34_bf16/call3), batch 8
# 1184 / 1252 (call2))
BF16_PDL_MAX_M = 4


def _bf16_gemv_mode() -> str:
    v = os.environ.get("QERL_BF16_GEMV", "auto")
    if v not in BF16_GEMV_MODES:
        raise ValueError(f"QERL_BF16_GEMV={v!r}; valid: {', '.join(BF16_GEMV_MODES)}")
    return v


def bf16_gemv_enabled() -> bool:
    """``QERL_BF16_GEMV`` (default ``auto``): BF16 weights at decode size (M <= 16, CUDA) run the CUDA GEMV over the
    stored weight, base + LoRA (+ SwiGLU) in one launch as for FP4 — under programmatic dependent launch (where the
    decode chain has it) up to :data:`BF16_PDL_MAX_M` rows, without it above; ``1``: never under PDL; ``pdl``: always
    (a 7B layer's seven GEMVs back to back in one graph measured 180.5 µs without PDL and 229-247 µs with it on the
    H100, ``raw/h100_s34_bf16``; in the decode step PDL paid at batches 1-4, +3%, and cost 6% at batch 8); ``0``:
    cuBLAS (``F.linear``), the LoRA by the caller. ``QERL_CUDA_GEMV=0`` turns it off too."""
    return _bf16_gemv_mode() != "0"


def _bf16_pdl(x2: torch.Tensor) -> bool:
    mode = _bf16_gemv_mode()
    return (mode == "pdl" or (mode == "auto" and x2.shape[0] <= BF16_PDL_MAX_M)) and pdl_enabled(x2)


def _dense_gemv_weight(x2: torch.Tensor, w: torch.Tensor):
    """``cuda_fp4.dense_weight(w)`` when the CUDA GEMV takes x2 (M, K) @ wᵀ, else None."""
    m, k = x2.shape
    if (w.dim() != 2 or not w.is_cuda or w.shape[1] != k or not 1 <= m or not bf16_gemv_enabled()
            or not _cuda_gemv_ok(x2, m, w.shape[0], k)):
        return None
    from qerl.kernels import cuda_fp4
    try:  # dtype, row layout and alignment: dense_weight's checks
        return cuda_fp4.dense_weight(w)
    except ValueError:
        return None


def _bf16_linear_lora(x: torch.Tensor, w: torch.Tensor, lora=None, act=None) -> torch.Tensor | None:
    """x (..., K) @ wᵀ (+ ``lora``'s term) (+ ``act``'s epilogue) by the CUDA GEMV in one launch at decode size;
    None where it does not run (CPU, M > 16, a shape or layout it does not take, ``QERL_CUDA_LORA=0`` with a LoRA)."""
    from qerl.kernels import cuda_fp4
    if act is not None and act not in cuda_fp4.ACTS:
        raise ValueError(f"act={act!r}: valid epilogues are None, {', '.join(map(repr, cuda_fp4.ACTS))}")
    if not x.is_cuda or x.dtype != torch.bfloat16 or (lora is not None and os.environ.get("QERL_CUDA_LORA",
                                                                                        "1") == "0"):
        return None
    x2 = x.reshape(-1, x.shape[-1])
    dw = _dense_gemv_weight(x2, w)
    if dw is None or (act is not None and dw.n % 32):
        return None
    if lora is not None and (lora.bn.shape[0] != dw.n or lora.a.dtype != torch.bfloat16 or lora.a.shape[1] != dw.k):
        return None
    y = cuda_fp4.gemv(x2, dw, lora=lora, pdl=_bf16_pdl(x2), act=act)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class BF16Kernels:
    """The BF16 baseline's decode products: the FP4 GEMV's kernel over the stored weight (``cuda_gemv``, M <= 16;
    measured against cuBLAS in ``benchmarks.cuda_bench``); None elsewhere, so ``F.linear`` (cuBLAS) runs large M,
    the backward and the CPU."""

    def backend(self, fmt, x, q=None):
        if not (x.is_cuda and x.dtype == torch.bfloat16 and bf16_gemv_enabled()):
            return None
        x2 = x.reshape(-1, x.shape[-1])
        if q is None:
            return "cuda_gemv" if _cuda_gemv_ok(x2, x2.shape[0], 16, 64) and x2.shape[1] % 64 == 0 else None
        return "cuda_gemv" if _dense_gemv_weight(x2, q["weight"]) is not None else None

    def linear(self, fmt, x, q):
        return _bf16_linear_lora(x, q["weight"])

    def linear_t(self, fmt, g, q):
        return None

    def linear_lora(self, fmt, x, q, lora, act=None):
        return _bf16_linear_lora(x, q["weight"], lora, act)

    def dequantize(self, fmt, q, out):
        return None
