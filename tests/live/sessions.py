"""Synthetic live sessions: the event stream a mirror would produce for a trace, in time order."""

from __future__ import annotations

import heapq
import random

from shadow.contracts.events import Arrive, Event, Finish, Route, Token
from shadow.live.lanes import LiveLanes
from shadow.traces import at_load, estimate_capacity_rps, resolve


def session_events(
    n: int, workers: int, slots: int, rho: float = 1.0, seed: int = 0, token_every: int = 8
) -> tuple[list[Event], list[tuple[str, float, int, int, str]]]:
    """Events of `n` paper-azure requests placed round-robin, each streaming at 60 ms per token.

    Returns (events sorted by time, [(id, arrival, prompt, output, worker)]). Real stream timing
    does not matter to the lanes (they simulate their own), only the facts and when they are known.
    """
    trace = resolve("paper-azure", seed=seed, limit=n)
    cap = estimate_capacity_rps(trace, workers=workers, slots=slots, step_a=1.2e-7, step_b=0.02)
    trace = at_load(trace, rho, cap)
    rng = random.Random(seed)
    heap: list[tuple[float, int, Event]] = []
    reqs = []
    tie = 0
    for i, r in enumerate(trace.requests):
        rid = f"r{i}"
        w = f"d{(i + rng.randrange(2)) % workers}"
        t0 = 1000.0 + r.arrival_s
        out = r.output_tokens
        evs: list[Event] = [
            Arrive(rid, t0, r.prompt_tokens, r.prompt_key),
            Route(rid, t0, w, r.prompt_tokens),
        ]
        step = 0.06
        for k in range(token_every, out, token_every):
            evs.append(Token(rid, t0 + k * step, k))
        evs.append(Finish(rid, t0 + out * step, "stop", out))
        for ev in evs:
            tie += 1
            heapq.heappush(heap, (ev.t, tie, ev))
        reqs.append((rid, t0, r.prompt_tokens, out, w))
    events = [heapq.heappop(heap)[2] for _ in range(len(heap))]
    return events, reqs


def feed(live: LiveLanes, events: list[Event], chunk: int = 50) -> LiveLanes:
    """Give `events` to `live` `chunk` at a time as the mirror would (processing after each chunk),
    then publish its report; returns `live`."""
    for i in range(0, len(events), chunk):
        for ev in events[i:i + chunk]:
            live.listener(ev)
        live.process_now()
    live._publish()
    return live
