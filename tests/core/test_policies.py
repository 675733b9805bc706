"""The policy registry: one meaning per name, each factory fed only its own parameters, the tables
the CLI and the metrics use derived from it, and the old active spelling `jsq` (it ran JSQ-bytes)
refused with an error naming `jsq-bytes` — `jsq` is JSQ-count everywhere."""

from __future__ import annotations

from dataclasses import fields

import pytest

from shadow.core.baselines import JoinShortestQueue, JoinShortestQueueBytes, RoundRobin
from shadow.core.bra import BRAParams
from shadow.core.params import BRParams
from shadow.core.policies import (
    ACTIVE,
    POLICIES,
    REGISTRY,
    ROUTE_LABELS,
    AdaptiveParams,
    BalanceRouteParams,
    BaselineParams,
    ForcedParams,
    RouterOptions,
    active_policy,
    lookup,
    make_router,
    names,
    policy,
)
from shadow.core.routers import BindingRouter, PoolRouter
from shadow.core.snapshot import STAY_BASIS, FleetSnapshot
from shadow.core.stay import StayBasis
from shadow.engine.config import LaneSpec


def test_every_policy_has_one_kind_and_the_derived_tables_follow_the_registry() -> None:
    assert list(REGISTRY) == [*POLICIES, "forced"]
    assert names("baseline") == ("rr", "random", "p2c", "jsq", "jsq-bytes", "least-tokens")
    assert names("pool") == ("br0", "brh", "bra") and names("forced") == ("forced",)
    assert set(ACTIVE) == {"br0", "brh", "jsq-bytes", "rr"} and (*ACTIVE, "router") == ROUTE_LABELS
    for p in REGISTRY.values():
        assert p.binds_at_arrival == (p.kind != "pool")
        assert not p.predicted or p.kind == "pool"


def test_a_factory_gets_only_its_own_parameters() -> None:
    options = RouterOptions(
        br=BRParams(r_max=3), bra=BRAParams(hold=False), predictor=None, seed=4, only_free=True,
        assignments={"a": 0}, workers=2,
    )
    taken = {name: REGISTRY[name].select(options) for name in ("jsq", "br0", "bra", "forced")}
    assert taken["jsq"] == BaselineParams(seed=4, only_free=True)
    assert taken["br0"] == BalanceRouteParams(br=BRParams(r_max=3))
    assert taken["bra"] == AdaptiveParams(br=BRParams(r_max=3), bra=BRAParams(hold=False))
    assert taken["forced"] == ForcedParams({"a": 0}, 2)
    for params in taken.values():  # nothing beyond the policy's own fields is carried
        assert {f.name for f in fields(params)} < {f.name for f in fields(RouterOptions)}
    # a factory called with its own dataclass builds the router without any caller's options
    brh = REGISTRY["brh"].factory(BalanceRouteParams(BRParams(horizon=7), "exactmatch"))
    assert isinstance(brh, PoolRouter) and brh.br.params.horizon == 7
    assert brh.predictor is not None and brh.predictor.name == "exactmatch"


def test_one_meaning_per_name_jsq_is_count_and_jsq_bytes_is_bytes_everywhere() -> None:
    jsq, jsqb = make_router("jsq"), make_router("jsq-bytes")
    assert isinstance(jsq, BindingRouter) and isinstance(jsq.baseline, JoinShortestQueue)
    assert isinstance(jsqb, BindingRouter) and isinstance(jsqb.baseline, JoinShortestQueueBytes)
    assert LaneSpec.parse("jsq").policy == "jsq" and LaneSpec.parse("jsq-bytes").policy == "jsq-bytes"
    # the rules differ on the same fleet: 2 requests vs 1 outstanding, 10 vs 900 tokens
    fleet = FleetSnapshot([0.0, 0.0], [4, 4], outstanding=[2, 1], outstanding_tokens=[10.0, 900.0])
    for router, worker in ((jsq, 1), (jsqb, 0)):
        router.on_arrive("x", 5, 0.0)
        assert router.decide(fleet, 0.0) == [("x", worker)]
    assert "jsq" not in ACTIVE  # active mode does not run JSQ-count


def test_the_retired_active_spelling_is_refused_naming_what_it_meant() -> None:
    assert active_policy("jsq-bytes") == "jsq-bytes" and active_policy("br0") == "br0"
    assert active_policy("round-robin") == "rr"  # an alias still names its policy
    with pytest.raises(ValueError, match=r"^active policy 'jsq' is retired: .*say 'jsq-bytes'") as err:
        active_policy("jsq")
    assert "JSQ-count" in str(err.value)  # what `jsq` is
    for bad in ("jsq-count", "bra", "random", "forced", "nope"):
        with pytest.raises(ValueError, match=r"^policy must be one of br0, brh, rr, jsq-bytes, got "):
            active_policy(bad)


def test_aliases_name_their_policy_and_unknown_names_fail_with_the_known_ones() -> None:
    assert lookup("round-robin") is policy("rr") and lookup("nope") is None
    rr = make_router("round-robin")
    assert isinstance(rr, BindingRouter) and isinstance(rr.baseline, RoundRobin) and rr.name == "rr"
    assert LaneSpec("round-robin").policy == "rr" and LaneSpec("round-robin").label == "rr"
    with pytest.raises(ValueError, match=r"^unknown policy 'nope'; known: \['rr', .*'forced'\]$"):
        policy("nope")


def test_a_snapshot_extra_reaches_bras_thin_round() -> None:
    # the thin round's "stay" basis comes from the snapshot's extras map, not from the caller's type
    router = make_router("bra", RouterOptions(bra=BRAParams(basis="stay", hold=False), predictor="survival"))
    asked: list[str] = []

    def basis(kind: str) -> StayBasis | None:
        asked.append(kind)
        return StayBasis([0.0, 5_000.0], 1.0)  # worker 1 holds far more over the stay

    router.on_arrive("x", 100, 0.0)
    fleet = FleetSnapshot([9_000.0, 1_000.0], [1, 1], prompt_loads=[9_000.0, 1_000.0],
                          extras={STAY_BASIS.name: basis})
    assert router.decide(fleet, 0.0) == [("x", 0)] and asked == ["stay"]
    router.on_arrive("y", 100, 0.0)  # without the extra: the prompt basis, the other worker
    assert router.decide(FleetSnapshot([9_000.0, 1_000.0], [1, 1], prompt_loads=[9_000.0, 1_000.0]), 0.0) == [
        ("y", 1)
    ]
