"""The evidence findings table: per scale and claim, the measured effect, its 95% interval and a verdict, computed
from the run directories under ``results/evidence/<scale>/`` alone (``write_findings(root, scale)`` writes
``findings.md`` and ``findings.csv`` there).

The runs, the learning-rate protocol and ``best_lr`` are in ``paper_figures.evidence_runs``.

Comparisons ``A − B`` (direction +: the claim says A is higher):

* (a) sampling entropy of the base model in NVFP4 / MXFP4 (NF4 reported too) minus BF16, paired over prompts (each
  prompt's entropy averaged over the seeds first);
* (b) NVFP4-LoRA − BF16-LoRA, NVFP4-LoRA − NF4-LoRA, MXFP4-LoRA − BF16-LoRA, NVFP4-LoRA − BF16-Full (reference):
  at the shared rate (not for BF16-Full, which has its own grid) and each arm at its own best rate;
* (c) NVFP4+AQN − NVFP4, the control BF16+AQN − BF16-LoRA, and each other AQN schedule − NVFP4: at the shared
  rate and at the rate best for B (the arm without AQN), so that only the noise differs (A falls back to its own
  best rate, said in the row's note, when it has no runs at B's);

with the metrics reward AUC (``stats.curve_auc``: the mean training reward over the steps), final reward (the
mean over the last 10% of steps, at least one) and held-out pass@1 per eval set; Welch t intervals over seeds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from paper_figures import stats as S
from paper_figures.evidence_runs import (
    ARMS,
    ENTROPY_FORMATS,
    LABELS,
    SCHEDULE_ARMS,
    TABLE,
    Evidence,
    FormatEntropy,
    entropy_by_format,
    fmt_lr,
    load,
)

LEVEL = 0.95
LEARNABLE = (0.10, 0.60)  # the target band for the BF16 base's pass@1 at the rollout temperature

CLAIM_B = [("nvfp4-lora", "bf16-lora", ""), ("nvfp4-lora", "nf4-lora", ""), ("mxfp4-lora", "bf16-lora", ""),
           ("nvfp4-lora", "bf16-full", "reference")]
CLAIM_C = [("nvfp4-lora-aqn", "nvfp4-lora", "exponential schedule"), ("bf16-lora-aqn", "bf16-lora", "control"),
           *[(arm, "nvfp4-lora", f"{s} schedule") for s, arm in SCHEDULE_ARMS.items() if s != "exponential"]]
CLAIMS = {"a": "quantized sampling has higher entropy than BF16",
          "b": "NVFP4-LoRA learns faster and ends higher than BF16-LoRA and NF4-LoRA",
          "c": "AQN adds to NVFP4-LoRA (and the control: does any noise help BF16-LoRA?)"}
COLUMNS = ["scale", "claim", "comparison", "a", "b", "lr_mode", "lr_a", "lr_b", "metric", "mean_a", "mean_b",
           "effect", "ci_lo", "ci_hi", "n_a", "n_b", "n_pairs", "test", "p", "p_holm", "verdict", "note"]



def claim_a_rows(ev: Evidence, fe: dict[str, FormatEntropy]) -> list[dict]:
    """Claim (a)'s rows: NVFP4, MXFP4 (and NF4, reported) minus BF16, paired over the prompts both have."""
    rows = []
    for fmt in ("nvfp4", "mxfp4", "nf4"):
        base = {"scale": ev.scale, "claim": "a", "comparison": f"{fmt.upper()} − BF16 base", "a": f"base-{fmt}",
                "b": "base-bf16", "lr_mode": "-", "metric": "sampling entropy",
                "note": "reported; the claim names NVFP4 and MXFP4" if fmt == "nf4" else ""}
        if fmt not in fe or "bf16" not in fe:
            miss = [f for f in (fmt, "bf16") if f not in fe]
            rows.append(dict(base, verdict="not run", note=f"not run: no finished entropy runs for {miss}"))
            continue
        a, b = fe[fmt].per_prompt, fe["bf16"].per_prompt
        ids = a.index.intersection(b.index)
        ci = S.paired_diff_ci(a[ids].to_numpy(), b[ids].to_numpy(), LEVEL)
        rows.append(dict(base, mean_a=float(a[ids].mean()), mean_b=float(b[ids].mean()), effect=ci.estimate,
                         ci_lo=ci.lo, ci_hi=ci.hi, n_a=len(fe[fmt].seed_means), n_b=len(fe["bf16"].seed_means),
                         n_pairs=ci.n, test="paired t over prompts (entropy averaged over seeds)", p=ci.p,
                         verdict=S.verdict(ci.lo, ci.hi, +1)))
    return rows


def learnability(ev: Evidence, fe: dict[str, FormatEntropy]) -> dict:
    """The BF16 base's pass@1 at the claim-(a) sampling temperature, mean and interval over seeds."""
    row = {"scale": ev.scale, "claim": "learnability", "comparison": "BF16 base pass@1", "a": "base-bf16",
           "b": "", "lr_mode": "-", "metric": "pass@1 (training distribution)", "verdict": "-"}
    if "bf16" not in fe or not fe["bf16"].pass1:
        return dict(row, note="not run: no finished BF16 entropy run with a pass@1")
    ci = S.mean_ci(fe["bf16"].pass1, LEVEL)
    t = ", ".join(str(x) for x in fe["bf16"].temperature) or "?"
    inside = LEARNABLE[0] <= ci.estimate <= LEARNABLE[1]
    return dict(row, metric=f"pass@1 at T={t}", mean_a=ci.estimate, effect=ci.estimate, ci_lo=ci.lo, ci_hi=ci.hi,
                n_a=ci.n, test="t interval over seeds",
                note=f"{'within' if inside else 'outside'} the {LEARNABLE[0]:.0%}–{LEARNABLE[1]:.0%} target")


RL_ARMS = ("bf16-lora", "nf4-lora", "mxfp4-lora", "nvfp4-lora")


def rl_works_rows(ev: Evidence) -> list[dict]:
    """Does RL raise held-out accuracy? Each LoRA arm at the shared rate (every seed) against its own untrained base
    in the same format (stage ``base``, evaluated like the trained runs' end-of-run evaluation), per eval set.

    effect = mean over seeds of trained pass@1 − base pass@1, with the t interval over seeds (the base taken as
    fixed); the issue's criterion is that the gain exceeds the seed-to-seed spread (``spread``: the seeds' sample
    standard deviation). verdict: supported when the interval lies above 0 and the gain exceeds the spread,
    contradicted when the interval lies below 0, else inconclusive."""
    rows, shared = [], ev.protocol.shared
    for arm in RL_ARMS:
        fmt = arm.split("-")[0]
        runs = ev.at(arm, shared)
        for st in ev.eval_sets:
            row = {"scale": ev.scale, "claim": "rl", "comparison": f"{LABELS[arm]} − {fmt.upper()} base",
                   "a": arm, "b": f"heldout-{fmt}", "lr_mode": "shared", "lr_a": shared, "metric": f"pass@1 {st}",
                   "n_a": len(runs)}
            base = ev.heldout[(ev.heldout["fmt"] == fmt) & (ev.heldout["set"] == st)] if len(ev.heldout) else []
            if runs.empty or len(base) == 0:
                miss = [x for x, e in ((f"{arm} at lr {fmt_lr(shared)}", runs.empty),
                                       (f"heldout-{fmt} on {st}", len(base) == 0)) if e]
                rows.append(dict(row, verdict="not run", note="not run: no finished " + " nor ".join(miss)))
                continue
            b = float(base["pass@1"].mean())
            va = ev.values.loc[runs["run_dir"], f"pass@1 {st}"].to_numpy(dtype=float)
            ci = S.mean_ci(va - b, LEVEL)
            spread = float(np.std(va, ddof=1)) if len(va) > 1 else math.nan
            if ci.n < 2:
                verdict, note = "inconclusive", "one seed: no interval, no spread"
            elif ci.lo > 0 and ci.estimate > spread:
                verdict, note = "supported", f"gain {ci.estimate:.3f} > seed spread (sd) {spread:.3f}"
            elif ci.hi < 0:
                verdict, note = "contradicted", f"seed spread (sd) {spread:.3f}"
            else:
                verdict, note = "inconclusive", f"gain {ci.estimate:.3f} vs seed spread (sd) {spread:.3f}"
            rows.append(dict(row, mean_a=float(np.mean(va)), mean_b=b, effect=ci.estimate, ci_lo=ci.lo, ci_hi=ci.hi,
                             n_a=ci.n, n_b=len(base), test="t interval over seeds (base fixed)", p=ci.p,
                             verdict=verdict, note=note))
    return rows


# ------------------------------------------------------------------------------------------------ claims (b), (c)
def run_metrics(ev: Evidence) -> list[str]:
    """The per-run metrics compared in claims (b) and (c)."""
    return ["reward AUC", "final reward"] + [f"pass@1 {s}" for s in ev.eval_sets]


def _welch_rows(ev: Evidence, claim: str, a: str, b: str, mode: str, lr_a, lr_b, note: str) -> list[dict]:
    ra, rb = ev.at(a, lr_a), ev.at(b, lr_b)
    base = {"scale": ev.scale, "claim": claim, "comparison": f"{LABELS[a]} − {LABELS[b]}", "a": a, "b": b,
            "lr_mode": mode, "lr_a": lr_a, "lr_b": lr_b, "n_a": len(ra), "n_b": len(rb)}
    if ra.empty or rb.empty:
        miss = [f"{arm} at lr {fmt_lr(lr)}" for arm, lr, r in ((a, lr_a, ra), (b, lr_b, rb)) if r.empty]
        why = "not run: no finished runs of " + " nor ".join(miss)
        return [dict(base, metric=m, verdict="not run", note=why) for m in run_metrics(ev)]
    rows = []
    for m in run_metrics(ev):
        va, vb = ev.values.loc[ra["run_dir"], m].to_numpy(), ev.values.loc[rb["run_dir"], m].to_numpy()
        ci = S.welch_diff_ci(va, vb, LEVEL)
        notes = [note] if note else []
        if min(ci.n) == 0:
            rows.append(dict(base, metric=m, verdict="not run", note="; ".join(notes + [f"no {m} in these runs"])))
            continue
        if min(ci.n) < 2:
            notes.append("one seed on a side: no interval")
        rows.append(dict(base, metric=m, mean_a=float(np.nanmean(va)), mean_b=float(np.nanmean(vb)),
                         effect=ci.estimate, ci_lo=ci.lo, ci_hi=ci.hi, n_a=ci.n[0], n_b=ci.n[1],
                         test="Welch t over seeds", p=ci.p, verdict=S.verdict(ci.lo, ci.hi, +1),
                         note="; ".join(notes)))
    return rows


def grid_gaps(ev: Evidence, *arms: str) -> str:
    """A note when an arm's best rate comes from a partial grid: the planned rates it has no finished run at."""
    p, gaps = ev.protocol, []
    for arm in dict.fromkeys(arms):
        missing = [lr for lr in p.planned.get(arm, []) if lr not in p.grid.get(arm, {})]
        if missing:
            gaps.append(f"{arm} at {', '.join(fmt_lr(x) for x in missing)}")
    return f"best rate provisional: no finished grid run of {'; '.join(gaps)}" if gaps else ""


def _claim_b(ev: Evidence) -> list[dict]:
    """Each pair at the shared rate and at each arm's best rate. Where both best rates are the shared rate, the
    best-rate comparison is the same runs: one row, said in its note (not counted twice in the Holm correction)."""
    best, shared, rows = ev.protocol.best, ev.protocol.shared, []
    for a, b, note in CLAIM_B:
        gaps = grid_gaps(ev, a, b)
        same = best.get(a) == best.get(b) == shared
        if "bf16-full" not in (a, b):  # BF16-Full has its own grid: no shared-rate comparison
            extra = "also each arm's best rate" if same else ""
            rows += _welch_rows(ev, "b", a, b, "shared", shared, shared,
                                "; ".join(x for x in (note, extra, gaps if same else "") if x))
        if not same:
            rows += _welch_rows(ev, "b", a, b, "best", best.get(a), best.get(b),
                                "; ".join(x for x in (note, gaps) if x))
    return rows


def c_best_rates(ev: Evidence, a: str, b: str) -> tuple[float | None, float | None, str]:
    """Claim (c)'s best-rate pair (lr_a, lr_b, note): both at B's best rate, so that only the noise differs; A at
    its own best rate (said in the note) when it has no runs at B's."""
    best = ev.protocol.best
    lr_b = best.get(b)
    if ev.at(a, lr_b).empty and best.get(a) is not None and best[a] != lr_b:
        return best[a], lr_b, f"{a} has no runs at {b}'s best rate: at its own best"
    return lr_b, lr_b, ""


def _claim_c(ev: Evidence) -> list[dict]:
    rows = []
    for a, b, note in CLAIM_C:
        rows += _welch_rows(ev, "c", a, b, "shared", ev.protocol.shared, ev.protocol.shared, note)
        lr_a, lr_b, why = c_best_rates(ev, a, b)
        rows += _welch_rows(ev, "c", a, b, "best", lr_a, lr_b,
                            "; ".join(x for x in (note, why, grid_gaps(ev, b)) if x))
    return rows


def findings_frame(ev: Evidence, fe: dict[str, FormatEntropy] | None = None) -> pd.DataFrame:
    """Every row of the findings (columns ``COLUMNS``), Holm-adjusted p within each claim."""
    fe = entropy_by_format(ev) if fe is None else fe
    df = pd.DataFrame([learnability(ev, fe), *rl_works_rows(ev), *claim_a_rows(ev, fe), *_claim_b(ev),
                       *_claim_c(ev)])
    df = df.reindex(columns=COLUMNS)
    df["p_holm"] = np.nan
    for claim in ("a", "b", "c"):
        sel = df["claim"] == claim
        df.loc[sel, "p_holm"] = S.holm(df.loc[sel, "p"].astype(float).to_numpy())
    df["note"] = df["note"].fillna("")
    return df


# ------------------------------------------------------------------------------------------------ writing
def _num(x, signed: bool = False, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    x = round(float(x), digits) + 0.0  # no "-0.000"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _digits(lo: float, hi: float) -> int:
    """Decimals that resolve an interval: 3, or more when it is narrower than 0.01 (a tiny but nonzero effect must
    not print as "+0.000 [+0.000, +0.000]"), at most 6."""
    width = abs(hi - lo)
    return 3 if not width or width >= 0.01 else min(6, 1 - math.floor(math.log10(width)))


def _effect(r: pd.Series) -> str:
    if r["verdict"] == "not run":
        return "—"
    if r["ci_lo"] != r["ci_lo"]:
        return _num(r["effect"], True) + " [no interval]"
    d = _digits(r["ci_lo"], r["ci_hi"])
    return f"{_num(r['effect'], True, d)} [{_num(r['ci_lo'], True, d)}, {_num(r['ci_hi'], True, d)}]"


def _p(x) -> str:
    return "—" if x is None or x != x else (f"{x:.3f}" if x >= 0.001 else "<0.001")


def _lr_cell(r: pd.Series) -> str:
    if r["lr_mode"] == "-":
        return "—"
    same = r["lr_a"] == r["lr_b"] or (r["lr_a"] != r["lr_a"] and r["lr_b"] != r["lr_b"])
    return f"{r['lr_mode']} {fmt_lr(r['lr_a'])}" + ("" if same else f" / {fmt_lr(r['lr_b'])}")


def _n(x) -> str:
    return "—" if x is None or x != x else str(int(x))


def _claim_table(df: pd.DataFrame) -> list[str]:
    """Claim (a): one line per comparison with both sides' means."""
    out = ["| comparison (A − B) | metric | A | B | effect [95% CI] | n A/B | p | p Holm | verdict | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        n = f"{_n(r['n_a'])}/{_n(r['n_b'])}" + (f" ({_n(r['n_pairs'])} prompts)" if r["n_pairs"] == r["n_pairs"] else "")
        out.append(f"| {r['comparison']} | {r['metric']} | {_num(r['mean_a'])} | {_num(r['mean_b'])} | {_effect(r)} "
                   f"| {n} | {_p(r['p'])} | {_p(r['p_holm'])} | {_verdict(r['verdict'])} | {r['note']} |")
    return out


def _verdict(v: str) -> str:
    return f"**{v}**" if v in ("supported", "contradicted") else v


def _cell(r: pd.Series) -> str:
    if r["verdict"] == "not run":
        return "not run"
    return (f"{_num(r['mean_a'])} vs {_num(r['mean_b'])}<br>{_effect(r)}<br>{_verdict(r['verdict'])}"
            f" (Holm p {_p(r['p_holm'])})")


def _wide_table(df: pd.DataFrame) -> list[str]:
    """Claims (b), (c): one line per comparison and rate mode, one column per metric (A vs B means, effect
    [95% CI], verdict and Holm-adjusted p)."""
    metrics = list(dict.fromkeys(df["metric"]))
    out = ["| comparison (A − B) | lr A / B | n A/B | " + " | ".join(metrics) + " | note |",
           "|---|---|---|" + "---|" * len(metrics) + "---|"]
    for (comp, _mode), g in df.groupby(["comparison", "lr_mode"], sort=False):
        g = g.set_index("metric")
        first = g.iloc[0]
        cells = [_cell(g.loc[m]) if m in g.index else "" for m in metrics]
        notes = "; ".join(dict.fromkeys(n for n in g["note"] if n))
        out.append(f"| {comp} | {_lr_cell(first)} | {_n(first['n_a'])}/{_n(first['n_b'])} | " + " | ".join(cells)
                   + f" | {notes} |")
    return out


def _protocol_md(ev: Evidence) -> list[str]:
    p = ev.protocol
    rates = sorted({lr for g in p.grid.values() for lr in g} | {lr for v in p.planned.values() for lr in v})
    out = ["## Learning-rate protocol", "",
           "Grid: each arm's seed-0 run per rate, scored by its mean training reward over all steps (held-out data "
           "is never used to choose). **Bold**: the arm's best rate (ties go to the lower rate); · : planned in "
           "protocol.json but no finished run.", ""]
    if rates:
        out += ["| arm | " + " | ".join(fmt_lr(x) for x in rates) + " | best |",
                "|---|" + "---|" * (len(rates) + 1)]
        for arm in [a for a in ARMS if a in p.grid or a in p.planned]:
            cells = []
            for lr in rates:
                s = p.grid.get(arm, {}).get(lr)
                cells.append(("**{:.3f}**" if lr == p.best.get(arm) else "{:.3f}").format(s) if s is not None
                             else "·" if lr in p.planned.get(arm, []) else "")
            out.append(f"| {arm} | " + " | ".join(cells) + f" | {fmt_lr(p.best.get(arm))} |")
        out.append("")
    seeds = ", ".join(str(s) for s in p.seeds)
    out += [f"- shared rate (all LoRA arms): **{fmt_lr(p.shared)}**, from {p.shared_source}; BF16-Full appears only "
            "in the best-rate comparisons (its own grid).",
            f"- seeds: {seeds}; settings tried: {p.n_settings} grid settings (arm × rate, seed 0), "
            f"{p.n_runs} finished trained runs in all.",
            "- claim (b) `best`: each arm at its own best rate; claim (c) `best`: both arms at the best rate of B "
            "(the arm without AQN), so only the noise differs."]
    out += [f"- protocol.json `{k}`: {json.dumps(v)}" for k, v in p.extra.items()]
    return out + [""]


def _entropy_md(ev: Evidence, fe: dict[str, FormatEntropy]) -> list[str]:
    if not fe:
        return []
    out = ["| format | seeds | prompts | mean entropy [95% CI over prompts] | pass@1 [95% CI over seeds] | T |",
           "|---|---|---|---|---|---|"]
    for fmt in [f for f in ENTROPY_FORMATS if f in fe] + sorted(set(fe) - set(ENTROPY_FORMATS)):
        e = fe[fmt]
        ci, pc = S.mean_ci(e.per_prompt.to_numpy(), LEVEL), S.mean_ci(e.pass1, LEVEL)
        out.append(f"| {fmt} | {len(e.seed_means)} | {len(e.per_prompt)} | {_num(ci.estimate)} [{_num(ci.lo)}, "
                   f"{_num(ci.hi)}] | {_num(pc.estimate)} [{_num(pc.lo)}, {_num(pc.hi)}] "
                   f"| {', '.join(str(t) for t in e.temperature)} |")
    return out + [""]


HOW_TO_READ = """## How to read this

- effect = mean(A) − mean(B); the claim says it is positive. Claims (b), (c): Welch t interval over seeds (each
  seed one number per run: its reward AUC, i.e. the mean training reward over the steps by the trapezoid rule;
  its final reward, the mean over the last 10% of steps; its held-out pass@1 at the end). Claim (a): paired t
  interval over prompts of the per-prompt sampling entropy (each prompt's entropy averaged over the seeds first;
  seeds differ only in sampling), so its interval reflects prompt-to-prompt variation.
- verdict: **supported** when the 95% interval lies above 0, **contradicted** when it lies below 0,
  inconclusive when it contains 0 (or there is no interval: one seed on a side); *not run* when an arm or rate is
  missing. A verdict holds at this scale only.
- multiple comparisons: the verdicts use the unadjusted 95% intervals, one comparison at a time, because each row
  answers its own question (a rate mode, a metric). With many rows per claim a few false verdicts are expected by
  chance (about 1 in 20 rows where there is no effect), so the `p Holm` column gives the Holm–Bonferroni adjusted
  p-value within the claim's rows: a verdict whose Holm p is above 0.05 does not survive the correction for all of
  the claim's comparisons.
"""


def findings_markdown(ev: Evidence, df: pd.DataFrame, fe: dict[str, FormatEntropy] | None = None) -> str:
    """The findings of one scale as markdown: model note, learnability, the lr protocol, a table per claim."""
    fe = entropy_by_format(ev) if fe is None else fe
    lines = [f"# Evidence findings: scale `{ev.scale}`", "",
             f"Computed by `python -m paper_figures` (`paper_figures/findings.py`) from the finished runs under "
             f"`{TABLE}/{ev.scale}/` ({len(ev.runs)} trained, {len(ev.entropy)} entropy runs); nothing here is "
             "written by hand.", ""]
    lines += [f"> **Model:** {n}" for n in ev.notes] + ([""] if ev.notes else [])
    learn = df[df["claim"] == "learnability"].iloc[0]
    if learn["effect"] == learn["effect"]:
        lines += [f"**Learnability.** {learn['comparison']} ({learn['metric']}, from the claim-(a) runs): "
                  f"{_num(learn['effect'])} [95% CI {_num(learn['ci_lo'])}, {_num(learn['ci_hi'])}] over "
                  f"{_n(learn['n_a'])} seeds; {learn['note']}.", ""]
    else:
        lines += [f"**Learnability.** {learn['note']}.", ""]
    rl = df[df["claim"] == "rl"]
    if len(rl):
        lines += ["## RL works: held-out pass@1 after RL vs the untrained base (each LoRA arm at the shared rate)", "",
                  "| comparison (A − B) | metric | A (trained) | B (base) | gain [95% CI] | seeds | verdict | note |",
                  "|---|---|---|---|---|---|---|---|"]
        for _, r in rl.iterrows():
            lines.append(f"| {r['comparison']} | {r['metric']} | {_num(r.get('mean_a'))} | {_num(r.get('mean_b'))} | "
                         f"{_effect(r)} | {_n(r['n_a'])} | {_verdict(r['verdict'])} | {r['note']} |")
        lines.append("")
    lines += _protocol_md(ev)
    for claim, text in CLAIMS.items():
        lines += [f"## Claim ({claim}): {text}", ""]
        if claim == "a":
            lines += _entropy_md(ev, fe)
        table = _claim_table if claim == "a" else _wide_table
        lines += table(df[df["claim"] == claim]) + [""]
    if ev.unfinished:
        lines += ["Unfinished runs, left out: " + ", ".join(f"`{u}`" for u in ev.unfinished), ""]
    return "\n".join(lines) + "\n" + HOW_TO_READ


def findings(root, scale: str) -> tuple[str, pd.DataFrame] | None:
    """(markdown, rows) of one scale's evidence, or None when it has no evidence runs."""
    ev = load(root, scale)
    if ev is None:
        return None
    fe = entropy_by_format(ev)
    df = findings_frame(ev, fe)
    return findings_markdown(ev, df, fe), df


def write_findings(root="results", scale: str = "toy") -> list[Path]:
    """Write ``<root>/evidence/<scale>/findings.md`` and ``findings.csv``; return their paths ([] and a printed
    reason when the scale has no evidence runs)."""
    got = findings(root, scale)
    if got is None:
        print(f"[paper_figures] skip findings_{scale}: no evidence runs (tags.table: {TABLE}) at scale {scale!r}")
        return []
    md, df = got
    out = Path(root) / TABLE / scale
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "findings.md", out / "findings.csv"]
    paths[0].write_text(md)
    df.to_csv(paths[1], index=False, float_format="%.6g")
    return paths
