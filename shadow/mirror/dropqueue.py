"""A bounded hand-off from the data path to the analysis side that never blocks and never raises.

`put` is called from the relay loop: it appends or, when full, drops and counts. `put_end` is for
end-of-request markers, which must not be lost (a lost end would leave a phantom request): when the
queue is full they go to a side list holding at most one entry per request. The consumer awaits
`get_batch`. Single event loop only (no locks).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class DropQueue:
    """Bounded FIFO; see module docstring."""

    __slots__ = ("_dq", "_ends", "_popped", "_waiter", "dropped", "maxsize", "put_total")

    def __init__(self, maxsize: int = 65536) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self._dq: deque[Any] = deque()
        self._ends: deque[tuple[int, Any]] = deque()  # (deliver once _popped reaches, item)
        self._popped = 0
        self._waiter: asyncio.Future[None] | None = None
        self.dropped = 0
        self.put_total = 0

    def __len__(self) -> int:
        return len(self._dq) + len(self._ends)

    def put(self, item: Any) -> bool:
        """Enqueue `item`; False (and counted in `dropped`) when full."""
        self.put_total += 1
        dq = self._dq
        if len(dq) >= self.maxsize:
            self.dropped += 1
            return False
        dq.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)
        return True

    def put_end(self, item: Any) -> None:
        """Enqueue an end marker; never dropped (overflows to a side list, drained first)."""
        if len(self._dq) >= self.maxsize:
            # deliver after everything queued before it (its own request's data among them)
            self._ends.append((self._popped + len(self._dq), item))
            w = self._waiter
            if w is not None:
                self._waiter = None
                if not w.done():
                    w.set_result(None)
            return
        self.put(item)

    def get_nowait_batch(self, max_items: int) -> list[Any]:
        """Up to `max_items` queued items, oldest first; overflowed end markers come after them."""
        dq = self._dq
        n = min(max_items, len(dq))
        out = [dq.popleft() for _ in range(n)]
        self._popped += n
        ends = self._ends
        while ends and ends[0][0] <= self._popped:
            out.append(ends.popleft()[1])
        return out

    async def get_batch(self, max_items: int = 512) -> list[Any]:
        """Wait until something is queued, then return up to `max_items` items."""
        while not self._dq and not self._ends:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiter = fut
            try:
                await fut
            finally:
                if self._waiter is fut:
                    self._waiter = None
        return self.get_nowait_batch(max_items)
