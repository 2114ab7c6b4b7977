"""The tokens' copy in the wgmma GEMM's K permutation, written by the launch that writes them (the fused RMSNorm /
SwiGLU launches, the CUDA decode attention) and tagged on the tensor, so the GEMM of the linear that takes them reads
it instead of permuting them itself. Re-exported by ``qerl.kernels``."""

from __future__ import annotations

import torch


def tag_permuted(x: torch.Tensor, xp: torch.Tensor) -> None:
    """Record that ``xp`` holds x in the wgmma GEMM's K permutation (``cuda_fp4.permute_x_reference``), written by
    the launch that writes x (``qerl.kernels.fused.add_rms_norm`` / ``silu_mul`` with ``permuted=True``): the GEMM
    of the linear that takes x then reads xp instead of permuting x itself (:func:`permuted_twin`). The tag lives on
    this tensor object only (a view of x carries none); an in-place change of x after tagging voids it."""
    x._qerl_permuted = (xp, _version(x))


def permuted_buffer(x: torch.Tensor, permuted: bool) -> torch.Tensor | None:
    """The buffer for x's copy in the wgmma GEMM's K permutation, tagged on x (:func:`tag_permuted`; None: not
    wanted, or K not a multiple of 64). Written by the launch that writes x, which runs right after this (the fused
    RMSNorm / SwiGLU launches, the CUDA decode attention)."""
    if not permuted or x.shape[-1] % 64:
        return None
    xp = torch.empty_like(x)
    tag_permuted(x, xp)
    return xp


def permuted_twin(x: torch.Tensor) -> torch.Tensor | None:
    """x's copy in the wgmma GEMM's K permutation recorded by :func:`tag_permuted`, or None (none recorded, or x was
    changed in place since)."""
    tag = getattr(x, "_qerl_permuted", None)
    if tag is None or tag[1] != _version(x) or tag[0].shape != x.shape:
        return None
    return tag[0]


def _version(x: torch.Tensor) -> int | None:
    try:
        return x._version
    except RuntimeError:  # inference-mode tensors keep no version counter (and cannot change outside it)
        return None
