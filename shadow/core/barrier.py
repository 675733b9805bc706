"""Do decode workers share a step barrier? Decided from when their measured steps end.

Workers behind one barrier (the DP ranks of an MoE server) end every step together; independent
servers end theirs whenever their own work is done, so their step ends fall at unrelated times.
Two workers are synchronised when at least `synced` of one's step ends (either way: a step hidden
on one side, as a merged SSE chunk hides one, must not split a barrier) have one of the other's
within `tolerance` × the shorter of their median steps. By chance, independent workers meet that
for about 2·tolerance of the ends (the slower one's against the faster one's steps; far fewer the
other way). Barrier groups are the connected components of synchronised pairs. Pure: the step
ends come in as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

TOLERANCE = 0.25
SYNCED = 0.8
MIN_STEPS = 30


@dataclass(frozen=True, slots=True)
class BarrierChoice:
    """Barrier groups (worker indices) chosen from measured step ends, and why.

    `decided` is False while a worker has fewer than `min_steps` measured steps (`groups` then is
    None); `coincidence[(i, j)]` is the larger of the two one-way fractions for i < j."""

    groups: tuple[tuple[int, ...], ...] | None
    coincidence: dict[tuple[int, int], float]
    unmeasured: tuple[int, ...]
    reason: str

    @property
    def decided(self) -> bool:
        return self.groups is not None

    @property
    def model(self) -> str:
        """"fleet-wide barrier", "per worker" (no barrier), "barrier groups", or "undecided"."""
        if self.groups is None:
            return "undecided"
        if len(self.groups) == 1:
            return "fleet-wide barrier"
        if all(len(g) == 1 for g in self.groups):
            return "per worker"
        return "barrier groups"


def _near_all(
    srt: Sequence[Sequence[float]], med: Sequence[float], tolerance: float
) -> npt.NDArray[np.float64]:
    """`near[i, j]`: the fraction of worker i's step ends (within the span of j's) with one of j's
    within tolerance × the shorter of their median steps: per j, every worker's ends at once."""
    n = len(srt)
    flat = np.concatenate([np.asarray(s, dtype=np.float64) for s in srt])
    owner = np.repeat(np.arange(n), [len(s) for s in srt])
    med_of = np.asarray(med, dtype=np.float64)[owner]
    near = np.zeros((n, n))
    for j in range(n):
        others = np.asarray(srt[j], dtype=np.float64)
        tol = tolerance * np.minimum(med_of, med[j])
        inside = (flat >= others[0] - tol) & (flat <= others[-1] + tol)
        i = np.searchsorted(others, flat - tol, side="left")
        hit = inside & (i < len(others)) & (others[np.minimum(i, len(others) - 1)] <= flat + tol)
        counted = np.bincount(owner, weights=inside, minlength=n)
        hits = np.bincount(owner, weights=hit, minlength=n)
        near[:, j] = np.divide(hits, counted, out=np.zeros(n), where=counted > 0)
    return near


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def choose_barrier(
    ends: Sequence[Sequence[float]],
    steps: Sequence[Sequence[float]],
    *,
    tolerance: float = TOLERANCE,
    synced: float = SYNCED,
    min_steps: int = MIN_STEPS,
) -> BarrierChoice:
    """Barrier groups of the workers from `ends[g]` (when worker g's measured steps ended, over
    one recent span of time) and `steps[g]` (their durations); see the module docstring."""
    n = len(ends)
    if len(steps) != n:
        raise ValueError(f"{n} workers' step ends but {len(steps)} workers' durations")
    if not (0 < tolerance < 0.5) or not (0 < synced <= 1):
        raise ValueError("tolerance must be in (0, 0.5) and synced in (0, 1]")
    unmeasured = tuple(g for g in range(n) if len(ends[g]) < min_steps or not steps[g])
    if n == 1:
        return BarrierChoice(((0,),), {}, unmeasured, "one worker")
    if unmeasured:
        names = ", ".join(str(g) for g in unmeasured)
        return BarrierChoice(None, {}, unmeasured, f"workers {names}: fewer than {min_steps} measured steps")
    srt = [sorted(e) for e in ends]
    med = [_median(s) for s in steps]
    parent = list(range(n))

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    near = _near_all(srt, med, tolerance)
    coincidence: dict[tuple[int, int], float] = {}
    for i in range(n):
        for j in range(i + 1, n):
            c = float(max(near[i, j], near[j, i]))
            coincidence[(i, j)] = c
            if c >= synced:
                parent[root(j)] = root(i)
    members: dict[int, list[int]] = {}
    for g in range(n):
        members.setdefault(root(g), []).append(g)
    groups = tuple(sorted(tuple(m) for m in members.values()))
    best = max(coincidence.values())
    reason = (f"step ends coincide (within {tolerance:g} × the shorter median step) for {best:.0%} at most "
              f"of any pair's steps, {synced:.0%} needed for a shared barrier"
              if len(groups) == n else
              f"step ends of {sum(len(g) for g in groups if len(g) > 1)} workers coincide for at least "
              f"{synced:.0%} of their steps (within {tolerance:g} × the shorter median step)")
    return BarrierChoice(groups, coincidence, (), reason)
