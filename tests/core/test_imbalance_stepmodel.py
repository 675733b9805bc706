"""Imbalance math and the step-time model fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadow.core.stepmodel import SlidingFit, StepTimeModel
from tests.core.imbalance import barrier_idle_fraction, imbalance, spread


def test_worked_example_from_the_paper_notes() -> None:
    assert imbalance([100, 90, 70, 60]) == 80
    assert spread([100, 90, 70, 60]) == 40


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=64), st.floats(1e-9, 1e-5), st.floats(1e-4, 0.1))
def test_idle_fraction_is_sum_of_worker_waits_over_total_time(loads: list[int], a: float, b: float) -> None:
    model = StepTimeModel(a=a, b=b)
    step = model.step_time(max(loads))
    waits = sum(step - model.worker_time(x) for x in loads)
    assert imbalance(loads) == sum(max(loads) - x for x in loads)
    assert barrier_idle_fraction(loads, model) == pytest.approx(waits / (len(loads) * step), abs=1e-12)


def test_fit_recovers_coefficients_and_reports_r2() -> None:
    rng = np.random.default_rng(0)
    fit = SlidingFit(size=600)
    empty = fit.result()
    assert empty.a_s_per_token is None and empty.r2 is None and empty.quality == "insufficient"
    for x in rng.uniform(1e5, 4e5, size=500):
        fit.add(float(x), 1.2e-7 * x + 0.02 + rng.normal(0, 1e-4))
    r = fit.result()
    assert r.a_s_per_token == pytest.approx(1.2e-7, rel=0.02) and r.b_s == pytest.approx(0.02, rel=0.05)
    assert r.r2 is not None and r.r2 > 0.99 and r.quality == "good" and r.samples == 500
    noise = SlidingFit(size=600)
    for x in rng.uniform(1e5, 4e5, size=500):
        noise.add(float(x), float(rng.uniform(0.05, 0.07)))
    n = noise.result()
    assert n.r2 is not None and n.r2 < 0.05 and n.quality == "poor"


def test_step_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        StepTimeModel(a=-1)
    with pytest.raises(ValueError):
        StepTimeModel(a=0, b=0)
    fit = SlidingFit()
    fit.add(float("nan"), 1.0)
    fit.add(1.0, -1.0)
    assert fit.result().samples == 0
