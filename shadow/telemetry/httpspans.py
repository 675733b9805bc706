"""HTTP spans by OpenTelemetry's HTTP semantic conventions, joined by W3C Trace Context: the active
proxy's SERVER span per generation request and CLIENT span per upstream call, and the taps' SERVER
span per relayed generation request (`TapSpans`, made by the analysis from what a tap handed over,
never on its relay path). Attributes never carry prompt text; request ids only as their hash.
"""

from __future__ import annotations

import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shadow.telemetry import attrs

W3C = TraceContextTextMapPropagator()


def _server_attributes(method: str, route: str, path: str, scheme: str, host: str | None,
                       port: int | None) -> dict[str, str | int]:
    out: dict[str, str | int] = {"http.request.method": method, "http.route": route, "url.path": path,
                                 "url.scheme": scheme, "network.protocol.version": "1.1"}
    if host:
        out["server.address"] = host
    if port:
        out["server.port"] = port
    return out


def http_server_span(tracer: trace.Tracer, headers: Mapping[str, str], method: str, route: str,
                     path: str, scheme: str, host: str | None, port: int | None) -> trace.Span:
    """A SERVER span for one HTTP request, child of the W3C `traceparent` in `headers` (when valid),
    named and attributed by OpenTelemetry's HTTP semantic conventions (`{method} {route}`)."""
    return tracer.start_span(f"{method} {route}", context=W3C.extract(headers), kind=trace.SpanKind.SERVER,
                             attributes=_server_attributes(method, route, path, scheme, host, port))


def http_status(span: trace.Span, status: int) -> None:
    """`http.response.status_code`; a 5xx answer marks the server span as an error (`error.type`)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(trace.Status(trace.StatusCode.ERROR))


def inject(headers: dict[str, str]) -> dict[str, str]:
    """`headers` with the current span context as `traceparent` (and `tracestate`): the callee's
    parent is the current span (or, with tracing off, the caller's own parent as it came)."""
    W3C.inject(headers)
    return headers


def http_client_span(tracer: trace.Tracer, method: str, url: str, worker: str, leg: str) -> trace.Span:
    """A CLIENT span for one upstream call to `url`, child of the current span: named `{method}`,
    with `http.request.method`, `server.address`/`server.port`, `url.full` (HTTP semantic
    conventions), the worker's name and the leg (prefill, decode, router). With a no-op tracer it is
    the current span itself (so the callee's parent stays the caller's, as it came)."""
    u = urllib.parse.urlsplit(url)
    attributes: dict[str, str | int] = {"http.request.method": method, "url.full": url,
                                        "network.protocol.version": "1.1", attrs.UPSTREAM_WORKER: worker,
                                        attrs.UPSTREAM_LEG: leg}
    if u.hostname:
        attributes["server.address"] = u.hostname
    attributes["server.port"] = u.port or (443 if u.scheme == "https" else 80)
    return tracer.start_span(method, kind=trace.SpanKind.CLIENT, attributes=attributes)


def inject_span(span: trace.Span, headers: dict[str, str]) -> dict[str, str]:
    """`headers` with `span` as the `traceparent` (the callee's parent is this call's span)."""
    W3C.inject(headers, context=trace.set_span_in_context(span))
    return headers


def client_status(span: trace.Span, status: int) -> None:
    """An upstream's answer on its CLIENT span: `http.response.status_code`; 4xx and 5xx are errors
    of a client span (`error.type` = the status code)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        span.set_attribute("error.type", str(status))
        span.set_status(trace.Status(trace.StatusCode.ERROR))


def client_failed(span: trace.Span, exc: BaseException) -> None:
    """A call that got no answer: `error.type` = the exception's class name."""
    span.set_attribute("error.type", type(exc).__name__)
    span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))


class TapRequest(Protocol):
    """What a tap span reads of one relayed request (the tap's `TapContext`): its head and answer,
    times on the analysis's monotonic clock."""

    @property
    def tap(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def request_id(self) -> str | None: ...
    @property
    def traceparent(self) -> str | None: ...
    @property
    def status(self) -> int: ...
    @property
    def t_start(self) -> float: ...


#: The tap's end reasons that are errors of its span (`error.type` = the reason).
TAP_ERRORS = frozenset(("upstream_cut", "upstream_error", "relay_lost"))


class TapSpans:
    """One SERVER span per generation request a tap relayed, from its start to its end as the tap
    saw them: the child of the `traceparent` the tap received (a root of its own without one),
    named `{method} {route}` with the HTTP attributes the proxy's span has, the tap's name and
    role, the worker and the request id's hash. The analysis calls `started` and `ended` (mirror
    thread); unsampled requests cost one sampler call and no state; open spans are capped
    (`max_open`, the oldest ended as `evicted`, counted)."""

    def __init__(self, tracer: trace.Tracer, *, max_open: int = 10_000,
                 clock: Callable[[], float] = time.monotonic,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.tracer = tracer
        self.max_open = max_open
        self.clock = clock
        self.clock_ns = clock_ns
        self.open: OrderedDict[TapRequest, trace.Span] = OrderedDict()
        self.evicted = 0

    def _ns(self, t: float) -> int:
        """A time of the analysis's monotonic clock as epoch nanoseconds."""
        return self.clock_ns() + int((t - self.clock()) * 1e9)

    def started(self, ctx: TapRequest, role: str) -> None:
        """The tap began relaying `ctx` (a `role` leg: prefill, decode or front)."""
        parent = (W3C.extract({"traceparent": ctx.traceparent}, context=otel_context.Context())
                  if ctx.traceparent else otel_context.Context())
        route = ctx.path.split("?", 1)[0]
        span = self.tracer.start_span(f"{ctx.method} {route}", context=parent, kind=trace.SpanKind.SERVER,
                                      start_time=self._ns(ctx.t_start))
        if not span.is_recording():
            return
        span.set_attributes(_server_attributes(ctx.method, route, route, "http", None, None))
        span.set_attributes({attrs.TAP_NAME: ctx.tap, attrs.TAP_ROLE: role})
        if ctx.request_id:  # (the tap keeps the hash of the X-Request-Id, never the id: contracts.ids)
            span.set_attribute(attrs.REQUEST_ID_HASH, ctx.request_id)
        self.open[ctx] = span
        while len(self.open) > self.max_open:
            _, old = self.open.popitem(last=False)
            old.set_attribute(attrs.TAP_END, "evicted")
            old.end(end_time=self.clock_ns())
            self.evicted += 1

    def ended(self, ctx: TapRequest, t: float, reason: str, worker: str | None) -> None:
        """`ctx` ended at `t` for `reason` (the tap's end reasons, as the analysis judged the end) on
        decode `worker` (if known)."""
        span = self.open.pop(ctx, None)
        if span is None:
            return
        span.set_attribute(attrs.TAP_END, reason)
        if worker:
            span.set_attribute(attrs.ACTUAL_WORKER, worker)
        if ctx.status:
            http_status(span, ctx.status)
        if reason in TAP_ERRORS:
            span.set_attribute("error.type", reason)
            span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
        span.end(end_time=self._ns(t))
