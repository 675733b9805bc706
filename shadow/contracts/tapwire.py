"""The wire contract between the data plane and the analysis: what a tap hands over per request
(`TapContext`, through a `Handoff`: a queue in one process, the attach channel between two), how a
request ended (`END_*`), and the bounded label sets both sides count by (`REJECT_REASONS`,
`CUT_REASONS`). The relay (`shadow.dataplane.tap`) fills it; the analysis (`shadow.mirror.analyzer`,
`.channel`, `.capture`) reads it. Imports nothing else from shadow."""

from __future__ import annotations

from typing import Any, Protocol

END_COMPLETE = "complete"
END_CLIENT_CANCEL = "client_cancel"
END_UPSTREAM_CUT = "upstream_cut"
END_UPSTREAM_ERROR = "upstream_error"
END_RELAY_LOST = "relay_lost"  # analysis side: the relay serving it died or was replaced mid-request
END_REASONS = (END_COMPLETE, END_CLIENT_CANCEL, END_UPSTREAM_CUT, END_UPSTREAM_ERROR, END_RELAY_LOST)

# Reasons counted in `Tap.rejected` (a bounded label set).
REJECT_REASONS = (
    "bad_framing",
    "head_too_large",
    "header_timeout",
    "body_timeout",
    "idle_timeout",
    "path_not_allowed",
    "upgrade",
    "busy",
    "evicted_idle",
    "not_resent",
    "bad_upstream_response",
    "linger_cut",
)

# Why a tap cut a response it had started relaying (`Tap.cut`, a bounded label set): the upstream
# closed or reset the connection mid-body, sent bytes the parser refused, or the tap shut down with
# the stream still open. The client sees an SSE error event (streams) and an aborted body.
CUT_REASONS = ("upstream_closed", "upstream_reset", "bad_upstream_response", "tap_shutdown")


class Handoff(Protocol):
    """Where a tap hands its copies: a `DropQueue` (analysis thread) or a `ChannelSink` (process)."""

    def put(self, item: Any, nbytes: int = 0) -> bool: ...

    def put_end(self, item: Any) -> None: ...


class TapContext:
    """One proxied request/response as the analysis side sees it (plain attributes, set by the tap)."""

    __slots__ = (
        "an",
        "announced",
        "body",
        "body_len",
        "cid",
        "end_no",
        "ended",
        "kept",
        "kept_bytes",
        "method",
        "path",
        "request_id",
        "resp_headers",
        "sent",
        "seq",
        "status",
        "t_start",
        "tap",
        "traceparent",
    )

    def __init__(
        self,
        tap: str,
        method: str,
        path: str,
        request_id: str | None,
        body: bytes | None,
        body_len: int,
        t_start: float,
        traceparent: str | None = None,
    ) -> None:
        self.tap = tap
        self.method = method
        self.path = path
        self.request_id = request_id  # the hash of its X-Request-Id (`http1.head_ids`), never the id
        self.body = body  # None when larger than the analysis limit
        self.body_len = body_len
        self.t_start = t_start
        self.traceparent = traceparent  # the W3C traceparent the request came with (as sent)
        self.status = 0
        self.resp_headers: dict[str, str] = {}
        self.seq = 0
        self.ended = False
        self.announced = False
        self.an: Any = None  # the analysis side's per-request state
        self.cid = 0  # the relay process's id for this request (ChannelSink)
        self.sent = 0  # ChannelSink: 0 nothing sent, 1 request info, 2 info with the response head
        self.kept: list[bytes] | None = None  # ChannelSink: this request's frames, for a snapshot
        self.kept_bytes = 0
        self.end_no = 0  # ChannelSink: the number of this request's end (0: not ended)
