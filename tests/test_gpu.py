"""GPU checks of the policy and sampler (run on a CUDA host: `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from conftest import perturb_lora_b

from qerl.lora import LoraSpec, packed_state
from qerl.model import load_policy
from qerl.quant import FORMATS
from qerl.rollout import Sampler
from qerl.train import completion_logprobs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("fmt", [f for f in FORMATS if 64 % (FORMATS[f].block or 1) == 0])  # tiny: K = 64
def test_graph_sampler_matches_teacher_forcing_on_gpu(fmt):
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)  # the sampler and the update must use the adapter too
    s = Sampler(policy, tok, 128, cuda_graphs=True)
    ro = s.generate(["how many apples", "3 + 4 is", "a"], 4, max_new_tokens=40, temperature=1.0, seed=1)
    assert s.use_graphs and ro.stats["decode_steps"] > 1
    with torch.no_grad():
        lp, ent = completion_logprobs(policy, ro, slice(0, 12), 1.0, True)
    m = ro.completion_mask
    # bf16 activations: sampler (graph decode, manual attention) vs HF forward agree to bf16 noise
    assert (lp[m] - ro.logp[m]).abs().mean() < 0.02, (lp[m] - ro.logp[m]).abs().mean()
    assert (ent[m] - ro.entropy[m]).abs().mean() < 0.02
    eager = Sampler(policy, tok, 128, cuda_graphs=False).generate(["how many apples", "3 + 4 is", "a"], 4,
                                                                   max_new_tokens=40, temperature=1.0, seed=1)
    assert abs(eager.logp[eager.completion_mask].mean() - ro.logp[m].mean()) < 0.5


@pytest.mark.parametrize("fmt", [f for f in FORMATS if 64 % (FORMATS[f].block or 1) == 0])  # tiny: K = 64
def test_gpu_training_step_updates_lora_only(fmt):
    torch.manual_seed(0)
    policy, _ = load_policy("preset:tiny", fmt, LoraSpec(rank=8), device="cuda")
    perturb_lora_b(policy)  # the sampler and the update must use the adapter too
    before = {k: v.clone() for k, v in packed_state(policy).items()}
    params = [p for p in policy.parameters() if p.requires_grad]
    old = [p.detach().clone() for p in params]
    ids = torch.randint(0, 700, (4, 64), device="cuda")
    policy(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(params, lr=1e-3, weight_decay=0).step()
    assert all(not torch.equal(a, p) for a, p in zip(old, params, strict=True))
    assert all(torch.equal(before[k], v) for k, v in packed_state(policy).items())


def test_full_finetune_graph_decode_reads_live_weights():
    """Full fine-tuning keeps fp32 weights and samples under bf16 autocast. With autocast's cast cache on, the
    captured decode graphs read bf16 weight copies freed after the first rollout: later rollouts sampled garbage
    (every completion 2 tokens on the H100 bf16-full runs). The log-probs the graph decode records must be those of
    the live policy (teacher forcing), also after the freed memory is reused and after an in-place weight update."""
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", "bf16", None, device="cuda", full_finetune=True)
    assert policy.get_input_embeddings().weight.dtype == torch.float32
    prompts, kw = ["how many apples", "3 + 4 is", "a"], dict(max_new_tokens=40, temperature=1.0, seed=1)
    graph = Sampler(policy, tok, 128, cuda_graphs=True)
    for round_ in range(3):
        ro = graph.generate(prompts, 4, **kw)
        assert graph.use_graphs and ro.stats["graphs"] > 0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # the live policy scores the samples
            lp, _ = completion_logprobs(policy, ro, slice(0, 12), 1.0, False)
        m = ro.completion_mask
        gap = (lp[m].float() - ro.logp[m]).abs().mean()
        assert gap < 0.05, f"round {round_}: the graph decode sampled from other weights (mean |Δ log p| {gap:.3f})"
        junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(64)]  # reuse freed memory
        del junk
        with torch.no_grad():  # an optimizer step updates the fp32 weights in place (same addresses)
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
