"""Tests for qerl.kernels.cuda_prefetch (QERL_L2_PREFETCH): the span descriptors cover exactly the weight bytes the
decode GEMV's warps load first (checked by walking the descriptors as the kernel does, on CPU tensors of the real
layouts), the budget, the switch; the kernel's machine code (CPU, nvcc); with ``-m gpu`` the launch itself and the
graph sampler's tokens unchanged by it."""

from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
import torch
from conftest import perturb_lora_b

from qerl.kernels import cuda_build, cuda_fp4, cuda_prefetch
from qerl.quant import FORMATS


def _fp4_weight(fmt: str, n: int, k: int):
    q = FORMATS[fmt].quantize(0.02 * torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
    return cuda_fp4.prepare(fmt, q["weight_packed"], q["weight_scale"], q.get("weight_global_scale"))


def _pieces(desc):
    """The byte ranges [start, end) the kernel prefetches: piece (row, seg) of a span at base + row * stride + off."""
    out = []
    for base, stride, count, nseg, *segs in desc:
        assert len(segs) == 2 * nseg
        for row in range(count):
            for j in range(nseg):
                start = base + row * stride + segs[2 * j]
                out.append((start, start + segs[2 * j + 1]))
    return out


def _expected(w, splits: int, fraction: float):
    """The bytes of the first round(fraction * share) chunks (at least one) of each split's K range, per row block:
    from the tensors' own strides (FP4: strip, chunk; BF16: row, 64 columns a chunk)."""
    c = w.k // 64
    out = []
    tensors = [(w.qweight, 64 * 2)] if w.fmt == "bf16" else [(w.qweight, None), (w.scales, None)]
    for t, dense_cb in tensors:
        es = t.element_size()
        cb = dense_cb if dense_cb else t.stride(1) * es
        for row in range(t.shape[0]):
            for j in range(splits):
                c0, c1 = j * c // splits, (j + 1) * c // splits
                if c1 == c0:
                    continue
                n = max(1, round(fraction * (c1 - c0)))
                start = t.data_ptr() + row * t.stride(0) * es + c0 * cb
                out.append((start, start + n * cb))
    return out


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "bf16"])
@pytest.mark.parametrize("splits,fraction", [(1, 1.0), (3, 1.0), (4, 0.25), (5, 0.5), (16, 0.1)])
def test_spans_cover_the_leading_chunks_of_every_split(fmt, splits, fraction):
    n, k = 64, 64 * 20
    w = (cuda_fp4.dense_weight(torch.randn(n, k).to(torch.bfloat16)) if fmt == "bf16"
         else _fp4_weight(fmt, n, k))
    got = sorted(_pieces(cuda_prefetch.spans(w, splits, fraction)))
    assert got == sorted(_expected(w, splits, fraction))
    assert all(s % 16 == 0 and (e - s) % 16 == 0 and e > s for s, e in got)
    if fraction == 1.0:  # the whole weight, each byte once
        total = sum(e - s for s, e in got)
        assert total == cuda_prefetch.weight_bytes(w)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(got))


def test_layer_spans_budget_takes_o_first_then_a_fraction():
    o, gu = _fp4_weight("nvfp4", 64, 256), _fp4_weight("nvfp4", 256, 256)
    ob, gb = cuda_prefetch.weight_bytes(o), cuda_prefetch.weight_bytes(gu)
    d = cuda_prefetch.layer_spans([(o, 2), (gu, 2)], ob + gb / 2)
    assert len(d) == 4  # words and scales of each
    size = sum(e - s for s, e in _pieces(d))
    assert ob + 0.4 * gb <= size <= ob + 0.6 * gb
    assert sum(e - s for s, e in _pieces(d[:2])) == ob  # all of o
    only_o = cuda_prefetch.layer_spans([(o, 2), (gu, 2)], ob)
    assert sum(e - s for s, e in _pieces(only_o)) == ob and len(only_o) == 2
    assert cuda_prefetch.layer_spans([(o, 2)], 0) == []
    with pytest.raises(ValueError, match="fraction"):
        cuda_prefetch.spans(o, 2, 1.5)
    with pytest.raises(ValueError, match="splits"):
        cuda_prefetch.spans(o, 17, 0.5)


def test_budget_switch(monkeypatch):
    monkeypatch.delenv("QERL_L2_PREFETCH", raising=False)
    assert cuda_prefetch.budget_mb() == 0
    monkeypatch.setenv("QERL_L2_PREFETCH", "24")
    assert cuda_prefetch.budget_mb() == 24
    for bad in ("-1", "lots", "2000"):
        monkeypatch.setenv("QERL_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match=f"QERL_L2_PREFETCH={bad!r}.*0 \\(off"):
            cuda_prefetch.budget_mb()
    from qerl.bench import _DECODE_ENV, DECODES
    assert {"fused-l2-16", "fused-l2-32", "fused-l2-48", "fused-l2-gu-32", "fused-l2-fork"} <= set(DECODES)
    assert 0 < float(_DECODE_ENV["fused-l2-fork"]["QERL_L2_PREFETCH"]) < 0.01
    assert _DECODE_ENV["fused-l2-32"] == {"QERL_L2_PREFETCH": "32"}
    assert _DECODE_ENV["fused-l2-gu-32"] == {"QERL_L2_PREFETCH": "32", "QERL_L2_PREFETCH_ORDER": "gu"}
    monkeypatch.delenv("QERL_L2_PREFETCH_ORDER", raising=False)
    assert cuda_prefetch.order() == ("o", "gu")
    monkeypatch.setenv("QERL_L2_PREFETCH_ORDER", "gu")
    assert cuda_prefetch.order() == ("gu",)
    monkeypatch.setenv("QERL_L2_PREFETCH_ORDER", "up")
    with pytest.raises(ValueError, match="QERL_L2_PREFETCH_ORDER='up'; valid: o-gu, gu, gu-o"):
        cuda_prefetch.order()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch,op", [("90a", "UBLKPF.L2"), ("80", "CCTL.E.PF2")])
def test_kernel_machine_code(tmp_path, arch, op):
    """sm_90a: one bulk L2 prefetch per piece, and the PDL trigger and wait around it; sm_80: line prefetches."""
    from benchmarks.wgmma_sass_check import _tool, functions, opcode
    cubin = tmp_path / "k.cubin"
    subprocess.run(["nvcc", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-cubin", "-o", str(cubin),
                    str(cuda_build.CSRC / "l2_prefetch.cu")], check=True, capture_output=True)
    sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    (fn,) = [v for name, v in functions(sass).items() if "l2_prefetch_kernel" in name]
    ops = [opcode(i) for _, i in fn]
    assert op in ops, sorted(set(ops))
    assert not any(o.startswith(("LDG", "STG", "ST.", "LD.")) for o in ops)  # reads and writes nothing
    if arch == "90a":
        assert "PREEXIT" in ops and "ACQBULK" in ops and ops.index("PREEXIT") < ops.index("UBLKPF.L2")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_prefetch_launch_and_bad_descriptors():
    w = _fp4_weight("nvfp4", 256, 512)
    w = cuda_fp4.CudaFP4Weight(w.fmt, w.n, w.k, w.qweight.cuda(), w.scales.cuda(), w.global_scale.cuda(), w.bexp,
                               w.bword, w.out_mult)
    dev = w.qweight.device
    cuda_prefetch.prefetch(cuda_prefetch.spans(w, 3, 0.5), dev)
    cuda_prefetch.join(dev)
    torch.cuda.synchronize()
    bad = cuda_prefetch.spans(w, 2, 1.0)
    bad[0][4] = 8  # an offset off the 16-byte grid
    with pytest.raises(RuntimeError, match="bad span descriptors"):
        cuda_prefetch.prefetch(bad, dev)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "bf16"])
def test_gpu_l2_prefetch_decode_is_bit_identical(fmt, monkeypatch):
    """The prefetch launches read and write nothing: the graph sampler draws the same tokens with the same log-probs
    with QERL_L2_PREFETCH=32 as without it, and it did launch."""
    from qerl.lora import LoraSpec
    from qerl.model import load_policy
    from qerl.rollout import Sampler
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    ros = {}
    for mb in ("0", "32"):
        monkeypatch.setenv("QERL_L2_PREFETCH", mb)
        before = cuda_prefetch.launches()
        s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
        ros[mb] = s.generate(["how many apples", "3 + 4 is", "a"], 4, max_new_tokens=300, temperature=1.0, seed=3)
        assert ros[mb].stats["fused_decode"] and s.use_graphs
        assert (cuda_prefetch.launches() > before) == (mb != "0")
    assert torch.equal(ros["0"].completion_ids, ros["32"].completion_ids)
    assert torch.equal(ros["0"].logp, ros["32"].logp)


def test_l2_prefetch_plan_takes_the_layers_weights_in_order_within_the_budget(monkeypatch):
    """fastdecode.l2_prefetch_plan on a real decode plan (tiny NVFP4 policy on the CPU): per layer, the spans of the
    o and gate|up weights the decode GEMV would launch with, in the order asked, within the budget. The GEMV's
    (weight, splits) lookup needs a CUDA device, so it is stood in for by the same re-laid-out weight of each module
    on the CPU (cuda_fp4.prepare) with 2 splits."""
    from qerl import kernels
    from qerl.fastdecode import build_decode_plan, l2_prefetch_plan
    from qerl.lora import LoraSpec
    from qerl.model import load_policy
    policy, _ = load_policy("preset:tiny", "nvfp4", LoraSpec(rank=4), device="cpu")
    plan = build_decode_plan(policy)
    assert kernels.decode_gemv_split(FORMATS["nvfp4"], plan[0]["gate_up"].q, 8, torch.device("cpu")) is None
    seen = {}

    def split(fmt, q, m, device, lora=None, act=None):
        w = cuda_fp4.prepare("nvfp4", q["weight_packed"], q["weight_scale"], q.get("weight_global_scale"))
        seen[w.qweight.data_ptr()] = (q["weight_packed"].shape[0], act)
        return w, 2

    monkeypatch.setattr(kernels, "decode_gemv_split", split)
    layers = policy.model.layers
    o_rows, gu_rows = layers[0].self_attn.o_proj.out_features, plan[0]["gate_up"].out_features
    big = l2_prefetch_plan(layers, plan, 8, 1e9)
    assert len(big) == len(layers) and all(len(d) == 4 for d in big)  # o's words and scales, then gate|up's
    assert [d[2] for d in big[0]] == [o_rows // 16] * 2 + [gu_rows // 16] * 2  # strips per span
    only_gu = l2_prefetch_plan(layers, plan, 8, 1e9, ("gu",))
    assert all(len(d) == 2 and d[0][2] == gu_rows // 16 for d in only_gu)
    gu_first = l2_prefetch_plan(layers, plan, 8, 1e9, ("gu", "o"))
    assert [d[2] for d in gu_first[0]] == [gu_rows // 16] * 2 + [o_rows // 16] * 2
    small = l2_prefetch_plan(layers, plan, 8, 1024.0)  # less than o: (a fraction of) o only, at least a chunk a split
    assert all(len(d) == 2 and d[0][2] == o_rows // 16 for d in small)
    assert all(sum(e - s for s, e in _pieces(d)) <= sum(e - s for s, e in _pieces(b[:2])) for d, b in zip(
        small, big, strict=True))
    assert l2_prefetch_plan(layers, plan, 8, 0.0) is None
