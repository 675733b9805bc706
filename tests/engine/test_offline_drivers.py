"""The offline drivers' wiring, on small hand-computed runs: prefill reaches the lanes, jobs are
offered as soon as they are ready (memory holds only jobs not yet ready), progress reports the
total, the trajectory is thinned to the points asked, a lane that never runs is named, and a
pool lane hears each newcomer's predicted stay."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shadow.core.stay import StayBasis
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec, PrefillConfig
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.offline import run_lanes, run_offline
from shadow.engine.summary import LogHistogram, percentile
from tests.engine.helpers import run_lane

UNIT = StepTimeModel(a=1.0, b=0.0)  # a step lasts max_g L_g seconds


def test_run_offline_sends_jobs_through_the_prefill_stage() -> None:
    # One prefill server, c0 = 1 s, c1 = 0.1 s/token: job 0 (10 tokens) is ready at 2 s, job 1 at
    # 4 s (it waits for the server).
    config = EngineConfig(
        workers=2, slots=1, step=UNIT, prefill=PrefillConfig(servers=1, c0_s=1.0, c1_s_per_token=0.1)
    )
    jobs = [Job(0, 0.0, 10, 1), Job(1, 0.0, 10, 1)]
    res = run_offline(jobs, config, [LaneSpec("rr")], time.perf_counter)["rr"]
    # job 0: ready at 2, one step of 10 s -> first token at 12; job 1: ready at 4, joins at the next
    # step boundary (12), one step of 10 s -> 22 (waited 8 s). Without prefill both would run in
    # the first step (TTFT 10 s, no wait). Percentiles of two samples interpolate: p50 = midpoint.
    assert res.ttft_p50_ms == pytest.approx(17_000.0) and res.wait_p50_ms == pytest.approx(4_000.0)
    lanes = [Lane(LaneSpec("jsq"), config, time.perf_counter)]
    run_lanes(iter(jobs), lanes, config.prefill)
    assert sorted(lanes[0].totals.ttft_s) == pytest.approx([12.0, 22.0])


def test_jobs_are_offered_as_soon_as_they_are_ready_not_held_back() -> None:
    # No prefill: a job is ready at its arrival, so it reaches every lane before the next job is
    # even read from the stream (all at t=0 here, then one later).
    log: list[str] = []

    class Logged(Lane):
        def offer(self, job: Job, ready_s: float) -> None:
            log.append(f"offer {job.request_id} to {self.spec.label}")
            super().offer(job, ready_s)

    def stream() -> Iterator[Job]:
        for job in (Job(0, 0.0, 1, 1), Job(1, 0.0, 1, 1), Job(2, 0.0, 1, 1), Job(3, 5.0, 1, 1)):
            log.append(f"read {job.request_id}")
            yield job

    config = EngineConfig(workers=1, slots=4, step=UNIT)
    lanes = [Logged(LaneSpec(p), config, time.perf_counter) for p in ("rr", "jsq")]
    assert run_lanes(stream(), lanes) == 4
    assert log == [x for i in range(4) for x in (f"read {i}", f"offer {i} to rr", f"offer {i} to jsq")]


def test_run_offline_reports_progress_against_the_length_of_a_job_list() -> None:
    # 501 one-token jobs at t=0 on 501 slots: the 500th offer reports 0 of 501 finished (the list's
    # length, not the 500 offered so far); the end reports 501 of 501.
    jobs = [Job(i, 0.0, 1, 1) for i in range(501)]
    calls: list[tuple[str, int, int]] = []
    run_offline(
        jobs,
        EngineConfig(workers=1, slots=501, step=UNIT),
        [LaneSpec("rr")],
        time.perf_counter,
        progress=lambda *a: calls.append(a),
    )
    assert calls == [("rr", 0, 501), ("rr", 501, 501)]
    calls.clear()
    run_offline(
        jobs,
        EngineConfig(workers=1, slots=501, step=UNIT),
        [LaneSpec("rr")],
        time.perf_counter,
        progress=lambda *a: calls.append(a),
        total=600,  # a total given wins
    )
    assert calls == [("rr", 0, 600), ("rr", 501, 600)]


def test_run_offline_thins_the_trajectory_to_the_points_asked() -> None:
    # One job of 5 tokens: 5 steps recorded; 2 points asked -> every 3rd step (t = 0 and 3 + ...).
    jobs = [Job(0, 0.0, 1, 5)]
    config = EngineConfig(workers=1, slots=1, step=UNIT, trajectory_points=2)
    res = run_offline(jobs, config, [LaneSpec("rr")], time.perf_counter)["rr"]
    assert res.trajectory_t == [0.0, 1.0 + 2.0 + 3.0]
    assert res.trajectory_loads == [[1.0], [4.0]]


class _Idle(Lane):
    """A broken lane: nothing ever runs (step() is always False)."""

    calls = 0

    def step(self, until: float = math.inf) -> bool:
        self.calls += 1
        assert self.calls < 100, "driver kept stepping an idle lane"
        return False


def test_a_lane_that_never_runs_its_jobs_is_named_by_the_drivers() -> None:
    config = EngineConfig(workers=1, slots=1, step=UNIT)
    lane = _Idle(LaneSpec("rr"), config, time.perf_counter)
    with pytest.raises(RuntimeError, match=r"^lane rr: jobs left but nothing runs \(engine bug\)$"):
        run_lane(lane, [Job(0, 0.0, 1, 1), Job(1, 0.0, 1, 1)], [0.0, 0.0])
    lanes = [_Idle(LaneSpec("jsq"), config, time.perf_counter)]
    with pytest.raises(RuntimeError, match=r"^lane jsq: jobs left but nothing runs \(engine bug\)$"):
        run_lanes([Job(0, 0.0, 1, 1)], lanes)


@pytest.mark.parametrize(("output", "expected"), [(5, 5.0), (10_000, 80.0)])
def test_a_pool_lane_hears_each_newcomers_predicted_stay_within_the_horizon(
    output: int, expected: float
) -> None:
    # BR-H with the oracle: a newcomer's predicted stay within the horizon (H = 80 by default) is
    # its output length, capped at H; the pool entry carries it (BRA's hold-back reads it).
    lane = Lane(LaneSpec("brh", "oracle"), EngineConfig(workers=1, slots=1, step=UNIT), time.perf_counter)
    lane.offer(Job("a", 0.0, 3, output), 0.0)
    (entry,) = list(lane.router.pool)  # type: ignore[attr-defined]
    assert entry.horizon_steps == pytest.approx(expected)
    assert lane.config.br.horizon == 80


class _Scripted:
    """A predictor that says: a newcomer stays 4 steps; every running request has 2 steps left."""

    name = "scripted"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def predict(self, generated, horizon, keys=None, remaining=None):  # type: ignore[no-untyped-def]
        self.calls.append(
            {"generated": generated.tolist(), "horizon": horizon, "keys": keys, "remaining": remaining}
        )
        n = len(generated)
        mu = 4.0 if len(self.calls) == 1 else 2.0
        return np.ones(n), np.full(n, mu)

    def observe(self, output_tokens: int, key: object = None) -> None:
        return None


def test_a_lanes_stay_basis_is_taken_over_its_running_requests() -> None:
    config = EngineConfig(workers=2, slots=2, step=UNIT)
    lane = Lane(LaneSpec("brh", "survival"), config, time.perf_counter)
    lane.offer(Job("a", 0.0, 10, 5, "ka"), 0.0)
    lane.offer(Job("b", 0.0, 4, 3, "kb"), 0.0)
    assert lane.step() is True  # both admitted and one token generated: age 1
    scripted = _Scripted()
    lane.predictor = scripted  # type: ignore[assignment]
    basis = lane.stay_basis()
    assert basis is not None and basis.span == 4.0
    # each running request: m/S * (w + (m - 1)/2) = 2/4 * (prompt + 1 + 0.5)
    want = [0.5 * (p + n * 1.5) for p, n in zip(lane.running_prompt, lane.running, strict=True)]
    assert basis.loads == pytest.approx(want) and sum(lane.running) == 2
    newcomer, running = scripted.calls
    assert newcomer["generated"] == [0] and running["generated"] == [1, 1] and running["horizon"] == 4
    keys, remaining = running["keys"], running["remaining"]
    assert sorted(zip(keys, remaining.tolist(), strict=True)) == [("ka", 4), ("kb", 2)]


def test_a_lane_without_a_fleet_wide_predictor_has_no_stay_basis() -> None:
    config = EngineConfig(workers=1, slots=1, step=UNIT)
    assert Lane(LaneSpec("jsq"), config, time.perf_counter).stay_basis() is None
    assert Lane(LaneSpec("brh", "oracle"), config, time.perf_counter).stay_basis() is None
    idle = Lane(LaneSpec("brh", "survival"), config, time.perf_counter)
    idle.predictor = _Scripted()  # type: ignore[assignment]
    assert idle.stay_basis() == StayBasis([0.0], 4.0)


class _Keyed:
    """Predicts by prompt key: "short" 1 step left, "long" 50, anything else (or no keys) 80."""

    name = "keyed"

    def predict(self, generated, horizon, keys=None, remaining=None):  # type: ignore[no-untyped-def]
        table = {"short": 1.0, "long": 50.0}
        mu = [table.get(k, 80.0) for k in keys] if keys is not None else [80.0] * len(generated)
        return np.ones(len(generated)), np.asarray(mu, dtype=np.float64)

    def observe(self, output_tokens: int, key: object = None) -> None:
        return None


def test_br_h_predicts_per_prompt_key_and_counts_a_short_prediction_down_to_zero() -> None:
    from shadow.core.params import BRParams

    config = EngineConfig(workers=1, slots=2, step=UNIT, br=BRParams(horizon=100), refresh_steps=2)
    lane = Lane(LaneSpec("brh", "survival"), config, time.perf_counter)
    lane.predictor = _Keyed()  # type: ignore[assignment]
    lane.offer(Job("a", 0.0, 5, 10, "short"), 0.0)
    lane.offer(Job("b", 0.0, 5, 10, "long"), 0.0)
    pool = {e.request_id.request_id: e.horizon_steps for e in lane.router.pool}  # type: ignore[attr-defined]
    assert pool == {"a": 1.0, "b": 50.0}  # the newcomers' stays, predicted by key

    def steps_left() -> list[float]:
        _, _, c = lane.projection()
        return sorted(c.tolist())

    assert lane.step() is True and lane.active == 2  # admitted at step 0 with ĉ = 1 and 50
    assert steps_left() == [0.0, 49.0]  # k = 1: counted down, not below zero
    assert lane.step() is True
    assert steps_left() == [1.0, 50.0]  # k = 2: refreshed, by key again
    assert lane.step() is True
    assert steps_left() == [0.0, 49.0]


def test_percentile_scales_exact_and_histogram_samples_alike() -> None:
    hist = LogHistogram()
    for x in (0.01, 0.02, 0.03):
        hist.append(x)
    p50 = hist.percentile(50)
    assert p50 is not None and percentile(hist, 50) == p50
    assert percentile(hist, 50, 1e3) == pytest.approx(p50 * 1e3)
    assert percentile(LogHistogram(), 50, 1e3) is None
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0], 50, 1e3) == 2000.0
    assert percentile([], 50) is None


def test_a_lane_builds_its_router_from_the_engine_config() -> None:
    from shadow.core.bra import BRAParams
    from shadow.core.params import BRParams

    br, bra = BRParams(horizon=7, r_max=3), BRAParams(hold=False)
    config = EngineConfig(workers=4, slots=2, step=UNIT, br=br, bra=bra, seed=7)
    assert Lane(LaneSpec("br0"), config, time.perf_counter).router.br.params is br  # type: ignore[attr-defined]
    adaptive = Lane(LaneSpec("bra", "survival"), config, time.perf_counter).router.br  # type: ignore[attr-defined]
    assert adaptive.params is br and adaptive.adaptive is bra

    def placements(seed: int) -> list[int]:
        lane = Lane(
            LaneSpec("random"), EngineConfig(workers=4, slots=2, step=UNIT, seed=seed), time.perf_counter
        )
        for i in range(12):
            lane.offer(Job(i, 0.0, 1, 1), 0.0)
        return [len(q) for q in lane.queues]

    assert placements(7) == placements(7) != placements(0)


def test_a_pool_round_is_timed_on_the_injected_clock() -> None:
    readings = iter([10.0, 12.5])
    lane = Lane(LaneSpec("br0"), EngineConfig(workers=1, slots=1, step=UNIT), lambda: next(readings))
    lane.offer(Job("a", 0.0, 1, 1), 0.0)
    assert lane.step() is True and lane.totals.decision_s == [2.5]


def test_requests_started_together_on_one_worker_add_their_prompts() -> None:
    lane = Lane(LaneSpec("rr"), EngineConfig(workers=1, slots=2, step=UNIT), time.perf_counter)
    lane.offer(Job("a", 0.0, 10, 2), 0.0)
    lane.offer(Job("b", 0.0, 4, 2), 0.0)
    assert lane.step() is True and lane.running_prompt == [14.0] and lane.loads == [16.0]


def test_a_finished_request_teaches_the_predictor_its_prompt_key() -> None:
    # BR-H with the exact-match predictor: after "k1" ended at 2 tokens and "k9" at 9, a new "k1"
    # request is predicted to end in 2 steps, a "k9" one in 9 (not the fleet-wide mix).
    lane = Lane(LaneSpec("brh", "exactmatch"), EngineConfig(workers=1, slots=2, step=UNIT), time.perf_counter)
    run_lane(lane, [Job("a", 0.0, 1, 2, "k1"), Job("b", 0.0, 1, 9, "k9")], [0.0, 0.0])
    pred = lane.router.predictor
    assert pred is not None
    p, mu = pred.predict(np.zeros(2, dtype=np.int64), 80, keys=["k1", "k9"])
    assert p.tolist() == [1.0, 1.0] and mu.tolist() == [2.0, 9.0]
