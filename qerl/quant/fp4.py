"""FP4 E2M1 elements shared by ``nvfp4`` and ``mxfp4``: encode, decode and nibble packing.

A 4-bit code is ``sign << 3 | magnitude`` where magnitude 0..7 indexes the E2M1 grid
{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Packing follows compressed-tensors: two codes per byte, the
even element in the low nibble.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Rounding thresholds between neighbouring grid points, with which side a tie goes to so that
# ties land on the even code (round half to even on the code index): (threshold, tie_rounds_up).
# 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (code 2), 1.75 -> 2.0 (code 4),
# 2.5 -> 2.0 (code 4), 3.5 -> 4.0 (code 6), 5.0 -> 4.0 (code 6). Anything above 5 saturates to 6.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

_PAIR_LUT_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` (already divided by its scale) to the nearest E2M1 value and return 4-bit codes.

    Round to nearest, ties to the even code, saturate at ±6. The sign bit is set for every
    ``x < 0``, also when the magnitude rounds to 0 (code 8, "-0"), exactly as compressed-tensors
    does (its CPU path multiplies by ``sign(x)``, its Triton path tests ``x < 0``); ``-0.0`` gets code 0.
    Non-finite input has no E2M1 value (NaN would become code 0, ±inf would saturate to ±6): the formats'
    ``quantize`` rejects it first (``qerl.quant.finite``), so this element-wise encoder does not check again.
    Returns uint8 of ``x``'s shape.
    """
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for thr, tie_up in _THRESHOLDS:
        mag += (a >= thr) if tie_up else (a > thr)
    return mag | ((x < 0).to(torch.uint8) << 3)


def _code_values(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(16,) value of each 4-bit code; code 8 decodes to -0.0 like compressed-tensors."""
    pos = torch.tensor(E2M1_GRID, dtype=dtype, device=device)
    return torch.cat([pos, -pos])


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map 4-bit codes (any integer dtype, values 0..15) to their E2M1 values in ``dtype``."""
    return _code_values(codes.device, dtype)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes (..., K) (K even, values 0..15) into uint8 (..., K/2): even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 (..., K/2) -> codes uint8 (..., K)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _pair_lut(device: torch.device) -> torch.Tensor:
    """(256, 2) float32: the two E2M1 values (low nibble first) of every packed byte."""
    key = (torch.device(device), torch.float32)
    lut = _PAIR_LUT_CACHE.get(key)
    if lut is None:
        vals = _code_values(device)
        byte = torch.arange(256, device=device)
        lut = torch.stack((vals[byte & 0x0F], vals[byte >> 4]), dim=-1).contiguous()
        _PAIR_LUT_CACHE[key] = lut
    return lut


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Unpack and decode uint8 (N, K/2) to float32 (N, K) E2M1 values in one table lookup per byte."""
    n, half = packed.shape
    pairs = F.embedding(packed.to(torch.int32), _pair_lut(packed.device))  # (N, K/2, 2)
    return pairs.reshape(n, 2 * half)
