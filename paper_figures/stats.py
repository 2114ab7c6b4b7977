"""Small-sample statistics for the evidence: t intervals, Welch and paired differences, curve areas, verdicts,
Holm's correction and per-step confidence bands over seeds. numpy + scipy only.

Every interval is a Student-t interval (the numbers of seeds are small, 3–5, where a normal interval is too narrow
and a bootstrap has too few points to resample). NaN entries are dropped before anything is computed; ``n`` counts
what is left. An interval that needs a variance it cannot have (one value; ``n < 2`` on a side of a Welch
difference) has NaN bounds, and a NaN bound always gives the verdict ``inconclusive``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy import stats as _st

VERDICTS = ("supported", "contradicted", "inconclusive")


class CI(NamedTuple):
    """An estimate with its two-sided interval: ``estimate``, ``lo``, ``hi``; ``df`` of the t quantile used, ``p``
    the two-sided t-test p-value of "the true value is 0", ``n`` the sample size (the number of pairs for a paired
    difference, ``(n_a, n_b)`` for a Welch difference)."""
    estimate: float
    lo: float
    hi: float
    df: float
    p: float
    n: int | tuple[int, int]


def _clean(x) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    return a[~np.isnan(a)]


def _check_level(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must lie strictly between 0 and 1, got {level!r}")
    return level


def _t_interval(est: float, se: float, df: float, level: float) -> tuple[float, float, float]:
    """(lo, hi, p) of ``est ± t_{(1+level)/2, df} · se``; NaN when df or se is undefined. A zero standard error
    (every value equal) gives the degenerate interval [est, est] and p = 0 unless est = 0 (then 1); its df may be
    infinite (Welch's df of two zero variances)."""
    if not (np.isfinite(se) and not np.isnan(df) and df > 0):
        return np.nan, np.nan, np.nan
    if se == 0:
        return est, est, (1.0 if est == 0 else 0.0)
    half = _st.t.ppf((1 + level) / 2, df) * se
    return est - half, est + half, float(2 * _st.t.sf(abs(est / se), df))


def mean_ci(x: Sequence[float], level: float = 0.95) -> CI:
    """Mean of ``x`` with its t interval ``mean ± t_{(1+level)/2, n-1} · s/√n`` (s: sample sd, ddof 1).
    One value: NaN bounds; no value: everything NaN."""
    a, level = _clean(x), _check_level(level)
    n = len(a)
    if n == 0:
        return CI(np.nan, np.nan, np.nan, np.nan, np.nan, 0)
    m = float(a.mean())
    if n == 1:
        return CI(m, np.nan, np.nan, np.nan, np.nan, 1)
    df = n - 1
    lo, hi, p = _t_interval(m, float(a.std(ddof=1)) / np.sqrt(n), df, level)
    return CI(m, lo, hi, float(df), p, n)


def welch_diff_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> CI:
    """mean(a) − mean(b) with Welch's interval (unequal variances): se² = s_a²/n_a + s_b²/n_b and the
    Welch–Satterthwaite df = se⁴ / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1)). Needs n ≥ 2 on each side for
    its bounds (NaN otherwise)."""
    x, y, level = _clean(a), _clean(b), _check_level(level)
    na, nb = len(x), len(y)
    est = float(x.mean() - y.mean()) if na and nb else np.nan
    if na < 2 or nb < 2:
        return CI(est, np.nan, np.nan, np.nan, np.nan, (na, nb))
    va, vb = x.var(ddof=1) / na, y.var(ddof=1) / nb
    se2 = va + vb
    df = se2**2 / (va**2 / (na - 1) + vb**2 / (nb - 1)) if se2 > 0 else np.inf
    lo, hi, p = _t_interval(est, float(np.sqrt(se2)), float(df), level)
    return CI(est, lo, hi, float(df), p, (na, nb))


def paired_diff_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> CI:
    """mean(a − b) over pairs with the t interval of the differences (``mean_ci`` of ``a − b``). ``a`` and ``b``
    are aligned (pair i is ``(a[i], b[i])``); a pair with a NaN on either side is dropped."""
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"paired samples must have the same length, got {len(x)} and {len(y)}")
    return mean_ci(x - y, level)


def curve_auc(steps: Sequence[float], values: Sequence[float]) -> float:
    """Normalised area under a curve: the trapezoid-rule integral over the step range divided by that range, i.e.
    the curve's mean value over its steps (so it is in the metric's own units, and unequal step spacing is
    weighted by its width). Points are sorted by step; NaN values are dropped; one point gives its value."""
    s, v = np.asarray(steps, dtype=float).ravel(), np.asarray(values, dtype=float).ravel()
    if s.shape != v.shape:
        raise ValueError(f"steps and values must have the same length, got {len(s)} and {len(v)}")
    keep = ~(np.isnan(s) | np.isnan(v))
    s, v = s[keep], v[keep]
    if len(s) == 0:
        return np.nan
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    span = s[-1] - s[0]
    if span == 0:
        return float(v.mean())
    return float(np.sum((v[1:] + v[:-1]) / 2 * np.diff(s)) / span)


def verdict(lo: float, hi: float, direction: int = +1) -> str:
    """``supported`` when the interval [lo, hi] excludes 0 on the claimed side (``direction`` +1: the effect is
    claimed positive, −1: negative), ``contradicted`` when it excludes 0 on the other side, ``inconclusive`` when
    it contains 0 or a bound is NaN."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction!r}")
    if lo is None or hi is None or np.isnan(lo) or np.isnan(hi):
        return "inconclusive"
    lo, hi = (lo, hi) if direction == 1 else (-hi, -lo)
    if lo > 0:
        return "supported"
    if hi < 0:
        return "contradicted"
    return "inconclusive"


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values, in the input order: the i-th smallest of m p-values is multiplied by
    (m − i + 1), made non-decreasing along that order, and capped at 1. NaN p-values stay NaN and do not count
    in m."""
    p = np.asarray(pvalues, dtype=float).ravel()
    out = np.full_like(p, np.nan)
    idx = np.flatnonzero(~np.isnan(p))
    m = len(idx)
    if m == 0:
        return out
    order = idx[np.argsort(p[idx], kind="stable")]
    adj = np.maximum.accumulate(p[order] * (m - np.arange(m)))
    out[order] = np.minimum(adj, 1.0)
    return out


class Band(NamedTuple):
    """A per-step band over seeds: ``x`` (the union of the seeds' steps, sorted), ``mean``, ``lo``, ``hi`` (the t
    interval of the mean over the seeds that have that step; NaN where only one has it) and ``n`` (that count)."""
    x: np.ndarray
    mean: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    n: np.ndarray


def band_matrix(x: Sequence[float], values, level: float = 0.95) -> Band:
    """Band of a (seeds, steps) matrix ``values`` (NaN where a seed has no value) over steps ``x``."""
    level = _check_level(level)
    xs = np.asarray(x, dtype=float)
    M = np.atleast_2d(np.asarray(values, dtype=float))
    if M.shape[1] != len(xs):
        raise ValueError(f"values have {M.shape[1]} columns but there are {len(xs)} steps")
    n = (~np.isnan(M)).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, np.nansum(M, axis=0) / np.maximum(n, 1), np.nan)
        dev = np.where(np.isnan(M), 0.0, M - mean)
        sd = np.sqrt((dev**2).sum(axis=0) / np.maximum(n - 1, 1))
        t = _st.t.ppf((1 + level) / 2, np.maximum(n - 1, 1))
        half = np.where(n >= 2, t * sd / np.sqrt(np.maximum(n, 1)), np.nan)
    return Band(xs, mean, mean - half, mean + half, n)


def curve_band(curves: Sequence[tuple[Sequence[float], Sequence[float]]], level: float = 0.95) -> Band:
    """Band over seeds of several curves, each ``(steps, values)`` (one per seed; their steps may differ: each
    step's interval uses the seeds that logged it)."""
    curves = [(np.asarray(s, dtype=float).ravel(), np.asarray(v, dtype=float).ravel()) for s, v in curves]
    if not curves:
        e = np.array([])
        return Band(e, e, e, e, e.astype(int))
    xs = np.unique(np.concatenate([s for s, _ in curves]))
    M = np.full((len(curves), len(xs)), np.nan)
    for i, (s, v) in enumerate(curves):
        if s.shape != v.shape:
            raise ValueError(f"curve {i}: {len(s)} steps but {len(v)} values")
        M[i, np.searchsorted(xs, s)] = v
    return band_matrix(xs, M, level)
