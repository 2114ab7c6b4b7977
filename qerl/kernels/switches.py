"""The environment switches of the CUDA GEMMs' LoRA epilogues (``QERL_WGMMA_LORA``, ``QERL_GEMM_LORA``) and the
one check of a switch's value against its choices (``_gemm_lora_switch``, also used by ``cuda_fp4``'s and
``cuda_dq``'s build switches). Imports nothing of ``qerl.kernels``, so the kernel modules can read it without an
import cycle."""

from __future__ import annotations

import os

GEMM_LORA_MODES = ("0", "1", "pdl")  # QERL_GEMM_LORA


def wgmma_lora_mode() -> str:
    """``QERL_WGMMA_LORA``: above decode size, how the LoRA term of a linear whose product the wgmma GEMM runs is
    added: ``pdl`` (default since session 37) by that GEMM's epilogue with x permuted first, then t = x·Aᵀ's launch
    (``qerl.kernels.fused.lora_a``), then the GEMM under programmatic dependent launch so its main loop overlaps t's
    launch (where that launch is lora_a's Triton kernel: up to ``QERL_LORA_A_MAX_M`` tokens) and waits for t only
    after it (a build of its own: ``-DQFP4_WGMMA_PDL=1``); ``1`` the same epilogue without PDL (the build without the
    waits); ``0`` an addmm after the GEMM. Measured on one H100 (7B NVFP4 rollouts, 256 + 512, the modes alternating
    twice in one process; `results/speed/raw/h100_s37_wgpdl`), tokens/s pdl with lora_a up to 256 tokens (the
    defaults) vs 1 with lora_a up to 64 (session 36's): 9752 / 9755 vs 9035 / 9171 at 64 sequences, 12583 / 12585 vs
    11792 / 11876 at 128, 14945 / 14960 vs 14535 / 14568 at 256; ``1`` against ``0`` +2.4-3.8% at 64-256
    (`results/speed/raw/h100_s32`). Same tokens and log-probs with and without PDL
    (``test_gpu_gemm_lora_pdl_decode_is_bit_identical``). The tail launch (``pdl-tail``, sessions 39-40: a launch's
    last partial wave of row blocks as a second launch with K split across CTAs; rollouts within the order effect,
    `results/speed/raw/h200_s40_tail`) was removed in session 48 (the code is at b686701)."""
    return _gemm_lora_switch("QERL_WGMMA_LORA", "pdl")


def mma_lora_mode() -> str:
    """``QERL_GEMM_LORA``: above decode size, how the LoRA term of a linear whose product the mma.sync GEMM runs (the
    H100 table's pick at 17-32 tokens, and at 64 for 7B's o projection) is added: ``pdl`` (default) in that GEMM's
    epilogue (t = x·Aᵀ by ``qerl.kernels.fused.lora_a`` first), the GEMM launched under programmatic dependent
    launch so its main loop runs while lora_a finishes and only the epilogue waits for t; ``1`` the same without PDL;
    ``0`` an addmm after the GEMM. Measured on one H100 (7B NVFP4 rollouts, 256 + 512, the modes alternating twice in
    one process; `results/speed/raw/h100_s36_pdl`): at 32 sequences pdl 6843 / 6791 tokens/s, 1 6083 / 6090, 0 with
    x·Aᵀ by cuBLAS (session 35's path) 5590 / 5766; at 64, 9149 / 9151, 8958 / 8944, 8731 / 8844; the 32-sequence
    graph step 4441 vs 5026 µs. Same tokens and log-probs with and without PDL
    (``test_gpu_gemm_lora_pdl_decode_is_bit_identical``)."""
    return _gemm_lora_switch("QERL_GEMM_LORA", "pdl")


def _gemm_lora_switch(name: str, default: str, valid: tuple[str, ...] = GEMM_LORA_MODES) -> str:
    v = os.environ.get(name, default)
    if v not in valid:
        raise ValueError(f"{name}={v!r}; valid: {', '.join(valid)}")
    return v
