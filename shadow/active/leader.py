"""`LeaderElector`: one replica's side of the leader lease — campaigns while standing by, renews
while leading, and says whether it may route now (`leader()`, lock-free: one float compare).

Every `renew_s` the leader renews; every `renew_s / 2` a standby reads who holds the lease and
campaigns (acquire) only when nobody does, so a lapse is taken over within half a renewal; a failed or
unanswered renewal leaves routing to the fence, which ends `margin` before the server can hand the
lease to another replica (see shadow/active/lease.py). Each change of role is logged (one line) and
kept in `history` (wall time, role, why), for /v1/report's "leader".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from shadow.active.lease import Fence, LeaseBackend, LeaseConfig

log = logging.getLogger("shadow.active.leader")


class LeaderElector:
    """See module docstring."""

    def __init__(self, backend: LeaseBackend, holder: str, config: LeaseConfig, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.holder = holder
        self.config = config
        self.fence = Fence(config)
        self.clock = clock
        self.wall = wall
        self.role = "standby"
        self.history: deque[dict[str, Any]] = deque(maxlen=100)
        self.errors = 0
        self.last_error: str | None = None

    def leader(self) -> bool:
        """This replica may route new requests now."""
        return self.fence.leader(self.clock())

    async def step(self) -> None:
        """One renewal (leader) or campaign (standby); never raises."""
        sent = self.clock()
        try:
            if self.role == "leader":
                ok = await self.backend.renew()
                why = "renewed" if ok else "lease expired"
            elif await self.backend.holder() is not None:
                ok, why = False, "held by another"
            else:
                sent = self.clock()
                ok = await self.backend.acquire(self.holder, self.config.ttl_s)
                why = "acquired" if ok else "held by another"
        except Exception as exc:  # the service unreachable: the fence decides
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            ok, why = False, self.last_error
            if self.role == "leader" and self.fence.leader(self.clock()):
                return  # keep trying until the fence's deadline
        if ok:
            self.fence.held(sent)
            self._become("leader", why)
        else:
            self.fence.lost()
            self._become("standby", why)

    def _become(self, role: str, why: str) -> None:
        if role == self.role:
            return
        self.role = role
        at = self.wall()
        self.history.append({"at": datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")
                             .replace("+00:00", "Z"), "t": at, "role": role, "reason": why})
        log.warning("shadow leader: %s is now %s (%s)", self.holder, role, why)

    async def run(self) -> None:
        """Campaign/renew every `renew_s` until cancelled; releases the lease on the way out."""
        try:
            while True:
                started = self.clock()
                await self.step()
                if self.role == "leader" and not self.leader():  # the deadline passed meanwhile
                    self.fence.lost()
                    self._become("standby", "fence deadline passed")
                period = self.config.renew_s if self.role == "leader" else self.config.renew_s / 2
                await asyncio.sleep(max(0.0, started + period - self.clock()))  # a period, not a gap
        finally:
            if self.role == "leader":
                self.fence.lost()
                self._become("standby", "stopping")
                try:
                    await asyncio.shield(self.backend.release())
                except Exception:
                    log.warning("shadow leader: releasing the lease failed", exc_info=True)

    def report(self) -> dict[str, Any]:
        now = self.clock()
        until = self.wall() + (self.fence.until - now) if self.fence.leader(now) else None
        return {"holder": self.holder, "role": self.role, "leader": until is not None, "valid_until": until,
                "ttl_s": self.config.ttl_s, "renew_s": self.config.renew_s,
                "margin_s": self.config.fence_margin_s, "errors": self.errors, "last_error": self.last_error,
                "transitions": list(self.history)}
