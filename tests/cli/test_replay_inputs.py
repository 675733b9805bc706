"""`shadow replay` bounds every size it reads (issue #37 D4): each file below once cost gigabytes or
hours before its error (or never ended); now each is a one-line error naming the value, its limit,
the file and the line, exit 2, within a memory ceiling (`tests.bounded`)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from shadow.base.procs import shadow_argv
from shadow.contracts.events import MAX_REQUEST_TOKENS
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.settings import LaneSettings
from shadow.mirror.recording import CompactRecorder
from shadow.traces import DEFAULT_LIMITS, load_trace
from tests.bounded import one_line_error, run_bounded

MiB = 1 << 20


def _recording(path: Path, slots: int, *, rolling_s: float | None = None, seed_window_s: float | None = None
               ) -> Path:
    """A `shadow serve` recording of two workers whose header says its lanes ran with `slots`."""
    lanes = LaneSettings(policies=("rr", "jsq", "br0"), step=StepTimeModel(), slots=slots,
                         rolling_s=rolling_s)
    CompactRecorder(str(path), workers=["d0", "d1"], slots=slots, lanes=lanes.to_json()).close()
    with path.open("a") as fh:
        for i in range(20):
            fh.write(json.dumps({"type": "request", "request_id": f"r{i}", "arrival_t": 5.0 * i,
                                 "prompt_tokens": 10, "output_tokens": 5, "worker": f"d{i % 2}"}) + "\n")
        if seed_window_s is not None:
            fh.write(json.dumps({"type": "seed", "window": 1, "t": seed_window_s, "origin": 0.0,
                                 "window_s": seed_window_s, "requests": []}) + "\n")
    return path


def _gzip_members(path: Path, chunk: bytes, times: int, tail: bytes = b"") -> Path:
    """`chunk` repeated `times` times, as as many gzip members (each compressed once), then `tail`."""
    member = gzip.compress(chunk, compresslevel=9)
    with path.open("wb") as fh:
        for _ in range(times):
            fh.write(member)
        fh.write(gzip.compress(tail))
    return path


def _slots(n: int) -> Callable[[Path], Path]:
    return lambda d: _recording(d / "slots.ndjson", n)


def _tokens(d: Path) -> Path:
    path = d / "tokens.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 2147483647}\n')
    return path


def _long_line(d: Path) -> Path:  # 0.5 MB holding one 512 MiB line
    return _gzip_members(d / "line.jsonl.gz", b"x" * MiB, 512, b"\n")


def _newlines(d: Path) -> Path:  # 1 MB holding 1 GiB of newlines
    return _gzip_members(d / "blank.jsonl.gz", b"\n" * MiB, 1024)


def _expanding(d: Path) -> Path:  # 2 MB holding 2.3 GB of valid rows
    row = b'{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n'
    return _gzip_members(d / "rows.jsonl.gz", row * (MiB // len(row) * 8), 256)


def _tiny_windows(d: Path) -> Path:  # rolling windows of 1 us over 95 s of arrivals
    return _recording(d / "rolling.ndjson", 8, rolling_s=1e-6, seed_window_s=1e-6)


L = DEFAULT_LIMITS
CASES = {
    "header slots 1e9": (_slots(10**9), f"slots.ndjson:1: invalid record: session: lanes slots {10**9} × 2 "
                         f"workers is more than {L.max_fleet_slots} slots in all (the limit)"),
    "header slots 2e6": (_slots(2 * 10**6), f"lanes slots {2 * 10**6} × 2 workers is more than"),
    "output tokens 2^31-1": (_tokens, f"tokens.jsonl:1: output_tokens {2**31 - 1} is more than "
                             f"{MAX_REQUEST_TOKENS} tokens (the limit for one request)"),
    "one 512 MiB line": (_long_line, f"line.jsonl.gz:1: line longer than {L.max_line_chars} characters"),
    "1 GiB of newlines": (_newlines, f"blank.jsonl.gz:{L.max_blank_lines + 1}: more than "
                          f"{L.max_blank_lines} blank lines in a row (the limit)"),
    "a gzip bomb of rows": (_expanding, f"more than {L.max_gzip_ratio:g} (the limit): not a trace"),
    "1 us rolling windows": (_tiny_windows,
                             f"rolling windows of 1e-06 s, more than {L.max_windows} (the limit)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_size_in_the_input_is_bounded_before_use(tmp_path: Path, case: str) -> None:
    build, message = CASES[case]
    path = build(tmp_path)
    proc = run_bounded(shadow_argv("replay", str(path), "--policies", "jsq"), memory_bytes=1 << 30)
    err = one_line_error(proc, message)
    assert err.startswith(f"shadow replay: {path}")


def _rows(path: Path, n: int) -> Path:
    rows = (json.dumps({"arrival_s": i, "prompt_tokens": 5, "output_tokens": 3}) + "\n" for i in range(n))
    path.write_text("".join(rows))
    return path


def test_the_line_cap_is_a_flag_that_names_itself(tmp_path: Path) -> None:
    path = _rows(tmp_path / "t.jsonl", 5)
    proc = run_bounded(shadow_argv("replay", str(path), "--policies", "jsq", "--max-trace-lines", "4"))
    one_line_error(proc, f"{path}:5: more than 4 lines (the limit; `shadow replay|sweep --max-trace-lines` "
                   "raises it)")
    proc = run_bounded(shadow_argv("replay", str(path), "--policies", "jsq", "--max-trace-lines", "5"))
    assert proc.returncode == 0, proc.stderr
    proc = run_bounded(shadow_argv("replay", str(path), "--max-trace-lines", "0"))
    one_line_error(proc, "--max-trace-lines must be >= 1, got 0")


def test_the_steady_protocol_reads_within_the_flag(tmp_path: Path) -> None:
    path = _rows(tmp_path / "t.jsonl", 9)
    proc = run_bounded(shadow_argv("sweep", str(path), "--workers", "2", "--policies", "jsq", "--seeds", "0",
                                   "--max-trace-lines", "8"))
    assert proc.returncode == 2 and "more than 8 lines" in proc.stderr, proc.stderr[-2000:]


def test_the_limits_are_checked_before_anything_is_sized(tmp_path: Path) -> None:
    """The largest values within the limits still replay: the bounds reject only beyond them."""
    g = 2
    at_limit = DEFAULT_LIMITS.max_fleet_slots // g
    path = _recording(tmp_path / "edge.ndjson", at_limit)
    proc = run_bounded(shadow_argv("replay", str(path), "--policies", "jsq"), memory_bytes=2 << 30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = tmp_path / "tokens.jsonl"
    path.write_text(f'{{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": {MAX_REQUEST_TOKENS}}}\n')
    assert load_trace(path).requests[0].output_tokens == MAX_REQUEST_TOKENS
