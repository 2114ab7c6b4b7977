"""NF4 (QLoRA): 4-bit NormalFloat codes, one absmax per 64 elements, double-quantized absmax.

Pure-torch re-implementation of ``bitsandbytes.functional.quantize_4bit(w, blocksize=64,
quant_type="nf4", compress_statistics=True)`` and ``dequantize_4bit`` as bitsandbytes 0.50 computes
them on CPU, bit for bit:

1. blocks of 64 consecutive (row-major) elements; absmax_b = max|w| in float32;
   code = bucketize(clamp(w * reciprocal(max(absmax_b, 1e-38)), -1, 1), NF4 midpoints);
   two codes per byte, the even element in the HIGH nibble (bitsandbytes' order).
2. double quantization: offset = mean(absmax); (absmax - offset) is quantized blockwise (256 per block)
   to uint8 indices of bitsandbytes' signed 8-bit dynamic map, through the CPU kernel's 65536-entry
   lookup table (the value is first snapped to a 16-bit grid on [-1, 1]).
3. dequantize: absmax_b = dyn[idx] * nested_absmax + offset; w_hat = nf4[code] * absmax_b (float32), cast.

Tensor names follow ``QuantState.as_dict(packed=True)`` (absmax, quant_map, nested_absmax,
nested_quant_map, nested_offset) plus ``weight_packed`` (bnb's ``weight``, shape (N*K/2, 1)) and
``weight_shape``. :func:`to_bnb_quant_state` rebuilds a bitsandbytes ``QuantState`` for its kernels.
A weight holding inf/NaN raises ``NonFiniteWeightError`` (bitsandbytes would give its block NaN codes silently).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from qerl.quant import base
from qerl.quant.finite import check_finite

NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # QLoRA's NormalFloat4 levels (bitsandbytes get_4bit_type("nf4"))
NESTED_BLOCKSIZE = 256
_LUT_SIZE = 65536

_CACHE: dict[tuple[str, torch.device], torch.Tensor] = {}


def dynamic_map() -> torch.Tensor:
    """(256,) float32 signed 8-bit dynamic quantization map (Dettmers 2015) with 7 exponent bits, sorted.

    For exponent i = 0..6 the 2^i means of a linspace(0.1, 1, 2^i + 1) grid, scaled by ±10^(i-6),
    plus 0 and 1 (bitsandbytes ``create_dynamic_map(signed=True)``).
    """
    vals: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        vals += ((10 ** (i - 6)) * mids).tolist()
        vals += (-(10 ** (i - 6)) * mids).tolist()
    vals += [0.0, 1.0]
    return torch.tensor(sorted(vals), dtype=torch.float32)


def _cached(name: str, device: torch.device) -> torch.Tensor:
    key = (name, torch.device(device))
    t = _CACHE.get(key)
    if t is None:
        if name == "nf4":
            t = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
        elif name == "nf4_mid":
            c = _cached("nf4", device)
            t = (c[:-1] + c[1:]) / 2
        elif name == "nf4_pairs":  # (256, 2): values of (high, low) nibble of every byte
            c, b = _cached("nf4", device), torch.arange(256, device=device)
            t = torch.stack((c[b >> 4], c[b & 0x0F]), dim=-1).contiguous()
        elif name == "dyn":
            t = dynamic_map().to(device)
        elif name == "dyn_lut":
            t = _dynamic_lut(_cached("dyn", device))
        else:
            raise KeyError(name)
        _CACHE[key] = t
    return t


def _dynamic_lut(code: torch.Tensor) -> torch.Tensor:
    """(65536,) uint8: nearest code index of each point -1 + 2i/65535 of the 16-bit grid (bnb CPU kernel)."""
    mid = 0.5 * (code[:-1] + code[1:])  # (255,)
    grid = -1.0 + (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32, device=code.device)) / float(_LUT_SIZE - 1)
    return torch.searchsorted(mid, grid, right=False).to(torch.uint8)  # number of midpoints < value


def _quantize_dynamic(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 8-bit dynamic quantization of float32 x (n,) -> (uint8 (n,), absmax float32 (ceil(n/b),))."""
    n = x.numel()
    nb = -(-n // blocksize)
    xb = F.pad(x, (0, nb * blocksize - n)).reshape(nb, blocksize)  # zero padding leaves absmax unchanged
    absmax = xb.abs().amax(dim=-1)  # (nb,)
    inv = torch.reciprocal(torch.where(absmax == 0, torch.ones_like(absmax), absmax))
    v = torch.clamp(xb * inv.unsqueeze(-1), -1.0, 1.0)
    idx = ((v + 1.0) * 0.5 * float(_LUT_SIZE - 1) + 0.5).to(torch.int32)  # truncation, as the C cast
    q = _cached("dyn_lut", x.device)[idx]
    q = torch.where((absmax == 0).unsqueeze(-1), torch.zeros_like(q), q)
    return q.reshape(-1)[:n], absmax


class NF4Format(base.FormatBase):
    """Handler for bitsandbytes NF4 (blocksize 64, double quantization on by default)."""

    name = "nf4"
    block = 64
    label, color = "NF4", "#ff7f0e"
    checkpoint = None  # bitsandbytes' own serialization, not a compressed-tensors scheme
    fusable = False  # bnb's nested absmax blocks are per tensor: q|k|v cannot share one buffer
    reference_backend = "torch_reference"
    kernels = None  # qerl.kernels registers bitsandbytes' kernels

    options = ("double_quant",)

    def __init__(self, double_quant: bool = True):
        self.double_quant = double_quant



    @torch.no_grad()
    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize w (N, K) to NF4 tensors named after bitsandbytes' QuantState serialization."""
        n, k = self.checked_shape(w)
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"nf4 supports bfloat16, float16 and float32 weights, got {w.dtype}")
        check_finite(w, self.name)
        dev = w.device
        blocks = w.detach().reshape(-1, self.block).float()  # (NB, 64)
        absmax = blocks.abs().amax(dim=-1)  # (NB,)
        scaled = torch.clamp(blocks * torch.reciprocal(absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1)
        codes = torch.bucketize(scaled, _cached("nf4_mid", dev), out_int32=True).to(torch.uint8).reshape(-1)
        out = {
            "weight_packed": ((codes[0::2] << 4) | codes[1::2]).unsqueeze(1),  # (N*K/2, 1)
            "quant_map": _cached("nf4", dev).clone(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64, device=dev),
        }
        if not self.double_quant:
            out["absmax"] = absmax
            return out
        offset = absmax.mean()
        qabs, nested_absmax = _quantize_dynamic(absmax - offset, NESTED_BLOCKSIZE)
        out.update(
            absmax=qabs,  # (NB,) uint8
            nested_absmax=nested_absmax,  # (ceil(NB/256),) float32
            nested_quant_map=_cached("dyn", dev).clone(),  # (256,)
            nested_offset=offset,  # () float32
        )
        return out

    @staticmethod
    def block_absmax(q: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """float32 (NB,) absmax of every 64-block, undoing the double quantization when present."""
        absmax = q["absmax"]
        if "nested_absmax" not in q:
            return absmax.float()
        nb = absmax.numel()
        nested = q["nested_absmax"].float().repeat_interleave(NESTED_BLOCKSIZE)[:nb]
        return q["nested_quant_map"].float()[absmax.long()] * nested + q["nested_offset"].float()

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W_hat (N, K) = nf4[code] * absmax_block in float32, cast to dtype."""
        n, k = (int(s) for s in q["weight_shape"].tolist())
        packed = q["weight_packed"].reshape(-1)
        code = q["quant_map"].to(torch.float32)
        pairs = code[torch.arange(256, device=code.device) >> 4], code[torch.arange(256, device=code.device) & 0x0F]
        vals = F.embedding(packed.to(torch.int32), torch.stack(pairs, dim=-1))  # (N*K/2, 2)
        vals = vals.reshape(-1, self.block) * self.block_absmax(q).unsqueeze(-1)  # (NB, 64)
        return vals.reshape(n, k).to(dtype)

    def bits_per_weight(self, n: int, k: int) -> float:
        """4-bit codes + uint8 absmax per 64 + float32 per 256 blocks (+ offset); code tables excluded."""
        nb = n * k // self.block
        bits = 4.0 * n * k
        if self.double_quant:
            bits += 8.0 * nb + 32.0 * -(-nb // NESTED_BLOCKSIZE) + 32.0
        else:
            bits += 32.0 * nb
        return bits / (n * k)


def to_bnb_quant_state(q: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype = torch.bfloat16):
    """Build a ``bitsandbytes.functional.QuantState`` from our NF4 dict (for bnb's 4-bit kernels).

    ``dtype`` is the dtype bnb dequantizes to (the original weight's). Pass ``q["weight_packed"]`` as the
    packed weight (bnb's ``Params4bit`` data, shape (N*K/2, 1)).
    """
    from bitsandbytes.functional import QuantState

    shape = torch.Size(int(s) for s in q["weight_shape"].tolist())
    state2, offset = None, None
    if "nested_absmax" in q:
        state2 = QuantState(
            absmax=q["nested_absmax"].to(device),
            code=q["nested_quant_map"].to(device),
            blocksize=NESTED_BLOCKSIZE,
            dtype=torch.float32,
        )
        offset = q["nested_offset"].to(device)
    return QuantState(
        absmax=q["absmax"].to(device),
        shape=shape,
        code=q["quant_map"].to(device),
        blocksize=NF4Format.block,
        quant_type="nf4",
        dtype=dtype,
        offset=offset,
        state2=state2,
    )
