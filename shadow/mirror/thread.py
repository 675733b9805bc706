"""Event loops in background threads: `LoopThread` (one loop, used for the service's analysis side)
and `TapThread` (a whole `TapService` off the caller's thread: demo, tests, notebooks)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
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


class TapThread:
    """`with TapThread(config) as t:` — `t.ready` is the ready document, `t.svc` the service.

    The service starts on this thread's loop (the taps relay there with `relay="thread"`, in a child
    process with `relay="process"`); `sync`/`wait_for` run on the service's analysis loop, where the
    mirrored state lives; `settle()` waits for the analysis watermark.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.relay = LoopThread("shadow-tap")
        self.svc: Any = None
        self.ready: dict[str, Any] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self.relay.loop is not None
        return self.relay.loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine on the relay loop and wait for its result."""
        return self.relay.call(coro, timeout)

    def sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn(*args)` on the analysis loop (state is only touched from there)."""
        return self.svc.analysis.sync(fn, *args)  # type: ignore[no-any-return]

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until the analysis has consumed everything the taps offered so far."""
        return self.call(self.svc.settle(timeout), timeout + 5)  # type: ignore[no-any-return]

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Settle the analysis, then poll `pred` on its loop until it holds or `timeout` passes."""
        self.settle(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sync(pred):
                return True
            time.sleep(0.02)
        return bool(self.sync(pred))

    def __enter__(self) -> TapThread:
        from shadow.mirror.service import TapService

        self.relay.start()

        async def _start() -> dict[str, Any]:
            self.svc = TapService(self.config)
            return await self.svc.start()  # type: ignore[no-any-return]

        self.ready = self.call(_start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self.svc.stop())
        finally:
            self.relay.stop()
