"""The hand-off between a relay (the data plane) and the analysis attached to it: frames on a socket.

Relay side, `ChannelSink`: the taps call `put`/`put_end` exactly as on a `DropQueue`. Every frame is
also *kept* with its request until the analysis has acknowledged the request's end (bounded by
`retain_bytes` and `retain_ended`; what does not fit is counted), so that an analysis attaching
later — a restart after `kill -9` included — gets a snapshot: a hello, then every kept request's
frames in the order they started (live ones and ended ones not yet acknowledged), a snapshot mark,
then the live frames. Nothing is waited on: frames for the attached analysis go to a bounded
pending buffer written to a non-blocking socket once per loop iteration; when it is full `put`
drops and counts (the analysis sees a seq gap), `put_end` never drops. Without an analysis the
frames are only kept.

Analysis side, `ChannelReader`: `feed(bytes)` decodes frames back into the `(ctx, seq, t, payload)`
items the `Analyzer` consumes, one `TapContext` per request, times moved onto this host's monotonic
clock. It survives re-attaching to the same relay (`relay_id`): a snapshot's frames it has already
seen are skipped, so nothing is counted twice; a new relay (restarted, replaced) first ends every
request still open on the old one (`lost()`, reason `relay_lost`). Marks carry the relay's
counters and answer sync requests, in stream order.

Frame: `<B type><I length><body>`. Data (the hot path) is packed with struct; rare frames (hello,
request info, ends, marks, control) with marshal (only str, bytes, int, float, None, tuples, dicts).
A request's W3C `traceparent` travels in its info frame (`TRACEPARENT_KEY`), for the analysis's spans.
Control frames (analysis → relay): `("hello", {...})`, `("sync", token)`, `("ack", end_no)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import socket
import struct
import time
from collections import deque
from typing import Any

from shadow.mirror.proxy import END_RELAY_LOST, TapContext

_HDR = struct.Struct("<BI")
_DATA = struct.Struct("<BIIId")  # type, length, cid, seq, t   (length counts cid + seq + t + payload)
_DATA_FIXED = _DATA.size - _HDR.size
_START = struct.Struct("<BIId")  # type, length, cid, t
_START_LEN = _START.size - _HDR.size
_SEND_MAX = 256 << 10
T_INFO, T_DATA, T_START, T_END, T_MARK, T_CTL, T_HELLO = 1, 2, 3, 4, 5, 6, 7
MAX_FRAME = 1 << 30
PROTOCOL = 1


def frame(kind: int, obj: Any) -> bytes:
    """One marshal-bodied frame."""
    body = marshal.dumps(obj)
    return _HDR.pack(kind, len(body)) + body


class FrameReader:
    """Splits a byte stream into (kind, body) frames; `feed` returns the complete ones."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[int, bytes]] = []
        pos = 0
        while len(buf) - pos >= _HDR.size:
            kind, length = _HDR.unpack_from(buf, pos)
            if length > self.max_frame:
                raise ValueError(f"frame of {length} bytes")
            if len(buf) - pos - _HDR.size < length:
                break
            body = pos + _HDR.size
            pos = body + length
            out.append((kind, bytes(buf[body:pos])))
        del buf[:pos]
        return out


# The request's traceparent rides in the info frame's header dict under a name no HTTP header can
# have (':' is not a token character): an analysis from before it reads the same ten fields.
TRACEPARENT_KEY = ":traceparent"


def _info(ctx: TapContext) -> tuple[Any, ...]:
    tp = ctx.traceparent
    rh = ctx.resp_headers if tp is None else {**ctx.resp_headers, TRACEPARENT_KEY: tp}
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
        rh,
    )


class ChannelSink:
    """Relay side (see module docstring). `attach(sock, hello)` starts a snapshot to a new analysis,
    `detach()` forgets it; `ack(end_no)` releases kept requests; `mark(token, stats)` sends the
    relay's counters in order."""

    def __init__(
        self,
        maxsize: int = 65536,
        max_bytes: int = 256 << 20,
        *,
        retain_bytes: int = 128 << 20,
        retain_ended: int = 100_000,
    ) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.sock: socket.socket | None = None
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.retain_bytes = retain_bytes
        self.retain_ended = retain_ended
        self._out: deque[list[Any]] = deque()  # [frame bytes, items in it, payload bytes in it]
        self._n = 0  # items pending (not yet handed to the socket)
        self.bytes = 0  # payload bytes pending
        self.offered = 0  # items offered while an analysis was attached (since it attached)
        self.dropped = 0  # of those, refused because the hand-off was full
        self.dropped_total = 0  # refused, over every attach (a counter)
        self.put_total = 0
        self._kept: dict[int, TapContext] = {}  # cid -> request whose frames are kept, in start order
        self._ended: deque[tuple[int, int]] = deque()  # (end_no, cid) of ended kept requests
        self.kept_bytes = 0
        self.unkept = 0  # data frames not kept (retain_bytes full): a later snapshot has a gap there
        self.missed = 0  # ended requests dropped before any analysis acknowledged them
        self.end_no = 0  # ends numbered in the order they happened
        self.acked = 0
        self.attaches = 0
        self.detached_items = 0  # items offered with no analysis attached (kept, not sent)
        self._next_cid = 1
        self._scheduled = False
        self._writing = False  # waiting for the socket to be writable (it was full)
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return self._n

    @property
    def attached(self) -> bool:
        return self.sock is not None

    @property
    def broken(self) -> bool:
        """No analysis to send to (frames are only kept)."""
        return self.sock is None

    @property
    def kept_requests(self) -> int:
        """Requests whose frames are kept (live, or ended and not yet acknowledged)."""
        return len(self._kept)

    @property
    def live(self) -> int:
        """Requests kept and not ended."""
        return len(self._kept) - len(self._ended)

    # -- keeping -----------------------------------------------------------------------------------

    def _keep(self, ctx: TapContext, b: bytes, always: bool) -> None:
        kept = ctx.kept
        if kept is None:
            return
        n = len(b)
        if not always and self.kept_bytes + n > self.retain_bytes:
            self._evict_ended(n)
            if self.kept_bytes + n > self.retain_bytes:
                self.unkept += 1
                return
        kept.append(b)
        ctx.kept_bytes += n
        self.kept_bytes += n

    def _forget(self, cid: int) -> None:
        ctx = self._kept.pop(cid, None)
        if ctx is not None:
            self.kept_bytes -= ctx.kept_bytes
            ctx.kept = None
            ctx.kept_bytes = 0

    def _evict_ended(self, room: int = 0) -> None:
        """Drop the oldest ended requests no analysis acknowledged, past the caps (counted)."""
        ended = self._ended
        while ended and (
            len(ended) > self.retain_ended or (room and self.kept_bytes + room > self.retain_bytes)
        ):
            _, cid = ended.popleft()
            self._forget(cid)
            self.missed += 1

    def ack(self, end_no: int) -> None:
        """The attached analysis has processed (and recorded) every end up to `end_no`."""
        ended = self._ended
        while ended and ended[0][0] <= end_no:
            self._forget(ended.popleft()[1])
        self.acked = max(self.acked, end_no)

    # -- the attached analysis -------------------------------------------------------------------

    def attach(self, sock: socket.socket, hello: dict[str, Any], resume_end: int = 0) -> int:
        """Send to `sock` from now on: a hello, every kept request's frames (those ended at or before
        `resume_end` are skipped: that analysis has them), a snapshot mark. Returns the requests sent."""
        self.detach()
        sock.setblocking(False)
        self.sock = sock
        self.attaches += 1
        self.offered = self.dropped = 0
        self._append(frame(T_HELLO, {**hello, "v": PROTOCOL, "mono": time.monotonic()}))
        sent = 0
        for ctx in self._kept.values():
            if (ctx.end_no and ctx.end_no <= resume_end) or not ctx.kept:
                continue
            self._append(b"".join(ctx.kept))
            sent += 1
        self._append(frame(T_MARK, {"token": 0, "offered": 0, "dropped": 0,
                                    "snapshot": {"requests": sent, "live": self.live, "unkept": self.unkept,
                                                 "missed": self.missed}}))
        return sent

    def detach(self) -> None:
        """Forget the attached analysis (its pending frames too); keeping goes on."""
        sock = self.sock
        if sock is None:
            return
        self._unwatch(sock)
        self.sock = None
        self._out.clear()
        self._n = 0
        self.bytes = 0
        with contextlib.suppress(OSError):
            sock.close()

    # -- frames ------------------------------------------------------------------------------------

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

    def _info_frame(self, ctx: TapContext) -> bytes:
        """The request's static info (and response head once known), ahead of its items."""
        if not ctx.cid:
            ctx.cid = self._next_cid
            self._next_cid += 1
            ctx.kept = []
            self._kept[ctx.cid] = ctx
        ctx.sent = 2 if ctx.status else 1
        b = frame(T_INFO, _info(ctx))
        self._keep(ctx, b, True)
        return b

    def put(self, item: tuple[TapContext, int, float, Any], nbytes: int = 0) -> bool:
        """Keep an item and hand it to the attached analysis; False (and counted) when not sent."""
        self.put_total += 1
        ctx, seq, t, payload = item
        info = self._info_frame(ctx) if ctx.sent < 2 and (ctx.sent == 0 or ctx.status) else None
        if seq == 0:
            b = _START.pack(T_START, _START_LEN, ctx.cid, t)
            self._keep(ctx, b, True)
        else:
            b = _DATA.pack(T_DATA, _DATA_FIXED + len(payload), ctx.cid, seq, t) + payload
            self._keep(ctx, b, False)
        if self.sock is None:
            self.detached_items += 1
            return False
        self.offered += 1
        if self._n >= self.maxsize or self.bytes + nbytes > self.max_bytes:
            self.dropped += 1
            self.dropped_total += 1
            if info is not None:
                self._append(info)
            return False
        if info is not None:
            self._append(info)
        self._append(b, 1, nbytes)
        return True

    def put_end(self, item: tuple[TapContext, int, float, Any]) -> None:
        """Keep and hand over an end marker; never dropped while an analysis is attached."""
        ctx, _, t, reason = item
        info = self._info_frame(ctx) if ctx.sent < 2 and (ctx.sent == 0 or ctx.status) else None
        self.end_no += 1
        ctx.end_no = self.end_no
        b = frame(T_END, (ctx.cid, t, reason, ctx.seq, ctx.end_no))
        self._keep(ctx, b, True)
        self._ended.append((ctx.end_no, ctx.cid))
        self._evict_ended()
        if self.sock is None:
            self.detached_items += 1
            return
        self.offered += 1
        if info is not None:
            self._append(info)
        self._append(b, 1)

    def send(self, kind: int, obj: Any) -> None:
        """A frame outside any request (a mark, a notice) to the attached analysis, if any."""
        if self.sock is not None:
            self._append(frame(kind, obj))

    def send_notice(self, notice: dict[str, Any]) -> None:
        """Tell the attached analysis something about this relay (draining, replaced), in order."""
        self.send(T_MARK, {"token": 0, "offered": self.offered, "dropped": self.dropped, "notice": notice})

    def mark(self, token: int, stats: dict[str, Any]) -> None:
        """A mark frame: the counters now, in stream order after everything offered before it."""
        self.send(T_MARK, {"token": token, "offered": self.offered, "dropped": self.dropped, **stats})

    def flush(self) -> None:
        """Write what is pending without blocking (at most 256 KB per send); when the socket is
        full, the rest waits for it to be writable; a broken socket detaches the analysis."""
        self._scheduled = False
        out = self._out
        sock = self.sock
        if sock is None:
            out.clear()
            return
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
                n = sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self.detach()
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
                    loop.add_writer(sock.fileno(), self.flush)
                return
        self._unwatch(sock)

    def _unwatch(self, sock: socket.socket) -> None:
        """Stop waiting for `sock` to be writable (when waiting)."""
        if self._writing and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(sock.fileno())
        self._writing = False

    def close(self, timeout_s: float = 5.0) -> None:
        """Last words: write everything pending (blocking, up to `timeout_s`), then close."""
        sock = self.sock
        if sock is None:
            return
        self._unwatch(sock)
        with contextlib.suppress(OSError):
            sock.settimeout(timeout_s)
            for e in self._out:
                sock.sendall(e[0])
        self._out.clear()
        self.sock = None
        with contextlib.suppress(OSError):
            sock.close()


class ChannelReader:
    """Analysis side (see module docstring). `feed(data)` returns the decoded items; marks update
    `offered`, `dropped`, `stats` and `token` (the last sync answered); `hello` is the relay's."""

    def __init__(self, boot_id: str = "", oldest_s: float | None = None) -> None:
        self._frames = FrameReader()
        # a snapshot's times older than this (s before now) are raised to it, so that an old
        # request's start is not dropped as out of bounds by the mirror (`clamped` counts them)
        self.oldest_s = oldest_s
        self.clamped = 0
        self._ctxs: dict[int, TapContext] = {}
        self.boot_id = boot_id  # this host's: a relay on the same kernel shares its monotonic clock
        self.offered = 0
        self.dropped = 0
        self.received = 0
        self.token = 0
        self.marks = 0
        self.eof = False  # set by the owner when the relay closed the stream
        self.stats: dict[str, Any] = {}
        self.hello: dict[str, Any] = {}
        self.peer_host = "127.0.0.1"  # the host the relay was reached at (its owner sets it)
        self.relay_id = ""
        self.offset = 0.0  # added to the relay's times to put them on this host's clock
        self.end_seen = 0  # highest end number processed
        self.snapshot_done = False
        self.snapshot: dict[str, Any] = {}
        self.skipped = 0  # frames a re-attach delivered again (already seen, not counted twice)
        self.notices: list[dict[str, Any]] = []  # relay notices (draining, replaced) not yet handled
        self.processed = 0  # items of this reader the analysis consumed (its owner counts them)
        self.lost_total = 0  # requests ended as relay_lost (their relay died or stayed unreachable)
        self._base_offered = 0  # offered/dropped of earlier attaches (a relay counts per attach)
        self._base_dropped = 0

    def __len__(self) -> int:
        return len(self._ctxs)

    @property
    def offered_total(self) -> int:
        return self._base_offered + self.offered

    @property
    def dropped_total(self) -> int:
        return self._base_dropped + self.dropped

    def _ctx(self, cid: int) -> TapContext:
        ctx = self._ctxs.get(cid)
        if ctx is None:  # cannot happen (info precedes items); an empty context keeps order
            ctx = self._ctxs[cid] = TapContext("", "", "", None, None, 0, 0.0)
        return ctx

    def _at(self, t: float, floor: float) -> float:
        if t < floor:
            self.clamped += 1
            return floor
        return t

    def lost(self, t: float) -> list[tuple[TapContext, int, float, Any]]:
        """End items (`relay_lost`) for every request still open: its relay is gone."""
        items: list[tuple[TapContext, int, float, Any]] = []
        for ctx in self._ctxs.values():
            ctx.ended = True
            items.append((ctx, -1, t, END_RELAY_LOST))
        self._ctxs.clear()
        self.received += len(items)
        self.lost_total += len(items)
        return items

    def _on_hello(self, h: dict[str, Any]) -> list[tuple[TapContext, int, float, Any]]:
        """A (re)attach: the same relay keeps what was seen; another one ends what was open."""
        items: list[tuple[TapContext, int, float, Any]] = []
        rid = str(h.get("relay_id", ""))
        if rid != self.relay_id:
            items = self.lost(time.monotonic())
            self.end_seen = 0
            self.relay_id = rid
        self.hello = h
        same_clock = bool(self.boot_id) and h.get("boot_id") == self.boot_id
        self.offset = 0.0 if same_clock else time.monotonic() - float(h.get("mono", time.monotonic()))
        self.snapshot_done = False
        self._base_offered += self.offered
        self._base_dropped += self.dropped
        self.offered = self.dropped = 0
        return items

    def feed(self, data: bytes) -> list[tuple[TapContext, int, float, Any]]:
        items: list[tuple[TapContext, int, float, Any]] = []
        off = self.offset
        floor = -1e300 if self.snapshot_done or self.oldest_s is None else time.monotonic() - self.oldest_s
        for kind, body in self._frames.feed(data):
            if kind == T_DATA:
                cid, seq, t = struct.unpack_from("<IId", body)
                ctx = self._ctx(cid)
                if seq <= ctx.seq:
                    self.skipped += 1  # a snapshot re-delivered what this reader has
                    continue
                ctx.seq = seq
                items.append((ctx, seq, self._at(t + off, floor), body[_DATA_FIXED:]))
            elif kind == T_START:
                cid, t = struct.unpack_from("<Id", body)
                ctx = self._ctx(cid)
                if ctx.announced:
                    self.skipped += 1
                    continue
                ctx.announced = True
                items.append((ctx, 0, self._at(t + off, floor), None))
            elif kind == T_INFO:
                (cid, tap, method, path, rid, rbody, blen, t0, status, rh) = marshal.loads(body)
                tp = rh.pop(TRACEPARENT_KEY, None)
                known = self._ctxs.get(cid)
                if known is None:
                    known = self._ctxs[cid] = TapContext(tap, method, path, rid, rbody, blen,
                                                         self._at(t0 + off, floor),
                                                         tp if isinstance(tp, str) else None)
                known.status = status
                known.resp_headers = rh
            elif kind == T_END:
                cid, t, reason, seq, end_no = marshal.loads(body)
                if end_no <= self.end_seen and cid not in self._ctxs:
                    self.skipped += 1
                    continue
                ctx = self._ctxs.pop(cid, None) or TapContext("", "", "", None, None, 0, 0.0)  # type: ignore[arg-type]
                ctx.seq = max(ctx.seq, seq)
                ctx.ended = True
                self.end_seen = max(self.end_seen, end_no)
                items.append((ctx, -1, self._at(t + off, floor), reason))
            elif kind == T_MARK:
                m = marshal.loads(body)
                self.offered = m.pop("offered")
                self.dropped = m.pop("dropped")
                self.token = max(self.token, m.pop("token"))
                self.marks += 1
                snap = m.pop("snapshot", None)
                if snap is not None:
                    self.snapshot_done = True
                    self.snapshot = snap
                    floor = -1e300
                notice = m.pop("notice", None)
                if notice is not None:
                    self.notices.append(notice)
                if m:
                    self.stats = m
            elif kind == T_HELLO:
                items += self._on_hello(marshal.loads(body))
                off = self.offset
                if self.oldest_s is not None:
                    floor = time.monotonic() - self.oldest_s
            else:
                raise ValueError(f"unknown channel frame type {kind}")
        self.received += len(items)
        return items
