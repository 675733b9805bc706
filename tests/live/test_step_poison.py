"""Step events cannot poison the live lanes (#37, D3).

Beside a step-level fleet (two workers, 50 ms steps, every token streamed), reported steps are
judged on what the mirror sees of the same worker: 400 steps per worker claiming 3000 s (under the
event bound of 3600 s) are left out and counted, the lanes' clock stays on 50 ms and the `actual`
lane finishes what the fleet finishes (the old lanes took one 3000 s step and froze for good).
Steps the streams cannot refute (3.5 × the real step, every step for a minute) move the clock while
they last; once they stop the clock comes back and the `actual` lane catches up with the fleet
(the old clock kept their mean for good). Outliers beyond the clamp move a worker's clock not at
all; the plausibility rules each have their reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from shadow.contracts.events import Finish, Step
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import LaneClock
from shadow.live.lanes import LiveLanes
from shadow.live.metrics import LiveCollector
from shadow.live.stepcheck import BEYOND_MODEL, LONGER, StepCheck
from shadow.live.workerclock import WorkerClock
from tests.engine.rolling_fleet import STEP, fleet

LAG = 1.0


class _Session:
    """Live lanes beside a fleet of two workers × 4 slots at 5 requests/s (well within capacity),
    advanced after every fleet step; `run` adds reported steps of `step_s` on both workers."""

    def __init__(self) -> None:
        self.real = fleet(2, 4, rate=5.0, out=40, every=1, seed=3, route="jsq-bytes")
        self.live = LiveLanes(workers=["d0", "d1"], slots=4, policies=("br0",), lag_s=LAG,
                              step=StepTimeModel(a=1e-9, b=STEP), clock=lambda: self.real.t)
        self.ends: list[float] = []  # the fleet's finishes

    def run(self, seconds: float, step_s: float | None = None) -> None:
        real, live = self.real, self.live
        end = real.t + seconds
        while real.t < end:
            for ev in real.step():
                live.listener(ev)
                if isinstance(ev, Finish):
                    self.ends.append(ev.t)
            if step_s is not None:
                for g in range(2):
                    live.listener(Step(real.t, step_s, worker=f"d{g}"))
            live.process_now()
            live.driver.advance_to(live.live_now())
        live._publish()

    def behind(self) -> int:
        """Requests the fleet finished before the lanes' horizon that the actual lane has not."""
        horizon = self.real.t - LAG
        done = sum(t <= horizon for t in self.ends)
        return done - int(self.live.report()["lanes"]["actual"]["requests_finished"])

    def clock(self) -> list[float]:
        """The step each worker's lane steps on (a ≈ 0 here: b)."""
        return [m.b for m in self.live.lane_clock.models or ()]


def test_steps_longer_than_the_streams_show_are_left_out_and_the_lanes_keep_up() -> None:
    s = _Session()
    s.run(20.0)
    assert s.behind() <= 3 and s.clock() == pytest.approx([STEP, STEP], rel=0.02)
    s.run(20.0, step_s=3000.0)  # 400 per worker, one per fleet step
    s.run(STEP)  # the last two are judged at the next observation point: the next step's events pass it
    rep = s.live.report()
    assert s.clock() == pytest.approx([STEP, STEP], rel=0.02)
    assert s.behind() <= 3, (s.behind(), rep["lanes"]["actual"])
    assert rep["step_model"]["step_events_rejected"] == {LONGER: 800, BEYOND_MODEL: 0}
    assert rep["step_model"]["step_event_sources"] == {"worker": 800}  # received, then judged
    s.run(20.0)
    assert s.behind() <= 3 and s.clock() == pytest.approx([STEP, STEP], rel=0.02)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(LiveCollector(s.live))
    page = generate_latest(registry).decode()
    assert 'shadow_live_step_events_rejected_total{reason="longer_than_streams"} 800.0' in page


def test_a_clock_moved_by_plausible_steps_comes_back_once_they_stop() -> None:
    s = _Session()
    s.run(20.0)
    # every step reported 3.5 × as long as the streams show (within what they can refute) for a
    # minute: the clock follows a lasting majority, and the actual lane falls behind the fleet
    s.run(60.0, step_s=3.5 * STEP)
    assert s.live.step_check.rejected[LONGER] == 0
    assert s.clock() == pytest.approx([3.5 * STEP] * 2, rel=0.05)
    assert s.behind() > 20
    # they stop: within the clock's history (120 windows of 0.5 s) the clock is back on the
    # streams' steps and the actual lane has caught up with the fleet (it has the capacity)
    waited = 0.0
    while not (s.clock() == pytest.approx([STEP, STEP], rel=0.02) and s.behind() <= 3):
        assert waited < 300.0, (s.clock(), s.behind(), s.live.report()["step_model"]["clock"])
        s.run(5.0)
        waited += 5.0
    print(f"\nrecovered {waited:g} s (fleet time) after the bad steps stopped")


def _windows(wc: WorkerClock, periods: list[list[float]]) -> None:
    """One window per list of periods (worker 0), each closed on the configured clock."""
    t = 0.0
    for window in periods:
        for p in window:
            t += p
            wc.add_step(0, t, p, "probe")
        wc.add_loads([10.0])
        wc.close(LaneClock.barrier(1))


def test_outliers_beyond_the_clamp_change_a_workers_clock_not_at_all() -> None:
    rng = np.random.default_rng(5)
    clean = [list(rng.uniform(0.018, 0.022, 20)) for _ in range(40)]
    # 30 % of three windows in four 100 × too long; after every fourth, a window of nothing else
    bad = [x for i, w in enumerate(clean) for x in ([w[:14] + [2.0] * 6] if i % 4 else [w, [2.0] * 20])]
    kept = [x for i, w in enumerate(clean) for x in (w[:14] if i % 4 else w)]
    wc = WorkerClock(1, StepTimeModel(a=0.0, b=0.05))
    _windows(wc, bad)
    model = wc.worker_model(0)
    assert model.kind == "mean step" and model.steps == len(kept)
    assert model.mean_step_s == pytest.approx(float(np.mean(kept)), rel=1e-9)
    # a lasting change (most of the recent windows) is the engine's new step: it is learned
    wc = WorkerClock(1, StepTimeModel(a=0.0, b=0.05))
    _windows(wc, clean[:20] + [[0.2] * 20] * 100)
    assert (wc.worker_model(0).mean_step_s or 0.0) > 0.1


def test_each_plausibility_rule_has_its_reason() -> None:
    check = StepCheck(2, StepTimeModel(a=0.0, b=0.02))
    # worker 0's streams step every 20 ms from t = 10 to 12, and stall 2 s before their chunk at 14
    ends = [(0, 10.0 + 0.02 * i, 0.02) for i in range(1, 101)] + [(0, 14.0, 2.0)]
    check.saw(ends)
    loads = [100.0, 0.0]
    assert check.check(0, 11.0, 0.02, 0.02, loads) is None
    assert check.check(0, 11.0, 0.5, 0.5, loads) == LONGER
    assert check.check(0, 11.0, 0.07, 0.001, loads) is None  # under 4 × the gaps: not refuted
    assert check.check(0, 11.0, 0.001, 0.09, loads) == LONGER  # its period counts too
    assert check.check(0, 14.0, 1.9, 2.0, loads) is None  # the stall: the chunk that ends it vouches
    # worker 1: no streams seen: the configured model (10 ×) bounds it
    assert check.check(1, 11.0, 0.15, 0.15, loads) is None
    assert check.check(1, 11.0, 3000.0, 3000.0, loads) == BEYOND_MODEL
    # no known worker: plausible when it fits some worker's streams or the model where none are seen
    assert check.check(None, 11.0, 0.15, 0.15, loads) is None  # worker 1 says nothing; 0.15 < 10 × 20 ms
    assert check.check(None, 11.0, 3000.0, 3000.0, loads) == BEYOND_MODEL
    check.saw([(1, 10.0 + 0.03 * i, 0.03) for i in range(1, 50)])
    assert check.check(None, 11.0, 0.1, 0.1, loads) is None  # fits worker 1's 30 ms steps
    assert check.check(None, 11.0, 0.5, 0.5, loads) == LONGER
    assert check.rejected == {LONGER: 3, BEYOND_MODEL: 2}


def test_stream_steps_that_come_by_stream_not_in_time_are_judged_as_in_time() -> None:
    # held Tokens bring a worker's step ends stream by stream: the same ends in any order vouch for
    # the same steps
    ends = [(0, 10.0 + 0.02 * i, 0.02) for i in range(1, 101)] + [(0, 14.0, 2.0)]
    ordered, shuffled = StepCheck(1, StepTimeModel(a=0.0, b=0.02)), StepCheck(1, StepTimeModel(a=0.0, b=0.02))
    ordered.saw(ends)
    shuffled.saw(ends[1::2] + ends[::-2])
    assert shuffled.seen[0].times == ordered.seen[0].times and shuffled.seen[0].gaps == ordered.seen[0].gaps
    for t, d in ((11.0, 0.02), (11.0, 0.5), (14.0, 1.9), (12.5, 0.03)):
        assert shuffled.check(0, t, d, d, [1.0]) == ordered.check(0, t, d, d, [1.0])
