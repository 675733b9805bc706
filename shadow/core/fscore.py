"""F-scores: the value of adding Δ KV tokens to worker g, for BR-0 and BR-H.

BR-0: F_g(Δ) = Δ − G·(Δ − m_g)+, the exact one-step drop of I(k).
BR-H: F_g(Δ) = α·D·Δ − β·Σ_h γ^h (Δ − m_{g,h})+ over projected margins h = 0..H, evaluated in
O(log H) from margins sorted per worker and prefix sums of the discount weights.
Both scorers also track loads through admissions inside a round (`admit`).

Loads and Δ are in the units of the scorer's `RouteCost` (KV tokens for the paper's `TOKENS`; KV
tokens + κ per sequence, or sequences, under a per-sequence step cost): a scorer is given loads
already in those units and prices the requests it admits with its cost (`RouteCost.weight`);
`tokens(g)` is worker g's KV tokens, which break ties between workers in sequence units.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shadow.core.cost import TOKENS, RouteCost
from shadow.core.params import BRParams
from shadow.core.pool import PoolEntry

FloatArray = npt.NDArray[np.float64]


class Scorer(Protocol):
    """What the two-stage assigner needs from an F-score."""

    workers: int
    cost: RouteCost

    def score(self, g: int, delta: float) -> float: ...

    def score_of(self, g: int) -> Callable[[float], float]:
        """score(g, ·) as one function of Δ, the same values; valid until the next `admit`."""
        ...

    def peak(self, g: int) -> float: ...

    def margin(self, g: int) -> float: ...

    def margins(self) -> list[float]:
        """margin(g) for every worker, in index order (one call instead of G)."""
        ...

    def load(self, g: int) -> float: ...

    def tokens(self, g: int) -> float:
        """Worker g's KV tokens (its load under the paper's cost): in sequence units, a tie-break."""
        ...

    def admit(self, g: int, entries: Sequence[PoolEntry]) -> None: ...


class _Tokens:
    """Per-worker KV tokens beside loads in other units (None: the loads are the tokens)."""

    __slots__ = ("_tok",)

    def __init__(self, tokens: Sequence[float] | None) -> None:
        self._tok = None if tokens is None else [float(x) for x in tokens]

    def _add_tokens(self, g: int, entries: Sequence[PoolEntry]) -> None:
        if self._tok is not None:
            self._tok[g] += sum(e.prompt_tokens for e in entries)


class BR0Scorer(_Tokens):
    """BR-0 over current loads L_g (integers stay exact), in `cost`'s units; `tokens`: the workers'
    KV tokens when the loads are in other units."""

    __slots__ = ("_loads", "_max", "_plain", "cost", "workers")

    def __init__(
        self, loads: Sequence[float], cost: RouteCost = TOKENS, tokens: Sequence[float] | None = None
    ) -> None:
        self._tok = None if tokens is None else [float(x) for x in tokens]
        self._loads = list(loads)
        self.workers = len(self._loads)
        self._max = max(self._loads)
        self.cost = cost
        self._plain = cost.paper and tokens is None  # the paper's loads, nothing beside them

    def score(self, g: int, delta: float) -> float:
        over = delta - (self._max - self._loads[g])
        return delta - self.workers * over if over > 0 else delta

    def score_of(self, g: int) -> Callable[[float], float]:
        return partial(self.score, g)

    def peak(self, g: int) -> float:
        return self._max - self._loads[g]

    def margin(self, g: int) -> float:
        return self._max - self._loads[g]

    def margins(self) -> list[float]:
        top = self._max
        return [top - x for x in self._loads]

    def load(self, g: int) -> float:
        return self._loads[g]

    def tokens(self, g: int) -> float:
        return self._loads[g] if self._tok is None else self._tok[g]

    def admit(self, g: int, entries: Sequence[PoolEntry]) -> None:
        if self._plain:
            self._loads[g] += sum(e.prompt_tokens for e in entries)
        else:
            tokens = sum(e.prompt_tokens for e in entries)
            self._loads[g] += self.cost.weight(tokens, len(entries))
            if self._tok is not None:
                self._tok[g] += tokens
        if self._loads[g] > self._max:
            self._max = self._loads[g]


#: BR-H's active requests: (worker index, current load, predicted steps within the horizon).
Projection = tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]]
#: No active requests (loads held constant over the horizon).
NO_PROJECTION: Projection = (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0))


def project_loads(
    loads: Sequence[float],
    active_worker: npt.NDArray[np.int64],
    active_load: FloatArray,
    active_steps: FloatArray,
    horizon: int,
    growth: float = 1.0,
) -> FloatArray:
    """L̂_g(k+h) for h = 0..H from active requests (worker, current load w_i, predicted steps ĉ_i).

    Request i contributes w_i + growth·h while present: for h < max(1, ⌈ĉ_i⌉), and for every h
    when ĉ_i >= H (`growth`: a generated token's weight, 1 in token units). Column 0 equals
    `loads`: load not covered by listed requests (if any) is held constant over the horizon.
    """
    workers = len(loads)
    width = horizon + 1
    base = np.asarray(loads, dtype=np.float64)
    if active_worker.size == 0:
        return np.repeat(base[:, None], width, axis=1)
    # ufuncs rather than np.where/np.clip (Python wrappers that cost more than the work): the same values
    steps = np.minimum(np.maximum(np.ceil(active_steps), 1), width)
    steps[active_steps >= horizon] = width
    last = steps.astype(np.int64) - 1  # request present for h in [0, last]
    flat = active_worker * width + last
    size = workers * width
    cnt = np.bincount(flat, minlength=size).reshape(workers, width).astype(np.float64)
    sw = np.bincount(flat, weights=active_load, minlength=size).reshape(workers, width)
    # Present at h iff last >= h: reverse cumulative sums along h.
    accumulate = np.add.accumulate  # cumsum's ufunc
    cnt = accumulate(cnt[:, ::-1], axis=1)[:, ::-1]
    sw = accumulate(sw[:, ::-1], axis=1)[:, ::-1]
    h = np.arange(width, dtype=np.float64)
    covered = sw[:, 0]
    grown = h[None, :] * cnt if growth == 1.0 else (growth * h)[None, :] * cnt
    proj = sw + grown + (base - covered)[:, None]
    return proj


class BRHScorer(_Tokens):
    """BR-H over a projection L̂ (G × (H+1)) in `cost`'s units (`tokens`: as BR0Scorer's).

    Margins are re-sorted lazily: an admission marks the rows it changed (all of them when the
    envelope rises) and a row is rebuilt only when its score or peak is next asked for.
    """

    __slots__ = (
        "_D",
        "_alpha",
        "_beta",
        "_d",
        "_dirty",
        "_dm",
        "_env",
        "_h",
        "_m0",
        "_newcomer",
        "_peak",
        "_pre",
        "_proj",
        "_s",
        "_sorted",
        "_thr",
        "_thr_eps",
        "_v",
        "_w",
        "cost",
        "horizon",
        "workers",
    )

    def __init__(
        self,
        projection: FloatArray,
        params: BRParams,
        cost: RouteCost = TOKENS,
        tokens: Sequence[float] | None = None,
    ) -> None:
        super().__init__(tokens)
        self.cost = cost
        if projection.ndim != 2 or projection.shape[1] != params.horizon + 1:
            raise ValueError(
                f"projection must have shape (G, H+1) = (G, {params.horizon + 1}), got {projection.shape}"
            )
        self._proj = np.array(projection, dtype=np.float64)
        self.workers = int(self._proj.shape[0])
        self.horizon = params.horizon
        self._alpha = float(params.alpha)
        self._beta = float(params.beta)
        self._newcomer = params.newcomer
        self._d = params.gamma ** np.arange(params.horizon + 1, dtype=np.float64)
        self._D = float(np.add.reduce(self._d))  # .sum()'s ufunc
        self._thr = self._alpha / self._beta * self._D
        self._thr_eps = self._thr * (1 - 1e-12)
        self._pre = np.zeros((3, params.horizon + 2), dtype=np.float64)
        self._s = np.empty((2, params.horizon + 1), dtype=np.float64)
        self._dm = np.zeros((2, params.horizon + 1), dtype=np.float64)
        self._dm[0] = self._d
        self._h = np.arange(params.horizon + 1, dtype=np.float64)
        self._env = np.maximum.reduce(self._proj, axis=0)  # .max()'s ufunc
        self._sorted: list[list[float]] = [[] for _ in range(self.workers)]
        self._w: list[list[float]] = [[] for _ in range(self.workers)]
        self._v: list[list[float]] = [[] for _ in range(self.workers)]
        self._peak: list[float] = [0.0] * self.workers
        self._dirty: set[int] = set(range(self.workers))
        self._m0: list[float] = (self._env[0] - self._proj[:, 0]).tolist()  # margins(), kept by admit

    def _row(self, g: int) -> None:
        """Sort worker g's margins m_{g,h} with their weights γ^h; prefix sums; the peak Δ*_g.
        (Called once per Stage-2 pop when the envelope rose: few array calls into preallocated
        buffers, one list conversion for the sorted margins and both prefix sums.)"""
        self._dirty.discard(g)
        dm = self._dm  # [γ^h, m_{g,h}]
        margins = dm[1]
        np.subtract(self._env, self._proj[g], out=margins)
        s = self._s  # [d sorted, m sorted], then [d sorted, d·m sorted]
        dm.take(margins.argsort(kind="stable"), axis=1, out=s)
        pre = self._pre  # [0, Σ d], [0, Σ d·m], [0, m sorted]: column 0 stays 0
        pre[2, 1:] = s[1]
        s[1] *= s[0]
        np.add.accumulate(s, axis=1, out=pre[:2, 1:])  # cumsum's ufunc, without its wrapper
        w, v, sm_l = pre.tolist()
        del sm_l[0]
        # Δ* = first sorted margin where the d-weight of margins at or below it reaches (α/β)·D.
        j = min(bisect.bisect_left(w, self._thr_eps, 1) - 1, len(sm_l) - 1)
        self._sorted[g] = sm_l
        self._w[g] = w
        self._v[g] = v
        self._peak[g] = sm_l[j]

    def score(self, g: int, delta: float) -> float:
        if g in self._dirty:
            self._row(g)
        j = bisect.bisect_left(self._sorted[g], delta)  # number of margins < Δ
        return self._alpha * self._D * delta - self._beta * (delta * self._w[g][j] - self._v[g][j])

    def score_of(self, g: int) -> Callable[[float], float]:
        """`score(g, ·)` with worker g's sorted margins and prefix sums bound (the same arithmetic:
        (α·D)·Δ − β·(Δ·W_j − V_j)): the Stage-2 subset search calls it per candidate subset."""
        if g in self._dirty:
            self._row(g)
        sm, w, v = self._sorted[g], self._w[g], self._v[g]
        ad, beta = self._alpha * self._D, self._beta
        left = bisect.bisect_left

        def f(delta: float) -> float:
            j = left(sm, delta)
            return ad * delta - beta * (delta * w[j] - v[j])

        return f

    def peak(self, g: int) -> float:
        if g in self._dirty:
            self._row(g)
        return self._peak[g]

    def margin(self, g: int) -> float:
        return float(self._env[0] - self._proj[g, 0])

    def margins(self) -> list[float]:
        return self._m0.copy()

    def load(self, g: int) -> float:
        return float(self._proj[g, 0])

    def tokens(self, g: int) -> float:
        return float(self._proj[g, 0]) if self._tok is None else self._tok[g]

    def admit(self, g: int, entries: Sequence[PoolEntry]) -> None:
        width = self.horizon + 1
        row = self._proj[g]
        cost = self.cost
        for e in entries:
            if self._newcomer == "constant":
                row += cost.weight(e.prompt_tokens)
                continue
            steps = width if e.horizon_steps is None else e.horizon_steps
            n = width if steps >= self.horizon else max(1, min(width, math.ceil(steps)))
            if cost.paper:
                row[:n] += e.prompt_tokens + self._h[:n]
            else:
                row[:n] += cost.token * (e.prompt_tokens + self._h[:n]) + cost.seq
        self._add_tokens(g, entries)
        env = self._env
        top = env[0]
        if np.count_nonzero(row > env):  # (faster than .any(), the same test)
            np.maximum(env, row, out=env)
            self._dirty.update(range(self.workers))
        else:
            self._dirty.add(g)
        if env[0] != top:  # every margin moved: the same subtraction as a fresh scorer's
            self._m0 = (env[0] - self._proj[:, 0]).tolist()
        else:
            self._m0[g] = float(top - row[0])

    def projection(self) -> FloatArray:
        """A copy of the current projection (after admissions)."""
        return self._proj.copy()
