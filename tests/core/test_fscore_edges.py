"""BR-H's projection and its scorer's admissions against hand-computed rows: requests present for
⌈ĉ⌉ steps (at least one, the whole horizon from ĉ = H), load not covered by listed requests held
constant, newcomers entering as "grow" (s + h while predicted present) or "constant" (s), and the
projection shape refused with its message."""

from __future__ import annotations

import numpy as np
import pytest

from shadow.core.fscore import BRHScorer, project_loads
from shadow.core.params import BRParams
from shadow.core.pool import PoolEntry


def _project(loads: list[float], active: list[tuple[int, float, float]], horizon: int) -> list[list[float]]:
    worker = np.array([a[0] for a in active], dtype=np.int64)
    load = np.array([a[1] for a in active], dtype=np.float64)
    steps = np.array([a[2] for a in active], dtype=np.float64)
    return project_loads(loads, worker, load, steps, horizon).tolist()  # type: ignore[no-any-return]


def test_one_request_is_present_for_its_rounded_up_predicted_steps() -> None:
    # H = 3. Worker 0: one request (w = 10, ĉ = 1.5 -> present h = 0, 1). Worker 1: idle at 5.
    assert _project([10.0, 5.0], [(0, 10.0, 1.5)], 3) == [[10.0, 11.0, 0.0, 0.0], [5.0] * 4]


def test_predicted_steps_at_the_horizon_stay_for_the_whole_horizon_and_below_one_for_one_step() -> None:
    # ĉ = H = 3: present at every h (4 columns), not only h < 3; ĉ = 0.2 and 0: one step.
    assert _project([7.0], [(0, 7.0, 3.0)], 3) == [[7.0, 8.0, 9.0, 10.0]]
    assert _project([7.0], [(0, 7.0, 0.2)], 3) == [[7.0, 0.0, 0.0, 0.0]]
    assert _project([7.0], [(0, 7.0, 0.0)], 3) == [[7.0, 0.0, 0.0, 0.0]]


def test_load_not_covered_by_listed_requests_is_held_constant() -> None:
    # Worker 0 holds 12 tokens, of which a listed request (w = 4, ĉ = 1) covers 4: 8 stay.
    assert _project([12.0, 3.0], [(0, 4.0, 1.0), (1, 3.0, 1.5)], 2) == [[12.0, 8.0, 8.0], [3.0, 4.0, 0.0]]


def _scorer(rows: list[list[float]], **params: object) -> BRHScorer:
    return BRHScorer(np.array(rows, dtype=np.float64), BRParams(horizon=len(rows[0]) - 1, **params))  # type: ignore[arg-type]


def test_a_growing_newcomer_adds_its_prompt_plus_age_while_predicted_present() -> None:
    sc = _scorer([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    sc.admit(0, [PoolEntry("a", 10, 0)])  # no prediction: the whole horizon
    sc.admit(1, [PoolEntry("b", 5, 1, horizon_steps=3.0)])  # ĉ = H: the whole horizon too
    assert sc.projection().tolist() == [[10.0, 11.0, 12.0, 13.0], [6.0, 7.0, 8.0, 9.0]]
    sc.admit(0, [PoolEntry("c", 2, 2, horizon_steps=0.3), PoolEntry("d", 1, 3, horizon_steps=1.5)])
    # c (s = 2, ĉ = 0.3): + 2 at h = 0; d (s = 1, ĉ = 1.5): + 1 at h = 0, + 2 at h = 1
    assert sc.projection()[0].tolist() == [13.0, 13.0, 12.0, 13.0]


def test_a_constant_newcomer_adds_its_prompt_at_every_step() -> None:
    sc = _scorer([[0.0, 0.0, 0.0], [4.0, 4.0, 4.0]], newcomer="constant")
    sc.admit(0, [PoolEntry("a", 10, 0, horizon_steps=1.0), PoolEntry("b", 3, 1)])
    assert sc.projection().tolist() == [[13.0, 13.0, 13.0], [4.0, 4.0, 4.0]]
    assert sc.load(0) == 13.0 and sc.margin(1) == 9.0


@pytest.mark.parametrize("shape", [(4,), (2, 3), (2, 4, 1)])
def test_a_projection_of_the_wrong_shape_is_refused_with_the_expected_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"^projection must have shape \(G, H\+1\) = \(G, 4\), got "):
        BRHScorer(np.zeros(shape), BRParams(horizon=3))


def test_an_admission_that_raises_the_envelope_rescores_the_other_workers() -> None:
    # Worker 1's peak and scores are relative to the envelope (max over workers per h): once worker
    # 0 rises above it, worker 1's margins grow and its score for the same Δ changes.
    sc = _scorer([[1.0, 1.0], [1.0, 1.0]])
    before = (sc.peak(1), sc.score(1, 5.0))
    sc.admit(0, [PoolEntry("a", 50, 0)])
    assert (sc.peak(1), sc.score(1, 5.0)) != before
    assert sc.margins() == [0.0, 50.0]
