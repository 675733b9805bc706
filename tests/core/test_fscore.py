"""F-scores: BR-0 is the exact drop of I(k); BR-H's fast evaluation matches its definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.cost import TOKENS, RouteCost
from shadow.core.fscore import BR0Scorer, BRHScorer, project_loads
from shadow.core.params import BRParams, br0_equivalent
from shadow.core.pool import PoolEntry
from tests.core.imbalance import imbalance

loads_st = st.lists(st.integers(0, 200_000), min_size=1, max_size=16)


@given(loads=loads_st, data=st.data())
def test_br0_score_is_exact_one_step_drop_of_imbalance(loads: list[int], data: st.DataObject) -> None:
    g = data.draw(st.integers(0, len(loads) - 1))
    delta = data.draw(st.integers(0, 300_000))
    before = imbalance(loads)
    after_loads = list(loads)
    after_loads[g] += delta
    assert BR0Scorer(loads).score(g, delta) == before - imbalance(after_loads)


def test_br0_sanity_values_from_paper_notes() -> None:
    # G=8, m_g=1000: F(500)=500, F(1000)=1000, F(1500)=1500-8*500; envelope worker F(s)=-7s.
    loads = [2000] + [1000] * 7
    scorer = BR0Scorer(loads)
    assert [scorer.score(1, d) for d in (500, 1000, 1500)] == [500, 1000, -2500]
    assert scorer.score(0, 300) == -7 * 300
    assert scorer.peak(1) == 1000


def naive_brh(proj: np.ndarray, g: int, delta: float, p: BRParams) -> float:
    env = proj.max(axis=0)
    m = env - proj[g]
    d = p.gamma ** np.arange(p.horizon + 1)
    return float(p.alpha * d.sum() * delta - p.beta * np.sum(d * np.maximum(delta - m, 0.0)))


@settings(max_examples=150, deadline=None)  # no wall-clock limit in a test (loaded CI machines)
@given(
    workers=st.integers(1, 8),
    horizon=st.integers(0, 40),
    beta=st.floats(1.5, 80),
    gamma=st.floats(0.5, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_brh_fast_score_and_peak_match_definition(
    workers: int, horizon: int, beta: float, gamma: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    proj = rng.integers(0, 50_000, size=(workers, horizon + 1)).astype(np.float64)
    params = BRParams(horizon=horizon, beta=beta, gamma=gamma)
    scorer = BRHScorer(proj, params)
    for g in range(workers):
        deltas = np.concatenate([rng.integers(0, 80_000, size=20), [scorer.peak(g)]])
        for delta in deltas:
            assert scorer.score(g, float(delta)) == pytest.approx(
                naive_brh(proj, g, float(delta), params), rel=1e-9, abs=1e-6
            )
        # The peak maximises F: nothing on a grid through all margins beats it.
        grid = np.unique(np.concatenate([proj.max(axis=0) - proj[g], deltas]))
        best = max(naive_brh(proj, g, float(x), params) for x in grid)
        assert naive_brh(proj, g, scorer.peak(g), params) >= best - 1e-6 * max(1.0, abs(best))


# G >= 2: with G = 1 the BR-0 equivalent would need beta = alpha, which BR-H rejects.
@given(loads=st.lists(st.integers(0, 200_000), min_size=2, max_size=16), data=st.data())
def test_brh_with_h0_alpha1_beta_g_scores_equal_br0(loads: list[int], data: st.DataObject) -> None:
    params = br0_equivalent(len(loads))
    brh = BRHScorer(np.asarray(loads, dtype=np.float64)[:, None], params)
    br0 = BR0Scorer(loads)
    g = data.draw(st.integers(0, len(loads) - 1))
    delta = data.draw(st.integers(0, 300_000))
    assert brh.score(g, delta) == br0.score(g, delta)
    assert brh.peak(g) == br0.peak(g)


@given(
    workers=st.integers(1, 5),
    horizon=st.integers(0, 20),
    items=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5000), st.floats(0, 30)), max_size=30),
)
def test_projection_matches_naive_sum(
    workers: int, horizon: int, items: list[tuple[int, int, float]]
) -> None:
    items = [(g % workers, w, c) for g, w, c in items]
    loads = [0.0] * workers
    for g, w, _ in items:
        loads[g] += w
    idx = np.asarray([i[0] for i in items], dtype=np.int64)
    w = np.asarray([i[1] for i in items], dtype=np.float64)
    c = np.asarray([i[2] for i in items], dtype=np.float64)
    proj = project_loads(loads, idx, w, c, horizon)
    naive = np.zeros((workers, horizon + 1))
    for g, wi, ci in items:
        for h in range(horizon + 1):
            present = h == 0 or ci >= horizon or h < np.ceil(ci)
            if present:
                naive[g, h] += wi + h
    np.testing.assert_allclose(proj, naive)
    np.testing.assert_allclose(proj[:, 0], loads)


def test_brh_admit_updates_projection_incrementally() -> None:
    params = BRParams(horizon=5, beta=10)
    proj = np.array([[100.0] * 6, [50.0] * 6])
    scorer = BRHScorer(proj, params)
    scorer.admit(1, [PoolEntry("r", 30, 0, 0.0, 2.5)])  # present for h < 3, growing s + h
    expected = np.array([[100.0] * 6, [80, 81, 82, 50, 50, 50]])
    np.testing.assert_allclose(scorer.projection(), expected)
    fresh = BRHScorer(expected, params)
    for d in (0, 10, 20, 40, 90):
        assert scorer.score(1, d) == pytest.approx(fresh.score(1, d))
        assert scorer.score(0, d) == pytest.approx(fresh.score(0, d))
    # Overtaking the envelope refreshes every worker's margins.
    scorer.admit(1, [PoolEntry("s", 500, 1, 0.0, None)])
    fresh = BRHScorer(scorer.projection(), params)
    assert scorer.peak(0) == fresh.peak(0)
    assert scorer.score(0, 300) == pytest.approx(fresh.score(0, 300))


Request = tuple[int, float | None]  # (prompt tokens, predicted steps or None: the whole horizon)


@settings(max_examples=150, deadline=None)  # no wall-clock limit in a test (loaded CI machines)
@given(
    workers=st.integers(1, 6),
    horizon=st.integers(0, 8),
    kappa=st.sampled_from([0, 37]),
    seed=st.integers(0, 2**32 - 1),
    admits=st.lists(
        st.tuples(st.integers(0, 5), st.lists(st.tuples(st.integers(0, 3000), st.none() | st.floats(0, 12)),
                                              min_size=1, max_size=3)),
        max_size=12,
    ),
)
def test_brh_state_kept_through_admissions_is_a_fresh_scorers_bit_for_bit(
    workers: int, horizon: int, kappa: int, seed: int, admits: list[tuple[int, list[Request]]]
) -> None:
    """What admit keeps (margins, rows rebuilt into reused buffers, peaks, scores) equals what a
    scorer built on the resulting projection computes, exactly, whether or not the envelope rose."""
    rng = np.random.default_rng(seed)
    proj = rng.integers(0, 20_000, size=(workers, 1)) + rng.integers(0, 9, size=(workers, horizon + 1))
    params = BRParams(horizon=horizon, beta=7.0)
    cost = RouteCost(1.0, float(kappa)) if kappa else TOKENS
    scorer = BRHScorer(proj.astype(np.float64), params, cost)
    seq = 0
    for g, reqs in admits:
        g %= workers
        scorer.peak(g)  # the row is built (and its buffers reused) before it changes
        entries = []
        for tokens, steps in reqs:
            entries.append(PoolEntry(f"r{seq}", tokens, seq, 0.0, steps))
            seq += 1
        scorer.admit(g, entries)
        fresh = BRHScorer(scorer.projection(), params, cost)
        assert scorer.margins() == fresh.margins()
        assert [scorer.margin(w) for w in range(workers)] == fresh.margins()
        for w in range(workers):
            assert scorer.peak(w) == fresh.peak(w)
            for delta in (0.0, 1.0, 500.0, 5_000.0, scorer.peak(w)):
                assert scorer.score(w, delta) == fresh.score(w, delta)
                assert scorer.score_of(w)(delta) == fresh.score_of(w)(delta)
