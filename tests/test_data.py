"""Datasets (vendored files, hub row conversion, Big-Math stand-in provenance) and prompt templates."""

import hashlib
import json
import re

import datasets
import pytest

from qerl import data as D
from qerl.errors import UserError

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


# --- every row is checked as it is read; errors name the file and line (or the hub row)


def _write(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_user_jsonl_dataset_loads_and_records_its_file(tmp_path):
    f = _write(tmp_path / "mine.jsonl", '{"prompt": "What is 2+3?", "answer": "5"}', "",
               '{"prompt": "Half of 5?", "answer": 2.5, "id": "half", "topic": "fractions"}',
               '{"prompt": "7*6?", "answer": 42.0}')
    ps = D.load_dataset(f"jsonl:{f}", "test")
    assert [(p.prompt, p.answer) for p in ps] == [("What is 2+3?", "5"), ("Half of 5?", "2.5"), ("7*6?", "42")]
    assert ps[1].id == "jsonl/test/half" and ps[1].meta["topic"] == "fractions"
    assert ps[2].meta["where"] == f"{f}:4"  # the blank line 2 is skipped, line numbers are the file's
    assert D.load_dataset("jsonl", "train", path=f) == D.load_dataset(f"jsonl:{f}", "train")
    prov = D.data_provenance(f"jsonl:{f}", split="test")
    assert prov["files"] == {str(f.resolve()): hashlib.sha256(f.read_bytes()).hexdigest()}
    assert prov["origin"] == "user file" and prov["split"] == "test"


@pytest.mark.parametrize("lines, needle", [
    (['{"prompt": "2+3?", "answer": "5"}', '{"prompt": "x?" "answer": "1"}'],
     ":2: not valid JSON (Expecting ',' delimiter at column 17)"),
    (['{"prompt": "2+3?", "answer": "5"}', '{"question": "x?", "answer": "1"}'],
     ":2: missing key 'prompt'; each row needs ['prompt', 'answer'], this one has ['answer', 'question']"),
    (['{"prompt": "2+3?", "answer": ""}'], ":1: empty gold answer"),
    (['{"prompt": "2+3?", "answer": "  "}'], ":1: empty gold answer"),
    (['{"prompt": "", "answer": "1"}'], ":1: 'prompt' must be non-empty text"),
    (['{"prompt": "2+3?", "answer": null}'], ":1: 'answer' must be text or a number"),
    (['["2+3?", "5"]'], ":1: expected a JSON object"),
    ([], "holds no problems"),
])
def test_user_jsonl_bad_rows_name_file_and_line(tmp_path, lines, needle):
    f = _write(tmp_path / "mine.jsonl", *lines)
    with pytest.raises(UserError) as e:
        D.load_dataset(f"jsonl:{f}")
    assert needle in str(e.value) and str(f) in str(e.value), str(e.value)


def test_user_jsonl_missing_file_and_bytes_that_are_not_utf8(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        D.load_dataset(f"jsonl:{tmp_path / 'nope.jsonl'}")
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"prompt": "2+3?", "answer": "5"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(UserError, match=rf"{f}:2: not UTF-8"):
        D.load_dataset(f"jsonl:{f}")


def test_hub_rows_with_an_empty_answer_or_a_missing_key_are_named():
    empty = datasets.Dataset.from_list([{"question": "Q1?", "answer": "a\n#### 3"}, {"question": "Q2?", "answer": "b\n#### "}])
    with pytest.raises(UserError, match=r"openai/gsm8k row 1: empty gold answer"):
        D.load_dataset("gsm8k", source="hub", hub_rows=empty)
    missing = datasets.Dataset.from_list([{"problem": "P", "solution": "S"}])
    with pytest.raises(UserError, match=r"HuggingFaceH4/MATH-500 row 0: missing key 'answer'"):
        D.load_dataset("math500", "test", source="hub", hub_rows=missing)
    no_hashes = datasets.Dataset.from_list([{"question": "Q?", "answer": "just 3"}])
    with pytest.raises(UserError, match=r"openai/gsm8k row 0: GSM8K solution without '####'"):
        D.load_dataset("gsm8k", source="hub", hub_rows=no_hashes)


def test_jsonl_in_the_config_is_checked_before_a_run_directory_exists(tmp_path, capsys):
    from qerl.config import from_dict, load_config
    from qerl.train import main

    good = _write(tmp_path / "train.jsonl", '{"prompt": "2+3?", "answer": 5}', '{"prompt": "4+4?", "answer": 8}')
    cfg = load_config(["data=jsonl", f"data.path={good}", f"eval.sets=[toy,jsonl:{good}]"])
    assert cfg.data.load_options() == {"path": str(good)} and cfg.eval.sets == ("toy", f"jsonl:{good}")
    assert cfg.run_dir.name.endswith("-jsonl-train-s0")  # the file's name keeps two datasets' runs apart
    moved = tmp_path / "moved.jsonl"
    good.rename(moved)  # a recorded run re-reads its config without needing its training file
    assert from_dict(cfg.to_dict()) == cfg
    with pytest.raises(UserError, match=r"data.path: .*train.jsonl' does not exist"):
        load_config(["data=jsonl", f"data.path={good}"])
    moved.rename(good)
    bad = _write(tmp_path / "bad.jsonl", '{"prompt": "2+3?", "answer": 5}', '{"prompt": "x?", "answer": ""}')
    out = tmp_path / "results"
    for overrides in (["data=jsonl", f"data.path={bad}"], [f"eval.sets=[jsonl:{bad}]"],
                      ["data.train=jsonl", f"data.path={good}"]):  # the toy preset's levels do not apply
        with pytest.raises(SystemExit) as e:
            main([*overrides, f"out_dir={out}"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and (f"{bad}:2: empty gold answer" in err or "data.levels=null" in err), err
        assert not out.exists()
