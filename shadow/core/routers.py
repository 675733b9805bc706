"""The stateful router protocol and its three shapes: binding, forced and pool routers.

A `Router` is told of each request when it reaches the router (`on_arrive`) and when it ends
(`on_finish`), and places requests when asked (`decide(fleet, now)`), returning
(request_id, worker_index) pairs in decision order. State (round-robin position, random stream,
the BalanceRoute pool, a length predictor) persists between calls. Routers that bind at arrival
(baselines, forced placements) place every request they have been told of; pool routers
(BR-0/BR-H/BRA) place into free slots only, keeping the rest waiting, and balance the step cost
the snapshot says (`FleetSnapshot.cost`: KV tokens, + κ per running sequence). `shadow.core.policies`
names them. Pure: time and randomness are arguments; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import replace
from typing import Protocol

from shadow.core.balanceroute import BalanceRoute
from shadow.core.baselines import Baseline, BindState, bind_all
from shadow.core.bra import BalanceRouteAdaptive, BRAParams
from shadow.core.params import BRParams
from shadow.core.pool import Pool
from shadow.core.predictors import Predictor
from shadow.core.snapshot import STAY_BASIS, FleetSnapshot

Decision = tuple[Hashable, int]


class Router(Protocol):
    """See module docstring."""

    name: str
    binds_at_arrival: bool
    predictor: Predictor | None

    def on_arrive(
        self, request_id: Hashable, prompt_tokens: int, now: float, predicted_steps: float | None = None
    ) -> None: ...

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None: ...

    def decide(self, fleet: FleetSnapshot, now: float) -> list[Decision]: ...

    def waiting(self) -> int: ...

    def forget(self, request_id: Hashable) -> bool:
        """Take a waiting request out (its client left); True when it was waiting here."""
        ...


class _Binding:
    """What routers that bind at arrival share: the requests told of and not yet placed."""

    binds_at_arrival = True
    predictor: Predictor | None = None

    def __init__(self) -> None:
        self._waiting: list[tuple[Hashable, int]] = []  # (request id, prompt tokens), arrival order

    def on_arrive(
        self, request_id: Hashable, prompt_tokens: int, now: float, predicted_steps: float | None = None
    ) -> None:
        self._waiting.append((request_id, prompt_tokens))

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None:
        return None

    def waiting(self) -> int:
        return len(self._waiting)

    def forget(self, request_id: Hashable) -> bool:
        n = len(self._waiting)
        self._waiting = [w for w in self._waiting if w[0] != request_id]
        return len(self._waiting) < n


class StaleView:
    """A router's view of the engines, `age_s` old at most: replaced by the fleet's state at the
    first decision `age_s` or more after the last replacement (SGLang's throttled refresh; a
    periodic publication every `age_s` is older on average: its view is replaced when a decision
    finds it due), and between replacements only the router's own ledger and free slots are
    current while the rule's optimistic increments (`Baseline.charge`) accumulate on the rest.
    `age_s` = 0 replaces it at every decision: exactly the fresh view."""

    def __init__(self, age_s: float) -> None:
        if not age_s >= 0:
            raise ValueError(f"a view's age must be >= 0 s, got {age_s!r}")
        self.age_s = age_s
        self._state: BindState | None = None
        self._at = -math.inf
        self.refreshes = 0

    def state(self, fleet: FleetSnapshot, now: float, engines: bool) -> BindState:
        """The view at `now` (written by the caller's charges until the next refresh)."""
        st = self._state
        if st is None or not 0 <= now - self._at < self.age_s or st.workers != fleet.workers:
            st = self._state = BindState.of(fleet, engines=engines)
            self._at = now
            self.refreshes += 1
        else:
            st.own(fleet)
        return st


class BindingRouter(_Binding):
    """A baseline (rr, random, p2c, jsq, jsq-bytes, least-tokens) or an incumbent's rule
    (`shadow.core.incumbents`) as a stateful router.

    `only_free`: place only on workers with a free slot, at most as many as there are free slots
    (a routing round); otherwise every waiting request is bound (an engine queues it). `view_age_s`
    > 0: the rule reads a `StaleView` of the engines that old at most (0: the fleet as it is).
    """

    def __init__(self, baseline: Baseline, *, only_free: bool = False, view_age_s: float = 0.0) -> None:
        super().__init__()
        self.baseline = baseline
        self.name = baseline.name
        self.only_free = only_free
        self.view = StaleView(view_age_s) if view_age_s > 0 else None

    def decide(self, fleet: FleetSnapshot, now: float) -> list[Decision]:
        if not self._waiting:
            return []
        view = self.view
        engines = self.baseline.engines
        state = BindState.of(fleet, engines=engines) if view is None else view.state(fleet, now, engines)
        if self.only_free:
            n = sum(max(0, c) for c in state.free_slots)
            take, self._waiting = self._waiting[:n], self._waiting[n:]
        else:
            take, self._waiting = self._waiting, []
        picks = bind_all(self.baseline, state, [s for _, s in take], self.only_free)
        return [(rid, g) for (rid, _), g in zip(take, picks, strict=True)]


class ForcedRouter(_Binding):
    """Replays given placements (the real router's decisions: the `actual` lane)."""

    name = "forced"

    def __init__(self, assignments: Mapping[Hashable, int], workers: int) -> None:
        super().__init__()
        self.assignments = assignments
        self.workers = workers

    def decide(self, fleet: FleetSnapshot, now: float) -> list[Decision]:
        out: list[Decision] = []
        for rid, _ in self._waiting:
            g = self.assignments[rid]
            if not 0 <= g < self.workers:
                raise ValueError(f"forced assignment of {rid!r} to unknown worker {g}")
            out.append((rid, g))
        self._waiting.clear()
        return out


class PoolRouter:
    """BalanceRoute (br0, brh) or BRA over a persistent pool; BR-H/BRA own their length predictor."""

    binds_at_arrival = False

    def __init__(
        self,
        variant: str,
        params: BRParams,
        predictor: Predictor | None = None,
        bra: BRAParams | None = None,
        view_age_s: float = 0.0,
    ) -> None:
        self.br: BalanceRoute | BalanceRouteAdaptive = (
            BalanceRouteAdaptive(params, bra)
            if variant == "bra"
            else BalanceRoute("br0" if variant == "br0" else "brh", params)
        )
        self.name = variant
        self.pool = Pool()
        self.predictor = predictor
        self.view = StaleLoads(view_age_s) if view_age_s > 0 else None

    def on_arrive(
        self, request_id: Hashable, prompt_tokens: int, now: float, predicted_steps: float | None = None
    ) -> None:
        self.pool.add(request_id, prompt_tokens, now, predicted_steps)

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None:
        if self.predictor is not None:
            self.predictor.observe(output_tokens, key)

    def waiting(self) -> int:
        return len(self.pool)

    def forget(self, request_id: Hashable) -> bool:
        for entry in self.pool:
            if entry.request_id == request_id:
                self.pool.remove(entry)
                return True
        return False

    def decide(self, fleet: FleetSnapshot, now: float) -> list[Decision]:
        if not self.pool:
            return []
        if not any(c > 0 for c in fleet.free_slots):
            return []
        view = self.view
        if view is None:
            return self._round(fleet, now)
        sizes = {e.request_id: e.prompt_tokens for e in self.pool}
        out = self._round(view.fleet(fleet, now), now)
        view.placed([(g, sizes[rid]) for rid, g in out])
        return out

    def _round(self, fleet: FleetSnapshot, now: float) -> list[Decision]:
        free = fleet.free_slots
        br = self.br
        cost = fleet.cost
        seqs = None if cost.paper else fleet.seqs()
        if isinstance(br, BalanceRouteAdaptive):
            # BRA scores with BR-H over the projection when it has one, with BR-0 otherwise.
            stay = fleet.extra(STAY_BASIS)
            prompts = fleet.prompt_loads
            if fleet.projection is not None:
                proj = fleet.projection()
                if len(proj[0]) or self.predictor is not None:
                    return br.round(
                        fleet.loads, free, self.pool, now, proj, prompts, stay, cost=cost, seqs=seqs
                    )
            return br.round(
                fleet.loads, free, self.pool, now, None, prompts, stay, cost=cost, seqs=seqs
            )
        if br.variant == "brh":
            return br.round(fleet.loads, free, self.pool, now, fleet.active(), cost=cost, seqs=seqs)
        return br.round(fleet.loads, free, self.pool, now, cost=cost, seqs=seqs)


class StaleLoads:
    """BR-0/BR-H/BRA's view of the KV loads and running sequences, `age_s` old at most (as
    `StaleView`: replaced at the first round due, else the last view plus each request placed
    since: its prompt tokens, one sequence). Free slots, BR-H's projection and BRA's basis stay
    current: only the loads the rounds balance are stale."""

    def __init__(self, age_s: float) -> None:
        if not age_s >= 0:
            raise ValueError(f"a view's age must be >= 0 s, got {age_s!r}")
        self.age_s = age_s
        self._loads: list[float] = []
        self._running: list[int] = []
        self._at = -math.inf

    def fleet(self, fleet: FleetSnapshot, now: float) -> FleetSnapshot:
        """`fleet` with the view's loads (and running sequences)."""
        if not 0 <= now - self._at < self.age_s or len(self._loads) != fleet.workers:
            self._loads = list(fleet.loads)
            seqs = fleet.seqs()
            self._running = [0] * fleet.workers if seqs is None else list(seqs)
            self._at = now
        return replace(fleet, loads=self._loads, running=self._running)

    def placed(self, decisions: list[tuple[int, int]]) -> None:
        """(worker, prompt tokens) of each request just placed: the view's optimistic increments."""
        for g, tokens in decisions:
            self._loads[g] += tokens
            self._running[g] += 1
