"""The shape of a trace as its readers need it (any object with these fields will do;
`shadow.traces.Trace` and its `TraceRequest` are one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TraceRequestLike(Protocol):
    """One trace request: when it arrives, its prompt and output sizes, and its prompt key."""

    @property
    def arrival_s(self) -> float: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def output_tokens(self) -> int: ...

    @property
    def prompt_key(self) -> str | None: ...


class TraceLike(Protocol):
    """A trace: a name and a sequence of requests."""

    @property
    def name(self) -> str: ...

    @property
    def requests(self) -> Sequence[TraceRequestLike]: ...
