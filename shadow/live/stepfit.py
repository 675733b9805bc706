"""Measured decode step times: observations windowed into samples for the online fit
(`shadow.core.stepmodel.SlidingFit`), and their outlier-proof running mean (`RobustMean`). Pure:
event times come in as arguments."""

from __future__ import annotations

from collections import deque

import numpy as np
import numpy.typing as npt

SOURCES = ("auto", "events", "sse")
DEFAULT_SOURCE = "auto"  # (`--step-source`'s default)
WINDOW_S = 0.5  # event time one step-time sample covers (`--step-window`'s default)
# Histogram buckets for measured step durations (s): 5 ms … 2 s.
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
CLAMP = 4.0  # steps beyond this multiple of the reference step are outliers (`RobustMean`)
MEAN_WINDOWS = 120  # windows a running mean step covers
MIN_GAPS = 5  # token gaps a window needs to be a step-time sample


def upper_median(xs: npt.NDArray[np.float64]) -> float:
    """The upper median of a non-empty array (one of its values)."""
    k = len(xs)
    return float(np.partition(xs, k // 2)[k // 2])


class RobustMean:
    """A step time's mean over the last `windows` windows, which outliers cannot move.

    Each window has a figure: the (upper) median of its steps, or for a window judged `whole` the
    mean of all of them. The reference is the (lower) median of the recent windows' figures (before
    any, the window's own). A window keeps only its steps up to `clamp` × the reference (a whole
    window: all of them, or none when its mean is beyond that), and a window whose figure is beyond
    `clamp` × the reference when the mean is read is left out: steps beyond the clamp change
    nothing, whether a minority of a window's or whole windows that are a minority of the recent
    ones. The reference moves once most of the recent windows agree (a lasting change of the
    engine); once bad input stops, its windows drop out as the reference comes back, and at the
    latest when they leave the history.

    Whole windows are for SSE gaps: a stream's chunks held up on their way (a stalled host, a
    worker catching up on its timeline, a relay that fell behind) arrive together, one gap long and
    the next ones near zero. The time is all there, so the window's mean is right, while its median
    (and a clamp that drops the long gap but keeps the short ones) comes out low.
    """

    def __init__(self, windows: int = MEAN_WINDOWS, clamp: float = CLAMP) -> None:
        if windows < 1 or not clamp > 1:
            raise ValueError("a robust mean needs >= 1 window and a clamp > 1")
        self.clamp = clamp
        self.history: deque[tuple[int, float, float]] = deque(maxlen=windows)  # (kept, Σ kept, figure)

    def __len__(self) -> int:
        return len(self.history)

    def reference(self) -> float | None:
        """The lower median of the recent windows' figures (None before any window): of two
        windows, a bad one is not half of it."""
        h = self.history
        if not h:
            return None
        k = (len(h) - 1) // 2
        return float(np.partition(np.fromiter((m for _, _, m in h), np.float64, len(h)), k)[k])

    def add(self, xs: npt.NDArray[np.float64], *, whole: bool = False) -> npt.NDArray[np.float64]:
        """One window's (non-negative) steps; returns those it keeps (see the class: `whole`). A
        whole window of zero gaps carries no time: none of it is kept and it is not a figure."""
        if not len(xs):
            return xs
        figure = float(xs.mean()) if whole else upper_median(xs)
        if not figure > 0:
            return xs[:0]
        ref = self.reference()
        limit = self.clamp * (figure if ref is None else ref)
        if whole:
            kept = xs if figure <= limit else xs[:0]
        else:
            kept = xs[xs <= limit]
        self.history.append((len(kept), float(kept.sum()), figure))
        return kept

    def steps(self) -> int:
        """The steps the mean stands on."""
        limit = self.clamp * (self.reference() or 0.0)
        return sum(k for k, _, m in self.history if m <= limit)

    def mean(self) -> float | None:
        """Σ kept steps / their count over the windows whose figure is within the clamp."""
        limit = self.clamp * (self.reference() or 0.0)
        n, total = 0, 0.0
        for k, s, m in self.history:
            if m <= limit:
                n += k
                total += s
        return total / n if n else None


class StepEstimator:
    """Turns observations into step-time samples, one per window of event time:
    - `events`: durations reported by workers (`step` events). The window's figure is the median of
      the steps `robust` (a `RobustMean` over the windows) keeps: a reported step is a step, so a
      hiccup is one value among the window's and tilts nothing;
    - `sse`: inter-chunk gaps of streams, one sample per token (a running stream gets one token per
      decode step; a gap over k tokens gives k samples of gap / k). The window's figure is their
      mean, judged as a whole by `robust`: chunks held up on the way arrive together (one gap long,
      the next ones near zero), which moves no time out of the window, so only the mean stays right
      (measured in tests/live/test_live_fleet.py with its fleet stopped 0.2-0.7 s every 1-3 s, 21
      times: a fit on window medians came out -25 % in a and +31 % in b, on window means -0.2 % and
      +2.0 %).
    The figure is what the fit takes; the window's plain mean is reported beside it (the measured
    mean step). Each sample is paired with the mirrored max_g L_g averaged over the window.
    `source="auto"` uses worker-reported steps when any arrived in the last window, else SSE gaps.
    """

    def __init__(
        self, *, window_s: float = WINDOW_S, min_gaps: int = MIN_GAPS, source: str = DEFAULT_SOURCE
    ) -> None:
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
        self.robust = RobustMean()

    def add_gaps(self, gaps: npt.NDArray[np.float64]) -> None:
        """Per-token gaps (kept as given until the window closes: the caller gives them up)."""
        if len(gaps):
            self._gaps.append(gaps)

    def add_steps(self, durations: list[float]) -> None:
        self._steps.extend(durations)

    def closes(self, t: float) -> bool:
        """`due(t)` without opening a window: True when event time `t` would close the current one."""
        return self._window_end is not None and t >= self._window_end

    def due(self, t: float) -> bool:
        """True when event time `t` closes the current window."""
        if self._window_end is None:
            self._window_end = t + self.window_s
            return False
        return t >= self._window_end

    def close(self, t: float) -> tuple[str, float, float] | None:
        """Close the window at `t`: (source, mean step seconds, the window's figure in seconds: what
        the fit takes), or None (no steps, or only outliers)."""
        self._window_end = t + self.window_s
        gaps, steps = self._gaps, self._steps
        self._gaps, self._steps = [], []
        # the SSE estimate of the same window, also when worker-reported steps are used (to check it)
        gap_arr = np.concatenate(gaps) if sum(map(len, gaps)) >= self.min_gaps else None
        self.sse_aside = None if gap_arr is None else float(gap_arr.mean())
        if self.source in ("auto", "events") and steps:
            source, arr = "events", np.asarray(steps, dtype=np.float64)
        elif self.source in ("auto", "sse") and gap_arr is not None:
            source, arr = "sse", gap_arr
        else:
            return None
        whole = source == "sse"
        kept = self.robust.add(arr[arr >= 0] if whole else arr[arr > 0], whole=whole)
        if not len(kept):
            return None
        self.samples[source] += 1
        return source, float(arr.mean()), float(kept.mean() if whole else np.median(kept))
