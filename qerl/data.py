"""Math datasets and prompt templates (QERL.md §5).

`load_dataset(name, split, source, ...)` returns a list of `Problem(id, prompt, answer, meta)`:
- `source="local"` (default) reads the copies vendored under `qerl/assets/data/` (byte-for-byte, see each SOURCE.md);
- `source="hub"` uses `datasets.load_dataset` on the Hugging Face hub (`openai/gsm8k`, Big-Math, ...).
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
# Loaders: each takes (split, source, **opts) and returns problems in their original order.


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _hub(path: str, config: str | None, split: str):
    import datasets  # lazy: only the hub path needs it

    return datasets.load_dataset(path, config, split=split)


def load_gsm8k(split: str, source: str, hub_rows=None) -> list[Problem]:
    """GSM8K train (7473) / test (1319); hub: `openai/gsm8k`, config `main`."""
    if source == "hub":
        rows = hub_rows if hub_rows is not None else _hub("openai/gsm8k", "main", split)
    else:
        rows = _jsonl(DATA_DIR / "gsm8k" / f"{split}.jsonl")
    return [gsm8k_row(r, i, split, source) for i, r in enumerate(rows)]


def load_math500(split: str, source: str, hub_rows=None) -> list[Problem]:
    """MATH-500 (PRM800K test subset); hub: `HuggingFaceH4/MATH-500`."""
    if source == "hub":
        rows = hub_rows if hub_rows is not None else _hub("HuggingFaceH4/MATH-500", None, "test")
    else:
        rows = _jsonl(DATA_DIR / "math500" / "test.jsonl")
    return [math500_row(r, i, source) for i, r in enumerate(rows)]


def load_aime24(split: str, source: str, hub_rows=None) -> list[Problem]:
    """AIME 2024 I+II (30); hub: `HuggingFaceH4/aime_2024` (its only split is `train`)."""
    if source == "hub":
        rows = hub_rows if hub_rows is not None else _hub("HuggingFaceH4/aime_2024", None, "train")
    else:
        rows = _jsonl(DATA_DIR / "aime24" / "test.jsonl")
    return [aime_row(r, i, "aime24", source) for i, r in enumerate(rows)]


def load_aime25(split: str, source: str) -> list[Problem]:
    """AIME 2025 I+II (30), vendored from inclusionAI/AReaL."""
    return [aime_row(r, i, "aime25", source) for i, r in enumerate(_jsonl(DATA_DIR / "aime25" / "test.jsonl"))]


def load_amc23(split: str, source: str) -> list[Problem]:
    """AMC 2023 (40), vendored from QwenLM/Qwen2.5-Math."""
    return [amc23_row(r, i, source) for i, r in enumerate(_jsonl(DATA_DIR / "amc23" / "test.jsonl"))]


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
        rows = hub_rows if hub_rows is not None else _hub("open-r1/Big-Math-RL-Verified-Processed", config, "train")
        return [bigmath_row(r, i, config) for i, r in enumerate(rows) if keep(r["prompt"])]
    stand_in = _stand_in_text(lv)
    out = []
    with open(DATA_DIR / "math_train" / "math.json", encoding="utf-8") as f:
        rows = json.load(f)
    for i, r in enumerate(rows):
        ans = r.get("answer")
        if ans is None or not str(ans).strip() or int(r["difficulty"]) not in lv or not keep(r["problem"]):
            continue
        meta = {"dataset": "bigmath", "split": "train", "source": "local", "index": i, "config": config,
                "level": int(r["difficulty"]), "subject": r.get("type"), "stand_in": stand_in}
        out.append(Problem(f"bigmath-local/{config}/{i}", r["problem"], str(ans).strip(), meta))
    return out


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
}
SPLITS = {"gsm8k": ("train", "test"), "math500": ("test",), "aime24": ("test",), "aime25": ("test",),
          "amc23": ("test",), "bigmath": ("train",), "toy": ("train", "test")}
SOURCES = {"gsm8k": ("local", "hub"), "math500": ("local", "hub"), "aime24": ("local", "hub"), "aime25": ("local",),
           "amc23": ("local",), "bigmath": ("local", "hub"), "toy": ("local",)}


def _validate(name: str, split: str, source: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)}")
    if split not in SPLITS[name]:
        raise ValueError(f"dataset {name!r} has no split {split!r}; valid: {list(SPLITS[name])}")
    if source not in SOURCES[name]:
        raise ValueError(f"dataset {name!r} has no source {source!r}; valid: {list(SOURCES[name])}")


def load_dataset(name: str, split: str = "train", source: str = "local", limit: int | None = None, seed: int = 0,
                 shuffle: bool = False, **opts) -> list[Problem]:
    """Problems of dataset `name`; with `shuffle`, a seeded permutation first; `limit` keeps the first n.

    opts: bigmath `levels` ('3_4_5' | '4_5' | ...), `max_prompt_chars` (1024); toy `n`, `levels`, `gen_seed`.
    """
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
    split = split or SPLITS.get(name, ("train",))[0]
    _validate(name, split, source)
    info: dict = {"dataset": name, "source": source, "split": split, "stand_in": None, "filters": {}}
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
