"""Edges of the engine's small parts: the live histogram at its range limits, repeated drop
reasons are counted (not just flagged), and an event type that is not a string is refused."""

from __future__ import annotations

import pytest

from shadow.contracts.events import Arrive, Finish, Route, Token, from_dict
from shadow.engine.feed import RequestFolder, recorded_requests
from shadow.engine.summary import LogHistogram


def test_a_sample_above_a_day_is_reported_as_about_a_day() -> None:
    h = LogHistogram()
    h.append(1e6)  # ~11.6 days: beyond the top bucket's lower edge, kept in the top bucket
    p = h.percentile(50)
    assert p is not None and LogHistogram.HI <= p <= LogHistogram.HI * 1.0101
    assert h.cumulative((LogHistogram.HI * 2,)) == [1]


def test_a_sample_just_above_the_lowest_bound_is_not_counted_at_zero() -> None:
    h = LogHistogram()
    h.append(0.0)
    h.append(1.005e-6)  # in the first bucket above LO = 1 µs
    assert h.zeros == 1
    assert h.cumulative((LogHistogram.LO, 2e-6)) == [1, 2]


def test_repeated_drop_reasons_are_counted() -> None:
    events = [
        Arrive("a", 0.0, prompt_tokens=3),
        Finish("a", 0.1, generated=0),
        Arrive("b", 0.0, prompt_tokens=3),
        Finish("b", 0.2, generated=0),
    ]
    assert recorded_requests(events).dropped["no_tokens"] == 2
    folder = RequestFolder(max_open=1)
    for ev in (*events, Arrive("c", 1.0, 3), Route("d", 1.0, "d0"), Token("e", 1.0, 1)):
        folder.apply(ev)
    assert folder.dropped["no_tokens"] == 2 and folder.dropped["evicted"] == 2


def test_an_event_type_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown event type"):
        from_dict({"type": ["arrive"], "request_id": "a", "t": 0})
