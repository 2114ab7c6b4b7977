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


def assert_teacher_forced(policy, ro, temperature: float, atol: float = 2e-5, entropy: bool = True) -> None:
    """The sampler's per-token log-probs (and entropies) equal the training forward's (teacher forcing), to
    ``atol``, on every generated token of every row of the rollout ``ro``."""
    from qerl.train import completion_logprobs

    with torch.no_grad():
        lp, ent = completion_logprobs(policy, ro, slice(0, ro.completion_ids.shape[0]), temperature, entropy)
    m = ro.completion_mask
    torch.testing.assert_close(lp[m], ro.logp[m], rtol=0, atol=atol)
    if entropy:
        torch.testing.assert_close(ent[m], ro.entropy[m], rtol=0, atol=atol)
