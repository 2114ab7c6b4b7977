"""Tables 1 and 2 of the paper, rendered from ``results/`` with the paper's numbers beside ours.

``render_table1(root, scale)`` / ``render_table2(root, scale)`` write ``<root>/table{1,2}/<scale>/table{1,2}.md`` and
``.csv`` and return ``(markdown, DataFrame)``. One line per paper row, in the paper's order, per paper model.

Columns of the DataFrame (and the CSV), for each column label ``C`` (a paper benchmark such as ``MATH500``, the
paper's ``Average``, or an extra eval set of our runs that the paper has no column for, e.g. ``toy``):

* ``C ours`` — our pass@1 in percent, one decimal, ``mean ± std`` over seeds when there are several, ``—`` if not run;
  ``C ours_mean``, ``C ours_std`` (sample std, ddof 1), ``C n`` (runs averaged), ``C runs`` (their directories);
* ``C ours_delta`` — our mean minus our BF16 base row (``BF16``, no training) of the same paper model;
* ``C paper`` and ``C paper_delta`` — the paper's value and printed delta as printed (``paper/table*.csv``); never
  mixed into ours. Extra eval sets have no paper columns.

Row keys: ``paper_model, weights, training, aqn`` (see ``paper_figures.runs``), a display label ``row``, and
``n_seeds``, ``seeds``, ``runs`` (every run behind the row, relative to the results root).
Our "Average" is the mean of a run's four benchmark scores (only for runs that have all four), then over seeds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from paper_figures import runs as R

PAPER_DIR = Path(__file__).resolve().parent / "paper"
BENCH_SETS = {"GSM8K": "gsm8k", "MATH500": "math500", "AIME24": "aime24", "AIME25": "aime25", "AMC23": "amc23"}
TABLES = {
    "table1": {"benchmarks": ["GSM8K"], "average": False,
               "title": "Table 1: Qwen2.5 performance on GSM8K (GRPO trained on GSM8K)"},
    "table2": {"benchmarks": ["MATH500", "AIME24", "AIME25", "AMC23"], "average": True,
               "title": "Table 2: performance across four benchmarks (DAPO trained on Big-Math)"},
}
DASH = "—"
_SCALE_NOTE = {
    "smoke": "smoke scale proves the plumbing only: a tiny CPU model, a few steps; the numbers are not meaningful "
             "and are not comparable with the paper's.",
    "toy": "toy scale trains a small model built in-project, not the paper's Qwen2.5; compare orderings and "
           "deltas between rows, not absolute values, with the paper.",
}


def paper_table(name: str) -> pd.DataFrame:
    """The paper's numbers as printed (all strings; empty string where the paper prints nothing)."""
    path = PAPER_DIR / f"{name}.csv"
    if not path.exists():
        valid = sorted(p.stem for p in PAPER_DIR.glob("*.csv"))
        raise ValueError(f"no paper table {name!r}; valid: {valid}")
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def row_label(weights: str, training: str, aqn: str) -> str:
    """The paper's W# / Training label: ``NVFP4 LoRA +AQN``, ``BF16 Full``, ``NF4 -``."""
    t = {"none": "-", "full": "Full", "lora": "LoRA"}.get(training, training)
    return f"{weights} {t}" + (" +AQN" if aqn == "yes" else "")


def _pct(v: float) -> str:
    return f"{v:.1f}"


def _signed(v: float) -> str:
    return f"{v:+.1f}"


def _printed_delta(s: str) -> str:
    if s == "":
        return ""
    return s if s.startswith("-") else "+" + s


def _ours_cell(mean: float, std: float, n: int) -> str:
    if n == 0 or mean != mean:
        return DASH
    return _pct(mean) + (f" ± {std:.1f}" if n > 1 and std == std else "")


def _eval_sets(df: pd.DataFrame) -> list[str]:
    """Eval sets with at least one pass@1 value among the runs of ``df``."""
    pat = re.compile(r"^sum\.eval\.(.+)\.pass@1$")
    return [m.group(1) for c in df.columns if (m := pat.match(c)) and df[c].notna().any()]


def render_rows(runs: pd.DataFrame, paper: pd.DataFrame, benchmarks: list[str], average: bool = False,
                models: list[str] | str | None = None, root: str | Path = ".") -> tuple[pd.DataFrame, dict]:
    """Place runs (``paper_figures.runs.all_runs`` rows) into the paper's rows; see the module docstring.

    ``models``: paper models to show (``None``: those with at least one run, or all if none has; ``"all"``).
    Returns the table and ``info`` (``placed``, ``unplaced``, ``unfinished`` run frames, ``labels``, ``extra``)."""
    order = paper[list(R.KEYS[1:])].assign(paper_model=paper["model"])[list(R.KEYS)]
    order = list(dict.fromkeys(map(tuple, order.itertuples(index=False))))
    pcell = {(r.model, r.weights, r.training, r.aqn, r.benchmark): (r.score, r.delta_vs_bf16_base)
             for r in paper.itertuples(index=False)}
    done = runs[runs["finished"]] if not runs.empty else runs
    key_of = {i: tuple(r[k] for k in R.KEYS) for i, r in done.iterrows()}
    placed_idx = [i for i, k in key_of.items() if k in set(order)]
    paper_models = list(dict.fromkeys(k[0] for k in order))
    if models is None:
        with_runs = [m for m in paper_models if any(key_of[i][0] == m for i in placed_idx)]
        models = with_runs or paper_models
    elif models == "all":
        models = paper_models
    else:
        bad = [m for m in models if m not in paper_models]
        if bad:
            raise ValueError(f"paper model(s) {bad} not in this table; valid: {paper_models}")
    placed_idx = [i for i in placed_idx if key_of[i][0] in models]
    placed = done.loc[placed_idx]
    mapped = {BENCH_SETS[b] for b in benchmarks}
    extra = [s for s in _eval_sets(placed) if s not in mapped]
    labels = list(benchmarks) + (["Average"] if average else []) + extra

    def values(sub: pd.DataFrame, label: str) -> pd.Series:  # percent per run, NaN where absent
        if label == "Average":
            cols = [f"sum.eval.{BENCH_SETS[b]}.pass@1" for b in benchmarks]
            if not all(c in sub for c in cols):
                return pd.Series(math.nan, index=sub.index)
            return 100 * sub[cols].astype(float).mean(axis=1, skipna=False)
        col = f"sum.eval.{BENCH_SETS.get(label, label)}.pass@1"
        return 100 * sub[col].astype(float) if col in sub else pd.Series(math.nan, index=sub.index)

    lines, base_mean, mixed = [], {}, []
    for key in order:
        if key[0] not in models:
            continue
        sub = placed.loc[[i for i in placed.index if key_of[i] == key]]
        if len(sub) > 1:
            diff = _differing_config(sub)
            if diff:
                mixed.append(f"{key[0]} {row_label(*key[1:])}: {', '.join(diff)}")
        line = dict(zip(R.KEYS, key, strict=True))
        line["row"] = row_label(*key[1:])
        for c in labels:
            v = values(sub, c).dropna()
            mean = float(v.mean()) if len(v) else math.nan
            std = float(v.std(ddof=1)) if len(v) > 1 else math.nan
            line.update({f"{c} ours": _ours_cell(mean, std, len(v)), f"{c} ours_mean": mean, f"{c} ours_std": std,
                         f"{c} n": len(v), f"{c} runs": ";".join(R.rel(sub.loc[i, "run_dir"], root) for i in v.index)})
            if c not in extra:
                score, delta = pcell.get((*key, c), ("", ""))
                line[f"{c} paper"], line[f"{c} paper_delta"] = score, delta
            if key[1:] == ("BF16", "none", "no"):
                base_mean[(key[0], c)] = mean
        seeds = sorted({str(s) for s in sub.get("cfg.seed", pd.Series(dtype=object)).dropna()})
        line.update(n_seeds=len(sub), seeds=",".join(seeds),
                    runs=";".join(R.rel(d, root) + R.gpus_note(w) for d, w in
                                  zip(sub["run_dir"], sub.get("sum.world_size", [None] * len(sub)), strict=True)))
        lines.append(line)
    for line in lines:
        for c in labels:
            is_base = (line["weights"], line["training"], line["aqn"]) == ("BF16", "none", "no")
            b = base_mean.get((line["paper_model"], c), math.nan)
            line[f"{c} ours_delta"] = math.nan if is_base else line[f"{c} ours_mean"] - b
    cols = list(R.KEYS) + ["row"]
    for c in labels:
        cols += [f"{c} ours", f"{c} ours_mean", f"{c} ours_std", f"{c} n", f"{c} ours_delta"]
        cols += [] if c in extra else [f"{c} paper", f"{c} paper_delta"]
        cols.append(f"{c} runs")
    table = pd.DataFrame(lines, columns=cols + ["n_seeds", "seeds", "runs"])
    unplaced = done.drop(index=placed_idx) if not done.empty else done
    unfinished = runs[~runs["finished"]] if not runs.empty else runs
    return table, {"placed": placed, "unplaced": unplaced, "unfinished": unfinished, "labels": labels,
                   "extra": extra, "models": models, "mixed": mixed}


_SAME_RUN = {"cfg.seed", "cfg.run_name", "cfg.out_dir", "cfg.device", "cfg.tags.row"}


def _differing_config(sub: pd.DataFrame) -> list[str]:
    """Config keys (other than seed, names, paths) whose values differ between the runs averaged into one row."""
    out = []
    for c in sub.columns:
        if c.startswith("cfg.") and c not in _SAME_RUN and not c.startswith("cfg.choices."):
            present = [v for v in sub[c] if v is not None and not (isinstance(v, float) and v != v)]
            vals = {repr(v) for v in present}
            if len(vals) > 1 or (vals and len(present) < len(sub)):
                out.append(c[4:])
    return out


# ------------------------------------------------------------------------------------------------ markdown
def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(out)


def _uniq(df: pd.DataFrame, col: str) -> list[str]:
    if col not in df:
        return []
    out = set()
    for v in df[col]:
        if v is None or (isinstance(v, float) and v != v):
            continue
        out.add(str(int(v)) if isinstance(v, float) and v.is_integer() else str(v))
    return sorted(out)


def _notes(info: dict, scale: str, root: Path) -> list[str]:
    placed = info["placed"]
    notes = []
    used = [f"{m} rows: `{', '.join(_uniq(placed[placed['paper_model'] == m], 'cfg.model.source')) or 'no run'}`"
            for m in info["models"]]
    differs = any(m.lower() not in src.lower() for m in info["models"]
                  for src in _uniq(placed[placed["paper_model"] == m], "cfg.model.source"))
    notes.append(f"**Scale `{scale}`.** Actual model(s): {'; '.join(used)}."
                 + (" These stand in for the paper's models: " + _SCALE_NOTE.get(scale, "the model differs from the "
                    "paper's; see `cfg.model.source`.") if differs else ""))
    data = []
    for train in _uniq(placed, "cfg.data.train"):
        sub = placed[placed.get("cfg.data.train") == train]
        d = f"`{train}` (source {', '.join(_uniq(sub, 'cfg.data.source')) or '?'}"
        lv = _uniq(sub, "cfg.data.levels")
        d += f", levels {', '.join(lv)})" if lv and lv != ["None"] else ")"
        for s in _uniq(sub, "sum.data.stand_in"):
            d += f"; stand-in: {s}"
        data.append(d)
    algo = ", ".join(_uniq(placed[placed["training"] != "none"], "cfg.algo.name")) or "-"
    steps = ", ".join(_uniq(placed[placed["training"] != "none"], "sum.steps")) or "-"
    notes.append(f"**Training data**: {'; '.join(data) or '-'}. Algorithm: {algo}; steps: {steps}.")
    proto = []
    for label in info["labels"]:
        s = BENCH_SETS.get(label, label)
        if label == "Average" or f"sum.eval.{s}.pass@1" not in placed:
            continue
        have = placed[placed[f"sum.eval.{s}.pass@1"].notna()]
        if have.empty:
            continue
        bits = [f"{k} {', '.join(_uniq(have, f'sum.eval.{s}.{k}'))}" for k in
                ("n_problems", "n_samples", "temperature", "top_p", "max_new_tokens") if _uniq(have, f"sum.eval.{s}.{k}")]
        lim = _uniq(have, "cfg.eval.limit")
        proto.append(f"`{s}`" + (f" for {label}" if s != label else "") + ": " + "; ".join(bits)
                     + (f"; limit {', '.join(lim)}" if lim else ""))
    notes.append("**Eval protocol** (pass@1 = mean accuracy over n_samples samples per problem, in %): "
                 + (" · ".join(proto) or "-") + ". The paper: temperature 0.6, top-p 0.95, 4096 tokens, full sets.")
    notes.append("**Columns**: *ours* = mean ± std over seeds (std only with 2+ seeds), (Δ) vs our BF16 base row "
                 "of the same model; *paper* = the paper's number with its printed (Δ), kept as printed (some "
                 "printed deltas are inconsistent; see `paper_figures/paper/README.md`). — = not run.")
    if info["extra"]:
        notes.append("Extra columns " + ", ".join(f"`{e}`" for e in info["extra"]) + " are eval sets of our runs "
                     "with no paper column (ours only).")
    if info["mixed"]:
        notes.append("**Warning**: some rows average runs whose configs differ beyond the seed — "
                     + "; ".join(info["mixed"]))
    for what in ("unplaced", "unfinished"):
        df = info[what]
        if len(df):
            why = ("finished runs that match no paper row shown (check tags.paper_model/weights/training/aqn)"
                   if what == "unplaced" else "unfinished runs (not in the table)")
            notes.append(f"{len(df)} {why}: " + ", ".join(f"`{R.rel(d, root)}`" for d in df["run_dir"]))
    return notes


def to_markdown(table: pd.DataFrame, info: dict, title: str, scale: str, root: str | Path = ".") -> str:
    """Markdown of a ``render_rows`` table: title, notes, the table, and run footnotes."""
    labels, extra = info["labels"], info["extra"]
    header = ["Model", "W#", "Training"]
    for c in labels:
        header += [f"{c} ours (Δ)"] + ([] if c in extra else [f"{c} paper (Δ)"])
    header += ["seeds", "runs"]
    rows, foot = [], []
    for _, r in table.iterrows():
        t = {"none": "-", "full": "Full", "lora": "LoRA"}.get(r["training"], r["training"])
        cells = [str(r["paper_model"]).replace("-Instruct", ""), r["weights"], t + (" +AQN" if r["aqn"] == "yes" else "")]
        for c in labels:
            ours, d = r[f"{c} ours"], r[f"{c} ours_delta"]
            cells.append(ours + (f" ({_signed(d)})" if ours != DASH and d == d else ""))
            if c not in extra:
                p, pd_ = r[f"{c} paper"], _printed_delta(r[f"{c} paper_delta"])
                cells.append((p + (f" ({pd_})" if pd_ else "")) if p else DASH)
        ref = ""
        if r["runs"]:
            foot.append(r["runs"])
            ref = f"[{len(foot)}]"
        cells += [str(r["n_seeds"]) if r["n_seeds"] else DASH, ref]
        rows.append(cells)
    parts = [f"# {title} — ours at scale `{scale}`", ""]
    parts += [f"- {n}" for n in _notes(info, scale, Path(root))] + ["", _md_table(header, rows), ""]
    if foot:
        parts += ["Runs behind each row (relative to the results root):", ""]
        parts += [f"[{i}] " + ", ".join(f"`{d}`" + (f" [{n}" if n else "") for d, _, n in
                                        (x.partition(" [") for x in f.split(";"))) + "  "
                  for i, f in enumerate(foot, 1)]
        parts.append("")
    return "\n".join(parts)


def render_table(name: str, root: str | Path = "results", scale: str = "smoke", models=None,
                 write: bool = True) -> tuple[str, pd.DataFrame]:
    """Render paper table ``name`` (``table1`` | ``table2``) from the runs under ``root`` at ``scale``.
    Writes ``<root>/<name>/<scale>/<name>.md|.csv`` when ``write`` and at least one run was placed (their paths
    are in ``table.attrs["written"]``; empty when nothing was written)."""
    if name not in TABLES:
        raise ValueError(f"no renderer for {name!r}; valid: {sorted(TABLES)}")
    spec, root = TABLES[name], Path(root)
    runs = R.select(R.all_runs(root), table=name, scale=scale)
    table, info = render_rows(runs, paper_table(name), spec["benchmarks"], spec["average"], models, root)
    md = to_markdown(table, info, spec["title"], scale, root)
    table.attrs["written"] = []
    if write and len(info["placed"]):
        out = root / name / scale
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.md").write_text(md)
        table.to_csv(out / f"{name}.csv", index=False)
        table.attrs["written"] = [out / f"{name}.md", out / f"{name}.csv"]
        print(f"[paper_figures] wrote {out / name}.md and .csv ({len(info['placed'])} runs)")
    elif write:
        print(f"[paper_figures] skip {name} at scale {scale}: no finished run of {name} under {root}")
    return md, table


def render_table1(root: str | Path = "results", scale: str = "smoke", models=None, write: bool = True):
    """Table 1 (GSM8K, GRPO): base BF16/NF4/MXFP4/NVFP4, Full, LoRA, NF4/MXFP4/NVFP4 LoRA, NVFP4 LoRA +AQN."""
    return render_table("table1", root, scale, models, write)


def render_table2(root: str | Path = "results", scale: str = "smoke", models=None, write: bool = True):
    """Table 2 (Big-Math, DAPO): MATH500/AIME24/AIME25/AMC23 and Average; base BF16/NVFP4, Full, LoRA, NVFP4 LoRA, +AQN."""
    return render_table("table2", root, scale, models, write)
