"""Run directories: provenance, append-only metrics, atomic summaries, checkpoints; and reading them back.

A run directory holds::

    config.yaml      the resolved configuration (what was actually run)
    env.json         git SHA and dirty diff, package versions, hardware, command line
    metrics.jsonl    one JSON object per optimizer step, appended and fsync'ed as the run goes
    samples.jsonl    (train.log_samples) one line per step: its groups' completions, rewards, advantages
    summary.json     final numbers (evaluation, totals), written atomically
    checkpoints/     step_<N>/ (trainable state, optimizer, data position, sha256.json), newest kept; git-ignored
    .lock            held (flock) by the one process writing the directory; names its pid and host

``load_runs`` and ``load_metrics`` turn a results tree into DataFrames; ``paper_figures`` uses only them. Readers
skip what they cannot read (a corrupt line, an unreadable summary) with a ``ResultsWarning`` naming the file (and
line), and never stop early: one bad line must not hide the lines after it.
The file primitives (atomic writes, appends, the lock, checksums) live in ``qerl.runfiles``. This module imports
no torch at module level so plotting code can import it cheaply.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from qerl.errors import UserError
from qerl.runfiles import (  # noqa: F401 (ResultsWarning: re-exported for readers)
    CHECKSUMS,
    JsonLines,
    ResultsWarning,
    append_line,
    aside_path,
    atomic_write_json,
    atomic_write_text,
    jsonable,
    lock_dir,
    read_jsonl,
    scan_jsonl,
    set_aside,
    sha256_file,
    spans,
    unlock_dir,
    verify_checkpoint,
    warn,
    writing,
)

CONFIG, ENV, METRICS, SUMMARY, CKPTS = "config.yaml", "env.json", "metrics.jsonl", "summary.json", "checkpoints"
EVALS, SAMPLES = "eval.jsonl", "samples.jsonl"
_STEP_DIR = re.compile(r"step_(\d+)")  # a finished checkpoint; step_N.tmp and moved-aside ones do not match
_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "compressed-tensors", "triton", "math-verify",
             "optuna", "hydra-core", "numpy", "vllm", "qerl")


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


def _step_gap(lines: JsonLines, k: int) -> str | None:
    """Why ``lines`` (metrics.jsonl) does not hold each of steps 1..k exactly once; None when it does."""
    if k == 0:
        return None
    if not lines.exists:
        return f"{lines.path} is missing"
    at: dict[int, list[int]] = {}
    for n, _, row in lines.rows:
        if row["step"] <= k:
            at.setdefault(row["step"], []).append(n)
    missing = [s for s in range(1, k + 1) if s not in at]
    twice = {s: ns for s, ns in sorted(at.items()) if len(ns) > 1}
    if not missing and not twice:
        return None
    why = []
    if missing:
        corrupt = f" (corrupt: line{'s' * (len(lines.bad) > 1)} {spans([n for n, _ in lines.bad])})" \
            if lines.bad else ""
        why.append(f"has no line for step{'s' * (len(missing) > 1)} {spans(missing)}{corrupt}")
    if twice:
        shown = "; ".join(f"step {s} on lines {', '.join(map(str, ns))}" for s, ns in list(twice.items())[:3])
        why.append(f"repeats steps ({shown}{'; ...' if len(twice) > 3 else ''}: two processes wrote the run?)")
    return f"{lines.path} " + ", ".join(why)


def _keep_steps_upto(lines: JsonLines, k: int) -> None:
    """Rewrite the file with its lines of steps 1..k in step order (the later copy of a repeated step wins).
    Lines past ``k`` are dropped (a resumed run recomputes them); corrupt lines are dropped only here, where the
    file is rewritten whole, and the original is kept as ``<name>.corrupt-<time>``."""
    if not lines.exists:
        return
    keep = {row["step"]: text for _, text, row in lines.rows if row["step"] <= k}
    if lines.bad:
        aside = aside_path(lines.path, "corrupt")
        shutil.copy2(lines.path, aside)
        warn(f"{lines.path}: dropped corrupt line{'s' * (len(lines.bad) > 1)} {spans([n for n, _ in lines.bad])} "
             f"while resuming from step {k}; the original file is kept as {aside.name}")
    atomic_write_text(lines.path, "".join(keep[s] + "\n" for s in sorted(keep)))


# ------------------------------------------------------------------------------------------------- the writer
@contextlib.contextmanager
def signals_deferred(signums=(signal.SIGINT, signal.SIGTERM)):
    """Hold SIGINT/SIGTERM until the block is done, then deliver the first one to the handler that was in place.

    A checkpoint write interrupted half-way (a sweep's SIGTERM handler raising inside ``torch.save``'s C++ writer
    surfaced as ``RuntimeError: unexpected pos``, not as the interrupt) is worth less than one finished a moment
    later. Only the main thread can set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[tuple[int, Any]] = []
    old = {s: signal.getsignal(s) for s in signums}
    for s in signums:
        signal.signal(s, lambda signum, frame: got.append((signum, frame)))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            signum, frame = got[0]
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


class RunWriter:
    """Owns one run directory (holding its lock until ``close()`` or process exit). Safe against being killed
    at any instruction:

    * metrics lines are appended and fsync'ed one step at a time;
    * ``resume`` continues from the newest checkpoint that is intact (sha256 recorded at save) and whose steps
      1..k metrics.jsonl holds exactly once, and keeps exactly those lines — so the file never has a gap or a
      duplicate, and no valid line up to k is ever dropped;
    * summaries and checkpoints are written to a temporary name and renamed; a full disk is reported with the
      file's name and leaves no temporary file behind.
    """

    def __init__(self, run_dir: str | Path, config_yaml: str | None = None, keep_checkpoints: int = 2,
                 env_extra: dict | None = None):
        self.dir = Path(run_dir)
        self.resumed_from: Path | None = None  # the checkpoint ``resume`` chose
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_dir(self.dir)  # before anything is written: a second process stops here
        self.keep = keep_checkpoints
        if config_yaml is not None and not self.is_finished():  # a finished run's provenance is never rewritten
            old = self.dir / CONFIG
            if old.exists() and old.read_text() != config_yaml:
                atomic_write_text(self.dir / "config.previous.yaml", old.read_text())
            atomic_write_text(old, config_yaml)
            env = {**environment(), **(env_extra or {})}
            if (self.dir / ENV).exists():  # a resumed run keeps its first env.json; each resume is appended
                append_line(self.dir / "env.resumes.jsonl", json.dumps(env, default=jsonable) + "\n")
            else:
                atomic_write_json(self.dir / ENV, env)

    def close(self) -> None:
        """Release the run directory's lock (idempotent)."""
        if self._lock is not None:
            unlock_dir(self._lock)
            self._lock = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    @property
    def metrics_path(self) -> Path:
        return self.dir / METRICS

    def log(self, step: int, **metrics: Any) -> dict:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        append_line(self.metrics_path, json.dumps(row, default=jsonable) + "\n")
        return row

    def log_eval(self, step: int, results: dict) -> None:
        """Append intermediate evaluation results (eval.jsonl), same crash-safety as metrics."""
        append_line(self.dir / EVALS, json.dumps({"step": step, **results}, default=jsonable) + "\n")

    def log_samples(self, step: int, groups: list[dict]) -> None:
        """Append one step's groups (samples.jsonl, one line per step; same crash-safety as metrics)."""
        append_line(self.dir / SAMPLES, json.dumps({"step": step, "groups": groups}, default=jsonable) + "\n")

    def read_summary(self) -> dict | None:
        return read_summary(self.dir)

    def write_summary(self, summary: dict, merge: bool = True) -> dict:
        path = self.dir / SUMMARY
        if merge and path.exists():
            old = read_summary(self.dir)
            if old is None:  # unreadable: keep it for inspection, write the new one whole
                warn(f"{path} is unreadable; kept as {set_aside(path, 'corrupt').name}, writing a new one")
            summary = {**(old or {}), **summary}
        atomic_write_json(path, summary)
        return summary

    def is_finished(self) -> bool:
        return bool((read_summary(self.dir) or {}).get("finished"))

    # ----------------------------------------------------------------------------------- checkpoints
    def checkpoint_dir(self, step: int) -> Path:
        return self.dir / CKPTS / f"step_{step:07d}"

    def checkpoints(self) -> list[Path]:
        """Finished checkpoint directories, oldest first (``.tmp`` and set-aside ones excluded)."""
        found = [(int(m.group(1)), p) for p in (self.dir / CKPTS).glob("step_*")
                 if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def save_checkpoint(self, step: int, state: dict, extra_files: dict[str, Any] | None = None) -> Path:
        """``torch.save`` ``state`` under checkpoints/step_N/ atomically, with the sha256 of every file in
        ``sha256.json`` (renamed into place together); keep the newest ``keep_checkpoints``."""
        import torch

        final = self.checkpoint_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with signals_deferred(), writing(final, tmp):
            tmp.mkdir(parents=True)
            with open(tmp / "state.pt", "wb") as f:  # a file object: a failed write keeps its OSError (errno)
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            for name, obj in (extra_files or {}).items():
                if callable(obj):
                    obj(tmp / name)
                else:
                    (tmp / name).write_text(obj if isinstance(obj, str) else json.dumps(obj, default=jsonable))
            sums = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            atomic_write_json(tmp / CHECKSUMS, sums)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        done = self.checkpoints()
        for old in done[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        done = [p for p in self.checkpoints() if (p / "state.pt").exists()]
        return done[-1] if done else None

    def resume(self, map_location=None, load: bool = True) -> tuple[int, dict | None]:
        """Where this run continues: ``(k, state)`` of the newest checkpoint that is intact and whose steps
        1..k metrics.jsonl holds exactly once, or ``(0, None)`` for a fresh start. Newer checkpoints that fail
        either test are set aside (``step_N.corrupt-<time>`` / ``step_N.unused-<time>``) with a warning; when
        every checkpoint fails, a ``UserError`` names each and why, and nothing is changed. Then metrics.jsonl
        and eval.jsonl keep exactly their lines of steps 1..k. ``load=False``: choose (``self.resumed_from``) and
        cut back, but return no state (the caller loads it, e.g. every rank of a torchrun job)."""
        metrics = scan_jsonl(self.metrics_path, steps=True)
        skipped, chosen = [], None
        for ck in reversed(self.checkpoints()):
            gap = _step_gap(metrics, _step_of(ck))
            damage = None if gap else verify_checkpoint(ck)
            if gap is None and damage is None:
                chosen = ck
                break
            skipped.append((ck, "unused" if gap else "corrupt", gap or damage))
        if chosen is None and skipped:
            hint = ("restore metrics.jsonl" if any(kind == "unused" for _, kind, _ in skipped)
                    else "no intact checkpoint is left")
            by_why: dict[str, list[str]] = {}
            for ck, _, why in skipped:
                by_why.setdefault(why, []).append(ck.name)
            raise UserError(f"cannot resume {self.dir}: " + "; ".join(f"{', '.join(n)}: {why}" for why, n in
                                                                      by_why.items())
                            + f". {hint.capitalize()}, or move {self.dir / CKPTS} aside to train again from step 0")
        k = _step_of(chosen) if chosen is not None else 0
        self.resumed_from = chosen
        state = _load_state(chosen, map_location) if chosen is not None and load else None
        for ck, kind, why in skipped:
            aside = set_aside(ck, kind)
            warn(f"not resuming from {ck}: {why}; set it aside as {aside.name} and resuming from step {k}")
        metrics.warn_bad()
        _keep_steps_upto(metrics, k)
        for name in (EVALS, SAMPLES):
            lines = scan_jsonl(self.dir / name, steps=True)
            lines.warn_bad()
            _keep_steps_upto(lines, k)
        for tmp in (self.dir / CKPTS).glob("step_*.tmp"):  # a save killed midway (we hold the lock: not in use)
            shutil.rmtree(tmp, ignore_errors=True)
        return k, state


def _step_of(ck: Path) -> int:
    return int(_STEP_DIR.fullmatch(ck.name).group(1))


def load_checkpoint(ck: str | Path, map_location=None) -> dict:
    """The state of checkpoint directory ``ck`` (as ``RunWriter.resume`` loads it)."""
    return _load_state(Path(ck), map_location)


def _load_state(ck: Path, map_location) -> dict:
    import torch

    try:
        return torch.load(ck / "state.pt", map_location=map_location, weights_only=False)
    except Exception as e:  # its bytes are intact (verified): this is not corruption, so do not fall back
        raise RuntimeError(f"cannot load checkpoint {ck / 'state.pt'}: {e}") from e


def _clean(v):
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


def _read_summary(path: Path) -> tuple[dict | None, str | None]:
    """(summary, None), or (None, why) when the file cannot be read, parsed, or is not a JSON object."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    return (obj, None) if isinstance(obj, dict) else (None, f"a JSON {type(obj).__name__}, not an object")


def read_summary(run_dir: str | Path) -> dict | None:
    """The run's summary.json; None when there is none, or (with a ``ResultsWarning``) when it is unreadable."""
    path = Path(run_dir) / SUMMARY
    if not path.exists():
        return None
    summary, why = _read_summary(path)
    if why is not None:
        warn(f"{path} is unreadable ({why})")
    return summary


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
    """One row per run: ``run_dir``, the flattened config (``cfg.<key>``) and summary (``sum.<key>``). A run whose
    config.yaml or summary.json cannot be read is skipped with a ``ResultsWarning`` naming the file."""
    import pandas as pd
    import yaml

    rows = []
    for d in runs if runs is not None else find_runs(root):
        d = Path(d)
        try:
            cfg = load_config(d)
        except (OSError, yaml.YAMLError) as e:
            warn(f"skipping run {d}: {d / CONFIG} is unreadable ({type(e).__name__}: {e})".replace("\n", " "))
            continue
        if not isinstance(cfg, dict):
            warn(f"skipping run {d}: {d / CONFIG} is a YAML {type(cfg).__name__}, not a mapping")
            continue
        row = {"run_dir": str(d)}
        row.update({f"cfg.{k}": v for k, v in _flatten(cfg).items()})
        if (d / SUMMARY).exists():
            summary, why = _read_summary(d / SUMMARY)
            if why is not None:
                warn(f"skipping run {d}: {d / SUMMARY} is unreadable ({why})")
                continue
            row.update({f"sum.{k}": v for k, v in _flatten(summary).items()})
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
