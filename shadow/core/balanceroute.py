"""BalanceRoute (BR-0, BR-H) as a pool policy for callers that keep their own pool across rounds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from shadow.core.assigner import Assignment, assign_round
from shadow.core.fscore import BR0Scorer, BRHScorer, Scorer, project_loads
from shadow.core.params import BRParams
from shadow.core.pool import Pool

_EMPTY_I = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0, dtype=np.float64)


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
        active_worker: npt.NDArray[np.int64] | None = None,
        active_load: npt.NDArray[np.float64] | None = None,
        active_steps: npt.NDArray[np.float64] | None = None,
    ) -> Scorer:
        """The round's F-score: BR-0 over loads, or BR-H over the projection of active requests."""
        if self.variant == "br0":
            return BR0Scorer(loads)
        proj = project_loads(
            loads,
            _EMPTY_I if active_worker is None else active_worker,
            _EMPTY_F if active_load is None else active_load,
            _EMPTY_F if active_steps is None else active_steps,
            self.params.horizon,
        )
        return BRHScorer(proj, self.params)

    def round(
        self,
        loads: Sequence[float],
        free_slots: Sequence[int],
        pool: Pool,
        now: float = 0.0,
        active_worker: npt.NDArray[np.int64] | None = None,
        active_load: npt.NDArray[np.float64] | None = None,
        active_steps: npt.NDArray[np.float64] | None = None,
    ) -> list[Assignment]:
        """Admit from `pool` into free slots; returns (request_id, worker) in decision order."""
        if not pool or not any(c > 0 for c in free_slots):
            return []
        scorer = self.scorer(loads, active_worker, active_load, active_steps)
        return assign_round(scorer, pool, free_slots, self.params, now, self.on_stage)
