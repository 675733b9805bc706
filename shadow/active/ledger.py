"""What the active proxy has dispatched to decode workers, and the load view it decides on.

`Ledger` keeps one entry per decode leg the proxy sent: its worker, prompt and generated tokens,
whether its KV transfer is still in flight (dispatched, no decode token yet), and per-worker
aggregates (outstanding requests and forwarded tokens for the JSQ rule, transfers in flight).
`snapshot(source)` merges it with a `LoadSource` (the mirror's reconciled running requests, or
nothing for a proxy without a mirror): a leg the source has not seen yet counts as *virtual*
load on its worker; a leg that ended at the proxy but is still live in the source is taken out
again, so a freed slot is usable at once. A worker running more than its slots (+ `ahead`) with
requests someone else placed (the router in canary, round-robin in fallback) has a queue that
takes every slot it frees, so waiting in the pool would only let later requests overtake: it shows
one free slot a round, not capped by KV transfers (vLLM pulls a queued request's KV once it
schedules it), and the pool's requests join the queue one by one, each on the loads as they are
then. A worker that is down — the source cannot
reach it, or the proxy could not reach it within the last `down_hold_s` — has no free slot
(unless every worker is down: then the view is as if none were).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shadow.contracts.ids import request_hash
from shadow.core.snapshot import FleetSnapshot
from shadow.mirror.state import MirrorState


class LoadSource(Protocol):
    """Running requests per worker as someone else observes them (index = worker order)."""

    def counts(self) -> tuple[list[float], list[int]]:
        """(KV tokens, running requests) per worker."""
        ...

    def known(self, request_id: str) -> bool:
        """The source has seen this request (running or ended)."""
        ...

    def live(self, request_id: str) -> bool:
        """The source counts this request as running now."""
        ...

    def down(self) -> Collection[int]:
        """Workers the source cannot reach now."""
        ...


class NoSource:
    """A proxy without a mirror: the ledger is the whole truth."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def counts(self) -> tuple[list[float], list[int]]:
        return [0.0] * self.workers, [0] * self.workers

    def known(self, request_id: str) -> bool:
        return False

    def live(self, request_id: str) -> bool:
        return False

    def down(self) -> Collection[int]:
        return ()


class MirrorSource:
    """Shadow's reconciled mirror state (read from another thread: plain int reads only);
    `unreachable()` names the workers whose /metrics cannot be reached (the reconciler's view)."""

    def __init__(
        self,
        state: MirrorState,
        workers: Sequence[str],
        unreachable: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.state = state
        self.names = list(workers)
        self.unreachable = unreachable

    def counts(self) -> tuple[list[float], list[int]]:
        ws = self.state.workers
        kv: list[float] = []
        act: list[int] = []
        for n in self.names:
            wc = ws.get(n)
            kv.append(float(wc.kv_tokens) if wc is not None else 0.0)
            act.append(wc.active if wc is not None else 0)
        return kv, act

    def known(self, request_id: str) -> bool:  # (the mirror knows a request by its id's hash)
        return self.state.known(request_hash(request_id))

    def live(self, request_id: str) -> bool:
        return self.state.is_live(request_hash(request_id))

    def down(self) -> Collection[int]:
        if self.unreachable is None:
            return ()
        gone = set(self.unreachable())
        return [g for g, n in enumerate(self.names) if n in gone]


@dataclass(slots=True)
class Leg:
    """One decode leg the proxy dispatched."""

    request_id: str
    worker: int
    prompt: int
    score_tokens: float
    dispatched_at: float
    generated: int = 0
    transferring: bool = True
    seen: bool = False  # the source has it (no longer virtual)
    ended_at: float = 0.0


class Ledger:
    """See module docstring. Not thread-safe: used from the proxy's event loop only."""

    def __init__(
        self,
        workers: int,
        slots: int,
        transfer_cap: int,
        forget_after_s: float = 30.0,
        ahead: int = 0,
        down_hold_s: float = 2.0,
    ) -> None:
        self.workers = workers
        self.slots = slots
        self.ahead = ahead  # requests placed beyond the free slots (queued at the worker)
        self.transfer_cap = transfer_cap
        self.forget_after_s = forget_after_s
        self.legs: dict[str, Leg] = {}
        self._virtual: dict[str, Leg] = {}
        self._ended: dict[str, Leg] = {}  # ended at the proxy, possibly still live in the source
        self.outstanding = [0] * workers
        self.outstanding_tokens = [0.0] * workers
        self.transfers = [0] * workers
        self.dispatched = [0] * workers  # decode legs placed per worker (all time)
        self.down_hold_s = down_hold_s
        self.unreachable_at = [float("-inf")] * workers  # the proxy's last failure to reach each worker
        self.down: frozenset[int] = frozenset()  # as of the last view

    def __len__(self) -> int:
        return len(self.legs)

    def dispatch(self, request_id: str, worker: int, prompt: int, score_tokens: float, now: float) -> Leg:
        old = self.legs.get(request_id)
        if old is not None:  # a retried leg under the same id: the old one is over
            self.finish(request_id, now)
        leg = Leg(request_id, worker, prompt, score_tokens, now)
        self.legs[request_id] = leg
        self._virtual[request_id] = leg
        self._ended.pop(request_id, None)
        self.outstanding[worker] += 1
        self.outstanding_tokens[worker] += score_tokens
        self.transfers[worker] += 1
        self.dispatched[worker] += 1
        return leg

    def first_token(self, request_id: str) -> Leg | None:
        """The leg's first decode token arrived: its KV transfer is over."""
        leg = self.legs.get(request_id)
        if leg is not None and leg.transferring:
            leg.transferring = False
            self.transfers[leg.worker] -= 1
        return leg

    def progress(self, request_id: str, generated: int) -> None:
        leg = self.legs.get(request_id)
        if leg is not None and generated > leg.generated:
            leg.generated = generated

    def finish(self, request_id: str, now: float) -> Leg | None:
        """The leg ended at the proxy (done, failed, cancelled); its slot is free from now on."""
        leg = self.legs.pop(request_id, None)
        if leg is None:
            return None
        self._virtual.pop(request_id, None)
        w = leg.worker
        self.outstanding[w] -= 1
        self.outstanding_tokens[w] -= leg.score_tokens
        if self.outstanding[w] == 0:
            self.outstanding_tokens[w] = 0.0  # no float residue once idle
        if leg.transferring:
            leg.transferring = False
            self.transfers[w] -= 1
        leg.ended_at = now
        self._ended[request_id] = leg
        return leg

    def transfer_room(self, worker: int) -> int:
        if worker in self.down:
            return 0
        return max(0, self.transfer_cap - self.transfers[worker])

    def unreachable(self, worker: int, now: float) -> None:
        """The proxy could not reach `worker` (it gets nothing for `down_hold_s`, then one try)."""
        self.unreachable_at[worker] = now

    def reached(self, worker: int) -> None:
        """`worker` answered: it is up."""
        self.unreachable_at[worker] = float("-inf")

    def snapshot(self, source: LoadSource, now: float) -> FleetSnapshot:
        """Loads and free slots as the source sees them, corrected by what only the proxy knows."""
        kv, act = source.counts()
        for rid in list(self._virtual):
            leg = self._virtual[rid]
            if source.known(rid):
                leg.seen = True
                del self._virtual[rid]
                continue
            kv[leg.worker] += leg.prompt + leg.generated
            act[leg.worker] += 1
        limit = now - self.forget_after_s
        for rid in list(self._ended):
            leg = self._ended[rid]
            if leg.ended_at < limit or not leg.seen or not source.live(rid):
                del self._ended[rid]
                continue
            kv[leg.worker] = max(0.0, kv[leg.worker] - leg.prompt - leg.generated)
            act[leg.worker] = max(0, act[leg.worker] - 1)
        room = self.slots + self.ahead
        free = [
            1 if a > room and a > own else max(0, min(room - a, self.transfer_cap - t))
            for a, t, own in zip(act, self.transfers, self.outstanding, strict=True)
        ]
        since = now - self.down_hold_s
        down = {g for g, t in enumerate(self.unreachable_at) if t > since}
        down.update(source.down())
        self.down = frozenset(down) if len(down) < self.workers else frozenset()
        for g in self.down:
            free[g] = 0
        return FleetSnapshot(kv, free, list(self.outstanding), list(self.outstanding_tokens), running=act)

    def active_arrays(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """(worker, current load, generated tokens) of every leg in flight (BR-H's projection)."""
        legs = list(self.legs.values())
        worker = np.fromiter((x.worker for x in legs), dtype=np.int64, count=len(legs))
        load = np.fromiter((x.prompt + x.generated for x in legs), dtype=np.float64, count=len(legs))
        gen = np.fromiter((x.generated for x in legs), dtype=np.int64, count=len(legs))
        return worker, load, gen
