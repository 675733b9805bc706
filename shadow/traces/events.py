"""Recorded sessions (`shadow tap|serve --record`) as a trace.

Two line kinds mix freely: compact records (`shadow.mirror.recording`: a `session` header naming
the configured workers, one `request` line per ended request, `steps` aggregates) and normalised
events (`shadow.contracts.events.to_dict`, the older one-event-per-line form). Requests carry the
decode worker the real router chose, so a replay adds the `actual` lane; the header's workers
all count as workers, traffic or not, and its `lanes` (when `shadow serve` wrote it) say what the
live lanes ran with; `seed` lines (rolling lanes) the state each window started from; `clock`
lines (the measured lane clock) the step models the lanes stepped on as they changed. Incomplete
requests are dropped and counted in the trace
notes; an invalid line is a one-line TraceError, and so is a size beyond `TraceLimits` (workers,
workers × slots, rolling windows) or a token count beyond the live mirror's bound. Gzipped files
and rotated parts read the same.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from shadow.contracts.events import EVENT_TYPES, MAX_REQUEST_TOKENS, TOKEN_FIELDS, Event, from_dict
from shadow.engine.config import LaneClock
from shadow.engine.feed import Recorded, recorded_requests
from shadow.engine.rolling import Seed
from shadow.engine.settings import LaneSettings, clock_from_json
from shadow.traces.limits import DEFAULT_LIMITS, TraceLimits
from shadow.traces.lines import open_lines
from shadow.traces.model import Trace, TraceError, TraceRequest
from shadow.traces.parsing import json_objects, show, too_many_tokens

RECORD_TYPES = ("session", "request", "steps", "seed", "clock")


def _request(obj: dict[str, Any]) -> Recorded:
    rid, t, s, o = obj["request_id"], obj["arrival_t"], obj["prompt_tokens"], obj["output_tokens"]
    w, key, size = obj.get("worker"), obj.get("prompt_key"), obj.get("body_bytes")
    if not isinstance(rid, str) or not rid:
        raise ValueError("request_id must be a non-empty string")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(float(t)):
        raise ValueError("arrival_t must be a finite number")
    for name, v in (("prompt_tokens", s), ("output_tokens", o)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0")
        if v > MAX_REQUEST_TOKENS:
            raise ValueError(too_many_tokens(v, name))
    if w is not None and not isinstance(w, str):
        raise ValueError("worker must be a string")
    if key is not None and not isinstance(key, str):
        raise ValueError("prompt_key must be a string")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ValueError("body_bytes must be an integer >= 0")
    return Recorded(rid, float(t), s, o, key, w, size)


def _header(obj: dict[str, Any], workers: list[str] | None, limits: TraceLimits) -> list[str] | None:
    """The workers a `session` line names (or the earlier header's when it names none), bounded."""
    ws = obj.get("workers")
    if isinstance(ws, list) and len(ws) > limits.max_workers:
        raise ValueError(f"session: {len(ws)} workers, more than {limits.max_workers} (the limit)")
    if not isinstance(ws, list) or not all(isinstance(w, str) and w for w in ws):
        raise ValueError("session: workers must be a list of names")
    if workers is not None and ws and ws != workers:
        raise ValueError(f"session: workers {show(ws)} differ from an earlier header's {show(workers)}")
    return ws or workers


def _lanes(obj: object, workers: list[str] | None, limits: TraceLimits) -> LaneSettings:
    """A header's `lanes`, their number and slots bounded: every replayed lane holds workers × slots."""
    policies = obj.get("policies") if isinstance(obj, dict) else None
    if isinstance(policies, list) and len(policies) > limits.max_lanes:
        raise ValueError(f"session: {len(policies)} lanes, more than {limits.max_lanes} (the limit)")
    settings = LaneSettings.from_json(obj)
    g = max(1, len(workers or ()))
    if settings.slots * g > limits.max_fleet_slots:
        raise ValueError(
            f"session: lanes slots {settings.slots} × {g} workers is more than "
            f"{limits.max_fleet_slots} slots in all (the limit)"
        )
    return settings


def _seed(obj: dict[str, Any], limits: TraceLimits) -> Seed:
    """A `seed` line, its times finite, its window and token counts bounded."""
    seed = Seed.from_json(obj)
    if seed.window > limits.max_windows:
        raise ValueError(f"seed line: window {seed.window} is beyond {limits.max_windows} (the limit)")
    if not all(map(math.isfinite, (seed.t, seed.origin, *(r.arrival for r in seed.requests)))):
        raise ValueError("seed line: times must be finite numbers")
    for r in seed.requests:
        for field, v in (("prompt", r.prompt), ("generated", r.generated)):
            if v < 0:
                raise ValueError(f"seed line: {field} must be >= 0, got {v}")
            if v > MAX_REQUEST_TOKENS:
                raise ValueError(f"seed line: {too_many_tokens(v, field)}")
    return seed


def _event(obj: dict[str, Any]) -> Event:
    """One event line (the older form), its token counts bounded."""
    ev = from_dict(obj)
    for field in TOKEN_FIELDS:
        v = getattr(ev, field, None)
        if v is not None and v > MAX_REQUEST_TOKENS:
            raise ValueError(f"{ev.kind}: {too_many_tokens(v, field)}")
    return ev


def _clock(obj: dict[str, Any], workers: list[str] | None) -> tuple[float, LaneClock]:
    """A `clock` line of a session whose header named its workers, its time finite."""
    t = obj.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise ValueError("clock line: t must be a finite number")
    if not workers:
        raise ValueError("clock line: the session header names no workers")
    return float(t), clock_from_json(obj, len(workers))


def _check_span(name: str, recs: Iterable[Recorded], seeds: dict[int, Seed], limits: TraceLimits) -> None:
    """The rolling windows the recorded arrivals span, at most `limits.max_windows`."""
    if not seeds:
        return
    first = next(iter(seeds.values()))
    last = max((r.arrival_s for r in recs), default=first.origin)
    windows = (last - first.origin) / first.window_s
    if windows > limits.max_windows:
        raise TraceError.at(
            name, None, f"arrivals span {windows:.3g} rolling windows of {first.window_s:g} s, more than "
            f"{limits.max_windows} (the limit)"
        )


def _check_workers(name: str, recs: list[Recorded], workers: list[str] | None, limits: TraceLimits) -> None:
    """TraceError when a request was placed on a worker the header does not name (without a header:
    on more workers than the limit)."""
    if workers:
        unknown = sorted({r.worker for r in recs if r.worker is not None and r.worker not in workers})
        if unknown:
            raise TraceError.at(
                name, None, f"requests placed on workers {show(unknown)} not in the header {show(workers)}"
            )
    else:
        seen = len({r.worker for r in recs if r.worker is not None})
        if seen > limits.max_workers:
            raise TraceError.at(name, None, f"requests placed on {seen} workers, more than "
                                f"{limits.max_workers} (the limit)")


def load_events(
    path: str | os.PathLike[str], *, limit: int | None = None, limits: TraceLimits = DEFAULT_LIMITS
) -> Trace:
    """Load a recorded session; arrivals normalised to start at 0.0."""
    name = os.fspath(path)
    events: list[Event] = []
    compact: list[Recorded] = []
    workers: list[str] | None = None
    settings: LaneSettings | None = None
    seeds: dict[int, Seed] = {}
    clocks: list[tuple[float, LaneClock]] = []
    with open_lines(name, limits) as lines:
        for line, obj in json_objects(lines, name):
            kind = obj.get("type")
            try:
                if kind in EVENT_TYPES:
                    try:
                        events.append(_event(obj))
                    except ValueError as err:
                        raise TraceError.at(name, line, f"invalid event: {err}") from None
                elif kind == "request":
                    compact.append(_request(obj))
                elif kind == "session":
                    workers = _header(obj, workers, limits)
                    if "lanes" in obj:
                        got = _lanes(obj["lanes"], workers, limits)
                        if settings is not None and got != settings:
                            raise ValueError("session: lanes differ from an earlier header's")
                        settings = got
                elif kind == "seed":
                    seed = _seed(obj, limits)
                    seeds[seed.window] = seed
                elif kind == "clock":
                    clocks.append(_clock(obj, workers))
                elif kind != "steps":
                    raise ValueError(f"unknown record type {show(kind)}")
            except TraceError:
                raise
            except (KeyError, ValueError, TypeError, OverflowError) as err:
                what = f"missing field {err}" if isinstance(err, KeyError) else str(err)
                raise TraceError.at(name, line, f"invalid record: {what}") from None
    outcome = recorded_requests(events)
    recs = sorted(
        [*outcome.requests, *(r for r in compact if r.output_tokens >= 1)], key=lambda r: r.arrival_s
    )
    _check_span(name, recs, seeds, limits)
    recs = recs[:limit] if limit is not None else recs
    if not recs:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.dropped.items())) or "no requests"
        raise TraceError.at(name, None, f"no complete request in the recording ({detail})")
    _check_workers(name, recs, workers, limits)
    first = recs[0].arrival_s
    requests = tuple(
        TraceRequest(r.arrival_s - first, max(1, r.prompt_tokens), r.output_tokens, r.prompt_key, r.worker,
                     r.body_bytes)
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
        clocks=tuple(clocks),
    )
