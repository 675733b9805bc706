"""Automatic fallback to round-robin, and BR-H's softer step down to BR-0: pure decision logic.

`Guards` is fed what happened (`decision`, `upstream`, with the time passed in) and a `Signals`
snapshot of the fleet's health (`evaluate`). It trips at once when a check fails (fast), and
recovers only after a hold-down has passed AND every check passes (slow). The hold-down doubles on
each trip that follows a recovery within `reset_after_s` (up to `holddown_max_s`) and falls back to
`holddown_s` after that long a healthy spell. `Degrade` is the same shape for BR-H → BR-0 on
predictor drift. No I/O, no clock of its own: every method takes `now` (monotonic seconds).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from shadow.base.knobs import AT_LEAST_ONE, OPEN_FRACTION, POSITIVE_S, Bound, check_knobs, knob

#: Trip reasons in the order they are checked (the first failing one is reported).
TRIP_ORDER: tuple[str, ...] = (
    "decision_error",
    "decision_slow",
    "worker_down",
    "upstream_errors",
    "client_errors",
    "slo_regression",
    "telemetry_stale",
    "drift",
)


@dataclass(frozen=True)
class GuardConfig:
    """Thresholds of the fallback checks and of the BR-H degrade (defaults are what `shadow serve`
    uses)."""

    decision_budget_s: float = knob(
        0.020, "--decision-budget", "a routing decision round slower than this counts as slow", POSITIVE_S,
        metavar="SECONDS")
    slow_count: int = knob(
        5, "--trip-slow-count", "this many slow decisions within --trip-window trip fallback", AT_LEAST_ONE,
        metavar="N")
    slow_window_s: float = knob(  # (serve gives the upstream window the same)
        10.0, "--trip-window", "window of the slow-decision and upstream-failure counts", POSITIVE_S,
        metavar="SECONDS")
    decision_errors: int = 1  # this many raising decisions within `slow_window_s` trip
    drift_requests: float = knob(
        16.0, "--trip-drift", "mirror drift (mirrored − worker-reported requests) on any worker that trips "
        "fallback", Bound(lambda v: math.isfinite(v) and v > 0, "> 0 requests"), metavar="REQUESTS")
    stale_s: float = knob(
        15.0, "--trip-stale", "no good /metrics scrape of a worker for this long trips fallback", POSITIVE_S,
        metavar="SECONDS")
    upstream_error_rate: float = knob(
        0.5, "--trip-upstream-error-rate", "failed fraction of one upstream's calls in the window that trips "
        "fallback ...", OPEN_FRACTION, metavar="FRACTION")
    upstream_min_calls: int = knob(
        10, "--trip-upstream-min-calls", "... given at least N calls in the window", AT_LEAST_ONE,
        metavar="N")
    upstream_window_s: float = 10.0
    holddown_s: float = knob(
        10.0, "--holddown", "first hold-down before recovery from fallback is tried; doubles on each "
        "repeated trip", POSITIVE_S, metavar="SECONDS")
    holddown_max_s: float = knob(
        300.0, "--holddown-max", "cap of the doubling hold-down", POSITIVE_S, metavar="SECONDS")
    reset_after_s: float = 600.0  # healthy this long after a recovery: hold-down back to `holddown_s`
    # BR-H → BR-0 (softer step)
    calibration_max: float = knob(
        0.15, "--degrade-calibration", "BR-H end-probability calibration error above which active BR-H runs "
        "BR-0", OPEN_FRACTION, metavar="ECE")
    calibration_min_samples: int = 200
    oracle_gap_max: float = knob(
        1.0, "--degrade-oracle-gap", "BR-H's spread over the Oracle's on the recent window, minus 1, above "
        "which active BR-H runs BR-0", Bound(lambda v: math.isfinite(v) and v > 0, "> 0"), metavar="RATIO")
    net_gain_min: float = knob(
        0.0, "--degrade-net-gain", "BR-H's spread gain over BR-0 in the live lanes below which active BR-H "
        "runs BR-0", Bound(math.isfinite, "a finite number"), metavar="FRACTION")
    net_gain_min_steps: int = 500  # live-lane steps before the net gain counts

    def validate(self) -> None:
        """ValueError with a one-line reason: a setting out of its bound (naming its flag), or values
        that do not fit together."""
        check_knobs(self)
        if not (self.upstream_window_s > 0 and math.isfinite(self.upstream_window_s)):
            raise ValueError(f"upstream window must be > 0 s, got {self.upstream_window_s}")
        if self.holddown_max_s < self.holddown_s:
            raise ValueError(f"hold-down cap {self.holddown_max_s} s is below the hold-down "
                             f"{self.holddown_s} s")
        if self.decision_errors < 1:
            raise ValueError("the decision error count that trips must be >= 1")

@dataclass(frozen=True)
class Signals:
    """The fleet's health as read at one moment (see `shadow.active.health`). Empty = all good."""

    drift: Mapping[str, float] = field(default_factory=dict)  # worker -> mirrored − reported requests
    scrape_age_s: Mapping[str, float] = field(default_factory=dict)  # worker -> s since a good scrape
    unreachable: frozenset[str] = frozenset()  # workers whose last scrape could not connect
    calibration_error: float | None = None
    calibration_samples: int = 0
    oracle_gap: float | None = None
    net_gain: float | None = None  # (BR-0 spread − BR-H spread) / BR-0 spread, live lanes
    net_gain_steps: int = 0
    scrapes: int = 0  # reconciliation rounds finished when read (to state bounds in scrapes)
    spread_tokens: float | None = None  # max − min mirrored KV tokens over the workers
    client: tuple[str, str] | None = None  # a failing client-felt check: (reason, detail)


class HoldDown:
    """Hold-down arithmetic: `trip(now)` returns the hold-down to serve; it doubles when the trip
    follows the previous recovery within `reset_after_s`, capped at `max_s`."""

    def __init__(self, base_s: float, max_s: float, reset_after_s: float) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.reset_after_s = reset_after_s
        self.current_s = base_s
        self.trips = 0
        self.last_recovery: float | None = None

    def trip(self, now: float) -> float:
        if self.trips and self.last_recovery is not None and now - self.last_recovery < self.reset_after_s:
            self.current_s = min(self.current_s * 2.0, self.max_s)
        else:
            self.current_s = self.base_s
        self.trips += 1
        return self.current_s

    def recovered(self, now: float) -> None:
        self.last_recovery = now


class _Window:
    """Timestamps of events within the last `span_s` seconds."""

    __slots__ = ("span_s", "times")

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.times: deque[float] = deque()

    def add(self, now: float) -> int:
        self.times.append(now)
        return self.count(now)

    def count(self, now: float) -> int:
        t = self.times
        while t and t[0] <= now - self.span_s:
            t.popleft()
        return len(t)


class _Rate:
    """Per-upstream (ok, failed) calls within the last `span_s` seconds, in 1 s buckets."""

    __slots__ = ("buckets", "span_s")

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.buckets: deque[list[float]] = deque()  # [second, ok, failed]

    def add(self, now: float, ok: bool) -> None:
        sec = math.floor(now)
        if not self.buckets or self.buckets[-1][0] != sec:
            self.buckets.append([sec, 0.0, 0.0])
        self.buckets[-1][1 if ok else 2] += 1

    def counts(self, now: float) -> tuple[int, int]:
        b = self.buckets
        while b and b[0][0] <= now - self.span_s:
            b.popleft()
        return int(sum(x[1] for x in b)), int(sum(x[2] for x in b))


class Guards:
    """Fallback state machine (see module docstring). `tripped` is the reason while in fallback."""

    def __init__(self, config: GuardConfig) -> None:
        config.validate()
        self.config = config
        self.hold = HoldDown(config.holddown_s, config.holddown_max_s, config.reset_after_s)
        self.tripped: str | None = None
        self.tripped_at = 0.0
        self.slow = _Window(config.slow_window_s)
        self.errors = _Window(config.slow_window_s)
        self.upstreams: dict[str, _Rate] = {}
        self.trips: dict[str, int] = {}

    # -- inputs ---------------------------------------------------------------------------------

    def decision(self, now: float, seconds: float, error: bool) -> str | None:
        """Record one decision round; returns the trip reason if this trips fallback now."""
        c = self.config
        if error and self.errors.add(now) >= c.decision_errors:
            return self._trip(now, "decision_error")
        if seconds > c.decision_budget_s and self.slow.add(now) >= c.slow_count:
            return self._trip(now, "decision_slow")
        return None

    def upstream(self, now: float, worker: str, ok: bool) -> str | None:
        """Record one upstream call; returns "upstream_errors" if this trips fallback now."""
        rate = self.upstreams.get(worker)
        if rate is None:
            if len(self.upstreams) >= 4096:  # a bounded table whatever names the proxy reports
                return None
            rate = self.upstreams[worker] = _Rate(self.config.upstream_window_s)
        rate.add(now, ok)
        if not ok and self._upstream_failing(now, rate):
            return self._trip(now, "upstream_errors")
        return None

    def _upstream_failing(self, now: float, rate: _Rate) -> bool:
        ok, failed = rate.counts(now)
        n = ok + failed
        return n >= self.config.upstream_min_calls and failed >= self.config.upstream_error_rate * n

    # -- checks ---------------------------------------------------------------------------------

    def failing(self, now: float, signals: Signals) -> str | None:
        """The first check that fails now (TRIP_ORDER), or None when every check passes."""
        c = self.config
        if self.errors.count(now) >= c.decision_errors:
            return "decision_error"
        if self.slow.count(now) >= c.slow_count:
            return "decision_slow"
        if signals.unreachable:
            return "worker_down"
        if any(self._upstream_failing(now, r) for r in self.upstreams.values()):
            return "upstream_errors"
        if signals.client is not None:
            return signals.client[0]
        if any(age > c.stale_s for age in signals.scrape_age_s.values()):
            return "telemetry_stale"
        if any(abs(d) > c.drift_requests for d in signals.drift.values()):
            return "drift"
        return None

    def evaluate(self, now: float, signals: Signals) -> tuple[str, str] | None:
        """Run every check: ("trip", reason) when a failing check trips fallback now,
        ("recover", "recovered") when the hold-down has passed and every check passes, else None."""
        reason = self.failing(now, signals)
        if self.tripped is None:
            if reason is not None:
                return "trip", self._trip(now, reason)
            return None
        if reason is None and now - self.tripped_at >= self.hold.current_s:
            self.tripped = None
            self.hold.recovered(now)
            return "recover", "recovered"
        return None

    def _trip(self, now: float, reason: str) -> str:
        if self.tripped is None:
            self.tripped = reason
            self.tripped_at = now
            self.hold.trip(now)
            self.trips[reason] = self.trips.get(reason, 0) + 1
        return reason

    def holddown_left(self, now: float) -> float:
        """Seconds before recovery may be tried (0 when not in fallback)."""
        if self.tripped is None:
            return 0.0
        return max(0.0, self.hold.current_s - (now - self.tripped_at))


class Degrade:
    """BR-H → BR-0 on predictor drift, with its own hold-down (same doubling rule).

    `evaluate(now, signals)` returns ("degrade", reason), ("restore", "recovered") or None;
    `degraded` is the reason while BR-0 stands in for BR-H."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.hold = HoldDown(config.holddown_s, config.holddown_max_s, config.reset_after_s)
        self.degraded: str | None = None
        self.since = 0.0
        self.counts: dict[str, int] = {}

    def failing(self, signals: Signals) -> str | None:
        c = self.config
        cal = signals.calibration_error
        enough = signals.calibration_samples >= c.calibration_min_samples
        if cal is not None and enough and cal > c.calibration_max:
            return "calibration"
        if signals.oracle_gap is not None and signals.oracle_gap > c.oracle_gap_max:
            return "oracle_gap"
        gain = signals.net_gain
        if gain is not None and signals.net_gain_steps >= c.net_gain_min_steps and gain < c.net_gain_min:
            return "net_gain"
        return None

    def evaluate(self, now: float, signals: Signals) -> tuple[str, str] | None:
        reason = self.failing(signals)
        if self.degraded is None:
            if reason is None:
                return None
            self.degraded = reason
            self.since = now
            self.hold.trip(now)
            self.counts[reason] = self.counts.get(reason, 0) + 1
            return "degrade", reason
        if reason is None and now - self.since >= self.hold.current_s:
            self.degraded = None
            self.hold.recovered(now)
            return "restore", "recovered"
        return None
