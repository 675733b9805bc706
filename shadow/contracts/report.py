"""`GET /v1/report`: the live analysis's report, section by section, as types.

The lanes build it through these types (`shadow.live.lanes`, `.shards`, `.confidence`,
`.routerrule`), the serve process adds its optional sections (`output_counts`, `mode`, `leader`),
and readers (the demo, the CLI, tests) read it through them: a key renamed on one side is a type
error on the other, not a silent "–". `report_schema()` derives the published JSON Schema
(`GET /v1/report/schema`) from the same types; every section is closed (`additionalProperties:
false`): it holds exactly the keys written here. Sections whose inner shape belongs to one producer
(the clock's and the step-cost fit's descriptions, the twin's figures, the serve process's
sections) are JSON objects here, documented where they are made.

`typing_extensions.TypedDict` (not `typing`'s): pydantic derives schemas only from it on 3.11.
"""

# no `from __future__ import annotations`: TypedDict reads NotRequired from evaluated annotations
from typing import Any, NotRequired

from typing_extensions import TypedDict


class BalanceFigures(TypedDict):
    """Balance in the field's units (`shadow.engine.balance`): NVIDIA's avg/max balance ratio and
    speed-of-light throughput, SGLang's per-step max/min quantiles."""

    balance_ratio_mean: float | None
    balance_ratio_p10: float | None
    idle_rate: float | None
    sol_throughput_tokens_per_s: float | None
    max_min_ratio_p50: float | None
    max_min_ratio_p90: float | None
    max_min_ratio_p95: float | None
    zero_min_fraction: float | None


class LaneFigures(BalanceFigures):
    """A lane's cumulative figures (`shadow.engine.windows.lane_figures`)."""

    steps: int
    requests_finished: int
    avg_spread_tokens: float
    avg_imbalance_tokens: float
    sum_spread_token_steps: float
    sum_imbalance_token_steps: float
    barrier_idle_fraction: float
    throughput_tokens_per_s: float
    tpot_s: float | None
    tokens: int


class WindowFigures(TypedDict):
    """One window of a lane (`shadow.engine.windows.WindowTotals.figures`)."""

    index: int
    steps: int
    avg_spread_tokens: float | None
    avg_imbalance_tokens: float | None
    barrier_idle_fraction: float | None
    throughput_tokens_per_s: float | None
    cut: bool


class LastWindow(TypedDict):
    """A lane's last complete window beside its cumulative figures (None before the first)."""

    window_index: int | None
    window_avg_spread_tokens: float | None
    window_avg_imbalance_tokens: float | None
    window_barrier_idle_fraction: float | None
    window_throughput_tokens_per_s: float | None


class LaneState(TypedDict):
    """What a lane holds now and how its decisions went (`shadow.live.lanes`)."""

    policy: str
    spread_tokens: float
    imbalance_tokens: float
    lookahead_stalls: int
    reseeds: int
    requests_dropped: int  # rolling: taken out by a re-seed before they finished here
    windows_cut: int
    lag_s: float
    waiting: int
    worker_loads: dict[str, float]
    worker_running_loads: dict[str, float]
    worker_active: dict[str, int]
    agreements: int | None
    decisions: int | None
    agreement_rate: float | None
    decision_ms_p50: float | None
    decision_ms_p99: float | None
    decision_buckets: list[int]
    decision_count: int
    decision_sum_s: float


class LaneReport(LaneFigures, LastWindow, LaneState):
    """One lane of the report: cumulative figures, last window, state."""


class StepModelReport(TypedDict):
    """The step-time fit, the clock the lanes step on and the step-cost model
    (`shadow.live.lanes`; `clock` and `cost` are described where they are made:
    `shadow.live.workerclock`, `shadow.core.stepcost`)."""

    a_s_per_token: float | None
    b_s: float | None
    r2: float | None
    samples: int
    quality: str
    max_load_range_tokens: list[float | None]
    source: str
    samples_by_source: dict[str, int]
    samples_from: str | None
    step_event_sources: dict[str, int]
    step_events_rejected: dict[str, int]
    configured: dict[str, float]
    model_in_use: str
    model_source: str
    figures_use: str
    linear_model_holds: bool | None
    clock: dict[str, Any]
    cost: dict[str, Any]
    host_load_average: float | None
    measured_vs_configured: float | None
    measured_vs_clock: float | None
    measured_step_mean_s: dict[str, float | None]
    sse_check: dict[str, Any] | None


class FidelityReport(TypedDict):
    """The twin check: the actual lane's loads against the engines' or the mirror's."""

    load_rel_error: float | None
    reference: str
    load_rel_error_mirror: float | None
    load_rel_error_unweighted: float | None
    load_rel_error_recent: float | None
    samples: int
    twin: dict[str, Any] | None
    servers: dict[str, Any] | None


class MirroredReport(TypedDict):
    worker_loads: dict[str, float]
    worker_placed_loads: dict[str, float]
    worker_active: dict[str, int]


class EventsReport(TypedDict):
    enqueued: int
    processed: int
    dropped: dict[str, int]
    queue_depth: int
    queue_capacity: int


class RequestsReport(TypedDict):
    released: int
    open: int
    late: int
    dropped: dict[str, int]
    unknown_worker_routes: int


class StepHistogram(TypedDict):
    buckets: list[float]
    counts: list[int]
    sum: float


class RollingReport(TypedDict):
    window_s: float | None
    max_lag_s: float | None
    windows_complete: int
    reseeds: int
    seed_unknown_worker: int
    meaning: str


class WindowsReport(TypedDict):
    window_s: float
    lanes: dict[str, list[WindowFigures]]


class RatioFigure(TypedDict):
    """A lane's figure against the reference lane over windows (`shadow.live.confidence`): the
    geometric mean of per-window ratios (> 1: the lane does better) with its 95 % interval."""

    ratio: float | None
    low: float | None
    high: float | None
    windows: int
    skipped: int
    verdict: str  # "not trustworthy" whenever the comparison has problems
    interval_verdict: str  # what the interval alone says


class Comparison(TypedDict):
    """Every lane against the reference (`actual`), figure by figure (`shadow.live.confidence`)."""

    reference: str
    method: str
    window_s: float
    windows: int
    trustworthy: bool
    problems: list[str]
    lanes: dict[str, dict[str, RatioFigure]]


class RouterRule(TypedDict):
    """Which compared lane's rule agrees most with the real router's placements
    (`shadow.live.routerrule`)."""

    closest_lane: str | None
    tied: list[str]  # the closest and the lanes not shown to disagree more often (Fisher, 5 %)
    agreement_rate: float | None
    decisions: int
    by_lane: dict[str, float]


class Report(TypedDict):
    """`GET /v1/report`. The last three sections are the serve process's (the tap's output counts,
    the mode controller's, the leader elector's), described where they are made."""

    lanes: dict[str, LaneReport]
    router_rule: RouterRule
    step_model: StepModelReport
    fidelity: FidelityReport
    workers: list[str]
    slots: int
    lag_s: float
    mirrored: MirroredReport
    events: EventsReport
    requests: RequestsReport
    step_histogram: dict[str, StepHistogram]
    cpu_s: float
    warnings: list[str]
    comparison: Comparison
    rolling: RollingReport
    windows: WindowsReport
    output_counts: NotRequired[dict[str, Any]]
    mode: NotRequired[dict[str, Any]]
    leader: NotRequired[dict[str, Any]]


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `Report`, derived from the types above."""
    from pydantic import TypeAdapter  # only the API and the tests ask: the data plane never loads it

    schema: dict[str, Any] = TypeAdapter(Report).json_schema()
    for section in (schema, *schema["$defs"].values()):  # every section closed: exactly its keys
        section["additionalProperties"] = False
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "shadow /v1/report"
    return schema
