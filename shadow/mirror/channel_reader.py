"""The analysis's end of the attach channel (the relay's end: `shadow.dataplane.channel.ChannelSink`;
the frames: `shadow.contracts.frames`).

`ChannelReader`: `feed(bytes)` decodes frames back into the `(ctx, seq, t, payload)`
items the `Analyzer` consumes, one `TapContext` per request, times moved onto this host's monotonic
clock. It survives re-attaching to the same relay (`relay_id`): a snapshot's frames it has already
seen are skipped, so nothing is counted twice; a new relay (restarted, replaced) first ends every
request still open on the old one (`lost()`, reason `relay_lost`). Marks carry the relay's
counters and answer sync requests, in stream order. A malformed frame raises `FrameError`, and
nothing else escapes `feed`.
"""

from __future__ import annotations

import time
from typing import Any

from shadow.contracts.frames import (
    DATA_BODY,
    DATA_FIXED,
    DEFAULT_MAX_BODY,
    T_DATA,
    T_END,
    T_HELLO,
    T_INFO,
    T_MARK,
    T_START,
    FrameError,
    FrameReader,
    Incompatible,
    decode_end,
    decode_hello,
    decode_info,
    decode_mark,
    decode_start,
    frame_bound,
)
from shadow.contracts.handshake import VERSION
from shadow.contracts.tapwire import END_RELAY_LOST, TapContext

_FAR = 1.7e308  # a time past this is not finite


class ChannelReader:
    """Analysis side (see module docstring). `feed(data)` returns the decoded items; marks update
    `offered`, `dropped`, `stats` and `token` (the last sync answered); `hello` is the relay's.
    Frames are read up to `frame_bound(max_body)`: a relay copying larger bodies is refused
    (`Incompatible`)."""

    def __init__(self, boot_id: str = "", oldest_s: float | None = None,
                 max_body: int = DEFAULT_MAX_BODY) -> None:
        self.max_body = max_body
        self._frames = FrameReader(frame_bound(max_body))
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
        self.torn_frames = 0  # connections that ended inside a frame (its bytes dropped)
        self.bad_frames = 0  # connections closed on a malformed frame (FrameError)
        self.lost_total = 0  # requests ended as relay_lost (their relay died or stayed unreachable)
        self._base_offered = 0  # offered/dropped of earlier attaches (a relay counts per attach)
        self._base_dropped = 0

    def __len__(self) -> int:
        return len(self._ctxs)

    def restart(self) -> int:
        """A new connection's stream follows: bytes of a frame the last one cut are dropped
        (counted in `torn_frames`), so they are not read as the start of the new stream. Returns
        how many were dropped."""
        torn = self._frames.pending
        if torn:
            self.torn_frames += 1
            self._frames = FrameReader(self._frames.max_frame)
        return torn

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
        """`t` (on this host's clock), raised to `floor` (counted); FrameError when not finite."""
        if not -_FAR <= t <= _FAR:
            raise FrameError("a frame's time is not finite")
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
        if h["v"] != VERSION:
            raise Incompatible(f"the relay's frames are of attach protocol {h['v']}, this analysis's "
                               f"{VERSION}")
        if h["max_body"] > self.max_body:
            raise Incompatible(f"the tap group copies request bodies up to {h['max_body']} bytes (its "
                               f"--max-body), over this analysis's {self.max_body}: give it --max-body "
                               f"{h['max_body']}")
        items: list[tuple[TapContext, int, float, Any]] = []
        rid = h["relay_id"]
        if rid != self.relay_id:
            items = self.lost(time.monotonic())
            self.end_seen = 0
            self.relay_id = rid
        self.hello = h
        same_clock = bool(self.boot_id) and h["boot_id"] == self.boot_id
        self.offset = 0.0 if same_clock else time.monotonic() - h["mono"]
        self.snapshot_done = False
        self._base_offered += self.offered
        self._base_dropped += self.dropped
        self.offered = self.dropped = 0
        return items

    def _on_mark(self, m: dict[str, Any]) -> None:
        self.offered = m.pop("offered")
        self.dropped = m.pop("dropped")
        self.token = max(self.token, m.pop("token"))
        self.marks += 1
        snap = m.pop("snapshot", None)
        if snap is not None:
            self.snapshot_done = True
            self.snapshot = snap
        notice = m.pop("notice", None)
        if notice is not None:
            self.notices.append(notice)
        if m:
            self.stats = m

    def feed(self, data: bytes) -> list[tuple[TapContext, int, float, Any]]:
        """The items in `data` (and what came before it of an incomplete frame). FrameError on a
        malformed frame (the items decoded before it are lost with the connection)."""
        items: list[tuple[TapContext, int, float, Any]] = []
        off = self.offset
        floor = -_FAR if self.snapshot_done or self.oldest_s is None else time.monotonic() - self.oldest_s
        frames = self._frames
        buf = frames.add(data)
        try:
            items = self._decode(buf, items, off, floor)
        except FrameError:
            self.bad_frames += 1
            self._frames = FrameReader(frames.max_frame)  # (what was left of this stream is dropped)
            raise
        self.received += len(items)
        return items

    def _decode(self, buf: bytearray, items: list[tuple[TapContext, int, float, Any]], off: float,
                floor: float) -> list[tuple[TapContext, int, float, Any]]:
        frames = self._frames
        ctxs = self._ctxs
        pos = 0
        while (at := frames.next(pos)) is not None:
            kind, start, pos = at
            if kind == T_DATA:  # the hot path: read in place, one copy (the payload)
                if pos - start < DATA_FIXED:
                    raise FrameError(f"a data frame of {pos - start} bytes")
                cid, seq, t = DATA_BODY.unpack_from(buf, start)
                ctx = ctxs.get(cid) or self._ctx(cid)
                if seq <= ctx.seq:
                    self.skipped += 1  # a snapshot re-delivered what this reader has
                    continue
                ctx.seq = seq
                t += off
                if not floor <= t <= _FAR:
                    t = self._at(t, floor)
                items.append((ctx, seq, t, bytes(buf[start + DATA_FIXED : pos])))
                continue
            body = bytes(buf[start:pos])
            if kind == T_START:
                cid, t = decode_start(body)
                ctx = self._ctx(cid)
                if ctx.announced:
                    self.skipped += 1
                    continue
                ctx.announced = True
                items.append((ctx, 0, self._at(t + off, floor), None))
            elif kind == T_INFO:
                info = decode_info(body)
                known = self._ctxs.get(info.cid)
                if known is None:
                    known = self._ctxs[info.cid] = TapContext(
                        info.tap, info.method, info.path, info.request_id, info.body, info.body_len,
                        self._at(info.t_start + off, floor), info.traceparent)
                known.status = info.status
                known.resp_headers = info.resp_headers
            elif kind == T_END:
                end = decode_end(body)
                if end.end_no <= self.end_seen and end.cid not in self._ctxs:
                    self.skipped += 1
                    continue
                ctx = self._ctxs.pop(end.cid, None) or TapContext("", "", "", None, None, 0, 0.0)  # type: ignore[arg-type]
                ctx.seq = max(ctx.seq, end.seq)
                ctx.ended = True
                self.end_seen = max(self.end_seen, end.end_no)
                items.append((ctx, -1, self._at(end.t + off, floor), end.reason))
            elif kind == T_MARK:
                self._on_mark(decode_mark(body))
                if self.snapshot_done:
                    floor = -_FAR
            elif kind == T_HELLO:
                items += self._on_hello(decode_hello(body))
                off = self.offset
                if self.oldest_s is not None:
                    floor = time.monotonic() - self.oldest_s
            else:
                raise FrameError(f"a frame of unknown kind {kind}")
        del buf[:pos]
        return items
