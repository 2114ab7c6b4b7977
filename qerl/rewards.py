"""Reward functions for math RL (QERL.md §5): math-verify accuracy, format rewards, the official GSM8K rewards.

Every reward is `fn(completions, answers, *, stats=None) -> list[float]` and lives in the plain registry `REWARDS`.
`combined(names, weights)` sums several with weights and keeps each function's values for logging.

Why a process pool (`qerl.verify_pool`): math-verify (sympy) can hang or eat all memory on short inputs
(`\\boxed{9^{9^{9^9}}}`, an unclosed `${{{...`), and its own timeouts use `signal.alarm`, which raises outside the
main thread and cannot interrupt long C-level integer arithmetic anyway. So:
  1. extraction (`<answer>`, `\\boxed{}`, `#### N`, and an answer's one math span when it is written in words) is
     done here with linear-time string code and length caps;
  2. easy cases (plain numbers, identical strings) are decided in-process, no sympy involved;
  3. the rest goes to `VerifierPool`: worker *processes* running math-verify with its signal timeouts as a soft
     limit and, as the hard limit, a per-item wall-clock deadline after which the worker is SIGKILLed and replaced.
     A timed-out or crashed item scores 0.0 and is counted in `stats["reward_errors"]`.
The default pool starts lazily on first use (about a second per worker to import and warm up sympy), is shared by all threads
(calls are serialised by a lock), survives forks (the child builds its own), and is shut down at exit.
Workers die with the thread that spawned them (PR_SET_PDEATHSIG), so a killed trainer leaves no orphans.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from qerl.verify_pool import (  # noqa: F401  (re-exported: the pool is part of the rewards API)
    DEFAULT_BATCH_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    VerifierPool,
    configure_pool,
    get_pool,
    shutdown_pool,
    wrap_latex,
)

MAX_ANSWER_CHARS = 2000  # an extracted answer longer than this scores 0.0 without being parsed
MAX_FALLBACK_CHARS = 4000  # with no answer marker, only the completion's tail is parsed

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


_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


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


# A LaTeX command, with the braced argument of the text-like ones (their words are math-verify's to read:
# `18 \text{ dollars}` already parses as 18), or else a word: two or more letters in a row.
_COMMAND_OR_WORD = re.compile(
    r"\\(?:text\w*|math\w*|mbox|operatorname|begin|end)\s*\{[^{}]*\}|\\[A-Za-z]+|(?P<word>[A-Za-z]{2,})")
# Words that are math written without a backslash: cutting `pi` out of `2 pi` or `sqrt` out of `sqrt(11)` would
# leave a different number (2, 11).
_MATH_WORDS = frozenset(
    "sqrt cbrt pi sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp mod gcd lcm max min "
    "abs floor ceil det choose binom inf infty infinity".split())
_MATH_CHAR = re.compile(r"[0-9\\]")  # a digit or a LaTeX command: what makes a piece of an answer math
_SPAN_EDGES = " \t\n,.;:!?"


def prose_free(answer: str) -> str | None:
    """The one math span left when the prose words are cut out of an answer, or None.

    `It is 18 dollars.` -> `18`, `1,800 eggs` -> `1,800`, `Therefore \\frac{1}{2}` -> `\\frac{1}{2}`. Read whole
    inside `$…$`, such an answer is a product of one-letter symbols (`18·d·o·l·l·a·r·s`) that equals nothing.
    None when the answer has no prose word (it is math already) or no math span; None too when it has several
    (`18 or 19`, `18 dollars and 17 cents`): such an answer names no single value, and picking one of its numbers
    (math-verify's reading of bare text takes the last) would reward hedging.
    """
    pieces, start = [], 0
    for m in _COMMAND_OR_WORD.finditer(answer):
        if m.group("word") and m.group("word").lower() not in _MATH_WORDS:
            pieces.append(answer[start : m.start()])
            start = m.end()
    if not pieces:
        return None
    pieces.append(answer[start:])
    spans = [p.strip(_SPAN_EDGES) for p in pieces if _MATH_CHAR.search(p)]
    return spans[0] if len(spans) == 1 else None


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
    An answer in words (`18 dollars`, `It is 18`) is also read as its one math span (`prose_free`).
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
            # the answer as written and, if it has prose words, its one math span: any reading equal to the gold
            # scores 1.0. The bare text is not a reading: math-verify takes the last number in it, so `3\sqrt{11}`
            # would equal 3 and `(1, 2)` would equal 2.
            readings = [r for r in (pred, prose_free(pred)) if r]
            verdicts = [quick_verdict(gold, r) for r in readings]
            if 1.0 in verdicts or None not in verdicts:
                out[i] = 1.0 if 1.0 in verdicts else 0.0
                _bump(stats, "reward_fast")
                continue
            cands = [wrap_latex(r) for r, v in zip(readings, verdicts, strict=True) if v is None]
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
