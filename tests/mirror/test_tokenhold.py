"""The Token hold (`--token-interval`): one Token per stream per interval of event time, in an
order that is a function of the events alone, and the mirrored state the same once released."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.contracts.events import MAX_STEP_ENDS, Event, Finish, Route, Token, from_dict
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.live import LiveDriver
from shadow.mirror.api import MAX_LINE
from shadow.mirror.hub import HELD, Mirror, event_dict, event_line
from shadow.mirror.state import MirrorState
from shadow.mirror.tokenhold import TokenHold

IV = 0.5


def mirror(interval: float) -> tuple[Mirror, list[Event]]:
    seen: list[Event] = []
    return Mirror(MirrorState(["d0", "d1"]), listeners=[seen.append], token_interval_s=interval), seen


def test_a_streams_tokens_in_one_interval_go_out_as_its_last_one_when_time_leaves_it() -> None:
    m, seen = mirror(IV)
    m.emit(Route("a", 0.0, "d0", 10), "tap", 0.0)
    m.emit(Route("p", 0.0, "d0", 10), "tap", 0.0)  # a stream whose chunks end d0's steps
    for rid in "pa":  # a stream's first Token goes out at once (the request runs, its gaps start)
        assert m.emit(Token(rid, 0.05, 1), "tap", 0.05) != HELD
    for i, t in enumerate((0.1, 0.2, 0.3), start=2):
        # p's chunk of the step comes first and ends the step; a's is of the same step
        assert m.emit(Token("p", t, i), "tap", t) == HELD
        assert m.emit(Token("a", t, i), "tap", t) == HELD
    assert seen[2:] == [Token("p", 0.05, 1), Token("a", 0.05, 1)]
    m.tick(0.49)  # still inside [0, 0.5)
    assert len(seen) == 4
    m.emit(Route("b", 0.6, "d1", 5), "tap", 0.6)  # the first event past the interval
    p_ends = (0.1, 0.1 - 0.05, 0.2, 0.2 - 0.1, 0.3, 0.3 - 0.2)  # (t, per-token gap) of each step end
    assert seen[4:] == [Token("p", 0.3, 4, p_ends), Token("a", 0.3, 4), Route("b", 0.6, "d1", 5)]
    assert m.hold is not None and m.hold.coalesced == 4
    assert m.state.workers["d0"].kv_tokens == 28


def test_a_lone_streams_chunks_each_end_a_step_and_go_out_with_its_held_token() -> None:
    m, seen = mirror(IV)
    m.emit(Route("a", 0.0, "d0", 10), "tap", 0.0)
    assert m.emit(Token("a", 0.1, 1), "tap", 0.1) != HELD
    assert m.emit(Token("a", 0.2, 2), "tap", 0.2) == HELD
    assert m.emit(Token("a", 0.4, 4), "tap", 0.4) == HELD  # two tokens: half the span each
    m.emit(Finish("a", 0.45, "stop", 4), "tap", 0.45)  # the end takes the held Token out first
    assert seen[1:] == [Token("a", 0.1, 1), Token("a", 0.4, 4, (0.2, 0.2 - 0.1, 0.4, (0.4 - 0.2) / 2)),
                        Finish("a", 0.45, "stop", 4)]


def test_a_stream_with_the_most_step_ends_a_token_carries_goes_out_at_once() -> None:
    m, seen = mirror(1e6)  # an interval no test reaches: only the cap lets the Token go
    m.emit(Route("a", 0.0, "d0", 10), "tap", 0.0)
    m.emit(Token("a", 0.0, 1), "tap", 0.0)
    outcomes = [m.emit(Token("a", 0.01 * i, i + 1), "tap", 0.01 * i) for i in range(1, MAX_STEP_ENDS + 2)]
    assert outcomes.count(HELD) == MAX_STEP_ENDS  # the last end filled the Token: it went out
    out = [e for e in seen if isinstance(e, Token)]
    assert len(out) == 2 and out[1].generated == MAX_STEP_ENDS + 1
    assert out[1].step_ends is not None and len(out[1].step_ends) == 2 * MAX_STEP_ENDS
    assert from_dict(event_dict(out[1])) == out[1]  # (the event API takes it)
    assert m.hold is not None and (m.hold.full, m.hold.step_ends) == (1, MAX_STEP_ENDS + 1)  # (counted)


def _three_on_d0(m: Mirror) -> None:
    """a, b, c on d0, each past its first Token; at 0.1 a's chunk ends the step, b's and c's are of
    the same step: all three held."""
    for rid in "abc":
        m.emit(Route(rid, 0.0, "d0", 10), "tap", 0.0)
        m.emit(Token(rid, 0.05, 1), "tap", 0.05)
    for rid in "abc":
        m.emit(Token(rid, 0.1, 2), "tap", 0.1)


def test_an_end_takes_its_streams_held_token_out_first_and_the_clock_releases_a_quiet_one() -> None:
    m, seen = mirror(IV)
    _three_on_d0(m)
    assert m.hold is not None and len(m.hold) == 3
    n = len(seen)
    m.emit(Finish("b", 0.2, "stop", 2), "tap", 0.2)
    assert seen[n:] == [Token("b", 0.1, 2), Finish("b", 0.2, "stop", 2)]
    m.tick(0.5)  # nothing came past the interval but the clock: a's and c's Tokens go out
    assert seen[n + 2:] == [Token("a", 0.1, 2, (0.1, 0.1 - 0.05)), Token("c", 0.1, 2)]


def test_an_api_event_from_far_ahead_does_not_hold_the_taps_tokens_back() -> None:
    # a poster's clock (or a hostile one) must not move the intervals: only the taps' times do
    m, seen = mirror(IV)
    _three_on_d0(m)
    m.emit(Route("x", 1e9, "d1", 1), "api", 0.0)  # dropped as out of bounds, and moves nothing
    m.tick(0.49)
    assert m.hold is not None and len(m.hold) == 3
    m.emit(Route("y", 0.6, "d1", 1), "tap", 0.6)  # the next interval: the held Tokens go out
    assert [e.request_id for e in seen if isinstance(e, Token)][-3:] == ["a", "b", "c"]
    assert len(m.hold) == 0


def test_the_interval_must_be_positive() -> None:
    for bad in (0.0, -1.0, float("nan")):
        try:
            TokenHold(bad)
        except ValueError:
            continue
        raise AssertionError(f"TokenHold({bad}) accepted")


@st.composite
def soups(draw: st.DrawFn) -> list[Event]:
    """Streams on two workers: a Route, Tokens counting up, maybe an end; their events interleaved,
    times rising with small steps back (events of one batch are not in time order)."""
    events: list[Event] = []
    t = 0.0
    n = draw(st.integers(1, 6))
    gen = dict.fromkeys(range(n), 0)
    routed: set[int] = set()
    ended: set[int] = set()
    for _ in range(draw(st.integers(1, 80))):
        t = max(0.0, t + draw(st.floats(-0.05, 0.3)))
        i = draw(st.integers(0, n - 1))
        rid = f"r{i}"
        if i in ended:
            continue
        if i not in routed:
            routed.add(i)
            events.append(Route(rid, t, f"d{i % 2}", 5 + i))
            continue
        if draw(st.integers(0, 9)) == 0:
            ended.add(i)
            events.append(Finish(rid, t, "stop", gen[i]))
            continue
        gen[i] += draw(st.integers(1, 3))
        events.append(Token(rid, t, gen[i]))
    return events


@given(soups())
@settings(max_examples=300, deadline=None)
def test_any_soup_keeps_each_requests_order_its_counts_at_every_other_event_and_the_end_state(
    events: list[Event],
) -> None:
    plain, _ = mirror(0.0)
    held, seen = mirror(IV)
    hold = held.hold
    assert hold is not None
    hw = float("-inf")  # the latest interval an event fell in
    interval_of: dict[int, float] = {}  # id of a Token in: the high-water interval when it came
    for ev in events:
        hw = max(hw, ev.t // IV)
        interval_of[id(ev)] = hw
        plain.emit(ev, "tap", ev.t)
        held.emit(ev, "tap", ev.t)
        # nothing is held from an interval the events have left
        assert all(interval_of[id(tok)] == hw for tok, _ in hold._pending.values())
    held.release_held()
    # every event but the Tokens passed on one to one, in the order they came
    assert [e for e in seen if not isinstance(e, Token)] == [e for e in events if not isinstance(e, Token)]
    # each request: its Tokens out are some of its Tokens in, in their order, ending with its last
    # one; and before each of its other events, the count it had then
    for rid in {getattr(e, "request_id", "") for e in events}:
        mine_in = [e for e in events if e.request_id == rid]  # type: ignore[attr-defined]
        mine_out = [e for e in seen if e.request_id == rid]  # type: ignore[attr-defined]
        toks_in = [e for e in mine_in if isinstance(e, Token)]
        # (a Token with step ends: the same chunk)
        toks_out = [Token(e.request_id, e.t, e.generated) for e in mine_out if isinstance(e, Token)]
        assert all(e in toks_in for e in toks_out)
        assert [toks_in.index(e) for e in toks_out] == sorted(toks_in.index(e) for e in toks_out)
        if toks_in:
            assert toks_out[-1] == toks_in[-1]

        def counts(seq: list[Event]) -> list[int]:
            out, c = [], 0
            for e in seq:
                if isinstance(e, Token):
                    c = e.generated
                else:
                    out.append(c)
            return out

        assert counts(mine_out) == counts(mine_in)
    assert held.state.snapshot(1e9)["workers"] == plain.state.snapshot(1e9)["workers"]


def _fed(events: list[Event], *, held: bool) -> LiveDriver:
    """A live driver's request table fed the events as the hub passes them on (held or not)."""
    m, seen = mirror(IV if held else 0.0)
    for ev in events:
        m.emit(ev, "tap", ev.t)
    m.release_held()
    d = LiveDriver(EngineConfig(workers=2, slots=4, step=StepTimeModel(a=1e-3, b=0.01)), [LaneSpec("br0")],
                   ["d0", "d1"], lambda: 0.0)
    d.table.stream_steps = not held  # what `--token-interval` tells the lanes
    for ev in seen:
        d.apply(ev)
    return d


@given(soups())
@settings(max_examples=300, deadline=None)
def test_held_tokens_give_the_lanes_the_same_step_ends_and_per_worker_gap_sums_and_counts(
    events: list[Event],
) -> None:
    # what the step estimate takes from the streams survives the hold: every step end a worker made
    # (found per chunk at the node, carried by the held Tokens: by stream, not in time order), each
    # worker's per-token gaps (same count, same sum: a held Token spreads its span over its tokens),
    # and the mirrored loads
    plain, held = _fed(events, held=False), _fed(events, held=True)
    assert sorted(held.table.worker_gap_ends) == sorted(plain.table.worker_gap_ends)
    for xs, ys in zip(held.take_gaps(), plain.take_gaps(), strict=True):
        assert len(xs) == len(ys)
        assert math.isclose(sum(xs), sum(ys), rel_tol=1e-9, abs_tol=1e-9)
    assert held.mirror_loads == plain.mirror_loads and held.mirror_active == plain.mirror_active


def test_a_token_with_the_most_step_ends_fits_one_line_of_the_event_api() -> None:
    # the worst case: times of a long-running monotonic clock and gaps, each with all 17 digits
    ends = tuple(x for i in range(MAX_STEP_ENDS) for x in (1_234_567.0 + i / 3, 1 / 3 + 1e-9 * i))
    line = event_line(Token("x" * 256, 9_876_543.123456789, 2**21, ends))
    assert len(line.encode()) <= MAX_LINE
    assert from_dict(json.loads(line)).step_ends == ends  # (JSON keeps every float exactly)
