"""Fault-safe files of a run directory: atomic writes, fsync'ed appends, JSON-lines reading that skips a bad line
without stopping, the directory lock, checkpoint checksums. Standard library only (``paper_figures`` reads through
``qerl.results``, which uses this module, without importing torch).

Faults are reported where they are met: a full disk as a ``UserError`` naming the file being written (temporary
files removed), a skipped line, file or checkpoint as a ``ResultsWarning`` naming it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import shutil
import sys
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl.errors import UserError

try:
    import fcntl
except ImportError:  # not POSIX (Windows): run directories are not locked there
    fcntl = None

LOCK, CHECKSUMS = ".lock", "sha256.json"
# Warnings are attributed to the first caller outside these files (their message names the file at fault).
_INTERNAL = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.py")}


class ResultsWarning(UserWarning):
    """Something in a run directory was skipped or set aside (a corrupt line or summary, a damaged checkpoint)."""


def warn(message: str) -> None:
    """Warn, attributed to the first caller outside this module and ``qerl.results`` (the message names the file)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _INTERNAL:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, ResultsWarning, stacklevel=level)


def out_of_space(e: BaseException | None) -> bool:
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
def writing(path: Path, *partial: Path):
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
        if out_of_space(e):
            raise UserError(f"no space left writing {path}; free some space and rerun (the run resumes from its "
                            f"last checkpoint)") from e
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file so that readers see either the old or the new content, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it. A failed write (disk full) is cut back off, so the file never keeps half a
    line in front of the lines a resumed run appends."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        with writing(path):
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


def aside_path(path: Path, why: str) -> Path:
    """A free name ``<name>.<why>-<time>`` beside ``path`` (ignored by every reader, kept for inspection)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.{why}-{stamp}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.{why}-{stamp}.{n}")
    return aside


def set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to ``aside_path(path, why)``; returns the new name."""
    aside = aside_path(path, why)
    os.replace(path, aside)
    return aside


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """``atomic_write_text`` of ``obj`` as indented JSON (tensors, paths, sets become plain values)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=jsonable) + "\n")


def jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


# ------------------------------------------------------------------------------------------------- JSON lines
@dataclass
class JsonLines:
    """A JSON-lines file as read: the good rows with their line numbers and text, and the bad lines."""

    path: Path
    exists: bool = False
    rows: list[tuple[int, str, dict]] = field(default_factory=list)  # (line number, text, row)
    bad: list[tuple[int, str]] = field(default_factory=list)         # (line number, why); a torn tail excluded
    torn: bool = False  # the last line was cut short (a crash mid-append): expected, dropped without a warning

    def warn_bad(self) -> None:
        for n, why in self.bad:
            warn(f"{self.path}:{n}: skipping a corrupt line ({why})")


def scan_jsonl(path: Path, steps: bool = False) -> JsonLines:
    """Read every line; a bad one is recorded and skipped, never the end of the file. ``steps``: a row must also
    carry a positive integer ``step`` (metrics and eval lines)."""
    out = JsonLines(Path(path))
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
    lines = scan_jsonl(Path(path))
    lines.warn_bad()
    return [row for _, _, row in lines.rows]


def spans(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


# ------------------------------------------------------------------------------------------------- the lock
_HELD: dict[Path, list] = {}  # run directory -> [open lock file, RunWriters of this process holding it]


def lock_dir(run_dir: Path) -> Path:
    """Take the run directory's lock (one writing process at a time). ``flock`` dies with its process, so a
    SIGKILLed run never leaves a stale lock; RunWriters of one process share it."""
    key = run_dir.resolve()
    if key in _HELD:
        _HELD[key][1] += 1
        return key
    if fcntl is None:
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


def unlock_dir(key: Path) -> None:
    """Drop one holder of the lock taken by ``lock_dir``; the last one releases it."""
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _HELD[key]
        held[0].close()  # closing the file releases the flock


# ------------------------------------------------------------------------------------------------- checksums
def sha256_file(path: Path) -> str:
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
        if sha256_file(p) != want:
            return f"{p} does not match the sha256 recorded when it was saved ({p.stat().st_size} bytes now)"
    return None
