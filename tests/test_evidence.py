"""The evidence matrix (experiments/evidence.py): its rules (temperature choice, lr selection, which runs a stage
makes) and the claim-(a) runner on the CPU smoke model."""

from __future__ import annotations

import json
import re

import pytest

from experiments import evidence as E
from qerl.errors import UserError

P = E.Protocol(lora_grid=(1e-4, 2e-4, 5e-4), full_grid=(1e-5, 3e-5), shared=2e-4, seeds=(0, 1, 2))


def test_temperature_is_the_papers_when_the_task_is_learnable_there():
    assert E.choose_temperature({1.0: 0.25, 0.7: 0.4})[0] == 1.0


def test_temperature_falls_to_the_highest_that_reaches_ten_percent():
    t, why = E.choose_temperature({1.0: 0.034, 0.8: 0.081, 0.7: 0.104, 0.6: 0.106})
    assert t == 0.7 and "0.034" in why and "T=0.7" in why


def test_temperature_when_nothing_reaches_ten_percent_says_so():
    t, why = E.choose_temperature({1.0: 0.01, 0.6: 0.05})
    assert t == 0.6 and "no tried temperature" in why


def test_too_easy_task_keeps_t1_and_says_so():
    t, why = E.choose_temperature({1.0: 0.8})
    assert t == 1.0 and "too easy" in why


def _keys(pairs):
    return sorted(f"{row.key}-s{seed}" for row, seed in pairs)


def test_grid_is_seed0_of_every_format_arm_at_every_rate():
    keys = _keys(E.grid_rows(P))
    assert len(keys) == 2 + 4 * 3
    assert "bf16-full-lr1e-05-s0" in keys and "nvfp4-lora-lr0.0005-s0" in keys
    assert all(k.endswith("-s0") for k in keys)


def test_main_runs_shared_and_best_rates_once_each():
    best = {"bf16-full": 1e-5, "bf16-lora": 2e-4, "nf4-lora": 2e-4, "mxfp4-lora": 1e-4, "nvfp4-lora": 5e-4}
    keys = _keys(E.main_rows(P, best, P.seeds))
    assert len(keys) == len(set(keys))
    # an arm whose best rate is the shared one runs once per seed; the others at both rates; Full at its best only
    assert sum(k.startswith("bf16-lora-") for k in keys) == 3
    assert sum(k.startswith("mxfp4-lora-") for k in keys) == 6
    assert sum(k.startswith("bf16-full-") for k in keys) == 3 and "bf16-full-lr1e-05-s2" in keys
    # the grid's seed-0 runs are the same directories (not run twice)
    assert set(_keys(E.grid_rows(P))) & set(keys) >= {"nvfp4-lora-lr0.0002-s0", "nvfp4-lora-lr0.0005-s0"}


def test_main_at_the_shared_rate_only_needs_no_grid(tmp_path):
    """--rates shared: the four LoRA arms at the shared rate (fixed before any run), no Full, no grid read."""
    pairs = E.stage_pairs("main", tmp_path, "small", P, (1, 2), dry_run=False, rates="shared")
    keys = _keys(pairs)
    assert sorted(keys) == sorted(f"{a}-lr0.0002-s{s}" for a in E.FORMAT_ARMS for s in (1, 2))
    best = {"bf16-full": 1e-5, "bf16-lora": 2e-4, "nf4-lora": 2e-4, "mxfp4-lora": 1e-4, "nvfp4-lora": 5e-4}
    only_best = _keys(E.main_rows(P, best, (0,), rates="best"))
    assert sorted(only_best) == sorted(["bf16-full-lr1e-05-s0", "bf16-lora-lr0.0002-s0", "nf4-lora-lr0.0002-s0",
                                        "mxfp4-lora-lr0.0001-s0", "nvfp4-lora-lr0.0005-s0"])
    with pytest.raises(UserError, match="grid is not finished"):  # best rates still need the grid
        E.stage_pairs("main", tmp_path, "small", P, (1,), dry_run=False, rates="both")


def test_arms_filter_keeps_the_given_order_and_names_unknown_arms(tmp_path):
    pairs = E.main_rows(P, None, (1,), rates="shared")
    kept = E.keep_arms(pairs, ("nvfp4-lora", "bf16-lora"))
    assert [f"{row.key}-s{seed}" for row, seed in kept] == ["nvfp4-lora-lr0.0002-s1", "bf16-lora-lr0.0002-s1"]
    with pytest.raises(UserError, match=r"--arms 'nvfp4,bf16-lora': unknown arm\(s\) \['nvfp4'\]; valid: .*'nvfp4-lora'"):
        E.main(["--scale", "small", "--arms", "nvfp4,bf16-lora", "--root", str(tmp_path)])
    with pytest.raises(UserError, match=r"--rates 'all': valid choices are \['both', 'shared', 'best'\]"):
        E.main(["--scale", "small", "--rates", "all", "--root", str(tmp_path)])


def test_aqn_arms_run_at_their_base_arms_best_rate():
    best = {"bf16-full": 1e-5, "bf16-lora": 1e-4, "nf4-lora": 2e-4, "mxfp4-lora": 1e-4, "nvfp4-lora": 5e-4}
    rows = E.aqn_rows(P, best, (0,))
    by_arm = {row.tags["arm"]: row for row, _ in rows}
    assert set(by_arm) == set(E.AQN_BASE)
    assert "optim.lr=0.0001" in by_arm["bf16-lora-aqn"].overrides
    assert all("optim.lr=0.0005" in by_arm[a].overrides for a in E.AQN_BASE if a.startswith("nvfp4"))
    assert "aqn.schedule=cosine" in by_arm["nvfp4-lora-aqn-cosine"].overrides


def test_main_stage_refuses_a_partial_grid(tmp_path):
    with pytest.raises(UserError, match="grid is not finished"):
        E.best_rates(tmp_path, "small", P)


def test_best_rates_use_training_reward_only(tmp_path):
    """Two grid runs: the higher mean training reward wins even where held-out pass@1 says the opposite."""
    p = E.Protocol(lora_grid=(1e-4, 2e-4), full_grid=(1e-5,), shared=1e-4, seeds=(0,))
    for arm in ("bf16-full", *E.FORMAT_ARMS):
        for lr in p.grid(arm):
            d = tmp_path / "evidence" / "small" / E.run_key(arm, lr, 0)
            d.mkdir(parents=True)
            good = lr == 2e-4
            lines = [json.dumps({"step": s, "reward": (0.6 if good else 0.3)}) for s in range(1, 5)]
            (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
            (d / "summary.json").write_text(json.dumps({"finished": True,
                                                        "eval": {"toy": {"pass@1": 0.1 if good else 0.9}}}))
    best = E.best_rates(tmp_path, "small", p)
    assert best["nvfp4-lora"] == 2e-4 and best["bf16-full"] == 1e-5


def test_aqn_schedules_need_only_their_base_arms_grid(tmp_path):
    """--arms of the NVFP4 AQN schedules: only NVFP4-LoRA's grid must be finished (BF16-Full's may still run); the
    best rate found is merged into protocol.json's best_lr next to what an earlier stage wrote."""
    p = E.Protocol(lora_grid=(1e-4, 2e-4), full_grid=(1e-5,), shared=1e-4, seeds=(0, 1))
    for lr in p.grid("nvfp4-lora"):
        d = tmp_path / "evidence" / "small" / E.run_key("nvfp4-lora", lr, 0)
        d.mkdir(parents=True)
        lines = [json.dumps({"step": s, "reward": 0.6 if lr == 2e-4 else 0.3}) for s in range(1, 5)]
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (d / "summary.json").write_text(json.dumps({"finished": True}))
    E._update_protocol(tmp_path, "small", best_lr={"mxfp4-lora": 1e-4})
    arms = tuple(f"nvfp4-lora-aqn-{s}" for s in E.SCHEDULES)
    pairs = E.keep_arms(E.stage_pairs("aqn", tmp_path, "small", p, (0, 1), False, "both", arms), arms)
    assert sorted(_keys(pairs)) == sorted(f"{a}-lr0.0002-s{s}" for a in arms for s in (0, 1))
    doc = json.loads((tmp_path / "evidence" / "small" / "protocol.json").read_text())
    assert doc["best_lr"] == {"mxfp4-lora": 1e-4, "nvfp4-lora": 2e-4}
    with pytest.raises(UserError, match="grid is not finished"):  # BF16-Full's grid is still needed for its arm
        E.stage_pairs("main", tmp_path, "small", p, (0,), False, "best", ("bf16-full",))


def test_stages_that_need_only_earlier_choices_share_one_pool(tmp_path, capsys):
    """--stage all plans three waves: calibrate; grid + entropy + base (grid first: the longest runs start first);
    main + aqn. A wave's runs are one job list, so no worker idles at a stage's tail."""
    E.main(["--scale", "smoke", "--dry-run", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    n = {st: int(re.search(rf"stage {st}: (\d+) runs", out).group(1)) for st in E.STAGES}
    totals = [int(t) for t in re.findall(r"plan 1/(\d+) ", out)]
    assert totals == [n["calibrate"], n["grid"] + n["entropy"] + n["base"], n["main"] + n["aqn"]]
    assert out.index("stage grid") < out.index("stage entropy")


def test_unknown_stage_is_named(tmp_path):
    with pytest.raises(UserError, match=r"unknown stage\(s\) \['gird'\]"):
        E.main(["--scale", "small", "--stage", "gird", "--root", str(tmp_path)])


def test_artifacts_at_evidence_scales_plan_the_evidence_stages(tmp_path, capsys):
    from experiments import fig4

    fig4.main(["--scale", "small", "--dry-run", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert "stage calibrate: 4 runs" in out and "stage grid: 15 runs" in out
    assert "stage main" in out and "stage aqn" not in out
    assert json.loads((tmp_path / "evidence" / "small" / "protocol.json").read_text())["shared_lr"] == 2e-4


def test_entropy_runner_writes_per_prompt_rows(tmp_path):
    """Claim (a)'s runner on the CPU smoke model: per-prompt entropy and correctness, token-weighted summary."""
    from qerl.config import load_config

    cfg = load_config(["scale=smoke", "quant=nvfp4", f"out_dir={tmp_path}", "experiment=evidence/smoke",
                       "run_name=entropy-nvfp4-s0", "+tags.n_prompts=6", "+tags.n_samples=2",
                       "data.max_new_tokens=16", "+tags.stage=entropy"])
    s = E.run_entropy(cfg)
    rows = [json.loads(x) for x in (tmp_path / "evidence" / "smoke" / "entropy-nvfp4-s0" / "entropy.jsonl")
            .read_text().splitlines()]
    assert s["kind"] == "entropy" and s["format"] == "nvfp4" and s["n_prompts"] == len(rows) == 6
    assert all(r["tokens"] > 0 and r["entropy"] >= 0 and 0 <= r["correct"] <= 1 for r in rows)
    weighted = sum(r["entropy"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows)
    assert s["entropy_mean"] == pytest.approx(weighted)
    assert s["pass@1"] == pytest.approx(sum(r["correct"] for r in rows) / 6)
    # the same prompts for another seed: a paired comparison over prompts
    cfg1 = load_config(["scale=smoke", "quant=bf16", f"out_dir={tmp_path}", "experiment=evidence/smoke",
                        "run_name=entropy-bf16-s1", "seed=1", "+tags.n_prompts=6", "+tags.n_samples=2",
                        "data.max_new_tokens=16", "+tags.stage=entropy"])
    E.run_entropy(cfg1)
    ids1 = [json.loads(x)["id"] for x in (tmp_path / "evidence" / "smoke" / "entropy-bf16-s1" / "entropy.jsonl")
            .read_text().splitlines()]
    assert ids1 == [r["id"] for r in rows]


def test_base_stage_evaluates_each_untrained_format_once():
    pairs = E.base_rows(P)
    assert [(row.key, seed, row.runner) for row, seed in pairs] == [(f"heldout-{f}", 0, "base") for f in E.FORMATS]
    assert all(row.tags["training"] == "none" and row.tags["stage"] == "base" for row, _ in pairs)
    assert E.STAGES.index("base") < E.STAGES.index("grid")
