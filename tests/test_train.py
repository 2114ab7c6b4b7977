"""The training loop end to end on the CPU: reward rises on the toy task; a SIGKILLed run resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qerl.config import load_config
from qerl.results import read_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Small but real: the committed toy smoke model, 4 prompts x 4 samples, short answers.
FAST = ["scale=smoke", "train.steps=10", "train.batch_size=16", "algo.group_size=4", "train.micro_batch=16",
        "data.max_new_tokens=40", "train.save_every=3", "eval.limit=8", "eval.n_samples=1",
        "eval.max_new_tokens=40", "algo.ppo_epochs=1", "train.progress=false"]
SAME = ("reward", "rewards/accuracy/mean", "pg_loss", "grad_norm", "entropy", "sampling_entropy", "clip_frac",
        "sigma", "lr", "response_length", "mismatch/kl_k3")


def _same_lines(a, b, *where):
    """Two runs' metrics lines pair up exactly and agree on every SAME metric (``where``: context for a failure)."""
    for ra, rb in zip(a, b, strict=True):
        for k in SAME:
            assert ra.get(k) == rb.get(k), (*where, ra["step"], k, ra.get(k), rb.get(k))


def _cmd(out, name, extra=()):
    return [sys.executable, "-m", "qerl.train", *FAST, f"out_dir={out}", "experiment=resume", f"run_name={name}",
            "quant=nvfp4", "aqn=paper", *extra]


def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ref = subprocess.run(_cmd(tmp_path, "ref"), env=env, capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "resume" / "killed"
    p = subprocess.Popen(_cmd(tmp_path, "killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:  # kill after step 5 is logged: past the step-3 checkpoint, before step 6's
        if len(read_jsonl(run / "metrics.jsonl")) >= 5:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    lines_at_kill = len(read_jsonl(run / "metrics.jsonl"))
    assert 5 <= lines_at_kill < 10
    assert not (run / "summary.json").exists()
    res = subprocess.run(_cmd(tmp_path, "killed"), env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in res.stdout
    a = read_jsonl(tmp_path / "resume" / "ref" / "metrics.jsonl")
    b = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 11))  # no gap, no duplicate
    _same_lines(a, b)
    sa = json.loads((tmp_path / "resume" / "ref" / "summary.json").read_text())
    sb = json.loads((run / "summary.json").read_text())
    assert sa["eval"]["toy"]["pass@1"] == sb["eval"]["toy"]["pass@1"]
    # a finished run is skipped, not retrained
    again = subprocess.run(_cmd(tmp_path, "killed"), env=env, capture_output=True, text=True, timeout=300)
    assert "already finished" in again.stdout


def test_reward_rises_on_the_toy_task(tmp_path):
    """A short DAPO-style run at smoke scale: the mean reward of the last steps beats the first steps'."""
    from qerl.train import run

    cfg = load_config(["scale=smoke", "quant=nvfp4", "algo=dapo", "aqn=off", f"out_dir={tmp_path}",
                       "train.progress=false", "eval.limit=16"])
    summary = run(cfg)
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert len(rows) == cfg.train.steps
    first = sum(r["rewards/accuracy/mean"] for r in rows[:4]) / 4
    last = sum(r["rewards/accuracy/mean"] for r in rows[-4:]) / 4
    assert last > first + 0.05, [round(r["rewards/accuracy/mean"], 3) for r in rows]
    assert summary["finished"] and 0 <= summary["eval"]["toy"]["pass@1"] <= 1
    for f in ("config.yaml", "env.json", "metrics.jsonl", "summary.json"):
        assert (cfg.run_dir / f).exists()
    env = json.loads((cfg.run_dir / "env.json").read_text())
    assert env["packages"]["torch"] and "hardware" in env
    assert Path(cfg.run_dir / "checkpoints" / "final_adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_a_truncated_latest_checkpoint_resumes_from_the_previous_one(tmp_path):
    """The audit's probe: the newest checkpoint's state.pt cut short used to fail every rerun with
    "PytorchStreamReader failed reading zip archive" and no path. Now the run falls back to the intact one, says
    which file was bad, and recomputes the same lines."""
    from qerl.results import ResultsWarning
    from qerl.train import run

    cfg = load_config([*FAST, "train.steps=2", "train.save_every=1", f"out_dir={tmp_path}", "quant=nvfp4",
                       "aqn=paper", "aqn.stages=2", "eval.limit=2"])
    run(cfg)
    ref = read_jsonl(cfg.run_dir / "metrics.jsonl")
    bad = cfg.run_dir / "checkpoints" / "step_0000002" / "state.pt"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    (cfg.run_dir / "summary.json").unlink()
    with pytest.warns(ResultsWarning, match=rf"not resuming from .*step_0000002: {bad} does not match"):
        summary = run(cfg)
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and summary["finished"]
    _same_lines(ref, rows)


def _poisoned_build_policy(poison: dict):
    """qerl.train's own build_policy, with a gradient hook that turns the first LoRA-B gradient into NaN while
    ``poison["on"]`` (fault injection: a real NaN gradient is not reproducible at smoke scale)."""
    import qerl.train as T

    real = T.build_policy

    def build(cfg, device, **kw):
        policy, tok = real(cfg, device, **kw)
        p = next(p for n, p in policy.named_parameters() if p.requires_grad and "lora_B" in n)
        p.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)
        return policy, tok
    return build


def test_a_nonfinite_gradient_skips_the_update_and_keeps_the_weights(tmp_path, monkeypatch):
    """A NaN gradient used to go through clip_grad_norm_ into the optimizer and make every weight NaN (the small
    scale's BF16-Full runs emitted one token from then on). Now that update is skipped and counted; the next
    step trains normally."""
    import qerl.train as T

    poison = {"on": True}
    monkeypatch.setattr(T, "build_policy", _poisoned_build_policy(poison))
    cfg = load_config([*FAST, "train.steps=2", "train.save_every=1", "eval.sets=[]", f"out_dir={tmp_path}",
                       "quant=nvfp4", "aqn=off", "optim.name=adamw8bit"])

    def on_step(step, m):
        poison["on"] = False  # only step 1's gradients are NaN
    T.run(cfg, on_step=on_step)
    m1, m2 = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert (m1["nonfinite_updates"], m1["updates"], m1["grad_norm"]) == (1, 0, None)  # NaN is logged as null
    assert (m2["nonfinite_updates"], m2["updates"]) == (0, 1) and m2["grad_norm"] > 0
    after1 = torch.load(cfg.run_dir / "checkpoints" / "step_0000001" / "state.pt", weights_only=False)["trainable"]
    after2 = torch.load(cfg.run_dir / "checkpoints" / "step_0000002" / "state.pt", weights_only=False)["trainable"]
    b = [k for k in after1 if "lora_B" in k]
    assert b and all(torch.equal(after1[k], torch.zeros_like(after1[k])) for k in b)  # untouched (B starts at 0)
    assert all(torch.isfinite(v).all() for v in after2.values())
    assert any(not torch.equal(after2[k], after1[k]) for k in b)  # step 2 did update


def test_a_run_whose_gradients_stay_nonfinite_stops_with_its_steps_logged(tmp_path, monkeypatch):
    import qerl.train as T
    from qerl.errors import TrainingDiverged

    monkeypatch.setattr(T, "build_policy", _poisoned_build_policy({"on": True}))
    cfg = load_config([*FAST, "train.steps=6", "train.max_nonfinite_steps=2", "eval.sets=[]", f"out_dir={tmp_path}",
                       "quant=bf16", "aqn=off"])
    with pytest.raises(TrainingDiverged, match=r"2 steps in a row .*\(steps 1-2\)"):
        T.run(cfg)
    assert [r["step"] for r in read_jsonl(cfg.run_dir / "metrics.jsonl")] == [1, 2]


def test_8bit_adamw_keeps_the_trained_embedding_state_in_float32():
    """Full fine-tuning trains the embedding: its AdamW-8bit moments stay float32 (as Hugging Face's Trainer does
    for adamw_bnb_8bit); every other large parameter keeps 8-bit state."""
    from qerl.train import build_optimizer

    cfg = load_config(["scale=smoke", "optim.name=adamw8bit"])
    emb, lin = torch.nn.Embedding(5000, 8), torch.nn.Linear(8, 5000, bias=False)
    params = [emb.weight, lin.weight]
    opt, _ = build_optimizer(params, cfg, 10, keep_32bit=[emb.weight])
    (emb.weight.sum() + lin.weight.square().sum()).backward()
    opt.step()
    assert opt.state[emb.weight]["state1"].dtype == torch.float32
    assert opt.state[lin.weight]["state1"].dtype == torch.uint8
    opt2, _ = build_optimizer(params, cfg, 10)  # without keep_32bit: no process-global leftovers
    opt2.step()
    assert opt2.state[emb.weight]["state1"].dtype == torch.uint8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_gpu_resumed_run_matches_uninterrupted(tmp_path, quant, capsys, monkeypatch):
    """On a GPU the sampler decodes through captured CUDA graphs, and a resumed run captures its graphs afresh.
    Until session 60 each capture's warm-up step took one step's draws from the sampling generators, so a resumed
    run sampled other completions than the uninterrupted one from the same checkpoint. A run of 4 steps
    (checkpoints at 2 and 4), then the same run resumed from step 2: steps 3 and 4 must be recomputed bit for bit
    (rewards, losses, gradient norms, entropies, lengths), graphs and all."""
    from qerl.rollout import Sampler
    from qerl.train import run

    graphs, real = [], Sampler.generate

    def generate(self, *a, **k):  # the real sampler; records how many decode graphs it held after each rollout
        ro = real(self, *a, **k)
        graphs.append(ro.stats["graphs"])
        return ro
    monkeypatch.setattr(Sampler, "generate", generate)
    cfg = load_config([*FAST, "train.steps=4", "train.save_every=2", "train.keep_checkpoints=2", f"out_dir={tmp_path}",
                       f"quant={quant}", "aqn=paper", "aqn.stages=2", "device=cuda", "eval.limit=4"])
    run(cfg)
    assert graphs and min(graphs) > 0, graphs  # every rollout decoded through captured CUDA graphs
    ref = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in ref] == [1, 2, 3, 4]
    ck = cfg.run_dir / "checkpoints"
    assert (ck / "step_0000002").is_dir() and (ck / "step_0000004").is_dir()
    shutil.rmtree(ck / "step_0000004")  # the run stopped after step 3: step 2's checkpoint is the newest
    (cfg.run_dir / "summary.json").unlink()
    capsys.readouterr()
    n = len(graphs)
    summary = run(cfg)
    assert len(graphs) > n and min(graphs[n:]) > 0, graphs  # the resumed run captured graphs of its own
    assert "resuming" in capsys.readouterr().out
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and summary["finished"]
    _same_lines(ref, rows, quant)
