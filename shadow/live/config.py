"""The live lanes' settings, declared once: each field is a setting whose flag, YAML key and
environment variable `shadow serve` derives from it (`shadow.base.knobs`), and whose default
`LiveLanes` takes as its own."""

from __future__ import annotations

from dataclasses import dataclass

from shadow.base.knobs import AT_LEAST_ONE, NON_NEGATIVE, NON_NEGATIVE_S, POSITIVE_S, Bound, knob
from shadow.core.stepmodel import DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S
from shadow.engine.live import DEFAULT_LAG_S
from shadow.live.stepfit import DEFAULT_SOURCE, SOURCES, WINDOW_S


@dataclass(kw_only=True)
class LanesConfig:
    """What the live lanes run with (keyword-only, so that a config built on it keeps its own
    positional fields first)."""

    lag_s: float = knob(
        DEFAULT_LAG_S, "--lag", "lanes run this far behind the live clock, so that late events still count",
        Bound(lambda v: 0 <= v <= 3600, "in [0, 3600] s"), metavar="SECONDS")
    step_source: str = knob(
        DEFAULT_SOURCE, "--step-source", "measured step times: worker `step` events, SSE inter-chunk gaps, "
        "or auto (events when reported, else SSE)", choices=SOURCES)
    lane_clock: str = knob(
        "measured", "--lane-clock", "the clock the lanes step on: measured (per-worker step models and "
        "barrier groups from the workers' measured steps; the configured model until measured) or "
        "configured (--step-a/--step-b, one fleet-wide barrier)", choices=("measured", "configured"))
    step_a: float = knob(
        DEFAULT_A_S_PER_TOKEN, "--step-a", "step model the lanes simulate: seconds per KV token of max load",
        NON_NEGATIVE_S)
    step_b: float = knob(
        DEFAULT_B_S, "--step-b", "step model the lanes simulate: fixed seconds per step", NON_NEGATIVE_S)
    compare_window_s: float = knob(
        60.0, "--compare-window", "each lane is compared with `actual` window by window: one ratio per "
        "window of this many seconds, a 95%% interval over windows", Bound(lambda v: 0 < v < 1e9, "> 0 s"),
        metavar="SECONDS")
    rolling: bool = knob(
        False, "--rolling", "rolling counterfactual: at every --compare-window boundary each lane is "
        "re-seeded from the mirrored fleet (what each policy would have done over the next window from the "
        "same state); a lane more than one window behind is re-seeded ahead (its window cut), so lag stays "
        "within --lag + one window under any overload")
    step_window_s: float = knob(
        WINDOW_S, "--step-window", "window of one measured step-time sample", POSITIVE_S, metavar="SECONDS")
    live_queue_size: int = knob(
        200_000, "--live-queue-size", "events waiting for the lanes; beyond it events are dropped and "
        "counted", AT_LEAST_ONE, metavar="EVENTS")
    lane_shards: int = knob(
        0, "--lane-shards", "run the policies' lanes in this many processes beside the analysis, one "
        "report (0: in the analysis process)", NON_NEGATIVE, metavar="N")
    lane_ray: str | None = knob(
        None, "--ray", "with --lane-shards: the shards as Ray actors on the cluster at this address (as "
        "`shadow sweep --ray`; none: local processes)", metavar="ADDRESS")
