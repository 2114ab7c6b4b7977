"""Tests for qerl.kernels.cuda_fp4: the re-layout + lane-level emulator (CPU, bit-exact against
``qerl.quant`` dequantization) and, with ``-m gpu``, the CUDA kernel against the reference over a shape sweep.

References: ``qerl.quant.FORMATS[fmt].dequantize`` (tested bit-exact against compressed-tensors elsewhere), with
NVFP4's global scale set to 1 for the exact decode check (the kernel applies 1/g to its fp32 accumulator).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from qerl.kernels import cuda_fp4 as cf
from qerl.quant import FORMATS

FP4 = ("nvfp4", "mxfp4")


def _weight(n: int, k: int, seed: int, device="cpu") -> torch.Tensor:
    """Heavy-tailed rows and blocks so scales span many binades; mixed signs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) * torch.exp(torch.randn(n, 1, generator=gen, device=device))
    blk = torch.exp(0.7 * torch.randn(n, k // 16, 1, generator=gen, device=device))
    return 0.02 * w * blk.expand(-1, -1, 16).reshape(n, k)


def _quant(fmt: str, n: int, k: int, seed: int, device="cpu") -> dict:
    return FORMATS[fmt].quantize(_weight(n, k, seed, device))


def _exact_ref(fmt: str, q: dict) -> torch.Tensor:
    """fp4 * s (NVFP4, g = 1) or fp4 * 2^(e-127) (MXFP4) in float32, from the format's own dequantize."""
    if fmt == "nvfp4":
        q = dict(q, weight_global_scale=torch.ones(1, device=q["weight_packed"].device))
    return FORMATS[fmt].dequantize(q, torch.float32)


def _prep(fmt: str, q: dict) -> cf.CudaFP4Weight:
    return cf.prepare(fmt, q["weight_packed"], q["weight_scale"], q.get("weight_global_scale"))


# ------------------------------------------------------------------------------------------ CPU

def test_bit_layout_is_a_bijection():
    bits = [cf.SRC[o][h][b] for o in range(4) for h in range(2) for b in range(4)]
    assert sorted(bits) == list(range(32))
    # the fourth register's three shifted copies of REST's bits never collide (no carries in the multiply)
    rest = [b for b in range(32) if cf.REST >> b & 1]
    assert sorted(rest) == sorted(cf.SRC[3][h][b] for h in range(2) for b in range(4))
    shifts = [s for s in range(32) if cf.SPREAD >> s & 1]
    targets = [b + s for b in rest for s in shifts if b + s < 32]
    assert len(targets) == len(set(targets))
    # every nibble bit lands on its bf16 place: sign 15, magnitude 8..6 (per half)
    for h in range(2):
        for b in range(4):
            hits = [s for s in shifts if cf.SRC[3][h][b] + s == 16 * h + (6, 7, 8, 15)[b]]
            assert len(hits) == 1


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (64, 128), (32, 1024)])
def test_emulated_decode_is_bit_exact(fmt, n, k):
    q = _quant(fmt, n, k, seed=n + k)
    w = _prep(fmt, q)
    assert w.qweight.shape == (n // 16, k // 64, 32, 4) and w.qweight.dtype == torch.int32
    assert w.nbytes == q["weight_packed"].numel() + q["weight_scale"].numel()
    assert torch.equal(cf.emulate_weight(w), _exact_ref(fmt, q))


def test_nvfp4_zero_subnormal_negative_scales_exact():
    n, k = 32, 256
    q = _quant("nvfp4", n, k, seed=7)
    sb = q["weight_scale"].view(torch.uint8).clone()
    special = torch.tensor([0x00, 0x80, 0x01, 0x03, 0x07, 0x81, 0x86, 0x08, 0xB8, 0x7E, 0xFE], dtype=torch.uint8)
    flat = sb.view(-1)
    idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[: 4 * special.numel()]
    flat[idx] = special.repeat(4)
    q["weight_scale"] = sb.view(torch.float8_e4m3fn)
    w = _prep("nvfp4", q)
    ref = _exact_ref("nvfp4", q)
    assert (ref < 0).any() and (ref == 0).any()
    assert torch.equal(cf.emulate_weight(w), ref)


def test_mxfp4_exponent_window():
    n, k = 32, 256
    q = _quant("mxfp4", n, k, seed=3)
    e = q["weight_scale"].clone()
    e[0, 0], e[1, 1], e[2, 2] = 0, 150, 40  # tiny and large scales, within 126 binades of each other? no: 0..150
    q["weight_scale"] = e
    with pytest.raises(ValueError, match="wider than the 126"):
        _prep("mxfp4", q)
    e[0, 0] = 30  # now [30, 150]: B = 104, exact
    w = _prep("mxfp4", q)
    assert w.bexp == 104
    assert torch.equal(cf.emulate_weight(w), _exact_ref("mxfp4", q))
    # an all-zero block with an out-of-window exponent is harmless
    q2 = _quant("mxfp4", n, k, seed=4)
    q2["weight_packed"][3, :16] = 0
    q2["weight_scale"][3, 0] = 254
    w2 = _prep("mxfp4", q2)
    assert w2.bexp == 126 and torch.equal(cf.emulate_weight(w2), _exact_ref("mxfp4", q2))


@pytest.mark.parametrize("fmt", FP4)
def test_emulate_matches_linear(fmt):
    n, k = 64, 512
    q = _quant(fmt, n, k, seed=11)
    w = _prep(fmt, q)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = cf.emulate(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (5, n)
    ref = x.float() @ FORMATS[fmt].dequantize(q, torch.float32).t()
    mag = x.float().abs() @ FORMATS[fmt].dequantize(q, torch.float32).abs().t()
    assert ((y.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-5 * mag).all()


@pytest.mark.parametrize("fmt", FP4)
def test_relayout_gives_the_compressed_tensors_back(fmt):
    """``to_compressed`` undoes ``prepare`` bit for bit — zero blocks, NVFP4's special scales and MXFP4's exponent
    window included — so the re-laid-out copy can stand for the weight; where ``prepare`` changed a block it cannot
    undo (an NVFP4 zero scale over nonzero codes), ``relayout_is_exact`` says so."""
    codes = torch.randint(0, 16, (64, 1024), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    assert torch.equal(cf.unpack_words(cf.pack_words(codes)), codes)
    q = _quant(fmt, 64, 512, seed=21)
    q["weight_packed"][5, :32] = 0  # an all-zero block (quantize gives it scale 0 / a small exponent)
    if fmt == "nvfp4":
        sb = q["weight_scale"].view(torch.uint8).clone()
        sb[5, :4] = 0
        sb[7, 3], sb[9, 1] = 0x01, 0xB8  # subnormal, negative
        q["weight_scale"] = sb.view(torch.float8_e4m3fn)
    w = _prep(fmt, q)
    back = cf.to_compressed(w)
    assert sorted(back) == sorted(q)
    for name, t in q.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8) if t.dtype != torch.float32
                                                           else back[name], t.view(torch.uint8)
                                                           if t.dtype != torch.float32 else t.reshape(1)), name
    assert cf.relayout_is_exact(fmt, w, q["weight_packed"], q["weight_scale"])
    if fmt == "nvfp4":  # zero scales prepare rewrites: over nonzero codes (zeroed), and -0 (made +1 over zeros)
        for row, byte, code in ((10, 0x00, 0x77), (12, 0x80, 0x00)):
            qq = {k: v.clone() for k, v in q.items()}
            sb = qq["weight_scale"].view(torch.uint8)
            sb[row, 2] = byte
            qq["weight_packed"][row, 16:24] = code
            w = _prep(fmt, qq)
            assert not cf.relayout_is_exact(fmt, w, qq["weight_packed"], qq["weight_scale"]), hex(byte)
            assert torch.equal(cf.emulate_weight(w), _exact_ref(fmt, qq))  # the weights themselves are the same
    else:  # an all-zero block whose exponent lies past the decode window: moved, and no longer the same bytes
        q["weight_packed"][11, :16] = 0
        q["weight_scale"][11, 0] = 254
        w = _prep(fmt, q)
        assert not cf.relayout_is_exact(fmt, w, q["weight_packed"], q["weight_scale"])


def test_bad_inputs_raise():
    q = _quant("nvfp4", 32, 128, seed=1)
    with pytest.raises(ValueError, match=r"'int4'.*valid formats: \['mxfp4', 'nvfp4'\]"):
        cf.prepare("int4", q["weight_packed"], q["weight_scale"])
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0, got N=8, K=128"):
        cf.prepare("nvfp4", q["weight_packed"][:8], q["weight_scale"][:8], q["weight_global_scale"])
    with pytest.raises(ValueError, match="K % 64 == 0, got N=32, K=96"):
        cf.prepare("nvfp4", q["weight_packed"][:, :48], q["weight_scale"][:, :6], q["weight_global_scale"])
    with pytest.raises(ValueError, match="weight_global_scale"):
        cf.prepare("nvfp4", q["weight_packed"], q["weight_scale"])
    with pytest.raises(ValueError, match="weight_scale has shape"):
        cf.prepare("mxfp4", q["weight_packed"], q["weight_scale"].view(torch.uint8))
    sb = q["weight_scale"].view(torch.uint8).clone()
    sb[0, 0] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        cf.prepare("nvfp4", q["weight_packed"], sb.view(torch.float8_e4m3fn), q["weight_global_scale"])
    w = _prep("nvfp4", q)
    with pytest.raises(ValueError, match="CUDA"):
        cf.gemv(torch.randn(1, 128).bfloat16(), w)


def test_pick_config_one_wave():
    # a simple occupancy model: 2048 threads / SM, at most 4 CTAs of any size
    occ = lambda warps, splits: min(4, 64 // warps)  # noqa: E731
    for s, c in [(224, 56), (32, 56), (1184, 56), (224, 296), (1728, 80), (4, 2)]:
        for m in (1, 8, 16):
            unroll, sw = cf.variant_for(s, c, m)
            splits, per, u, w = cf.pick_config(s, c, 132, unroll, occ, sw)
            assert (u, w) == (unroll, sw) and 1 <= splits * per <= (8 if u * w >= 8 else 16)
            assert splits == 1 or c // splits >= unroll
            assert splits == 1 or -(-s // (per * sw)) <= occ(splits * per, splits) * 132
            # with CTAs added by the launch (LoRA), the whole grid still fits one wave, or splits fell to 1
            extra = lambda warps, splits, c=c: 4 * cf.lora_parts(64, c, warps)  # noqa: E731
            sp2, per2, _, _ = cf.pick_config(s, c, 132, unroll, occ, sw, extra_ctas=extra)
            assert sp2 <= splits
            assert sp2 == 1 or -(-s // (per2 * sw)) + extra(sp2 * per2, sp2) <= occ(sp2 * per2, sp2) * 132
    # 7B: gate|up two strips per warp; down_proj (224 strips, 296 chunks) one at M <= 8 (two left SMs idle), two above
    assert cf.variant_for(2368, 56) == (2, 2) and cf.variant_for(224, 296, 8) == (4, 1)
    assert cf.variant_for(224, 296, 16) == (2, 2) and cf.variant_for(288, 56, 16) == (4, 1)
    # gate|up of 7B at M = 8: 592 CTAs fit 5 per SM; 16 more LoRA CTAs at 4 per SM do not, so the pick changes
    occ5 = lambda warps, splits: 5 if warps <= 4 else 2  # noqa: E731
    occ4 = lambda warps, splits: 4 if warps <= 4 else 2  # noqa: E731
    assert cf.pick_config(2368, 56, 132, 2, occ5, 2) == (2, 2, 2, 2)
    assert cf.pick_config(2368, 56, 132, 2, occ4, 2, extra_ctas=lambda w, sp: 16) == (1, 4, 2, 2)


def test_gemm_config_validation():
    assert cf.check_gemm_config((8, 1, 4, 2), s=224, c=56) == (8, 1, 4, 2)
    assert cf.gemm_smem_bytes(16, 1, 2, 4) > cf.GEMM_SMEM_MAX >= cf.gemm_smem_bytes(16, 1, 2, 2)
    for bad, why in [((3, 1, 4, 1), "nt in"), ((8, 3, 4, 1), "sw in"), ((8, 1, 4, 4), "r \\* ks <= 8"),
                     ((8, 1, 0, 1), "r in"), ((8, 1, 3, 1), "r in"), ((8, 1, 1, 9), "ks <= C"), ((8, 1, 1), "must be"),
                     ((16, 2, 2, 1), "nt 16: sw 1 and r >= 2"), ((16, 1, 1, 2), "nt 16: sw 1 and r >= 2"),
                     ((8, 2, 8, 1), "sw 2: r <= 4"), ((16, 1, 2, 4), "shared memory")]:
        with pytest.raises(ValueError, match=why if why != "must be" else "must be \\(nt, sw, r, ks\\)"):
            cf.check_gemm_config(bad, s=224, c=8)
    w = _prep("nvfp4", _quant("nvfp4", 32, 128, seed=1))
    with pytest.raises(ValueError, match="CUDA"):
        cf.gemm(torch.randn(32, 128).bfloat16(), w)


def test_wgmma_config_validation():
    assert cf.check_gemm_config((16, 0, 2, 1), s=224, c=56) == (16, 0, 2, 1)
    for bad in [(16, 0, 4, 1), (12, 0, 1, 1), (32, 0, 2, 2), (16, 0, 1, 4), (32, 0, 4, 1)]:  # not compiled
        with pytest.raises(ValueError, match="wgmma GEMM config"):
            cf.check_gemm_config(bad, s=224, c=56)
    with pytest.raises(ValueError, match="ks <= C"):
        cf.check_gemm_config((8, 0, 1, 4), s=224, c=3)
    # the shared-memory formula is csrc's: 4 stages of (tokens + 4 rw strips x 576 B) rounded to 1 KB, + 1 KB
    assert cf.wgmma_smem_bytes(128, 2, 1) == 4 * 21 * 1024 + 1024
    assert cf.wgmma_smem_bytes(32, 1, 4) == 4 * 4 * 7 * 1024 + 1024
    for ntok, rw, ks in cf.WGMMA_VARIANTS:  # every compiled variant fits some shape's opt-in shared memory
        assert cf.wgmma_smem_bytes(ntok, rw, ks) <= cf.GEMM_SMEM_MAX, (ntok, rw, ks)
    cfgs = cf.wgmma_configs(224, 56)
    # all variants x CTA splits but kz 4 x ks 4 (16 splits of 56 chunks: < 4 chunks each), + each one's stream-K,
    # + the tail splits kt 2..4 but kt 4 x ks 4 (test_wgmma_tail_split_configs)
    assert len(cfgs) == (2 * cf.WGMMA_MAX_KZ - 1) * len(cf.WGMMA_VARIANTS) - 4 + len(cf.WGMMA_SK_VARIANTS)
    assert (4, -3, 1, 4) not in cfgs and (16, cf.WGMMA_SK, 2, 1) in cfgs and (16, cf.WGMMA_SK, 2, 2) not in cfgs
    with pytest.raises(ValueError, match="stream-K, variants"):  # 128 tokens on 512 threads: no stream-K kernel
        cf.check_gemm_config((16, cf.WGMMA_SK, 2, 2), s=224, c=56)
    assert all(cf.check_gemm_config(c, 224, 56) == c for c in cfgs)
    assert cf.check_gemm_config((8, -3, 1, 2), s=224, c=8) == (8, -3, 1, 2)  # 4 CTA splits x 2 groups = C
    with pytest.raises(ValueError, match="kz = 1 - sw"):
        cf.check_gemm_config((8, -3, 1, 2), s=224, c=7)
    with pytest.raises(ValueError, match="kz = 1 - sw"):
        cf.check_gemm_config((8, -cf.WGMMA_MAX_KZ, 1, 1), s=224, c=56)
    # every split of K keeps >= 4 chunks
    assert all((1 - c[1]) * c[3] == 1 for c in cf.wgmma_configs(224, 7) if c[1] != cf.WGMMA_SK)
    with pytest.raises(ValueError, match="no wgmma variant"):
        cf.gemm_kernel_attributes("nvfp4", 16, 0, 4, 2)


def test_wgmma_tail_split_configs(monkeypatch):
    """Session 50's tail-split configs (nt, wgmma_tail_sw(kt), r, ks): sw WGMMA_SK - kt for kt = 2..WGMMA_MAX_KZ, only
    in a QERL_WGMMA_TAIL=1 build (the default), every grid variant; the launch's CTAs (csrc's mapping in pure Python)
    cover each tile's K exactly once: the tiles up to the last whole wave whole, the rest kt ways."""
    monkeypatch.setenv("QERL_WGMMA_TAIL", "0")
    monkeypatch.setattr(cf, "_arch_flags", lambda: ["-gencode=arch=compute_90a,code=sm_90a"])  # no GPU here
    assert [cf.wgmma_tail_kt(cf.wgmma_tail_sw(kt)) for kt in range(2, cf.WGMMA_MAX_KZ + 1)] == [2, 3, 4]
    assert [cf.wgmma_tail_kt(sw) for sw in (0, -1, -3, cf.WGMMA_SK, cf.WGMMA_SK - 1, cf.WGMMA_SK - 5)] == [0] * 6
    with pytest.raises(ValueError, match="tail split kt=1; valid: 2..4"):
        cf.wgmma_tail_sw(1)
    tail = (16, cf.wgmma_tail_sw(4), 2, 2)
    assert not any(cf.wgmma_tail_kt(c[1]) for c in cf.wgmma_configs(224, 56))  # QERL_WGMMA_TAIL=0's has none
    with pytest.raises(ValueError, match=r"needs a QERL_WGMMA_TAIL=1 build \(this one: False\)"):
        cf.check_gemm_config(tail, s=2368, c=56)
    monkeypatch.delenv("QERL_WGMMA_TAIL")
    assert "-DQFP4_WGMMA_TAIL=1" in cf._build_flags()
    assert cf.check_gemm_config(tail, s=2368, c=56) == tail
    with pytest.raises(ValueError, match="kt \\* ks <= C \\(kt = 4\\)"):
        cf.check_gemm_config(tail, s=2368, c=7)
    with pytest.raises(ValueError, match="tail-split config"):
        cf.check_gemm_config((16, cf.wgmma_tail_sw(2), 4, 2), s=2368, c=56)  # no such variant
    cfgs = cf.wgmma_configs(224, 56)
    tails = [c for c in cfgs if cf.wgmma_tail_kt(c[1])]
    # every variant x kt 2..4 but kt 4 x ks 4 (16 splits of 56 chunks: < 4 each), each one valid
    assert len(tails) == (cf.WGMMA_MAX_KZ - 1) * len(cf.WGMMA_VARIANTS) - 2 and tail in tails
    assert all(cf.check_gemm_config(c, 224, 56) == c for c in tails)
    monkeypatch.setenv("QERL_WGMMA_TAIL", "2")
    with pytest.raises(ValueError, match="QERL_WGMMA_TAIL='2'; valid: 0, 1$"):
        cf._build_flags()
    for tiles, wave, kt in [(296, 132, 4), (264, 132, 4), (5, 132, 3), (133, 132, 2), (296, 132, 1)]:
        ctas = cf.wgmma_tail_ctas(tiles, wave, kt)
        rest = tiles % wave
        split = kt if rest and kt > 1 else 1
        assert len(ctas) == tiles - rest + rest * split if split > 1 else len(ctas) == tiles
        assert ctas[: tiles - rest] == [(t, 0, 1) for t in range(tiles - rest)] or split == 1
        cover = {}
        for t, z, n in ctas:
            cover.setdefault(t, []).append((z, n))
        assert sorted(cover) == list(range(tiles))
        for t, parts in cover.items():  # each tile: splits 0..n-1 of n, once each, n = kt only past the last wave
            n = parts[0][1]
            assert sorted(parts) == [(z, n) for z in range(n)] and n == (split if t >= tiles - rest else 1), (t, parts)
    assert len(cf.wgmma_tail_ctas(296, 132, 4)) == 264 + 32 * 4 <= 3 * 132  # the last wave's 32 tiles on 128 CTAs
    # the pick fills the last wave: 7B gate|up at 128 tokens (296 tiles, 32 left) 4 ways, at 64 (592, 64 left) 2 ways
    # whether one CTA fits an SM (a wave of 132) or two (264: (8, 0, 1, 2) on an H200, where 4 ways measured slower
    # than 2 in sessions 50 and 51); none below one whole wave, on whole waves, where the rest fills every SM, or where
    # a split would keep < 4 chunks a group
    assert cf.wgmma_tail_pick((16, 0, 2, 2), 296, 56, 132, 132) == (16, cf.wgmma_tail_sw(4), 2, 2)
    assert cf.wgmma_tail_pick((8, 0, 1, 2), 592, 56, 132, 132) == (8, cf.wgmma_tail_sw(2), 1, 2)
    assert cf.wgmma_tail_pick((8, 0, 1, 2), 592, 56, 264, 132) == (8, cf.wgmma_tail_sw(2), 1, 2)
    assert cf.wgmma_tail_pick((8, 0, 1, 2), 400, 56, 264, 132) == (8, 0, 1, 2)  # 136 left: more than the SMs
    assert cf.wgmma_tail_pick((16, 0, 2, 2), 100, 56, 132, 132) == (16, 0, 2, 2)
    assert cf.wgmma_tail_pick((16, 0, 2, 2), 264, 56, 132, 132) == (16, 0, 2, 2)
    assert cf.wgmma_tail_pick((16, 0, 2, 2), 296, 8, 132, 132) == (16, 0, 2, 2)
    assert cf.wgmma_tail_pick((16, -1, 2, 2), 296, 56, 132, 132) == (16, -1, 2, 2)

    # the dispatcher (CUDA-free here: the device's name and SMs, its tuned table and its wave stand in): the default
    # build turns the tuned grid config of 7B gate|up at 128 tokens into its kt 4 split; QERL_WGMMA_TAIL=0's build
    # runs a table's tail split as its grid config; the choice is cached per build
    from types import SimpleNamespace
    props = SimpleNamespace(name="NVIDIA H200", multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx: props)
    monkeypatch.setattr(cf, "wgmma_ctas", lambda fmt, ntok, r, ks, lora: 132)
    monkeypatch.setattr(cf, "gemm_table_tails", lambda name: False)  # a table swept before tail splits (or none)
    w = SimpleNamespace(fmt="nvfp4", n=37888, k=3584)
    for tuned, tail_on, want in [((16, 0, 2, 2), "1", (16, cf.wgmma_tail_sw(4), 2, 2)),
                                 ((16, 0, 2, 2), "0", (16, 0, 2, 2)),
                                 ((16, cf.wgmma_tail_sw(3), 2, 2), "0", (16, 0, 2, 2)),
                                 ((16, cf.wgmma_tail_sw(3), 2, 2), "1", (16, cf.wgmma_tail_sw(3), 2, 2)),
                                 ((16, -1, 2, 2), "1", (16, -1, 2, 2))]:
        monkeypatch.setattr(cf, "tuned_gemm_config", lambda *a, t=tuned: (t, True))
        monkeypatch.setenv("QERL_WGMMA_TAIL", tail_on)
        cf._STATE.pop(("gemm", 0, "nvfp4", 37888, 3584, 128, tail_on == "1"), None)
        assert cf._gemm_config(w, 128, torch.device("cuda", 0)) == want, (tuned, tail_on)
    assert cf._STATE.pop(("gemm", 0, "nvfp4", 37888, 3584, 128, True)) == (16, -1, 2, 2)
    cf._STATE.pop(("gemm", 0, "nvfp4", 37888, 3584, 128, False))
    # at 64 tokens (8, 0, 1, 2) fits two CTAs an SM: the dispatcher splits its 64 left-over tiles over the SMs (2 ways)
    monkeypatch.setattr(cf, "wgmma_ctas", lambda fmt, ntok, r, ks, lora: 264)
    monkeypatch.setattr(cf, "tuned_gemm_config", lambda *a: ((8, 0, 1, 2), True))
    cf._STATE.pop(("gemm", 0, "nvfp4", 37888, 3584, 64, True), None)
    assert cf._gemm_config(w, 64, torch.device("cuda", 0)) == (8, cf.wgmma_tail_sw(2), 1, 2)
    cf._STATE.pop(("gemm", 0, "nvfp4", 37888, 3584, 64, True))
    # a table swept with tail splits measured its grid configs against them: kept as they are; without a table hit
    # (the heuristic's config) the pick applies
    monkeypatch.setattr(cf, "gemm_table_tails", lambda name: name == "NVIDIA H200")
    assert cf._gemm_config(w, 64, torch.device("cuda", 0)) == (8, 0, 1, 2)
    cf._STATE.pop(("gemm", 0, "nvfp4", 37888, 3584, 64, True))
    monkeypatch.setattr(cf, "tuned_gemm_config", lambda *a: None)
    monkeypatch.setattr(cf, "pick_gemm_config", lambda *a, **k: (8, 0, 1, 2))
    assert cf._gemm_config(w, 64, torch.device("cuda", 0)) == (8, cf.wgmma_tail_sw(2), 1, 2)
    cf._STATE.pop(("gemm", 0, "nvfp4", 37888, 3584, 64, True))


@pytest.mark.parametrize("tiles,c,workers", [(296, 56, 264), (1, 56, 264), (72, 56, 528), (3, 5, 7), (10, 3, 40),
                                             (7, 56, 6), (2368, 56, 132), (296, 56, 132), (264, 56, 132)])
def test_streamk_schedule_covers_every_unit_once_and_counts_each_tiles_contributors(tiles, c, workers):
    """The stream-K schedule (``streamk_segments``, the kernel's arithmetic): every (tile, chunk) unit in exactly one
    segment; the whole multiples of the workers' count of tiles done whole, round-robin; in the split rest a tile's
    contributors are consecutive workers, counted by the kernel as owner(last unit) - owner(first unit) + 1 (its
    'last to finish' test), so no worker inside a shared tile may be empty; a whole tile has one writer and no
    slot, a shared tile's partials distinct slots, at most 2 per worker (2 w, 2 w + 1)."""
    segs = cf.streamk_segments(tiles, c, workers)
    units = [(t, ch) for _, t, a, b, _ in segs for ch in range(a, b)]
    assert len(units) == len(set(units)) == tiles * c
    dp = tiles // workers * workers
    assert all((a, b, sl) == (0, c, -1) and t % workers == w for w, t, a, b, sl in segs if t < dp)
    u_all, u0 = (tiles - dp) * c, dp * c
    nw = min(workers, u_all)

    def first(v):
        return u0 + v * u_all // nw

    def owner(u):  # csrc: v = (u - u0) W / U, then forward past the workers whose first unit is <= u
        v = (u - u0) * nw // u_all
        while v + 1 < nw and first(v + 1) <= u:
            v += 1
        return v

    by_tile = {}
    for w, t, a, b, slot in segs:
        if t >= dp:
            by_tile.setdefault(t, []).append((w, a, b, slot))
            assert all(owner(t * c + ch) == w for ch in range(a, b))
    slots = [sl for *_, sl in segs if sl >= 0]
    assert len(slots) == len(set(slots)) and all(sl // 2 < workers for sl in slots)
    for t, parts in by_tile.items():
        ws = [p[0] for p in parts]
        assert ws == list(range(owner(t * c), owner(t * c + c - 1) + 1))
        assert (len(parts) == 1) == (parts[0][3] == -1) and all((p[3] >= 0) == (len(parts) > 1) for p in parts)
    if u_all >= nw > 0:  # every worker of the split part has work (the kernel's W = min(workers, U))
        assert {s[0] for s in segs if s[1] >= dp} == set(range(nw))


@pytest.mark.parametrize("fmt", FP4)
def test_wgmma_token_permutation_matches_the_weight_words(fmt):
    """The wgmma kernel feeds the mma.sync A fragments as they are and reads the tokens from shared memory in
    wgmma's own K order, so the tokens are permuted instead (``permute_x_reference``, csrc ``permute_x_kernel``):
    the weight in the MMAs' logical K order times the permuted tokens is the product, and the unpermuted tokens
    (or a wrong permutation) are not."""
    n, k = 48, 256
    q = _quant(fmt, n, k, seed=31)
    w = _prep(fmt, q)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = x.double() @ cf.emulate_weight(w).double().t()
    got = cf.permute_x_reference(x).double() @ cf.wgmma_weight(w).double().t()
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9 * float(ref.abs().max()))
    for wrong in (x, x.reshape(5, 4, 8, 4, 2).permute(0, 1, 3, 2, 4).reshape(5, k)):  # none; the inverse
        assert not torch.allclose(wrong.double() @ cf.wgmma_weight(w).double().t(), ref, rtol=1e-3, atol=1e-3)
    # a permutation of the columns inside each chunk of 64, nothing else
    idx = cf.permute_x_reference(torch.arange(k, dtype=torch.float64)[None])[0].long()
    assert sorted(idx.tolist()) == list(range(k)) and ((idx // 64) == (torch.arange(k) // 64)).all()
    assert idx[:10].tolist() == [0, 1, 16, 17, 32, 33, 48, 49, 2, 3]


@pytest.mark.parametrize("s,c", [(224, 56), (32, 56), (1184, 56), (224, 296), (2, 1), (9504, 56)])
@pytest.mark.parametrize("m", [17, 24, 32, 33, 64, 100, 256, 512, 4096])
def test_pick_gemm_config_is_valid_and_fills_the_gpu(s, c, m):
    nt, sw, r, ks = cfg = cf.pick_gemm_config(s, c, m, sms=132)
    assert cf.check_gemm_config(cfg, s, c) == cfg
    assert 8 * nt >= min(m, 64) and (nt == 8 or 8 * nt >= m)  # one tile covers M up to 64 tokens
    ctas = -(-m // (8 * nt)) * -(-s // (r * sw))
    # split-K only while the grid has fewer warps than ~2 CTAs per SM, and never more groups than chunks
    assert ks == 1 or (ks <= c and (ks - 1) * ctas < 2 * 132)
    # on sm_90 above 32 tokens: the wgmma kernel, split across CTAs only while the grid leaves SMs idle
    nt, sw, r, ks = cfg = cf.pick_gemm_config(s, c, m, sms=132, wgmma=True)
    assert cf.check_gemm_config(cfg, s, c) == cfg
    assert (sw <= 0) == (m > 32)
    if sw <= 0:
        kz, ctas = 1 - sw, -(-m // (8 * nt)) * -(-s // (4 * r))
        assert kz == 1 or (ctas * (kz - 1) < 132 and c // (kz * ks) >= 4)


def test_rows_aligned_and_permute_tokens_refuse_bad_input():
    """rows_aligned: unit column stride, rows and start 16-byte aligned (what the kernels read in place); permute_tokens
    refuses anything else (and CPU tensors) by name before a launch."""
    x = torch.zeros(4, 136, dtype=torch.bfloat16)
    assert cf.rows_aligned(x[:, :128]) and cf.rows_aligned(x[:, 8:])
    assert not cf.rows_aligned(x[:, 4:]) and not cf.rows_aligned(x.t()) and not cf.rows_aligned(x[:, ::2])
    assert not cf.rows_aligned(torch.zeros(4, 130, dtype=torch.bfloat16)[:, :128])  # rows 260 bytes apart
    with pytest.raises(ValueError, match="permute_tokens: x must be a CUDA bf16 \\(M, K\\) tensor, K % 64 == 0"):
        cf.permute_tokens(x[:, :128])


def test_wgmma_pipe_switch(monkeypatch):
    """QERL_WGMMA_PIPE picks the wgmma main loop at build time: 2 (default) adds no flag (the measured build), 1 adds
    -DQFP4_WGMMA_PIPE=1 (a separate build: the flags are part of its name); anything else is refused by name.
    QERL_WGMMA_LORA=pdl (the default) adds -DQFP4_WGMMA_PDL=1 (the LoRA variants' waits), its other values nothing.
    QERL_WGMMA_TMA=1 (the default) adds -DQFP4_WGMMA_TMA=1 (chunks staged by tensor copies), 0 nothing.
    QERL_WGMMA_TAIL=1 (the default) adds -DQFP4_WGMMA_TAIL=1 (the tail-split configs), 0 nothing.
    QERL_GEMM_KZ=1 adds -DQFP4_GEMM_KZ=1 (the mma.sync GEMM's K split across CTAs), 0 (the default) nothing.
    QERL_BF16_LOADS=sector (the default) adds -DQFP4_DENSE_SECTOR=1 (the BF16 GEMV's sector-wide loads), pair nothing.
    QERL_WGMMA_STSM=1 adds -DQFP4_WGMMA_STSM=1 (the wgmma epilogue through shared memory), 0 (the default) nothing.
    The removed opt-ins' switches are refused by value, naming the choices left."""
    from qerl.kernels import switches as sw
    monkeypatch.setattr(cf, "_arch_flags", lambda: ["-gencode=arch=compute_90a,code=sm_90a"])  # no GPU here
    for k in cf.BUILD_SWITCHES:
        monkeypatch.delenv(k, raising=False)
    assert cf.wgmma_pipe() == 2
    default = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DQFP4_WGMMA_PDL=1", "-DQFP4_WGMMA_TMA=1",
               "-DQFP4_WGMMA_TAIL=1", "-DQFP4_DENSE_SECTOR=1"]
    assert cf._build_flags() == default
    monkeypatch.setenv("QERL_BF16_LOADS", "pair")
    assert cf._build_flags()[-1] == "-DQFP4_WGMMA_TAIL=1"
    monkeypatch.setenv("QERL_BF16_LOADS", "quad")
    with pytest.raises(ValueError, match="QERL_BF16_LOADS='quad'; valid: pair, sector"):
        cf._build_flags()
    monkeypatch.setenv("QERL_BF16_LOADS", "pair")  # the wgmma flags below without the BF16 one
    monkeypatch.setenv("QERL_WGMMA_TMA", "0")
    assert cf._build_flags() == ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DQFP4_WGMMA_PDL=1",
                                 "-DQFP4_WGMMA_TAIL=1"]
    for v in ("all-bar", "la3", "la4"):  # removed in sessions 48 and 50
        monkeypatch.setenv("QERL_WGMMA_TMA", v)
        with pytest.raises(ValueError, match=f"QERL_WGMMA_TMA='{v}'; valid: 0, 1$"):
            cf._build_flags()
    monkeypatch.setenv("QERL_WGMMA_TMA", "1")
    monkeypatch.setenv("QERL_GEMM_KZ", "1")  # session 68's experiment: the mma.sync GEMM's K split across CTAs
    assert cf._build_flags()[-1] == "-DQFP4_GEMM_KZ=1"
    monkeypatch.setenv("QERL_GEMM_KZ", "2")
    with pytest.raises(ValueError, match="QERL_GEMM_KZ='2'; valid: 0, 1$"):
        cf._build_flags()
    monkeypatch.delenv("QERL_GEMM_KZ")
    monkeypatch.setenv("QERL_WGMMA_STSM", "1")  # session 72's experiment: the wgmma epilogue through shared memory
    assert cf._build_flags()[-1] == "-DQFP4_WGMMA_STSM=1"
    monkeypatch.setenv("QERL_WGMMA_STSM", "on")
    with pytest.raises(ValueError, match="QERL_WGMMA_STSM='on'; valid: 0, 1$"):
        cf._build_flags()
    monkeypatch.delenv("QERL_WGMMA_STSM")
    monkeypatch.setenv("QERL_WGMMA_TAIL", "0")  # session 49's kernel, without the tail splits
    assert cf._build_flags()[-1] == "-DQFP4_WGMMA_TMA=1"
    monkeypatch.delenv("QERL_WGMMA_TAIL")
    monkeypatch.delenv("QERL_WGMMA_TMA")
    for v in ("0", "1", "pdl"):
        monkeypatch.setenv("QERL_WGMMA_LORA", v)
        assert ("-DQFP4_WGMMA_PDL=1" in cf._build_flags()) == (v == "pdl")
    for name in ("QERL_WGMMA_LORA", "QERL_GEMM_LORA"):
        monkeypatch.setenv(name, "pdl-tail")  # removed in session 48
        with pytest.raises(ValueError, match=f"{name}='pdl-tail'; valid: 0, 1, pdl$"):
            sw.wgmma_lora_mode() if name == "QERL_WGMMA_LORA" else sw.mma_lora_mode()
    monkeypatch.delenv("QERL_WGMMA_LORA")
    monkeypatch.setenv("QERL_WGMMA_PIPE", "1")
    assert cf.wgmma_pipe() == 1 and "-DQFP4_WGMMA_PIPE=1" in cf._build_flags()
    monkeypatch.setenv("QERL_WGMMA_PIPE", "3")
    with pytest.raises(ValueError, match="QERL_WGMMA_PIPE='3'; valid: 1, 2"):
        cf._build_flags()


def test_pick_gemm_config_wgmma_matches_the_h100_sweep():
    """Where the tuned table has no entry (another sm_90 part), the heuristic gives the configurations the H100
    sweep chose for the 7B fused gate|up (M = 64, 128) and the down projection at 128 tokens; at 32 tokens and
    without wgmma it keeps the mma.sync heuristic."""
    assert cf.pick_gemm_config(2368, 56, 64, sms=132, wgmma=True) == (8, 0, 1, 2)
    assert cf.pick_gemm_config(2368, 56, 128, sms=132, wgmma=True) == (16, 0, 2, 2)
    assert cf.pick_gemm_config(224, 296, 128, sms=132, wgmma=True) == (16, -3, 2, 2)
    assert cf.pick_gemm_config(224, 296, 32, sms=132, wgmma=True) == cf.pick_gemm_config(224, 296, 32, sms=132)


def test_tuned_gemm_table(tmp_path, monkeypatch):
    import json
    monkeypatch.setattr(cf, "_GEMM_TABLE_DIR", tmp_path)
    entries = [dict(fmt="nvfp4", N=3584, K=3584, M=m, config=[8, 1, 2, ks], us=1.0, prev_us=2.0, wins=wins)
               for m, ks, wins in [(64, 2, True), (24, 4, True), (512, 1, False)]]
    entries.append(dict(fmt="nvfp4", N=18944, K=3584, M=256, config=[8, 1, 2, 1], us=1.0, prev_us=2.0, wins=True))
    cf._table_path("NVIDIA H100 80GB HBM3").write_text(json.dumps({"device": "x", "entries": entries}))
    assert cf._table_path("NVIDIA H100 80GB HBM3").name == "cuda_gemm_nvidia_h100_80gb_hbm3.json"
    name = "NVIDIA H100 80GB HBM3"
    cf._STATE.pop(("table", name), None)
    try:
        assert cf.tuned_gemm_config("nvfp4", 3584, 3584, 17, name) == ((8, 1, 2, 4), True)  # smallest M >= 17: 24
        assert cf.tuned_gemm_config("nvfp4", 3584, 3584, 64, name) == ((8, 1, 2, 2), True)
        assert cf.tuned_gemm_config("nvfp4", 3584, 3584, 100, name) == ((8, 1, 2, 1), False)  # next: 512
        assert cf.tuned_gemm_config("nvfp4", 3584, 3584, 4096, name) == ((8, 1, 2, 1), False)  # above all: largest
        # a sweep that stopped where the GEMM still won: above it nothing was measured, so no win is extrapolated
        assert cf.tuned_gemm_config("nvfp4", 18944, 3584, 256, name) == ((8, 1, 2, 1), True)
        assert cf.tuned_gemm_config("nvfp4", 18944, 3584, 257, name) == ((8, 1, 2, 1), False)
        assert cf.tuned_gemm_config("nvfp4", 18944, 3584, 8192, name) == ((8, 1, 2, 1), False)
        assert cf.tuned_gemm_config("mxfp4", 3584, 3584, 64, name) is None
        assert cf.tuned_gemm_config("nvfp4", 3584, 3584, 64, "other GPU") is None
        assert not cf.gemm_table_tails(name) and not cf.gemm_table_tails("other GPU")  # no "tail_splits": swept before
        # installing a new table replaces the cached one at once
        entries[1]["config"] = [4, 2, 2, 4]
        cf.install_gemm_table(name, json.dumps({"device": "x", "tail_splits": True, "entries": entries}))
        assert cf.tuned_gemm_config("nvfp4", 3584, 3584, 17, name) == ((4, 2, 2, 4), True)
        assert cf.gemm_table_tails(name)
    finally:
        cf._STATE.pop(("table", name), None)
        cf._STATE.pop(("table_tails", name), None)


def test_installed_gemm_tables_are_valid():
    """Every table shipped under qerl/kernels/tuned/ parses and holds only valid configs of its shapes."""
    import json
    for path in sorted(cf._GEMM_TABLE_DIR.glob("cuda_gemm_*.json")):
        doc = json.loads(path.read_text())
        assert doc["entries"], path
        for e in doc["entries"]:
            assert e["fmt"] in FP4 and e["M"] > 16 and isinstance(e["wins"], bool)
            assert cf.check_gemm_config(e["config"], e["N"] // 16, e["K"] // 64) == tuple(e["config"])


def test_installed_gemv_tables_are_valid():
    """Every GEMV table shipped under qerl/kernels/tuned/ (the H100's since session 61: the 14B / 32B q|k|v and o at
    M <= 8 with rank-32 LoRA, ``benchmarks.gemv_tune``'s docstring) loads with its configs checked against the
    format's compiled variants and keys decode-size points; a device without a table gets {} (the rules decide).
    The H100 table's q|k|v / o entries reach M = 1-8 of those shapes and no M > 8 (the other n8-tile variants)."""
    import json
    for path in sorted(cf._GEMM_TABLE_DIR.glob("cuda_gemv_*.json")):
        doc = json.loads(path.read_text())
        table = cf.load_gemv_table(doc["device"])
        assert table and len(doc["entries"]) == sum(len(v) for v in table.values()), path
        for e in doc["entries"]:
            assert e["fmt"] in cf.GEMV_FORMATS and 1 <= e["M"] <= 16 and e["us"] <= e["heuristic_us"]
    assert cf.load_gemv_table("no such GPU") == {}
    assert cf.tuned_gemv_config("bf16", 37888, 3584, 8, (64, 32), "silu_mul", "no such GPU") is None
    h100 = "NVIDIA H100 80GB HBM3"
    for m in (1, 2, 8):  # 14B / 32B q|k|v (r32 on q, k, v: 96 ranks) and o
        assert cf.tuned_gemv_config("nvfp4", 7168, 5120, m, (96, 32), None, h100) == (5, 1, 2, 1)
        assert cf.tuned_gemv_config("nvfp4", 5120, 5120, m, (32, 32), None, h100) == (5, 1, 2, 1)
    assert cf.tuned_gemv_config("nvfp4", 7168, 5120, 9, (96, 32), None, h100) is None
    assert cf.tuned_gemv_config("nvfp4", 7168, 5120, 8, None, None, h100) is None  # no LoRA: not tuned
    assert cf.tuned_gemv_config("mxfp4", 7168, 5120, 8, (96, 32), None, h100) is None


def test_gemv_config_validation():
    assert cf.check_gemv_config([8, 1, 4, 1]) == (8, 1, 4, 1)
    assert cf.check_gemv_config((2, 2, 2, 2), "silu_mul") == (2, 2, 2, 2)
    for bad, why in [((8, 1, 3, 1), r"\(3, 1\) is not compiled for nvfp4; valid: \[\(2, 1\)"),
                     ((8, 2, 8, 1), r"8 x 2 must be in \[1, 8\] warps"), ((0, 1, 4, 1), r"0 x 1 must be in \[1, 16\]"),
                     ((8, 1, 4), r"is \(splits, strip groups per CTA, unroll, strips per warp\)"),
                     ("abcd", r"is \(splits")]:
        with pytest.raises(ValueError, match=why):
            cf.check_gemv_config(bad)
    with pytest.raises(ValueError, match="act='silu_mul' runs with two strips per warp, got 1"):
        cf.check_gemv_config((8, 1, 4, 1), "silu_mul")
    # a BF16 weight: its own compiled variants, and 8 warps per CTA at most (four words a lane per chunk)
    assert cf.check_gemv_config((4, 2, 2, 1), None, "bf16") == (4, 2, 2, 1)
    assert cf.check_gemv_config((1, 4, 2, 2), "silu_mul", "bf16") == (1, 4, 2, 2)
    for bad, why in [((1, 1, 8, 1), r"\(8, 1\) is not compiled for bf16; valid: \[\(2, 1\), \(4, 1\), \(2, 2\)\]"),
                     ((4, 4, 2, 1), r"4 x 4 must be in \[1, 8\] warps for bf16"),
                     ((1, 1, 2, 1), r"unknown GEMV weight format 'fp8'")]:
        with pytest.raises(ValueError, match=why):
            cf.check_gemv_config(bad, None, "fp8" if "fp8" in why else "bf16")
    assert cf.gemv_warp_cap(2, 1, cf.gemv_words("bf16")) == 8 and cf.gemv_warp_cap(2, 1, cf.gemv_words("nvfp4")) == 16
    assert cf.variant_for(2368, 56, 8, "bf16") == (2, 1) and cf.variant_for(2368, 56, 8) == (2, 2)
    # the BF16 rule: one strip group per CTA, K split toward 10 warps per SM (7B on 132 SMs: the H100 tuner's picks
    # for q|k|v, o and gate|up + SwiGLU; down 6 where the tuner took 8), at most 8 splits, each >= one batch
    picks = [cf.bf16_gemv_config(s, c, 132, act) for s, c, act in ((288, 56, None), (224, 56, None),
                                                                     (2368, 56, "silu_mul"), (224, 296, None))]
    assert picks == [(5, 1, 2, 1), (6, 1, 2, 1), (2, 1, 2, 2), (6, 1, 2, 1)]
    assert cf.bf16_gemv_config(4, 3, 132) == (1, 1, 2, 1) and cf.bf16_gemv_config(8, 4096, 132) == (8, 1, 2, 1)
    for cfg, act in zip(picks, (None, None, "silu_mul", None), strict=True):
        assert cf.check_gemv_config(cfg, act, "bf16") == cfg


def test_dense_weight_operand_checks():
    """``dense_weight``: a view of the stored BF16 weight (no copy), and a clear error for what the GEMV cannot
    read — shape, dtype, strides, alignment; the GEMMs and the dequantization refuse it by name."""
    buf = torch.randn(96 + 8, 128).bfloat16()
    w = cf.dense_weight(buf[:96])
    assert w.fmt == "bf16" and (w.n, w.k) == (96, 128) and w.qweight.data_ptr() == buf.data_ptr()
    assert w.out_mult == 1.0 and w.global_scale is None and w.nbytes == 96 * 128 * 2
    for bad, why in [(buf[:96].float(), "2-D bfloat16"), (buf[:40], r"N % 16 == 0 and K % 64 == 0, got \(40, 128\)"),
                     (torch.randn(32, 96).bfloat16(), r"got \(32, 96\)"),
                     (torch.randn(128, 32).bfloat16().t(), r"got strides \(1, 32\)"),
                     (torch.randn(16 * 128 + 8).bfloat16()[4:4 + 16 * 128].view(16, 128), "at offset 8 mod 16")]:
        with pytest.raises(ValueError, match=why):
            cf.dense_weight(bad)
    x = torch.randn(4, 128).bfloat16()
    with pytest.raises(ValueError, match="unknown FP4 format 'bf16'"):
        cf.gemm(x, w)
    with pytest.raises(ValueError, match="unknown FP4 format 'bf16'"):
        cf.dequantize(w)
    # the CPU emulation of the GEMV over it: x Wᵀ in fp32, one rounding; + the LoRA term, + the SwiGLU epilogue
    ref = (x.double() @ buf[:96].double().t())
    assert torch.allclose(cf.emulate(x, w).double(), ref, rtol=2 ** -8, atol=1e-6)
    g, u = cf.emulate(x, w).float().chunk(2, dim=-1)
    assert torch.equal(cf.emulate(x, w, act="silu_mul"), (torch.nn.functional.silu(g.bfloat16()) * u.bfloat16()))


def test_tuned_gemv_table(tmp_path, monkeypatch):
    """The GEMV table: lookup by (fmt, N, K, LoRA rank and Bn row length, act) at the smallest tuned M >= m on m's
    side of the 8-row boundary, None elsewhere; the tuner's JSON merges into an existing table; bad configs are
    refused on load; install forgets cached choices."""
    import json

    from benchmarks.gemv_tune import table_json
    monkeypatch.setattr(cf, "_GEMM_TABLE_DIR", tmp_path)
    name = "NVIDIA H100 80GB HBM3"
    assert cf._gemv_table_path(name).name == "cuda_gemv_nvidia_h100_80gb_hbm3.json"
    row = dict(model="7b", fmt="nvfp4", linear="down", N=3584, K=18944, rank=32, rp=32, act="", candidates=9,
               best=[8, 1, 4, 1], best_sweep_us=19.0, best_us=19.8, pick=[10, 1, 4, 1], pick_us=20.0)
    rows = [dict(row, M=m, config=cfg) for m, cfg in [(2, [8, 1, 4, 1]), (8, [5, 1, 4, 1]), (16, [10, 1, 2, 2])]]
    rows.append(dict(row, linear="gate|up", N=37888, K=3584, M=8, act="silu_mul", config=[2, 2, 2, 2]))
    old = json.loads(table_json([dict(row, M=8, config=[7, 1, 4, 1]), dict(row, M=4, rank=0, rp=0,
                                                                           config=[6, 1, 2, 1])], name, []))
    doc = json.loads(table_json(rows, name, ["--m", "2,8,16"], old))
    assert len(doc["entries"]) == 5 and doc["command"] == "python -m benchmarks.gemv_tune --m 2,8,16"
    e8 = next(e for e in doc["entries"] if e["M"] == 8 and e["rank"] == 32 and not e["act"])
    assert e8["config"] == [5, 1, 4, 1] and e8["us"] == 19.8 and e8["heuristic_us"] == 20.0  # the new run wins
    cf._STATE.pop(("gemv_table", name), None)
    try:
        cf.install_gemv_table(name, json.dumps(doc))
        get = lambda m, sig=(32, 32), act=None, fmt="nvfp4", n=3584, k=18944: cf.tuned_gemv_config(  # noqa: E731
            fmt, n, k, m, sig, act, name)
        assert get(1) == get(2) == (8, 1, 4, 1) and get(3) == get(8) == (5, 1, 4, 1)
        assert get(9) == get(16) == (10, 1, 2, 2)  # M > 8: only the two-tile entries
        assert get(4, sig=None) == (6, 1, 2, 1) and get(8, sig=None) is None  # plain: its own entries (kept from old)
        assert get(8, sig=(96, 32)) is None and get(8, fmt="mxfp4") is None
        assert get(8, act="silu_mul", n=37888, k=3584) == (2, 2, 2, 2) and get(8, n=37888, k=3584) is None
        assert cf.tuned_gemv_config("nvfp4", 3584, 18944, 8, (32, 32), None, "other GPU") is None
        cf._STATE[("gemv", 0, "nvfp4", 8, 3584, 18944, None, None, True)] = (1, 1, 4, 1)
        doc["entries"][0]["config"] = [9, 1, 4, 1]
        cf.install_gemv_table(name, json.dumps(doc))  # a new table: cached choices are forgotten
        assert not any(k[0] == "gemv" for k in cf._STATE if isinstance(k, tuple) and k)
        doc["entries"][0]["config"] = [9, 2, 8, 1]
        cf.install_gemv_table(name, json.dumps(doc))
        with pytest.raises(ValueError, match="9 x 2 must be in"):
            cf.load_gemv_table(name)
    finally:
        cf._STATE.pop(("gemv_table", name), None)


def _lora(members, k: int, seed: int, device="cpu") -> cf.LoraOperand:
    """A LoRA operand with bf16 A (R, K) and each member's (scaling·B)ᵀ (rank, rows) laid out as Bn."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = sum(rk for _, rk in members)
    a = (torch.randn(r, k, generator=gen, device=device) / k ** 0.5).bfloat16()
    bts = [(0.05 * torch.randn(rk, nm, generator=gen, device=device)).bfloat16() if rk else None
           for nm, rk in members]
    return cf.LoraOperand(a, cf.lora_bn(bts, members), members)


def test_bf16_gemv_switch_and_cpu_dispatch(monkeypatch):
    """QERL_BF16_GEMV: auto (default), 1 and pdl on, 0 off, anything else refused by name; PDL by mode and M (off the
    GPU never); off the GPU the BF16 format's kernels decline (F.linear, the reference, runs: ``dense``)."""
    from qerl import kernels as qk
    from qerl.kernels import bf16_decode as bd
    from qerl.quant import get_format
    monkeypatch.delenv("QERL_BF16_GEMV", raising=False)
    assert qk.bf16_gemv_enabled()
    for v, on in (("pdl", True), ("0", False), ("1", True), ("auto", True)):
        monkeypatch.setenv("QERL_BF16_GEMV", v)
        assert qk.bf16_gemv_enabled() is on
        assert not bd._bf16_pdl(torch.zeros(1, 64))  # a CPU tensor: no PDL in any mode
    monkeypatch.setattr(bd, "pdl_enabled", lambda t: True)  # as on an sm_90 GPU
    for v, want in (("pdl", (True, True)), ("1", (False, False)), ("auto", (True, False))):
        monkeypatch.setenv("QERL_BF16_GEMV", v)
        assert (bd._bf16_pdl(torch.zeros(bd.BF16_PDL_MAX_M, 64)), bd._bf16_pdl(torch.zeros(8, 64))) == want, v
    monkeypatch.setenv("QERL_BF16_GEMV", "yes")
    with pytest.raises(ValueError, match="QERL_BF16_GEMV='yes'; valid: auto, 0, 1, pdl"):
        qk.bf16_gemv_enabled()
    monkeypatch.setenv("QERL_BF16_GEMV", "1")
    q = get_format("bf16").quantize(torch.randn(32, 64))
    x = torch.randn(2, 64).bfloat16()
    assert qk.backend_for("bf16", x, q) == "dense"
    assert torch.equal(qk.qmm(x, "bf16", q), F.linear(x, q["weight"]))
    assert get_format("bf16").kernels.linear_lora(get_format("bf16"), x, q, None) is None


def test_wgmma_lora_switch_and_rank_rule(monkeypatch):
    """LoRA in the GEMMs' epilogues: QERL_WGMMA_LORA (pdl default, 1, 0 off: the addmm; anything else refused by name),
    QERL_GEMM_LORA for the mma.sync kernel (pdl default, 1, 0), and only for ranks that are multiples of 8 (16-byte
    staging of t, whole Bn pairs)."""
    # both GEMMs' epilogues (under PDL by default): the other values, a bad one
    from qerl.kernels import switches as sw
    for name, mode, default, others, bad in (("QERL_WGMMA_LORA", sw.wgmma_lora_mode, "pdl", ("0", "1"), "yes"),
                                             ("QERL_GEMM_LORA", sw.mma_lora_mode, "pdl", ("0", "1"), "on")):
        monkeypatch.delenv(name, raising=False)
        assert mode() == default
        for v in others:
            monkeypatch.setenv(name, v)
            assert mode() == v
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}'; valid: 0, 1, pdl"):
            mode()
    assert cf.wgmma_lora_ok(_lora([(48, 32), (16, 16), (32, 48)], 128, seed=0))
    assert cf.wgmma_lora_ok(_lora([(48, 8), (16, 0), (32, 24)], 128, seed=0))
    assert not cf.wgmma_lora_ok(_lora([(48, 8), (16, 0), (32, 20)], 128, seed=0))  # 20: not a multiple of 8
    assert not cf.wgmma_lora_ok(_lora([(48, 4), (16, 4)], 128, seed=0))


def test_lora_operand_checks_and_launch_args():
    op = _lora([(48, 8), (16, 0), (32, 20)], 128, seed=0)
    assert op.rank == 28 and op.launch_args() == (48, 64, [0, 8, 8], [8, 0, 20])
    assert op.bn.shape == (96, 32) and not op.bn[:48, 8:].any() and not op.bn[48:64].any()  # zero past each rank
    one = _lora([(64, 16)], 128, seed=0)
    assert one.launch_args() == (64, 64, [0, 0, 0], [16, 0, 0]) and cf.lora_rp([(64, 16)]) == 16
    a, bn = one.a, one.bn
    with pytest.raises(ValueError, match="1 to 3 members"):
        cf.LoraOperand(a, bn, [(16, 4)] * 4)
    with pytest.raises(ValueError, match="do not match members"):
        cf.LoraOperand(a, bn, [(32, 16)])
    with pytest.raises(ValueError, match="do not match members"):  # Bn rows shorter than the rank
        cf.LoraOperand(torch.zeros(32, 128).bfloat16(), bn, [(64, 32)])
    with pytest.raises(ValueError, match="a multiple of 16"):
        cf.LoraOperand(a, bn, [(56, 8), (8, 8)])
    # each LoRA warp takes ~4 chunks of 64: 56 chunks over 8 warps -> 2 parts, 296 -> 10
    assert cf.lora_parts(96, 56) == 4 and cf.lora_parts(32, 296, warps=8) == 19 and cf.lora_parts(16, 1) == 1
    assert cf.lora_parts(96, 56, chunks_per_warp=4) == 2 and cf.lora_parts(32, 296, warps=16) == 10
    assert cf.lora_parts(384, 20000, warps=1) * 24 <= cf.LORA_MAX_UNITS  # at most 512 LoRA CTAs


def test_lora_workspace_sizes_agree_with_the_kernel_and_the_binding():
    """The kernel's workspace constants are the Python ones, and the binding checks for exactly what
    ``lora_workspace`` allocates (session 46 left its check at a removed build's larger size: every LoRA launch failed
    with "LoRA workspace too small", seen only on the GPU)."""
    src = (cf._CSRC / "fp4_mma_gemv.cu").read_text()
    units = int(re.search(r"constexpr int kLoraMaxUnits = (\d+);", src).group(1))
    strips = int(re.search(r"constexpr int kLoraMaxStrips = (\d+);", src).group(1))
    assert (units, 16 * strips) == (cf.LORA_MAX_UNITS, cf.LORA_MAX_RANKS)
    floats, ints = cf.lora_workspace_sizes()
    assert (floats, ints) == ((units + strips) * 256, 2 + strips)
    check = re.search(r"TORCH_CHECK\(part\.numel\(\) >= (\w+) && ctr\.numel\(\) >= (\w+), "
                      r'"LoRA workspace too small"\);', cf._BINDING)
    assert check is not None and (int(check.group(1)), int(check.group(2))) == (floats, ints)


def test_emulate_lora_uses_each_members_ranks():
    members = [(48, 8), (16, 0), (32, 5)]
    op = _lora(members, 128, seed=1)
    x = torch.randn(7, 128).bfloat16()
    t = (x.float() @ op.a.float().t()).bfloat16().float()  # the kernel's MMA operand
    bn = op.bn.float()
    ref = torch.cat([t[:, 0:8] @ bn[0:48, :8].t(), torch.zeros(7, 16), t[:, 8:13] @ bn[64:96, :5].t()], dim=1)
    torch.testing.assert_close(cf.emulate_lora(x, op), ref)
    q = _quant("nvfp4", 96, 128, seed=3)
    w = _prep("nvfp4", q)
    # one bf16 rounding of base + LoRA against rounding the base first: apart by <= 1 ulp of each addend (where
    # they cancel, relative to the small sum that is large: the tolerance scales with the addends, not the sum)
    base = cf.emulate(x, w).float()
    got, want = cf.emulate(x, w, op).float(), (base + ref).bfloat16().float()
    assert ((got - want).abs() <= 2**-7 * (base.abs() + ref.abs()) + 1e-3).all()
    assert not torch.allclose(got, base.bfloat16().float(), atol=1e-2)  # the LoRA term is there


def test_emulate_silu_mul_and_act_errors():
    """act="silu_mul": the emulator's SwiGLU of the gate|up halves is the unfused path's (GEMV output, then
    ``silu_mul_ref``); a bad epilogue or an odd number of 16-row blocks per half is refused by name."""
    from qerl.kernels import fused as fk
    q = _quant("nvfp4", 96, 128, seed=3)
    w = _prep("nvfp4", q)
    x = torch.randn(5, 128).bfloat16()
    op = _lora([(48, 8), (48, 8)], 128, seed=2)
    for lora in (None, op):
        y = cf.emulate(x, w, lora, act="silu_mul")
        assert y.shape == (5, 48) and y.dtype == torch.bfloat16
        assert torch.equal(y, fk.silu_mul_ref(cf.emulate(x, w, lora)))
    with pytest.raises(ValueError, match=r"act='gelu' is not an epilogue of the FP4 GEMV; valid: None, 'silu_mul'"):
        cf.emulate(x, w, act="gelu")
    with pytest.raises(ValueError, match=r"act='gelu'.*valid: None, 'silu_mul'"):
        cf.gemv(x, w, act="gelu")
    w80 = _prep("nvfp4", _quant("nvfp4", 80, 128, seed=4))
    with pytest.raises(ValueError, match=r"N/2 = 40 to be a multiple of 16"):
        cf.gemv(x, w80, act="silu_mul")


# ------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(16, 64), (48, 192), (64, 128), (128, 256), (512, 3584), (3584, 3584), (18944, 3584), (3584, 18944),
          (1024, 5120), (5120, 5120), (13824, 5120), (5120, 13824), (27648, 5120), (5120, 27648), (64, 27648)]


def _check(y: torch.Tensor, x: torch.Tensor, fmt: str, q: dict, w: cf.CudaFP4Weight, emu=None) -> None:
    """y vs F.linear(x, bf16 reference weight) (tolerance of the weight's bf16 rounding) and vs the emulator
    (same math, other fp32 summation order: one bf16 ulp plus fp32 rounding)."""
    wref = FORMATS[fmt].dequantize(q, torch.bfloat16)
    ref = F.linear(x, wref).float()
    mag = x.float().abs() @ wref.float().abs().t()
    y = y.float()
    assert torch.isfinite(y).all(), "unwritten or non-finite output"
    assert ((y - ref).abs() <= 1e-2 * ref.abs() + 2e-3 * mag).all(), float((y - ref).abs().max())
    emu = (cf.emulate(x, w) if emu is None else emu).float()
    assert ((y - emu).abs() <= 2**-7 * emu.abs() + 2e-5 * mag).all(), float((y - emu).abs().max())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_dequantize_relaid_matches_compressed_tensors(fmt):
    """The dense weight rebuilt from the re-laid-out copy alone equals the compressed-tensors dequantization
    (Triton ``dequantize_into``) bit for bit, on the Qwen shapes, in bf16 and float32."""
    from qerl import kernels as qk
    for i, (n, k) in enumerate(SHAPES):
        q = _quant(fmt, n, k, seed=300 + i, device="cuda")
        w = _prep(fmt, q)
        for dt in (torch.bfloat16, torch.float32):
            ref = qk.dequantize_into(fmt, q, torch.empty((n, k), device="cuda", dtype=dt))
            got = qk.dequantize_relaid(w, torch.full((n, k), float("nan"), device="cuda", dtype=dt))
            assert torch.equal(got, ref), (fmt, n, k, dt)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_cuda_dequantize_equals_triton_bit_for_bit(fmt):
    """The CUDA dequantization kernel (``cuda_fp4.dequantize``, what ``dequantize_relaid`` takes for a bf16 out)
    writes the Triton kernel's bits on every Qwen shape (chunk counts 1, 2, 3 and multiples of its 4-chunk warp
    tasks), on blocks with a zero scale and subnormal E4M3 scales (NVFP4) or scales set apart (MXFP4), into a
    row-strided out without touching the columns beside it."""
    from qerl import kernels as qk
    assert cf.available(), cf.build_error()
    for i, (n, k) in enumerate(SHAPES):
        w = _prep(fmt, _quant(fmt, n, k, seed=700 + i, device="cuda"))
        ref = qk.dequantize_relaid(w, torch.empty((n, k), device="cuda", dtype=torch.bfloat16), backend="triton")
        got = qk.dequantize_relaid(w, torch.full((n, k), float("nan"), device="cuda", dtype=torch.bfloat16))
        assert torch.equal(got, ref), (fmt, n, k)
    n, k = 48, 320  # 5 chunks: one full 4-chunk task and a 1-chunk tail per strip
    q = _quant(fmt, n, k, seed=799, device="cuda")
    sb = q["weight_scale"].view(torch.uint8)
    if fmt == "nvfp4":
        sb[0, :8] = torch.arange(8, dtype=torch.uint8, device="cuda")  # zero, then E4M3 subnormals 1..7
        sb[1, :4] = torch.tensor([0x80 | 3, 0x7E, 0x08, 0x01], dtype=torch.uint8, device="cuda")
    else:
        sb[0, :4] = torch.tensor([110, 118, 131, 127], dtype=torch.uint8, device="cuda")
    w = _prep(fmt, q)
    ref = qk.dequantize_relaid(w, torch.empty((n, k), device="cuda", dtype=torch.bfloat16), backend="triton")
    assert torch.equal(ref, FORMATS[fmt].dequantize(q, torch.bfloat16)), "the Triton kernel disagrees with the format"
    wide = torch.full((n, k + 72), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = cf.dequantize(w, wide[:, 8:8 + k])
    assert torch.equal(got, ref) and torch.isnan(wide[:, :8]).all() and torch.isnan(wide[:, 8 + k:]).all()
    with pytest.raises(ValueError, match="row stride a multiple of 8"):
        cf.dequantize(w, wide[:, 3:3 + k])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_relaid_dequant_mm_in_row_slices(fmt):
    """Large M from the kernels' layout: dequantize + cuBLAS in L2-sized row slices (the tuned table's
    ``cublas_chN``) gives the product of the whole dense weight, every output column written."""
    from qerl import kernels as qk
    g = torch.Generator(device="cuda").manual_seed(5)
    for i, (n, k) in enumerate(SHAPES):
        w = _prep(fmt, _quant(fmt, n, k, seed=500 + i, device="cuda"))
        x = torch.randn(512, k, device="cuda", generator=g).bfloat16()
        ref = x.float() @ qk.dequantize_relaid(w, torch.empty((n, k), device="cuda")).t()
        for chunk in (0, 1000, 2048):  # 1000: not a multiple of the 16-row strips
            out = torch.full((512, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            qk._relaid_dequant_mm(x, w, out, chunk)
            assert torch.isfinite(out).all() and ((out.float() - ref).norm() / ref.norm()) < 6e-3, (n, k, chunk)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_relaid_backward_in_column_slices(fmt, tmp_path, monkeypatch):
    """The backward g·Ŵ from the kernels' layout in column slices: the CUDA kernel reads a column slice's strided
    strips as the whole weight's columns (bit for bit), the sliced product matches the whole one, and ``qmm_t``
    slices as the device's slice table says (and not above its largest measured M)."""
    import json

    from qerl import kernels as qk
    from qerl.kernels import configs, relaid
    from qerl.kernels import dequant as kd
    g = torch.Generator(device="cuda").manual_seed(6)
    for i, (n, k) in enumerate(SHAPES):
        if k < 192:
            continue
        w = _prep(fmt, _quant(fmt, n, k, seed=600 + i, device="cuda"))
        whole = qk.dequantize_relaid(w, torch.empty((n, k), device="cuda", dtype=torch.bfloat16))
        c0, c1 = 64, k - 64 * (k // 192)
        part = cf.dequantize(kd._relaid_cols(w, c0, c1), torch.full((n, c1 - c0), float("nan"), device="cuda",
                                                                   dtype=torch.bfloat16))
        assert torch.equal(part, whole[:, c0:c1]), (n, k, "column slice")
        gr = torch.randn(384, n, device="cuda", generator=g).bfloat16()
        ref = gr.float() @ whole.float()
        for cols in (0, 1000, 2048):  # 1000: not a multiple of the 64-column chunks (-> 960)
            out = torch.full((384, k), float("nan"), device="cuda", dtype=torch.bfloat16)
            qk._relaid_dequant_mm(gr, w, out, cols, t=True)
            assert torch.isfinite(out).all() and ((out.float() - ref).norm() / ref.norm()) < 6e-3, (n, k, cols)
    # the dispatcher: a table entry for (bwd, 18944, 3584) at M 512 slices qmm_t there, the whole weight above
    name = torch.cuda.get_device_name()
    monkeypatch.setattr(configs, "_SLICE_DIR", tmp_path)
    configs._SLICE_TABLES.clear()
    try:
        configs.install_slice_table(name, json.dumps({"entries": [dict(op="bwd", N=18944, K=3584, M=512,
                                                                       slice=1024)]}))
        q = relaid.from_compressed(FORMATS[fmt], _quant(fmt, 18944, 3584, seed=650, device="cuda"))
        w = relaid.weight(FORMATS[fmt], q)
        whole = qk.dequantize_relaid(w, torch.empty((18944, 3584), device="cuda", dtype=torch.bfloat16)).float()
        calls, orig = [], qk._relaid_dequant_mm  # a spy: the real function runs, its slice width recorded
        monkeypatch.setattr(qk, "_relaid_dequant_mm", lambda *a, **k: calls.append((a[3], k)) or orig(*a, **k))
        for m in (500, 600):  # 500: the 512 entry (sliced); 600: above every measured M (whole)
            gr = torch.randn(2, m // 2, 18944, device="cuda", generator=g).bfloat16()
            y = qk.qmm_t(gr, fmt, q)
            ref = gr.float() @ whole
            assert y.shape == (2, m // 2, 3584) and ((y.float() - ref).norm() / ref.norm()) < 6e-3, m
        assert calls == [(1024, {"t": True})], calls
    finally:
        configs._SLICE_TABLES.clear()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_kernel_matches_reference(fmt):
    assert cf.available(), cf.build_error()
    g = torch.Generator(device="cuda").manual_seed(0)
    ms = (1, 2, 3, 4, 8, 9, 16)
    for i, (n, k) in enumerate(SHAPES):
        q = _quant(fmt, n, k, seed=100 + i, device="cuda")
        w = _prep(fmt, q)
        xs = torch.randn(sum(ms), k, device="cuda", generator=g).bfloat16().split(ms)
        emus = cf.emulate(torch.cat(xs), w).split(ms)  # one decode of the weight for every M
        for x, emu in zip(xs, emus, strict=True):
            out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = cf.gemv(x, w, out=out)
            assert y.data_ptr() == out.data_ptr()
            _check(y, x, fmt, q, w, emu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_every_config_and_layout(fmt):
    n, k = 112, 1536  # 7 strips, 24 chunks: uneven splits, partial batches, partial CTAs and strip groups
    q = _quant(fmt, n, k, seed=5, device="cuda")
    w = _prep(fmt, q)
    g = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 7, 12, 16):
        xb = torch.randn(m, k + 8, device="cuda", generator=g).bfloat16()
        for x in (xb[:, :k], xb[:, 4:k + 4]):  # strided rows; misaligned start (copied by gemv)
            for cfg in [(1, 1, 4, 1), (1, 4, 8, 1), (3, 2, 4, 1), (5, 3, 4, 1), (7, 1, 8, 1), (16, 1, 4, 1),
                        (8, 1, 8, 1), (2, 8, 4, 1), (1, 1, 2, 1), (3, 1, 2, 2), (1, 2, 4, 2), (2, 1, 2, 4),
                        (5, 1, 2, 4), (1, 3, 2, 4), (4, 2, 2, 2)]:
                for pdl in (False, True):
                    _check(cf.gemv(x, w, config=cfg, pdl=pdl), x.contiguous(), fmt, q, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_cuda_graph_replay(fmt):
    n, k = 3584, 3584
    q = _quant(fmt, n, k, seed=9, device="cuda")
    w = _prep(fmt, q)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda").bfloat16()
        cf.gemv(x, w)  # config + build outside capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            cf.gemv(x, w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = cf.gemv(x, w)
            y2 = cf.gemv(y[:, :k], w, pdl=True)  # consumes the previous launch's output (PDL edge)
        for _ in range(3):
            x.copy_(torch.randn(m, k, device="cuda").bfloat16())
            graph.replay()
            torch.cuda.synchronize()
            ref = cf.gemv(x, w)
            assert torch.equal(y, ref)
            assert torch.equal(y2, cf.gemv(ref[:, :k].contiguous(), w))


def _check_lora(y: torch.Tensor, x: torch.Tensor, w: cf.CudaFP4Weight, op: cf.LoraOperand, emu=None) -> None:
    """y vs the emulator with LoRA (other fp32 summation orders: one bf16 ulp plus fp32 rounding of both terms),
    and the counters left zero for the next launch."""
    torch.cuda.synchronize()
    emu = (cf.emulate(x, w, op) if emu is None else emu).float()
    mag = x.float().abs() @ cf.emulate_weight(w).abs().t().to(x.device)
    if w.global_scale is not None:
        mag = mag / w.global_scale.to(x.device)
    lmag = cf.emulate_lora(x.abs(), cf.LoraOperand(op.a.abs(), op.bn.abs(), op.members))
    y = y.float()
    assert torch.isfinite(y).all(), "unwritten or non-finite output"
    # + 2^-8 of the LoRA magnitude: t is rounded to bf16 for the MMA after an fp32 sum in another order (one ulp)
    assert ((y - emu).abs() <= 2**-7 * emu.abs() + 2e-5 * mag + 2**-8 * lmag).all(), float((y - emu).abs().max())
    assert not cf.lora_workspace(x.device)[1].any(), "the launch left its LoRA counters set"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_gemv_lora_every_config(fmt):
    """Base + LoRA in one launch: members whose boundaries fall inside CTAs, a member without ranks, R not a
    multiple of 16, every compiled variant and split setting, PDL on/off, M = 1..16."""
    n, k = 208, 1536  # 13 strips: members 112 | 48 | 48 rows
    q = _quant(fmt, n, k, seed=11, device="cuda")
    w = _prep(fmt, q)
    g = torch.Generator(device="cuda").manual_seed(3)
    ops = [_lora([(112, 16), (48, 8), (48, 24)], k, seed=4, device="cuda"),  # R = 48, RP = 32
           _lora([(112, 8), (48, 0), (48, 5)], k, seed=5, device="cuda"),
           _lora([(208, 32)], k, seed=6, device="cuda")]
    cfgs = [(1, 1, 4, 1), (1, 4, 8, 1), (3, 2, 4, 1), (5, 3, 4, 1), (16, 1, 4, 1), (2, 8, 4, 1), (1, 1, 2, 1),
            (3, 1, 2, 2), (1, 2, 4, 2), (2, 1, 2, 4), (1, 3, 2, 4), (4, 2, 2, 2)]
    # both ways of summing x·Aᵀ's K parts (the output warps; each strip's last LoRA CTA), with one strip per warp too
    modes = {(cf.lora_direct(cf.lora_parts(48, k // 64, s * p), sw), sw == 1) for s, p, _, sw in cfgs}
    assert modes == {(True, True), (False, True), (False, False)}, modes
    for m in (1, 7, 9, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        for op in ops:
            for cfg in cfgs:
                for pdl in (False, True):
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    _check_lora(cf.gemv(x, w, out=out, config=cfg, pdl=pdl, lora=op), x, w, op)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_gemv_silu_mul_epilogue(fmt):
    """act="silu_mul" (gate|up: warp takes row block i of both halves, SwiGLU in the epilogue) is bit-for-bit the
    GEMV's own output at the same configuration followed by torch's silu · up — with and without LoRA, every
    two-strips-per-warp variant and split setting (registers and shared-memory reductions), partial CTAs, M = 1..16,
    PDL on/off; at the default configuration on 7B's gate|up too; a config with one strip per warp is refused."""
    from qerl.kernels import fused as fk
    g = torch.Generator(device="cuda").manual_seed(5)
    n, k = 448, 1536  # 28 strips: 14 pairs; uneven splits, partial strip groups
    q = _quant(fmt, n, k, seed=21, device="cuda")
    w = _prep(fmt, q)
    ops = [None, _lora([(224, 16), (224, 16)], k, seed=7, device="cuda"),
           _lora([(224, 8), (224, 0)], k, seed=8, device="cuda")]
    cfgs = [(1, 1, 2, 2), (3, 1, 2, 2), (1, 2, 4, 2), (4, 2, 2, 2), (2, 3, 2, 2), (5, 1, 4, 2), (1, 5, 2, 2)]
    for m in (1, 5, 8, 9, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        for op in ops:
            for cfg in cfgs:
                for pdl in (False, True):
                    full = cf.gemv(x, w, config=cfg, lora=op)
                    out = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
                    y = cf.gemv(x, w, out=out, config=cfg, pdl=pdl, lora=op, act="silu_mul")
                    assert y.data_ptr() == out.data_ptr()
                    assert torch.equal(y, fk.silu_mul_ref(full)), (m, cfg, pdl, op is None)
                    if op is not None:
                        assert not cf.lora_workspace(x.device)[1].any()
            y = cf.gemv(x, w, lora=op, act="silu_mul").float()  # the default configuration for the epilogue
            emu = cf.emulate(x, w, op, act="silu_mul").float()
            ge, ue = cf.emulate(x, w, op).float().chunk(2, dim=-1)  # one bf16 ulp on gate and up, then SwiGLU
            bound = 2**-5 * (ge.abs() + 1e-2) * (ue.abs() + 1e-2) + 2**-7 * emu.abs()
            assert ((y - emu).abs() <= bound).all(), float((y - emu).abs().max())
    with pytest.raises(ValueError, match="two strips per warp"):
        cf.gemv(x, w, config=(1, 1, 4, 1), act="silu_mul")
    q = _quant(fmt, 2 * 18944, 3584, seed=22, device="cuda")  # 7B gate|up with rank-32 LoRA
    w = _prep(fmt, q)
    op = _lora([(18944, 32), (18944, 32)], 3584, seed=9, device="cuda")
    for m in (1, 8, 16):
        x = torch.randn(m, 3584, device="cuda", generator=g).bfloat16()
        cfg = cf._config(w, m, x.device, op, "silu_mul")
        assert torch.equal(cf.gemv(x, w, lora=op, act="silu_mul"), fk.silu_mul_ref(cf.gemv(x, w, config=cfg, lora=op)))


def _graph_chain_replay(w: cf.CudaFP4Weight, op: cf.LoraOperand, g: torch.Generator, launches: int,
                        check=None) -> None:
    """A captured graph of ``launches`` LoRA GEMVs on w (K = N), each consuming the previous output (PDL edges after
    the first), replayed three times on fresh x (8 rows): every output equals the eager chain bit for bit;
    ``check(first output, x)`` after each replay."""
    x = torch.randn(8, w.k, device="cuda", generator=g).bfloat16()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cf.gemv(x, w, lora=op)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [cf.gemv(x, w, lora=op)]
        for _ in range(launches - 1):
            ys.append(cf.gemv(ys[-1], w, pdl=True, lora=op))
    for _ in range(3):
        x.copy_(torch.randn(8, w.k, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        r = x
        for y in ys:
            r = cf.gemv(r, w, lora=op)
            assert torch.equal(y, r)
        if check is not None:
            check(ys[0], x)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_gemv_lora_model_shapes_and_graphs(fmt):
    """Qwen2.5-7B's fused q|k|v, gate|up and down_proj with rank-32 LoRA at the default configuration, then a
    captured graph of consecutive LoRA launches (PDL edges, each consuming the previous output) replayed."""
    g = torch.Generator(device="cuda").manual_seed(7)
    for i, (members, k) in enumerate([([(3584, 32), (512, 32), (512, 32)], 3584), ([(18944, 32), (18944, 32)], 3584),
                                      ([(3584, 32)], 18944)]):
        n = sum(nm for nm, _ in members)
        q = _quant(fmt, n, k, seed=300 + i, device="cuda")
        w = _prep(fmt, q)
        op = _lora(members, k, seed=i, device="cuda")
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            _check_lora(cf.gemv(x, w, lora=op), x, w, op)
    n = k = 1024
    q = _quant(fmt, n, k, seed=9, device="cuda")
    w = _prep(fmt, q)
    op = _lora([(512, 16), (256, 16), (256, 16)], k, seed=8, device="cuda")
    _graph_chain_replay(w, op, g, 3, check=lambda y1, x: _check_lora(y1, x, w, op))



@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_gemv_every_config_lora_epilogue_graphs(monkeypatch):
    """The GEMV over a dense BF16 weight (format "bf16", ``dense_weight``: the stored rows, no copy): against a
    float64 product at the Qwen shapes and M = 1..16; every compiled BF16 variant and split setting with and without
    LoRA (members inside CTAs, a member without ranks) and PDL; the SwiGLU epilogue bit for bit the GEMV then
    ``silu_mul_ref``; a weight that is a row view of a larger buffer ([W; A], as ``reserve_lora_rows`` makes);
    graph replay of consecutive PDL launches; and the BF16 format's dispatch (``cuda_gemv`` up to M = 16, cuBLAS
    above and with ``QERL_BF16_GEMV=0``)."""
    from qerl import kernels as qk
    from qerl.kernels import fused as fk
    from qerl.quant import get_format
    assert cf.available(), cf.build_error()
    g = torch.Generator(device="cuda").manual_seed(11)

    def check(y, x, w, op=None):
        torch.cuda.synchronize()
        ref = x.double() @ w.qweight.double().t()
        mag = x.double().abs() @ w.qweight.double().abs().t()
        lmag = torch.zeros_like(mag)
        if op is not None:
            ref = ref + cf.emulate_lora(x, op).double()
            lmag = cf.emulate_lora(x.abs(), cf.LoraOperand(op.a.abs(), op.bn.abs(), op.members)).double()
            assert not cf.lora_workspace(x.device)[1].any(), "the launch left its LoRA counters set"
        y = y.double()
        assert torch.isfinite(y).all(), "unwritten or non-finite output"
        # one bf16 rounding of the result (2^-9 relative), fp32 sums in another order, t rounded to bf16 for its MMA
        bound = 2 ** -8 * ref.abs() + 4e-5 * mag + 2 ** -8 * lmag + 1e-6
        assert ((y - ref).abs() <= bound).all(), float((y - ref).abs().max())

    for n, k in SHAPES:
        w = cf.dense_weight((torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16())
        for m in (1, 3, 8, 9, 16):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            assert cf.gemv(x, w, out=out).data_ptr() == out.data_ptr()
            check(out, x, w)
    n, k = 208, 1536  # 13 strips, 24 chunks: members 112 | 48 | 48 rows; uneven splits, partial batches and CTAs
    buf = (torch.randn(n + 48, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    w = cf.dense_weight(buf[:n])  # the rows of a [W; A] buffer
    ops = [None, _lora([(112, 16), (48, 8), (48, 24)], k, seed=4, device="cuda"),
           _lora([(112, 8), (48, 0), (48, 5)], k, seed=5, device="cuda")]
    ops[1] = cf.LoraOperand(buf[n:], ops[1].bn, ops[1].members)  # A = the buffer's spare rows
    cfgs = [(1, 1, 2, 1), (4, 2, 2, 1), (3, 1, 2, 1), (8, 1, 2, 1), (1, 8, 2, 1), (1, 1, 4, 1), (5, 1, 4, 1),
            (2, 4, 4, 1), (1, 1, 2, 2), (3, 1, 2, 2), (2, 4, 2, 2), (8, 1, 2, 2)]
    for m in (1, 7, 9, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        for op in ops:
            for cfg in cfgs:
                for pdl in (False, True):
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    check(cf.gemv(x, w, out=out, config=cfg, pdl=pdl, lora=op), x, w, op)
    with pytest.raises(RuntimeError, match="unsupported configuration"):  # (8, 1) is an FP4 variant only
        cf._ext().gemv(x, buf[:n], buf[:0].view(torch.int16), buf, torch.empty(16, n, device="cuda",
                       dtype=torch.bfloat16), 2, 1.0, 0, 1, 1, 8, 1, False, 0)
    # SwiGLU epilogue: 14 row pairs
    n2 = 448
    w2 = cf.dense_weight((torch.randn(n2, k, device="cuda", generator=g) / k ** 0.5).bfloat16())
    for m in (1, 8, 9, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        for op in (None, _lora([(224, 16), (224, 16)], k, seed=7, device="cuda")):
            for cfg in [(1, 1, 2, 2), (3, 1, 2, 2), (2, 3, 2, 2), (1, 5, 2, 2)]:
                full = cf.gemv(x, w2, config=cfg, lora=op)
                y = cf.gemv(x, w2, config=cfg, pdl=True, lora=op, act="silu_mul")
                assert torch.equal(y, fk.silu_mul_ref(full)), (m, cfg, op is None)
    # graph replay: consecutive launches, each consuming the previous output under PDL
    n = k = 1024
    w = cf.dense_weight((torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16())
    op = _lora([(512, 16), (256, 16), (256, 16)], k, seed=8, device="cuda")
    _graph_chain_replay(w, op, g, 2)
    # the format's dispatch: the GEMV at decode size, cuBLAS above it and when switched off
    fmt = get_format("bf16")
    q = fmt.quantize(torch.randn(3584 + 1024, 3584, device="cuda", generator=g) / 60)
    for m, want in ((1, "cuda_gemv"), (16, "cuda_gemv"), (17, "dense")):
        x = torch.randn(m, 3584, device="cuda", generator=g).bfloat16()
        assert qk.backend_for("bf16", x, q) == want, (m, want)
        y = qk.qmm(x, "bf16", q)
        if want == "cuda_gemv":
            assert torch.equal(y, cf.gemv(x, cf.dense_weight(q["weight"])))
        else:
            assert torch.equal(y, F.linear(x, q["weight"]))
    monkeypatch.setenv("QERL_BF16_GEMV", "0")
    x = torch.randn(8, 3584, device="cuda", generator=g).bfloat16()
    assert qk.backend_for("bf16", x, q) == "dense" and torch.equal(qk.qmm(x, "bf16", q), F.linear(x, q["weight"]))

GEMM_MS = (17, 24, 31, 32, 33, 64, 100, 128, 256, 512, 1000, 4096)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_gemm_matches_reference(fmt):
    """The M > 16 kernel at its default configuration over the Qwen2.5 3B-32B shapes and M = 17..4096."""
    assert cf.available(), cf.build_error()
    g = torch.Generator(device="cuda").manual_seed(0)
    for i, (n, k) in enumerate(SHAPES):
        q = _quant(fmt, n, k, seed=200 + i, device="cuda")
        w = _prep(fmt, q)
        for m in GEMM_MS if n * k <= 4096 * 4096 else (17, 64, 300):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = cf.gemm(x, w, out=out)
            assert y.data_ptr() == out.data_ptr()
            _check(y, x, fmt, q, w)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_gemm_every_config_and_layout(fmt):
    n, k = 112, 1536  # 7 strips, 24 chunks: partial strip groups, uneven K splits, partial token tiles
    q = _quant(fmt, n, k, seed=6, device="cuda")
    w = _prep(fmt, q)
    g = torch.Generator(device="cuda").manual_seed(2)
    cfgs = [(nt, sw, r, ks) for nt, sw, r in cf.gemm_variants() for ks in (1, 2, 3, 5, 8)
            if r * ks <= cf.GEMM_MAX_WARPS and cf.gemm_smem_bytes(nt, sw, r, ks) <= cf.GEMM_SMEM_MAX]
    assert len(cfgs) > 50 and any(c[0] == 16 and c[3] > 1 for c in cfgs) and any(c[2] == 1 for c in cfgs)
    for m in (1, 17, 40, 129):
        xb = torch.randn(m, k + 8, device="cuda", generator=g).bfloat16()
        for x in (xb[:, :k], xb[:, 8:k + 8], xb[:, 4:k + 4]):  # strided rows; misaligned start (copied)
            emu = cf.emulate(x.contiguous(), w)
            for cfg in cfgs:
                _check(cf.gemm(x, w, config=cfg), x.contiguous(), fmt, q, w, emu)


def _gemm_lora_case(fmt: str):
    """The GEMM LoRA tests' weight and operands: 208 rows (13 strips: members 112 | 48 | 48 rows, boundaries inside a
    warp's strips), K 1536; LoRA with R = 96, with ranks of 8 / 0 / 24 (a member without ranks, a partial 16-rank
    block), one member of rank 64. Returns (q, w, ops, k)."""
    n, k = 208, 1536
    q = _quant(fmt, n, k, seed=12, device="cuda")
    ops = [_lora([(112, 32), (48, 16), (48, 48)], k, seed=7, device="cuda"),  # R = 96
           _lora([(112, 8), (48, 0), (48, 24)], k, seed=8, device="cuda"),
           _lora([(208, 64)], k, seed=9, device="cuda")]
    return q, _prep(fmt, q), ops, k


def _check_gemm_lora_configs(w, ops, cfgs, ms, g) -> None:
    """cf.gemm with each LoRA operand and config against the emulator, at each M (fresh tokens per M)."""
    for m in ms:
        x = torch.randn(m, w.k, device="cuda", generator=g).bfloat16()
        for op in ops:
            emu = cf.emulate(x, w, op)
            for cfg in cfgs:
                _check_lora(cf.gemm(x, w, config=cfg, lora=op), x, w, op, emu)


def _check_graph_replay(launch, x, eager=None, g=None) -> None:
    """launch() captured in a CUDA graph: after each of two replays on new tokens written into x, its output equals
    eager() (the same product launched without the graph; launch() itself by default)."""
    eager = eager or launch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = launch()
    for _ in range(2):
        x.copy_(torch.randn(*x.shape, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager())


def _check_gemm_lora_graph(w, op, cfg, x) -> None:
    """cf.gemm with LoRA captured in a CUDA graph: two replays on new tokens equal the eager launch."""
    cf.gemm(x, w, config=cfg, lora=op)
    _check_graph_replay(lambda: cf.gemm(x, w, config=cfg, lora=op), x)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_mma_gemm_kz_splits_k_across_ctas(fmt, monkeypatch):
    """QERL_GEMM_KZ=1's build (session 68's experiment): kz = 1 gives the default build's output bit for bit; kz = 2,
    3, 4 (K split across CTAs as well, uneven splits, partial token tiles and strip groups) match the emulator with and
    without LoRA, are deterministic, leave the tile counters at zero, and replay in a CUDA graph; kz is refused in the
    default build, under PDL and past the chunks, by name."""
    q, w, ops, k = _gemm_lora_case(fmt)  # 13 strips, 24 chunks
    g = torch.Generator(device="cuda").manual_seed(68)
    cfgs = [(4, 2, 2, 2), (4, 2, 1, 8), (2, 1, 4, 2), (8, 1, 2, 1), (16, 1, 2, 2)]
    x = torch.randn(40, k, device="cuda", generator=g).bfloat16()
    monkeypatch.setenv("QERL_GEMM_KZ", "0")
    with pytest.raises(ValueError, match="kz=2 .* needs a QERL_GEMM_KZ=1 build \\(this one: False\\)"):
        cf.gemm(x, w, config=cfgs[0], kz=2)
    base = {(m, c): cf.gemm(xm, w, config=c) for m, xm in ((17, x[:17]), (40, x)) for c in cfgs}
    monkeypatch.setenv("QERL_GEMM_KZ", "1")
    for (m, c), ref in base.items():
        assert torch.equal(cf.gemm(x[:m], w, config=c), ref), (m, c)  # kz = 1: the default kernel's bits
    for m in (17, 40):
        xm = x[:m].contiguous()
        emu, emu_l = cf.emulate(xm, w), cf.emulate(xm, w, ops[0])
        for c in cfgs:
            for kz in (2, 3, 4):
                if kz * c[3] > k // 64:
                    continue
                y = cf.gemm(xm, w, config=c, kz=kz)
                _check(y, xm, fmt, q, w, emu)
                assert torch.equal(cf.gemm(xm, w, config=c, kz=kz), y), (m, c, kz)
                _check_lora(cf.gemm(xm, w, config=c, kz=kz, lora=ops[0]), xm, w, ops[0], emu_l)
    torch.cuda.synchronize()
    assert not cf._wgmma_counters(x.device).any()
    _check_graph_replay(lambda: cf.gemm(x, w, config=(4, 2, 2, 2), kz=3), x)
    with pytest.raises(ValueError, match="kz=9 .* 1 <= kz <= 8"):
        cf.gemm(x, w, config=cfgs[0], kz=9)
    with pytest.raises(ValueError, match="kz=4 .* kz \\* ks <= 24 chunks"):
        cf.gemm(x, w, config=(4, 2, 1, 8), kz=4)
    t = torch.nn.functional.linear(x, ops[0].a)
    with pytest.raises(ValueError, match="kz=2 .* no pdl"):
        cf.gemm(x, w, config=cfgs[0], kz=2, lora=ops[0], t=t, pdl=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_mma_gemm_lora(fmt, monkeypatch):
    """LoRA in the mma.sync GEMM's epilogue (cf.gemm(lora=...) with an mma.sync config): member boundaries inside a
    warp's strips, a member without ranks, R = 96 and ranks of 8 / 24 (a partial 16-rank block), every compiled
    variant with K splits, partial token tiles, a given t equal to the default one, CUDA-graph replay; under PDL right
    after lora_a(trigger=True) (the main loop overlapping it) equal to the plain launch, eagerly and replayed in a
    graph; the dispatcher where the mma.sync kernel serves the M with QERL_GEMM_LORA=pdl (the default; t by the
    Triton kernel) and 1, t by cuBLAS with QERL_LORA_A_MAX_M=16, and None (the caller's addmm) with QERL_GEMM_LORA=0."""
    from qerl import kernels as qk
    from qerl.kernels import fused as fk
    q, w, ops, k = _gemm_lora_case(fmt)
    g = torch.Generator(device="cuda").manual_seed(7)
    cfgs = [(nt, sw, r, ks) for nt, sw, r in cf.gemm_variants() for ks in (1, 3)
            if r * ks <= cf.GEMM_MAX_WARPS and cf.gemm_smem_bytes(nt, sw, r, ks) <= cf.GEMM_SMEM_MAX]
    assert len(cfgs) > 20
    _check_gemm_lora_configs(w, ops, cfgs, (17, 40, 130), g)
    op, cfg = ops[0], (4, 2, 2, 2)
    x = torch.randn(32, k, device="cuda", generator=g).bfloat16()
    t = torch.nn.functional.linear(x, op.a)
    assert torch.equal(cf.gemm(x, w, config=cfg, lora=op, t=t), cf.gemm(x, w, config=cfg, lora=op))
    with pytest.raises(ValueError, match="t must be bf16 \\(32, 96\\)"):
        cf.gemm(x, w, config=cfg, lora=op, t=t[:, :64])
    _check_gemm_lora_graph(w, op, cfg, x)
    with pytest.raises(ValueError, match="pdl=True needs lora, a given t and, for a wgmma config"):
        cf.gemm(x, w, config=cfg, lora=op, pdl=True)
    # under PDL after the trigger: the same bits, eagerly (every token tile count) and in a graph on new tokens
    monkeypatch.delenv("QERL_LORA_A_MAX_M", raising=False)  # 256: t by the Triton kernel up to 256 tokens
    for m in (17, 32, 64):
        xm = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        for c in ((4, 2, 2, 2), (4, 2, 1, 8), (8, 1, 2, 4)):
            ref = cf.gemm(xm, w, config=c, lora=op, t=fk.lora_a(xm, op.a))
            for _ in range(2):
                assert torch.equal(cf.gemm(xm, w, config=c, lora=op, t=fk.lora_a(xm, op.a, trigger=True), pdl=True),
                                   ref)
    _check_graph_replay(lambda: cf.gemm(x, w, config=cfg, lora=op, t=fk.lora_a(x, op.a, trigger=True), pdl=True),
                        x, lambda: cf.gemm(x, w, config=cfg, lora=op, t=fk.lora_a(x, op.a)), g)  # the same t rounding
    # the dispatcher at an M the mma.sync kernel serves (forced onto the CUDA GEMM; the heuristic's pick at 24 tokens)
    monkeypatch.setenv("QERL_CUDA_GEMM", "1")
    x = torch.randn(24, k, device="cuda", generator=g).bfloat16()
    assert cf._gemm_config(w, 24, x.device)[1] > 0
    monkeypatch.delenv("QERL_GEMM_LORA", raising=False)  # pdl: in the epilogue, t by the Triton kernel
    for mode, max_m in (("pdl", "64"), ("1", "64"), ("pdl", "16")):  # 16: t by cuBLAS
        monkeypatch.setenv("QERL_GEMM_LORA", mode)
        monkeypatch.setenv("QERL_LORA_A_MAX_M", max_m)
        _check_lora(qk.FP4.linear_lora(FORMATS[fmt], x, q, op), x, w, op)
    monkeypatch.setenv("QERL_GEMM_LORA", "0")
    assert qk.FP4.linear_lora(FORMATS[fmt], x, q, op) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_wgmma_gemm_lora_pdl(fmt, monkeypatch):
    """QERL_WGMMA_LORA=pdl: the build whose wgmma LoRA variants wait (griddepcontrol.wait) after each main loop; the
    tokens permuted first (cf.permute_tokens, the reference permutation), then t = lora_a(trigger=True) (one Triton
    launch up to QERL_LORA_A_MAX_M=256 tokens, tiles of 64 rows), then the GEMM under PDL: bit-identical to the plain
    launch with the same t for every wgmma configuration (CTA splits and stream-K, whose fp32 partials are stored only
    after the wait) at 17-256 tokens, and both equal to the launch of the build without the waits (QERL_WGMMA_LORA=1;
    both builds load side by side in one process), and in a CUDA graph on new tokens; the dispatcher's pdl path;
    refused by the build without the waits and without xp."""
    if not cf.wgmma_supported():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    from qerl import kernels as qk
    from qerl.kernels import fused as fk
    q, w, ops, k = _gemm_lora_case(fmt)
    g = torch.Generator(device="cuda").manual_seed(5)
    op, cfgs = ops[0], cf.wgmma_configs(w.n // 16, k // 64)
    x = torch.randn(130, k, device="cuda", generator=g).bfloat16()
    xp = cf.permute_tokens(x)
    assert torch.equal(xp, cf.permute_x_reference(x))
    monkeypatch.setenv("QERL_WGMMA_LORA", "1")  # the build without waits: a PDL launch refused
    with pytest.raises(RuntimeError, match="unsupported device or configuration"):
        cf.gemm(x, w, config=cfgs[0], lora=op, t=fk.lora_a(x, op.a), pdl=True, xp=xp)
    with pytest.raises(ValueError, match="for a wgmma config \\(sw <= 0\\), the permuted xp"):
        cf.gemm(x, w, config=cfgs[0], lora=op, t=fk.lora_a(x, op.a), pdl=True)
    monkeypatch.setenv("QERL_LORA_A_MAX_M", "256")
    cases = []
    for m in (17, 64, 130, 256):  # the references by the build without the waits
        xm = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        t = fk.lora_a(xm, op.a)
        cases.append((m, xm, t, {c: cf.gemm(xm, w, config=c, lora=op, t=t) for c in cfgs}))
    monkeypatch.setenv("QERL_WGMMA_LORA", "pdl")
    for m, xm, t, refs in cases:
        for c, ref in refs.items():
            assert torch.equal(cf.gemm(xm, w, config=c, lora=op, t=t), ref), (m, c)  # the PDL build, plain launch
            for _ in range(2):
                xpm = cf.permute_tokens(xm)
                got = cf.gemm(xm, w, config=c, lora=op, t=fk.lora_a(xm, op.a, trigger=True), pdl=True, xp=xpm)
                assert torch.equal(got, ref), (m, c)
    cfg = (8, -2, 1, 2)  # two CTAs per output tile: fp32 partials in the workspace
    _check_graph_replay(lambda: cf.gemm(x, w, config=cfg, lora=op, t=fk.lora_a(x, op.a, trigger=True), pdl=True,
                                        xp=cf.permute_tokens(x)),
                        x, lambda: cf.gemm(x, w, config=cfg, lora=op, t=fk.lora_a(x, op.a)), g)
    monkeypatch.setenv("QERL_CUDA_GEMM", "1")  # the dispatcher (the heuristic's wgmma config at 130 tokens)
    assert cf._gemm_config(w, 130, x.device)[1] <= 0
    _check_lora(qk.FP4.linear_lora(FORMATS[fmt], x, q, op), x, w, op)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_gemm_graph_replay_and_dispatch(fmt, monkeypatch):
    from qerl import kernels as qk
    n, k = 3584, 3584
    q = _quant(fmt, n, k, seed=19, device="cuda")
    w = _prep(fmt, q)
    for m in (24, 64, 256):
        x = torch.randn(m, k, device="cuda").bfloat16()
        cf.gemm(x, w)  # config + build outside capture
        _check_graph_replay(lambda x=x: cf.gemm(x, w), x)
        # the dispatcher: forced on, it takes this path (same bits); off, the previous path (same values)
        monkeypatch.setenv("QERL_CUDA_GEMM", "1")
        assert qk.backend_for(fmt, x, q) == "cuda_gemm"
        assert torch.equal(qk.qmm(x, fmt, q), cf.gemm(x, qk._cuda_weight(qk.get_format(fmt), q)))
        monkeypatch.setenv("QERL_CUDA_GEMM", "0")
        assert qk.backend_for(fmt, x, q) in ("triton_gemm", "dequant_cublas")
        wref = FORMATS[fmt].dequantize(q, torch.bfloat16)  # the previous path: its own rounding, not the emulator's
        ref, y = F.linear(x, wref).float(), qk.qmm(x, fmt, q).float()
        assert ((y - ref).abs() <= 1e-2 * ref.abs() + 2e-3 * (x.float().abs() @ wref.float().abs().t())).all()
        monkeypatch.delenv("QERL_CUDA_GEMM")


def _check_build_bit_identical(fmt, monkeypatch, switch: str, on: str, case, cfgs, seed: int) -> None:
    """The build that ``switch=on`` selects gives the output of ``switch=0``'s bit for bit at every config of cfgs,
    without LoRA and with the first two operands of ``case`` (``_gemm_lora_case``), at M = 17, 40, 100, 130 and 300
    (fresh tokens per M); with it on, (16, 0, 2, 2) matches the emulator with and without LoRA, and in a CUDA graph."""
    q, w, ops, k = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    for m in (17, 40, 100, 130, 300):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        for op in (None, *ops[:2]):
            for cfg in cfgs:
                monkeypatch.setenv(switch, "0")
                ref = cf.gemm(x, w, config=cfg, lora=op)
                monkeypatch.setenv(switch, on)
                got = cf.gemm(x, w, config=cfg, lora=op)
                assert torch.equal(got, ref), (m, cfg, op is None)
        monkeypatch.setenv(switch, on)
        _check(cf.gemm(x, w, config=(16, 0, 2, 2)), x, fmt, q, w)
        _check_lora(cf.gemm(x, w, config=(16, 0, 2, 2), lora=ops[0]), x, w, ops[0])
    _check_gemm_lora_graph(w, ops[0], (16, 0, 2, 2), torch.randn(130, k, device="cuda").bfloat16())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_wgmma_tma_is_bit_identical(fmt, monkeypatch):
    """QERL_WGMMA_TMA=1's build (the default: the grid variants of 128+ tokens a CTA stage their chunks by tensor
    copies on mbarriers) gives the output of QERL_WGMMA_TMA=0's (cp.async) bit for bit: every wgmma config (K split
    inside CTAs, across CTAs, stream-K, which keeps cp.async), with and without LoRA, token tiles partial or past M
    (the copies' zero fill), strips past the weight's last (13 strips), odd and even chunk counts per split; in a CUDA
    graph; and matches the emulator."""
    if not cf.wgmma_supported():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    if cf.wgmma_pipe() != 2:  # a pipe-1 build has no tensor-copy path: TMA=1 is its clear error (the SASS test)
        pytest.skip(f"QERL_WGMMA_TMA=1 needs QERL_WGMMA_PIPE=2; this run has pipe {cf.wgmma_pipe()}")
    q, w, ops, k = _gemm_lora_case(fmt)
    cfgs = cf.wgmma_configs(w.n // 16, k // 64)
    assert any(c[1] < 0 for c in cfgs) and any(c[1] == cf.WGMMA_SK for c in cfgs), cfgs
    _check_build_bit_identical(fmt, monkeypatch, "QERL_WGMMA_TMA", "1", (q, w, ops, k), cfgs, seed=41)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_wgmma_stsm_is_bit_identical(fmt, monkeypatch):
    """QERL_WGMMA_STSM=1's build (session 72's experiment: the epilogue through shared memory, 16-byte stores) gives
    the default build's output bit for bit at every wgmma config, with and without LoRA (``_check_build_bit_identical``),
    and into an out whose rows are 16-byte aligned with a wider row stride (the staged stores), start 2 bytes off or
    have a row stride that is no multiple of 8 (both: the plain stores), the columns around it untouched."""
    if not cf.wgmma_supported():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    q, w, ops, k = _gemm_lora_case(fmt)
    cfgs = cf.wgmma_configs(w.n // 16, k // 64)
    _check_build_bit_identical(fmt, monkeypatch, "QERL_WGMMA_STSM", "1", (q, w, ops, k), cfgs, seed=72)
    x = torch.randn(130, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(73)).bfloat16()
    for off, extra in ((8, 16), (1, 8), (0, 4)):
        for op in (None, ops[0]):
            monkeypatch.setenv("QERL_WGMMA_STSM", "0")
            ref = cf.gemm(x, w, config=(16, 0, 2, 2), lora=op)
            monkeypatch.setenv("QERL_WGMMA_STSM", "1")
            wide = torch.full((130, w.n + extra), float("nan"), device="cuda", dtype=torch.bfloat16)
            out = wide[:, off:off + w.n]
            cf.gemm(x, w, out=out, config=(16, 0, 2, 2), lora=op)
            assert torch.equal(out, ref), (off, extra, op is None)
            assert wide[:, :off].isnan().all() and wide[:, off + w.n:].isnan().all(), (off, extra)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_wgmma_tail_split(fmt, monkeypatch):
    """QERL_WGMMA_TAIL=1's build (the default since session 50) gives QERL_WGMMA_TAIL=0's output bit for bit at every
    config (``_check_build_bit_identical``); and a tail-split config (nt, wgmma_tail_sw(kt), r, ks) gives, tile by
    tile (``cf.wgmma_tail_ctas`` over the device's wave), the output of (nt, 0, r, ks) on the tiles it runs whole and
    of (nt, 1 - kt, r, ks) on the split ones, bit for bit: with and without LoRA, a partial token tile and a partial
    row block, a last wave of a few tiles; in a CUDA graph too (the tile counters left at zero)."""
    if not cf.wgmma_supported():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    case = _gemm_lora_case(fmt)
    monkeypatch.setenv("QERL_WGMMA_TAIL", "0")
    cfgs = cf.wgmma_configs(13, 24)  # the default build's (no tail splits)
    _check_build_bit_identical(fmt, monkeypatch, "QERL_WGMMA_TAIL", "1", case, cfgs, seed=50)
    monkeypatch.setenv("QERL_WGMMA_TAIL", "1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k, m = 16 * ((sms // 2 + 3) * 8 - 3), 512, 130  # 128-row blocks: sms / 2 + 3, the last partial
    q = _quant(fmt, n, k, seed=51, device="cuda")
    w = _prep(fmt, q)
    op = _lora([(n - 16 * 40, 16), (16 * 40, 8)], k, seed=52, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(53)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    split_seen = 0
    for nt, r, ks in [(16, 2, 2), (16, 2, 1), (8, 1, 2)]:
        tx, rows = -(-m // (8 * nt)), 64 * r
        tiles = cf.wgmma_tiles(m, n // 16, nt, r)
        for lora in (None, op):
            wave = cf.wgmma_ctas(fmt, 8 * nt, r, ks, lora is not None)
            whole = cf.gemm(x, w, config=(nt, 0, r, ks), lora=lora)
            for kt in range(2, cf.WGMMA_MAX_KZ + 1):
                if kt * ks > k // 64:
                    continue
                want = whole.clone()
                parts = cf.gemm(x, w, config=(nt, 1 - kt, r, ks), lora=lora)
                for t in sorted({t for t, _, splits in cf.wgmma_tail_ctas(tiles, wave, kt) if splits > 1}):
                    bx, by = t % tx, t // tx
                    tok, row = slice(8 * nt * bx, 8 * nt * (bx + 1)), slice(rows * by, rows * (by + 1))
                    want[tok, row] = parts[tok, row]
                    split_seen += 1
                cfg = (nt, cf.wgmma_tail_sw(kt), r, ks)
                got = cf.gemm(x, w, config=cfg, lora=lora)
                assert torch.equal(got, want), (cfg, lora is None, tiles, wave)
                assert torch.equal(cf.gemm(x, w, config=cfg, lora=lora), want), cfg  # the counters were left at 0
    assert split_seen > 0
    _check_gemm_lora_graph(w, op, (16, cf.wgmma_tail_sw(4), 2, 2), x)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_wgmma_gemm_every_variant(fmt):
    """The sm_90a wgmma kernel, every compiled variant: partial row blocks (7 strips), uneven K splits, partial token
    tiles, strided and misaligned x; the CUDA permutation equals the reference one bit for bit."""
    if not cf.wgmma_supported():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    n, k = 112, 1536
    q = _quant(fmt, n, k, seed=7, device="cuda")
    w = _prep(fmt, q)
    g = torch.Generator(device="cuda").manual_seed(4)
    cfgs = cf.wgmma_configs(n // 16, k // 64)
    assert len(cfgs) > len(cf.WGMMA_VARIANTS) and any(c[1] == 1 - cf.WGMMA_MAX_KZ for c in cfgs)
    for m in (1, 17, 40, 129, 300):
        xb = torch.randn(m, k + 8, device="cuda", generator=g).bfloat16()
        for x in (xb[:, :k], xb[:, 8:k + 8]):
            xp = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            cf._ext().permute_x(x, xp)
            assert torch.equal(xp, cf.permute_x_reference(x.contiguous()))
            emu = cf.emulate(x.contiguous(), w)
            for cfg in cfgs:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                _check(cf.gemm(x, w, out=out, config=cfg), x.contiguous(), fmt, q, w, emu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_wgmma_gemm_model_shapes_and_graphs(fmt):
    """The wgmma kernel over the Qwen2.5 3B-32B shapes at M = 17..512 (a config per M), and under CUDA-graph
    replay."""
    if not cf.wgmma_supported():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(5)
    for i, (n, k) in enumerate(SHAPES):
        q = _quant(fmt, n, k, seed=300 + i, device="cuda")
        w = _prep(fmt, q)
        cfgs = cf.wgmma_configs(n // 16, k // 64)
        for j, m in enumerate((17, 64, 130, 512) if n * k <= 4096 * 4096 else (48, 256)):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            _check(cf.gemm(x, w, config=cfgs[(i + j) % len(cfgs)]), x, fmt, q, w)
    n, k = 3584, 3584
    q = _quant(fmt, n, k, seed=29, device="cuda")
    w = _prep(fmt, q)
    for cfg in [(8, 0, 1, 2), (16, 0, 2, 1), (8, -2, 1, 2), (4, -3, 2, 1)]:  # CTA splits: counters reset per launch
        x = torch.randn(96, k, device="cuda").bfloat16()
        cf.gemm(x, w, config=cfg)
        _check_graph_replay(lambda x=x, cfg=cfg: cf.gemm(x, w, config=cfg), x)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_wgmma_gemm_lora(fmt, monkeypatch):
    """LoRA in the wgmma GEMM's epilogue (cf.gemm(lora=...)): member boundaries inside a warpgroup's 64 rows, a
    member without ranks, R = 96 (two passes of 64 ranks), every wgmma configuration (CTA splits included), partial
    token tiles, CUDA-graph replay; the dispatcher's opt-in path (QERL_WGMMA_LORA=1) where the GEMM is a wgmma one,
    and None (the caller's addmm) where the mma.sync kernel serves the M or the switch is off."""
    if not cf.wgmma_supported():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    from qerl import kernels as qk
    q, w, ops, k = _gemm_lora_case(fmt)
    g = torch.Generator(device="cuda").manual_seed(6)
    cfgs = cf.wgmma_configs(w.n // 16, k // 64)
    _check_gemm_lora_configs(w, ops, cfgs, (17, 130, 300), g)
    x = torch.randn(300, k, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="needs ranks that are multiples of 8"):
        cf.gemm(x, w, config=cfgs[0], lora=_lora([(112, 4), (48, 0), (48, 8)], k, seed=3, device="cuda"))
    op = ops[0]
    _check_gemm_lora_graph(w, op, (8, -2, 1, 2), torch.randn(96, k, device="cuda").bfloat16())
    # the dispatcher: forced onto the CUDA GEMM (an untuned shape: the heuristic's wgmma config above 32 tokens)
    monkeypatch.setenv("QERL_CUDA_GEMM", "1")
    monkeypatch.setenv("QERL_WGMMA_LORA", "1")
    x = torch.randn(130, k, device="cuda").bfloat16()
    _check_lora(qk.FP4.linear_lora(FORMATS[fmt], x, q, op), x, w, op)
    # M = 24: the mma.sync kernel, whose LoRA epilogue QERL_GEMM_LORA=0 turns off: LoRA by the caller
    monkeypatch.setenv("QERL_GEMM_LORA", "0")
    assert qk.FP4.linear_lora(FORMATS[fmt], x[:24], q, op) is None
    monkeypatch.setenv("QERL_WGMMA_LORA", "0")
    assert qk.FP4.linear_lora(FORMATS[fmt], x, q, op) is None


def test_zero_lora_counters_zeroes_every_lora_workspace_and_nothing_else(monkeypatch):
    """cf.zero_lora_counters (after a timing-only launch that may leave them set) zeroes every LoRA workspace, each
    (device, stream) one, counters and values, and leaves every other cached state alone."""
    state = {("lora_ws", "dev0", 1): (torch.ones(4), torch.tensor([3, 1, 0], dtype=torch.int32)),
             ("lora_ws", "dev1", 2): (torch.ones(4), torch.tensor([0, 0, 7], dtype=torch.int32)),
             ("wgmma_ctas", 0, "nvfp4"): 264, ("counters", 0): torch.ones(2)}
    monkeypatch.setattr(cf, "_STATE", state)
    cf.zero_lora_counters()
    assert all(not ws[1].any() and not ws[0].any() for k, ws in state.items() if k[0] == "lora_ws")
    assert state[("wgmma_ctas", 0, "nvfp4")] == 264 and state[("counters", 0)].eq(1).all()


def test_build_switches_are_the_ones_the_build_flags_read(monkeypatch):
    """cf.BUILD_SWITCHES (the tests clear them) lists every switch _build_flags reads: a bad value of each is refused
    by name, and each listed name is read."""
    monkeypatch.setattr(cf, "_arch_flags", lambda: [])
    for k in cf.BUILD_SWITCHES:
        monkeypatch.delenv(k, raising=False)
    for k in cf.BUILD_SWITCHES:
        monkeypatch.setenv(k, "no-such-value")
        with pytest.raises(ValueError, match=k):
            cf._build_flags()
        monkeypatch.delenv(k)
