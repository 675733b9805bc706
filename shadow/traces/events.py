"""Recorded sessions: the NDJSON of normalised mirror events (`shadow tap --record`) as a trace.

Each line is one event in `shadow.engine.events.to_dict` form. Requests carry the decode worker
the real router chose, so a replay can add the `actual` lane (twin fidelity). Incomplete requests
are dropped and counted in the trace notes; an invalid line is a one-line TraceError.
"""

from __future__ import annotations

import os

from shadow.engine.events import Event, from_dict
from shadow.engine.feed import recorded_requests
from shadow.traces.model import Trace, TraceError, TraceRequest
from shadow.traces.parsing import json_objects, open_text


def load_events(path: str | os.PathLike[str], *, limit: int | None = None) -> Trace:
    """Load a recorded session; arrivals normalised to start at 0.0."""
    name = os.fspath(path)
    events: list[Event] = []
    with open_text(name) as handle:
        for line, obj in json_objects(handle, name):
            try:
                events.append(from_dict(obj))
            except ValueError as err:
                raise TraceError.at(name, line, f"invalid event: {err}") from None
    outcome = recorded_requests(events)
    recs = outcome.requests[:limit] if limit is not None else outcome.requests
    if not recs:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.dropped.items())) or "no requests"
        raise TraceError.at(name, None, f"no complete request in the recorded events ({detail})")
    first = recs[0].arrival_s
    requests = tuple(
        TraceRequest(r.arrival_s - first, max(1, r.prompt_tokens), r.output_tokens, r.prompt_key, r.worker)
        for r in recs
    )
    dropped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(outcome.dropped.items()))
    notes = f"recorded session; dropped: {dropped}" if dropped else "recorded session"
    return Trace(name=os.path.basename(name), requests=requests, source=name, synthetic=False, notes=notes)
