"""Minimal raw-ASGI helpers for the fleet's servers: bounded body reading, plain and JSON
responses, disconnect watching, and `StreamCut` to drop a connection mid-response.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from shadow.fleet.sse import JSON_CONTENT_TYPE, dumps

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

_DRAIN_CAP = 64 << 20  # stop draining an oversized body after this many extra bytes


class StreamCut(Exception):
    """Raised by a handler after the response started: the server closes the connection."""


class BodyTooLarge(Exception):
    """The request body exceeds the configured limit (it was drained, up to a cap)."""


class ClientGone(Exception):
    """The client disconnected before the request body was read."""


class _DropStreamCut(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamCut)


def quiet_stream_cuts() -> None:
    """Keep uvicorn from logging our deliberate connection cuts as application errors."""
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropStreamCut) for f in log.filters):
        log.addFilter(_DropStreamCut())


def header(scope: Scope, name: bytes) -> str | None:
    """First value of request header `name` (lower-case bytes), decoded as latin-1."""
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v).decode("latin-1")
    return None


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; BodyTooLarge past `limit` bytes, ClientGone on disconnect."""
    chunks: list[bytes] = []
    size = 0
    too_large = False
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        data = msg.get("body", b"")
        size += len(data)
        if size > limit:
            too_large = True
            chunks.clear()
            if size > limit + _DRAIN_CAP:
                raise BodyTooLarge
        elif data:
            chunks.append(data)
        if not msg.get("more_body", False):
            break
    if too_large:
        raise BodyTooLarge
    return b"".join(chunks)


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes | None, headers: Headers | None = None
) -> None:
    hdrs: Headers = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        hdrs.append((b"content-type", content_type))
    if headers:
        hdrs.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, obj: Any, headers: Headers | None = None) -> None:
    await send_bytes(send, status, dumps(obj).encode(), JSON_CONTENT_TYPE, headers)


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Wait for the client to go away, then call `on_disconnect` (run as a task; cancel it after)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            on_disconnect()
            return
