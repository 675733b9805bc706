"""Small typed helpers over the Grafana Foundation SDK: one datasource variable, fleet/instance
variables, panels with a unit and a description, explicit ids and grid positions.

Every target uses `${datasource}`; every selector filters on the Kubernetes `cluster`, `namespace`
and `pod` labels (where service discovery or external labels put them: "All" also matches series
without them, as on bare metal), the `fleet` target label (added by the shipped scrape configs)
and the sidecar `instance`. A time series showing a metric an alert
compares with a constant draws that constant as a threshold line (`ALERT_LINES`); a panel of
counter rates shows 0, not "No data", when nothing happened; every dashboard marks mode changes
and fallback trips as annotations.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
PLACE = 'cluster=~"$cluster", namespace=~"$namespace", pod=~"$pod"'
SEL = PLACE + ', fleet=~"$fleet", instance=~"$instance"'
RATE = "$__rate_interval"
TAGS = ["shadow", "llm-routing"]


#: Metric -> (the constant an alert in alerts/src compares it with, whether it fires above it).
ALERT_LINES: dict[str, tuple[float, bool]] = {
    "shadow_mirror_drift_requests": (2, True),  # ShadowStateDrift (|drift| > 2)
    "shadow_mirror_scrape_age_seconds": (30, True),  # ShadowWorkerTelemetryStale
    "shadow_fidelity_load_relative_error": (0.05, True),  # ShadowTwinFidelityPoor
    "shadow_step_model_r2": (0.8, False),  # ShadowStepModelPoorFit
    "shadow_lane_lag_seconds": (30, True),  # ShadowLanesLagging
    "shadow_router_decision_duration_seconds": (0.02, True),  # ShadowDecisionsSlow (p99)
    "shadow_pool_wait_seconds": (0.05, True),  # ShadowPoolWaitRising (p99)
    "shadow_predictor_calibration_error": (0.15, True),  # ShadowPredictorDrift
    "shadow_predictor_oracle_gap_ratio": (1, True),  # ShadowPredictorDrift
}
_COUNTER_RATE = re.compile(r"^\s*sum\b.*\b(rate|increase)\(")


def _alert_lines(exprs: list[str]) -> list[tuple[float, bool]]:
    """The alert constants of the metrics `exprs` show (a histogram by its buckets)."""
    return [line for name, line in ALERT_LINES.items()
            if any(re.search(rf"\b{name}(_bucket)?\{{", e) for e in exprs)]


def _zero_meant(exprs: list[str]) -> bool:
    """Every target is a sum of counter rates: no series means nothing happened, i.e. 0."""
    return bool(exprs) and all(_COUNTER_RATE.match(e) for e in exprs)


def sel(extra: str = "") -> str:
    """The dashboard's series selector, optionally with more matchers."""
    return "{" + SEL + (", " + extra if extra else "") + "}"


def rate(metric: str, by: str = "", extra: str = "", *, fn: str = "rate", agg: str = "sum") -> str:
    """`agg by (by) (fn(metric{selector}[window]))`: a counter's rate (or increase) over the window."""
    return f"{agg}{_by(by)} ({fn}({metric}{sel(extra)}[{RATE}]))"


def level(metric: str, by: str = "", extra: str = "", *, agg: str = "max") -> str:
    """`agg by (by) (metric{selector})`: a gauge aggregated over the series it has."""
    return f"{agg}{_by(by)} ({metric}{sel(extra)})"


def per_step(counter: str, lanes: str = "", by: str = "lane") -> str:
    """A lane counter's average per step over the window: rate(Σ x over steps) / rate(steps)."""
    return f'{rate(counter, by, lanes)} / {rate("shadow_lane_steps_total", by, lanes)}'


def legend(by: str) -> str:
    """The legend naming each label of `by` ("a, b" -> "{{a}} {{b}}")."""
    return " ".join("{{" + k.strip() + "}}" for k in by.split(",") if k.strip())


def _by(by: str) -> str:
    return f" by ({by})" if by else ""


def named(name: str, by: str) -> str:
    """A series' legend: `name`, then the labels of `by` ("retry", "leg" -> "retry {{leg}}")."""
    return f"{name} {legend(by)}".strip()


def q(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False,
      heat: bool = False) -> prometheus.Dataquery:
    """One target; panels renumber their targets A, B, C, ... in order."""
    t = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        t = t.legend_format(legend)
    if instant:
        t = t.instant()
    if heat:
        t = t.format(pm.PromQueryFormat.HEATMAP)
    return t


def rates(metric: str, by: str = "", extra: str = "", *, fn: str = "rate",
          name: str = "") -> prometheus.Dataquery:
    """One target: a counter's `rate` by `by`, a series per label value, named `named(name, by)`."""
    return q(rate(metric, by, extra, fn=fn), named(name, by))


def levels(metric: str, by: str = "", extra: str = "", *, agg: str = "max",
           name: str = "") -> prometheus.Dataquery:
    """One target: a gauge's `level` by `by`, a series per label value, named `named(name, by)`."""
    return q(level(metric, by, extra, agg=agg), named(name, by))


def ts(title: str, description: str, unit: str, *targets: prometheus.Dataquery,
       min_: float | None = 0, max_: float | None = None, decimals: float | None = None) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DS)
         .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST)
                 .placement(cm.LegendPlacement.BOTTOM).show_legend(True)))
    if min_ is not None:
        p = p.min(min_)
    if max_ is not None:
        p = p.max(max_)
    if decimals is not None:
        p = p.decimals(decimals)
    for i, t in enumerate(targets):
        p = p.with_target(t.ref_id(chr(65 + i)))
    exprs = [str(t.build().expr) for t in targets]
    lines = _alert_lines(exprs)
    if lines:
        steps: list[tuple[float | None, str]] = [(None, "transparent")]
        steps += [(v, "red" if above else "transparent") for v, above in sorted(lines)]
        p = (p.thresholds(thresholds(*steps))
             .thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)))
    if _zero_meant(exprs):
        p = p.no_value("0")
    return p


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=v, color=c) for v, c in steps]))


def st(title: str, description: str, unit: str, expr: str, *, decimals: float | None = None,
       steps: tuple[tuple[float | None, str], ...] = ((None, "blue"),)) -> stat.Panel:
    p = (stat.Panel().title(title).description(description).unit(unit).datasource(DS)
         .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
         .graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
         .thresholds(thresholds(*steps))
         .with_target(q(expr, instant=True)))
    if decimals is not None:
        p = p.decimals(decimals)
    if _zero_meant([expr]):
        p = p.no_value("0")
    return p


def heat(title: str, description: str, unit: str, target: prometheus.Dataquery, *,
         calculate: bool) -> heatmap.Panel:
    return (heatmap.Panel().title(title).description(description).unit(unit).datasource(DS)
            .calculate(calculate).y_axis(heatmap.YAxisConfig().unit(unit)).with_target(target))


def variables(d: db.Dashboard, *, lane: bool = False) -> db.Dashboard:
    """Datasource, fleet and sidecar instance variables (multi, all, reload on time change)."""
    d = d.with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    scope = ""
    for name, label in (("cluster", "Cluster"), ("namespace", "Namespace"), ("pod", "Pod")):
        d = d.with_variable(
            db.QueryVariable(name).label(label).datasource(DS)
            .query(f"label_values(shadow_mirror_events_total{{{scope}}}, {name})")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))
        scope += (", " if scope else "") + f'{name}=~"${name}"'
    d = d.with_variable(
        db.QueryVariable("fleet").label("Fleet").datasource(DS)
        .query(f"label_values(shadow_mirror_events_total{{{PLACE}}}, fleet)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True).include_all(True).all_value(".*"))
    d = d.with_variable(
        db.QueryVariable("instance").label("Sidecar").datasource(DS)
        .query(f'label_values(shadow_mirror_events_total{{{PLACE}, fleet=~"$fleet"}}, instance)')
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True).include_all(True).all_value(".*"))
    if lane:
        d = d.with_variable(
            db.QueryVariable("lane").label("Lane").datasource(DS)
            .query('label_values(shadow_lane_steps_total{fleet=~"$fleet"}, lane)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))
    return d


class Layout:
    """Places panels left to right on Grafana's 24-column grid, rows across; ids from 1."""

    def __init__(self, d: db.Dashboard) -> None:
        self.d = d
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.d = self.d.with_row(db.Row(title).id(self._id()).grid_pos(dm.GridPos(h=1, w=24, x=0, y=self.y)))
        self.y += 1

    def add(self, panel: cogbuilder.Builder[dm.Panel], w: int = 12, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel.id(self._id()).grid_pos(dm.GridPos(h=h, w=w, x=self.x, y=self.y))  # type: ignore[attr-defined]
        self.d = self.d.with_panel(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _moments(counter: str, by: str) -> str:
    """Samples where `counter` went up in the last minute, its first count included: a series is
    born at 1 when its first event happens (labels are exported once seen), which `changes()`
    alone never sees."""
    now = f"{counter}{sel()}"
    return f"sum by ({by}) ((changes({now}[1m]) > 0) or ({now} unless {now} offset 1m))"


#: Annotations on every dashboard: (name, colour, the expression whose samples mark the moments).
ANNOTATIONS = (
    ("Mode changes", "blue", _moments("shadow_mode_transitions_total", "mode, reason")),
    ("Fallback trips", "red", _moments("shadow_fallback_trips_total", "reason")),
)


def dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    d = db.Dashboard(title)
    for name, colour, expr in ANNOTATIONS:
        d = d.annotation(db.AnnotationQuery().name(name).datasource(DS).enable(True).icon_color(colour)
                         .expr(expr))
    return (d.uid(uid).description(description).tags(TAGS).readonly()
            .refresh("30s").time("now-1h", "now").timezone("browser")
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)
            .link(db.DashboardLink("shadow dashboards").type(dm.DashboardLinkType.DASHBOARDS)
                  .tags(["shadow"]).as_dropdown(True).include_vars(True).keep_time(True)))


@dataclass(frozen=True)
class Board:
    """One dashboard: uid (also its file name), title, description, and what lays out its panels
    (`lane`: a lane variable beside the datasource, fleet and instance ones)."""

    uid: str
    title: str
    description: str
    panels: Callable[[Layout], None]
    lane: bool = False

    def build(self) -> db.Dashboard:
        lay = Layout(variables(dashboard(self.uid, self.title, self.description), lane=self.lane))
        self.panels(lay)
        return lay.d
