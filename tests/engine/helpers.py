"""Test helpers over the engine: a single lane run to the end on its one driver, prefill ready
times, a lane's loads recomputed from scratch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shadow.engine.config import PrefillConfig
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.offline import PrefillStage, Progress


def loads_from_slots(lane: Lane) -> list[float]:
    """Per-worker loads recomputed from the lane's slot arrays (Σ s_i + generated_i), to check its
    incremental loads against."""
    act = lane.slot_active
    w = lane.slot_prompt[act] + (lane.slot_steps()[act] - lane.slot_start[act])
    sums = np.bincount(lane.slots.worker[act], weights=w, minlength=lane.config.workers)
    return [float(x) for x in sums.tolist()]


def ready_times(jobs: Sequence[Job], prefill: PrefillConfig | None) -> list[float]:
    """When each job leaves prefill: earliest-free FCFS server, c0 + c1·s per job."""
    stage = PrefillStage(prefill)
    return [stage.ready(j) for j in jobs]


class _Watch(Observer):
    def __init__(
        self, n: int, progress: Progress | None, on_step: Callable[[Lane], None] | None, max_steps: int | None
    ) -> None:
        self.n, self.progress, self.on_step, self.max_steps = n, progress, on_step, max_steps

    def stepped(self, lane: Lane) -> None:
        if self.on_step is not None:
            self.on_step(lane)
        if self.progress is not None and lane.k % 2048 == 0:
            self.progress(lane.spec.label, lane.totals.finished, self.n)
        if self.max_steps is not None and lane.k >= self.max_steps:
            raise RuntimeError(f"lane {lane.spec.label}: gave up after {self.max_steps} steps")


def run_lane(
    lane: Lane,
    jobs: Sequence[Job],
    ready: Sequence[float],
    progress: Progress | None = None,
    on_step: Callable[[Lane], None] | None = None,
    max_steps: int | None = None,
) -> None:
    """Drive `lane` through `jobs` (offered in ready-time order) until all have finished;
    `on_step` after each step, `progress` every 2048 steps and at the end, RuntimeError after
    `max_steps`. The engine's guards apply (a lane that makes no progress raises, naming it)."""
    driver = LaneDriver(lane, observers=(_Watch(len(jobs), progress, on_step, max_steps),))
    for i in sorted(range(len(jobs)), key=lambda i: (ready[i], i)):
        driver.offer(jobs[i], ready[i])
    driver.drain()
    if progress is not None:
        progress(lane.spec.label, len(jobs), len(jobs))
