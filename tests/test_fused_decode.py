"""The fused decode step: its kernels (``qerl.kernels.fused``) against independent references and under the
Triton interpreter, the fused projection storage (``qerl.fastdecode``), and the sampler with ``fused=True``
against teacher forcing. ``-m gpu``: the Triton kernels on CUDA in bf16."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import assert_teacher_forced, perturb_lora_b, run_under_triton_interpreter

from qerl import kernels
from qerl.fastdecode import FusedLinear, build_decode_plan, concat_rows, fuse_projection_storage
from qerl.kernels import fused as fk
from qerl.kernels.cuda_fp4 import permute_x_reference
from qerl.lora import LoraSpec, lora_inference_cache, swap_linears
from qerl.model import load_policy
from qerl.quant import FORMATS
from qerl.rollout import Sampler
from qerl.train import completion_logprobs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
BF = torch.bfloat16


def _naive_attention(q, kc, vc, bias, S, scale):
    """float64 loop over heads: softmax(q·k·scale + bias)·v with GQA head h -> kv head h // (H/Hkv)."""
    m, H, d = q.shape
    g = H // kc.shape[1]
    out = torch.zeros(m, H, d, dtype=torch.float64)
    for r in range(m):
        for h in range(H):
            k, v = kc[r, h // g, :S].double(), vc[r, h // g, :S].double()
            p = torch.softmax(k @ q[r, h].double() * scale + bias[r, :S].double(), 0)
            out[r, h] = p @ v
    return out.reshape(m, H * d)


# ------------------------------------------------------------------------------------------ references (CPU)

def test_cuda_attention_dispatch_rules(monkeypatch):
    """Where fused.decode_attention takes the CUDA split kernel: bf16, head dims 64/128, <= 16 query heads per KV head,
    contiguous caches and an fp32 bias, on a CUDA device; QERL_ATTN=triton never, =cuda or an error naming why, a bad
    value an error naming the valid ones."""
    from qerl.kernels import cuda_attn
    z = lambda *s, dt=BF: torch.zeros(*s, dtype=dt)  # noqa: E731
    kc = z(2, 4, 32, 128)
    assert cuda_attn.shape_ok(z(2, 28, 128), kc, kc, z(2, 32, dt=torch.float32))
    assert cuda_attn.shape_ok(z(2, 14, 64), z(2, 2, 32, 64), z(2, 2, 32, 64), z(2, 32, dt=torch.float32))
    assert not cuda_attn.shape_ok(z(2, 4, 16), z(2, 2, 32, 16), z(2, 2, 32, 16), z(2, 32, dt=torch.float32))  # d
    assert not cuda_attn.shape_ok(z(2, 68, 128), kc, kc, z(2, 32, dt=torch.float32))  # 17 heads per KV head
    assert not cuda_attn.shape_ok(z(2, 28, 128), kc, kc, z(2, 32, dt=BF))             # bf16 bias
    assert not cuda_attn.shape_ok(z(2, 28, 128).float(), kc.float(), kc.float(), z(2, 32, dt=torch.float32))
    assert not cuda_attn.shape_ok(z(2, 28, 128), kc, z(2, 32, 4, 128).transpose(1, 2), z(2, 32, dt=torch.float32))
    args = (z(2, 28, 128), kc, kc, z(2, 32, dt=torch.float32))
    monkeypatch.setenv("QERL_ATTN", "auto")
    assert not cuda_attn.usable(*args)  # CPU tensors
    monkeypatch.setenv("QERL_ATTN", "triton")
    assert not cuda_attn.usable(*args)
    monkeypatch.setenv("QERL_ATTN", "cuda")
    with pytest.raises(RuntimeError, match="QERL_ATTN=cuda"):
        cuda_attn.usable(*args)
    monkeypatch.setenv("QERL_ATTN", "fast")
    with pytest.raises(ValueError, match="'fast'.*auto, cuda, triton"):
        cuda_attn.usable(*args)
    monkeypatch.setattr(cuda_attn, "MODE", "triton")  # the benchmark's override wins over the environment
    assert cuda_attn.attn_mode() == "triton"
    with pytest.raises(ValueError, match="nst=5"):
        cuda_attn.attend(*args, 32, 0.1, None, False, nst=5)
    # the CPU path (no Triton on CPU tensors) is the reference, slot or not
    q, kv = torch.randn(2, 28, 128).to(BF), torch.randn(2, 4, 32, 128).to(BF)
    monkeypatch.setattr(cuda_attn, "MODE", None)
    monkeypatch.setenv("QERL_ATTN", "auto")
    bias = torch.zeros(2, 32)
    assert torch.equal(fk.decode_attention(q, kv, kv, bias, 20, 0.1, torch.tensor([19])),
                       fk.decode_attention_ref(q, kv, kv, bias, 20, 0.1))


def test_attn_bench_rejects_bad_arguments():
    from benchmarks import attn_bench
    for argv, msg in ((["--kernels", "cudnn"], "--kernels"), (["--cuda-configs", "5"], "--cuda-configs"),
                      (["--cuda-configs", "2:64"], "--cuda-configs"), (["--kv", "0"], "--kv")):
        with pytest.raises(SystemExit, match=msg):
            attn_bench.main(argv)


def test_add_rms_norm_ref_matches_hf_qwen2_rmsnorm():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = Qwen2RMSNorm(96, eps=1e-6).to(BF)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    h, d = torch.randn(4, 96, generator=g).to(BF), torch.randn(4, 96, generator=g).to(BF)
    h2, x = fk.add_rms_norm_ref(h.clone(), d, norm.weight, 1e-6)
    assert torch.equal(h2, h + d) and torch.equal(x, norm(h + d))


def test_rope_ref_matches_hf_rotate_half():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    m, H, hkv, d = 3, 4, 2, 16
    qkv = torch.randn(m, (H + 2 * hkv) * d, generator=g, dtype=torch.float64)
    ang = torch.rand(m, d // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    ssin = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)
    kc, vc = torch.zeros(m, hkv, 7, d, dtype=torch.float64), torch.zeros(m, hkv, 7, d, dtype=torch.float64)
    q = fk.rope_qkv_ref(qkv, None, cos, ssin, H, hkv, d, kc, vc, torch.tensor([5]))
    qh, kh, vh = qkv.split((H * d, hkv * d, hkv * d), -1)
    q_ref, k_ref = apply_rotary_pos_emb(qh.view(m, 1, H, d).transpose(1, 2), kh.view(m, 1, hkv, d).transpose(1, 2),
                                        cos[:, None], sin[:, None])
    torch.testing.assert_close(q, q_ref[:, :, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(kc[:, :, 5], k_ref[:, :, 0], rtol=0, atol=1e-12)
    assert torch.equal(vc[:, :, 5], vh.view(m, hkv, d)) and not kc[:, :, :5].any() and not vc[:, :, 6].any()


def test_attention_and_silu_refs_match_naive():
    g = torch.Generator().manual_seed(2)
    m, H, hkv, d, smax = 2, 6, 2, 8, 40
    q = torch.randn(m, H, d, generator=g)
    kc, vc = torch.randn(m, hkv, smax, d, generator=g), torch.randn(m, hkv, smax, d, generator=g)
    bias = torch.zeros(m, smax)
    bias[0, 3:9] = -math.inf
    out = fk.decode_attention_ref(q, kc, vc, bias, 30, 0.3)
    torch.testing.assert_close(out.double(), _naive_attention(q, kc, vc, bias, 30, 0.3), rtol=1e-5, atol=1e-6)
    gu = torch.randn(3, 20, generator=g)
    torch.testing.assert_close(fk.silu_mul_ref(gu), gu[:, :10] * torch.sigmoid(gu[:, :10]) * gu[:, 10:])


def test_permuted_twin_tags_and_reference_paths():
    """The tag the decode step's producers leave for the wgmma GEMM: on the reference paths (CPU) add_rms_norm and
    silu_mul with permuted=True tag their output with the permuted copy (cuda_fp4.permute_x_reference's values, the
    kernel's K permutation: inside each 64-chunk k = 16 i + 2 u + e lands at 8 u + 2 i + e), none for K not a multiple
    of 64; a view, an in-place change or another tensor does not carry it; on the CPU no linear asks for it."""
    from qerl.fastdecode import permuted_input
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(3, 128, generator=g), torch.randn(128, generator=g)
    _, x = fk.add_rms_norm(h.clone(), None, w, 1e-6, permuted=True)
    xp = kernels.permuted_twin(x)
    assert torch.equal(x, fk.add_rms_norm_ref(h.clone(), None, w, 1e-6)[1])
    k = torch.arange(128)
    r = k % 64
    dest = k - r + (r // 2 % 8) * 8 + (r // 16) * 2 + r % 2  # the kernels' K permutation, spelled out
    assert sorted(dest.tolist()) == k.tolist()
    assert torch.equal(xp[:, dest], x)
    assert kernels.permuted_twin(x.view(3, 128)) is None and kernels.permuted_twin(x.clone()) is None
    x.add_(1)  # an in-place change voids the tag
    assert kernels.permuted_twin(x) is None
    assert kernels.permuted_twin(fk.add_rms_norm(h[:, :96].clone(), None, w[:96], 1e-6, permuted=True)[1]) is None
    gu = torch.randn(2, 256, generator=g)
    out = fk.silu_mul(gu, permuted=True)
    assert torch.equal(out, fk.silu_mul_ref(gu)) and torch.equal(kernels.permuted_twin(out)[:, dest], out)
    policy, _ = load_policy("preset:tiny-d64", "nvfp4", LoraSpec(rank=8), device="cpu")
    plan = build_decode_plan(policy)
    with lora_inference_cache(policy, torch.float32):
        for e in plan:
            e["qkv"].refresh(torch.float32)
            assert not permuted_input(e["qkv"], 64, torch.float32)
        assert not permuted_input(policy.model.layers[0].mlp.down_proj, 64, torch.float32)


def test_attention_splits_cover_the_keys():
    for rows, S in ((32, 1), (32, 300), (2, 2304), (512, 4096), (8, 64)):
        n, chunk = fk.attention_splits(rows, S)
        assert chunk % 64 == 0 and (n - 1) * chunk < S <= n * chunk, (rows, S, n, chunk)
        assert rows * n >= min(264, rows * -(-S // 64)) or n == -(-S // chunk)


# ------------------------------------------------------------------------------------------ Triton interpreter

def _interpreter_main() -> None:
    """Subprocess with TRITON_INTERPRET=1: every fused kernel vs its reference on CPU tensors (float32, where
    the interpreter's arithmetic is exact to rounding; it truncates bf16 conversions, so bf16 is checked on
    the GPU)."""
    from test_kernels import _interp_shim

    _interp_shim()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    f32 = torch.float32
    for D in (96, 64):
        h, d, w = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g), 1 + torch.randn(D, generator=g)
        wide = torch.randn(5, D + 7, generator=g)  # a row-strided delta, as a BF16 product's [W; A] view gives
        for delta in (d, None, wide[:, :D]):
            h1, x1 = fk.add_rms_norm_ref(h.clone(), delta, w, 1e-6)
            h2, x2 = fk.add_rms_norm(h.clone(), delta, w, 1e-6)
            assert torch.equal(h1, h2)
            torch.testing.assert_close(x2, x1, rtol=1e-6, atol=1e-6)
            # the same launch writing the wgmma GEMM's permuted copy too (D a multiple of 64; none otherwise), with
            # either store (QERL_PERMUTE_STORE)
            for store in fk.PERMUTE_STORES:
                os.environ["QERL_PERMUTE_STORE"] = store
                h3, x3 = fk.add_rms_norm(h.clone(), delta, w, 1e-6, permuted=True)
                assert torch.equal(h3, h2) and torch.equal(x3, x2)
                twin = kernels.permuted_twin(x3)
                assert (twin is None) == (D % 64 != 0)
                if twin is not None:
                    assert torch.equal(twin, permute_x_reference(x3)) and not torch.equal(twin, x3), store
    H, hkv, d, m = 4, 2, 16, 3
    qkv, b = torch.randn(m, (H + 2 * hkv) * d, generator=g), torch.randn((H + 2 * hkv) * d, generator=g)
    cos, ssin = torch.randn(m, d, generator=g), torch.randn(m, d, generator=g)
    wide = torch.randn(m, (H + 2 * hkv) * d + 5, generator=g)[:, :(H + 2 * hkv) * d]  # rows further apart
    for bias, x in ((b, qkv), (None, qkv), (b, wide)):
        caches = [torch.full((m, hkv, 9, d), 7.0, dtype=f32) for _ in range(4)]
        q1 = fk.rope_qkv_ref(x, bias, cos, ssin, H, hkv, d, caches[0], caches[1], torch.tensor([6]))
        q2 = fk.rope_qkv(x, bias, cos, ssin, H, hkv, d, caches[2], caches[3], torch.tensor([6]))
        torch.testing.assert_close(q2, q1, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(caches[2], caches[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(caches[3], caches[1])
    m, H, hkv, d, smax = 3, 6, 2, 32, 300
    q = torch.randn(m, H, d, generator=g)
    kc, vc = torch.randn(m, hkv, smax, d, generator=g), torch.randn(m, hkv, smax, d, generator=g)
    bias = torch.zeros(m, smax)
    bias[0, 1:50] = -math.inf    # a whole leading split masked for row 0 (left padding)
    bias[1, 100:] = -math.inf
    bias[2, 130:200] = -math.inf
    for S in (1, 70, 257, 300):
        ref = _naive_attention(q, kc, vc, bias, S, 0.17)
        torch.testing.assert_close(fk.decode_attention(q, kc, vc, bias, S, 0.17).double(), ref, rtol=1e-5, atol=1e-5)
    # bias + RoPE + cache write inside the split kernel: the same q, cache and output as the two launches, at every
    # split of the new token's slot (first, middle, last key; one split and several), G = 1 and 3, with a bias or not
    for m, H, hkv, d, smax in ((3, 6, 2, 32, 300), (2, 4, 4, 16, 70)):
        qkv = torch.randn(m, (H + 2 * hkv) * d + 3, generator=g)[:, :(H + 2 * hkv) * d]  # rows further apart
        b = torch.randn((H + 2 * hkv) * d, generator=g)
        cos, ssin = torch.randn(m, d, generator=g), torch.randn(m, d, generator=g)
        bias = torch.zeros(m, smax)
        bias[0, 1:20] = -math.inf  # left padding, not the slot
        for S, sl, qb in ((1, 0, b), (70, 69, None), (257, 129, b), (smax, smax - 1, b), (130, 64, None)):
            if S > smax:
                continue
            kv = [torch.randn(m, hkv, smax, d, generator=g) for _ in range(2)]
            c1, c2 = [t.clone() for t in kv], [t.clone() for t in kv]
            slot = torch.tensor([sl])
            os.environ["QERL_FUSED_ROPE_ATTN"] = "0"
            o1 = fk.rope_attention(qkv, qb, cos, ssin, H, hkv, d, c1[0], c1[1], bias, S, 0.17, slot)
            os.environ["QERL_FUSED_ROPE_ATTN"] = "1"
            o2 = fk.rope_attention(qkv, qb, cos, ssin, H, hkv, d, c2[0], c2[1], bias, S, 0.17, slot)
            assert torch.equal(c1[1], c2[1]) and not torch.equal(c2[1], kv[1]), (S, sl)
            torch.testing.assert_close(c2[0], c1[0], rtol=1e-6, atol=1e-6)
            q = fk.rope_qkv_ref(qkv, qb, cos, ssin, H, hkv, d, kv[0].clone(), kv[1].clone(), slot)
            ref = _naive_attention(q, c1[0], c1[1], bias, S, 0.17)
            torch.testing.assert_close(o2.double(), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(o2, o1, rtol=1e-6, atol=1e-6)
    os.environ.pop("QERL_FUSED_ROPE_ATTN")
    gu = torch.randn(4, 2 * 1500, generator=g)
    torch.testing.assert_close(fk.silu_mul(gu), fk.silu_mul_ref(gu), rtol=1e-6, atol=1e-6)
    gu = torch.randn(4, 2 * 1500 + 96, generator=g)[:, :3000]  # rows 3096 apart
    torch.testing.assert_close(fk.silu_mul(gu), fk.silu_mul_ref(gu), rtol=1e-6, atol=1e-6)
    gu = torch.randn(3, 2 * 1088 + 32, generator=g)[:, :2176]  # I = 1088: a second, partial block of 1024
    for store in fk.PERMUTE_STORES:
        os.environ["QERL_PERMUTE_STORE"] = store
        out = fk.silu_mul(gu, permuted=True)
        assert torch.equal(out, fk.silu_mul(gu))
        assert torch.equal(kernels.permuted_twin(out), permute_x_reference(out)), store
    os.environ.pop("QERL_PERMUTE_STORE")
    os.environ["QERL_LORA_A_MAX_M"] = "256"  # the 32- and 64-row tiles too, and several tiles of 64 rows (the default)
    for m, r, k in ((3, 32, 700), (8, 96, 2048), (16, 40, 1000), (1, 16, 128), (17, 96, 700), (32, 32, 1000),
                    (40, 64, 2048), (64, 16, 128), (100, 48, 700), (256, 32, 1000)):  # split-K, ragged R, K and M
        assert fk.lora_a_splits(r, k)[0] > 1 or k <= 128
        x, a = torch.randn(m, k, generator=g), torch.randn(r, k, generator=g)
        for _ in range(2):  # twice: the split-K counters must be back at zero
            torch.testing.assert_close(fk.lora_a(x, a), x @ a.t(), rtol=1e-5, atol=1e-4)
    del os.environ["QERL_LORA_A_MAX_M"]
    for n, v in ((3, 5000), (2, 4096), (1, 9000)):  # 2, 1 and 3 chunks of SAMPLE_BLOCK
        z = 3 * torch.randn(n, v, generator=g)
        z[0, :100] = -math.inf  # masked vocabulary entries (as a top-k filter leaves them)
        e = torch.empty(n, v).exponential_(generator=g)
        for temp in (1.0, 0.7):
            t1, l1, h1 = fk.sample_race_ref(z, temp, e)
            t2, l2, h2 = fk.sample_race(z, temp, e)
            assert torch.equal(t1, t2), (t1, t2)
            torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
            lp = (z / temp).log_softmax(-1)  # the reference's entropy is NaN where z = -inf (0 · -inf): skip those
            h1 = -torch.where(lp.isfinite(), lp.exp() * lp, torch.zeros(())).sum(-1)
            torch.testing.assert_close(h2, h1, rtol=1e-5, atol=1e-5)
            # bf16 logits (the lm_head's output) are read as float32 by the kernels: the same draw as their copy
            zb = z.to(BF)
            for a, b in zip(fk.sample_race(zb, temp, e), fk.sample_race(zb.float(), temp, e), strict=True):
                assert torch.equal(a, b)
    # the decode step's opening (slot, embedding, position-table rows) and close (bookkeeping), bit for bit
    for n, D in ((5, 700), (3, 2100)):  # one partial block of the embedding row; two blocks (2048 + 52)
        V, hd, smax = 300, 16, 40
        emb = torch.randn(V, D, generator=g).to(BF)
        ctab, stab = (torch.randn(smax, hd, generator=g).to(BF) for _ in range(2))
        tok, plen = torch.randint(0, V, (n,), generator=g), torch.randint(1, 9, (n,), generator=g)
        t, lp = torch.tensor([4]), torch.tensor([9])
        b1, b2 = torch.full((n, smax), -math.inf), torch.full((n, smax), -math.inf)
        r1 = fk.step_begin_ref(tok, t, lp, plen, emb, ctab, stab, b1)
        r2 = fk.step_begin(tok, t, lp, plen, emb, ctab, stab, b2)
        for a, b in zip(r1, r2, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
        assert torch.equal(b1, b2) and int(r2[3]) == 12 and (b2[:, 12] == 0).all() and int((b2 == 0).sum()) == n
        assert torch.equal(r2[0], emb[tok]) and torch.equal(r2[1], ctab[plen + 3])
    for n, eos, fin in ((6, torch.tensor([3, 7]), torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool)),
                        (6, torch.tensor([-1]), torch.zeros(6, dtype=torch.bool)),  # ignore_eos
                        (20, torch.tensor([2, 5, 11]), torch.rand(20, generator=g) < 0.3)):
        tok = torch.tensor([5, 3, 9, 3, 0, 7]) if n == 6 else torch.randint(0, 12, (n,), generator=g)
        lp, ent, T = torch.randn(n, generator=g), torch.rand(n, generator=g), 7
        st = [[fin.clone(), torch.tensor([2]), torch.zeros(n, dtype=torch.long), torch.full((n, T), -5),
               torch.zeros(n, T, dtype=torch.bool), torch.full((n, T), 9.0), torch.full((n, T), 9.0)] for _ in range(2)]
        for f, (fi, tt, *outs) in zip((fk.sample_finish_ref, fk.sample_finish), st, strict=True):
            f(tok, lp, ent, fi, eos, 1, tt, *outs)
        for a, b in zip(*st, strict=True):
            assert torch.equal(a, b), (a, b)
        fi, tt, stok, otok, omask, olp, _ = st[1]
        alive = ~fin
        assert int(tt) == 3 and torch.equal(stok, torch.where(alive, tok, 1)) and torch.equal(otok[:, 2], stok)
        assert torch.equal(omask[:, 2], alive) and torch.equal(olp[:, 2], torch.where(alive, lp, 0.0))
        assert (otok[:, 3:] == -5).all() and not omask[:, 3:].any()
        assert torch.equal(fi, fin | torch.isin(stok, eos))
        if n == 6 and eos[0] == 3:
            assert fi.tolist() == [False, True, False, True, True, True]
    print("FUSED-INTERPRETER-OK")


def test_fused_kernels_under_triton_interpreter():
    run_under_triton_interpreter(__file__, "FUSED-INTERPRETER-OK")


def test_fused_kernels_compile_for_sm90():
    """Ahead-of-time compile (no GPU) for Hopper: catches what the interpreter accepts and the compiler
    does not (non-constexpr globals, layout errors), with the 7B decode shapes."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(fn, sig, const, warps=4, attrs=None):  # attrs: e.g. the divisibility the JIT specializes on
        sig = dict(sig, **{c: "constexpr" for c in const})
        ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert ck.asm["cubin"]
        return ck

    bf, f32 = "*bf16", "*fp32"
    for wdt in (bf, f32):
        for perm, vec in ((False, False), (True, False), (True, True)):  # the permuted copy too, both stores
            build(fk._add_rms_norm_kernel, dict(h_ptr=bf, d_ptr=bf, w_ptr=wdt, x_ptr=bf, xp_ptr=bf, D="i32",
                                                    stride_d="i32", eps="fp32"),
                  dict(HAS_DELTA=True, BLOCK=4096, PERM=perm, VEC=vec))
    build(fk._rope_qkv_kernel, dict(qkv_ptr=bf, b_ptr=bf, cos_ptr=bf, sin_ptr=bf, q_ptr=bf, kc_ptr=bf, vc_ptr=bf,
                                    slot_ptr="*i64", S_MAX="i32", stride_qkv="i32"), dict(H=28, HKV=4, D=128, HAS_BIAS=True), 1)
    build(fk._attn_split_kernel, dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, b_ptr=f32, m_ptr=f32, l_ptr=f32, acc_ptr=f32,
                                      S="i32", S_MAX="i32", CHUNK="i32", NSPLIT="i32", scale="fp32"),
          dict(HKV=4, G=7, GP=16, D=128, BS=64, DOT_F32=False))
    build(fk._attn_combine_kernel, dict(m_ptr=f32, l_ptr=f32, acc_ptr=f32, o_ptr=bf, NSPLIT="i32"), dict(D=128, SP=16))
    for pdl in (False, True):  # bias + RoPE + cache write in the split kernel (7B: G = 7; 32B: G = 5, no bias)
        for hkv, g, has_bias in ((4, 7, True), (8, 5, False)):
            build(fk._rope_attn_split_kernel, dict(qkv_ptr=bf, qb_ptr=bf, cos_ptr=bf, sin_ptr=bf, k_ptr=bf, v_ptr=bf,
                                                   slot_ptr="*i64", b_ptr=f32, m_ptr=f32, l_ptr=f32, acc_ptr=f32,
                                                   S="i32", S_MAX="i32", CHUNK="i32", NSPLIT="i32", scale="fp32",
                                                   stride_qkv="i32"),
                  dict(H=hkv * g, HKV=hkv, G=g, GP=16, D=128, BS=64, HAS_BIAS=has_bias, DOT_F32=False, PDL=pdl))
    for perm, vec in ((False, False), (True, False), (True, True)):
        # with the sizes divisible by 16 (as every Qwen shape is, so the JIT specializes on it): the output in 16-byte
        # stores; the permuted copy element by element, or (vec) permuted in registers and in 16-byte stores too
        ck = build(fk._silu_mul_kernel, dict(gu_ptr=bf, o_ptr=bf, op_ptr=bf, NI="i32", stride_gu="i32"),
                   dict(BLOCK=1024, PERM=perm, VEC=vec), attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
        ptx = ck.asm["ptx"]
        assert "st.global.v4.b32" in ptx and ("st.global.b16" in ptx) == (perm and not vec), (perm, vec)
    for zt in (f32, bf):  # float32 logits, and the lm_head's bf16 ones read as float32
        build(fk._sample_part_kernel, dict(z_ptr=zt, e_ptr=f32, ws_ptr=f32, idx_ptr="*i32", V="i32", temp="fp32",
                                           S="i32"), dict(BLOCK=fk.SAMPLE_BLOCK), 8)
        build(fk._sample_combine_kernel, dict(z_ptr=zt, ws_ptr=f32, idx_ptr="*i32", tok_ptr="*i64", lp_ptr=f32,
                                              ent_ptr=f32, V="i32", temp="fp32", S="i32"), dict(SB=64), 1)
    i64 = "*i64"
    build(fk._step_begin_kernel, dict(tok_ptr=i64, t_ptr=i64, lp_ptr=i64, plen_ptr=i64, emb_ptr=bf, cos_tab_ptr=bf,
                                      sin_tab_ptr=bf, bias_ptr=f32, h_ptr=bf, cos_ptr=bf, sin_ptr=bf, slot_ptr=i64,
                                      D="i32", S_MAX="i32", HD="i32"), dict(BLOCK=2048, HB=128))
    build(fk._sample_finish_kernel, dict(tok_ptr=i64, lp_ptr=f32, ent_ptr=f32, fin_ptr="*i1", eos_ptr=i64, t_ptr=i64,
                                         stok_ptr=i64, otok_ptr=i64, omask_ptr="*i1", olp_ptr=f32, oent_ptr=f32,
                                         N="i32", T="i32", E="i32", PAD="i32"), dict(NB=256, EB=4))
    # the programmatic-dependent-launch variants (griddepcontrol.wait / launch_dependents first)
    build(fk._add_rms_norm_kernel, dict(h_ptr=bf, d_ptr=bf, w_ptr=bf, x_ptr=bf, xp_ptr=bf, D="i32",
                                            stride_d="i32", eps="fp32"),
          dict(HAS_DELTA=True, BLOCK=4096, PDL=True, PERM=True))
    build(fk._rope_qkv_kernel, dict(qkv_ptr=bf, b_ptr=bf, cos_ptr=bf, sin_ptr=bf, q_ptr=bf, kc_ptr=bf, vc_ptr=bf,
                                    slot_ptr="*i64", S_MAX="i32", stride_qkv="i32"), dict(H=28, HKV=4, D=128, HAS_BIAS=False, PDL=True), 1)
    build(fk._attn_split_kernel, dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, b_ptr=f32, m_ptr=f32, l_ptr=f32, acc_ptr=f32,
                                      S="i32", S_MAX="i32", CHUNK="i32", NSPLIT="i32", scale="fp32"),
          dict(HKV=4, G=7, GP=16, D=128, BS=64, DOT_F32=False, PDL=True))
    build(fk._attn_combine_kernel, dict(m_ptr=f32, l_ptr=f32, acc_ptr=f32, o_ptr=bf, NSPLIT="i32"),
          dict(D=128, SP=16, PDL=True))
    build(fk._silu_mul_kernel, dict(gu_ptr=bf, o_ptr=bf, op_ptr=bf, NI="i32", stride_gu="i32"),
          dict(BLOCK=1024, PDL=True, PERM=True))
    for bm in (16, 32, 64):  # decode size; 17-32 and 33-64 tokens; the PDL trigger with 32; tiles of 64 rows (> 64)
        ck = build(fk._lora_a_kernel, dict(x_ptr=bf, a_ptr=bf, out_ptr=bf, ws_ptr=f32, cnt_ptr="*i32", M="i32",
                                           R="i32", K="i32", stride_xm="i32", PER="i32"),
                   dict(BM=bm, BR=16, BK=128, SPLIT=8, FENCE=True, DOT_F32=False, TRIGGER=bm >= 32,
                        MTILES=bm == 64, WAIT=bm == 64))
        ptx = ck.asm["ptx"]
        assert ("griddepcontrol.launch_dependents" in ptx) == (bm >= 32)
        assert ("griddepcontrol.wait" in ptx) == (bm == 64)  # launched under PDL itself (QERL_LORA_A_PDL)
        if bm == 64:  # the wait comes before the trigger: the GEMM launched after it reads x's producer's output
            assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


def test_permute_store_switch(monkeypatch):
    """QERL_PERMUTE_STORE: scatter by default, vector, anything else refused by name with the choices."""
    monkeypatch.delenv("QERL_PERMUTE_STORE", raising=False)
    assert fk.permute_store() == "scatter"
    monkeypatch.setenv("QERL_PERMUTE_STORE", "vector")
    assert fk.permute_store() == "vector"
    monkeypatch.setenv("QERL_PERMUTE_STORE", "v4")
    with pytest.raises(ValueError, match="QERL_PERMUTE_STORE='v4'; valid: scatter, vector"):
        fk.permute_store()


def test_lora_a_pdl_switch(monkeypatch):
    """QERL_LORA_A_PDL: on by default, "0" off, anything else refused by name with the choices."""
    monkeypatch.delenv("QERL_LORA_A_PDL", raising=False)
    assert fk.lora_a_pdl()
    monkeypatch.setenv("QERL_LORA_A_PDL", "0")
    assert not fk.lora_a_pdl()
    monkeypatch.setenv("QERL_LORA_A_PDL", "yes")
    with pytest.raises(ValueError, match="QERL_LORA_A_PDL='yes': choose 1 \\(on\\) or 0 \\(off\\)"):
        fk.lora_a_pdl()


def test_lora_a_max_m_switch(monkeypatch):
    """QERL_LORA_A_MAX_M: which M ``lora_a`` takes into its Triton kernel (256 by default, 16-128), F.linear
    above; a bad value is refused by name with the choices (it is read only where it decides: M > 16)."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    calls = []
    monkeypatch.setattr(fk, "F", SimpleNamespace(linear=lambda x, a: calls.append(x.shape[0]) or F.linear(x, a)))
    monkeypatch.setattr(fk, "_triton_ok", lambda x: False)  # no Triton here: every call falls back; count the M
    x, a = torch.randn(24, 64), torch.randn(8, 64)
    monkeypatch.delenv("QERL_LORA_A_MAX_M", raising=False)
    assert fk.lora_a_max_m() == 256
    for v, limit in (("16", 16), ("32", 32), ("64", 64), ("128", 128), ("256", 256)):
        monkeypatch.setenv("QERL_LORA_A_MAX_M", v)
        assert fk.lora_a_max_m() == limit
    monkeypatch.setenv("QERL_LORA_A_MAX_M", "48")
    with pytest.raises(ValueError, match="QERL_LORA_A_MAX_M='48': choose one of 16, 32, 64, 128, 256"):
        fk.lora_a(x, a)
    assert fk.lora_a(x[:8], a).shape == (8, 8) and calls == [8]  # M <= 16: the switch is not read
    monkeypatch.setattr(fk, "_triton_ok", lambda x: True)
    monkeypatch.setenv("QERL_LORA_A_MAX_M", "16")
    calls.clear()
    torch.testing.assert_close(fk.lora_a(x, a), x @ a.t())  # 24 > 16: F.linear
    assert calls == [24]


def test_rope_in_split_switch(monkeypatch):
    """QERL_FUSED_ROPE_ATTN: off by default (session 60 measured the fold slower on the H100), "1" on, anything else
    refused by name with the choices; the bench's two decode modes spell out each value."""
    from qerl import bench
    monkeypatch.delenv("QERL_FUSED_ROPE_ATTN", raising=False)
    assert fk.fused_rope_attention() is False
    monkeypatch.setenv("QERL_FUSED_ROPE_ATTN", "1")
    assert fk.fused_rope_attention() is True
    monkeypatch.setenv("QERL_FUSED_ROPE_ATTN", "on")
    with pytest.raises(ValueError, match="QERL_FUSED_ROPE_ATTN must be one of \\['0', '1'\\], got 'on'"):
        fk.fused_rope_attention()
    assert bench._DECODE_ENV["fused-rope-in-split"] == {"QERL_FUSED_ROPE_ATTN": "1"}
    assert bench._DECODE_ENV["fused-rope-split"] == {"QERL_FUSED_ROPE_ATTN": "0"}


def test_pdl_switch(monkeypatch):
    from qerl import kernels
    x = torch.zeros(2)
    for mode in ("1", "0", "auto"):
        monkeypatch.setenv("QERL_PDL", mode)
        assert kernels.pdl_enabled(x) is False  # never off CUDA
        assert fk._pdl(x) == {}
    monkeypatch.setenv("QERL_PDL", "yes")
    with pytest.raises(ValueError, match="QERL_PDL='yes': choose 1 \\(on\\), 0 \\(off\\) or auto"):
        kernels.pdl_enabled(x)


@pytest.mark.gpu
def test_gpu_sample_race_matches_reference():
    """The two-launch token draw against the torch race on the vocabulary sizes of Qwen2.5 (152064) and others:
    the same tokens from the same noise, log-probs and entropies to float32 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, v, temp in ((8, 152064, 1.0), (16, 32000, 0.7), (1, 151936, 1.3), (64, 152064, 1.0)):
        z = 4 * torch.randn(n, v, generator=g, device="cuda")
        e = torch.empty_like(z).exponential_(generator=g)
        t1, l1, h1 = fk.sample_race_ref(z, temp, e)
        t2, l2, h2 = fk.sample_race(z, temp, e)
        assert torch.equal(t1, t2)
        torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h2, h1, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------ fused storage

@pytest.mark.parametrize("fmt", [f for f in FORMATS if FORMATS[f].fusable and 64 % (FORMATS[f].block or 1) == 0])
def test_load_policy_fuses_storage_and_fused_linear_equals_members(fmt):
    torch.manual_seed(0)
    policy, _ = load_policy("preset:tiny", fmt, LoraSpec(rank=4), device="cpu")
    perturb_lora_b(policy)
    a = policy.model.layers[1].self_attn
    mods = [a.q_proj, a.k_proj, a.v_proj]
    for name in mods[0]._qnames:
        whole = concat_rows([getattr(m, name) for m in mods])
        if getattr(mods[0], name).shape[0] == mods[0].out_features:  # stacked by rows, one storage
            assert whole is not None and whole.shape[0] == sum(m.out_features for m in mods)
            part = whole[mods[0].out_features:][:mods[1].out_features]
            assert torch.equal(part.view(torch.uint8), getattr(mods[1], name).view(torch.uint8))
    plan = build_decode_plan(policy)
    assert plan is not None and all(e["qkv"].concatenated and e["gate_up"].concatenated for e in plan)
    x = torch.randn(5, mods[0].in_features)
    with torch.no_grad(), lora_inference_cache(policy, torch.float32):
        for key in ("qkv", "gate_up"):
            f = plan[1][key]
            f.refresh(torch.float32)
            y = f(x)
            if f.pending_bias is not None:
                y = y + f.pending_bias
            ref = torch.cat([m(x) for m in f.mods], -1)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
            assert (f.Bt != 0).sum() == sum((m.lora_B.weight != 0).sum() for m in f.mods)  # block diagonal
        # gate|up's SwiGLU: on the CPU (no one-launch path) the group's output, then silu_mul
        gu = plan[1]["gate_up"]
        torch.testing.assert_close(gu.silu_mul(x), fk.silu_mul(gu(x)), rtol=0, atol=0)
    # replacing a member's buffer makes the plan stale and the group no longer concatenable
    mods[1]._buffers[mods[1]._qnames[0]] = getattr(mods[1], mods[1]._qnames[0]).clone()
    assert plan[1]["qkv"].stale() and not FusedLinear(mods, defer_bias=True).concatenated


def test_unfusable_groups_fall_back_to_member_calls():
    torch.manual_seed(0)
    policy, _ = load_policy("preset:tiny", "nf4", LoraSpec(rank=4), device="cpu")  # per-tensor bnb states
    perturb_lora_b(policy)
    plan = build_decode_plan(policy)
    f = plan[0]["qkv"]
    assert not f.concatenated and f.pending_bias is None
    x = torch.randn(3, f.mods[0].in_features)
    with torch.no_grad(), lora_inference_cache(policy, torch.float32):
        f.refresh(torch.float32)
        torch.testing.assert_close(f(x), torch.cat([m(x) for m in f.mods], -1))
    # NVFP4 quantized per linear (swap_linears): different global scales, so no shared storage
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    m = swap_linears(Qwen2ForCausalLM(cfg), "nvfp4", LoraSpec(rank=2))
    assert fuse_projection_storage(m) == 0 or torch.equal(m.model.layers[0].self_attn.q_proj.weight_global_scale,
                                                          m.model.layers[0].self_attn.k_proj.weight_global_scale)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if 64 % (FORMATS[f].block or 1) == 0])
def test_fused_sampler_matches_teacher_forcing(fmt):
    torch.manual_seed(1)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=4), train_norms=True, device="cpu")
    perturb_lora_b(policy)
    s = Sampler(policy, tok, 64, fused=True)
    ro = s.generate(["how many apples are there", "3 + 4", "a"], 3, max_new_tokens=12, temperature=0.9, seed=3)
    assert ro.stats["fused_decode"] and ro.completion_mask.any()
    assert_teacher_forced(policy, ro, 0.9)
    # after an update (new LoRA B, new norm weights), the same sampler (plan and buffers reused) follows it
    perturb_lora_b(policy)
    with torch.no_grad():
        policy.model.layers[0].post_attention_layernorm.weight.mul_(1.5)
    ro2 = s.generate(["how many apples are there", "3 + 4", "a"], 3, max_new_tokens=12, temperature=0.9, seed=3)
    assert_teacher_forced(policy, ro2, 0.9, entropy=False)
    assert not torch.equal(ro2.logp, ro.logp)
    # a hooked norm (AQN per_forward) turns the fused step off
    hook = policy.model.layers[0].input_layernorm.register_forward_pre_hook(lambda mod, args: None)
    try:
        assert not s.generate(["a"], 2, max_new_tokens=3, seed=0).stats["fused_decode"]
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="fused must be one of"):
        Sampler(policy, tok, 64, fused="yes")


def test_fused_step_ends_match_the_torch_ops(monkeypatch):
    """The fused step reads each row's cos / sin from a table of every position made once per shape: the same
    values as HF's rotary embedding computed per step; a whole rollout is bit-identical with QERL_FUSED_STEP_ENDS
    0 / 1; a warm-up (``precapture``: one prefill of the shape) changes nothing of the rollout after it."""
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", "nvfp4", LoraSpec(rank=4), device="cpu")
    perturb_lora_b(policy)
    s = Sampler(policy, tok, 64, fused=True)
    cos_t, sin_t = s._rope_table(50)
    pos = torch.tensor([[0], [7], [49], [13]])
    c, si = s._rope_tables(torch.zeros(4, 1, 8, dtype=policy.model.embed_tokens.weight.dtype), pos)
    assert torch.equal(cos_t[pos[:, 0]], c.reshape(4, -1)) and torch.equal(sin_t[pos[:, 0]], si.reshape(4, -1))
    assert not torch.equal(cos_t[7], cos_t[13])
    prompts, ros = ["how many apples are there", "3 + 4", "a"], {}
    for mode in ("0", "1", "warm"):
        monkeypatch.setenv("QERL_FUSED_STEP_ENDS", "1" if mode == "warm" else mode)
        s = Sampler(policy, tok, 64, fused=True)
        if mode == "warm":  # the generate's own shape: its state (and cache) is the one warmed
            s.precapture(3, s.encode(prompts)[0].shape[1], 2, 10, temperature=0.9)
            warmed = s._static
            assert warmed["kc"][0].abs().sum() > 0  # the warm-up prefill wrote the cache
        ros[mode] = s.generate(prompts, 2, max_new_tokens=10, temperature=0.9, seed=3)
        assert mode != "warm" or s._static is warmed
        assert ros[mode].stats["fused_decode"] and s._static["rope"] is not None
    for mode in ("1", "warm"):
        for f in ("completion_ids", "completion_mask", "logp", "entropy"):
            assert torch.equal(getattr(ros["0"], f), getattr(ros[mode], f)), (mode, f)
    monkeypatch.setenv("QERL_FUSED_STEP_ENDS", "2")
    with pytest.raises(ValueError, match="QERL_FUSED_STEP_ENDS must be one of"):
        Sampler(policy, tok, 64, fused=True).generate(["a"], 1, max_new_tokens=3, seed=0)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if FORMATS[f].fusable and 64 % (FORMATS[f].block or 1) == 0])
def test_fused_sampler_on_a_llama_stack(fmt):
    """Llama layout (no q/k/v bias), quantized by swap_linears: bf16/mxfp4 groups concatenate; nvfp4 per-linear
    global scales do not, so its groups run member by member — both match teacher forcing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl.model import load_tokenizer

    tok = load_tokenizer(None)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id)
    m = swap_linears(LlamaForCausalLM(cfg), fmt, LoraSpec(rank=4))
    fused = fuse_projection_storage(m)
    assert fused == (0 if fmt == "nvfp4" else 4)
    perturb_lora_b(m)
    s = Sampler(m, tok, 64, fused=True)
    ro = s.generate(["how many apples are there", "3 + 4"], 3, max_new_tokens=10, temperature=0.9, seed=3)
    assert ro.stats["fused_decode"]
    assert_teacher_forced(m, ro, 0.9, entropy=False)


# ------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_kernels_bf16(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(3)

    def rn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    for D, wdt in ((3584, BF), (5120, torch.float32), (64, BF)):
        h, d, w = rn(8, D).to(BF), rn(8, D).to(BF), (1 + 0.1 * rn(D)).to(wdt)
        h1, x1 = fk.add_rms_norm_ref(h.clone(), d, w, 1e-6)
        h2, x2 = fk.add_rms_norm(h.clone(), d, w, 1e-6)
        assert torch.equal(h1, h2)
        assert (x1 != x2).float().mean() < 0.01 and (x1.float() - x2.float()).abs().max() <= 2 ** -6 * x1.abs().max()
    for H, hkv, d in ((28, 4, 128), (40, 8, 128), (4, 2, 16)):
        qkv, b = rn(8, (H + 2 * hkv) * d).to(BF), rn((H + 2 * hkv) * d).to(BF)
        cos, ssin = rn(8, d).to(BF), rn(8, d).to(BF)
        caches = [torch.zeros(8, hkv, 300, d, dtype=BF, device="cuda") for _ in range(4)]
        slot = torch.tensor([257], device="cuda")
        q1 = fk.rope_qkv_ref(qkv, b, cos, ssin, H, hkv, d, caches[0], caches[1], slot)
        q2 = fk.rope_qkv(qkv, b, cos, ssin, H, hkv, d, caches[2], caches[3], slot)
        for a1, a2 in ((q1, q2), (caches[0], caches[2]), (caches[1], caches[3])):
            assert (a1 != a2).float().mean() < 0.01 and (a1.float() - a2.float()).abs().max() < 0.05
        for S in (1, 64, 257, 300):
            kc, vc = rn(8, hkv, 300, d).to(BF), rn(8, hkv, 300, d).to(BF)
            bias = torch.zeros(8, 300, device="cuda")
            bias[:4, 1:40] = -math.inf
            o = fk.decode_attention(q2, kc, vc, bias, S, d ** -0.5)
            ref = _naive_attention(q2.cpu(), kc.cpu(), vc.cpu(), bias.cpu(), S, d ** -0.5)
            assert (o.double().cpu() - ref).abs().max() < 0.03, (H, S)
    monkeypatch.setenv("QERL_LORA_A_MAX_M", "256")  # the 32- and 64-row tiles, and several of 64 rows (the default)
    for m, r, k in ((8, 96, 3584), (8, 32, 18944), (2, 64, 5120), (16, 32, 27648), (24, 96, 3584), (32, 32, 18944),
                    (64, 64, 3584), (128, 96, 3584), (200, 32, 18944), (256, 64, 3584)):
        x, a = rn(m, k).to(BF), (0.02 * rn(r, k)).to(BF)
        ref = x.double() @ a.double().t()
        for _ in range(3):
            assert ((fk.lora_a(x, a).double() - ref).abs().max() / ref.abs().max()) < 1e-2, (m, r, k)
    gu = rn(8, 2 * 18944).to(BF)
    a1, a2 = fk.silu_mul_ref(gu), fk.silu_mul(gu)
    assert (a1 != a2).float().mean() < 0.01 and (a1.float() - a2.float()).abs().max() <= 2 ** -7 * a1.abs().max()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,preset", [(f, "tiny") for f in FORMATS if 64 % (FORMATS[f].block or 1) == 0]
                         + [("nvfp4", "tiny-d64"), ("bf16", "tiny-d64")])
def test_gpu_fused_graph_sampler_matches_teacher_forcing(fmt, preset, monkeypatch):
    """The fused graph decode against the HF forward (teacher forcing); ``tiny-d64`` with the CUDA decode attention
    (QERL_ATTN=cuda: its 24 (row, KV head) pairs are below the batch `auto` takes it from)."""
    monkeypatch.setenv("QERL_ATTN", "cuda" if preset == "tiny-d64" else "auto")
    torch.manual_seed(0)
    policy, tok = load_policy(f"preset:{preset}", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    from qerl.kernels import cuda_fp4

    stats = {}
    for fused in (True, False):
        s = Sampler(policy, tok, 128, cuda_graphs=True, fused=fused)
        launches = cuda_fp4.lora_launches()
        ro = s.generate(["how many apples", "3 + 4 is", "a"], 4, max_new_tokens=300, temperature=1.0, seed=1)
        assert ro.stats["fused_decode"] is fused and s.use_graphs
        # NVFP4/MXFP4/BF16: the decode step's base + LoRA ran as one CUDA launch (the tiny shapes qualify; BF16's
        # from the stored rows, A = the spare rows of reserve_lora_rows)
        assert (cuda_fp4.lora_launches() > launches) == (fmt in ("nvfp4", "mxfp4", "bf16")), fmt
        if fused and fmt == "bf16":  # the A rows are live (the GEMV reads them; above M = 16: x·[W; A]ᵀ)
            assert all(e["qkv"].rows_live and e["gate_up"].rows_live for e in s._plan)
            assert all(e["qkv"].lora.a.data_ptr() == e["qkv"].rows.data_ptr() for e in s._plan)
        with torch.no_grad():
            lp, _ = completion_logprobs(policy, ro, slice(0, 12), 1.0, True)
        m = ro.completion_mask
        stats[fused] = float((lp[m] - ro.logp[m]).abs().mean())
    # bf16 activations: both decode steps agree with the HF forward to bf16 noise (300 tokens: 2 KV buckets)
    assert stats[True] < 0.02 and stats[False] < 0.02, stats


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_gpu_graphs_replayed_for_shorter_prompts_draw_what_fresh_ones_draw(fmt):
    """The graph sampler after a batch of long prompts (Lp 128 after padding to 64) keeps its cache and graphs for a
    batch of short ones (Lp 64): the same tokens, log-probs and entropies as a fresh sampler's, bit for bit (the
    prompt length and the slot are data the graphs read; the attention covers the slots a fresh cache's would)."""
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    long_ = [" ".join(["apples and pears"] * 30), "3 + 4 is"]
    short = ["how many apples", "a"]
    s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
    kw = dict(max_new_tokens=300, temperature=1.0, seed=3, ignore_eos=True)  # every bucket reached (H100, s59)
    first = s.generate(long_, 3, **kw)
    assert first.stats["state_built"] and first.prompt_ids.shape[1] == 128
    ro = s.generate(short, 3, **kw)
    fresh = Sampler(policy, tok, 128, cuda_graphs=True, fused=True).generate(short, 3, **kw)
    assert not ro.stats["state_built"] and fresh.stats["state_built"] and ro.prompt_ids.shape[1] == 64
    assert ro.stats["graphs"] > first.stats["graphs"]  # the new last bucket (64 + 300) captured once
    for f in ("completion_ids", "completion_mask", "logp", "entropy"):
        assert torch.equal(getattr(ro, f), getattr(fresh, f)), f


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,per_group", [("nvfp4", False), ("nvfp4", True), ("bf16", False)])
def test_gpu_graph_captures_take_no_draws(fmt, per_group):
    """A graph's capture (its warm-up step samples a token) leaves the sampling generators where they were: the graph
    sampler draws what the eager step draws from the same seed, bit for bit, whether its graphs are captured during
    the call (one per KV bucket, mid-rollout) or ahead of it (``precapture``). Before session 60 each warm-up moved
    the stream on by one step's draws, so a sampler that already held a bucket's graph drew other tokens than a fresh
    one (the H100 failure of test_gpu_graphs_replayed_for_shorter_prompts_draw_what_fresh_ones_draw)."""
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    prompts = ["how many apples", "3 + 4 is", "a"]
    kw = dict(max_new_tokens=300, temperature=1.0, seed=[3, 4, 5] if per_group else 3, ignore_eos=True)
    e = Sampler(policy, tok, 128, cuda_graphs=False, fused=True)
    e.prompt_pad_multiple = 64  # the graph sampler's padding: the same slots, KV buckets and kernels, step by step
    eager = e.generate(prompts, 4, **kw)
    s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
    during = s.generate(prompts, 4, **kw)
    assert during.stats["graphs"] == 2 and during.stats["state_built"]  # buckets 256 and 64 + 300, captured mid-call
    assert not eager.stats["graphs"] and eager.prompt_ids.shape == during.prompt_ids.shape
    runs = [during, s.generate(prompts, 4, **kw)]  # the second: every graph replayed, none captured
    if not per_group:  # precapture's buffers are the one-generator kind
        ahead = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
        ahead.precapture(3, 64, 4, 300, ignore_eos=True)
        runs.append(ahead.generate(prompts, 4, **kw))
        assert not runs[-1].stats["state_built"]
    for ro in runs:
        for f in ("completion_ids", "completion_mask", "logp", "entropy"):
            assert torch.equal(getattr(ro, f), getattr(eager, f)), f


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_gpu_rope_in_the_attention_split_kernel_changes_nothing(fmt, monkeypatch):
    """Bias + RoPE + cache write inside the Triton attention split kernel (QERL_FUSED_ROPE_ATTN=1, an opt-in) against
    their own launch before it (0): on bf16 tensors of the 7B and 32B attention shapes the same cache bit for bit and
    the same output, at a slot in the first, a middle and the last split; in the graph sampler (PDL on) the same
    tokens, stops and log-probs over 3 x 4 x 300 tokens, and the HF forward's log-probs to bf16 noise."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for H, hkv, d, bias_on in ((28, 4, 128, True), (40, 8, 128, False)):
        qkv = torch.randn(8, (H + 2 * hkv) * d, generator=g, device="cuda").to(BF)
        b = torch.randn((H + 2 * hkv) * d, generator=g, device="cuda").to(BF) if bias_on else None
        cos, ssin = (torch.randn(8, d, generator=g, device="cuda").to(BF) for _ in range(2))
        bias = torch.zeros(8, 1100, device="cuda")
        bias[:4, 1:40] = -math.inf
        for S, sl in ((1, 0), (300, 150), (1100, 1099), (700, 699)):
            kv = [torch.randn(8, hkv, 1100, d, generator=g, device="cuda").to(BF) for _ in range(2)]
            outs = {}
            for mode in ("0", "1"):
                monkeypatch.setenv("QERL_FUSED_ROPE_ATTN", mode)
                c = [t.clone() for t in kv]
                outs[mode] = (fk.rope_attention(qkv, b, cos, ssin, H, hkv, d, c[0], c[1], bias, S, d ** -0.5,
                                                torch.tensor([sl], device="cuda")), c)
            (o0, c0), (o1, c1) = outs["0"], outs["1"]
            assert torch.equal(c0[0], c1[0]) and torch.equal(c0[1], c1[1]) and not torch.equal(c1[0], kv[0]), (H, S)
            torch.testing.assert_close(o1.float(), o0.float(), rtol=0, atol=1e-6 * float(o0.abs().max()))
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    ros = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("QERL_FUSED_ROPE_ATTN", mode)
        s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
        ros[mode] = s.generate(["how many apples", "3 + 4 is", "a"], 4, max_new_tokens=300, temperature=1.0, seed=3)
        assert ros[mode].stats["fused_decode"] and s.use_graphs
    a, b = ros["0"], ros["1"]
    assert torch.equal(a.completion_mask, b.completion_mask) and torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.logp, a.logp, rtol=1e-6, atol=1e-5)
    with torch.no_grad():
        lp_tf, _ = completion_logprobs(policy, b, slice(0, 12), 1.0, False)
    assert float((lp_tf[b.completion_mask] - b.logp[b.completion_mask]).abs().mean()) < 0.02


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,per_group", [("nvfp4", False), ("nvfp4", True), ("bf16", False)])
def test_gpu_fused_step_ends_are_bit_identical(fmt, per_group, monkeypatch):
    """The step's opening and close in one launch each (slot, embedding, position-table rows; the bookkeeping
    after the draw, from bf16 logits) change no token or stop of the graph sampler: the same rollouts as session
    57's torch ops (QERL_FUSED_STEP_ENDS=0), EOS stops included (no ignore_eos). The opening's outputs are the torch
    ops' bit for bit. The log-probs and entropies agree to float32 rounding, not bit for bit: the sampling kernel
    compiled for bf16 logits sums the vocabulary in another order than the one for their float32 copy (session 58's
    H100 run of the first version of this test)."""
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
    n, smax, emb = 12, 300, policy.get_input_embeddings()
    cos_t, sin_t = s._rope_table(smax)
    g = torch.Generator(device="cuda").manual_seed(1)
    tk = torch.randint(0, emb.weight.shape[0], (n,), device="cuda", generator=g)
    plen = torch.randint(1, 100, (n,), device="cuda", generator=g)
    t, lp = torch.tensor([57], device="cuda"), torch.tensor([128], device="cuda")
    b1, b2 = (torch.full((n, smax), float("-inf"), device="cuda") for _ in range(2))
    h, c, si, slot = fk.step_begin(tk, t, lp, plen, emb.weight, cos_t, sin_t, b1)
    pos = (plen + 56)[:, None]
    c0, si0 = s._rope_tables(emb(tk)[:, None], pos)  # session 57's per-step rotary tables and embedding, on the GPU
    assert torch.equal(h, emb(tk)) and torch.equal(c, c0.reshape(n, -1)) and torch.equal(si, si0.reshape(n, -1))
    fk.step_begin_ref(tk, t, lp, plen, emb.weight, cos_t, sin_t, b2)
    assert int(slot) == 184 and torch.equal(b1, b2)
    z = 4 * torch.randn(n, 5000, device="cuda", generator=g).to(BF)
    e = torch.empty(n, 5000, device="cuda").exponential_(generator=g)
    (t1, l1, h1), (t2, l2, h2) = fk.sample_race(z, 0.8, e), fk.sample_race(z.float(), 0.8, e)
    assert torch.equal(t1, t2)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h1, h2, rtol=1e-6, atol=1e-5)
    prompts = ["how many apples", "3 + 4 is", "a"]
    ros = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("QERL_FUSED_STEP_ENDS", mode)
        s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
        s.precapture(3, 128, 4, 200)
        ros[mode] = s.generate(prompts, 4, max_new_tokens=200, temperature=1.0,
                               seed=[3, 4, 5] if per_group else 3)
        assert ros[mode].stats["fused_decode"] and s.use_graphs and (s._static["rope"] is not None)
    a, b = ros["0"], ros["1"]
    assert torch.equal(a.completion_mask, b.completion_mask) and torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.logp, a.logp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(b.entropy, a.entropy, rtol=1e-6, atol=1e-5)
    assert torch.equal(a.logp == 0, b.logp == 0) and torch.equal(a.truncated, b.truncated)
    with torch.no_grad():  # and the HF forward to bf16 noise, as test_gpu_fused_graph_sampler_matches_teacher_forcing
        lp_tf, _ = completion_logprobs(policy, b, slice(0, 12), 1.0, False)
    assert float((lp_tf[b.completion_mask] - b.logp[b.completion_mask]).abs().mean()) < 0.02


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,preset", [("nvfp4", "tiny"), ("mxfp4", "tiny"), ("bf16", "tiny"),
                                        ("nvfp4", "tiny-d64"), ("bf16", "tiny-d64")])
def test_gpu_pdl_decode_is_bit_identical(fmt, preset, monkeypatch):
    """Programmatic dependent launch changes when kernels start, not what they compute: the graph sampler with
    QERL_PDL=1 draws the same tokens with the same log-probs as with QERL_PDL=0 (a read before a predecessor's
    writes landed would show up as a difference somewhere in 3 x 4 x 300 tokens). ``tiny-d64`` runs the CUDA
    decode attention (QERL_ATTN=cuda), which requests the cache before it waits for the RoPE launch that writes the
    new slot."""
    from qerl import kernels
    from qerl.kernels import cuda_attn
    monkeypatch.setenv("QERL_ATTN", "cuda" if preset == "tiny-d64" else "auto")  # 24 pairs: below auto's MIN_ROWS
    torch.manual_seed(0)
    policy, tok = load_policy(f"preset:{preset}", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    cfg = policy.config
    d, H, hkv = cfg.hidden_size // cfg.num_attention_heads, cfg.num_attention_heads, cfg.num_key_value_heads
    z = torch.zeros(12, hkv, 16, d, dtype=BF, device="cuda")
    assert cuda_attn.usable(torch.zeros(12, H, d, dtype=BF, device="cuda"), z, z,
                            torch.zeros(12, 16, device="cuda")) == (preset == "tiny-d64")
    perturb_lora_b(policy)
    ros = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("QERL_PDL", mode)
        assert kernels.pdl_enabled(torch.zeros(1, device="cuda")) == (mode == "1" and
                                                                     torch.cuda.get_device_capability()[0] >= 9)
        s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
        ros[mode] = s.generate(["how many apples", "3 + 4 is", "a"], 4, max_new_tokens=300, temperature=1.0, seed=3)
        assert ros[mode].stats["fused_decode"] and s.use_graphs
    assert torch.equal(ros["0"].completion_mask, ros["1"].completion_mask)
    assert torch.equal(ros["0"].completion_ids, ros["1"].completion_ids)
    assert torch.equal(ros["0"].logp, ros["1"].logp)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,switch,per_prompt,lora_a_pdl", [
    (f, sw, pp, "0") for f in ("nvfp4", "mxfp4") for sw, pp in (("QERL_GEMM_LORA", 8), ("QERL_WGMMA_LORA", 16))]
    + [("nvfp4", "QERL_GEMM_LORA", 8, "1"), ("nvfp4", "QERL_WGMMA_LORA", 16, "1")])
def test_gpu_gemm_lora_pdl_decode_is_bit_identical(fmt, switch, per_prompt, lora_a_pdl, monkeypatch):
    """A GEMM with the LoRA term in its epilogue, launched under PDL so its main loop overlaps the x·Aᵀ kernel
    (``switch`` = pdl), draws the same tokens with the same log-probs as the plain launch (``switch`` = 1) in the graph
    sampler: the mma.sync GEMM at 24 sequences (QERL_GEMM_LORA), the wgmma GEMM at 48 (QERL_WGMMA_LORA=pdl: its own
    build with the waits; the heuristic's wgmma configuration for these untuned shapes), the other GEMM's switch at 1.
    The PDL launches are counted, so the comparison cannot pass by both modes taking another path. ``lora_a_pdl`` 1:
    the x·Aᵀ launch before the GEMM under PDL itself (QERL_LORA_A_PDL). Failures print the first differing
    position."""
    from qerl.kernels import cuda_fp4 as cf
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    monkeypatch.delenv("QERL_LORA_A_MAX_M", raising=False)  # t by the Triton kernel (the default up to 256 tokens)
    monkeypatch.setenv("QERL_PDL", "1")
    monkeypatch.setenv("QERL_LORA_A_PDL", lora_a_pdl)  # 1: x·Aᵀ itself launched under PDL too (waits, then triggers)
    monkeypatch.setenv("QERL_WGMMA_LORA" if switch == "QERL_GEMM_LORA" else "QERL_GEMM_LORA", "1")
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny-d64", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    launches = {"1": [], "pdl": []}
    gemm = cf.gemm
    ros = {}
    for mode in ("1", "pdl"):
        monkeypatch.setenv(switch, mode)
        monkeypatch.setattr(cf, "gemm", lambda *a, seen=launches[mode], **k: seen.append(k.get("pdl", False))
                            or gemm(*a, **k))
        s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
        ros[mode] = s.generate(["how many apples", "3 + 4 is", "a"], per_prompt, max_new_tokens=300, temperature=1.0,
                               seed=3)
        assert ros[mode].stats["fused_decode"] and s.use_graphs
    # the same GEMM launches in both (prefill's at other token counts may take the other kernel: never under PDL)
    assert len(launches["1"]) == len(launches["pdl"]) and not any(launches["1"]) and any(launches["pdl"])
    for key in ("completion_mask", "completion_ids", "logp"):
        a, b = getattr(ros["1"], key), getattr(ros["pdl"], key)
        assert torch.equal(a, b), (key, (a != b).nonzero()[:4].tolist())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,store", [("nvfp4", "scatter"), ("mxfp4", "scatter"), ("nvfp4", "vector")])
def test_gpu_permuted_inputs_decode_is_bit_identical(fmt, store, monkeypatch):
    """The norm and SwiGLU launches writing the wgmma GEMM's permuted tokens beside their output
    (QERL_FUSED_PERMUTE=1, the default) draw the same tokens with the same log-probs as the GEMM's own permute launch
    (0), in the graph sampler at 48 sequences, with and without PDL, with either store of the copy; the twins are counted (q|k|v, gate|up, down and
    o, whose input the CUDA attention writes (QERL_ATTN=cuda): four per layer and step in the capture), and so are
    the GEMM's own permute launches under PDL (one fewer per twin: only the prefill's are left)."""
    from qerl.kernels import cuda_fp4 as cf
    monkeypatch.delenv("QERL_LORA_A_MAX_M", raising=False)
    monkeypatch.setenv("QERL_ATTN", "cuda")
    monkeypatch.setenv("QERL_PERMUTE_STORE", store)
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny-d64", fmt, LoraSpec(rank=8), train_norms=True, device="cuda")
    perturb_lora_b(policy)
    twin, permute = kernels.permuted_twin, cf.permute_tokens
    for pdl in ("0", "1"):
        monkeypatch.setenv("QERL_PDL", pdl)
        ros, seen = {}, {}
        for mode in ("0", "1"):
            monkeypatch.setenv("QERL_FUSED_PERMUTE", mode)
            seen[mode] = c = {"twins": 0, "permutes": 0}

            def counted_twin(x, c=c):
                t = twin(x)
                c["twins"] += t is not None
                return t

            def counted_permute(x, c=c):
                c["permutes"] += 1
                return permute(x)
            monkeypatch.setattr(kernels, "permuted_twin", counted_twin)
            monkeypatch.setattr(cf, "permute_tokens", counted_permute)
            s = Sampler(policy, tok, 128, cuda_graphs=True, fused=True)
            ros[mode] = s.generate(["how many apples", "3 + 4 is", "a"], 16, max_new_tokens=300, temperature=1.0,
                                   seed=3)
            assert ros[mode].stats["fused_decode"] and s.use_graphs
        layers = len(policy.model.layers)
        assert seen["0"]["twins"] == 0 and seen["1"]["twins"] >= 4 * layers, seen
        if pdl == "1":  # each twin saves one permute launch (the prefill's stay); without PDL the GEMM permutes
            # inside its own launch, not through permute_tokens
            assert seen["1"]["permutes"] == seen["0"]["permutes"] - seen["1"]["twins"], seen
        for key in ("completion_mask", "completion_ids", "logp"):
            a, b = getattr(ros["0"], key), getattr(ros["1"], key)
            assert torch.equal(a, b), (pdl, key, (a != b).nonzero()[:4].tolist())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("H,hkv,d", [(28, 4, 128), (40, 8, 128), (16, 2, 128), (32, 2, 128), (14, 2, 64)])
def test_gpu_cuda_decode_attention_matches_reference(H, hkv, d, monkeypatch):
    """The CUDA decode attention (qerl.kernels.cuda_attn) against a float64 reference (the Triton path within the same
    bound), over every ring depth, key counts around the 16-key subtiles and the 4-warp rounds, left-padded and holed
    masks, and a `slot` (the key the kernel loads after its wait and stores from registers) in and out of the
    early-requested stages; `auto` takes it only from MIN_ROWS (row, KV head) pairs."""
    from qerl.kernels import cuda_attn
    monkeypatch.setattr(cuda_attn, "MODE", "cuda")
    if not cuda_attn.usable(torch.zeros(1, H, d, dtype=BF, device="cuda"),
                            torch.zeros(1, hkv, 16, d, dtype=BF, device="cuda"),
                            torch.zeros(1, hkv, 16, d, dtype=BF, device="cuda"), torch.zeros(1, 16, device="cuda")):
        pytest.fail(f"CUDA decode attention not usable: {cuda_attn._STATE.get('error')}")
    g = torch.Generator(device="cuda").manual_seed(H * 1000 + d)
    m, smax, scale = 5, 700, d ** -0.5
    q = torch.randn(m, H, d, device="cuda", generator=g).to(BF)
    kc = torch.randn(m, hkv, smax, d, device="cuda", generator=g).to(BF)
    vc = torch.randn(m, hkv, smax, d, device="cuda", generator=g).to(BF)
    bias = torch.zeros(m, smax, device="cuda")
    bias[0, :37] = -math.inf      # left padding over more than two subtiles
    bias[1, 100:300] = -math.inf  # a hole spanning whole splits
    bias[3, 1:16] = -math.inf
    runs = 0
    # bf16 output (half an ulp is 2^-9 relative) and P rounded to bf16 before P·V: the Triton path's largest error on
    # these inputs was 2.5-3.3e-3 (H100, s33) where outputs are near zero; a misplaced key or head is off by ~0.1-1
    tol = dict(rtol=2 ** -7, atol=5e-3)
    for S in (1, 15, 16, 17, 63, 64, 65, 300, 700):
        live = (bias[:, :S] == 0).any(1)  # a row with no unmasked key has no defined output
        ref = fk.decode_attention_ref(q.double(), kc.double(), vc.double(), bias.double(), S, scale).float()[live]
        monkeypatch.setattr(cuda_attn, "MODE", "triton")
        torch.testing.assert_close(fk.decode_attention(q, kc, vc, bias, S, scale).float()[live], ref, **tol)  # bound
        monkeypatch.setattr(cuda_attn, "MODE", "cuda")
        for nst in cuda_attn.NST_CHOICES:
            for slot in (None, S - 1, min(5, S - 1), min(40, S - 1)):
                monkeypatch.setattr(cuda_attn, "NST", nst)
                st = None if slot is None else torch.tensor([slot], device="cuda")
                out = fk.decode_attention(q, kc, vc, bias, S, scale, st)
                torch.testing.assert_close(out.float()[live], ref, **tol, msg=lambda e, a=(S, nst, slot): f"{a}: {e}")
                runs += 1
            # the launch that also writes the output in the wgmma GEMM's K permutation (the o projection's input)
            outp = fk.decode_attention(q, kc, vc, bias, S, scale, None, permuted=True)
            assert torch.equal(outp, fk.decode_attention(q, kc, vc, bias, S, scale))
            assert torch.equal(kernels.permuted_twin(outp), permute_x_reference(outp))
    assert runs == 9 * 3 * 4
    monkeypatch.setattr(cuda_attn, "MODE", "auto")  # auto: Triton's split kernel below MIN_ROWS (row, KV head) pairs
    assert not cuda_attn.usable(q, kc, vc, bias) and m * hkv < cuda_attn.MIN_ROWS
    big = torch.zeros(-(-cuda_attn.MIN_ROWS // hkv), H, d, dtype=BF, device="cuda")
    z = torch.zeros(big.shape[0], hkv, 16, d, dtype=BF, device="cuda")
    assert cuda_attn.usable(big, z, z, torch.zeros(big.shape[0], 16, device="cuda"))


if __name__ == "__main__":
    _interpreter_main()


# ------------------------------------------------------------------------------------------ BF16: LoRA A rows

def _bf16_policy(rows: bool, monkeypatch):
    monkeypatch.setenv("QERL_LORA_ROWS", "1" if rows else "0")
    torch.manual_seed(0)
    policy, tok = load_policy("preset:tiny", "bf16", LoraSpec(rank=4), device="cpu", dtype=BF)
    torch.manual_seed(5)
    perturb_lora_b(policy)
    return policy, tok


def test_bf16_lora_rows_one_gemm_per_product(monkeypatch):
    """BF16 + LoRA: every adapted linear's weight sits in a buffer with its A rows after it; inside
    lora_inference_cache the cast A is in those rows, and x·[W; A]ᵀ + one addmm equals the three-launch path
    (x·Wᵀ, x·Aᵀ, addmm) — for the fused q|k|v / gate|up groups and for o_proj / down_proj alone."""
    policy, _ = _bf16_policy(True, monkeypatch)
    plain, _ = _bf16_policy(False, monkeypatch)
    monkeypatch.setenv("QERL_LORA_ROWS", "1")  # the switch is read at use too: plain has no rows to use
    layer, ref_layer = policy.model.layers[1], plain.model.layers[1]
    a = layer.self_attn
    for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, layer.mlp.down_proj):
        assert m._lora_rows.shape == (m.rank, m.in_features) and not m._lora_rows.any()
    assert a.o_proj._lora_ext.shape == (a.o_proj.out_features + 4, a.o_proj.in_features)
    assert a.q_proj._lora_ext is None  # a group member: the group's product carries its rows
    assert all(getattr(m, "_lora_rows", None) is None for m in plain.modules())
    for n, t in policy.state_dict().items():  # the same values as without rows (views of the new buffers)
        assert torch.equal(t, plain.state_dict()[n]), n
    plan, ref_plan = build_decode_plan(policy), build_decode_plan(plain)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, a.q_proj.in_features, generator=g).to(BF)
    with torch.no_grad(), lora_inference_cache(policy, BF), lora_inference_cache(plain, BF):
        assert torch.equal(a.o_proj._lora_rows, a.o_proj.lora_A.weight.to(BF))
        for key in ("qkv", "gate_up"):
            f, r = plan[1][key], ref_plan[1][key]
            f.refresh(BF)
            r.refresh(BF)
            assert f.rows_live and not r.rows_live and f.A.data_ptr() == f.ext[f.out_features:].data_ptr()
            y = f(x)
            assert y.stride(0) == f.out_features + sum(f.ranks)  # a view of the wider product
            torch.testing.assert_close(y, r(x), rtol=0, atol=2e-2)
            torch.testing.assert_close(f.silu_mul(x) if key == "gate_up" else y, r.silu_mul(x) if key == "gate_up"
                                       else r(x), rtol=0, atol=2e-2)
        for name in ("o_proj", "down_proj"):
            m = a.o_proj if name == "o_proj" else layer.mlp.down_proj
            r = ref_layer.self_attn.o_proj if name == "o_proj" else ref_layer.mlp.down_proj
            xi = torch.randn(2, 3, m.in_features, generator=g).to(BF)
            y = m(xi)
            assert y.shape == (2, 3, m.out_features) and y.stride(-2) == m.out_features + m.rank
            torch.testing.assert_close(y, r(xi), rtol=0, atol=2e-2)
        # QERL_LORA_ROWS=0 at use time (decode mode fused-split-lora): the three-launch path, the same values
        monkeypatch.setenv("QERL_LORA_ROWS", "0")
        f = plan[1]["qkv"]
        f.refresh(BF)
        assert not f.rows_live and f.A.data_ptr() != f.ext[f.out_features:].data_ptr()
        torch.testing.assert_close(f(x), ref_plan[1]["qkv"](x), rtol=0, atol=2e-2)
        assert a.o_proj(x[:, :a.o_proj.in_features]).is_contiguous()
        monkeypatch.setenv("QERL_LORA_ROWS", "1")
        f.refresh(BF)
        assert f.rows_live
        torch.testing.assert_close(f(x), ref_plan[1]["qkv"](x), rtol=0, atol=2e-2)
        # a replaced base weight is never read through stale rows: the module falls back to its own path
        m = layer.mlp.down_proj
        m._buffers["weight"] = m.weight.clone()
        xi = torch.randn(3, m.in_features, generator=g).to(BF)
        torch.testing.assert_close(m(xi), ref_layer.mlp.down_proj(xi), rtol=0, atol=2e-2)


def test_bf16_lora_rows_sampler_and_training_unchanged(monkeypatch):
    """The fused sampler in bf16 draws the same tokens with and without the rows (same seed), its log-probs match
    the teacher-forced forward, and the training gradients are the same with the rows reserved."""
    outs = {}
    for rows in (True, False):
        policy, tok = _bf16_policy(rows, monkeypatch)
        s = Sampler(policy, tok, 64, fused=True)
        ro = s.generate(["how many apples are there", "3 + 4"], 2, max_new_tokens=10, temperature=0.9, seed=3)
        assert ro.stats["fused_decode"]
        assert all(e[k].rows_live == rows for e in s._plan for k in ("qkv", "gate_up"))
        assert_teacher_forced(policy, ro, 0.9, atol=0.1, entropy=False)
        policy.train()
        ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(0))
        policy(ids, labels=ids).loss.backward()
        outs[rows] = (ro, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    (r1, g1), (r0, g0) = outs[True], outs[False]
    assert torch.equal(r1.completion_ids, r0.completion_ids)
    torch.testing.assert_close(r1.logp, r0.logp, rtol=0, atol=2e-2)
    assert g1.keys() == g0.keys() and all(torch.equal(g1[n], g0[n]) for n in g1)
