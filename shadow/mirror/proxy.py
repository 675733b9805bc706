"""The in-path tap: a lean HTTP/1.1 reverse proxy in front of one upstream worker.

Bytes pass unchanged in both directions (the response's own framing, chunked or not, is relayed
as is; only hop-by-hop headers are dropped and connection persistence is managed per side). A copy
of each request and of the de-chunked response body goes to a `DropQueue` as
`(ctx, seq, t, payload)` items: seq 0 = request start (payload None), seq > 0 = body bytes,
seq -1 = end (payload = one of END_REASONS). Putting never blocks; a full queue drops data (the
consumer sees a seq gap) but never an end marker. Nothing here parses JSON or SSE.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import Coroutine
from typing import Any, cast

from shadow.mirror.dropqueue import DropQueue
from shadow.mirror.usage_inject import FrameRewriter, inject_request

END_COMPLETE = "complete"
END_CLIENT_CANCEL = "client_cancel"
END_UPSTREAM_CUT = "upstream_cut"
END_UPSTREAM_ERROR = "upstream_error"
END_REASONS = (END_COMPLETE, END_CLIENT_CANCEL, END_UPSTREAM_CUT, END_UPSTREAM_ERROR)

_HOP_BY_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade", b"expect"))
MAX_HEAD = 1 << 20
_BAD_GATEWAY = (
    b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: 77\r\n"
    b"connection: close\r\n\r\n"
    b'{"error":{"message":"shadow tap: upstream unavailable","type":"BadGateway"}}\n'
)
assert len(_BAD_GATEWAY.split(b"\r\n\r\n", 1)[1]) == 77

_BODY_NONE, _BODY_LENGTH, _BODY_CHUNKED, _BODY_CLOSE = 0, 1, 2, 3
_C_SIZE, _C_DATA, _C_TRAILER, _C_DONE = 0, 1, 2, 3


class TapContext:
    """One proxied request/response as the analysis side sees it (plain attributes, set by the tap)."""

    __slots__ = (
        "an",
        "body",
        "body_len",
        "ended",
        "method",
        "path",
        "request_id",
        "resp_headers",
        "seq",
        "status",
        "t_start",
        "tap",
    )

    def __init__(
        self,
        tap: str,
        method: str,
        path: str,
        request_id: str | None,
        body: bytes | None,
        body_len: int,
        t_start: float,
    ) -> None:
        self.tap = tap
        self.method = method
        self.path = path
        self.request_id = request_id
        self.body = body  # None when larger than the analysis limit
        self.body_len = body_len
        self.t_start = t_start
        self.status = 0
        self.resp_headers: dict[str, str] = {}
        self.seq = 0
        self.ended = False
        self.an: Any = None  # the analysis side's per-request state


def _split_head(head: bytes) -> tuple[bytes, list[bytes]]:
    lines = head.split(b"\r\n")
    return lines[0], lines[1:]


def _header_map(lines: list[bytes]) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for line in lines:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        v = value.strip()
        out[key] = out[key] + b", " + v if key in out else v
    return out


def _filter_lines(lines: list[bytes], hmap: dict[bytes, bytes]) -> list[bytes] | None:
    """Header lines without hop-by-hop ones; None when nothing had to be removed."""
    drop = set(_HOP_BY_HOP)
    conn = hmap.get(b"connection")
    if conn:
        drop.update(t.strip().lower() for t in conn.split(b","))
    drop.discard(b"transfer-encoding")  # we relay the same framing
    drop.discard(b"content-length")
    kept = [ln for ln in lines if ln.partition(b":")[0].strip().lower() not in drop]
    return None if len(kept) == len(lines) else kept


class Tap:
    """One listener in front of one upstream; `await start()` binds, `await close()` stops."""

    def __init__(
        self,
        name: str,
        upstream: str,
        queue: DropQueue,
        *,
        max_body: int = 4 << 20,
        connect_timeout: float = 10.0,
        pool_size: int = 256,
        inject_usage: bool = False,
    ) -> None:
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream {upstream!r}: only http://host:port is supported")
        self.name = name
        self.upstream = upstream
        self.up_host = u.hostname
        self.up_port = u.port or 80
        self.queue = queue
        self.max_body = max_body
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self.inject_usage = inject_usage
        self._pool: list[_UpstreamConn] = []
        self._server: asyncio.AbstractServer | None = None
        self._clients: set[_ClientConn] = set()
        self._tasks: set[asyncio.Future[None]] = set()
        self.connect_errors = 0
        self.requests = 0
        self.host = ""
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientConn(self), host, port, backlog=1024)
        sock = self._server.sockets[0].getsockname()
        self.host, self.port = sock[0], sock[1]
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._clients):
            if c.transport is not None:
                c.transport.close()
        for up in self._pool:
            up.close()
        self._pool.clear()
        if self._server is not None:
            await self._server.wait_closed()

    # -- pool ------------------------------------------------------------------------------------

    def _take(self) -> _UpstreamConn | None:
        pool = self._pool
        while pool:
            up = pool.pop()
            if up.usable():
                return up
        return None

    def _give_back(self, up: _UpstreamConn) -> None:
        if up.usable() and len(self._pool) < self.pool_size:
            self._pool.append(up)
        else:
            up.close()

    def _forget(self, up: _UpstreamConn) -> None:
        with contextlib.suppress(ValueError):
            self._pool.remove(up)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _end(self, ctx: TapContext, reason: str) -> None:
        if ctx.ended:
            return
        ctx.ended = True
        self.queue.put_end((ctx, -1, time.monotonic(), reason))


class _ClientConn(asyncio.Protocol):
    """The router-facing side of one TCP connection."""

    def __init__(self, tap: Tap) -> None:
        self.tap = tap
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.ctx: TapContext | None = None
        self.up: _UpstreamConn | None = None
        self.keep_alive = True
        self.closed = False
        self.write_paused = False
        self._read_paused = False
        self._continued = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not subclasses)
        self.tap._clients.add(self)

    def data_received(self, data: bytes) -> None:
        self.buf = self.buf + data if self.buf else data
        if self.ctx is None:
            self._try_request()
        elif len(self.buf) > MAX_HEAD and not self._read_paused and self.transport is not None:
            self._read_paused = True  # pipelined data beyond reason: wait for the response to end
            self.transport.pause_reading()

    def _try_request(self) -> None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._fail(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
                    b"connection: close\r\n\r\n"
                )
            return
        start_line, lines = _split_head(buf[:end])
        hmap = _header_map(lines)
        body_start = end + 4
        te = hmap.get(b"transfer-encoding")
        if te is not None and b"chunked" in te.lower():
            body_end = _chunked_end(buf, body_start)
            if body_end < 0:
                self._maybe_continue(hmap)
                return
            body = _dechunk(buf[body_start:body_end])
        else:
            try:
                clen = int(hmap.get(b"content-length", b"0"))
            except ValueError:
                self._fail(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                return
            body_end = body_start + clen
            if len(buf) < body_end:
                self._maybe_continue(hmap)
                return
            body = buf[body_start:body_end]
        self.buf = buf[body_end:]
        parts = start_line.split(b" ")
        method = parts[0].decode("latin-1")
        path = parts[1].decode("latin-1") if len(parts) > 1 else "/"
        version = parts[2] if len(parts) > 2 else b"HTTP/1.1"
        conn = hmap.get(b"connection", b"").lower()
        self.keep_alive = (b"close" not in conn) if version == b"HTTP/1.1" else (b"keep-alive" in conn)
        kept = _filter_lines(lines, hmap)
        rewrite = 0
        injected = inject_request(body) if self.tap.inject_usage and method == "POST" else None
        if injected is not None:
            new_body, rewrite = injected
            drop = (b"content-length", b"transfer-encoding")
            lines2 = [
                ln
                for ln in (lines if kept is None else kept)
                if ln.partition(b":")[0].strip().lower() not in drop
            ]
            lines2.append(b"content-length: %d" % len(new_body))
            out = b"\r\n".join([start_line, *lines2]) + b"\r\n\r\n" + new_body
        elif kept is None:
            out = buf[:body_end]
        else:
            out = b"\r\n".join([start_line, *kept]) + b"\r\n\r\n" + buf[body_start:body_end]
        rid = hmap.get(b"x-request-id")
        tap = self.tap
        tap.requests += 1
        ctx = TapContext(
            tap.name,
            method,
            path,
            rid.decode("latin-1") if rid else None,
            body if len(body) <= tap.max_body else None,
            len(body),
            time.monotonic(),
        )
        self.ctx = ctx
        tap.queue.put((ctx, 0, ctx.t_start, None))
        up = tap._take()
        if up is not None:
            up.send(self, ctx, out, method == "HEAD", reused=True, rewrite=rewrite)
        else:
            tap._spawn(self._connect_and_send(ctx, out, method == "HEAD", rewrite))

    def _maybe_continue(self, hmap: dict[bytes, bytes]) -> None:
        if (
            b"100-continue" in hmap.get(b"expect", b"").lower()
            and self.transport is not None
            and not self._continued
        ):
            self._continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _connect_and_send(self, ctx: TapContext, out: bytes, head_only: bool, rewrite: int = 0) -> None:
        tap = self.tap
        loop = asyncio.get_running_loop()
        try:
            _, up = await asyncio.wait_for(
                loop.create_connection(lambda: _UpstreamConn(tap), tap.up_host, tap.up_port),
                tap.connect_timeout,
            )
        except (TimeoutError, OSError):
            tap.connect_errors += 1
            if self.ctx is ctx and not self.closed:
                tap._end(ctx, END_UPSTREAM_ERROR)
                self._fail(_BAD_GATEWAY)
            return
        if self.closed or self.ctx is not ctx:
            up.close()
            return
        up.send(self, ctx, out, head_only, reused=False, rewrite=rewrite)

    def _fail(self, raw: bytes) -> None:
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.write(raw)
            self.transport.close()

    def response_done(self, close_after: bool) -> None:
        """Called by the upstream side once the whole response was relayed."""
        self.ctx = None
        self.up = None
        self._continued = False
        if close_after or not self.keep_alive:
            if self.transport is not None:
                self.transport.close()
            return
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()
        if self.buf:
            self._try_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.tap._clients.discard(self)
        ctx, up = self.ctx, self.up
        if ctx is not None:
            self.ctx = None
            self.up = None
            self.tap._end(ctx, END_CLIENT_CANCEL)
            if up is not None:
                up.client = None
                up.ctx = None
                up.close()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.up is not None:
            self.up.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.up is not None:
            self.up.resume()


class _UpstreamConn(asyncio.Protocol):
    """The worker-facing side: relays the response to the current client and copies the body."""

    def __init__(self, tap: Tap) -> None:
        self.tap = tap
        self.transport: asyncio.Transport | None = None
        self.client: _ClientConn | None = None
        self.ctx: TapContext | None = None
        self.alive = True
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        self.head_buf = b""
        self.in_body = False
        self.got_bytes = False
        self.body_mode = _BODY_NONE
        self.remaining = 0
        self.cstate = _C_SIZE
        self.cline = b""
        self.reusable = True
        self.head_only = False
        self.reused = False
        self.out = b""
        self.rewrite = 0
        self.rw: FrameRewriter | None = None

    def usable(self) -> bool:
        return self.alive and self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not subclasses)

    def send(
        self,
        client: _ClientConn,
        ctx: TapContext,
        out: bytes,
        head_only: bool,
        reused: bool,
        rewrite: int = 0,
    ) -> None:
        self._reset()
        self.rewrite = rewrite
        self.client = client
        self.ctx = ctx
        self.head_only = head_only
        self.reused = reused
        self.out = out if reused else b""
        client.up = self
        if client.write_paused:
            self.pause()
        assert self.transport is not None
        self.transport.write(out)

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

    # -- response --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None or client.transport is None:
            self.close()  # bytes nobody asked for
            return
        self.got_bytes = True
        if self.in_body:
            if self.rw is None:
                client.transport.write(data)
            self._body(data)
            return
        self._head(data)

    def _head(self, data: bytes) -> None:
        buf = self.head_buf + data if self.head_buf else data
        client = self.client
        ctx = self.ctx
        assert client is not None and client.transport is not None and ctx is not None
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._cut()
                    return
                self.head_buf = buf
                return
            status_line, lines = _split_head(buf[:end])
            parts = status_line.split(b" ", 2)
            try:
                status = int(parts[1])
            except (IndexError, ValueError):
                self._cut()
                return
            if 100 <= status < 200 and status != 101:
                client.transport.write(buf[: end + 4])  # interim response (e.g. 103)
                buf = buf[end + 4 :]
                continue
            break
        hmap = _header_map(lines)
        self.head_buf = b""
        version = parts[0]
        conn = hmap.get(b"connection", b"").lower()
        self.reusable = version == b"HTTP/1.1" and b"close" not in conn
        te = hmap.get(b"transfer-encoding")
        if self.head_only or status in (204, 304):
            mode = _BODY_NONE
        elif te is not None and b"chunked" in te.lower():
            mode = _BODY_CHUNKED
        elif b"content-length" in hmap:
            try:
                self.remaining = int(hmap[b"content-length"])
            except ValueError:
                self._cut()
                return
            mode = _BODY_LENGTH if self.remaining > 0 else _BODY_NONE
        else:
            mode = _BODY_CLOSE
            self.reusable = False
        self.body_mode = mode
        close_client = mode == _BODY_CLOSE or not client.keep_alive
        kept = _filter_lines(lines, hmap)
        if kept is None and not close_client:
            head = buf[: end + 4]
        else:
            kept = lines if kept is None else kept
            if close_client:
                kept = [*kept, b"connection: close"]
            head = b"\r\n".join([status_line, *kept]) + b"\r\n\r\n"
        ctx.status = status
        ctx.resp_headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in hmap.items()
            if k in (b"content-type", b"content-length", b"transfer-encoding")
        }
        rest = buf[end + 4 :]
        self.in_body = True
        if self.rewrite and status == 200 and mode == _BODY_CHUNKED:
            self.rw = FrameRewriter(self.rewrite)  # --inject-usage: the client gets rewritten frames
            client.transport.write(head)
        else:
            client.transport.write(head + rest if rest else head)
        if mode == _BODY_NONE:
            self._done()
        elif rest:
            self._body(rest)

    def _body(self, data: bytes) -> None:
        mode = self.body_mode
        if mode == _BODY_CHUNKED:
            self._chunked(data)
        elif mode == _BODY_LENGTH:
            n = len(data)
            if n >= self.remaining:
                self._copy(data[: self.remaining] if n > self.remaining else data)
                self.remaining = 0
                self._done()
            else:
                self.remaining -= n
                self._copy(data)
        else:
            self._copy(data)

    def _copy(self, payload: bytes) -> None:
        ctx = self.ctx
        if ctx is None or not payload:
            return
        ctx.seq += 1
        self.tap.queue.put((ctx, ctx.seq, time.monotonic(), payload))
        rw = self.rw
        if rw is not None and self.client is not None and self.client.transport is not None:
            out = rw.feed(payload)
            if out:
                self.client.transport.write(b"%x\r\n%s\r\n" % (len(out), out))

    def _chunked(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            st = self.cstate
            if st == _C_DATA:
                rem = self.remaining
                take = n - i if n - i < rem else rem
                self._copy(data if take == n else data[i : i + take])
                i += take
                self.remaining = rem - take
                if self.remaining == 0:
                    self.cstate = _C_SIZE
                continue
            if st == _C_SIZE and not self.cline:  # fast path: "<hex>\r\n<payload>" as servers send it
                j = data.find(b"\r\n", i)
                if j == i:
                    i += 2  # the CRLF that closes the previous chunk's data
                    continue
                if j > i:
                    try:
                        size = int(data[i:j], 16)
                    except ValueError:
                        size = -1  # extensions, spaces: the general path below
                    if size > 0:
                        i = j + 2
                        end = i + size
                        if end <= n:
                            self._copy(data[i:end])
                            i = end
                        else:
                            self.remaining = size
                            self.cstate = _C_DATA
                        continue
            j = data.find(b"\n", i)
            if j < 0:
                self.cline += data[i:]
                if len(self.cline) > 4096:
                    self._cut()
                return
            line = (self.cline + data[i:j]) if self.cline else data[i:j]
            self.cline = b""
            i = j + 1
            line = line.strip()
            if st == _C_SIZE:
                if not line:
                    continue  # the CRLF that closes the previous chunk's data
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    self._cut()
                    return
                if size == 0:
                    self.cstate = _C_TRAILER
                else:
                    self.remaining = size
                    self.cstate = _C_DATA
            elif st == _C_TRAILER and not line:
                self.cstate = _C_DONE
                self._done()
                return

    def _done(self) -> None:
        client, ctx = self.client, self.ctx
        rw = self.rw
        if rw is not None and client is not None and client.transport is not None:
            rest = rw.flush()
            client.transport.write((b"%x\r\n%s\r\n" % (len(rest), rest) if rest else b"") + b"0\r\n\r\n")
        self.rw = None
        self.client = None
        self.ctx = None
        self.in_body = False
        if ctx is not None:
            self.tap._end(ctx, END_COMPLETE)
        close_client = self.body_mode == _BODY_CLOSE
        if self.paused:
            self.resume()
        if self.reusable and self.usable():
            self.tap._give_back(self)
        else:
            self.close()
        if client is not None:
            client.response_done(close_client)

    def _cut(self) -> None:
        """Protocol error or premature close mid-response: the client sees the same truncation."""
        client, ctx = self.client, self.ctx
        self.client = None
        self.ctx = None
        self.close()
        if ctx is not None:
            self.tap._end(ctx, END_UPSTREAM_CUT)
        if client is not None:
            client.ctx = None
            client.up = None
            client.keep_alive = False
            if client.transport is not None:
                client.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        self.tap._forget(self)
        client, ctx = self.client, self.ctx
        if client is None or ctx is None:
            return
        if self.in_body and self.body_mode == _BODY_CLOSE:
            self._done()
            return
        if not self.got_bytes:
            self.client = None
            self.ctx = None
            if self.reused and not client.closed:
                # a pooled connection the worker had already closed: one fresh attempt, no byte sent yet
                self.tap._spawn(client._connect_and_send(ctx, self.out, self.head_only, self.rewrite))
                return
            self.tap._end(ctx, END_UPSTREAM_ERROR)
            client.ctx = None
            client.up = None
            client._fail(_BAD_GATEWAY)
            return
        self._cut()


def _chunked_end(buf: bytes, start: int) -> int:
    """Index just past a complete chunked body starting at `start`, or -1 if incomplete."""
    i = start
    n = len(buf)
    while True:
        j = buf.find(b"\r\n", i)
        if j < 0:
            return -1
        try:
            size = int(buf[i:j].split(b";", 1)[0].strip(), 16)
        except ValueError:
            return -1
        i = j + 2
        if size == 0:
            while True:  # trailers up to an empty line
                k = buf.find(b"\r\n", i)
                if k < 0:
                    return -1
                if k == i:
                    return k + 2
                i = k + 2
        i += size + 2
        if i > n:
            return -1


def _dechunk(raw: bytes) -> bytes:
    out: list[bytes] = []
    i = 0
    while True:
        j = raw.find(b"\r\n", i)
        if j < 0:
            break
        size = int(raw[i:j].split(b";", 1)[0].strip(), 16)
        if size == 0:
            break
        out.append(raw[j + 2 : j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)
