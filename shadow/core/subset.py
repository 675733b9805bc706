"""Best subset of a window of waiting requests for one worker, by an F-score of their sum.

F depends on a subset only through Δ = Σ s_i, and is concave in Δ with maximiser `peak`, so
the optimum over reachable sums is the largest reachable Δ ≤ peak or the smallest ≥ peak.
`exhaustive` enumerates subsets (small windows; ties: older requests, then fewer);
`bitset` runs a per-cardinality subset-sum over Python big-int bitsets (windows up to 16).
Both are exact in the optimum value.

Under a `RouteCost` with a per-sequence term a subset of j requests holding x prompt tokens weighs
Δ = cost.weight(x, j) (x + κ·j, or j in sequence units), so the candidates are taken per
cardinality: in layer j the largest reachable x with Δ <= peak and the smallest with Δ >= peak
(in sequence units: the largest x when j sequences fit under the peak, else the smallest); the
best by (score, then the smaller Δ, then fewer members). With the paper's cost this is the rule
above, and the code takes the paper's path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from shadow.core.cost import TOKENS, RouteCost
from shadow.core.pool import PoolEntry

Score = Callable[[float], float]


def _subsets(n: int, cap: int) -> tuple[tuple[int, int, int], ...]:
    """The subsets of n items with 1..cap members as bit masks, ascending, each with the mask
    without its lowest member and that member's index (its sum = that mask's sum + its weight)."""
    masks = (m for m in range(1, 1 << n) if m.bit_count() <= cap)
    return tuple((m, m & (m - 1), (m & -m).bit_length() - 1) for m in masks)


#: `_subsets(n, cap)` for windows up to this size (the default exhaustive_max is 4), built once.
SUBSETS_UP_TO = 8
_SUBSETS = tuple(tuple(_subsets(n, cap) for cap in range(n + 1)) for n in range(SUBSETS_UP_TO + 1))


def exhaustive(
    window: Sequence[PoolEntry], cap: int, score: Score, cost: RouteCost = TOKENS
) -> tuple[list[PoolEntry], float]:
    """Best non-empty subset with at most `cap` members: (subset, F). Subsets are scored in
    ascending mask order; ties go to the older (`_older`)."""
    n = len(window)
    # a subset weighs the sum of its members' weights (Σ s_i + κ·j: linear)
    if cost.paper:
        weights: list[float] = [e.prompt_tokens for e in window]
    else:
        weights = [cost.weight(e.prompt_tokens) for e in window]
    cap = max(0, min(cap, n))
    subsets = _SUBSETS[n][cap] if n <= SUBSETS_UP_TO else _subsets(n, cap)
    sums: list[float] = [0] * (1 << n)
    best_mask, best_f = 0, -math.inf
    for mask, rest, i in subsets:
        total = sums[mask] = sums[rest] + weights[i]
        f = score(total)
        if f > best_f or (f == best_f and _older(window, mask, best_mask)):
            best_mask, best_f = mask, f
    return [e for i, e in enumerate(window) if best_mask >> i & 1], best_f


def _older(window: Sequence[PoolEntry], a: int, b: int) -> bool:
    """Tie-break: the subset whose sorted arrival ranks compare smaller (older, then fewer)."""
    seqs_a = sorted(e.seq for i, e in enumerate(window) if a >> i & 1)
    seqs_b = sorted(e.seq for i, e in enumerate(window) if b >> i & 1)
    return seqs_a < seqs_b


def _bound(sizes: Sequence[int], peak: float, cost: RouteCost) -> int:
    """The largest token sum worth reaching. Sums weighing more than peak + the heaviest member are
    never the lightest reachable weight >= peak (drop one member and it still weighs >= peak), and
    are worse than it by concavity; a member weighs s + κ, so in layer j >= 1 that is a token sum
    above peak + max(s). In sequence units every sum may be the largest of its layer."""
    if math.isinf(peak) or cost.sequences:
        return sum(sizes)
    return min(sum(sizes), max(0, math.ceil(peak)) + max(sizes))


def _best_of_layers(
    candidates: Sequence[tuple[int, int]], score: Score, cost: RouteCost
) -> tuple[int, int, float] | None:
    """The best (token sum, members) by (score, the smaller weight, fewer members), with its score."""
    best: tuple[int, int, float] | None = None
    best_key: tuple[float, float, int] | None = None
    for x, j in candidates:
        w = cost.weight(x, j)
        key = (score(w), -w, -j)
        if best_key is None or key > best_key:
            best, best_key = (x, j, key[0]), key
    return best


def bitset(
    window: Sequence[PoolEntry], cap: int, score: Score, peak: float, cost: RouteCost = TOKENS
) -> tuple[list[PoolEntry], float]:
    """Best non-empty subset with at most `cap` members, by per-cardinality subset-sum bitsets."""
    items = list(window)
    cap = min(cap, len(items))
    if cap <= 0:
        return [], -math.inf
    sizes = [e.prompt_tokens for e in items]
    bound = _bound(sizes, peak, cost)
    limit = bound + 1
    mask = (1 << limit) - 1
    layers = [1] + [0] * cap  # layers[j]: bit x set iff sum x is reachable with exactly j items
    history: list[list[int]] = [layers.copy()]
    for s in sizes:
        for j in range(cap, 0, -1):
            layers[j] |= (layers[j - 1] << s) & mask
        history.append(layers.copy())
    if not cost.paper:
        layered: list[tuple[int, int]] = []
        for j in range(1, cap + 1):
            # layer j's target: peak − κ·j tokens; ±∞ in sequence units (j fit under the peak, or not)
            layered += [(x, j) for x in _bit_candidates(layers[j], cost.tokens_at(peak, j), limit)]
        picked = _best_of_layers(layered, score, cost)
        if picked is None:
            return [], -math.inf
        total, count, f = picked
        return _reconstruct(items, sizes, history, total, count), f
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
    return _reconstruct(items, sizes, history, total, count), f


def _bit_candidates(bits: int, target: float, limit: int) -> list[int]:
    """The largest set bit <= `target` and the smallest >= it, of `bits` below `limit`."""
    out: list[int] = []
    if not bits:
        return out
    if math.isinf(target):
        hi, start = (limit - 1, limit) if target > 0 else (-1, 0)
    else:
        hi, start = min(limit - 1, math.floor(target)), max(0, math.ceil(target))
    if hi >= 0:
        below = bits & ((1 << (hi + 1)) - 1)
        if below:
            out.append(below.bit_length() - 1)
    above = bits >> start if start < limit else 0
    if above:
        out.append(start + (above & -above).bit_length() - 1)
    return out


def _reconstruct(
    items: Sequence[PoolEntry], sizes: Sequence[int], history: Sequence[Sequence[int]], total: int, count: int
) -> list[PoolEntry]:
    """The `count` items summing to `total` that the backward walk over `history` finds: the
    smallest last index, then recursively the same for the rest."""
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
    return chosen


def pairs(
    window: Sequence[PoolEntry], cap: int, score: Score, peak: float, cost: RouteCost = TOKENS
) -> tuple[list[PoolEntry], float]:
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
    bound = _bound(sizes, peak, cost)
    ones = {s for s in sizes if s <= bound}
    twos = {a + b for j, b in enumerate(sizes) for a in sizes[:j] if a + b <= bound} if cap == 2 else set()
    if not cost.paper:
        layered = [
            (x, j)
            for j, sums in ((1, ones), (2, twos))
            for x in _set_candidates(sums, cost.tokens_at(peak, j))
        ]
        picked = _best_of_layers(layered, score, cost)
        if picked is None:
            return [], -math.inf
        total, count, f = picked
        return _members(items, sizes, total, count), f
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
    return _members(items, sizes, total, 1 if total in ones else 2), score(total)


def _set_candidates(sums: set[int], target: float) -> list[int]:
    """The largest of `sums` <= `target` and the smallest >= it."""
    below = [x for x in sums if x <= target]
    above = [x for x in sums if x >= target]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def _members(items: Sequence[PoolEntry], sizes: Sequence[int], total: int, count: int) -> list[PoolEntry]:
    """What bitset's backward walk returns for `count` <= 2 items summing to `total`: one item, the
    first of that size; two, the smallest last index, then the smallest first."""
    if count == 1:
        return [items[sizes.index(total)]]
    for j, b in enumerate(sizes):
        for i in range(j):
            if sizes[i] + b == total:
                return [items[i], items[j]]
    raise AssertionError("unreachable: total is a reachable sum")  # pragma: no cover


def best_subset(
    window: Sequence[PoolEntry],
    cap: int,
    score: Score,
    peak: float,
    exhaustive_max: int,
    cost: RouteCost = TOKENS,
) -> tuple[list[PoolEntry], float]:
    """Exhaustive search for windows up to `exhaustive_max` entries, bitset subset-sum above."""
    if len(window) <= exhaustive_max:
        return exhaustive(window, cap, score, cost)
    return bitset(window, cap, score, peak, cost)
