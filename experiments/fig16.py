"""Figures 16 and 17: learning rate — QeRL (NVFP4-LoRA + AQN) at 3e-5 vs 5e-6 (Fig. 16: "×2.0 speed up" at the
higher rate), and BF16 LoRA at 3e-5 vs 5e-6 (Fig. 17: the higher rate is unstable). Paper: 7B on GSM8K.
At smoke/toy scale both rates are scaled by the same factor as the scale's base rates (experiments.common.LR).

    python -m experiments.fig16 --scale smoke|toy|paper [--seeds ...] [key=value ...]
"""

from __future__ import annotations

from experiments.common import LR, PAPER_MODELS, Row, figure_main, scale_model

ARTIFACT_QERL, ARTIFACT_LORA = "fig16", "fig17"


def rates(scale: str) -> tuple[float, float]:
    f = LR[scale]["quantized"] / LR["paper"]["quantized"]
    return 3e-5 * f, 5e-6 * f


def rows_qerl(scale: str) -> list[Row]:
    base = (*scale_model(scale, "7b"), "algo=grpo", "quant=nvfp4", "lora=r32", "aqn=paper")
    tags = dict(paper_model=PAPER_MODELS["7b"], weights="NVFP4", training="lora", aqn="yes")
    return [Row(f"qerl-lr{lr:g}", (*base, f"optim.lr={lr}"), tags) for lr in rates(scale)]


def rows_lora(scale: str) -> list[Row]:
    base = (*scale_model(scale, "7b"), "algo=grpo", "quant=bf16", "lora=r32", "aqn=off")
    tags = dict(paper_model=PAPER_MODELS["7b"], weights="BF16", training="lora", aqn="no")
    return [Row(f"lora-lr{lr:g}", (*base, f"optim.lr={lr}"), tags) for lr in rates(scale)]


def main(argv=None) -> None:
    figure_main(ARTIFACT_QERL, rows_qerl, ("fig16",), __doc__, argv)
    figure_main(ARTIFACT_LORA, rows_lora, ("fig17",), __doc__, argv)


if __name__ == "__main__":
    main()
