"""The active dispatcher routes on the fleet's step cost: its BalanceRoute policies and the BR-0 bypass
balance KV tokens + κ per running sequence as `cost()` says it at each round (a refit reaches the
next round), the paper's KV tokens without one; `shadow serve --active` gives it the live lanes'
cost (their step models, the configured one until measured)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from shadow.active.dispatcher import DispatchConfig, Dispatcher
from shadow.active.ledger import Ledger
from shadow.active.metrics import ActiveMetrics
from shadow.app.serve import ServeConfig, ServeService
from shadow.contracts.modes import StaticModeSource
from shadow.core.cost import SEQUENCES, TOKENS, RouteCost
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import LaneClock
from shadow.mirror.config import MirrorConfig
from tests.active.stubs import FixedSource

# d0 runs six short requests (600 KV tokens), d1 one long one (700): the bytes say d0, the
# sequences say d1.
SOURCE = ([600.0, 700.0], [6, 1])


def _placements(cost: RouteCost | None, bypass: bool, prompts: list[int]) -> list[int]:
    async def scenario() -> list[int]:
        ledger = Ledger(2, 16, 8)
        dispatcher = Dispatcher(
            DispatchConfig(["d0", "d1"], 16, bypass=bypass),
            ledger,
            FixedSource(*SOURCE),
            ActiveMetrics(CollectorRegistry()),
            StaticModeSource("active", "br0"),
            cost=None if cost is None else (lambda: cost),
        )
        out = []
        for i, s in enumerate(prompts):
            fut = dispatcher.submit(f"r{i}", s, float(s), "br0")
            out.append(await asyncio.wait_for(fut, 5))
        return out

    return asyncio.run(scenario())


def test_pool_rounds_and_the_bypass_balance_the_cost_they_are_given() -> None:
    for bypass in (False, True):
        assert _placements(None, bypass, [50]) == [0], bypass  # the paper's: fewer KV tokens
        assert _placements(TOKENS, bypass, [50]) == [0], bypass
        assert _placements(RouteCost(1.0, 200.0), bypass, [50]) == [1], bypass  # κ = 200 tokens
        assert _placements(SEQUENCES, bypass, [50]) == [1], bypass


def test_the_cost_is_asked_at_every_round() -> None:
    costs = [TOKENS, RouteCost(1.0, 200.0)]

    async def scenario() -> list[int]:
        dispatcher = Dispatcher(
            DispatchConfig(["d0", "d1"], 16),
            Ledger(2, 16, 8),
            FixedSource(*SOURCE),
            ActiveMetrics(CollectorRegistry()),
            StaticModeSource("active", "br0"),
            cost=lambda: costs[0],
        )
        first = await asyncio.wait_for(dispatcher.submit("a", 10, 10.0, "br0"), 5)
        costs[0] = costs[1]  # a refit
        second = await asyncio.wait_for(dispatcher.submit("b", 10, 10.0, "br0"), 5)
        return [first, second]

    assert asyncio.run(scenario()) == [0, 1]


def test_serve_active_gives_its_policy_the_lanes_cost() -> None:
    tap = MirrorConfig({"d0": "http://127.0.0.1:1", "d1": "http://127.0.0.1:2"}, slots=8)
    svc = ServeService(ServeConfig(tap))  # constructed, never started
    assert svc.route_cost() == RouteCost.of(svc.live.step) == TOKENS  # the configured model until measured
    fitted = StepTimeModel(2e-6, 0.02, c=1e-3)
    svc.live.lane_clock = LaneClock.barrier(2, [fitted, fitted])  # as a refit sets it
    assert svc.route_cost() == RouteCost.of(fitted)
    configured = ServeService(ServeConfig(tap, lane_clock="configured"))  # the lanes step on --step-a/-b
    configured.live.lane_clock = LaneClock.barrier(2, [fitted, fitted])
    assert configured.route_cost() == TOKENS
