"""Shared test helpers."""

from __future__ import annotations

import torch

from qerl.lora import lora_modules


def perturb_lora_b(policy, std: float = 0.05) -> None:
    """Give every adapter a non-zero B (PEFT initialises B = 0), so its path is exercised."""
    with torch.no_grad():
        for m in lora_modules(policy).values():
            if m.rank:
                m.lora_B.weight.normal_(0, std)
