"""The relay writes what one upstream read delivers to the client in one write (#35): a response
whose head, chunks and terminator arrive together leaves as one write, byte for byte what the
per-chunk writes sent, and every read of the upstream gives at most one write to the client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shadow.contracts.tapwire import END_COMPLETE
from shadow.dataplane import tap as proxy
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.tap import Tap
from tests.mirror.test_proxy import SSE_RESP, _items_through_end, _read_request, _talk, _with_tap

SSE_EVENTS = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in (b'data: {"t":%d}\n\n' % i for i in range(20)))


class _Counting:
    """A client transport that counts the relay's writes (everything else passes through)."""

    def __init__(self, inner: Any, writes: list[bytes]) -> None:
        self._inner = inner
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[list[bytes], list[int]]:
    """(the client writes, the upstream reads' sizes) of every relayed exchange in the test."""
    writes: list[bytes] = []
    reads: list[int] = []
    made = proxy._ClientConn.connection_made
    received = proxy._UpstreamConn.data_received

    def connection_made(self: proxy._ClientConn, transport: asyncio.BaseTransport) -> None:
        made(self, transport)
        self.transport = _Counting(self.transport, writes)  # type: ignore[assignment]

    def data_received(self: proxy._UpstreamConn, data: bytes) -> None:
        reads.append(len(data))
        received(self, data)

    monkeypatch.setattr(proxy._ClientConn, "connection_made", connection_made)
    monkeypatch.setattr(proxy._UpstreamConn, "data_received", data_received)
    return writes, reads


def test_a_response_read_at_once_leaves_in_one_write(counted: tuple[list[bytes], list[int]]) -> None:
    writes, reads = counted
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, seen: list[bytes]) -> None:
        seen.append(await _read_request(r))
        w.write(head + SSE_EVENTS + b"0\r\n\r\n")  # one write: it arrives in one read or a few
        await w.drain()

    async def client(tap: Tap, q: DropQueue, seen: list[bytes]) -> None:
        out = await _talk(tap, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
                          until=b"0\r\n\r\n")
        _, body = out.split(b"\r\n\r\n", 1)
        assert body == SSE_EVENTS + b"0\r\n\r\n"  # the same chunks, the same order
        items = await _items_through_end(q)
        assert [s for s, _ in items if s > 0] == list(range(1, 21))  # the copy: still one item per chunk
        assert items[-1] == (-1, END_COMPLETE)

    asyncio.run(_with_tap(handler, client))
    assert reads, "the upstream's response was never read"
    assert len(writes) <= len(reads), f"{len(writes)} client writes for {len(reads)} upstream reads"
    assert b"".join(writes).split(b"\r\n\r\n", 1)[1] == SSE_EVENTS + b"0\r\n\r\n"


def test_chunks_read_apart_are_written_apart(counted: tuple[list[bytes], list[int]]) -> None:
    """A chunk alone in its read is written when read (nothing waits for more)."""
    writes, reads = counted
    events = (b"data: 1\n\n", b"data: 2\n\n")
    reached = [asyncio.Event() for _ in events]  # (one loop: the handler waits on the client)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, seen: list[bytes]) -> None:
        seen.append(await _read_request(r))
        w.write(SSE_RESP.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n")
        for ev, done in zip(events, reached, strict=True):
            w.write(b"%x\r\n%b\r\n" % (len(ev), ev))
            await w.drain()
            await done.wait()  # the client has this chunk before the next one is sent
        w.write(b"0\r\n\r\n")
        await w.drain()

    async def client(tap: Tap, q: DropQueue, seen: list[bytes]) -> None:
        r, w = await asyncio.open_connection(tap.host, tap.port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await w.drain()
        for ev, done in zip(events, reached, strict=True):
            await r.readuntil(ev)
            done.set()
        await r.readuntil(b"0\r\n\r\n")
        w.close()
        await _items_through_end(q)

    asyncio.run(_with_tap(handler, client))
    # the head may share a read with the first chunk; each later chunk was alone in its read
    assert len(writes) <= len(reads) and len(writes) >= len(events)


@pytest.mark.parametrize("closing", [b"Connection: close\r\n", b""], ids=["connection-close", "http10"])
def test_a_response_read_at_once_ends_before_a_staged_close(closing: bytes) -> None:
    """The whole response in one read, to a client whose connection ends after it (its own
    `Connection: close`, or HTTP/1.0): every byte, terminator included, before the FIN."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    version = b"HTTP/1.1" if closing else b"HTTP/1.0"

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, seen: list[bytes]) -> None:
        seen.append(await _read_request(r))
        w.write(head + SSE_EVENTS + b"0\r\n\r\n")  # one write: the terminator in the read of the rest
        await w.drain()

    async def client(tap: Tap, q: DropQueue, seen: list[bytes]) -> None:
        out = await _talk(tap, b"POST /v1/completions " + version + b"\r\nHost: x\r\n" + closing
                          + b"Content-Length: 0\r\n\r\n")  # read to the connection's end
        _, body = out.split(b"\r\n\r\n", 1)
        events = b"".join(e for e in (b'data: {"t":%d}\n\n' % i for i in range(20)))
        assert (body == SSE_EVENTS + b"0\r\n\r\n") if closing else (body == events), body[-40:]
        items = await _items_through_end(q)
        assert items[-1] == (-1, END_COMPLETE)

    asyncio.run(_with_tap(handler, client))


def test_a_broken_pipelined_request_is_answered_after_the_response_read_at_once() -> None:
    """A valid request, then bad bytes pipelined behind it: the first response (read at once from
    the upstream) reaches the client whole, and only then the 400 for the bad request."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    gate = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, seen: list[bytes]) -> None:
        seen.append(await _read_request(r))
        await gate.wait()  # the bad bytes reached the tap before the response is sent
        w.write(head + SSE_EVENTS + b"0\r\n\r\n")
        await w.drain()

    async def client(tap: Tap, q: DropQueue, seen: list[bytes]) -> None:
        r, w = await asyncio.open_connection(tap.host, tap.port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await w.drain()
        while not seen:  # the request reached the upstream
            await asyncio.sleep(0)
        w.write(b"GARBAGE\r\n\r\n")
        await w.drain()
        while "bad_framing" not in tap.rejected:  # the tap parsed (and refused) the bad bytes
            await asyncio.sleep(0)
        gate.set()
        out = await asyncio.wait_for(r.read(-1), 5)
        first, rest = out.split(b"0\r\n\r\n", 1)
        assert first.split(b"\r\n\r\n", 1)[1] == SSE_EVENTS
        assert rest.startswith(b"HTTP/1.1 400 "), rest[:60]
        w.close()
        await _items_through_end(q)

    asyncio.run(_with_tap(handler, client))
