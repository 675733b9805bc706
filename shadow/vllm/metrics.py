"""vLLM's Prometheus `/metrics`: the load series shadow reads, and one scraper for every caller.

`parse_vllm_metrics(text)` reads `vllm:num_requests_running`, `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` (or the deprecated `vllm:gpu_cache_usage_perc`), summed over DP engines
(KV usage averaged). `MetricsScraper` fetches and parses pages with one httpx client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

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


class MetricsScraper:
    """Scrapes vLLM `/metrics` URLs with one client (no proxy settings taken from the environment).

    `scrape(url)` returns the parsed load or raises (network, HTTP status, parse);
    `scrape_all({name: url})` scrapes concurrently and gives each name its load or its error.
    """

    def __init__(self, *, timeout_s: float = 2.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout_s, trust_env=False)

    async def scrape(self, url: str) -> VllmLoad:
        resp = await self._client.get(url)
        resp.raise_for_status()
        return parse_vllm_metrics(resp.text)

    async def scrape_all(self, targets: Mapping[str, str]) -> dict[str, VllmLoad | Exception]:
        """Every target at once; the result is in the targets' order. Never raises."""

        async def one(url: str) -> VllmLoad | Exception:
            try:
                return await self.scrape(url)
            except Exception as exc:  # network, HTTP status, parse: handed to the caller
                return exc

        results = await asyncio.gather(*(one(url) for url in targets.values()))
        return dict(zip(targets, results, strict=True))

    async def aclose(self) -> None:
        await self._client.aclose()
