"""What the host adds to an engine's step: its work, the host factor, and how well the two predict
the period. Pure.

A step's period (the engine's time from one step to the next) is the engine's own work plus the
time its main thread waited, runnable, for a CPU (Linux schedstat, sent by the engine probe): the
host's doing, not the load's. Over a window of consecutive steps, with `wait` seconds waited over
`span` seconds of the engine's time (the differences of its cumulative wait and of the probe's record
times between the window's first and last steps, or of its run + wait where longer:
`shadow.live.workerclock.host_wait`), the host took the share s = wait / span of the time and the
engine's work is

    work = period × (1 − s)

(the period less the wait, measured as a share: the probe reads the counters at its record times,
which follow the engine's steps by a jittery lag; the share over the same records is exact whatever
the lag, where a difference of counters and periods is off by the lag's jitter × the wait rate).
Of a barrier group, s is its members' largest: the member the host held back longest is the one the
others waited for. The host factor of a window is h = period / work (≥ 1; 1: no wait).

`host_factor` summarises it over windows: the recent factor (Σ period / Σ work over the most recent
`recent` windows: it follows a host that changes within a run, e.g. CPU burners starting), the spread
of the per-window factors, and the wait's share of the period. `recent_factor` is the same ratio of
any two series (the step cost's clock factor: the periods over what a model predicts for them)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

HOST_WINDOWS = 2  # the most recent windows the factors in use are measured over (the host moves fast)
LEVEL_WINDOWS = 8  # the most recent windows whose host factor says whether the host moved
MAX_WAIT_SHARE = 0.99  # a window's wait share is at most this (the engine's work stays > 0)
MIN_SPAN = 0.5  # of a member's period in a window, the span with a known wait it needs (else: unknown)


def engine_work(period_s: float, members: list[tuple[float, float, float]]) -> float:
    """The engine's work over a window of mean period `period_s` from its members' (wait, span, need)
    seconds (one member: a worker on its own): the period less the largest wait share of the members
    whose span with a known wait reaches `need`; NaN when none does."""
    known = [w / s for w, s, need in members if s >= need and s > 0]
    if not known:
        return math.nan
    return period_s * (1.0 - min(MAX_WAIT_SHARE, max(0.0, max(known))))


def recent_factor(windows: Iterable[tuple[float, float]]) -> float | None:
    """Σ period / Σ work over (period, work) windows whose work is known (None: none is)."""
    p = e = 0.0
    for period, work in windows:
        if math.isfinite(work) and work > 0:
            p += period
            e += work
    return p / e if e > 0 else None


@dataclass(frozen=True, slots=True)
class HostFactor:
    """The host factor over windows whose engine work is known: `recent` (Σ period / Σ work over the
    last `recent_windows`), the per-window factors' median and 10th-90th percentiles over all
    `windows`, and the wait's share of the period over them (1 − Σ work / Σ period)."""

    recent: float
    median: float
    low: float
    high: float
    windows: int
    recent_windows: int
    wait_share: float
    level: float  # Σ period / Σ work over the last LEVEL_WINDOWS windows

    @property
    def moved(self) -> bool:
        """True when the factor of the last LEVEL_WINDOWS windows lies outside the 10th-90th
        percentiles of the per-window factors: the host changed within the run (the clock follows
        it; what was measured before may not hold). (A mean over several windows varies less than
        one window: on a host that does not change it stays within them.)"""
        return not self.low <= self.level <= self.high


def host_factor(period_s: npt.ArrayLike, work_s: npt.ArrayLike,
                recent: int = HOST_WINDOWS) -> HostFactor | None:
    """The host factor of window means in time order (`period_s`, `work_s`; NaN work: unknown, left
    out); None without a window whose work is known."""
    p = np.asarray(period_s, dtype=np.float64)
    e = np.asarray(work_s, dtype=np.float64)
    known = np.isfinite(e) & (e > 0) & np.isfinite(p)
    p, e = p[known], e[known]
    if not len(p):
        return None
    h = p / e
    k = min(recent, len(p))
    lo, med, hi = (float(np.quantile(h, q)) for q in (0.1, 0.5, 0.9))  # as stats.quantile
    share = float(1.0 - e.sum() / p.sum())
    j = min(LEVEL_WINDOWS, len(p))
    return HostFactor(float(p[-k:].sum() / e[-k:].sum()), med, lo, hi, len(p), k, share,
                      float(p[-j:].sum() / e[-j:].sum()))
