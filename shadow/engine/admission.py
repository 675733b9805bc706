"""A lane's front door: requests offered to its router, placed on workers, shed while they wait.

`Admission` is where the lane meets its routing policy. It offers each job to the router (a policy
that binds at arrival places it on a worker's FIFO queue at once; a pool router keeps it, and its
time of arrival, until a round places it), runs the pool router's rounds on the free slots
(`decide`: each round's time counted in `totals.decision_s`), admits the paper model's queued and
placed requests into free slots of workers at a step boundary (`admit`; engine mode admits through
`EngineScheduler.admit`), drops waiting requests past an admission timeout (`shed`), counts each
placed request's body bytes on its worker until it finishes (`hold`, `unhold`), and builds the
`FleetSnapshot` the router decides on (`snapshot`: views over the lane's lists).

It owns the pool's arrival times, the bytes held per request and the snapshot; the per-worker
lists (loads, running, queues, queued tokens, bytes held) are the lane's (`AdmissionHost`), and a
request placed on a free worker starts through the lane's `_start`. Pure (time comes from the lane's clock).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from shadow.core.cost import RouteCost
from shadow.core.fscore import Projection
from shadow.core.predictors import Predictor
from shadow.core.routers import PoolRouter, Router
from shadow.core.snapshot import FleetSnapshot
from shadow.engine.barrier import BarrierClock, EndSource
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.outcomes import LaneTotals, RequestLedger
from shadow.engine.slots import SlotTable
from shadow.engine.views import Added, Outstanding


class AdmissionHost(Protocol):
    """What `Admission` reads of its lane, and the lane's `_start` (a request placed on a free worker)."""

    spec: LaneSpec
    config: EngineConfig
    clock: Callable[[], float]
    ends: EndSource | None
    now: float
    totals: LaneTotals
    router: Router
    predictor: Predictor | None
    loads: list[float]
    running: list[int]
    running_prompt: list[float]
    queues: list[deque[tuple[Job, float]]]
    queued_tokens: list[float]
    held_bytes: list[float]
    ledger: RequestLedger
    slots: SlotTable
    barrier: BarrierClock

    def projection(self) -> Projection: ...

    def _start(self, g: int, job: Job, ready_s: float) -> None: ...


class Admission:
    """See module docstring. `placed(request id, worker, ready time)` is told of each request a
    policy that binds at arrival places (engine mode: its way to its engine's queue)."""

    def __init__(self, host: AdmissionHost, extras: dict[str, object],
                 placed: Callable[[Hashable, int, float], None]) -> None:
        self.host, self.placed = host, placed
        self.extras = extras  # the snapshot's extra figures (`FleetSnapshot.extras`)
        self.fleet: FleetSnapshot | None = None  # built by the first `snapshot`
        self.fleet_free: list[int] = []  # its free slots, refreshed by each `snapshot`
        self.reset()

    def reset(self) -> None:
        """No request waiting nor held (at first, and at a re-seed: the lane's lists are new)."""
        self.bytes_at: dict[Hashable, tuple[int, float]] = {}  # placed requests: (worker, bytes)
        self.pool_ready: dict[Hashable, float] = {}  # pooled requests: when each reached the router
        self.fleet = None  # its views read the lists just replaced

    def drop(self, dropped: Sequence[Hashable]) -> None:
        """A re-seed drops every request in the lane (`dropped`): the router forgets those it holds."""
        router = self.host.router
        if isinstance(router, PoolRouter):
            router.pool.pop_arrived_before(math.inf)
        elif router.waiting():
            for rid in dropped:
                router.forget(rid)

    def offer(self, job: Job, ready_s: float) -> None:
        """See `Lane.offer`."""
        host = self.host
        rid = job.request_id
        inflight = host.ledger.inflight
        if rid in inflight:
            raise ValueError(f"lane {host.spec.label}: request {rid!r} offered while still in the lane")
        if host.ends is None and job.output_tokens < 1:
            raise ValueError(
                f"lane {host.spec.label}: request {rid!r} has {job.output_tokens} output tokens (at least 1)"
            )
        inflight.add(rid)
        host.totals.first_arrival_s = min(host.totals.first_arrival_s, job.arrival_s)
        router = host.router
        if not router.binds_at_arrival:
            router.on_arrive(job, job.prompt_tokens, ready_s, host.slots.newcomer_steps(job))
            self.pool_ready[job.request_id] = ready_s
            return
        t0 = host.clock()
        router.on_arrive(job.request_id, job.prompt_tokens, ready_s)
        ((_, g),) = router.decide(self.snapshot(), host.now)
        host.totals.decision_s.append(host.clock() - t0)
        host.queues[g].append((job, ready_s))
        host.queued_tokens[g] += job.prompt_tokens
        self.hold(g, job)
        self.placed(rid, g, ready_s)

    def hold(self, g: int, job: Job) -> None:
        """`job` is placed on worker g: its body bytes count there until it finishes (once: a
        preempted request queued again on its worker is still held)."""
        rid = job.request_id
        if rid not in self.bytes_at:
            size = job.forwarded_bytes
            self.bytes_at[rid] = (g, size)
            self.host.held_bytes[g] += size

    def unhold(self, rid: Hashable) -> None:
        """The request finished or left its worker: its body bytes no longer count there."""
        held = self.bytes_at.pop(rid, None)
        if held is not None:
            g, size = held
            self.host.held_bytes[g] -= size

    def snapshot(self, free_slots: Sequence[int] | None = None) -> FleetSnapshot:
        """The lane as a router sees it now: views over the lane's own lists, valid until the lane
        moves (one object, refreshed in place: `free_slots` is copied into it). BR-H's projection
        and BRA's predicted basis are computed only when asked, and only with a predictor."""
        host = self.host
        fleet, free = self.fleet, self.fleet_free
        if fleet is None:  # first use, or a re-seed replaced the lists the views read
            queued = host.queued_tokens
            fleet = self.fleet = FleetSnapshot(
                loads=host.loads,
                free_slots=free,
                outstanding=Outstanding(host.running, host.queues),
                # prompt tokens of requests sent and not finished: queued prompts + running prompts
                outstanding_tokens=Added(queued, host.running_prompt),
                queued_tokens=queued,
                prompt_loads=host.running_prompt,
                outstanding_bytes=host.held_bytes,
                projection=None if host.predictor is None else host.projection,
                extras=self.extras,
                running=host.running,
                cost=RouteCost.fleet(host.barrier.models or (host.config.step,)),  # what the lane steps on
            )
        if free_slots is None:
            b = host.config.slots
            free[:] = [b - r for r in host.running]
        else:
            free[:] = free_slots
        return fleet

    def shed(self, before: float) -> int:
        """See `Lane.shed_waiting`."""
        host = self.host
        shed = 0
        inflight = host.ledger.inflight
        if isinstance(host.router, PoolRouter):
            for entry in host.router.pool.pop_arrived_before(before):
                assert isinstance(entry.request_id, Job)
                self.pool_ready.pop(entry.request_id.request_id, None)
                inflight.remove(entry.request_id.request_id)
                shed += 1
        else:
            for g, queue in enumerate(host.queues):
                while queue and queue[0][1] < before:
                    job, _ = queue.popleft()
                    host.queued_tokens[g] -= job.prompt_tokens
                    self.unhold(job.request_id)
                    inflight.remove(job.request_id)
                    shed += 1
        host.totals.shed += shed
        return shed

    def admit(self) -> None:
        """The paper's model: each worker at a step boundary takes its queued requests into its free
        slots; then a pool router's round places requests on the free slots (a worker in the middle
        of a step queues its placements: they start at the step's end)."""
        host = self.host
        b = host.config.slots
        queues, running, queued_tokens = host.queues, host.running, host.queued_tokens
        bc = host.barrier
        gnow, group_of = bc.gnow, bc.group_of  # (a worker's group is free: at a step boundary)
        queued = any(queues)
        for g, queue in enumerate(queues) if queued else ():
            if queue and running[g] < b and gnow[group_of[g]] <= host.now:
                while queue and running[g] < b:
                    job, ready = queue.popleft()
                    queued_tokens[g] -= job.prompt_tokens
                    host._start(g, job, ready)
        router = host.router
        if router.binds_at_arrival or not router.waiting() or min(running) >= b:
            return
        free: list[int] | None = None  # without queues: b - running, at least one > 0 (min < b)
        if queued:
            free = [b - r - len(q) for r, q in zip(running, queues, strict=True)]
            if not any(free):
                return
        for entry, g, ready in self.decide(free):
            self.hold(g, entry)
            if gnow[group_of[g]] <= host.now:
                host._start(g, entry, ready)
            else:  # its worker is in the middle of a step: it starts at the step's end
                queues[g].append((entry, ready))
                queued_tokens[g] += entry.prompt_tokens

    def decide(self, free: list[int] | None) -> list[tuple[Job, int, float]]:
        """A pool router's round on the free slots `free` (None: b − running): (job, worker, the
        time it reached the router) per decision, the round's time counted."""
        host = self.host
        t0 = host.clock()
        decisions = host.router.decide(self.snapshot(free), host.now)
        host.totals.decision_s.append(host.clock() - t0)
        out: list[tuple[Job, int, float]] = []
        pool_ready, now = self.pool_ready, host.now
        for entry, g in decisions:
            assert isinstance(entry, Job)
            out.append((entry, g, pool_ready.pop(entry.request_id, now)))
        return out
