"""A running stack for telemetry tests: a simulated fleet, taps in front of its decode ranks, and
some streamed traffic through the taps (real HTTP on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from shadow.app.serve import ServeConfig
from shadow.fleet import FleetConfig
from shadow.mirror.service import TapConfig
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
        tap = TapConfig(workers, slots=slots, scrape_interval_s=scrape_interval_s)
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
