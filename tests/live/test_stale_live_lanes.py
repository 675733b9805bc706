"""Staleness as a lane property in the live lanes: the live driver's lanes and the agreement
routers are built from `policy@AGE` like the simulated ones, on the live clock; a burst of arrivals
inside one refresh period lands as the rule's own increments place it. The report's `router_rule`
names the lane that agrees most with the router (the lanes it cannot be told from: tied)."""

from __future__ import annotations

import time
from typing import Any

from shadow.contracts.events import Arrive, Finish, Route
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.live import LiveDriver
from shadow.live.routerrule import router_rule


def test_a_burst_in_the_live_lanes_is_placed_on_the_stale_view() -> None:
    cfg = EngineConfig(workers=2, slots=8)
    specs = [LaneSpec.parse(p) for p in ("smg-min-tokens@0", "smg-min-tokens@10s")]
    driver = LiveDriver(cfg, specs, ["d0", "d1"], time.perf_counter, lag_s=0.0)
    for i in range(6):  # six requests within 5 ms, all through the router to d0
        rid = f"r{i}"
        driver.apply(Arrive(rid, 1.0 + 0.001 * i, 100))
        driver.apply(Route(rid, 1.0 + 0.001 * i, "d0", 100))
    for i in range(6):  # their ends known (the lanes hold a step whose end is not)
        driver.apply(Finish(f"r{i}", 1.5, "stop", 3))
    driver.advance_to(1.005)  # all offered inside the first step (20 ms): r0 runs, the rest queue
    placed = {lane.spec.label: list(lane.snapshot().outstanding or ()) for lane in driver.lanes}
    assert placed["actual"] == [6, 0]
    # fresh: r0's 100 tokens are used at d0 from the step it started; queued prompts are not
    # used tokens, so r1..r5 all see d1 empty
    assert placed["smg-min-tokens@0"] == [1, 5]
    # on the 10 s poll: the view of t = 1.0 (both empty) plus its own +98 per dispatch
    assert placed["smg-min-tokens@10s"] == [3, 3]
    driver.drain()
    assert all(lane.totals.finished == 6 for lane in driver.lanes)


def test_router_rule_names_the_highest_agreement_and_lists_ties() -> None:
    lanes: dict[str, dict[str, Any]] = {
        "actual": {"agreement_rate": None},
        "jsq-bytes": {"agreement_rate": 0.9, "decisions": 10},
        "sglang-tokens": {"agreement_rate": 0.9, "decisions": 10},
        "vllm-dp": {"agreement_rate": 0.4, "decisions": 10},
    }
    rule = router_rule(lanes)
    assert rule["closest_lane"] == "jsq-bytes" and rule["tied"] == ["jsq-bytes", "sglang-tokens"]
    assert rule["agreement_rate"] == 0.9 and rule["decisions"] == 10
    assert list(rule["by_lane"]) == ["jsq-bytes", "sglang-tokens", "vllm-dp"]
    assert router_rule({"actual": {"agreement_rate": None}})["closest_lane"] is None


def test_router_rule_ties_the_lanes_the_placements_cannot_tell_apart() -> None:
    # 160 and 162 of 164 placements (a CI run behind the JSQ-bytes router): 4 misses against 2 is
    # chance (Fisher p 0.34), 34 against 2 is not
    lanes: dict[str, dict[str, Any]] = {
        "actual": {"agreement_rate": None},
        "jsq-bytes": {"agreements": 160, "decisions": 164, "agreement_rate": 160 / 164},
        "sglang-tokens": {"agreements": 162, "decisions": 164, "agreement_rate": 162 / 164},
        "trtllm-adp": {"agreements": 130, "decisions": 164, "agreement_rate": 130 / 164},
        "br0": {"agreements": 87, "decisions": 164, "agreement_rate": 87 / 164},
    }
    rule = router_rule(lanes)
    assert rule["closest_lane"] == "sglang-tokens" and rule["tied"] == ["jsq-bytes", "sglang-tokens"], rule
    assert rule["agreement_rate"] == 162 / 164 and rule["decisions"] == 164
    # the same rates over 10 times fewer placements: nothing is told apart but BR-0 (8 misses of 16)
    few = {k: {**v, "agreements": None, "decisions": 16} if v["agreement_rate"] else v
           for k, v in lanes.items()}
    assert router_rule(few)["tied"] == ["jsq-bytes", "sglang-tokens", "trtllm-adp"]
    # one miss in 164 against 34 in 164 is told apart however the other lanes stand
    strict: dict[str, dict[str, Any]] = {
        "jsq-bytes": {"agreements": 163, "decisions": 164, "agreement_rate": 163 / 164},
        "sglang-tokens": {"agreements": 130, "decisions": 164, "agreement_rate": 130 / 164},
    }
    assert router_rule(strict)["tied"] == ["jsq-bytes"]
