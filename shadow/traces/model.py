"""Trace data model: one request (`TraceRequest`), an immutable arrival-sorted trace (`Trace`), and
`TraceError`, the one-line error every loader raises for bad input ("<file>:<line>: <what>").
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from shadow.engine.config import LaneClock
from shadow.engine.feed import Recorded
from shadow.engine.rolling import Seed
from shadow.engine.settings import LaneSettings


class TraceError(ValueError):
    """Bad trace input. `str(err)` is one line: "<file>:<line>: <what>" or "<file>: <what>"."""

    path: str | None
    line: int | None
    what: str

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        one_line = " ".join(message.splitlines())
        super().__init__(one_line)
        self.path = path
        self.line = line
        self.what = one_line

    @classmethod
    def at(cls, path: str, line: int | None, what: str) -> TraceError:
        """Build the error for `what` at `path` (and `line`, 1-based, when known)."""
        where = path if line is None else f"{path}:{line}"
        err = cls(f"{where}: {what}", path=path, line=line)
        err.what = " ".join(what.splitlines())
        return err


def _as_count(value: object, field: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{field} must be an integer, got {value!r}")
    number = value if type(value) is int else operator.index(value)  # type: ignore[arg-type]
    if number < 1:
        raise ValueError(f"{field} must be >= 1, got {number}")
    return number


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: arrival time in seconds from the trace start, prompt and output token counts (>= 1),
    and an optional hash-like prompt key (identical prompts share a key; never prompt text)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_key: str | None = None
    # Recorded sessions only: the decode worker the real router chose (for the `actual` lane), and
    # the request body's size in bytes where the taps saw it (what `jsq-bytes` scores).
    worker: str | None = None
    body_bytes: int | None = None

    def __post_init__(self) -> None:
        arrival = self.arrival_s
        if type(arrival) is not float:
            if isinstance(arrival, bool) or not isinstance(arrival, int | float | np.floating | np.integer):
                raise TypeError(f"arrival_s must be a number, got {arrival!r}")
            arrival = float(arrival)
            object.__setattr__(self, "arrival_s", arrival)
        if not (math.isfinite(arrival) and arrival >= 0.0):
            raise ValueError(f"arrival_s must be finite and >= 0, got {arrival!r}")
        for field in ("prompt_tokens", "output_tokens"):
            raw = getattr(self, field)
            count = _as_count(raw, field)
            if count is not raw:
                object.__setattr__(self, field, count)
        key = self.prompt_key
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"prompt_key must be None or a non-empty string, got {key!r}")


@dataclass(frozen=True, slots=True, repr=False)
class Trace:
    """An immutable request trace, sorted by arrival time (stable). `synthetic` must be shown in reports.

    Empty traces are allowed (means and duration are then 0.0), but loaders never return one.
    """

    name: str
    requests: tuple[TraceRequest, ...]
    source: str
    synthetic: bool
    notes: str = ""
    # a recorded session: the configured decode workers, in order (None: not known)
    workers: tuple[str, ...] | None = None
    # a recorded session of `shadow serve`: what its live lanes ran with (None: not recorded)
    lane_settings: LaneSettings | None = None
    # ... with rolling lanes: each window's seed (by window) and the requests as recorded (ids,
    # event-time placements), which a replay needs to start every window from its seed
    seeds: Mapping[int, Seed] = dataclasses.field(default_factory=dict)
    recorded: tuple[Recorded, ...] = ()
    # ... with the measured lane clock: (time, clock) each time the lanes' step models changed
    clocks: tuple[tuple[float, LaneClock], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.requests, tuple):
            object.__setattr__(self, "requests", tuple(self.requests))
        previous = -math.inf
        for index, request in enumerate(self.requests):
            if not isinstance(request, TraceRequest):
                raise TypeError(f"requests[{index}] is not a TraceRequest: {request!r}")
            if request.arrival_s < previous:
                raise ValueError(
                    f"requests must be sorted by arrival_s: requests[{index}] at {request.arrival_s!r} s "
                    f"comes before requests[{index - 1}] at {previous!r} s"
                )
            previous = request.arrival_s

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, requests=<{len(self.requests)}>, source={self.source!r}, "
            f"synthetic={self.synthetic!r})"
        )

    @property
    def mean_prompt_tokens(self) -> float:
        """Mean prompt length in tokens (0.0 for an empty trace)."""
        n = len(self.requests)
        return math.fsum(r.prompt_tokens for r in self.requests) / n if n else 0.0

    @property
    def mean_output_tokens(self) -> float:
        """Mean output length in tokens (0.0 for an empty trace)."""
        n = len(self.requests)
        return math.fsum(r.output_tokens for r in self.requests) / n if n else 0.0

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last arrival (0.0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rate_rps(self) -> float:
        """Mean arrival rate in requests/s: 1 / mean inter-arrival gap = (n - 1) / duration_s.

        0.0 when it is undefined (fewer than two requests, or all arrivals at the same instant).
        """
        duration = self.duration_s
        return (len(self.requests) - 1) / duration if duration > 0.0 else 0.0

    def arrays(self) -> dict[str, NDArray[Any]]:
        """Columns as new numpy arrays: arrival_s (float64), prompt_tokens and output_tokens (int64)."""
        n = len(self.requests)
        return {
            "arrival_s": np.fromiter((r.arrival_s for r in self.requests), dtype=np.float64, count=n),
            "prompt_tokens": np.fromiter((r.prompt_tokens for r in self.requests), dtype=np.int64, count=n),
            "output_tokens": np.fromiter((r.output_tokens for r in self.requests), dtype=np.int64, count=n),
        }

    def limit(self, n: int | None) -> Trace:
        """The first `n` requests (all of them when `n` is None or >= len); `n` must be >= 0."""
        if n is None or n >= len(self.requests):
            return self
        if n < 0:
            raise ValueError(f"limit must be >= 0, got {n}")
        note = f"first {n} of {len(self.requests)} requests"
        return replace(self, requests=self.requests[:n], notes=_add_note(self.notes, note))

    def with_arrivals(self, arrivals: Sequence[float] | NDArray[Any], *, note: str = "") -> Trace:
        """Same requests with new arrival times (one per request, finite, >= 0), re-sorted stably.

        `note`, when given, is appended to `notes` so that reports show how arrivals were changed.
        """
        values = np.asarray(arrivals, dtype=np.float64)
        if values.shape != (len(self.requests),):
            raise ValueError(
                f"with_arrivals: expected {len(self.requests)} arrival times, got shape {values.shape}"
            )
        if not bool(np.all(np.isfinite(values))) or bool(np.any(values < 0.0)):
            raise ValueError("with_arrivals: arrival times must be finite and >= 0")
        order = np.argsort(values, kind="stable")
        requests = tuple(replace(self.requests[i], arrival_s=float(values[i])) for i in order.tolist())
        return replace(self, requests=requests, notes=_add_note(self.notes, note) if note else self.notes)


def _add_note(notes: str, note: str) -> str:
    return f"{notes.rstrip('. ')}; {note}" if notes else note
