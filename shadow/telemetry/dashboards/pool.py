"""Pool and transfer: late binding's cost — the Prompt Pool's depth, wait quantiles, TTL expiries
and starvation guard; KV transfers in flight, their time, retries and recomputations; and the
routing round's compute time split into BalanceRoute's Stage 1 and Stage 2."""

from __future__ import annotations

from shadow.telemetry.dashboards._hist import bucket_heat, quantiles
from shadow.telemetry.dashboards._kit import Board, Layout, levels, q, rate, rates, ts


def _panels(lay: Layout) -> None:
    lay.row("Prompt Pool")
    lay.add(ts("Pool depth", "Requests waiting in the Prompt Pool: prefill done, decode not yet dispatched.",
               "short", levels("shadow_pool_requests", "instance", agg="sum", name="waiting")), w=8)
    lay.add(ts("Oldest pool entry",
               "Age of the oldest entry in the Prompt Pool: it grows when decode capacity is short or "
               "the scores pass it over (the starvation guard bounds it).",
               "s", levels("shadow_pool_oldest_seconds", "instance")), w=8)
    lay.add(ts("Pool wait quantiles",
               "p50, p95 and p99 of the time from prefill done to decode dispatch (alert "
               "ShadowPoolWaitRising when the tail rises with throughput).",
               "s", *quantiles("shadow_pool_wait_seconds")), w=8)
    lay.add(ts("TTL expiries and starvation guard",
               "Pool entries per second released by the TTL reaper, and dispatched by the age "
               "(starvation) guard rather than by score.",
               "ops", rates("shadow_pool_reaped_total", name="TTL expiries"),
               rates("shadow_pool_starvation_guard_total", name="starvation guard")), w=12)
    lay.add(ts("Starvation-guard share of dispatches",
               "Share of pool dispatches over the window made by the age guard: high means the "
               "scores keep passing the same requests over.",
               "percentunit",
               q(f'{rate("shadow_pool_starvation_guard_total")} / {rate("shadow_pool_wait_seconds_count")}',
                 "guard share"), max_=1), w=12)
    lay.row("KV transfer")
    lay.add(ts("KV transfers in flight",
               "KV transfers in flight per decode worker (bounded by the transfer cap).",
               "short", levels("shadow_router_kv_transfers_inflight", "worker", agg="sum")),
            w=8)
    lay.add(ts("KV transfer time quantiles",
               "p50, p95 and p99 of decode dispatch to first decode token (KV transfer plus queueing "
               "on the decode worker).",
               "s", *quantiles("shadow_router_kv_transfer_seconds")), w=8)
    lay.add(ts("Retries, recomputations, back-pressure",
               "Per second: upstream retries by leg, decode legs ended as `recomputed`, waits "
               "caused by back-pressure by reason, and streams over the resume budget (they could "
               "not continue a recomputed end).",
               "ops", rates("shadow_router_retries_total", "leg", name="retry"),
               rates("shadow_router_recomputed_total", name="recomputed"),
               rates("shadow_router_backpressure_total", "reason", name="wait"),
               rates("shadow_router_resume_dropped_total", name="resume dropped")), w=8)
    lay.row("Routing time")
    lay.add(ts("Routing time by stage: P50 / P95 / P99",
               "Compute time of BalanceRoute's Stage 1 and Stage 2 within each routing round.",
               "s", *quantiles("shadow_router_round_stage_seconds", "round_stage")), w=12)
    lay.add(ts("Routing round: P50 / P95 / P99", "Compute time of a whole dispatch round, by policy.",
               "s", *quantiles("shadow_router_decision_duration_seconds", "policy")), w=12)
    lay.add(bucket_heat("Pool wait distribution", "Prompt Pool waits per window (histogram buckets).",
                        "s", "shadow_pool_wait_seconds"), w=24)


BOARD = Board("shadow-pool", "shadow / Pool and transfer",
              "What does late binding cost? Prompt Pool depth and waits, expiries and the starvation "
              "guard, KV transfers and their time, retries, recomputations, and routing time by stage.",
              _panels)
