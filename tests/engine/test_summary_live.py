"""The live lanes' bounded sample summary (LogHistogram) against exact counts, and the live
driver's lag figure at its edges (written against behaviour; kills mutants, docs/mutation.md)."""

from __future__ import annotations

import bisect
import math
import time

import numpy as np
import pytest

from shadow.contracts.events import Arrive, Cancel, Finish, Route, Token
from shadow.engine.config import EngineConfig, LaneSpec
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


def test_the_mirrored_loads_follow_the_events_and_return_to_zero() -> None:
    """Mirror twin: KV load (prompt + generated) and count of running requests (first token seen)
    per worker, and the load of every placed request not ended; token gaps, one sample per token."""
    cfg = EngineConfig(workers=2, slots=4)
    d = LiveDriver(cfg, [LaneSpec("br0")], ["d0", "d1"], time.perf_counter, lag_s=1.0)
    d.apply(Arrive("a", 1.0, 100))
    d.apply(Route("a", 1.0, "d1", 100))
    d.apply(Arrive("b", 1.0, 40))
    d.apply(Route("b", 1.1, "d1", 40))
    assert d.mirror_placed == [0.0, 140.0] and d.mirror_loads == [0.0, 0.0] and d.mirror_active == [0, 0]
    d.apply(Token("a", 2.0, 1))  # a runs
    assert d.mirror_active == [0, 1] and d.mirror_loads == [0.0, 101.0] and d.mirror_placed == [0.0, 141.0]
    d.apply(Token("a", 2.25, 2))
    d.apply(Token("a", 2.75, 5))  # three tokens at once: three steps of 0.5 / 3 s
    d.apply(Token("a", 2.5, 4))  # late and stale: ignored
    assert d.mirror_loads == [0.0, 105.0] and d.mirror_placed == [0.0, 145.0]
    assert [x for xs in d.take_gaps() for x in xs] == [0.25, 0.5 / 3, 0.5 / 3, 0.5 / 3]
    d.apply(Token("b", 3.0, 2))  # b's first token seen carries 2 generated
    assert d.mirror_active == [0, 2] and d.mirror_loads == [0.0, 147.0]
    d.apply(Finish("a", 3.0, "stop", 6))
    d.apply(Token("a", 3.1, 7))  # after its end: ignored
    assert d.mirror_active == [0, 1] and d.mirror_loads == [0.0, 42.0] and d.mirror_placed == [0.0, 42.0]
    d.apply(Cancel("b", 3.5))
    assert d.mirror_active == [0, 0] and d.mirror_loads == [0.0, 0.0] and d.mirror_placed == [0.0, 0.0]
    d.apply(Finish("zzz", 4.0, "stop", 1))  # never seen: counted, nothing else changes
    assert d.dropped == {"end_before_start": 1}


def test_percentiles_are_within_one_bucket_of_the_exact_ones() -> None:
    rng = np.random.default_rng(1)
    values = rng.lognormal(-3, 1.5, 5000)
    h = LogHistogram()
    for v in values:
        h.append(float(v))
    srt = np.sort(values)
    for q in (0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100):
        got = h.percentile(q)
        rank = q / 100 * (len(srt) - 1)
        lo, hi = srt[math.floor(rank)], srt[math.ceil(rank)]
        assert got is not None and lo / 1.0101 <= got <= hi * 1.0101, (q, got, lo, hi)
    z = LogHistogram()
    for v in (0.0, 0.0, 0.0, 2.0):  # three zeros: the lower three quarters are 0
        z.append(v)
    assert z.percentile(50) == 0.0 and z.percentile(66) == 0.0
    assert z.percentile(100) == pytest.approx(2.0, rel=0.0101)
