"""`shadow replay` of a session recorded with rolling lanes: every window from its recorded seed.

The figures are the live report's: per lane the cumulative ones (over every step, re-priced under
the step model) and one row per window (spread, I(k), barrier idle, throughput); `--rolling-window N`
replays window N alone from its seed. A replay knows every end, so it never cuts a window (a live
lane too far behind does: such a window's live figures are not comparable).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from shadow.contracts.report import WindowFigures
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.rolled import replay_rolling
from shadow.engine.windows import lane_figures
from shadow.replay.experiment import ReplaySetup
from shadow.traces import Trace

SHOWN_WINDOWS = 12  # the table's last windows (the JSON has them all)


@dataclass(frozen=True, slots=True)
class RolledReport:
    """Per lane: cumulative figures and its windows (oldest first), as `to_json` writes them."""

    window_s: float
    only: int | None
    lanes: dict[str, dict[str, Any]]
    windows: dict[str, list[WindowFigures]]
    config: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        lanes = {label: {**figs, "windows": self.windows[label]} for label, figs in self.lanes.items()}
        rolling = {"window_s": self.window_s, "only": self.only}
        return {"rolling": rolling, "config": self.config, "lanes": lanes}


def run_rolled(trace: Trace, setup: ReplaySetup, only: int | None = None) -> RolledReport:
    """Replay a rolling recording (`trace.seeds`); ValueError when it has none or ρ is rescaled."""
    if not trace.seeds or not trace.workers:
        raise ValueError(f"{trace.source}: no rolling windows recorded (no seed lines)")
    if setup.load is not None or setup.rate_scale is not None:
        raise ValueError("a rolling recording replays at its own arrivals (no --load or --rate-scale)")
    workers = list(trace.workers)
    config = EngineConfig(workers=len(workers), slots=setup.slots, step=setup.step, br=setup.br,
                          seed=setup.seed, clock=setup.clock)
    specs = [LaneSpec.parse(p) for p in setup.policies]
    rolled = replay_rolling(trace.recorded, trace.seeds, config, specs, workers, time.perf_counter, only=only)
    g = len(workers)
    lanes: dict[str, dict[str, Any]] = {}
    windows: dict[str, list[WindowFigures]] = {}
    for lane in rolled.driver.lanes:
        label = lane.spec.label
        series = rolled.series(label)
        if only is not None:
            series = [w for w in series if w.index == only]
        windows[label] = [w.figures(setup.step, g) for w in series]
        lanes[label] = {"policy": lane.spec.policy, **lane_figures(lane.totals, setup.step, g),
                        "reseeds": lane.reseeds}
    window_s = next(iter(trace.seeds.values())).window_s
    cfg = {"workers": workers, "slots": setup.slots, "policies": list(setup.policies),
           "step": {"a_s_per_token": setup.step.a, "b_s": setup.step.b, "c_s_per_seq": setup.step.c,
                    "p_s_per_prefill_token": setup.step.p}, "seeds": len(trace.seeds)}
    return RolledReport(window_s, only, lanes, windows, cfg)


def _f(v: Any, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def render_rolled(report: RolledReport, console: Console) -> None:
    """The cumulative table (whole replay only), then spread per window and lane."""
    labels = list(report.lanes)
    if report.only is None:
        table = Table(title=f"rolling lanes, re-seeded every {report.window_s:g} s (cumulative)")
        for col in ("lane", "spread", "I(k)", "idle", "tok/s", "steps", "done", "windows"):
            table.add_column(col, justify="left" if col == "lane" else "right")
        for label, f in report.lanes.items():
            table.add_row(label, _f(f["avg_spread_tokens"], ",.0f"), _f(f["avg_imbalance_tokens"], ",.0f"),
                          _f(100 * f["barrier_idle_fraction"], ".1f") + "%",
                          _f(f["throughput_tokens_per_s"], ",.0f"), str(f["steps"]),
                          str(f["requests_finished"]), str(len(report.windows[label])))
        console.print(table)
    first = report.windows[labels[0]] if labels else []
    shown = first[-SHOWN_WINDOWS:]
    what = f"window {report.only} alone, from its seed" if report.only is not None else (
        f"the last {len(shown)} of {len(first)} windows")
    table = Table(title=f"average spread per {report.window_s:g} s window ({what})")
    table.add_column("window", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    by = {label: {w["index"]: w for w in report.windows[label]} for label in labels}
    for w in shown:
        cells = []
        for label in labels:
            x = by[label].get(w["index"])
            cells.append("–" if x is None else _f(x["avg_spread_tokens"], ",.0f"))
        table.add_row(str(w["index"]), *cells)
    console.print(table)
