"""The active proxy's configuration (`ActiveConfig`): where its legs go and the operator's settings.

Its `knob` fields are `shadow serve --active`'s flags, YAML keys and env variables
(`shadow.base.knobs`); construction validates every value (ValueError naming the setting).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shadow.active.backoff import Backoff
from shadow.base.knobs import AT_LEAST_ONE, NON_NEGATIVE, OPEN_FRACTION, POSITIVE_S, check_knobs, knob
from shadow.core.params import BRParams
from shadow.vllm.sse import DEFAULT_MAX_FRAME

#: An upstream that sends nothing for this long (s) has failed the request: 502 before its answer
#: began, a cut stream (`upstream_idle`) after. Generous: a long prefill precedes the first token.
UPSTREAM_IDLE_S = 300.0


@dataclass
class ActiveConfig:
    """Where legs go ({name: base URL}); `router_url` takes shadow-mode requests."""

    decode: dict[str, str]
    slots: int
    prefill: dict[str, str] = field(default_factory=dict)
    prefill_metrics: dict[str, str] = field(default_factory=dict)  # default: <prefill url>/metrics
    router_url: str | None = None
    # the operator's settings (`shadow serve --active`): flags, YAML keys and env variables from here
    transfer_cap: int = knob(
        8, "--transfer-cap", "KV transfers in flight per decode worker (dispatched, no token yet)",
        AT_LEAST_ONE, metavar="N")
    dispatch_ahead: int = knob(
        0, "--dispatch-ahead", "pool routers place up to N requests per decode worker beyond its free slots "
        "(they queue there and start the moment a slot frees, hiding the dispatch round trip)",
        NON_NEGATIVE, metavar="N")
    pool_ttl_s: float = knob(
        60.0, "--pool-ttl", "a request waiting longer in the Prompt Pool gets 503 and its prefill KV is "
        "released", POSITIVE_S, metavar="SECONDS")
    bypass: bool = knob(
        False, "--pool-bypass", "policy br0 only: place each request when its prefill is done (BR-0's "
        "single-request score over running + dispatched-not-yet-running load, workers with a free slot "
        "first, the worker queues it) instead of in pool rounds; it waits in the pool only while every "
        "decode worker is at its --transfer-cap")
    kv_pause: float = knob(
        0.9, "--kv-pause", "no new prefill to a prefiller at this KV usage (its /metrics)", OPEN_FRACTION,
        metavar="FRACTION")
    kv_resume: float = knob(
        0.8, "--kv-resume", "... until it is below this again", OPEN_FRACTION, metavar="FRACTION")
    upstream_idle_s: float = knob(
        UPSTREAM_IDLE_S, "--upstream-idle", "an upstream (prefiller, decode worker, router) that sends "
        "nothing for this long fails its request: 502 before its answer began, a cut stream after (counted "
        "as upstream_idle); it covers the wait for a prefill too", POSITIVE_S, metavar="SECONDS")
    tick_s: float = 0.05
    br: BRParams = field(default_factory=BRParams)
    kv_poll_s: float = 1.0
    kv_backpressure: bool = True  # scrape the prefillers' KV usage and pause the full ones
    prefill_rule: str = "least"  # least outstanding work, or "rr" (round-robin)
    prefill_wait_s: float = 60.0
    retries: int = 3
    retry_delay_s: float = 0.001
    max_body_bytes: int = 8 << 20
    max_event_bytes: int = DEFAULT_MAX_FRAME  # an SSE event held whole; a larger one is forwarded as it comes
    max_connections: int = 1024
    resume_budget_bytes: int = 256 << 20  # all streams' bytes kept for recompute continuations
    timeout_s: float = 600.0
    api_key: str | None = None

    def backoff(self) -> Backoff:
        """The retry budget and backoff of every upstream call (`retries`, `retry_delay_s` doubling)."""
        return Backoff(self.retries, self.retry_delay_s)

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("need at least one decode backend")
        for url in [
            *self.decode.values(),
            *self.prefill.values(),
            *([self.router_url] if self.router_url else []),
        ]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        check_knobs(self)
        if self.slots < 1:
            raise ValueError("slots must be >= 1")
        if not self.tick_s > 0:
            raise ValueError("the tick must be > 0 s")
        if self.retries < 0 or self.max_body_bytes < 1 or self.max_connections < 1:
            raise ValueError("retries must be >= 0; body limit and connections >= 1")
