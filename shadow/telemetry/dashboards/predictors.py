"""Predictors: is BR-H's end predictor still good enough to route on? Prompt-key hit rate, the
end-probability calibration error, the gap to the offline Oracle bound, BR-H's net gain over BR-0
in the live lanes, and the degradations to BR-0 the controller made."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from shadow.telemetry.dashboards._kit import RATE, Layout, dashboard, q, sel, st, ts, variables

UID = "shadow-predictors"
HIT = 'result="hit"'
BRH = 'lane=~"brh.*"'
BR0 = 'lane="br0"'


def _per_step(counter: str, lanes: str) -> str:
    """A lane's average per step over the window (rate of Σ x over steps / rate of steps)."""
    return (f"sum by (instance, lane) (rate({counter}{sel(lanes)}[{RATE}])) "
            f"/ sum by (instance, lane) (rate(shadow_lane_steps_total{sel(lanes)}[{RATE}]))")


def net_gain_throughput() -> str:
    """BR-H's estimated decode throughput over BR-0's, minus 1 (live lanes, same traffic)."""
    return (f"max by (instance) (shadow_lane_throughput_tokens_per_second{sel(BRH)}) "
            f"/ max by (instance) (shadow_lane_throughput_tokens_per_second{sel(BR0)}) - 1")


def build() -> db.Dashboard:
    d = variables(dashboard(
        UID, "shadow / Predictors",
        "Is BR-H's end predictor good enough to route on? Prompt-key hits, calibration, the gap to "
        "the Oracle bound and BR-H's net gain over BR-0 on the same live traffic."))
    lay = Layout(d)
    lay.row("Now")
    lay.add(st("Prompt-key hit rate",
               "Share of BR-H predictor lookups over the window that found the prompt's key (a known "
               "prompt shape); misses fall back to the population prior.",
               "percentunit",
               f"sum by (instance) (rate(shadow_predictor_key_lookups_total{sel(HIT)}[{RATE}])) "
               f"/ sum by (instance) (rate(shadow_predictor_key_lookups_total{sel()}[{RATE}]))",
               decimals=1, steps=((None, "orange"), (0.5, "green"))), w=6, h=5)
    lay.add(st("Calibration error",
               "BR-H's end-probability calibration error on requests finished in the window (0 = "
               "predicted end probabilities match observed ends).",
               "percentunit", f"max by (instance) (shadow_predictor_calibration_error{sel()})",
               decimals=1, steps=((None, "green"), (0.1, "orange"), (0.15, "red"))), w=6, h=5)
    lay.add(st("Gap to the Oracle bound",
               "BR-H's live spread over the offline Oracle bound's on the same window, minus 1 (0 = as "
               "good as knowing every end).",
               "percentunit", f"max by (instance) (shadow_predictor_oracle_gap_ratio{sel()})",
               decimals=1, steps=((None, "green"), (0.5, "orange"), (1, "red"))), w=6, h=5)
    lay.add(st("BR-H net gain over BR-0 (throughput)",
               "Estimated decode throughput of the BR-H lane over the BR-0 lane's, minus 1: positive "
               "means BR-H's prediction pays for itself on this traffic.",
               "percentunit", net_gain_throughput(),
               decimals=1, steps=((None, "red"), (0, "green"))), w=6, h=5)
    lay.row("Over time")
    lay.add(ts("Prompt-key lookups",
               "BR-H predictor prompt-key lookups per second, by result (hit, miss).",
               "ops", q(f"sum by (result) (rate(shadow_predictor_key_lookups_total{sel()}[{RATE}]))",
                        "{{result}}")), w=8)
    lay.add(ts("Calibration error and Oracle gap",
               "The calibration error of BR-H's end probabilities and its spread's excess over the "
               "Oracle bound (alert ShadowPredictorDrift).",
               "percentunit",
               q(f"max by (instance) (shadow_predictor_calibration_error{sel()})",
                 "calibration {{instance}}"),
               q(f"max by (instance) (shadow_predictor_oracle_gap_ratio{sel()})", "oracle gap {{instance}}",
                 ref="B")), w=8)
    lay.add(ts("BR-H net gain over BR-0",
               "From the live lanes on the same traffic: BR-H's throughput over BR-0's minus 1, and "
               "BR-0's barrier-idle fraction minus BR-H's (both positive when BR-H helps).",
               "percentunit",
               q(net_gain_throughput(), "throughput gain {{instance}}"),
               q(f"max by (instance) (shadow_lane_barrier_idle_ratio{sel(BR0)}) "
                 f"- max by (instance) (shadow_lane_barrier_idle_ratio{sel(BRH)})",
                 "idle saved {{instance}}", ref="B"), min_=None), w=8)
    lay.add(ts("Average spread: BR-H vs BR-0",
               "Average max−min KV load per step over the window in the BR-0 and BR-H lanes.",
               "short",
               q(_per_step("shadow_lane_spread_token_steps_total", 'lane=~"br0|brh.*"'), "{{lane}}")), w=12)
    lay.add(ts("Degradations to BR-0",
               "BR-H → BR-0 degradations over the window, by reason (calibration, oracle_gap, "
               "net_gain), and the policy active mode runs now.",
               "short",
               q(f"sum by (reason) (increase(shadow_policy_degraded_total{sel()}[{RATE}]))", "{{reason}}"),
               q(f"max by (policy) (shadow_policy_active{sel()})", "running {{policy}}", ref="B")), w=12)
    return lay.d
