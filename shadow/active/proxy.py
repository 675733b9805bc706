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

The pieces, one job each: `proxyconfig` (the settings), `wiring` (ledger, dispatcher, prefill
chooser, KV poller), `calls` (connection pools, traced sends), `legs` (the prefill and decode
legs), `backoff` (the retry waits), `clientgone` (racing the client going away), `passthrough`
(shadow mode), `streamrelay` (the one SSE relay loop), `streamtally` (the one place a stream is
accounted), `recompute` (continuations), `proxycounts` (request, failure and cut counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
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

from shadow.active.calls import UpstreamCalls
from shadow.active.clientgone import Gone, race, wait_disconnect
from shadow.active.cohorts import client_fault
from shadow.active.dispatcher import PoolExpired
from shadow.active.flow import Flow, LegFailed
from shadow.active.ledger import LoadSource, NoSource
from shadow.active.legs import Legs
from shadow.active.metrics import ActiveMetrics
from shadow.active.passthrough import Passthrough
from shadow.active.proxyconfig import UPSTREAM_IDLE_S, ActiveConfig
from shadow.active.proxycounts import ProxyCounts
from shadow.active.recompute import Kept, ResumeBudget, recomputed, whole_recomputed
from shadow.active.streamrelay import LegRelay, RelayResponse, StreamCut, cut_event, cut_reason, in_span
from shadow.active.streamtally import StreamTally
from shadow.active.wiring import build_routing
from shadow.contracts.labels import prompt_bucket
from shadow.contracts.modes import ModeSource, StaticModeSource
from shadow.core.cost import RouteCost
from shadow.core.routers import Router
from shadow.mirror.analyzer import estimate_prompt_tokens
from shadow.telemetry.httpspans import client_failed, http_server_span, http_status
from shadow.telemetry.tracing import RoutingSpans, exemplar
from shadow.vllm.sse import EventSplitter

__all__ = ["GENERATE_PATHS", "UPSTREAM_IDLE_S", "ActiveConfig", "ActiveProxy"]

log = logging.getLogger("shadow.active")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


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
        self.source = source or NoSource(len(config.decode))
        routing = build_routing(
            config, self.metrics, self.modes, self.source, clock, router_factory, spans, cost
        )
        self.ledger, self.dispatcher, self.prefill, self.poller = (
            routing.ledger, routing.dispatcher, routing.prefill, routing.poller
        )
        self.tracer = spans.tracer if spans is not None else trace.NoOpTracer()
        self.counts = ProxyCounts(self.metrics, self.modes, log)
        self.errors, self.cut = self.counts.errors, self.counts.cut  # error answers; cut streams
        self.upstreams = UpstreamCalls(self.tracer, config.api_key)
        self.legs = Legs(self.upstreams, self.prefill, self.dispatcher, self.ledger, self.counts, self.modes,
                         config.decode, config.prefill_wait_s, clock)
        self.decode_names, self.decode_urls = self.legs.decode_names, self.legs.decode_urls
        self.backoff = config.backoff()
        self.resume = ResumeBudget(config.resume_budget_bytes, self.metrics.resume_dropped)
        self.router_url = config.router_url.rstrip("/") if config.router_url else None
        self.passthrough = None if self.router_url is None else Passthrough(
            self.router_url, self.upstreams, self.counts, self.modes, self.backoff, config.max_event_bytes
        )
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

    @property
    def oversized_events(self) -> int:
        """SSE events over `max_event_bytes` (forwarded unaligned)."""
        return self.counts.oversized_events

    @property
    def resume_dropped(self) -> int:
        """Streams that stopped keeping bytes for a recompute continuation (the budget)."""
        return self.resume.dropped

    # -- lifecycle ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.close()

    async def start(self) -> None:
        if self.upstreams.is_open:
            return
        c = self.config
        limits = httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=c.max_connections)
        timeout = httpx.Timeout(c.timeout_s, connect=10.0, read=c.upstream_idle_s)
        urls = {*self.decode_urls, *(p.url for p in self.prefill.prefillers)}
        self.upstreams.open(urls | ({self.router_url} if self.router_url else set()), limits, timeout)
        self.dispatcher.start()
        self.poller.start()

    async def close(self) -> None:
        await self.dispatcher.stop()
        await self.poller.stop()
        await self.upstreams.close()

    # -- small endpoints ---------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "prefill_instances": len(self.prefill.prefillers),
                "decode_instances": len(self.decode_names),
                "request_num": len(self.ledger),
                "resume_dropped": self.resume.dropped,
                "oversized_events": self.counts.oversized_events,
                "pool": len(self.dispatcher.waiting),
            }
        )

    async def _metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def _models(self, request: Request) -> Response:
        for url in [*self.decode_urls, *(p.url for p in self.prefill.prefillers)]:
            with contextlib.suppress(httpx.HTTPError):
                r = await self.upstreams.client(url).get(url + "/v1/models", timeout=10.0)
                if r.status_code == 200:
                    return Response(r.content, media_type="application/json")
        return self.counts.error(503, "no backend answered /v1/models", "unavailable")

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
            response.body_iterator = in_span(response.body_iterator, span, ctx)
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
            self.counts.request(mode, policy, "client_cancel")
            self.errors["client_gone"] += 1
            return Response(status_code=499)
        if raw is None:
            self.counts.request(mode, policy, "rejected", 413)
            limit = self.config.max_body_bytes
            return self.counts.error(413, f"request body over {limit} bytes", "too_large")
        if mode == "shadow" and self.passthrough is not None:
            return await self.passthrough(request, raw, t0)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            self.counts.request(mode, policy, "rejected", 400)
            return self.counts.error(400, "request body must be a JSON object", "bad_request")
        est = estimate_prompt_tokens(body)
        flow = Flow(rid, request.url.path, mode, policy, body, raw, t0,
                    prompt_bucket(est if est is not None else len(raw) // 4))
        flow.prompt_tokens = est if est is not None else max(1, len(raw) // 4)
        return await self._route(flow, request.receive)

    async def _route(self, flow: Flow, receive: Receive) -> Response:
        gone = asyncio.get_running_loop().create_task(wait_disconnect(receive))
        try:
            try:
                upstream = await self._attempts(flow, gone)
            except Gone:
                self.counts.request(flow.mode, flow.policy, "client_cancel")
                return Response(status_code=499)
            except LegFailed as f:
                return self._failed(flow, f)
        finally:
            gone.cancel()
            with contextlib.suppress(BaseException):
                await gone
        if not flow.body.get("stream"):
            return await self._respond_whole(flow, upstream)
        media = upstream.headers.get("content-type", "text/event-stream")
        return RelayResponse(
            self._relay(flow, upstream), status_code=200, media_type=media, headers={"X-Request-Id": flow.rid}
        )

    def _failed(self, flow: Flow, f: LegFailed) -> Response:
        """The client's answer to a flow no retry could save: counted, logged, the upstream's own."""
        self.errors[f.kind] += 1
        refused = (f.leg == "pool" and f.status in (429, 503)) or (f.leg != "pool" and client_fault(f.status))
        if refused:
            self.counts.rejected_log.warning(f.kind, "request refused (%s) on the %s leg: %s", f.status,
                                             f.leg, f.kind, kind=f.kind)
        else:
            log.warning("request failed (%s): %s leg, worker %s", f.status, f.leg, f.worker or "-",
                        extra={"kind": f.kind, "request_id": flow.rid, "mode": flow.mode})
        self.counts.request(flow.mode, flow.policy, "rejected" if refused else "upstream_error", f.status)
        headers = {"X-Request-Id": flow.rid}
        return Response(f.content, status_code=f.status, media_type=f.media, headers=headers)

    async def _attempts(self, flow: Flow, gone: asyncio.Future[Any]) -> httpx.Response:
        """Prefill, pool and decode leg, retried while nothing reached the client: as a whole, or
        from the pool on when the decode leg failed unsent (its KV handle was never used)."""
        failed_prefill: list[str] = []
        attempt = 0
        kv: dict[str, Any] | None = None  # a prefill's KV handle still unused (this call owns it)
        while True:
            try:
                return await self._legs(flow, gone, failed_prefill, kv)
            except LegFailed as f:
                kv, leg, worker, status, kind = f.kv, f.leg, f.worker, f.status, f.kind
                if not f.retryable or not self.backoff.allows(attempt + 1):
                    self.legs.abort_kv(flow, kv)
                    raise
            attempt += 1
            self.metrics.retries.labels(leg).inc()
            how = ", its KV handle reused" if kv is not None else ", a new prefill" if self.prefill else ""
            self.counts.retry_log.warning(
                f"{leg}:{kind}", "request retried (attempt %d%s): the %s leg failed on %s (%s, %s)",
                attempt + 1, how, leg, worker or "-", status, kind, kind=kind, request_id=flow.rid,
            )
            if leg == "prefill":
                failed_prefill.append(worker)
                if len(failed_prefill) >= len(self.prefill.prefillers):
                    failed_prefill.clear()
            try:
                await self.backoff.wait(attempt, gone)
            except BaseException:
                self.legs.abort_kv(flow, kv)
                raise

    async def _legs(
        self, flow: Flow, gone: asyncio.Future[Any], exclude: list[str], kv: dict[str, Any] | None
    ) -> httpx.Response:
        """One attempt; `kv`: a handle from an earlier attempt's prefill (no prefill leg then)."""
        if kv is None and self.prefill:
            kv = await self.legs.prefill_leg(flow, gone, exclude)
        try:
            fut = self.dispatcher.submit(
                flow.rid, flow.prompt_tokens, len(flow.raw) / 4, flow.policy, flow.mode
            )
            try:
                g = await race(fut, gone)
            except Gone:
                if not self.dispatcher.cancel(flow.rid):
                    self.dispatcher.released(flow.rid)
                self.legs.abort_kv(flow, kv)
                raise
            except PoolExpired as exc:
                self.legs.abort_kv(flow, kv)
                raise LegFailed.ours(
                    503, f"no decode slot in time: {exc}", "pool_timeout", False, "pool"
                ) from None
            flow.worker, flow.dispatched_at = g, time.perf_counter()
            return await self.legs.decode_leg(flow, kv, gone)
        except BaseException:
            self.legs.release_prefill(flow)
            raise

    async def _respond_whole(self, flow: Flow, upstream: httpx.Response) -> Response:
        """A non-streamed request: read the whole answer (a recomputed one is re-run, nothing was sent)."""
        outcome = "ok"
        for _ in range(self.config.retries + 1):
            try:
                content = await upstream.aread()
            except httpx.HTTPError:
                content, outcome = b"", "upstream_error"
                self.counts.upstream_failed(self.decode_names[flow.worker], "decode")
            finally:
                await upstream.aclose()
            t = time.perf_counter()
            self.legs.first_token(flow, t)
            self.legs.decode_over(flow, None)
            if b'"recomputed"' not in content or not whole_recomputed(content):
                break
            self.metrics.recomputed.inc()
            try:
                upstream = await self._attempts(flow, asyncio.get_running_loop().create_future())
            except LegFailed as f:
                self.errors[f.kind] += 1
                self.counts.request(flow.mode, flow.policy, "upstream_error", f.status)
                return Response(f.content, status_code=f.status, media_type=f.media)
        elapsed = time.perf_counter() - flow.t0
        self.metrics.first_token.labels(flow.mode, flow.bucket).observe(elapsed, exemplar())
        self.metrics.completion.labels(flow.mode, flow.bucket).observe(elapsed, exemplar())
        self.counts.request(flow.mode, flow.policy, outcome, 200 if outcome == "ok" else 502, elapsed)
        if outcome != "ok":
            return self.counts.error(502, "decode answer broke off", "decode_stream", flow.rid)
        return Response(
            content,
            status_code=200,
            media_type=upstream.headers.get("content-type", "application/json"),
            headers={"X-Request-Id": flow.rid},
        )

    async def _relay(self, flow: Flow, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """Relay SSE events as they come, each as soon as its blank line arrives (any line ends;
        an event over `max_event_bytes` is forwarded as it comes); continue a recomputed stream. A
        stream that ends with neither a `finish_reason` nor `[DONE]` is counted `stream_incomplete`."""
        outcome = "client_cancel"
        cut = ""  # why the stream ended early, if it did
        tally = StreamTally(self.counts, flow.mode, flow.bucket, flow.t0)
        kept = Kept(self.resume)  # what was sent, for a recompute continuation

        def sent(out: bytes) -> None:
            self.ledger.progress(flow.rid, tally.events)
            kept.keep(out)

        try:
            while True:
                leg = LegRelay(tally, EventSplitter(self.config.max_event_bytes), aligned=True,
                               counts=self.counts, on_first=lambda t: self.legs.first_token(flow, t),
                               on_sent=sent, stop=recomputed)
                tally.new_leg()
                async with contextlib.aclosing(leg.relay(upstream.aiter_raw())) as pieces:
                    async for out in pieces:
                        yield out
                await upstream.aclose()
                if not leg.stopped:
                    outcome = tally.complete()
                    break
                upstream, cut = await self._continued(flow, kept, upstream)
                if cut:
                    outcome = "upstream_error"
                    break
        except httpx.HTTPError as exc:
            outcome, cut = "upstream_error", cut_reason(exc)
            if flow.call is not None:
                client_failed(flow.call, exc)
            if flow.worker >= 0:
                self.counts.upstream_failed(self.decode_names[flow.worker], "decode")
            log.warning("decode stream %s broke: %s", flow.rid, type(exc).__name__)
        finally:
            outcome = tally.settle(outcome, "decode", self.legs.worker_name(flow))
            if outcome == "upstream_error":
                self.errors["decode_stream"] += 1
            kept.release()
            await upstream.aclose()
            self.legs.release_prefill(flow)
            if flow.worker >= 0:
                self.legs.decode_over(flow, tally.events if outcome == "ok" else None)
            status = 200 if outcome != "upstream_error" else 502
            tally.record(flow.policy, outcome, status, failed_completion=True)
        if cut:  # a stream that ended early is an error the client sees: no clean end
            self.counts.stream_cut("decode", cut)
            event = cut_event("decode", cut, tally.tail)
            if event is not None:
                yield event
            raise StreamCut

    async def _continued(
        self, flow: Flow, kept: Kept, upstream: httpx.Response
    ) -> tuple[httpx.Response, str]:
        """A recomputed decode stream's continuation on a new P/D flow: its answer, or `upstream`
        (closed) and why there is none."""
        self.metrics.recomputed.inc()
        self.legs.decode_over(flow, None)
        nxt = kept.continuation(flow.body)
        if nxt is None:
            return upstream, "no_continuation"
        flow.body, flow.raw = nxt, orjson.dumps(nxt)
        flow.worker = -1
        try:
            return await self._attempts(flow, asyncio.get_running_loop().create_future()), ""
        except LegFailed:
            return upstream, "continuation_failed"
