"""Test helpers: a TapService running in its own event loop thread, and a raw HTTP/1.1 client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shadow.mirror.service import TapService
from shadow.mirror.thread import LoopThread

T = TypeVar("T")


class TapThread:
    """`with TapThread(config) as t:` — `t.ready` is the ready document, `t.svc` the service.

    The service starts on this thread's loop (the taps relay there with `relay="thread"`, in a child
    process with `relay="process"`); `sync`/`wait_for` run on the service's analysis loop, where the
    mirrored state lives; `settle()` waits for the analysis watermark.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.relay = LoopThread("shadow-tap")
        self.svc: Any = None
        self.ready: dict[str, Any] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self.relay.loop is not None
        return self.relay.loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine on the relay loop and wait for its result."""
        return self.relay.call(coro, timeout)

    def sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn(*args)` on the analysis loop (state is only touched from there)."""
        return self.svc.analysis.sync(fn, *args)  # type: ignore[no-any-return]

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until the analysis has consumed everything the taps offered so far."""
        return self.call(self.svc.settle(timeout), timeout + 5)  # type: ignore[no-any-return]

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Settle the analysis, then poll `pred` on its loop until it holds or `timeout` passes."""
        self.settle(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sync(pred):
                return True
            time.sleep(0.02)
        return bool(self.sync(pred))

    def __enter__(self) -> TapThread:
        self.relay.start()

        async def _start() -> dict[str, Any]:
            self.svc = TapService(self.config)
            return await self.svc.start()  # type: ignore[no-any-return]

        self.ready = self.call(_start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self.svc.stop())
        finally:
            self.relay.stop()

    def drain(self) -> None:
        self.call(self.svc.drain())


async def raw_request(host: str, port: int, request: bytes, *, timeout: float = 10) -> bytes:
    """Send one raw request with `Connection: close` semantics and return every byte until EOF."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()


def http_post(
    path: str, body: bytes, *, host: str = "127.0.0.1", rid: str | None = None, close: bool = True
) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    if rid:
        lines.append(f"X-Request-Id: {rid}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers without date/server/connection, raw body bytes as on the wire)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        k = k.strip().lower()
        if k in ("date", "server", "connection", "keep-alive"):
            continue
        headers[k] = v.strip()
    return status, headers, body
