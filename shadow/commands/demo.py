"""`shadow demo`: the main job on the embedded default.

Default: a replay of the synthetic paper-like workload through every policy (no network, no
accelerator). `--live`: the whole loop on loopback — simulated fleet, taps, a real vllm-router,
the openai client — then the recorded session replayed with the router's decisions as a lane.
"""

from __future__ import annotations

import argparse

from shadow.commands import replay


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="run shadow on the embedded default (synthetic paper-like workload, G=8, near saturation)",
        description="Replay 4,000 requests of the synthetic paper-azure workload at ρ=1.1 through every "
        "policy and print the comparison. Needs no accelerator and no network.",
    )
    p.add_argument("--requests", type=int, default=None, help="requests (default 4000; 240 with --live)")
    p.add_argument(
        "--live",
        action="store_true",
        help="run the live loop instead: simulated fleet + taps + vllm-router (needs the vllm-router "
        "package) + openai client, about 30 s",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.live:
        return _live(args)
    args.requests = args.requests or 4000
    argv = ["paper-azure", "--load", "1.1", "--limit", str(args.requests)]
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    replay.register(sub)
    return replay.run(parser.parse_args(["replay", *argv]))


def _live(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    from shadow.livedemo import LiveDemoOptions, run_live_demo

    opts = LiveDemoOptions(requests=args.requests or LiveDemoOptions.requests)
    console = Console() if Console().is_terminal else Console(width=170)
    try:
        return run_live_demo(opts, console, Console(stderr=True))
    except RuntimeError as exc:
        print(f"shadow demo --live: {exc}", file=sys.stderr)
        return 2
