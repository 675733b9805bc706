"""The accounting of one stream relayed to its client: the one place the P/D decode stream and the
shadow-mode passthrough count what a stream did.

Contract. A `StreamTally` is made per client stream and fed by its relay (`streamrelay.LegRelay`):
`first_byte(t)` when an upstream's first byte arrives (the stream's TTFT is the first call's, from
`t0`); `event(piece, whole)` for every SSE event (or oversized event's piece) read off the upstream,
before it is forwarded; `sending(out)` / `sent(out, before)` around each forward. It counts:

- `events`: whole SSE events (lines ended by a blank line, any line ends, split anywhere across
  reads) whose data field is a JSON object: vLLM's completion chunks (an error object too), never
  `[DONE]`, comments, field-only events, an oversized event (forwarded in pieces) or an event the
  stream never ended with its blank line (SSE: an unterminated event is not dispatched);
- `errored`: such an event's data is an error object (`{"error": ...}`): the upstream failed it;
- `finished`: the current leg named a `finish_reason` (a string) — `new_leg()` forgets it;
- `done`: the last bytes sent are the end marker `data: [DONE]` (the client had the whole stream).

At the end: `settle(outcome)` (a client that left after `[DONE]` had it all: ok; an error event
makes a stream `upstream_error`), `complete()` (ok, or `stream_incomplete` when the stream ended
cleanly with neither a finish reason nor `[DONE]`), `record(...)` (completion time, TPOT over
`events - 1` gaps, the request counted once).
"""

from __future__ import annotations

import re
import time

from shadow.active.proxycounts import ProxyCounts
from shadow.contracts.labels import STREAM_INCOMPLETE
from shadow.telemetry.tracing import exemplar
from shadow.vllm.sse import event_data

DONE_TAIL = 32  # bytes of a relayed stream kept to see its end marker
#: An event's data field carrying an error object (vLLM's, a tap's or a router's cut event).
_ERROR_OBJECT = re.compile(rb'\{\s*"error"\s*:')
#: A choice's finish reason given (a string): its stream reached its end.
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"')


def stream_done(tail: bytes) -> bool:
    """The relayed bytes ended with the SSE end marker (the client had the whole stream)."""
    last = tail.rstrip(b"\r\n").replace(b"\r", b"\n").rsplit(b"\n", 1)[-1]
    return last in (b"data: [DONE]", b"data:[DONE]")


def names_finish(chunk: bytes, before: bytes) -> bool:
    """`chunk` of an event stream names a `finish_reason` (a string, not null), also across its
    start (`before`: the bytes relayed just before it)."""
    return _FINISH.search(chunk) is not None or _FINISH.search(before + chunk[:DONE_TAIL]) is not None


class StreamTally:
    """One client stream's counts (see module docstring). `sse`: the body is an event stream (a
    plain body names no finish reason and counts no events)."""

    __slots__ = ("bucket", "counts", "errored", "events", "finished", "mode", "t0", "t_first", "tail")

    def __init__(self, counts: ProxyCounts, mode: str, bucket: str, t0: float, sse: bool = True) -> None:
        self.counts, self.mode, self.bucket, self.t0 = counts, mode, bucket, t0
        self.events = 0  # whole JSON-data SSE events relayed
        self.errored = False  # an error event was relayed: the upstream failed the request
        self.finished = not sse  # this leg's stream named a finish reason
        self.t_first = 0.0  # when the stream's first byte arrived (0: not yet)
        self.tail = b""  # the last bytes sent to the client

    def first_byte(self, t: float) -> None:
        """An upstream call's first byte arrived at `t`; the stream's first one is its TTFT."""
        if not self.t_first:
            self.t_first = t
            self.counts.metrics.first_token.labels(self.mode, self.bucket).observe(t - self.t0, exemplar())

    def event(self, piece: bytes, whole: bool) -> None:
        """One event read off the upstream (`whole`), or a piece of an oversized one (not counted)."""
        if not whole:
            return
        data = event_data(piece)
        if data is not None and data.startswith(b"{"):
            self.events += 1
            self.errored = self.errored or _ERROR_OBJECT.match(data) is not None

    def sending(self, out: bytes) -> bytes:
        """`out` is about to go to the client; returns the tail before it (for `sent`)."""
        before, self.tail = self.tail, (self.tail + out)[-DONE_TAIL:]
        return before

    def sent(self, out: bytes, before: bytes) -> None:
        """`out` reached the client (its finish reason counts only once the bytes went out)."""
        self.finished = self.finished or names_finish(out, before)

    def new_leg(self) -> None:
        """A continuation leg starts: it has to name its own finish reason."""
        self.finished = False

    @property
    def done(self) -> bool:
        """The bytes sent so far end with `data: [DONE]`."""
        return stream_done(self.tail)

    def complete(self) -> str:
        """The outcome of a stream its upstream ended cleanly: ok, or `stream_incomplete`."""
        return "ok" if self.finished or self.done else STREAM_INCOMPLETE

    def settle(self, outcome: str, leg: str, worker: str) -> str:
        """The stream's final outcome from the one its relay saw (`worker` served its `leg`)."""
        if outcome == "client_cancel" and self.done:
            outcome = "ok"  # the client left after the end marker: the stream was complete
        if self.errored and outcome != "upstream_error":
            outcome = self.counts.failed_by_event(outcome, leg, worker)
        return outcome

    def record(self, policy: str, outcome: str, status: int, *, failed_completion: bool) -> None:
        """The stream ended now with `outcome`: its completion time (also for a failed stream when
        `failed_completion`), its TPOT when ok with two events or more, the request counted."""
        t_end = time.perf_counter()
        metrics = self.counts.metrics
        if failed_completion or outcome == "ok":
            metrics.completion.labels(self.mode, self.bucket).observe(t_end - self.t0, exemplar())
        tpot = None
        if outcome == "ok" and self.events > 1 and self.t_first:
            tpot = (t_end - self.t_first) / (self.events - 1)
            metrics.tpot.labels(self.mode, self.bucket).observe(tpot, exemplar())
        ttft = self.t_first - self.t0 if self.t_first else None
        self.counts.request(self.mode, policy, outcome, status, ttft, tpot)
