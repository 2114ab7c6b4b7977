"""train_step's loss normalisers and logged loss, checked through a real one-step run against a hand-derived identity."""

from __future__ import annotations

import pytest

from qerl.config import load_config
from qerl.results import read_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MAX_NEW = 64
# One on-policy update (ρ ≡ 1, no KL, no TIS) on 16 completions in uneven micro-batches of 6, 6, 4 rows; nothing
# masked beyond the completion mask. gsm8k_hash scores "#### N" without the math-verify pool (fast to start); seed 7
# gives groups with mixed rewards, so the advantages are not all 0.
ONE_STEP = ["scale=smoke", "quant=bf16", "aqn=off", "algo=grpo", "algo.ppo_epochs=1", "algo.mask_truncated=false",
            "train.steps=1", "train.batch_size=16", "algo.group_size=4", "train.micro_batch=6",
            f"data.max_new_tokens={MAX_NEW}", "data.rewards=[gsm8k_hash]", "seed=7", "eval.sets=[]",
            "train.progress=false", "train.save_every=0"]


@pytest.mark.slow  # two one-step runs: ~60 s of CPU time
def test_dr_grpo_divides_by_max_new_tokens_and_logged_loss_is_the_minibatch_objective(tmp_path):
    """With ρ ≡ 1 the per-token loss is −A_i, so over the minibatch (n_i = completion lengths, N rows)
        token_mean:   pg_loss = −Σ_i A_i n_i / Σ_i n_i
        seq_sum_norm: pg_loss = −Σ_i A_i n_i / (N · max_new_tokens)
    hence pg_loss(seq_sum_norm) = pg_loss(token_mean) · mean_i(n_i) / max_new_tokens, mean_i(n_i) being the logged
    response_length. It fails if Dr. GRPO divides by the step's width (the longest completion here is shorter than
    max_new_tokens) or if the logged loss is an unweighted mean over the uneven micro-batches."""
    from qerl.train import run

    rows = {}
    for agg in ("token_mean", "seq_sum_norm"):
        cfg = load_config([*ONE_STEP, f"algo.loss_agg={agg}", f"out_dir={tmp_path}", f"run_name={agg}"])
        run(cfg)
        (rows[agg],) = read_jsonl(cfg.run_dir / "metrics.jsonl")
    tm, ssn = rows["token_mean"], rows["seq_sum_norm"]
    for k in ("reward", "response_length", "response_length_max"):  # the same rollout in both runs
        assert tm[k] == ssn[k], k
    assert tm["ratio_mean"] == 1.0 and tm["truncated_frac"] == 0.0
    assert tm["response_length_max"] < MAX_NEW  # so the step's width differs from the constant normaliser
    assert abs(tm["pg_loss"]) > 1e-4  # mixed rewards: a non-trivial loss
    want = tm["pg_loss"] * tm["response_length"] / MAX_NEW
    assert ssn["pg_loss"] == pytest.approx(want, rel=1e-5)
