"""Step model: measured decode step times against the fitted T = a·max_g L_g + b, with a, b, R²
and the sample count, and the measured step-time distribution."""

from __future__ import annotations

from shadow.telemetry.dashboards._hist import bucket_heat, quantiles
from shadow.telemetry.dashboards._kit import Board, Layout, level, q, rate, st, ts

ACTUAL = 'lane="actual"'
A = "shadow_step_model_a_seconds_per_token"
B = "shadow_step_model_b_seconds"


def _panels(lay: Layout) -> None:
    lay.row("Fit")
    lay.add(st("a (per token of the largest load)", "Fitted seconds per KV token of the most loaded rank.",
               "s", level(A, "instance")), w=6, h=5)
    lay.add(st("b (fixed cost per step)", "Fitted seconds per step independent of load.",
               "s", level(B, "instance")), w=6, h=5)
    lay.add(st("R²", "Share of step-time variance the fit explains; under 0.8 the estimates built on it "
               "are unreliable (alert ShadowStepModelPoorFit).",
               "none", level("shadow_step_model_r2", "instance", agg="min"), decimals=3,
               steps=((None, "red"), (0.8, "orange"), (0.9, "green"))), w=6, h=5)
    lay.add(st("Samples in the window", "Measured steps in the sliding fit window.",
               "short", level("shadow_step_model_samples", "instance")), w=6, h=5)
    lay.row("Measured against modelled")
    lay.add(ts("Step time: measured vs modelled",
               "Measured: mean step time over the window from the step-time histogram. Modelled: "
               "a·max_g L_g + b at the actual lane's current largest per-worker load.",
               "s",
               q(f'{rate("shadow_step_duration_seconds_sum")} / {rate("shadow_step_duration_seconds_count")}',
                 "measured"),
               q(f'{level(A)} * {level("shadow_lane_worker_load_tokens", extra=ACTUAL)} + {level(B)}',
                 "modelled")))
    lay.add(ts("Fit quality over time", "R² of the fit over time; it should stay above 0.8.",
               "none", q(level("shadow_step_model_r2", "instance", agg="min"), "R² {{instance}}"), max_=1,
               decimals=3))
    lay.add(bucket_heat("Measured step-time distribution",
                        "Measured step times per window (histogram buckets, all sources).",
                        "s", "shadow_step_duration_seconds"))
    lay.add(ts("Step time quantiles by source",
               "p50 and p95 of measured step times, by source: worker step events, or SSE inter-chunk "
               "gaps of co-scheduled streams.",
               "s", *quantiles("shadow_step_duration_seconds", "source", (0.5, 0.95))))


BOARD = Board("shadow-step-model", "shadow / Step model",
              "Do KV tokens explain step time on this fleet? Measured step times against the online fit "
              "T = a·max_g L_g + b that every barrier-idle, throughput and TPOT estimate uses.",
              _panels)
