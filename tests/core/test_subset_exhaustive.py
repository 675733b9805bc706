"""Exhaustive subset search against brute force: every window size (one entry up), every cap
(including cap = window size, where the full window is a candidate), and the tie rule.

Seeded bug this kills: the mask loop stopping one short (the full window never scored, a
one-entry window returning nothing)."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.fscore import BR0Scorer, BRHScorer
from shadow.core.params import BRParams
from shadow.core.pool import PoolEntry
from shadow.core.subset import best_subset, bitset, exhaustive

Score = Callable[[float], float]


def window_of(sizes: list[int], seqs: list[int] | None = None) -> list[PoolEntry]:
    seqs = seqs if seqs is not None else list(range(len(sizes)))
    return [PoolEntry(f"r{q}", s, q) for s, q in zip(sizes, seqs, strict=True)]


def brute_force(window: list[PoolEntry], cap: int, score: Score) -> tuple[list[PoolEntry], float]:
    """The optimum by enumerating every non-empty subset of at most `cap` members; ties: the
    subset whose sorted arrival ranks compare smaller (older members, then fewer)."""
    best: tuple[float, list[int]] | None = None
    chosen: tuple[PoolEntry, ...] = ()
    for size in range(1, min(cap, len(window)) + 1):
        for combo in combinations(window, size):
            f = score(sum(e.prompt_tokens for e in combo))
            seqs = sorted(e.seq for e in combo)
            if best is None or f > best[0] or (f == best[0] and seqs < best[1]):
                best, chosen = (f, seqs), combo
    return list(chosen), (best[0] if best else -math.inf)


def describe(entries: list[PoolEntry]) -> str:
    return "{" + ", ".join(f"{e.request_id}:{e.prompt_tokens}" for e in entries) + "}"


def check_against_brute_force(window: list[PoolEntry], cap: int, score: Score, chosen: list[PoolEntry],
                              value: float, who: str) -> None:
    want, want_value = brute_force(window, cap, score)
    context = f"window {describe(window)}, cap {cap}"
    assert value == want_value, (
        f"{who} found F={value} with {describe(chosen)} but brute force finds F={want_value} with "
        f"{describe(want)} ({context})")
    assert chosen, f"{who} returned an empty subset ({context})"
    assert len(chosen) <= cap, f"{who} returned {len(chosen)} members over cap {cap} ({context})"
    assert len({e.seq for e in chosen}) == len(chosen), f"{who} repeated a member ({context})"
    assert all(any(e is w for w in window) for e in chosen), f"{who} invented a member ({context})"
    assert score(sum(e.prompt_tokens for e in chosen)) == value, f"{who}: F does not match its subset"


@pytest.mark.parametrize("n", range(1, 9))
def test_cap_equal_to_the_window_can_take_the_whole_window(n: int) -> None:
    """More is better and cap = n: the only optimum is the full window (the last mask)."""
    window = window_of(list(range(1, n + 1)))
    chosen, value = exhaustive(window, n, lambda d: d)
    assert value == n * (n + 1) // 2, (
        f"exhaustive over {n} entries with cap {n} found F={value} with {describe(chosen)}, "
        f"not the full window (F={n * (n + 1) // 2})")
    assert [e.seq for e in chosen] == list(range(n))


def test_one_entry_window_returns_that_entry() -> None:
    (only,) = window_of([42])
    for cap in (1, 2, 5):
        chosen, value = exhaustive([only], cap, lambda d: -abs(d - 10))
        assert chosen == [only], f"a one-entry window with cap {cap} returned {describe(chosen)}"
        assert value == -32


def test_the_issue_example() -> None:
    chosen, value = exhaustive(window_of([1, 2, 3]), 3, lambda d: d)
    assert (value, sorted(e.prompt_tokens for e in chosen)) == (6, [1, 2, 3]), (
        f"exhaustive([1,2,3], cap=3, F=d) gave F={value} with {describe(chosen)}, expected all three (6)")


def test_cap_below_one_means_nothing_fits() -> None:
    chosen, value = exhaustive(window_of([3, 4]), 0, lambda d: d)
    assert chosen == [] and value == -math.inf


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 400), min_size=1, max_size=7),
    cap_offset=st.integers(-7, 2),
    peak=st.integers(0, 1500),
    shape=st.sampled_from(["peak", "more", "less", "square"]),
    seqs=st.permutations(range(7)),
)
def test_exhaustive_matches_brute_force_on_random_windows_and_caps(
    sizes: list[int], cap_offset: int, peak: int, shape: str, seqs: list[int]
) -> None:
    """Value, membership, cap and the tie rule (older, then fewer) all as brute force decides.
    `cap_offset` ≥ 0 gives cap ≥ window size (the full window is allowed)."""
    n = len(sizes)
    cap = max(1, n + cap_offset)
    window = window_of(sizes, list(seqs[:n]))
    scores: dict[str, Score] = {
        "peak": lambda d: -abs(d - peak),
        "more": lambda d: d,
        "less": lambda d: -d,
        "square": lambda d: -((d - peak) ** 2) // 1000,  # flat regions: many ties
    }
    score = scores[shape]
    chosen, value = exhaustive(window, cap, score)
    check_against_brute_force(window, cap, score, chosen, value, "exhaustive")
    want, _ = brute_force(window, cap, score)
    assert sorted(e.seq for e in chosen) == sorted(e.seq for e in want), (
        f"tie rule: exhaustive chose {describe(chosen)}, brute force (older, then fewer) chose "
        f"{describe(want)} (window {describe(window)}, cap {cap})")


@settings(max_examples=120, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=7),
    loads=st.lists(st.integers(0, 60_000), min_size=2, max_size=6),
    cap_offset=st.integers(-7, 1),
    exhaustive_max=st.integers(0, 8),
    data=st.data(),
)
def test_best_subset_matches_brute_force_with_the_real_br0_score(
    sizes: list[int], loads: list[int], cap_offset: int, exhaustive_max: int, data: st.DataObject
) -> None:
    """Both branches of `best_subset` (exhaustive up to `exhaustive_max`, bitset above) are exact."""
    g = data.draw(st.integers(0, len(loads) - 1))
    scorer = BR0Scorer(loads)
    window = window_of(sizes)
    cap = max(1, len(sizes) + cap_offset)

    def score(d: float) -> float:
        return scorer.score(g, d)

    chosen, value = best_subset(window, cap, score, scorer.peak(g), exhaustive_max)
    branch = "exhaustive" if len(window) <= exhaustive_max else "bitset"
    check_against_brute_force(window, cap, score, chosen, value, f"best_subset ({branch})")


@pytest.mark.parametrize("seed", range(20))
def test_exhaustive_and_bitset_agree_with_brute_force_under_brh(seed: int) -> None:
    """The BR-H score (horizon-weighted) on random windows, caps 1..n, both searches."""
    rng = np.random.default_rng(seed)
    scorer = BRHScorer(rng.integers(0, 40_000, size=(3, 9)).astype(float), BRParams(horizon=8, beta=5))
    g = int(rng.integers(0, 3))
    n = int(rng.integers(1, 7))
    window = window_of([int(x) for x in rng.integers(1, 9_000, size=n)])

    def score(d: float) -> float:
        return scorer.score(g, d)

    for cap in range(1, n + 1):
        chosen, value = exhaustive(window, cap, score)
        check_against_brute_force(window, cap, score, chosen, value, "exhaustive")
        chosen, value = bitset(window, cap, score, scorer.peak(g))
        _, want = brute_force(window, cap, score)
        assert abs(value - want) <= 1e-9 * max(1.0, abs(want)), (
            f"bitset found F={value}, brute force {want} (window {describe(window)}, cap {cap})")
