"""Run a `TapService` on its own event loop in a background thread (demo, tests, notebooks)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shadow.mirror.service import TapConfig, TapService

T = TypeVar("T")


class TapThread:
    """`with TapThread(config) as t:` — `t.ready` is the ready document, `t.svc` the service."""

    def __init__(self, config: TapConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="shadow-tap", daemon=True)
        self.svc: TapService
        self.ready: dict[str, Any] = {}

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine on the service's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn(*args)` on the service's loop (state is only touched from there)."""

        async def _run() -> T:
            return fn(*args)

        return self.call(_run())

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Poll `pred` on the loop until it holds or `timeout` passes; returns its last value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sync(pred):
                return True
            time.sleep(0.02)
        return bool(self.sync(pred))

    def __enter__(self) -> TapThread:
        self.thread.start()

        async def _start() -> dict[str, Any]:
            self.svc = TapService(self.config)
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
