"""BRA's "stay" basis against hand-computed values, with a scripted predictor that records what it
is asked: the newcomer's stay (rounded, at least one step, capped by `cap`), what running requests
pass through (ages, keys, remaining), and the mean-over-the-stay formula including requests with
less than one predicted step left."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pytest

from shadow.core.stay import STAY_CAP, StayBasis, predicted_stay, stay_basis


class Scripted:
    """p_fin = 1 and mu_rem = `stay` for a newcomer (no keys), `mu[i]` for running request i."""

    name = "scripted"

    def __init__(self, stay: float, mu: Sequence[float] = ()) -> None:
        self.stay = stay
        self.mu = list(mu)
        self.calls: list[dict[str, Any]] = []

    def predict(
        self,
        generated: np.ndarray,
        horizon: int,
        keys: Sequence[Hashable | None] | None = None,
        remaining: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        self.calls.append({"generated": generated, "horizon": horizon, "keys": keys, "remaining": remaining})
        n = len(generated)
        mu = [self.stay] if not self.calls[1:] else self.mu
        return np.ones(n), np.asarray(mu[:n], dtype=np.float64)

    def observe(self, output_tokens: int, key: Hashable | None = None) -> None:
        return None


@pytest.mark.parametrize(("stay", "expected"), [(0.2, 1), (1.2, 1), (1.6, 2), (7.4, 7), (5000.0, STAY_CAP)])
def test_the_newcomers_stay_is_rounded_at_least_one_step_and_capped(stay: float, expected: int) -> None:
    pred = Scripted(stay)
    assert predicted_stay(pred) == expected
    (call,) = pred.calls
    assert call["horizon"] == STAY_CAP and call["keys"] is None and call["remaining"] is None
    gen = call["generated"]
    assert gen.dtype == np.int64 and gen.tolist() == [0]  # one newcomer, nothing generated yet


def test_the_stay_cap_given_to_the_basis_bounds_the_span() -> None:
    basis = stay_basis(Scripted(10.0), 2, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), cap=3)
    assert basis == StayBasis([0.0, 0.0], 3.0)
    assert (
        stay_basis(Scripted(10.0), 1, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)).span == 10.0
    )


def test_one_running_request_counts_its_mean_load_over_the_stay() -> None:
    # Span S = 4. One request on worker 1 with load 100 and m = 2 predicted steps left:
    # 2/4 * (100 + (2 - 1)/2) = 50.25.
    pred = Scripted(4.0, [2.0])
    basis = stay_basis(
        pred, 2, np.array([1]), np.array([100.0]), np.array([7]), keys=["k"], remaining=np.array([2])
    )
    assert basis.loads == [0.0, pytest.approx(50.25)] and basis.span == 4.0
    running = pred.calls[1]
    assert running["generated"].tolist() == [7] and running["horizon"] == 4
    assert running["keys"] == ["k"] and running["remaining"].tolist() == [2]


def test_requests_with_under_one_step_left_add_no_growth_and_workers_sum() -> None:
    # S = 4: m = 0.5 -> 0.5/4 * (40 + 0) = 5; m = 4 -> 4/4 * (10 + 1.5) = 11.5, both on worker 0;
    # m = 1 -> 1/4 * (20 + 0) = 5 on worker 2.
    pred = Scripted(4.0, [0.5, 4.0, 1.0])
    basis = stay_basis(pred, 3, np.array([0, 0, 2]), np.array([40.0, 10.0, 20.0]), np.array([1, 2, 3]))
    assert basis.loads == [pytest.approx(16.5), 0.0, pytest.approx(5.0)]
    assert basis.newcomer(10.0) == 11.5  # prompt + (S - 1)/2
