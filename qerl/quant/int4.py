"""INT4 weight-only, symmetric, one scale per 128 elements along K (W4A16: the GPTQ/AWQ layout vLLM serves).

Numerics are compressed-tensors 0.20's ``W4A16`` preset as llm-compressor calibrates it for round-to-nearest
(memoryless min-max observer), reproduced op for op in the weight's dtype so packed words and scales are
bit-identical:

* scale   s_g = max(|min(w_g, 0)|, max(w_g, 0)) / 7.5  in W's dtype (7.5 = (q_max - q_min) / 2 = 15 / 2);
  an s_g of 0 (an all-zero group) becomes the dtype's machine epsilon;
* element q = clamp(round_half_even(W / s_g), -8, 7).

Dequantization: W_hat = q * s_g (the product is exact in float32 for bfloat16/float16 scales, so rounding it to the
scale's dtype gives compressed-tensors' result bit for bit).

Checkpoint layout (compressed-tensors ``pack-quantized``): ``weight_packed`` int32 (N, K/8): eight 4-bit codes
q + 8 per word, element j of a row in bits 4*(j % 8) of word j // 8; ``weight_scale`` (N, K/128) in the weight's
dtype; ``weight_shape`` int64 (2,). Symmetric, so no zero point is stored.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qerl.quant import base
from qerl.quant.finite import check_finite

Q_MIN, Q_MAX = -8, 7
_HALF_RANGE = (Q_MAX - Q_MIN) / 2  # 7.5
_PER_WORD = 8  # 4-bit codes per int32


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int codes (N, K) in [-8, 7] (K % 8 == 0) -> int32 (N, K/8), compressed-tensors' ``pack_to_int32`` layout."""
    n, k = q.shape
    u = (q.to(torch.int64) - Q_MIN).reshape(n, k // _PER_WORD, _PER_WORD)  # (N, K/8, 8) in [0, 15]
    shifts = 4 * torch.arange(_PER_WORD, device=q.device, dtype=torch.int64)
    words = (u << shifts).sum(-1)  # (N, K/8) in [0, 2^32): disjoint bits, so the sum is the OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement wrap


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 (N, K/8) -> int8 (N, K) codes in [-8, 7]."""
    n, w = packed.shape
    shifts = 4 * torch.arange(_PER_WORD, device=packed.device, dtype=torch.int32)
    u = (packed.unsqueeze(-1) >> shifts) & 0xF  # (N, K/8, 8); the arithmetic shift's sign bits are masked off
    return (u.reshape(n, w * _PER_WORD) + Q_MIN).to(torch.int8)


class INT4Format(base.FormatBase):
    """Handler for INT4 W4A16 (symmetric, group 128) weights in the compressed-tensors ``pack-quantized`` layout."""

    name = "int4"
    block = 128
    label, color = "INT4", "#8c564b"
    checkpoint = base.CheckpointScheme(
        compression="pack-quantized", preset="W4A16",
        weights={"dynamic": False, "group_size": 128, "num_bits": 4, "strategy": "group", "symmetric": True,
                 "type": "int"},
        tensors=("weight_packed", "weight_scale", "weight_shape"))
    fusable = False  # weight_shape is per tensor: q|k|v do not concatenate into one packed weight
    reference_backend = "torch_reference"
    kernels = None  # no fast kernel yet: dequantize + matmul everywhere



    @torch.no_grad()
    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize w (N, K) -> {weight_packed int32 (N, K/8), weight_scale (N, K/128) in w's dtype,
        weight_shape int64 (2,)}."""
        n, k = self.checked_shape(w)
        if not w.is_floating_point():
            raise ValueError(f"int4 expects a floating-point weight, got {w.dtype}")
        check_finite(w, self.name)
        wg = w.detach().reshape(n, k // self.block, self.block)  # (N, G, 128)
        zero = torch.zeros((), dtype=w.dtype, device=w.device)
        lo = torch.minimum(wg.amin(-1), zero)  # (N, G): 0 is always representable
        hi = torch.maximum(wg.amax(-1), zero)
        amax = torch.maximum(lo.abs(), hi.abs())
        scale = amax / torch.tensor(_HALF_RANGE, dtype=w.dtype, device=w.device)  # (N, G) in w.dtype
        scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(w.dtype).eps), scale)
        q = torch.round(torch.clamp(wg / scale.unsqueeze(-1), Q_MIN, Q_MAX)).reshape(n, k)  # ties to even
        return {
            "weight_packed": pack_int4(q),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k], dtype=torch.int64, device=w.device),
        }

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W_hat (N, K) = q * weight_scale, computed in float32 (float64 for a float64 scale), cast to dtype."""
        packed, scale = q["weight_packed"], q["weight_scale"]
        n, w = packed.shape
        k = w * _PER_WORD
        cdt = torch.float64 if scale.dtype == torch.float64 else torch.float32
        vals = unpack_int4(packed).to(cdt).reshape(n, k // self.block, self.block)  # (N, G, 128)
        return (vals * scale.to(cdt).unsqueeze(-1)).reshape(n, k).to(dtype)

    def bits_per_weight(self, n: int, k: int) -> float:
        """4-bit elements + one 16-bit scale per 128 (a bfloat16 checkpoint's) + the int64 (2,) shape."""
        return (4.0 * n * k + 16.0 * n * (k // self.block) + 128.0) / (n * k)
