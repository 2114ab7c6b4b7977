"""Rewards on real GSM8K / MATH-500 / AIME / AMC answers: right, wrong, malformed, pathological, threads, speed.

The reference for accuracy is math-verify itself, called directly in the main thread (where its signal
timeouts work); the format rewards are checked against the official code's regular expressions.
"""

import json
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest
from math_verify import parse, verify

from qerl import rewards as R

DATA = Path(R.__file__).resolve().parent / "assets" / "data"


def _jsonl(rel):
    return [json.loads(line) for line in open(DATA / rel, encoding="utf-8")]


GSM8K = _jsonl("gsm8k/test.jsonl")
MATH500 = _jsonl("math500/test.jsonl")
AIME24 = _jsonl("aime24/test.jsonl")
AIME25 = _jsonl("aime25/test.jsonl")
AMC23 = _jsonl("amc23/test.jsonl")


def mv_reference(gold: str, pred: str) -> float:
    """math-verify on its own: gold and prediction wrapped in $…$, parsed and verified in the main thread."""
    wrap = lambda s: s if "$" in s.replace("\\$", "") else f"${s}$"
    return float(verify(parse(wrap(gold)), parse(wrap(pred))))


@pytest.fixture(scope="module")
def pool():
    p = R.VerifierPool(num_workers=2, timeout_s=5.0).start(wait=True)
    yield p
    p.close()


def test_gsm8k_right_and_wrong_every_test_answer(pool):
    golds = [r["answer"].split("####")[-1].strip() for r in GSM8K]  # raw golds, some with commas (1,080)
    assert sum("," in g for g in golds) == 14  # as SOURCE.md says: the comma case is really exercised
    norm = [g.replace(",", "") for g in golds]
    rng = random.Random(0)
    comps, answers, expect = [], [], []
    for g, n in zip(golds, norm, strict=True):
        style = rng.choice(["<think>work</think> <answer>{}</answer>", "so \\boxed{{{}}}.", "steps\n#### {}"])
        comps += [style.format(g), style.format(n), style.format(int(n) + 1)]
        answers += [n, g, n]
        expect += [1.0, 1.0, 0.0]
    stats = {}
    got = R.accuracy(comps, answers, stats=stats, pool=pool)
    assert got == expect
    assert stats.get("reward_errors", 0) == 0


def test_aime_zero_padded_and_amc_float_answers(pool):
    padded = [r for r in AIME24 if r["answer"].startswith("0")]
    assert len(padded) == 7
    comps, answers = [], []
    for r in padded:  # raw gold '025' vs prediction 25, and gold 25 vs prediction '025'
        comps += [f"\\boxed{{{int(r['answer'])}}}", f"<answer>{r['answer']}</answer>"]
        answers += [r["answer"], str(int(r["answer"]))]
    for r in AIME25:
        comps.append(f"<answer>{r['answer']}</answer>")
        answers.append(str(r["answer"]))
    for r in AMC23:  # gold as the file stores it, str(27.0) == '27.0'
        comps.append(f"The answer is $\\boxed{{{int(r['answer'])}}}$")
        answers.append(str(r["answer"]))
    assert R.accuracy(comps, answers, pool=pool) == [1.0] * len(comps)
    wrong = [f"\\boxed{{{int(r['answer']) + 1}}}" for r in AMC23]
    assert R.accuracy(wrong, [str(r["answer"]) for r in AMC23], pool=pool) == [0.0] * len(AMC23)


def test_math500_every_gold_boxed_is_right_and_shifted_matches_math_verify(pool):
    golds = [r["answer"] for r in MATH500]  # all 500 right (cheap: identical strings are decided in-process)
    right = R.accuracy([f"<think>..</think> so the answer is $\\boxed{{{g}}}$" for g in golds], golds, pool=pool)
    assert right == [1.0] * len(golds)
    # the same through math-verify in the workers (no in-process shortcut): every other gold against itself
    assert [v for v, _ in pool.verify([(g, [f"${g}$"]) for g in golds[::2]])] == [1.0] * len(golds[::2])
    golds = golds[::3]  # every third problem keeps the test fast; wrong answers need full sympy work
    shifted = golds[1:] + golds[:1]  # each problem answered with the next problem's answer
    got = R.accuracy([f"<answer>{p}</answer>" for p in shifted], golds, pool=pool)
    ref = [mv_reference(g, p) for g, p in zip(golds, shifted, strict=True)]
    assert got == ref
    assert sum(got) < 5  # almost all different


# Real MATH-500 golds, each with an equivalent rewriting and a wrong one (fractions, \text{}, intervals, tuples,
# degrees, complex numbers, radicals, bases, equations, lists).
VARIANTS = [
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", "(3, \\pi)"),
    ("\\frac{14}{3}", "\\dfrac{14}{3}", "\\frac{3}{14}"),
    ("90^\\circ", "90", "45^\\circ"),
    ("\\text{Evelyn}", "\\text{Evelyn}", "\\text{Bob}"),
    ("(3,4]", "(3, 4]", "[3,4)"),
    ("6 - 5i", "6-5i", "6+5i"),
    ("3\\sqrt{13}", "\\sqrt{117}", "3\\sqrt{11}"),
    ("x=5", "5", "6"),
    ("3, 5, 7", "3,5,7", "3,5,8"),
    ("52_8", "52_8", "53_8"),
    ("\\text{(C)}", "\\text{(C)}", "\\text{(D)}"),
]


def test_math500_latex_variants(pool):
    golds = {r["answer"] for r in MATH500}
    comps, answers, expect = [], [], []
    for gold, same, other in VARIANTS:
        assert gold in golds, gold  # a real MATH-500 answer
        comps += [f"<answer>{same}</answer>", f"\\boxed{{{same}}}", f"<answer>{other}</answer>"]
        answers += [gold, gold, gold]
        expect += [1.0, 1.0, 0.0]
    got = R.accuracy(comps, answers, pool=pool)
    assert got == expect
    assert [mv_reference(a, re.sub(r"^<answer>|</answer>$", "", c)) for c, a in zip(comps[::3], answers[::3],
                                                                                      strict=True)] == [1.0] * 11


def test_extraction_order_and_fallback(pool):
    # <answer> beats \boxed beats ####; the whole text is parsed only when there is no marker
    c = "#### 3\n\\boxed{2}\n<answer>1</answer>"
    assert R.extract_answer(c) == ("1", "answer_tag")
    assert R.extract_answer("#### 3\n\\boxed{2}") == ("2", "boxed")
    assert R.extract_answer("so #### 1,080 dollars") == ("1,080", "hash")
    assert R.extract_answer("\\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == ("x^{2}", "boxed")
    assert R.accuracy([c, c, "therefore the total is $42$."], ["1", "2", "42"], pool=pool) == [1.0, 0.0, 1.0]


def gsm8k_gold(i):
    return GSM8K[i]["answer"].split("####")[-1].strip()


# Real problems, each answered in words the way models write it, plus wrong twins in the same words:
# (dataset row, gold, right answers, wrong answers).
PHRASED = [
    (GSM8K, 0, ["18 dollars", "It is 18", "She makes \\$18 every day.", "18 dollars per day"],
     ["17 dollars", "It is 19", "She makes \\$17 every day.", "18 or 19 dollars", "18 dollars and 17 cents"]),
    (GSM8K, 13, ["18 vacuum cleaners", "She started with 18."], ["17 vacuum cleaners", "She started with 19."]),
    (GSM8K, 969, ["1,800 dollars", "He paid \\$1,800.", "1800 dollars"], ["1,700 dollars", "He paid \\$1,700."]),
    (GSM8K, 249, ["5,600 calories", "Sue consumed 5,600 more calories"], ["5,400 calories", "5,600 or 5,400"]),
    (GSM8K, 92, ["4 years old", "Jackson is 4"], ["5 years old", "Jackson is 14"]),
    (GSM8K, 98, ["5 cars", "5 people"], ["6 cars", "It is -5"]),
    (GSM8K, 118, ["4 solutions", "4 containers"], ["3 solutions", "40 containers"]),
    (MATH500, 381, ["Therefore \\frac{1}{2}", "The probability is $\\frac{1}{2}$.", "It is 1/2"],
     ["Therefore \\frac{1}{3}", "The probability is $\\frac{1}{4}$.", "It is 1/2 or 1/3"]),
]


def test_answers_in_words_score_like_their_number_and_wrong_twins_do_not(pool):
    comps, golds, expect = [], [], []
    for rows, i, right, wrong in PHRASED:
        gold = gsm8k_gold(i) if rows is GSM8K else rows[i]["answer"]
        for words, score in [(w, 1.0) for w in right] + [(w, 0.0) for w in wrong]:
            # wrong twins go without a marker instead of after ####: `#### 18 or 19` takes its leading number,
            # GSM8K's own convention
            for fmt in ("<think>..</think> <answer>{}</answer>", "so \\boxed{{{}}}", "#### {}" if score else "{}"):
                comps.append(fmt.format(words))
                golds.append(gold.replace(",", ""))
                expect.append(score)
    stats = {}
    assert R.accuracy(comps, golds, stats=stats, pool=pool) == expect
    assert stats.get("reward_errors", 0) == 0


def test_answers_in_words_with_a_plain_number_need_no_sympy(pool):
    comps = [f"<answer>{w}</answer>" for rows, _, right, _ in PHRASED if rows is GSM8K for w in right]
    golds = [gsm8k_gold(i).replace(",", "") for rows, i, right, _ in PHRASED if rows is GSM8K for _ in right]
    stats = {}
    assert R.accuracy(comps, golds, stats=stats, pool=pool) == [1.0] * len(comps)
    assert stats == {"reward_fast": len(comps)}


# math-verify's reading of bare text takes its last number; none of these answers is that number
LAST_NUMBER_TRAPS = [("3", "3\\sqrt{11}"), ("2", "(1, 2)"), ("2", "x > 2"), ("6", "6+5i"), ("5", "1, 2, 3, 4, 5"),
                     ("3", "It is 3\\sqrt{11}"), ("2", "It is 2^{10}"), ("5", "It is 6 + 5i"), ("5", "It is - 5"),
                     ("19", "It is 18 or 19"), ("2", "It is 2 pi"), ("20", "18 dollars, then 20")]


def test_no_reading_takes_the_last_number_of_an_answer(pool):
    golds = [g for g, _ in LAST_NUMBER_TRAPS]
    answers = [a for _, a in LAST_NUMBER_TRAPS]
    assert [float(verify(parse(f"${g}$"), parse(a))) for g, a in LAST_NUMBER_TRAPS] == [1.0] * len(golds)  # real traps
    assert R.accuracy([f"<answer>{a}</answer>" for a in answers], golds, pool=pool) == [0.0] * len(golds)
    assert R.accuracy([f"<answer>{a}</answer>" for a in ["It is 2^{10}", "It is -5"]], ["1024", "-5"],
                      pool=pool) == [1.0, 1.0]


def test_prose_free_keeps_the_one_math_span():
    assert R.prose_free("It is 18 dollars.") == "18"
    assert R.prose_free("He paid \\$1,800.") == "\\$1,800"
    assert R.prose_free("Therefore, the answer is $\\frac{1}{2}$.") == "$\\frac{1}{2}$"
    assert R.prose_free("It is 2 pi") == "2 pi"  # pi, sqrt, log ... are math, not prose
    assert R.prose_free("It is sqrt(11)") == "sqrt(11)"
    for math_only in ["18", "18 \\text{ dollars}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "x = 5", "\\sqrt{2}"]:
        assert R.prose_free(math_only) is None, math_only  # no prose word: the answer is read as written
    for hedge in ["18 or 19", "18 dollars and 17 cents", "x = 5 or x = 7", "no answer"]:
        assert R.prose_free(hedge) is None, hedge  # several math spans, or none


def test_pool_tries_every_candidate_until_one_verifies(pool):
    # the first candidate parses (as 18·d·o·l·l·a·r·s) and is wrong; it must not end the search
    assert pool.verify([("18", ["$18 dollars$", "$18$"]), ("18", ["$18 dollars$", "$17$"])]) == [(1.0, None),
                                                                                                   (0.0, None)]


MALFORMED = ["", "   ", None, "<answer></answer>", "\\boxed{}", "\\boxed{", "####", "<answer>\\frac{</answer>",
             "</answer>18<answer>", "\\boxed{\\left(}", "$$$$", "<think></think>"]


def test_malformed_scores_zero_without_errors(pool):
    stats = {}
    assert R.accuracy(MALFORMED, ["18"] * len(MALFORMED), stats=stats, pool=pool) == [0.0] * len(MALFORMED)
    assert stats.get("reward_errors", 0) == 0


PATHOLOGICAL = [
    "x" * 100_000,
    "<answer>" * 20_000,
    "\\boxed{" * 30_000,
    "{" * 50_000 + "}" * 50_000,
    "<answer>$" + "{" * 1500 + "$</answer>",  # hangs math-verify's parser without a timeout
    "\\boxed{9^{9^{9^{9}}}}",  # hangs sympy
    "\\boxed{10^{10^{10}}}",
    "$9^9^9^9$",
    "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 301,
    "<answer>(1+x)^{100000}</answer>",
    "\u2603\x00\ud800\U0001f600" * 5000,
    "",
]


def test_pathological_neither_hangs_nor_crashes():
    with R.VerifierPool(num_workers=2, timeout_s=1.5, batch_timeout_s=60) as p:
        stats = {}
        t = time.monotonic()
        got = R.accuracy(PATHOLOGICAL, ["5"] * len(PATHOLOGICAL), stats=stats, pool=p)
        elapsed = time.monotonic() - t
        assert got == [0.0] * len(PATHOLOGICAL)
        assert stats["reward_errors"] >= 2 and stats["reward_timeouts"] >= 2
        # 12 items, 2 workers, <= 1.5 s each (+ respawns): bounded well below a hang
        assert elapsed < 6 * 1.5 + 8, elapsed
        assert R.accuracy(["\\boxed{\\frac{10}{2}}"], ["5"], pool=p) == [1.0]  # still serving


def test_hard_kill_when_soft_timeouts_are_off():
    # soft_timeout_s=0 turns math-verify's signal timeouts off, so only the wall-clock kill can stop the item
    with R.VerifierPool(num_workers=1, timeout_s=1.0, soft_timeout_s=0) as p:
        t = time.monotonic()
        stats = {}
        got = R.accuracy(["\\boxed{9^{9^{9}}}", "\\boxed{\\frac{10}{2}}"], ["5", "5"], stats=stats, pool=p)
        assert got == [0.0, 1.0]
        assert p.counters["timeouts"] == 1 and p.counters["restarts"] == 1
        assert stats["reward_errors"] == 1
        assert time.monotonic() - t < 10


def test_batch_timeout_bounds_a_whole_call():
    with R.VerifierPool(num_workers=1, timeout_s=30.0, soft_timeout_s=0, batch_timeout_s=2.0) as p:
        p.start(wait=True)
        t = time.monotonic()
        got = R.accuracy(["\\boxed{9^{9^{9}}}"] * 3, ["5"] * 3, pool=p)
        assert got == [0.0] * 3 and time.monotonic() - t < 6


def test_called_from_threads_uses_the_default_pool():
    R.configure_pool(num_workers=2, timeout_s=1.5)
    comps = ["<answer>\\frac{1}{2}</answer>", "\\boxed{0.5}", "#### 1,080", "\\boxed{9^{9^{9^{9}}}}", "$\\frac{3}{6}$"]
    golds = ["\\frac12", "\\frac{1}{2}", "1080", "5", "0.5"]
    expect = [1.0, 1.0, 1.0, 0.0, 1.0]
    results, errors = [], []

    def work():
        try:
            results.append(R.accuracy(comps, golds))
        except BaseException as e:  # pragma: no cover - the failure we test for
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and results == [expect] * 3
    assert R.accuracy(comps, golds) == expect  # and from the main thread, after the spawning threads are gone
    R.shutdown_pool()
    R.configure_pool()


def test_default_pool_works_in_a_forked_child():
    comps, golds = ["\\boxed{\\frac{2}{4}}", "<answer>3</answer>"], ["0.5", "4"]
    assert R.accuracy(comps, golds) == [1.0, 0.0]  # parent starts the default pool
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must build its own pool, not talk to the parent's workers
        code = 1
        try:
            os.write(w, json.dumps(R.accuracy(comps, golds)).encode())
            R.shutdown_pool()
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert json.loads(os.read(r, 1000)) == [1.0, 0.0]
    assert R.accuracy(comps, golds) == [1.0, 0.0]  # the parent's pool is untouched
    R.shutdown_pool()


def test_256_normal_completions_are_fast(pool):
    rng = random.Random(1)
    comps, golds = [], []
    for i in range(256):
        if i % 2:
            g = GSM8K[i]["answer"].split("####")[-1].strip().replace(",", "")
            comps.append(f"<think>{'step ' * 300}</think> <answer>{g if rng.random() < .5 else '7'}</answer>")
        else:
            g = MATH500[i]["answer"]
            comps.append(f"<think>{'step ' * 300}</think> <answer>{g if rng.random() < .5 else '7'}</answer>")
        golds.append(g)
    pool.start(wait=True)
    t = time.monotonic()
    out = R.combined(["accuracy", "soft_format"])(comps, golds)
    elapsed = time.monotonic() - t
    assert len(out.total) == 256 and out.stats["reward_errors"] == 0
    print(f"256 completions scored in {elapsed:.2f} s ({out.stats})")
    assert elapsed < 5.0, elapsed  # ~1 s on 2 busy CPU cores


# --- format rewards against the official regular expressions


SOFT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
THINK = re.compile(r"<think>.+?</think>.*", re.DOTALL)


def test_format_rewards_equal_official_regexes_on_random_strings():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "a", "<", ">", "/", "think"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 14))) for _ in range(20_000)]
    texts += ["<think>x</think>\n <answer>1</answer>", "<think></think><answer></answer>", "<think></think>"]
    assert R.soft_format(texts) == [0.2 if SOFT.search(t) else 0.0 for t in texts]
    assert R.think_format(texts) == [0.2 if THINK.search(t) else 0.0 for t in texts]
    assert sum(R.soft_format(texts)) > 0 and sum(R.think_format(texts)) > 0


def test_format_rewards_linear_on_junk():
    junk = ["<think>" * 30_000, "<think></think>" * 20_000 + " x", "<think> </think> " * 20_000]
    t = time.monotonic()
    assert R.soft_format(junk) == [0.0, 0.0, 0.0]
    assert R.think_format(junk) == [0.0, 0.2, 0.2]
    assert time.monotonic() - t < 1.0


def test_gsm8k_exact_official_semantics():
    comps = ["<think>a</think><answer> 72 </answer>", "<answer>1</answer> then <answer>72</answer> tail", "72",
             " 72\n", "<answer>72.</answer>", "<answer>72", "<answer>7,2</answer>", ""]
    assert R.gsm8k_exact(comps, ["72"] * len(comps)) == [2.0, 2.0, 2.0, 2.0, 0.0, 2.0, 0.0, 0.0]


def test_gsm8k_hash_official_semantics():
    comps = ["so #### 1,080", "####1080", "#### 72\nlater #### 73", "#### $72", "#### -5", "#### 5.", "no answer"]
    golds = ["1080", "1080", "72", "72", "-5", "5", "5"]
    assert R.gsm8k_hash(comps, golds) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert R.gsm8k_hash(["#### 1,080"], ["1,080"]) == [1.0]  # an unnormalised gold works too


def test_combined_weights_and_per_function_values(pool):
    comps = ["<think>r</think> <answer>72</answer>", "<answer>72</answer>", "<think>r</think><answer>71</answer>"]
    f = R.combined(["accuracy", "soft_format", "gsm8k_exact"], [1.0, 0.5, 0.25])
    out = f(comps, ["72"] * 3)
    assert out.per_function == {"accuracy": [1.0, 1.0, 0.0], "soft_format": [0.2, 0.0, 0.2],
                                "gsm8k_exact": [2.0, 2.0, 0.0]}
    assert out.total == pytest.approx([1 + 0.1 + 0.5, 1 + 0.5, 0.1])
    m = out.metrics()
    assert m["rewards/accuracy/mean"] == pytest.approx(2 / 3) and m["reward_errors"] == 0
    assert m["reward"] == pytest.approx((1.6 + 1.5 + 0.1) / 3)


def test_registry_errors_name_the_valid_keys():
    with pytest.raises(ValueError, match="valid:.*accuracy"):
        R.get_reward("acc")
    with pytest.raises(ValueError, match="valid:"):
        R.combined(["accuracy", "nope"])
    with pytest.raises(ValueError, match="weight"):
        R.combined(["accuracy"], [1.0, 2.0])
    with pytest.raises(ValueError, match="answers"):
        R.gsm8k_hash(["a", "b"], ["1"])
    assert set(R.REWARDS) == {"accuracy", "soft_format", "think_format", "gsm8k_exact", "gsm8k_hash"}
