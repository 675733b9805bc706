"""The hand-off between a relay (the data plane) and the analysis attached to it: frames on a socket
(their layout and decoders: `shadow.contracts.frames`; the connection's authentication before any
frame: `shadow.contracts.handshake`).

Relay side, `ChannelSink`: the taps call `put`/`put_end` exactly as on a `DropQueue`. Every frame is
also *kept* with its request until the analysis has acknowledged the request's end (bounded by
`retain_bytes` and `retain_ended`; what does not fit is counted), so that an analysis attaching
later — a restart after `kill -9` included — gets a snapshot: a hello, then every kept request's
frames in the order they started (live ones and ended ones not yet acknowledged), a snapshot mark,
then the live frames. Several analyses may attach at once, each under its name (replicas of
`shadow serve` behind the same taps): each gets every frame, and an ended request is kept until
every attached analysis has acknowledged it; an analysis attaching under a name already attached
replaces that one. Nothing is waited on: frames for each analysis go to its own pending buffer,
written to a non-blocking socket once per loop iteration.

Memory. Kept copies: at most `retain_bytes`, plus the heads (info frames) of the requests in
flight. Pending copies: `max_bytes` in all, shared equally by the attached analyses; a data frame
beyond an analysis's share is dropped for it and counted (it sees a seq gap); heads, ends and marks
are never dropped, but an analysis whose pending bytes pass its share plus another share (or plus
the largest request head, `frame_bound(max_body)`, when that is more) is detached at once
(`overflow`), and one that has taken nothing from its socket for `stall_s` while its share was full
is detached (`stalled`): what was pending for it is released, and what it had not acknowledged
stays kept for its return. A snapshot is not copied: it refers to the kept frames, joined one
request at a time as the socket takes them. Without an analysis the frames are only kept.

The analysis's side, `ChannelReader`, is `shadow.mirror.channel_reader`.

A request's W3C `traceparent` travels in its info frame, for the analysis's spans. Control frames
(analysis → relay): hello (name, resume), sync (token), ack (end number).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from shadow.contracts.frames import (
    DATA,
    DATA_FIXED,
    DEFAULT_MAX_BODY,
    FIELD_MAX,
    START,
    START_LEN,
    T_DATA,
    T_HELLO,
    T_MARK,
    T_START,
    Info,
    clamp,
    encode,
    encode_end,
    encode_info,
    frame_bound,
)
from shadow.contracts.handshake import VERSION
from shadow.contracts.tapwire import TapContext

_SEND_MAX = 256 << 10
GONE_GRACE_S = 60.0  # what a detached analysis had not acknowledged is kept this long for its return
#: An analysis whose share of the pending bytes is full and whose socket has taken nothing for this
#: long is detached (it stopped reading: its pending copies are released).
STALL_S = 15.0
#: why an analysis was detached (shadow_tap_analysis_detached_total's reasons)
DETACH_REASONS = ("closed", "replaced", "stalled", "overflow", "bad_frame")
TRIM_AFTER_BYTES = 1 << 20  # a detached analysis with this much pending: the heap is trimmed


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`, which runs without
    the GIL; elsewhere nothing). Without it the memory of a detached analysis's pending copies,
    freed, stays in the process (seen: 190 -> 320 MiB with 8 analyses that never read, still 320
    MiB after they left)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _info(ctx: TapContext) -> tuple[Info, bool]:
    """The request's head as sent (strings clamped to FIELD_MAX), and whether one was. (The
    response headers' names are the tap's own: content-type, content-length, transfer-encoding.)"""
    rid, tp, rh = ctx.request_id, ctx.traceparent, ctx.resp_headers
    if max(len(ctx.tap), len(ctx.method), len(ctx.path), len(rid or ""), len(tp or ""),
           max(map(len, rh.values()), default=0)) <= FIELD_MAX:
        return Info(ctx.cid, ctx.tap, ctx.method, ctx.path, rid, ctx.body, ctx.body_len, ctx.t_start,
                    ctx.status, rh, tp), False
    return Info(ctx.cid, clamp(ctx.tap), clamp(ctx.method), clamp(ctx.path),
                None if rid is None else clamp(rid), ctx.body, ctx.body_len, ctx.t_start, ctx.status,
                {k: clamp(v) for k, v in rh.items()}, None if tp is None else clamp(tp)), True


class _Analysis:
    """One attached analysis: its socket, the frames pending for it (`out`: [frame bytes, items in
    it, bytes counted]; a snapshot's request: [its kept frames, -1, how many]), what was offered to
    and dropped for it since it attached, the last end it acknowledged, since when its share has
    been full and when its socket last took bytes."""

    __slots__ = ("acked", "bytes", "dropped", "full_since", "n", "name", "offered", "out", "overflowing",
                 "scheduled", "sent_at", "sock", "writing")

    def __init__(self, name: str, sock: socket.socket, acked: int) -> None:
        self.name = name
        self.sock = sock
        self.out: deque[list[Any]] = deque()
        self.n = 0  # items pending (not yet handed to the socket)
        self.bytes = 0  # bytes pending (a snapshot's excepted: they are the kept copies)
        self.offered = 0
        self.dropped = 0
        self.acked = acked
        self.scheduled = False
        self.writing = False  # waiting for the socket to be writable (it was full)
        self.full_since: float | None = None  # a copy was dropped for it, and it has not drained since
        self.sent_at = time.monotonic()
        self.overflowing = False  # to be detached: past twice its share


def _frames_of(e: list[Any]) -> bytes:
    """A pending entry's bytes (a snapshot's request joined now: [its frames, -1, how many])."""
    if e[1] < 0:
        e[0] = b"".join(e[0][: e[2]])
        e[1] = e[2] = 0
    return e[0]  # type: ignore[no-any-return]


class ChannelSink:
    """Relay side (see module docstring). `attach(sock, hello, name=...)` starts a snapshot to an
    analysis (one of that name is replaced; others go on), `detach(name, reason)` forgets one;
    `ack(end_no, name)` releases kept requests every attached analysis has; `mark(token, stats)`
    sends the relay's counters in order; `reap()` detaches the analyses that stopped reading."""

    def __init__(
        self,
        maxsize: int = 65536,
        max_bytes: int = 256 << 20,
        *,
        retain_bytes: int = 128 << 20,
        retain_ended: int = 100_000,
        max_body: int = DEFAULT_MAX_BODY,
        stall_s: float = STALL_S,
    ) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize  # items pending per analysis
        self.max_bytes = max_bytes  # bytes pending, over every analysis
        self._share = self._limit = 0  # each analysis's part of it; pending past the limit detaches it
        self.retain_bytes = retain_bytes
        self.retain_ended = retain_ended
        self.max_body = max_body  # told in the hello: the analysis's frame bound must hold it
        self.stall_s = stall_s
        self._subs: dict[str, _Analysis] = {}  # attached analyses by name
        self._gone: dict[str, tuple[int, float]] = {}  # detached ones: (acked, when), for GONE_GRACE_S
        self.dropped_total = 0  # refused because an analysis's hand-off was full (a counter)
        self.put_total = 0
        self._kept: dict[int, TapContext] = {}  # cid -> request whose frames are kept, in start order
        self._ended: deque[tuple[int, int]] = deque()  # (end_no, cid) of ended kept requests
        self.kept_bytes = 0
        self.unkept = 0  # data frames not kept (retain_bytes full): a later snapshot has a gap there
        self.missed = 0  # ended requests dropped before every analysis acknowledged them
        self.clamped = 0  # request heads sent with a string cut to FIELD_MAX
        self.end_no = 0  # ends numbered in the order they happened
        self.acked = 0
        self.attaches = 0
        self.detached = dict.fromkeys(DETACH_REASONS, 0)  # analyses detached, by why
        self.detached_items = 0  # items offered with no analysis attached (kept, not sent)
        self._next_cid = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        # told (name, socket) when an analysis is detached, before its socket is closed: whoever
        # watches that socket for control frames stops watching it first
        self.on_detach: Callable[[str, socket.socket], None] | None = None
        self._shares()

    def __len__(self) -> int:
        return sum(a.n for a in self._subs.values())

    @property
    def pending_bytes(self) -> int:
        """Bytes pending, over every attached analysis (snapshots excepted)."""
        return sum(a.bytes for a in self._subs.values())

    @property
    def attached(self) -> int:
        """Analyses attached now."""
        return len(self._subs)

    @property
    def analyses(self) -> list[str]:
        """Names of the attached analyses."""
        return list(self._subs)

    def sock(self, name: str) -> socket.socket | None:
        """The socket analysis `name` is attached on, if it is."""
        sub = self._subs.get(name)
        return sub.sock if sub is not None else None

    @property
    def broken(self) -> bool:
        """No analysis to send to (frames are only kept)."""
        return not self._subs

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
        """Drop the oldest ended requests not yet acknowledged by all, past the caps (counted)."""
        ended = self._ended
        while ended and (len(ended) > self.retain_ended or self.kept_bytes + room > self.retain_bytes):
            _, cid = ended.popleft()
            self._forget(cid)
            self.missed += 1

    def ack(self, end_no: int, name: str | None = None) -> None:
        """Analysis `name` has processed (and recorded) every end up to `end_no`; what every attached
        analysis has is released (with none attached, or no name: up to `end_no`)."""
        if name is None:
            self._release(end_no)
            return
        sub = self._subs.get(name)
        if sub is not None:
            sub.acked = max(sub.acked, end_no)
        self._release()

    def _release(self, upto: int | None = None) -> None:
        if upto is None:
            if not self._subs:
                return
            now = time.monotonic()
            for name, (_, when) in list(self._gone.items()):
                if now - when > GONE_GRACE_S:
                    del self._gone[name]
            upto = min([a.acked for a in self._subs.values()] + [a for a, _ in self._gone.values()])
        ended = self._ended
        while ended and ended[0][0] <= upto:
            self._forget(ended.popleft()[1])
        self.acked = max(self.acked, upto)

    # -- the attached analyses -------------------------------------------------------------------

    def attach(self, sock: socket.socket, hello: dict[str, Any], resume_end: int = 0, name: str = "") -> int:
        """Send to `sock` from now on as analysis `name` (replacing one of that name): a hello, every
        kept request's frames (those ended at or before `resume_end` are skipped: that analysis has
        them), a snapshot mark. Returns the requests sent."""
        self.detach(name, "replaced")
        self._gone.pop(name, None)
        sock.setblocking(False)
        sub = self._subs[name] = _Analysis(name, sock, resume_end)
        self._shares()
        self.attaches += 1
        mono = time.monotonic()
        self._append(sub, encode(T_HELLO, {**hello, "v": VERSION, "mono": mono, "max_body": self.max_body}))
        sent = 0
        for ctx in self._kept.values():
            if (ctx.end_no and ctx.end_no <= resume_end) or not ctx.kept:
                continue
            sub.out.append([ctx.kept, -1, len(ctx.kept)])  # (not a copy: joined when written)
            sent += 1
        snap = {"requests": sent, "live": self.live, "unkept": self.unkept, "missed": self.missed}
        self._append(sub, encode(T_MARK, {"token": 0, "offered": 0, "dropped": 0, "snapshot": snap}))
        return sent

    def detach(self, name: str | None = None, reason: str = "closed") -> None:
        """Forget analysis `name` (every one when None) and its pending frames, counted under
        `reason` (their memory goes back to the system: `trim_heap`); keeping goes on. What it had
        not acknowledged stays kept for its return (up to GONE_GRACE_S, within the caps)."""
        freed = 0
        for sub in self._to(name):
            self._unwatch(sub)
            del self._subs[sub.name]
            self.detached[reason] += 1
            self._gone[sub.name] = (sub.acked, time.monotonic())
            freed += sub.bytes
            sub.out.clear()
            sub.n = sub.bytes = 0
            if self.on_detach is not None:
                self.on_detach(sub.name, sub.sock)
            with contextlib.suppress(OSError):
                sub.sock.close()
        self._shares()
        self._release()
        if freed >= TRIM_AFTER_BYTES:  # (off the loop: it takes ~30 ms on a 400 MB heap)
            loop = self._loop
            if loop is not None and loop.is_running():
                loop.run_in_executor(None, trim_heap)
            else:
                trim_heap()

    def _shares(self) -> None:
        """Each attached analysis's share of `max_bytes`, and the pending bytes that detach one."""
        share = self._share = self.max_bytes // max(1, len(self._subs))
        self._limit = share + max(share, frame_bound(self.max_body))

    def reap(self, now: float | None = None) -> list[str]:
        """Detach the analyses that stopped reading: their share full, nothing taken from their
        socket for `stall_s`. Returns their names."""
        now = time.monotonic() if now is None else now
        stalled = [a.name for a in self._subs.values() if a.full_since is not None
                   and now - max(a.full_since, a.sent_at) > self.stall_s]
        for name in stalled:
            self.detach(name, "stalled")
        return stalled

    def _overflow(self, sub: _Analysis) -> None:
        if self._subs.get(sub.name) is sub:
            self.detach(sub.name, "overflow")

    # -- frames ------------------------------------------------------------------------------------

    def _append(self, sub: _Analysis, b: bytes, items: int = 0) -> None:
        """Pending for `sub` (whatever its share: the callers that may drop have checked it)."""
        n = len(b)
        sub.out.append([b, items, n])
        sub.n += items
        sub.bytes += n
        if not sub.scheduled and not sub.writing:
            sub.scheduled = True
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._flush, sub)  # once per loop iteration, whatever was put in it
        if sub.bytes > self._limit and not sub.overflowing:  # (only heads, ends and marks get there)
            sub.overflowing = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._overflow, sub)

    def _info_frame(self, ctx: TapContext) -> bytes:
        """The request's static info (and response head once known), ahead of its items."""
        if not ctx.cid:
            ctx.cid = self._next_cid
            self._next_cid += 1
            ctx.kept = []
            self._kept[ctx.cid] = ctx
        ctx.sent = 2 if ctx.status else 1
        info, clamped = _info(ctx)
        self.clamped += clamped
        b = encode_info(info)
        self._keep(ctx, b, True)
        return b

    def put(self, item: tuple[TapContext, int, float, Any], nbytes: int = 0) -> bool:
        """Keep an item and hand it to every attached analysis; False when one (or none) got it, each
        refusal counted. (`nbytes`, the payload's size, is the `DropQueue` interface's: the sink
        counts whole frames.)"""
        self.put_total += 1
        ctx, seq, t, payload = item
        info = self._info_frame(ctx) if ctx.sent < 2 and (ctx.sent == 0 or ctx.status) else None
        if seq == 0:
            b = START.pack(T_START, START_LEN, ctx.cid, t)
            self._keep(ctx, b, True)
        else:
            b = DATA.pack(T_DATA, DATA_FIXED + len(payload), ctx.cid, seq, t) + payload
            self._keep(ctx, b, False)
        subs = self._subs
        if not subs:
            self.detached_items += 1
            return False
        ok = True
        size = len(b)
        share = self._share
        for sub in subs.values():
            sub.offered += 1
            if info is not None:
                self._append(sub, info)
            if sub.n >= self.maxsize or sub.bytes + size > share:
                sub.dropped += 1
                self.dropped_total += 1
                if sub.full_since is None:
                    sub.full_since = time.monotonic()
                ok = False
            else:
                self._append(sub, b, 1)
        return ok

    def put_end(self, item: tuple[TapContext, int, float, Any]) -> None:
        """Keep and hand over an end marker; never dropped while an analysis is attached."""
        ctx, _, t, reason = item
        info = self._info_frame(ctx) if ctx.sent < 2 and (ctx.sent == 0 or ctx.status) else None
        self.end_no += 1
        ctx.end_no = self.end_no
        b = encode_end(ctx.cid, t, reason, ctx.seq, ctx.end_no)
        self._keep(ctx, b, True)
        self._ended.append((ctx.end_no, ctx.cid))
        self._evict_ended()
        if not self._subs:
            self.detached_items += 1
            return
        for sub in self._subs.values():
            sub.offered += 1
            if info is not None:
                self._append(sub, info)
            self._append(sub, b, 1)

    def _to(self, name: str | None) -> list[_Analysis]:
        """Analysis `name` (none when it is not attached), or every one when None."""
        if name is None:
            return list(self._subs.values())
        sub = self._subs.get(name)
        return [] if sub is None else [sub]

    def send_notice(self, notice: dict[str, Any], to: str | None = None) -> None:
        """Tell the attached analyses (or `to`) something about this relay (draining, replaced), in order."""
        for sub in self._to(to):
            self._mark(sub, 0, {"notice": notice})

    def mark(self, token: int, stats: dict[str, Any], to: str | None = None) -> None:
        """A mark frame: the counters now (the analysis's own hand-off: offered, dropped, pending
        bytes), in stream order after everything offered before it (to analysis `to` only: the
        answer to its sync)."""
        for sub in self._to(to):
            self._mark(sub, token, {**stats, "pending_bytes": sub.bytes})

    def _mark(self, sub: _Analysis, token: int, body: dict[str, Any]) -> None:
        head = {"token": token, "offered": sub.offered, "dropped": sub.dropped}
        self._append(sub, encode(T_MARK, {**head, **body}))

    def flush(self, name: str | None = None) -> None:
        """Write what is pending to analysis `name`, or to every one (see `_flush`)."""
        for sub in self._to(name):
            self._flush(sub)

    def _flush(self, sub: _Analysis) -> None:
        """Write what is pending without blocking (at most 256 KB per send); when the socket is
        full, the rest waits for it to be writable; a broken socket detaches the analysis."""
        sub.scheduled = False
        if self._subs.get(sub.name) is not sub:
            return  # detached or replaced meanwhile
        out = sub.out
        sock = sub.sock
        while out:
            take: list[bytes] = []
            size = 0
            for e in out:
                b = e[0] if e[1] >= 0 else _frames_of(e)
                take.append(b)
                size += len(b)
                if size >= _SEND_MAX:
                    break
            data = b"".join(take) if len(take) > 1 else take[0]
            try:
                n = sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self.detach(sub.name)
                return
            full = n < len(data)
            if n:
                sub.sent_at = time.monotonic()
            while n > 0:  # retire what went out
                e = out[0]
                size = len(e[0])
                if n >= size:
                    out.popleft()
                    sub.n -= e[1]
                    sub.bytes -= e[2]
                    n -= size
                else:
                    e[0] = e[0][n:]
                    n = 0
            if sub.full_since is not None and sub.bytes <= self._share // 2 and sub.n <= self.maxsize // 2:
                sub.full_since = None  # it drained: no longer full
            if full:
                if not sub.writing:
                    sub.writing = True
                    loop = self._loop or asyncio.get_running_loop()
                    self._loop = loop
                    loop.add_writer(sock.fileno(), self._flush, sub)
                return
        self._unwatch(sub)

    def _unwatch(self, sub: _Analysis) -> None:
        """Stop waiting for `sub`'s socket to be writable (when waiting)."""
        if sub.writing and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(sub.sock.fileno())
        sub.writing = False

    def close(self, timeout_s: float = 5.0) -> None:
        """Last words: write everything pending to each analysis (blocking, up to `timeout_s`
        each), then close."""
        for sub in list(self._subs.values()):
            self._unwatch(sub)
            with contextlib.suppress(OSError):
                sub.sock.settimeout(timeout_s)
                for e in sub.out:
                    sub.sock.sendall(_frames_of(e))
            sub.out.clear()
            with contextlib.suppress(OSError):
                sub.sock.close()
        self._subs.clear()
