"""Evidence findings and figures on a results tree written by the test with made-up numbers whose effects are known:
NVFP4-LoRA is clearly above BF16-LoRA in every seed (supported), MXFP4-LoRA clearly below (contradicted), NF4-LoRA
within the seed spread of NVFP4-LoRA (inconclusive); the lr protocol picks by training reward only; missing arms
give "not run" rows; the curve figures draw t-interval bands over seeds."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from paper_figures import evidence as E
from paper_figures import evidence_runs as ER
from paper_figures import figures as F
from paper_figures import findings as FD
from paper_figures.__main__ import main as cli_main
from qerl.errors import UserError

SCALE = "toy"
STEPS = 20
SEED_OFFSET = {0: 0.0, 1: 0.03, 2: -0.03}  # the same spread in every arm: differences of means are exact
GRID = (1e-5, 3e-5, 1e-4)
SHARED = 3e-5
NOTE = "BF16 weights are the Q4_1 GGUF values (SmolLM2-135M-Instruct)"
# arm -> (reward level at its best rate, best rate); 0.1 less at any other rate
LEVELS = {"bf16-lora": (0.40, 1e-5), "nf4-lora": (0.58, 3e-5), "mxfp4-lora": (0.30, 3e-5),
          "nvfp4-lora": (0.60, 1e-4), "bf16-full": (0.50, 3e-6)}
RAMP = np.linspace(0.0, 0.1, STEPS)  # every curve rises by the same 0.1 over the run


def write_trained(root: Path, arm: str, lr: float, seed: int, rewards, *, evals=None, finished=True, note=NOTE,
                  scale=SCALE) -> Path:
    """A trained evidence run as experiments/evidence.py writes it: config.yaml, metrics.jsonl, summary.json."""
    fmt, full, aqn = arm.split("-")[0], arm == "bf16-full", "aqn" in arm
    sched = arm.rsplit("-", 1)[-1] if arm.count("-") == 3 else "exponential"
    d = root / "evidence" / scale / f"{arm}-lr{lr:g}-s{seed}"
    d.mkdir(parents=True)
    cfg = {"scale": scale, "seed": seed, "experiment": f"evidence/{scale}", "optim": {"lr": lr},
           "quant": {"format": fmt}, "lora": {"enabled": not full},
           "aqn": {"enabled": aqn, "schedule": sched},
           "tags": {"table": "evidence", "arm": arm, "weights": fmt.upper(), "training": "full" if full else "lora",
                    "aqn": "yes" if aqn else "no"}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    lines = [{"step": s + 1, "reward": float(r), "entropy": 0.5 - 0.01 * s, "sampling_entropy": 0.6 - 0.01 * s,
              "sigma": 0.01 if aqn else 0.0} for s, r in enumerate(rewards)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ev = {k: {"pass@1": v, "n_problems": 100, "n_samples": 4} for k, v in (evals or {}).items()}
    summ = {"finished": finished, "steps": len(rewards), "scale": scale, "eval": ev}
    if note:
        summ["model_source"] = {"note": note}
    (d / "summary.json").write_text(json.dumps(summ))
    return d


def write_entropy(root: Path, fmt: str, seed: int, entropies, pass1: float, scale=SCALE) -> Path:
    """A claim-(a) run: config.yaml, summary.json (kind entropy) and entropy.jsonl (one line per prompt)."""
    d = root / "evidence" / scale / f"entropy-{fmt}-s{seed}"
    d.mkdir(parents=True)
    cfg = {"scale": scale, "seed": seed, "experiment": f"evidence/{scale}", "quant": {"format": fmt},
           "tags": {"table": "evidence", "arm": f"base-{fmt}"}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (d / "entropy.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "entropy": float(e), "tokens": 100,
                                                         "correct": 0.25}) + "\n" for i, e in enumerate(entropies)))
    (d / "summary.json").write_text(json.dumps({
        "finished": True, "kind": "entropy", "format": fmt, "temperature": 1.0, "n_prompts": len(entropies),
        "n_samples": 8, "entropy_mean": float(np.mean(entropies)), "pass@1": pass1, "model_source": {"note": NOTE}}))
    return d


def level(arm: str, lr: float) -> float:
    top, best = LEVELS[arm]
    return top if math.isclose(lr, best) else top - 0.1


N_PROMPTS = 40
ALT = np.array([(-1) ** i for i in range(N_PROMPTS)], dtype=float)  # ±1 alternating: sums to 0
BASE_ENTROPY = 1.0 + 0.3 * np.sin(np.arange(N_PROMPTS))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    for arm, (_, best) in LEVELS.items():
        grid = (1e-6, 3e-6, 1e-5) if arm == "bf16-full" else GRID
        rates = set(grid) | {best} | (set() if arm == "bf16-full" else {SHARED})
        for lr in sorted(rates):
            seeds = (0, 1, 2) if math.isclose(lr, best) or math.isclose(lr, SHARED) else (0,)
            for seed in seeds:
                # held-out pass@1 would pick NVFP4-LoRA's lowest rate; training reward picks 1e-4
                trap = arm == "nvfp4-lora" and lr == 1e-5
                write_trained(root, arm, lr, seed, level(arm, lr) + SEED_OFFSET[seed] + RAMP,
                              evals={"toy": 0.95 if trap else level(arm, lr) / 2 + 0.01 * seed})
    # an unfinished NVFP4-LoRA seed with a huge reward: left out
    write_trained(root, "nvfp4-lora", 1e-4, 3, np.full(STEPS, 5.0), evals={"toy": 1.0}, finished=False)
    # claim (c): AQN lifts NVFP4-LoRA by 0.1 (runs at the shared rate and NVFP4-LoRA's best); the BF16 control is
    # only run at the shared rate and is no better; linear schedule only at NVFP4's best; cosine, logarithmic absent
    for seed in (0, 1, 2):
        for lr in (SHARED, 1e-4):
            write_trained(root, "nvfp4-lora-aqn", lr, seed, level("nvfp4-lora", lr) + 0.1 + SEED_OFFSET[seed] + RAMP,
                          evals={"toy": 0.5})
        write_trained(root, "bf16-lora-aqn", SHARED, seed,
                      level("bf16-lora", SHARED) + [0.02, -0.02, 0.0][seed] + RAMP, evals={"toy": 0.2})
        write_trained(root, "nvfp4-lora-aqn-linear", 1e-4, seed, 0.65 + SEED_OFFSET[seed] + RAMP, evals={"toy": 0.5})
    # claim (a): NVFP4 +0.1 and MXFP4 −0.05 per prompt (each ± 0.02, alternating), NF4 ± 0.02 around BF16
    for seed in (0, 1, 2):
        bf16 = BASE_ENTROPY + 0.01 * (seed - 1)
        write_entropy(root, "bf16", seed, bf16, pass1=[0.25, 0.30, 0.35][seed])
        write_entropy(root, "nvfp4", seed, bf16 + 0.1 + 0.02 * ALT, pass1=0.2)
        write_entropy(root, "mxfp4", seed, bf16 - 0.05 + 0.02 * ALT, pass1=0.2)
        write_entropy(root, "nf4", seed, bf16 + 0.02 * ALT, pass1=0.2)
    (root / "evidence" / SCALE / "protocol.json").write_text(json.dumps(
        {"shared_lr": SHARED, "grid": {"nvfp4-lora": [1e-5, 3e-5, 1e-4, 3e-4]}, "seeds": [0, 1, 2], "budget_min": 20}))
    return root


@pytest.fixture(scope="module")
def table(tree) -> pd.DataFrame:
    return FD.findings(tree, SCALE)[1]


def row(df, comparison, mode, metric="reward AUC"):
    hit = df[(df["comparison"] == comparison) & (df["lr_mode"] == mode) & (df["metric"] == metric)]
    assert len(hit) == 1, (comparison, mode, metric, df[["comparison", "lr_mode", "metric"]])
    return hit.iloc[0]


# ------------------------------------------------------------------------------------------------ lr protocol
def test_best_lr_uses_training_reward_only(tree):
    ev = ER.load(tree, SCALE)
    nv = ev.runs[ev.runs["arm"] == "nvfp4-lora"]
    # held-out pass@1 of the grid runs would choose 1e-5 (0.95); the training reward chooses 1e-4
    assert ER.best_lr(nv) == pytest.approx(1e-4)
    assert ev.protocol.best == pytest.approx({a: b for a, (_, b) in LEVELS.items()} | {
        "nvfp4-lora-aqn": 1e-4, "bf16-lora-aqn": SHARED, "nvfp4-lora-aqn-linear": 1e-4})
    # the grid score is the mean training reward over all steps of the seed-0 run
    assert ev.protocol.grid["nvfp4-lora"][1e-4] == pytest.approx(0.60 + 0.05)
    assert ev.protocol.grid["nvfp4-lora"][1e-5] == pytest.approx(0.50 + 0.05)
    assert ER.mean_training_reward(nv[nv["lr"] == 1e-4].query("seed == 0")["run_dir"].iloc[0]) == pytest.approx(0.65)


def test_best_lr_tie_goes_to_the_lower_rate(tmp_path):
    for lr in (3e-4, 1e-4, 2e-4):
        write_trained(tmp_path, "bf16-lora", lr, 0, np.full(5, 0.3 if lr != 3e-4 else 0.1))
    ev = ER.load(tmp_path, SCALE)
    assert ER.best_lr(ev.runs) == pytest.approx(1e-4)
    assert ER.best_lr(ev.runs.iloc[0:0]) is None


def test_shared_rate_from_protocol_json_else_the_median_grid_rate(tree, tmp_path):
    p = ER.load(tree, SCALE).protocol
    assert p.shared == pytest.approx(SHARED) and "protocol.json" in p.shared_source
    assert p.extra == {"budget_min": 20} and p.seeds == [0, 1, 2]
    # without protocol.json: the lower middle of the LoRA arms' grid rates (4 rates here: the 2nd)
    for arm, rates in (("bf16-lora", (1e-5, 1e-4)), ("nvfp4-lora", (3e-5, 3e-4))):
        for lr in rates:
            write_trained(tmp_path, arm, lr, 0, np.full(5, 0.3))
    write_trained(tmp_path, "bf16-full", 1e-6, 0, np.full(5, 0.3))  # full fine-tuning's grid does not count
    p = ER.load(tmp_path, SCALE).protocol
    assert p.shared == pytest.approx(3e-5) and "median" in p.shared_source
    assert p.n_settings == 5 and p.n_runs == 5


# ------------------------------------------------------------------------------------------------ verdicts
def test_claim_b_verdicts_from_known_effects(table):
    # best rates: NVFP4 0.60 vs BF16 0.40 in every seed (same seed spread): +0.20 exactly, supported
    r = row(table, "NVFP4-LoRA − BF16-LoRA", "best")
    assert r["effect"] == pytest.approx(0.20) and r["verdict"] == "supported"
    assert (r["lr_a"], r["lr_b"], r["n_a"], r["n_b"]) == (pytest.approx(1e-4), pytest.approx(1e-5), 3, 3)
    # Welch by hand: s² = 0.0009 each side, se² = 2·0.0009/3 = 0.0006, df = 4; half = 2.776·0.024495 = 0.06800
    assert r["ci_hi"] - r["effect"] == pytest.approx(0.06800, rel=1e-3)
    assert row(table, "NVFP4-LoRA − BF16-LoRA", "best", "final reward")["effect"] == pytest.approx(0.20)
    # within the seed spread: inconclusive; reversed: contradicted
    assert row(table, "NVFP4-LoRA − NF4-LoRA", "best")["verdict"] == "inconclusive"
    assert row(table, "MXFP4-LoRA − BF16-LoRA", "best")["verdict"] == "contradicted"
    assert row(table, "MXFP4-LoRA − BF16-LoRA", "best")["effect"] == pytest.approx(-0.10)
    # at the shared rate NVFP4 and BF16 are both off their best (0.50 vs 0.30), MXFP4 equals BF16 there
    assert row(table, "NVFP4-LoRA − BF16-LoRA", "shared")["effect"] == pytest.approx(0.20)
    assert row(table, "MXFP4-LoRA − BF16-LoRA", "shared")["verdict"] == "inconclusive"
    assert row(table, "NVFP4-LoRA − NF4-LoRA", "shared")["verdict"] == "contradicted"
    # BF16-Full: only the best-rate comparison
    assert set(table[table["comparison"] == "NVFP4-LoRA − BF16-Full"]["lr_mode"]) == {"best"}
    # held-out pass@1 is a metric of its own, never the one that chose the rates
    assert row(table, "NVFP4-LoRA − BF16-LoRA", "best", "pass@1 toy")["effect"] == pytest.approx(0.30 - 0.20)


def test_unfinished_runs_are_left_out(tree, table):
    assert row(table, "NVFP4-LoRA − BF16-LoRA", "best")["n_a"] == 3
    ev = ER.load(tree, SCALE)
    assert ev.unfinished == [f"evidence/{SCALE}/nvfp4-lora-lr0.0001-s3"]


def test_claim_c_rows_and_missing_arms(table):
    r = row(table, "NVFP4-LoRA+AQN − NVFP4-LoRA", "best")
    assert r["effect"] == pytest.approx(0.10) and r["verdict"] == "supported" and r["lr_a"] == r["lr_b"]
    assert row(table, "NVFP4-LoRA+AQN − NVFP4-LoRA", "shared")["verdict"] == "supported"
    # the control has no run at BF16-LoRA's best rate: its own best rate, said in the note
    r = row(table, "BF16-LoRA+AQN − BF16-LoRA", "best")
    assert r["lr_a"] == pytest.approx(SHARED) and r["lr_b"] == pytest.approx(1e-5) and "own best" in r["note"]
    assert row(table, "BF16-LoRA+AQN − BF16-LoRA", "shared")["verdict"] == "inconclusive"
    # linear only at NVFP4's best rate: not run at the shared rate; cosine never run: every row "not run"
    assert row(table, "NVFP4-LoRA+AQN(linear) − NVFP4-LoRA", "best")["effect"] == pytest.approx(0.05)
    r = row(table, "NVFP4-LoRA+AQN(linear) − NVFP4-LoRA", "shared")
    assert r["verdict"] == "not run" and "nvfp4-lora-aqn-linear at lr 3e-5" in r["note"]
    cos = table[table["comparison"] == "NVFP4-LoRA+AQN(cosine) − NVFP4-LoRA"]
    assert len(cos) == 6 and set(cos["verdict"]) == {"not run"}  # 2 modes × (AUC, final, pass@1 toy)


def test_claim_a_paired_over_prompts_by_hand(table):
    r = row(table, "NVFP4 − BF16 base", "-", "sampling entropy")
    # differences alternate 0.12 / 0.08 over 40 prompts: mean 0.1, s = 0.02·√(40/39) = 0.020255,
    # se = 0.0032026; t_{0.975,39} = 2.023 -> half 0.006479
    assert r["effect"] == pytest.approx(0.1) and r["n_pairs"] == 40 and (r["n_a"], r["n_b"]) == (3, 3)
    assert (r["ci_lo"], r["ci_hi"]) == (pytest.approx(0.1 - 0.006479, rel=1e-3), pytest.approx(0.1 + 0.006479, rel=1e-3))
    assert r["verdict"] == "supported"
    assert row(table, "MXFP4 − BF16 base", "-", "sampling entropy")["verdict"] == "contradicted"
    nf4 = row(table, "NF4 − BF16 base", "-", "sampling entropy")
    assert nf4["verdict"] == "inconclusive" and "reported" in nf4["note"]


def test_learnability_line(table):
    r = table[table["claim"] == "learnability"].iloc[0]
    # pass@1 0.25, 0.30, 0.35: mean 0.30, s 0.05; half = 4.303·0.05/√3 = 0.12422
    assert r["effect"] == pytest.approx(0.30) and r["ci_hi"] == pytest.approx(0.42422, rel=1e-3)
    assert r["metric"] == "pass@1 at T=1.0" and "within" in r["note"]


def test_holm_within_each_claim(table):
    b = table[(table["claim"] == "b") & table["p"].notna()]
    assert (b["p_holm"] >= b["p"] - 1e-12).all() and b["p_holm"].max() <= 1.0
    smallest = b.loc[b["p"].idxmin()]
    assert smallest["p_holm"] == pytest.approx(min(1.0, smallest["p"] * len(b)))


def test_findings_files(tree):
    md_path, csv_path = FD.write_findings(tree, SCALE)
    md = md_path.read_text()
    assert md_path == tree / "evidence" / SCALE / "findings.md"
    for text in ("## Claim (a)", "## Claim (b)", "## Claim (c)", "## Learning-rate protocol", NOTE, "Holm",
                 "**Learnability.**", "shared rate (all LoRA arms): **3e-5**", "settings tried", "not run",
                 "nvfp4-lora-lr0.0001-s3"):
        assert text in md, text
    # the planned-but-not-run grid rate of protocol.json is marked in the grid table
    assert "| nvfp4-lora |  |  | 0.550 | 0.550 | **0.650** | · | 1e-4 |" in md
    # claims (b), (c): one line per comparison and rate mode, a column per metric
    line = next(ln for ln in md.splitlines() if ln.startswith("| NVFP4-LoRA − BF16-LoRA | best 1e-4 / 1e-5 |"))
    assert "| 3/3 | 0.650 vs 0.450<br>+0.200 [+0.132, +0.268]<br>**supported** (Holm p " in line
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == set(FD.COLUMNS)
    assert {r["verdict"] for r in rows} >= {"supported", "contradicted", "inconclusive", "not run"}


def test_a_bad_protocol_file_is_named(tmp_path):
    write_trained(tmp_path, "bf16-lora", 1e-5, 0, np.full(5, 0.3))
    path = tmp_path / "evidence" / SCALE / "protocol.json"
    for text, msg in (("{not json", "not valid JSON"), ('{"shared_lr": "fast"}', "shared_lr must be a number"),
                      ('{"grid": {"bf16-lora": 1e-5}}', "grid must map each arm")):
        path.write_text(text)
        with pytest.raises(UserError, match=msg) as e:
            ER.load(tmp_path, SCALE)
        assert str(path) in str(e.value)


def test_a_scale_without_arms_says_not_run(tmp_path):
    write_trained(tmp_path, "bf16-lora", 1e-5, 0, np.full(5, 0.3))
    md, df = FD.findings(tmp_path, SCALE)
    claims = df[df["claim"].isin(["a", "b", "c"])]
    assert set(claims["verdict"]) == {"not run"} and "not run" in md
    assert FD.findings(tmp_path, "small") is None and FD.write_findings(tmp_path, "small") == []


# ------------------------------------------------------------------------------------------------ figures
def test_evidence_band_numbers(tree):
    ev = ER.load(tree, SCALE)
    band, dirs = E.line_band(ev, "nvfp4-lora", 1e-4, "reward")
    assert len(dirs) == 3 and list(band.n) == [3] * STEPS
    # seeds at +0, +0.03, −0.03 around 0.60 + ramp: mean 0.60 + ramp, half = 4.303 · 0.03/√3 = 0.074530
    assert band.mean == pytest.approx(0.60 + RAMP)
    assert band.hi - band.mean == pytest.approx(np.full(STEPS, 0.074530), rel=1e-3)
    band, dirs = E.line_band(ev, "nvfp4-lora", 1e-5, "reward")  # one seed: a line, no band
    assert len(dirs) == 1 and np.isnan(band.lo).all()


def test_evidence_figures_skip_without_runs(tmp_path, capsys):
    assert E.all_figures(tmp_path, SCALE) == [] and E.reward_curves(tmp_path, SCALE) == []
    assert "skip evidence" in capsys.readouterr().out


def test_paper_curve_figures_draw_bands(tmp_path):
    # two seeds 0.01 apart at every step: band half-width t_{0.975,1}·0.005 = 12.706·0.005 = 0.06353
    for seed in (0, 1):
        d = write_trained(tmp_path, "nvfp4-lora", 1e-5, seed, 0.2 + 0.01 * seed + RAMP)
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        cfg["experiment"] = "fig4/toy"
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    m = pd.DataFrame([dict(json.loads(ln), run_dir=str(d)) for d in sorted((tmp_path / "evidence" / SCALE).iterdir())
                      for ln in (d / "metrics.jsonl").read_text().splitlines()]).assign(g="x")
    band = F.group_bands(m, "reward", ["g"])[("x",)]
    assert band.mean == pytest.approx(0.205 + RAMP) and band.hi - band.mean == pytest.approx(
        np.full(STEPS, 0.06353), rel=1e-3)
    paths = F.fig4(tmp_path, scale="toy", out_dir=tmp_path / "figs")
    assert paths and paths[0].exists()


def test_cli_writes_evidence_figures_and_findings(tree, capsys):
    assert cli_main(["--root", str(tree), "--only", "evidence,findings", "--scale", SCALE]) == 0
    out = capsys.readouterr().out
    assert f"wrote   evidence[{SCALE}]" in out and f"wrote   findings[{SCALE}]" in out
    figs = tree / "figures"
    for n in ("reward", "entropy", "aqn", "schedules", "sampling_entropy", "lr_grid"):
        assert (figs / f"evidence_{n}_{SCALE}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", n
        sidecar = (figs / f"evidence_{n}_{SCALE}.runs.txt").read_text()
        assert NOTE in sidecar.splitlines()[0]  # the GGUF note travels with the figure
    listed = (figs / f"evidence_reward_{SCALE}.runs.txt").read_text()
    assert "nvfp4-lora-lr0.0001-s2" in listed and "s3" not in listed  # the unfinished run is not drawn
    assert "entropy-nvfp4-s0" in (figs / f"evidence_sampling_entropy_{SCALE}.runs.txt").read_text()
    assert (tree / "evidence" / SCALE / "findings.csv").exists()


def test_evidence_figures_with_most_arms_missing(tmp_path, capsys):
    for seed in (0, 1):
        write_trained(tmp_path, "bf16-lora", 1e-5, seed, 0.3 + 0.01 * seed + RAMP)
    written = {p.name for p in E.all_figures(tmp_path, SCALE, out_dir=tmp_path / "f") if p.suffix == ".png"}
    # the format and AQN figures draw what exists ("not run" panels for the rest); no entropy runs: skipped
    assert {f"evidence_{n}_{SCALE}.png" for n in ("reward", "aqn", "lr_grid")} <= written
    assert f"evidence_sampling_entropy_{SCALE}.png" not in written
    assert f"skip evidence_sampling_entropy_{SCALE}" in capsys.readouterr().out


def test_evidence_modules_do_not_import_torch():
    code = ("import sys, paper_figures.stats, paper_figures.evidence_runs, paper_figures.findings, "
            "paper_figures.evidence, paper_figures.__main__; "
            "bad = [m for m in ('torch', 'qerl.aqn', 'qerl.train') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(FD.__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr


def test_partial_grid_and_best_equal_to_shared(tree, table):
    """A best rate picked from a partial grid says so; where both arms' best rate is the shared one, the pair has
    one row (the same runs), not a shared and a best row counted twice by Holm."""
    import dataclasses

    r = row(table, "NVFP4-LoRA − BF16-LoRA", "best")  # protocol.json plans nvfp4-lora at 3e-4: never run
    assert "best rate provisional: no finished grid run of nvfp4-lora at 3e-4" in r["note"]
    assert "provisional" not in row(table, "MXFP4-LoRA − BF16-LoRA", "best")["note"]
    ev = ER.load(tree, SCALE)
    best = dict(ev.protocol.best, **{"nvfp4-lora": SHARED, "bf16-lora": SHARED})
    ev2 = dataclasses.replace(ev, protocol=dataclasses.replace(ev.protocol, best=best))
    rows = pd.DataFrame(FD._claim_b(ev2))
    pair = rows[rows["comparison"] == "NVFP4-LoRA − BF16-LoRA"]
    assert set(pair["lr_mode"]) == {"shared"} and len(pair) == len(FD.run_metrics(ev2))
    assert all("also each arm's best rate" in n for n in pair["note"])
    assert set(rows[rows["comparison"] == "MXFP4-LoRA − BF16-LoRA"]["lr_mode"]) == {"shared"}  # MXFP4's best: 3e-5
    assert set(rows[rows["comparison"] == "NVFP4-LoRA − BF16-Full"]["lr_mode"]) == {"best"}
    assert set(pd.DataFrame(FD._claim_b(ev))["lr_mode"]) == {"shared", "best"}  # as run: the rates differ


def write_heldout(root: Path, fmt: str, pass1: float, scale=SCALE) -> Path:
    """An untrained base evaluated on the held-out set (experiments.evidence --stage base, runner qerl.evaluate)."""
    d = root / "evidence" / scale / f"heldout-{fmt}-s0"
    d.mkdir(parents=True)
    cfg = {"scale": scale, "seed": 0, "experiment": f"evidence/{scale}", "quant": {"format": fmt},
           "tags": {"table": "evidence", "arm": f"heldout-{fmt}", "training": "none", "stage": "base"}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (d / "summary.json").write_text(json.dumps({"finished": True, "trained": False, "steps": 0, "scale": scale,
                                                "eval": {"toy": {"pass@1": pass1, "n_problems": 100}}}))
    return d


def test_rl_works_rows_against_the_untrained_base(tmp_path):
    """BF16-LoRA gains 0.40 over its base with seed sd 0.02: supported (t interval by hand); NF4-LoRA's gain is
    within its spread: inconclusive; MXFP4 has no base run: not run. Base runs are neither trained runs nor seeds."""
    for seed, (bf, nf) in enumerate([(0.50, 0.12), (0.52, 0.20), (0.48, 0.04)]):
        write_trained(tmp_path, "bf16-lora", SHARED, seed, np.full(STEPS, 0.4), evals={"toy": bf})
        write_trained(tmp_path, "nf4-lora", SHARED, seed, np.full(STEPS, 0.4), evals={"toy": nf})
        write_trained(tmp_path, "mxfp4-lora", SHARED, seed, np.full(STEPS, 0.4), evals={"toy": 0.3})
    write_heldout(tmp_path, "bf16", 0.10)
    write_heldout(tmp_path, "nf4", 0.10)
    (tmp_path / "evidence" / SCALE / "protocol.json").write_text(json.dumps({"shared_lr": SHARED}))
    ev = ER.load(tmp_path, SCALE)
    assert len(ev.runs) == 9 and set(ev.heldout["fmt"]) == {"bf16", "nf4"}  # base runs are not trained runs
    df = pd.DataFrame(FD.rl_works_rows(ev)).set_index("a")
    bf = df.loc["bf16-lora"]
    assert bf["effect"] == pytest.approx(0.40) and bf["mean_b"] == pytest.approx(0.10)
    # sd 0.02, se 0.02/√3, t_{0.975,2} = 4.3027: half-width 0.04969
    assert bf["ci_hi"] - bf["effect"] == pytest.approx(0.04969, rel=1e-3) and bf["verdict"] == "supported"
    assert "seed spread (sd) 0.020" in bf["note"]
    assert df.loc["nf4-lora", "verdict"] == "inconclusive"
    assert df.loc["mxfp4-lora", "verdict"] == "not run" and "heldout-mxfp4 on toy" in df.loc["mxfp4-lora", "note"]
    assert df.loc["nvfp4-lora", "verdict"] == "not run"
    md = FD.findings(tmp_path, SCALE)[0]
    assert "## RL works" in md and "| BF16-LoRA − BF16 base | pass@1 toy | 0.500 | 0.100 | +0.400" in md


def test_tiny_effects_print_with_the_decimals_their_interval_needs():
    """A real but tiny effect (the toy model's entropy gap is ~2e-4) must not print as "+0.000 [+0.000, +0.000]"."""
    import pandas as pd

    from paper_figures import findings as F

    tiny = pd.Series({"verdict": "supported", "effect": 0.00023, "ci_lo": 0.00011, "ci_hi": 0.00035})
    assert F._effect(tiny) == "+0.00023 [+0.00011, +0.00035]"
    usual = pd.Series({"verdict": "contradicted", "effect": -0.117, "ci_lo": -0.208, "ci_hi": -0.025})
    assert F._effect(usual) == "-0.117 [-0.208, -0.025]"
    assert F._effect(pd.Series({"verdict": "inconclusive", "effect": 0.1, "ci_lo": float("nan"),
                                "ci_hi": float("nan")})) == "+0.100 [no interval]"
