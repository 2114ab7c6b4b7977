"""The math-verify worker pool behind ``qerl.rewards.accuracy``.

math-verify (sympy) can hang or eat all memory on short inputs (``\\boxed{9^{9^{9^9}}}``, an unclosed ``${{{…``),
and its own timeouts use ``signal.alarm``, which raises outside the main thread and cannot interrupt long C-level
integer arithmetic anyway. ``VerifierPool`` runs math-verify in worker *processes*, with its signal timeouts as a
soft limit and, as the hard limit, a per-item wall-clock deadline after which the worker is SIGKILLed and replaced.
The default pool starts lazily on first use, is shared by all threads (calls are serialised by a lock), survives
forks (the child builds its own), and is shut down at exit. Workers die with the thread that spawned them
(PR_SET_PDEATHSIG), so a killed trainer leaves no orphans. A worker loads this file by path (standard library and
math-verify only), so no package import happens there.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field

DEFAULT_TIMEOUT_S = 5.0  # hard wall-clock limit per verified item
DEFAULT_BATCH_TIMEOUT_S = 120.0  # hard limit for one call; items left unscored get 0.0
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def wrap_latex(s: str) -> str:
    """`$s$` unless s already holds an unescaped `$` (how QERL.md §5 feeds golds to math-verify)."""
    return s if _UNESCAPED_DOLLAR.search(s) or "\\(" in s or "\\[" in s else f"${s}$"

# --------------------------------------------------------------------------------------------------------------
# The worker process (runs this very file, loaded by path, so no package import happens in the worker).


def _worker_main() -> None:  # pragma: no cover - runs in a subprocess
    parent, soft, mem_mb = int(sys.argv[2]), int(sys.argv[3]) or None, int(sys.argv[4])
    with suppress(Exception):  # die with the parent's spawning thread, even while stuck in C code
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)
    proto = os.fdopen(os.dup(1), "w", encoding="ascii")
    os.dup2(2, 1)  # stray prints go to stderr, never into the protocol
    if mem_mb > 0:
        with suppress(Exception):
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
    import logging

    from math_verify import parse, verify

    timeouts = []

    class _Count(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Timeout during"):
                timeouts.append(1)

    mv_log = logging.getLogger("math_verify")
    mv_log.handlers[:] = [_Count(logging.WARNING)]
    mv_log.setLevel(logging.WARNING)
    mv_log.propagate = False
    gold_cache: dict[str, list] = {}

    def score(gold: str, cands: list[str]) -> float:
        if gold not in gold_cache:
            if len(gold_cache) > 4096:
                gold_cache.clear()
            gold_cache[gold] = parse(wrap_latex(gold), parsing_timeout=soft)
        g = gold_cache[gold]
        if not g:
            return 0.0
        # Every candidate gets its turn: one that parses but does not verify must not end the search. The
        # `$…$` reading of "It is 18" parses (as a product of one-letter symbols) and is wrong; the reading after
        # it ("18", see qerl.rewards.prose_free) is right.
        for c in cands:
            p = parse(c, parsing_timeout=soft)
            if p and verify(g, p, timeout_seconds=soft):
                return 1.0
        return 0.0

    score("\\frac{1}{2}", ["$0.5$"])  # warm up sympy/antlr before taking timed work
    proto.write('{"ready": true}\n')
    proto.flush()
    for line in sys.stdin.buffer:
        req = json.loads(line)
        timeouts.clear()
        try:
            s = score(req["gold"], req["cands"])
            err = "soft_timeout" if (timeouts and s == 0.0) else None
        except BaseException as e:  # MemoryError, RecursionError, anything sympy throws
            s, err = 0.0, f"crash:{type(e).__name__}"
        proto.write(json.dumps({"id": req["id"], "score": s, "error": err}) + "\n")
        proto.flush()


# --------------------------------------------------------------------------------------------------------------
# The pool.


@dataclass
class _Worker:
    proc: subprocess.Popen
    start_deadline: float
    ready: bool = False
    job: int | None = None
    deadline: float = 0.0
    buf: bytes = b""


_BOOT = (
    "import importlib.util,sys;s=importlib.util.spec_from_file_location('_qerl_reward_worker',sys.argv[1]);"
    "m=importlib.util.module_from_spec(s);sys.modules[s.name]=m;s.loader.exec_module(m);m._worker_main()"
)


@dataclass
class VerifierPool:
    """Worker processes running math-verify, with a hard per-item wall-clock timeout (kill + respawn).

    `verify(jobs)` takes [(gold, [candidate, ...]), ...] and returns [(score, error or None), ...]: 1.0 if any
    candidate, tried in order, parses and verifies equal to the gold (wrapped in `$…$`), else 0.0. Thread-safe;
    use as a context manager or call `close()`; `counters` holds items / timeouts / crashes / restarts.
    """

    num_workers: int = 0  # 0: min(4, cpu count)
    timeout_s: float = DEFAULT_TIMEOUT_S
    batch_timeout_s: float = DEFAULT_BATCH_TIMEOUT_S
    startup_timeout_s: float = 120.0
    soft_timeout_s: int | None = None  # math-verify's own (signal) timeout inside a worker; None: 0.6 * timeout_s
    memory_limit_mb: int = 4096  # RLIMIT_AS per worker; 0 disables
    counters: dict = field(default_factory=lambda: {"items": 0, "timeouts": 0, "crashes": 0, "restarts": 0})

    def __post_init__(self):
        self.num_workers = self.num_workers or min(4, os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._reset()

    def _reset(self):
        self._pid = os.getpid()
        self._workers: list[_Worker] = []
        self._sel = selectors.DefaultSelector()
        # Workers are spawned from this long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that forked
        # a worker exits, so spawning from a short-lived caller thread would kill the workers with it.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="qerl-reward-spawn")
        self._start_failures = 0

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def start(self, wait: bool = False) -> VerifierPool:
        """Spawn the workers now (otherwise the first `verify` does); `wait=True` blocks until they are ready."""
        with self._lock:
            self._prepare()
            if wait:
                self._run([], [], time.monotonic() + self.startup_timeout_s, until_ready=True)
        return self

    def close(self) -> None:
        """Kill all workers; the pool can be used again afterwards (it respawns)."""
        with self._lock:
            if self._pid != os.getpid():
                return self._reset()
            for w in list(self._workers):
                self._drop(w)
            self._spawner.shutdown(wait=False)
            self._reset()

    def verify(self, jobs: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[float, str | None]]:
        results: list = [None] * len(jobs)
        if not jobs:
            return results
        with self._lock:
            self._prepare()
            self._run(jobs, results, time.monotonic() + self.batch_timeout_s)
            self.counters["items"] += len(jobs)
        return results

    # -- internals (called with the lock held) --
    def _prepare(self):
        if self._pid != os.getpid():  # inherited through fork: the parent's workers are not ours
            self._reset()
        for w in [w for w in self._workers if w.proc.poll() is not None]:
            self._drop(w)
        while len(self._workers) < self.num_workers:
            self._spawn()

    def _spawn(self):
        soft = self.soft_timeout_s if self.soft_timeout_s is not None else max(1, int(self.timeout_s * 0.6))
        cmd = [sys.executable, "-c", _BOOT, os.path.abspath(__file__), str(os.getpid()), str(soft),
               str(self.memory_limit_mb)]
        # own session: a Ctrl-C meant for the trainer does not hit the workers mid-item (they die with it anyway)
        popen = lambda: subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                         start_new_session=True)
        w = _Worker(self._spawner.submit(popen).result(), time.monotonic() + self.startup_timeout_s)
        self._sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        self._workers.append(w)

    def _drop(self, w: _Worker):
        with suppress(KeyError, ValueError):
            self._sel.unregister(w.proc.stdout)
        with suppress(Exception):
            w.proc.kill()
            w.proc.wait(timeout=5)
        for f in (w.proc.stdin, w.proc.stdout):
            with suppress(Exception):
                f.close()
        self._workers.remove(w)

    def _replace(self, w: _Worker):
        self._drop(w)
        self.counters["restarts"] += 1
        self._spawn()

    def _finish(self, w: _Worker, results, score, err):
        if w.job is not None:
            results[w.job] = (score, err)
            if err == "timeout":
                self.counters["timeouts"] += 1
            elif err and err.startswith("crash"):
                self.counters["crashes"] += 1
        w.job = None

    def _run(self, jobs, results, t_end, until_ready=False):
        pending = deque(range(len(jobs)))
        while True:
            busy = [w for w in self._workers if w.job is not None]
            if until_ready and all(w.ready for w in self._workers):
                return
            if not until_ready and not pending and not busy:
                return
            now = time.monotonic()
            if now > t_end:  # the whole call ran out of time: everything unscored gets 0.0
                for w in busy:
                    self._finish(w, results, 0.0, "batch_timeout")
                    self._replace(w)
                for i in pending:
                    results[i] = (0.0, "batch_timeout")
                return
            for w in list(self._workers):
                if w.ready and w.job is None and pending:
                    i = pending.popleft()
                    msg = json.dumps({"id": i, "gold": jobs[i][0], "cands": list(jobs[i][1])}) + "\n"
                    try:
                        w.proc.stdin.write(msg.encode("ascii"))
                        w.job, w.deadline = i, time.monotonic() + self.timeout_s
                    except OSError:  # died while idle: retry the item elsewhere
                        pending.appendleft(i)
                        self._replace(w)
            waits = [w.deadline if w.job is not None else (w.start_deadline if not w.ready else t_end)
                     for w in self._workers]
            for key, _ in self._sel.select(max(0.0, min(waits + [t_end]) - time.monotonic())):
                self._on_readable(key.data, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.job is not None and now > w.deadline:
                    self._finish(w, results, 0.0, "timeout")
                    self._replace(w)
                elif not w.ready and now > w.start_deadline:
                    self._start_failed(w)

    def _start_failed(self, w: _Worker):
        self._start_failures += 1
        if self._start_failures >= 3 * self.num_workers:
            raise RuntimeError(
                "qerl.rewards: math-verify worker processes keep failing to start (see their stderr above); "
                "is math-verify installed for " + sys.executable + "?")
        self._replace(w)

    def _on_readable(self, w: _Worker, results):
        if w not in self._workers:
            return
        data = os.read(w.proc.stdout.fileno(), 1 << 16)
        if not data:  # the worker died: segfault, OOM kill, failed import
            if not w.ready:
                return self._start_failed(w)
            self._finish(w, results, 0.0, "crash:exit")
            return self._replace(w)
        w.buf += data
        while b"\n" in w.buf:
            line, w.buf = w.buf.split(b"\n", 1)
            msg = json.loads(line)
            if msg.get("ready"):
                w.ready, self._start_failures = True, 0
            elif msg.get("id") == w.job:
                self._finish(w, results, float(msg["score"]), msg.get("error"))


_POOL: VerifierPool | None = None
_POOL_LOCK = threading.Lock()
_POOL_KW: dict = {}


def configure_pool(**kw) -> None:
    """Set the default pool's VerifierPool arguments (num_workers, timeout_s, ...); closes a running one.
    Environment: QERL_REWARD_WORKERS, QERL_REWARD_TIMEOUT_S."""
    global _POOL
    with _POOL_LOCK:
        _POOL_KW.clear()
        _POOL_KW.update(kw)
        if _POOL is not None:
            _POOL.close()
            _POOL = None


def get_pool() -> VerifierPool:
    """The process-wide default VerifierPool (created on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            kw = {"num_workers": int(os.environ.get("QERL_REWARD_WORKERS", 0)),
                  "timeout_s": float(os.environ.get("QERL_REWARD_TIMEOUT_S", DEFAULT_TIMEOUT_S)), **_POOL_KW}
            _POOL = VerifierPool(**kw)
        return _POOL


def shutdown_pool() -> None:
    """Stop the default pool's workers (also runs at interpreter exit)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


def _forget_pool_in_child() -> None:  # a forked child must not touch the parent's workers or a held lock
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


atexit.register(shutdown_pool)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)
