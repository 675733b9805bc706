"""Baseline routers that bind a request to a worker the moment it arrives.

Shape of each: filter (which workers may take it) → score (a key per worker, lower is better)
→ pick (the minimum; ties go to the first registered worker). Randomness comes from the
`random.Random` passed in; nothing here reads a clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from shadow.core.snapshot import FleetSnapshot


@dataclass(slots=True)
class BindState:
    """What a baseline reads of each worker while it binds (index = registration order), taken
    from a snapshot and updated after each choice as a live router's counters would be.

    kv_tokens: KV tokens held plus prompt tokens queued there. outstanding: requests sent and not
    finished (without counts: minus the free slots, so more free slots read as a shorter queue).
    outstanding_tokens: their summed forwarded size, the vllm-ascend proxy's byte score (without
    them: the loads). free_slots: free running slots.
    """

    kv_tokens: list[float]
    outstanding: list[int]
    outstanding_tokens: list[float]
    free_slots: list[int]

    @classmethod
    def of(cls, fleet: FleetSnapshot) -> BindState:
        """A fresh state from `fleet` (the snapshot's sequences are copied, never written)."""
        loads, queued, free = fleet.loads, fleet.queued_tokens, fleet.free_slots
        return cls(
            kv_tokens=list(loads) if queued is None else [x + q for x, q in zip(loads, queued, strict=True)],
            outstanding=[-c for c in free] if fleet.outstanding is None else list(fleet.outstanding),
            outstanding_tokens=list(loads if fleet.outstanding_tokens is None else fleet.outstanding_tokens),
            free_slots=list(free),
        )

    @property
    def workers(self) -> int:
        return len(self.kv_tokens)


class Baseline:
    """Base class: `pick` returns a worker index for a request of `prompt_tokens`."""

    name = "baseline"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def candidates(self, state: BindState, only_free: bool) -> list[int]:
        """Filter: every worker, or (only_free) those with a free slot; ValueError when none is left."""
        free = state.free_slots
        cands = [g for g, c in enumerate(free) if c > 0] if only_free else list(range(len(free)))
        if not cands:
            raise ValueError(f"{self.name}: no worker can take the request")
        return cands

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        raise NotImplementedError


class _ByKey(Baseline):
    """Pick the candidate with the lowest key; ties to the first registered."""

    def key(self, state: BindState, g: int) -> float:
        raise NotImplementedError

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        return min(cands, key=lambda g: (self.key(state, g), g))


class RoundRobin(Baseline):
    """Cyclic over workers (skipping those filtered out)."""

    name = "rr"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._next = 0

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        n = state.workers
        for k in range(n):
            g = (self._next + k) % n
            if not only_free or state.free_slots[g] > 0:
                self._next = g + 1
                return g
        raise ValueError("rr: no worker can take the request")


class UniformRandom(Baseline):
    """Uniformly random worker."""

    name = "random"

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        return cands[self.rng.randrange(len(cands))]


class PowerOfTwo(Baseline):
    """Two distinct random workers; the one with fewer outstanding requests (ties: first drawn)."""

    name = "p2c"

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        if len(cands) == 1:
            return cands[0]
        a, b = self.rng.sample(cands, 2)
        return b if state.outstanding[b] < state.outstanding[a] else a


class JoinShortestQueue(_ByKey):
    """Fewest outstanding requests (JSQ-count)."""

    name = "jsq"

    def key(self, state: BindState, g: int) -> float:
        return state.outstanding[g]


class JoinShortestQueueBytes(_ByKey):
    """vllm-ascend P/D proxy rule: least outstanding forwarded size, ties to first registered."""

    name = "jsq-bytes"

    def key(self, state: BindState, g: int) -> float:
        return state.outstanding_tokens[g]


class LeastTokens(_ByKey):
    """Least KV tokens held plus prompt tokens already queued there."""

    name = "least-tokens"

    def key(self, state: BindState, g: int) -> float:
        return state.kv_tokens[g]


def bind_all(baseline: Baseline, state: BindState, prompts: Sequence[int], only_free: bool) -> list[int]:
    """Route `prompts` in order, updating `state` after each choice as a live router would."""
    out: list[int] = []
    for s in prompts:
        g = baseline.pick(state, s, only_free)
        state.kv_tokens[g] += s
        state.outstanding[g] += 1
        state.outstanding_tokens[g] += s
        if only_free:
            state.free_slots[g] -= 1
        out.append(g)
    return out
