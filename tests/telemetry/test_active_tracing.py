"""Spans of the active proxy, through the real thing: `shadow serve --active` (its configuration
parsed from the command line, the service run in-process so spans go to an in-memory exporter)
in front of a simulated P/D fleet, traced as `shadow serve` traces (`ServeService(..., tracing=provider)`).

Asserted: a span per dispatch round (policy, the requests' mode, pool depth, candidates, free
slots, admitted count, decision and Stage 1 / Stage 2 times) with one child span per admission
(request id hash, worker, pool wait, BR-0 score, load; never prompt text); every request the
proxy answered was admitted exactly once, under a round of its trace; the mode transition an
operator forces is a span; rounds in fallback carry policy rr and mode fallback; the sampler the
OTEL_* variables name decides, and unsampled rounds leave nothing behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased

from shadow.commands.serve import build_parser, config_from_args
from shadow.fleet import FleetConfig
from shadow.telemetry import attrs
from shadow.telemetry.tracing import make_provider, request_hash
from tests.harness import FleetThread, ServeThread

pytestmark = pytest.mark.integration

TOKEN = "tracing-test-admin-token-0123456789"
SECRET = "tracing-secret-prompt"  # prompt text that must appear in no span


def _provider(environ: dict[str, str]) -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = make_provider({"OTEL_SERVICE_NAME": "shadow-active-test", **environ})
    assert provider is not None
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@contextmanager
def traced_serve(provider: TracerProvider, slots: int = 2,
                 extra: tuple[str, ...] = ()) -> Iterator[tuple[ServeThread, str]]:
    """A P/D fleet (1 prefill, 2 decode ranks) and `shadow serve --active` in mode active, pinned
    (no automatic fallback under a loaded test machine), traced into `provider`."""
    with FleetThread(FleetConfig(prefill=1, decode=2, slots=slots, base_port=0, time_scale=0.05)) as fleet:
        argv = ["--slots", str(slots), "--active", "--active-policy", "br0", "--mode", "active",
                "--pin-mode", "--admin-token", TOKEN, "--scrape-interval", "0.5", "--oracle-interval", "0",
                *extra]
        for g, url in enumerate(fleet.decode_urls):
            argv += ["--upstream", f"d{g}={url}"]
        argv += ["--prefill", f"p0={fleet.prefill_urls[0]}"]
        config = config_from_args(build_parser().parse_args(argv))

        with ServeThread(config, provider) as serve:
            yield serve, str(serve.ready["active"])


def _send(url: str, n: int, max_tokens: int = 6) -> list[str]:
    """`n` concurrent streamed completions through the proxy; their X-Request-Id headers."""

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": "sim-llm", "prompt": f"{SECRET} {i} " + "w " * (20 + 40 * i), "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            assert len(events) == max_tokens
            return r.headers["x-request-id"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(n))))

    return asyncio.run(run())


def _named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _values(span: ReadableSpan) -> list[Any]:
    out: list[Any] = list((span.attributes or {}).values())
    for ev in span.events:
        out += list((ev.attributes or {}).values())
    return out


def test_rounds_admissions_and_mode_transitions_of_the_real_proxy() -> None:
    provider, exporter = _provider({"OTEL_TRACES_SAMPLER": "always_on"})
    try:
        with traced_serve(provider) as (serve, url):
            active_rids = _send(url, 10)  # 10 streams > 2 ranks x 2 slots: the pool fills
            r = httpx.put(serve.ready["api"] + "/v1/mode", json={"mode": "fallback", "pin": True},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            assert r.status_code == 200, r.text
            fallback_rids = _send(url, 4)
            proxy = serve.serve.proxy
            assert proxy is not None
            rounds_run = serve.sync(lambda: proxy.dispatcher.rounds)
            # every mirrored request ended (the mirror spans are closed)
            assert serve.wait_for(lambda: serve.svc.state.live() == 0 and not len(serve.svc.queue), 30)
    finally:
        provider.shutdown()
    spans = exporter.get_finished_spans()
    rounds = {s.context.span_id: s for s in _named(spans, "shadow.route.round")}
    admissions = _named(spans, "shadow.route.admission")

    # one admission per request answered, under a round of the same trace
    want = {request_hash(rid): "active" for rid in active_rids} | {request_hash(rid): "fallback"
                                                                  for rid in fallback_rids}
    got = [a.attributes[attrs.REQUEST_ID_HASH] for a in admissions]
    assert sorted(got) == sorted(want)
    children: dict[int, list[ReadableSpan]] = {}
    for a in admissions:
        assert a.parent is not None and a.parent.span_id in rounds, "an admission without its round"
        parent = rounds[a.parent.span_id]
        assert a.context.trace_id == parent.context.trace_id
        assert parent.start_time <= a.start_time and a.end_time <= parent.end_time
        children.setdefault(a.parent.span_id, []).append(a)
        at = a.attributes
        assert at[attrs.MODE] == want[at[attrs.REQUEST_ID_HASH]]
        assert at[attrs.POLICY] == ("br0" if at[attrs.MODE] == "active" else "rr")
        assert at[attrs.DECISION_WORKER] in ("d0", "d1")
        assert at[attrs.POOL_WAIT_SECONDS] >= 0.0 and at[attrs.WORKER_LOAD] >= 0.0
        assert at[attrs.GEN_AI_USAGE_INPUT_TOKENS] > 20
        assert isinstance(at[attrs.ADMISSION_SCORE], float)
    assert {a.attributes[attrs.DECISION_WORKER] for a in admissions} == {"d0", "d1"}

    # round attributes: one span per round the dispatcher ran; admitted = its children
    assert len(rounds) == rounds_run
    for sid, rnd in rounds.items():
        at = rnd.attributes
        assert at[attrs.DECISIONS] == len(children.get(sid, []))
        assert at[attrs.FREE_SLOTS] >= at[attrs.CANDIDATES] >= 0
        assert at[attrs.POOL_SIZE] >= at[attrs.DECISIONS]
        assert at[attrs.ROUND_DECISION_SECONDS] > 0.0 and at[attrs.ROUND_BYPASS] is False
        assert rnd.parent is None and rnd.status.status_code == trace.StatusCode.UNSET
        if at[attrs.POLICY] == "br0":
            assert at[attrs.MODE] == "active"
            # BalanceRoute places into free slots only, running its two stages when it does
            assert at[attrs.DECISIONS] <= at[attrs.FREE_SLOTS]
            if at[attrs.DECISIONS]:
                assert at[attrs.ROUND_STAGE1_SECONDS] >= 0.0 and at[attrs.ROUND_STAGE2_SECONDS] >= 0.0
        else:
            assert at[attrs.POLICY] == "rr" and at[attrs.MODE] == "fallback"
            assert attrs.ROUND_STAGE1_SECONDS not in at
    # 10 requests for 2 x 2 slots: at least 3 br0 rounds placed some, none more than 4
    placing = [r for r in rounds.values()
               if r.attributes[attrs.POLICY] == "br0" and r.attributes[attrs.DECISIONS]]
    assert len(placing) >= 3 and max(r.attributes[attrs.DECISIONS] for r in placing) <= 4
    waits = sorted(a.attributes[attrs.POOL_WAIT_SECONDS] for a in admissions
                   if a.attributes[attrs.MODE] == "active")
    assert waits[-1] > waits[0]  # the later ones waited in the pool for a slot
    assert {r.attributes[attrs.POLICY] for r in rounds.values() if r.attributes[attrs.DECISIONS]} == \
        {"br0", "rr"}

    # the operator's forced fallback, as a span of its own
    (flip,) = [s for s in _named(spans, "shadow.mode.transition")
               if s.attributes[attrs.MODE_TO] == "fallback"]
    assert flip.attributes[attrs.MODE_FROM] == "active" and flip.attributes[attrs.MODE_REASON] == "operator"

    # the same requests as mirrored by the taps, matched by the id hash
    mirrored = {s.attributes[attrs.REQUEST_ID_HASH] for s in _named(spans, "shadow.mirror.request")}
    assert set(want) <= mirrored

    # no prompt text anywhere, in any span
    assert not [s.name for s in spans if any(SECRET in str(v) for v in _values(s))]
    assert {s.resource.attributes["service.name"] for s in spans} == {"shadow-active-test"}


def test_unsampled_rounds_make_no_spans_but_requests_are_routed() -> None:
    """OTEL_TRACES_SAMPLER_ARG=0 (the default sampler, parent-based ratio): rounds are not sampled,
    so neither are their admissions; routing is untouched."""
    provider, exporter = _provider({"OTEL_TRACES_SAMPLER_ARG": "0"})
    try:
        with traced_serve(provider) as (serve, url):
            rids = _send(url, 6)
            proxy = serve.serve.proxy
            assert proxy is not None
            assert serve.sync(lambda: proxy.dispatcher.rounds) >= 1
    finally:
        provider.shutdown()
    assert len(set(rids)) == 6
    names = {s.name for s in exporter.get_finished_spans()}
    assert not names & {"shadow.route.round", "shadow.route.admission"}


def test_pool_bypass_placements_are_one_admission_rounds() -> None:
    """With --pool-bypass each request is placed the moment its prefill is done: a round span of
    its own (bypass, pool 1, one admission), also when no slot is free."""
    provider, exporter = _provider({"OTEL_TRACES_SAMPLER": "always_on"})
    try:
        with traced_serve(provider, extra=("--pool-bypass",)) as (_, url):
            rids = _send(url, 6)  # 6 > 2 x 2 slots
    finally:
        provider.shutdown()
    spans = exporter.get_finished_spans()
    rounds = {s.context.span_id: s for s in _named(spans, "shadow.route.round")}
    admissions = _named(spans, "shadow.route.admission")
    assert sorted(a.attributes[attrs.REQUEST_ID_HASH] for a in admissions) == sorted(map(request_hash, rids))
    assert len(rounds) == 6
    for a in admissions:
        assert a.parent is not None
        rnd = rounds[a.parent.span_id]
        assert rnd.attributes[attrs.ROUND_BYPASS] is True and rnd.attributes[attrs.POOL_SIZE] == 1
        assert rnd.attributes[attrs.DECISIONS] == 1 and rnd.attributes[attrs.POLICY] == "br0"
        assert a.attributes[attrs.DECISION_WORKER] in ("d0", "d1")


def test_shadow_serve_active_process_exports_rounds_and_admissions_over_otlp() -> None:
    """`shadow serve --active` as a process, configured only by OTEL_* variables: its rounds and
    admissions (and the mirrored requests) reach an OTLP/HTTP receiver; SIGTERM flushes the rest."""
    from tests.telemetry.servers import OtlpReceiver, traced_serve_process, wait_for

    rx = OtlpReceiver()
    env = {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": "shadow-active-otlp"}
    try:
        args = ["--active", "--mode", "active", "--pin-mode", "--oracle-interval", "0"]
        with traced_serve_process(rx, args, env, slots=2) as ready:
            rids = _send(ready["active"], 5)
            wait_for(lambda: [s.name for _, s in rx.spans()].count("shadow.route.admission") >= 5, 30,
                     "5 admissions at the receiver")
    finally:
        rx.close()
    spans = [s for _, s in rx.spans()]
    rounds = {s.span_id for s in spans if s.name == "shadow.route.round"}
    admissions = [s for s in spans if s.name == "shadow.route.admission"]
    assert len(admissions) == 5 and all(a.parent_span_id in rounds for a in admissions)
    got = sorted({a.key: a.value for a in s.attributes}[attrs.REQUEST_ID_HASH].string_value
                 for s in admissions)
    assert got == sorted(map(request_hash, rids))
    assert {res["service.name"] for res, _ in rx.spans()} == {"shadow-active-otlp"}
    assert len([s for s in spans if s.name == "shadow.mirror.request"]) == 5


@pytest.mark.parametrize(("name", "arg", "want"), [
    ("always_on", None, ALWAYS_ON.get_description()),
    ("always_off", None, ALWAYS_OFF.get_description()),
    ("traceidratio", "0.25", TraceIdRatioBased(0.25).get_description()),
    ("parentbased_always_on", None, ParentBased(ALWAYS_ON).get_description()),
    ("parentbased_always_off", None, ParentBased(ALWAYS_OFF).get_description()),
    ("parentbased_traceidratio", "0.5", ParentBased(TraceIdRatioBased(0.5)).get_description()),
    (None, None, ParentBased(TraceIdRatioBased(0.05)).get_description()),  # shadow's default
])
def test_sampler_named_by_otel_variables(name: str | None, arg: str | None, want: str) -> None:
    env = {k: v for k, v in (("OTEL_TRACES_SAMPLER", name), ("OTEL_TRACES_SAMPLER_ARG", arg)) if v}
    provider = make_provider(env)
    assert provider is not None
    try:
        assert provider.sampler.get_description() == want
    finally:
        provider.shutdown()


def test_unknown_sampler_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"OTEL_TRACES_SAMPLER must be one of always_on, .*'jaeger_remote'"):
        make_provider({"OTEL_TRACES_SAMPLER": "jaeger_remote"})
