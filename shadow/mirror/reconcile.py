"""Reconciliation of the mirrored state against each worker's own Prometheus `/metrics`.

`Reconciler` scrapes every target each interval (`shadow.vllm.metrics.MetricsScraper`; its
transport is swappable for tests) and keeps, per worker, the remote figures, the drift
(mirrored active − remote running − remote waiting − draining), the time of the last good scrape and
an error count; `shadow.mirror.metrics` exports them. A target `URL#engine=N` is one DP engine of a
server's page (its `engine` label); one page serving several workers is scraped once per round.

A worker's page tells its state at one instant between the round's request and its answer; the
mirror moves meanwhile. A round's drift is therefore taken against the mirror over that span: from
when the round sent its scrapes to when the analysis has taken in what the taps had seen when they
returned (`settle`, up to min(1 s, the interval)). The state keeps each worker's least and most
active count since the round opened (`MirrorState.open_window`), and the drift is 0 when the page
matches the mirror at some point of the span, else the gap to the nearest. Under load a burst of
starts the analysis had not reached yet, or of ends the page had not counted yet, read -17..-22
on a canary's first round and tripped fallback; neither is a request one side has and the other
never had. A round that could not wait so long is counted (`unsettled`) and its drift taken as it is.

Draining: a stream the engine has finished may still be on its way to a slow client, so the mirror
(which ends it when the tap sees its end) counts it a while longer. The engine's finished-request
counter (`vllm:request_success_total`) minus the requests the mirror ended there, both counted from
the last scrape at which neither side had anything running (or the first), is that number; it is
reported and left out of the drift, so a drift is a request one side has and the other never had.

A worker whose /metrics refuses connections (or cannot be connected to in time) is gone: it runs
nothing and takes nothing, while the mirror still counts its slots, running or free. Its drift is
then what the mirror counts there: its slots (`slots`), or its mirrored requests when more or when
slots are unknown. A drift frozen at the last good scrape would show a dead rank as in step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from shadow.mirror.state import MirrorState, WorkerCounts
from shadow.vllm.metrics import GONE, MetricsScraper, VllmLoad


def split_target(target: str) -> tuple[str, str | None]:
    """`URL#engine=N` → (URL, "N"); a URL without the fragment → (URL, None)."""
    url, sep, frag = target.partition("#")
    if not sep:
        return url, None
    key, eq, value = frag.partition("=")
    if key != "engine" or not eq or not value:
        raise ValueError(f"metrics target {target!r}: the only fragment understood is #engine=N")
    return url, value


@dataclass(slots=True)
class WorkerReconcile:
    """Reconciliation status of one worker."""

    url: str
    load: VllmLoad | None = None
    last_ok: float | None = None  # clock time of the last good scrape
    errors: int = 0
    last_error: str | None = None
    engine: str | None = None  # the DP engine of the page this worker is (None: the whole page)
    drift_requests: float | None = None
    drift_kv_ratio: float | None = None
    draining: float | None = None  # finished by the engine, not yet ended in the mirror
    done_base: float | None = None  # engine-finished − mirror-ended at the last quiet scrape
    kv_capacity_tokens: float | None = None

    #: The drift figures, as /v1/state names them.
    DRIFT: ClassVar[tuple[str, ...]] = ("drift_requests", "drift_kv_ratio", "draining", "kv_capacity_tokens")

    def as_dict(self, now: float) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.url, "errors": self.errors, "last_error": self.last_error,
                             "age_s": None if self.last_ok is None else round(now - self.last_ok, 3)}
        d.update((k, getattr(self, k)) for k in self.DRIFT)
        if self.engine is not None:
            d["engine"] = self.engine
        if self.load is not None:
            d.update(running=self.load.running, waiting=self.load.waiting, kv_usage=self.load.kv_usage)
            if self.load.engines:  # a DP server's page: each engine's own figures
                d["engines"] = {k: {"running": e.running, "waiting": e.waiting, "kv_usage": e.kv_usage,
                                    "finished": e.finished} for k, e in self.load.engines.items()}
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
        settle: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.state = state
        # awaited between a round's scrapes and its drift: the mirror takes in what the taps had seen
        # by then (a burst of starts the analysis has not reached yet is not a drift); False (timed
        # out: the analysis is that far behind) is counted in `unsettled` and the drift taken as it is
        self.settle = settle
        self.unsettled = 0
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.kv_capacity = kv_capacity_tokens or {}
        self.slots = slots
        self.clock = clock
        self.workers: dict[str, WorkerReconcile] = {}
        for name, target in targets.items():
            url, engine = split_target(target)
            self.workers[name] = WorkerReconcile(url, engine=engine)
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
        self.state.open_window()
        opened = {name: wc.routed for name, wc in self.state.workers.items()}
        pages = await self._scraper.scrape_all({w.url: w.url for w in self.workers.values()})
        if self.settle is not None:
            try:
                settled = await self.settle()
            except Exception:  # (the analysis' channel broke meanwhile): counted, the drift taken as it is
                settled = False
            if not settled:
                self.unsettled += 1
        for name, w in self.workers.items():
            result = pages[w.url]
            if w.engine is not None and isinstance(result, VllmLoad):
                engine = result.engine(w.engine)
                result = engine if engine is not None else KeyError(f"no engine {w.engine} on the page")
            self._apply(name, w, result, opened.get(name))
        self.scrapes += 1

    def _apply(self, name: str, w: WorkerReconcile, load: VllmLoad | Exception, opened: int | None) -> None:
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
        wc = self.state.workers.get(name)
        if load.running is not None:
            remote = load.running + (load.waiting or 0.0)
            active = self.state.active(name)
            w.draining = self._draining(w, load, wc, quiet=active == 0 and remote == 0)
            w.drift_requests = self._drift(w, load, remote, wc, opened)
        w.kv_capacity_tokens = self.kv_capacity.get(name) or load.kv_capacity_tokens
        cap = w.kv_capacity_tokens
        if cap and load.kv_usage is not None and wc is not None:
            w.drift_kv_ratio = wc.kv_tokens / cap - load.kv_usage

    @staticmethod
    def _drift(w: WorkerReconcile, load: VllmLoad, remote: float, wc: WorkerCounts | None,
               opened: int | None) -> float:
        """Mirrored − reported requests, 0 when the page matches the mirror somewhere in the round's
        span (module docstring). At one instant the drift is min(A − R, C − (R + F − base)): A the
        mirror's active, C its routed-so-far (active + ended), R the page's running + waiting, F its
        finished, base the draining base; A ranges over [low, high] and C over its values at the
        round's ends, so the drift over the span lies between the two bounds below."""
        if wc is None:
            return -remote
        lo, hi = wc.low - remote, wc.high - remote
        if w.draining is not None and w.done_base is not None and load.finished is not None:
            x = remote + load.finished - w.done_base
            c0 = wc.routed if opened is None else opened
            lo = min(lo, min(c0, wc.routed) - x)
            hi = min(hi, max(c0, wc.routed) - x)
        return lo if lo > 0 else hi if hi < 0 else 0.0

    @staticmethod
    def _draining(w: WorkerReconcile, load: VllmLoad, wc: WorkerCounts | None, quiet: bool) -> float | None:
        """Requests the engine finished that the mirror has not ended yet (see module docstring)."""
        if load.finished is None or wc is None:
            return None
        ended = wc.ended
        if w.done_base is None or quiet:
            w.done_base = load.finished - ended
        return max(0.0, load.finished - w.done_base - ended)

    async def run(self) -> None:
        """Scrape forever every interval (cancel to stop)."""
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {name: w.as_dict(now) for name, w in self.workers.items()}
