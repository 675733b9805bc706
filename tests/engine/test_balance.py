"""Balance in the field's units (shadow.engine.balance) against hand-computed values: the tally
alone on three steps, and a two-worker lane whose loads are worked out step by step; the identity
1 − balance ratio = I(k)/(G·max L) per step."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.balance import BALANCE_FIGURES, BalanceTally
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.results import lane_result
from tests.engine.helpers import run_lane


def _tally(steps: list[tuple[list[float], float]]) -> BalanceTally:
    t = BalanceTally()
    for loads, dt in steps:
        t.add(max(loads), min(loads), sum(loads), len(loads), dt)
    return t


def test_three_steps_by_hand() -> None:
    # ratios 3/4, 1, 1/2 for 1 s, 3 s, 1 s: time-weighted mean (0.75 + 3 + 0.5) / 5 = 0.85;
    # p10 of the time (0.5 s of 5) lies in the 1/2 step; max/min 2, 1, ∞ over the steps
    t = _tally([([4.0, 2.0], 1.0), ([3.0, 3.0], 3.0), ([6.0, 0.0], 1.0)])
    f = t.figures(100.0)
    assert list(f) == list(BALANCE_FIGURES)
    assert f["balance_ratio_mean"] == pytest.approx(0.85)
    assert f["idle_rate"] == pytest.approx(0.15)
    assert f["balance_ratio_p10"] == pytest.approx(0.5)
    assert f["sol_throughput_tokens_per_s"] == pytest.approx(100 / 0.85)
    assert f["max_min_ratio_p50"] == pytest.approx(2.0, rel=0.011)  # 1 % bins
    assert f["max_min_ratio_p90"] is None and f["max_min_ratio_p95"] is None  # in the ∞ step
    assert f["zero_min_fraction"] == pytest.approx(1 / 3)
    # a step with no load counts for nothing; before any step every figure is None
    assert _tally([([0.0, 0.0], 9.0)]).figures(5.0) == BalanceTally().figures(5.0)
    assert all(v is None for v in BalanceTally().figures(None).values())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.lists(st.floats(0, 1e6), min_size=1, max_size=8), st.floats(1e-4, 1.0)),
                min_size=1, max_size=30))
@example(steps=[([0.0, 5e-324], 0.5)])  # a CI run's case: the oracle's dt·(n·max − Σ) underflowed to 0
def test_one_minus_the_balance_ratio_is_i_k_over_g_max_l(steps) -> None:  # type: ignore[no-untyped-def]
    t = _tally(steps)
    kept = [(loads, dt) for loads, dt in steps if max(loads) > 0]
    if not kept:
        assert t.ratio_mean() is None
        return
    # (the step's idle share first, then its weight: dt * (n·max − Σ) underflows for subnormal loads)
    idle = sum(dt * ((len(x) * max(x) - sum(x)) / (len(x) * max(x))) for x, dt in kept)
    idle /= sum(dt for _, dt in kept)
    assert t.figures(1.0)["idle_rate"] == pytest.approx(idle, abs=1e-9)
    p10 = t.ratio_quantile(0.1)
    assert p10 is not None
    total = sum(dt for _, dt in kept)
    rs = [(sum(x) / (len(x) * max(x)), dt) for x, dt in kept]
    # at least a tenth of the time at or below p10's bin; less than a tenth below the bin
    assert sum(dt for r, dt in rs if r < p10 + 1e-3) >= 0.1 * total * (1 - 1e-9)
    assert sum(dt for r, dt in rs if r < p10 - 1e-9) < 0.1 * total * (1 + 1e-9)


def test_a_two_worker_lane_by_hand() -> None:
    # rr: job 0 (prompt 10, 2 tokens) on worker 0, job 1 (prompt 30, 1 token) on worker 1.
    # step 1: loads [10, 30], T = 0.01·30 + 0.1 = 0.4 s, ratio 20/30; job 1 ends.
    # step 2: loads [11, 0],  T = 0.01·11 + 0.1 = 0.21 s, ratio 5.5/11; job 0 ends.
    config = EngineConfig(workers=2, slots=4, step=StepTimeModel(a=0.01, b=0.1))
    lane = Lane(LaneSpec.parse("rr"), config, time.perf_counter)
    jobs = [Job(0, 0.0, 10, 2), Job(1, 0.0, 30, 1)]
    run_lane(lane, jobs, [0.0, 0.0])
    r = lane_result(lane, 2, 0)
    mean = (0.4 * 20 / 30 + 0.21 * 0.5) / 0.61
    assert r.balance["balance_ratio_mean"] == pytest.approx(mean)
    assert r.balance["idle_rate"] == pytest.approx(1 - mean)
    assert r.balance["balance_ratio_p10"] == pytest.approx(0.5)  # 0.21 s of 0.61 s at 1/2
    assert r.balance["max_min_ratio_p50"] == pytest.approx(3.0, rel=0.011)
    assert r.balance["zero_min_fraction"] == 0.5
    assert r.throughput_tokens_per_s == pytest.approx(3 / 0.61)
    assert r.balance["sol_throughput_tokens_per_s"] == pytest.approx(3 / 0.61 / mean)
    # the per-step identity against the lane's own I(k): Σ I(k)/(G·max L) weighted by step time
    assert 1 - mean == pytest.approx((0.4 * (60 - 40) / 60 + 0.21 * (22 - 11) / 22) / 0.61)
    assert math.isclose(lane.totals.sum_imbalance, (60 - 40) + (22 - 11))
    assert r.figures()["balance_ratio_mean"] == r.balance["balance_ratio_mean"]  # flat in the JSON
