"""Arrival-rate scaling: `scale_rate` (rate × factor), `estimate_capacity_rps` (saturated throughput of
a fleet for a trace's length mix), `at_load` (rescale so the mean rate is ρ × capacity), and
`spread_ties` (spread requests that share a timestamp, e.g. Mooncake's quantised buckets).

The mean rate of a trace is `Trace.mean_rate_rps` = (n − 1) / duration, one over the mean gap.
"""

from __future__ import annotations

import math

import numpy as np

from shadow.traces.model import Trace


def _positive(value: float, what: str) -> float:
    number = float(value)
    if not (math.isfinite(number) and number > 0.0):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return number


def scale_rate(trace: Trace, factor: float) -> Trace:
    """The trace with its arrival rate multiplied by `factor` (> 0): every arrival time divided by it."""
    factor = _positive(factor, "rate factor")
    arrivals = trace.arrays()["arrival_s"] / factor
    return trace.with_arrivals(arrivals, note=f"arrival rate x{factor:.6g}")


def mean_slot_load_tokens(trace: Trace) -> float:
    """Time-averaged KV load of a busy slot, in tokens, when requests of `trace` run back to back.

    A request of prompt s and output o holds its slot o steps with loads s, s+1, …, s+o−1, so
    a slot's average is Σ o·(s + (o−1)/2) / Σ o: long requests weigh by how long they stay (this
    is what a snapshot of a saturated fleet sees; it exceeds mean_prompt + mean_output/2 when
    output lengths vary).
    """
    cols = trace.arrays()
    prompt = cols["prompt_tokens"].astype(np.float64)
    output = cols["output_tokens"].astype(np.float64)
    return float(np.sum(output * (prompt + (output - 1.0) / 2.0)) / np.sum(output))


def estimate_capacity_rps(
    trace: Trace,
    *,
    workers: int,
    slots: int,
    step_a: float,
    step_b: float,
    imbalance: float = 1.0,
    step_c: float = 0.0,
) -> float:
    """Saturated throughput, in requests/s, of `workers` DP ranks × `slots` slots whose decode step
    takes T = step_a · max_load + step_c · running + step_b seconds, for the request mix of `trace`.

    With every slot busy, a worker runs `slots` sequences holding slots × `mean_slot_load_tokens(trace)`
    KV tokens; the heaviest worker holds `imbalance` (≥ 1; 1 = perfect balance, an upper bound on
    capacity) times that, so T_sat = step_a · imbalance · slots · load + step_c · slots + step_b,
    and capacity = workers · slots / (mean_output · T_sat).
    """
    if len(trace) == 0:
        raise ValueError("estimate_capacity_rps: the trace is empty")
    if workers < 1 or slots < 1:
        raise ValueError(f"workers and slots must be >= 1, got workers={workers}, slots={slots}")
    if not all(math.isfinite(x) and x >= 0.0 for x in (step_a, step_b, step_c)):
        raise ValueError(
            f"step_a, step_b and step_c must be finite and >= 0, got {step_a!r}, {step_b!r}, {step_c!r}"
        )
    if not (math.isfinite(imbalance) and imbalance >= 1.0):
        raise ValueError(f"imbalance must be a finite number >= 1, got {imbalance!r}")
    step_s = step_a * imbalance * slots * mean_slot_load_tokens(trace) + step_b
    if step_c:
        step_s += step_c * slots
    if step_s <= 0.0:
        raise ValueError("estimate_capacity_rps: the step time is 0 (step_a, step_b and step_c all 0)")
    return workers * slots / (trace.mean_output_tokens * step_s)


def at_load(trace: Trace, rho: float, capacity_rps: float) -> Trace:
    """The trace rescaled in time so that its mean arrival rate is rho × capacity_rps (the shape of
    the arrival process is kept). Needs at least two requests at distinct times."""
    rho = _positive(rho, "rho")
    capacity_rps = _positive(capacity_rps, "capacity_rps")
    current = trace.mean_rate_rps
    if current <= 0.0:
        raise ValueError("at_load: the trace has no arrival rate (fewer than two distinct arrival times)")
    target = rho * capacity_rps
    arrivals = trace.arrays()["arrival_s"] * (current / target)
    note = f"arrivals rescaled to load rho={rho:.4g} of {capacity_rps:.6g} req/s ({target:.6g} req/s)"
    return trace.with_arrivals(arrivals, note=note)


def spread_ties(trace: Trace, window_s: float) -> Trace:
    """Requests sharing one arrival time t are spread evenly over [t, t + w), w = min(window_s, gap to
    the next distinct time), keeping their order; the first request keeps its time."""
    window_s = _positive(window_s, "window_s")
    arrivals = trace.arrays()["arrival_s"]
    n = len(arrivals)
    if n == 0:
        return trace
    starts = np.flatnonzero(np.r_[True, arrivals[1:] != arrivals[:-1]])
    ends = np.r_[starts[1:], n]
    spread = arrivals.copy()
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        size = end - start
        if size == 1:
            continue
        t = float(arrivals[start])
        width = min(window_s, float(arrivals[end]) - t) if end < n else window_s
        spread[start:end] = t + width * np.arange(size, dtype=np.float64) / size
    return trace.with_arrivals(spread, note=f"tied arrivals spread over {window_s:g} s")
