"""The analysis side of attaching to a running tap group (the data plane): one `Attachment` per
address, on the analysis loop.

It connects (a group directory's unix socket, or `tcp://host:port` with a token), authenticates
(`shadow.contracts.handshake`: the relay proves it holds the token before this side sends anything
but a nonce; over the unix socket, the relay's uid must be ours or root), says hello, and feeds
the relay's items to `on_items` in order: first the snapshot of the requests the relay keeps
(so a restarted analysis rebuilds its mirrored state), then the live ones. After an end of stream
it reconnects (backoff up to 1 s): the same relay resumes where this reader was (nothing counted
twice); another relay (the old one died) first ends every request still open as `relay_lost`, as
does a relay that stays unreachable for `lost_after_s`. A draining relay (reload) is read to its
end while a second connection attaches to its successor. A relay that says another analysis
replaced this one (attached under the same `name`) is not reconnected to. Acks tell the relay
which ends are processed and recorded.

A relay of another attach protocol — one that says so, or one that closes on the handshake
`LEGACY_TRIES` times in a row, as a relay from before the handshake does — or one copying larger
bodies than this side reads (`max_body`) is not attached to (`rejected`, with the fix in
`last_error`); any other failure is retried. A malformed frame closes the connection (counted in
the reader's `bad_frames`) and it attaches again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shadow.base.net import read_now, size_buffers
from shadow.contracts import handshake
from shadow.contracts.frames import (
    DEFAULT_MAX_BODY,
    FrameError,
    Hello,
    Incompatible,
    encode_control,
    encode_hello,
)
from shadow.contracts.handshake import HandshakeError
from shadow.contracts.tapwire import TapContext
from shadow.dataplane.rundir import ATTACH, unix_connect
from shadow.mirror.channel_reader import ChannelReader

log = logging.getLogger("shadow.attach")

Items = list[tuple[TapContext, int, float, Any]]
BACKOFF_S = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
HANDSHAKE_TIMEOUT_S = 5.0  # connect to hello sent
LEGACY_TRIES = 3  # handshakes in a row the relay closes unanswered: a relay of attach protocol 1
_SUSPECT = ("magic", "proof", "peer")  # handshake failures said as they happen (not a restart's)


def parse_address(address: str) -> tuple[str, Any]:
    """("unix", Path) for `unix:PATH` or a group directory; ("tcp", (host, port)) for `tcp://h:p`."""
    if address.startswith("tcp://"):
        rest = address[len("tcp://") :].rstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"--attach {address!r}: expected tcp://HOST:PORT")
        return "tcp", (host.strip("[]"), int(port))
    path = Path(address[len("unix:") :] if address.startswith("unix:") else address).expanduser()
    if not address.startswith("unix:") and (path.is_dir() or not path.name.endswith(".sock")):
        path = path / ATTACH  # a group directory
    return "unix", path


class _Conn:
    """One connection to a relay and the reader decoding it."""

    def __init__(self, sock: socket.socket, reader: ChannelReader) -> None:
        self.sock = sock
        self.reader = reader
        self.acked = 0
        self.draining = False
        self.closed = False
        self.checked = False


class Attachment:
    """See module docstring. `start()` / `aclose()` on the analysis loop."""

    def __init__(
        self,
        address: str,
        on_items: Callable[[ChannelReader, Items], None],
        *,
        token: str | None = None,
        name: str = "",
        boot_id: str = "",
        lost_after_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        check: Callable[[dict[str, Any]], str | None] | None = None,
        oldest_s: float | None = None,
        max_body: int = DEFAULT_MAX_BODY,
    ) -> None:
        """`check(hello)` names what is wrong with a relay (then it is not attached to) or None;
        `max_body`: the largest request body this analysis reads (the relay's must not be larger)."""
        self.address = address
        self.kind, self.where = parse_address(address)
        self.on_items = on_items
        self.token = token
        self.name = name  # attached under: the relay replaces one of the same name, keeps others
        self.boot_id = boot_id
        self.lost_after_s = lost_after_s
        self.clock = clock
        self.check = check
        self.rejected = False  # the relay's hello failed `check`: a configuration error, not retried
        self.conn: _Conn | None = None
        self.draining: list[_Conn] = []
        self.oldest_s = oldest_s
        self.max_body = max_body
        self.unanswered = 0  # handshakes in a row the relay closed without a word
        self._said: set[str] = set()  # handshake failures warned about (once each)
        self.reader = self._new_reader()  # kept across reconnects to the same relay
        self.readers: list[ChannelReader] = [self.reader]  # every reader ever used (counters)
        self.replaced = False
        self.attaches = 0
        self.failures = 0  # connection attempts that failed
        self.detached_since: float | None = clock()
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closing = False

    def _new_reader(self) -> ChannelReader:
        r = ChannelReader(self.boot_id, self.oldest_s, self.max_body)
        if self.kind == "tcp":
            r.peer_host = self.where[0]
        return r

    # -- state ---------------------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self.conn is not None

    @property
    def relay(self) -> dict[str, Any]:
        return self.reader.hello

    def taps(self) -> list[dict[str, Any]]:
        return list(self.reader.hello.get("taps", []))

    def live_readers(self) -> list[ChannelReader]:
        return [c.reader for c in ([self.conn] if self.conn else []) + self.draining]

    # -- running -------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait_attached(self, timeout_s: float) -> bool:
        """Until the first snapshot was processed (True) or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while not (self.conn is not None and self.conn.reader.snapshot_done):
            if time.monotonic() > deadline or self.replaced or self.rejected:
                return False
            await asyncio.sleep(0.005)
        return True

    async def _run(self) -> None:
        attempt = 0
        while not self._closing and not self.replaced and not self.rejected:
            if self.conn is None:
                try:
                    await self._connect()
                    attempt = 0
                except (OSError, ValueError) as exc:
                    self.failures += 1
                    self._failed(exc)
                    self._maybe_lost()
                    delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                    attempt += 1
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), delay)
                    continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.25)
            self._maybe_lost()

    def _failed(self, exc: Exception) -> None:
        """A connection attempt failed: given up (an error) when trying again cannot help; said once
        (a warning) when it was not the relay that answered, or not as it should."""
        error = str(exc) or type(exc).__name__
        unanswered = isinstance(exc, HandshakeError) and exc.reason == "unanswered"
        self.unanswered = self.unanswered + 1 if unanswered else 0
        if isinstance(exc, HandshakeError) and (exc.final or self.unanswered >= LEGACY_TRIES):
            self.rejected = True
            log.error("tap attach %s: %s", self.address, error)
        elif isinstance(exc, HandshakeError) and exc.reason in _SUSPECT and exc.reason not in self._said:
            self._said.add(exc.reason)
            log.warning("tap attach %s: %s", self.address, error)
        self.last_error = error

    def _maybe_lost(self) -> None:
        """Unreachable for longer than `lost_after_s`: its open requests are ended (relay_lost)."""
        since = self.detached_since
        if (
            self.conn is None
            and since is not None
            and self.clock() - since > self.lost_after_s
            and len(self.reader)
        ):
            self.on_items(self.reader, self.reader.lost(time.monotonic()))

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        if self.kind == "unix":
            sock = await loop.run_in_executor(None, unix_connect, self.where, 2.0)
        else:
            sock = await loop.run_in_executor(None, socket.create_connection, self.where, 2.0)
        sock.setblocking(False)
        size_buffers(sock)
        r = self.reader
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                if self.kind == "unix":
                    handshake.check_peer(sock, "relay")
                    key = b""
                else:
                    key = (self.token or "").encode()
                await handshake.client(loop, sock, key)
                await loop.sock_sendall(sock, encode_hello(Hello(self.name, r.relay_id, r.end_seen)))
        except TimeoutError:
            sock.close()
            raise HandshakeError("timeout", f"the relay did not answer the handshake within "
                                 f"{HANDSHAKE_TIMEOUT_S:g} s") from None
        except BaseException:
            sock.close()
            raise
        self.unanswered = 0
        self._open(sock, r)

    def _open(self, sock: socket.socket, reader: ChannelReader) -> None:
        torn = reader.restart()  # what a cut connection left of a frame is not the new stream's start
        if torn:
            log.info("tap attach %s: the last connection ended inside a frame (%d bytes dropped)",
                     self.address, torn)
        c = _Conn(sock, reader)
        self.conn = c
        self.attaches += 1
        self.detached_since = None
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable, c)

    def _readable(self, c: _Conn) -> None:
        data = read_now(lambda: c.sock.recv(1 << 20))
        if data is None:
            return
        if not data:
            self._closed(c)
            return
        try:
            items = c.reader.feed(data)
        except Incompatible as exc:  # a configuration error: not retried
            self.rejected = True
            self.last_error = str(exc)
            log.error("tap attach %s: %s", self.address, exc)
            self._closed(c)
            return
        except FrameError as exc:  # a broken stream: start over
            self.last_error = f"bad frame from the relay: {exc}"
            log.warning("tap attach %s: %s", self.address, self.last_error)
            self._closed(c)
            return
        if not c.checked and c.reader.hello:
            c.checked = True
            problem = self.check(c.reader.hello) if self.check is not None else None
            if problem is not None:
                self.rejected = True
                self.last_error = problem
                log.error("tap attach %s: %s", self.address, problem)
                self._closed(c)
                return
        if items:
            self.on_items(c.reader, items)
        if c.reader.notices:
            self._notices(c)

    def _notices(self, c: _Conn) -> None:
        notices, c.reader.notices = c.reader.notices, []
        for n in notices:
            if n.get("replaced"):
                self.replaced = True
                log.error(
                    "tap attach %s: another analysis attached to this tap group; this one stops mirroring it",
                    self.address,
                )
                self._closed(c)
                return
            if n.get("draining") and c is self.conn:  # a reload: read it to its end, attach again
                c.draining = True
                self.draining.append(c)
                self.conn = None
                self.reader = self._new_reader()
                self.readers.append(self.reader)
                self.detached_since = self.clock()
                self._wake.set()

    def _closed(self, c: _Conn) -> None:
        if c.closed:
            return
        c.closed = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(c.sock.fileno())
        c.sock.close()
        if c in self.draining:
            self.draining.remove(c)
            items = c.reader.lost(time.monotonic())  # a drained relay has none left, normally
            if items:
                self.on_items(c.reader, items)
            return
        if c is self.conn:
            self.conn = None
            self.detached_since = self.clock()
            self._wake.set()

    # -- control -------------------------------------------------------------------------------------

    def _send(self, c: _Conn, cmd: str, arg: Any) -> None:
        with contextlib.suppress(OSError):
            c.sock.send(encode_control(cmd, arg))  # tiny: fits the socket buffer

    def sync(self, token: int) -> list[ChannelReader]:
        """Ask every connected relay for a mark answering `token`; the readers to wait on."""
        out = []
        for c in [*([self.conn] if self.conn else []), *self.draining]:
            self._send(c, "sync", token)
            out.append(c.reader)
        return out

    def ack(self) -> None:
        """Tell each relay the ends processed so far (after its snapshot was processed whole)."""
        for c in [*([self.conn] if self.conn else []), *self.draining]:
            r = c.reader
            if r.snapshot_done and r.end_seen > c.acked:
                c.acked = r.end_seen
                self._send(c, "ack", r.end_seen)

    async def aclose(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for c in [*([self.conn] if self.conn else []), *self.draining]:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(c.sock.fileno())
            c.sock.close()
        self.conn = None
        self.draining.clear()

    def snapshot(self) -> dict[str, Any]:
        """What /v1/state and the metrics show of this attachment."""
        r = self.reader
        return {
            "address": self.address,
            "attached": self.attached,
            "relay_id": r.relay_id,
            "relay_pid": r.hello.get("pid"),
            "group": r.hello.get("group"),
            "attaches": self.attaches,
            "failures": self.failures,
            "lost_requests": sum(x.lost_total for x in self.readers),
            "torn_frames": sum(x.torn_frames for x in self.readers),
            "bad_frames": sum(x.bad_frames for x in self.readers),
            "replaced": self.replaced,
            "rejected": self.rejected,
            "snapshot": r.snapshot,
            "draining": len(self.draining),
            "last_error": self.last_error,
        }
