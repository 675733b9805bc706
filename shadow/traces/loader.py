"""`load_trace`: read a trace file of any supported format, detected from its first non-blank line.

Formats (`fmt`): "azure-csv" (Azure LLM inference CSV), "mooncake" (Mooncake JSONL), "jsonl" and
"csv" (the generic format, see `shadow.traces.generic`), "events" (a recorded session of normalised
mirror events, see `shadow.traces.events`). Gzipped files are read transparently.
Detection: a line starting with "{" means JSONL (Mooncake when it has `input_length`), anything
else CSV (Azure when the header names `ContextTokens`). Every input problem is a one-line TraceError,
and every size the file claims is bounded (`TraceLimits`) before anything is sized by it.
"""

from __future__ import annotations

import csv
import os
from typing import Protocol

from shadow.contracts.events import EVENT_TYPES
from shadow.traces.azure import PROMPT_COLUMN, load_azure_csv
from shadow.traces.events import RECORD_TYPES, load_events
from shadow.traces.generic import load_generic_csv, load_generic_jsonl
from shadow.traces.limits import DEFAULT_LIMITS, TraceLimits
from shadow.traces.lines import open_lines
from shadow.traces.model import Trace, TraceError
from shadow.traces.mooncake import PROMPT_FIELD, load_mooncake
from shadow.traces.parsing import parse_json_line

FORMATS: tuple[str, ...] = ("azure-csv", "mooncake", "jsonl", "csv", "events")


class Loader(Protocol):
    """A format's loader."""

    def __call__(self, path: str, *, limit: int | None = None, limits: TraceLimits = ...) -> Trace: ...


def _loader(fmt: str) -> Loader | None:
    loaders: dict[str, Loader] = {
        "azure-csv": load_azure_csv,
        "mooncake": load_mooncake,
        "jsonl": load_generic_jsonl,
        "csv": load_generic_csv,
        "events": load_events,
    }
    return loaders.get(fmt)


def detect_format(path: str, limits: TraceLimits = DEFAULT_LIMITS) -> str:
    """The format name of the file at `path`, from its first non-blank line."""
    with open_lines(path, limits) as lines:
        for line, text in enumerate(lines, start=1):
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


def load_trace(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    fmt: str | None = None,
    limits: TraceLimits = DEFAULT_LIMITS,
) -> Trace:
    """Load the trace at `path` (first `limit` requests if given), arrivals normalised to start at 0.0.

    Raises TraceError (one line, naming file and line) for any bad input or a size beyond `limits`,
    and ValueError for limit < 1.
    """
    name = os.fspath(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if fmt is None:
        fmt = detect_format(name, limits)
    loader = _loader(fmt)
    if loader is None:
        raise TraceError.at(name, None, f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    return loader(name, limit=limit, limits=limits)
