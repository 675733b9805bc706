"""The twin check averages each side over the same windows of time, exactly; and a live driver's
twin of servers that schedule as its lanes do (a lane standing in for them, `tests.engine.servers`)
measures their latencies, KV cache and speed off their probe's steps and reproduces their running
requests and KV."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, EngineLimits, LaneClock
from shadow.engine.live import LiveDriver
from shadow.engine.twincheck import TwinCheck, _Series
from tests.engine.servers import server_events


@settings(max_examples=50, deadline=None)
@given(points=st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 100.0)), min_size=1, max_size=30),
       window=st.floats(0.3, 4.0))
def test_a_step_function_is_integrated_exactly_into_windows(points: list[tuple[float, float]],
                                                             window: float) -> None:
    points = sorted(points)
    s = _Series(1, window)
    for t, v in points:
        s.set(t, [v])
    s.advance(12.0)
    total = sum(s.take(i)[0] * window for i in list(s.sums))
    ends = [p[0] for p in points[1:]] + [12.0]
    exact = sum(v * (end - t) for (t, v), end in zip(points, ends, strict=True))
    assert total == pytest.approx(exact, rel=1e-9, abs=1e-9)


def test_the_same_series_on_both_sides_is_no_error_and_a_late_one_is_its_share() -> None:
    check = TwinCheck(1, 1.0, lambda g: 100.0)
    for t in (0.5, 1.5, 2.5, 3.5, 4.5):
        check.mirror(t, [10.0])
        check.lane(0, t, 10.0, 2, 50.0)
        check.engine(0, t, 2, 0.5)
    check.mirror(6.0, [10.0])
    check.lane(0, 6.0, 10.0, 2, 50.0)
    check.settle(10.0, slack_s=0.0)
    assert check.windows >= 4
    assert check.error("placed") == 0 and check.error("running") == 0 and check.error("kv") == 0
    late = TwinCheck(1, 1.0, lambda g: None)
    late.mirror(0.0, [10.0])
    late.lane(0, 0.0, 0.0, 0, 0.0)
    late.lane(0, 1.25, 10.0, 0, 0.0)  # the twin places it a quarter of the window late
    late.mirror(3.0, [10.0])
    late.lane(0, 3.0, 10.0, 0, 0.0)
    late.settle(3.0)
    # windows 1..2 count: the first is 2.5 of 10 off, the second none
    assert late.error("placed") == pytest.approx(2.5 / 20.0)
    assert late.error("kv") is None


BOUNDED = EngineLimits(max_num_batched_tokens=512, kv_tokens=128 * 40, block_tokens=128)


@pytest.mark.parametrize("limits", [EngineLimits(block_tokens=128), BOUNDED],
                         ids=["unbounded", "budget-and-kv"])
def test_a_twin_of_servers_that_schedule_as_its_lanes_do_reproduces_them(limits: EngineLimits) -> None:
    models = [StepTimeModel(0.0, 0.004, 0.0008, 4e-5), StepTimeModel(0.0, 0.006, 0.001, 3e-5)]
    run = server_events(models, front=[0.02, 0.05], back=[0.1, 0.2], limits=limits, slots=4, n=400,
                        rate=6.0, seed=7)
    config = EngineConfig(workers=2, slots=4, step=models[0], limits=limits)
    driver = LiveDriver(config, [], ["d0", "d1"], time.perf_counter, lag_s=1.0)
    driver.set_clock(LaneClock.independent(2, models))
    t_end = run.events[-1].t
    tick = 0.05
    t = run.events[0].t
    for ev in run.events:
        while ev.t > t:
            driver.advance_to(t)
            t += tick
        driver.apply(ev)
    driver.advance_to(t_end + 5.0)
    driver.drain()
    assert driver.servers is not None and driver.twin is not None
    for g, (front, back) in enumerate([(0.02, 0.1), (0.05, 0.2)]):
        assert driver.servers.block_tokens(g) == 128
        assert driver.servers.back(g) == pytest.approx(back, abs=1e-6)
        f = driver.servers.front(g)
        assert f is not None and front - 1e-9 <= f <= front + 0.03  # + the wait for a step boundary
    figures = driver.twin.figures()
    assert figures["engine_windows"] >= 5
    # the same scheduler, latencies within a step of the truth, the same step models: within a few %
    assert figures["running_vs_engine"] < 0.05, figures
    assert figures["kv_vs_engine"] < 0.05, figures
    assert driver.lanes[0].totals.finished == len(run.jobs)
