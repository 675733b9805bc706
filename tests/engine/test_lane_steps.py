"""A lane stepped by hand, one decode step at a time, against hand-computed states; and the
progress a driver reports.

Every loop here is bounded (a fixed number of `step` calls), so an engine bug that would make a
driver loop forever (a step that never finishes anything, an idle step that claims it ran) fails
here at once with the state that went wrong, instead of hanging `run_lane`/`run_lanes`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable

import pytest

from shadow.core.baselines import BindState
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane, checked_step
from shadow.engine.offline import run_lanes
from shadow.engine.results import lane_result
from tests.engine.helpers import loads_from_slots, run_lane

# a = 1 s per token of the largest load, b = 0: a step lasts exactly max_g L_g seconds.
UNIT = StepTimeModel(a=1.0, b=0.0)


def _state(lane: Lane) -> dict[str, object]:
    return {
        "k": lane.k,
        "now": lane.now,
        "loads": list(lane.loads),
        "running": list(lane.running),
        "running_prompt": list(lane.running_prompt),
        "queued_tokens": list(lane.queued_tokens),
        "finished": lane.totals.finished,
    }


def test_a_binding_lane_step_by_step_matches_the_hand_computed_states() -> None:
    # Two workers, one slot each. A(s=10, o=2) -> w0; B(s=4, o=1) and C(s=5, o=1) -> w1 (C waits
    # in w1's queue). Step 0 at t=0: loads [10, 4], T=10; B ends. Step 1 at t=10: C admitted,
    # loads [11, 5], T=11; A and C end at t=21. Then nothing runs: step() is False, no time passes.
    a, b, c = Job("A", 0.0, 10, 2, "ka"), Job("B", 0.0, 4, 1, "kb"), Job("C", 0.0, 5, 1, "kc")
    config = EngineConfig(workers=2, slots=1, step=UNIT)
    lane = Lane(LaneSpec("forced"), config, time.perf_counter, forced={"A": 0, "B": 1, "C": 1})
    done: list[Hashable] = []
    lane.on_done = done.append
    for job in (a, b, c):
        lane.offer(job, 0.0)
    assert lane.queued_tokens == [10.0, 9.0] and lane.waiting == 3 and lane.active == 0
    assert _state(lane)["loads"] == [0.0, 0.0]

    assert lane.step() is True
    assert _state(lane) == {
        "k": 1,
        "now": 10.0,
        "loads": [11.0, 0.0],
        "running": [1, 0],
        "running_prompt": [10.0, 0.0],
        "queued_tokens": [0.0, 5.0],
        "finished": 1,
    }, "after step 0: A runs with 11 tokens on w0, B finished and released 4 + 1 on w1, C waits"
    assert done == ["B"] and lane.waiting == 1 and lane.active == 1
    assert lane.loads == loads_from_slots(lane)

    assert lane.step() is True
    assert _state(lane) == {
        "k": 2,
        "now": 21.0,
        "loads": [0.0, 0.0],
        "running": [0, 0],
        "running_prompt": [0.0, 0.0],
        "queued_tokens": [0.0, 0.0],
        "finished": 3,
    }, "after step 1: A and C finished and released everything"
    assert sorted(map(str, done)) == ["A", "B", "C"]

    for _ in range(3):  # idle: no step runs, the clock and the step count stay put
        assert lane.step() is False
    assert lane.k == 2 and lane.now == 21.0

    tt = lane.totals
    assert tt.steps == 2 and tt.busy_time_s == 21.0 and tt.sum_max == 21.0
    assert tt.sum_spread == (10 - 4) + (11 - 5)
    assert tt.sum_imbalance == (2 * 10 - 14) + (2 * 11 - 16)
    assert tt.sum_idle_s == tt.sum_imbalance  # a = 1
    assert tt.tokens == 4 and tt.first_arrival_s == 0.0 and tt.last_finish_s == 21.0
    assert sorted(tt.ttft_s) == [10.0, 10.0, 21.0]  # A and B get their first token at 10, C at 21
    assert sorted(tt.wait_s) == [0.0, 0.0, 10.0]  # C waited one 10 s step for w1's slot
    assert list(tt.tpot_s) == [11.0]  # only A has a second token: (21 - 10) / 1
    assert tt.trajectory_t == [] and tt.trajectory_loads == []  # not asked for (0 points)


def test_free_slots_seen_by_a_pool_router_follow_admissions_and_finishes() -> None:
    config = EngineConfig(workers=2, slots=2, step=UNIT)
    lane = Lane(LaneSpec("br0"), config, time.perf_counter)
    assert list(lane.snapshot().free_slots) == [2, 2]
    lane.offer(Job("x", 0.0, 8, 1), 0.0)
    lane.offer(Job("y", 0.0, 6, 3), 0.0)
    assert lane.waiting == 2 and lane.queued_tokens == [0.0, 0.0]  # a pool: nothing bound yet
    assert lane.step() is True
    view = lane.snapshot()
    assert sum(view.free_slots) == 3 and lane.totals.finished == 1  # x ended after one step
    assert list(view.prompt_loads or []) == [6.0 if r else 0.0 for r in lane.running]
    for _ in range(2):
        assert lane.step() is True
    assert lane.totals.finished == 2 and list(lane.snapshot().free_slots) == [2, 2]
    assert lane.step() is False and lane.loads == [0.0, 0.0] and lane.running_prompt == [0.0, 0.0]


def test_trajectory_is_recorded_only_when_asked() -> None:
    config = EngineConfig(workers=1, slots=1, step=UNIT, trajectory_points=5)
    lane = Lane(LaneSpec("rr"), config, time.perf_counter)
    lane.offer(Job(0, 0.0, 3, 2), 0.0)
    while checked_step(lane, 2):  # bounded: an engine bug fails here instead of hanging
        pass
    assert lane.totals.trajectory_t == [0.0, 3.0]
    assert lane.totals.trajectory_loads == [[3.0], [4.0]]


class Ends:
    """What the live driver tells a lane: (tokens generated so far, final length or None)."""

    def __init__(self) -> None:
        self.known: dict[Hashable, tuple[int, int | None]] = {}

    def end_of(self, request_id: Hashable) -> tuple[int, int | None]:
        return self.known[request_id]


def _live_lane(workers: int = 1, slots: int = 2) -> tuple[Lane, Ends]:
    ends = Ends()
    config = EngineConfig(workers=workers, slots=slots, step=UNIT)
    return Lane(LaneSpec("rr"), config, time.perf_counter, ends=ends), ends


def test_a_live_lane_holds_until_the_real_stream_tells_and_ends_where_it_ended() -> None:
    lane, ends = _live_lane()
    ends.known["x"] = (1, None)  # one token streamed, end not known
    lane.offer(Job("x", 0.0, 10, 999), 0.0)
    for _ in range(3):  # the first step may be the last: hold, counted once however often asked
        assert lane.step() is False
        assert lane.stalled and lane.totals.stalls == 1 and lane.k == 0 and lane.now == 0.0
    ends.known["x"] = (3, None)  # three tokens: steps 0 and 1 certainly do not end it
    assert lane.step() is True and not lane.stalled
    assert lane.step() is True and lane.k == 2 and lane.loads == [12.0]
    assert lane.step() is False and lane.stalled and lane.totals.stalls == 2  # step 2 unknown again
    ends.known["x"] = (3, 3)  # the stream ended with 3 tokens: it ends at step 2
    assert lane.step() is True
    assert lane.totals.finished == 1 and lane.loads == [0.0] and lane.running == [0]
    assert lane.totals.tokens == 3 and lane.now == 10.0 + 11.0 + 12.0
    assert lane.step() is False and not lane.stalled and lane.totals.stalls == 2


@pytest.mark.parametrize(
    ("known", "steps"),
    [((0, 0), 1), ((0, 1), 1), ((2, 5), 5), ((4, 4), 4), ((6, None), None)],
    ids=["zero-tokens-takes-one-step", "one", "final-above-streamed", "final-equal", "open"],
)
def test_a_live_lane_runs_a_request_for_its_real_length(
    known: tuple[int, int | None], steps: int | None
) -> None:
    # Known at admission: the request runs max(final, streamed, 1) steps. Still open with 6
    # streamed: it runs at least the 5 steps known not to be its last, then holds.
    lane, ends = _live_lane()
    ends.known["r"] = known
    lane.offer(Job("r", 0.0, 7, 1), 0.0)
    ran = 0
    for _ in range(10):
        if not lane.step():
            break
        ran += 1
    if steps is None:
        assert ran == 5 and lane.stalled and lane.totals.finished == 0 and lane.loads == [12.0]
    else:
        assert ran == steps and lane.totals.finished == 1 and lane.totals.tokens == steps
        assert lane.loads == [0.0] and not lane.stalled


def test_two_open_requests_are_resolved_in_the_order_their_ends_are_due() -> None:
    lane, ends = _live_lane(slots=2)
    ends.known["a"] = (2, None)
    ends.known["b"] = (4, None)
    lane.offer(Job("a", 0.0, 1, 1), 0.0)
    lane.offer(Job("b", 0.0, 1, 1), 0.0)
    assert lane.step() is True and lane.step() is False  # step 1 may be a's last
    ends.known["a"] = (2, 2)
    assert lane.step() is True and lane.totals.finished == 1  # a ends at step 1
    assert lane.step() is True and lane.step() is False  # b: step 3 unknown
    ends.known["b"] = (5, 5)
    for _ in range(2):
        assert lane.step() is True
    assert lane.totals.finished == 2 and lane.step() is False and lane.totals.stalls == 2


def test_a_forced_lane_needs_its_assignments() -> None:
    with pytest.raises(ValueError, match=r"^a forced lane needs its assignments$"):
        Lane(LaneSpec("forced"), EngineConfig(), time.perf_counter)


# -- drivers' progress ----------------------------------------------------------------------


def test_run_lane_reports_progress_every_2048_steps_and_at_the_end() -> None:
    # Two slots: J0 (2048 tokens) ends at step 2047 (k = 2048 after it), J1 (2049) one step later.
    jobs = [Job(0, 0.0, 1, 2048), Job(1, 0.0, 1, 2049)]
    lane = Lane(LaneSpec("rr"), EngineConfig(workers=1, slots=2, step=UNIT), time.perf_counter)
    calls: list[tuple[str, int, int]] = []
    run_lane(lane, jobs, [0.0, 0.0], progress=lambda *a: calls.append(a))
    assert calls == [("rr", 1, 2), ("rr", 2, 2)]


def test_run_lane_stops_at_max_steps_with_the_lane_named() -> None:
    lane = Lane(LaneSpec("jsq"), EngineConfig(workers=1, slots=1, step=UNIT), time.perf_counter)
    with pytest.raises(RuntimeError, match="lane jsq: gave up after 3 steps"):
        run_lane(lane, [Job(0, 0.0, 1, 5)], [0.0], max_steps=3)
    assert lane.k == 3
    lane = Lane(LaneSpec("jsq"), EngineConfig(workers=1, slots=1, step=UNIT), time.perf_counter)
    run_lane(lane, [Job(0, 0.0, 1, 5)], [0.0], max_steps=6)
    assert lane.totals.finished == 1 and lane.k == 5


def test_run_lane_jumps_an_idle_lane_to_the_next_ready_job() -> None:
    lane = Lane(LaneSpec("rr"), EngineConfig(workers=1, slots=1, step=UNIT), time.perf_counter)
    run_lane(lane, [Job(0, 0.0, 2, 1), Job(1, 0.5, 3, 1)], [0.0, 50.0])
    assert lane.totals.wait_s == [0.0, 0.0] and lane.totals.ttft_s == [2.0, 53.0 - 0.5]


@pytest.mark.parametrize("total", [None, 1000])
def test_run_lanes_reports_progress_every_500_offers_every_2048_steps_and_at_the_end(
    total: int | None,
) -> None:
    # 500 jobs at t=0 on one worker with 500 slots: 499 end after one step, the last (2049 tokens)
    # at step 2048; the 500th offer reports 0 finished, step 2048 reports 499, the end 500.
    jobs = [Job(i, 0.0, 1, 1) for i in range(499)] + [Job(499, 0.0, 1, 2049)]
    lane = Lane(LaneSpec("rr"), EngineConfig(workers=1, slots=500, step=UNIT), time.perf_counter)
    calls: list[tuple[str, int, int]] = []
    n = run_lanes(iter(jobs), [lane], progress=lambda *a: calls.append(a), total=total)
    t = total or 500
    assert n == 500
    assert calls == [("rr", 0, t), ("rr", 499, t), ("rr", 500, t)]


def test_run_lanes_delivers_a_job_ready_exactly_at_an_arrival_and_refuses_disorder() -> None:
    config = EngineConfig(workers=2, slots=1, step=UNIT)
    lanes = [Lane(LaneSpec(p), config, time.perf_counter) for p in ("rr", "jsq")]
    jobs = [Job(0, 0.0, 4, 3), Job(1, 0.0, 2, 1), Job(2, 7.0, 1, 1)]
    assert run_lanes(jobs, lanes) == 3
    # Steps end at 4 and 9 (then 15): job 2 (ready at 7) is offered at t=9. Round robin sends it
    # to w0, busy until 15 (waits 8 s); JSQ to the idle w1 (waits 2 s).
    rr, jsq = lanes
    assert rr.totals.finished == 3 and sorted(rr.totals.wait_s) == [0.0, 0.0, 8.0]
    assert jsq.totals.finished == 3 and sorted(jsq.totals.wait_s) == [0.0, 0.0, 2.0]
    with pytest.raises(ValueError, match="job 1 arrives before the previous one"):
        run_lanes([Job(0, 1.0, 1, 1), Job(1, 0.5, 1, 1)], lanes)


def _ticks() -> Callable[[], float]:
    """A clock that advances 1, 2, 3, ... s per reading: decisions timed by it take 1, 3, 5 ... s."""
    readings = itertools.accumulate(itertools.count())
    return lambda: float(next(readings))


def test_what_a_binding_router_sees_and_the_decision_times_of_the_injected_clock() -> None:
    config = EngineConfig(workers=2, slots=1, step=UNIT)
    lane = Lane(LaneSpec("forced"), config, _ticks(), forced={"A": 0, "B": 1, "C": 1})
    for job in (Job("A", 0.0, 10, 2), Job("B", 0.0, 4, 1), Job("C", 0.0, 5, 1)):
        lane.offer(job, 0.0)
    view = BindState.of(lane.snapshot())  # before any step: everything queued
    assert list(view.kv_tokens) == [10.0, 9.0] and list(view.outstanding) == [1, 2]
    assert list(view.outstanding_tokens) == [10.0, 9.0] and list(view.free_slots) == [1, 1]
    lane.step()  # A runs (11 tokens), B ended, C queued on w1
    view = BindState.of(lane.snapshot())
    assert list(view.kv_tokens) == [11.0, 5.0] and list(view.outstanding) == [1, 1]
    assert list(view.outstanding_tokens) == [10.0, 5.0] and list(view.free_slots) == [0, 1]
    assert list(lane.totals.decision_s) == [1.0, 3.0, 5.0]
    lane.step()
    res = lane_result(lane, 3, 0)
    assert res.decision_ms_p50 == pytest.approx(3e3) and res.decision_ms_p99 == pytest.approx(4.96e3)
    assert res.barrier_idle_fraction == pytest.approx(12 / 42)


def test_figures_of_a_single_short_step() -> None:
    # One step of 0.1 s (a = 0.01 s/token, loads [10, 4]): less than a second of worker time.
    config = EngineConfig(workers=2, slots=1, step=StepTimeModel(a=0.01, b=0.0))
    lane = Lane(LaneSpec("forced"), config, _ticks(), forced={"A": 0, "B": 1})
    lane.offer(Job("A", 0.0, 10, 1), 0.0)
    lane.offer(Job("B", 0.0, 4, 1), 0.0)
    assert lane.step() and not lane.step()
    res = lane_result(lane, 2, 0)
    assert res.steps == 1 and res.avg_imbalance_tokens == 6.0 and res.avg_spread_tokens == 6.0
    assert res.barrier_idle_fraction == pytest.approx(0.06 / 0.2)


def test_shedding_a_queue_releases_exactly_the_shed_prompts() -> None:
    config = EngineConfig(workers=1, slots=1, step=UNIT)
    lane = Lane(LaneSpec("jsq"), config, _ticks())
    for i, size in enumerate((7, 11, 13, 17)):
        lane.offer(Job(i, float(i), size, 2), float(i))
    assert lane.step() and lane.queued_tokens == [11.0 + 13.0 + 17.0]
    assert lane.shed_waiting(2.5) == 2 and lane.queued_tokens == [17.0]


def test_a_live_end_given_above_the_streamed_count_is_honoured() -> None:
    # EndSource contract: the final length is >= every earlier count, and may exceed the last one.
    lane, ends = _live_lane()
    ends.known["x"] = (1, None)
    lane.offer(Job("x", 0.0, 10, 1), 0.0)
    assert lane.step() is False
    ends.known["x"] = (2, 5)  # ended with 5 tokens, the last Token said 2
    ran = sum(1 for _ in range(8) if lane.step())
    assert ran == 5 and lane.totals.finished == 1 and lane.totals.tokens == 5


def test_a_live_end_of_one_token_learnt_at_the_first_step_takes_one_step() -> None:
    lane, ends = _live_lane()
    ends.known["x"] = (1, None)
    lane.offer(Job("x", 0.0, 10, 1), 0.0)
    assert lane.step() is False
    ends.known["x"] = (1, 1)
    assert lane.step() is True and lane.totals.finished == 1 and lane.step() is False


def test_a_live_lane_runs_exactly_up_to_the_last_step_known_not_to_end() -> None:
    # Two tokens streamed at the first step: step 0 emitted token 1 and token 2 exists, so step 0
    # is certainly not the last; step 1 (token 2) may be.
    lane, ends = _live_lane()
    ends.known["x"] = (1, None)
    lane.offer(Job("x", 0.0, 10, 1), 0.0)
    assert lane.step() is False
    ends.known["x"] = (2, None)
    assert lane.step() is True and lane.step() is False and lane.k == 1


def test_the_br_h_projection_inputs_age_and_count_down_between_refreshes() -> None:
    # BR-H (oracle: ĉ = min(remaining, H)) with H = 100, refreshed every 3 steps. X (s=10, o=5)
    # and Y (s=20, o=150) start at step 0, Z (s=30, o=4) at step 1; slots 0, 1, 2 in that order.
    # Between refreshes ĉ counts down one per step from its reference; a refresh re-predicts
    # from the true remaining steps (Y's stays capped at H).
    from shadow.core.params import BRParams

    config = EngineConfig(workers=1, slots=3, step=UNIT, br=BRParams(horizon=100), refresh_steps=3)
    lane = Lane(LaneSpec("brh", "oracle"), config, _ticks())
    lane.projection()  # the first look refreshes (nothing running): reference step 0
    lane.offer(Job("X", 0.0, 10, 5), 0.0)
    lane.offer(Job("Y", 0.0, 20, 150), 0.0)
    assert lane.step()
    lane.offer(Job("Z", 0.0, 30, 4), lane.now)
    assert lane.step() and lane.k == 2 and lane.active == 3

    def projection() -> tuple[list[int], list[float], list[float]]:
        workers, w, c = lane.projection()
        return workers.tolist(), w.tolist(), c.tolist()

    assert projection() == ([0, 0, 0], [12.0, 22.0, 31.0], [3.0, 98.0, 3.0])  # k=2: no refresh yet
    assert lane.step()
    assert projection() == ([0, 0, 0], [13.0, 23.0, 32.0], [2.0, 100.0, 2.0])  # k=3: refreshed
