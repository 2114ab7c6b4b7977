"""Figure 9: AQN noise schedulers — linear, exponential, cosine and logarithmic decay (paper: 3B on GSM8K).
Fig. 15 implies σ_start ≈ 5e-2 in this ablation; override with aqn.sigma_start=... .

    python -m experiments.fig9 --scale smoke|toy|paper [--seeds ...] [key=value ...]
"""

from __future__ import annotations

from experiments.common import LR, PAPER_MODELS, Row, figure_main, scale_model

ARTIFACT = "fig9"
SCHEDULES = ("linear", "exponential", "cosine", "logarithmic")


def rows(scale: str) -> list[Row]:
    base = (*scale_model(scale, "3b"), "algo=grpo", "quant=nvfp4", "lora=r32", "aqn=paper", "aqn.sigma_start=5e-2",
            f"optim.lr={LR[scale]['quantized']}")
    tags = dict(paper_model=PAPER_MODELS["3b"], weights="NVFP4", training="lora", aqn="yes")
    return [Row(f"nvfp4-aqn-{s}", (*base, f"aqn.schedule={s}"), tags) for s in SCHEDULES]


def main(argv=None) -> None:
    figure_main(ARTIFACT, rows, ("fig9",), __doc__, argv)


if __name__ == "__main__":
    main()
