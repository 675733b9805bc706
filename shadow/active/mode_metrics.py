"""Prometheus families of the mode controller, declared here (`FAMILIES`): mode, transitions, pin,
fallback, hold-down, policy, BR-H degrade, predictor health, the client-felt cohorts and the canary
analysis."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from shadow.active.calibration import CalibrationMonitor
from shadow.active.canary import METRICS, VERDICTS
from shadow.active.cohorts import COHORTS
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

COHORT_REQUESTS = Family("shadow_cohort_requests_total", "counter",
                         "Finished requests as their clients saw them, by cohort (shadow: routed by shadow's "
                         "policy; router: passed to the existing router) and result", "requests",
                         ("cohort", "result"), {"cohort": COHORTS, "result": ("ok", "failed")},
                         note="failed: an error that is not the client's own (429/5xx, pool TTL, upstream "
                         "error, cut stream); a client's 4xx or cancel is not counted.")
CANARY_FRACTION = Family("shadow_canary_step_fraction", "gauge",
                         "Canary fraction of the step under analysis (0: no canary under analysis)", "ratio")
CANARY_VERDICTS = Family("shadow_canary_verdicts_total", "counter", "Canary step verdicts, by verdict",
                         "verdicts", ("verdict",), {"verdict": VERDICTS})
CANARY_P = Family("shadow_canary_p_value", "gauge",
                  "One-sided p-value of the last canary verdict's test, by metric",
                  "ratio", ("metric",), {"metric": METRICS},
                  note="ttft, tpot: non-inferiority Mann-Whitney U (small: shown within the margin; a step "
                  "passes below --canary-alpha); error_rate: Fisher's exact and spread: Mann-Whitney U on "
                  "batch means (small: worse); absent when not tested.")

#: Every family `ModeCollector` yields, in that order.
FAMILIES = (MODE, TRANSITIONS, PINNED, FALLBACK, TRIPS, HOLDDOWN, POLICY, DEGRADED, CALIBRATION, LOOKUPS,
            ORACLE_GAP, COHORT_REQUESTS, CANARY_FRACTION, CANARY_VERDICTS, CANARY_P)


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
        yield COHORT_REQUESTS.sampled({key: float(n) for key, n in sorted(m["cohorts"].items())})
        yield CANARY_FRACTION.value(float(m["canary_fraction"]))
        yield CANARY_VERDICTS.sampled({v: float(m["canary_verdicts"].get(v, 0)) for v in VERDICTS})
        figures = m["canary_p"]
        yield CANARY_P.sampled({k: figures[k].get("p") for k in METRICS if isinstance(figures.get(k), dict)})
