"""QuantLoRALinear, swap_linears and load_policy on tiny models (CPU, no network)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from qerl.lora import LoraSpec, QuantLoRALinear, lora_modules, packed_state, resident_weight_bytes
from qerl.model import load_adapter, load_policy, save_adapter, save_quantized_base
from qerl.quant import FORMATS

FMTS = [f for f in FORMATS if 64 % (FORMATS[f].block or 1) == 0]  # those the tiny models (K = 64) fit
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def hf_checkpoint(tmp_path, bf16_linears=True):
    """A tiny random Qwen2 saved as an ordinary HF checkpoint (fp32; linears rounded to bf16 when asked)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=768, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)  # not all-ones, so trained/loaded norms are visible
            if bf16_linears and n.endswith("proj.weight"):
                p.copy_(p.bfloat16().float())
    model.save_pretrained(tmp_path / "base")
    return tmp_path / "base", model


def randomize_adapter(policy, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(policy).values():
            if m.rank:
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
        for n, p in policy.named_parameters():
            if p.requires_grad and "layernorm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("fmt", FMTS)
def test_one_step_changes_every_lora_tensor_and_no_packed_byte(fmt):
    policy, _ = load_policy("preset:tiny", fmt, LoraSpec(rank=4, alpha=8), train_norms=True, device="cpu")
    randomize_adapter(policy)  # B != 0, so the gradient reaches A as well as B
    packed_before = {k: v.clone() for k, v in packed_state(policy).items()}
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    assert len(packed_before) == 2 * 7 * (1 if fmt == "bf16" else len(next(iter(lora_modules(policy).values())).packed))
    assert all(not t.requires_grad for t in packed_before.values())
    ids = torch.randint(0, 700, (2, 10))
    loss = policy(input_ids=ids, labels=ids).loss
    loss.backward()
    for n, p in policy.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n
    torch.optim.AdamW(trainable.values(), lr=1e-3, weight_decay=0.0).step()
    n_lora = sum(".lora_" in n for n in trainable)
    assert n_lora == 2 * 2 * 7 and sum("layernorm" in n for n in trainable) == 4
    for n, p in trainable.items():
        assert not torch.equal(p, before[n]), f"{n} did not change"
    for k, v in packed_state(policy).items():
        assert torch.equal(v, packed_before[k]), f"packed {k} changed"


@pytest.mark.parametrize("fmt", sorted(FORMATS))  # K = 128: every format fits
def test_input_gradient_matches_dequantized_dense_linear(fmt):
    """The custom backward (recompute Ŵ, grad_x = g Ŵ) equals autograd through a dense copy of Ŵ."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64, bias=True)
    f = FORMATS[fmt]
    q = f.quantize(lin.weight.detach())
    mod = QuantLoRALinear(fmt, q, 128, 64, lin.bias, LoraSpec(rank=4, alpha=4))
    with torch.no_grad():
        mod.lora_B.weight.normal_()
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = mod(x)
    g = torch.randn_like(y)
    y.backward(g)
    w = f.dequantize(q, torch.float32)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = x2 @ w.T + lin.bias + (x2 @ mod.lora_A.weight.T @ mod.lora_B.weight.T) * mod.scaling
    y2.backward(g)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_backward_keeps_no_dense_weight_alive():
    """Nothing saved for backward is weight-sized: the dequantized Ŵ is recomputed, not stored."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 512, bias=False)
    mod = QuantLoRALinear("nvfp4", FORMATS["nvfp4"].quantize(lin.weight.detach()), 256, 512, None,
                          LoraSpec(rank=4, alpha=4))
    saved = []
    x = torch.randn(2, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mod(x).sum().backward()
    assert saved, "the LoRA path saves its activations"
    assert max(t.numel() for t in saved) < 256 * 512 // 4, [tuple(t.shape) for t in saved]


def test_loaded_bf16_policy_matches_transformers_and_peft_roundtrip(tmp_path):
    from peft import PeftModel

    base_dir, ref = hf_checkpoint(tmp_path)
    policy, _ = load_policy(str(base_dir), "bf16", LoraSpec(rank=8, alpha=16), train_norms=True, device="cpu")
    ids = torch.randint(0, 700, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(policy(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    randomize_adapter(policy)
    with torch.no_grad():
        ours = policy(input_ids=ids).logits
    adapter = save_adapter(policy, tmp_path / "adapter", str(base_dir))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["modules_to_save"]
    peft_base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(peft_base, str(adapter)).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - ref(input_ids=ids).logits).abs().max() > 1e-3  # the adapter really does something
    # and our own loader restores it into a fresh policy
    fresh, _ = load_policy(str(base_dir), "bf16", LoraSpec(rank=8, alpha=16), train_norms=True, device="cpu")
    load_adapter(fresh, adapter)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, ours, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", [f for f in FMTS if FORMATS[f].checkpoint is not None])
def test_compressed_tensors_checkpoint_roundtrip_through_load_policy(tmp_path, fmt):
    base_dir, _ = hf_checkpoint(tmp_path)
    policy, _ = load_policy(str(base_dir), fmt, None, device="cpu")
    save_quantized_base(policy, tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert "quantization_config" in cfg
    again, _ = load_policy(str(tmp_path / "ct"), fmt, LoraSpec(rank=4), device="cpu")
    for k, v in packed_state(policy).items():
        assert torch.equal(packed_state(again)[k], v), k
    ids = torch.randint(0, 700, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="compressed-tensors"):
        load_policy(str(tmp_path / "ct"), "nf4" if fmt == "nvfp4" else "nvfp4", None, device="cpu")


def test_compressed_tensors_written_checkpoint_gives_its_decompressed_logits(tmp_path):
    """A checkpoint compressed by compressed-tensors itself loads into load_policy and reproduces the logits of
    compressed-tensors' own decompressed model."""
    ct = pytest.importorskip("test_quant_checkpoint")
    model = ct.tiny_model()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    qcfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
                              ignore=["lm_head"])
    apply_quantization_config(model, qcfg, show_progress=False)
    ct.calibrate_like_llm_compressor(model)
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    model.save_pretrained(tmp_path / "ct")
    comp.update_config(str(tmp_path / "ct"))
    reference = ct.load_with_compressed_tensors(tmp_path / "ct")
    ours, _ = load_policy(str(tmp_path / "ct"), "nvfp4", None, device="cpu", dtype=torch.bfloat16)
    ids = torch.randint(0, 250, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_nvfp4_load_shares_global_scale_in_fused_groups(tmp_path):
    base_dir, _ = hf_checkpoint(tmp_path)
    policy, _ = load_policy(str(base_dir), "nvfp4", None, device="cpu")
    attn = policy.model.layers[0].self_attn
    mlp = policy.model.layers[0].mlp
    assert torch.equal(attn.q_proj.weight_global_scale, attn.k_proj.weight_global_scale)
    assert torch.equal(attn.q_proj.weight_global_scale, attn.v_proj.weight_global_scale)
    assert torch.equal(mlp.gate_proj.weight_global_scale, mlp.up_proj.weight_global_scale)
    assert not torch.equal(attn.o_proj.weight_global_scale, attn.q_proj.weight_global_scale)


def test_non_finite_checkpoint_weight_is_named(tmp_path):
    """A checkpoint weight holding inf/NaN stops load_policy with the parameter's name (before: silently NaN/zeroed)."""
    from safetensors.torch import load_file, save_file

    from qerl.errors import UserError

    base_dir, _ = hf_checkpoint(tmp_path)
    path = base_dir / "model.safetensors"
    good = load_file(str(path))
    cases = [  # up_proj and k_proj share an NVFP4 global scale with gate_proj / q_proj, v_proj: the bad member is named
        ("model.layers.1.mlp.up_proj.weight", (float("inf"), float("nan")), r"2 non-finite values \(1 inf, 1 nan\)"),
        ("model.layers.0.self_attn.k_proj.weight", (float("-inf"),), r"1 non-finite value \(1 inf, 0 nan\)"),
        ("model.layers.0.self_attn.o_proj.weight", (float("nan"),), r"1 non-finite value \(0 inf, 1 nan\)"),
    ]
    for name, bad, counts in cases:
        sd = dict(good)
        w = sd[name].clone()
        w.view(-1)[torch.arange(len(bad)) * 7] = torch.tensor(bad)
        sd[name] = w
        save_file(sd, str(path), metadata={"format": "pt"})
        for fmt in FMTS:
            with pytest.raises(UserError, match=rf"^{name} has {counts}; cannot quantize to {fmt} "):
                load_policy(str(base_dir), fmt, LoraSpec(rank=4), device="cpu")


def test_resident_bytes_and_bad_inputs():
    sizes = {}
    for fmt in FMTS:
        p, _ = load_policy("preset:tiny", fmt, LoraSpec(rank=4), device="cpu")
        sizes[fmt] = resident_weight_bytes(p)["quantized_base"]
        assert p.lm_head.weight.dtype == torch.float32 and not p.lm_head.weight.requires_grad
    n_weights = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
    assert sizes["bf16"] == 2 * n_weights
    assert sizes["nvfp4"] < sizes["bf16"] / 3 and sizes["mxfp4"] < sizes["nvfp4"]
    with pytest.raises(ValueError, match="valid"):
        load_policy("preset:tiny", "int3", LoraSpec(), device="cpu")
    with pytest.raises(ValueError, match="unknown model preset"):
        load_policy("preset:qwen9", "bf16", LoraSpec(), device="cpu")
    with pytest.raises(FileNotFoundError):
        load_policy("./no/such/dir", "bf16", LoraSpec(), device="cpu")
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(ValueError, match="full fine-tuning"):
        load_policy("preset:tiny", "nvfp4", None, device="cpu", full_finetune=True)


def test_full_finetune_trains_every_weight():
    p, _ = load_policy("preset:tiny", "bf16", None, device="cpu", full_finetune=True)
    assert not lora_modules(p)
    assert all(t.requires_grad and t.dtype == torch.float32 for t in p.parameters())


def test_shape_presets_have_the_paper_sizes():
    """Qwen2.5-7B-Instruct shape preset: 7.62B parameters, 15.2 GB in BF16 (paper Table 3)."""
    from qerl.model import preset_config

    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(preset_config("qwen2.5-7b"))
    n = sum(p.numel() for p in m.parameters())
    assert abs(n - 7.6157e9) / 7.6157e9 < 1e-3
    assert abs(2 * n / 1e9 - 15.2) < 0.1
