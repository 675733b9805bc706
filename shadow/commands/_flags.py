"""Options declared once: the flag, the config field it fills, and `add_argument`'s keywords."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """`--flag` filling the config field `fills` (None: the command reads it itself); `kw` goes to
    `add_argument` as given."""

    flag: str
    fills: str | None
    help: str
    kw: dict[str, Any]

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def flag(name: str, fills: str | None, help: str, **kw: Any) -> Flag:
    return Flag(name, fills, help, kw)


def add_flags(group: argparse._ActionsContainer, flags: Iterable[Flag]) -> None:
    """Declare `flags` on a parser or an argument group, in their order."""
    for f in flags:
        group.add_argument(f.flag, help=f.help, **f.kw)


def fields(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[str, Any]:
    """{config field: parsed value} of the flags that fill one."""
    return {f.fills: getattr(args, f.dest) for f in flags if f.fills is not None}
