"""paper_figures: tables place every paper number in its cell and average our seeds; every figure writes PNG + PDF
+ a runs sidecar from a synthetic results tree, and skips cleanly without its runs; no torch import."""

from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from paper_figures import figures as F
from paper_figures import speed as S
from paper_figures import tables as T
from paper_figures.__main__ import main as cli_main

PAPER = Path(T.__file__).resolve().parent / "paper"
SHARED = Path("/work/shared/paper/tables")
M7 = "Qwen2.5-7B-Instruct"


# ------------------------------------------------------------------------------------------------ fixture builder
def write_run(root: Path, experiment: str, name: str, *, fmt="bf16", lora=True, rank=32, aqn=False, algo="grpo",
              schedule="exponential", lr=1e-5, seed=0, scale="smoke", tags=None, evals=None, trained=True,
              finished=True, steps=6, reward0=0.2, slope=0.05, sigma=False):
    """A run directory in the documented layout: config.yaml (nested, as TrainConfig.to_yaml writes it),
    summary.json, and metrics.jsonl (trained runs only)."""
    d = root / experiment / name
    d.mkdir(parents=True)
    cfg = {"model": {"source": "toy:smoke"}, "quant": {"format": fmt},
           "lora": {"enabled": lora, "rank": rank, "train_norms": False},
           "algo": {"name": algo}, "aqn": {"enabled": aqn, "schedule": schedule, "sigma_start": 1e-2,
                                           "sigma_end": 5e-4, "stages": 3, "mode": "paper"},
           "data": {"train": "bigmath" if experiment.startswith("table2") else "toy", "source": "local",
                    "levels": [3, 4, 5] if experiment.startswith("table2") else None},
           "optim": {"lr": lr}, "eval": {"sets": list(evals or {}), "n_samples": 4, "limit": 8, "temperature": 0.6,
                                        "top_p": 0.95},
           "experiment": experiment, "run_name": name, "seed": seed, "scale": scale, "tags": tags or {}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    ev = {k: {"pass@1": v, "n_problems": 8, "n_samples": 4, "temperature": 0.6, "top_p": 0.95,
              "pass@1_std_over_samples": 0.01} for k, v in (evals or {}).items()}
    summ = {"finished": finished, "steps": steps if trained else 0, "scale": scale, "eval": ev}
    if not trained:
        summ["trained"] = False
    elif experiment.startswith("table2"):
        summ["data"] = {"dataset": "bigmath", "stand_in": "MATH train levels 3-5 stands in for Big-Math"}
    (d / "summary.json").write_text(json.dumps(summ))
    if trained:
        lines = []
        for s in range(1, steps + 1):
            r = reward0 + slope * s + 0.01 * seed
            sig = (0.0 if s <= 2 else 1e-2 if s <= 4 else 5e-4) if sigma else 0.0
            lines.append({"step": s, "reward": r, "rewards/accuracy/mean": r, "entropy": 0.3 - 0.01 * s,
                          "sampling_entropy": 0.35 - 0.01 * s, "sigma": sig})
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def t1tags(weights, training, aqn="no", model=M7):
    return {"table": "table1", "paper_model": model, "weights": weights, "training": training, "aqn": aqn}


def t2tags(weights, training, aqn="no", model=M7):
    return {**t1tags(weights, training, aqn, model), "table": "table2"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    # Table 1 (7B): base BF16 and NF4, BF16 LoRA with two seeds, NVFP4 LoRA +AQN; MXFP4 LoRA etc. are missing.
    write_run(root, "table1/smoke", "bf16-base", tags=t1tags("BF16", "none"), evals={"gsm8k": 0.50}, trained=False)
    write_run(root, "table1/smoke", "nf4-base", fmt="nf4", tags=t1tags("NF4", "none"), evals={"gsm8k": 0.45},
              trained=False)
    write_run(root, "table1/smoke", "bf16-lora-s0", tags=t1tags("BF16", "lora"), evals={"gsm8k": 0.60})
    write_run(root, "table1/smoke", "bf16-lora-s1", seed=1, tags=t1tags("BF16", "lora"), evals={"gsm8k": 0.70})
    write_run(root, "table1/smoke", "nvfp4-aqn", fmt="nvfp4", aqn=True, tags=t1tags("NVFP4", "lora", "yes"),
              evals={"gsm8k": 0.72, "toy": 0.9})
    # no weights/training/aqn tags: the config decides (NVFP4 LoRA, no AQN)
    write_run(root, "table1/smoke", "nvfp4-untagged", fmt="nvfp4",
              tags={"table": "table1", "paper_model": M7}, evals={"gsm8k": 0.66})
    write_run(root, "table1/smoke", "mxfp4-unfinished", fmt="mxfp4", tags=t1tags("MXFP4", "lora"),
              evals={"gsm8k": 0.99}, finished=False)
    write_run(root, "table1/toy", "bf16-base-toy", scale="toy", tags=t1tags("BF16", "none"), evals={"gsm8k": 0.1},
              trained=False)
    # Table 2 (7B): base BF16; NVFP4 LoRA with two seeds; +AQN evaluated on MATH500 only.
    b2 = {"math500": 0.40, "aime24": 0.10, "aime25": 0.0, "amc23": 0.25}
    write_run(root, "table2/smoke", "bf16-base", tags=t2tags("BF16", "none"), evals=b2, trained=False)
    write_run(root, "table2/smoke", "nvfp4-s0", fmt="nvfp4", algo="dapo", tags=t2tags("NVFP4", "lora"),
              evals={"math500": 0.50, "aime24": 0.20, "aime25": 0.10, "amc23": 0.30})
    write_run(root, "table2/smoke", "nvfp4-s1", fmt="nvfp4", algo="dapo", seed=1, tags=t2tags("NVFP4", "lora"),
              evals={"math500": 0.60, "aime24": 0.10, "aime25": 0.00, "amc23": 0.40})
    write_run(root, "table2/smoke", "nvfp4-aqn", fmt="nvfp4", algo="dapo", aqn=True,
              tags=t2tags("NVFP4", "lora", "yes"), evals={"math500": 0.55})
    # Figure experiments
    for algo in ("grpo", "dapo"):
        for i, (fmt, lora) in enumerate((("bf16", True), ("nvfp4", True), ("mxfp4", True), ("nf4", True),
                                         ("bf16", False))):
            for seed in (0, 1):
                write_run(root, "fig4/smoke", f"{fmt}-{'lora' if lora else 'full'}-{algo}-s{seed}", fmt=fmt,
                          lora=lora, algo=algo, seed=seed, tags={"paper_model": M7}, slope=0.02 + 0.01 * i)
    for aqn in (False, True):
        write_run(root, "fig8/smoke", f"nvfp4-aqn{int(aqn)}", fmt="nvfp4", aqn=aqn, sigma=aqn, slope=0.04 + 0.02 * aqn)
    for i, sch in enumerate(("linear", "exponential", "cosine", "logarithmic")):
        write_run(root, "fig9/smoke", f"nvfp4-{sch}", fmt="nvfp4", aqn=True, schedule=sch, sigma=True,
                  slope=0.02 + 0.01 * i)
    for i, rank in enumerate((16, 32, 64, 128)):
        write_run(root, "fig10/smoke", f"nvfp4-r{rank}", fmt="nvfp4", rank=rank, slope=0.05 - 0.01 * i)
    for fig, fmt in (("fig16", "nvfp4"), ("fig17", "bf16")):
        for lr in (3e-5, 5e-6):
            write_run(root, f"{fig}/smoke", f"{fmt}-lr{lr}", fmt=fmt, lr=lr, aqn=fmt == "nvfp4", slope=lr * 2000)
    (root / "fig15").mkdir()
    with open(root / "fig15" / "schedules.csv", "w") as f:
        f.write("schedule,mode,stage,step,sigma\n")
        for sch in ("linear", "exponential"):
            for k in range(1, 11):
                f.write(f"{sch},paper,{k},{10 * k},{0.05 / k}\n")
    (root / "speed").mkdir()
    with open(root / "speed" / "rollout.csv", "w") as f:
        f.write("model,method,weights,batch_size,lora_rank,tokens_per_s\n")
        for model in ("preset:qwen2.5-7b", "preset:qwen2.5-14b"):
            for meth, w in (("LoRA", "BF16"), ("QLoRA", "NF4"), ("QeRL", "NVFP4")):
                for b in (2, 8):
                    for r in (16, 32, 64):
                        f.write(f"{model},{meth},{w},{b},{r},{100 * b / r * (2 if w == 'NVFP4' else 1)}\n")
    with open(root / "speed" / "layers.csv", "w") as f:
        f.write("model,fmt,m,time_ms,ratio_vs_bf16\n")
        for fmt, ratio in (("bf16", 1.0), ("nvfp4", 0.4), ("mxfp4", 0.45)):
            for m in (1, 16, 256):
                f.write(f"qwen2.5-7b,{fmt},{m},{ratio * (1 + m / 256)},{ratio}\n")
    return root


# ------------------------------------------------------------------------------------------------ tables
def _paper_rows(name):
    with open(PAPER / f"{name}.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", ["table1", "table2"])
def test_every_paper_cell_lands_in_its_row_and_column(tree, name):
    _, df = T.render_table(name, tree, "smoke", models="all", write=False)
    rows = _paper_rows(name)
    assert len(rows) == {"table1": 20, "table2": 90}[name]
    for p in rows:
        hit = df[(df["paper_model"] == p["model"]) & (df["weights"] == p["weights"])
                 & (df["training"] == p["training"]) & (df["aqn"] == p["aqn"])]
        assert len(hit) == 1, p
        assert hit.iloc[0][f"{p['benchmark']} paper"] == p["score"], p
        assert hit.iloc[0][f"{p['benchmark']} paper_delta"] == p["delta_vs_bf16_base"], p
    # one line per paper row and model: 2 x 10 (Table 1), 3 x 6 (Table 2)
    assert len(df) == {"table1": 20, "table2": 18}[name]


def test_known_paper_cells_by_hand(tree):
    # read off the paper's printed tables (QERL.md §1), independent of the CSV
    _, t1 = T.render_table("table1", tree, "smoke", models="all", write=False)
    r = t1[(t1.paper_model == M7) & (t1.row == "NVFP4 LoRA +AQN")].iloc[0]
    assert (r["GSM8K paper"], r["GSM8K paper_delta"]) == ("90.8", "13.5")
    r = t1[(t1.paper_model == "Qwen2.5-3B-Instruct") & (t1.row == "MXFP4 -")].iloc[0]
    assert (r["GSM8K paper"], r["GSM8K paper_delta"]) == ("59.8", "-1.4")
    _, t2 = T.render_table("table2", tree, "smoke", models="all", write=False)
    r = t2[(t2.paper_model == "Qwen2.5-32B-Instruct") & (t2.row == "NVFP4 LoRA +AQN")].iloc[0]
    assert [r[f"{b} paper"] for b in ("MATH500", "AIME24", "AIME25", "AMC23", "Average")] == \
        ["83.3", "16.7", "19.2", "63.3", "45.6"]
    r = t2[(t2.paper_model == "Qwen2.5-14B-Instruct") & (t2.row == "BF16 -")].iloc[0]
    assert r["AIME24 paper"] == "11.3" and r["AIME24 paper_delta"] == ""
    # the row order is the paper's
    assert list(t1[t1.paper_model == M7]["row"]) == [
        "BF16 -", "NF4 -", "MXFP4 -", "NVFP4 -", "BF16 Full", "BF16 LoRA", "NF4 LoRA", "MXFP4 LoRA", "NVFP4 LoRA",
        "NVFP4 LoRA +AQN"]


def test_our_numbers_mean_over_seeds_deltas_and_dashes(tree):
    md, df = T.render_table1(tree, "smoke")
    assert set(df["paper_model"]) == {M7}  # default: only paper models that have runs
    row = lambda label: df[df["row"] == label].iloc[0]  # noqa: E731
    lora = row("BF16 LoRA")
    assert lora["GSM8K ours_mean"] == pytest.approx(65.0)
    assert lora["GSM8K ours_std"] == pytest.approx(statistics.stdev([60.0, 70.0]))
    assert lora["GSM8K ours"] == "65.0 ± 7.1" and lora["n_seeds"] == 2 and lora["seeds"] == "0,1"
    assert lora["GSM8K ours_delta"] == pytest.approx(15.0)
    assert row("NF4 -")["GSM8K ours_delta"] == pytest.approx(-5.0)
    assert row("NVFP4 LoRA +AQN")["GSM8K ours_delta"] == pytest.approx(22.0)
    assert row("NVFP4 LoRA")["GSM8K ours"] == "66.0"  # placed from its config (no weights/training/aqn tags)
    assert math.isnan(row("BF16 -")["GSM8K ours_delta"])
    for missing in ("MXFP4 -", "BF16 Full", "MXFP4 LoRA", "NF4 LoRA"):
        assert row(missing)["GSM8K ours"] == "—" and row(missing)["n_seeds"] == 0
    # the unfinished MXFP4 run is not averaged in, and the toy-scale run stays out of the smoke table
    assert "mxfp4-unfinished" not in ";".join(df["runs"]) and "toy" not in ";".join(df["runs"])
    assert set(lora["runs"].split(";")) == {"table1/smoke/bf16-lora-s0", "table1/smoke/bf16-lora-s1"}
    # an eval set with no paper column becomes an ours-only column
    assert row("NVFP4 LoRA +AQN")["toy ours"] == "90.0" and "toy paper" not in df
    # markdown: ours beside the paper, the paper's printed sign, a dash for rows not run, notes
    line = next(s for s in md.splitlines() if "| BF16 | LoRA |" in s)
    assert "65.0 ± 7.1 (+15.0)" in line and "88.1 (+11.8)" in line and "| 2 |" in line
    line = next(s for s in md.splitlines() if "| MXFP4 | LoRA |" in s)
    assert "| — | 86.4 (+10.1) |" in line
    assert "toy:smoke" in md and "`smoke`" in md and "mxfp4-unfinished" in md
    assert (tree / "table1" / "smoke" / "table1.md").read_text() == md
    assert (tree / "table1" / "smoke" / "table1.csv").exists()


def test_table2_average_and_stand_in(tree):
    md, df = T.render_table2(tree, "smoke")
    row = lambda label: df[df["row"] == label].iloc[0]  # noqa: E731
    q = row("NVFP4 LoRA")
    per_run = [statistics.mean([50, 20, 10, 30]), statistics.mean([60, 10, 0, 40])]
    assert q["Average ours_mean"] == pytest.approx(statistics.mean(per_run))
    assert q["Average ours_std"] == pytest.approx(statistics.stdev(per_run))
    assert q["Average ours_delta"] == pytest.approx(statistics.mean(per_run) - statistics.mean([40, 10, 0, 25]))
    assert q["AIME25 ours_delta"] == pytest.approx(5.0)
    assert q["MATH500 ours"] == "55.0 ± 7.1"
    aqn = row("NVFP4 LoRA +AQN")
    assert aqn["MATH500 ours"] == "55.0" and aqn["AIME24 ours"] == "—" and aqn["Average ours"] == "—"
    assert (aqn["Average paper"], aqn["Average paper_delta"]) == ("36.4", "7.5")
    assert "stands in for Big-Math" in md and "dapo" in md


def test_no_runs_writes_nothing(tmp_path, capsys):
    md, df = T.render_table2(tmp_path, "smoke")
    assert not (tmp_path / "table2").exists() and df.attrs["written"] == []
    assert (df["n_seeds"] == 0).all() and len(df) == 18 and "skip table2" in capsys.readouterr().out


def test_a_run_written_by_the_training_core_is_placed(tmp_path):
    # config.yaml from the real TrainConfig, summary and metrics through the real RunWriter
    from qerl.config import AqnCfg, QuantCfg, TrainConfig
    from qerl.results import RunWriter, atomic_write_text

    cfg = TrainConfig(quant=QuantCfg(format="nvfp4"), aqn=AqnCfg(enabled=True), experiment="table2/smoke",
                      out_dir=str(tmp_path), seed=3, tags=t2tags("NVFP4", "lora", "yes"))
    w = RunWriter(cfg.run_dir)
    atomic_write_text(cfg.run_dir / "config.yaml", cfg.to_yaml())
    for step in (1, 2):
        w.log(step, reward=0.1 * step, **{"rewards/accuracy/mean": 0.1 * step}, entropy=0.2, sigma=0.0)
    w.write_summary({"finished": True, "steps": 2, "scale": "smoke", "eval": {
        "math500": {"pass@1": 0.25, "n_problems": 4, "n_samples": 2},
        "aime24": {"pass@1": 0.5, "n_problems": 4, "n_samples": 2}}})
    md, df = T.render_table2(tmp_path, "smoke", write=False)
    r = df[df["row"] == "NVFP4 LoRA +AQN"].iloc[0]
    assert (r["MATH500 ours"], r["AIME24 ours"], r["AMC23 ours"], r["seeds"]) == ("25.0", "50.0", "—", "3")
    assert r["runs"] == str(cfg.run_dir.relative_to(tmp_path))
    assert F.fig7(tmp_path, scale="smoke", out_dir=tmp_path / "f")[0].exists()


def test_rows_mixing_configs_are_flagged(tmp_path):
    for seed, lr in ((0, 1e-5), (1, 3e-5)):
        write_run(tmp_path, "table1/smoke", f"bf16-s{seed}", lr=lr, seed=seed, tags=t1tags("BF16", "lora"),
                  evals={"gsm8k": 0.5})
    md, df = T.render_table1(tmp_path, "smoke", write=False)
    assert "**Warning**" in md and "BF16 LoRA: optim.lr" in md
    assert df[df["row"] == "BF16 LoRA"].iloc[0]["n_seeds"] == 2


@pytest.mark.skipif(not SHARED.exists(), reason="shared paper tables not on this machine")
def test_shipped_paper_csvs_match_the_shared_copies():
    for p in sorted(SHARED.iterdir()):
        assert (PAPER / p.name).read_bytes() == p.read_bytes(), p.name


# ------------------------------------------------------------------------------------------------ figures
CURVES = {"fig4": F.fig4, "fig5": F.fig5, "fig7": F.fig7, "fig8": F.fig8, "fig9": F.fig9, "fig10": F.fig10,
          "fig14": F.fig14, "fig16": F.fig16, "fig17": F.fig17}


def _check_written(paths, out: Path, name: str, expect_runs: set[str]):
    assert [p.name for p in paths] == [f"{name}.png", f"{name}.pdf", f"{name}.runs.txt"]
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / f"{name}.pdf").read_bytes()[:5] == b"%PDF-"
    listed = {ln.split()[0] for ln in (out / f"{name}.runs.txt").read_text().splitlines() if not ln.startswith("#")}
    assert listed == expect_runs


@pytest.mark.parametrize("fig", list(CURVES))
def test_curve_figures_write_png_pdf_and_sidecar(tree, tmp_path, fig):
    own = {f"fig{n}/smoke" for n in (4, 8, 9, 10, 16, 17)}
    exp = {"fig5": "fig4/smoke", "fig7": "table2/smoke", "fig14": "table2/smoke"}.get(fig, f"{fig}/smoke")
    assert exp in own or fig in ("fig5", "fig7", "fig14")
    paths = CURVES[fig](tree, scale="smoke", smooth=2, out_dir=tmp_path)
    runs = {str(p.relative_to(tree)) for p in (tree / exp).iterdir() if (p / "metrics.jsonl").exists()}
    _check_written(paths, tmp_path, f"{fig}_smoke", runs)


def test_regenerated_figures_are_byte_identical(tree, tmp_path):
    a = [p.read_bytes() for p in F.fig8(tree, scale="smoke", out_dir=tmp_path / "a")]
    b = [p.read_bytes() for p in F.fig8(tree, scale="smoke", out_dir=tmp_path / "b")]
    assert a == b


def test_sampling_entropy_option(tree, tmp_path):
    paths = F.fig5(tree, scale="smoke", out_dir=tmp_path, metric="sampling_entropy")
    assert paths[0].name == "fig5_smoke_sampling_entropy.png"


@pytest.mark.parametrize("fig", list(CURVES))
def test_curve_figures_skip_without_runs(tmp_path, capsys, fig):
    assert CURVES[fig](tmp_path, scale="smoke", out_dir=tmp_path / "figs") == []
    assert f"skip {fig}_smoke" in capsys.readouterr().out and not (tmp_path / "figs").exists()


def test_fig15_and_speed_figures(tree, tmp_path):
    _check_written(F.fig15(tree, out_dir=tmp_path), tmp_path, "fig15", {str(tree / "fig15" / "schedules.csv")})
    csvs = {str(tree / "speed" / "rollout.csv")}
    _check_written(S.speed_rollout(tree, out_dir=tmp_path), tmp_path, "speed_rollout", csvs)
    _check_written(S.speed_rank(tree, out_dir=tmp_path), tmp_path, "speed_rank", csvs)
    _check_written(S.speed_layers(tree, out_dir=tmp_path), tmp_path, "speed_layers", {str(tree / "speed" / "layers.csv")})


def test_scale_free_figures_skip_without_files(tmp_path, capsys):
    for fn in (F.fig15, S.speed_rollout, S.speed_rank, S.speed_layers):
        assert fn(tmp_path, out_dir=tmp_path / "figs") == []
    out = capsys.readouterr().out
    assert all(f"skip {n}" in out for n in ("fig15", "speed_rollout", "speed_rank", "speed_layers"))


def test_speed_rollout_keeps_one_gpu_and_one_length_a_group():
    """The rollout figure's bars: the paper's GPU (an H100) only, one length per model and batch (the one most
    formats were measured at; ties: 2048 new tokens) so a group compares like with like, and per bar the row merged
    last; the title names both."""
    import pandas as pd
    rows = [("BF16", 8, 2048, "NVIDIA H100 80GB HBM3", 1200.0), ("NVFP4", 8, 2048, "NVIDIA H100 80GB HBM3", 2400.0),
            ("NVFP4", 8, 2048, "NVIDIA H100 80GB HBM3", 2450.0),  # merged later (another layout): this one
            ("NVFP4", 8, 512, "NVIDIA H100 80GB HBM3", 9999.0),  # another length, fewer formats: out
            ("BF16", 64, 512, "NVIDIA H100 80GB HBM3", 7400.0), ("NVFP4", 64, 512, "NVIDIA H100 80GB HBM3", 10600.0),
            ("NVFP4", 64, 2048, "NVIDIA H100 80GB HBM3", 7500.0),  # one format at 2048: the group stays at 512
            ("BF16", 8, 2048, "NVIDIA H200", 1500.0), ("NVFP4", 8, 2048, "NVIDIA H200", 2900.0)]  # another GPU: out
    df = S._prep(pd.DataFrame([dict(model="Qwen2.5-7B-Instruct", method="QeRL" if w == "NVFP4" else "LoRA",
                                    weights=w, batch=b, rank=32, new_tokens=n, device=d, tok_s=t)
                               for w, b, n, d, t in rows]))
    got, note = S.one_machine(df)
    assert sorted(zip(got["weights"], got["batch"], got["tok_s"], strict=True)) == [
        ("BF16", 8, 1200.0), ("BF16", 64, 7400.0), ("NVFP4", 8, 2450.0), ("NVFP4", 64, 10600.0)]
    assert note == " · NVIDIA H100 80GB HBM3, 512 new tokens at batch 64; 2048 new tokens at batch 8"
    plain, none = S.one_machine(df.drop(columns=["device", "new_tokens"]).iloc[:2])
    assert len(plain) == 2 and none == ""  # CSVs without those columns pass as they are


def test_speed_columns_are_read_defensively():
    df = S._canon(__import__("pandas").DataFrame({"Preset": ["x"], "FMT": ["nvfp4"], "BS": [2], "tok_s": [3.0]}))
    assert {"model", "weights", "batch", "tok_s"} <= set(df.columns)
    assert S.model_size("preset:qwen2.5-14b") == "14B" and S.model_size("Qwen2.5-7B-Instruct") == "7B"


def test_cli_only_and_scale(tree, tmp_path, capsys):
    assert cli_main(["--root", str(tree), "--only", "table2,fig8,fig1", "--scale", "smoke"]) == 0
    out = capsys.readouterr().out
    assert "wrote   table2[smoke]" in out and "wrote   fig8[smoke]" in out and "wrote   fig1:" in out
    assert (tree / "figures" / "fig8_smoke.pdf").exists() and (tree / "figures" / "speed_rollout.png").exists()
    assert "fig4" not in out
    assert cli_main(["--root", str(tmp_path), "--only", "fig4,fig15", "--scale", "smoke"]) == 0
    out = capsys.readouterr().out
    assert "skipped fig4[smoke]" in out and "skipped fig15" in out and "wrote" not in out
    with pytest.raises(SystemExit):
        cli_main(["--only", "fig99"])


def test_importing_paper_figures_does_not_import_torch():
    code = ("import sys, paper_figures, paper_figures.tables, paper_figures.figures, paper_figures.speed, "
            "paper_figures.__main__; bad = [m for m in ('torch', 'qerl.aqn', 'qerl.train') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(T.__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_truncated_summary_and_a_corrupt_metrics_line_skip_only_themselves(tmp_path, capsys):
    # the audit's probe: one truncated summary.json aborted every figure; a corrupt metrics line hid the rest
    for seed in (0, 1):
        write_run(tmp_path, "table1/smoke", f"bf16-lora-s{seed}", seed=seed, tags=t1tags("BF16", "lora"),
                  evals={"gsm8k": 0.6 + seed / 10})
    for aqn in (False, True):
        write_run(tmp_path, "fig8/smoke", f"nvfp4-aqn{int(aqn)}", fmt="nvfp4", aqn=aqn, sigma=aqn)
    torn = tmp_path / "table1" / "smoke" / "bf16-lora-s1" / "summary.json"
    torn.write_text(torn.read_text()[:25])
    metrics = tmp_path / "fig8" / "smoke" / "nvfp4-aqn1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*lines[:2], '{"step": 3, "rew', *lines[3:]]) + "\n")
    assert cli_main(["--root", str(tmp_path), "--only", "table1,fig8", "--scale", "smoke"]) == 0
    out, err = capsys.readouterr()
    assert f"[paper_figures] warning: skipping run {torn.parent}: {torn} is unreadable" in err
    assert f"[paper_figures] warning: {metrics}:3: skipping a corrupt line" in err
    assert "wrote   table1[smoke]" in out and "wrote   fig8[smoke]" in out
    md, df = T.render_table1(tmp_path, "smoke", write=False)
    assert df[df["row"] == "BF16 LoRA"].iloc[0]["n_seeds"] == 1  # the readable seed is still there
    curve = F.fig8(tmp_path, scale="smoke", out_dir=tmp_path / "f")
    assert curve and curve[0].exists()


def test_cli_user_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "paper_figures", "--root", str(tmp_path / "nope")], capture_output=True,
                       text=True, cwd=Path(T.__file__).resolve().parents[1])
    assert r.returncode == 2
    assert r.stderr == f"paper_figures: error: --root {tmp_path / 'nope'}: no such directory (the results tree to " \
                       f"draw from)\n"
