"""The `shadow` CLI's parsers as tests read them: one sub-command's parser, one of its actions by
destination, and how a knob's default is shown in its help (as `shadow.base.knobs.argument` shows
it)."""

from __future__ import annotations

import argparse

from shadow.cli import build_parser


def subparser(command: str) -> argparse.ArgumentParser:
    """`shadow COMMAND`'s own parser."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices[command]
            return parser
    raise AssertionError("no sub-commands")


def action(command: str, dest: str) -> argparse.Action:
    """The action of `shadow COMMAND` that fills `dest`."""
    return next(a for a in subparser(command)._actions if a.dest == dest)


def shown(default: object) -> object:
    """A default as a help text's "(default X)" shows it."""
    return "none" if default is None else format(default, "g") if isinstance(default, float) else default
