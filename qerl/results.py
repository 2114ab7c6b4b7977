"""Run directories: provenance, append-only metrics, atomic summaries, checkpoints; and reading them back.

A run directory holds::

    config.yaml      the resolved configuration (what was actually run)
    env.json         git SHA and dirty diff, package versions, hardware, command line
    metrics.jsonl    one JSON object per optimizer step, appended and fsync'ed as the run goes
    summary.json     final numbers (evaluation, totals), written atomically
    checkpoints/     step_<N>/ (trainable state, optimizer, data position, sha256.json), newest kept; git-ignored
    .lock            held (flock) by the one process writing the directory; names its pid and host

``load_runs`` and ``load_metrics`` turn a results tree into DataFrames; ``paper_figures`` uses only them. Readers
skip what they cannot read (a corrupt line, an unreadable summary) with a ``ResultsWarning`` naming the file (and
line), and never stop early: one bad line must not hide the lines after it.
This module imports no torch at module level so plotting code can import it cheaply.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl.errors import UserError

CONFIG, ENV, METRICS, SUMMARY, CKPTS = "config.yaml", "env.json", "metrics.jsonl", "summary.json", "checkpoints"
EVALS, LOCK, CHECKSUMS = "eval.jsonl", ".lock", "sha256.json"
_STEP_DIR = re.compile(r"step_(\d+)")  # a finished checkpoint; step_N.tmp and moved-aside ones do not match
_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "compressed-tensors", "triton", "math-verify",
             "optuna", "hydra-core", "numpy", "vllm", "qerl")


class ResultsWarning(UserWarning):
    """Something in a run directory was skipped or set aside (a corrupt line or summary, a damaged checkpoint)."""


def _warn(message: str) -> None:
    """Warn, attributed to the first caller outside this module (the message itself names the file)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, ResultsWarning, stacklevel=level)


def _out_of_space(e: BaseException | None) -> bool:
    """Whether ``e`` or an exception it was raised from is a full disk (torch.save wraps the OSError of a failed
    write in a RuntimeError that says only "unexpected pos ... iostream error")."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def _writing(path: Path, *partial: Path):
    """Writing ``path``: on any failure remove the ``partial`` files or directories (no orphan ``.tmp`` stays
    behind), and turn a full disk into an error that names ``path``."""
    try:
        yield
    except BaseException as e:
        for p in partial:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
        if _out_of_space(e):
            raise UserError(f"no space left writing {path}; free some space and rerun (the run resumes from its "
                            f"last checkpoint)") from e
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file so that readers see either the old or the new content, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with _writing(path, tmp):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _append_line(path: Path, line: str) -> None:
    """Append one line and fsync it. A failed write (disk full) is cut back off, so the file never keeps half a
    line in front of the lines a resumed run appends."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        with _writing(path):
            try:
                data = line.encode()
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
    finally:
        os.close(fd)


def _set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to ``<name>.<why>-<time>`` (kept for inspection, ignored by every reader)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.{why}-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.{why}-{stamp}.{n}")
    os.replace(path, aside)
    return aside


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


# ------------------------------------------------------------------------------------------------- JSON lines
@dataclass
class _Lines:
    """A JSON-lines file as read: the good rows with their line numbers and text, and the bad lines."""

    path: Path
    exists: bool = False
    rows: list[tuple[int, str, dict]] = field(default_factory=list)  # (line number, text, row)
    bad: list[tuple[int, str]] = field(default_factory=list)         # (line number, why); a torn tail excluded
    torn: bool = False  # the last line was cut short (a crash mid-append): expected, dropped without a warning

    def warn_bad(self) -> None:
        for n, why in self.bad:
            _warn(f"{self.path}:{n}: skipping a corrupt line ({why})")


def _scan_jsonl(path: Path, steps: bool = False) -> _Lines:
    """Read every line; a bad one is recorded and skipped, never the end of the file. ``steps``: a row must also
    carry a positive integer ``step`` (metrics and eval lines)."""
    out = _Lines(Path(path))
    if not out.path.exists():
        return out
    out.exists = True
    data = out.path.read_bytes()
    lines = data.split(b"\n")
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        why, row = None, None
        try:
            text = raw.decode()
            row = json.loads(text)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
            why = f"not valid JSON: {e}"
        else:
            if not isinstance(row, dict):
                why = f"a JSON {type(row).__name__}, not an object"
            elif steps and not (type(row.get("step")) is int and row["step"] >= 1):
                why = f"no positive integer 'step' (got {row.get('step')!r})"
        if why is None:
            out.rows.append((n, text, row))
        elif n == len(lines) and not data.endswith(b"\n"):
            out.torn = True
        else:
            out.bad.append((n, why))
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file. A corrupt line is skipped with a ``ResultsWarning`` naming ``file:line`` (the
    lines after it are still read); a torn final line (a crash mid-write) is skipped silently."""
    lines = _scan_jsonl(Path(path))
    lines.warn_bad()
    return [row for _, _, row in lines.rows]


def _step_gap(lines: _Lines, k: int) -> str | None:
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
        corrupt = f" (corrupt: line{'s' * (len(lines.bad) > 1)} {_spans([n for n, _ in lines.bad])})" \
            if lines.bad else ""
        why.append(f"has no line for step{'s' * (len(missing) > 1)} {_spans(missing)}{corrupt}")
    if twice:
        shown = "; ".join(f"step {s} on lines {', '.join(map(str, ns))}" for s, ns in list(twice.items())[:3])
        why.append(f"repeats steps ({shown}{'; ...' if len(twice) > 3 else ''}: two processes wrote the run?)")
    return f"{lines.path} " + ", ".join(why)


def _spans(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _keep_steps_upto(lines: _Lines, k: int) -> None:
    """Rewrite the file with its lines of steps 1..k in step order (the later copy of a repeated step wins).
    Lines past ``k`` are dropped (a resumed run recomputes them); corrupt lines are dropped only here, where the
    file is rewritten whole, and the original is kept as ``<name>.corrupt-<time>``."""
    if not lines.exists:
        return
    keep = {row["step"]: text for _, text, row in lines.rows if row["step"] <= k}
    if lines.bad:
        aside = lines.path.with_name(f"{lines.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(lines.path, aside)
        _warn(f"{lines.path}: dropped corrupt line{'s' * (len(lines.bad) > 1)} {_spans([n for n, _ in lines.bad])} "
              f"while resuming from step {k}; the original file is kept as {aside.name}")
    atomic_write_text(lines.path, "".join(keep[s] + "\n" for s in sorted(keep)))


# ------------------------------------------------------------------------------------------------- the lock
_HELD: dict[Path, list] = {}  # run directory -> [open lock file, RunWriters of this process holding it]


def _lock(run_dir: Path) -> Path:
    """Take the run directory's lock (one writing process at a time). ``flock`` dies with its process, so a
    SIGKILLed run never leaves a stale lock; RunWriters of one process share it."""
    key = run_dir.resolve()
    if key in _HELD:
        _HELD[key][1] += 1
        return key
    f = open(run_dir / LOCK, "a+")  # noqa: SIM115 (held open for the lock's lifetime)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"run directory {run_dir} is in use by {holder} (its {LOCK} is locked); wait for that "
                        f"run to end, or give this one another run_name or out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {platform.node()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    f.flush()
    _HELD[key] = [f, 1]
    return key


def _unlock(key: Path) -> None:
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _HELD[key]
        held[0].close()  # closing the file releases the flock


# ------------------------------------------------------------------------------------------------- the writer
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

    def __init__(self, run_dir: str | Path, config_yaml: str | None = None, keep_checkpoints: int = 2):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.dir)  # before anything is written: a second process stops here
        self.keep = keep_checkpoints
        if config_yaml is not None and not self.is_finished():  # a finished run's provenance is never rewritten
            old = self.dir / CONFIG
            if old.exists() and old.read_text() != config_yaml:
                atomic_write_text(self.dir / "config.previous.yaml", old.read_text())
            atomic_write_text(old, config_yaml)
            env = environment()
            if (self.dir / ENV).exists():  # a resumed run keeps its first env.json; each resume is appended
                _append_line(self.dir / "env.resumes.jsonl", json.dumps(env, default=_jsonable) + "\n")
            else:
                atomic_write_json(self.dir / ENV, env)

    def close(self) -> None:
        """Release the run directory's lock (idempotent)."""
        if self._lock is not None:
            _unlock(self._lock)
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
        _append_line(self.metrics_path, json.dumps(row, default=_jsonable) + "\n")
        return row

    def log_eval(self, step: int, results: dict) -> None:
        """Append intermediate evaluation results (eval.jsonl), same crash-safety as metrics."""
        _append_line(self.dir / EVALS, json.dumps({"step": step, **results}, default=_jsonable) + "\n")

    def read_summary(self) -> dict | None:
        return read_summary(self.dir)

    def write_summary(self, summary: dict, merge: bool = True) -> dict:
        path = self.dir / SUMMARY
        if merge and path.exists():
            old = read_summary(self.dir)
            if old is None:  # unreadable: keep it for inspection, write the new one whole
                _warn(f"{path} is unreadable; kept as {_set_aside(path, 'corrupt').name}, writing a new one")
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
        with _writing(final, tmp):
            tmp.mkdir(parents=True)
            with open(tmp / "state.pt", "wb") as f:  # a file object: a failed write keeps its OSError (errno)
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            for name, obj in (extra_files or {}).items():
                if callable(obj):
                    obj(tmp / name)
                else:
                    (tmp / name).write_text(obj if isinstance(obj, str) else json.dumps(obj, default=_jsonable))
            sums = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
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

    def resume(self, map_location=None) -> tuple[int, dict | None]:
        """Where this run continues: ``(k, state)`` of the newest checkpoint that is intact and whose steps
        1..k metrics.jsonl holds exactly once, or ``(0, None)`` for a fresh start. Newer checkpoints that fail
        either test are set aside (``step_N.corrupt-<time>`` / ``step_N.unused-<time>``) with a warning; when
        every checkpoint fails, a ``UserError`` names each and why, and nothing is changed. Then metrics.jsonl
        and eval.jsonl keep exactly their lines of steps 1..k."""
        metrics = _scan_jsonl(self.metrics_path, steps=True)
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
            raise UserError(f"cannot resume {self.dir}: " + "; ".join(f"{ck.name}: {why}" for ck, _, why in skipped)
                            + f". {hint.capitalize()}, or move {self.dir / CKPTS} aside to train again from step 0")
        k = _step_of(chosen) if chosen is not None else 0
        state = _load_state(chosen, map_location) if chosen is not None else None
        for ck, kind, why in skipped:
            aside = _set_aside(ck, kind)
            _warn(f"not resuming from {ck}: {why}; set it aside as {aside.name} and resuming from step {k}")
        metrics.warn_bad()
        _keep_steps_upto(metrics, k)
        evals = _scan_jsonl(self.dir / EVALS, steps=True)
        evals.warn_bad()
        _keep_steps_upto(evals, k)
        for tmp in (self.dir / CKPTS).glob("step_*.tmp"):  # a save killed midway (we hold the lock: not in use)
            shutil.rmtree(tmp, ignore_errors=True)
        return k, state


def _step_of(ck: Path) -> int:
    return int(_STEP_DIR.fullmatch(ck.name).group(1))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_checkpoint(ck: Path) -> str | None:
    """Why checkpoint directory ``ck`` is damaged (a file missing, truncated or changed); None when intact.
    Checked against its ``sha256.json``; a checkpoint saved before checksums were recorded is checked through the
    CRCs of its zip container (what ``torch.save`` writes)."""
    state = ck / "state.pt"
    if not (ck / CHECKSUMS).exists():
        try:
            with zipfile.ZipFile(state) as z:
                bad = z.testzip()
        except (OSError, zipfile.BadZipFile, EOFError) as e:
            return f"{state} is not a readable checkpoint ({e})"
        return None if bad is None else f"{state} fails its CRC check (member {bad})"
    try:
        sums = json.loads((ck / CHECKSUMS).read_text())
    except (OSError, ValueError) as e:
        return f"its checksum file {ck / CHECKSUMS} is unreadable ({e})"
    if not isinstance(sums, dict) or "state.pt" not in sums:
        return f"its checksum file {ck / CHECKSUMS} does not list state.pt"
    for name, want in sums.items():
        p = ck / name
        if not p.is_file():
            return f"{p} is missing"
        if _sha256(p) != want:
            return f"{p} does not match the sha256 recorded when it was saved ({p.stat().st_size} bytes now)"
    return None


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
        _warn(f"{path} is unreadable ({why})")
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
            _warn(f"skipping run {d}: {d / CONFIG} is unreadable ({type(e).__name__}: {e})".replace("\n", " "))
            continue
        if not isinstance(cfg, dict):
            _warn(f"skipping run {d}: {d / CONFIG} is a YAML {type(cfg).__name__}, not a mapping")
            continue
        row = {"run_dir": str(d)}
        row.update({f"cfg.{k}": v for k, v in _flatten(cfg).items()})
        if (d / SUMMARY).exists():
            summary, why = _read_summary(d / SUMMARY)
            if why is not None:
                _warn(f"skipping run {d}: {d / SUMMARY} is unreadable ({why})")
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
