"""Insertion-ordered maps kept as age queues: the oldest entry first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def expire(entries: OrderedDict[K, V], limit: float, stamp: Callable[[V], float]) -> int:
    """Drop the oldest entries while their `stamp` is before `limit` (up to the first that is not);
    returns how many were dropped."""
    n = 0
    while entries and stamp(next(iter(entries.values()))) < limit:
        entries.popitem(last=False)
        n += 1
    return n
