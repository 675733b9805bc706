"""The in-path tap: an HTTP/1.1 reverse proxy in front of one upstream worker, framed by llhttp.

Both directions are parsed by llhttp (httptools) and the tap writes out only what the parser
delivered, re-framed canonically (a chunked body leaves as the same chunks, without extensions):
bytes the parser did not accept are never forwarded. Ambiguous or invalid request framing
(obs-fold, bare LF, CL+TE, bad or negative chunk sizes or Content-Length, repeated
Content-Length, a Transfer-Encoding other than `chunked`) is answered 400 and the connection is
closed; an invalid upstream response cuts that one stream (502 before its head, truncation
after). Bodies stream through with bounded buffers: reading a side pauses when the other cannot
take more. Hop-by-hop headers are dropped and connection persistence is managed per side.
Only paths on the allow-list are relayed (`TapLimits.allow_paths`); a request already written
upstream is resent only when idempotent and body-less.

A copy of each request and of the de-chunked response body goes to a `Handoff` (a `DropQueue`
or a `ChannelSink`) as
`(ctx, seq, t, payload)` items: seq 0 = request start (payload None; sent once the request body
is complete), seq > 0 = response body bytes, seq -1 = end (payload = one of END_REASONS). Putting
never blocks; a full queue drops data (the consumer sees a seq gap) but never an end marker.
Nothing here parses JSON or SSE; nothing here does analysis (the relay loop only relays).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections import deque
from collections.abc import Coroutine
from typing import Any, cast

from httptools import HttpParserError, HttpRequestParser, HttpResponseParser

from shadow.base.front import Conn, Front, head_fault
from shadow.contracts.tapwire import (
    CUT_REASONS,
    END_CLIENT_CANCEL,
    END_COMPLETE,
    END_UPSTREAM_CUT,
    END_UPSTREAM_ERROR,
    REJECT_REASONS,
    Handoff,
    TapContext,
)
from shadow.dataplane.http1 import (
    BAD_GATEWAY,
    BAD_REQUEST,
    BODY_TIMEOUT,
    BUSY,
    HEAD_TOO_LARGE,
    IDEMPOTENT,
    NO_UPGRADE,
    NOT_RELAYED,
    NOT_RESENT,
    TIMEOUT,
    TapLimits,
    bad_head,
    connection_tokens,
    head_ids,
    kept_headers,
    path_allowed,
)
from shadow.dataplane.usage_inject import FrameRewriter, inject_request
from shadow.vllm.errors import TAIL_BYTES, cut_event

_BODY_NONE, _BODY_LENGTH, _BODY_CHUNKED, _BODY_CLOSE = 0, 1, 2, 3
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))


class _Reject(Exception):
    """Raised inside a parser callback: answer `response` and close."""

    def __init__(self, response: bytes, reason: str) -> None:
        super().__init__(reason)
        self.response = response
        self.reason = reason


class Tap(Front):
    """One listener in front of one upstream; `await start()` binds, `await close()` stops.

    `begin_drain()` stops accepting and lets in-flight requests finish (`await drained(t)`), closing
    no connection under a client that may be writing on it (`Front.begin_drain`).
    Counters: `requests`, `connect_errors`, `rejected[reason]` (REJECT_REASONS), `cut[reason]`
    (CUT_REASONS: responses ended early, which the client sees as an error).
    """

    def __init__(
        self,
        name: str,
        upstream: str,
        queue: Handoff,
        *,
        max_body: int = 4 << 20,
        connect_timeout: float = 10.0,
        pool_size: int = 256,
        inject_usage: bool = False,
        limits: TapLimits | None = None,
    ) -> None:
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream {upstream!r}: only http://host:port is supported")
        super().__init__(REJECT_REASONS)
        self.name = name
        self.upstream = upstream
        self.up_host = u.hostname
        self.up_port = u.port or 80
        self.up_authority = u.netloc.rsplit("@", 1)[-1].encode("idna")  # a Host header's value
        self.queue = queue
        self.max_body = max_body
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self.inject_usage = inject_usage
        self.limits = limits or TapLimits()
        self._pool: list[tuple[_UpstreamConn, float]] = []
        self._clients: set[_ClientConn] = set()
        self._idle: dict[_ClientConn, None] = {}  # connections without a request in flight, oldest first
        self._tasks: set[asyncio.Future[None]] = set()
        self.connect_errors = 0
        self.requests = 0
        self.cut: dict[str, int] = dict.fromkeys(CUT_REASONS, 0)
        self.host = ""
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._clients)

    def inflight(self) -> int:
        """Client connections with a request in flight."""
        return sum(1 for c in self._clients if c.active is not None)

    async def start(self, host: str = "127.0.0.1", port: int = 0, sock: Any = None) -> str:
        """Bind host:port, or serve the already listening `sock` (a relay process gets its
        listeners from the process that bound them)."""
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(lambda: _ClientConn(self), sock=sock, backlog=4096)
        else:
            self._server = await loop.create_server(lambda: _ClientConn(self), host, port, backlog=4096)
        sock = self._server.sockets[0].getsockname()
        self.host, self.port = sock[0], sock[1]
        return self.url

    def close_idle(self) -> None:
        for c in list(self._idle):
            if c.quiet:
                c._drop()

    async def close(self) -> None:
        """Stop now: responses still being relayed are cut (`tap_shutdown`), the rest closed."""
        if self._server is not None:
            self._server.close()
        for c in list(self._clients):
            c.disarm()
            req = c.active
            if req is not None and req.up is not None and req.up.head_done and not req.up.finished:
                req.up.cut("tap_shutdown")
            if c.transport is not None:
                c.transport.close()
        for up, _ in self._pool:
            up.close()
        self._pool.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    # -- pool ------------------------------------------------------------------------------------

    def _take(self) -> _UpstreamConn | None:
        pool = self._pool
        oldest = time.monotonic() - self.limits.pool_idle_s
        while pool:
            up, t = pool.pop()
            if t >= oldest and up.usable():
                return up
            up.close()
        return None

    def _give_back(self, up: _UpstreamConn) -> None:
        if up.usable() and len(self._pool) < self.pool_size and not self.draining:
            self._pool.append((up, time.monotonic()))
        else:
            up.close()

    def _forget(self, up: _UpstreamConn) -> None:
        for i, (u, _) in enumerate(self._pool):
            if u is up:
                del self._pool[i]
                return

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _announce(self, ctx: TapContext) -> None:
        if not ctx.announced:
            ctx.announced = True
            self.queue.put((ctx, 0, ctx.t_start, None))

    def _end(self, ctx: TapContext, reason: str) -> None:
        if ctx.ended:
            return
        self._announce(ctx)
        ctx.ended = True
        self.queue.put_end((ctx, -1, time.monotonic(), reason))


class _Req:
    """One parsed request on a client connection (possibly pipelined behind another)."""

    __slots__ = (
        "body_len",
        "chunked",
        "complete",
        "copy",
        "copy_len",
        "ctx",
        "head",
        "head_lines",
        "hold",
        "keep_alive",
        "method",
        "pending",
        "pending_len",
        "rewrite",
        "target",
        "up",
    )

    def __init__(self, method: bytes, target: bytes, head_lines: list[bytes], keep_alive: bool) -> None:
        self.method = method
        self.target = target
        self.head_lines = head_lines
        self.head = b"%s %s HTTP/1.1\r\n%s\r\n" % (
            method,
            target,
            b"".join(ln + b"\r\n" for ln in head_lines),
        )
        self.keep_alive = keep_alive
        self.chunked = False
        self.complete = False
        self.copy: list[bytes] | None = []
        self.copy_len = 0
        self.body_len = 0
        self.pending: list[bytes] = []
        self.pending_len = 0
        self.hold = False
        self.rewrite = 0
        self.up: _UpstreamConn | None = None
        self.ctx: TapContext


class _ClientConn(Conn):
    """The router-facing side of one TCP connection."""

    def __init__(self, tap: Tap) -> None:
        super().__init__()
        self.tap = tap
        self.parser = HttpRequestParser(self)
        self.reqs: deque[_Req] = deque()  # parsed requests; reqs[0] is `active` once started
        self.active: _Req | None = None
        self.write_paused = False
        self.http11 = True
        self._broken: bytes | None = None  # a reject to send once the active response is done
        self._parsing: _Req | None = None

    # -- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not subclasses)
        tap = self.tap
        full = len(tap._clients) >= tap.limits.max_connections
        if full and not self._make_room(next(iter(tap._idle), None), tap.count, BUSY):
            return
        tap._clients.add(self)
        tap._idle[self] = None
        # no byte yet: idle, not a late head. A client's pool may open a connection it does not use
        # at once (hyper does); a 408 on it would meet the request the client sends on it then.
        self.arm("idle", tap.limits.idle_timeout_s)

    def _drop(self) -> None:
        self.tap._clients.discard(self)
        self.tap._idle.pop(self, None)
        self.disarm()
        if self.transport is not None:
            self.transport.close()

    def _evict(self) -> None:
        self._drop()

    def _deadline(self, kind: str) -> None:
        if kind == "body":  # the request body stalled: the request is abandoned upstream too
            if self._parsing is not None:
                self._reject(_Reject(BODY_TIMEOUT, "body_timeout"))
            return
        if self.active is not None:
            return
        if kind == "header":
            self.tap.count("header_timeout")
            self._fail(TIMEOUT)
        else:
            self.tap.count("idle_timeout")
            self._drop()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            self._lingered(len(data))
            return
        if self._broken is not None:
            return
        if self._timer_kind == "idle":
            self.arm("header", self.tap.limits.header_timeout_s)
        elif self._parsing is not None and not self._in_head:
            self.arm("body", self.tap.limits.header_timeout_s)  # longest silence inside a request body
        fresh = not self._in_head and self._parsing is None
        if self._in_head or fresh:
            self._head_fed += len(data)
        try:
            self.parser.feed_data(data)
        except _Reject as exc:  # (never raised by feed_data itself; kept for clarity)
            self._reject(exc)
            return
        except HttpParserError:
            rej = self._pending_reject
            self._pending_reject = None
            if "done" in self._pauses:
                return  # bytes after a request that ends the connection: never processed (RFC 9112 9.6)
            self._reject(rej if rej is not None else _Reject(BAD_REQUEST, "bad_framing"))
            return
        if self._in_head and self._head_fed > self.tap.limits.max_head:
            self._reject(_Reject(HEAD_TOO_LARGE, "head_too_large"))

    _pending_reject: _Reject | None = None

    def _raise(self, rej: _Reject) -> None:
        self._pending_reject = rej
        raise rej

    def _reject(self, rej: _Reject) -> None:
        self.tap.count(rej.reason)
        self._pause("broken")
        # requests parsed but not started are dropped (never forwarded)
        while self.reqs and self.reqs[-1] is not self.active:
            self.reqs.pop()
        req = self.active
        if req is None:
            self._fail(rej.response)
        elif not req.complete:
            # the request in flight is itself broken: abandon it upstream, answer (or cut) the client
            self.active = None
            self.reqs.clear()
            up = req.up
            head_sent = up is not None and up.head_done
            if up is not None:
                up.client = None
                up.req = None
                up.close()
            self.tap._end(req.ctx, END_CLIENT_CANCEL)
            if head_sent:
                self._close_staged()
            else:
                self._fail(rej.response)
        else:
            self._broken = rej.response  # answered once the response in flight is done

    # -- request parser callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # request trailers are dropped
        if len(self._hdrs) >= self.tap.limits.max_headers:
            self._raise(_Reject(HEAD_TOO_LARGE, "head_too_large"))
        self._hdrs.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_ended()
        tap = self.tap
        p = self.parser
        hdrs = self._hdrs
        method: bytes = p.get_method()
        target = b"".join(self._url)
        version = p.get_http_version()
        if version not in ("1.1", "1.0"):
            self._raise(_Reject(BAD_REQUEST, "bad_framing"))
        te = [v for n, v in hdrs if n.lower() == b"transfer-encoding"]
        fault = head_fault(version == "1.1", te, sum(1 for n, _ in hdrs if n.lower() == b"host"))
        if fault is not None:
            self._raise(_Reject(bad_head(fault), "bad_framing"))
        conn = connection_tokens(hdrs)
        if method == b"CONNECT" or (b"upgrade" in conn and any(n.lower() == b"upgrade" for n, _ in hdrs)):
            self._raise(_Reject(NO_UPGRADE, "upgrade"))
        if not path_allowed(target, tap.limits.allow_paths):
            self._raise(_Reject(NOT_RELAYED, "path_not_allowed"))
        if not target.startswith(b"/"):  # absolute-form: the upstream gets origin-form
            u = urllib.parse.urlsplit(target)
            target = (u.path or b"/") + (b"?" + u.query if u.query else b"")
        self.http11 = version == "1.1"
        lines = kept_headers(hdrs)
        if not self.http11 and not any(n.lower() == b"host" for n, _ in hdrs):
            lines.append(b"host: " + tap.up_authority)  # it goes upstream as HTTP/1.1, which needs one
        req = _Req(method, target, lines, bool(p.should_keep_alive()))
        req.chunked = bool(te)
        rid, traceparent = head_ids(hdrs)
        req.ctx = TapContext(
            tap.name,
            method.decode("latin-1"),
            target.decode("latin-1"),
            rid,
            None,
            0,
            time.monotonic(),
            traceparent,
        )
        has_body = req.chunked or any(n.lower() == b"content-length" and v.strip() != b"0" for n, v in hdrs)
        if tap.inject_usage and method == b"POST" and has_body:
            req.hold = True  # the body is rewritten once complete (or sent as is when too large)
        if (
            has_body
            and self.http11
            and any(n.lower() == b"expect" and v.strip().lower() == b"100-continue" for n, v in hdrs)
        ):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        self._parsing = req
        self.reqs.append(req)
        if self.active is None:
            self._start(req)
        if has_body:
            self.arm("body", tap.limits.header_timeout_s)

    def on_body(self, body: bytes) -> None:
        req = self._parsing
        if req is None:
            return
        n = len(body)
        req.body_len += n
        if req.copy is not None:
            if req.copy_len + n <= self.tap.max_body:
                req.copy.append(body)
                req.copy_len += n
            else:
                req.copy = None
        self._forward(req, b"%x\r\n%b\r\n" % (n, body) if req.chunked else body)

    def on_message_complete(self) -> None:
        req = self._parsing
        self._parsing = None
        self._in_head = False
        self._body_ended()
        if req is None:
            return
        req.complete = True
        if req.chunked:
            self._forward(req, b"0\r\n\r\n")
        ctx = req.ctx
        ctx.body_len = req.body_len
        ctx.body = b"".join(req.copy) if req.copy is not None else None
        if req.hold:
            self._inject(req, ctx.body)
        if req is self.active:
            self.tap._announce(ctx)
        if not req.keep_alive:
            self._pause("done")  # nothing more is read from a connection that closes after this

    def _inject(self, req: _Req, body: bytes | None) -> None:
        """--inject-usage: rewrite the complete request body (held until now) and release it."""
        req.hold = False
        injected = inject_request(body) if body is not None else None
        if injected is not None:
            new_body, req.rewrite = injected
            lines = [ln for ln in req.head_lines if ln.split(b":", 1)[0].strip().lower() not in _FRAMING]
            lines.append(b"content-length: %d" % len(new_body))
            req.head = b"%s %s HTTP/1.1\r\n%s\r\n" % (
                req.method,
                req.target,
                b"".join(ln + b"\r\n" for ln in lines),
            )
            self.buffered -= req.pending_len
            req.pending = [new_body]
            req.pending_len = len(new_body)
            self.buffered += req.pending_len
        if req.up is not None:
            req.up.flush_request()

    def _forward(self, req: _Req, data: bytes) -> None:
        up = req.up
        if up is not None and not req.hold and up.transport is not None:
            up.transport.write(data)
            return
        req.pending.append(data)
        req.pending_len += len(data)
        self.buffered += len(data)
        if req.hold and req.pending_len > self.tap.max_body:
            self._inject(req, None)  # too large to rewrite: relay unchanged
        if self.buffered > self.tap.limits.max_buffer:
            self._pause("buffer")

    def released(self, n: int) -> None:
        """`n` held request bytes were written upstream."""
        self._release(n, self.tap.limits.max_buffer)

    # -- dispatch --------------------------------------------------------------------------------

    def _start(self, req: _Req) -> None:
        tap = self.tap
        self.active = req
        self.disarm()
        tap._idle.pop(self, None)
        tap.requests += 1
        if req.complete:
            tap._announce(req.ctx)
        up = tap._take()
        if up is not None:
            up.begin(self, req, reused=True)
        else:
            tap._spawn(self._connect_and_send(req))

    async def _connect_and_send(self, req: _Req) -> None:
        tap = self.tap
        loop = asyncio.get_running_loop()
        try:
            _, up = await asyncio.wait_for(
                loop.create_connection(lambda: _UpstreamConn(tap), tap.up_host, tap.up_port),
                tap.connect_timeout,
            )
        except (TimeoutError, OSError):
            tap.connect_errors += 1
            if self.active is req and not self.closed:
                tap._end(req.ctx, END_UPSTREAM_ERROR)
                self._fail(BAD_GATEWAY)
            return
        if self.closed or self.active is not req:
            up.close()
            return
        up.begin(self, req, reused=False)

    def _fail(self, raw: bytes) -> None:
        """Answer `raw` (a canned error) and end the connection."""
        if self.transport is not None and not self.closed:
            self.transport.write(raw)
        self._close_staged()

    def _close_staged(self) -> None:
        """Close after the last response (staged: `Conn._linger`); nothing more is relayed."""
        if self.closed:
            return
        self._abandon()
        self.tap._idle.pop(self, None)
        lim = self.tap.limits
        self._linger(lim.linger_s, lim.linger_bytes, self.tap._idle)

    def _cut_off(self) -> None:
        """Reset the connection (`Conn._send_reset`): the client sees an error where a close would
        end its response cleanly (a body read to the connection's close)."""
        if self.closed:
            return
        self._abandon()
        self.tap._idle.pop(self, None)
        self.closed = True
        self.disarm()
        self._send_reset()

    def _abandon(self) -> None:
        """No request of this connection goes on: the one in flight ends (client_cancel unless its
        end was told already) and lets its upstream go; those parsed behind it are dropped."""
        req, self.active = self.active, None
        self.reqs.clear()
        if req is not None:
            self.tap._end(req.ctx, END_CLIENT_CANCEL)
            up = req.up
            if up is not None:
                up.client = None
                up.req = None
                up.close()

    def _linger_cut(self) -> None:
        self.tap.count("linger_cut")
        super()._linger_cut()

    def response_done(self, close_after: bool) -> None:
        """Called by the upstream side once the whole response was relayed."""
        req = self.active
        self.active = None
        if req is not None and self.reqs and self.reqs[0] is req:
            self.reqs.popleft()
        if req is not None and not req.complete:
            close_after = True  # answered before the request ended: the rest of it is not relayed
        if self._broken is not None:
            self._fail(self._broken)
            return
        if close_after or (req is not None and not req.keep_alive):  # (the head said `connection: close`)
            self._close_staged()
            return
        if self.reqs:
            self._start(self.reqs[0])
            return
        self.tap._idle[self] = None
        self.arm("idle", self.tap.limits.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(self.tap._clients, self.tap._idle)
        self._abandon()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.active is not None and self.active.up is not None:
            self.active.up.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.active is not None and self.active.up is not None:
            self.active.up.resume()


class _UpstreamConn(asyncio.Protocol):
    """The worker-facing side: relays the response to the current client and copies the body."""

    def __init__(self, tap: Tap) -> None:
        self.tap = tap
        self.transport: asyncio.Transport | None = None
        self.parser = HttpResponseParser(self)
        self.client: _ClientConn | None = None
        self.req: _Req | None = None
        self.alive = True
        self.paused = False
        self.reused = False
        self._reset()

    def _reset(self) -> None:
        self.got_bytes = False
        self.head_done = False
        self.interim = False
        self.finished = False
        self.mode = _BODY_NONE
        self.rechunk = False
        self.close_client = False
        self.reusable = True
        self.stop_at_head = False
        self.reason = b""
        self.hdrs: list[tuple[bytes, bytes]] = []
        self.trailers: list[bytes] = []
        self.rw: FrameRewriter | None = None
        self.bad = False
        self.sse = False  # the response is an event stream (a cut gets an SSE error event)
        self.tail = b""  # the last bytes of body written to the client (is an event open?)

    _out: list[bytes] | None = None  # set while a read is parsed: the client's bytes, written after it

    def usable(self) -> bool:
        return self.alive and self.transport is not None and not self.transport.is_closing()

    def _write(self, client: _ClientConn, data: bytes) -> None:
        """To the client: with the read being parsed (in order), else now."""
        out = self._out
        if out is not None:
            out.append(data)
        else:
            assert client.transport is not None
            client.transport.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def begin(self, client: _ClientConn, req: _Req, reused: bool) -> None:
        self._reset()
        self.client = client
        self.req = req
        self.reused = reused
        req.up = self
        if client.write_paused:
            self.pause()
        if not req.hold:
            self.flush_request()

    def flush_request(self) -> None:
        """Write the request head and the body held so far."""
        req, client = self.req, self.client
        if req is None or client is None or self.transport is None:
            return
        data = req.head + b"".join(req.pending) if req.pending else req.head
        n = req.pending_len
        req.pending = []
        req.pending_len = 0
        self.transport.write(data)
        if n:
            client.released(n)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.alive = False
        if self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        if self.client is not None:
            self.client._pause("upstream")

    def resume_writing(self) -> None:
        if self.client is not None:
            self.client._resume("upstream")

    # -- response --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None or client.transport is None:
            self.close()  # bytes nobody asked for
            return
        self.got_bytes = True
        # what the parser delivers from this read goes to the client in one write (the chunks
        # that arrived together, a last chunk and its terminator): one syscall, not one per chunk
        out: list[bytes] = []
        self._out = out
        try:
            try:
                self.parser.feed_data(data)
            finally:
                self._out = None
                if out and client.transport is not None:
                    client.transport.write(out[0] if len(out) == 1 else b"".join(out))
        except HttpParserError:
            if self.stop_at_head:
                self.finished = True  # a HEAD response ends at its head (the parser cannot be told)
                self.reusable = False
            elif self.finished:
                self.reusable = False  # bytes after the response: this connection is not reused
            else:
                self.tap.count("bad_upstream_response")
                self._cut("bad_upstream_response")
                return
        if self.finished:
            self._finish()

    def on_message_begin(self) -> None:
        if self.finished or self.req is None:
            raise RuntimeError("unsolicited response")
        self.hdrs = []
        self.reason = b""

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            if len(self.trailers) < self.tap.limits.max_headers:
                self.trailers.append(name + b": " + value)
            return
        if len(self.hdrs) >= self.tap.limits.max_headers:
            raise RuntimeError("too many response headers")
        self.hdrs.append((name, value))

    def on_headers_complete(self) -> None:
        client, req = self.client, self.req
        assert client is not None and req is not None and client.transport is not None
        status: int = self.parser.get_status_code()
        hdrs = self.hdrs
        if 100 <= status < 200:
            if status == 101:
                raise RuntimeError("upgrade response")
            self.interim = True
            if client.http11:
                lines = kept_headers(hdrs)
                self._write(
                    client,
                    b"HTTP/1.1 %d %s\r\n%s\r\n"
                    % (status, self.reason, b"".join(ln + b"\r\n" for ln in lines))
                )
            return
        self.head_done = True
        ctx = req.ctx
        has_te = any(n.lower() == b"transfer-encoding" for n, _ in hdrs)
        if req.method == b"HEAD" or status in (204, 304):
            mode = _BODY_NONE
            self.stop_at_head = req.method == b"HEAD"
        elif has_te:
            mode = _BODY_CHUNKED
        elif any(n.lower() == b"content-length" for n, _ in hdrs):
            mode = _BODY_LENGTH
        else:
            mode = _BODY_CLOSE
            self.reusable = False
        self.mode = mode
        drop: frozenset[bytes] = frozenset()
        close_client = mode == _BODY_CLOSE or not req.keep_alive or self.tap.draining or not req.complete
        self.rechunk = mode == _BODY_CHUNKED
        if mode == _BODY_CHUNKED and not client.http11:
            drop = frozenset((b"transfer-encoding",))  # an HTTP/1.0 client reads until close
            self.rechunk = False
            close_client = True
        self.close_client = close_client
        lines = kept_headers(hdrs, drop)
        if close_client:
            lines.append(b"connection: close")
        ctx.status = status
        ctx.resp_headers = {
            k: v.decode("latin-1")
            for n, v in hdrs
            if (k := n.decode("latin-1").lower()) in ("content-type", "content-length", "transfer-encoding")
        }
        self.sse = "event-stream" in ctx.resp_headers.get("content-type", "")
        if req.rewrite and status == 200 and self.rechunk:
            self.rw = FrameRewriter(req.rewrite)  # --inject-usage: the client gets rewritten frames
        self._write(
            client,
            b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, self.reason, b"".join(ln + b"\r\n" for ln in lines))
        )
        if self.stop_at_head:
            self.finished = True
            raise RuntimeError("HEAD response ends at its head")

    def on_body(self, body: bytes) -> None:
        req, client = self.req, self.client
        if req is None or client is None or client.transport is None:
            return
        ctx = req.ctx
        tap = self.tap
        if not ctx.announced:
            tap._announce(ctx)
        ctx.seq += 1
        tap.queue.put((ctx, ctx.seq, time.monotonic(), body), len(body))
        rw = self.rw
        if rw is not None:
            out = rw.feed(body)
            if out:
                self.tail = out[-TAIL_BYTES:] if len(out) >= TAIL_BYTES else (self.tail + out)[-TAIL_BYTES:]
                self._write(client, b"%x\r\n%b\r\n" % (len(out), out))
        elif self.rechunk:
            self.tail = body[-TAIL_BYTES:] if len(body) >= TAIL_BYTES else (self.tail + body)[-TAIL_BYTES:]
            self._write(client, b"%x\r\n%b\r\n" % (len(body), body))
        else:
            self._write(client, body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        client = self.client
        self.finished = True
        if not self.parser.should_keep_alive():  # (only meaningful inside this callback)
            self.reusable = False
        if client is None or client.transport is None:
            return
        rw = self.rw
        if rw is not None:
            rest = rw.flush()
            if rest:
                self._write(client, b"%x\r\n%b\r\n" % (len(rest), rest))
        if self.rechunk:
            self._write(client, b"0\r\n%s\r\n" % b"".join(t + b"\r\n" for t in self.trailers))

    def _finish(self) -> None:
        client, req = self.client, self.req
        self.rw = None
        self.client = None
        self.req = None
        if req is not None:
            self.tap._end(req.ctx, END_COMPLETE)
        if self.paused:
            self.resume()
        if self.reusable and self.usable():
            self.tap._give_back(self)
        else:
            self.close()
        if client is not None:
            client.response_done(self.close_client)

    def cut(self, reason: str) -> None:
        """The response cannot be completed: end the client's copy so that it sees an error."""
        self._cut(reason)

    def _cut(self, reason: str) -> None:
        """Protocol error, premature close or shutdown mid-response. Before the head the client gets
        502; after it, an SSE error event in vLLM's shape (event streams relayed chunked, unless the
        upstream left an event open: `vllm.errors.cut_event`) and then the connection closes without
        the terminating chunk, or short of its Content-Length; a body the client reads to the
        connection's close is reset instead. Never a clean end. Counted in `Tap.cut[reason]`."""
        client, req = self.client, self.req
        self.client = None
        self.req = None
        self.rw = None
        self.close()
        if req is not None:
            self.tap._end(req.ctx, END_UPSTREAM_CUT if self.head_done else END_UPSTREAM_ERROR)
        if client is None:
            return
        client.active = None
        if not self.head_done:
            client._fail(BAD_GATEWAY)
            return
        self.tap.cut[reason] = self.tap.cut.get(reason, 0) + 1
        if self.mode == _BODY_CLOSE or (self.mode == _BODY_CHUNKED and not self.rechunk):
            client._cut_off()  # the client reads the body to the close: a FIN would end it cleanly
            return
        tr = client.transport
        if tr is not None and self.rechunk and self.sse:
            why = f"shadow tap {self.tap.name}: the upstream stream was cut ({reason})"
            event = cut_event(why, self.tail)
            if event is not None:
                tr.write(b"%x\r\n%b\r\n" % (len(event), event))
        client._close_staged()  # what was written is sent, then FIN: the body never ends

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        self.tap._forget(self)
        client, req = self.client, self.req
        if client is None or req is None:
            return
        if self.head_done and self.mode == _BODY_CLOSE and exc is None:
            self.finished = True
            self._finish()
            return
        if not self.got_bytes:
            self.client = None
            self.req = None
            if (
                self.reused
                and not client.closed
                and req.method in IDEMPOTENT
                and req.body_len == 0
                and req.complete
            ):
                # a pooled connection the worker had closed: one fresh attempt for a safe request
                req.up = None
                self.tap._spawn(client._connect_and_send(req))
                return
            if self.reused:
                self.tap.count("not_resent")
            self.tap._end(req.ctx, END_UPSTREAM_ERROR)
            client.active = None
            client._fail(NOT_RESENT if self.reused else BAD_GATEWAY)
            return
        self._cut("upstream_closed" if exc is None else "upstream_reset")
