"""Predictors: hand-computed Survival values, ExactMatch fallback, Oracle labelling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadow.core.predictors import (
    ExactMatchPredictor,
    OraclePredictor,
    SurvivalPredictor,
    contribution,
    make_predictor,
)


def test_survival_matches_hand_computed_values() -> None:
    # Outputs {2, 4, 4, 10}, H = 3.
    pred = SurvivalPredictor([2, 4, 4, 10])
    p, mu = pred.predict(np.array([0, 1, 4, 5, 10, 12]), horizon=3)
    # a=0: F(0)=0, F(3)=1/4 → p=1/4; finishing {2} → mu = 2.
    # a=1: F(1)=0, F(4)=3/4 → p=3/4; finishing {2,4,4} → mu = (1+3+3)/3 = 7/3.
    # a=4: F(4)=3/4, F(7)=3/4 → p=0; nobody finishes in (4,7] → mu = H/2.
    # a=5: survivors {10}, (5,8] empty → p=0.
    # a=10, 12: nobody survives → p=1, mu=1.
    np.testing.assert_allclose(p, [0.25, 0.75, 0.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(mu, [2.0, 7 / 3, 1.5, 1.5, 1.0, 1.0])
    np.testing.assert_allclose(
        contribution(p, mu, 3), [0.75 * 3 + 0.25 * 2, 0.25 * 3 + 0.75 * 7 / 3, 3, 3, 1, 1]
    )


def test_survival_learns_online_and_without_data_assumes_requests_stay() -> None:
    pred = SurvivalPredictor()
    p, mu = pred.predict(np.array([0, 5]), horizon=10)
    np.testing.assert_allclose(contribution(p, mu, 10), [10, 10])
    for o in (3, 3, 3):
        pred.observe(o)
    p, mu = pred.predict(np.array([0]), horizon=10)
    assert p[0] == 1.0 and mu[0] == 3.0


@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60),
    age=st.integers(0, 300),
    h=st.integers(1, 100),
)
def test_survival_agrees_with_a_direct_count(lengths: list[int], age: int, h: int) -> None:
    p, mu = SurvivalPredictor(lengths).predict(np.array([age]), horizon=h)
    survivors = [o for o in lengths if o > age]
    finishing = [o for o in survivors if o <= age + h]
    if not survivors:
        assert (p[0], mu[0]) == (1.0, 1.0)
        return
    assert p[0] == pytest.approx(len(finishing) / len(survivors))
    expected_mu = sum(o - age for o in finishing) / len(finishing) if finishing else h / 2
    assert mu[0] == pytest.approx(expected_mu)


def test_exactmatch_uses_buckets_and_falls_back_to_survival() -> None:
    pred = ExactMatchPredictor(min_samples=2)
    for o in (100, 100, 1000, 1000, 1000):
        pred.observe(o, key="k-short" if o == 100 else None)
    pred.observe(1000, key="k-once")
    p, mu = pred.predict(np.array([95, 95, 95]), horizon=10, keys=["k-short", "k-once", None])
    # Bucket k-short: every sample ends at 100 → p=1, mu=5. k-once has 1 < 2 samples → global.
    assert (p[0], mu[0]) == (1.0, 5.0)
    p_global, mu_global = pred.fallback.predict(np.array([95]), horizon=10)
    assert (p[1], mu[1]) == (p_global[0], mu_global[0]) == (p[2], mu[2])
    assert p_global[0] == pytest.approx(2 / 6)


def test_oracle_needs_truth_and_is_exact() -> None:
    oracle = OraclePredictor()
    with pytest.raises(ValueError, match="oracle"):
        oracle.predict(np.array([1]), horizon=5)
    p, mu = oracle.predict(np.array([0, 0]), horizon=5, remaining=np.array([3, 9]))
    np.testing.assert_allclose(contribution(p, mu, 5), [3, 5])


def test_make_predictor_rejects_unknown_names() -> None:
    assert make_predictor("survival").name == "survival"
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("psychic")
    with pytest.raises(ValueError, match="min_samples"):
        ExactMatchPredictor(min_samples=0)


@given(
    data=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 400)), max_size=80),
    queries=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d", "e", None]), st.integers(0, 400)),
        min_size=1,
        max_size=20,
    ),
    min_samples=st.integers(1, 3),
    h=st.integers(1, 90),
)
def test_exactmatch_batch_equals_per_bucket_survival(
    data: list[tuple[str, int]], queries: list[tuple[str | None, int]], min_samples: int, h: int
) -> None:
    pred = ExactMatchPredictor(min_samples=min_samples)
    for key, o in data:
        pred.observe(o, key)
    keys = [k for k, _ in queries]
    ages = np.asarray([a for _, a in queries])
    p, mu = pred.predict(ages, horizon=h, keys=keys)
    for i, (key, age) in enumerate(queries):
        own = [o for k, o in data if k == key]
        ref = SurvivalPredictor(own if len(own) >= min_samples else [o for _, o in data])
        rp, rmu = ref.predict(np.asarray([age]), horizon=h)
        assert p[i] == pytest.approx(rp[0]) and mu[i] == pytest.approx(rmu[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_prediction_is_refused_before_it_reaches_brh(bad: float) -> None:
    """ĉ feeds BR-H's projection as an integer index: a NaN or infinite p_fin or mu_rem is a
    predictor defect, refused with a clear error instead of becoming an arbitrary step count."""
    p = np.asarray([0.5, bad], dtype=np.float64)
    mu = np.asarray([3.0, 4.0], dtype=np.float64)
    with pytest.raises(ValueError, match="1 non-finite prediction"):
        contribution(p, mu, 16)
    with pytest.raises(ValueError, match="non-finite"):
        contribution(mu, p, 16)
    assert contribution(mu * 0 + 0.5, mu, 16).tolist() == [9.5, 10.0]
