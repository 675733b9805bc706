"""Contracts of small core pieces that the property tests leave loose: the step-time fit on exact
data and at its edges, the imbalance helpers at their edges, the pool's shedding by arrival time,
the empirical length counter. Written against public functions (kills mutants, docs/mutation.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shadow.core.imbalance import barrier_idle_fraction, imbalance, spread
from shadow.core.pool import Pool
from shadow.core.predictors import EmpiricalLengths, OraclePredictor, SurvivalPredictor
from shadow.core.stepmodel import StepTimeFit, StepTimeModel

FALLBACK = StepTimeModel(a=1e-7, b=0.02)


def fit_of(points: list[tuple[float, float]]) -> StepTimeFit:
    fit = StepTimeFit()
    for x, y in points:
        fit.add(x, y)
    return fit


def test_fit_on_exact_points_recovers_the_line_and_r2_is_one() -> None:
    fit = fit_of([(0.0, 0.02), (100.0, 0.03), (300.0, 0.05)])
    a, b = fit.coefficients()  # type: ignore[misc]
    assert a == pytest.approx(1e-4, rel=1e-9) and b == pytest.approx(0.02, rel=1e-9)
    assert fit.r_squared() == pytest.approx(1.0, rel=1e-9)
    model = fit.model(FALLBACK)
    assert model.a == pytest.approx(1e-4) and model.b == pytest.approx(0.02)
    assert (fit.n, fit.sx, fit.sy) == (3, 400.0, pytest.approx(0.10))
    assert fit.sxx == 100.0**2 + 300.0**2 and fit.sxy == pytest.approx(100 * 0.03 + 300 * 0.05)
    assert fit.syy == pytest.approx(0.02**2 + 0.03**2 + 0.05**2)


def test_two_distinct_loads_are_enough_one_is_not() -> None:
    assert fit_of([(10.0, 1.0)]).coefficients() is None
    two = fit_of([(10.0, 1.0), (20.0, 3.0)])
    assert two.coefficients() == (pytest.approx(0.2), pytest.approx(-1.0))
    assert fit_of([(10.0, 1.0), (10.0, 3.0), (10.0, 2.0)]).coefficients() is None  # one load only


def test_zero_loads_and_zero_times_are_samples_negative_and_non_finite_are_not() -> None:
    fit = fit_of([(0.0, 0.0), (5.0, 0.0)])
    assert fit.n == 2
    bad = ((-1.0, 1.0), (1.0, -1e-9), (math.inf, 1.0), (1.0, math.nan), (math.nan, 1.0), (1.0, math.inf))
    for x, y in bad:
        fit.add(x, y)
    assert fit.n == 2 and fit.sx == 5.0 and fit.sy == 0.0


def test_r_squared_is_undefined_for_constant_times_and_in_0_1_otherwise() -> None:
    assert fit_of([(1.0, 0.5), (2.0, 0.5), (3.0, 0.5)]).r_squared() is None
    assert fit_of([(1.0, 0.5)]).r_squared() is None
    noisy = fit_of([(1.0, 1.0), (2.0, 3.0), (3.0, 2.0), (4.0, 4.0)])
    r2 = noisy.r_squared()
    assert r2 is not None and 0.0 < r2 < 1.0
    assert r2 == pytest.approx(0.64)  # cov² / (var_x var_y) = 2.0² / (5 · 1.25)


def test_model_falls_back_while_undefined_or_unphysical() -> None:
    assert StepTimeFit().model(FALLBACK) is FALLBACK
    assert fit_of([(1.0, 3.0), (2.0, 2.0)]).model(FALLBACK) is FALLBACK  # a < 0
    assert fit_of([(10.0, 0.5), (20.0, 1.5)]).model(FALLBACK) is FALLBACK  # b < 0
    flat = fit_of([(1.0, 0.0), (2.0, 0.0)])  # a = b = 0
    assert flat.model(FALLBACK) is FALLBACK
    only_b = fit_of([(1.0, 0.2), (2.0, 0.2)]).model(FALLBACK)  # a = 0, b > 0 is physical
    assert only_b is not FALLBACK and abs(only_b.a) < 1e-15 and only_b.b == pytest.approx(0.2)
    only_a = fit_of([(1.0, 0.1), (2.0, 0.2)]).model(FALLBACK)  # b = 0, a > 0 is physical
    assert only_a.a == pytest.approx(0.1) and abs(only_a.b) < 1e-12


def test_imbalance_helpers_at_their_edges() -> None:
    assert imbalance([]) == 0.0 and spread([]) == 0.0 and barrier_idle_fraction([], FALLBACK) == 0.0
    assert spread([5.0]) == 0.0 and spread([3, 9, 4]) == 6.0 and isinstance(spread([3, 9]), float)
    # all-idle fleet with b = 0: a zero-length step has no idle time (no division by zero)
    assert barrier_idle_fraction([0.0, 0.0], StepTimeModel(a=1e-7, b=0.0)) == 0.0
    m = StepTimeModel(a=1e-3, b=0.0)
    assert barrier_idle_fraction([100.0, 0.0], m) == pytest.approx(0.5)  # one of two waits all step
    assert barrier_idle_fraction([100.0, 100.0], m) == 0.0


def test_pop_arrived_before_takes_exactly_the_earlier_arrivals_in_order() -> None:
    pool = Pool()
    entries = [pool.add(f"r{i}", 100 - i, arrived_at=t) for i, t in enumerate([0.0, 1.0, 2.0, 2.0, 3.0])]
    assert pool.pop_arrived_before(-1.0) == [] and len(pool) == 5
    popped = pool.pop_arrived_before(2.0)
    assert popped == entries[:2]
    assert [e.request_id for e in pool] == ["r2", "r3", "r4"]
    assert pool.pop_arrived_before(10.0) == entries[2:] and not pool


def test_empirical_lengths_counts_added_and_initial_lengths() -> None:
    lengths = EmpiricalLengths([3, 5])
    assert len(lengths) == 2
    lengths.add(0)
    assert len(lengths) == 3
    lengths.conditional(np.array([0.0]), 4)  # settles the pending lengths: the count stays
    assert len(lengths) == 3
    with pytest.raises(ValueError, match="output length must be >= 0, got -1"):
        lengths.add(-1)
    assert len(lengths) == 3


def test_step_and_worker_time_are_a_times_load_plus_b() -> None:
    m = StepTimeModel(a=1e-3, b=0.02)
    assert m.step_time(100.0) == pytest.approx(0.12) and m.worker_time(50.0) == pytest.approx(0.07)
    assert m.step_time(0.0) == 0.02


@pytest.mark.parametrize("horizon", [3, 4, 5])
def test_oracle_agrees_with_a_point_mass_survival_estimate_at_the_horizon_edge(horizon: int) -> None:
    """Every request is 10 tokens long; at age 6, 4 remain: finishing within H iff 4 <= H."""
    oracle_p, oracle_r = OraclePredictor().predict(np.array([6]), horizon, remaining=np.array([4]))
    survival_p, _ = SurvivalPredictor([10] * 5).predict(np.array([6]), horizon)
    assert oracle_p.tolist() == survival_p.tolist() == [1.0 if horizon >= 4 else 0.0]
    assert oracle_p.dtype == np.float64 and oracle_r.dtype == np.float64 and oracle_r.tolist() == [4.0]


def test_oracle_needs_the_true_lengths() -> None:
    message = r"^the oracle predictor needs true remaining lengths \(offline replay only\)$"
    with pytest.raises(ValueError, match=message):
        OraclePredictor().predict(np.array([1]), 4)
