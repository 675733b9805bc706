"""Run a `ServeService` on its own event loop in a background thread (demo, tests, notebooks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from shadow.live.service import ServeConfig, ServeService

T = TypeVar("T")


class ServeThread:
    """`with ServeThread(config) as s:` — `s.ready` is the ready document, `s.svc` the service."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="shadow-serve", daemon=True)
        self.svc: ServeService
        self.ready: dict[str, Any] = {}

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run a coroutine on the service's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServeThread:
        self.thread.start()

        async def _start() -> dict[str, Any]:
            self.svc = ServeService(self.config)
            return await self.svc.start()

        self.ready = self.call(_start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self.svc.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
