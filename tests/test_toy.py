"""Toy task: generator (checked by an independent reader of the question text), tokenizer, presets, checkpoint."""

import ast
import json
import operator
import re

import pytest
import torch

from qerl import toy

# ----------------------------------------------------------------------------------------------------------------
# Independent references: an arithmetic evaluator for the solution lines, a reader of the question sentences
# ----------------------------------------------------------------------------------------------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(expr: str) -> float:
    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected syntax in {expr!r}")

    return walk(ast.parse(expr, mode="eval").body)


def _read_question(question: str) -> int:
    """Compute the answer from the English alone, one sentence pattern at a time (written from the templates'
    meaning, not from the generator's code)."""
    have: dict[str, int] = {}
    main = None  # the person "She"/"He" refers to
    spent, result = 0, None
    for sent in re.findall(r"[^.?]+[.?]", question):
        s = sent.strip()
        if m := re.fullmatch(r"(\w+) has (\d+) \w+ of \w+ with (\d+) \w+ in each \w+\.", s):
            have[m[1]], main = int(m[2]) * int(m[3]), main or m[1]
        elif m := re.fullmatch(r"(\w+) has (\d+) \w+\.", s):
            have[m[1]], main = int(m[2]), main or m[1]
        elif m := re.fullmatch(r"(\w+) has (\d+) (more|fewer) \w+ than (\w+)\.", s):
            have[m[1]] = have[m[4]] + int(m[2]) * (1 if m[3] == "more" else -1)
        elif m := re.fullmatch(r"(\w+) has (\d+) times as many \w+ as (\w+)\.", s):
            have[m[1]] = have[m[3]] * int(m[2])
        elif m := re.fullmatch(r"(?:She|He) buys (\d+) \w+ with (\d+) \w+ in each \w+\.", s):
            have[main] += int(m[1]) * int(m[2])
        elif m := re.fullmatch(r"(?:She|He) (?:buys|finds) (\d+) more \w+\.|\w+ gives (?:her|him) (\d+) more \w+\."
                               r"|(?:She|He) gets (\d+) more \w+ from \w+\.", s):
            have[main] += int(next(g for g in m.groups() if g))
        elif m := re.fullmatch(r"(?:She|He) (?:gives|sells|loses) (\d+) (?:of (?:her|his) )?\w+(?: to \w+| away)?\.", s):
            have[main] -= int(m[1])
        elif m := re.fullmatch(r".* (\d+) times as many(?: as before)?\.", s):
            have[main] *= int(m[1])
        elif m := re.fullmatch(r"(?:She|He) splits the \w+ into (\d+) equal groups and keeps only one group\.", s):
            assert have[main] % int(m[1]) == 0
            have[main] //= int(m[1])
        elif m := re.fullmatch(r"\w+ (?:also )?buys (\d+) \w+ for (\d+) dollars each\.", s):
            spent += int(m[1]) * int(m[2])
        elif m := re.fullmatch(r"(?:She|He) also buys a \w+ for (\d+) dollars\.", s):
            spent += int(m[1])
        elif m := re.fullmatch(r"(?:She|He) pays with (\d+) dollars\.", s):
            paid = int(m[1])
        elif re.fullmatch(r"How many dollars does \w+ get back\?", s):
            result = paid - spent
        elif re.fullmatch(r"How many dollars does \w+ spend\?", s):
            result = spent
        elif re.fullmatch(r"How many \w+ do they have together\?", s):
            result = sum(have.values())
        elif m := re.fullmatch(r"How many \w+ does (\w+) have(?: now| at the end| in the end)?\?", s):
            result = have[m[1]]
        else:
            raise AssertionError(f"no reading for sentence {s!r}")
    return result


# ----------------------------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------------------------
def test_generator_deterministic_and_seeded():
    a = toy.generate_problems(60, 3, "train", (1, 2, 3, 4))
    assert a == toy.generate_problems(60, 3, "train", (1, 2, 3, 4))
    b = toy.generate_problems(60, 4, "train", (1, 2, 3, 4))
    assert [p["question"] for p in a] != [p["question"] for p in b]
    assert len({p["question"] for p in a}) == 60  # distinct within a call
    assert {p["level"] for p in toy.generate_problems(200, 0, levels=(2, 4))} == {2, 4}


def test_splits_disjoint():
    train = {p["question"] for seed in (0, 1) for p in toy.generate_problems(3000, seed, "train", (1, 2, 3, 4))}
    test = {p["question"] for seed in (0, 1) for p in toy.generate_problems(600, seed, "test", (1, 2, 3, 4))}
    assert len(test) > 1000 and not (train & test)


@pytest.mark.parametrize("split", ["train", "test"])
def test_solutions_are_correct(split):
    for p in toy.generate_problems(800, 7, split, (1, 2, 3, 4)):
        lines = p["solution"].split("\n")
        assert lines[-1] == f"#### {p['answer']}"
        assert p["answer"] == str(_read_question(p["question"])), p
        known = {int(x) for x in re.findall(r"\d+", p["question"])}
        n_ops, last = 0, None
        for line in lines[:-1]:
            m = re.search(r"([\d +\-*/]+?) = (\d+)\b", line)
            assert m, line
            value = _eval(m[1].strip())
            assert value == int(m[2]) and value >= 0, line
            assert all(int(x) in known for x in re.findall(r"\d+", m[1])), (line, p["question"])
            known.add(int(m[2]))
            n_ops += len(re.findall(r" [+\-*/] ", m[1]))
            last = m[2]
        assert last == p["answer"] and n_ops == p["level"], p
        assert int(p["answer"]) < 1000


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="valid"):
        toy.generate_problems(3, 0, "validation")
    with pytest.raises(ValueError, match="valid"):
        toy.generate_problems(3, 0, levels=(0, 1))


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return toy.load_tokenizer()


def test_tokenizer_round_trip_and_digits(tok):
    probs = toy.generate_problems(200, 1, "test", (1, 2, 3, 4))
    texts = [p["question"] for p in probs] + [p["solution"] for p in probs] + [
        "Ünïcödé, emoji 🙂 and tabs\t\n  spaces", "<think> 3 + 4 = 7 </think> <answer> 7 </answer> #### 7"]
    for t in texts:
        assert tok.decode(tok(t, add_special_tokens=False)["input_ids"]) == t
    ids = tok("It costs 90817 dollars.", add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert [x for x in pieces if x.isdigit()] == ["9", "0", "8", "1", "7"]
    assert all(not any(c.isdigit() for c in x) or x.isdigit() for x in tok.get_vocab())  # no token mixes digits


def test_tokenizer_knows_template_words(tok):
    pre = tok.backend_tokenizer.pre_tokenizer
    for p in toy.generate_problems(500, 2, "train", (1, 2, 3, 4)):
        for text in (p["question"], p["solution"]):  # every word / digit / punctuation piece is a single token
            assert len(tok(text, add_special_tokens=False)["input_ids"]) == len(pre.pre_tokenize_str(text)), text
    for w in ["<think>", "</think>", "<answer>", "</answer>"]:
        assert len(tok(" " + w, add_special_tokens=False)["input_ids"]) <= 3, w
    assert len(tok(" ####", add_special_tokens=False)["input_ids"]) == 1


def test_tokenizer_specials_and_chat_template(tok):
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for s in toy.SPECIAL_TOKENS:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5\n#### 5"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n2 + 3 = 5\n#### 5<|im_end|>\n")
    assert toy.render_prompt(tok, "Q?") == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok) <= toy.TOY_VOCAB_SIZE


def test_committed_tokenizer_matches_a_fresh_build(tok):
    fresh = toy.build_tokenizer()
    assert fresh.get_vocab() == tok.get_vocab()
    text = " ".join(p["question"] + p["solution"] for p in toy.generate_problems(50, 5, "test"))
    assert fresh(text)["input_ids"] == tok(text)["input_ids"]


def test_encode_batch_masks_prompt(tok):
    probs = toy.generate_problems(3, 0)
    ids, mask, labels = toy.encode_batch(tok, probs)
    for i, p in enumerate(probs):
        keep = labels[i] != -100
        assert tok.decode(labels[i][keep]) == p["solution"] + "<|im_end|>"
        first = int(keep.nonzero()[0])
        assert tok.decode(ids[i, :first]) == toy.render_prompt(tok, p["question"])
        assert int(mask[i].sum()) == int(keep.nonzero()[-1]) + 1


def test_extract_answer():
    assert toy.extract_answer("a = 3\n#### 1,234") == "1234"
    assert toy.extract_answer("#### 3 then #### -7") == "-7"
    assert toy.extract_answer("no answer 5") is None


# ----------------------------------------------------------------------------------------------------------------
# Presets, pretraining, committed checkpoint
# ----------------------------------------------------------------------------------------------------------------
def test_presets_quantizable_shapes():
    from transformers import Qwen2ForCausalLM

    for name, cfg in toy.TOY_PRESETS.items():
        assert cfg.hidden_size % 64 == 0 and cfg.intermediate_size % 64 == 0, name
        assert (cfg.hidden_size // cfg.num_attention_heads) % 16 == 0 and not cfg.tie_word_embeddings, name
    model = Qwen2ForCausalLM(toy.TOY_PRESETS["smoke"])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * 4 + 1 and all(m.in_features % 64 == 0 for m in linears)
    with pytest.raises(ValueError, match="smoke"):
        toy.TOY_PRESETS["huge"]


def test_tiny_pretrain_lowers_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    path = toy.ensure_checkpoint("smoke", tmp_path / "ck", steps=10, batch=4, eval_n=0, log_every=0)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # written aside, renamed into place
    rec = json.loads((path / "pretrain.json").read_text())
    assert rec["final_loss"] < rec["first_loss"] - 1.0, rec
    assert rec["steps_done"] == 10 and rec["torch"] == torch.__version__
    assert AutoModelForCausalLM.from_pretrained(str(path)).config.model_type == "qwen2"
    assert toy.ensure_checkpoint("smoke", path) == path  # present: not retrained
    assert json.loads((path / "pretrain.json").read_text()) == rec


def test_committed_smoke_checkpoint_solves_easy_problems():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = toy.smoke_checkpoint_dir()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.eos_token == "<|im_end|>"
    assert model.config.to_dict()["hidden_size"] == toy.TOY_PRESETS["smoke"].hidden_size
    # Partially right: most easy problems solved (measured 0.70 on these 60), the hard ones mostly not (0.07 measured
    # on 200 level-3 test problems), so RL has room to raise the reward.
    easy = toy.evaluate_accuracy(model, tok, toy.generate_problems(60, 11, "test", levels=(1,)))
    assert easy["acc"] >= 0.5, easy
    hard = toy.evaluate_accuracy(model, tok, toy.generate_problems(40, 11, "test", levels=(3,)))
    assert hard["acc"] <= 0.4, hard
    record = json.loads((path / "pretrain.json").read_text())
    assert 0.15 <= record["test_t1"]["acc"] <= 0.5 and record["steps_done"] == record["steps"]
