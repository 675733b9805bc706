"""Loader for Mooncake traces: JSON Lines with `timestamp` (ms from the trace start), `input_length`
(prompt tokens), `output_length` (output tokens) and optional `hash_ids` (prefix-block hash ids).

`prompt_key` is `block_key(hash_ids)`, a 16-hex-digit BLAKE2b digest of the full id list (None when
the row has no ids). Mooncake timestamps are quantised (about 3 s buckets in the FAST'25 traces);
they are kept as bursts here; `shadow.traces.rate.spread_ties` spreads them out.
"""

from __future__ import annotations

import os
from typing import Any

from shadow.traces.keys import block_key
from shadow.traces.limits import DEFAULT_LIMITS, TraceLimits
from shadow.traces.lines import open_lines
from shadow.traces.model import Trace, TraceError
from shadow.traces.parsing import (
    collect_requests,
    json_rows,
    limit_note,
    show,
)

TIME_FIELD = "timestamp"
PROMPT_FIELD = "input_length"
OUTPUT_FIELD = "output_length"
BLOCKS_FIELD = "hash_ids"


def _prompt_key(value: object, path: str, line: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise TraceError.at(path, line, f"{BLOCKS_FIELD} must be a list of integers, got {show(value)}")
    return block_key(value) if value else None


def load_mooncake(path: str, *, limit: int | None = None, limits: TraceLimits = DEFAULT_LIMITS) -> Trace:
    """Load a Mooncake JSONL trace; bad input raises a one-line TraceError naming file and line."""

    def key(obj: dict[str, Any], line: int) -> str | None:
        return _prompt_key(obj.get(BLOCKS_FIELD), path, line)

    with open_lines(path, limits) as lines:
        rows = json_rows(lines, path, (TIME_FIELD, PROMPT_FIELD, OUTPUT_FIELD), key, (1000.0, "ms"))
        requests, cut = collect_requests(rows, path=path, limit=limit, time_field=TIME_FIELD)
    stem = os.path.basename(path).split(".", 1)[0].removesuffix("_trace")
    notes = (
        "Mooncake trace (real); prompt_key = BLAKE2b of the prefix-block hash ids; timestamps kept as "
        "written (quantised buckets arrive as bursts)" + limit_note(len(requests), cut)
    )
    return Trace(name=f"mooncake-{stem}", requests=requests, source=path, synthetic=False, notes=notes)
