"""The evidence findings table: per scale and claim, the measured effect, its 95% interval and a verdict, computed
from the run directories under ``results/evidence/<scale>/`` alone (``write_findings(root, scale)`` writes
``findings.md`` and ``findings.csv`` there).

Runs read (``tags.table: evidence``, ``scale``):

* trained runs ``<arm>-lr<lr>-s<seed>/`` (``tags.arm`` one of ``ARMS``; ``optim.lr``; ``seed``): the training
  reward curve (``metrics.jsonl``: ``rewards/accuracy/mean``, else ``reward``, per run) and ``summary.json``
  ``eval.<set>.pass@1``;
* claim-(a) runs ``entropy-<fmt>-s<seed>/`` (``summary.kind: entropy``): ``entropy.jsonl`` (per prompt: ``id``,
  ``entropy``, ``correct``) and the summary's ``pass@1`` and ``temperature``;
* ``protocol.json`` (optional): ``{"shared_lr": x, "grid": {arm: [rates]}, "seeds": [...], ...}``.

Learning-rate protocol (``Protocol``): an arm's grid is its seed-0 runs; its best rate is ``best_lr`` (the highest
mean training reward over all steps, ties to the lower rate; held-out data is never read); the shared rate comes
from ``protocol.json`` or, without one, is the median of the LoRA arms' grid rates (the lower middle one of an even
count, so that it is a rate that was run). Only finished runs count.

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from paper_figures import runs as R
from paper_figures import stats as S
from qerl.errors import UserError
from qerl.results import read_jsonl

TABLE = "evidence"
FORMAT_ARMS = ("bf16-full", "bf16-lora", "nf4-lora", "mxfp4-lora", "nvfp4-lora")
AQN_ARMS = ("nvfp4-lora-aqn", "bf16-lora-aqn", "nvfp4-lora-aqn-linear", "nvfp4-lora-aqn-cosine",
            "nvfp4-lora-aqn-logarithmic")
ARMS = FORMAT_ARMS + AQN_ARMS
LORA_ARMS = tuple(a for a in ARMS if a != "bf16-full")
SCHEDULE_ARMS = {"exponential": "nvfp4-lora-aqn", "linear": "nvfp4-lora-aqn-linear",
                 "cosine": "nvfp4-lora-aqn-cosine", "logarithmic": "nvfp4-lora-aqn-logarithmic"}
ENTROPY_FORMATS = ("bf16", "nf4", "mxfp4", "nvfp4")
REWARD = ("rewards/accuracy/mean", "reward")
FINAL_FRACTION = 0.10
LEVEL = 0.95
LEARNABLE = (0.10, 0.60)  # the issue's target band for the BF16 base's pass@1 at the rollout temperature

CLAIM_B = [("nvfp4-lora", "bf16-lora", ""), ("nvfp4-lora", "nf4-lora", ""), ("mxfp4-lora", "bf16-lora", ""),
           ("nvfp4-lora", "bf16-full", "reference")]
CLAIM_C = [("nvfp4-lora-aqn", "nvfp4-lora", "exponential schedule"), ("bf16-lora-aqn", "bf16-lora", "control"),
           *[(arm, "nvfp4-lora", f"{s} schedule") for s, arm in SCHEDULE_ARMS.items() if s != "exponential"]]
CLAIMS = {"a": "quantized sampling has higher entropy than BF16",
          "b": "NVFP4-LoRA learns faster and ends higher than BF16-LoRA and NF4-LoRA",
          "c": "AQN adds to NVFP4-LoRA (and the control: does any noise help BF16-LoRA?)"}
COLUMNS = ["scale", "claim", "comparison", "a", "b", "lr_mode", "lr_a", "lr_b", "metric", "mean_a", "mean_b",
           "effect", "ci_lo", "ci_hi", "n_a", "n_b", "n_pairs", "test", "p", "p_holm", "verdict", "note"]


def fmt_lr(lr) -> str:
    """``2e-4``, ``2.5e-4``: a learning rate as people write it; ``—`` when there is none."""
    if lr is None or (isinstance(lr, float) and math.isnan(lr)):
        return "—"
    return np.format_float_scientific(float(lr), trim="-", exp_digits=1)


def _lr_key(lr) -> float:
    """Rates compared as numbers that survived a YAML round trip (6 significant digits)."""
    return float(f"{float(lr):.6g}")


# ------------------------------------------------------------------------------------------------ loading
@dataclass
class Protocol:
    """The learning-rate protocol as run: ``grid`` arm -> {rate: seed-0 mean training reward}, ``best`` arm ->
    rate, ``shared`` rate and where it came from, the ``planned`` grid and ``seeds`` of protocol.json, the number of
    grid settings tried (arm × rate) and of trained runs, and the rest of protocol.json (``extra``)."""
    grid: dict[str, dict[float, float]]
    best: dict[str, float]
    shared: float | None
    shared_source: str
    planned: dict[str, list[float]] = field(default_factory=dict)
    seeds: list = field(default_factory=list)
    n_settings: int = 0
    n_runs: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class Evidence:
    """Every finished evidence run of one scale: ``runs`` (trained: ``run_dir, arm, lr, seed``), ``entropy``
    (claim (a): ``run_dir, fmt, seed``), their per-run ``values`` (index ``run_dir``: reward AUC, final reward,
    pass@1 per set), ``curves`` (run_dir -> metrics frame), the ``protocol``, the ``unfinished`` runs left out,
    and the models' provenance ``notes`` (e.g. that GGUF weights stand for BF16)."""
    root: Path
    scale: str
    runs: pd.DataFrame
    entropy: pd.DataFrame
    values: pd.DataFrame
    curves: dict[str, pd.DataFrame]
    protocol: Protocol
    unfinished: list[str]
    notes: list[str]
    eval_sets: list[str]

    def at(self, arm: str, lr) -> pd.DataFrame:
        """The finished runs of ``arm`` at rate ``lr`` (every seed), sorted by seed."""
        if lr is None:
            return self.runs.iloc[0:0]
        sel = self.runs[(self.runs["arm"] == arm) & (self.runs["lr"] == _lr_key(lr))]
        return sel.sort_values("seed")

    def has(self, arm: str) -> bool:
        return bool((self.runs["arm"] == arm).any())


def _col(df: pd.DataFrame, name: str, default=None) -> pd.Series:
    return df[name] if name in df else pd.Series(default, index=df.index, dtype=object)


def evidence_runs(root, scale: str | None = None) -> pd.DataFrame:
    """Every run tagged ``tags.table: evidence`` (of ``scale`` when given)."""
    return R.select(R.all_runs(root), table=TABLE, scale=scale)


def evidence_scales(root) -> list[str]:
    """The scales that have evidence runs."""
    df = evidence_runs(root)
    return sorted({str(s) for s in _col(df, "cfg.scale").dropna()}) if len(df) else []


def reward_curve(metrics: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(steps, training reward) of one run's metrics: ``rewards/accuracy/mean`` when logged, else ``reward``."""
    col = next((c for c in REWARD if c in metrics and metrics[c].notna().any()), None)
    if col is None:
        return np.array([]), np.array([])
    m = metrics[["step", col]].dropna().sort_values("step")
    return m["step"].to_numpy(float), m[col].to_numpy(float)


def final_mean(values: np.ndarray, fraction: float = FINAL_FRACTION) -> float:
    """Mean of the last ``fraction`` of a curve's points (at least one); NaN for an empty curve."""
    if len(values) == 0:
        return np.nan
    k = max(1, math.ceil(fraction * len(values)))
    return float(np.mean(values[-k:]))


def mean_training_reward(run_dir) -> float:
    """Mean training reward over all logged steps of a run (read from its metrics.jsonl); NaN without one."""
    _, v = reward_curve(pd.DataFrame(read_jsonl(Path(run_dir) / "metrics.jsonl")))
    return float(np.mean(v)) if len(v) else np.nan


def grid_scores(runs_of_arm: pd.DataFrame, score=mean_training_reward) -> dict[float, float]:
    """rate -> ``score(run_dir)`` of the arm's seed-0 run at that rate (its grid). ``runs_of_arm`` has columns
    ``run_dir``, ``lr``, ``seed``. Rates whose run has no score (no metrics) are left out."""
    g = runs_of_arm[runs_of_arm["seed"] == 0]
    out = {}
    for lr, d in sorted(zip(g["lr"].map(_lr_key), g["run_dir"], strict=True)):
        s = score(d)
        if s == s:
            out[lr] = float(s)
    return out


def best_lr(runs_of_arm: pd.DataFrame, score=mean_training_reward) -> float | None:
    """The arm's best learning rate: the rate whose seed-0 run has the highest mean training reward over all its
    steps (``score``; training reward only, never held-out data); a tie goes to the lower rate. None without a
    seed-0 run."""
    best = None
    for lr, s in sorted(grid_scores(runs_of_arm, score).items()):
        if best is None or s > best[1]:  # strictly greater: a tie keeps the lower rate
            best = (lr, s)
    return best[0] if best else None


def _read_protocol(path: Path) -> dict:
    """protocol.json, checked: an object whose ``shared_lr`` (if any) is a number and ``grid`` maps arms to rates."""
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise UserError(f"{path}: expected a JSON object like {{\"shared_lr\": 2e-4, \"grid\": {{arm: [rates]}}, "
                        f"\"seeds\": [0, 1, 2]}}, got {type(spec).__name__}")
    lr = spec.get("shared_lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float)):
        raise UserError(f"{path}: shared_lr must be a number, got {lr!r}")
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) for v in grid.values()):
        raise UserError(f"{path}: grid must map each arm to a list of rates, got {grid!r}")
    return spec


def _protocol(root: Path, scale: str, runs: pd.DataFrame, curves: dict) -> Protocol:
    means = {d: float(np.mean(v)) for d, c in curves.items() if len(v := reward_curve(c)[1])}
    score = lambda d: means.get(d, np.nan)  # noqa: E731  (the same number mean_training_reward reads from disk)
    grid = {arm: grid_scores(runs[runs["arm"] == arm], score) for arm in ARMS if (runs["arm"] == arm).any()}
    best = {arm: best_lr(runs[runs["arm"] == arm], score) for arm in grid}
    path = root / TABLE / scale / "protocol.json"
    spec = _read_protocol(path) if path.exists() else {}
    if spec.get("shared_lr") is not None:
        shared, source = _lr_key(spec["shared_lr"]), f"{R.rel(path, root)} (`shared_lr`)"
    else:
        rates = sorted({lr for arm, g in grid.items() if arm in LORA_ARMS for lr in g})
        shared = rates[(len(rates) - 1) // 2] if rates else None
        source = "median of the LoRA arms' grid rates (no shared_lr in protocol.json)"
    planned = {a: [_lr_key(x) for x in v] for a, v in (spec.get("grid") or {}).items()}
    extra = {k: v for k, v in spec.items() if k not in ("shared_lr", "grid", "seeds")}
    return Protocol(grid=grid, best={a: b for a, b in best.items() if b is not None}, shared=shared,
                    shared_source=source, planned=planned, seeds=list(spec.get("seeds") or sorted(set(runs["seed"]))),
                    n_settings=sum(len(g) for g in grid.values()), n_runs=len(runs), extra=extra)


def _run_values(curve: pd.DataFrame, row: pd.Series, sets: list[str]) -> dict:
    steps, v = reward_curve(curve)
    out = {"reward AUC": S.curve_auc(steps, v) if len(v) else np.nan, "final reward": final_mean(v)}
    for s in sets:
        x = row.get(f"sum.eval.{s}.pass@1")
        out[f"pass@1 {s}"] = float(x) if x is not None and x == x else np.nan
    return out


def load(root, scale: str) -> Evidence | None:
    """The evidence of one scale (finished runs only), or None when it has no evidence runs."""
    root = Path(root)
    df = evidence_runs(root, scale)
    if df.empty:
        return None
    arm = _col(df, "cfg.tags.arm").astype(str)
    is_entropy = (_col(df, "sum.kind").astype(str) == "entropy") | arm.str.startswith("base-")
    unfinished = sorted(R.rel(d, root) for d in df.loc[~df["finished"], "run_dir"])
    notes = sorted({str(n) for n in _col(df, "sum.model_source.note").dropna() if str(n).strip()})
    df = df[df["finished"]]
    ent, tr = df[is_entropy[df.index]], df[~is_entropy[df.index]]
    runs = pd.DataFrame({"run_dir": tr["run_dir"], "arm": _col(tr, "cfg.tags.arm").astype(str),
                         "lr": _col(tr, "cfg.optim.lr").map(lambda x: _lr_key(x) if x is not None else np.nan),
                         "seed": _col(tr, "cfg.seed", 0).astype(int)})
    runs = runs.sort_values("run_dir").drop_duplicates(["arm", "lr", "seed"]).reset_index(drop=True)
    unknown = sorted(set(runs["arm"]) - set(ARMS))
    if unknown:
        print(f"[paper_figures] evidence {scale}: runs with arms {unknown} are not in any comparison (known: {ARMS})")
    fmt = _col(ent, "sum.format").fillna(_col(ent, "cfg.quant.format")).astype(str).str.lower()
    entropy = pd.DataFrame({"run_dir": ent["run_dir"], "fmt": fmt, "seed": _col(ent, "cfg.seed", 0).astype(int),
                            "pass@1": _col(ent, "sum.pass@1"), "temperature": _col(ent, "sum.temperature")})
    m = R.metrics(runs["run_dir"])
    curves = {d: g.drop(columns="run_dir") for d, g in m.groupby("run_dir")} if len(m) else {}
    sets = sorted({c[len("sum.eval."):-len(".pass@1")] for c in tr.columns
                   if c.startswith("sum.eval.") and c.endswith(".pass@1")})
    by_dir = tr.set_index("run_dir")
    values = pd.DataFrame([_run_values(curves.get(d, pd.DataFrame()), by_dir.loc[d], sets) for d in runs["run_dir"]],
                          index=runs["run_dir"]) if len(runs) else pd.DataFrame()
    return Evidence(root=root, scale=scale, runs=runs, entropy=entropy.reset_index(drop=True), values=values,
                    curves=curves, protocol=_protocol(root, scale, runs, curves), unfinished=unfinished,
                    notes=notes, eval_sets=sets)


# ------------------------------------------------------------------------------------------------ claim (a)
@dataclass
class FormatEntropy:
    """Claim (a) for one format: ``per_prompt`` entropy (prompt id -> mean over seeds), ``seed_means`` (seed ->
    mean over its prompts), the summaries' ``pass1`` per seed, the sampling ``temperature``(s) and the ``runs``."""
    per_prompt: pd.Series
    seed_means: pd.Series
    pass1: list[float]
    temperature: list
    runs: list[str]


def entropy_by_format(ev: Evidence) -> dict[str, FormatEntropy]:
    """Claim (a)'s runs per format, read from their ``entropy.jsonl`` (a run without one is left out, said)."""
    out = {}
    for fmt, g in ev.entropy.groupby("fmt"):
        per_seed, used = {}, []
        for d, seed in zip(g["run_dir"], g["seed"], strict=True):
            rows = [r for r in read_jsonl(Path(d) / "entropy.jsonl") if r.get("entropy") is not None]
            if not rows:
                print(f"[paper_figures] evidence {ev.scale}: {d} has no entropy.jsonl rows; left out")
                continue
            # prompts pair across formats and seeds by id (by line number when a file has no ids)
            per_seed[int(seed)] = pd.Series({str(r.get("id", i)): float(r["entropy"]) for i, r in enumerate(rows)})
            used.append(d)
        if not per_seed:
            continue
        table = pd.DataFrame(per_seed)  # (prompts, seeds)
        done = g[g["run_dir"].isin(used)]
        out[str(fmt)] = FormatEntropy(per_prompt=table.mean(axis=1), seed_means=table.mean(axis=0),
                                      pass1=[float(x) for x in done["pass@1"] if x is not None and x == x],
                                      temperature=sorted({t for t in done["temperature"] if t is not None and t == t}),
                                      runs=[R.rel(d, ev.root) for d in used])
    return out


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


# ------------------------------------------------------------------------------------------------ claims (b), (c)
LABELS = {"bf16-full": "BF16-Full", "bf16-lora": "BF16-LoRA", "nf4-lora": "NF4-LoRA", "mxfp4-lora": "MXFP4-LoRA",
          "nvfp4-lora": "NVFP4-LoRA", "nvfp4-lora-aqn": "NVFP4-LoRA+AQN", "bf16-lora-aqn": "BF16-LoRA+AQN",
          "nvfp4-lora-aqn-linear": "NVFP4-LoRA+AQN(linear)", "nvfp4-lora-aqn-cosine": "NVFP4-LoRA+AQN(cosine)",
          "nvfp4-lora-aqn-logarithmic": "NVFP4-LoRA+AQN(logarithmic)"}


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


def _claim_b(ev: Evidence) -> list[dict]:
    best, rows = ev.protocol.best, []
    for a, b, note in CLAIM_B:
        if "bf16-full" not in (a, b):  # BF16-Full has its own grid: no shared-rate comparison
            rows += _welch_rows(ev, "b", a, b, "shared", ev.protocol.shared, ev.protocol.shared, note)
        rows += _welch_rows(ev, "b", a, b, "best", best.get(a), best.get(b), note)
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
        rows += _welch_rows(ev, "c", a, b, "best", lr_a, lr_b, "; ".join(x for x in (note, why) if x))
    return rows


def findings_frame(ev: Evidence, fe: dict[str, FormatEntropy] | None = None) -> pd.DataFrame:
    """Every row of the findings (columns ``COLUMNS``), Holm-adjusted p within each claim."""
    fe = entropy_by_format(ev) if fe is None else fe
    df = pd.DataFrame([learnability(ev, fe), *claim_a_rows(ev, fe), *_claim_b(ev), *_claim_c(ev)])
    df = df.reindex(columns=COLUMNS)
    df["p_holm"] = np.nan
    for claim in ("a", "b", "c"):
        sel = df["claim"] == claim
        df.loc[sel, "p_holm"] = S.holm(df.loc[sel, "p"].astype(float).to_numpy())
    df["note"] = df["note"].fillna("")
    return df


# ------------------------------------------------------------------------------------------------ writing
def _num(x, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    x = round(float(x), 3) + 0.0  # no "-0.000"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _effect(r: pd.Series) -> str:
    if r["verdict"] == "not run":
        return "—"
    ci = f" [{_num(r['ci_lo'], True)}, {_num(r['ci_hi'], True)}]" if r["ci_lo"] == r["ci_lo"] else " [no interval]"
    return _num(r["effect"], True) + ci


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
