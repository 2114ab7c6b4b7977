"""qerl.evaluate: a run's weights are checked before any model is built; full fine-tuning runs can be re-evaluated;
greedy evaluation (temperature 0); truncated prompts are reported once, without the tokenizer's warning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from qerl.config import load_config
from qerl.errors import UserError
from qerl.evaluate import evaluate_policy, evaluate_run, main
from qerl.rollout import Sampler

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run_dir(tmp_path, *overrides):
    """A run directory holding only its config.yaml (what a killed or unfinished run leaves, minus metrics)."""
    cfg = load_config(["scale=smoke", f"out_dir={tmp_path}", *overrides])
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(cfg.to_yaml())
    return cfg


def test_missing_or_broken_weights_fail_before_the_model_is_built(tmp_path):
    # the model source does not exist: building the model first would fail on it, not on the weights
    cfg = _run_dir(tmp_path, "model.source=/nonexistent/model")
    adapter = cfg.run_dir / "checkpoints" / "final_adapter" / "adapter_model.safetensors"
    with pytest.raises(UserError, match=f"trained weights {adapter} not found: the run has not finished"):
        evaluate_run(cfg.run_dir)
    adapter.parent.mkdir(parents=True)
    adapter.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": trunc")  # a torn write
    with pytest.raises(UserError, match=f"trained weights {adapter} are not a readable safetensors file"):
        evaluate_run(cfg.run_dir)
    full = _run_dir(tmp_path / "full", "lora=none", "model.source=/nonexistent/model")
    with pytest.raises(UserError, match=r"final_model/model.safetensors not found"):
        evaluate_run(full.run_dir)
    with pytest.raises(UserError, match=r"run directory .*nope does not exist"):
        evaluate_run(tmp_path / "nope")
    with pytest.raises(UserError, match=r"is not a qerl run directory"):
        evaluate_run(tmp_path)
    with pytest.raises(UserError, match=r"only eval\.\* overrides .* got 'train.steps=3'"):
        evaluate_run(cfg.run_dir, ["train.steps=3"])


def test_entry_point_prints_one_line_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([f"run_dir={tmp_path / 'nope'}"])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: run directory {tmp_path / 'nope'} does not exist\n"
    res = subprocess.run([sys.executable, "-m", "qerl.evaluate", "eval.top_p=2", f"out_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: eval.top_p=2 is out of range")


@pytest.mark.slow  # ~40 s of CPU: two training steps, two evaluations, three model loads
def test_full_finetuning_run_saves_its_weights_and_re_evaluates_to_the_same_result(tmp_path, capsys):
    from qerl.train import run

    cfg = load_config(["scale=smoke", "lora=none", "quant=bf16", "train.steps=2", "train.batch_size=8",
                       "algo.group_size=4", "train.micro_batch=8", "algo.ppo_epochs=1", "data.max_new_tokens=16",
                       "algo.mask_truncated=false",
                       "data.max_prompt_tokens=24", "eval.limit=6", "eval.n_samples=1", "eval.max_new_tokens=24",
                       "train.progress=false", "optim.lr=1e-2", f"out_dir={tmp_path}"])
    summary = run(cfg)
    out = capsys.readouterr().out
    # prompts longer than 24 tokens were cut: said once for the run, with the count
    cut = sum(json.loads(line)["prompts_truncated"] for line in (cfg.run_dir / "metrics.jsonl").open())
    assert cut > 0 and out.count("training prompts were longer") == 1
    assert f"{cut} training prompts were longer than data.max_prompt_tokens=24" in out
    final = cfg.run_dir / "checkpoints" / "final_model"
    assert (final / "model.safetensors").exists() and not (cfg.run_dir / "checkpoints" / "final_adapter").exists()
    records = (cfg.run_dir / "eval" / "toy.jsonl")
    first = records.read_text() if records.exists() else None
    ev = evaluate_run(cfg.run_dir)
    assert ev["toy"]["pass@1"] == summary["eval"]["toy"]["pass@1"]
    # the reloaded weights are the trained ones: the same seeded completions, token for token
    from qerl.model import load_policy
    from qerl.train import build_policy, resolve_device

    trained, _ = build_policy(load_config(["scale=smoke", "lora=none", "quant=bf16", f"model.source={final}"]),
                              resolve_device("cpu"))
    base, _ = load_policy(cfg.model.source, "bf16", None, device="cpu", full_finetune=True)
    moved = [n for (n, a), b in zip(trained.named_parameters(), base.parameters(), strict=True)
             if not torch.equal(a, b)]
    assert moved  # training changed the saved weights (so the equal pass@1 above is not the base model's)
    if first is not None:
        assert records.read_text() == first


def test_greedy_evaluation_is_the_argmax_of_the_model(tmp_path):
    """eval.temperature=0 decodes greedily: the same tokens as transformers' own greedy generate."""
    from qerl.model import load_policy

    policy, tok = load_policy("toy:smoke", "bf16", None, device="cpu")
    prompts = ["Tom has 3 boxes of 4 pens. How many pens does he have?", "Ann had 9 cups and gave away 2."]
    ro = Sampler(policy, tok, 256).generate(prompts, 1, max_new_tokens=20, temperature=0.0, seed=1)
    for i, p in enumerate(prompts):
        ids = tok(p, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ref = policy.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        n = int(ro.completion_mask[i].sum())
        assert ro.completion_ids[i, :n].tolist() == ref[:n].tolist()
    again = Sampler(policy, tok, 256).generate(prompts, 1, max_new_tokens=20, temperature=0.0, seed=2)
    assert torch.equal(again.completion_ids, ro.completion_ids)  # no randomness left
    cfg = load_config(["scale=smoke", "eval.temperature=0", "eval.n_samples=1", "eval.limit=4",
                       "eval.max_new_tokens=16"])
    assert evaluate_policy(policy, tok, cfg)["toy"]["temperature"] == 0


def test_long_eval_prompts_are_reported_once_without_the_tokenizer_warning(tmp_path, capfd):
    from qerl.model import load_policy

    f = tmp_path / "long.jsonl"
    long_prompt = " ".join(f"Sam has {i} apples and buys {i + 1} more." for i in range(150))  # > 1024 tokens
    f.write_text(json.dumps({"prompt": long_prompt, "answer": 1}) + "\n" + json.dumps({"prompt": "1+1?", "answer": 2})
                 + "\n")
    policy, tok = load_policy("toy:smoke", "bf16", None, device="cpu")
    assert len(tok(long_prompt, verbose=False)["input_ids"]) > tok.model_max_length  # would trigger the warning
    cfg = load_config(["scale=smoke", f"eval.sets=[jsonl:{f}]", "eval.n_samples=1", "eval.max_new_tokens=4",
                       "eval.batch_prompts=1"])
    evaluate_policy(policy, tok, cfg)
    captured = capfd.readouterr()
    both = captured.out + captured.err
    assert "indexing errors" not in both and "longer than the specified maximum" not in both
    assert both.count("prompts were longer than") == 1
    assert f"eval jsonl:{f}: 1 of 2 prompts were longer than 1024 tokens" in captured.out
