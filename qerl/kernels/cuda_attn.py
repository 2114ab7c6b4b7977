"""Hand-written CUDA decode attention (``csrc/decode_attn.cu``) for :func:`qerl.kernels.fused.decode_attention` at
large decode batches: bf16, head dims 64 and 128 (every Qwen2.5 size), up to 16 query heads per KV head.

One CTA per (row, KV head) over all keys: its four warps stream 16-key subtiles of K and V through per-warp rings of
``nst`` shared-memory stages (cp.async), with the scores and P·V on mma.sync; under programmatic dependent launch the
first stages are requested before ``griddepcontrol.wait`` (everything but q and the cache slot ``slot`` the
preceding RoPE launch writes is final by then). No key splits, so no combine launch: it applies where the batch has
:data:`MIN_ROWS` (row, KV head) pairs or more, i.e. where the batch alone about fills the GPU. ``QERL_ATTN``:
``auto`` (default: this kernel there, Triton's split kernel + combine below), ``cuda`` (this kernel at any batch, or
an error), ``triton`` (never this kernel).
"""

from __future__ import annotations

import os

import torch

from qerl.kernels import cuda_build

ATTN_MODES = ("auto", "cuda", "triton")
NST_CHOICES = (2, 3, 4)
NST = 2  # ring stages per warp (benchmarks.attn_bench --cuda-configs sweeps them)
# (row, KV head) pairs from which `auto` takes this kernel: about a wave of 132 SMs without splitting the keys. On an
# H200 (session 33, benchmarks.attn_bench) it beat the Triton split kernel at 128-2048 pairs (7B batch 32: 8.5 vs
# 10.4 µs at KV 256, 23.5 vs 24.1 at 1024; batch 64-256: 3-14% faster) and lost at 32 (7B batch 8, KV 1024: 14.2 vs
# 10.2 µs: too few CTAs); 64 pairs (32B batch 8) about even
MIN_ROWS = 128

# The decode attention's torch wrappers: C++ compiled as the extension's binding.cpp
_BINDING = (cuda_build.CSRC / "decode_attn_binding.cpp").read_text()

_CU = (cuda_build.CSRC / "decode_attn.cu",)
_HEADERS = (cuda_build.CSRC / "fp4_mma_common.cuh",)
_STATE: dict = {}


MODE: str | None = None  # overrides QERL_ATTN when set (benchmarks.attn_bench)


def attn_mode() -> str:
    """``QERL_ATTN`` (or :data:`MODE`): auto, cuda or triton."""
    v = MODE if MODE is not None else os.environ.get("QERL_ATTN", "auto")
    if v not in ATTN_MODES:
        raise ValueError(f"QERL_ATTN={v!r}; valid: {', '.join(ATTN_MODES)}")
    return v


def _ext():
    return cuda_build.load_extension("qerl_attn", _CU, _HEADERS, _BINDING, ["-O3", *cuda_build.arch_flags()], _STATE)


def shape_ok(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bias: torch.Tensor) -> bool:
    """The shapes and dtypes the kernel takes: bf16 q and contiguous caches, head dim 64 or 128, <= 16 query heads
    per KV head, a contiguous fp32 bias."""
    d, h, hkv = q.shape[-1], q.shape[1], kc.shape[1]
    return (q.dtype == kc.dtype == vc.dtype == torch.bfloat16 and d in (64, 128) and h % hkv == 0
            and h // hkv <= 16 and kc.is_contiguous() and vc.is_contiguous() and bias.dtype == torch.float32
            and bias.is_contiguous())


def triton_by_rule(rows: int) -> bool:
    """True where ``QERL_ATTN`` alone sends a decode batch of ``rows`` (row, KV head) pairs to the Triton split kernel:
    ``triton``, or ``auto`` below :data:`MIN_ROWS` (before :func:`usable` looks at the device and the build)."""
    mode = attn_mode()
    return mode == "triton" or (mode == "auto" and rows < MIN_ROWS)


def usable(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bias: torch.Tensor) -> bool:
    """True where :func:`qerl.kernels.fused.decode_attention` runs this kernel (``QERL_ATTN``; ``auto``: from
    :data:`MIN_ROWS` (row, KV head) pairs; a CUDA device of compute capability 8.0+ on which the extension builds);
    ``QERL_ATTN=cuda`` takes it at any batch and raises where it cannot run instead of falling back."""
    if triton_by_rule(q.shape[0] * kc.shape[1]):
        return False
    mode = attn_mode()
    ok = q.is_cuda and shape_ok(q, kc, vc, bias) and torch.cuda.get_device_capability(q.device)[0] >= 8
    if ok:
        try:
            _ext()
        except Exception:
            ok = False
    if not ok and mode == "cuda":
        raise RuntimeError(f"QERL_ATTN=cuda but the CUDA decode attention does not apply (q {tuple(q.shape)} "
                           f"{q.dtype} on {q.device}, {kc.shape[1]} KV heads; build error: {_STATE.get('error')})")
    return ok


def attend(q, kc, vc, bias, s: int, scale: float, slot: torch.Tensor | None, pdl: bool,
           nst: int | None = None, permuted: bool = False) -> torch.Tensor:
    """softmax(q·Kᵀ·scale + bias)·V over cache slots [0, s), one CTA per (row, KV head): q (M, H, d), kc/vc (M, HKV,
    S_max, d), bias (M, S_max) fp32. Returns (M, H·d) bf16. ``nst``: ring stages per warp (default :data:`NST`).
    ``permuted``: the launch also writes the output in the FP4 wgmma GEMM's K permutation, tagged on it
    (``qerl.kernels.permuted.tag_permuted``: the o projection's GEMM reads it instead of permuting)."""
    nst = NST if nst is None else nst
    if nst not in NST_CHOICES:
        raise ValueError(f"nst={nst}; valid: {NST_CHOICES}")
    m, h, d = q.shape
    o = torch.empty((m, h * d), dtype=q.dtype, device=q.device)
    empty = torch.empty(0, dtype=torch.long, device=q.device)
    from qerl.kernels.permuted import permuted_buffer
    op = permuted_buffer(o, permuted)  # tagged on o before the launch that writes both
    _ext().attend(q, kc, vc, bias, empty if slot is None else slot, o, o[:0] if op is None else op, int(s),
                  float(scale), int(nst), bool(pdl))
    return o
