"""Staleness as a lane property in the simulated clock: a lane named `policy@AGE` routes on a view
of the engines that old at most (`shadow.core.routers.StaleView`), so on a burst of arrivals
inside one refresh period it places where the fresh lane does not; at age 0 it is the fresh lane."""

from __future__ import annotations

import time

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from tests.engine.helpers import run_lane

CONFIG = EngineConfig(workers=2, slots=8, step=StepTimeModel(a=1e-6, b=0.01))


def _burst(label: str, n: int = 6) -> list[int]:
    """Where a lane places `n` requests of 100 prompt tokens that all arrive at t = 0."""
    lane = Lane(LaneSpec.parse(label), CONFIG, time.perf_counter)
    for i in range(n):
        lane.offer(Job(i, 0.0, 100, 5), 0.0)
    return [len(q) for q in lane.queues]


def test_a_burst_inside_one_poll_period_is_spread_only_by_the_rules_own_increments() -> None:
    # SMG reads used KV tokens, which queued prompts are not: fresh, every request of the burst sees
    # two empty ranks and goes to rank 0; on its 10 s poll its own estimates spread them.
    assert _burst("smg-min-tokens@0") == [6, 0]
    assert _burst("smg-min-tokens") == [3, 3]
    assert _burst("smg-min-tokens@10s") == [3, 3]


def test_stale_and_fresh_lanes_run_to_the_end_and_differ_on_bursty_traffic() -> None:
    jobs = [Job(i, 0.5 * (i // 8), 50 + 37 * (i % 5), 3 + (i * 7) % 11) for i in range(64)]
    figures = {}
    for label in ("smg-min-tokens@0", "smg-min-tokens", "vllm-dp@0", "vllm-dp@1s", "br0", "br0@1s"):
        lane = Lane(LaneSpec.parse(label), CONFIG, time.perf_counter)
        run_lane(lane, jobs, [j.arrival_s for j in jobs])
        assert lane.totals.finished == len(jobs)
        figures[label] = lane.totals.sum_imbalance
    assert figures["smg-min-tokens@0"] != figures["smg-min-tokens"]
    assert figures["br0"] != figures["br0@1s"]
