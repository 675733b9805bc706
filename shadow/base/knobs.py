"""Settings declared once: a config dataclass's field is where a setting's name, type, default,
help, bounds and flag are written, and everything else is derived from it.

    transfer_cap: int = knob(8, "--transfer-cap", "KV transfers in flight per decode worker", AT_LEAST_ONE)

gives the command its flag (`add_knobs`, `argument`: type from the default, "(default 8)" appended to the
help), and through the command's layered options (`shadow.commands._layered`) its YAML key
`transfer_cap` and its environment variable (`SHADOW_SERVE_TRANSFER_CAP`); the start-up check that
names the flag and where its value came from (`knob_rules`), and the dataclass's own check
(`check_knobs`, one line naming the flag). Pure: no I/O.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

KNOB = "shadow.knob"  # the dataclass field metadata key


@dataclass(frozen=True)
class Bound:
    """What a numeric setting must be: `ok(value)`, said as `asks` ("> 0 s")."""

    ok: Callable[[float], bool]
    asks: str


POSITIVE = Bound(lambda v: math.isfinite(v) and v > 0, "> 0")
POSITIVE_S = Bound(lambda v: math.isfinite(v) and v > 0, "> 0 s")
NON_NEGATIVE = Bound(lambda v: math.isfinite(v) and v >= 0, ">= 0")
NON_NEGATIVE_S = Bound(lambda v: math.isfinite(v) and v >= 0, ">= 0 s")
AT_LEAST_ONE = Bound(lambda v: v >= 1, ">= 1")
OPEN_FRACTION = Bound(lambda v: math.isfinite(v) and 0 < v <= 1, "a fraction in (0, 1]")
FRACTION = Bound(lambda v: math.isfinite(v) and 0 <= v <= 1, "a fraction in [0, 1]")
OPEN_UNIT = Bound(lambda v: math.isfinite(v) and 0 < v < 1, "in (0, 1)")
OVER_ONE = Bound(lambda v: math.isfinite(v) and v > 1, "> 1")
AT_LEAST_TWO = Bound(lambda v: v >= 2, ">= 2")
PORT = Bound(lambda v: 0 <= v <= 65535, "a port in 0..65535 (0 = a free one)")
NICENESS = Bound(lambda v: 0 <= v <= 19, "in 0..19")


@dataclass(frozen=True)
class Knob:
    """A setting's flag, help (without its default: derived), bound and `add_argument` extras
    (`metavar`, `action`, a `type` other than the default's). `unset_is_none`: the flag parses to
    None when not given (the command picks the value, e.g. by another flag); its help still shows
    the field's default."""

    flag: str
    help: str
    bound: Bound | None
    kw: Mapping[str, Any]
    unset_is_none: bool = False

    @property
    def dest(self) -> str:
        """The option's name in a parsed namespace (and the YAML key, the env variable's tail)."""
        return self.flag.lstrip("-").replace("-", "_")


def knob(
    default: Any, flag: str, help: str, bound: Bound | None = None, *, unset_is_none: bool = False, **kw: Any
) -> Any:
    """A dataclass field with `default` that is the setting `flag` (see module docstring)."""
    return dataclasses.field(default=default, metadata={KNOB: Knob(flag, help, bound, kw, unset_is_none)})


def knobs(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Knob]]:
    """The fields of dataclass `cls` that are settings, in declaration order, with their knob."""
    for f in dataclasses.fields(cls):
        k = f.metadata.get(KNOB)
        if isinstance(k, Knob):
            yield f, k


def argument(f: dataclasses.Field[Any], k: Knob) -> dict[str, Any]:
    """`add_argument`'s keywords for setting `k` of field `f`: a boolean is a switch (off by
    default); anything else takes the default's type (a None default: `k.kw`'s), the default,
    and its help ends with "(default X)" (None: "(default: none)"); `k.unset_is_none`: the flag's
    own default is None."""
    default = f.default
    if isinstance(default, bool):
        return {"action": "store_true", "help": k.help, **k.kw}
    shown = "none" if default is None else format(default, "g") if isinstance(default, float) else default
    typed = {} if default is None or "choices" in k.kw else {"type": type(default)}
    given = None if k.unset_is_none else default
    return {**typed, "default": given, "help": f"{k.help} (default {shown})", **k.kw}


def add_knobs(group: argparse._ActionsContainer, cls: type) -> None:
    """Declare the flag of every setting of dataclass `cls` on a parser or an argument group."""
    for f, k in knobs(cls):
        group.add_argument(k.flag, dest=k.dest, **argument(f, k))


def knob_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{field name: parsed value} of every setting of dataclass `cls` (its keyword arguments)."""
    return {f.name: getattr(args, k.dest) for f, k in knobs(cls)}


def knob_rules(cls: type) -> tuple[tuple[str, Bound], ...]:
    """(option dest, bound) of every bounded setting of `cls`, for a command's start-up check of
    values from flags, files and the environment."""
    return tuple((k.dest, k.bound) for _, k in knobs(cls) if k.bound is not None)


def check_knobs(obj: Any) -> None:
    """ValueError of one line naming the flag of the first setting of dataclass `obj` out of its
    bound or its choices."""
    for f, k in knobs(type(obj)):
        v = getattr(obj, f.name)
        choices = k.kw.get("choices")
        if choices is not None and v not in choices:
            raise ValueError(f"{k.flag} must be one of {', '.join(map(str, choices))}, got {v!r}")
        if k.bound is not None and v is not None and not isinstance(v, bool) and not k.bound.ok(float(v)):
            raise ValueError(f"{k.flag} must be {k.bound.asks}, got {v}")


def knob_argv(obj: Any) -> list[str]:
    """The command line that gives every setting of dataclass `obj` its value (a switch only when on)."""
    argv: list[str] = []
    for f, k in knobs(type(obj)):
        v = getattr(obj, f.name)
        if isinstance(v, bool):
            argv += [k.flag] if v else []
        elif v is not None:
            argv += [k.flag, str(v)]
    return argv
