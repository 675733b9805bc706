"""From a stream of normalised events (a recorded live session) to replayable requests.

Each request needs an arrival at the decode router (its first Route: in P/D after prefill; else
its Arrive), a prompt size (Arrive or Route),
and an end (Finish, or Cancel after tokens) with its output length (Finish.generated, else the
last Token). The decode worker the real router chose comes from Route, for the `actual` lane.
Requests that never end, never got a token, or lack a prompt size are dropped and counted by
reason — nothing is invented.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from shadow.contracts.events import Arrive, Cancel, Event, Finish, Route, Step, Token
from shadow.contracts.requests import RequestRecord


@dataclass(frozen=True, slots=True)
class Recorded:
    """One replayable request from a recorded session (time on the recorder's clock)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_key: str | None
    worker: str | None
    body_bytes: int | None = None  # the request body's size, where the recording has it


@dataclass(slots=True)
class _Partial(RequestRecord):
    """What the events told of a request so far, and when it arrived, was placed and ended."""

    arrival: float | None = None  # Arrive (the request reached the router)
    placed: float | None = None  # first Route (its decode placement: prefill done)
    ended: bool = False
    reason: str | None = None
    t_end: float | None = None


@dataclass(slots=True)
class FeedOutcome:
    """Replayable requests in arrival order, plus dropped requests counted by reason."""

    requests: list[Recorded] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    steps: list[float] = field(default_factory=list)  # measured step durations, if any


def _fold(p: _Partial, ev: Arrive | Route | Token | Finish | Cancel) -> None:
    """Apply one request event to its partial record (order-tolerant)."""
    if isinstance(ev, Arrive) and (p.arrival is None or ev.t < p.arrival):
        p.arrival = ev.t
    elif isinstance(ev, Route) and (p.placed is None or ev.t < p.placed):
        p.placed = ev.t
    # The first prompt size known counts (later ones correct the mirrored state only): the
    # size the live lanes used when the request reached them. Likewise the first placement.
    if isinstance(ev, Arrive | Route):
        p.learn(ev)
    elif isinstance(ev, Token):
        p.generated = max(p.generated, ev.generated)
    elif isinstance(ev, Finish):
        if ev.generated is not None:
            p.generated = max(p.generated, ev.generated)
        p.ended, p.reason, p.t_end = True, ev.reason, ev.t
    else:
        p.ended, p.reason, p.t_end = True, "cancel", ev.t


def _outcome(rid: str, p: _Partial) -> Recorded | str:
    """The replayable request, or the reason it is dropped."""
    if not p.ended:
        return "never_ended"
    # A request reaches the decode router when it is placed (after its prefill, in P/D): that
    # is the time the lanes offer it, live and replayed alike.
    arrival = p.placed if p.placed is not None else p.arrival
    if arrival is None:
        return "no_arrival"
    if p.prompt is None:
        return "no_prompt_tokens"
    if p.generated < 1:
        return "no_tokens"
    return Recorded(rid, arrival, p.prompt, p.generated, p.key, p.worker, p.body_bytes)


def recorded_requests(events: Iterable[Event]) -> FeedOutcome:
    """Fold events into requests; duplicates and out-of-order events are tolerated."""
    parts: dict[str, _Partial] = {}
    out = FeedOutcome()
    for ev in events:
        if isinstance(ev, Step):
            out.steps.append(ev.duration_s)
            continue
        _fold(parts.setdefault(ev.request_id, _Partial()), ev)
    for rid, p in parts.items():
        r = _outcome(rid, p)
        if isinstance(r, str):
            out.dropped[r] += 1
        else:
            out.requests.append(r)
    out.requests.sort(key=lambda r: r.arrival_s)
    return out


class RequestFolder:
    """`recorded_requests` one event at a time, for a recorder that writes requests as they end.

    `apply(event)` returns None until a request ends, then (request or None if dropped, end
    reason, end time). Events for a request after its end are ignored; at most `max_open`
    requests are open (the oldest is dropped beyond, counted as `evicted`).
    """

    def __init__(self, max_open: int = 1_000_000) -> None:
        self.max_open = max_open
        self._open: OrderedDict[str, _Partial] = OrderedDict()
        self.dropped: Counter[str] = Counter()

    def apply(self, ev: Event) -> tuple[Recorded | None, str | None, float | None] | None:
        if isinstance(ev, Step):
            return None
        p = self._open.get(ev.request_id)
        if p is None:
            p = self._open[ev.request_id] = _Partial()
            if len(self._open) > self.max_open:
                self._open.popitem(last=False)
                self.dropped["evicted"] += 1
        _fold(p, ev)
        if not p.ended:
            return None
        del self._open[ev.request_id]
        r = _outcome(ev.request_id, p)
        if isinstance(r, str):
            self.dropped[r] += 1
            return None, p.reason, p.t_end
        return r, p.reason, p.t_end

    def open(self) -> int:
        return len(self._open)
