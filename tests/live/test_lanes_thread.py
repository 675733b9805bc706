"""The live lanes' worker thread outlives an exception in one of its ticks: the tick is counted
(`tick_errors`) and told (`on_error("lanes")`: `shadow serve` counts it in
shadow_mirror_errors_total{stage="lanes"} and logs it), and the next tick goes on — a thread that
died would leave the report frozen with nothing said."""

from __future__ import annotations

import time
from typing import Any

from shadow.contracts.events import Arrive, Route, Token
from shadow.contracts.report import Report
from shadow.live.lanes import LiveLanes
from tests.live.stack import wait


def test_a_tick_that_raises_is_counted_and_the_thread_goes_on() -> None:
    told: list[str] = []
    live = LiveLanes(workers=["d0"], slots=4, policies=("br0",), lag_s=0.1, publish_s=0.0, tick_s=0.01)
    live.on_error = told.append
    build, fails = live.reports.build, [2]

    def failing_build(*args: Any, **kwargs: Any) -> Report:
        if fails[0]:
            fails[0] -= 1
            raise RuntimeError("a report that could not be built")
        return build(*args, **kwargs)

    live.reports.build = failing_build  # type: ignore[method-assign]
    live.start()
    try:
        now = time.monotonic()
        for ev in (Arrive("x", now, 10), Route("x", now, "d0", 10), Token("x", now + 0.02, 1)):
            live.listener(ev)
        wait(lambda: live.report()["events"]["processed"] == 3, "a report after the failed ticks")
    finally:
        live.stop()
    assert live.tick_errors == 2 and told == ["lanes", "lanes"]
