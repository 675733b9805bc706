"""BalanceRoute's policies on the step cost (`shadow.core.cost`): the definition (scores and decisions
equal the paper's on loads shifted by κ per running sequence and requests shifted by κ), the F-score
as the exact drop of the barrier idle under τ_g = a·L_g + c·n_g + b, the a = 0 limit (sequence
units: the paper's BR-0 on sequence counts, tokens breaking ties), and RouteCost itself."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core import schedule_round
from shadow.core.balanceroute import BalanceRoute
from shadow.core.bra import BalanceRouteAdaptive, BRAParams
from shadow.core.cost import SEQUENCES, TOKENS, RouteCost
from shadow.core.fscore import BR0Scorer, BRHScorer, project_loads
from shadow.core.params import BRParams
from shadow.core.pool import Pool, PoolEntry
from shadow.core.stepmodel import StepTimeModel
from shadow.core.subset import bitset, exhaustive, pairs
from tests.core.imbalance import imbalance

# -- RouteCost ---------------------------------------------------------------------------------------


def test_the_cost_of_a_step_model_is_kappa_per_sequence_in_tokens() -> None:
    assert RouteCost.of(StepTimeModel(1e-7, 0.02)) == TOKENS  # the paper's model
    assert RouteCost.of(StepTimeModel(0.0, 0.02)) == TOKENS  # a mean step: nothing to balance but tokens
    assert RouteCost.of(StepTimeModel(2e-6, 0.02, c=1e-3)) == RouteCost(1.0, 1e-3 / 2e-6)
    assert RouteCost.of(StepTimeModel(0.0, 0.02, c=1e-3)) == SEQUENCES  # a = 0: κ = ∞
    assert RouteCost.of(StepTimeModel(1e-7, 0.02, p=1e-5)) == TOKENS  # prefill: no per-step load
    m = StepTimeModel(2e-6, 0.02, c=1e-3)
    assert RouteCost.of(m).kappa_tokens == m.kappa_tokens
    assert SEQUENCES.kappa_tokens == math.inf and TOKENS.kappa_tokens == 0.0


def test_a_fleet_of_models_costs_what_they_share_or_the_kappa_of_their_mean() -> None:
    m = StepTimeModel(2e-6, 0.02, c=1e-3)
    assert RouteCost.fleet([m, m, m]) == RouteCost.of(m)
    assert RouteCost.fleet([]) == TOKENS
    mixed = [StepTimeModel(1e-6, 0.02, c=1e-3), StepTimeModel(3e-6, 0.01, c=3e-3)]
    assert RouteCost.fleet(mixed).seq == pytest.approx(4e-3 / 4e-6)
    assert RouteCost.fleet([StepTimeModel(0.0, 0.02, c=1e-3), StepTimeModel(0.0, 0.03, c=2e-3)]) == SEQUENCES
    assert RouteCost.fleet([StepTimeModel(1e-6, 0.02), StepTimeModel(0.0, 0.03)]) == TOKENS


@pytest.mark.parametrize("token,seq", [(2.0, 1.0), (0.0, 2.0), (1.0, -1.0), (1.0, math.inf), (1.0, math.nan)])
def test_route_costs_are_token_units_or_sequence_units_only(token: float, seq: float) -> None:
    with pytest.raises(ValueError, match="route cost"):
        RouteCost(token, seq)


def test_weights_loads_and_their_inverse() -> None:
    k = RouteCost(1.0, 40.0)
    assert k.weight(100) == 140.0 and k.weight(100, 3) == 220.0
    assert k.loads([100.0, 0.0], [2, 0]) == [180.0, 0.0]
    assert k.tokens_at(140.0) == 100.0 and k.tokens_at(220.0, 3) == 100.0
    assert TOKENS.weight(7) == 7 and isinstance(TOKENS.weight(7), int)  # the paper's integers stay exact
    assert SEQUENCES.weight(10_000) == 1.0 and SEQUENCES.loads([5e4, 1.0], [3, 1]) == [3.0, 1.0]
    assert SEQUENCES.tokens_at(1.0) == math.inf and SEQUENCES.tokens_at(0.5) == -math.inf
    with pytest.raises(ValueError, match="2 loads but 1"):
        k.loads([1.0, 2.0], [1])


# -- the F-score under the cost model -----------------------------------------------------------------


def _idle_units(loads: Sequence[int], seqs: Sequence[int], kappa: int) -> int:
    """Σ_g (max τ − τ_g)/a with τ_g = a·(L_g + κ·n_g) + b: the barrier idle of a step, in token units."""
    return int(imbalance([x + kappa * n for x, n in zip(loads, seqs, strict=True)]))


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    loads=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
    kappa=st.integers(0, 800),
)
def test_br0_scores_the_exact_drop_of_the_barrier_idle_under_the_cost_model(
    data: st.DataObject, loads: list[int], kappa: int
) -> None:
    # The paper's identity I_before − I_after = F_g(Δ) with τ_g = a·L_g + c·n_g + b: admitting x tokens
    # over j sequences to g lowers Σ_g (T − τ_g) by a·F_g(x + κ·j).
    seqs = data.draw(st.lists(st.integers(0, 30), min_size=len(loads), max_size=len(loads)))
    g = data.draw(st.integers(0, len(loads) - 1))
    x, j = data.draw(st.integers(0, 6000)), data.draw(st.integers(0, 4))
    cost = RouteCost.kappa(kappa)
    scorer = BR0Scorer(cost.loads(loads, seqs) if kappa else loads, cost, tokens=loads)
    after_l, after_n = list(loads), list(seqs)
    after_l[g] += x
    after_n[g] += j
    drop = _idle_units(loads, seqs, kappa) - _idle_units(after_l, after_n, kappa)
    assert scorer.score(g, cost.weight(x, j)) == drop


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    loads=st.lists(st.integers(0, 40), min_size=1, max_size=8),
)
def test_in_sequence_units_br0_scores_the_drop_of_the_idle_of_a_per_sequence_step(
    data: st.DataObject, loads: list[int]
) -> None:
    # a = 0: τ_g = c·n_g + b; the score counts sequences whatever the tokens.
    tokens = data.draw(st.lists(st.integers(0, 10**6), min_size=len(loads), max_size=len(loads)))
    g, j = data.draw(st.integers(0, len(loads) - 1)), data.draw(st.integers(0, 5))
    x = data.draw(st.integers(0, 10**5))
    scorer = BR0Scorer(SEQUENCES.loads(tokens, loads), SEQUENCES, tokens=tokens)
    after = list(loads)
    after[g] += j
    assert scorer.score(g, SEQUENCES.weight(x, j)) == imbalance(loads) - imbalance(after)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), workers=st.integers(1, 5), horizon=st.integers(0, 12), kappa=st.integers(0, 300))
def test_brh_projection_in_cost_units_is_the_paper_projection_of_shifted_requests(
    data: st.DataObject, workers: int, horizon: int, kappa: int
) -> None:
    n = data.draw(st.integers(0, 20))
    worker = np.asarray(data.draw(st.lists(st.integers(0, workers - 1), min_size=n, max_size=n)),
                        dtype=np.int64)
    load = np.asarray(data.draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n)), dtype=np.float64)
    steps = np.asarray(data.draw(st.lists(st.floats(0, 2 * horizon + 1), min_size=n, max_size=n)))
    tokens = np.bincount(worker, weights=load, minlength=workers)
    seqs = np.bincount(worker, minlength=workers)
    cost = RouteCost.kappa(kappa)
    got = project_loads(cost.loads(tokens.tolist(), seqs.tolist()), worker, load + kappa, steps, horizon)
    want = project_loads((tokens + kappa * seqs).tolist(), worker, load + kappa, steps, horizon)
    np.testing.assert_array_equal(got, want)
    # sequence units: each request weighs 1 while present, generated tokens weigh nothing
    weighed = SEQUENCES.loads(tokens.tolist(), seqs.tolist())
    seq = project_loads(weighed, worker, np.ones(n), steps, horizon, growth=0.0)
    present = np.zeros((workers, horizon + 1))  # requests present at h, counted by hand
    width = horizon + 1
    for w, c in zip(worker.tolist(), steps.tolist(), strict=True):
        last = width if c >= horizon else max(1, min(width, math.ceil(c)))
        present[w, :last] += 1
    np.testing.assert_array_equal(seq, present)


# -- decisions: the definition ----------------------------------------------------------------------


@st.composite
def fleet_states(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    """Loads, running sequences, free slots, waiting prompts (+ arrival times) and BR-H's active
    requests (their loads sum to the loads), in small ranges so that ties are common."""
    g = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(0, 6), min_size=g, max_size=g))
    worker = np.repeat(np.arange(g, dtype=np.int64), counts)
    load = np.asarray(draw(st.lists(st.integers(1, 40).map(lambda x: 25 * x), min_size=len(worker),
                                    max_size=len(worker))), dtype=np.float64)
    steps = np.asarray(draw(st.lists(st.integers(0, 24).map(float), min_size=len(worker),
                                     max_size=len(worker))))
    loads = np.bincount(worker, weights=load, minlength=g).tolist()
    free = draw(st.lists(st.integers(0, 4), min_size=g, max_size=g))
    n = draw(st.integers(0, 24))
    sizes = draw(st.lists(st.integers(0, 40).map(lambda x: 25 * x), min_size=n, max_size=n))
    arrived = np.cumsum(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))).tolist()
    return loads, counts, free, sizes, arrived, (worker, load, steps)


def _pool(sizes: Sequence[int], arrived: Sequence[float], shift: int = 0) -> Pool:
    pool = Pool()
    for i, (s, t) in enumerate(zip(sizes, arrived, strict=True)):
        pool.add(f"q{i}", s + shift, t, horizon_steps=float(i % 7))
    return pool


PARAMS = [
    BRParams(r_max=4, age_s=1.0, horizon=12),
    BRParams(r_max=8, exhaustive_max=3, s_greedy=0, horizon=6),
    BRParams(r_max=6, s_greedy=100, horizon=0, beta=9.0),
]


@settings(max_examples=300, deadline=None)
@given(state=fleet_states(), kappa=st.integers(0, 600), which=st.integers(0, len(PARAMS) - 1),
       variant=st.sampled_from(["br0", "brh"]))
def test_br0_and_brh_decide_on_the_cost_as_the_paper_on_loads_shifted_by_kappa(  # type: ignore[no-untyped-def]
    state, kappa: int, which: int, variant: str
) -> None:
    loads, counts, free, sizes, arrived, (worker, load, steps) = state
    params, now = PARAMS[which], float(arrived[-1]) if arrived else 0.0
    active = (worker, load, steps) if variant == "brh" else None
    shifted = (worker, load + kappa, steps) if variant == "brh" else None
    got = BalanceRoute(variant, params).round(  # type: ignore[arg-type]
        loads, free, _pool(sizes, arrived), now, active, cost=RouteCost.kappa(kappa), seqs=counts
    )
    want = BalanceRoute(variant, params).round(  # type: ignore[arg-type]
        [x + kappa * n for x, n in zip(loads, counts, strict=True)], free, _pool(sizes, arrived, kappa), now,
        shifted,
    )
    assert got == want


@settings(max_examples=300, deadline=None)
@given(state=fleet_states(), kappa=st.integers(0, 600), which=st.integers(0, len(PARAMS) - 1),
       pick=st.booleans(), scale=st.booleans(), brh=st.booleans())
def test_bra_decides_on_the_cost_as_on_prompt_loads_shifted_by_kappa(  # type: ignore[no-untyped-def]
    state, kappa: int, which: int, pick: bool, scale: bool, brh: bool
) -> None:
    loads, counts, free, sizes, arrived, (worker, load, steps) = state
    params, now = PARAMS[which], float(arrived[-1]) if arrived else 0.0
    prompts = [0.6 * x for x in loads]  # a prompt basis apart from the KV loads
    bra = BRAParams(score_pick=pick, hold=pick, scale_window=scale, basis="prompt")
    active = (worker, load, steps) if brh else None
    shifted = (worker, load + kappa, steps) if brh else None
    shift = [x + kappa * n for x, n in zip(loads, counts, strict=True)]
    got = BalanceRouteAdaptive(params, bra).round(
        loads, free, _pool(sizes, arrived), now, active, prompts, cost=RouteCost.kappa(kappa), seqs=counts
    )
    want = BalanceRouteAdaptive(params, bra).round(
        shift, free, _pool(sizes, arrived, kappa), now, shifted,
        [p + kappa * n for p, n in zip(prompts, counts, strict=True)],
    )
    assert got == want


#: A subset search's case: window sizes, cap, a peak to search around, the envelope's load, G, the cost.
SEARCHES = st.tuples(
    st.lists(st.integers(0, 300), max_size=16),
    st.integers(0, 6),
    st.one_of(st.floats(-50, 1200, allow_nan=False), st.just(math.inf), st.integers(0, 1200).map(float)),
    st.integers(0, 1200),
    st.integers(1, 16),
    st.one_of(st.integers(0, 200).map(RouteCost.kappa), st.just(SEQUENCES)),
)


@settings(max_examples=300, deadline=None)
@given(case=SEARCHES)
def test_subset_searches_agree_under_a_cost(case: tuple[list[int], int, float, int, int, RouteCost]) -> None:
    """bitset is exact in value under any cost (against enumeration); pairs returns exactly bitset's."""
    sizes, cap, peak, top, g, cost = case
    window = [PoolEntry(f"e{i}", s, i) for i, s in enumerate(sizes)]
    scorer = BR0Scorer([0.0, float(top)] + [float(top)] * (g - 1), cost)

    def score(w: float) -> float:
        return scorer.score(0, w)

    true_set, true_f = bitset(window, cap, score, scorer.peak(0), cost)  # at the score's own peak
    if len(window) <= 12:
        _, e_f = exhaustive(window, cap, score, cost)
        assert true_f == e_f or (math.isinf(true_f) and math.isinf(e_f))
    weight = cost.weight(sum(e.prompt_tokens for e in true_set), len(true_set))
    assert true_f == -math.inf or score(weight) == true_f
    b_set, b_f = bitset(window, cap, score, peak, cost)  # any peak: pairs must still return the same
    if cap <= 2:
        p_set, p_f = pairs(window, cap, score, peak, cost)
        assert [e.request_id for e in p_set] == [e.request_id for e in b_set]
        assert p_f == b_f or (math.isinf(p_f) and math.isinf(b_f))


# -- the a = 0 limit: sequence units ---------------------------------------------------------------


def _sequence_outcome(
    counts: list[int], free: list[int], decisions: Sequence[tuple[object, int]]
) -> list[tuple[int, int]]:
    """Per worker (free slots, running sequences) after `decisions`, sorted: the state at the
    sequence level, whichever of tied workers took a request."""
    f, n = list(free), list(counts)
    for _, g in decisions:
        f[g] -= 1
        n[g] += 1
    return sorted(zip(f, n, strict=True))


@settings(max_examples=300, deadline=None)
@given(state=fleet_states(), which=st.integers(0, len(PARAMS) - 1))
def test_in_sequence_units_br0_is_the_paper_br0_on_sequence_counts(state, which: int) -> None:  # type: ignore[no-untyped-def]
    # KV tokens cost nothing: BR-0 balances running sequences — at the sequence level its round is
    # the paper's BR-0 over loads n_g and requests of size 1, whatever the tokens (which only decide
    # between workers and requests that tie).
    loads, counts, free, sizes, arrived, _ = state
    params, now = PARAMS[which], float(arrived[-1]) if arrived else 0.0
    got = BalanceRoute("br0", params).round(
        loads, free, _pool(sizes, arrived), now, cost=SEQUENCES, seqs=counts
    )
    unit = _pool([1] * len(sizes), arrived)
    want = BalanceRoute("br0", params).round([float(n) for n in counts], free, unit, now)
    assert _sequence_outcome(counts, free, got) == _sequence_outcome(counts, free, want)


def test_in_sequence_units_fewer_tokens_break_a_tie_between_workers() -> None:
    # Two workers with 3 sequences each and equal free slots: the one holding fewer KV tokens takes
    # the request (the paper's rule on counts alone would give it to the lower index).
    out = schedule_round("br0", [9000.0, 300.0], [2, 2], [("x", 50)], cost=SEQUENCES, running=[3, 3])
    assert out == [("x", 1)]
    out = schedule_round("br0", [300.0, 9000.0], [2, 2], [("x", 50)], cost=SEQUENCES, running=[3, 3])
    assert out == [("x", 0)]
    # the sequences decide before the tokens: 2 sequences beat 3 whatever they hold
    out = schedule_round("br0", [9000.0, 300.0], [3, 2], [("x", 50)], cost=SEQUENCES, running=[2, 3])
    assert out == [("x", 0)]


def test_a_request_fitting_a_sequence_margin_is_the_longest_else_the_shortest() -> None:
    pool = Pool()
    for rid, s in (("short", 10), ("long", 9000), ("mid", 400)):
        pool.add(rid, s)
    fits = BR0Scorer([2.0, 0.0], SEQUENCES, tokens=[50.0, 0.0])  # worker 1: two sequences of room
    assert pool.best_single(lambda d: fits.score(1, d), fits.peak(1), SEQUENCES).request_id == "long"  # type: ignore[union-attr]
    assert pool.best_single(lambda d: fits.score(0, d), fits.peak(0), SEQUENCES).request_id == "short"  # type: ignore[union-attr]


def test_without_running_sequences_a_per_sequence_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="running sequences"):
        schedule_round("br0", [10.0, 20.0], [1, 1], [("x", 5)], cost=RouteCost(1.0, 5.0))
    with pytest.raises(ValueError, match="running must be one integer"):
        schedule_round("br0", [10.0, 20.0], [1, 1], [("x", 5)], cost=RouteCost(1.0, 5.0), running=[1])
    with pytest.raises(ValueError, match="running sequences"):
        BalanceRouteAdaptive().round([1.0], [1], _pool([3], [0.0]), cost=SEQUENCES)
    # counted from BR-H's active requests when they are given
    act = [(0, 10.0, 3.0), (1, 10.0, 3.0), (1, 10.0, 3.0)]
    assert schedule_round("brh", [10.0, 20.0], [1, 1], [("x", 5)], cost=SEQUENCES, active=act) == [("x", 0)]


# -- bytes that do not track the cost ---------------------------------------------------------------


def _step_time(model: StepTimeModel, loads: Sequence[float], seqs: Sequence[int]) -> float:
    return max(model.worker_time(x, n) for x, n in zip(loads, seqs, strict=True))


@pytest.mark.parametrize("model", [StepTimeModel(1e-7, 0.02, c=1.1e-3), StepTimeModel(0.0, 0.02, c=1.1e-3)])
def test_where_bytes_do_not_track_the_cost_cost_aware_br0_steps_shorter(model: StepTimeModel) -> None:
    """Policy level (the lane engine does not price c·n yet): worker 0 runs 12 short requests, worker 1
    two long ones of the same KV tokens; short requests arrive one per round, each worker with the
    same free slots (a saturated fleet freeing slots alike). JSQ-bytes (least outstanding prompt
    tokens) and the paper's BR-0 see balanced bytes and alternate; BR-0 on the cost sends them to
    the worker with fewer sequences, and the barrier step under the cost model is shorter."""
    cost = RouteCost.of(model)
    loads = {"cost": [2400.0, 2400.0], "paper": [2400.0, 2400.0], "bytes": [2400.0, 2400.0]}
    seqs = {k: [12, 2] for k in loads}
    placed: dict[str, list[int]] = {k: [] for k in loads}
    for r in range(8):
        rid, s = f"r{r}", 180
        for name in loads:
            L, n = loads[name], seqs[name]
            if name == "bytes":  # JSQ-bytes on outstanding prompt tokens (= loads here: no output yet)
                g = min(range(2), key=lambda w: (L[w], w))
            else:
                kw = {"cost": cost, "running": n} if name == "cost" else {}
                ((_, g),) = schedule_round("br0", L, [2, 2], [(rid, s)], **kw)  # type: ignore[arg-type]
            L[g] += s
            n[g] += 1
            placed[name].append(g)
    assert placed["bytes"] == placed["paper"] == [0, 1] * 4  # bytes balanced
    assert placed["cost"] == [1] * 8  # into the worker with fewer sequences
    t = {k: _step_time(model, loads[k], seqs[k]) for k in loads}
    assert t["cost"] < t["bytes"] and t["cost"] < t["paper"]


def test_at_kappa_zero_every_pool_policy_takes_the_paper_path() -> None:
    """c = 0 is the paper's cost: a round given it is the round given nothing (the same objects)."""
    rng = np.random.default_rng(5)
    loads = rng.integers(0, 40_000, size=8).astype(float).tolist()
    free = rng.integers(0, 3, size=8).tolist()
    waiting = [(f"w{i}", int(s)) for i, s in enumerate(rng.integers(16, 9000, size=40))]
    act = [(g, loads[g], 30.0) for g in range(8)]
    for policy in ("br0", "brh", "bra"):
        base = schedule_round(policy, loads, free, waiting, active=act)
        assert schedule_round(policy, loads, free, waiting, active=act,
                              cost=RouteCost.of(StepTimeModel(3e-7, 0.01)), running=[5] * 8) == base
    assert BRHScorer(np.zeros((2, 1)), BRParams(horizon=0)).cost.paper
