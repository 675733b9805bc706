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
when the last acquire/renew that succeeded was *sent*. The server starts the lease's TTL when it
receives that call, never earlier, so our deadline passes `margin` before the server can let
another replica take the lease: a replica that loses its lease (renewals failing, a pause) stops
routing new requests before another can start. `renew_every_s` (default TTL / 3) leaves two
renewals' room before the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LeaseBackend(Protocol):
    """A coordination service's lease, one round trip a call (see module docstring)."""

    async def acquire(self, holder: str, ttl_s: float) -> bool: ...

    async def renew(self) -> bool: ...

    async def release(self) -> None: ...

    async def holder(self) -> str | None: ...


@dataclass(frozen=True)
class LeaseConfig:
    """TTL, renewal period and fencing margin (seconds)."""

    ttl_s: float = 2.0
    renew_every_s: float | None = None  # default ttl / 3
    margin_s: float | None = None  # default ttl / 4

    @property
    def renew_s(self) -> float:
        return self.renew_every_s if self.renew_every_s is not None else self.ttl_s / 3.0

    @property
    def fence_margin_s(self) -> float:
        return self.margin_s if self.margin_s is not None else self.ttl_s / 4.0

    def validate(self) -> None:
        if not (self.ttl_s >= 1.0 and self.ttl_s == int(self.ttl_s)):
            raise ValueError(f"lease TTL must be a whole number of seconds >= 1, got {self.ttl_s}")
        if not 0 < self.renew_s < self.ttl_s - self.fence_margin_s:
            raise ValueError(f"lease renewal every {self.renew_s:g} s must be under TTL − margin "
                             f"({self.ttl_s - self.fence_margin_s:g} s)")
        if not 0 < self.fence_margin_s < self.ttl_s:
            raise ValueError(f"lease margin must be in (0, TTL), got {self.fence_margin_s}")


class Fence:
    """Whether this replica holds a lease it may route under now (see module docstring)."""

    def __init__(self, config: LeaseConfig) -> None:
        config.validate()
        self.config = config
        self.until = float("-inf")  # monotonic deadline; -inf: not leader

    def held(self, sent_at: float) -> None:
        """An acquire or renew sent at `sent_at` succeeded."""
        self.until = sent_at + self.config.ttl_s - self.config.fence_margin_s

    def lost(self) -> None:
        self.until = float("-inf")

    def leader(self, now: float) -> bool:
        return now < self.until
