"""BRA's "stay" basis against hand-computed values, with a scripted predictor that records what it
is asked: the newcomer's stay (rounded, at least one step, capped by `cap`), what running requests
pass through (ages, keys, remaining), and the mean-over-the-stay formula including requests with
less than one predicted step left."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pytest

from shadow.core.stay import STAY_CAP, StayBasis, predicted_basis, predicted_stay, stay_basis


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


class Rec:
    """Newcomer calls (generated [0], no keys) get `stay`; running-request calls get `mu`."""

    name = "rec"

    def __init__(self, stay: float, mu: Sequence[float] = ()) -> None:
        self.stay, self.mu = stay, list(mu)
        self.newcomer_calls: list[dict[str, Any]] = []
        self.running_calls: list[dict[str, Any]] = []

    def predict(
        self,
        generated: np.ndarray,
        horizon: int,
        keys: Sequence[Hashable | None] | None = None,
        remaining: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        call = {"generated": generated, "horizon": horizon, "keys": keys, "remaining": remaining}
        if keys is None and remaining is None and generated.tolist() == [0]:
            self.newcomer_calls.append(call)
            return np.ones(1), np.array([self.stay])
        self.running_calls.append(call)
        return np.ones(len(generated)), np.asarray(self.mu[: len(generated)], dtype=np.float64)

    def observe(self, output_tokens: int, key: Hashable | None = None) -> None:
        return None


RUNNING = (np.array([0, 1]), np.array([100.0, 20.0]), np.array([3, 5]))  # worker, load, age


def _basis(kind: str, pred: Rec, running: tuple[np.ndarray, ...] = RUNNING) -> StayBasis:
    return predicted_basis(kind, pred, 2, *running, 10, keys=["k0", "k1"], remaining=np.array([4, 9]))


def test_the_life_and_final_bases_add_half_or_all_of_the_predicted_remaining_output() -> None:
    life = _basis("life", Rec(6.0, [4.0, 8.0]))
    assert life == StayBasis([102.0, 24.0], 6.0, 3.0)  # w + E[R]/2; a newcomer grows E[O]/2
    final = _basis("final", Rec(6.0, [4.0, 8.0]))
    assert final == StayBasis([104.0, 28.0], 6.0, 6.0)  # w + E[R]; a newcomer grows E[O]


def test_the_near_basis_is_the_mean_load_over_the_horizon() -> None:
    # H = 10, newcomer stay 6 -> span 6, growth (6 - 1)/2; running m = 4 and 0.5 (below one step):
    # 4/10 * (100 + 3/2) = 40.6 and 0.5/10 * (20 + 0) = 1.0.
    pred = Rec(6.0, [4.0, 0.5])
    near = _basis("near", pred)
    assert near.loads == [pytest.approx(40.6), pytest.approx(1.0)] and near.growth == 2.5
    assert near.span == 6.0
    assert [c["horizon"] for c in pred.newcomer_calls] == [10, 10]  # the stay, then E[O] over H


def test_what_the_predicted_bases_pass_to_the_predictor() -> None:
    for kind in ("life", "final", "near"):
        pred = Rec(6.0, [4.0, 8.0])
        _basis(kind, pred)
        for call in pred.newcomer_calls:
            assert call["generated"].dtype == np.int64 and call["generated"].tolist() == [0]
        (running,) = pred.running_calls
        assert running["generated"].tolist() == [3, 5] and running["keys"] == ["k0", "k1"]
        assert running["remaining"].tolist() == [4, 9]
    pred = Rec(6.0, [4.0, 8.0])  # "stay" is stay_basis, with the same arguments
    assert _basis("stay", pred) == stay_basis(Rec(6.0, [4.0, 8.0]), 2, *RUNNING, keys=["k0", "k1"])
    (running,) = pred.running_calls
    assert running["generated"].tolist() == [3, 5] and running["keys"] == ["k0", "k1"]
    assert running["remaining"].tolist() == [4, 9]


def test_the_span_is_at_least_one_step_and_one_running_request_counts() -> None:
    none = (np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64))
    assert _basis("final", Rec(0.4), none) == StayBasis([0.0, 0.0], 1.0, 0.4)
    one = (np.array([1]), np.array([7.0]), np.array([2]))
    assert _basis("life", Rec(0.4, [2.0]), one) == StayBasis([0.0, 8.0], 1.0, 0.2)
    with pytest.raises(ValueError, match=r"^unknown basis 'wide'$"):
        _basis("wide", Rec(1.0))
