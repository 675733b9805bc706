"""One plain-data entry point for any caller: `schedule_round`.

Given per-worker loads and free slots and the waiting requests (oldest first), return the
admissions one routing round of the named policy makes, as (request_id, worker_index) pairs
in decision order. Pool policies (br0, brh) run the two-stage assigner; baselines route the
waiting requests in arrival order among workers with a free slot, using `loads` as their load
signal (jsq-bytes, least-tokens) and free slots as the count signal (jsq, p2c).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from shadow.core.cost import TOKENS, RouteCost
from shadow.core.fscore import Projection
from shadow.core.params import BRParams
from shadow.core.policies import POLICIES, RouterOptions, lookup
from shadow.core.routers import Router
from shadow.core.snapshot import FleetSnapshot

Waiting = tuple[Hashable, int] | tuple[Hashable, int, float]
Active = tuple[int, float, float]


def _check_fleet(loads: Sequence[float], free_slots: Sequence[int]) -> None:
    if len(loads) == 0:
        raise ValueError("loads: need at least one worker")
    if len(loads) != len(free_slots):
        raise ValueError(f"loads has {len(loads)} workers but free_slots has {len(free_slots)}")
    for g, value in enumerate(loads):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"loads[{g}] must be a finite number >= 0, got {value!r}")
    for g, c in enumerate(free_slots):
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0:
            raise ValueError(f"free_slots[{g}] must be an integer >= 0, got {c!r}")


def _check_waiting(waiting: Sequence[Sequence[Any]]) -> None:
    seen: set[Hashable] = set()
    for i, item in enumerate(waiting):
        if len(item) not in (2, 3):
            raise ValueError(f"waiting[{i}] must be (request_id, prompt_tokens[, predicted_steps])")
        rid, s = item[0], item[1]
        if isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 0:
            raise ValueError(f"waiting[{i}]: prompt_tokens must be an integer >= 0, got {s!r}")
        try:
            if rid in seen:
                raise ValueError(f"waiting[{i}]: duplicate request id {rid!r}")
        except TypeError:
            raise ValueError(f"waiting[{i}]: request id must be hashable") from None
        seen.add(rid)
        if len(item) == 3 and (not isinstance(item[2], int | float) or not item[2] >= 0):
            raise ValueError(f"waiting[{i}]: predicted_steps must be a number >= 0, got {item[2]!r}")


def _active_arrays(loads: Sequence[float], active: Sequence[Active] | None) -> Projection:
    """Validate `active` (worker, load, predicted steps) and split it into arrays.

    Without `active`, today's loads are held constant over the horizon (empty arrays).
    """
    workers = len(loads)
    if active is None or len(active) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
    arr = np.asarray(active, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError("active must be a sequence of (worker_index, current_load, predicted_steps)")
    idx = arr[:, 0].astype(np.int64)
    if np.any(idx != arr[:, 0]) or np.any(idx < 0) or np.any(idx >= workers):
        raise ValueError(f"active: worker_index must be an integer in [0, {workers})")
    w, c = arr[:, 1], arr[:, 2]
    if not (np.all(np.isfinite(w)) and np.all(w >= 0) and np.all(np.isfinite(c)) and np.all(c >= 0)):
        raise ValueError("active: loads and predicted steps must be finite numbers >= 0")
    per_worker = np.bincount(idx, weights=w, minlength=workers)
    if not np.allclose(per_worker, np.asarray(loads, dtype=np.float64), rtol=1e-9, atol=1e-6):
        raise ValueError("active: current loads must sum, per worker, to `loads`")
    return idx, w, c


def _running(
    loads: Sequence[float], running: Sequence[int] | None, active: Sequence[Active] | None, cost: RouteCost
) -> list[int] | None:
    """The running sequences per worker: `running` checked, else counted from `active` when `cost`
    needs them (ValueError when it needs them and neither says)."""
    if running is not None:
        if len(running) != len(loads) or any(
            isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0 for n in running
        ):
            raise ValueError(f"running must be one integer >= 0 per worker, got {running!r}")
        return [int(n) for n in running]
    if cost.paper:
        return None
    if active is None:
        raise ValueError("a per-sequence cost needs the running sequences per worker (running or active)")
    return [int(x) for x in np.bincount(_active_arrays(loads, active)[0], minlength=len(loads))]


def schedule_round(
    policy: str | Router,
    loads: Sequence[float],
    free_slots: Sequence[int],
    waiting: Sequence[Waiting],
    *,
    params: Mapping[str, Any] | BRParams | None = None,
    active: Sequence[Active] | None = None,
    seed: int = 0,
    now: float = 0.0,
    cost: RouteCost = TOKENS,
    running: Sequence[int] | None = None,
) -> list[tuple[Hashable, int]]:
    """Admissions of one routing round of `policy`: [(request_id, worker_index), ...].

    `waiting` is (request_id, prompt_tokens) — optionally with a third item, the predicted
    steps the request stays once admitted (BR-H) — oldest first. `active` (BR-H only) lists
    (worker_index, current_load_tokens, predicted_remaining_steps) whose loads sum per worker
    to `loads`. `policy` is a name (a fresh router for this one round: round-robin starts at
    worker 0 and `random` draws from `seed`) or a router from `make_round_router` whose state
    (round-robin position, random stream, waiting pool) carries over between rounds; requests
    a router keeps waiting stay in its pool and are not repeated in later `waiting` lists.
    `cost`: what BalanceRoute's policies balance (`shadow.core.cost`; the paper's KV tokens by
    default); one with a per-sequence term needs the `running` sequences per worker (counted from
    `active` when not given). Raises ValueError on an unknown policy or invalid input.
    """
    router = make_round_router(policy, params=params, seed=seed) if isinstance(policy, str) else policy
    _check_fleet(loads, free_slots)
    _check_waiting(waiting)
    proj = _active_arrays(loads, active if router.name in ("brh", "bra") else None)
    running = _running(loads, running, active, cost)
    for item in waiting:
        router.on_arrive(item[0], int(item[1]), now, float(item[2]) if len(item) == 3 else None)
    fleet = FleetSnapshot(
        loads=[float(x) for x in loads],
        free_slots=[int(x) for x in free_slots],
        projection=lambda: proj,
        running=running,
        cost=cost,
    )
    return router.decide(fleet, now)


def make_round_router(
    name: str, *, params: Mapping[str, Any] | BRParams | None = None, seed: int = 0
) -> Router:
    """A router for repeated `schedule_round` calls (baselines place only into free slots)."""
    p = lookup(name)
    if p is None or p.name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {list(POLICIES)}")
    return p.make(RouterOptions(br=BRParams.from_mapping(params), seed=seed, only_free=True))
