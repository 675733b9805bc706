"""Offline driver: replay jobs through every lane, each lane on its own simulated clock.

Prefill (optional) is shared: N FCFS prefill servers give each job the time it enters the
router, identical for all lanes. Each lane then steps until every job has finished. `clock`
(for decision timing only) and `progress` are injected; nothing here reads the wall clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

from shadow.engine.config import EngineConfig, LaneSpec, PrefillConfig
from shadow.engine.jobs import Job
from shadow.engine.lane import Clock, Lane
from shadow.engine.results import LaneResult, lane_result

Progress = Callable[[str, int, int], None]  # (lane label, finished jobs, total jobs)


def ready_times(jobs: Sequence[Job], prefill: PrefillConfig | None) -> list[float]:
    """When each job leaves prefill: earliest-free FCFS server, c0 + c1·s per job."""
    if prefill is None:
        return [j.arrival_s for j in jobs]
    free_at = [0.0] * prefill.servers
    out: list[float] = []
    for j in jobs:
        p = min(range(prefill.servers), key=lambda i: (max(free_at[i], j.arrival_s), i))
        done = max(free_at[p], j.arrival_s) + prefill.c0_s + prefill.c1_s_per_token * j.prompt_tokens
        free_at[p] = done
        out.append(done)
    return out


def run_lane(
    lane: Lane,
    jobs: Sequence[Job],
    ready: Sequence[float],
    progress: Progress | None = None,
    on_step: Callable[[Lane], None] | None = None,
    max_steps: int | None = None,
) -> None:
    """Step `lane` until all `jobs` (sorted by ready time) have finished."""
    order = sorted(range(len(jobs)), key=lambda i: (ready[i], i))
    n, i = len(jobs), 0
    label = lane.spec.label
    while lane.totals.finished < n:
        while i < n and ready[order[i]] <= lane.now:
            lane.offer(jobs[order[i]], ready[order[i]])
            i += 1
        if lane.step():
            if on_step is not None:
                on_step(lane)
            if progress is not None and lane.k % 2048 == 0:
                progress(label, lane.totals.finished, n)
            if max_steps is not None and lane.k >= max_steps:
                raise RuntimeError(f"lane {label}: gave up after {max_steps} steps")
        elif i < n:
            lane.now = max(lane.now, ready[order[i]])
        else:
            raise RuntimeError(f"lane {label}: jobs left but nothing runs (engine bug)")
    if progress is not None:
        progress(label, n, n)


def run_offline(
    jobs: Sequence[Job],
    config: EngineConfig,
    lanes: Sequence[LaneSpec],
    clock: Clock,
    progress: Progress | None = None,
    forced: Mapping[Hashable, int] | None = None,
) -> dict[str, LaneResult]:
    """Replay `jobs` through each lane; results keyed by lane label, in lane order."""
    labels = [spec.label for spec in lanes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"lane labels must be unique, got {labels}")
    ready = ready_times(jobs, config.prefill)
    out: dict[str, LaneResult] = {}
    for spec in lanes:
        lane = Lane(spec, config, clock, forced if spec.policy == "forced" else None)
        run_lane(lane, jobs, ready, progress)
        out[spec.label] = lane_result(lane, len(jobs), config.trajectory_points)
    return out
