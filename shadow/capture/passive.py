"""Passive capture: the router↔worker traffic read off an interface, nothing in the path.

`Capture(interface, targets, queue)` reads TCP segments to and from the target servers
({(ip, port): name}) with a packet socket (`packets`), reassembles each connection's two directions
(`reassembly`), parses them with llhttp (httptools) as the taps do, and hands the same
`(ctx, seq, t, payload)` items to the same queue (`DropQueue`): request start, de-chunked response
body, end. So the analysis is the taps' own; only the source differs. It runs on a thread of its
own and never touches the traffic: if it dies, lags (the kernel drops, counted) or is flooded, the
clients see nothing. Bytes it never saw are counted (`gap_bytes`) and the exchange they belonged to
is marked (a seq gap), never guessed; `seen_ratio()` says how much of the traffic it saw.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from httptools import HttpParserError, HttpRequestParser, HttpResponseParser

from shadow.capture.packets import FIN, RST, SYN, PacketSocket, Segment
from shadow.capture.reassembly import GAP, Direction
from shadow.contracts.tapwire import (
    END_CLIENT_CANCEL,
    END_COMPLETE,
    END_UPSTREAM_CUT,
    END_UPSTREAM_ERROR,
    Handoff,
    TapContext,
)
from shadow.dataplane.http1 import head_ids

_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ")
_KEPT_HEADERS = ("content-type", "content-length", "transfer-encoding")


class _Side:
    """One direction's parser (None while waiting for the next message to start) and whether a gap
    cut the message it was in (`lost`)."""

    __slots__ = ("lost", "parser")

    def __init__(self, parser: HttpRequestParser | HttpResponseParser) -> None:
        self.parser: HttpRequestParser | HttpResponseParser | None = parser
        self.lost = False

    def gap(self) -> None:
        """Bytes are missing: what follows is skipped up to the next message's start."""
        self.lost = True
        self.parser = None

    def start(self, parser: HttpRequestParser | HttpResponseParser) -> None:
        self.parser = parser
        self.lost = False


class _Flow:
    """One TCP connection to a target: both directions, their parsers, requests awaiting answers."""

    def __init__(self, cap: Capture, name: str, t: float) -> None:
        self.cap = cap
        self.name = name
        self.c2s = Direction(cap.max_pending)
        self.s2c = Direction(cap.max_pending)
        self.last = t
        self.t = t  # the time of the segment being parsed
        self.waiting: deque[TapContext] = deque()  # requests sent, answer not complete
        self.req = _Side(HttpRequestParser(_RequestSide(self)))
        self.resp = _Side(HttpResponseParser(_ResponseSide(self)))
        self.closed = 0  # directions that ended
        self.client_fin = False  # the client closed first (a request left unanswered was cancelled)

    # -- bytes in ------------------------------------------------------------------------------------

    def request_bytes(self, pieces: list[bytes | None]) -> None:
        for piece in pieces:
            if piece is GAP:
                self.req.gap()
                self.cap.request_gaps += 1
                continue
            assert piece is not None
            if self.req.parser is None:
                if not piece.startswith(_METHODS):
                    continue  # still inside a message the capture lost the start of
                self.req.start(HttpRequestParser(_RequestSide(self)))
            if not self._parsed(self.req, piece):
                self.req.parser = None

    def response_bytes(self, pieces: list[bytes | None]) -> None:
        for piece in pieces:
            if piece is GAP:
                self.resp.gap()
                self.cap.response_gaps += 1
                if self.waiting:
                    self.waiting[0].seq += 1  # the analysis sees a gap in this answer's copy
                continue
            assert piece is not None
            if self.resp.parser is None:
                if not piece.startswith(b"HTTP/1."):
                    continue
                if self.resp.lost and self.waiting:  # a new answer: the one with the hole ended
                    self.end(self.waiting.popleft(), END_COMPLETE)
                self.resp.start(HttpResponseParser(_ResponseSide(self)))
            if not self._parsed(self.resp, piece):
                self.resp.gap()  # the rest of this answer is not followed

    def _parsed(self, side: _Side, piece: bytes) -> bool:
        """Feed `piece` to the side's parser; False (counted) when the parser refuses it."""
        try:
            side.parser.feed_data(piece)  # type: ignore[union-attr]
        except HttpParserError:
            self.cap.parse_errors += 1
            return False
        return True

    def end(self, ctx: TapContext, reason: str) -> None:
        if not ctx.ended:
            ctx.ended = True
            self.cap.queue.put_end((ctx, -1, self.t, reason))

    def close(self, by_server: bool) -> None:
        """The connection ended: what was still waiting for its answer ends too."""
        by_server = by_server and not self.client_fin
        while self.waiting:
            ctx = self.waiting.popleft()
            if ctx.status == 0:
                self.end(ctx, END_UPSTREAM_ERROR if by_server else END_CLIENT_CANCEL)
            elif (
                by_server
                and ctx.resp_headers.get("content-length") is None
                and "transfer-encoding" not in ctx.resp_headers
            ):
                self.end(ctx, END_COMPLETE)  # a body delimited by the close
            else:
                self.end(ctx, END_UPSTREAM_CUT if by_server else END_CLIENT_CANCEL)


class _RequestSide:
    """llhttp callbacks of a flow's request direction."""

    def __init__(self, flow: _Flow) -> None:
        self.flow = flow
        self.url = b""
        self.hdrs: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] | None = []
        self.body_len = 0
        self.ctx: TapContext | None = None

    def on_message_begin(self) -> None:
        self.url, self.hdrs, self.body, self.body_len = b"", [], [], 0
        self.t0 = self.flow.t

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.hdrs) < 256:
            self.hdrs.append((name, value))

    def on_headers_complete(self) -> None:
        rid, traceparent = head_ids(self.hdrs)
        parser = self.flow.req.parser
        method = parser.get_method() if isinstance(parser, HttpRequestParser) else b"GET"
        self.ctx = TapContext(
            self.flow.name,
            method.decode("latin-1"),
            self.url.decode("latin-1"),
            rid,
            None,
            0,
            self.t0,
            traceparent,
        )

    def on_body(self, body: bytes) -> None:
        self.body_len += len(body)
        if self.body is not None:
            if self.body_len <= self.flow.cap.max_body:
                self.body.append(body)
            else:
                self.body = None

    def on_message_complete(self) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        ctx.body = b"".join(self.body) if self.body is not None else None
        ctx.body_len = self.body_len
        cap = self.flow.cap
        cap.requests += 1
        ctx.announced = True
        cap.queue.put((ctx, 0, ctx.t_start, None))
        self.flow.waiting.append(ctx)
        self.ctx = None


class _ResponseSide:
    """llhttp callbacks of a flow's response direction: the answer to the oldest waiting request."""

    def __init__(self, flow: _Flow) -> None:
        self.flow = flow
        self.hdrs: list[tuple[bytes, bytes]] = []
        self.interim = False

    def on_message_begin(self) -> None:
        self.hdrs = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.hdrs) < 256:
            self.hdrs.append((name, value))

    def on_headers_complete(self) -> None:
        flow = self.flow
        parser = flow.resp.parser
        status = parser.get_status_code() if isinstance(parser, HttpResponseParser) else 0
        self.interim = 100 <= status < 200
        if self.interim or not flow.waiting:
            return
        ctx = flow.waiting[0]
        ctx.status = status
        ctx.resp_headers = {
            k: v.decode("latin-1")
            for n, v in self.hdrs
            if (k := n.decode("latin-1").lower()) in _KEPT_HEADERS
        }
        if ctx.method == "HEAD":  # no body follows (llhttp cannot be told): the answer ends here
            flow.waiting.popleft()
            flow.end(ctx, END_COMPLETE)
            flow.resp.parser = None

    def on_body(self, body: bytes) -> None:
        flow = self.flow
        if self.interim or not flow.waiting:
            return
        ctx = flow.waiting[0]
        ctx.seq += 1
        flow.cap.queue.put((ctx, ctx.seq, flow.t, body), len(body))

    def on_message_complete(self) -> None:
        flow = self.flow
        if self.interim:
            self.interim = False
            return
        if flow.waiting:
            flow.end(flow.waiting.popleft(), END_COMPLETE)


class Capture:
    """See module docstring. `start()` opens the socket (OSError when it cannot) and starts the
    thread; `stop()` ends it. Counters are read by the metrics and /v1/state."""

    def __init__(
        self,
        interface: str,
        targets: dict[tuple[str, int], str],
        queue: Handoff,
        *,
        max_body: int = 4 << 20,
        max_flows: int = 65536,
        max_pending: int = 256 << 10,
        idle_s: float = 300.0,
    ) -> None:
        if not targets:
            raise ValueError("nothing to capture: no target servers")
        self.interface = interface
        self.targets = dict(targets)
        self.queue = queue
        self.max_body = max_body
        self.max_flows = max_flows
        self.max_pending = max_pending
        self.idle_s = idle_s
        self.flows: OrderedDict[tuple[tuple[str, int], tuple[str, int]], _Flow] = OrderedDict()
        self.sock: PacketSocket | None = None
        self.segments = 0
        self.requests = 0
        self.request_gaps = 0
        self.response_gaps = 0
        self.parse_errors = 0
        self.flows_dropped = 0  # connections not followed (max_flows)
        self.kernel_packets = 0
        self.kernel_drops = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bytes_ended = [0, 0, 0]  # delivered c2s, delivered s2c, gap bytes of flows gone

    def start(self) -> None:
        self.sock = PacketSocket(self.interface, sorted({p for _, p in self.targets}))
        self._thread = threading.Thread(target=self._run, name="shadow-capture", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.sock is not None:
            self.sock.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        sock = self.sock
        assert sock is not None
        next_housekeeping = time.monotonic() + 1.0
        while not self._stop.is_set():
            try:
                seg = sock.recv()
                if seg is not None:
                    self.segments += 1
                    self.segment(seg)
                now = time.monotonic()
                if now >= next_housekeeping:
                    next_housekeeping = now + 1.0
                    self._housekeeping(now)
            except Exception:
                self.errors += 1  # confined to that packet; the capture goes on

    def _housekeeping(self, now: float) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                packets, drops = self.sock.stats()
                self.kernel_packets += packets
                self.kernel_drops += drops
        while self.flows:
            key, flow = next(iter(self.flows.items()))
            if now - flow.last < self.idle_s:
                break
            self._forget(key, flow, by_server=False)

    def segment(self, seg: Segment) -> None:
        """One segment (the thread calls this; tests may too)."""
        if seg.dst in self.targets:
            server, client, to_server = seg.dst, seg.src, True
        elif seg.src in self.targets:
            server, client, to_server = seg.src, seg.dst, False
        else:
            return
        key = (client, server)
        flow = self.flows.get(key)
        if flow is None:
            if seg.flags & RST:
                return
            if len(self.flows) >= self.max_flows:
                self.flows_dropped += 1
                return
            flow = self.flows[key] = _Flow(self, self.targets[server], seg.t)
        else:
            self.flows.move_to_end(key)
        flow.last = flow.t = seg.t
        if seg.flags & RST:
            self._forget(key, flow, by_server=not to_server)
            return
        direction = flow.c2s if to_server else flow.s2c
        pieces = direction.add(seg.seq, seg.payload, syn=bool(seg.flags & SYN), fin=bool(seg.flags & FIN))
        if pieces:
            (flow.request_bytes if to_server else flow.response_bytes)(pieces)
        if seg.flags & FIN:
            flow.closed += 1
            if to_server and flow.closed == 1:
                flow.client_fin = True
            if not to_server or flow.closed >= 2:  # the server closed, or both did
                self._forget(key, flow, by_server=not to_server)

    def _forget(self, key: Any, flow: _Flow, by_server: bool) -> None:
        flow.close(by_server)
        self.flows.pop(key, None)
        self._bytes_ended[0] += flow.c2s.delivered
        self._bytes_ended[1] += flow.s2c.delivered
        self._bytes_ended[2] += flow.c2s.gap_bytes + flow.s2c.gap_bytes

    def byte_counts(self) -> dict[str, int]:
        """Bytes reassembled per direction and bytes never seen (gaps), over every flow so far."""
        flows = list(self.flows.values())
        c2s = self._bytes_ended[0] + sum(f.c2s.delivered for f in flows)
        s2c = self._bytes_ended[1] + sum(f.s2c.delivered for f in flows)
        gaps = self._bytes_ended[2] + sum(f.c2s.gap_bytes + f.s2c.gap_bytes for f in flows)
        return {"to_server": c2s, "to_client": s2c, "gap": gaps}

    def seen_ratio(self) -> float:
        """Share of the connections' bytes that were seen (1.0 before any)."""
        b = self.byte_counts()
        total = b["to_server"] + b["to_client"] + b["gap"]
        return 1.0 if total == 0 else (b["to_server"] + b["to_client"]) / total

    def snapshot(self) -> dict[str, Any]:
        return {
            "interface": self.interface,
            "alive": self.alive,
            "targets": {f"{h}:{p}": n for (h, p), n in self.targets.items()},
            "segments": self.segments,
            "flows": len(self.flows),
            "flows_dropped": self.flows_dropped,
            "requests": self.requests,
            "bytes": self.byte_counts(),
            "seen_ratio": self.seen_ratio(),
            "request_gaps": self.request_gaps,
            "response_gaps": self.response_gaps,
            "parse_errors": self.parse_errors,
            "kernel_packets": self.kernel_packets,
            "kernel_drops": self.kernel_drops,
            "errors": self.errors,
        }


def capture_targets(servers: dict[str, str]) -> dict[tuple[str, int], str]:
    """{name: http://host:port} as {(ip, port): name} (host names resolved once, IPv4)."""
    import socket
    import urllib.parse

    out: dict[tuple[str, int], str] = {}
    for name, url in servers.items():
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"{name}={url!r}: only http://host:port is supported")
        try:
            ip = socket.gethostbyname(u.hostname)
        except OSError as exc:
            raise ValueError(f"{name}={url!r}: cannot resolve {u.hostname}: {exc}") from None
        out[(ip, u.port or 80)] = name
    return out
