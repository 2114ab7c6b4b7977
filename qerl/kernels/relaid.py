"""One resident copy of an FP4 base: the CUDA kernels' re-laid-out layout in place of the compressed-tensors one.

In ``quant.layout=compressed`` an NVFP4/MXFP4 linear keeps its compressed-tensors tensors (``weight_packed`` (N, K/2) uint8,
``weight_scale``, NVFP4's ``weight_global_scale``) and, on a GPU where the CUDA FP4 kernels build, the decode GEMV
and mid-M GEMM make a second copy of the same size in their own layout (``cuda_fp4.prepare``: lane-major mma A
fragments and paired scales) — +0.56 bytes per weight while both live. ``quant.layout=kernel``
(``load_policy(layout="kernel")``; ``auto``, the default, picks it wherever the CUDA FP4 kernels run) keeps only
the kernels' copy: ``qerl.fastdecode.relayout_model`` converts each
linear (a fused q|k|v or gate|up group as one weight, the members keeping row views of it, so decode still reads one
buffer) and drops the compressed-tensors tensors. The module then holds

    ``weight_relaid``        int32 (N/16, K/64, 32, 4)  the fragment words
    ``weight_relaid_scale``  int16 (N/16, K/64, 8·64/G)  the scale pairs
    ``weight_relaid_bexp``   int32 (1,)                  the decode exponent B (MXFP4: per weight or group)
    ``weight_global_scale``  float32 (1,)                NVFP4 only, unchanged

and ``qerl.kernels`` serves every product from them: the CUDA GEMV (M <= 16) and GEMM (mid M) as before, and
elsewhere (large M, the backward, ``dequantize_into``) the dense weight rebuilt by ``dequantize_relaid`` for
cuBLAS, bit-exact with the compressed-tensors dequantization. Checkpoints, state dicts and
``QuantLoRALinear.compressed()`` convert back (``cuda_fp4.to_compressed``), so what is saved is the
compressed-tensors checkpoint it would have been. A weight is converted only where the round trip is exact
(``cuda_fp4.relayout_is_exact``; else it keeps its compressed-tensors copy and the second copy comes back on use).
On the CPU the same layout works through the pure-torch conversion (tests), slowly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

from qerl.quant.base import LAYOUTS

NAMES = ("weight_relaid", "weight_relaid_scale", "weight_relaid_bexp")
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()
# MXFP4's decode exponent by the storage of its fragment words (a fused group's members share it), set where the
# tensors are made or overwritten, so that a view seen first inside a CUDA-graph capture needs no host sync
_BEXP: dict[int, int] = {}


def note_bexp(qweight: torch.Tensor, bexp: int) -> None:
    """Record the decode exponent of the fragment words in ``qweight``'s storage (see ``_BEXP``)."""
    _BEXP[qweight.untyped_storage().data_ptr()] = int(bexp)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"quant.layout={layout!r}: valid layouts are {list(LAYOUTS)} (auto: kernel where the CUDA "
                         f"FP4 kernels run, else compressed; compressed: the compressed-tensors tensors, plus the CUDA "
                         f"kernels' copy where they run; kernel: only the CUDA kernels' re-laid-out copy)")
    return layout


def is_relaid(q: Mapping[str, torch.Tensor]) -> bool:
    """True when ``q`` holds the kernels' re-laid-out copy instead of the compressed-tensors tensors."""
    return "weight_relaid" in q


def _encoding(fmt) -> str:
    from qerl.kernels.base import _CUDA_ENCODINGS, _fp4_id

    enc = _CUDA_ENCODINGS.get((_fp4_id(fmt), getattr(fmt, "block", None)))
    if enc is None:
        raise ValueError(f"{fmt!r}: the re-laid-out layout exists for NVFP4 (block 16) and MXFP4 (block 32) only")
    return enc


def weight(fmt, q: Mapping[str, torch.Tensor]):
    """The ``cuda_fp4.CudaFP4Weight`` of a re-laid-out ``q`` (views of its tensors; cached per tensor: the decode
    exponent is read once, with one host sync, so call it eagerly before a CUDA-graph capture)."""
    from qerl.kernels import cuda_fp4

    qw, sc = q["weight_relaid"], q["weight_relaid_scale"]
    stamp = (qw.data_ptr(), sc.data_ptr(), qw._version, tuple(qw.shape))
    hit = _CACHE.get(qw)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    enc = _encoding(fmt)
    if enc == "nvfp4":
        bexp = cuda_fp4.NV_BEXP
    else:
        bexp = _BEXP.get(qw.untyped_storage().data_ptr())
        if bexp is None:  # one host sync (not allowed inside a capture: relayout_model notes every group)
            bexp = int(q["weight_relaid_bexp"].reshape(-1)[0].item())
    gs = q.get("weight_global_scale") if enc == "nvfp4" else None
    w = cuda_fp4.weight_from(enc, qw, sc, None if gs is None else gs.reshape(1).to(torch.float32), bexp)
    _CACHE[qw] = (stamp, w)
    return w


def from_compressed(fmt, q: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The re-laid-out tensors of a compressed-tensors ``q`` (on its device), or None where the kernels' layout
    cannot hold it exactly (shape not a multiple of 16 x 64, exponents outside the decode window, rewritten zero
    blocks: ``cuda_fp4.relayout_is_exact``)."""
    from qerl.kernels import cuda_fp4

    enc = _encoding(fmt)
    packed, scale = q["weight_packed"], q["weight_scale"]
    try:
        w = cuda_fp4.prepare(enc, packed, scale, q.get("weight_global_scale"))
    except ValueError:
        return None
    if not cuda_fp4.relayout_is_exact(enc, w, packed, scale):
        return None
    out = {"weight_relaid": w.qweight, "weight_relaid_scale": w.scales,
           "weight_relaid_bexp": torch.tensor([w.bexp], dtype=torch.int32, device=packed.device)}
    if w.global_scale is not None:
        out["weight_global_scale"] = q["weight_global_scale"]
    return out


def to_compressed(fmt, q: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of ``q`` (converted back when it is re-laid out; ``q`` itself otherwise), in
    the checkpoint's key order."""
    if not is_relaid(q):
        return dict(q)
    from qerl.kernels import cuda_fp4

    back = cuda_fp4.to_compressed(weight(fmt, q))
    if "weight_global_scale" in back:
        back["weight_global_scale"] = q["weight_global_scale"]  # the module's own tensor (dtype and shape kept)
    names = fmt.checkpoint.tensors if fmt.checkpoint is not None else tuple(back)
    return {n: back[n] for n in names if n in back}
