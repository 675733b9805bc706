"""YAML an operator hands to shadow (`--config`, the mode flag file), read as plain data only.

`load_yaml(raw, where, name)` parses bytes with PyYAML's safe loader and refuses what lets a small
file cost far more than its size: aliases and anchors (a few hundred bytes of nested aliases stand
for gigabytes once anything walks, prints or joins the value) and nesting deeper than `MAX_DEPTH`
(the composer recurses once per level). The caller caps the bytes it reads. Every problem is one
ValueError line naming `where` and, when known, the line ("config x.yaml: line 3: aliases are not
allowed in --config"); nothing else escapes (over-long integers, impossible dates, ... included).
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 32  # nested collections: a shadow config is a flat mapping, a value at most a list of lists


class _Refused(Exception):
    """A construct the loader does not take, at `line` (1-based)."""

    def __init__(self, what: str, line: int) -> None:
        super().__init__(what)
        self.what = what
        self.line = line


class _PlainLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader without aliases or anchors, nesting at most MAX_DEPTH collections deep."""

    def __init__(self, stream: str, name: str) -> None:
        super().__init__(stream)
        self.name = name
        self.depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(f"aliases are not allowed in {self.name} (write the value out)", line)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused(f"nested too deep (more than {MAX_DEPTH} levels, the limit)", line)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def load_yaml(raw: bytes, where: str, name: str) -> Any:
    """The data of the YAML document `raw` (None when empty); a one-line ValueError "`where`: line N:
    ..." otherwise. `name` says what the file is to the user (e.g. "--config")."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    loader: _PlainLoader | None = None
    try:
        loader = _PlainLoader(text, name)  # reads `text` through: a bad character fails here
        return loader.get_single_data()
    except _Refused as exc:
        raise ValueError(f"{where}: line {exc.line}: {exc.what}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" line {mark.line + 1}:" if mark is not None else ""
        raise ValueError(f"{where}:{at} invalid YAML ({_one_line(exc.problem or exc.context)})") from None
    except Exception as exc:
        # PyYAML's constructors also raise ValueError (a 5000-digit integer, 2001-13-45),
        # AttributeError (`!!timestamp ''`), TypeError...: bad input all the same
        raise ValueError(f"{where}: invalid YAML ({type(exc).__name__}: {_one_line(str(exc))})") from None
    finally:
        if loader is not None:
            loader.dispose()


def _one_line(text: str | None, width: int = 120) -> str:
    flat = " ".join((text or "unreadable").split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."
