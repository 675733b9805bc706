"""One lane: a DP decode fleet routed by one policy, stepped one decode step of one barrier group at a time.

The workers form barrier groups (`EngineConfig.clock`; default one group: the paper's
barrier-synchronised DP fleet). Per step k of a group: admissions (engine FIFO queues for policies
that bind at arrival; a BalanceRoute round over the pool otherwise), then every running request of
the group emits one token — its KV load s + (k − k0) grows by one — and requests that reach their
output length free their slot at the end of the step. The step lasts max over the group's workers
of τ_g = a_g·L_g(k) + b_g (one fleet-wide model: T(k) = a·max_g L_g(k) + b). Groups step on their
own clocks; the lane steps whichever group's next step starts first, and a request a pool router
places on a worker in the middle of its group's step waits at that worker until the step ends.
Loads are kept per worker and updated incrementally, so a step costs O(G + admissions + finishes)
Python work; BR-H adds a vectorised projection over the G·B slot arrays when it routes.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shadow.core.cost import RouteCost
from shadow.core.policies import RouterOptions, make_router
from shadow.core.predictors import Predictor, contribution
from shadow.core.routers import PoolRouter, Router
from shadow.core.snapshot import KV_CAPACITY, STAY_BASIS, FleetSnapshot, Projection
from shadow.core.stay import StayBasis, predicted_basis
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.balance import BalanceTally
from shadow.engine.config import DEFAULT_BLOCK_TOKENS, EngineConfig, LaneClock, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.kvcache import FreeBlocks
from shadow.engine.summary import SampleSink

Clock = Callable[[], float]


class _Outstanding(Sequence[int]):
    """Requests sent to each worker and not finished (running + queued), counted when read: a
    snapshot's derived lists cost nothing for the policies that never read them (valid while the
    lane does not move, as the snapshot itself)."""

    __slots__ = ("queues", "running")

    def __init__(self, running: list[int], queues: list[deque[tuple[Job, float]]]) -> None:
        self.running, self.queues = running, queues

    def __len__(self) -> int:
        return len(self.running)

    def __getitem__(self, g: int) -> int:  # type: ignore[override]  # worker indices only
        return self.running[g] + len(self.queues[g])

    def __iter__(self) -> Iterator[int]:  # (Sequence's would index one worker at a time)
        return map(operator.add, self.running, map(len, self.queues))


class _Added(Sequence[float]):
    """`a[g] + b[g]` per worker, added when read (as `_Outstanding`)."""

    __slots__ = ("a", "b")

    def __init__(self, a: list[float], b: list[float]) -> None:
        self.a, self.b = a, b

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, g: int) -> float:  # type: ignore[override]  # worker indices only
        return self.a[g] + self.b[g]

    def __iter__(self) -> Iterator[float]:
        return map(operator.add, self.a, self.b)


class EndSource(Protocol):
    """Live driver: what is known of a request's real output so far.

    `end_of(request_id)` is (tokens generated so far, final output length or None while the real
    stream has not ended); the final length, once given, is >= every earlier count.
    """

    def end_of(self, request_id: Hashable) -> tuple[int, int | None]: ...


@dataclass(slots=True)
class _Prefill:
    """A request in a running slot whose prompt (plus, resumed after a preemption, its tokens so
    far) is still being prefilled: `chunk` tokens of it scheduled into its worker's next step,
    `left` to go after that one."""

    slot: int
    job: Job
    ready: float
    age: int  # tokens it had generated before a preemption (0: a new request)
    left: int
    chunk: int = 0


def _samples() -> SampleSink:
    out: list[float] = []
    return out


@dataclass(slots=True)
class LaneTotals:
    """Running sums over steps and per-request samples, turned into a report by `results`."""

    steps: int = 0
    busy_time_s: float = 0.0
    sum_spread: float = 0.0
    sum_imbalance: float = 0.0
    sum_idle_s: float = 0.0  # Σ a·I(k): worker-seconds spent waiting at the barrier
    worker_time_s: float = 0.0  # Σ over steps of the step time × the workers stepping it
    sum_max: float = 0.0  # Σ max_g L_g(k): re-prices the steps under another step model
    tokens: int = 0
    finished: int = 0
    shed: int = 0  # requests refused at the door (`refuse`) or dropped waiting (`shed_waiting`)
    stalls: int = 0  # live: steps held because a running request's end was not yet known
    first_arrival_s: float = float("inf")
    last_finish_s: float = 0.0
    ttft_s: SampleSink = field(default_factory=_samples)
    tpot_s: SampleSink = field(default_factory=_samples)
    wait_s: SampleSink = field(default_factory=_samples)
    decision_s: SampleSink = field(default_factory=_samples)
    trajectory_t: list[float] = field(default_factory=list)
    trajectory_loads: list[list[float]] = field(default_factory=list)
    balance: BalanceTally = field(default_factory=BalanceTally)  # balance in the field's units


class Lane:
    """A simulated fleet under one routing policy; fed jobs with `offer`, advanced with `step`.

    Offline (`ends` None) a job's output length is known at admission and its finish is booked
    then. Live (`ends` given) the lane asks `ends` before every step whether a running request
    ends at that step; when the real stream has not told yet, the step is held (`stalled`,
    counted in `totals.stalls`) and `step` returns False without time passing.
    """

    def __init__(
        self,
        spec: LaneSpec,
        config: EngineConfig,
        clock: Clock,
        forced: Mapping[Hashable, int] | None = None,
        ends: EndSource | None = None,
    ) -> None:
        self.spec = spec
        self.config = config
        self.clock = clock
        g, b = config.workers, config.slots
        self.now = 0.0
        self.k = 0
        self.loads: list[float] = [0.0] * g
        self.running: list[int] = [0] * g
        self.queued_tokens: list[float] = [0.0] * g
        self.running_prompt: list[float] = [0.0] * g  # prompt tokens of running requests
        # request-body bytes placed on each worker and not finished (`Job.forwarded_bytes`), by request
        self.held_bytes: list[float] = [0.0] * g
        self._bytes_at: dict[Hashable, tuple[int, float]] = {}
        self.queues: list[deque[tuple[Job, float]]] = [deque() for _ in range(g)]
        self.totals = LaneTotals()
        self._free_slots: list[list[int]] = [list(range((w + 1) * b - 1, w * b - 1, -1)) for w in range(g)]
        # Barrier groups (see set_clock): per group its members, step count, next step's start,
        # running requests, finishes booked by its step index, and requests started for its next step.
        self._groups: list[tuple[int, ...]] = [tuple(range(g))]
        self._group_of: list[int] = [0] * g
        self._models: tuple[StepTimeModel, ...] | None = None
        self._gk: list[int] = [0]
        self._gnow: list[float] = [0.0]
        self._grun: list[int] = [0]
        self._calendars: list[dict[int, list[tuple[int, int, Job, int]]]] = [{}]
        self.ends = ends
        self.on_done: Callable[[Hashable], None] | None = None  # called as each request finishes
        self.stalled = False
        # live, per group: (last step known not to end it, tie, worker, slot, job) of requests whose
        # end is open
        self._watches: list[list[tuple[int, int, int, int, Job]]] = [[]]
        self._watch_seq = 0
        self._started: list[list[tuple[int, Job]]] = [[]]
        self._first_token: dict[Hashable, float] = {}
        self._seeded_age: dict[Hashable, int] = {}  # seeded running requests: tokens before the seed
        self.seeded: frozenset[Hashable] = frozenset()  # request ids the last `reseed` put in the lane
        self.reseeds = 0
        self.seed_overflow = 0  # seeded running requests beyond a worker's slots (offered anew)
        # requests the lane had finished that a re-seed put back (their second finish is not counted)
        self.again: set[Hashable] = set()
        self.dropped_unfinished = 0  # dropped at a re-seed, not put back, never finished here
        self._pool_ready: dict[Hashable, float] = {}
        self._inflight: set[Hashable] = set()  # offered, not finished nor shed: offered twice is refused
        self._record_all = config.trajectory_points > 0
        # Slot arrays (G·B): what BR-H projects from; also used by the brute-force checker.
        n = g * b
        self.slot_active = np.zeros(n, dtype=bool)
        self.slot_prompt = np.zeros(n, dtype=np.float64)
        self.slot_start = np.zeros(n, dtype=np.int64)
        self.slot_output = np.zeros(n, dtype=np.int64)
        self._slot_steps = np.zeros(n, dtype=np.float64)  # ĉ at its reference step
        self._slot_ref = np.zeros(n, dtype=np.int64)
        self._slot_key: list[Hashable | None] = [None] * n
        self._slot_worker = np.repeat(np.arange(g, dtype=np.int64), b)
        self._slot_group = np.zeros(n, dtype=np.int64)
        self._last_refresh = -(10**9)
        # Engine mode (`_engine`): each worker scheduled as a vLLM-like engine does it — the token
        # budget and KV cache of `config.limits` (chunked prefill, recompute preemption), step terms
        # per running sequence and per prefill token (a non-linear step model), the server's latencies
        # (`set_latency`). Off (the paper's model): none of this state is used.
        self.limits = config.limits
        self.front_s: tuple[float, ...] | None = None  # per worker: placed -> in its engine's queue
        self.back_s: tuple[float, ...] | None = None  # per worker: last step -> its stream's end
        self._admissible: dict[Hashable, float] = {}  # queued requests on their way (front latency)
        self._prefilling: list[list[_Prefill]] = [[] for _ in range(g)]  # in admission order
        self._slot_pf = np.zeros(n, dtype=bool)  # the slot's request is still prefilling
        self._slot_fresh = np.zeros(n, dtype=bool)  # admitted at its worker's next step (not run yet)
        self._fresh: list[list[int]] = [[] for _ in range(g)]  # ... those slots per worker
        self._kv_limited = config.limits is not None and config.limits.kv_tokens is not None
        self._order: list[list[int]] = [[] for _ in range(g)]  # kv-limited: running slots, admission order
        self._slot_jobs: list[Job | None] = [None] * n  # kv-limited: each running slot's job
        self._slot_ready = np.zeros(n, dtype=np.float64)  # kv-limited: each running slot's ready time
        kv_blocks = 0 if config.limits is None else config.limits.kv_blocks or 0
        self._cache = [FreeBlocks(kv_blocks) for _ in range(g)]  # kv-limited: its free blocks
        self._prefill = [0.0] * g  # prefill tokens scheduled into each worker's next step
        self.step_prefill = [0.0] * g  # ... and into its last one
        self._budget_left: list[float] = [0.0] * g  # its token budget left for admissions
        self._sched_k = [-1] * g  # the step index (of its group) each worker's plan is for
        self._no_admit = [False] * g  # its plan preempted: nothing is admitted in that step (vLLM)
        self._resume: dict[Hashable, int] = {}  # preempted, queued again: tokens generated before
        self._draining: list[deque[tuple[float, float]]] = [deque() for _ in range(g)]
        self.draining_tokens: list[float] = [0.0] * g  # finished, stream not ended yet (back latency)
        self.preemptions = 0
        self.resumed = 0  # preempted requests admitted again
        self.silent_steps = 0  # steps that emitted no token (prefill chunks only)
        # the host's speed: (worker, lane time) -> factor on its step model's time (live: measured)
        self.speed: Callable[[int, float], float] | None = None
        self.last_group = 0  # the barrier group of the last step that ran
        # told (worker, from, until, KV tokens) of each request finished while its stream goes on
        self.on_drain: Callable[[int, float, float, float], None] | None = None
        self._engine = False
        if config.clock is not None:
            self.set_clock(config.clock)
        # Policy.
        if spec.policy == "forced" and forced is None:
            raise ValueError("a forced lane needs its assignments")
        self.router: Router = make_router(
            spec.policy,
            RouterOptions(
                br=config.br,
                bra=config.bra,
                predictor=spec.predictor,
                seed=config.seed,
                assignments=forced,
                workers=g,
                view_age_s=spec.view_age_s,
            ),
        )
        self.predictor: Predictor | None = self.router.predictor
        self._extras: dict[str, object] = {STAY_BASIS.name: self.stay_basis}
        if self._kv_limited:
            assert config.limits is not None and config.limits.kv_tokens is not None
            self._extras[KV_CAPACITY.name] = [float(config.limits.kv_tokens)] * g
        self._fleet: FleetSnapshot | None = None  # built by the first `snapshot`
        self._fleet_free: list[int] = []  # its free slots, refreshed by each `snapshot`
        self._update_engine()

    # -- arrivals ---------------------------------------------------------------------------

    @property
    def binds_at_arrival(self) -> bool:
        return self.router.binds_at_arrival

    def offer(self, job: Job, ready_s: float) -> None:
        """A job whose prefill completed at `ready_s` (<= now) reaches the router.

        Refused (ValueError): a request id still in the lane (a driver offering a job twice would
        otherwise loop or corrupt the lane), and offline (no `ends`) an output below one token (its
        finish would be booked for a step already past, so it would run forever).
        """
        rid = job.request_id
        if rid in self._inflight:
            raise ValueError(f"lane {self.spec.label}: request {rid!r} offered while still in the lane")
        if self.ends is None and job.output_tokens < 1:
            raise ValueError(
                f"lane {self.spec.label}: request {rid!r} has {job.output_tokens} output tokens (at least 1)"
            )
        self._inflight.add(rid)
        self.totals.first_arrival_s = min(self.totals.first_arrival_s, job.arrival_s)
        router = self.router
        if not router.binds_at_arrival:
            router.on_arrive(job, job.prompt_tokens, ready_s, self._newcomer_steps(job))
            self._pool_ready[job.request_id] = ready_s
            return
        t0 = self.clock()
        router.on_arrive(job.request_id, job.prompt_tokens, ready_s)
        ((_, g),) = router.decide(self.snapshot(), self.now)
        self.totals.decision_s.append(self.clock() - t0)
        self.queues[g].append((job, ready_s))
        self.queued_tokens[g] += job.prompt_tokens
        self._hold(g, job)
        if self.front_s is not None:
            self._admissible[rid] = ready_s + self.front_s[g]

    def _hold(self, g: int, job: Job) -> None:
        """`job` is placed on worker g: its body bytes count there until it finishes (once: a
        preempted request queued again on its worker is still held)."""
        rid = job.request_id
        if rid not in self._bytes_at:
            size = job.forwarded_bytes
            self._bytes_at[rid] = (g, size)
            self.held_bytes[g] += size

    def _unhold(self, rid: Hashable) -> None:
        """The request finished or left its worker: its body bytes no longer count there."""
        held = self._bytes_at.pop(rid, None)
        if held is not None:
            g, size = held
            self.held_bytes[g] -= size

    def snapshot(self, free_slots: Sequence[int] | None = None) -> FleetSnapshot:
        """The lane as a router sees it now: views over the lane's own lists, valid until the lane
        moves (one object, refreshed in place: `free_slots` is copied into it). BR-H's projection
        and BRA's predicted basis are computed only when asked, and only with a predictor."""
        fleet, free = self._fleet, self._fleet_free
        if fleet is None:  # first use, or a re-seed replaced the lists the views read
            queued = self.queued_tokens
            fleet = self._fleet = FleetSnapshot(
                loads=self.loads,
                free_slots=free,
                outstanding=_Outstanding(self.running, self.queues),
                # prompt tokens of requests sent and not finished: queued prompts + running prompts
                outstanding_tokens=_Added(queued, self.running_prompt),
                queued_tokens=queued,
                prompt_loads=self.running_prompt,
                outstanding_bytes=self.held_bytes,
                projection=None if self.predictor is None else self.projection,
                extras=self._extras,
                running=self.running,
                cost=RouteCost.fleet(self._models or (self.config.step,)),  # what the lane steps on
            )
        if free_slots is None:
            b = self.config.slots
            free[:] = [b - r for r in self.running]
        else:
            free[:] = free_slots
        return fleet

    def _newcomer_steps(self, job: Job) -> float | None:
        if self.predictor is None:
            return None
        h = self.config.br.horizon
        p, mu = self.predictor.predict(
            np.zeros(1, dtype=np.int64),
            h,
            keys=[job.prompt_key],
            remaining=np.asarray([job.output_tokens], dtype=np.int64),
        )
        return float(contribution(p, mu, h)[0])

    def refuse(self) -> None:
        """A request refused at the door (a bounded queue was full): counted as shed, never offered."""
        self.totals.shed += 1

    def shed_waiting(self, before: float) -> int:
        """Drop waiting (not yet admitted) requests that reached the router before `before`.

        The overload model of a proxy with an admission timeout; returns and counts the number shed.
        Queues and the pool hold requests in ready order, so only their heads are looked at.
        """
        shed = 0
        if isinstance(self.router, PoolRouter):
            for entry in self.router.pool.pop_arrived_before(before):
                assert isinstance(entry.request_id, Job)
                self._pool_ready.pop(entry.request_id.request_id, None)
                self._inflight.remove(entry.request_id.request_id)
                shed += 1
        else:
            for g, queue in enumerate(self.queues):
                while queue and queue[0][1] < before:
                    job, _ = queue.popleft()
                    self.queued_tokens[g] -= job.prompt_tokens
                    self._unhold(job.request_id)
                    self._inflight.remove(job.request_id)
                    shed += 1
        self.totals.shed += shed
        return shed

    def reseed(
        self, at: float, running: Sequence[tuple[int, Job, int]], waiting: Sequence[tuple[Job, float]]
    ) -> list[Hashable]:
        """Replace the lane's in-flight state by a fleet's, at lane time `at` (a rolling window's start).

        Every request in the lane (running, queued, pooled) is dropped, unfinished and uncounted;
        `running` (worker, job, tokens generated so far >= 1) start where they are (KV load prompt +
        tokens, their end as before: from the job offline, from `ends` live); `waiting` (job, ready
        time) are offered anew, in order. A worker seeded beyond its slots offers the rest anew
        (counted in `seed_overflow`). Every barrier group starts its next step at `at`. Returns the
        request ids dropped; `seeded` holds those put in.
        """
        dropped = list(self._inflight)
        router = self.router
        if isinstance(router, PoolRouter):
            router.pool.pop_arrived_before(math.inf)
        elif router.waiting():
            for rid in dropped:
                router.forget(rid)
        g, b = self.config.workers, self.config.slots
        self.queues = [deque() for _ in range(g)]
        self.queued_tokens = [0.0] * g
        self.loads = [0.0] * g
        self.running = [0] * g
        self.running_prompt = [0.0] * g
        self.held_bytes = [0.0] * g
        self._bytes_at = {}
        self._fleet = None  # its views read the lists just replaced
        self._free_slots = [list(range((w + 1) * b - 1, w * b - 1, -1)) for w in range(g)]
        self.slot_active[:] = False
        self._slot_key = [None] * (g * b)
        n_groups = len(self._groups)
        self._calendars = [{} for _ in range(n_groups)]
        self._watches = [[] for _ in range(n_groups)]
        self._started = [[] for _ in range(n_groups)]
        self._grun = [0] * n_groups
        self._gnow = [at] * n_groups
        self._first_token = {}
        self._seeded_age = {}
        self._pool_ready = {}
        self._inflight = set()
        self._last_refresh = -(10**9)
        self._reset_engine()
        self.stalled = False
        self.now = at
        self.reseeds += 1
        again: list[tuple[Job, float]] = []
        for w, job, age in running:
            if age < 1 or not self._free_slots[w]:
                self.seed_overflow += age >= 1
                again.append((job, at))
                continue
            self._inflight.add(job.request_id)
            self._start(w, job, at, age)
        for job, ready in [*again, *waiting]:
            self.offer(job, ready)
        self.seeded = frozenset(self._inflight)
        for rid in dropped:
            if rid not in self.seeded:
                if rid in self.again:
                    self.again.discard(rid)
                else:
                    self.dropped_unfinished += 1
        return dropped

    # -- stepping ---------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return sum(self.running)

    @property
    def waiting(self) -> int:
        return self.router.waiting() + sum(len(q) for q in self.queues)

    def step(self, until: float = math.inf) -> bool:
        """Run one decode step of the group whose next step starts first; False (and no time passes)
        when nothing is running after admissions, when that step would start after `until` (only
        with several barrier groups), or (live, `stalled` set) when a running request's end at this
        step is not yet known. In engine mode a step may also wait for a request still on its way
        to an idle worker (front latency)."""
        self._admit()
        engine = self._engine
        nxt: int | None
        if len(self._grun) == 1 and not engine:  # one barrier group: it has work or nothing has
            nxt = 0 if self._grun[0] or any(self.queues) else None
        else:
            nxt = self._next_group()
        if nxt is None:
            return False
        c = nxt
        start = self._start_at(c) if engine else self._gnow[c]
        if start > self.now:  # several groups, or a request on its way: the next boundary is later
            if start > until:
                return False
            self.now = start
            self._admit()
            nxt = self._next_group()
            assert nxt is not None
            c = nxt
        watch = self._watches[c]
        if watch and self._unknown_end(c):
            if not self.stalled:
                self.totals.stalls += 1
            self.stalled = True
            return False
        self.stalled = False
        self.last_group = c
        loads = self.loads
        mx, mn, tot = max(loads), min(loads), sum(loads)
        n_workers = len(loads)
        imb = n_workers * mx - tot
        members = self._groups[c]
        n_members = len(members)
        shared = n_members == n_workers
        models = self._models
        if engine:
            t_step, idle = self._engine_time(members)
        elif models is None:
            model = self.config.step
            if shared:
                t_step = model.a * mx + model.b
                idle = model.a * imb
            else:
                gmx = max(loads[g] for g in members)
                t_step = model.a * gmx + model.b
                idle = model.a * (n_members * gmx - sum(loads[g] for g in members))
        else:
            taus = [models[g].a * loads[g] + models[g].b for g in members]
            t_step = max(taus)
            idle = len(taus) * t_step - sum(taus)
        tt = self.totals
        tt.steps += 1
        tt.busy_time_s += t_step
        tt.worker_time_s += n_members * t_step
        tt.sum_spread += mx - mn
        tt.sum_imbalance += imb
        tt.sum_idle_s += idle
        tt.sum_max += mx
        tt.balance.add(mx, mn, tot, n_workers, t_step)
        if self._record_all:
            tt.trajectory_t.append(self.now)
            tt.trajectory_loads.append(list(loads))
        end = self.now + t_step
        started = self._started[c]
        for _, job in started:
            self._first_token[job.request_id] = end
        started.clear()
        running = self.running
        if engine:
            self._emit(members)
        elif shared:
            for g in range(n_workers):
                loads[g] += running[g]
            tt.tokens += sum(running)
        else:
            for g in members:
                loads[g] += running[g]
                tt.tokens += running[g]
        k = self._gk[c]
        for g, slot, job, out in self._calendars[c].pop(k, ()):
            self._finish(g, slot, job, out, end)
        self._gk[c] = k + 1
        self._gnow[c] = end
        self.k += 1
        if shared:
            self.now = end
        else:  # the next boundary of a group with work, or the end of this step if none has any
            nxt = self._next_group()
            self.now = max(self.now, end if nxt is None else self._gnow[nxt])
        return True

    def _next_group(self) -> int | None:
        """The group with work (running, or waiting at its workers) whose next step starts first."""
        if self._engine:
            return self._next_engine_group()
        if len(self._groups) == 1:
            return 0 if self._grun[0] or any(self.queues) else None
        best: int | None = None
        queues, gnow = self.queues, self._gnow
        for c, members in enumerate(self._groups):
            if (self._grun[c] or any(queues[g] for g in members)) and (best is None or gnow[c] < gnow[best]):
                best = c
        return best

    def _free(self, g: int) -> bool:
        """True when worker g's group is at a step boundary (not in the middle of a step)."""
        return self._gnow[self._group_of[g]] <= self.now

    def _admit(self) -> None:
        if self._engine:
            self._admit_engine()
            return
        b = self.config.slots
        queues, running = self.queues, self.running
        queued = any(queues)
        for g, queue in enumerate(queues) if queued else ():
            if queue and running[g] < b and self._free(g):
                while queue and running[g] < b:
                    job, ready = queue.popleft()
                    self.queued_tokens[g] -= job.prompt_tokens
                    self._start(g, job, ready)
        router = self.router
        if router.binds_at_arrival or not router.waiting() or min(running) >= b:
            return
        free: list[int] | None = None  # without queues: b - running, at least one > 0 (min < b)
        if queued:
            free = [b - r - len(q) for r, q in zip(running, queues, strict=True)]
            if not any(free):
                return
        for entry, g, ready in self._decide(free):
            self._hold(g, entry)
            if self._free(g):
                self._start(g, entry, ready)
            else:  # its worker is in the middle of a step: it starts at the step's end
                self.queues[g].append((entry, ready))
                self.queued_tokens[g] += entry.prompt_tokens

    # -- engine mode -------------------------------------------------------------------------

    def _update_engine(self) -> None:
        models = self._models or (self.config.step,)
        self._engine = (self.limits is not None or self.front_s is not None or self.back_s is not None
                        or self.speed is not None or not all(m.linear for m in models))

    def set_speed(self, speed: Callable[[int, float], float] | None) -> None:
        """Step from now on at `speed(g, lane time)` × each worker's model time (None: 1)."""
        self.speed = speed
        self._update_engine()

    def _reset_engine(self) -> None:
        """A re-seed: the engines' own state starts empty (the seed puts requests back)."""
        g = self.config.workers
        self._admissible = {}
        self._prefilling = [[] for _ in range(g)]
        self._slot_pf[:] = False
        self._slot_fresh[:] = False
        self._fresh = [[] for _ in range(g)]
        self._order = [[] for _ in range(g)]
        self._slot_jobs = [None] * len(self._slot_jobs)
        self._cache = [FreeBlocks(self._cache[0].blocks) for _ in range(g)]
        self._prefill = [0.0] * g
        self._sched_k = [-1] * g
        self._no_admit = [False] * g
        self._resume = {}
        self._draining = [deque() for _ in range(g)]
        self.draining_tokens = [0.0] * g

    def set_latency(self, front_s: Sequence[float] | None, back_s: Sequence[float] | None) -> None:
        """The servers' latencies from now on, per worker (None: none): `front_s`, from a request's
        placement to its engine's queue (the HTTP front end and input processing); `back_s`, from
        its last step to the end of its stream (output processing and the HTTP side), during which
        it holds no slot and no KV but is still placed (`placed_loads`)."""
        n = self.config.workers
        for what, xs in (("front", front_s), ("back", back_s)):
            if xs is not None and (len(xs) != n or not all(math.isfinite(x) and x >= 0 for x in xs)):
                raise ValueError(f"{what} latencies must be {n} finite values >= 0, got {list(xs)}")
        self.front_s = None if front_s is None else tuple(front_s)
        self.back_s = None if back_s is None else tuple(back_s)
        if self.front_s is None:
            self._admissible = {}
        self._update_engine()

    def placed_loads(self) -> list[float]:
        """Per worker, the KV tokens of every request placed on it and not ended: running, queued (on
        its way or waiting) and, with a back latency, finished but its stream not ended yet."""
        now = self.now
        for g, drain in enumerate(self._draining):
            while drain and drain[0][0] <= now:
                self.draining_tokens[g] -= drain.popleft()[1]
            if not drain:
                self.draining_tokens[g] = 0.0  # no rounding left over
        return [x + q + d
                for x, q, d in zip(self.loads, self.queued_tokens, self.draining_tokens, strict=True)]

    def engine_waiting(self) -> list[int]:
        """Per worker, the requests in its engine's waiting queue: queued at it and arrived (not on
        their way: front latency)."""
        if not self._admissible:
            return [len(q) for q in self.queues]
        now, adm = self.now, self._admissible
        return [sum(1 for job, _ in q if adm.get(job.request_id, -math.inf) <= now) for q in self.queues]

    def kv_blocks(self, g: int, block_tokens: int | None = None) -> int:
        """KV blocks worker g's running requests hold now, as its engine counts them after its last
        step (prompt and tokens computed so far, in blocks of `block_tokens`, default the limits'
        block size; requests admitted for its next step not yet)."""
        return self._kv_needed(g, self._gk[self._group_of[g]], new=False, block_tokens=block_tokens)

    def engine_running(self, g: int) -> int:
        """Worker g's running requests as its engine counts them after its last step (without those
        admitted for its next one)."""
        return self.running[g] - len(self._fresh[g])

    def _kv_needed(self, g: int, k: int, new: bool = True, block_tokens: int | None = None) -> int:
        """Blocks worker g's running requests hold at the start of its step k (`new`: with the
        tokens that step computes: one per decoding request, the chunk of each prefilling one)."""
        bs = block_tokens or (self.limits.block_tokens if self.limits is not None else DEFAULT_BLOCK_TOKENS)
        b = self.config.slots
        sl = slice(g * b, (g + 1) * b)
        mask = self.slot_active[sl] & ~self._slot_pf[sl]
        if not new:
            mask &= ~self._slot_fresh[sl]
        held = self.slot_prompt[sl][mask] + (k - self.slot_start[sl][mask])
        if not new:
            held = held - 1  # the last sampled token is not computed yet
        blocks = int(np.ceil(held / bs).sum())
        for e in self._prefilling[g]:  # (`left` is what is left after its planned `chunk`)
            if new or not self._slot_fresh[e.slot]:
                done = e.job.prompt_tokens + e.age - e.left - (0 if new else e.chunk)
                blocks += -(-done // bs)
        return blocks

    def _start_at(self, c: int) -> float:
        """When group c's next step can start: its boundary; idle, when a request on its way reaches
        one of its workers (inf: no work)."""
        if self._grun[c]:
            return self._gnow[c]
        adm = self._admissible
        first = math.inf
        for g in self._groups[c]:
            q = self.queues[g]
            if q:
                first = min(first, adm.get(q[0][0].request_id, -math.inf) if adm else -math.inf)
        return max(self._gnow[c], first)

    def _next_engine_group(self) -> int | None:
        best: int | None = None
        best_t = math.inf
        for c in range(len(self._groups)):
            t = self._start_at(c)
            if t < best_t:
                best, best_t = c, t
        return best

    def _admit_engine(self) -> None:
        """Engine mode: a pool router places requests on free slots (they join their worker's queue),
        then every worker at a step boundary schedules its next step (`_schedule`)."""
        router = self.router
        queues, running = self.queues, self.running
        if not router.binds_at_arrival and router.waiting():
            b = self.config.slots
            free = [b - r - len(q) for r, q in zip(running, queues, strict=True)]
            if any(f > 0 for f in free):
                for entry, g, ready in self._decide(free):
                    self._hold(g, entry)
                    queues[g].append((entry, ready))
                    self.queued_tokens[g] += entry.prompt_tokens
                    if self.front_s is not None:
                        self._admissible[entry.request_id] = self.now + self.front_s[g]
        for g in range(len(queues)):
            if self._free(g):
                self._schedule(g)

    def _schedule(self, g: int) -> None:
        """Worker g at a step boundary: its step's plan (once per step: the running requests' tokens
        and preemptions, `_plan`), then its waiting requests admitted in order while a slot, token
        budget and KV blocks are left and nothing was preempted (vLLM V1's `schedule`)."""
        k = self._gk[self._group_of[g]]
        if self._sched_k[g] != k:
            self._sched_k[g] = k
            self._plan(g, k)
        queue = self.queues[g]
        if not queue or self._no_admit[g]:
            return
        b, running, adm = self.config.slots, self.running, self._admissible
        budget = self._budget_left[g]
        limits = self.limits
        cap = None if limits is None else limits.kv_blocks
        while queue and running[g] < b and budget > 0:
            job, ready = queue[0]
            rid = job.request_id
            if adm and adm.get(rid, -math.inf) > self.now:
                break  # still on its way (FIFO: nothing behind it is ahead of it)
            age = self._resume.get(rid, 0)
            need = job.prompt_tokens + age
            if cap is not None and running[g]:  # (an idle worker admits whatever its cache holds)
                assert limits is not None  # vLLM's default: its whole sequence must fit, not a chunk
                if self._kv_needed(g, k) + -(-need // limits.block_tokens) > cap:
                    break
            queue.popleft()
            adm.pop(rid, None)
            resumed = self._resume.pop(rid, None) is not None
            self.resumed += resumed
            self.queued_tokens[g] -= need
            hit = 0  # a resumed request's blocks still cached: only the tokens past them are computed
            if self._kv_limited:
                assert limits is not None
                bs = limits.block_tokens
                cached = self._cache[g].reclaim(rid)
                hit = min(cached, (need - 1) // bs) * bs
            chunk = int(min(need - hit, budget))
            if self._kv_limited:
                self._cache[g].free(cached - hit // bs)  # (cached past the last token: not a hit)
                self._cache[g].allocate(-(-(hit + chunk) // bs) - hit // bs)
            budget -= chunk
            self._prefill[g] += chunk
            self._start(g, job, ready, age, resumed=resumed, prefill_left=need - hit - chunk, chunk=chunk)
        self._budget_left[g] = budget

    def _plan(self, g: int, k: int) -> None:
        """Worker g's step k, before admissions: one token per decoding request, then each
        prefilling one's next chunk from the budget left (a chunk that ends its prefill begins its
        decoding: its first token comes at the end of this step); when the KV cache cannot hold
        the step's tokens, the newest running requests are preempted (never the last one)."""
        limits = self.limits
        pf = self._prefilling[g]
        budget = math.inf
        if limits is not None and limits.max_num_batched_tokens is not None:
            budget = float(limits.max_num_batched_tokens)
        budget -= self.running[g] - len(pf)
        prefill = 0
        for e in pf:
            e.chunk = int(min(e.left, max(budget, 0.0)))
            e.left -= e.chunk
            budget -= e.chunk
            prefill += e.chunk
        self._no_admit[g] = False
        if self._kv_limited:
            assert limits is not None and limits.kv_blocks is not None
            cap = limits.kv_blocks
            order = self._order[g]
            held = self._kv_needed(g, k, new=False)
            if self.loads[g] / limits.block_tokens + self.running[g] > cap:  # else it cannot overflow
                while len(order) > 1 and self._kv_needed(g, k) > cap:
                    was_prefilling = bool(self._slot_pf[order[-1]])
                    took, freed = self._preempt(g, order[-1], k)
                    held -= freed
                    budget += took
                    prefill -= took if was_prefilling else 0
            self._cache[g].allocate(self._kv_needed(g, k) - held)  # the step's new blocks
        for e in list(pf):
            if not e.left:  # its last chunk: it begins decoding in this step
                pf.remove(e)
                self._slot_pf[e.slot] = False
                self._begin(g, e.slot, e.job, k - e.age, e.age, e.age > 0)
        self._prefill[g] = float(prefill)
        self._budget_left[g] = budget

    def _preempt(self, g: int, slot: int, k: int) -> tuple[int, int]:
        """vLLM V1's recompute preemption of the request in `slot` at the start of worker g's step k:
        its KV and slot freed, its finish unbooked, it goes to the front of g's queue and, admitted
        again, prefills its prompt and the tokens it generated (then goes on from there). Returns
        the tokens of the step's budget it had taken and the blocks it held (freed: its full ones
        stay cached for it, `FreeBlocks`)."""
        job = self._slot_jobs[slot]
        assert job is not None and self.limits is not None
        c = self._group_of[g]
        took = 1
        if self._slot_pf[slot]:
            e = next(e for e in self._prefilling[g] if e.slot == slot)
            self._prefilling[g].remove(e)
            self._slot_pf[slot] = False
            age, took = e.age, e.chunk
            computed = job.prompt_tokens + age - e.left - e.chunk
        else:
            age = k - int(self.slot_start[slot])
            self._unbook(c, slot)
            computed = job.prompt_tokens + age - 1
        bs = self.limits.block_tokens
        full, partial = divmod(computed, bs)
        self._cache[g].free(1 if partial else 0)  # its last block first (evicted first)
        self._cache[g].free(full, job.request_id)
        self._release(g, slot, job, job.prompt_tokens + age)
        self.queues[g].appendleft((job, float(self._slot_ready[slot])))
        self.queued_tokens[g] += job.prompt_tokens + age
        self._resume[job.request_id] = age
        self._no_admit[g] = True
        self.preemptions += 1
        return took, full + (1 if partial else 0)

    def _unbook(self, c: int, slot: int) -> None:
        """Take the booked (or watched) finish of the request in `slot` out of group c's calendar."""
        key = int(self.slot_start[slot] + self.slot_output[slot]) - 1
        entries = self._calendars[c].get(key)
        if entries is not None:
            for i, entry in enumerate(entries):
                if entry[1] == slot:
                    del entries[i]
                    if not entries:
                        del self._calendars[c][key]
                    return
        watch = [w for w in self._watches[c] if w[3] != slot]
        heapq.heapify(watch)
        self._watches[c] = watch

    def _engine_time(self, members: Sequence[int]) -> tuple[float, float]:
        """The step's time (the slowest member's τ_g = a·L_g + c·n_g + p·P_g + b) and barrier idle."""
        models, step = self._models, self.config.step
        loads, running, prefill = self.loads, self.running, self._prefill
        taus = [(step if models is None else models[g]).worker_time(loads[g], running[g], prefill[g])
                for g in members]
        speed = self.speed
        if speed is not None:
            now = self.now
            taus = [tau * speed(g, now) for tau, g in zip(taus, members, strict=True)]
        t_step = max(taus)
        return t_step, len(taus) * t_step - sum(taus)

    def _emit(self, members: Sequence[int]) -> None:
        """The step's tokens: one per running request of each member but those still prefilling."""
        loads, running = self.loads, self.running
        emitted = 0
        fresh = self._fresh
        for g in members:
            if fresh[g]:
                self._slot_fresh[fresh[g]] = False
                fresh[g].clear()
            pf = self._prefilling[g]
            n = running[g] - len(pf)
            loads[g] += n
            emitted += n
            for e in pf:  # no token yet: its age (step count − start) stays what it holds
                e.chunk = 0
                self.slot_start[e.slot] += 1
            self.step_prefill[g] = self._prefill[g]
            self._prefill[g] = 0.0
        self.totals.tokens += emitted
        if not emitted:
            self.silent_steps += 1

    def _decide(self, free: list[int] | None) -> list[tuple[Job, int, float]]:
        """A pool router's round on the free slots `free` (None: b − running): (job, worker, the
        time it reached the router) per decision, the round's time counted."""
        t0 = self.clock()
        decisions = self.router.decide(self.snapshot(free), self.now)
        self.totals.decision_s.append(self.clock() - t0)
        out: list[tuple[Job, int, float]] = []
        for entry, g in decisions:
            assert isinstance(entry, Job)
            out.append((entry, g, self._ready_of(entry)))
        return out

    def _unknown_end(self, c: int) -> bool:
        """Live: resolve the open ends group `c`'s step needs; True when one is still unknown (hold)."""
        assert self.ends is not None
        watch, k = self._watches[c], self._gk[c]
        # Each open end is looked at once at most: it is resolved, re-filed under a step >= k, or
        # holds the step. The loop is bounded by that count rather than left open-ended.
        for _ in range(len(watch)):
            if not watch or watch[0][0] >= k:
                break
            _, n, g, slot, job = watch[0]
            gen, final = self.ends.end_of(job.request_id)
            start = int(self.slot_start[slot])
            if final is not None:
                heapq.heappop(watch)
                done = max(start + max(final, gen, 1) - 1, k)
                self._calendars[c].setdefault(done, []).append((g, slot, job, done - start + 1))
                self.slot_output[slot] = done - start + 1
            elif start + gen - 2 >= k:
                heapq.heapreplace(watch, (start + gen - 2, n, g, slot, job))
            else:
                return True
        return False

    # -- clock -------------------------------------------------------------------------------

    def set_clock(self, clock: LaneClock) -> None:
        """Step from now on under `clock` (barrier groups, per-worker models). Regrouping keeps every
        request's progress: a merged group starts its next step when its slowest member ends its
        current one; a split group's workers start theirs where the group would have."""
        g_count = self.config.workers
        clock.check(g_count)
        self._models = clock.models
        self._fleet = None  # the next snapshot says the new models' cost to the policies
        self._update_engine()
        groups = [tuple(group) for group in clock.groups]
        if groups == self._groups:
            return
        old_of, old_k, old_now = self._group_of, self._gk, self._gnow
        worker_k = [old_k[old_of[g]] for g in range(g_count)]
        new_of = [0] * g_count
        for c, members in enumerate(groups):
            for g in members:
                new_of[g] = c
        new_k = [max(worker_k[g] for g in members) for members in groups]
        delta = [new_k[new_of[g]] - worker_k[g] for g in range(g_count)]  # steps added per worker
        calendars: list[dict[int, list[tuple[int, int, Job, int]]]] = [{} for _ in groups]
        for cal in self._calendars:
            for k, entries in cal.items():
                for entry in entries:
                    w = entry[0]
                    calendars[new_of[w]].setdefault(k + delta[w], []).append(entry)
        watches: list[list[tuple[int, int, int, int, Job]]] = [[] for _ in groups]
        for watch in self._watches:
            for k, n, w, slot, job in watch:
                watches[new_of[w]].append((k + delta[w], n, w, slot, job))
        for watch in watches:
            heapq.heapify(watch)
        started: list[list[tuple[int, Job]]] = [[] for _ in groups]
        for jobs in self._started:
            for w, job in jobs:
                started[new_of[w]].append((w, job))
        shift = np.asarray(delta, dtype=np.int64)[self._slot_worker]
        self.slot_start += shift
        self._slot_ref += shift
        self._groups, self._group_of, self._gk = groups, new_of, new_k
        self._gnow = [max(old_now[old_of[g]] for g in members) for members in groups]
        self._grun = [sum(self.running[g] for g in members) for members in groups]
        self._calendars, self._watches, self._started = calendars, watches, started
        self._slot_group = np.asarray(new_of, dtype=np.int64)[self._slot_worker]
        self._sched_k = [k + delta[g] if k >= 0 else k for g, k in enumerate(self._sched_k)]

    def slot_steps(self) -> npt.NDArray[np.int64]:
        """Per slot: the step count of its worker's group (a slot's age is this − slot_start)."""
        return np.asarray(self._gk, dtype=np.int64)[self._slot_group]

    @property
    def clock_groups(self) -> list[tuple[int, ...]]:
        """The barrier groups the lane steps (worker indices)."""
        return list(self._groups)

    def group_now(self, c: int) -> float:
        """When barrier group c's next step can start (the end of its last one)."""
        return self._gnow[c]

    def _ready_of(self, job: Job) -> float:
        return self._pool_ready.pop(job.request_id, self.now)

    def projection(self) -> Projection:
        """BR-H's active requests: (worker, load, predicted steps left), predictions refreshed
        every `refresh_steps` steps (needs a predictor)."""
        idx = np.flatnonzero(self.slot_active)
        ks = self._ks(idx)
        age = ks - self.slot_start[idx]
        if self.k - self._last_refresh >= self.config.refresh_steps:
            self._refresh_predictions(idx, age, ks)
        w = self.slot_prompt[idx] + age
        c = np.maximum(self._slot_steps[idx] - (ks - self._slot_ref[idx]), 0.0)
        return self._slot_worker[idx], w, c

    def stay_basis(self, kind: str = "stay") -> StayBasis | None:
        """BRA's predicted thin-pool basis `kind` over the running requests (shadow.core.stay);
        None without a predictor or with the oracle (it knows no fleet-wide length distribution)."""
        if self.predictor is None or self.predictor.name == "oracle":
            return None
        idx = np.flatnonzero(self.slot_active)
        age = self._ks(idx) - self.slot_start[idx]
        keys = [self._slot_key[i] for i in idx.tolist()]
        return predicted_basis(
            kind,
            self.predictor,
            self.config.workers,
            self._slot_worker[idx],
            self.slot_prompt[idx] + age,
            age,
            self.config.br.horizon,
            keys=keys,
            remaining=self.slot_output[idx] - age,
        )

    def _ks(self, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | int:
        """The step count of each slot's group (one group: the lane's step count)."""
        if len(self._gk) == 1:
            return self._gk[0]
        return np.asarray(self._gk, dtype=np.int64)[self._slot_group[idx]]

    def _refresh_predictions(
        self, idx: npt.NDArray[np.int64], age: npt.NDArray[np.int64], ks: npt.NDArray[np.int64] | int
    ) -> None:
        assert self.predictor is not None
        h = self.config.br.horizon
        keys = [self._slot_key[i] for i in idx.tolist()]
        remaining = self.slot_output[idx] - age
        p, mu = self.predictor.predict(age, h, keys=keys, remaining=remaining)
        self._slot_steps[idx] = contribution(p, mu, h)
        self._slot_ref[idx] = ks
        self._last_refresh = self.k

    def _start(self, g: int, job: Job, ready_s: float, age: int = 0, *, resumed: bool = False,
               prefill_left: int = 0, chunk: int = 0) -> None:
        """Start `job` on worker `g`; `age` > 0: it already generated `age` tokens (seeded, or
        `resumed` after a preemption); `prefill_left` > 0 (engine mode): its prefill goes on over the
        next steps, and it begins decoding when that is done (`_Prefill`)."""
        c = self._group_of[g]
        k = self._gk[c]
        if self._gnow[c] < self.now:  # an idle group starts when its work arrives
            self._gnow[c] = self.now
        slot = self._free_slots[g].pop()
        self.slot_active[slot] = True
        self.slot_prompt[slot] = job.prompt_tokens
        self.slot_start[slot] = k - age
        self._slot_key[slot] = job.prompt_key
        if self.predictor is not None:
            steps = self._newcomer_steps(job)
            self._slot_steps[slot] = self.config.br.horizon if steps is None else steps
            self._slot_ref[slot] = k
        self.loads[g] += job.prompt_tokens + age
        self.running_prompt[g] += job.prompt_tokens
        self._hold(g, job)
        self.running[g] += 1
        self._grun[c] += 1
        if self._engine and (not age or resumed):
            self._slot_fresh[slot] = True
            self._fresh[g].append(slot)
        if self._kv_limited:
            self._order[g].append(slot)
            self._slot_jobs[slot] = job
            self._slot_ready[slot] = ready_s
        if not resumed and not age:
            self.totals.wait_s.append(self.now - ready_s)
        if prefill_left:  # (its first `chunk` is in this step, `prefill_left` after it)
            self._slot_pf[slot] = True
            self._prefilling[g].append(_Prefill(slot, job, ready_s, age, prefill_left, chunk))
            return
        self._begin(g, slot, job, k - age, age, resumed)

    def _begin(self, g: int, slot: int, job: Job, start: int, age: int, resumed: bool) -> None:
        """`job` in `slot` emits its first (next) token at the end of its group's step `start` + `age`:
        its finish is booked (offline, or its end known) or watched (live)."""
        c = self._group_of[g]
        self.slot_start[slot] = start
        if self.ends is None:
            self._book(g, slot, job, start, max(job.output_tokens, age + 1))
        else:
            gen, final = self.ends.end_of(job.request_id)
            if final is not None:
                self._book(g, slot, job, start, max(final, gen, age + 1, 1))
            else:
                self.slot_output[slot] = gen
                self._watch_seq += 1
                heapq.heappush(self._watches[c], (start + gen - 2, self._watch_seq, g, slot, job))
        if resumed and job.request_id in self._first_token:  # counted when it first began
            return
        if age and not resumed:
            self._first_token[job.request_id] = self.now
            self._seeded_age[job.request_id] = age
            return
        self._started[c].append((g, job))

    def _book(self, g: int, slot: int, job: Job, start: int, out: int) -> None:
        """Book the finish of a request started at step `start` (of its group) with `out` output tokens."""
        self.slot_output[slot] = out
        self._calendars[self._group_of[g]].setdefault(start + out - 1, []).append((g, slot, job, out))

    def _release(self, g: int, slot: int, job: Job, held: float) -> None:
        """Free `slot` of worker g, whose request held `held` KV tokens."""
        self.loads[g] -= held
        self.running_prompt[g] -= job.prompt_tokens
        self.running[g] -= 1
        self._grun[self._group_of[g]] -= 1
        self.slot_active[slot] = False
        if self._slot_fresh[slot]:
            self._slot_fresh[slot] = False
            self._fresh[g].remove(slot)
        self._slot_key[slot] = None
        self._free_slots[g].append(slot)
        if self._kv_limited:
            self._order[g].remove(slot)
            self._slot_jobs[slot] = None

    def _finish(self, g: int, slot: int, job: Job, out: int, end: float) -> None:
        held = job.prompt_tokens + out
        self._release(g, slot, job, held)
        self._unhold(job.request_id)
        if self._kv_limited:
            assert self.limits is not None
            self._cache[g].free(-(-(held - 1) // self.limits.block_tokens))
        if self.back_s is not None and self.back_s[g] > 0:
            self._draining[g].append((end + self.back_s[g], held))
            self.draining_tokens[g] += held
            if self.on_drain is not None:
                self.on_drain(g, end, end + self.back_s[g], held)
        tt = self.totals
        if job.request_id in self.again:  # finished here before a re-seed put it back: counted once
            self.again.discard(job.request_id)
        else:
            tt.finished += 1
        tt.last_finish_s = max(tt.last_finish_s, end)
        self._inflight.remove(job.request_id)
        first = self._first_token.pop(job.request_id)
        age = self._seeded_age.pop(job.request_id, 0)
        if age:  # seeded: no first token in this window; TPOT over its tokens since the seed
            tt.tpot_s.append((end - first) / (out - age))
        else:
            tt.ttft_s.append(first - job.arrival_s)
            if out >= 2:
                tt.tpot_s.append((end - first) / (out - 1))
        self.router.on_finish(job.request_id, out, job.prompt_key)
        if self.on_done is not None:
            self.on_done(job.request_id)


def checked_step(lane: Lane, budget: float = math.inf, until: float = math.inf) -> bool:
    """`lane.step(until)` for the drivers' loops, which would spin forever on an engine bug instead.

    Raises RuntimeError when the step count did not move by exactly one step that ran (none when
    it did not run), or when more than `budget` steps ran: each step that runs emits at least one
    token (but for an engine's prefill-only steps, `Lane.silent_steps`, not counted), so the output
    tokens offered bound the steps (the live driver passes the tokens it has seen plus one per
    released request).
    """
    k = lane.k
    ran = lane.step(until)
    if lane.k != k + ran:
        raise RuntimeError(
            f"lane {lane.spec.label}: step {k} {'ran' if ran else 'did not run'} but the step count is now"
            f" {lane.k} (engine bug)"
        )
    if lane.k > budget and lane.k - lane.silent_steps > budget:
        raise RuntimeError(
            f"lane {lane.spec.label}: {lane.k} steps ran for {budget} output tokens offered: requests"
            " never finish (engine bug)"
        )
    return ran
