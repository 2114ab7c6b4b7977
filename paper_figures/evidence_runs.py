"""The evidence runs of one scale, read from ``results/evidence/<scale>/`` (``load(root, scale)``), and the
learning-rate protocol they were run under. Used by ``paper_figures.findings`` (the table) and
``paper_figures.evidence`` (the figures).

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
count, so that it is a rate that was run). Only finished runs count; unfinished ones are listed.
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

LABELS = {"bf16-full": "BF16-Full", "bf16-lora": "BF16-LoRA", "nf4-lora": "NF4-LoRA", "mxfp4-lora": "MXFP4-LoRA",
          "nvfp4-lora": "NVFP4-LoRA", "nvfp4-lora-aqn": "NVFP4-LoRA+AQN", "bf16-lora-aqn": "BF16-LoRA+AQN",
          "nvfp4-lora-aqn-linear": "NVFP4-LoRA+AQN(linear)", "nvfp4-lora-aqn-cosine": "NVFP4-LoRA+AQN(cosine)",
          "nvfp4-lora-aqn-logarithmic": "NVFP4-LoRA+AQN(logarithmic)"}


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
    heldout: pd.DataFrame = field(default_factory=pd.DataFrame)  # untrained base on the eval sets: fmt, seed, set, pass@1

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
    """Every run tagged ``tags.table: evidence`` (of ``scale`` when given) under ``root/evidence/``, where
    ``experiments.evidence`` writes them: copies kept elsewhere under ``root`` (e.g. the 2-GPU runs of issue 13
    under ``speed/raw/``) are not this root's evidence."""
    df = R.select(R.all_runs(root), table=TABLE, scale=scale)
    if df.empty:
        return df
    base = (Path(root) / TABLE).resolve()
    return df[[Path(d).resolve().is_relative_to(base) for d in df["run_dir"]]]


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


def _heldout(ho: pd.DataFrame) -> pd.DataFrame:
    """One row per (untrained base run, eval set): ``run_dir, fmt, seed, set, pass@1``."""
    rows = []
    fmts, seeds = _col(ho, "cfg.quant.format").astype(str).str.lower(), _col(ho, "cfg.seed", 0)
    for idx, r in ho.iterrows():
        for c in ho.columns:
            if c.startswith("sum.eval.") and c.endswith(".pass@1") and r[c] == r[c]:
                rows.append({"run_dir": r["run_dir"], "fmt": fmts[idx], "seed": int(seeds[idx]),
                             "set": c[len("sum.eval."):-len(".pass@1")], "pass@1": float(r[c])})
    return pd.DataFrame(rows, columns=["run_dir", "fmt", "seed", "set", "pass@1"])


def load(root, scale: str) -> Evidence | None:
    """The evidence of one scale (finished runs only), or None when it has no evidence runs."""
    root = Path(root)
    df = evidence_runs(root, scale)
    # the rollout-temperature calibration (experiments.evidence --stage calibrate) is part of the protocol
    # (protocol.json), not a claim's run
    df = df[_col(df, "sum.kind").astype(str) != "calibration"]
    if df.empty:
        return None
    arm = _col(df, "cfg.tags.arm").astype(str)
    is_entropy = (_col(df, "sum.kind").astype(str) == "entropy") | arm.str.startswith("base-")
    is_heldout = arm.str.startswith("heldout-") | (_col(df, "sum.trained").astype(str) == "False")
    unfinished = sorted(R.rel(d, root) for d in df.loc[~df["finished"], "run_dir"])
    notes = sorted({str(n) for n in _col(df, "sum.model_source.note").dropna() if str(n).strip()})
    df = df[df["finished"]]
    ent, ho = df[is_entropy[df.index]], df[is_heldout[df.index] & ~is_entropy[df.index]]
    tr = df[~is_entropy[df.index] & ~is_heldout[df.index]]
    heldout = _heldout(ho)
    runs = pd.DataFrame({"run_dir": tr["run_dir"], "arm": _col(tr, "cfg.tags.arm").astype(str),
                         "lr": _col(tr, "cfg.optim.lr").map(lambda x: _lr_key(x) if x is not None else np.nan),
                         "seed": _col(tr, "cfg.seed", 0).astype(int)})
    runs = runs.sort_values("run_dir")
    dup = runs.duplicated(["arm", "lr", "seed"])
    if dup.any():  # one run per (arm, rate, seed), or a setting would count twice as independent seeds
        print(f"[paper_figures] evidence {scale}: runs repeating an (arm, lr, seed) left out: "
              f"{[R.rel(d, root) for d in runs.loc[dup, 'run_dir']]}")
    runs = runs[~dup].reset_index(drop=True)
    unknown = sorted(set(runs["arm"]) - set(ARMS))
    if unknown:
        print(f"[paper_figures] evidence {scale}: runs with arms {unknown} are not in any comparison (known: {ARMS})")
    fmt = _col(ent, "sum.format").fillna(_col(ent, "cfg.quant.format")).astype(str).str.lower()
    entropy = pd.DataFrame({"run_dir": ent["run_dir"], "fmt": fmt, "seed": _col(ent, "cfg.seed", 0).astype(int),
                            "pass@1": _col(ent, "sum.pass@1"), "temperature": _col(ent, "sum.temperature")})
    m = R.metrics(runs["run_dir"])
    curves = {d: g.drop(columns="run_dir") for d, g in m.groupby("run_dir")} if len(m) else {}
    sets = sorted({c[len("sum.eval."):-len(".pass@1")] for c in tr.columns
                   if c.startswith("sum.eval.") and c.endswith(".pass@1") and tr[c].notna().any()})
    by_dir = tr.set_index("run_dir")
    values = pd.DataFrame([_run_values(curves.get(d, pd.DataFrame()), by_dir.loc[d], sets) for d in runs["run_dir"]],
                          index=runs["run_dir"]) if len(runs) else pd.DataFrame()
    return Evidence(root=root, scale=scale, runs=runs, entropy=entropy.reset_index(drop=True), values=values,
                    curves=curves, protocol=_protocol(root, scale, runs, curves), unfinished=unfinished,
                    notes=notes, eval_sets=sets, heldout=heldout)


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
