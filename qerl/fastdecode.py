"""Fused projections for the sampler: q|k|v and gate|up as one packed matmul each, LoRA included.

vLLM and llm-compressor treat q/k/v and gate/up as one linear each (one NVFP4 global scale per group,
``qerl.arch.FUSED_GROUPS``). qerl keeps one ``QuantLoRALinear`` per projection (the training graph, PEFT
adapters and compressed-tensors checkpoints are per projection) but, at load time,
:func:`fuse_projection_storage` places each group's packed tensors in one buffer, row block after row block,
and leaves every module a view of its block. Nothing is copied twice and every module works as before; the
sampler's decode step (``qerl.rollout``) then reads a group as one weight:

* :func:`concat_rows` recovers the whole buffer from the modules' views (and returns None if they are not
  consecutive blocks of one storage any more — e.g. someone replaced a buffer — so nothing stale is read);
* :class:`FusedLinear` runs ``qmm`` once over the group, then its LoRA as ``x·[A_q;A_k;A_v]ᵀ`` and one
  ``addmm_`` with the block-diagonal, pre-scaled ``Bᵀ``: 3 launches instead of 3 per projection; where the format
  has a one-launch path (NVFP4/MXFP4 at decode size: ``qerl.quant.base.linear_lora``), base and LoRA are one.

Formats whose packing is per tensor (``fmt.fusable`` False: NF4's nested absmax blocks, INT4's ``weight_shape``)
are not concatenated; their ``FusedLinear`` calls the modules one by one and concatenates the outputs.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from qerl.arch import FUSED_GROUPS
from qerl.kernels.fused import lora_a, silu_mul
from qerl.lora import QuantLoRALinear, _lora_operand, lora_rows_enabled, rows_product
from qerl.quant.base import linear_lora, wants_permuted


def _row_tensors(mods: list[QuantLoRALinear]) -> tuple[list[str], list[str]] | None:
    """(names stacked by rows, names shared by value) of the group's packed tensors, or None if unfusable."""
    m0 = mods[0]
    if not m0.fmt.fusable or any(m.fmt != m0.fmt or m._qnames != m0._qnames or
                                          m.in_features != m0.in_features for m in mods):
        return None
    rows, shared = [], []
    for name in m0._qnames:
        ts = [getattr(m, name) for m in mods]
        if any(t.device != ts[0].device or t.dtype != ts[0].dtype for t in ts):
            return None
        per = 16 if name in ("weight_relaid", "weight_relaid_scale") else 1  # the kernels' layout: 16-row strips
        if all(t.dim() >= 1 and t.shape[0] * per == m.out_features and t.shape[1:] == ts[0].shape[1:]
               for t, m in zip(ts, mods, strict=True)):
            rows.append(name)
        elif all(t.shape == ts[0].shape and torch.equal(t, ts[0]) for t in ts):
            shared.append(name)  # e.g. NVFP4's weight_global_scale, one per group
        else:
            return None
    return rows, shared


def _cat_rows(ts: list[torch.Tensor]) -> torch.Tensor:
    if ts[0].dtype.itemsize == 1 and ts[0].is_floating_point():  # float8 scales: concatenate the bytes
        return torch.cat([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)
    return torch.cat(ts)


@torch.no_grad()
def fuse_projection_storage(model: nn.Module) -> int:
    """Give every q/k/v and gate/up group of ``QuantLoRALinear`` one shared buffer per packed tensor (each
    module keeps a view of its rows). Values are unchanged. Returns the number of groups fused."""
    fused = 0
    for parent in model.modules():
        for _, names in FUSED_GROUPS.values():
            mods = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, QuantLoRALinear) for m in mods):
                continue
            split = _row_tensors(mods)
            if split is None:
                continue
            for name in split[0]:
                whole = _cat_rows([getattr(m, name) for m in mods])
                off = 0
                for m in mods:
                    m._buffers[name] = whole[off:off + m.out_features]
                    off += m.out_features
                if whole.is_cuda:  # hand the members' old blocks back: cached, they cannot hold the next group's
                    del whole      # (larger) buffer, and a 32B BF16 load would grow by one group per layer (OOM)
                    torch.cuda.empty_cache()
            fused += 1
    return fused


def _decode_units(model: nn.Module, ok, group_ok=lambda mods: True):
    """The modules to convert, as lists: each q|k|v and gate|up group whose members all pass ``ok`` (and the group
    ``group_ok``) as one list, then every other module that passes ``ok`` alone. Lazy: ``ok`` is asked as the
    caller goes (after a group is converted its members are not offered again)."""
    done: set[int] = set()
    for parent in model.modules():
        for _, names in FUSED_GROUPS.values():
            mods = [getattr(parent, n, None) for n in names]
            if all(ok(m) for m in mods) and group_ok(mods) and not any(id(m) in done for m in mods):
                done.update(id(m) for m in mods)
                yield mods
    for m in model.modules():
        if id(m) not in done and ok(m):
            yield [m]


def _rows_eligible(m) -> bool:
    return (isinstance(m, QuantLoRALinear) and m.rank > 0 and m.fmt.name == "bf16" and m._qnames == ("weight",)
            and m.weight.dtype == torch.bfloat16 and m.lora_A.weight.device == m.weight.device)


@torch.no_grad()
def reserve_lora_rows(model: nn.Module) -> int:
    """BF16 bases with LoRA: give each decode product — the q|k|v and gate|up groups (one buffer each, as
    :func:`fuse_projection_storage` made them) and every other adapted linear — R spare rows after its weight rows,
    where ``qerl.lora.lora_inference_cache`` puts the cast LoRA A. Then x·[W; A]ᵀ is one GEMM that gives the base
    output and x·Aᵀ side by side, and the LoRA term is one ``addmm`` on its first N columns: two launches per product
    instead of three (the profile of the BF16 decode step at batch 8 had 112 ``x·Aᵀ`` launches, ~0.6 ms of ~7.3).
    Values are unchanged; the members keep views of their rows. Returns the number of buffers made (0 with
    ``QERL_LORA_ROWS=0``, for other formats, or without LoRA)."""
    if not lora_rows_enabled():
        return 0
    made = 0
    for mods in _decode_units(model, _rows_eligible):
        w = concat_rows([m.weight for m in mods]) if len(mods) > 1 else mods[0].weight
        if w is None or not w.is_contiguous():
            continue
        n, r = sum(m.out_features for m in mods), sum(m.rank for m in mods)
        buf = torch.empty((n + r, w.shape[1]), dtype=w.dtype, device=w.device)
        buf[:n].copy_(w)
        buf[n:].zero_()
        off, roff = 0, n
        for m in mods:
            m._buffers["weight"] = buf[off:off + m.out_features]
            m._lora_rows = buf[roff:roff + m.rank]  # lora_inference_cache casts A into these rows
            m._lora_ext = buf if len(mods) == 1 else None  # a module alone: its own x·[W; A]ᵀ (o_proj, down_proj)
            off, roff = off + m.out_features, roff + m.rank
        made += 1
        del w
        if buf.is_cuda:  # as in fuse_projection_storage: hand the old block back before the next one is made
            torch.cuda.empty_cache()
    return made


def _ext_rows(mods: list[QuantLoRALinear]) -> torch.Tensor | None:
    """The group's [W; A] buffer ((N + R, K), one storage) when :func:`reserve_lora_rows` made one for exactly
    these members, else None."""
    rows = [getattr(m, "_lora_rows", None) for m in mods]
    if any(r is None for r in rows):
        return None
    w = concat_rows([m.weight for m in mods])
    a = concat_rows(rows)
    if w is None or a is None or a.data_ptr() != w.data_ptr() + w.numel() * w.element_size():
        return None
    return concat_rows([w, a])


@torch.no_grad()
def relayout_model(model: torch.nn.Module) -> dict[str, int]:
    """Keep only the CUDA kernels' layout of every NVFP4/MXFP4 ``QuantLoRALinear`` of ``model`` (fused q|k|v and
    gate|up groups as one weight, members as row views). Returns counts: ``converted`` linears and ``kept`` (could
    not be converted exactly: they keep the compressed-tensors tensors). Values are unchanged (every product reads
    the same weights)."""
    from qerl.kernels import relaid
    from qerl.kernels.relaid import from_compressed, is_relaid, note_bexp

    stats = {"converted": 0, "kept": 0}

    def eligible(m) -> bool:
        if not isinstance(m, QuantLoRALinear):
            return False
        try:
            relaid._encoding(m.fmt)
        except (ValueError, AttributeError):
            return False
        return not is_relaid(m.packed)

    def convert(mods: list) -> None:
        qs = [m.packed for m in mods]
        if len(mods) > 1:
            whole = {}
            for name in qs[0]:
                if name == "weight_global_scale":  # one per group (or the members go one by one)
                    same = all(torch.equal(q[name], qs[0][name]) for q in qs)
                    cat = qs[0][name] if same else None
                else:
                    cat = concat_rows([q[name] for q in qs])
                if cat is None:  # not one buffer any more: convert the members one by one
                    for m in mods:
                        convert([m])
                    return
                whole[name] = cat
        else:
            whole = qs[0]
        new = from_compressed(mods[0].fmt, whole)
        if new is None:
            stats["kept"] += len(mods)
            return
        note_bexp(new["weight_relaid"], int(new["weight_relaid_bexp"][0]))
        s0 = 0
        for m in mods:
            s1 = s0 + m.out_features // 16
            mine = {n: (t if n in ("weight_global_scale", "weight_relaid_bexp") else t[s0:s1]) for n, t in new.items()}
            m.set_base(mine)
            s0 = s1
        stats["converted"] += len(mods)

    for mods in _decode_units(model, eligible, lambda mods: all(m.out_features % 16 == 0 for m in mods)):
        convert(mods)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stats


def concat_rows(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row blocks are ``ts`` (a view, no copy), or None if they are not
    consecutive contiguous blocks of one storage."""
    t0 = ts[0]
    off = t0.storage_offset()
    for t in ts:
        if (not t.is_contiguous() or t.dtype != t0.dtype or t.shape[1:] != t0.shape[1:]
                or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() or t.storage_offset() != off):
            return None
        off += t.numel()
    return t0.as_strided((sum(t.shape[0] for t in ts), *t0.shape[1:]), t0.stride(), t0.storage_offset())


class FusedLinear:
    """One group (q|k|v or gate|up) of ``QuantLoRALinear`` modules as a single linear, for inference inside
    ``qerl.lora.lora_inference_cache``. Output columns are the members' outputs side by side.

    ``defer_bias``: leave the bias to the caller (the fused RoPE kernel adds it); :attr:`pending_bias` is
    what the caller must add (None when the members already added their own)."""

    def __init__(self, mods: list[QuantLoRALinear], defer_bias: bool = False):
        self.mods = mods
        self.fmt = mods[0].fmt
        self.out_features = sum(m.out_features for m in mods)
        split = _row_tensors(mods)
        self.q = None
        if split is not None:
            q = {n: concat_rows([getattr(m, n) for m in mods]) for n in split[0]}
            if all(v is not None for v in q.values()):
                q.update({n: getattr(mods[0], n) for n in split[1]})
                self.q = {n: q[n] for n in mods[0]._qnames}  # the checkpoint's key order
        self.device = next(iter(mods[0].packed.values())).device
        self.bias = self._stacked_bias() if self.q is not None else None
        self.defer_bias = defer_bias
        self.ranks = [m.rank for m in mods]
        self.A = self.Bt = None
        self.lora = None  # A and Bt as the fused GEMV's LoRA operand (base and LoRA in one launch)
        # BF16 with reserve_lora_rows: [W; A] as one buffer, so x·Wᵀ and x·Aᵀ are one GEMM (rows_live: A is there)
        self.ext = _ext_rows(mods) if self.q is not None and any(self.ranks) else None
        self.rows = self.ext[self.out_features:] if self.ext is not None else None  # the members' A rows
        self.rows_live = False
        self._sig = self.signature()

    @property
    def concatenated(self) -> bool:
        """True when the group runs as one matmul (False: member by member, then concatenated)."""
        return self.q is not None

    @property
    def pending_bias(self) -> torch.Tensor | None:
        return self.bias if (self.defer_bias and self.bias is not None) else None

    def _stacked_bias(self) -> torch.Tensor | None:
        """The members' biases side by side (zeros for a member without one), or None if none has one."""
        have = [m.bias for m in self.mods if m.bias is not None]
        if not have:
            return None
        return torch.cat([m.bias if m.bias is not None else have[0].new_zeros(m.out_features) for m in self.mods])

    def signature(self) -> tuple:
        """Addresses the captured graphs depend on (the members' packed tensors)."""
        return tuple((t.data_ptr(), tuple(t.shape)) for m in self.mods for t in m.packed.values())

    def stale(self) -> bool:
        """True if a member's packed tensors moved since this plan was built (rebuild before use)."""
        return self.signature() != self._sig

    @torch.no_grad()
    def refresh(self, dtype: torch.dtype) -> None:
        """Copy the members' current LoRA (cast, pre-scaled: ``_lora_cache``) and bias into the fused
        buffers, in place (captured graphs keep their addresses)."""
        if self.bias is not None:
            self.bias.copy_(self._stacked_bias())
        if not any(self.ranks):
            return
        R, K = sum(self.ranks), self.mods[0].in_features
        self.rows_live = (self.ext is not None and self.ext.dtype == dtype and lora_rows_enabled() and all(
            m._lora_cache and m._lora_cache[0].data_ptr() == m._lora_rows.data_ptr() for m in self.mods if m.rank))
        if self.rows_live and self.A is not self.rows:
            self.A = self.rows  # lora_inference_cache has put every member's A there
            self.Bt = torch.zeros((R, self.out_features), dtype=dtype, device=self.device)
        elif not self.rows_live and (self.A is None or self.A is self.rows or self.A.dtype != dtype):
            self.A = torch.zeros((R, K), dtype=dtype, device=self.device)
            self.Bt = torch.zeros((R, self.out_features), dtype=dtype, device=self.device)
        r0 = c0 = 0
        for m in self.mods:
            if m.rank:
                if not m._lora_cache:
                    raise RuntimeError("FusedLinear.refresh needs qerl.lora.lora_inference_cache to be active")
                a, bt = m._lora_cache
                if not self.rows_live:
                    self.A[r0:r0 + m.rank].copy_(a)
                self.Bt[r0:r0 + m.rank, c0:c0 + m.out_features].copy_(bt)  # off-diagonal blocks stay 0
                r0 += m.rank
            c0 += m.out_features
        bts = [m._lora_cache[1] if m.rank else None for m in self.mods]
        self.lora = _lora_operand(self, self.A, bts, [(m.out_features, m.rank) for m in self.mods])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: (M, K) -> (M, sum N)
        if self.q is None:
            return torch.cat([m(x) for m in self.mods], dim=-1)
        y = linear_lora(self.fmt, x, self.q, self.lora) if self.lora is not None else None  # one launch (the GEMV)
        if y is None and self.rows_live and x.dtype == self.ext.dtype:
            # BF16 above the GEMV's M: one GEMM for x·[W; A]ᵀ, one addmm (a row-strided view)
            return rows_product(x, self.ext, self.out_features, self.Bt, None if self.defer_bias else self.bias)
        if y is None:  # no one-launch path for this format / M: the base, then x·Aᵀ and one addmm
            y = self.fmt.linear(x, self.q)
            if self.A is not None:
                y.addmm_(lora_a(x, self.A), self.Bt)
        if self.bias is not None and not self.defer_bias:
            y.add_(self.bias.to(y.dtype))
        return y

    def silu_mul(self, x: torch.Tensor, permuted: bool = False) -> torch.Tensor:
        """silu(gate) · up of a gate|up group (M, I): in the GEMV's epilogue where the format has that path (the
        FP4 GEMV at decode size: one launch for base, LoRA and SwiGLU; ``QERL_FUSED_SILU=0`` turns it off), else
        the group's output, then ``qerl.kernels.fused.silu_mul`` (``permuted``: which also writes the copy the next
        linear's wgmma GEMM reads, :func:`permuted_input`). The same rounding either way."""
        if (self.q is not None and len(self.mods) == 2 and self.bias is None
                and self.mods[0].out_features == self.mods[1].out_features
                and (self.lora is not None) == (self.A is not None)
                and os.environ.get("QERL_FUSED_SILU", "1") != "0"):
            y = linear_lora(self.fmt, x, self.q, self.lora, act="silu_mul")
            if y is not None:
                return y
        return silu_mul(self(x), permuted)


def permuted_input(mod, m: int, dtype: torch.dtype) -> bool:
    """Whether the decode step's producer of ``mod``'s (M, K) input (a :class:`FusedLinear` or a
    ``QuantLoRALinear`` inside ``lora_inference_cache``) should also write it in the K permutation of the GEMM that
    will read it (the FP4 wgmma GEMM with the LoRA term in its epilogue; ``qerl.quant.base.wants_permuted``): one
    permute launch fewer per such linear. ``QERL_FUSED_PERMUTE=0`` turns it off (the GEMM's own permute launch,
    session 37's step)."""
    if os.environ.get("QERL_FUSED_PERMUTE", "1") == "0":
        return False
    if isinstance(mod, FusedLinear):
        return mod.q is not None and mod.lora is not None and mod.lora.a.dtype == dtype and wants_permuted(
            mod.fmt, mod.q, mod.lora, m, mod.device)
    op = getattr(mod, "_lora_op", None)
    return (op is not None and op.a.dtype == dtype
            and wants_permuted(mod.fmt, mod.packed, op, m, op.a.device))


def build_decode_plan(model: nn.Module) -> list[dict[str, FusedLinear]] | None:
    """Per decoder layer {"qkv": FusedLinear, "gate_up": FusedLinear}, or None when the model is not a
    Qwen2/Llama stack of ``QuantLoRALinear`` projections with a SiLU-gated MLP (then decode unfused)."""
    if getattr(model.config, "hidden_act", "silu") != "silu":
        return None
    plan = []
    for layer in model.model.layers:
        entry = {}
        for key, (parent_name, names) in FUSED_GROUPS.items():
            parent = getattr(layer, parent_name)
            mods = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, QuantLoRALinear) for m in mods):
                return None
            entry[key] = FusedLinear(mods, defer_bias=(key == "qkv"))
        if not isinstance(layer.self_attn.o_proj, QuantLoRALinear) or not isinstance(layer.mlp.down_proj,
                                                                                     QuantLoRALinear):
            return None
        plan.append(entry)
    return plan
