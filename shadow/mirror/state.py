"""The mirrored model of the fleet: per worker active requests, KV tokens, free slots, ends.

Pure (no clock, no I/O): every call takes `now` (seconds, the caller's monotonic clock, used for
activity and TTLs; event `t` fields are the producer's and are only passed through). Events are
applied idempotently and robustly: duplicates, reordering (token or finish before route), unknown
workers and tokens going backwards are absorbed and reported as an outcome string; `reap(now)`
ends silent requests so that every mirrored request ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shadow.base.ordered import expire
from shadow.contracts.events import Arrive, Cancel, Event, Finish, Route, Step, Token
from shadow.contracts.requests import RequestRecord

# Outcomes of `apply` (also the `reason` label of ignored-event counters; a bounded set).
OK = "ok"
DUPLICATE = "duplicate"  # same fact again, or any event for a request that already ended
STALE = "stale"  # token count not above what is known
ORPHAN = "orphan"  # event for a request never arrived/routed (kept pending; TTL reaps it)
LATE = "late"  # route for a request that already ended (counted as finished on that worker)
UNKNOWN_WORKER = "unknown_worker"
MOVED = "moved"  # route of an active request to another worker (e.g. recompute)
OUTCOMES = (OK, DUPLICATE, STALE, ORPHAN, LATE, UNKNOWN_WORKER, MOVED)


@dataclass(slots=True)
class _Mirrored(RequestRecord):
    """What the events told of a live request (an unsized prompt is 0), and when it was last heard
    of (the caller's clock: silence ends it)."""

    last_seen: float = 0.0


@dataclass(slots=True)
class WorkerCounts:
    """Aggregates of one worker (kept incrementally). `low`/`high`: the least and most `active` has
    been since `MirrorState.open_window` (a reconciliation round's span: see `shadow.mirror.reconcile`)."""

    active: int = 0
    kv_tokens: int = 0
    finished: int = 0
    cancelled: int = 0
    reaped: int = 0
    slots: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    low: int = 0
    high: int = 0

    #: The counters, as /v1/state names them.
    COUNTS: ClassVar[tuple[str, ...]] = ("active", "kv_tokens", "finished", "cancelled", "reaped")

    @property
    def ended(self) -> int:
        """Requests that ended here: finished, cancelled or reaped."""
        return self.finished + self.cancelled + self.reaped

    @property
    def routed(self) -> int:
        """Requests routed here so far: active or ended (only a move elsewhere lowers it)."""
        return self.active + self.ended

    def active_up(self) -> None:
        self.active += 1
        if self.active > self.high:
            self.high = self.active

    def active_down(self) -> None:
        self.active -= 1
        if self.active < self.low:
            self.low = self.active


class MirrorState:
    """Mirrored requests and per-worker aggregates; see the module docstring for the contract."""

    def __init__(
        self,
        workers: Iterable[str] = (),
        *,
        slots: int | dict[str, int] | None = None,
        ttl_s: float = 300.0,
        phantom_age_s: float = 120.0,
        tombstones: int = 200_000,
        dynamic_workers: bool = False,
        tombstone_ttl_s: float | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        # Ended requests are remembered (to absorb late and duplicate events) for this long, and at
        # most `tombstones` of them: memory follows rate × TTL, under a hard cap.
        self.tombstone_ttl_s = ttl_s if tombstone_ttl_s is None else tombstone_ttl_s
        self.phantom_age_s = phantom_age_s
        self.dynamic_workers = dynamic_workers
        self._slots = slots
        self._tomb_cap = tombstones
        self.workers: dict[str, WorkerCounts] = {}
        for w in workers:
            self.add_worker(w)
        self._live: dict[str, _Mirrored] = {}
        # ended request -> (its worker, when it ended); insertion order is end order
        self._tomb: OrderedDict[str, tuple[str | None, float]] = OrderedDict()
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.orphans = 0
        self.reaped = 0
        self.last_step: Step | None = None

    # -- configuration -------------------------------------------------------------------------

    def add_worker(self, name: str) -> None:
        if name in self.workers:
            return
        slots = self._slots.get(name) if isinstance(self._slots, dict) else self._slots
        self.workers[name] = WorkerCounts(slots=slots)

    def open_window(self) -> None:
        """Start every worker's `low`/`high` afresh at its `active` now."""
        for wc in self.workers.values():
            wc.low = wc.high = wc.active

    # -- events --------------------------------------------------------------------------------

    def apply(self, ev: Event, now: float) -> str:
        """Apply one event received at `now`; returns its outcome (one of OUTCOMES)."""
        if isinstance(ev, Token):
            out = self._token(ev, now)
        elif isinstance(ev, Route):
            out = self._route(ev, now)
        elif isinstance(ev, Finish):
            out = self._end(ev.request_id, now, cancelled=False, generated=ev.generated)
        elif isinstance(ev, Cancel):
            out = self._end(ev.request_id, now, cancelled=True, generated=None)
        elif isinstance(ev, Arrive):
            out = self._arrive(ev, now)
        else:
            self.last_step = ev
            out = OK
        self.outcomes[out] += 1
        return out

    def _arrive(self, ev: Arrive, now: float) -> str:
        rid = ev.request_id
        if rid in self._tomb:
            return DUPLICATE
        req = self._live.get(rid)
        if req is not None:
            if ev.prompt_tokens is not None and not req.prompt:
                self._set_prompt(req, ev.prompt_tokens)
            req.last_seen = now
            return DUPLICATE
        self._live[rid] = _Mirrored(prompt=ev.prompt_tokens or 0, last_seen=now)
        return OK

    def _route(self, ev: Route, now: float) -> str:
        rid, worker = ev.request_id, ev.worker
        wc = self.workers.get(worker)
        if wc is None:
            if not self.dynamic_workers:
                return UNKNOWN_WORKER
            self.add_worker(worker)
            wc = self.workers[worker]
        if rid in self._tomb:
            buried_worker, ended = self._tomb[rid]
            if buried_worker is None:  # ended before its route was seen
                self._tomb[rid] = (worker, ended)
                wc.finished += 1
                return LATE
            return DUPLICATE
        req = self._live.get(rid)
        if req is None:
            req = _Mirrored(worker, ev.prompt_tokens or 0, last_seen=now)
            self._live[rid] = req
            wc.active_up()
            wc.kv_tokens += req.held
            return OK
        req.last_seen = now
        if ev.prompt_tokens is not None and ev.prompt_tokens != req.prompt:
            # a worker's own count (prefill, usage) replaces an estimate from the request body
            self._set_prompt(req, ev.prompt_tokens)
        if req.worker == worker:
            return DUPLICATE
        out = OK
        if req.worker is not None:  # reassignment (e.g. recompute on another worker)
            old = self.workers[req.worker]
            old.active_down()
            old.kv_tokens -= req.held
            out = MOVED
        req.worker = worker
        wc.active_up()
        wc.kv_tokens += req.held
        return out

    def _set_prompt(self, req: _Mirrored, prompt: int) -> None:
        if req.worker is not None:
            self.workers[req.worker].kv_tokens += prompt - (req.prompt or 0)
        req.prompt = prompt

    def _token(self, ev: Token, now: float) -> str:
        rid = ev.request_id
        req = self._live.get(rid)
        if req is None:
            if rid in self._tomb:
                return DUPLICATE
            self._live[rid] = _Mirrored(prompt=0, generated=ev.generated, last_seen=now)
            self.orphans += 1
            return ORPHAN
        req.last_seen = now
        delta = ev.generated - req.generated
        if delta <= 0:
            return DUPLICATE if delta == 0 else STALE
        req.generated = ev.generated
        if req.worker is not None:
            self.workers[req.worker].kv_tokens += delta
        return OK

    def _end(
        self, rid: str, now: float, *, cancelled: bool, generated: int | None, reaped: bool = False
    ) -> str:
        if rid in self._tomb:
            return DUPLICATE
        req = self._live.pop(rid, None)
        if req is None:
            self._bury(rid, None, now)
            self.orphans += 1
            return ORPHAN
        self._bury(rid, req.worker, now)
        if req.worker is not None:
            wc = self.workers[req.worker]
            wc.active_down()
            wc.kv_tokens -= req.held
            if reaped:
                wc.reaped += 1
            elif cancelled:
                wc.cancelled += 1
            else:
                wc.finished += 1
        return OK

    def _bury(self, rid: str, worker: str | None, now: float) -> None:
        tomb = self._tomb
        tomb[rid] = (worker, now)
        if len(tomb) > self._tomb_cap:
            tomb.popitem(last=False)

    def _forget(self, now: float) -> None:
        """Drop tombstones older than the tombstone TTL (oldest first)."""
        expire(self._tomb, now - self.tombstone_ttl_s, lambda t: t[1])

    # -- time ----------------------------------------------------------------------------------

    def reap(self, now: float, t: float | None = None) -> list[Finish]:
        """End every request silent for longer than the TTL; returns the Finish("reaped") events
        (already applied; `t` is stamped on them, default `now`)."""
        self._forget(now)
        limit = now - self.ttl_s
        stale = [(rid, r) for rid, r in self._live.items() if r.last_seen < limit]
        out: list[Finish] = []
        for rid, r in stale:
            self._end(rid, now, cancelled=False, generated=r.generated, reaped=True)
            self.reaped += 1
            out.append(Finish(rid, now if t is None else t, "reaped", r.generated))
        return out

    # -- views ---------------------------------------------------------------------------------

    def active(self, worker: str | None = None) -> int:
        """Active (routed, not ended) requests on `worker`, or on all workers."""
        if worker is not None:
            wc = self.workers.get(worker)
            return wc.active if wc else 0
        return sum(wc.active for wc in self.workers.values())

    def live(self) -> int:
        """Every request not yet ended, routed or not (arrived, orphan tokens)."""
        return len(self._live)

    def is_live(self, request_id: str) -> bool:
        """True while `request_id` is mirrored and not ended."""
        return request_id in self._live

    def known(self, request_id: str) -> bool:
        """True when `request_id` is live or remembered as ended."""
        return request_id in self._live or request_id in self._tomb

    def pending(self) -> int:
        return sum(1 for r in self._live.values() if r.worker is None)

    def phantoms(self, now: float) -> int:
        """Requests not ended and silent for longer than the phantom age."""
        limit = now - self.phantom_age_s
        return sum(1 for r in self._live.values() if r.last_seen < limit)

    def oldest_silence(self, now: float) -> float:
        return max((now - r.last_seen for r in self._live.values()), default=0.0)

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-ready view served at /v1/state."""
        workers: dict[str, Any] = {}
        for name, wc in self.workers.items():
            d: dict[str, Any] = {k: getattr(wc, k) for k in WorkerCounts.COUNTS}
            if wc.slots is not None:
                d["slots"] = wc.slots
                d["free_slots"] = max(0, wc.slots - wc.active)
            d.update(wc.extra)
            workers[name] = d
        return {
            "workers": workers,
            "phantoms": self.phantoms(now),
            "pending": self.pending(),
            "live": self.live(),
            "orphans": self.orphans,
            "reaped": self.reaped,
            "outcomes": dict(self.outcomes),
            "ttl_s": self.ttl_s,
            "phantom_age_s": self.phantom_age_s,
        }
