"""Predictors of how long an active request stays within the BR-H horizon.

Interface: for requests with `generated` tokens so far, `predict` returns p_fin (probability of
finishing within H more steps) and mu_rem (expected remaining steps given that it does);
ĉ = (1 − p_fin)·H + p_fin·mu_rem (`contribution`). Oracle knows the true remaining length and
is an offline upper bound only; Survival learns the empirical output-length distribution
online from finished requests; ExactMatch keeps one per prompt key (a hash, never text) and
falls back to Survival.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Prediction = tuple[FloatArray, FloatArray]
"""Per request: p_fin, the probability it ends within the horizon, and mu_rem, its expected
remaining steps if it does."""
Keys = Sequence[Hashable | None] | None
"""Per request its prompt key (None: no key), or None for none at all."""


def contribution(p_fin: FloatArray, mu_rem: FloatArray, horizon: int) -> FloatArray:
    """ĉ = (1 − p_fin)·H + p_fin·mu_rem, clipped to [0, H]; ValueError if a predictor gave a
    non-finite p_fin or mu_rem (every prediction reaches BR-H's projection through here, and a NaN
    step count has no place in it: it would become an arbitrary integer index)."""
    with np.errstate(invalid="ignore"):  # inf − inf: NaN, refused below
        c = (1.0 - p_fin) * horizon + p_fin * mu_rem
    if not np.isfinite(c).all():
        bad = int(np.count_nonzero(~np.isfinite(c)))
        raise ValueError(f"a length predictor gave {bad} non-finite prediction(s) of {c.size}")
    return np.clip(c, 0.0, float(horizon))


class Predictor(Protocol):
    """Termination-classifier interface used by BR-H."""

    name: str

    def predict(self, generated: IntArray, horizon: int, keys: Keys = None,
                remaining: IntArray | None = None) -> Prediction: ...

    def observe(self, output_tokens: int, key: Hashable | None = None) -> None: ...


def _from_counts(
    age: FloatArray, horizon: int, survivors: IntArray, finishing: IntArray, sums: FloatArray
) -> Prediction:
    """p_fin and mu_rem from, per query, the samples above the age, those ending within H, and
    the sum of the latter (see `EmpiricalLengths.conditional` for the edge cases)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p_fin = np.where(survivors > 0, finishing / np.maximum(survivors, 1), 1.0)
        mu = np.where(finishing > 0, (sums - age * finishing) / np.maximum(finishing, 1), horizon / 2.0)
    mu = np.where(survivors > 0, mu, 1.0)
    return p_fin.astype(np.float64), mu.astype(np.float64)


class EmpiricalLengths:
    """Empirical output-length distribution with O(log N) conditional queries."""

    __slots__ = ("_pending", "_prefix", "_sorted")

    def __init__(self, lengths: Sequence[int] = ()) -> None:
        self._sorted: FloatArray = np.zeros(0)
        self._prefix: FloatArray = np.zeros(1)
        self._pending: list[int] = [int(x) for x in lengths]

    def __len__(self) -> int:
        return int(self._sorted.size) + len(self._pending)

    def add(self, length: int) -> None:
        """Record one finished request's output length (tokens)."""
        if length < 0:
            raise ValueError(f"output length must be >= 0, got {length}")
        self._pending.append(int(length))

    def _settle(self) -> None:
        if self._pending:
            self._sorted = _merged(self._sorted, self._pending)
            self._prefix = np.concatenate([[0.0], np.cumsum(self._sorted)])
            self._pending.clear()

    def conditional(self, age: FloatArray, horizon: int) -> Prediction:
        """p_fin(a) = [F(a+H) − F(a)] / [1 − F(a)], mu_rem(a) = E[O − a | a < O ≤ a+H].

        No data: p_fin = 0 (assume it stays). Every sample ≤ a: p_fin = 1, mu_rem = 1.
        No sample in (a, a+H]: mu_rem = H/2.
        """
        self._settle()
        age = np.asarray(age, dtype=np.float64)
        n = self._sorted.size
        if n == 0:
            return np.zeros_like(age), np.full_like(age, horizon / 2.0)
        le_a = np.searchsorted(self._sorted, age, side="right")
        le_ah = np.searchsorted(self._sorted, age + horizon, side="right")
        return _from_counts(age, horizon, n - le_a, le_ah - le_a, self._prefix[le_ah] - self._prefix[le_a])


class OraclePredictor:
    """Knows each request's true remaining steps (offline upper bound, labelled as such)."""

    name = "oracle"

    def predict(self, generated: IntArray, horizon: int, keys: Keys = None,
                remaining: IntArray | None = None) -> Prediction:
        if remaining is None:
            raise ValueError("the oracle predictor needs true remaining lengths (offline replay only)")
        r = np.asarray(remaining, dtype=np.float64)
        return (r <= horizon).astype(np.float64), r

    def observe(self, output_tokens: int, key: Hashable | None = None) -> None:
        return None


class SurvivalPredictor:
    """Age-conditioned empirical distribution of output lengths, learned online."""

    name = "survival"

    def __init__(self, history: Sequence[int] = ()) -> None:
        self.lengths = EmpiricalLengths(history)

    def predict(self, generated: IntArray, horizon: int, keys: Keys = None,
                remaining: IntArray | None = None) -> Prediction:
        return self.lengths.conditional(np.asarray(generated, dtype=np.float64), horizon)

    def observe(self, output_tokens: int, key: Hashable | None = None) -> None:
        self.lengths.add(output_tokens)


class ExactMatchPredictor:
    """Per prompt-key empirical distributions; keys with < `min_samples` fall back to Survival.

    All buckets live in one sorted array of composite values (bucket id · 2^24 + length), so a
    batch of requests with different keys is answered with a few vectorised searches.
    """

    name = "exactmatch"
    _SHIFT = float(2**24)  # output lengths < 16.7 M; 2^29 buckets stay exact in float64

    def __init__(self, min_samples: int = 1) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.min_samples = min_samples
        self.fallback = SurvivalPredictor()
        self._ids: dict[Hashable, int] = {}
        self._counts: list[int] = []
        self._pending: list[float] = []
        self._composite: FloatArray = np.zeros(0)
        self._prefix: FloatArray = np.zeros(1)

    def _settle(self) -> None:
        if self._pending:
            self._composite = _merged(self._composite, self._pending)
            self._prefix = np.concatenate([[0.0], np.cumsum(np.mod(self._composite, self._SHIFT))])
            self._pending.clear()

    def predict(self, generated: IntArray, horizon: int, keys: Keys = None,
                remaining: IntArray | None = None) -> Prediction:
        gen = np.asarray(generated, dtype=np.float64)
        p_fin, mu = self.fallback.predict(np.asarray(generated), horizon)
        if keys is None or not self._ids:
            return p_fin, mu
        self._settle()
        bucket = np.fromiter(
            (self._ids.get(k, -1) if k is not None else -1 for k in keys), dtype=np.int64, count=len(keys)
        )
        counts = np.asarray(self._counts, dtype=np.int64)
        use = np.flatnonzero((bucket >= 0) & (counts[np.maximum(bucket, 0)] >= self.min_samples))
        if use.size == 0:
            return p_fin, mu
        base = bucket[use].astype(np.float64) * self._SHIFT
        age = gen[use]
        comp, pre = self._composite, self._prefix
        le_a = np.searchsorted(comp, base + age, side="right")
        le_ah = np.searchsorted(comp, base + age + horizon, side="right")
        end = np.searchsorted(comp, base + (self._SHIFT - 1.0), side="right")
        bp, bm = _from_counts(age, horizon, end - le_a, le_ah - le_a, pre[le_ah] - pre[le_a])
        p_fin[use] = bp
        mu[use] = bm
        return p_fin, mu

    def observe(self, output_tokens: int, key: Hashable | None = None) -> None:
        self.fallback.observe(output_tokens)
        if key is None:
            return
        if not 0 <= output_tokens < self._SHIFT:
            raise ValueError(f"output length out of range: {output_tokens}")
        bucket = self._ids.setdefault(key, len(self._ids))
        if bucket == len(self._counts):
            self._counts.append(0)
        self._counts[bucket] += 1
        self._pending.append(bucket * self._SHIFT + output_tokens)


def _merged(values: FloatArray, pending: Sequence[float]) -> FloatArray:
    """`values` (sorted) with `pending` merged in, sorted (stable)."""
    merged = np.concatenate([values, np.asarray(pending, dtype=np.float64)])
    merged.sort(kind="mergesort")
    return merged


PREDICTORS = ("oracle", "survival", "exactmatch")


def make_predictor(name: str) -> Predictor:
    """A fresh predictor by name (ValueError for an unknown one)."""
    if name == "oracle":
        return OraclePredictor()
    if name == "survival":
        return SurvivalPredictor()
    if name == "exactmatch":
        return ExactMatchPredictor()
    raise ValueError(f"unknown predictor {name!r}; known: {list(PREDICTORS)}")
