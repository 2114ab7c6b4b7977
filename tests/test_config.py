"""Configuration: every group option composes; bad keys and values fail with the valid choices."""

from __future__ import annotations

import pytest

from qerl.config import CONF_DIR, GROUPS, ConfigError, from_dict, load_config
from qerl.errors import UserError


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(group, tmp_path):
    problems = tmp_path / "mine.jsonl"
    problems.write_text('{"prompt": "2+3?", "answer": 5}\n')
    for opt in options(group):
        extra = {("lora", "none"): ["quant=bf16"], ("data", "jsonl"): [f"data.path={problems}"]}.get((group, opt), [])
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


# Each value the audit found accepted and failing late (or never): the entry point prints one line naming the key,
# the value and what is valid, exits 2, and no run directory exists.
BAD_VALUES = [
    (["optim.max_grad_norm=-1"], ["optim.max_grad_norm=-1", "must be > 0"]),        # trained as gradient ascent
    (["eval.temperature=0"], ["eval.temperature=0", "greedily", "eval.n_samples=1"]),  # crashed in the final eval
    (["algo.group_size=1", "algo.adv_std_norm=true"], ["algo.group_size=1", "must be >= 2"]),
    (["optim.lr=-1"], ["optim.lr=-1", "must be > 0"]),
    (["optim.betas=[2,3]"], ["optim.betas=[2, 3]", "each value must be in [0, 1)"]),
    (["optim.lr=abc"], ["optim.lr='abc'", "must be a number"]),
    (["aqn=paper", "aqn.sigma_start=1e-4", "aqn.sigma_end=1e-3"],
     ["aqn.sigma_start=0.0001", "aqn.sigma_end=0.001", "rise"]),
    (["eval.limit=-1"], ["eval.limit=-1", "must be >= 1", "null evaluates all"]),
    (["eval.top_p=2"], ["eval.top_p=2", "must be in (0, 1]"]),
    (["data.train_size=0"], ["data.train_size=0", "must be >= 1"]),
    (["device=gpu"], ["device='gpu'", "'cpu'", "'cuda'", "'cuda:N'"]),
    (["train.stepz=3"], ["'train.stepz'", "valid keys of train", "'batch_size'", "did you mean 'train.steps'"]),
]


@pytest.mark.parametrize("overrides, needles", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_value_fails_at_once_in_one_line_before_any_run_directory(overrides, needles, tmp_path, capsys):
    from qerl.train import main

    with pytest.raises(SystemExit) as e:
        main([*overrides, f"out_dir={tmp_path}", "train.progress=false"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    for needle in needles:
        assert needle in err, err
    assert "+train.stepz" not in err  # not Hydra's "append with +" advice
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, needle", [
    ("lora.dropout=1", "lora.dropout=1 is out of range: must be in [0, 1)"),
    ("algo.adv_eps=0", "algo.adv_eps=0 is out of range: must be > 0"),
    ("algo.kl_coef=-0.1", "algo.kl_coef=-0.1 is out of range: must be >= 0"),
    ("algo.max_refills=-1", "algo.max_refills=-1"),
    ("algo.tis_cap=0", "algo.tis_cap=0 is out of range: must be > 0"),
    ("aqn.stages=1", "aqn.stages=1 is out of range: must be >= 2"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens=0"),
    ("data.reward_weights=[inf]", "data.reward_weights=[inf]"),
    ("data.levels=[7]", "choose a non-empty subset of [1, 2, 3, 4]"),
    ("rollout.temperature=0", "rollout.temperature=0 is out of range: must be > 0"),
    ("rollout.top_k=-1", "rollout.top_k=-1"),
    ("rollout.prompt_batch=-2", "rollout.prompt_batch=-2"),
    ("train.save_every=-1", "train.save_every=-1"),
    ("train.keep_checkpoints=-1", "train.keep_checkpoints=-1"),
    ("train.eval_every=-5", "train.eval_every=-5"),
    ("train.steps=true", "train.steps=True is not valid: it must be an integer"),
    ("train.micro_batch=0", "train.micro_batch=0"),
    ("optim.weight_decay=-1", "optim.weight_decay=-1"),
    ("optim.eps=0", "optim.eps=0"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] is not valid: it must be a list of 2 numbers"),
    ("optim.lr=nan", "optim.lr=nan"),
    ("eval.n_samples=0", "eval.n_samples=0"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens=0"),
    ("eval.batch_prompts=0", "eval.batch_prompts=0"),
    ("model.attn_implementation=flash", "flash_attention_2"),
    ("rollout.cuda_graphs=maybe", "'auto'"),
    ("seed=-1", "seed=-1 is out of range: must be >= 0"),
    ("lora.alpha=0", "lora.alpha > 0"),
    ("optim.lr.x=1", "optim.lr is a value, not a section"),
])
def test_every_range_of_the_schema_is_checked(override, needle):
    with pytest.raises(UserError) as e:
        load_config([override])
    assert needle in str(e.value), str(e.value)


def test_valid_edge_values_pass():
    cfg = load_config(["eval.temperature=0", "eval.n_samples=1", "eval.limit=null", "device=cuda:1",
                       "optim.lr=1", "aqn=paper", "aqn.sigma_start=5e-4", "aqn.sigma_end=5e-4", "train.save_every=0"])
    assert (cfg.eval.temperature, cfg.eval.limit, cfg.device, cfg.optim.lr) == (0, None, "cuda:1", 1)
