"""A running stack for telemetry tests: a simulated fleet, taps in front of its decode ranks, and
some streamed traffic through the taps (real HTTP on loopback)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from shadow.app.serve import ServeConfig
from shadow.fleet import FleetConfig
from shadow.mirror.config import MirrorConfig
from shadow.realvllm.stepsender import StepSample, StepSender
from tests.harness import FleetThread, ServeThread, TapThread


@dataclass
class Stack:
    fleet: FleetThread
    taps: TapThread

    @property
    def api(self) -> str:
        return str(self.taps.ready["api"])

    @property
    def tap_urls(self) -> dict[str, str]:
        return dict(self.taps.ready["taps"])


async def _stream(client: httpx.AsyncClient, url: str, n: int) -> int:
    body = {"model": "sim-llm", "prompt": "hello " * 40, "stream": True, "max_tokens": n}
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for _ in resp.aiter_lines():
            chunks += 1
    return chunks


def send_traffic(urls: list[str], per_url: int = 3, max_tokens: int = 8) -> None:
    """Stream `per_url` completions through each URL, concurrently; raises on any failure."""

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            jobs = [_stream(client, u, max_tokens) for u in urls for _ in range(per_url)]
            done = await asyncio.gather(*jobs)
            assert all(c > 0 for c in done)

    asyncio.run(run())


@contextmanager
def running_stack(decode: int = 2, slots: int = 8, scrape_interval_s: float = 0.5,
                  time_scale: float = 0.05, serve: bool = False) -> Iterator[Stack]:
    """Fleet (plain decode ranks; fast steps by default) with a tap in front of each rank: as
    `shadow tap` (taps only) or, with `serve`, as `shadow serve` (taps + live lanes)."""
    cfg = FleetConfig(prefill=0, decode=decode, slots=slots, base_port=0, time_scale=time_scale)
    with FleetThread(cfg) as fleet:
        workers = {f"d{g}": u for g, u in enumerate(fleet.decode_urls)}
        tap = MirrorConfig(workers, slots=slots, scrape_interval_s=scrape_interval_s)
        runner = ServeThread(ServeConfig(tap=tap)) if serve else TapThread(tap)
        with runner as taps:
            yield Stack(fleet, taps)


def until_step_model(stack: Stack, bursts: int = 5) -> dict[str, Any]:
    """Send bursts of concurrent streams until `shadow serve` has fitted its step model (SSE step
    estimates need co-scheduled streams); returns the report's step_model. Fails after `bursts`."""
    urls = list(stack.tap_urls.values())
    for _ in range(bursts):
        send_traffic(urls, per_url=8, max_tokens=60)
        stack.taps.wait_for(lambda: stack.taps.svc.state.live() == 0 and not len(stack.taps.svc.queue))
        report = httpx.get(stack.api + "/v1/report", params={"drain": 1}, timeout=30).json()
        if report["step_model"].get("samples", 0) >= 2 and report["step_model"].get("r2") is not None:
            return dict(report["step_model"])
    raise AssertionError(f"no step model after {bursts} bursts of traffic")


HOST = 1.25  # the synthetic probe's host factor: period over the engine's work


def post_probe_steps(stack: Stack, steps: int = 1500, seed: int = 7) -> dict[str, int]:
    """Post `steps` engine-probe `step` events per decode rank to the stack's event API through
    the probe's own sender (`StepSender`: real HTTP, the probe's NDJSON), as vLLM's probe on DP
    ranks in lockstep would: each step's engine work is 3 ms + 0.4 ms per running sequence (the
    count changing every 25 steps, the same on every rank) and its period HOST times that (the rest
    a wait for a CPU, in the probe's schedstat reads), the last one ending now. The
    simulated fleet has no engine probe (its steps are seen through SSE only); this gives the
    step-cost families a fit to export (a group's form is chosen from 20 windows of 25 steps per
    rank on). Returns the events each sender posted."""
    rng = random.Random(seed)
    running = [rng.randint(1, 12) for _ in range(steps // 25 + 1)]
    work = [0.003 + 0.0004 * running[k // 25] for k in range(steps)]
    periods = [HOST * w for w in work]
    start = time.monotonic() - sum(periods)
    posted: dict[str, int] = {}
    for name in stack.tap_urls:  # the fleet's ranks step in lockstep: the same steps on each
        t, run_s, wait_s = start, 0.0, 0.0
        sender = StepSender(stack.api, worker=name)
        try:
            for k, period in enumerate(periods):
                t, run_s, wait_s = t + period, run_s + work[k], wait_s + period - work[k]
                n = running[k // 25]
                sender.offer(StepSample(t, 0, 0.8 * period, n, 0, 0.01 * n, n, 0, decode_requests=n,
                                        iteration=k, engine_interval_s=period, run_s=run_s, wait_s=wait_s))
        finally:
            sender.close(timeout_s=30.0)
        assert not sender.counts.rejected and sender.counts.sent == steps, sender.counts
        posted[name] = sender.counts.sent
    return posted
