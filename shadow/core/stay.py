"""BRA's "stay" basis: per worker, the KV its running requests are expected to hold, on average,
over the stay of a request admitted now.

A newcomer's predicted stay is S = E[min(O, cap)] steps under the predictor's fleet-wide output
distribution (no key). A running request i with load w_i (prompt + generated) and remaining output
R_i holds w_i + t at t = 0 .. min(R_i, S) − 1, so its mean over the stay is
E[m_i]/S · (w_i + (E[m_i] − 1)/2) with m_i = min(R_i, S) and E[m_i] the predictor's ĉ over a
horizon of S (the second moment is taken as E[m_i]², a documented approximation). Requests about
to end weigh little, long ones their whole load: the basis adapts to the output-length mix where
outstanding prompt tokens (long outputs) and current KV (short outputs) each fit only one end.
Pure: predictors and arrays in, numbers out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from shadow.core.predictors import Predictor, contribution

STAY_CAP = 4096  # a newcomer's predicted stay is capped at this many steps


class StayBasis(NamedTuple):
    """Per-worker mean KV over a newcomer's predicted stay, and that stay `span` (steps, >= 1).

    `growth`, when given, is what a newcomer adds beyond its prompt (other predicted bases).
    `seqs`, when given, is per worker the running sequences the basis counts, each weighted as its
    KV is (present over the whole window: 1; over part of it: that fraction): what a per-sequence
    step cost adds to the basis (`shadow.core.cost`); a newcomer counts one. None (no running
    request, or a basis that does not say): the fleet's running sequences stand in."""

    loads: list[float]
    span: float
    growth: float | None = None
    seqs: list[float] | None = None

    def newcomer(self, prompt_tokens: float) -> float:
        """What a newcomer of `prompt_tokens` adds to its worker's basis: prompt + mean growth."""
        return prompt_tokens + ((self.span - 1.0) / 2.0 if self.growth is None else self.growth)


def predicted_stay(predictor: Predictor, cap: int = STAY_CAP) -> int:
    """A newcomer's predicted stay in steps, E[min(O, cap)] with no key, at least 1."""
    p, mu = predictor.predict(np.zeros(1, dtype=np.int64), cap)
    return max(1, round(float(contribution(p, mu, cap)[0])))


def stay_basis(
    predictor: Predictor,
    workers: int,
    worker: npt.NDArray[np.int64],
    load: npt.NDArray[np.float64],
    age: npt.NDArray[np.int64],
    keys: Sequence[Hashable | None] | None = None,
    remaining: npt.NDArray[np.int64] | None = None,
    cap: int = STAY_CAP,
) -> StayBasis:
    """The basis for running requests (worker index, load w_i, generated tokens = age) of a fleet.

    `keys`/`remaining` are passed to the predictor as BR-H's projection passes them (only the
    offline oracle reads `remaining`).
    """
    span = predicted_stay(predictor, cap)
    if worker.size == 0:
        return StayBasis([0.0] * workers, float(span))
    p, mu = predictor.predict(age, span, keys=keys, remaining=remaining)
    m = contribution(p, mu, span)
    present = m / span
    per = present * (load + np.maximum(m - 1.0, 0.0) / 2.0)
    return StayBasis(_sums(worker, per, workers), float(span), seqs=_sums(worker, present, workers))


def _sums(worker: npt.NDArray[np.int64], weights: npt.NDArray[np.float64], workers: int) -> list[float]:
    """Per worker, the sum of `weights` of its requests."""
    return [float(x) for x in np.bincount(worker, weights=weights, minlength=workers).tolist()]


FINAL_CAP = 16_384  # remaining output is predicted up to this many steps


def predicted_basis(
    kind: str,
    predictor: Predictor,
    workers: int,
    worker: npt.NDArray[np.int64],
    load: npt.NDArray[np.float64],
    age: npt.NDArray[np.int64],
    horizon: int,
    keys: Sequence[Hashable | None] | None = None,
    remaining: npt.NDArray[np.int64] | None = None,
) -> StayBasis:
    """Other predicted bases: "life" Σ w_i + E[R_i]/2 (each request's mean KV over the rest
    of its life), "final" Σ w_i + E[R_i] (its KV when it ends), R_i the predicted remaining output
    capped at FINAL_CAP; "near" the mean KV over the next `horizon` steps; "stay" is `stay_basis`.
    A newcomer adds its prompt plus E[O]/2, E[O] resp. (H − 1)/2 (`StayBasis.newcomer`)."""
    if kind == "stay":
        return stay_basis(predictor, workers, worker, load, age, keys=keys, remaining=remaining)
    if kind == "near":
        span = float(min(horizon, predicted_stay(predictor, horizon)))
        cap = horizon
    else:
        cap = FINAL_CAP
    p0, mu0 = predictor.predict(np.zeros(1, dtype=np.int64), cap)
    e_new = float(contribution(p0, mu0, cap)[0])
    if kind == "near":
        growth = (span - 1.0) / 2.0
    elif kind == "final":
        growth = e_new
    elif kind == "life":
        growth = e_new / 2.0
    else:
        raise ValueError(f"unknown basis {kind!r}")
    if worker.size == 0:
        return StayBasis([0.0] * workers, max(1.0, e_new), growth)
    p, mu = predictor.predict(age, cap, keys=keys, remaining=remaining)
    m = contribution(p, mu, cap)
    seqs: list[float] | None = None  # life, final: every running request is there the whole window
    if kind == "near":
        present = m / cap
        per = present * (load + np.maximum(m - 1.0, 0.0) / 2.0)
        seqs = _sums(worker, present, workers)
    else:
        per = load + m if kind == "final" else load + m / 2.0
    return StayBasis(_sums(worker, per, workers), max(1.0, e_new), growth, seqs)
