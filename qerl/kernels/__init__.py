"""Fast paths for the formats that own them, registered on import: the FP4 family (NVFP4, MXFP4) shares one
dispatcher (:class:`FP4Kernels`, given block size and scale type by the format); NF4 calls bitsandbytes
(:class:`BnbKernels`); BF16 runs the FP4 GEMV's kernel over its stored weight at decode size (:class:`BF16Kernels`).
``qerl.quant.base`` calls them from ``fmt.linear`` / ``fmt.linear_t``; a kernel that declines an input (CPU, no
Triton) returns None and the format runs its reference (dequantize + matmul).

``qmm`` (x Wᵀ), ``qmm_t`` (g W) and ``dequantize_into`` are the same calls by format (object or registered name);
the path is picked by device, format and M (rows of x flattened) and named by :func:`backend_for`:

=================  =======================================================================================
``cuda_gemv``      NVFP4/MXFP4, CUDA, BF16 x, M <= 16, N % 16 == 0, K % 64 == 0, when the hand-written CUDA
                   kernel builds (``qerl.kernels.cuda_fp4``; ``QERL_CUDA_GEMV=0`` turns it off): weights
                   re-laid out once into mma fragments (a second copy, same size as the packed weight, unless
                   the base is held only in that layout: ``quant.layout=kernel``, ``qerl.kernels.relaid``); the
                   rollout's LoRA joins the same launch (``base.linear_lora``; ``QERL_CUDA_LORA=0`` turns it off)
``cuda_gemm``      NVFP4/MXFP4, CUDA, BF16 x, M > 16 where the device's tuned table measured it fastest (untuned:
                   M <= 192; ``QERL_CUDA_GEMM=0|1`` off/forced): the same re-laid-out weights as ``cuda_gemv``,
                   tokens staged in shared memory by a cp.async pipeline, one weight decode per 16-32-64 tokens
                   (mma.sync), or on sm_90 the wgmma kernel (the weight as wgmma's register operand, the tokens
                   permuted into the weights' K order and read by the tensor cores; 32-256 tokens per CTA; at 128+
                   tokens a CTA its chunks staged by tensor copies (TMA) on mbarriers, ``QERL_WGMMA_TMA=0`` for
                   cp.async), as the
                   table's configuration names (two chunks of MMAs in flight per warpgroup, ``QERL_WGMMA_PIPE=1``
                   for one; ``benchmarks.wgmma_sass_check`` checks both main loops' machine code; a tile grid, splits
                   of K across CTAs, or stream-K over persistent CTAs); the rollout's LoRA term added by either
                   GEMM's epilogue instead of an addmm after it (t = x·Aᵀ by ``fused.lora_a`` first; each GEMM
                   launched under PDL so its main loop overlaps that launch: ``QERL_GEMM_LORA=pdl|1|0`` for the
                   mma.sync kernel, ``QERL_WGMMA_LORA=pdl|1|0`` for the wgmma kernel)
``triton_gemv``    NVFP4/MXFP4, CUDA, BF16 x, M <= 16 otherwise: split-K tiled kernel (BM=16 mma), in-register
                   FP4->BF16 by bit manipulation
``triton_gemm``    NVFP4/MXFP4, CUDA, BF16 x, 16 < M <= 256: tiled GEMM, in-register dequantization -> tl.dot
``dequant_cublas`` NVFP4/MXFP4, CUDA: M > 256, every ``qmm_t``, x not BF16, and wherever the tuned table
                   (``configs``/``tuned_h100``) measured it faster: Triton dequantization into a reusable
                   per-device buffer (or L2-sized row slices of it), then cuBLAS; for a base in the kernels'
                   layout, ``dequantize_relaid`` (the same values from the fragment words) for every M the CUDA
                   GEMV/GEMM do not take, in slices of Ŵ where the device's measured slice table says so
                   (``configs.dequant_slice``: rows for ``qmm``, columns for ``qmm_t``, each slice's product one
                   cuBLAS call into its output columns; ``QERL_DEQUANT_SLICES=0`` ignores the table)
``cuda_dq``        NVFP4/MXFP4 in the kernels' layout, sm_90, BF16 activations, instead of ``dequant_cublas`` when
                   ``QERL_DQ_GEMM`` names the product (``bwd``: every ``qmm_t``; ``fwd``: the forward where the
                   dispatcher would dequantize; ``all``; ``0`` none): one wgmma GEMM that dequantizes each chunk of the
                   weight into shared memory inside its main loop (``qerl.kernels.cuda_dq``; no BF16 copy of Ŵ)
``bnb``            NF4 on CUDA: bitsandbytes' own kernels (gemv_4bit for one token, dequantize + matmul else)
``cuda_gemv``      also BF16 weights at M <= 16 on CUDA (N % 16 == 0, K % 64 == 0, rows contiguous): the same kernel
                   reading the stored weight row-major (``cuda_fp4.dense_weight``, no copy), with the same LoRA and
                   SwiGLU epilogues, under PDL at M <= 4 only (``QERL_BF16_GEMV=0`` turns it off: cuBLAS, for
                   same-process comparisons; ``1``: never under PDL, ``pdl``: always)
``dense``          BF16 weights otherwise: ``F.linear`` (cuBLAS; the BF16 format's reference)
``torch_reference`` CPU, no Triton, or a format without kernels (INT4): ``fmt.dequantize`` then ``F.linear``
=================  =======================================================================================

The Triton kernels are CUDA-graph capturable (no host sync, allocations depend on shapes only, split-K
counters reset by the kernel) once a weight has been seen eagerly: the first call on a weight runs
:func:`prepare` (for MXFP4 one host sync to check the exponent range), cached per tensor. Call it at load
time or run one eager step before capture. Small-M calls cost tens of µs of host time (dispatch + Triton
launch), more than the GPU work: decode belongs in CUDA graphs. Measured speeds: ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from qerl.kernels import configs, relaid
from qerl.kernels.base import (
    _COUNTER_SLOTS,
    _CUDA_ENCODINGS,
    CUDA_GEMV_MAX_M,
    HAS_TRITON,
    _counters,
    _cuda_gemv_ok,
    _device_info,
    _fp4_id,
    _interpret,
    _k,
    _stamp,
    _triton_ok,
    _workspace,
    cuda_gemm_choice,
    cuda_gemv_enabled,
    pdl_enabled,
    triton,
)
from qerl.kernels.bf16_decode import BF16Kernels, bf16_gemv_enabled
from qerl.kernels.bnb_nf4 import BnbKernels
from qerl.kernels.dequant import (
    _relaid_dense,
    _relaid_dequant_mm,
    _relaid_reference,
    cuda_dequant_enabled,
    dequantize_relaid,
    sliced_rows,
)
from qerl.kernels.gemm_lora import _gemm_lora, _gemm_lora_route, _lora_fits
from qerl.kernels.permuted import permuted_twin
from qerl.quant import BF16Format, MXFP4Format, NF4Format, NVFP4Format, get_format, register_kernels
from qerl.quant import base as _quant

BACKENDS = ("cuda_gemv", "cuda_gemm", "triton_gemv", "triton_gemm", "dequant_cublas", "cuda_dq", "bnb", "dense",
            "torch_reference")


@dataclass
class PackedFP4:
    """Kernel view of an NVFP4/MXFP4 weight: the checkpoint tensors themselves (no copies) plus facts
    checked once. ``scale`` is ``weight_scale`` viewed as uint8; ``asm_ok`` says the inline-PTX decoder's
    range conditions hold (see ``fp4_triton``)."""

    fmt_id: int
    group: int  # elements per block scale (the format's block)
    n: int
    k: int
    packed: torch.Tensor  # (N, K/2) uint8
    scale: torch.Tensor  # (N, K/G) uint8
    gs: torch.Tensor | None  # (1,) float32, NVFP4 only
    asm_ok: bool
    stamp: tuple
    scale32: torch.Tensor | None = None  # (N, K/G/4) int32 view of ``scale`` when K/G % 4 == 0


_PREPARED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def prepare(fmt, q: Mapping[str, torch.Tensor]) -> PackedFP4:
    """Kernel view of an NVFP4/MXFP4 weight (cached per ``weight_packed`` tensor; re-checked if it changes).

    The fast inline-PTX decoder is exact for every NVFP4 weight; for MXFP4 it needs every E8M0 exponent
    <= 154 (scales <= 2^27), checked once here (one host sync; inside CUDA-graph capture the check is
    skipped and the always-exact pure decoder is used).
    """
    fmt = get_format(fmt)
    fid = _fp4_id(fmt)
    if relaid.is_relaid(q):
        raise ValueError(f"{fmt.name}: this weight is held in the CUDA kernels' layout (quant.layout=kernel); the "
                         f"Triton kernels read the compressed-tensors one (relaid.to_compressed converts back)")
    packed, scale = q["weight_packed"], q["weight_scale"]
    gs = q.get("weight_global_scale") if fid == 0 else None
    stamp = _stamp(packed, scale, gs)
    hit = _PREPARED.get(packed)
    if hit is not None and hit.stamp == stamp and hit.fmt_id == fid:
        return hit
    n, kh = packed.shape
    k = 2 * kh
    g = fmt.block
    if scale.shape != (n, k // g):
        raise ValueError(f"{fmt.name}: weight_scale has shape {tuple(scale.shape)}, expected {(n, k // g)}")
    s8 = scale.contiguous().view(torch.uint8)
    asm_ok = fid == 0  # every E4M3 byte has an exact scale word (normals, subnormals, zero)
    if fid == 1 and packed.is_cuda and not torch.cuda.is_current_stream_capturing():
        asm_ok = int(s8.max().item()) <= _k.MX_ASM_MAX_EXP if _k is not None else False
    s32 = s8.view(torch.int32) if (k // g) % 4 == 0 and s8.storage_offset() % 4 == 0 else None
    pw = PackedFP4(fid, g, n, k, packed.contiguous(), s8,
                   None if gs is None else gs.reshape(1).to(torch.float32), asm_ok, stamp, s32)
    _PREPARED[packed] = pw
    return pw


_CUDA_PREPARED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _cuda_weight(fmt, q: Mapping[str, torch.Tensor]):
    """The CUDA kernel's re-laid-out copy of this weight (cached per ``weight_packed`` tensor), or None when
    the format/shape is not supported or we are inside a CUDA-graph capture without a cached copy."""
    if relaid.is_relaid(q):
        return relaid.weight(fmt, q)
    fid = _fp4_id(fmt)
    packed, scale = q["weight_packed"], q["weight_scale"]
    gs = q.get("weight_global_scale") if fid == 0 else None
    stamp = _stamp(packed, scale, gs)
    hit = _CUDA_PREPARED.get(packed)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    if torch.cuda.is_current_stream_capturing():
        return None
    from qerl.kernels import cuda_fp4
    encoding = _CUDA_ENCODINGS.get((fid, fmt.block))  # the two block layouts the CUDA kernel implements
    try:
        w = None if encoding is None else cuda_fp4.prepare(encoding, packed, scale, gs)
    except ValueError:  # e.g. an MXFP4 exponent range the kernel's decode cannot represent exactly
        w = None
    _CUDA_PREPARED[packed] = (stamp, w)
    return w


def prepared_bytes() -> int:
    """Bytes held by the CUDA kernels' re-laid-out copies of compressed-tensors weights (made at a weight's first
    CUDA GEMV/GEMM, kept while the weight lives): the second copy that ``quant.layout=kernel`` does without."""
    return sum(hit[1].nbytes for hit in list(_CUDA_PREPARED.values()) if hit[1] is not None)


def _fp4_backend(fmt, x: torch.Tensor, q: Mapping[str, torch.Tensor] | None) -> str | None:
    """The FP4 path for x (None: the reference). Without ``q`` the layer shape is unknown and the rule of
    ``configs`` by M alone is reported; with it, the (tuned) configuration of that shape decides, as in ``linear``."""
    if not (_triton_ok(x) and x.is_cuda):
        return None
    m = x.numel() // max(1, x.shape[-1])
    if q is not None and relaid.is_relaid(q):
        w = relaid.weight(fmt, q)
        if x.dtype == torch.bfloat16 and _cuda_gemv_ok(x, m, w.n, w.k):
            return "cuda_gemv"
        if x.dtype == torch.bfloat16 and cuda_gemm_choice(fmt, w.n, w.k, m, x.device):
            return "cuda_gemm"
        if x.dtype == torch.bfloat16 and _dq_route(w, x.device, "fwd"):
            return "cuda_dq"
        return "dequant_cublas"
    if x.dtype != torch.bfloat16:
        return "dequant_cublas"
    if q is not None:
        n, kh = q["weight_packed"].shape
        hit = _CUDA_PREPARED.get(q["weight_packed"])  # a query: no re-layout here (linear makes it on first use)
        if (hit is None or hit[1] is not None) and x.dtype == torch.bfloat16:
            if _cuda_gemv_ok(x, m, n, 2 * kh):
                return "cuda_gemv"
            if cuda_gemm_choice(fmt, n, 2 * kh, m, x.device):
                return "cuda_gemm"
        cfg = kernel_config(fmt, n, 2 * kh, m, x.device)
    else:
        cfg = configs.heuristic(1, x.shape[-1], m)
    if cfg.kernel == "cublas":
        return "dequant_cublas"
    return "triton_gemv" if m <= configs.GEMV_MAX_M else "triton_gemm"


# ----------------------------------------------------------------------------------------- launchers

def _use_asm(pw: PackedFP4, dev: torch.device) -> bool:
    if _interpret() or not pw.asm_ok or dev.type != "cuda":
        return False
    return _device_info(dev)[2] >= 90


def _launch(x2: torch.Tensor, pw: PackedFP4, cfg: configs.KernelConfig, out: torch.Tensor,
            use_asm: bool | None = None) -> torch.Tensor:
    """Run one fused kernel: out (M, N) = x2 (M, K) @ Wᵀ. x2 is BF16 with unit stride along K."""
    m, k = x2.shape
    n = pw.n
    dev = x2.device
    asm = _use_asm(pw, dev) if use_asm is None else use_asm
    fence = dev.type == "cuda" and not _interpret()
    gs = pw.gs if pw.gs is not None else pw.packed  # dummy pointer when HAS_G is off
    n_iter = triton.cdiv(k, cfg.bk)
    per = triton.cdiv(n_iter, min(cfg.split_k, n_iter))
    sk = triton.cdiv(n_iter, per)  # no empty splits
    common = dict(FMT=pw.fmt_id, G=pw.group, USE_ASM=asm, HAS_G=pw.gs is not None,
                  OUT_C=_k.ASM_OUT_SCALE if asm else 1.0, BN=cfg.bn, BK=cfg.bk, SPLIT_K=sk,
                  MASKED=bool(n % cfg.bn or k % cfg.bk), FENCE=fence,
                  num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.maxnreg:
        common["maxnreg"] = cfg.maxnreg
    if cfg.kernel == "gemv":
        grid = (triton.cdiv(n, cfg.bn), sk, m)
        tiles = grid[0] * m
    else:
        grid = (triton.cdiv(n, cfg.bn), triton.cdiv(m, cfg.bm), sk)
        tiles = grid[0] * grid[1]
    if sk > 1:
        if tiles > _COUNTER_SLOTS:
            raise ValueError(f"split-K launch with {tiles} tiles exceeds {_COUNTER_SLOTS} counters")
        ws = torch.empty((sk, m, n), device=dev, dtype=torch.float32)
        cnt = _counters(dev)
    else:
        ws, cnt = out, out
    sc32 = (cfg.sc32 or cfg.mode == 3) and pw.scale32 is not None and (cfg.bk // pw.group) % 4 == 0
    if cfg.mode == 3 and not sc32:
        cfg = configs.replace(cfg, mode=1)
    args = (x2, pw.packed, pw.scale32 if sc32 else pw.scale, gs, out, ws, cnt, m, n, k, x2.stride(0), out.stride(0),
            per, n_iter)
    common.update(SC32=sc32, MODE=cfg.mode)
    if cfg.kernel != "gemv":
        common["PREFETCH"] = cfg.prefetch and not sc32 and cfg.mode != 3
    if cfg.kernel == "gemv":
        _k._qgemv_kernel[grid](*args, **common)
    else:
        _k._qmm_dot_kernel[grid](*args, BM=cfg.bm, SWAP=cfg.swap, JOIN=cfg.join, DOT_F32=_interpret(), **common)
    return out


def _dequant_launch(pw: PackedFP4, out: torch.Tensor, bn: int = 32, bk: int = 256) -> torch.Tensor:
    grid = (triton.cdiv(pw.n, bn), triton.cdiv(pw.k, bk))
    gs = pw.gs if pw.gs is not None else pw.packed
    _k._dequant_kernel[grid](pw.packed, pw.scale, gs, out, pw.n, pw.k, FMT=pw.fmt_id, G=pw.group,
                             HAS_G=pw.gs is not None, BN=bn, BK=bk,
                             MASKED=bool(pw.n % bn or pw.k % bk), num_warps=4)
    return out


def kernel_config(fmt, n: int, k: int, m: int, device: torch.device) -> configs.KernelConfig:
    """The launch configuration the dispatcher uses for this layer shape and M on ``device``."""
    if device.type == "cuda":
        name, sms, _ = _device_info(device)
    else:
        name, sms = "", 132
    return configs.lookup(get_format(fmt).name, n, k, m, name, sms)


# ----------------------------------------------------------------------------------------- FP4 family


def _fp4_dequantize(fmt, q: Mapping[str, torch.Tensor], out: torch.Tensor | None) -> torch.Tensor | None:
    """Ŵ by the Triton dequantization kernel (None off the GPU path). ``out=None``: the per-device BF16 workspace."""
    if relaid.is_relaid(q):
        return _relaid_dense(fmt, q, out)
    if not _triton_ok(q["weight_packed"]):
        return None
    pw = prepare(fmt, q)
    if out is None:
        out = _workspace(pw.packed.device, torch.bfloat16, pw.n * pw.k).view(pw.n, pw.k)
    if out.shape != (pw.n, pw.k) or not out.is_contiguous():
        raise ValueError(f"dequantize_into: out must be contiguous {(pw.n, pw.k)}, got {tuple(out.shape)}")
    return _dequant_launch(pw, out)


def _fp4_linear(fmt, x: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """x (..., K) @ Ŵᵀ on the GPU: CUDA GEMV, fused Triton GEMV/GEMM or dequantize + cuBLAS (None off the GPU)."""
    if relaid.is_relaid(q):
        return _relaid_linear(fmt, x, q)
    if not (_triton_ok(x) and x.is_cuda):
        return None
    pw = prepare(fmt, q)
    k = x.shape[-1]
    if k != pw.k:
        raise ValueError(f"qmm: x has K={k}, the {fmt.name} weight is {(pw.n, pw.k)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, pw.n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out.reshape(*x.shape[:-1], pw.n)
    if _cuda_gemv_ok(x2, m, pw.n, pw.k):
        w = _cuda_weight(fmt, q)
        if w is not None:
            from qerl.kernels import cuda_fp4
            cuda_fp4.gemv(x2, w, out, pdl=pdl_enabled(x2))
            return out.reshape(*x.shape[:-1], pw.n)
    elif x2.dtype == torch.bfloat16 and cuda_gemm_choice(fmt, pw.n, pw.k, m, x.device):
        w = _cuda_weight(fmt, q)
        if w is not None:
            from qerl.kernels import cuda_fp4
            cuda_fp4.gemm(x2, w, out)
            return out.reshape(*x.shape[:-1], pw.n)
    cfg = kernel_config(fmt, pw.n, pw.k, m, x.device) if x.dtype == torch.bfloat16 else None
    if cfg is None or cfg.kernel == "cublas":
        _dequant_mm(x2, fmt, q, pw, out, sliced_rows(cfg.chunk, m, pw.n) if cfg is not None else 0)
    else:
        _launch(x2, pw, cfg, out)
    return out.reshape(*x.shape[:-1], pw.n)


def _relaid_linear(fmt, x: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """x (..., K) @ Ŵᵀ from the kernels' layout alone: the CUDA GEMV (M <= 16) or GEMM (mid M, as the dispatcher
    chooses for the compressed-tensors layout), else the dense weight rebuilt by ``dequantize_relaid`` + cuBLAS;
    off the GPU the reference of the converted-back tensors."""
    w = relaid.weight(fmt, q)
    k = x.shape[-1]
    if k != w.k:
        raise ValueError(f"qmm: x has K={k}, the {fmt.name} weight is {(w.n, w.k)}")
    if not (_triton_ok(x) and x.is_cuda):
        return F.linear(x, _relaid_reference(fmt, q, x.dtype))
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, w.n), device=x.device, dtype=x.dtype)
    if m:
        from qerl.kernels import cuda_fp4
        if _cuda_gemv_ok(x2, m, w.n, w.k):
            cuda_fp4.gemv(x2, w, out, pdl=pdl_enabled(x2))
        elif x2.dtype == torch.bfloat16 and cuda_gemm_choice(fmt, w.n, w.k, m, x.device):
            cuda_fp4.gemm(x2, w, out)
        elif (x2.dtype == torch.bfloat16 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0
              and _dq_route(w, x.device, "fwd")):
            from qerl.kernels import cuda_dq
            cuda_dq.gemm(x2, w, out)
        else:
            _relaid_dequant_mm(x2, w, out, _relaid_fwd_slice(fmt, w, m, x2))
    return out.reshape(*x.shape[:-1], w.n)


def _relaid_fwd_slice(fmt, w, m: int, x2: torch.Tensor) -> int:
    """Rows of Ŵ per dequantize + cuBLAS slice of the forward at M = m: the device's measured slice table
    (``configs.dequant_slice``) where it has one, else the tuned Triton-era table's ``cublas_chN`` under
    :func:`sliced_rows`' rule (as for the compressed layout); 0 = the whole weight."""
    if x2.dtype != torch.bfloat16:
        return 0
    hit = configs.dequant_slice("fwd", w.n, w.k, m, _device_info(x2.device)[0])
    if hit is not None:
        return hit
    cfg = kernel_config(fmt, w.n, w.k, m, x2.device)
    return sliced_rows(cfg.chunk, m, w.n) if cfg.kernel == "cublas" else 0


def _fp4_linear_lora(fmt, x: torch.Tensor, q: Mapping[str, torch.Tensor], lora, act=None) -> torch.Tensor | None:
    """x (..., K) @ Ŵᵀ + the LoRA term (``lora`` None: none) in one CUDA GEMV launch (``cuda_fp4.gemv(lora=...)``)
    for decode-size M (``QERL_CUDA_LORA=0`` turns the LoRA path off), with ``act`` ("silu_mul": silu(gate) · up of
    a gate|up weight, (..., N/2)) in its epilogue; None where that path does not run (the caller then runs the
    linear, its LoRA and the activation itself)."""
    from qerl.kernels import cuda_fp4
    if act is not None and act not in cuda_fp4.ACTS:
        raise ValueError(f"act={act!r}: valid epilogues are None, {', '.join(map(repr, cuda_fp4.ACTS))}")
    if (lora is not None and os.environ.get("QERL_CUDA_LORA", "1") == "0") or not x.is_cuda \
            or x.dtype != torch.bfloat16:
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    w = _cuda_weight(fmt, q) if x2.shape[0] else None
    if w is None:
        return None
    m, n = x2.shape[0], w.n
    if lora is not None and not _lora_fits(lora, w):
        return None
    if not _cuda_gemv_ok(x2, m, n, k):
        y = _gemm_lora(fmt, x2, w, lora, permuted_twin(x)) if act is None and lora is not None else None
        return None if y is None else y.reshape(*x.shape[:-1], n)
    if act is not None and n % 32:
        return None
    # programmatic dependent launch only with the whole decode chain (pdl_enabled): alone, between Triton kernels
    # that never trigger it, it measured slower (H100, 7B batch 8: 2278 vs 2335 tokens/s; raw/h100_s22_pdl)
    y = cuda_fp4.gemv(x2, w, lora=lora, pdl=pdl_enabled(x2), act=act)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _fp4_wants_permuted(fmt, q: Mapping[str, torch.Tensor], lora, m: int, device: torch.device) -> bool:
    """Whether :func:`_fp4_linear_lora` on an (M, K) bf16 x on ``device`` runs the wgmma GEMM with the LoRA term in
    its epilogue, the kernel that reads x in its K permutation: x's producer may then write that copy too."""
    if lora is None or device.type != "cuda" or m <= CUDA_GEMV_MAX_M or os.environ.get("QERL_CUDA_LORA", "1") == "0":
        return False
    w = _cuda_weight(fmt, q)
    if w is None or not _lora_fits(lora, w):
        return False
    route = _gemm_lora_route(fmt, m, w, lora, device)
    return route is not None and route[1]


def _dequant_mm(x2: torch.Tensor, fmt, q, pw: PackedFP4, out: torch.Tensor, chunk: int) -> None:
    """out (M, N) = x2 @ Ŵᵀ by dequantize + cuBLAS; with ``chunk`` rows at a time, so each dequantized
    slice is still in L2 when cuBLAS reads it (for large M, where each slice's GEMM fills the GPU)."""
    if not chunk or chunk >= pw.n or x2.dtype != torch.bfloat16:
        w = dequantize_into(fmt, q, None if x2.dtype == torch.bfloat16 else
                            _workspace(x2.device, x2.dtype, pw.n * pw.k).view(pw.n, pw.k))
        torch.mm(x2, w.t(), out=out)
        return
    buf = _workspace(x2.device, torch.bfloat16, chunk * pw.k).view(chunk, pw.k)
    for n0 in range(0, pw.n, chunk):
        r = min(chunk, pw.n - n0)
        part = PackedFP4(pw.fmt_id, pw.group, r, pw.k, pw.packed[n0:n0 + r], pw.scale[n0:n0 + r], pw.gs,
                         pw.asm_ok, pw.stamp)
        _dequant_launch(part, buf[:r])
        torch.mm(x2, buf[:r].t(), out=out[:, n0:n0 + r])


def _dq_route(w, device: torch.device, op: str = "bwd") -> bool:
    """The product ``op`` (``bwd``: g @ Ŵ; ``fwd``: x @ Ŵᵀ where the dispatcher would dequantize) of a weight in the
    kernels' layout takes the in-loop dequantizing GEMM (``cuda_dq``): its switch on for ``op`` (``QERL_DQ_GEMM``),
    the shape one it runs, an sm_90 device where it builds."""
    from qerl.kernels import cuda_dq
    return cuda_dq.enabled(op) and cuda_dq.supported(w, op) and cuda_dq.available(device)


def _fp4_linear_t(fmt, g: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """g (..., N) @ Ŵ on the GPU: dequantization + cuBLAS (None off the GPU; a base in the kernels' layout: its
    reference there), in column slices of Ŵ where the device's slice table says so; for a base in the kernels' layout
    with ``QERL_DQ_GEMM`` bwd / all, the in-loop dequantizing GEMM (``cuda_dq.gemm_t``) instead."""
    if relaid.is_relaid(q):
        if not (g.is_cuda and _triton_ok(g)):
            return torch.matmul(g, _relaid_reference(fmt, q, g.dtype))
        w = relaid.weight(fmt, q)
        if g.dtype == torch.bfloat16 and g.numel() and _dq_route(w, g.device):
            from qerl.kernels import cuda_dq
            g2 = g.reshape(-1, w.n)
            if g2.stride(-1) != 1 or g2.stride(0) % 8 or g2.data_ptr() % 16:
                g2 = g2.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy (contiguous() may not)
            return cuda_dq.gemm_t(g2, w).reshape(*g.shape[:-1], w.k)
        cols = (configs.dequant_slice("bwd", w.n, w.k, g.numel() // max(1, w.n), _device_info(g.device)[0])
                if g.dtype == torch.bfloat16 else None)
        if not cols:  # the whole dense weight (no slice table, or its entry is the whole weight)
            return torch.matmul(g, _relaid_dense(fmt, q, None, g.dtype))
        g2 = g.reshape(-1, w.n)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
        out = torch.empty((g2.shape[0], w.k), device=g.device, dtype=g.dtype)
        _relaid_dequant_mm(g2, w, out, cols, t=True)
        return out.reshape(*g.shape[:-1], w.k)
    if not (_triton_ok(g) and g.is_cuda):
        return None
    pw = prepare(fmt, q)
    out_buf = None if g.dtype == torch.bfloat16 else _workspace(g.device, g.dtype, pw.n * pw.k).view(pw.n, pw.k)
    w = dequantize_into(fmt, q, out_buf)
    return torch.matmul(g, w)


class FP4Kernels:
    """The FP4 family's fast paths (NVFP4, MXFP4, any format with ``scale_kind`` e4m3/e8m0 and a ``block``):
    one dispatcher, parameterized by the format's block size and scale type."""

    def backend(self, fmt, x, q=None):
        return _fp4_backend(fmt, x, q)

    def linear(self, fmt, x, q):
        return _fp4_linear(fmt, x, q)

    def linear_t(self, fmt, g, q):
        return _fp4_linear_t(fmt, g, q)

    def linear_lora(self, fmt, x, q, lora, act=None):
        return _fp4_linear_lora(fmt, x, q, lora, act)

    def wants_permuted(self, fmt, q, lora, m, device):
        return _fp4_wants_permuted(fmt, q, lora, m, device)

    def dequantize(self, fmt, q, out):
        return _fp4_dequantize(fmt, q, out)


# ------------------------------------------------------------------- registration (NF4: bnb_nf4; BF16: bf16_decode)

FP4 = FP4Kernels()
BNB = BnbKernels()
BF16 = BF16Kernels()
register_kernels(NVFP4Format, FP4)
register_kernels(MXFP4Format, FP4)
register_kernels(NF4Format, BNB)
register_kernels(BF16Format, BF16)


# ----------------------------------------------------------------------------------------- by format

def backend_for(fmt, x: torch.Tensor, q: Mapping[str, torch.Tensor] | None = None) -> str:
    """Name of the path ``qmm(x, fmt, q)`` takes (one of ``BACKENDS``); ``fmt`` is a format or registered name."""
    return _quant.backend(get_format(fmt), x, q)


def supports(fmt, x: torch.Tensor) -> bool:
    """True when ``qmm(x, fmt, ·)`` runs on a GPU path (Triton, cuBLAS or bitsandbytes), not the reference."""
    return backend_for(fmt, x) != "torch_reference"


def qmm(x: torch.Tensor, fmt, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """x (..., K) @ Ŵᵀ -> (..., N) in x's dtype: ``fmt.linear(x, q)``."""
    return get_format(fmt).linear(x, q)


def qmm_t(g: torch.Tensor, fmt, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """g (..., N) @ Ŵ -> (..., K) in g's dtype: ``fmt.linear_t(g, q)``."""
    return get_format(fmt).linear_t(g, q)


def dequantize_into(fmt, q: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense weight Ŵ (N, K) (Triton on GPU, the reference elsewhere).

    With ``out=None`` on the FP4 GPU path the result lives in a reusable per-device BF16 workspace (one buffer per
    (device, dtype), sized to the largest weight seen) and is valid until the next call on that device: use it at
    once. ``out`` may be any float dtype; FP4 values are computed in float32 exactly as the reference does.
    """
    return _quant.dequantize_into(get_format(fmt), q, out)


__all__ = ["cuda_gemv_enabled", "bf16_gemv_enabled", "BF16Kernels", "cuda_dequant_enabled", "cuda_gemm_choice", "qmm", "qmm_t", "dequantize_into", "dequantize_relaid", "supports", "backend_for", "prepare", "kernel_config",
           "PackedFP4", "BACKENDS", "HAS_TRITON", "FP4Kernels", "BnbKernels"]
