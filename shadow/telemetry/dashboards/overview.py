"""Overview: the router's real placements (`actual` lane) against each counterfactual lane, with
the twin's fidelity and the step model's fit beside every figure."""

from __future__ import annotations

from grafana_foundation_sdk.builders import prometheus

from shadow.telemetry.dashboards._hist import quantile
from shadow.telemetry.dashboards._kit import (
    Board,
    Layout,
    level,
    levels,
    per_step,
    q,
    rate,
    rates,
    sel,
    st,
    ts,
)

ACTUAL = 'lane="actual"'
BR = 'lane=~"br.*"'
SPREAD = "shadow_lane_spread_token_steps_total"


def _per_stat(metric: str, *stats: str) -> list[prometheus.Dataquery]:
    """A lane figure's gauge per lane at each of `stats` (its `stat` label), legends "{{lane}} stat"."""
    return [q(level(metric, "lane", f'stat="{s}"'), "{{lane}} " + s) for s in stats]


def _panels(lay: Layout) -> None:  # long by design: one statement per panel, in the dashboard's order
    lay.row("Headline")
    lay.add(st(
        "What BR would save: barrier idle",
        "Barrier-idle fraction of the actual lane minus that of the best BR lane (BR-0 / BR-H), per "
        "sidecar: the share of decode step time BalanceRoute would have kept busy. Trust it only "
        "when fidelity and R² (beside) are good.",
        "percentunit",
        f'max by (instance) (shadow_lane_barrier_idle_ratio{sel(ACTUAL)}) '
        f'- min by (instance) (shadow_lane_barrier_idle_ratio{sel(BR)})',
        decimals=1, steps=((None, "text"), (0.02, "green"))), w=6, h=5)
    lay.add(st(
        "Average spread: actual ÷ best BR",
        "Average max−min KV load over the window in the actual lane divided by the best BR lane's: "
        "how many times wider the router's imbalance is.",
        "suffix:×",
        f'({per_step(SPREAD, ACTUAL, "instance")}) '
        f'/ min by (instance) ({per_step(SPREAD, BR, "instance, lane")})',
        decimals=2, steps=((None, "text"), (1.2, "green"))), w=6, h=5)
    lay.add(st(
        "Twin fidelity: load error",
        "Mean relative error between the actual lane's per-worker loads and the mirrored loads. "
        "Under 2 % the counterfactual lanes are comparable with reality; over 5 % do not trust them.",
        "percentunit", level("shadow_fidelity_load_relative_error", "instance"),
        decimals=2, steps=((None, "green"), (0.02, "orange"), (0.05, "red"))), w=6, h=5)
    lay.add(st(
        "Step model fit: R²",
        "R² of the fitted step time T = a·max_g L_g + b. Barrier idle, throughput and TPOT estimates "
        "rest on it; under 0.8 they are unreliable.",
        "none", level("shadow_step_model_r2", "instance", agg="min"),
        decimals=3, steps=((None, "red"), (0.8, "orange"), (0.9, "green"))), w=6, h=5)

    lay.row("Balance by lane")
    lay.add(ts("Average spread (max − min KV load)",
               "Per lane, the average over decode steps of max_g L_g − min_g L_g, from the lane's "
               "counters (rate of Σ spread over rate of steps).",
               "suffix: tok", q(per_step(SPREAD), "{{lane}}")))
    lay.add(ts("Average imbalance I(k)",
               "Per lane, the average over steps of I(k) = Σ_g (max − L_g): KV tokens the barrier "
               "waits for, the quantity BalanceRoute minimises.",
               "suffix: tok", q(per_step("shadow_lane_imbalance_token_steps_total"), "{{lane}}")))
    lay.add(ts("Barrier idle by lane",
               "Fraction of step time the ranks wait at the barrier for the most loaded one, over the "
               "report window, from the fitted step model.",
               "percentunit", levels("shadow_lane_barrier_idle_ratio", "lane"), max_=1))
    lay.add(ts("Spread at the latest step",
               "Instantaneous max − min KV load per lane (noisier than the average beside).",
               "suffix: tok", levels("shadow_lane_spread_tokens", "lane")))

    lay.row("Balance in the field's units")
    lay.add(ts("Balance ratio (NVIDIA's avg/max)",
               "Per lane, mean over workers of the KV load over the largest, per step: its step-time-"
               "weighted mean (solid) and 10th percentile. 1 − it = I(k)/(G·max L); NVIDIA's TRT-LLM ADP "
               "blog reports 54.1 % → 87.7 %.",
               "percentunit",
               *_per_stat("shadow_lane_balance_ratio", "mean", "p10"), max_=1), w=6)
    lay.add(ts("Idle rate (BF-IO's)",
               "Per lane, mean over workers of 1 − L_g / max L, step-time-weighted: the share of the "
               "fleet's KV capacity at the barrier's pace left unused (= 1 − the mean balance ratio).",
               "percentunit", levels("shadow_lane_idle_rate_ratio", "lane"), max_=1), w=6)
    lay.add(ts("Speed-of-light throughput",
               "Per lane, throughput over its mean balance ratio (NVIDIA's SOL TPS): what the lane's "
               "traffic would give perfectly balanced; the gap to the throughput panel is what "
               "imbalance costs.",
               "suffix: tok/s",
               levels("shadow_lane_sol_throughput_tokens_per_second", "lane", agg="sum")), w=6)
    lay.add(ts("Max/min KV load per step (SGLang's)",
               "Per lane, the largest over the smallest worker's KV load per step at p50 and p95 over "
               "steps (no point where a worker held nothing: infinite).",
               "none",
               *_per_stat("shadow_lane_max_min_ratio", "p50", "p95"), min_=1), w=6)

    lay.row("Estimated service by lane")
    lay.add(ts("Estimated decode throughput",
               "Output tokens per second each lane would deliver, from its loads and the fitted step "
               "model.",
               "suffix: tok/s",
               levels("shadow_lane_throughput_tokens_per_second", "lane", agg="sum")))
    lay.add(ts("Estimated TPOT",
               "Mean time per output token in each lane, from the fitted step model.",
               "s", levels("shadow_lane_tpot_seconds", "lane")))
    lay.add(ts("Fidelity and fit",
               "Twin fidelity error (actual lane vs mirror) and step-model R², the two figures every "
               "counterfactual number depends on.",
               "percentunit",
               levels("shadow_fidelity_load_relative_error", "instance", name="load error"),
               levels("shadow_step_model_r2", "instance", agg="min", name="R²"), max_=1))
    lay.add(ts("Agreement with the router",
               "Share of the router's decisions each lane's policy would have made identically.",
               "percentunit",
               q(f'{rate("shadow_lane_agreements_total", "lane")} '
                 f'/ {rate("shadow_lane_decisions_total", "lane")}', "{{lane}}"), max_=1))

    lay.row("Lanes")
    lay.add(ts("Requests finished per lane",
               "Requests each lane finished per second (all lanes see the same traffic).",
               "reqps", rates("shadow_lane_requests_finished_total", "lane")), w=8)
    lay.add(ts("Lane lag",
               "How far each lane runs behind the live clock (lanes wait for real request ends).",
               "s", levels("shadow_lane_lag_seconds", "lane")), w=8)
    lay.add(ts("Policy compute time p99",
               "99th percentile of one routing round's compute time per lane.",
               "s", q(quantile(0.99, "shadow_lane_decision_duration_seconds", "lane"), "{{lane}}")), w=8)


BOARD = Board("shadow-overview", "shadow / Overview",
              "What the router really did (lane `actual`) against BalanceRoute and the baselines on the "
              "same live traffic, with the twin's fidelity and the step model's fit next to every figure.",
              _panels)
