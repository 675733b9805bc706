"""Contracts of small core pieces that the property tests leave loose: the step-time fit on exact
data and at its edges, the imbalance helpers at their edges, the pool's shedding by arrival time,
the empirical length counter. Written against public functions (kills mutants, docs/mutation.md)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from shadow.core.balanceroute import BalanceRoute
from shadow.core.baselines import Baseline, BindState, bind_all
from shadow.core.bra import BalanceRouteAdaptive
from shadow.core.params import BRParams
from shadow.core.policies import make_baseline
from shadow.core.pool import Pool
from shadow.core.predictors import (
    EmpiricalLengths,
    ExactMatchPredictor,
    OraclePredictor,
    SurvivalPredictor,
    contribution,
)
from shadow.core.schedule import schedule_round
from shadow.core.stepmodel import SlidingFit, StepTimeModel
from tests.core.imbalance import barrier_idle_fraction, imbalance, spread

FALLBACK = StepTimeModel(a=1e-7, b=0.02)


def fit_of(points: list[tuple[float, float]], min_samples: int = 2) -> SlidingFit:
    fit = SlidingFit(size=100, min_samples=min_samples)
    for x, y in points:
        fit.add(x, y)
    return fit


def test_fit_on_exact_points_recovers_the_line_and_r2_is_one() -> None:
    r = fit_of([(0.0, 0.02), (100.0, 0.03), (300.0, 0.05)]).result()
    assert r.a_s_per_token == pytest.approx(1e-4, rel=1e-9) and r.b_s == pytest.approx(0.02, rel=1e-9)
    assert r.r2 == pytest.approx(1.0, rel=1e-9) and r.quality == "good"
    assert (r.samples, r.x_min, r.x_max) == (3, 0.0, 300.0)
    model = r.model(FALLBACK)
    assert model.a == pytest.approx(1e-4) and model.b == pytest.approx(0.02)


def test_two_distinct_loads_are_enough_one_is_not() -> None:
    one = fit_of([(10.0, 1.0)]).result()
    assert one.a_s_per_token is None and one.quality == "insufficient"
    two = fit_of([(10.0, 1.0), (20.0, 3.0)]).result()
    assert (two.a_s_per_token, two.b_s) == (pytest.approx(0.2), pytest.approx(-1.0))
    flat = fit_of([(10.0, 1.0), (10.0, 3.0), (10.0, 2.0)]).result()  # one load only
    assert flat.a_s_per_token is None and flat.quality == "poor"


def test_zero_loads_are_samples_negative_non_finite_and_zero_times_are_not() -> None:
    fit = fit_of([(0.0, 0.5), (5.0, 0.7)])
    assert fit.result().samples == 2
    bad = ((-1.0, 1.0), (1.0, -1e-9), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan), (math.nan, 1.0),
           (1.0, math.inf))
    for x, y in bad:
        fit.add(x, y)
    r = fit.result()
    assert r.samples == 2 and (r.x_min, r.x_max) == (0.0, 5.0)


def test_r_squared_is_cov2_over_the_variances_and_one_for_constant_times() -> None:
    assert fit_of([(1.0, 0.5), (2.0, 0.5), (3.0, 0.5)]).result().r2 == 1.0  # a flat line fits exactly
    assert fit_of([(1.0, 0.5)]).result().r2 is None
    noisy = fit_of([(1.0, 1.0), (2.0, 3.0), (3.0, 2.0), (4.0, 4.0)]).result()
    assert noisy.r2 == pytest.approx(0.64)  # cov² / (var_x var_y) = 2.0² / (5 · 1.25)
    assert noisy.quality == "poor"  # below min_r2 = 0.9


def test_model_falls_back_unless_the_fit_is_good() -> None:
    assert SlidingFit().result().model(FALLBACK) is FALLBACK
    assert fit_of([(1.0, 3.0), (2.0, 2.0)]).result().model(FALLBACK) is FALLBACK  # a < 0
    assert fit_of([(10.0, 0.5), (20.0, 1.5)]).result().model(FALLBACK) is FALLBACK  # b < 0
    flat = fit_of([(1.0, 0.2), (2.0, 0.2)]).result()  # a = 0: load does not drive step time
    assert flat.quality == "poor" and flat.model(FALLBACK) is FALLBACK
    few = fit_of([(1.0, 0.1), (2.0, 0.2)], min_samples=20).result()  # exact, but too few samples
    assert few.quality == "insufficient" and few.model(FALLBACK) is FALLBACK
    only_a = fit_of([(1.0, 0.1), (2.0, 0.2)]).result().model(FALLBACK)  # b = 0, a > 0 is physical
    assert only_a is not FALLBACK and only_a.a == pytest.approx(0.1) and abs(only_a.b) < 1e-12


def test_the_fit_keeps_only_the_most_recent_samples() -> None:
    fit = SlidingFit(size=3, min_samples=2)
    for x, y in ((1.0, 9.0), (2.0, 1.0), (3.0, 2.0), (4.0, 3.0)):  # the first point falls out
        fit.add(x, y)
    r = fit.result()
    assert r.samples == 3 and r.a_s_per_token == pytest.approx(1.0) and r.b_s == pytest.approx(-1.0)


def test_imbalance_helpers_at_their_edges() -> None:
    assert imbalance([]) == 0.0 and spread([]) == 0.0 and barrier_idle_fraction([], FALLBACK) == 0.0
    assert spread([5.0]) == 0.0 and spread([3, 9, 4]) == 6.0 and isinstance(spread([3, 9]), float)
    # all-idle fleet with b = 0: a zero-length step has no idle time (no division by zero)
    assert barrier_idle_fraction([0.0, 0.0], StepTimeModel(a=1e-7, b=0.0)) == 0.0
    m = StepTimeModel(a=1e-3, b=0.0)
    assert barrier_idle_fraction([100.0, 0.0], m) == pytest.approx(0.5)  # one of two waits all step
    assert barrier_idle_fraction([100.0, 100.0], m) == 0.0


def test_pop_arrived_before_takes_exactly_the_earlier_arrivals_in_order() -> None:
    pool = Pool()
    entries = [pool.add(f"r{i}", 100 - i, arrived_at=t) for i, t in enumerate([0.0, 1.0, 2.0, 2.0, 3.0])]
    assert pool.pop_arrived_before(-1.0) == [] and len(pool) == 5
    popped = pool.pop_arrived_before(2.0)
    assert popped == entries[:2]
    assert [e.request_id for e in pool] == ["r2", "r3", "r4"]
    assert pool.pop_arrived_before(10.0) == entries[2:] and not pool


def test_empirical_lengths_counts_added_and_initial_lengths() -> None:
    lengths = EmpiricalLengths([3, 5])
    assert len(lengths) == 2
    lengths.add(0)
    assert len(lengths) == 3
    lengths.conditional(np.array([0.0]), 4)  # settles the pending lengths: the count stays
    assert len(lengths) == 3
    with pytest.raises(ValueError, match="output length must be >= 0, got -1"):
        lengths.add(-1)
    assert len(lengths) == 3


def test_step_and_worker_time_are_a_times_load_plus_b() -> None:
    m = StepTimeModel(a=1e-3, b=0.02)
    assert m.step_time(100.0) == pytest.approx(0.12) and m.worker_time(50.0) == pytest.approx(0.07)
    assert m.step_time(0.0) == 0.02


@pytest.mark.parametrize("horizon", [3, 4, 5])
def test_oracle_agrees_with_a_point_mass_survival_estimate_at_the_horizon_edge(horizon: int) -> None:
    """Every request is 10 tokens long; at age 6, 4 remain: finishing within H iff 4 <= H."""
    oracle_p, oracle_r = OraclePredictor().predict(np.array([6]), horizon, remaining=np.array([4]))
    survival_p, _ = SurvivalPredictor([10] * 5).predict(np.array([6]), horizon)
    assert oracle_p.tolist() == survival_p.tolist() == [1.0 if horizon >= 4 else 0.0]
    assert oracle_p.dtype == np.float64 and oracle_r.dtype == np.float64 and oracle_r.tolist() == [4.0]


def test_oracle_needs_the_true_lengths() -> None:
    message = r"^the oracle predictor needs true remaining lengths \(offline replay only\)$"
    with pytest.raises(ValueError, match=message):
        OraclePredictor().predict(np.array([1]), 4)


# -- baselines ----------------------------------------------------------------------------------


def _view(kv: list[float], outstanding: list[int], free: list[int]) -> BindState:
    return BindState(list(kv), list(outstanding), list(kv), list(free))


@pytest.mark.parametrize("only_free", [False, True])
def test_bind_all_updates_the_view_after_each_choice(only_free: bool) -> None:
    view = _view([100.0, 0.0, 50.0], [3, 0, 1], [2, 3, 1])
    prompts = [40, 7, 7, 300, 1]
    picks = bind_all(make_baseline("least-tokens", random.Random(0)), view, prompts, only_free)
    kv = [100.0, 0.0, 50.0]
    out = [3, 0, 1]
    free = [2, 3, 1]
    for g, s in zip(picks, prompts, strict=True):
        cands = [w for w in range(3) if not only_free or free[w] > 0]
        assert g == min(cands, key=lambda w: (kv[w], w))
        kv[g] += s
        out[g] += 1
        free[g] -= 1 if only_free else 0
    assert picks == ([1, 1, 1, 2, 0] if only_free else [1, 1, 1, 2, 1])
    assert view.kv_tokens == kv and view.outstanding_tokens == kv
    assert view.outstanding == out and view.free_slots == free


@pytest.mark.parametrize("name", ["rr", "random", "p2c", "jsq", "jsq-bytes", "least-tokens"])
def test_no_free_worker_is_a_named_error_and_only_free_workers_are_picked(name: str) -> None:
    baseline = make_baseline(name, random.Random(1))
    with pytest.raises(ValueError, match=rf"^{name}: no worker can take the request$"):
        baseline.pick(_view([0.0, 0.0], [0, 0], [0, 0]), 5, only_free=True)
    # by default the free-slot filter is off: a full fleet still gets a worker
    assert baseline.pick(_view([0.0, 0.0], [0, 0], [0, 0]), 5) in (0, 1)
    # only worker 2 has a free slot, though it is the most loaded by every signal
    view = _view([0.0, 0.0, 9.0], [0, 0, 9], [0, 0, 1])
    assert {make_baseline(name, random.Random(s)).pick(view, 5, only_free=True) for s in range(20)} == {2}
    # without the filter every worker can be chosen by the randomised ones
    if name in ("random", "p2c"):
        even = _view([0.0] * 3, [0] * 3, [0] * 3)
        assert {make_baseline(name, random.Random(s)).pick(even, 5) for s in range(40)} == {0, 1, 2}


def test_p2c_takes_the_less_loaded_of_two_draws_and_the_first_drawn_on_ties() -> None:
    for seed in range(30):
        first, second = random.Random(seed).sample([0, 1, 2, 3], 2)
        tie = make_baseline("p2c", random.Random(seed)).pick(_view([0.0] * 4, [2, 2, 2, 2], [1] * 4), 1)
        assert tie == first
        outstanding = [5, 5, 5, 5]
        outstanding[second] = 4
        better = make_baseline("p2c", random.Random(seed)).pick(_view([0.0] * 4, outstanding, [1] * 4), 1)
        assert better == second


def test_the_base_class_has_no_policy() -> None:
    with pytest.raises(NotImplementedError):
        Baseline(random.Random(0)).pick(_view([0.0], [0], [1]), 1)


# -- schedule_round: the `active` argument ------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "message"),
    [
        ([(0, 5.0)], r"^active must be a sequence of \(worker_index, current_load, predicted_steps\)$"),
        ([0, 5.0, 1.0], r"^active must be a sequence of \(worker_index, current_load, predicted_steps\)$"),
        ([(0.5, 5.0, 1.0)], r"^active: worker_index must be an integer in \[0, 2\)$"),
        ([(-1, 5.0, 1.0)], r"^active: worker_index must be an integer in \[0, 2\)$"),
        ([(2, 5.0, 1.0)], r"^active: worker_index must be an integer in \[0, 2\)$"),
        ([(0, -5.0, 1.0)], r"^active: loads and predicted steps must be finite numbers >= 0$"),
        ([(0, math.inf, 1.0)], r"^active: loads and predicted steps must be finite numbers >= 0$"),
        ([(0, 5.0, -1.0)], r"^active: loads and predicted steps must be finite numbers >= 0$"),
        ([(0, 5.0, math.nan)], r"^active: loads and predicted steps must be finite numbers >= 0$"),
        ([(0, 4.0, 1.0)], r"^active: current loads must sum, per worker, to `loads`$"),
    ],
)
def test_invalid_active_lists_are_refused(active: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        schedule_round("brh", [5.0, 0.0], [1, 1], [("r", 3)], active=active)


def test_active_lists_with_zero_loads_and_zero_steps_on_some_workers_are_accepted() -> None:
    waiting = [("a", 30), ("b", 5)]
    params = {"horizon": 4}
    for active in ([(0, 5.0, 0.0), (0, 0.0, 2.0)], [(0, 5.0, 3)], None, []):
        out = schedule_round("brh", [5.0, 0.0], [1, 1], waiting, params=params, active=active)
        assert sorted(g for _, g in out) == [0, 1], (active, out)


# -- schedule_round: fleet and waiting validation -----------------------------------------------

SHAPE = r"^waiting\[0\] must be \(request_id, prompt_tokens\[, predicted_steps\]\)$"


@pytest.mark.parametrize(
    ("loads", "free", "waiting", "message"),
    [
        ([], [], [], r"^loads: need at least one worker$"),
        ([1.0], [1, 1], [], r"^loads has 1 workers but free_slots has 2$"),
        (["5"], [1], [], r"^loads\[0\] must be a finite number >= 0, got '5'$"),
        ([0.0, True], [1, 1], [], r"^loads\[1\] must be a finite number >= 0, got True$"),
        ([math.nan], [1], [], r"^loads\[0\] must be a finite number >= 0, got nan$"),
        ([-1.0], [1], [], r"^loads\[0\] must be a finite number >= 0, got -1.0$"),
        ([0.0], [1.0], [], r"^free_slots\[0\] must be an integer >= 0, got 1.0$"),
        ([0.0], [True], [], r"^free_slots\[0\] must be an integer >= 0, got True$"),
        ([0.0], [-1], [], r"^free_slots\[0\] must be an integer >= 0, got -1$"),
        ([0.0], [1], [("a", 1, 2.0, 3)], SHAPE),
        ([0.0], [1], [("a",)], SHAPE),
        ([0.0], [1], [("a", "5")], r"^waiting\[0\]: prompt_tokens must be an integer >= 0, got '5'$"),
        ([0.0], [1], [("a", -1)], r"^waiting\[0\]: prompt_tokens must be an integer >= 0, got -1$"),
        ([0.0], [1], [("a", 1), ("a", 2)], r"^waiting\[1\]: duplicate request id 'a'$"),
        ([0.0], [1], [(["x"], 1)], r"^waiting\[0\]: request id must be hashable$"),
        ([0.0], [1], [("a", 1, -1)], r"^waiting\[0\]: predicted_steps must be a number >= 0, got -1$"),
        ([0.0], [1], [("a", 1, "3")], r"^waiting\[0\]: predicted_steps must be a number >= 0, got '3'$"),
        ([0.0], [1], [("a", 1, math.nan)], r"^waiting\[0\]: predicted_steps must be a number >= 0, got nan$"),
    ],
)
def test_invalid_fleet_or_waiting_input_is_refused(loads: Any, free: Any, waiting: Any, message: str) -> None:
    for policy in ("jsq", "br0"):
        with pytest.raises(ValueError, match=message):
            schedule_round(policy, loads, free, waiting)


def test_edge_values_that_are_valid() -> None:
    waiting = [("a", 0, 0), ("b", 7, 0.5), ("c", 3)]
    for policy in ("jsq", "br0", "brh"):
        out = schedule_round(policy, [0.0, 2.0], [2, 2], waiting)
        assert sorted(rid for rid, _ in out) == ["a", "b", "c"], policy
    with pytest.raises(ValueError, match=r"^params must be a mapping or BRParams, got list$"):
        schedule_round("br0", [0.0], [1], [("a", 1)], params=[1])  # type: ignore[arg-type]


def test_baselines_in_schedule_round_count_free_slots_and_use_seed_zero_by_default() -> None:
    # jsq's count signal is free slots: the worker with more free slots is the shorter queue
    assert schedule_round("jsq", [0.0, 0.0], [1, 3], [("a", 1)]) == [("a", 1)]
    waiting = [(f"r{i}", 1) for i in range(12)]
    free = [3, 3, 3, 3]
    default = schedule_round("random", [0.0] * 4, free, waiting)
    assert default == schedule_round("random", [0.0] * 4, free, waiting, seed=0)
    assert any(schedule_round("random", [0.0] * 4, free, waiting, seed=s) != default for s in range(1, 4))


def test_only_predicting_policies_read_active() -> None:
    bogus = [(7, 1.0, 1.0)]  # worker 7 does not exist
    assert schedule_round("br0", [0.0], [1], [("a", 1)], active=bogus) == [("a", 0)]
    for policy in ("brh", "bra"):
        with pytest.raises(ValueError, match=r"^active: worker_index"):
            schedule_round(policy, [0.0], [1], [("a", 1)], active=bogus)


# -- schedule_round runs the named policy on exactly the given round ------------------------------


Round = tuple[list[float], list[int], list[Any], list[tuple[int, float, float]]]


def _random_round(rng: random.Random) -> Round:
    g = rng.randint(1, 4)
    active: list[tuple[int, float, float]] = []
    loads = []
    for w in range(g):
        parts = [float(rng.randint(0, 4000)) for _ in range(rng.randint(0, 3))]
        active += [(w, p, float(rng.randint(0, 120))) for p in parts]
        loads.append(sum(parts))
    free = [rng.randint(0, 3) for _ in range(g)]
    waiting: list[Any] = []
    for i in range(rng.randint(0, 8)):
        s = rng.randint(0, 3000)
        waiting.append((f"r{i}", s, float(rng.randint(0, 8))) if rng.random() < 0.6 else (f"r{i}", s))
    return loads, free, waiting, active


def _direct(policy: str, loads: list[float], free: list[int], waiting: list[Any],
            active: list[tuple[int, float, float]], params: BRParams) -> list[Any]:
    pool = Pool()
    for item in waiting:
        pool.add(item[0], item[1], 0.0, item[2] if len(item) == 3 else None)
    arrays: tuple[Any, Any, Any] | None = None
    if active:
        arr = np.asarray(active, dtype=np.float64)
        arrays = (arr[:, 0].astype(np.int64), arr[:, 1], arr[:, 2])
    if policy == "bra":
        return BalanceRouteAdaptive(params).round(loads, free, pool, 0.0, arrays)
    if policy == "br0":
        arrays = None
    return BalanceRoute(policy, params).round(loads, free, pool, 0.0, arrays)


@pytest.mark.parametrize("policy", ["br0", "brh", "bra"])
def test_schedule_round_is_one_round_of_the_named_router(policy: str) -> None:
    """Same admissions as the router itself on a pool of these requests, all arrived now (so
    none is aged), with their predicted steps, and (brh, bra) the active requests."""
    rng = random.Random(11)
    params = BRParams(horizon=6, age_s=0.5, r_max=3)
    differs_without_steps = differs_aged = 0
    for _ in range(150):
        loads, free, waiting, active = _random_round(rng)
        got = schedule_round(policy, loads, free, waiting, params=params, active=active)
        assert got == _direct(policy, loads, free, waiting, active, params), (loads, free, waiting)
        no_aging = BRParams(horizon=6, age_s=None, r_max=3)
        assert got == schedule_round(policy, loads, free, waiting, params=no_aging, active=active), (
            "a request routed in this round has no age")
        bare = [item[:2] for item in waiting]
        differs_without_steps += got != _direct(policy, loads, free, bare, active, params)
        aged_pool_params = BRParams(horizon=6, age_s=0.0, r_max=3)
        differs_aged += got != _direct(policy, loads, free, waiting, active, aged_pool_params)
    if policy != "br0":  # the cases above are sensitive to what is checked
        assert differs_without_steps > 0
    assert differs_aged > 0


def test_a_round_without_now_is_a_round_at_time_zero() -> None:
    """Aging depends on `now`; the default is 0.0 (here r0 and r1 are aged at 0, all four at 1)."""
    items = [("r0", 1455, -1.65), ("r1", 1369, -1.25), ("r2", 1254, -0.99), ("r3", 1777, -0.67)]
    params = BRParams(age_s=1.0, r_max=2, s_greedy=100)

    def run(**now: float) -> list[Any]:
        pool = Pool()
        for rid, s, t in items:
            pool.add(rid, s, t)
        return BalanceRoute("br0", params).round([1066.0, 255.0, 2247.0], [0, 0, 2], pool, **now)

    assert run() == run(now=0.0) == [("r1", 2), ("r0", 2)]
    assert run(now=1.0) == [("r1", 2), ("r2", 2)]


# -- bitset subset search at its edges ----------------------------------------------------------


def test_bitset_with_no_room_finds_nothing() -> None:
    from shadow.core.subset import bitset

    window = [Pool().add("a", 5)]
    assert bitset(window, 0, lambda d: d, 10.0) == ([], -math.inf)
    assert bitset([], 3, lambda d: d, 10.0) == ([], -math.inf)


def test_bitset_takes_the_whole_window_when_more_is_better() -> None:
    from shadow.core.subset import bitset

    pool = Pool()
    window = [pool.add(f"r{i}", s) for i, s in enumerate([3, 5, 9, 1])]
    chosen, value = bitset(window, 4, lambda d: d, math.inf)
    assert value == 18 and sorted(e.prompt_tokens for e in chosen) == [1, 3, 5, 9]


def test_bitset_keeps_the_best_sum_below_the_peak_when_the_next_sum_is_just_above() -> None:
    """Reachable sums 8 and 11 around a peak of 10.5; the steep right side makes 8 the best."""
    from shadow.core.subset import bitset

    def score(d: float) -> float:
        return -(10.5 - d) if d <= 10.5 else -10 * (d - 10.5)

    pool = Pool()
    window = [pool.add("a", 8), pool.add("b", 11)]
    chosen, value = bitset(window, 1, score, 10.5)
    assert [e.request_id for e in chosen] == ["a"] and value == -2.5


def test_fit_threshold_for_distinct_loads() -> None:
    # identical large loads leave only rounding noise in the variance: no fit
    assert fit_of([(123456.789, 1.0), (123456.789, 2.0), (123456.789, 3.0)]).result().a_s_per_token is None
    # tiny but distinct loads (variance 1.28e-12, above the 1e-12 floor) do fit
    assert fit_of([(0.0, 0.5), (1.6e-6, 1.0)]).result().a_s_per_token is not None


def test_a_fit_through_the_origin_is_physical() -> None:
    model = fit_of([(1.0, 0.5), (2.0, 1.0)]).result().model(FALLBACK)
    assert model is not FALLBACK and (model.a, model.b) == (0.5, 0.0)


# -- Stage 2 picks the worker with most free slots, then the largest margin, then the lowest index


@pytest.mark.parametrize(
    ("loads", "free", "first"),
    [([0.0, 0.0, 0.0], [1, 2, 1], 1), ([300.0, 0.0, 100.0], [1, 1, 1], 1), ([50.0, 50.0, 50.0], [1, 1, 1], 0),
     ([0.0, 50.0, 0.0], [0, 1, 1], 2)],
)
def test_stage2_worker_order(loads: list[float], free: list[int], first: int) -> None:
    waiting = [(f"r{i}", 10 + i) for i in range(6)]
    out = schedule_round("br0", loads, free, waiting, params={"s_greedy": 100})
    assert out[0][1] == first, out
    assert sorted(g for _, g in out) == sorted(g for g, c in enumerate(free) for _ in range(c))


# -- Pool.nearest against a scan ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_nearest_are_the_closest_lengths_ties_to_the_shorter(seed: int) -> None:
    rng = random.Random(seed)
    pool = Pool()
    sizes = [rng.choice([0, 1, 5, 5, 9, 20, 20, 33, 100]) for _ in range(rng.randint(1, 12))]
    entries = [pool.add(f"r{i}", s) for i, s in enumerate(sizes)]
    length = rng.choice([0, 0.5, 1, 4.5, 5, 7, 19.9, 20, 50, 200, -3])
    size = rng.randint(1, 14)
    got = pool.nearest(length, size)
    want = sorted(entries, key=lambda e: (abs(e.prompt_tokens - length), e.prompt_tokens))[:size]
    assert sorted(e.prompt_tokens for e in got) == sorted(e.prompt_tokens for e in want), (length, size)
    assert len({e.seq for e in got}) == len(got) == min(size, len(entries))
    dists = [abs(e.prompt_tokens - length) for e in got]
    assert dists == sorted(dists), "nearest first"


# -- predictors at their edges ------------------------------------------------------------------


def test_contribution_is_clipped_to_the_horizon() -> None:
    p = np.array([1.0, 1.0, 0.0, 0.5, 1.0])
    mu = np.array([0.0, 50.0, 3.0, 2.0, -1.0])
    assert contribution(p, mu, 10).tolist() == [0.0, 10.0, 10.0, 6.0, 0.0]


def test_empirical_lengths_without_data_predict_nothing_finishing() -> None:
    p, mu = EmpiricalLengths().conditional(np.array([0, 7]), 7)  # integer ages, odd horizon
    assert p.tolist() == [0.0, 0.0] and mu.tolist() == [3.5, 3.5]


def test_exactmatch_length_range_and_horizon_edge() -> None:
    pred = ExactMatchPredictor()
    pred.observe(0, "z")
    with pytest.raises(ValueError, match=r"^output length must be >= 0, got -1$"):
        pred.observe(-1, "a")
    with pytest.raises(ValueError, match=r"^output length out of range: 16777216$"):
        pred.observe(2**24, "a")
    pred.observe(2**24 - 1, "big")
    for _ in range(3):
        pred.observe(10, "a")
    # age 6, horizon 4: every "a" request ends exactly at the horizon, as survival/oracle say
    p, _ = pred.predict(np.array([6, 6, 6]), 4, keys=["a", "big", "a"])
    assert p.tolist() == [1.0, 0.0, 1.0]
    p, _ = pred.predict(np.array([6]), 3, keys=["a"])
    assert p.tolist() == [0.0]
    p, _ = pred.predict(np.array([2**24 - 2]), 1, keys=["big"])
    assert p.tolist() == [1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"a": -1.0}, r"^step model: a must be a finite number >= 0, got -1.0$"),
     ({"a": math.nan}, r"^step model: a must be a finite number >= 0, got nan$"),
     ({"b": math.inf}, r"^step model: b must be a finite number >= 0, got inf$"),
     ({"b": -0.5}, r"^step model: b must be a finite number >= 0, got -0.5$"),
     ({"a": 0.0, "b": 0.0}, r"^step model: a, b, c and p cannot all be 0 \(steps would take no time\)$"),
     ({"c": -1.0}, r"^step model: c must be a finite number >= 0, got -1.0$"),
     ({"p": math.nan}, r"^step model: p must be a finite number >= 0, got nan$")],
)
def test_step_model_refusals_name_the_problem(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepTimeModel(**kwargs)


def test_active_loads_must_match_to_a_part_per_billion_plus_a_micro_token() -> None:
    waiting = [("r", 3)]
    schedule_round("brh", [1e6, 0.0], [1, 1], waiting, active=[(0, 1e6 + 1e-4, 1.0), (1, 5e-7, 1.0)])
    with pytest.raises(ValueError, match=r"current loads must sum"):
        schedule_round("brh", [1e6, 0.0], [1, 1], waiting, active=[(0, 1e6 + 5.0, 1.0)])
    with pytest.raises(ValueError, match=r"current loads must sum"):
        schedule_round("brh", [1.0, 0.0], [1, 1], waiting, active=[(0, 1.0, 1.0), (1, 1e-5, 1.0)])


def test_a_fit_over_one_large_load_is_degenerate_despite_rounding() -> None:
    # 50 steps all at max load 3000.7: Σ(x − x̄)² rounds to ~2e-7, not 0. That is no spread of
    # loads (the threshold scales with Σx²), so there is no slope to fit.
    fit = SlidingFit()
    for i in range(50):
        fit.add(3000.7, 0.01 + (i % 3) * 1e-4)
    r = fit.result()
    assert r.a_s_per_token is None and r.quality == "poor"
    assert r.model(StepTimeModel(a=2e-6, b=0.03)) == StepTimeModel(a=2e-6, b=0.03)
