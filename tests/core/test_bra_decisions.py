"""BRA's faster Stage 2 makes exactly the decisions of the implementation it replaced.

`_reference_round` below is the centred Stage 2 of commit 0caf67e, copied verbatim (per-worker
`margin` calls in the pop order, `best_subset`'s bitset for every window wider than the exhaustive
limit). The current code pops with one `margins()` call and lists sums for caps <= 2 (`pairs`);
both are checked against it on random states, small (hypothesis) and bench-sized (G = 64, 1,024
waiting), with and without BR-H projections and aged entries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.assigner import Assignment
from shadow.core.balanceroute import BalanceRoute
from shadow.core.bra import BalanceRouteAdaptive, BRAParams
from shadow.core.fscore import BR0Scorer, Scorer
from shadow.core.params import BRParams
from shadow.core.pool import Pool, PoolEntry, best_of
from shadow.core.subset import best_subset, bitset, pairs

STAGE2_ONLY = BRAParams(score_pick=False, hold=False, scale_window=True)


# -- the reference: commit 0caf67e's centred round, verbatim -------------------------------------------


def _ref_centred_round(
    scorer: Scorer, pool: Pool, free: list[int], params: BRParams, now: float
) -> list[Assignment]:
    out: list[Assignment] = []
    threshold = params.greedy_threshold(scorer.workers)

    def admit(g: int, entries: Sequence[PoolEntry]) -> None:
        for entry in entries:
            pool.remove(entry)
            out.append((entry.request_id, g))
        free[g] -= len(entries)
        scorer.admit(g, entries)

    total_free = sum(free)
    while pool and total_free > threshold:
        g = _ref_most_free(scorer, free)
        entry = pool.best_single(partial(scorer.score, g), scorer.peak(g))
        assert entry is not None
        admit(g, (entry,))
        total_free -= 1
    while pool:
        g = _ref_most_free(scorer, free)
        if g < 0:
            break
        peak = scorer.peak(g)
        window = _ref_centred_window(pool, params.r_max, peak, now, params.age_s)
        cap = min(free[g], params.r_max)
        score = partial(scorer.score, g)
        chosen, value = best_subset(window, cap, score, peak, params.exhaustive_max)
        if not chosen or value <= 0:
            single = best_of(window, score)
            assert single is not None
            chosen = [single]
        admit(g, chosen)
    return out


def _ref_most_free(scorer: Scorer, free: Sequence[int]) -> int:
    best, best_key = -1, (0, -math.inf, 0)
    for g, c in enumerate(free):
        if c <= 0:
            continue
        key = (c, scorer.margin(g), -g)
        if best < 0 or key > best_key:
            best, best_key = g, key
    return best


def _ref_centred_window(
    pool: Pool, size: int, peak: float, now: float, age_s: float | None
) -> list[PoolEntry]:
    aged = [e for e in pool.window(size, now, age_s) if age_s is not None and now - e.arrived_at >= age_s]
    aged = aged[: max(1, size // 2)] if aged else []
    taken = {e.seq for e in aged}
    near = [e for e in pool.nearest(peak, size + len(aged)) if e.seq not in taken]
    return (aged + near)[:size]


def _reference_round(
    params: BRParams,
    loads: list[float],
    free: list[int],
    pool: Pool,
    now: float,
    active: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
) -> list[Assignment]:
    if not pool or not any(c > 0 for c in free):
        return []
    scaled = replace(params, r_max=STAGE2_ONLY.window(len(loads), params.r_max))
    variant = "br0" if active is None else "brh"
    scorer = BalanceRoute(variant, scaled).scorer(loads, active)
    return _ref_centred_round(scorer, pool, list(free), scaled, now)


# -- helpers ---------------------------------------------------------------------------------------


def _pool(sizes: Sequence[int], arrived: Sequence[float]) -> Pool:
    pool = Pool()
    for i, (s, t) in enumerate(zip(sizes, arrived, strict=True)):
        pool.add(f"q{i}", int(s), float(t))
    return pool


def _both(
    params: BRParams,
    loads: list[float],
    free: list[int],
    sizes: Sequence[int],
    arrived: Sequence[float],
    now: float,
    active: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
) -> tuple[list[Assignment], list[Assignment]]:
    want = _reference_round(params, loads, free, _pool(sizes, arrived), now, active)
    got = BalanceRouteAdaptive(params, STAGE2_ONLY).round(
        loads, free, _pool(sizes, arrived), now, active
    )
    return got, want


# -- pairs == bitset --------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 400), min_size=0, max_size=16),
    cap=st.integers(0, 2),
    peak=st.one_of(st.floats(-5, 900, allow_nan=False), st.just(math.inf), st.integers(0, 900).map(float)),
    top=st.integers(0, 900),
    g=st.integers(1, 64),
)
def test_pairs_returns_exactly_what_bitset_returns(
    sizes: list[int], cap: int, peak: float, top: int, g: int
) -> None:
    # Small ranges make equal sizes, equal sums and sums exactly at the peak common.
    window = [PoolEntry(f"e{i}", s, i) for i, s in enumerate(sizes)]
    scorer = BR0Scorer([0.0, float(top)] + [float(top)] * (g - 1))
    score = partial(scorer.score, 0)
    want_set, want_f = bitset(window, cap, score, peak)
    got_set, got_f = pairs(window, cap, score, peak)
    assert [e.request_id for e in got_set] == [e.request_id for e in want_set]
    assert got_f == want_f or (math.isinf(got_f) and math.isinf(want_f))


def test_pairs_refuses_larger_caps() -> None:
    with pytest.raises(ValueError, match="caps up to 2"):
        pairs([PoolEntry("a", 1, 0)], 3, float, 1.0)


# -- whole rounds ---------------------------------------------------------------------------------------


@st.composite
def small_states(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    g = draw(st.integers(1, 40))
    loads = [100.0 * x for x in draw(st.lists(st.integers(0, 300), min_size=g, max_size=g))]
    free = draw(st.lists(st.integers(0, 4), min_size=g, max_size=g))
    n = draw(st.integers(0, 60))
    sizes = draw(st.lists(st.integers(1, 120).map(lambda x: 50 * x), min_size=n, max_size=n))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    arrived = list(np.cumsum(gaps)) if n else []
    active = None
    if draw(st.booleans()):
        steps = draw(st.lists(st.floats(0, 30), min_size=g, max_size=g))
        active = (np.arange(g, dtype=np.int64), np.asarray(loads, dtype=np.float64), np.asarray(steps))
    return loads, free, sizes, arrived, active


@settings(max_examples=300, deadline=None)
@given(state=small_states(), r_max=st.integers(1, 8), s_greedy=st.integers(0, 40), horizon=st.integers(1, 30))
def test_rounds_equal_the_reference_on_small_states(state, r_max: int, s_greedy: int, horizon: int) -> None:  # type: ignore[no-untyped-def]
    loads, free, sizes, arrived, active = state
    now = float(arrived[-1]) if arrived else 0.0  # ages 0 .. a few seconds: some aged with age_s 1
    params = BRParams(r_max=r_max, s_greedy=s_greedy, horizon=horizon, age_s=1.0)
    got, want = _both(params, loads, free, sizes, arrived, now, active)
    assert got == want


@pytest.mark.parametrize("workers,waiting", [(8, 256), (64, 1024), (32, 100)])
def test_rounds_equal_the_reference_on_bench_sized_states(workers: int, waiting: int) -> None:
    """States as bench/bench_decision.py draws them (B = 64, 0-3 free slots, lognormal prompts,
    BR-H projections), some with aged entries; every round's decisions must match."""
    rng = np.random.default_rng(workers * 7919 + waiting)
    checked = 0
    for trial in range(12):
        prompts = rng.lognormal(np.log(4652) - 0.32, 0.8, size=(workers, 64)).clip(16, 32768)
        per_req = prompts + rng.integers(0, 1000, size=(workers, 64))
        loads = per_req.sum(axis=1).tolist()
        free = rng.integers(0, 4, size=workers).tolist()
        sizes = rng.lognormal(np.log(4652) - 0.32, 0.8, size=waiting).clip(16, 32768).astype(int).tolist()
        arrived = np.sort(rng.uniform(0, 4.0, size=waiting)).tolist()
        active = None
        if trial % 3:
            active = (
                np.repeat(np.arange(workers, dtype=np.int64), 64),
                per_req.ravel().astype(np.float64),
                rng.uniform(0, 80, size=workers * 64),
            )
        got, want = _both(BRParams(), loads, free, sizes, arrived, 4.0, active)
        assert got == want, f"trial {trial}: decisions differ"
        checked += len(want)
    assert checked > 0
