"""How well BR-H's end probabilities match what finished requests really did (a mirror listener).

`CalibrationMonitor` listens to the mirror. For each finished request (output O tokens) it asks a
survival model of output lengths — the kind BR-H's default predictor is, learned the same way,
online from the requests finished before — for p_fin(a) at ages a = 0, H, 2H, ... < O, and pairs
each with the outcome 1[O ≤ a + H]. The expected calibration error over the recent pairs (10 equal
bins of p) is what BR-H's degrade check reads. Prompt-key lookups (a key seen finished before =
hit) are counted for BR-H:exactmatch. Work is batched in `update()` (called by the health poll on
the mirror's thread); memory is bounded (length window, pair window, key table).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from shadow.contracts.events import Arrive, Cancel, Event, Finish
from shadow.core.predictors import EmpiricalLengths


class CalibrationMonitor:
    """See module docstring. Call `update()` periodically; read `error()` and `lookups`."""

    def __init__(
        self,
        horizon: int = 80,
        *,
        lengths_window: int = 20_000,
        pairs_window: int = 5_000,
        bins: int = 10,
        max_ages: int = 8,
        max_open: int = 100_000,
    ) -> None:
        self.horizon = horizon
        self.bins = bins
        self.max_ages = max_ages
        self.max_open = max_open
        self.lengths: deque[int] = deque(maxlen=lengths_window)
        self.pairs: deque[tuple[float, float]] = deque(maxlen=pairs_window)
        self.pending: list[int] = []
        self.keys: OrderedDict[str, str] = OrderedDict()  # request id -> prompt key (open requests)
        self.seen: OrderedDict[str, None] = OrderedDict()  # prompt keys of finished requests
        self.lookups = {"hit": 0, "miss": 0}

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, Arrive):
            if ev.prompt_key is not None:
                self.lookups["hit" if ev.prompt_key in self.seen else "miss"] += 1
                self.keys[ev.request_id] = ev.prompt_key
                if len(self.keys) > self.max_open:
                    self.keys.popitem(last=False)
        elif isinstance(ev, Finish):
            key = self.keys.pop(ev.request_id, None)
            if ev.generated is not None and ev.reason in ("stop", "length") and len(self.pending) < 100_000:
                self.pending.append(int(ev.generated))
                if key is not None:
                    self.seen[key] = None
                    self.seen.move_to_end(key)
                    if len(self.seen) > self.max_open:
                        self.seen.popitem(last=False)
        elif isinstance(ev, Cancel):
            self.keys.pop(ev.request_id, None)

    def update(self) -> None:
        """Score the requests finished since the last call, then learn from them."""
        if not self.pending:
            return
        done, self.pending = self.pending, []
        if self.lengths:
            model = EmpiricalLengths(list(self.lengths))
            h = self.horizon
            ages: list[float] = []
            outcome: list[float] = []
            for o in done:
                for k in range(min(self.max_ages, o // h + 1)):
                    a = k * h
                    if a >= o and o > 0:
                        break
                    ages.append(float(a))
                    outcome.append(1.0 if o <= a + h else 0.0)
            if ages:
                p, _ = model.conditional(np.asarray(ages), h)
                self.pairs.extend(zip(p.tolist(), outcome, strict=True))
        self.lengths.extend(done)

    def error(self) -> tuple[float | None, int]:
        """(expected calibration error over the recent pairs, number of pairs); None without any."""
        n = len(self.pairs)
        if n == 0:
            return None, 0
        arr = np.asarray(self.pairs, dtype=np.float64)
        p, y = arr[:, 0], arr[:, 1]
        idx = np.minimum((p * self.bins).astype(np.int64), self.bins - 1)
        sp = np.bincount(idx, weights=p, minlength=self.bins)
        sy = np.bincount(idx, weights=y, minlength=self.bins)
        return float(np.abs(sp - sy).sum() / n), n
