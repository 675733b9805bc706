"""The drivers' loops stop with a clear error instead of spinning forever.

An engine bug or a hostile input that makes no progress (a step that claims to run but moves no
step count, requests that never finish, an idle lane whose next job is not later than its clock,
a job offered twice) raises, naming the lane. Each test here breaks a lane on purpose and runs the
driver on it; every lane used carries a fuse (`_Fused`) that fails the test after a fixed number of
steps, so a test whose guard were missing fails in milliseconds instead of hanging.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable

import pytest

from shadow.contracts.events import Arrive, Finish, Route, Token
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane, checked_step
from shadow.engine.live import LiveDriver
from shadow.engine.offline import run_lanes
from tests.engine.helpers import run_lane

UNIT = StepTimeModel(a=1.0, b=0.0)
FUSE = 200  # steps a test lane may take before the test fails (every test here needs far fewer)


class _Fused(Lane):
    """A lane that fails the test (AssertionError) once `step` was called more than FUSE times."""

    calls = 0

    def step(self, until: float = math.inf) -> bool:
        self.calls += 1
        if self.calls > FUSE:
            raise AssertionError(f"lane {self.spec.label}: driver still stepping after {FUSE} steps")
        return super().step(until)


class _Frozen(_Fused):
    """Claims every step ran, but neither the step count nor the clock moves (a no-progress bug)."""

    def step(self, until: float = math.inf) -> bool:
        super().step(until)  # count the call (the fuse) and run it,
        self.k -= 1 if self.k > 0 else 0  # then undo the step count
        return True


class _Leaping(_Fused):
    """Steps run, but the step count jumps by two."""

    def step(self, until: float = math.inf) -> bool:
        ran = super().step(until)
        self.k += 1
        return ran


class _Endless(_Fused):
    """Requests never finish: every booked finish is dropped (steps keep running)."""

    def step(self, until: float = math.inf) -> bool:
        self.barrier.calendars[0].clear()
        return super().step(until)


def _lane(cls: type[_Fused] = _Fused, policy: str = "rr", workers: int = 1, slots: int = 2) -> _Fused:
    return cls(LaneSpec(policy), EngineConfig(workers=workers, slots=slots, step=UNIT), time.perf_counter)


# -- checked_step ---------------------------------------------------------------------------


def test_checked_step_passes_a_correct_step_through_up_to_the_budget() -> None:
    lane = _lane()
    lane.offer(Job(0, 0.0, 1, 2), 0.0)
    assert checked_step(lane, 2) is True and lane.k == 1
    assert checked_step(lane, 2) is True and lane.k == 2  # exactly the budget: still fine
    assert checked_step(lane, 2) is False and lane.k == 2  # idle: no step, nothing raised
    assert lane.totals.finished == 1


def test_checked_step_refuses_a_step_that_ran_without_moving_the_step_count() -> None:
    lane = _lane(_Frozen)
    lane.offer(Job(0, 0.0, 1, 3), 0.0)
    frozen = r"^lane rr: step 0 ran but the step count is now 0 \(engine bug\)$"
    with pytest.raises(RuntimeError, match=frozen):
        checked_step(lane)


def test_checked_step_refuses_a_step_count_that_jumps() -> None:
    lane = _lane(_Leaping)
    lane.offer(Job(0, 0.0, 1, 3), 0.0)
    with pytest.raises(RuntimeError, match="lane rr: step 0 ran but the step count is now 2"):
        checked_step(lane)
    idle = _lane(_Leaping)  # nothing to run: step() is False, yet the count moved
    with pytest.raises(RuntimeError, match="lane rr: step 0 did not run but the step count is now 1"):
        checked_step(idle)


def test_checked_step_refuses_more_steps_than_output_tokens_offered() -> None:
    lane = _lane()
    lane.offer(Job(0, 0.0, 1, 5), 0.0)
    assert checked_step(lane, 1) is True
    never = r"^lane rr: 2 steps ran for 1 output tokens offered: requests never finish \(engine bug\)$"
    with pytest.raises(RuntimeError, match=never):
        checked_step(lane, 1)


# -- offline drivers ----------------------------------------------------------------------


def test_run_lane_stops_a_lane_whose_steps_make_no_progress() -> None:
    lane = _lane(_Frozen)
    with pytest.raises(RuntimeError, match="lane rr: step 0 ran but the step count is now 0"):
        run_lane(lane, [Job(0, 0.0, 1, 2)], [0.0])
    assert lane.calls == 1


def test_run_lane_stops_a_lane_whose_requests_never_finish_after_their_tokens() -> None:
    lane = _lane(_Endless)
    jobs = [Job(0, 0.0, 1, 3), Job(1, 0.0, 1, 4)]
    with pytest.raises(RuntimeError, match="lane rr: 8 steps ran for 7 output tokens offered"):
        run_lane(lane, jobs, [0.0, 0.0])
    assert lane.calls == 8


def test_run_lane_refuses_a_nan_ready_time_instead_of_idling_forever() -> None:
    lane = _lane()
    with pytest.raises(RuntimeError, match=r"lane rr: idle at t=1\.0 with a job ready at nan not offered"):
        run_lane(lane, [Job(0, 0.0, 1, 1), Job(1, 0.0, 1, 1)], [0.0, math.nan])
    assert lane.totals.finished == 1


def test_run_lanes_stops_a_lane_that_makes_no_progress_while_jobs_arrive_and_at_the_drain() -> None:
    # while arriving: the lane is advanced to the second job's ready time
    lanes = [_lane(_Frozen)]
    with pytest.raises(RuntimeError, match="lane rr: step 0 ran but the step count is now 0"):
        run_lanes([Job(0, 0.0, 1, 2), Job(1, 5.0, 1, 1)], lanes)
    # at the drain: one job, offered at t=0, then the lanes run to the end
    lanes = [_lane(), _lane(_Frozen, policy="jsq")]
    with pytest.raises(RuntimeError, match="lane jsq: step 0 ran but the step count is now 0"):
        run_lanes([Job(0, 0.0, 1, 2)], lanes)
    assert lanes[0].totals.finished == 1  # the lanes drain in order: the first one finished


def test_run_lanes_stops_a_lane_whose_requests_never_finish() -> None:
    lanes = [_lane(_Endless)]
    with pytest.raises(RuntimeError, match="lane rr: 3 steps ran for 2 output tokens offered"):
        run_lanes([Job(0, 0.0, 1, 2)], lanes)
    lanes = [_lane(_Endless)]  # while advancing to the second job: 2 tokens offered before it
    with pytest.raises(RuntimeError, match="lane rr: 3 steps ran for 2 output tokens offered"):
        run_lanes([Job(0, 0.0, 1, 2), Job(1, 100.0, 1, 1)], lanes)


# -- offers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["rr", "br0"])
def test_a_request_still_in_the_lane_cannot_be_offered_again_but_can_after_it_finished(
    policy: str,
) -> None:
    lane = _lane(policy=policy)
    lane.offer(Job("a", 0.0, 1, 2), 0.0)
    with pytest.raises(ValueError, match=f"lane {policy}: request 'a' offered while still in the lane"):
        lane.offer(Job("a", 0.0, 1, 2), 0.0)  # waiting
    assert lane.step() is True
    with pytest.raises(ValueError, match="request 'a' offered while still in the lane"):
        lane.offer(Job("a", 0.0, 1, 2), 0.0)  # running
    assert lane.step() is True and lane.totals.finished == 1
    lane.offer(Job("a", 2.0, 1, 1), 2.0)  # finished: the id may come again
    assert lane.step() is True and lane.totals.finished == 2


@pytest.mark.parametrize("policy", ["rr", "br0"])
def test_a_shed_request_can_be_offered_again(policy: str) -> None:
    lane = _lane(policy=policy, slots=1)
    lane.offer(Job("a", 0.0, 1, 5), 0.0)
    assert lane.step() is True  # a runs
    lane.offer(Job("b", 0.0, 1, 1), 0.0)
    assert lane.shed_waiting(1.0) == 1  # b shed (waiting since 0.0)
    lane.offer(Job("b", 1.0, 1, 1), 1.0)
    with pytest.raises(ValueError, match="request 'a' offered while still in the lane"):
        lane.offer(Job("a", 1.0, 1, 1), 1.0)


def test_run_lane_refuses_a_job_given_twice_instead_of_offering_it_forever() -> None:
    lane = _lane()
    with pytest.raises(ValueError, match="lane rr: request 0 offered while still in the lane"):
        run_lane(lane, [Job(0, 0.0, 1, 2), Job(0, 0.0, 1, 2)], [0.0, 0.0])


def test_an_offline_job_without_output_tokens_is_refused_instead_of_running_forever() -> None:
    lane = _lane()
    with pytest.raises(ValueError, match="lane rr: request 'z' has 0 output tokens \\(at least 1\\)"):
        lane.offer(Job("z", 0.0, 1, 0), 0.0)
    lane.offer(Job("z", 0.0, 1, 1), 0.0)  # refused before it was recorded: a valid one is accepted
    assert lane.step() is True and lane.totals.finished == 1


# -- live driver ----------------------------------------------------------------------------


def _live(step_bug: type[Lane]) -> tuple[LiveDriver, list[int]]:
    """A live driver whose lanes run `step_bug.step` (fused); returns it and a per-lane call count."""
    config = EngineConfig(workers=1, slots=2, step=UNIT)
    d = LiveDriver(config, [LaneSpec("jsq")], ["d0"], time.perf_counter, lag_s=0.0)
    calls = [0] * len(d.lanes)
    for i, lane in enumerate(d.lanes):

        def step(until: float = math.inf, lane: Lane = lane, i: int = i) -> bool:
            calls[i] += 1
            if calls[i] > FUSE:
                raise AssertionError(f"lane {lane.spec.label}: driver still stepping after {FUSE} steps")
            return step_bug.step(lane, until)

        lane.step = step  # type: ignore[method-assign]
    return d, calls


def _frozen_step(lane: Lane, until: float = math.inf) -> bool:
    Lane.step(lane, until)
    lane.k -= 1 if lane.k > 0 else 0
    return True


class _FrozenLive(Lane):
    step = _frozen_step


def _request(d: LiveDriver, rid: Hashable, t: float, tokens: int) -> None:
    d.apply(Arrive(str(rid), t, 4))
    d.apply(Route(str(rid), t, "d0"))
    d.apply(Token(str(rid), t, tokens))


def test_the_live_driver_stops_a_lane_that_makes_no_progress_while_advancing() -> None:
    d, calls = _live(_FrozenLive)
    _request(d, "a", 0.0, 3)
    frozen = r"lane actual: step 0 ran but the step count is now 0 \(engine bug\)"
    with pytest.raises(RuntimeError, match=frozen):
        d.advance_to(50.0)
    assert calls[0] == 1


def test_the_live_driver_stops_a_lane_that_makes_no_progress_at_the_drain() -> None:
    d, calls = _live(_FrozenLive)
    _request(d, "a", 0.0, 3)
    d.apply(Finish("a", 0.0, "stop", 3))
    with pytest.raises(RuntimeError, match="lane actual: step 0 ran but the step count is now 0"):
        d.drain()
    assert calls[0] == 1


def test_the_live_driver_runs_correct_lanes_to_the_end_within_the_fuse() -> None:
    d, calls = _live(Lane)
    _request(d, "a", 0.0, 3)
    _request(d, "b", 1.0, 1)
    d.advance_to(100.0)
    d.apply(Finish("a", 2.0, "stop", 3))
    d.apply(Finish("b", 2.0, "stop", 1))
    d.drain()
    assert [lane.totals.finished for lane in d.lanes] == [2, 2] and calls[0] < 10
    assert d.open_requests() == 0


def _endless_step(lane: Lane, until: float = math.inf) -> bool:
    lane.barrier.calendars[0].clear()  # every booked finish dropped
    return Lane.step(lane, until)


class _EndlessLive(Lane):
    step = _endless_step


def test_the_live_driver_stops_a_lane_whose_requests_never_finish() -> None:
    # One request, 3 tokens: the budget is 3 tokens + 1 released = 4 steps; the 5th is refused.
    d, calls = _live(_EndlessLive)
    _request(d, "a", 0.0, 3)
    d.apply(Finish("a", 0.0, "stop", 3))
    with pytest.raises(RuntimeError, match="lane actual: 5 steps ran for 4 output tokens offered"):
        d.drain()
    assert calls[0] == 5
    d, calls = _live(_EndlessLive)  # and while advancing: lanes run on to the horizon
    _request(d, "b", 0.0, 2)
    d.apply(Finish("b", 0.0, "stop", 4))  # 2 more tokens reported by the Finish: budget 4 + 1
    with pytest.raises(RuntimeError, match="lane actual: 6 steps ran for 5 output tokens offered"):
        d.advance_to(1e6)
