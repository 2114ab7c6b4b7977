"""Optuna storage for sweeps: an ``RDBStorage`` with heartbeats and retries, made safe for several SQLite writers.

Any SQLAlchemy URL works (``postgresql://user@host/db`` for workers on several machines); a SQLite file serves the
workers of one machine. Optuna's stale-trial callback re-enqueues a trial whose worker stopped beating with the same
parameters (and user attributes: the retry finds its run directory there and resumes it).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from qerl.errors import UserError

MAX_RETRY = 3  # a trial whose worker dies more often than this counts as FAIL


def retry_callback():
    """Optuna's callback that re-enqueues a dead trial (up to MAX_RETRY times); named per Optuna version."""
    import optuna

    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(max_retry=MAX_RETRY)


def default_storage(out_dir: str | Path, study: str) -> str:
    """The default study file: ``sqlite:///<out_dir>/sweeps/<study>.db``."""
    return f"sqlite:///{Path(out_dir) / 'sweeps' / f'{study}.db'}"


@contextlib.contextmanager
def storage_errors(url: str):
    """Turn a bad storage URL, a missing driver, an unreachable server or a corrupt SQLite file met inside the
    block into a ``UserError`` of one line that echoes ``url`` (the drivers' own messages name neither)."""
    import sqlite3

    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

    shown = _masked(url)
    try:
        yield
    except (ArgumentError, NoSuchModuleError) as e:
        raise UserError(f"study storage {shown!r} is not a valid storage URL ({_first_line(e)}); give "
                        f"sqlite:///path/to/study.db or a SQLAlchemy database URL such as "
                        f"postgresql://user@host/db") from None
    except ImportError as e:
        raise UserError(f"study storage {shown!r}: the database driver for this URL is not installed "
                        f"({_first_line(e)})") from None
    except (sqlite3.DatabaseError, SQLAlchemyError) as e:
        orig = getattr(e, "orig", None) or e
        if url.startswith("sqlite:///") and isinstance(orig, sqlite3.DatabaseError):
            raise UserError(f"study storage {shown!r}: {_sqlite_path(url)} is not a readable SQLite study "
                            f"({_first_line(orig)}); restore it from a copy, or move it aside to start the study "
                            f"anew") from None
        raise UserError(f"study storage {shown!r}: {_first_line(orig)}") from None
    except OSError as e:
        raise UserError(f"study storage {shown!r}: {e}") from None


def _masked(url: str) -> str:
    """``url`` with its password (if any) hidden: the message goes to logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _sqlite_path(url: str) -> Path:
    return Path(url[len("sqlite:///"):])


def make_storage(url: str, heartbeat: int = 10):
    """An ``RDBStorage`` with heartbeats (stale trials: no beat for 3 × ``heartbeat`` s, failed and retried); for
    SQLite a long busy timeout and the WAL journal so several processes can write one file. A URL or file that
    cannot serve as a study is a ``UserError`` naming it."""
    with storage_errors(url):
        return _make_storage(url, heartbeat)


def _make_storage(url: str, heartbeat: int):
    import inspect

    import optuna

    if url.startswith("sqlite:///") and ":memory:" not in url:
        import sqlite3

        path = _sqlite_path(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(path, timeout=120)) as con:
            con.execute("PRAGMA journal_mode=WAL")  # persistent in the file: readers never block the writer
        engine = {"connect_args": {"timeout": 120}}
    else:
        engine = {"pool_pre_ping": True}
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    cb = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else "failed_trial_callback"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=heartbeat,
                                             grace_period=3 * heartbeat, **{cb: retry_callback()})
    if url.startswith("sqlite"):
        _immediate_transactions(storage.engine)
    return storage


def _immediate_transactions(engine) -> None:
    """Make every SQLite transaction ``BEGIN IMMEDIATE`` (the SQLAlchemy pysqlite recipe).

    Optuna reads a row, checks its state and writes it in one transaction, relying on ``SELECT … FOR UPDATE``, which
    SQLite ignores: with deferred transactions two processes both see a WAITING trial as WAITING and both run it
    (or both fail the same stale trial and enqueue two retries). Taking the write lock at BEGIN serializes them.
    """
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, record):
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened while the storage set itself up do not have the hooks
