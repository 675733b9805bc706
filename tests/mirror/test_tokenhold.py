"""The Token hold (`--token-interval`): one Token per stream per interval of event time, in an
order that is a function of the events alone, and the mirrored state the same once released."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.contracts.events import Event, Finish, Route, Token
from shadow.mirror.hub import HELD, Mirror
from shadow.mirror.state import MirrorState
from shadow.mirror.tokenhold import TokenHold

IV = 0.5


def mirror(interval: float) -> tuple[Mirror, list[Event]]:
    seen: list[Event] = []
    return Mirror(MirrorState(["d0", "d1"]), listeners=[seen.append], token_interval_s=interval), seen


def test_a_streams_tokens_in_one_interval_go_out_as_its_last_one_when_time_leaves_it() -> None:
    m, seen = mirror(IV)
    m.emit(Route("a", 0.0, "d0", 10), "tap", 0.0)
    for i, t in enumerate((0.1, 0.2, 0.3), start=1):
        assert m.emit(Token("a", t, i), "tap", t) == HELD
    assert seen == [Route("a", 0.0, "d0", 10)]
    m.tick(0.49)  # still inside [0, 0.5)
    assert len(seen) == 1
    m.emit(Route("b", 0.6, "d1", 5), "tap", 0.6)  # the first event past the interval
    assert seen[1:] == [Token("a", 0.3, 3), Route("b", 0.6, "d1", 5)]
    assert m.hold is not None and m.hold.coalesced == 2
    assert m.state.workers["d0"].kv_tokens == 13


def test_an_end_takes_its_streams_held_token_out_first_and_the_clock_releases_a_quiet_one() -> None:
    m, seen = mirror(IV)
    m.emit(Route("a", 0.0, "d0", 10), "tap", 0.0)
    m.emit(Route("b", 0.0, "d1", 10), "tap", 0.0)
    m.emit(Token("a", 0.1, 1), "tap", 0.1)
    m.emit(Token("b", 0.1, 1), "tap", 0.1)
    m.emit(Finish("a", 0.2, "stop", 2), "tap", 0.2)
    assert seen[2:] == [Token("a", 0.1, 1), Finish("a", 0.2, "stop", 2)]
    m.tick(0.5)  # nothing came past the interval but the clock: b's Token goes out
    assert seen[4:] == [Token("b", 0.1, 1)]


def test_api_tokens_are_not_held_and_no_interval_means_no_hold() -> None:
    m, _ = mirror(IV)
    m.emit(Route("a", 0.0, "d0", 10), "api", 0.0)
    assert m.emit(Token("a", 0.1, 1), "api", 0.1) != HELD
    plain, seen_plain = mirror(0.0)
    assert plain.hold is None
    plain.emit(Route("a", 0.0, "d0", 10), "tap", 0.0)
    assert plain.emit(Token("a", 0.1, 1), "tap", 0.1) != HELD and len(seen_plain) == 2


def test_an_api_event_from_far_ahead_does_not_hold_the_taps_tokens_back() -> None:
    # a poster's clock (or a hostile one) must not move the intervals: only the taps' times do
    m, seen = mirror(IV)
    m.emit(Route("a", 0.0, "d0", 10), "tap", 0.0)
    m.emit(Route("x", 1e9, "d1", 1), "api", 0.0)  # dropped as out of bounds, and moves nothing
    m.emit(Token("a", 0.1, 1), "tap", 0.1)
    m.emit(Token("a", 0.6, 2), "tap", 0.6)  # the next interval: the first one's Token goes out
    assert [e for e in seen if isinstance(e, Token)] == [Token("a", 0.1, 1)]
    m.tick(1.0)
    assert [e for e in seen if isinstance(e, Token)] == [Token("a", 0.1, 1), Token("a", 0.6, 2)]


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
        toks_out = [e for e in mine_out if isinstance(e, Token)]
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
