"""`shadow replay`: a trace or synthetic workload through every policy lane; the paper's table."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shadow.base.extras import missing_extra
from shadow.commands._help import add_command
from shadow.commands._replay_args import (
    STEP_FLAGS,
    Given,
    add_br_args,
    add_fleet_args,
    add_workload_args,
    given,
    setup_from,
    trace_limits,
)
from shadow.commands.sweep_protocol import add_protocol_args, run_protocol
from shadow.core.policies import lane_names
from shadow.replay.experiment import DEFAULT_POLICIES, ReplayReport, ReplaySetup, as_recorded, run_replay
from shadow.replay.render import render_report
from shadow.replay.rolled import render_rolled, run_rolled
from shadow.traces import Trace, TraceError, TraceLimits, resolve

SUMMARY = "replay a trace through BR-0/BR-H and the baselines (offline)"
DESCRIPTION = (
    "Replay a trace through the fleet engine: one lane per policy, same arrivals, and print average "
    "max−min spread, I(k), barrier idle, throughput, TPOT, TTFT and decision time."
)
EPILOG = """examples:
  shadow replay paper-azure --load 1.05                  # the paper's comparison, near saturation
  shadow replay data/traces/conversation_trace.jsonl --load 1.05 --json out.json --plot loads.png
  shadow replay paper-templates -G 16 --policies jsq,jsq-bytes,br0,brh:exactmatch,brh:oracle
  shadow replay paper-azure --load 1.05 --steady --policies jsq-bytes,least-tokens,br0,bra   # 3 seeds, CI

  shadow replay session.ndjson.gz                       # a `shadow serve --record` session, as it ran live
  shadow replay session.ndjson.gz --step-a 2e-7          # ... what if the step model were different
  shadow replay paper-azure --step-c 1e-3 --policies jsq-bytes,br0   # a per-sequence step cost
  shadow replay rolling.ndjson.gz --rolling-window 12    # `serve --rolling`: window 12 alone, from its seed

Throughput and latencies come from the step model T = a·max L + b (set --step-a/--step-b to
your fleet's fit). With a per-sequence term (--step-c, seconds per running sequence: a worker steps
in a·L + c·n + b) BR-0, BR-H and BRA balance that cost: a request weighs its KV tokens + c/a, or
one sequence when a = 0. brh:oracle knows true output lengths: an offline upper bound, never deployable.
A session recorded by `shadow serve` carries what its live lanes ran with (policies, step model,
slots, BR parameters, seed; with the measured clock, the step models fitted live, of which the
replay runs on the last): without flags the replay runs exactly that; each flag that departs
from it is printed as a what-if. A session of `shadow serve --rolling` also carries each window's
starting state (its seed): the replay starts every window from it, as the live lanes did, and prints
cumulative and per-window figures. Older recordings (and `shadow tap`'s) take the flags and defaults.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = add_command(sub, "replay", SUMMARY, DESCRIPTION, EPILOG, run)
    add_workload_args(p)
    add_fleet_args(p)
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        action=Given,
        help=f"comma-separated lanes: {lane_names()} (bra: this project's BalanceRoute-adaptive; a "
        "predicted policy alone takes survival) (default: all but bra; a recorded session: its live lanes)",
    )
    add_br_args(p)
    p.add_argument("--rolling-window", dest="rolling_window", type=int, metavar="N", default=None,
                   help="a session recorded with rolling lanes (serve --rolling): replay window N alone, "
                   "from the fleet state it started from live (default: every window in turn)")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw per-worker KV-load trajectories per policy (needs shadow[plot])")
    add_protocol_args(p, default=False)


def load_workload(spec: str, seed: int, limit: int | None, limits: TraceLimits) -> Trace:
    return resolve(spec, seed=seed, limit=limit, limits=limits)


def replay_with_progress(trace: Trace, setup: ReplaySetup, console: Console) -> ReplayReport:
    """run_replay with a progress bar per lane (plain lines when not on a terminal)."""
    with Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    ) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)  # type: ignore[arg-type]
            if not console.is_terminal and done == total:
                console.print(f"  {label}: {total} requests replayed")

        return run_replay(trace, setup, progress)


def recorded_setup(
    trace: Trace, setup: ReplaySetup, flags: set[str], err: Console
) -> tuple[ReplaySetup, list[str] | None]:
    """A recorded session replays with what its live lanes ran with, flags given aside (each
    printed as a what-if); None when the trace says nothing of its lanes."""
    recorded = trace.lane_settings
    if recorded is None:
        if trace.workers is not None:
            err.print(f"note: {trace.name} does not say what its lanes ran with (an older recording, or "
                      f"`shadow tap`'s): replaying with step model {setup.step.describe()}, "
                      f"{setup.slots} slots")
        return setup, None
    setup, what_if = as_recorded(setup, recorded, flags)
    measured = recorded.clock == "measured"
    fitted = trace.clocks[-1] if measured and trace.clocks and not flags & STEP_FLAGS else None
    if fitted is not None:
        setup = replace(setup, clock=fitted[1])
    head = ("replaying the live lanes' settings (not their measured clock)" if measured and fitted is None
            else "replaying as the live lanes ran")
    err.print(f"{head}: {','.join(recorded.policies)}; step model "
              f"{recorded.step.describe()} ({recorded.step_origin}); {recorded.slots} slots")
    if fitted is not None:
        models = fitted[1].models or ()
        err.print(f"on the live lanes' last measured clock (recorded at t={fitted[0]:g}, of "
                  f"{len(trace.clocks)}): {len(fitted[1].groups)} barrier group(s); step models "
                  + "; ".join(dict.fromkeys(m.describe() for m in models)))
    elif measured:
        err.print("[yellow]note: the live lanes stepped on the measured clock (per-worker step models "
                  "fitted live, /v1/report's clock block), which this replay does not run on "
                  + ("(a --step-* flag asks for the step model above)" if trace.clocks else
                     "(the recording has no clock line: an older recording, or lanes that never "
                     "left the configured model)")
                  + ": it runs on the step model above and its figures may differ from the live lanes' "
                  "(record with `shadow serve --lane-clock configured` for a replay that reproduces them)[/]")
    for line in what_if:
        err.print(f"[yellow]what-if: {line}[/]")
    return setup, what_if


def _rolled(trace: Trace, setup: ReplaySetup, args: argparse.Namespace, what_if: list[str] | None,
            console: Console, err: Console) -> int:
    """A session recorded with rolling lanes: each window from its recorded seed."""
    if args.plot:
        raise ValueError("--plot draws whole runs: not for a rolling recording")
    n = len(trace.seeds)
    n_only = args.rolling_window
    how = f"replaying window {n_only} alone" if n_only is not None else "replaying each in turn"
    err.print(f"rolling lanes: {n} windows recorded with their seeds; {how}")
    report = run_rolled(trace, setup, args.rolling_window)
    if args.json:
        doc = report.to_json()
        doc["config"]["what_if"] = what_if
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        err.print(f"wrote {args.json}")
    render_rolled(report, console)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.steady:
        return run_protocol(args, args.policies, "replay")
    console = Console(stderr=False)
    if not console.is_terminal:
        console = Console(stderr=False, width=170)
    err = Console(stderr=True)
    missing = missing_extra("matplotlib", "plot", "--plot") if args.plot else None
    if missing:
        print(f"shadow replay: {missing}", file=sys.stderr)
        return 2
    try:
        setup = setup_from(args, args.policies)
        if args.plot:
            setup = replace(setup, trajectory_points=1500)
        trace = load_workload(args.trace, args.seed, args.limit, trace_limits(args))
        setup, what_if = recorded_setup(trace, setup, given(args), err)
        if trace.seeds or args.rolling_window is not None:
            return _rolled(trace, setup, args, what_if, console, err)
        report = replay_with_progress(trace, setup, err)
    except (TraceError, ValueError) as exc:
        print(f"shadow replay: {exc}", file=sys.stderr)
        return 2
    # Files first: whatever the table shows, the figures are on disk.
    if args.json:
        doc = report.to_json()
        doc["config"]["what_if"] = what_if
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        err.print(f"wrote {args.json}")
    if args.plot:
        from shadow.replay.plot import plot_trajectories

        plot_trajectories(report, args.plot)
        err.print(f"wrote {args.plot}")
    render_report(report, console)
    return 0
