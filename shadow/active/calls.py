"""The active proxy's calls to its upstreams: one persistent connection pool per upstream base URL
(opened by `open`, closed by `close`), each call in its own CLIENT span whose `traceparent` it
carries. `send` tells a request that never completely left (`upstream.Unsent`) from one that did,
and races the call against the client going away when given its `gone` future.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import httpx
from opentelemetry import trace

from shadow.active.clientgone import race
from shadow.active.upstream import send
from shadow.telemetry.httpspans import client_failed, client_status, inject_span


class UpstreamCalls:
    """Connection pools and traced sends (see module docstring); `api_key` goes on every P/D leg."""

    def __init__(self, tracer: trace.Tracer, api_key: str | None) -> None:
        self.tracer = tracer
        self.api_key = api_key
        self._clients: dict[str, httpx.AsyncClient] = {}

    @property
    def is_open(self) -> bool:
        """The pools are open."""
        return bool(self._clients)

    def open(self, urls: Iterable[str], limits: httpx.Limits, timeout: httpx.Timeout) -> None:
        """One pool per base URL in `urls`."""
        for url in urls:
            self._clients[url] = httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def client(self, url: str) -> httpx.AsyncClient:
        """The pool of base URL `url` (RuntimeError before `open`)."""
        client = self._clients.get(url)
        if client is None:
            raise RuntimeError("proxy not started")
        return client

    def headers(self, rid: str, call: trace.Span) -> dict[str, str]:
        """A P/D leg's headers; its `traceparent` names the call's CLIENT span `call`."""
        h = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return inject_span(call, h)

    async def send(self, call: trace.Span, client: httpx.AsyncClient, req: httpx.Request,
                   gone: asyncio.Future[Any] | None, stream: bool = False) -> httpx.Response:
        """`req` sent (raced against `gone`) in its CLIENT span `call`, which records the answer's
        status or the failure; it ends here unless a `stream`ed answer follows (its reader ends it)."""
        try:
            aw = send(client, req, stream=stream)
            r: httpx.Response = await (race(aw, gone) if gone is not None else aw)
        except BaseException as exc:
            client_failed(call, exc)
            call.end()
            raise
        client_status(call, r.status_code)
        if not stream:
            call.end()
        return r
