"""Reward functions for math RL (QERL.md §5): math-verify accuracy, format rewards, the official GSM8K rewards.

Every reward is `fn(completions, answers, *, stats=None) -> list[float]` and lives in the plain registry `REWARDS`.
`combined(names, weights)` sums several with weights and keeps each function's values for logging.

Why a process pool: math-verify (sympy) can hang or eat all memory on short inputs (`\\boxed{9^{9^{9^9}}}`, an
unclosed `${{{...`), and its own timeouts use `signal.alarm`, which raises outside the main thread and cannot
interrupt long C-level integer arithmetic anyway. So:
  1. extraction (`<answer>`, `\\boxed{}`, `#### N`) is done here with linear-time string code and length caps;
  2. easy cases (plain numbers, identical strings) are decided in-process, no sympy involved;
  3. the rest goes to `VerifierPool`: worker *processes* running math-verify with its signal timeouts as a soft
     limit and, as the hard limit, a per-item wall-clock deadline after which the worker is SIGKILLed and replaced.
     A timed-out or crashed item scores 0.0 and is counted in `stats["reward_errors"]`.
The default pool starts lazily on first use (about a second per worker to import and warm up sympy), is shared by all threads
(calls are serialised by a lock), survives forks (the child builds its own), and is shut down at exit.
Workers die with the thread that spawned them (PR_SET_PDEATHSIG), so a killed trainer leaves no orphans.
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

MAX_ANSWER_CHARS = 2000  # an extracted answer longer than this scores 0.0 without being parsed
MAX_FALLBACK_CHARS = 4000  # with no answer marker, only the completion's tail is parsed
DEFAULT_TIMEOUT_S = 5.0  # hard wall-clock limit per verified item
DEFAULT_BATCH_TIMEOUT_S = 120.0  # hard limit for one call; items left unscored get 0.0

RewardFn = Callable[..., list]

# --------------------------------------------------------------------------------------------------------------
# Extraction: linear time, no backtracking regexes over the whole completion.


def _text(c) -> str:
    """A completion as text; chat-style `[{"role": ..., "content": ...}]` lists give their last message."""
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        c = c[-1].get("content", "")
    return c if isinstance(c, str) else ("" if c is None else str(c))


def last_answer_block(text: str) -> str | None:
    """Content of the last complete `<answer>…</answer>` block, or None."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>") : end] if start >= 0 else None


def _braced(text: str, j: int, limit: int) -> str | None:
    """Content of the brace group opening at text[j] == '{' (escaped braces skipped), or None if unclosed in `limit`."""
    depth, k, stop = 0, j, min(len(text), j + limit + 2)
    while k < stop:
        ch = text[k]
        if ch == "\\":
            k += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
        k += 1
    return None


def last_boxed(text: str, max_tries: int = 16) -> str | None:
    """Content of the last balanced `\\boxed{…}` (at most MAX_ANSWER_CHARS long), or None."""
    pos = len(text)
    for _ in range(max_tries):
        i = text.rfind("\\boxed", 0, pos)
        if i < 0:
            return None
        j = i + len("\\boxed")
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            inner = _braced(text, j, MAX_ANSWER_CHARS)
            if inner is not None:
                return inner
        pos = i
    return None


_HASH_LEAD_NUM = re.compile(r"\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def last_hash_answer(text: str) -> str | None:
    """What follows the last `####` on its line (its leading number if it starts with one), or None."""
    i = text.rfind("####")
    if i < 0:
        return None
    line = text[i + 4 : i + 4 + 200].split("\n", 1)[0]
    m = _HASH_LEAD_NUM.match(line)
    return m.group(1) if m else (line.strip() or None)


def extract_answer(completion: str) -> tuple[str, str]:
    """(answer text, where) with where in answer_tag | boxed | hash | full (the last MAX_FALLBACK_CHARS)."""
    for where, fn in (("answer_tag", last_answer_block), ("boxed", last_boxed), ("hash", last_hash_answer)):
        got = fn(completion)
        if got is not None:
            return got, where
    return completion[-MAX_FALLBACK_CHARS:], "full"


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def wrap_latex(s: str) -> str:
    """`$s$` unless s already holds an unescaped `$` (how QERL.md §5 feeds golds to math-verify)."""
    return s if _UNESCAPED_DOLLAR.search(s) or "\\(" in s or "\\[" in s else f"${s}$"


def as_number(s: str) -> Decimal | None:
    """A plain decimal number ('1,080', '025', '$18', '27.0', '\\$42') as Decimal, else None."""
    s = s.strip()
    if len(s) > 64:
        return None
    s = re.sub(r"\s+", "", s.replace("\\$", "").replace("$", "").replace("{,}", ",").replace("\\!", "")).rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def quick_verdict(gold: str, pred: str) -> float | None:
    """Decide easy cases without sympy: equal numbers -> 1, unequal integers -> 0, identical strings -> 1."""
    g, p = as_number(gold), as_number(pred)
    if g is not None and p is not None:
        if g == p:
            return 1.0
        if g == g.to_integral_value() and p == p.to_integral_value():
            return 0.0
        return None  # unequal non-integers: math-verify's rounding rules decide
    squash = lambda x: re.sub(r"\s+", "", x)
    if squash(gold) and squash(gold) == squash(pred):
        return 1.0
    return None


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
        for c in cands:  # the first candidate that parses decides
            p = parse(c, parsing_timeout=soft)
            if p:
                return float(verify(g, p, timeout_seconds=soft))
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

    `verify(jobs)` takes [(gold, [candidate, ...]), ...] and returns [(score, error or None), ...]: the first
    candidate that math-verify can parse is compared with the gold (wrapped in `$…$`). Thread-safe; use as a
    context manager or call `close()`; `counters` holds items / timeouts / crashes / restarts.
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

# --------------------------------------------------------------------------------------------------------------
# Reward functions.


def _bump(stats: dict | None, key: str, n: int = 1) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0) + n


def _check(completions, answers):
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")


def accuracy(completions: Sequence, answers: Sequence, *, stats: dict | None = None,
             pool: VerifierPool | None = None) -> list[float]:
    """1.0 if math-verify finds the completion's answer equal to the gold, else 0.0 (QERL.md §5 accuracy_reward).

    The answer is taken from the last `<answer>…</answer>`, else the last `\\boxed{}`, else the last `#### N`,
    else the whole completion's tail (math-verify's LaTeX + expression extraction). Gold is wrapped in `$…$`.
    Timeouts and crashes score 0.0 and count in stats["reward_errors"].
    """
    _check(completions, answers)
    out = [0.0] * len(completions)
    jobs, where = [], []
    for i, (c, a) in enumerate(zip(completions, answers, strict=True)):
        text, gold = _text(c), ("" if a is None else str(a).strip())
        pred, kind = extract_answer(text)
        pred = pred.strip()
        if not gold or not pred:
            continue
        if kind != "full":
            if len(pred) > MAX_ANSWER_CHARS:
                _bump(stats, "reward_answer_too_long")
                continue
            v = quick_verdict(gold, pred)
            if v is not None:
                out[i] = v
                _bump(stats, "reward_fast")
                continue
            cands = [pred] if wrap_latex(pred) == pred else [wrap_latex(pred), pred]
        else:
            cands = [pred]
        jobs.append((gold, cands))
        where.append(i)
    if jobs:
        res = (pool or get_pool()).verify(jobs)
        for i, (score, err) in zip(where, res, strict=True):
            out[i] = score
            if err in ("timeout", "batch_timeout", "soft_timeout"):
                _bump(stats, "reward_timeouts")
            if err is not None:
                _bump(stats, "reward_errors")
        _bump(stats, "reward_verified", len(jobs))
    return out


_THINK_CLOSE_THEN_ANSWER = re.compile(r"</think>\s*<answer>")


def soft_format(completions: Sequence, answers: Sequence | None = None, *, stats=None) -> list[float]:
    """0.2 if `<think>.*?</think>\\s*<answer>.*?</answer>` (DOTALL) matches anywhere (official code), else 0.0.

    Same truth value as the official `re.search`, computed in linear time (the regex is quadratic on junk).
    """
    out = []
    for c in completions:
        t = _text(c)
        i = t.find("<think>")
        m = _THINK_CLOSE_THEN_ANSWER.search(t, i + len("<think>")) if i >= 0 else None
        out.append(0.2 if m is not None and t.find("</answer>", m.end()) >= 0 else 0.0)
    return out


def think_format(completions: Sequence, answers: Sequence | None = None, *, stats=None) -> list[float]:
    """0.2 if `<think>.+?</think>` (DOTALL) matches (official `think_reward_func`), else 0.0; linear time."""
    out = []
    for c in completions:
        t = _text(c)
        i = t.find("<think>")
        out.append(0.2 if i >= 0 and t.find("</think>", i + len("<think>") + 1) >= 0 else 0.0)
    return out


def official_xml_answer(text: str) -> str:
    """Official `extract_xml_answer`: text after the last `<answer>`, up to the next `</answer>`, stripped."""
    i = text.rfind("<answer>")
    a = text[i + len("<answer>") :] if i >= 0 else text
    j = a.find("</answer>")
    return (a[:j] if j >= 0 else a).strip()


def gsm8k_exact(completions: Sequence, answers: Sequence, *, stats=None) -> list[float]:
    """2.0 if the stripped last `<answer>` text equals the gold string exactly (official code at e8c6e79)."""
    _check(completions, answers)
    return [2.0 if official_xml_answer(_text(c)) == str(a).strip() else 0.0
            for c, a in zip(completions, answers, strict=True)]


_STRICT_HASH = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_hash(completions: Sequence, answers: Sequence, *, stats=None) -> list[float]:
    """1.0 if the last strict `#### (-?[0-9.,]+)` match, commas and `$` removed, equals the gold (official
    `gsm8k_score` before 2025-11-27). The gold's commas are removed too; the official code kept them, so its
    answers like `1,080` could never be matched."""
    _check(completions, answers)
    out = []
    for c, a in zip(completions, answers, strict=True):
        found = _STRICT_HASH.findall(_text(c))
        pred = found[-1].replace(",", "").replace("$", "") if found else None
        out.append(1.0 if pred is not None and pred == str(a).strip().replace(",", "") else 0.0)
    return out


REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy,
    "soft_format": soft_format,
    "think_format": think_format,
    "gsm8k_exact": gsm8k_exact,
    "gsm8k_hash": gsm8k_hash,
}


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}")
    return REWARDS[name]


@dataclass
class RewardOutput:
    """Weighted total per completion, each function's own values, and counters (reward_errors, ...)."""

    total: list[float]
    per_function: dict[str, list[float]]
    stats: dict[str, int]

    def metrics(self) -> dict[str, float]:
        """Flat means/stds for a metrics line: reward, reward_std, rewards/<fn>/mean|std, reward_errors, ..."""
        def ms(v):
            m = sum(v) / len(v) if v else 0.0
            return m, (sum((x - m) ** 2 for x in v) / len(v)) ** 0.5 if v else 0.0

        out = dict(zip(("reward", "reward_std"), ms(self.total), strict=True))
        for k, v in self.per_function.items():
            out[f"rewards/{k}/mean"], out[f"rewards/{k}/std"] = ms(v)
        out.update({k: float(v) for k, v in self.stats.items()})
        return out


def combined(names: Sequence[str], weights: Sequence[float] | None = None) -> Callable[..., RewardOutput]:
    """A callable (completions, answers) -> RewardOutput with total = Σ_k w_k · r_k (weights default to 1)."""
    names = list(names)
    fns = [get_reward(n) for n in names]
    weights = [1.0] * len(names) if weights is None else [float(w) for w in weights]
    if len(weights) != len(names) or not names:
        raise ValueError(f"need one weight per reward: names={names}, weights={weights}")

    def score(completions: Sequence, answers: Sequence) -> RewardOutput:
        _check(completions, answers)
        stats = {"reward_errors": 0}
        per = {n: [float(x) for x in fn(completions, answers, stats=stats)] for n, fn in zip(names, fns, strict=True)}
        total = [sum(w * per[n][i] for n, w in zip(names, weights, strict=True)) for i in range(len(completions))]
        return RewardOutput(total, per, stats)

    return score
