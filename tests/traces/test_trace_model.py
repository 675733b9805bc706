"""Trace data model: validation, helpers, limit, with_arrivals, prompt keys, TraceError format."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from shadow.traces import Trace, TraceError, TraceRequest
from shadow.traces.keys import block_key, ctx_prompt_key, hash_key, template_key


def _trace(arrivals: list[float], name: str = "t") -> Trace:
    requests = tuple(TraceRequest(t, 10 + i, 5 + i, f"k{i}") for i, t in enumerate(arrivals))
    return Trace(name=name, requests=requests, source="test", synthetic=False)


def test_request_coerces_numpy_scalars_and_validates() -> None:
    r = TraceRequest(np.float64(1.5), np.int64(7), np.int32(3))  # type: ignore[arg-type]
    assert type(r.arrival_s) is float and type(r.prompt_tokens) is int and type(r.output_tokens) is int
    assert TraceRequest(2, 1, 1).arrival_s == 2.0
    bad_calls: tuple[Callable[[], object], ...] = (
        lambda: TraceRequest(0.0, 0, 1),
        lambda: TraceRequest(0.0, 1, -2),
        lambda: TraceRequest(-1.0, 1, 1),
        lambda: TraceRequest(float("nan"), 1, 1),
        lambda: TraceRequest(0.0, 1, 1, ""),
    )
    for bad in bad_calls:
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError):
        TraceRequest(0.0, 1.5, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TraceRequest(0.0, True, 1)


def test_trace_helpers() -> None:
    trace = _trace([0.0, 1.0, 1.0, 4.0])
    assert len(trace) == 4
    assert trace.mean_prompt_tokens == pytest.approx(11.5)
    assert trace.mean_output_tokens == pytest.approx(6.5)
    assert trace.duration_s == 4.0
    assert trace.mean_rate_rps == pytest.approx(3 / 4)
    cols = trace.arrays()
    assert cols["arrival_s"].dtype == np.float64 and cols["prompt_tokens"].dtype == np.int64
    assert cols["output_tokens"].dtype == np.int64
    assert cols["prompt_tokens"].tolist() == [10, 11, 12, 13]
    assert "requests=<4>" in repr(trace)
    empty = Trace(name="e", requests=(), source="s", synthetic=True)
    assert (len(empty), empty.mean_prompt_tokens, empty.duration_s, empty.mean_rate_rps) == (0, 0.0, 0.0, 0.0)


def test_trace_rejects_unsorted_and_converts_lists() -> None:
    with pytest.raises(ValueError, match="sorted"):
        _trace([0.0, 2.0, 1.0])
    trace = Trace(name="t", requests=[TraceRequest(0.0, 1, 1)], source="s", synthetic=False)  # type: ignore[arg-type]
    assert isinstance(trace.requests, tuple)


def test_limit() -> None:
    trace = _trace([0.0, 1.0, 2.0])
    assert trace.limit(None) is trace and trace.limit(5) is trace
    two = trace.limit(2)
    assert [r.prompt_tokens for r in two.requests] == [10, 11]
    assert "first 2 of 3" in two.notes
    assert len(trace.limit(0)) == 0
    with pytest.raises(ValueError):
        trace.limit(-1)


def test_with_arrivals_sorts_stably_and_validates() -> None:
    trace = _trace([0.0, 1.0, 2.0, 3.0])
    moved = trace.with_arrivals([5.0, 1.0, 5.0, 0.0], note="moved")
    assert [r.prompt_key for r in moved.requests] == ["k3", "k1", "k0", "k2"]
    assert [r.arrival_s for r in moved.requests] == [0.0, 1.0, 5.0, 5.0]
    assert moved.notes.endswith("moved") and moved.name == trace.name
    with pytest.raises(ValueError):
        trace.with_arrivals([0.0, 1.0])
    with pytest.raises(ValueError):
        trace.with_arrivals([0.0, 1.0, float("inf"), 2.0])
    with pytest.raises(ValueError):
        trace.with_arrivals([0.0, 1.0, -1.0, 2.0])


def test_prompt_keys_are_short_stable_hashes() -> None:
    assert len(hash_key("x")) == 16 and int(hash_key("x"), 16) >= 0
    assert ctx_prompt_key(512) == hash_key("ctx-512") != ctx_prompt_key(513)
    assert block_key([0, 1, 2]) == block_key((0, 1, 2)) != block_key([0, 1])
    assert block_key([1, 23]) != block_key([12, 3])
    assert template_key(3) == hash_key("template-3")


def test_trace_error_is_one_line() -> None:
    err = TraceError.at("f.csv", 7, "bad\nthing")
    assert str(err) == "f.csv:7: bad thing"
    assert (err.path, err.line, err.what) == ("f.csv", 7, "bad thing")
    assert str(TraceError.at("f.csv", None, "empty")) == "f.csv: empty"
    assert isinstance(err, ValueError)
