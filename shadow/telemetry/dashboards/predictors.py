"""Predictors: is BR-H's end predictor still good enough to route on? Prompt-key hit rate, the
end-probability calibration error, the gap to the offline Oracle bound, BR-H's net gain over BR-0
in the live lanes, and the degradations to BR-0 the controller made."""

from __future__ import annotations

from shadow.contracts.labels import LOOKUP_RESULTS
from shadow.contracts.modes import DEGRADE_REASONS
from shadow.telemetry.dashboards._kit import Board, Layout, level, levels, per_step, q, rate, rates, st, ts

HIT = 'result="hit"'
BRH = 'lane=~"brh.*"'
BR0 = 'lane="br0"'
BR0_BRH = 'lane=~"br0|brh.*"'
LOOKUPS = "shadow_predictor_key_lookups_total"
THROUGHPUT = "shadow_lane_throughput_tokens_per_second"
IDLE = "shadow_lane_barrier_idle_ratio"


def net_gain_throughput() -> str:
    """BR-H's estimated decode throughput over BR-0's, minus 1 (live lanes, same traffic)."""
    return f"{level(THROUGHPUT, 'instance', BRH)} / {level(THROUGHPUT, 'instance', BR0)} - 1"


def _panels(lay: Layout) -> None:
    lay.row("Now")
    lay.add(st("Prompt-key hit rate",
               "Share of BR-H predictor lookups over the window that found the prompt's key (a known "
               "prompt shape); misses fall back to the population prior.",
               "percentunit", f"{rate(LOOKUPS, 'instance', HIT)} / {rate(LOOKUPS, 'instance')}",
               decimals=1, steps=((None, "orange"), (0.5, "green"))), w=6, h=5)
    lay.add(st("Calibration error",
               "BR-H's end-probability calibration error on requests finished in the window (0 = "
               "predicted end probabilities match observed ends).",
               "percentunit", level("shadow_predictor_calibration_error", "instance"),
               decimals=1, steps=((None, "green"), (0.1, "orange"), (0.15, "red"))), w=6, h=5)
    lay.add(st("Gap to the Oracle bound",
               "BR-H's live spread over the offline Oracle bound's on the same window, minus 1 (0 = as "
               "good as knowing every end).",
               "percentunit", level("shadow_predictor_oracle_gap_ratio", "instance"),
               decimals=1, steps=((None, "green"), (0.5, "orange"), (1, "red"))), w=6, h=5)
    lay.add(st("BR-H net gain over BR-0 (throughput)",
               "Estimated decode throughput of the BR-H lane over the BR-0 lane's, minus 1: positive "
               "means BR-H's prediction pays for itself on this traffic.",
               "percentunit", net_gain_throughput(),
               decimals=1, steps=((None, "red"), (0, "green"))), w=6, h=5)
    lay.row("Over time")
    lay.add(ts("Prompt-key lookups",
               f"BR-H predictor prompt-key lookups per second, by result ({', '.join(LOOKUP_RESULTS)}).",
               "ops", rates(LOOKUPS, "result")), w=8)
    lay.add(ts("Calibration error and Oracle gap",
               "The calibration error of BR-H's end probabilities and its spread's excess over the "
               "Oracle bound (alert ShadowPredictorDrift).",
               "percentunit",
               levels("shadow_predictor_calibration_error", "instance", name="calibration"),
               levels("shadow_predictor_oracle_gap_ratio", "instance", name="oracle gap")), w=8)
    lay.add(ts("BR-H net gain over BR-0",
               "From the live lanes on the same traffic: BR-H's throughput over BR-0's minus 1, and "
               "BR-0's barrier-idle fraction minus BR-H's (both positive when BR-H helps).",
               "percentunit", q(net_gain_throughput(), "throughput gain {{instance}}"),
               q(f"{level(IDLE, 'instance', BR0)} - {level(IDLE, 'instance', BRH)}",
                 "idle saved {{instance}}"), min_=None), w=8)
    lay.add(ts("Average spread: BR-H vs BR-0",
               "Average max−min KV load per step over the window in the BR-0 and BR-H lanes.",
               "short", q(per_step("shadow_lane_spread_token_steps_total", BR0_BRH, "instance, lane"),
                          "{{lane}}")), w=12)
    lay.add(ts("Degradations to BR-0",
               f"BR-H → BR-0 degradations over the window, by reason ({', '.join(DEGRADE_REASONS)}), and "
               "the policy active mode runs now.",
               "short", rates("shadow_policy_degraded_total", "reason", fn="increase"),
               levels("shadow_policy_active", "policy", name="running")), w=12)


BOARD = Board("shadow-predictors", "shadow / Predictors",
              "Is BR-H's end predictor good enough to route on? Prompt-key hits, calibration, the gap to "
              "the Oracle bound and BR-H's net gain over BR-0 on the same live traffic.",
              _panels)
