"""`load_trace`: read a trace file of any supported format, detected from its first non-blank line.

Formats (`fmt`): "azure-csv" (Azure LLM inference CSV), "mooncake" (Mooncake JSONL), "jsonl" and
"csv" (the generic format, see `shadow.traces.generic`), "events" (a recorded session of normalised
mirror events, see `shadow.traces.events`). Gzipped files are read transparently.
Detection: a line starting with "{" means JSONL (Mooncake when it has `input_length`), anything
else CSV (Azure when the header names `ContextTokens`). Every input problem is a one-line TraceError.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable

from shadow.contracts.events import EVENT_TYPES
from shadow.traces.azure import PROMPT_COLUMN, load_azure_csv
from shadow.traces.events import RECORD_TYPES, load_events
from shadow.traces.generic import load_generic_csv, load_generic_jsonl
from shadow.traces.model import Trace, TraceError
from shadow.traces.mooncake import PROMPT_FIELD, load_mooncake
from shadow.traces.parsing import open_text, parse_json_line

FORMATS: tuple[str, ...] = ("azure-csv", "mooncake", "jsonl", "csv", "events")


def _loader(fmt: str) -> Callable[[str, int | None], Trace] | None:
    match fmt:
        case "azure-csv":
            return lambda path, limit: load_azure_csv(path, limit=limit)
        case "mooncake":
            return lambda path, limit: load_mooncake(path, limit=limit)
        case "jsonl":
            return lambda path, limit: load_generic_jsonl(path, limit=limit)
        case "csv":
            return lambda path, limit: load_generic_csv(path, limit=limit)
        case "events":
            return lambda path, limit: load_events(path, limit=limit)
    return None


def detect_format(path: str) -> str:
    """The format name of the file at `path`, from its first non-blank line."""
    with open_text(path) as handle:
        for line, text in enumerate(handle, start=1):
            stripped = text.strip()
            if not stripped:
                continue
            if stripped.startswith("{"):
                obj = parse_json_line(stripped, path, line)
                if isinstance(obj, dict) and obj.get("type") in (*EVENT_TYPES, *RECORD_TYPES):
                    return "events"
                return "mooncake" if isinstance(obj, dict) and PROMPT_FIELD in obj else "jsonl"
            try:
                header = next(csv.reader([stripped]))
            except csv.Error as err:
                raise TraceError.at(path, line, f"malformed CSV header: {err}") from None
            names = {cell.strip().lower() for cell in header}
            return "azure-csv" if PROMPT_COLUMN.lower() in names else "csv"
    raise TraceError.at(path, None, "file is empty")


def load_trace(path: str | os.PathLike[str], *, limit: int | None = None, fmt: str | None = None) -> Trace:
    """Load the trace at `path` (first `limit` requests if given), arrivals normalised to start at 0.0.

    Raises TraceError (one line, naming file and line) for any bad input, and ValueError for limit < 1.
    """
    name = os.fspath(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if fmt is None:
        fmt = detect_format(name)
    loader = _loader(fmt)
    if loader is None:
        raise TraceError.at(name, None, f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    return loader(name, limit)
