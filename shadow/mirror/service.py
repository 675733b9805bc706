"""Assembly of a running mirror: taps + analysis + state + reconciliation + event API, in one loop.

`TapService(config)`: `await start()` binds everything and returns the ready document
`{"taps": {name: url}, "api": url}`; `await stop()` ends it. Everything is created per instance
(own CollectorRegistry, own state); nothing global. Used by `shadow tap` and by tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry

from shadow.mirror.analyzer import Analyzer
from shadow.mirror.api import create_app
from shadow.mirror.dropqueue import DropQueue
from shadow.mirror.emitter import Emitter
from shadow.mirror.hub import Mirror, Recorder
from shadow.mirror.metrics import MirrorCollector
from shadow.mirror.proxy import Tap, TapContext
from shadow.mirror.reconcile import Reconciler
from shadow.mirror.state import MirrorState


@dataclass
class TapConfig:
    """What `shadow tap` is told. Upstreams are {name: base URL}; prefill ones get taps too.

    Front mode: `front` taps sit in front of routers ({name: router URL}); `workers` names the
    decode workers behind them ({name: URL}, no tap) so that decisions read from the router's
    responses map to names, and so that their /metrics are reconciled.
    """

    upstreams: dict[str, str]
    prefill: dict[str, str] = field(default_factory=dict)
    front: dict[str, str] = field(default_factory=dict)
    workers: dict[str, str] = field(default_factory=dict)
    metrics_of: dict[str, str] = field(default_factory=dict)  # default: <upstream>/metrics
    host: str = "127.0.0.1"
    port: int = 0  # API port; taps on port+1.. when non-zero, else ephemeral
    record: str | None = None
    max_body: int = 4 << 20
    queue_size: int = 65536
    slots: int | None = None
    ttl_s: float = 300.0
    phantom_age_s: float = 120.0
    scrape_interval_s: float = 5.0  # 0 disables reconciliation
    tick_s: float = 0.25
    forward_to: str | None = None  # post every event to another shadow's /v1/events
    hook: Callable[[TapContext, bytes], None] | None = None  # tests: analysis fault injection
    pace_s: float = 0.0  # tests: slow analysis consumer
    inject_usage: bool = False  # ask workers for continuous usage; strip what the client did not ask for
    events_token: str | None = None  # bearer token for POST /v1/events (required off loopback)


def _host_port(url: str) -> str:
    """ "http://h:p/..." → "h:p" (how vllm-router names workers in its request ids)."""
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0]


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class TapService:
    """See module docstring."""

    def __init__(self, config: TapConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        c = config
        names = [*c.upstreams, *c.prefill, *c.front, *c.workers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"names used twice: {sorted(dup)}")
        if not c.upstreams and not c.front:
            raise ValueError("nothing to mirror: give upstream workers to tap, or a router to front")
        self.config = c
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        self.queue = DropQueue(c.queue_size)
        decode_workers = {**c.upstreams, **c.workers}
        self.state = MirrorState(decode_workers, slots=c.slots, ttl_s=c.ttl_s, phantom_age_s=c.phantom_age_s)
        self.recorder = Recorder(c.record) if c.record else None
        self.mirror = Mirror(self.state, recorder=self.recorder)
        self.analyzer = Analyzer(
            self.mirror,
            prefill_taps=c.prefill,
            max_body=c.max_body,
            hook=c.hook,
            clock=clock,
            front_taps=c.front,
            worker_by_addr={_host_port(u): n for n, u in decode_workers.items()},
        )
        self.taps = [
            Tap(n, u, self.queue, max_body=c.max_body, inject_usage=c.inject_usage)
            for n, u in {**c.upstreams, **c.prefill, **c.front}.items()
        ]
        targets = {n: c.metrics_of.get(n, u.rstrip("/") + "/metrics") for n, u in decode_workers.items()}
        self.reconciler = (
            Reconciler(targets, self.state, interval_s=c.scrape_interval_s, clock=clock)
            if c.scrape_interval_s > 0
            else None
        )
        self.emitter = Emitter(c.forward_to) if c.forward_to else None
        if self.emitter is not None:
            self.mirror.listeners.append(self.emitter)
        self.rejected: dict[str, int] = {}
        self.registry.register(
            MirrorCollector(
                self.mirror,
                analyzer=self.analyzer,
                queue=self.queue,
                taps=self.taps,
                reconciler=self.reconciler,
                rejected=self.rejected,
                clock=clock,
            )
        )
        self.app = create_app(
            self.mirror,
            self.registry,
            rejected=self.rejected,
            extra_state=self._extra_state,
            clock=clock,
            host=c.host,
            ingest_token=c.events_token,
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: uvicorn.Server | None = None
        self.api_url = ""

    def _extra_state(self, now: float) -> dict[str, Any]:
        inflight = self.analyzer.inflight
        out: dict[str, Any] = {
            "taps": {
                t.name: {
                    "url": t.url,
                    "upstream": t.upstream,
                    "inflight": inflight.get(t.name, 0),
                    "role": "prefill"
                    if t.name in self.config.prefill
                    else ("front" if t.name in self.config.front else "decode"),
                }
                for t in self.taps
            },
            "queue": {
                "depth": len(self.queue),
                "capacity": self.queue.maxsize,
                "dropped": self.queue.dropped,
            },
            "errors": dict(self.mirror.errors),
            "dropped": dict(self.mirror.dropped),
        }
        if self.reconciler is not None:
            rec = self.reconciler.snapshot(now)
            out["reconcile"] = rec
            for name, r in rec.items():
                w = out.setdefault("drift", {})
                w[name] = r["drift_requests"]
        return out

    async def start(self) -> dict[str, Any]:
        c = self.config
        api_sock = _bind(c.host, c.port)
        taps: dict[str, str] = {}
        for i, tap in enumerate(self.taps):
            taps[tap.name] = await tap.start(c.host, c.port + 1 + i if c.port else 0)
        self._tasks.append(asyncio.create_task(self.analyzer.run(self.queue, pace=c.pace_s)))
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        if self.reconciler is not None:
            self._tasks.append(asyncio.create_task(self.reconciler.run()))
        if self.emitter is not None:
            self.emitter.start()
        cfg = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(cfg)
        self._tasks.append(asyncio.create_task(self._server.serve(sockets=[api_sock])))
        while not self._server.started:
            await asyncio.sleep(0.005)
        h, p = api_sock.getsockname()[:2]
        self.api_url = f"http://{h}:{p}"
        return {"taps": taps, "api": self.api_url}

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                now = self.clock()
                self.mirror.reap(now)
                self.analyzer.tick(now)
                if self.recorder is not None:
                    self.recorder.flush()
            except Exception:
                self.mirror.count_error("housekeeping")

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until the analysis queue is empty (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while len(self.queue) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.005)

    async def stop(self) -> None:
        for tap in self.taps:
            with contextlib.suppress(Exception):
                await tap.close()
        with contextlib.suppress(Exception):
            await self.drain(1.0)
        if self._server is not None:
            self._server.should_exit = True
        for t in self._tasks:
            if t.get_coro().__qualname__.startswith("Server.serve"):  # type: ignore[union-attr]
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(t, 5)
            else:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        self._tasks.clear()
        if self.reconciler is not None:
            await self.reconciler.aclose()
        if self.emitter is not None:
            await self.emitter.aclose()
        if self.recorder is not None:
            self.recorder.close()
