"""Optuna storage for sweeps: an ``RDBStorage`` with heartbeats and retries, made safe for several SQLite writers.

Any SQLAlchemy URL works (``postgresql://user@host/db`` for workers on several machines); a SQLite file serves the
workers of one machine. Optuna's stale-trial callback re-enqueues a trial whose worker stopped beating with the same
parameters (and user attributes: the retry finds its run directory there and resumes it).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

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


def make_storage(url: str, heartbeat: int = 10):
    """An ``RDBStorage`` with heartbeats (stale trials: no beat for 3 × ``heartbeat`` s, failed and retried); for
    SQLite a long busy timeout and the WAL journal so several processes can write one file."""
    import inspect

    import optuna

    if url.startswith("sqlite:///") and ":memory:" not in url:
        import sqlite3

        path = Path(url[len("sqlite:///"):])
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
