"""Loader for the Azure LLM inference traces (2023 and 2024 schemas): CSV with a header naming
`TIMESTAMP`, `ContextTokens` (prompt tokens) and `GeneratedTokens` (output tokens), in any order,
extra columns ignored.

TIMESTAMP is a wall-clock date-time such as `2023-11-16 18:15:46.6805900` (7 fractional digits, no
zone: read as UTC) or `2024-05-12 00:00:00.001163+00:00`; fractions of any length are kept exactly
(relative to the first row). The trace has no prompt text: `prompt_key` is `ctx_prompt_key(prompt)`,
the key of the deterministic synthetic prompt a replay client sends (paper notes A9), so ExactMatch
sees "same prompt length = same prompt", as in the paper's Azure replay.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from datetime import UTC, datetime

from shadow.traces.keys import ctx_prompt_key
from shadow.traces.limits import DEFAULT_LIMITS, TraceLimits
from shadow.traces.lines import open_lines
from shadow.traces.model import Trace, TraceError
from shadow.traces.parsing import (
    Row,
    collect_requests,
    count_from_text,
    csv_header,
    csv_rows,
    limit_note,
    show,
)

TIME_COLUMN = "TIMESTAMP"
PROMPT_COLUMN = "ContextTokens"
OUTPUT_COLUMN = "GeneratedTokens"
COLUMNS = (TIME_COLUMN, PROMPT_COLUMN, OUTPUT_COLUMN)


def parse_timestamp(text: str) -> tuple[int, int]:
    """(nanoseconds since the Unix epoch, year) of an Azure TIMESTAMP; digits past 1 ns are dropped.

    Raises ValueError when `text` is not an ISO-like date-time.
    """
    stamp = text.strip()
    nanos = 0
    dot = stamp.find(".")
    if dot >= 0:
        rest = stamp[dot + 1 :]
        digits = len(rest) - len(rest.lstrip("0123456789"))
        if digits == 0:
            raise ValueError(stamp)
        nanos = int(rest[:digits][:9].ljust(9, "0"))
        stamp = stamp[:dot] + rest[digits:]
    moment = datetime.fromisoformat(stamp)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp()) * 1_000_000_000 + nanos, moment.year


def _trace_name(path: str, year: int) -> str:
    stem = os.path.basename(path).lower()
    for kind in ("conv", "code"):
        if kind in stem:
            return f"azure-{year}-{kind}"
    base = stem.split(".", 1)[0]
    return f"azure-{year}-{base}"


def load_azure_csv(path: str, *, limit: int | None = None, limits: TraceLimits = DEFAULT_LIMITS) -> Trace:
    """Load an Azure LLM inference CSV; bad input raises a one-line TraceError naming file and line."""
    years: list[int] = []
    with open_lines(path, limits) as lines:
        reader = csv.reader(lines)

        def line_num() -> int:
            return reader.line_num

        def rows() -> Iterator[Row]:
            (t_col, p_col, o_col), width = csv_header(reader, line_num, path, COLUMNS)
            base: int | None = None
            for line, cells in csv_rows(reader, line_num, path, max(t_col, p_col, o_col) + 1, width):
                stamp = cells[t_col].strip()
                try:
                    ticks, year = parse_timestamp(stamp)
                except (ValueError, OverflowError):
                    raise TraceError.at(
                        path, line, f"{TIME_COLUMN} is not a date-time: {show(stamp)}"
                    ) from None
                if base is None:
                    base = ticks
                    years.append(year)
                prompt = count_from_text(cells[p_col], PROMPT_COLUMN, path, line)
                output = count_from_text(cells[o_col], OUTPUT_COLUMN, path, line)
                yield line, (ticks - base) / 1e9, prompt, output, ctx_prompt_key(prompt), stamp

        try:
            requests, cut = collect_requests(rows(), path=path, limit=limit, time_field=TIME_COLUMN)
        except csv.Error as err:
            raise TraceError.at(path, reader.line_num, f"malformed CSV: {err}") from None
    notes = (
        "Azure LLM inference trace (real); no prompt text, prompt_key = key of a deterministic "
        "synthetic prompt of ContextTokens tokens (A9)" + limit_note(len(requests), cut)
    )
    name = _trace_name(path, years[0])
    return Trace(name=name, requests=requests, source=path, synthetic=False, notes=notes)
