"""Test helpers: a raw HTTP/1.1 client for the taps; a stream read with the official openai client;
attaching to a relay by hand."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, TypeVar

import openai
import pytest

from shadow.contracts import handshake
from shadow.contracts.frames import T_CTL, Hello, encode, encode_hello

T = TypeVar("T")


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


def dechunk(body: bytes) -> tuple[bytes, bool]:
    """A chunked body's payload (the bytes after the head) and whether it ended with the
    terminating zero-length chunk."""
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return out, True
        out, rest = out + rest[:size], rest[size + 2:]
    return out, False


async def openai_stream_error(base_url: str, raises: type[openai.APIError] = openai.APIError
                              ) -> tuple[list[Any], openai.APIError]:
    """A streamed completion through `base_url` (`.../v1`) with the official openai client, read
    until it raises `raises` (the test fails if it ends otherwise): the chunks before, and the error."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    got: list[Any] = []
    try:
        with pytest.raises(raises) as raised:
            stream = await client.completions.create(model="m", prompt="p", stream=True)
            async for chunk in stream:
                got.append(chunk)
    finally:
        await client.close()
    return got, raised.value


def _exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from a blocking socket (fewer when it closes first)."""
    buf = b""
    while len(buf) < n and (chunk := sock.recv(n - len(buf))):
        buf += chunk
    return buf


def attach_by_hand(sock: socket.socket, name: Any, key: bytes = b"") -> bytes:
    """Attach to a relay on a connected blocking socket as an analysis does — the handshake with
    `key` (the attach token; empty on the unix socket), then a hello under `name` (any JSON value:
    a wrong one is for the relay to refuse) — and return what the relay sent first (b"": refused)."""
    msg, nonce = handshake.opening()
    sock.sendall(msg)
    head = _exactly(sock, handshake.HEAD)
    if len(head) < handshake.HEAD:
        return b""
    handshake.answer_status(head)
    sock.sendall(handshake.prove(key, nonce, _exactly(sock, handshake.ANSWER)))
    sock.sendall(encode_hello(Hello(name, "", 0)) if isinstance(name, str) else
                 encode(T_CTL, ["hello", {"name": name}]))
    return sock.recv(1 << 16)


async def attach_on_loop(sock: socket.socket, name: str, key: bytes = b"") -> None:
    """`attach_by_hand`'s handshake and hello, on the running loop (a non-blocking socket)."""
    loop = asyncio.get_running_loop()
    await handshake.client(loop, sock, key)
    await loop.sock_sendall(sock, encode_hello(Hello(name, "", 0)))
