"""Step-cost form selection (`shadow.core.stepcost`) on synthetic steps with known terms and noise:
the terms come back within their intervals, the true form is chosen, a form with a significantly
negative term never is, what the data cannot identify is said, and the sliding fit's memory is
bounded."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.stepcost import (
    FORMS,
    TERMS,
    CostFit,
    StepCostFit,
    form_label,
    select,
)

W = 25
Arr = npt.NDArray[np.float64]
MEANS = {"c": 16.5, "a": 1e5, "p": 0.0}  # feature means of `synthetic` (p: set from its q)


def synthetic(
    seed: int, terms: dict[str, float], *, steps: int = 6000, noise: float = 0.05, q: float = 0.3,
    regime: int = 40,
) -> tuple[Arr, Arr, Arr, Arr]:
    """Per step: period, running sequences, KV tokens, prefill tokens. The sequences and the load
    change every `regime` steps (independently, uniform); a step holds a prefill of 16-512 tokens
    with probability q; the period is the true cost plus Gaussian noise of sd `noise` × the mean
    cost (homoscedastic: the OLS intervals are exact)."""
    rng = np.random.default_rng(seed)
    r = steps // regime + 1
    n = np.repeat(rng.integers(1, 33, size=r), regime)[:steps].astype(np.float64)
    kv = np.repeat(rng.uniform(0, 2e5, size=r), regime)[:steps]
    prefill = np.where(rng.random(steps) < q, rng.integers(16, 513, size=steps), 0).astype(np.float64)
    get = terms.get
    cost = get("b", 0.0) + get("c", 0.0) * n + get("a", 0.0) * kv + get("p", 0.0) * prefill
    y = cost + rng.normal(0.0, noise * float(cost.mean()), size=steps)
    return np.maximum(y, 1e-9), n, kv, prefill


def windows(*cols: npt.NDArray[np.float64]) -> list[npt.NDArray[np.float64]]:
    k = len(cols[0]) // W * W
    return [c[:k].reshape(-1, W).mean(axis=1) for c in cols]


def choose(seed: int, terms: dict[str, float], **kw: float) -> CostFit:
    y, n, kv, prefill = windows(*synthetic(seed, terms, **kw))  # type: ignore[arg-type]
    return select(y, n, kv, prefill, window_steps=W)


@st.composite
def true_terms(draw: st.DrawFn) -> dict[str, float]:
    """b with a random subset of c, a, p, each adding 0.3-2 × b to the mean step (strong terms)."""
    b = draw(st.floats(1e-3, 2e-2))
    out = {"b": b}
    q_mean = 0.3 * 264.0  # E[P] at q = 0.3
    for t, mean in (("c", MEANS["c"]), ("a", MEANS["a"]), ("p", q_mean)):
        if draw(st.booleans()):
            out[t] = draw(st.floats(0.3, 2.0)) * b / mean
    return out


@settings(max_examples=40, deadline=None)
@given(true_terms(), st.integers(0, 2**31), st.floats(0.01, 0.1))
def test_every_strong_term_is_chosen_and_recovered_within_its_interval(
        terms: dict[str, float], seed: int, noise: float) -> None:
    fit = choose(seed, terms, noise=noise)
    assert fit.chosen is not None, fit.reason
    true_form = tuple(t for t in TERMS if t in terms)
    assert set(true_form) <= set(fit.chosen.form), (fit.chosen.label, true_form, fit.reason)
    assert fit.chosen.admissible and fit.windows == 240
    # the true form's terms within twice their 95 % half-width (a miss: p < 1e-4 per term)
    own = next(f for f in fit.forms if f.form == true_form)
    for t, v in own.terms.items():
        half = (v.high - v.low) / 2
        assert abs(v.value - terms[t]) <= 2 * half, (t, v, terms[t])
        assert v.low <= v.value <= v.high
    assert fit.model is not None and fit.chosen.oos_error is not None and fit.chosen.oos_error < 0.1


def test_the_true_form_is_chosen_and_the_intervals_cover_at_their_level() -> None:
    """Over 100 seeded runs of b + c·n + p·P at 5 % noise: the true form is chosen in at least 90
    (a superfluous term passes the 95 % test rarely), and each term's 95 % interval covers its
    true value in 85-100 of them (binomial: 95 expected, sd 2.2)."""
    terms = {"b": 4e-3, "c": 2e-4, "p": 2e-5}
    form = ("b", "c", "p")
    chosen = 0
    covered = dict.fromkeys(form, 0)
    for seed in range(100):
        fit = choose(seed, terms)
        assert fit.chosen is not None
        chosen += fit.chosen.form == form
        own = next(f for f in fit.forms if f.form == form)
        for t in form:
            covered[t] += own.terms[t].low <= terms[t] <= own.terms[t].high
    assert chosen >= 90, chosen
    assert all(85 <= k <= 100 for k in covered.values()), covered


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.lists(st.floats(-1.0, 1.0), min_size=3, max_size=3), st.floats(0.01, 0.3))
def test_a_form_with_a_significantly_negative_term_is_never_chosen(
        seed: int, signs: list[float], noise: float) -> None:
    """Whatever the data (costs that fall with a feature included), the chosen form has no term
    whose interval lies below 0, and the model handed on is a valid one."""
    b = 0.01
    terms = {"b": b}
    for (t, mean), f in zip((("c", MEANS["c"]), ("a", MEANS["a"]), ("p", 79.2)), signs, strict=True):
        terms[t] = 0.3 * f * b / mean  # each between -0.3 b and 0.3 b on average: the period stays > 0
    fit = choose(seed, terms, noise=noise)
    assert fit.chosen is not None
    assert all(v.high >= 0 for v in fit.chosen.terms.values()), fit.chosen
    for f in fit.forms:
        if f.terms and any(v.high < 0 for v in f.terms.values()):
            assert not f.admissible and f.why_not and "negative" in f.why_not
    model = fit.model
    assert model is not None and min(model.a, model.b, model.c, model.p) >= 0


def test_a_negative_cost_in_the_data_keeps_its_term_out() -> None:
    fit = choose(3, {"b": 0.01, "c": -1.5e-4})  # steps get shorter with more sequences
    assert fit.chosen is not None and "c" not in fit.chosen.form
    with_c = next(f for f in fit.forms if f.form == ("b", "c"))
    assert not with_c.admissible and with_c.why_not == "significantly negative c"


def test_what_the_windows_cannot_identify_is_said_and_never_fitted() -> None:
    rng = np.random.default_rng(0)
    k = 60
    n = rng.integers(1, 16, size=k).astype(np.float64)
    y = 0.004 + 3e-4 * n + rng.normal(0, 1e-4, size=k)
    none = select(y, n, 5e4 * np.ones(k), np.zeros(k))  # constant load, no prefill seen
    assert set(none.not_identified) == {"a", "p"}
    assert "none seen" in none.not_identified["p"] and "50000 throughout" in none.not_identified["a"]
    assert none.chosen is not None and none.chosen.form == ("b", "c")
    out = [f for f in none.forms if not f.admissible]
    assert {f.form for f in out} == {f for f in FORMS if "a" in f or "p" in f}
    assert all(f.why_not and f.why_not.startswith("not identified") for f in out)
    together = select(y, n, 1000.0 * n, np.zeros(k))  # every request the same length: L = 1000 n
    assert "c+a" in together.not_identified and "moved together" in together.not_identified["c+a"]
    assert together.chosen is not None and not {"c", "a"} <= set(together.chosen.form)


def test_too_few_windows_choose_nothing_and_say_so() -> None:
    fit = select([0.01] * 5, [1] * 5, [0] * 5, [0] * 5, window_steps=W)
    assert fit.chosen is None and fit.model is None and "5 windows of 25 steps" in fit.reason


@given(st.integers(0, 2**31), st.integers(20, 40))
@settings(max_examples=20, deadline=None)
def test_the_sliding_fit_keeps_bounded_memory_and_follows_a_change(seed: int, keep: int) -> None:
    rng = np.random.default_rng(seed)
    fit = StepCostFit(window_steps=5, max_windows=keep, min_windows=10, blocks=5)
    for phase in ({"b": 0.004, "c": 3e-4}, {"b": 0.004, "p": 2e-5}):
        y, n, kv, prefill = synthetic(int(rng.integers(1 << 30)), phase, steps=20 * keep * 5, noise=0.02,
                                      regime=5)
        for row in zip(y, n, kv, prefill, strict=True):
            fit.add(*map(float, row))
            assert len(fit.windows) <= keep
        res = fit.result()
        assert res.windows == keep and res.chosen is not None
        assert set(res.chosen.form) >= set(phase), (phase, res.chosen.label)  # refitted on the recent steps
    assert fit.taken == 2 * 20 * keep * 5 - fit.outliers


def test_a_stall_beyond_the_clamp_is_left_out_once_a_form_stands() -> None:
    y, n, kv, prefill = synthetic(1, {"b": 0.004, "c": 2e-4}, steps=1000, noise=0.02)
    fit = StepCostFit()
    for row in zip(y, n, kv, prefill, strict=True):
        assert fit.add(*map(float, row))
    before = fit.result()
    assert before.chosen is not None and fit.outliers == 0
    assert not fit.add(1.0, 4.0, 0.0, 0.0)  # 1 s where the model says ~5 ms
    assert fit.outliers == 1
    assert fit.add(1.0, 4.0, 0.0, 2000.0)  # as long, holding a prefill: its cost may be unmodelled yet
    assert fit.outliers == 1
    for bad in (math.nan, -1.0, 0.0):
        assert not fit.add(bad, 1.0, 0.0, 0.0)


def test_the_model_handed_on_sets_a_negative_estimate_within_noise_to_zero() -> None:
    fit = choose(5, {"b": 0.005})  # no cost but b: any other term is noise around 0
    assert fit.chosen is not None
    model = fit.model
    assert model is not None and model.b == pytest.approx(0.005, rel=0.02)
    for t in ("a", "c", "p"):
        assert getattr(model, t) >= 0


def test_form_labels() -> None:
    assert [form_label(f) for f in FORMS] == [
        "b", "b + c·n", "b + a·L", "b + p·P", "b + c·n + a·L", "b + c·n + p·P", "b + a·L + p·P",
        "b + c·n + a·L + p·P"]


def test_the_hosts_wait_for_a_cpu_is_measured_beside_the_fit_not_in_it() -> None:
    """Periods that are the engine's cost plus a wait for a CPU which comes and goes with the
    host's other work (not with the load): the result says what share of the period the wait is
    and how much of the chosen form's residual it accounts for."""
    rng = np.random.default_rng(4)
    y, n, kv, prefill = synthetic(4, {"b": 0.002, "c": 1e-4}, noise=0.01)
    contention = np.repeat(rng.uniform(0.0, 0.004, size=len(y) // 100 + 1), 100)[:len(y)]
    wy, wn, wkv, wp, wwait = windows(y + contention, n, kv, prefill, contention)
    fit = select(wy, wn, wkv, wp, window_steps=W, host_wait_s=wwait)
    assert fit.host_wait_share == pytest.approx(float(contention.sum() / (y + contention).sum()), rel=1e-6)
    assert fit.host_wait_r2 is not None and fit.host_wait_r2 > 0.9
    assert fit.chosen is not None and fit.chosen.r2 is not None and fit.chosen.r2 < 0.9
    unknown = select(wy, wn, wkv, wp, window_steps=W, host_wait_s=np.full(len(wy), np.nan))
    assert unknown.host_wait_share is None and unknown.host_wait_r2 is None
    sliding = StepCostFit()
    for row in zip(y + contention, n, kv, prefill, contention, strict=True):
        sliding.add(*map(float, row))
    assert sliding.result().host_wait_share == pytest.approx(fit.host_wait_share, rel=0.05)
