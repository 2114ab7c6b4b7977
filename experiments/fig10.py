"""Figure 10: LoRA rank 16 / 32 / 64 / 128 for NVFP4 + AQN (paper: 3B on GSM8K; "rank 16 converging slightly
faster"). Alpha = rank for every rank (the paper states no alpha).

    python -m experiments.fig10 --scale smoke|toy|paper [--seeds ...] [key=value ...]
"""

from __future__ import annotations

from experiments.common import LR, PAPER_MODELS, Row, figure_main, scale_model

ARTIFACT = "fig10"


def rows(scale: str) -> list[Row]:
    base = (*scale_model(scale, "3b"), "algo=grpo", "quant=nvfp4", "lora=r32", "aqn=paper",
            f"optim.lr={LR[scale]['quantized']}")
    tags = dict(paper_model=PAPER_MODELS["3b"], weights="NVFP4", training="lora", aqn="yes")
    return [Row(f"nvfp4-r{r}", (*base, f"lora.rank={r}", f"lora.alpha={r}"), tags) for r in (16, 32, 64, 128)]


def main(argv=None) -> None:
    figure_main(ARTIFACT, rows, ("fig10",), __doc__, argv)


if __name__ == "__main__":
    main()
