"""qerl.algos against hand-computed numbers and a float64 full-softmax reference."""

import math

import pytest
import torch

from qerl import algos

# ---------------------------------------------------------------------------------------------------------------------
# advantages


def test_group_advantages_hand_computed():
    # group 1: [1, 0, 0]: mean 1/3, unbiased var ((2/3)^2 + 2*(1/3)^2)/2 = 1/3
    # group 2: [2.2, 2.2, 0.2]: mean 23/15, deviations 2/3, 2/3, -4/3, unbiased var (4/9+4/9+16/9)/2 = 4/3
    r = torch.tensor([1.0, 0.0, 0.0, 2.2, 2.2, 0.2], dtype=torch.float64)
    s1, s2 = math.sqrt(1 / 3) + 1e-4, math.sqrt(4 / 3) + 1e-4
    want = torch.tensor(
        [(2 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1, (2 / 3) / s2, (2 / 3) / s2, (-4 / 3) / s2],
        dtype=torch.float64,
    )
    got = algos.group_advantages(r, G=3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # population std would give (2/3)/(sqrt(2/9)+1e-4) = 1.414 for the first entry, not 1.1545: make sure we differ
    assert abs(got[0].item() - (2 / 3) / (math.sqrt(2 / 9) + 1e-4)) > 0.2
    # Dr. GRPO: no std division
    torch.testing.assert_close(
        algos.group_advantages(r, G=3, std_norm=False),
        torch.tensor([2 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -4 / 3], dtype=torch.float64),
    )


def test_group_advantages_equal_rewards_and_errors():
    r = torch.tensor([0.2, 0.2, 0.2, 0.2])
    assert torch.equal(algos.group_advantages(r, G=2), torch.zeros(4))
    with pytest.raises(ValueError, match="multiple of G"):
        algos.group_advantages(torch.zeros(5), G=2)
    with pytest.raises(ValueError, match="G >= 2"):
        algos.group_advantages(torch.zeros(3), G=1)


# ---------------------------------------------------------------------------------------------------------------------
# clipped loss


def _one_token_rows(ratios, advs):
    old = torch.zeros(len(ratios), 1, dtype=torch.float64)
    logp = torch.tensor([[math.log(x)] for x in ratios], dtype=torch.float64, requires_grad=True)
    return logp, old, torch.tensor(advs, dtype=torch.float64), torch.ones(len(ratios), 1, dtype=torch.bool)


def test_asymmetric_clipping_values_and_grads():
    # per token: loss = -min(ρA, clip(ρ, 0.8, 1.28)A); d loss/d logp = -ρA when the unclipped branch is active, else 0
    cases = [  # (ρ, A, loss, grad)
        (1.5, +1.0, -1.28, 0.0),  # above 1+0.28 with A>0: clipped
        (1.5, -1.0, 1.5, 1.5),  # above with A<0: min picks the unclipped -1.5
        (0.5, +1.0, -0.5, -0.5),  # below with A>0: unclipped 0.5 is the min
        (0.5, -1.0, 0.8, 0.0),  # below 1-0.2 with A<0: clipped
        (1.25, +1.0, -1.25, -1.25),  # inside [0.8, 1.28]; a symmetric 0.2 clip would cut this at 1.2
        (0.75, -1.0, 0.8, 0.0),  # below 0.8, A<0: clipped
    ]
    logp, old, adv, mask = _one_token_rows([c[0] for c in cases], [c[1] for c in cases])
    loss, stats = algos.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="token_mean")
    want = sum(c[2] for c in cases) / 6
    assert loss.item() == pytest.approx(want, abs=1e-12)
    loss.backward()
    want_grad = torch.tensor([[c[3] / 6] for c in cases], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-12, atol=1e-12)
    assert stats["clip_low_frac"].item() == pytest.approx(2 / 6)
    assert stats["clip_high_frac"].item() == pytest.approx(1 / 6)
    assert stats["clip_frac"].item() == pytest.approx(3 / 6)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 1.5 + 0.5 + 0.5 + 1.25 + 0.75) / 6)
    assert stats["ratio_max"].item() == pytest.approx(1.5)


def test_symmetric_clip_cuts_where_asymmetric_does_not():
    logp, old, adv, mask = _one_token_rows([1.25], [1.0])
    loss, stats = algos.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clip_high_frac"].item() == 1.0


def _ragged():
    # row 0: 3 tokens, ρ = 1.0, 1.1, 0.9, A = +1 -> losses -1.0, -1.1, -0.9 (none clipped)
    # row 1: 1 token, ρ = 1.2, A = -2 -> -min(-2.4, -2.4) = 2.4; two padded positions with a huge log-ratio
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor(
        [[0.0, math.log(1.1), math.log(0.9)], [math.log(1.2), 1000.0, 1000.0]], dtype=torch.float64
    ).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return logp, old, torch.tensor([1.0, -2.0], dtype=torch.float64), mask


@pytest.mark.parametrize(
    "agg,max_len,want,grad",
    [
        # Σℓ/#tokens = (-3.0 + 2.4)/4; d/dlogp = -ρA/4
        ("token_mean", None, -0.15, [[-1.0 / 4, -1.1 / 4, -0.9 / 4], [2.4 / 4, 0, 0]]),
        # mean over rows of row means = (-3.0/3 + 2.4/1)/2; row 0 grads / (3*2), row 1 / (1*2)
        ("seq_mean", None, 0.7, [[-1.0 / 6, -1.1 / 6, -0.9 / 6], [2.4 / 2, 0, 0]]),
        # Σℓ/(N·L_max) with L_max = T = 3: -0.6/6
        ("seq_sum_norm", 3, -0.1, [[-1.0 / 6, -1.1 / 6, -0.9 / 6], [2.4 / 6, 0, 0]]),
        # Σℓ/(N·L_max) with L_max = 5: -0.6/10
        ("seq_sum_norm", 5, -0.06, [[-1.0 / 10, -1.1 / 10, -0.9 / 10], [2.4 / 10, 0, 0]]),
    ],
)
def test_aggregation_on_ragged_mask(agg, max_len, want, grad):
    logp, old, adv, mask = _ragged()
    loss, stats = algos.policy_loss(logp, old, adv, mask, agg=agg, max_len=max_len)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert stats["clip_frac"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx((1.0 + 1.1 + 0.9 + 1.2) / 4)


def test_dr_grpo_normaliser_is_the_generation_budget_not_the_width():
    """Dr. GRPO divides by N·max_new_tokens, a constant: padding the same rows wider changes nothing, and the
    width is never used as a fallback (it changes every step)."""
    logp, old, adv, mask = _ragged()  # width T = 3
    wide = torch.cat([logp.detach(), torch.full((2, 2), 1000.0, dtype=torch.float64)], 1).requires_grad_()  # T = 5
    wide_mask = torch.cat([mask, torch.zeros(2, 2, dtype=mask.dtype)], 1)
    loss3, _ = algos.policy_loss(logp, old, adv, mask, agg="seq_sum_norm", max_len=8)
    loss5, _ = algos.policy_loss(wide, torch.zeros(2, 5, dtype=torch.float64), adv, wide_mask, agg="seq_sum_norm",
                                 max_len=8)
    for loss in (loss3, loss5):
        assert loss.item() == pytest.approx(-0.6 / 16, abs=1e-15)  # Σℓ = -0.6, N·L = 2·8
    loss5.backward()
    torch.testing.assert_close(wide.grad, torch.tensor([[-1.0 / 16, -1.1 / 16, -0.9 / 16, 0, 0],
                                                        [2.4 / 16, 0, 0, 0, 0]], dtype=torch.float64))
    for bad in (None, 2):  # missing, or narrower than the completions it normalises
        with pytest.raises(ValueError, match=rf"max_len \(max_new_tokens\).*width T=3; got max_len={bad}"):
            algos.policy_loss(logp, old, adv, mask, agg="seq_sum_norm", max_len=bad)


def test_merge_loss_stats_hand_computed():
    # micro-batch a: 2 tokens, loss weight 0.25; b: 6 tokens, loss weight 0.75 (a token_mean minibatch of 8 tokens)
    a = {"pg_loss": 1.0, "clip_frac": 0.5, "ratio_mean": 1.2, "ratio_max": 1.5}
    b = {"pg_loss": -1.0, "clip_frac": 0.0, "ratio_mean": 1.0, "ratio_max": 2.0}
    parts = [({k: torch.tensor(v) for k, v in a.items()}, torch.tensor(2), 0.25),
             ({k: torch.tensor(v) for k, v in b.items()}, torch.tensor(6), 0.75)]
    got = algos.merge_loss_stats(parts)
    assert got["pg_loss"] == pytest.approx(0.25 * 1.0 + 0.75 * -1.0)  # -0.5; the unweighted mean would say 0
    assert got["clip_frac"] == pytest.approx((0.5 * 2 + 0.0 * 6) / 8)  # 0.125, not 0.25
    assert got["ratio_mean"] == pytest.approx((1.2 * 2 + 1.0 * 6) / 8)  # 1.05, not 1.1
    assert got["ratio_max"] == pytest.approx(2.0)  # a max, not the mean 1.75
    # two updates (ppo_epochs = 2), each a whole minibatch: pg_loss is the mean of the two objectives
    twice = algos.merge_loss_stats(parts + [({**parts[0][0], "pg_loss": torch.tensor(3.0)}, torch.tensor(8), 1.0)])
    assert twice["pg_loss"] == pytest.approx((-0.5 + 3.0) / 2)
    assert twice["clip_frac"] == pytest.approx((0.5 * 2 + 0.5 * 8) / 16)
    assert algos.merge_loss_stats([]) == {}


@pytest.mark.parametrize("agg", sorted(algos.AGGREGATIONS))
def test_merged_micro_batch_stats_equal_the_whole_batch(agg):
    """Split a batch into uneven micro-batches the way train.py does: the merged stats are the whole batch's."""
    g = torch.Generator().manual_seed(3)
    N, T = 7, 6
    old = torch.randn(N, T, generator=g, dtype=torch.float64)
    logp = old + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)  # ratios on both sides of the clip
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor([6, 1, 3, 0, 5, 2, 6])[:, None]  # ragged, one empty row
    ref = torch.randn(N, T, generator=g, dtype=torch.float64)
    behav = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    kw = dict(agg=agg, max_len=8, tis_cap=1.2)
    _, whole = algos.policy_loss(logp, old, adv, mask, ref_logp=ref, behav_logp=behav, **kw)
    parts = []
    for rows in (slice(0, 4), slice(4, 6), slice(6, 7)):
        _, st = algos.policy_loss(logp[rows], old[rows], adv[rows], mask[rows], ref_logp=ref[rows],
                                  behav_logp=behav[rows], **kw)
        n_tok = mask[rows].sum()
        n_rows = rows.stop - rows.start
        parts.append((st, n_tok, n_tok / mask.sum() if agg == "token_mean" else n_rows / N))
    merged = algos.merge_loss_stats(parts)
    assert set(merged) == set(whole)
    for k, v in whole.items():
        assert merged[k] == pytest.approx(v.item(), rel=1e-6, abs=1e-7), k


def test_bad_agg_lists_choices():
    logp, old, adv, mask = _ragged()
    with pytest.raises(ValueError, match=r"'sum_all'.*seq_mean.*seq_sum_norm.*token_mean"):
        algos.policy_loss(logp, old, adv, mask, agg="sum_all")


def test_on_policy_old_none_gives_advantage_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = algos.policy_loss(logp, None, torch.tensor([3.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-3.0)  # ρ = 1
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5]]))


def test_k3_kl_term():
    # logp = ln .5, ref = ln .25: k3 = exp(-ln 2) + ln 2 - 1; d/dlogp = 1 - exp(ref - logp) = 0.5
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)
    loss, stats = algos.policy_loss(logp, None, adv, torch.ones(1, 1), ref_logp=ref, kl_coef=0.1)
    k3 = 0.5 + math.log(2) - 1
    assert loss.item() == pytest.approx(0.1 * k3, abs=1e-12)
    assert stats["kl"].item() == pytest.approx(k3, rel=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.05, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logp"):
        algos.policy_loss(logp, None, adv, torch.ones(1, 1), kl_coef=0.1)


def test_truncated_importance_sampling_weights():
    # exp(old - behav) = 3 -> capped at 2; 0.5 stays. On-policy, A = 1: per-token loss = -w, token mean
    old = torch.zeros(1, 2, dtype=torch.float64)
    behav = torch.tensor([[-math.log(3.0), math.log(2.0)]], dtype=torch.float64)
    logp = old.clone().requires_grad_()
    loss, stats = algos.policy_loss(
        logp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2), behav_logp=behav, tis_cap=2.0
    )
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]], dtype=torch.float64))
    assert stats["tis_weight_mean"].item() == pytest.approx(1.25)
    assert stats["tis_capped_frac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tis_cap"):
        algos.policy_loss(logp, old, torch.ones(1), torch.ones(1, 2), behav_logp=behav)


# ---------------------------------------------------------------------------------------------------------------------
# log-probs and entropy


def _reference(logits, tokens, temperature):
    z = logits.double() / temperature
    logq = torch.log_softmax(z, dim=-1)
    logp = logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(logq.exp() * logq).sum(-1)
    return logp, ent


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_entropy_vs_float64_reference(dtype, tol, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=g)).to(dtype)
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    logp, ent = algos.token_logprobs_and_entropy(logits, tokens, temperature=temperature, chunk=5)
    ref_lp, ref_ent = _reference(logits, tokens, temperature)  # reference sees the same (rounded) logits
    assert logp.dtype == torch.float32 and logp.shape == (3, 7)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=0, atol=tol)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=tol)


def test_logprob_gradient_vs_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 33, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 33, (2, 5), generator=g)
    up = torch.randn(2, 5, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    logp, _ = algos.token_logprobs_and_entropy(a, tokens, temperature=0.8, chunk=3)
    (logp * up).sum().backward()
    b = logits.clone().requires_grad_()
    ref_lp, _ = _reference(b, tokens, 0.8)
    (ref_lp * up).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


def test_chunking_invariance():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, 40, generator=g).requires_grad_()
    tokens = torch.randint(0, 40, (4, 9), generator=g)
    outs = []
    for chunk in [1, 4, 9, 10, 36, 1000, None]:
        lp, ent = algos.token_logprobs_and_entropy(logits, tokens, chunk=chunk)
        (grad,) = torch.autograd.grad(lp.sum(), logits)
        outs.append((lp, ent, grad))
    for lp, ent, grad in outs[1:]:
        torch.testing.assert_close(lp, outs[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ent, outs[0][1], rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, outs[0][2], rtol=0, atol=1e-7)


def test_entropy_with_masked_vocab_and_noncontiguous_logits():
    # -inf logits (a top-k-masked vocabulary) contribute 0 to the entropy; a sliced view needs no copy
    full = torch.randn(2, 6, 20)
    full[..., 10:] = float("-inf")
    logits = full[:, :-1]  # (2, 5, 20), non-contiguous
    tokens = torch.randint(0, 10, (2, 5))
    lp, ent = algos.token_logprobs_and_entropy(logits, tokens, chunk=3)
    ref_lp, ref_ent = _reference(logits[..., :10], tokens, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    # uniform over 10 tokens: entropy ln 10
    _, ent_u = algos.token_logprobs_and_entropy(torch.zeros(1, 1, 10), torch.zeros(1, 1, dtype=torch.long))
    assert ent_u.item() == pytest.approx(math.log(10), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# dynamic sampling, masks, mismatch


def test_dynamic_sampling_filter_and_refill():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.2, 2.2, 0.2])
    keep = algos.dynamic_sampling_filter(r, G=3)
    assert keep.tolist() == [False, True, False, True]
    idx, short = algos.select_groups(keep, need=1)
    assert idx.tolist() == [1] and short == 0
    idx, short = algos.select_groups(keep, need=3)
    assert idx.tolist() == [1, 3] and short == 1
    assert algos.group_rows(idx, 3).tolist() == [3, 4, 5, 9, 10, 11]


def test_truncation_mask():
    cm = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    tr = torch.tensor([False, True, False])
    assert algos.truncation_mask(cm, tr).tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert torch.equal(algos.truncation_mask(cm, tr, mask_truncated=False), cm)


def test_mismatch_stats_hand_computed():
    s = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    t = torch.tensor([[math.log(0.25), math.log(0.25), -5.0]])
    m = torch.tensor([[1, 1, 0]])  # third position masked
    st = algos.mismatch_stats(s, t, m)
    ln2 = math.log(2)  # d = [ln 2, 0]
    assert st["abs_diff_mean"].item() == pytest.approx(ln2 / 2, rel=1e-6)
    assert st["abs_diff_max"].item() == pytest.approx(ln2, rel=1e-6)
    assert st["kl_k1"].item() == pytest.approx(ln2 / 2, rel=1e-6)
    assert st["kl_k2"].item() == pytest.approx(ln2**2 / 4, rel=1e-6)
    assert st["kl_k3"].item() == pytest.approx((0.5 - 1 + ln2) / 2, rel=1e-5)
    assert st["ratio_mean"].item() == pytest.approx(0.75, rel=1e-6)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert algos.masked_mean(x, m).item() == pytest.approx(13 / 4)
    assert algos.masked_mean(x, m, dim=1).tolist() == [1.5, 5.0]
    assert algos.masked_mean(x, torch.zeros_like(m)).item() == 0.0
