"""A round's edges seen from outside: the stages a caller is told about (for timing) and how many
requests each stage admits, the round's clock reaching the pool's aging, and the registry's
documented defaults."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shadow.core.assigner import assign_round
from shadow.core.balanceroute import BalanceRoute
from shadow.core.baselines import JoinShortestQueue
from shadow.core.fscore import BR0Scorer
from shadow.core.params import BRParams
from shadow.core.policies import RouterOptions, make_router
from shadow.core.pool import Pool
from shadow.core.routers import BindingRouter
from shadow.core.schedule import make_round_router
from shadow.core.snapshot import FleetSnapshot


def test_the_stages_are_announced_in_order_with_stage1_filling_down_to_s_greedy() -> None:
    # 6 free slots, S_greedy = 2: Stage 1 admits one request per free slot until 2 are left,
    # Stage 2 fills those 2; the pool holds 10, so 4 remain at the end.
    pool = Pool()
    for i in range(10):
        pool.add(f"r{i}", 100 + i)
    seen: list[tuple[str, int]] = []
    out = assign_round(
        BR0Scorer([0, 0, 0]),
        pool,
        [2, 2, 2],
        BRParams(s_greedy=2),
        on_stage=lambda s: seen.append((s, len(pool))),
    )
    assert seen == [("stage1", 10), ("stage2", 6), ("end", 4)]
    assert len(out) == 6


def test_a_pool_router_ages_requests_on_the_clock_it_is_given() -> None:
    # Stage 2 only (S_greedy above the free slots), one free slot, a window of one: at t=100 the
    # small request that has waited 100 s (> age_s) heads the window; at t=0.5 nothing has aged
    # and the largest prompt goes first.
    def decide(now: float) -> list[tuple[object, int]]:
        router = make_router("br0", RouterOptions(br=BRParams(s_greedy=100, r_max=1, age_s=1.0)))
        router.on_arrive("old-small", 10, 0.0)
        router.on_arrive("new-big", 5000, 0.0)
        return list(router.decide(FleetSnapshot(loads=[0.0], free_slots=[1]), now))

    assert decide(100.0) == [("old-small", 0)]
    assert decide(0.5) == [("new-big", 0)]


def test_the_default_seed_is_zero() -> None:
    view = FleetSnapshot(loads=[0.0] * 8, free_slots=[4] * 8)

    def picks(**kw: int) -> list[int]:
        router = make_router("random", RouterOptions(**kw))
        for i in range(20):
            router.on_arrive(i, 10, 0.0)
        return [g for _, g in router.decide(view, 0.0)]

    assert picks() == picks(seed=0) != picks(seed=1)


def test_balanceroute_tells_its_stage_listener() -> None:
    br = BalanceRoute("br0", BRParams(s_greedy=0))
    seen: list[str] = []
    br.on_stage = seen.append
    pool = Pool()
    pool.add("a", 10)
    assert br.round([0.0, 0.0], [1, 1], pool) == [("a", 0)]
    assert seen == ["stage1", "stage2", "end"]


def test_a_binding_router_binds_every_waiting_request_unless_told_only_free() -> None:
    # No free slot anywhere: by default every waiting request is still bound (an engine queues it);
    # with only_free nothing is placed.
    view = FleetSnapshot(loads=[0.0, 5.0], free_slots=[0, 0])
    router = BindingRouter(JoinShortestQueue(random.Random(0)))
    router.on_arrive("a", 10, 0.0)
    assert router.decide(view, 0.0) == [("a", 0)]
    strict = BindingRouter(JoinShortestQueue(random.Random(0)), only_free=True)
    strict.on_arrive("a", 10, 0.0)
    assert strict.decide(view, 0.0) == [] and strict.waiting() == 1


def test_a_snapshot_without_a_projection_projects_nothing() -> None:
    arr_i, arr_f = np.array([0], dtype=np.int64), np.array([1.0])
    idx, w, c = FleetSnapshot(loads=[1.0], free_slots=[1]).active()
    assert idx.size == w.size == c.size == 0
    idx, w, c = FleetSnapshot(loads=[1.0], free_slots=[1], projection=lambda: (arr_i, arr_f, arr_f)).active()
    assert (idx.tolist(), w.tolist(), c.tolist()) == ([0], [1.0], [1.0])


def test_make_round_router_seeds_zero_by_default() -> None:
    # make_round_router's seed defaults to 0 (random draws the same as with seed=0, not seed=1).
    view = FleetSnapshot(loads=[0.0] * 8, free_slots=[4] * 8)

    def picks(**kw: int) -> list[int]:
        router = make_round_router("random", **kw)
        for i in range(20):
            router.on_arrive(i, 10, 0.0)
        return [g for _, g in router.decide(view, 0.0)]

    assert picks() == picks(seed=0) != picks(seed=1)


def test_a_forced_router_without_assignments_is_refused_with_its_message() -> None:
    with pytest.raises(ValueError, match=r"^a forced lane needs its assignments$"):
        make_router("forced")
