"""benchmarks/wave_balance.py's arguments, checked on the CPU (its timings need a GPU)."""

from __future__ import annotations

import pytest

from benchmarks import wave_balance as wb


def test_rows_per_cta_is_the_mma_config_s_row_block():
    assert wb.rows_per_cta((4, 2, 2, 2)) == 64
    assert wb.rows_per_cta((4, 2, 1, 8)) == 32  # the ks groups split K, not rows
    with pytest.raises(ValueError, match=r"config \(16, 0, 2, 2\): an mma.sync config \(sw >= 1\)"):
        wb.rows_per_cta((16, 0, 2, 2))


def test_fitting_keeps_the_kz_the_chunks_allow():
    assert wb.fitting([1, 2, 3, 4], (4, 2, 1, 8), 1536) == [1, 2, 3]  # 24 chunks: 3 x 8 groups fit, 4 x 8 do not
    assert wb.fitting([1, 2], (4, 2, 2, 2), 128) == [1]


def test_bad_arguments_are_refused_by_name(monkeypatch):
    monkeypatch.delenv("QERL_GEMM_KZ", raising=False)
    with pytest.raises(ValueError, match="--kz '1,2': kz > 1 needs a QERL_GEMM_KZ=1 build"):
        wb.main(["--kz", "1,2"])
    with pytest.raises(ValueError, match="--ctas '0,132': comma-separated positive integers"):
        wb.main(["--ctas", "0,132"])
    with pytest.raises(ValueError, match="--config '4,2,2': four integers"):
        wb.main(["--config", "4,2,2"])
    with pytest.raises(ValueError, match=r"--m 64: more than one token tile of config \(4, 2, 2, 2\) \(32 tokens\)"):
        wb.main(["--m", "64"])
    with pytest.raises(ValueError, match=r"--eager: only with --products"):
        wb.main(["--eager"])
    with pytest.raises(ValueError, match=r"--models \['9b'\]: valid"):
        wb.main(["--products", "--models", "9b"])
    monkeypatch.setenv("QERL_GEMM_KZ", "1")
    with pytest.raises(ValueError, match="--m 'x': comma-separated positive integers"):
        wb.main(["--products", "--m", "x"])
