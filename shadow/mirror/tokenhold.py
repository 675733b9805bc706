"""Token coalescing: one `Token` per stream per interval of event time instead of one per chunk.

A decode stream sends a chunk per step; the centre of a large fleet cannot take one event per
token (docs/scale.md). `TokenHold` keeps each request's newest tap `Token` and lets it go when
event time leaves the interval it fell in (intervals of `interval_s` seconds on a fixed grid,
k·interval_s), so what follows the hold sees, per stream and interval, the count at its last
chunk and that chunk's time. The sum of a stream's per-token gaps and their number are the same
either way (the gaps of one released Token are its span over the tokens it adds), given its first
Token is not held (the caller passes it on); what is lost is how they were spread inside the
interval. The chunks that ended a step of their worker (the caller finds them:
`shadow.engine.stepends`) go out with the Token as `Token.step_ends`.

Order: a held Token goes out before any later event of its request (its end, a late Route), and
all held Tokens go out, in the order their requests first held one, before the first event whose
time lies past their interval: the events that follow are a function of the events that came in,
never of how they were batched. The high-water mark moves with the events the caller advances it
with (the hub: the taps' own, whose times are the relay's clock); `due(t)` tells a quiet input's
caller whether time alone should release them. Pure: time is in the events.
"""

from __future__ import annotations

import math

from shadow.contracts.events import MAX_STEP_ENDS, Event, Token

Held = tuple[Token, float]  # the Token and the `now` it came with


class TokenHold:
    """See module docstring. `interval_s` > 0."""

    __slots__ = ("_ends", "_k", "_pending", "coalesced", "full", "interval_s", "step_ends")

    def __init__(self, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self._k = -math.inf  # the latest interval an event fell in
        self._pending: dict[str, Held] = {}
        self._ends: dict[str, list[float]] = {}  # a held stream's step ends, flat (t, gap) pairs
        self.coalesced = 0  # Tokens replaced by a newer one of their stream (never passed on)
        self.step_ends = 0  # step ends taken to carry on the Tokens that go out
        self.full = 0  # Tokens passed on before their interval's end: full of step ends

    def __len__(self) -> int:
        return len(self._pending)

    def due(self, t: float) -> bool:
        """Whether time `t` lies past the interval of the held Tokens (release them)."""
        return bool(self._pending) and t // self.interval_s > self._k

    def advance(self, t: float) -> list[Held]:
        """Time `t` has come (an event's, or the clock's): every held Token when it leaves their
        interval, in the order their requests first held one; else nothing."""
        k = t // self.interval_s
        if k <= self._k:
            return []
        self._k = k
        return self.release()

    def hold(self, ev: Token, now: float, step_gap: float | None = None) -> Held | None:
        """Keep `ev` as its request's newest Token (call `advance(ev.t)` first); `step_gap`: its
        chunk ended a step of its worker, with this per-token gap (carried on the Token that goes
        out: `Token.step_ends`). Returns a Token to pass on at once: this one when its stream has
        `MAX_STEP_ENDS` step ends held (else None)."""
        rid = ev.request_id
        pending = self._pending
        if rid in pending:
            self.coalesced += 1
        if step_gap is not None:
            self.step_ends += 1
            ends = self._ends.get(rid)
            if ends is None:
                ends = self._ends[rid] = []
            ends += (ev.t, step_gap)
            if len(ends) >= 2 * MAX_STEP_ENDS:
                self.full += 1
                pending.pop(rid, None)
                return self._out((ev, now))
        pending[rid] = (ev, now)
        return None

    def take(self, ev: Event) -> Held | None:
        """The held Token of `ev`'s request, to go out before `ev` (None: none held)."""
        rid = getattr(ev, "request_id", None)
        if rid is None or not self._pending:
            return None
        held = self._pending.pop(rid, None)
        return None if held is None else self._out(held)

    def release(self) -> list[Held]:
        """Every held Token, in the order their requests first held one (the hold is emptied)."""
        out = list(self._pending.values())
        self._pending.clear()
        if self._ends:
            out = [self._out(held) for held in out]
        return out

    def _out(self, held: Held) -> Held:
        """A held Token as it goes out: with its stream's step ends since its previous one."""
        tok, now = held
        ends = self._ends.pop(tok.request_id, None)
        if ends is None:
            return held
        return Token(tok.request_id, tok.t, tok.generated, tuple(ends)), now
