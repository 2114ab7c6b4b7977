"""Finding runs in ``results/`` and labelling them the way the paper does.

A run joins to a paper row on four keys, taken from the experiment's tags when set and derived from the config
otherwise (the derivation is the fallback; experiments should set the tags):

=================  =====================================  =============================================
key                tag (``cfg.tags.*``)                   fallback
=================  =====================================  =============================================
``paper_model``    ``tags.paper_model``                   none (a run without it is listed as unplaced)
``weights``        ``tags.weights`` (BF16/NF4/MXFP4/NVFP4)  ``quant.format`` upper-cased
``training``       ``tags.training`` (none/full/lora)      ``none`` if ``sum.trained`` is false, else
                                                           ``full`` if ``lora.enabled`` is false, else ``lora``
``aqn``            ``tags.aqn`` (yes/no)                   ``aqn.enabled``
=================  =====================================  =============================================

Imports pandas and ``qerl.results`` only (no torch). A run whose summary.json or config.yaml cannot be read, and a
corrupt metrics line, are skipped with a ``qerl.results.ResultsWarning`` naming the file (and line).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from qerl.results import load_metrics, load_runs

KEYS = ("paper_model", "weights", "training", "aqn")
_NO_RUNS_COLUMNS = ["run_dir"]


def _val(row: pd.Series, key: str, default=None):
    v = row.get(key, default)
    if v is None or (isinstance(v, float) and v != v):
        return default
    return v


def _yes_no(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "yes" if v else "no"
    s = str(v).strip().lower()
    if s in ("yes", "true", "on", "1", "y"):
        return "yes"
    if s in ("no", "false", "off", "0", "n"):
        return "no"
    return s


def row_keys(row: pd.Series) -> dict:
    """The paper-row keys of one run (tags first, config fallback). See the module docstring."""
    weights = _val(row, "cfg.tags.weights") or _val(row, "cfg.quant.format")
    training = _val(row, "cfg.tags.training")
    if training is None:
        trained = _val(row, "sum.trained", True)
        if trained is False or str(trained).lower() == "false":
            training = "none"
        elif _yes_no(_val(row, "cfg.lora.enabled", True)) == "no":
            training = "full"
        else:
            training = "lora"
    aqn = _yes_no(_val(row, "cfg.tags.aqn"))
    if aqn is None:
        aqn = _yes_no(_val(row, "cfg.aqn.enabled", False))
        # an untrained run has no rollouts, so no AQN whatever its config says
        aqn = "no" if str(training).lower() == "none" else aqn
    pm = _val(row, "cfg.tags.paper_model")
    return {"paper_model": str(pm) if pm is not None else None,
            "weights": str(weights).upper() if weights is not None else None,
            "training": str(training).lower(), "aqn": aqn}


_CACHE: dict = {}


def _signature(root: Path) -> tuple:
    files = sorted(p for name in ("config.yaml", "summary.json") for p in root.rglob(name)
                   if "checkpoints" not in p.parts)
    return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)


def all_runs(root: str | Path) -> pd.DataFrame:
    """``qerl.results.load_runs`` of the whole tree plus the key columns (``paper_model`` … ``aqn``) and
    ``finished``. Empty (with a ``run_dir`` column) when there is no run. Cached until a config or summary
    file under ``root`` changes."""
    root = Path(root)
    sig = _signature(root) if root.exists() else ()
    hit = _CACHE.get(str(root.resolve()))
    if hit is not None and hit[0] == sig:
        return hit[1].copy()
    df = _load(root)
    _CACHE[str(root.resolve())] = (sig, df)
    return df.copy()


def _load(root: Path) -> pd.DataFrame:
    df = load_runs(root) if root.exists() else pd.DataFrame(columns=_NO_RUNS_COLUMNS)
    if df.empty:
        return pd.DataFrame(columns=_NO_RUNS_COLUMNS + list(KEYS) + ["finished"])
    keys = pd.DataFrame([row_keys(r) for _, r in df.iterrows()], index=df.index)
    df = pd.concat([df, keys], axis=1)
    fin = df["sum.finished"] if "sum.finished" in df else pd.Series(False, index=df.index)
    df["finished"] = fin.map(lambda v: v is True or str(v).lower() == "true")
    return df


def _scale_of(df: pd.DataFrame) -> pd.Series:
    s = df["cfg.scale"] if "cfg.scale" in df else pd.Series(None, index=df.index, dtype=object)
    if "sum.scale" in df:
        s = s.fillna(df["sum.scale"])
    return s


def select(df: pd.DataFrame, experiments: str | Iterable[str] | None = None, table: str | None = None,
           scale: str | None = None) -> pd.DataFrame:
    """Runs whose ``cfg.experiment`` is one of ``experiments`` (exact, or a prefix followed by ``/``), or whose
    ``cfg.tags.table`` (or experiment prefix) is ``table``; restricted to ``scale`` when given."""
    if df.empty:
        return df
    exp = df["cfg.experiment"].astype(str) if "cfg.experiment" in df else pd.Series("", index=df.index)
    keep = pd.Series(False, index=df.index)
    if experiments is not None:
        for e in [experiments] if isinstance(experiments, str) else experiments:
            keep |= (exp == e) | exp.str.startswith(e.rstrip("/") + "/")
    if table is not None:
        tag = df["cfg.tags.table"].astype(str) if "cfg.tags.table" in df else pd.Series("", index=df.index)
        keep |= (tag == table) | (exp.str.split("/").str[0] == table)
    if scale is not None:
        keep &= _scale_of(df) == scale
    return df[keep]


def scales(root: str | Path) -> list[str]:
    """Every scale that some run under ``root`` records."""
    df = all_runs(root)
    return sorted({str(s) for s in _scale_of(df).dropna()}) if not df.empty else []


def metrics(run_dirs: Iterable[str]) -> pd.DataFrame:
    """Long metrics frame of the runs (``qerl.results.load_metrics``)."""
    return load_metrics(list(run_dirs))


def gpus_note(world_size) -> str:
    """`` [N GPUs]`` for a run trained data-parallel on N > 1 ranks (``summary.json``'s ``world_size``), else ''."""
    try:
        n = int(world_size)
    except (TypeError, ValueError):  # a run from before world_size was recorded, or NaN: one process
        return ""
    return f" [{n} GPUs]" if n > 1 else ""


def rel(path: str | Path, root: str | Path) -> str:
    """``path`` relative to ``root`` when it lies under it (for compact provenance)."""
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(path)
