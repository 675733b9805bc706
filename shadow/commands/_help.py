"""One help style for every sub-command: descriptions and epilogs keep their line breaks (examples),
and every option with a default shows it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to options whose help does not already state a default.

    Skipped: positionals, flags (default False/None) and suppressed defaults.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
            and default != []
            and "default" not in text.lower()
            and not isinstance(action, argparse._VersionAction | argparse._HelpAction)
        ):
            shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else "%(default)s"
            text = f"{text} (default: {shown})" if text else f"(default: {shown})"
        return text


class ShadowArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose help uses `HelpFormatter` unless a command asks for another."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fmt = kwargs.get("formatter_class")
        if fmt is None or fmt in (argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)


def add_command(
    sub: Any,
    name: str,
    summary: str,
    description: str | None,
    epilog: str,
    run: Callable[[argparse.Namespace], int] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    """The parser of sub-command `name`: `summary` in `shadow --help`; its own help shows
    `description` and `epilog` (examples) with their line breaks; `run` runs it, `add_arguments`
    declares its options."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if add_arguments is not None:
        add_arguments(parser)
    if run is not None:
        parser.set_defaults(func=run)
    return parser


def run_alone(
    prog: str,
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """A command run on its own (`python -m shadow.commands.X`): its options parsed from `argv`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return run(parser.parse_args(argv))
