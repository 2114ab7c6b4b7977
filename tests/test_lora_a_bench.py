"""benchmarks/lora_a_bench.py on the CPU: its candidate grid, its launcher under the Triton interpreter (against the
fp32 reference) and its argument errors (the timing itself needs a GPU and runs on the device)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import run_under_triton_interpreter

from benchmarks import lora_a_bench as lb
from qerl.kernels.fused import lora_a_splits
from qerl.model import PRESETS

TINY = (40, 24, 256)  # (M, R, K): two M tiles of 32, a ragged rank block of 16, two K tiles of 128


def test_shapes_are_the_layers_four_lora_products():
    c = PRESETS["qwen2.5-7b"]
    h, i = c["hidden_size"], c["intermediate_size"]
    assert lb.shapes("7b", 32) == [("qkv", 96, h), ("o", 32, h), ("gate_up", 64, h), ("down", 32, i)]
    assert (h, i) == (3584, 18944)


def test_splits_is_lora_a_splits_rule_with_a_cap():
    for r, k, br, bk, t in ((96, 3584, 16, 128, 96), (32, 18944, 32, 64, 264), (24, 256, 16, 64, 7),
                            (64, 100, 64, 128, 1)):
        assert lb.splits(r, k, br, bk, t) == lora_a_splits(r, k, br, bk, t)
    # 148 K tiles: 16 splits of 10 tiles leave 15 non-empty ones; a cap of 32 gives 30 of 5 tiles
    assert lb.splits(32, 18944, 32, 128, 264, cap=16) == (15, 1280) == lora_a_splits(32, 18944, 32, 128, 264)
    assert lb.splits(32, 18944, 32, 128, 264, cap=32) == (30, 640)


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("m, r, k", [(64, 96, 3584), (128, 32, 18944), (256, 64, 3584), (1, 24, 256), (40, 24, 200)])
def test_candidates_are_distinct_and_valid(m, r, k, quick):
    cands = lb.candidates(m, r, k, quick)
    keys = [(c["bm"], c["br"], c["bk"], c["split"], c["per"], c["warps"]) for c in cands]
    assert cands and len(set(keys)) == len(keys)
    assert len({key[:4] + key[5:] for key in keys}) == len(keys)  # the split alone tells the per apart too
    for c in cands:
        lb.validate(m, r, k, c)  # raises where the kernel's preconditions fail
        assert c["per"] % c["bk"] == 0 and c["split"] * c["per"] >= k > (c["split"] - 1) * c["per"], c
        assert c["br"] <= max(16, lb.next_pow2(r)) and c["bm"] <= max(32, lb.next_pow2(m)), c
        assert c["bm"] in lb.BMS and c["br"] in lb.BRS and 1 <= c["split"] <= lb.MAX_SPLIT
        assert c["bk"] in ((128,) if quick else lb.BKS) and c["warps"] in ((4,) if quick else lb.WARPS)
    assert any(c["split"] == 1 for c in cands)
    assert any(c["split"] > 1 for c in cands) or k <= 128
    if not quick:  # the full grid holds both BKs and both warp counts, and more than the quick one
        assert {c["bk"] for c in cands} == set(lb.BKS) and {c["warps"] for c in cands} == set(lb.WARPS)
        assert len(cands) > len(lb.candidates(m, r, k, True))


def test_validate_rejects_what_the_kernel_cannot_run():
    m, r, k = TINY
    good = dict(bm=32, br=16, bk=64, split=2, per=128, warps=4)
    lb.validate(m, r, k, good)
    for bad in (dict(per=64), dict(per=96), dict(split=3), dict(bm=48), dict(br=8), dict(split=1, per=128)):
        with pytest.raises(ValueError):
            lb.validate(m, r, k, dict(good, **bad))


def test_check_tolerance():
    ref = torch.tensor([[1.0, -2.0], [0.5, 100.0]])
    assert lb.check(ref.bfloat16(), ref)[0]
    assert not lb.check(ref + torch.tensor([[0.0, 0.0], [0.0, 3.0]]), ref)[0]  # 3 % off at the largest entry
    assert not lb.check(ref + torch.tensor([[2.0, 0.0], [0.0, 0.0]]), ref)[0]  # off by 2·max|ref|·1e-2 where small
    assert not lb.check(torch.full_like(ref, float("nan")), ref)[0]


def test_main_without_cuda_says_a_gpu_is_needed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        lb.main(["--m", "64", "--quick"])


@pytest.mark.parametrize("argv, why", [(["--models", "9b"], "unknown --models"), (["--m", "0"], "--m must"),
                                       (["--m", "a"], "--m must"), (["--rank", "0"], "must be positive")])
def test_bad_arguments(argv, why):
    with pytest.raises(SystemExit, match=why):
        lb.main(argv)


# ------------------------------------------------------------------------------------------ Triton interpreter

def _interpreter_main() -> None:
    """Subprocess with TRITON_INTERPRET=1: ``launch`` for a few configurations vs the fp32 reference (float32
    inputs: the interpreter's arithmetic is exact to rounding; it truncates bf16 conversions, so bf16 gets the
    benchmark's own bf16 tolerance)."""
    from test_kernels import _interp_shim

    _interp_shim()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    m, r, k = TINY
    cfgs = [dict(bm=32, br=16, bk=64, split=2, per=128, warps=4),   # 2 M tiles, 2 rank blocks (one ragged), split-K
            dict(bm=64, br=32, bk=128, split=1, per=256, warps=4),  # one CTA, no split
            dict(bm=32, br=32, bk=64, split=4, per=64, warps=8)]    # 4 splits of one K tile, 2 M tiles
    cands = lb.candidates(m, r, k)
    cfgs += [cands[0], cands[-1], max(cands, key=lambda c: c["split"])]  # from the grid: first, last, most splits
    x, a = torch.randn(m, k, generator=g), torch.randn(r, k, generator=g)
    ref = x @ a.t()
    for cfg in cfgs:
        for _ in range(2):  # twice: the split-K counters must be back at zero
            out = lb.launch(x, a, cfg)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4, msg=lambda s, c=cfg: f"{c}: {s}")
        assert not lb._counters(x.device).any(), cfg
    # a ragged K (200: the last split's tile masked), and bf16 through the benchmark's own check
    for kk, dt in ((200, torch.float32), (256, torch.bfloat16)):
        xk, ak = x[:, :kk].contiguous().to(dt), a[:, :kk].contiguous().to(dt)
        refk = xk.float() @ ak.float().t()
        for cfg in lb.candidates(m, r, kk, quick=True)[:4]:
            out = lb.launch(xk, ak, cfg)
            assert out.dtype == dt and lb.check(out, refk, 1e-5 if dt == torch.float32 else 1e-2,
                                                1e-4 if dt == torch.float32 else 1e-2)[0], (kk, dt, cfg)
    # the check catches a launch whose splits miss part of K (validation skipped)
    bad = dict(bm=32, br=16, bk=64, split=2, per=64, warps=4)
    assert not lb.check(lb.launch(x, a, bad, check=False), ref)[0]
    lb._counters(x.device).zero_()
    _rows_main()
    print("LORA-A-BENCH-INTERPRETER-OK")


def _rows_main() -> None:
    """bench_shape / report / the CSV on the CPU (interpreter; a timer that just calls): every candidate a row, the
    grid's valid ones correct, one that fails validation, one whose result is wrong and one that raises recorded as
    failed without stopping the run."""
    import tempfile
    from pathlib import Path

    from qerl.bench_common import _write_csv

    m, r, k = TINY
    grid = lb.candidates(m, r, k, quick=True)
    bad, wrong, boom = dict(grid[0], bm=48), dict(grid[0], warps=2), dict(grid[0], warps=1)
    lb.candidates = lambda *a, **kw: grid + [bad, wrong, boom]

    def timer(fn):
        out = fn()
        if calls[-1] is wrong:
            out = out * 2
        if calls[-1] is boom:
            raise RuntimeError("capture failed\nsecond line")
        return 2.0, out

    calls = [None]
    orig = lb.launch
    lb.launch = lambda x, a, cfg, check=True: (calls.append(cfg), orig(x, a, cfg, check))[1]
    rows = lb.bench_shape("7b", "o", m, r, k, True, lb.MAX_SPLIT, {"device": "cpu"}, timer,
                          [lb._counters(torch.device("cpu"))], "cpu")
    lb.launch = orig
    assert [row["candidate"] for row in rows] == ["default", "cublas"] + ["grid"] * (len(grid) + 3)
    assert all(row["ok"] and row["us"] == 2.0 for row in rows[:-3]), [row["error"] for row in rows]
    assert rows[0]["bit_identical"] is True and rows[0]["default_path"] == "triton" and rows[0]["bm"] == 64
    assert {(row["bm"], row["br"], row["bk"], row["split"], row["warps"]) for row in rows[2:-3]} == \
        {(c["bm"], c["br"], c["bk"], c["split"], c["warps"]) for c in grid}
    for row in rows[2:-3]:
        nrb, mt = -(-r // row["br"]), -(-m // row["bm"])
        assert row["ctas"] == nrb * row["split"] * mt and row["mtiles"] == mt, row
    assert not rows[-3]["ok"] and rows[-3]["error"].startswith("ValueError") and rows[-3]["us"] == ""
    assert not rows[-2]["ok"] and rows[-2]["error"] == "wrong result"
    assert not rows[-1]["ok"] and rows[-1]["error"] == "RuntimeError: capture failed"
    lb.report(rows)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lora_a.csv"
        _write_csv(rows, path, lb.IDENT)
        _write_csv(rows[:3], path, lb.IDENT)  # the same rows again replace theirs: the IDENT tells them apart
        assert len(path.read_text().splitlines()) == 1 + len(rows)


def test_launch_under_triton_interpreter():
    run_under_triton_interpreter(__file__, "LORA-A-BENCH-INTERPRETER-OK")


if __name__ == "__main__":
    _interpreter_main()
