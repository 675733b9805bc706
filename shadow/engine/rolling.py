"""The rolling counterfactual's seeds: the mirrored fleet at the start of each window of W seconds.

At lane time n·W (n >= 1; event time origin + n·W) every live lane drops what it holds and starts
again from the real fleet's in-flight requests: "from the same starting state, what would each
policy have done over the next W seconds?". A `Seed` is that state as the live driver mirrored it
from the events before the boundary: per request its worker, placement time, prompt size and
tokens generated so far (0: placed, waiting at its worker for a slot). Recordings carry seeds as
`{"type": "seed", ...}` lines (`to_json`), so a replay starts each window from the same state.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Seeded:
    """One request in flight at a window's start (time on the event clock)."""

    request_id: str
    worker: str
    arrival: float
    prompt: int
    generated: int  # tokens so far; 0: waiting at its worker (no token yet)
    key: str | None = None


@dataclass(frozen=True, slots=True)
class Seed:
    """The mirrored fleet at the start of rolling window `window` (event time `t` = origin + window·W).

    `budget`: the live driver's step budget when it was taken (the tokens seen so far); the
    lanes' steps within the window are bounded by what it grew since (0 in a replay: no bound).
    """

    window: int
    t: float
    origin: float
    window_s: float
    requests: tuple[Seeded, ...]
    budget: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "seed",
            "window": self.window,
            "t": self.t,
            "origin": self.origin,
            "window_s": self.window_s,
            "requests": [[r.request_id, r.worker, r.arrival, r.prompt, r.generated, r.key]
                         for r in self.requests],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Seed:
        """Parse `to_json()`'s output; ValueError (one line) on anything else."""
        try:
            reqs = tuple(
                Seeded(str(rid), str(w), float(a), int(p), int(g), None if k is None else str(k))
                for rid, w, a, p, g, k in obj["requests"]
            )
            seed = cls(int(obj["window"]), float(obj["t"]), float(obj["origin"]), float(obj["window_s"]),
                       reqs)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"seed line: {err!r}") from None
        if seed.window < 1 or not (math.isfinite(seed.window_s) and seed.window_s > 0):
            raise ValueError(f"seed line: window {seed.window} of {seed.window_s} s")
        return seed


def check_window(window_s: float | None) -> float | None:
    """A rolling window length (seconds, finite, > 0) or None (off); ValueError otherwise."""
    if window_s is None:
        return None
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"rolling window must be > 0 s, got {window_s!r}")
    return float(window_s)


class SeedBook:
    """A rolling driver's seeds: taken (live) or given (a replay), each kept until every one of
    `lanes` lanes has used it; the requests a kept seed holds are pinned (the driver keeps them).

    `due(origin, upto)` names the boundaries at or before event time `upto` whose seed is still to
    be taken, in order; `add` keeps one (and lists it in `new` for the caller); `get(n)` is seed n
    if any; `used(n)` counts one lane past boundary n and returns the requests no seed pins any more.
    """

    def __init__(self, window_s: float, lanes: int, given: Mapping[int, Seed] | None = None) -> None:
        self.window_s = window_s
        self.lanes = lanes
        self.given = dict(given) if given is not None else None
        self.seeds: dict[int, Seed] = {}
        self.uses: Counter[int] = Counter()
        self.pinned: Counter[str] = Counter()
        self.next = 1  # the next boundary whose seed is to be taken
        self.new: list[Seed] = []
        for seed in (self.given or {}).values():
            self.pinned.update(r.request_id for r in seed.requests)

    def due(self, origin: float, upto: float) -> Iterator[int]:
        while self.given is None and upto >= origin + self.next * self.window_s:
            self.next += 1
            yield self.next - 1

    def add(self, seed: Seed) -> None:
        self.seeds[seed.window] = seed
        self.pinned.update(r.request_id for r in seed.requests)
        self.new.append(seed)

    def get(self, n: int) -> Seed | None:
        if self.given is not None and n in self.given:
            self.seeds[n] = self.given.pop(n)
        return self.seeds.get(n)

    def holds(self, request_id: str) -> bool:
        return self.pinned.get(request_id, 0) > 0

    def used(self, n: int) -> list[str]:
        self.uses[n] += 1
        if self.uses[n] < self.lanes:
            return []
        del self.uses[n]
        seed = self.seeds.pop(n, None)
        freed: list[str] = []
        for r in seed.requests if seed is not None else ():
            self.pinned[r.request_id] -= 1
            if self.pinned[r.request_id] <= 0:
                del self.pinned[r.request_id]
                freed.append(r.request_id)
        return freed
