"""What shadow's two HTTP/1.1 fronts (the listener in `base.listener`, the tap in `dataplane.tap`)
share: a front's refusal counts and draining; a connection's reads paused for named reasons, its
one deadline, its held bytes, the connection cap, the staged close after a last response, and the
request head as llhttp delivers it."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
from collections.abc import Callable
from typing import Any

# A client deadline (head, body) that runs more than this after it passed ran on a loop that did
# not run meanwhile (starved or blocked): the time lost is given back to the client (`Conn`).
STALL_S = 1.0
# Deadlines on the client's pace: judged only once the loop has read what the client sent (`Conn`).
CLIENT_PACED = frozenset(("header", "body"))


def head_fault(http11: bool, te: list[bytes], hosts: int) -> str | None:
    """Why a request head is refused (400, then the connection closes), or None when it is sound:
    its body framed other than by one plain `chunked` (`te`: its Transfer-Encoding values), a
    Transfer-Encoding in an HTTP/1.0 request (RFC 9112 6.1: its framing is faulty), more than one
    Host header (`hosts`: how many it has), or none in an HTTP/1.1 request (RFC 9112 3.2)."""
    if te and (len(te) > 1 or te[0].strip().lower() != b"chunked"):
        return "a Transfer-Encoding other than chunked"
    if te and not http11:
        return "Transfer-Encoding in an HTTP/1.0 request"
    if hosts > 1:
        return "more than one Host header"
    if hosts == 0 and http11:
        return "an HTTP/1.1 request without a Host header"
    return None


class Front:
    """A listening front: `rejected[reason]` counts refusals; `draining` once it stopped accepting."""

    def __init__(self, reasons: tuple[str, ...]) -> None:
        self.rejected: dict[str, int] = dict.fromkeys(reasons, 0)
        self.draining = False
        self.handoff = False  # draining for a successor (`begin_drain`)
        self._server: asyncio.AbstractServer | None = None

    def count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def inflight(self) -> int:
        """Requests in flight (the front's own count)."""
        raise NotImplementedError

    @property
    def connections(self) -> int:
        """Client connections open."""
        raise NotImplementedError

    def _stop_accepting(self) -> None:
        self.draining = True
        if self._server is not None:
            self._server.close()

    def begin_drain(self, handoff: bool = False) -> None:
        """Stop accepting. No connection is closed under a client that may be writing on it: a
        response whose head goes out from now on says `connection: close` and its connection
        closes after it; a connection idle between requests stays open (a request on it is answered
        the same way) until `drained` closes it. `handoff`: a successor serves the listening socket,
        so idle connections are left to their clients for as long as the drain may take."""
        self._stop_accepting()
        self.handoff = handoff

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight and, handing off, no connection is open, or until
        `timeout_s` passes; then close the idle connections. True when nothing is in flight."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.inflight() or (self.handoff and self.connections):
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)
        self.close_idle()
        return not self.inflight()

    def close_idle(self) -> None:
        """Close the connections that have had no byte since their last response."""
        raise NotImplementedError


class Conn(asyncio.Protocol):
    """One client connection of a front. Reading pauses while any reason to pause holds (`_pause`,
    `_resume`), and for "buffer" while more than a cap of bytes are held (`_hold`, `_release`:
    resumes at half the cap). One deadline at a time (`arm(kind, s)`: `_deadline(kind)` runs when it
    passes, unless the connection closed first). A deadline on the client's pace (CLIENT_PACED)
    judges the client only, never the loop: it waits again when it ran more than STALL_S late (the
    loop did not run: the time lost is added), when bytes wait unread in the socket (judged again
    after the loop's next read: uvloop runs due timers before it polls again), and, for a body,
    while reading is paused (the front stopped reading, not the client sending; its whole length
    again). A peer that really sends nothing still meets it. `on_message_begin` / `on_url` collect
    the head."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.buffered = 0  # request bytes held (not yet taken by the app, or not yet sent upstream)
        self._pauses: set[str] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        self._timer_due = 0.0  # loop time the armed deadline is due
        self._timer_span = 0.0  # its length as armed
        self._linger_left = 0  # bytes still dropped while lingering (`_linger`)
        self._in_head = False
        self._head_fed = 0
        self._url: list[bytes] = []
        self._hdrs: list[tuple[bytes, bytes]] = []

    def _pause(self, why: str) -> None:
        if not self._pauses and self.transport is not None:
            self.transport.pause_reading()
        self._pauses.add(why)

    def _resume(self, why: str) -> None:
        if why in self._pauses:
            self._pauses.discard(why)
            if not self._pauses and self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def _hold(self, n: int, cap: int) -> None:
        self.buffered += n
        if self.buffered > cap:
            self._pause("buffer")

    def _release(self, n: int, cap: int) -> None:
        self.buffered -= n
        if self.buffered <= cap // 2:
            self._resume("buffer")

    def arm(self, kind: str, seconds: float) -> None:
        self.disarm()
        self._timer_span = seconds
        self._wait(kind, seconds)

    def _wait(self, kind: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._timer_kind = kind
        self._timer_due = loop.time() + seconds
        self._timer = loop.call_later(seconds, self._expired)

    @property
    def quiet(self) -> bool:
        """Open, and no byte read since its last response (or since it was accepted)."""
        return not self.closed and self._timer_kind == "idle"

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_kind = ""

    def _expired(self) -> None:
        kind, self._timer, self._timer_kind = self._timer_kind, None, ""
        if kind == "linger":
            self._linger_cut()
        elif not self.closed and not (kind in CLIENT_PACED and self._waits_again(kind)):
            self._deadline(kind)

    def _waits_again(self, kind: str) -> bool:
        """The client-paced deadline `kind` ran: re-armed (True) unless it is the client's silence."""
        late = asyncio.get_running_loop().time() - self._timer_due
        if late > STALL_S:
            self._wait(kind, late)
        elif self._pauses:
            if kind != "body":
                return False
            self._wait(kind, self._timer_span)
        elif self._unread():
            self._wait(kind, 0.0)
        else:
            return False
        return True

    def _unread(self) -> bool:
        """Bytes wait in the socket that the loop has not read yet."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            n: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except (OSError, ValueError):
            return False
        return n > 0

    def _linger(self, seconds: float, max_bytes: int, idle: dict[Any, None]) -> None:
        """End the connection after its last response without losing that response: what was
        written is sent, then a FIN; what the client still sends is read and dropped until it
        closes, or `seconds` pass, or more than `max_bytes` came (`_linger_cut`; 0 s: a plain
        close). RFC 9112 §9.6: a plain close with request bytes unread makes the kernel send a
        reset, and the reset can destroy the response in flight (seen: requests pipelined after a
        `Connection: close` one lost that one's answer). While it lingers the connection is idle in
        its front (`idle`): the first to go when the cap needs room."""
        t = self.transport
        self.closed = True
        self.disarm()
        if t is None or t.is_closing():
            return
        if seconds <= 0 or not t.can_write_eof():
            t.close()
            return
        t.write_eof()  # (after what is buffered has been sent)
        idle[self] = None
        self._pauses.clear()
        self._linger_left = max_bytes
        t.resume_reading()
        self.arm("linger", seconds)

    def _send_reset(self) -> None:
        """Close now with a TCP reset (SO_LINGER 0; what is still buffered is lost): the client
        sees an error, never a clean end, also of a body it reads to the connection's close."""
        t = self.transport
        if t is None:
            return
        sock = t.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        t.abort()

    def _lingered(self, n: int) -> None:
        """`n` bytes came on a closed connection: dropped; beyond the linger budget it is cut."""
        if self._timer_kind == "linger":
            self._linger_left -= n
            if self._linger_left < 0:
                self.disarm()
                self._linger_cut()

    def _linger_cut(self) -> None:
        """The client neither closed nor stopped sending within the linger time: close now."""
        if self.transport is not None:
            self.transport.close()

    def _lost(self, conns: set[Any], idle: dict[Any, None]) -> None:
        """The peer is gone: closed, no deadline, neither open (`conns`) nor idle in its front."""
        self.closed = True
        self.disarm()
        conns.discard(self)
        idle.pop(self, None)

    def _head_ended(self) -> None:
        """The request head is complete (what follows is its body)."""
        self._in_head = False
        self._head_fed = 0

    def _body_ended(self) -> None:
        """The request body is complete: its silence deadline is off."""
        if self._timer_kind == "body":
            self.disarm()

    def _deadline(self, kind: str) -> None:
        """The deadline `kind` passed on an open connection."""
        raise NotImplementedError

    def _make_room(self, victim: Conn | None, count: Callable[[str], None], busy: bytes) -> bool:
        """At the connection cap: close `victim` (an idle connection) to make room (True), else
        answer `busy` and close this one (False)."""
        if victim is not None:
            count("evicted_idle")
            victim._evict()
            return True
        count("busy")
        self.closed = True
        if self.transport is not None:
            self.transport.write(busy)
            self.transport.close()
        return False

    def _evict(self) -> None:
        """Close this idle connection to make room for a new one."""
        raise NotImplementedError

    def on_message_begin(self) -> None:
        self._in_head = True
        self._url = []
        self._hdrs = []

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
