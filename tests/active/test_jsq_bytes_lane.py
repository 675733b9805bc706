"""The `jsq-bytes` lane is `shadow router`'s JSQ-bytes rule (the vllm-ascend proxy's): on the same
sequence of arrivals (each with its request-body size) and stream ends, the lane places every
request where the stand-in router's own dispatcher and ledger place it. The lane is driven first
(its steps decide when streams end); the router is then fed the events in the order the lane saw
them, as its proxy would feed them: `submit` with the body's bytes / 4 at a request's decode leg,
`released` at its stream's end.

Without body sizes (traces, older recordings) the lane keeps its estimate: 4 bytes per prompt
token, i.e. the order of outstanding prompt tokens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.active.standin import RouterConfig, router_proxy
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane


@dataclass(frozen=True, slots=True)
class _Arrive:
    job: Job
    worker: int  # where the lane placed it


@dataclass(frozen=True, slots=True)
class _End:
    request_id: str


class _Log(Observer):
    """The lane's arrivals (with its placement) and stream ends, in the order it saw them."""

    def __init__(self, lane: Lane) -> None:
        self.events: list[_Arrive | _End] = []
        self.before: list[float] = []
        lane.on_done = lambda rid: self.events.append(_End(str(rid)))

    def offering(self, lane: Lane, job: Job) -> None:
        self.before = list(lane.held_bytes)

    def placed(self, lane: Lane, job: Job) -> None:
        grew = [g for g, (a, b) in enumerate(zip(self.before, lane.held_bytes, strict=True)) if b > a]
        assert len(grew) == 1, (self.before, lane.held_bytes)
        self.events.append(_Arrive(job, grew[0]))


def _lane_run(jobs: list[Job], workers: int) -> list[_Arrive | _End]:
    config = EngineConfig(workers=workers, slots=64, step=StepTimeModel(1e-4, 0.01))
    lane = Lane(LaneSpec("jsq-bytes"), config, clock=lambda: 0.0)
    log = _Log(lane)
    driver = LaneDriver(lane, observers=(log,))
    for job in jobs:
        assert driver.offer(job, job.arrival_s)
        log.placed(lane, job)
    driver.drain()
    return log.events


def _router_run(events: list[_Arrive | _End], workers: int) -> list[int]:
    """The stand-in router's decode choices for the same arrivals and stream ends."""
    proxy = router_proxy(RouterConfig({f"d{g}": f"http://127.0.0.1:{9 + g}" for g in range(workers)}))
    dispatcher = proxy.dispatcher

    async def run() -> list[int]:
        out: list[int] = []
        for ev in events:
            if isinstance(ev, _End):
                dispatcher.released(ev.request_id)
                continue
            job = ev.job
            assert job.body_bytes is not None
            fut = dispatcher.submit(str(job.request_id), job.prompt_tokens, job.body_bytes / 4, "jsq-bytes")
            out.append(await asyncio.wait_for(fut, 30))
        return out

    return asyncio.run(run())


_REQUESTS = st.lists(
    st.tuples(
        st.floats(0.0, 0.05),  # gap to the previous arrival (s)
        st.integers(1, 4000),  # request-body bytes
        st.integers(1, 400),  # prompt tokens: unrelated to the bytes, so the two rules would differ
        st.integers(1, 30),  # output tokens
    ),
    min_size=1,
    max_size=40,
)


def _jobs(requests: list[tuple[float, int, int, int]], bodies: bool) -> list[Job]:
    out, t = [], 0.0
    for i, (gap, size, prompt, output) in enumerate(requests):
        t += gap
        out.append(Job(f"r{i}", t, prompt, output, body_bytes=size if bodies else None))
    return out


@settings(max_examples=40, deadline=None)
@given(_REQUESTS, st.integers(2, 4))
def test_the_lane_places_as_the_router_does(
    requests: list[tuple[float, int, int, int]], workers: int
) -> None:
    events = _lane_run(_jobs(requests, bodies=True), workers)
    lane = [ev.worker for ev in events if isinstance(ev, _Arrive)]
    assert len(lane) == len(requests)
    assert sum(isinstance(ev, _End) for ev in events) == len(requests)
    assert _router_run(events, workers) == lane


def test_bytes_not_tokens_decide() -> None:
    # d0 holds a small body with a long prompt, d1 a large body with a short one: the body bytes
    # send the third request to d0, the prompt tokens would send it to d1.
    jobs = [Job("a", 0.0, 500, 30, body_bytes=100), Job("b", 0.0, 10, 30, body_bytes=900),
            Job("c", 0.0, 10, 30, body_bytes=50)]
    events = _lane_run(jobs, 2)
    assert [ev.worker for ev in events if isinstance(ev, _Arrive)] == [0, 1, 0]
    assert _router_run(events, 2) == [0, 1, 0]


def test_without_bodies_the_prompt_tokens_stand_in() -> None:
    jobs = [Job("a", 0.0, 500, 30), Job("b", 0.0, 10, 30), Job("c", 0.0, 10, 30)]
    assert jobs[0].forwarded_bytes == 2000.0  # 4 bytes per prompt token
    events = _lane_run(jobs, 2)
    assert [ev.worker for ev in events if isinstance(ev, _Arrive)] == [0, 1, 1]
