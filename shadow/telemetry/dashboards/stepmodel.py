"""Step model: the step-cost model chosen per barrier group (its form, terms with their 95 %
intervals, out-of-sample error and R², the host factor its period is the engine's cost times, and
how far that is off the window periods), measured decode step times against the fitted
T = a·max_g L_g + b (the paper's form) with a, b, R² and the sample count, and the measured
step-time distribution."""

from __future__ import annotations

from shadow.telemetry.dashboards._hist import bucket_heat, quantiles
from shadow.telemetry.dashboards._kit import Board, Layout, level, levels, q, rate, st, ts

ACTUAL = 'lane="actual"'
A = "shadow_step_model_a_seconds_per_token"
B = "shadow_step_model_b_seconds"


COST = "shadow_step_cost_term_seconds"
HOST = "shadow_step_cost_host_factor_ratio"
PER_SEQ = 'form=~".*c.*"'


def _cost_panels(lay: Layout) -> None:
    lay.row("Step cost (chosen per barrier group)")
    lay.add(st("Out-of-sample error (worst group)",
               "Median absolute relative error of the chosen step-cost form on window means it was not "
               "fitted on (time-blocked cross-validation); above 10% the live figures are not trustworthy.",
               "percentunit", level("shadow_step_cost_oos_error_ratio", "instance"), decimals=1,
               steps=((None, "green"), (0.1, "red"))), w=6, h=5)
    lay.add(st("R² of the chosen form (worst group)",
               "Share of the window means' variance the chosen form explains; low with a small "
               "out-of-sample error: the load barely moves the step, the host's noise is the rest.",
               "none", level("shadow_step_cost_r2", "instance", agg="min"), decimals=3), w=6, h=5)
    lay.add(st("Windows in the fit", "Window means the step-cost fits stand on (fewest group).",
               "short", level("shadow_step_cost_windows", "instance", agg="min")), w=6, h=5)
    lay.add(st("Groups on a form with a per-sequence term",
               "Barrier groups whose chosen form has c·n: a running sequence costs the step on its own.",
               "short", f"count({level('shadow_step_cost_form', 'instance, group', extra=PER_SEQ)} == 1)"),
            w=6, h=5)
    lay.add(ts("Chosen form per group", "1 for the form each barrier group's step cost has now (b: fixed, c: "
               "per running sequence, a: per KV token, p: per prefill token).", "none",
               q(f'{level("shadow_step_cost_form", "group, form")} == 1', "{{group}}: {{form}}"), max_=1))
    lay.add(ts("Step-cost terms with their 95% intervals",
               "Each term of each group's chosen form (seconds per step, per running sequence, per KV token "
               "or per prefill token) and its interval bounds.", "s",
               q(level(COST, "group, term", extra='bound="estimate"'), "{{group}} {{term}}"),
               q(level(COST, "group, term", extra='bound="low"'), "{{group}} {{term}} low"),
               q(level(COST, "group, term", extra='bound="high"'), "{{group}} {{term}} high"), min_=None))
    lay.add(ts("Out-of-sample error and R² over time", "Per group: the chosen form's out-of-sample error "
               "and R² on its window means.", "none",
               q(level("shadow_step_cost_oos_error_ratio", "group"), "{{group}} out-of-sample error"),
               q(level("shadow_step_cost_r2", "group"), "{{group}} R²"), max_=1, decimals=3))
    lay.add(ts("Host factor and clock factor",
               "Per group: the step period over the engine's own work (the period less its measured wait for "
               "a CPU; recent, and its 10th-90th percentiles over the fit's windows; 1: the host adds "
               "nothing), and the clock factor the lanes multiply the engine's cost by (the last windows' "
               "periods over what the cost predicts).", "none",
               q(level(HOST, "group", extra='stat="recent"'), "{{group}} host recent"),
               q(level(HOST, "group", extra='stat="low"'), "{{group}} host p10"),
               q(level(HOST, "group", extra='stat="high"'), "{{group}} host p90"),
               q(level("shadow_step_cost_clock_factor_ratio", "group"), "{{group}} clock"), min_=None))
    lay.add(ts("Window periods: what the lanes step on, off",
               "Per group: median error of the cost model × the clock factor against each window's mean step "
               "period, one window ahead; above 10% the lanes do not keep the engine's timeline.",
               "percentunit", levels("shadow_step_cost_period_error_ratio", "group"),
               max_=None, decimals=1))


def _panels(lay: Layout) -> None:
    _cost_panels(lay)
    lay.row("Fit of the paper's form a·max L + b")
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
               "none", levels("shadow_step_model_r2", "instance", agg="min", name="R²"), max_=1,
               decimals=3))
    lay.add(bucket_heat("Measured step-time distribution",
                        "Measured step times per window (histogram buckets, all sources).",
                        "s", "shadow_step_duration_seconds"))
    lay.add(ts("Step time quantiles by source",
               "p50 and p95 of measured step times, by source: worker step events, or SSE inter-chunk "
               "gaps of co-scheduled streams.",
               "s", *quantiles("shadow_step_duration_seconds", "source", (0.5, 0.95))))


BOARD = Board("shadow-step-model", "shadow / Step model",
              "What does a step cost on this fleet? The step-cost model chosen per barrier group by "
              "out-of-sample error (fixed, per running sequence, per KV token, per prefill token), and "
              "measured step times against the paper's T = a·max_g L_g + b.",
              _panels)
