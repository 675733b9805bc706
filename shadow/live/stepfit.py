"""Measured decode step times: observations windowed into samples for the online fit
(`shadow.core.stepmodel.SlidingFit`). Pure: event times come in as arguments."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

SOURCES = ("auto", "events", "sse")
# Histogram buckets for measured step durations (s): 5 ms … 2 s.
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class StepEstimator:
    """Turns observations into step-time samples, one per window of event time:
    - `events`: durations reported by workers (`step` events), averaged over the window;
    - `sse`: inter-chunk gaps of streams, one sample per token (a running stream gets one token per
      decode step; a gap over k tokens gives k samples of gap / k). Per window: their mean (a delayed
      chunk makes one gap long and the next short, which the mean absorbs; it matches the workers'
      mean step time) and their median (robust to a stalled step; what the fit uses, so that one
      hiccup does not tilt it).
    Each sample is paired with the mirrored max_g L_g averaged over the window. `source="auto"` uses
    worker-reported steps when any arrived in the last window, else SSE gaps.
    """

    def __init__(self, *, window_s: float = 0.5, min_gaps: int = 5, source: str = "auto") -> None:
        if source not in SOURCES:
            raise ValueError(f"step source must be one of {list(SOURCES)}, got {source!r}")
        self.window_s = window_s
        self.min_gaps = min_gaps
        self.source = source
        self._gaps: list[npt.NDArray[np.float64]] = []  # this window's, in parts (as given)
        self._steps: list[float] = []
        self._window_end: float | None = None
        self.samples: dict[str, int] = {"events": 0, "sse": 0}
        self.sse_aside: float | None = None  # the last closed window's SSE mean step (see close)

    def add_gaps(self, gaps: npt.NDArray[np.float64]) -> None:
        """Per-token gaps (kept as given until the window closes: the caller gives them up)."""
        if len(gaps):
            self._gaps.append(gaps)

    def add_steps(self, durations: list[float]) -> None:
        self._steps.extend(durations)

    def due(self, t: float) -> bool:
        """True when event time `t` closes the current window."""
        if self._window_end is None:
            self._window_end = t + self.window_s
            return False
        return t >= self._window_end

    def close(self, t: float) -> tuple[str, float, float] | None:
        """Close the window at `t`: (source, mean step seconds, robust step seconds), or None."""
        self._window_end = t + self.window_s
        gaps, steps = self._gaps, self._steps
        self._gaps, self._steps = [], []
        # the SSE estimate of the same window, also when worker-reported steps are used (to check it)
        gap_arr = np.concatenate(gaps) if sum(map(len, gaps)) >= self.min_gaps else None
        self.sse_aside = None if gap_arr is None else float(gap_arr.mean())
        if self.source in ("auto", "events") and steps:
            self.samples["events"] += 1
            arr = np.asarray(steps)
            return "events", float(arr.mean()), float(np.median(arr))
        if self.source in ("auto", "sse") and gap_arr is not None:
            self.samples["sse"] += 1
            return "sse", float(gap_arr.mean()), float(np.median(gap_arr))
        return None
