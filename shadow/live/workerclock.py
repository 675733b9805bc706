"""The lanes' clock from what the workers' steps measure: per barrier group a step-cost model, and
the groups they step in (`shadow.core.barrier`). Pure: event times come in as arguments.

Engine probe steps that carry what the engine scheduled (running sequences n, prefill tokens P) and
a real step period (the engine's own time since its previous step, else the probe's interval between
busy steps: never the engine's elapsed execute time, which leaves out the forward pass on vLLM's
CPU executor) feed a `shadow.core.stepcost.StepCostFit` per worker, and one per barrier group of
several workers (a group steps at the max over its members: its samples are its members' steps
against the max over the members of n, P and L, a member's n and P as of its latest step while it
stepped within two periods, its mirrored load L always; with each step the engine's wait for a CPU
since the member's previous step, `host_wait`). Per worker, the model in the clock is its group's
(else its own) chosen cost model × its clock factor (`CostFit.clock_model`: the engine's cost fitted
on its work, times the most recent windows' periods over what it predicts for them; the fit of the
period itself where the probe measures no wait), "cost fit"; without one yet (or with SSE gaps only, which
keep today's estimator): the per-worker linear fit τ_g = a_g·L_g + b_g of the windows' figures
(`stepfit.RobustMean`: the median of reported periods, the mean of SSE gaps) against the mean
mirrored load when it is good, "linear fit"; else its robust mean step over the recent
windows, "mean step" (after `min_windows` windows); else the configured model. Outliers do not
count (`stepfit.RobustMean`: steps beyond a multiple of the worker's reference step, and windows of
them; SSE windows whole). Under a fleet-wide barrier the fleet's cost model (else the caller's fleet
model) is every worker's; otherwise each group steps at the max over its members' models.
"""

from __future__ import annotations

import heapq
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shadow.core.barrier import MIN_STEPS, BarrierChoice, choose_barrier
from shadow.core.hostfactor import LEVEL_WINDOWS
from shadow.core.stepcost import WINDOW_STEPS, CostFit, StepCostFit
from shadow.core.stepmodel import FIT_WINDOW, FitResult, SlidingFit, StepTimeModel
from shadow.engine.config import LaneClock
from shadow.live.stepfit import MEAN_WINDOWS, MIN_GAPS, RobustMean, upper_median

SOURCE_NAMES = {"probe": "probe", "probe_interval": "probe"}  # step event source -> clock source
#: The most worker pairs whose step-end coincidence the report lists (every pair of 16 workers).
REPORTED_PAIRS = 120


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """One worker's model in the clock: what it is, where its samples came from, its fit."""

    model: StepTimeModel
    kind: str  # "cost fit", "linear fit", "mean step", "configured"
    source: str  # "probe", "events", "sse", "configured"
    fit: FitResult
    mean_step_s: float | None
    steps: int
    cost: CostFit | None = None  # the cost fit of its group (of it alone when not in one)
    group: tuple[int, ...] = ()  # the workers that cost fit is of
    # of a cost fit: the cost model it fitted (the engine's own cost where the probe measures the
    # engine's wait for a CPU: what routing balances) and the clock factor `model` is it times
    engine: StepTimeModel | None = None
    factor: float | None = None


@dataclass(frozen=True, slots=True)
class StepCounts:
    """What an engine scheduled into one step (its probe's counts): the sequences it computed and
    the prefill tokens among its tokens."""

    seqs: int
    prefill_tokens: int
    wait_s: float | None = None  # the engine's cumulative wait for a CPU at the step (its probe's)
    iteration: int | None = None  # the engine's step index (its probe's)
    run_s: float | None = None  # the engine's cumulative time on a CPU at the step (its probe's)


def host_wait(prev: tuple[float, float, StepCounts] | None, t: float, period: float,
              counts: StepCounts) -> tuple[float, float] | None:
    """(seconds the engine waited for a CPU, seconds of its time they are of) from its previous
    counted step `prev` (t, period, counts) to this one at `t`: the difference of its cumulative
    wait, over the difference of the probe's record times, or of the engine's run + wait where that
    is longer (a thread is never on a CPU and waiting longer than the time that passed: the record
    time was taken apart from the read); when both steps carry the wait and the engine stepped
    throughout (consecutive iterations, or, without them, within two periods: not an idle gap,
    where it slept and did not wait); None otherwise."""
    if prev is None:
        return None
    t0, p0, c0 = prev
    if counts.wait_s is None or c0.wait_s is None:
        return None
    wait, span = counts.wait_s - c0.wait_s, t - t0
    if wait < 0 or span < 0:
        return None
    if counts.iteration is not None and c0.iteration is not None:
        stepped = counts.iteration == c0.iteration + 1
    else:
        stepped = span <= 2 * max(period, p0)
    if counts.run_s is not None and c0.run_s is not None and counts.run_s >= c0.run_s:
        span = max(span, counts.run_s - c0.run_s + wait)
    return (wait, span) if stepped else None


class _Worker:
    def __init__(self, fit_window: int, mean_windows: int, max_ends: int, window_steps: int) -> None:
        self.fit = SlidingFit(fit_window)
        self.cost = StepCostFit(window_steps)
        self.last: tuple[float, float, StepCounts] | None = None  # (t, period, counts) of its latest step
        self.window_counts = [0.0, 0.0, 0]  # Σ seqs, Σ prefill tokens, steps with counts, this window
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
        fit_window: int = FIT_WINDOW,
        mean_windows: int = MEAN_WINDOWS,
        min_gaps: int = MIN_GAPS,
        choose_every: int = 4,
        min_windows: int = 4,
        check_windows: int = 20,
        window_steps: int = WINDOW_STEPS,
    ) -> None:
        self.min_windows = min_windows  # windows before a worker's mean step is its clock
        self.n = workers
        self.configured = configured
        self.min_gaps = min_gaps
        self.window_steps = window_steps
        max_ends = max(60, min(600, 40_000 // max(1, workers * workers)))
        self.w = [_Worker(fit_window, mean_windows, max_ends, window_steps) for _ in range(workers)]
        # the cost fit of each barrier group of several workers (per the current choice)
        self.group_cost: dict[tuple[int, ...], StepCostFit] = {}
        self._load_sum = [0.0] * workers  # Σ mirrored load per worker, this window
        self._load_n = 0
        self.choose_every = choose_every
        self._closes = 0
        self.choice = BarrierChoice(None, {}, tuple(range(workers)), "no steps measured yet")
        # per window of the last `check_windows`: Σ steps·measured, Σ steps·the clock's prediction
        self.check: deque[tuple[float, float]] = deque(maxlen=check_windows)

    def add_step(self, g: int, t: float, period: float, source: str | None,
                 counts: StepCounts | None = None, loads: Sequence[float] | None = None) -> None:
        """A worker-reported step of worker `g` ending at `t`, `period` seconds after the previous
        (the engine's real step period when `counts` are given: what it scheduled into the step,
        which with the mirrored `loads` per worker feed the cost fits)."""
        if not period > 0:
            return
        w = self.w[g]
        w.periods.append(period)
        w.event_source = SOURCE_NAMES.get(source or "", "events")
        w.ends["events"].append(t)
        w.durations["events"].append(period)
        if counts is None or loads is None:
            return
        wait, span = host_wait(w.last, t, period, counts) or (None, None)
        w.last = (t, period, counts)
        wc = w.window_counts
        wc[0] += counts.seqs
        wc[1] += counts.prefill_tokens
        wc[2] += 1
        w.cost.add(period, counts.seqs, loads[g], counts.prefill_tokens, wait, span)
        for group, fit in self.group_cost.items():
            if g in group:
                seqs, prefill = 0, 0
                for h in group:
                    last = self.w[h].last
                    if last is not None and t - last[0] <= 2 * max(period, last[1]):
                        seqs = max(seqs, last[2].seqs)
                        prefill = max(prefill, last[2].prefill_tokens)
                load = max(loads[h] for h in group)
                fit.add(period, seqs, load, prefill, wait, span, member=group.index(g))

    def add_gaps(self, gaps: Sequence[npt.NDArray[np.float64]]) -> None:
        """Per worker, its streams' per-token gaps (`gaps[g]`, kept until the window closes: the
        caller gives them up; negative ones do not count)."""
        for w, xs in zip(self.w, gaps, strict=True):
            if len(xs):
                w.gaps.append(xs)

    def add_ends(self, ends: Iterable[tuple[int, float, float]]) -> None:
        """(g, t, gap) once per step worker g made in its streams (`RequestTable.worker_gap_ends`)."""
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
        group_step: dict[tuple[int, ...], float] = {}  # the step each barrier group's models predict
        n = self._load_n
        xs_all = [x / n for x in self._load_sum] if n else [0.0] * self.n
        self._load_sum, self._load_n = [0.0] * self.n, 0
        measured = predicted = 0.0
        counts: list[tuple[float, float]] = []  # mean seqs, prefill tokens per step, this window
        for w in self.w:
            ns, ps, k = w.window_counts
            counts.append((ns / k, ps / k) if k else (0.0, 0.0))
            w.window_counts = [0.0, 0.0, 0]
        for g, w in enumerate(self.w):
            x = xs_all[g]
            periods, gaps = w.periods, w.gaps
            w.periods, w.gaps = [], []
            if periods:
                w.source = w.event_source
                xs = np.asarray(periods, dtype=np.float64)
            else:
                xs = np.concatenate(gaps) if gaps else np.zeros(0)
                xs = xs[xs >= 0]
                if len(xs) < self.min_gaps:
                    continue
                w.source = "sse"
            # the check takes a worker's reported periods whole (the engine's own: a long step is
            # as real as a short one, and the cost model predicts their mean), SSE gaps robustly;
            # the fit a window's figure (`RobustMean`: SSE gaps judged as a whole window, their mean)
            raw = xs if periods else None
            whole = not periods
            xs = w.robust.add(xs, whole=whole)
            if not len(xs):
                continue  # outliers only
            w.fit.add(x, float(xs.mean()) if whole else upper_median(xs))
            w.steps += len(xs)
            checked = xs if raw is None else raw
            if models is not None:
                grp = group_of[g]
                step = group_step.get(grp)
                if step is None:  # (once per group and window: a fleet-wide group is every worker)
                    step = group_step[grp] = max(models[h].worker_time(xs_all[h], *counts[h]) for h in grp)
                measured += float(checked.sum())
                predicted += len(checked) * step
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
        groups = [grp for grp in self.choice.groups or () if len(grp) > 1]
        self.group_cost = {grp: self.group_cost.get(grp) or StepCostFit(self.window_steps * len(grp))
                           for grp in groups}

    def cost_fits(self) -> list[tuple[tuple[int, ...], CostFit]]:
        """The cost fit of every barrier group (per worker where workers share no barrier; every
        worker until the groups are decided) that has taken steps, with its workers."""
        fits = [(grp, fit) for grp, fit in self.group_cost.items()]
        grouped = {g for grp in self.group_cost for g in grp}
        fits += [((g,), self.w[g].cost) for g in range(self.n) if g not in grouped]
        return sorted((grp, fit.result()) for grp, fit in fits if fit.taken)

    def worker_model(self, g: int) -> WorkerModel:
        w = self.w[g]
        fit = w.fit.result()
        steps = w.robust.steps()
        mean = w.robust.mean()
        source = w.source or "configured"
        group = next((grp for grp in self.group_cost if g in grp), (g,))
        cost = self.group_cost[group].result() if len(group) > 1 else w.cost.result()
        clock = cost.clock_model
        if clock is not None:  # fitted on the steps a worker reported with its counts: their source,
            # not the last window's (one without reported steps takes its figure from SSE gaps)
            return WorkerModel(clock, "cost fit", w.event_source or source, fit, mean, steps, cost, group,
                               cost.model,
                               cost.clock_factor if cost.basis == "engine" else None)
        if fit.quality == "good" and fit.a_s_per_token is not None and fit.b_s is not None:
            linear = StepTimeModel(fit.a_s_per_token, fit.b_s)
            return WorkerModel(linear, "linear fit", source, fit, mean, steps, cost, group)
        if mean is not None and len(w.robust) >= self.min_windows:
            return WorkerModel(StepTimeModel(0.0, mean), "mean step", source, fit, mean, steps, cost, group)
        return WorkerModel(self.configured, "configured", "configured", fit, mean, steps, cost, group)

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
        if len(groups) == 1 and per[0].kind == "cost fit" and len(per[0].group) == self.n:
            return LaneClock(groups, (per[0].model,) * self.n), per
        if len(groups) == 1 and fleet is not None:
            return LaneClock(groups, (fleet,) * self.n), per
        return LaneClock(groups, tuple(m.model for m in per)), per

    def measured_vs_clock(self) -> float | None:
        """Σ measured / Σ what the clock predicted, per worker-step, over the recent windows (every
        worker-reported period; of SSE gaps, those `RobustMean` keeps)."""
        predicted = sum(p for _, p in self.check)
        return sum(m for m, _ in self.check) / predicted if predicted > 0 else None

    def describe(self, names: Sequence[str], per: Sequence[WorkerModel]) -> dict[str, Any]:
        """The clock's part of the report's step model, per worker by name. `coincidence`: every
        pair's while there are at most `REPORTED_PAIRS` pairs (16 workers), else the `REPORTED_PAIRS`
        least coincident ones (the pairs nearest to splitting a group); `pairs`: how many pairs
        were measured."""
        ch = self.choice
        pairs: Iterable[tuple[tuple[int, int], float]] = ch.coincidence.items()
        if len(ch.coincidence) > REPORTED_PAIRS:
            pairs = heapq.nsmallest(REPORTED_PAIRS, pairs, key=operator.itemgetter(1))
        return {
            "barrier": ch.model,
            "groups": None if ch.groups is None else [[names[g] for g in grp] for grp in ch.groups],
            "reason": ch.reason,
            "coincidence": {f"{names[i]}~{names[j]}": round(c, 3) for (i, j), c in pairs},
            "pairs": len(ch.coincidence),
            "workers": {
                names[g]: {
                    "model": m.kind,
                    "source": m.source,
                    "a_s_per_token": m.model.a,
                    "b_s": m.model.b,
                    "c_s_per_seq": m.model.c,
                    "p_s_per_token": m.model.p,
                    # of a cost fit: the engine's cost the model above is `clock_factor` times
                    "engine_model": None if m.engine is None else model_terms(m.engine),
                    "clock_factor": m.factor,
                    # the barrier group whose step-cost fit is its model ("cost fit")
                    "cost_group": group_name(names, m.group) if m.group else None,
                    # of the linear fit a_g·L_g + b_g (the paper's form, per worker)
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


#: What the estimator without an engine's counts (SSE token gaps, or steps of a probe that sends
#: none, beside the mirrored load) cannot tell apart.
COUNTLESS_UNIDENTIFIED = {
    "c": "per-sequence cost: without the engine's counts a step is fitted against the mirrored KV load "
         "only (a·L + b); with one stream running n = 1 while L grows with it, so a per-sequence and a "
         "per-token cost are confounded",
    "p": "per-prefill-token cost: a step holding a prefill chunk shows only as one longer gap of the "
         "streams decoding beside it; the prefill tokens in it are not seen",
}


def model_terms(m: StepTimeModel) -> dict[str, float]:
    """A step model's terms as the report writes them."""
    return {"a_s_per_token": m.a, "b_s": m.b, "c_s_per_seq": m.c, "p_s_per_token": m.p}


def describe_cost(fit: CostFit) -> dict[str, Any]:
    """One cost fit as the report gives it: what it fitted (`basis`: the engine's work per step, or
    the period without the engine's wait) and in one sentence how the period splits (`split`); the
    chosen form with each term and its 95 % interval, R² and out-of-sample error on its window
    means, the windows it stands on, what the data cannot identify, and every candidate's error;
    the host factor (measured: recent, median and 10th-90th percentiles of the windows, whether it
    moved, the wait's share of the period) and how well the model × the host factor predicted the
    window periods one window ahead (`period_error`)."""
    ch = fit.chosen
    host = fit.host if fit.basis == "engine" else None
    return {
        "basis": fit.basis,
        "basis_reason": fit.basis_reason,
        "split": split_text(fit),
        "form": ch.label if ch is not None else None,
        "terms": {t: {"value": v.value, "low": v.low, "high": v.high} for t, v in ch.terms.items()}
        if ch is not None else {},
        "r2": ch.r2 if ch is not None else None,
        "oos_error": ch.oos_error if ch is not None else None,
        "best_form": fit.best,
        "reason": fit.reason,
        "windows": fit.windows,
        "window_steps": fit.window_steps,
        "steps": fit.steps,
        "outliers": fit.outliers,
        "mean_step_s": fit.mean_s,
        "window_cv": fit.window_cv,
        "residual_cv": fit.residual_cv,
        "driver": fit.driver,
        "host_wait_share": fit.host_wait_share,
        "host_factor": None if host is None else {
            "recent": host.recent, "recent_windows": host.recent_windows, "median": host.median,
            "low": host.low, "high": host.high, "windows": host.windows, "level": host.level,
            "level_windows": LEVEL_WINDOWS, "moved": host.moved},
        # what the lanes multiply the model by: the recent periods over the model's prediction
        "clock_factor": fit.clock_factor if fit.basis == "engine" else None,
        "period_error": fit.period_error,
        "period_windows": fit.period_windows,
        "not_identified": dict(fit.not_identified),
        "forms": {f.label: {"oos_error": f.oos_error, "r2": f.r2, "out": f.why_not} for f in fit.forms},
    }


def split_text(fit: CostFit) -> str:
    """Which part of the period is the engine's (fitted) and which the host's (measured), in words."""
    form = fit.chosen.label if fit.chosen is not None else "no form chosen yet"
    h, f = fit.host, fit.clock_factor
    if fit.basis != "engine" or h is None or f is None:
        return f"period = {form} (fitted on {fit.basis_reason or 'the step period'})"
    return (f"period = engine cost ({form}, fitted on the engine's work per step) × clock factor "
            f"{f:.2f} (measured over the last {h.recent_windows} windows: the host's wait for a CPU × "
            f"{h.recent:.2f}, {h.wait_share:.0%} of the period over the fit's windows; the engine's work "
            f"against its cost × {f / h.recent:.2f})")


def group_name(names: Sequence[str], group: Sequence[int]) -> str:
    """A barrier group's name: its workers' names joined by '+'."""
    return "+".join(names[g] for g in group)


def describe_costs(names: Sequence[str], fits: Sequence[tuple[tuple[int, ...], CostFit]]) -> dict[str, Any]:
    """Every fed cost fit by its group's name (`describe_cost`)."""
    return {group_name(names, grp): describe_cost(fit) for grp, fit in fits}
