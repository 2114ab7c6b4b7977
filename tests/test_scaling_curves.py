"""1-GPU vs N-GPU reward curves (paper_figures/scaling_curves.py): verdicts from data, checks on the inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paper_figures import scaling_curves as SC
from qerl.errors import UserError


def _runs(root, rewards_by_seed, world=1, heldout=0.5, scale="toy", arm="nvfp4-lora", lr="0.0005", finished=True):
    for seed, rewards in rewards_by_seed.items():
        d = root / "evidence" / scale / f"{arm}-lr{lr}-s{seed}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward": float(r)}) + "\n"
                                                 for i, r in enumerate(rewards)))
        summary = {"finished": finished, "eval": {"toy": {"pass@1": heldout + 0.01 * seed}}}
        if world > 1:
            summary["world_size"] = world
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "env.json").write_text(json.dumps({"hardware": {"gpu": "NVIDIA H200"}}))
    return root


def _noisy(rng, shift=0.0, seeds=(0, 1, 2), steps=40):
    return {s: np.clip(np.linspace(0.3, 0.7, steps) + shift + rng.normal(0, 0.05, steps), 0, 1) for s in seeds}


def test_same_distribution_matches_and_a_shift_differs(tmp_path):
    rng = np.random.default_rng(0)
    curves = _noisy(rng)
    one = _runs(tmp_path / "one", curves)
    # the same seeds' curves with small per-step noise (what world-size-invariant sampling gives, up to float order)
    same = _runs(tmp_path / "same", {s: c + rng.normal(0, 0.005, len(c)) for s, c in curves.items()}, world=2)
    c = SC.compare(one, same, "toy", "nvfp4-lora")
    assert c.verdict == "matches within seed noise" and c.world == 2
    assert list(c.rows["metric"]) == list(SC.METRICS)
    worse = _runs(tmp_path / "worse", _noisy(rng, shift=-0.2), world=2, heldout=0.3)
    d = SC.compare(one, worse, "toy", "nvfp4-lora")
    assert d.verdict == "differs"
    auc = d.rows.set_index("metric").loc["reward AUC"]
    assert auc["verdict"] == "differs" and auc["ci_hi"] < 0 and auc["effect"] == pytest.approx(-0.2, abs=0.03)
    paths = SC.write(d, tmp_path / "out")
    text = paths[0].read_text()
    assert "**Verdict: differs.**" in text and "NVIDIA H200" in text and paths[1].suffix == ".png"


def test_interval_by_hand():
    """Constant curves: AUC per seed = the constant. 1 GPU {0.4, 0.5, 0.6}, 2 GPUs {0.5, 0.6, 0.7}: the difference
    is 0.1 with Welch se sqrt(0.01/3 + 0.01/3) = 0.08165 on 4 df, t_0.975,4 = 2.7764: [-0.1267, 0.3267]."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as t:
        t = Path(t)
        one = _runs(t / "a", {s: [v] * 10 for s, v in enumerate((0.4, 0.5, 0.6))})
        two = _runs(t / "b", {s: [v] * 10 for s, v in enumerate((0.5, 0.6, 0.7))}, world=2)
        row = SC.compare(one, two, "toy", "nvfp4-lora").rows.set_index("metric").loc["reward AUC"]
    assert row["effect"] == pytest.approx(0.1)
    assert (row["ci_lo"], row["ci_hi"]) == (pytest.approx(-0.1267, abs=1e-4), pytest.approx(0.3267, abs=1e-4))
    assert row["verdict"] == "matches"


def test_bad_sets_are_named(tmp_path):
    rng = np.random.default_rng(1)
    one = _runs(tmp_path / "one", _noisy(rng))
    with pytest.raises(UserError, match="world sizes \\[1\\]"):  # the "2-GPU" root holds one-process runs
        SC.compare(one, _runs(tmp_path / "notdist", _noisy(rng)), "toy", "nvfp4-lora")
    with pytest.raises(UserError, match="several ranks"):
        SC.compare(_runs(tmp_path / "dist1", _noisy(rng), world=2), _runs(tmp_path / "dist2", _noisy(rng), world=2),
                   "toy", "nvfp4-lora")
    with pytest.raises(UserError, match="different seeds.*missing: \\[2\\]"):
        SC.compare(one, _runs(tmp_path / "two_seeds", _noisy(rng, seeds=(0, 1)), world=2), "toy", "nvfp4-lora")
    with pytest.raises(UserError, match="is not finished"):
        SC.compare(one, _runs(tmp_path / "cut", _noisy(rng), world=2, finished=False), "toy", "nvfp4-lora")
    with pytest.raises(UserError, match="no runs of arm 'bf16-lora'"):
        SC.compare(one, one, "toy", "bf16-lora")
