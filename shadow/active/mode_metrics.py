"""Prometheus families of the mode controller, declared here (`FAMILIES`): mode, transitions, pin,
fallback, hold-down, policy, BR-H degrade and predictor health."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from shadow.active.calibration import CalibrationMonitor
from shadow.active.modes import ModeController
from shadow.base.families import DeclaredCollector, Family
from shadow.contracts.labels import LOOKUP_RESULTS
from shadow.contracts.modes import DEGRADE_REASONS, MODES, TRANSITION_REASONS
from shadow.core.policies import ROUTE_LABELS

MODE = Family("shadow_mode", "gauge", "1 for the operator-set mode, 0 for the others", "info", ("mode",),
              {"mode": MODES})
TRANSITIONS = Family("shadow_mode_transitions_total", "counter", "Transitions into `mode`, by reason",
                     "transitions", ("mode", "reason"), {"mode": MODES, "reason": TRANSITION_REASONS})
PINNED = Family("shadow_mode_pinned", "gauge", "1 when an operator pinned the mode", "info",
                note="Automatic fallback is off while pinned.")
FALLBACK = Family("shadow_fallback_active", "gauge", "1 while automatic fallback routes round-robin", "info")
TRIPS = Family("shadow_fallback_trips_total", "counter", "Automatic fallbacks, by trigger", "trips",
               ("reason",), {"reason": TRANSITION_REASONS})
HOLDDOWN = Family("shadow_fallback_holddown_seconds", "gauge",
                  "Hold-down in force before recovery is tried (0 when not in fallback)", "seconds")
POLICY = Family("shadow_policy_active", "gauge", "1 for the policy requests are routed with now", "info",
                ("policy",), {"policy": ROUTE_LABELS})
DEGRADED = Family("shadow_policy_degraded_total", "counter", "BR-H to BR-0 degradations, by reason",
                  "degradations", ("reason",), {"reason": DEGRADE_REASONS})
CALIBRATION = Family("shadow_predictor_calibration_error", "gauge",
                     "BR-H end-probability calibration error on finished requests (window)", "ratio")
LOOKUPS = Family("shadow_predictor_key_lookups_total", "counter", "BR-H predictor prompt-key lookups",
                 "lookups", ("result",), {"result": LOOKUP_RESULTS})
ORACLE_GAP = Family("shadow_predictor_oracle_gap_ratio", "gauge",
                    "BR-H's live spread over the offline Oracle bound's on the same window, minus 1", "ratio")

#: Every family `ModeCollector` yields, in that order.
FAMILIES = (MODE, TRANSITIONS, PINNED, FALLBACK, TRIPS, HOLDDOWN, POLICY, DEGRADED, CALIBRATION, LOOKUPS,
            ORACLE_GAP)


class ModeCollector(DeclaredCollector):
    """Reads one consistent view of the controller per scrape."""

    families = FAMILIES

    def __init__(self, controller: ModeController, calibration: CalibrationMonitor | None = None) -> None:
        self.controller = controller
        self.calibration = calibration

    def collect(self) -> Iterator[Metric]:
        m = self.controller.metrics()
        yield MODE.sampled({mode: 1.0 if m["mode"] == mode else 0.0 for mode in MODE.closed("mode")})
        yield TRANSITIONS.sampled({key: float(n) for key, n in sorted(m["transitions"].items())})
        yield PINNED.value(1.0 if m["pinned"] else 0.0)
        yield FALLBACK.value(1.0 if m["fallback"] else 0.0)
        yield TRIPS.sampled({reason: float(n) for reason, n in sorted(m["trips"].items())})
        yield HOLDDOWN.value(float(m["holddown_s"]))
        yield POLICY.sampled({p: 1.0 if m["policy"] == p else 0.0 for p in POLICY.closed("policy")})
        yield DEGRADED.sampled({r: float(m["degraded"].get(r, 0)) for r in DEGRADED.closed("reason")})
        calibration = m["calibration_error"]
        yield CALIBRATION.value(None if calibration is None else float(calibration))
        lookups = self.calibration.lookups if self.calibration is not None else {}
        yield LOOKUPS.sampled({r: float(lookups.get(r, 0)) for r in LOOKUPS.closed("result")})
        gap = m["oracle_gap"]
        yield ORACLE_GAP.value(None if gap is None else float(gap))
