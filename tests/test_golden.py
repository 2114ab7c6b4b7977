"""House rule 8: refactors keep the math. A seeded smoke run's metrics are kept as a golden file; a change that
should not alter the math must reproduce them exactly.

The seeded CPU run is deterministic (run twice, it gives the same tokens and the same floats, bit for bit), so every
recorded metric is compared with ``==``; timings, memory and throughput are not recorded. Floats are bit-stable only
for one torch build on one CPU kernel set, so the golden file's ``.env.json`` records both: on another torch version
or CPU capability the floats are compared to a relative 1e-4 instead (and integers, token counts, still exactly).

A missing golden file fails. Regenerate it deliberately, and say in the commit which keys changed and why, with

    QERL_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from qerl.config import load_config
from qerl.results import read_jsonl

GOLDEN = Path(__file__).parent / "golden" / "smoke_nvfp4_dapo.jsonl"
GOLDEN_ENV = GOLDEN.with_suffix(".env.json")
_HERE = Path(__file__).resolve()
REGENERATE = f"QERL_UPDATE_GOLDEN=1 python -m pytest {_HERE.relative_to(_HERE.parents[1])}"  # from the repo root
UNSTABLE = ("time_", "peak_mem_gib", "rollout_tokens_per_s")  # wall-clock and memory: not part of the math
THREADS = 2  # CPU reductions may split by thread count: pin it so the floats do not depend on the machine's cores
OVERRIDES = ["scale=smoke", "quant=nvfp4", "algo=dapo", "aqn=off", "train.steps=3", "train.save_every=0",
             "train.progress=false", "eval.sets=[]", "seed=7"]


def _env() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _run(out_dir: Path) -> list[dict]:
    from qerl.train import run

    cfg = load_config([*OVERRIDES, f"out_dir={out_dir}"])
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        run(cfg)
    finally:
        torch.set_num_threads(threads)
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith(UNSTABLE)} for r in rows]


# Sampler-vs-trainer log-prob differences: float rounding noise (~1e-5 when the two agree; a misaligned or wrongly
# tempered log-prob shows up as >= 1e-2). Another CPU or BLAS build moves the noise itself, so across environments
# they are compared in absolute terms.
NOISE = "mismatch/"
NOISE_ABS = 1e-4


def _same(a, b, exact: bool, key: str = "") -> bool:
    if exact or not (isinstance(a, float) and isinstance(b, float)):
        return a == b  # JSON keeps a float's shortest repr, which reads back to the same double
    if key.startswith(NOISE):
        return abs(a - b) <= NOISE_ABS
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


@pytest.mark.slow  # a 3-step training run: minutes of CPU time on 2 cores
def test_seeded_smoke_run_matches_golden(tmp_path):
    if not os.environ.get("QERL_UPDATE_GOLDEN") and not GOLDEN.exists():
        pytest.fail(f"golden file {GOLDEN} is missing; regenerate it deliberately with `{REGENERATE}` "
                    f"and commit it, saying why")
    rows = _run(tmp_path)
    if os.environ.get("QERL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text("".join(json.dumps(r) + "\n" for r in rows))
        GOLDEN_ENV.write_text(json.dumps(_env(), indent=1) + "\n")
        pytest.skip(f"QERL_UPDATE_GOLDEN is set: wrote {GOLDEN} and {GOLDEN_ENV.name}; commit them, saying why")
    gold = read_jsonl(GOLDEN)
    exact = GOLDEN_ENV.exists() and json.loads(GOLDEN_ENV.read_text()) == _env()
    assert [r["step"] for r in rows] == [g["step"] for g in gold]
    bad = [(g["step"], k, g[k], r.get(k)) for r, g in zip(rows, gold, strict=True) for k in g
           if not _same(r.get(k), g[k], exact, k)]
    assert not bad, (f"{len(bad)} metrics differ from the golden run ({'exactly' if exact else 'to rel 1e-4'}); "
                     f"(step, key, golden, now): {bad[:12]}. If the math was meant to change, regenerate with "
                     f"`{REGENERATE}` and say which keys changed and why in the commit")
