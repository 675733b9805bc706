"""When each trace request is sent: arrival offsets, time scaling, limits.

The load generator only needs four fields of a trace request, so it depends on the trace
*shape* (``shadow.contracts.traces.TraceLike``), not on ``shadow.traces`` itself.

Offsets are relative to the first arrival of the (limited) trace, in trace order sorted by
arrival, and divided by the time scale: ``time_scale=2`` sends the same requests twice as fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shadow.contracts.traces import TraceLike


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of the load: its position, when to send it, and its sizes."""

    index: int  # position in the (sorted, limited) trace
    offset_s: float  # send time relative to the start of the run, after scaling
    prompt_tokens: int
    output_tokens: int
    prompt_key: str | None


def trace_rate(trace: TraceLike, limit: int | None = None) -> float:
    """Mean arrival rate of the trace in requests per second (0.0 when it has no time span)."""
    arrivals = sorted(float(r.arrival_s) for r in trace.requests)
    if limit is not None:
        arrivals = arrivals[: max(0, limit)]
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return 0.0
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def plan(trace: TraceLike, *, time_scale: float = 1.0, limit: int | None = None) -> list[PlannedRequest]:
    """The send plan: requests sorted by arrival, cut to ``limit``, offsets divided by ``time_scale``."""
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time scale must be a positive number, got {time_scale}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    ordered = sorted(trace.requests, key=lambda r: float(r.arrival_s))
    if limit is not None:
        ordered = ordered[:limit]
    if not ordered:
        return []
    t0 = float(ordered[0].arrival_s)
    out: list[PlannedRequest] = []
    for i, r in enumerate(ordered):
        if r.prompt_tokens < 0 or r.output_tokens < 0:
            raise ValueError(f"request {i}: token counts must be >= 0")
        out.append(
            PlannedRequest(
                index=i,
                offset_s=(float(r.arrival_s) - t0) / time_scale,
                prompt_tokens=int(r.prompt_tokens),
                output_tokens=int(r.output_tokens),
                prompt_key=r.prompt_key,
            )
        )
    return out
