"""Lane figures per window of lane time, and each lane against a reference with a batch-means interval.

`Windows` observes lanes: when a lane's clock passes a boundary (every `window_s` seconds of lane
time from 0) it books the change of the lane's totals since the previous one as that window's
figures. A window counts once every lane has passed its end. `compare` pairs one lane with a
reference window by window (the ratio per window, > 1 when the lane does better: lower spread,
I(k) and barrier idle, higher throughput) and gives their geometric mean with a two-sided 95 %
t-interval of the log ratios over the windows (`core.intervals.ratio_interval`; batch means:
windows long against a request's lifetime are close to independent). Both bounds are positive.
Memory: the most recent `keep` windows per lane.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shadow.contracts.report import LaneFigures, WindowFigures
from shadow.core.intervals import MIN_SAMPLES, RatioInterval, ratio_interval
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.driver import Observer
from shadow.engine.lane import Lane, LaneTotals

FIGURES = ("spread", "imbalance", "idle", "throughput")
MIN_WINDOWS = MIN_SAMPLES  # fewer: a ratio is given without its interval


@dataclass(frozen=True, slots=True)
class WindowTotals:
    """The change of one lane's totals over one window."""

    index: int
    steps: int
    sum_spread: float
    sum_imbalance: float
    sum_max: float
    tokens: int
    cut: bool = False  # left unfinished (a rolling lane re-seeded ahead): never compared
    # the lane's own barrier idle (worker-seconds) and stepping time: sums of step times, whose
    # rounding depends on where the running sum started (equality compares the counts above)
    idle_s: float = field(default=0.0, compare=False)
    worker_s: float = field(default=0.0, compare=False)

    def figure(self, name: str, step: StepTimeModel | None, workers: int) -> float | None:
        """`name` (one of FIGURES) over this window, priced under `step` (None: on the lane's own
        clock, the step times it stepped); None without steps."""
        if self.steps <= 0:
            return None
        if name == "spread":
            return self.sum_spread / self.steps
        if name == "imbalance":
            return self.sum_imbalance / self.steps
        if step is None:
            if self.worker_s <= 0:
                return None
            return self.idle_s / self.worker_s if name == "idle" else workers * self.tokens / self.worker_s
        busy = step.a * self.sum_max + step.b * self.steps
        if busy <= 0:
            return None
        if name == "idle":
            return step.a * self.sum_imbalance / (workers * busy)
        return self.tokens / busy

    def figures(self, step: StepTimeModel | None, workers: int) -> WindowFigures:
        """This window as reports give it (the per-window twins of `lane_figures`)."""
        return {
            "index": self.index,
            "steps": self.steps,
            "avg_spread_tokens": self.figure("spread", step, workers),
            "avg_imbalance_tokens": self.figure("imbalance", step, workers),
            "barrier_idle_fraction": self.figure("idle", step, workers),
            "throughput_tokens_per_s": self.figure("throughput", step, workers),
            "cut": self.cut,
        }


def lane_figures(t: LaneTotals, step: StepTimeModel | None, workers: int) -> LaneFigures:
    """A lane's cumulative figures under `step` (re-priced from its sums; None: on the lane's own
    clock, the step times it stepped): spread, I(k), barrier idle, throughput and TPOT over every
    step it ran. On its own clock, throughput is tokens per second of stepping over the fleet
    (G · tokens / the workers' stepping time: tokens / busy under one barrier)."""
    steps = max(t.steps, 1)
    if step is None:
        busy, work = t.busy_time_s, t.worker_time_s
        idle = t.sum_idle_s / work if work > 0 else 0.0
        throughput = workers * t.tokens / work if work > 0 else 0.0
    else:
        busy = step.a * t.sum_max + step.b * t.steps
        idle = step.a * t.sum_imbalance / (workers * busy) if busy > 0 else 0.0
        throughput = t.tokens / busy if busy > 0 else 0.0
    return {
        **t.balance.figures(throughput),  # balance in the field's units (`shadow.engine.balance`)
        "steps": t.steps,
        "requests_finished": t.finished,
        "avg_spread_tokens": t.sum_spread / steps,
        "avg_imbalance_tokens": t.sum_imbalance / steps,
        "sum_spread_token_steps": t.sum_spread,
        "sum_imbalance_token_steps": t.sum_imbalance,
        "barrier_idle_fraction": idle,
        "throughput_tokens_per_s": throughput,
        "tpot_s": busy / t.steps if t.steps else None,
        "tokens": t.tokens,
    }


class Windows(Observer):
    """See module docstring. Observe every lane (`LaneDriver.observers`); `lanes` in one order."""

    def __init__(self, lanes: Sequence[Lane], window_s: float, keep: int = 10_000) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window must be > 0 s, got {window_s!r}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.window_s = window_s
        self.labels = [lane.spec.label for lane in lanes]
        self._index = {id(lane): i for i, lane in enumerate(lanes)}
        self._mark: list[tuple[int, int, float, float, float, int, float, float]] = [
            (0, 0, 0.0, 0.0, 0.0, 0, 0.0, 0.0)] * len(lanes)
        self.done: list[deque[WindowTotals]] = [deque(maxlen=keep) for _ in lanes]
        self.passed = [0] * len(lanes)  # windows each lane has passed the end of

    def stepped(self, lane: Lane) -> None:
        i = self._index.get(id(lane))
        if i is None:
            return
        k = int(lane.now // self.window_s)
        if k > self.passed[i]:
            self._close(i, lane, k)

    def boundary(self, lane: Lane, n: int) -> None:
        i = self._index.get(id(lane))
        if i is not None and n > self.passed[i]:
            self._close(i, lane, n)

    def cut(self, lane: Lane, at: float) -> None:
        i = self._index.get(id(lane))
        if i is None:
            return
        k = int(at // self.window_s)
        if k > self.passed[i]:
            self._close(i, lane, k, cut=True)

    def _close(self, i: int, lane: Lane, k: int, cut: bool = False) -> None:
        """Book the totals since the last boundary as window `passed[i]`; windows the lane jumped
        over (idle; or `cut`: re-seeded ahead, all marked cut) are booked empty."""
        t = lane.totals
        w0, steps0, spread0, imb0, max0, tok0, idle0, work0 = self._mark[i]
        self.done[i].append(
            WindowTotals(w0, t.steps - steps0, t.sum_spread - spread0, t.sum_imbalance - imb0,
                         t.sum_max - max0, t.tokens - tok0, cut, t.sum_idle_s - idle0,
                         t.worker_time_s - work0)
        )
        for j in range(w0 + 1, k):
            self.done[i].append(WindowTotals(j, 0, 0.0, 0.0, 0.0, 0, cut))
        self._mark[i] = (k, t.steps, t.sum_spread, t.sum_imbalance, t.sum_max, t.tokens, t.sum_idle_s,
                         t.worker_time_s)
        self.passed[i] = k

    @classmethod
    def view(cls, window_s: float, booked: Mapping[str, tuple[Sequence[WindowTotals], int]]) -> Windows:
        """Windows booked elsewhere (lanes in other processes): per label, in order, its windows and
        how many it has passed; read like the observer that booked them (`complete`, `series`,
        `recent`, `compare`). It observes nothing."""
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window must be > 0 s, got {window_s!r}")
        w = cls.__new__(cls)
        w.window_s = window_s
        w.labels = list(booked)
        w._index = {}
        w._mark = []
        w.done = [deque(done, maxlen=max(1, len(done))) for done, _ in booked.values()]
        w.passed = [passed for _, passed in booked.values()]
        return w

    def booked(self, label: str) -> tuple[list[WindowTotals], int]:
        """Lane `label`'s windows kept and how many it has passed (what `view` takes)."""
        i = self.labels.index(label)
        return list(self.done[i]), self.passed[i]

    @property
    def complete(self) -> int:
        """Windows every lane has passed the end of."""
        return min(self.passed, default=0)

    def series(self, label: str) -> list[WindowTotals]:
        """The complete windows of lane `label` still kept, oldest first."""
        n = self.complete
        return [w for w in self.done[self.labels.index(label)] if w.index < n]

    def recent(self, label: str, n: int) -> list[WindowTotals]:
        """The last (up to) `n` complete windows of lane `label`, oldest first."""
        c = self.complete
        out: list[WindowTotals] = []
        for w in reversed(self.done[self.labels.index(label)]):
            if len(out) >= n:
                break
            if w.index < c:
                out.append(w)
        return out[::-1]

    def compare(
        self, label: str, reference: str, step: StepTimeModel | None, workers: int
    ) -> dict[str, RatioInterval]:
        """Per figure: lane `label` against `reference`, window by window (ratio > 1: `label` better);
        `step` None: each lane on its own clock."""
        mine = {w.index: w for w in self.series(label)}
        ref = self.series(reference)
        out: dict[str, RatioInterval] = {}
        for name in FIGURES:
            ratios: list[float] = []
            skipped = 0
            for r in ref:
                w = mine.get(r.index)
                if r.cut or (w is not None and w.cut):
                    skipped += 1
                    continue
                a = r.figure(name, step, workers)
                b = w.figure(name, step, workers) if w is not None else None
                if a is None or b is None:
                    skipped += 1
                    continue
                num, den = (b, a) if name == "throughput" else (a, b)
                if den <= 0:
                    skipped += 1
                    continue
                ratios.append(num / den)
            out[name] = ratio_interval(ratios, skipped)
        return out
