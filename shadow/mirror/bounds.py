"""Bounds on what one event may claim, checked before it reaches the mirrored state.

An event's time must lie within `max_skew_s` of the receiver's clock (producers share the host's
CLOCK_MONOTONIC), and its token counts within `max_request_tokens` (the longest request any worker
could hold). The live lanes step simulated time up to the newest event time and run a request for
as many steps as its tokens, so one event beyond these would hold them for hours or forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shadow.contracts.events import MAX_REQUEST_TOKENS, TOKEN_FIELDS, Event

#: Drop reasons (`Mirror.dropped`, the outcome the event API reports for the line).
TIME_SKEW = "time_skew"
TOKEN_BOUND = "token_bound"


@dataclass(frozen=True)
class EventBounds:
    """`check(ev, now)`: None when the event is within bounds, else the drop reason."""

    max_skew_s: float = 60.0
    max_request_tokens: int = MAX_REQUEST_TOKENS
    # per event class, the token counts it has (looked up once per class, not per event)
    _counts: dict[type, tuple[str, ...]] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.max_skew_s > 0 or self.max_request_tokens < 1:
            raise ValueError("the event time skew must be > 0 s and the token bound >= 1")

    def check(self, ev: Event, now: float) -> str | None:
        if not now - self.max_skew_s <= ev.t <= now + self.max_skew_s:
            return TIME_SKEW
        names = self._counts.get(type(ev))
        if names is None:
            names = self._counts[type(ev)] = tuple(n for n in TOKEN_FIELDS if hasattr(ev, n))
        bound = self.max_request_tokens
        for name in names:
            v = getattr(ev, name)
            if v is not None and v > bound:
                return TOKEN_BOUND
        return None
