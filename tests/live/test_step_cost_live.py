"""The live lanes learn the step cost from an engine probe's counts: per barrier group the chosen
form with its terms and intervals in `/v1/report`, on `/metrics` and in the demo's status line, the
models handed to the lanes' clock, and the trust checks on its out-of-sample error."""

from __future__ import annotations

import numpy as np
import pytest

from shadow.app.demo import cost_line
from shadow.contracts.events import Event, Step
from shadow.core.stepcost import select
from shadow.live.confidence import cost_problem, trust_problems
from shadow.live.lanes import LiveLanes, step_counts, step_period
from shadow.live.metrics import LiveCollector
from tests.live.sessions import feed

B, C = 0.003, 0.0004  # the engine's true cost: 3 ms a step + 0.4 ms a running sequence


def _probe_steps(seed: int, workers: int, steps: int, *, shared: bool, noise: float = 0.05) -> list[Event]:
    """Probe step events of `workers` engines costing B + C·n (n: sequences computed, changing every
    40 steps), each step's period the engine's own (`engine_interval_s`) with Gaussian noise of sd
    `noise` × the cost. Independent engines step apart; `shared`: all at once, at the cost of the
    busiest (a barrier)."""
    rng = np.random.default_rng(seed)
    n = np.repeat(rng.integers(1, 17, size=(workers, steps // 40 + 1)), 40, axis=1)[:, :steps]
    events: list[Event] = []
    t = [0.0013 * g for g in range(workers)]
    for k in range(steps):
        costs = [B + C * n[g, k] for g in range(workers)]
        if shared:
            costs = [max(costs)] * workers
        for g in range(workers):
            period = costs[g] * (1 + noise * float(rng.standard_normal()))
            t[g] = (t[0] if shared and g else t[g]) + (0 if shared and g else period)
            events.append(Step(t[g] + 1e-4 * g, 0.8 * period, worker=f"d{g}", engine=0, source="probe",
                               running=int(n[g, k]), interval_s=period, engine_interval_s=period,
                               decode_requests=int(n[g, k]), prefill_requests=0, prefill_tokens=0))
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
    from shadow.core.stepmodel import FitResult
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
