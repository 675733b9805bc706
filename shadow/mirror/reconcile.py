"""Reconciliation of the mirrored state against each worker's own Prometheus `/metrics`.

`Reconciler` scrapes every target each interval (`shadow.vllm.metrics.MetricsScraper`; its
transport is swappable for tests) and keeps, per worker, the remote figures, the drift
(mirrored active − remote running − remote waiting), the time of the last good scrape and an error
count; `shadow.mirror.metrics` exports them.

A worker whose /metrics refuses connections (or cannot be connected to in time) is gone: it runs
nothing and takes nothing, while the mirror still counts its slots, running or free. Its drift is
then what the mirror counts there: its slots (`slots`), or its mirrored requests when more or when
slots are unknown. A drift frozen at the last good scrape would show a dead rank as in step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from shadow.mirror.state import MirrorState
from shadow.vllm.metrics import GONE, MetricsScraper, VllmLoad


@dataclass(slots=True)
class WorkerReconcile:
    """Reconciliation status of one worker."""

    url: str
    load: VllmLoad | None = None
    last_ok: float | None = None  # clock time of the last good scrape
    errors: int = 0
    last_error: str | None = None
    drift_requests: float | None = None
    drift_kv_ratio: float | None = None

    def as_dict(self, now: float) -> dict[str, Any]:
        d: dict[str, Any] = {
            "url": self.url,
            "errors": self.errors,
            "last_error": self.last_error,
            "age_s": None if self.last_ok is None else round(now - self.last_ok, 3),
            "drift_requests": self.drift_requests,
            "drift_kv_ratio": self.drift_kv_ratio,
        }
        if self.load is not None:
            d.update(running=self.load.running, waiting=self.load.waiting, kv_usage=self.load.kv_usage)
        return d


class Reconciler:
    """Scrapes `targets` ({worker: metrics URL}) and compares them with `state`."""

    def __init__(
        self,
        targets: dict[str, str],
        state: MirrorState,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        kv_capacity_tokens: dict[str, int] | None = None,
        slots: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.kv_capacity = kv_capacity_tokens or {}
        self.slots = slots
        self.clock = clock
        self.workers = {name: WorkerReconcile(url) for name, url in targets.items()}
        self._scraper = MetricsScraper(timeout_s=timeout_s, transport=transport)
        self.scrapes = 0

    @property
    def scrape_rejected(self) -> dict[str, int]:
        """Worker pages refused, by reason (the scraper's bounds)."""
        return self._scraper.rejected

    async def aclose(self) -> None:
        await self._scraper.aclose()

    async def scrape_once(self) -> None:
        """Scrape every target concurrently and update drift; never raises."""
        results = await self._scraper.scrape_all({n: w.url for n, w in self.workers.items()})
        for name, result in results.items():
            self._apply(name, self.workers[name], result)
        self.scrapes += 1

    def _apply(self, name: str, w: WorkerReconcile, load: VllmLoad | Exception) -> None:
        if isinstance(load, Exception):  # network, HTTP status, parse: all counted, none raised
            w.errors += 1
            w.last_error = type(load).__name__
            if isinstance(load, GONE):  # see module docstring
                w.drift_requests = float(max(self.state.active(name), self.slots or 0))
            return
        now = self.clock()
        w.load = load
        w.last_ok = now
        w.last_error = None
        if load.running is not None:
            remote = load.running + (load.waiting or 0.0)
            w.drift_requests = self.state.active(name) - remote
        cap = self.kv_capacity.get(name)
        wc = self.state.workers.get(name)
        if cap and load.kv_usage is not None and wc is not None:
            w.drift_kv_ratio = wc.kv_tokens / cap - load.kv_usage

    async def run(self) -> None:
        """Scrape forever every interval (cancel to stop)."""
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {name: w.as_dict(now) for name, w in self.workers.items()}
