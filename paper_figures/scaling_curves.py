"""Does data-parallel training learn like one GPU? The reward curves of one evidence arm trained on 1 GPU and on N
GPUs (same global batch, same seeds, same rate), compared over seeds (issue 13).

    python -m paper_figures.scaling_curves --one ROOT1 --two ROOT2 --scale small --arm nvfp4-lora --out results

``ROOT1``/``ROOT2`` are the ``--root`` folders of the two ``experiments.evidence`` invocations
(``scripts/multigpu_gpu.sh curves`` makes them: ``c1`` on one GPU, ``c2`` with ``--nproc 2``); each holds
``evidence/<scale>/<arm>-lr<lr>-s<seed>/`` runs, read by ``paper_figures.evidence_runs.load`` exactly as the
evidence findings read them. The metrics are the findings' own: reward AUC (the mean training reward over the
steps), final reward (the mean of the last 10% of steps) and held-out pass@1 per eval set.

For each metric the N-GPU − 1-GPU difference of the means over seeds gets a Welch 95% interval
(``stats.welch_diff_ci``), and is set against the seed-to-seed spread (the root mean square of the two sets'
sample sds over seeds). A metric

* **differs** when its interval excludes 0;
* **matches** when its interval contains 0 and the difference is no larger than the seed spread;
* is **inconclusive** when its interval contains 0 but the difference exceeds the seed spread (too few seeds to
  tell), or when there is no interval (one seed per set).

Verdict: **differs** when a metric differs, **matches within seed noise** when every metric matches, else
inconclusive. Inputs are checked first: the 1-GPU runs must have world size 1 (or none recorded), the other set one
world size > 1 (``summary.json``); both sets finished, with the same seeds, rate and logged steps.

Writes ``<out>/speed/scaling_curves_<scale>.md`` (the table, the verdict, where the runs came from: hardware from
each run's env.json), the rows into ``<out>/speed/scaling_curves.csv`` (one block per scale and arm;
``python -m experiments.speed`` shows them in speed.md) and ``<out>/figures/scaling_curves_<scale>.png`` (mean ±
95% band over seeds of each set).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from paper_figures import evidence_runs as ER
from paper_figures import runs as R
from paper_figures import stats as S
from qerl.errors import UserError
from qerl.results import read_summary

LEVEL = 0.95
CURVE_METRICS = ("reward AUC", "final reward")
CSV_NAME = "scaling_curves.csv"
CSV_COLUMNS = ["scale", "arm", "lr", "world_size", "seeds", "steps", "metric", "mean_one", "sd_one", "mean_many",
               "sd_many", "spread", "effect", "ci_lo", "ci_hi", "df", "p", "verdict", "why", "overall"]


# ------------------------------------------------------------------------------------------------ one set of runs
@dataclass(frozen=True)
class RunSet:
    """The finished runs of one arm at one rate under one root, one per seed (sorted by seed): their ``run_dir``,
    ``seed``, ``world_size`` (``summary.json``; 1 when not recorded), ``hardware`` (from env.json) and training
    reward curve (``steps``, ``reward``); ``values`` the per-run metrics (index ``run_dir``) as the findings compute
    them; ``band`` the per-step mean reward with its 95% interval over seeds."""
    root: Path
    arm: str
    lr: float
    runs: pd.DataFrame  # run_dir, seed, world_size, hardware
    curves: dict[str, tuple[np.ndarray, np.ndarray]]
    values: pd.DataFrame
    band: S.Band

    @property
    def seeds(self) -> list[int]:
        return [int(s) for s in self.runs["seed"]]

    @property
    def worlds(self) -> list[int]:
        return [int(w) for w in self.runs["world_size"]]


def _world_size(run_dir: str) -> int:
    ws = (read_summary(run_dir) or {}).get("world_size")
    return 1 if ws is None else int(ws)  # runs from before world_size was recorded ran as one process


def _hardware(run_dir: str) -> str:
    """``2 × NVIDIA H200, nccl, host h1``: what a run trained on, from its env.json (its first launch's)."""
    p = Path(run_dir) / "env.json"
    if not p.exists():
        return "unknown (no env.json)"
    env = json.loads(p.read_text())
    hw, dist = env.get("hardware") or {}, env.get("distributed") or {}
    name = hw.get("gpu") or f"CPU {hw.get('cpu', '?')} ({hw.get('cpu_count', '?')} cores)"
    backend = f", {dist['backend']}" if dist.get("backend") else ""
    return f"{dist.get('world_size', 1)} × {name}{backend}, host {env.get('hostname', '?')}"


def load_set(root, scale: str, arm: str, lr: float | None = None) -> RunSet:
    """The finished runs of ``arm`` under ``root/evidence/<scale>/`` at rate ``lr`` (default: the arm's only rate
    there). Refuses an unfinished run of the arm, a missing arm, and several rates without ``lr``."""
    root = Path(root)
    where = root / ER.TABLE / scale
    ev = ER.load(root, scale)
    if ev is None:
        raise UserError(f"no evidence runs of scale {scale!r} under {where}")
    unfinished = [u for u in ev.unfinished if Path(u).name.startswith(f"{arm}-lr")]
    if unfinished:
        raise UserError(f"run {root / unfinished[0]} is not finished (no finished summary.json); let it finish or "
                        f"move it away (unfinished runs of {arm} under {root}: {unfinished})")
    mine = ev.runs[ev.runs["arm"] == arm]
    if mine.empty:
        raise UserError(f"no finished runs of arm {arm!r} under {where}; arms there: {sorted(set(ev.runs['arm']))}")
    rates = sorted(set(mine["lr"]))
    if lr is None and len(rates) > 1:
        raise UserError(f"{where} has runs of {arm} at several rates {[ER.fmt_lr(x) for x in rates]}: choose one "
                        f"with --lr")
    lr = rates[0] if lr is None else ER._lr_key(lr)
    sel = ev.at(arm, lr)
    if sel.empty:
        raise UserError(f"no finished runs of {arm} at lr {ER.fmt_lr(lr)} under {where}; rates there: "
                        f"{[ER.fmt_lr(x) for x in rates]}")
    curves = {}
    for d in sel["run_dir"]:
        steps, reward = ER.reward_curve(ev.curves.get(d, pd.DataFrame()))
        if not len(reward):
            raise UserError(f"run {d} logged no training reward (metrics.jsonl has no {' / '.join(ER.REWARD)})")
        curves[d] = (steps, reward)
    runs = pd.DataFrame({"run_dir": sel["run_dir"].to_numpy(), "seed": sel["seed"].to_numpy(int),
                         "world_size": [_world_size(d) for d in sel["run_dir"]],
                         "hardware": [_hardware(d) for d in sel["run_dir"]]})
    band = S.curve_band([curves[d] for d in runs["run_dir"]], LEVEL)
    return RunSet(root, arm, lr, runs, curves, ev.values.loc[runs["run_dir"]], band)


# ------------------------------------------------------------------------------------------------ the comparison
@dataclass(frozen=True)
class Comparison:
    """1 GPU (``one``) against N GPUs (``many``): per metric (``rows``: means and sds over seeds, seed
    ``spread``, ``effect`` = N-GPU − 1-GPU with its Welch interval, ``verdict``) and the overall ``verdict``."""
    scale: str
    arm: str
    one: RunSet
    many: RunSet
    rows: pd.DataFrame

    @property
    def world(self) -> int:
        return self.many.worlds[0]

    @property
    def steps(self) -> int:
        return len(self.one.band.x)

    @property
    def verdict(self) -> str:
        return overall_verdict(list(self.rows["verdict"]))


def metric_verdict(ci: S.CI, spread: float) -> tuple[str, str]:
    """``differs`` / ``matches`` / ``inconclusive`` of one metric (see the module docstring), and why."""
    if np.isnan(ci.lo) or np.isnan(ci.hi):
        return "inconclusive", "no interval (one seed in a set)"
    if S.verdict(ci.lo, ci.hi) != "inconclusive":  # the interval excludes 0, on either side
        return "differs", "the interval excludes 0"
    if abs(ci.estimate) <= spread:
        return "matches", "the interval contains 0 and the effect is within the seed spread"
    return "inconclusive", (f"the interval contains 0 but the effect ({ci.estimate:+.3g}) exceeds the seed spread "
                            f"({spread:.3g}): more seeds would tell")


def overall_verdict(verdicts: list[str]) -> str:
    if "differs" in verdicts:
        return "differs"
    if verdicts and all(v == "matches" for v in verdicts):
        return "matches within seed noise"
    return "inconclusive"


def _check(one: RunSet, many: RunSet) -> None:
    """The two sets are comparable: world sizes 1 and one N > 1, the same seeds, rate and steps."""
    for _, r in one.runs.iterrows():
        if r["world_size"] != 1:
            raise UserError(f"the 1-GPU set has a run trained on {r['world_size']} ranks: {r['run_dir']} "
                            f"(summary.json world_size {r['world_size']}); give the root of the one-process runs "
                            f"as --one")
    n = many.worlds[0]
    for _, r in many.runs.iterrows():
        if r["world_size"] == 1:
            raise UserError(f"the multi-GPU set has a one-process run: {r['run_dir']} (summary.json world_size 1 "
                            f"or not recorded); give the root of the torchrun (--nproc 2) runs as --two")
        if r["world_size"] != n:
            raise UserError(f"the multi-GPU set mixes world sizes: {r['run_dir']} has {r['world_size']}, "
                            f"{many.runs['run_dir'].iloc[0]} has {n}")
    if one.seeds != many.seeds:
        only1, only2 = sorted(set(one.seeds) - set(many.seeds)), sorted(set(many.seeds) - set(one.seeds))
        raise UserError(f"the two sets have different seeds: 1 GPU {one.seeds} ({one.root}), {n} GPUs "
                        f"{many.seeds} ({many.root}); missing on {n} GPUs: {only1}, missing on 1 GPU: {only2}")
    if one.lr != many.lr:
        raise UserError(f"the two sets use different learning rates: {ER.fmt_lr(one.lr)} ({one.root}) and "
                        f"{ER.fmt_lr(many.lr)} ({many.root}); pass --lr")
    ref_dir = one.runs["run_dir"].iloc[0]
    ref = one.curves[ref_dir][0]
    for s in (one, many):
        for d, (steps, _) in s.curves.items():
            if not np.array_equal(steps, ref):
                raise UserError(f"run {d} logged steps {_span(steps)}, but {ref_dir} logged {_span(ref)}: the curves "
                                f"must cover the same steps (same train.steps, finished)")


def _span(steps: np.ndarray) -> str:
    return f"{int(steps[0])}..{int(steps[-1])} ({len(steps)} steps)" if len(steps) else "none"


def _sd(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(np.std(x, ddof=1)) if len(x) > 1 else np.nan


def compare(one_root, two_root, scale: str, arm: str = "nvfp4-lora", lr: float | None = None) -> Comparison:
    """Compare ``arm``'s runs under ``one_root`` (1 GPU) with those under ``two_root`` (N GPUs)."""
    one, many = load_set(one_root, scale, arm, lr), load_set(two_root, scale, arm, lr)
    _check(one, many)
    sets = [c for c in one.values.columns if c.startswith("pass@1 ") and c in many.values.columns]
    rows = []
    for name in (*CURVE_METRICS, *sets):
        a, b = many.values[name].to_numpy(float), one.values[name].to_numpy(float)
        if np.isnan(a).all() or np.isnan(b).all():
            continue
        ci = S.welch_diff_ci(a, b, LEVEL)
        sd_one, sd_many = _sd(b), _sd(a)
        spread = float(np.sqrt((sd_one**2 + sd_many**2) / 2))
        verdict, why = metric_verdict(ci, spread)
        rows.append(dict(metric=name.replace("pass@1 ", "held-out pass@1 "), mean_one=float(np.nanmean(b)),
                         sd_one=sd_one, mean_many=float(np.nanmean(a)), sd_many=sd_many, spread=spread,
                         effect=ci.estimate, ci_lo=ci.lo, ci_hi=ci.hi, df=ci.df, p=ci.p,
                         verdict=verdict, why=why))
    return Comparison(scale, arm, one, many, pd.DataFrame(rows))


# ------------------------------------------------------------------------------------------------ rendering
def _f(x: float, signed: bool = False) -> str:
    return "—" if x is None or x != x else (f"{x:+.3f}" if signed else f"{x:.3f}")


def _per_step_rows(c: Comparison, most: int = 10) -> list[str]:
    """Up to ``most`` evenly spaced steps (first and last included) of both bands."""
    x = c.one.band.x
    idx = np.unique(np.linspace(0, len(x) - 1, min(most, len(x))).round().astype(int))
    out = []
    for i in idx:
        cells = [f"{_f(b.mean[i])} [{_f(b.lo[i])}, {_f(b.hi[i])}]" for b in (c.one.band, c.many.band)]
        out.append(f"| {int(x[i])} | {cells[0]} | {cells[1]} |")
    return out


def render_markdown(c: Comparison) -> str:
    w = c.world
    lines = [f"# Reward curves on 1 vs {w} GPUs: scale `{c.scale}`, arm `{c.arm}`", "",
             f"Computed by `python -m paper_figures.scaling_curves` from {len(c.one.seeds)} + {len(c.many.seeds)} "
             f"finished runs (seeds {c.one.seeds}, lr {ER.fmt_lr(c.one.lr)}, {c.steps} steps, the same global "
             f"batch). Effect = {w} GPUs − 1 GPU with its Welch {LEVEL:.0%} interval over seeds; spread = the "
             f"seed-to-seed sd (root mean square of the two sets' sds). A metric matches when its interval contains "
             f"0 and the effect is within the spread, differs when the interval excludes 0.", "",
             f"**Verdict: {c.verdict}.**", "",
             *[f"- {r.metric}: {r.verdict}, {r.why}." for r in c.rows.itertuples() if r.verdict != "matches"],
             *([""] if (c.rows["verdict"] != "matches").any() else []),
             f"| metric | 1 GPU mean (sd) | {w} GPUs mean (sd) | spread | effect [95% CI] | p | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in c.rows.itertuples():
        lines.append(f"| {r.metric} | {_f(r.mean_one)} ({_f(r.sd_one)}) | {_f(r.mean_many)} ({_f(r.sd_many)}) | "
                     f"{_f(r.spread)} | {_f(r.effect, True)} [{_f(r.ci_lo, True)}, {_f(r.ci_hi, True)}] | "
                     f"{_f(r.p)} | {r.verdict} |")
    lines += ["", f"Training reward per step, mean [{LEVEL:.0%} CI] over seeds:", "",
              f"| step | 1 GPU | {w} GPUs |", "|---|---|---|", *_per_step_rows(c), "",
              "Where the runs came from (hardware from each run's env.json):", ""]
    for label, s in (("1 GPU", c.one), (f"{w} GPUs", c.many)):
        lines.append(f"- {label}: `{s.root}`: {'; '.join(sorted(set(s.runs['hardware'])))}")
        lines += [f"  - {R.rel(d, s.root)} (world size {ws})" for d, ws in zip(s.runs["run_dir"], s.worlds,
                                                                               strict=True)]
    return "\n".join(lines) + "\n"


def render_figure(c: Comparison, out_dir) -> list[Path]:
    from paper_figures import style

    fig, axes = style.new_figure(1, 1, width=6.0)
    ax = axes[0][0]
    for s, label, color in ((c.one, "1 GPU", "#7f7f7f"), (c.many, f"{c.world} GPUs", "#d62728")):
        b = s.band
        ax.plot(b.x, b.mean, color=color, label=f"{label} (n={len(s.seeds)})")
        ax.fill_between(b.x, b.lo, b.hi, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("training reward")
    ax.set_title(f"{c.arm}, {c.scale}: 1 vs {c.world} GPUs, mean ± 95% CI over seeds\n{c.verdict}", fontsize=9)
    ax.legend(loc="lower right")
    sources = [str(d) for s in (c.one, c.many) for d in s.runs["run_dir"]]
    return style.save(fig, out_dir, f"scaling_curves_{c.scale}", sources)


def csv_rows(c: Comparison) -> pd.DataFrame:
    head = dict(scale=c.scale, arm=c.arm, lr=c.one.lr, world_size=c.world,
                seeds=" ".join(map(str, c.one.seeds)), steps=c.steps, overall=c.verdict)
    return pd.DataFrame([{**head, **r} for r in c.rows.to_dict("records")], columns=CSV_COLUMNS)


def write_csv(c: Comparison, speed_dir) -> Path:
    """Put ``c``'s rows into ``<speed_dir>/scaling_curves.csv``, replacing the older rows of its scale and arm."""
    from qerl.results import atomic_write_text

    path = Path(speed_dir) / CSV_NAME
    old = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=CSV_COLUMNS)
    old = old[~((old["scale"].astype(str) == c.scale) & (old["arm"].astype(str) == c.arm))]
    new = csv_rows(c)
    out = pd.concat([old, new], ignore_index=True) if len(old) else new
    atomic_write_text(path, out.sort_values(["scale", "arm"], kind="stable").to_csv(index=False))
    return path


def write(c: Comparison, out) -> list[Path]:
    """The markdown and CSV under ``<out>/speed/`` and the figure under ``<out>/figures/``."""
    from qerl.results import atomic_write_text

    speed = Path(out) / "speed"
    speed.mkdir(parents=True, exist_ok=True)
    md = speed / f"scaling_curves_{c.scale}.md"
    atomic_write_text(md, render_markdown(c))
    return [md, write_csv(c, speed), *render_figure(c, Path(out) / "figures")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paper_figures.scaling_curves", description=__doc__.split("\n")[0])
    ap.add_argument("--one", required=True, help="--root of the 1-GPU evidence runs (multigpu_gpu.sh: c1)")
    ap.add_argument("--two", required=True, help="--root of the multi-GPU evidence runs (multigpu_gpu.sh: c2)")
    ap.add_argument("--scale", required=True, help="evidence scale (toy, small, smoke)")
    ap.add_argument("--arm", default="nvfp4-lora", help=f"one of {list(ER.ARMS)}")
    ap.add_argument("--lr", type=float, default=None, help="the rate to compare when a root has several")
    ap.add_argument("--out", default="results", help="writes OUT/speed/scaling_curves_<scale>.md, "
                                                      "OUT/speed/scaling_curves.csv, OUT/figures/...")
    args = ap.parse_args(argv)
    c = compare(args.one, args.two, args.scale, args.arm, args.lr)
    for p in write(c, args.out):
        print(f"wrote {p}")
    print(f"verdict: {c.verdict}")


if __name__ == "__main__":
    from qerl.errors import cli_main

    cli_main(main)
