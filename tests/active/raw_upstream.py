"""A scripted HTTP/1.1 upstream on its own event-loop thread: each request is answered by an async
function that writes raw bytes (so a test can send exactly the framing an attack needs)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Script = Callable[["Exchange"], Awaitable[None]]


@dataclass
class Exchange:
    """One request as the upstream read it, and the writer to answer it with."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    writer: asyncio.StreamWriter
    sent: list[bytes] = field(default_factory=list)

    async def send(self, data: bytes) -> None:
        self.sent.append(data)
        self.writer.write(data)
        await self.writer.drain()

    async def chunk(self, data: bytes) -> None:
        """One chunk of a chunked body (the body bytes are recorded, not the framing)."""
        self.sent.append(data)
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await self.writer.drain()

    async def end_chunks(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    @property
    def body_sent(self) -> bytes:
        return b"".join(self.sent)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"date: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: raw-upstream\r\n\r\n"
)


class RawUpstream:
    """`with RawUpstream(script) as up:` — `up.url`; `up.exchanges` holds every request served."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.exchanges: list[Exchange] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="raw-upstream", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self.url = ""

    def __enter__(self) -> RawUpstream:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for ln in lines[1:]:
                    if ":" in ln:
                        k, v = ln.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                ex = Exchange(method, path, headers, body, writer)
                self.exchanges.append(ex)
                await self.script(ex)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


class Held:
    """A script: the SSE head and a first event (" t0"), then, once `release` is set, a second
    (" t1"), [DONE] and the end: a stream held in flight for as long as a test needs."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def script(self, ex: Exchange) -> None:
        await ex.send(SSE_HEAD)
        await ex.chunk(b'data: {"choices":[{"index":0,"text":" t0"}]}\n\n')
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        await ex.chunk(b'data: {"choices":[{"index":0,"text":" t1","finish_reason":"length"}]}\n\n'
                       b"data: [DONE]\n\n")
        await ex.end_chunks()
