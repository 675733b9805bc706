"""Leader leases for replicas of `shadow serve --active`: the small interface a coordination
service implements, and the fencing arithmetic (pure: time is passed in).

`LeaseBackend` is what a backend does, each call one round trip, answering for the server:
`acquire(holder, ttl_s)` takes the lease when nobody holds it (True: we hold it now), `renew()`
keeps ours alive (False: it is gone), `release()` gives it up, `holder()` names who holds it.
`EtcdLease` (shadow/active/etcdlease.py) implements it on etcd v3: a lease granted with the TTL,
and a transaction that puts the key with that lease only if the key does not exist. A Kubernetes
`coordination.k8s.io/v1` Lease implements the same four calls: acquire = create the Lease object
(or update it when its `renewTime` + `leaseDurationSeconds` has passed) with `holderIdentity` =
holder, guarded by `resourceVersion`; renew = update `renewTime` under the `resourceVersion` read;
release = clear `holderIdentity`; holder = read `holderIdentity` (as client-go's leaderelection
and llm-d's EPP do).

`Fence` decides whether this replica may route: only until `sent + ttl − margin`, where `sent` is
when the latest acquire/renew that succeeded was *sent*. The server starts the lease's TTL when it
receives that call, never earlier, so our deadline passes `margin` before the server can let
another replica take the lease: a replica that loses its lease (renewals failing, a pause) stops
routing new requests before another can start.

Every call is bounded by `call_timeout_s`, and a slow answer must not end the lease: the leader
renews every `renew_s` whether or not the previous renewal has answered, with `renew_s` (default
min(TTL / 3, (TTL − margin − call timeout) / 2)) such that when every renewal is answered within
the call timeout the fence never lapses, and when one is lost the next still lands in time. A
renewal is only worth something if it is answered before `sent + ttl − margin`, so TTL − margin
must exceed the call timeout (`validate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

#: How long one call to the coordination service may take (`EtcdLease`'s default timeout).
DEFAULT_CALL_TIMEOUT_S = 1.0


class LeaseBackend(Protocol):
    """A coordination service's lease, one round trip a call (see module docstring)."""

    async def acquire(self, holder: str, ttl_s: float) -> bool: ...

    async def renew(self) -> bool: ...

    async def release(self) -> None: ...

    async def holder(self) -> str | None: ...


@dataclass(frozen=True)
class LeaseConfig:
    """TTL, renewal period, fencing margin and the call timeout the backend uses (seconds)."""

    ttl_s: float = 2.0
    renew_every_s: float | None = None  # default min(ttl / 3, (ttl − margin − call timeout) / 2)
    margin_s: float | None = None  # default ttl / 4
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S

    @property
    def renew_s(self) -> float:
        """The leader's renewal period (renewals do not wait for each other's answers)."""
        if self.renew_every_s is not None:
            return self.renew_every_s
        return min(self.ttl_s / 3.0, (self.ttl_s - self.fence_margin_s - self.call_timeout_s) / 2.0)

    @property
    def campaign_s(self) -> float:
        """A standby's period: it reads who holds the lease (and campaigns when nobody does)."""
        return self.ttl_s / 6.0

    @property
    def fence_margin_s(self) -> float:
        return self.margin_s if self.margin_s is not None else self.ttl_s / 4.0

    def validate(self) -> None:
        if not (self.ttl_s >= 1.0 and self.ttl_s == int(self.ttl_s)):
            raise ValueError(f"lease TTL must be a whole number of seconds >= 1, got {self.ttl_s}")
        if not 0 < self.fence_margin_s < self.ttl_s:
            raise ValueError(f"lease margin must be in (0, TTL), got {self.fence_margin_s}")
        room = self.ttl_s - self.fence_margin_s - self.call_timeout_s
        if not (self.call_timeout_s > 0 and room > 0):
            raise ValueError(f"lease TTL − margin ({self.ttl_s - self.fence_margin_s:g} s) must exceed the "
                             f"call timeout ({self.call_timeout_s:g} s): a renewal answered in time must "
                             "land before the fence ends; raise the TTL")
        if not 0 < self.renew_s <= room:
            raise ValueError(f"lease renewal every {self.renew_s:g} s must be at most TTL − margin − call "
                             f"timeout ({room:g} s): a renewal answered in time must land before the "
                             "previous one's fence ends")


class Fence:
    """Whether this replica holds a lease it may route under now (see module docstring)."""

    def __init__(self, config: LeaseConfig) -> None:
        config.validate()
        self.config = config
        self.until = float("-inf")  # monotonic deadline; -inf: not leader

    def held(self, sent_at: float) -> None:
        """An acquire or renew sent at `sent_at` succeeded (answers may come out of order: the
        latest deadline stands)."""
        self.until = max(self.until, sent_at + self.config.ttl_s - self.config.fence_margin_s)

    def lost(self) -> None:
        self.until = float("-inf")

    def leader(self, now: float) -> bool:
        return now < self.until
