"""The relay: the taps of one data-plane process on their own event loop, nothing else on it but
the hand-off to an attached analysis and a small /metrics and /health endpoint.

`Relay(spec, sockets)` serves listening sockets it is given (bound by its supervisor, systemd, or a
predecessor): one per tap, the attach socket(s) an analysis connects to, and the admin socket.
`await relay.run(ready)` serves until `drain()` (SIGTERM; SIGUSR2 hands over to a successor) has
let the streams in flight finish or timed out; `ready(doc)` is called once everything accepts.
Analyses attach by name (their hello's `name`; replicas of `shadow serve` behind the same taps each
give theirs): up to MAX_ANALYSES at once, each getting every copy; a new one under a name already
attached replaces that one (which is told so).

An attach connection is authenticated before a frame of it is read (`shadow.contracts.handshake`:
over TCP, proof of the attach token; over the unix socket, the peer's uid must be this one's or
root's): at most MAX_HANDSHAKES at once on each kind of socket (MAX_HANDSHAKES_PER_PEER from one
TCP address), each within HANDSHAKE_TIMEOUT_S through its hello.
Every refusal is counted by reason (`refused`). Then only control frames are read from it, each
at most CONTROL_MAX bytes and decoded by type (`frames.decode_control`); a malformed one detaches
the analysis (counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from httptools import HttpParserError, HttpRequestParser
from prometheus_client import CollectorRegistry, generate_latest

from shadow.base.knobs import AT_LEAST_ONE, knob, knob_argv
from shadow.base.net import read_now, size_buffers
from shadow.base.runtime import LOOPS
from shadow.contracts import handshake
from shadow.contracts.frames import CONTROL_MAX, HDR, FrameError, FrameReader, Hello, decode_control
from shadow.contracts.handshake import REFUSALS, HandshakeError
from shadow.dataplane.channel import ChannelSink
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.relay_metrics import RelayCollector
from shadow.dataplane.tap import Tap

STATS_INTERVAL_S = 0.25
HANDSHAKE_TIMEOUT_S = 5.0  # an attach connection's handshake and hello, from its accept
MAX_HANDSHAKES = 16  # attach connections in the handshake at once, over TCP and over the unix socket
MAX_HANDSHAKES_PER_PEER = 4  # ... from one TCP address; more are refused (busy), counted
MAX_ANALYSES = 8  # analyses attached at once (by name); more are refused and counted
log = logging.getLogger("shadow.relay")


def boot_id() -> str:
    """This kernel's boot id: two processes that share it share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


@dataclass(kw_only=True)
class RelayBounds:
    """How a relay copies and hands off: body copy cap, usage injection, the hand-off's and the
    kept copies' bounds, the event loop; what `shadow tap` is told and its relays are given."""

    max_body: int = knob(4 << 20, "--max-body", "largest request/response body copied for the analysis "
                         "(traffic is never limited)", AT_LEAST_ONE, metavar="BYTES")
    inject_usage: bool = knob(False, "--inject-usage", "ask workers for continuous usage stats (exact token "
                              "counts) and strip them from what clients receive unless they asked; changes "
                              "the wire bytes, off by default")
    queue_size: int = knob(65536, "--queue-size", "copies pending for the attached analysis (items); beyond "
                           "it dropped and counted", AT_LEAST_ONE)
    queue_bytes: int = knob(256 << 20, "--queue-bytes", "bytes of copies pending for the attached analyses, "
                            "all together (an equal share each); beyond its share copies are dropped for it "
                            "and counted, traffic is never affected; one that stops reading is detached",
                            AT_LEAST_ONE, metavar="BYTES")
    retain_bytes: int = knob(128 << 20, "--retain-bytes", "copies of requests in flight (and of ended ones "
                             "no analysis has acknowledged yet) kept for the snapshot an attaching analysis "
                             "gets; beyond it not kept, counted", AT_LEAST_ONE, metavar="BYTES")
    retain_ended: int = knob(100_000, "--retain-ended", "ended requests kept while no analysis acknowledged "
                             "them", AT_LEAST_ONE, metavar="N")
    loop: str = knob("auto", "--loop", "the relay's event loop: uvloop roughly halves its CPU per chunk; "
                     "auto = uvloop when installed", choices=LOOPS)

    def bounds(self) -> dict[str, Any]:
        """These fields by name (to build another `RelayBounds` from this one)."""
        return {k: getattr(self, k) for k in RelayBounds.__dataclass_fields__}

    def argv(self) -> list[str]:
        """`shadow tap`'s flags for these bounds."""
        return knob_argv(self)


@dataclass
class RelaySpec(RelayBounds):
    """What a relay serves: taps [{name, upstream, role}] and the hand-off's bounds."""

    taps: list[dict[str, str]]
    limits: dict[str, Any] = field(default_factory=dict)
    attach_token: str | None = None  # required of an analysis attaching over TCP
    group: str = ""
    restarts: int = 0  # relays of this group started before this one after a crash

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RelaySpec:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class RelaySockets:
    """Listening sockets a relay serves: `taps` by name, `attach` (unix and/or TCP), `admin`."""

    taps: dict[str, socket.socket]
    attach: list[socket.socket]
    admin: socket.socket | None = None

    def all(self) -> list[socket.socket]:
        return [*self.taps.values(), *self.attach, *([self.admin] if self.admin is not None else [])]


def tap_stats(taps: Iterable[Tap]) -> dict[str, Any]:
    return {
        "taps": {
            t.name: {
                "requests": t.requests,
                "connect_errors": t.connect_errors,
                "rejected": dict(t.rejected),
                "cut": dict(t.cut),
                "connections": t.connections,
                "inflight": t.inflight(),
            }
            for t in taps
        }
    }


class Relay:
    """See module docstring."""

    def __init__(self, spec: RelaySpec, sockets: RelaySockets) -> None:
        self.spec = spec
        self.sockets = sockets
        self.relay_id = secrets.token_hex(6)
        self.started = time.time()
        self.sink = ChannelSink(
            spec.queue_size, spec.queue_bytes, retain_bytes=spec.retain_bytes, retain_ended=spec.retain_ended,
            max_body=spec.max_body,
        )
        self.sink.on_detach = self._detached
        lim: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.limits.items()}
        limits = TapLimits(**lim)
        self.taps = [
            Tap(
                t["name"],
                t["upstream"],
                self.sink,
                max_body=spec.max_body,
                inject_usage=spec.inject_usage,
                limits=limits,
            )
            for t in spec.taps
        ]
        self.draining = False
        self.replaced = 0  # analyses that a newer attach replaced
        self.refused = dict.fromkeys(REFUSALS, 0)  # attach connections refused, by reason
        # attach connections not yet attached -> where from: "unix", or the TCP peer's address
        self._handshaking: dict[socket.socket, str] = {}
        self._told_protocol = False  # an analysis of another protocol was refused (said once)
        self._servers: list[asyncio.AbstractServer] = []
        self._attach_listeners: list[socket.socket] = []
        self._done = asyncio.Event()
        self._tasks: set[asyncio.Future[Any]] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(RelayCollector(self))

    def hello(self) -> dict[str, Any]:
        return {
            "relay_id": self.relay_id,
            "pid": os.getpid(),
            "boot_id": boot_id(),
            "group": self.spec.group,
            "taps": [
                {
                    "name": t.name,
                    "upstream": t.upstream,
                    "url": t.url,
                    "role": next(
                        (d.get("role", "decode") for d in self.spec.taps if d["name"] == t.name), "decode"
                    ),
                }
                for t in self.taps
            ],
        }

    # -- serving -----------------------------------------------------------------------------------

    async def run(
        self, ready: Callable[[dict[str, Any]], None] | None = None, drain_timeout_s: float = 30.0
    ) -> None:
        """Serve until drained (see `drain`) or `stop()`."""
        loop = asyncio.get_running_loop()
        for tap in self.taps:
            await tap.start(sock=self.sockets.taps[tap.name])
        for s in self.sockets.attach:
            s.setblocking(False)
            loop.add_reader(s.fileno(), self._accept_attach, s)
            self._attach_listeners.append(s)
        if self.sockets.admin is not None:
            self._servers.append(await loop.create_server(lambda: _AdminConn(self), sock=self.sockets.admin))
        self._drain_timeout = drain_timeout_s
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGTERM, self.drain)
            loop.add_signal_handler(signal.SIGUSR2, self.drain, True)
            loop.add_signal_handler(signal.SIGUSR1, self.stop)
        if ready is not None:
            ready({**self.hello(), "admin": self._admin_url()})
        try:
            while not self._done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._done.wait(), STATS_INTERVAL_S)
                self.sink.reap()
                self.mark()
        finally:
            await self._close()

    def _admin_url(self) -> str:
        a = self.sockets.admin
        if a is None:
            return ""
        h, p = a.getsockname()[:2]
        return f"http://[{h}]:{p}" if ":" in h else f"http://{h}:{p}"

    def mark(self, token: int = 0, to: str | None = None) -> None:
        self.sink.mark(token, tap_stats(self.taps), to)

    def drain(self, handoff: bool = False) -> None:
        """Stop accepting (the listening sockets stay open wherever else they are held: a successor
        relay takes the next connections), tell the analysis, let the streams in flight finish.
        `handoff` (SIGUSR2: a successor accepts): the clients' idle connections are kept until
        they close them, use them once more (answered `connection: close`) or the drain times out
        (`Front.begin_drain`). A drain (SIGTERM) during a hand-off stops waiting for idle
        connections; a second one ends the relay now."""
        if self.draining:
            if handoff:
                return
            if any(t.handoff for t in self.taps):
                for t in self.taps:
                    t.handoff = False
                return
            self.stop()  # a second signal: now
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        for s in self._attach_listeners:
            loop.remove_reader(s.fileno())
            s.close()
        self._attach_listeners.clear()
        for srv in self._servers:
            srv.close()
        for t in self.taps:
            t.begin_drain(handoff)
        self.sink.send_notice({"draining": True, "relay_id": self.relay_id})
        task = asyncio.ensure_future(self._drained())
        self._tasks.add(task)

    async def _drained(self) -> None:
        await asyncio.gather(*(t.drained(self._drain_timeout) for t in self.taps))
        self.stop()

    def stop(self) -> None:
        self._done.set()

    async def _close(self) -> None:
        loop = asyncio.get_running_loop()
        for s in self._attach_listeners:
            with contextlib.suppress(Exception):
                loop.remove_reader(s.fileno())
        for t in self.taps:
            with contextlib.suppress(Exception):
                await t.close()  # what is still in flight is cut (visibly: tap_shutdown)
        self.mark()
        for name in self.sink.analyses:
            self._unwatch(self.sink.sock(name))
        self.sink.close()
        for srv in self._servers:
            srv.close()

    # -- the attached analysis ---------------------------------------------------------------------

    def _accept_attach(self, listener: socket.socket) -> None:
        try:
            conn, addr = listener.accept()
        except (BlockingIOError, InterruptedError, OSError):
            return
        tcp = listener.family != socket.AF_UNIX
        peer = str(addr[0]) if tcp else "unix"
        if self.draining or not self._room(peer):
            self._refuse(conn, "busy" if not self.draining else "draining", handshake.head(handshake.BUSY))
            return
        self._handshaking[conn] = peer
        task = asyncio.ensure_future(self._attach(conn, tcp))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._handshaking.pop(conn, None))  # (whatever happened)

    def _room(self, peer: str) -> bool:
        """Another connection from `peer` may start a handshake: fewer than MAX_HANDSHAKES over TCP
        (the unix socket has as many of its own: abuse of the TCP port does not keep a local
        analysis out), fewer than MAX_HANDSHAKES_PER_PEER from one TCP address."""
        here = [p for p in self._handshaking.values() if (p == "unix") == (peer == "unix")]
        return len(here) < MAX_HANDSHAKES and (peer == "unix" or here.count(peer) < MAX_HANDSHAKES_PER_PEER)

    def _refuse(self, conn: socket.socket, reason: str, reply: bytes = b"") -> None:
        """Close an attach connection, counted under `reason`, after `reply` (best effort). What
        the peer had sent and is there to read (at most CONTROL_MAX) is read and dropped first, so
        that the close is not a reset that would lose the reply."""
        self.refused[reason] += 1
        self._handshaking.pop(conn, None)
        if reply:
            with contextlib.suppress(OSError):
                conn.setblocking(False)
                conn.send(reply)
                conn.recv(CONTROL_MAX)
        conn.close()

    async def _attach(self, conn: socket.socket, tcp: bool) -> None:
        """Authenticate an attach connection, read its hello (all within HANDSHAKE_TIMEOUT_S), attach it."""
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        token = self.spec.attach_token
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                if tcp and not token:
                    raise HandshakeError("proof", "no attach token: TCP attaches are refused")
                await handshake.server(loop, conn, token.encode() if tcp and token else b"", unix=not tcp)
                head = await handshake.recv_exact(loop, conn, HDR.size, "before its hello")
                kind, length = HDR.unpack(head)
                if length > CONTROL_MAX:
                    raise FrameError(f"a hello of {length} bytes")
                body = await handshake.recv_exact(loop, conn, length, "in its hello")
                cmd, hello = decode_control(kind, body)
                if not isinstance(hello, Hello):
                    raise FrameError(f"the first frame is {cmd}, not a hello")
        except HandshakeError as exc:
            if exc.reason == "protocol" and not self._told_protocol:
                self._told_protocol = True
                log.warning("shadow relay: refused an attach: %s", exc)
            self._refuse(conn, exc.reason, exc.reply)
            return
        except TimeoutError:
            self._refuse(conn, "timeout")
            return
        except FrameError:
            self._refuse(conn, "hello")
            return
        except OSError:
            self._refuse(conn, "closed")
            return
        self._handshaking.pop(conn, None)
        name = hello.name
        if self.draining:
            self._refuse(conn, "draining")  # a successor takes attaches now
            return
        if self.sink.sock(name) is None and self.sink.attached >= MAX_ANALYSES:
            self._refuse(conn, "full")
            return
        if self.sink.sock(name) is not None:
            self.replaced += 1
            self.sink.send_notice({"replaced": True}, to=name)
            self.sink.flush(name)  # (attach below detaches it; its hook stops watching it)
        resume_end = hello.end_seen if hello.relay_id == self.relay_id else 0
        size_buffers(conn)
        self.sink.attach(conn, self.hello(), resume_end, name=name)
        loop.add_reader(conn.fileno(), self._on_control, name, conn, FrameReader(CONTROL_MAX))

    def _on_control(self, name: str, conn: socket.socket, frames: FrameReader) -> None:
        data = read_now(lambda: conn.recv(65536))
        if data is None:
            return
        reason = "closed"
        try:
            if data:
                for kind, body in frames.feed(data):
                    if self.sink.sock(name) is conn:
                        self._control(name, kind, body)
                return
        except FrameError:
            reason = "bad_frame"
        self._unwatch(conn)  # closed, or a bad frame
        if self.sink.sock(name) is conn:
            self.sink.detach(name, reason)

    def _detached(self, name: str, conn: socket.socket) -> None:
        """The sink detached analysis `name` (its socket broke, or it was replaced or ended): stop
        reading its control frames before the sink closes the socket (a closed socket left watched
        would wake the loop for ever)."""
        self._unwatch(conn)

    def _unwatch(self, conn: socket.socket | None) -> None:
        fd = conn.fileno() if conn is not None else -1
        if fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)

    def _control(self, name: str, kind: int, body: bytes) -> None:
        """One control frame of analysis `name` (FrameError when malformed, or a second hello)."""
        cmd, arg = decode_control(kind, body)
        if cmd == "sync":
            self.mark(arg, to=name)
        elif cmd == "ack":
            self.sink.ack(arg, name)
        else:
            raise FrameError("a second hello")


class _AdminConn(asyncio.Protocol):
    """GET /metrics (Prometheus text) and GET /health on the admin socket; anything else 404."""

    MAX_HEAD = 8 << 10

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.fed = 0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.timer = asyncio.get_running_loop().call_later(10.0, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes) -> None:
        self.fed += len(data)
        try:
            if self.fed > self.MAX_HEAD:
                raise HttpParserError("head too large")
            self.parser.feed_data(data)
        except HttpParserError:
            self._answer(400, b"bad request\n", b"text/plain")

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        path = self.url.split(b"?", 1)[0]
        method = self.parser.get_method()
        if method not in (b"GET", b"HEAD"):
            self._answer(405, b"method not allowed\n", b"text/plain")
        elif path == b"/metrics":
            self._answer(
                200, generate_latest(self.relay.registry), b"text/plain; version=0.0.4; charset=utf-8"
            )
        elif path in (b"/health", b"/ready"):
            ok = not self.relay.draining or path == b"/health"
            self._answer(200 if ok else 503, b"ok\n" if ok else b"draining\n", b"text/plain")
        else:
            self._answer(404, b"not found\n", b"text/plain")

    def _answer(self, status: int, body: bytes, ctype: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        reason = {
            200: b"OK",
            400: b"Bad Request",
            404: b"Not Found",
            405: b"Method Not Allowed",
            503: b"Service Unavailable",
        }[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, reason, ctype, len(body), body)
        )
        self.transport.close()


def serve_relay(spec: RelaySpec, sockets: RelaySockets, ready_fd: int, drain_timeout_s: float) -> int:
    """Run a relay in this process until it has drained; `ready_fd` gets one JSON line when it
    accepts. SIGTERM drains (a second one ends it now), SIGUSR2 drains for a successor, SIGUSR1
    ends it now (open streams are cut, visibly); SIGINT is the supervisor's to handle."""
    from shadow.base.runtime import loop_runner, raise_fd_limit, tune_gc

    raise_fd_limit()
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def ready(doc: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            os.write(ready_fd, json.dumps(doc).encode() + b"\n")
            os.close(ready_fd)

    relay = Relay(spec, sockets)
    tune_gc()
    loop_runner(spec.loop if spec.loop in ("asyncio", "uvloop") else "auto")(
        relay.run(ready, drain_timeout_s)
    )
    return 0


def main() -> None:
    """A relay started by its supervisor in a fresh interpreter: spec and fd numbers on stdin."""
    doc = json.loads(sys.stdin.readline())
    fds = doc["fds"]
    sockets = RelaySockets(
        taps={n: socket.socket(fileno=fd) for n, fd in fds["taps"].items()},
        attach=[socket.socket(fileno=fd) for fd in fds["attach"]],
        admin=socket.socket(fileno=fds["admin"]) if fds.get("admin") is not None else None,
    )
    raise SystemExit(
        serve_relay(
            RelaySpec.from_dict(doc["spec"]), sockets, int(doc["ready_fd"]), float(doc["drain_timeout_s"])
        )
    )
