"""A real uvicorn server with the h11 protocol that records every request it frames (method, path,
body length and bytes, peer port), for differential tests of the fronts' framing and attack tests."""

from __future__ import annotations

import array
import fcntl
import socket
import termios
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn


@dataclass
class Seen:
    method: str
    path: str
    body_len: int
    peer_port: int
    body: bytes = b""


@dataclass
class Recorder:
    seen: list[Seen] = field(default_factory=list)
    started: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: int = 0


def recording_app(rec: Recorder) -> Any:
    """ASGI app: records each request as framed by h11, answers 200 `ok <path>` (or per path)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        with rec.lock:
            rec.started += 1
            rec.inflight += 1
        try:
            parts: list[bytes] = []
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    break
                parts.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    break
            body = b"".join(parts)
            peer = scope.get("client") or ("", 0)
            with rec.lock:
                rec.seen.append(Seen(scope["method"], scope["path"], len(body), int(peer[1]), body))
            answer = b"ok " + scope["path"].encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))],
                }
            )
            await send({"type": "http.response.body", "body": answer})
        finally:
            with rec.lock:
                rec.inflight -= 1

    return app


def unread(transports: list[Any]) -> int:
    """Bytes waiting unread in the kernel for these transports' sockets (FIONREAD)."""
    n = 0
    for t in transports:
        sock = t.get_extra_info("socket") if t is not None else None
        if sock is None:
            continue
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        except OSError:
            continue
        n += buf[0]
    return n


def accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the loopback listener on `port` (Linux: the
    receive-queue column of a listening socket's /proc/net/tcp line)."""
    local = f"0100007F:{port:04X}"
    with open("/proc/net/tcp", encoding="ascii") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[3] == "0A":  # (0A: LISTEN)
                return int(fields[4].split(":")[1], 16)
    return 0


class H11Server:
    """uvicorn (http="h11") on a free loopback port in a daemon thread."""

    def __init__(self, app: Any, *, keep_alive_s: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(
            app,
            http="h11",
            log_level="critical",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=int(keep_alive_s) or 1,
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def connections(self) -> int:
        """Connections the server still holds open."""
        return len(self.server.server_state.connections)

    def settled(self) -> bool:
        """Nothing sent to this server is still to be handled: no connection waiting to be accepted,
        no app running, and no connection with bytes unread in its socket (what a peer wrote and
        then walked away from is read, framed and handed to the app in one callback, so a request on
        its way shows in one or the other). Read from another thread: a set changing under the copy
        reads as not settled."""
        if accept_queue(self.port):
            return False  # a connection (and maybe a request on it) the loop has not accepted yet
        state = self.server.server_state
        try:
            if state.tasks:
                return False
            conns = list(state.connections)
        except RuntimeError:
            return False
        return unread([getattr(c, "transport", None) for c in conns]) == 0

    def __enter__(self) -> H11Server:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("h11 server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
