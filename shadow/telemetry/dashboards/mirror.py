"""Mirror health: events in, what was dropped and why (the caps that bit), parse and analysis
errors, drift against the workers, phantoms, staleness, and the live lanes' intake."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from shadow.telemetry.dashboards._kit import RATE, Layout, dashboard, q, sel, ts, variables

UID = "shadow-mirror-health"


def build() -> db.Dashboard:
    d = variables(dashboard(
        UID, "shadow / Mirror health",
        "Is the mirror's picture of the fleet complete and current? Events, drops, errors, drift, "
        "phantoms and staleness."))
    lay = Layout(d)
    lay.row("Intake")
    lay.add(ts("Events applied",
               "Normalised events per second applied to the mirror, by source (tap, api, reaper) and "
               "kind.",
               "ops", q(f"sum by (source, kind) (rate(shadow_mirror_events_total{sel()}[{RATE}]))",
                        "{{source}} {{kind}}")), w=8)
    lay.add(ts("Caps that bit (drops)",
               "Mirrored data dropped per second by reason — a bounded queue or buffer was full. The "
               "client traffic is never dropped.",
               "ops",
               q(f"sum by (reason) (rate(shadow_mirror_dropped_total{sel()}[{RATE}]))", "mirror {{reason}}"),
               q(f"sum by (reason) (rate(shadow_live_events_dropped_total{sel()}[{RATE}]))",
                 "lanes {{reason}}",
                 ref="B")), w=8)
    lay.add(ts("Analysis queue fill",
               "Items waiting between the taps and the analysis, as a share of the queue's capacity.",
               "percentunit", q(f"max by (instance) (shadow_mirror_queue_depth{sel()} "
                                f"/ shadow_mirror_queue_capacity{sel()})", "{{instance}}"), max_=1), w=8)
    lay.row("Errors")
    lay.add(ts("Rejected events (parse errors)",
               "Event-API lines rejected per second, by reason (bad JSON, schema, size, auth).",
               "ops", q(f"sum by (reason) (rate(shadow_mirror_events_rejected_total{sel()}[{RATE}]))",
                        "{{reason}}")), w=8)
    lay.add(ts("Ignored events",
               "Events that had no effect on the state per second, by reason (duplicates, unknown ids).",
               "ops", q(f"sum by (reason) (rate(shadow_mirror_events_ignored_total{sel()}[{RATE}]))",
                        "{{reason}}")), w=8)
    lay.add(ts("Analysis errors, gaps, upstream connect errors",
               "Exceptions isolated in the analysis by stage, gaps in copied streams after drops, and "
               "failed connections from taps to workers, per second.",
               "ops",
               q(f"sum by (stage) (rate(shadow_mirror_errors_total{sel()}[{RATE}]))", "error {{stage}}"),
               q(f"sum (rate(shadow_mirror_stream_gaps_total{sel()}[{RATE}]))", "stream gaps", ref="B"),
               q(f"sum by (worker) (rate(shadow_mirror_upstream_connect_errors_total{sel()}[{RATE}]))",
                 "connect {{worker}}", ref="C")), w=8)
    lay.row("Taps")
    lay.add(ts("Tap rejections by reason",
               "Requests or connections the taps refused or cut per second, by reason: hostile or "
               "broken peers (bad_framing, head_too_large, timeouts, path_not_allowed, upgrade) and "
               "the connection cap (busy, evicted_idle).",
               "reqps", q(f"sum by (reason) (rate(shadow_mirror_tap_rejected_total{sel()}[{RATE}]))",
                          "{{reason}}")), w=6)
    lay.add(ts("Client connections per tap",
               "Client connections open on each tap.",
               "short", q(f"sum by (worker) (shadow_mirror_tap_connections{sel()})", "{{worker}}")), w=6)
    lay.add(ts("Analysis queue bytes",
               "Payload bytes waiting between the taps and the analysis.",
               "bytes", q(f"sum by (instance) (shadow_mirror_queue_bytes{sel()})", "{{instance}}")), w=6)
    lay.add(ts("Forwarding (--forward)",
               "Events per second forwarded to another shadow, dropped (full buffer or failed post), "
               "and failed posts; all zero without --forward.",
               "ops",
               q(f"sum (rate(shadow_mirror_forward_sent_total{sel()}[{RATE}]))", "sent"),
               q(f"sum (rate(shadow_mirror_forward_dropped_total{sel()}[{RATE}]))", "dropped", ref="B"),
               q(f"sum (rate(shadow_mirror_forward_errors_total{sel()}[{RATE}]))", "errors", ref="C")), w=6)
    lay.row("Consistency with the workers")
    lay.add(ts("Drift per worker",
               "Mirrored active requests minus the worker's own running + waiting at the last scrape; "
               "a worker that refuses connections (dead rank) shows the slots the mirror still counts "
               "there. Near 0 is healthy; the ShadowStateDrift alert fires beyond ±2 for 2 minutes.",
               "short", q(f"max by (worker) (shadow_mirror_drift_requests{sel()})", "{{worker}}"), min_=None),
            w=8)
    lay.add(ts("Phantoms and pending",
               "Requests silent past the phantom age (never ended), and requests seen but not yet "
               "routed to a worker.",
               "short",
               q(f"sum (shadow_mirror_phantom_requests{sel()})", "phantoms"),
               q(f"sum (shadow_mirror_pending_requests{sel()})", "pending", ref="B")), w=8)
    lay.add(ts("Staleness",
               "Seconds since each worker's /metrics was last read, and the longest silence of a live "
               "mirrored request.",
               "s",
               q(f"max by (worker) (shadow_mirror_scrape_age_seconds{sel()})", "scrape age {{worker}}"),
               q(f"max (shadow_mirror_oldest_silence_seconds{sel()})", "oldest silence", ref="B")), w=8)
    lay.add(ts("Ends by reason",
               "Requests ended per second: finished, cancelled by the client, reaped by TTL.",
               "reqps",
               q(f"sum (rate(shadow_mirror_requests_finished_total{sel()}[{RATE}]))", "finished"),
               q(f"sum (rate(shadow_mirror_requests_cancelled_total{sel()}[{RATE}]))", "cancelled", ref="B"),
               q(f"sum (rate(shadow_mirror_requests_reaped_total{sel()}[{RATE}]))", "reaped", ref="C")), w=12)
    lay.add(ts("Worker scrape errors",
               "Failed scrapes of each worker's /metrics per second.",
               "ops", q(f"sum by (worker) (rate(shadow_mirror_scrape_errors_total{sel()}[{RATE}]))",
                        "{{worker}}")), w=12)
    lay.row("Live lanes intake")
    lay.add(ts("Lookahead stalls",
               "Admissions per second a lane held because a request's real end was not yet known "
               "(lanes never guess ends).",
               "ops", q(f"sum by (lane) (rate(shadow_lane_lookahead_stalls_total{sel()}[{RATE}]))",
                        "{{lane}}")),
            w=12)
    lay.add(ts("Lane lag",
               "How far each lane runs behind the live clock.",
               "s", q(f"max by (lane) (shadow_lane_lag_seconds{sel()})", "{{lane}}")), w=12)
    return lay.d
