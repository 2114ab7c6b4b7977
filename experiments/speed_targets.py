"""Issues 10 and 11's H100 speed targets: each beside the measurement that judges it (``target_rows``), and each
missed one with what limits it (``results/speed/target_limits.toml``, ``missed_targets_table``). Rendered into
``results/speed/speed.md`` by :mod:`experiments.speed`; reads only ``results/speed`` (CSVs and raw runs).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def _read(root: Path, name: str) -> pd.DataFrame | None:
    """A benchmark CSV of ``root``, or None when that benchmark has not been run."""
    p = root / name
    return pd.read_csv(p) if p.exists() else None


def _last_pass(d: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per ``keys``, the row of the last pass of an A/B repeated in one process (``pass`` = 2, 3, ...; the first
    pass's rows have none); ``d`` itself when it has no ``pass`` column."""
    if "pass" not in d:
        return d
    last = d.assign(_p=d["pass"].fillna(1)).sort_values("_p", kind="stable")
    return last.drop_duplicates(keys, keep="last").sort_index().drop(columns=["_p"])


#: The runs issues 10 and 11's layer and rollout targets are judged by: the forward layer rows', the backward's (both
#: session 68's three passes at the installed GEMM and slice tables) and the rollouts' (see :func:`target_rows`).
TARGET_RUNS = ("h100_s68_layers", "h100_s68_layers", "h100_s55_cmp")
#: Issue 10's per-layer targets on the H100 (7B decoder linears, FP4 vs BF16 cuBLAS): (op, M, at least).
LAYER_TARGETS = (("fwd", 32, 2.3), ("fwd", 64, 1.6), ("fwd", 128, 1.15), ("fwd", 256, 0.95), ("fwd", 512, 0.95),
                 ("fwd", 2048, 0.95), ("bwd", 512, 0.95), ("bwd", 2048, 0.95))
#: Issue 11's decode targets on the H100 (256 + 2048 tokens, LoRA r32, tokens/s): (model, weights, batch, at least).
DECODE_TARGETS = (("Qwen2.5-7B-Instruct", "NVFP4", 8, 2600), ("Qwen2.5-7B-Instruct", "MXFP4", 8, 2600),
                  ("Qwen2.5-7B-Instruct", "BF16", 8, 1650), ("Qwen2.5-7B-Instruct", "NVFP4", 2, 700),
                  ("Qwen2.5-14B-Instruct", "NVFP4", 8, 1300), ("Qwen2.5-32B-Instruct", "NVFP4", 8, 800))


def _layer_us(path: Path) -> pd.Series:
    """A ``benchmarks.kernel_bench`` CSV's decoder-layer µs (its ``linear == "layer"`` rows) by (fmt, op, M)."""
    d = pd.read_csv(path)
    return d[d["linear"] == "layer"].set_index(["fmt", "op", "M"])["us"]


def _on_h100(d: pd.DataFrame | None) -> pd.DataFrame | None:
    """The rows of ``d`` measured on an H100 (issue 10's and 11's targets are H100 targets)."""
    return None if d is None or "device" not in d else d[d["device"].astype(str).str.contains("H100")]


def targets_table(root: Path, fwd_run: str, bwd_run: str, roll_run: str) -> str:
    """Issues 10 and 11's H100 targets beside the H100 measurement each is judged by, its run, and whether it is met
    (:func:`target_rows`)."""
    out = ["| issue | target | measured | met | run |", "|---|---|---:|---|---|"]
    for r in target_rows(root, fwd_run, bwd_run, roll_run):
        if r["value"] is None:
            out.append(f"| {r['issue']} | {r['what']} | not measured | — | — |")
        else:
            out.append(f"| {r['issue']} | {r['what']} | {r['text']} | {'yes' if r['met'] else 'no'} | `{r['run']}` |")
    return "\n".join(out) + "\n"


def target_rows(root: Path, fwd_run: str, bwd_run: str, roll_run: str) -> list[dict]:
    """Issues 10 and 11's H100 targets, each as a dict: issue, what (the target's text), bound, value (None: not
    measured), text (the value as the table prints it), met, run. The layer rows come from ``raw/<fwd_run>``
    (forward) and ``raw/<bwd_run>`` (backward; the runs of the installed setting, ``benchmarks.kernel_bench`` CSVs:
    with several passes, one CSV each in subfolders, the mean of each layer's µs over the passes), the rollout rows
    from ``raw/<roll_run>/rollout.csv`` (its last pass), the realistic GRPO step, the 32B step's peak, the 7B resident size and the decode rows from the
    top-level CSVs' H100 rows (the row merged last where several match). Values are not rounded before the
    comparison."""
    rows: list[dict] = []

    def row(issue, what, meets, value, run, fmt="{:.3f}×", bound=None):
        rows.append(dict(issue=issue, what=what, bound=bound, value=value, run=run,
                         text=None if value is None else fmt.format(value),
                         met=None if value is None else bool(meets(value))))

    layer = {}
    for op, run in (("fwd", fwd_run), ("bwd", bwd_run)):
        passes = [_layer_us(p) for p in sorted((root / "raw" / run).rglob("layers_*.csv"))]
        if passes:  # several passes (one CSV each, in subfolders): the mean of each layer's µs over them
            mean = pd.concat(passes, axis=1).mean(axis=1)
            layer.update({(o, f, m): (us, run) for (f, o, m), us in mean.items() if o == op})
    for fmt in ("nvfp4", "mxfp4"):
        for op, m, bound in LAYER_TARGETS:
            bf, fp = layer.get((op, "bf16", m)), layer.get((op, f"{fmt}-kernel", m))
            row(10, f"7B layer {fmt.upper()} {op} M = {m}: ≥ {bound}× BF16", lambda v, t=bound: v >= t,
                None if bf is None or fp is None else bf[0] / fp[0], fp[1] if fp else "", bound=bound)
    roll = _read(root / "raw" / roll_run, "rollout.csv")
    if roll is not None:
        roll = _last_pass(roll, ["model", "batch_size", "weights"])
    for n in (64, 128):
        v = None
        if roll is not None:
            g = roll[roll.batch_size == n].set_index("weights").tokens_per_s
            v = g["NVFP4"] / g["BF16"] if {"NVFP4", "BF16"} <= set(g.index) else None
        row(10, f"7B rollout, {n} sequences: NVFP4 ≥ 1.3× BF16-LoRA", lambda v: v >= 1.3, v, roll_run, bound=1.3)
    h100 = _on_h100(_read(root, "step.csv"))
    v, run = None, ""
    if h100 is not None and "group_size" in h100:
        real = h100[(h100.model == "Qwen2.5-7B-Instruct") & (h100.batch_size == 128) & (h100.group_size == 8)
                    & (h100.new_tokens == 1024)
                    & (h100.gc.astype(str) == "True") & (h100.status == "ok")]
        nv, bf = real[real.weights == "NVFP4"], real[real.weights == "BF16"]
        if len(nv) and len(bf):  # the last NVFP4 row against BF16-LoRA of its own run where it has one
            nv = nv.iloc[-1]
            bf = bf[bf.run == nv.run] if (bf.run == nv.run).any() else bf
            v, run = bf.iloc[-1].step_s / nv.step_s, nv.run
    row(10, "realistic GRPO step (7B, 16 × G 8): NVFP4 faster than BF16-LoRA", lambda v: v > 1.0, v, run, bound=1.0)
    v, run = None, ""
    if h100 is not None:
        big = h100[(h100.model == "Qwen2.5-32B-Instruct") & (h100.weights == "NVFP4") & (h100.status == "ok")]
        big = big[big["layout"] == "kernel"] if "layout" in big else big
        if len(big):
            v, run = float(big.iloc[-1].peak_mem_gb), big.iloc[-1].run
    row(10, "32B NVFP4 GRPO step peak < 45 GB", lambda v: v < 45.0, v, run, "{:.1f} GB", bound=45.0)
    mem, v, run = _on_h100(_read(root, "memory.csv")), None, ""
    if mem is not None and "layout" in mem:
        r = mem[(mem.model == "Qwen2.5-7B-Instruct") & (mem.weights == "NVFP4") & (mem["layout"] == "kernel")]
        if len(r):
            v, run = float(r.iloc[-1].model_size_gb), r.iloc[-1].run
    row(10, "7B NVFP4 resident weights (kernel layout) ≤ 5.9 GB", lambda v: v <= 5.9, v, run, "{:.2f} GB", bound=5.9)
    rolls = _on_h100(_read(root, "rollout.csv"))
    for model, w, b, bound in DECODE_TARGETS:
        v, run = None, ""
        if rolls is not None:
            r = rolls[(rolls.model == model) & (rolls.weights == w) & (rolls.batch_size == b) & (rolls.lora_rank == 32)
                      & (rolls.prompt_len == 256) & (rolls.new_tokens == 2048) & (rolls.decode == "fused")]
            if len(r):
                v, run = float(r.iloc[-1].tokens_per_s), r.iloc[-1].run
        row(11, f"{model.split('-')[0]}-{model.split('-')[1]} {w} batch {b}: ≥ {bound} tok/s",
            lambda v, t=bound: v >= t, v, run, "{:.0f}", bound=bound)
    return rows


def target_limits(path: Path) -> list[dict]:
    """The entries of ``target_limits.toml`` (``[[limit]]`` tables of name, match, limit, evidence); a missing key or
    an unknown one is an error naming the entry."""
    import tomllib

    entries = tomllib.loads(path.read_text())["limit"]
    keys = {"name", "match", "limit", "evidence"}
    for i, e in enumerate(entries):
        if set(e) != keys:
            raise ValueError(f"{path}: limit entry {i + 1} ({e.get('match', '?')!r}) has keys {sorted(e)}; "
                             f"expected {sorted(keys)}")
    return entries


def _limits_or_none(root: Path) -> list[dict]:
    """``root/target_limits.toml``'s entries, none where the file is absent (a results folder without it renders
    every missed target as "not analysed")."""
    path = root / "target_limits.toml"
    return target_limits(path) if path.exists() else []


def missed_targets_table(rows: list[dict], limits: list[dict]) -> str:
    """Each target of ``rows`` (:func:`target_rows`) that is measured and not met: its value, how far it is from its
    bound (in % of the bound: a ratio's shortfall negative, a size over a below-bound positive) and the name of what
    limits it (the one ``limits`` entry whose ``match`` finds the target's text; "not analysed" where none does); then
    each named limit once, with the measurements that show it. Two entries matching one missed target is an error."""
    import re

    out = ["| issue | target | measured | gap | what limits it |", "|---|---|---:|---:|---|"]
    used: list[dict] = []
    for r in rows:
        if r["met"] is not False:
            continue
        hits = [e for e in limits if re.search(e["match"], r["what"])]
        if len(hits) > 1:
            raise ValueError(f"target {r['what']!r}: {len(hits)} limit entries match it "
                             f"({', '.join(repr(e['match']) for e in hits)}); one is allowed")
        if hits and hits[0] not in used:
            used.append(hits[0])
        name = hits[0]["name"] if hits else "not analysed"
        out.append(f"| {r['issue']} | {r['what']} | {r['text']} | {(r['value'] / r['bound'] - 1) * 100:+.1f}% | "
                   f"{name} |")
    if len(out) == 2:
        return "_every measured target is met_\n"
    out.append("")
    for e in used:
        out.append(f"- **{e['name']}.** {' '.join(e['limit'].split())} *Evidence:* {e['evidence']}.")
    return "\n".join(out) + "\n"
