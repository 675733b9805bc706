"""Both HTTP fronts (the listener of `serve --active`/the API, and a tap) end a connection after its
last response with a staged close (RFC 9112 §9.6): the response is sent, then a FIN, and what the
client still sends is read and dropped until it closes or the linger time passes. A plain close
with request bytes unread makes the kernel answer with a reset, which can destroy the response
in flight: the framing fuzz lost the answer to a `Connection: close` request that had requests
pipelined behind it (in CI, at load).

Each case holds the answer until the client's next bytes sit unread in the front's socket (read
with FIONREAD: a condition, not a sleep), then lets it go. With linger 0 (a plain close) the same
sequence ends in a reset at the client: the cause is shown, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from shadow.base.listener import AsgiListener, ListenerLimits
from shadow.base.loopthread import LoopThread
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.tap import Tap
from tests.active.raw_upstream import Exchange, RawUpstream
from tests.active.test_proxy_framing_fuzz import wait_for
from tests.mirror.h11_upstream import unread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
BEHIND = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" * 40  # pipelined behind it: never answered
ANSWER = b"the whole answer"


@dataclass
class Ending:
    """What the client read, and how its read ended ("eof" or "reset")."""

    data: bytes
    how: str


def read_to_end(s: socket.socket, timeout: float = 30.0) -> Ending:
    out = bytearray()
    s.settimeout(timeout)
    while True:
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            return Ending(bytes(out), "reset")
        if not got:
            return Ending(bytes(out), "eof")
        out += got


@dataclass
class Front:
    """One front under test: its port, the transports of its client connections, its counts."""

    loop: LoopThread
    port: int
    transports: Callable[[], list[Any]]
    rejected: Callable[[], dict[str, int]]
    connections: Callable[[], int]
    entered: threading.Event  # the request reached the app (or the upstream)
    release: threading.Event  # ... which may answer now


def exchange(front: Front) -> Ending:
    """The request, then (once it is being answered) requests pipelined behind it, left unread in
    the front's socket; then the answer goes out and the client reads to the end."""
    s = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    try:
        s.sendall(REQUEST)
        assert front.entered.wait(30), "the request never reached the app"
        s.sendall(BEHIND)
        assert wait_for(lambda: front.loop.sync(lambda: unread(front.transports())) > 0), \
            "the pipelined bytes never waited unread in the front's socket"
        front.release.set()
        return read_to_end(s)
    finally:
        s.close()


@contextmanager
def listener(linger_s: float, linger_bytes: int = 1 << 20) -> Iterator[Front]:
    loop = LoopThread("staged-close")
    loop.start()
    entered, release = threading.Event(), threading.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        entered.set()
        await asyncio.to_thread(release.wait, 60)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(ANSWER))]})
        await send({"type": "http.response.body", "body": ANSWER})

    limits = ListenerLimits(linger_s=linger_s, linger_bytes=linger_bytes)
    ln = AsgiListener(app, lifespan="off", limits=limits)
    loop.call(ln.start())
    try:
        yield Front(loop, ln.port, lambda: [c.transport for c in ln.conns], lambda: dict(ln.rejected),
                    lambda: ln.connections, entered, release)
    finally:
        release.set()
        loop.call(ln.stop(grace_s=0))
        loop.stop()


@contextmanager
def tap(linger_s: float, linger_bytes: int = 1 << 20) -> Iterator[Front]:
    entered, release = threading.Event(), threading.Event()

    async def answer(ex: Exchange) -> None:
        entered.set()
        await asyncio.to_thread(release.wait, 60)
        await ex.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                      % (len(ANSWER), ANSWER))

    loop = LoopThread("staged-close-tap")
    loop.start()
    with RawUpstream(answer) as up:

        async def start() -> Tap:
            limits = TapLimits(linger_s=linger_s, linger_bytes=linger_bytes)
            t = Tap("a", up.url, DropQueue(1 << 12), limits=limits)
            await t.start()
            return t

        t = loop.call(start())
        try:
            yield Front(loop, t.port, lambda: [c.transport for c in t._clients], lambda: dict(t.rejected),
                        lambda: len(t._clients), entered, release)
        finally:
            release.set()
            loop.call(t.close())
            loop.stop()


FRONTS = {"listener": listener, "tap": tap}


@pytest.mark.parametrize("kind", FRONTS)
def test_the_answer_reaches_the_client_whole_and_ends_in_a_fin(kind: str) -> None:
    with FRONTS[kind](5.0) as front:
        end = exchange(front)
        assert end.how == "eof", end
        assert end.data.startswith(b"HTTP/1.1 200 ") and end.data.endswith(b"\r\n\r\n" + ANSWER), end.data
        assert end.data.count(b"HTTP/1.1 ") == 1, "a request pipelined behind a closing one was answered"
        # the client closed: the lingering connection is gone, and it was not the deadline
        assert wait_for(lambda: front.loop.sync(front.connections) == 0)
        assert front.loop.sync(front.rejected)["linger_cut"] == 0


@pytest.mark.parametrize("kind", FRONTS)
def test_a_plain_close_with_bytes_unread_resets_the_connection(kind: str) -> None:
    """The cause, shown: linger 0 closes at once, and the kernel answers the unread bytes with a
    reset (which may reach the client before the answer does)."""
    with FRONTS[kind](0.0) as front:
        end = exchange(front)
        assert end.how == "reset", end


@pytest.mark.parametrize("kind", FRONTS)
def test_a_client_that_never_closes_is_closed_at_the_linger_deadline_and_counted(kind: str) -> None:
    with FRONTS[kind](0.3) as front:
        s = socket.create_connection(("127.0.0.1", front.port), timeout=30)
        try:
            front.release.set()
            s.sendall(REQUEST + BEHIND)
            head = b""
            while ANSWER not in head:
                got = s.recv(65536)
                assert got, head
                head += got
            # the front sent its FIN and lingers; this client keeps the connection open. The
            # requests behind the closing one (in the same read) were neither answered nor refused
            assert s.recv(65536) == b"" and head.count(b"HTTP/1.1 ") == 1, head
            refused = front.loop.sync(front.rejected)
            assert sum(refused.values()) - refused["linger_cut"] == 0, refused
            assert wait_for(lambda: front.loop.sync(front.rejected)["linger_cut"] == 1)
            assert wait_for(lambda: front.loop.sync(front.connections) == 0)
        finally:
            s.close()


@pytest.mark.parametrize("kind", FRONTS)
def test_a_client_that_keeps_sending_is_closed_past_the_linger_budget_and_counted(kind: str) -> None:
    """What lingering reads is bounded in bytes as well as in time: a peer that streams after its
    answer is closed once it passed the budget (64 KiB here), long before the linger time (60 s)."""
    with FRONTS[kind](60.0, 64 << 10) as front:
        s = socket.create_connection(("127.0.0.1", front.port), timeout=30)
        try:
            front.release.set()
            s.sendall(REQUEST)
            got = b""
            while ANSWER not in got:
                more = s.recv(65536)
                assert more, got
                got += more
            sent = 0
            with contextlib.suppress(OSError):  # the front closed (a reset, once it stopped reading)
                while sent < 256 << 20:
                    s.sendall(b"x" * 65536)
                    sent += 65536
            assert sent < 64 << 20, sent
            assert wait_for(lambda: front.loop.sync(front.rejected)["linger_cut"] == 1)
            assert wait_for(lambda: front.loop.sync(front.connections) == 0)
        finally:
            s.close()
