"""One plain-data entry point for any caller: `schedule_round`.

Given per-worker loads and free slots and the waiting requests (oldest first), return the
admissions one routing round of the named policy makes, as (request_id, worker_index) pairs
in decision order. Pool policies (br0, brh, and bra — this project's variant) run the two-stage
assigner; baselines route the waiting requests in arrival order among workers with a free
slot, using `loads` as their load signal (jsq-bytes, least-tokens) and free slots as the count
signal (jsq, p2c).
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shadow.core.balanceroute import BalanceRoute
from shadow.core.baselines import BASELINES, WorkerView, bind_all, make_baseline
from shadow.core.bra import BalanceRouteAdaptive
from shadow.core.params import BRParams
from shadow.core.pool import Pool

POOL_POLICIES = ("br0", "brh", "bra")  # bra: this project's BalanceRoute-adaptive
POLICIES: tuple[str, ...] = ("rr", "random", "p2c", "jsq", "jsq-bytes", "least-tokens", *POOL_POLICIES)

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


def _active_arrays(
    loads: Sequence[float], active: Sequence[Active] | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
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


def schedule_round(
    policy: str,
    loads: Sequence[float],
    free_slots: Sequence[int],
    waiting: Sequence[Waiting],
    *,
    params: Mapping[str, Any] | BRParams | None = None,
    active: Sequence[Active] | None = None,
    seed: int = 0,
) -> list[tuple[Hashable, int]]:
    """Admissions of one routing round of `policy`: [(request_id, worker_index), ...].

    `waiting` is (request_id, prompt_tokens) — optionally with a third item, the predicted
    steps the request stays once admitted (BR-H) — oldest first. `active` (BR-H only) lists
    (worker_index, current_load_tokens, predicted_remaining_steps) whose loads sum per worker
    to `loads`. Raises ValueError on an unknown policy or invalid input.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {list(POLICIES)}")
    _check_fleet(loads, free_slots)
    _check_waiting(waiting)
    br = BRParams.from_mapping(params)
    if policy in BASELINES:
        view = WorkerView(
            kv_tokens=[float(x) for x in loads],
            outstanding=[-int(c) for c in free_slots],
            outstanding_tokens=[float(x) for x in loads],
            free_slots=[int(c) for c in free_slots],
        )
        capacity = sum(view.free_slots)
        admitted = list(waiting)[:capacity]
        picks = bind_all(make_baseline(policy, random.Random(seed)), view, [w[1] for w in admitted], True)
        return [(w[0], g) for w, g in zip(admitted, picks, strict=True)]
    idx, w, c = _active_arrays(loads, active if policy in ("brh", "bra") else None)
    pool = Pool()
    for item in waiting:
        pool.add(item[0], int(item[1]), 0.0, float(item[2]) if len(item) == 3 else None)
    free = [int(c) for c in free_slots]
    if policy == "bra":
        # Without `active` BRA scores with BR-0; a round has no clock, so nothing is held back
        # for longer than this call (held requests are simply not in the result).
        has_active = active is not None and len(active) > 0
        bra = BalanceRouteAdaptive(br)
        return bra.round(loads, free, pool, 0.0, *((idx, w, c) if has_active else (None, None, None)))
    router = BalanceRoute("br0" if policy == "br0" else "brh", br)
    return router.round(loads, free, pool, 0.0, idx, w, c)
