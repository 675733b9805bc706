"""The generic trace format, as JSON Lines or CSV, with a reader and a writer for each.

Fields (JSONL keys, or CSV header names in any order; extra fields are ignored):
- `arrival_s`: arrival time in seconds (any origin; rows sorted, ties allowed; normalised on load so
  that the first request is at 0.0);
- `prompt_tokens`, `output_tokens`: whole numbers >= 1;
- `prompt_key` (optional): a non-empty hash-like string (JSON integers are accepted and turned into
  strings); JSON null, a missing field or an empty CSV cell mean "no key". Never prompt text.

JSONL example: `{"arrival_s": 0.25, "prompt_tokens": 812, "output_tokens": 97, "prompt_key": "9f0c..."}`.
CSV example: header `arrival_s,prompt_tokens,output_tokens,prompt_key`, then `0.25,812,97,9f0c...`.
The writers emit arrival times with `repr`, so a written trace reads back identical.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from typing import IO, Any

from shadow.traces.limits import DEFAULT_LIMITS, TraceLimits
from shadow.traces.lines import open_lines
from shadow.traces.model import Trace, TraceError
from shadow.traces.parsing import (
    Row,
    collect_requests,
    count_from_text,
    csv_header,
    csv_rows,
    json_rows,
    limit_note,
    seconds_from_text,
    show,
)

TIME_FIELD = "arrival_s"
PROMPT_FIELD = "prompt_tokens"
OUTPUT_FIELD = "output_tokens"
KEY_FIELD = "prompt_key"
REQUIRED = (TIME_FIELD, PROMPT_FIELD, OUTPUT_FIELD)


def _name(path: str) -> str:
    return os.path.basename(path).split(".", 1)[0] or path


def _key_from_json(value: object, path: str, line: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise TraceError.at(path, line, f"{KEY_FIELD} must be a non-empty string or null, got {show(value)}")
    return value


def load_generic_jsonl(path: str, *, limit: int | None = None, limits: TraceLimits = DEFAULT_LIMITS) -> Trace:
    """Load a generic JSONL trace; bad input raises a one-line TraceError naming file and line."""

    def key(obj: dict[str, Any], line: int) -> str | None:
        return _key_from_json(obj.get(KEY_FIELD), path, line)

    with open_lines(path, limits) as lines:
        rows = json_rows(lines, path, (TIME_FIELD, PROMPT_FIELD, OUTPUT_FIELD), key)
        requests, cut = collect_requests(rows, path=path, limit=limit, time_field=TIME_FIELD)
    notes = "generic JSONL trace" + limit_note(len(requests), cut)
    return Trace(name=_name(path), requests=requests, source=path, synthetic=False, notes=notes)


def load_generic_csv(path: str, *, limit: int | None = None, limits: TraceLimits = DEFAULT_LIMITS) -> Trace:
    """Load a generic CSV trace; bad input raises a one-line TraceError naming file and line."""
    with open_lines(path, limits) as lines:
        reader = csv.reader(lines)

        def line_num() -> int:
            return reader.line_num

        def rows() -> Iterator[Row]:
            cols, width = csv_header(reader, line_num, path, REQUIRED, (KEY_FIELD,))
            t_col, p_col, o_col, k_col = cols
            for line, cells in csv_rows(reader, line_num, path, max(cols) + 1, width):
                arrival = seconds_from_text(cells[t_col], TIME_FIELD, path, line)
                prompt = count_from_text(cells[p_col], PROMPT_FIELD, path, line)
                output = count_from_text(cells[o_col], OUTPUT_FIELD, path, line)
                key = (cells[k_col] or None) if k_col >= 0 else None
                yield line, arrival, prompt, output, key, f"{cells[t_col].strip()} s"

        try:
            requests, cut = collect_requests(rows(), path=path, limit=limit, time_field=TIME_FIELD)
        except csv.Error as err:
            raise TraceError.at(path, reader.line_num, f"malformed CSV: {err}") from None
    notes = "generic CSV trace" + limit_note(len(requests), cut)
    return Trace(name=_name(path), requests=requests, source=path, synthetic=False, notes=notes)


def write_jsonl(trace: Trace, out: IO[str]) -> None:
    """Write `trace` in the generic JSONL format (one object per request; no metadata)."""
    for r in trace.requests:
        row: dict[str, object] = {
            TIME_FIELD: r.arrival_s,
            PROMPT_FIELD: r.prompt_tokens,
            OUTPUT_FIELD: r.output_tokens,
        }
        if r.prompt_key is not None:
            row[KEY_FIELD] = r.prompt_key
        out.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_csv(trace: Trace, out: IO[str]) -> None:
    """Write `trace` in the generic CSV format (header + one row per request; no metadata).

    Keys are always quoted (so that any character survives); `out` should be opened with newline="".
    """
    csv.writer(out, lineterminator="\n").writerow((TIME_FIELD, PROMPT_FIELD, OUTPUT_FIELD, KEY_FIELD))
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    for r in trace.requests:
        writer.writerow((r.arrival_s, r.prompt_tokens, r.output_tokens, r.prompt_key or ""))
