"""What the real router saw of the fleet when it placed each request (for the agreement ledger).

The live report says which lane's rule is closest to what the router really does by asking every
rule, at each of the router's placements, where it would have placed that request. The question
is only fair on the view the router had: its own ledger of requests it sent and has not seen end
(counts, prompt tokens, request-body bytes: what JSQ, JSQ-bytes and the token-ledger rules read)
and what the engines were running (the mirror's running requests and their KV tokens: what the
engine-stat rules read). A lane's modelled fleet is not that view: its streams end when the lane
says, and under host load the real ends drift from the modelled ones.

`RouterViews` keeps that ledger from the same events the mirror folds, and takes a copy of it at
each placement, before the placed request is counted (the router decided on the fleet without
it). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from shadow.core.cost import RouteCost
from shadow.core.snapshot import FleetSnapshot


@dataclass(frozen=True, slots=True)
class RouterView:
    """Per worker at one placement: requests sent and not ended (`outstanding`), their prompt tokens
    and body bytes, the mirror's running requests, their KV tokens (`loads`) and prompt tokens."""

    outstanding: tuple[int, ...]
    outstanding_tokens: tuple[float, ...]
    outstanding_bytes: tuple[float, ...]
    running: tuple[int, ...]
    loads: tuple[float, ...]
    prompt_loads: tuple[float, ...]

    def snapshot(self, slots: int, cost: RouteCost, extras: Mapping[str, object]) -> FleetSnapshot:
        """The view as a policy reads it: `slots` running slots per worker, the fleet's step `cost`
        and the caller's `extras` (KV capacity, BRA's basis)."""
        running = [min(r, slots) for r in self.running]
        return FleetSnapshot(
            loads=self.loads,
            free_slots=[slots - r for r in running],
            outstanding=self.outstanding,
            outstanding_tokens=self.outstanding_tokens,
            queued_tokens=[max(0.0, t - p) for t, p in zip(self.outstanding_tokens, self.prompt_loads,
                                                            strict=True)],
            prompt_loads=self.prompt_loads,
            extras=extras,
            running=running,
            cost=cost,
            outstanding_bytes=self.outstanding_bytes,
        )


class RouterViews:
    """The router's ledger per worker, and the view it had at each placement until it is taken.

    `placed(rid, g, prompt, body_bytes, running, loads)`: the router sent `rid` to worker g, the
    mirror's running requests and KV tokens per worker being `running` and `loads` (the view is
    copied before `rid` counts); `started(rid)`: its first token (running on its engine);
    `ended(rid)`: its stream ended; `take(rid)`: the view at its placement, once (None: not placed
    here, or taken). A view not taken is dropped by `forget(rid)`; `pending` counts those kept."""

    def __init__(self, workers: int) -> None:
        self._out = [0] * workers
        self._tokens = [0.0] * workers
        self._bytes = [0.0] * workers
        self._prompts = [0.0] * workers  # prompt tokens of the running ones
        self._sent: dict[Hashable, tuple[int, float, float]] = {}  # rid -> (worker, prompt, bytes)
        self._started: set[Hashable] = set()
        self._views: dict[Hashable, RouterView] = {}

    @property
    def pending(self) -> int:
        return len(self._views)

    def placed(self, rid: Hashable, g: int, prompt: float, body_bytes: float,
               running: Sequence[int], loads: Sequence[float]) -> None:
        if rid in self._sent:
            return
        self._views[rid] = RouterView(tuple(self._out), tuple(self._tokens), tuple(self._bytes),
                                      tuple(running), tuple(loads), tuple(self._prompts))
        self._sent[rid] = (g, prompt, body_bytes)
        self._out[g] += 1
        self._tokens[g] += prompt
        self._bytes[g] += body_bytes

    def started(self, rid: Hashable) -> None:
        sent = self._sent.get(rid)
        if sent is not None and rid not in self._started:
            self._started.add(rid)
            self._prompts[sent[0]] += sent[1]

    def ended(self, rid: Hashable) -> None:
        sent = self._sent.pop(rid, None)
        if sent is None:
            return
        g, prompt, size = sent
        self._out[g] -= 1
        self._tokens[g] -= prompt
        self._bytes[g] -= size
        if rid in self._started:
            self._started.discard(rid)
            self._prompts[g] -= prompt

    def take(self, rid: Hashable) -> RouterView | None:
        return self._views.pop(rid, None)

    def forget(self, rid: Hashable) -> None:
        self._views.pop(rid, None)
