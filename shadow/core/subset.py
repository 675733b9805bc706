"""Best subset of a window of waiting requests for one worker, by an F-score of their sum.

F depends on a subset only through Δ = Σ s_i, and is concave in Δ with maximiser `peak`, so
the optimum over reachable sums is the largest reachable Δ ≤ peak or the smallest ≥ peak.
`exhaustive` enumerates subsets (small windows; ties: older requests, then fewer);
`bitset` runs a per-cardinality subset-sum over Python big-int bitsets (windows up to 16).
Both are exact in the optimum value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from shadow.core.pool import PoolEntry

Score = Callable[[float], float]


def exhaustive(window: Sequence[PoolEntry], cap: int, score: Score) -> tuple[list[PoolEntry], float]:
    """Best non-empty subset with at most `cap` members: (subset, F)."""
    n = len(window)
    sums = [0] * (1 << n)
    best_mask, best_f = 0, -math.inf
    for mask in range(1, 1 << n):
        low = mask & -mask
        sums[mask] = sums[mask ^ low] + window[low.bit_length() - 1].prompt_tokens
        if mask.bit_count() > cap:
            continue
        f = score(sums[mask])
        if f > best_f or (f == best_f and _older(window, mask, best_mask)):
            best_mask, best_f = mask, f
    return [e for i, e in enumerate(window) if best_mask >> i & 1], best_f


def _older(window: Sequence[PoolEntry], a: int, b: int) -> bool:
    """Tie-break: the subset whose sorted arrival ranks compare smaller (older, then fewer)."""
    seqs_a = sorted(e.seq for i, e in enumerate(window) if a >> i & 1)
    seqs_b = sorted(e.seq for i, e in enumerate(window) if b >> i & 1)
    return seqs_a < seqs_b


def bitset(window: Sequence[PoolEntry], cap: int, score: Score, peak: float) -> tuple[list[PoolEntry], float]:
    """Best non-empty subset with at most `cap` members, by per-cardinality subset-sum bitsets."""
    items = list(window)
    cap = min(cap, len(items))
    if cap <= 0:
        return [], -math.inf
    sizes = [e.prompt_tokens for e in items]
    # Sums above peak + max(s) are never the smallest reachable sum >= peak (drop one member
    # and the sum is still >= peak), and are worse than it by concavity: cap the bit width.
    bound = sum(sizes) if math.isinf(peak) else min(sum(sizes), max(0, math.ceil(peak)) + max(sizes))
    limit = bound + 1
    mask = (1 << limit) - 1
    layers = [1] + [0] * cap  # layers[j]: bit x set iff sum x is reachable with exactly j items
    history: list[list[int]] = [layers.copy()]
    for s in sizes:
        for j in range(cap, 0, -1):
            layers[j] |= (layers[j - 1] << s) & mask
        history.append(layers.copy())
    reach = 0
    for j in range(1, cap + 1):
        reach |= layers[j]
    if reach == 0:
        return [], -math.inf
    candidates: list[int] = []
    hi = limit - 1 if math.isinf(peak) else min(limit - 1, math.floor(peak))
    if hi >= 0:
        below = reach & ((1 << (hi + 1)) - 1)
        if below:
            candidates.append(below.bit_length() - 1)  # largest reachable sum <= peak
    start = max(0, math.ceil(peak)) if not math.isinf(peak) else limit
    above = reach >> start if start < limit else 0
    if above:
        candidates.append(start + (above & -above).bit_length() - 1)  # smallest reachable sum >= peak
    total = max(candidates, key=lambda x: (score(x), -x))
    f = score(total)
    count = next(j for j in range(1, cap + 1) if (layers[j] >> total) & 1)
    chosen: list[PoolEntry] = []
    rest = total
    for t in range(len(items), 0, -1):
        if count == 0:
            break
        before = history[t - 1]
        if (before[count] >> rest) & 1:
            continue  # reachable without item t: leave it out
        chosen.append(items[t - 1])
        rest -= sizes[t - 1]
        count -= 1
    chosen.reverse()
    return chosen, f


def pairs(window: Sequence[PoolEntry], cap: int, score: Score, peak: float) -> tuple[list[PoolEntry], float]:
    """`bitset`'s exact result for caps <= 2, by listing the at most n + n(n−1)/2 sums.

    The same bound on sums, the same two candidates (largest reachable <= peak, smallest >= peak),
    the same tie-break (score, then the smaller sum), the fewest members, and among those the
    subset bitset's backward reconstruction returns (smallest last index, then smallest first).
    """
    if cap > 2:
        raise ValueError(f"pairs handles caps up to 2, got {cap}")
    items = list(window)
    n = len(items)
    cap = min(cap, n)
    if cap <= 0:
        return [], -math.inf
    sizes = [e.prompt_tokens for e in items]
    bound = sum(sizes) if math.isinf(peak) else min(sum(sizes), max(0, math.ceil(peak)) + max(sizes))
    ones = {s for s in sizes if s <= bound}
    twos = {a + b for j, b in enumerate(sizes) for a in sizes[:j] if a + b <= bound} if cap == 2 else set()
    reach = ones | twos
    if not reach:
        return [], -math.inf
    limit = bound + 1
    candidates: list[int] = []
    hi = limit - 1 if math.isinf(peak) else min(limit - 1, math.floor(peak))
    if hi >= 0:
        below = [x for x in reach if x <= hi]
        if below:
            candidates.append(max(below))
    start = max(0, math.ceil(peak)) if not math.isinf(peak) else limit
    above = [x for x in reach if x >= start] if start < limit else []
    if above:
        candidates.append(min(above))
    total = max(candidates, key=lambda x: (score(x), -x))
    f = score(total)
    if total in ones:
        return [items[sizes.index(total)]], f
    for j, b in enumerate(sizes):
        for i in range(j):
            if sizes[i] + b == total:
                return [items[i], items[j]], f
    raise AssertionError("unreachable: total is a reachable sum")  # pragma: no cover


def best_subset(
    window: Sequence[PoolEntry], cap: int, score: Score, peak: float, exhaustive_max: int
) -> tuple[list[PoolEntry], float]:
    """Exhaustive search for windows up to `exhaustive_max` entries, bitset subset-sum above."""
    if len(window) <= exhaustive_max:
        return exhaustive(window, cap, score)
    return bitset(window, cap, score, peak)
