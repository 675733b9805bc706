"""Mirror health: events in, what was dropped and why (the caps that bit), parse and analysis
errors, drift against the workers, phantoms, staleness, and the live lanes' intake."""

from __future__ import annotations

from shadow.telemetry.dashboards._kit import Board, Layout, level, q, rate, sel, ts


def _panels(lay: Layout) -> None:
    lay.row("Intake")
    lay.add(ts("Events applied",
               "Normalised events per second applied to the mirror, by source (tap, api, reaper) and "
               "kind.",
               "ops", q(rate("shadow_mirror_events_total", "source, kind"), "{{source}} {{kind}}")), w=8)
    lay.add(ts("Caps that bit (drops)",
               "Mirrored data dropped per second by reason — a bounded queue or buffer was full. The "
               "client traffic is never dropped.",
               "ops", q(rate("shadow_mirror_dropped_total", "reason"), "mirror {{reason}}"),
               q(rate("shadow_live_events_dropped_total", "reason"), "lanes {{reason}}")), w=8)
    lay.add(ts("Analysis queue fill",
               "Items waiting between the taps and the analysis, as a share of the queue's capacity.",
               "percentunit", q(f"max by (instance) (shadow_mirror_queue_depth{sel()} "
                                f"/ shadow_mirror_queue_capacity{sel()})", "{{instance}}"), max_=1), w=8)
    lay.row("Errors")
    lay.add(ts("Rejected events (parse errors)",
               "Event-API lines rejected per second, by reason (bad JSON, schema, size, auth).",
               "ops", q(rate("shadow_mirror_events_rejected_total", "reason"), "{{reason}}")), w=8)
    lay.add(ts("Ignored events",
               "Events that had no effect on the state per second, by reason (duplicates, unknown ids).",
               "ops", q(rate("shadow_mirror_events_ignored_total", "reason"), "{{reason}}")), w=8)
    lay.add(ts("Analysis errors, gaps, upstream connect errors",
               "Exceptions isolated in the analysis by stage, gaps in copied streams after drops, and "
               "failed connections from taps to workers, per second.",
               "ops", q(rate("shadow_mirror_errors_total", "stage"), "error {{stage}}"),
               q(rate("shadow_mirror_stream_gaps_total"), "stream gaps"),
               q(rate("shadow_mirror_upstream_connect_errors_total", "worker"), "connect {{worker}}")), w=8)
    lay.row("Taps")
    lay.add(ts("Tap rejections by reason",
               "Requests or connections the taps refused or cut per second, by reason: hostile or "
               "broken peers (bad_framing, head_too_large, timeouts, path_not_allowed, upgrade) and "
               "the connection cap (busy, evicted_idle).",
               "reqps", q(rate("shadow_mirror_tap_rejected_total", "reason"), "{{reason}}")), w=6)
    lay.add(ts("Client connections per tap", "Client connections open on each tap.",
               "short", q(level("shadow_mirror_tap_connections", "worker", agg="sum"), "{{worker}}")), w=6)
    lay.add(ts("Analysis queue bytes", "Payload bytes waiting between the taps and the analysis.",
               "bytes", q(level("shadow_mirror_queue_bytes", "instance", agg="sum"), "{{instance}}")), w=6)
    lay.add(ts("Forwarding (--forward)",
               "Events per second forwarded to another shadow, dropped (full buffer or failed post), "
               "and failed posts; all zero without --forward.",
               "ops", q(rate("shadow_mirror_forward_sent_total"), "sent"),
               q(rate("shadow_mirror_forward_dropped_total"), "dropped"),
               q(rate("shadow_mirror_forward_errors_total"), "errors")), w=6)
    lay.row("Consistency with the workers")
    lay.add(ts("Drift per worker",
               "Mirrored active requests minus the worker's own running + waiting at the last scrape; "
               "a worker that refuses connections (dead rank) shows the slots the mirror still counts "
               "there. Near 0 is healthy; the ShadowStateDrift alert fires beyond ±2 for 2 minutes.",
               "short", q(level("shadow_mirror_drift_requests", "worker"), "{{worker}}"), min_=None), w=8)
    lay.add(ts("Phantoms and pending",
               "Requests silent past the phantom age (never ended), and requests seen but not yet "
               "routed to a worker.",
               "short", q(level("shadow_mirror_phantom_requests", agg="sum"), "phantoms"),
               q(level("shadow_mirror_pending_requests", agg="sum"), "pending")), w=8)
    lay.add(ts("Staleness",
               "Seconds since each worker's /metrics was last read, and the longest silence of a live "
               "mirrored request.",
               "s", q(level("shadow_mirror_scrape_age_seconds", "worker"), "scrape age {{worker}}"),
               q(level("shadow_mirror_oldest_silence_seconds"), "oldest silence")), w=8)
    lay.add(ts("Ends by reason",
               "Requests ended per second: finished, cancelled by the client, reaped by TTL.",
               "reqps", q(rate("shadow_mirror_requests_finished_total"), "finished"),
               q(rate("shadow_mirror_requests_cancelled_total"), "cancelled"),
               q(rate("shadow_mirror_requests_reaped_total"), "reaped")), w=12)
    lay.add(ts("Worker scrape errors", "Failed scrapes of each worker's /metrics per second.",
               "ops", q(rate("shadow_mirror_scrape_errors_total", "worker"), "{{worker}}")), w=12)
    lay.row("Live lanes intake")
    lay.add(ts("Lookahead stalls",
               "Admissions per second a lane held because a request's real end was not yet known "
               "(lanes never guess ends).",
               "ops", q(rate("shadow_lane_lookahead_stalls_total", "lane"), "{{lane}}")), w=12)
    lay.add(ts("Lane lag", "How far each lane runs behind the live clock.",
               "s", q(level("shadow_lane_lag_seconds", "lane"), "{{lane}}")), w=12)


BOARD = Board("shadow-mirror-health", "shadow / Mirror health",
              "Is the mirror's picture of the fleet complete and current? Events, drops, errors, drift, "
              "phantoms and staleness.",
              _panels)
