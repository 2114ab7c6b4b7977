"""What every weight format provides, and the pure-torch reference matmuls they share.

A format is one object (house rule 5, after gpt-fast's ``WeightOnlyInt4Linear``): it quantizes, dequantizes, runs
``linear(x, packed)`` / ``linear_t(g, packed)``, describes its compressed-tensors checkpoint scheme and how it is
drawn in figures. Options (MXFP4's ``scale_rule``) are constructor arguments, set in the format's YAML.

Fast kernels are not imported here (``qerl.quant`` is a leaf that imports only torch): a kernel package registers
itself with the format class that owns it through :func:`register_kernels` (``qerl.kernels`` does so for the FP4
family and NF4 when it is imported, which ``qerl.lora`` always does). A format without registered kernels, or whose
kernels decline an input (CPU, no Triton), runs the reference: ``dequantize`` then one matmul.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

#: How an NVFP4/MXFP4 base is held (``quant.layout``): the checkpoint's compressed-tensors tensors (plus the CUDA
#: kernels' copy where they run), only the CUDA kernels' re-laid-out copy (``qerl.kernels.relaid``), or ``auto``
#: (the default): kernel where the CUDA FP4 kernels run (an NVFP4/MXFP4 base on a GPU that builds them), else
#: compressed (the CPU, other formats); ``qerl.model.resolve_layout``.
LAYOUTS = ("auto", "compressed", "kernel")
KERNEL_LAYOUT_FORMATS = ("nvfp4", "mxfp4")  # the formats the CUDA kernels' layout can hold


@dataclass(frozen=True)
class CheckpointScheme:
    """How a format is written in a compressed-tensors checkpoint (what llm-compressor and vLLM read).

    ``compression``: the compressor name (``config_groups.*.format``); ``weights``: the ``QuantizationArgs`` as
    compressed-tensors serializes them into ``config.json``; ``tensors``: the packed tensors of one module
    (compressed-tensors' ``compression_param_names``), in the order it lists them; ``preset``: its scheme preset."""

    compression: str
    preset: str
    weights: dict = field(default_factory=dict)
    tensors: tuple[str, ...] = ()

    #: the QuantizationArgs keys that identify a scheme when reading a checkpoint (others, e.g. ``dynamic``, do not)
    MATCH = ("num_bits", "type", "strategy", "group_size", "symmetric")

    def matches(self, weights: Mapping, compression: str | None) -> bool:
        """True when a checkpoint group's weight args and compressor name are this scheme's."""
        if compression not in (None, self.compression):
            return False
        defaults = {"symmetric": True}  # compressed-tensors' default when a config leaves it out
        return all(str(weights.get(k, defaults.get(k))).lower() == str(self.weights.get(k)).lower()
                   for k in self.MATCH)


class Kernels(Protocol):
    """Fast paths of one format family, registered with :func:`register_kernels`.

    ``backend(fmt, x, q)`` names the path ``linear`` takes for ``x`` (None: the reference). ``linear``,
    ``linear_t`` and ``dequantize`` (Ŵ (N, K), into ``out`` when given) run the fast path, or return None when it
    does not take the input (CPU, no Triton, no bitsandbytes): the caller then runs the reference."""

    def backend(self, fmt, x: torch.Tensor, q: Mapping[str, torch.Tensor] | None = None) -> str | None: ...

    def linear(self, fmt, x: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor | None: ...

    def linear_t(self, fmt, g: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor | None: ...

    def dequantize(self, fmt, q: Mapping[str, torch.Tensor], out: torch.Tensor | None) -> torch.Tensor | None: ...


class QuantFormat(Protocol):
    """The interface of a weight format (see the module docstring)."""

    name: str                       # registry key, also what run records and checkpoints name
    block: int | None               # elements per scale block along K (K must be a multiple)
    label: str                      # display name in tables and figures ("NVFP4")
    color: str                      # its colour in every figure
    checkpoint: CheckpointScheme | None  # compressed-tensors scheme, None when it has none (bf16, nf4)
    fusable: bool                   # q|k|v and gate|up can share one packed buffer (fused decode)
    reference_backend: str          # the name ``backend`` reports for the reference path
    kernels: Kernels | None         # registered fast paths, None: reference only

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor: ...

    def linear_t(self, g: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor: ...

    def bits_per_weight(self, n: int, k: int) -> float: ...

    def check_shape(self, n: int, k: int) -> None: ...


def register_kernels(format_cls: type, kernels: Kernels) -> None:
    """Attach fast paths to every instance of ``format_cls`` (called by the kernel package that owns them)."""
    format_cls.kernels = kernels


def backend(fmt: QuantFormat, x: torch.Tensor, q: Mapping[str, torch.Tensor] | None = None) -> str:
    """Name of the path ``fmt.linear(x, q)`` takes: a registered kernel's, else ``fmt.reference_backend``."""
    k = fmt.kernels
    name = k.backend(fmt, x, q) if k is not None else None
    return name or fmt.reference_backend


def linear(fmt: QuantFormat, x: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """x (..., K) @ Ŵᵀ -> (..., N) in x's dtype: the registered fast path when it takes x, else the reference."""
    k = fmt.kernels
    y = k.linear(fmt, x, q) if k is not None else None
    return y if y is not None else F.linear(x, fmt.dequantize(q, x.dtype))


def linear_lora(fmt: QuantFormat, x: torch.Tensor, q: Mapping[str, torch.Tensor], lora,
                act: str | None = None) -> torch.Tensor | None:
    """x Ŵᵀ plus a LoRA term (``qerl.kernels.cuda_fp4.LoraOperand``: stacked A, (scaling·B)ᵀ, members; None: no
    LoRA) in one launch, when the format's kernels have such a path for x (NVFP4/MXFP4 at decode size on CUDA);
    None otherwise (the caller then runs ``linear`` and its own LoRA). ``act="silu_mul"``: the weight is a gate|up
    pair (gate rows, then as many up rows) and the launch returns silu(gate) · up, (..., N/2)."""
    fn = getattr(fmt.kernels, "linear_lora", None)
    if fn is None:
        return None
    return fn(fmt, x, q, lora) if act is None else fn(fmt, x, q, lora, act=act)


def wants_permuted(fmt: QuantFormat, q: Mapping[str, torch.Tensor], lora, m: int, device: torch.device) -> bool:
    """Whether :func:`linear_lora` on an (M, K) input on ``device`` would read it through a copy in a GEMM's own K
    order (the FP4 wgmma GEMM's), which the input's producer can write beside it (``qerl.kernels.permuted.tag_permuted``,
    ``qerl.kernels.fused.add_rms_norm(permuted=True)``) to save the permute launch; False for formats without it."""
    fn = getattr(fmt.kernels, "wants_permuted", None)
    return bool(fn is not None and lora is not None and fn(fmt, q, lora, m, device))


def linear_t(fmt: QuantFormat, g: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """g (..., N) @ Ŵ -> (..., K) in g's dtype (the input gradient of ``linear``)."""
    k = fmt.kernels
    y = k.linear_t(fmt, g, q) if k is not None else None
    return y if y is not None else torch.matmul(g, fmt.dequantize(q, g.dtype))


def dequantize_into(fmt: QuantFormat, q: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Ŵ (N, K): the registered fast path's (see ``qerl.kernels.dequantize_into`` for its buffer rules), else the
    reference in ``out``'s dtype (bfloat16 without ``out``), copied into ``out`` when given."""
    k = fmt.kernels
    w = k.dequantize(fmt, q, out) if k is not None else None
    if w is not None:
        return w
    w = fmt.dequantize(q, torch.bfloat16 if out is None else out.dtype)
    return w if out is None else out.copy_(w)


class FormatBase:
    """What the format classes share: identity by class and constructor options (``options`` names them),
    ``linear``/``linear_t`` through the registered kernels (else the reference), the block-shape check, and the
    shape checks of a weight about to be quantized."""

    options: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{o}={getattr(self, o)!r}' for o in self.options)})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and all(getattr(other, o) == getattr(self, o) for o in self.options)

    def __hash__(self) -> int:
        return hash((type(self), *(getattr(self, o) for o in self.options)))

    def linear(self, x: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """x (..., K) @ Ŵᵀ (registered kernels, else the reference: dequantize + matmul)."""
        return linear(self, x, q)

    def linear_t(self, g: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """g (..., N) @ Ŵ, the input gradient of ``linear``."""
        return linear_t(self, g, q)

    def check_shape(self, n: int, k: int) -> None:
        """Raise ValueError unless an (n, k) weight can be stored (non-empty, K a multiple of the block)."""
        check_block_shape(self, n, k)

    def checked_shape(self, w: torch.Tensor) -> tuple[int, int]:
        """(N, K) of a weight to quantize; ValueError unless it is 2-D and ``check_shape`` accepts it."""
        if w.dim() != 2:
            raise ValueError(f"{self.name} expects a 2-D weight (N, K), got shape {tuple(w.shape)}")
        n, k = w.shape
        self.check_shape(n, k)
        return n, k


def check_block_shape(fmt: QuantFormat, n: int, k: int) -> None:
    """Raise ValueError unless an (n, k) weight fits ``fmt``: non-empty, K a multiple of its block."""
    if n <= 0 or k <= 0 or (fmt.block and k % fmt.block):
        raise ValueError(
            f"{fmt.name} cannot quantize a weight of shape ({n}, {k}): the input dimension K={k} must be a "
            f"positive multiple of the block size {fmt.block}"
        )
