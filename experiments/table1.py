"""Table 1: GRPO on GSM8K, Qwen2.5-3B/7B-Instruct (paper scale) — base rows BF16/NF4/MXFP4/NVFP4, Full, LoRA,
NF4-LoRA, MXFP4-LoRA, NVFP4-LoRA, NVFP4-LoRA + AQN.

    python -m experiments.table1 --scale smoke|toy|paper [--seeds 0,1] [--dry-run] [key=value ...]

smoke/toy: the toy model stands in for Qwen2.5-7B and trains with GRPO on the toy arithmetic task (GSM8K-style,
answers after ####); it is evaluated on the toy test split and on real GSM8K (which it cannot solve: plumbing).
"""

from __future__ import annotations

from dataclasses import replace

from experiments.common import method_rows, table_main

ARTIFACT = "table1"


def rows(scale: str):
    if scale == "paper":
        return [replace(r, overrides=r.overrides + (f"model=qwen2.5-{mk}", "algo=grpo", "data=gsm8k",
                                                     "eval.sets=[gsm8k]"))
                for mk in ("3b", "7b") for r in method_rows(mk, scale)]
    return [replace(r, overrides=r.overrides + ("algo=grpo", "data=toy", "eval.sets=[toy,gsm8k]"))
            for r in method_rows("7b", scale)]


def main(argv=None) -> None:
    table_main(ARTIFACT, rows, __doc__, argv)


if __name__ == "__main__":
    main()
