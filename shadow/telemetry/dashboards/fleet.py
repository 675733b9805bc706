"""Fleet: per-worker KV load and active requests as the mirror sees them and as the workers report
them, the load distribution across workers, free slots, and per-worker loads inside each lane."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from shadow.telemetry.dashboards._kit import RATE, Layout, dashboard, heat, q, sel, ts, variables

UID = "shadow-fleet"


def build() -> db.Dashboard:
    d = variables(dashboard(
        UID, "shadow / Fleet",
        "Per-worker load: the mirror's view (from the taps), the workers' own figures (scraped by "
        "the sidecar), and each lane's counterfactual placement."), lane=True)
    lay = Layout(d)
    lay.row("Mirrored load per worker")
    lay.add(ts("KV load per worker (mirror)",
               "Prompt + generated tokens of the requests the mirror holds on each worker (L_g).",
               "suffix: tok", q(f"sum by (worker) (shadow_mirror_kv_tokens{sel()})", "{{worker}}")))
    lay.add(ts("Active requests per worker (mirror)",
               "Requests the mirror holds as running on each worker.",
               "short", q(f"sum by (worker) (shadow_mirror_requests_active{sel()})", "{{worker}}")))
    lay.add(heat("KV load distribution across workers",
                 "At each time, how the workers' mirrored KV loads are spread (Grafana buckets the "
                 "per-worker values): a wide band is imbalance, a narrow one balance.",
                 "short", q(f"sum by (worker) (shadow_mirror_kv_tokens{sel()})", "{{worker}}"),
                 calculate=True))
    lay.add(ts("Free decode slots per worker",
               "Configured slots minus mirrored active requests (shown when --slots is set).",
               "short", q(f"sum by (worker) (shadow_mirror_free_slots{sel()})", "{{worker}}")))
    lay.row("The workers' own figures")
    lay.add(ts("Running and waiting (worker's /metrics)",
               "vllm:num_requests_running and vllm:num_requests_waiting as the sidecar last scraped "
               "them from each worker.",
               "short",
               q(f"sum by (worker) (shadow_mirror_worker_requests_running{sel()})", "running {{worker}}"),
               q(f"sum by (worker) (shadow_mirror_worker_requests_waiting{sel()})", "waiting {{worker}}",
                 ref="B")))
    lay.add(ts("KV cache usage (worker's /metrics)",
               "Each worker's own KV cache usage (0–1), as last scraped.",
               "percentunit",
               q(f"max by (worker) (shadow_mirror_worker_kv_usage_ratio{sel()})", "{{worker}}"),
               max_=1))
    lay.add(ts("Finished requests per worker",
               "Requests per second that ended normally on each worker, from the mirror.",
               "reqps", q(f"sum by (worker) (rate(shadow_mirror_requests_finished_total{sel()}[{RATE}]))",
                          "{{worker}}")))
    lay.add(ts("Relayed requests per tap",
               "HTTP requests per second each tap relayed (all legs).",
               "reqps", q(f"sum by (worker) (rate(shadow_mirror_tap_requests_total{sel()}[{RATE}]))",
                          "{{worker}}")))
    lay.row("Per-worker load inside the lanes")
    lay.add(ts("KV load per worker in lane $lane",
               "Each lane's counterfactual per-worker KV load (lane `actual` replays the router's real "
               "placements).",
               "suffix: tok",
               q(f'sum by (lane, worker) (shadow_lane_worker_load_tokens{sel("lane=~" + QUOTE_LANE)})',
                 "{{lane}} {{worker}}")))
    lay.add(ts("Active requests per worker in lane $lane",
               "Each lane's counterfactual running requests per worker.",
               "short",
               q(f'sum by (lane, worker) (shadow_lane_worker_active_requests{sel("lane=~" + QUOTE_LANE)})',
                 "{{lane}} {{worker}}")))
    return lay.d


QUOTE_LANE = '"$lane"'
