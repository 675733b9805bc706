"""`LeaderElector`: one replica's side of the leader lease — campaigns while it holds none, renews
the one it holds, and says whether it may route now (`leader()`, lock-free: one float compare).

A replica that holds the lease (its acquire succeeded and the server has not said the lease is
gone) renews it every `renew_s`, without waiting for the previous renewal's answer (each call is
bounded by the call timeout), so a slow coordination service does not end the lease; it routes
while the fence says so, which ends `margin` before the server can hand the lease to another
replica (see shadow/active/lease.py). A holder whose fence passed (renewals late or failing) stands
by but keeps renewing its own lease — it never reads its own key as another's — until the server
says the lease is gone, or no renewal was answered for a TTL plus a call timeout (the lease has
lapsed at the server, or will before anyone can take it): then it campaigns like the others.
Every `campaign_s` a replica without the lease reads who holds it and acquires only when nobody
does. Each change of role is logged (one line) and kept in `history` (wall time, role, why), for
/v1/report's "leader".
"""

from __future__ import annotations

import asyncio
import logging
import math
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
        self.holding = False  # our acquire succeeded and the server has not said the lease is gone
        self.renewals = 0  # renewals the server answered with the lease alive
        self._epoch = 0  # bumped whenever `holding` changes: answers to older calls are stale
        self._last_ok = float("-inf")  # when the latest acquire/renew that succeeded was sent
        self.history: deque[dict[str, Any]] = deque(maxlen=100)
        self.errors = 0
        self.last_error: str | None = None

    def leader(self) -> bool:
        """This replica may route new requests now."""
        return self.fence.leader(self.clock())

    async def step(self) -> None:
        """One renewal (holding the lease) or campaign (not); never raises."""
        if self.holding:
            await self._renew()
        else:
            await self._campaign()
        self._settle()

    async def _renew(self) -> None:
        sent, epoch = self.clock(), self._epoch
        try:
            ok = await self.backend.renew()
        except Exception as exc:  # the service unreachable or slow: the fence decides
            self._error(exc)
            return
        if epoch != self._epoch:
            return  # the lease was given up or taken anew meanwhile
        if ok:
            self.renewals += 1
            self._held(sent, "renewed")
        else:
            self._drop("lease expired")

    async def _campaign(self) -> None:
        try:
            if await self.backend.holder() is not None:
                self._become("standby", "held by another")
                return
            sent = self.clock()
            ok = await self.backend.acquire(self.holder, self.config.ttl_s)
        except Exception as exc:
            self._error(exc)
            self._become("standby", self.last_error or "error")
            return
        if not ok:
            self._become("standby", "held by another")
            return
        self.holding = True
        self._epoch += 1
        self._held(sent, "acquired")

    def _held(self, sent: float, why: str) -> None:
        self._last_ok = max(self._last_ok, sent)
        self.fence.held(sent)
        if self.fence.leader(self.clock()):
            self._become("leader", why)

    def _drop(self, why: str) -> None:
        self.holding = False
        self._epoch += 1
        self.fence.lost()
        self._become("standby", why)

    def _error(self, exc: Exception) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _settle(self) -> None:
        """The role from the fence; a holder no renewal of which was answered for a TTL plus a call
        timeout gives the lease up (see module docstring)."""
        now = self.clock()
        if self.holding and now - self._last_ok > self.config.ttl_s + self.config.call_timeout_s:
            self._drop("no renewal answered for a TTL")
        elif self.role == "leader" and not self.fence.leader(now):
            self._become("standby", "fence deadline passed")

    def _become(self, role: str, why: str) -> None:
        if role == self.role:
            return
        self.role = role
        at = self.wall()
        self.history.append({"at": datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")
                             .replace("+00:00", "Z"), "t": at, "role": role, "reason": why})
        log.warning("shadow leader: %s is now %s (%s)", self.holder, role, why)

    async def run(self) -> None:
        """Renew every `renew_s` while holding the lease (renewals overlap when answers are slow, at
        most `in_flight` at once), campaign every `campaign_s` otherwise, until cancelled; releases
        the lease on the way out."""
        renewals: set[asyncio.Task[None]] = set()
        cfg = self.config
        in_flight = math.ceil(cfg.call_timeout_s / cfg.renew_s) + 1
        try:
            while True:
                started = self.clock()
                if self.holding:
                    if len(renewals) < in_flight:
                        task = asyncio.create_task(self._renew())
                        renewals.add(task)
                        task.add_done_callback(renewals.discard)
                    period = cfg.renew_s
                else:
                    await self._campaign()
                    period = 0.0 if self.holding else cfg.campaign_s  # just acquired: renew at once
                self._settle()
                await asyncio.sleep(max(0.0, started + period - self.clock()))  # a period, not a gap
        finally:
            for task in renewals:
                task.cancel()
            await asyncio.gather(*renewals, return_exceptions=True)
            held = self.holding
            self.holding = False
            self.fence.lost()
            self._become("standby", "stopping")
            if held:
                try:
                    await asyncio.shield(self.backend.release())
                except Exception:
                    log.warning("shadow leader: releasing the lease failed", exc_info=True)

    def report(self) -> dict[str, Any]:
        now = self.clock()
        until = self.wall() + (self.fence.until - now) if self.fence.leader(now) else None
        return {"holder": self.holder, "role": self.role, "leader": until is not None, "valid_until": until,
                "holding": self.holding, "renewals": self.renewals,
                "ttl_s": self.config.ttl_s, "renew_s": self.config.renew_s,
                "margin_s": self.config.fence_margin_s, "errors": self.errors, "last_error": self.last_error,
                "transitions": list(self.history)}
