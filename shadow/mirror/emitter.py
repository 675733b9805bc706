"""A tiny client for the event API: batches events and POSTs them as NDJSON, never raising.

Usage::

    async with Emitter("http://127.0.0.1:9000") as em:
        em.emit(Route("r1", t, "d0"))

`emit` is synchronous and cheap (appends to a bounded buffer; a full buffer drops and counts).
A background task posts batches every `flush_interval_s` or when `batch_size` is reached; HTTP
errors are counted (`errors`) and the batch is dropped (`dropped`), never retried forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from types import TracebackType
from typing import Any

import httpx

from shadow.contracts.events import Event
from shadow.mirror.hub import event_line


class Emitter:
    """See module docstring. `transport` swaps the HTTP layer (e.g. httpx.MockTransport in tests)."""

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 500,
        flush_interval_s: float = 0.2,
        max_buffer: int = 100_000,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/v1/events") else base + "/v1/events"
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_buffer = max_buffer
        self._buf: deque[str] = deque()
        self._client = httpx.AsyncClient(
            transport=transport, timeout=timeout_s, headers=headers, trust_env=False
        )
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self.rejected = 0

    def emit(self, event: Event | dict[str, Any]) -> bool:
        """Queue one event (or an already-built dict); False when dropped. Never raises."""
        try:
            if len(self._buf) >= self.max_buffer:
                self.dropped += 1
                return False
            line = json.dumps(event, separators=(",", ":")) if isinstance(event, dict) else event_line(event)
            self._buf.append(line)
            if len(self._buf) >= self.batch_size and self._wake is not None:
                self._wake.set()
            return True
        except Exception:
            self.errors += 1
            return False

    def __call__(self, event: Event) -> None:
        """So that an Emitter can be a `Mirror` listener (forwarding a tap process's events)."""
        self.emit(event)

    async def flush(self) -> None:
        """Post everything buffered now, in batches; never raises."""
        while self._buf:
            n = min(self.batch_size, len(self._buf))
            lines = [self._buf.popleft() for _ in range(n)]
            try:
                resp = await self._client.post(
                    self.url,
                    content=("\n".join(lines) + "\n").encode(),
                    headers={"content-type": "application/x-ndjson"},
                )
                if resp.status_code >= 400:
                    self.errors += 1
                    self.dropped += n
                    continue
                self.sent += n
                with contextlib.suppress(Exception):
                    self.rejected += sum(resp.json().get("rejected", {}).values())
            except asyncio.CancelledError:
                self.dropped += n  # cancelled from outside mid-post: counted, not lost silently
                raise
            except Exception:
                self.errors += 1
                self.dropped += n

    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._closing:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            self._wake.clear()
            await self.flush()

    def start(self) -> None:
        """Start the background flusher (needs a running loop)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def aclose(self) -> None:
        """Let the flusher finish the batch it is posting (never cut a post short: the batch would
        be lost), then post what is left and close the client."""
        if self._task is not None:
            self._closing = True
            if self._wake is not None:
                self._wake.set()
            with contextlib.suppress(Exception):
                await self._task
            self._task = None
        await self.flush()
        await self._client.aclose()

    async def __aenter__(self) -> Emitter:
        self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
