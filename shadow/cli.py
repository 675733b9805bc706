"""The `shadow` command line: one sub-command per module under `shadow.commands`.

Each command module exposes `register(subparsers) -> None`, which adds its parser and sets
`func=<callable(args) -> int>` as the parser default. The CLI itself holds no logic.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shadow import __version__
from shadow.commands._help import ShadowArgumentParser

# One module per sub-command, in the order `--help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "shadow.commands.demo",
    "shadow.commands.replay",
    "shadow.commands.sweep",
    "shadow.commands.load",
    "shadow.commands.tap",
    "shadow.commands.serve",
    "shadow.commands.capture",
    "shadow.commands.fleet",
    "shadow.commands.router",
    "shadow.commands.dashboards",
)


def build_parser() -> argparse.ArgumentParser:
    parser = ShadowArgumentParser(
        prog="shadow",
        description=(
            "Run BalanceRoute (BR-0/BR-H) and baseline routers counterfactually beside an "
            "existing LLM router, offline on traces or live on mirrored traffic."
        ),
    )
    parser.add_argument("--version", action="version", version=f"shadow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ShadowArgumentParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
