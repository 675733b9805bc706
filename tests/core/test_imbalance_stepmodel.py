"""Imbalance math and the step-time model fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadow.core.imbalance import barrier_idle_fraction, imbalance, spread
from shadow.core.stepmodel import StepTimeFit, StepTimeModel


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
    fit = StepTimeFit()
    assert fit.coefficients() is None and fit.r_squared() is None
    for x in rng.uniform(1e5, 4e5, size=500):
        fit.add(float(x), 1.2e-7 * x + 0.02 + rng.normal(0, 1e-4))
    a, b = fit.coefficients()  # type: ignore[misc]
    assert a == pytest.approx(1.2e-7, rel=0.02) and b == pytest.approx(0.02, rel=0.05)
    assert fit.r_squared() > 0.99  # type: ignore[operator]
    noise = StepTimeFit()
    for x in rng.uniform(1e5, 4e5, size=500):
        noise.add(float(x), float(rng.uniform(0.05, 0.07)))
    assert noise.r_squared() < 0.05  # type: ignore[operator]


def test_step_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        StepTimeModel(a=-1)
    with pytest.raises(ValueError):
        StepTimeModel(a=0, b=0)
    fit = StepTimeFit()
    fit.add(float("nan"), 1.0)
    fit.add(1.0, -1.0)
    assert fit.n == 0
