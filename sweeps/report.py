"""What a sweep wrote, read back: the trial budget (``census``), ``trials.csv``/``trials.md`` and the plots.

Imports no torch: ``python -m sweeps.aqn --study X --report-only`` regenerates everything from the study storage
and the trial run directories under ``results/`` alone.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from qerl.results import read_jsonl, read_summary

PARAMS = ("sigma_start", "sigma_end", "sigma_ratio", "stages", "schedule")
# The paper's AQN setting (Table 4): the star in the σ plot.
PAPER_SIGMA = (1e-2, 5e-4)


# ------------------------------------------------------------------------------------------------- budget
def census(trials) -> tuple[list, list, dict[int, int]]:
    """Split a study's trials into (counted, pending, retried_as).

    counted: COMPLETE, PRUNED, and FAIL trials that failed by themselves — these count toward ``--trials``.
    pending: RUNNING and WAITING trials (they will end up counted, or superseded).
    retried_as: {number of a FAIL trial whose worker died -> number of the trial that retries it}. Such trials and
    trials voided when they started (``void_reason``: surplus, duplicate retry) are not counted.
    """
    from optuna.trial import TrialState

    retried_as: dict[int, int] = {}
    for t in sorted(trials, key=lambda t: t.number):
        for n in t.system_attrs.get("retry_history", []):
            retried_as.setdefault(n, t.number)  # the first retry; later copies of it are voided when they start
    counted, pending = [], []
    for t in trials:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            counted.append(t)
        elif t.state == TrialState.FAIL:
            if t.number not in retried_as and not t.user_attrs.get("void"):
                counted.append(t)
        else:
            pending.append(t)
    return counted, pending, retried_as


def void_reason(trial, trials, n_trials: int) -> str | None:
    """Why ``trial`` (just started) must not run, or None. Two cases, both races between workers:

    surplus — the budget was already taken (counted trials + pending trials opened before this one >= n_trials);
    duplicate — another trial with a lower number retries the same dead trial (two workers noticed the same stale
    heartbeat at once; on SQLite nothing stops both from enqueueing a retry). Running it would train the same run
    directory twice at the same time.
    """
    history = trial.system_attrs.get("retry_history")
    if history:
        twin = min((t.number for t in trials if t.number < trial.number
                    and t.system_attrs.get("retry_history") == history), default=None)
        if twin is not None:
            return f"duplicate retry of trial {history[-1]} (trial {twin} retries it)"
    counted, pending, _ = census(trials)  # all of them: this trial may be what supersedes a dead one
    if len(counted) + sum(t.number < trial.number for t in pending) >= n_trials:
        return f"surplus: the study already holds {n_trials} trials"
    return None


# ------------------------------------------------------------------------------------------------- values
def accuracy_reward(row: dict) -> float | None:
    """The accuracy reward of one metrics line (the total reward when no accuracy reward is logged)."""
    v = row.get("rewards/accuracy/mean", row.get("reward"))
    return None if v is None else float(v)


def run_values(run_dir: str | Path) -> dict:
    """Both objectives of one run directory: ``val_acc`` (mean final eval pass@1 over the eval sets; None until the
    run finished) and ``reward_area`` (mean accuracy reward over the logged steps), plus ``steps_done``."""
    run_dir = Path(run_dir)
    accs = [a for a in (accuracy_reward(r) for r in read_jsonl(run_dir / "metrics.jsonl")) if a is not None]
    out = {"val_acc": None, "reward_area": sum(accs) / len(accs) if accs else None, "steps_done": len(accs)}
    summary = read_summary(run_dir)  # None when missing or unreadable (a warning names the file)
    if summary is not None:
        p = [v["pass@1"] for v in (summary.get("eval") or {}).values() if isinstance(v, dict) and "pass@1" in v]
        if summary.get("finished") and p:
            out["val_acc"] = sum(p) / len(p)
    return out


def trials_frame(study):
    """One row per trial: number, state, counted, value, both objectives, parameters, duration, run_dir, error."""
    import pandas as pd

    trials = study.get_trials(deepcopy=False)
    counted, _, retried_as = census(trials)
    counted_ids = {t.number for t in counted}
    rows = []
    for t in trials:
        p = dict(t.params)
        if "sigma_start" in p and "sigma_ratio" in p:
            p["sigma_end"] = p["sigma_start"] * p["sigma_ratio"]
        run_dir = None if t.user_attrs.get("void") else t.user_attrs.get("run_dir")  # a void trial ran nothing
        vals = run_values(run_dir) if run_dir and Path(run_dir).exists() and t.number not in retried_as else {}
        if t.number in retried_as:
            note = f"worker lost; retried as trial {retried_as[t.number]}"
        elif t.user_attrs.get("void"):
            note = t.user_attrs["void"]
        else:
            note = t.user_attrs.get("error") or t.system_attrs.get("fail_reason") or ""
        if t.state.name == "PRUNED" and t.intermediate_values:
            last = max(t.intermediate_values)
            note = note or f"pruned at step {last} (running accuracy reward {t.intermediate_values[last]:.3f})"
        rows.append({
            "number": t.number, "state": t.state.name, "counted": t.number in counted_ids, "value": t.value,
            "val_acc": t.user_attrs.get("val_acc", vals.get("val_acc")),
            "reward_area": t.user_attrs.get("reward_area", vals.get("reward_area")),
            **{k: p.get(k) for k in PARAMS},
            "steps_done": vals.get("steps_done"),
            "duration_s": t.duration.total_seconds() if t.duration is not None else None,
            "retry_of": t.system_attrs.get("failed_trial"),
            "run_dir": run_dir, "error": " ".join(str(note).split())[:300],
        })
    cols = ["number", "state", "counted", "value", "val_acc", "reward_area", *PARAMS, "steps_done", "duration_s",
            "retry_of", "run_dir", "error"]
    df = pd.DataFrame(rows, columns=cols).sort_values("number").reset_index(drop=True)
    return df.astype({"retry_of": "Int64", "steps_done": "Int64"})


def importances(study) -> tuple[dict[str, float], str]:
    """Parameter importances of the COMPLETE trials and the evaluator's name.

    fANOVA when scikit-learn is installed, else PED-ANOVA (needs no scikit-learn). Empty when fewer than two
    trials completed or their values do not differ (nothing to attribute)."""
    import optuna
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(done) < 2 or len({t.value for t in done}) < 2:
        return {}, "none"
    try:
        import sklearn  # noqa: F401

        evaluator, name = optuna.importance.FanovaImportanceEvaluator(seed=0), "fANOVA"
    except ImportError:
        evaluator, name = optuna.importance.PedAnovaImportanceEvaluator(), "PED-ANOVA"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            imp = optuna.importance.get_param_importances(study, evaluator=evaluator)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            return {}, f"{name} failed: {e}"
    clean = {k: float(v) for k, v in imp.items() if v == v}
    return clean, name


# ------------------------------------------------------------------------------------------------- plots
_MARK = {"COMPLETE": ("o", None), "PRUNED": ("X", "#888888"), "FAIL": ("s", "#d62728"), "RUNNING": ("^", "#1f77b4"),
         "WAITING": ("v", "#1f77b4")}


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_history(study, df, objective: str, path: Path) -> Path:
    """Left: the objective of each COMPLETE trial and the best so far; right: the running accuracy reward each
    trial reported (what the pruner judged), pruned trials grey."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ok = df[df.state == "COMPLETE"].sort_values("number")
    if len(ok):
        ax.plot(ok.number, ok.value, "o", color="#1f77b4", label=f"{objective} (COMPLETE)")
        ax.step(ok.number, ok.value.cummax(), where="post", color="#ff7f0e", label="best so far")
    for state in ("PRUNED", "FAIL"):
        sub = df[(df.state == state) & df.counted]
        if len(sub):
            y0 = float(ok.value.min()) if len(ok) else 0.0
            ax.plot(sub.number, [y0] * len(sub), _MARK[state][0], color=_MARK[state][1], label=state, alpha=0.8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.set_title("optimization history")
    ax.legend(fontsize=8)
    for t in study.get_trials(deepcopy=False):
        if t.intermediate_values and t.state.name != "FAIL":  # a dead trial's curve is continued by its retry
            steps = sorted(t.intermediate_values)
            pruned = t.state.name == "PRUNED"
            bx.plot(steps, [t.intermediate_values[s] for s in steps], color="#888888" if pruned else None,
                    ls="--" if pruned else "-", lw=1.2, label=f"{t.number}{' (pruned)' if pruned else ''}")
    bx.set_xlabel("step")
    bx.set_ylabel("running mean accuracy reward")
    bx.set_title("intermediate values")
    if bx.lines:
        bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def plot_importances(imp: dict[str, float], evaluator: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3))
    if imp:
        names = list(imp)[::-1]
        ax.barh(names, [imp[n] for n in names], color="#1f77b4")
        ax.set_xlabel(f"importance ({evaluator})")
    else:
        ax.text(0.5, 0.5, "not enough COMPLETE trials with differing values\nto rank the parameters",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title("parameter importances")
    fig.tight_layout()
    return _save(fig, path)


def plot_sigma(df, objective: str, path: Path) -> Path:
    """σ_start × σ_end, coloured by the objective (COMPLETE), other states by marker; the paper's point as a star."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.8))
    d = df[df.sigma_start.notna() & df.sigma_end.notna() & df.counted]
    ok = d[d.state == "COMPLETE"]
    if len(ok):
        sc = ax.scatter(ok.sigma_start, ok.sigma_end, c=ok.value.astype(float), cmap="viridis", s=60,
                        edgecolors="k", linewidths=0.5, zorder=3)
        fig.colorbar(sc, ax=ax, label=objective)
    for state in ("PRUNED", "FAIL"):
        sub = d[d.state == state]
        if len(sub):
            ax.scatter(sub.sigma_start, sub.sigma_end, marker=_MARK[state][0], color=_MARK[state][1], s=50,
                       label=state, zorder=3)
    for _, r in d.iterrows():
        ax.annotate(str(int(r.number)), (r.sigma_start, r.sigma_end), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    ax.scatter(*PAPER_SIGMA, marker="*", s=320, facecolors="none", edgecolors="#ff7f0e", linewidths=1.5,
               label="paper (1e-2 → 5e-4)", zorder=4)
    lo = min([PAPER_SIGMA[1], *d.sigma_end.tolist()]) / 2
    hi = max([PAPER_SIGMA[0], *d.sigma_start.tolist()]) * 2
    ax.plot([lo, hi], [lo, hi], ":", color="#999999", lw=1, label="σ_end = σ_start")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("σ_start")
    ax.set_ylabel("σ_end")
    ax.set_title("AQN noise range")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------- the report
def _fmt(v) -> str:
    import pandas as pd

    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}".rstrip("0").rstrip(".")
    return str(v)


def markdown(study, df, settings: dict, imp: dict, evaluator: str) -> str:
    counted = int(df.counted.sum())
    lines = [f"# AQN sweep `{study.study_name}`", ""]
    for k in ("scale", "objective", "overrides", "n_trials", "space"):
        if k in settings:
            lines.append(f"- {k}: `{json.dumps(settings[k]) if not isinstance(settings[k], str) else settings[k]}`")
    lines.append(f"- trials counted toward the budget: {counted}"
                 + (f" of {settings['n_trials']}" if "n_trials" in settings else ""))
    ok = df[df.state == "COMPLETE"]
    if len(ok):
        b = ok.loc[ok.value.astype(float).idxmax()]
        lines.append(f"- best: trial {int(b.number)}, {settings.get('objective', 'value')} = {_fmt(b.value)} "
                     f"(σ {_fmt(b.sigma_start)} → {_fmt(b.sigma_end)}, K = {_fmt(b.stages)}, {b.schedule})")
    if imp:
        lines.append(f"- importances ({evaluator}): " + ", ".join(f"{k} {v:.2f}" for k, v in imp.items()))
    cols = ["number", "state", "value", "val_acc", "reward_area", "sigma_start", "sigma_end", "stages", "schedule",
            "steps_done", "duration_s", "error"]
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        cells = {c: r[c] for c in cols}
        if cells["duration_s"] == cells["duration_s"] and cells["duration_s"] is not None:
            cells["duration_s"] = round(float(cells["duration_s"]))
        lines.append("| " + " | ".join(_fmt(cells[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_report(study, out_dir: str | Path) -> list[Path]:
    """Write ``trials.csv``, ``trials.md``, ``history.png``, ``importances.png`` and ``sigma.png`` into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    from qerl.results import atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(study.user_attrs.get("sweep") or {})
    if "n_trials" in study.user_attrs:
        settings["n_trials"] = study.user_attrs["n_trials"]
    objective = settings.get("objective", "value")
    df = trials_frame(study)
    imp, evaluator = importances(study)
    atomic_write_text(out / "trials.csv", df.to_csv(index=False))
    atomic_write_text(out / "trials.md", markdown(study, df, settings, imp, evaluator))
    return [out / "trials.csv", out / "trials.md", plot_history(study, df, objective, out / "history.png"),
            plot_importances(imp, evaluator, out / "importances.png"), plot_sigma(df, objective, out / "sigma.png")]
