"""Offline replay of a rolling session: every window from the seed the live lanes started it from.

`replay_rolling` feeds the recorded requests (placement, prompt, output, worker) to a
`LiveDriver` with the recorded seeds, so each lane goes through the steps it went through live
(same jobs, same ends, same starting state per window) and the per-window figures agree. With
`only=N` it replays window N alone from its seed: the same figures for policies whose decisions
depend only on the fleet they see (a learned predictor, BR-H's, starts cold instead).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shadow.contracts.events import Arrive, Finish, Route
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.feed import Recorded
from shadow.engine.lane import Clock
from shadow.engine.live import LiveDriver
from shadow.engine.rolling import Seed
from shadow.engine.windows import Windows, WindowTotals


@dataclass(slots=True)
class RolledReplay:
    """The driver after the replay and its lanes' windows (lane label -> windows, oldest first)."""

    driver: LiveDriver
    windows: Windows

    def series(self, label: str) -> list[WindowTotals]:
        return self.windows.series(label)


def replay_rolling(
    requests: Iterable[Recorded],
    seeds: Mapping[int, Seed],
    config: EngineConfig,
    specs: Sequence[LaneSpec],
    workers: Sequence[str],
    clock: Clock,
    *,
    only: int | None = None,
) -> RolledReplay:
    """See module docstring. ValueError without seeds, or for a window with no seed."""
    if not seeds:
        raise ValueError("no seeds: the session was not recorded with rolling windows")
    first = next(iter(seeds.values()))
    window_s, origin = first.window_s, first.origin
    given = dict(seeds)
    if only is not None:
        if only not in seeds:
            raise ValueError(f"window {only}: no seed recorded (recorded: {min(seeds)}..{max(seeds)})")
        given = {only: seeds[only]}
    driver = LiveDriver(config, specs, workers, clock, lag_s=0.0, rolling_s=window_s, seeds=given,
                        origin=origin)
    windows = Windows(driver.lanes, window_s)
    driver.observe(windows)
    start = end = None
    held: dict[str, int] = {}
    if only is not None:
        seed = seeds[only]
        start, end = seed.t, seed.t + window_s
        held = {r.request_id: i for i, r in enumerate(seed.requests)}
    for r in requests:
        if start is not None and end is not None and not start <= r.arrival_s < end:
            i = held.get(r.request_id)
            if i is not None:  # in flight at the window's start: enters through the seed
                driver.know(seeds[only].requests[i], r.output_tokens, r.body_bytes)  # type: ignore[index]
            continue
        driver.apply(Arrive(r.request_id, r.arrival_s, r.prompt_tokens, r.prompt_key,
                            body_bytes=r.body_bytes))
        driver.apply(Route(r.request_id, r.arrival_s, r.worker or "", r.prompt_tokens))
        driver.apply(Finish(r.request_id, r.arrival_s, "stop", r.output_tokens))
    driver.drain()
    if only is not None:
        driver.run_lanes_to((only + 1) * window_s)  # window N ends at its boundary, as it did live
    return RolledReplay(driver, windows)
