"""`pairs` (caps <= 2 by listing sums) at the edges a few random examples rarely reach: ties
between the candidates below and above the peak, zero-size entries with a peak in [0, 1) or
below zero, an infinite peak that takes the whole window, and caps of zero. Each case is also
checked against `bitset`, whose result `pairs` must return exactly."""

from __future__ import annotations

import math

import pytest

from shadow.core.pool import PoolEntry
from shadow.core.subset import Score, bitset, pairs


def _window(*sizes: int) -> list[PoolEntry]:
    return [PoolEntry(f"e{i}", s, i) for i, s in enumerate(sizes)]


def _both(window: list[PoolEntry], cap: int, score: Score, peak: float) -> tuple[list[str], float]:
    got, f = pairs(window, cap, score, peak)
    want, want_f = bitset(window, cap, score, peak)
    ids = [str(e.request_id) for e in got]
    assert ids == [str(e.request_id) for e in want] and f == want_f, (ids, f, want, want_f)
    return ids, f


def test_a_tie_between_below_and_above_the_peak_goes_to_the_smaller_sum() -> None:
    # Sums 4 and 6 around a peak of 5 score the same: the smaller sum (4) is taken.
    def score(d: float) -> float:
        return -abs(d - 5.0)

    assert _both(_window(6, 4), 1, score, 5.0) == (["e1"], -1.0)
    assert _both(_window(3, 6, 1), 2, score, 5.0) == (["e0", "e2"], -1.0)  # 3 + 1 = 4 vs 6


def test_a_zero_size_entry_is_the_candidate_below_a_peak_under_one_token() -> None:
    # peak 0.5: the largest reachable sum <= 0 is the zero-size entry (score -0.5), better than 3.
    def score(d: float) -> float:
        return -abs(d - 0.5)

    assert _both(_window(3, 0), 1, score, 0.5) == (["e1"], -0.5)


def test_a_zero_size_entry_is_the_candidate_above_a_peak_below_zero() -> None:
    # peak -2: nothing is below it; the smallest reachable sum >= 0 is the zero-size entry.
    def score(d: float) -> float:
        return -d

    assert _both(_window(3, 0), 1, score, -2.0) == (["e1"], 0.0)


def test_an_infinite_peak_can_take_the_whole_window() -> None:
    def score(d: float) -> float:
        return d

    assert _both(_window(5), 1, score, math.inf) == (["e0"], 5.0)
    assert _both(_window(3, 4), 2, score, math.inf) == (["e0", "e1"], 7.0)


@pytest.mark.parametrize("cap", [0, -1])
def test_no_room_selects_nothing_at_minus_infinity(cap: int) -> None:
    assert pairs(_window(1, 2), cap, float, 1.0) == ([], -math.inf)
    assert pairs([], 2, float, 1.0) == ([], -math.inf)
