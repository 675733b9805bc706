"""The lanes' clock from what the workers' steps measure: per worker a step model, and the barrier
groups they step in (`shadow.core.barrier`). Pure: event times come in as arguments.

Per worker and window: the step period from its worker-reported steps (the probe's interval
between busy steps, else the step's duration; only those `shadow.live.stepcheck` found plausible),
else from its streams' SSE gaps (one per token). Outliers do not count (`stepfit.RobustMean`: steps
beyond a multiple of the worker's reference step, and windows of them); the median of the rest,
paired with the worker's mean mirrored load, feeds a `SlidingFit` of τ_g = a_g·L_g + b_g. A
worker's model in the clock is that fit when it is good, else its robust mean step over the recent
windows (a = 0: the linear model does not hold, or too few samples for a fit yet; after
`min_windows` windows), else the configured model. Under a fleet-wide barrier the fleet's
own fit (a·max L + b) is the model, as in the paper; otherwise each group steps at the max over
its members' models.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shadow.core.barrier import MIN_STEPS, BarrierChoice, choose_barrier
from shadow.core.stepmodel import FitResult, SlidingFit, StepTimeModel
from shadow.engine.config import LaneClock
from shadow.live.stepfit import RobustMean, upper_median

SOURCE_NAMES = {"probe": "probe", "probe_interval": "probe"}  # step event source -> clock source


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """One worker's model in the clock: what it is, where its samples came from, its fit."""

    model: StepTimeModel
    kind: str  # "linear fit", "mean step", "configured"
    source: str  # "probe", "events", "sse", "configured"
    fit: FitResult
    mean_step_s: float | None
    steps: int


class _Worker:
    def __init__(self, fit_window: int, mean_windows: int, max_ends: int) -> None:
        self.fit = SlidingFit(fit_window)
        self.periods: list[float] = []  # worker-reported, this window
        self.gaps: list[npt.NDArray[np.float64]] = []  # SSE per-token gaps, this window (in parts)
        self.event_source: str | None = None
        self.robust = RobustMean(mean_windows)
        self.ends: dict[str, deque[float]] = {"events": deque(maxlen=max_ends), "sse": deque(maxlen=max_ends)}
        self.durations: dict[str, deque[float]] = {
            "events": deque(maxlen=max_ends), "sse": deque(maxlen=max_ends)}
        self.source: str | None = None  # where the last window's sample came from
        self.steps = 0


class WorkerClock:
    """See module docstring. `add_step`/`add_gaps` per observation, `add_loads` per look at the
    mirror, `close` per window; `clock()` is the LaneClock to step the lanes on and what it is."""

    def __init__(
        self,
        workers: int,
        configured: StepTimeModel,
        *,
        fit_window: int = 600,
        mean_windows: int = 120,
        min_gaps: int = 5,
        choose_every: int = 4,
        min_windows: int = 4,
        check_windows: int = 20,
    ) -> None:
        self.min_windows = min_windows  # windows before a worker's mean step is its clock
        self.n = workers
        self.configured = configured
        self.min_gaps = min_gaps
        max_ends = max(60, min(600, 40_000 // max(1, workers * workers)))
        self.w = [_Worker(fit_window, mean_windows, max_ends) for _ in range(workers)]
        self._load_sum = [0.0] * workers  # Σ mirrored load per worker, this window
        self._load_n = 0
        self.choose_every = choose_every
        self._closes = 0
        self.choice = BarrierChoice(None, {}, tuple(range(workers)), "no steps measured yet")
        # per window of the last `check_windows`: Σ steps·measured, Σ steps·the clock's prediction
        self.check: deque[tuple[float, float]] = deque(maxlen=check_windows)

    def add_step(self, g: int, t: float, period: float, source: str | None) -> None:
        """A worker-reported step of worker `g` ending at `t`, `period` seconds after the previous."""
        if not period > 0:
            return
        w = self.w[g]
        w.periods.append(period)
        w.event_source = SOURCE_NAMES.get(source or "", "events")
        w.ends["events"].append(t)
        w.durations["events"].append(period)

    def add_gaps(self, gaps: Sequence[npt.NDArray[np.float64]]) -> None:
        """Per worker, its streams' per-token gaps (`gaps[g]`, kept until the window closes: the
        caller gives them up; only positive ones count)."""
        for w, xs in zip(self.w, gaps, strict=True):
            if len(xs):
                w.gaps.append(xs)

    def add_ends(self, ends: Iterable[tuple[int, float, float]]) -> None:
        """(g, t, gap) once per step worker g made in its streams (`LiveDriver.worker_gap_ends`)."""
        ws = self.w
        for g, t, gap in ends:
            w = ws[g]
            w.ends["sse"].append(t)
            w.durations["sse"].append(gap)

    def add_loads(self, loads: Sequence[float]) -> None:
        """One look at the mirrored loads (per worker); a window's mean load is its x."""
        if len(loads) != self.n:
            raise ValueError(f"{len(loads)} loads for {self.n} workers")
        self._load_sum = list(map(operator.add, self._load_sum, loads))
        self._load_n += 1

    def close(self, clock: LaneClock) -> None:
        """End of a window: one sample per measured worker, checked against `clock` (the models
        the lanes stepped on in it)."""
        models = clock.models
        group_of = {g: grp for grp in clock.groups for g in grp}
        n = self._load_n
        xs_all = [x / n for x in self._load_sum] if n else [0.0] * self.n
        self._load_sum, self._load_n = [0.0] * self.n, 0
        measured = predicted = 0.0
        for g, w in enumerate(self.w):
            x = xs_all[g]
            periods, gaps = w.periods, w.gaps
            w.periods, w.gaps = [], []
            if periods:
                w.source = w.event_source
                xs = np.asarray(periods, dtype=np.float64)
            else:
                xs = np.concatenate(gaps) if gaps else np.zeros(0)
                xs = xs[xs > 0]
                if len(xs) < self.min_gaps:
                    continue
                w.source = "sse"
            xs = w.robust.add(xs)
            if not len(xs):
                continue  # outliers only
            k = len(xs)
            total = float(xs.sum())
            w.fit.add(x, upper_median(xs))
            w.steps += k
            if models is not None:
                measured += total
                predicted += k * max(models[h].worker_time(xs_all[h]) for h in group_of[g])
        if predicted > 0:
            self.check.append((measured, predicted))
        self._closes += 1
        if self._closes % self.choose_every == 0 or not self.choice.decided:
            self._choose()

    def _choose(self) -> None:
        ends: list[list[float]] = []
        durations: list[list[float]] = []
        for w in self.w:
            key = "events" if len(w.ends["events"]) >= MIN_STEPS else "sse"
            ends.append(list(w.ends[key]))
            durations.append(list(w.durations[key]))
        self.choice = choose_barrier(ends, durations)

    def worker_model(self, g: int) -> WorkerModel:
        w = self.w[g]
        fit = w.fit.result()
        steps = w.robust.steps()
        mean = w.robust.mean()
        source = w.source or "configured"
        if fit.quality == "good" and fit.a_s_per_token is not None and fit.b_s is not None:
            linear = StepTimeModel(fit.a_s_per_token, fit.b_s)
            return WorkerModel(linear, "linear fit", source, fit, mean, steps)
        if mean is not None and len(w.robust) >= self.min_windows:
            return WorkerModel(StepTimeModel(0.0, mean), "mean step", source, fit, mean, steps)
        return WorkerModel(self.configured, "configured", "configured", fit, mean, steps)

    def clock(self, fleet: StepTimeModel | None) -> tuple[LaneClock, list[WorkerModel]]:
        """The lanes' clock: the chosen groups with each worker's model; under one fleet-wide barrier
        `fleet` (the fleet's fitted or mean model; None: the workers' own) for every worker. Until
        the choice is made, one barrier (the configured fleet)."""
        per = [self.worker_model(g) for g in range(self.n)]
        groups = self.choice.groups
        if groups is None:
            groups = (tuple(range(self.n)),)
            if all(m.kind == "configured" for m in per):
                return LaneClock(groups, (self.configured,) * self.n), per
        if len(groups) == 1 and fleet is not None:
            return LaneClock(groups, (fleet,) * self.n), per
        return LaneClock(groups, tuple(m.model for m in per)), per

    def measured_vs_clock(self) -> float | None:
        """Σ measured / Σ what the clock predicted, per worker-step, over the recent windows."""
        predicted = sum(p for _, p in self.check)
        return sum(m for m, _ in self.check) / predicted if predicted > 0 else None

    def describe(self, names: Sequence[str], per: Sequence[WorkerModel]) -> dict[str, Any]:
        """The clock's part of the report's step model, per worker by name."""
        ch = self.choice
        return {
            "barrier": ch.model,
            "groups": None if ch.groups is None else [[names[g] for g in grp] for grp in ch.groups],
            "reason": ch.reason,
            "coincidence": {f"{names[i]}~{names[j]}": round(c, 3) for (i, j), c in ch.coincidence.items()},
            "workers": {
                names[g]: {
                    "model": m.kind,
                    "source": m.source,
                    "a_s_per_token": m.model.a,
                    "b_s": m.model.b,
                    "r2": m.fit.r2,
                    "fit_quality": m.fit.quality,
                    "samples": m.fit.samples,
                    "linear_model_holds": {"good": True, "poor": False}.get(m.fit.quality),
                    "mean_step_s": m.mean_step_s,
                    "steps": m.steps,
                }
                for g, m in enumerate(per)
            },
        }
