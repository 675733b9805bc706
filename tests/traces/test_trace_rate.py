"""Arrival-rate scaling and the capacity estimate."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from shadow.traces import (
    Trace,
    TraceRequest,
    at_load,
    estimate_capacity_rps,
    mean_slot_load_tokens,
    scale_rate,
    spread_ties,
    synthetic_workload,
)


def _trace(arrivals: list[float], prompt: int = 100, output: int = 11) -> Trace:
    requests = tuple(TraceRequest(t, prompt, output) for t in arrivals)
    return Trace(name="t", requests=requests, source="test", synthetic=False)


def test_scale_rate() -> None:
    trace = _trace([0.0, 1.0, 3.0, 10.0])
    fast = scale_rate(trace, 2.0)
    assert [r.arrival_s for r in fast.requests] == [0.0, 0.5, 1.5, 5.0]
    assert fast.mean_rate_rps == pytest.approx(2 * trace.mean_rate_rps)
    assert "x2" in fast.notes
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            scale_rate(trace, bad)


@settings(max_examples=80, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=1, max_size=40).filter(
        lambda g: sum(g) > 1e-3
    ),
    rho=st.floats(min_value=0.05, max_value=3.0),
    capacity=st.floats(min_value=0.01, max_value=1e4),
)
def test_at_load_hits_the_requested_rate(gaps: list[float], rho: float, capacity: float) -> None:
    trace = _trace(np.concatenate(([0.0], np.cumsum(gaps))).tolist())
    loaded = at_load(trace, rho, capacity)
    assert loaded.mean_rate_rps == pytest.approx(rho * capacity, rel=1e-9)
    assert [r.prompt_tokens for r in loaded.requests] == [r.prompt_tokens for r in trace.requests]


def test_at_load_on_a_workload() -> None:
    trace = synthetic_workload("paper-azure", n=2000)
    capacity = estimate_capacity_rps(trace, workers=8, slots=64, step_a=1.2e-7, step_b=0.02)
    loaded = at_load(trace, 1.05, capacity)
    assert loaded.mean_rate_rps == pytest.approx(1.05 * capacity)
    assert loaded.synthetic and "rho=1.05" in loaded.notes
    with pytest.raises(ValueError):
        at_load(_trace([0.0, 0.0]), 1.0, 5.0)
    with pytest.raises(ValueError):
        at_load(trace, 0.0, 5.0)


def test_capacity_formula() -> None:
    # Constant lengths s=100, o=11: a busy slot averages s + (o - 1)/2 = 105 tokens.
    trace = _trace([0.0, 1.0])
    assert mean_slot_load_tokens(trace) == pytest.approx(105.0)
    capacity = estimate_capacity_rps(trace, workers=4, slots=8, step_a=1e-3, step_b=0.01)
    step = 1e-3 * 8 * 105.0 + 0.01
    assert capacity == pytest.approx(4 * 8 / (11 * step))
    assert (
        estimate_capacity_rps(trace, workers=4, slots=8, step_a=1e-3, step_b=0.01, imbalance=1.2) < capacity
    )
    # Mixed lengths: long requests hold their slot longer, so they weigh more.
    mixed = Trace(
        name="m",
        requests=(TraceRequest(0.0, 10, 1), TraceRequest(1.0, 1000, 101)),
        source="s",
        synthetic=False,
    )
    assert mean_slot_load_tokens(mixed) == pytest.approx((1 * 10 + 101 * (1000 + 50)) / 102)
    for kwargs in (
        {"workers": 0},
        {"slots": 0},
        {"step_a": -1.0},
        {"imbalance": 0.5},
        {"step_a": 0.0, "step_b": 0.0},
    ):
        args = {"workers": 2, "slots": 2, "step_a": 1e-3, "step_b": 0.01, **kwargs}
        with pytest.raises(ValueError):
            estimate_capacity_rps(trace, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        estimate_capacity_rps(trace.limit(0), workers=1, slots=1, step_a=1.0, step_b=0.0)


def test_spread_ties() -> None:
    trace = _trace([0.0, 0.0, 0.0, 1.0, 5.0, 5.0])
    spread = spread_ties(trace, 3.0)
    assert [r.arrival_s for r in spread.requests] == [0.0, 1 / 3, 2 / 3, 1.0, 5.0, 6.5]
    assert spread_ties(trace.limit(0), 3.0) is not None
