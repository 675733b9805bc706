"""The active proxy's Prometheus metrics, declared here (`FAMILIES`) and registered once on the
registry `ActiveMetrics` is given; closed label sets from `shadow.contracts` and the policy registry."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from shadow.base.families import Family
from shadow.contracts.labels import (
    BACKPRESSURE_REASONS,
    LEGS,
    OUTCOMES,
    PROMPT_BUCKETS,
    ROUND_STAGES,
)
from shadow.contracts.modes import MODES
from shadow.core.policies import ROUTE_LABELS

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_CLIENT = {"mode": MODES, "prompt_bucket": PROMPT_BUCKETS}  # per-request histograms' closed sets

REQUESTS = Family("shadow_router_requests_total", "counter", "requests by effective mode, policy and outcome",
                  "requests", ("mode", "policy", "outcome"),
                  {"mode": MODES, "policy": ROUTE_LABELS, "outcome": OUTCOMES})
DECISION = Family("shadow_router_decision_duration_seconds", "histogram",
                  "compute time of one dispatch round", "seconds", ("policy",), {"policy": ROUTE_LABELS},
                  _FAST)
UPSTREAM_ERRORS = Family("shadow_router_upstream_errors_total", "counter", "failed upstream calls", "errors",
                         ("leg", "worker"), {"leg": LEGS})
RETRIES = Family("shadow_router_retries_total", "counter", "retries before the first byte reached a client",
                 "retries", ("leg",), {"leg": LEGS})
INFLIGHT = Family("shadow_router_inflight", "gauge", "requests in flight per upstream", "requests",
                  ("leg", "worker"), {"leg": LEGS})
TRANSFERS = Family("shadow_router_kv_transfers_inflight", "gauge",
                   "KV transfers in flight per decode worker (capped)", "transfers", ("worker",))
BACKPRESSURE = Family("shadow_router_backpressure_total", "counter", "waits caused by back-pressure", "waits",
                      ("reason",), {"reason": BACKPRESSURE_REASONS})
POOL_REQUESTS = Family("shadow_pool_requests", "gauge", "requests waiting in the Prompt Pool", "requests")
POOL_OLDEST = Family("shadow_pool_oldest_seconds", "gauge", "age of the oldest pool entry", "seconds")
POOL_WAIT = Family("shadow_pool_wait_seconds", "histogram", "time from prefill done to decode dispatch",
                   "seconds", buckets=_LATENCY)
POOL_REAPED = Family("shadow_pool_reaped_total", "counter", "pool entries released by the TTL reaper",
                     "requests")
FIRST_TOKEN = Family("shadow_router_first_token_seconds", "histogram",
                     "time to first token the client saw, through the proxy", "seconds",
                     ("mode", "prompt_bucket"), _CLIENT, _LATENCY)
TPOT = Family("shadow_router_tpot_seconds", "histogram",
              "mean time per output token of a finished stream, as the client saw it", "seconds",
              ("mode", "prompt_bucket"), _CLIENT, _TPOT)
COMPLETION = Family("shadow_router_completion_seconds", "histogram",
                    "request start to last byte, as the client saw it", "seconds",
                    ("mode", "prompt_bucket"), _CLIENT, _LATENCY)
ROUND_STAGE = Family("shadow_router_round_stage_seconds", "histogram",
                     "compute time of BR Stage 1 and Stage 2 within a round", "seconds",
                     ("round_stage",), {"round_stage": ROUND_STAGES}, _FAST)
KV_TRANSFER = Family("shadow_router_kv_transfer_seconds", "histogram",
                     "decode dispatch to first decode token", "seconds", buckets=_LATENCY,
                     note="KV transfer and queueing on the decode worker.")
RECOMPUTED = Family("shadow_router_recomputed_total", "counter",
                    'decode legs that ended with stop_reason "recomputed"', "requests")
RESUME_DROPPED = Family(
    "shadow_router_resume_dropped_total", "counter",
    "streams that stopped keeping their bytes for a recompute continuation (resume budget)", "requests")
PLACEMENTS = Family("shadow_router_placements_total", "counter",
                    "requests placed on each decode worker, by policy", "requests", ("worker", "policy"),
                    {"policy": ROUTE_LABELS})
WORKER_UP = Family("shadow_router_worker_up", "gauge",
                   "1 while a decode worker takes placements, 0 while it is down (unreachable, or its "
                   "source says so), as of the last routing round", "boolean", ("worker",))
STARVATION = Family("shadow_pool_starvation_guard_total", "counter",
                    "pool entries dispatched by the age (starvation) guard", "requests")
#: Why the proxy cut a stream it had started relaying (`upstream_broke`: the upstream's body broke
#: off, or it relayed the upstream's error event and the client left on it before the break came;
#: `upstream_idle`: the upstream sent nothing for the idle deadline, `ActiveConfig.upstream_idle_s`;
#: a recomputed stream with `no_continuation` possible or whose `continuation_failed`).
CUT_REASONS = ("upstream_broke", "upstream_idle", "no_continuation", "continuation_failed")
STREAMS_CUT = Family("shadow_router_streams_cut_total", "counter",
                     "client streams cut after their first byte (an SSE error event unless the upstream left "
                     "one open, then an aborted body), by leg and reason", "requests", ("leg", "reason"),
                     {"leg": LEGS, "reason": CUT_REASONS})

#: Every family `ActiveMetrics` registers, in the order it registers them.
FAMILIES = (REQUESTS, DECISION, UPSTREAM_ERRORS, RETRIES, INFLIGHT, TRANSFERS, BACKPRESSURE, POOL_REQUESTS,
            POOL_OLDEST, POOL_WAIT, POOL_REAPED, FIRST_TOKEN, TPOT, COMPLETION, ROUND_STAGE, KV_TRANSFER,
            RECOMPUTED, RESUME_DROPPED, STARVATION, PLACEMENTS, WORKER_UP,
            STREAMS_CUT)


class ActiveMetrics:
    """Every metric of the active proxy, registered once on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = REQUESTS.counter(r)
        self.decision = DECISION.histogram(r)
        self.upstream_errors = UPSTREAM_ERRORS.counter(r)
        self.retries = RETRIES.counter(r)
        self.inflight = INFLIGHT.gauge(r)
        self.transfers = TRANSFERS.gauge(r)
        self.backpressure = BACKPRESSURE.counter(r)
        self.pool_requests = POOL_REQUESTS.gauge(r)
        self.pool_oldest = POOL_OLDEST.gauge(r)
        self.pool_wait = POOL_WAIT.histogram(r)
        self.pool_reaped = POOL_REAPED.counter(r)
        self.first_token = FIRST_TOKEN.histogram(r)
        self.tpot = TPOT.histogram(r)
        self.completion = COMPLETION.histogram(r)
        self.round_stage = ROUND_STAGE.histogram(r)
        self.kv_transfer = KV_TRANSFER.histogram(r)
        self.recomputed = RECOMPUTED.counter(r)
        self.resume_dropped = RESUME_DROPPED.counter(r)
        self.starvation = STARVATION.counter(r)
        self.placements = PLACEMENTS.counter(r)
        self.worker_up = WORKER_UP.gauge(r)
        self.streams_cut = STREAMS_CUT.counter(r)
        for reason in BACKPRESSURE.closed("reason"):
            self.backpressure.labels(reason)
        for leg in RETRIES.closed("leg"):
            self.retries.labels(leg)
        self.pool_requests.set(0)
        self.pool_oldest.set(0)
        for leg in STREAMS_CUT.closed("leg"):
            for reason in STREAMS_CUT.closed("reason"):
                self.streams_cut.labels(leg, reason)

    def know_workers(self, decode: Iterable[str], prefill: Iterable[str]) -> None:
        """Start each worker's error series at 0, so that `rate()` and `increase()` see its first
        errors (a series born at its first value shows no increase)."""
        for leg, names in (("decode", decode), ("prefill", prefill)):
            for name in names:
                self.upstream_errors.labels(leg, name)
