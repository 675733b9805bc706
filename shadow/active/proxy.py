"""The active P/D proxy: an ASGI app that routes OpenAI completions itself or passes them on.

Per request it asks the `ModeSource` once (`choose`): in `shadow` mode the request goes to the
existing router unchanged (bytes, status and headers relayed as they come; retried only when it
did not completely leave); in `active`/`fallback` it runs the P/D flow — the prefill leg
(not streamed, `max_tokens=1`, `min_tokens=1`, `kv_transfer_params.do_remote_decode`) on the
prefiller `PrefillChooser` picks, the request then waits in the `Dispatcher`'s pool for a decode
worker, and the decode leg (the client's body plus the returned `kv_transfer_params`) is relayed
back. Plain fleets (no prefillers) skip the prefill leg. Both legs carry one `X-Request-Id` (also
returned to the client). Failures before the first byte reached the client are retried (bounded):
a prefill that did not completely leave (`upstream.Unsent`) or an upstream's error answer re-runs
the whole flow; a decode leg that did not completely leave goes back to the pool with the same KV
handle; a request already written upstream is never sent again (502). After the first byte a
stream the upstream breaks off (or leaves silent for `upstream_idle_s`) ends in an SSE error event,
unless the upstream left an event open, and a body that never ends; one that ends cleanly with
neither a `finish_reason` nor `[DONE]` is counted `stream_incomplete`. A decode stream ending with
`stop_reason: "recomputed"` continues on a new P/D flow (prompt + text so far, remaining
`max_tokens`) within the same client stream. A client that goes away frees its pool entry or
decode slot at once. Each upstream has its own persistent connection pool.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from shadow.active.cohorts import client_fault
from shadow.active.dispatcher import DispatchConfig, Dispatcher, PoolExpired
from shadow.active.ledger import Ledger, LoadSource, NoSource
from shadow.active.metrics import ActiveMetrics
from shadow.active.prefill import KvPoller, PrefillChooser, Prefiller, prefill_score
from shadow.active.upstream import Unsent, send
from shadow.base.hopbyhop import HOP_BY_HOP
from shadow.base.knobs import AT_LEAST_ONE, NON_NEGATIVE, OPEN_FRACTION, POSITIVE_S, check_knobs, knob
from shadow.base.logthrottle import Throttled
from shadow.contracts.labels import STREAM_INCOMPLETE, prompt_bucket
from shadow.contracts.modes import ModeSource, StaticModeSource
from shadow.core.cost import RouteCost
from shadow.core.params import BRParams
from shadow.core.routers import Router
from shadow.mirror.analyzer import estimate_prompt_tokens
from shadow.telemetry.httpspans import (
    client_failed,
    client_status,
    http_client_span,
    http_server_span,
    http_status,
    inject_span,
)
from shadow.telemetry.tracing import RoutingSpans, exemplar
from shadow.vllm.errors import cut_event
from shadow.vllm.sse import DEFAULT_MAX_FRAME, EventSplitter, event_data

log = logging.getLogger("shadow.active")
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})  # replaced by ours on the way up

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: Not relayed in shadow-mode passthrough: the hop-by-hop headers, those our server re-frames, and
#: proxy credentials (consumed here, never passed on).
PASSTHROUGH_DROPS = HOP_BY_HOP | {"host", "content-length", "proxy-authenticate", "proxy-authorization"}
MAX_ABORTED = 4096  # abandoned KV handles remembered per prefiller
MAX_RESUME_BYTES = 4 << 20  # stream bytes kept per request for a recompute continuation
DONE_TAIL = 32  # bytes of a relayed stream kept to see its end marker
#: The head of an SSE data field carrying an error object (vLLM's, a tap's or a router's cut event).
_ERROR_DATA = re.compile(rb'data:\s*\{\s*"error"\s*:')
#: A choice's finish reason given (a string): its stream reached its end.
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"')
GATEWAY_DOWN = (502, 504)  # a decode worker's tap could not reach it: the worker is down
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

    def backoff_s(self, retry: int) -> float:
        """The wait before retry `retry` (1, 2, ...) of an upstream call: `retry_delay_s` doubling."""
        return self.retry_delay_s * 2.0 ** (retry - 1)

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


class _Failed(Exception):
    """An upstream attempt failed before anything reached the client (retryable unless final).

    `kind` names the failure (the error body's `type`, or `<leg>_status` for an upstream's own
    error answer); `kv` is the prefill's KV handle when the decode leg failed before any of its
    bytes were written (the decode worker never saw it: a retry may use it again)."""

    def __init__(
        self,
        status: int,
        content: bytes,
        media: str,
        retryable: bool,
        leg: str,
        worker: str,
        kind: str = "",
        kv: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{leg} {worker}: HTTP {status}")
        self.status, self.content, self.media = status, content, media
        self.retryable, self.leg, self.worker = retryable, leg, worker
        self.kind = kind or f"{leg}_status"
        self.kv = kv

    @classmethod
    def ours(
        cls, status: int, message: str, kind: str, retryable: bool, leg: str, worker: str = ""
    ) -> _Failed:
        """A failure the proxy answers itself (JSON error body of `kind`)."""
        body = _error_body(status, message, kind)
        return cls(status, body, "application/json", retryable, leg, worker, kind)

    def holding(self, kv: dict[str, Any] | None) -> _Failed:
        self.kv = kv
        return self


class _Gone(Exception):
    """The client went away while its request waited."""


class _StreamCut(Exception):
    """Raised by a relayed body after its last bytes: end the response without completing it."""


def _cut_event(leg: str, reason: str, tail: bytes) -> bytes | None:
    """The SSE error event that ends a cut stream, None when `tail` (the last bytes sent) leaves an
    event open (`vllm.errors.cut_event`: the stream is cut without one)."""
    return cut_event(f"shadow proxy: the {leg} stream was cut ({reason})", tail)


def _cut_reason(exc: httpx.HTTPError) -> str:
    """Why an upstream's answer broke off: it sent nothing for `upstream_idle_s`, or it broke."""
    return "upstream_idle" if isinstance(exc, httpx.ReadTimeout) else "upstream_broke"


def _finished(chunk: bytes, before: bytes) -> bool:
    """`chunk` of an event stream names a `finish_reason` (a string, not null), also across its
    start (`before`: the bytes relayed just before it)."""
    return _FINISH.search(chunk) is not None or _FINISH.search(before + chunk[:DONE_TAIL]) is not None


def _error_body(status: int, message: str, kind: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}})


@dataclass
class _Flow:
    """One request's routing state across its (re)tried and recomputed legs."""

    rid: str
    path: str
    mode: str
    policy: str
    body: dict[str, Any]
    raw: bytes
    t0: float
    bucket: str
    prefiller: Prefiller | None = None
    prefill_cost: float = 0.0
    worker: int = -1
    dispatched_at: float = 0.0
    prompt_tokens: int = 0
    kv_from: str = ""  # the prefiller holding this request's KV until a decode pulls it
    call: trace.Span | None = None  # the decode call's CLIENT span while its answer streams


class ActiveProxy:
    """See module docstring. `start()` opens pools and the dispatcher tick; `close()` ends them."""

    def __init__(
        self,
        config: ActiveConfig,
        *,
        modes: ModeSource | None = None,
        source: LoadSource | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        router_factory: Callable[[str], Router] | None = None,
        spans: RoutingSpans | None = None,
        metrics_route: bool = True,
        cost: Callable[[], RouteCost] | None = None,
    ) -> None:
        """`router_factory(policy)`: the decode router per policy (default: `make_router`'s);
        `spans`: where the dispatcher's rounds and admissions are traced (default: nowhere);
        `metrics_route`: serve `registry` on GET /metrics (off where clients reach this app and
        the metrics are served elsewhere: `shadow serve` serves them on its API listener);
        `cost`: the fleet's step cost now, which the BalanceRoute policies balance (default: the
        paper's KV tokens; see `Dispatcher`)."""
        self.config = config
        self.modes: ModeSource = modes or StaticModeSource("active", "br0")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ActiveMetrics(self.registry)
        self.metrics.know_workers(config.decode, config.prefill)
        self.clock = clock
        self.decode_names = list(config.decode)
        self.decode_urls = [u.rstrip("/") for u in config.decode.values()]
        self.ledger = Ledger(
            len(self.decode_names), config.slots, config.transfer_cap, ahead=config.dispatch_ahead
        )
        self.source = source or NoSource(len(self.decode_names))
        self.dispatcher = Dispatcher(
            DispatchConfig(
                self.decode_names,
                config.slots,
                config.transfer_cap,
                config.pool_ttl_s,
                config.tick_s,
                config.bypass,
                config.br,
            ),
            self.ledger,
            self.source,
            self.metrics,
            self.modes,
            clock,
            router_factory,
            cost,
        )
        if spans is not None:
            self.dispatcher.spans = spans
        self.tracer = spans.tracer if spans is not None else trace.NoOpTracer()
        self.prefill = PrefillChooser(
            config.prefill,
            self.metrics,
            pause_at=config.kv_pause,
            resume_at=config.kv_resume,
            rule=config.prefill_rule,
        )
        targets = {
            n: config.prefill_metrics.get(n, u.rstrip("/") + "/metrics")
            for n, u in config.prefill.items()
            if config.kv_backpressure
        }
        self.poller = KvPoller(targets, self.prefill.update_kv, interval_s=config.kv_poll_s)
        self._clients: dict[str, httpx.AsyncClient] = {}
        # KV handles nobody will pull (pool TTL, client gone), per prefiller: sent as
        # `kv_transfer_params.aborted_request` with its next prefill leg so it frees them
        self._aborted: dict[str, list[str]] = {}
        self._resume_bytes = 0  # stream bytes kept by all streams for a recompute continuation
        self.resume_dropped = 0  # streams that stopped keeping them (budget): shown on /health
        self.oversized_events = 0  # SSE events over `max_event_bytes` (forwarded unaligned)
        self.errors: collections.Counter[str] = collections.Counter()  # error answers by kind
        self.rejected_log = Throttled(log)  # requests refused for what the client sent
        self.retry_log = Throttled(log)  # upstream failures a retry hid from the client
        # streams cut after their first byte, by (leg, reason): the client got an error event
        self.cut: collections.Counter[tuple[str, str]] = collections.Counter()
        self.router_url = config.router_url.rstrip("/") if config.router_url else None
        self.app = Starlette(
            routes=[
                *(Route(p, self._generate, methods=["POST"]) for p in GENERATE_PATHS),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/healthcheck", self._health, methods=["GET"]),
                *([Route("/metrics", self._metrics_endpoint, methods=["GET"])] if metrics_route else []),
            ],
            lifespan=self._lifespan,
        )

    # -- lifecycle ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.close()

    async def start(self) -> None:
        if self._clients:
            return
        c = self.config
        limits = httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=c.max_connections)
        timeout = httpx.Timeout(c.timeout_s, connect=10.0, read=c.upstream_idle_s)
        for url in {
            *self.decode_urls,
            *(p.url for p in self.prefill.prefillers),
            *([self.router_url] if self.router_url else []),
        }:
            self._clients[url] = httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)
        self.dispatcher.start()
        self.poller.start()

    async def close(self) -> None:
        await self.dispatcher.stop()
        await self.poller.stop()
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def _client(self, url: str) -> httpx.AsyncClient:
        client = self._clients.get(url)
        if client is None:
            raise RuntimeError("proxy not started")
        return client

    # -- small endpoints ---------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "prefill_instances": len(self.prefill.prefillers),
                "decode_instances": len(self.decode_names),
                "request_num": len(self.ledger),
                "resume_dropped": self.resume_dropped,
                "oversized_events": self.oversized_events,
                "pool": len(self.dispatcher.waiting),
            }
        )

    async def _metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def _models(self, request: Request) -> Response:
        for url in [*self.decode_urls, *(p.url for p in self.prefill.prefillers)]:
            with contextlib.suppress(httpx.HTTPError):
                r = await self._client(url).get(url + "/v1/models", timeout=10.0)
                if r.status_code == 200:
                    return Response(r.content, media_type="application/json")
        return self._error(503, "no backend answered /v1/models", "unavailable")

    def _error(self, status: int, message: str, kind: str, rid: str | None = None) -> Response:
        self.errors[kind] += 1
        if status < 500:
            self.rejected_log.warning(kind, "request rejected (%s): %s", status, message, kind=kind)
        else:
            log.warning("request failed (%s): %s", status, message, extra={"kind": kind, "request_id": rid})
        headers = {"X-Request-Id": rid} if rid else None
        return Response(
            _error_body(status, message, kind),
            status_code=status,
            media_type="application/json",
            headers=headers,
        )

    def _headers(self, rid: str, call: trace.Span) -> dict[str, str]:
        """An upstream call's headers; its `traceparent` names the call's CLIENT span `call`."""
        h = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if self.config.api_key:
            h["Authorization"] = f"Bearer {self.config.api_key}"
        return inject_span(call, h)

    async def _send(self, call: trace.Span, client: httpx.AsyncClient, req: httpx.Request,
                    gone: asyncio.Future[Any] | None, stream: bool = False) -> httpx.Response:
        """`req` sent (raced against `gone`) in its CLIENT span `call`, which records the answer's
        status or the failure; it ends here unless a `stream`ed answer follows (its reader ends it)."""
        try:
            aw = send(client, req, stream=stream)
            r: httpx.Response = await (_race(aw, gone) if gone is not None else aw)
        except BaseException as exc:
            client_failed(call, exc)
            call.end()
            raise
        client_status(call, r.status_code)
        if not stream:
            call.end()
        return r

    def _count(self, mode: str, policy: str, outcome: str, status: int | None = None,
               ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        """One request ended: counted, and reported to the mode source as its client saw it."""
        self.metrics.requests.labels(mode, policy, outcome).inc()
        self.modes.on_request(mode, outcome, status, ttft_s, tpot_s)

    # -- the request -------------------------------------------------------------------------
    async def _read_body(self, request: Request) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _generate(self, request: Request) -> Response:
        """A generation request in a SERVER span, child of its `traceparent` (if any); the span ends
        with the response's last byte, and every upstream call carries it as the parent."""
        url = request.url
        span = http_server_span(self.tracer, request.headers, request.method, url.path, url.path,
                                url.scheme, url.hostname, url.port)
        ctx = trace.set_span_in_context(span)
        token = otel_context.attach(ctx)
        try:
            response = await self._generate_in_context(request)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise
        finally:
            otel_context.detach(token)
        http_status(span, response.status_code)
        if isinstance(response, StreamingResponse) and span.get_span_context().is_valid:
            response.body_iterator = _in_span(response.body_iterator, span, ctx)
        else:  # (no trace at all: tracing off and no traceparent, nothing to carry on)
            span.end()
        return response

    async def _generate_in_context(self, request: Request) -> Response:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        choice = self.modes.choose(rid)
        mode, policy = choice.mode, choice.policy
        if mode == "shadow" and self.router_url is None:
            policy = "rr"  # nothing to pass to: route round-robin ourselves
        elif mode == "fallback":
            policy = "rr"
        try:
            raw = await self._read_body(request)
        except ClientDisconnect:
            self._count(mode, policy, "client_cancel")
            self.errors["client_gone"] += 1
            return Response(status_code=499)
        if raw is None:
            self._count(mode, policy, "rejected", 413)
            return self._error(413, f"request body over {self.config.max_body_bytes} bytes", "too_large")
        if mode == "shadow" and self.router_url is not None:
            return await self._passthrough(request, raw, rid, t0)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            self._count(mode, policy, "rejected", 400)
            return self._error(400, "request body must be a JSON object", "bad_request")
        est = estimate_prompt_tokens(body)
        flow = _Flow(
            rid,
            request.url.path,
            mode,
            policy,
            body,
            raw,
            t0,
            prompt_bucket(est if est is not None else len(raw) // 4),
        )
        flow.prompt_tokens = est if est is not None else max(1, len(raw) // 4)
        return await self._route(flow, request.receive)

    async def _route(self, flow: _Flow, receive: Receive) -> Response:
        gone = asyncio.get_running_loop().create_task(_wait_disconnect(receive))
        try:
            try:
                upstream = await self._attempts(flow, gone)
            except _Gone:
                self._count(flow.mode, flow.policy, "client_cancel")
                return Response(status_code=499)
            except _Failed as f:
                self.errors[f.kind] += 1
                refused = (f.leg == "pool" and f.status in (429, 503)) or (
                    f.leg != "pool" and client_fault(f.status)
                )
                if refused:
                    self.rejected_log.warning(f.kind, "request refused (%s) on the %s leg: %s", f.status,
                                              f.leg, f.kind, kind=f.kind)
                else:
                    log.warning("request failed (%s): %s leg, worker %s", f.status, f.leg, f.worker or "-",
                                extra={"kind": f.kind, "request_id": flow.rid, "mode": flow.mode})
                self._count(flow.mode, flow.policy, "rejected" if refused else "upstream_error", f.status)
                return Response(
                    f.content, status_code=f.status, media_type=f.media, headers={"X-Request-Id": flow.rid}
                )
        finally:
            gone.cancel()
            with contextlib.suppress(BaseException):
                await gone
        if not flow.body.get("stream"):
            return await self._respond_whole(flow, upstream)
        media = upstream.headers.get("content-type", "text/event-stream")
        return _Relay(
            self._relay(flow, upstream), status_code=200, media_type=media, headers={"X-Request-Id": flow.rid}
        )

    async def _attempts(self, flow: _Flow, gone: asyncio.Future[Any]) -> httpx.Response:
        """Prefill, pool and decode leg, retried while nothing reached the client: as a whole, or
        from the pool on when the decode leg failed unsent (its KV handle was never used)."""
        failed_prefill: list[str] = []
        attempt = 0
        kv: dict[str, Any] | None = None  # a prefill's KV handle still unused (this call owns it)
        while True:
            try:
                return await self._legs(flow, gone, failed_prefill, kv)
            except _Failed as f:
                kv, leg, worker, status, kind = f.kv, f.leg, f.worker, f.status, f.kind
                if not f.retryable or attempt >= self.config.retries:
                    self._abort_kv(flow, kv)
                    raise
            attempt += 1
            self.metrics.retries.labels(leg).inc()
            how = ", its KV handle reused" if kv is not None else ", a new prefill" if self.prefill else ""
            self.retry_log.warning(
                f"{leg}:{kind}", "request retried (attempt %d%s): the %s leg failed on %s (%s, %s)",
                attempt + 1, how, leg, worker or "-", status, kind, kind=kind, request_id=flow.rid,
            )
            if leg == "prefill":
                failed_prefill.append(worker)
                if len(failed_prefill) >= len(self.prefill.prefillers):
                    failed_prefill.clear()
            try:
                await _race(asyncio.sleep(self.config.backoff_s(attempt)), gone)
            except BaseException:
                self._abort_kv(flow, kv)
                raise

    async def _legs(
        self, flow: _Flow, gone: asyncio.Future[Any], exclude: list[str], kv: dict[str, Any] | None
    ) -> httpx.Response:
        """One attempt; `kv`: a handle from an earlier attempt's prefill (no prefill leg then)."""
        if kv is None and self.prefill:
            kv = await self._prefill_leg(flow, gone, exclude)
        try:
            fut = self.dispatcher.submit(
                flow.rid, flow.prompt_tokens, len(flow.raw) / 4, flow.policy, flow.mode
            )
            try:
                g = await _race(fut, gone)
            except _Gone:
                if not self.dispatcher.cancel(flow.rid):
                    self.dispatcher.released(flow.rid)
                self._abort_kv(flow, kv)
                raise
            except PoolExpired as exc:
                self._abort_kv(flow, kv)
                raise _Failed.ours(
                    503, f"no decode slot in time: {exc}", "pool_timeout", False, "pool"
                ) from None
            flow.worker, flow.dispatched_at = g, time.perf_counter()
            return await self._decode_leg(flow, kv, gone)
        except BaseException:
            self._release_prefill(flow)
            raise

    async def _prefill_leg(
        self, flow: _Flow, gone: asyncio.Future[Any], exclude: list[str]
    ) -> dict[str, Any]:
        cost = prefill_score(len(flow.raw))
        try:
            p = await _race(self.prefill.acquire(cost, exclude, self.config.prefill_wait_s), gone)
        except TimeoutError:
            raise _Failed.ours(
                503, "every prefiller is over its KV budget", "prefill_kv", False, "pool"
            ) from None
        flow.prefiller, flow.prefill_cost = p, cost
        leg = dict(flow.body)
        leg.pop("stream_options", None)
        kvp = dict(PREFILL_KV_PARAMS)
        aborted = self._aborted.pop(p.name, None)
        if aborted:
            kvp["aborted_request"] = aborted
        leg.update(stream=False, max_tokens=1, min_tokens=1, kv_transfer_params=kvp)
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        client = self._client(p.url)
        call = http_client_span(self.tracer, "POST", p.url + flow.path, p.name, "prefill")
        req = client.build_request(
            "POST", p.url + flow.path, content=orjson.dumps(leg), headers=self._headers(flow.rid, call)
        )
        try:
            r = await self._send(call, client, req, gone)
        except (Unsent, httpx.HTTPError) as exc:
            self._upstream_failed(p.name, "prefill")
            p.down = True
            self._release_prefill(flow)
            if isinstance(exc, Unsent):  # it never got the whole request: another prefiller may
                raise _Failed.ours(
                    502, f"prefill {p.name} unreachable: {type(exc.cause).__name__}", "prefill_unreachable",
                    True, "prefill", p.name,
                ) from None
            raise _Failed.ours(  # written: it may be running it (and hold its KV), never sent again
                502, f"prefill {p.name} failed before answering: {type(exc).__name__}", "prefill_no_answer",
                False, "prefill", p.name,
            ) from None
        except BaseException:
            self._release_prefill(flow)
            raise
        ok = r.status_code == 200
        params: Any = None
        if ok:
            try:
                doc = orjson.loads(r.content)
                params = doc.get("kv_transfer_params")
                usage = doc.get("usage") or {}
                if isinstance(usage.get("prompt_tokens"), int):
                    flow.prompt_tokens = usage["prompt_tokens"]
            except (orjson.JSONDecodeError, AttributeError):
                params = None
        fault = not ok and client_fault(r.status_code)  # the request's own fault, not the prefiller's
        self.modes.on_upstream(p.name, "prefill", (ok and isinstance(params, dict)) or fault)
        if ok and isinstance(params, dict):
            p.down = False
            flow.kv_from = p.name
            return params
        if not ok and not fault:
            self.metrics.upstream_errors.labels("prefill", p.name).inc()
        self._release_prefill(flow)
        if ok:
            raise _Failed.ours(
                502, f"prefill {p.name} returned no kv_transfer_params", "prefill_bad_response", False,
                "prefill", p.name,
            )
        p.down = r.status_code >= 500
        raise _Failed(
            r.status_code,
            r.content,
            r.headers.get("content-type", "application/json"),
            r.status_code >= 500 or r.status_code == 429,
            "prefill",
            p.name,
        )

    def _abort_kv(self, flow: _Flow, kv: dict[str, Any] | None) -> None:
        key = kv.get("remote_request_id") if kv else None
        if isinstance(key, str) and flow.kv_from:
            pending = self._aborted.setdefault(flow.kv_from, [])
            pending.append(key)
            del pending[:-MAX_ABORTED]

    def _release_prefill(self, flow: _Flow) -> None:
        if flow.prefiller is not None:
            self.prefill.release(flow.prefiller, flow.prefill_cost)
            flow.prefiller = None

    def _upstream_failed(self, worker: str, leg: str) -> None:
        self.metrics.upstream_errors.labels(leg, worker).inc()
        self.modes.on_upstream(worker, leg, False)

    def _failed_by_event(self, outcome: str, leg: str, worker: int) -> str:
        """A relayed stream that carried an SSE error event failed upstream, whether the client then
        left (it raises on the event, often before the break behind it reaches the proxy: counted
        as the cut it is) or the stream ended: `upstream_error`, and the upstream is told failed."""
        if outcome not in ("ok", "client_cancel", STREAM_INCOMPLETE):
            return outcome
        self._upstream_failed(self.decode_names[worker] if worker >= 0 else "router", leg)
        if outcome == "client_cancel":
            self.cut[(leg, "upstream_broke")] += 1
            self.metrics.streams_cut.labels(leg, "upstream_broke").inc()
        return "upstream_error"

    async def _decode_leg(
        self, flow: _Flow, kv: dict[str, Any] | None, gone: asyncio.Future[Any]
    ) -> httpx.Response:
        g = flow.worker
        name, url = self.decode_names[g], self.decode_urls[g]
        self.metrics.inflight.labels("decode", name).set(self.ledger.outstanding[g])
        if kv is None:
            payload = flow.raw
        else:
            body = dict(flow.body)
            body["kv_transfer_params"] = kv
            payload = orjson.dumps(body)
        client = self._client(url)
        call = http_client_span(self.tracer, "POST", url + flow.path, name, "decode")
        req = client.build_request("POST", url + flow.path, content=payload,
                                   headers=self._headers(flow.rid, call))
        try:
            upstream = await self._send(call, client, req, gone, stream=True)
            flow.call = call
        except Unsent as u:  # the worker never got the whole request: try again, same KV handle
            self._decode_over(flow, None)
            self.ledger.unreachable(g, self.clock())  # (elsewhere, while it stays down)
            self._upstream_failed(name, "decode")
            raise _Failed.ours(
                502, f"decode {name} unreachable: {type(u.cause).__name__}", "decode_unreachable", True,
                "decode", name,
            ).holding(kv) from None
        except httpx.HTTPError as exc:  # written: the worker may be running it, never sent again
            self._decode_over(flow, None)
            self._upstream_failed(name, "decode")
            raise _Failed.ours(
                502, f"decode {name} failed before answering: {type(exc).__name__}", "decode_no_answer",
                False, "decode", name,
            ) from None
        except BaseException:
            self._decode_over(flow, None)
            raise
        status = upstream.status_code
        if status in GATEWAY_DOWN:  # its tap could not reach it
            self.ledger.unreachable(g, self.clock())
        else:
            self.ledger.reached(g)
        if status == 200:
            self.modes.on_upstream(name, "decode", True)
            return upstream
        try:
            content = await upstream.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await upstream.aclose()
        self._decode_over(flow, None)
        if client_fault(status):  # the request's own fault: the worker is fine
            self.modes.on_upstream(name, "decode", True)
        else:
            self._upstream_failed(name, "decode")
        # The worker answered, so it had the KV handle (it may have pulled or dropped the blocks):
        # a retry runs the whole flow, with a fresh prefill.
        raise _Failed(
            upstream.status_code,
            content,
            upstream.headers.get("content-type", "application/json"),
            upstream.status_code >= 500 or upstream.status_code == 429,
            "decode",
            name,
        )

    def _decode_over(self, flow: _Flow, output_tokens: int | None) -> None:
        call, flow.call = flow.call, None
        if call is not None:  # the decode call is over: its CLIENT span ends
            call.end()
        self.dispatcher.released(flow.rid, output_tokens)
        if flow.worker >= 0:
            self.metrics.inflight.labels("decode", self.decode_names[flow.worker]).set(
                self.ledger.outstanding[flow.worker]
            )

    def _first_token(self, flow: _Flow, t: float) -> None:
        self.dispatcher.transfer_done(flow.rid)
        self._release_prefill(flow)  # the decode pulled the KV
        self.metrics.kv_transfer.observe(max(0.0, t - flow.dispatched_at))

    async def _respond_whole(self, flow: _Flow, upstream: httpx.Response) -> Response:
        """A non-streamed request: read the whole answer (a recomputed one is re-run, nothing was sent)."""
        outcome = "ok"
        for _ in range(self.config.retries + 1):
            try:
                content = await upstream.aread()
            except httpx.HTTPError:
                content, outcome = b"", "upstream_error"
                self._upstream_failed(self.decode_names[flow.worker], "decode")
            finally:
                await upstream.aclose()
            t = time.perf_counter()
            self._first_token(flow, t)
            self._decode_over(flow, None)
            if b'"recomputed"' not in content or not _whole_recomputed(content):
                break
            self.metrics.recomputed.inc()
            try:
                upstream = await self._attempts(flow, asyncio.get_running_loop().create_future())
            except _Failed as f:
                self.errors[f.kind] += 1
                self._count(flow.mode, flow.policy, "upstream_error", f.status)
                return Response(f.content, status_code=f.status, media_type=f.media)
        elapsed = time.perf_counter() - flow.t0
        self.metrics.first_token.labels(flow.mode, flow.bucket).observe(elapsed, exemplar())
        self.metrics.completion.labels(flow.mode, flow.bucket).observe(elapsed, exemplar())
        self._count(flow.mode, flow.policy, outcome, 200 if outcome == "ok" else 502, elapsed)
        if outcome != "ok":
            return self._error(502, "decode answer broke off", "decode_stream", flow.rid)
        return Response(
            content,
            status_code=200,
            media_type=upstream.headers.get("content-type", "application/json"),
            headers={"X-Request-Id": flow.rid},
        )

    async def _relay(self, flow: _Flow, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """Relay SSE events as they come, each as soon as its blank line arrives (any line ends;
        an event over `max_event_bytes` is forwarded as it comes); continue a recomputed stream. A
        stream that ends with neither a `finish_reason` nor `[DONE]` is counted `stream_incomplete`."""
        outcome = "client_cancel"
        cut_reason = ""  # why the stream ended early, if it did
        errored = False  # an error event was relayed: the upstream failed the request
        events = 0
        t_first = 0.0
        tail = b""  # the last bytes sent to the client
        kept: list[bytes] | None = []  # what was sent, for a recompute continuation
        kept_bytes = 0
        try:
            while True:
                split = EventSplitter(self.config.max_event_bytes)
                recomputed = False
                finished = False  # this leg's stream named a finish reason
                first = True
                async for chunk in upstream.aiter_raw():
                    if first:
                        first = False
                        t = time.perf_counter()
                        self._first_token(flow, t)
                        if not t_first:
                            t_first = t
                            ttft = t - flow.t0
                            self.metrics.first_token.labels(flow.mode, flow.bucket).observe(ttft, exemplar())
                    pieces = split.feed(chunk)
                    if not pieces:
                        continue
                    sent: list[bytes] = []
                    for piece, whole in pieces:
                        if whole and b'"recomputed"' in piece and _recomputed(piece):
                            recomputed = True
                            break
                        sent.append(piece)
                        if whole and _is_chunk(piece):
                            events += 1
                            errored = errored or _ERROR_DATA.search(piece, 0, 64) is not None
                    self.oversized_events += split.oversized
                    split.oversized = 0
                    if sent:
                        out = b"".join(sent) if len(sent) > 1 else sent[0]
                        self.ledger.progress(flow.rid, events)
                        if kept is not None:
                            kept.append(out)
                            kept_bytes += len(out)
                            self._resume_bytes += len(out)
                            if (
                                kept_bytes > MAX_RESUME_BYTES
                                or self._resume_bytes > self.config.resume_budget_bytes
                            ):
                                self._resume_bytes -= kept_bytes  # too much to keep: no continuation
                                kept, kept_bytes = None, 0
                                self.resume_dropped += 1
                                self.metrics.resume_dropped.inc()
                        before, tail = tail, (tail + out)[-DONE_TAIL:]
                        yield out
                        finished = finished or _finished(out, before)  # (once the bytes went out)
                    if recomputed:
                        break
                rest = split.rest()
                if rest and not recomputed:
                    before, tail = tail, (tail + rest)[-DONE_TAIL:]
                    yield rest
                    finished = finished or _finished(rest, before)
                await upstream.aclose()
                if not recomputed:
                    outcome = "ok" if finished or _stream_done(tail) else STREAM_INCOMPLETE
                    break
                self.metrics.recomputed.inc()
                self._decode_over(flow, None)
                nxt = _continuation(flow.body, kept) if kept is not None else None
                if nxt is None:
                    outcome = "upstream_error"
                    cut_reason = "no_continuation"
                    break
                flow.body, flow.raw = nxt, orjson.dumps(nxt)
                flow.worker = -1
                try:
                    upstream = await self._attempts(flow, asyncio.get_running_loop().create_future())
                except _Failed:
                    outcome = "upstream_error"
                    cut_reason = "continuation_failed"
                    break
        except httpx.HTTPError as exc:
            outcome = "upstream_error"
            cut_reason = _cut_reason(exc)
            if flow.call is not None:
                client_failed(flow.call, exc)
            if flow.worker >= 0:
                self._upstream_failed(self.decode_names[flow.worker], "decode")
            log.warning("decode stream %s broke: %s", flow.rid, type(exc).__name__)
        finally:
            if outcome == "client_cancel" and _stream_done(tail):
                outcome = "ok"  # the client left after the end marker: the stream was complete
            if errored and outcome != "upstream_error":
                outcome = self._failed_by_event(outcome, "decode", flow.worker)
            if outcome == "upstream_error":
                self.errors["decode_stream"] += 1
            self._resume_bytes -= kept_bytes
            await upstream.aclose()
            self._release_prefill(flow)
            if flow.worker >= 0:
                self._decode_over(flow, events if outcome == "ok" else None)
            t_end = time.perf_counter()
            self.metrics.completion.labels(flow.mode, flow.bucket).observe(t_end - flow.t0, exemplar())
            tpot = (t_end - t_first) / (events - 1) if outcome == "ok" and events > 1 and t_first else None
            if tpot is not None:
                self.metrics.tpot.labels(flow.mode, flow.bucket).observe(tpot, exemplar())
            self._count(flow.mode, flow.policy, outcome, 200 if outcome != "upstream_error" else 502,
                        t_first - flow.t0 if t_first else None, tpot)
        if cut_reason:  # a stream that ended early is an error the client sees: no clean end
            self.cut[("decode", cut_reason)] += 1
            self.metrics.streams_cut.labels("decode", cut_reason).inc()
            event = _cut_event("decode", cut_reason, tail)
            if event is not None:
                yield event
            raise _StreamCut

    # -- shadow mode -------------------------------------------------------------------------
    async def _passthrough(self, request: Request, raw: bytes, rid: str, t0: float) -> Response:
        """The request to the existing router, unchanged; its answer relayed as it comes. Its TTFT,
        TPOT and completion time count from `t0`, its arrival, as the active path's do."""
        assert self.router_url is not None
        url = self.router_url + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        passed = [(k, v) for k, v in request.headers.items()
                  if k.lower() not in PASSTHROUGH_DROPS and k.lower() not in TRACE_HEADERS]
        client = self._client(self.router_url)
        bucket = prompt_bucket(len(raw) // 4)  # not parsed in shadow mode: bytes / 4 as tokens
        upstream: httpx.Response | None = None
        call: trace.Span = trace.INVALID_SPAN
        for attempt in range(self.config.retries + 1):
            call = http_client_span(self.tracer, "POST", url, "router", "router")
            headers = passed + list(inject_span(call, {}).items())
            try:
                upstream = await self._send(
                    call, client, client.build_request("POST", url, content=raw, headers=headers), None,
                    stream=True,
                )
                break
            except Unsent:  # the router never got the whole request: safe to send again
                self._upstream_failed("router", "router")
                if attempt == self.config.retries:
                    break
                self.metrics.retries.labels("router").inc()
                await asyncio.sleep(self.config.backoff_s(attempt + 1))
            except httpx.HTTPError as exc:  # written: the router may be running it, never sent again
                self._upstream_failed("router", "router")
                self._count("shadow", "router", "upstream_error", 502)
                return self._error(
                    502, f"router failed before answering: {type(exc).__name__}", "router_no_answer"
                )
        if upstream is None:
            self._count("shadow", "router", "upstream_error", 502)
            return self._error(502, "router unreachable", "router_unreachable")
        self.modes.on_upstream("router", "router", upstream.status_code < 500)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in PASSTHROUGH_DROPS}
        self.metrics.inflight.labels("router", "router").inc()

        sse = "event-stream" in upstream.headers.get("content-type", "")

        async def relay() -> AsyncIterator[bytes]:
            outcome = "client_cancel"
            first = True
            broke = ""  # why the router's answer broke off, if it did
            finished = not sse  # an event stream named a finish reason
            errored = False  # an error event was relayed: the router failed the request
            tail = b""  # the last bytes relayed: a client leaving after `data: [DONE]` had it all
            events, t_first = 0, 0.0  # SSE data events relayed (a line start can only be one)
            try:
                async for chunk in upstream.aiter_raw():
                    if first and chunk:
                        first = False
                        t_first = time.perf_counter()
                        self.metrics.first_token.labels("shadow", bucket).observe(t_first - t0, exemplar())
                    if sse:
                        at_line = chunk.startswith(b"data:") and tail[-1:] in (b"", b"\n")
                        events += chunk.count(b"\ndata:") + at_line
                        if not errored and (b'"error"' in chunk or b'"error"' in tail[-6:] + chunk[:6]):
                            errored = _ERROR_DATA.search(tail + chunk) is not None
                    before, tail = tail, (tail + chunk)[-DONE_TAIL:]
                    yield chunk
                    finished = finished or _finished(chunk, before)  # (once the bytes went out)
                status = upstream.status_code
                outcome = "ok" if status < 400 else "rejected" if client_fault(status) else "upstream_error"
                if outcome == "ok" and not finished and not _stream_done(tail):
                    outcome = STREAM_INCOMPLETE
            except httpx.HTTPError as exc:
                outcome = "upstream_error"
                broke = _cut_reason(exc)
                client_failed(call, exc)
                self._upstream_failed("router", "router")
            finally:
                if outcome == "client_cancel" and _stream_done(tail):
                    outcome = "ok"
                if errored and outcome != "upstream_error":
                    outcome = self._failed_by_event(outcome, "router", -1)
                await upstream.aclose()
                call.end()
                self.metrics.inflight.labels("router", "router").dec()
                t_end = time.perf_counter()
                tpot = None
                if outcome == "ok":  # as the active path records them, so the two modes compare
                    self.metrics.completion.labels("shadow", bucket).observe(t_end - t0, exemplar())
                    tokens = events - (b"[DONE]" in tail)
                    if tokens > 1:
                        tpot = (t_end - t_first) / (tokens - 1)
                        self.metrics.tpot.labels("shadow", bucket).observe(tpot, exemplar())
                self._count("shadow", "router", outcome, 502 if broke else upstream.status_code,
                            t_first - t0 if t_first else None, tpot)
            if broke:  # the router's answer broke off: the client sees an error, never a clean end
                self.cut[("router", broke)] += 1
                self.metrics.streams_cut.labels("router", broke).inc()
                event = _cut_event("router", broke, tail) if sse else None
                if event is not None:
                    yield event
                raise _StreamCut

        return _Relay(relay(), status_code=upstream.status_code, headers=out_headers)


def _stream_done(tail: bytes) -> bool:
    """The relayed bytes ended with the SSE end marker (the client had the whole stream)."""
    last = tail.rstrip(b"\r\n").replace(b"\r", b"\n").rsplit(b"\n", 1)[-1]
    return last in (b"data: [DONE]", b"data:[DONE]")


def _whole_recomputed(content: bytes) -> bool:
    try:
        doc = orjson.loads(content)
        return any(c.get("stop_reason") == "recomputed" for c in doc.get("choices") or [])
    except (orjson.JSONDecodeError, AttributeError):
        return False


def _chunk_of(event: bytes) -> Any:
    """The JSON object one raw SSE event carries, or None."""
    data = event_data(event)
    if data is None or not data.startswith(b"{"):
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _recomputed(event: bytes) -> bool:
    """The event ends its stream with stop_reason "recomputed" (the worker preempted it)."""
    doc = _chunk_of(event)
    try:
        return any(c.get("stop_reason") == "recomputed" for c in doc.get("choices") or [])
    except AttributeError:
        return False


def _is_chunk(event: bytes) -> bool:
    """The event carries a completion chunk (a JSON data field), not a comment or `[DONE]`."""
    data = event_data(event)
    return data is not None and data.startswith(b"{")


def _continuation(body: dict[str, Any], sent: list[bytes]) -> dict[str, Any] | None:
    """The body that continues a recomputed request: its prompt plus the text sent so far, and
    the remaining `max_tokens` (None when nothing is left or the body cannot be continued)."""
    text: list[str] = []
    tokens = 0
    split = EventSplitter(max_event=MAX_RESUME_BYTES + 1)
    for whole, _ in [*split.feed(b"".join(sent)), (split.rest(), True)]:
        doc = _chunk_of(whole)
        if not isinstance(doc, dict):
            continue
        for c in doc.get("choices") or []:
            piece = c.get("text")
            if piece is None:
                piece = (c.get("delta") or {}).get("content")
            if isinstance(piece, str) and piece:
                text.append(piece)
                tokens += 1
    nxt = dict(body)
    limit_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    limit = body.get(limit_key)
    if isinstance(limit, int):
        if limit - tokens <= 0:
            return None
        nxt[limit_key] = limit - tokens
        if isinstance(body.get("min_tokens"), int):
            nxt["min_tokens"] = max(0, body["min_tokens"] - tokens)
    so_far = "".join(text)
    if isinstance(body.get("prompt"), str):
        nxt["prompt"] = body["prompt"] + so_far
    elif isinstance(body.get("messages"), list):
        nxt["messages"] = [*body["messages"], {"role": "assistant", "content": so_far}]
        nxt["continue_final_message"] = True
        nxt["add_generation_prompt"] = False
    else:
        return None
    return nxt


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _race(aw: Any, gone: asyncio.Future[Any]) -> Any:
    """Await `aw` unless the client goes first (then `_Gone`, and `aw` is cancelled)."""
    task = asyncio.ensure_future(aw)
    if gone.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise _Gone
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _Gone


class _Relay(StreamingResponse):
    """A streaming response that always closes its body iterator (so reservations are released
    at once, also when the client goes away mid-stream)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except _StreamCut:
            return  # the response stays incomplete: the server closes the connection mid-body
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _in_span(body: AsyncIterable[Any], span: trace.Span,
                   ctx: otel_context.Context) -> AsyncIterator[Any]:
    """`body`, each step run in `ctx` (continuations, exemplars, log lines see the request's span);
    `span` ends with the last chunk, as an error when the stream was cut."""
    it = aiter(body)
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                chunk = await anext(it)
            except StopAsyncIteration:
                break
            finally:
                otel_context.detach(token)
            yield chunk
    except BaseException as exc:
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        close = getattr(it, "aclose", None)  # the relay's own accounting runs now, in the span
        if close is not None:
            token = otel_context.attach(ctx)
            try:
                await close()
            finally:
                otel_context.detach(token)
        span.end()
