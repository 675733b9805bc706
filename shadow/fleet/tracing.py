"""The fleet's request spans, as vLLM 0.32 makes them with `--otlp-traces-endpoint` (its
`OutputProcessor.do_tracing`): one SERVER span `llm_request` per generation request the engine
finished (stop or length; none for a request aborted by its client, a crash or an error), the child
of the W3C `traceparent`/`tracestate` of the request's headers (a root without one), from the
request's arrival to the end of its response, with vLLM's `gen_ai.*` attribute names filled from
the simulated engine's own timestamps and counts. The tracer is given (`shadow fleet` builds it);
a fleet without one makes no span and reads no header.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shadow.fleet.asgi import Scope, header
from shadow.fleet.engine import Seq
from shadow.fleet.openai_api import GenRequest

SPAN_NAME = "llm_request"
#: The headers vLLM reads the trace context from (`vllm.tracing.utils.TRACE_HEADERS`).
TRACE_HEADERS = (b"traceparent", b"tracestate")
#: Finish reasons that end a request in the engine's output path (where vLLM makes the span).
TRACED_FINISHES = ("stop", "length")

# vLLM's `SpanAttributes` names (vllm/tracing/utils.py), those the simulated engine fills truthfully.
REQUEST_ID = "gen_ai.request.id"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
N = "gen_ai.request.n"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
TIME_IN_INFERENCE = "gen_ai.latency.time_in_model_inference"

_W3C = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class Arrival:
    """What a traced request brought: its trace headers and its arrival in epoch nanoseconds."""

    carrier: Mapping[str, str]
    start_ns: int


class RequestSpans:
    """`arrived(scope)` when a generation request comes in; `finished(...)` once its response ended."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def arrived(self, scope: Scope) -> Arrival:
        carrier = {}
        for name in TRACE_HEADERS:
            value = header(scope, name)
            if value is not None:
                carrier[name.decode()] = value
        return Arrival(carrier, time.time_ns())

    def finished(self, arrival: Arrival, req: GenRequest, seq: Seq, rid: str) -> None:
        """The request's span, when the engine finished it (see module docstring); `rid`: the
        response id (vLLM's engine request id is the response id, `-0` added for completions)."""
        if not seq.finished or seq.finish_reason not in TRACED_FINISHES:
            return
        attributes: dict[str, str | int | float] = {
            REQUEST_ID: rid if req.chat else f"{rid}-0",
            PROMPT_TOKENS: seq.prompt_tokens, COMPLETION_TOKENS: seq.generated,
            MAX_TOKENS: req.max_tokens, N: 1,
            E2E: seq.finished_t - seq.arrival, TIME_IN_QUEUE: max(0.0, seq.scheduled_t - seq.arrival),
        }
        if seq.generated > 0:
            attributes |= {TIME_TO_FIRST_TOKEN: seq.first_t - seq.arrival,
                           TIME_IN_PREFILL: seq.first_t - seq.scheduled_t,
                           TIME_IN_DECODE: seq.last_t - seq.first_t,
                           TIME_IN_INFERENCE: seq.last_t - seq.scheduled_t}
        if req.temperature:  # as vLLM: a zero (greedy) temperature or top_p is not recorded
            attributes[TEMPERATURE] = req.temperature
        if req.top_p:
            attributes[TOP_P] = req.top_p
        span = self.tracer.start_span(SPAN_NAME, context=_W3C.extract(arrival.carrier),
                                      kind=trace.SpanKind.SERVER, start_time=arrival.start_ns,
                                      attributes=attributes)
        span.end(end_time=max(arrival.start_ns, time.time_ns()))
