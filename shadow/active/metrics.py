"""The active proxy's Prometheus metrics, on the registry it is given (label value sets:
`shadow.contracts.labels`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shadow.contracts.labels import BACKPRESSURE_REASONS, LEGS

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ActiveMetrics:
    """Every H10p metric of the active proxy, registered once on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "shadow_router_requests",
            "requests by effective mode, policy and outcome",
            ["mode", "policy", "outcome"],
            registry=r,
        )
        self.decision = Histogram(
            "shadow_router_decision_duration_seconds",
            "compute time of one dispatch round",
            ["policy"],
            buckets=_FAST,
            registry=r,
        )
        self.upstream_errors = Counter(
            "shadow_router_upstream_errors", "failed upstream calls", ["leg", "worker"], registry=r
        )
        self.retries = Counter(
            "shadow_router_retries", "retries before the first byte reached a client", ["leg"], registry=r
        )
        self.inflight = Gauge(
            "shadow_router_inflight", "requests in flight per upstream", ["leg", "worker"], registry=r
        )
        self.transfers = Gauge(
            "shadow_router_kv_transfers_inflight",
            "KV transfers in flight per decode worker (capped)",
            ["worker"],
            registry=r,
        )
        self.backpressure = Counter(
            "shadow_router_backpressure", "waits caused by back-pressure", ["reason"], registry=r
        )
        self.pool_requests = Gauge("shadow_pool_requests", "requests waiting in the Prompt Pool", registry=r)
        self.pool_oldest = Gauge("shadow_pool_oldest_seconds", "age of the oldest pool entry", registry=r)
        self.pool_wait = Histogram(
            "shadow_pool_wait_seconds",
            "time from prefill done to decode dispatch",
            buckets=_LATENCY,
            registry=r,
        )
        self.pool_reaped = Counter(
            "shadow_pool_reaped", "pool entries released by the TTL reaper", registry=r
        )
        self.first_token = Histogram(
            "shadow_router_first_token_seconds",
            "time to first token the client saw, through the proxy",
            ["mode", "prompt_bucket"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "shadow_router_tpot_seconds",
            "mean time per output token of a finished stream, as the client saw it",
            ["mode", "prompt_bucket"],
            buckets=_TPOT,
            registry=r,
        )
        self.completion = Histogram(
            "shadow_router_completion_seconds",
            "request start to last byte, as the client saw it",
            ["mode", "prompt_bucket"],
            buckets=_LATENCY,
            registry=r,
        )
        self.round_stage = Histogram(
            "shadow_router_round_stage_seconds",
            "compute time of BR Stage 1 and Stage 2 within a round",
            ["round_stage"],
            buckets=_FAST,
            registry=r,
        )
        self.kv_transfer = Histogram(
            "shadow_router_kv_transfer_seconds",
            "decode dispatch to first decode token",
            buckets=_LATENCY,
            registry=r,
        )
        self.recomputed = Counter(
            "shadow_router_recomputed", 'decode legs that ended with stop_reason "recomputed"', registry=r
        )
        self.resume_dropped = Counter(
            "shadow_router_resume_dropped",
            "streams that stopped keeping their bytes for a recompute continuation (resume budget)",
            registry=r,
        )
        self.starvation = Counter(
            "shadow_pool_starvation_guard",
            "pool entries dispatched by the age (starvation) guard",
            registry=r,
        )
        for reason in BACKPRESSURE_REASONS:
            self.backpressure.labels(reason)
        for leg in LEGS:
            self.retries.labels(leg)
        self.pool_requests.set(0)
        self.pool_oldest.set(0)
