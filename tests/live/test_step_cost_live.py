"""The live lanes learn the step cost from an engine probe's counts: per barrier group the chosen
form with its terms and intervals in `/v1/report`, on `/metrics` and in the demo's status line, the
models handed to the lanes' clock, and the trust checks on its out-of-sample error."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from shadow.app.demo import cost_line
from shadow.contracts.events import Event, Route, Step, Token
from shadow.core.hostfactor import HOST_WINDOWS, HostFactor
from shadow.core.stepcost import PERIOD_ERROR_MAX, select
from shadow.core.stepmodel import FitResult
from shadow.live.confidence import cost_problem, host_warnings, period_problem, trust_problems
from shadow.live.lanes import LiveLanes, step_counts, step_period
from shadow.live.metrics import LiveCollector
from shadow.live.workerclock import StepCounts, host_wait
from tests.live.sessions import feed

B, C = 0.003, 0.0004  # the engine's true cost: 3 ms a step + 0.4 ms a running sequence


def _probe_steps(seed: int, workers: int, steps: int, *, shared: bool, noise: float = 0.05,
                 host: tuple[float, float] | None = None) -> list[Event]:
    """Probe step events of `workers` engines costing B + C·n (n: sequences computed, changing every
    40 steps), each step's period the engine's own (`engine_interval_s`) with Gaussian noise of sd
    `noise` × the cost. Independent engines step apart; `shared`: all at once, at the cost of the
    busiest (a barrier). `host`: each engine behind a host that multiplies its steps by a factor
    drawn in [low, high] every 200 steps, its cumulative wait for a CPU (the period less the cost)
    in `engine_wait_s` at each step, with the step's index."""
    rng = np.random.default_rng(seed)
    n = np.repeat(rng.integers(1, 17, size=(workers, steps // 40 + 1)), 40, axis=1)[:, :steps]
    lo, hi = host or (1.0, 1.0)
    factor = np.repeat(rng.uniform(lo, hi, size=(workers, steps // 200 + 1)), 200, axis=1)[:, :steps]
    events: list[Event] = []
    t = [0.0013 * g for g in range(workers)]
    waited = [0.0] * workers
    for k in range(steps):
        costs = [B + C * n[g, k] for g in range(workers)]
        if shared:
            costs = [max(costs)] * workers
        for g in range(workers):
            cost = costs[g] * (1 + noise * float(rng.standard_normal()))
            period = cost * (float(factor[0 if shared else g, k]))
            waited[g] += period - cost
            t[g] = (t[0] if shared and g else t[g]) + (0 if shared and g else period)
            extra: dict[str, Any] = {"engine_wait_s": waited[g], "iteration": k} if host else {}
            events.append(Step(t[g] + 1e-4 * g, 0.8 * period, worker=f"d{g}", engine=0, source="probe",
                               running=int(n[g, k]), interval_s=period, engine_interval_s=period,
                               decode_requests=int(n[g, k]), prefill_requests=0, prefill_tokens=0, **extra))
    events.sort(key=lambda e: e.t)
    return events


def _run(events: list[Event], workers: int) -> LiveLanes:
    live = LiveLanes(workers=[f"d{g}" for g in range(workers)], slots=16, policies=["br0"], lag_s=0.0,
                     window_s=0.5)
    return feed(live, events, 100)


def test_independent_engines_get_the_per_sequence_cost_each_with_its_interval() -> None:
    live = _run(_probe_steps(1, 2, 1500, shared=False), 2)
    rep = live.report()
    sm = rep["step_model"]
    assert sm["clock"]["groups"] == [["d0"], ["d1"]], sm["clock"]
    groups = sm["cost"]["groups"]
    assert set(groups) == {"d0", "d1"}
    for name, g in groups.items():
        assert g["form"] == "b + c·n", (name, g["reason"], g["forms"])
        assert g["terms"]["b"]["low"] <= B <= g["terms"]["b"]["high"], g["terms"]
        assert g["terms"]["c"]["low"] <= C <= g["terms"]["c"]["high"], g["terms"]
        assert g["oos_error"] < 0.05 and g["r2"] > 0.9 and g["driver"] == "load"
        assert g["window_steps"] == 25 and g["windows"] >= 20
        # the probe sent no wait for a CPU: the period itself is fitted, and the report says so
        assert g["basis"] == "period" and "no schedstat" in g["basis_reason"] and g["host_factor"] is None
        assert g["split"].startswith("period = b + c·n (fitted on the step period")
        # no load and no prefill seen: their terms are said to be unidentifiable, not fitted
        assert set(g["not_identified"]) == {"a", "p"}, g["not_identified"]
    assert sm["cost"]["not_identifiable"] is None
    # the lanes' clock: each worker on its own cost model, c included (lane.py prices it)
    for g, m in enumerate(live.lane_clock.models or ()):
        assert sm["clock"]["workers"][f"d{g}"]["model"] == "cost fit"
        assert m.c == pytest.approx(C, rel=0.1) and m.b == pytest.approx(B, rel=0.1) and m.a == 0
        assert sm["clock"]["lane_models"][f"d{g}"]["c_s_per_seq"] == m.c
    assert not any("step cost" in p for p in rep["comparison"]["problems"]), rep["comparison"]["problems"]
    line = cost_line(sm)
    assert line is not None and "d0 b + c·n (b " in line and "ms/seq" in line and "out-of-sample" in line


def test_a_cost_model_says_it_comes_from_the_probe_after_a_window_of_stream_gaps_only() -> None:
    # the probe's posts can lag the streams: a last window with SSE gaps and no reported step takes
    # its figure from the gaps, but the cost model the lanes step on is still the probe's
    steps = _probe_steps(1, 2, 1500, shared=False)
    end = steps[-1].t
    tail: list[Event] = []
    for i in range(32):
        tail += [Route(f"s{i}", end + 0.01, f"d{i % 2}", 10), Token(f"s{i}", end + 0.02, 1)]
    tail += [Token(f"s{i}", end + 0.02 + 0.01 * k, 1 + k) for k in range(1, 200) for i in range(32)]
    live = _run(steps + tail, 2)
    sm = live.report()["step_model"]
    for g in range(2):
        assert sm["clock"]["workers"][f"d{g}"]["model"] == "cost fit", sm["clock"]["workers"]
        assert sm["clock"]["workers"][f"d{g}"]["source"] == "probe", sm["clock"]["workers"]
    assert {w.source for w in live.steps.worker_clock.w} == {"sse"}  # (the last window's figures)
    assert sm["model_source"] == "probe", sm


def test_engines_behind_one_barrier_share_one_fitted_model() -> None:
    live = _run(_probe_steps(2, 2, 2000, shared=True), 2)
    sm = live.report()["step_model"]
    assert sm["clock"]["groups"] == [["d0", "d1"]], sm["clock"]
    g = sm["cost"]["groups"]["d0+d1"]
    assert g["form"] == "b + c·n", g
    assert g["terms"]["c"]["low"] <= C <= g["terms"]["c"]["high"], g["terms"]
    assert g["window_steps"] == 50  # 25 steps of the group: each reported by both ranks
    models = live.lane_clock.models or ()
    assert live.lane_clock.groups == ((0, 1),) and models[0] == models[1]
    assert models[0].c == pytest.approx(C, rel=0.1)


def test_the_cost_fits_are_on_metrics() -> None:
    live = _run(_probe_steps(3, 2, 1500, shared=False), 2)
    got = {m.name: m for m in LiveCollector(live).collect()}
    terms = {tuple(s.labels.values()): s.value for s in got["shadow_step_cost_term_seconds"].samples}
    assert terms[("d0", "c", "estimate")] == pytest.approx(C, rel=0.1)
    assert terms[("d0", "c", "low")] <= C <= terms[("d0", "c", "high")]
    assert terms[("d1", "a", "estimate")] == 0.0  # not in the form
    forms = {(s.labels["group"], s.labels["form"]): s.value for s in got["shadow_step_cost_form"].samples}
    assert forms[("d0", "b+c")] == 1.0 and sum(v for (g, _), v in forms.items() if g == "d0") == 1.0
    oos = {s.labels["group"]: s.value for s in got["shadow_step_cost_oos_error_ratio"].samples}
    assert set(oos) == {"d0", "d1"} and max(oos.values()) < 0.05
    assert {s.labels["group"] for s in got["shadow_step_cost_r2"].samples} == {"d0", "d1"}
    assert all(s.value >= 20 for s in got["shadow_step_cost_windows"].samples)


def test_steps_without_counts_keep_the_old_estimator_and_say_what_it_cannot_identify() -> None:
    events: list[Event] = [Step(0.005 * (k + 1), 0.004, worker="d0", source="probe", interval_s=0.005)
                           for k in range(600)]
    sm = _run(events, 1).report()["step_model"]
    assert sm["cost"]["groups"] == {}
    assert set(sm["cost"]["not_identifiable"]) == {"c", "p"}
    assert sm["clock"]["workers"]["d0"]["model"] == "mean step"
    line = cost_line(sm)
    assert line is not None and "cannot identify c, p" in line


def test_a_cost_model_off_out_of_sample_makes_the_figures_untrustworthy_and_says_why() -> None:
    rng = np.random.default_rng(0)
    k = 100
    n = rng.integers(1, 16, size=k).astype(np.float64)
    noisy = select(0.004 * (1 + 0.4 * rng.standard_normal(k)).clip(0.05), n, np.zeros(k), np.zeros(k),
                   window_steps=25)
    assert noisy.chosen is not None and noisy.chosen.oos_error is not None and noisy.chosen.oos_error > 0.1
    why = cost_problem("d0", noisy)
    assert why is not None and "d0" in why and "off out of sample on 25-step windows" in why
    assert "the host, not the load, drives the variance" in why
    few = select([0.004] * 4, [1] * 4, [0] * 4, [0] * 4, window_steps=25)
    want = "step cost model of d1 not chosen yet (4 windows of 25 steps (needs 20))"
    assert cost_problem("d1", few) == want
    good = select(0.004 + 3e-4 * n + rng.normal(0, 1e-5, k), n, np.zeros(k), np.zeros(k), window_steps=25)
    assert cost_problem("d0", good) is None
    # the cost fits are the test of the step model when a probe feeds them, whatever the linear fit
    poor_linear = FitResult(None, None, 0.1, 100, "poor")
    assert trust_problems(poor_linear, 0.01, 1.0, 0, [("d0", good)]) == []
    assert trust_problems(poor_linear, 0.01, 1.0, 0)[0].startswith("step model fit is poor")


def test_a_step_event_gives_its_real_period_and_counts() -> None:
    old = Step(1.0, 0.004, worker="d0", source="probe", running=3)
    assert step_period(old) is None  # the engine's elapsed execute time is not its period
    assert step_period(Step(1.0, 0.004, interval_s=0.006)) == 0.006
    new = Step(1.0, 0.004, interval_s=0.0061, engine_interval_s=0.006, running=5, decode_requests=4,
               prefill_requests=1, prefill_tokens=200)
    assert step_period(new) == 0.006
    counts = step_counts(new)
    assert counts is not None and (counts.seqs, counts.prefill_tokens) == (5, 200)
    old_counts = step_counts(old)
    assert old_counts is not None and (old_counts.seqs, old_counts.prefill_tokens) == (3, 0)
    dummy = step_counts(Step(1.0, 0.004, dummy=True, running=0))
    assert dummy is not None and (dummy.seqs, dummy.prefill_tokens) == (0, 0)
    assert step_counts(Step(1.0, 0.004)) is None


def test_the_engines_cost_is_fitted_apart_from_the_host_and_the_lanes_step_on_both() -> None:
    """Engines costing B + C·n behind hosts that multiply their steps by 2-6 (changing every 200
    steps, per engine), the probe sending each engine's wait for a CPU: each group's cost is fitted
    on the engine's work (its terms the engine's, within their intervals), the host factor is
    measured over the last windows, the lanes step on the engine's model × the clock factor (the
    last windows' periods over its prediction: the host factor here), which predicts the window
    periods one window ahead, and /metrics and the status line say so."""
    live = _run(_probe_steps(4, 2, 3000, shared=False, noise=0.03, host=(2.0, 6.0)), 2)
    rep = live.report()
    sm = rep["step_model"]
    assert sm["cost"]["period_error_max"] == PERIOD_ERROR_MAX and sm["cost"]["host_windows"] == HOST_WINDOWS
    for g, (name, grp) in enumerate(sorted(sm["cost"]["groups"].items())):
        assert grp["basis"] == "engine", grp["basis_reason"]
        assert grp["form"] == "b + c·n", (grp["reason"], grp["forms"])
        assert grp["terms"]["b"]["low"] <= B <= grp["terms"]["b"]["high"], grp["terms"]
        assert grp["terms"]["c"]["low"] <= C <= grp["terms"]["c"]["high"], grp["terms"]
        assert grp["oos_error"] < 0.05 and grp["r2"] > 0.9
        h = grp["host_factor"]
        assert 2.0 <= h["low"] <= h["median"] <= h["high"] <= 6.0 and 2.0 <= h["recent"] <= 6.0, h
        assert 0.5 < grp["host_wait_share"] < 0.84
        assert grp["period_error"] < 0.05 and grp["period_windows"] >= 20, grp["period_error"]
        assert "engine cost (b + c·n, fitted on the engine's work per step) × clock factor" in grp["split"]
        worker = sm["clock"]["workers"][name]
        # (the clock was set at the last lane window's close: its factor may be a cost window older)
        assert worker["model"] == "cost fit" and 1.8 <= worker["clock_factor"] <= 6.6, worker
        assert worker["engine_model"]["c_s_per_seq"] == pytest.approx(C, rel=0.1)
        lane = (live.lane_clock.models or ())[g]
        assert lane.c == pytest.approx(worker["engine_model"]["c_s_per_seq"] * worker["clock_factor"])
        assert lane.b == pytest.approx(worker["engine_model"]["b_s"] * worker["clock_factor"])
        # the clock factor: the host's wait × the engine's work over its cost (1 within the noise)
        assert grp["clock_factor"] == pytest.approx(h["recent"], rel=0.1)
    assert not any("step cost" in p or "predicts" in p for p in rep["comparison"]["problems"]), \
        rep["comparison"]["problems"]
    got = {m.name: m for m in LiveCollector(live).collect()}
    factors = {tuple(s.labels.values()): s.value for s in got["shadow_step_cost_host_factor_ratio"].samples}
    assert factors[("d0", "recent")] == pytest.approx(sm["cost"]["groups"]["d0"]["host_factor"]["recent"])
    basis = {s.labels["group"]: s.value for s in got["shadow_step_cost_engine_basis"].samples}
    assert basis == {"d0": 1, "d1": 1}
    assert all(s.value < 0.05 for s in got["shadow_step_cost_period_error_ratio"].samples)
    line = cost_line(sm)
    assert line is not None and "× clock factor" in line and "one window ahead" in line, line
    clock = {s.labels["group"]: s.value for s in got["shadow_step_cost_clock_factor_ratio"].samples}
    assert clock["d0"] == pytest.approx(sm["cost"]["groups"]["d0"]["clock_factor"])


def test_a_barrier_groups_engine_work_is_its_most_held_back_members() -> None:
    """Two ranks in lockstep behind one host factor: the group's fit is on the engine's work, its
    terms the engine's, the factor the host's."""
    live = _run(_probe_steps(5, 2, 3000, shared=True, noise=0.03, host=(2.0, 4.0)), 2)
    sm = live.report()["step_model"]
    g = sm["cost"]["groups"]["d0+d1"]
    assert g["basis"] == "engine" and g["form"] == "b + c·n", g
    assert g["terms"]["c"]["low"] <= C <= g["terms"]["c"]["high"], g["terms"]
    assert 2.0 <= g["host_factor"]["recent"] <= 4.0 and g["period_error"] < 0.05


def test_what_the_lanes_step_on_off_the_window_periods_is_a_trust_problem_said_with_the_host() -> None:
    rng = np.random.default_rng(1)
    k = 100
    n = rng.integers(1, 16, size=k).astype(np.float64)
    good = select(0.004 + 3e-4 * n + rng.normal(0, 1e-5, k), n, np.zeros(k), np.zeros(k), window_steps=25)
    host = HostFactor(recent=5.2, median=3.1, low=2.5, high=4.0, windows=100, recent_windows=4,
                      wait_share=0.7, level=5.0)
    off = replace(good, basis="engine", host=host, clock_factor=6.1, period_error=0.27, period_windows=90)
    assert cost_problem("d0", off) is None  # the engine's cost itself is fine
    why = period_problem("d0", off)
    assert why is not None and why.startswith("engine cost × clock factor of d0 predicts its 25-step window "
                                              "periods 27% off, one window ahead (median of 90; needs ≤ 10%)")
    assert "clock factor 6.10 over the last 4 windows, of which the host's wait 5.20 (2.50–4.00" in why
    assert why.endswith("the host changed within the run")
    assert trust_problems(FitResult(None, None, 0.1, 100, "poor"), 0.01, 1.0, 0, [("d0", off)]) == [why]
    assert period_problem("d0", replace(off, period_error=0.08)) is None
    warned = host_warnings([("d0", off)], trustworthy=False)
    assert len(warned) == 1 and "moved within the run: 5.00 over the last 8 windows" in warned[0]
    assert "do not hold" in warned[0]
    assert "(clock factor 6.10)" in warned[0]
    assert host_warnings([("d0", replace(off, host=replace(host, level=3.0)))], trustworthy=True) == []


def test_the_wait_between_two_steps_is_over_the_time_that_passed_while_the_engine_stepped() -> None:
    """`host_wait`: the wait's difference over the record times' (or the engine's run + wait where
    longer: the record time was taken apart from the read); None across an idle gap (iterations not
    consecutive; without them, more than two periods apart), without the wait, or backwards."""
    prev = (1.000, 0.010, StepCounts(4, 0, 2.000, 10, 0.500))
    assert host_wait(prev, 1.010, 0.010, StepCounts(4, 0, 2.008, 11, 0.502)) == pytest.approx((0.008, 0.010))
    # run + wait (0.003 + 0.009) longer than the records' 0.010: the span is the engine's
    assert host_wait(prev, 1.010, 0.010, StepCounts(4, 0, 2.009, 11, 0.503)) == pytest.approx((0.009, 0.012))
    assert host_wait(prev, 1.010, 0.010, StepCounts(4, 0, 2.008, 12, 0.502)) is None  # a step between
    old = (1.000, 0.010, StepCounts(4, 0, 2.000))
    assert host_wait(old, 1.015, 0.010, StepCounts(4, 0, 2.012)) == pytest.approx((0.012, 0.015))
    assert host_wait(old, 1.030, 0.010, StepCounts(4, 0, 2.012)) is None  # idle between them
    assert host_wait(old, 1.010, 0.010, StepCounts(4, 0, None)) is None
    assert host_wait(old, 1.010, 0.010, StepCounts(4, 0, 1.9)) is None
    assert host_wait(None, 1.010, 0.010, StepCounts(4, 0, 2.0)) is None
