"""benchmarks.ab_compare: gains of interleaved builds over a baseline, per pass against the same pass's baseline."""

import csv

import pytest

from benchmarks import ab_compare as ab

COLS = ["fmt", "N", "K", "M", "config", "tuned", "lora_rank", "us"]


def _write(root, folder, rows):
    d = root / folder
    d.mkdir()
    with open(d / "wgmma_profile_h200.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLS)
        for n, k, m, us in rows:
            w.writerow(["nvfp4", n, k, m, "(16, 0, 2, 2)", True, 32, us])


def test_gain_is_per_pass_against_that_pass_baseline(tmp_path):
    # pass 1: base 100 vs build 80 (+25 %); pass 2: base 90 vs build 90 (0 %). Pairing across passes instead
    # (e.g. the mean times 95 / 85) would give +11.8 %, which the assertion rejects.
    _write(tmp_path, "tma_0_1", [(37888, 3584, 128, 100.0), (3584, 3584, 256, 30.0)])
    _write(tmp_path, "tma_1_1", [(37888, 3584, 128, 80.0), (3584, 3584, 256, 30.0)])
    _write(tmp_path, "tma_1_2", [(37888, 3584, 128, 90.0)])  # cut short: no o row in this pass
    _write(tmp_path, "tma_0_2", [(37888, 3584, 128, 90.0), (3584, 3584, 256, 33.0)])
    _write(tmp_path, "other_1_1", [(37888, 3584, 128, 1.0)])  # another prefix: ignored
    rows = ab.compare(ab.load(str(tmp_path), "tma"), "0")
    by = {(r["build"], r["key"][3]): r for r in rows}
    gu = by[("1", 128)]
    assert gu["n"] == 2
    assert gu["gain"] == pytest.approx((0.25 + 0.0) / 2)
    assert (gu["lo"], gu["hi"]) == pytest.approx((0.0, 0.25))
    o = by[("1", 256)]  # only pass 1 has both builds
    assert o["n"] == 1 and o["gain"] == pytest.approx(0.0)
    text = ab.render(rows, "0")
    assert "| 1 | nvfp4 gate\\|up | 128 |" in text and "+12.5 %" in text and "| nvfp4 o | 256 |" in text


def test_folder_names_with_dashes_in_the_build(tmp_path):
    _write(tmp_path, "tma_all-bar_1", [(4608, 3584, 64, 22.0)])
    _write(tmp_path, "tma_1_1", [(4608, 3584, 64, 20.0)])
    runs = ab.load(str(tmp_path), "tma")
    assert set(runs) == {"all-bar", "1"}
    (r,) = ab.compare(runs, "1")
    assert r["build"] == "all-bar" and r["gain"] == pytest.approx(20 / 22 - 1)


def test_bad_base_and_empty_folder_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="no tma_<build>_<pass>"):
        ab.load(str(tmp_path), "tma")
    _write(tmp_path, "tma_1_1", [(4608, 3584, 64, 20.0)])
    with pytest.raises(SystemExit, match="--base '0': not among the builds found \\(1\\)"):
        ab.compare(ab.load(str(tmp_path), "tma"), "0")
