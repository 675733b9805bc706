"""Fleet engine invariants: loads, I(k), token totals, no lost or duplicated requests, a hand example."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec, PrefillConfig
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.offline import run_offline
from shadow.engine.results import lane_result
from shadow.replay.experiment import DEFAULT_POLICIES
from tests.core.imbalance import imbalance
from tests.engine.helpers import loads_from_slots, ready_times, run_lane

ALL_LANES = list(DEFAULT_POLICIES)


@st.composite
def workloads(draw: st.DrawFn) -> list[Job]:
    n = draw(st.integers(1, 40))
    gaps = draw(st.lists(st.floats(0, 0.5), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    keys = draw(st.lists(st.sampled_from([None, "a", "b", "c"]), min_size=n, max_size=n))
    t, jobs = 0.0, []
    for i in range(n):
        t += gaps[i]
        jobs.append(Job(i, t, prompts[i], outputs[i], keys[i]))
    return jobs


@settings(max_examples=40, deadline=None)
@given(
    jobs=workloads(),
    workers=st.integers(1, 5),
    slots=st.integers(1, 4),
    policy=st.sampled_from(ALL_LANES),
    horizon=st.integers(0, 12),
)
def test_step_invariants_hold_for_every_policy(
    jobs: list[Job], workers: int, slots: int, policy: str, horizon: int
) -> None:
    from shadow.core.params import BRParams

    config = EngineConfig(
        workers=workers,
        slots=slots,
        step=StepTimeModel(a=1e-6, b=0.01),
        br=BRParams(horizon=horizon, beta=max(2.0, float(workers)), age_s=0.05),
        refresh_steps=3,
    )
    lane = Lane(LaneSpec.parse(policy), config, time.perf_counter)
    model = config.step

    def check(ln: Lane) -> None:
        # After every step: incremental loads equal a from-scratch recomputation, slots are respected.
        assert ln.loads == pytest.approx(loads_from_slots(ln))
        assert all(r <= slots for r in ln.running)
        assert all(x >= 0 for x in ln.loads)

    run_lane(lane, jobs, ready_times(jobs, None), on_step=check, max_steps=100_000)
    assert lane.totals.finished == len(jobs)
    assert lane.totals.tokens == sum(j.output_tokens for j in jobs)
    assert lane.active == 0 and lane.waiting == 0
    assert sum(lane.loads) == 0
    assert len(lane.totals.ttft_s) == len(jobs)
    assert lane.totals.sum_idle_s == pytest.approx(model.a * lane.totals.sum_imbalance)


class SnapshotLane(Lane):
    """Records, for each step, the loads recomputed from scratch right before the step runs."""

    snapshots: list[list[float]]

    def step(self, until: float = math.inf) -> bool:
        self._admit()  # what step() does first; a second call admits nothing more
        snap = loads_from_slots(self)
        ran = super().step(until)
        if ran:
            self.snapshots.append(snap)
        return ran


@settings(max_examples=30, deadline=None)
@given(jobs=workloads(), workers=st.integers(1, 4), slots=st.integers(1, 3))
def test_imbalance_each_step_is_sum_of_gaps_to_the_max(jobs: list[Job], workers: int, slots: int) -> None:
    config = EngineConfig(
        workers=workers, slots=slots, step=StepTimeModel(a=1e-6, b=0.01), trajectory_points=1
    )
    for policy in ("jsq", "br0", "brh:oracle"):
        lane = SnapshotLane(LaneSpec.parse(policy), config, time.perf_counter)
        lane.snapshots = []
        increments: list[float] = []
        last = [0.0]

        def record(ln: Lane, increments: list[float] = increments, last: list[float] = last) -> None:
            increments.append(ln.totals.sum_imbalance - last[0])
            last[0] = ln.totals.sum_imbalance

        run_lane(lane, jobs, ready_times(jobs, None), on_step=record)
        assert len(lane.snapshots) == len(increments) == lane.totals.steps
        # The incrementally maintained loads the step used equal a from-scratch recomputation...
        assert lane.totals.trajectory_loads == [pytest.approx(x) for x in lane.snapshots]
        # ...and the step's I(k) is Σ_g (max L − L_g) of those loads.
        for loads, d_imb in zip(lane.snapshots, increments, strict=True):
            assert d_imb == pytest.approx(sum(max(loads) - x for x in loads))
            assert d_imb == pytest.approx(imbalance(loads))


def test_forced_lane_reproduces_a_hand_computed_three_worker_example() -> None:
    # a=1 s/token, b=0: step time = max load. Jobs (id, arrival, prompt, output):
    #   A(0, s=10, o=2) → w0, B(0, s=4, o=3) → w1, C(0, s=6, o=1) → w2, D(1.5, s=3, o=1) → w2.
    # Step 0 (t=0):   loads [10, 4, 6]  → T=10, I=30-20=10, spread 6. C finishes.
    # Step 1 (t=10):  D arrived at 1.5, admitted: loads [11, 5, 3] → T=11, I=33-19=14, spread 8. A, D finish.
    # Step 2 (t=21):  loads [0, 6, 0] → T=6, I=18-6=12, spread 6. B finishes at t=27.
    jobs = [Job("A", 0, 10, 2), Job("B", 0, 4, 3), Job("C", 0, 6, 1), Job("D", 1.5, 3, 1)]
    forced = {"A": 0, "B": 1, "C": 2, "D": 2}
    config = EngineConfig(workers=3, slots=2, step=StepTimeModel(a=1.0, b=0.0))
    res = run_offline(jobs, config, [LaneSpec("forced")], time.perf_counter, forced=forced)["forced"]
    assert res.steps == 3
    assert res.avg_imbalance_tokens == pytest.approx((10 + 14 + 12) / 3)
    assert res.avg_spread_tokens == pytest.approx((6 + 8 + 6) / 3)
    assert res.tokens == 7 and res.finished == 4
    assert res.makespan_s == pytest.approx(27.0)
    # barrier idle = Σ a·I / Σ G·T = 36 / (3 · 27)
    assert res.barrier_idle_fraction == pytest.approx(36 / 81)
    # TTFT: A, B, C get their first token at t=10; D at t=21 (arrived 1.5).
    assert res.ttft_p50_ms == pytest.approx(10_000)
    # TPOT: A (21-10)/1 = 11 s, B (27-10)/2 = 8.5 s.
    assert res.tpot_p50_ms == pytest.approx((11 + 8.5) / 2 * 1e3)


def test_all_lanes_see_every_request_exactly_once() -> None:
    rng = np.random.default_rng(5)
    jobs = [
        Job(i, float(t), int(s), int(o), f"k{i % 7}")
        for i, (t, s, o) in enumerate(
            zip(
                np.cumsum(rng.exponential(0.05, 300)),
                rng.integers(10, 4000, 300),
                rng.integers(1, 300, 300),
                strict=True,
            )
        )
    ]
    config = EngineConfig(workers=4, slots=8, prefill=PrefillConfig(servers=2))
    results = run_offline(jobs, config, [LaneSpec.parse(p) for p in ALL_LANES], time.perf_counter)
    assert list(results) == [
        "rr",
        "random",
        "p2c",
        "jsq",
        "jsq-bytes",
        "least-tokens",
        "br0",
        "brh-survival",
        "brh-exactmatch",
        "brh-oracle",
    ]
    for r in results.values():
        assert r.finished == 300 and r.requests == 300
        assert r.tokens == sum(j.output_tokens for j in jobs)
    assert results["brh-oracle"].offline_bound and not results["brh-survival"].offline_bound


def test_prefill_servers_are_fcfs() -> None:
    jobs = [Job(0, 0.0, 100, 1), Job(1, 0.0, 100, 1), Job(2, 0.0, 100, 1)]
    ready = ready_times(jobs, PrefillConfig(servers=2, c0_s=1.0, c1_s_per_token=0.01))
    assert ready == pytest.approx([2.0, 2.0, 4.0])


def test_bad_configuration_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        LaneSpec.parse("jsq-psychic")
    with pytest.raises(ValueError, match="predictor"):
        LaneSpec("brh", "tarot")
    with pytest.raises(ValueError, match="takes no predictor"):
        LaneSpec.parse("jsq:oracle")
    with pytest.raises(ValueError, match="workers"):
        EngineConfig(workers=0)
    with pytest.raises(ValueError, match="unique"):
        run_offline([Job(0, 0, 1, 1)], EngineConfig(), [LaneSpec("rr"), LaneSpec("rr")], time.perf_counter)


@settings(max_examples=25, deadline=None)
@given(jobs=workloads(), workers=st.integers(1, 4), slots=st.integers(1, 3), prefill=st.booleans())
def test_lockstep_stream_equals_each_lane_alone(
    jobs: list[Job], workers: int, slots: int, prefill: bool
) -> None:
    # One shared stream, consumed once (a generator), gives every lane exactly what it gets alone.
    config = EngineConfig(
        workers=workers,
        slots=slots,
        step=StepTimeModel(a=1e-6, b=0.01),
        prefill=PrefillConfig(servers=2, c0_s=0.01, c1_s_per_token=1e-5) if prefill else None,
    )
    specs = [LaneSpec.parse(p) for p in ("rr", "jsq-bytes", "br0", "brh:survival")]
    shared = run_offline((j for j in jobs), config, specs, time.perf_counter)
    ready = ready_times(jobs, config.prefill)
    for spec in specs:
        lane = Lane(spec, config, time.perf_counter)
        run_lane(lane, jobs, ready)
        alone = lane_result(lane, len(jobs), 0).figures()
        together = shared[spec.label].figures()
        for key in ("decision_ms_p50", "decision_ms_p99"):  # wall-clock timings differ
            alone.pop(key)
            together.pop(key)
        assert together == alone
