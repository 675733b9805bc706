"""`shadow sweep`: BR's gain over the best baseline across G, load ρ and (β, γ)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shadow.commands._help import add_command
from shadow.commands._replay_args import (
    add_br_args,
    add_fleet_args,
    add_workload_args,
    setup_from,
    trace_limits,
)
from shadow.commands.sweep_protocol import add_protocol_args
from shadow.replay.render import pct
from shadow.replay.sweep import SweepRow, run_sweep
from shadow.traces import TraceError, resolve

SUMMARY = "BR-0/BR-H gain over the best baseline across G, load and (β, γ)"
DESCRIPTION = (
    "Replay a workload over a grid and print, per cell, each BR lane's spread reduction and "
    "throughput gain against the best baseline of that cell."
)
EPILOG = """examples:
  shadow sweep paper-azure --workers 8 --loads 1.05                    # steady-state protocol, 3 seeds
  shadow sweep paper-azure --workers 4,8,16,32,64 --loads 0.6,0.8,0.95,1.05,1.2 --jobs 2 --json out.json
  shadow sweep trace.csv --policies jsq-bytes,br0,bra,bra{pick},bra{window} --seeds 0,1,2,3,4
  shadow sweep paper-azure --whole-run --betas 8,16,43 --gammas 0.8,0.86,0.95 --policies jsq,brh:oracle
  shadow sweep paper-azure --workers 8,16,32,64 --ray ray-head:6379    # cells as tasks on a Ray cluster
  shadow sweep trace.csv --workers 4,8 --ray                           # RAY_ADDRESS, `ray start`, or local

Ray (optional extra: pip install 'shadow[ray]'): --ray [ADDRESS] runs every (workload, G, rho, seed)
cell as a Ray task (1 CPU each) instead of --jobs local processes, with the same figures (only
decision times, which are wall-clock, differ) and the same JSON. ADDRESS is Ray's: HOST:PORT of a
cluster's head (`ray start --head`), ray://HOST:PORT (Ray Client), auto, or local (a new instance
here); without ADDRESS, Ray looks at RAY_ADDRESS, then a cluster `ray start` left on this machine,
else starts a local instance with all cores. Every node needs shadow installed and the trace file
at the same absolute path. A cluster with token authentication (Ray's default for clusters that
ray.init starts) needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token) when ADDRESS
is given. Put --ray after the workload (or write --ray=ADDRESS).

Protocol (default): open-loop arrivals at RHO x estimated balanced capacity; a bounded queue:
an arrival is rejected (shed, counted) while --queue N x G requests wait (BR's pool, or the
baselines' per-worker queues summed), so every policy serves the same request mix; --timeout S
instead sheds requests that waited S seconds (this penalises policies that reorder). The first
--warmup lifetimes (lifetime = mean output x balanced saturated step time) are discarded, the
window is the next --window lifetimes up to the last arrival, the drain is discarded; spread is
averaged per step (step units) and weighted by step time (seconds); ratios to the best baseline
are paired per seed and given with a 95% t-interval over seeds.
--whole-run keeps the old whole-run figures (unbounded queues: they depend on run length).
bra is this project's BalanceRoute-adaptive; bra{pick}, bra{pick+hold}, bra{window}, bra{} are
its ablations (bra{} = BR-H's decisions); bra{v1} is the first BRA (hold bounded by time only),
bra{pick+hold0|hold/life|hold/pool} the hold's bounds one at a time, bra{stay}/bra{pick+stay} the
"stay" thin-pool basis (shadow.replay.protocol.ABLATIONS lists them all).
"""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = add_command(sub, "sweep", SUMMARY, DESCRIPTION, EPILOG, run)
    add_workload_args(p)
    add_fleet_args(p, workers=False)
    p.add_argument(
        "--workers", type=_ints, default=[4, 8, 16], help="comma-separated G values (default 4,8,16)"
    )
    p.add_argument("--loads", type=_floats, help="comma-separated ρ values (overrides --load)")
    p.add_argument("--betas", type=_floats, help="comma-separated β values (default: --beta)")
    p.add_argument("--gammas", type=_floats, help="comma-separated γ values (default: --gamma)")
    p.add_argument(
        "--policies",
        help=f"lanes: baselines, BR variants, bra and its ablations (default {PROTOCOL_POLICIES}; "
        f"with --whole-run {WHOLE_RUN_POLICIES})",
    )
    add_br_args(p)
    p.add_argument("--json", metavar="OUT", help="write every cell (and every seed's run) as JSON")
    add_protocol_args(p, default=True)
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the cells as Ray tasks (see below); --jobs is then unused (default: local processes)",
    )


PROTOCOL_POLICIES = "rr,p2c,jsq,jsq-bytes,least-tokens,br0,brh:survival,bra"
WHOLE_RUN_POLICIES = "rr,p2c,jsq,jsq-bytes,least-tokens,br0,brh:survival,brh:oracle"


def run(args: argparse.Namespace) -> int:
    if not args.whole_run:
        from shadow.commands.sweep_protocol import run_protocol

        return run_protocol(args, args.policies or PROTOCOL_POLICIES, "sweep")
    if args.ray is not None:
        print("shadow sweep: --ray runs the steady-state protocol's cells; drop --whole-run", file=sys.stderr)
        return 2
    console = Console() if Console().is_terminal else Console(width=170)
    err = Console(stderr=True)
    try:
        base = setup_from(args, args.policies or WHOLE_RUN_POLICIES, workers=args.workers[0])
        trace = resolve(args.trace, seed=args.seed, limit=args.limit, limits=trace_limits(args))
        loads = args.loads or [args.load]
        rows = run_sweep(
            trace,
            base,
            args.workers,
            loads,
            args.betas or [base.br.beta],
            args.gammas or [base.br.gamma],
            on_cell=lambda cell: err.print(f"  running {cell}", highlight=False),
        )
    except (TraceError, ValueError) as exc:
        print(f"shadow sweep: {exc}", file=sys.stderr)
        return 2
    tag = " [bold yellow](SYNTHETIC workload)[/]" if trace.synthetic and "synthetic" not in trace.name else ""
    console.print(f"[bold]{trace.name}[/]{tag}: gain of each BR lane over the best baseline per cell")
    table = Table()
    for col in ("G", "ρ", "β", "γ", "lane", "best baseline (spread)", "spread ×", "throughput %", "vs"):
        table.add_column(col, justify="left" if col in ("lane", "best baseline (spread)", "vs") else "right")
    for r in rows:
        table.add_row(
            str(r.workers),
            "trace" if r.load is None else f"{r.load:g}",
            f"{r.beta:g}",
            f"{r.gamma:g}",
            r.lane,
            f"{r.best_baseline} ({r.baseline_spread:,.0f})",
            f"{r.spread_reduction_x:.2f}",
            pct(r.throughput_gain_pct).rstrip("%"),
            r.best_throughput_baseline,
        )
    console.print(table)
    console.print(_winners(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
        err.print(f"wrote {args.json}")
    return 0


def _winners(rows: list[SweepRow]) -> Table:
    """Average spread of every lane per (G, ρ) cell (first β, γ), the lowest in bold: who wins where."""
    cells: dict[tuple[int, float | None], dict[str, float]] = {}
    for r in rows:
        cell = cells.setdefault((r.workers, r.load), {})
        for lane, spread in r.by_policy_spread.items():
            cell.setdefault(lane, spread)
    lanes = list(dict.fromkeys(k for spreads in cells.values() for k in spreads))
    table = Table(title="average max−min spread (tokens) per policy; lowest in bold")
    table.add_column("G", justify="right")
    table.add_column("ρ", justify="right")
    for lane in lanes:
        table.add_column(lane, justify="right")
    for (g, rho), spreads in cells.items():
        best = min(spreads.values())
        table.add_row(
            str(g),
            "trace" if rho is None else f"{rho:g}",
            *(
                ("[bold]" if spreads.get(lane) == best else "") + f"{spreads[lane]:,.0f}"
                if lane in spreads
                else "–"
                for lane in lanes
            ),
        )
    return table
