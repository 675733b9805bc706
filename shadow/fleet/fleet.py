"""Assemble and run a simulated fleet in one event loop: prefill servers, decode ranks on one
shared step clock, the optional all-ranks port, scheduled faults.

    async with Fleet(FleetConfig(prefill=1, decode=2, base_port=0)) as fleet:
        fleet.prefill_urls, fleet.decode_urls
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, TypeVar

from opentelemetry import trace

from shadow.fleet.asgi import quiet_stream_cuts
from shadow.fleet.clock import StepClock
from shadow.fleet.config import FleetConfig
from shadow.fleet.faults import FaultSpec, Target, validate_settings
from shadow.fleet.pd import KvDirectory
from shadow.fleet.server import BaseServer, DecodeServer, DpFrontServer, PrefillServer
from shadow.fleet.tracing import RequestSpans

T = TypeVar("T")


class Fleet:
    """The whole simulated fleet; start with `async with` or `start()`/`stop()`. `tracer`: every
    server makes vLLM's `llm_request` span per finished request with it (None: no spans)."""

    def __init__(self, config: FleetConfig, tracer: trace.Tracer | None = None) -> None:
        self.config = config
        self.spans = RequestSpans(tracer) if tracer is not None else None
        self.directory = KvDirectory()
        self.prefill_servers: list[PrefillServer] = []
        self.decode_servers: list[DecodeServer] = []
        self.dp_server: DpFrontServer | None = None
        self.clock: StepClock | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_at = 0.0

    # -- addresses -------------------------------------------------------------------------------
    @property
    def prefill_urls(self) -> list[str]:
        return [s.url for s in self.prefill_servers]

    @property
    def decode_urls(self) -> list[str]:
        return [s.url for s in self.decode_servers]

    @property
    def dp_url(self) -> str | None:
        return self.dp_server.url if self.dp_server else None

    def servers(self) -> list[BaseServer]:
        out: list[BaseServer] = [*self.prefill_servers, *self.decode_servers]
        if self.dp_server is not None:
            out.append(self.dp_server)
        return out

    def server(self, role: str, index: int) -> BaseServer:
        pool: list[Any] = []
        if role in ("prefill", "decode"):
            pool.extend(self.prefill_servers if role == "prefill" else self.decode_servers)
        if not 0 <= index < len(pool):
            raise KeyError(f"no fleet server {role}/{index}")
        srv: BaseServer = pool[index]
        return srv

    def ready_line(self) -> dict[str, Any]:
        line: dict[str, Any] = {"prefill": self.prefill_urls, "decode": self.decode_urls}
        if self.dp_server is not None:
            line["dp"] = self.dp_url
        return line

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        quiet_stream_cuts()
        loop = asyncio.get_running_loop()

        def poke() -> None:
            if self.clock is not None:
                self.clock.poke()

        kvd, af = self.directory, self.apply_faults
        self.prefill_servers = [
            PrefillServer(i, cfg, cfg.prefill_port(i), kvd, af) for i in range(cfg.prefill)
        ]
        self.decode_servers = [
            DecodeServer(g, cfg, cfg.decode_port(g), kvd, af, poke) for g in range(cfg.decode)
        ]
        self.clock = StepClock(
            [d.engine for d in self.decode_servers],
            cfg.step_model,
            time_scale=cfg.time_scale,
            prefill_c1=cfg.prefill_c1,
            max_behind_s=cfg.catch_up_s,
        )
        for d in self.decode_servers:
            d.clock = self.clock
        if cfg.dp_front:
            self.dp_server = DpFrontServer(
                cfg, cfg.dp_front_port(), self.directory, self.apply_faults, self.decode_servers
            )
        for s in self.servers():
            s.spans = self.spans
        try:
            for s in self.servers():
                await s.listener.start()
        except BaseException:
            await self.stop()
            raise
        for p in self.prefill_servers:
            p.register()
            self._tasks.append(asyncio.create_task(p.engine.run(), name=f"prefill-{p.index}"))
            self._tasks.append(
                asyncio.create_task(p.engine.local_clock.run(), name=f"prefill-{p.index}-local")
            )
        self._tasks.append(asyncio.create_task(self.clock.run(), name="decode-clock"))
        self.started_at = loop.time()
        for spec in cfg.faults:
            self._tasks.append(asyncio.create_task(self._scheduled(spec)))

    async def stop(self) -> None:
        """Stop listening, end in-flight requests, stop the clocks."""
        loop = asyncio.get_running_loop()
        servers = self.servers()
        for s in servers:
            s.reset_engines(loop.time())
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _scheduled(self, spec: FaultSpec) -> None:
        await asyncio.sleep(spec.at_s)
        await self.apply_faults(spec.target, dict(spec.settings))

    # -- faults ----------------------------------------------------------------------------------
    def _targets(self, target: Target) -> list[BaseServer]:
        pool: list[BaseServer] = []
        pool.extend(self.prefill_servers if target.role == "prefill" else self.decode_servers)
        if target.index is None:
            return pool
        return [pool[target.index]] if 0 <= target.index < len(pool) else []

    async def apply_faults(self, target: Target, settings: dict[str, float | int | bool]) -> list[str]:
        """Apply validated settings to the servers named by `target`; return their names."""
        servers = self._targets(target)
        for s in servers:
            await s.apply(settings)
        return [s.name for s in servers]

    async def inject(self, target: str, **settings: Any) -> list[str]:
        """Python API: `await fleet.inject("decode/1", stall_s=2)` (same keys as the CLI/JSON)."""
        return await self.apply_faults(Target.parse(target), validate_settings(settings))

    async def crash(self, role: str, index: int, duration_s: float | None = None) -> None:
        await self.server(role, index).crash(duration_s)

    async def recover(self, role: str, index: int) -> None:
        await self.server(role, index).recover()
