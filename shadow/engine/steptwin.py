"""A real engine's steps replayed through a lane on the engine's own step index: the scheduler's
rules checked apart from time.

An engine probe reports after each step k the running and waiting requests and the requests the
step computed. From them (`arrivals`): finished_k = computed_k − running_k, and the requests that
reached the engine before step k (it adds requests between steps; a step schedules what is there)
= (running_k + waiting_k) − (running_{k−1} + waiting_{k−1}) + finished_k: every request in it is
running or waiting until it finishes, a preempted one included (vLLM counts a preemption only when
the request next produces a token, at its resume, so a step's own preemptions are not known).
`replay` offers the jobs (in the order they reached the engine) to a one-worker lane with unit
steps at those step indices
and steps it once per engine step: its step k is the engine's step k whatever the host's speed or
the HTTP side's delays, so the two series differ only where the lane's scheduling rules (slots,
FIFO queue, token budget, KV blocks and preemption: `EngineLimits`) differ from the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, EngineLimits, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One step as an engine probe reports it (the counts after it)."""

    running: int
    waiting: int
    computed: int  # requests it computed (prefilling and decoding)
    preempted: int = 0  # preemptions the probe counted at it (vLLM: at the preempted one's resume)
    kv_blocks: int | None = None  # blocks in use after it (usage × the cache's blocks)
    prefill_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StepPair:
    """The engine's and the twin's (running, waiting, KV blocks, prefill tokens) after step k."""

    engine: tuple[int, int, int | None, int | None]
    twin: tuple[int, int, int, int]


def arrivals(steps: Sequence[EngineStep]) -> list[int]:
    """Per step index k, the requests that reached the engine's queue before step k."""
    out: list[int] = []
    held = 0
    for s in steps:
        finished = max(0, s.computed - s.running)
        out.append(max(0, s.running + s.waiting - held + finished))
        held = s.running + s.waiting
    return out


def replay(steps: Sequence[EngineStep], jobs: Sequence[Job], slots: int, limits: EngineLimits
           ) -> list[StepPair]:
    """The twin's step-by-step state beside the engine's (see module docstring); `jobs` in the
    order they reached the engine, as many as `arrivals` counts (extra ones are left out, missing
    ones end the offers early)."""
    config = EngineConfig(workers=1, slots=slots, step=StepTimeModel(0.0, 1.0), limits=limits)
    forced = {j.request_id: 0 for j in jobs}
    lane = Lane(LaneSpec("forced"), config, time.perf_counter, forced=forced)
    pending = list(jobs)
    out: list[StepPair] = []
    for k, (step, n) in enumerate(zip(steps, arrivals(steps), strict=True)):
        lane.now = float(k)
        for job in pending[:n]:
            lane.offer(Job(job.request_id, float(k), job.prompt_tokens, job.output_tokens), float(k))
        del pending[:n]
        ran = lane.step()
        twin_prefill = int(lane.step_prefill[0]) if ran else 0
        out.append(StepPair(
            (step.running, step.waiting, step.kv_blocks, step.prefill_tokens),
            (lane.engine_running(0), lane.engine_waiting()[0], lane.kv_blocks(0), twin_prefill)))
    return out
