"""The policy registry and the stateful routers (shadow.core.policies, shadow.core.routers), at the
core level: every name builds its own router with the options it was given (seed, only_free,
params, predictor, BRA knobs), bad combinations fail with a message, binding routers respect free
slots and arrival order, the forced router replays, pool routers teach their predictor."""

from __future__ import annotations

import numpy as np
import pytest

from shadow.core.baselines import BindState
from shadow.core.bra import BRAParams
from shadow.core.params import BRParams
from shadow.core.policies import REGISTRY, RouterOptions, make_router, names
from shadow.core.snapshot import FleetSnapshot

BASELINES = (*names("baseline"), *names("incumbent"))  # every rule that binds at arrival
POOL_ROUTERS = names("pool")
ROUTERS = REGISTRY


def _arrive(router, n: int, size: int = 100) -> list[str]:  # type: ignore[no-untyped-def]
    ids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        router.on_arrive(rid, size + i, float(i))
    return ids


def test_every_name_builds_a_fresh_router_of_that_name() -> None:
    assert set(ROUTERS) == {*BASELINES, *POOL_ROUTERS, "forced"}
    for name in ROUTERS:
        extra = {"assignments": {}, "workers": 1} if name == "forced" else {}
        a, b = make_router(name, RouterOptions(**extra)), make_router(name, RouterOptions(**extra))  # type: ignore[arg-type]
        assert a is not b and a.name == name
        assert a.binds_at_arrival == (name not in POOL_ROUTERS)
        assert a.waiting() == 0
    # fresh state: a second rr router starts from worker 0 again
    view = FleetSnapshot([0.0] * 3, [4] * 3)
    first = make_router("rr")
    _arrive(first, 2)
    assert [g for _, g in first.decide(view, 0.0)] == [0, 1]
    second = make_router("rr")
    _arrive(second, 1)
    assert [g for _, g in second.decide(view, 0.0)] == [0]


def test_unknown_names_and_misplaced_options_fail_with_a_message() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; known: \[.*'br0'"):
        make_router("nope")
    for name in ("jsq", "rr", "br0"):
        with pytest.raises(ValueError, match=f"policy '{name}' takes no predictor"):
            make_router(name, RouterOptions(predictor="survival"))
    for name in ("brh", "bra"):
        with pytest.raises(ValueError, match=f"{name} predictor must be one of .*'survival'.*got 'bogus'"):
            make_router(name, RouterOptions(predictor="bogus"))
    with pytest.raises(ValueError, match="a forced lane needs its assignments"):
        make_router("forced")


def test_options_reach_the_router_they_were_given_to() -> None:
    params = BRParams(r_max=3, s_greedy=1)
    knobs = BRAParams(hold=False, thin_ratio=2.0)
    br0 = make_router("br0", RouterOptions(br=params))
    assert br0.br.params == params and br0.br.variant == "br0" and br0.predictor is None  # type: ignore[attr-defined]
    assert make_router("br0").br.params == BRParams()  # type: ignore[attr-defined]
    brh = make_router("brh", RouterOptions(br=params, predictor="exactmatch"))
    assert brh.br.variant == "brh" and brh.br.params == params  # type: ignore[attr-defined]
    assert brh.predictor is not None and brh.predictor.name == "exactmatch"  # type: ignore[attr-defined]
    assert make_router("brh").predictor is None  # steps come from the caller (schedule_round)
    bra = make_router("bra", RouterOptions(br=params, bra=knobs, predictor="survival"))
    assert bra.br.adaptive == knobs and bra.br.params == params  # type: ignore[attr-defined]
    assert bra.predictor is not None and bra.predictor.name == "survival"  # type: ignore[attr-defined]
    assert make_router("bra").br.adaptive == BRAParams()  # type: ignore[attr-defined]
    assert make_router("jsq", RouterOptions(only_free=True)).only_free  # type: ignore[attr-defined]
    assert not make_router("jsq").only_free  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["random", "p2c"])
def test_random_baselines_follow_their_seed(name: str) -> None:
    view = FleetSnapshot([0.0] * 8, [100] * 8, outstanding=[0] * 8)

    def picks(seed: int) -> list[int]:
        r = make_router(name, RouterOptions(seed=seed))
        _arrive(r, 40)
        return [g for _, g in r.decide(view, 0.0)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8), "the seed does not reach the random stream"


def test_binding_router_with_only_free_places_at_most_the_free_slots_in_arrival_order() -> None:
    r = make_router("jsq", RouterOptions(only_free=True))
    ids = _arrive(r, 5)
    out = r.decide(FleetSnapshot([0.0] * 3, [1, 0, 2]), 0.0)
    assert [rid for rid, _ in out] == ids[:3], "not in arrival order"
    assert sorted(g for _, g in out) == [0, 2, 2], "placed beyond a worker's free slots"
    assert r.waiting() == 2
    assert r.decide(FleetSnapshot([0.0] * 3, [0, 0, 0]), 1.0) == [] and r.waiting() == 2
    out = r.decide(FleetSnapshot([0.0] * 3, [-2, 0, 1]), 2.0)  # an over-full worker gives no credit
    assert out == [(ids[3], 2)] and r.waiting() == 1
    binding = make_router("jsq")  # without only_free every waiting request is bound
    _arrive(binding, 5)
    out = binding.decide(FleetSnapshot([0.0] * 3, [0, 0, 0]), 0.0)
    assert len(out) == 5 and binding.waiting() == 0
    assert binding.decide(FleetSnapshot([0.0] * 3, [0, 0, 0]), 0.0) == []


def test_binding_router_updates_the_view_between_its_picks() -> None:
    r = make_router("jsq-bytes")
    for rid, size in (("a", 300), ("b", 200), ("c", 100)):
        r.on_arrive(rid, size, 0.0)
    view = FleetSnapshot([0.0, 0.0], [4, 4], outstanding=[0, 0], outstanding_tokens=[0.0, 150.0])
    # bytes after each pick: a → w0 [300, 150]; b → w1 (150 < 300) [300, 350]; c → w0 (300 < 350)
    assert r.decide(view, 0.0) == [("a", 0), ("b", 1), ("c", 0)]


def test_forced_router_replays_and_rejects_unknown_workers() -> None:
    r = make_router("forced", RouterOptions(assignments={"a": 1, "b": 0, "c": 2}, workers=2))
    r.on_arrive("a", 10, 0.0)
    r.on_arrive("b", 10, 0.0)
    assert r.waiting() == 2
    assert r.decide(FleetSnapshot([0.0, 0.0], [0, 0]), 0.0) == [("a", 1), ("b", 0)]  # slots do not matter
    assert r.waiting() == 0 and r.decide(FleetSnapshot([0.0, 0.0], [1, 1]), 0.0) == []
    r.on_arrive("c", 10, 0.0)
    with pytest.raises(ValueError, match="forced assignment of 'c' to unknown worker 2"):
        r.decide(FleetSnapshot([0.0, 0.0], [1, 1]), 0.0)
    neg = make_router("forced", RouterOptions(assignments={"x": -1}, workers=2))
    neg.on_arrive("x", 10, 0.0)
    with pytest.raises(ValueError, match="unknown worker -1"):
        neg.decide(FleetSnapshot([0.0, 0.0], [1, 1]), 0.0)


def test_pool_router_teaches_its_predictor_per_key() -> None:
    r = make_router("brh", RouterOptions(predictor="exactmatch"))
    assert r.predictor is not None
    for i in range(4):
        r.on_finish(f"long{i}", 500, key="long")
        r.on_finish(f"short{i}", 3, key="short")
    p_fin, mu = r.predictor.predict(np.array([0, 0]), 10, keys=["long", "short"])
    assert list(p_fin) == [0.0, 1.0], "finish lengths did not reach the predictor under their key"
    assert mu[1] == pytest.approx(3.0)
    s = make_router("bra", RouterOptions(predictor="survival"))
    assert s.predictor is not None
    for _ in range(3):
        s.on_finish("x", 4)
    assert list(s.predictor.predict(np.array([0]), 10)[0]) == [1.0]
    make_router("br0").on_finish("x", 4)  # no predictor: nothing to teach, nothing raised


def test_pool_routers_wait_for_free_slots_and_place_each_request_once() -> None:
    for name in POOL_ROUTERS:
        r = make_router(name)
        ids = _arrive(r, 5, size=1000)
        assert r.decide(FleetSnapshot([10.0, 20.0], [0, 0]), 0.0) == [] and r.waiting() == 5
        out = r.decide(FleetSnapshot([10.0, 20.0], [2, 1]), 10.0)
        assert len(out) == 3 and r.waiting() == 2, name
        assert sum(g == 0 for _, g in out) == 2 and sum(g == 1 for _, g in out) == 1, name
        out += r.decide(FleetSnapshot([10.0, 20.0], [1, 1]), 20.0)
        assert sorted(rid for rid, _ in out) == ids and r.waiting() == 0, name
        assert r.decide(FleetSnapshot([10.0, 20.0], [1, 1]), 30.0) == []


def test_snapshot_defaults_and_projection() -> None:
    v = FleetSnapshot([5.0, 1.0], [2, 3])
    wv = BindState.of(v)
    assert wv.kv_tokens == [5.0, 1.0] and wv.free_slots == [2, 3]
    assert wv.outstanding == [-2, -3], "without counts, more free slots must read as a shorter queue"
    assert wv.outstanding_tokens == [5.0, 1.0]
    wv.kv_tokens[0] = 99.0  # a router's bookkeeping must not write through to the caller's lists
    wv.outstanding_tokens[1] = 99.0
    assert v.loads == [5.0, 1.0]
    full = BindState.of(FleetSnapshot([5.0, 1.0], [2, 3], outstanding=[4, 1], outstanding_tokens=[7.0, 8.0]))
    assert full.outstanding == [4, 1] and full.outstanding_tokens == [7.0, 8.0]
    queued = BindState.of(FleetSnapshot([5.0, 1.0], [2, 3], queued_tokens=[10.0, 0.0]))
    assert queued.kv_tokens == [15.0, 1.0], "prompts queued at a worker count as its KV"
    idx, w, c = v.active()
    assert idx.size == w.size == c.size == 0 and idx.dtype == np.int64
    act = (np.array([1], dtype=np.int64), np.array([5.0]), np.array([2.0]))
    got = FleetSnapshot([5.0, 1.0], [2, 3], projection=lambda: act).active()
    assert all(g is a for g, a in zip(got, act, strict=True))
