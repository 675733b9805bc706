"""The lanes' clock from the measured steps: step-time windows, their fit, the per-worker step
models and barrier groups, and the clock the lanes step on.

`StepClock.observe(table)` takes what the live driver's request table gathered since the last
call — the streams' step ends, the worker-reported steps (with their step events, `events`), the
mirrored loads — leaves out the steps the streams refute (`StepCheck`), and, when a step-time
window is due, closes it (`StepEstimator` → `SlidingFit`, `WorkerClock`, `StepTally`) and sets the
lanes' clock (`apply(clock)`; the configured clock: only described). It answers what the report
says of the clock (`view`, `samples_from`, `fleet_model`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shadow.contracts.events import Step
from shadow.core.stepmodel import FitResult, SlidingFit, StepTimeModel
from shadow.engine.config import LaneClock
from shadow.engine.livetable import RequestTable
from shadow.live.stepcheck import StepCheck
from shadow.live.stepfit import StepEstimator
from shadow.live.steptally import StepTally
from shadow.live.workerclock import StepCounts, WorkerClock, WorkerModel


def step_period(ev: Step) -> float | None:
    """The engine's real step period of a step event: its own time since its previous step, else
    the probe's interval between busy steps; None when it has neither (`duration_s` of an engine
    probe is the engine's elapsed execute time, which leaves out the forward pass on vLLM's CPU
    executor: 70-90 % of the period, bench/vllm_step_period.py)."""
    for x in (ev.engine_interval_s, ev.interval_s):
        if x is not None and x > 0:
            return x
    return None


def step_counts(ev: Step) -> StepCounts | None:
    """What the engine scheduled into the step (`StepCounts`), from its probe's fields: the
    sequences it computed (decode + prefill requests; the running count after it from older
    probes) and its prefill tokens (0 when not reported), with the engine's cumulative wait for a
    CPU and time on one, and its step index; a DP rank's padding step computed none. None without a
    running count."""
    if ev.dummy:
        seqs, prefill = 0, 0
    elif ev.decode_requests is not None:
        seqs, prefill = ev.decode_requests + (ev.prefill_requests or 0), ev.prefill_tokens or 0
    elif ev.running is not None:
        seqs, prefill = ev.running, ev.prefill_tokens or 0
    else:
        return None
    return StepCounts(seqs, prefill, ev.engine_wait_s, ev.iteration, ev.engine_run_s)


class StepClock:
    """See module docstring. `workers`: how many; `step`: the configured model; `measured`: the
    lanes step on the measured clock (else on the configured model); `apply(clock)`: step the
    lanes on `clock` from now on."""

    def __init__(self, workers: int, step: StepTimeModel, *, measured: bool, source: str, window_s: float,
                 fit_window: int, apply: Callable[[LaneClock], None]) -> None:
        self.step = step
        self.measured = measured
        self._apply = apply
        self.events: list[Step] = []  # the applied step events, in the table's `steps` order
        self.estimator = StepEstimator(window_s=window_s, source=source)
        self.fit = SlidingFit(fit_window)
        # the lanes' clock: per-worker step models and barrier groups from the measured steps
        self.worker_clock = WorkerClock(workers, step, fit_window=fit_window)
        # worker-reported steps the mirror's streams (or the configured model) cannot vouch for
        self.check = StepCheck(workers, step)
        self.tally = StepTally(step)
        self.lane_clock, self.worker_models = self.worker_clock.clock(None)
        if measured:
            apply(self.lane_clock)
        self._x_sum = 0.0  # max mirrored load summed over the observations of the current window
        self._x_n = 0

    def closes(self, t: float) -> bool:
        """True when an observation at event time `t` closes the current step-time window."""
        return self.estimator.closes(t)

    def observe(self, table: RequestTable) -> bool:
        """Take the table's step observations; True when a step-time window closed (at `table.now`)."""
        est = self.estimator
        self._x_sum += max(table.mirror_loads)
        self._x_n += 1
        wc = self.worker_clock
        wc.add_loads(table.mirror_loads)
        ends, table.worker_gap_ends = table.worker_gap_ends, []
        if ends:  # before the steps: a step is judged on the streams seen up to and after it
            self.check.saw(ends)
            if est.source != "events":
                wc.add_ends(ends)
        if table.steps:
            events, self.events = self.events, []
            self._take_steps(table, events if len(events) == len(table.steps) else None)
            table.steps = []
        if not est.due(table.now):
            return False
        # the window's token gaps (they wait in the table until its end), converted once
        gaps = [np.asarray(xs, dtype=np.float64) for xs in table.take_gaps()]
        for part in gaps:
            est.add_gaps(part)
        if est.source != "events":
            wc.add_gaps(gaps[:-1])
        sample = est.close(table.now)
        x = self._x_sum / self._x_n
        self._x_sum, self._x_n = 0.0, 0
        self.tally.close_window(sample, est.sse_aside, x)
        if sample is not None:
            self.fit.add(x, sample[2])
        wc.close(self.lane_clock)
        self._set_clock()
        return True

    def _take_steps(self, table: RequestTable, events: list[Step] | None) -> None:
        """Worker-reported steps: the plausible ones (`StepCheck`) to the estimate and the clock,
        the others counted by reason. A step's measure is the engine's real step period when its
        event has one (`step_period`), else its duration; with the engine's counts (`events`, in
        the same order) it also feeds the cost fits."""
        check, wc, loads = self.check, self.worker_clock, table.mirror_loads
        to_clock = self.estimator.source != "sse"
        durations: list[float] = []
        for i, (g, t, duration, period, source) in enumerate(table.steps):
            if check.check(None if g < 0 else g, t, duration, period, loads) is not None:
                continue
            ev = events[i] if events is not None else None
            real = step_period(ev) if ev is not None else None
            durations.append(duration if real is None else real)
            if g >= 0 and to_clock:
                counts = step_counts(ev) if ev is not None and real is not None else None
                wc.add_step(g, t, period if real is None else real, source, counts, loads)
        self.estimator.add_steps(durations)
        self.tally.took(durations)

    def fleet_model(self) -> StepTimeModel | None:
        """Under a fleet-wide barrier: the fleet's fit when good, else its robust per-step mean
        over the recent windows (`StepEstimator.robust`)."""
        fit = self.fit.result()
        model = fit.model(self.step)
        if model is not self.step:
            return model
        robust = self.estimator.robust
        mean = robust.mean()
        return StepTimeModel(0.0, mean) if mean is not None and len(robust) >= 4 else None

    def _set_clock(self) -> None:
        """Step the lanes on the clock the measured steps give (see `shadow.live.workerclock`);
        with the configured clock, only describe it."""
        clock, self.worker_models = self.worker_clock.clock(self.fleet_model())
        if self.measured and clock != self.lane_clock:
            self.lane_clock = clock
            self._apply(clock)

    def measured_mean(self) -> float | None:
        """The mean step the fit's windows came from (events when any window had them, else SSE)."""
        return self.tally.measured_mean(bool(self.estimator.samples["events"]))

    def samples_from(self, step_sources: dict[str, int]) -> str | None:
        """Where the fit's samples came from, in words: the engine probe, step events, SSE gaps
        (`step_sources`: the step events by source)."""
        by = self.estimator.samples
        if by["events"]:
            src = max(step_sources, key=step_sources.__getitem__) if step_sources else ""
            what = {"probe": "the engine probe (the engine's own step times)",
                    "probe_interval": "the engine probe (intervals between busy steps)"}.get(
                        src, "step events")
            return what if not by["sse"] else f"{what} and SSE inter-chunk gaps"
        return "SSE inter-chunk gaps" if by["sse"] else None

    def view(self, workers: list[str]) -> tuple[str, str, FitResult, list[tuple[str, WorkerModel]]]:
        """The clock in use: its model in words, its samples' source (probe / sse / configured /
        events, '+' joined when workers differ), the fit it stands on (fleet-wide under one barrier;
        else the worst worker's), and the workers whose linear fit does not hold."""
        per = self.worker_models
        choice = self.worker_clock.choice
        fleet = self.fit.result()
        if not self.measured:
            return "fleet-wide barrier (--lane-clock configured)", "configured", fleet, []
        sources = sorted({m.source for m in per})
        if choice.groups is not None and len(choice.groups) == 1:
            return "fleet-wide barrier", "+".join(sorted(set(sources) - {"configured"}) or sources), fleet, []
        poor = [(workers[g], m) for g, m in enumerate(per)
                if m.fit.quality == "poor" and m.kind != "cost fit"]
        rank = {"poor": 0, "insufficient": 1, "good": 2}
        worst = min((m.fit for m in per), key=lambda f: (rank[f.quality], f.r2 if f.r2 is not None else -1.0))
        if choice.groups is None:
            what = "fleet-wide barrier (undecided: " + choice.reason + ")"
            return what, "+".join(sources), worst if any(m.kind != "configured" for m in per) else fleet, poor
        return choice.model, "+".join(sources), worst, poor
