"""``quant.layout=kernel``: an NVFP4/MXFP4 base held only in the CUDA kernels' re-laid-out layout
(``qerl.kernels.relaid``) computes, trains and saves exactly what the compressed-tensors layout does, with one copy
of the weights. On the CPU every product goes through the pure-torch conversion; the GPU paths (CUDA GEMV/GEMM,
``dequantize_relaid``) are checked by ``tests/test_cuda_fp4.py -m gpu`` and the Triton-interpreter test."""

from __future__ import annotations

import json

import pytest
import torch

from qerl import kernels as qk
from qerl.config import ConfigError, load_config
from qerl.fastdecode import relayout_model
from qerl.kernels import relaid
from qerl.lora import QuantLoRALinear, lora_modules, resident_weight_bytes
from qerl.model import load_policy, save_quantized_base

FP4 = ("nvfp4", "mxfp4")


def _pair(fmt, seed=3):
    a, _ = load_policy("preset:tiny", fmt, device="cpu", dtype=torch.float32, seed=seed)
    b, _ = load_policy("preset:tiny", fmt, device="cpu", dtype=torch.float32, seed=seed, layout="kernel")
    return a, b


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", FP4)
def test_kernel_layout_holds_one_copy_and_computes_the_same(fmt):
    a, b = _pair(fmt)
    assert a.qerl["layout"] == "compressed" and b.qerl["layout"] == "kernel"
    mods = lora_modules(b)
    assert all(relaid.is_relaid(m.packed) and "weight_packed" not in m.packed for m in mods.values())
    # a fused group's members are consecutive row views of one buffer (decode reads the group as one weight)
    attn = b.model.layers[0].self_attn
    q, k = attn.q_proj.weight_relaid, attn.k_proj.weight_relaid
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert k.storage_offset() == q.storage_offset() + q.numel()
    # resident base bytes: the compressed-tensors size (+4 bytes of decode exponent per weight or group)
    ra, rb = resident_weight_bytes(a)["quantized_base"], resident_weight_bytes(b)["quantized_base"]
    assert ra <= rb <= ra + 4 * len(mods)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    for m in mods.values():  # what the base is, per linear
        ma = dict(lora_modules(a))[next(n for n, x in mods.items() if x is m)]
        assert torch.equal(m.dequantized_weight(torch.float32), ma.dequantized_weight(torch.float32))
        assert qk.backend_for(fmt, torch.zeros(1, m.in_features), m.packed) == "torch_reference"


@pytest.mark.parametrize("fmt", FP4)
def test_kernel_layout_trains_and_saves_the_same(fmt, tmp_path):
    a, b = _pair(fmt)
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    for m in (a, b):
        for mod in lora_modules(m).values():  # a nonzero B, so the base's backward (x̂ = g·Ŵ) reaches A
            torch.nn.init.normal_(mod.lora_B.weight, std=0.02, generator=torch.Generator().manual_seed(7))
        m(ids).logits.float().pow(2).mean().backward()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and (pa.grad is None) == (pb.grad is None), na
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad), na
    sa, sb = a.state_dict(), b.state_dict()  # the checkpoint's names and bytes, whatever the layout
    assert list(sa) == list(sb)
    assert all(sa[k].dtype == sb[k].dtype and torch.equal(_bytes(sa[k]), _bytes(sb[k])) for k in sa)
    b.load_state_dict(sa)  # the same base loads (LoRA and the rest are restored as usual)
    from safetensors.torch import load_file
    da, db = save_quantized_base(a, tmp_path / "a"), save_quantized_base(b, tmp_path / "b")
    ta = {k: v for f in sorted(da.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    tb = {k: v for f in sorted(db.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert sorted(ta) == sorted(tb) and any(k.endswith("weight_packed") for k in ta)
    assert all(torch.equal(_bytes(ta[k]), _bytes(tb[k])) for k in ta)
    assert json.loads((da / "config.json").read_text()) == json.loads((db / "config.json").read_text())
    c, _ = load_policy("preset:tiny", fmt, device="cpu", dtype=torch.float32, seed=4)
    with pytest.raises(RuntimeError, match="different base"):  # (PyTorch loads the other tensors, then raises)
        b.load_state_dict(c.state_dict())


def test_a_weight_the_layout_cannot_hold_keeps_its_compressed_tensors():
    m = next(iter(lora_modules(_pair("nvfp4")[0]).values()))
    q = {k: v.clone() for k, v in m.packed.items()}
    q["weight_scale"].view(torch.uint8)[0, 0] = 0  # a zero scale over nonzero codes: prepare would zero them
    q["weight_packed"][0, :8] = 0x33
    assert relaid.from_compressed(m.fmt, q) is None
    lin = QuantLoRALinear("nvfp4", q, m.in_features, m.out_features)
    stats = relayout_model(torch.nn.ModuleDict({"o_proj": lin}))
    assert stats["converted"] == 0 and stats["kept"] == 1 and "weight_packed" in lin.packed


def test_layout_choices_are_checked():
    with pytest.raises(ValueError, match="valid layouts"):
        load_policy("preset:tiny", "nvfp4", device="cpu", layout="fragments")
    with pytest.raises(ValueError, match="nvfp4 or mxfp4"):
        load_policy("preset:tiny", "nf4", device="cpu", layout="kernel")
    with pytest.raises(ConfigError, match="quant.layout"):
        load_config(["quant=nvfp4", "quant.layout=fragments"])
    with pytest.raises(ConfigError, match="must be 'nvfp4' or 'mxfp4'"):
        load_config(["quant=bf16", "quant.layout=kernel"])
    assert load_config(["quant=mxfp4", "quant.layout=kernel"]).quant.layout == "kernel"


def test_auto_layout_is_kernel_only_where_the_cuda_kernels_run(monkeypatch):
    """``auto`` (the default of ``load_policy``, ``quant.layout`` and ``qerl.bench --layout``) holds an FP4 base in the
    kernels' layout only on a GPU that runs the CUDA FP4 kernels: the CPU, other formats and a GPU with the kernels
    switched off keep the compressed-tensors tensors; an explicit layout is kept as asked."""
    from qerl import bench, bench_common
    from qerl.model import resolve_layout

    assert load_config([]).quant.layout == "auto" and load_config(["quant=nvfp4"]).quant.layout == "auto"
    pol, _ = load_policy("preset:tiny", "nvfp4", device="cpu")
    assert pol.qerl["layout"] == "compressed" and "weight_packed" in next(iter(lora_modules(pol).values())).packed
    for fmt in ("nvfp4", "mxfp4", "nf4", "bf16"):
        assert resolve_layout("auto", fmt, "cpu") == "compressed"
    assert resolve_layout("kernel", "nvfp4", "cpu") == "kernel" and resolve_layout("compressed", "nvfp4", "cuda") == \
        "compressed"
    monkeypatch.setenv("QERL_CUDA_GEMV", "0")  # the CUDA kernels off: nothing to hold the kernels' layout for
    assert resolve_layout("auto", "nvfp4", "cuda") == "compressed"
    with pytest.raises(ValueError, match="valid layouts are \\['auto', 'compressed', 'kernel'\\]"):
        resolve_layout("fragments", "nvfp4", "cpu")
    monkeypatch.setattr(bench_common, "LAYOUT", "auto")
    monkeypatch.setattr(bench_common, "DEVICE", "cpu")  # bench rows record the resolved layout, never "auto"
    assert bench._layout_for("nvfp4") == "compressed"
    monkeypatch.setattr(bench_common, "LAYOUT", "kernel")
    assert bench._layout_for("mxfp4") == "kernel" and bench._layout_for("nf4") == "compressed"


def test_training_run_is_identical_in_either_layout(tmp_path):
    """Two smoke-scale GRPO steps (rollout, rewards, log-probs, update) give the same metrics in both layouts."""
    from qerl.train import run

    rows = {}
    for layout in ("compressed", "kernel"):
        out = tmp_path / layout
        run(load_config(["scale=smoke", "quant=nvfp4", f"quant.layout={layout}", "train.steps=2", "eval.sets=[]",
                         "data.max_new_tokens=32", "train.progress=false", f"out_dir={out}", "experiment=layout"]))
        (metrics,) = out.rglob("metrics.jsonl")
        rows[layout] = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert f"layout: {layout}" in (metrics.parent / "config.yaml").read_text()
    keys = ("reward", "pg_loss", "grad_norm", "entropy", "response_length")
    assert len(rows["kernel"]) == 2
    assert [[r[k] for k in keys] for r in rows["compressed"]] == [[r[k] for k in keys] for r in rows["kernel"]]


# ------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_kernel_layout_decodes_trains_and_holds_one_copy(fmt):
    """On the GPU: the graph sampler draws the same tokens with the same log-probs in both layouts (the CUDA GEMV
    reads the same words either way), every linear gives the same products at decode, mid and large M and the same
    input gradients, and the kernel layout makes no second copy (the dispatcher's re-layout cache stays empty)."""
    from conftest import perturb_lora_b

    from qerl.lora import LoraSpec
    from qerl.rollout import Sampler

    pols = {}
    for layout in ("compressed", "kernel"):
        torch.manual_seed(0)
        pol, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=8), device="cuda", layout=layout)
        perturb_lora_b(pol)
        pols[layout] = pol
    assert pols["kernel"].qerl["layout"] == "kernel"
    auto, _ = load_policy("preset:tiny", fmt, LoraSpec(rank=8), device="cuda")  # the default on a GPU with the kernels
    assert auto.qerl["layout"] == "kernel" and all(relaid.is_relaid(m.packed) for m in lora_modules(auto).values())
    del auto
    before = len(qk._CUDA_PREPARED)
    ros, samplers = {}, {}  # (the samplers stay alive: their fused weights key the re-layout cache)
    for layout, pol in pols.items():
        s = samplers[layout] = Sampler(pol, tok, 128, cuda_graphs=True, fused=True)
        ros[layout] = s.generate(["how many apples", "3 + 4 is", "a"], 4, max_new_tokens=200, temperature=1.0, seed=3)
        assert ros[layout].stats["fused_decode"] and s.use_graphs
        if layout == "compressed":
            made = len(qk._CUDA_PREPARED) - before
            assert made > 0  # the compressed layout's decode made its second copies
    assert len(qk._CUDA_PREPARED) - before == made  # ... and the kernel layout none
    assert torch.equal(ros["compressed"].completion_ids, ros["kernel"].completion_ids)
    assert torch.equal(ros["compressed"].logp, ros["kernel"].logp)
    ma, mb = lora_modules(pols["compressed"]), lora_modules(pols["kernel"])
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, a in ma.items():
        b = mb[name]
        for m in (1, 8, 24, 300):
            x = torch.randn(m, a.in_features, device="cuda", generator=g).bfloat16()
            with torch.no_grad():
                ya, yb = a.fmt.linear(x, a.packed), b.fmt.linear(x, b.packed)
            if m <= 16:  # the same CUDA GEMV on the same words
                assert torch.equal(ya, yb), (name, m)
            else:  # CUDA GEMM / Triton / dequantize + cuBLAS: the same weights, other summation orders
                assert ((ya.float() - yb.float()).abs() <= 1e-2 * ya.float().abs() + 1e-2).all(), (name, m)
            gout = torch.randn(m, a.out_features, device="cuda", generator=g).bfloat16()
            assert torch.equal(a.fmt.linear_t(gout, a.packed), b.fmt.linear_t(gout, b.packed)), (name, m)
    ra = resident_weight_bytes(pols["compressed"])["quantized_base"]
    assert resident_weight_bytes(pols["kernel"])["quantized_base"] <= ra + 4 * len(mb)


def test_unfused_group_members_convert_one_by_one():
    """q/k/v that are not one buffer (e.g. NVFP4 members with their own global scales, which the fused decode does
    not concatenate) are converted member by member, each with its own tensors, and compute what they did."""
    from qerl.quant import get_format

    fmt = get_format("nvfp4")
    g = torch.Generator().manual_seed(2)
    block = torch.nn.Module()
    ref = {}
    for i, (name, n) in enumerate((("q_proj", 64), ("k_proj", 32), ("v_proj", 32))):
        w = torch.randn(n, 128, generator=g) * (1 + 3 * i)  # other amax, other global scale
        lin = QuantLoRALinear(fmt, fmt.quantize(w), 128, n)
        setattr(block, name, lin)
        ref[name] = lin.dequantized_weight(torch.float32)
    gs = [getattr(block, n).weight_global_scale.item() for n in ("q_proj", "k_proj", "v_proj")]
    assert len(set(gs)) == 3
    stats = relayout_model(block)
    assert stats["converted"] == 3 and stats["kept"] == 0
    ptrs = {getattr(block, n).weight_relaid.untyped_storage().data_ptr() for n in ref}
    assert len(ptrs) == 3
    x = torch.randn(3, 128, generator=g)
    for name, w in ref.items():
        m = getattr(block, name)
        assert relaid.is_relaid(m.packed) and m.weight_global_scale.item() == gs[list(ref).index(name)]
        assert torch.equal(m.dequantized_weight(torch.float32), w)
        assert torch.equal(fmt.linear(x, m.packed), x @ w.t())


def test_layer_benchmark_times_the_kernel_layout_as_its_own_columns(monkeypatch):
    """``benchmarks.kernel_bench --layout kernel|both``: an NVFP4/MXFP4 column ``<fmt>-kernel`` holds its weights in
    the kernels' layout alone and its timed products (forward and backward) are the compressed column's."""
    from benchmarks import kernel_bench as kb

    assert kb.layout_columns(["bf16", "nvfp4", "mxfp4", "nf4"], "both") == \
        ["bf16", "nvfp4", "nvfp4-kernel", "mxfp4", "mxfp4-kernel", "nf4"]
    assert kb.layout_columns(["bf16", "nvfp4"], "kernel") == ["bf16", "nvfp4-kernel"]
    assert kb.layout_columns(["nvfp4"], "compressed") == ["nvfp4"]
    with pytest.raises(ValueError, match="valid layouts are compressed, kernel, both"):
        kb.layout_columns(["nvfp4"], "fragments")
    monkeypatch.setattr(kb, "DEVICE", "cpu")
    monkeypatch.setattr(kb, "ROTATE_BYTES", 1)  # one copy of each weight
    for fmt in FP4:
        assert kb._fp4(fmt + kb.KL)
        wc, wk = kb._Weights(fmt, 48, 192, seed=4), kb._Weights(fmt + kb.KL, 48, 192, seed=4)
        assert relaid.is_relaid(wk.qs[0]) and "weight_packed" not in wk.qs[0] and not hasattr(wk, "pws")
        x, g = torch.randn(5, 192).bfloat16(), torch.randn(5, 48).bfloat16()
        assert torch.equal(kb._call(fmt, wc, 0, x, "fwd")(), kb._call(fmt + kb.KL, wk, 0, x, "fwd")())
        assert torch.equal(kb._call(fmt, wc, 0, g, "bwd")(), kb._call(fmt + kb.KL, wk, 0, g, "bwd")())
