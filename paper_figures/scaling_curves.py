"""Does data-parallel training learn like one GPU? The reward curves of one evidence arm trained on 1 GPU and on N
GPUs (same global batch, same seeds), compared over seeds (issue 13).

    python -m paper_figures.scaling_curves --one ROOT1 --two ROOT2 --scale toy --arm nvfp4-lora --out results

``ROOT1``/``ROOT2`` are the ``--root`` folders of the two ``experiments.evidence`` invocations
(``scripts/multigpu_gpu.sh curves`` makes them); each holds ``evidence/<scale>/<arm>-lr<lr>-s<seed>/`` runs.
For each metric of the evidence findings (reward AUC, final reward, held-out pass@1) the N-GPU − 1-GPU difference
gets a Welch 95% interval over seeds. Verdict: **matches within seed noise** when every interval contains 0,
**differs** when one excludes it. Writes ``<out>/speed/scaling_curves_<scale>.md`` and
``<out>/figures/scaling_curves_<scale>.png`` (mean ± 95% band over seeds of each set).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from paper_figures import stats as S
from paper_figures.evidence_runs import final_mean, reward_curve
from qerl.errors import UserError
from qerl.results import read_jsonl

METRICS = ("reward AUC", "final reward", "held-out pass@1")


@dataclass(frozen=True)
class SeedRun:
    seed: int
    lr: float
    world_size: int
    steps: np.ndarray
    reward: np.ndarray
    heldout: float
    gpu: str
    run_dir: Path

    def metric(self, name: str) -> float:
        return {"reward AUC": S.curve_auc(self.steps, self.reward), "final reward": final_mean(self.reward),
                "held-out pass@1": self.heldout}[name]


def load_set(root, scale: str, arm: str) -> list[SeedRun]:
    """The finished runs of ``arm`` under ``root/evidence/<scale>/``, one per seed, sorted by seed."""
    here = Path(root) / "evidence" / scale
    pat = re.compile(rf"{re.escape(arm)}-lr([0-9.e+-]+)-s(\d+)")
    dirs = sorted(d for d in here.glob(f"{arm}-lr*-s*") if d.is_dir() and pat.fullmatch(d.name))
    if not dirs:
        raise UserError(f"no runs of arm {arm!r} under {here}")
    out = []
    for d in dirs:
        m = pat.fullmatch(d.name)
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        if not summary.get("finished"):
            raise UserError(f"{d} is not finished (no finished summary.json): let it finish or remove it")
        ev = summary.get("eval") or {}
        heldout = float(next(iter(ev.values())).get("pass@1", np.nan)) if ev else np.nan
        env = json.loads((d / "env.json").read_text()) if (d / "env.json").exists() else {}
        steps, reward = reward_curve(pd.DataFrame(read_jsonl(d / "metrics.jsonl")))
        out.append(SeedRun(int(m.group(2)), float(m.group(1)), int(summary.get("world_size") or 1), steps, reward,
                           heldout, str((env.get("hardware") or {}).get("gpu") or "cpu"), d))
    return sorted(out, key=lambda r: r.seed)


@dataclass(frozen=True)
class Comparison:
    scale: str
    arm: str
    one: list[SeedRun]
    many: list[SeedRun]
    rows: pd.DataFrame  # metric, mean_one, mean_many, sd_one, sd_many, effect, ci_lo, ci_hi, verdict

    @property
    def world(self) -> int:
        return self.many[0].world_size

    @property
    def verdict(self) -> str:
        v = set(self.rows["verdict"])
        if "differs" in v:
            return "differs"
        return "inconclusive (no interval: one seed per set)" if "no interval" in v else "matches within seed noise"


def _check(one: list[SeedRun], many: list[SeedRun]) -> None:
    bad = [r.run_dir for r in one if r.world_size != 1]
    if bad:
        raise UserError(f"the 1-GPU set has runs trained on several ranks: {bad[0]} (world_size "
                        f"{one[0].world_size}); give the root of the one-process runs as --one")
    sizes = {r.world_size for r in many}
    if len(sizes) != 1 or 1 in sizes:
        raise UserError(f"the multi-GPU set must be trained on one world size > 1, found world sizes "
                        f"{sorted(sizes)} under {many[0].run_dir.parent}")
    s1, s2 = [r.seed for r in one], [r.seed for r in many]
    if s1 != s2:
        raise UserError(f"the two sets have different seeds: 1 GPU {s1}, {many[0].world_size} GPUs {s2}; "
                        f"the comparison needs the same seeds (missing: {sorted(set(s1) ^ set(s2))})")
    if {r.lr for r in one} != {r.lr for r in many}:
        raise UserError(f"the two sets use different learning rates: {sorted({r.lr for r in one})} vs "
                        f"{sorted({r.lr for r in many})}")
    for a, b in zip(one, many, strict=True):
        if len(a.steps) != len(b.steps):
            raise UserError(f"seed {a.seed}: {a.run_dir} logged {len(a.steps)} steps, {b.run_dir} {len(b.steps)}")


def compare(one_root, many_root, scale: str, arm: str) -> Comparison:
    """Compare ``arm``'s runs under ``one_root`` (1 GPU) with those under ``many_root`` (N GPUs)."""
    one, many = load_set(one_root, scale, arm), load_set(many_root, scale, arm)
    _check(one, many)
    rows = []
    for name in METRICS:
        a = np.array([r.metric(name) for r in many])
        b = np.array([r.metric(name) for r in one])
        if np.isnan(a).all() or np.isnan(b).all():
            continue
        ci = S.welch_diff_ci(a, b)
        v = "no interval" if np.isnan(ci.lo) else ("matches" if ci.lo <= 0 <= ci.hi else "differs")
        rows.append(dict(metric=name, mean_one=float(np.nanmean(b)), mean_many=float(np.nanmean(a)),
                         sd_one=float(np.nanstd(b, ddof=1)) if len(b) > 1 else np.nan,
                         sd_many=float(np.nanstd(a, ddof=1)) if len(a) > 1 else np.nan,
                         effect=ci.estimate, ci_lo=ci.lo, ci_hi=ci.hi, p=ci.p, verdict=v))
    return Comparison(scale, arm, one, many, pd.DataFrame(rows))


def _f(x: float, signed: bool = False) -> str:
    return "—" if x != x else (f"{x:+.3f}" if signed else f"{x:.3f}")


def render_markdown(c: Comparison) -> str:
    gpus = sorted({r.gpu for r in c.one + c.many})
    lines = [f"# Reward curves on 1 vs {c.world} GPUs: scale `{c.scale}`, arm `{c.arm}`", "",
             f"Computed by `python -m paper_figures.scaling_curves` from {len(c.one)} + {len(c.many)} finished runs "
             f"(seeds {[r.seed for r in c.one]}, lr {c.one[0].lr:g}, the same global batch); hardware: "
             f"{', '.join(gpus)}. Effect = {c.world} GPUs − 1 GPU, Welch 95% interval over seeds.", "",
             f"**Verdict: {c.verdict}.**", "",
             f"| metric | 1 GPU (sd over seeds) | {c.world} GPUs (sd) | effect [95% CI] | p | verdict |",
             "|---|---|---|---|---|---|"]
    for r in c.rows.itertuples():
        lines.append(f"| {r.metric} | {_f(r.mean_one)} ({_f(r.sd_one)}) | {_f(r.mean_many)} ({_f(r.sd_many)}) | "
                     f"{_f(r.effect, True)} [{_f(r.ci_lo, True)}, {_f(r.ci_hi, True)}] | {_f(r.p)} | {r.verdict} |")
    lines += ["", "Runs:", *[f"- {r.run_dir} (world size {r.world_size})" for r in c.one + c.many], ""]
    return "\n".join(lines)


def render_figure(c: Comparison, out_dir) -> list[Path]:
    from paper_figures import style

    fig, axes = style.new_figure(1, 1, width=6.0)
    ax = axes[0][0]
    for runs, label, color in ((c.one, "1 GPU", "#7f7f7f"), (c.many, f"{c.world} GPUs", "#d62728")):
        band = S.curve_band([(r.steps, r.reward) for r in runs])
        ax.plot(band.x, band.mean, color=color, label=f"{label} (n={len(runs)})")
        ax.fill_between(band.x, band.lo, band.hi, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("training reward")
    ax.set_title(f"{c.arm}, scale {c.scale}: 1 vs {c.world} GPUs, mean ± 95% CI over seeds — {c.verdict}")
    ax.legend(loc="lower right")
    return style.save(fig, out_dir, f"scaling_curves_{c.scale}", [str(r.run_dir) for r in c.one + c.many])


def write(c: Comparison, out) -> list[Path]:
    md = Path(out) / "speed" / f"scaling_curves_{c.scale}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render_markdown(c))
    return [md, *render_figure(c, Path(out) / "figures")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paper_figures.scaling_curves", description=__doc__.split("\n")[0])
    ap.add_argument("--one", required=True, help="root of the 1-GPU runs")
    ap.add_argument("--two", required=True, help="root of the multi-GPU runs")
    ap.add_argument("--scale", required=True)
    ap.add_argument("--arm", default="nvfp4-lora")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    c = compare(args.one, args.two, args.scale, args.arm)
    for p in write(c, args.out):
        print(f"wrote {p}")
    print(f"verdict: {c.verdict}")


if __name__ == "__main__":
    from qerl.errors import cli_main

    cli_main(main)
