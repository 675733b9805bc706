"""W3C Trace Context through the active proxy: a client's `traceparent` becomes the parent of the
proxy's SERVER span (HTTP semantic conventions), every upstream call (prefill, decode, the router in
shadow mode) is a CLIENT span, its child, and carries a `traceparent` naming that CLIENT span;
latency histograms carry the sampled span as an OpenMetrics exemplar; the OTEL_* exporter variables
pick the exporter. The whole chain across real processes: tests/telemetry/test_joined_traces.py."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

from shadow.active.proxy import ActiveConfig, ActiveProxy
from shadow.base.listener import AsgiListener
from shadow.contracts.modes import StaticModeSource
from shadow.telemetry import attrs as keys
from shadow.telemetry.httpspans import inject
from shadow.telemetry.tracing import RoutingSpans, make_provider, otlp_provider
from tests.active.stubs import DONE, Step, Stub, sse

SERVER, CLIENT = 2, 3  # OTLP's SpanKind numbers
BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4, "stream": True}


def _parent(traceparent: str) -> tuple[str, str]:
    """(trace id, parent span id) of a `traceparent` header value."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and len(flags) == 2
    return trace_id, span_id


async def _through(mode: str, script: list[Step] | None = None,
                   whole: bool = True) -> tuple[InMemorySpanExporter, Stub, Stub, ActiveProxy, str]:
    """One streamed request through a proxy in `mode` with a client span around it (the decode or
    router stub answers by `script`; `whole`: the client got the whole stream); returns the spans,
    the prefill and decode (or router) stubs, the proxy and the client span's traceparent."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pre = Stub([], role="prefill")
    dec = Stub(script or [Step(events=[sse("a", 0), sse("b", 1), sse("c", 2, "stop"), DONE])])
    await pre.start()
    await dec.start()
    routed = mode != "shadow"
    proxy = ActiveProxy(
        ActiveConfig(decode={"d0": dec.url}, prefill={"p0": pre.url} if routed else {}, slots=4,
                     router_url=None if routed else dec.url, kv_backpressure=False),
        modes=StaticModeSource(mode, "br0"), spans=RoutingSpans(provider.get_tracer("shadow")),
    )
    server = AsgiListener(proxy.app, name="shadow proxy")
    url = await server.start()
    try:
        client = provider.get_tracer("client")
        with client.start_as_current_span("client call", kind=trace.SpanKind.CLIENT):
            headers = inject({})
            async with httpx.AsyncClient() as c:
                try:
                    r = await c.post(url + "/v1/completions", content=orjson.dumps(BODY),
                                     headers={**headers, "content-type": "application/json"})
                    assert r.status_code == 200 and r.content.endswith(DONE)
                except httpx.RemoteProtocolError:  # a cut stream's body never ends
                    assert not whole
                else:
                    assert whole
        deadline = asyncio.get_running_loop().time() + 30
        # the server span ends with the stream's last byte
        while not any(s.kind == trace.SpanKind.SERVER for s in exporter.get_finished_spans()):
            assert asyncio.get_running_loop().time() < deadline, "no SERVER span ended in 30 s"
            await asyncio.sleep(0.01)
    finally:
        await server.stop(grace_s=1.0)
        await pre.stop()
        await dec.stop()
    return exporter, pre, dec, proxy, headers["traceparent"]


@pytest.mark.parametrize("mode", ["active", "shadow"])
def test_one_trace_from_the_client_through_the_proxy_to_the_workers(mode: str) -> None:
    exporter, pre, dec, proxy, sent = asyncio.run(_through(mode))
    trace_id, client_span = _parent(sent)
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind == trace.SpanKind.SERVER]
    assert format(server.context.trace_id, "032x") == trace_id
    assert server.parent is not None and format(server.parent.span_id, "016x") == client_span
    assert server.name == "POST /v1/completions"
    attrs = dict(server.attributes or {})
    assert attrs["http.request.method"] == "POST" and attrs["http.route"] == "/v1/completions"
    assert attrs["url.path"] == "/v1/completions" and attrs["http.response.status_code"] == 200
    assert attrs["server.address"] == "127.0.0.1" and attrs["server.port"] > 0
    calls = {format(s.context.span_id, "016x"): s for s in spans
             if s.kind == trace.SpanKind.CLIENT and s.name == "POST"}
    upstream = {"prefill": pre, "decode": dec} if mode == "active" else {"router": dec}
    assert sorted(c.attributes[keys.UPSTREAM_LEG] for c in calls.values()) == sorted(upstream)
    for leg, stub in upstream.items():
        headers, _ = stub.calls[0]
        # the worker's (or router's) parent is shadow's CLIENT span for that call, in the client's
        # trace, and that span is the SERVER span's child: the client's own traceparent did not pass
        tid, parent = _parent(headers["traceparent"])
        assert tid == trace_id and parent in calls, (leg, headers["traceparent"])
        call = calls[parent]
        assert call.parent is not None and call.parent.span_id == server.context.span_id
        got = dict(call.attributes or {})
        assert got[keys.UPSTREAM_LEG] == leg and got["http.request.method"] == "POST"
        assert got["url.full"] == stub.url + "/v1/completions"
        assert got["server.address"] == "127.0.0.1" and got["server.port"] == int(stub.url.rsplit(":", 1)[1])
        assert got["http.response.status_code"] == 200 and call.status.is_ok
        assert call.end_time is not None and call.end_time <= server.end_time
    if mode == "active":
        rounds = [s for s in spans if s.name == "shadow.route.round"]
        assert rounds, [s.name for s in spans]
    # the latency histograms name the request's trace (OpenMetrics exemplars)
    text = openmetrics(proxy.registry).decode()
    lines = [x for x in text.splitlines() if x.startswith("shadow_router_completion_seconds_bucket")
             and "trace_id" in x]
    assert lines and all(f'trace_id="{trace_id}"' in x for x in lines), text[-2000:]


def test_otel_variables_choose_the_exporter() -> None:
    assert otlp_provider({}) is None
    off = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"}
    assert otlp_provider(off) is None
    console = otlp_provider({"OTEL_TRACES_EXPORTER": "console"})
    assert console is not None
    console.shutdown()
    with pytest.raises(ValueError, match="unknown exporter 'zipkin'"):
        otlp_provider({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL must be one of"):
        make_provider({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    provider = make_provider({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9/"})
    assert provider is not None
    processor = provider._active_span_processor._span_processors[0]
    assert processor.span_exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    provider.shutdown()


def test_failed_calls_are_error_spans_and_every_call_span_ends() -> None:
    """A decode answering 503 (retried) and then a stream cut mid-way: two CLIENT spans, the first
    with `error.type` 503, the second with the exception's class; both ended, in the client's trace."""
    script = [Step(status=503, body=b'{"error": "busy"}'), Step(events=[sse("a", 0), sse("b", 1)], cut=True)]
    exporter, _, dec, _, sent = asyncio.run(_through("active", script, whole=False))
    trace_id, _ = _parent(sent)
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind == trace.SpanKind.SERVER]
    calls = sorted((s for s in spans if s.kind == trace.SpanKind.CLIENT and s.name == "POST"
                    and s.attributes[keys.UPSTREAM_LEG] == "decode"), key=lambda s: s.start_time)
    assert len(calls) == len(dec.calls) == 2
    busy, broke = calls
    assert busy.attributes["http.response.status_code"] == 503 and busy.attributes["error.type"] == "503"
    assert busy.status.status_code == trace.StatusCode.ERROR
    assert broke.attributes["http.response.status_code"] == 200
    assert broke.status.status_code == trace.StatusCode.ERROR
    assert broke.attributes["error.type"] not in ("", "200") and broke.attributes["error.type"][0].isupper()
    for c in calls:
        assert format(c.context.trace_id, "032x") == trace_id and c.parent.span_id == server.context.span_id
