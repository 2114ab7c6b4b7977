"""NF4 on CUDA through bitsandbytes' own kernels (``BnbKernels``: gemv_4bit for one token, dequantize + matmul
else); the quantization state built once per weight. Registered for the NF4 format by ``qerl.kernels``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from qerl.kernels.base import _stamp

_BNB_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _nf4_on_gpu(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def _bnb_state(q: Mapping[str, torch.Tensor], device: torch.device):
    packed = q["weight_packed"]
    hit = _BNB_STATES.get(packed)
    if hit is not None and hit[0] == _stamp(packed):
        return hit[1]
    from qerl.quant.nf4 import to_bnb_quant_state
    state = to_bnb_quant_state(q, device)
    _BNB_STATES[packed] = (_stamp(packed), state)
    return state


def _bnb_dequant(q: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    import bitsandbytes.functional as bnbf
    return bnbf.dequantize_4bit(q["weight_packed"], _bnb_state(q, device))


def _bnb_matmul(x: torch.Tensor, q: Mapping[str, torch.Tensor]) -> torch.Tensor:
    import bitsandbytes as bnb
    state = _bnb_state(q, x.device)
    w = q["weight_packed"]
    if x.dtype != state.dtype:
        return F.linear(x, _bnb_dequant(q, x.device).to(x.dtype))
    return bnb.matmul_4bit(x, w.t(), quant_state=state)


class BnbKernels:
    """NF4 through bitsandbytes' own kernels on CUDA (gemv_4bit for one token, dequantize + matmul else)."""

    def backend(self, fmt, x, q=None):
        return "bnb" if _nf4_on_gpu(x) else None

    def linear(self, fmt, x, q):
        return _bnb_matmul(x, q) if _nf4_on_gpu(x) else None

    def linear_t(self, fmt, g, q):
        return torch.matmul(g, _bnb_dequant(q, g.device).to(g.dtype)) if _nf4_on_gpu(g) else None

    def dequantize(self, fmt, q, out):
        packed = q["weight_packed"]
        if not (packed.is_cuda and _nf4_on_gpu(packed)):
            return None
        w = _bnb_dequant(q, packed.device)
        return w if out is None else out.copy_(w)
