"""`shadow fleet --otlp-traces-endpoint URL` (vLLM's flag) as a process, read back at a loopback
OTLP/HTTP receiver: one `llm_request` SERVER span per request the engine finished, the child of
the request's `traceparent` (a root without one), with vLLM's `gen_ai.*` attributes; none for a
request its client left. Without the flag, OTEL_* alone trace nothing (as vLLM)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from shadow.app.fleet import traces_provider
from tests.active.procs import shadow_process
from tests.telemetry.servers import OtlpReceiver, wait_for

pytestmark = pytest.mark.integration

SERVER = 2  # OTLP's SpanKind number
TRACE_ID, PARENT_ID = "5b8aa5a2d2c872e8321cf37308d69df2", "051581bf3cb55c13"


def _spans(rx: OtlpReceiver) -> dict[str, Any]:
    """The received `llm_request` spans by their request id."""
    out: dict[str, Any] = {}
    for res, s in rx.spans():
        assert res.get("service.name") == "shadow-fleet" and s.name == "llm_request" and s.kind == SERVER
        a = {x.key: getattr(x.value, x.value.WhichOneof("value")) for x in s.attributes}
        out[a["gen_ai.request.id"]] = (s, a)
    return out


def test_each_finished_request_is_one_llm_request_span(monkeypatch: pytest.MonkeyPatch) -> None:
    rx = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    args = ["fleet", "--prefill", "0", "--decode", "1", "--port", "0", "--time-scale", "0.25",
            "--otlp-traces-endpoint", rx.endpoint + "/v1/traces"]
    try:
        with shadow_process(args) as (_, ready):
            url = ready["decode"][0]
            # a traced completion, not streamed: greedy (temperature 0 is not recorded, as vLLM)
            traced = httpx.post(url + "/v1/completions", timeout=30, json={
                "prompt": "one two three", "max_tokens": 3, "ignore_eos": True, "temperature": 0,
                "top_p": 0.5}, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "t1"})
            assert traced.status_code == 200, traced.text
            # a chat request its client leaves after the first token: the engine aborts it, no span
            left = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json=left,
                              headers={"X-Request-Id": "gone"}) as r:
                next(r.iter_raw())

            def idle() -> bool:
                state = httpx.get(url + "/fleet/state", timeout=5).json()
                return all(e["running"] == 0 and e["waiting"] == 0 for e in state["engines"])

            wait_for(idle, 30, "the left request aborted")
            # an untraced chat request (after the abort: its span is exported after any of it)
            root = httpx.post(url + "/v1/chat/completions", timeout=30, headers={"X-Request-Id": "r1"}, json={
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": True})
            assert root.status_code == 200, root.text
            spans = wait_for(lambda: (got := _spans(rx)) and "chatcmpl-r1" in got and got, 30,
                             "the untraced request's span")
    finally:
        rx.close()
    assert set(spans) == {"cmpl-t1-0", "chatcmpl-r1"}, spans  # no span for the request its client left
    span, a = spans["cmpl-t1-0"]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    usage = traced.json()["usage"]
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 3
    assert a["gen_ai.request.max_tokens"] == 3 and a["gen_ai.request.top_p"] == 0.5
    assert "gen_ai.request.temperature" not in a
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.e2e"] <= (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 + 0.01
    span, a = spans["chatcmpl-r1"]
    assert span.parent_span_id == b"" and span.trace_id.hex() != TRACE_ID
    assert a["gen_ai.usage.completion_tokens"] == root.json()["usage"]["completion_tokens"] == 4
    assert a["gen_ai.request.temperature"] == 1.0 and a["gen_ai.request.top_p"] == 1.0


def test_no_flag_no_provider_whatever_otel_says() -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert traces_provider(None, env) is None
    assert traces_provider("http://127.0.0.1:4318/v1/traces", {**env, "OTEL_SDK_DISABLED": "true"}) is None
    provider = traces_provider("http://127.0.0.1:4318/v1/traces",
                               {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "shadow-fleet"
        assert provider.sampler.get_description().startswith("ParentBased{root:AlwaysOnSampler")
    finally:
        provider.shutdown()
