"""Configuration: every group option composes; bad keys and values fail with the valid choices."""

from __future__ import annotations

import pytest

from qerl.config import CONF_DIR, GROUPS, ConfigError, from_dict, load_config


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(group):
    for opt in options(group):
        extra = ["quant=bf16"] if (group == "lora" and opt == "none") else []
        cfg = load_config([f"{group}={opt}", *extra])
        assert cfg.choices[group] == opt
        assert from_dict(cfg.to_dict()) == cfg  # what a run directory stores rebuilds the same config


def test_presets_hold_the_paper_settings():
    g = load_config(["algo=grpo", "scale=paper", "data=gsm8k"])
    assert (g.algo.group_size, g.algo.updates_per_rollout, g.algo.loss_agg) == (8, 4, "seq_mean")
    assert (g.algo.clip_low, g.algo.clip_high, g.algo.kl_coef) == (0.2, 0.28, 0.0)
    assert g.data.max_new_tokens == 4096 and g.train.batch_size == 128 and g.batch_prompts == 16
    assert g.model.source == "Qwen/Qwen2.5-7B-Instruct"
    d = load_config(["algo=dapo", "scale=paper", "data=bigmath"])
    assert (d.algo.group_size, d.algo.updates_per_rollout, d.algo.loss_agg) == (16, 1, "token_mean")
    assert d.algo.dynamic_sampling and d.data.max_new_tokens == 8192 and d.batch_prompts == 8
    a = load_config(["aqn=paper"]).aqn
    assert (a.sigma_start, a.sigma_end, a.stages, a.mode) == (1e-2, 5e-4, 10, "paper")
    o = load_config(["aqn=official"]).aqn
    assert (o.sigma_end, o.mode) == (1e-4, "official")
    assert load_config([]).optim.name == "adamw8bit"
    lo = load_config(["lora=official"]).lora
    assert (lo.rank, lo.alpha, lo.train_norms) == (16, 16, True)


def test_scale_sets_sizes_but_explicit_overrides_win():
    s = load_config(["scale=smoke"])
    assert s.model.source == "toy:smoke" and s.scale == "smoke"
    t = load_config(["scale=toy"])
    assert t.model.source == "toy:toy"
    assert load_config(["scale=paper", "model=qwen2.5-3b"]).model.source == "Qwen/Qwen2.5-3B-Instruct"
    assert load_config(["model=qwen2.5-3b", "scale=paper"]).model.source == "Qwen/Qwen2.5-3B-Instruct"
    assert load_config(["scale=smoke", "train.steps=3"]).train.steps == 3
    assert load_config(["scale=smoke", "algo=dapo"]).algo.group_size == 4  # smoke shrinks G for both presets


@pytest.mark.parametrize("override, needle", [
    ("quant=int3", "nvfp4"),                      # unknown group option: lists the valid ones
    ("quant.format=int3", "nvfp4"),               # unknown value
    ("algo.loss_agg=mean", "token_mean"),
    ("aqn.schedule=step", "exponential"),
    ("data.train=mnist", "gsm8k"),
    ("data.prompt=chatty", "think_answer"),
    ("train.stepz=3", "train.stepz"),             # unknown key is named
    ("bogus=1", "bogus"),
    ("eval.sets=[gsm8k,mnist]", "mnist"),
    ("train.batch_size=30", "multiple"),          # 30 completions are not whole groups of 8
    ("lora=none", "bf16"),                        # full fine-tuning of a 4-bit base
    ("optim.name=sgd", "adamw8bit"),
    ("lora.targets=[q_proj,lm_head]", "lm_head"),
    ("aqn.sigma_start=0", "sigma_start"),
])
def test_bad_input_names_the_value_and_the_choices(override, needle):
    extra = ["quant=nvfp4"] if override == "lora=none" else []
    with pytest.raises(ValueError, match=None) as e:
        load_config([override, "aqn=paper" if override.startswith("aqn.") else "aqn=off", *extra])
    assert needle in str(e.value), str(e.value)


def test_a_bare_group_name_asks_for_key_value():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["quant"])
