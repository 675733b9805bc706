"""Prometheus collector for the live lanes: reads the published snapshot, never lane state.

Its families are declared here (`FAMILIES`): prefix `shadow_`, base units, labels `lane`, `worker`,
`group` (a barrier group: its workers' names joined by +), `source`, `reason` (all bounded by
configuration).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate
from typing import Any, Protocol

from prometheus_client.core import Metric

from shadow.base.families import Family, SourceCollector
from shadow.contracts.report import Report
from shadow.core.stepcost import FORMS, TERMS, form_key, form_label
from shadow.engine.windows import FIGURES
from shadow.live.confidence import VERDICTS
from shadow.live.lanes import DECISION_BUCKETS
from shadow.live.stepcheck import REASONS as STEP_REJECT_REASONS
from shadow.live.stepfit import STEP_BUCKETS

L = ("lane",)
HOST_STATS = ("recent", "median", "low", "high")  # the host factor's stat label
STEPS = Family("shadow_lane_steps_total", "counter", "Decode steps the lane has advanced.", "steps", L)
SPREAD = Family("shadow_lane_spread_tokens", "gauge", "max-min KV load at the latest step.", "tokens", L)
SPREAD_STEPS = Family("shadow_lane_spread_token_steps_total", "counter",
                      "Sum of max-min KV load over steps (rate / steps rate = average spread).",
                      "token-steps", L)
IMBALANCE = Family("shadow_lane_imbalance_tokens", "gauge",
                   "I(k) = sum_g (max - L_g) at the latest step.", "tokens", L)
IMBALANCE_STEPS = Family("shadow_lane_imbalance_token_steps_total", "counter",
                         "Sum of I(k) over steps.", "token-steps", L)
BARRIER_IDLE = Family("shadow_lane_barrier_idle_ratio", "gauge",
                      "Barrier-idle fraction of worker time (fitted step model when the fit is good).",
                      "ratio", L)
THROUGHPUT = Family("shadow_lane_throughput_tokens_per_second", "gauge",
                    "Estimated decode throughput.", "tokens/s", L)
TPOT = Family("shadow_lane_tpot_seconds", "gauge", "Estimated mean time per output token.", "seconds", L)
FINISHED = Family("shadow_lane_requests_finished_total", "counter",
                  "Requests the lane has finished.", "requests", L)
STALLS = Family("shadow_lane_lookahead_stalls_total", "counter",
                "Steps held because a running request's end was not yet known.", "steps", L)
BALANCE = Family("shadow_lane_balance_ratio", "gauge",
                 "Balance ratio (NVIDIA's avg/max): mean over workers of the KV load over the largest, "
                 "per step; its step-time-weighted mean and 10th percentile (1 - it = I(k)/(G*max L)).",
                 "ratio", ("lane", "stat"), values={"stat": ("mean", "p10")})
IDLE_RATE = Family("shadow_lane_idle_rate_ratio", "gauge",
                   "Idle rate (BF-IO's): mean over workers of 1 - L_g/max L, step-time-weighted "
                   "(= 1 - the mean balance ratio).", "ratio", L)
SOL_THROUGHPUT = Family("shadow_lane_sol_throughput_tokens_per_second", "gauge",
                        "Speed-of-light throughput (NVIDIA's): the lane's throughput over its mean balance "
                        "ratio, what it would deliver perfectly balanced.", "tokens/s", L)
MAX_MIN = Family("shadow_lane_max_min_ratio", "gauge",
                 "Per-step largest over smallest worker KV load (SGLang's max/min) at p50/p90/p95 over "
                 "steps; absent where it is infinite (a worker held nothing) or over 1000 at that quantile.",
                 "ratio",
                 ("lane", "stat"), values={"stat": ("p50", "p90", "p95")})
LAG = Family("shadow_lane_lag_seconds", "gauge", "How far the lane runs behind the live clock.", "seconds", L)


def _windowed(figure: Family, help: str) -> Family:
    """The gauge of a lane figure over the last complete window (`shadow_lane_window_*`, same unit)."""
    name = figure.name.replace("shadow_lane_", "shadow_lane_window_", 1)
    return Family(name, "gauge", help, figure.unit, L)


W_SPREAD = _windowed(SPREAD, "Average max-min KV load over the last complete window (rolling: from its "
                              "seed).")
W_IMBALANCE = _windowed(IMBALANCE, "Average I(k) over the last complete window.")
W_IDLE = _windowed(BARRIER_IDLE, "Barrier-idle fraction over the last complete window.")
W_THROUGHPUT = _windowed(THROUGHPUT, "Estimated decode throughput over the last complete window.")
RESEEDS = Family("shadow_lane_reseeds_total", "counter",
                 "Times the lane was re-seeded from the mirrored fleet (rolling windows).", "reseeds", L)
CUTS = Family("shadow_lane_windows_cut_total", "counter",
              "Rolling windows the lane left unfinished: too far behind, re-seeded ahead.", "windows", L)
AGREEMENTS = Family("shadow_lane_agreements_total", "counter",
                    "Router decisions this lane's policy would have made identically.", "decisions", L)
DECISIONS = Family("shadow_lane_decisions_total", "counter",
                   "Decisions compared for agreement.", "decisions", L)
WORKER_LOAD = Family("shadow_lane_worker_load_tokens", "gauge",
                     "Per-worker KV load in the lane.", "tokens", ("lane", "worker"))
WORKER_ACTIVE = Family("shadow_lane_worker_active_requests", "gauge",
                       "Per-worker running requests in the lane.", "requests", ("lane", "worker"))
DECISION_SECONDS = Family("shadow_lane_decision_duration_seconds", "histogram",
                          "Routing-round compute time.", "seconds", L, buckets=DECISION_BUCKETS)
MODEL_A = Family("shadow_step_model_a_seconds_per_token", "gauge",
                 "Fitted a of T = a*max L + b.", "seconds/token")
MODEL_B = Family("shadow_step_model_b_seconds", "gauge", "Fitted b of T = a*max L + b.", "seconds")
MODEL_R2 = Family("shadow_step_model_r2", "gauge", "R^2 of the step model fit.", "ratio")
MODEL_SAMPLES = Family("shadow_step_model_samples", "gauge", "Samples in the fit window.", "samples")
STEP_SECONDS = Family("shadow_step_duration_seconds", "histogram", "Measured decode step times.",
                      "seconds", ("source",), buckets=STEP_BUCKETS)
COST_TERM = Family("shadow_step_cost_term_seconds", "gauge",
                   "A term of a barrier group's chosen step-cost form (b: seconds per step, c: per running "
                   "sequence, a: per KV token, p: per prefill token) and its 95% interval bounds; 0 for the "
                   "terms the form does not have.", "seconds", ("group", "term", "bound"),
                   values={"term": TERMS, "bound": ("estimate", "low", "high")})
COST_OOS = Family("shadow_step_cost_oos_error_ratio", "gauge",
                  "Out-of-sample median absolute relative error of a barrier group's chosen step-cost form "
                  "on window means (time-blocked cross-validation).", "ratio", ("group",))
COST_R2 = Family("shadow_step_cost_r2", "gauge",
                 "R^2 of a barrier group's chosen step-cost form on its window means.", "ratio", ("group",))
COST_FORM = Family("shadow_step_cost_form", "gauge",
                   "1 for the chosen form of a barrier group's step cost (its terms joined by +), 0 for the "
                   "other candidates.", "bool", ("group", "form"),
                   values={"form": tuple(form_key(f) for f in FORMS)})
COST_WINDOWS = Family("shadow_step_cost_windows", "gauge",
                      "Window means a barrier group's step-cost fit stands on.", "windows", ("group",))
COST_BASIS = Family("shadow_step_cost_engine_basis", "gauge",
                    "1 when a barrier group's step cost is fitted on the engine's work per step (the period "
                    "less its measured wait for a CPU), 0 when on the period (no wait measured).", "bool",
                    ("group",))
HOST_FACTOR = Family("shadow_step_cost_host_factor_ratio", "gauge",
                     "A barrier group's step period over the engine's work (the host's factor, measured "
                     "from the engine's wait for a CPU): recent (the last windows), median, low and high "
                     "(10th and 90th percentiles) over the fit's windows.", "ratio", ("group", "stat"),
                     values={"stat": HOST_STATS})
CLOCK_FACTOR = Family("shadow_step_cost_clock_factor_ratio", "gauge",
                      "What a barrier group's lanes multiply the engine's step cost by: the last windows' "
                      "periods over what the cost model predicts for them (the host's wait and the engine's "
                      "work off its model).", "ratio", ("group",))
PERIOD_ERROR = Family("shadow_step_cost_period_error_ratio", "gauge",
                      "Median absolute relative error of what a barrier group's lanes step on (the cost "
                      "model x the clock factor) against each window's mean step period, predicted one "
                      "window ahead.", "ratio", ("group",))
_COST = (COST_TERM, COST_OOS, COST_R2, COST_FORM, COST_WINDOWS, COST_BASIS, HOST_FACTOR, CLOCK_FACTOR,
         PERIOD_ERROR)
FIDELITY = Family("shadow_fidelity_load_relative_error", "gauge",
                  "Actual lane loads vs mirrored loads, mean relative error.", "ratio")
DROPPED = Family("shadow_live_events_dropped_total", "counter",
                 "Events the lanes could not take.", "events", ("reason",))
STEPS_REJECTED = Family("shadow_live_step_events_rejected_total", "counter",
                        "Step events the lanes left out: longer than the worker's stream gaps around them, "
                        "or beyond the step model where no stream vouches for them.", "events",
                        ("reason",), values={"reason": STEP_REJECT_REASONS})
VS_ACTUAL = Family("shadow_lane_vs_actual_ratio", "gauge",
                   "A lane's figure against the actual lane, batch means over windows (> 1: the lane does "
                   "better): the geometric mean of the window ratios and its 95% t-interval bounds "
                   "(on the log scale: both positive).", "ratio",
                   ("lane", "figure", "bound"),
                   values={"figure": FIGURES, "bound": ("estimate", "low", "high")})
VERDICT = Family("shadow_lane_verdict", "gauge",
                 "1 for the verdict on a lane's figure against the actual lane (0 for the others).", "bool",
                 ("lane", "figure", "verdict"), values={"figure": FIGURES, "verdict": VERDICTS})
TRUSTWORTHY = Family("shadow_live_figures_trustworthy", "gauge",
                     "1 when the twin is in bounds (step fit good, fidelity < 2%, steps on the model, no "
                     "drops), else 0.", "bool")

#: Per-lane counters and gauges with the lane report's key each, in the order they are yielded.
_PER_LANE = (
    (STEPS, "steps"), (SPREAD, "spread_tokens"), (SPREAD_STEPS, "sum_spread_token_steps"),
    (IMBALANCE, "imbalance_tokens"), (IMBALANCE_STEPS, "sum_imbalance_token_steps"),
    (BARRIER_IDLE, "barrier_idle_fraction"), (THROUGHPUT, "throughput_tokens_per_s"), (TPOT, "tpot_s"),
    (FINISHED, "requests_finished"), (STALLS, "lookahead_stalls"), (LAG, "lag_s"),
    (AGREEMENTS, "agreements"), (DECISIONS, "decisions"),
    (W_SPREAD, "window_avg_spread_tokens"), (W_IMBALANCE, "window_avg_imbalance_tokens"),
    (W_IDLE, "window_barrier_idle_fraction"), (W_THROUGHPUT, "window_throughput_tokens_per_s"),
    (RESEEDS, "reseeds"), (CUTS, "windows_cut"),
    (IDLE_RATE, "idle_rate"), (SOL_THROUGHPUT, "sol_throughput_tokens_per_s"),
)
#: The families of a lane figure per statistic: (family, {stat: the lane report's key}).
_PER_LANE_STAT = (
    (BALANCE, {"mean": "balance_ratio_mean", "p10": "balance_ratio_p10"}),
    (MAX_MIN, {"p50": "max_min_ratio_p50", "p90": "max_min_ratio_p90", "p95": "max_min_ratio_p95"}),
)
#: The step model's gauges with the report's step_model key each.
_STEP_MODEL = ((MODEL_A, "a_s_per_token"), (MODEL_B, "b_s"), (MODEL_R2, "r2"), (MODEL_SAMPLES, "samples"))

FAMILIES = (
    *(f for f, _ in _PER_LANE), BALANCE, MAX_MIN, WORKER_LOAD, WORKER_ACTIVE, DECISION_SECONDS,
    *(f for f, _ in _STEP_MODEL), *_COST, STEP_SECONDS, FIDELITY, DROPPED, STEPS_REJECTED, VS_ACTUAL, VERDICT,
    TRUSTWORTHY,
)


class Reporting(Protocol):
    """What the collector reads: the live report (`LiveLanes`, or `ShardedLanes` merging its shards)."""

    def report(self) -> Report: ...


class LiveCollector(SourceCollector[Reporting]):
    """See module docstring."""

    families = FAMILIES

    def collect(self) -> Iterator[Metric]:
        rep = self.source.report()
        lanes: dict[str, Any] = rep.get("lanes", {})
        for fam, key in _PER_LANE:
            yield fam.sampled({label: _float(v.get(key)) for label, v in lanes.items()})
        for fam, keys in _PER_LANE_STAT:
            yield fam.sampled({(label, stat): _float(v.get(key)) for label, v in lanes.items()
                               for stat, key in keys.items()})
        for fam, key in ((WORKER_LOAD, "worker_running_loads"), (WORKER_ACTIVE, "worker_active")):
            per_worker = fam.gauge_family()
            for label, v in lanes.items():
                for w, x in v[key].items():
                    per_worker.add_metric([label, w], float(x))
            yield per_worker
        hist = DECISION_SECONDS.histogram_family()
        for label, v in lanes.items():
            cum = v.get("decision_buckets") or [0] * len(DECISION_BUCKETS)
            hist.add_metric([label], DECISION_SECONDS.cumulative(cum, v.get("decision_count", 0)),
                            float(v.get("decision_sum_s", 0.0)))
        yield hist
        sm = rep.get("step_model", {})
        for fam, key in _STEP_MODEL:
            yield fam.value(_float(sm.get(key)))
        yield from _cost_families(sm.get("cost", {}).get("groups", {}))
        steps = STEP_SECONDS.histogram_family()
        for source, h in rep.get("step_histogram", {}).items():
            counts = h["counts"]
            steps.add_metric([source], STEP_SECONDS.cumulative(accumulate(counts[:-1]), sum(counts)),
                             float(h["sum"]))
        yield steps
        yield FIDELITY.value(_float(rep.get("fidelity", {}).get("load_rel_error")))
        dropped = rep.get("events", {}).get("dropped", {})
        yield DROPPED.sampled({reason: float(n) for reason, n in dropped.items()})
        rejected = sm.get("step_events_rejected", {})
        yield STEPS_REJECTED.sampled({reason: float(n) for reason, n in rejected.items()})
        cmp = rep.get("comparison", {})
        ratios: dict[tuple[str, ...], float | None] = {}
        verdicts: dict[tuple[str, ...], float | None] = {}
        for label, figs in cmp.get("lanes", {}).items():
            for fig, iv in figs.items():
                for bound, key in (("estimate", "ratio"), ("low", "low"), ("high", "high")):
                    ratios[(label, fig, bound)] = _float(iv.get(key))
                for v in VERDICTS:
                    verdicts[(label, fig, v)] = 1.0 if iv.get("verdict") == v else 0.0
        yield VS_ACTUAL.sampled(ratios)
        yield VERDICT.sampled(verdicts)
        yield TRUSTWORTHY.value(None if not cmp else float(bool(cmp.get("trustworthy"))))


def _cost_families(groups: dict[str, Any]) -> Iterator[Metric]:
    """The step-cost families of the report's step_model.cost.groups (a group without a chosen
    form yet: its windows only)."""
    terms: dict[tuple[str, ...], float | None] = {}
    forms: dict[tuple[str, ...], float | None] = {}
    for name, g in groups.items():
        chosen = g.get("form")
        for t in TERMS:
            v = g.get("terms", {}).get(t)
            for bound, key in (("estimate", "value"), ("low", "low"), ("high", "high")):
                terms[(name, t, bound)] = None if chosen is None else (float(v[key]) if v else 0.0)
        for f in FORMS:
            forms[(name, form_key(f))] = None if chosen is None else float(form_label(f) == chosen)
    yield COST_TERM.sampled(terms)
    yield COST_OOS.sampled({name: _float(g.get("oos_error")) for name, g in groups.items()})
    yield COST_R2.sampled({name: _float(g.get("r2")) for name, g in groups.items()})
    yield COST_FORM.sampled(forms)
    yield COST_WINDOWS.sampled({name: float(g.get("windows", 0)) for name, g in groups.items()})
    yield COST_BASIS.sampled({name: float(g.get("basis") == "engine") for name, g in groups.items()})
    yield HOST_FACTOR.sampled({(name, stat): _float((g.get("host_factor") or {}).get(stat))
                               for name, g in groups.items() for stat in HOST_STATS})
    yield CLOCK_FACTOR.sampled({name: _float(g.get("clock_factor")) for name, g in groups.items()})
    yield PERIOD_ERROR.sampled({name: _float(g.get("period_error")) for name, g in groups.items()})


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
