"""The stateful router protocol and the one registry of policy names.

A `Router` is told of each request when it reaches the router (`on_arrive`) and when it ends
(`on_finish`), and places requests when asked (`decide(view, now)`), returning
(request_id, worker_index) pairs in decision order. State (round-robin position, random stream,
the BalanceRoute pool, a length predictor) persists between calls. Routers that bind at arrival
(baselines, forced placements) place every request they have been told of; pool routers
(BR-0/BR-H) place into free slots only, keeping the rest waiting.

`make_router(name, ...)` is the only place policy names are resolved; engine lanes,
`schedule_round` and an active proxy all build routers through it. `ROUTERS` lists the names.
Pure: time and randomness are arguments; nothing here reads a clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shadow.core.balanceroute import BalanceRoute
from shadow.core.baselines import BASELINES, Baseline, WorkerView, bind_all, make_baseline
from shadow.core.bra import BalanceRouteAdaptive, BRAParams
from shadow.core.params import BRParams
from shadow.core.pool import Pool
from shadow.core.predictors import PREDICTORS, Predictor, make_predictor

Decision = tuple[Hashable, int]

_EMPTY_I = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0, dtype=np.float64)


class FleetView(Protocol):
    """What a router may look at when it decides (index = worker registration order).

    `loads`: KV tokens held by running requests; `free_slots`: free running slots;
    `worker_view()`: the baselines' signals (KV incl. queued prompts, outstanding requests and
    their forwarded tokens); `projection()`: BR-H's active requests as (worker, load, predicted
    steps) arrays. Implementations may compute the latter two lazily.
    """

    @property
    def loads(self) -> Sequence[float]: ...

    @property
    def free_slots(self) -> Sequence[int]: ...

    @property
    def prompt_loads(self) -> Sequence[float] | None:
        """Per-worker prompt tokens of running requests (BRA's thin-pool basis), if known."""
        ...

    def worker_view(self) -> WorkerView: ...

    def projection(
        self,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]]: ...


@dataclass(slots=True)
class StaticView:
    """A FleetView from plain lists (schedule_round, tests, an active proxy's snapshot)."""

    loads: Sequence[float]
    free_slots: Sequence[int]
    outstanding: Sequence[int] | None = None
    outstanding_tokens: Sequence[float] | None = None
    active_worker: npt.NDArray[np.int64] | None = None
    active_load: npt.NDArray[np.float64] | None = None
    active_steps: npt.NDArray[np.float64] | None = None
    prompt_loads: Sequence[float] | None = None

    def worker_view(self) -> WorkerView:
        return WorkerView(
            kv_tokens=[float(x) for x in self.loads],
            outstanding=list(self.outstanding)
            if self.outstanding is not None
            else [-int(c) for c in self.free_slots],
            outstanding_tokens=[float(x) for x in (self.outstanding_tokens or self.loads)],
            free_slots=[int(c) for c in self.free_slots],
        )

    def projection(
        self,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        if self.active_worker is None or self.active_load is None or self.active_steps is None:
            return _EMPTY_I, _EMPTY_F, _EMPTY_F
        return self.active_worker, self.active_load, self.active_steps


class Router(Protocol):
    """See module docstring."""

    name: str
    binds_at_arrival: bool
    predictor: Predictor | None

    def on_arrive(
        self, request_id: Hashable, prompt_tokens: int, now: float, predicted_steps: float | None = None
    ) -> None: ...

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None: ...

    def decide(self, view: FleetView, now: float) -> list[Decision]: ...

    def waiting(self) -> int: ...


class BindingRouter:
    """A baseline (rr, random, p2c, jsq, jsq-bytes, least-tokens) as a stateful router.

    `only_free`: place only on workers with a free slot, at most as many as there are free slots
    (a routing round); otherwise every waiting request is bound (an engine queues it).
    """

    binds_at_arrival = True
    predictor: Predictor | None = None

    def __init__(self, baseline: Baseline, *, only_free: bool = False) -> None:
        self.baseline = baseline
        self.name = baseline.name
        self.only_free = only_free
        self._waiting: list[tuple[Hashable, int]] = []

    def on_arrive(
        self, request_id: Hashable, prompt_tokens: int, now: float, predicted_steps: float | None = None
    ) -> None:
        self._waiting.append((request_id, prompt_tokens))

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None:
        return None

    def waiting(self) -> int:
        return len(self._waiting)

    def decide(self, view: FleetView, now: float) -> list[Decision]:
        if not self._waiting:
            return []
        wv = view.worker_view()
        if self.only_free:
            n = sum(max(0, c) for c in wv.free_slots)
            take, self._waiting = self._waiting[:n], self._waiting[n:]
        else:
            take, self._waiting = self._waiting, []
        picks = bind_all(self.baseline, wv, [s for _, s in take], self.only_free)
        return [(rid, g) for (rid, _), g in zip(take, picks, strict=True)]


class ForcedRouter:
    """Replays given placements (the real router's decisions: the `actual` lane)."""

    name = "forced"
    binds_at_arrival = True
    predictor: Predictor | None = None

    def __init__(self, assignments: Mapping[Hashable, int], workers: int) -> None:
        self.assignments = assignments
        self.workers = workers
        self._waiting: list[Hashable] = []

    def on_arrive(
        self, request_id: Hashable, prompt_tokens: int, now: float, predicted_steps: float | None = None
    ) -> None:
        self._waiting.append(request_id)

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None:
        return None

    def waiting(self) -> int:
        return len(self._waiting)

    def decide(self, view: FleetView, now: float) -> list[Decision]:
        out: list[Decision] = []
        for rid in self._waiting:
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
    ) -> None:
        self.br: BalanceRoute | BalanceRouteAdaptive = (
            BalanceRouteAdaptive(params, bra)
            if variant == "bra"
            else BalanceRoute("br0" if variant == "br0" else "brh", params)
        )
        self.name = variant
        self.pool = Pool()
        self.predictor = predictor

    def on_arrive(
        self, request_id: Hashable, prompt_tokens: int, now: float, predicted_steps: float | None = None
    ) -> None:
        self.pool.add(request_id, prompt_tokens, now, predicted_steps)

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None:
        if self.predictor is not None:
            self.predictor.observe(output_tokens, key)

    def waiting(self) -> int:
        return len(self.pool)

    def decide(self, view: FleetView, now: float) -> list[Decision]:
        if not self.pool:
            return []
        free = view.free_slots
        if not any(c > 0 for c in free):
            return []
        if isinstance(self.br, BalanceRouteAdaptive):
            # BRA scores with BR-H over the projection when it has one, with BR-0 otherwise.
            static_active = isinstance(view, StaticView) and view.active_worker is not None
            proj = view.projection() if self.predictor is not None or static_active else None
            stay = getattr(view, "stay_basis", None)  # optional FleetView extra (the engine's lanes)
            if proj is None or (not len(proj[0]) and self.predictor is None):
                return self.br.round(
                    view.loads, free, self.pool, now, None, None, None, view.prompt_loads, stay
                )
            return self.br.round(view.loads, free, self.pool, now, *proj, view.prompt_loads, stay)
        if self.br.variant == "brh":
            idx, w, c = view.projection()
            return self.br.round(view.loads, free, self.pool, now, idx, w, c)
        return self.br.round(view.loads, free, self.pool, now)


RouterFactory = Callable[..., Router]


# The factories are plain module functions bound to their policy name with `partial`, so each call
# of a factory runs the function's code then (no closure built once at import).
def _baseline_router(name: str, *, seed: int = 0, only_free: bool = False, **_: object) -> Router:
    return BindingRouter(make_baseline(name, random.Random(seed)), only_free=only_free)


def _pool_router(
    variant: str,
    *,
    params: BRParams | None = None,
    predictor: str | None = None,
    bra: BRAParams | None = None,
    **_: object,
) -> Router:
    if variant in ("brh", "bra"):
        # Without a predictor, BR-H takes predicted steps from its callers (schedule_round).
        if predictor is not None and predictor not in PREDICTORS:
            raise ValueError(f"{variant} predictor must be one of {list(PREDICTORS)}; got {predictor!r}")
        return PoolRouter(
            variant, params or BRParams(), make_predictor(predictor) if predictor else None, bra
        )
    if predictor is not None:
        raise ValueError(f"policy {variant!r} takes no predictor")
    return PoolRouter(variant, params or BRParams())


def _forced_factory(
    *, assignments: Mapping[Hashable, int] | None = None, workers: int = 0, **_: object
) -> Router:
    if assignments is None:
        raise ValueError("a forced lane needs its assignments")
    return ForcedRouter(assignments, workers)


# The registry: every policy name the project knows, mapped to its factory.
ROUTERS: Mapping[str, RouterFactory] = {
    **{name: partial(_baseline_router, name) for name in BASELINES},
    "br0": partial(_pool_router, "br0"),
    "brh": partial(_pool_router, "brh"),
    "bra": partial(_pool_router, "bra"),  # this project's BalanceRoute-adaptive (shadow.core.bra)
    "forced": _forced_factory,
}
POOL_ROUTERS = ("br0", "brh", "bra")


def make_router(
    name: str,
    *,
    params: BRParams | None = None,
    predictor: str | None = None,
    bra: BRAParams | None = None,
    seed: int = 0,
    only_free: bool = False,
    assignments: Mapping[Hashable, int] | None = None,
    workers: int = 0,
) -> Router:
    """A fresh router for policy `name` (ValueError naming the known policies otherwise)."""
    factory = ROUTERS.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known: {list(ROUTERS)}")
    if name in BASELINES and predictor is not None:
        raise ValueError(f"policy {name!r} takes no predictor")
    return factory(
        params=params,
        predictor=predictor,
        bra=bra,
        seed=seed,
        only_free=only_free,
        assignments=assignments,
        workers=workers,
    )
