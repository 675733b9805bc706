"""The live lanes' bounded sample summary (LogHistogram) against exact counts, and the live
driver's lag figure at its edges (written against behaviour; kills mutants, docs/mutation.md)."""

from __future__ import annotations

import bisect
import time

import numpy as np
import pytest

from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.events import Arrive, Finish, Route, Token
from shadow.engine.live import LiveDriver
from shadow.engine.summary import LogHistogram


def test_cumulative_counts_match_exact_counts_within_one_bucket() -> None:
    rng = np.random.default_rng(0)
    values = [0.0, 1e-7, 1e-6, *rng.lognormal(-4, 2, 3000).tolist(), 1e6]  # zeros, tiny, a huge one
    h = LogHistogram()
    for v in values:
        h.append(v)
    h.append(float("nan"))  # not a sample
    h.append(float("inf"))
    assert len(h) == h.count == len(values) and h.zeros == 3
    assert h.mean() == pytest.approx(sum(values) / len(values))
    srt = sorted(values)
    bounds = (0.0, 1e-6, 1e-4, 1e-3, 0.005, 0.01, 0.1, 0.5, 1.0, 10.0, 1e4, 1e7)  # within [1 µs, 1 day]
    got = h.cumulative(bounds)
    for b, n in zip(bounds, got, strict=True):
        lo = bisect.bisect_right(srt, b / 1.0101)  # within one bucket (1 %) below the bound ...
        hi = bisect.bisect_right(srt, b * 1.0101)  # ... or above it
        if b <= LogHistogram.LO:
            lo = hi = 3  # samples <= 1 µs count as zeros, at every bound that low
        assert lo <= n <= hi, f"bound {b}: {n} samples counted, exact count between {lo} and {hi}"
    assert got == sorted(got), "cumulative counts must not decrease"
    assert got[-1] == len(values), "the last bound is above every sample"


def test_an_empty_summary_has_no_mean_and_no_percentile() -> None:
    h = LogHistogram()
    assert h.mean() is None and h.percentile(50) is None and h.cumulative((1.0, 2.0)) == [0, 0]
    h.append(2.0)
    assert h.mean() == 2.0 and h.cumulative((1.0, 3.0)) == [0, 1]


def test_lag_is_zero_before_any_release_and_never_negative() -> None:
    cfg = EngineConfig(workers=2, slots=4)
    driver = LiveDriver(cfg, [LaneSpec("br0")], ["d0", "d1"], time.perf_counter, lag_s=0.0)
    actual = driver.lanes[0]
    driver.apply(Arrive("a", 100.0, 100))  # not routed yet: nothing released, no lane time 0
    assert driver.origin is None and driver.lag(actual) == 0.0
    driver.apply(Route("a", 100.0, "d1", 100))
    driver.apply(Token("a", 100.2, 3))
    driver.apply(Token("a", 130.0, 4))  # the newest event: 30 s after the lanes' time 0
    driver.advance_to(100.0)  # lanes at lane time 0 = event time 100
    assert driver.origin == 100.0
    assert driver.lag(actual) == pytest.approx(30.0 - actual.now), "lag = newest event − lane's event time"
    assert driver.lag(actual) > 25.0
    driver.apply(Finish("a", 130.5, "stop", 4))
    driver.drain()
    assert driver.lag(actual) >= 0.0
    assert driver.lag(actual) == pytest.approx(max(0.0, 30.5 - actual.now))
