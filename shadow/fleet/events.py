"""A step-level "real" fleet that emits what a mirror sees, in event time (no HTTP, no sleeping).

G workers × B slots step every `step_s` (one token per running request per step; a worker admits
from its FIFO queue into free slots first). Poisson arrivals at `rate` per second take their
(prompt, output) from `lengths` in turn; a router places each at arrival: `jsq-bytes` (least
outstanding prompt tokens), `jsq` (fewest requests), or `first` (all on worker 0: a router that
overloads one worker). With `queue_cap`, arrivals are refused while that many wait (counted in
`shed`; they never reach the mirror). Per request the events are Arrive + Route at arrival, a
cumulative Token at its first token and every `token_every` tokens, Finish at its end. Pure:
randomness comes from `rng`. Used by the soak bench and the rolling-lane tests.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shadow.contracts.events import Arrive, Event, Finish, Route, Token

ROUTES = ("jsq-bytes", "jsq", "first")


@dataclass(slots=True)
class _Req:
    rid: str
    prompt: int
    output: int
    generated: int = 0


class EventFleet:
    """See module docstring. `step()` advances one step and returns its events; `t` is the clock."""

    def __init__(self, workers: int, slots: int, step_s: float, rate: float,
                 lengths: Sequence[tuple[int, int]], rng: random.Random, *, route: str = "jsq-bytes",
                 queue_cap: int | None = None, token_every: int = 8, t0: float = 1000.0) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        if not lengths:
            raise ValueError("no request lengths")
        self.g, self.b, self.step_s, self.rate = workers, slots, step_s, rate
        self.lengths, self.rng, self.route, self.every = lengths, rng, route, token_every
        self.cap = queue_cap
        self.t = t0
        self.next_arrival = t0 + rng.expovariate(rate)
        self.arrivals = True  # False: no more arrivals (the fleet drains)
        self.n = 0
        self.arrived = 0
        self.shed = 0
        self.queues: list[deque[_Req]] = [deque() for _ in range(workers)]
        self.running: list[list[_Req]] = [[] for _ in range(workers)]
        self.outstanding = [0] * workers  # prompt tokens placed and not finished

    def busy(self) -> bool:
        return any(self.queues) or any(self.running)

    def _place(self) -> int:
        if self.route == "first":
            return 0
        if self.route == "jsq":
            return min(range(self.g), key=lambda i: (len(self.queues[i]) + len(self.running[i]), i))
        return min(range(self.g), key=lambda i: (self.outstanding[i], i))

    def step(self) -> list[Event]:
        out: list[Event] = []
        self.t += self.step_s
        t = self.t
        while self.arrivals and self.next_arrival <= t:
            self.arrived += 1
            if self.cap is not None and sum(len(q) for q in self.queues) >= self.cap:
                self.shed += 1
            else:
                s, o = self.lengths[self.n % len(self.lengths)]
                req = _Req(f"r{self.n}", s, max(1, o))
                self.n += 1
                w = self._place()
                self.outstanding[w] += s
                self.queues[w].append(req)
                out += [Arrive(req.rid, self.next_arrival, s), Route(req.rid, self.next_arrival, f"d{w}", s)]
            self.next_arrival += self.rng.expovariate(self.rate)
        for w in range(self.g):
            run, q = self.running[w], self.queues[w]
            while q and len(run) < self.b:
                run.append(q.popleft())
            keep = []
            for r in run:
                r.generated += 1
                if r.generated >= r.output:
                    out.append(Finish(r.rid, t, "stop", r.generated))
                    self.outstanding[w] -= r.prompt
                else:
                    if r.generated == 1 or r.generated % self.every == 0:
                        out.append(Token(r.rid, t, r.generated))
                    keep.append(r)
            self.running[w] = keep
        return out
