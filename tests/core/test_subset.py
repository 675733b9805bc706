"""Subset search: the bitset subset-sum finds the brute-force optimum; tie and cap rules hold."""

from __future__ import annotations

from itertools import combinations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.fscore import BR0Scorer, BRHScorer
from shadow.core.params import BRParams
from shadow.core.pool import PoolEntry
from shadow.core.subset import bitset, exhaustive


def brute_force_best(window: list[PoolEntry], cap: int, score) -> float:  # type: ignore[no-untyped-def]
    best = float("-inf")
    for size in range(1, min(cap, len(window)) + 1):
        for combo in combinations(window, size):
            best = max(best, score(sum(e.prompt_tokens for e in combo)))
    return best


def entries(sizes: list[int]) -> list[PoolEntry]:
    return [PoolEntry(f"r{i}", s, i) for i, s in enumerate(sizes)]


@settings(max_examples=120, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=12),
    loads=st.lists(st.integers(0, 60_000), min_size=2, max_size=8),
    cap=st.integers(1, 12),
    data=st.data(),
)
def test_bitset_matches_brute_force_br0(
    sizes: list[int], loads: list[int], cap: int, data: st.DataObject
) -> None:
    g = data.draw(st.integers(0, len(loads) - 1))
    scorer = BR0Scorer(loads)
    window = entries(sizes)

    def score(d: float) -> float:
        return scorer.score(g, d)

    chosen, value = bitset(window, cap, score, scorer.peak(g))
    assert value == brute_force_best(window, cap, score)
    assert 1 <= len(chosen) <= min(cap, len(window))
    assert len({e.seq for e in chosen}) == len(chosen)
    assert score(sum(e.prompt_tokens for e in chosen)) == value


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9_000), min_size=1, max_size=12),
    cap=st.integers(1, 12),
    seed=st.integers(0, 2**31),
)
def test_bitset_matches_brute_force_brh(sizes: list[int], cap: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    params = BRParams(horizon=16, beta=20, gamma=0.9)
    scorer = BRHScorer(rng.integers(0, 40_000, size=(4, 17)).astype(float), params)
    g = int(rng.integers(0, 4))
    window = entries(sizes)

    def score(d: float) -> float:
        return scorer.score(g, d)

    chosen, value = bitset(window, cap, score, scorer.peak(g))
    assert abs(value - brute_force_best(window, cap, score)) <= 1e-6 * max(1.0, abs(value))
    assert 1 <= len(chosen) <= min(cap, len(window))


def test_exhaustive_prefers_older_then_fewer_on_ties() -> None:
    # Both {a} and {b} give the same sum; a is older.
    window = [PoolEntry("b", 10, 5), PoolEntry("a", 10, 2), PoolEntry("c", 0, 1)]
    chosen, value = exhaustive(window, 1, lambda d: -abs(d - 10))
    assert [e.request_id for e in chosen] == ["a"] and value == 0
    # {c, a} (sum 10, contains the oldest) beats {a} alone: same F, older member wins.
    chosen, _ = exhaustive(window, 2, lambda d: -abs(d - 10))
    assert sorted(e.request_id for e in chosen) == ["a", "c"]


def test_cap_is_respected_even_when_more_would_score_better() -> None:
    window = entries([100, 100, 100, 100])
    chosen, value = exhaustive(window, 2, lambda d: d)  # more is better, cap says 2
    assert len(chosen) == 2 and value == 200
    chosen, value = bitset(window, 2, lambda d: d, float("inf"))
    assert len(chosen) == 2 and value == 200


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5_000), min_size=1, max_size=40),
    loads=st.lists(st.integers(0, 20_000), min_size=2, max_size=6),
    data=st.data(),
)
def test_pool_best_single_equals_a_scan_of_the_whole_pool(
    sizes: list[int], loads: list[int], data: st.DataObject
) -> None:
    from shadow.core.pool import Pool

    g = data.draw(st.integers(0, len(loads) - 1))
    scorer = BR0Scorer(loads)
    pool = Pool()
    entries = [pool.add(f"r{i}", s) for i, s in enumerate(sizes)]
    best = pool.best_single(lambda d: scorer.score(g, d), scorer.peak(g))
    expected = max(entries, key=lambda e: (scorer.score(g, e.prompt_tokens), -e.seq))
    assert best is expected
