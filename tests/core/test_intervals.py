"""One Student t quantile and one ratio interval for every report: the quantile is Student's (checked
against scipy over the degrees of freedom a sweep or a live run reaches), and a ratio's interval is
never at or below zero, whatever the windows or seeds say."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from shadow.core.intervals import MIN_SAMPLES, mean_interval, ratio_interval, t975


@pytest.mark.parametrize("df", [*range(1, 60), 64, 100, 128, 500, 1_000, 10_000, 1_000_000])
def test_t975_is_students_quantile(df: int) -> None:
    assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=2e-6)


def test_t975_refuses_no_degrees_of_freedom() -> None:
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)


def test_sixteen_seeds_get_studentss_width_not_the_normals() -> None:
    # the sweep's old table fell back to 1.96 from 16 seeds on: ~8 % too narrow there
    xs = [float(i % 5) for i in range(16)]
    mean, half = mean_interval(xs)
    lo, hi = stats.t.interval(0.95, len(xs) - 1, loc=mean, scale=stats.sem(xs))
    assert (mean - half, mean + half) == pytest.approx((lo, hi))


positive = st.floats(min_value=1e-12, max_value=1e12, allow_nan=False, allow_infinity=False)


@given(st.lists(positive, min_size=MIN_SAMPLES, max_size=60))
def test_a_ratio_interval_is_positive_and_holds_its_estimate(ratios: list[float]) -> None:
    iv = ratio_interval(ratios)
    assert iv.ratio is not None and iv.low is not None and iv.high is not None
    assert 0 < iv.low <= iv.ratio * (1 + 1e-9) and iv.ratio <= iv.high * (1 + 1e-9)
    assert iv.n == len(ratios) and iv.skipped == 0
    # read the other way round, the same estimate
    back = ratio_interval([1 / r for r in ratios])
    assert back.ratio == pytest.approx(1 / iv.ratio, rel=1e-9)
    assert back.low == pytest.approx(1 / iv.high, rel=1e-9)
    assert back.high == pytest.approx(1 / iv.low, rel=1e-9)
    inv = iv.inverted()
    assert (inv.ratio, inv.low, inv.high) == pytest.approx((back.ratio, back.low, back.high), rel=1e-9)


off_scale = st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf])


@given(st.lists(st.one_of(positive, off_scale), max_size=40))
def test_ratios_off_the_log_scale_are_counted_not_used(ratios: list[float]) -> None:
    iv = ratio_interval(ratios, skipped=2)
    good = [r for r in ratios if r > 0 and math.isfinite(r)]
    assert iv.n == len(good) and iv.skipped == 2 + len(ratios) - len(good)
    for bound in (iv.ratio, iv.low, iv.high):
        assert bound is None or (bound > 0 and math.isfinite(bound))
    if len(good) < MIN_SAMPLES:
        assert iv.low is None and iv.high is None and iv.verdict == "too few windows"
