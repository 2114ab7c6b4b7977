"""Figure 8: AQN ablation — NVFP4-LoRA with and without Adaptive Quantization Noise (paper: 3B and 7B, GSM8K).

    python -m experiments.fig8 --scale smoke|toy|paper [--seeds ...] [key=value ...]
"""

from __future__ import annotations

from experiments.common import LR, PAPER_MODELS, Row, figure_main, scale_model

ARTIFACT = "fig8"


def rows(scale: str) -> list[Row]:
    models = ("3b", "7b") if scale == "paper" else ("7b",)
    out = []
    for mk in models:
        base = (*scale_model(scale, mk), "algo=grpo", "quant=nvfp4", "lora=r32", f"optim.lr={LR[scale]['quantized']}")
        tags = dict(paper_model=PAPER_MODELS[mk], weights="NVFP4", training="lora")
        out.append(Row(f"{mk}-nvfp4-noaqn", (*base, "aqn=off"), dict(tags, aqn="no")))
        out.append(Row(f"{mk}-nvfp4-aqn", (*base, "aqn=paper"), dict(tags, aqn="yes")))
    return out


def main(argv=None) -> None:
    figure_main(ARTIFACT, rows, ("fig8",), __doc__, argv)


if __name__ == "__main__":
    main()
