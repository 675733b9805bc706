"""The incumbents' rules (shadow.core.incumbents) pinned by hand-worked examples taken from their
sources' logic — scores, ties, caps, optimistic increments — and their stale views
(shadow.core.routers.StaleView / StaleLoads): a view refreshed at every decision (Δ = 0, or Δ below
every gap between decisions) is exactly the fresh one; inside one refresh period a burst is
placed on the old view plus the rule's own increments."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.baselines import Baseline, BindState
from shadow.core.incumbents import smg_estimate
from shadow.core.params import BRParams
from shadow.core.policies import (
    REGISTRY,
    SGLANG_VIEW_S,
    SMG_VIEW_S,
    VLLM_DP_VIEW_S,
    RouterOptions,
    format_age,
    make_baseline,
    make_router,
    names,
    parse_age,
)
from shadow.core.routers import BindingRouter, PoolRouter, StaleLoads, StaleView
from shadow.core.snapshot import KV_CAPACITY, FleetSnapshot
from shadow.engine.config import LaneSpec

INCUMBENTS = names("incumbent")


def state(**published: list[float] | list[int]) -> BindState:
    """A three-worker view: the ledger as given or empty, the engines' stats as given."""
    g = 3
    s = BindState(
        kv_tokens=list(published.pop("kv_tokens", [0.0] * g)),  # type: ignore[arg-type]
        outstanding=list(published.pop("outstanding", [0] * g)),  # type: ignore[arg-type]
        outstanding_tokens=list(published.pop("outstanding_tokens", [0.0] * g)),  # type: ignore[arg-type]
        free_slots=[4] * g,
    )
    s.kv_used = list(published.pop("kv_used", [0.0] * g))  # type: ignore[arg-type]
    s.running = list(published.pop("running", [0] * g))  # type: ignore[arg-type]
    s.waiting = list(published.pop("waiting", [0] * g))  # type: ignore[arg-type]
    s.kv_usage = list(published.pop("kv_usage", [0.0] * g))  # type: ignore[arg-type]
    assert not published
    return s


def rule(name: str) -> Baseline:
    return make_baseline(name, random.Random(0))


def test_the_registry_names_each_incumbent_with_its_source_and_default_view_age() -> None:
    assert INCUMBENTS == ("vllm-dp", "vllm-dp-legacy", "sglang-tokens", "sglang-requests", "smg-min-tokens",
                          "trtllm-adp")
    ages = {n: REGISTRY[n].view_age_s for n in INCUMBENTS}
    assert ages == {"vllm-dp": VLLM_DP_VIEW_S, "vllm-dp-legacy": VLLM_DP_VIEW_S,
                    "sglang-tokens": SGLANG_VIEW_S, "sglang-requests": SGLANG_VIEW_S,
                    "smg-min-tokens": SMG_VIEW_S, "trtllm-adp": 0.0}
    assert (VLLM_DP_VIEW_S, SGLANG_VIEW_S, SMG_VIEW_S) == (0.1, 0.02, 10.0)
    for n in INCUMBENTS:  # each summary names the file its rule was read in
        assert ".py" in REGISTRY[n].summary or ".rs" in REGISTRY[n].summary
        assert "PR #" in REGISTRY[n].summary or n in ("vllm-dp-legacy", "sglang-requests")


def test_vllm_dp_score_is_max_of_inflight_and_counts_plus_the_kv_penalty() -> None:
    # e0: max(3, 0+3) = 3; e1: max(3, 2+1) = 3, + 2·6·(0.75−0.5) = 3 → 6; e2: max(2, 0+2) = 2
    s = state(outstanding=[3, 3, 2], waiting=[0, 2, 0], running=[3, 1, 2], kv_usage=[0.9, 0.75, 0.2])
    r = rule("vllm-dp")
    assert [r.score(s, g) for g in range(3)] == [3.0, 6.0, 2.0]  # type: ignore[attr-defined]
    assert r.pick(s, 10) == 2
    # the client's own inflight count bounds a stale view from below: e0 looks empty but holds 5
    s = state(outstanding=[5, 1, 1], running=[0, 1, 1])
    assert rule("vllm-dp").pick(s, 10) == 1
    # no penalty at <= 50% usage or without waiting requests; 3× waiting at 100%
    s = state(outstanding=[2, 7, 9], waiting=[2, 0, 0], running=[0, 7, 9], kv_usage=[1.0, 1.0, 1.0])
    assert rule("vllm-dp").score(s, 0) == 2 + 2 * 6 * 0.5  # type: ignore[attr-defined]
    assert rule("vllm-dp").pick(s, 10) == 1
    s.kv_usage = [0.5, 0.5, 0.5]
    assert rule("vllm-dp").pick(s, 10) == 0


def test_vllm_dp_rotates_its_scan_start_so_ties_spread() -> None:
    r, s = rule("vllm-dp"), state()
    assert [r.pick(s, 1) for _ in range(4)] == [0, 1, 2, 0]  # all tied: the scan start moves on
    r, s = rule("vllm-dp-legacy"), state()
    assert [r.pick(s, 1) for _ in range(3)] == [0, 0, 0]  # before PR #47420: the first engine


def test_vllm_dp_charges_one_waiting_request_to_the_chosen_engine() -> None:
    r, s = rule("vllm-dp"), state()
    r.charge(s, 1, 100)
    assert s.waiting == [0, 1, 0] and s.outstanding == [0, 1, 0] and s.running == [0, 0, 0]


def test_vllm_dp_legacy_weighs_waiting_four_times() -> None:
    # e0: 4·1 + 0 = 4; e1: 4·0 + 3 = 3; e2: 4·1 + 1 = 5
    s = state(waiting=[1, 0, 1], running=[0, 3, 1])
    assert rule("vllm-dp-legacy").pick(s, 10) == 1
    s = state(waiting=[0, 0, 1], running=[2, 2, 0])  # 2, 2, 4: tie to the first
    assert rule("vllm-dp-legacy").pick(s, 10) == 0


def test_sglang_total_tokens_breaks_ties_on_requests_and_charges_the_input_length() -> None:
    s = state(kv_tokens=[300.0, 200.0, 200.0], running=[1, 3, 1], waiting=[0, 0, 1])
    r = rule("sglang-tokens")
    assert r.pick(s, 50) == 2  # 200 = 200: fewer requests (2 < 3)
    r.charge(s, 2, 50)
    assert s.kv_tokens == [300.0, 200.0, 250.0] and s.waiting == [0, 0, 2]
    assert r.pick(s, 50) == 1
    s = state(running=[2, 1, 1], waiting=[0, 1, 0])
    assert rule("sglang-requests").pick(s, 9) == 2  # 2, 2, 1
    s = state(running=[1, 1, 1])
    assert rule("sglang-requests").pick(s, 9) == 0  # ties: the lowest rank


def test_smg_takes_the_fewest_used_tokens_and_adds_its_word_estimate() -> None:
    assert smg_estimate(100) == 98  # 75 words × 1.3 = 97.5 → 98
    assert smg_estimate(0) == 0 and smg_estimate(1) == 2  # round(0.75) = 1 word → ceil(1.3)
    s = state(kv_used=[300.0, 200.0, 200.0], kv_tokens=[300.0, 900.0, 900.0])
    r = rule("smg-min-tokens")
    assert r.pick(s, 100) == 1  # 200 = 200: the lowest rank; queued prompts are not used tokens
    r.charge(s, 1, 100)
    assert s.kv_used == [300.0, 298.0, 200.0]
    assert r.pick(s, 100) == 2


def test_trtllm_caps_each_rank_at_the_fair_share_then_takes_the_fewest_prompt_tokens() -> None:
    # expected = max(ceil((2+0+1 + 1)/3), 2) = 2: rank 0 (2 active) is out although it holds least
    s = state(outstanding=[2, 0, 1], outstanding_tokens=[10.0, 500.0, 400.0])
    assert rule("trtllm-adp").pick(s, 7) == 2
    # all under the cap: fewest prompt tokens, ties on fewer requests, then the lowest rank
    s = state(outstanding=[1, 1, 0], outstanding_tokens=[40.0, 40.0, 40.0])
    assert rule("trtllm-adp").pick(s, 7) == 2
    s = state(outstanding=[1, 1, 1], outstanding_tokens=[40.0, 40.0, 90.0])
    assert rule("trtllm-adp").pick(s, 7) == 0


def test_view_ages_parse_in_one_place_and_name_their_lanes() -> None:
    assert [parse_age(t) for t in ("100ms", "10s", "250us", "0", "0.5")] == [0.1, 10.0, 250e-6, 0.0, 0.5]
    assert [format_age(x) for x in (0.1, 10.0, 0.0, 0.02, 250e-6)] == ["100ms", "10s", "0", "20ms", "250us"]
    for bad in ("-1ms", "soon", "inf"):
        try:
            parse_age(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    spec = LaneSpec.parse("vllm-dp@10ms")
    assert (spec.policy, spec.view_age_s, spec.label) == ("vllm-dp", 0.01, "vllm-dp@10ms")
    assert LaneSpec.parse("vllm-dp").view_age_s is None and LaneSpec.parse("vllm-dp").label == "vllm-dp"
    spec = LaneSpec.parse("brh:oracle@100ms")
    assert (spec.predictor, spec.view_age_s, spec.label) == ("oracle", 0.1, "brh-oracle@100ms")


def _fleet(loads: list[float], queued: list[float], running: list[int], waiting: list[int]) -> FleetSnapshot:
    return FleetSnapshot(
        loads=loads, free_slots=[8 - r for r in running],
        outstanding=[r + w for r, w in zip(running, waiting, strict=True)],
        outstanding_tokens=[x + q for x, q in zip(loads, queued, strict=True)],
        queued_tokens=queued, running=running, extras={KV_CAPACITY.name: [4000.0] * len(loads)},
    )


def test_a_burst_inside_one_refresh_period_is_placed_on_the_old_view_plus_increments() -> None:
    # Two idle workers; four requests reach the router at once, before any engine steps. The fleet
    # as it is never shows queued prompts as used tokens: SMG reading it fresh puts all four on
    # rank 0; on its 10 s poll it spreads them with its own estimates.
    idle = _fleet([0.0, 0.0], [0.0, 0.0], [0, 0], [0, 0])
    fresh, stale = make_router("smg-min-tokens", RouterOptions(view_age_s=0.0)), make_router("smg-min-tokens")
    picks: dict[str, list[int]] = {"fresh": [], "stale": []}
    for i in range(4):
        queued = [100.0 * picks["fresh"].count(g) for g in (0, 1)]
        waiting = [picks["fresh"].count(g) for g in (0, 1)]
        fresh.on_arrive(i, 100, 0.001 * i)
        ((_, g),) = fresh.decide(_fleet([0.0, 0.0], queued, [0, 0], waiting), 0.001 * i)
        picks["fresh"].append(g)
        stale.on_arrive(i, 100, 0.001 * i)
        ((_, g),) = stale.decide(idle, 0.001 * i)
        picks["stale"].append(g)
    assert picks == {"fresh": [0, 0, 0, 0], "stale": [0, 1, 0, 1]}
    # vLLM: the engines' counts move from waiting to running between publications; inside one
    # period the client does not see it and keeps its own +1 per request.
    r = make_router("vllm-dp-legacy")
    assert isinstance(r, BindingRouter) and r.view is not None and r.view.age_s == VLLM_DP_VIEW_S
    r.on_arrive("a", 10, 0.0)
    assert r.decide(_fleet([0.0, 0.0], [0.0, 0.0], [3, 0], [0, 2]), 0.0) == [("a", 0)]  # 3 vs 8
    # engine 1 admitted its two queued requests ("a" waits at 0): fresh, 4·1+3 = 7 vs 2 → 1; the
    # view published at 0 plus the client's own +1: 4·1+3 = 7 vs 8 → 0
    r.on_arrive("b", 10, 0.05)
    assert r.decide(_fleet([0.0, 0.0], [10.0, 0.0], [3, 2], [1, 0]), 0.05) == [("b", 0)]
    r.on_arrive("c", 10, 0.10)  # the period is over: refreshed, 4·2+3 = 11 vs 2
    assert r.decide(_fleet([0.0, 0.0], [20.0, 0.0], [3, 2], [2, 0]), 0.10) == [("c", 1)]
    assert r.view.refreshes == 2


decisions = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=3, max_size=3),  # running
        st.lists(st.integers(0, 3), min_size=3, max_size=3),  # waiting
        st.lists(st.integers(0, 2000), min_size=3, max_size=3),  # loads
        st.integers(1, 4000),  # prompt tokens
        st.floats(0.001, 1.0),  # time since the previous decision
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(decisions, st.sampled_from((*INCUMBENTS, "jsq-bytes", "least-tokens", "jsq")))
def test_a_view_refreshed_at_every_decision_is_the_fresh_view(seq, name) -> None:  # type: ignore[no-untyped-def]
    """Δ = 0, or a Δ below every gap between decisions: the same picks as the fresh rule."""
    shortest = min(gap for *_, gap in seq)
    routers = [make_router(name, RouterOptions(view_age_s=0.0))]
    for age in (0.0, shortest / 2):  # (half: the float sum of the gaps may fall a hair short)
        r = make_router(name, RouterOptions(view_age_s=0.0))
        assert isinstance(r, BindingRouter)
        r.view = StaleView(age)  # the stale machinery itself, at an age that refreshes every time
        routers.append(r)
    now = 0.0
    for i, (running, waiting, loads, prompt, gap) in enumerate(seq):
        now += gap
        fleet = _fleet([float(x) for x in loads], [50.0 * w for w in waiting], running, waiting)
        picks = set()
        for r in routers:
            r.on_arrive(i, prompt, now)
            picks.add(tuple(r.decide(fleet, now)))
        assert len(picks) == 1


@settings(max_examples=30, deadline=None)
@given(decisions)
def test_balance_route_on_a_view_refreshed_every_round_is_br0(seq) -> None:  # type: ignore[no-untyped-def]
    fresh = make_router("br0", RouterOptions(br=BRParams()))
    stale = make_router("br0", RouterOptions(br=BRParams()))
    assert isinstance(stale, PoolRouter)
    stale.view = StaleLoads(0.0)
    now = 0.0
    for i, (running, waiting, loads, prompt, gap) in enumerate(seq):
        now += gap
        fleet = _fleet([float(x) for x in loads], [50.0 * w for w in waiting], running, waiting)
        for r in (fresh, stale):
            r.on_arrive(f"r{i}", prompt, now)
        assert fresh.decide(fleet, now) == stale.decide(fleet, now)


def test_balance_route_on_a_stale_view_adds_what_it_placed() -> None:
    r = make_router("br0", RouterOptions(view_age_s=1.0))
    assert isinstance(r, PoolRouter) and r.view is not None
    fleet = FleetSnapshot([0.0, 0.0], [1, 1])
    r.on_arrive("a", 500, 0.0)
    assert r.decide(fleet, 0.0) == [("a", 0)]
    # the fleet has not moved (no step yet); the view adds its placement: the next goes to 1
    r.on_arrive("b", 400, 0.5)
    assert r.decide(FleetSnapshot([0.0, 0.0], [1, 1]), 0.5) == [("b", 1)]
