"""Measured decode step times and the online fit T = a·max_g L_g + b.

`StepEstimator` turns observations into step-time samples, one per window of event time:
- `events`: durations reported by workers (`step` events), averaged over the window;
- `sse`: inter-chunk gaps of streams, one sample per token (a running stream gets one token per
  decode step; a gap over k tokens gives k samples of gap / k). Per window: their mean (a delayed
  chunk makes one gap long and the next short, which the mean absorbs; it matches the workers'
  mean step time) and their median (robust to a stalled step; what the fit uses, so that one
  hiccup does not tilt it).
Each sample is paired with the mirrored max_g L_g averaged over the window. `source="auto"` uses
worker-reported steps when any arrived in the last window, else SSE gaps.

`SlidingFit`: least squares over the last `size` samples, with R²; `quality` says "good" only
with enough samples, a load range that identifies the slope, and R² >= `min_r2`.
Pure: event times come in as arguments.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

SOURCES = ("auto", "events", "sse")
# Histogram buckets for measured step durations (s): 5 ms … 2 s.
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


@dataclass(frozen=True, slots=True)
class FitResult:
    a_s_per_token: float | None
    b_s: float | None
    r2: float | None
    samples: int
    quality: str  # "good", "poor" (R² low or load range too narrow), "insufficient" (too few samples)
    x_min: float | None = None
    x_max: float | None = None


class SlidingFit:
    """Least squares of step time on max load over the most recent `size` samples."""

    def __init__(self, size: int = 600, *, min_samples: int = 20, min_r2: float = 0.9) -> None:
        self.xs: deque[float] = deque(maxlen=size)
        self.ys: deque[float] = deque(maxlen=size)
        self.min_samples = min_samples
        self.min_r2 = min_r2

    def add(self, max_load: float, step_s: float) -> None:
        if math.isfinite(max_load) and math.isfinite(step_s) and max_load >= 0 and step_s > 0:
            self.xs.append(max_load)
            self.ys.append(step_s)

    def result(self) -> FitResult:
        n = len(self.xs)
        if n < 2:
            return FitResult(None, None, None, n, "insufficient")
        x = np.asarray(self.xs)
        y = np.asarray(self.ys)
        xm, ym = float(x.mean()), float(y.mean())
        vx = float(((x - xm) ** 2).sum())
        vy = float(((y - ym) ** 2).sum())
        lo, hi = float(x.min()), float(x.max())
        if vx <= 1e-12 * max(1.0, float((x * x).sum())):
            return FitResult(None, None, None, n, "poor" if n >= self.min_samples else "insufficient", lo, hi)
        cov = float(((x - xm) * (y - ym)).sum())
        a = cov / vx
        b = ym - a * xm
        r2 = cov * cov / (vx * vy) if vy > 0 else 1.0
        if n < self.min_samples:
            quality = "insufficient"
        elif r2 < self.min_r2 or a <= 0 or b < 0:
            quality = "poor"
        else:
            quality = "good"
        return FitResult(a, b, max(0.0, min(1.0, r2)), n, quality, lo, hi)


class StepEstimator:
    """Windows observations into step-time samples; see module docstring."""

    def __init__(self, *, window_s: float = 0.5, min_gaps: int = 5, source: str = "auto") -> None:
        if source not in SOURCES:
            raise ValueError(f"step source must be one of {list(SOURCES)}, got {source!r}")
        self.window_s = window_s
        self.min_gaps = min_gaps
        self.source = source
        self._gaps: list[float] = []
        self._steps: list[float] = []
        self._window_end: float | None = None
        self.samples: dict[str, int] = {"events": 0, "sse": 0}

    def add_gaps(self, gaps: list[float]) -> None:
        self._gaps.extend(gaps)

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
        if self.source in ("auto", "events") and steps:
            self.samples["events"] += 1
            arr = np.asarray(steps)
            return "events", float(arr.mean()), float(np.median(arr))
        if self.source in ("auto", "sse") and len(gaps) >= self.min_gaps:
            self.samples["sse"] += 1
            arr = np.asarray(gaps)
            return "sse", float(arr.mean()), float(np.median(arr))
        return None
