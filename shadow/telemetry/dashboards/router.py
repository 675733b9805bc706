"""Router: what active routing is doing now — the operator mode and whether automatic fallback holds
it, why it fell back, how long decisions take, what requests end in, upstream errors, and the
Prompt Pool's depth and wait."""

from __future__ import annotations

from typing import get_args

from shadow.contracts.labels import BACKPRESSURE_REASONS, FAILED_OUTCOMES, LEGS, OUTCOMES
from shadow.contracts.modes import MODES, RouteMode
from shadow.core.policies import ACTIVE
from shadow.telemetry.dashboards._hist import quantiles
from shadow.telemetry.dashboards._kit import Board, Layout, level, levels, q, rate, rates, st, ts

ROUTED = 'mode!="shadow"'
FAILED = f'outcome=~"{"|".join(FAILED_OUTCOMES)}"'
REQUESTS = "shadow_router_requests_total"


def _listed(values: tuple[str, ...]) -> str:
    return ", ".join(values)


def _panels(lay: Layout) -> None:  # long by design: one statement per panel, in the dashboard's order
    lay.row("Mode")
    lay.add(st("Fallback active",
               "1 while automatic fallback routes round-robin (alert ShadowFallbackActive); 0 otherwise.",
               "none", level("shadow_fallback_active", "instance"), steps=((None, "green"), (1, "red"))),
            w=6, h=5)
    lay.add(st("Mode pinned",
               "1 when an operator pinned the mode through the admin API or the flag file: automatic "
               "fallback is off.",
               "none", level("shadow_mode_pinned", "instance"), steps=((None, "text"), (1, "orange"))),
            w=6, h=5)
    lay.add(st("Hold-down before recovery",
               "Seconds the controller still waits after a fallback before it tries the configured "
               "mode again (0 when not in fallback).",
               "s", level("shadow_fallback_holddown_seconds", "instance")), w=6, h=5)
    lay.add(st("Requests routed actively",
               "Share of the proxy's requests over the window that shadow routed itself (mode active "
               "or fallback) rather than passing them to the existing router.",
               "percentunit", f"{rate(REQUESTS, 'instance', ROUTED)} / {rate(REQUESTS, 'instance')}",
               decimals=1), w=6, h=5)
    lay.add(ts("Operator mode",
               f"1 for the mode an operator set ({_listed(MODES)}), 0 for the others.",
               "none", levels("shadow_mode", "mode"), max_=1), w=8)
    lay.add(ts("Policy active mode runs",
               f"1 for the policy active mode runs now ({_listed(ACTIVE)}); BR-H degrades to BR-0 "
               "when its predictor drifts.",
               "none", levels("shadow_policy_active", "policy"), max_=1), w=8)
    lay.add(ts("Fallback trips and transitions by reason",
               "Automatic fallbacks by trigger, and transitions into each mode by reason (operator, "
               "flag file, drift, decision_slow, recovered, ...), counted over the window.",
               "short", rates("shadow_fallback_trips_total", "reason", fn="increase", name="trip"),
               q(rate("shadow_mode_transitions_total", "mode, reason", fn="increase"),
                 "→ {{mode}} ({{reason}})")), w=8)
    lay.row("Decisions")
    lay.add(ts("Decision latency quantiles",
               "p50, p95 and p99 of one dispatch round's compute time, by policy (alert "
               "ShadowDecisionsSlow when p99 exceeds the budget).",
               "s", *quantiles("shadow_router_decision_duration_seconds", "policy")), w=12)
    lay.add(ts("Decision rounds",
               "Dispatch rounds per second, by policy (pool policies coalesce several requests into "
               "one round).",
               "ops", rates("shadow_router_decision_duration_seconds_count", "policy")), w=12)
    lay.row("Requests")
    lay.add(ts("Requests by mode, policy and outcome",
               f"Requests per second through the proxy by effective mode ({_listed(get_args(RouteMode))}), "
               f"policy and outcome ({_listed(OUTCOMES)}).",
               "reqps", rates(REQUESTS, "mode, policy, outcome")), w=12)
    lay.add(ts("Failed share of requests",
               f"Share of requests per second ending in {_listed(FAILED_OUTCOMES)}, by effective mode.",
               "percentunit", q(f"{rate(REQUESTS, 'mode', FAILED)} / {rate(REQUESTS, 'mode')}", "{{mode}}"),
               max_=1), w=12)
    lay.add(ts("Upstream errors",
               f"Failed upstream calls per second, by leg ({_listed(LEGS)}) and worker.",
               "ops", rates("shadow_router_upstream_errors_total", "leg, worker")),
            w=8)
    lay.add(ts("Retries",
               "Upstream retries per second before the first byte reached a client, by leg.",
               "ops", rates("shadow_router_retries_total", "leg")), w=8)
    lay.add(ts("In flight per upstream",
               "Requests in flight from the proxy to each upstream, by leg and worker.",
               "short", levels("shadow_router_inflight", "leg, worker", agg="sum")),
            w=8)
    lay.add(ts("Streams cut",
               "Client streams the proxy cut after their first byte (an SSE error event, then an aborted "
               "body, so the client sees the failure), by leg and reason, counted over the window.",
               "short", rates("shadow_router_streams_cut_total", "leg, reason", fn="increase")), w=12)
    lay.add(ts("Requests by cohort and result",
               "Finished requests per second as their clients saw them: shadow (routed by shadow's policy) "
               "and router (passed to the existing router), ok or failed (not the client's own 4xx).",
               "reqps", rates("shadow_cohort_requests_total", "cohort, result")),
            w=12)
    lay.row("Canary analysis")
    lay.add(ts("Canary step",
               "Fraction of requests the canary under analysis routes by shadow's policy (0: no canary "
               "under analysis).",
               "percentunit", levels("shadow_canary_step_fraction", "instance"), max_=1),
            w=8)
    lay.add(ts("Canary verdicts",
               "Verdicts of the canary's steps (pass: on to the next step; fail: back to shadow; promoted: "
               "active), counted over the window.",
               "short", rates("shadow_canary_verdicts_total", "verdict", fn="increase")),
            w=8)
    lay.add(ts("Canary p-values",
               "One-sided p-value of the last verdict's test that the canary is worse, by metric (Fisher's "
               "exact test on errors, Mann-Whitney U on TTFT, TPOT and spread); low means worse.",
               "none", levels("shadow_canary_p_value", "metric", agg="min"), max_=1), w=8)
    lay.row("Decode workers")
    lay.add(ts("Placements per decode worker",
               "Requests placed on each decode worker per second, by policy (rr in fallback).",
               "reqps", rates("shadow_router_placements_total", "worker, policy")),
            w=12)
    lay.add(ts("Decode workers up",
               "1 while a decode worker takes placements; 0 while it is down (the proxy could not reach "
               "it, or its telemetry says so), as of the last routing round.",
               "none", levels("shadow_router_worker_up", "worker", agg="min"), max_=1), w=12)
    lay.row("Prompt Pool")
    lay.add(ts("Pool depth",
               "Requests waiting in the Prompt Pool (prefill done, decode not yet dispatched).",
               "short", levels("shadow_pool_requests", "instance", agg="sum")), w=8)
    lay.add(ts("Pool wait quantiles",
               "p50, p95 and p99 of the time from prefill done to decode dispatch.",
               "s", *quantiles("shadow_pool_wait_seconds")), w=8)
    lay.add(ts("Back-pressure waits",
               f"Waits per second caused by back-pressure, by reason ({_listed(BACKPRESSURE_REASONS)}).",
               "ops", rates("shadow_router_backpressure_total", "reason")), w=8)


BOARD = Board("shadow-router", "shadow / Router",
              "Is shadow routing, and is it routing well? Mode and fallback state with their reasons, "
              "decision latency against the budget, request outcomes, upstream errors, the Prompt Pool.",
              _panels)
