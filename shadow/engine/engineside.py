"""The real engines beside the lanes: what their probes measured (`ServerTimes`) and the twin check
(`TwinCheck`) of the `actual` lane against them.

`EngineSide` takes an engine probe's steps (`probe_step`) and, once a probe has reported any,
gives every lane the host's measured speed and the servers' measured latencies (`serve`); it also
answers what the lanes' twin check needs of the servers (KV tokens, block size). `TwinSide` is the
`actual` lane's side of the twin check (an `Observer`). Pure: time arrives in the steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import Protocol

from shadow.contracts.events import Step
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import DEFAULT_BLOCK_TOKENS
from shadow.engine.driver import Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.servertimes import ServerTimes
from shadow.engine.twincheck import TwinCheck


class EngineSide:
    """See module docstring. `servers`: measure the servers (off: the lanes keep their configured
    speed and latencies); `twin_window_s`: the twin check's window (None: no twin check)."""

    def __init__(self, workers: Sequence[str], step: StepTimeModel, *, servers: bool,
                 twin_window_s: float | None) -> None:
        n = len(workers)
        self.servers: ServerTimes | None = ServerTimes(n, [step] * n) if servers else None
        self.serving = False  # the lanes step on the servers' measurements
        self.origin: float | None = None  # event time of lane time 0 (set by `serve`)
        self.twin: TwinCheck | None = None
        if twin_window_s is not None:
            self.twin = TwinCheck(n, twin_window_s, self.kv_tokens, names=list(workers))

    def probe_step(self, g: int, ev: Step, period: float, mirror_load: float) -> None:
        """An engine probe's step of worker g (with its counts): to the servers' measurements and
        the twin check's engine side."""
        assert ev.running is not None and ev.tokens is not None
        if self.servers is not None:
            scheduled = (None if ev.decode_requests is None or ev.prefill_requests is None
                         else ev.decode_requests + ev.prefill_requests)
            self.servers.step(g, ev.t, period, ev.running, ev.waiting or 0, ev.tokens, ev.preemptions or 0,
                              ev.kv_usage, mirror_load, scheduled=scheduled,
                              prefill_tokens=ev.prefill_tokens)
            self.serving = True
        if self.twin is not None:
            self.twin.engine(g, ev.t, ev.running, ev.kv_usage or 0.0)

    def kv_tokens(self, g: int) -> float | None:
        return None if self.servers is None else self.servers.kv_tokens(g)

    def block_tokens(self, lane: Lane, g: int) -> int:
        """The KV block size worker g's engine counts in: measured (`ServerTimes`), else the lane's
        configured one."""
        default = lane.limits.block_tokens if lane.limits is not None else DEFAULT_BLOCK_TOKENS
        measured = None if self.servers is None else self.servers.block_tokens(g)
        return measured or default

    def set_models(self, models: Sequence[StepTimeModel]) -> None:
        """The step models the lanes step on now (the servers' speed is measured against them)."""
        if self.servers is not None:
            self.servers.set_models(models)

    def serve(self, lanes: Sequence[Lane], origin: float) -> None:
        """Once an engine probe reports steps: every lane at the host's measured speed, with the
        servers' measured latencies (`ServerTimes`). `origin`: event time of lane time 0."""
        servers = self.servers
        if servers is None or not self.serving:
            return
        self.origin = origin
        lat = servers.latencies()
        for lane in lanes:
            if lane.speed is None:
                lane.set_speed(self._speed)
            if lat is not None and (lane.front_s, lane.back_s) != lat:
                lane.set_latency(*lat)

    def _speed(self, g: int, lane_t: float) -> float:
        assert self.servers is not None
        return self.servers.speed(g, lane_t + (self.origin or 0.0))


class Placements(Protocol):
    """Where the real router placed the released requests, and when lane time 0 is."""

    @property
    def origin(self) -> float | None: ...

    def assignment(self, request_id: Hashable) -> int | None: ...


class TwinSide(Observer):
    """The `actual` lane's side of the twin check: each worker's state when a step of its ends,
    and the requests placed on it as they are."""

    def __init__(self, placements: Placements, engine: EngineSide, check: TwinCheck, workers: int) -> None:
        self.placements, self.engine, self.check = placements, engine, check
        self.drains: list[list[tuple[float, float]]] = [[] for _ in range(workers)]  # (until, tokens) heaps
        self.draining = [0.0] * workers

    def drain(self, g: int, start: float, until: float, held: float) -> None:
        """The lane's `on_drain`: a finished request still placed on worker g until `until`."""
        heapq.heappush(self.drains[g], (until, held))
        self.draining[g] += held

    def _expire(self, g: int, upto: float, origin: float) -> None:
        drains = self.drains[g]
        while drains and drains[0][0] <= upto:
            until, held = heapq.heappop(drains)
            self.draining[g] -= held
            self.check.lane_placed(g, origin + until, -held)

    def offering(self, lane: Lane, job: Job) -> None:
        g = self.placements.assignment(job.request_id)
        origin = self.placements.origin
        if g is not None and origin is not None:
            self._expire(g, lane.now, origin)
            self.check.lane_placed(g, origin + lane.now, job.prompt_tokens)

    def stepped(self, lane: Lane) -> None:
        origin = self.placements.origin
        if origin is None:
            return
        c = lane.last_group
        end = lane.group_now(c)
        for g in lane.clock_groups[c]:
            self._expire(g, end, origin)
            bs = self.engine.block_tokens(lane, g)
            placed = lane.loads[g] + lane.queued_tokens[g] + self.draining[g]
            self.check.lane(g, origin + end, placed, lane.engine_running(g), lane.kv_blocks(g, bs) * bs)
        for g in range(len(self.drains)):
            self._expire(g, lane.now, origin)
        self.check.lane_clock(origin + lane.now)
