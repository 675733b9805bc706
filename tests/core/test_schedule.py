"""schedule_round and the two-stage assigner: invariants, BR-H ≡ BR-0 reduction, validation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core import POLICIES, BRParams, br0_equivalent, schedule_round
from shadow.core.assigner import assign_round
from shadow.core.fscore import BR0Scorer
from shadow.core.pool import Pool


@st.composite
def rounds(draw: st.DrawFn, min_workers: int = 1) -> tuple[list[int], list[int], list[tuple[str, int]]]:
    workers = draw(st.integers(min_workers, 12))
    loads = draw(st.lists(st.integers(0, 400_000), min_size=workers, max_size=workers))
    free = draw(st.lists(st.integers(0, 6), min_size=workers, max_size=workers))
    sizes = draw(st.lists(st.integers(1, 30_000), max_size=40))
    return loads, free, [(f"q{i}", s) for i, s in enumerate(sizes)]


@settings(max_examples=150, deadline=None)
@given(state=rounds(), policy=st.sampled_from(POLICIES), s_greedy=st.integers(0, 30), r_max=st.integers(1, 8))
def test_invariants_for_every_policy(
    state: tuple[list[int], list[int], list[tuple[str, int]]], policy: str, s_greedy: int, r_max: int
) -> None:
    loads, free, waiting = state
    out = schedule_round(policy, loads, free, waiting, params={"s_greedy": s_greedy, "r_max": r_max})
    ids = [rid for rid, _ in out]
    assert len(ids) == len(set(ids)), "a request was admitted twice"
    assert set(ids) <= {rid for rid, _ in waiting}
    per_worker = Counter(g for _, g in out)
    for g, n in per_worker.items():
        assert 0 <= g < len(loads)
        assert n <= free[g], f"worker {g} got {n} requests for {free[g]} free slots"
    # Work conserving: every policy fills min(waiting, free slots) — except that BRA may hold a
    # request back when every placement raises the barrier (tests/core/test_bra.py).
    if policy == "bra":
        assert len(out) <= min(len(waiting), sum(free))
    else:
        assert len(out) == min(len(waiting), sum(free))


@settings(max_examples=200, deadline=None)
@given(state=rounds(min_workers=2), s_greedy=st.integers(0, 30), r_max=st.integers(1, 8))
def test_brh_h0_alpha1_beta_g_makes_the_same_decisions_as_br0(
    state: tuple[list[int], list[int], list[tuple[str, int]]], s_greedy: int, r_max: int
) -> None:
    loads, free, waiting = state
    common = {"s_greedy": s_greedy, "r_max": r_max, "exhaustive_max": 4}
    br0 = schedule_round("br0", loads, free, waiting, params=common)
    eq = br0_equivalent(len(loads))
    brh = schedule_round(
        "brh", loads, free, waiting, params={**common, "horizon": 0, "alpha": eq.alpha, "beta": eq.beta}
    )
    assert brh == br0


def test_stage2_guard_admits_one_when_no_subset_scores_positive() -> None:
    # Worker 0 is the envelope (margin 0): every admission has F < 0 there; it is the only free worker.
    loads, free = [1000, 0], [2, 0]
    out = schedule_round("br0", loads, free, [("a", 50), ("b", 10)], params={"s_greedy": 100})
    assert len(out) == 2 and {g for _, g in out} == {0}
    # First pop: nothing scores > 0, the guard admits the single best (smallest overflow) request.
    assert out[0] == ("b", 0)


@settings(max_examples=100, deadline=None)
@given(state=rounds(), r_max=st.integers(1, 6))
def test_every_stage2_pop_admits_at_least_one(
    state: tuple[list[int], list[int], list[tuple[str, int]]], r_max: int
) -> None:
    loads, free, waiting = state
    params = BRParams(s_greedy=10_000, r_max=r_max)  # Stage 2 only
    pool = Pool()
    for rid, s in waiting:
        pool.add(rid, s)
    pops: list[int] = []

    class Spy(BR0Scorer):
        def admit(self, g, entries):  # type: ignore[no-untyped-def]
            pops.append(len(entries))
            super().admit(g, entries)

    out = assign_round(Spy(loads), pool, free, params)
    assert all(n >= 1 for n in pops)
    assert sum(pops) == len(out) == min(len(waiting), sum(free))


def test_stage1_picks_worker_with_most_free_slots_then_larger_margin() -> None:
    # All free counts equal: the lightest worker (largest margin) goes first and takes the request
    # that fills its margin best.
    out = schedule_round(
        "br0", [500, 100, 300], [3, 3, 3], [("big", 400), ("small", 50)], params={"s_greedy": 0}
    )
    assert out[0] == ("big", 1)
    # More free slots beat a larger margin.
    out = schedule_round("br0", [500, 100, 300], [1, 1, 2], [("x", 10)], params={"s_greedy": 0})
    assert out == [("x", 2)]


def test_pool_order_is_longest_first_with_aging() -> None:
    pool = Pool()
    pool.add("old-small", 10, arrived_at=0.0)
    pool.add("mid", 500, arrived_at=5.0)
    pool.add("big", 900, arrived_at=6.0)
    assert [e.request_id for e in pool.window(3, now=6.0, age_s=None)] == ["big", "mid", "old-small"]
    assert [e.request_id for e in pool.window(2, now=6.0, age_s=2.0)] == ["old-small", "big"]


def test_brh_uses_predictions_to_choose_what_a_worker_takes() -> None:
    # Equal loads now, so BR-0 sees margin 0 on the only free worker and takes the smallest request.
    # BR-H sees that worker 0's requests leave within 2 steps, opening a margin it can fill.
    loads, free = [10_000, 10_000], [1, 0]
    waiting = [("big", 8_000), ("small", 500)]
    leaving = [(0, 5_000, 1), (0, 5_000, 2), (1, 5_000, 80), (1, 5_000, 80)]
    staying = [(1, 5_000, 1), (1, 5_000, 2), (0, 5_000, 80), (0, 5_000, 80)]
    params = {"s_greedy": 0, "beta": 5.0}
    assert schedule_round("br0", loads, free, waiting, params=params) == [("small", 0)]
    assert schedule_round("brh", loads, free, waiting, active=leaving, params=params) == [("big", 0)]
    assert schedule_round("brh", loads, free, waiting, active=staying, params=params) == [("small", 0)]


def test_jsq_bytes_ties_go_to_first_registered_and_loads_accumulate() -> None:
    out = schedule_round("jsq-bytes", [0, 0, 0], [5, 5, 5], [("a", 10), ("b", 10), ("c", 10), ("d", 1)])
    assert out == [("a", 0), ("b", 1), ("c", 2), ("d", 0)]


def test_rr_cycles_and_random_is_seeded() -> None:
    out = schedule_round("rr", [0, 0, 0], [2, 0, 2], [(i, 1) for i in range(4)])
    assert [g for _, g in out] == [0, 2, 0, 2]
    a = schedule_round("random", [0] * 8, [9] * 8, [(i, 1) for i in range(30)], seed=7)
    b = schedule_round("random", [0] * 8, [9] * 8, [(i, 1) for i in range(30)], seed=7)
    c = schedule_round("random", [0] * 8, [9] * 8, [(i, 1) for i in range(30)], seed=8)
    assert a == b and a != c


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "bogus"}, "unknown policy"),
        ({"free_slots": [1, -1]}, "free_slots"),
        ({"params": {"beta": 0.5}}, "beta must be greater than alpha"),
        ({"params": {"beta": 1.0, "alpha": 1.0}}, "beta must be greater than alpha"),
        ({"params": {"gamma": 0}}, "gamma"),
        ({"params": {"horizon": -1}}, "horizon"),
        ({"params": {"r_max": 17}}, "r_max"),
        ({"params": {"nope": 1}}, "unknown BalanceRoute parameter"),
        ({"loads": [1.0]}, "workers"),
        ({"loads": [float("nan"), 1.0]}, "loads"),
        ({"waiting": [("a", 1), ("a", 2)]}, "duplicate"),
        ({"waiting": [("a", -3)]}, "prompt_tokens"),
        ({"active": [(5, 1.0, 1.0)], "policy": "brh"}, "worker_index"),
        ({"active": [(0, 3.0, 1.0)], "policy": "brh"}, "sum"),
    ],
)
def test_invalid_input_raises_clear_value_error(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    call = {"policy": "br0", "loads": [0.0, 0.0], "free_slots": [1, 1], "waiting": [("a", 1)]} | kwargs
    with pytest.raises(ValueError, match=message):
        schedule_round(
            call["policy"],
            call["loads"],
            call["free_slots"],
            call["waiting"],
            params=call.get("params"),
            active=call.get("active"),
        )


def test_brparams_rejects_negative_s_greedy() -> None:
    with pytest.raises(ValueError, match="s_greedy"):
        BRParams(s_greedy=-1)


def test_large_round_stays_valid_with_bitset_windows() -> None:
    rng = np.random.default_rng(3)
    loads = rng.integers(100_000, 300_000, size=16).tolist()
    free = rng.integers(0, 4, size=16).tolist()
    waiting = [(i, int(s)) for i, s in enumerate(rng.integers(100, 9000, size=200))]
    out = schedule_round(
        "brh", loads, free, waiting, params={"r_max": 16, "exhaustive_max": 4, "s_greedy": 0}
    )
    assert len(out) == sum(free)
    assert all(n <= free[g] for g, n in Counter(g for _, g in out).items())
