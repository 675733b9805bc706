"""Lanes on a clock of barrier groups with per-worker step models: independent servers step on
their own clocks, a shared barrier steps at its slowest member, regrouping keeps every request's
progress, and the live driver still goes through the steps the offline replay does."""

from __future__ import annotations

import time

import pytest

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneClock, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.live import LiveDriver
from shadow.engine.results import lane_result
from tests.engine.helpers import loads_from_slots, run_lane
from tests.live.sessions import session_events
from tests.live.test_live_driver import POLICIES, _feed, _offline

FAST, SLOW = StepTimeModel(a=0.0, b=1.0), StepTimeModel(a=0.0, b=4.0)


def _lane(clock: LaneClock, policy: str = "forced", slots: int = 4, **kw: object) -> Lane:
    config = EngineConfig(workers=2, slots=slots, step=StepTimeModel(a=0.0, b=100.0), clock=clock)
    forced = kw.get("forced")
    return Lane(LaneSpec(policy), config, time.perf_counter, forced=forced)  # type: ignore[arg-type]


def test_independent_servers_step_on_their_own_clocks() -> None:
    # one request of 8 tokens on each worker: w0 steps every 1 s, w1 every 4 s, no barrier
    lane = _lane(LaneClock.independent(2, [FAST, SLOW]), forced={"a": 0, "b": 1})
    ends: dict[object, float] = {}
    lane.on_done = lambda rid: ends.setdefault(rid, lane.now)
    lane.offer(Job("a", 0.0, 10, 8), 0.0)
    lane.offer(Job("b", 0.0, 10, 8), 0.0)
    for _ in range(16):
        assert lane.step() is True
        assert lane.loads == loads_from_slots(lane)
    assert lane.step() is False
    t = lane.totals
    assert t.finished == 2 and t.tokens == 16 and t.steps == 16  # 8 steps per worker
    assert sorted(t.tpot_s) == [1.0, 4.0] and sorted(t.ttft_s) == [1.0, 4.0]
    assert t.last_finish_s == 32.0 and lane.now == 32.0
    assert t.sum_idle_s == 0.0  # nobody waits at a barrier
    assert t.worker_time_s == 8 * 1.0 + 8 * 4.0
    r = lane_result(lane, 2, 0)
    assert r.makespan_s == 32.0 and r.barrier_idle_fraction == 0.0


def test_a_shared_barrier_steps_at_its_slowest_member() -> None:
    lane = _lane(LaneClock.barrier(2, [FAST, SLOW]), forced={"a": 0, "b": 1})
    lane.offer(Job("a", 0.0, 10, 8), 0.0)
    lane.offer(Job("b", 0.0, 10, 8), 0.0)
    for _ in range(8):
        assert lane.step() is True
    assert lane.step() is False
    t = lane.totals
    assert t.steps == 8 and t.tokens == 16 and sorted(t.tpot_s) == [4.0, 4.0]
    assert t.sum_idle_s == pytest.approx(8 * 3.0)  # w0 waits 3 s of every 4 s step
    assert lane_result(lane, 2, 0).barrier_idle_fraction == pytest.approx(3.0 / 8.0)


def test_the_barrier_clock_with_the_fleet_model_is_the_default_engine() -> None:
    """LaneClock.barrier without models is exactly the engine without a clock (same steps, times)."""
    jobs = [Job(i, 0.3 * i, 20 + 7 * (i % 5), 3 + i % 11) for i in range(60)]
    results = []
    for clock in (None, LaneClock.barrier(3)):
        config = EngineConfig(workers=3, slots=4, step=StepTimeModel(a=0.01, b=0.5), clock=clock)
        lane = Lane(LaneSpec("br0"), config, time.perf_counter)
        run_lane(lane, jobs, [j.arrival_s for j in jobs])
        t = lane.totals
        results.append((t.steps, t.busy_time_s, t.sum_spread, t.last_finish_s, sorted(t.tpot_s)))
    assert results[0] == results[1]


def test_a_pool_router_places_on_a_worker_mid_step_and_the_request_starts_at_its_boundary() -> None:
    """At t=1 the slow worker (4 s steps) is in the middle of its first step; BR-0 places c on the
    lighter worker; on the slow one, c waits until that step ends at t=4, on the fast one not at all.
    Both model orders are run, so one of them is the mid-step case."""
    waits = []
    for models in ([FAST, SLOW], [SLOW, FAST]):
        lane = _lane(LaneClock.independent(2, models), policy="br0", slots=2)
        lane.offer(Job("a", 0.0, 500, 20), 0.0)
        lane.offer(Job("b", 0.0, 10, 20), 0.0)
        for _ in range(3):
            if lane.now >= 1.0:
                break
            assert lane.step()
        assert lane.now == 1.0 and lane.running == [1, 1]
        small = 0 if lane.loads[0] < lane.loads[1] else 1
        lane.offer(Job("c", 1.0, 5, 3), 1.0)
        lane.step()
        if models[small] is SLOW:  # placed mid-step: waiting at its worker, not started
            assert len(lane.queues[small]) == 1 and lane.running[small] == 1 and lane.waiting == 1
        while lane.totals.finished < 1:
            assert lane.step()
        wait = sorted(lane.totals.wait_s)[-1]
        waits.append(wait)
        assert wait == pytest.approx(3.0 if models[small] is SLOW else 0.0)
    assert sorted(waits) == pytest.approx([0.0, 3.0])


def test_regrouping_mid_run_keeps_every_request_s_progress() -> None:
    lane = _lane(LaneClock.barrier(2, [FAST, SLOW]), forced={"a": 0, "b": 1, "c": 1, "d": 0, "e": 1})
    done: list[object] = []
    lane.on_done = done.append
    for job in (Job("a", 0.0, 10, 12), Job("b", 0.0, 10, 6), Job("c", 0.0, 3, 9)):
        lane.offer(job, 0.0)
    for _ in range(3):  # three barrier steps of 4 s: every request has 3 tokens
        assert lane.step()
    assert lane.now == 12.0 and lane.loads == [13.0, 19.0]
    lane.set_clock(LaneClock.independent(2, [FAST, SLOW]))
    assert lane.clock_groups == [(0,), (1,)]
    for _ in range(40):
        if not lane.step():
            break
        assert lane.loads == loads_from_slots(lane)
    assert lane.totals.tokens == 12 + 6 + 9 and sorted(map(str, done)) == ["a", "b", "c"]
    assert lane.loads == [0.0, 0.0]
    # a: 3 tokens by t=12, 9 more at 1 s; b and c: 3 more / 6 more at 4 s
    assert lane.totals.last_finish_s == pytest.approx(12.0 + 6 * 4.0)
    # and back: two workers in one group again
    lane.offer(Job("d", 36.0, 1, 2), 36.0)
    lane.offer(Job("e", 36.0, 1, 2), 36.0)
    assert lane.step() and lane.now == 36.0  # w0 stepped d (36 -> 37); w1 has not started e
    # one barrier again: w1 waits for w0's step in progress (until 37), then 4 s steps for both
    lane.set_clock(LaneClock.barrier(2, [FAST, SLOW]))
    assert lane.step() and lane.now == 41.0 and lane.totals.finished == 4  # d's 2nd token
    assert lane.step() and lane.now == 45.0 and not lane.step()  # e's 2nd token
    assert lane.totals.finished == 5 and lane.totals.last_finish_s == 45.0


def test_a_clock_that_does_not_partition_the_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="partition"):
        EngineConfig(workers=3, clock=LaneClock(((0, 1),)))
    with pytest.raises(ValueError, match="step models"):
        EngineConfig(workers=2, clock=LaneClock.independent(2, [FAST]))


@pytest.mark.parametrize("shared", [False, True])
def test_live_lanes_equal_the_offline_replay_on_per_worker_clocks(shared: bool) -> None:
    g, b = 4, 16
    events, reqs = session_events(300, g, b, rho=1.0, token_every=16)
    models = [StepTimeModel(a=1e-7 * (1 + w), b=0.01 * (1 + 2 * w)) for w in range(g)]
    clock = LaneClock.barrier(g, models) if shared else LaneClock.independent(g, models)
    cfg = EngineConfig(workers=g, slots=b, clock=clock)
    specs = [LaneSpec.parse(p) for p in POLICIES]
    driver = LiveDriver(cfg, specs, [f"d{i}" for i in range(g)], time.perf_counter, lag_s=2.0)
    _feed(driver, events)
    driver.drain()
    off = _offline(reqs, cfg, specs)
    for lane in driver.lanes:
        r, o = lane_result(lane, driver.released, 0), off[lane.spec.label]
        assert r.finished == o.finished == 300
        assert r.tokens == o.tokens
        assert r.steps == o.steps, lane.spec.label
        assert r.makespan_s == pytest.approx(o.makespan_s, rel=1e-9)
    if not shared:  # the slowest server makes fewer steps than the fastest
        steps = [lane.totals.steps for lane in driver.lanes]
        assert all(s > 0 for s in steps)
