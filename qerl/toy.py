"""Toy task and toy models: synthetic GSM8K-style word problems, an in-project tokenizer, small Qwen2 presets.

`scale=smoke` and `scale=toy` train RL on a model that was pretrained here, from scratch, on these problems, so the
reward has real room to rise. The checkpoint is a normal Hugging Face directory (config.json, model.safetensors,
tokenizer files): the same loading path serves toy and real models.

    python -m qerl.toy pretrain --preset smoke --out DIR     # train from scratch, save_pretrained + pretrain.json
    python -m qerl.toy eval --model DIR --n 200              # greedy and T=1.0 accuracy on the test split
    python -m qerl.toy tokenizer --out DIR                   # rebuild the tokenizer (the committed one is in assets/)
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets" / "toy"
LEVELS = (1, 2, 3, 4)  # level = number of arithmetic operations in the worked solution

# ---------------------------------------------------------------------------------------------------------------
# Problem generator
# ---------------------------------------------------------------------------------------------------------------
_NAMES = (("Anna", "she"), ("Ben", "he"), ("Carla", "she"), ("David", "he"), ("Emma", "she"), ("Frank", "he"),
          ("Grace", "she"), ("Henry", "he"), ("Ivy", "she"), ("Jack", "he"), ("Kate", "she"), ("Leo", "he"),
          ("Mia", "she"), ("Noah", "he"), ("Olivia", "she"), ("Paul", "he"), ("Rosa", "she"), ("Sam", "he"),
          ("Tina", "she"), ("Victor", "he"))
_OBJECTS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "shells", "stamps", "balloons",
            "candies", "toys", "coins", "flowers", "eggs", "beads", "oranges", "crayons", "cupcakes", "rocks")
_CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("pack", "packs"), ("jar", "jars"))
_ITEMS = (("pen", "pens"), ("notebook", "notebooks"), ("ball", "balls"), ("hat", "hats"), ("cup", "cups"),
          ("plant", "plants"), ("shirt", "shirts"), ("kite", "kites"), ("puzzle", "puzzles"), ("lamp", "lamps"))


class _Person:
    def __init__(self, name: str, gender: str):
        self.name = name
        self.P, self.p, self.poss, self.obj = ("She", "she", "her", "her") if gender == "she" else ("He", "he", "his", "him")


def _people(rng: random.Random, k: int) -> list[_Person]:
    return [_Person(n, g) for n, g in rng.sample(_NAMES, k)]


def _count_story(rng: random.Random, level: int):
    """One person's pile of objects changes `level` times (+, -, *, /, or buying groups = * then +)."""
    a, b = _people(rng, 2)
    objs = rng.choice(_OBJECTS)
    q, s, left = [], [], level
    if rng.random() < 0.3:
        (cont, conts), n, k = rng.choice(_CONTAINERS), rng.randint(2, 9), rng.randint(2, 12)
        x = n * k
        q.append(f"{a.name} has {n} {conts} of {objs} with {k} {objs} in each {cont}.")
        s.append(f"{a.name} has {n} * {k} = {x} {objs}.")
        left -= 1
    else:
        x = rng.randint(5, 60)
        q.append(f"{a.name} has {x} {objs}.")
    used_scale = False
    while left > 0:
        ops = ["add", "sub"] if x > 2 else ["add"]
        if not used_scale and x * 2 <= 200:
            ops.append("mul")
        if not used_scale and any(x % k == 0 and x // k >= 2 for k in range(2, 6)):
            ops.append("div")
        if left >= 2:
            ops.append("groups")
        op = rng.choice(ops)
        if op == "add":
            m = rng.randint(2, 40)
            q.append(rng.choice([f"{a.P} buys {m} more {objs}.", f"{a.P} finds {m} more {objs}.",
                                 f"{b.name} gives {a.obj} {m} more {objs}.", f"{a.P} gets {m} more {objs} from {b.name}."]))
            s.append(f"Now {a.p} has {x} + {m} = {x + m} {objs}.")
            x, left = x + m, left - 1
        elif op == "sub":
            m = rng.randint(1, min(40, x - 1))
            q.append(rng.choice([f"{a.P} gives {m} {objs} to {b.name}.", f"{a.P} sells {m} {objs}.",
                                 f"{a.P} loses {m} {objs}.", f"{a.P} gives {m} of {a.poss} {objs} away."]))
            s.append(f"Now {a.p} has {x} - {m} = {x - m} {objs}.")
            x, left = x - m, left - 1
        elif op == "mul":
            k = rng.randint(2, max(2, min(4, 200 // x)))
            q.append(rng.choice([f"Then {a.p} collects more {objs} until {a.p} has {k} times as many as before.",
                                 f"The next week the number of {objs} {a.p} has grows to {k} times as many."]))
            s.append(f"Now {a.p} has {x} * {k} = {x * k} {objs}.")
            x, left, used_scale = x * k, left - 1, True
        elif op == "div":
            k = rng.choice([k for k in range(2, 6) if x % k == 0 and x // k >= 2])
            q.append(f"{a.P} splits the {objs} into {k} equal groups and keeps only one group.")
            s.append(f"Now {a.p} has {x} / {k} = {x // k} {objs}.")
            x, left, used_scale = x // k, left - 1, True
        else:
            (cont, conts), n, k = rng.choice(_CONTAINERS), rng.randint(2, 6), rng.randint(2, 12)
            q.append(f"{a.P} buys {n} {conts} with {k} {objs} in each {cont}.")
            s.append(f"{a.P} buys {n} * {k} = {n * k} {objs}.")
            s.append(f"Now {a.p} has {x} + {n * k} = {x + n * k} {objs}.")
            x, left = x + n * k, left - 2
    q.append(f"How many {objs} does {a.name} have {rng.choice(['now', 'at the end', 'in the end'])}?")
    return q, s, x


def _compare_story(rng: random.Random, level: int):
    """A chain of people, each with more / fewer / k times the objects of the previous one; maybe a total."""
    together = level % 2 == 0 and rng.random() < 0.5
    n_rel = level // 2 if together else level
    people = _people(rng, n_rel + 1)
    objs = rng.choice(_OBJECTS)
    x = rng.randint(5, 60)
    counts = [x]
    q, s = [f"{people[0].name} has {x} {objs}."], []
    for prev, cur in zip(people, people[1:], strict=False):
        ops = ["more", "fewer"] if x > 2 else ["more"]
        if x * 2 <= 200:
            ops.append("times")
        op = rng.choice(ops)
        if op == "more":
            m = rng.randint(2, 30)
            q.append(f"{cur.name} has {m} more {objs} than {prev.name}.")
            s.append(f"{cur.name} has {x} + {m} = {x + m} {objs}.")
            x += m
        elif op == "fewer":
            m = rng.randint(1, min(30, x - 1))
            q.append(f"{cur.name} has {m} fewer {objs} than {prev.name}.")
            s.append(f"{cur.name} has {x} - {m} = {x - m} {objs}.")
            x -= m
        else:
            k = rng.randint(2, max(2, min(4, 200 // x)))
            q.append(f"{cur.name} has {k} times as many {objs} as {prev.name}.")
            s.append(f"{cur.name} has {x} * {k} = {x * k} {objs}.")
            x *= k
        counts.append(x)
    if together:
        x = sum(counts)
        q.append(f"How many {objs} do they have together?")
        s.append(f"Together they have {' + '.join(map(str, counts))} = {x} {objs}.")
    else:
        q.append(f"How many {objs} does {people[-1].name} have?")
    return q, s, x


def _shop_story(rng: random.Random, level: int):
    """Buying items at a unit price (*), single items (+ to the total), and maybe change from a payment (-)."""
    a = _people(rng, 1)[0]
    change = level >= 2 and rng.random() < 0.5
    ops = level - int(change)  # = purchases by count (one "*" each) + additions to the total
    # n_mul purchases by count and n_single single items give ops = n_mul + (n_mul + n_single - 1)
    n_mul = rng.choice([m for m in (1, 2) if ops + 1 - 2 * m >= 0])
    n_single = ops + 1 - 2 * n_mul
    items = rng.sample(_ITEMS, n_mul + n_single)
    q, s, costs = [], [], []
    for i, (_, plural) in enumerate(items[:n_mul]):
        n, price = rng.randint(2, 9), rng.randint(2, 15)
        also = "" if i == 0 else "also "
        q.append(f"{a.name if i == 0 else a.P} {also}buys {n} {plural} for {price} dollars each.")
        s.append(f"The {plural} cost {n} * {price} = {n * price} dollars.")
        costs.append(n * price)
    for single, _ in items[n_mul:]:
        price = rng.randint(5, 40)
        q.append(f"{a.P} also buys a {single} for {price} dollars.")
        costs.append(price)
    total = sum(costs)
    if len(costs) > 1:
        s.append(f"In total {a.p} spends {' + '.join(map(str, costs))} = {total} dollars.")
    if change:
        paid = (total // 10 + 1) * 10 + 10 * rng.randint(0, 3)
        paid += 10 if paid - total < 2 else 0
        q.append(f"{a.P} pays with {paid} dollars. How many dollars does {a.p} get back?")
        s.append(f"{a.P} gets back {paid} - {total} = {paid - total} dollars.")
        return q, s, paid - total
    q.append(f"How many dollars does {a.name} spend?")
    return q, s, total


_FAMILIES = (_count_story, _compare_story, _shop_story)


def _split_of(question: str) -> str:
    """Deterministic train/test partition by a hash of the question text: 1 in 8 questions is a test question."""
    return "test" if hashlib.sha256(question.encode()).digest()[0] % 8 == 0 else "train"


def generate_problems(n: int, seed: int, split: str = "train", levels=(1, 2, 3)) -> list[dict]:
    """`n` distinct word problems of the given split: dicts with question, answer (integer string), solution
    (one step per line, last line `#### N`) and level (= number of operations). Deterministic in (seed, split);
    train and test are disjoint because the split is a function of the question text."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; valid: ['train', 'test']")
    levels = tuple(levels)
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise ValueError(f"unknown level(s) {bad or levels!r}; valid: {list(LEVELS)}")
    rng = random.Random(f"qerl-toy/{seed}/{split}")
    out, seen = [], set()
    while len(out) < n:
        level = rng.choice(levels)
        q, s, ans = rng.choice(_FAMILIES)(rng, level)
        question = " ".join(q)
        if question in seen or _split_of(question) != split:
            continue
        seen.add(question)
        out.append({"question": question, "answer": str(ans), "solution": "\n".join(s + [f"#### {ans}"]),
                    "level": level})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE learned on the templates, digits always single tokens, Qwen-style chat markup
# ---------------------------------------------------------------------------------------------------------------
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad / bos, chat markup, eos (as Qwen2.5-Instruct)
# Qwen2.5's template without its default system prompt (a tiny model need not read one on every sequence).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role'] + '; valid: system, user, assistant') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# English the RL prompts may add around a toy question (the paper's system prompt and GSM8K instruction): learned as
# whole words too. Anything else still tokenises (byte fallback); nothing maps to an unknown token.
_EXTRA_TEXT = (
    "You are a helpful assistant.",
    "Solve the following math problem step by step. The reasoning process and direct answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>: <think> ... </think> <answer> ... </answer>",
    "Let's think step by step first within <think> </think> tags, and output the final answer after \"####\" tag, "
    "e.g. #### 42. Please reason step by step, and put your final answer within \\boxed{}.",
)
TOY_VOCAB_SIZE = 768  # model vocabulary (a multiple of 64) >= the tokenizer's size


def build_tokenizer():
    """Train the toy byte-level BPE on generated problems (both splits, all levels) plus `_EXTRA_TEXT`; return a
    `PreTrainedTokenizerFast` with eos `<|im_end|>`, pad `<|endoftext|>` and the Qwen-style chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are split off one by one before the byte-level split, so no merge can ever join two digits (as Qwen2).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    problems = [p for split in ("train", "test") for p in generate_problems(3000, 0, split, LEVELS)]
    corpus = [f"<|im_start|>user\n{p['question']}<|im_end|>\n<|im_start|>assistant\n{p['solution']}<|im_end|>"
              for p in problems] + list(_EXTRA_TEXT) * 20
    trainer = trainers.BpeTrainer(vocab_size=TOY_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, model_max_length=1024)
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) > TOY_VOCAB_SIZE:
        raise RuntimeError(f"toy tokenizer has {len(fast)} tokens > TOY_VOCAB_SIZE={TOY_VOCAB_SIZE}")
    return fast


def tokenizer_dir() -> Path:
    """Directory of the committed toy tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    return ASSETS / "tokenizer"


def load_tokenizer(path: str | Path | None = None):
    """The toy tokenizer via `AutoTokenizer` (the committed one unless `path` is given)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or tokenizer_dir()))


# ---------------------------------------------------------------------------------------------------------------
# Model presets (Qwen2 architecture; every Linear's K a multiple of 64, head_dim a multiple of 16)
# ---------------------------------------------------------------------------------------------------------------
def _qwen2(hidden: int, layers: int, heads: int, kv_heads: int, inter: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=TOY_VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                       bos_token_id=0, eos_token_id=2, pad_token_id=0)


class _Presets(dict):
    """Plain dict of Qwen2Config presets; a bad key raises a ValueError listing the valid ones."""

    def __missing__(self, key):
        raise ValueError(f"unknown toy preset {key!r}; valid: {sorted(self)}")


TOY_PRESETS = _Presets(
    smoke=_qwen2(hidden=128, layers=4, heads=4, kv_heads=2, inter=384),  # ~1.0M params: 2 CPU cores, minutes
    toy=_qwen2(hidden=512, layers=8, heads=8, kv_heads=4, inter=1536),  # ~26M params: one GPU
)
# Pretraining recipe per preset (what `pretrain` and `ensure_checkpoint` use unless told otherwise).
# smoke: measured on 2 CPU cores (see qerl/assets/toy/smoke/pretrain.json). toy: not measured here (no GPU on the
# machine that wrote this); the probe-based stop keeps it partially right whatever its learning speed.
PRETRAIN_DEFAULTS = {
    "smoke": dict(steps=1500, batch=32, lr=3e-3, levels=(1, 2, 3)),
    "toy": dict(steps=4000, batch=64, lr=1e-3, levels=(1, 2, 3), eval_every=250, stop_acc=0.35),
}
PRETRAIN_SEED_OFFSET = 10_000


def smoke_checkpoint_dir() -> Path:
    """The committed, pretrained `smoke` checkpoint (a Hugging Face directory with model and tokenizer)."""
    return ASSETS / "smoke"


# ---------------------------------------------------------------------------------------------------------------
# Pretraining from scratch and evaluation
# ---------------------------------------------------------------------------------------------------------------
def render_prompt(tokenizer, question: str) -> str:
    """The "plain" prompt the RL pipeline uses for the toy task: one user turn, then the assistant header."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def encode_batch(tokenizer, problems: list[dict]):
    """Right-padded (input_ids, attention_mask, labels), each (B, T): prompt + solution + `<|im_end|>`, with labels
    -100 everywhere but on the solution tokens and the final `<|im_end|>`."""
    import torch

    rows = []
    for p in problems:
        prompt = tokenizer(render_prompt(tokenizer, p["question"]), add_special_tokens=False)["input_ids"]
        target = tokenizer(p["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, target))
    T = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)  # (B, T)
    for i, (a, b) in enumerate(rows):
        ids[i, : len(a) + len(b)] = torch.tensor(a + b)
        mask[i, : len(a) + len(b)] = 1
        labels[i, len(a) : len(a) + len(b)] = torch.tensor(b)
    return ids, mask, labels


def extract_answer(text: str) -> str | None:
    """The integer after the last `####` in a completion, or None."""
    import re

    found = re.findall(r"####\s*(-?[\d,]+)", text)
    return found[-1].replace(",", "") if found else None


def evaluate_accuracy(model, tokenizer, problems: list[dict], temperature: float = 0.0, seed: int = 0,
                      batch: int = 100, max_new_tokens: int = 128) -> dict:
    """Accuracy of `#### N` against the answer: greedy when temperature == 0, else pure sampling at that temperature
    (no top-k / top-p). Returns {"acc": float, "acc_by_level": {level: float}, "n": int}."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    right = []
    # Seeded sampling that leaves the caller's RNG state as it was.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        try:
            for i in range(0, len(problems), batch):
                chunk = problems[i : i + batch]
                enc = tokenizer([render_prompt(tokenizer, p["question"]) for p in chunk], return_tensors="pt",
                                padding=True, add_special_tokens=False).to(device)
                with torch.no_grad():
                    out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, **sample)  # (B, T + new)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                right += [extract_answer(t) == p["answer"] for t, p in zip(texts, chunk, strict=True)]
        finally:
            tokenizer.padding_side = side
            model.train(was_training)
    by_level = {}
    for ok, p in zip(right, problems, strict=True):
        by_level.setdefault(p["level"], []).append(ok)
    return {"acc": sum(right) / max(1, len(right)), "n": len(right),
            "acc_by_level": {lv: sum(v) / len(v) for lv, v in sorted(by_level.items())}}


def pretrain(preset: str, out_dir: str | Path, steps: int | None = None, batch: int | None = None,
             lr: float | None = None, seed: int = 0, device: str | None = None, levels=None, eval_n: int = 200,
             log_every: int = 50, threads: int | None = 2, eval_every: int | None = None,
             stop_acc: float | None = None) -> dict:
    """Train the `preset` model from scratch on train-split problems (loss on solution tokens only; AdamW, linear
    warmup then cosine decay to 10%), save model + tokenizer with `save_pretrained` and `pretrain.json`.
    Every `eval_every` steps a probe of 100 test problems is scored; with `stop_acc`, training stops once the probe's
    T=1.0 accuracy reaches it (keeps the model only partially right). `device` None: cuda if available, else cpu."""
    import copy
    import json
    import math
    import time

    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    d = {**PRETRAIN_DEFAULTS[preset]} if preset in PRETRAIN_DEFAULTS else TOY_PRESETS[preset]  # bad key: ValueError
    steps, batch, lr = steps or d["steps"], batch or d["batch"], lr or d["lr"]
    levels = tuple(levels or d["levels"])
    eval_every = d.get("eval_every", 0) if eval_every is None else eval_every
    stop_acc = d.get("stop_acc") if stop_acc is None else stop_acc
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    tok = load_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(copy.deepcopy(TOY_PRESETS[preset])).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    # A generator stream of its own (seed + 10000): the RL train prompts (seed 0, 1, ...) are not its exact problems.
    data = generate_problems(steps * batch, PRETRAIN_SEED_OFFSET + seed, "train", levels)
    probe = generate_problems(100, seed + 1, "test", levels) if eval_every else []
    t0, losses, probes = time.time(), [], []
    for step in range(steps):
        ids, mask, labels = (x.to(device) for x in encode_batch(tok, data[step * batch : (step + 1) * batch]))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # mean over solution tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and ((step + 1) % log_every == 0 or step == 0):
            avg = sum(losses[-log_every:]) / len(losses[-log_every:])
            print(f"step {step + 1}/{steps} loss {avg:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            g, s = evaluate_accuracy(model, tok, probe), evaluate_accuracy(model, tok, probe, temperature=1.0)
            probes.append({"step": step + 1, "greedy": g["acc"], "t1": s["acc"]})
            print(f"step {step + 1} probe greedy {g['acc']:.2f} {g['acc_by_level']} T=1 {s['acc']:.2f} "
                  f"{s['acc_by_level']}", flush=True)
            if stop_acc is not None and s["acc"] >= stop_acc:
                print(f"probe T=1.0 accuracy {s['acc']:.2f} >= stop_acc {stop_acc}: stopping", flush=True)
                break
    wall = time.time() - t0
    tail = max(1, min(20, len(losses) // 4))  # final loss = mean of the last few steps
    record = {"preset": preset, "steps": steps, "steps_done": len(losses), "batch": batch, "lr": lr, "seed": seed,
              "data_seed": PRETRAIN_SEED_OFFSET + seed, "levels": list(levels), "first_loss": losses[0],
              "final_loss": sum(losses[-tail:]) / tail, "wall_time_s": round(wall, 1), "device": device,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "params": sum(p.numel() for p in model.parameters()), "probes": probes}
    if eval_n:
        test = generate_problems(eval_n, seed, "test", levels)
        record["test_greedy"] = evaluate_accuracy(model, tok, test)
        record["test_t1"] = evaluate_accuracy(model, tok, test, temperature=1.0, seed=seed)
        print(f"test greedy {record['test_greedy']}\ntest T=1.0 {record['test_t1']}", flush=True)
    torch.set_num_threads(old_threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.to("cpu").save_pretrained(str(out))  # fp32 safetensors
    tok.save_pretrained(str(out))
    (out / "pretrain.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def ensure_checkpoint(preset: str, out_dir: str | Path, **pretrain_kwargs) -> Path:
    """`out_dir` if it already holds a checkpoint (config.json + model.safetensors), else pretrain `preset` into it
    with `PRETRAIN_DEFAULTS` (on cuda when available: the `toy` preset is meant for a GPU). Written to a temporary
    sibling and renamed into place, so concurrent callers never see a half-written checkpoint."""
    import os
    import shutil

    out = Path(out_dir)
    if not ((out / "config.json").exists() and (out / "model.safetensors").exists()):
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        pretrain(preset, tmp, **pretrain_kwargs)
        try:
            if out.exists() and not any(out.iterdir()):
                out.rmdir()
            os.rename(tmp, out)
        except OSError:  # another process finished first: keep its checkpoint
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _main(argv=None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m qerl.toy", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pretrain", help="train a toy model from scratch and save it as a HF checkpoint")
    p.add_argument("--preset", required=True, choices=sorted(TOY_PRESETS))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--levels", type=lambda s: tuple(int(x) for x in s.split(",")), help="e.g. 1,2,3")
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, help="probe accuracy every N steps (0: only at the end)")
    p.add_argument("--stop-acc", type=float, help="stop once the probe's T=1.0 accuracy reaches this")
    e = sub.add_parser("eval", help="greedy and T=1.0 accuracy of a checkpoint on the toy test split")
    e.add_argument("--model", required=True)
    e.add_argument("--n", type=int, default=200)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--split", default="test", choices=["train", "test"])
    e.add_argument("--levels", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 2, 3))
    e.add_argument("--device", default="cpu")
    e.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("tokenizer", help="rebuild the toy tokenizer into a directory")
    t.add_argument("--out", default=str(tokenizer_dir()))
    a = ap.parse_args(argv)
    if a.cmd == "pretrain":
        rec = pretrain(a.preset, a.out, a.steps, a.batch, a.lr, a.seed, a.device, a.levels, a.eval_n,
                       threads=a.threads, eval_every=a.eval_every, stop_acc=a.stop_acc)
        print(json.dumps(rec, indent=2))
    elif a.cmd == "eval":
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(a.threads)
        tok = load_tokenizer(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(a.device)
        probs = generate_problems(a.n, a.seed, a.split, a.levels)
        res = {"greedy": evaluate_accuracy(model, tok, probs),
               "t1": evaluate_accuracy(model, tok, probs, temperature=1.0, seed=a.seed)}
        print(json.dumps(res, indent=2))
    else:
        build_tokenizer().save_pretrained(a.out)
        print(f"saved toy tokenizer to {a.out}")


if __name__ == "__main__":
    _main()
