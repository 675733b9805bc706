"""The router's own view at each placement (`shadow.engine.routerview`), kept by the live driver from
the same events the mirror folds: its ledger of requests sent and not ended (counts, prompt tokens,
body bytes) and the mirror's running requests, taken before the placed request counts."""

from __future__ import annotations

import time

import pytest

from shadow.contracts.events import Arrive, Event, Finish, Route, Token
from shadow.core.cost import TOKENS
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.live import LiveDriver
from shadow.engine.routerview import RouterViews


def _driver() -> LiveDriver:
    cfg = EngineConfig(workers=2, slots=4)
    return LiveDriver(cfg, [LaneSpec.parse("jsq-bytes")], ["d0", "d1"], time.perf_counter, lag_s=0.0)


def test_each_placement_sees_the_ledger_before_it() -> None:
    driver = _driver()
    views = driver.watch_router()
    events: list[Event] = [
        Arrive("a", 1.0, 100, body_bytes=900), Route("a", 1.0, "d0", 100),
        Arrive("b", 1.1, 40), Route("b", 1.1, "d1", 40),  # no body size: 4 bytes a prompt token
        Token("a", 1.2, 1), Token("a", 1.3, 3),  # a runs on d0 and holds 103 KV tokens
        Arrive("c", 1.4, 10, body_bytes=50), Route("c", 1.4, "d0", 10),
        Finish("a", 1.5, "stop", 5),
        Arrive("d", 1.6, 7, body_bytes=70), Route("d", 1.6, "d1", 7),
    ]
    for ev in events:
        driver.apply(ev)
    a, b, c, d = (views.take(r) for r in "abcd")
    assert a is not None and b is not None and c is not None and d is not None
    empty = ((0, 0), (0.0, 0.0), (0, 0), (0.0, 0.0))
    assert (a.outstanding, a.outstanding_bytes, a.running, a.loads) == empty
    assert (b.outstanding, b.outstanding_tokens, b.outstanding_bytes) == ((1, 0), (100.0, 0.0), (900.0, 0.0))
    assert (c.outstanding, c.outstanding_tokens) == ((1, 1), (100.0, 40.0))
    assert c.outstanding_bytes == (900.0, 160.0)
    assert (c.running, c.loads, c.prompt_loads) == ((1, 0), (103.0, 0.0), (100.0, 0.0))
    # a's stream ended before d was placed: out of the ledger and of the running
    assert (d.outstanding, d.outstanding_bytes) == ((1, 1), (50.0, 160.0))
    assert (d.running, d.loads) == ((0, 0), (0.0, 0.0))
    assert views.take("a") is None  # once

    snap = c.snapshot(4, TOKENS, {})
    assert list(snap.free_slots) == [3, 4] and list(snap.queued_tokens or ()) == [0.0, 40.0]


def test_views_not_taken_leave_with_their_requests() -> None:
    driver = _driver()
    views = driver.watch_router()
    for i in range(20):
        t = 1.0 + i
        for ev in (Arrive(f"r{i}", t, 10, body_bytes=30), Route(f"r{i}", t, f"d{i % 2}", 10),
                   Token(f"r{i}", t + 0.1, 1), Finish(f"r{i}", t + 0.5, "stop", 2)):
            driver.apply(ev)
        driver.advance_to(t + 0.5)
    driver.drain()
    assert views.pending == 0 and driver.open_requests() == 0
    # a request that ended with no token is dropped at its end, its view with it
    driver.apply(Arrive("x", 30.0, 10))
    driver.apply(Route("x", 30.0, "d0", 10))
    assert views.pending == 1
    driver.apply(Finish("x", 30.1, "stop", 0))
    assert views.pending == 0


def test_a_placed_request_counts_once() -> None:
    views = RouterViews(2)
    views.placed("r", 1, 10, 40.0, [0, 0], [0.0, 0.0])
    views.placed("r", 0, 10, 40.0, [0, 0], [0.0, 0.0])
    views.started("r")
    views.started("r")
    views.placed("s", 0, 1, 4.0, [0, 1], [0.0, 11.0])
    s = views.take("s")
    assert s is not None and s.outstanding == (0, 1) and s.prompt_loads == (0.0, 10.0)
    views.ended("r")
    views.ended("r")
    views.placed("t", 0, 1, 4.0, [0, 0], [0.0, 0.0])
    t = views.take("t")
    assert t is not None and t.outstanding == (1, 0) and t.prompt_loads == (0.0, 0.0)
    assert t.outstanding_bytes == pytest.approx((4.0, 0.0))
