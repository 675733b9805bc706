"""Live lanes beside a small step-level fleet (`shadow.fleet.events`), for the rolling-lane tests."""

from __future__ import annotations

import dataclasses
import random
import zlib

from shadow.contracts.events import Arrive, Event
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.live import LiveDriver
from shadow.engine.windows import Windows
from shadow.fleet.events import EventFleet

STEP = 0.05


def clock() -> float:
    return 0.0


def fleet(g: int, b: int, *, rate: float, out: int, every: int, seed: int, route: str) -> EventFleet:
    """G × B workers stepping every STEP s, prompts 50–400 and outputs 2–`out` tokens at random."""
    rng = random.Random(seed)
    lengths = [(rng.randint(50, 400), rng.randint(2, out)) for _ in range(10_000)]
    return EventFleet(g, b, STEP, rate, lengths, rng, route=route, token_every=every, t0=100.0)


def live_session(real: EventFleet, seconds: float, specs: list[LaneSpec], *, rolling: float | None,
                 lag: float = 1.0, bodies: bool = False) -> tuple[LiveDriver, Windows, list[Event], float]:
    """Live lanes beside `real` for `seconds` of arrivals (then it drains), advanced after every
    step; returns the driver, its windows, every event, and the largest lag seen. `bodies`: every
    arrival carries a body size as a tap's would (2–9 bytes per prompt token, by request id), so
    jsq-bytes scores what it was sent, not the per-token estimate."""
    config = EngineConfig(workers=real.g, slots=real.b, step=StepTimeModel(a=1e-9, b=STEP))
    driver = LiveDriver(config, specs, [f"d{g}" for g in range(real.g)], clock, lag_s=lag, rolling_s=rolling)
    windows = Windows(driver.lanes, rolling or 5.0)
    driver.observe(windows)
    events: list[Event] = []
    worst = 0.0
    end = real.t + seconds
    while real.t < end or real.busy():
        real.arrivals = real.t < end
        batch = real.step()
        if bodies:
            batch = [_with_body(ev) for ev in batch]
        events += batch
        for ev in batch:
            driver.apply(ev)
        driver.advance_to(real.t)
        worst = max(worst, *(driver.lag(lane) for lane in driver.lanes))
    driver.drain()
    return driver, windows, events, worst


def _with_body(ev: Event) -> Event:
    if not isinstance(ev, Arrive) or ev.prompt_tokens is None:
        return ev
    per_token = 2 + zlib.crc32(ev.request_id.encode()) % 8
    return dataclasses.replace(ev, body_bytes=per_token * ev.prompt_tokens)
