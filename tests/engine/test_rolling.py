"""The rolling counterfactual: lanes re-seeded from the mirrored fleet at every window boundary.

A small deterministic fleet (the "real" one) emits what a mirror sees; live lanes with a rolling
window follow it. Checked: a re-seeded lane holds exactly the seed's state; lag stays bounded
where without re-seeding it grows; and an offline replay from the recorded requests and seeds
gives every window the same figures the live lanes gave it (all of them in one pass, and one
window alone from its seed).
"""

from __future__ import annotations

import pytest

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.feed import recorded_requests
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.rolled import replay_rolling
from shadow.engine.rolling import Seed
from shadow.engine.windows import Windows
from tests.engine.rolling_fleet import clock, fleet, live_session

SPECS = [LaneSpec("jsq-bytes"), LaneSpec("br0"), LaneSpec("brh", "survival")]


def test_reseed_replaces_the_lane_state() -> None:
    """Offline lane: after `reseed` it holds exactly the seeded running requests (KV prompt +
    tokens so far, ending after their remaining tokens) and routes the seeded waiting ones anew."""
    config = EngineConfig(workers=2, slots=2, step=StepTimeModel(a=0.0, b=1.0))
    lane = Lane(LaneSpec("jsq-bytes"), config, clock)
    for i in range(3):
        lane.offer(Job(f"old{i}", 0.0, 100, 50), 0.0)
    lane.step()
    dropped = lane.reseed(10.0, [(0, Job("a", 5.0, 10, 5), 3), (1, Job("b", 6.0, 4, 2), 1)],
                          [(Job("c", 9.0, 7, 3), 9.0)])
    assert sorted(map(str, dropped)) == ["old0", "old1", "old2"]
    assert lane.now == 10.0 and lane.seeded == {"a", "b", "c"}
    assert lane.loads == [13.0, 5.0] and lane.running == [1, 1]
    assert lane.waiting == 1 and lane.queued_tokens == [0.0, 7.0]  # JSQ-bytes: c to the lighter d1
    finished_at = {}
    lane.on_done = lambda rid: finished_at.setdefault(rid, lane.k)
    k0 = lane.k
    while lane.step():
        pass
    # a: tokens 4 and 5 (2 steps); b: token 2 (1 step); c: d1's free slot at once, 3 tokens
    assert finished_at == {"b": k0, "a": k0 + 1, "c": k0 + 2}
    assert lane.totals.finished == 3 and lane.loads == [0.0, 0.0]
    assert len(lane.totals.ttft_s) == 1  # only c started in the window


def test_seeded_lanes_hold_the_mirrored_state() -> None:
    """Right after each boundary every lane's running KV per worker is the seed's (prompt + tokens
    mirrored so far of the requests with a token), whatever the lane did before."""
    seen: list[tuple[str, list[float], list[float]]] = []
    original = Lane.reseed

    def spy(self: Lane, at: float, running: list[tuple[int, Job, int]],
            waiting: list[tuple[Job, float]]) -> list[object]:
        out = original(self, at, running, waiting)
        want = [0.0] * 3
        for g, job, age in running:
            want[g] += job.prompt_tokens + age
        seen.append((self.spec.label, want, list(self.loads)))
        return out  # type: ignore[return-value]

    mp = pytest.MonkeyPatch()
    mp.setattr(Lane, "reseed", spy)
    try:
        driver, _, _, _ = live_session(fleet(3, 4, rate=14.0, out=40, every=3, seed=1, route="jsq"), 40.0,
                                       SPECS, rolling=5.0)
    finally:
        mp.undo()
    assert driver.reseeds >= 4 * 6  # four lanes, every 5 s boundary of the 40 s
    assert {label for label, _, _ in seen} == {"actual", "jsq-bytes", "br0", "brh-survival"}
    assert any(sum(want) > 0 for _, want, _ in seen)
    for label, want, got in seen:
        assert got == want, label


def test_rolling_bounds_the_lag() -> None:
    """The real router puts everything on d0 (its queue grows without end): a JSQ-bytes lane runs
    requests long before the real worker does and waits for their ends. Without re-seeding its lag
    grows with the real queue; re-seeded every 5 s (and cut when more than 5 s behind) it stays
    within the window's bound."""
    specs = [LaneSpec("jsq-bytes")]
    _, _, _, grows = live_session(fleet(2, 2, rate=8.0, out=12, every=2, seed=3, route="first"), 90.0,
                                  specs, rolling=None)
    driver, windows, _, bounded = live_session(
        fleet(2, 2, rate=8.0, out=12, every=2, seed=3, route="first"), 90.0, specs, rolling=5.0)
    assert grows > 20.0
    assert bounded <= 5.0 + 5.0 + 1.0 + 0.5  # max lag + one window + the lag itself + one step
    assert driver.cuts.get("jsq-bytes", 0) >= 1
    assert any(w.cut for w in windows.series("jsq-bytes"))


def _agree(live: Windows, replayed: Windows, labels: list[str], first: int, last: int) -> int:
    """Windows first..last of every lane: the same totals live and replayed; returns how many."""
    n = 0
    for label in labels:
        mine = {w.index: w for w in live.series(label)}
        theirs = {w.index: w for w in replayed.series(label)}
        for i in range(first, last + 1):
            assert i in mine and i in theirs, (label, i)
            if mine[i].cut:
                continue
            assert theirs[i] == mine[i], (label, i)
            n += 1
    return n


def test_replay_gives_every_window_the_live_figures() -> None:
    """Live lanes at ρ above capacity (real queues) with lag and ends learned late, arrivals
    carrying their body sizes (jsq-bytes scores them); the recording (requests as ended, seeds as
    taken) replayed offline: every window's totals are the live ones, in one pass for all lanes,
    and one window alone from its seed for the history-free ones."""
    driver, windows, events, _ = live_session(fleet(3, 4, rate=16.0, out=40, every=4, seed=7, route="jsq"),
                                              60.0, SPECS, rolling=5.0, bodies=True)
    seeds = {s.window: Seed.from_json(s.to_json()) for s in driver.seeds.new}  # as a recording has them
    assert len(seeds) >= 11 and any(r.generated == 0 for s in seeds.values() for r in s.requests)
    for lane in driver.lanes:  # every request finished in the lane once, or was taken out by a re-seed
        assert lane.totals.finished + lane.dropped_unfinished == driver.released, lane.spec.label
    assert driver.open_requests() == 0
    folded = recorded_requests(events)
    assert not folded.dropped
    config = driver.config
    labels = [lane.spec.label for lane in driver.lanes]
    rolled = replay_rolling(folded.requests, seeds, config, SPECS, driver.workers, clock)
    last = min(windows.complete, rolled.windows.complete) - 1
    assert last >= 10
    assert _agree(windows, rolled.windows, labels, 0, last) >= 4 * 10
    for n in (3, 8):
        alone = replay_rolling(folded.requests, seeds, config, SPECS, driver.workers, clock, only=n)
        _agree(windows, alone.windows, ["actual", "jsq-bytes", "br0"], n, n)
