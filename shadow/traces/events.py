"""Recorded sessions (`shadow tap|serve --record`) as a trace.

Two line kinds mix freely: compact records (`shadow.mirror.recording`: a `session` header naming
the configured workers, one `request` line per ended request, `steps` aggregates) and normalised
events (`shadow.contracts.events.to_dict`, the older one-event-per-line form). Requests carry the
decode worker the real router chose, so a replay adds the `actual` lane; the header's workers
all count as workers, traffic or not, and its `lanes` (when `shadow serve` wrote it) say what the
live lanes ran with; `seed` lines (rolling lanes) the state each window started from. Incomplete
requests are dropped and counted in the trace
notes; an invalid line is a one-line TraceError. Gzipped files and rotated parts read the same.
"""

from __future__ import annotations

import os
from typing import Any

from shadow.contracts.events import EVENT_TYPES, Event, from_dict
from shadow.engine.feed import Recorded, recorded_requests
from shadow.engine.rolling import Seed
from shadow.engine.settings import LaneSettings
from shadow.traces.model import Trace, TraceError, TraceRequest
from shadow.traces.parsing import json_objects, open_text

RECORD_TYPES = ("session", "request", "steps", "seed")


def _request(obj: dict[str, Any]) -> Recorded:
    rid, t, s, o = obj["request_id"], obj["arrival_t"], obj["prompt_tokens"], obj["output_tokens"]
    w, key = obj.get("worker"), obj.get("prompt_key")
    if not isinstance(rid, str) or not rid:
        raise ValueError("request_id must be a non-empty string")
    if isinstance(t, bool) or not isinstance(t, int | float) or t != t:
        raise ValueError("arrival_t must be a number")
    for name, v in (("prompt_tokens", s), ("output_tokens", o)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0")
    if w is not None and not isinstance(w, str):
        raise ValueError("worker must be a string")
    if key is not None and not isinstance(key, str):
        raise ValueError("prompt_key must be a string")
    return Recorded(rid, float(t), s, o, key, w)


def load_events(path: str | os.PathLike[str], *, limit: int | None = None) -> Trace:
    """Load a recorded session; arrivals normalised to start at 0.0."""
    name = os.fspath(path)
    events: list[Event] = []
    compact: list[Recorded] = []
    workers: list[str] | None = None
    settings: LaneSettings | None = None
    seeds: dict[int, Seed] = {}
    with open_text(name) as handle:
        for line, obj in json_objects(handle, name):
            kind = obj.get("type")
            try:
                if kind in EVENT_TYPES:
                    try:
                        events.append(from_dict(obj))
                    except ValueError as err:
                        raise TraceError.at(name, line, f"invalid event: {err}") from None
                elif kind == "request":
                    compact.append(_request(obj))
                elif kind == "session":
                    ws = obj.get("workers")
                    if not isinstance(ws, list) or not all(isinstance(w, str) and w for w in ws):
                        raise ValueError("session: workers must be a list of names")
                    if workers is not None and ws and ws != workers:
                        raise ValueError(f"session: workers {ws} differ from an earlier header's {workers}")
                    workers = ws or workers
                    if "lanes" in obj:
                        got = LaneSettings.from_json(obj["lanes"])
                        if settings is not None and got != settings:
                            raise ValueError("session: lanes differ from an earlier header's")
                        settings = got
                elif kind == "seed":
                    seed = Seed.from_json(obj)
                    seeds[seed.window] = seed
                elif kind != "steps":
                    raise ValueError(f"unknown record type {kind!r}")
            except (KeyError, ValueError, TypeError) as err:
                what = f"missing field {err}" if isinstance(err, KeyError) else str(err)
                raise TraceError.at(name, line, f"invalid record: {what}") from None
    outcome = recorded_requests(events)
    recs = sorted(
        [*outcome.requests, *(r for r in compact if r.output_tokens >= 1)], key=lambda r: r.arrival_s
    )
    recs = recs[:limit] if limit is not None else recs
    if not recs:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.dropped.items())) or "no requests"
        raise TraceError.at(name, None, f"no complete request in the recording ({detail})")
    if workers:
        unknown = sorted({r.worker for r in recs if r.worker is not None and r.worker not in workers})
        if unknown:
            raise TraceError.at(
                name, None, f"requests placed on workers {unknown} not in the header {workers}"
            )
    first = recs[0].arrival_s
    requests = tuple(
        TraceRequest(r.arrival_s - first, max(1, r.prompt_tokens), r.output_tokens, r.prompt_key, r.worker)
        for r in recs
    )
    dropped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(outcome.dropped.items()))
    notes = f"recorded session; dropped: {dropped}" if dropped else "recorded session"
    return Trace(
        name=os.path.basename(name),
        requests=requests,
        source=name,
        synthetic=False,
        notes=notes,
        workers=tuple(workers) if workers else None,
        lane_settings=settings,
        seeds=seeds,
        recorded=tuple(recs) if seeds else (),
    )
