"""The `/v1/report` document (`shadow.contracts.report.Report`) of the live lanes, built from their
collaborators' state at one moment.

`ReportBuilder.build(events, dropped_total, cpu_s)` assembles it, key order fixed: each lane's
figures and state (with its agreement fields, `AgreementLedger`), the router rule, the step model
and the clock (`StepClock`, `StepTally`), the fidelity (`FidelityLedger`), the mirrored fleet and
request counts (`LiveDriver`), the intake counts (`events`, given), warnings, the comparison over
the windows (`Windows`, recomputed only when they or the trust problems change) and the rolling
block. It reads; it changes nothing but its comparison cache."""

from __future__ import annotations

import os

from shadow.contracts.report import (
    Comparison,
    EventsReport,
    LaneReport,
    LaneState,
    LastWindow,
    Report,
    RollingReport,
    StepModelReport,
    WindowFigures,
)
from shadow.core.hostfactor import HOST_WINDOWS
from shadow.core.stepcost import OOS_ERROR_MAX, PERIOD_ERROR_MAX, CostFit
from shadow.core.stepmodel import FitResult, StepTimeModel
from shadow.engine.lane import Lane
from shadow.engine.live import LiveDriver
from shadow.engine.summary import LogHistogram, percentile
from shadow.engine.windows import Windows, lane_figures
from shadow.live.agreement import AgreementLedger
from shadow.live.confidence import comparison, host_warnings, trust_problems
from shadow.live.fidelity import FidelityLedger
from shadow.live.routerrule import router_rule
from shadow.live.stepclock import StepClock
from shadow.live.stepfit import STEP_BUCKETS
from shadow.live.workerclock import COUNTLESS_UNIDENTIFIED, WorkerModel, describe_costs, group_name

DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
RECENT_WINDOWS = 30  # per lane in the report's `windows`
COST_METHOD = (
    "per barrier group (per worker without one), from an engine probe's steps: their real period "
    "(the engine's time since its previous step) and, where the probe measures it (Linux schedstat), "
    "the engine's wait for a CPU, against the sequences computed n, the mirrored KV load L and the "
    "prefill tokens P; window means of window_steps consecutive steps; the engine's work of a window is "
    "its period less its wait's share of the engine's time (of a group: its members' largest), the host "
    "factor its period over that work; the cost is fitted on the engine's work (basis engine; on the "
    "period where no wait is measured: basis period): candidate forms b with any of c·n, a·L, p·P, each "
    "fitted by least squares (terms with 95% t-intervals); the form is the simplest whose time-blocked "
    "cross-validated error (10 blocks; median absolute relative error on window means) the best form "
    "does not beat beyond noise (95% t-interval of the per-block log ratios of their errors above 0), "
    "never one with a "
    "significantly negative term; the lanes step on the cost × the host factor of the last host_windows "
    "windows, and period_error is how far that was off each window's mean period when it closed (median)")



def _load_average() -> float | None:
    """The host's 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def window_fields(last: WindowFigures | None) -> LastWindow:
    """A lane's last complete window (rolling: from its seed; None: none yet), beside its
    cumulative figures."""
    if last is None:
        return {"window_index": None, "window_avg_spread_tokens": None, "window_avg_imbalance_tokens": None,
                "window_barrier_idle_fraction": None, "window_throughput_tokens_per_s": None}
    return {
        "window_index": last["index"],
        "window_avg_spread_tokens": last["avg_spread_tokens"],
        "window_avg_imbalance_tokens": last["avg_imbalance_tokens"],
        "window_barrier_idle_fraction": last["barrier_idle_fraction"],
        "window_throughput_tokens_per_s": last["throughput_tokens_per_s"],
    }



class ReportBuilder:
    """See module docstring. `workers`, `slots`: the fleet's; `step`: the configured step model."""

    def __init__(self, workers: list[str], slots: int, step: StepTimeModel, driver: LiveDriver,
                 windows: Windows, clock: StepClock, fidelity: FidelityLedger,
                 agreement: AgreementLedger) -> None:
        self.workers, self.slots, self.step = workers, slots, step
        self.driver, self.windows = driver, windows
        self.clock, self.fidelity, self.agreement = clock, fidelity, agreement
        self._comparison_key: tuple[int, tuple[str, ...]] | None = None  # what it was computed for
        self._comparison: Comparison  # set by the first build

    def build(self, events: EventsReport, dropped_total: int, cpu_s: float) -> Report:
        """The report from the lanes' state now (`events`: the intake's counts; `dropped_total`:
        events dropped; `cpu_s`: CPU seconds the lanes' thread spent)."""
        d, sc = self.driver, self.clock
        fit = sc.fit.result()
        g = len(self.workers)
        clock_model, clock_source, clock_fit, poor = sc.view(self.workers)
        lanes: dict[str, LaneReport] = {}
        recent: dict[str, list[WindowFigures]] = {}
        for lane in d.lanes:
            label = lane.spec.label
            recent[label] = [w.figures(None, g) for w in self.windows.recent(label, RECENT_WINDOWS)]
            lanes[label] = {**lane_figures(lane.totals, None, g),  # on the lanes' own (measured) clock
                            **window_fields(recent[label][-1] if recent[label] else None),
                            **self._lane_state(lane)}
        on_configured = clock_source == "configured"
        measured, modelled = sc.tally.model_check
        vs_clock = sc.worker_clock.measured_vs_clock()
        fidelity = self.fidelity.report(d.twin, d.servers, self.workers)
        fid = fidelity["load_rel_error"]
        drift = (measured / modelled if modelled > 0 else None) if on_configured else vs_clock
        cost_fits = sc.worker_clock.cost_fits()
        named = [(group_name(self.workers, grp), cf) for grp, cf in cost_fits]
        problems = trust_problems(clock_fit, fid, drift, dropped_total, named)
        warnings = self._warnings(fit, clock_model, on_configured, poor, dropped_total)
        warnings += host_warnings(named, not problems)
        key = (self.windows.complete, tuple(problems))
        if self._comparison_key != key:
            self._comparison_key, self._comparison = key, comparison(self.windows, None, g, problems)
        step_model = self._step_model(fit, (clock_model, clock_source, clock_fit), bool(poor), cost_fits)
        tally = sc.tally
        return {
            "lanes": lanes,
            # which compared lane's rule is closest to the real router's placements
            "router_rule": router_rule(lanes),
            "step_model": step_model,
            "fidelity": fidelity,
            "workers": list(self.workers),
            "slots": self.slots,
            "lag_s": d.lag_s,
            "mirrored": {
                "worker_loads": dict(zip(self.workers, d.mirror_loads, strict=True)),
                "worker_placed_loads": dict(zip(self.workers, d.mirror_placed, strict=True)),
                "worker_active": dict(zip(self.workers, d.mirror_active, strict=True)),
            },
            "events": events,
            "requests": {
                "released": d.released,
                "open": d.open_requests(),
                "late": d.late,
                "dropped": dict(d.dropped),
                "unknown_worker_routes": d.unknown_worker,
            },
            "step_histogram": {
                s: {"buckets": list(STEP_BUCKETS), "counts": list(h), "sum": tally.sum[s]}
                for s, h in tally.hist.items()
            },
            "cpu_s": cpu_s,
            "warnings": warnings,
            "comparison": self._comparison,
            "rolling": self._rolling(),
            "windows": {"window_s": self.windows.window_s, "lanes": recent},
        }

    def _step_model(self, fit: FitResult, clock: tuple[str, str, FitResult], poor: bool,
                    cost_fits: list[tuple[tuple[int, ...], CostFit]]) -> StepModelReport:
        """The report's `step_model`: the fleet-wide fit, the clock in use (`StepClock.view`: its
        model in words, its samples' source, the fit it stands on; `poor`: some worker's linear fit
        does not hold) and the step-cost model of each barrier group."""
        clock_model, clock_source, clock_fit = clock
        on_configured = clock_source == "configured"
        sc = self.clock
        measured, modelled = sc.tally.model_check
        vs_clock = sc.worker_clock.measured_vs_clock()
        return {
            "a_s_per_token": fit.a_s_per_token,
            "b_s": fit.b_s,
            "r2": fit.r2,
            "samples": fit.samples,
            "quality": fit.quality,
            "max_load_range_tokens": [fit.x_min, fit.x_max],
            "source": sc.estimator.source,
            "samples_by_source": dict(sc.estimator.samples),
            "samples_from": sc.samples_from(self.driver.step_sources),
            "step_event_sources": dict(self.driver.step_sources),
            # step events the lanes left out, by reason (`shadow.live.stepcheck`)
            "step_events_rejected": dict(sc.check.rejected),
            "configured": {"a_s_per_token": self.step.a, "b_s": self.step.b},
            # the clock the lanes step on: its model, where its samples came from
            "model_in_use": clock_model,
            "model_source": clock_source,
            "figures_use": "configured" if on_configured else "measured",
            # False: enough samples, and the model in use (a·max L + b fleet-wide, a_g·L_g + b_g
            # per worker) does not explain them (see the warning)
            "linear_model_holds": False if poor else {"good": True, "poor": False}.get(clock_fit.quality),
            "clock": {
                **sc.worker_clock.describe(self.workers, sc.worker_models),
                # what each worker's lane steps on now (under one barrier: the fleet's model)
                "lane_models": {
                    name: {"a_s_per_token": m.a, "b_s": m.b, "c_s_per_seq": m.c, "p_s_per_token": m.p}
                    for name, m in zip(self.workers, sc.lane_clock.models or (), strict=False)
                },
            },
            # the step-cost model of each barrier group (`shadow.core.stepcost`), from an engine
            # probe's counts; SSE gaps alone cannot identify some terms
            "cost": {
                "method": COST_METHOD,
                "window_steps": sc.worker_clock.window_steps,
                "oos_error_max": OOS_ERROR_MAX,
                "period_error_max": PERIOD_ERROR_MAX,
                "host_windows": HOST_WINDOWS,
                "groups": describe_costs(self.workers, cost_fits),
                # without an engine probe's counts: what the estimator cannot identify
                "not_identifiable": None if cost_fits else dict(COUNTLESS_UNIDENTIFIED),
            },
            "host_load_average": _load_average(),
            "measured_vs_configured": (measured / modelled) if modelled > 0 else None,
            "measured_vs_clock": vs_clock,
            # per step: worker-reported steps averaged; SSE windows (equal length, one median
            # each) weighted by the steps they hold (harmonic mean)
            "measured_step_mean_s": sc.tally.means(),
            "sse_check": sc.tally.sse_check(),
        }

    def _lane_state(self, lane: Lane) -> LaneState:
        """What `lane` holds now and how its decisions went (beside its figures in the report)."""
        t, loads, queued, label = lane.totals, lane.loads, lane.queued_tokens, lane.spec.label
        dec = t.decision_s
        agreements, decisions, rate = self.agreement.figures(label)
        return {
            "policy": lane.spec.policy,
            "spread_tokens": max(loads) - min(loads),
            "imbalance_tokens": len(loads) * max(loads) - sum(loads),
            "lookahead_stalls": t.stalls,
            "reseeds": lane.reseeds,
            # rolling: requests a re-seed took out before they finished here (reality ended them)
            "requests_dropped": lane.dropped_unfinished,
            "windows_cut": self.driver.cuts.get(label, 0),
            "lag_s": self.driver.lag(lane),
            "waiting": lane.waiting,
            "worker_loads": {w: loads[i] + queued[i] for i, w in enumerate(self.workers)},
            "worker_running_loads": {w: loads[i] for i, w in enumerate(self.workers)},
            "worker_active": {w: lane.running[i] for i, w in enumerate(self.workers)},
            "agreements": agreements,
            "decisions": decisions,
            "agreement_rate": rate,
            "decision_ms_p50": percentile(dec, 50, 1e3),
            "decision_ms_p99": percentile(dec, 99, 1e3),
            "decision_buckets": dec.cumulative(DECISION_BUCKETS) if isinstance(dec, LogHistogram) else [],
            "decision_count": len(dec),
            "decision_sum_s": dec.total if isinstance(dec, LogHistogram) else 0.0,
        }

    def _warnings(self, fit: FitResult, clock_model: str, on_configured: bool,
                  poor: list[tuple[str, WorkerModel]], dropped_total: int) -> list[str]:
        """What an operator must know before reading the figures: the step model and the clock."""
        sc = self.clock
        warnings: list[str] = []
        fleet_wide = clock_model.startswith("fleet-wide")
        on_cost = sc.measured and any(m.kind == "cost fit" for m in sc.worker_models)
        uses = (f"the lanes step on the configured model a={self.step.a:g} s/token, b={self.step.b:g} s"
                if on_configured else "the lanes step on the measured mean step")
        if on_cost:
            pass  # the step-cost model is the clock: its own checks (trust_problems)
        elif fleet_wide and fit.quality == "poor":
            warnings.append(
                f"the linear step model T = a·max L + b does not hold for these workers (R²={_r(fit.r2, 3)} "
                f"over {fit.samples} samples from {sc.samples_from(self.driver.step_sources)}): {uses}, "
                "which does not follow the load"
            )
        elif fleet_wide and fit.quality != "good":
            warnings.append(
                f"step model fit is {fit.quality} (R²={_r(fit.r2, 3)}, {fit.samples} samples): {uses}"
            )
        if poor:
            names = ", ".join(
                f"{name} (R²={_r(m.fit.r2, 3)} over {m.fit.samples} samples from "
                f"{'the engine probe' if m.source == 'probe' else m.source}; mean step "
                f"{1e3 * (m.mean_step_s or 0.0):.2f} ms)" for name, m in poor)
            warnings.append(
                f"the linear step model τ = a·L + b does not hold per worker for {names}: "
                f"{'their lanes step' if len(poor) > 1 else 'its lane steps'} on the measured mean step, "
                "which does not follow the load"
            )
        measured, modelled = sc.tally.model_check
        mean_step = sc.measured_mean()
        if on_configured and modelled > 0 and abs(measured / modelled - 1.0) > 0.05:
            ms = f" (mean {1e3 * mean_step:.2f} ms per step)" if mean_step is not None else ""
            warnings.append(
                f"measured steps{ms} are {100 * (measured / modelled - 1):+.0f}% against the configured "
                "model the lanes simulate: lanes drift from the fleet's real timing (set --step-a/--step-b "
                "from the fit)"
            )
        if dropped_total:
            warnings.append(f"{dropped_total} events dropped (lanes overloaded): lanes miss requests")
        if not self.driver.table.stream_steps:
            warnings.append(
                "Tokens come one per stream per interval (--token-interval): the streams' step times are "
                "interval means and their step ends the nodes' (Token.step_ends), both taken when the "
                "interval's Tokens come: a step-time window's SSE figure lags by up to one interval"
            )
        return warnings

    def _rolling(self) -> RollingReport:
        d = self.driver
        return {
            "window_s": d.rolling_s,
            "max_lag_s": d.max_lag_s,
            "windows_complete": self.windows.complete,
            "reseeds": d.reseeds,
            "seed_unknown_worker": d.seed_unknown_worker,
            "meaning": "every lane re-seeded from the mirrored fleet at each boundary of "
            f"{d.rolling_s:g} s: a window's figures say what each policy would have done from "
            "the same starting state; cumulative figures sum the windows"
            if d.rolling_s is not None else
            "off: each lane runs on from its own state since the start (lag can grow under overload)",
        }
