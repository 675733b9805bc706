"""The send plan: ordering, offsets, time scaling, limits, mean rate."""

from __future__ import annotations

import pytest
from loadgen_helpers import make_trace

from shadow.loadgen import plan, trace_rate


def test_offsets_are_relative_to_first_arrival_and_scaled() -> None:
    trace = make_trace([(10.0, 5, 3, None), (11.0, 6, 4, "a"), (14.0, 7, 5, None)])
    p = plan(trace)
    assert [r.offset_s for r in p] == [0.0, 1.0, 4.0]
    assert [(r.index, r.prompt_tokens, r.output_tokens, r.prompt_key) for r in p] == [
        (0, 5, 3, None),
        (1, 6, 4, "a"),
        (2, 7, 5, None),
    ]
    assert [r.offset_s for r in plan(trace, time_scale=4.0)] == [0.0, 0.25, 1.0]


def test_limit_takes_the_first_arrivals() -> None:
    trace = make_trace([(float(i), 1, 1, None) for i in range(10)])
    assert len(plan(trace, limit=3)) == 3
    assert plan(trace, limit=0) == []
    with pytest.raises(ValueError):
        plan(trace, limit=-1)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_time_scale(scale: float) -> None:
    with pytest.raises(ValueError):
        plan(make_trace([(0.0, 1, 1, None)]), time_scale=scale)


def test_trace_rate() -> None:
    trace = make_trace([(float(i) * 0.5, 1, 1, None) for i in range(11)])  # 10 gaps over 5 s
    assert trace_rate(trace) == pytest.approx(2.0)
    assert trace_rate(trace, limit=3) == pytest.approx(2.0)
    assert trace_rate(make_trace([(1.0, 1, 1, None)])) == 0.0
