"""Prefill server choice: least outstanding work (the vllm-ascend proxy's score, 0.3 × the sum of
0.0345 · body bytes / 4 + 120.0745 over requests in flight; ties to the first registered), or
round-robin (`rule="rr"`, vLLM's toy proxy), among prefillers not paused by KV back-pressure. A
prefiller pauses while its `vllm:kv_cache_usage_perc` (scraped from its /metrics by `KvPoller`) is
at or above `pause_at` and resumes below `resume_at` (hysteresis); when every prefiller is paused,
`acquire` waits (counted) until one resumes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shadow.active.metrics import ActiveMetrics
from shadow.base.runtime import cancel_task
from shadow.vllm.metrics import MetricsScraper

log = logging.getLogger("shadow.active")

PREFILL_SCORE_PER_TOKEN = 0.0345  # vllm-ascend proxy: prefill cost per (body bytes / 4)
PREFILL_SCORE_BASE = 120.0745  # ... plus a fixed cost per request
PREFILL_PRIORITY_WEIGHT = 0.3  # prefill priority = 0.3 × outstanding prefill score


def prefill_score(body_bytes: int) -> float:
    """The vllm-ascend proxy's prefill cost estimate for a body of `body_bytes` bytes."""
    return PREFILL_SCORE_PER_TOKEN * (body_bytes / 4) + PREFILL_SCORE_BASE


@dataclass
class Prefiller:
    name: str
    url: str
    ordinal: int
    outstanding: float = 0.0
    requests: int = 0
    kv_usage: float | None = None
    paused: bool = False
    down: bool = False  # last attempt failed: tried last until it answers again
    picked: int = 0  # prefill legs sent to it (all time)


class PrefillChooser:
    """See module docstring. Loop-local; `update_kv` is called by the poller."""

    def __init__(
        self,
        prefillers: dict[str, str],
        metrics: ActiveMetrics,
        *,
        pause_at: float = 0.9,
        resume_at: float = 0.8,
        rule: str = "least",
    ) -> None:
        if not 0 < resume_at <= pause_at <= 1:
            raise ValueError(f"need 0 < resume ({resume_at}) <= pause ({pause_at}) <= 1")
        if rule not in ("least", "rr"):
            raise ValueError(f"prefill rule must be 'least' or 'rr', got {rule!r}")
        self.rule = rule
        self._next = 0  # round-robin position
        self.prefillers = [Prefiller(n, u.rstrip("/"), i) for i, (n, u) in enumerate(prefillers.items())]
        self.metrics = metrics
        self.pause_at = pause_at
        self.resume_at = resume_at
        self._changed = asyncio.Event()

    def __bool__(self) -> bool:
        return bool(self.prefillers)

    def update_kv(self, name: str, usage: float | None) -> None:
        for p in self.prefillers:
            if p.name == name:
                p.kv_usage = usage
                was = p.paused
                if usage is None:
                    p.paused = False
                elif p.paused:
                    p.paused = usage >= self.resume_at
                else:
                    p.paused = usage >= self.pause_at
                if was and not p.paused:
                    self._changed.set()

    def pick(self, exclude: Sequence[str] = ()) -> Prefiller | None:
        """Least outstanding work (or the next in turn) among admissible prefillers (None: all paused)."""
        cands = [p for p in self.prefillers if not p.paused and p.name not in exclude]
        if not cands:
            return None
        if self.rule == "rr":
            n = len(self.prefillers)
            p = min(cands, key=lambda p: (p.ordinal - self._next) % n)
            self._next = (p.ordinal + 1) % n
            return p
        return min(cands, key=lambda p: (p.down, PREFILL_PRIORITY_WEIGHT * p.outstanding, p.ordinal))

    async def acquire(self, score: float, exclude: Sequence[str] = (), timeout_s: float = 60.0) -> Prefiller:
        """Reserve `score` on the best prefiller, waiting while all are paused (TimeoutError)."""
        p = self.pick(exclude)
        if p is None:
            self.metrics.backpressure.labels("prefill_kv").inc()
            async with asyncio.timeout(timeout_s):
                while p is None:
                    self._changed.clear()
                    await self._changed.wait()
                    p = self.pick(exclude)
        p.outstanding += score
        p.requests += 1
        p.picked += 1
        self.metrics.inflight.labels("prefill", p.name).set(p.requests)
        return p

    def release(self, p: Prefiller, score: float) -> None:
        p.requests -= 1
        p.outstanding = 0.0 if p.requests <= 0 else max(0.0, p.outstanding - score)
        self.metrics.inflight.labels("prefill", p.name).set(p.requests)


class KvPoller:
    """Scrapes each prefiller's /metrics every `interval_s` and feeds `on_usage(name, usage)`."""

    def __init__(
        self,
        targets: dict[str, str],
        on_usage: Callable[[str, float | None], None],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.targets = targets
        self.on_usage = on_usage
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.scrapes = 0
        self.errors = 0
        self._task: asyncio.Task[None] | None = None
        self._scraper: MetricsScraper | None = None

    def start(self) -> None:
        if self._task is None and self.targets:
            self._scraper = MetricsScraper(timeout_s=self.timeout_s)
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_task(self._task)
        self._task = None
        if self._scraper is not None:
            await self._scraper.aclose()
            self._scraper = None

    async def scrape_once(self) -> None:
        assert self._scraper is not None
        for name, load in (await self._scraper.scrape_all(self.targets)).items():
            if isinstance(load, Exception):  # unreachable or unparsable: no back-pressure signal from it
                self.errors += 1
                log.debug("prefill metrics %s: %s", name, load)
                continue
            self.on_usage(name, load.kv_usage)
        self.scrapes += 1

    async def _run(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)
