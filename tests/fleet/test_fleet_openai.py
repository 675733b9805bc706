"""The official openai client drives the fleet: completions and chat, stream and non-stream,
every chunk checked against vLLM's stream schema; raw SSE framing checked with httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fleet_helpers import check_stream, metric_value, stream_raw, words
from openai import AsyncOpenAI, OpenAI

from shadow.fleet.tokens import CHAT_MESSAGE_OVERHEAD
from tests.harness import FleetThread

pytestmark = pytest.mark.timeout(60)
MODEL = "sim-llm"


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)


def test_models_health_version(fleet: FleetThread) -> None:
    url = fleet.decode_urls[0]
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "vllm"
    h = httpx.get(url + "/health")
    assert h.status_code == 200 and h.content == b""
    assert httpx.get(url + "/version").json()["version"].startswith("0.33")
    assert httpx.get(url + "/load").json() == {"server_load": 0}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", ["none", "include", "continuous"])
def test_openai_stream_schema(fleet: FleetThread, chat: bool, usage: str) -> None:
    c = client(fleet.decode_urls[1])
    opts = None if usage == "none" else {"include_usage": True,
                                         "continuous_usage_stats": usage == "continuous"}
    kwargs: dict = {"model": MODEL, "max_tokens": 7, "stream": True, "extra_body": {"ignore_eos": True}}
    if opts:
        kwargs["stream_options"] = opts
    if chat:
        stream = c.chat.completions.create(messages=[{"role": "user", "content": words(5)}], **kwargs)
    else:
        stream = c.completions.create(prompt=words(5), **kwargs)
    payloads = [json.dumps(chunk.to_dict()) for chunk in stream] + ["[DONE]"]
    n = check_stream(payloads, chat=chat, include_usage=usage != "none", continuous=usage == "continuous",
                     prompt_tokens=5 + (CHAT_MESSAGE_OVERHEAD if chat else 0))
    assert n == 7


@pytest.mark.parametrize("chat", [False, True])
def test_raw_sse_framing_and_headers(fleet: FleetThread, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": MODEL, "max_tokens": 4, "stream": True, "ignore_eos": True,
                  "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words(3)}]
    else:
        body["prompt"] = words(3)
    r, events = stream_raw(fleet.decode_urls[0] + path, body, headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.headers["x-request-id"] == "req-42"
    payloads = [p for _, p in events]
    prompt = (2 + 3 + 2 * CHAT_MESSAGE_OVERHEAD) if chat else 3
    assert check_stream(payloads, chat=chat, include_usage=True, prompt_tokens=prompt, key_order=True) == 4
    first = json.loads(payloads[0])
    assert first["id"] == ("chatcmpl-req-42" if chat else "cmpl-req-42")
    # compact JSON, as vLLM writes it
    assert ", " not in payloads[0] and '": ' not in payloads[0]


@pytest.mark.parametrize("chat", [False, True])
def test_openai_non_stream(fleet: FleetThread, chat: bool) -> None:
    c = client(fleet.decode_urls[0])
    if chat:
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words(10)}],
                                      max_tokens=5, extra_body={"ignore_eos": True})
        assert r.object == "chat.completion"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == " tok" * 5
        assert r.usage is not None and r.usage.prompt_tokens == 10 + CHAT_MESSAGE_OVERHEAD
    else:
        r2 = c.completions.create(model=MODEL, prompt=words(10), max_tokens=5,
                                  extra_body={"ignore_eos": True})
        assert r2.object == "text_completion"
        assert r2.choices[0].text == " tok" * 5
        assert r2.choices[0].finish_reason == "length"
        assert r2.usage is not None and r2.usage.prompt_tokens == 10 and r2.usage.completion_tokens == 5


def test_output_length_deterministic_without_ignore_eos(fleet: FleetThread) -> None:
    c = client(fleet.decode_urls[0])
    a = c.completions.create(model=MODEL, prompt="some prompt text", max_tokens=300)
    b = c.completions.create(model=MODEL, prompt="some prompt text", max_tokens=300)
    assert a.usage is not None and b.usage is not None
    assert a.usage.completion_tokens == b.usage.completion_tokens >= 1
    reason = "length" if a.usage.completion_tokens == 300 else "stop"
    assert a.choices[0].finish_reason == reason
    capped = c.completions.create(model=MODEL, prompt="some prompt text", max_tokens=1)
    assert capped.usage is not None and capped.usage.completion_tokens == 1
    assert capped.choices[0].finish_reason == "length"


def test_async_client_concurrent_streams_and_metrics(fleet: FleetThread) -> None:
    async def one(url: str, i: int) -> int:
        async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20) as ac:
            stream = await ac.completions.create(model=MODEL, prompt=words(20 + i), max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
            payloads = [json.dumps(ch.to_dict()) async for ch in stream] + ["[DONE]"]
            return check_stream(payloads, chat=False, include_usage=True, prompt_tokens=20 + i)

    async def main() -> list[int]:
        return await asyncio.gather(*(one(fleet.decode_urls[i % 2], i) for i in range(16)))

    assert asyncio.run(main()) == [12] * 16
    for url in fleet.decode_urls:
        m = httpx.get(url + "/metrics").text
        assert metric_value(m, "vllm:request_success_total", finished_reason="length") == 8
        assert metric_value(m, "vllm:generation_tokens_total") == 96
        assert metric_value(m, "vllm:num_requests_running") == 0
        assert metric_value(m, "vllm:time_to_first_token_seconds_count") == 8
        assert metric_value(m, "vllm:inter_token_latency_seconds_count") == 8 * 11


def test_client_disconnect_aborts_and_frees_slot(fleet: FleetThread) -> None:
    url = fleet.decode_urls[0]
    body = {"prompt": words(4), "max_tokens": 5000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
        it = r.iter_raw()
        next(it)
        next(it)
    for _ in range(100):
        m = httpx.get(url + "/metrics").text
        if metric_value(m, "vllm:request_success_total", finished_reason="abort") == 1:
            break
        time.sleep(0.05)
    assert metric_value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric_value(m, "vllm:num_requests_running") == 0
    assert metric_value(m, "vllm:kv_cache_usage_perc") == 0
