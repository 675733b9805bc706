"""The one lane driver: offers at ready times, steps between them, the admission rules it applies
(bounded queue, admission timeout: counted in the lane's totals), where it stops, and what its
observers are told and when."""

from __future__ import annotations

import math
import time

import pytest

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import Admission, LaneDriver, Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane

UNIT = StepTimeModel(a=0.0, b=1.0)  # every step takes 1 s


def _lane(policy: str = "rr", slots: int = 1) -> Lane:
    return Lane(LaneSpec.parse(policy), EngineConfig(workers=1, slots=slots, step=UNIT), time.perf_counter)


class _Log(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[str, float, object]] = []

    def offering(self, lane: Lane, job: Job) -> None:
        self.events.append(("offer", lane.now, job.request_id))

    def stepping(self, lane: Lane) -> None:
        self.events.append(("stepping", lane.now, lane.k))

    def stepped(self, lane: Lane) -> None:
        self.events.append(("stepped", lane.now, lane.k))


def test_jobs_are_offered_at_the_first_boundary_at_or_after_their_ready_time_and_observers_see_it() -> None:
    log = _Log()
    driver = LaneDriver(_lane(), observers=(log,))
    for job, ready in ((Job("a", 0.0, 1, 2), 0.0), (Job("b", 0.5, 1, 1), 0.5), (Job("c", 5.0, 1, 1), 5.0)):
        assert driver.offer(job, ready)
    driver.drain()
    assert log.events == [
        ("offer", 0.0, "a"),
        ("stepping", 0.0, 0), ("stepped", 1.0, 1),  # b is ready at 0.5: offered at the boundary 1.0
        ("offer", 1.0, "b"),
        ("stepping", 1.0, 1), ("stepped", 2.0, 2),  # a's second token; b waits for the one slot
        ("stepping", 2.0, 2), ("stepped", 3.0, 3),  # b runs
        ("stepping", 3.0, 3),  # nothing runs: the idle lane jumps to c's ready time
        ("offer", 5.0, "c"),
        ("stepping", 5.0, 3), ("stepped", 6.0, 4),
    ]
    assert driver.offered == 3 and driver.tokens == 4 and driver.lane.totals.finished == 3


def test_a_bounded_queue_refuses_arrivals_while_it_is_full_and_counts_them_as_shed() -> None:
    lane = _lane("rr", slots=1)
    driver = LaneDriver(lane, admission=Admission(queue_cap=2))
    for i in range(5):  # all at t=0, before any step: two wait, three are refused
        driver.offer(Job(i, 0.0, 1, 3), 0.0)
    assert driver.offered == 2 and lane.totals.shed == 3 and lane.waiting == 2
    driver.drain()
    assert lane.totals.finished == 2 and lane.totals.shed == 3


@pytest.mark.parametrize("policy", ["jsq-bytes", "br0"])
def test_the_admission_timeout_sheds_waiting_requests_at_each_boundary(policy: str) -> None:
    lane = _lane(policy, slots=1)
    driver = LaneDriver(lane, admission=Admission(timeout_s=1.5))
    driver.offer(Job("long", 0.0, 1, 10), 0.0)
    driver.offer(Job("late", 0.0, 1, 1), 0.0)  # waits behind `long` for the one slot
    driver.advance(3.0)
    # boundaries at 0, 1, 2: `late` has waited 2 s > 1.5 at t=2 and is shed there
    assert lane.totals.shed == 1 and lane.waiting == 0 and lane.k == 3
    driver.run_out()
    assert lane.totals.finished == 1


def test_a_driver_stops_at_its_stop_time_without_offering_later_jobs() -> None:
    lane = _lane("rr", slots=4)
    log = _Log()
    driver = LaneDriver(lane, observers=(log,), stop_at=2.0)
    assert driver.offer(Job("a", 0.0, 1, 10), 0.0)
    assert driver.offer(Job("b", 1.0, 1, 10), 1.0)  # offered at the boundary 1.0 (< 2.0)
    assert not driver.offer(Job("c", 3.0, 1, 10), 3.0)  # the lane stops at 2.0, c never offered
    assert driver.stopped and lane.now == 2.0 and lane.k == 2 and driver.offered == 2
    assert log.events[-1] == ("stepping", 2.0, 2)  # told of the boundary it stopped at
    driver.run_out()  # a stopped lane does not move again
    assert lane.k == 2


def test_an_idle_lane_with_a_nan_ready_time_is_an_error_naming_it() -> None:
    driver = LaneDriver(_lane())
    driver.offer(Job("a", 0.0, 1, 1), 0.0)
    with pytest.raises(RuntimeError, match=r"^lane rr: idle at t=1\.0 with a job ready at nan not offered$"):
        driver.offer(Job("b", 0.0, 1, 1), float("nan"))


def test_drain_refuses_a_lane_with_jobs_left_and_nothing_running() -> None:
    class Stuck(Lane):
        def step(self, until: float = math.inf) -> bool:
            return False

    lane = Stuck(LaneSpec("rr"), EngineConfig(workers=1, slots=1, step=UNIT), time.perf_counter)
    driver = LaneDriver(lane)
    driver.offer(Job("a", 0.0, 1, 1), 0.0)
    with pytest.raises(RuntimeError, match=r"^lane rr: jobs left but nothing runs \(engine bug\)$"):
        driver.drain()
