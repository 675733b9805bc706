"""The live driver's edges, event by event: what it refuses, counts and drops, when it releases a
request to the lanes and with what, the mirrored loads of odd requests, and that finished requests
leave every table (bounded memory). Small, fast and bounded: each test is a handful of events."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from shadow.contracts.events import Arrive, Cancel, Finish, Route, Step, Token
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import Observer
from shadow.engine.feed import RequestFolder
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.live import LiveDriver
from shadow.engine.summary import LogHistogram

CFG = EngineConfig(workers=2, slots=4, step=StepTimeModel(a=1e-3, b=0.01))
NAMES = ["d0", "d1"]


def _driver(lag_s: float = 0.0, **kw: object) -> LiveDriver:
    return LiveDriver(CFG, [LaneSpec("br0")], NAMES, time.perf_counter, lag_s=lag_s, **kw)  # type: ignore[arg-type]


class _Recorder(Observer):
    """Every offer and every step the driver makes, by lane label."""

    def __init__(self) -> None:
        self.offers: list[tuple[str, Job]] = []
        self.steps: list[tuple[str, int]] = []

    def offering(self, lane: Lane, job: Job) -> None:
        self.offers.append((lane.spec.label, job))

    def stepped(self, lane: Lane) -> None:
        self.steps.append((lane.spec.label, lane.k))


def _offers(d: LiveDriver) -> list[tuple[str, Job]]:
    seen = _Recorder()
    d.observe(seen)
    return seen.offers


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="config has 2 workers but 3 are named"):
        LiveDriver(CFG, [], ["a", "b", "c"], time.perf_counter)
    with pytest.raises(ValueError, match=r"lag must be >= 0 s, got -0.5"):
        LiveDriver(CFG, [], NAMES, time.perf_counter, lag_s=-0.5)
    with pytest.raises(ValueError, match="lane labels must be unique"):
        LiveDriver(CFG, [LaneSpec("jsq"), LaneSpec("jsq")], NAMES, time.perf_counter)


def test_lanes_are_the_actual_one_then_the_specs_unless_told_otherwise() -> None:
    d = _driver()
    assert [lane.spec.label for lane in d.lanes] == ["actual", "br0"]
    assert d.workers == NAMES and d.config is CFG
    d2 = LiveDriver(CFG, [LaneSpec("br0")], NAMES, time.perf_counter, actual=False)
    assert [lane.spec.label for lane in d2.lanes] == ["br0"]
    for lane in d.lanes:  # streaming samples are bounded histograms, not growing lists
        for sink in (lane.totals.ttft_s, lane.totals.tpot_s, lane.totals.wait_s, lane.totals.decision_s):
            assert isinstance(sink, LogHistogram)


def test_the_default_lag_is_two_seconds_of_event_time() -> None:
    d = LiveDriver(CFG, [LaneSpec("br0")], NAMES, time.perf_counter)
    d.apply(Arrive("a", 10.0, 50))
    d.apply(Route("a", 10.0, "d0", 50))
    d.apply(Token("a", 10.1, 1))
    d.advance_to(11.9)  # horizon 9.9: "a" (placed at 10) is not released yet
    assert d.released == 0 and d.horizon == pytest.approx(9.9)
    d.advance_to(12.0)
    assert d.released == 1 and d.horizon == pytest.approx(10.0)
    d.advance_to(11.0)  # the horizon never moves back
    assert d.horizon == pytest.approx(10.0)


def test_a_request_is_released_once_placed_sized_and_old_enough_in_arrival_order() -> None:
    d = _driver(lag_s=1.0)
    offers = _offers(d)
    d.apply(Route("r", 5.0, "d1"))  # placed, size unknown: not queued (no crash, nothing placed)
    assert d.mirror_placed == [0.0, 0.0]
    d.apply(Token("r", 5.2, 1))  # not queued yet: nothing placed; not counted as a single-token gap
    assert d.mirror_placed == [0.0, 0.0]
    d.apply(Arrive("r", 4.0, 30, prompt_key="first"))
    d.apply(Arrive("r", 4.0, 99, prompt_key="second"))  # the first size and key count
    assert d.mirror_placed == [0.0, 31.0]  # prompt + the token already streamed
    for rid in ("c", "a", "b"):  # same placement time: released in the order they were placed
        d.apply(Arrive(rid, 5.0, 1, prompt_key=rid))
        d.apply(Route(rid, 5.0, "d0"))
    d.advance_to(5.5)
    assert d.released == 0
    d.advance_to(6.0)
    assert d.released == 4 and d.late == 0 and d.origin == 5.0
    jobs = [job for label, job in offers if label == "actual"]
    assert [j.request_id for j in jobs] == ["r", "c", "a", "b"]
    assert [(j.arrival_s, j.prompt_tokens, j.prompt_key) for j in jobs] == [
        (0.0, 30, "first"),
        (0.0, 1, "c"),
        (0.0, 1, "a"),
        (0.0, 1, "b"),
    ]
    assert [job for label, job in offers if label == "br0"] == jobs


def test_a_late_placement_is_released_and_counted_late_and_an_equal_one_is_not() -> None:
    d = _driver()
    d.apply(Arrive("b", 6.0, 10))
    d.apply(Route("b", 6.0, "d0"))
    d.advance_to(6.0)
    d.apply(Arrive("a", 5.0, 10))
    d.apply(Route("a", 5.0, "d1"))  # placed before b, learnt after b was released
    d.apply(Arrive("c", 6.0, 10))
    d.apply(Route("c", 6.0, "d1"))  # placed at the same time as b: not late
    d.advance_to(7.0)
    assert d.released == 3 and d.late == 1 and d.last_release == 6.0


def test_prompt_sizes_below_one_token_are_offered_as_one() -> None:
    d = _driver()
    offers = _offers(d)
    for rid, size in (("z", 0), ("o", 1)):
        d.apply(Arrive(rid, 1.0, size))
        d.apply(Route(rid, 1.0, "d0"))
    d.advance_to(1.0)
    assert [(job.request_id, job.prompt_tokens) for _, job in offers[:2]] == [("z", 1), ("o", 1)]


def test_counters_of_odd_input() -> None:
    d = _driver(max_requests=2)
    d.apply(Route("x", 1.0, "nope"))
    d.apply(Route("y", 1.0, "d9"))
    assert d.unknown_worker == 2
    d.apply(Finish("ghost", 1.0))
    d.apply(Cancel("ghost2", 1.0))
    assert d.dropped == {"end_before_start": 2}
    d.apply(Arrive("a", 1.0, 5))
    d.apply(Arrive("b", 1.0, 5))
    d.apply(Arrive("c", 1.0, 5))  # the table holds 2
    assert d.dropped == {"end_before_start": 2, "table_full": 1} and d.open_requests() == 2
    d.apply(Step(2.0, 0.03, "d1"))
    d.apply(Step(1.5, 0.02))
    d.apply(Step(1.6, 0.02, "d7", interval_s=0.025))
    assert d.steps == [(1, 2.0, 0.03, 0.03, None), (-1, 1.5, 0.02, 0.02, None), (-1, 1.6, 0.02, 0.025, None)]
    assert d.now == 2.0  # the newest event time; an older event does not move it back


def test_token_gaps_are_single_token_advances_including_one_at_time_zero() -> None:
    d = _driver()
    d.apply(Arrive("a", 0.0, 5))
    d.apply(Route("a", 0.0, "d0"))
    d.apply(Token("a", 0.0, 1))
    d.apply(Token("a", 0.1, 1))  # a repeat: no advance, changes nothing
    d.apply(Token("a", 0.25, 2))
    d.apply(Token("a", 0.5, 3))
    assert [x for xs in d.take_gaps() for x in xs] == [0.25, 0.25]
    assert d.mirror_loads == [8.0, 0.0] and d.mirror_placed == [8.0, 0.0]


def test_tokens_held_per_interval_keep_the_gaps_sum_and_take_the_step_ends_they_carry() -> None:
    # --token-interval: one Token per stream per interval, carrying the step ends the node found in
    # its chunks; the held Tokens' gaps are interval means (same sum, same count), the step ends are
    # the ones carried, and every count and load is kept
    held, plain = _driver(), _driver()
    held.table.stream_steps = False
    marked = [Token("a", 0.0, 1), Token("a", 0.5, 4, (0.2, 0.2))]
    plain_tokens = [Token("a", t, n) for t, n in ((0.0, 1), (0.2, 2), (0.4, 3), (0.5, 4))]
    for d, tokens in ((held, marked), (plain, plain_tokens)):
        d.apply(Arrive("a", 0.0, 5))
        d.apply(Route("a", 0.0, "d0"))
        for tok in tokens:
            d.apply(tok)
    held_gaps, plain_gaps = held.take_gaps(), plain.take_gaps()
    assert [len(xs) for xs in held_gaps] == [len(xs) for xs in plain_gaps] == [3, 0, 0]
    assert sum(held_gaps[0]) == pytest.approx(sum(plain_gaps[0])) == 0.5
    assert held.table.worker_gap_ends == [(0, 0.2, 0.2)]  # the carried one, not found in the held gaps
    assert len(plain.table.worker_gap_ends) == 3
    assert held.mirror_loads == plain.mirror_loads == [9.0, 0.0]
    assert held.end_of("a") == plain.end_of("a") == (4, None)


def test_taken_gaps_are_the_callers_a_numpy_view_of_them_leaves_the_fold_working() -> None:
    # the lanes view a window's gaps with numpy (no copy); a packed array exporting its buffer
    # cannot grow, so the driver must fold later tokens into new arrays
    d = _driver()
    d.apply(Arrive("a", 0.0, 5))
    d.apply(Route("a", 0.0, "d0"))
    d.apply(Token("a", 0.0, 1))
    d.apply(Token("a", 0.25, 2))
    views = [np.asarray(xs, dtype=np.float64) for xs in d.take_gaps()]
    d.apply(Token("a", 0.75, 3))
    d.apply(Token("a", 1.0, 5))  # two tokens at once: two gaps of half the time
    assert [v.tolist() for v in views] == [[0.25], [], []]
    assert [list(xs) for xs in d.take_gaps()] == [[0.5, 0.125, 0.125], [], []]
    assert d.dropped == {}


def test_a_zero_token_prompt_is_mirrored_as_its_generated_tokens_only() -> None:
    d = _driver()
    d.apply(Arrive("a", 0.0, 0))
    d.apply(Route("a", 0.0, "d1"))
    d.apply(Token("a", 0.1, 2))
    assert d.mirror_loads == [0.0, 2.0] and d.mirror_placed == [0.0, 2.0] and d.mirror_active == [0, 1]
    d.apply(Finish("a", 0.2, "stop", 2))
    assert d.mirror_loads == [0.0, 0.0] and d.mirror_placed == [0.0, 0.0] and d.mirror_active == [0, 0]


def test_an_end_before_the_first_token_leaves_the_running_counts_alone() -> None:
    d = _driver()
    d.apply(Arrive("a", 0.0, 10))
    d.apply(Route("a", 0.0, "d0"))
    d.advance_to(0.0)  # released: kept to the end even without tokens
    d.apply(Finish("a", 0.5, "abort", 0))
    assert d.mirror_active == [0, 0] and d.mirror_loads == [0.0, 0.0] and d.mirror_placed == [0.0, 0.0]
    assert d.dropped == {}
    d.drain()
    assert all(lane.totals.finished == 1 for lane in d.lanes) and d.open_requests() == 0


def test_one_token_ended_before_release_is_still_a_request_and_none_is_not() -> None:
    d = _driver(lag_s=10.0)
    for rid, gen in (("one", 1), ("none", 0)):
        d.apply(Arrive(rid, 0.0, 10))
        d.apply(Route(rid, 0.0, "d0"))
        if gen:
            d.apply(Token(rid, 0.1, gen))
        d.apply(Finish(rid, 0.2, "stop", gen))
    assert d.dropped == {"no_tokens": 1}
    d.drain()
    assert d.released == 1 and all(lane.totals.finished == 1 and lane.totals.tokens == 1 for lane in d.lanes)


def test_a_dropped_request_does_not_hold_back_later_releases() -> None:
    d = _driver()
    d.apply(Arrive("a", 1.0, 10))
    d.apply(Route("a", 1.0, "d0"))
    d.apply(Finish("a", 1.1, "abort", 0))  # dropped: no tokens, never released
    d.apply(Arrive("b", 2.0, 10))
    d.apply(Route("b", 2.0, "d0"))
    d.advance_to(2.0)  # one call releases b behind a's stale entry
    assert d.released == 1 and d.dropped == {"no_tokens": 1}


def test_on_step_sees_every_step_and_drain_leaves_the_lanes_at_their_last_step() -> None:
    d = _driver()
    recorder = _Recorder()
    d.observe(recorder)
    steps = recorder.steps
    d.apply(Arrive("a", 0.0, 1000))  # steps of about 1 s
    d.apply(Route("a", 0.0, "d0"))
    d.apply(Token("a", 0.0, 1))
    d.apply(Token("a", 0.5, 4))
    d.advance_to(10.0)  # runs the 3 steps known not to be the last, then holds
    assert [k for label, k in steps if label == "actual"] == [1, 2, 3]
    d.apply(Finish("a", 0.6, "stop", 4))
    d.drain()
    for lane in d.lanes:
        assert [k for label, k in steps if label == lane.spec.label] == [1, 2, 3, 4]
        assert lane.totals.finished == 1 and math.isfinite(lane.now) and lane.k == 4
        assert d.lag(lane) == 0.0  # caught up: the lanes are past the newest event
    assert d.open_requests() == 0 and d.assignment("a") is None  # every table is empty again


def test_every_late_release_is_counted() -> None:
    d = _driver()
    d.apply(Arrive("c", 9.0, 10))
    d.apply(Route("c", 9.0, "d0"))
    d.advance_to(9.0)
    for rid, t in (("a", 5.0), ("b", 6.0)):  # both placed before c, learnt after it was released
        d.apply(Arrive(rid, t, 10))
        d.apply(Route(rid, t, "d1"))
    d.advance_to(10.0)
    assert d.released == 3 and d.late == 2


def test_a_route_alone_can_size_the_request() -> None:
    # No Arrive: the Route's prompt size makes the request releasable (offered with that size).
    d = _driver()
    offers = _offers(d)
    d.apply(Route("r", 1.0, "d0", prompt_tokens=7))
    d.advance_to(1.0)
    assert d.released == 1 and [(job.request_id, job.prompt_tokens) for _, job in offers][:1] == [("r", 7)]


def test_an_unsized_routed_request_leaves_no_mirrored_load_behind() -> None:
    # Routed to d0 but never sized (not queued): its tokens and its Finish's extra tokens move no
    # placed load, and what it held as a running stream is released at its end.
    d = _driver()
    d.apply(Route("u", 1.0, "d0"))
    d.apply(Token("u", 1.1, 2))
    d.apply(Finish("u", 1.2, "stop", 5))
    assert d.mirror_placed == [0.0, 0.0] and d.mirror_loads == [0.0, 0.0] and d.mirror_active == [0, 0]


def test_a_placed_request_ended_before_its_first_token_leaves_no_running_load() -> None:
    # Sized and placed (queued) but no Token seen: the Finish's tokens count in the placed load
    # until the end, never in the running (KV) load.
    d = _driver()
    d.apply(Arrive("q", 1.0, 10))
    d.apply(Route("q", 1.0, "d1"))
    assert d.mirror_placed == [0.0, 10.0]
    d.apply(Finish("q", 1.5, "stop", 3))
    assert d.mirror_loads == [0.0, 0.0] and d.mirror_active == [0, 0] and d.mirror_placed == [0.0, 0.0]


def test_the_table_bounds_default_to_a_million_open_requests() -> None:
    assert _driver().max_requests == 1_000_000
    assert RequestFolder().max_open == 1_000_000
