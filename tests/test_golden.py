"""House rule 8: refactors keep the math. A seeded smoke run's metrics are kept as a golden file; a change that
should not alter the math must reproduce them. Regenerate deliberately (and say why in the commit) with

    QERL_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from qerl.config import load_config
from qerl.results import read_jsonl

GOLDEN = Path(__file__).parent / "golden" / "smoke_nvfp4_dapo.jsonl"
KEYS = ("reward", "rewards/accuracy/mean", "response_length", "sampling_entropy", "entropy", "pg_loss",
        "grad_norm", "clip_frac", "ratio_mean", "mismatch/kl_k3", "lr", "groups_kept")
OVERRIDES = ["scale=smoke", "quant=nvfp4", "algo=dapo", "aqn=off", "train.steps=3", "train.save_every=0",
             "train.progress=false", "eval.sets=[]", "seed=7"]


def test_seeded_smoke_run_matches_golden(tmp_path):
    from qerl.train import run

    cfg = load_config([*OVERRIDES, f"out_dir={tmp_path}"])
    run(cfg)
    rows = [{k: r.get(k) for k in ("step", *KEYS)} for r in read_jsonl(cfg.run_dir / "metrics.jsonl")]
    if os.environ.get("QERL_UPDATE_GOLDEN") or not GOLDEN.exists():
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text("".join(json.dumps(r) + "\n" for r in rows))
        pytest.skip(f"wrote {GOLDEN}")
    gold = read_jsonl(GOLDEN)
    assert [r["step"] for r in rows] == [g["step"] for g in gold]
    for r, g in zip(rows, gold, strict=True):
        for k in KEYS:
            a, b = r[k], g[k]
            if isinstance(b, float) and isinstance(a, float):
                # fp32 CPU math: the same tokens and rewards, floats to within summation-order noise
                assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (r["step"], k, a, b)
            else:
                assert a == b, (r["step"], k, a, b)
