"""OpenTelemetry tracing for shadow: a provider built from the standard OTEL_* variables (never set
as the global provider here), spans for mirrored requests, and the span API the live lanes and the
active proxy call for routing rounds, admissions and mode transitions.

- `make_provider(environ)`: a `TracerProvider` with `Resource.create` (honours `OTEL_SERVICE_NAME`,
  `OTEL_RESOURCE_ATTRIBUTES`), sampler `ParentBased(TraceIdRatioBased(OTEL_TRACES_SAMPLER_ARG))`
  (default ratio 0.05), and an OTLP/HTTP exporter (`shadow[otlp]`) when `OTEL_EXPORTER_OTLP_ENDPOINT`
  or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set; None when `OTEL_SDK_DISABLED=true`.
- `MirrorSpans(tracer)`: a mirror listener (`mirror.listeners.append(...)`): one INTERNAL span
  `shadow.mirror.request` per sampled request from Arrive (or Route) to Finish/Cancel, with the
  worker, token counts and finish reason. Unsampled requests cost one sampler call and no state;
  open spans are capped (default 10,000; evictions counted in `evicted`).
- `RoutingSpans(tracer)`: `round(lane, ...)` (a context manager span per routing round),
  `admission(...)` (a span event on the round), `mode_transition(...)`.
- `trace_mirror(mirror, environ)`: the one call a process makes (`shadow serve`, `shadow tap`):
  when an OTLP endpoint is configured, attach `MirrorSpans` to the mirror and return the provider
  (shut it down on exit); otherwise do nothing and return None.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from shadow.engine.events import Arrive, Cancel, Event, Finish, Route, Token
from shadow.telemetry import attrs

DEFAULT_RATIO = 0.05


def _ratio(environ: Mapping[str, str]) -> float:
    raw = environ.get("OTEL_TRACES_SAMPLER_ARG")
    if raw is None:
        return DEFAULT_RATIO
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be in [0, 1], got {raw!r}")
    return value


def make_provider(
    environ: Mapping[str, str] | None = None, *, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """A provider configured from OTEL_* variables; `exporter` overrides OTLP (tests pass one)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    attributes = {"service.name": env.get("OTEL_SERVICE_NAME") or attrs.SERVICE_NAME}
    resource = Resource.create(attributes)
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(_ratio(env))))
    otlp = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if exporter is None and otlp:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError("OTEL_EXPORTER_OTLP_ENDPOINT is set but OTLP export needs "
                             "pip install 'shadow[otlp]'") from None
        # the endpoint as the OTLP spec resolves it, from `env`; headers, timeout, compression are
        # read by the exporter from OTEL_EXPORTER_OTLP_* itself
        traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        endpoint = traces or str(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")).rstrip("/") + "/v1/traces"
        exporter = OTLPSpanExporter(endpoint=endpoint)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def get_tracer(provider: TracerProvider | None) -> trace.Tracer:
    """The shadow tracer of `provider`, or a no-op tracer when tracing is off."""
    if provider is None:
        return trace.NoOpTracer()
    from shadow import __version__

    return provider.get_tracer("shadow", __version__)


class MirrorSpans:
    """Mirror listener making one span per sampled mirrored request (see module docstring)."""

    def __init__(self, tracer: trace.Tracer, *, max_open: int = 10_000,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.tracer = tracer
        self.max_open = max_open
        self.clock_ns = clock_ns
        self.open: OrderedDict[str, trace.Span] = OrderedDict()
        self.unsampled: set[str] = set()
        self.evicted = 0

    def __call__(self, ev: Event) -> None:
        rid = getattr(ev, "request_id", None)
        if rid is None:
            return
        if isinstance(ev, Arrive | Route) and rid not in self.open and rid not in self.unsampled:
            self._start(rid, ev)
        span = self.open.get(rid)
        if span is None:
            if isinstance(ev, Finish | Cancel):
                self.unsampled.discard(rid)
            return
        if isinstance(ev, Route):
            span.set_attribute(attrs.ACTUAL_WORKER, ev.worker)
            if ev.prompt_tokens is not None:
                span.set_attribute(attrs.GEN_AI_USAGE_INPUT_TOKENS, ev.prompt_tokens)
            span.add_event("route", {attrs.ACTUAL_WORKER: ev.worker}, timestamp=self.clock_ns())
        elif isinstance(ev, Token):
            span.set_attribute(attrs.GEN_AI_USAGE_OUTPUT_TOKENS, ev.generated)
        elif isinstance(ev, Finish):
            if ev.generated is not None:
                span.set_attribute(attrs.GEN_AI_USAGE_OUTPUT_TOKENS, ev.generated)
            span.set_attribute(attrs.FINISH_REASON, ev.reason)
            span.set_attribute(attrs.GEN_AI_RESPONSE_FINISH_REASONS, [ev.reason])
            if ev.reason in ("error", "cut", "reaped"):
                span.set_status(trace.Status(trace.StatusCode.ERROR, ev.reason))
            self._end(rid)
        elif isinstance(ev, Cancel):
            span.set_attribute(attrs.FINISH_REASON, "cancel")
            self._end(rid)

    def _start(self, rid: str, ev: Arrive | Route) -> None:
        span = self.tracer.start_span("shadow.mirror.request", kind=trace.SpanKind.INTERNAL,
                                      attributes={attrs.REQUEST_ID: rid}, start_time=self.clock_ns())
        if not span.is_recording():
            if len(self.unsampled) < self.max_open:
                self.unsampled.add(rid)
            return
        if isinstance(ev, Arrive):
            if ev.prompt_tokens is not None:
                span.set_attribute(attrs.GEN_AI_USAGE_INPUT_TOKENS, ev.prompt_tokens)
            if ev.max_tokens is not None:
                span.set_attribute(attrs.GEN_AI_REQUEST_MAX_TOKENS, ev.max_tokens)
            if ev.prompt_key is not None:
                span.set_attribute(attrs.PROMPT_KEY, ev.prompt_key)
        self.open[rid] = span
        while len(self.open) > self.max_open:
            _, old = self.open.popitem(last=False)
            old.set_attribute(attrs.FINISH_REASON, "evicted")
            old.end(end_time=self.clock_ns())
            self.evicted += 1

    def _end(self, rid: str) -> None:
        span = self.open.pop(rid)
        span.end(end_time=self.clock_ns())


def trace_mirror(mirror: Any, environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Attach mirrored-request spans to `mirror` when OTEL_EXPORTER_OTLP(_TRACES)_ENDPOINT is set
    (and the SDK is not disabled); returns the provider to shut down on exit, or None."""
    env = os.environ if environ is None else environ
    if not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    provider = make_provider(env)
    if provider is not None:
        mirror.listeners.append(MirrorSpans(get_tracer(provider)))
    return provider


class RoutingSpans:
    """Spans for routing: what the live lanes (and later the active proxy) call."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    @contextmanager
    def round(self, lane: str, *, pool_size: int, candidates: int) -> Iterator[trace.Span]:
        """One routing round of `lane` over `pool_size` waiting requests and `candidates` workers."""
        with self.tracer.start_as_current_span(
            "shadow.route.round", kind=trace.SpanKind.INTERNAL,
            attributes={attrs.LANE: lane, attrs.POOL_SIZE: pool_size, attrs.CANDIDATES: candidates},
        ) as span:
            yield span

    def admission(self, span: trace.Span, request_id: str, worker: str | None, *, held: bool = False,
                  actual_worker: str | None = None) -> None:
        """Record one admission decision (or a hold) of a round as a span event."""
        if not span.is_recording():
            return
        event: dict[str, Any] = {attrs.REQUEST_ID: request_id, attrs.HELD: held}
        if worker is not None:
            event[attrs.DECISION_WORKER] = worker
        if actual_worker is not None:
            event[attrs.ACTUAL_WORKER] = actual_worker
            if worker is not None:
                event[attrs.AGREE] = worker == actual_worker
        span.add_event("shadow.admission", event)

    def mode_transition(self, from_mode: str, to_mode: str, reason: str) -> None:
        """A mode change (active mode; a short span so it shows on its own)."""
        with self.tracer.start_as_current_span(
            "shadow.mode.transition", kind=trace.SpanKind.INTERNAL,
            attributes={attrs.MODE_FROM: from_mode, attrs.MODE_TO: to_mode, attrs.MODE_REASON: reason},
        ):
            pass
