"""BRA, "BalanceRoute-adaptive": this project's own policy (not the paper's), built on BR's
F-scores; with pick, hold and window off it makes exactly BR's decisions (tested)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shadow.core.assigner import Assignment, assign_round, stage2_tied
from shadow.core.balanceroute import BalanceRoute
from shadow.core.cost import TOKENS, RouteCost
from shadow.core.fscore import Projection, Scorer
from shadow.core.params import BRParams
from shadow.core.pool import Pool, PoolEntry
from shadow.core.stay import StayBasis
from shadow.core.subset import best_subset, pairs

BASES = ("prompt", "life", "kv", "final", "near", "stay")
PREDICTED_BASES = ("life", "final", "near", "stay")  # need a predictor; "prompt" without one


@dataclass(frozen=True, slots=True)
class BRAParams:
    """BRA's own knobs (BR's are in BRParams). Defaults fixed on paper-azure only (see docs/results).

    hold_life / hold_pool: None switches that bound off (the hold is then bounded by hold_s only).
    """

    score_pick: bool = True
    thin_ratio: float = 1.0
    hold: bool = True
    hold_s: float = 0.5
    hold_life: float | None = 0.125
    hold_pool: float | None = 1.0
    scale_window: bool = True
    basis: str = "life"

    def __post_init__(self) -> None:
        if not (
            isinstance(self.thin_ratio, int | float)
            and math.isfinite(self.thin_ratio)
            and self.thin_ratio >= 0
        ):
            raise ValueError(f"thin_ratio must be a finite number >= 0, got {self.thin_ratio!r}")
        if not (isinstance(self.hold_s, int | float) and math.isfinite(self.hold_s) and self.hold_s >= 0):
            raise ValueError(f"hold_s must be a finite number >= 0, got {self.hold_s!r}")
        for name in ("hold_life", "hold_pool"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value >= 0
            ):
                raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")
        if self.basis not in BASES:
            raise ValueError(f"basis must be one of {list(BASES)}, got {self.basis!r}")

    def hold_rounds(self, predicted_steps: float | None, horizon: int) -> float:
        """Rounds a request may be held: ⌊hold_life · ĉ⌋ for a predicted stay ĉ within the
        `horizon`; unbounded (hold_s alone applies) without a life bound, without a prediction or
        when ĉ reaches the horizon — the stay is then at least H and unknown beyond it."""
        if self.hold_life is None or predicted_steps is None or predicted_steps >= horizon:
            return math.inf
        return math.floor(self.hold_life * predicted_steps)

    def window(self, workers: int, base: int) -> int:
        """Stage-2 window R_max for a fleet of `workers` (the base value when not scaling)."""
        if not self.scale_window:
            return base
        return max(base, min(16, math.ceil(workers / 2)))




class BalanceRouteAdaptive:
    """One BRA routing round per call over a persistent `Pool` (same call shape as BalanceRoute).

    It keeps BalanceRoute's idea — score each admission by its effect on the barrier — and changes
    what the replays showed (docs/results/protocol.md), each switchable for ablation:

    - `score_pick`: when the pool is thin (no more waiting requests than `thin_ratio` × free slots,
      so every one of them fits this round), place requests largest first, each on the worker with
      the best BR-0 F-score among *all* workers with a free slot, instead of the paper's "most free
      slots first", which below saturation degenerates into JSQ-count. The F-score is taken over
      each worker's outstanding prompt tokens (`prompt_loads`; current loads if not given): over a
      request's whole stay the tokens already generated leave with their requests, so today's KV
      load overweights requests about to finish (measured: least-KV placement loses to JSQ-bytes
      below saturation, docs/results/protocol.md). Ties: lower prompt load.
    - `hold`: in that thin regime, a request for which every worker's F-score is <= 0 (any placement
      raises the barrier) is held back instead of being forced in — only while something is running,
      for at most `hold_life` of its predicted stay counted in rounds (one round per decode step in
      the engine; the stay is BR-H's ĉ within the horizon: a request predicted to outlive the
      horizon, or without a prediction, is bounded by time only), never longer than `hold_s`
      seconds, and only while the pool holds at most `hold_pool` × G requests (held requests must not
      fill a bounded queue). A 28-token request is held about 3 steps, a long one up to `hold_s`.
    - `basis`: the thin-pool F-score's per-worker load: "prompt" (outstanding prompt tokens) or
      "stay" (the KV running requests are expected to hold over a newcomer's predicted stay,
      `shadow.core.stay`; needs a predictor, falls back to "prompt" without one).
    - `scale_window`: Stage 2's window grows with G (R_max = clamp(⌈G/2⌉, 4, 16)), and each popped
      worker's window is centred on its own best fill (pool entries nearest its F-score peak, aged
      entries first), so large fleets do not all draw from the same R_max longest prompts.

    With pick, hold and window off it makes exactly BR's decisions (tested). It reads prompt sizes,
    loads, free slots and (BR-H) predicted steps only — never true output lengths. Under a
    per-sequence step cost (`cost`, with `seqs` running per worker) every load and basis is in the
    cost's units (`shadow.core.cost`) as BR's are: a running request of the basis weighs its basis
    tokens + κ (× the fraction of the basis window it is there), a newcomer its own + κ.
    """

    variant = "bra"

    def __init__(self, params: BRParams | None = None, adaptive: BRAParams | None = None) -> None:
        self.params = params or BRParams()
        self.adaptive = adaptive or BRAParams()
        self._held: dict[int, int] = {}  # pool seq -> thin rounds it has been held so far

    def round(
        self,
        loads: Sequence[float],
        free_slots: Sequence[int],
        pool: Pool,
        now: float = 0.0,
        active: Projection | None = None,
        prompt_loads: Sequence[float] | None = None,
        stay: Callable[[str], StayBasis | None] | None = None,
        *,
        cost: RouteCost = TOKENS,
        seqs: Sequence[float] | None = None,
    ) -> list[Assignment]:
        """Admit from `pool` into free slots; returns (request_id, worker) in decision order.

        Scores with BR-H over the projection when active requests are given (`active`), with
        BR-0 over `loads` otherwise; a thin pool is placed by BR-0 over its basis: `prompt_loads`
        (per-worker prompt tokens of running requests; `loads` if None) or, with basis "stay",
        what `stay()` returns (asked only then; None falls back to the prompt basis).
        Never exceeds free slots; admits each entry once.
        """
        if not pool or not any(c > 0 for c in free_slots):
            return []
        if not cost.paper and seqs is None:
            raise ValueError("a per-sequence step cost needs each worker's running sequences")
        a = self.adaptive
        free = list(free_slots)
        if a.score_pick and len(pool) <= a.thin_ratio * sum(free):
            return self._thin_round(loads, free, pool, now, prompt_loads, stay, cost, seqs)
        workers = len(loads)
        params = replace(self.params, r_max=a.window(workers, self.params.r_max))
        scorer = BalanceRoute("br0" if active is None else "brh", params).scorer(
            loads, active, cost=cost, seqs=seqs
        )
        if not a.scale_window:
            return assign_round(scorer, pool, free, params, now)
        return _centred_round(scorer, pool, free, params, now)

    def _thin_round(
        self,
        loads: Sequence[float],
        free: list[int],
        pool: Pool,
        now: float,
        prompt_loads: Sequence[float] | None,
        stay: Callable[[str], StayBasis | None] | None,
        cost: RouteCost,
        seqs: Sequence[float] | None,
    ) -> list[Assignment]:
        """Every waiting request fits: largest first, each to the worker with a free slot whose BR-0
        F-score over the basis is best (ties: lower basis load, then its tokens, then lower index),
        or held back."""
        a = self.adaptive
        sb = stay(a.basis) if a.basis in PREDICTED_BASES and stay is not None else None
        added: Callable[[float], float] = float
        if sb is not None:
            basis, added = list(sb.loads), sb.newcomer
            if sb.seqs is not None:
                seqs = sb.seqs
        elif a.basis == "kv":
            basis = [float(x) for x in loads]
        else:
            basis = [float(x) for x in (loads if prompt_loads is None else prompt_loads)]
        workers = len(basis)
        tokens = basis  # the tie-break after the basis: itself in token units, its tokens in sequence units
        if not cost.paper:
            assert seqs is not None  # checked by round()
            weighed = cost.loads(basis, seqs)
            tokens, basis = (basis, weighed) if cost.sequences else (weighed, weighed)
        may_hold = (
            a.hold
            and any(x > 0 for x in loads)  # something runs: holding can never deadlock
            and (a.hold_pool is None or len(pool) <= a.hold_pool * workers)
        )
        held_before, held_now = self._held, {}
        horizon = self.params.horizon
        top = max(basis)
        out: list[Assignment] = []
        for entry in list(pool):
            grown = added(entry.prompt_tokens)
            delta = cost.weight(grown)
            best, best_key = -1, (-math.inf, -math.inf, -math.inf, 0)
            for g, c in enumerate(free):
                if c <= 0:
                    continue
                over = delta - (top - basis[g])  # BR-0: Δ − G·(Δ − m_g)+
                key = (delta - workers * over if over > 0 else delta, -basis[g], -tokens[g], -g)
                if key > best_key:
                    best, best_key = g, key
            if best < 0:
                break
            if may_hold and best_key[0] <= 0 and now - entry.arrived_at < a.hold_s:
                # every placement raises the barrier: wait a few rounds for a better one
                rounds = held_before.get(entry.seq, 0)
                if rounds < a.hold_rounds(entry.horizon_steps, horizon):
                    held_now[entry.seq] = rounds + 1
                    continue
            pool.remove(entry)
            out.append((entry.request_id, best))
            free[best] -= 1
            basis[best] += delta
            if tokens is not basis:
                tokens[best] += grown
            top = max(top, basis[best])
        self._held = held_now
        return out


def _centred_round(
    scorer: Scorer, pool: Pool, free: list[int], params: BRParams, now: float
) -> list[Assignment]:
    """BR's two stages; Stage 2 windows are centred on each popped worker's F-score peak."""

    cost = scorer.cost

    def window(g: int, peak: float) -> list[PoolEntry]:
        alone = peak if cost.paper else cost.tokens_at(peak)  # the prompt that would weigh the peak alone
        return _centred_window(pool, params.r_max, alone, now, params.age_s)

    return assign_round(
        scorer, pool, free, params, now, stage1=_most_free, stage2=_most_free, window=window, subset=_subset
    )


def _most_free(scorer: Scorer, free: Sequence[int]) -> int:
    """BR's Stage-2 pop order: most free slots, then larger margin, then lower index (in sequence
    units, fewer KV tokens before the index: `stage2_tied`)."""
    if scorer.cost.sequences:
        return stage2_tied(scorer, free)
    margins = scorer.margins()
    best, best_c, best_m = -1, 0, -math.inf
    for g, c in enumerate(free):
        if c <= 0:
            continue
        m = margins[g]
        if best < 0 or c > best_c or (c == best_c and m > best_m):
            best, best_c, best_m = g, c, m
    return best


def _subset(
    window: Sequence[PoolEntry],
    cap: int,
    score: Callable[[float], float],
    peak: float,
    exhaustive_max: int,
    cost: RouteCost = TOKENS,
) -> tuple[list[PoolEntry], float]:
    """`best_subset`'s result; caps <= 2 over wide windows by listing sums (`pairs`), not bitsets."""
    if len(window) > exhaustive_max and min(cap, len(window)) <= 2:
        return pairs(window, cap, score, peak, cost)
    return best_subset(window, cap, score, peak, exhaustive_max, cost)


def _centred_window(pool: Pool, size: int, peak: float, now: float, age_s: float | None) -> list[PoolEntry]:
    """Aged entries first (arrival order, at most half the window), then the entries nearest `peak`."""
    aged = [e for e in pool.window(size, now, age_s) if age_s is not None and now - e.arrived_at >= age_s]
    aged = aged[: max(1, size // 2)] if aged else []
    taken = {e.seq for e in aged}
    near = [e for e in pool.nearest(peak, size + len(aged)) if e.seq not in taken]
    return (aged + near)[:size]
