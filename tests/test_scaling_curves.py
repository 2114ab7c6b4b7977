"""1-GPU vs N-GPU reward curves (paper_figures/scaling_curves.py): verdicts from data, intervals by hand, checks on
the inputs, the files it writes and speed.md's table; and (slow) real smoke-scale runs on 1 and 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_findings import write_trained

from paper_figures import scaling_curves as SC
from qerl.errors import UserError

ARM, SCALE, LR = "nvfp4-lora", "toy", 5e-4
H200 = {"gpu": "NVIDIA H200", "gpu_count": 1, "cpu": "x86_64", "cpu_count": 16}


def write_set(root: Path, rewards_by_seed: dict, world: int | None = 1, heldout=0.5, lr=LR, unfinished=(),
              arm=ARM) -> Path:
    """Evidence runs of ``arm`` as experiments.evidence writes them (config.yaml, metrics.jsonl, summary.json) plus
    the summary's world size (``None``: not recorded, as before it was) and env.json; one per seed."""
    for seed, rewards in rewards_by_seed.items():
        d = write_trained(root, arm, lr, seed, rewards, evals={"toy": heldout + 0.01 * seed},
                          finished=seed not in unfinished)
        summary = json.loads((d / "summary.json").read_text())
        if world is not None:
            summary["world_size"] = world
        (d / "summary.json").write_text(json.dumps(summary))
        dist = {"world_size": world or 1, "backend": "nccl" if (world or 1) > 1 else None}
        (d / "env.json").write_text(json.dumps({"hardware": H200, "distributed": dist, "hostname": "h1"}))
    return root


def noisy(rng, shift=0.0, offsets=(0.0, 0.05, -0.05), steps=40) -> dict:
    """One curve per seed: a common rise, a per-seed offset (the seed-to-seed spread), per-step noise."""
    return {s: np.linspace(0.3, 0.7, steps) + off + shift + rng.normal(0, 0.02, steps) for s, off in enumerate(offsets)}


def row(c: SC.Comparison, metric: str) -> pd.Series:
    return c.rows.set_index("metric").loc[metric]


def test_same_distribution_matches(tmp_path):
    rng = np.random.default_rng(0)
    one = write_set(tmp_path / "one", noisy(rng))
    # the same seed-to-seed spread, dealt to other seeds, with fresh per-step noise: the same distribution
    two = write_set(tmp_path / "two", noisy(rng, offsets=(0.05, -0.05, 0.0)), world=2)
    c = SC.compare(one, two, SCALE, ARM)
    assert c.verdict == "matches within seed noise" and c.world == 2 and c.steps == 40
    assert list(c.rows["metric"]) == ["reward AUC", "final reward", "held-out pass@1 toy"]
    assert (c.rows["verdict"] == "matches").all()
    auc = row(c, "reward AUC")
    assert abs(auc["effect"]) < 0.01 and auc["spread"] == pytest.approx(0.05, abs=0.005)
    assert auc["ci_lo"] < 0 < auc["ci_hi"]
    # the per-step bands: mean over the 3 seeds with a t interval around it
    assert len(c.one.band.x) == 40 and np.all(c.many.band.lo < c.many.band.mean)


def test_shifted_set_differs_and_is_written(tmp_path):
    rng = np.random.default_rng(1)
    one = write_set(tmp_path / "one", noisy(rng))
    worse = write_set(tmp_path / "worse", noisy(rng, shift=-0.2), world=2, heldout=0.3)
    c = SC.compare(one, worse, SCALE, ARM)
    assert c.verdict == "differs"
    auc = row(c, "reward AUC")
    assert auc["verdict"] == "differs" and auc["ci_hi"] < 0 and auc["effect"] == pytest.approx(-0.2, abs=0.02)
    assert row(c, "held-out pass@1 toy")["effect"] == pytest.approx(-0.2)

    out = tmp_path / "out"
    md, csv, png, *_ = SC.write(c, out)
    text = md.read_text()
    assert md == out / "speed" / "scaling_curves_toy.md" and png == out / "figures" / "scaling_curves_toy.png"
    assert "**Verdict: differs.**" in text and "2 × NVIDIA H200, nccl, host h1" in text and "1 × NVIDIA H200" in text
    assert "evidence/toy/nvfp4-lora-lr0.0005-s2 (world size 2)" in text and png.stat().st_size > 0
    table = pd.read_csv(csv)
    assert len(table) == 3 and set(table["overall"]) == {"differs"} and set(table["world_size"]) == {2}
    # writing again (another comparison of the same scale and arm) replaces its rows; other scales' rows stay
    pd.concat([table.assign(scale="small"), table]).to_csv(csv, index=False)
    same = write_set(tmp_path / "same", noisy(rng, offsets=(0.05, -0.05, 0.0)), world=2)
    SC.write(SC.compare(one, same, SCALE, ARM), out)
    table = pd.read_csv(csv)
    assert sorted(table["scale"]) == ["small"] * 3 + ["toy"] * 3
    assert set(table.loc[table["scale"] == "toy", "overall"]) == {"matches within seed noise"}

    # speed.md shows the rows (experiments.speed renders from the CSVs under results/speed)
    from experiments.speed import render
    from experiments.speed_tables import curves_table

    assert "| toy | nvfp4-lora | 0.0005 | 2 | 0 1 2 | 40 | reward AUC |" in curves_table(out / "speed")
    assert "Reward curves on 1 vs N GPUs" in render(out / "speed")


def test_intervals_by_hand(tmp_path):
    """Constant curves: each seed's AUC and final reward are its constant. 1 GPU {0.4, 0.5, 0.6} (sd 0.1); 2 GPUs
    {0.5, 0.6, 0.7}: effect 0.1, Welch se = sqrt(0.01/3 + 0.01/3) = 0.08165 on 4 df, t_0.975,4 = 2.7764:
    [-0.1267, 0.3267] contains 0 and 0.1 is within the spread 0.1: matches. 2 GPUs {0.55, 0.65, 0.75}: effect
    0.15, [-0.0767, 0.3767] contains 0 but 0.15 exceeds the spread: inconclusive."""
    one = write_set(tmp_path / "a", {s: [v] * 10 for s, v in enumerate((0.4, 0.5, 0.6))}, heldout=0.2)
    two = write_set(tmp_path / "b", {s: [v] * 10 for s, v in enumerate((0.5, 0.6, 0.7))}, world=2, heldout=0.2)
    r = row(SC.compare(one, two, SCALE, ARM), "reward AUC")
    assert (r["effect"], r["spread"], r["df"]) == (pytest.approx(0.1), pytest.approx(0.1), pytest.approx(4.0))
    assert (r["ci_lo"], r["ci_hi"]) == (pytest.approx(-0.1267, abs=1e-4), pytest.approx(0.3267, abs=1e-4))
    assert r["verdict"] == "matches"
    further = write_set(tmp_path / "c", {s: [v] * 10 for s, v in enumerate((0.55, 0.65, 0.75))}, world=2,
                        heldout=0.2)
    c = SC.compare(one, further, SCALE, ARM)
    r = row(c, "final reward")
    assert (r["ci_lo"], r["ci_hi"]) == (pytest.approx(-0.0767, abs=1e-4), pytest.approx(0.3767, abs=1e-4))
    assert r["verdict"] == "inconclusive" and c.verdict == "inconclusive"
    # held-out pass@1 the same in both sets seed by seed (0.2, 0.21, 0.22): effect 0, within the spread
    assert row(c, "held-out pass@1 toy")["verdict"] == "matches"


def test_one_process_runs_without_a_recorded_world_size_count_as_one_gpu(tmp_path):
    rng = np.random.default_rng(2)
    one = write_set(tmp_path / "one", noisy(rng), world=None)
    c = SC.compare(one, write_set(tmp_path / "two", noisy(rng), world=4), SCALE, ARM)
    assert c.one.worlds == [1, 1, 1] and c.world == 4


def test_bad_sets_are_refused_naming_the_run(tmp_path):
    rng = np.random.default_rng(3)
    one = write_set(tmp_path / "one", noisy(rng))
    with pytest.raises(UserError, match=r"multi-GPU set has a one-process run: .*notdist.*-s0"):
        SC.compare(one, write_set(tmp_path / "notdist", noisy(rng)), SCALE, ARM)
    with pytest.raises(UserError, match=r"1-GPU set has a run trained on 2 ranks: .*dist1.*-s0"):
        SC.compare(write_set(tmp_path / "dist1", noisy(rng), world=2), one, SCALE, ARM)
    mixed = write_set(tmp_path / "mixed", {0: noisy(rng)[0]}, world=2)
    write_set(mixed, {s: c for s, c in noisy(rng).items() if s}, world=4)
    with pytest.raises(UserError, match=r"mixes world sizes: .*mixed.*-s1 has 4"):
        SC.compare(one, mixed, SCALE, ARM)
    with pytest.raises(UserError, match=r"different seeds.*missing on 2 GPUs: \[2\]"):
        SC.compare(one, write_set(tmp_path / "two_seeds", noisy(rng, offsets=(0.0, 0.05)), world=2), SCALE, ARM)
    with pytest.raises(UserError, match=r"run .*cut.*-s1 is not finished"):
        SC.compare(one, write_set(tmp_path / "cut", noisy(rng), world=2, unfinished=(1,)), SCALE, ARM)
    short = write_set(tmp_path / "short", {s: c[:30] if s == 2 else c for s, c in noisy(rng).items()}, world=2)
    with pytest.raises(UserError, match=r"run .*short.*-s2 logged steps 1\.\.30 \(30 steps\), but .*-s0 logged "
                                        r"1\.\.40"):
        SC.compare(one, short, SCALE, ARM)
    with pytest.raises(UserError, match=r"no finished runs of arm 'bf16-lora'.*arms there: \['nvfp4-lora'\]"):
        SC.compare(one, one, SCALE, "bf16-lora")
    with pytest.raises(UserError, match=r"no evidence runs of scale 'small'"):
        SC.compare(one, one, "small", ARM)
    # two rates of the arm in one root: the comparison needs --lr
    two_rates = write_set(tmp_path / "rates", noisy(rng), world=2)
    write_set(two_rates, noisy(rng), world=2, lr=1e-3)
    with pytest.raises(UserError, match=r"several rates \['5e-4', '1e-3'\]: choose one with --lr"):
        SC.compare(one, two_rates, SCALE, ARM)
    assert SC.compare(one, two_rates, SCALE, ARM, lr=5e-4).many.lr == 5e-4
    with pytest.raises(UserError, match=r"no finished runs of nvfp4-lora at lr 2e-4 .*rates there: \['5e-4'\]"):
        SC.compare(one, two_rates, SCALE, ARM, lr=2e-4)


def test_cli(tmp_path, capsys):
    rng = np.random.default_rng(4)
    one = write_set(tmp_path / "c1", noisy(rng))
    two = write_set(tmp_path / "c2", noisy(rng, offsets=(0.05, -0.05, 0.0)), world=2)
    SC.main(["--one", str(one), "--two", str(two), "--scale", SCALE, "--arm", ARM, "--out", str(tmp_path / "res")])
    out = capsys.readouterr().out
    assert "verdict: matches within seed noise" in out
    assert (tmp_path / "res" / "speed" / "scaling_curves_toy.md").exists()
    assert (tmp_path / "res" / "figures" / "scaling_curves_toy.runs.txt").read_text().count("evidence/toy/") == 6


# ------------------------------------------------------------------------------------------------ real runs
def _train(nproc: int, root: Path, seeds, log: list) -> None:
    """The evidence main stage's runs of nvfp4-lora at the smoke scale's shared rate (experiments.evidence's own
    overrides), shortened, one seed after the other, on ``nproc`` gloo ranks."""
    from experiments.evidence import PROTOCOLS, main_rows

    rows = [(r, s) for r, s in main_rows(PROTOCOLS["smoke"], None, seeds, "shared") if r.tags["arm"] == ARM]
    fast = [f"out_dir={root}", "train.steps=3", "train.batch_size=16", "algo.group_size=4", "train.micro_batch=16",
            "data.max_new_tokens=48", "eval.limit=4", "eval.n_samples=1", "eval.max_new_tokens=24",
            "eval.batch_prompts=2", "train.progress=false", "dist.timeout_s=60",
            # per-group sampling streams: the same completions on 1 and 2 ranks (tests/test_distributed.py)
            "rollout.seed_scope=group"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", QERL_REWARD_WORKERS="1")
    for r, seed in rows:
        args = ["-m", "qerl.train", *r.all_overrides("evidence", "smoke", seed, fast)]
        if nproc > 1:
            args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
        res = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
        log.append((nproc, seed, res.returncode, res.stderr[-3000:]))


@pytest.mark.slow
def test_real_smoke_runs_on_one_and_two_ranks_match(tmp_path):
    t0 = time.time()
    log = []
    jobs = [threading.Thread(target=_train, args=(n, tmp_path / f"c{n}", (0, 1), log)) for n in (1, 2)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    assert [x[2] for x in log] == [0, 0, 0, 0], log
    c = SC.compare(tmp_path / "c1", tmp_path / "c2", "smoke", ARM)
    assert (c.one.worlds, c.many.worlds, c.one.seeds, c.steps) == ([1, 1], [2, 2], [0, 1], 3)
    # group-scoped sampling: each seed's rewards are the same on 1 and 2 ranks, so every effect is 0
    for d1, d2 in zip(c.one.runs["run_dir"], c.many.runs["run_dir"], strict=True):
        assert np.array_equal(c.one.curves[d1][1], c.many.curves[d2][1])
    assert (c.rows["effect"] == 0).all() and c.verdict == "matches within seed noise", c.rows
    assert "2 × CPU" in SC.render_markdown(c) and "gloo" in SC.render_markdown(c)
    print(f"real runs + comparison: {time.time() - t0:.0f} s")


def test_copies_outside_the_evidence_folder_are_not_the_roots_runs(tmp_path):
    """A results tree that keeps another machine's runs under speed/raw/…/evidence/ (issue 13's 2-GPU curves, or an
    unfinished 1-GPU set) still compares its own evidence/<scale>/ runs: the copies are neither duplicates nor
    'unfinished' runs of the root."""
    rng = np.random.default_rng(3)
    root = write_set(tmp_path / "results", noisy(rng))
    kept = write_set(tmp_path / "results" / "speed" / "raw" / "x4" / "c2", noisy(rng), world=2)
    write_set(tmp_path / "results" / "speed" / "raw" / "x4" / "c1", noisy(rng), unfinished=(0, 1, 2))
    c = SC.compare(root, kept, SCALE, ARM)
    assert c.world == 2 and len(c.one.runs) == 3
    assert all("speed" not in Path(d).parts for d in c.one.runs["run_dir"])
    assert all("c2" in Path(d).parts for d in c.many.runs["run_dir"])
