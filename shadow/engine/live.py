"""Live driver: the same lanes as the offline driver, fed by normalised events as they happen;
lanes never see the future."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from shadow.contracts.events import Cancel, Event, Finish, Route, Step, Token
from shadow.contracts.requests import RequestRecord
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Clock, Lane, LaneTotals
from shadow.engine.summary import LogHistogram

ACTUAL = "actual"


@dataclass(slots=True)
class _Live(RequestRecord):
    """What the events told of a request, plus the driver's bookkeeping of it."""

    arrival: float | None = None  # its first Route: the lanes offer it then (after prefill in P/D)
    final: int | None = None
    released: bool = False
    queued: bool = False
    lanes_done: int = 0
    t_token: float = -1.0  # event time of the last token advance (SSE gap estimate)
    running: bool = False  # first token seen: holds KV on its worker (mirrored load)


def _streaming_totals() -> LaneTotals:
    return LaneTotals(
        ttft_s=LogHistogram(), tpot_s=LogHistogram(), wait_s=LogHistogram(), decision_s=LogHistogram()
    )


class LiveDriver:
    """Lanes fed by events; `workers` are the configured decode worker names (index order).

    `apply(event)` folds Arrive/Route/Token/Finish/Cancel into a request table; `advance_to(t)`
    moves every lane up to `t − lag` on the event clock. A request enters the lanes (in arrival
    order, like `run_lanes`) once its arrival is at or before that horizon and its
    decode worker and prompt size are known. Lanes never see the future: an output length is taken
    only from the request's Finish/Cancel (or a lower bound from its Token counts); a lane step that
    needs an end not yet known is held and counted (`LaneTotals.stalls`). `drain()` releases
    everything known and runs the lanes as far as knowledge allows (the end of a session).

    With the same requests, arrival times and step model, the lanes go through exactly the steps
    `run_offline` does on the recorded session (the consistency the tests check). Memory: requests
    leave the table once every lane has finished them; samples are bounded (`LogHistogram`).
    Pure: time arrives in events and arguments; `clock` only times decisions.
    """

    def __init__(
        self,
        config: EngineConfig,
        specs: Sequence[LaneSpec],
        workers: Sequence[str],
        clock: Clock,
        *,
        lag_s: float = 2.0,
        actual: bool = True,
        max_requests: int = 1_000_000,
    ) -> None:
        if config.workers != len(workers):
            raise ValueError(f"config has {config.workers} workers but {len(workers)} are named")
        if lag_s < 0:
            raise ValueError(f"lag must be >= 0 s, got {lag_s}")
        self.config = config
        self.workers = list(workers)
        self.index = {name: g for g, name in enumerate(workers)}
        self.lag_s = lag_s
        self.max_requests = max_requests
        self._reqs: dict[str, _Live] = {}
        self._assign: dict[Hashable, int] = {}
        all_specs = ([LaneSpec("forced", name=ACTUAL)] if actual else []) + list(specs)
        labels = [s.label for s in all_specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"lane labels must be unique, got {labels}")
        self.lanes: list[Lane] = []
        self._drivers: list[LaneDriver] = []
        for spec in all_specs:
            lane = Lane(spec, config, clock, self._assign if spec.policy == "forced" else None, ends=self)
            lane.totals = _streaming_totals()
            lane.on_done = self._lane_done
            self.lanes.append(lane)
            self._drivers.append(LaneDriver(lane, budget=self._budget))
        self._pending: list[tuple[float, int, str]] = []  # (arrival, tie, id) releasable, not released
        self._tie = 0
        self._released: deque[Job] = deque()
        self._base = 0  # index of _released[0] in the release sequence
        self._cursor = [0] * len(self.lanes)
        self.origin: float | None = None  # event time of lane time 0
        self.last_release = float("-inf")
        self.now = float("-inf")  # latest event time seen
        self.horizon = float("-inf")
        # mirrored per-worker KV load (running requests: first token seen), from the same events
        self.mirror_loads: list[float] = [0.0] * len(workers)
        self.mirror_active: list[int] = [0] * len(workers)
        # ... and of every placed request not ended (running or queued at its worker), the twin of a
        # lane's loads + queued prompts
        self.mirror_placed: list[float] = [0.0] * len(workers)
        # counters
        self.released = 0
        # output tokens seen plus requests released: no lane can run more steps (`checked_step`)
        self._step_budget = 0
        self.late = 0  # released after lanes had passed their arrival
        self.dropped: dict[str, int] = {}
        self.unknown_worker = 0
        # per-step observations for the step-time estimate (filled here, read by the caller)
        self.gap_samples: list[float] = []
        self.step_samples: list[tuple[float, float, str | None]] = []  # (t, duration, worker)

    def observe(self, observer: Observer, label: str | None = None) -> None:
        """Tell `observer` what the lane called `label` does (every lane when None)."""
        for driver in self._drivers:
            if label is None or driver.lane.spec.label == label:
                driver.observers.append(observer)

    def _budget(self) -> float:
        return self._step_budget

    # -- events ------------------------------------------------------------------------------

    def end_of(self, request_id: Hashable) -> tuple[int, int | None]:
        r = self._reqs.get(str(request_id))
        if r is None:  # cannot happen for a released request (kept until every lane is done)
            return 1, 1
        return r.generated, r.final

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def apply(self, ev: Event) -> None:
        """Fold one event into the request table (never raises on odd input; counts it)."""
        if ev.t > self.now:
            self.now = ev.t
        if isinstance(ev, Token):
            self._token(ev)
            return
        if isinstance(ev, Step):
            self.step_samples.append((ev.t, ev.duration_s, ev.worker))
            return
        rid = ev.request_id
        if isinstance(ev, Route) and ev.worker not in self.index:
            self.unknown_worker += 1
            return
        r = self._reqs.get(rid)
        if r is None:
            if isinstance(ev, Finish | Cancel):
                self._drop("end_before_start")
                return
            if len(self._reqs) >= self.max_requests:
                self._drop("table_full")
                return
            r = self._reqs[rid] = _Live()
        if isinstance(ev, Finish | Cancel):
            self._end(rid, r, ev)
            return
        r.learn(ev)  # the first size, key and worker known count (as in the offline feed)
        if isinstance(ev, Route) and r.arrival is None:
            r.arrival = ev.t
        if not r.queued and r.worker is not None and r.prompt is not None and r.arrival is not None:
            r.queued = True
            self.mirror_placed[self.index[r.worker]] += r.held
            self._tie += 1
            heapq.heappush(self._pending, (r.arrival, self._tie, rid))

    def _token(self, ev: Token) -> None:
        r = self._reqs.get(ev.request_id)
        if r is None or r.final is not None:
            return
        dg = ev.generated - r.generated
        if dg <= 0:
            return
        self._step_budget += dg
        if r.t_token >= 0:
            # dg tokens since the last event are dg decode steps (one token per step per running
            # stream), each the gap's share. Not only one-token advances: a busy tap coalesces a
            # stream's chunks per analysis batch, and a chunk is alone in its batch when the gaps
            # around it are long (one-token gaps only: step mean +14-24% at load average 15-19).
            self.gap_samples.extend([(ev.t - r.t_token) / dg] * dg)
        r.t_token = ev.t
        r.generated = ev.generated
        if r.worker is not None:
            g = self.index[r.worker]
            if r.queued:
                self.mirror_placed[g] += dg
            if not r.running:
                r.running = True
                self.mirror_active[g] += 1
                self.mirror_loads[g] += r.held
            else:
                self.mirror_loads[g] += dg

    def _end(self, rid: str, r: _Live, ev: Finish | Cancel) -> None:
        if r.final is not None:
            return
        g = None if r.worker is None else self.index[r.worker]
        if isinstance(ev, Finish) and ev.generated is not None and ev.generated > r.generated:
            extra = ev.generated - r.generated  # tokens the Finish reports beyond the last Token
            self._step_budget += extra
            if r.queued and g is not None:
                self.mirror_placed[g] += extra
            if r.running and g is not None:
                self.mirror_loads[g] += extra  # released just below with the rest
            r.generated = ev.generated
        r.final = r.generated
        if r.queued and g is not None:
            self.mirror_placed[g] -= r.held
        if r.running and g is not None:
            self.mirror_active[g] -= 1
            self.mirror_loads[g] -= r.held
            r.running = False
        if not r.queued:
            del self._reqs[rid]
            self._drop("never_routed")
        elif r.generated < 1 and not r.released:
            # never released, and a request without tokens is no request (as the offline feed)
            r.queued = False
            self._reqs.pop(rid, None)
            self._drop("no_tokens")

    def _lane_done(self, request_id: Hashable) -> None:
        rid = str(request_id)
        r = self._reqs.get(rid)
        if r is None:
            return
        r.lanes_done += 1
        if r.lanes_done >= len(self.lanes):
            del self._reqs[rid]
            self._assign.pop(rid, None)

    # -- time --------------------------------------------------------------------------------

    def _release(self, horizon: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= horizon:
            arrival, _, rid = heapq.heappop(pending)
            r = self._reqs.get(rid)
            if r is None or not r.queued or r.released:
                continue  # dropped meanwhile (ended without tokens)
            assert r.worker is not None and r.prompt is not None
            if self.origin is None:
                self.origin = arrival
            if arrival < self.last_release:
                self.late += 1
            self.last_release = max(self.last_release, arrival)
            r.released = True
            self._assign[rid] = self.index[r.worker]
            self._released.append(Job(rid, arrival - self.origin, max(1, r.prompt), 1, r.key))
            self.released += 1
            self._step_budget += 1  # a request runs at least one step

    def advance_to(self, t: float) -> None:
        """Move every lane up to event time `t − lag` (as far as known ends allow)."""
        self._advance(t - self.lag_s, drain=False)

    def drain(self) -> None:
        """Release every request known and run the lanes as far as known ends allow."""
        self._advance(float("inf"), drain=True)

    def _advance(self, horizon: float, drain: bool) -> None:
        self.horizon = max(self.horizon, horizon)
        self._release(horizon)
        if self.origin is None:
            return
        lane_t = horizon - self.origin
        for i, driver in enumerate(self._drivers):
            # a lane held by an unknown end before its next job cannot run further either
            if self._offer_released(i, driver):
                if drain:
                    driver.run_out()
                else:
                    driver.advance(lane_t)
        low = min(self._cursor)
        while self._base < low:
            self._released.popleft()
            self._base += 1

    def _offer_released(self, i: int, driver: LaneDriver) -> bool:
        """Offer lane `i` the released jobs it has not seen, each at its arrival; False when the
        lane is held by an unknown end before reaching the next one."""
        released, base = self._released, self._base
        cur = self._cursor[i]
        try:
            while cur - base < len(released):
                job = released[cur - base]
                if not driver.offer(job, job.arrival_s):
                    return False
                cur += 1
            return True
        finally:
            self._cursor[i] = cur

    # -- views -------------------------------------------------------------------------------

    def lag(self, lane: Lane) -> float:
        """How far `lane` runs behind the newest event time (seconds)."""
        if self.origin is None:
            return 0.0
        return max(0.0, self.now - (lane.now + self.origin))

    def assignment(self, request_id: Hashable) -> int | None:
        """The worker index the real router chose for a released request."""
        return self._assign.get(request_id)

    def open_requests(self) -> int:
        return len(self._reqs)
