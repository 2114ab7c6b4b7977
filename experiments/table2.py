"""Table 2: DAPO on Big-Math, Qwen2.5-7B/14B/32B-Instruct (paper scale), evaluated on MATH-500, AIME24, AIME25,
AMC23 — base BF16/NVFP4, Full, LoRA, NVFP4-LoRA, NVFP4-LoRA + AQN.

    python -m experiments.table2 --scale smoke|toy|paper [--seeds 0,1] [--dry-run] [key=value ...]

paper: Big-Math levels 3-5 for 7B/14B and 4-5 for 32B (offline, the vendored MATH train levels stand in for
Big-Math, and every result says so; add `data.source=hub` for the real Big-Math). smoke/toy: the toy model stands
in for Qwen2.5-7B and trains with DAPO on the toy task; it is evaluated on the toy test split and on the four real
benchmarks (which it cannot solve: the columns prove the evaluation plumbing).
"""

from __future__ import annotations

from dataclasses import replace

from experiments.common import method_rows, table_main

ARTIFACT = "table2"
BENCH = "eval.sets=[math500,aime24,aime25,amc23]"


def rows(scale: str):
    if scale == "paper":
        return [replace(r, overrides=r.overrides + (f"model=qwen2.5-{mk}", "algo=dapo", f"data={data}", BENCH))
                for mk, data in (("7b", "bigmath"), ("14b", "bigmath"), ("32b", "bigmath_hard"))
                for r in method_rows(mk, scale, formats=("bf16", "nvfp4"), base=("bf16", "nvfp4"))]
    return [replace(r, overrides=r.overrides + ("algo=dapo", "data=toy",
                                                "eval.sets=[toy,math500,aime24,aime25,amc23]"))
            for r in method_rows("7b", scale, formats=("bf16", "nvfp4"), base=("bf16", "nvfp4"))]


def main(argv=None) -> None:
    table_main(ARTIFACT, rows, __doc__, argv)


if __name__ == "__main__":
    main()
