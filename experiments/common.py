"""Shared machinery of the experiment scripts: a row is a list of overrides of the training core.

An experiment script declares its rows for a scale and calls ``main``; nothing about training is re-implemented
here. Every run lands in ``results/<artifact>/<scale>/<row>-s<seed>/``; a finished run is skipped and an
interrupted one resumes from its checkpoint (``qerl.train.run`` does both), so re-running a matrix is cheap.

Scales (``SCALE=`` in the Makefile):
* ``smoke``: CPU, minutes. The committed toy smoke model stands in for every paper model and trains on the toy
  arithmetic task; numbers prove the plumbing and are not comparable with the paper.
* ``toy``: one GPU. The larger toy model, several seeds: meaningful relative comparisons between formats.
* ``paper``: Qwen2.5-*-Instruct from the hub, the paper's data, hyper-parameters and lengths.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass, field

SCALES = ("smoke", "toy", "paper")

#: Learning rates per scale. Paper (Table 4): 1e-5 for quantized LoRA (QeRL, QLoRA), 5e-6 for BF16 LoRA (it
#: "collapses" above); the Full baseline's rate is not stated — 1e-6, a common full-parameter RL rate. The tiny toy
#: models need far larger rates to move in a few dozen steps; the 2:1 quantized:BF16 ratio is kept.
LR = {
    "smoke": {"quantized": 1e-3, "bf16_lora": 5e-4, "full": 1e-4},
    "toy": {"quantized": 5e-4, "bf16_lora": 2.5e-4, "full": 2e-5},
    "paper": {"quantized": 1e-5, "bf16_lora": 5e-6, "full": 1e-6},
}
#: Seeds per scale (the paper reports single runs; toy-scale comparisons need several).
SEEDS = {"smoke": (0,), "toy": (0, 1, 2), "paper": (0,)}
PAPER_MODELS = {"3b": "Qwen2.5-3B-Instruct", "7b": "Qwen2.5-7B-Instruct", "14b": "Qwen2.5-14B-Instruct",
                "32b": "Qwen2.5-32B-Instruct"}
WEIGHTS = {"bf16": "BF16", "nf4": "NF4", "mxfp4": "MXFP4", "nvfp4": "NVFP4"}


@dataclass(frozen=True)
class Row:
    """One cell-producing run: ``overrides`` of the training config plus the paper-row tags it fills."""

    key: str
    overrides: tuple[str, ...]
    tags: dict = field(default_factory=dict)
    train: bool = True  # False: evaluate the untrained base model only

    def all_overrides(self, artifact: str, scale: str, seed: int, extra=()) -> list[str]:
        tags = [f"+tags.{k}={v}" for k, v in {"table": artifact, **self.tags}.items()]
        return [f"scale={scale}", f"experiment={artifact}/{scale}", f"run_name={self.key}-s{seed}",
                f"seed={seed}", *self.overrides, *tags, *extra]


def method_rows(model_key: str, scale: str, formats=("bf16", "nf4", "mxfp4", "nvfp4"), full: bool = True,
                aqn: bool = True, base: tuple[str, ...] = ("bf16", "nf4", "mxfp4", "nvfp4")) -> list[Row]:
    """The rows of Tables 1/2 for one model: untrained bases, Full, LoRA per format, NVFP4 + AQN."""
    lr = LR[scale]
    paper = PAPER_MODELS[model_key]
    rows = [Row(f"{model_key}-{f}-base", (f"quant={f}",),
                dict(paper_model=paper, weights=WEIGHTS[f], training="none", aqn="no"), train=False) for f in base]
    if full:
        rows.append(Row(f"{model_key}-bf16-full", ("quant=bf16", "lora=none", f"optim.lr={lr['full']}"),
                        dict(paper_model=paper, weights="BF16", training="full", aqn="no")))
    for f in formats:
        rate = lr["bf16_lora"] if f == "bf16" else lr["quantized"]
        rows.append(Row(f"{model_key}-{f}-lora", (f"quant={f}", "lora=r32", f"optim.lr={rate}"),
                        dict(paper_model=paper, weights=WEIGHTS[f], training="lora", aqn="no")))
    if aqn:
        rows.append(Row(f"{model_key}-nvfp4-lora-aqn", ("quant=nvfp4", "lora=r32", "aqn=paper",
                                                         f"optim.lr={lr['quantized']}"),
                        dict(paper_model=paper, weights="NVFP4", training="lora", aqn="yes")))
    return rows


def run_rows(artifact: str, scale: str, rows: list[Row], seeds=None, extra=(), dry_run: bool = False) -> dict:
    """Run (or skip, or resume) every row x seed. Failures are reported, not fatal to the other rows."""
    from qerl.config import load_config

    seeds = SEEDS[scale] if seeds is None else seeds
    done, failed = [], []
    cfgs = [(row, load_config(row.all_overrides(artifact, scale, s, extra))) for row in rows for s in seeds]
    for i, (row, cfg) in enumerate(cfgs, 1):
        print(f"[{artifact}/{scale}] {i}/{len(cfgs)} {cfg.run_dir} ({'train' if row.train else 'base eval'})",
              flush=True)
        if dry_run:
            continue
        t0 = time.perf_counter()
        try:
            if row.train:
                from qerl.train import run

                run(cfg)
            else:
                from qerl.evaluate import run_base

                run_base(cfg)
            done.append(str(cfg.run_dir))
            print(f"    done in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # keep going: the matrix resumes the failed row next time
            traceback.print_exc()
            failed.append((str(cfg.run_dir), f"{type(e).__name__}: {e}"))
    return {"configs": cfgs, "done": done, "failed": failed}


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--scale", default="smoke", choices=SCALES)
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: per scale)")
    p.add_argument("--dry-run", action="store_true", help="compose and validate every row, run nothing")
    p.add_argument("--root", default="results")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides applied to every row")
    return p


def finish(result: dict, render=None) -> None:
    """Render the artifact (when given) and exit non-zero if any row failed."""
    if render is not None and result["done"]:
        render()
    for run_dir, err in result["failed"]:
        print(f"FAILED {run_dir}: {err}", file=sys.stderr)
    if result["failed"]:
        sys.exit(1)


def seeds_arg(args) -> tuple[int, ...] | None:
    return tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None


def scale_model(scale: str, paper_key: str) -> tuple[str, ...]:
    """Model and data overrides for a figure run: the paper's model on GSM8K, or the toy model on the toy task."""
    if scale == "paper":
        return (f"model=qwen2.5-{paper_key}", "data=gsm8k", "eval.sets=[gsm8k]")
    return ("data=toy", "eval.sets=[toy]")


def artifact_main(artifact: str, rows_fn, doc: str, render, argv=None) -> None:
    """CLI of an experiment: run (or skip, or resume) its rows, then ``render(root, scale)`` from results/."""
    args = parser(doc).parse_args(argv)
    res = run_rows(artifact, args.scale, rows_fn(args.scale), seeds_arg(args),
                   [f"out_dir={args.root}", *args.overrides], args.dry_run)
    finish(res, lambda: render(args.root, args.scale))


def figure_main(artifact: str, rows_fn, figures: tuple[str, ...], doc: str, argv=None) -> None:
    """CLI of a figure experiment: run its rows, then draw its figures from results/."""

    def render(root, scale):
        from paper_figures import figures as figs

        for name in figures:
            written = getattr(figs, name)(root=root, scale=scale)
            print(f"{name}: {written or 'skipped'}")

    artifact_main(artifact, rows_fn, doc, render, argv)


def table_main(artifact: str, rows_fn, doc: str, argv=None) -> None:
    """CLI of a table experiment: run its rows, then render the table (ours beside the paper's)."""

    def render(root, scale):
        from paper_figures import tables

        md, _ = getattr(tables, f"render_{artifact}")(root, scale)
        print(md)

    artifact_main(artifact, rows_fn, doc, render, argv)
