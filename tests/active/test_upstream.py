"""`shadow.active.upstream.send` tells a request that never completely left from one the upstream
may be running, against raw loopback servers (real sockets; requests framed by llhttp):

- nothing listening: `Unsent`;
- the connection closed under the request before its body was written (what httpcore's pool does
  when it closes a connection it had just handed to a request, encode/httpcore#1110): `Unsent`,
  and the server never saw a whole request;
- the whole request written, then the connection closed without an answer: httpx's own error
  (never `Unsent`: the upstream may be running it).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httptools
import httpx
import pytest

from shadow.active.upstream import Unsent, send


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


class Seen:
    """What a raw server parsed: heads and complete requests."""

    def __init__(self) -> None:
        self.heads = 0
        self.complete = 0

    def on_headers_complete(self) -> None:
        self.heads += 1

    def on_message_complete(self) -> None:
        self.complete += 1


async def _server(close_after: str, seen: Seen) -> tuple[asyncio.Server, str]:
    """A server that never answers: it closes each connection once it parsed a whole request
    (`request`), or only when the client does (`none`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = httptools.HttpRequestParser(seen)
        before = seen.complete
        while True:
            data = await reader.read(65536)
            if not data:
                break
            parser.feed_data(data)
            if close_after == "request" and seen.complete > before:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_nothing_listening_is_unsent() -> None:
    async def scenario() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
            async with httpx.AsyncClient() as c:
                with pytest.raises(Unsent) as info:
                    await send(c, c.build_request("POST", url + "/v1/completions", content=b"{}"))
        assert isinstance(info.value.cause, httpx.ConnectError)

    run(scenario)


def test_a_connection_closed_under_the_request_before_its_body_was_written_is_unsent() -> None:
    """The production failure, made deterministic: the request head is out, then the pool closes
    the connection (as httpcore's `_close_connections` does with a connection it had already
    handed to this request), then the rest of the body is due: httpx says ReadError (caused by
    the closed stream); `send` says Unsent, and no whole request reached the server."""

    async def scenario() -> None:
        seen = Seen()
        server, url = await _server("none", seen)
        rest = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            yield b'{"prompt": '
            await rest.wait()
            yield b'"x"}'

        transport = httpx.AsyncHTTPTransport()
        async with httpx.AsyncClient(transport=transport) as c:
            req = c.build_request("POST", url + "/v1/completions", content=body(),
                                  headers={"content-length": "15"})
            task = asyncio.create_task(send(c, req))
            while seen.heads == 0:  # the head reached the server
                await asyncio.sleep(0.005)
            (conn,) = transport._pool.connections  # the pool's view (httpx keeps it private)
            await conn.aclose()  # what the pool does to a connection it judged expired
            rest.set()
            with pytest.raises(Unsent) as info:
                await task
        assert isinstance(info.value.cause, httpx.ReadError)
        assert seen.heads == 1 and seen.complete == 0  # no whole request reached the server
        server.close()
        await server.wait_closed()

    run(scenario)


def test_a_written_request_without_an_answer_is_not_unsent() -> None:
    async def scenario() -> None:
        seen = Seen()
        server, url = await _server("request", seen)
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.HTTPError) as info:
                await send(c, c.build_request("POST", url + "/v1/completions", content=b'{"prompt": "x"}'))
        assert not isinstance(info.value, Unsent) and seen.complete == 1
        server.close()
        await server.wait_closed()

    run(scenario)
