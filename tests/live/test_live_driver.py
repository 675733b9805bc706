"""The live driver: same lanes as the offline driver, ends only from events, bounded memory."""

from __future__ import annotations

import time

import pytest

from shadow.contracts.events import Arrive, Event, Finish, Route, Token
from shadow.core.policies import RouterOptions, make_router
from shadow.core.schedule import make_round_router, schedule_round
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job, jobs_from
from shadow.engine.lane import Lane
from shadow.engine.live import LiveDriver
from shadow.engine.offline import run_offline
from shadow.engine.results import lane_result
from shadow.traces import at_load, estimate_capacity_rps, resolve
from tests.engine.helpers import ready_times, run_lane
from tests.live.sessions import session_events

POLICIES = ("jsq-bytes", "br0", "brh:survival")


def _offline(reqs, cfg, specs):  # type: ignore[no-untyped-def]
    first = min(r[1] for r in reqs)
    jobs = [Job(rid, a - first, p, o, None) for rid, a, p, o, _ in sorted(reqs, key=lambda x: x[1])]
    forced = {rid: int(w[1:]) for rid, _, _, _, w in reqs}
    lanes = [LaneSpec("forced", name="actual"), *specs]
    return run_offline(jobs, cfg, lanes, time.perf_counter, forced=forced)


def _feed(driver: LiveDriver, events: list[Event], every: float = 0.1) -> None:
    last = None
    for ev in events:
        driver.apply(ev)
        if last is None or ev.t - last > every:
            driver.advance_to(ev.t)
            last = ev.t


def test_live_lanes_equal_the_offline_replay_of_the_same_session() -> None:
    g, b = 4, 16
    events, reqs = session_events(400, g, b, rho=1.05, token_every=16)
    cfg = EngineConfig(workers=g, slots=b)
    specs = [LaneSpec.parse(p) for p in POLICIES]
    driver = LiveDriver(cfg, specs, [f"d{i}" for i in range(g)], time.perf_counter, lag_s=2.0)
    _feed(driver, events)
    driver.drain()
    off = _offline(reqs, cfg, specs)
    live = {lane.spec.label: lane_result(lane, driver.released, 0) for lane in driver.lanes}
    assert set(live) == set(off) == {"actual", "jsq-bytes", "br0", "brh-survival"}
    for label, r in live.items():
        assert r.finished == off[label].finished == 400
        assert r.steps == off[label].steps
        assert r.avg_spread_tokens == pytest.approx(off[label].avg_spread_tokens, rel=1e-9)
    # Ends were learnt from events only: with a token event every 16 tokens the lanes had to wait.
    assert sum(lane.totals.stalls for lane in driver.lanes) > 0
    # Bounded memory: every finished request has left the table and the release queue.
    assert driver.open_requests() == 0 and len(driver.releases.jobs) == 0


def test_a_lane_never_guesses_an_end_it_does_not_know() -> None:
    cfg = EngineConfig(workers=2, slots=4)
    driver = LiveDriver(cfg, [LaneSpec("br0")], ["d0", "d1"], time.perf_counter, lag_s=0.0)
    driver.apply(Arrive("a", 10.0, 100))
    driver.apply(Route("a", 10.0, "d1", 100))
    driver.apply(Token("a", 10.5, 5))
    driver.advance_to(60.0)  # far ahead: the lanes may only run while "a" is known to continue
    actual, br0 = driver.lanes
    for lane in (actual, br0):
        assert lane.stalled and lane.totals.finished == 0
        assert lane.k == 4  # steps 0..3 emitted tokens 1..4; token 5 exists; the 6th is unknown
        assert lane.totals.stalls == 1
    assert driver.lag(actual) > 0
    driver.apply(Finish("a", 61.0, "stop", 7))
    driver.advance_to(61.0)
    for lane in (actual, br0):
        assert not lane.stalled and lane.totals.finished == 1 and lane.totals.tokens == 7
        assert lane.loads == [0.0, 0.0]
    assert actual.totals.stalls == 1
    assert driver.open_requests() == 0


def test_unrouted_and_tokenless_requests_never_reach_the_lanes() -> None:
    cfg = EngineConfig(workers=1, slots=2)
    driver = LiveDriver(cfg, [LaneSpec("jsq-bytes")], ["d0"], time.perf_counter, lag_s=1.0)
    driver.apply(Arrive("x", 1.0, 10))
    driver.apply(Finish("x", 2.0, "error", 0))  # failed before any placement
    driver.apply(Arrive("y", 1.0, 10))
    driver.apply(Route("y", 1.0, "d0", 10))
    driver.apply(Finish("y", 1.2, "abort", 0))  # no token: not a request (as the offline feed)
    driver.apply(Route("z", 1.0, "nope", 10))
    driver.drain()
    assert driver.released == 0 and driver.open_requests() == 0
    assert driver.dropped == {"never_routed": 1, "no_tokens": 1} and driver.unknown_worker == 1


def test_br0_beats_a_jsq_bytes_router_on_a_saturated_paper_like_run() -> None:
    # The actual lane replays a JSQ-bytes router's decisions (those of an offline JSQ-bytes lane on
    # the same trace, i.e. the vllm-ascend proxy's rule); BR-0 runs beside it on the live events.
    # The paper-like default of `shadow replay`/`shadow demo`: G=8, B=64, 4,000 requests at ρ=1.1.
    g, b, n = 8, 64, 4000
    trace = resolve("paper-azure", seed=0, limit=n)
    cfg = EngineConfig(workers=g, slots=b)
    cap = estimate_capacity_rps(trace, workers=g, slots=b, step_a=cfg.step.a, step_b=cfg.step.b)
    jobs = jobs_from(at_load(trace, 1.1, cap).requests)
    decided: dict[object, int] = {}
    jsq = Lane(LaneSpec("jsq-bytes"), cfg, time.perf_counter)
    decide = jsq.router.decide

    def spy(view, now):  # type: ignore[no-untyped-def]
        out = decide(view, now)
        decided.update(out)
        return out

    jsq.router.decide = spy  # type: ignore[method-assign]
    run_lane(jsq, jobs, ready_times(jobs, None))
    events: list[Event] = []
    for j in jobs:
        rid, t = str(j.request_id), 100.0 + j.arrival_s
        events += [Arrive(rid, t, j.prompt_tokens), Route(rid, t, f"d{decided[j.request_id]}")]
        events.append(Finish(rid, t + 0.06 * j.output_tokens, "stop", j.output_tokens))
    events.sort(key=lambda e: e.t)
    driver = LiveDriver(cfg, [LaneSpec("br0")], [f"d{i}" for i in range(g)], time.perf_counter, lag_s=2.0)
    _feed(driver, events, every=0.5)
    driver.drain()
    res = {lane.spec.label: lane_result(lane, n, 0) for lane in driver.lanes}
    assert res["actual"].finished == res["br0"].finished == n
    jsq_spread = lane_result(jsq, n, 0).avg_spread_tokens
    assert res["actual"].avg_spread_tokens == pytest.approx(jsq_spread, rel=1e-9)
    assert res["br0"].avg_spread_tokens <= res["actual"].avg_spread_tokens / 1.5


def test_round_robin_and_random_keep_state_across_rounds() -> None:
    rr = make_round_router("rr")
    picks = [schedule_round(rr, [0, 0, 0], [1, 1, 1], [(i, 1)])[0][1] for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    rnd = make_round_router("random", seed=3)
    draws = {schedule_round(rnd, [0] * 8, [1] * 8, [(i, 1)])[0][1] for i in range(40)}
    assert len(draws) > 3
    # a name is a fresh router per round (documented): round-robin restarts at worker 0
    assert [schedule_round("rr", [0, 0], [1, 1], [(i, 1)])[0][1] for i in range(3)] == [0, 0, 0]


def test_registry_rejects_unknown_names_and_misplaced_predictors() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_router("nope")
    with pytest.raises(ValueError, match="takes no predictor"):
        make_router("jsq", RouterOptions(predictor="survival"))
    with pytest.raises(ValueError, match="needs its assignments"):
        make_router("forced")


def _drained_report(live, events):  # type: ignore[no-untyped-def]
    """`live`'s report once it has applied `events` and drained."""
    for ev in events:
        live.listener(ev)
    live.process_now()
    live.driver.drain()
    live._publish()
    return live.report()


def test_agreement_counts_what_each_policy_would_have_chosen_and_keeps_nothing() -> None:
    from shadow.live.lanes import LiveLanes

    live = LiveLanes(workers=["d0", "d1"], slots=1, policies=["jsq-bytes", "br0"], lag_s=0.0)
    events: list[Event] = []
    for i, w in enumerate(["d0", "d1", "d1", "d0", "d1", "d0"]):
        t = 10.0 + i
        events += [Arrive(f"r{i}", t, 100 + i), Route(f"r{i}", t, w, 100 + i)]
        events.append(Finish(f"r{i}", t + 0.5, "stop", 3))
    lanes = _drained_report(live, events)["lanes"]
    # jsq-bytes (least outstanding prompt tokens, ties to d0) agrees on an empty fleet only with d0
    assert lanes["jsq-bytes"]["decisions"] == 6 and lanes["jsq-bytes"]["agreements"] == 3
    assert 0 < lanes["br0"]["decisions"] <= 6
    assert set(lanes) == {"actual", "jsq-bytes", "br0"}
    assert all(r.waiting() == 0 for r in live.agreement.routers.values())


def test_agreement_asks_each_rule_on_the_routers_view_not_the_lanes_model() -> None:
    """A JSQ-bytes router (least outstanding body bytes, held to the stream's real end, ties to the
    first worker) places 300 requests whose streams last far longer than the lanes' step model
    says (0.2 s a token against its 20 ms): the lanes' `actual` fleet ends them early and orders the
    workers otherwise, but the rules are asked on the router's own view, so `jsq-bytes` agrees with
    every placement and the rules on other signals do not."""
    import random

    from shadow.live.lanes import LiveLanes

    rng = random.Random(7)
    workers = ["d0", "d1", "d2"]
    held = [0.0] * 3
    ends: list[tuple[float, str, int, int, int]] = []  # (end, rid, worker, bytes, output)
    events: list[Event] = []
    t = 0.0
    for i in range(300):
        t += rng.expovariate(8.0)
        while ends and min(ends)[0] <= t:
            _end, _rid, g, size, _out = min(ends)
            ends.remove(min(ends))
            held[g] -= size
        prompt = rng.randint(10, 400)
        size = prompt * rng.randint(2, 9)
        out = rng.randint(2, 40)
        g = min(range(3), key=lambda w: (held[w], w))
        held[g] += size
        end = t + 0.05 + 0.2 * out
        ends.append((end, f"r{i}", g, size, out))
        events += [Arrive(f"r{i}", t, prompt, body_bytes=size), Route(f"r{i}", t, workers[g], prompt),
                   Token(f"r{i}", t + 0.05, 1), Finish(f"r{i}", end, "stop", out)]
    events.sort(key=lambda ev: ev.t)
    live = LiveLanes(workers=workers, slots=64, policies=["jsq-bytes", "sglang-tokens", "jsq"], lag_s=1.0)
    lanes = _drained_report(live, events)["lanes"]
    assert lanes["jsq-bytes"]["decisions"] == 300
    assert lanes["jsq-bytes"]["agreements"] == 300
    assert lanes["sglang-tokens"]["agreements"] < 300 and lanes["jsq"]["agreements"] < 300
    assert live.report()["router_rule"]["closest_lane"] == "jsq-bytes"
