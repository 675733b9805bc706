"""Prometheus families of the mode controller (COORDINATION's active-routing table, exporter
`serve`): mode, transitions, pin, fallback, hold-down, policy, BR-H degrade and predictor health."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shadow.active.calibration import CalibrationMonitor
from shadow.active.modes import ModeController
from shadow.contracts.labels import LOOKUP_RESULTS, POLICY_LABELS
from shadow.contracts.modes import DEGRADE_REASONS, MODES


class ModeCollector(Collector):
    """Reads one consistent view of the controller per scrape."""

    def __init__(self, controller: ModeController, calibration: CalibrationMonitor | None = None) -> None:
        self.controller = controller
        self.calibration = calibration

    def collect(self) -> Iterator[Metric]:
        m = self.controller.metrics()
        g = GaugeMetricFamily("shadow_mode", "1 for the operator-set mode, 0 for the others", labels=["mode"])
        for mode in MODES:
            g.add_metric([mode], 1.0 if m["mode"] == mode else 0.0)
        yield g
        c = CounterMetricFamily("shadow_mode_transitions", "Transitions into `mode`, by reason",
                                labels=["mode", "reason"])
        for (mode, reason), n in sorted(m["transitions"].items()):
            c.add_metric([mode, reason], float(n))
        yield c
        yield GaugeMetricFamily("shadow_mode_pinned", "1 when an operator pinned the mode",
                                value=1.0 if m["pinned"] else 0.0)
        yield GaugeMetricFamily("shadow_fallback_active", "1 while automatic fallback routes round-robin",
                                value=1.0 if m["fallback"] else 0.0)
        c = CounterMetricFamily("shadow_fallback_trips", "Automatic fallbacks, by trigger", labels=["reason"])
        for reason, n in sorted(m["trips"].items()):
            c.add_metric([reason], float(n))
        yield c
        yield GaugeMetricFamily("shadow_fallback_holddown_seconds",
                                "Hold-down in force before recovery is tried (0 when not in fallback)",
                                value=float(m["holddown_s"]))
        g = GaugeMetricFamily("shadow_policy_active", "1 for the policy requests are routed with now",
                              labels=["policy"])
        for policy in POLICY_LABELS:
            g.add_metric([policy], 1.0 if m["policy"] == policy else 0.0)
        yield g
        c = CounterMetricFamily("shadow_policy_degraded", "BR-H to BR-0 degradations, by reason",
                                labels=["reason"])
        for reason in DEGRADE_REASONS:
            c.add_metric([reason], float(m["degraded"].get(reason, 0)))
        yield c
        g = GaugeMetricFamily("shadow_predictor_calibration_error",
                              "BR-H end-probability calibration error on finished requests (window)")
        if m["calibration_error"] is not None:
            g.add_metric([], float(m["calibration_error"]))
        yield g
        c = CounterMetricFamily("shadow_predictor_key_lookups", "BR-H predictor prompt-key lookups",
                                labels=["result"])
        lookups = self.calibration.lookups if self.calibration is not None else {}
        for result in LOOKUP_RESULTS:
            c.add_metric([result], float(lookups.get(result, 0)))
        yield c
        g = GaugeMetricFamily("shadow_predictor_oracle_gap_ratio",
                              "BR-H's live spread over the offline Oracle bound's on the same window, "
                              "minus 1")
        if m["oracle_gap"] is not None:
            g.add_metric([], float(m["oracle_gap"]))
        yield g
