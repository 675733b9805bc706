"""The simulated fleet (the double) against a real vLLM server in the same run: the SHAPE of what
each sends must agree — SSE framing, headers, every kind of chunk's keys and value types (role,
content, last content, usage), [DONE], the non-streamed body, and the /metrics families, types and
label names the double exports (the mirror reads running/waiting/KV from them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shadow.fleet import FleetConfig
from tests.harness import FleetThread
from tests.realvllm.conftest import MODEL_NAME, Tier
from tests.realvllm.helpers import raw_stream, sse_payloads

# The double's deliberate extras: it echoes X-Request-Id (vLLM does with --enable-request-id-headers);
# vLLM's CORS middleware adds `vary: Origin`. Neither is read by the mirror.
HEADER_ALLOWED_DIFF = {"x-request-id", "vary", "date", "content-length"}
MIRROR_FAMILIES = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                   "vllm:kv_cache_usage_perc": "gauge"}


@pytest.fixture(scope="module")
def double() -> Iterator[FleetThread]:
    with FleetThread(FleetConfig(prefill=0, decode=1, base_port=0, time_scale=0.05, model=MODEL_NAME)) as ft:
        yield ft


def shape(v: Any) -> Any:
    """The JSON value's shape: keys (ordered as sent) and value types, not values."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return sorted({json.dumps(shape(x)) for x in v})
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    return "null" if v is None else type(v).__name__


def chunk_kinds(payloads: list[str], chat: bool) -> dict[str, Any]:
    """One shape per kind of chunk: role (chat), content, last content (finish_reason), usage."""
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    kinds: dict[str, set[str]] = {}
    chunks = [json.loads(p) for p in payloads[:-1]]
    for i, c in enumerate(chunks):
        if not c["choices"]:
            kind = "usage"
        elif chat and i == 0:
            kind = "role"
        elif c["choices"][0]["finish_reason"] is not None:
            kind = "last"
        else:
            kind = "content"
        kinds.setdefault(kind, set()).add(json.dumps(shape(c)))
    assert list(kinds) == (["role"] if chat else []) + ["content", "last", "usage"], list(kinds)
    return {k: sorted(v) for k, v in kinds.items()}


def _stream_body(chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "compare the wire"}]
    else:
        body["prompt"] = "compare the wire"
    return body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_shape_matches_the_real_engine(tier: Tier, double: FleetThread, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    real_r, real = raw_stream(tier.probe.decode_urls[0] + path, _stream_body(chat))
    sim_r, sim = raw_stream(double.decode_urls[0] + path, _stream_body(chat))
    assert real_r.status_code == sim_r.status_code == 200
    sse = "text/event-stream; charset=utf-8"
    assert real_r.headers["content-type"] == sim_r.headers["content-type"] == sse
    assert real_r.headers.get("transfer-encoding") == sim_r.headers.get("transfer-encoding") == "chunked"
    real_h, sim_h = set(real_r.headers) - HEADER_ALLOWED_DIFF, set(sim_r.headers) - HEADER_ALLOWED_DIFF
    assert real_h == sim_h
    assert real.endswith(b"data: [DONE]\n\n") and sim.endswith(b"data: [DONE]\n\n")
    assert chunk_kinds(sse_payloads(sim), chat) == chunk_kinds(sse_payloads(real), chat)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_full_response_shape_matches_the_real_engine(tier: Tier, double: FleetThread, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {k: v for k, v in _stream_body(chat).items() if k not in ("stream", "stream_options")}
    real = httpx.post(tier.probe.decode_urls[0] + path, json=body, timeout=60, trust_env=False)
    sim = httpx.post(double.decode_urls[0] + path, json=body, timeout=60, trust_env=False)
    assert real.status_code == sim.status_code == 200
    assert real.headers["content-type"] == sim.headers["content-type"]
    assert shape(sim.json()) == shape(real.json())


def families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """family name -> (type, label names of its samples, without `le`/`quantile`)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        labels = frozenset(k for s in fam.samples for k in s.labels if k not in ("le", "quantile"))
        out[fam.name] = (fam.type, labels)
    return out


def test_metrics_families_the_double_exports_are_the_real_engines(tier: Tier, double: FleetThread) -> None:
    real = families(httpx.get(tier.probe.decode_urls[0] + "/metrics", timeout=10, trust_env=False).text)
    sim = families(httpx.get(double.decode_urls[0] + "/metrics", timeout=10, trust_env=False).text)
    for name, kind in MIRROR_FAMILIES.items():
        assert real[name] == sim[name] == (kind, frozenset({"engine", "model_name"})), name
    sim_vllm = {n: v for n, v in sim.items() if n.startswith("vllm:")}
    assert len(sim_vllm) >= 20
    differ = {n: (v, real.get(n)) for n, v in sim_vllm.items() if not _agrees(v, real.get(n), n)}
    assert differ == {}, "the double's vllm: families must be the real engine's (name, type, labels)"


def _agrees(sim: tuple[str, frozenset[str]], real: tuple[str, frozenset[str]] | None, name: str) -> bool:
    """Same type and labels; an `_info` family's labels are configuration, of which the double
    exports a subset (vLLM has ~40 cache-config labels)."""
    if real is None or sim[0] != real[0]:
        return False
    return sim[1] <= real[1] if name.endswith("_info") else sim[1] == real[1]
