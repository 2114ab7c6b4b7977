"""The training loop end to end on the CPU: reward rises on the toy task; a SIGKILLed run resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qerl.config import load_config
from qerl.results import read_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Small but real: the committed toy smoke model, 4 prompts x 4 samples, short answers.
FAST = ["scale=smoke", "train.steps=10", "train.batch_size=16", "algo.group_size=4", "train.micro_batch=16",
        "data.max_new_tokens=40", "train.save_every=3", "eval.limit=8", "eval.n_samples=1",
        "eval.max_new_tokens=40", "algo.ppo_epochs=1", "train.progress=false"]
SAME = ("reward", "rewards/accuracy/mean", "pg_loss", "grad_norm", "entropy", "sampling_entropy", "clip_frac",
        "sigma", "lr", "response_length", "mismatch/kl_k3")


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
    for ra, rb in zip(a, b, strict=True):
        for k in SAME:
            assert ra.get(k) == rb.get(k), (ra["step"], k, ra.get(k), rb.get(k))
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
    for ra, rb in zip(ref, rows, strict=True):
        for k in SAME:
            assert ra.get(k) == rb.get(k), (ra["step"], k, ra.get(k), rb.get(k))
