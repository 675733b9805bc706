"""One trace from an `openai` client through shadow's real processes, read back at a loopback OTLP
receiver (an HTTP server decoding OTLP/HTTP protobuf `POST /v1/traces`): the client's span, the
active proxy's SERVER span, its CLIENT span per upstream call, the taps' spans, each the child
of the `traceparent` its tap received, and each worker's own `llm_request` span (the simulated
fleet's, as vLLM's `--otlp-traces-endpoint` makes it), the child of the `traceparent` the worker
received through its tap — in active mode (proxy → taps → fleet) and in shadow mode (proxy → front
tap → router → taps → fleet, the router traced too). shadow's processes are configured by the
standard OTEL_* variables only, the fleet by vLLM's flag; no span carries the prompt's text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from shadow.telemetry import attrs
from shadow.telemetry.httpspans import inject
from shadow.telemetry.tracing import request_hash
from tests.telemetry.active_stack import ActiveStack, active_stack
from tests.telemetry.servers import OtlpReceiver, wait_for

pytestmark = pytest.mark.integration

SERVER, CLIENT = 2, 3  # OTLP's SpanKind numbers
SHADOW, ROUTER, TEST = "shadow-under-test", "router-under-test", "test-client"
WORKER = "fleet-under-test"
MAX_TOKENS = 5
MARKER = "quokka-marker-prompt"  # the prompt's text: in no span


def _env(rx: OtlpReceiver, service: str) -> dict[str, str]:
    return {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "OTEL_SERVICE_NAME": service, "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            "OTEL_BSP_SCHEDULE_DELAY": "200"}


class Got:
    """One received span: its service, ids as hex, kind, name and attributes."""

    def __init__(self, service: str, span: Any) -> None:
        self.service = service
        self.span = span
        self.id = span.span_id.hex()
        self.trace = span.trace_id.hex()
        self.parent = span.parent_span_id.hex()
        self.kind = span.kind
        self.name = span.name
        self.attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}

    def __repr__(self) -> str:
        return f"<{self.service} {self.kind} {self.name} {self.id}<-{self.parent} {self.attrs}>"


def _fleet_tracing(rx: OtlpReceiver) -> dict[str, Any]:
    """`shadow fleet` traced as vLLM is: `--otlp-traces-endpoint` (over OTLP/HTTP, as vLLM's
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL selects it), its own service name."""
    return {"fleet_args": ("--otlp-traces-endpoint", rx.endpoint + "/v1/traces"),
            "fleet_env": {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": WORKER}}


class Received:
    """What the client received of its streamed completion: the chunks' response id and the usage."""

    def __init__(self, ids: set[str], usage: Any) -> None:
        assert len(ids) == 1, ids
        self.id = ids.pop()
        self.prompt_tokens, self.completion_tokens = usage.prompt_tokens, usage.completion_tokens


def _traced_call(stack: ActiveStack, rx: OtlpReceiver) -> tuple[bytes, str, Received]:
    """A streamed chat completion by the openai client under a CLIENT span of the test's own
    provider (exported to `rx`), its `traceparent` sent as a header; returns (trace id, span id, what
    the client received)."""
    from openai import OpenAI
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": TEST}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.endpoint + "/v1/traces")))
    try:
        client = OpenAI(base_url=stack.front + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        with provider.get_tracer("client").start_as_current_span("chat", kind=trace.SpanKind.CLIENT) as span:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"{MARKER} say hi"}],
                max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True},
                extra_headers=inject({}))
            chunks = list(stream)
            ids = span.get_span_context()
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(pieces), pieces
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1, chunks
        received = Received({c.id for c in chunks}, usage[0])
    finally:
        provider.shutdown()  # the client span is exported
    return ids.trace_id.to_bytes(16, "big"), format(ids.span_id, "016x"), received


def _in_trace(rx: OtlpReceiver, trace_id: bytes) -> list[Got]:
    return [Got(res.get("service.name", ""), s) for res, s in rx.spans() if s.trace_id == trace_id]


def _wait(rx: OtlpReceiver, trace_id: bytes, done: Callable[[list[Got]], bool], what: str) -> list[Got]:
    def ready() -> list[Got] | None:
        got = _in_trace(rx, trace_id)
        return got if done(got) else None

    try:
        spans: list[Got] = wait_for(ready, 60, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the trace holds {_in_trace(rx, trace_id)}") from None
    return spans


def _one(spans: list[Got], **want: Any) -> Got:
    """The one span with these fields (`service`, `kind`, `name`) and attributes (`attr_<key>` with
    dots as '__'; None: no such attribute)."""
    def fits(s: Got) -> bool:
        for k, v in want.items():
            if k.startswith("attr_"):
                if s.attrs.get(k[5:].replace("__", ".")) != v:
                    return False
            elif getattr(s, k) != v:
                return False
        return True

    found = [s for s in spans if fits(s)]
    assert len(found) == 1, (want, spans)
    return found[0]


def _tap_span(spans: list[Got], role: str) -> Got:
    return _one(spans, service=SHADOW, kind=SERVER, name="POST /v1/chat/completions",
                attr_shadow__tap__role=role)


def _no_prompt_text(rx: OtlpReceiver) -> None:
    for res, s in rx.spans():
        for a in s.attributes:
            assert MARKER not in str(a.value), (res, s.name, a.key)


def _check_tap(tap: Got, parent: Got, taps: dict[str, str]) -> None:
    """A tap's span: its parent is `parent` (the CLIENT span that called it), HTTP attributes, and
    its tap's URL is what the caller called."""
    assert tap.parent == parent.id, (tap, parent)
    name = tap.attrs[attrs.TAP_NAME]
    assert parent.attrs["url.full"] == taps[name] + "/v1/chat/completions", (tap, parent)
    assert tap.attrs["http.request.method"] == "POST" and tap.attrs["http.route"] == "/v1/chat/completions"
    assert tap.attrs["http.response.status_code"] == 200 and tap.attrs[attrs.TAP_END] == "complete"
    # the tap's times (its relay's monotonic clock, moved to epoch by the analysis) fall within its
    # caller's call: it got the request head after the call began, it ended about when the call did
    # (its end is when its relay saw the caller close, a moment after the call's end on a busy host)
    t0, t1 = tap.span.start_time_unix_nano, tap.span.end_time_unix_nano
    c0, c1 = parent.span.start_time_unix_nano, parent.span.end_time_unix_nano
    assert c0 - 5_000_000 <= t0 < t1 <= c1 + 5_000_000_000, (t0 - c0, t1 - c1)


def _check_worker(worker: Got, parent: Got, tap: Got) -> None:
    """A worker's `llm_request` span: the child of `parent` (the span whose `traceparent` reached
    the worker through `tap`, which relays it unchanged), in its trace, for the request the tap
    relayed, its vLLM timings consistent with its own start and end."""
    assert worker.parent == parent.id and worker.trace == parent.trace, (worker, parent)
    assert request_hash(worker.attrs["gen_ai.request.id"].removeprefix("chatcmpl-")) == tap.attrs[
        attrs.REQUEST_ID_HASH], (worker, tap)
    assert worker.attrs["gen_ai.request.n"] == 1 and worker.attrs["gen_ai.request.temperature"] == 1.0
    # the worker answered within its caller's call (its span ends once its response was sent, a
    # moment before the caller read the end, or after it on a busy host)
    w0, w1 = worker.span.start_time_unix_nano, worker.span.end_time_unix_nano
    c0, c1 = parent.span.start_time_unix_nano, parent.span.end_time_unix_nano
    assert c0 - 5_000_000 <= w0 < w1 <= c1 + 5_000_000_000, (w0 - c0, w1 - c1)
    a = worker.attrs
    queue, ttft, e2e = (a[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e"))
    assert 0 <= queue <= ttft <= e2e <= (w1 - w0) / 1e9 + 0.01, a
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(
        a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"]), a


def _check_workers(spans: list[Got], calls: dict[str, Got], taps: dict[str, Got], got: Received) -> None:
    """The prefill and the decode worker's `llm_request` spans (`calls` and `taps` by role): the
    decode worker generated what the client received, the prefill worker one token of the prompt."""
    workers = [s for s in spans if s.name == "llm_request"]
    assert len(workers) == 2 and all(s.service == WORKER and s.kind == SERVER for s in workers), workers
    for role in ("prefill", "decode"):
        _check_worker(_one(workers, parent=calls[role].id), calls[role], taps[role])
    decode = _one(workers, parent=calls["decode"].id)
    assert decode.attrs["gen_ai.request.id"] == got.id
    assert decode.attrs["gen_ai.usage.prompt_tokens"] == got.prompt_tokens
    assert decode.attrs["gen_ai.usage.completion_tokens"] == got.completion_tokens
    assert decode.attrs["gen_ai.request.max_tokens"] == MAX_TOKENS
    prefill = _one(workers, parent=calls["prefill"].id)
    assert prefill.attrs["gen_ai.usage.prompt_tokens"] == got.prompt_tokens
    assert prefill.attrs["gen_ai.usage.completion_tokens"] == 1


class Trace:
    """What one traced call through a stack left: the spans of its trace, the client's span, the
    taps' URLs, every span received, the API's /metrics in OpenMetrics and what the client got."""

    def __init__(self, spans: list[Got], client: Got, taps: dict[str, str], rx: OtlpReceiver,
                 metrics: httpx.Response, received: Received) -> None:
        self.spans, self.client, self.taps, self.metrics = spans, client, taps, metrics
        self.received = received
        self.everything = [Got(r.get("service.name", ""), s) for r, s in rx.spans()]


def _through(tmp_path: Path, mode: str, roles: set[str], legs: set[tuple[str, str]]) -> Trace:
    """One traced call through `active_stack(mode=...)` (shadow serve, the router and the fleet
    exporting to a loopback receiver), waited on until its trace holds the client's span, a tap span
    of each of `roles`, a CLIENT span of each (service, leg) in `legs` and the two workers' (prefill,
    decode) `llm_request` spans; no span may hold the prompt's text."""
    rx = OtlpReceiver()
    try:
        traced = {"env": _env(rx, SHADOW), "processes_env": _env(rx, ROUTER), **_fleet_tracing(rx)}
        with active_stack(tmp_path, mode=mode, **traced) as stack:
            trace_id, client_id, received = _traced_call(stack, rx)

            def whole(got: list[Got]) -> bool:
                taps = {s.attrs.get(attrs.TAP_ROLE) for s in got if s.kind == SERVER}
                calls = {(s.service, s.attrs.get(attrs.UPSTREAM_LEG)) for s in got if s.kind == CLIENT}
                workers = sum(1 for s in got if s.service == WORKER)
                client = any(s.service == TEST for s in got)
                return roles <= taps and legs <= calls and workers >= 2 and client

            spans = _wait(rx, trace_id, whole, f"client, proxy, {sorted(legs)} calls, {sorted(roles)} "
                                                "tap spans and two worker spans in one trace")
            metrics = httpx.get(stack.api + "/metrics", timeout=10,
                                headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            taps = dict(stack.serve["taps"])
        _no_prompt_text(rx)
        client = _one(spans, service=TEST, kind=CLIENT, name="chat")
        assert client.id == client_id
        return Trace(spans, client, taps, rx, metrics, received)
    finally:
        rx.close()


def test_active_mode_client_proxy_calls_and_taps_in_one_trace(tmp_path: Path) -> None:
    got = _through(tmp_path, "active", {"prefill", "decode"}, {(SHADOW, "prefill"), (SHADOW, "decode")})
    spans, client = got.spans, got.client
    server = _one(spans, service=SHADOW, kind=SERVER, name="POST /v1/chat/completions",
                  attr_http__route="/v1/chat/completions", attr_url__path="/v1/chat/completions",
                  attr_shadow__tap__role=None)
    assert server.parent == client.id
    assert server.attrs["http.response.status_code"] == 200
    prefill_call = _one(spans, service=SHADOW, kind=CLIENT, attr_shadow__upstream__leg="prefill")
    decode_call = _one(spans, service=SHADOW, kind=CLIENT, attr_shadow__upstream__leg="decode")
    for call in (prefill_call, decode_call):
        assert call.parent == server.id and call.name == "POST"
        assert call.attrs["http.response.status_code"] == 200 and call.attrs["server.address"] == "127.0.0.1"
        assert call.span.end_time_unix_nano <= server.span.end_time_unix_nano
    prefill_tap, decode_tap = _tap_span(spans, "prefill"), _tap_span(spans, "decode")
    _check_tap(prefill_tap, prefill_call, got.taps)
    _check_tap(decode_tap, decode_call, got.taps)
    # the taps relay the proxy's traceparent unchanged: each worker's span is the child of the
    # proxy's call to it
    _check_workers(spans, {"prefill": prefill_call, "decode": decode_call},
                   {"prefill": prefill_tap, "decode": decode_tap}, got.received)
    worker = decode_call.attrs[attrs.UPSTREAM_WORKER]
    assert decode_tap.attrs[attrs.TAP_NAME] == worker and decode_tap.attrs[attrs.ACTUAL_WORKER] == worker
    assert prefill_tap.attrs[attrs.TAP_NAME] == prefill_call.attrs[attrs.UPSTREAM_WORKER]
    # both legs went with the proxy's request id: the taps' spans name it by the same hash, the one
    # the proxy's admission span has
    h = decode_tap.attrs[attrs.REQUEST_ID_HASH]
    assert prefill_tap.attrs[attrs.REQUEST_ID_HASH] == h and len(h) == 16
    admissions = [s for s in got.everything
                  if s.name == "shadow.route.admission" and s.attrs.get(attrs.REQUEST_ID_HASH) == h]
    assert len(admissions) == 1, admissions
    # the API's /metrics in OpenMetrics names the request's trace on its latency buckets
    page = got.metrics
    assert page.headers["content-type"].startswith("application/openmetrics-text")
    assert any(x.startswith("shadow_router_completion_seconds_bucket") and f'trace_id="{server.trace}"' in x
               for x in page.text.splitlines()), page.text[-1500:]


def test_shadow_mode_taps_join_the_proxy_and_the_router(tmp_path: Path) -> None:
    got = _through(tmp_path, "shadow", {"front", "prefill", "decode"},
                   {(SHADOW, "router"), (ROUTER, "prefill"), (ROUTER, "decode")})
    spans, client = got.spans, got.client
    server = _one(spans, service=SHADOW, kind=SERVER, name="POST /v1/chat/completions",
                  attr_url__path="/v1/chat/completions", attr_url__scheme="http", attr_shadow__tap__role=None)
    assert server.parent == client.id
    to_router = _one(spans, service=SHADOW, kind=CLIENT, attr_shadow__upstream__leg="router")
    assert to_router.parent == server.id and to_router.attrs["http.response.status_code"] == 200
    # the front tap relays the proxy's traceparent unchanged: its span and the router's are both
    # children of the proxy's call to the router
    front = _tap_span(spans, "front")
    _check_tap(front, to_router, got.taps)
    router = _one(spans, service=ROUTER, kind=SERVER, name="POST /v1/chat/completions")
    assert router.parent == to_router.id
    # the router's calls to the workers' taps: each tap's span is the child of the router's call,
    # and so is the worker's own span (the tap relays the router's traceparent unchanged)
    calls, taps = {}, {}
    for role in ("prefill", "decode"):
        call = calls[role] = _one(spans, service=ROUTER, kind=CLIENT, attr_shadow__upstream__leg=role)
        assert call.parent == router.id
        tap = taps[role] = _tap_span(spans, role)
        _check_tap(tap, call, got.taps)
        assert tap.attrs[attrs.TAP_NAME] == call.attrs[attrs.UPSTREAM_WORKER]
    _check_workers(spans, calls, taps, got.received)
    assert _tap_span(spans, "decode").attrs[attrs.REQUEST_ID_HASH] == _tap_span(
        spans, "prefill").attrs[attrs.REQUEST_ID_HASH]
