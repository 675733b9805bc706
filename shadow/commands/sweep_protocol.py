"""`shadow sweep` (and `shadow replay --steady`) under the steady-state protocol: tables with CIs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shadow.base.knobs import argument, knob_values, knobs
from shadow.commands._replay_args import br_params, step_model, trace_limits
from shadow.core.cost import RouteCost
from shadow.replay.protocol import (
    NO_INTERVAL,
    Cell,
    Protocol,
    cells_for,
    interval_text,
    run_cells,
    summarise,
)
from shadow.replay.sweep_ray import RayUnavailable, run_cells_ray
from shadow.traces import TraceError


def add_protocol_args(p: argparse.ArgumentParser, default: bool) -> None:
    """The protocol's flags; `default` says whether it is the command's default mode."""
    title = "steady-state protocol (the default)" if default else "steady-state protocol (--steady)"
    g = p.add_argument_group(title)
    if default:
        g.add_argument("--whole-run", action="store_true", help="old whole-run figures, unbounded queues")
    else:
        g.add_argument("--steady", action="store_true", help="measure under the steady-state protocol")
    g.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    warmup, window, max_requests = knobs(Protocol)  # declared once: the protocol's fields
    for f, k in (warmup, window):
        g.add_argument(k.flag, dest=k.dest, **argument(f, k))
    g.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="admission timeout in s, waiting requests shed; 0 = none (default)",
    )
    g.add_argument(
        "--queue",
        type=int,
        default=6,
        metavar="N",
        help="bounded queue: reject arrivals while N×G requests wait (pool or queues); "
        "0 = unbounded (default 6)",
    )
    g.add_argument(max_requests[1].flag, dest=max_requests[1].dest, **argument(*max_requests))
    g.add_argument("--jobs", type=int, default=1, help="local worker processes (default 1)")


def protocol_from(args: argparse.Namespace) -> Protocol:
    seeds = tuple(int(x) for x in str(args.seeds).split(",") if x.strip())
    return Protocol(
        timeout_s=args.timeout if args.timeout and args.timeout > 0 else None,
        queue_per_worker=args.queue if args.queue else None,
        seeds=seeds,
        **knob_values(args, Protocol),
    )


def run_protocol(args: argparse.Namespace, policies: str, command: str) -> int:
    """Run the grid of (G, ρ, seed) cells and print one table per (G, ρ)."""
    console = Console() if Console().is_terminal else Console(width=200)
    err = Console(stderr=True)
    try:
        if args.rate_scale is not None or args.prefill:
            raise ValueError(
                "the steady-state protocol sets the rate by --load/--loads and has no prefill stage"
            )
        if getattr(args, "limit", None):
            raise ValueError("the steady-state protocol sizes runs itself: use --max-requests, not --limit")
        proto = protocol_from(args)
        lanes = [x.strip() for x in policies.split(",") if x.strip()]
        one = args.workers if args.workers is not None else 8  # replay's -G (None: the default)
        workers = args.workers if isinstance(args.workers, list) else [one]
        loads = getattr(args, "loads", None) or [args.load if args.load is not None else 1.05]
        base = Cell(
            workload=args.trace,
            workers=workers[0],
            load=loads[0],
            seed=0,
            lanes=tuple(lanes),
            slots=args.slots,
            step=step_model(args),
            br=br_params(args),
            protocol=proto,
            trace_limits=trace_limits(args),
        )
        cells = cells_for([args.trace], workers, loads, lanes, base)
        done = [0]

        def on_done(r: dict[str, Any]) -> None:
            done[0] += 1
            err.print(
                f"  [{done[0]}/{len(cells)}] G={r['workers']} ρ={r['load']:g} seed={r['seed']} "
                f"({r['requests']} requests)",
                highlight=False,
            )

        ray_address = getattr(args, "ray", None)
        if ray_address is not None:
            runner = f"ray ({ray_address or 'default address'})"
            runs = run_cells_ray(
                cells,
                ray_address or None,
                on_done,
                on_connect=lambda msg: err.print(f"  {msg}", highlight=False),
            )
        else:
            runner = f"local ({max(1, args.jobs)} process{'es' if args.jobs > 1 else ''})"
            runs = run_cells(cells, max(1, args.jobs), on_done)
    except (TraceError, ValueError, RayUnavailable) as exc:
        print(f"shadow {command}: {exc}", file=sys.stderr)
        return 2
    summary = summarise(runs)
    console.print(f"[bold]protocol[/]: {proto.describe()}")
    step = step_model(args)
    if not step.linear:  # the cost model: say what it is and what BalanceRoute balances
        balanced = RouteCost.of(step).describe()
        console.print(f"[bold]step model[/]: {step.describe()}; BalanceRoute balances {balanced}")
    for cell in summary:
        console.print(cell_table(cell))
    if args.json:
        doc = {
            "command": "shadow " + " ".join(sys.argv[1:]),
            "commit": source_commit(),
            "runner": runner,
            "protocol": proto.__dict__ | {"seeds": list(proto.seeds)},
            "step": {"a": args.step_a, "b": args.step_b, "c": args.step_c, "p": args.step_p},
            "slots": args.slots,
            "summary": summary,
            "runs": sorted(runs, key=lambda r: (r["workers"], r["load"], r["seed"])),
        }
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        err.print(f"wrote {args.json}")
    return 0


def source_commit() -> str | None:
    """The git commit of the shadow source that ran ("+dirty": its code has local edits), if a checkout."""
    here = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cell_table(cell: dict[str, Any]) -> Table:
    """One (workload, G, ρ) cell: every lane's figures as mean ± 95 % CI over seeds, and its paired
    ratios and changes against the best baseline as the geometric mean over seeds (95 % CI)."""
    title = (
        f"{cell['workload']}  G={cell['workers']}  ρ={cell['load']:g}  seeds={len(cell['seeds'])}  "
        f"window {cell['window_s']:.0f} s ({cell['window_s'] / cell['lifetime_s']:.1f} lifetimes), "
        f"{cell['requests']:,} requests/run; best baseline by spread: {cell['best_baseline_spread']}"
    )
    t = Table(title=title, title_justify="left")
    for col in (
        "lane",
        "spread/step (tok)",
        "× best (steps)",
        "× best (seconds)",
        "throughput vs best %",
        "TPOT P95 vs best %",
        "shed %",
        "decision P99 ms",
    ):
        t.add_column(col, justify="left" if col == "lane" else "right")
    for label, row in cell["lanes"].items():
        t.add_row(
            label,
            interval_text(row["spread_steps"], ",.0f"),
            interval_text(row.get("spread_x", NO_INTERVAL), ".2f"),
            interval_text(row.get("spread_seconds_x", NO_INTERVAL), ".2f"),
            interval_text(row.get("throughput_pct", NO_INTERVAL), "+.1f"),
            interval_text(row.get("tpot_p95_pct", NO_INTERVAL), "+.1f"),
            interval_text((100 * row["shed_fraction"][0], 100 * row["shed_fraction"][1]), ".1f"),
            interval_text(row["decision_p99_ms"], ".2f"),
        )
    return t
