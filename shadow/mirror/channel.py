"""The hand-off between a relay process and the analysis process: a stream of frames on a socket.

Relay side, `ChannelSink`: the taps call `put`/`put_end` exactly as on a `DropQueue`. Frames are
appended to a bounded pending buffer and written to a non-blocking socket once per loop iteration;
the socket's buffer plus `maxsize` items / `max_bytes` bytes pending bound the hand-off. When full,
`put` drops and counts (the analysis sees a seq gap), `put_end` never drops (at most one per
request). The relay never waits on the analysis: nothing here blocks.

Analysis side, `ChannelReader`: `feed(bytes)` decodes frames back into the `(ctx, seq, t, payload)`
items the `Analyzer` consumes, with one analysis-side `TapContext` per request; mark frames carry
the relay's counters (`offered`, `dropped`, per-tap stats) and answer sync requests, in stream
order, so `offered == processed + dropped` holds at every answered mark.

Frame: `<B type><I length><body>`. Data (the hot path) is packed with struct; rare frames (request
info, ends, marks, control) with marshal (only str, bytes, int, float, None, tuples, dicts).
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import socket
import struct
from collections import deque
from typing import Any

from shadow.mirror.proxy import TapContext

_HDR = struct.Struct("<BI")
_DATA = struct.Struct("<BIIId")  # type, length, cid, seq, t   (length counts cid + seq + t + payload)
_DATA_FIXED = _DATA.size - _HDR.size
_START = struct.Struct("<BIId")  # type, length, cid, t
_START_LEN = _START.size - _HDR.size
_SEND_MAX = 256 << 10
T_INFO, T_DATA, T_START, T_END, T_MARK, T_CTL = 1, 2, 3, 4, 5, 6
MAX_FRAME = 1 << 30


def frame(kind: int, obj: Any) -> bytes:
    """One marshal-bodied frame."""
    body = marshal.dumps(obj)
    return _HDR.pack(kind, len(body)) + body


def _info(ctx: TapContext) -> tuple[Any, ...]:
    return (
        ctx.cid,
        ctx.tap,
        ctx.method,
        ctx.path,
        ctx.request_id,
        ctx.body,
        ctx.body_len,
        ctx.t_start,
        ctx.status,
        ctx.resp_headers,
    )


class ChannelSink:
    """Relay side (see module docstring). `mark(token, stats)` sends the relay's counters in order."""

    def __init__(self, sock: socket.socket, maxsize: int = 65536, max_bytes: int = 256 << 20) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        sock.setblocking(False)
        self.sock = sock
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._out: deque[list[Any]] = deque()  # [frame bytes, items in it, payload bytes in it]
        self._n = 0  # items pending (not yet handed to the socket)
        self.bytes = 0  # payload bytes pending
        self.offered = 0
        self.dropped = 0
        self.put_total = 0
        self.broken = False  # the analysis side is gone: everything is dropped
        self._next_cid = 1
        self._scheduled = False
        self._writing = False  # waiting for the socket to be writable (it was full)
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return self._n

    def _append(self, b: bytes, items: int = 0, nbytes: int = 0) -> None:
        self._out.append([b, items, nbytes])
        self._n += items
        self.bytes += nbytes
        if not self._scheduled and not self._writing:
            self._scheduled = True
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self.flush)  # once per loop iteration, whatever was put in it

    def _ship_info(self, ctx: TapContext) -> None:
        """Send the request's static info (and response head once known) ahead of its items."""
        if not ctx.cid:
            ctx.cid = self._next_cid
            self._next_cid += 1
        ctx.sent = 2 if ctx.status else 1
        self._append(frame(T_INFO, _info(ctx)))

    def put(self, item: tuple[TapContext, int, float, Any], nbytes: int = 0) -> bool:
        """Hand an item over; False (and counted) when the hand-off is full."""
        self.offered += 1
        self.put_total += 1
        if self._n >= self.maxsize or self.bytes + nbytes > self.max_bytes or self.broken:
            self.dropped += 1
            return False
        ctx, seq, t, payload = item
        if ctx.sent < 2 and (ctx.sent == 0 or ctx.status):
            self._ship_info(ctx)
        if seq == 0:
            self._append(_START.pack(T_START, _START_LEN, ctx.cid, t), 1)
        else:
            self._append(_DATA.pack(T_DATA, _DATA_FIXED + len(payload), ctx.cid, seq, t) + payload, 1, nbytes)
        return True

    def put_end(self, item: tuple[TapContext, int, float, Any]) -> None:
        """Hand an end marker over; never dropped (unless the analysis side is gone)."""
        self.offered += 1
        if self.broken:
            self.dropped += 1
            return
        ctx, _, t, reason = item
        if ctx.sent < 2 and (ctx.sent == 0 or ctx.status):
            self._ship_info(ctx)
        self._append(frame(T_END, (ctx.cid, t, reason, ctx.seq)), 1)

    def mark(self, token: int, stats: dict[str, Any]) -> None:
        """A mark frame: the counters now, in stream order after everything offered before it."""
        self._append(
            frame(T_MARK, {"token": token, "offered": self.offered, "dropped": self.dropped, **stats})
        )

    def flush(self) -> None:
        """Write what is pending without blocking (at most 256 KB per send); when the socket is
        full, the rest waits for it to be writable."""
        self._scheduled = False
        out = self._out
        while out:
            take: list[bytes] = []
            size = 0
            for e in out:
                take.append(e[0])
                size += len(e[0])
                if size >= _SEND_MAX:
                    break
            data = b"".join(take) if len(take) > 1 else take[0]
            try:
                n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._break()
                return
            full = n < len(data)
            while n > 0:  # retire what went out
                e = out[0]
                size = len(e[0])
                if n >= size:
                    out.popleft()
                    self._n -= e[1]
                    self.bytes -= e[2]
                    n -= size
                else:
                    e[0] = e[0][n:]
                    n = 0
            if full:
                if not self._writing:
                    self._writing = True
                    loop = self._loop or asyncio.get_running_loop()
                    self._loop = loop
                    loop.add_writer(self.sock.fileno(), self.flush)
                return
        if self._writing:
            self._writing = False
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_writer(self.sock.fileno())

    def close(self, timeout_s: float = 5.0) -> None:
        """Last words: write everything pending (blocking, up to `timeout_s`), then close."""
        if self._writing and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self.sock.fileno())
        self._writing = False
        with contextlib.suppress(OSError):
            self.sock.settimeout(timeout_s)
            for e in self._out:
                self.sock.sendall(e[0])
        self._out.clear()
        self.sock.close()

    def _break(self) -> None:
        self.broken = True
        self.dropped += self._n
        self._out.clear()
        self._n = 0
        self.bytes = 0
        if self._writing and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self.sock.fileno())
        self._writing = False


class ChannelReader:
    """Analysis side (see module docstring). `feed(data)` returns the decoded items; marks update
    `offered`, `dropped`, `stats` and `token` (the last sync answered)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._ctxs: dict[int, TapContext] = {}
        self.offered = 0
        self.dropped = 0
        self.received = 0
        self.token = 0
        self.marks = 0
        self.eof = False  # set by the owner when the relay closed the stream
        self.stats: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._ctxs)

    def _ctx(self, cid: int) -> TapContext:
        ctx = self._ctxs.get(cid)
        if ctx is None:  # cannot happen (info precedes items); an empty context keeps order
            ctx = self._ctxs[cid] = TapContext("", "", "", None, None, 0, 0.0)
        return ctx

    def feed(self, data: bytes) -> list[tuple[TapContext, int, float, Any]]:
        buf = self._buf
        buf += data
        items: list[tuple[TapContext, int, float, Any]] = []
        pos = 0
        end = len(buf)
        hdr = _HDR.size
        while end - pos >= hdr:
            kind, length = _HDR.unpack_from(buf, pos)
            if length > MAX_FRAME:
                raise ValueError(f"channel frame of {length} bytes")
            if end - pos - hdr < length:
                break
            body = pos + hdr
            pos = body + length
            if kind == T_DATA:
                cid, seq, t = struct.unpack_from("<IId", buf, body)
                ctx = self._ctx(cid)
                ctx.seq = seq
                items.append((ctx, seq, t, bytes(buf[body + _DATA_FIXED : pos])))
            elif kind == T_START:
                cid, t = struct.unpack_from("<Id", buf, body)  # _START without its header
                items.append((self._ctx(cid), 0, t, None))
            elif kind == T_INFO:
                (cid, tap, method, path, rid, rbody, blen, t0, status, rh) = marshal.loads(buf[body:pos])
                known = self._ctxs.get(cid)
                if known is None:
                    known = self._ctxs[cid] = TapContext(tap, method, path, rid, rbody, blen, t0)
                ctx = known
                ctx.status = status
                ctx.resp_headers = rh
            elif kind == T_END:
                cid, t, reason, seq = marshal.loads(buf[body:pos])
                ctx = self._ctxs.pop(cid, None) or TapContext("", "", "", None, None, 0, 0.0)  # type: ignore[arg-type]
                ctx.seq = seq
                ctx.ended = True
                items.append((ctx, -1, t, reason))
            elif kind == T_MARK:
                m = marshal.loads(buf[body:pos])
                self.offered = m.pop("offered")
                self.dropped = m.pop("dropped")
                self.token = max(self.token, m.pop("token"))
                self.marks += 1
                self.stats = m
            else:
                raise ValueError(f"unknown channel frame type {kind}")
        del buf[:pos]
        self.received += len(items)
        return items
