"""Lane figures per window and batch-means intervals: the windows add up to the lane's totals, a
lane against itself is exactly 1 with no width, and the interval is the t-interval of the log
ratios."""

from __future__ import annotations

import math
import time

import pytest

from shadow.core.intervals import RatioInterval, ratio_interval
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import jobs_from
from shadow.engine.lane import Lane
from shadow.engine.windows import Windows
from shadow.traces import at_load, estimate_capacity_rps, resolve
from tests.engine.helpers import run_lane

STEP = StepTimeModel()


def _lanes(*policies: str) -> tuple[list[Lane], Windows]:
    trace = resolve("paper-azure", seed=1, limit=600)
    capacity = estimate_capacity_rps(trace, workers=4, slots=32, step_a=STEP.a, step_b=STEP.b)
    trace = at_load(trace, 1.05, capacity)
    config = EngineConfig(workers=4, slots=32, step=STEP)
    jobs = jobs_from(trace.requests)
    specs = [LaneSpec.parse(p) if p != "twin" else LaneSpec("jsq", name="twin") for p in policies]
    lanes = [Lane(spec, config, time.perf_counter) for spec in specs]
    windows = Windows(lanes, window_s=20.0)
    for lane in lanes:
        run_lane(lane, jobs, [j.arrival_s for j in jobs], on_step=windows.stepped)
    return lanes, windows


def test_windows_add_up_to_the_lane_totals_and_a_lane_equals_its_twin() -> None:
    lanes, windows = _lanes("jsq", "twin", "br0")
    assert windows.complete >= 5
    for i, lane in enumerate(lanes):
        kept = windows.done[i]
        assert [w.index for w in kept] == list(range(windows.passed[i]))
        # the windows telescope: together they are the lane's totals at its last boundary
        _, steps, spread, _, _, tokens, _, _ = windows._mark[i]
        assert 0 < steps <= lane.totals.steps
        assert sum(w.steps for w in kept) == steps and sum(w.tokens for w in kept) == tokens
        assert sum(w.sum_spread for w in kept) == pytest.approx(spread)
    same = windows.compare("twin", "jsq", STEP, 4)
    for iv in same.values():
        assert iv.n >= 3
        assert (iv.ratio, iv.low, iv.high) == (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0))
        assert iv.verdict == "no significant difference"
    # BR-0 against JSQ on a saturated paper-like fleet: lower spread, an interval that says so
    br0 = windows.compare("br0", "jsq", STEP, 4)["spread"]
    assert br0.ratio is not None and br0.ratio > 1.0
    assert br0.verdict in ("better", "no significant difference")


def test_the_interval_is_the_t_interval_of_the_log_ratios_and_verdicts_follow_it() -> None:
    iv = ratio_interval([1.0, 2.0, 4.0])  # logs: 0, ln 2, 2 ln 2 -> mean ln 2, sd ln 2
    assert iv.ratio == pytest.approx(2.0)
    assert iv.low == pytest.approx(2.0 * math.exp(-4.302653 * math.log(2) / 3**0.5))
    assert iv.high == pytest.approx(2.0 * math.exp(4.302653 * math.log(2) / 3**0.5))
    assert iv.verdict == "no significant difference"
    assert ratio_interval([1.5, 1.6, 1.7, 1.55]).verdict == "better"
    assert ratio_interval([0.5, 0.6, 0.55]).verdict == "worse"
    two = ratio_interval([1.5, 1.6])
    assert (two.ratio, two.low, two.verdict) == (pytest.approx((1.5 * 1.6) ** 0.5), None, "too few windows")
    assert ratio_interval([]) == RatioInterval(None, None, None, 0, 0)


def test_windows_that_once_gave_a_negative_bound_give_a_positive_one() -> None:
    # The arithmetic mean of these window ratios is 1.77 with a t-interval of -5.2..8.7 (the demo
    # printed intervals such as "-0.04–2.61x"); on the log scale both bounds are positive.
    ratios = [0.1, 5.0, 0.2]
    mean = sum(ratios) / 3
    sd = (sum((r - mean) ** 2 for r in ratios) / 2) ** 0.5
    assert mean - 4.302653 * sd / 3**0.5 < 0  # what the old method said
    iv = ratio_interval(ratios)
    assert iv.low is not None and iv.high is not None
    assert 0 < iv.low < iv.ratio < iv.high


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window must be > 0 s"):
        Windows([], window_s=0.0)
