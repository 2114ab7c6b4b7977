"""Evidence figures, per scale, from the runs under ``results/evidence/<scale>/`` (``paper_figures.evidence_runs``
says which runs and the learning-rate protocol; ``paper_figures.findings`` the comparisons these figures draw).

Each function takes the results ``root`` and a ``scale`` (and optionally ``smooth``, a rolling mean over steps of
each run before the seeds are averaged; ``out_dir``, default ``<root>/figures``; ``ev``, an already loaded
``findings.Evidence``), writes ``<out_dir>/evidence_<name>_<scale>.png``, ``.pdf`` and ``.runs.txt`` (the runs
drawn) and returns those paths, or ``[]`` with a printed reason when it has nothing to draw:

* ``reward_curves`` (Fig. 4 style): training reward of the format arms, at the shared rate and at each arm's best;
* ``entropy_curves`` (Fig. 5 style): the training policy's entropy, same panels;
* ``aqn_curves`` (Fig. 8 style): NVFP4-LoRA ± AQN and the control BF16-LoRA ± AQN, at the shared rate and at the
  best rate of the arm without AQN;
* ``schedule_curves`` (Fig. 9 style): NVFP4-LoRA without AQN and with each noise schedule;
* ``entropy_formats`` (claim a): the base model's sampling entropy per format (95% CI over prompts, a dot per
  seed) and its paired difference from BF16;
* ``lr_grid``: the seed-0 mean training reward against the learning rate per arm (the numbers ``best_lr`` chose
  from), the best rates starred and the shared rate marked.

Curves are the mean over seeds with a 95% t-interval band (``paper_figures.stats.curve_band``; one seed: a line
without a band); the legend gives each line's rate and number of seeds. When the runs record a model note (e.g.
that GGUF Q4_1 weights stand in for BF16) the subtitle carries it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from paper_figures import evidence_runs as ER
from paper_figures import findings as FD
from paper_figures import runs as R
from paper_figures import stats as S
from paper_figures.figures import BAND_NOTE, out_dir_for, plot_band, seeds_label, skip
from paper_figures.style import FORMAT_COLORS, SCHEDULE_COLORS, format_color, new_figure, save

AQN_DASH = (5, 2)
# the lr-grid figure draws every arm in one panel; these differ from the format colours
GRID_SCHEDULE_COLORS = {"nvfp4-lora-aqn-linear": "#8c564b", "nvfp4-lora-aqn-cosine": "#e377c2",
                        "nvfp4-lora-aqn-logarithmic": "#bcbd22"}


def arm_color(arm: str) -> str:
    """A format arm's colour (BF16-Full its own); AQN arms share their format's colour (they are dashed)."""
    return format_color(arm.split("-")[0], full=arm == "bf16-full")


def _dashes(arm: str):
    return AQN_DASH if "aqn" in arm else None


def _load(root, scale: str, ev):
    return ev if ev is not None else ER.load(root, scale)


def _smoothed(values: np.ndarray, window: int) -> np.ndarray:
    if not window or window <= 1 or len(values) == 0:
        return values
    c = np.cumsum(np.insert(values, 0, 0.0))
    k = np.minimum(np.arange(1, len(values) + 1), window)  # a trailing window, shorter at the start
    return (c[1:] - c[np.arange(1, len(values) + 1) - k]) / k


def metric_curve(ev: ER.Evidence, run_dir: str, metric: str, smooth: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one run: ``metric`` ``reward`` is the training reward (``findings.reward_curve``),
    anything else a metrics.jsonl column; smoothed by a trailing mean of ``smooth`` steps."""
    m = ev.curves.get(run_dir)
    if m is None:
        return np.array([]), np.array([])
    if metric == "reward":
        s, v = ER.reward_curve(m)
    elif metric in m:
        sub = m[["step", metric]].dropna().sort_values("step")
        s, v = sub["step"].to_numpy(float), sub[metric].to_numpy(float)
    else:
        return np.array([]), np.array([])
    return s, _smoothed(v, smooth)


def line_band(ev: ER.Evidence, arm: str, lr, metric: str, smooth: int = 1) -> tuple[S.Band, list[str]]:
    """The band over seeds of ``arm`` at rate ``lr`` and the runs behind it (runs without the metric left out)."""
    curves, dirs = [], []
    for d in ev.at(arm, lr)["run_dir"]:
        s, v = metric_curve(ev, d, metric, smooth)
        if len(v):
            curves.append((s, v))
            dirs.append(d)
    return S.curve_band(curves), dirs


def _subtitle(ev: ER.Evidence, text: str) -> str:
    import textwrap

    return "\n".join([text, *(line for n in ev.notes for line in textwrap.wrap(n, 110))])


def _sources(ev: ER.Evidence, dirs) -> list[str]:
    return [R.rel(d, ev.root) for d in dict.fromkeys(dirs)]


def _curve_panels(name: str, ev: ER.Evidence, panels, metric: str, ylabel: str, title: str, smooth: int,
                  out_dir, ncols: int | None = None) -> list[Path]:
    """Panels of band lines. ``panels``: [(panel title, [(arm, lr, colour, dashes, label prefix)])]."""
    drawn = [(t, [(*ln, *line_band(ev, ln[0], ln[1], metric, smooth)) for ln in lines]) for t, lines in panels]
    if not any(dirs for _, lines in drawn for *_, dirs in lines):
        return skip(name, f"no finished runs with {metric!r} for these arms at scale {ev.scale}")
    ncols = ncols or len(drawn)
    nrows = -(-len(drawn) // ncols)
    fig, axes = new_figure(nrows, ncols)
    used, counts = [], []
    for ax, (ptitle, lines) in zip(axes.flat, drawn, strict=False):
        for _arm, lr, color, dashes, label, band, dirs in lines:
            if dirs:
                plot_band(ax, band, color, f"{label} lr {ER.fmt_lr(lr)} ({seeds_label([len(dirs)])})", dashes)
                used += dirs
                counts.append(len(dirs))
        if ax.lines:
            ax.legend(loc="best", fontsize=7)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.set_title(ptitle, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    smooth_note = f", smoothed over {smooth} steps" if smooth and smooth > 1 else ""
    fig.suptitle(_subtitle(ev, f"{title} — evidence, scale {ev.scale}: {seeds_label(counts)} seeds per line\n"
                               f"{BAND_NOTE}{smooth_note}"), fontsize=9)
    return save(fig, out_dir_for(ev.root, out_dir), name, _sources(ev, used),
                note=f"scale {ev.scale}, paths relative to {ev.root}" + "".join(f"; {n}" for n in ev.notes))


def _format_panels(ev: ER.Evidence) -> list:
    p, lora = ev.protocol, [a for a in ER.FORMAT_ARMS if a != "bf16-full"]
    line = lambda arm, lr: (arm, lr, arm_color(arm), _dashes(arm), ER.LABELS[arm])  # noqa: E731
    return [(f"shared lr {ER.fmt_lr(p.shared)}", [line(a, p.shared) for a in lora]),
            ("each arm at its best lr", [line(a, p.best.get(a)) for a in ER.FORMAT_ARMS])]


def reward_curves(root="results", scale: str = "toy", smooth: int = 1, out_dir=None, ev=None) -> list[Path]:
    """Fig. 4 style: training reward per format arm, at the shared rate and at each arm's best rate."""
    name = f"evidence_reward_{scale}"
    if (ev := _load(root, scale, ev)) is None:
        return skip(name, f"no evidence runs at scale {scale!r}")
    return _curve_panels(name, ev, _format_panels(ev), "reward", "training reward",
                         "Training reward per format (Fig. 4)", smooth, out_dir)


def entropy_curves(root="results", scale: str = "toy", smooth: int = 1, out_dir=None, ev=None) -> list[Path]:
    """Fig. 5 style: the training policy's entropy (``entropy``, noiseless) per format arm."""
    name = f"evidence_entropy_{scale}"
    if (ev := _load(root, scale, ev)) is None:
        return skip(name, f"no evidence runs at scale {scale!r}")
    return _curve_panels(name, ev, _format_panels(ev), "entropy", "training-policy entropy",
                         "Training entropy per format (Fig. 5)", smooth, out_dir)


def aqn_curves(root="results", scale: str = "toy", smooth: int = 1, out_dir=None, ev=None) -> list[Path]:
    """Fig. 8 style: reward with and without AQN, for NVFP4-LoRA and the BF16-LoRA control; rows: the shared rate
    and the best rate of the arm without AQN."""
    name = f"evidence_aqn_{scale}"
    if (ev := _load(root, scale, ev)) is None:
        return skip(name, f"no evidence runs at scale {scale!r}")
    p, panels = ev.protocol, []
    for mode in ("shared", "best"):
        for a, b in (("nvfp4-lora-aqn", "nvfp4-lora"), ("bf16-lora-aqn", "bf16-lora")):
            lr_a, lr_b = (p.shared, p.shared) if mode == "shared" else FD.c_best_rates(ev, a, b)[:2]
            panels.append((f"{ER.LABELS[b]} ± AQN · {mode} lr",
                           [(b, lr_b, arm_color(b), None, ER.LABELS[b]),
                            (a, lr_a, arm_color(a), AQN_DASH, ER.LABELS[a])]))
    return _curve_panels(name, ev, panels, "reward", "training reward", "AQN on/off (Fig. 8), BF16 control",
                         smooth, out_dir, ncols=2)


def schedule_curves(root="results", scale: str = "toy", smooth: int = 1, out_dir=None, ev=None) -> list[Path]:
    """Fig. 9 style: NVFP4-LoRA without AQN and with each schedule, at the shared rate and at NVFP4-LoRA's best."""
    name = f"evidence_schedules_{scale}"
    if (ev := _load(root, scale, ev)) is None:
        return skip(name, f"no evidence runs at scale {scale!r}")
    p, panels = ev.protocol, []
    for mode in ("shared", "best"):
        lines = [("nvfp4-lora", p.shared if mode == "shared" else p.best.get("nvfp4-lora"),
                  SCHEDULE_COLORS["none"], None, "no AQN")]
        for sched, arm in ER.SCHEDULE_ARMS.items():
            lr = p.shared if mode == "shared" else FD.c_best_rates(ev, arm, "nvfp4-lora")[0]
            lines.append((arm, lr, SCHEDULE_COLORS[sched], None, sched))
        panels.append((f"NVFP4-LoRA, {mode} lr", lines))
    return _curve_panels(name, ev, panels, "reward", "training reward", "AQN schedules (Fig. 9)", smooth, out_dir)


def entropy_formats(root="results", scale: str = "toy", out_dir=None, ev=None, **_) -> list[Path]:
    """Claim (a): the base model's sampling entropy per format (mean over prompts with its 95% CI; a dot per seed)
    and each format's paired difference from BF16 with its 95% CI and verdict (the findings' numbers)."""
    name = f"evidence_sampling_entropy_{scale}"
    if (ev := _load(root, scale, ev)) is None:
        return skip(name, f"no evidence runs at scale {scale!r}")
    fe = ER.entropy_by_format(ev)
    if not fe:
        return skip(name, f"no finished entropy runs (claim a) at scale {scale}")
    fmts = [f for f in ER.ENTROPY_FORMATS if f in fe] + sorted(set(fe) - set(ER.ENTROPY_FORMATS))
    fig, axes = new_figure(1, 2, sharey=False)
    left, right = axes[0]
    for i, f in enumerate(fmts):
        ci = S.mean_ci(fe[f].per_prompt.to_numpy())
        c = FORMAT_COLORS.get(f.upper(), "#7f7f7f")
        left.errorbar([i], [ci.estimate], yerr=[[ci.estimate - ci.lo], [ci.hi - ci.estimate]], fmt="o", color=c,
                      capsize=4, ms=7)
        left.scatter(np.full(len(fe[f].seed_means), i + 0.15), fe[f].seed_means, color=c, s=12, alpha=0.6)
    left.set_xticks(range(len(fmts)), [f"{f}\n({len(fe[f].seed_means)} seeds)" for f in fmts])
    left.set_ylabel("mean token entropy per prompt")
    left.set_title("per format: 95% CI over prompts; dots: seeds", fontsize=10)
    rows = FD.claim_a_rows(ev, fe)
    done = [r for r in rows if r["verdict"] != "not run"]
    for i, r in enumerate(done):
        c = FORMAT_COLORS.get(r["a"].split("-")[-1].upper(), "#7f7f7f")
        lo, hi = r["ci_lo"], r["ci_hi"]
        right.errorbar([i], [r["effect"]], yerr=[[r["effect"] - lo], [hi - r["effect"]]], fmt="o", color=c,
                       capsize=4, ms=7)
        right.annotate(r["verdict"], (i, hi), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
    right.axhline(0, color="0.3", lw=0.8)
    right.set_xticks(range(len(done)), [r["comparison"].replace(" base", "") for r in done])
    right.set_ylabel("entropy difference")
    right.set_title("paired over prompts, 95% CI", fontsize=10)
    temps = sorted({t for f in fmts for t in fe[f].temperature})
    fig.suptitle(_subtitle(ev, f"Claim (a): sampling entropy of the base model per format — evidence, scale "
                               f"{ev.scale}, T={', '.join(str(t) for t in temps) or '?'}"), fontsize=9)
    return save(fig, out_dir_for(ev.root, out_dir), name, [r for f in fmts for r in fe[f].runs],
                note=f"scale {ev.scale}, paths relative to {ev.root}" + "".join(f"; {n}" for n in ev.notes))


def lr_grid(root="results", scale: str = "toy", out_dir=None, ev=None, **_) -> list[Path]:
    """The learning-rate grid: each arm's seed-0 mean training reward against the rate (log axis), its best rate
    starred, the shared rate dotted."""
    name = f"evidence_lr_grid_{scale}"
    if (ev := _load(root, scale, ev)) is None:
        return skip(name, f"no evidence runs at scale {scale!r}")
    p = ev.protocol
    if not p.grid:
        return skip(name, f"no seed-0 grid runs at scale {scale}")
    fig, axes = new_figure(1, 1, width=7.5, height=4.0)
    ax = axes[0][0]
    for arm in [a for a in ER.ARMS if a in p.grid]:
        lrs = sorted(p.grid[arm])
        # the other schedules get colours of their own: they would all be NVFP4 green otherwise
        color = GRID_SCHEDULE_COLORS.get(arm) or arm_color(arm)
        kw = {"dashes": AQN_DASH, "marker": "s"} if "aqn" in arm else {"marker": "o"}
        ax.plot(lrs, [p.grid[arm][x] for x in lrs], ms=4, color=color, label=ER.LABELS[arm], **kw)
        if arm in p.best:
            ax.plot([p.best[arm]], [p.grid[arm][p.best[arm]]], marker="*", ms=13, color=color, ls="")
    if p.shared is not None:
        ax.axvline(p.shared, color="0.4", ls=":", lw=1)
        ax.text(p.shared, 1.0, f"shared {ER.fmt_lr(p.shared)}", transform=ax.get_xaxis_transform(), fontsize=7,
                ha="center", va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("mean training reward (seed 0, all steps)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    fig.suptitle(_subtitle(ev, f"Learning-rate grid — evidence, scale {ev.scale}: {p.n_settings} settings; "
                               "★ best rate (training reward only)"), fontsize=9)
    grid_dirs = ev.runs[ev.runs["seed"] == 0]["run_dir"]
    return save(fig, out_dir_for(ev.root, out_dir), name, _sources(ev, grid_dirs),
                note=f"scale {ev.scale}, paths relative to {ev.root}" + "".join(f"; {n}" for n in ev.notes))


FIGURES = {"reward": reward_curves, "entropy": entropy_curves, "aqn": aqn_curves, "schedules": schedule_curves,
           "sampling_entropy": entropy_formats, "lr_grid": lr_grid}


def all_figures(root="results", scale: str = "toy", smooth: int = 1, out_dir=None) -> list[Path]:
    """Every evidence figure of ``scale`` (the runs are loaded once); the paths written."""
    ev = ER.load(root, scale)
    if ev is None:
        return skip(f"evidence_{scale}", f"no evidence runs (tags.table: {ER.TABLE}) at scale {scale!r}")
    return [p for fn in FIGURES.values() for p in fn(root, scale, smooth=smooth, out_dir=out_dir, ev=ev)]
