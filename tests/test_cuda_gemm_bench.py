"""benchmarks/cuda_gemm_bench.py's candidate list on the CPU (the sweep itself times kernels on the device). The
device's answers -- whether it runs the wgmma kernel, its SM count -- are set by monkeypatching: this machine has no
CUDA device to ask."""

from __future__ import annotations

import types

import torch

from benchmarks import cuda_gemm_bench as gb
from qerl.kernels import cuda_fp4 as cf


def _sm90(monkeypatch, sms: int = 132):
    monkeypatch.setattr(cf, "wgmma_supported", lambda device=None: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=sms))


def test_candidates_without_wgmma_are_mma_sync_only(monkeypatch):
    monkeypatch.setattr(cf, "wgmma_supported", lambda device=None: False)
    cfgs = gb.configs(224, 296, 128)
    assert cfgs and all(sw >= 1 for _, sw, _, _ in cfgs)
    assert all(cf.check_gemm_config(c, 224, 296) == c for c in cfgs)


def test_wgmma_candidates_split_k_across_ctas_only_where_the_grid_leaves_sms_idle(monkeypatch):
    _sm90(monkeypatch)
    monkeypatch.setenv("QERL_WGMMA_TAIL", "0")  # tail splits: the next test
    # down_proj of 7B at M = 128: 28-56 CTAs per split, fewer than the SMs -> CTA splits are tried
    down = [c for c in gb.configs(224, 296, 128) if c[1] <= 0]
    assert (16, -3, 2, 2) in down and (16, 0, 2, 2) in down
    assert {8 * nt for nt, _, _, _ in down} == {64, 128}  # the two token tiles that suit M = 128
    # the fused gate|up at M = 128: 296+ CTAs without splits -> no split-K tried; stream-K (persistent CTAs) always
    gu = [c for c in gb.configs(2368, 56, 128) if c[1] <= 0]
    assert gu and all(sw in (0, cf.WGMMA_SK) for _, sw, _, _ in gu) and (16, cf.WGMMA_SK, 2, 1) in gu
    assert (16, cf.WGMMA_SK, 2, 1) in down
    # every candidate is valid for its shape, and small M keeps 32-token tiles
    assert all(cf.check_gemm_config(c, 224, 296) == c for c in down)
    assert {8 * c[0] for c in gb.configs(224, 296, 24) if c[1] <= 0} == {32}


def test_tail_splits_are_tried_where_a_partial_wave_follows_whole_ones(monkeypatch):
    """The tail-split build's candidates (session 52's fix: before it, the tuner tried tail splits only where the
    grid left SMs idle -- where they act as plain splits of K -- and never where they fill a last partial wave, the
    case the dispatcher applies them to). The wave is ``fmt``'s variant's, without LoRA. Below one wave: none."""
    _sm90(monkeypatch)
    monkeypatch.setenv("QERL_WGMMA_TAIL", "1")
    waves = []

    def ctas(fmt, ntok, r, ks, lora):
        waves.append((fmt, lora))
        return 264 if (ntok, r, ks) == (64, 1, 2) else 132
    monkeypatch.setattr(cf, "wgmma_ctas", ctas)
    tails = {kt: cf.wgmma_tail_sw(kt) for kt in range(2, cf.WGMMA_MAX_KZ + 1)}
    # gate|up at 64 tokens, (8, 0, 1, 2): 592 tiles = two waves of 264 + 64; (8, 0, 2, 2): 296 = 132 + 132 + 32
    gu = gb.configs(2368, 56, 64, "mxfp4")
    assert all((8, sw, 1, 2) in gu for sw in tails.values())
    assert all((8, sw, 2, 2) in gu for sw in tails.values())
    assert set(waves) == {("mxfp4", False)}
    # (4, 0, 2, 2) at 64 tokens: 2 x 296 = 592 tiles, 132 a wave -> 64 left over: tried too
    assert (4, tails[2], 2, 2) in gu
    # q|k|v at 128 tokens, 64-token tiles, r 1: 2 x 72 = 144 tiles; 132 a wave -> a 12-tile tail: tried
    assert (8, tails[2], 1, 1) in gb.configs(288, 56, 128)
    # below one wave (down at 128 tokens: 28-56 tiles) the split-K configs, not their tail-split twins
    down = gb.configs(224, 296, 128)
    assert (16, -3, 2, 2) in down and not [c for c in down if cf.wgmma_tail_kt(c[1])]
    # whole waves only: 264 tiles of (8, 0, 1, 1) at 64 tokens over 132 SMs (a shape of 1056 strips) -> none
    assert not [c for c in gb.configs(1056, 56, 64) if c[:1] == (8,) and c[2:] == (1, 1) and cf.wgmma_tail_kt(c[1])]
    # every candidate is valid for its shape
    assert all(cf.check_gemm_config(c, 2368, 56) == c for c in gu)
    # the build without tail splits has none
    monkeypatch.setenv("QERL_WGMMA_TAIL", "0")
    assert not [c for c in gb.configs(2368, 56, 64) if cf.wgmma_tail_kt(c[1])]


def test_prev_path_weights_are_held_in_the_layout_asked_for(monkeypatch):
    """--prev-layout: the "prev" path (and the dispatcher's column) is timed on the kernels' layout alone by default
    -- what rollouts and the update hold after relayout_model -- or on the compressed-tensors layout; the same
    weight either way; anything else a clear error naming the valid choices."""
    import pytest

    from benchmarks import kernel_bench as kb
    from qerl.kernels import relaid

    monkeypatch.setattr(kb, "DEVICE", "cpu")
    monkeypatch.setattr(kb, "ROTATE_BYTES", 1)  # one copy of each weight
    wk = gb.prev_weights("nvfp4", 48, 192, 7, "kernel")
    wc = gb.prev_weights("nvfp4", 48, 192, 7, "compressed")
    assert wk.fmt == "nvfp4" + kb.KL and relaid.is_relaid(wk.qs[0]) and "weight_packed" not in wk.qs[0]
    assert wc.fmt == "nvfp4" and "weight_packed" in wc.qs[0] and not relaid.is_relaid(wc.qs[0])
    x = torch.randn(3, 192).bfloat16()
    assert torch.equal(kb._call(wk.fmt, wk, 0, x, "fwd")(), kb._call(wc.fmt, wc, 0, x, "fwd")())
    with pytest.raises(ValueError, match="--prev-layout 'relaid': valid: kernel, compressed"):
        gb.prev_weights("nvfp4", 48, 192, 7, "relaid")
    with pytest.raises(SystemExit):  # argparse's choices, before any device is asked for
        gb.main(["--prev-layout", "relaid"])
