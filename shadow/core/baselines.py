"""Baseline routers that bind a request to a worker the moment it arrives.

Shape of each: filter (which workers may take it) → score (a key per worker, lower is better)
→ pick (the minimum; ties go to the first registered worker). Randomness comes from the
`random.Random` passed in; nothing here reads a clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from shadow.core.snapshot import KV_CAPACITY, FleetSnapshot

#: Bytes per token in the vllm-ascend proxy's (and `shadow router`'s) estimates: a body of n bytes
#: counts n / 4 tokens. Where a request's body size is unknown, 4 × its prompt tokens stands in.
BODY_BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class BindState:
    """What a baseline reads of each worker while it binds (index = registration order), taken
    from a snapshot and updated after each choice as a live router's counters would be.

    kv_tokens: KV tokens held plus prompt tokens queued there. outstanding: requests sent and not
    finished (without counts: minus the free slots, so more free slots read as a shorter queue).
    outstanding_tokens: their summed forwarded size in tokens (without them: the loads).
    outstanding_bytes: their summed request-body bytes, the vllm-ascend proxy's decode score
    (without them: BODY_BYTES_PER_TOKEN × outstanding_tokens). free_slots: free running slots.

    What an engine publishes of itself (the incumbents' rules read these, `shadow.core.incumbents`):
    kv_used: KV tokens its running requests hold; running / waiting: requests running / queued at
    it (without counts: none); kv_usage: the fraction of its KV cache in use (0 when the cache's size
    is unknown). `outstanding`, `outstanding_tokens`, `outstanding_bytes` and `free_slots` are what
    the router itself
    knows (its own ledger); the rest is what it reads of the engines, which may be stale
    (`StaleView`).
    """

    kv_tokens: list[float]
    outstanding: list[int]
    outstanding_tokens: list[float]
    free_slots: list[int]
    kv_used: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    outstanding_bytes: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outstanding_bytes:
            self.outstanding_bytes = [BODY_BYTES_PER_TOKEN * x for x in self.outstanding_tokens]
        # Built by hand without what the engines publish: none published (nothing running or
        # waiting that the router would know of, KV used = kv_tokens, usage unknown).
        if self.kv_tokens and not self.running:
            g = len(self.free_slots)
            self.kv_used = self.kv_used or list(self.kv_tokens)
            self.running, self.waiting = [0] * g, self.waiting or [0] * g
            self.kv_usage = self.kv_usage or [0.0] * g

    @classmethod
    def of(cls, fleet: FleetSnapshot, *, engines: bool = False) -> BindState:
        """A fresh state from `fleet` (the snapshot's sequences are copied, never written); `engines`:
        with what the engines publish of themselves (kv_used, running, waiting, kv_usage), which
        only the incumbents' rules read."""
        state = cls.of_ledger(fleet)
        if engines:
            state.publish(fleet)
        else:
            state.kv_tokens = _held_and_queued(fleet)
        return state

    def publish(self, fleet: FleetSnapshot) -> None:
        """Replace what the engines publish of themselves by `fleet`'s (a refresh of a stale view)."""
        loads = fleet.loads
        self.kv_tokens = _held_and_queued(fleet)
        self.kv_used = list(loads)
        running = fleet.running
        self.running = [0] * len(loads) if running is None else list(running)
        out, cap = fleet.outstanding, fleet.extra(KV_CAPACITY)
        if out is None or running is None:
            self.waiting = [0] * len(loads)
        else:
            self.waiting = [o - r for o, r in zip(out, running, strict=True)]
        if cap is None:
            self.kv_usage = [0.0] * len(loads)
        else:
            self.kv_usage = [x / c if c else 0.0 for x, c in zip(loads, cap, strict=True)]

    def own(self, fleet: FleetSnapshot) -> None:
        """Replace what the router knows itself (its ledger, the free slots) by `fleet`'s."""
        fresh = BindState.of_ledger(fleet)
        self.outstanding, self.outstanding_tokens, self.outstanding_bytes, self.free_slots = (
            fresh.outstanding, fresh.outstanding_tokens, fresh.outstanding_bytes, fresh.free_slots)

    @classmethod
    def of_ledger(cls, fleet: FleetSnapshot) -> BindState:
        """Only the router's own ledger and the free slots of `fleet` (nothing published)."""
        loads, free, body = fleet.loads, fleet.free_slots, fleet.outstanding_bytes
        return cls(
            kv_tokens=[],
            outstanding=[-c for c in free] if fleet.outstanding is None else list(fleet.outstanding),
            outstanding_tokens=list(loads if fleet.outstanding_tokens is None else fleet.outstanding_tokens),
            free_slots=list(free),
            outstanding_bytes=[] if body is None else list(body),
        )

    @property
    def workers(self) -> int:
        return len(self.free_slots)


def _held_and_queued(fleet: FleetSnapshot) -> list[float]:
    """KV tokens held plus prompt tokens queued, per worker."""
    loads, queued = fleet.loads, fleet.queued_tokens
    return list(loads) if queued is None else [x + q for x, q in zip(loads, queued, strict=True)]


class Baseline:
    """Base class: `pick` returns a worker index for a request of `prompt_tokens`."""

    name = "baseline"
    #: reads what the engines publish of themselves (`BindState.of(..., engines=True)`)
    engines = False

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

    def charge(self, state: BindState, g: int, prompt_tokens: int) -> None:
        """What the router's view adds at worker `g` for a request it just placed there, before
        the engines tell (a live router's own counters; an incumbent's optimistic increment)."""
        state.kv_tokens[g] += prompt_tokens
        state.outstanding[g] += 1
        state.outstanding_tokens[g] += prompt_tokens
        # (its body's size is not told to the rule: the estimate, until the next snapshot's ledger)
        state.outstanding_bytes[g] += BODY_BYTES_PER_TOKEN * prompt_tokens


class _ByKey(Baseline):
    """Pick the candidate with the lowest key; ties to the first registered."""

    def keys(self, state: BindState) -> Sequence[float]:
        """Every worker's key, by index."""
        raise NotImplementedError

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        # candidates ascend, and min keeps the first of equal keys: ties go to the first registered
        return min(self.candidates(state, only_free), key=self.keys(state).__getitem__)


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

    def keys(self, state: BindState) -> Sequence[float]:
        return state.outstanding


class JoinShortestQueueBytes(_ByKey):
    """vllm-ascend P/D proxy rule: least outstanding request-body bytes (each request's body size,
    held until its stream ends), ties to the first registered. Where a body's size is unknown
    (traces, recordings without it) BODY_BYTES_PER_TOKEN × its prompt tokens stands in: the order of
    outstanding prompt tokens."""

    name = "jsq-bytes"

    def keys(self, state: BindState) -> Sequence[float]:
        return state.outstanding_bytes


class LeastTokens(_ByKey):
    """Least KV tokens held plus prompt tokens already queued there."""

    name = "least-tokens"

    def keys(self, state: BindState) -> Sequence[float]:
        return state.kv_tokens


def bind_all(baseline: Baseline, state: BindState, prompts: Sequence[int], only_free: bool) -> list[int]:
    """Route `prompts` in order, updating `state` after each choice as a live router would."""
    out: list[int] = []
    for s in prompts:
        g = baseline.pick(state, s, only_free)
        baseline.charge(state, g, s)
        if only_free:
            state.free_slots[g] -= 1
        out.append(g)
    return out
