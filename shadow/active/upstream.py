"""Sending a request upstream so that it is never sent twice: `send` tells a request that did not
completely leave this process from one that did.

httpx raises the same `ReadError` for a request the upstream may be running (written, then the
connection broke) and for one whose body never left: httpcore swallows a failed write and reports
the read that follows. The difference matters because a connection can be closed under a request
by httpcore's own pool — an idle connection handed to a request is still "idle" until that request
starts on it, and a concurrent pass closes it once its keep-alive expiry passes
(encode/httpcore#1110, open in httpcore 1.0.9) — and by an upstream closing a kept-alive
connection. `send` watches httpcore's trace events: until the request body was completely handed
to the socket, the upstream cannot have acted on it (HTTP framing: an incomplete body is no
request), so the failure is `Unsent` and the caller may send it again, on another connection.
"""

from __future__ import annotations

from typing import Any

import httpx


class Unsent(Exception):
    """The request did not completely reach the upstream (safe to send again); `cause` is httpx's."""

    def __init__(self, cause: httpx.HTTPError) -> None:
        super().__init__(f"not sent: {type(cause).__name__}")
        self.cause = cause


async def send(client: httpx.AsyncClient, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
    """`client.send(request)`; a failure before the request body was completely written raises
    `Unsent` (from httpx's error), any later one httpx's error itself."""
    written = False

    async def trace(event: str, info: dict[str, Any]) -> None:
        nonlocal written
        if event.endswith("send_request_body.complete"):
            written = True

    request.extensions["trace"] = trace
    try:
        return await client.send(request, stream=stream)
    except httpx.HTTPError as exc:
        if written:
            raise
        raise Unsent(exc) from exc
