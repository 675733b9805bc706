"""Every live comparison with its interval and a verdict, and when the figures cannot be trusted.

A lane's figures are compared with the `actual` lane's window by window (`engine.windows`:
batch means; the geometric mean of the window ratios with a 95 % t-interval on their logarithms,
`core.intervals.ratio_interval`, so both bounds are positive). The verdict is `better`, `worse`
or `no significant difference` from the interval, `too few windows` below three, and `not
trustworthy` whatever the interval says when the twin is out of bounds: the step model not good
(with an engine probe's counts: a group's step-cost model not chosen yet or more than 10 % off
out of sample on what it fitted, the engine's work per step where the probe measures its wait for
a CPU, or the model × the host factor more than 10 % off the window periods one window ahead,
`shadow.core.stepcost`; from SSE gaps only: the linear fit's R² < 0.9 or too few samples), twin
fidelity at or above 2 %, measured steps more than 5 % off the model the lanes simulate, or events
dropped before the lanes.
"""

from __future__ import annotations

from collections.abc import Sequence

from shadow.contracts.report import Comparison, RatioFigure
from shadow.core.hostfactor import LEVEL_WINDOWS
from shadow.core.stepcost import OOS_ERROR_MAX, PERIOD_ERROR_MAX, CostFit
from shadow.core.stepmodel import FitResult, StepTimeModel
from shadow.engine.windows import FIGURES, Windows

REFERENCE = "actual"
FIDELITY_MAX = 0.02
DRIFT_MAX = 0.05
NOT_TRUSTWORTHY = "not trustworthy"
#: Every verdict, as `/v1/report` and the `verdict` label spell them.
VERDICTS = ("better", "no significant difference", "worse", "too few windows", NOT_TRUSTWORTHY)


def cost_problem(name: str, fit: CostFit) -> str | None:
    """Why a group's step-cost model cannot carry the figures (None: it can): not chosen yet, or
    its out-of-sample error above OOS_ERROR_MAX on what it fitted (the engine's work per step, or
    the period where the wait is not measured), said with its R² and what drives the variance."""
    ch = fit.chosen
    if ch is None:
        return f"step cost model of {name} not chosen yet ({fit.reason})"
    if ch.oos_error is not None and ch.oos_error <= OOS_ERROR_MAX:
        return None
    err = "–" if ch.oos_error is None else f"{ch.oos_error:.0%}"
    r2 = "–" if ch.r2 is None else f"{ch.r2:.2f}"
    rest = "" if fit.residual_cv is None else f", the rest ±{fit.residual_cv:.0%} of the step"
    if fit.basis == "engine":
        on, drives = "the engine's work per step", {"load": "the load drives it",
                                                    "host": "the load does not explain the engine's work"}
    else:
        on, drives = "the step period (no wait for a CPU measured)", {
            "load": "the load drives the variance", "host": "the host, not the load, drives the variance"}
    return (f"step cost model of {name} ({ch.label}, on {on}) is {err} off out of sample on "
            f"{fit.window_steps}-step windows (needs ≤ {OOS_ERROR_MAX:.0%}; R² {r2}: "
            f"{drives.get(fit.driver or '', 'no fit')}{rest})")


def period_problem(name: str, fit: CostFit) -> str | None:
    """Why what a group's lanes step on does not keep the engine's timeline (None: it does): the
    model × the clock factor predicted its window periods, one window ahead, more than
    PERIOD_ERROR_MAX off (median), said with the factors and how the host moved."""
    err = fit.period_error
    if err is None or err <= PERIOD_ERROR_MAX:
        return None
    h = fit.host if fit.basis == "engine" else None
    f = fit.clock_factor if fit.basis == "engine" else None
    what = "the step cost model" if f is None else "engine cost × clock factor"
    host = "" if h is None or f is None else (
        f"; clock factor {f:.2f} over the last {h.recent_windows} windows, of which the host's wait "
        f"{h.recent:.2f} ({h.low:.2f}–{h.high:.2f}, 10th–90th percentile over {h.windows})"
        + (": the host changed within the run" if h.moved else ""))
    return (f"{what} of {name} predicts its {fit.window_steps}-step window periods {err:.0%} off, one window "
            f"ahead (median of {fit.period_windows}; needs ≤ {PERIOD_ERROR_MAX:.0%}){host}")


def host_warnings(fits: Sequence[tuple[str, CostFit]], trustworthy: bool) -> list[str]:
    """A warning per group whose host factor moved within the run (that of its last windows outside
    the 10th-90th percentiles of its windows' factors), saying whether the figures still hold
    (`trustworthy`: every check, the window periods' included, passes)."""
    out = []
    for name, fit in fits:
        h = fit.host
        if fit.basis != "engine" or h is None or not h.moved:
            continue
        holds = ("the figures still hold (every check passes)" if trustworthy else
                 "the figures do not hold (see the comparison's problems)")
        out.append(f"the host factor of {name} moved within the run: {h.level:.2f} over the last "
                   f"{LEVEL_WINDOWS} windows against {h.median:.2f} (median; {h.low:.2f}–{h.high:.2f}) "
                   f"over {h.windows}: the lanes' clock follows it (clock factor "
                   f"{fit.clock_factor or 1:.2f}), the engine's cost terms stand on all its windows; {holds}")
    return out


def trust_problems(
    fit: FitResult, fidelity: float | None, measured_vs_model: float | None, dropped: int,
    cost: Sequence[tuple[str, CostFit]] = (),
) -> list[str]:
    """Why the live figures cannot be trusted (empty: they can). `cost`: the step-cost fits of the
    barrier groups by name when an engine probe feeds them (they are then the step model's test,
    else `fit`, the linear fit of SSE gaps)."""
    out: list[str] = [p for name, cf in cost for p in (cost_problem(name, cf), period_problem(name, cf))
                      if p is not None]
    if not cost and fit.quality != "good":
        r2 = "–" if fit.r2 is None else f"{fit.r2:.2f}"
        out.append(f"step model fit is {fit.quality} (R² {r2}, {fit.samples} samples; needs R² ≥ 0.9)")
    if fidelity is None:
        out.append("no twin fidelity yet (the actual lane has not been compared with the mirror)")
    elif fidelity >= FIDELITY_MAX:
        out.append(f"twin fidelity {fidelity:.1%} (the actual lane's loads vs the fleet's; needs < 2%)")
    if measured_vs_model is not None and abs(measured_vs_model - 1.0) > DRIFT_MAX:
        out.append(f"measured steps {100 * (measured_vs_model - 1):+.0f}% against the model the lanes "
                   "simulate (the host or the fleet did not keep the model's timeline)")
    if dropped:
        out.append(f"{dropped} events dropped before the lanes")
    return out


def comparison(
    windows: Windows, step: StepTimeModel | None, workers: int, problems: list[str]
) -> Comparison:
    """The `comparison` block of the live report (see module docstring); `step` None: the lanes'
    figures on their own clock (the measured one)."""
    lanes: dict[str, dict[str, RatioFigure]] = {}
    if REFERENCE in windows.labels:
        for label in windows.labels:
            if label == REFERENCE:
                continue
            figures = windows.compare(label, REFERENCE, step, workers)
            lanes[label] = {
                name: {
                    "ratio": iv.ratio,
                    "low": iv.low,
                    "high": iv.high,
                    "windows": iv.n,
                    "skipped": iv.skipped,
                    "verdict": NOT_TRUSTWORTHY if problems else iv.verdict,
                    "interval_verdict": iv.verdict,
                }
                for name, iv in ((n, figures[n]) for n in FIGURES)
            }
    return {
        "reference": REFERENCE,
        "method": f"batch means: one ratio per {windows.window_s:g} s window of lane time (lane vs "
        f"{REFERENCE}; > 1: the lane does better), their geometric mean with a two-sided 95% "
        "t-interval of the log ratios over windows (both bounds positive)",
        "window_s": windows.window_s,
        "windows": windows.complete,
        "trustworthy": not problems,
        "problems": problems,
        "lanes": lanes,
    }
