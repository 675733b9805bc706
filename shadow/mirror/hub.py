"""The mirror hub: where normalised events from taps and from the event API meet.

`Mirror.emit(event, source, now)` applies the event to the `MirrorState`, appends it to the
recorder (if any) and to a bounded ring of recent events (served by GET /v1/events), and counts it.
With `token_interval_s` > 0 the taps' Tokens pass a `TokenHold` first (one per stream per
interval of event time: `shadow.mirror.tokenhold`), except a stream's first Token, passed on at
once; the chunks that ended a decode step of their worker (`shadow.engine.stepends`) go out with
the held Token (`Token.step_ends`); everything after the hub sees the same events whatever the
interval's batches were.
All counters here are plain integers exported by `shadow.mirror.metrics.MirrorCollector`.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import IO, Any, Protocol

from shadow.base.logthrottle import Throttled
from shadow.contracts.events import Cancel, Event, Finish, Token
from shadow.engine.stepends import FIRST, StepEndFinder
from shadow.mirror.bounds import EventBounds
from shadow.mirror.state import OK, MirrorState
from shadow.mirror.tokenhold import TokenHold

SOURCES = ("tap", "api", "reaper")
HELD = "held"  # `Mirror.emit`'s outcome for a tap Token the hold keeps (passed on later)

Listener = Callable[[Event], None]  # told of every applied event, on the analysis thread


def event_dict(ev: Event) -> dict[str, Any]:
    """Same result as `shadow.contracts.events.to_dict`, without dataclasses.asdict's deep copy."""
    out: dict[str, Any] = {"type": ev.kind}
    for name in ev.__match_args__:  # every field, in order (a request event's id and time first)
        v = getattr(ev, name)
        if v is not None:
            out[name] = v
    return out


def event_line(ev: Event) -> str:
    """One event as an NDJSON line (no newline): what the event API takes and serves, `--forward`
    posts and the debugging recorder writes."""
    return json.dumps(event_dict(ev), separators=(",", ":"))


class Recorder:
    """Appends events as NDJSON (to_dict form) to a file; buffered, written on `flush()`.

    The one-event-per-line form (debugging); `--record` writes `recording.CompactRecorder`."""

    def __init__(self, path: str, *, max_buffered: int = 100_000) -> None:
        self.path = path
        self._fh: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lines: list[str] = []
        self.max_buffered = max_buffered
        self.written = 0
        self.dropped = 0
        self.errors = 0

    def write(self, ev: Event) -> None:
        if len(self._lines) >= self.max_buffered:
            self.dropped += 1
            return
        self._lines.append(event_line(ev))

    def flush(self) -> None:
        if not self._lines or self._fh is None:
            return
        lines, self._lines = self._lines, []
        try:
            self._fh.write("\n".join(lines) + "\n")
            self._fh.flush()
            self.written += len(lines)
        except OSError:
            self.errors += 1

    def close(self) -> None:
        self.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class RecorderLike(Protocol):
    """What the hub needs of a recorder (`Recorder`, `recording.CompactRecorder`)."""

    dropped: int
    errors: int

    def write(self, ev: Event) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class Mirror:
    """Event fan-in; see module docstring. `listeners` get every applied event, in their order."""

    def __init__(
        self,
        state: MirrorState,
        *,
        recorder: RecorderLike | None = None,
        ring: int = 10_000,
        ring_bytes: int = 16 << 20,
        max_live: int = 1_000_000,
        listeners: Sequence[Listener] = (),
        bounds: EventBounds | None = None,
        token_interval_s: float = 0.0,
    ) -> None:
        self.state = state
        self.hold = TokenHold(token_interval_s) if token_interval_s > 0 else None
        # with the hold: the taps' step ends, found per chunk (carried as `Token.step_ends`)
        self.step_end_finder = StepEndFinder()
        self.bounds = bounds or EventBounds()  # time and counts an event may claim (else dropped)
        self.recorder = recorder
        self.recent: deque[tuple[int, Event]] = deque(maxlen=ring)
        self.ring_bytes = ring_bytes  # the recent-events ring is also bounded by (approximate) bytes
        self.max_live = max_live  # a new request beyond this many live ones is dropped (counted)
        self._ring_sizes: deque[int] = deque()
        self._ring_used = 0
        self.seq = 0
        self.listeners: list[Listener] = list(listeners)
        # counters (exported by MirrorCollector)
        self.events: dict[tuple[str, str], int] = {}
        self.ignored: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self._error_log = Throttled(logging.getLogger("shadow.mirror"))
        self.listener_errors = 0

    def count_drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def count_error(self, stage: str, n: int = 1) -> None:
        """Count an exception the analysis side isolated (call it in the `except` block: the first
        one per stage per 10 s is logged with its traceback)."""
        self.errors[stage] = self.errors.get(stage, 0) + n
        self._error_log.warning(stage, "analysis error isolated (%s)", stage, exc_info=True, stage=stage)

    def emit(self, ev: Event, source: str, now: float) -> str:
        """Apply and fan out one event; returns the state's outcome, or the reason it was dropped
        ("live_cap", or `bounds.TIME_SKEW`/`TOKEN_BOUND`), or HELD (a tap Token kept by the hold)."""
        hold = self.hold
        if hold is not None:
            if source == "tap":  # (only the relay's times move the intervals: an API event's time
                # is the poster's, and one far ahead must not hold the taps' Tokens back)
                for tok, t_now in hold.advance(ev.t):
                    self._apply(tok, "tap", t_now)
                if isinstance(ev, Token):
                    gap = self.step_end_finder.token(ev)
                    if gap != FIRST:  # (a stream's first Token goes out at once: its gaps start there)
                        full = hold.hold(ev, now, gap)
                        if full is None:
                            return HELD
                        return self._apply(full[0], source, now)
            held_one = hold.take(ev)
            if held_one is not None:
                self._apply(held_one[0], "tap", held_one[1])
        return self._apply(ev, source, now)

    def tick(self, now: float) -> None:
        """The clock reads `now` (event time): held Tokens whose interval it has left go out."""
        if self.hold is not None and self.hold.due(now):
            for tok, t_now in self.hold.advance(now):
                self._apply(tok, "tap", t_now)

    def release_held(self) -> None:
        """The input ended (drain, stop): every held Token goes out now."""
        if self.hold is not None:
            for tok, t_now in self.hold.release():
                self._apply(tok, "tap", t_now)

    def _apply(self, ev: Event, source: str, now: float) -> str:
        out_of_bounds = self.bounds.check(ev, now)
        if out_of_bounds is not None:
            self.count_drop(out_of_bounds)
            return out_of_bounds
        rid = getattr(ev, "request_id", None)
        if rid is not None and self.state.live() >= self.max_live and not self.state.known(rid):
            self.count_drop("live_cap")
            return "live_cap"
        outcome = self.state.apply(ev, now)
        if (self.hold is not None and not isinstance(ev, Token)
                and (outcome == OK or isinstance(ev, Finish | Cancel))):
            self.step_end_finder.learn(ev)  # (of a request the state refused: nothing)
        key = (source, ev.kind)
        self.events[key] = self.events.get(key, 0) + 1
        if outcome != OK:
            self.ignored[outcome] = self.ignored.get(outcome, 0) + 1
        self._fan_out(ev)
        return outcome

    def _fan_out(self, ev: Event) -> None:
        """Number the event, keep it in `recent`, record it, and hand it to every listener."""
        self.seq += 1
        recent = self.recent
        size = 64
        for n in ev.__match_args__:
            v = getattr(ev, n)
            if isinstance(v, str):
                size += len(v)
        if len(recent) == recent.maxlen:
            self._ring_used -= self._ring_sizes.popleft()
        recent.append((self.seq, ev))
        self._ring_sizes.append(size)
        self._ring_used += size
        while self._ring_used > self.ring_bytes and len(recent) > 1:
            recent.popleft()
            self._ring_used -= self._ring_sizes.popleft()
        if self.recorder is not None:
            self.recorder.write(ev)
        for fn in self.listeners:
            try:
                fn(ev)
            except Exception:
                self.listener_errors += 1
                self._error_log.warning("listener", "a mirror listener raised (isolated)", exc_info=True,
                                        stage="listener")

    def reap(self, now: float, t: float | None = None) -> list[Finish]:
        """TTL-reap silent requests; the resulting Finish("reaped") events are recorded too."""
        self.tick(now)
        out = self.state.reap(now, t)
        for ev in out:
            key = ("reaper", ev.kind)
            self.events[key] = self.events.get(key, 0) + 1
            self._fan_out(ev)
        return out

    def recent_after(self, after: int, limit: int) -> list[tuple[int, Event]]:
        """Recent events with sequence number > `after`, oldest first, at most `limit`."""
        out: list[tuple[int, Event]] = []
        for seq, ev in self.recent:
            if seq > after:
                out.append((seq, ev))
                if len(out) >= limit:
                    break
        return out
