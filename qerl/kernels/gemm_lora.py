"""The rollout's LoRA term above decode size, in the epilogue of the CUDA GEMM that runs the base product (the
mma.sync kernel at 17-64 tokens, the wgmma kernel above): when that path runs (``_gemm_lora_route``, by the
switches ``QERL_GEMM_LORA`` / ``QERL_WGMMA_LORA`` of ``qerl.kernels.switches``) and the launch of t = x·Aᵀ followed
by the GEMM (``_gemm_lora``). Called by ``qerl.kernels``' FP4 dispatcher."""

from __future__ import annotations

import torch

from qerl.kernels.base import cuda_gemm_choice, pdl_enabled
from qerl.kernels.switches import mma_lora_mode, wgmma_lora_mode


def _lora_fits(lora, w) -> bool:
    """The LoRA operand (bf16 A (R, K), Bn (N, RP)) matches the CUDA kernels' weight ``w``."""
    return lora.bn.shape[0] == w.n and lora.a.dtype == torch.bfloat16 and lora.a.shape[1] == w.k


def _gemm_lora_route(fmt, m: int, w, lora, dev: torch.device) -> tuple[tuple, bool, str] | None:
    """(config, wgmma?, mode) of the CUDA GEMM with the LoRA term in its epilogue for M tokens, where the dispatcher
    gives this (format, shape, M) to the CUDA GEMM, the ranks fit (``cuda_fp4.wgmma_lora_ok``) and the switch of its
    kernel is on (a wgmma configuration: :func:`wgmma_lora_mode`; an mma.sync one: :func:`mma_lora_mode`); None
    otherwise (the caller adds the LoRA)."""
    if not cuda_gemm_choice(fmt, w.n, w.k, m, dev):
        return None
    from qerl.kernels import cuda_fp4
    if not cuda_fp4.wgmma_lora_ok(lora):
        return None
    config = cuda_fp4._gemm_config(w, m, dev)
    wg = config[1] <= 0
    mode = wgmma_lora_mode() if wg else mma_lora_mode()
    return None if mode == "0" else (config, wg, mode)


def _gemm_lora(fmt, x2: torch.Tensor, w, lora, xp: torch.Tensor | None = None) -> torch.Tensor | None:
    """x2 @ Ŵᵀ + the LoRA term by the CUDA GEMM with the term in its epilogue (:func:`_gemm_lora_route`); None where
    that path does not run (the caller adds the LoRA). t = x·Aᵀ by ``qerl.kernels.fused.lora_a`` (cuBLAS above its M
    bound); in mode ``pdl`` that launch triggers the GEMM (under PDL) at once. The wgmma kernel reads x in its K
    permutation: ``xp`` when given (x's producer wrote it: :func:`permuted_twin`), else permuted here, before t's
    launch (which must be the GEMM's immediate predecessor under PDL)."""
    route = _gemm_lora_route(fmt, x2.shape[0], w, lora, x2.device)
    if route is None:
        return None
    from qerl.kernels import cuda_fp4
    from qerl.kernels.fused import lora_a
    config, wg, mode = route
    if not wg or (xp is not None and (xp.shape != x2.shape or not xp.is_contiguous())):
        xp = None
    # rows read in place: no copy between t's launch and the GEMM
    pdl = mode == "pdl" and pdl_enabled(x2) and (not wg or xp is not None or cuda_fp4.rows_aligned(x2))
    if xp is None and pdl and wg:
        xp = cuda_fp4.permute_tokens(x2)
    return cuda_fp4.gemm(x2, w, config=config, lora=lora, t=lora_a(x2, lora.a, trigger=pdl), pdl=pdl, xp=xp)
