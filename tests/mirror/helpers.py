"""Test helpers: a TapService running in its own event loop thread, and a raw HTTP/1.1 client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from shadow.mirror.service import TapConfig, TapService

T = TypeVar("T")


class TapInThread:
    """`with TapInThread(config) as t:` — t.ready is the ready document, t.svc the service."""

    def __init__(self, config: TapConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.svc: TapService
        self.ready: dict[str, Any] = {}

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self, fn: Any, *args: Any) -> Any:
        async def _run() -> Any:
            return fn(*args)

        return self.call(_run())

    def __enter__(self) -> TapInThread:
        self.thread.start()

        async def _start() -> dict[str, Any]:
            self.svc = TapService(self.config)
            return await self.svc.start()

        self.ready = self.call(_start())
        return self

    def drain(self) -> None:
        self.call(self.svc.drain())

    def wait_for(self, pred: Any, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sync(pred):
                return True
            time.sleep(0.01)
        return bool(self.sync(pred))

    def __exit__(self, *exc: Any) -> None:
        try:
            self.call(self.svc.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


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
