"""`shadow router`'s engine: the active proxy in a fixed mode with a binding rule, standing in for
an existing router (the vllm-ascend P/D proxy's JSQ rule, or vLLM's toy round-robin proxy).

It is `ActiveProxy` (prefill choice and leg, dispatcher, decode leg, SSE relay, retries only before
the first byte) in mode `active` with policy `jsq` — decode: least outstanding request-body bytes,
ties to the first registered; prefill: least 0.3 × outstanding prefill score — or `rr` (both stages
in turn); no mirror (the proxy's own ledger is its load view), no slot limit (requests are bound at
once, the workers queue them) and no KV back-pressure. Its /metrics adds the stand-in's own
families next to the proxy's: backends picked per stage, outstanding score per stage and backend
(decode: request-body bytes), and error answers by reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shadow.active.proxy import ActiveConfig, ActiveProxy
from shadow.contracts.modes import StaticModeSource

#: `shadow router --policy` → (the proxy's decode policy, the prefill rule)
POLICIES: dict[str, tuple[str, str]] = {"jsq-bytes": ("jsq", "least"), "round-robin": ("rr", "rr")}
UNBOUNDED = 1 << 30  # slots and KV transfers per worker: a binding rule never waits for them


@dataclass
class RouterConfig:
    """Backends as {name: base URL}; `prefill` empty = plain mode (decode only)."""

    decode: dict[str, str]
    prefill: dict[str, str] = field(default_factory=dict)
    policy: str = "jsq-bytes"
    max_body_bytes: int = 8 << 20
    max_connections: int = 1024
    retries: int = 3  # attempts again before anything reached the client (none after HTTP 4xx)
    api_key: str | None = None  # sent upstream as a bearer token when set

    def active_config(self) -> ActiveConfig:
        """The active proxy's configuration for this router (ValueError on a bad one)."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        return ActiveConfig(
            decode=self.decode,
            slots=UNBOUNDED,
            prefill=self.prefill,
            transfer_cap=UNBOUNDED,
            kv_backpressure=False,
            prefill_rule=POLICIES[self.policy][1],
            retries=self.retries,
            max_body_bytes=self.max_body_bytes,
            max_connections=self.max_connections,
            api_key=self.api_key,
        )


class StandInCollector(Collector):
    """The stand-in's own families, read from the proxy's state at scrape time (same loop)."""

    def __init__(self, proxy: ActiveProxy) -> None:
        self.proxy = proxy

    def collect(self) -> Iterator[Metric]:
        p = self.proxy
        picked = CounterMetricFamily(
            "shadow_router_decisions", "backends picked, by stage", labels=["stage", "backend"]
        )
        score = GaugeMetricFamily(
            "shadow_router_outstanding_score",
            "outstanding score per backend (prefill: the vllm-ascend score; decode: body bytes)",
            labels=["stage", "backend"],
        )
        for pf in p.prefill.prefillers:
            picked.add_metric(["prefill", pf.name], pf.picked)
            score.add_metric(["prefill", pf.name], pf.outstanding)
        for g, name in enumerate(p.decode_names):
            picked.add_metric(["decode", name], p.ledger.dispatched[g])
            score.add_metric(["decode", name], p.ledger.outstanding_tokens[g] * 4)  # tokens = bytes / 4
        errors = CounterMetricFamily("shadow_router_errors", "requests answered with an error, by reason",
                                     labels=["reason"])
        for reason, n in sorted(p.errors.items()):
            errors.add_metric([reason], n)
        yield from (picked, score, errors)


def router_proxy(config: RouterConfig, registry: CollectorRegistry | None = None) -> ActiveProxy:
    """The stand-in router as an (unstarted) ActiveProxy; its `.app` is the ASGI app."""
    modes = StaticModeSource("active", POLICIES[config.policy][0])
    proxy = ActiveProxy(config.active_config(), modes=modes, registry=registry)
    proxy.registry.register(StandInCollector(proxy))
    return proxy
