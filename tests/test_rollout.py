"""The sampler: its log-probs/entropies equal teacher forcing, EOS/truncation bookkeeping, sampling law."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_teacher_forced, perturb_lora_b

from qerl.lora import LoraSpec
from qerl.model import load_policy
from qerl.quant import FORMATS
from qerl.rollout import Rollout, Sampler, filter_logits, sample_from_logits

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", "nvfp4", LoraSpec(rank=4), device="cpu")
    perturb_lora_b(policy)  # the sampler and the update must use the adapter too
    return policy, tok


@pytest.mark.parametrize("fmt", [f for f in FORMATS if 64 % (FORMATS[f].block or 1) == 0])  # tiny: K = 64
def test_sampler_logprobs_and_entropy_equal_teacher_forcing(fmt):
    torch.manual_seed(1)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=4), train_norms=True, device="cpu")
    perturb_lora_b(policy)  # the sampler and the update must use the adapter too
    s = Sampler(policy, tok, 64)
    # prompts of different lengths: left padding, per-row positions, prefix shared by G = 3 samples
    ro = s.generate(["how many apples are there", "3 + 4", "a"], 3, max_new_tokens=12, temperature=0.9, seed=3)
    assert ro.completion_ids.shape[0] == 9 and ro.prompt_ids.shape[0] == 9
    assert ro.completion_mask.any()
    assert_teacher_forced(policy, ro, 0.9)


def test_eos_mask_truncation_and_texts():
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", "bf16", LoraSpec(rank=4), device="cpu")
    s = Sampler(policy, tok, 64)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():  # EOS logit ≈ 4.4 on typical states: p(EOS) ≈ 0.1 per step, so some rows stop early
        ids = torch.randint(0, 700, (8, 16))
        h = policy.model(input_ids=ids).last_hidden_state.reshape(-1, 64).mean(0)
        policy.lm_head.weight[eos] = 4.4 * h / h.pow(2).sum()
    ro = s.generate(["one two three"] * 4, 4, max_new_tokens=20, seed=0)
    for i in range(ro.completion_ids.shape[0]):
        row, mask = ro.completion_ids[i], ro.completion_mask[i]
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()           # a prefix
        hits = (row[:n] == eos).nonzero()
        if ro.truncated[i]:
            assert len(hits) == 0 and n == row.shape[0]
        else:
            assert hits.numel() == 1 and int(hits[0]) == n - 1  # ends with its first EOS
            assert (row[n:] == s.pad_id).all()
        assert (ro.logp[i, n:] == 0).all() and (ro.entropy[i, n:] == 0).all()
        assert ro.texts[i] == tok.decode(row[:n].tolist(), skip_special_tokens=True)
    assert ro.truncated.any() and (~ro.truncated).any()


def test_seeded_sampling_is_reproducible(tiny):
    policy, tok = tiny
    s = Sampler(policy, tok, 64)
    a = s.generate(["x y z"], 4, max_new_tokens=8, seed=5)
    b = s.generate(["x y z"], 4, max_new_tokens=8, seed=5)
    c = s.generate(["x y z"], 4, max_new_tokens=8, seed=6)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


@pytest.mark.parametrize("fused", [True, False])
def test_shorter_prompts_reuse_the_buffers_and_draw_what_a_fresh_sampler_draws(tiny, fused):
    """The prompt length is data, not shape: a batch of shorter prompts than the last reuses the sampler's cache
    (and, on CUDA, its captured graphs) and draws exactly what a fresh sampler draws; a longer batch rebuilds them
    (``stats["state_built"]``)."""
    policy, tok = tiny
    long_, short, longer = (["how many apples are there in the basket", "3 + 4"], ["a b", "3"],
                            ["how many apples are there in the basket now, and how many pears are left"])
    s = Sampler(policy, tok, 64, fused=fused)
    kw = dict(max_new_tokens=9, temperature=0.9, seed=3)
    assert s.generate(long_, 2, **kw).stats["state_built"]
    first = s._static
    for prompts in (short, long_):  # reused, the extra slots masked; then the first length again
        ro = s.generate(prompts, 2, **kw)
        assert not ro.stats["state_built"] and s._static is first and ro.stats["fused_decode"] is fused
        fresh = Sampler(policy, tok, 64, fused=fused).generate(prompts, 2, **kw)
        assert fresh.stats["state_built"] and fresh.prompt_ids.shape[1] <= first["Lp_alloc"]
        for f in ("completion_ids", "completion_mask", "logp", "entropy"):
            assert torch.equal(getattr(ro, f), getattr(fresh, f)), f
    assert s.generate(longer + short[:1], 2, **kw).stats["state_built"] and s._static is not first  # longer: rebuilt
    assert not s.generate(short, 2, **kw).stats["state_built"]  # and kept for the shorter ones after it
    assert s.generate(short, 1, **kw).stats["state_built"]  # another batch shape (N = 2): its own buffers


def test_reuse_switch_restores_the_rebuild_on_every_new_prompt_length(tiny, monkeypatch):
    """QERL_SAMPLER_REUSE=0 (session 57's rule, for same-run comparisons): a shorter batch gets new buffers; the same
    length keeps them; a bad value names the valid ones."""
    policy, tok = tiny
    monkeypatch.setenv("QERL_SAMPLER_REUSE", "0")
    s = Sampler(policy, tok, 64)
    kw = dict(max_new_tokens=4, temperature=0.9, seed=3)
    assert s.generate(["how many apples are there in the basket", "3 + 4"], 2, **kw).stats["state_built"]
    assert s.generate(["a b", "3"], 2, **kw).stats["state_built"]  # shorter: rebuilt under this rule
    assert not s.generate(["a c", "4"], 2, **kw).stats["state_built"]  # the same padded length: kept
    monkeypatch.setenv("QERL_SAMPLER_REUSE", "yes")
    with pytest.raises(ValueError, match=r"QERL_SAMPLER_REUSE.*\['0', '1'\].*'yes'"):
        s.generate(["a b", "3"], 2, **kw)


def test_sampling_law_top_k_top_p():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    z = p.log()[None].repeat(40000, 1)
    gen = torch.Generator().manual_seed(0)
    for top_k, top_p, expect in [(0, 1.0, p), (2, 1.0, torch.tensor([0.625, 0.375, 0, 0])),
                                 (0, 0.8, torch.tensor([0.625, 0.375, 0, 0])),
                                 (0, 0.81, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)]:
        tok, lp, ent = sample_from_logits(z, 1.0, top_k, top_p, gen)
        freq = torch.bincount(tok, minlength=4).float() / len(tok)
        assert (freq - expect).abs().max() < 0.01, (top_k, top_p, freq)
        torch.testing.assert_close(lp, p.log()[tok])  # log-probs of the untruncated distribution
        torch.testing.assert_close(ent, -(p * p.log()).sum().expand(len(tok)))
    # temperature sharpens
    tok, _, _ = sample_from_logits(z, 0.25, 0, 1.0, gen)
    assert (tok == 0).float().mean() > 0.8


def test_filter_logits_hand_computed():
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.isinf(filter_logits(z, 2, 1.0)[0, 2:]).all() and torch.isfinite(filter_logits(z, 2, 1.0)[0, :2]).all()
    p = z.softmax(-1)[0]  # 0.644, 0.237, 0.087, 0.032
    kept = torch.isfinite(filter_logits(z, 0, 0.7)[0])
    assert kept.tolist() == [True, True, False, False]
    assert float(p[0]) < 0.7 < float(p[0] + p[1])


def test_select_and_cat_groups(tiny):
    policy, tok = tiny
    s = Sampler(policy, tok, 64)
    ro = s.generate(["a b", "c d e f", "g"], 2, max_new_tokens=6, seed=1)
    sub = ro.select_groups(torch.tensor([True, False, True]))
    assert sub.completion_ids.shape[0] == 4
    assert torch.equal(sub.completion_ids[2:], ro.completion_ids[4:])
    ro2 = s.generate(["h i j k l m n"], 2, max_new_tokens=4, seed=2)
    both = Rollout.cat([sub, ro2], s.pad_id)
    assert both.completion_ids.shape == (6, 6) and both.prompt_ids.shape[1] == max(sub.prompt_ids.shape[1],
                                                                                  ro2.prompt_ids.shape[1])
    assert both.texts == sub.texts + ro2.texts
    assert_teacher_forced(policy, both, 1.0, entropy=False)  # still consistent after left/right re-padding
