"""`shadow router`'s engine: the active proxy in a fixed mode with a binding rule, standing in for
an existing router (the vllm-ascend P/D proxy's JSQ rule, or vLLM's toy round-robin proxy).

It is `ActiveProxy` (prefill choice and leg, dispatcher, decode leg, SSE relay, retries only before
the first byte) in mode `active` with policy `jsq-bytes` — decode: least outstanding request-body
bytes, ties to the first registered; prefill: least 0.3 × outstanding prefill score — or `rr` (both
stages in turn); no mirror (the proxy's own ledger is its load view), no slot limit (requests are bound at
once, the workers queue them) and no KV back-pressure. Its /metrics adds the stand-in's own
families next to the proxy's: backends picked per stage, outstanding score per stage and backend
(decode: request-body bytes), and error answers by reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from shadow.active.proxy import ActiveConfig, ActiveProxy
from shadow.base.families import Family, SourceCollector
from shadow.base.knobs import AT_LEAST_ONE, NON_NEGATIVE, check_knobs, knob
from shadow.contracts.modes import StaticModeSource
from shadow.core.policies import REGISTRY, lookup
from shadow.telemetry.tracing import RoutingSpans

#: `shadow router --policy`: the binding rules active mode runs, by name or alias.
POLICIES: tuple[str, ...] = tuple(
    name for p in REGISTRY.values() if p.active and p.kind == "baseline" for name in (p.name, *p.aliases)
)
UNBOUNDED = 1 << 30  # slots and KV transfers per worker: a binding rule never waits for them


@dataclass
class RouterConfig:
    """Backends as {name: base URL}; `prefill` empty = plain mode (decode only).

    Its `knob` fields are `shadow router`'s flags (`shadow.base.knobs`); construction checks each
    (ValueError naming the flag)."""

    decode: dict[str, str]
    prefill: dict[str, str] = field(default_factory=dict)
    policy: str = knob(
        "jsq-bytes", "--policy", "routing rule: jsq-bytes (the vllm-ascend proxy's: least outstanding "
        "request-body bytes) or rr / round-robin", choices=POLICIES)
    max_body_bytes: int = knob(8 << 20, "--max-body-bytes", "request body limit (413 above)", AT_LEAST_ONE)
    max_connections: int = knob(1024, "--max-connections", "upstream connection pool size", AT_LEAST_ONE)
    retries: int = knob(
        3, "--prefill-retries", "retries of a request before anything reached the client: a failed prefill "
        "leg (on another prefiller when there is one), a decode leg that could not be sent; exponential "
        "backoff from 1 ms, none after HTTP 4xx", NON_NEGATIVE)
    api_key: str | None = None  # sent upstream as a bearer token when set

    def __post_init__(self) -> None:
        check_knobs(self)

    def decode_policy(self) -> str:
        """The policy's registry name (ValueError naming the known ones)."""
        p = lookup(self.policy)
        if p is None or self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        return p.name

    def active_config(self) -> ActiveConfig:
        """The active proxy's configuration for this router (ValueError on a bad one)."""
        policy = self.decode_policy()
        return ActiveConfig(
            decode=self.decode,
            slots=UNBOUNDED,
            prefill=self.prefill,
            transfer_cap=UNBOUNDED,
            kv_backpressure=False,
            prefill_rule="rr" if policy == "rr" else "least",
            retries=self.retries,
            max_body_bytes=self.max_body_bytes,
            max_connections=self.max_connections,
            api_key=self.api_key,
        )


PICKED = Family("shadow_router_decisions_total", "counter", "backends picked, by stage", "decisions",
                ("stage", "backend"), {"stage": ("prefill", "decode")})
SCORE = Family("shadow_router_outstanding_score", "gauge",
               "outstanding score per backend (prefill: the vllm-ascend score; decode: body bytes)", "score",
               ("stage", "backend"), {"stage": ("prefill", "decode")})
ERRORS = Family("shadow_router_errors_total", "counter", "requests answered with an error, by reason",
                "requests", ("reason",))
#: The stand-in's own families (beside the active proxy's), in the order they are yielded.
FAMILIES = (PICKED, SCORE, ERRORS)


class StandInCollector(SourceCollector[ActiveProxy]):
    """The stand-in's own families, read from the proxy's state at scrape time (same loop)."""

    families = FAMILIES

    def collect(self) -> Iterator[Metric]:
        p = self.source
        picked = {("prefill", pf.name): pf.picked for pf in p.prefill.prefillers}
        score = {("prefill", pf.name): pf.outstanding for pf in p.prefill.prefillers}
        for g, name in enumerate(p.decode_names):
            picked["decode", name] = p.ledger.dispatched[g]
            score["decode", name] = p.ledger.outstanding_tokens[g] * 4  # tokens = bytes / 4
        yield PICKED.sampled(picked)
        yield SCORE.sampled(score)
        yield ERRORS.sampled(dict(sorted(p.errors.items())))


def router_proxy(config: RouterConfig, registry: CollectorRegistry | None = None,
                 spans: RoutingSpans | None = None) -> ActiveProxy:
    """The stand-in router as an (unstarted) ActiveProxy; its `.app` is the ASGI app; `spans`:
    where its requests' spans go (default: nowhere; a `traceparent` is passed on as it came)."""
    modes = StaticModeSource("active", config.decode_policy())
    proxy = ActiveProxy(config.active_config(), modes=modes, registry=registry, spans=spans)
    proxy.registry.register(StandInCollector(proxy))
    return proxy
