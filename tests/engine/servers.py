"""A stand-in for real servers with an engine probe: a lane that schedules as vLLM does (its
`EngineLimits`), with known latencies and step models, run offline; what its requests' events and
its probe's steps would have been, as the contract's events (Route, Token, Finish; probe Steps)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from shadow.contracts.events import Arrive, Event, Finish, Route, Step, Token
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, EngineLimits, LaneClock, LaneSpec
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane


@dataclass(frozen=True)
class ServerRun:
    events: list[Event]  # in time order
    jobs: list[Job]
    lane: Lane  # the servers, after the run


def server_events(models: Sequence[StepTimeModel], *, front: Sequence[float], back: Sequence[float],
                  limits: EngineLimits, slots: int, n: int, rate: float, seed: int,
                  names: Sequence[str] | None = None) -> ServerRun:
    """`n` requests at Poisson arrivals of `rate`/s placed round-robin on len(models) independent
    servers; each reaches its engine `front` after its placement, its stream ends `back` after its
    last step."""
    g_count = len(models)
    names = list(names or [f"d{g}" for g in range(g_count)])
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        jobs.append(Job(f"r{i}", t, rng.randint(30, 900), rng.randint(1, 60)))
    forced = {j.request_id: i % g_count for i, j in enumerate(jobs)}
    config = EngineConfig(workers=g_count, slots=slots, step=models[0], limits=limits,
                          clock=LaneClock.independent(g_count, models))
    lane = Lane(LaneSpec("forced"), config, time.perf_counter, forced=forced)  # type: ignore[arg-type]
    events: list[Event] = []
    block = limits.block_tokens
    blocks = (limits.kv_tokens or block * 100_000) // block
    probe = _StepProbe(names, blocks, block, events)
    outs = {j.request_id: j.output_tokens for j in jobs}
    ending: list[float] = []
    lane.on_drain = lambda g, start, until, held: ending.append(until)
    lane.on_done = lambda rid: events.append(Finish(str(rid), ending.pop(), "length", outs[rid]))
    lane.set_latency(front, [max(x, 1e-9) for x in back])  # (a drain for every finish: its stream's end)
    driver = LaneDriver(lane, observers=(probe,))
    for j in jobs:
        w = names[forced[j.request_id]]
        events += [Arrive(str(j.request_id), j.arrival_s, j.prompt_tokens),
                   Route(str(j.request_id), j.arrival_s, w, j.prompt_tokens)]
        driver.offer(j, j.arrival_s)
    driver.drain()
    # a first token for every request (the mirror counts it running from then on)
    events += [Token(str(j.request_id), j.arrival_s + front[forced[j.request_id]] + 1e-3, 1) for j in jobs]
    events.sort(key=lambda e: e.t)
    return ServerRun(events, jobs, lane)


class _StepProbe(Observer):
    """Per step of each (independent) worker: a probe `Step` with its end, its own time (the
    busy time it added), the counts after it and the KV usage of the engine's blocks."""

    def __init__(self, names: Sequence[str], blocks: int, block: int, events: list[Event]) -> None:
        self.names, self.blocks, self.block, self.events = names, blocks, block, events
        self._tokens = 0
        self._busy = 0.0
        self._preempted = 0
        self._finished = 0

    def stepped(self, lane: Lane) -> None:
        c = lane.last_group
        (g,) = lane.clock_groups[c]
        tokens, self._tokens = lane.totals.tokens - self._tokens, lane.totals.tokens
        period, self._busy = lane.totals.busy_time_s - self._busy, lane.totals.busy_time_s
        # as vLLM counts them: a preemption when the request resumes (its next token)
        preempted, self._preempted = lane.resumed - self._preempted, lane.resumed
        pf = lane.sched.prefilling[g]
        finished, self._finished = lane.totals.finished - self._finished, lane.totals.finished
        scheduled = lane.engine_running(g) + finished  # the requests the step computed
        self.events.append(Step(lane.group_now(c), period, self.names[g], 0, lane.engine_running(g),
                                lane.engine_waiting()[g], lane.kv_blocks(g, self.block) / self.blocks, tokens,
                                preempted, period, "probe", prefill_requests=len(pf),
                                decode_requests=scheduled - len(pf)))
