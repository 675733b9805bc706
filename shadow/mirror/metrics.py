"""Prometheus export of the mirror: one custom collector reading plain counters at scrape time.

Its families are declared here (`FAMILIES`): `shadow_mirror_*` in base units with bounded labels;
request ids never appear. Reading at scrape time keeps the data path free of metric-library calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import Metric

from shadow.base.families import DeclaredCollector, Family, SourceCollector
from shadow.capture.passive import Capture
from shadow.contracts.events import EVENT_TYPES
from shadow.contracts.tapwire import CUT_REASONS
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.relay_metrics import TapFamilies
from shadow.dataplane.tap import Tap
from shadow.mirror.analyzer import OUTPUT_SOURCES, Analyzer
from shadow.mirror.emitter import Emitter
from shadow.mirror.hub import SOURCES, Mirror
from shadow.mirror.reconcile import Reconciler
from shadow.mirror.relayview import RemoteQueue, RemoteTap

W = ("worker",)
REQUESTS_ACTIVE = Family("shadow_mirror_requests_active", "gauge",
                         "Mirrored requests active on each worker.", "requests", W)
KV_TOKENS = Family("shadow_mirror_kv_tokens", "gauge",
                   "Mirrored KV tokens (prompt + generated) per worker.", "tokens", W)
FREE_SLOTS = Family("shadow_mirror_free_slots", "gauge",
                    "Free decode slots per worker (when slots are configured).", "slots", W)
FINISHED = Family("shadow_mirror_requests_finished_total", "counter",
                  "Mirrored requests that finished, per worker.", "requests", W)
CANCELLED = Family("shadow_mirror_requests_cancelled_total", "counter",
                   "Mirrored requests cancelled by the client.", "requests", W)
REAPED = Family("shadow_mirror_requests_reaped_total", "counter",
                "Mirrored requests ended by TTL reaping.", "requests", W)
PHANTOMS = Family("shadow_mirror_phantom_requests", "gauge",
                  "Requests not ended and silent for longer than the phantom age.", "requests")
PENDING = Family("shadow_mirror_pending_requests", "gauge",
                 "Requests seen but not yet routed to a worker.", "requests")
OLDEST_SILENCE = Family("shadow_mirror_oldest_silence_seconds", "gauge",
                        "Longest silence of a live mirrored request.", "seconds")
ORPHANS = Family("shadow_mirror_orphan_events_total", "counter",
                 "Events for requests never arrived or routed.", "events")
EVENTS = Family("shadow_mirror_events_total", "counter",
                "Normalised events applied to the mirror.", "events", ("source", "kind"),
                {"source": SOURCES, "kind": tuple(EVENT_TYPES)})
IGNORED = Family("shadow_mirror_events_ignored_total", "counter",
                 "Events applied without effect, by reason.", "events", ("reason",))
REJECTED = Family("shadow_mirror_events_rejected_total", "counter",
                  "Event API lines rejected, by reason.", "events", ("reason",))
DROPPED = Family("shadow_mirror_dropped_total", "counter",
                 "Mirrored data dropped, by reason (never the traffic).", "items", ("reason",))
ERRORS = Family("shadow_mirror_errors_total", "counter",
                "Exceptions in the analysis side, by stage (isolated).", "errors", ("stage",))
QUEUE_DEPTH = Family("shadow_mirror_queue_depth", "gauge",
                     "Items waiting in the tap-to-analysis queue.", "items")
QUEUE_CAPACITY = Family("shadow_mirror_queue_capacity", "gauge",
                        "Capacity of the tap-to-analysis queue.", "items")
CHUNKS = Family("shadow_mirror_chunks_total", "counter",
                "Response body pieces analysed, per tap.", "chunks", W)
OUTPUT_COUNTS = Family(
    "shadow_mirror_output_counts_total", "counter",
    "Finished decode responses by what their output token count came from: usage, token_ids, "
    "max_tokens (ended for length), chunks (a lower bound: vLLM merges tokens into one chunk under "
    "load), none.", "requests", ("worker", "source"), {"source": OUTPUT_SOURCES})
LEGS = Family("shadow_mirror_legs_total", "counter",
              "Requests seen by taps, by leg (prefill/decode).", "requests", ("worker", "leg"))
TAP_ENDS = Family("shadow_mirror_tap_ends_total", "counter",
                  "Ends of proxied requests, by reason.", "requests", ("worker", "reason"))
LEGS_INFLIGHT = Family("shadow_mirror_legs_inflight", "gauge",
                       "Legs in flight through each tap.", "requests", W)
TOKENS_HELD = Family("shadow_mirror_tokens_held", "gauge",
                     "Streams whose newest Token the hub holds until its interval ends (--token-interval).",
                     "streams")
TOKENS_COALESCED = Family("shadow_mirror_tokens_coalesced_total", "counter",
                          "Tap Tokens replaced by a newer one of their stream in the same interval, never "
                          "passed on (--token-interval).", "events")
STEP_ENDS = Family("shadow_mirror_step_ends_total", "counter",
                   "Decode step ends found in the taps' chunks and carried on held Tokens "
                   "(--token-interval).", "steps")
TOKENS_FULL = Family("shadow_mirror_tokens_full_total", "counter",
                     "Held Tokens passed on before their interval ended: they carried the most step ends one "
                     "Token takes (--token-interval).", "events")
STREAM_GAPS = Family("shadow_mirror_stream_gaps_total", "counter",
                     "Gaps in copied streams after queue drops.", "gaps")
TAP_REQUESTS = Family("shadow_mirror_tap_requests_total", "counter",
                      "HTTP requests relayed by each tap.", "requests", W)
CONNECT_ERRORS = Family("shadow_mirror_upstream_connect_errors_total", "counter",
                        "Failed connections to upstream workers.", "errors", W)
TAP_REJECTED = Family(
    "shadow_mirror_tap_rejected_total", "counter",
    "Requests or connections a tap refused or cut, by reason (bad_framing, head_too_large, "
    "header_timeout, body_timeout, idle_timeout, path_not_allowed, upgrade, busy, evicted_idle, "
    "not_resent, bad_upstream_response, linger_cut).", "requests", ("worker", "reason"))
TAP_CUT = Family(
    "shadow_mirror_tap_streams_cut_total", "counter",
    "Responses a tap cut after their head (the client got an SSE error event and an aborted body), by "
    "reason.", "requests", ("worker", "reason"), {"reason": CUT_REASONS})
TAP_CONNECTIONS = Family("shadow_mirror_tap_connections", "gauge",
                         "Client connections open on each tap.", "connections", W)
TAPS = TapFamilies(TAP_REQUESTS, CONNECT_ERRORS, TAP_REJECTED, TAP_CUT, TAP_CONNECTIONS)
QUEUE_BYTES = Family("shadow_mirror_queue_bytes", "gauge",
                     "Payload bytes waiting in the tap-to-analysis queue.", "bytes")
FORWARD_SENT = Family("shadow_mirror_forward_sent_total", "counter",
                      "Events forwarded (--forward).", "events")
FORWARD_DROPPED = Family("shadow_mirror_forward_dropped_total", "counter",
                         "Events not forwarded (full buffer or a failed post).", "events")
FORWARD_ERRORS = Family(
    "shadow_mirror_forward_errors_total", "counter",
    "Failed forwarding posts (network errors and HTTP statuses >= 400, e.g. 401).", "errors")
DRAINING = Family("shadow_mirror_draining_requests", "gauge",
                  "Mirrored requests the worker has finished (vllm:request_success_total) whose streams "
                  "still drain to the client; left out of the drift.", "requests", W)
DRIFT_REQUESTS = Family(
    "shadow_mirror_drift_requests", "gauge",
    "Mirrored active minus the worker's running+waiting requests at the last scrape (0 when the page "
    "matches the mirror at some point of the round); for a worker that refuses connections (gone), "
    "the slots the mirror still counts there.", "requests", W)
DRIFT_KV = Family("shadow_mirror_drift_kv_ratio", "gauge",
                  "Mirrored KV share minus the worker's KV cache usage (when capacity is known).", "ratio", W)
WORKER_RUNNING = Family("shadow_mirror_worker_requests_running", "gauge",
                        "The worker's vllm:num_requests_running.", "requests", W)
WORKER_WAITING = Family("shadow_mirror_worker_requests_waiting", "gauge",
                        "The worker's vllm:num_requests_waiting.", "requests", W)
WORKER_KV = Family("shadow_mirror_worker_kv_usage_ratio", "gauge",
                   "The worker's KV cache usage (0-1).", "ratio", W)
SCRAPE_AGE = Family("shadow_mirror_scrape_age_seconds", "gauge",
                    "Seconds since the last good scrape.", "seconds", W)
SCRAPE_ERRORS = Family("shadow_mirror_scrape_errors_total", "counter",
                       "Failed scrapes of worker /metrics.", "errors", W)
DRIFT_UNSETTLED = Family(
    "shadow_mirror_drift_unsettled_total", "counter",
    "Reconciliation rounds whose drift was taken before the analysis had taken in what the taps had seen "
    "when the scrapes returned (it was further behind than min(1 s, the scrape interval)).", "rounds")

#: Every family `MirrorCollector` may yield, in the order it yields them.
FAMILIES = (
    REQUESTS_ACTIVE, KV_TOKENS, FREE_SLOTS, FINISHED, CANCELLED, REAPED, PHANTOMS, PENDING,
    OLDEST_SILENCE, ORPHANS, EVENTS, IGNORED, REJECTED, DROPPED, ERRORS, TOKENS_HELD, TOKENS_COALESCED,
    STEP_ENDS, TOKENS_FULL,
    QUEUE_DEPTH, QUEUE_CAPACITY,
    CHUNKS, OUTPUT_COUNTS, LEGS, TAP_ENDS, LEGS_INFLIGHT, STREAM_GAPS, TAP_REQUESTS, CONNECT_ERRORS,
    TAP_REJECTED, TAP_CUT, TAP_CONNECTIONS, QUEUE_BYTES, FORWARD_SENT, FORWARD_DROPPED, FORWARD_ERRORS,
    DRIFT_REQUESTS,
    DRAINING, DRIFT_KV, WORKER_RUNNING, WORKER_WAITING, WORKER_KV, SCRAPE_AGE, SCRAPE_ERRORS, DRIFT_UNSETTLED,
)


class MirrorCollector(DeclaredCollector):
    """Collects the mirror's state and counters; any part may be None (e.g. API-only)."""

    families = FAMILIES

    def __init__(
        self,
        mirror: Mirror,
        *,
        analyzer: Analyzer | None = None,
        queue: DropQueue | RemoteQueue | None = None,
        taps: Iterable[Tap | RemoteTap] = (),
        reconciler: Reconciler | None = None,
        rejected: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        emitter: Emitter | None = None,
    ) -> None:
        self.emitter = emitter
        self.mirror = mirror
        self.analyzer = analyzer
        self.queue = queue
        self.taps = list(taps)
        self.reconciler = reconciler
        self.rejected = rejected if rejected is not None else {}
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        m = self.mirror
        st = m.state
        ws = st.workers
        yield REQUESTS_ACTIVE.sampled({w: c.active for w, c in ws.items()})
        yield KV_TOKENS.sampled({w: c.kv_tokens for w, c in ws.items()})
        yield FREE_SLOTS.sampled(
            {w: (max(0, c.slots - c.active) if c.slots is not None else None) for w, c in ws.items()})
        yield FINISHED.sampled({w: c.finished for w, c in ws.items()})
        yield CANCELLED.sampled({w: c.cancelled for w, c in ws.items()})
        yield REAPED.sampled({w: c.reaped for w, c in ws.items()})
        yield PHANTOMS.value(st.phantoms(now))
        yield PENDING.value(st.pending())
        yield OLDEST_SILENCE.value(st.oldest_silence(now))
        yield ORPHANS.value(st.orphans)
        yield EVENTS.sampled(m.events)
        yield IGNORED.sampled(m.ignored)
        yield REJECTED.sampled(self.rejected)
        dropped = dict(m.dropped)
        if self.queue is not None:
            dropped["queue_full"] = dropped.get("queue_full", 0) + self.queue.dropped
        if m.recorder is not None:
            dropped["record_full"] = m.recorder.dropped
        yield DROPPED.sampled(dropped)
        errors = dict(m.errors)
        errors["listener"] = m.listener_errors
        if m.recorder is not None:
            errors["record"] = m.recorder.errors
        yield ERRORS.sampled(errors)
        hold = m.hold  # zeros without --token-interval
        yield TOKENS_HELD.value(len(hold) if hold is not None else 0)
        yield TOKENS_COALESCED.value(hold.coalesced if hold is not None else 0)
        yield STEP_ENDS.value(hold.step_ends if hold is not None else 0)
        yield TOKENS_FULL.value(hold.full if hold is not None else 0)
        if self.queue is not None:
            yield QUEUE_DEPTH.value(len(self.queue))
            yield QUEUE_CAPACITY.value(self.queue.maxsize)
        a = self.analyzer
        if a is not None:
            yield CHUNKS.sampled(a.chunks)
            yield OUTPUT_COUNTS.sampled(a.output_counts)
            yield LEGS.sampled(a.legs)
            yield TAP_ENDS.sampled(a.ends)
            yield LEGS_INFLIGHT.sampled(a.inflight)
            yield STREAM_GAPS.value(a.gaps)
        if self.taps:
            yield from TAPS.collect(self.taps)
        if self.queue is not None:
            yield QUEUE_BYTES.value(self.queue.bytes)
        em = self.emitter  # zeros without --forward
        yield FORWARD_SENT.value(em.sent if em else 0)
        yield FORWARD_DROPPED.value(em.dropped if em else 0)
        yield FORWARD_ERRORS.value(em.errors if em else 0)
        r = self.reconciler
        if r is not None:
            rw = r.workers
            yield DRIFT_REQUESTS.sampled({w: x.drift_requests for w, x in rw.items()})
            yield DRAINING.sampled({w: x.draining for w, x in rw.items()})
            yield DRIFT_KV.sampled({w: x.drift_kv_ratio for w, x in rw.items()})
            yield WORKER_RUNNING.sampled({w: (x.load.running if x.load else None) for w, x in rw.items()})
            yield WORKER_WAITING.sampled({w: (x.load.waiting if x.load else None) for w, x in rw.items()})
            yield WORKER_KV.sampled({w: (x.load.kv_usage if x.load else None) for w, x in rw.items()})
            yield SCRAPE_AGE.sampled(
                {w: (now - x.last_ok if x.last_ok is not None else None) for w, x in rw.items()})
            yield SCRAPE_ERRORS.sampled({w: x.errors for w, x in rw.items()})
            yield DRIFT_UNSETTLED.value(r.unsettled)


CAPTURE_SEGMENTS = Family("shadow_capture_segments_total", "counter", "TCP segments read off the interface.",
                          "segments")
CAPTURE_REQUESTS = Family("shadow_capture_requests_total", "counter",
                          "HTTP requests reassembled from the capture.", "requests")
CAPTURE_BYTES = Family("shadow_capture_bytes_total", "counter", "TCP payload bytes reassembled, by "
                                                                "direction.",
                       "bytes", ("direction",), {"direction": ("to_server", "to_client")})
CAPTURE_GAP_BYTES = Family("shadow_capture_gap_bytes_total", "counter",
                           "TCP payload bytes never seen (reassembly gaps; the exchange they belong to is "
                           "marked, never guessed).", "bytes")
CAPTURE_SEEN = Family("shadow_capture_seen_ratio", "gauge", "Share of the connections' bytes the capture "
                                                            "saw.",
                      "ratio")
CAPTURE_DROPS = Family("shadow_capture_kernel_drops_total", "counter",
                       "Packets the kernel dropped because the capture read them too slowly.", "packets")
CAPTURE_PARSE_ERRORS = Family("shadow_capture_parse_errors_total", "counter",
                              "HTTP messages the capture could not parse.", "messages")
CAPTURE_FLOWS = Family("shadow_capture_flows", "gauge", "Connections the capture follows now.", "connections")
CAPTURE_FAMILIES = (CAPTURE_SEGMENTS, CAPTURE_REQUESTS, CAPTURE_BYTES, CAPTURE_GAP_BYTES, CAPTURE_SEEN,
                    CAPTURE_DROPS, CAPTURE_PARSE_ERRORS, CAPTURE_FLOWS)


class CaptureCollector(SourceCollector[Capture]):
    """Passive capture's counters: what it saw of the traffic and what it could not reassemble."""

    families = CAPTURE_FAMILIES

    def collect(self) -> Iterator[Metric]:
        c = self.source
        b = c.byte_counts()
        yield CAPTURE_SEGMENTS.value(c.segments)
        yield CAPTURE_REQUESTS.value(c.requests)
        yield CAPTURE_BYTES.sampled({"to_server": b["to_server"], "to_client": b["to_client"]})
        yield CAPTURE_GAP_BYTES.value(b["gap"])
        yield CAPTURE_SEEN.value(c.seen_ratio())
        yield CAPTURE_DROPS.value(c.kernel_drops)
        yield CAPTURE_PARSE_ERRORS.value(c.parse_errors)
        yield CAPTURE_FLOWS.value(len(c.flows))
