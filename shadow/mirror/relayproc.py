"""The relay process: the taps alone on their own event loop, in their own interpreter, so that no
analysis, API or housekeeping work can take the GIL (or the loop) from the relay.

`RelayProcess(...)` (in the analysis process) starts `python -m shadow.mirror.relayproc` with the
taps' listening sockets (bound by the parent, so their addresses are known at once), a data socket
(relay → analysis: `ChannelSink` frames) and a control socket (analysis → relay: marshal frames
`("sync", token)`, `("drain", seconds)`, `("stop", 0)`). The child ignores SIGINT/SIGTERM (the parent
drains it) and exits when the control socket closes, so it never outlives the parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import marshal
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from shadow.base.runtime import loop_runner, tune_gc
from shadow.mirror.channel import _HDR, T_CTL, ChannelSink, frame
from shadow.mirror.http1 import TapLimits
from shadow.mirror.proxy import Tap

STATS_INTERVAL_S = 0.25


def _tap_stats(taps: list[Tap]) -> dict[str, Any]:
    return {
        "taps": {
            t.name: {
                "requests": t.requests,
                "connect_errors": t.connect_errors,
                "rejected": dict(t.rejected),
                "connections": t.connections,
                "inflight": t.inflight(),
            }
            for t in taps
        }
    }


async def _relay(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    data = socket.socket(fileno=spec["data_fd"])
    ctl = socket.socket(fileno=spec["ctl_fd"])
    ctl.setblocking(False)
    sink = ChannelSink(data, spec["queue_size"], spec["queue_bytes"])
    lim: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["limits"].items()}
    limits = TapLimits(**lim)
    taps = [
        Tap(
            t["name"],
            t["upstream"],
            sink,
            max_body=spec["max_body"],
            inject_usage=spec["inject_usage"],
            limits=limits,
        )
        for t in spec["taps"]
    ]
    for t, desc in zip(taps, spec["taps"], strict=True):
        await t.start(sock=socket.socket(fileno=desc["fd"]))
    done = asyncio.Event()
    buf = bytearray()

    def mark(token: int = 0) -> None:
        sink.mark(token, {**_tap_stats(taps), "pending_bytes": sink.bytes})

    async def drain(timeout_s: float, token: int) -> None:
        for t in taps:
            t.begin_drain()
        await asyncio.gather(*(t.drained(timeout_s) for t in taps))
        mark(token)

    def on_control() -> None:
        try:
            chunk = ctl.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the analysis process is gone (or stopped us): end now
            done.set()
            return
        buf.extend(chunk)
        while len(buf) >= _HDR.size:
            kind, length = _HDR.unpack_from(buf)
            if len(buf) < _HDR.size + length:
                break
            cmd, arg = marshal.loads(bytes(buf[_HDR.size : _HDR.size + length]))
            del buf[: _HDR.size + length]
            if kind != T_CTL:
                continue
            if cmd == "sync":
                mark(int(arg))
            elif cmd == "drain":
                token, timeout_s = arg
                task = asyncio.ensure_future(drain(float(timeout_s), int(token)))
                task.add_done_callback(lambda _t: None)
                tasks.add(task)
            elif cmd == "stop":
                done.set()

    tasks: set[asyncio.Future[None]] = set()
    loop.add_reader(ctl.fileno(), on_control)
    mark(1)  # ready
    try:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), STATS_INTERVAL_S)
            mark()
    finally:
        loop.remove_reader(ctl.fileno())
        for t in taps:
            with contextlib.suppress(Exception):
                await t.close()
        mark()
        sink.close()


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the analysis process drains us; EOF on control ends us
    runner = loop_runner("asyncio" if spec.get("loop") == "asyncio" else "auto")
    tune_gc()
    runner(_relay(spec))


class RelayProcess:
    """The parent's handle: `start()` spawns the child; `send(cmd, arg)` on the control socket;
    `data` is the socket the analysis reads; `stop()` closes control and waits for the child."""

    def __init__(
        self, spec: dict[str, Any], listeners: list[socket.socket], buffer_bytes: int = 4 << 20
    ) -> None:
        self.spec = spec
        self.buffer_bytes = buffer_bytes  # the data socket's kernel buffers (part of the hand-off bound)
        self.listeners = listeners
        self.proc: subprocess.Popen[bytes] | None = None
        self.data: socket.socket | None = None
        self.ctl: socket.socket | None = None
        self._token = 1
        self._lock = threading.Lock()  # sync/drain/stop come from the API's thread and the caller's

    def start(self) -> None:
        data_p, data_c = socket.socketpair()
        ctl_p, ctl_c = socket.socketpair()
        for s in (data_p, data_c):
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer_bytes)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer_bytes)
        spec = dict(self.spec, data_fd=data_c.fileno(), ctl_fd=ctl_c.fileno())
        for desc, sock in zip(spec["taps"], self.listeners, strict=True):
            desc["fd"] = sock.fileno()
        fds = [data_c.fileno(), ctl_c.fileno(), *(s.fileno() for s in self.listeners)]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        boot = f"import sys; sys.path.insert(0, {root!r}); from shadow.mirror.relayproc import main; main()"
        self.proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE, pass_fds=fds)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec).encode() + b"\n")
        self.proc.stdin.close()
        data_c.close()
        ctl_c.close()
        for s in self.listeners:
            s.close()  # the child serves them now
        data_p.setblocking(False)
        self.data, self.ctl = data_p, ctl_p

    def next_token(self) -> int:
        with self._lock:
            self._token += 1
            return self._token

    def send(self, cmd: str, arg: Any) -> None:
        """One control frame (tiny; a blocking send is bounded by the socket buffer)."""
        with self._lock, contextlib.suppress(OSError):
            if self.ctl is not None:
                self.ctl.sendall(frame(T_CTL, (cmd, arg)))

    def close_control(self) -> None:
        with self._lock:
            if self.ctl is not None:
                with contextlib.suppress(OSError):
                    self.ctl.close()
                self.ctl = None

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return 0
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


if __name__ == "__main__":
    main()
