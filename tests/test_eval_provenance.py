"""Evaluation records the data it evaluated on: the test split, with that split's file and hash."""

from __future__ import annotations

import pytest

from qerl import data
from qerl.config import load_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_eval_summary_records_the_test_split():
    from qerl.evaluate import evaluate_policy
    from qerl.train import build_policy, resolve_device

    cfg = load_config(["scale=smoke", "eval.sets=[gsm8k,toy]", "eval.limit=1", "eval.n_samples=1",
                       "eval.max_new_tokens=2", "eval.batch_prompts=1", "device=cpu"])
    policy, tok = build_policy(cfg, resolve_device(cfg.device), base_only=True)
    ev = evaluate_policy(policy, tok, cfg)
    assert ev["gsm8k"]["n_problems"] == 1 and ev["toy"]["n_problems"] == 1
    assert ev["gsm8k"]["data"]["split"] == "test" and ev["toy"]["data"]["split"] == "test"  # before: "train"
    # the hashed file is the one the problems came from, and it is GSM8K's test file, not its train file
    files = ev["gsm8k"]["data"]["files"]
    assert list(files) == ["gsm8k/test.jsonl"]
    assert files == data.data_provenance("gsm8k", "local", "test")["files"]
