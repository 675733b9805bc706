"""A round's edges seen from outside: the stages a caller is told about (for timing) and how many
requests each stage admits, the round's clock reaching the pool's aging, and the registry's
documented defaults."""

from __future__ import annotations

from shadow.core.assigner import assign_round
from shadow.core.fscore import BR0Scorer
from shadow.core.params import BRParams
from shadow.core.pool import Pool
from shadow.core.routers import StaticView, make_router


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
        router = make_router("br0", params=BRParams(s_greedy=100, r_max=1, age_s=1.0))
        router.on_arrive("old-small", 10, 0.0)
        router.on_arrive("new-big", 5000, 0.0)
        return list(router.decide(StaticView(loads=[0.0], free_slots=[1]), now))

    assert decide(100.0) == [("old-small", 0)]
    assert decide(0.5) == [("new-big", 0)]


def test_the_default_seed_is_zero() -> None:
    view = StaticView(loads=[0.0] * 8, free_slots=[4] * 8)

    def picks(**kw: int) -> list[int]:
        router = make_router("random", **kw)
        for i in range(20):
            router.on_arrive(i, 10, 0.0)
        return [g for _, g in router.decide(view, 0.0)]

    assert picks() == picks(seed=0) != picks(seed=1)
