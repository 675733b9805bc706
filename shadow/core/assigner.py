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

from shadow.core.cost import RouteCost
from shadow.core.fscore import Scorer
from shadow.core.params import BRParams
from shadow.core.pool import Pool, PoolEntry, best_of
from shadow.core.subset import best_subset

Assignment = tuple[Hashable, int]


def _stage1_worker(scorer: Scorer, free: Sequence[int]) -> int:
    best = -1
    best_key: tuple[int, float, float, int] | None = None
    margins = scorer.margins()
    for g, c in enumerate(free):
        if c <= 0:
            continue
        key = (c, margins[g], -scorer.load(g), -g)
        if best_key is None or key > best_key:
            best, best_key = g, key
    return best


def _stage2_worker(scorer: Scorer, free: Sequence[int]) -> int:
    """The most free slots, then the largest margin, then the lowest index (-1: none free)."""
    margins = scorer.margins()  # one call, not one per worker
    best, best_c, best_m = -1, 0, 0.0
    for g, c in enumerate(free):
        if c > best_c or (c == best_c and c > 0 and margins[g] > best_m):
            best, best_c, best_m = g, c, margins[g]
    return best


def stage1_tied(scorer: Scorer, free: Sequence[int]) -> int:
    """Stage 1's worker in sequence units: the paper's key with fewer KV tokens before the index
    (-1 when no worker has a free slot: the key's last item is −g)."""
    m, load, tok = scorer.margin, scorer.load, scorer.tokens
    keys = ((c, m(g), -load(g), -tok(g), -g) for g, c in enumerate(free) if c > 0)
    return -max(keys, default=(0, 0.0, 0.0, 0.0, 1))[-1]


def stage2_tied(scorer: Scorer, free: Sequence[int]) -> int:
    """Stage 2's pop in sequence units: the paper's key with fewer KV tokens before the index."""
    keys = ((c, scorer.margin(g), -scorer.tokens(g), -g) for g, c in enumerate(free) if c > 0)
    return -max(keys, default=(0, 0.0, 0.0, 1))[-1]


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
    stage1: Callable[[Scorer, Sequence[int]], int] | None = None,
    stage2: Callable[[Scorer, Sequence[int]], int] | None = None,
    window: Window | None = None,
    subset: Subset = best_subset,
) -> list[Assignment]:
    """Run one round; admitted entries leave `pool`, `scorer` tracks the new loads.

    Returns (request_id, worker) in decision order. No worker gets more than its free slots;
    every popped Stage-2 worker admits at least one request. `on_stage` (if given) is told
    "stage1", "stage2" and "end" as the round reaches them (a caller may time the stages).
    A variant may pick the stages' workers (default: the keys above; `stage1_tied`/`stage2_tied`
    in sequence units), Stage 2's window (default: the first R_max pool entries, aged ones first)
    and its subset search otherwise (BRA does).
    """
    free = list(free_slots)
    out: list[Assignment] = []
    threshold = params.greedy_threshold(scorer.workers)
    cost = scorer.cost
    if stage1 is None:
        stage1 = stage1_tied if cost.sequences else _stage1_worker
    if stage2 is None:
        stage2 = stage2_tied if cost.sequences else _stage2_worker

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
        entry = pool.best_single(scorer.score_of(g), scorer.peak(g), cost)
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
        score = scorer.score_of(g)
        chosen, value = subset(entries, cap, score, peak, params.exhaustive_max, cost)
        if not chosen or value <= 0:
            single = best_of(entries, score, cost)  # starvation guard
            assert single is not None
            chosen = [single]
        admit(g, chosen)
    if on_stage is not None:
        on_stage("end")
    return out
