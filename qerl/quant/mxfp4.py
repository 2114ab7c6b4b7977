"""MXFP4: E2M1 elements with one shared power-of-two scale (E8M0, bias 127) per 32 elements along K.

The element is q = E2M1(W / 2^(e - 127)) (ties to even, saturating at ±6) and W_hat = q * 2^(e - 127).
Libraries differ only in how they pick the shared exponent e from the block's amax
(the element format's largest power of two is 2^2, so each rule subtracts 2):

* ``ct`` (default; torchao calls it EVEN): compressed-tensors 0.20 ``MXFP4A16``. amax is first rounded
  to a power of two, upwards when its significand is >= 1.75, then e = log2(that) - 2. A block max in
  [1.5, 1.75) * 2^k still saturates to 6; one in [1.75, 2) * 2^k no longer does.
* ``floor``: the OCP MX v1.0 spec, e = floor(log2(amax)) - 2; block maxima in [1.5, 2) * 2^k saturate.
* ``ceil``: e = ceil(log2(amax)) - 2; never saturates, a coarser grid for most blocks.
* ``rceil``: e = ceil(log2(amax / 6)) (NVIDIA's cuBLAS/Blackwell rule); the smallest power of two that
  avoids saturation.

Biased exponents are clamped to [0, 254] (255 is E8M0's NaN); an all-zero block gets e = 0 (e = 127 for
float16 weights under ``ct``, as compressed-tensors' float16 scale parameter gives). A weight holding inf/NaN
raises ``NonFiniteWeightError`` (a NaN block would otherwise get e = 0 and be zeroed without a word).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qerl.quant import base
from qerl.quant.finite import check_finite
from qerl.quant.fp4 import decode_packed, e2m1_encode, pack_nibbles

E8M0_BIAS = 127
_ELEM_EMAX = 2  # floor(log2(6))

_SCALE_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def _floor_log2(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """floor(log2(amax)) as int32 and the significand m in [1, 2), exact for normals and subnormals."""
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    return (exp - 1).to(torch.int32), mant * 2


def _exp_ct(amax: torch.Tensor) -> torch.Tensor:
    e, m = _floor_log2(amax)
    return e + (m >= 1.75).to(torch.int32) - _ELEM_EMAX


def _exp_floor(amax: torch.Tensor) -> torch.Tensor:
    e, _ = _floor_log2(amax)
    return e - _ELEM_EMAX


def _exp_ceil(amax: torch.Tensor) -> torch.Tensor:
    e, m = _floor_log2(amax)
    return e + (m > 1).to(torch.int32) - _ELEM_EMAX


def _exp_rceil(amax: torch.Tensor) -> torch.Tensor:
    # smallest e with amax / 2^e <= 6, computed exactly: amax <= 6 * 2^e  <=>  amax / 6 <= 2^e
    e, m = _floor_log2(amax)  # amax = m * 2^e, m in [1, 2)
    # m * 2^e <= 6 * 2^x  <=>  x >= e + log2(m / 6); log2(m/6) in [-2.585, -1.585) -> x = e - 2 if m <= 1.5 else e - 1
    return e - 2 + (m > 1.5).to(torch.int32)


SCALE_RULES = {"ct": _exp_ct, "floor": _exp_floor, "ceil": _exp_ceil, "rceil": _exp_rceil}


def _scale_lut(device: torch.device) -> torch.Tensor:
    """(256,) float32: 2^(e - 127) for every biased exponent byte (e = 255 gives inf)."""
    key = torch.device(device)
    lut = _SCALE_LUT_CACHE.get(key)
    if lut is None:
        lut = torch.tensor([2.0 ** (e - E8M0_BIAS) if e < 255 else float("inf") for e in range(256)],
                           dtype=torch.float32, device=device)
        _SCALE_LUT_CACHE[key] = lut
    return lut


class MXFP4Format(base.FormatBase):
    """Handler for MXFP4 weights in the compressed-tensors ``mxfp4-pack-quantized`` layout.

    ``scale_rule`` only changes how ``quantize`` picks exponents; the stored layout and ``dequantize`` are the
    same for every rule, so ``name`` is always "mxfp4".
    """

    name = "mxfp4"
    block = 32
    scale_kind = "e8m0"  # power-of-two block scales (the FP4 kernels read this)
    label, color = "MXFP4", "#9467bd"
    checkpoint = base.CheckpointScheme(
        compression="mxfp4-pack-quantized", preset="MXFP4A16",
        weights={"dynamic": False, "group_size": 32, "num_bits": 4, "scale_dtype": "torch.uint8",
                 "strategy": "group", "symmetric": True, "type": "float"},
        tensors=("weight_packed", "weight_scale"))
    fusable = True
    reference_backend = "torch_reference"
    kernels = None  # qerl.kernels registers the FP4 dispatcher

    options = ("scale_rule",)

    def __init__(self, scale_rule: str = "ct"):
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"unknown MXFP4 scale_rule {scale_rule!r}; valid rules: {sorted(SCALE_RULES)}")
        self.scale_rule = scale_rule



    def shared_exponent(self, amax: torch.Tensor) -> torch.Tensor:
        """Biased E8M0 exponent (uint8) of each block from its amax (any float dtype), by this scale rule."""
        amax = amax.to(torch.float64 if amax.dtype == torch.float64 else torch.float32)
        e = SCALE_RULES[self.scale_rule](amax) + E8M0_BIAS
        e = torch.where(amax > 0, e, torch.zeros_like(e))
        return e.clamp(0, 254).to(torch.uint8)

    @torch.no_grad()
    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize w (N, K) -> {weight_packed uint8 (N, K/2), weight_scale uint8 E8M0 (N, K/32)}."""
        n, k = self.checked_shape(w)
        if not w.is_floating_point():
            raise ValueError(f"mxfp4 expects a floating-point weight, got {w.dtype}")
        check_finite(w, self.name)
        cdt = torch.float64 if w.dtype == torch.float64 else torch.float32
        wg = w.detach().reshape(n, k // self.block, self.block).to(cdt)  # (N, G, 32), exact upcast
        amax = wg.abs().amax(dim=-1)  # (N, G)
        e = self.shared_exponent(amax)  # (N, G) uint8
        if self.scale_rule == "ct" and w.dtype == torch.float16:
            # compressed-tensors rounds amax to a power of two with a bit trick in float16. On a subnormal amax
            # (< 2^-14, no implicit leading 1) it gives 2^-14 when amax >= 0.75 * 2^-14 and 0 otherwise; a 0
            # scale is then replaced by 1 (e = 127). Match it so fp16 weights stay bit-identical too.
            sub = amax < 2.0**-14
            e = torch.where(sub & (amax >= 0.75 * 2.0**-14), torch.full_like(e, E8M0_BIAS - 14 - _ELEM_EMAX), e)
            e = torch.where(sub & (amax < 0.75 * 2.0**-14), torch.full_like(e, E8M0_BIAS), e)
        scale = _scale_lut(w.device)[e.long()].to(cdt)  # (N, G); power-of-two division is exact
        codes = e2m1_encode(wg / scale.unsqueeze(-1)).reshape(n, k)
        return {"weight_packed": pack_nibbles(codes), "weight_scale": e}

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W_hat (N, K) = e2m1 * 2^(weight_scale - 127), exact in float32, cast to dtype."""
        packed = q["weight_packed"]
        n, half = packed.shape
        k = 2 * half
        vals = decode_packed(packed).reshape(n, k // self.block, self.block)  # (N, G, 32)
        scale = _scale_lut(packed.device)[q["weight_scale"].long()]  # (N, G)
        return (vals * scale.unsqueeze(-1)).reshape(n, k).to(dtype)

    def bits_per_weight(self, n: int, k: int) -> float:
        """4-bit elements + one 8-bit exponent per 32."""
        return (4.0 * n * k + 8.0 * n * (k // self.block)) / (n * k)
