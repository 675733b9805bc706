"""ServerTimes measures what a server does around its engine from probe-like steps and request
events: here the "server" is a lane with known latencies, KV blocks and step times, and what
ServerTimes reads off its steps must be what it was given — also when the probe's steps come in
late, in batches, behind the requests' events."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, EngineLimits, LaneSpec
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.servertimes import MAX_LATENCY_S, ServerTimes

BLOCK = 128
BLOCKS = 1000


class _Probe(Observer):
    """What an engine probe would post for a one-worker lane: after each step, its end, period,
    running, waiting, tokens and KV usage."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int, int, int, float]] = []
        self._busy = 0.0
        self._tokens = 0

    def stepped(self, lane: Lane) -> None:
        tokens = lane.totals.tokens - self._tokens
        period = lane.totals.busy_time_s - self._busy
        self._tokens, self._busy = lane.totals.tokens, lane.totals.busy_time_s
        self.steps.append((lane.now, period, lane.engine_running(0), lane.engine_waiting()[0],
                           tokens, lane.kv_blocks(0, BLOCK) / BLOCKS))


def _server(front: float, back: float, step: StepTimeModel, n: int, seed: int, slots: int = 4
            ) -> tuple[list[tuple[str, float, object]], float]:
    """Events of a one-worker server run: ("place"|"end"|"step", t, payload), in time order."""
    rng = random.Random(seed)
    config = EngineConfig(workers=1, slots=slots, step=step,
                          limits=EngineLimits(kv_tokens=BLOCK * BLOCKS, block_tokens=BLOCK))
    forced = {i: 0 for i in range(n)}
    lane = Lane(LaneSpec("forced"), config, time.perf_counter, forced=forced)  # type: ignore[arg-type]
    lane.set_latency([front], [back])
    events: list[tuple[str, float, object]] = []
    lane.on_done = lambda rid: events.append(("end", lane.totals.last_finish_s + back, None))
    probe = _Probe()
    driver = LaneDriver(lane, observers=(probe,))
    t = 0.0
    jobs = []
    for i in range(n):
        t += rng.expovariate(4.0)
        job = Job(i, t, rng.randint(50, 900), rng.randint(1, 40))
        jobs.append(job)
        events.append(("place", t, job))
    for job in jobs:
        driver.offer(job, job.arrival_s)
    driver.drain()
    events += [("step", s[0], s) for s in probe.steps]
    events.sort(key=lambda e: (e[1], e[0] != "place"))
    return events, lane.totals.busy_time_s


def _feed(times: ServerTimes, events: list[tuple[str, float, object]]) -> None:
    for kind, t, payload in events:
        if kind == "place":
            assert isinstance(payload, Job)
            times.placed(0, t, str(payload.request_id), payload.prompt_tokens)
        elif kind == "end":
            times.ended(0, t, "?", 1)
        else:
            assert isinstance(payload, tuple)
            end, period, running, waiting, tokens, usage = payload
            times.step(0, end, period, running, waiting, tokens, 0, usage, 0.0)


Timed = list[tuple[str, float, object]]


def _late(events: Timed, delay: float, seed: int) -> Timed:
    """The probe's steps posted every 0.1 s, each batch delivered up to `delay` s late, in order."""
    rng = random.Random(seed)
    keyed, last = [], 0.0
    for e in events:
        key = e[1]
        if e[0] == "step":
            last = max(last, (int(e[1] / 0.1) + 1) * 0.1 + rng.uniform(0.0, delay))
            key = last
        keyed.append((key, e))
    keyed.sort(key=lambda x: x[0])
    return [e for _, e in keyed]


@settings(max_examples=15, deadline=None)
@given(front=st.floats(0.0, 0.2), back=st.floats(0.0, 0.5), b=st.floats(0.002, 0.05), seed=st.integers(0, 99),
       late=st.floats(0.0, 2.0))
def test_latencies_and_kv_cache_are_read_off_the_steps(front: float, back: float, b: float, seed: int,
                                                        late: float) -> None:
    step = StepTimeModel(0.0, b, 0.1 * b, 1e-5)
    events, _ = _server(front, back, step, 60, seed)
    times = ServerTimes(1, [step])
    _feed(times, _late(events, late, seed))
    assert times.desyncs == 0
    # admitted at the first step boundary after it arrived: up to one step (plus a prefill's) later
    f = times.front(0)
    assert f is not None and front - 1e-9 <= f <= front + 2 * b + 0.01
    back_s = times.back(0)
    assert back_s == pytest.approx(back, abs=1e-9)
    assert times.block_tokens(0) == BLOCK
    assert times.kv_tokens(0) == BLOCK * BLOCKS


def test_the_host_speed_is_measured_over_modelled_steps() -> None:
    # the server steps at twice its model's time: a factor of 2 wherever it stepped, 1 elsewhere
    true = StepTimeModel(0.0, 0.02, 0.004, 2e-5)
    events, _ = _server(0.01, 0.05, true, 40, 3)
    model = StepTimeModel(0.0, 0.01, 0.002, 1e-5)
    times = ServerTimes(1, [model])
    _feed(times, events)
    stepped = [e[1] for e in events if e[0] == "step"]
    inside = [times.speed(0, t) for t in stepped[5:-5:7]]
    assert inside and all(x == pytest.approx(2.0, rel=0.15) for x in inside)
    assert times.speed(0, stepped[-1] + 100.0) == 1.0


def test_a_request_that_never_reached_the_engine_leaves_the_admission_order() -> None:
    times = ServerTimes(1, [StepTimeModel(0.0, 0.01)])
    times.placed(0, 0.0, "lost", 100)
    times.placed(0, 0.1, "a", 100)
    times.ended(0, 0.2, "lost", 0)  # no token: never admitted
    times.step(0, 0.16, 0.01, 1, 0, 1, 0, 0.01, 0.0)  # admits "a" at 0.15
    assert times.front(0) == pytest.approx(0.05)
    assert times.desyncs == 0


def test_without_a_probe_or_without_events_nothing_waits_for_a_partner_forever() -> None:
    # an SSE-only fleet never admits a placement nor finishes a step; a worker whose streams are not
    # tapped never ends one: what waits for a partner is kept for MAX_LATENCY_S, not for the run
    times = ServerTimes(2, [StepTimeModel(0.0, 0.01)] * 2)
    for i in range(20_000):  # 10 requests a second for 2,000 s on worker 0
        t = 0.1 * i
        times.placed(0, t, f"r{i}", 100)
        times.ended(0, t + 1.0, f"r{i}", 5)
        times.step(1, t, 0.1, 0, 0, 1, 0, None, 0.0)  # worker 1: a finish in every step, no stream
    w0, w1 = times.w
    assert len(w0.placed) <= 10 * MAX_LATENCY_S + 1 and len(w0.ends) <= 10 * MAX_LATENCY_S + 1
    assert len(w1.finished) <= 10 * MAX_LATENCY_S + 1
    assert times.desyncs > 3 * 19_000  # each one dropped is counted
