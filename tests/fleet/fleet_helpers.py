"""Helpers for the fleet tests: raw SSE reading, a vLLM stream schema checker, metrics parsing,
free ports, waiting for sockets, and an event loop with virtual time."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0, ok: tuple[int, ...] = (200,)) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code in ok:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready: {last}")


def sse_events(raw: bytes) -> list[str]:
    """`data:` payloads of an SSE body, split on blank lines as a strict reader must."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        assert "\n" not in block, f"one line per event expected: {block!r}"
        out.append(block[len("data: "):])
    return out


def stream_raw(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
               timeout: float = 20.0) -> tuple[httpx.Response, list[tuple[float, str]]]:
    """POST a streaming request; return the response and (arrival time, payload) per event."""
    events: list[tuple[float, str]] = []
    buf = b""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
        for chunk in r.iter_raw():
            buf += chunk
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                events.append((time.monotonic(), sse_events(block + b"\n\n")[0]))
    assert buf == b"", f"trailing bytes {buf!r}"
    return r, events


def check_stream(payloads: list[str], *, chat: bool, include_usage: bool = False, continuous: bool = False,
                 prompt_tokens: int | None = None, key_order: bool = False) -> int:
    """Check a vLLM 0.32 stream (payloads after `data: `); return the number of token chunks.
    `key_order` also checks vLLM's usage key order (raw wire data only)."""
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks, "no chunks"
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    (rid,) = ids
    assert rid.startswith("chatcmpl-" if chat else "cmpl-")
    obj = "chat.completion.chunk" if chat else "text_completion"
    for c in chunks:
        assert c["object"] == obj and isinstance(c["created"], int) and isinstance(c["model"], str)
        assert "error" not in c
    content = [c for c in chunks if c["choices"]]
    usage_only = [c for c in chunks if not c["choices"]]
    if include_usage:
        assert len(usage_only) == 1 and chunks[-1] is usage_only[0], "usage-only chunk must be last"
        u = usage_only[0]["usage"]
        keys = ["prompt_tokens", "total_tokens", "completion_tokens"]
        assert (list(u) if key_order else sorted(u)) == (keys if key_order else sorted(keys))
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    else:
        assert not usage_only
        assert all("usage" not in c for c in chunks)
    tokens = 0
    for i, c in enumerate(content):
        (choice,) = c["choices"]
        assert choice["index"] == 0
        last = i == len(content) - 1
        if chat:
            assert set(choice) <= {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"}
            assert choice["logprobs"] is None
            if i == 0:
                assert choice["delta"] == {"role": "assistant", "content": ""}, "role-only first chunk"
                assert choice["finish_reason"] is None
            else:
                assert "role" not in choice["delta"]
                assert isinstance(choice["delta"]["content"], str) and choice["delta"]["content"]
                tokens += 1
        else:
            assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason",
                                   "prompt_token_ids", "token_ids"}
            assert isinstance(choice["text"], str) and choice["text"]
            tokens += 1
        if last:
            assert choice["finish_reason"] in ("stop", "length"), choice
        else:
            assert choice["finish_reason"] is None, "finish_reason only on the last content chunk"
        if continuous:
            u = c["usage"]
            assert u["completion_tokens"] == tokens
            assert u["total_tokens"] == u["prompt_tokens"] + tokens
        elif include_usage:
            assert "usage" not in c
    if include_usage:
        u = usage_only[0]["usage"]
        assert u["completion_tokens"] == tokens, "usage must equal the token chunks seen"
        if prompt_tokens is not None:
            assert u["prompt_tokens"] == prompt_tokens
    return tokens


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        lab = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv) if rest else {}
        lab = {k: v.strip('"') for k, v in lab.items()}
        if all(lab.get(k) == v for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"no sample {name}{labels}"
    return total


def words(n: int) -> str:
    return " ".join(["w"] * n)


T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer instead of sleeping (no real I/O)."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0
        real = self._selector  # type: ignore[has-type]
        loop = self

        class _Selector:
            def select(self, timeout: float | None = None) -> Any:
                events = real.select(0)
                if events or timeout == 0:
                    return events
                if timeout is None:
                    raise RuntimeError("virtual-time loop: nothing scheduled and nothing ready (deadlock)")
                loop._virtual_now += timeout
                return []

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        self._selector = _Selector()

    def time(self) -> float:
        return self._virtual_now


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
