"""Where a worker's decode steps end, as its streams show them.

A running stream gets one chunk per decode step of its worker, so the chunks of one worker's
streams come in bursts, one burst per step. A chunk ends a step when it comes at least
`SAME_STEP_FRACTION` of its stream's per-token gap after the worker's previous step end (a chunk
closer than that is another stream's chunk of the same step). The lanes' request table applies
this rule to every Token it folds (`shadow.engine.livetable.RequestTable`); `StepEndFinder` applies it
where the Tokens are still one per chunk, at a node that holds them (`--token-interval`): the node
passes a stream's first Token on at once and the step ends with the held Tokens (`Token.step_ends`),
so that the centre has every step end and, from the held Tokens, every stream's gaps with the same
sum and count.

Pure: the events carry the time.
"""

from __future__ import annotations

import math

from shadow.contracts.events import Arrive, Cancel, Event, Finish, Route, Token

#: A chunk less than this fraction of its per-token gap after its worker's previous step end is a
#: chunk of the same step.
SAME_STEP_FRACTION = 0.1
#: `StepEndFinder.token`'s answer for a stream's first advance (never a step end: it has no gap).
FIRST = 0.0


class _Stream:
    __slots__ = ("count", "last", "worker")

    def __init__(self) -> None:
        self.worker: str | None = None  # its first Route's
        self.last = -1.0  # event time of its last advance (none yet: -1)
        self.count = 0  # tokens seen


class StepEndFinder:
    """The step-end rule over a node's events, in their order: per request its worker (the first
    Route's), its count and the time of its last advance; per worker its last step end. As the
    request table: a request is known from its first Arrive or Route and forgotten at its end; a
    Token of an unknown request, or one that does not advance the count, ends no step; a stream's
    first Token has no gap."""

    __slots__ = ("_ends", "_streams")

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._ends: dict[str, float] = {}  # worker -> its last step end

    def __len__(self) -> int:
        return len(self._streams)

    def learn(self, ev: Event) -> None:
        """A request's other events: Arrive/Route make it known (the first Route names its
        worker), Finish/Cancel forget it."""
        if isinstance(ev, Arrive | Route):
            s = self._streams.get(ev.request_id)
            if s is None:
                s = self._streams[ev.request_id] = _Stream()
            if isinstance(ev, Route) and s.worker is None:
                s.worker = ev.worker
        elif isinstance(ev, Finish | Cancel):
            self._streams.pop(ev.request_id, None)

    def token(self, ev: Token) -> float | None:
        """One chunk's Token: its stream's per-token gap when it ends a step of its worker;
        `FIRST` for its stream's first advance (no gap: it starts the stream's gaps, and the
        request running); else None."""
        s = self._streams.get(ev.request_id)
        if s is None:
            return None
        dg = ev.generated - s.count
        if dg <= 0:
            return None
        t, last, worker = ev.t, s.last, s.worker
        s.last, s.count = t, ev.generated
        if last < 0:
            return FIRST
        if worker is None:
            return None
        gap = (t - last) / dg
        if gap > 0 and t - self._ends.get(worker, -math.inf) >= SAME_STEP_FRACTION * gap:
            self._ends[worker] = t
            return gap
        return None
