"""The barrier choice: workers whose step ends coincide share a barrier, independent servers do
not (whatever their speeds), and too few steps decide nothing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.barrier import TOLERANCE, choose_barrier


def _steps(rng: random.Random, mean: float, n: int, start: float = 0.0, cv: float = 0.15) -> list[float]:
    return [max(1e-4, rng.gauss(mean, cv * mean)) for _ in range(n)]


def _ends(durations: list[float], start: float = 0.0) -> list[float]:
    out, t = [], start
    for d in durations:
        t += d
        out.append(t)
    return out


def test_ranks_behind_one_barrier_end_their_steps_together() -> None:
    rng = random.Random(1)
    barrier = _steps(rng, 0.012, 300)  # the slowest rank sets each step
    ends = [[t + rng.uniform(-2e-4, 2e-4) for t in _ends(barrier)] for _ in range(3)]
    choice = choose_barrier(ends, [barrier] * 3)
    assert choice.groups == ((0, 1, 2),) and choice.model == "fleet-wide barrier", choice
    assert min(choice.coincidence.values()) > 0.95


def test_a_merged_chunk_hiding_steps_on_one_side_does_not_split_a_barrier() -> None:
    rng = random.Random(2)
    barrier = _ends(_steps(rng, 0.02, 300))
    sparse = [t for t in barrier if rng.random() > 0.4]  # 40 % of rank 1's steps unseen
    choice = choose_barrier([barrier, sparse], [[0.02] * 300, [0.02] * 300])
    assert choice.groups == ((0, 1),), choice


@pytest.mark.parametrize(("fast", "slow"), [(0.0039, 0.0189), (0.010, 0.010), (0.010, 0.011)])
def test_independent_servers_are_chosen_per_worker_whatever_their_speeds(fast: float, slow: float) -> None:
    """6.4x apart (the issue's two real servers), and the same speed with drifting phases."""
    rng = random.Random(3)
    span = 3.0
    a = _steps(rng, fast, int(span / fast))
    b = _steps(rng, slow, int(span / slow))
    choice = choose_barrier([_ends(a), _ends(b, 0.0031)], [a, b])
    assert choice.groups == ((0,), (1,)) and choice.model == "per worker", choice
    assert choice.coincidence[(0, 1)] < 0.65


def test_two_dp_ranks_and_an_independent_server_make_two_groups() -> None:
    rng = random.Random(4)
    dp = _steps(rng, 0.015, 200)
    solo = _steps(rng, 0.006, 500)
    ends = [_ends(dp), _ends(solo), [t + 1e-4 for t in _ends(dp)]]
    choice = choose_barrier(ends, [dp, solo, dp])
    assert choice.groups == ((0, 2), (1,)) and choice.model == "barrier groups", choice


def test_too_few_steps_decide_nothing() -> None:
    choice = choose_barrier([[0.01 * i for i in range(100)], [0.1, 0.2]], [[0.01], [0.1]])
    assert not choice.decided and choice.groups is None and choice.unmeasured == (1,)
    assert "fewer than 30 measured steps" in choice.reason and choice.model == "undecided"
    assert choose_barrier([[1.0]], [[0.01]]).groups == ((0,),)


def _near_reference(ends: list[float], others: list[float], tol: float) -> float:
    """The module docstring's one-way fraction, one end at a time."""
    lo, hi = others[0] - tol, others[-1] + tol
    inside = [t for t in ends if lo <= t <= hi]
    hits = [t for t in inside if any(t - tol <= o <= t + tol for o in others)]
    return len(hits) / len(inside) if inside else 0.0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=40),
        min_size=2, max_size=6,
    ),
    st.lists(st.floats(1e-3, 1.0), min_size=6, max_size=6),
)
def test_the_coincidence_of_every_pair_is_the_one_way_fractions_larger(
    ends: list[list[float]], medians: list[float]
) -> None:
    srt = [sorted(e) for e in ends]
    choice = choose_barrier(srt, [[m] for m in medians[: len(srt)]], min_steps=1)
    for (i, j), c in choice.coincidence.items():
        tol = TOLERANCE * min(medians[i], medians[j])
        assert c == max(_near_reference(srt[i], srt[j], tol), _near_reference(srt[j], srt[i], tol)), (i, j)
