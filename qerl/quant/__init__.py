"""Weight formats: one module per format, registered in ``FORMATS``; the format object is the unit that runs.

A format (house rule 5; interface in ``qerl.quant.base.QuantFormat``)::

    fmt = FORMATS["nvfp4"]            # or build("mxfp4", {"scale_rule": "floor"}): options are constructor args
    q = fmt.quantize(w)               # w: (N, K) float tensor  ->  dict[str, Tensor] (packed, compressed-tensors names)
    w_hat = fmt.dequantize(q, dtype)  # -> (N, K) tensor in `dtype`, pure torch, CPU or GPU
    y = fmt.linear(x, q)              # x Ŵᵀ: registered fast kernels, else dequantize + matmul
    gx = fmt.linear_t(g, q)           # g Ŵ (the backward)
    fmt.bits_per_weight(N, K)         # storage cost, scales included
    fmt.checkpoint                    # compressed-tensors scheme (compressor, weight args, tensor names) or None
    fmt.label, fmt.color, fmt.fusable # display name and colour; whether fused decode concatenates q|k|v

Adding a format: its module here, one line in ``FORMATS``, ``qerl/conf/quant/<name>.yaml``, its tests.

Packed tensor names follow the compressed-tensors checkpoint layout so checkpoints move between
qerl, llm-compressor and vLLM without conversion:

* ``nvfp4``: ``weight_packed`` uint8 (N, K/2) (low nibble = even element), ``weight_scale`` float8_e4m3fn
  (N, K/16), ``weight_global_scale`` float32 (1,) (compressed-tensors' convention: the divisor).
* ``mxfp4``: ``weight_packed`` uint8 (N, K/2), ``weight_scale`` uint8 E8M0 exponents (N, K/32).
* ``mxfp4`` takes a ``scale_rule`` (``MXFP4Format(scale_rule="floor")``); ``FORMATS`` holds compressed-tensors' rule.
* ``nf4``: bitsandbytes NF4 (blocksize 64, double quantization): ``weight_packed`` uint8 (N*K/2, 1) (bnb's
  ``weight``, even element in the high nibble) + QuantState names ``absmax``, ``quant_map``, ``nested_absmax``,
  ``nested_quant_map``, ``nested_offset``, and ``weight_shape``; ``nf4.to_bnb_quant_state`` rebuilds bnb's state.
* ``int4``: ``weight_packed`` int32 (N, K/8) (eight codes q+8 per word), ``weight_scale`` (N, K/128) in the
  weight's dtype, ``weight_shape`` int64 (2,) (compressed-tensors ``pack-quantized``, W4A16).
* ``bf16``: ``weight`` (N, K) bfloat16.

Every ``quantize`` raises ``NonFiniteWeightError`` (a ``UserError``) on a weight holding inf/NaN: no format can store
them, and each would otherwise corrupt the tensor silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from qerl.errors import UserError
from qerl.quant.base import CheckpointScheme, QuantFormat, register_kernels
from qerl.quant.bf16 import BF16Format
from qerl.quant.finite import NonFiniteWeightError
from qerl.quant.int4 import INT4Format
from qerl.quant.mxfp4 import MXFP4Format
from qerl.quant.nf4 import NF4Format
from qerl.quant.nvfp4 import NVFP4Format

FORMATS: dict[str, QuantFormat] = {
    "bf16": BF16Format(),
    "nf4": NF4Format(),
    "mxfp4": MXFP4Format(),
    "nvfp4": NVFP4Format(),
    "int4": INT4Format(),
}


def get_format(fmt) -> QuantFormat:
    """The registered format named ``fmt`` (a format object is returned as it is); a ``UserError`` names the value
    and lists the valid names."""
    if not isinstance(fmt, str) and hasattr(fmt, "quantize") and hasattr(fmt, "dequantize"):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise UserError(f"unknown weight format {fmt!r}; valid formats: {sorted(FORMATS)}") from None


def options_of(name: str) -> list[str]:
    """The constructor options the format ``name`` takes (e.g. ``['scale_rule']`` for mxfp4)."""
    sig = inspect.signature(type(get_format(name)).__init__)
    return [p for p in sig.parameters if p != "self" and sig.parameters[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def build(name: str, options: Mapping | None = None) -> QuantFormat:
    """The format ``name`` with constructor ``options`` (the registered instance when there are none).
    A ``UserError`` names an unknown format, an option the format does not take, or a bad option value."""
    f = get_format(name)
    opts = dict(options or {})
    if not opts:
        return f
    valid = options_of(name)
    bad = sorted(set(opts) - set(valid))
    if bad:
        raise UserError(f"quantization option(s) {bad} do not apply to {name!r}; its options: {valid}")
    try:
        return type(f)(**opts)
    except ValueError as e:
        raise UserError(f"{name} options {opts}: {e}") from None


__all__ = ["FORMATS", "QuantFormat", "CheckpointScheme", "NonFiniteWeightError", "get_format", "build", "options_of",
           "register_kernels", "BF16Format", "NF4Format", "MXFP4Format", "NVFP4Format", "INT4Format"]
