"""Small traces for the load-generator tests (``shadow.traces`` dataclasses when available)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

try:
    from shadow.traces import Trace, TraceRequest

    HAVE_TRACES = True
except ImportError:  # shadow.traces not committed yet: a stand-in with the same fields
    HAVE_TRACES = False

    @dataclass(frozen=True)
    class TraceRequest:  # type: ignore[no-redef]
        arrival_s: float
        prompt_tokens: int
        output_tokens: int
        prompt_key: str | None = None

    @dataclass(frozen=True)
    class Trace:  # type: ignore[no-redef]
        name: str
        requests: tuple[Any, ...]
        source: str
        synthetic: bool
        notes: str = ""


def make_trace(rows: Sequence[tuple[float, int, int, str | None]], name: str = "test") -> Any:
    """A trace from ``(arrival_s, prompt_tokens, output_tokens, prompt_key)`` rows."""
    reqs = tuple(TraceRequest(float(a), int(p), int(o), k) for a, p, o, k in sorted(rows, key=lambda r: r[0]))
    return Trace(name=name, requests=reqs, source="test", synthetic=True, notes="")
