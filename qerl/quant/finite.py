"""The finiteness check every format runs before quantizing.

No format can represent inf or NaN, and none fails loudly on them by itself: one ``inf`` makes NVFP4's global scale
0 (the whole tensor dequantizes to NaN), a NaN block gets MXFP4 exponent 0 (silently zeroed), NF4 turns the block
into NaN codes. A non-finite weight means a corrupt or diverged checkpoint, so ``quantize`` refuses it.
"""

from __future__ import annotations

import torch

from qerl.errors import UserError


class NonFiniteWeightError(UserError):
    """A weight holds inf/NaN and cannot be quantized. ``name`` is the tensor's name where the caller knows it."""

    def __init__(self, fmt: str, n_inf: int, n_nan: int, name: str | None = None):
        self.fmt, self.n_inf, self.n_nan, self.name = fmt, n_inf, n_nan, name
        n = n_inf + n_nan
        super().__init__(f"{name or 'the weight'} has {n} non-finite value{'s' * (n != 1)} ({n_inf} inf, {n_nan} nan); "
                         f"cannot quantize to {fmt} (the checkpoint is corrupt or its training diverged)")

    @classmethod
    def of(cls, w: torch.Tensor, fmt: str, name: str | None = None) -> NonFiniteWeightError:
        """The error for ``w``, with its inf and NaN counts (only built on the failure path: it reads all of w)."""
        return cls(fmt, int(torch.isinf(w).sum()), int(torch.isnan(w).sum()), name)


def check_finite(w: torch.Tensor, fmt: str) -> None:
    """Raise :class:`NonFiniteWeightError` unless every element of ``w`` is finite (one pass, one host sync)."""
    if not bool(torch.isfinite(w).all()):
        raise NonFiniteWeightError.of(w, fmt)
