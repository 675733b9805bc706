"""The fleet as a policy sees it at one decision: one frozen snapshot for every caller.

Index = worker registration order. The sequences are read-only to policies; a caller may pass its
own live lists when the snapshot does not outlive the decision it was taken for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar, cast

from shadow.core.cost import TOKENS, RouteCost
from shadow.core.fscore import NO_PROJECTION, Projection
from shadow.core.stay import StayBasis

T = TypeVar("T")

_NO_EXTRAS: Mapping[str, object] = MappingProxyType({})



class Extra(Generic[T]):
    """A typed key of the snapshot's extras map (what one caller knows beyond the common fields)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Extra({self.name!r})"


#: Each worker's KV cache in tokens (what an engine's KV usage is a fraction of), where known.
KV_CAPACITY: Extra[Sequence[float]] = Extra("kv_capacity")

#: BRA's predicted thin-pool basis of a kind ("life", "stay", ...), None when there is none.
STAY_BASIS: Extra[Callable[[str], StayBasis | None]] = Extra("stay_basis")


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Per worker: `loads` (KV tokens of running requests) and `free_slots`; where the caller knows
    them, `outstanding` requests sent and not finished, their forwarded prompt tokens
    (`outstanding_tokens`), prompt tokens queued at the worker (`queued_tokens`) and prompt tokens
    of running requests (`prompt_loads`), and the request-body bytes of the requests sent and not
    finished (`outstanding_bytes`: the vllm-ascend proxy's decode score); `projection`, computed on
    demand, is BR-H's view of the active requests; `extras` holds caller-specific attributes
    under `Extra` keys.

    `cost` is what a running sequence costs the fleet's step, in the units BalanceRoute's policies
    balance (`shadow.core.cost`; the paper's KV tokens by default): the caller that knows the
    fleet's step model says it here, so the policies follow it when it is refitted. A cost with a
    per-sequence term needs the `running` sequences per worker (requests counted in `loads`;
    `outstanding` stands in for them when not given)."""

    loads: Sequence[float]
    free_slots: Sequence[int]
    outstanding: Sequence[int] | None = None
    outstanding_tokens: Sequence[float] | None = None
    queued_tokens: Sequence[float] | None = None
    prompt_loads: Sequence[float] | None = None
    projection: Callable[[], Projection] | None = None
    extras: Mapping[str, object] = field(default_factory=lambda: _NO_EXTRAS)
    running: Sequence[int] | None = None
    cost: RouteCost = TOKENS
    outstanding_bytes: Sequence[float] | None = None

    @property
    def workers(self) -> int:
        return len(self.loads)

    def active(self) -> Projection:
        """The projection's arrays; empty (loads held constant over the horizon) without one."""
        return NO_PROJECTION if self.projection is None else self.projection()

    def seqs(self) -> Sequence[int] | None:
        """Running sequences per worker: `running`, else `outstanding`, else None (unknown)."""
        return self.running if self.running is not None else self.outstanding

    def extra(self, key: Extra[T]) -> T | None:
        """The extra under `key`, or None when the caller gave none."""
        return cast("T | None", self.extras.get(key.name))
