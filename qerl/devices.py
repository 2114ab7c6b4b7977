"""Where a run computes: the device resolver and the autocast rule, one definition each."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; any other name as torch reads it (CUDA must be available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} was asked but CUDA is not available")
    return dev


def autocast_for(model: nn.Module, device: torch.device, cache_enabled: bool = True):
    """BF16 autocast on CUDA for a model whose weights are fp32 masters (full fine-tuning), else a no-op context.
    ``cache_enabled=False`` where CUDA graphs are captured inside (the sampler): see ``Sampler._autocast``."""
    w = model.get_input_embeddings().weight
    if device.type == "cuda" and w.dtype == torch.float32:
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache_enabled)
    return contextlib.nullcontext()
