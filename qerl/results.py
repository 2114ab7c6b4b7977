"""Run directories: provenance, append-only metrics, atomic summaries, checkpoints; and reading them back.

A run directory holds::

    config.yaml      the resolved configuration (what was actually run)
    env.json         git SHA and dirty diff, package versions, hardware, command line
    metrics.jsonl    one JSON object per optimizer step, appended and fsync'ed as the run goes
    summary.json     final numbers (evaluation, totals), written atomically
    checkpoints/     step_<N>/ (trainable state, optimizer, data position), newest kept; git-ignored

``load_runs`` and ``load_metrics`` turn a results tree into DataFrames; ``paper_figures`` uses only them.
This module imports no torch at module level so plotting code can import it cheaply.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CONFIG, ENV, METRICS, SUMMARY, CKPTS = "config.yaml", "env.json", "metrics.jsonl", "summary.json", "checkpoints"
_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "compressed-tensors", "triton", "math-verify",
             "optuna", "hydra-core", "numpy", "vllm", "qerl")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file so that readers see either the old or the new content, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n")


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def environment(repo: Path | None = None) -> dict:
    """Provenance of this process: code version, packages, hardware."""
    from importlib import metadata

    repo = repo or Path(__file__).resolve().parents[1]
    sha = _git("rev-parse", "HEAD", cwd=repo)
    diff = _git("diff", "HEAD", cwd=repo)
    pk = {}
    for p in _PACKAGES:
        try:
            pk[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    hw: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                          "platform": platform.platform()}
    try:
        import torch

        hw["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            hw.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                      cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}")
    except ImportError:
        pass
    return {"git_sha": sha.strip() if sha else None, "git_dirty": bool(diff and diff.strip()),
            "git_diff": diff if diff and len(diff) < 200_000 else (diff[:200_000] + "\n...[truncated]" if diff else None),
            "python": sys.version.split()[0], "packages": pk, "hardware": hw, "argv": sys.argv,
            "hostname": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


class RunWriter:
    """Owns one run directory. Safe against being killed at any instruction:

    * metrics lines are appended and fsync'ed one step at a time;
    * on resume from checkpoint step ``s``, lines for steps > s are dropped (they will be recomputed), and a
      torn last line (killed mid-write) is discarded — so the file never has a gap or a duplicate;
    * summaries and checkpoints are written to a temporary name and renamed.
    """

    def __init__(self, run_dir: str | Path, config_yaml: str | None = None, keep_checkpoints: int = 2):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep_checkpoints
        if config_yaml is not None and not self.is_finished():  # a finished run's provenance is never rewritten
            old = self.dir / CONFIG
            if old.exists() and old.read_text() != config_yaml:
                atomic_write_text(self.dir / "config.previous.yaml", old.read_text())
            atomic_write_text(old, config_yaml)
            env = environment()
            if (self.dir / ENV).exists():  # a resumed run keeps its first env.json; each resume is appended
                with open(self.dir / "env.resumes.jsonl", "a") as f:
                    f.write(json.dumps(env, default=_jsonable) + "\n")
            else:
                atomic_write_json(self.dir / ENV, env)

    @property
    def metrics_path(self) -> Path:
        return self.dir / METRICS

    def truncate_after(self, step: int | None) -> None:
        """Keep only metrics lines with ``step <= step`` (all lines are dropped for ``None``)."""
        rows = read_jsonl(self.metrics_path)
        keep = [r for r in rows if step is not None and r.get("step", -1) <= step]
        atomic_write_text(self.metrics_path, "".join(json.dumps(r, default=_jsonable) + "\n" for r in keep))
        ev = self.dir / "eval.jsonl"
        if ev.exists():
            rows = [r for r in read_jsonl(ev) if step is not None and r.get("step", -1) <= step]
            atomic_write_text(ev, "".join(json.dumps(r, default=_jsonable) + "\n" for r in rows))

    def log(self, step: int, **metrics: Any) -> dict:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return row

    def log_eval(self, step: int, results: dict) -> None:
        """Append intermediate evaluation results (eval.jsonl), same crash-safety as metrics."""
        with open(self.dir / "eval.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **results}, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_summary(self, summary: dict, merge: bool = True) -> dict:
        path = self.dir / SUMMARY
        if merge and path.exists():
            summary = {**json.loads(path.read_text()), **summary}
        atomic_write_json(path, summary)
        return summary

    # ----------------------------------------------------------------------------------- checkpoints
    def checkpoint_dir(self, step: int) -> Path:
        return self.dir / CKPTS / f"step_{step:07d}"

    def save_checkpoint(self, step: int, state: dict, extra_files: dict[str, Any] | None = None) -> Path:
        """``torch.save`` ``state`` under checkpoints/step_N/ atomically; keep the newest ``keep_checkpoints``."""
        import torch

        final = self.checkpoint_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(state, tmp / "state.pt")
        for name, obj in (extra_files or {}).items():
            if callable(obj):
                obj(tmp / name)
            else:
                (tmp / name).write_text(obj if isinstance(obj, str) else json.dumps(obj, default=_jsonable))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted(p for p in (self.dir / CKPTS).glob("step_*") if not p.name.endswith(".tmp"))
        for old in done[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in (self.dir / CKPTS).glob("step_*") if not p.name.endswith(".tmp")
                      and (p / "state.pt").exists())
        return done[-1] if done else None

    def is_finished(self) -> bool:
        path = self.dir / SUMMARY
        return path.exists() and bool(json.loads(path.read_text()).get("finished"))


def _clean(v):
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file; a torn final line (a crash mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def find_runs(root: str | Path) -> list[Path]:
    """Every run directory (one holding config.yaml) under ``root``."""
    root = Path(root)
    return sorted(p.parent for p in root.rglob(CONFIG) if CKPTS not in p.parts)


def load_config(run_dir: str | Path) -> dict:
    import yaml

    return yaml.safe_load((Path(run_dir) / CONFIG).read_text()) or {}


def load_runs(root: str | Path, runs: Iterable[Path] | None = None):
    """One row per run: ``run_dir``, the flattened config (``cfg.<key>``) and summary (``sum.<key>``)."""
    import pandas as pd

    rows = []
    for d in runs if runs is not None else find_runs(root):
        d = Path(d)
        row = {"run_dir": str(d)}
        row.update({f"cfg.{k}": v for k, v in _flatten(load_config(d)).items()})
        s = d / SUMMARY
        if s.exists():
            row.update({f"sum.{k}": v for k, v in _flatten(json.loads(s.read_text())).items()})
        rows.append(row)
    return pd.DataFrame(rows)


def load_metrics(run_dirs: Iterable[str | Path]):
    """All metrics lines of the given runs in one long DataFrame with a ``run_dir`` column."""
    import pandas as pd

    frames = []
    for d in run_dirs:
        rows = read_jsonl(Path(d) / METRICS)
        if rows:
            df = pd.DataFrame(rows)
            df["run_dir"] = str(d)
            frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
