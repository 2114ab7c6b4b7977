"""compressed-tensors checkpoints both ways on a tiny Qwen2: written by compressed-tensors and read by qerl,
written by qerl and decompressed by compressed-tensors (through transformers' loader).

compressed-tensors writes its checkpoint the way llm-compressor's ``oneshot`` + ``save_pretrained`` does:
``apply_quantization_config``, RTN weight calibration (memoryless min-max; NVFP4 global scales shared by
q/k/v and by gate/up, as llm-compressor fuses them), ``ModelCompressor.compress_model``, ``save_pretrained``,
``ModelCompressor.update_config``. llm-compressor itself cannot be installed beside compressed-tensors 0.20.
"""

from __future__ import annotations

import json

import pytest
import torch

from qerl.quant import FORMATS, NVFP4Format
from qerl.quant.checkpoint import (
    detect_format,
    load_safetensors_dir,
    quantization_config_for,
    save_compressed,
    split_quantized_state_dict,
)

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.offload import update_offload_parameter  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

# Every registered format with a compressed-tensors scheme (nvfp4, mxfp4, int4, and any added later).
CT_FORMATS_OF_QERL = sorted(n for n, f in FORMATS.items() if f.checkpoint is not None)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_model(fmt: str = "nvfp4") -> torch.nn.Module:
    """A 2-layer Qwen2 whose every K is a multiple of the format's block (hidden 64, or the block when larger)."""
    torch.manual_seed(0)
    hidden = max(64, FORMATS[fmt].block or 0)
    cfg = transformers.Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                   num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    # from_config(dtype=...) keeps the rotary buffers in float32, as from_pretrained does
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # make one block of each weight all-zero and give one an outlier
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight[0, :32] = 0
            layer.mlp.down_proj.weight[1, 5] = 1.0
    return model


def linear_names(model) -> list[str]:
    return [f"model.layers.{i}.{grp}.{n}" for i in range(len(model.model.layers))
            for grp, names in (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:])) for n in names]


def _group_of(model, name: str) -> list[str]:
    parent, _, leaf = name.rpartition(".")
    for group in FUSED:
        if leaf in group:
            return [f"{parent}.{n}" for n in group]
    return [name]


def calibrate_like_llm_compressor(model) -> None:
    """RTN weight qparams with compressed-tensors' own helpers (what llm-compressor's observer calls)."""
    for name, mod in model.named_modules():
        args = getattr(getattr(mod, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        wg = mod.weight.unflatten(-1, (-1, args.group_size))
        gs = None
        if args.strategy == "tensor_group":
            a = None
            for other in _group_of(model, name):
                ow = model.get_submodule(other).weight.unflatten(-1, (-1, args.group_size))
                a = ow.amax(-1).max() if a is None else a
                a = torch.max(torch.max(a, -ow.amin(-1).min()), ow.amax(-1).max())
            gs = generate_gparam(-a.reshape(1), a.reshape(1))
            update_offload_parameter(mod, "weight_global_scale", gs)
        scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args, global_scale=gs)
        update_offload_parameter(mod, "weight_scale", scale)
        update_offload_parameter(mod, "weight_zero_point", zp)
        mod.quantization_status = QuantizationStatus.FROZEN


@pytest.fixture(scope="module", params=CT_FORMATS_OF_QERL)
def ct_checkpoint(request, tmp_path_factory):
    fmt = request.param
    model = tiny_model(fmt)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    preset = FORMATS[fmt].checkpoint.preset
    qcfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                              ignore=["lm_head"])
    apply_quantization_config(model, qcfg, show_progress=False)
    calibrate_like_llm_compressor(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    directory = tmp_path_factory.mktemp(f"ct_{fmt}")
    model.save_pretrained(directory)
    compressor.update_config(str(directory))
    return fmt, directory, dense


def load_with_compressed_tensors(directory):
    """compressed-tensors' decompression of a checkpoint, through transformers' loader."""
    qc = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), quantization_config=qc,
                                                             dtype=torch.bfloat16).eval()


def dense_model_from(weights: dict[str, torch.Tensor], fmt: str) -> torch.nn.Module:
    model = tiny_model(fmt)
    model.load_state_dict(weights, strict=True)
    return model


def logits(model) -> torch.Tensor:
    ids = torch.arange(0, 256, 8).reshape(2, -1)  # (2, 16)
    with torch.no_grad():
        return model(ids).logits


def test_quantization_config_matches_compressed_tensors(ct_checkpoint):
    fmt, directory, _ = ct_checkpoint
    written = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert quantization_config_for(fmt) == written
    assert detect_format(written) == fmt
    assert detect_format(json.loads((directory / "config.json").read_text())) == fmt


def test_compressed_tensors_checkpoint_reads_back(ct_checkpoint):
    fmt, directory, dense = ct_checkpoint
    f = FORMATS[fmt]
    quant, rest = split_quantized_state_dict(load_safetensors_dir(directory))
    names = linear_names(tiny_model(fmt))
    assert sorted(quant) == sorted(names)
    assert all(sorted(q) == sorted(f.checkpoint.tensors) for q in quant.values())
    assert "lm_head.weight" in rest and "model.layers.0.self_attn.q_proj.bias" in rest

    ref = load_with_compressed_tensors(directory)
    ref_sd = ref.state_dict()
    ours = dict(rest)
    for name, q in quant.items():
        w_hat = f.dequantize(q, torch.bfloat16)
        assert torch.equal(w_hat.view(torch.int16), ref_sd[f"{name}.weight"].view(torch.int16)), name
        ours[f"{name}.weight"] = w_hat
        # our quantizer, fed the original weight (and llm-compressor's fused global scale), packs the same bytes
        kw = {}
        if fmt == "nvfp4":
            kw["global_scale"] = NVFP4Format.global_scale(*(dense[f"{n}.weight"] for n in _group_of(ref, name)))
        mine = f.quantize(dense[f"{name}.weight"], **kw)
        for key, t in q.items():
            assert torch.equal(mine[key].view(torch.uint8) if t.element_size() == 1 else mine[key],
                               t.view(torch.uint8) if t.element_size() == 1 else t), (name, key)
    assert torch.equal(logits(dense_model_from(ours, fmt)), logits(ref))


def test_qerl_checkpoint_loads_in_compressed_tensors(ct_checkpoint, tmp_path):
    fmt, _, _ = ct_checkpoint
    f = FORMATS[fmt]
    model = tiny_model(fmt)
    sd = model.state_dict()
    names = linear_names(model)
    quant = {n: f.quantize(sd[f"{n}.weight"]) for n in names}
    other = {k: v for k, v in sd.items() if k[: -len(".weight")] not in quant}
    cfg = model.config.to_dict()
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    out = save_compressed(tmp_path / "ckpt", cfg, quant, other, fmt, max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded

    back_quant, back_rest = split_quantized_state_dict(load_safetensors_dir(out))
    assert sorted(back_quant) == sorted(quant) and sorted(back_rest) == sorted(other)
    assert detect_format(json.loads((out / "config.json").read_text())) == fmt

    ref = load_with_compressed_tensors(out)
    ref_sd = ref.state_dict()
    ours = dict(other)
    for n in names:
        w_hat = f.dequantize(quant[n], torch.bfloat16)
        assert torch.equal(w_hat.view(torch.int16), ref_sd[f"{n}.weight"].view(torch.int16)), n
        ours[f"{n}.weight"] = w_hat
    assert torch.equal(logits(dense_model_from(ours, fmt)), logits(ref))


CT_FORMATS = {"W4A16": "pack-quantized", "W8A16": "pack-quantized", "FP8": "float-quantized",
              "NVFP4": "nvfp4-pack-quantized", "NVFP4A16": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized"}


def _preset_config(preset: str) -> dict:
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                            quantization_status="compressed", format=CT_FORMATS[preset])
    return {"model_type": "qwen2", "quantization_config": qc.model_dump()}


@pytest.mark.parametrize("preset, match", [
    ("FP8", r"quantizes activations"),
    ("NVFP4", r"quantizes activations"),
    ("W8A16", r"unsupported compressed-tensors scheme.*num_bits=8"),
])
def test_detect_format_names_unsupported_schemes(preset, match):
    with pytest.raises(ValueError, match=match):
        detect_format(_preset_config(preset))


def test_detect_format_other_cases():
    assert detect_format({"model_type": "qwen2"}) is None
    assert detect_format({"model_type": "qwen2", "quantization_config": None}) is None
    assert detect_format(_preset_config("NVFP4A16")) == "nvfp4"
    assert detect_format(_preset_config("MXFP4A16")) == "mxfp4"
    assert detect_format(_preset_config("W4A16")) == "int4"
    asym = _preset_config("W4A16")  # the asymmetric variant stores zero points: not INT4 W4A16
    asym["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(ValueError, match=r"unsupported compressed-tensors scheme.*symmetric=False"):
        detect_format(asym)
    with pytest.raises(ValueError, match="'bitsandbytes'"):
        detect_format({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    frozen = _preset_config("NVFP4A16")
    frozen["quantization_config"]["quantization_status"] = "frozen"
    with pytest.raises(ValueError, match="'frozen'"):
        detect_format(frozen)


def test_save_compressed_rejects_bad_input(tmp_path):
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="'nf4'"):
        save_compressed(tmp_path, {}, {"a": FORMATS["nf4"].quantize(w)}, {}, "nf4")
    with pytest.raises(ValueError, match="weight_global_scale"):
        save_compressed(tmp_path, {}, {"a": FORMATS["mxfp4"].quantize(w)}, {}, "nvfp4")
    with pytest.raises(FileNotFoundError):
        load_safetensors_dir(tmp_path / "nothing")
