"""Shadow mode's passthrough: a request goes to the existing router unchanged and its answer is
relayed as it comes (bytes, status and headers; hop-by-hop headers, those our server re-frames,
proxy credentials and trace context not passed on: `PASSTHROUGH_DROPS`, `TRACE_HEADERS`).

A send the router never completely got (`upstream.Unsent`) is retried (`Backoff`); one it got is
never sent again (502). The answer is relayed by `streamrelay.LegRelay` and accounted by a
`StreamTally`, as the P/D path's decode stream is: TTFT, TPOT and completion time count from the
request's arrival, so that the two modes compare; a broken-off answer ends in an SSE error event
(unless it leaves an event open) and a body that never ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

from shadow.active.backoff import Backoff
from shadow.active.calls import UpstreamCalls
from shadow.active.cohorts import client_fault
from shadow.active.proxycounts import ProxyCounts
from shadow.active.streamrelay import LegRelay, RelayResponse, StreamCut, cut_event, cut_reason
from shadow.active.streamtally import StreamTally
from shadow.active.upstream import Unsent
from shadow.base.hopbyhop import HOP_BY_HOP
from shadow.contracts.labels import prompt_bucket
from shadow.contracts.modes import ModeSource
from shadow.telemetry.httpspans import client_failed, http_client_span, inject_span
from shadow.vllm.sse import EventSplitter

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})  # replaced by ours on the way up
#: Not relayed in shadow-mode passthrough: the hop-by-hop headers, those our server re-frames, and
#: proxy credentials (consumed here, never passed on).
PASSTHROUGH_DROPS = HOP_BY_HOP | {"host", "content-length", "proxy-authenticate", "proxy-authorization"}


class Passthrough:
    """Passes shadow-mode requests to `router_url` (see module docstring); `max_event`: the SSE
    event size up to which an event is counted (a larger one is relayed all the same)."""

    def __init__(self, router_url: str, upstreams: UpstreamCalls, counts: ProxyCounts, modes: ModeSource,
                 backoff: Backoff, max_event: int) -> None:
        self.router_url, self.upstreams, self.counts, self.modes = router_url, upstreams, counts, modes
        self.backoff, self.max_event = backoff, max_event

    async def __call__(self, request: Request, raw: bytes, t0: float) -> Response:
        """The request to the router, unchanged; its answer relayed as it comes. Its TTFT, TPOT and
        completion time count from `t0`, its arrival, as the active path's do."""
        url = self.router_url + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        passed = [(k, v) for k, v in request.headers.items()
                  if k.lower() not in PASSTHROUGH_DROPS and k.lower() not in TRACE_HEADERS]
        sent = await self._send(url, raw, passed)
        if isinstance(sent, Response):
            return sent
        upstream, call = sent
        self.modes.on_upstream("router", "router", upstream.status_code < 500)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in PASSTHROUGH_DROPS}
        self.counts.metrics.inflight.labels("router", "router").inc()
        sse = "event-stream" in upstream.headers.get("content-type", "")
        tally = StreamTally(self.counts, "shadow", prompt_bucket(len(raw) // 4), t0, sse=sse)
        body = self._relay(upstream, call, tally, sse)  # not parsed here: bytes / 4 as prompt tokens
        return RelayResponse(body, status_code=upstream.status_code, headers=out_headers)

    async def _send(self, url: str, raw: bytes,
                    passed: list[tuple[str, str]]) -> tuple[httpx.Response, trace.Span] | Response:
        """The streamed answer and its call's span, or the client's 502 when there is none."""
        client = self.upstreams.client(self.router_url)
        retry = 0
        while True:
            call = http_client_span(self.upstreams.tracer, "POST", url, "router", "router")
            headers = passed + list(inject_span(call, {}).items())
            req = client.build_request("POST", url, content=raw, headers=headers)
            try:
                return await self.upstreams.send(call, client, req, None, stream=True), call
            except Unsent:  # the router never got the whole request: safe to send again
                self.counts.upstream_failed("router", "router")
                retry += 1
                if not self.backoff.allows(retry):
                    self.counts.request("shadow", "router", "upstream_error", 502)
                    return self.counts.error(502, "router unreachable", "router_unreachable")
                self.counts.metrics.retries.labels("router").inc()
                await self.backoff.wait(retry)
            except httpx.HTTPError as exc:  # written: the router may be running it, never sent again
                self.counts.upstream_failed("router", "router")
                self.counts.request("shadow", "router", "upstream_error", 502)
                return self.counts.error(
                    502, f"router failed before answering: {type(exc).__name__}", "router_no_answer"
                )

    async def _relay(self, upstream: httpx.Response, call: trace.Span, tally: StreamTally,
                     sse: bool) -> AsyncIterator[bytes]:
        """The router's answer as it comes; counted once it ends (or the client leaves)."""
        outcome = "client_cancel"
        broke = ""  # why the router's answer broke off, if it did
        leg = LegRelay(tally, EventSplitter(self.max_event) if sse else None)
        try:
            async with contextlib.aclosing(leg.relay(upstream.aiter_raw())) as chunks:
                async for chunk in chunks:
                    yield chunk
            status = upstream.status_code
            outcome = "ok" if status < 400 else "rejected" if client_fault(status) else "upstream_error"
            if outcome == "ok":
                outcome = tally.complete()
        except httpx.HTTPError as exc:
            outcome = "upstream_error"
            broke = cut_reason(exc)
            client_failed(call, exc)
            self.counts.upstream_failed("router", "router")
        finally:
            outcome = tally.settle(outcome, "router", "router")
            await upstream.aclose()
            call.end()
            self.counts.metrics.inflight.labels("router", "router").dec()
            tally.record("router", outcome, 502 if broke else upstream.status_code, failed_completion=False)
        if broke:  # the router's answer broke off: the client sees an error, never a clean end
            self.counts.stream_cut("router", broke)
            event = cut_event("router", broke, tally.tail) if sse else None
            if event is not None:
                yield event
            raise StreamCut
