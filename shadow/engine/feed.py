"""From a stream of normalised events (a recorded live session) to replayable requests.

Each request needs an arrival (Arrive, else its first Route), a prompt size (Arrive or Route),
and an end (Finish, or Cancel after tokens) with its output length (Finish.generated, else the
last Token). The decode worker the real router chose comes from Route, for the `actual` lane.
Requests that never end, never got a token, or lack a prompt size are dropped and counted by
reason — nothing is invented.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from shadow.engine.events import Arrive, Cancel, Event, Finish, Route, Step, Token


@dataclass(frozen=True, slots=True)
class Recorded:
    """One replayable request from a recorded session (time on the recorder's clock)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_key: str | None
    worker: str | None


@dataclass(slots=True)
class _Partial:
    arrival: float | None = None
    prompt: int | None = None
    key: str | None = None
    worker: str | None = None
    generated: int = 0
    ended: bool = False


@dataclass(slots=True)
class FeedOutcome:
    """Replayable requests in arrival order, plus dropped requests counted by reason."""

    requests: list[Recorded] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    steps: list[float] = field(default_factory=list)  # measured step durations, if any


def recorded_requests(events: Iterable[Event]) -> FeedOutcome:
    """Fold events into requests; duplicates and out-of-order events are tolerated."""
    parts: dict[str, _Partial] = {}
    out = FeedOutcome()
    for ev in events:
        if isinstance(ev, Step):
            out.steps.append(ev.duration_s)
            continue
        p = parts.setdefault(ev.request_id, _Partial())
        first_seen = p.arrival is None and isinstance(ev, Route)
        if first_seen or (isinstance(ev, Arrive) and (p.arrival is None or ev.t < p.arrival)):
            p.arrival = ev.t
        # The first prompt size known counts (later ones correct the mirrored state only): the
        # size the live lanes used when the request reached them.
        if isinstance(ev, Arrive):
            p.prompt = ev.prompt_tokens if p.prompt is None else p.prompt
            p.key = p.key or ev.prompt_key
        elif isinstance(ev, Route):
            p.worker = p.worker or ev.worker
            if p.prompt is None and ev.prompt_tokens is not None:
                p.prompt = ev.prompt_tokens
        elif isinstance(ev, Token):
            p.generated = max(p.generated, ev.generated)
        elif isinstance(ev, Finish):
            if ev.generated is not None:
                p.generated = max(p.generated, ev.generated)
            p.ended = True
        elif isinstance(ev, Cancel):
            p.ended = True
    for rid, p in parts.items():
        if not p.ended:
            out.dropped["never_ended"] += 1
        elif p.arrival is None:
            out.dropped["no_arrival"] += 1
        elif p.prompt is None:
            out.dropped["no_prompt_tokens"] += 1
        elif p.generated < 1:
            out.dropped["no_tokens"] += 1
        else:
            out.requests.append(Recorded(rid, p.arrival, p.prompt, p.generated, p.key, p.worker))
    out.requests.sort(key=lambda r: r.arrival_s)
    return out
