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
from collections.abc import Mapping
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
