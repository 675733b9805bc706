"""Reconciliation of the mirrored state against each worker's own Prometheus `/metrics`.

`parse_vllm_metrics(text)` reads `vllm:num_requests_running`, `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` (or the deprecated `vllm:gpu_cache_usage_perc`), summed over DP engines
(KV usage averaged). `Reconciler` scrapes every target each interval with one httpx client (its
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
from prometheus_client.parser import text_string_to_metric_families

from shadow.mirror.state import MirrorState

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
#: Scrape failures meaning nothing listens at the worker (a dead or unreachable rank).
GONE = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(slots=True)
class VllmLoad:
    """What one scrape said (None = metric absent)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None


def parse_vllm_metrics(text: str) -> VllmLoad:
    """Parse Prometheus text exposition; raises ValueError on unparsable text."""
    running: float | None = None
    waiting: float | None = None
    kv_new: list[float] = []
    kv_old: list[float] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == RUNNING:
                running = (running or 0.0) + s.value
            elif s.name == WAITING:
                waiting = (waiting or 0.0) + s.value
            elif s.name == KV_USAGE[0]:
                kv_new.append(s.value)
            elif s.name == KV_USAGE[1]:
                kv_old.append(s.value)
    kv = kv_new or kv_old
    return VllmLoad(running, waiting, sum(kv) / len(kv) if kv else None)


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
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout_s, trust_env=False)
        self.scrapes = 0

    async def aclose(self) -> None:
        await self._client.aclose()

    async def scrape_once(self) -> None:
        """Scrape every target concurrently and update drift; never raises."""
        await asyncio.gather(*(self._scrape(n, w) for n, w in self.workers.items()))
        self.scrapes += 1

    async def _scrape(self, name: str, w: WorkerReconcile) -> None:
        try:
            resp = await self._client.get(w.url)
            resp.raise_for_status()
            load = parse_vllm_metrics(resp.text)
        except Exception as exc:  # network, HTTP status, parse: all counted, none raised
            w.errors += 1
            w.last_error = type(exc).__name__
            if isinstance(exc, GONE):  # see module docstring
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
