"""Engine mode: each worker of a lane scheduled as a vLLM-like engine does it.

Off (the paper's model) a lane admits whatever its free slots take and a step's time is linear in
its largest load. `EngineScheduler.wanted` turns it on when any of these is set: the token budget
and KV cache of `config.limits` (chunked prefill, vLLM V1's recompute preemption, the prefix cache
of a preempted request's blocks: `FreeBlocks`), a non-linear step model (terms per running sequence
and per prefill token), the servers' latencies (`set_latency`: front, placed -> in its engine's
queue; back, last step -> its stream's end), or the hosts' speed (`speed`).

The scheduler owns that state: per worker the requests still prefilling (`prefilling`, admission
order), the slots admitted for its next step (`fresh`), its plan for its next step (budget left,
prefill tokens, whether it preempted), its free KV blocks, the preempted requests queued again
(`resume`), and the finished requests whose stream has not ended (`draining`). It drives the lane
(`host`) through the lane's request lifecycle only: `_start` (admit), `_begin` (a prefill done:
decoding begins), `_release` (a preempted request leaves its slot), and its `admission` (a pool
router's placements); it reads the lane's per-worker lists (loads, running, queues, queued tokens),
its slots and its barrier clock. Pure.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shadow.core.routers import Router
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.admission import Admission
from shadow.engine.barrier import BarrierClock
from shadow.engine.config import DEFAULT_BLOCK_TOKENS, EngineConfig
from shadow.engine.jobs import Job
from shadow.engine.kvcache import FreeBlocks
from shadow.engine.outcomes import LaneTotals
from shadow.engine.slots import SlotTable


@dataclass(slots=True)
class Prefill:
    """A request in a running slot whose prompt (plus, resumed after a preemption, its tokens so
    far) is still being prefilled: `chunk` tokens of it scheduled into its worker's next step,
    `left` to go after that one."""

    slot: int
    job: Job
    ready: float
    age: int  # tokens it had generated before a preemption (0: a new request)
    left: int
    chunk: int = 0


class SchedulerHost(Protocol):
    """What `EngineScheduler` reads of its lane, and the lane's request lifecycle it drives."""

    config: EngineConfig
    now: float
    totals: LaneTotals
    router: Router
    loads: list[float]
    running: list[int]
    queues: list[deque[tuple[Job, float]]]
    queued_tokens: list[float]
    barrier: BarrierClock
    admission: Admission

    def _start(self, g: int, job: Job, ready_s: float, age: int = 0, *, resumed: bool = False,
               prefill_left: int = 0, chunk: int = 0) -> None: ...

    def _begin(self, g: int, slot: int, job: Job, start: int, age: int, resumed: bool) -> None: ...

    def _release(self, g: int, slot: int, job: Job, held: float) -> None: ...


class EngineScheduler:
    """See module docstring. `host` is the lane whose workers it schedules."""

    def __init__(self, host: SchedulerHost, config: EngineConfig, slots: SlotTable) -> None:
        g, n = config.workers, config.workers * config.slots
        self.host, self.slots, self.workers, self.b = host, slots, g, config.slots
        self.limits = config.limits
        self.front_s: tuple[float, ...] | None = None  # per worker: placed -> in its engine's queue
        self.back_s: tuple[float, ...] | None = None  # per worker: last step -> its stream's end
        # the host's speed: (worker, lane time) -> factor on its step model's time (live: measured)
        self.speed: Callable[[int, float], float] | None = None
        self.kv_limited = config.limits is not None and config.limits.kv_tokens is not None
        self.slot_pf = np.zeros(n, dtype=bool)  # the slot's request is still prefilling
        self.slot_fresh = np.zeros(n, dtype=bool)  # admitted at its worker's next step (not run yet)
        self.slot_ready = np.zeros(n, dtype=np.float64)  # kv-limited: each running slot's ready time
        self.kv_blocks = 0 if config.limits is None else config.limits.kv_blocks or 0
        self.preemptions = 0
        self.resumed = 0  # preempted requests admitted again
        self.silent_steps = 0  # steps that emitted no token (prefill chunks only)
        self.step_prefill = [0.0] * g  # prefill tokens scheduled into each worker's last step
        self._budget_left: list[float] = [0.0] * g  # its token budget left for admissions
        self.reset()

    def reset(self) -> None:
        """The engines' own state starts empty (at first, and at a re-seed: the seed puts requests back)."""
        g = self.workers
        self.admissible: dict[Hashable, float] = {}  # queued requests on their way (front latency)
        self.prefilling: list[list[Prefill]] = [[] for _ in range(g)]  # in admission order
        self.slot_pf[:] = False
        self.slot_fresh[:] = False
        self.fresh: list[list[int]] = [[] for _ in range(g)]  # ... the fresh slots per worker
        self.order: list[list[int]] = [[] for _ in range(g)]  # kv-limited: running slots, admission order
        self.slot_jobs: list[Job | None] = [None] * (g * self.b)  # kv-limited: each running slot's job
        limits = self.limits
        bs = 1 if limits is None else limits.block_tokens
        self.cache = [FreeBlocks(self.kv_blocks, bs) for _ in range(g)]  # kv-limited: its free blocks
        self.prefill = [0.0] * g  # prefill tokens scheduled into each worker's next step
        self.sched_k = [-1] * g  # the step index (of its group) each worker's plan is for
        self.no_admit = [False] * g  # its plan preempted: nothing is admitted in that step (vLLM)
        self.resume: dict[Hashable, int] = {}  # preempted, queued again: tokens generated before
        self.draining: list[deque[tuple[float, float]]] = [deque() for _ in range(g)]
        self.draining_tokens = [0.0] * g  # finished, stream not ended yet (back latency)

    def wanted(self, models: Sequence[StepTimeModel]) -> bool:
        """Whether the lane must step in engine mode under the step `models` in force."""
        return (self.limits is not None or self.front_s is not None or self.back_s is not None
                or self.speed is not None or not all(m.linear for m in models))

    def set_latency(self, front_s: Sequence[float] | None, back_s: Sequence[float] | None) -> None:
        """The servers' latencies from now on, per worker (None: none): `front_s`, from a request's
        placement to its engine's queue (the HTTP front end and input processing); `back_s`, from
        its last step to the end of its stream (output processing and the HTTP side), during which
        it holds no slot and no KV but is still placed (`placed_loads`)."""
        n = self.workers
        for what, xs in (("front", front_s), ("back", back_s)):
            if xs is not None and (len(xs) != n or not all(math.isfinite(x) and x >= 0 for x in xs)):
                raise ValueError(f"{what} latencies must be {n} finite values >= 0, got {list(xs)}")
        self.front_s = None if front_s is None else tuple(front_s)
        self.back_s = None if back_s is None else tuple(back_s)
        if self.front_s is None:
            self.admissible = {}

    def placed(self, rid: Hashable, g: int, at: float) -> None:
        """Request `rid` was placed on worker g at `at`: with a front latency, it is on its way."""
        if self.front_s is not None:
            self.admissible[rid] = at + self.front_s[g]

    def regroup(self, delta: list[int]) -> None:
        """The barrier groups changed: worker g's step count moved by `delta[g]`."""
        self.sched_k = [k + delta[g] if k >= 0 else k for g, k in enumerate(self.sched_k)]

    # -- what the lane reports -----------------------------------------------------------------

    def placed_loads(self, now: float, loads: list[float], queued_tokens: list[float]) -> list[float]:
        """Per worker, the KV tokens of every request placed on it and not ended: running, queued (on
        its way or waiting) and, with a back latency, finished but its stream not ended yet."""
        for g, drain in enumerate(self.draining):
            while drain and drain[0][0] <= now:
                self.draining_tokens[g] -= drain.popleft()[1]
            if not drain:
                self.draining_tokens[g] = 0.0  # no rounding left over
        return [x + q + d for x, q, d in zip(loads, queued_tokens, self.draining_tokens, strict=True)]

    def engine_waiting(self, now: float, queues: list[deque[tuple[Job, float]]]) -> list[int]:
        """Per worker, the requests in its engine's waiting queue: queued at it and arrived (not on
        their way: front latency)."""
        if not self.admissible:
            return [len(q) for q in queues]
        adm = self.admissible
        return [sum(1 for job, _ in q if adm.get(job.request_id, -math.inf) <= now) for q in queues]

    def kv_needed(self, g: int, k: int, new: bool = True, block_tokens: int | None = None) -> int:
        """Blocks worker g's running requests hold at the start of its step k (`new`: with the
        tokens that step computes: one per decoding request, the chunk of each prefilling one; not
        `new`: as its engine counts them after its last step, prompt and tokens computed so far,
        requests admitted for its next step not yet), in blocks of `block_tokens` (default the
        limits' block size)."""
        bs = block_tokens or (self.limits.block_tokens if self.limits is not None else DEFAULT_BLOCK_TOKENS)
        b, slots = self.b, self.slots
        sl = slice(g * b, (g + 1) * b)
        mask = slots.active[sl] & ~self.slot_pf[sl]
        if not new:
            mask &= ~self.slot_fresh[sl]
        held = slots.prompt[sl][mask] + (k - slots.start[sl][mask])
        if not new:
            held = held - 1  # the last sampled token is not computed yet
        blocks = int(np.ceil(held / bs).sum())
        for e in self.prefilling[g]:  # (`left` is what is left after its planned `chunk`)
            if new or not self.slot_fresh[e.slot]:
                done = e.job.prompt_tokens + e.age - e.left - (0 if new else e.chunk)
                blocks += -(-done // bs)
        return blocks

    # -- which group steps next ------------------------------------------------------------------

    def start_at(self, c: int) -> float:
        """When group c's next step can start: its boundary; idle, when a request on its way reaches
        one of its workers (inf: no work)."""
        clock = self.host.barrier
        if clock.grun[c]:
            return clock.gnow[c]
        adm, queues = self.admissible, self.host.queues
        first = math.inf
        for g in clock.groups[c]:
            q = queues[g]
            if q:
                first = min(first, adm.get(q[0][0].request_id, -math.inf) if adm else -math.inf)
        return max(clock.gnow[c], first)

    def next_group(self) -> int | None:
        """The group whose next step can start first (None: no group has work)."""
        best: int | None = None
        best_t = math.inf
        for c in range(len(self.host.barrier.groups)):
            t = self.start_at(c)
            if t < best_t:
                best, best_t = c, t
        return best

    # -- admissions ------------------------------------------------------------------------------

    def admit(self) -> None:
        """A pool router places requests on free slots (they join their worker's queue), then every
        worker at a step boundary schedules its next step (`schedule`)."""
        host = self.host
        router = host.router
        queues, running = host.queues, host.running
        if not router.binds_at_arrival and router.waiting():
            b = self.b
            free = [b - r - len(q) for r, q in zip(running, queues, strict=True)]
            if any(f > 0 for f in free):
                for entry, g, ready in host.admission.decide(free):
                    host.admission.hold(g, entry)
                    queues[g].append((entry, ready))
                    host.queued_tokens[g] += entry.prompt_tokens
                    self.placed(entry.request_id, g, host.now)
        clock = host.barrier
        for g in range(len(queues)):
            if clock.gnow[clock.group_of[g]] <= host.now:  # at a step boundary
                self.schedule(g)

    def schedule(self, g: int) -> None:
        """Worker g at a step boundary: its step's plan (once per step: the running requests' tokens
        and preemptions, `plan`), then its waiting requests admitted in order while a slot, token
        budget and KV blocks are left and nothing was preempted (vLLM V1's `schedule`)."""
        host = self.host
        clock = host.barrier
        k = clock.gk[clock.group_of[g]]
        if self.sched_k[g] != k:
            self.sched_k[g] = k
            self.plan(g, k)
        queue = host.queues[g]
        if not queue or self.no_admit[g]:
            return
        b, running, adm = self.b, host.running, self.admissible
        budget = self._budget_left[g]
        limits = self.limits
        cap = None if limits is None else limits.kv_blocks
        while queue and running[g] < b and budget > 0:
            job, ready = queue[0]
            rid = job.request_id
            if adm and adm.get(rid, -math.inf) > host.now:
                break  # still on its way (FIFO: nothing behind it is ahead of it)
            age = self.resume.get(rid, 0)
            need = job.prompt_tokens + age
            if cap is not None and running[g]:  # (an idle worker admits whatever its cache holds)
                assert limits is not None  # vLLM's default: its whole sequence must fit, not a chunk
                if self.kv_needed(g, k) + -(-need // limits.block_tokens) > cap:
                    break
            queue.popleft()
            adm.pop(rid, None)
            resumed = self.resume.pop(rid, None) is not None
            self.resumed += resumed
            host.queued_tokens[g] -= need
            hit = 0  # a resumed request's blocks still cached: only the tokens past them are computed
            if self.kv_limited:
                assert limits is not None
                bs = limits.block_tokens
                hit = self.cache[g].reclaim(rid, need)
            chunk = int(min(need - hit, budget))
            if self.kv_limited:
                self.cache[g].allocate(-(-(hit + chunk) // bs) - hit // bs)
            budget -= chunk
            self.prefill[g] += chunk
            host._start(g, job, ready, age, resumed=resumed, prefill_left=need - hit - chunk, chunk=chunk)
        self._budget_left[g] = budget

    def plan(self, g: int, k: int) -> None:
        """Worker g's step k, before admissions: one token per decoding request, then each
        prefilling one's next chunk from the budget left (a chunk that ends its prefill begins its
        decoding: its first token comes at the end of this step); when the KV cache cannot hold
        the step's tokens, the newest running requests are preempted (never the last one)."""
        host = self.host
        limits = self.limits
        pf = self.prefilling[g]
        budget = math.inf
        if limits is not None and limits.max_num_batched_tokens is not None:
            budget = float(limits.max_num_batched_tokens)
        budget -= host.running[g] - len(pf)
        prefill = 0
        for e in pf:
            e.chunk = int(min(e.left, max(budget, 0.0)))
            e.left -= e.chunk
            budget -= e.chunk
            prefill += e.chunk
        self.no_admit[g] = False
        if self.kv_limited:
            assert limits is not None and limits.kv_blocks is not None
            cap = limits.kv_blocks
            order = self.order[g]
            held = self.kv_needed(g, k, new=False)
            if host.loads[g] / limits.block_tokens + host.running[g] > cap:  # else it cannot overflow
                while len(order) > 1 and self.kv_needed(g, k) > cap:
                    was_prefilling = bool(self.slot_pf[order[-1]])
                    took, freed = self.preempt(g, order[-1], k)
                    held -= freed
                    budget += took
                    prefill -= took if was_prefilling else 0
            self.cache[g].allocate(self.kv_needed(g, k) - held)  # the step's new blocks
        for e in list(pf):
            if not e.left:  # its last chunk: it begins decoding in this step
                pf.remove(e)
                self.slot_pf[e.slot] = False
                host._begin(g, e.slot, e.job, k - e.age, e.age, e.age > 0)
        self.prefill[g] = float(prefill)
        self._budget_left[g] = budget

    def preempt(self, g: int, slot: int, k: int) -> tuple[int, int]:
        """vLLM V1's recompute preemption of the request in `slot` at the start of worker g's step k:
        its KV and slot freed, its finish unbooked, it goes to the front of g's queue and, admitted
        again, prefills its prompt and the tokens it generated (then goes on from there). Returns
        the tokens of the step's budget it had taken and the blocks it held (freed: its full ones
        stay cached for it, `FreeBlocks`)."""
        host = self.host
        job = self.slot_jobs[slot]
        assert job is not None and self.limits is not None
        took = 1
        if self.slot_pf[slot]:
            e = next(e for e in self.prefilling[g] if e.slot == slot)
            self.prefilling[g].remove(e)
            self.slot_pf[slot] = False
            age, took = e.age, e.chunk
            computed = job.prompt_tokens + age - e.left - e.chunk
        else:
            start = self.slots.start
            age = k - int(start[slot])
            key = int(start[slot] + self.slots.output[slot]) - 1
            host.barrier.unbook(host.barrier.group_of[g], slot, key)
            computed = job.prompt_tokens + age - 1
        full, partial = divmod(computed, self.limits.block_tokens)
        self.cache[g].release(computed, job.request_id)
        host._release(g, slot, job, job.prompt_tokens + age)
        host.queues[g].appendleft((job, float(self.slot_ready[slot])))
        host.queued_tokens[g] += job.prompt_tokens + age
        self.resume[job.request_id] = age
        self.no_admit[g] = True
        self.preemptions += 1
        return took, full + (1 if partial else 0)

    # -- the lane's request lifecycle, engine side -----------------------------------------------

    def started(self, g: int, slot: int, job: Job, ready_s: float, age: int, resumed: bool) -> None:
        """`job` took `slot` of worker g (a new or `resumed` request: admitted at its next step)."""
        if not age or resumed:
            self.slot_fresh[slot] = True
            self.fresh[g].append(slot)
        if self.kv_limited:
            self.order[g].append(slot)
            self.slot_jobs[slot] = job
            self.slot_ready[slot] = ready_s

    def prefilling_from(self, g: int, slot: int, job: Job, ready_s: float, age: int, left: int,
                        chunk: int) -> None:
        """The request in `slot` prefills `chunk` tokens in its worker's next step, `left` after it."""
        self.slot_pf[slot] = True
        self.prefilling[g].append(Prefill(slot, job, ready_s, age, left, chunk))

    def released(self, g: int, slot: int) -> None:
        """`slot` of worker g is free again."""
        if self.slot_fresh[slot]:
            self.slot_fresh[slot] = False
            self.fresh[g].remove(slot)
        if self.kv_limited:
            self.order[g].remove(slot)
            self.slot_jobs[slot] = None

    def finished(self, g: int, held: int, end: float,
                 on_drain: Callable[[int, float, float, float], None] | None) -> None:
        """A request of worker g holding `held` KV tokens finished at `end`: its blocks freed; with a
        back latency, it drains (its stream ends later; `on_drain` told)."""
        if self.kv_limited:
            assert self.limits is not None
            self.cache[g].release(held - 1)
        if self.back_s is not None and self.back_s[g] > 0:
            self.draining[g].append((end + self.back_s[g], held))
            self.draining_tokens[g] += held
            if on_drain is not None:
                on_drain(g, end, end + self.back_s[g], held)

    # -- a step ----------------------------------------------------------------------------------

    def step_time(self, members: Sequence[int]) -> tuple[float, float]:
        """The step's time (the slowest member's τ_g = a·L_g + c·n_g + p·P_g + b) and barrier idle."""
        host = self.host
        models, step = host.barrier.models, host.config.step
        loads, running, prefill = host.loads, host.running, self.prefill
        taus = [(step if models is None else models[g]).worker_time(loads[g], running[g], prefill[g])
                for g in members]
        speed = self.speed
        if speed is not None:
            now = host.now
            taus = [tau * speed(g, now) for tau, g in zip(taus, members, strict=True)]
        t_step = max(taus)
        return t_step, len(taus) * t_step - sum(taus)

    def emit(self, members: Sequence[int]) -> None:
        """The step's tokens: one per running request of each member but those still prefilling."""
        host = self.host
        loads, running = host.loads, host.running
        emitted = 0
        fresh = self.fresh
        slot_start = self.slots.start
        for g in members:
            if fresh[g]:
                self.slot_fresh[fresh[g]] = False
                fresh[g].clear()
            pf = self.prefilling[g]
            n = running[g] - len(pf)
            loads[g] += n
            emitted += n
            for e in pf:  # no token yet: its age (step count − start) stays what it holds
                e.chunk = 0
                slot_start[e.slot] += 1
            self.step_prefill[g] = self.prefill[g]
            self.prefill[g] = 0.0
        host.totals.tokens += emitted
        if not emitted:
            self.silent_steps += 1
