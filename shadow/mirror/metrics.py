"""Prometheus export of the mirror: one custom collector reading plain counters at scrape time.

Everything is `shadow_mirror_*` in base units with bounded labels (worker, reason, source, kind,
leg, stage); request ids never appear. Register with `registry.register(MirrorCollector(...))` on a
registry passed in (no global registry). Reading at scrape time keeps the data path free of
metric-library calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shadow.mirror.analyzer import Analyzer
from shadow.mirror.dropqueue import DropQueue
from shadow.mirror.emitter import Emitter
from shadow.mirror.hub import Mirror
from shadow.mirror.proxy import Tap
from shadow.mirror.reconcile import Reconciler
from shadow.mirror.relayview import RemoteQueue, RemoteTap


def _counter(name: str, doc: str, labels: list[str], values: Mapping[Any, int | float]) -> Metric:
    m = CounterMetricFamily(name, doc, labels=labels)
    for key, v in values.items():
        lv = list(key) if isinstance(key, tuple) else [key]
        m.add_metric([str(x) for x in lv], v)
    return m


def _gauge(name: str, doc: str, labels: list[str], values: Mapping[Any, int | float | None]) -> Metric:
    m = GaugeMetricFamily(name, doc, labels=labels)
    for key, v in values.items():
        if v is None:
            continue
        lv = list(key) if isinstance(key, tuple) else [key]
        m.add_metric([str(x) for x in lv], v)
    return m


class MirrorCollector(Collector):
    """Collects the mirror's state and counters; any part may be None (e.g. API-only)."""

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
        yield _gauge(
            "shadow_mirror_requests_active",
            "Mirrored requests active on each worker.",
            ["worker"],
            {w: c.active for w, c in ws.items()},
        )
        yield _gauge(
            "shadow_mirror_kv_tokens",
            "Mirrored KV tokens (prompt + generated) per worker.",
            ["worker"],
            {w: c.kv_tokens for w, c in ws.items()},
        )
        yield _gauge(
            "shadow_mirror_free_slots",
            "Free decode slots per worker (when slots are configured).",
            ["worker"],
            {w: (max(0, c.slots - c.active) if c.slots is not None else None) for w, c in ws.items()},
        )
        yield _counter(
            "shadow_mirror_requests_finished",
            "Mirrored requests that finished, per worker.",
            ["worker"],
            {w: c.finished for w, c in ws.items()},
        )
        yield _counter(
            "shadow_mirror_requests_cancelled",
            "Mirrored requests cancelled by the client.",
            ["worker"],
            {w: c.cancelled for w, c in ws.items()},
        )
        yield _counter(
            "shadow_mirror_requests_reaped",
            "Mirrored requests ended by TTL reaping.",
            ["worker"],
            {w: c.reaped for w, c in ws.items()},
        )
        yield _gauge(
            "shadow_mirror_phantom_requests",
            "Requests not ended and silent for longer than the phantom age.",
            [],
            {(): st.phantoms(now)},
        )
        yield _gauge(
            "shadow_mirror_pending_requests",
            "Requests seen but not yet routed to a worker.",
            [],
            {(): st.pending()},
        )
        yield _gauge(
            "shadow_mirror_oldest_silence_seconds",
            "Longest silence of a live mirrored request.",
            [],
            {(): st.oldest_silence(now)},
        )
        yield _counter(
            "shadow_mirror_orphan_events",
            "Events for requests never arrived or routed.",
            [],
            {(): st.orphans},
        )
        yield _counter(
            "shadow_mirror_events", "Normalised events applied to the mirror.", ["source", "kind"], m.events
        )
        yield _counter(
            "shadow_mirror_events_ignored", "Events applied without effect, by reason.", ["reason"], m.ignored
        )
        yield _counter(
            "shadow_mirror_events_rejected", "Event API lines rejected, by reason.", ["reason"], self.rejected
        )
        dropped = dict(m.dropped)
        if self.queue is not None:
            dropped["queue_full"] = dropped.get("queue_full", 0) + self.queue.dropped
        if m.recorder is not None:
            dropped["record_full"] = m.recorder.dropped
        yield _counter(
            "shadow_mirror_dropped",
            "Mirrored data dropped, by reason (never the traffic).",
            ["reason"],
            dropped,
        )
        errors = dict(m.errors)
        errors["listener"] = m.listener_errors
        if m.recorder is not None:
            errors["record"] = m.recorder.errors
        yield _counter(
            "shadow_mirror_errors", "Exceptions in the analysis side, by stage (isolated).", ["stage"], errors
        )
        if self.queue is not None:
            yield _gauge(
                "shadow_mirror_queue_depth",
                "Items waiting in the tap-to-analysis queue.",
                [],
                {(): len(self.queue)},
            )
            yield _gauge(
                "shadow_mirror_queue_capacity",
                "Capacity of the tap-to-analysis queue.",
                [],
                {(): self.queue.maxsize},
            )
        a = self.analyzer
        if a is not None:
            yield _counter(
                "shadow_mirror_chunks", "Response body pieces analysed, per tap.", ["worker"], a.chunks
            )
            yield _counter(
                "shadow_mirror_legs",
                "Requests seen by taps, by leg (prefill/decode).",
                ["worker", "leg"],
                a.legs,
            )
            yield _counter(
                "shadow_mirror_tap_ends", "Ends of proxied requests, by reason.", ["worker", "reason"], a.ends
            )
            yield _gauge(
                "shadow_mirror_legs_inflight", "Legs in flight through each tap.", ["worker"], a.inflight
            )
            yield _counter(
                "shadow_mirror_stream_gaps", "Gaps in copied streams after queue drops.", [], {(): a.gaps}
            )
        if self.taps:
            yield _counter(
                "shadow_mirror_tap_requests",
                "HTTP requests relayed by each tap.",
                ["worker"],
                {t.name: t.requests for t in self.taps},
            )
            yield _counter(
                "shadow_mirror_upstream_connect_errors",
                "Failed connections to upstream workers.",
                ["worker"],
                {t.name: t.connect_errors for t in self.taps},
            )
            yield _counter(
                "shadow_mirror_tap_rejected",
                "Requests or connections a tap refused or cut, by reason (bad_framing, head_too_large, "
                "header_timeout, body_timeout, idle_timeout, path_not_allowed, upgrade, busy, evicted_idle, "
                "not_resent, "
                "bad_upstream_response).",
                ["worker", "reason"],
                {(t.name, k): v for t in self.taps for k, v in list(t.rejected.items())},
            )
            yield _gauge(
                "shadow_mirror_tap_connections",
                "Client connections open on each tap.",
                ["worker"],
                {t.name: t.connections for t in self.taps},
            )
        if self.queue is not None:
            yield _gauge(
                "shadow_mirror_queue_bytes",
                "Payload bytes waiting in the tap-to-analysis queue.",
                [],
                {(): self.queue.bytes},
            )
        em = self.emitter  # zeros without --forward
        yield _counter(
            "shadow_mirror_forward_sent", "Events forwarded (--forward).", [], {(): em.sent if em else 0}
        )
        yield _counter(
            "shadow_mirror_forward_dropped",
            "Events not forwarded (full buffer or a failed post).",
            [],
            {(): em.dropped if em else 0},
        )
        yield _counter(
            "shadow_mirror_forward_errors",
            "Failed forwarding posts (network errors and HTTP statuses >= 400, e.g. 401).",
            [],
            {(): em.errors if em else 0},
        )
        r = self.reconciler
        if r is not None:
            rw = r.workers
            yield _gauge(
                "shadow_mirror_drift_requests",
                "Mirrored active minus the worker's running+waiting requests at the last scrape; for a "
                "worker that refuses connections (gone), the slots the mirror still counts there.",
                ["worker"],
                {w: x.drift_requests for w, x in rw.items()},
            )
            yield _gauge(
                "shadow_mirror_drift_kv_ratio",
                "Mirrored KV share minus the worker's KV cache usage (when capacity is known).",
                ["worker"],
                {w: x.drift_kv_ratio for w, x in rw.items()},
            )
            yield _gauge(
                "shadow_mirror_worker_requests_running",
                "The worker's vllm:num_requests_running.",
                ["worker"],
                {w: (x.load.running if x.load else None) for w, x in rw.items()},
            )
            yield _gauge(
                "shadow_mirror_worker_requests_waiting",
                "The worker's vllm:num_requests_waiting.",
                ["worker"],
                {w: (x.load.waiting if x.load else None) for w, x in rw.items()},
            )
            yield _gauge(
                "shadow_mirror_worker_kv_usage_ratio",
                "The worker's KV cache usage (0-1).",
                ["worker"],
                {w: (x.load.kv_usage if x.load else None) for w, x in rw.items()},
            )
            yield _gauge(
                "shadow_mirror_scrape_age_seconds",
                "Seconds since the last good scrape.",
                ["worker"],
                {w: (now - x.last_ok if x.last_ok is not None else None) for w, x in rw.items()},
            )
            yield _counter(
                "shadow_mirror_scrape_errors",
                "Failed scrapes of worker /metrics.",
                ["worker"],
                {w: x.errors for w, x in rw.items()},
            )
