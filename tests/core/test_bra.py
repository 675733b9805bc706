"""BRA (this project's BalanceRoute-adaptive): round invariants under hypothesis, reduction to BR-H
with every idea off, bounded hold-back, and no knowledge of output lengths in the engine."""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.balanceroute import BalanceRoute
from shadow.core.bra import BASES, BalanceRouteAdaptive, BRAParams
from shadow.core.params import BRParams
from shadow.core.pool import Pool
from shadow.core.stay import StayBasis
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from tests.engine.helpers import ready_times, run_lane

Active = tuple[np.ndarray, np.ndarray, np.ndarray]


@st.composite
def states(draw: st.DrawFn) -> tuple[list[float], list[int], list[int], list[float], Active | None]:
    g = draw(st.integers(1, 10))
    loads = draw(st.lists(st.integers(0, 300_000), min_size=g, max_size=g))
    free = draw(st.lists(st.integers(0, 5), min_size=g, max_size=g))
    sizes = draw(st.lists(st.integers(1, 30_000), max_size=40))
    ages = draw(st.lists(st.floats(0, 5), min_size=len(sizes), max_size=len(sizes)))
    active: Active | None = None
    if draw(st.booleans()):
        # one active request per worker carrying its whole load, with a predicted stay
        steps = draw(st.lists(st.floats(0, 100), min_size=g, max_size=g))
        active = (np.arange(g, dtype=np.int64), np.asarray(loads, dtype=np.float64), np.asarray(steps))
    return [float(x) for x in loads], free, sizes, ages, active


params_st = st.builds(
    BRAParams,
    score_pick=st.booleans(),
    thin_ratio=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    hold=st.booleans(),
    hold_s=st.sampled_from([0.0, 0.5, 10.0]),
    hold_life=st.sampled_from([None, 0.0, 0.125, 1.0]),
    hold_pool=st.sampled_from([None, 0.5, 1.0, 100.0]),
    scale_window=st.booleans(),
    basis=st.sampled_from(BASES),
)


def _pool(sizes: list[int], ages: list[float], now: float) -> Pool:
    pool = Pool()
    order = sorted(range(len(sizes)), key=lambda i: -ages[i])  # oldest first = arrival order
    for i in order:
        pool.add(f"q{i}", sizes[i], now - ages[i])
    return pool


@settings(max_examples=300, deadline=None)
@given(
    state=states(),
    adaptive=params_st,
    r_max=st.integers(1, 8),
    s_greedy=st.integers(0, 20),
    stay_span=st.sampled_from([None, 1.0, 30.0]),
)
def test_round_never_exceeds_slots_and_admits_each_request_at_most_once(
    state: tuple[list[float], list[int], list[int], list[float], Active | None],
    adaptive: BRAParams,
    r_max: int,
    s_greedy: int,
    stay_span: float | None,
) -> None:
    loads, free, sizes, ages, active = state
    now = 10.0
    pool = _pool(sizes, ages, now)
    router = BalanceRouteAdaptive(BRParams(r_max=r_max, s_greedy=s_greedy, horizon=20), adaptive)
    prompt_loads = [x / 2 for x in loads]
    stay = None if stay_span is None else (lambda kind: StayBasis([x / 3 for x in loads], stay_span))
    out = router.round(
        loads, free, pool, now, active, prompt_loads=prompt_loads, stay=stay
    )
    ids = [rid for rid, _ in out]
    assert len(ids) == len(set(ids)), "a request was admitted twice"
    assert set(ids) <= {f"q{i}" for i in range(len(sizes))}
    assert {e.request_id for e in pool}.isdisjoint(ids), "an admitted request is still in the pool"
    assert len(pool) + len(ids) == len(sizes), "a request was lost"
    for g, n in Counter(g for _, g in out).items():
        assert 0 <= g < len(loads) and n <= free[g], f"worker {g}: {n} admissions for {free[g]} free slots"
    guard = adaptive.hold_pool is not None and len(sizes) > adaptive.hold_pool * len(loads)
    held = adaptive.hold and adaptive.score_pick and not guard
    if not held:
        assert len(out) == min(len(sizes), sum(free)), "without hold-back BRA is work-conserving"
    else:
        # What it holds back is only ever young: every request older than hold_s fits if slots allow.
        old = [f"q{i}" for i, a in enumerate(ages) if a >= adaptive.hold_s]
        if len(sizes) <= sum(free):
            assert set(old) <= set(ids)


@settings(max_examples=200, deadline=None)
@given(state=states(), r_max=st.integers(1, 8), s_greedy=st.integers(0, 20))
def test_every_idea_off_makes_balanceroute_decisions(
    state: tuple[list[float], list[int], list[int], list[float], Active | None], r_max: int, s_greedy: int
) -> None:
    loads, free, sizes, ages, active = state
    br = BRParams(r_max=r_max, s_greedy=s_greedy, horizon=20)
    off = BRAParams(score_pick=False, hold=False, scale_window=False)
    a = BalanceRouteAdaptive(br, off).round(loads, free, _pool(sizes, ages, 10.0), 10.0, active)
    variant = "br0" if active is None else "brh"
    b = BalanceRoute(variant, br).round(loads, free, _pool(sizes, ages, 10.0), 10.0, active)
    assert a == b


def test_thin_pool_goes_to_the_worker_it_fits_not_the_one_with_most_free_slots() -> None:
    # Worker 0 has the most free slots but is the heaviest; BR would put the request there.
    loads, free = [100_000.0, 60_000.0, 90_000.0], [5, 1, 1]
    pool = Pool()
    pool.add("x", 30_000, 0.0)
    br = BalanceRoute("br0").round(loads, free, pool, 0.0)
    assert br == [("x", 0)]
    pool.add("x", 30_000, 0.0)
    bra = BalanceRouteAdaptive().round(loads, free, pool, 0.0, prompt_loads=loads)
    assert bra == [("x", 1)]


def test_hold_back_only_while_young_and_something_runs() -> None:
    loads, free = [50_000.0, 50_000.0], [1, 1]  # equal loads: every placement raises the max
    router = BalanceRouteAdaptive(adaptive=BRAParams(hold_s=0.5))
    pool = Pool()
    pool.add("x", 10_000, 0.0)
    assert router.round(loads, free, pool, 0.1, prompt_loads=loads) == []  # held
    assert len(pool) == 1
    assert router.round(loads, free, pool, 0.6, prompt_loads=loads) == [("x", 0)]  # too old to hold
    pool.add("y", 10_000, 0.0)
    assert router.round([0.0, 0.0], free, pool, 0.0, prompt_loads=[0.0, 0.0]) == [("y", 0)]  # idle fleet


def test_window_grows_with_g() -> None:
    a = BRAParams()
    assert [a.window(g, 4) for g in (4, 8, 16, 32, 64)] == [4, 4, 8, 16, 16]
    assert BRAParams(scale_window=False).window(64, 4) == 4
    with pytest.raises(ValueError, match="hold_s"):
        BRAParams(hold_s=-1)


class RecordingLane(Lane):
    """Records every admission as (request id, worker, step)."""

    admissions: list[tuple[object, int, int]]

    def _start(self, g: int, job: Job, ready_s: float) -> None:
        self.admissions.append((job.request_id, g, self.k))
        super()._start(g, job, ready_s)


def _lane(jobs: list[Job], predictor: str, adaptive: BRAParams) -> RecordingLane:
    config = EngineConfig(
        workers=3,
        slots=8,
        step=StepTimeModel(a=1e-6, b=0.01),
        br=BRParams(horizon=60, beta=4.0, age_s=0.05),
        bra=adaptive,
    )
    lane = RecordingLane(LaneSpec("bra", predictor), config, time.perf_counter)
    lane.admissions = []
    run_lane(lane, jobs, ready_times(jobs, None), max_steps=100_000)
    return lane


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 60),
    seed=st.integers(0, 10_000),
    predictor=st.sampled_from(["survival", "exactmatch"]),
    adaptive=params_st,
)
def test_no_future_knowledge_output_lengths_change_nothing_before_the_first_finish(
    n: int, seed: int, predictor: str, adaptive: BRAParams
) -> None:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.002, n))  # bursts: the pool is sometimes longer than the free slots
    prompts = rng.integers(0, 5000, n)
    out_a = rng.integers(25, 100, n)
    out_b = out_a + rng.integers(0, 30, n)  # same requests, other (longer or equal) true lengths
    jobs_a = [Job(i, float(t[i]), int(prompts[i]), int(out_a[i]), f"k{i % 3}") for i in range(n)]
    jobs_b = [Job(i, float(t[i]), int(prompts[i]), int(out_b[i]), f"k{i % 3}") for i in range(n)]
    a, b = _lane(jobs_a, predictor, adaptive), _lane(jobs_b, predictor, adaptive)
    first_finish = int(out_a.min())  # no request of either run ends before step min(o) - 1
    before_a = [x for x in a.admissions if x[2] < first_finish - 1]
    before_b = [x for x in b.admissions if x[2] < first_finish - 1]
    assert before_a == before_b
    # and the lane served everything, slots respected throughout (hold-back is bounded)
    assert a.totals.finished == n and b.totals.finished == n
    assert a.totals.tokens == int(out_a.sum())


def test_the_no_future_check_has_power_an_oracle_fails_it() -> None:
    # The same comparison with the oracle predictor (it reads true remaining lengths) must differ.
    differs = False
    for seed in range(30):
        rng = np.random.default_rng(seed)
        n = 60
        t = np.cumsum(rng.exponential(0.002, n))
        prompts = rng.integers(0, 5000, n)
        out_a = rng.integers(25, 100, n)
        out_b = out_a + rng.integers(0, 30, n)
        jobs_a = [Job(i, float(t[i]), int(prompts[i]), int(out_a[i])) for i in range(n)]
        jobs_b = [Job(i, float(t[i]), int(prompts[i]), int(out_b[i])) for i in range(n)]
        off = BRAParams(score_pick=False, hold=False)  # its Stage 1/2 use BR-H projections
        a, b = _lane(jobs_a, "oracle", off), _lane(jobs_b, "oracle", off)
        cut = int(out_a.min()) - 1
        if [x for x in a.admissions if x[2] < cut] != [x for x in b.admissions if x[2] < cut]:
            differs = True
            break
    assert differs


# -- the thin-pool placement and the centred Stage 2, against their documented rules -----------------


@settings(max_examples=200, deadline=None)
@given(
    g=st.integers(1, 6),
    data=st.data(),
    hold=st.booleans(),
    hold_s=st.sampled_from([0.0, 0.3, 10.0]),
    hold_pool=st.sampled_from([None, 0.5, 1.0, 3.0]),
    life=st.sampled_from([None, 0.0, 7.0, 8.0, 79.0, 80.0]),
    kind=st.sampled_from(["prompt", "kv", "life"]),
)
def test_thin_pool_placement_follows_the_documented_rule_step_by_step(
    g: int,
    data: st.DataObject,
    hold: bool,
    hold_s: float,
    hold_pool: float | None,
    life: float | None,
    kind: str,
) -> None:
    """Largest first (pool order), each to the free worker with the best BR-0 F-score over the
    basis *including this round's earlier placements* (ties: lower basis, then lower index); with
    hold, a young request (age < hold_s) whose best score is <= 0 stays in the pool and the requests
    behind it are still placed — provided the pool held at most hold_pool × G requests and the
    request's predicted stay allows a round (⌊hold_life · ĉ⌋ >= 1, or ĉ unknown or >= H). The basis
    is the prompt loads ("prompt"), today's KV ("kv") or a predicted basis ("life": what the
    callback returns; a request then weighs its prompt plus the basis's newcomer growth)."""
    # Small integer ranges make score ties, exact zeros and exact ages common.
    drawn = data.draw(st.lists(st.integers(0, 60).map(lambda x: 50.0 * x), min_size=g, max_size=g))
    loads = [b + 1.0 for b in drawn]  # something runs on every worker: hold-back may apply
    growth = data.draw(st.sampled_from([0.0, 25.0, 100.0])) if kind == "life" else 0.0
    basis0 = loads if kind == "kv" else drawn
    stay = StayBasis(list(drawn), 1.0, growth)
    free = data.draw(st.lists(st.integers(0, 3), min_size=g, max_size=g))
    n = data.draw(st.integers(0, sum(free)))  # thin: everything waiting fits this round
    sizes = data.draw(st.lists(st.integers(1, 40).map(lambda x: 50 * x), min_size=n, max_size=n))
    ages = data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=n, max_size=n))
    now = 5.0
    pool = Pool()
    for i in sorted(range(n), key=lambda i: -ages[i]):
        pool.add(f"q{i}", sizes[i], now - ages[i], life)
    entries = list(pool)  # pool order: largest first, ties older first
    knobs = BRAParams(hold=hold, hold_s=hold_s, hold_pool=hold_pool, scale_window=False, basis=kind)
    router = BalanceRouteAdaptive(adaptive=knobs)
    prompt = [x + 7.0 for x in drawn] if kind != "prompt" else list(drawn)  # must not be read
    out = router.round(
        loads, free, pool, now, prompt_loads=prompt, stay=lambda k: stay if k == kind else None
    )
    may_hold = hold and (hold_pool is None or n <= hold_pool * g)
    rounds_allowed = life is None or life >= 80 or int(0.125 * life) >= 1
    placed = dict(out)
    assert len(placed) == len(out)
    assert [rid for rid, _ in out] == [e.request_id for e in entries if e.request_id in placed], (
        "not placed largest first")
    basis, slots = list(basis0), list(free)
    for e in entries:
        top = max(max(basis), 0.0)

        def score(w: int, s: float = e.prompt_tokens + growth, top: float = top) -> float:
            over = s - (top - basis[w])  # BR-0: fill up to the barrier, G× penalty above it
            return s - g * over if over > 0 else s

        cands = [w for w in range(g) if slots[w] > 0]
        assert cands, "a thin pool always fits"
        best = max(cands, key=lambda w: (score(w), -basis[w], -w))
        young = now - e.arrived_at < hold_s
        if e.request_id not in placed:
            assert may_hold and young and rounds_allowed, f"{e.request_id} held outside the bounds"
            assert score(best) <= 0, f"{e.request_id} held although worker {best} scores {score(best)} > 0"
            continue
        if may_hold and young and rounds_allowed:
            assert score(best) > 0, f"{e.request_id} placed although every placement scores <= 0"
        w = placed[e.request_id]
        assert w == best, (
            f"{e.request_id} ({e.prompt_tokens} tokens) went to worker {w} (score {score(w)}, basis "
            f"{basis[w]}); the rule picks {best} (score {score(best)}, basis {basis[best]})")
        basis[w] += e.prompt_tokens + growth
        slots[w] -= 1
    assert {e.request_id for e in pool} == {e.request_id for e in entries} - set(placed)


def test_hold_back_edges_score_zero_holds_and_age_is_measured_from_arrival() -> None:
    # G = 2, basis [100, 50]: a request of 100 on worker 1 overflows by 50 → 100 − 2·50 = 0 (held);
    # one of 99 overflows by 49 → 99 − 98 = 1 > 0 (placed).
    loads, prompt = [1.0, 1.0], [100.0, 50.0]
    router = BalanceRouteAdaptive(adaptive=BRAParams(hold_s=0.5))
    pool = Pool()
    pool.add("zero", 100, 10.0)
    assert router.round(loads, [1, 1], pool, 10.1, prompt_loads=prompt) == [], "score 0 must be held"
    pool = Pool()
    pool.add("one", 99, 10.0)
    assert router.round(loads, [1, 1], pool, 10.1, prompt_loads=prompt) == [("one", 1)]
    # young = now − arrival < hold_s, with a non-zero arrival time; exactly hold_s old is not young
    pool = Pool()
    pool.add("young", 100, 9.75)
    assert router.round(loads, [1, 1], pool, 10.0, prompt_loads=prompt) == []
    pool = Pool()
    pool.add("old", 100, 9.5)
    assert router.round(loads, [1, 1], pool, 10.0, prompt_loads=prompt) == [("old", 1)]


def test_a_held_request_does_not_block_smaller_ones_behind_it() -> None:
    # basis [500, 400]: 300 tokens overflow everywhere (held while young); 50 fits under the barrier.
    router = BalanceRouteAdaptive(adaptive=BRAParams(hold_s=1.0))
    pool = Pool()
    pool.add("big", 300, 0.0)
    pool.add("small", 50, 0.0)
    out = router.round([1.0, 1.0], [2, 2], pool, 0.1, prompt_loads=[500.0, 400.0])
    assert out == [("small", 1)] and [e.request_id for e in pool] == ["big"]


@settings(max_examples=150, deadline=None)
@given(
    g=st.integers(1, 12),
    data=st.data(),
    r_max=st.integers(1, 6),
    s_greedy=st.integers(0, 12),
)
def test_centred_stage2_equals_balanceroute_when_the_window_holds_the_whole_pool(
    g: int, data: st.DataObject, r_max: int, s_greedy: int
) -> None:
    """With no aged entries and a window as large as the pool, centring the window changes
    nothing but the window's order: BRA (scale_window only) must make BR-0's decisions with the
    scaled R_max — the same Stage 1 greedy, the same Stage 2 pops, subsets and starvation guard —
    up to *which* of several equally long prompts it takes (the centred window lists equal
    lengths above the peak newest first, BR's window oldest first; found by hypothesis on sizes
    [100, 100, 100, 700, 700] with a 600-token peak, and present since the first BRA)."""
    knobs = BRAParams(score_pick=False, hold=False, scale_window=True)
    window = knobs.window(g, r_max)
    loads = data.draw(st.lists(st.integers(0, 200).map(lambda x: 100.0 * x), min_size=g, max_size=g))
    free = data.draw(st.lists(st.integers(0, 4), min_size=g, max_size=g))
    sizes = data.draw(st.lists(st.integers(1, 200).map(lambda x: 100 * x), max_size=window))
    params = BRParams(r_max=r_max, s_greedy=s_greedy, age_s=None)
    ages = [0.0] * len(sizes)
    bra = BalanceRouteAdaptive(params, knobs).round(loads, free, _pool(sizes, ages, 0.0), 0.0)
    scaled = BRParams(r_max=window, s_greedy=s_greedy, age_s=None)
    br = BalanceRoute("br0", scaled).round(loads, free, _pool(sizes, ages, 0.0), 0.0)
    size = {f"q{i}": s for i, s in enumerate(sizes)}
    assert [(size[r], g) for r, g in bra] == [(size[r], g) for r, g in br]


def test_stage2_takes_the_best_subset_not_the_best_single_for_both_br_and_bra() -> None:
    # One worker with 2 free slots and 100 tokens below the barrier; S_greedy 10 skips Stage 1.
    # {b, c} = 50 + 50 fills the gap exactly (F = 100); the best single (a, 70) then b would overflow.
    def pool() -> Pool:
        p = Pool()
        for rid, size in (("a", 70), ("b", 50), ("c", 50)):
            p.add(rid, size, 0.0)
        return p

    prm = BRParams(s_greedy=10, age_s=None)
    assert BalanceRoute("br0", prm).round([0.0, 100.0], [2, 0], pool(), 0.0) == [("b", 0), ("c", 0)]
    off = BRAParams(score_pick=False, hold=False)
    assert BalanceRouteAdaptive(prm, off).round([0.0, 100.0], [2, 0], pool(), 0.0) == [("b", 0), ("c", 0)]
    # Stage 1 runs only while total free slots *exceed* S_greedy: 2 free, S_greedy 2 → no greedy pick.
    prm2 = BRParams(s_greedy=2, age_s=None)
    assert BalanceRouteAdaptive(prm2, off).round([0.0, 100.0], [2, 0], pool(), 0.0) == [("b", 0), ("c", 0)]
    # ... and with S_greedy 1 the first pick is greedy (a), the second the best fill of what is left.
    prm1 = BRParams(s_greedy=1, age_s=None)
    assert BalanceRouteAdaptive(prm1, off).round([0.0, 100.0], [2, 0], pool(), 0.0) == [("a", 0), ("b", 0)]


def test_stage2_pop_ties_go_to_the_lower_index() -> None:
    # Equal loads, equal free slots, equal margins: BR's pop order falls back to the lower index.
    off = BRAParams(score_pick=False, hold=False)
    pool = Pool()
    pool.add("a", 50, 0.0)
    assert BalanceRouteAdaptive(BRParams(s_greedy=5), off).round([0.0, 0.0], [1, 1], pool, 0.0) == [("a", 0)]


def test_centred_window_aged_first_then_nearest_the_peak() -> None:
    from shadow.core.bra import _centred_window

    def ids(window: list) -> list[str]:  # type: ignore[type-arg]
        return [e.request_id for e in window]

    def pool(aged: int) -> Pool:
        p = Pool()
        for i, size in enumerate((10, 20, 30)[:aged]):  # arrived long ago, in this order
            p.add(f"e{i + 1}", size, 0.1 * i)
        for i, size in enumerate((100, 200, 300)):
            p.add(f"y{i + 1}", size, 4.9 + 0.01 * i)
        return p

    now, age = 5.0, 1.0
    # Aged entries in arrival order, at most half the window; then nearest the peak (190: 200, 100, 300).
    assert ids(_centred_window(pool(3), 4, 190.0, now, age)) == ["e1", "e2", "y2", "y1"]
    # Peak among the aged: the nearest list skips the aged ones already taken and still fills the window.
    assert ids(_centred_window(pool(3), 4, 15.0, now, age)) == ["e1", "e2", "e3", "y1"]
    # One aged entry only; young entries are never counted as aged.
    assert ids(_centred_window(pool(1), 4, 190.0, now, age)) == ["e1", "y2", "y1", "y3"]
    # A window of 2 or 3 holds at most one aged entry (half, at least one).
    assert ids(_centred_window(pool(3), 2, 190.0, now, age)) == ["e1", "y2"]
    assert ids(_centred_window(pool(3), 3, 190.0, now, age)) == ["e1", "y2", "y1"]
    # No aging: nearest the peak only.
    assert ids(_centred_window(pool(3), 3, 190.0, now, None)) == ["y2", "y1", "y3"]


def test_bra_scores_with_its_own_params_and_the_given_projection() -> None:
    """On states where BR-H's decisions depend on the horizon or on the active requests, BRA with
    every idea off follows BR-H with *its* parameters (not the defaults) and *its* projection."""
    rng = np.random.default_rng(3)
    off = BRAParams(score_pick=False, hold=False, scale_window=False)
    mine, other = BRParams(horizon=20, r_max=3, s_greedy=2), BRParams(horizon=80, r_max=3, s_greedy=2)
    checked = 0
    for _ in range(300):
        g = int(rng.integers(2, 6))
        loads = [float(x) for x in rng.integers(0, 30_000, g)]
        free = [int(x) for x in rng.integers(0, 4, g)]
        sizes = [int(x) for x in rng.integers(1, 20_000, int(rng.integers(1, 10)))]
        act = (np.arange(g, dtype=np.int64), np.asarray(loads), rng.uniform(0, 100, g))

        def fresh(sizes: list[int] = sizes) -> Pool:
            return _pool(sizes, [0.0] * len(sizes), 0.0)

        want = BalanceRoute("brh", mine).round(loads, free, fresh(), 0.0, act)
        if (want == BalanceRoute("brh", other).round(loads, free, fresh(), 0.0, act)
                and want == BalanceRoute("br0", mine).round(loads, free, fresh(), 0.0)):
            continue  # this state cannot tell the horizon or the projection apart
        assert BalanceRouteAdaptive(mine, off).round(loads, free, fresh(), 0.0, act) == want
        checked += 1
    assert checked >= 20, f"only {checked} states told the horizon or projection apart"


def test_thin_placement_ties_use_the_basis_including_this_rounds_placements() -> None:
    # basis [150, 200] under a barrier of 1200: both requests fit everywhere (equal scores),
    # so ties go to the lower basis: a (100) → worker 0 (150 < 200), basis [250, 200];
    # b (50) → worker 1 (200 < 250). Forgetting a's tokens in the basis would send b to worker 0.
    pool = Pool()
    pool.add("a", 100, 0.0)
    pool.add("b", 50, 0.0)
    basis = [150.0, 200.0, 1200.0]  # worker 2 (full) sets the barrier
    out = BalanceRouteAdaptive().round([1.0, 1.0, 1.0], [2, 2, 0], pool, 0.0, prompt_loads=basis)
    assert out == [("a", 0), ("b", 1)]


# -- hold-back bounded by the request's predicted stay and by the pool --------------------------------


def _overflowing(router: BalanceRouteAdaptive, life: float | None, rounds: int) -> list[int]:
    """Rounds (1-based) in which a request that overflows every worker was placed; it is young
    throughout (hold_s is large), so only the stay bound can release it."""
    pool = Pool()
    pool.add("x", 10_000, 0.0, life)
    placed = []
    for r in range(1, rounds + 1):
        if router.round([50_000.0, 50_000.0], [1, 1], pool, 0.001 * r, prompt_loads=[5e4, 5e4]):
            placed.append(r)
            pool.add("x", 10_000, 0.001 * r, life)
    return placed


def test_hold_back_lasts_at_most_hold_life_of_the_predicted_stay_in_rounds() -> None:
    knobs = BRAParams(hold_s=1e9, hold_life=0.125)
    # ĉ = 24 steps → held ⌊3⌋ rounds, placed in the 4th; the next copy is held 3 more.
    assert _overflowing(BalanceRouteAdaptive(adaptive=knobs), 24.0, 9) == [4, 8]
    # ĉ = 7 steps → ⌊0.875⌋ = 0 rounds: a short request is never held.
    assert _overflowing(BalanceRouteAdaptive(adaptive=knobs), 7.0, 3) == [1, 2, 3]
    # ĉ = 79.9 (just inside H = 80) → 9 rounds.
    assert _overflowing(BalanceRouteAdaptive(adaptive=knobs), 79.9, 11) == [10]
    # Predicted to outlive the horizon (ĉ = H) or no prediction: only hold_s limits it.
    assert _overflowing(BalanceRouteAdaptive(adaptive=knobs), 80.0, 50) == []
    assert _overflowing(BalanceRouteAdaptive(adaptive=knobs), None, 50) == []
    timed = BalanceRouteAdaptive(adaptive=BRAParams(hold_s=0.0105))  # rounds are 1 ms apart
    assert _overflowing(timed, None, 12) == [11]
    # Without the stay bound only hold_s limits it (the first BRA's hold).
    unbounded = BRAParams(hold_s=1e9, hold_life=None)
    assert _overflowing(BalanceRouteAdaptive(adaptive=unbounded), 2.0, 50) == []
    assert knobs.hold_rounds(24.0, 80) == 3 and knobs.hold_rounds(80.0, 80) == math.inf
    assert unbounded.hold_rounds(1.0, 80) == math.inf


def test_hold_back_stops_when_the_pool_exceeds_hold_pool_per_worker() -> None:
    def run(n: int, hold_pool: float | None) -> int:
        pool = Pool()
        for i in range(n):
            pool.add(f"x{i}", 10_000, 0.0)
        router = BalanceRouteAdaptive(adaptive=BRAParams(hold_s=1e9, hold_pool=hold_pool))
        return len(router.round([5e4, 5e4], [4, 4], pool, 0.01, prompt_loads=[5e4, 5e4]))

    assert run(2, 1.0) == 0  # 2 waiting <= 1 × G: every one held
    assert run(3, 1.0) == 3  # 3 > 1 × G: nothing held, all placed
    assert run(3, 1.5) == 0 and run(4, 1.5) == 4
    assert run(8, None) == 0  # no guard


def test_hold_state_only_tracks_requests_held_now() -> None:
    # Requests come and go (placed, shed by a timeout): the round counter never outgrows the pool.
    router = BalanceRouteAdaptive(adaptive=BRAParams(hold_s=1e9, hold_pool=None))
    pool = Pool()
    rng = np.random.default_rng(0)
    for r in range(300):
        for _ in range(int(rng.integers(0, 3))):
            pool.add(f"r{r}-{rng.integers(1 << 30)}", int(rng.integers(1, 20_000)), 0.01 * r)
        pool.pop_arrived_before(0.01 * r - 0.05)
        router.round([5e4, 4e4], [3, 3], pool, 0.01 * r, prompt_loads=[5e4, 4e4])
        assert len(router._held) <= len(pool)
        assert set(router._held) <= {e.seq for e in pool}


def test_bra_params_reject_bad_hold_bounds_and_bases() -> None:
    for bad in ({"hold_life": -0.1}, {"hold_pool": math.inf}, {"hold_life": True}, {"basis": "mean"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BRAParams(**bad)  # type: ignore[arg-type]
    assert BRAParams(hold_life=None, hold_pool=None).hold_rounds(5.0, 80) == math.inf


# -- the "stay" basis ---------------------------------------------------------------------------------


def test_stay_basis_weighs_each_request_by_its_expected_share_of_a_newcomers_stay() -> None:
    from shadow.core.predictors import SurvivalPredictor
    from shadow.core.stay import stay_basis

    # Outputs are 10 or 30 tokens, equally often: a newcomer stays E[min(O, cap)] = 20 steps.
    pred = SurvivalPredictor([10, 30] * 50)
    worker = np.asarray([0, 0, 1], dtype=np.int64)
    age = np.asarray([0, 25, 5], dtype=np.int64)
    load = np.asarray([1000.0, 1025.0, 2005.0])
    sb = stay_basis(pred, 3, worker, load, age)
    assert sb.span == 20.0
    # age 0: remaining 10 or 30 → m = min(R, 20) = 10 or 20, E[m] = 15 → 15/20·(1000 + 7) = 755.25
    # age 25: only the 30s remain, R = 5 → E[m] = 5 → 5/20·(1025 + 2) = 256.75
    # age 5: R = 5 or 25 → m = 5 or 20 → E[m] = 12.5 → 12.5/20·(2005 + 5.75) = 1256.71875
    assert sb.loads == pytest.approx([755.25 + 256.75, 1256.71875, 0.0])
    assert sb.newcomer(100) == 100 + 9.5
    empty = stay_basis(pred, 2, np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64))
    assert empty.loads == [0.0, 0.0] and empty.span == 20.0


def test_stay_basis_places_where_prompt_tokens_would_not() -> None:
    # Worker 0 runs requests about to end (little KV left over a newcomer's stay), worker 1 fresh
    # ones: by prompt tokens worker 1 is lighter, by expected stay load worker 0 is.
    stay = StayBasis([1_000.0, 8_000.0], 40.0)
    for basis, want in (("prompt", 1), ("stay", 0)):
        pool = Pool()
        pool.add("x", 3_000, 0.0)
        router = BalanceRouteAdaptive(adaptive=BRAParams(hold=False, basis=basis))
        out = router.round(
            [9e3, 9e3], [2, 2], pool, 0.0, prompt_loads=[9_000.0, 6_000.0], stay=lambda kind: stay
        )
        assert out == [("x", want)]
    # No stay basis available (no predictor): falls back to prompt tokens.
    pool = Pool()
    pool.add("x", 3_000, 0.0)
    router = BalanceRouteAdaptive(adaptive=BRAParams(hold=False, basis="stay"))
    out = router.round([9e3, 9e3], [2, 2], pool, 0.0, prompt_loads=[9e3, 6e3], stay=lambda kind: None)
    assert out == [("x", 1)]


def test_the_lane_offers_a_stay_basis_only_with_a_predictor() -> None:
    jobs = [Job(i, 0.001 * i, 100 + i, 20) for i in range(12)]
    config = EngineConfig(workers=2, slots=8, bra=BRAParams(basis="stay"))
    cases = (
        (LaneSpec("bra", "survival"), True), (LaneSpec("bra", "oracle"), False), (LaneSpec("br0"), False)
    )
    for spec, has in cases:
        lane = Lane(spec, config, time.perf_counter)
        for job in jobs:
            lane.offer(job, job.arrival_s)
        lane.step()
        sb = lane.stay_basis()
        assert (sb is not None) == has
        if sb is not None:  # no finished request yet: the whole cap, every running request counted
            assert sb.span == 4096 and sum(sb.loads) > sum(lane.loads)


# -- the "life" basis (the default) and the other measured bases -------------------------------------


def test_life_final_and_near_bases_match_a_hand_computation() -> None:
    from shadow.core.predictors import SurvivalPredictor
    from shadow.core.stay import predicted_basis

    # Outputs are 10 or 30 tokens, equally often: a newcomer's E[O] = 20.
    pred = SurvivalPredictor([10, 30] * 50)
    worker = np.asarray([0, 0, 1], dtype=np.int64)
    age = np.asarray([0, 25, 5], dtype=np.int64)
    load = np.asarray([1000.0, 1025.0, 2005.0])
    # remaining R: age 0 → 10 or 30 (E 20); age 25 → 5; age 5 → 5 or 25 (E 15)
    life = predicted_basis("life", pred, 3, worker, load, age, 20)
    assert life.loads == pytest.approx([1000 + 10 + 1025 + 2.5, 2005 + 7.5, 0.0])
    assert life.newcomer(100) == 110.0  # prompt + E[O]/2
    final = predicted_basis("final", pred, 3, worker, load, age, 20)
    assert final.loads == pytest.approx([1000 + 20 + 1025 + 5, 2005 + 15, 0.0])
    assert final.newcomer(100) == 120.0
    # near, H = 20: m = E[min(R, 20)] = 15, 5, 12.5; each weighs m/H · (w + (m − 1)/2); a
    # newcomer stays min(H, E[min(O, H)] = 15) steps and adds its prompt + 7.
    near = predicted_basis("near", pred, 3, worker, load, age, 20)
    assert near.loads == pytest.approx([15 / 20 * 1007 + 5 / 20 * 1027, 12.5 / 20 * (2005 + 5.75), 0.0])
    assert near.newcomer(100) == 107.0
    none = np.zeros(0, dtype=np.int64)
    empty = predicted_basis("life", pred, 2, none, np.zeros(0), none, 20)
    assert empty.loads == [0.0, 0.0] and empty.newcomer(0) == 10.0
    with pytest.raises(ValueError, match="basis"):
        predicted_basis("mean", pred, 3, worker, load, age, 20)


def test_life_basis_weighs_a_long_running_request_by_what_it_will_still_hold() -> None:
    # Heavy tail: most outputs are 100 tokens, a few 10,000. A request 500 tokens into its output
    # is one of the long ones: it will hold its KV for ~9,500 more steps. Worker 0 runs it, worker 1
    # runs two fresh requests with more prompt tokens. Prompt tokens send a newcomer to worker 0,
    # the life basis to worker 1.
    from shadow.core.predictors import SurvivalPredictor
    from shadow.core.stay import predicted_basis

    pred = SurvivalPredictor([100] * 95 + [10_000] * 5)
    worker = np.asarray([0, 1, 1], dtype=np.int64)
    age = np.asarray([500, 0, 0], dtype=np.int64)
    prompt = np.asarray([1_000.0, 1_500.0, 1_500.0])
    sb = predicted_basis("life", pred, 2, worker, prompt + age, age, 80)
    assert sb.loads[0] > sb.loads[1]  # 1,500 + 4,750 against 2 × (1,500 + ~297)
    for basis, want in (("prompt", 0), ("life", 1)):
        pool = Pool()
        pool.add("x", 2_000, 0.0)
        router = BalanceRouteAdaptive(adaptive=BRAParams(hold=False, basis=basis))
        out = router.round(
            [1_500.0, 3_000.0], [4, 4], pool, 0.0, prompt_loads=[1_000.0, 3_000.0], stay=lambda kind: sb
        )
        assert out == [("x", want)]


def test_kv_basis_places_by_todays_kv() -> None:
    # Today's KV says worker 1 is lighter; prompt tokens say worker 0.
    for basis, want in (("prompt", 0), ("kv", 1)):
        pool = Pool()
        pool.add("x", 2_000, 0.0)
        router = BalanceRouteAdaptive(adaptive=BRAParams(hold=False, basis=basis))
        out = router.round([9_000.0, 5_000.0], [2, 2], pool, 0.0, prompt_loads=[1_000.0, 4_000.0])
        assert out == [("x", want)]


def test_the_default_basis_is_life_and_falls_back_to_prompt_tokens_without_a_predictor() -> None:
    assert BRAParams().basis == "life"
    pool = Pool()
    pool.add("x", 2_000, 0.0)
    router = BalanceRouteAdaptive(adaptive=BRAParams(hold=False))
    # no callback (a snapshot without it: the active proxy) or a callback without a basis: prompt tokens
    assert router.round([9e3, 5e3], [2, 2], pool, 0.0, prompt_loads=[1e3, 4e3]) == [("x", 0)]
    pool.add("x", 2_000, 0.0)
    out = router.round([9e3, 5e3], [2, 2], pool, 0.0, prompt_loads=[1e3, 4e3], stay=lambda k: None)
    assert out == [("x", 0)]


def test_the_lane_computes_the_life_basis_over_its_running_requests() -> None:
    from shadow.core.predictors import SurvivalPredictor
    from shadow.core.stay import FINAL_CAP, predicted_basis

    jobs = [Job(i, 0.001 * i, 100 + i, 20) for i in range(12)]
    config = EngineConfig(workers=2, slots=8)
    lane = Lane(LaneSpec("bra", "survival"), config, time.perf_counter)
    for job in jobs:
        lane.offer(job, job.arrival_s)
    for _ in range(3):
        lane.step()
    sb = lane.stay_basis("life")
    assert sb is not None
    idx = np.flatnonzero(lane.slot_active)
    age = lane.k - lane.slot_start[idx]
    want = predicted_basis(
        "life", SurvivalPredictor(), 2, lane.slots.worker[idx], lane.slot_prompt[idx] + age, age, 80
    )
    assert sb.loads == pytest.approx(want.loads)
    # nothing finished yet: with no lengths known a request is assumed to stay for the cap, so each
    # counts its KV plus half the cap
    running = np.bincount(lane.slots.worker[idx], minlength=2)
    want_loads = [kv + n * FINAL_CAP / 2 for kv, n in zip(lane.loads, running, strict=True)]
    assert sb.loads == pytest.approx(want_loads)
