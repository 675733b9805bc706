"""An asyncio event loop in a background thread (the tap service's analysis side, test harnesses)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running forever in a daemon thread; `start()`, `submit/call/sync`, `stop()`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=self.name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on this loop (from any other thread)."""
        assert self.loop is not None, "LoopThread not started"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine on this loop and wait for its result (blocking the calling thread)."""
        return self.submit(coro).result(timeout)

    def sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn(*args)` on this loop and wait for the result."""

        async def _run() -> T:
            return fn(*args)

        return self.call(_run())

    def stop(self) -> None:
        loop, thread = self.loop, self.thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not thread.is_alive():
            loop.close()
        self.thread = None

