"""OpenTelemetry tracing for shadow: a provider built from the standard OTEL_* variables (never set
as the global provider here), spans for mirrored requests, and spans for the active proxy's
dispatch rounds and admissions and the mode controller's transitions.

- `make_provider(environ)`: a `TracerProvider` with `Resource.create` (honours `OTEL_SERVICE_NAME`,
  `OTEL_RESOURCE_ATTRIBUTES`), the sampler `OTEL_TRACES_SAMPLER` names (always_on, always_off,
  traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio; default
  parentbased_traceidratio) with ratio `OTEL_TRACES_SAMPLER_ARG` (default 0.05: a sidecar on the
  request path samples lightly unless told otherwise), and an OTLP/HTTP exporter (`shadow[otlp]`)
  when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set; None when
  `OTEL_SDK_DISABLED=true`.
- `MirrorSpans(tracer)`: a mirror listener: one INTERNAL span
  `shadow.mirror.request` per sampled request from Arrive (or Route) to Finish/Cancel, with the
  worker, token counts and finish reason; its request id is the mirror's (a tapped request's is
  the hash of its X-Request-Id, `contracts.ids`: the id hash its other spans carry). Unsampled
  requests cost one sampler call and no state; open spans are capped (default 10,000; evictions
  counted in `evicted`).
- `RoutingSpans(tracer)`: what the dispatcher calls per round (`round_start`, `admission`,
  `round_end`) and the mode controller per transition (`mode_transition`); see the class.
- `otlp_provider(environ)`: the provider when an OTLP endpoint is configured, else None;
  `trace_mirror(listeners, environ)` attaches mirrored-request spans to a mirror (returns the provider to
  shut down). `shadow serve` gives its `MirrorSpans` and `RoutingSpans` to what they trace.

HTTP spans (the proxy's SERVER and CLIENT spans, the taps' SERVER spans) and W3C propagation are in
`shadow.telemetry.httpspans`.
"""

from __future__ import annotations

import importlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, MutableSequence, Sequence
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

from shadow.contracts.events import Arrive, Cancel, Event, Finish, Route, Token
from shadow.contracts.ids import request_hash as request_hash  # (spans' request id: re-exported)
from shadow.core.fscore import BR0Scorer
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


#: OTEL_TRACES_SAMPLER values (the specification's built-in samplers) → sampler given the ratio.
SAMPLERS: dict[str, Callable[[float], Sampler]] = {
    "always_on": lambda r: ALWAYS_ON,
    "always_off": lambda r: ALWAYS_OFF,
    "traceidratio": TraceIdRatioBased,
    "parentbased_always_on": lambda r: ParentBased(ALWAYS_ON),
    "parentbased_always_off": lambda r: ParentBased(ALWAYS_OFF),
    "parentbased_traceidratio": lambda r: ParentBased(TraceIdRatioBased(r)),
}


def _sampler(environ: Mapping[str, str]) -> Sampler:
    name = (environ.get("OTEL_TRACES_SAMPLER") or "parentbased_traceidratio").strip().lower()
    make = SAMPLERS.get(name)
    if make is None:
        raise ValueError(f"OTEL_TRACES_SAMPLER must be one of {', '.join(SAMPLERS)}, got {name!r}")
    return make(_ratio(environ))


def make_provider(
    environ: Mapping[str, str] | None = None, *, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """A provider configured from OTEL_* variables; `exporter` overrides OTLP (tests pass one)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    attributes = {"service.name": env.get("OTEL_SERVICE_NAME") or attrs.SERVICE_NAME}
    resource = Resource.create(attributes)
    provider = TracerProvider(resource=resource, sampler=_sampler(env))
    names = _exporters(env)
    if exporter is None and "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if exporter is None and "otlp" in names:
        exporter = _otlp_exporter(env)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


#: OTEL_TRACES_EXPORTER values shadow knows (comma-separated; `none`: no export).
EXPORTERS = ("otlp", "console", "none")
#: OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL values and the exporter module each needs.
PROTOCOLS = {"http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
             "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"}


def _exporters(env: Mapping[str, str]) -> set[str]:
    """The exporters OTEL_TRACES_EXPORTER names; unset: otlp when an OTLP endpoint is set, else none
    (a sidecar exports nothing it was not told to)."""
    raw = env.get("OTEL_TRACES_EXPORTER")
    if raw is None or not raw.strip():
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return {"otlp"} if endpoint else set()
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    unknown = names - set(EXPORTERS)
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {sorted(unknown)[0]!r} "
                         f"(shadow knows {', '.join(EXPORTERS)})")
    return names - {"none"}


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    """The OTLP span exporter of OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL (default http/protobuf), at the
    endpoint the OTLP spec resolves (default http://localhost:4318 or, for grpc, :4317); headers,
    timeout, compression and certificates are read by the exporter from OTEL_EXPORTER_OTLP_* itself."""
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}, "
                         f"got {protocol!r}")
    try:
        module = importlib.import_module(PROTOCOLS[protocol])
    except ImportError:
        extra = "pip install 'shadow[otlp]'" if protocol == "http/protobuf" else (
            "pip install opentelemetry-exporter-otlp-proto-grpc")
        raise ValueError(f"OTLP export over {protocol} needs {extra}") from None
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        endpoint = traces or base or "http://localhost:4317"
    else:
        endpoint = traces or (base or "http://localhost:4318").rstrip("/") + "/v1/traces"
    exporter: SpanExporter = module.OTLPSpanExporter(endpoint=endpoint)
    return exporter


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
        if span.is_recording():
            span.set_attribute(attrs.REQUEST_ID_HASH, rid)  # (already the hash: see the module docstring)
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


def otlp_provider(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """The provider of `make_provider` when the OTEL_* variables name an exporter (OTEL_TRACES_EXPORTER,
    or an OTLP endpoint) and the SDK is not disabled; None otherwise (tracing off: nothing exported)."""
    env = os.environ if environ is None else environ
    if not _exporters(env):
        return None
    return make_provider(env)


def trace_mirror(listeners: MutableSequence[Callable[[Event], None]],
                 environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Append mirrored-request spans to a mirror's `listeners` when an OTLP endpoint is configured
    (see `otlp_provider`); returns the provider to shut down on exit, or None."""
    provider = otlp_provider(environ)
    if provider is not None:
        listeners.append(MirrorSpans(get_tracer(provider)))
    return provider


class Placed(Protocol):
    """What a span reads of a request the dispatcher places (the active proxy's ticket)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def arrived_at(self) -> float: ...


class RoutingSpans:
    """Spans of the active proxy's decode dispatcher and of the mode controller.

    A dispatch round is one span `shadow.route.round` (policy, the requests' mode, pool depth,
    candidate workers = those with a free slot, free slots; at its end the admitted count,
    the decision time and BR's Stage 1 / Stage 2 times); each request it places is a child span
    `shadow.route.admission` (request id hash, worker, pool wait, the placement's BR-0 F-score and
    the worker's load, prompt tokens; never prompt text). Rounds are sampled by the provider's
    sampler, admissions follow their round. With a no-op tracer every call returns at once.
    """

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    @classmethod
    def off(cls) -> RoutingSpans:
        """Spans that record nothing (the default of a dispatcher nobody traces)."""
        return cls(trace.NoOpTracer())

    def round_start(self, policy: str, free_slots: Sequence[int], tickets: Iterable[Placed], *,
                    pool: int, bypass: bool = False) -> trace.Span:
        """Open the span of a round of `policy` over `pool` waiting requests (`tickets`: the
        dispatcher's waiting requests, read only when sampled); `bypass`: one request placed at once."""
        # a root of its own: a round places many requests, it belongs to none of their traces
        span = self.tracer.start_span("shadow.route.round", context=otel_context.Context(),
                                      kind=trace.SpanKind.INTERNAL)
        if not span.is_recording():
            return span
        modes = sorted({t.mode for t in tickets if t.policy == policy})
        span.set_attributes({
            attrs.POLICY: policy, attrs.MODE: ",".join(modes), attrs.POOL_SIZE: pool,
            attrs.CANDIDATES: sum(1 for c in free_slots if c > 0),
            attrs.FREE_SLOTS: int(sum(max(0, c) for c in free_slots)), attrs.ROUND_BYPASS: bypass,
        })
        return span

    def admission(self, round_span: trace.Span, ticket: Placed, worker: str, loads: Sequence[float],
                  g: int, now: float) -> None:
        """A child span of `round_span` for `ticket` placed on worker `g` (`worker`) at `now` (the
        dispatcher's clock); `loads` are the round's loads before this placement."""
        if not round_span.is_recording():
            return
        prompt = ticket.prompt_tokens
        self.tracer.start_span(
            "shadow.route.admission", context=trace.set_span_in_context(round_span),
            kind=trace.SpanKind.INTERNAL,
            attributes={
                attrs.REQUEST_ID_HASH: request_hash(ticket.request_id), attrs.DECISION_WORKER: worker,
                attrs.POLICY: ticket.policy, attrs.MODE: ticket.mode,
                attrs.POOL_WAIT_SECONDS: max(0.0, now - ticket.arrived_at),
                attrs.ADMISSION_SCORE: float(BR0Scorer(loads).score(g, prompt)),
                attrs.WORKER_LOAD: float(loads[g]), attrs.GEN_AI_USAGE_INPUT_TOKENS: int(prompt),
            },
        ).end()

    def round_end(self, span: trace.Span, admitted: int, decision_s: float,
                  stages: Mapping[str, float] | None = None, error: BaseException | None = None) -> None:
        """Close a round's span: `admitted` requests placed, `decision_s` of compute, BR's stages."""
        if not span.is_recording():
            return
        span.set_attribute(attrs.DECISIONS, admitted)
        span.set_attribute(attrs.ROUND_DECISION_SECONDS, decision_s)
        for stage, key in (("stage1", attrs.ROUND_STAGE1_SECONDS), ("stage2", attrs.ROUND_STAGE2_SECONDS)):
            if stages and stage in stages:
                span.set_attribute(key, stages[stage])
        if error is not None:
            span.record_exception(error)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        span.end()

    def canary_verdict(self, step: int, fraction: float, verdict: str, reason: str,
                       figures: Mapping[str, Any]) -> None:
        """A canary step's verdict, with each metric's cohorts and p-value as attributes."""
        attributes: dict[str, Any] = {attrs.CANARY_STEP: step, attrs.CANARY_FRACTION: fraction,
                                      attrs.CANARY_VERDICT: verdict, attrs.CANARY_REASON: reason}
        for metric, fig in figures.items():
            if isinstance(fig, Mapping):
                for k, v in fig.items():
                    if isinstance(v, int | float | str) and not isinstance(v, bool):
                        attributes[f"shadow.canary.{metric}.{k}"] = v
        with self.tracer.start_as_current_span("shadow.canary.verdict", kind=trace.SpanKind.INTERNAL,
                                               attributes=attributes):
            pass

    def mode_transition(self, from_mode: str, to_mode: str, reason: str,
                        inside: Callable[[], None] | None = None) -> None:
        """A mode change (active mode; a short span so it shows on its own); `inside` runs in the
        span's context (the transition's log line, which then carries its trace id)."""
        with self.tracer.start_as_current_span(
            "shadow.mode.transition", context=otel_context.Context(), kind=trace.SpanKind.INTERNAL,
            attributes={attrs.MODE_FROM: from_mode, attrs.MODE_TO: to_mode, attrs.MODE_REASON: reason},
        ):
            if inside is not None:
                inside()


def exemplar() -> dict[str, str] | None:
    """The current sampled span as a histogram exemplar (`trace_id`, `span_id`), else None."""
    ctx = trace.get_current_span().get_span_context()
    if not (ctx.is_valid and ctx.trace_flags.sampled):
        return None
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}
