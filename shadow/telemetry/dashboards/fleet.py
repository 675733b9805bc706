"""Fleet: per-worker KV load and active requests as the mirror sees them and as the workers report
them, the load distribution across workers, free slots, and per-worker loads inside each lane."""

from __future__ import annotations

from shadow.telemetry.dashboards._kit import Board, Layout, heat, level, levels, q, rates, ts

LANE = 'lane=~"$lane"'


def _per_worker(metric: str, agg: str = "sum") -> str:
    return level(metric, "worker", agg=agg)


def _panels(lay: Layout) -> None:
    lay.row("Mirrored load per worker")
    lay.add(ts("KV load per worker (mirror)",
               "Prompt + generated tokens of the requests the mirror holds on each worker (L_g).",
               "suffix: tok", q(_per_worker("shadow_mirror_kv_tokens"), "{{worker}}")))
    lay.add(ts("Active requests per worker (mirror)",
               "Requests the mirror holds as running on each worker.",
               "short", q(_per_worker("shadow_mirror_requests_active"), "{{worker}}")))
    lay.add(heat("KV load distribution across workers",
                 "At each time, how the workers' mirrored KV loads are spread (Grafana buckets the "
                 "per-worker values): a wide band is imbalance, a narrow one balance.",
                 "short", q(_per_worker("shadow_mirror_kv_tokens"), "{{worker}}"), calculate=True))
    lay.add(ts("Free decode slots per worker",
               "Configured slots minus mirrored active requests (shown when --slots is set).",
               "short", q(_per_worker("shadow_mirror_free_slots"), "{{worker}}")))
    lay.row("The workers' own figures")
    lay.add(ts("Running and waiting (worker's /metrics)",
               "vllm:num_requests_running and vllm:num_requests_waiting as the sidecar last scraped "
               "them from each worker.",
               "short", q(_per_worker("shadow_mirror_worker_requests_running"), "running {{worker}}"),
               q(_per_worker("shadow_mirror_worker_requests_waiting"), "waiting {{worker}}")))
    lay.add(ts("KV cache usage (worker's /metrics)",
               "Each worker's own KV cache usage (0–1), as last scraped.",
               "percentunit", q(_per_worker("shadow_mirror_worker_kv_usage_ratio", "max"), "{{worker}}"),
               max_=1))
    lay.add(ts("Finished requests per worker",
               "Requests per second that ended normally on each worker, from the mirror.",
               "reqps", rates("shadow_mirror_requests_finished_total", "worker")))
    lay.add(ts("Relayed requests per tap",
               "HTTP requests per second each tap relayed (all legs).",
               "reqps", rates("shadow_mirror_tap_requests_total", "worker")))
    lay.row("Per-worker load inside the lanes")
    lay.add(ts("KV load per worker in lane $lane",
               "Each lane's counterfactual per-worker KV load (lane `actual` replays the router's real "
               "placements).",
               "suffix: tok",
               levels("shadow_lane_worker_load_tokens", "lane, worker", LANE, agg="sum")))
    lay.add(ts("Active requests per worker in lane $lane",
               "Each lane's counterfactual running requests per worker.",
               "short",
               levels("shadow_lane_worker_active_requests", "lane, worker", LANE, agg="sum")))


BOARD = Board("shadow-fleet", "shadow / Fleet",
              "Per-worker load: the mirror's view (from the taps), the workers' own figures (scraped by "
              "the sidecar), and each lane's counterfactual placement.",
              _panels, lane=True)
