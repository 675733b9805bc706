"""Mirror health: events in, what was dropped and why (the caps that bit), parse and analysis
errors, drift against the workers, phantoms, staleness, and the live lanes' intake."""

from __future__ import annotations

from shadow.telemetry.dashboards._kit import Board, Layout, levels, q, rates, sel, ts


def _panels(lay: Layout) -> None:
    lay.row("Intake")
    lay.add(ts("Events applied",
               "Normalised events per second applied to the mirror, by source (tap, api, reaper) and "
               "kind.",
               "ops", rates("shadow_mirror_events_total", "source, kind")), w=8)
    lay.add(ts("Caps that bit (drops)",
               "Mirrored data dropped per second by reason — a bounded queue or buffer was full. The "
               "client traffic is never dropped.",
               "ops", rates("shadow_mirror_dropped_total", "reason", name="mirror"),
               rates("shadow_live_events_dropped_total", "reason", name="lanes")), w=8)
    lay.add(ts("Analysis queue fill",
               "Items waiting between the taps and the analysis, as a share of the queue's capacity.",
               "percentunit", q(f"max by (instance) (shadow_mirror_queue_depth{sel()} "
                                f"/ shadow_mirror_queue_capacity{sel()})", "{{instance}}"), max_=1), w=8)
    lay.row("Errors")
    lay.add(ts("Rejected events (parse errors)",
               "Event-API lines rejected per second, by reason (bad JSON, schema, size, auth).",
               "ops", rates("shadow_mirror_events_rejected_total", "reason")), w=8)
    lay.add(ts("Ignored events",
               "Events that had no effect on the state per second, by reason (duplicates, unknown ids).",
               "ops", rates("shadow_mirror_events_ignored_total", "reason")), w=8)
    lay.add(ts("Analysis errors, gaps, upstream connect errors",
               "Exceptions isolated in the analysis by stage, gaps in copied streams after drops, and "
               "failed connections from taps to workers, per second.",
               "ops", rates("shadow_mirror_errors_total", "stage", name="error"),
               rates("shadow_mirror_stream_gaps_total", name="stream gaps"),
               rates("shadow_mirror_upstream_connect_errors_total", "worker", name="connect")), w=8)
    lay.row("Taps")
    lay.add(ts("Tap rejections by reason",
               "Requests or connections the taps refused or cut per second, by reason: hostile or "
               "broken peers (bad_framing, head_too_large, timeouts, path_not_allowed, upgrade) and "
               "the connection cap (busy, evicted_idle).",
               "reqps", rates("shadow_mirror_tap_rejected_total", "reason")), w=6)
    lay.add(ts("Client connections per tap", "Client connections open on each tap.",
               "short", levels("shadow_mirror_tap_connections", "worker", agg="sum")), w=6)
    lay.add(ts("Analysis queue bytes", "Payload bytes waiting between the taps and the analysis.",
               "bytes", levels("shadow_mirror_queue_bytes", "instance", agg="sum")), w=6)
    lay.add(ts("Forwarding (--forward)",
               "Events per second forwarded to another shadow, dropped (full buffer or failed post), "
               "and failed posts; all zero without --forward.",
               "ops", *(rates(f"shadow_mirror_forward_{x}_total", name=x)
                        for x in ("sent", "dropped", "errors"))), w=6)
    lay.row("Consistency with the workers")
    lay.add(ts("Drift per worker",
               "Mirrored active requests minus the worker's own running + waiting at the last scrape; "
               "a worker that refuses connections (dead rank) shows the slots the mirror still counts "
               "there. Near 0 is healthy; the ShadowStateDrift alert fires beyond ±2 for 2 minutes.",
               "short", levels("shadow_mirror_drift_requests", "worker"), min_=None), w=8)
    lay.add(ts("Phantoms and pending",
               "Requests silent past the phantom age (never ended), and requests seen but not yet "
               "routed to a worker.",
               "short", levels("shadow_mirror_phantom_requests", agg="sum", name="phantoms"),
               levels("shadow_mirror_pending_requests", agg="sum", name="pending")), w=8)
    lay.add(ts("Staleness",
               "Seconds since each worker's /metrics was last read, and the longest silence of a live "
               "mirrored request.",
               "s", levels("shadow_mirror_scrape_age_seconds", "worker", name="scrape age"),
               levels("shadow_mirror_oldest_silence_seconds", name="oldest silence")), w=8)
    lay.add(ts("Ends by reason",
               "Requests ended per second: finished, cancelled by the client, reaped by TTL.",
               "reqps", *(rates(f"shadow_mirror_requests_{x}_total", name=x)
                          for x in ("finished", "cancelled", "reaped"))), w=12)
    lay.add(ts("Worker scrape errors", "Failed scrapes of each worker's /metrics per second.",
               "ops", rates("shadow_mirror_scrape_errors_total", "worker")), w=12)
    lay.row("Live lanes intake")
    lay.add(ts("Lookahead stalls",
               "Admissions per second a lane held because a request's real end was not yet known "
               "(lanes never guess ends).",
               "ops", rates("shadow_lane_lookahead_stalls_total", "lane")), w=12)
    lay.add(ts("Lane lag", "How far each lane runs behind the live clock.",
               "s", levels("shadow_lane_lag_seconds", "lane")), w=12)


BOARD = Board("shadow-mirror-health", "shadow / Mirror health",
              "Is the mirror's picture of the fleet complete and current? Events, drops, errors, drift, "
              "phantoms and staleness.",
              _panels)
