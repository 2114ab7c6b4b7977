"""shared/DESIGN.md's promise, kept: a weight format is one unit. This file defines a throwaway sixth format (INT8,
symmetric, one scale per output row), registers it at runtime (one registry entry, nothing else changed anywhere),
and trains one smoke step with it: config validation, loading, QuantLoRALinear, the fused decode and the loop all ask
the registry and the format object, so nothing else needs to know it exists.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qerl.config import load_config
from qerl.quant import FORMATS, base
from qerl.quant.finite import check_finite


class RowInt8Format:
    """INT8 weight-only, symmetric, one float32 scale per output row: q = round(w / s), s = amax_row / 127."""

    name = "int8row"
    block = None
    label, color = "INT8-row", "#17becf"
    checkpoint = None
    fusable = True  # every tensor is per row: q|k|v concatenate
    reference_backend = "torch_reference"
    kernels = None
    calls = 0  # linear + linear_t calls, to see that the run went through this object

    def check_shape(self, n: int, k: int) -> None:
        base.check_block_shape(self, n, k)

    @torch.no_grad()
    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        check_finite(w, self.name)
        scale = (w.detach().float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)  # (N, 1)
        q = torch.round(w.detach().float() / scale).clamp(-127, 127).to(torch.int8)
        return {"weight_packed": q, "weight_scale": scale}

    def dequantize(self, q: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (q["weight_packed"].float() * q["weight_scale"]).to(dtype)

    def linear(self, x, q):
        type(self).calls += 1
        return base.linear(self, x, q)

    def linear_t(self, g, q):
        type(self).calls += 1
        return base.linear_t(self, g, q)

    def bits_per_weight(self, n: int, k: int) -> float:
        return 8.0 + 32.0 / k


def test_a_sixth_format_registered_at_runtime_trains_one_step(tmp_path, monkeypatch):
    from qerl.lora import QuantLoRALinear, packed_state
    from qerl.model import build_policy
    from qerl.train import run

    fmt = RowInt8Format()
    monkeypatch.setitem(FORMATS, fmt.name, fmt)  # the one registry line, at runtime
    cfg = load_config(["scale=smoke", "quant=bf16", f"quant.format={fmt.name}", "aqn=off", "train.steps=1",
                       "train.batch_size=8", "algo.group_size=4", "train.micro_batch=8", "data.max_new_tokens=16",
                       "algo.ppo_epochs=1", "train.save_every=0", "train.progress=false", "eval.sets=[]",
                       "optim.name=adamw", f"out_dir={tmp_path}"])
    assert cfg.quant.format == fmt.name

    policy, _ = build_policy(cfg, torch.device("cpu"))
    mods = [m for m in policy.modules() if isinstance(m, QuantLoRALinear)]
    assert mods and all(m.fmt is fmt for m in mods)
    before = {k: v.clone() for k, v in packed_state(policy).items()}
    del policy

    summary = run(cfg)
    assert summary["finished"]
    assert RowInt8Format.calls > 0  # forward (rollout and update) and backward went through the format object
    metrics = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 1
    # the frozen base the run would rebuild is the same packed tensors (quantization is deterministic)
    again, _ = build_policy(cfg, torch.device("cpu"))
    assert all(torch.equal(before[k], v) for k, v in packed_state(again).items())
