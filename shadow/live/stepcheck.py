"""Whether a worker-reported step is plausible beside what the mirror sees of that worker, before
it reaches the lanes' clock. Pure: event times come in as arguments.

The mirror sees a worker step in its streams: once per step, the first chunk of that step on any
of its streams, with that stream's per-token gap (`RequestTable.worker_gap_ends`: (worker, t, gap)).
A step reported on worker g as ending at t is judged by p, the longer of its duration and its
period (the time since the engine's previous busy step), on the gaps of g's streams seen within
(t − p, t + p] (the step's own span and as long again after it, where the chunk that ends it
lands):
- `longer_than_streams`: p > `gap_factor` × the longest of those gaps. The engine emits one chunk
  per running stream per step, so a step longer than every gap around it did not happen (a real
  stall shows in the gap of the chunk that ends it).
- `beyond_model`: none of g's streams were seen within it (the mirror cannot vouch for it), and
  p > `model_factor` × the larger of the configured model at g's mirrored load and g's step as its
  streams last measured it (the median of its recent gaps). A step of no known worker is judged
  against every worker: plausible when it fits some worker's streams, or the model when some
  worker's streams say nothing.
Only the mirror's own observations and the operator's configured model set the bounds, so
accepted steps cannot raise them. Each worker keeps its last `keep` gaps (a step spanning more of
them is judged on those). `check` returns None for a plausible step, else the reason.

Steps shorter than the streams show are not refused: a tap sees a real engine's chunks in bursts
(per-token gaps from 0.1 ms to several steps, bench/vllm_mirror_gaps.py), so a lower bound refused
about 1 % of a real probe's steps; too short a clock costs the lanes no more steps than the tokens
seen (`LiveDriver`'s step budget).
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections.abc import Iterable, Sequence

from shadow.core.stepmodel import StepTimeModel

LONGER = "longer_than_streams"
BEYOND_MODEL = "beyond_model"
REASONS = (LONGER, BEYOND_MODEL)
GAP_FACTOR = 4.0
MODEL_FACTOR = 10.0
KEEP = 512


class _Seen:
    """One worker's stream steps: when (ascending) and the per-token gap, the last `keep`."""

    __slots__ = ("gaps", "keep", "median", "times")

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.times: list[float] = []
        self.gaps: list[float] = []
        self.median: float | None = None  # of `gaps`, computed when asked (None: stale or none)

    def add(self, t: float, gap: float) -> None:
        times = self.times
        if times and t < times[-1]:  # (held Tokens bring a worker's step ends by stream, not in time)
            i = bisect_right(times, t)
            times.insert(i, t)
            self.gaps.insert(i, gap)
        else:
            times.append(t)
            self.gaps.append(gap)
        if len(self.times) > 2 * self.keep:  # trimmed in halves: amortised O(1)
            del self.times[: -self.keep], self.gaps[: -self.keep]
        self.median = None

    def within(self, lo: float, hi: float) -> list[float]:
        """The gaps of the stream steps seen in (lo, hi]."""
        times = self.times
        return self.gaps[bisect_right(times, lo) : bisect_right(times, hi)]

    def typical(self) -> float:
        """The median of the recent gaps (0 before any)."""
        if self.median is None:
            self.median = statistics.median(self.gaps[-self.keep :]) if self.gaps else 0.0
        return self.median


class StepCheck:
    """See module docstring: `saw` every stream step, `check` every reported one."""

    def __init__(
        self,
        workers: int,
        configured: StepTimeModel,
        *,
        gap_factor: float = GAP_FACTOR,
        model_factor: float = MODEL_FACTOR,
        keep: int = KEEP,
    ) -> None:
        if not (gap_factor >= 1 and model_factor >= 1 and keep >= 1):
            raise ValueError("step check: the factors must be >= 1 and keep >= 1")
        self.configured = configured
        self.gap_factor = gap_factor
        self.model_factor = model_factor
        self.seen = [_Seen(keep) for _ in range(workers)]
        self.rejected: dict[str, int] = dict.fromkeys(REASONS, 0)

    def saw(self, ends: Iterable[tuple[int, float, float]]) -> None:
        """Stream steps (worker, t, per-token gap) as the mirror saw them; non-positive gaps say nothing."""
        seen = self.seen
        for g, t, gap in ends:
            if gap > 0:
                seen[g].add(t, gap)

    def check(
        self, g: int | None, t: float, duration: float, period: float, loads: Sequence[float]
    ) -> str | None:
        """None when a step of worker `g` (None: no known worker) ending at `t`, `duration` long
        and `period` after the previous one, is plausible, else the reason (counted in `rejected`);
        `loads` are the mirrored loads per worker."""
        longest = max(duration, period)
        reason: str | None = None
        unvouched: list[int] = []
        for w in range(len(self.seen)) if g is None else (g,):
            gaps = self.seen[w].within(t - longest, t + longest)
            if not gaps:
                unvouched.append(w)
            elif longest > self.gap_factor * max(gaps):
                reason = LONGER
            else:
                return None  # these streams vouch for it
        if unvouched:
            bound = max(max(self.configured.worker_time(loads[w]), self.seen[w].typical()) for w in unvouched)
            reason = BEYOND_MODEL if longest > self.model_factor * bound else None
        if reason is not None:
            self.rejected[reason] += 1
        return reason
