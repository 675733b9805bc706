"""Tracing: mirrored-request spans (sampled, capped), routing-round spans, provider from OTEL_*
variables; asserted with the in-memory exporter on an injected provider (never the global one)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shadow.contracts.events import Arrive, Cancel, Finish, Route, Token
from shadow.telemetry import attrs
from shadow.telemetry.tracing import MirrorSpans, RoutingSpans, get_tracer, make_provider, request_hash
from tests.telemetry.stack import running_stack, send_traffic


def _provider(ratio: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = make_provider({"OTEL_TRACES_SAMPLER_ARG": ratio, "OTEL_SERVICE_NAME": "shadow-test"})
    assert provider is not None
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


Traced = tuple[trace.Tracer, InMemorySpanExporter]


@pytest.fixture
def traced() -> Iterator[Traced]:
    provider, exporter = _provider("1")
    yield get_tracer(provider), exporter
    provider.shutdown()


def test_one_span_per_request_with_worker_tokens_and_reason(traced: Traced) -> None:
    tracer, exporter = traced
    spans = MirrorSpans(tracer, clock_ns=iter(range(1_000, 10_000, 100)).__next__)
    for ev in (Arrive("r1", 0.0, prompt_tokens=50, max_tokens=9, prompt_key="k1"),
               Route("r1", 0.1, "d1"),
               Token("r1", 0.2, 3), Token("r1", 0.3, 9), Finish("r1", 0.4, "length", 9),
               Arrive("r2", 0.0), Route("r2", 0.1, "d0"), Cancel("r2", 0.2)):
        spans(ev)
    done = {s.attributes[attrs.REQUEST_ID]: s for s in exporter.get_finished_spans()}
    assert set(done) == {"r1", "r2"} and not spans.open
    r1 = done["r1"]
    assert r1.name == "shadow.mirror.request" and r1.kind == trace.SpanKind.INTERNAL
    assert r1.attributes[attrs.ACTUAL_WORKER] == "d1"
    assert r1.attributes[attrs.GEN_AI_USAGE_INPUT_TOKENS] == 50
    assert r1.attributes[attrs.GEN_AI_REQUEST_MAX_TOKENS] == 9
    assert r1.attributes[attrs.GEN_AI_USAGE_OUTPUT_TOKENS] == 9
    assert r1.attributes[attrs.FINISH_REASON] == "length"
    assert r1.attributes[attrs.PROMPT_KEY] == "k1"
    assert r1.attributes[attrs.REQUEST_ID_HASH] == "r1"  # a mirror id already is its request's id hash
    assert [e.name for e in r1.events] == ["route"]
    assert r1.start_time < r1.events[0].timestamp < r1.end_time
    assert r1.resource.attributes["service.name"] == "shadow-test"
    assert done["r2"].attributes[attrs.FINISH_REASON] == "cancel"
    assert done["r2"].status.status_code == trace.StatusCode.UNSET


def test_errors_mark_the_span(traced: Traced) -> None:
    tracer, exporter = traced
    spans = MirrorSpans(tracer)
    spans(Route("r", 0.0, "d0"))  # a request first seen at routing still gets its span
    spans(Finish("r", 1.0, "cut"))
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR and span.attributes[attrs.FINISH_REASON] == "cut"


def test_unsampled_requests_keep_no_span_state() -> None:
    provider, exporter = _provider("0")
    spans = MirrorSpans(get_tracer(provider))
    for i in range(5):
        spans(Arrive(f"r{i}", 0.0))
        spans(Route(f"r{i}", 0.1, "d0"))
    assert not spans.open and len(spans.unsampled) == 5
    for i in range(5):
        spans(Finish(f"r{i}", 1.0))
    assert not spans.unsampled and exporter.get_finished_spans() == ()


def test_open_spans_are_capped_and_evictions_counted(traced: Traced) -> None:
    tracer, exporter = traced
    spans = MirrorSpans(tracer, max_open=2)
    for i in range(3):
        spans(Arrive(f"r{i}", 0.0))
    assert len(spans.open) == 2 and spans.evicted == 1
    (evicted,) = exporter.get_finished_spans()
    assert evicted.attributes[attrs.REQUEST_ID] == "r0"
    assert evicted.attributes[attrs.FINISH_REASON] == "evicted"


@dataclass
class _Ticket:
    request_id: str
    prompt_tokens: int
    policy: str
    arrived_at: float
    mode: str = "active"


def test_routing_round_with_admission_children_and_mode_transition(traced: Traced) -> None:
    tracer, exporter = traced
    routing = RoutingSpans(tracer)
    waiting = [_Ticket("a", 100, "br0", 1.0), _Ticket("b", 50, "br0", 1.5, "fallback"),
               _Ticket("c", 10, "rr", 0.5)]
    span = routing.round_start("br0", [2, 0, 1], waiting, pool=2)
    routing.admission(span, waiting[0], "d2", [300.0, 500.0, 200.0], 2, now=2.0)
    routing.admission(span, waiting[1], "d0", [300.0, 500.0, 300.0], 0, now=2.0)
    routing.round_end(span, 2, 0.001, {"stage1": 0.0004, "stage2": 0.0005})
    routing.mode_transition("shadow", "active", "operator")
    a, b, rnd, mode = exporter.get_finished_spans()
    assert rnd.name == "shadow.route.round" and rnd.parent is None
    assert dict(rnd.attributes) == {
        attrs.POLICY: "br0", attrs.MODE: "active,fallback", attrs.POOL_SIZE: 2, attrs.CANDIDATES: 2,
        attrs.FREE_SLOTS: 3, attrs.ROUND_BYPASS: False, attrs.DECISIONS: 2,
        attrs.ROUND_DECISION_SECONDS: 0.001, attrs.ROUND_STAGE1_SECONDS: 0.0004,
        attrs.ROUND_STAGE2_SECONDS: 0.0005}
    for child in (a, b):
        assert child.name == "shadow.route.admission"
        assert child.parent is not None and child.parent.span_id == rnd.context.span_id
        assert child.context.trace_id == rnd.context.trace_id
    assert a.attributes[attrs.REQUEST_ID_HASH] == request_hash("a") != request_hash("b")
    assert request_hash("a") == hashlib.blake2b(b"a", digest_size=8).hexdigest()
    assert a.attributes[attrs.DECISION_WORKER] == "d2" and a.attributes[attrs.POOL_WAIT_SECONDS] == 1.0
    # BR-0 over loads (300, 500, 200): 100 tokens on d2 stay under the max: score = delta
    assert a.attributes[attrs.ADMISSION_SCORE] == 100.0 and a.attributes[attrs.WORKER_LOAD] == 200.0
    # 50 tokens on d0 of (300, 500, 300): under the max too; mode and policy of the request
    assert b.attributes[attrs.ADMISSION_SCORE] == 50.0 and b.attributes[attrs.MODE] == "fallback"
    assert b.attributes[attrs.GEN_AI_USAGE_INPUT_TOKENS] == 50 and b.attributes[attrs.POLICY] == "br0"
    assert mode.name == "shadow.mode.transition" and mode.attributes[attrs.MODE_REASON] == "operator"


def test_admission_score_is_the_br0_f_score(traced: Traced) -> None:
    tracer, exporter = traced
    routing = RoutingSpans(tracer)
    t = _Ticket("x", 400, "br0", 0.0)
    span = routing.round_start("br0", [1, 1], [t], pool=1)
    routing.admission(span, t, "d1", [1000.0, 900.0], 1, now=0.0)  # 400 - 2 * (400 - 100) = -200
    routing.round_end(span, 1, 0.0)
    adm, _ = exporter.get_finished_spans()
    assert adm.attributes[attrs.ADMISSION_SCORE] == -200.0


def test_a_round_without_a_free_slot_is_a_span_and_unsampled_or_off_ones_record_nothing(
        traced: Traced) -> None:
    tracer, exporter = traced
    t = _Ticket("x", 1, "br0", 0.0)
    routing = RoutingSpans(tracer)
    span = routing.round_start("br0", [0, 0], [t], pool=1)  # back-pressure: nothing to place
    routing.round_end(span, 0, 0.0001)
    (rnd,) = exporter.get_finished_spans()
    assert rnd.attributes[attrs.CANDIDATES] == 0 and rnd.attributes[attrs.FREE_SLOTS] == 0
    assert rnd.attributes[attrs.POOL_SIZE] == 1 and rnd.attributes[attrs.DECISIONS] == 0
    exporter.clear()
    off = RoutingSpans.off()
    span = off.round_start("br0", [1], [t], pool=1)
    assert not span.is_recording()
    off.admission(span, t, "d0", [0.0], 0, now=0.0)
    off.round_end(span, 1, 0.0)
    provider, unsampled = _provider("0")
    routing = RoutingSpans(get_tracer(provider))
    span = routing.round_start("br0", [1], [t], pool=1)
    assert not span.is_recording()
    routing.admission(span, t, "d0", [0.0], 0, now=0.0)
    routing.round_end(span, 1, 0.0)
    provider.shutdown()
    assert exporter.get_finished_spans() == () and unsampled.get_finished_spans() == ()


def test_a_failed_round_is_an_error_span(traced: Traced) -> None:
    tracer, exporter = traced
    routing = RoutingSpans(tracer)
    span = routing.round_start("brh", [1], [], pool=3)
    routing.round_end(span, 0, 0.002, error=RuntimeError("predictor broke"))
    (rnd,) = exporter.get_finished_spans()
    assert rnd.status.status_code == trace.StatusCode.ERROR and rnd.status.description == "RuntimeError"
    assert rnd.attributes[attrs.DECISIONS] == 0 and rnd.attributes[attrs.MODE] == ""
    assert [e.name for e in rnd.events] == ["exception"]


def test_provider_from_environment() -> None:
    assert make_provider({"OTEL_SDK_DISABLED": "true"}) is None
    assert isinstance(get_tracer(None), trace.NoOpTracer)
    spans = MirrorSpans(get_tracer(None))
    spans(Arrive("r", 0.0))
    assert not spans.open  # no-op spans are never recording
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        make_provider({"OTEL_TRACES_SAMPLER_ARG": "2"})
    p = make_provider({})
    assert p is not None and p.sampler.get_description().startswith("ParentBased")
    p.shutdown()


@pytest.mark.integration
def test_spans_for_real_mirrored_requests(traced: Traced) -> None:
    tracer, exporter = traced
    spans = MirrorSpans(tracer)
    with running_stack() as stack:
        stack.taps.sync(stack.taps.svc.mirror.listeners.append, spans)
        send_traffic(list(stack.tap_urls.values()), per_url=3, max_tokens=6)
        stack.taps.wait_for(lambda: stack.taps.svc.state.live() == 0 and not len(stack.taps.svc.queue))
        assert stack.taps.sync(lambda: len(spans.open)) == 0
    done = exporter.get_finished_spans()
    assert len(done) == 6
    by_worker: dict[str, int] = {}
    for s in done:
        w = s.attributes[attrs.ACTUAL_WORKER]
        by_worker[w] = by_worker.get(w, 0) + 1
        assert 0 < s.attributes[attrs.GEN_AI_USAGE_OUTPUT_TOKENS] <= 6
        assert s.attributes[attrs.FINISH_REASON] in ("stop", "length")
        assert s.end_time > s.start_time
    assert by_worker == {"d0": 3, "d1": 3}


def test_trace_mirror_exports_over_otlp_http_configured_by_otel_variables() -> None:
    """The standard variables alone send mirrored-request spans to an OTLP/HTTP receiver (a loopback
    double decoding the protobuf); without an endpoint nothing is attached."""
    from shadow.telemetry.tracing import trace_mirror
    from tests.telemetry.servers import OtlpReceiver

    class _Mirror:
        def __init__(self) -> None:
            self.listeners: list[object] = []

    assert trace_mirror(_Mirror().listeners, {}) is None
    rx = OtlpReceiver()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
               "OTEL_TRACES_SAMPLER_ARG": "1", "OTEL_SERVICE_NAME": "shadow-otlp-test"}
        mirror = _Mirror()
        provider = trace_mirror(mirror.listeners, env)
        assert provider is not None and len(mirror.listeners) == 1
        listener = mirror.listeners[0]
        assert isinstance(listener, MirrorSpans)
        listener(Arrive("r1", 0.0, prompt_tokens=12))
        listener(Route("r1", 0.1, "d3"))
        listener(Finish("r1", 0.5, "stop", 4))
        provider.shutdown()  # flushes the batch processor
    finally:
        rx.close()
    assert rx.posts == [("/v1/traces", "application/x-protobuf")]
    ((res, span),) = rx.spans()
    assert res["service.name"] == "shadow-otlp-test"
    got = {a.key: a.value for a in span.attributes}
    assert span.name == "shadow.mirror.request"
    assert got[attrs.ACTUAL_WORKER].string_value == "d3"
    assert got[attrs.GEN_AI_USAGE_OUTPUT_TOKENS].int_value == 4


@pytest.mark.integration
def test_shadow_serve_exports_spans_when_otel_variables_say_so() -> None:
    """`shadow serve` as a process, configured only by OTEL_* variables, sends one span per
    mirrored request and one per request a tap relayed to an OTLP/HTTP receiver; SIGTERM flushes
    what is left."""
    from tests.telemetry.servers import OtlpReceiver, traced_serve_process, wait_for
    from tests.telemetry.stack import send_traffic

    rx = OtlpReceiver()
    try:
        env = {"OTEL_TRACES_SAMPLER_ARG": "1", "OTEL_SERVICE_NAME": "shadow-serve-test"}
        with traced_serve_process(rx, [], env, slots=8) as ready:
            send_traffic(list(ready["taps"].values()), per_url=2, max_tokens=5)
            wait_for(lambda: len(rx.spans()) >= 8, 30, "8 spans at the OTLP receiver")
    finally:
        rx.close()
    everything = rx.spans()
    assert len(everything) == 8
    assert {res["service.name"] for res, _ in everything} == {"shadow-serve-test"}
    spans = [s for _, s in everything if s.name == "shadow.mirror.request"]
    taps = [s for _, s in everything if s.name == "POST /v1/completions"]
    assert len(spans) == len(taps) == 4
    workers = sorted({a.key: a.value for a in s.attributes}[attrs.ACTUAL_WORKER].string_value for s in spans)
    assert workers == ["d0", "d0", "d1", "d1"]
    tapped = sorted({a.key: a.value for a in s.attributes}[attrs.TAP_NAME].string_value for s in taps)
    assert tapped == ["d0", "d0", "d1", "d1"] and all(s.kind == 2 and not s.parent_span_id for s in taps)
