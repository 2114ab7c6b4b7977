"""NVFP4: E2M1 elements, one FP8 E4M3 scale per 16 elements along K, one FP32 per-tensor scale.

Numerics are those of compressed-tensors 0.20 ``NVFP4A16`` as llm-compressor calibrates it
(memoryless min-max weight observer, round to nearest), reproduced op for op in the weight's dtype
so the packed bytes and scales are bit-identical:

* global scale  g = 448 * 6 / amax(|W|)  (computed as ``reciprocal(amax) * 2688`` in W's dtype, amax clamped
  to the dtype's smallest normal; a g that overflows to inf, i.e. an all-zero or tiny weight, becomes 1, as
  compressed-tensors' ``generate_gparam`` does), stored as float32 ``weight_global_scale``;
* block scale   s_b = fp8_e4m3(g * (amax_b / 6)), with s_b == 0 replaced by 0.125;
* elements      q = E2M1(W / (s_b / g)), ties to even, saturating at ±6.

Dequantization (paper Eq. 6, compressed-tensors' convention that ``weight_global_scale`` divides):
    W_hat = q * (float(s_b) / g).
A weight holding inf/NaN raises ``NonFiniteWeightError`` (one ``inf`` would make g = 0 and every element NaN).
llm-compressor additionally shares one global scale over fused projections (q/k/v, gate/up);
pass ``global_scale=NVFP4Format.global_scale(w_q, w_k, w_v)`` to reproduce that.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qerl.quant import base
from qerl.quant.finite import NonFiniteWeightError, check_finite
from qerl.quant.fp4 import E2M1_MAX, decode_packed, e2m1_encode, pack_nibbles

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
ZERO_SCALE_EPS = 0.125  # compressed-tensors' replacement for a block scale that rounds to 0 in E4M3


class NVFP4Format(base.FormatBase):
    """Handler for NVFP4 weights in the compressed-tensors ``nvfp4-pack-quantized`` layout."""

    name = "nvfp4"
    block = 16
    scale_kind = "e4m3"  # FP8 E4M3 block scales + an FP32 per-tensor divisor (the FP4 kernels read this)
    label, color = "NVFP4", "#2ca02c"
    checkpoint = base.CheckpointScheme(
        compression="nvfp4-pack-quantized", preset="NVFP4A16",
        weights={"dynamic": False, "group_size": 16, "num_bits": 4, "scale_dtype": "torch.float8_e4m3fn",
                 "strategy": "tensor_group", "symmetric": True, "type": "float"},
        tensors=("weight_packed", "weight_scale", "weight_global_scale"))
    fusable = True
    reference_backend = "torch_reference"
    kernels = None  # qerl.kernels registers the FP4 dispatcher



    @staticmethod
    def global_scale(*weights: torch.Tensor) -> torch.Tensor:
        """float32 (1,) per-tensor scale 448*6/amax over all ``weights`` (one for a fused q/k/v group).

        Raises NonFiniteWeightError if any weight holds inf/NaN (amax is then non-finite: a free scalar check)."""
        amax = torch.stack([w.detach().abs().amax() for w in weights]).amax()
        if not bool(torch.isfinite(amax)):
            raise NonFiniteWeightError("nvfp4", sum(int(torch.isinf(w).sum()) for w in weights),
                                       sum(int(torch.isnan(w).sum()) for w in weights))
        amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
        # compressed-tensors writes `448 * 6 / amax`; Python's float / Tensor is reciprocal() * float.
        gs = torch.reciprocal(amax) * (FP8_E4M3_MAX * E2M1_MAX)
        gs = torch.nan_to_num(gs, posinf=1.0)  # amax is finite and >= tiny here: only overflow is left
        return gs.to(torch.float32).reshape(1)

    @torch.no_grad()
    def quantize(self, w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Quantize w (N, K) -> {weight_packed uint8 (N, K/2), weight_scale e4m3 (N, K/16), weight_global_scale f32 (1,)}."""
        n, k = self.checked_shape(w)
        w = w.detach()
        if not w.is_floating_point():
            raise ValueError(f"nvfp4 expects a floating-point weight, got {w.dtype}")
        check_finite(w, self.name)
        if global_scale is None:
            gs = self.global_scale(w)
        else:
            gs = global_scale.to(torch.float32, copy=True)
            if gs.numel() != 1 or not bool(torch.isfinite(gs).all() & (gs > 0).all()):
                raise ValueError(f"nvfp4 global_scale must be one finite positive number, got {global_scale}")
        gs = gs.reshape(1).to(w.device)

        wg = w.reshape(n, k // self.block, self.block)  # (N, G, 16)
        amax_b = wg.abs().amax(dim=-1)  # (N, G) in w.dtype
        six = torch.full((), E2M1_MAX, dtype=w.dtype, device=w.device)
        scale = gs * (amax_b / six)  # (N, G) float32 (promoted by the float32 global scale)
        scale = torch.clamp(scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(scale.dtype)
        scale = torch.where(scale == 0, torch.full_like(scale, ZERO_SCALE_EPS), scale)
        # compressed-tensors keeps the block scale in a parameter of the weight's dtype (exact for E4M3
        # values) and quantizes with x / (scale / global_scale) in the promoted dtype.
        scale_w = scale.to(w.dtype)
        eff = (scale_w / gs).unsqueeze(-1)  # (N, G, 1)
        codes = e2m1_encode(wg / eff).reshape(n, k)  # (N, K)
        return {
            "weight_packed": pack_nibbles(codes),
            "weight_scale": scale_w.to(torch.float8_e4m3fn),
            "weight_global_scale": gs,
        }

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W_hat (N, K) = e2m1 * (float(weight_scale) / weight_global_scale), computed in float32, cast to dtype."""
        packed = q["weight_packed"]
        n, half = packed.shape
        k = 2 * half
        vals = decode_packed(packed).reshape(n, k // self.block, self.block)  # (N, G, 16) float32
        eff = q["weight_scale"].to(torch.float32) / q["weight_global_scale"].to(torch.float32)  # (N, G)
        return (vals * eff.unsqueeze(-1)).reshape(n, k).to(dtype)

    def bits_per_weight(self, n: int, k: int) -> float:
        """4-bit elements + one 8-bit scale per 16 + one float32 per tensor."""
        return (4.0 * n * k + 8.0 * n * (k // self.block) + 32.0) / (n * k)
