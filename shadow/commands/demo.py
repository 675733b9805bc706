"""`shadow demo`: the main job on the embedded default — for now, a replay of the paper-like workload."""

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
    p.add_argument("--requests", type=int, default=4000, help="requests to replay (default 4000)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    argv = ["paper-azure", "--load", "1.1", "--limit", str(args.requests)]
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    replay.register(sub)
    return replay.run(parser.parse_args(["replay", *argv]))
