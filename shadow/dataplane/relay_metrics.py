"""The data plane's own metrics (`shadow tap`'s /metrics on --metrics-port), declared here
(`FAMILIES`): what a relay knows of itself, read at scrape time. Its being scrapable at all is
what the tap-down page watches."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import Metric

from shadow.base.families import Family, SourceCollector
from shadow.contracts.frames import FIELD_MAX
from shadow.contracts.handshake import REFUSALS
from shadow.contracts.tapwire import CUT_REASONS, REJECT_REASONS
from shadow.dataplane.channel import DETACH_REASONS

W = ("worker",)


class TapCounts(Protocol):
    """What `TapFamilies` reads of a tap: a `Tap` here, or the analysis's view of a relay's tap."""

    @property
    def name(self) -> str: ...
    @property
    def requests(self) -> int: ...
    @property
    def connect_errors(self) -> int: ...
    @property
    def rejected(self) -> dict[str, int]: ...
    @property
    def cut(self) -> dict[str, int]: ...
    @property
    def connections(self) -> int: ...


@dataclass(frozen=True)
class TapFamilies:
    """The per-tap counters' families as one exporter names them: the data plane's `shadow_tap_*`
    (here) or the analysis' `shadow_mirror_*` (`mirror.metrics`)."""

    requests: Family
    connect_errors: Family
    rejected: Family
    cut: Family
    connections: Family

    def collect(self, taps: Collection[TapCounts]) -> Iterator[Metric]:
        """One sample per tap (and per reason) of each family."""
        yield self.requests.sampled({t.name: t.requests for t in taps})
        yield self.connect_errors.sampled({t.name: t.connect_errors for t in taps})
        yield self.rejected.sampled({(t.name, k): v for t in taps for k, v in list(t.rejected.items())})
        yield self.cut.sampled({(t.name, k): v for t in taps for k, v in list(t.cut.items())})
        yield self.connections.sampled({t.name: t.connections for t in taps})


REQUESTS = Family("shadow_tap_requests_total", "counter", "HTTP requests relayed by each tap.", "requests", W)
CONNECT_ERRORS = Family(
    "shadow_tap_upstream_connect_errors_total",
    "counter",
    "Failed connections to the tap's upstream.",
    "errors",
    W,
)
REJECTED = Family(
    "shadow_tap_rejected_total",
    "counter",
    "Requests or connections a tap refused, by reason.",
    "requests",
    ("worker", "reason"),
    {"reason": REJECT_REASONS},
)
CUT = Family(
    "shadow_tap_streams_cut_total",
    "counter",
    "Responses a tap cut after their head (the client saw an SSE error event and an aborted body), "
    "by reason.",
    "requests",
    ("worker", "reason"),
    {"reason": CUT_REASONS},
)
CONNECTIONS = Family(
    "shadow_tap_connections", "gauge", "Client connections open on each tap.", "connections", W
)
INFLIGHT = Family("shadow_tap_inflight", "gauge", "Requests in flight through each tap.", "requests", W)
ATTACHED = Family("shadow_tap_analysis_attached", "gauge",
                  "Analyses attached now (replicas each attach; 0: copies are only kept).", "analyses")
ATTACHES = Family("shadow_tap_attaches_total", "counter", "Analyses that attached.", "analyses")
HANDOFF_DROPPED = Family(
    "shadow_tap_handoff_dropped_total",
    "counter",
    "Copies not handed to the attached analysis (hand-off full); kept for a later snapshot when they fit.",
    "items",
)
KEPT_BYTES = Family("shadow_tap_kept_bytes", "gauge", "Bytes of copies kept for a snapshot.", "bytes")
KEPT_REQUESTS = Family(
    "shadow_tap_kept_requests",
    "gauge",
    "Requests whose copies are kept (live, or ended and not yet acknowledged by an analysis).",
    "requests",
)
UNKEPT = Family(
    "shadow_tap_unkept_total", "counter", "Copies not kept for a snapshot (--retain-bytes full).", "items"
)
MISSED = Family(
    "shadow_tap_missed_total",
    "counter",
    "Ended requests no analysis saw before they were dropped from the kept copies (--retain-bytes, "
    "--retain-ended).",
    "requests",
)
ATTACH_REFUSED = Family(
    "shadow_tap_attach_refused_total",
    "counter",
    "Attach connections refused, by reason: busy (too many in the handshake), timeout, closed, magic "
    "(not the attach handshake), protocol (another shadow version), proof (not the attach token), peer "
    "(another uid on the unix socket), hello (a malformed hello), full (8 analyses attached), draining.",
    "connections",
    ("reason",),
    {"reason": REFUSALS},
)
DETACHED = Family(
    "shadow_tap_analysis_detached_total",
    "counter",
    "Analyses detached, by reason: closed (it left, or its socket broke), replaced (another attached under "
    "its name), stalled (it took nothing while its share of --queue-bytes was full), overflow (what "
    "cannot be dropped for it passed another share, or one largest request head), bad_frame (a malformed "
    "control frame).",
    "analyses",
    ("reason",),
    {"reason": DETACH_REASONS},
)
PENDING_BYTES = Family(
    "shadow_tap_handoff_pending_bytes",
    "gauge",
    "Bytes of copies waiting to be written to the attached analyses, all together (snapshots excepted: "
    "they are the kept copies).",
    "bytes",
)
CLAMPED = Family(
    "shadow_tap_heads_clamped_total",
    "counter",
    f"Request heads sent to the analysis with a string (path, request id, header) cut to {FIELD_MAX} "
    "characters.",
    "requests",
)
RESTARTS = Family(
    "shadow_tap_relay_restarts_total",
    "counter",
    "Relays of this group restarted after one died (the supervisor's count when this one started).",
    "restarts",
)
STARTED = Family(
    "shadow_tap_relay_start_time_seconds", "gauge", "When this relay started (Unix time).", "seconds"
)
TAPS = TapFamilies(REQUESTS, CONNECT_ERRORS, REJECTED, CUT, CONNECTIONS)

FAMILIES = (
    REQUESTS,
    CONNECT_ERRORS,
    REJECTED,
    CUT,
    CONNECTIONS,
    INFLIGHT,
    ATTACHED,
    ATTACHES,
    HANDOFF_DROPPED,
    KEPT_BYTES,
    KEPT_REQUESTS,
    UNKEPT,
    MISSED,
    ATTACH_REFUSED,
    DETACHED,
    PENDING_BYTES,
    CLAMPED,
    RESTARTS,
    STARTED,
)


class RelayCollector(SourceCollector[Any]):
    """Reads a `Relay` (taps, hand-off, kept copies) at scrape time."""

    families = FAMILIES

    def collect(self) -> Iterator[Metric]:
        r = self.source
        sink = r.sink
        taps = r.taps
        yield from TAPS.collect(taps)
        yield INFLIGHT.sampled({t.name: t.inflight() for t in taps})
        yield ATTACHED.value(float(sink.attached or 0))
        yield ATTACHES.value(sink.attaches)
        yield HANDOFF_DROPPED.value(sink.dropped_total)
        yield KEPT_BYTES.value(sink.kept_bytes)
        yield KEPT_REQUESTS.value(sink.kept_requests)
        yield UNKEPT.value(sink.unkept)
        yield MISSED.value(sink.missed)
        yield ATTACH_REFUSED.sampled(dict(r.refused))
        yield DETACHED.sampled(dict(sink.detached))
        yield PENDING_BYTES.value(sink.pending_bytes)
        yield CLAMPED.value(sink.clamped)
        yield RESTARTS.value(r.spec.restarts)
        yield STARTED.value(r.started)
