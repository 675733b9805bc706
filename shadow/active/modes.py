"""`ModeController`: which mode each new request is routed in, and why (a `ModeSource`).

The operator sets a mode (`shadow`, `canary`, `active`, `fallback`), a policy and a canary
fraction at start (flag, config file, environment), through a watched flag file or the admin API;
an invalid setting from any source means `shadow` (counted, reason `flag_error`). A mode the
process cannot carry out (no active proxy: only `shadow`) is refused (`ModeUnavailable`). In
`active`/`canary`, `Guards` (and the client-felt checks on what shadow-routed requests got) trip
automatic fallback to round-robin (fast) and recover after the
hold-down (slow), and `Degrade` steps BR-H down to BR-0 on predictor drift; an operator pin turns
both off. `choose` is lock-free (one immutable plan, swapped on each change), so a change applies
to new requests only. Every transition is logged (one line), counted, traced, and kept for
`/v1/report`'s "mode". With canary steps configured, a canary is analysed step by step
(`CanaryAnalysis`): each verdict is a transition (canary_step, canary_promoted, canary_failed)
carrying its figures, and a fallback trip during an analysed canary ends it in shadow.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from shadow.active.canary import CanaryAnalysis, CanaryConfig, Verdict
from shadow.active.cohorts import (
    ClientChecks,
    ClientConfig,
    CohortWindow,
    Outcome,
    client_fault,
    cohort_of,
)
from shadow.active.fallback import Degrade, GuardConfig, Guards, Signals
from shadow.base.knobs import FRACTION, NON_NEGATIVE_S, POSITIVE_S, knob
from shadow.contracts.labels import FAILED_OUTCOMES
from shadow.contracts.modes import MODES, START_REASONS, RouteChoice
from shadow.core.policies import active_policy
from shadow.telemetry.tracing import RoutingSpans

log = logging.getLogger("shadow.active.modes")

SHADOW = RouteChoice("shadow", "router")
NO_PROXY = ("this shadow serve runs without --active: the existing router routes every request, so only "
            "mode shadow can be carried out (start it with --active to route)")
FALLBACK = RouteChoice("fallback", "rr")


def canary_point(request_id: str) -> float:
    """A request id's fixed point in [0, 1): blake2b of the id, so stable across restarts and hosts."""
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True)
class ModeSetting:
    """What an operator source says: mode, policy, canary fraction, pin (None = unchanged)."""

    mode: str
    policy: str | None = None
    canary_fraction: float | None = None
    pin: bool | None = None

    def validate(self) -> None:
        """ValueError with a one-line reason (a retired policy spelling included: see `active_policy`)."""
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.policy is not None:
            active_policy(self.policy)
        f = self.canary_fraction
        if f is not None and not (isinstance(f, int | float) and math.isfinite(f) and 0.0 <= f <= 1.0):
            raise ValueError(f"canary_fraction must be a number in [0, 1], got {f!r}")


class ModeUnavailable(ValueError):
    """A valid mode this process cannot carry out (the reason says why)."""


@dataclass(frozen=True)
class ModeConfig:
    """The controller's configuration (`shadow serve`'s mode flags)."""

    mode: str = "shadow"
    policy: str = "br0"
    canary_fraction: float = knob(
        0.05, "--canary-fraction", "fraction of request ids canary mode routes actively, by a hash of the id",
        FRACTION, metavar="F")
    pin: bool = knob(False, "--pin-mode", "pin the mode: no automatic fallback, no BR-H degrade")
    mode_file: str | None = knob(
        None, "--mode-file", "watched flag file, YAML or JSON {mode, policy, canary_fraction, pin}; replace "
        "it atomically (write + rename); polled every --mode-file-interval. With PUT /v1/mode the last "
        "writer wins: every write of the file applies it (also of the same bytes, e.g. after a PUT), a PUT "
        "holds until the file is written again", metavar="FILE")
    mode_file_interval_s: float = knob(
        0.5, "--mode-file-interval", "how often the flag file is read", POSITIVE_S, metavar="SECONDS")
    admin_token: str | None = None
    check_interval_s: float = knob(
        0.25, "--mode-check-interval", "how often health signals (drift, scrape age, lanes) are checked",
        POSITIVE_S, metavar="SECONDS")
    oracle_interval_s: float = knob(
        60.0, "--oracle-interval", "how often BR-H and the Oracle are replayed on the last 300 finished "
        "requests (CPU: ~0.3 s a run; 0 = off)", NON_NEGATIVE_S, metavar="SECONDS")
    guards: GuardConfig = field(default_factory=GuardConfig)
    clients: ClientConfig = field(default_factory=ClientConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # steps given: analysed canaries
    history: int = 100
    active_available: bool = True  # an active proxy carries out canary/active/fallback
    source: str = "default"  # where the mode at start came from (one of START_REASONS)
    source_detail: str = ""  # e.g. "mode from env SHADOW_SERVE_MODE, canary_fraction from flag"


@dataclass(frozen=True)
class _Plan:
    choice: RouteChoice  # for every request, or for the canary fraction
    canary: float | None  # None: not canary


class ModeController:
    """See module docstring. Thread-safe: `choose` from the proxy, the rest from anywhere."""

    def __init__(
        self,
        config: ModeConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        spans: RoutingSpans | None = None,
    ) -> None:
        self.config = c = config or ModeConfig()
        c.guards.validate()
        self.clock = clock
        self.wall = wall
        self.spans = spans
        self._lock = threading.Lock()
        self.guards = Guards(c.guards)
        self.degrade = Degrade(c.guards)
        self.cohorts = CohortWindow()
        self.client_checks = ClientChecks(c.clients)
        self.canary = CanaryAnalysis(c.canary) if c.canary.steps else None
        self.canary_verdicts: dict[str, int] = {}
        self.spread_base: deque[float] = deque(maxlen=2400)  # shadow mode's fleet spread, per check
        self.spread_step: list[float] = []  # ... during the canary step under analysis
        self.mode = "shadow"
        self.policy = "br0"
        self.canary_fraction = 0.0
        self.pinned = False
        self.since = wall()
        self.transitions: dict[tuple[str, str], int] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=c.history)
        self.last_error: str | None = None
        self.signals = Signals()
        self.degraded_total: dict[str, int] = {}
        # what the proxy reported (all modes), so bounds can be stated in decisions and calls
        self.observed = {"decisions": 0, "slow_decisions": 0, "decision_errors": 0, "upstream_calls": 0,
                         "upstream_failures": 0}
        self._plan = _Plan(SHADOW, None)
        self.gate: Callable[[], bool] | None = None  # replicas: True while this one leads
        self.last_writer = c.source
        source = c.source if c.source in START_REASONS else "default"
        try:
            start = ModeSetting(c.mode, c.policy, c.canary_fraction, c.pin)
            self.apply(start, source)
        except ValueError as exc:
            self.flag_error(f"{source}: {exc}")

    # -- ModeSource -------------------------------------------------------------------------------

    def choose(self, request_id: str) -> RouteChoice:
        gate = self.gate
        if gate is not None and not gate():  # a standby replica: the existing router routes
            return SHADOW
        plan = self._plan
        if plan.canary is None or canary_point(request_id) < plan.canary:
            return plan.choice
        return SHADOW

    def on_decision(self, seconds: float, error: BaseException | None = None) -> None:
        try:
            with self._lock:
                o = self.observed
                o["decisions"] += 1
                o["slow_decisions"] += seconds > self.config.guards.decision_budget_s
                o["decision_errors"] += error is not None
                # in fallback the rounds are round-robin's: they say nothing about the policy's
                # decisions, which are tried again after the hold-down
                if self._guarded() and not self._in_fallback:
                    reason = self.guards.decision(self.clock(), seconds, error is not None)
                    if reason is not None:
                        self._enter_fallback(reason, f"decision took {seconds * 1e3:.1f} ms"
                                             + (f", raised {type(error).__name__}" if error else ""))
        except Exception:  # never raise into the proxy
            log.exception("shadow mode: on_decision failed")

    def on_upstream(self, worker: str, leg: str, ok: bool) -> None:
        try:
            with self._lock:
                self.observed["upstream_calls"] += 1
                self.observed["upstream_failures"] += not ok
                if self._guarded():
                    was = self._in_fallback
                    reason = self.guards.upstream(self.clock(), f"{leg}:{worker}", ok)
                    if reason is not None and not was:
                        self._enter_fallback(reason, f"{leg} calls to {worker} failing")
        except Exception:
            log.exception("shadow mode: on_upstream failed")

    def on_request(self, mode: str, outcome: str, status: int | None, ttft_s: float | None,
                   tpot_s: float | None) -> None:
        try:
            cohort = cohort_of(mode)
            if cohort is None:
                return
            failed = outcome in FAILED_OUTCOMES and not client_fault(status)
            if outcome != "ok" and not failed:  # the client's own: cancelled, or its 4xx
                return
            with self._lock:
                self.cohorts.add(cohort, Outcome(self.clock(), failed, ttft_s, tpot_s))
        except Exception:
            log.exception("shadow mode: on_request failed")

    # -- operator sources -----------------------------------------------------------------------

    def unavailable(self, mode: str) -> str | None:
        """Why `mode` cannot be carried out here (None: it can)."""
        if mode != "shadow" and not self.config.active_available:
            return NO_PROXY
        return None

    def apply(self, setting: ModeSetting, reason: str) -> dict[str, Any]:
        """Apply an operator setting (validated: ValueError leaves everything unchanged,
        `ModeUnavailable` for a mode this process cannot carry out)."""
        setting.validate()
        why = self.unavailable(setting.mode)
        if why is not None:
            raise ModeUnavailable(f"mode {setting.mode} refused: {why}")
        policy = None
        if setting.policy is not None:
            policy = active_policy(setting.policy)
        with self._lock:
            self.last_writer = reason
            prev = "start" if reason in START_REASONS else self._current()
            self.mode = setting.mode
            if policy is not None:
                if policy != self.policy:
                    self.degrade.degraded = None  # a new policy starts undegraded
                self.policy = policy
            if setting.canary_fraction is not None:
                self.canary_fraction = float(setting.canary_fraction)
            if setting.pin is not None:
                self.pinned = setting.pin
            self._canary_setting()
            if not self._guarded():  # pinned, shadow or operator fallback: automatic state off
                self.guards.tripped = None
                self.degrade.degraded = None
            detail = self.config.source_detail if reason in START_REASONS else ""
            said = f"set by {reason}" + (f": {detail}" if detail else "")
            self._record(prev, self._current(), reason, said)
            return self._snapshot()

    def flag_error(self, message: str) -> None:
        """A flag source was unreadable or invalid: route everything through the router (shadow)."""
        with self._lock:
            prev = self._current()
            self.mode = "shadow"
            self.guards.tripped = None
            self.degrade.degraded = None
            self.last_error = message
            self.last_writer = "flag_error"
            self._canary_setting()
            self._record(prev, "shadow", "flag_error", message)

    # -- health ---------------------------------------------------------------------------------

    def check(self, signals: Signals) -> None:
        """Run the fallback and degrade checks on a health snapshot (the health poll calls this)."""
        with self._lock:
            now = self.clock()
            if signals.spread_tokens is not None:
                if self.mode == "shadow":
                    self.spread_base.append(signals.spread_tokens)
                elif self.canary is not None and self.canary.running:
                    self.spread_step.append(signals.spread_tokens)
            if self._guarded():
                signals = replace(signals, client=self.client_checks.failing(now, self.cohorts))
            self.signals = signals
            if self._guarded():
                self._guard(now, signals)
            self._analyse_canary(now)

    def _guard(self, now: float, signals: Signals) -> None:
        verdict = self.guards.evaluate(now, signals)
        if verdict is not None:
            kind, reason = verdict
            if kind == "trip":
                self._enter_fallback(reason, _describe(reason, signals, self.config.guards))
            else:
                self._record("fallback", self.mode, "recovered", "all checks pass after the hold-down")
        if self.policy == "brh":
            d = self.degrade.evaluate(now, signals)
            if d is not None:
                self._degrade_changed(*d)

    # -- the canary analysis (lock held) --------------------------------------------------------

    def _canary_setting(self) -> None:
        """An operator setting: a canary starts its analysis (at the first step's fraction), any
        other mode stops it."""
        a = self.canary
        if a is None:
            return
        if self.mode != "canary":
            a.stop()
        elif not a.running:
            self.canary_fraction = a.start(self.clock())
            self.spread_step = []

    def _analyse_canary(self, now: float) -> None:
        a = self.canary
        if a is None or not a.running or self.mode != "canary":
            return
        if self._in_fallback:
            self._canary_verdict(a.abort(now, f"fallback tripped ({self.guards.tripped})"), "fallback")
            return
        t0 = a.step_started
        v = a.evaluate(now, self.cohorts.since("shadow", t0), self.cohorts.since("router", t0),
                       self.spread_step, list(self.spread_base))
        if v is not None:
            self._canary_verdict(v)

    def _canary_verdict(self, v: Verdict, prev: str = "canary") -> None:
        self.canary_verdicts[v.verdict] = self.canary_verdicts.get(v.verdict, 0) + 1
        if self.spans is not None:
            try:
                self.spans.canary_verdict(v.step, v.fraction, v.verdict, v.reason, v.figures)
            except Exception:
                log.exception("shadow mode: tracing the canary verdict failed")
        line = "canary " + v.line()
        if v.verdict == "pass":
            assert self.canary is not None
            self.canary_fraction = self.canary.fraction
            self.spread_step = []
            self._record("canary", "canary", "canary_step", line)
        elif v.verdict == "promoted":
            self.mode = "active"
            self._record("canary", "active", "canary_promoted", line)
        else:
            self._end_canary(prev, line)

    def _end_canary(self, prev: str, detail: str) -> None:
        self.mode = "shadow"
        self.guards.tripped = None
        self.degrade.degraded = None
        self._record(prev, "shadow", "canary_failed", detail)

    # -- internals (lock held) ------------------------------------------------------------------

    @property
    def _in_fallback(self) -> bool:
        return self.guards.tripped is not None

    def _guarded(self) -> bool:
        return not self.pinned and self.mode in ("active", "canary")

    def _current(self) -> str:
        return "fallback" if self._in_fallback and self.mode in ("active", "canary") else self.mode

    def _effective_policy(self) -> str:
        if self.policy == "brh" and self.degrade.degraded is not None:
            return "br0"
        return self.policy

    def _route_policy(self) -> str:
        """The policy requests routed actively run now (`router` in shadow, `rr` in fallback)."""
        return {"shadow": "router", "fallback": "rr"}.get(self._current(), self._effective_policy())

    def _enter_fallback(self, reason: str, detail: str) -> None:
        self._record(self.mode, "fallback", reason, detail)

    def _degrade_changed(self, kind: str, reason: str) -> None:
        if kind == "degrade":
            self.degraded_total[reason] = self.degraded_total.get(reason, 0) + 1
            line = f"shadow policy: brh -> br0 (reason={reason})"
        else:
            line = "shadow policy: br0 -> brh (recovered)"
        log.warning(line)
        self.history.append({"at": _iso(self.wall()), "policy_from": "brh" if kind == "degrade" else "br0",
                             "policy_to": self._effective_policy(), "reason": reason})
        self._replan()

    def _record(self, prev: str, into: str, reason: str, detail: str) -> None:
        now = self.wall()
        self.since = now
        key = (into, reason)
        self.transitions[key] = self.transitions.get(key, 0) + 1
        self.history.append({"at": _iso(now), "from": prev, "to": into, "reason": reason,
                             "policy": self._effective_policy(), "detail": detail,
                             "scrapes": self.signals.scrapes, "observed": dict(self.observed),
                             "holddown_s": self.guards.hold.current_s if self.guards.tripped else 0.0})
        logged = False

        def line() -> None:
            nonlocal logged
            logged = True
            log.log(logging.WARNING if into == "fallback" or reason == "canary_failed" else logging.INFO,
                    "shadow mode: %s -> %s (reason=%s: %s)", prev, into, reason, detail,
                    extra={"mode_from": prev, "mode_to": into, "reason": reason})

        if self.spans is not None:
            try:
                self.spans.mode_transition(prev, into, reason, inside=line)
            except Exception:
                log.exception("shadow mode: tracing the transition failed")
        if not logged:
            line()
        self._replan()

    def _replan(self) -> None:
        current = self._current()
        if current == "shadow":
            plan = _Plan(SHADOW, None)
        elif current == "fallback":
            plan = _Plan(FALLBACK, self.canary_fraction if self.mode == "canary" else None)
        else:
            choice = RouteChoice("active", self._effective_policy())
            plan = _Plan(choice, self.canary_fraction if self.mode == "canary" else None)
        self._plan = plan

    # -- views ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The report's "mode" section (also GET /v1/mode)."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        now = self.clock()
        g = self.guards
        s = self.signals
        return {
            "current": self._current(),
            "configured": self.mode,
            "policy": self._route_policy(),
            "configured_policy": self.policy,
            "canary_fraction": self.canary_fraction,
            "pinned": self.pinned,
            "since": _iso(self.since),
            "fallback_reason": g.tripped,
            "degraded_reason": self.degrade.degraded,
            "holddown_s": g.hold.current_s if g.tripped else 0.0,
            "holddown_left_s": round(g.holddown_left(now), 3),
            "trips": dict(g.trips),
            "degradations": dict(self.degraded_total),
            "transitions": list(self.history),
            "transitions_total": {f"{m}/{r}": n for (m, r), n in self.transitions.items()},
            "canary": ({**self.canary.report(), "baseline_samples": len(self.spread_base)}
                       if self.canary is not None else None),
            "cohorts": {f"{co}/{result}": n for (co, result), n in sorted(self.cohorts.counts.items())},
            "last_flag_error": self.last_error,
            "last_writer": self.last_writer,
            "active_routing": {
                "available": self.config.active_available,
                "modes": [m for m in MODES if self.unavailable(m) is None],
                "reason": self.unavailable("active"),
            },
            "observed": dict(self.observed),
            "signals": {
                "drift": dict(s.drift),
                "scrape_age_s": {k: round(v, 3) for k, v in s.scrape_age_s.items()},
                "unreachable": sorted(s.unreachable),
                "calibration_error": s.calibration_error,
                "calibration_samples": s.calibration_samples,
                "oracle_gap": s.oracle_gap,
                "net_gain": s.net_gain,
                "net_gain_steps": s.net_gain_steps,
            },
        }

    def metrics(self) -> Mapping[str, Any]:
        """Figures for the Prometheus collector (one consistent read)."""
        with self._lock:
            return {
                "mode": self.mode,
                "pinned": self.pinned,
                "fallback": self._in_fallback and self.mode in ("active", "canary"),
                "holddown_s": self.guards.hold.current_s if self.guards.tripped else 0.0,
                "policy": self._route_policy(),
                "transitions": dict(self.transitions),
                "trips": dict(self.guards.trips),
                "degraded": dict(self.degraded_total),
                "calibration_error": self.signals.calibration_error,
                "oracle_gap": self.signals.oracle_gap,
                "canary_fraction": self.canary.fraction if self.canary is not None else 0.0,
                "canary_verdicts": dict(self.canary_verdicts),
                "canary_p": self.canary.verdicts[-1].figures if self.canary and self.canary.verdicts else {},
                "cohorts": dict(self.cohorts.counts),
            }


def _describe(reason: str, s: Signals, c: GuardConfig) -> str:
    if reason == "worker_down":
        return f"unreachable: {', '.join(sorted(s.unreachable))}"
    if reason == "telemetry_stale":
        old = {w: round(a, 1) for w, a in s.scrape_age_s.items() if a > c.stale_s}
        return f"no good /metrics scrape for > {c.stale_s:g} s: {old}"
    if reason == "drift":
        bad = {w: d for w, d in s.drift.items() if abs(d) > c.drift_requests}
        return f"mirror drift over {c.drift_requests:g} requests: {bad}"
    if reason == "decision_slow":
        return f"{c.slow_count} decisions over {c.decision_budget_s * 1e3:g} ms within {c.slow_window_s:g} s"
    if s.client is not None and s.client[0] == reason:
        return s.client[1]
    return reason


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
