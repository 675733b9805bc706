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
from shadow.engine.driver import LaneDriver
from shadow.engine.jobs import Job
from shadow.engine.lane import Clock, Lane
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
    drivers = [LaneDriver(lane) for lane in lanes]
    offered = 0
    last_arrival = float("-inf")

    def deliver(until: float) -> None:
        nonlocal offered
        while pending and pending[0][0] <= until:
            ready, _, job = heapq.heappop(pending)
            for driver in drivers:
                driver.offer(job, ready)
            offered += 1
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
    for driver in drivers:
        label = driver.lane.spec.label

        def every_2048(lane: Lane, label: str = label) -> None:
            if progress is not None and lane.k % 2048 == 0:
                progress(label, lane.totals.finished, total or offered)

        driver.drain(every_2048 if progress is not None else None)
        if progress is not None:
            progress(label, offered, total or offered)
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
