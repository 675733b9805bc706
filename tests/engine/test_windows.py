"""Lane figures per window and batch-means intervals: the windows add up to the lane's totals, a
lane against itself is exactly 1 with no width, and the t-interval is the textbook one."""

from __future__ import annotations

import time

import pytest

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import jobs_from
from shadow.engine.lane import Lane
from shadow.engine.windows import Interval, Windows, interval
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
        assert iv.windows >= 3
        assert (iv.ratio, iv.low, iv.high) == (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0))
        assert iv.verdict == "no significant difference"
    # BR-0 against JSQ on a saturated paper-like fleet: lower spread, an interval that says so
    br0 = windows.compare("br0", "jsq", STEP, 4)["spread"]
    assert br0.ratio is not None and br0.ratio > 1.0
    assert br0.verdict in ("better", "no significant difference")


def test_interval_is_the_t_interval_and_verdicts_follow_it() -> None:
    iv = interval([1.0, 2.0, 3.0])
    assert iv.ratio == 2.0
    assert iv.low == pytest.approx(2.0 - 4.303 / 3**0.5, abs=1e-3)
    assert iv.high == pytest.approx(2.0 + 4.303 / 3**0.5, abs=1e-3)
    assert iv.verdict == "no significant difference"
    assert interval([1.5, 1.6, 1.7, 1.55]).verdict == "better"
    assert interval([0.5, 0.6, 0.55]).verdict == "worse"
    two = interval([1.5, 1.6])
    assert (two.ratio, two.low, two.verdict) == (pytest.approx(1.55), None, "too few windows")
    assert interval([]) == Interval(None, None, None, 0, 0)


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window must be > 0 s"):
        Windows([], window_s=0.0)
