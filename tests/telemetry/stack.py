"""A running stack for telemetry tests: a simulated fleet, taps in front of its decode ranks, and
some streamed traffic through the taps (real HTTP on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from shadow.fleet import FleetConfig, FleetThread
from shadow.mirror.service import TapConfig
from shadow.mirror.thread import TapThread


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
                  time_scale: float = 0.05) -> Iterator[Stack]:
    """Fleet (plain decode ranks; fast steps by default) with a tap in front of each rank."""
    cfg = FleetConfig(prefill=0, decode=decode, slots=slots, base_port=0, time_scale=time_scale)
    with FleetThread(cfg) as fleet:
        workers = {f"d{g}": u for g, u in enumerate(fleet.decode_urls)}
        with TapThread(TapConfig(workers, slots=slots, scrape_interval_s=scrape_interval_s)) as taps:
            yield Stack(fleet, taps)
