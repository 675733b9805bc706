"""The event-driven decode dispatcher: requests whose prefill is done wait here (the Prompt Pool)
until a routing round places them on a decode worker."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np

from shadow.active.ledger import Ledger, LoadSource
from shadow.active.metrics import ActiveMetrics
from shadow.base.runtime import cancel_task
from shadow.contracts.modes import ModeSource
from shadow.core.balanceroute import BalanceRoute
from shadow.core.cost import TOKENS, RouteCost
from shadow.core.fscore import BR0Scorer, Projection
from shadow.core.params import BRParams
from shadow.core.policies import RouterOptions, active_policy, make_router
from shadow.core.predictors import Predictor, contribution
from shadow.core.routers import PoolRouter, Router
from shadow.core.snapshot import FleetSnapshot
from shadow.telemetry.tracing import RoutingSpans

T = TypeVar("T")

log = logging.getLogger("shadow.active")


class PoolExpired(Exception):
    """The request waited in the pool longer than its TTL."""


@dataclass(slots=True)
class Ticket:
    """One request waiting for a decode worker."""

    request_id: str
    prompt_tokens: int
    score_tokens: float  # the JSQ rule's forwarded size (body bytes / 4)
    policy: str
    arrived_at: float
    future: asyncio.Future[int]
    mode: str = "active"  # the request's effective mode (active, fallback), for its spans


@dataclass
class DispatchConfig:
    workers: list[str]
    slots: int
    transfer_cap: int = 8
    pool_ttl_s: float = 60.0
    tick_s: float = 0.05
    bypass: bool = False
    br: BRParams | None = None
    brh_predictor: str = "survival"


def _only(fleet: FleetSnapshot, workers: list[int]) -> FleetSnapshot:
    """The snapshot of `workers` alone (index i of the result is worker `workers[i]`; no projection:
    the binding rules it serves read none)."""

    def pick(xs: Sequence[T] | None) -> list[T] | None:
        return None if xs is None else [xs[g] for g in workers]

    return FleetSnapshot([fleet.loads[g] for g in workers], [fleet.free_slots[g] for g in workers],
                         pick(fleet.outstanding), pick(fleet.outstanding_tokens))


class Dispatcher:
    """`start()`/`stop()` run the tick; everything else is loop-local.

    A round runs on the proxy's event loop when something changed — a request arrived, a leg ended
    (slot freed), a transfer finished — coalesced so that all events of one loop iteration share
    one round, and on a periodic tick (slots freed by traffic the proxy did not route). Each policy
    has its router from the policy registry: pool routers (br0, brh) place into free slots only,
    binding ones (jsq-bytes = the vllm-ascend rule, rr) place at once. Each decides on a fleet
    snapshot: the `Ledger`'s merge with the load source, each worker's free slots also capped by
    the KV transfers it may still take. Optional BR-0 pool bypass: place each request the moment
    its prefill is done by the single-request BR-0 score over running plus virtual load (ties to
    the larger margin), preferring workers with a free slot; it waits in the pool only while every
    worker is at its KV-transfer cap. The tick also reaps entries older than the pool TTL (their
    waiters get `PoolExpired`).

    `cost()` says what a running sequence costs the fleet's step (`shadow.core.cost`), asked once
    per round: the BalanceRoute policies and the bypass balance it (default: the paper's KV
    tokens); `shadow serve --active` gives the live lanes' step models, so a refit reaches the
    policy at its next round.
    """

    def __init__(
        self,
        config: DispatchConfig,
        ledger: Ledger,
        source: LoadSource,
        metrics: ActiveMetrics,
        modes: ModeSource,
        clock: Callable[[], float] = time.monotonic,
        router_factory: Callable[[str], Router] | None = None,
        cost: Callable[[], RouteCost] | None = None,
    ) -> None:
        """`router_factory(policy)` makes each policy's router (default `make_router`'s; tests inject);
        `cost`: the fleet's step cost now (default: the paper's KV tokens)."""
        self.config = config
        self.cost: Callable[[], RouteCost] = cost or (lambda: TOKENS)
        self.router_factory = router_factory or self.make_router
        self.ledger = ledger
        self.source = source
        self.metrics = metrics
        self.modes = modes
        self.clock = clock
        self.params = config.br or BRParams()
        self.routers: dict[str, Router] = {}
        self.waiting: dict[str, Ticket] = {}
        self._scheduled = False
        self._tick: asyncio.Task[None] | None = None
        self.rounds = 0
        self.reaped = 0
        self._marks: list[tuple[str, float]] = []  # BR stage boundaries of the current round
        self.spans = RoutingSpans.off()  # a span per round and per admission when traced

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_task(self._ticker())

    async def stop(self) -> None:
        await cancel_task(self._tick)
        self._tick = None
        for t in list(self.waiting.values()):
            if not t.future.done():
                t.future.cancel()
        self.waiting.clear()

    def make_router(self, policy: str) -> Router:
        """The router of an active policy name (ValueError naming the active ones)."""
        name = active_policy(policy)
        predictor = self.config.brh_predictor if name == "brh" else None
        return make_router(name, RouterOptions(br=self.params, predictor=predictor))

    def router(self, policy: str) -> Router:
        r = self.routers.get(policy)
        if r is None:
            r = self.router_factory(policy)
            if isinstance(r, PoolRouter) and isinstance(r.br, BalanceRoute):
                r.br.on_stage = self._stage_mark
            self.routers[policy] = r
        return r

    def _stage_mark(self, stage: str) -> None:
        self._marks.append((stage, time.perf_counter()))

    def _observe_stages(self) -> dict[str, float]:
        marks = self._marks
        stages: dict[str, float] = {}
        for (stage, t0), (_, t1) in itertools.pairwise(marks):
            self.metrics.round_stage.labels(stage).observe(t1 - t0)
            stages[stage] = stages.get(stage, 0.0) + t1 - t0
        marks.clear()
        return stages

    # -- events ------------------------------------------------------------------------------
    def submit(
        self, request_id: str, prompt_tokens: int, score_tokens: float, policy: str, mode: str = "active"
    ) -> asyncio.Future[int]:
        """Queue a request whose prefill is done; the future resolves to its worker index."""
        now = self.clock()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        ticket = Ticket(request_id, prompt_tokens, score_tokens, policy, now, fut, mode)
        if self.config.bypass and policy == "br0":
            g = self._bypass_pick(ticket, now)
            if g is not None:
                self._place(ticket, g, now)
                return fut
            # every worker is at its KV-transfer cap: this one waits in the pool like the others
            self.metrics.backpressure.labels("transfer_cap").inc()
        try:
            router = self.router(policy)
        except ValueError as exc:  # a policy this proxy cannot run: round-robin, reported as an error
            self.modes.on_decision(0.0, exc)
            ticket.policy = policy = "rr"
            router = self.router(policy)
        router.on_arrive(request_id, prompt_tokens, now, self._predicted_new(router))
        self.waiting[request_id] = ticket
        self._update_pool_gauges(now)
        self.schedule()
        return fut

    def cancel(self, request_id: str) -> bool:
        """Take a waiting request out of the pool at once (client gone); True if it was waiting."""
        ticket = self.waiting.pop(request_id, None)
        if ticket is None:
            return False
        self._forget(ticket)
        if not ticket.future.done():
            ticket.future.cancel()
        self._update_pool_gauges(self.clock())
        return True

    def released(self, request_id: str, output_tokens: int | None = None) -> None:
        """A decode leg ended (any way): its slot is free now; a round may place the next."""
        leg = self.ledger.finish(request_id, self.clock())
        if leg is not None and output_tokens is not None:
            for r in self.routers.values():
                r.on_finish(request_id, output_tokens)
        self.schedule()

    def transfer_done(self, request_id: str) -> None:
        if self.ledger.first_token(request_id) is not None:
            self.schedule()

    def schedule(self) -> None:
        """Run one round soon (once per loop iteration however many events asked)."""
        if not self._scheduled and self.waiting:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._round)

    # -- rounds ------------------------------------------------------------------------------
    def _forget(self, ticket: Ticket) -> None:
        r = self.routers.get(ticket.policy)
        if r is not None:
            r.forget(ticket.request_id)

    def _predicted_new(self, router: Router) -> float | None:
        if router.predictor is None:
            return None
        h = self.params.horizon
        p, mu = router.predictor.predict(np.zeros(1, dtype=np.int64), h)
        return float(contribution(p, mu, h)[0])

    def _projection(self, predictor: Predictor) -> Projection:
        """BR-H's view of the legs in flight, their steps predicted by `predictor`."""
        worker, load, gen = self.ledger.active_arrays()
        h = self.params.horizon
        p, mu = predictor.predict(gen, h)
        return worker, load, contribution(p, mu, h)

    def _round(self) -> None:
        self._scheduled = False
        if not self.waiting:
            return
        now = self.clock()
        # The round's counts, updated after each policy's placements; each policy decides on a
        # snapshot of them as they stand.
        lv = self.ledger.snapshot(self.source, now)
        loads, free = list(lv.loads), list(lv.free_slots)
        outstanding, tokens = list(lv.outstanding or ()), list(lv.outstanding_tokens or ())
        running = list(lv.seqs() or outstanding)
        cost = self.cost()
        for policy in list(self.routers):
            router = self.routers[policy]
            if not router.waiting():
                continue
            t0 = time.perf_counter()
            span = self.spans.round_start(policy, free, self.waiting.values(), pool=router.waiting())
            pred = router.predictor
            projection = None if pred is None else partial(self._projection, pred)
            fleet = FleetSnapshot(
                loads, free, outstanding, tokens, projection=projection, running=running, cost=cost
            )
            up = [g for g in range(len(loads)) if g not in self.ledger.down]
            try:
                if router.binds_at_arrival and len(up) < len(loads):  # (pool routers see no free slot)
                    picks = router.decide(_only(fleet, up), now)
                    decisions = [(rid, up[g]) for rid, g in picks]  # a binding rule among ranks that are up
                else:
                    decisions = router.decide(fleet, now)
            except Exception as exc:  # a broken policy must not strand its requests
                spent = time.perf_counter() - t0
                self._marks.clear()
                self.spans.round_end(span, 0, spent, error=exc)
                self.modes.on_decision(spent, exc)
                log.exception(
                    "policy %s failed a round; its %d waiting requests go round-robin",
                    policy,
                    router.waiting(),
                )
                self._requeue(policy, "rr" if policy != "rr" else "jsq-bytes", now)
                continue
            spent = time.perf_counter() - t0
            stages = self._observe_stages()
            placed = 0
            self.rounds += 1
            self.metrics.decision.labels(policy).observe(spent)
            self.modes.on_decision(spent, None)
            for rid, g in decisions:
                ticket = self.waiting.pop(str(rid), None)
                if ticket is None or ticket.future.done():
                    continue
                if self.params.age_s is not None and now - ticket.arrived_at >= self.params.age_s:
                    self.metrics.starvation.inc()
                self._place(ticket, g, now)
                self.spans.admission(span, ticket, self.config.workers[g], loads, g, now)
                placed += 1
                outstanding[g] += 1
                running[g] += 1
                tokens[g] += ticket.score_tokens
                loads[g] += ticket.prompt_tokens
                free[g] = max(0, free[g] - 1)
            self.spans.round_end(span, placed, spent, stages)
        if self.waiting and not any(free):
            self.metrics.backpressure.labels(self._why_no_slot(free)).inc()
        self._update_pool_gauges(now)

    def _why_no_slot(self, free: list[int]) -> str:
        capped = all(self.ledger.transfer_room(g) == 0 for g in range(len(free)) if free[g] == 0)
        return "transfer_cap" if capped and any(self.ledger.transfers) else "no_slot"

    def _requeue(self, policy: str, to: str, now: float) -> None:
        moved = [t for t in self.waiting.values() if t.policy == policy]
        self.routers.pop(policy, None)
        target = self.router(to)
        for t in moved:
            t.policy = to
            target.on_arrive(t.request_id, t.prompt_tokens, now, None)
        self.schedule()

    def _place(self, ticket: Ticket, g: int, now: float) -> None:
        self.ledger.dispatch(ticket.request_id, g, ticket.prompt_tokens, ticket.score_tokens, now)
        self.metrics.pool_wait.observe(max(0.0, now - ticket.arrived_at))
        self.metrics.placements.labels(self.config.workers[g], ticket.policy).inc()
        if not ticket.future.done():
            ticket.future.set_result(g)

    def _bypass_pick(self, ticket: Ticket, now: float) -> int | None:
        """BR-0 single-request score over running + virtual load, among workers with a free slot
        (else any under its KV-transfer cap: the worker queues it); ties to the larger margin.
        None when every worker is at its transfer cap."""
        t0 = time.perf_counter()
        prompt_tokens = ticket.prompt_tokens
        lv = self.ledger.snapshot(self.source, now)
        room = [g for g in range(len(lv.loads)) if self.ledger.transfer_room(g) > 0]
        if not room:
            return None
        span = self.spans.round_start("br0", lv.free_slots, (ticket,), pool=1, bypass=True)
        cost = self.cost()
        loads = lv.loads if cost.paper else cost.loads(lv.loads, lv.seqs() or [0] * len(lv.loads))
        scorer = BR0Scorer(loads, cost, tokens=None if cost.paper else lv.loads)
        delta = cost.weight(prompt_tokens)
        cands = [g for g in room if lv.free_slots[g] > 0] or room
        tie = scorer.tokens if cost.sequences else (lambda w: 0.0)  # sequence units: fewer KV tokens
        g = max(cands, key=lambda w: (scorer.score(w, delta), scorer.margin(w), -tie(w), -w))
        spent = time.perf_counter() - t0
        self.spans.admission(span, ticket, self.config.workers[g], lv.loads, g, now)
        self.spans.round_end(span, 1, spent)
        self.metrics.decision.labels("br0").observe(spent)
        self.modes.on_decision(spent, None)
        return g

    def _update_pool_gauges(self, now: float) -> None:
        self.metrics.pool_requests.set(len(self.waiting))
        oldest = min((t.arrived_at for t in self.waiting.values()), default=now)
        self.metrics.pool_oldest.set(max(0.0, now - oldest))
        for g, name in enumerate(self.config.workers):
            self.metrics.transfers.labels(name).set(self.ledger.transfers[g])
            self.metrics.worker_up.labels(name).set(0.0 if g in self.ledger.down else 1.0)

    def reap(self, now: float) -> int:
        """Fail every waiting request older than the pool TTL (their handlers release prefill KV)."""
        limit = now - self.config.pool_ttl_s
        old = [t for t in self.waiting.values() if t.arrived_at < limit]
        for t in old:
            del self.waiting[t.request_id]
            self._forget(t)
            if not t.future.done():
                t.future.set_exception(PoolExpired(f"waited {now - t.arrived_at:.1f} s in the pool"))
            self.metrics.pool_reaped.inc()
        self.reaped += len(old)
        return len(old)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                now = self.clock()
                self.reap(now)
                if self.waiting:
                    self._round()
                else:
                    self._update_pool_gauges(now)
            except Exception:
                log.exception("dispatcher tick failed")

