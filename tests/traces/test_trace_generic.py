"""Generic JSONL/CSV: writer -> loader round trip (hypothesis), detection, optional fields, gzip."""

from __future__ import annotations

import gzip
import io
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import given, settings

from shadow.contracts.events import MAX_REQUEST_TOKENS
from shadow.traces import Trace, TraceRequest, detect_format, load_trace, write_csv, write_jsonl

KEYS = st.one_of(st.none(), st.text(min_size=1, max_size=12))


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(min_value=1, max_value=30))
    gaps = draw(
        st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=n - 1, max_size=n - 1)
    )
    arrivals = [0.0]
    for gap in gaps:
        arrivals.append(arrivals[-1] + gap)
    requests = tuple(
        TraceRequest(
            t,
            draw(st.integers(min_value=1, max_value=MAX_REQUEST_TOKENS)),
            draw(st.integers(min_value=1, max_value=MAX_REQUEST_TOKENS)),
            draw(KEYS),
        )
        for t in arrivals
    )
    return Trace(name="roundtrip", requests=requests, source="hypothesis", synthetic=False)


def _roundtrip(trace: Trace, suffix: str) -> Trace:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"trace{suffix}"
        with open(path, "w", encoding="utf-8", newline="") as out:
            (write_jsonl if suffix == ".jsonl" else write_csv)(trace, out)
        assert detect_format(str(path)) == suffix[1:]
        return load_trace(path)


@settings(max_examples=60, deadline=None)
@given(traces())
def test_jsonl_roundtrip(trace: Trace) -> None:
    assert _roundtrip(trace, ".jsonl").requests == trace.requests


@settings(max_examples=60, deadline=None)
@given(traces())
def test_csv_roundtrip(trace: Trace) -> None:
    loaded = _roundtrip(trace, ".csv")
    assert loaded.requests == trace.requests
    assert loaded.name == "trace" and not loaded.synthetic


def test_arrivals_are_normalised_and_extras_ignored(tmp_path: Path) -> None:
    path = tmp_path / "shifted.jsonl"
    path.write_text(
        '{"arrival_s": 100.5, "prompt_tokens": 5, "output_tokens": 2.0, "prompt_key": 17, "x": 1}\n'
        "\n"
        '{"arrival_s": 101, "prompt_tokens": 6, "output_tokens": 3, "prompt_key": null}\n',
        encoding="utf-8",
    )
    trace = load_trace(path)
    assert trace.requests == (TraceRequest(0.0, 5, 2, "17"), TraceRequest(0.5, 6, 3, None))
    csv_path = tmp_path / "cols.csv"
    csv_path.write_text(
        "extra,Output_Tokens,arrival_s,prompt_tokens\nz,3,7.5,9\nz,4,8,1e1\n", encoding="utf-8"
    )
    assert load_trace(csv_path).requests == (TraceRequest(0.0, 9, 3), TraceRequest(0.5, 10, 4))


def test_gzip_and_limit(tmp_path: Path) -> None:
    rows = "".join(f'{{"arrival_s": {i}, "prompt_tokens": {i + 1}, "output_tokens": 1}}\n' for i in range(5))
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(rows.encode()))
    assert len(load_trace(path)) == 5
    limited = load_trace(path, limit=2)
    assert [r.prompt_tokens for r in limited.requests] == [1, 2] and "limit" in limited.notes


def test_writers_emit_documented_format() -> None:
    trace = Trace(
        name="w",
        requests=(TraceRequest(0.0, 3, 4, "k,1"), TraceRequest(0.1, 5, 6)),
        source="s",
        synthetic=False,
    )
    out = io.StringIO()
    write_csv(trace, out)
    assert out.getvalue() == 'arrival_s,prompt_tokens,output_tokens,prompt_key\n0.0,3,4,"k,1"\n0.1,5,6,""\n'
    out = io.StringIO()
    write_jsonl(trace, out)
    assert out.getvalue().splitlines()[1] == '{"arrival_s": 0.1, "prompt_tokens": 5, "output_tokens": 6}'
