"""Prometheus collector for the live lanes: reads the published snapshot, never lane state.

Names and labels are the contract in COORDINATION.md (prefix `shadow_`, base units, labels
`lane`, `worker`, `source`, `reason` — all bounded by configuration).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from shadow.live.lanes import DECISION_BUCKETS, LiveLanes


def _counter(name: str, doc: str, lanes: dict[str, Any], key: str) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=["lane"])
    for label, v in lanes.items():
        if v.get(key) is not None:
            m.add_metric([label], float(v[key]))
    return m


def _gauge(name: str, doc: str, lanes: dict[str, Any], key: str) -> GaugeMetricFamily:
    m = GaugeMetricFamily(name, doc, labels=["lane"])
    for label, v in lanes.items():
        if v.get(key) is not None:
            m.add_metric([label], float(v[key]))
    return m


class LiveCollector(Collector):
    """See module docstring."""

    def __init__(self, live: LiveLanes) -> None:
        self.live = live

    def collect(self) -> Iterator[Any]:
        rep = self.live.report()
        lanes: dict[str, Any] = rep.get("lanes", {})
        yield _counter("shadow_lane_steps", "Decode steps the lane has advanced.", lanes, "steps")
        yield _gauge(
            "shadow_lane_spread_tokens", "max-min KV load at the latest step.", lanes, "spread_tokens"
        )
        yield _counter(
            "shadow_lane_spread_token_steps",
            "Sum of max-min KV load over steps (rate / steps rate = average spread).",
            lanes,
            "sum_spread_token_steps",
        )
        yield _gauge(
            "shadow_lane_imbalance_tokens",
            "I(k) = sum_g (max - L_g) at the latest step.",
            lanes,
            "imbalance_tokens",
        )
        yield _counter(
            "shadow_lane_imbalance_token_steps", "Sum of I(k) over steps.", lanes, "sum_imbalance_token_steps"
        )
        yield _gauge(
            "shadow_lane_barrier_idle_ratio",
            "Barrier-idle fraction of worker time (fitted step model when the fit is good).",
            lanes,
            "barrier_idle_fraction",
        )
        yield _gauge(
            "shadow_lane_throughput_tokens_per_second",
            "Estimated decode throughput.",
            lanes,
            "throughput_tokens_per_s",
        )
        yield _gauge("shadow_lane_tpot_seconds", "Estimated mean time per output token.", lanes, "tpot_s")
        yield _counter(
            "shadow_lane_requests_finished", "Requests the lane has finished.", lanes, "requests_finished"
        )
        yield _counter(
            "shadow_lane_lookahead_stalls",
            "Steps held because a running request's end was not yet known.",
            lanes,
            "lookahead_stalls",
        )
        yield _gauge(
            "shadow_lane_lag_seconds", "How far the lane runs behind the live clock.", lanes, "lag_s"
        )
        yield _counter(
            "shadow_lane_agreements",
            "Router decisions this lane's policy would have made identically.",
            lanes,
            "agreements",
        )
        yield _counter("shadow_lane_decisions", "Decisions compared for agreement.", lanes, "decisions")
        load = GaugeMetricFamily(
            "shadow_lane_worker_load_tokens", "Per-worker KV load in the lane.", labels=["lane", "worker"]
        )
        active = GaugeMetricFamily(
            "shadow_lane_worker_active_requests",
            "Per-worker running requests in the lane.",
            labels=["lane", "worker"],
        )
        hist = HistogramMetricFamily(
            "shadow_lane_decision_duration_seconds", "Routing-round compute time.", labels=["lane"]
        )
        for label, v in lanes.items():
            for w, x in v["worker_running_loads"].items():
                load.add_metric([label, w], float(x))
            for w, x in v["worker_active"].items():
                active.add_metric([label, w], float(x))
            cum = v.get("decision_buckets") or [0] * len(DECISION_BUCKETS)
            buckets = [(repr(b), float(c)) for b, c in zip(DECISION_BUCKETS, cum, strict=True)]
            buckets.append(("+Inf", float(v.get("decision_count", 0))))
            hist.add_metric([label], buckets, float(v.get("decision_sum_s", 0.0)))
        yield load
        yield active
        yield hist
        sm = rep.get("step_model", {})
        for name, key, doc in (
            ("shadow_step_model_a_seconds_per_token", "a_s_per_token", "Fitted a of T = a*max L + b."),
            ("shadow_step_model_b_seconds", "b_s", "Fitted b of T = a*max L + b."),
            ("shadow_step_model_r2", "r2", "R^2 of the step model fit."),
            ("shadow_step_model_samples", "samples", "Samples in the fit window."),
        ):
            g = GaugeMetricFamily(name, doc)
            if sm.get(key) is not None:
                g.add_metric([], float(sm[key]))
            yield g
        sh = HistogramMetricFamily(
            "shadow_step_duration_seconds", "Measured decode step times.", labels=["source"]
        )
        for source, h in rep.get("step_histogram", {}).items():
            total = 0
            buckets = []
            for b, c in zip(h["buckets"], h["counts"], strict=False):
                total += c
                buckets.append((repr(float(b)), float(total)))
            total += h["counts"][-1]
            buckets.append(("+Inf", float(total)))
            sh.add_metric([source], buckets, float(h["sum"]))
        yield sh
        fid = GaugeMetricFamily(
            "shadow_fidelity_load_relative_error", "Actual lane loads vs mirrored loads, mean relative error."
        )
        value = rep.get("fidelity", {}).get("load_rel_error")
        if value is not None:
            fid.add_metric([], float(value))
        yield fid
        drops = CounterMetricFamily(
            "shadow_live_events_dropped", "Events the lanes could not take.", labels=["reason"]
        )
        for reason, n in rep.get("events", {}).get("dropped", {}).items():
            drops.add_metric([reason], float(n))
        yield drops
