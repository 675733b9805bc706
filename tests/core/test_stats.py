"""The canary's one-sided tests against scipy's (the reference implementation, test-only)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sp

from shadow.core.stats import fisher_greater, mann_whitney_greater, quantile

samples = st.lists(st.integers(0, 40).map(lambda v: v / 4), min_size=1, max_size=60)  # many ties


@settings(max_examples=300, deadline=None)
@given(samples, samples)
def test_mann_whitney_matches_scipy_asymptotic_with_ties(x: list[float], y: list[float]) -> None:
    u, p = mann_whitney_greater(x, y)
    if len(set(x + y)) == 1:  # no spread at all: scipy answers nan, we say "not worse"
        assert p == 1.0
        return
    want = sp.mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True)
    assert u == pytest.approx(want.statistic)
    assert p == pytest.approx(want.pvalue, rel=1e-9, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(0, 300), st.data())
def test_fisher_matches_scipy(nx: int, ny: int, data: st.DataObject) -> None:
    fx = data.draw(st.integers(0, nx))
    fy = data.draw(st.integers(0, ny))
    want = sp.fisher_exact([[fx, nx - fx], [fy, ny - fy]], alternative="greater").pvalue
    got = fisher_greater(fx, nx, fy, ny)
    if math.isnan(want):
        assert got == 1.0
    else:
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_a_clear_difference_is_significant_and_none_is_not() -> None:
    slow, fast = [1.0 + i / 100 for i in range(50)], [0.5 + i / 100 for i in range(50)]
    assert mann_whitney_greater(slow, fast)[1] < 1e-6
    assert mann_whitney_greater(fast, slow)[1] > 0.99
    assert fisher_greater(30, 100, 2, 100) < 1e-6 and fisher_greater(2, 100, 30, 100) > 0.99
    with pytest.raises(ValueError):
        fisher_greater(5, 4, 0, 1)
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([], 0.5) is None


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0.0, 1.0))
def test_quantile_is_linear_between_order_statistics(values: list[float], q: float) -> None:
    """The one exact quantile: type 7 (linear between order statistics), as scipy's default."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    want = s[lo] + (s[hi] - s[lo]) * (pos - lo)
    got = quantile(values, q)
    assert got is not None and got == pytest.approx(want, rel=1e-9, abs=1e-6)
    assert got == pytest.approx(float(sp.mstats.mquantiles(values, [q], alphap=1, betap=1)[0]), abs=1e-6)
