"""A draining front (a tap; the listener of `serve --active` and the API) closes no keep-alive
connection under a client that may be writing on it.

HTTP/1.1 has no way to tell a client "do not reuse this idle connection" except on a response, so a
front that closed its idle connections when it began to drain (a tap group's reload, a stop) raced
every client that picked one of them from its pool at that moment: the request met a closed socket
and the router answered its client 500 (2 of 200 streams in a CI run of test_data_plane's reload).
Now a request on such a connection is answered (`connection: close`, then the connection closes), a
response begun before the drain leaves its connection open, and idle connections are closed only
once nothing is in flight, or, handing off to a successor, when their client closes them or the
drain times out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from shadow.base.front import Front
from shadow.base.listener import AsgiListener
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.tap import Tap

REQ = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
FRONTS = pytest.mark.parametrize("kind", ["tap", "listener"])
SLOW = REQ.replace(b"/v1/completions", b"/slow")


async def _upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter, gate: asyncio.Event) -> None:
    """Keep-alive answers: `ok` at once, or for /slow a chunked body whose end waits for `gate`."""
    try:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await r.readexactly(n)
            if not head.startswith(b"POST /slow"):
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            else:
                w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
                await w.drain()
                await gate.wait()
                w.write(b"4\r\nlast\r\n0\r\n\r\n")
            await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        w.close()


async def _app(scope: dict[str, Any], receive: Any, send: Any, gate: asyncio.Event) -> None:
    """The listener's app: the same answers as `_upstream`."""
    while (await receive()).get("more_body"):
        pass
    if scope["path"] != "/slow":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"first", "more_body": True})
    await gate.wait()
    await send({"type": "http.response.body", "body": b"last"})


async def _with_front(kind: str, go: Callable[[Front, int, asyncio.Event], Awaitable[Any]]) -> Any:
    """`go(front, port, gate)` against a tap (in front of `_upstream`) or a listener (`_app`)."""
    gate = asyncio.Event()
    if kind == "listener":
        ln = AsgiListener(lambda sc, rc, sd: _app(sc, rc, sd, gate), lifespan="off")
        await ln.start()
        try:
            return await go(ln, ln.port, gate)
        finally:
            await ln.stop(grace_s=0)
    srv = await asyncio.start_server(lambda r, w: _upstream(r, w, gate), "127.0.0.1", 0)
    tap = Tap(
        "w",
        f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}",
        DropQueue(1000),
        limits=TapLimits(allow_paths=("/",)),
    )
    await tap.start()
    try:
        return await go(tap, tap.port, gate)
    finally:
        await tap.close()
        srv.close()


async def _response(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response: (head, body), content-length or chunked."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    low = head.lower()
    if b"content-length:" in low:
        n = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
        return head, await asyncio.wait_for(r.readexactly(n), 10)
    body = b""
    while not body.endswith(b"0\r\n\r\n"):
        more = await asyncio.wait_for(r.read(4096), 10)
        assert more, (head, body)
        body += more
    return head, body


async def _kept_alive(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A connection that has had one answered request (the pooled connection of a client), and
    that answer's head."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(REQ)
    head, body = await _response(r)
    assert head.startswith(b"HTTP/1.1 200") and body == b"ok", (head, body)
    return r, w, head


async def _eof(r: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(r.read(1), 10) == b""


@FRONTS
def test_a_request_on_a_connection_idle_when_the_drain_began_is_answered_then_closed(kind: str) -> None:
    async def go(front: Front, port: int, _gate: asyncio.Event) -> None:
        r, w, head = await _kept_alive(port)
        assert b"connection: close" not in head.lower()  # kept alive
        front.begin_drain()
        w.write(REQ)  # the client reuses its pooled connection just as the drain begins
        head, body = await _response(r)
        assert head.startswith(b"HTTP/1.1 200") and body == b"ok"
        assert b"connection: close" in head.lower()  # told not to reuse it
        assert await _eof(r)
        w.close()

    asyncio.run(_with_front(kind, go))


@FRONTS
def test_a_response_begun_before_the_drain_leaves_its_connection_open_for_one_more(kind: str) -> None:
    async def go(front: Front, port: int, gate: asyncio.Event) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(SLOW)
        head = await asyncio.wait_for(r.readuntil(b"first\r\n"), 10)
        assert b"connection: close" not in head.lower()  # the head promised keep-alive
        front.begin_drain()
        gate.set()
        await asyncio.wait_for(r.readuntil(b"0\r\n\r\n"), 10)
        w.write(REQ)  # so the client may reuse it: the tap answers instead of closing under it
        head, body = await _response(r)
        assert head.startswith(b"HTTP/1.1 200") and body == b"ok" and b"connection: close" in head.lower()
        assert await _eof(r)
        w.close()

    asyncio.run(_with_front(kind, go))


@FRONTS
def test_a_stop_closes_idle_connections_once_nothing_is_in_flight(kind: str) -> None:
    async def go(front: Front, port: int, gate: asyncio.Event) -> None:
        idle_r, idle_w, _ = await _kept_alive(port)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(SLOW)
        await asyncio.wait_for(r.readuntil(b"first\r\n"), 10)
        front.begin_drain()
        drained = asyncio.create_task(front.drained(60))
        idle_w.write(REQ)  # while a stream is in flight the idle connection still serves
        head, _ = await _response(idle_r)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower()
        assert not drained.done()
        gate.set()
        assert await asyncio.wait_for(drained, 30) is True
        await asyncio.wait_for(r.readuntil(b"0\r\n\r\n"), 10)
        assert await _eof(r) and await _eof(idle_r)  # the stream's connection, idle now, closed
        w.close()
        idle_w.close()

    asyncio.run(_with_front(kind, go))


@FRONTS
def test_a_handoff_leaves_idle_connections_to_their_clients(kind: str) -> None:
    async def go(front: Front, port: int, _gate: asyncio.Event) -> None:
        r1, w1, _ = await _kept_alive(port)
        _, w2, _ = await _kept_alive(port)
        front.begin_drain(handoff=True)
        drained = asyncio.create_task(front.drained(60))
        w1.write(REQ)  # nothing in flight, yet the idle connections are not closed under a client
        head, _ = await _response(r1)
        assert b"connection: close" in head.lower() and await _eof(r1)
        w1.close()
        assert not drained.done()
        w2.close()  # the client's pool lets the last one go
        assert await asyncio.wait_for(drained, 30) is True
        assert front.connections == 0

    asyncio.run(_with_front(kind, go))


@FRONTS
def test_a_handoff_that_times_out_closes_the_idle_connections(kind: str) -> None:
    async def go(front: Front, port: int, _gate: asyncio.Event) -> None:
        r, w, _ = await _kept_alive(port)
        front.begin_drain(handoff=True)
        assert await front.drained(0.05) is True  # nothing in flight: the deadline only ends the wait
        assert await _eof(r)
        w.close()

    asyncio.run(_with_front(kind, go))
