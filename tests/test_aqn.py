"""qerl.aqn: σ schedules (hand-computed, both modes) and noise on a tiny in-memory Qwen2."""

import math
import warnings

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from qerl import aqn

# ---------------------------------------------------------------------------------------------------------------------
# schedules


def test_paper_mode_stage_boundaries():
    # M = 600, K = 10: ⌊M/K⌋ = 60; stage k = ⌊(step-1)/60⌋; σ = 1e-2·0.05^((k-1)/9)
    s = lambda step, M=600: aqn.sigma_at(step, M, 1e-2, 5e-4, stages=10, mode="paper")  # noqa: E731
    assert s(1) == 0.0 and s(60) == 0.0
    assert s(61) == pytest.approx(1e-2, rel=1e-12) and s(120) == pytest.approx(1e-2, rel=1e-12)
    assert s(121) == pytest.approx(7.16871e-3, rel=1e-5)  # 1e-2·0.05^(1/9)
    assert s(540) == pytest.approx(9.72944e-4, rel=1e-5)  # k = 8: 1e-2·0.05^(7/9)
    assert s(541) == pytest.approx(6.97475e-4, rel=1e-5)  # k = 9: 1e-2·0.05^(8/9), σ_end = 5e-4 never reached
    assert s(600) == pytest.approx(6.97475e-4, rel=1e-5)
    # M = 605: the 5 leftover steps stay in stage K-1
    assert aqn.stage_at(601, 605, 10, "paper") == 9 and aqn.stage_at(605, 605, 10, "paper") == 9
    assert s(605, M=605) == pytest.approx(6.97475e-4, rel=1e-5)
    # M = 25: ⌊25/10⌋ = 2 steps per stage, steps 21..25 clamp to stage 9
    assert [aqn.stage_at(t, 25, 10, "paper") for t in (1, 2, 3, 4, 19, 20, 21, 25)] == [
        0,
        0,
        1,
        1,
        9,
        9,
        9,
        9,
    ]


def test_official_mode_boundaries_and_example():
    s = lambda step, M=600: aqn.sigma_at(step, M, 1e-2, 1e-4, stages=10, mode="official")  # noqa: E731
    # interval = ⌊step / (M/K)⌋ with M/K = 60: step 59 is the last noise-free step, 60 starts σ_start
    assert s(1) == 0.0 and s(59) == 0.0
    assert s(60) == pytest.approx(1e-2, rel=1e-12) and s(119) == pytest.approx(1e-2, rel=1e-12)
    assert s(120) == pytest.approx(5.62341e-3, rel=1e-5)  # 1e-2·(1e-2)^(1/8)
    assert s(540) == pytest.approx(1e-4, rel=1e-12) and s(600) == pytest.approx(1e-4, rel=1e-12)
    # QERL.md §3.5 example: 0, 1e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1e-4
    printed = [0, 1e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1e-4]
    got = [s(60 * i + (i == 0)) for i in range(10)]
    assert got[0] == 0.0
    np.testing.assert_allclose(got[1:], printed[1:], rtol=5e-3)
    # the official code's own expression: σs·(σe/σs)^(arange(K-1)/(K-2)), interval i >= 1 -> trend[i-1]
    trend = 1e-2 * (1e-4 / 1e-2) ** (np.arange(9) / 8)
    np.testing.assert_allclose(got[1:], trend, rtol=1e-12)
    # non-divisible M = 25: interval size 2.5
    m = [aqn.stage_at(t, 25, 10, "official") for t in (1, 2, 3, 4, 5, 22, 24, 25)]
    assert m == [0, 0, 1, 1, 2, 8, 9, 9]
    assert s(22, M=25) == pytest.approx(1.77828e-4, rel=1e-5)  # trend[7] = 1e-2·1e-2^(7/8)


@pytest.mark.parametrize("mode", ["paper", "official"])
@pytest.mark.parametrize("schedule", sorted(aqn.SCHEDULES))
def test_schedule_shapes_monotone_from_sigma_start(mode, schedule):
    K, M = 10, 100
    firsts = [next(t for t in range(1, M + 1) if aqn.stage_at(t, M, K, mode) == k) for k in range(K)]
    sig = [aqn.sigma_at(t, M, 5e-2, 5e-4, K, schedule, mode) for t in firsts]
    assert sig[0] == 0.0
    assert sig[1] == pytest.approx(5e-2, rel=1e-12)
    assert all(a > b for a, b in zip(sig[1:-1], sig[2:], strict=True)), sig
    if mode == "official":
        assert sig[-1] == pytest.approx(5e-4, rel=1e-9)
    else:
        assert sig[-1] > 5e-4 * (1 + 1e-6)  # u = 8/9 at the last stage


def test_schedule_midpoints_hand_computed():
    # paper mode with K = 11: stage k has u = (k-1)/10; M = 110 so stage 6 (u = 0.5) starts at step 61
    s, e = 4e-2, 1e-3
    at = lambda sch: aqn.sigma_at(61, 110, s, e, stages=11, schedule=sch)  # noqa: E731
    assert aqn.stage_at(61, 110, 11) == 6
    assert at("exponential") == pytest.approx(math.sqrt(4e-5), rel=1e-12)
    assert at("linear") == pytest.approx(0.0205, rel=1e-12)
    assert at("cosine") == pytest.approx(0.0205, rel=1e-12)
    assert at("logarithmic") == pytest.approx(0.04 - 0.039 * 0.7403627, rel=1e-6)  # log10(5.5)


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match=r"'step'.*cosine.*exponential.*linear.*logarithmic"):
        aqn.sigma_at(5, 100, 1e-2, 1e-4, schedule="step")
    with pytest.raises(ValueError, match=r"'vllm'.*official.*paper"):
        aqn.sigma_at(5, 100, 1e-2, 1e-4, mode="vllm")
    with pytest.raises(ValueError, match=">= 3"):
        aqn.sigma_at(5, 100, 1e-2, 1e-4, stages=2, mode="official")
    with pytest.raises(ValueError, match=">= 2"):
        aqn.sigma_at(5, 100, 1e-2, 1e-4, stages=1)
    assert aqn.sigma_at(51, 100, 1e-2, 1e-4, stages=2) == pytest.approx(1e-2)  # K = 2 is valid in paper mode
    with pytest.raises(ValueError, match="sigma_start"):
        aqn.sigma_at(5, 100, 0.0, 1e-4)
    with pytest.raises(ValueError, match="sigma_end"):
        aqn.sigma_at(5, 100, 1e-2, float("nan"))
    for bad in (0, 101):
        with pytest.raises(ValueError, match="1-based"):
            aqn.sigma_at(bad, 100, 1e-2, 1e-4)
    with pytest.raises(ValueError, match="total_steps >= stages"):
        aqn.sigma_at(1, 5, 1e-2, 1e-4, stages=10)


# ---------------------------------------------------------------------------------------------------------------------
# noise on a tiny Qwen2

BLOCK = {
    f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")
}


def tiny_qwen2(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # norms away from their all-ones init, so a wrong restore cannot pass by luck
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
    return model


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model, snap):
    return {n for n, p in model.named_parameters() if not torch.equal(p, snap[n])}


IDS = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))


def test_find_noise_targets_default_and_final_norm():
    model = tiny_qwen2()
    assert {n for n, _ in aqn.find_noise_targets(model)} == BLOCK
    assert {n for n, _ in aqn.find_noise_targets(model, include_final_norm=True)} == BLOCK | {
        "model.norm.weight"
    }
    params = dict(model.named_parameters())
    assert all(p is params[n] for n, p in aqn.find_noise_targets(model))
    with pytest.raises(ValueError, match="no AQN target"):
        aqn.find_noise_targets(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_only_block_norms_touched_and_exact_restore(dtype):
    model = tiny_qwen2(dtype)
    snap = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", aqn.AQNPrecisionWarning
        )  # σ = 1e-2 is above bf16 resolution near 1: no warning expected
        with aqn.noise(model, 1e-2, generator=torch.Generator().manual_seed(1)) as inj:
            assert changed(model, snap) == BLOCK  # final norm, q/k/v, mlp, embeddings untouched
            assert model.model.layers[0].input_layernorm.weight.dtype == dtype
    assert inj.sigma == 1e-2 and inj.n_draws == 1
    assert changed(model, snap) == set()  # torch.equal on every parameter
    with aqn.noise(model, 1e-2, include_final_norm=True):
        assert changed(model, snap) == BLOCK | {"model.norm.weight"}
    assert changed(model, snap) == set()


@pytest.mark.parametrize("mode", ["per_rollout", "per_forward"])
def test_exact_restore_after_exception(mode):
    model = tiny_qwen2(torch.bfloat16)
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with aqn.noise(model, 5e-2, mode=mode):
            model(IDS)
            assert changed(model, snap) == BLOCK
            raise RuntimeError("boom")
    assert changed(model, snap) == set()
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_noise_statistics_channelwise():
    model = tiny_qwen2(torch.float32)
    clean = {n: p.detach().clone() for n, p in aqn.find_noise_targets(model)}
    gen, sigma, diffs = torch.Generator().manual_seed(2), 1e-2, []
    for _ in range(40):
        with aqn.noise(model, sigma, generator=gen):
            for n, p in aqn.find_noise_targets(model):
                d = (p.detach() - clean[n]).double()
                assert d.unique().numel() > 60  # one value per channel, not one per tensor
                diffs.append(d)
    z = torch.cat(diffs)  # 40 draws × 4 norms × 64 channels
    assert z.numel() == 10240
    assert z.std().item() == pytest.approx(sigma, rel=0.03)
    assert abs(z.mean().item()) < 4 * sigma / math.sqrt(z.numel())
    # same seed, same noise
    a, b = tiny_qwen2(), tiny_qwen2()
    with aqn.noise(a, sigma, generator=torch.Generator().manual_seed(3)):
        with aqn.noise(b, sigma, generator=torch.Generator().manual_seed(3)):
            assert changed(a, snapshot(b)) == set()


def test_per_rollout_vs_per_forward():
    model = tiny_qwen2(torch.float32)
    snap = snapshot(model)
    with torch.no_grad():
        clean_logits = model(IDS).logits
        with aqn.noise(model, 2e-2, mode="per_rollout") as inj:
            l1, l2 = model(IDS).logits, model(IDS).logits
        assert inj.n_draws == 1
        assert torch.equal(l1, l2) and not torch.allclose(l1, clean_logits)

        seen = []
        norm = model.model.layers[0].input_layernorm
        with aqn.noise(model, 2e-2, mode="per_forward") as inj:
            h = norm.register_forward_hook(lambda m, a, o: seen.append(m.weight.detach().clone()))
            l1, l2 = model(IDS).logits, model(IDS).logits
            h.remove()
            assert inj.n_draws == 2
        assert len(seen) == 2 and not torch.equal(seen[0], seen[1])
        assert not torch.equal(seen[0], snap["model.layers.0.input_layernorm.weight"])
        assert not torch.allclose(l1, l2)
        assert changed(model, snap) == set()
        assert torch.equal(model(IDS).logits, clean_logits)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_sigma_zero_is_noop():
    model = tiny_qwen2(torch.bfloat16)
    snap = snapshot(model)
    for mode in aqn.DRAW_MODES:
        with aqn.noise(model, 0.0, mode=mode) as inj:
            model(IDS)
            assert changed(model, snap) == set()
            assert all(not m._forward_pre_hooks for m in model.modules())
        assert inj.n_draws == 0


def test_bf16_resolution_warning():
    assert aqn.resolution(torch.bfloat16, 1.0) == 2**-7
    assert aqn.resolution(torch.bfloat16, 0.9) == 2**-8
    assert aqn.resolution(torch.float32, 1.5) == 2**-23
    model = tiny_qwen2(torch.bfloat16)
    with pytest.warns(aqn.AQNPrecisionWarning, match="bfloat16"):
        with aqn.noise(model, 1e-4) as inj:
            pass
    assert inj.rounded_frac["bfloat16"] > 0.95  # |Z| ≲ 4e-4 against a half-spacing of ≥ 2e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error", aqn.AQNPrecisionWarning)
        with aqn.noise(model, 1e-2) as inj:
            pass
        assert inj.rounded_frac["bfloat16"] < 0.5
        with aqn.noise(tiny_qwen2(torch.float32), 1e-4) as inj:  # fp32 norms keep σ = 1e-4
            pass
        assert inj.rounded_frac["float32"] == 0.0


def test_wrapped_norms_peft_and_fp32_master():
    from peft import LoraConfig, get_peft_model

    from qerl.lora import MasterRMSNorm

    base = tiny_qwen2(torch.float32)
    pm = get_peft_model(
        base,
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=list(aqn.BLOCK_NORMS)),
    )
    names = [n for n, _ in aqn.find_noise_targets(pm)]
    assert len(names) == 8
    assert (
        sum("modules_to_save.default" in n for n in names) == 4
        and sum("original_module" in n for n in names) == 4
    )
    snap = snapshot(pm)
    with torch.no_grad():
        clean = pm(input_ids=IDS).logits
        with aqn.noise(pm, 2e-2):
            active = "base_model.model.model.layers.0.input_layernorm.modules_to_save.default.weight"
            assert active in changed(pm, snap)
            assert not torch.allclose(pm(input_ids=IDS).logits, clean)
        assert changed(pm, snap) == set()

    # qerl.lora's trainable fp32 norms (official --ln True) in a bf16 model: found, and σ = 1e-4 survives in fp32
    model = tiny_qwen2(torch.bfloat16)
    for layer in model.model.layers:
        for n in aqn.BLOCK_NORMS:
            old = getattr(layer, n)
            setattr(layer, n, MasterRMSNorm(old.weight, old.variance_epsilon))
    assert {n for n, _ in aqn.find_noise_targets(model)} == BLOCK
    with warnings.catch_warnings():
        warnings.simplefilter("error", aqn.AQNPrecisionWarning)
        with aqn.noise(model, 1e-4) as inj:
            pass
    assert inj.rounded_frac == {"float32": 0.0}


def test_injector_argument_errors():
    model = tiny_qwen2()
    with pytest.raises(ValueError, match=r"'per_step'.*per_forward.*per_rollout"):
        aqn.noise(model, 1e-2, mode="per_step")
    with pytest.raises(ValueError, match="sigma"):
        aqn.noise(model, -1e-2)
    with pytest.raises(ValueError, match="per_forward"):
        aqn.noise(aqn.find_noise_targets(model), 1e-2, mode="per_forward")
    snap = snapshot(model)
    with aqn.noise(aqn.find_noise_targets(model), 1e-2):  # bare parameters work per rollout
        assert changed(model, snap) == BLOCK
    assert changed(model, snap) == set()
