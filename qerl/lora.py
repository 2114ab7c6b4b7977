"""QuantLoRALinear: a frozen packed base weight plus a trainable low-rank update.

    y = x Ŵᵀ + b + (α/r) · dropout(x) Aᵀ Bᵀ        Ŵ = dequantize(packed), A: (r, K), B: (N, r)

The base is stored only in its packed format (compressed-tensors / bitsandbytes tensors registered as
buffers, so a state dict carries the checkpoint names) beside the format object that owns it (``self.fmt``).
Ŵ is rebuilt inside every forward by ``fmt.linear`` and again in the backward by ``fmt.linear_t``
(grad_input = grad_out · Ŵ; the fast kernels of ``qerl.kernels`` are registered with their formats on import):
no BF16 copy of a quantized weight outlives the matmul that needs it. The official QeRL code keeps the
forward's dequantized weight alive for the backward, which costs a full BF16 copy per layer in flight.

``swap_linears`` turns a Hugging Face Qwen2/Llama causal LM into a QeRL policy in place.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import qerl.kernels  # noqa: F401  (registers the fast paths with the formats that own them)
from qerl.arch import BLOCK_NORMS, DEFAULT_TARGETS
from qerl.kernels.fused import lora_a
from qerl.quant import QuantFormat, get_format
from qerl.quant.base import linear_lora


@dataclass(frozen=True)
class LoraSpec:
    """LoRA hyper-parameters. ``rank=32`` is the paper's; the official scripts use 16/16."""

    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.targets if t not in DEFAULT_TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA target(s) {bad}; valid: {list(DEFAULT_TARGETS)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class _FrozenBaseMatmul(torch.autograd.Function):
    """x Ŵᵀ (+ a frozen bias, added in place) with Ŵ frozen and rebuilt from packed storage in the forward and again
    in the backward."""

    @staticmethod
    def forward(ctx, x, fmt: QuantFormat, q: Mapping[str, torch.Tensor], bias: torch.Tensor | None = None):
        ctx.fmt, ctx.q = fmt, q  # references to the module's buffers: nothing new is kept alive
        y = fmt.linear(x, q)
        if bias is not None:  # y is this call's own output: no extra (M, N) tensor for the bias
            y.add_(bias.to(y.dtype))
        return y

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = ctx.fmt.linear_t(grad_out, ctx.q) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """y + scaling · (x Aᵀ) Bᵀ with the B product, the scaling and the sum in one cuBLAS call (``torch.addmm``'s
    alpha and beta = 1 in the GEMM epilogue, float32 accumulation): no (M, N) LoRA output, no scaled copy and no
    separate sum are written, and the backward scales only the (M, r) and (r, N) gradients. Differentiable in y,
    x, a and b. y (..., N), x (..., K), a (r, K), b (N, r)."""
    n, r = b.shape
    xa = F.linear(x, a).reshape(-1, r)
    return torch.addmm(y.reshape(-1, n), xa, b.t(), alpha=scaling).view(*y.shape)


def lora_rows_enabled() -> bool:
    """BF16 + LoRA: whether the base weight's spare A rows (``qerl.fastdecode.reserve_lora_rows``) are made at load
    and used at inference; ``QERL_LORA_ROWS=0`` turns both off (the decode mode ``fused-split-lora`` sets it, for
    same-process comparisons: LoRA as its own launches)."""
    return os.environ.get("QERL_LORA_ROWS", "1") != "0"


def rows_product(x: torch.Tensor, ext: torch.Tensor, n: int, bt: torch.Tensor, bias: torch.Tensor | None = None):
    """x (M, K) · Wᵀ + (x·Aᵀ)·Bt (+ bias) from ``ext`` = [W; A] ((N + R, K), ``qerl.fastdecode.reserve_lora_rows``):
    one GEMM gives x·Wᵀ and x·Aᵀ side by side, one addmm adds the LoRA term to the first ``n`` columns. Returns
    that (M, N) view, its rows N + R apart."""
    ye = F.linear(x, ext)
    y = ye[:, :n]
    y.addmm_(ye[:, n:], bt)
    if bias is not None:
        y.add_(bias.to(y.dtype))
    return y


class QuantLoRALinear(nn.Module):
    """Frozen packed base (any format of ``qerl.quant.FORMATS``, or one built with options) + trainable LoRA A/B.

    ``fmt`` is the format object (a registered name is looked up); the module calls it for every matmul.

    ``rank=0`` (``lora=None``) gives a frozen quantized linear with no adapter (base-model evaluation).
    LoRA weights are kept in ``lora_dtype`` (fp32 by default, as PEFT's k-bit preparation does) and cast to
    the activation dtype in the forward.
    """

    def __init__(self, fmt: QuantFormat | str, q: Mapping[str, torch.Tensor], in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, lora: LoraSpec | None = None,
                 lora_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fmt = get_format(fmt)
        self.in_features, self.out_features = in_features, out_features
        self._qnames = tuple(q)
        for name, t in q.items():
            self.register_buffer(name, t)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._lora_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lora_op = None  # the cache as one LoRA operand of the fused GEMV (qerl.kernels.cuda_fp4.LoraOperand)
        self.rank = 0 if lora is None else lora.rank
        self.scaling = 0.0 if lora is None else lora.scaling
        if lora is not None:
            dev = next(iter(q.values())).device
            self.lora_A = nn.Linear(in_features, lora.rank, bias=False, device=dev, dtype=lora_dtype)
            self.lora_B = nn.Linear(lora.rank, out_features, bias=False, device=dev, dtype=lora_dtype)
            self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
            self.reset_lora()

    @property
    def packed(self) -> dict[str, torch.Tensor]:
        """The packed base tensors by name, as held: the checkpoint's, or the CUDA kernels' re-laid-out copy
        (``quant.layout=kernel``, ``qerl.kernels.relaid``)."""
        return {n: getattr(self, n) for n in self._qnames}

    def compressed(self) -> dict[str, torch.Tensor]:
        """The base as its compressed-tensors checkpoint tensors (converted back when held re-laid out)."""
        from qerl.kernels import relaid

        return relaid.to_compressed(self.fmt, self.packed)

    def set_base(self, q: Mapping[str, torch.Tensor]) -> None:
        """Hold ``q`` as the packed base instead of the current tensors (same weights, e.g. re-laid out)."""
        for n in self._qnames:
            del self._buffers[n]
        self._qnames = tuple(q)
        for n, t in q.items():
            self.register_buffer(n, t)
        for n in [n for n in self._buffers if n not in q]:  # the base first, as at construction (state dict order)
            self._buffers[n] = self._buffers.pop(n)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        from qerl.kernels import relaid

        held = relaid.is_relaid(self.packed)
        if held:  # a state dict always holds the checkpoint's tensors (first, as they would be)
            for n, t in self.compressed().items():
                destination[prefix + n] = t
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if held:
            for n in relaid.NAMES:
                destination.pop(prefix + n, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        from qerl.kernels import relaid

        if relaid.is_relaid(self.packed) and prefix + "weight_packed" in state_dict:
            # a state dict holds the checkpoint's tensors: they must be the base this module holds (the kernels'
            # layout is made once, at load; a different base is loaded with quant.layout=compressed)
            mine = self.compressed()
            for n, t in mine.items():
                got = state_dict.get(prefix + n)
                if got is None or got.shape != t.shape or got.dtype != t.dtype or not torch.equal(
                        got.detach().to(t.device).view(torch.uint8), t.view(torch.uint8)):
                    error_msgs.append(f"{prefix}{n}: this module holds its base in the CUDA kernels' layout "
                                      f"(quant.layout=kernel) and the state dict has a different base; load it into "
                                      f"a model built with quant.layout=compressed")
            state_dict = {k: v for k, v in state_dict.items()
                          if not (k.startswith(prefix) and k[len(prefix):] in mine)}
            state_dict.update({prefix + n: getattr(self, n) for n in self._qnames})
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def reset_lora(self) -> None:
        """PEFT's default init: A ~ kaiming-uniform(a=√5), B = 0, so the adapter starts as the identity."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Ŵ as a dense (N, K) tensor (for export and tests; the forward never keeps it)."""
        return self.fmt.dequantize(self.compressed(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., K) -> (..., N)
        if self._lora_cache is not None and not torch.is_grad_enabled():
            return self._forward_inference(x)
        y = _FrozenBaseMatmul.apply(x, self.fmt, self.packed, self.bias)
        if self.rank and (self.scaling or torch.is_grad_enabled()):  # (scaling 0: adapters_disabled, no grad)
            a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
            y = add_lora(y, self.lora_dropout(x), a, b, self.scaling)
        return y

    def _forward_inference(self, x: torch.Tensor) -> torch.Tensor:
        """Rollout path (no grad, inside ``lora_inference_cache``): fewer kernels per call, same function —
        bias added in place, LoRA as x·Aᵀ then one in-place addmm with the pre-scaled, pre-cast (α/r)·Bᵀ."""
        op = self._lora_op
        if op is not None and op.a.dtype == x.dtype:  # base and LoRA in one launch where the format has it
            y = linear_lora(self.fmt, x, self.packed, op)
            if y is not None:
                if self.bias is not None:
                    y.add_(self.bias.to(y.dtype))
                return y
        ext = getattr(self, "_lora_ext", None)
        if (ext is not None and self.rank and x.dtype == ext.dtype and ext.data_ptr() == self.weight.data_ptr()
                and self._lora_cache[0].data_ptr() == self._lora_rows.data_ptr() and lora_rows_enabled()):
            # BF16 with reserve_lora_rows: x·[W; A]ᵀ in one GEMM, then the LoRA term on its first N columns
            y = rows_product(x.reshape(-1, self.in_features), ext, self.out_features, self._lora_cache[1], self.bias)
            return y.unflatten(0, x.shape[:-1])                              # (..., N), rows N + r apart
        y = self.fmt.linear(x, self.packed)                                  # (..., N)
        if self.bias is not None:
            y.add_(self.bias.to(y.dtype))
        if self.rank:
            a, bt = self._lora_cache
            if a.dtype != x.dtype:
                a, bt = a.to(x.dtype), bt.to(x.dtype)
            xa = lora_a(x.reshape(-1, self.in_features), a)                     # (M, r)
            y.view(-1, self.out_features).addmm_(xa, bt)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt.name}, "
                f"rank={self.rank}, scaling={self.scaling:g}, bias={self.bias is not None}")


class MasterRMSNorm(nn.Module):
    """RMSNorm with an fp32 master weight, output in the input dtype.

    Used for the per-block norms when they are trained (official ``--ln True``): an update of ~1e-5 to a
    bf16 weight near 1.0 rounds away (bf16 spacing there is 2⁻⁷), so the trainable copy must be fp32.
    With a bf16-representable weight this computes exactly what Qwen2RMSNorm/LlamaRMSNorm compute.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().clone())
        self.variance_epsilon = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # dt(w · dt(x · rsqrt(mean(x²) + eps))), fused on the GPU
        from qerl.kernels.train_fused import rms_norm

        return rms_norm(h, self.weight, self.variance_epsilon)


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def target_linear_names(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> list[str]:
    """Names of the decoder linears to quantize/adapt (never ``lm_head`` or embeddings)."""
    targets = set(targets)
    names = [n for n, m in model.named_modules()
             if isinstance(m, (nn.Linear, QuantLoRALinear)) and n.rpartition(".")[2] in targets]
    if not names:
        raise ValueError(f"no linear layers named {sorted(targets)} found in {type(model).__name__}")
    return names


def quantize_linear(linear: nn.Linear, fmt: QuantFormat | str, lora: LoraSpec | None,
                    lora_dtype: torch.dtype = torch.float32) -> QuantLoRALinear:
    """Round-to-nearest quantize one ``nn.Linear`` into a ``QuantLoRALinear`` on the same device."""
    f = get_format(fmt)
    n, k = linear.weight.shape
    f.check_shape(n, k)
    with torch.no_grad():
        q = f.quantize(linear.weight.detach())
    return QuantLoRALinear(f, q, k, n, linear.bias, lora, lora_dtype)


def swap_linears(model: nn.Module, fmt: QuantFormat | str, lora: LoraSpec | None, train_norms: bool = False,
                 targets: Iterable[str] | None = None, lora_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace the target linears of a Qwen2/Llama causal LM by ``QuantLoRALinear`` (in place).

    Everything else is frozen: embeddings and ``lm_head`` stay in the model dtype (as QeRL). With
    ``train_norms`` the per-block RMSNorm weights become trainable fp32 parameters (``MasterRMSNorm``).
    Each original dense weight is freed as soon as it is quantized.
    """
    targets = tuple(targets or (lora.targets if lora else DEFAULT_TARGETS))
    for name in target_linear_names(model, targets):
        mod = model.get_submodule(name)
        if isinstance(mod, nn.Linear):
            _set_module(model, name, quantize_linear(mod, fmt, lora, lora_dtype))
            del mod
    finalize_trainable(model, train_norms)
    return model


def finalize_trainable(model: nn.Module, train_norms: bool) -> None:
    """Freeze all but LoRA (and, with ``train_norms``, the per-block norms as fp32 masters)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, QuantLoRALinear) and m.rank:
            m.lora_A.weight.requires_grad_(True)
            m.lora_B.weight.requires_grad_(True)
    if train_norms:
        for name, m in list(model.named_modules()):
            if name.rpartition(".")[2] in BLOCK_NORMS:
                if not isinstance(m, MasterRMSNorm):
                    eps = getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6))
                    m = MasterRMSNorm(m.weight, eps)
                    _set_module(model, name, m)
                m.weight.requires_grad_(True)


def _lora_operand(owner, a: torch.Tensor, bts: list[torch.Tensor | None], members: list[tuple[int, int]]):
    """The fused GEMV's LoRA operand: ``a`` and the members' (scaling·B)ᵀ ``bts`` laid out as Bn in a buffer kept on
    ``owner`` (``_lora_bn``, reused in place: captured graphs keep its address); None where the kernel cannot take
    them (not on CUDA, not bf16, too many ranks or members, member rows not multiples of 16)."""
    from qerl.kernels.fp4_layout import LORA_MAX_RANKS, LoraOperand, lora_bn, lora_rp
    if (not a.is_cuda or a.dtype != torch.bfloat16 or not 1 <= a.shape[0] <= LORA_MAX_RANKS or len(members) > 3
            or any(n % 16 for n, _ in members)):
        return None
    shape = (sum(n for n, _ in members), lora_rp(members))
    buf = getattr(owner, "_lora_bn", None)
    if buf is None or tuple(buf.shape) != shape or buf.device != a.device:
        buf = torch.zeros(shape, dtype=torch.bfloat16, device=a.device)
        owner._lora_bn = buf
    return LoraOperand(a, lora_bn(bts, members, out=buf), members)


@contextlib.contextmanager
def lora_inference_cache(model: nn.Module, dtype: torch.dtype):
    """Inside the block, LoRA A/B are read from copies cast to ``dtype`` once, not re-cast every forward
    (a decode step would otherwise re-read the fp32 masters of every layer). No gradients flow through them."""
    mods = list(lora_modules(model).values())
    try:
        with torch.no_grad():
            for m in mods:  # persistent buffers, updated in place: captured CUDA graphs keep their addresses
                if not m.rank:
                    m._lora_cache = ()  # marks the inference path for adapter-free (base) modules
                    continue
                buf = getattr(m, "_lora_cast_buf", None)
                if buf is None or buf[0].dtype != dtype or buf[0].device != m.lora_A.weight.device:
                    bt = torch.empty((m.rank, m.out_features), dtype=dtype, device=m.lora_B.weight.device)
                    rows = getattr(m, "_lora_rows", None)  # BF16: A's rows after the base weight's (reserve_lora_rows)
                    a = rows if rows is not None and rows.dtype == dtype and rows.device == bt.device else \
                        torch.empty_like(m.lora_A.weight, dtype=dtype)
                    buf = (a, bt)
                    m._lora_cast_buf = buf
                buf[0].copy_(m.lora_A.weight)
                buf[1].copy_((m.lora_B.weight * m.scaling).t())  # (r, N): scaling folded in once
                m._lora_cache = buf
                m._lora_op = _lora_operand(m, buf[0], [buf[1]], [(m.out_features, m.rank)])
        yield
    finally:
        for m in mods:
            m._lora_cache = None
            m._lora_op = None


def lora_modules(model: nn.Module) -> dict[str, QuantLoRALinear]:
    """All ``QuantLoRALinear`` modules by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLoRALinear)}


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def packed_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every packed base tensor by full name (for the 'base is bit-identical after a step' invariant)."""
    out = {}
    for name, m in lora_modules(model).items():
        for k, t in m.packed.items():
            out[f"{name}.{k}"] = t
    return out


def resident_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every parameter and buffer held by the model, split into quantized base / other / trainable."""
    seen, out = set(), {"quantized_base": 0, "other_frozen": 0, "trainable": 0}
    qids = {id(t) for t in packed_state(model).values()}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        if id(t) in qids:
            out["quantized_base"] += nbytes
        elif isinstance(t, nn.Parameter) and t.requires_grad:
            out["trainable"] += nbytes
        else:
            out["other_frozen"] += nbytes
    out["total"] = sum(out.values())
    return out
