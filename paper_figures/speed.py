"""Speed figures (Fig. 1 / Fig. 11-style bars) from the benchmark CSVs under ``<root>/speed/`` (any depth).

Each CSV is classified by its columns (names are matched case-insensitively, first alias found wins):

* a **rollout** CSV has a throughput column — ``tokens_per_s`` | ``tok_per_s`` | ``tokens_s`` | ``tok_s`` |
  ``rollout_tokens_per_s`` | ``throughput_tokens_per_s`` | ``throughput`` — and optionally
  ``model`` | ``preset`` | ``model_name``; ``method`` (``LoRA`` | ``QLoRA`` | ``QeRL`` | …);
  ``weights`` | ``fmt`` | ``format`` | ``quant``; ``batch_size`` | ``batch`` | ``bs``; ``lora_rank`` | ``rank``.
  Repeated rows of one configuration are averaged (bars show mean ± sd).
* a **layer** CSV has ``time_ms`` and ``m`` | ``M`` | ``tokens`` and optionally ``model``, ``fmt`` | ``weights``,
  ``ratio_vs_bf16`` (plotted when present, else ``time_ms``) and ``direction`` | ``pass`` (fwd / bwd: line style).

``speed_rollout`` (Fig. 1 / Tables 5–8: tokens/s per method × batch size, at the most common LoRA rank),
``speed_rank`` (Fig. 11 / Table 9: tokens/s per LoRA rank, at the smallest batch) and ``speed_layers`` (per-layer
time vs M per format) draw ours in the top row and, where the model size matches, the paper's numbers
(``paper/rollout_speed.csv``, ``paper/table9.csv``; vLLM on one H100) in a second row, on their own y scale.
Colours: the base format (``FORMAT_COLORS``). Missing files or columns: a message and no figure.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import seaborn as sns

from paper_figures.figures import out_dir_for, skip
from paper_figures.style import FORMAT_COLORS, FORMAT_ORDER, METHOD_FORMAT, new_figure, save
from paper_figures.tables import paper_table

ALIASES = {
    "tok_s": ["tokens_per_s", "tok_per_s", "tokens_s", "tok_s", "rollout_tokens_per_s", "throughput_tokens_per_s",
              "throughput"],
    "model": ["model", "preset", "model_name"],
    "method": ["method"],
    "weights": ["weights", "fmt", "format", "quant"],
    "batch": ["batch_size", "batch", "bs"],
    "rank": ["lora_rank", "rank"],
    "m": ["m", "tokens"],
    "time_ms": ["time_ms"],
    "ratio": ["ratio_vs_bf16"],
    "direction": ["direction", "pass", "op"],
}


def _canon(df: pd.DataFrame) -> pd.DataFrame:
    """Rename the first alias found of each known column to its canonical name (case-insensitive)."""
    lower = {c.lower(): c for c in df.columns}
    ren = {}
    for canon, names in ALIASES.items():
        hit = next((lower[n] for n in names if n in lower), None)
        if hit is not None and canon not in ren.values():
            ren[hit] = canon
    return df.rename(columns=ren)


def speed_csvs(root) -> dict[str, list[tuple[Path, pd.DataFrame]]]:
    """``{"rollout": [(path, frame)], "layer": [...]}`` for every CSV under ``<root>/speed``.

    ``speed/raw/`` (per-session logs and CSVs, already merged into the top-level CSVs) and ``step.csv`` (whose
    ``rollout_tokens_per_s`` is an in-training figure, not a rollout benchmark) are not read, nor the rows of a
    CSV whose ``bench`` column names another benchmark (``scaling``), nor, for the layer figure, the kernel
    comparisons that time several paths per linear (a ``path`` column: their sum would mix kernels)."""
    out = {"rollout": [], "layer": []}
    for p in sorted((Path(root) / "speed").rglob("*.csv")):
        if "raw" in p.relative_to(Path(root) / "speed").parts[:-1] or p.name == "step.csv":
            continue
        try:
            df = _canon(pd.read_csv(p))
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
            print(f"[paper_figures] ignoring {p}: {e}")
            continue
        if "bench" in df:  # qerl.bench rows say what they measured: scaling.csv's tokens/s are training steps
            df = df[df["bench"] == "rollout"] if "tok_s" in df else df
        if "tok_s" in df:
            if len(df):
                out["rollout"].append((p, df))
        elif ("time_ms" in df or ("us" in df and "linear" in df)) and "m" in df and "path" not in df:
            out["layer"].append((p, df))  # one time per linear and M (a "path" CSV compares kernels side by side)
    return out


def model_size(name) -> str:
    """``Qwen2.5-7B-Instruct`` / ``preset:qwen2.5-7b`` → ``7B``; the name itself when it has no size."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])", str(name))
    return f"{m.group(1)}B" if m else str(name)


def _size_key(name) -> tuple:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)B", str(name))
    return (0, float(m.group(1)), "") if m else (1, 0.0, str(name))


def _label(method, weights) -> str:
    w = str(weights).upper() if weights == weights and weights is not None else ""
    if method == method and method is not None and str(method):
        return f"{method} ({w})" if w else str(method)
    return {"BF16": "LoRA (BF16)", "NF4": "QLoRA (NF4)", "NVFP4": "QeRL (NVFP4)"}.get(w, f"{w} LoRA")


def _color(label: str) -> str:
    m = re.search(r"\((\w+)\)", label)
    w = m.group(1) if m else METHOD_FORMAT.get(label.split()[0], label.split()[0])
    return FORMAT_COLORS.get(w, "#7f7f7f")


def _prep(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["model"] = df["model"].map(model_size) if "model" in df else ""
    df["label"] = [_label(m, w) for m, w in zip(df.get("method", pd.Series(None, index=df.index)),
                                                 df.get("weights", pd.Series(None, index=df.index)), strict=True)]
    return df


def _order(labels) -> list[str]:
    def key(s):
        w = re.search(r"\((\w+)\)", s)
        w = w.group(1) if w else s
        return (FORMAT_ORDER.index(w) if w in FORMAT_ORDER else 99, s)
    return sorted(set(labels), key=key)


def _bars(name: str, ours: pd.DataFrame, paper: pd.DataFrame, x: str, xlabel: str, title: str, sources,
          root, out_dir) -> list[Path]:
    models = sorted(ours["model"].unique(), key=_size_key)
    paper = paper[paper["model"].isin(models)] if len(paper) else paper
    rows = [("ours", ours)] + ([("paper (vLLM, H100)", paper)] if len(paper) else [])
    fig, axes = new_figure(len(rows), len(models), sharey=False)
    labels = _order(list(ours["label"]) + list(paper["label"] if len(paper) else []))
    pal = {lab: _color(lab) for lab in labels}
    for i, (who, df) in enumerate(rows):
        for j, model in enumerate(models):
            ax, sub = axes[i][j], df[df["model"] == model]
            if sub.empty:
                ax.set_visible(False)
                continue
            sns.barplot(data=sub, x=x, y="tok_s", hue="label", hue_order=[h for h in labels if h in set(sub["label"])],
                        palette=pal, errorbar="sd", ax=ax)
            ax.set_title(f"{who} · {model}", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("rollout tokens/s")
            if ax.get_legend() is not None:
                sns.move_legend(ax, "best", title=None, fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save(fig, out_dir_for(root, out_dir), name, sources)


def _paper_rollout() -> pd.DataFrame:
    p = paper_table("rollout_speed")
    p = p[(p["metric"] == "rollout_throughput") & (p["value"] != "")]
    return _prep(pd.DataFrame({"model": p["model"], "method": p["method"], "weights": p["weights"],
                               "batch": p["batch_size"].astype(int), "tok_s": p["value"].astype(float)}))


def _paper_rank() -> pd.DataFrame:
    p = paper_table("table9")
    return _prep(pd.DataFrame({"model": p["model"], "method": p["weights"].map({"BF16": "LoRA", "NVFP4": "QeRL"}),
                               "weights": p["weights"], "rank": p["lora_rank"].astype(int),
                               "tok_s": p["rollout_throughput_tokens_per_s"].astype(float)}))


def current_decode(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the sampler's current decode step: where a model has ``decode == "fused"`` rows, only those;
    otherwise its rows as they are (older CSVs have no ``decode`` column, or only "unfused")."""
    if "decode" not in df:
        return df
    fused_models = set(df.loc[df["decode"] == "fused", "model"])
    return df[(df["decode"] == "fused") | ~df["model"].isin(fused_models)]


def one_machine(df: pd.DataFrame, key=("model", "label", "batch", "rank")) -> tuple[pd.DataFrame, str]:
    """Ours on one GPU model, one measurement a bar: the rows of the paper's GPU (an H100) where a ``device`` column
    names one, else of the device with the most rows; per model and batch one length, the one most formats were
    measured at (ties: the paper's 2048 new tokens, else the longest), so the bars of a group compare like with like;
    per ``key`` the row merged last (the top-level CSV keeps one row per configuration and layout). Returns the rows
    and a title note naming the device and the lengths."""
    note = []
    if "device" in df and df["device"].notna().any():
        dev = df["device"].astype(str)
        pick = "H100" if dev.str.contains("H100").any() else dev.value_counts().idxmax()
        df = df[dev.str.contains(pick, regex=False)]
        note.append(df["device"].iloc[0] if pick == "H100" else pick)
    key = [k for k in key if k in df]
    group = [k for k in ("model", "batch") if k in df]
    if "new_tokens" in df and group:
        by = [*group, "new_tokens"]
        formats = (df.groupby(by, dropna=False)["label"].transform("nunique") if "label" in df
                   else df.groupby(by, dropna=False)["new_tokens"].transform("size"))
        order = df.assign(_f=formats, _p=df["new_tokens"] == 2048).sort_values(["_f", "_p", "new_tokens"], kind="stable")
        best = order.groupby(group, dropna=False)["new_tokens"].transform("last").reindex(df.index)
        df = df[df["new_tokens"] == best]
        lengths = df.groupby("new_tokens")["batch"].agg(lambda b: sorted(set(int(x) for x in b))) \
            if "batch" in df else None
        if lengths is not None and len(lengths):
            note.append("; ".join(f"{int(n)} new tokens at batch {', '.join(map(str, b))}" for n, b in lengths.items()))
    if key:
        df = df.groupby(key, dropna=False, sort=False).tail(1)
    return df, (" · " + ", ".join(note)) if note else ""


def _rollout_frame(root):
    found = speed_csvs(root)["rollout"]
    if not found:
        return None, []
    return _prep(current_decode(pd.concat([df for _, df in found], ignore_index=True))), [str(p) for p, _ in found]


def speed_rollout(root="results", out_dir=None) -> list[Path]:
    """Fig. 1 / Tables 5–8: rollout tokens/s per method (format) and batch size, ours beside the paper's."""
    df, sources = _rollout_frame(root)
    if df is None:
        return skip("speed_rollout", f"no rollout CSV (with a tokens/s column) under {Path(root) / 'speed'}")
    if "batch" not in df:
        df["batch"] = 1
    df = df[df["batch"].notna()].assign(batch=lambda x: x["batch"].astype(int))
    note = ""
    if "rank" in df and df["rank"].nunique() > 1:
        r = df["rank"].value_counts().sort_index().idxmax()
        df, note = df[df["rank"] == r], f", LoRA rank {int(r)}"
    df, machine = one_machine(df)
    note += machine
    return _bars("speed_rollout", df, _paper_rollout(), "batch", "batch size (prompts)",
                 f"Rollout throughput per format and batch size{note} (Fig. 1 / Tables 5–8)", sources, root, out_dir)


def speed_rank(root="results", out_dir=None) -> list[Path]:
    """Fig. 11 / Table 9: rollout tokens/s per LoRA rank, ours beside the paper's."""
    df, sources = _rollout_frame(root)
    if df is None or "rank" not in df or df["rank"].nunique() < 2:
        return skip("speed_rank", f"no rollout CSV with a LoRA-rank sweep under {Path(root) / 'speed'}")
    note = ""
    if "batch" in df:
        b = df["batch"].min()
        df, note = df[df["batch"] == b], f",\nours at batch {int(b)}, the paper's at batch 1"
    df, machine = one_machine(df)
    note += machine.replace(" · ", "\n")  # a one-model figure is narrow: one part a line
    # only the (model, format) pairs that were swept over ranks
    swept = df.groupby(["model", "label"])["rank"].transform("nunique") > 1
    if swept.any():
        df = df[swept]
    if "run" in df and df["run"].nunique() > 1:  # a rank re-measured later replaced its row: say whose each bar is
        runs = df.groupby("rank")["run"].agg(lambda r: ", ".join(sorted(set(map(str, r)))))
        note += "\nruns (rank: run): " + "; ".join(f"{int(k)}: {v}" for k, v in runs.items())
    return _bars("speed_rank", df, _paper_rank(), "rank", "LoRA rank",
                 f"Rollout throughput per LoRA rank (Fig. 11 / Table 9){note}", sources, root, out_dir)


def speed_layers(root="results", out_dir=None) -> list[Path]:
    """Per-layer W4A16 kernel time vs M per format (``ratio_vs_bf16`` when present, else ``time_ms``)."""
    found = speed_csvs(root)["layer"]
    if not found:
        return skip("speed_layers", f"no layer CSV (time_ms, m) under {Path(root) / 'speed'}")
    df = pd.concat([d for _, d in found], ignore_index=True)
    df["model"] = df["model"].map(model_size) if "model" in df else ""
    df["weights"] = df["weights"].astype(str).str.upper() if "weights" in df else "?"
    if "us" in df and "linear" in df:  # benchmarks.kernel_bench rows: one per linear -> decoder-layer sums
        keys = ["model", "weights", "m"] + (["direction"] if "direction" in df else [])
        lay = df.groupby(keys, as_index=False)["us"].sum()
        bf = lay[lay["weights"] == "BF16"].drop(columns="weights").rename(columns={"us": "bf16_us"})
        lay = lay.merge(bf, on=[k for k in keys if k != "weights"], how="left")
        lay["ratio"] = lay["us"] / lay["bf16_us"]
        lay["time_ms"] = lay["us"] / 1e3
        df = lay
    y = "ratio" if "ratio" in df and df["ratio"].notna().any() else "time_ms"
    models = sorted(df["model"].unique(), key=_size_key)
    fig, axes = new_figure(1, len(models), sharey=False)
    order = [w for w in FORMAT_ORDER if w in set(df["weights"])] + sorted(set(df["weights"]) - set(FORMAT_ORDER))
    for ax, model in zip(axes[0], models, strict=True):
        sub = df[df["model"] == model]
        sns.lineplot(data=sub, x="m", y=y, hue="weights", hue_order=[w for w in order if w in set(sub["weights"])],
                     style="direction" if "direction" in sub else None, marker="o", errorbar="sd",
                     palette={w: FORMAT_COLORS.get(w, "#7f7f7f") for w in order}, ax=ax)
        ax.set_xscale("log", base=2)
        if y == "time_ms":
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="0.4", lw=0.8, ls=":")
        ax.set_title(str(model), fontsize=10)
        ax.set_xlabel("M (tokens in the batch)")
        ax.set_ylabel("time / BF16 time" if y == "ratio" else "time (ms)")
    fig.suptitle("Linear-layer time per format\n(mean ± sd over the CSV's layers and repeats; "
                 f"{', '.join(p.name for p, _ in found)})", fontsize=9)
    return save(fig, out_dir_for(root, out_dir), "speed_layers", [str(p) for p, _ in found])
