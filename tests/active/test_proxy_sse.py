"""The active proxy relays SSE event by event whatever the line ends, and never holds a huge event.

A real `shadow router` process (the active proxy in a fixed mode) in front of a scripted upstream.
The upstream sends one event and then waits until the client says it has it (bounded, so that a
proxy holding the event back fails the test instead of hanging it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.active.procs import shadow_process
from tests.active.raw_upstream import SSE_HEAD, Exchange, RawUpstream

HOLD_S = 30.0  # how long the upstream waits for the client before it sends the rest anyway


def chunk(i: int) -> bytes:
    return b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"t%d"}]}' % i


class Gate:
    """The client opens it when it has read what it waits for; the upstream waits on it."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.timed_out = False

    async def wait(self) -> None:
        ok = await asyncio.get_running_loop().run_in_executor(None, self.opened.wait, HOLD_S)
        self.timed_out = self.timed_out or not ok


@pytest.fixture
def gate() -> Gate:
    return Gate()


def _router(url: str) -> Iterator[str]:
    with shadow_process(["router", "--decode", f"d0={url}", "--port", "0"]) as (_, ready):
        yield ready["url"]


def _stream(proxy: str, until: bytes, gate: Gate) -> bytes:
    """POST a streamed completion; open the gate once `until` has arrived; every byte read."""
    got = b""
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", proxy + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for part in r.iter_raw():
            got += part
            if until in got:
                gate.opened.set()
    return got


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"], ids=["CRLF", "CR", "LF"])
def test_each_event_reaches_the_client_before_the_next_is_sent(end: bytes, gate: Gate) -> None:
    events = [b"data: " + chunk(i) + end + end for i in range(3)] + [b"data: [DONE]" + end + end]

    async def script(ex: Exchange) -> None:
        await ex.send(SSE_HEAD)
        await ex.chunk(events[0])
        await gate.wait()  # the proxy must have forwarded event 0 by now
        for ev in events[1:]:
            await ex.chunk(ev)
        await ex.end_chunks()

    with RawUpstream(script) as up:
        for proxy in _router(up.url):
            got = _stream(proxy, events[0], gate)
    assert not gate.timed_out, "the proxy held the first event back until more bytes came"
    assert got == b"".join(events)  # bytes unchanged


def test_an_event_over_the_cap_is_forwarded_as_it_comes(gate: Gate) -> None:
    big = b"data: " + b"x" * (20 << 20)  # 20 MB without its blank line yet

    async def script(ex: Exchange) -> None:
        await ex.send(SSE_HEAD)
        await ex.chunk(b"data: " + chunk(0) + b"\n\n")
        for i in range(0, 4 << 20, 1 << 16):  # the first 4 MB of the big event ...
            await ex.chunk(big[i : i + (1 << 16)])
        await gate.wait()  # ... must reach the client before the rest is sent
        for i in range(4 << 20, len(big), 1 << 16):
            await ex.chunk(big[i : i + (1 << 16)])
        await ex.chunk(b"\n\ndata: [DONE]\n\n")
        await ex.end_chunks()

    with RawUpstream(script) as up:
        for proxy in _router(up.url):
            got = _stream(proxy, b"x" * (2 << 20), gate)
            health = httpx.get(proxy + "/health", timeout=10).json()
        sent = up.exchanges[0].body_sent[len(SSE_HEAD) :]
    assert not gate.timed_out, "the proxy buffered the oversized event whole"
    assert got == sent
    assert health["oversized_events"] == 1
