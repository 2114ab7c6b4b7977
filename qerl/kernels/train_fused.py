"""RMSNorm, SiLU·up and the rotary embedding as single kernels with their backward, for the training passes.

The Hugging Face modules compute all three as chains of elementwise PyTorch ops, each a full pass over an (M, D) or
(M, I) tensor (RMSNorm: a float32 copy, pow, mean, rsqrt, mul, a cast back, the weight product; SwiGLU: silu, then
the product; RoPE: two products, a negation, a cat, a sum, for q and for k) and autograd runs as many again backward. In a GRPO update (7B, 16 completions of 64 + 1024 tokens,
gradient checkpointing) such elementwise kernels took 601 of 1857 ms of GPU time (H100, ``python -m qerl.bench
update``). Here each is one Triton kernel forward and one backward, written with the HF formulas' roundings:

    RMSNorm:  n = dt(x · r), r = rsqrt(mean(x²) + eps) in float32;  y = dt(w · n)      (dt: the input dtype)
    SiLU·up:  s = dt(silu(g));  y = dt(s · u)
    RoPE:     y = dt(dt(x · cos) + dt(rotate_half(x) · sin))    (5 elementwise kernels and a cat in HF)

(``MasterRMSNorm``'s fp32-master formula is the same expression). The backward takes autograd's path through
those ops: ∂n = dt(∂y · w), ∂x = r ∂n − x r³ mean(∂n · x); ∂w = Σ_rows ∂y · n (float32, when the weight trains);
∂s = dt(∂y · u), ∂u = dt(∂y · s), ∂g = ∂s · σ(g)(1 + g(1 − σ(g))); ∂x = dt(dt(∂y · cos) + rotate_halfᵀ(dt(∂y · sin)))
(RoPE). Only the per-row r (RMSNorm) is saved beside the inputs, and nothing of q / k (RoPE is linear in them). Off the Triton path (CPU without ``TRITON_INTERPRET=1``) all three run the reference formulas in PyTorch.
Every written rounding is done by integer operations on the bits (``_rnd``): a
``.to(bf16).to(float32)`` round trip followed by a sum was compiled by Triton into a bf16 FMA (``fma.rn.bf16`` in the
sm_90 PTX; the RoPE kernel was 1-2 ulps off HF's on an H100 in session 29), integer operations cannot be. So the
rotary embedding gives HF's bits forward and backward (the Triton interpreter checks it in bf16; the sm_90 PTX of all
six kernels has no bf16 arithmetic left), SiLU·up differs only where exp does (a rare ulp), and RMSNorm by the float32
summation order of mean(x²) and the rsqrt (measured within 1.5 bf16 ulps; gradients within 1%).
``QERL_FUSED_TRAIN=0`` keeps the Hugging Face modules (``install``).
"""

from __future__ import annotations

import os
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from qerl.kernels.base import HAS_TRITON, _triton_ok
from qerl.kernels.fused import _unit_cols

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rnd(x, dt: tl.constexpr):
        """float32 x rounded to the nearest ``dt`` value (ties to even), as float32. For bf16 by integer operations on
        the bits: a written ``.to(bf16).to(float32)`` round trip is folded by the compiler into bf16 arithmetic and
        FMAs (one rounding skipped: seen as ``fma.rn.bf16`` in the sm_90 PTX), these cannot be."""
        if dt == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = u + 0x7FFF + ((u >> 16) & 1)
            return ((u >> 16) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(dt).to(tl.float32)

    @triton.jit
    def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, r_ptr, D, sx, sy, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < D
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / D + eps)
        dt = y_ptr.dtype.element_ty
        n = _rnd(x * r, dt)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + cols, _rnd(w * n, dt).to(dt), mask=m)
        tl.store(r_ptr + row, r)

    @triton.jit
    def _rms_bwd_kernel(g_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dw_ptr, M, D, sg, sx, sdx, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr, HAS_DW: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < D
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        dt = dx_ptr.dtype.element_ty
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(ROWS):
            row = pid * ROWS + i
            ok = row < M
            row64 = row.to(tl.int64)
            mm = m & ok
            g = tl.load(g_ptr + row64 * sg + cols, mask=mm, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row64 * sx + cols, mask=mm, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + row, mask=ok, other=0.0)
            gn = _rnd(g * w, dt)
            dot = tl.sum(gn * x, 0)
            dx = r * gn - x * (r * r * r) * (dot / D)
            tl.store(dx_ptr + row64 * sdx + cols, _rnd(dx, dt).to(dt), mask=mm)
            if HAS_DW:
                dw += g * _rnd(x * r, dt)
        if HAS_DW:
            tl.store(dw_ptr + pid * D + cols, dw, mask=m)

    @triton.jit
    def _silu_mul_fwd_kernel(g_ptr, u_ptr, y_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        s = _rnd(g / (1.0 + tl.exp(-g)), dt)
        tl.store(y_ptr + offs, _rnd(s * u, dt).to(dt), mask=m)

    @triton.jit
    def _silu_mul_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        dt = dg_ptr.dtype.element_ty
        sig = 1.0 / (1.0 + tl.exp(-g))
        s = _rnd(g * sig, dt)
        ds = _rnd(dy * u, dt)
        tl.store(du_ptr + offs, _rnd(dy * s, dt).to(dt), mask=m)
        tl.store(dg_ptr + offs, _rnd(ds * sig * (1.0 + g * (1.0 - sig)), dt).to(dt), mask=m)


    @triton.jit
    def _rope_kernel(x_ptr, c_ptr, s_ptr, y_ptr, H, L, sxb, sxh, sxl, syb, syh, syl, scb, scl, ssb, ssl,
                     D: tl.constexpr, BWD: tl.constexpr):
        # one program per (batch, position): every head of x (B, H, L, D) at that position, cos/sin (B | 1, L, D)
        pid = tl.program_id(0)
        b = (pid // L).to(tl.int64)
        pos = (pid % L).to(tl.int64)
        i = tl.arange(0, D)
        j = (i + D // 2) % D                               # the rotated partner of element i
        sign = tl.where(i < D // 2, -1.0, 1.0)             # rotate_half(x)[i] = sign_i · x[j]
        cos = tl.load(c_ptr + b * scb + pos * scl + i).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        if BWD:
            sin = tl.load(s_ptr + b * ssb + pos * ssl + j).to(tl.float32)
        else:
            sin = tl.load(s_ptr + b * ssb + pos * ssl + i).to(tl.float32)
        for h in range(H):
            xb = x_ptr + b * sxb + h * sxh + pos * sxl
            xi = tl.load(xb + i).to(tl.float32)
            xj = tl.load(xb + j).to(tl.float32)
            a = _rnd(xi * cos, dt)
            if BWD:  # ∂x[i] = dt(∂y[i]·cos[i]) − sign_i · dt(∂y[j]·sin[j])
                r = -sign * _rnd(xj * sin, dt)
            else:    # y[i] = dt(x[i]·cos[i]) + dt(sign_i · x[j]·sin[i])
                r = _rnd(sign * xj * sin, dt)
            tl.store(y_ptr + b * syb + h * syh + pos * syl + i, _rnd(a + r, dt).to(dt))


_ROWS = 16          # rows per backward program (the weight-gradient partial sums: one row of M / 16 per program)
_SILU_BLOCK = 2048


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return _unit_cols(t.reshape(-1, t.shape[-1]))


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The Hugging Face / ``MasterRMSNorm`` formula: dt(w · dt(x · rsqrt(mean(x²) + eps))) in float32."""
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * h.to(dt).float()).to(dt)


def silu_mul_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The Hugging Face SwiGLU product: silu(g) · u, each op rounded to the input dtype."""
    return F.silu(g) * u


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps: float):
        x2 = _rows2d(x)
        m, d = x2.shape
        y = torch.empty((m, d), device=x.device, dtype=x.dtype)
        r = torch.empty(m, device=x.device, dtype=torch.float32)
        if m:
            _rms_fwd_kernel[(m,)](x2, w, y, r, d, x2.stride(0), y.stride(0), eps,
                                  BLOCK=triton.next_power_of_2(d), num_warps=8 if d > 2048 else 4)
        ctx.save_for_backward(x2, w, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, gy):
        x2, w, r = ctx.saved_tensors
        m, d = x2.shape
        g2 = _rows2d(gy)
        dx = torch.empty_like(x2)
        need_w = ctx.needs_input_grad[1]
        progs = -(-m // _ROWS)
        dw = torch.empty((progs, d), device=x2.device, dtype=torch.float32) if need_w else r
        if m:
            _rms_bwd_kernel[(progs,)](g2, x2, w, r, dx, dw, m, d, g2.stride(0), x2.stride(0), dx.stride(0),
                                      ROWS=_ROWS, BLOCK=triton.next_power_of_2(d), HAS_DW=need_w,
                                      num_warps=8 if d > 2048 else 4)
        gw = dw.sum(0).to(w.dtype) if need_w else None
        return dx.view(ctx.shape), gw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        g, u = g.contiguous(), u.contiguous()
        y = torch.empty_like(g)
        n = g.numel()
        if n:
            _silu_mul_fwd_kernel[(triton.cdiv(n, _SILU_BLOCK),)](g, u, y, n, BLOCK=_SILU_BLOCK, num_warps=8)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        if n:
            _silu_mul_bwd_kernel[(triton.cdiv(n, _SILU_BLOCK),)](dy, g, u, dg, du, n, BLOCK=_SILU_BLOCK, num_warps=8)
        return dg, du


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """dt(w · dt(x · rsqrt(mean(x²) + eps))) over the last dimension, differentiable in x and w: one Triton kernel
    each way where Triton runs on x's device, else ``rms_norm_ref``."""
    if not _triton_ok(x) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.shape[-1] > 16384:
        return rms_norm_ref(x, w, eps)
    return _RMSNorm.apply(x, w, eps)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) · u as HF computes it, differentiable in g and u: one Triton kernel each way where Triton runs on
    g's device (same shape and dtype for g and u), else ``silu_mul_ref``."""
    if not _triton_ok(g) or g.shape != u.shape or g.dtype != u.dtype or g.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return silu_mul_ref(g, u)
    return _SiluMul.apply(g, u)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor, bwd: bool) -> None:
    B, H, L, D = x.shape
    if B * L:
        cb = 0 if cos.shape[0] == 1 else cos.stride(0)
        sb = 0 if sin.shape[0] == 1 else sin.stride(0)
        _rope_kernel[(B * L,)](x, cos, sin, y, H, L, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
                               y.stride(2), cb, cos.stride(1), sb, sin.stride(1), D=D, BWD=bwd,
                               num_warps=1 if D <= 64 else 2)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        y = torch.empty_like(x)
        _rope_launch(x, cos, sin, y, False)
        ctx.save_for_backward(cos, sin)  # the rotation is linear in x: nothing of x is kept
        return y

    @staticmethod
    def backward(ctx, gy):
        cos, sin = ctx.saved_tensors
        if gy.stride(-1) != 1:
            gy = gy.contiguous()
        dx = torch.empty_like(gy)
        _rope_launch(gy, cos, sin, dx, True)
        return dx, None, None


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary embedding of x (B, H, L, D) with cos/sin (B, L, D): x·cos + rotate_half(x)·sin, each op
    rounded to x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _rope_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if x.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or not _triton_ok(x):
        return False
    B, _, L, D = x.shape
    return (x.dtype == cos.dtype == sin.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and D >= 2 and D & (D - 1) == 0 and cos.shape[1:] == (L, D) and cos.shape[0] in (1, B)
            and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope_ref`` (its bits forward, autograd's backward) as one Triton kernel each way where it runs
    (x (B, H, L, D) with unit last stride, any head/position strides; D a power of two), else ``rope_ref``."""
    return _Rope.apply(x, cos, sin) if _rope_ok(x, cos, sin) else rope_ref(x, cos, sin)


def _rope_wrapper(orig):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if unsqueeze_dim == 1 and not kwargs and fused_train_enabled():
            return rope(q, cos, sin), rope(k, cos, sin)  # (rope_ref, HF's formula, where the kernel does not apply)
        return orig(q, k, cos, sin, unsqueeze_dim, **kwargs)
    apply_rotary_pos_emb.qerl_fused = orig  # marks the module as patched (and keeps the original)
    return apply_rotary_pos_emb


class FusedRMSNorm(nn.Module):
    """An RMSNorm module (the HF ``Qwen2RMSNorm``/``LlamaRMSNorm`` it replaces keeps its weight Parameter, so AQN's
    hooks and the optimizer see the same tensor) whose forward is ``rms_norm``."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _fused_mlp_forward(self, x):
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def fused_train_enabled() -> bool:
    """``QERL_FUSED_TRAIN`` is not "0"."""
    return os.environ.get("QERL_FUSED_TRAIN", "1") != "0"


def install(model: nn.Module) -> dict[str, int]:
    """Use the fused kernels in ``model`` (in place): every HF RMSNorm module (class name ending in "RMSNorm", a 1-D
    weight and ``variance_epsilon``) becomes a ``FusedRMSNorm`` over the same weight Parameter, every MLP with
    gate_proj / up_proj / down_proj and a SiLU activation computes silu(gate) · up with ``silu_mul``, and the
    attention's ``apply_rotary_pos_emb`` (the module-level function of its Hugging Face modeling module, patched once
    per process; it checks ``QERL_FUSED_TRAIN`` and its inputs at every call and otherwise calls the original) runs
    ``rope`` for q and k. Returns the counts (attention layers for "rope"); nothing is changed with
    ``QERL_FUSED_TRAIN=0``. ``MasterRMSNorm`` (trained norms) uses ``rms_norm`` itself."""
    counts = {"rms_norm": 0, "silu_mul": 0, "rope": 0}
    if not fused_train_enabled():
        return counts
    for name, mod in list(model.named_modules()):
        cls = type(mod).__name__
        if cls.endswith("Attention") and hasattr(mod, "q_proj"):
            pymod = sys.modules.get(type(mod).__module__)
            fn = getattr(pymod, "apply_rotary_pos_emb", None)
            if fn is not None:
                if not hasattr(fn, "qerl_fused"):
                    pymod.apply_rotary_pos_emb = _rope_wrapper(fn)
                counts["rope"] += 1
            continue
        w = getattr(mod, "weight", None)
        if cls.endswith("RMSNorm") and cls not in ("FusedRMSNorm", "MasterRMSNorm") and isinstance(w, nn.Parameter) \
                and w.dim() == 1 and hasattr(mod, "variance_epsilon") and not mod._forward_hooks \
                and not mod._forward_pre_hooks:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, FusedRMSNorm(w, mod.variance_epsilon))
            counts["rms_norm"] += 1
        elif all(hasattr(mod, p) for p in ("gate_proj", "up_proj", "down_proj")) and \
                type(getattr(mod, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
            mod.forward = types.MethodType(_fused_mlp_forward, mod)
            counts["silu_mul"] += 1
    return counts


__all__ = ["rms_norm", "rms_norm_ref", "silu_mul", "silu_mul_ref", "rope", "rope_ref", "FusedRMSNorm", "install",
           "fused_train_enabled"]
