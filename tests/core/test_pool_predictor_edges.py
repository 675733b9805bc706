"""Edges of the pool, the BR-0 scorer and the exact-match predictor that the property tests rarely
hit: ties, absent entries, an infinite peak, an age equal to an observed length, neighbouring
buckets, and schedule_round with a router carried over (written against documented behaviour;
kills mutants, docs/mutation.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shadow.core.balanceroute import BalanceRoute
from shadow.core.pool import Pool, PoolEntry, best_of
from shadow.core.predictors import ExactMatchPredictor, SurvivalPredictor
from shadow.core.schedule import make_round_router, schedule_round


def test_nearest_breaks_distance_ties_to_the_shorter_prompt() -> None:
    pool = Pool()
    pool.add("long", 110)
    pool.add("short", 90)
    assert [e.request_id for e in pool.nearest(100.0, 1)] == ["short"]
    assert [e.request_id for e in pool.nearest(100.0, 2)] == ["short", "long"]


def test_best_of_breaks_score_ties_to_the_older_entry_whatever_the_list_order() -> None:
    older, newer = PoolEntry("old", 50, seq=1), PoolEntry("new", 50, seq=2)
    assert best_of([older, newer], float) is older
    assert best_of([newer, older], float) is older
    assert best_of([], float) is None


def test_best_single_with_an_infinite_peak_takes_the_largest_prompt() -> None:
    pool = Pool()
    for rid, size in (("a", 10), ("b", 300), ("c", 40)):
        pool.add(rid, size)
    best = pool.best_single(lambda s: s, math.inf)  # the score only grows with size
    assert best is not None and best.request_id == "b"


def test_removing_an_absent_entry_raises_keyerror_naming_it() -> None:
    pool = Pool()
    pool.add("a", 10)
    kept = pool.add("b", 20)
    ghosts = (PoolEntry("small", 1, seq=99), PoolEntry("big", 10_000, seq=98), PoolEntry("a2", 10, seq=5))
    for ghost in ghosts:
        with pytest.raises(KeyError, match=repr(ghost.request_id)):
            pool.remove(ghost)
    pool.remove(kept)
    with pytest.raises(KeyError, match="'b'"):
        pool.remove(kept)
    assert [e.request_id for e in pool] == ["a"]


def test_br0_scores_with_the_fleet_size_penalty_not_brh() -> None:
    br = BalanceRoute("br0")
    scorer = br.scorer([100.0, 0.0, 40.0])
    assert scorer.score(1, 60.0) == 60.0  # fits under the barrier (100): the fill itself
    assert scorer.score(1, 150.0) == 150.0 - 3 * 50.0  # 50 over the barrier costs G = 3 per token
    with pytest.raises(ValueError, match="BalanceRoute variant must be 'br0' or 'brh', got 'br1'"):
        BalanceRoute("br1")  # type: ignore[arg-type]


def test_exactmatch_at_an_age_equal_to_an_observed_length_conditions_on_longer_ones() -> None:
    # Having generated 5 tokens, a request is known to be longer than 5: only the sample 10 remains.
    em, sv = ExactMatchPredictor(), SurvivalPredictor()
    for n in (5, 10):
        em.observe(n, key="k")
        sv.observe(n)
    p_fin, mu = em.predict(np.array([5]), 10, keys=["k"])
    assert (p_fin[0], mu[0]) == (1.0, pytest.approx(5.0))
    assert sv.predict(np.array([5]), 10)[1][0] == pytest.approx(5.0)


def test_exactmatch_buckets_do_not_leak_into_each_other() -> None:
    em = ExactMatchPredictor()
    em.observe(5, key="a")  # bucket 0
    em.observe(1, key="b")  # bucket 1: its short lengths sit right after bucket 0's range
    em.observe(0, key="b")
    p_fin, mu = em.predict(np.array([0, 0]), 10, keys=["a", "b"])
    assert p_fin[0] == 1.0 and mu[0] == pytest.approx(5.0), "bucket b's samples counted for key a"
    assert p_fin[1] == 1.0 and mu[1] == pytest.approx(1.0)


def test_schedule_round_carries_a_router_over_between_rounds() -> None:
    rr = make_round_router("rr")
    assert schedule_round(rr, [0.0, 0.0, 0.0], [1, 1, 1], [("a", 10)]) == [("a", 0)]
    assert schedule_round(rr, [0.0, 0.0, 0.0], [1, 1, 1], [("b", 10)]) == [("b", 1)]  # position kept
    assert schedule_round("rr", [0.0, 0.0, 0.0], [1, 1, 1], [("c", 10)]) == [("c", 0)]  # a name: fresh
