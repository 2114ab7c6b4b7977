"""paper_figures.stats against intervals worked out by hand from the t table (t_{0.975,1} = 12.706,
t_{0.975,2} = 4.303, t_{0.95,2} = 2.920, t_{0.975,4} = 2.776, t_{0.975,7} = 2.365); tolerances are the table's
three decimals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paper_figures import stats as S

TOL = 1e-3  # relative: the t table's quantiles have four significant digits


def test_mean_ci_by_hand():
    # [1, 2, 3]: mean 2, s = 1, se = 1/√3 = 0.57735; half = 4.303 · 0.57735 = 2.4844
    ci = S.mean_ci([1, 2, 3])
    assert ci.estimate == 2 and ci.n == 3 and ci.df == 2
    assert ci.lo == pytest.approx(2 - 2.4844, rel=TOL) and ci.hi == pytest.approx(2 + 2.4844, rel=TOL)
    # 90%: half = 2.920 · 0.57735 = 1.6859
    ci = S.mean_ci([1, 2, 3], level=0.90)
    assert (ci.lo, ci.hi) == (pytest.approx(0.3141, rel=TOL), pytest.approx(3.6859, rel=TOL))
    # [2,4,4,4,5,5,7,9]: mean 5, Σ(x-5)² = 32, s = √(32/7) = 2.1381, se = 0.75593; half = 2.365 · 0.75593 = 1.7878
    ci = S.mean_ci([2, 4, 4, 4, 5, 5, 7, 9])
    assert (ci.lo, ci.hi) == (pytest.approx(3.2122, rel=TOL), pytest.approx(6.7878, rel=TOL))


def test_mean_ci_edge_cases():
    one = S.mean_ci([0.7])
    assert one.estimate == 0.7 and math.isnan(one.lo) and math.isnan(one.hi) and one.n == 1
    none = S.mean_ci([])
    assert math.isnan(none.estimate) and none.n == 0
    # NaN entries are dropped: [1, nan, 2, 3] is [1, 2, 3]
    assert S.mean_ci([1, float("nan"), 2, 3]).lo == pytest.approx(S.mean_ci([1, 2, 3]).lo)
    # every value equal: a zero-width interval at the value
    same = S.mean_ci([0.5, 0.5, 0.5])
    assert (same.lo, same.hi) == (0.5, 0.5)
    with pytest.raises(ValueError, match="between 0 and 1"):
        S.mean_ci([1, 2], level=95)


def test_welch_diff_ci_by_hand():
    # a = [1,2,3], b = [2,3,4]: diff −1; s² = 1 each, se² = 1/3 + 1/3 = 2/3, se = 0.81650;
    # df = (2/3)² / ((1/3)²/2 + (1/3)²/2) = 4; half = 2.776 · 0.81650 = 2.2666
    ci = S.welch_diff_ci([1, 2, 3], [2, 3, 4])
    assert ci.estimate == pytest.approx(-1.0) and ci.df == pytest.approx(4.0) and ci.n == (3, 3)
    assert (ci.lo, ci.hi) == (pytest.approx(-3.2666, rel=TOL), pytest.approx(1.2666, rel=TOL))
    # unequal variances: a = [1,2,3] (s² 1), b = [4,6,8] (s² 4): se² = 1/3 + 4/3 = 5/3;
    # df = (5/3)² / ((1/3)²/2 + (4/3)²/2) = (25/9) / (17/18) = 50/17
    ci = S.welch_diff_ci([1, 2, 3], [4, 6, 8])
    assert ci.estimate == pytest.approx(-4.0) and ci.df == pytest.approx(50 / 17)
    assert ci.hi - ci.estimate == pytest.approx(ci.estimate - ci.lo)
    # one run on a side: no variance there, so no interval (but the difference of means is still given)
    ci = S.welch_diff_ci([1.0], [2, 3, 4])
    assert ci.estimate == pytest.approx(-2.0) and math.isnan(ci.lo) and math.isnan(ci.p)
    # every value equal on both sides (e.g. a held-out pass@1 of 0 in every seed): zero standard error, so the
    # zero-width interval at the difference, as for one sample (not "no interval")
    same = S.welch_diff_ci([0.0, 0.0, 0.0], [0.0, 0.0])
    assert (same.estimate, same.lo, same.hi, same.p) == (0.0, 0.0, 0.0, 1.0)
    apart = S.welch_diff_ci([0.5, 0.5], [0.4, 0.4])
    assert (apart.lo, apart.hi) == (pytest.approx(0.1), pytest.approx(0.1)) and apart.p == 0.0


def test_paired_diff_ci_by_hand():
    # differences [2, 3, 4]: mean 3, s 1, half = 4.303/√3 = 2.4844;
    # t = 3/(1/√3) = √27; for df 2 the t tail is ½(1 − t/√(t²+2)) = ½(1 − √27/√29) = 0.017549, p = 0.035098
    ci = S.paired_diff_ci([3, 5, 7], [1, 2, 3])
    assert ci.estimate == pytest.approx(3.0) and ci.n == 3
    assert (ci.lo, ci.hi) == (pytest.approx(0.5156, rel=TOL), pytest.approx(5.4844, rel=TOL))
    assert ci.p == pytest.approx(0.035098, rel=TOL)
    # a pair with a NaN is dropped whole
    assert S.paired_diff_ci([3, 5, 7, np.nan], [1, 2, 3, 9]).n == 3
    with pytest.raises(ValueError, match="same length"):
        S.paired_diff_ci([1, 2], [1, 2, 3])


def test_curve_auc_is_the_trapezoid_mean():
    # steps 0,1,2,4 values 0,1,1,3: trapezoids 0.5 + 1 + 2·2 = 5.5 over a range of 4 -> 1.375 (order-free)
    assert S.curve_auc([0, 1, 2, 4], [0, 1, 1, 3]) == pytest.approx(1.375)
    assert S.curve_auc([4, 0, 2, 1], [3, 0, 1, 1]) == pytest.approx(1.375)
    assert S.curve_auc([1, 2, 3], [0.2, 0.2, 0.2]) == pytest.approx(0.2)
    assert S.curve_auc([5], [0.3]) == 0.3 and math.isnan(S.curve_auc([], []))


@pytest.mark.parametrize("lo,hi,direction,expect", [
    (0.01, 0.2, 1, "supported"), (-0.2, -0.01, 1, "contradicted"), (-0.1, 0.1, 1, "inconclusive"),
    (0.0, 0.1, 1, "inconclusive"),  # touching 0 is not excluding it
    (-0.2, -0.01, -1, "supported"), (0.01, 0.2, -1, "contradicted"), (-0.1, 0.1, -1, "inconclusive"),
    (float("nan"), 0.3, 1, "inconclusive"), (0.1, float("nan"), 1, "inconclusive"),
])
def test_verdict_rules(lo, hi, direction, expect):
    assert S.verdict(lo, hi, direction) == expect


def test_verdict_rejects_a_bad_direction():
    with pytest.raises(ValueError, match=r"\+1 or -1"):
        S.verdict(0.1, 0.2, direction=2)


def test_holm_by_hand():
    # sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 -> max so far 0.06
    adj = S.holm([0.01, 0.04, 0.03, 0.005])
    assert adj == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adj = S.holm([0.5, float("nan"), 0.9])  # m = 2: 0.5·2 = 1.0, 0.9·1 -> 1.0
    assert adj[0] == pytest.approx(1.0) and math.isnan(adj[1]) and adj[2] == pytest.approx(1.0)


def test_curve_band_by_hand():
    # three seeds; step 3 is logged by one seed only (no band there)
    band = S.curve_band([([1, 2, 3], [1.0, 0.1, 0.9]), ([1, 2], [2.0, 0.1]), ([1, 2], [3.0, 0.1])])
    assert list(band.x) == [1, 2, 3] and list(band.n) == [3, 3, 1]
    assert band.mean[0] == pytest.approx(2.0)
    assert (band.lo[0], band.hi[0]) == (pytest.approx(2 - 2.4844, rel=TOL), pytest.approx(2 + 2.4844, rel=TOL))
    assert (band.lo[1], band.hi[1]) == (pytest.approx(0.1), pytest.approx(0.1))  # all equal: zero width
    assert band.mean[2] == pytest.approx(0.9) and math.isnan(band.lo[2]) and math.isnan(band.hi[2])
    # two seeds 0.01 apart: mean ± 12.706 · 0.005 = ± 0.06353
    band = S.curve_band([([0], [0.20]), ([0], [0.21])])
    assert band.hi[0] - band.mean[0] == pytest.approx(0.06353, rel=TOL)
    assert S.curve_band([]).x.size == 0
