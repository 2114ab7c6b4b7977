"""Datasets (vendored files, hub row conversion, Big-Math stand-in provenance) and prompt templates."""

import hashlib
import json
import re

import datasets
import pytest

from qerl import data as D

RAW = D.DATA_DIR


def _jsonl(rel):
    return [json.loads(line) for line in open(RAW / rel, encoding="utf-8")]


@pytest.mark.parametrize("folder", ["gsm8k", "math500", "aime24", "aime25", "amc23", "math_train"])
def test_vendored_files_match_the_sha256_in_their_source_notes(folder):
    noted = set(re.findall(r"`([0-9a-f]{64})`", (RAW / folder / "SOURCE.md").read_text()))
    files = [p for p in (RAW / folder).iterdir() if p.name != "SOURCE.md"]
    assert files and noted
    for p in files:
        assert hashlib.sha256(p.read_bytes()).hexdigest() in noted, p
    assert (RAW / "README.md").exists()


@pytest.mark.parametrize("name,split,n", [("gsm8k", "train", 7473), ("gsm8k", "test", 1319), ("math500", "test", 500),
                                          ("aime24", "test", 30), ("aime25", "test", 30), ("amc23", "test", 40)])
def test_row_counts_and_fields(name, split, n):
    ps = D.load_dataset(name, split)
    assert len(ps) == n
    assert all(p.prompt and p.answer for p in ps)
    assert len({p.id for p in ps}) == n
    assert all(p.meta["dataset"] == name and p.meta["source"] == "local" for p in ps)


def test_gsm8k_answers_are_the_text_after_hashes_without_commas():
    raw = _jsonl("gsm8k/test.jsonl")
    ps = D.load_dataset("gsm8k", "test")
    with_commas = [i for i, r in enumerate(raw) if "," in r["answer"].split("####")[-1]]
    assert len(with_commas) == 14
    for i, (r, p) in enumerate(zip(raw, ps, strict=True)):
        final = r["answer"].split("####")[-1].strip()
        assert p.answer == final.replace(",", "") and int(p.answer) == int(final.replace(",", ""))
        assert p.prompt == r["question"] and p.meta["solution"] == r["answer"]
        assert "," not in p.answer, i


def test_aime_and_amc_answers_are_integer_strings():
    a24 = D.load_dataset("aime24", "test")
    raw = _jsonl("aime24/test.jsonl")
    assert [p.answer for p in a24] == [str(int(r["answer"])) for r in raw]
    assert "025" in [r["answer"] for r in raw] and "25" in [p.answer for p in a24]
    assert [p.answer for p in D.load_dataset("aime25", "test")][:3] == ["70", "588", "16"]  # SOURCE.md's list
    amc = D.load_dataset("amc23", "test")
    assert amc[0].answer == "27" and all(re.fullmatch(r"-?\d+", p.answer) for p in amc)
    assert [float(p.answer) for p in amc] == [r["answer"] for r in _jsonl("amc23/test.jsonl")]


def test_math500_answers_are_verbatim_latex():
    raw = _jsonl("math500/test.jsonl")
    ps = D.load_dataset("math500", "test")
    assert [p.answer for p in ps] == [r["answer"] for r in raw]
    assert ps[0].meta["unique_id"] == "test/precalculus/807.json" and ps[0].meta["level"] == 2


def test_bigmath_local_stand_in_levels_and_prompt_filter():
    rows = json.load(open(RAW / "math_train" / "math.json", encoding="utf-8"))
    has_answer = lambda r: r["answer"] is not None and str(r["answer"]).strip() != ""
    for levels, min_level in [("3_4_5", 3), ("4_5", 4)]:
        expect = [i for i, r in enumerate(rows) if r["difficulty"] >= min_level and has_answer(r)
                  and len(r["problem"]) <= 1024]
        ps = D.load_dataset("bigmath", levels=levels)
        assert [p.meta["index"] for p in ps] == expect
        assert len(D.load_dataset("bigmath", min_level=min_level)) == len(expect)
        assert all(p.meta["stand_in"] and "Big-Math" in p.meta["stand_in"] for p in ps)
        assert all(len(p.prompt) <= 1024 and p.meta["level"] >= min_level for p in ps)
    unfiltered = D.load_dataset("bigmath", max_prompt_chars=None)
    assert len(unfiltered) == sum(r["difficulty"] >= 3 and has_answer(r) for r in rows)
    assert sum(r["difficulty"] >= 3 for r in rows) == 5563  # SOURCE.md's count, before dropping answerless rows


def test_provenance_says_when_a_stand_in_is_used():
    prov = D.data_provenance("bigmath", "local")
    assert prov["stand_in"] == "Hendrycks MATH train levels 3-5 (vendored) for Big-Math level_3_4_5"
    assert prov["filters"] == {"max_prompt_chars": 1024, "math_levels": [3, 4, 5]}
    assert prov["files"]["math_train/math.json"] == "569230b362fd501e1a33d8f29aae3b4b989d32e2b91b07c3f48493528c3bf6d2"
    assert D.data_provenance("bigmath", "local", levels="4_5")["stand_in"].startswith("Hendrycks MATH train levels 4-5")
    assert D.load_dataset("bigmath", limit=1)[0].meta["stand_in"] == prov["stand_in"]
    hub = D.data_provenance("bigmath", "hub", levels="4_5")
    assert hub["stand_in"] is None and hub["config"] == "level_4_5" and "open-r1/Big-Math" in hub["origin"]
    g = D.data_provenance("gsm8k", "local", split="test")
    assert g["stand_in"] is None and g["files"]["gsm8k/test.jsonl"].startswith("3730d312")


def test_bad_name_split_source_list_the_choices():
    with pytest.raises(ValueError, match=r"unknown dataset 'gsm9k'.*valid:.*gsm8k"):
        D.load_dataset("gsm9k")
    with pytest.raises(ValueError, match=r"no split 'train'; valid: \['test'\]"):
        D.load_dataset("math500", "train")
    with pytest.raises(ValueError, match=r"no source 'hub'; valid: \['local'\]"):
        D.load_dataset("amc23", "test", source="hub")
    with pytest.raises(ValueError, match=r"no source 'web'"):
        D.load_dataset("gsm8k", source="web")
    with pytest.raises(ValueError, match="Big-Math levels"):
        D.load_dataset("bigmath", levels="6_7")


def test_seeded_shuffle_and_limit_are_deterministic():
    base = D.load_dataset("gsm8k", "test")
    assert [p.meta["index"] for p in base[:5]] == [0, 1, 2, 3, 4]  # no shuffle: file order
    a = D.load_dataset("gsm8k", "test", shuffle=True, seed=3)
    b = D.load_dataset("gsm8k", "test", shuffle=True, seed=3)
    c = D.load_dataset("gsm8k", "test", shuffle=True, seed=4)
    assert [p.id for p in a] == [p.id for p in b] != [p.id for p in c]
    assert sorted(p.id for p in a) == sorted(p.id for p in base)
    assert D.load_dataset("gsm8k", "test", shuffle=True, seed=3, limit=7) == a[:7]
    assert D.load_dataset("gsm8k", "test", limit=7) == base[:7]


# --- hub path: the real conversion code on in-memory datasets with the hub's column names


def test_hub_gsm8k_rows():
    ds = datasets.Dataset.from_list([
        {"question": "Q1?", "answer": "a <<1+1=2>>2\n#### 1,080"},
        {"question": "Q2?", "answer": "b\n#### -3"},
    ])
    ps = D.load_dataset("gsm8k", "train", source="hub", hub_rows=ds)
    assert [(p.prompt, p.answer) for p in ps] == [("Q1?", "1080"), ("Q2?", "-3")]
    assert ps[0].meta["source"] == "hub" and ps[0].id == "gsm8k/train/0"


def test_hub_bigmath_rows_with_official_prompt_filter():
    row = {"source": "olympiads", "domain": ["Mathematics -> Algebra"], "llama8b_solve_rate": 0.25}
    ds = datasets.Dataset.from_list([
        {"prompt": "Find x if 2x = 4.", "solution": "2", **row},
        {"prompt": "y" * 1025, "solution": "1", **row},  # longer than 1024 characters: dropped (official filter)
        {"prompt": "z" * 1024, "solution": "\\frac{1}{2}", **row},
    ])
    ps = D.load_dataset("bigmath", source="hub", levels="level_4_5", hub_rows=ds)
    assert [p.answer for p in ps] == ["2", "\\frac{1}{2}"]
    assert ps[0].meta["config"] == "level_4_5" and ps[0].meta["stand_in"] is None
    assert ps[0].meta["domain"] == ["Mathematics -> Algebra"] and ps[1].meta["index"] == 2


def test_hub_math500_and_aime24_rows():
    m = datasets.Dataset.from_list([{"problem": "P", "solution": "S \\boxed{3}", "answer": "3", "subject": "Algebra",
                                     "level": 1, "unique_id": "test/algebra/1.json"}])
    assert D.load_dataset("math500", "test", source="hub", hub_rows=m)[0].answer == "3"
    a = datasets.Dataset.from_list([{"id": 60, "problem": "P", "solution": "S", "answer": "025", "url": "u",
                                     "year": "2024"}])
    p = D.load_dataset("aime24", "test", source="hub", hub_rows=a)[0]
    assert p.answer == "25" and p.meta["answer_raw"] == "025" and p.meta["year"] == "2024"


# --- prompts

PAPER_SYSTEM = ("Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
                "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
                "here </think> <answer> answer here </answer>: <think> ... </think> <answer> ... </answer>")


def test_templates():
    q = "What is 2+3?"
    assert D.build_messages(q, "think_answer") == [{"role": "system", "content": PAPER_SYSTEM},
                                                   {"role": "user", "content": q}]
    assert D.build_messages(q, "think_answer_suffix") == [{"role": "user", "content": q + " " + PAPER_SYSTEM}]
    assert D.build_messages(q, "plain") == [{"role": "user", "content": q}]
    assert D.build_messages(q, "boxed")[0]["content"].endswith(
        "Please reason step by step, and put your final answer within \\boxed{}.")
    hash_msg = D.build_messages(q, "gsm8k_hash")[0]["content"]
    assert hash_msg.startswith(q + " Let's think step by step first within <think> </think> tags, and output the "
                                   "final answer after \"####\" tag")
    # the verbatim official string collapses to the QERL.md text
    assert " ".join(D.THINK_ANSWER_SYSTEM_VERBATIM.split()) == PAPER_SYSTEM
    with pytest.raises(ValueError, match="valid:.*think_answer"):
        D.build_messages(q, "thinking")


def _tokenizer(chat_template):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.chat_template = chat_template
    return tok


def test_render_prompt_chat_template_and_fallback():
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    got = D.render_prompt(_tokenizer(chatml), "Q?", "think_answer")
    assert got == f"<|im_start|>system\n{PAPER_SYSTEM}<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert D.render_prompt(_tokenizer(None), "Q?", "think_answer") == f"System: {PAPER_SYSTEM}\nUser: Q?\nAssistant:"
    assert D.render_prompt(_tokenizer(None), "Q?", "plain") == "User: Q?\nAssistant:"


def test_toy_problems_come_from_qerl_toy():
    toy = pytest.importorskip("qerl.toy")
    ps = D.load_dataset("toy", "train", limit=12, seed=5)
    ref = toy.generate_problems(12, 5, split="train", levels=(1, 2, 3))
    assert [(p.prompt, p.answer, p.meta["level"]) for p in ps] == [(r["question"], str(r["answer"]), r["level"])
                                                                    for r in ref]
    assert all(p.meta["solution"].rstrip().endswith("#### " + p.answer) for p in ps)
    test = D.load_dataset("toy", "test", n=8, seed=5, levels=(1,))
    assert len(test) == 8 and {p.meta["level"] for p in test} == {1}
    assert D.data_provenance("toy", "local", n=8, levels=(1,))["options"] == {"n": 8, "levels": [1]}
