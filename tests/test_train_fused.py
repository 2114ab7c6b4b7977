"""The fused training kernels (``qerl.kernels.train_fused``): RMSNorm and SiLU·up forward and backward against the
Hugging Face formulas under autograd (Triton interpreter on the CPU in float32, compiled kernels in bf16 on a GPU),
and their installation into a policy (the same Parameters, AQN still finds the norms, the same loss and gradients)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import run_under_triton_interpreter

from qerl.kernels import train_fused as tf


def _ref_grads(fn, inputs, gy):
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*ins)
    y.backward(gy)
    return y.detach(), [t.grad for t in ins]


def _interpreter_main() -> None:
    from test_kernels import _interp_shim

    _interp_shim()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for m, d in ((37, 96), (16, 64), (5, 200)):  # rows not a multiple of the backward's 16, D not a power of two
        x = 3 * torch.randn(m, d, generator=g)
        w = 1 + 0.1 * torch.randn(d, generator=g)
        gy = torch.randn(m, d, generator=g)
        y0, (dx0, dw0) = _ref_grads(lambda a, b: tf.rms_norm_ref(a, b, 1e-6), (x, w), gy)
        y1, (dx1, dw1) = _ref_grads(lambda a, b: tf.rms_norm(a, b, 1e-6), (x, w), gy)
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx1, dx0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dw1, dw0, rtol=1e-4, atol=1e-4)
        xs = torch.randn(2, m, d, generator=g)  # (..., D) input, weight frozen: no weight gradient
        x3 = xs.clone().requires_grad_(True)
        tf.rms_norm(x3, w, 1e-5).backward(torch.ones_like(xs))
        x4 = xs.clone().requires_grad_(True)
        tf.rms_norm_ref(x4, w, 1e-5).backward(torch.ones_like(xs))
        torch.testing.assert_close(x3.grad, x4.grad, rtol=1e-4, atol=1e-5)
    for shape in ((3, 5000), (2, 7, 300), (1, 1)):
        a, b = 4 * torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        gy = torch.randn(*shape, generator=g)
        y0, (da0, db0) = _ref_grads(tf.silu_mul_ref, (a, b), gy)
        y1, (da1, db1) = _ref_grads(tf.silu_mul, (a, b), gy)
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(da1, da0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(db1, db0, rtol=1e-5, atol=1e-6)
    for B, H, L, D, cb in ((2, 3, 5, 16, 2), (1, 2, 7, 64, 1), (3, 1, 4, 8, 1)):  # cos for every row or broadcast
        q = torch.randn(B, L, H, D, generator=g).transpose(1, 2)  # HF's view: heads and positions transposed
        cos, sin = torch.randn(cb, L, D, generator=g), torch.randn(cb, L, D, generator=g)
        gy = torch.randn(B, H, L, D, generator=g)
        y0, (dq0,) = _ref_grads(lambda a, c=cos, s=sin: tf.rope_ref(a, c, s), (q,), gy)
        y1, (dq1,) = _ref_grads(lambda a, c=cos, s=sin: tf.rope(a, c, s), (q,), gy)
        torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dq1, dq0, rtol=1e-6, atol=1e-6)
    # bf16: the kernels round through integer bit operations (``_rnd``), so even the interpreter (whose own bf16
    # casts truncate) gives HF's bits for the rotary embedding, forward and backward
    q = torch.randn(2, 6, 3, 64, generator=g).bfloat16().transpose(1, 2)
    cos, sin = torch.randn(2, 6, 64, generator=g).bfloat16(), torch.randn(2, 6, 64, generator=g).bfloat16()
    gy = torch.randn(2, 3, 6, 64, generator=g).bfloat16()
    y0, (dq0,) = _ref_grads(lambda a: tf.rope_ref(a, cos, sin), (q,), gy)
    y1, (dq1,) = _ref_grads(lambda a: tf.rope(a, cos, sin), (q,), gy)
    assert torch.equal(y1, y0) and torch.equal(dq1, dq0), "bf16 rope differs from HF's ops"
    a, b = (3 * torch.randn(4, 999, generator=g)).bfloat16(), torch.randn(4, 999, generator=g).bfloat16()
    y0, y1 = tf.silu_mul_ref(a, b), tf.silu_mul(a, b)  # silu's exp: numpy's vs ATen's, a rare ulp
    assert float((y1 != y0).float().mean()) < 0.01 and ((y1.float() - y0.float()).abs() <= 2**-7 * y0.float().abs()).all()
    print("TRAIN-FUSED-INTERPRETER-OK")


def test_train_fused_kernels_under_triton_interpreter():
    run_under_triton_interpreter(__file__, "TRAIN-FUSED-INTERPRETER-OK",
                                 code="import test_train_fused as t; t._interpreter_main()", timeout=600)


def _policy(device="cpu", fused="1", train_norms=False):
    from qerl.lora import LoraSpec
    from qerl.model import load_policy

    old = os.environ.get("QERL_FUSED_TRAIN")
    os.environ["QERL_FUSED_TRAIN"] = fused
    try:
        return load_policy("preset:tiny", "bf16", LoraSpec(rank=4, alpha=8), device=device, seed=3,
                           train_norms=train_norms)[0]
    finally:
        if old is None:
            os.environ.pop("QERL_FUSED_TRAIN")
        else:
            os.environ["QERL_FUSED_TRAIN"] = old


def test_install_keeps_parameters_and_aqn_targets():
    """Every norm becomes a FusedRMSNorm over the same weight Parameter, every SiLU MLP uses silu_mul; AQN finds
    the same norms; QERL_FUSED_TRAIN=0 leaves the HF modules; on the CPU the policy computes what HF's does."""
    from qerl.aqn import find_noise_targets

    p = _policy()
    q = _policy(fused="0")
    cfg = p.config
    assert p.qerl["fused_train"] == {"rms_norm": 2 * cfg.num_hidden_layers + 1, "silu_mul": cfg.num_hidden_layers,
                                     "rope": cfg.num_hidden_layers}
    assert q.qerl["fused_train"] == {"rms_norm": 0, "silu_mul": 0, "rope": 0}

    hf = sys.modules[type(p.model.layers[0].self_attn).__module__]
    orig = hf.apply_rotary_pos_emb.qerl_fused  # patched once per process, the original kept
    x = torch.randn(2, 3, 5, 16).bfloat16()
    cos, sin = torch.randn(2, 5, 16).bfloat16(), torch.randn(2, 5, 16).bfloat16()
    assert torch.equal(tf.rope_ref(x, cos, sin), orig(x, x, cos, sin)[0])  # the reference is HF's, bit for bit
    assert torch.equal(hf.apply_rotary_pos_emb(x, x, cos, sin)[1], orig(x, x, cos, sin)[1])  # CPU: the original
    assert all(type(m).__name__ == "FusedRMSNorm" for n, m in p.named_modules() if n.endswith("layernorm"))
    assert all(type(m).__name__ != "FusedRMSNorm" for m in q.modules())
    assert [n for n, _ in find_noise_targets(p)] == [n for n, _ in find_noise_targets(q)]
    assert {n for n, _ in p.named_parameters()} == {n for n, _ in q.named_parameters()}
    q.load_state_dict(p.state_dict())
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    for m in (p, q):
        m.train()
        m(input_ids=ids).logits.float().square().mean().backward()
    lp, lq = p(input_ids=ids).logits, q(input_ids=ids).logits
    assert torch.equal(lp, lq)
    gp = {n: t.grad for n, t in p.named_parameters() if t.requires_grad}
    gq = {n: t.grad for n, t in q.named_parameters() if t.requires_grad}
    assert gp.keys() == gq.keys() and gp
    for n in gp:
        torch.testing.assert_close(gp[n], gq[n], rtol=0, atol=0)


def test_trained_norms_use_the_fused_function():
    """train_norms: MasterRMSNorm (fp32 masters, not replaced) takes its weight gradient through rms_norm."""
    p = _policy(train_norms=True)
    norms = [m for n, m in p.named_modules() if n.endswith("layernorm")]
    assert norms and all(type(m).__name__ == "MasterRMSNorm" for m in norms)
    ids = torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(1))
    p.train()
    p(input_ids=ids).logits.float().mean().backward()
    assert all(m.weight.grad is not None and m.weight.grad.dtype == torch.float32 for m in norms)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_train_fused_bf16_matches_hf_ops():
    """bf16 on the GPU: RMSNorm within two bf16 roundings of the HF ops (mean(x²) summed in another order), SiLU·up
    within a rare ulp (exp), RoPE bit for bit forward and backward; gradients close; and a 7B-width policy's loss and
    LoRA gradients with and without the fused kernels."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))

    for m, d in ((4096, 3584), (33, 5120)):
        x = (2 * torch.randn(m, d, device="cuda", generator=g)).bfloat16()
        w = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16()
        gy = torch.randn(m, d, device="cuda", generator=g).bfloat16()
        y0, (dx0, dw0) = _ref_grads(lambda a, b: tf.rms_norm_ref(a, b, 1e-6), (x, w), gy)
        y1, (dx1, dw1) = _ref_grads(lambda a, b: tf.rms_norm(a, b, 1e-6), (x, w), gy)
        ulp = (y1.float() - y0.float()).abs() / y0.float().abs().clamp(min=1e-30)
        assert float(ulp.max()) <= 2**-6, ("rms forward", m, d, float(ulp.max()))  # two bf16 roundings
        assert float((y1 != y0).float().mean()) < 0.01, ("rms forward mismatches", float((y1 != y0).float().mean()))
        assert rel(dx1, dx0) < 1e-2, ("rms dx", m, d, rel(dx1, dx0))
        assert rel(dw1, dw0) < 1e-2, ("rms dw", m, d, rel(dw1, dw0))
        a = (3 * torch.randn(m, 4 * d, device="cuda", generator=g)).bfloat16()
        b = torch.randn(m, 4 * d, device="cuda", generator=g).bfloat16()
        gy = torch.randn(m, 4 * d, device="cuda", generator=g).bfloat16()
        y0, (da0, db0) = _ref_grads(tf.silu_mul_ref, (a, b), gy)
        y1, (da1, db1) = _ref_grads(tf.silu_mul, (a, b), gy)
        assert float((y1 != y0).float().mean()) < 0.01, ("silu forward mismatches", float((y1 != y0).float().mean()))
        assert rel(y1, y0) < 1e-2 and rel(da1, da0) < 1e-2 and rel(db1, db0) < 1e-2, \
            ("silu", rel(y1, y0), rel(da1, da0), rel(db1, db0))
    for B, H, L, D in ((4, 28, 300, 128), (2, 4, 33, 128)):
        q = torch.randn(B, L, H, D, device="cuda", generator=g).bfloat16().transpose(1, 2)
        cos = torch.randn(B, L, D, device="cuda", generator=g).bfloat16()
        sin = torch.randn(B, L, D, device="cuda", generator=g).bfloat16()
        gy = torch.randn(B, H, L, D, device="cuda", generator=g).bfloat16()
        y0, (dq0,) = _ref_grads(lambda a, c=cos, s=sin: tf.rope_ref(a, c, s), (q,), gy)
        y1, (dq1,) = _ref_grads(lambda a, c=cos, s=sin: tf.rope(a, c, s), (q,), gy)
        assert torch.equal(y1, y0), ("rope forward", float((y1.float() - y0.float()).abs().max()))
        assert torch.equal(dq1, dq0), ("rope dq", rel(dq1, dq0))
    p, q = _policy("cuda"), _policy("cuda", fused="0")
    q.load_state_dict(p.state_dict())
    ids = torch.randint(0, 500, (4, 64), device="cuda", generator=g)
    losses = []
    for m in (p, q):
        m.train()
        loss = m(input_ids=ids).logits.float().log_softmax(-1).mean()
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-3 * abs(losses[1]), losses
    ga = torch.cat([t.grad.flatten() for t in p.parameters() if t.requires_grad])
    gb = torch.cat([t.grad.flatten() for t in q.parameters() if t.requires_grad])
    assert rel(ga, gb) < 0.05, ("policy gradients", rel(ga, gb))
