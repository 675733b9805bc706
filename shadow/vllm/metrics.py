"""vLLM's Prometheus `/metrics`: the load series shadow reads, and one scraper for every caller.

`parse_vllm_metrics(text)` reads `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` (or the deprecated `vllm:gpu_cache_usage_perc`), the requests the engine
finished (`vllm:request_success_total`, every reason) and its KV capacity (`vllm:cache_config_info`),
per DP engine (the `engine` label) and summed over them (KV usage averaged weighted by capacity where
known); a non-finite or negative value is refused. `MetricsScraper` fetches pages with
one httpx client, each scrape bounded in bytes and in total time, and counts what it refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
FINISHED = "vllm:request_success"  # the counter's family name (samples end in _total)
CACHE_CONFIG = "vllm:cache_config_info"
_READ = (RUNNING, WAITING, *KV_USAGE, FINISHED, CACHE_CONFIG)
_TYPE_LINES = tuple(f"# TYPE {n} " for n in _READ)
#: Scrape failures meaning nothing listens at the worker (a dead or unreachable rank).
GONE = (httpx.ConnectError, httpx.ConnectTimeout)
DEFAULT_MAX_BYTES = 4 << 20  # a real vLLM page is 10-200 KB (histograms per engine)
#: Reasons a scrape is refused (`MetricsScraper.rejected`), beside network and HTTP errors.
REJECT_REASONS = ("too_large", "timeout", "encoded", "non_finite", "unparsable")


class ScrapeRejected(ValueError):
    """A page shadow will not use; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NonFiniteValue(ScrapeRejected):
    """A load series read NaN, ±Inf or a negative number."""

    def __init__(self, name: str, value: float) -> None:
        super().__init__("non_finite", f"{name} is {value!r}")


class PageTooLarge(ScrapeRejected):
    def __init__(self, limit: int) -> None:
        super().__init__("too_large", f"/metrics page over {limit} bytes")


class ScrapeTimeout(ScrapeRejected):
    def __init__(self, seconds: float) -> None:
        super().__init__("timeout", f"/metrics scrape took over {seconds:g} s")


@dataclass(slots=True)
class VllmLoad:
    """What one scrape said, for the whole server or one engine (None = metric absent).
    `engines` holds each DP engine's own figures by its `engine` label (empty without the label)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    finished: float | None = None  # requests the engine finished (vllm:request_success_total)
    kv_capacity_tokens: float | None = None  # vllm:cache_config_info's kv_cache_size_tokens
    engines: dict[str, VllmLoad] = field(default_factory=dict)

    def engine(self, label: str) -> VllmLoad | None:
        """One engine's figures (None when the page has no such engine)."""
        return self.engines.get(label)


def _checked(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise NonFiniteValue(name, value)
    return value


def _capacity(labels: Mapping[str, str]) -> float | None:
    """KV tokens of one engine from cache_config_info's labels (kv_cache_size_tokens, else blocks ×
    block size); None when neither is a number."""
    with contextlib.suppress(KeyError, ValueError):
        return _checked(CACHE_CONFIG, float(labels["kv_cache_size_tokens"]))
    with contextlib.suppress(KeyError, ValueError):
        return _checked(CACHE_CONFIG, float(labels["num_gpu_blocks"]) * float(labels["block_size"]))
    return None


def _add(a: float | None, b: float) -> float:
    return b if a is None else a + b


def parse_vllm_metrics(text: str) -> VllmLoad:
    """Parse Prometheus text exposition (only the series read here; a sample line starts with its
    name); raises ValueError on unparsable text, `NonFiniteValue` on NaN, ±Inf or < 0."""
    kept = "\n".join(ln for ln in text.splitlines() if ln.startswith(_READ) or ln.startswith(_TYPE_LINES))
    engines: dict[str, VllmLoad] = {}
    kv_old: dict[str, float] = {}
    for fam in text_string_to_metric_families(kept + "\n" if kept else ""):
        for s in fam.samples:
            e = engines.setdefault(s.labels.get("engine", ""), VllmLoad())
            if s.name == RUNNING:
                e.running = _add(e.running, _checked(s.name, s.value))
            elif s.name == WAITING:
                e.waiting = _add(e.waiting, _checked(s.name, s.value))
            elif s.name == KV_USAGE[0]:
                e.kv_usage = _checked(s.name, s.value)
            elif s.name == KV_USAGE[1]:
                kv_old[s.labels.get("engine", "")] = _checked(s.name, s.value)
            elif s.name == FINISHED + "_total":
                e.finished = _add(e.finished, _checked(s.name, s.value))
            elif s.name == CACHE_CONFIG:
                e.kv_capacity_tokens = _capacity(s.labels)
    for label, kv in kv_old.items():
        if engines[label].kv_usage is None:
            engines[label].kv_usage = kv
    total = VllmLoad(engines={k: e for k, e in engines.items() if k})
    for e in engines.values():
        if e.running is not None:
            total.running = _add(total.running, e.running)
        if e.waiting is not None:
            total.waiting = _add(total.waiting, e.waiting)
        if e.finished is not None:
            total.finished = _add(total.finished, e.finished)
        if e.kv_capacity_tokens is not None:
            total.kv_capacity_tokens = _add(total.kv_capacity_tokens, e.kv_capacity_tokens)
    usage = [e for e in engines.values() if e.kv_usage is not None]
    if usage:
        caps = [e.kv_capacity_tokens for e in usage]
        if all(c is not None and c > 0 for c in caps):
            used = sum((e.kv_usage or 0.0) * (e.kv_capacity_tokens or 0.0) for e in usage)
            total.kv_usage = used / sum(c or 0.0 for c in caps)
        else:
            total.kv_usage = sum(e.kv_usage or 0.0 for e in usage) / len(usage)
    return total


class MetricsScraper:
    """Scrapes vLLM `/metrics` URLs with one client (no proxy settings taken from the environment).

    `scrape(url)` returns the parsed load or raises (network, HTTP status, `ScrapeRejected`): the
    whole scrape (connect, head, body) must end within `timeout_s`, the body (asked for without
    content coding) within `max_bytes`. `scrape_all({name: url})` scrapes concurrently and gives
    each name its load or its error. `rejected[reason]` counts refused pages.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not timeout_s > 0 or max_bytes < 1:
            raise ValueError("scrape timeout must be > 0 s and the page limit >= 1 byte")
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=timeout_s,
            trust_env=False,
            headers={"accept-encoding": "identity"},
        )

    async def scrape(self, url: str) -> VllmLoad:
        try:
            return await self._scrape(url)
        except ScrapeRejected as exc:
            self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
            raise

    async def _scrape(self, url: str) -> VllmLoad:
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._fetch(url)
        except TimeoutError:
            raise ScrapeTimeout(self.timeout_s) from None
        try:
            text = body.decode("utf-8")
            return parse_vllm_metrics(text)
        except ScrapeRejected:
            raise
        except ValueError as exc:  # (UnicodeDecodeError is one)
            raise ScrapeRejected("unparsable", f"/metrics page unparsable: {exc}") from None

    async def _fetch(self, url: str) -> bytes:
        async with self._client.stream("GET", url) as resp:
            resp.raise_for_status()
            coding = resp.headers.get("content-encoding", "identity").strip().lower()
            if coding not in ("", "identity"):
                raise ScrapeRejected("encoded", f"/metrics answered with content-encoding {coding!r}")
            declared = resp.headers.get("content-length")
            if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
                raise PageTooLarge(self.max_bytes)
            parts: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():  # (identity: the raw bytes)
                size += len(chunk)
                if size > self.max_bytes:
                    raise PageTooLarge(self.max_bytes)
                parts.append(chunk)
            return b"".join(parts)

    async def scrape_all(self, targets: Mapping[str, str]) -> dict[str, VllmLoad | Exception]:
        """Every target at once; the result is in the targets' order. Never raises."""

        async def one(url: str) -> VllmLoad | Exception:
            try:
                return await self.scrape(url)
            except Exception as exc:  # network, HTTP status, refused page: handed to the caller
                return exc

        results = await asyncio.gather(*(one(url) for url in targets.values()))
        return dict(zip(targets, results, strict=True))

    async def aclose(self) -> None:
        await self._client.aclose()
