"""A bounded hand-off from the relay loop to the analysis side that never blocks and never raises.

`put` is called on the relay loop: it appends or, when full (items or bytes), drops and counts.
`put_end` is for end-of-request markers, which must not be lost (a lost end would leave a phantom
request): when the queue is full they go to a side list holding at most one entry per request.
The consumer awaits `get_batch` on its own event loop, possibly in another thread (a wake-up is
sent there only when it is idle). Watermark: `offered` items went in; `taken` came out; drops
are counted in `dropped` (so offered == taken + dropped + len(queue)).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Any


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class DropQueue:
    """Bounded FIFO; see module docstring. `max_bytes` bounds the payload bytes held (`put(nbytes=)`)."""

    def __init__(self, maxsize: int = 65536, max_bytes: int = 256 << 20) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._dq: deque[tuple[Any, int]] = deque()
        self._ends: deque[tuple[int, Any]] = deque()  # (deliver once _popped reaches, item)
        self._popped = 0
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.bytes = 0
        self.dropped = 0
        self.put_total = 0
        self.offered = 0
        self.taken = 0

    def __len__(self) -> int:
        return len(self._dq) + len(self._ends)

    def _notify(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_wake, w)

    def put(self, item: Any, nbytes: int = 0) -> bool:
        """Enqueue `item` (carrying `nbytes` payload bytes); False (and counted) when full."""
        with self._lock:
            return self._put(item, nbytes)

    def _put(self, item: Any, nbytes: int) -> bool:
        self.put_total += 1
        self.offered += 1
        if len(self._dq) >= self.maxsize or self.bytes + nbytes > self.max_bytes:
            self.dropped += 1
            return False
        self._dq.append((item, nbytes))
        self.bytes += nbytes
        if self._waiter is not None:
            self._notify()
        return True

    def put_end(self, item: Any) -> None:
        """Enqueue an end marker; never dropped (overflows to a side list, drained first)."""
        with self._lock:
            if len(self._dq) >= self.maxsize:
                # deliver after everything queued before it (its own request's data among them)
                self.offered += 1
                self._ends.append((self._popped + len(self._dq), item))
                self._notify()
                return
            self._put(item, 0)

    def get_nowait_batch(self, max_items: int) -> list[Any]:
        """Up to `max_items` queued items, oldest first; overflowed end markers come after them."""
        with self._lock:
            dq = self._dq
            n = min(max_items, len(dq))
            out = []
            freed = 0
            for _ in range(n):
                item, nb = dq.popleft()
                out.append(item)
                freed += nb
            self.bytes -= freed
            self._popped += n
            ends = self._ends
            while ends and ends[0][0] <= self._popped:
                out.append(ends.popleft()[1])
            self.taken += len(out)
            return out

    async def get_batch(self, max_items: int = 512, timeout: float | None = None) -> list[Any]:
        """Wait until something is queued (or `timeout` passes), then return up to `max_items`."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._dq or self._ends:
                    break
                fut: asyncio.Future[None] = loop.create_future()
                self._waiter = fut
                self._loop = loop
            try:
                if timeout is None:
                    await fut
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(fut, timeout)
                    if not fut.done():
                        return []
            finally:
                with self._lock:
                    if self._waiter is fut:
                        self._waiter = None
        return self.get_nowait_batch(max_items)
