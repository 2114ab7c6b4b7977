"""Carrying an evidence matrix to a GPU host and back (experiments/evidence_carry.py)."""

from __future__ import annotations

import json

import pytest

from experiments import evidence as E
from experiments import evidence_carry as C
from qerl.errors import UserError

P = E.Protocol(lora_grid=(1e-4, 2e-4), full_grid=(1e-5,), shared=1e-4, seeds=(0, 1))


def _run(root, name, rewards, finished=True, extra=None):
    d = root / "evidence" / "small" / name
    d.mkdir(parents=True)
    rows = [{"step": i + 1, "reward": r, "entropy": 0.5, "time_step_s": 1.0} for i, r in enumerate(rewards)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"finished": finished, "eval": {"toy": {"pass@1": 0.5}}}))
    (d / "worker.log").write_text("x" * 10_000)
    if extra:
        (d / extra).write_text("y" * 10_000)
    return d


@pytest.fixture
def full(tmp_path):
    root = tmp_path / "full"
    for arm in ("bf16-full", *E.FORMAT_ARMS):
        for lr in P.grid(arm):
            _run(root, E.run_key(arm, lr, 0), [0.6 if lr == 2e-4 else 0.3] * 5, extra="samples.jsonl")
    _run(root, "nvfp4-lora-lr0.0002-s1", [0.4] * 5)
    _run(root, "nvfp4-lora-lr0.0002-s2", [0.4] * 2, finished=False)
    E._update_protocol(root, "small", rollout_temperature=0.7, best_lr={"bf16-full": 1e-5})
    return root


def test_slim_keeps_what_the_host_reads_and_gives_the_same_best_rates(full, tmp_path):
    kept = C.slim(full, "small", tmp_path / "slim")
    names = {k.name for k in kept}
    assert "nvfp4-lora-lr0.0002-s1" in names and "nvfp4-lora-lr0.0002-s2" not in names  # unfinished: not carried
    slim_dir = tmp_path / "slim" / "evidence" / "small"
    assert json.loads((slim_dir / "protocol.json").read_text())["rollout_temperature"] == 0.7
    assert not list(slim_dir.rglob("worker.log")) and not list(slim_dir.rglob("samples.jsonl"))
    assert not (slim_dir / "nvfp4-lora-lr0.0002-s1" / "metrics.jsonl").exists()  # only the seed-0 grid runs' curves
    assert E.best_rates(tmp_path / "slim", "small", P) == E.best_rates(full, "small", P)
    size = lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())  # noqa: E731
    assert size(slim_dir) < size(full / "evidence" / "small") / 3


def test_merge_adds_only_new_finished_runs_and_merges_best_rates(full, tmp_path):
    host = tmp_path / "host"
    C.slim(full, "small", host)
    _run(host, "nvfp4-lora-aqn-lr0.0002-s0", [0.5] * 5)  # new on the host
    (host / "evidence" / "small" / "nvfp4-lora-aqn-lr0.0002-s0" / "checkpoints").mkdir()
    _run(host, "nvfp4-lora-aqn-lr0.0002-s1", [0.5] * 2, finished=False)  # cut off on the host
    E._update_protocol(host, "small", best_lr={"nvfp4-lora": 2e-4})
    (host / "evidence-small-aqn.log").write_text("stage aqn\n")
    added = C.merge(host, full, "h100-test")
    assert added == {"small": ["nvfp4-lora-aqn-lr0.0002-s0"]}
    local = full / "evidence" / "small"
    assert not (local / "nvfp4-lora-aqn-lr0.0002-s0" / "checkpoints").exists()
    assert (local / "bf16-lora-lr0.0002-s0" / "samples.jsonl").exists()  # the slim copy never replaces the full one
    assert json.loads((local / "bf16-lora-lr0.0002-s0" / "metrics.jsonl").read_text().splitlines()[0])["entropy"] == 0.5
    doc = json.loads((local / "protocol.json").read_text())
    assert doc["best_lr"] == {"bf16-full": 1e-5, "nvfp4-lora": 2e-4} and doc["rollout_temperature"] == 0.7
    assert (local / "logs" / "evidence-small-aqn-h100-test.log").read_text() == "stage aqn\n"


def test_bad_inputs_name_the_path(tmp_path):
    with pytest.raises(UserError, match="protocol.json does not exist"):
        C.slim(tmp_path, "toy", tmp_path / "out")
    with pytest.raises(UserError, match="has no evidence/ folder"):
        C.merge(tmp_path, tmp_path / "dst", "t")
