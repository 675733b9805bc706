"""Every bad input gives a one-line TraceError naming the file (and the line, when there is one)."""

from __future__ import annotations

import gzip
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from shadow.contracts.events import MAX_REQUEST_TOKENS
from shadow.traces import DEFAULT_LIMITS, FORMATS, TraceError, TraceLimits, load_trace, resolve

AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
MC_ROW = '{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n'
GJ_ROW = '{"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 3}\n'
GC_HEAD = "arrival_s,prompt_tokens,output_tokens,prompt_key\n"

# (file name, content, line the error must name, a fragment of the message)
LINE_CASES = [
    ("az_missing_col.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,3\n", 1, "GeneratedTokens"),
    ("az_zero.csv", AZ_HEAD + AZ_ROW + "2023-11-16 18:15:47.0,12,0\n", 3, "GeneratedTokens must be >= 1"),
    ("az_negative.csv", AZ_HEAD + "2023-11-16 18:15:47.0,-4,3\n", 2, "ContextTokens must be >= 1"),
    ("az_text.csv", AZ_HEAD + AZ_ROW + AZ_ROW.replace("44", "many"), 3, "GeneratedTokens is not a number"),
    ("az_fraction.csv", AZ_HEAD + "2023-11-16 18:15:47.0,12.5,3\n", 2, "whole number"),
    ("az_time.csv", AZ_HEAD + AZ_ROW + "yesterday,12,3\n", 3, "not a date-time"),
    ("az_short.csv", AZ_HEAD + AZ_ROW + "2023-11-16 18:15:47.0,12\n", 3, "expected 3 columns"),
    ("az_unsorted.csv", AZ_HEAD + AZ_ROW + "2023-11-16 18:15:45.0,12,3", 3, "back in time"),
    (
        "az_blank_lines.csv",
        "\n" + AZ_HEAD + "\n" + AZ_ROW + "\n" + "2023-11-16 18:15:47.0,1,x\n",
        6,
        "not a number",
    ),
    ("mc_json.jsonl", MC_ROW + '{"timestamp": 3, "input_length": 7\n', 2, "invalid JSON"),
    (
        "mc_missing.jsonl",
        MC_ROW + '{"timestamp": 3, "input_length": 7}\n',
        2,
        "missing field 'output_length'",
    ),
    ("mc_zero.jsonl", MC_ROW + MC_ROW.replace('"output_length": 5', '"output_length": 0'), 2, ">= 1"),
    ("mc_string.jsonl", MC_ROW.replace("700", '"700"'), 1, "input_length is not a number"),
    ("mc_unsorted.jsonl", MC_ROW.replace(": 0,", ": 3000,") + MC_ROW, 2, "back in time"),
    ("mc_hash.jsonl", MC_ROW + MC_ROW.replace("[0, 1]", '"ab"'), 2, "hash_ids must be a list"),
    ("gj_not_object.jsonl", GJ_ROW + "\n[1, 2]\n", 3, "expected a JSON object"),
    (
        "gj_missing.jsonl",
        GJ_ROW + '{"arrival_s": 1, "prompt_tokens": 3}\n',
        2,
        "missing field 'output_tokens'",
    ),
    ("gj_nan.jsonl", GJ_ROW + GJ_ROW.replace("0.5", "NaN"), 2, "arrival_s must be finite"),
    ("gj_bool.jsonl", GJ_ROW.replace("10", "true"), 1, "prompt_tokens is not a number"),
    ("gj_key.jsonl", GJ_ROW.replace("}", ', "prompt_key": ""}'), 1, "prompt_key"),
    ("gj_unsorted.jsonl", GJ_ROW + GJ_ROW.replace("0.5", "0.25"), 2, "back in time"),
    ("gc_missing.csv", "arrival_s,prompt_tokens\n0,1\n", 1, "output_tokens"),
    ("gc_negative.csv", GC_HEAD + "0,5,5,a\n1,5,-5,b\n", 3, "output_tokens must be >= 1"),
    ("gc_time.csv", GC_HEAD + "0,5,5,a\nsoon,5,5,b\n", 3, "arrival_s is not a number"),
    ("gc_unsorted.csv", GC_HEAD + "0,5,5,a\n2,5,5,b\n1,5,5,c\n", 4, "line 3"),
]


def _check(err: TraceError, path: Path, line: int | None) -> None:
    message = str(err)
    assert "\n" not in message and "\r" not in message
    assert message.startswith(str(path))
    if line is not None:
        assert message.startswith(f"{path}:{line}: "), message
        assert err.line == line
    assert err.path == str(path)


@pytest.mark.parametrize(("name", "content", "line", "fragment"), LINE_CASES)
def test_bad_rows_name_file_and_line(
    tmp_path: Path, name: str, content: str, line: int, fragment: str
) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    _check(info.value, path, line)
    assert fragment in str(info.value)


def test_unsorted_message_says_which_line_goes_back(tmp_path: Path) -> None:
    path = tmp_path / "u.csv"
    path.write_text(
        AZ_HEAD + AZ_ROW + "2023-11-16 18:15:47.0,5,5\n2023-11-16 18:15:46.0,5,5\n", encoding="utf-8"
    )
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4: ") and "18:15:46.0" in message and "at line 3" in message


@pytest.mark.parametrize(
    ("name", "content", "fmt", "fragment"),
    [
        ("empty.csv", "", None, "file is empty"),
        ("blank.jsonl", "\n\n  \n", None, "file is empty"),
        ("empty_mc.jsonl", "", "mooncake", "no requests"),
        ("empty_az.csv", "", "azure-csv", "file is empty"),
        ("header_only.csv", AZ_HEAD, None, "no requests"),
        ("header_only_generic.csv", GC_HEAD + "\n", None, "no requests"),
        ("fmt.csv", AZ_HEAD + AZ_ROW, "pcap", "unknown trace format"),
    ],
)
def test_file_level_errors(tmp_path: Path, name: str, content: str, fmt: str | None, fragment: str) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceError) as info:
        load_trace(path, fmt=fmt)
    _check(info.value, path, None)
    assert fragment in str(info.value)


def test_missing_file_directory_and_binary(tmp_path: Path) -> None:
    for path in (tmp_path / "nope.csv", tmp_path):
        with pytest.raises(TraceError) as info:
            load_trace(path)
        _check(info.value, path, None)
        assert "cannot open" in str(info.value)
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(TraceError) as info:
        load_trace(binary)
    _check(info.value, binary, None)
    bad_gzip = tmp_path / "cut.jsonl.gz"
    bad_gzip.write_bytes(gzip.compress(GJ_ROW.encode() * 50)[:40])
    with pytest.raises(TraceError) as info:
        load_trace(bad_gzip)
    _check(info.value, bad_gzip, None)


def test_wrong_explicit_format(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZ_HEAD + AZ_ROW, encoding="utf-8")
    with pytest.raises(TraceError) as info:
        load_trace(path, fmt="jsonl")
    _check(info.value, path, 1)
    with pytest.raises(TraceError) as info:
        load_trace(path, fmt="csv")
    _check(info.value, path, 1)


def test_resolve_unknown_spec_and_bad_limit(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not a synthetic workload"):
        resolve(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError):
        load_trace(tmp_path / "x.csv", limit=0)


LINES = [
    AZ_HEAD.strip(),
    AZ_ROW.strip(),
    "2023-11-16 18:15:40,5,5",
    MC_ROW.strip(),
    GJ_ROW.strip(),
    GC_HEAD.strip(),
    "0.5,10,3,k",
    "",
    "{",
    '{"timestamp": -1e999, "input_length": 1e400, "output_length": null}',
    '{"arrival_s": "0", "prompt_tokens": [], "output_tokens": {}}',
    "\ufeff,,,",
    # recordings, and lines beyond SMALL's limits
    '{"type": "session", "version": 2, "workers": ["a", "b", "c"]}',
    '{"type": "request", "request_id": "r", "arrival_t": 1, "prompt_tokens": 5, "output_tokens": 3}',
    '{"type": "request", "request_id": "s", "arrival_t": 2, "prompt_tokens": 5, "output_tokens": 9999999}',
    '{"type": "seed", "window": 7, "t": 1, "origin": 0, "window_s": 0.1, "requests": []}',
    "x" * 80,
    " ",
]
SMALL = TraceLimits(max_lines=12, max_line_chars=64, max_blank_lines=2, max_gzip_ratio=4.0,
                    gzip_ratio_after=64, max_workers=2, max_fleet_slots=8, max_lanes=2, max_windows=3)


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(st.one_of(st.sampled_from(LINES), st.text(max_size=30)), max_size=14),
    fmt=st.sampled_from([None, *FORMATS]),
    gz=st.booleans(),
    limits=st.sampled_from([DEFAULT_LIMITS, SMALL]),
)
def test_loader_never_raises_anything_but_trace_error(
    lines: list[str], fmt: str | None, gz: bool, limits: TraceLimits
) -> None:
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.txt"
        path.write_bytes(gzip.compress(data) if gz else data)
        try:
            trace = load_trace(path, fmt=fmt, limits=limits)
        except TraceError as err:
            _check(err, path, err.line)
        else:
            assert len(trace) >= 1 and trace.requests[0].arrival_s == 0.0
            assert len(trace) <= limits.max_lines
            assert all(max(r.prompt_tokens, r.output_tokens) <= MAX_REQUEST_TOKENS for r in trace.requests)
            assert trace.workers is None or len(trace.workers) <= limits.max_workers
