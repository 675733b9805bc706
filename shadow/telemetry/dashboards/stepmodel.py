"""Step model: measured decode step times against the fitted T = a·max_g L_g + b, with a, b, R²
and the sample count, and the measured step-time distribution."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from shadow.telemetry.dashboards._kit import RATE, Layout, dashboard, heat, q, sel, st, ts, variables

UID = "shadow-step-model"
ACTUAL = 'lane="actual"'


def build() -> db.Dashboard:
    d = variables(dashboard(
        UID, "shadow / Step model",
        "Do KV tokens explain step time on this fleet? Measured step times against the online fit "
        "T = a·max_g L_g + b that every barrier-idle, throughput and TPOT estimate uses."))
    lay = Layout(d)
    lay.row("Fit")
    lay.add(st("a (per token of the largest load)", "Fitted seconds per KV token of the most loaded rank.",
               "s", f"max by (instance) (shadow_step_model_a_seconds_per_token{sel()})"), w=6, h=5)
    lay.add(st("b (fixed cost per step)", "Fitted seconds per step independent of load.",
               "s", f"max by (instance) (shadow_step_model_b_seconds{sel()})"), w=6, h=5)
    lay.add(st("R²", "Share of step-time variance the fit explains; under 0.8 the estimates built on it "
               "are unreliable (alert ShadowStepModelPoorFit).",
               "none", f"min by (instance) (shadow_step_model_r2{sel()})", decimals=3,
               steps=((None, "red"), (0.8, "orange"), (0.9, "green"))), w=6, h=5)
    lay.add(st("Samples in the window", "Measured steps in the sliding fit window.",
               "short", f"max by (instance) (shadow_step_model_samples{sel()})"), w=6, h=5)
    lay.row("Measured against modelled")
    lay.add(ts("Step time: measured vs modelled",
               "Measured: mean step time over the window from the step-time histogram. Modelled: "
               "a·max_g L_g + b at the actual lane's current largest per-worker load.",
               "s",
               q(f"sum (rate(shadow_step_duration_seconds_sum{sel()}[{RATE}])) "
                 f"/ sum (rate(shadow_step_duration_seconds_count{sel()}[{RATE}]))", "measured"),
               q(f"max (shadow_step_model_a_seconds_per_token{sel()}) "
                 f"* max (shadow_lane_worker_load_tokens{sel(ACTUAL)}) "
                 f"+ max (shadow_step_model_b_seconds{sel()})", "modelled", ref="B")))
    lay.add(ts("Fit quality over time",
               "R² of the fit over time; it should stay above 0.8.",
               "none", q(f"min by (instance) (shadow_step_model_r2{sel()})", "R² {{instance}}"), max_=1,
               decimals=3))
    lay.add(heat("Measured step-time distribution",
                 "Measured step times per window (histogram buckets, all sources).",
                 "s", q(f"sum by (le) (increase(shadow_step_duration_seconds_bucket{sel()}[{RATE}]))",
                        "{{le}}", heat=True), calculate=False))
    lay.add(ts("Step time quantiles by source",
               "p50 and p95 of measured step times, by source: worker step events, or SSE inter-chunk "
               "gaps of co-scheduled streams.",
               "s",
               q(f"histogram_quantile(0.5, sum by (le, source) "
                 f"(rate(shadow_step_duration_seconds_bucket{sel()}[{RATE}])))", "p50 {{source}}"),
               q(f"histogram_quantile(0.95, sum by (le, source) "
                 f"(rate(shadow_step_duration_seconds_bucket{sel()}[{RATE}])))", "p95 {{source}}", ref="B")))
    return lay.d
