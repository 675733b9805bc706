"""Every size a trace or recording claims is bounded before use (`TraceLimits`, issue #37 D4): each
limit ends the read with a one-line TraceError naming the value, the limit, the file and the line;
the values at a limit still load. Small limits here (test_trace_errors fuzzes the loaders within
them too); `tests/cli/test_replay_inputs.py` replays the defaults' reproductions."""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from shadow.contracts.events import MAX_REQUEST_TOKENS
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.settings import LaneSettings
from shadow.mirror.bounds import EventBounds
from shadow.mirror.config import MirrorConfig
from shadow.traces import TraceError, TraceLimits, load_trace

ROW = '{"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 3}\n'
HEADER = {"type": "session", "version": 2, "workers": ["d0", "d1"], "slots": None}


def _request(i: int, **kw: Any) -> dict[str, Any]:
    return {"type": "request", "request_id": f"r{i}", "arrival_t": float(i), "prompt_tokens": 5,
            "output_tokens": 3, "worker": f"d{i % 2}", **kw}


def _ndjson(path: Path, *objs: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def _fails(path: Path, limits: TraceLimits, line: int | None, what: str) -> None:
    with pytest.raises(TraceError) as info:
        load_trace(path, limits=limits)
    message = str(info.value)
    assert "\n" not in message and info.value.line == line, message
    assert message.startswith(f"{path}:{line}: " if line is not None else f"{path}: "), message
    assert what in message, message


def test_the_token_bound_is_the_live_mirrors_one_constant(tmp_path: Path) -> None:
    tap_default = next(f.default for f in fields(MirrorConfig) if f.name == "max_request_tokens")
    assert EventBounds().max_request_tokens == tap_default == MAX_REQUEST_TOKENS
    ok = tmp_path / "ok.jsonl"
    ok.write_text(ROW.replace('"output_tokens": 3', f'"output_tokens": {MAX_REQUEST_TOKENS}'))
    assert load_trace(ok).requests[0].output_tokens == MAX_REQUEST_TOKENS
    over = MAX_REQUEST_TOKENS + 1
    cases = (("t.jsonl", ROW.replace('"prompt_tokens": 10', f'"prompt_tokens": {over}'), 1, "prompt_tokens"),
             ("t.csv", f"arrival_s,prompt_tokens,output_tokens\n0,5,{over}\n", 2, "output_tokens"))
    for name, text, line, field in cases:
        path = tmp_path / name
        path.write_text(text)
        _fails(path, TraceLimits(), line,
               f"{field} {over} is more than {MAX_REQUEST_TOKENS} tokens (the limit for one request)")


@pytest.mark.parametrize("gz", [False, True])
def test_lines_are_read_with_a_length_limit(tmp_path: Path, gz: bool) -> None:
    data = (ROW + '{"pad": "' + "x" * 500 + '"}\n').encode()
    path = tmp_path / ("t.jsonl.gz" if gz else "t.jsonl")
    path.write_bytes(gzip.compress(data) if gz else data)
    _fails(path, TraceLimits(max_line_chars=100), 2, "line longer than 100 characters (the limit)")
    _fails(path, TraceLimits(max_line_chars=1000), 2, "missing field 'arrival_s'")  # read whole, parsed


def test_a_line_at_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(ROW * 3)
    assert len(load_trace(path, limits=TraceLimits(max_line_chars=len(ROW)))) == 3
    _fails(path, TraceLimits(max_line_chars=len(ROW) - 1), 1, f"line longer than {len(ROW) - 1} characters")


def test_blank_lines_in_a_row_and_lines_in_all_are_capped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(ROW + "\n \n\t\n" + ROW + "\n" * 4 + ROW)
    assert len(load_trace(path, limits=TraceLimits(max_blank_lines=4))) == 3
    _fails(path, TraceLimits(max_blank_lines=3), 9, "more than 3 blank lines in a row (the limit)")
    _fails(path, TraceLimits(max_lines=9), 10, "more than 9 lines (the limit; `shadow replay|sweep "
           "--max-trace-lines` raises it)")
    assert len(load_trace(path, limits=TraceLimits(max_lines=10))) == 3


def test_a_gzip_file_that_expands_too_much_is_refused(tmp_path: Path) -> None:
    rows = 50_000
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress((ROW * rows).encode(), compresslevel=9))
    ratio = rows * len(ROW) / path.stat().st_size
    assert ratio > 100  # the rows repeat: far more than a real trace's 3 to 10 times
    after = 1 << 20
    _fails(path, TraceLimits(max_gzip_ratio=10, gzip_ratio_after=after), math.ceil(after / len(ROW)),
           "more than 10 (the limit): not a trace")
    assert len(load_trace(path, limits=TraceLimits(max_gzip_ratio=ratio * 2, gzip_ratio_after=after))) == rows


def test_a_recording_header_is_bounded(tmp_path: Path) -> None:
    lanes = LaneSettings(policies=("jsq", "br0"), step=StepTimeModel(), slots=64).to_json()
    header = {**HEADER, "lanes": lanes}
    path = _ndjson(tmp_path / "r.ndjson", header, _request(0), _request(1))
    assert load_trace(path, limits=TraceLimits(max_fleet_slots=128, max_workers=2, max_lanes=2)).workers == (
        "d0", "d1")
    _fails(path, TraceLimits(max_fleet_slots=127), 1,
           "invalid record: session: lanes slots 64 × 2 workers is more than 127 slots in all (the limit)")
    _fails(path, TraceLimits(max_workers=1), 1, "invalid record: session: 2 workers, more than 1 (the limit)")
    _fails(path, TraceLimits(max_lanes=1), 1, "invalid record: session: 2 lanes, more than 1 (the limit)")


def test_a_recording_without_header_is_bounded_by_the_workers_its_requests_name(tmp_path: Path) -> None:
    path = _ndjson(tmp_path / "r.ndjson", *(_request(i, worker=f"w{i}") for i in range(5)))
    assert len(load_trace(path, limits=TraceLimits(max_workers=5))) == 5
    _fails(path, TraceLimits(max_workers=4), None, "requests placed on 5 workers, more than 4 (the limit)")


@pytest.mark.parametrize(
    ("line", "what"),
    [
        (_request(1, output_tokens=MAX_REQUEST_TOKENS + 1),
         f"output_tokens {MAX_REQUEST_TOKENS + 1} is more than"),
        (_request(1, prompt_tokens=2**63), f"prompt_tokens {2**63} is more than {MAX_REQUEST_TOKENS}"),
        (_request(1, arrival_t=10**400), "invalid record: "),
        ({"type": "token", "request_id": "r", "t": 1.0, "generated": MAX_REQUEST_TOKENS + 1},
         f"invalid event: token: generated {MAX_REQUEST_TOKENS + 1} is more than {MAX_REQUEST_TOKENS}"),
        ({"type": "arrive", "request_id": "r", "t": 1.0, "max_tokens": 2**31},
         f"invalid event: arrive: max_tokens {2**31} is more than"),
        ({"type": "seed", "window": 10**9, "t": 1.0, "origin": 0.0, "window_s": 1.0, "requests": []},
         "invalid record: seed line: window 1000000000 is beyond 100000 (the limit)"),
        ({"type": "seed", "window": 1, "t": 1.0, "origin": 0.0, "window_s": 1.0,
          "requests": [["r", "d0", 0.5, 2**40, 0, None]]},
         f"invalid record: seed line: prompt {2**40} is more than {MAX_REQUEST_TOKENS}"),
        ({"type": "seed", "window": 1, "t": 1.0, "origin": 0.0, "window_s": 1.0,
          "requests": [["r", "d0", 0.5, 5, -1, None]]}, "seed line: generated must be >= 0"),
    ],
)
def test_recorded_counts_and_times_are_bounded(tmp_path: Path, line: dict[str, Any], what: str) -> None:
    path = tmp_path / "r.ndjson"
    path.write_text(json.dumps(HEADER) + "\n" + json.dumps(_request(0)) + "\n" + json.dumps(line) + "\n")
    _fails(path, TraceLimits(), 3, what)


def test_non_finite_times_are_refused_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "r.ndjson"
    path.write_text(json.dumps(HEADER) + "\n" + json.dumps(_request(0)) + "\n"
                    + json.dumps(_request(1)).replace('"arrival_t": 1.0', '"arrival_t": 1e999') + "\n")
    _fails(path, TraceLimits(), 3, "invalid record: arrival_t must be a finite number")
    seed = {"type": "seed", "window": 1, "t": 1.0, "origin": 0.0, "window_s": 1.0, "requests": []}
    bad_seed = json.dumps(seed).replace('"origin": 0.0', '"origin": -1e999')
    path.write_text(json.dumps(HEADER) + "\n" + bad_seed + "\n")
    _fails(path, TraceLimits(), 2, "seed line: times must be finite numbers")


def test_rolling_windows_are_bounded_by_the_span_they_cover(tmp_path: Path) -> None:
    seed = {"type": "seed", "window": 1, "t": 2.0, "origin": 0.0, "window_s": 2.0, "requests": []}
    path = _ndjson(tmp_path / "r.ndjson", HEADER, *(_request(i) for i in range(21)), seed)
    assert len(load_trace(path, limits=TraceLimits(max_windows=10)).seeds) == 1
    _fails(path, TraceLimits(max_windows=9), None,
           "arrivals span 10 rolling windows of 2 s, more than 9 (the limit)")


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="trace limit max_lines must be >= 1, got 0"):
        TraceLimits(max_lines=0)
