"""BRA, "BalanceRoute-adaptive": this project's own policy (not the paper's), built on BR's F-scores.

It keeps BalanceRoute's idea — score each admission by its effect on the barrier — and changes
three things the replays showed (docs/results/protocol.md), each switchable for ablation:

- `score_pick`: when the pool is thin (no more waiting requests than `thin_ratio` × free slots,
  so every one of them fits this round), place requests largest first, each on the worker with
  the best BR-0 F-score among *all* workers with a free slot, instead of the paper's "most free
  slots first", which below saturation degenerates into JSQ-count. The F-score is taken over
  each worker's outstanding prompt tokens (`prompt_loads`; current loads if not given): over a
  request's whole stay the tokens already generated leave with their requests, so today's KV
  load overweights requests about to finish (measured: least-KV placement loses to JSQ-bytes
  below saturation, docs/results/protocol.md). Ties: lower prompt load.
- `hold`: in that thin regime, a request for which every worker's F-score is <= 0 (any placement
  raises the barrier) is held back, at most `hold_s` seconds after it entered the pool and only
  while something is running, instead of being forced in by the starvation guard.
- `scale_window`: Stage 2's window grows with G (R_max = clamp(⌈G/2⌉, 4, 16)), and each popped
  worker's window is centred on its own best fill (pool entries nearest its F-score peak, aged
  entries first), so large fleets do not all draw from the same R_max longest prompts.

With all three off it makes exactly BR's decisions (tested). It reads prompt sizes, loads, free
slots and (BR-H) predicted steps only — never true output lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import numpy.typing as npt

from shadow.core.assigner import Assignment, assign_round
from shadow.core.balanceroute import BalanceRoute
from shadow.core.fscore import BR0Scorer, Scorer
from shadow.core.params import BRParams
from shadow.core.pool import Pool, PoolEntry, best_of
from shadow.core.subset import best_subset


@dataclass(frozen=True, slots=True)
class BRAParams:
    """BRA's own knobs (BR's are in BRParams). Defaults fixed on paper-azure only (see docs/results)."""

    score_pick: bool = True
    thin_ratio: float = 1.0
    hold: bool = True
    hold_s: float = 0.5
    scale_window: bool = True

    def __post_init__(self) -> None:
        if not (
            isinstance(self.thin_ratio, int | float)
            and math.isfinite(self.thin_ratio)
            and self.thin_ratio >= 0
        ):
            raise ValueError(f"thin_ratio must be a finite number >= 0, got {self.thin_ratio!r}")
        if not (isinstance(self.hold_s, int | float) and math.isfinite(self.hold_s) and self.hold_s >= 0):
            raise ValueError(f"hold_s must be a finite number >= 0, got {self.hold_s!r}")

    def window(self, workers: int, base: int) -> int:
        """Stage-2 window R_max for a fleet of `workers` (the base value when not scaling)."""
        if not self.scale_window:
            return base
        return max(base, min(16, math.ceil(workers / 2)))


_EMPTY_I = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0, dtype=np.float64)


class BalanceRouteAdaptive:
    """One BRA routing round per call over a persistent `Pool` (same call shape as BalanceRoute)."""

    variant = "bra"

    def __init__(self, params: BRParams | None = None, adaptive: BRAParams | None = None) -> None:
        self.params = params or BRParams()
        self.adaptive = adaptive or BRAParams()

    def round(
        self,
        loads: Sequence[float],
        free_slots: Sequence[int],
        pool: Pool,
        now: float = 0.0,
        active_worker: npt.NDArray[np.int64] | None = None,
        active_load: npt.NDArray[np.float64] | None = None,
        active_steps: npt.NDArray[np.float64] | None = None,
        prompt_loads: Sequence[float] | None = None,
    ) -> list[Assignment]:
        """Admit from `pool` into free slots; returns (request_id, worker) in decision order.

        Scores with BR-H over the projection when active requests are given (`active_*`), with
        BR-0 over `loads` otherwise; a thin pool is placed by BR-0 over `prompt_loads` (per-worker
        prompt tokens of running requests). Never exceeds free slots; admits each entry once.
        """
        if not pool or not any(c > 0 for c in free_slots):
            return []
        a = self.adaptive
        workers = len(loads)
        params = replace(self.params, r_max=a.window(workers, self.params.r_max))
        scorer = BalanceRoute("br0" if active_worker is None else "brh", params).scorer(
            loads,
            _EMPTY_I if active_worker is None else active_worker,
            _EMPTY_F if active_load is None else active_load,
            _EMPTY_F if active_steps is None else active_steps,
        )
        free = list(free_slots)
        if a.score_pick and len(pool) <= a.thin_ratio * sum(free):
            running = any(x > 0 for x in loads)
            basis = [float(x) for x in (loads if prompt_loads is None else prompt_loads)]
            return _thin_round(BR0Scorer(basis), basis, pool, free, now, a.hold and running, a.hold_s)
        if not a.scale_window:
            return assign_round(scorer, pool, free, params, now)
        return _centred_round(scorer, pool, free, params, now)


def _thin_round(
    scorer: BR0Scorer, basis: list[float], pool: Pool, free: list[int], now: float, hold: bool, hold_s: float
) -> list[Assignment]:
    """Every waiting request fits: largest first, each to the worker with a free slot whose BR-0
    F-score over `basis` is best (ties: lower basis load, then lower index)."""
    out: list[Assignment] = []
    for entry in list(pool):
        best, best_key = -1, (-math.inf, -math.inf, 0)
        for g, c in enumerate(free):
            if c <= 0:
                continue
            key = (scorer.score(g, entry.prompt_tokens), -basis[g], -g)
            if key > best_key:
                best, best_key = g, key
        if best < 0:
            break
        if hold and best_key[0] <= 0 and now - entry.arrived_at < hold_s:
            continue  # every placement raises the barrier: wait (bounded by hold_s) for a better one
        pool.remove(entry)
        out.append((entry.request_id, best))
        free[best] -= 1
        basis[best] += entry.prompt_tokens
        scorer.admit(best, (entry,))
    return out


def _centred_round(
    scorer: Scorer, pool: Pool, free: list[int], params: BRParams, now: float
) -> list[Assignment]:
    """BR's two stages; Stage 2 windows are centred on each popped worker's F-score peak."""
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
        g = _most_free(scorer, free)
        entry = pool.best_single(partial(scorer.score, g), scorer.peak(g))
        assert entry is not None
        admit(g, (entry,))
        total_free -= 1
    while pool:
        g = _most_free(scorer, free)
        if g < 0:
            break
        peak = scorer.peak(g)
        window = _centred_window(pool, params.r_max, peak, now, params.age_s)
        cap = min(free[g], params.r_max)
        score = partial(scorer.score, g)
        chosen, value = best_subset(window, cap, score, peak, params.exhaustive_max)
        if not chosen or value <= 0:
            single = best_of(window, score)  # starvation guard, as BR's
            assert single is not None
            chosen = [single]
        admit(g, chosen)
    return out


def _most_free(scorer: Scorer, free: Sequence[int]) -> int:
    """BR's Stage-2 pop order: most free slots, then larger margin, then lower index."""
    best, best_key = -1, (0, -math.inf, 0)
    for g, c in enumerate(free):
        if c <= 0:
            continue
        key = (c, scorer.margin(g), -g)
        if best < 0 or key > best_key:
            best, best_key = g, key
    return best


def _centred_window(pool: Pool, size: int, peak: float, now: float, age_s: float | None) -> list[PoolEntry]:
    """Aged entries first (arrival order, at most half the window), then the entries nearest `peak`."""
    aged = [e for e in pool.window(size, now, age_s) if age_s is not None and now - e.arrived_at >= age_s]
    aged = aged[: max(1, size // 2)] if aged else []
    taken = {e.seq for e in aged}
    near = [e for e in pool.nearest(peak, size + len(aged)) if e.seq not in taken]
    return (aged + near)[:size]
