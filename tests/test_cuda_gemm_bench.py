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
    # down_proj of 7B at M = 128: 28-56 CTAs per split, fewer than the SMs -> CTA splits are tried
    down = [c for c in gb.configs(224, 296, 128) if c[1] <= 0]
    assert (16, -3, 2, 2) in down and (16, 0, 2, 2) in down
    assert {8 * nt for nt, _, _, _ in down} == {64, 128}  # the two token tiles that suit M = 128
    # the fused gate|up at M = 128: 296+ CTAs without splits -> none tried; stream-K (persistent CTAs) always
    gu = [c for c in gb.configs(2368, 56, 128) if c[1] <= 0]
    assert gu and all(sw in (0, cf.WGMMA_SK) for _, sw, _, _ in gu) and (16, cf.WGMMA_SK, 2, 1) in gu
    assert (16, cf.WGMMA_SK, 2, 1) in down
    # every candidate is valid for its shape, and small M keeps 32-token tiles
    assert all(cf.check_gemm_config(c, 224, 296) == c for c in down)
    assert {8 * c[0] for c in gb.configs(224, 296, 24) if c[1] <= 0} == {32}
