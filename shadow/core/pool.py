"""The prompt pool: prefill-completed requests waiting for a decode worker.

Ordered by prompt length descending (ties: older first), with aging: entries older than
`age_s` are promoted to the front of the Stage-2 window in arrival order. Length-sorted keys
let the best single request for a concave score be found by binary search.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from shadow.core.cost import TOKENS, RouteCost


@dataclass(slots=True)
class PoolEntry:
    """One waiting request. `seq` is its arrival rank (smaller = older, unique per pool)."""

    request_id: Hashable
    prompt_tokens: int
    seq: int
    arrived_at: float = 0.0
    # BR-H: predicted steps this request stays within the horizon once admitted (None = whole horizon).
    horizon_steps: float | None = None


Score = Callable[[float], float]


class Pool:
    """Waiting requests, sorted by (−prompt_tokens, seq)."""

    __slots__ = ("_by_seq", "_keys", "_next_seq")

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._by_seq: dict[int, PoolEntry] = {}
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __iter__(self) -> Iterator[PoolEntry]:
        """Entries in pool order (longest prompt first, ties older first)."""
        for _, seq in self._keys:
            yield self._by_seq[seq]

    def add(
        self,
        request_id: Hashable,
        prompt_tokens: int,
        arrived_at: float = 0.0,
        horizon_steps: float | None = None,
    ) -> PoolEntry:
        """Insert a request (arrival order = call order); returns its entry."""
        entry = PoolEntry(request_id, int(prompt_tokens), self._next_seq, arrived_at, horizon_steps)
        self._next_seq += 1
        bisect.insort(self._keys, (-entry.prompt_tokens, entry.seq))
        self._by_seq[entry.seq] = entry
        return entry

    def remove(self, entry: PoolEntry) -> None:
        """Take an entry out of the pool (KeyError if it is not there)."""
        key = (-entry.prompt_tokens, entry.seq)
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            raise KeyError(entry.request_id)
        del self._keys[i]
        del self._by_seq[entry.seq]

    def window(self, size: int, now: float, age_s: float | None) -> list[PoolEntry]:
        """The first `size` entries: aged ones (arrival order) first, then by pool order."""
        out: list[PoolEntry] = []
        taken: set[int] = set()
        if age_s is not None:
            # _by_seq is insertion-ordered, i.e. arrival-ordered: stop at the first young entry.
            for seq, entry in self._by_seq.items():
                if len(out) == size or now - entry.arrived_at < age_s:
                    break
                out.append(entry)
                taken.add(seq)
        if not out and size >= 0:  # nothing aged: the first `size` in pool order
            return [self._by_seq[seq] for _, seq in self._keys[:size]]
        for _, seq in self._keys:
            if len(out) == size:
                break
            if seq not in taken:
                out.append(self._by_seq[seq])
        return out

    def nearest(self, length: float, size: int) -> list[PoolEntry]:
        """Up to `size` entries whose prompt lengths are nearest `length` (ties: the shorter); a
        negative `length` (a peak below one request's per-sequence weight) is nearest the shortest."""
        keys = self._keys
        target = _floor(length) if length > 0 else (0 if length == 0 else -1)
        hi = bisect.bisect_left(keys, (-target, -1))  # keys[hi:] have prompt <= target
        lo = hi - 1  # keys[:hi] have prompt > target, nearest at lo
        out: list[PoolEntry] = []
        n, by_seq = len(keys), self._by_seq
        for _ in range(min(size, n)):
            below = length + keys[hi][0] if hi < n else math.inf
            above = -keys[lo][0] - length if lo >= 0 else math.inf
            if hi < n and below <= above:
                out.append(by_seq[keys[hi][1]])
                hi += 1
            else:
                out.append(by_seq[keys[lo][1]])
                lo -= 1
        return out

    def pop_arrived_before(self, t: float) -> list[PoolEntry]:
        """Remove and return entries that arrived before `t` (entries are added in arrival order)."""
        out: list[PoolEntry] = []
        for entry in self._by_seq.values():
            if entry.arrived_at >= t:
                break
            out.append(entry)
        for entry in out:
            self.remove(entry)
        return out

    def best_single(self, score: Score, peak: float, cost: RouteCost = TOKENS) -> PoolEntry | None:
        """Highest-scoring entry for a concave `score` of an entry's weight under `cost` (its prompt
        tokens under the paper's) with maximiser `peak` (ties: older).

        By concavity the best is the largest entry weighing <= peak or the smallest weighing more
        (in sequence units every entry weighs one: the longest when one fits, else the shortest).
        """
        keys = self._keys
        if not keys:
            return None
        if not cost.paper:
            peak = cost.tokens_at(peak)
            score = _priced(score, cost)
        candidates: list[PoolEntry] = []
        # Largest prompt <= peak: first key with -s >= -peak (oldest among equal lengths).
        lo = bisect.bisect_left(keys, (-_floor(peak), -1))
        if lo < len(keys):
            candidates.append(self._by_seq[keys[lo][1]])
        if lo > 0:
            length = -keys[lo - 1][0]
            j = bisect.bisect_left(keys, (-length, -1))
            candidates.append(self._by_seq[keys[j][1]])
        return best_of(candidates, score)


def _priced(score: Score, cost: RouteCost) -> Score:
    """`score` of an entry's weight under `cost`, taking its prompt tokens."""

    def priced(tokens: float) -> float:
        return score(cost.weight(tokens))

    return priced


def best_of(entries: list[PoolEntry], score: Score, cost: RouteCost = TOKENS) -> PoolEntry | None:
    """Highest score of an entry's weight under `cost` among `entries`; equal scores go to the older."""
    if not cost.paper:
        score = _priced(score, cost)
    best: PoolEntry | None = None
    best_score = 0.0
    for entry in entries:
        value = score(entry.prompt_tokens)
        if best is None or value > best_score or (value == best_score and entry.seq < best.seq):
            best, best_score = entry, value
    return best


def _floor(x: float) -> int:
    if math.isinf(x):
        return 1 << 62 if x > 0 else -(1 << 62)
    return int(x // 1)
