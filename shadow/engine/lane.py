"""One lane: a barrier-synchronised DP decode fleet routed by one policy, stepped one decode step at a time.

Per step k: admissions (engine FIFO queues for policies that bind at arrival; a BalanceRoute
round over the pool otherwise), then every running request emits one token — its KV load
s + (k − k0) grows by one — and requests that reach their output length free their slot at the
end of the step. The step lasts T(k) = a·max_g L_g(k) + b. Loads are kept per worker and updated
incrementally, so a step costs O(G + admissions + finishes) Python work; BR-H adds a vectorised
projection over the G·B slot arrays when it routes.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shadow.core.balanceroute import BalanceRoute
from shadow.core.baselines import BASELINES, Baseline, WorkerView, make_baseline
from shadow.core.bra import BalanceRouteAdaptive
from shadow.core.pool import Pool
from shadow.core.predictors import Predictor, contribution, make_predictor
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job

Clock = Callable[[], float]


@dataclass(slots=True)
class LaneTotals:
    """Running sums over steps and per-request samples, turned into a report by `results`."""

    steps: int = 0
    busy_time_s: float = 0.0
    sum_spread: float = 0.0
    sum_imbalance: float = 0.0
    sum_idle_s: float = 0.0  # Σ a·I(k): worker-seconds spent waiting at the barrier
    tokens: int = 0
    finished: int = 0
    shed: int = 0  # waiting requests dropped by `shed_waiting` (admission timeout)
    first_arrival_s: float = float("inf")
    last_finish_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    decision_s: list[float] = field(default_factory=list)
    trajectory_t: list[float] = field(default_factory=list)
    trajectory_loads: list[list[float]] = field(default_factory=list)


class Lane:
    """A simulated fleet under one routing policy; fed jobs with `offer`, advanced with `step`."""

    def __init__(
        self,
        spec: LaneSpec,
        config: EngineConfig,
        clock: Clock,
        forced: Mapping[Hashable, int] | None = None,
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
        self.queues: list[deque[tuple[Job, float]]] = [deque() for _ in range(g)]
        self.totals = LaneTotals()
        self._free_slots: list[list[int]] = [list(range((w + 1) * b - 1, w * b - 1, -1)) for w in range(g)]
        self._calendar: dict[int, list[tuple[int, int, Job]]] = {}
        self._started_now: list[tuple[int, Job]] = []
        self._first_token: dict[Hashable, float] = {}
        self._pool_ready: dict[Hashable, float] = {}
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
        self._last_refresh = -(10**9)
        # Policy.
        self.forced = forced
        self.baseline: Baseline | None = None
        self.router: BalanceRoute | BalanceRouteAdaptive | None = None
        self.predictor: Predictor | None = None
        self.pool: Pool | None = None
        if spec.policy in BASELINES:
            self.baseline = make_baseline(spec.policy, random.Random(config.seed))
        elif spec.policy in ("br0", "brh"):
            self.router = BalanceRoute("br0" if spec.policy == "br0" else "brh", config.br)
            self.pool = Pool()
            if spec.predictor is not None:
                self.predictor = make_predictor(spec.predictor)
        elif spec.policy == "bra":
            self.router = BalanceRouteAdaptive(config.br, config.bra)
            self.pool = Pool()
            if spec.predictor is not None:
                self.predictor = make_predictor(spec.predictor)
        elif forced is None:
            raise ValueError("a forced lane needs its assignments")

    # -- arrivals ---------------------------------------------------------------------------

    @property
    def binds_at_arrival(self) -> bool:
        return self.pool is None

    def offer(self, job: Job, ready_s: float) -> None:
        """A job whose prefill completed at `ready_s` (<= now) reaches the router."""
        self.totals.first_arrival_s = min(self.totals.first_arrival_s, job.arrival_s)
        if self.pool is not None:
            self.pool.add(job, job.prompt_tokens, ready_s, self._newcomer_steps(job))
            self._pool_ready[job.request_id] = ready_s
            return
        t0 = self.clock()
        if self.baseline is not None:
            g = self.baseline.pick(self._view(), job.prompt_tokens)
        else:
            assert self.forced is not None
            g = self.forced[job.request_id]
            if not 0 <= g < self.config.workers:
                raise ValueError(f"forced assignment of {job.request_id!r} to unknown worker {g}")
        self.totals.decision_s.append(self.clock() - t0)
        self.queues[g].append((job, ready_s))
        self.queued_tokens[g] += job.prompt_tokens

    def _view(self) -> WorkerView:
        b = self.config.slots
        return WorkerView(
            kv_tokens=[x + q for x, q in zip(self.loads, self.queued_tokens, strict=True)],
            outstanding=[r + len(q) for r, q in zip(self.running, self.queues, strict=True)],
            outstanding_tokens=self._outstanding_tokens(),
            free_slots=[b - r for r in self.running],
        )

    def _outstanding_tokens(self) -> list[float]:
        # Prompt tokens of requests sent and not finished: running prompts + queued prompts.
        out = list(self.queued_tokens)
        act = self.slot_active
        sums = np.bincount(
            self._slot_worker[act], weights=self.slot_prompt[act], minlength=self.config.workers
        )
        return [o + float(s) for o, s in zip(out, sums.tolist(), strict=True)]

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

    def shed_waiting(self, before: float) -> int:
        """Drop waiting (not yet admitted) requests that reached the router before `before`.

        The overload model of a proxy with an admission timeout; returns and counts the number shed.
        Queues and the pool hold requests in ready order, so only their heads are looked at.
        """
        shed = 0
        if self.pool is not None:
            for entry in self.pool.pop_arrived_before(before):
                assert isinstance(entry.request_id, Job)
                self._pool_ready.pop(entry.request_id.request_id, None)
                shed += 1
        else:
            for g, queue in enumerate(self.queues):
                while queue and queue[0][1] < before:
                    job, _ = queue.popleft()
                    self.queued_tokens[g] -= job.prompt_tokens
                    shed += 1
        self.totals.shed += shed
        return shed

    # -- stepping ---------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return sum(self.running)

    @property
    def waiting(self) -> int:
        return len(self.pool) if self.pool is not None else sum(len(q) for q in self.queues)

    def step(self) -> bool:
        """Run one decode step; False (and no time passes) when nothing is running after admissions."""
        self._admit()
        if not any(self.running):
            return False
        loads = self.loads
        mx, mn, tot = max(loads), min(loads), sum(loads)
        imb = len(loads) * mx - tot
        model = self.config.step
        t_step = model.a * mx + model.b
        tt = self.totals
        tt.steps += 1
        tt.busy_time_s += t_step
        tt.sum_spread += mx - mn
        tt.sum_imbalance += imb
        tt.sum_idle_s += model.a * imb
        if self._record_all:
            tt.trajectory_t.append(self.now)
            tt.trajectory_loads.append(list(loads))
        end = self.now + t_step
        for _, job in self._started_now:
            self._first_token[job.request_id] = end
        self._started_now.clear()
        running = self.running
        for g in range(len(loads)):
            loads[g] += running[g]
        tt.tokens += sum(running)
        for g, slot, job in self._calendar.pop(self.k, ()):
            self._finish(g, slot, job, end)
        self.now = end
        self.k += 1
        return True

    def _admit(self) -> None:
        if self.pool is None:
            for g, queue in enumerate(self.queues):
                while queue and self.running[g] < self.config.slots:
                    job, ready = queue.popleft()
                    self.queued_tokens[g] -= job.prompt_tokens
                    self._start(g, job, ready)
            return
        if not self.pool:
            return
        free = [self.config.slots - r for r in self.running]
        if not any(free):
            return
        assert self.router is not None
        t0 = self.clock()
        if isinstance(self.router, BalanceRouteAdaptive):
            idx, w, c = self._projection_inputs() if self.predictor is not None else (None, None, None)
            decisions = self.router.round(
                self.loads,
                free,
                self.pool,
                self.now,
                None if idx is None else self._slot_worker[idx],
                w,
                c,
                self.running_prompt,
            )
        elif self.predictor is not None:
            idx, w, c = self._projection_inputs()
            decisions = self.router.round(self.loads, free, self.pool, self.now, self._slot_worker[idx], w, c)
        else:
            decisions = self.router.round(self.loads, free, self.pool, self.now)
        self.totals.decision_s.append(self.clock() - t0)
        for entry, g in decisions:
            assert isinstance(entry, Job)
            self._start(g, entry, self._ready_of(entry))

    def _ready_of(self, job: Job) -> float:
        return self._pool_ready.pop(job.request_id, self.now)

    def _projection_inputs(
        self,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        idx = np.flatnonzero(self.slot_active)
        age = self.k - self.slot_start[idx]
        if self.k - self._last_refresh >= self.config.refresh_steps:
            self._refresh_predictions(idx, age)
        w = self.slot_prompt[idx] + age
        c = np.maximum(self._slot_steps[idx] - (self.k - self._slot_ref[idx]), 0.0)
        return idx, w, c

    def _refresh_predictions(self, idx: npt.NDArray[np.int64], age: npt.NDArray[np.int64]) -> None:
        assert self.predictor is not None
        h = self.config.br.horizon
        keys = [self._slot_key[i] for i in idx.tolist()]
        remaining = self.slot_output[idx] - age
        p, mu = self.predictor.predict(age, h, keys=keys, remaining=remaining)
        self._slot_steps[idx] = contribution(p, mu, h)
        self._slot_ref[idx] = self.k
        self._last_refresh = self.k

    def _start(self, g: int, job: Job, ready_s: float) -> None:
        slot = self._free_slots[g].pop()
        self.slot_active[slot] = True
        self.slot_prompt[slot] = job.prompt_tokens
        self.slot_start[slot] = self.k
        self.slot_output[slot] = job.output_tokens
        self._slot_key[slot] = job.prompt_key
        if self.predictor is not None:
            steps = self._newcomer_steps(job)
            self._slot_steps[slot] = self.config.br.horizon if steps is None else steps
            self._slot_ref[slot] = self.k
        self.loads[g] += job.prompt_tokens
        self.running_prompt[g] += job.prompt_tokens
        self.running[g] += 1
        self._calendar.setdefault(self.k + job.output_tokens - 1, []).append((g, slot, job))
        self._started_now.append((g, job))
        self.totals.wait_s.append(self.now - ready_s)

    def _finish(self, g: int, slot: int, job: Job, end: float) -> None:
        self.loads[g] -= job.prompt_tokens + job.output_tokens
        self.running_prompt[g] -= job.prompt_tokens
        self.running[g] -= 1
        self.slot_active[slot] = False
        self._slot_key[slot] = None
        self._free_slots[g].append(slot)
        tt = self.totals
        tt.finished += 1
        tt.last_finish_s = max(tt.last_finish_s, end)
        first = self._first_token.pop(job.request_id)
        tt.ttft_s.append(first - job.arrival_s)
        if job.output_tokens >= 2:
            tt.tpot_s.append((end - first) / (job.output_tokens - 1))
        if self.predictor is not None:
            self.predictor.observe(job.output_tokens, job.prompt_key)

    # -- checking ---------------------------------------------------------------------------

    def loads_from_slots(self) -> list[float]:
        """Per-worker loads recomputed from scratch (Σ s_i + generated_i); for invariant checks."""
        act = self.slot_active
        w = self.slot_prompt[act] + (self.k - self.slot_start[act])
        sums = np.bincount(self._slot_worker[act], weights=w, minlength=self.config.workers)
        return [float(x) for x in sums.tolist()]
