"""Small helpers for the real-engine tests: waiting on a condition, one raw SSE stream, metrics."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.telemetry import servers


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 120.0, step: float = 0.2) -> Any:
    """Poll `pred` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    return servers.wait_for(pred, timeout, what, step)


def raw_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[httpx.Response, bytes]:
    """POST `body` to `url` with streaming and return the response (headers) and its raw bytes."""
    with httpx.Client(timeout=timeout, trust_env=False) as c, c.stream("POST", url, json=body) as r:
        data = b"".join(r.iter_raw())
    return r, data


def sse_payloads(data: bytes) -> list[str]:
    """The `data:` payloads of an SSE body framed as vLLM frames it (one line per event)."""
    assert data.endswith(b"\n\n"), data[-40:]
    out = []
    for block in data.decode().split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block[:80]
        out.append(block[len("data: "):])
    return out


def usage(data: bytes) -> dict[str, Any]:
    """The usage of the usage chunk of a raw SSE body."""
    for p in sse_payloads(data):
        if p != "[DONE]":
            obj = json.loads(p)
            if obj.get("usage") and not obj["choices"]:
                return dict(obj["usage"])
    raise AssertionError("no usage chunk")


def completion_tokens(data: bytes) -> int:
    """completion_tokens of the usage chunk of a raw SSE body."""
    return int(usage(data)["completion_tokens"])


def prompt_tokens(data: bytes) -> int:
    """prompt_tokens of the usage chunk of a raw SSE body."""
    return int(usage(data)["prompt_tokens"])


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition: (name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples at url/metrics whose labels include `labels` (0 if none)."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for (n, lab), v in samples(text).items():
        if n == name and all((k, val) in lab for k, val in labels.items()):
            total += v
    return total


def latest_seq(api: str) -> int:
    """The sequence number of the newest event a shadow event API holds (paging through them)."""
    seq = 0
    while True:
        r = httpx.get(f"{api}/v1/events", params={"after": seq, "limit": 100000}, timeout=10, trust_env=False)
        last = int(r.headers["X-Last-Seq"])
        if last <= seq:
            return seq
        seq = last
