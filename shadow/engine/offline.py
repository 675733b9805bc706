"""Offline driver: one shared stream of jobs, consumed once, advancing every lane in lockstep.

Prefill (optional) is shared: N FCFS prefill servers give each job the time it enters the
router, identical for all lanes. Each lane keeps its own simulated clock (its step times follow
its own loads); a job is offered to a lane at the first step boundary at or after its ready time.
`clock` (for decision timing only) and `progress` are injected; nothing here reads the wall clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from shadow.engine.config import EngineConfig, LaneSpec, PrefillConfig
from shadow.engine.jobs import Job
from shadow.engine.lane import Clock, Lane, checked_step
from shadow.engine.results import LaneResult, lane_result

Progress = Callable[[str, int, int], None]  # (lane label, finished jobs, total jobs)


class PrefillStage:
    """N FCFS prefill servers; `ready(job)` is when the job leaves prefill (jobs in arrival order)."""

    def __init__(self, config: PrefillConfig | None) -> None:
        self.config = config
        self._free_at = [0.0] * (config.servers if config is not None else 0)

    def ready(self, job: Job) -> float:
        c = self.config
        if c is None:
            return job.arrival_s
        free = self._free_at
        p = min(range(c.servers), key=lambda i: (max(free[i], job.arrival_s), i))
        done = max(free[p], job.arrival_s) + c.c0_s + c.c1_s_per_token * job.prompt_tokens
        free[p] = done
        return done


def ready_times(jobs: Sequence[Job], prefill: PrefillConfig | None) -> list[float]:
    """When each job leaves prefill: earliest-free FCFS server, c0 + c1·s per job."""
    stage = PrefillStage(prefill)
    return [stage.ready(j) for j in jobs]


def run_lane(
    lane: Lane,
    jobs: Sequence[Job],
    ready: Sequence[float],
    progress: Progress | None = None,
    on_step: Callable[[Lane], None] | None = None,
    max_steps: int | None = None,
) -> None:
    """Step `lane` until all `jobs` (sorted by ready time) have finished.

    RuntimeError (naming the lane) instead of looping forever: a step count past `max_steps` or
    past the jobs' output tokens, or an idle lane whose next job is not later than its clock (a
    NaN ready time, or an engine bug).
    """
    order = sorted(range(len(jobs)), key=lambda i: (ready[i], i))
    n, i = len(jobs), 0
    label = lane.spec.label
    budget = sum(job.output_tokens for job in jobs)
    while lane.totals.finished < n:
        while i < n and ready[order[i]] <= lane.now:
            lane.offer(jobs[order[i]], ready[order[i]])
            i += 1
        if checked_step(lane, budget):
            if on_step is not None:
                on_step(lane)
            if progress is not None and lane.k % 2048 == 0:
                progress(label, lane.totals.finished, n)
            if max_steps is not None and lane.k >= max_steps:
                raise RuntimeError(f"lane {label}: gave up after {max_steps} steps")
        elif i < n:
            nxt = ready[order[i]]
            if not nxt > lane.now:
                raise RuntimeError(
                    f"lane {label}: idle at t={lane.now} with a job ready at {nxt} not offered"
                )
            lane.now = nxt
        else:
            raise RuntimeError(f"lane {label}: jobs left but nothing runs (engine bug)")
    if progress is not None:
        progress(label, n, n)


def _advance(lane: Lane, t: float, budget: int) -> None:
    """Step `lane` until its clock reaches `t` (an idle lane jumps there)."""
    while lane.now < t:
        if not checked_step(lane, budget):
            lane.now = t
            return


def run_lanes(
    jobs: Iterable[Job],
    lanes: Sequence[Lane],
    prefill: PrefillConfig | None = None,
    progress: Progress | None = None,
    total: int | None = None,
) -> int:
    """Feed one stream of jobs (in arrival order) to every lane in lockstep, then drain them.

    Returns the number of jobs. Jobs are consumed once; memory holds only jobs not yet ready.
    """
    stage = PrefillStage(prefill)
    pending: list[tuple[float, int, Job]] = []  # (ready time, order, job): prefill can reorder
    offered = 0
    tokens = 0  # output tokens offered: a bound on the steps any lane can run (`checked_step`)
    last_arrival = float("-inf")

    def deliver(until: float) -> None:
        nonlocal offered, tokens
        while pending and pending[0][0] <= until:
            ready, _, job = heapq.heappop(pending)
            for lane in lanes:
                _advance(lane, ready, tokens)
                lane.offer(job, ready)
            offered += 1
            tokens += job.output_tokens
            if progress is not None and offered % 500 == 0:
                for lane in lanes:
                    progress(lane.spec.label, lane.totals.finished, total or offered)

    for n, job in enumerate(jobs):
        if job.arrival_s < last_arrival:
            raise ValueError(f"job {job.request_id!r} arrives before the previous one")
        last_arrival = job.arrival_s
        heapq.heappush(pending, (stage.ready(job), n, job))
        deliver(job.arrival_s)  # ready times are >= arrivals: everything up to here is final
    deliver(float("inf"))
    for lane in lanes:
        while lane.totals.finished < offered:
            if not checked_step(lane, tokens):
                raise RuntimeError(f"lane {lane.spec.label}: jobs left but nothing runs (engine bug)")
            if progress is not None and lane.k % 2048 == 0:
                progress(lane.spec.label, lane.totals.finished, total or offered)
        if progress is not None:
            progress(lane.spec.label, offered, total or offered)
    return offered


def run_offline(
    jobs: Iterable[Job],
    config: EngineConfig,
    lanes: Sequence[LaneSpec],
    clock: Clock,
    progress: Progress | None = None,
    forced: Mapping[Hashable, int] | None = None,
    total: int | None = None,
) -> dict[str, LaneResult]:
    """Replay `jobs` through every lane on one shared stream; results keyed by lane label."""
    labels = [spec.label for spec in lanes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"lane labels must be unique, got {labels}")
    running = [Lane(spec, config, clock, forced if spec.policy == "forced" else None) for spec in lanes]
    if total is None and isinstance(jobs, Sequence):
        total = len(jobs)
    n = run_lanes(jobs, running, config.prefill, progress, total)
    return {lane.spec.label: lane_result(lane, n, config.trajectory_points) for lane in running}
