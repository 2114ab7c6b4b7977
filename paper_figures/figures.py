"""Training-curve figures of the paper from ``results/`` (mean ± 95% t-interval band over seeds, no band for a
single seed; PNG + PDF).

Every function takes the results ``root``, an ``experiment`` (a ``cfg.experiment`` value such as ``fig4/smoke``, or
a list of them: the first that has runs is used; default: the figure's own experiment at ``scale`` and then the
table whose runs the paper's figure came from), an optional ``smooth`` window (a rolling mean over steps of each
run, before averaging over seeds) and ``out_dir`` (default ``<root>/figures``). It writes
``<out_dir>/<name>.png``, ``.pdf`` and ``.runs.txt`` (the run directories it used) and returns those paths, or
prints why it skipped and returns ``[]`` when its runs or metrics are absent. ``<name>`` is ``fig4_smoke`` etc.

Metrics read (``metrics.jsonl``): ``rewards/accuracy/mean`` (falls back to ``reward``), ``entropy`` (training
policy, noiseless; ``metric="sampling_entropy"`` for the sampler's), ``sigma`` (AQN stage marks in Fig. 8).
Config keys read: ``quant.format`` / ``tags.weights``, ``lora.enabled`` / ``tags.training``, ``lora.rank``,
``aqn.enabled`` / ``tags.aqn``, ``aqn.schedule``, ``algo.name``, ``optim.lr``, ``tags.paper_model``, ``seed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import seaborn as sns

from paper_figures import runs as R
from paper_figures.stats import Band, curve_band
from paper_figures.style import AQN_DASHES, FORMAT_ORDER, SCHEDULE_COLORS, format_color, new_figure, save

REWARD = ("rewards/accuracy/mean", "reward")
BAND_NOTE = "mean ± 95% CI (t) over seeds; one seed: no band"


def skip(name: str, why: str) -> list:
    """Say why a figure was not made; return the empty list of written paths."""
    print(f"[paper_figures] skip {name}: {why}")
    return []


def out_dir_for(root, out_dir) -> Path:
    return Path(out_dir) if out_dir is not None else Path(root) / "figures"


def series_label(run: pd.Series, rank: bool = True) -> str:
    """``NVFP4 LoRA r32 +AQN``, ``BF16 Full``: the format/training/AQN of a run, as a legend label."""
    if run["training"] == "full":
        s = f"{run['weights']} Full"
    elif run["training"] == "none":
        s = f"{run['weights']} base"
    else:
        r = run.get("cfg.lora.rank")
        s = f"{run['weights']} LoRA" + (f" r{int(r)}" if rank and r == r and r is not None else "")
    return s + (" +AQN" if run["aqn"] == "yes" else "")


def _sort_key(run: pd.Series):
    full = run["training"] == "full"
    w = "Full" if full else str(run["weights"])
    return (FORMAT_ORDER.index(w) if w in FORMAT_ORDER else 99, run["aqn"] == "yes")


def find_runs(root, experiments: str | Sequence[str]) -> tuple[pd.DataFrame, str | None]:
    """Runs (with metrics) of the first experiment in ``experiments`` that has any; and that experiment."""
    df = R.all_runs(root)
    for e in [experiments] if isinstance(experiments, str) else experiments:
        sel = R.select(df, experiments=e)
        sel = sel[[(Path(d) / "metrics.jsonl").exists() for d in sel["run_dir"]]] if len(sel) else sel
        if len(sel):
            return sel, e
    return df.iloc[0:0], None


def _smooth(m: pd.DataFrame, y: str, window: int) -> pd.DataFrame:
    m = m.sort_values(["run_dir", "step"])
    if window and window > 1:
        m[y] = m.groupby("run_dir")[y].transform(lambda s: s.rolling(window, min_periods=1).mean())
    return m


def group_bands(m: pd.DataFrame, ycol: str, keys: Sequence[str], level: float = 0.95) -> dict[tuple, Band]:
    """Per group of ``keys`` values, the band over its runs (``run_dir``) of ``ycol`` vs ``step``: mean and the
    ``level`` t interval at each step (``paper_figures.stats.curve_band``; no interval where one run has the step)."""
    out = {}
    for key, sub in m.groupby(list(keys), sort=False):
        key = key if isinstance(key, tuple) else (key,)
        out[key] = curve_band([(g["step"].to_numpy(), g[ycol].to_numpy()) for _, g in sub.groupby("run_dir")], level)
    return out


def plot_band(ax, band: Band, color, label: str, dashes=None) -> None:
    """The mean line and, where at least two runs have the step, its confidence band (same colour, translucent)."""
    kw = {"dashes": dashes} if dashes else {}
    ax.plot(band.x, band.mean, color=color, label=label, lw=1.4, **kw)
    if (band.n >= 2).any():
        ax.fill_between(band.x, band.lo, band.hi, where=band.n >= 2, color=color, alpha=0.2, lw=0)


def seeds_label(counts) -> str:
    """``n=3`` or ``n=1–3``: how many runs (seeds) stand behind a line."""
    lo, hi = min(counts), max(counts)
    return f"n={lo}" if lo == hi else f"n={lo}–{hi}"


def curves(name: str, root, experiments, y: Sequence[str], hue: Callable[[pd.Series], str], *,
           palette: Callable[[pd.DataFrame, list], dict] | None = None, row: Callable | None = None,
           col: Callable | None = None, style: Callable | None = None, smooth: int = 1, ylabel: str = "",
           title: str = "", out_dir=None, sigma_marks: bool = False, hue_order: Callable | None = None) -> list[Path]:
    """Generic curve figure: one line per ``hue(run)`` value (mean over its runs ± 95% t interval band, no band
    for a single run), panels by ``row(run)`` × ``col(run)``, dashes by ``style(run)``. ``y``: metric
    candidates, first present is used."""
    runs, exp = find_runs(root, experiments)
    if runs.empty:
        return skip(name, f"no runs with metrics for experiment(s) {experiments!r} under {root}")
    m = R.metrics(runs["run_dir"])
    ycol = next((c for c in y if c in m and m[c].notna().any()), None)
    if ycol is None:
        return skip(name, f"none of the metrics {list(y)} in the runs of {exp}")
    runs = runs.assign(_hue=[hue(r) for _, r in runs.iterrows()],
                       _row=[row(r) if row else "" for _, r in runs.iterrows()],
                       _col=[col(r) if col else "" for _, r in runs.iterrows()],
                       _style=[style(r) if style else "" for _, r in runs.iterrows()])
    m = _smooth(m[["run_dir", "step", ycol] + (["sigma"] if sigma_marks and "sigma" in m else [])].dropna(
        subset=[ycol]), ycol, smooth).merge(runs[["run_dir", "_hue", "_row", "_col", "_style"]], on="run_dir")
    order = hue_order(runs) if hue_order else list(dict.fromkeys(
        runs.assign(_k=[_sort_key(r) for _, r in runs.iterrows()]).sort_values("_k")["_hue"]))
    pal = palette(runs, order) if palette else dict(zip(order, sns.color_palette(n_colors=len(order)), strict=True))
    styles = [s for s in AQN_DASHES if s in set(m["_style"])] if style else []
    bands = group_bands(m, ycol, ["_row", "_col", "_hue", "_style"])
    n_runs = runs.groupby(["_row", "_col", "_hue", "_style"]).size()
    rows, cols = sorted(runs["_row"].unique()), sorted(runs["_col"].unique())
    fig, axes = new_figure(len(rows), len(cols))
    for i, rv in enumerate(rows):
        for j, cv in enumerate(cols):
            ax, sub = axes[i][j], m[(m["_row"] == rv) & (m["_col"] == cv)]
            if sub.empty:
                ax.set_visible(False)
                continue
            for h in [h for h in order if h in set(sub["_hue"])]:
                own = sorted(set(sub.loc[sub["_hue"] == h, "_style"]), key=lambda v: (v not in styles, v))
                for st in own:
                    # the legend says how many runs stand behind a line, over every panel it appears in
                    n = seeds_label(n_runs.xs((h, st), level=("_hue", "_style")))
                    label = f"{h}, {st} ({n})" if len(set(runs.loc[runs["_hue"] == h, "_style"])) > 1 else f"{h} ({n})"
                    plot_band(ax, bands[(rv, cv, h, st)], pal[h], label,
                              AQN_DASHES.get(st) if len(styles) > 1 else None)
            if sigma_marks and "sigma" in sub:
                _mark_stages(ax, sub)
            ax.set_title(" · ".join(str(v) for v in (rv, cv) if v), fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel or ycol)
            if i == 0 and j == len(cols) - 1:
                ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"{title}\n{exp}: {len(runs)} runs, {seeds_label(n_runs)} per line\n{BAND_NOTE}"
                 + (f", smoothed over {smooth} steps" if smooth and smooth > 1 else ""), fontsize=9)
    sources = [R.rel(d, root) + R.gpus_note(w) + ("" if f else "  (unfinished)") for d, f, w in
               zip(runs["run_dir"], runs["finished"], runs.get("sum.world_size", [None] * len(runs)), strict=True)]
    return save(fig, out_dir_for(root, out_dir), name, sources, note=f"experiment {exp}, paths relative to {root}")


def _mark_stages(ax, sub: pd.DataFrame) -> None:
    """Vertical lines where the AQN σ changes (stage boundaries Z¹, Z², …) in the first run with noise."""
    noisy = sub[sub["sigma"].fillna(0) > 0]
    if noisy.empty:
        return
    s = sub[sub["run_dir"] == noisy["run_dir"].iloc[0]].sort_values("step")
    change = s[s["sigma"].ne(s["sigma"].shift()) & s["sigma"].gt(0)]
    for k, step in enumerate(change["step"], 1):
        ax.axvline(step, color="0.5", lw=0.8, ls=":")
        ax.text(step, 1.0, f"Z{k}", transform=ax.get_xaxis_transform(), fontsize=7, ha="center", va="bottom")


def _format_palette(runs: pd.DataFrame, order: list) -> dict:
    first = runs.drop_duplicates("_hue").set_index("_hue")
    return {h: format_color(first.loc[h, "weights"], first.loc[h, "training"] == "full") for h in order}


def _seq_palette(runs: pd.DataFrame, order: list) -> dict:
    return dict(zip(order, sns.color_palette("viridis", len(order)), strict=True))


def _model(r: pd.Series) -> str:
    m = r["paper_model"]
    return "" if m is None or (isinstance(m, float) and m != m) else str(m)


def _aqn_style(r: pd.Series) -> str:
    return "AQN on" if r["aqn"] == "yes" else "AQN off"


# ------------------------------------------------------------------------------------------------ the figures
def fig4(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None) -> list[Path]:
    """Fig. 4: accuracy reward vs step per format (NVFP4/MXFP4/NF4/BF16 LoRA, BF16 Full); rows DAPO / GRPO.
    Default runs: ``fig4/<scale>``, else the trained runs of ``table1/<scale>``."""
    return curves(f"fig4_{scale}", root, experiment or [f"fig4/{scale}", f"table1/{scale}"], REWARD, series_label,
                  palette=_format_palette, row=lambda r: str(r.get("cfg.algo.name", "")).upper(), col=_model,
                  style=_aqn_style, smooth=smooth, ylabel="accuracy reward", title="Fig. 4: reward per format",
                  out_dir=out_dir)


def fig5(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None,
         metric: str = "entropy") -> list[Path]:
    """Fig. 5: entropy vs step per format. ``metric``: ``entropy`` (training policy, noiseless — what the official
    code logs) or ``sampling_entropy`` (the sampler's, with AQN noise). Default runs: ``fig5/<scale>``, then
    ``fig4/<scale>``, then ``table1/<scale>``."""
    name = f"fig5_{scale}" + ("" if metric == "entropy" else f"_{metric}")
    return curves(name, root, experiment or [f"fig5/{scale}", f"fig4/{scale}", f"table1/{scale}"], [metric],
                  series_label, palette=_format_palette, row=lambda r: str(r.get("cfg.algo.name", "")).upper(),
                  col=_model, style=_aqn_style, smooth=smooth, ylabel=metric.replace("_", " "),
                  title=f"Fig. 5: {metric.replace('_', ' ')} per format", out_dir=out_dir)


def fig14(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None,
          metric: str = "entropy") -> list[Path]:
    """Fig. 14: entropy over RL steps, QeRL vs LoRA (paper: 14B on Big-Math). Default runs: ``fig14/<scale>``,
    else the trained runs of ``table2/<scale>``."""
    name = f"fig14_{scale}" + ("" if metric == "entropy" else f"_{metric}")
    return curves(name, root, experiment or [f"fig14/{scale}", f"table2/{scale}"], [metric], series_label,
                  palette=_format_palette, col=_model, style=_aqn_style, smooth=smooth,
                  ylabel=metric.replace("_", " "), title=f"Fig. 14: {metric.replace('_', ' ')}", out_dir=out_dir)


def fig7(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None) -> list[Path]:
    """Fig. 7: accuracy reward on Big-Math, Full vs QeRL vs LoRA. Default runs: ``fig7/<scale>``, else ``table2``."""
    return curves(f"fig7_{scale}", root, experiment or [f"fig7/{scale}", f"table2/{scale}"], REWARD, series_label,
                  palette=_format_palette, col=_model, style=_aqn_style, smooth=smooth, ylabel="accuracy reward",
                  title="Fig. 7: reward (Big-Math)", out_dir=out_dir)


def fig8(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None) -> list[Path]:
    """Fig. 8: AQN ablation, reward with vs without AQN (same format colour, dashed = AQN on); dotted lines mark
    the steps where σ changes stage. Default runs: ``fig8/<scale>``."""
    return curves(f"fig8_{scale}", root, experiment or [f"fig8/{scale}"], REWARD, series_label,
                  palette=_format_palette, col=_model, style=_aqn_style, smooth=smooth, ylabel="accuracy reward",
                  title="Fig. 8: AQN on/off", out_dir=out_dir, sigma_marks=True)


def _schedule(r: pd.Series) -> str:
    return str(r.get("cfg.aqn.schedule", "none")) if r["aqn"] == "yes" else "none"


def fig9(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None) -> list[Path]:
    """Fig. 9: reward per AQN decay schedule (``aqn.schedule``: linear/exponential/cosine/logarithmic; runs
    without AQN as ``none``). Default runs: ``fig9/<scale>``."""
    order = lambda runs: [s for s in SCHEDULE_COLORS if s in set(runs["_hue"])] + sorted(  # noqa: E731
        set(runs["_hue"]) - set(SCHEDULE_COLORS))
    pal = lambda runs, order: {h: SCHEDULE_COLORS.get(h, "#333333") for h in order}  # noqa: E731
    return curves(f"fig9_{scale}", root, experiment or [f"fig9/{scale}"], REWARD, _schedule, palette=pal,
                  col=_model, smooth=smooth, ylabel="accuracy reward", title="Fig. 9: AQN schedules",
                  out_dir=out_dir, hue_order=order)


def fig10(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None) -> list[Path]:
    """Fig. 10: reward per LoRA rank (``lora.rank``), one panel per format series. Default runs: ``fig10/<scale>``."""
    rank = lambda r: f"rank {int(r['cfg.lora.rank'])}"  # noqa: E731
    order = lambda runs: sorted(set(runs["_hue"]), key=lambda s: int(s.split()[-1]))  # noqa: E731
    return curves(f"fig10_{scale}", root, experiment or [f"fig10/{scale}"], REWARD, rank, palette=_seq_palette,
                  col=lambda r: series_label(r, rank=False), smooth=smooth, ylabel="accuracy reward",
                  title="Fig. 10: LoRA rank", out_dir=out_dir, hue_order=order)


def _lr(r: pd.Series) -> str:
    return f"lr {float(r['cfg.optim.lr']):.0e}"


def _lr_curves(name: str, fig: str, root, experiment, scale, smooth, out_dir) -> list[Path]:
    order = lambda runs: sorted(set(runs["_hue"]), key=lambda s: float(s.split()[-1]))  # noqa: E731
    return curves(f"{fig}_{scale}", root, experiment or [f"{fig}/{scale}"], REWARD, _lr, palette=_seq_palette,
                  col=lambda r: series_label(r), smooth=smooth, ylabel="accuracy reward",
                  title=f"{name}: learning rate", out_dir=out_dir, hue_order=order)


def fig16(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None) -> list[Path]:
    """Fig. 16: QeRL at two learning rates (``optim.lr``; paper 3e-5 vs 5e-6); one panel per format series, so
    an experiment holding both the QeRL and the LoRA runs draws Fig. 16 and 17 side by side."""
    return _lr_curves("Fig. 16", "fig16", root, experiment, scale, smooth, out_dir)


def fig17(root="results", experiment=None, scale: str = "smoke", smooth: int = 1, out_dir=None) -> list[Path]:
    """Fig. 17: BF16 LoRA at two learning rates (the paper's 3e-5 run is unstable). Default runs: ``fig17/<scale>``."""
    return _lr_curves("Fig. 17", "fig17", root, experiment, scale, smooth, out_dir)


def fig15(root="results", out_dir=None, path: str | Path | None = None) -> list[Path]:
    """Fig. 15: σ vs stage for each schedule, from ``<root>/fig15/schedules.csv`` (columns ``schedule, mode,
    stage, step, sigma``; one panel per ``mode``)."""
    path = Path(path) if path else Path(root) / "fig15" / "schedules.csv"
    if not path.exists():
        return skip("fig15", f"{path} not found (written by the fig15 experiment)")
    df = pd.read_csv(path)
    need = {"schedule", "stage", "sigma"}
    if not need <= set(df.columns):
        return skip("fig15", f"{path} lacks columns {sorted(need - set(df.columns))}")
    if "mode" not in df:
        df["mode"] = ""
    df = df.drop_duplicates(["schedule", "mode", "stage"]).sort_values(["schedule", "mode", "stage"])
    modes = sorted(df["mode"].astype(str).unique())
    fig, axes = new_figure(1, len(modes))
    for ax, mode in zip(axes[0], modes, strict=True):
        sub = df[df["mode"].astype(str) == mode]
        order = [s for s in SCHEDULE_COLORS if s in set(sub["schedule"])] + sorted(
            set(sub["schedule"]) - set(SCHEDULE_COLORS))
        sns.lineplot(data=sub, x="stage", y="sigma", hue="schedule", hue_order=order, marker="o", ax=ax,
                     palette={s: SCHEDULE_COLORS.get(s, "#333333") for s in order})
        ax.set_title(f"mode: {mode}" if mode else "", fontsize=10)
        ax.set_ylabel("σ")
    fig.suptitle("Fig. 15: AQN noise level per stage", fontsize=10)
    return save(fig, out_dir_for(root, out_dir), "fig15", [str(path)])
