"""Figures 4 and 5: accuracy reward and entropy over training steps for NVFP4/MXFP4/NF4/BF16 LoRA and Full,
with DAPO (top) and GRPO (bottom). Paper: Qwen2.5-7B-Instruct on GSM8K, LoRA rank 32.

    python -m experiments.fig4 --scale smoke|toy|paper [--seeds ...] [key=value ...]
"""

from __future__ import annotations

from experiments.common import LR, PAPER_MODELS, WEIGHTS, Row, figure_main, scale_model

ARTIFACT = "fig4"


def rows(scale: str) -> list[Row]:
    lr, base = LR[scale], scale_model(scale, "7b")
    out = []
    for algo in ("dapo", "grpo"):
        for f in ("bf16", "nf4", "mxfp4", "nvfp4"):
            rate = lr["bf16_lora"] if f == "bf16" else lr["quantized"]
            out.append(Row(f"{algo}-{f}-lora", (f"algo={algo}", f"quant={f}", "lora=r32", f"optim.lr={rate}", *base),
                           dict(paper_model=PAPER_MODELS["7b"], weights=WEIGHTS[f], training="lora", aqn="no")))
        out.append(Row(f"{algo}-bf16-full", (f"algo={algo}", "quant=bf16", "lora=none", f"optim.lr={lr['full']}",
                                             *base),
                       dict(paper_model=PAPER_MODELS["7b"], weights="BF16", training="full", aqn="no")))
    return out


def main(argv=None) -> None:
    figure_main(ARTIFACT, rows, ("fig4", "fig5"), __doc__, argv)


if __name__ == "__main__":
    main()
