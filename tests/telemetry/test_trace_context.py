"""W3C Trace Context through the active proxy: a client's `traceparent` becomes the parent of the
proxy's SERVER span (HTTP semantic conventions), and every upstream call (prefill, decode, the
router in shadow mode) carries a `traceparent` whose parent is that span; latency histograms carry
the sampled span as an OpenMetrics exemplar; the OTEL_* exporter variables pick the exporter."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

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
from shadow.telemetry.tracing import RoutingSpans, inject, make_provider, otlp_provider
from tests.active.stubs import DONE, Step, Stub, sse

SERVER, CLIENT = 2, 3  # OTLP's SpanKind numbers
BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4, "stream": True}


def _parent(traceparent: str) -> tuple[str, str]:
    """(trace id, parent span id) of a `traceparent` header value."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and len(flags) == 2
    return trace_id, span_id


async def _through(mode: str) -> tuple[InMemorySpanExporter, Stub, Stub, ActiveProxy, str]:
    """One streamed request through a proxy in `mode` with a client span around it; returns the
    spans, the prefill and decode (or router) stubs, the proxy and the client span's traceparent."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pre = Stub([], role="prefill")
    dec = Stub([Step(events=[sse("a", 0), sse("b", 1), sse("c", 2, "stop"), DONE])])
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
                r = await c.post(url + "/v1/completions", content=orjson.dumps(BODY),
                                 headers={**headers, "content-type": "application/json"})
        assert r.status_code == 200 and r.content.endswith(DONE)
        for _ in range(200):  # the server span ends with the stream's last byte
            if any(s.kind == trace.SpanKind.SERVER for s in exporter.get_finished_spans()):
                break
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
    ours = format(server.context.span_id, "016x")
    upstream = [pre, dec] if mode == "active" else [dec]
    for stub in upstream:
        headers, _ = stub.calls[0]
        # the worker's (or router's) parent is shadow's span, in the client's trace: the client's
        # own traceparent did not pass unchanged
        assert _parent(headers["traceparent"]) == (trace_id, ours), (stub.role, headers["traceparent"])
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


@pytest.mark.integration
def test_an_openai_client_trace_joins_shadow_serve_active_at_an_otlp_receiver(tmp_path: Path) -> None:
    """The real `shadow serve --active` process, configured by OTEL_* variables only, and the openai
    client sending under a span of its own (exported to the same loopback OTLP receiver): the
    proxy's SERVER span arrives in the client's trace, as the child of the client's span."""
    from openai import OpenAI
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from tests.telemetry.active_stack import active_stack
    from tests.telemetry.servers import OtlpReceiver, wait_for

    rx = OtlpReceiver()
    try:
        env = {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
               "OTEL_SERVICE_NAME": "shadow-under-test", "OTEL_TRACES_SAMPLER": "parentbased_always_on",
               "OTEL_BSP_SCHEDULE_DELAY": "200"}
        with active_stack(tmp_path, mode="active", env=env) as stack:
            provider = TracerProvider(resource=Resource.create({"service.name": "test-client"}))
            exporter = OTLPSpanExporter(endpoint=rx.endpoint + "/v1/traces")
            provider.add_span_processor(BatchSpanProcessor(exporter))
            client = OpenAI(base_url=stack.front + "/v1", api_key="unused", max_retries=0, timeout=60)
            model = client.models.list().data[0].id
            tracer = provider.get_tracer("client")
            with tracer.start_as_current_span("chat", kind=trace.SpanKind.CLIENT) as span:
                out = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                    extra_headers=inject({}))
                ids = span.get_span_context()
            assert out.choices[0].message.content is not None
            provider.shutdown()
            trace_id = ids.trace_id.to_bytes(16, "big")

            def joined() -> list[tuple[dict[str, str], Any]] | None:
                got = [(res, s) for res, s in rx.spans() if s.trace_id == trace_id]
                kinds = {(res["service.name"], s.kind) for res, s in got}
                return got if {("test-client", CLIENT), ("shadow-under-test", SERVER)} <= kinds else None

            spans = wait_for(joined, 60, "the client's and shadow's spans in one trace")
            # the API's /metrics in OpenMetrics names the request's trace on its latency buckets
            page = httpx.get(stack.api + "/metrics", timeout=10,
                             headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            assert page.headers["content-type"].startswith("application/openmetrics-text")
            hex_id = format(ids.trace_id, "032x")
            assert any(x.startswith("shadow_router_completion_seconds_bucket") and f'trace_id="{hex_id}"' in x
                       for x in page.text.splitlines()), page.text[-1500:]
            plain = httpx.get(stack.api + "/metrics", timeout=10)
            assert plain.headers["content-type"].startswith("text/plain") and "trace_id" not in plain.text
    finally:
        rx.close()
    (server,) = [s for res, s in spans if res["service.name"] == "shadow-under-test" and s.kind == SERVER]
    assert server.name == "POST /v1/chat/completions"
    assert server.parent_span_id == ids.span_id.to_bytes(8, "big")
    got = {a.key: a.value for a in server.attributes}
    assert got["http.response.status_code"].int_value == 200
