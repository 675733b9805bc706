"""BalanceRoute (BR-0, BR-H) as a pool policy for callers that keep their own pool across rounds.

`BalanceRoute.scorer` is where the fleet's loads enter every BalanceRoute-based policy (BR-0,
BR-H and BRA's rounds): under a `RouteCost` with a per-sequence term they are put in its units
there (a worker's load L_g + κ·n_g, a running request's w_i + κ, a generated token weighing 1), and
the scorer prices the requests it admits the same way. With the paper's cost nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from shadow.core.assigner import Assignment, assign_round
from shadow.core.cost import TOKENS, RouteCost
from shadow.core.fscore import NO_PROJECTION, BR0Scorer, BRHScorer, Projection, Scorer, project_loads
from shadow.core.params import BRParams
from shadow.core.pool import Pool


class BalanceRoute:
    """One routing round per call over a persistent `Pool`; `variant` is "br0" or "brh"."""

    def __init__(self, variant: Literal["br0", "brh"], params: BRParams | None = None) -> None:
        if variant not in ("br0", "brh"):
            raise ValueError(f"BalanceRoute variant must be 'br0' or 'brh', got {variant!r}")
        self.variant = variant
        self.params = params or BRParams()
        self.on_stage: Callable[[str], None] | None = None  # told of each round's stages (timing)

    def scorer(
        self,
        loads: Sequence[float],
        active: Projection | None = None,
        *,
        cost: RouteCost = TOKENS,
        seqs: Sequence[float] | None = None,
    ) -> Scorer:
        """The round's F-score: BR-0 over loads, or BR-H over the projection of `active` requests
        (None: none listed), in `cost`'s units (`seqs`: running sequences per worker, needed by a
        per-sequence cost)."""
        if cost.paper and self.variant == "br0":
            return BR0Scorer(loads)
        worker, load, steps = NO_PROJECTION if active is None else active
        if cost.paper:
            return BRHScorer(project_loads(loads, worker, load, steps, self.params.horizon), self.params)
        if seqs is None:
            raise ValueError("a per-sequence step cost needs each worker's running sequences")
        weighed = cost.loads(loads, seqs)
        if self.variant == "br0":
            return BR0Scorer(weighed, cost, tokens=loads)
        h = self.params.horizon
        proj = project_loads(weighed, worker, cost.token * load + cost.seq, steps, h, growth=cost.token)
        return BRHScorer(proj, self.params, cost, tokens=loads)

    def round(
        self,
        loads: Sequence[float],
        free_slots: Sequence[int],
        pool: Pool,
        now: float = 0.0,
        active: Projection | None = None,
        *,
        cost: RouteCost = TOKENS,
        seqs: Sequence[float] | None = None,
    ) -> list[Assignment]:
        """Admit from `pool` into free slots; returns (request_id, worker) in decision order."""
        if not pool or not any(c > 0 for c in free_slots):
            return []
        scorer = self.scorer(loads, active, cost=cost, seqs=seqs)
        return assign_round(scorer, pool, free_slots, self.params, now, self.on_stage)
