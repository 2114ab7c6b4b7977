"""BF16: the unquantized baseline (the weight is stored as bfloat16, nothing else)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qerl.quant import base
from qerl.quant.finite import check_finite


class BF16Format(base.FormatBase):
    """Handler that keeps the weight dense in bfloat16."""

    name = "bf16"
    block = None
    label, color = "BF16", "#1f77b4"
    checkpoint = None  # a dense checkpoint
    fusable = True
    reference_backend = "dense"  # the reference is the fast path: F.linear on the stored weight
    kernels = None


    def check_shape(self, n: int, k: int) -> None:
        """Any positive (n, k) is fine."""
        if n <= 0 or k <= 0:
            raise ValueError(f"bf16 needs a non-empty weight, got shape ({n}, {k})")

    @torch.no_grad()
    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"weight": w (N, K) as bfloat16}; NonFiniteWeightError if it holds inf/NaN (or overflows bfloat16)."""
        self.checked_shape(w)
        out = w.detach().to(torch.bfloat16)
        check_finite(out, self.name)  # on the result, so a float32 value beyond bfloat16's range is caught too
        return {"weight": out}

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The stored weight in ``dtype``."""
        return q["weight"].to(dtype)

    def bits_per_weight(self, n: int, k: int) -> float:
        """16."""
        return 16.0
