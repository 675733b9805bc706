"""The one backoff of the proxy's retry loops (the P/D flow's attempts and the shadow-mode
passthrough's sends): at most `retries` retries, retry n (1, 2, ...) waiting `delay_s * 2**(n-1)`
before it, the wait cut short (`clientgone.Gone`) when the client goes away first.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from shadow.active.clientgone import race


@dataclass(frozen=True)
class Backoff:
    """How often and after what wait an upstream call that failed before the client got a byte is
    sent again. Immutable: one per proxy, shared by every request."""

    retries: int
    delay_s: float

    def delay(self, retry: int) -> float:
        """The wait (s) before retry `retry` (1, 2, ...): `delay_s` doubling."""
        return self.delay_s * 2.0 ** (retry - 1)

    def allows(self, retry: int) -> bool:
        """Retry `retry` (1, 2, ...) is within the budget."""
        return retry <= self.retries

    async def wait(self, retry: int, gone: asyncio.Future[Any] | None = None) -> None:
        """Sleep `delay(retry)`; raced against `gone` (raising `Gone`) when given."""
        sleep = asyncio.sleep(self.delay(retry))
        if gone is None:
            await sleep
        else:
            await race(sleep, gone)
