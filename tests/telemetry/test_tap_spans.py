"""The taps' spans, made by the analysis from what a tap handed over: a SERVER span per relayed
generation request, the child of the `traceparent` the tap received (a root without one), with the
HTTP attributes, the tap, its role, the worker and the request id's hash (never prompt text);
unsampled ones keep no state, open ones are capped, a broken stream is an error. Asserted with the
in-memory exporter; the analyzer tells the spans of each generation request's start and end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

from shadow.contracts.tapwire import TapContext
from shadow.dataplane.http1 import head_ids
from shadow.mirror.analyzer import Analyzer
from shadow.mirror.hub import Mirror
from shadow.mirror.state import MirrorState
from shadow.telemetry import attrs
from shadow.telemetry.httpspans import TapSpans
from shadow.telemetry.tracing import request_hash

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
TP = f"00-{TRACE_ID}-{PARENT}-01"
NOW_NS = 1_700_000_000_000_000_000
MARKER = "platypus-marker-prompt"


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))  # roots unsampled unless asked
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _spans(provider: TracerProvider, max_open: int = 10_000) -> TapSpans:
    # the analysis's monotonic clock reads 100 s while the wall clock reads NOW_NS
    return TapSpans(provider.get_tracer("t"), max_open=max_open, clock=lambda: 100.0, clock_ns=lambda: NOW_NS)


def _ctx(rid: str | None = request_hash("r1"), tp: str | None = TP, tap: str = "d1", t: float = 99.5
         ) -> TapContext:
    """A request as a tap hands it over (its request id: the hash of its X-Request-Id)."""
    body = f'{{"prompt": "{MARKER}", "max_tokens": 3, "stream": true}}'.encode()
    ctx = TapContext(tap, "POST", "/v1/completions?x=1", rid, body, len(body), t, tp)
    return ctx


def test_a_tap_span_is_the_child_of_the_traceparent_the_tap_received(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    spans = _spans(provider)
    ctx = _ctx()
    spans.started(ctx, "decode")
    ctx.status = 200
    spans.ended(ctx, 99.75, "complete", "d1")
    (s,) = exporter.get_finished_spans()
    assert s.kind == trace.SpanKind.SERVER and s.name == "POST /v1/completions"
    assert format(s.context.trace_id, "032x") == TRACE_ID
    assert s.parent is not None and format(s.parent.span_id, "016x") == PARENT and s.parent.is_remote
    got = dict(s.attributes or {})
    assert got == {
        "http.request.method": "POST", "http.route": "/v1/completions", "url.path": "/v1/completions",
        "url.scheme": "http", "network.protocol.version": "1.1", "http.response.status_code": 200,
        attrs.TAP_NAME: "d1", attrs.TAP_ROLE: "decode", attrs.TAP_END: "complete",
        attrs.ACTUAL_WORKER: "d1", attrs.REQUEST_ID_HASH: request_hash("r1"),
    }
    assert MARKER not in repr(got)
    # the tap's times (monotonic, 0.5 s and 0.25 s before "now") as epoch nanoseconds
    assert (s.start_time, s.end_time) == (NOW_NS - 500_000_000, NOW_NS - 250_000_000)
    assert not spans.open and s.status.status_code == trace.StatusCode.UNSET


def test_without_a_traceparent_the_sampler_decides_and_unsampled_ones_keep_nothing(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    spans = _spans(provider)
    unsampled = f"00-{TRACE_ID}-{PARENT}-00"
    for ctx in (_ctx(tp=None), _ctx(tp="garbage"), _ctx(tp=unsampled)):
        spans.started(ctx, "decode")  # roots at ratio 0, and a parent that says "not sampled"
        assert not spans.open
        spans.ended(ctx, 99.9, "complete", "d1")
    assert exporter.get_finished_spans() == ()
    always = TracerProvider(sampler=ALWAYS_ON)
    mem = InMemorySpanExporter()
    always.add_span_processor(SimpleSpanProcessor(mem))
    root = TapSpans(always.get_tracer("t"))
    ctx = _ctx(rid=None, tp=None)
    root.started(ctx, "prefill")
    root.ended(ctx, ctx.t_start + 0.1, "complete", None)
    (s,) = mem.get_finished_spans()
    assert s.parent is None and attrs.REQUEST_ID_HASH not in (s.attributes or {})
    assert attrs.ACTUAL_WORKER not in (s.attributes or {}) and s.attributes[attrs.TAP_ROLE] == "prefill"
    always.shutdown()


@pytest.mark.parametrize("reason", ["upstream_cut", "upstream_error", "relay_lost"])
def test_a_stream_the_tap_saw_break_is_an_error(
        exported: tuple[TracerProvider, InMemorySpanExporter], reason: str) -> None:
    provider, exporter = exported
    spans = _spans(provider)
    ctx = _ctx()
    spans.started(ctx, "decode")
    ctx.status = 200
    spans.ended(ctx, 99.9, reason, "d1")
    (s,) = exporter.get_finished_spans()
    assert s.status.status_code == trace.StatusCode.ERROR and s.attributes["error.type"] == reason


def test_a_5xx_answer_is_an_error_and_a_client_cancel_is_not(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    spans = _spans(provider)
    failed, left = _ctx(rid=request_hash("a")), _ctx(rid=request_hash("b"))
    spans.started(failed, "decode")
    spans.started(left, "decode")
    failed.status, left.status = 503, 200
    spans.ended(failed, 99.9, "complete", "d1")
    spans.ended(left, 99.9, "client_cancel", "d1")
    by_hash = {s.attributes[attrs.REQUEST_ID_HASH]: s for s in exporter.get_finished_spans()}
    bad, gone = by_hash[request_hash("a")], by_hash[request_hash("b")]
    assert bad.status.status_code == trace.StatusCode.ERROR and bad.attributes["error.type"] == "503"
    assert gone.status.status_code == trace.StatusCode.UNSET
    assert gone.attributes[attrs.TAP_END] == "client_cancel"


def test_open_spans_are_capped_the_oldest_ended_as_evicted(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    spans = _spans(provider, max_open=2)
    ctxs = [_ctx(rid=request_hash(f"r{i}")) for i in range(3)]
    for c in ctxs:
        spans.started(c, "decode")
    assert len(spans.open) == 2 and spans.evicted == 1
    (old,) = exporter.get_finished_spans()
    assert old.attributes[attrs.REQUEST_ID_HASH] == request_hash("r0")
    assert old.attributes[attrs.TAP_END] == "evicted"
    spans.ended(ctxs[0], 99.9, "complete", "d1")  # already gone: nothing
    assert len(exporter.get_finished_spans()) == 1


def test_head_ids_reads_the_first_request_id_and_a_bounded_traceparent() -> None:
    head = [(b"X-Request-ID", b"a"), (b"x-request-id", b"b"), (b"TRACEPARENT", b" " + TP.encode())]
    assert head_ids(head) == (request_hash("a"), TP)  # the id's hash: the id itself is never kept
    assert head_ids([(b"traceparent", b"0" * 129)]) == (None, None)
    assert head_ids([]) == (None, None)


class _Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    def started(self, ctx: TapContext, role: str) -> None:
        self.calls.append(("start", ctx.request_id, role))
        if self.fail:
            raise RuntimeError("tracing broke")

    def ended(self, ctx: TapContext, t: float, reason: str, worker: str | None) -> None:
        self.calls.append(("end", ctx.request_id, reason, worker))


def _analyzer(spans: _Recorder, **kw: Any) -> Analyzer:
    mirror = Mirror(MirrorState({"d0": "", "d1": ""}, slots=4))
    return Analyzer(mirror, spans=spans, clock=lambda: 100.0, **kw)


def test_the_analyzer_tells_the_spans_of_generation_requests_only() -> None:
    rec = _Recorder()
    an = _analyzer(rec, prefill_taps=("p0",))
    gen = _ctx(rid="g", tap="d1")
    pre = TapContext("p0", "POST", "/v1/completions", "g", b'{"prompt": "x", "max_tokens": 1}', 30, 99.0, TP)
    models = TapContext("d1", "GET", "/v1/models", None, b"", 0, 99.0, TP)
    gen.status = pre.status = models.status = 200
    an.process([(pre, 0, 99.0, None), (models, 0, 99.0, None), (gen, 0, 99.5, None),
                (models, -1, 99.1, "complete"), (pre, -1, 99.2, "complete"),
                (gen, -1, 99.9, "client_cancel")])
    assert rec.calls == [("start", "g", "prefill"), ("start", "g", "decode"), ("end", "g", "complete", None),
                         ("end", "g", "client_cancel", "d1")]


def test_a_front_taps_span_role_and_a_failing_span_maker_leave_the_mirror_alone() -> None:
    rec = _Recorder(fail=True)
    an = _analyzer(rec, front_taps=("router",))
    ctx = _ctx(rid="f", tap="router")
    an.process([(ctx, 0, 99.5, None), (ctx, -1, 99.9, "complete")])
    assert rec.calls == [("start", "f", "front"), ("end", "f", "complete", None)]
    assert an.mirror.errors == {"tracing": 1}
    assert an.mirror.events == {("tap", "arrive"): 1, ("tap", "finish"): 1}  # still mirrored


def test_a_client_that_left_after_the_streams_end_ended_it_complete() -> None:
    """The span's end is the analysis's judgement, as the mirror's: a client (or the proxy before
    it) that closed after `[DONE]` had the whole stream."""
    rec = _Recorder()
    an = _analyzer(rec)
    whole, cut = _ctx(rid="w"), _ctx(rid="c")
    for c in (whole, cut):
        c.status, c.resp_headers = 200, {"content-type": "text/event-stream"}
    chunk = b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    an.process([(whole, 0, 99.5, None), (whole, 1, 99.6, chunk), (whole, -1, 99.7, "client_cancel"),
                (cut, 0, 99.5, None), (cut, 1, 99.6, chunk[:20]), (cut, -1, 99.7, "client_cancel")])
    assert [c for c in rec.calls if c[0] == "end"] == [("end", "w", "complete", "d1"),
                                                     ("end", "c", "client_cancel", "d1")]
