"""The measured steps in figures: per-source histograms and means, the configured model's check,
and the SSE estimate against the worker-reported steps (what `/v1/report`'s `step_model` and
`step_histogram` give of them).

`StepTally` is told every worker-reported step taken (`took`) and every closed step-time window
(`close_window`); it keeps sums only (no samples)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shadow.core.stepmodel import StepTimeModel
from shadow.live.stepfit import STEP_BUCKETS


class StepTally:
    """See module docstring; `step`: the configured step model the measured steps are checked
    against."""

    def __init__(self, step: StepTimeModel) -> None:
        self.step = step
        self.hist: dict[str, list[int]] = {s: [0] * (len(STEP_BUCKETS) + 1) for s in ("events", "sse")}
        self.sum: dict[str, float] = {"events": 0.0, "sse": 0.0}
        self.count: dict[str, int] = {"events": 0, "sse": 0}
        # Σ w·measured, Σ w·configured-model step time over the windows, w = the steps a window
        # holds (its step count; window / mean for SSE): the same per-step mean the report gives
        self.model_check = [0.0, 0.0]
        self._window_steps = 0  # worker-reported steps in the current window
        self._both = [0.0, 0, 0.0]  # windows with both sources: Σ reported, steps, Σ SSE estimate (per step)
        self._inv_sum = 0.0  # Σ 1/T over SSE windows: their step-weighted mean is count / Σ 1/T

    def add(self, source: str, x: float) -> None:
        """One step time of `source` (events / sse) to its histogram and mean."""
        h = self.hist[source]
        i = 0
        while i < len(STEP_BUCKETS) and x > STEP_BUCKETS[i]:
            i += 1
        h[i] += 1
        self.sum[source] += x
        self.count[source] += 1

    def took(self, durations: Sequence[float]) -> None:
        """Worker-reported steps the estimate took (in the current window)."""
        self._window_steps += len(durations)
        for x in durations:
            self.add("events", x)

    def close_window(self, sample: tuple[str, float, float] | None, sse_aside: float | None,
                     x: float) -> None:
        """A step-time window closed with `sample` (source, mean step, robust step; None: too few
        steps), the SSE estimate beside worker-reported steps (`sse_aside`) and the window's mean
        max load `x`."""
        steps, self._window_steps = self._window_steps, 0
        if sample is not None and sample[0] == "events" and sse_aside is not None:
            # the same window both ways: worker-reported (probe) steps and SSE gaps, per step
            self._both[0] += sample[1] * steps
            self._both[1] += steps
            self._both[2] += steps * sse_aside
        if sample is not None:
            source, mean_step, _ = sample
            if source == "sse":
                self.add("sse", mean_step)
                self._inv_sum += 1.0 / mean_step
            w = steps if source == "events" else 1.0 / mean_step
            self.model_check[0] += w * mean_step
            self.model_check[1] += w * self.step.step_time(x)

    def means(self) -> dict[str, float | None]:
        """Mean step time per source: worker-reported steps averaged; SSE windows (equal length,
        one median each) weighted by the steps they hold (harmonic mean)."""
        n = self.count["events"]
        return {"events": self.sum["events"] / n if n else None,
                "sse": self.count["sse"] / self._inv_sum if self._inv_sum > 0 else None}

    def measured_mean(self, from_events: bool) -> float | None:
        """The mean the fit's windows came from (`from_events`: any window had worker-reported
        steps; else SSE)."""
        means = self.means()
        return means["events"] if from_events else means["sse"]

    def sse_check(self) -> dict[str, Any]:
        """The SSE-gap estimate against the worker-reported (probe) steps of the same windows:
        trusted within 10 %; otherwise, or without reported steps to check it, the reason."""
        reported, steps, sse = self._both
        if not steps:
            return {"trusted": None, "reason": "no worker-reported steps beside SSE gaps to check them "
                    "against (a merged chunk counts as one step)"}
        ratio = sse / reported if reported > 0 else None
        out: dict[str, Any] = {"sse_mean_s": sse / steps, "reported_mean_s": reported / steps,
                               "ratio": ratio, "steps": steps}
        if ratio is not None and abs(ratio - 1.0) <= 0.10:
            return {**out, "trusted": True, "reason": "within 10 % of the reported steps"}
        why = ("SSE gaps are longer than the engine's steps: the engine merges several tokens into "
               "one chunk when the HTTP side lags, and the streams' pauses are not steps"
               if ratio is not None and ratio > 1 else
               "SSE gaps are shorter than the engine's reported steps (the reported time covers more "
               "than the gap between two chunks)")
        return {**out, "trusted": False, "reason": f"{why}: {100 * ((ratio or 0) - 1):+.0f}% off"}
