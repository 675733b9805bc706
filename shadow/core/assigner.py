"""The BalanceRoute two-stage assigner: one routing round over the pool and free slots.

Stage 1, while total free slots exceed S_greedy: the worker with the most free slots (ties:
larger margin, lower load, lower index) takes its best single request from the whole pool.
Stage 2: workers popped by (free slots desc, margin desc, index asc) with keys refreshed before
each pop; each takes the best subset of the first R_max window entries within its free slots,
or — when no subset scores > 0 — the single best window entry (starvation guard).

Loads, margins and scores are in the units of the scorer's cost (`shadow.core.cost`); requests are
weighed by it. In sequence units (the a = 0 limit) workers whose keys tie are told apart by their KV
tokens (fewer first) before their index; in token units the keys are the paper's on loads L + κ·n.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial

from shadow.core.cost import RouteCost
from shadow.core.fscore import Scorer
from shadow.core.params import BRParams
from shadow.core.pool import Pool, PoolEntry, best_of
from shadow.core.subset import best_subset

Assignment = tuple[Hashable, int]


def _stage1_worker(scorer: Scorer, free: Sequence[int]) -> int:
    best = -1
    best_key: tuple[float, ...] | None = None
    tie = scorer.tokens if scorer.cost.sequences else None
    for g, c in enumerate(free):
        if c <= 0:
            continue
        if tie is None:
            key: tuple[float, ...] = (c, scorer.margin(g), -scorer.load(g), -g)
        else:
            key = (c, scorer.margin(g), -scorer.load(g), -tie(g), -g)
        if best_key is None or key > best_key:
            best, best_key = g, key
    return best


def _stage2_worker(scorer: Scorer, free: Sequence[int]) -> int:
    best = -1
    best_key: tuple[float, ...] | None = None
    tie = scorer.tokens if scorer.cost.sequences else None
    for g, c in enumerate(free):
        if c <= 0:
            continue
        m = scorer.margin(g)
        key: tuple[float, ...] = (c, m, -g) if tie is None else (c, m, -tie(g), -g)
        if best_key is None or key > best_key:
            best, best_key = g, key
    return best


Window = Callable[[int, float], list[PoolEntry]]  # (worker, its F-score peak) -> Stage-2 window
Subset = Callable[
    [Sequence[PoolEntry], int, Callable[[float], float], float, int, RouteCost], tuple[list[PoolEntry], float]
]


def assign_round(
    scorer: Scorer,
    pool: Pool,
    free_slots: Sequence[int],
    params: BRParams,
    now: float = 0.0,
    on_stage: Callable[[str], None] | None = None,
    *,
    stage1: Callable[[Scorer, Sequence[int]], int] = _stage1_worker,
    stage2: Callable[[Scorer, Sequence[int]], int] = _stage2_worker,
    window: Window | None = None,
    subset: Subset = best_subset,
) -> list[Assignment]:
    """Run one round; admitted entries leave `pool`, `scorer` tracks the new loads.

    Returns (request_id, worker) in decision order. No worker gets more than its free slots;
    every popped Stage-2 worker admits at least one request. `on_stage` (if given) is told
    "stage1", "stage2" and "end" as the round reaches them (a caller may time the stages).
    A variant may pick the stages' workers, Stage 2's window (default: the first R_max pool
    entries, aged ones first) and its subset search otherwise (BRA does).
    """
    free = list(free_slots)
    out: list[Assignment] = []
    threshold = params.greedy_threshold(scorer.workers)
    cost = scorer.cost

    def admit(g: int, entries: Sequence[PoolEntry]) -> None:
        for entry in entries:
            pool.remove(entry)
            out.append((entry.request_id, g))
        free[g] -= len(entries)
        scorer.admit(g, entries)

    # Stage 1: capacity is plentiful — greedy single fills from the whole pool.
    if on_stage is not None:
        on_stage("stage1")
    total_free = sum(free)
    while pool and total_free > threshold:
        g = stage1(scorer, free)
        entry = pool.best_single(partial(scorer.score, g), scorer.peak(g), cost)
        assert entry is not None  # pool is non-empty
        admit(g, (entry,))
        total_free -= 1

    # Stage 2: capacity is scarce — exact best subset of the window per popped worker.
    if on_stage is not None:
        on_stage("stage2")
    while pool:
        g = stage2(scorer, free)
        if g < 0:
            break
        peak = scorer.peak(g)
        entries = pool.window(params.r_max, now, params.age_s) if window is None else window(g, peak)
        cap = min(free[g], params.r_max)
        score = partial(scorer.score, g)
        chosen, value = subset(entries, cap, score, peak, params.exhaustive_max, cost)
        if not chosen or value <= 0:
            single = best_of(entries, score, cost)  # starvation guard
            assert single is not None
            chosen = [single]
        admit(g, chosen)
    if on_stage is not None:
        on_stage("end")
    return out
