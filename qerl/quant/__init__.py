"""Weight formats: one module per format, registered in ``FORMATS``.

A format is a small handler object (house rule 5) with this interface::

    fmt = FORMATS["nvfp4"]
    q = fmt.quantize(w)               # w: (N, K) float tensor  ->  dict[str, Tensor] (packed, compressed-tensors names)
    w_hat = fmt.dequantize(q, dtype)  # -> (N, K) tensor in `dtype`, pure torch, CPU or GPU
    fmt.bits_per_weight(N, K)         # storage cost, scales included

Packed tensor names follow the compressed-tensors checkpoint layout so checkpoints move between
qerl, llm-compressor and vLLM without conversion:

* ``nvfp4``: ``weight_packed`` uint8 (N, K/2) (low nibble = even element), ``weight_scale`` float8_e4m3fn
  (N, K/16), ``weight_global_scale`` float32 (1,) (compressed-tensors' convention: the divisor).
* ``mxfp4``: ``weight_packed`` uint8 (N, K/2), ``weight_scale`` uint8 E8M0 exponents (N, K/32).
* ``mxfp4`` takes a ``scale_rule`` (``MXFP4Format(scale_rule="floor")``); ``FORMATS`` holds compressed-tensors' rule.
* ``nf4``: bitsandbytes NF4 (blocksize 64, double quantization): ``weight_packed`` uint8 (N*K/2, 1) (bnb's
  ``weight``, even element in the high nibble) + QuantState names ``absmax``, ``quant_map``, ``nested_absmax``,
  ``nested_quant_map``, ``nested_offset``, and ``weight_shape``; ``nf4.to_bnb_quant_state`` rebuilds bnb's state.
* ``bf16``: ``weight`` (N, K) bfloat16.

Every ``quantize`` raises ``NonFiniteWeightError`` (a ``UserError``) on a weight holding inf/NaN: no format can store
them, and each would otherwise corrupt the tensor silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch


class QuantFormat(Protocol):
    name: str
    block: int | None  # elements per scale block along K (nvfp4 16, mxfp4 32, nf4 64, bf16 None)

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor: ...

    def bits_per_weight(self, n: int, k: int) -> float: ...

    def check_shape(self, n: int, k: int) -> None: ...


# Imported after the Protocol so the format modules can be read on their own.
from qerl.quant.bf16 import BF16Format  # noqa: E402
from qerl.quant.finite import NonFiniteWeightError  # noqa: E402
from qerl.quant.mxfp4 import MXFP4Format  # noqa: E402
from qerl.quant.nf4 import NF4Format  # noqa: E402
from qerl.quant.nvfp4 import NVFP4Format  # noqa: E402

FORMATS: dict[str, QuantFormat] = {
    "bf16": BF16Format(),
    "nf4": NF4Format(),
    "mxfp4": MXFP4Format(),
    "nvfp4": NVFP4Format(),
}


def get_format(name: str) -> QuantFormat:
    """The registered handler for ``name``; a ValueError lists the valid names."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown weight format {name!r}; valid formats: {sorted(FORMATS)}") from None


__all__ = ["FORMATS", "QuantFormat", "NonFiniteWeightError", "get_format", "BF16Format", "NF4Format", "MXFP4Format",
           "NVFP4Format"]
