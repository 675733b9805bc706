"""What the active proxy counts about its requests beyond their Prometheus families: one request's
end (`request`: the requests counter and the mode source, as its client saw it), an upstream's
failure, a stream cut after its first byte, error answers by kind (`error`: the proxy's own error
answer, counted, logged and made), oversized SSE events.

One `ProxyCounts` per proxy, shared by its P/D flow and its shadow-mode passthrough; every count
here is also what `/health` and the tests read (`errors`, `cut`, `oversized_events`).
"""

from __future__ import annotations

import collections
import logging

from starlette.responses import Response

from shadow.active.flow import error_body
from shadow.active.metrics import ActiveMetrics
from shadow.base.logthrottle import Throttled
from shadow.contracts.labels import STREAM_INCOMPLETE
from shadow.contracts.modes import ModeSource


class ProxyCounts:
    """The proxy's request, failure and cut counts (see module docstring); `log` takes its warnings."""

    def __init__(self, metrics: ActiveMetrics, modes: ModeSource, log: logging.Logger) -> None:
        self.metrics = metrics
        self.log = log
        self.modes = modes
        self.errors: collections.Counter[str] = collections.Counter()  # error answers by kind
        # streams cut after their first byte, by (leg, reason): the client got an error event
        self.cut: collections.Counter[tuple[str, str]] = collections.Counter()
        self.oversized_events = 0  # SSE events over `max_event_bytes` (forwarded unaligned)
        self.rejected_log = Throttled(log)  # requests refused for what the client sent
        self.retry_log = Throttled(log)  # upstream failures a retry hid from the client

    def request(self, mode: str, policy: str, outcome: str, status: int | None = None,
                ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        """One request ended: counted, and reported to the mode source as its client saw it."""
        self.metrics.requests.labels(mode, policy, outcome).inc()
        self.modes.on_request(mode, outcome, status, ttft_s, tpot_s)

    def upstream_failed(self, worker: str, leg: str) -> None:
        """`worker` (a prefiller, decode worker or "router") failed its `leg` of a request."""
        self.metrics.upstream_errors.labels(leg, worker).inc()
        self.modes.on_upstream(worker, leg, False)

    def stream_cut(self, leg: str, reason: str) -> None:
        """A stream of `leg` ended early for `reason`, after its first byte reached the client."""
        self.cut[(leg, reason)] += 1
        self.metrics.streams_cut.labels(leg, reason).inc()

    def failed_by_event(self, outcome: str, leg: str, worker: str) -> str:
        """A relayed stream that carried an SSE error event failed upstream, whether the client then
        left (it raises on the event, often before the break behind it reaches the proxy: counted
        as the cut it is) or the stream ended: `upstream_error`, and the upstream is told failed."""
        if outcome not in ("ok", "client_cancel", STREAM_INCOMPLETE):
            return outcome
        self.upstream_failed(worker, leg)
        if outcome == "client_cancel":
            self.stream_cut(leg, "upstream_broke")
        return "upstream_error"

    def error(self, status: int, message: str, kind: str, rid: str | None = None) -> Response:
        """The proxy's own error answer (JSON, `kind` its type), counted by kind and logged."""
        self.errors[kind] += 1
        if status < 500:
            self.rejected_log.warning(kind, "request rejected (%s): %s", status, message, kind=kind)
        else:
            extra = {"kind": kind, "request_id": rid}
            self.log.warning("request failed (%s): %s", status, message, extra=extra)
        headers = {"X-Request-Id": rid} if rid else None
        return Response(
            error_body(status, message, kind),
            status_code=status,
            media_type="application/json",
            headers=headers,
        )
