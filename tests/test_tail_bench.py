"""benchmarks/tail_bench.py on the CPU: the products it times and its refusals (the timing itself needs an sm_90 GPU:
``scripts/gpu_bench.sh tail39``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import tail_bench as tb


def test_products_are_the_fused_decode_steps():
    """7B: q|k|v 4608 x 3584 (members 3584 | 512 | 512), o 3584 x 3584, gate|up 37888 x 3584 (two members of 18944),
    down 3584 x 18944; every member with the given rank."""
    got = tb.products("7b", 32)
    assert [(p[0], p[1], p[2]) for p in got] == [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584),
                                                ("down", 3584, 18944)]
    assert got[0][3] == [(3584, 32), (512, 32), (512, 32)] and got[2][3] == [(18944, 32), (18944, 32)]
    assert all(sum(rows for rows, _ in p[3]) == p[1] for p in got)  # the members cover every output row
    with pytest.raises(ValueError, match="unknown model '9b'; valid: "):
        tb.products("9b", 32)


def test_bad_arguments_are_refused_before_any_gpu_work(monkeypatch):
    with pytest.raises(ValueError, match="--m 8,64: the wgmma GEMM serves M > 16"):
        tb.main(["--m", "8,64"])
    with pytest.raises(ValueError, match="--rank 12: the GEMM's LoRA epilogue needs a multiple of 8"):
        tb.main(["--rank", "12"])
    with pytest.raises(ValueError, match="unknown model '9b'"):
        tb.main(["--models", "7b,9b"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device of compute capability 9.0"):
        tb.main([])
