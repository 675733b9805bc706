"""Baseline routers that bind a request to a worker the moment it arrives.

Shape of each: filter (which workers may take it) → score (a key per worker, lower is better)
→ pick (the minimum; ties go to the first registered worker). Randomness comes from the
`random.Random` passed in; nothing here reads a clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class WorkerView:
    """What a baseline router sees of each worker (index = registration order).

    kv_tokens: KV tokens held (running requests). outstanding: requests sent and not finished
    (running or queued in the engine). outstanding_tokens: their summed forwarded size — the
    vllm-ascend proxy's byte score, in prompt tokens. free_slots: free running slots.
    """

    kv_tokens: list[float]
    outstanding: list[int]
    outstanding_tokens: list[float]
    free_slots: list[int]

    @property
    def workers(self) -> int:
        return len(self.kv_tokens)


class Baseline:
    """Base class: `pick` returns a worker index for a request of `prompt_tokens`."""

    name = "baseline"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def candidates(self, view: WorkerView, only_free: bool) -> list[int]:
        """Filter: every worker, or (only_free) those with a free slot."""
        if only_free:
            return [g for g, c in enumerate(view.free_slots) if c > 0]
        return list(range(view.workers))

    def pick(self, view: WorkerView, prompt_tokens: int, only_free: bool = False) -> int:
        raise NotImplementedError


class _ByKey(Baseline):
    """Pick the candidate with the lowest key; ties to the first registered."""

    def key(self, view: WorkerView, g: int) -> float:
        raise NotImplementedError

    def pick(self, view: WorkerView, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(view, only_free)
        if not cands:
            raise ValueError(f"{self.name}: no worker can take the request")
        return min(cands, key=lambda g: (self.key(view, g), g))


class RoundRobin(Baseline):
    """Cyclic over workers (skipping those filtered out)."""

    name = "rr"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._next = 0

    def pick(self, view: WorkerView, prompt_tokens: int, only_free: bool = False) -> int:
        n = view.workers
        for k in range(n):
            g = (self._next + k) % n
            if not only_free or view.free_slots[g] > 0:
                self._next = g + 1
                return g
        raise ValueError("rr: no worker can take the request")


class UniformRandom(Baseline):
    """Uniformly random worker."""

    name = "random"

    def pick(self, view: WorkerView, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(view, only_free)
        if not cands:
            raise ValueError("random: no worker can take the request")
        return cands[self.rng.randrange(len(cands))]


class PowerOfTwo(Baseline):
    """Two distinct random workers; the one with fewer outstanding requests (ties: first drawn)."""

    name = "p2c"

    def pick(self, view: WorkerView, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(view, only_free)
        if not cands:
            raise ValueError("p2c: no worker can take the request")
        if len(cands) == 1:
            return cands[0]
        a, b = self.rng.sample(cands, 2)
        return b if view.outstanding[b] < view.outstanding[a] else a


class JoinShortestQueue(_ByKey):
    """Fewest outstanding requests (JSQ-count)."""

    name = "jsq"

    def key(self, view: WorkerView, g: int) -> float:
        return view.outstanding[g]


class JoinShortestQueueBytes(_ByKey):
    """vllm-ascend P/D proxy rule: least outstanding forwarded size, ties to first registered."""

    name = "jsq-bytes"

    def key(self, view: WorkerView, g: int) -> float:
        return view.outstanding_tokens[g]


class LeastTokens(_ByKey):
    """Least KV tokens held plus prompt tokens already queued there."""

    name = "least-tokens"

    def key(self, view: WorkerView, g: int) -> float:
        return view.kv_tokens[g]


BASELINES: dict[str, type[Baseline]] = {
    cls.name: cls
    for cls in (RoundRobin, UniformRandom, PowerOfTwo, JoinShortestQueue, JoinShortestQueueBytes, LeastTokens)
}


def make_baseline(name: str, rng: random.Random) -> Baseline:
    """A fresh baseline router by policy name (ValueError for an unknown one)."""
    try:
        return BASELINES[name](rng)
    except KeyError:
        raise ValueError(f"unknown baseline policy {name!r}; known: {sorted(BASELINES)}") from None


def bind_all(baseline: Baseline, view: WorkerView, prompts: Sequence[int], only_free: bool) -> list[int]:
    """Route `prompts` in order, updating the view after each choice as a live router would."""
    out: list[int] = []
    for s in prompts:
        g = baseline.pick(view, s, only_free)
        view.kv_tokens[g] += s
        view.outstanding[g] += 1
        view.outstanding_tokens[g] += s
        if only_free:
            view.free_slots[g] -= 1
        out.append(g)
    return out
