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

import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from shadow.core.fscore import Projection
from shadow.core.policies import RouterOptions, make_router
from shadow.core.predictors import Predictor
from shadow.core.routers import Router
from shadow.core.snapshot import KV_CAPACITY, STAY_BASIS, FleetSnapshot
from shadow.core.stay import StayBasis
from shadow.engine.admission import Admission
from shadow.engine.barrier import BarrierClock, EndSource
from shadow.engine.config import EngineConfig, LaneClock, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.outcomes import LaneTotals, RequestLedger, tally_step
from shadow.engine.scheduler import EngineScheduler
from shadow.engine.slots import SlotTable
from shadow.engine.views import Forward

__all__ = ["Clock", "EndSource", "Lane", "LaneTotals", "checked_step"]

Clock = Callable[[], float]


class Lane:
    """A simulated fleet under one routing policy; fed jobs with `offer`, advanced with `step`.

    Offline (`ends` None) a job's output length is known at admission and its finish is booked
    then. Live (`ends` given) the lane asks `ends` before every step whether a running request
    ends at that step; when the real stream has not told yet, the step is held (`stalled`,
    counted in `totals.stalls`) and `step` returns False without time passing.

    The lane keeps the per-worker lists the policies see (loads, running, queues, queued and
    running prompt tokens, body bytes held), admits and steps; its collaborators keep the rest:
    `admission` (the router: offers, placements, shedding, snapshots), `slots` (the G·B slot arrays
    and the predictions read off them), `barrier` (the barrier groups' clocks and booked finishes),
    `sched` (engine mode: a vLLM-like scheduler per worker) and `ledger` (each request from offer
    to finish, and what it adds to `totals`).
    """

    def __init__(
        self,
        spec: LaneSpec,
        config: EngineConfig,
        clock: Clock,
        forced: Mapping[Hashable, int] | None = None,
        ends: EndSource | None = None,
    ) -> None:
        self.spec, self.config, self.clock, self.ends = spec, config, clock, ends
        g = config.workers
        self.now, self.k = 0.0, 0
        self.totals = LaneTotals()
        self._clear(g)
        self.on_done: Callable[[Hashable], None] | None = None  # called as each request finishes
        # told (worker, from, until, KV tokens) of each request finished while its stream goes on
        self.on_drain: Callable[[int, float, float, float], None] | None = None
        self.stalled = False
        # the router saw the lane as it is (no offer, shed or clock change since): a held step tried
        # again does not route again (BRA counts its holds in rounds, not in retries)
        self._routed = False
        self.last_group = 0  # the barrier group of the last step that ran
        self.reseeds = 0
        self.seed_overflow = 0  # seeded running requests beyond a worker's slots (offered anew)
        self.seeded: frozenset[Hashable] = frozenset()  # request ids the last `reseed` put in the lane
        self.limits = config.limits
        self._record_all = config.trajectory_points > 0
        self._engine = False  # engine mode (`sched`): off, the paper's model
        if spec.policy == "forced" and forced is None:
            raise ValueError("a forced lane needs its assignments")
        self.router: Router = make_router(spec.policy, RouterOptions(
            br=config.br, bra=config.bra, predictor=spec.predictor, seed=config.seed, assignments=forced,
            workers=g, view_age_s=spec.view_age_s))
        self.ledger = RequestLedger()
        self.barrier = BarrierClock(g)
        slots = SlotTable(g, config.slots, self.router.predictor, config.br.horizon, config.refresh_steps)
        self.slots = slots
        # the slot arrays (updated in place): what BR-H projects from; also read by the checkers
        self.slot_active, self.slot_prompt = slots.active, slots.prompt
        self.slot_start, self.slot_output = slots.start, slots.output
        self.sched = EngineScheduler(self, config, slots)
        extras: dict[str, object] = {STAY_BASIS.name: self.stay_basis}
        if self.sched.kv_limited:
            assert config.limits is not None and config.limits.kv_tokens is not None
            extras[KV_CAPACITY.name] = [float(config.limits.kv_tokens)] * g
        self.admission = Admission(self, extras, self.sched.placed)
        self._admit: Callable[[], None] = self.admission.admit  # admissions before a step (per mode)
        if config.clock is not None:
            self.set_clock(config.clock)
        self._update_engine()

    def _clear(self, g: int) -> None:
        """The per-worker lists, empty (at first, and at a re-seed: new lists)."""
        self.loads: list[float] = [0.0] * g
        self.running: list[int] = [0] * g
        self.queues: list[deque[tuple[Job, float]]] = [deque() for _ in range(g)]
        self.queued_tokens: list[float] = [0.0] * g
        self.running_prompt: list[float] = [0.0] * g  # prompt tokens of running requests
        self.held_bytes: list[float] = [0.0] * g  # body bytes placed, not finished (`Admission.hold`)

    @property
    def predictor(self) -> Predictor | None:
        """The policy's length predictor (None: none); what the slots' predictions come from."""
        return self.slots.predictor

    @predictor.setter
    def predictor(self, predictor: Predictor | None) -> None:
        self.slots.predictor = predictor

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
        self.admission.offer(job, ready_s)
        self._routed = False

    def snapshot(self, free_slots: Sequence[int] | None = None) -> FleetSnapshot:
        """The lane as a router sees it now, valid until the lane moves (`Admission.snapshot`)."""
        return self.admission.snapshot(free_slots)

    def refuse(self) -> None:
        """A request refused at the door (a bounded queue was full): counted as shed, never offered."""
        self.totals.shed += 1

    def shed_waiting(self, before: float) -> int:
        """Drop waiting (not yet admitted) requests that reached the router before `before`.

        The overload model of a proxy with an admission timeout; returns and counts the number shed.
        Queues and the pool hold requests in ready order, so only their heads are looked at.
        """
        shed = self.admission.shed(before)
        if shed:
            self._routed = False
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
        ledger = self.ledger
        dropped = list(ledger.inflight)
        self.admission.drop(dropped)
        self._clear(self.config.workers)
        self.admission.reset()
        self.slots.reset()
        self.barrier.reset(at)
        ledger.reset()
        self.sched.reset()
        self.stalled = False
        self.now = at
        self.reseeds += 1
        again: list[tuple[Job, float]] = []
        for w, job, age in running:
            if age < 1 or not self.slots.free[w]:
                self.seed_overflow += age >= 1
                again.append((job, at))
                continue
            ledger.inflight.add(job.request_id)
            self._start(w, job, at, age)
        for job, ready in [*again, *waiting]:
            self.offer(job, ready)
        self.seeded = ledger.reseeded(dropped)
        return dropped

    # re-seeds (see `RequestLedger`): requests put back after they had finished here (counted once),
    # those dropped and never finished here
    again = Forward[set[Hashable]]("ledger")
    dropped_unfinished = Forward[int]("ledger")

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
        if not (self.stalled and self._routed):
            self._admit()
            self._routed = True
        engine = self._engine
        bc = self.barrier
        nxt: int | None
        if len(bc.grun) == 1 and not engine:  # one barrier group: it has work or nothing has
            nxt = 0 if bc.grun[0] or any(self.queues) else None
        else:
            nxt = self._next_group()
        if nxt is None:
            return False
        c = nxt
        start = self.sched.start_at(c) if engine else bc.gnow[c]
        if start > self.now:  # several groups, or a request on its way: the next boundary is later
            if start > until:
                return False
            self.now = start
            self._admit()
            nxt = self._next_group()
            assert nxt is not None
            c = nxt
        watch = bc.watches[c]
        if watch:
            assert self.ends is not None
            if bc.unknown_end(c, self.ends, self.slot_start, self.slot_output):
                if not self.stalled:
                    self.totals.stalls += 1
                self.stalled = True
                return False
        self.stalled = False
        self.last_group = c
        loads = self.loads
        members = bc.groups[c]
        shared = len(members) == len(loads)
        tt = self.totals
        t_step = tally_step(tt, self.now, loads, members, shared, self.config.step, bc.models,
                            self.sched.step_time(members) if engine else None, self._record_all)
        end = self.now + t_step
        started = bc.started[c]
        first_token = self.ledger.first_token
        for _, job in started:
            first_token[job.request_id] = end
        started.clear()
        running = self.running
        if engine:
            self.sched.emit(members)
        elif shared:
            for g in range(len(loads)):
                loads[g] += running[g]
            tt.tokens += sum(running)
        else:
            for g in members:
                loads[g] += running[g]
                tt.tokens += running[g]
        k = bc.gk[c]
        for g, slot, job, out in bc.calendars[c].pop(k, ()):
            self._finish(g, slot, job, out, end)
        bc.gk[c] = k + 1
        bc.gnow[c] = end
        self.k += 1
        if shared:
            self.now = end
        else:  # the next boundary of a group with work, or the end of this step if none has any
            nxt = self._next_group()
            self.now = max(self.now, end if nxt is None else bc.gnow[nxt])
        return True

    def _next_group(self) -> int | None:
        """The group with work (running, or waiting at its workers) whose next step starts first."""
        if self._engine:
            return self.sched.next_group()
        return self.barrier.next_group(self.queues)

    # -- engine mode (`sched`) -----------------------------------------------------------------

    def _update_engine(self) -> None:
        self._engine = self.sched.wanted(self.barrier.models or (self.config.step,))
        self._admit = self.sched.admit if self._engine else self.admission.admit

    def set_speed(self, speed: Callable[[int, float], float] | None) -> None:
        """Step from now on at `speed(g, lane time)` × each worker's model time (None: 1)."""
        self.sched.speed = speed
        self._update_engine()

    def set_latency(self, front_s: Sequence[float] | None, back_s: Sequence[float] | None) -> None:
        """The servers' latencies from now on, per worker (`EngineScheduler.set_latency`)."""
        self.sched.set_latency(front_s, back_s)
        self._update_engine()

    def placed_loads(self) -> list[float]:
        """Per worker, the KV tokens of every request placed on it and not ended (`EngineScheduler`)."""
        return self.sched.placed_loads(self.now, self.loads, self.queued_tokens)

    def engine_waiting(self) -> list[int]:
        """Per worker, the requests in its engine's waiting queue (`EngineScheduler.engine_waiting`)."""
        return self.sched.engine_waiting(self.now, self.queues)

    def kv_blocks(self, g: int, block_tokens: int | None = None) -> int:
        """KV blocks worker g's running requests hold now, as its engine counts them after its last
        step (`EngineScheduler.kv_needed`, not `new`)."""
        bc = self.barrier
        return self.sched.kv_needed(g, bc.gk[bc.group_of[g]], new=False, block_tokens=block_tokens)

    def engine_running(self, g: int) -> int:
        """Worker g's running requests as its engine counts them after its last step (not the fresh)."""
        return self.running[g] - len(self.sched.fresh[g])

    # engine mode's figures (`set_speed`, `set_latency`; preempted requests admitted again, steps
    # that emitted no token, prefill tokens of each worker's last step, KV tokens draining)
    speed = Forward[Callable[[int, float], float] | None]("sched")
    front_s = Forward[tuple[float, ...] | None]("sched")
    back_s = Forward[tuple[float, ...] | None]("sched")
    preemptions = Forward[int]("sched")
    resumed = Forward[int]("sched")
    silent_steps = Forward[int]("sched")
    step_prefill = Forward[list[float]]("sched")
    draining_tokens = Forward[list[float]]("sched")

    # -- clock -------------------------------------------------------------------------------

    def set_clock(self, clock: LaneClock) -> None:
        """Step from now on under `clock` (barrier groups, per-worker models). Regrouping keeps every
        request's progress: a merged group starts its next step when its slowest member ends its
        current one; a split group's workers start theirs where the group would have."""
        clock.check(self.config.workers)
        self._routed = False
        bc = self.barrier
        bc.models = clock.models
        self.admission.fleet = None  # the next snapshot says the new models' cost to the policies
        self._update_engine()
        delta = bc.regroup([tuple(group) for group in clock.groups], self.running)
        if delta is not None:
            self.slots.regroup(delta, bc.group_of)
            self.sched.regroup(delta)

    def slot_steps(self) -> npt.NDArray[np.int64]:
        """Per slot: the step count of its worker's group (a slot's age is this − slot_start)."""
        return self.slots.slot_steps(self.barrier.gk)

    @property
    def clock_groups(self) -> list[tuple[int, ...]]:
        """The barrier groups the lane steps (worker indices)."""
        return list(self.barrier.groups)

    def group_now(self, c: int) -> float:
        """When barrier group c's next step can start (the end of its last one)."""
        return self.barrier.gnow[c]

    def projection(self) -> Projection:
        """BR-H's active requests: (worker, load, predicted steps left) (`SlotTable.projection`)."""
        return self.slots.projection(self.barrier.gk, self.k)

    def stay_basis(self, kind: str = "stay") -> StayBasis | None:
        """BRA's predicted thin-pool basis `kind` over the running requests (`SlotTable.stay_basis`)."""
        return self.slots.stay_basis(kind, self.barrier.gk)

    # -- a request's life in its slot ----------------------------------------------------------

    def _start(self, g: int, job: Job, ready_s: float, age: int = 0, *, resumed: bool = False,
               prefill_left: int = 0, chunk: int = 0) -> None:
        """Start `job` on worker `g`; `age` > 0: it already generated `age` tokens (seeded, or
        `resumed` after a preemption); `prefill_left` > 0 (engine mode): its prefill goes on over the
        next steps, and it begins decoding when that is done (`Prefill`)."""
        bc = self.barrier
        c = bc.group_of[g]
        k = bc.gk[c]
        if bc.gnow[c] < self.now:  # an idle group starts when its work arrives
            bc.gnow[c] = self.now
        slot = self.slots.take(g, job, k - age, k)
        self.loads[g] += job.prompt_tokens + age
        self.running_prompt[g] += job.prompt_tokens
        self.admission.hold(g, job)
        self.running[g] += 1
        bc.grun[c] += 1
        if self._engine:
            self.sched.started(g, slot, job, ready_s, age, resumed)
        if not resumed and not age:
            self.totals.wait_s.append(self.now - ready_s)
        if prefill_left:  # (its first `chunk` is in this step, `prefill_left` after it)
            self.sched.prefilling_from(g, slot, job, ready_s, age, prefill_left, chunk)
            return
        self._begin(g, slot, job, k - age, age, resumed)

    def _begin(self, g: int, slot: int, job: Job, start: int, age: int, resumed: bool) -> None:
        """`job` in `slot` emits its first (next) token at the end of its group's step `start` + `age`:
        its finish is booked (offline, or its end known) or watched (live)."""
        self.slot_start[slot] = start
        bc = self.barrier
        bc.book(g, slot, job, start, age, self.ends, self.slot_output)
        rid = job.request_id
        ledger = self.ledger
        if resumed and rid in ledger.first_token:  # counted when it first began
            return
        if age and not resumed:
            ledger.first_token[rid] = self.now
            ledger.seeded_age[rid] = age
            return
        bc.started[bc.group_of[g]].append((g, job))

    def _release(self, g: int, slot: int, job: Job, held: float) -> None:
        """Free `slot` of worker g, whose request held `held` KV tokens."""
        self.loads[g] -= held
        self.running_prompt[g] -= job.prompt_tokens
        self.running[g] -= 1
        bc = self.barrier
        bc.grun[bc.group_of[g]] -= 1
        self.slots.give(g, slot)
        sched = self.sched
        if sched.kv_limited or sched.slot_fresh[slot]:
            sched.released(g, slot)

    def _finish(self, g: int, slot: int, job: Job, out: int, end: float) -> None:
        held = job.prompt_tokens + out
        self._release(g, slot, job, held)
        self.admission.unhold(job.request_id)
        sched = self.sched
        if sched.kv_limited or sched.back_s is not None:
            sched.finished(g, held, end, self.on_drain)
        self.ledger.finish(job, out, end, self.totals)
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
