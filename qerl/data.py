"""Math datasets and prompt templates (QERL.md §5).

`load_dataset(name, split, source, ...)` returns a list of `Problem(id, prompt, answer, meta)`:
- `source="local"` (default) reads the copies vendored under `qerl/assets/data/` (byte-for-byte, see each SOURCE.md);
- `source="hub"` uses `datasets.load_dataset` on the Hugging Face hub (`openai/gsm8k`, Big-Math, ...).
- `jsonl:<file>` (or `load_dataset("jsonl", path=<file>)`) reads a user's own problems, one JSON object a line
  with `prompt` and `answer` (see `load_jsonl`).
Every row is checked as it is read: a malformed line, a missing key or an empty gold answer is a `UserError`
naming the file and line (or the hub dataset and row).
Big-Math has no offline copy: locally, Hendrycks MATH train filtered by level stands in for it, and every
Problem's meta and `data_provenance(...)` say so. `toy` problems come from `qerl.toy.generate_problems`.

Gold answers are normalised as the SOURCE notes say: GSM8K = text after `####` without thousands commas,
AIME = integer string without zero padding, AMC = integer string when whole, MATH = the LaTeX answer as given.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from qerl.errors import UserError

DATA_DIR = Path(__file__).resolve().parent / "assets" / "data"


@dataclass(frozen=True)
class Problem:
    """One problem: `prompt` is the raw question text (no template), `answer` the normalised gold answer."""

    id: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


# --------------------------------------------------------------------------------------------------------------
# Answer normalisation and row conversion (shared by the local files and the hub rows).


def gsm8k_gold(solution: str) -> str:
    """Final answer of a GSM8K worked solution: the text after `####`, stripped, thousands commas removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution without '####': {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def integer_gold(x) -> str:
    """AIME/AMC gold as an integer string ('025' -> '25', 27.0 -> '27'); non-integers keep their value."""
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() else repr(x)
    s = str(x).strip()
    return str(int(s)) if re.fullmatch(r"[+-]?\d+", s) else s


def gsm8k_row(row: dict, index: int, split: str, source: str) -> Problem:
    """Problem from a GSM8K row (`question`, `answer` = worked solution ending in `#### N`)."""
    return Problem(f"gsm8k/{split}/{index}", row["question"], gsm8k_gold(row["answer"]),
                   {"dataset": "gsm8k", "split": split, "source": source, "index": index, "solution": row["answer"]})


def math500_row(row: dict, index: int, source: str) -> Problem:
    """Problem from a MATH-500 row (`problem`, `solution`, `answer`, `subject`, `level`, `unique_id`)."""
    meta = {"dataset": "math500", "split": "test", "source": source, "index": index, "solution": row.get("solution"),
            "subject": row.get("subject"), "level": row.get("level"), "unique_id": row.get("unique_id")}
    return Problem(f"math500/test/{index}", row["problem"], str(row["answer"]).strip(), meta)


def aime_row(row: dict, index: int, name: str, source: str) -> Problem:
    """Problem from an AIME row (`problem`, `answer` as '025' or 25, optional `id`, `solution`, `url`)."""
    meta = {"dataset": name, "split": "test", "source": source, "index": index, "answer_raw": row["answer"],
            **{k: row[k] for k in ("id", "url", "year") if k in row}}
    return Problem(f"{name}/test/{index}", row["problem"], integer_gold(row["answer"]), meta)


def amc23_row(row: dict, index: int, source: str) -> Problem:
    """Problem from an AMC23 row (`problem`, `answer` as a float like 27.0, `id`, `url`)."""
    meta = {"dataset": "amc23", "split": "test", "source": source, "index": index, "answer_raw": row["answer"],
            **{k: row[k] for k in ("id", "url") if k in row}}
    return Problem(f"amc23/test/{index}", row["problem"], integer_gold(row["answer"]), meta)


def bigmath_row(row: dict, index: int, config: str) -> Problem:
    """Problem from an `open-r1/Big-Math-RL-Verified-Processed` row (`prompt`, `solution` = final answer,
    `source`, `domain`, `llama8b_solve_rate`)."""
    meta = {"dataset": "bigmath", "split": "train", "source": "hub", "index": index, "config": config,
            "origin": row.get("source"), "domain": row.get("domain"), "llama8b_solve_rate": row.get("llama8b_solve_rate"),
            "stand_in": None}
    return Problem(f"bigmath/{config}/{index}", row["prompt"], str(row["solution"]).strip(), meta)


# --------------------------------------------------------------------------------------------------------------
# Reading rows: each row travels with where it came from ('file:line', 'hub id row i'), so every error names it.


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    """(where, row) for each non-blank line of a JSON-lines file; where is 'path:line'."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UserError(f"cannot read dataset file {path}: {e.strerror or e}") from None
    out = []
    for n, raw in enumerate(lines, 1):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object {{...}}, got {type(row).__name__}")
        out.append((where, row))
    return out


def _hub_rows(hub_id: str, rows) -> list[tuple[str, dict]]:
    return [(f"{hub_id} row {i}", r) for i, r in enumerate(rows)]


def _require(where: str, row: dict, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise UserError(f"{where}: missing key {missing[0]!r}; each row needs {list(keys)}, this one has {sorted(row)}")


def _convert(rows: list[tuple[str, dict]], required: tuple[str, ...],
             make: Callable[[dict, int], Problem]) -> list[Problem]:
    """Problems from (where, row) pairs, ``make(row, position)``: each row must hold the `required` keys and give
    a non-empty gold answer (an empty one would score every completion 0, silently)."""
    out = []
    for i, (where, row) in enumerate(rows):
        _require(where, row, required)
        try:
            p = make(row, i)
        except ValueError as e:  # e.g. a GSM8K solution without '####', a prompt that is not text
            raise UserError(f"{where}: {e}") from None
        if not p.answer.strip():
            raise UserError(f"{where}: empty gold answer; every completion of this problem would score 0 "
                            f"(fix or remove the row)")
        out.append(p)
    return out


# --------------------------------------------------------------------------------------------------------------
# Loaders: each takes (split, source, **opts) and returns problems in their original order.


def _hub(path: str, config: str | None, split: str):
    import datasets  # lazy: only the hub path needs it

    return datasets.load_dataset(path, config, split=split)


def load_gsm8k(split: str, source: str, hub_rows=None) -> list[Problem]:
    """GSM8K train (7473) / test (1319); hub: `openai/gsm8k`, config `main`."""
    if source == "hub":
        rows = _hub_rows("openai/gsm8k", hub_rows if hub_rows is not None else _hub("openai/gsm8k", "main", split))
    else:
        rows = _read_jsonl(DATA_DIR / "gsm8k" / f"{split}.jsonl")
    return _convert(rows, ("question", "answer"), lambda r, i: gsm8k_row(r, i, split, source))


def load_math500(split: str, source: str, hub_rows=None) -> list[Problem]:
    """MATH-500 (PRM800K test subset); hub: `HuggingFaceH4/MATH-500`."""
    if source == "hub":
        rows = _hub_rows("HuggingFaceH4/MATH-500",
                         hub_rows if hub_rows is not None else _hub("HuggingFaceH4/MATH-500", None, "test"))
    else:
        rows = _read_jsonl(DATA_DIR / "math500" / "test.jsonl")
    return _convert(rows, ("problem", "answer"), lambda r, i: math500_row(r, i, source))


def load_aime24(split: str, source: str, hub_rows=None) -> list[Problem]:
    """AIME 2024 I+II (30); hub: `HuggingFaceH4/aime_2024` (its only split is `train`)."""
    if source == "hub":
        rows = _hub_rows("HuggingFaceH4/aime_2024",
                         hub_rows if hub_rows is not None else _hub("HuggingFaceH4/aime_2024", None, "train"))
    else:
        rows = _read_jsonl(DATA_DIR / "aime24" / "test.jsonl")
    return _convert(rows, ("problem", "answer"), lambda r, i: aime_row(r, i, "aime24", source))


def load_aime25(split: str, source: str) -> list[Problem]:
    """AIME 2025 I+II (30), vendored from inclusionAI/AReaL."""
    return _convert(_read_jsonl(DATA_DIR / "aime25" / "test.jsonl"), ("problem", "answer"),
                    lambda r, i: aime_row(r, i, "aime25", source))


def load_amc23(split: str, source: str) -> list[Problem]:
    """AMC 2023 (40), vendored from QwenLM/Qwen2.5-Math."""
    return _convert(_read_jsonl(DATA_DIR / "amc23" / "test.jsonl"), ("problem", "answer"),
                    lambda r, i: amc23_row(r, i, source))


def jsonl_row(row: dict, index: int, split: str, where: str) -> Problem:
    """Problem from a user's row: `prompt` (the question text, no template) and `answer` (the gold final answer,
    a string or a number); optional `id`; every other key is kept in `meta`."""
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"'prompt' must be non-empty text, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"'answer' must be text or a number, got {answer!r}")
    extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "id")}
    meta = {"dataset": "jsonl", "split": split, "source": "local", "index": index, "where": where, **extra}
    gold = answer.strip() if isinstance(answer, str) else integer_gold(answer)  # 27.0 -> '27'; text as written
    return Problem(f"jsonl/{split}/{row.get('id', index)}", prompt, gold, meta)


JSONL_SCHEMA = ('one JSON object a line: {"prompt": "<question text>", "answer": "<gold final answer>"} '
                '(answer may be a number; optional "id"; other keys are kept as metadata)')


def load_jsonl(split: str, source: str, path: str | Path | None = None) -> list[Problem]:
    """A user's problems from a JSON-lines file (any split: the file is the split). See `JSONL_SCHEMA`."""
    if path is None:
        raise UserError(f"the jsonl dataset needs a file (jsonl:<file>, or data.path=<file>); {JSONL_SCHEMA}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"dataset file {str(path)!r} does not exist (or is not a file); expected {JSONL_SCHEMA}")
    rows = _read_jsonl(path)
    if not rows:
        raise UserError(f"dataset file {path} holds no problems; expected {JSONL_SCHEMA}")
    return _convert(rows, ("prompt", "answer"), lambda r, i: jsonl_row(r, i, split, rows[i][0]))


def _bigmath_levels(levels) -> tuple[str, tuple[int, ...]]:
    """('level_3_4_5', (3, 4, 5)) from '3_4_5', 'level_3_4_5', '3-5', (3, 4, 5) or 'all'."""
    if isinstance(levels, str):
        s = levels.removeprefix("level_")
        if s == "all":
            return "all", (1, 2, 3, 4, 5)
        m = re.fullmatch(r"([1-5])-([1-5])", s)
        lv = tuple(range(int(m.group(1)), int(m.group(2)) + 1)) if m else tuple(int(x) for x in s.split("_") if x)
    else:
        lv = tuple(int(x) for x in levels)
    lv = tuple(sorted(set(lv)))
    if not lv or any(x not in range(1, 6) for x in lv):
        raise ValueError(f"bad Big-Math levels {levels!r}; valid: e.g. '3_4_5', '4_5', 'level_5', 'all'")
    return "level_" + "_".join(map(str, lv)), lv


def _levels_text(lv: tuple[int, ...]) -> str:
    contiguous = lv == tuple(range(lv[0], lv[-1] + 1))
    return f"{lv[0]}-{lv[-1]}" if contiguous and len(lv) > 1 else ",".join(map(str, lv))


def load_bigmath(split: str, source: str, levels="3_4_5", max_prompt_chars: int | None = 1024,
                 min_level: int | None = None, hub_rows=None) -> list[Problem]:
    """Big-Math RL (QERL.md §5): hub `open-r1/Big-Math-RL-Verified-Processed` config `level_<levels>`, prompts of at
    most `max_prompt_chars` characters (official filter). Local stand-in: vendored Hendrycks MATH train whose
    level is in `levels` (levels 3-5 means difficulty >= 3), same prompt filter, rows without an answer dropped.
    `min_level=k` is shorthand for levels k..5."""
    config, lv = _bigmath_levels(levels if min_level is None else tuple(range(int(min_level), 6)))
    keep = lambda p: max_prompt_chars is None or len(p) <= max_prompt_chars
    if source == "hub":
        hub_id = "open-r1/Big-Math-RL-Verified-Processed"
        rows = _hub_rows(f"{hub_id} ({config})", hub_rows if hub_rows is not None else _hub(hub_id, config, "train"))
        for where, r in rows:
            _require(where, r, ("prompt", "solution"))
        index = [i for i, (_, r) in enumerate(rows) if keep(r["prompt"])]  # positions in the hub split
        return _convert([rows[i] for i in index], (), lambda r, j: bigmath_row(r, index[j], config))
    stand_in = _stand_in_text(lv)
    path = DATA_DIR / "math_train" / "math.json"
    try:
        rows = [(f"{path}[{i}]", r) for i, r in enumerate(json.loads(path.read_text(encoding="utf-8")))]
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    for where, r in rows:
        _require(where, r, ("problem", "answer", "difficulty"))
    # rows without an answer are dropped: the stand-in's filter (Big-Math keeps only verifiable answers), not an error
    index = [i for i, (_, r) in enumerate(rows) if r["answer"] is not None and str(r["answer"]).strip()
             and int(r["difficulty"]) in lv and keep(r["problem"])]

    def make(r: dict, j: int) -> Problem:
        i = index[j]
        meta = {"dataset": "bigmath", "split": "train", "source": "local", "index": i, "config": config,
                "level": int(r["difficulty"]), "subject": r.get("type"), "stand_in": stand_in}
        return Problem(f"bigmath-local/{config}/{i}", r["problem"], str(r["answer"]).strip(), meta)

    return _convert([rows[i] for i in index], (), make)


def _stand_in_text(lv: tuple[int, ...]) -> str:
    return f"Hendrycks MATH train levels {_levels_text(lv)} (vendored) for Big-Math level_{'_'.join(map(str, lv))}"


def load_toy(split: str, source: str, n: int | None = None, levels=(1, 2, 3), gen_seed: int | None = None,
             _seed: int = 0) -> list[Problem]:
    """Synthetic GSM8K-style problems from `qerl.toy.generate_problems(n, seed, split, levels)` (n default 1000
    train / 200 test; generator seed defaults to load_dataset's seed)."""
    from qerl import toy  # lazy: toy is a sibling leaf

    n = n if n is not None else (1000 if split == "train" else 200)
    seed = _seed if gen_seed is None else gen_seed
    rows = toy.generate_problems(n, seed, split=split, levels=tuple(levels))
    return [Problem(f"toy/{split}/{seed}/{i}", r["question"], str(r["answer"]),
                    {"dataset": "toy", "split": split, "source": "generated", "index": i, "level": r.get("level"),
                     "solution": r.get("solution"), "gen_seed": seed}) for i, r in enumerate(rows)]


DATASETS: dict[str, Callable[..., list[Problem]]] = {
    "gsm8k": load_gsm8k,
    "math500": load_math500,
    "aime24": load_aime24,
    "aime25": load_aime25,
    "amc23": load_amc23,
    "bigmath": load_bigmath,
    "toy": load_toy,
    "jsonl": load_jsonl,
}
SPLITS = {"gsm8k": ("train", "test"), "math500": ("test",), "aime24": ("test",), "aime25": ("test",),
          "amc23": ("test",), "bigmath": ("train",), "toy": ("train", "test"), "jsonl": ("train", "test")}
SOURCES = {"gsm8k": ("local", "hub"), "math500": ("local", "hub"), "aime24": ("local", "hub"), "aime25": ("local",),
           "amc23": ("local",), "bigmath": ("local", "hub"), "toy": ("local",), "jsonl": ("local",)}


def valid_levels(name: str) -> tuple[int, ...] | None:
    """The difficulty levels dataset `name` can be filtered to (its `levels` option), or None if it has none."""
    if name == "toy":
        from qerl import toy

        return tuple(toy.LEVELS)
    return (1, 2, 3, 4, 5) if name == "bigmath" else None


def dataset_name(spec: str) -> str:
    """The registry name of a dataset spec: 'jsonl:<file>' -> 'jsonl', 'gsm8k' -> 'gsm8k'."""
    return spec.split(":", 1)[0]


def _resolve(spec: str, opts: dict) -> tuple[str, dict]:
    """(registry name, options) of a spec: 'jsonl:<file>' is the jsonl dataset with path=<file>."""
    name, sep, path = spec.partition(":")
    if sep and name == "jsonl":
        return name, {**opts, "path": path}
    return spec, opts


def absolute_spec(spec: str) -> str:
    """The spec with a user file's path made absolute (so a recorded config still finds it from elsewhere)."""
    name, opts = _resolve(spec, {})
    return f"{name}:{Path(opts['path']).expanduser().resolve()}" if "path" in opts else spec


_CHECKED: dict[tuple, int] = {}


def check_dataset(spec: str, split: str = "train", **opts) -> int:
    """Read and check every row of dataset `spec` now (a user file: each time it changes); returns the number of
    problems. Raises `UserError` naming the file and line of the first bad row."""
    name, opts = _resolve(spec, opts)
    path = Path(opts["path"]).expanduser() if "path" in opts else None
    stamp = (name, split, str(path), *((path.stat().st_mtime_ns, path.stat().st_size) if path and path.is_file()
                                       else ()), tuple(sorted(opts.items())))
    if stamp not in _CHECKED:
        _CHECKED[stamp] = len(load_dataset(name, split, **opts))
    return _CHECKED[stamp]


def _validate(name: str, split: str, source: str) -> None:
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)} (a file of your own: jsonl:<file>)")
    if split not in SPLITS[name]:
        raise UserError(f"dataset {name!r} has no split {split!r}; valid: {list(SPLITS[name])}")
    if source not in SOURCES[name]:
        raise UserError(f"dataset {name!r} has no source {source!r}; valid: {list(SOURCES[name])}")


def load_dataset(name: str, split: str = "train", source: str = "local", limit: int | None = None, seed: int = 0,
                 shuffle: bool = False, **opts) -> list[Problem]:
    """Problems of dataset `name` (a registry name, or `jsonl:<file>`); with `shuffle`, a seeded permutation
    first; `limit` keeps the first n.

    opts: bigmath `levels` ('3_4_5' | '4_5' | ...), `max_prompt_chars` (1024); toy `n`, `levels`, `gen_seed`;
    jsonl `path`.
    """
    name, opts = _resolve(name, opts)
    _validate(name, split, source)
    if name == "toy":
        opts = {"_seed": seed, **opts}
        if limit is not None and "n" not in opts:
            opts["n"] = limit
    problems = DATASETS[name](split, source, **opts)
    if shuffle:
        random.Random(seed).shuffle(problems)
    return problems if limit is None else problems[: int(limit)]


_LOCAL_FILES = {"gsm8k": ["gsm8k/{split}.jsonl"], "math500": ["math500/test.jsonl"], "aime24": ["aime24/test.jsonl"],
                "aime25": ["aime25/test.jsonl"], "amc23": ["amc23/test.jsonl"], "bigmath": ["math_train/math.json"]}
_HUB_IDS = {"gsm8k": "openai/gsm8k (config main)", "math500": "HuggingFaceH4/MATH-500",
            "aime24": "HuggingFaceH4/aime_2024", "bigmath": "open-r1/Big-Math-RL-Verified-Processed"}


@cache
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_provenance(name: str, source: str = "local", split: str | None = None, **opts) -> dict:
    """Where `load_dataset(name, split, source, **opts)` data comes from, for run records: origin, files and their
    sha256, filters, and `stand_in` (non-null when a local substitute replaces the named dataset)."""
    name, opts = _resolve(name, opts)
    split = split or SPLITS.get(name, ("train",))[0]
    _validate(name, split, source)
    info: dict = {"dataset": name, "source": source, "split": split, "stand_in": None, "filters": {}}
    if name == "jsonl":
        path = Path(opts["path"]).expanduser().resolve()
        info["origin"] = "user file"
        info["files"] = {str(path): hashlib.sha256(path.read_bytes()).hexdigest()}  # not cached: the user may edit it
        return info
    if name == "toy":
        info["origin"] = "qerl.toy.generate_problems (synthetic, generated in-process)"
        info["options"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.items()}
        return info
    if name == "bigmath":
        m = opts.get("min_level")
        config, lv = _bigmath_levels(opts.get("levels", "3_4_5") if m is None else tuple(range(int(m), 6)))
        info["config"] = config
        info["filters"]["max_prompt_chars"] = opts.get("max_prompt_chars", 1024)
        if source == "local":
            info["stand_in"] = _stand_in_text(lv)
            info["filters"]["math_levels"] = list(lv)
    if source == "hub":
        info["origin"] = "huggingface hub: " + _HUB_IDS[name]
        return info
    files = [f.format(split=split) for f in _LOCAL_FILES[name]]
    info["origin"] = f"vendored copy under qerl/assets/data/ (see {files[0].split('/')[0]}/SOURCE.md)"
    info["files"] = {f: _sha256(DATA_DIR / f) for f in files}
    return info


# --------------------------------------------------------------------------------------------------------------
# Prompt templates.

# QERL.md §5 text (official utils/data.py, whitespace collapsed to single spaces).
THINK_ANSWER_SYSTEM = (
    "Solve the following math problem step by step. The reasoning process and direct answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>: <think> ... </think> <answer> ... </answer>"
)
# The same prompt exactly as the official code's triple-quoted string (newlines and 8-space indents included).
THINK_ANSWER_SYSTEM_VERBATIM = (
    "\n        Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
    "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think> <answer> answer here </answer>: \n        <think>\n        ...\n        </think>\n        <answer>\n"
    "        ...\n        </answer>\n    "
)
# QERL.md quotes the pre-2025-11-27 GSM8K instruction up to "tag …". Completed here from the official utils/data.py
# at 4de3ce6^ (its continuation is "i.e.,:" then <think> ... </think> #### number), whitespace collapsed.
GSM8K_HASH_INSTRUCTION = (
    "Let's think step by step first within <think> </think> tags, and output the final answer after \"####\" tag, "
    "i.e.,: <think> ... </think> #### number"
)
# Verbatim official string: its example lines carry stray '#     ' prefixes left from commenting them out.
GSM8K_HASH_INSTRUCTION_VERBATIM = (
    "\n        Let's think step by step first within <think> </think> tags, and output the final answer after "
    "\"####\" tag, i.e.,: \n        #     <think>\n        #     ...\n        #     </think>\n        #     #### number\n    "
)
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _sys_user(system: str) -> Callable[[str], list[dict]]:
    return lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]


def _user(fmt: Callable[[str], str]) -> Callable[[str], list[dict]]:
    return lambda q: [{"role": "user", "content": fmt(q)}]


PROMPTS: dict[str, Callable[[str], list[dict]]] = {
    # official BigMath (and eval) prompt: the <think>/<answer> system prompt + the problem as the user message
    "think_answer": _sys_user(THINK_ANSWER_SYSTEM),
    "think_answer_verbatim": _sys_user(THINK_ANSWER_SYSTEM_VERBATIM),
    # paper App. E: the same text appended to the problem in the user message (separator not stated; a space)
    "think_answer_suffix": _user(lambda q: q + " " + THINK_ANSWER_SYSTEM),
    # official GSM8K before 2025-11-27: question + " " + instruction
    "gsm8k_hash": _user(lambda q: q + " " + GSM8K_HASH_INSTRUCTION),
    "gsm8k_hash_verbatim": _user(lambda q: q + " " + GSM8K_HASH_INSTRUCTION_VERBATIM),
    # official GSM8K at e8c6e79: the question alone (the chat template's default system prompt applies)
    "plain": _user(lambda q: q),
    # the usual Qwen2.5-Math evaluation prompt
    "boxed": _user(lambda q: q + "\n" + BOXED_INSTRUCTION),
}


def build_messages(problem_text: str, template: str) -> list[dict]:
    """Chat messages [{"role", "content"}, ...] for a problem under prompt template `template`."""
    if template not in PROMPTS:
        raise ValueError(f"unknown prompt template {template!r}; valid: {sorted(PROMPTS)}")
    return PROMPTS[template](problem_text)


def render_prompt(tokenizer, problem_text: str, template: str) -> str:
    """Prompt string: the tokenizer's chat template (with the generation prompt) if it has one, else the plain
    fallback 'System: …\\nUser: …\\nAssistant:'."""
    messages = build_messages(problem_text, template)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])
