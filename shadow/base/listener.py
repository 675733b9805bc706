"""One ASGI app on one listening socket, HTTP/1.1 framed by llhttp (httptools), with the limits a
listener facing a hostile peer needs: a header deadline, a body silence deadline, head and body
caps (431/413), a connection cap that closes the oldest idle connection to make room (one read
from, or past a short grace: never a newcomer of the same accept burst; else 503),
idle keep-alive close, and a count of every refusal (`rejected`, by reason).

The app sees ASGI 3 `http` scopes (and `lifespan` when asked). Request bodies are pulled: reading
pauses while `max_buffer` body bytes wait for the app. A response is written as the app sends it:
with the app's Content-Length, else one whole body gets one, else chunked; the app's headers are
sent as given, plus `date` when it has none (no `server` header). A response the app leaves
unfinished (it returns, or raises, after its head) or the drain deadline cuts is cut on the wire
too: the connection closes without the body's end (no final chunk, or short of its length; a body
an HTTP/1.0 client reads to the connection's close is reset).
Pipelined requests are answered in order, one at a time; nothing after a request that ends its
connection is read, and a request refused (400, 408) before its app began never reaches the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import socket
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from httptools import HttpParserError, HttpRequestParser
from starlette.requests import Request

from shadow.base.front import Conn, Front, head_fault
from shadow.base.net import bind_listen

log = logging.getLogger("shadow.listener")

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

#: Reasons counted in `AsgiListener.rejected` (a bounded label set).
REJECT_REASONS = (
    "bad_framing",
    "head_too_large",
    "header_timeout",
    "body_timeout",
    "body_too_large",
    "idle_timeout",
    "upgrade",
    "busy",
    "evicted_idle",
    "app_error",
    "app_cut",
    "drain_cut",
    "linger_cut",
)


@dataclass(frozen=True)
class ListenerLimits:
    """Caps and deadlines of one listener; each refusal is counted by its reason."""

    max_head: int = 64 << 10  # request line + headers, bytes (431 beyond)
    max_headers: int = 128  # header lines (431 beyond)
    header_timeout_s: float = 10.0  # a head begun must be complete within this (408 + close)
    body_timeout_s: float = 10.0  # longest silence inside a request body (408 or close)
    idle_timeout_s: float = 30.0  # connection without a request: new or kept alive (closed)
    max_connections: int = 1024  # beyond: the oldest idle connection is closed, else 503
    evict_grace_s: float = 0.05  # a new connection not yet read from is not evicted this long
    max_body: int = 16 << 20  # request body bytes (413 beyond)
    max_buffer: int = 256 << 10  # body bytes waiting for the app before reading pauses
    max_pipelined: int = 16  # requests parsed ahead of the one being answered (reading pauses)
    linger_s: float = 5.0  # after a last response: read and drop what the client still sends (0: off)
    linger_bytes: int = 1 << 20  # ... this many at most (beyond: closed at once)

    def validate(self) -> None:
        """ValueError with a one-line reason for a value out of range."""
        if not self.evict_grace_s >= 0:
            raise ValueError("listener evict grace must be >= 0 s")
        if not self.linger_s >= 0:
            raise ValueError("listener linger must be >= 0 s")
        if self.linger_bytes < 0:
            raise ValueError("listener linger bytes must be >= 0")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"listener {name.removesuffix('_s').replace('_', ' ')} must be > 0 s")
        for name in ("max_head", "max_headers", "max_connections", "max_body", "max_buffer", "max_pipelined"):
            if getattr(self, name) < 1:
                raise ValueError(f"listener {name.replace('_', ' ')} must be >= 1")


def canned(status: int, reason: str, message: str, prog: str = "shadow") -> bytes:
    """A complete JSON error response that closes the connection."""
    body = b'{"error":{"message":"%s: %s","type":"%s"}}\n' % (
        prog.encode("ascii", "replace"),
        message.encode("ascii", "replace"),
        reason.replace(" ", "").encode(),
    )
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body)
    )


_BAD_REQUEST = canned(400, "Bad Request", "malformed or ambiguous HTTP/1.1 request")
_HEAD_TOO_LARGE = canned(431, "Request Header Fields Too Large", "request head too large")
_TIMEOUT = canned(408, "Request Timeout", "request not received in time")
_TOO_LARGE = canned(413, "Content Too Large", "request body too large")
_BUSY = canned(503, "Service Unavailable", "connection limit reached")
_NO_UPGRADE = canned(501, "Not Implemented", "protocol upgrades are not served")
_APP_ERROR = canned(500, "Internal Server Error", "the request failed")
_REASONS = {
    200: b"OK", 201: b"Created", 202: b"Accepted", 204: b"No Content", 206: b"Partial Content",
    301: b"Moved Permanently", 302: b"Found", 304: b"Not Modified", 307: b"Temporary Redirect",
    400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found",
    405: b"Method Not Allowed", 408: b"Request Timeout", 409: b"Conflict", 413: b"Content Too Large",
    415: b"Unsupported Media Type", 422: b"Unprocessable Content", 429: b"Too Many Requests",
    431: b"Request Header Fields Too Large", 499: b"Client Closed Request",
    500: b"Internal Server Error", 501: b"Not Implemented", 502: b"Bad Gateway",
    503: b"Service Unavailable", 504: b"Gateway Timeout",
}  # fmt: skip
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection", b"keep-alive"))


def bad_head(fault: str, prog: str = "shadow") -> bytes:
    """The 400 for a request head `front.head_fault` refuses, naming why."""
    return canned(400, "Bad Request", f"malformed or ambiguous HTTP/1.1 request: {fault}", prog)


class _Date:
    """The `date` header value, formatted at most once a second."""

    def __init__(self) -> None:
        self._sec = -1
        self._value = b""

    def value(self) -> bytes:
        sec = int(time.time())
        if sec != self._sec:
            self._sec = sec
            self._value = email.utils.formatdate(sec, usegmt=True).encode()
        return self._value


class _Cycle:
    """One request and its response on a connection."""

    __slots__ = (
        "body",
        "buffered",
        "chunked_out",
        "complete",
        "conn",
        "continue_needed",
        "delivered",
        "disconnected",
        "head_pending",
        "headers",
        "keep_alive",
        "length_out",
        "method",
        "more",
        "received",
        "refused",
        "response_complete",
        "scope",
        "sent_out",
        "started",
        "status",
    )

    def __init__(self, conn: _Conn, scope: dict[str, Any], keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.method: str = scope["method"]
        self.keep_alive = keep_alive
        self.continue_needed = expect_continue
        self.body: deque[bytes] = deque()
        self.buffered = 0  # body bytes received, not yet taken by the app
        self.received = 0  # body bytes received in all
        self.complete = False  # the whole request body was received
        self.delivered = False  # ... and handed to the app
        self.disconnected = False
        self.refused = False  # the listener refused it (its framing, a deadline): answered already
        self.started = False
        self.head_pending = True
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.response_complete = False
        self.chunked_out = False
        self.length_out: int | None = None
        self.sent_out = 0
        self.more = asyncio.Event()  # body bytes, the body's end, a disconnect or the response's end

    # -- ASGI ------------------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        if self.continue_needed and not self.complete and not self.disconnected:
            self.continue_needed = False
            t = self.conn.transport
            if t is not None and not t.is_closing():
                t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while True:
            if self.disconnected:
                return {"type": "http.disconnect"}
            if self.body or (self.complete and not self.delivered):
                body = self.body
                data = body.popleft() if len(body) == 1 else b"".join(body)
                body.clear()
                n, self.buffered = self.buffered, 0
                self.conn.body_taken(n)
                if self.complete:
                    self.delivered = True
                return {"type": "http.request", "body": data, "more_body": not self.complete}
            if self.delivered and self.response_complete:
                return {"type": "http.disconnect"}
            self.more.clear()
            await self.more.wait()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if self.disconnected or self.response_complete:
            return  # the client is gone (or the response is over): nothing more goes out
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = int(message["status"])
            self.headers = list(message.get("headers") or [])
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started:
            raise RuntimeError("http.response.body before http.response.start")
        conn = self.conn
        body: bytes = message.get("body", b"") or b""
        more = bool(message.get("more_body", False))
        if self.head_pending:
            self._write_head(None if more else len(body))
        transport = conn.transport
        if transport is None:
            return
        bodiless = self._bodiless()
        if body and not bodiless:
            if self.length_out is not None and self.sent_out + len(body) > self.length_out:
                raise RuntimeError("response body longer than its content-length")
            transport.write(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked_out else body)
            self.sent_out += len(body)
        if not more:
            if not bodiless and self.length_out is not None and self.sent_out < self.length_out:
                raise RuntimeError("response body shorter than its content-length")
            if self.chunked_out and not bodiless:
                transport.write(b"0\r\n\r\n")
            self.response_complete = True
            self.more.set()
            conn.response_done(self)
            return
        if conn.write_paused:
            await conn.drain()

    def _bodiless(self) -> bool:
        return self.method == "HEAD" or self.status in (204, 304) or 100 <= self.status < 200

    def _write_head(self, whole_len: int | None) -> None:
        """The status line and headers, framed by the app's content-length, the one body's length,
        or chunks (HTTP/1.1) / the connection's close (HTTP/1.0)."""
        self.head_pending = False
        conn = self.conn
        lines: list[bytes] = []
        has_date = False
        close = not self.keep_alive or conn.server.draining or not self.complete
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-length":
                with contextlib.suppress(ValueError):
                    self.length_out = int(value)
                continue
            if low in _FRAMING:
                if low == b"connection" and b"close" in value.lower():
                    close = True
                continue
            if low == b"date":
                has_date = True
            lines.append(name + b": " + value)
        if self.length_out is not None:
            lines.append(b"content-length: %d" % self.length_out)
        elif self._bodiless():
            pass
        elif whole_len is not None:
            self.length_out = whole_len
            lines.append(b"content-length: %d" % whole_len)
        elif conn.http11:
            self.chunked_out = True
            lines.append(b"transfer-encoding: chunked")
        else:
            close = True  # an HTTP/1.0 client reads the body until the connection closes
        if not has_date:
            lines.append(b"date: " + conn.server.date.value())
        if close:
            lines.append(b"connection: close")
            self.keep_alive = False
        reason = _REASONS.get(self.status, b"Status")
        head = b"HTTP/1.1 %d %s\r\n%s\r\n" % (self.status, reason, b"".join(ln + b"\r\n" for ln in lines))
        if conn.transport is not None:
            conn.transport.write(head)

    async def run(self, app: ASGIApp) -> None:
        conn = self.conn
        srv = conn.server
        if self.refused:
            return  # refused before the app began (bytes in the same read): the app never sees it
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            conn.abort()
            raise
        except Exception:
            srv.count("app_error")
            srv.note_error(f"{self.method} {self.scope['path']} failed", exc_info=True)
            if self.head_pending:
                conn.fail(_APP_ERROR)
            elif not self.response_complete:
                conn.abort()  # the client must see a cut, not a complete response
            return
        if self.response_complete or self.disconnected:
            return
        if self.head_pending:
            srv.count("app_error")
            srv.note_error(f"{self.method} {self.scope['path']} ended without a response")
            conn.fail(_APP_ERROR)
        else:  # a response the app ends early on purpose (a stream cut upstream; it said why):
            srv.count("app_cut")  # what it sent reaches the client, the body never ends ...
            if self.chunked_out or self.length_out is not None or self._bodiless():
                conn.close_staged()
            else:
                conn.reset()  # ... but one read to the connection's close would end at a FIN


class _Conn(Conn):
    """One client connection: parses requests, runs their cycles in order, enforces the limits."""

    def __init__(self, server: AsgiListener) -> None:
        super().__init__()
        self.server = server
        self.parser = HttpRequestParser(self)
        self.cycles: deque[_Cycle] = deque()  # cycles[0] runs; the rest are pipelined behind it
        self.parsing: _Cycle | None = None
        self.http11 = True
        self.write_paused = False
        self._drained: asyncio.Event | None = None
        self._reject: tuple[bytes, str] | None = None
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.born = 0.0  # loop time of connection_made
        self.read_from = False  # bytes arrived (else it may be one of a burst not read yet)

    # -- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        srv = self.server
        full = len(srv.conns) >= srv.limits.max_connections
        if full and not self._make_room(srv.evictable(), srv.count, _BUSY):
            return
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self.local = (str(sock[0]), int(sock[1])) if isinstance(sock, tuple) else None
        srv.conns.add(self)
        srv.idle[self] = None
        self.born = asyncio.get_running_loop().time()
        self.arm("idle", srv.limits.idle_timeout_s)  # no byte yet: idle (closed), never a 408

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(self.server.conns, self.server.idle)
        for c in self.cycles:
            c.disconnected = True
            c.more.set()
        if self._drained is not None:
            self._drained.set()

    def close(self) -> None:
        """Close now (an idle connection: no request bytes are waiting)."""
        self._done()
        if self.transport is not None:
            self.transport.close()

    def close_staged(self) -> None:
        """Close after the last response (staged: `Conn._linger`); nothing more is answered."""
        self._done()
        for c in self.cycles:  # requests pipelined behind it: never answered
            c.disconnected = True
            c.more.set()
        self.cycles.clear()
        lim = self.server.limits
        self._linger(lim.linger_s, lim.linger_bytes, self.server.idle)

    def _linger_cut(self) -> None:
        self.server.count("linger_cut")
        super()._linger_cut()

    def abort(self) -> None:
        """Reset the connection: what was sent so far is all the client gets (a visible cut)."""
        self._done()
        if self.transport is not None:
            self.transport.abort()

    def reset(self) -> None:
        """Close with a TCP reset (`Conn._send_reset`): the client sees a cut even in a body it
        reads to the connection's close."""
        self._done()
        self._send_reset()

    def fail(self, raw: bytes) -> None:
        """Answer with a canned error and close (staged)."""
        if self.transport is not None and not self.closed:
            self.transport.write(raw)
            self.close_staged()
        else:
            self._done()

    def _done(self) -> None:
        """Nothing more is read or answered here: closed, no deadline, not idle."""
        self.closed = True
        self.disarm()
        self.server.idle.pop(self, None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    async def drain(self) -> None:
        while self.write_paused and not self.closed:
            if self._drained is None:
                self._drained = asyncio.Event()
            await self._drained.wait()

    def _evict(self) -> None:
        self.close()

    def _deadline(self, kind: str) -> None:
        srv = self.server
        if kind == "idle":
            srv.count("idle_timeout")
            self.close()
        elif kind == "header":
            srv.count("header_timeout")
            self._refuse(_TIMEOUT)
        elif kind == "body":
            srv.count("body_timeout")
            self._refuse(_TIMEOUT)

    def _refuse(self, raw: bytes) -> None:
        """A request cannot go on: answer `raw` unless a response has begun (then cut)."""
        running = self.cycles[0] if self.cycles else None
        if running is not None and running.started and not running.response_complete:
            self.abort()
        else:
            for c in self.cycles:
                c.disconnected = c.refused = True
                c.more.set()
            self.fail(raw)

    # -- bytes in --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self.read_from = True
        if self.closed:
            self._lingered(len(data))
            return
        limits = self.server.limits
        if self._timer_kind == "idle":
            self.arm("header", limits.header_timeout_s)
        elif self.parsing is not None and not self._in_head:
            self.arm("body", limits.body_timeout_s)
        if self._in_head or self.parsing is None:
            self._head_fed += len(data)
        try:
            self.parser.feed_data(data)
        except HttpParserError:
            if "done" in self._pauses:
                return  # bytes after a request that ends the connection: never processed (RFC 9112 9.6)
            rej, self._reject = self._reject, None
            raw, reason = rej if rej is not None else (_BAD_REQUEST, "bad_framing")
            self.server.count(reason)
            self._refuse(raw)
            return
        if self._in_head and self._head_fed > limits.max_head:
            self.server.count("head_too_large")
            self._refuse(_HEAD_TOO_LARGE)

    def _raise(self, raw: bytes, reason: str) -> None:
        self._reject = (raw, reason)
        raise HttpParserError(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # trailers are dropped
        if len(self._hdrs) >= self.server.limits.max_headers:
            self._raise(_HEAD_TOO_LARGE, "head_too_large")
        self._hdrs.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._head_ended()
        p = self.parser
        srv = self.server
        hdrs = self._hdrs
        version = p.get_http_version()
        if version not in ("1.1", "1.0"):
            self._raise(_BAD_REQUEST, "bad_framing")
        method = p.get_method().decode("ascii")
        te = [v for n, v in hdrs if n == b"transfer-encoding"]
        fault = head_fault(version == "1.1", te, sum(1 for n, _ in hdrs if n == b"host"))
        if fault is not None:
            self._raise(bad_head(fault), "bad_framing")
        if method == "CONNECT" or p.should_upgrade():
            self._raise(_NO_UPGRADE, "upgrade")
        cl = [v for n, v in hdrs if n == b"content-length"]
        if cl and int(cl[0]) > srv.limits.max_body:  # (llhttp checked it is one valid number)
            self._raise(_TOO_LARGE, "body_too_large")
        target = b"".join(self._url)
        try:
            url = urllib.parse.urlsplit(target.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            self._raise(_BAD_REQUEST, "bad_framing")
        raw_path = (url.path or "/").encode("ascii")
        self.http11 = version == "1.1"
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self.local,
            "client": self.client,
            "scheme": "http",
            "method": method,
            "root_path": "",
            "path": urllib.parse.unquote(url.path or "/"),
            "raw_path": raw_path,
            "query_string": url.query.encode("ascii"),
            "headers": hdrs,
            "state": dict(srv.state),
        }
        expect = any(n == b"expect" and v.strip().lower() == b"100-continue" for n, v in hdrs)
        has_body = bool(te) or bool(cl and cl[0].strip() != b"0")
        cycle = _Cycle(self, scope, bool(p.should_keep_alive()), expect and has_body and self.http11)
        self.parsing = cycle
        self.cycles.append(cycle)
        if len(self.cycles) == 1:
            self._start(cycle)
        elif len(self.cycles) > srv.limits.max_pipelined:
            self._pause("pipeline")
        if has_body:
            self.arm("body", srv.limits.body_timeout_s)
        elif self._timer_kind == "header":
            self.disarm()

    def on_body(self, body: bytes) -> None:
        c = self.parsing
        if c is None:
            return
        c.received += len(body)
        if c.received > self.server.limits.max_body:
            self._raise(_TOO_LARGE, "body_too_large")
        if c.disconnected or c.response_complete:
            return  # nobody reads it any more
        c.body.append(body)
        c.buffered += len(body)
        self._hold(len(body), self.server.limits.max_buffer)
        c.more.set()

    def on_message_complete(self) -> None:
        c = self.parsing
        self.parsing = None
        self._body_ended()
        if c is None:
            return
        c.complete = True
        c.more.set()
        if not c.keep_alive:
            self._pause("done")  # it is answered, then the connection closes: nothing more is read

    # -- flow ------------------------------------------------------------------------------------

    def body_taken(self, n: int) -> None:
        """The app took `n` body bytes."""
        self._release(n, self.server.limits.max_buffer)

    def _start(self, cycle: _Cycle) -> None:
        srv = self.server
        srv.idle.pop(self, None)
        if self._timer_kind in ("idle", "header"):
            self.disarm()
        srv.requests += 1
        task = asyncio.get_running_loop().create_task(cycle.run(srv.app))
        srv.tasks.add(task)
        task.add_done_callback(srv.tasks.discard)

    def response_done(self, cycle: _Cycle) -> None:
        if self.cycles and self.cycles[0] is cycle:
            self.cycles.popleft()
        srv = self.server
        self.buffered -= cycle.buffered
        cycle.buffered = 0
        cycle.body.clear()
        if not (cycle.keep_alive and cycle.complete and not self.closed):  # (its head said close)
            self.close_staged()  # (a body still arriving is not read to its end: the connection goes)
            return
        self._resume("pipeline")
        self._resume("buffer")
        if self.cycles:
            self._start(self.cycles[0])
        elif self._in_head:  # the next request's head is arriving
            self.arm("header", srv.limits.header_timeout_s)
        else:
            srv.idle[self] = None
            self.arm("idle", srv.limits.idle_timeout_s)


class AsgiListener(Front):
    """`await start()` listens on host:port (0: a free port) and returns the base URL;
    `begin_drain()` stops accepting (a connection closes after a response that said so, idle ones
    when drained: `Front.begin_drain`); `await drained(t)` waits until no request is in flight;
    `await stop(grace_s)` does both and then cuts what is left; `await crash()` cuts every connection at once.
    `rejected[reason]` counts refusals (REJECT_REASONS), `requests` the requests served.
    """

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ListenerLimits | None = None,
        lifespan: Literal["on", "off"] = "on",
        name: str = "shadow",
    ) -> None:
        super().__init__(REJECT_REASONS)
        self.app = app
        self.host, self.port = host, port
        self.limits = limits or ListenerLimits()
        self.limits.validate()
        self.lifespan = lifespan
        self.name = name
        self.requests = 0
        self.conns: set[_Conn] = set()
        self.idle: dict[_Conn, None] = {}  # connections without a request, oldest first
        self.tasks: set[asyncio.Task[None]] = set()
        self.state: dict[str, Any] = {}  # the lifespan state, copied into every request scope
        self.date = _Date()
        self._life: _Lifespan | None = None
        self._logged_at = float("-inf")
        self._unlogged = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def connections(self) -> int:
        return len(self.conns)

    def inflight(self) -> int:
        """Requests being answered (or waiting behind one on their connection)."""
        return sum(len(c.cycles) for c in self.conns)

    def evictable(self) -> _Conn | None:
        """The idle connection to close for a new one: the oldest that was read from or is older
        than `evict_grace_s` (not one accepted in the same burst as the newcomer and not read
        yet: a client's whole request may be waiting in it), else None (the newcomer gets 503)."""
        cutoff = asyncio.get_running_loop().time() - self.limits.evict_grace_s
        for c in self.idle:
            if c.read_from or c.born <= cutoff:
                return c
        return None

    def note_error(self, message: str, exc_info: bool = False) -> None:
        """Log an app failure; at most one line per 10 s (a hostile peer cannot fill the disk)."""
        now = time.monotonic()
        if now - self._logged_at < 10.0:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        log.error("%s: %s%s", self.name, message, more, exc_info=exc_info)

    async def start(self, sock: socket.socket | None = None) -> str:
        """Listen (on `sock` when given, else a new socket on host:port; OSError names it)."""
        if self._server is not None:
            return self.url
        if self.lifespan == "on":
            self._life = _Lifespan(self.app, self.state)
            await self._life.startup(self.url)
        # Connections waiting to be accepted are at most the cap: one accept burst (a loop that was
        # busy) then holds at most twice the cap in descriptors, not the cap plus 1024.
        backlog = min(1024, self.limits.max_connections)
        sock = sock if sock is not None else bind_listen(self.host, self.port, backlog)
        self.port = sock.getsockname()[1]
        self.draining = False
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), sock=sock, backlog=backlog)
        return self.url

    def close_idle(self) -> None:
        for c in list(self.idle):
            if c.quiet:
                c.close()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain for up to `grace_s`, then cut what is left (counted as `drain_cut`) and end the
        app's lifespan."""
        if self._server is None and not self.conns:
            return
        self.begin_drain()
        if grace_s > 0:
            await self.drained(grace_s)
        self._cut_all(count=True)
        await self._finish()

    async def crash(self) -> None:
        """Stop listening and reset every open connection now."""
        self._stop_accepting()
        self._cut_all(count=False)
        await self._finish()

    def _cut_all(self, count: bool) -> None:
        for c in list(self.conns):
            if count and c.cycles:
                self.count("drain_cut")
            c.abort()
        for t in list(self.tasks):
            t.cancel()

    async def _finish(self) -> None:
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)
        life, self._life = self._life, None
        if life is not None:
            await life.shutdown()


class _Lifespan:
    """The ASGI lifespan protocol: startup before listening, shutdown after the last request."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}
        try:
            await self.app(scope, self._inbox.get, self._outbox.put)
        except Exception as exc:
            await self._outbox.put({"type": "lifespan.startup.failed", "message": repr(exc)})

    async def startup(self, where: str) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        msg = await self._outbox.get()
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app on {where} failed to start: {msg.get('message', '')}")

    async def shutdown(self) -> None:
        task = self._task
        if task is None or task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self._outbox.get(), 30)
        except TimeoutError:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 5)


async def capped_body(request: Request, max_body: int) -> bytes | None:
    """A request's body for a handler behind one of these listeners, or None when it is over
    `max_body` bytes (by a Content-Length over it or not a number, or as it streams: reading
    stops there)."""
    cl = request.headers.get("content-length")
    if cl is not None and (not cl.isdigit() or int(cl) > max_body):
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            return None
        parts.append(chunk)
    return b"".join(parts)
