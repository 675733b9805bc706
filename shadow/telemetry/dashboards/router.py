"""Router: what active routing is doing now — the operator mode and whether automatic fallback holds
it, why it fell back, how long decisions take, what requests end in, upstream errors, and the
Prompt Pool's depth and wait."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from shadow.telemetry.dashboards._hist import quantiles
from shadow.telemetry.dashboards._kit import RATE, Layout, dashboard, q, sel, st, ts, variables

UID = "shadow-router"
ROUTED = 'mode!="shadow"'
FAILED = 'outcome=~"upstream_error|rejected"'


def build() -> db.Dashboard:
    d = variables(dashboard(
        UID, "shadow / Router",
        "Is shadow routing, and is it routing well? Mode and fallback state with their reasons, "
        "decision latency against the budget, request outcomes, upstream errors, the Prompt Pool."))
    lay = Layout(d)
    lay.row("Mode")
    lay.add(st("Fallback active",
               "1 while automatic fallback routes round-robin (alert ShadowFallbackActive); 0 otherwise.",
               "none", f"max by (instance) (shadow_fallback_active{sel()})",
               steps=((None, "green"), (1, "red"))), w=6, h=5)
    lay.add(st("Mode pinned",
               "1 when an operator pinned the mode through the admin API or the flag file: automatic "
               "fallback is off.",
               "none", f"max by (instance) (shadow_mode_pinned{sel()})",
               steps=((None, "text"), (1, "orange"))), w=6, h=5)
    lay.add(st("Hold-down before recovery",
               "Seconds the controller still waits after a fallback before it tries the configured "
               "mode again (0 when not in fallback).",
               "s", f"max by (instance) (shadow_fallback_holddown_seconds{sel()})"), w=6, h=5)
    lay.add(st("Requests routed actively",
               "Share of the proxy's requests over the window that shadow routed itself (mode active "
               "or fallback) rather than passing them to the existing router.",
               "percentunit",
               f'sum by (instance) (rate(shadow_router_requests_total{sel(ROUTED)}[{RATE}])) '
               f"/ sum by (instance) (rate(shadow_router_requests_total{sel()}[{RATE}]))",
               decimals=1), w=6, h=5)
    lay.add(ts("Operator mode",
               "1 for the mode an operator set (shadow, canary, active, fallback), 0 for the others.",
               "none", q(f"max by (mode) (shadow_mode{sel()})", "{{mode}}"), max_=1), w=8)
    lay.add(ts("Policy active mode runs",
               "1 for the policy active mode runs now (br0, brh, jsq, rr); BR-H degrades to BR-0 when "
               "its predictor drifts.",
               "none", q(f"max by (policy) (shadow_policy_active{sel()})", "{{policy}}"), max_=1), w=8)
    lay.add(ts("Fallback trips and transitions by reason",
               "Automatic fallbacks by trigger, and transitions into each mode by reason (operator, "
               "flag file, drift, decision_slow, recovered, ...), counted over the window.",
               "short",
               q(f"sum by (reason) (increase(shadow_fallback_trips_total{sel()}[{RATE}]))",
                 "trip {{reason}}"),
               q(f"sum by (mode, reason) (increase(shadow_mode_transitions_total{sel()}[{RATE}]))",
                 "→ {{mode}} ({{reason}})", ref="B")), w=8)
    lay.row("Decisions")
    lay.add(ts("Decision latency quantiles",
               "p50, p95 and p99 of one dispatch round's compute time, by policy (alert "
               "ShadowDecisionsSlow when p99 exceeds the budget).",
               "s", *quantiles("shadow_router_decision_duration_seconds", "policy")), w=12)
    lay.add(ts("Decision rounds",
               "Dispatch rounds per second, by policy (pool policies coalesce several requests into "
               "one round).",
               "ops",
               q(f"sum by (policy) (rate(shadow_router_decision_duration_seconds_count{sel()}[{RATE}]))",
                 "{{policy}}")), w=12)
    lay.row("Requests")
    lay.add(ts("Requests by mode, policy and outcome",
               "Requests per second through the proxy by effective mode (shadow, active, fallback), "
               "policy and outcome (ok, client_cancel, upstream_error, rejected).",
               "reqps",
               q(f"sum by (mode, policy, outcome) (rate(shadow_router_requests_total{sel()}[{RATE}]))",
                 "{{mode}} {{policy}} {{outcome}}")), w=12)
    lay.add(ts("Failed share of requests",
               "Share of requests per second ending in upstream_error or rejected, by effective mode.",
               "percentunit",
               q(f'sum by (mode) (rate(shadow_router_requests_total{sel(FAILED)}[{RATE}])) '
                 f"/ sum by (mode) (rate(shadow_router_requests_total{sel()}[{RATE}]))", "{{mode}}"),
               max_=1), w=12)
    lay.add(ts("Upstream errors",
               "Failed upstream calls per second, by leg (prefill, decode, router) and worker.",
               "ops", q(f"sum by (leg, worker) (rate(shadow_router_upstream_errors_total{sel()}[{RATE}]))",
                        "{{leg}} {{worker}}")), w=8)
    lay.add(ts("Retries",
               "Upstream retries per second before the first byte reached a client, by leg.",
               "ops", q(f"sum by (leg) (rate(shadow_router_retries_total{sel()}[{RATE}]))", "{{leg}}")), w=8)
    lay.add(ts("In flight per upstream",
               "Requests in flight from the proxy to each upstream, by leg and worker.",
               "short",
               q(f"sum by (leg, worker) (shadow_router_inflight{sel()})", "{{leg}} {{worker}}")), w=8)
    lay.row("Prompt Pool")
    lay.add(ts("Pool depth",
               "Requests waiting in the Prompt Pool (prefill done, decode not yet dispatched).",
               "short", q(f"sum by (instance) (shadow_pool_requests{sel()})", "{{instance}}")), w=8)
    lay.add(ts("Pool wait quantiles",
               "p50, p95 and p99 of the time from prefill done to decode dispatch.",
               "s", *quantiles("shadow_pool_wait_seconds")), w=8)
    lay.add(ts("Back-pressure waits",
               "Waits per second caused by back-pressure, by reason (prefill_kv, transfer_cap, no_slot).",
               "ops", q(f"sum by (reason) (rate(shadow_router_backpressure_total{sel()}[{RATE}]))",
                        "{{reason}}")), w=8)
    return lay.d
