"""`ServeService`: the mirror of `shadow tap` plus live lanes, on one API listener.

    svc = ServeService(ServeConfig(tap=TapConfig(upstreams={...}, slots=64)))
    ready = await svc.start()      # {"taps": {name: url}, "api": url}
    ...                            # GET {api}/v1/report, {api}/metrics
    await svc.stop()

The tap side is `shadow.mirror.service.TapService`, unchanged; the lanes (`LiveLanes`) listen to
its mirror through a bounded queue and run on their own thread. `GET /v1/report` serves the
latest snapshot; `GET /v1/report?drain=1` first processes everything received and runs the lanes
as far as known ends allow (use it for the final report of a session).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Query
from fastapi.responses import JSONResponse, Response

from shadow.active.control import ModeControl
from shadow.active.ledger import MirrorSource
from shadow.active.modes import ModeConfig
from shadow.active.proxy import ActiveConfig, ActiveProxy
from shadow.active.server import AppServer
from shadow.contracts.modes import ModeSource, StaticModeSource
from shadow.core.params import BRParams
from shadow.core.routers import Router
from shadow.core.stepmodel import DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S, StepTimeModel
from shadow.engine.config import LaneSpec
from shadow.live.lanes import DEFAULT_POLICIES, LiveLanes
from shadow.live.metrics import LiveCollector
from shadow.live.stepfit import SOURCES
from shadow.mirror.service import TapConfig, TapService
from shadow.telemetry.tracing import RoutingSpans


def check_policies(policies: tuple[str, ...]) -> tuple[str, ...]:
    """Validate live lane policies (ValueError with a one-line reason)."""
    if not policies:
        raise ValueError("no policies given")
    labels = []
    for p in policies:
        spec = LaneSpec.parse(p)
        if spec.policy == "forced":
            raise ValueError("'forced' is not a policy: the router's real placements are the lane 'actual'")
        if spec.predictor == "oracle":
            raise ValueError("brh:oracle needs true output lengths up front: offline only (shadow replay)")
        labels.append(spec.label)
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise ValueError(f"policy given twice: {sorted(dup)}")
    return policies


@dataclass
class ActiveSettings:
    """`shadow serve --active`: the proxy's listener and knobs (legs go to the taps)."""

    host: str = "127.0.0.1"
    port: int = 0
    policy: str = "br0"
    transfer_cap: int = 8
    dispatch_ahead: int = 0
    pool_ttl_s: float = 60.0
    bypass: bool = False
    kv_pause: float = 0.9
    kv_resume: float = 0.8
    kv_poll_s: float = 1.0
    retries: int = 3
    tick_s: float = 0.05
    router_factory: Callable[[str], Router] | None = None  # tests: the decode router per policy


@dataclass
class ServeConfig:
    """What `shadow serve` is told: the tap configuration plus the live lanes'."""

    tap: TapConfig
    policies: tuple[str, ...] = DEFAULT_POLICIES
    lag_s: float = 2.0
    step_source: str = "auto"
    step_a: float = DEFAULT_A_S_PER_TOKEN
    step_b: float = DEFAULT_B_S
    live_queue_size: int = 200_000
    step_window_s: float = 0.5
    br: BRParams = field(default_factory=BRParams)
    mode_config: ModeConfig | None = None  # the mode controller (active routing); None: none
    active: ActiveSettings | None = None  # --active: the front listener is shadow's own proxy

    def validate(self) -> None:
        check_policies(self.policies)
        if self.tap.slots is None or self.tap.slots < 1:
            raise ValueError(
                "give the decode slots per worker (--slots B): the lanes simulate B slots per worker"
            )
        if not 0 <= self.lag_s <= 3600:
            raise ValueError(f"--lag must be in [0, 3600] s, got {self.lag_s}")
        if self.step_source not in SOURCES:
            raise ValueError(f"--step-source must be one of {', '.join(SOURCES)}, got {self.step_source!r}")
        if self.live_queue_size < 1:
            raise ValueError(f"--live-queue-size must be >= 1, got {self.live_queue_size}")
        if not self.step_window_s > 0:
            raise ValueError(f"--step-window must be > 0 s, got {self.step_window_s}")
        StepTimeModel(self.step_a, self.step_b)


class ServeService:
    """See module docstring."""

    def __init__(self, config: ServeConfig) -> None:
        config.validate()
        self.config = config
        self.tap = TapService(config.tap)
        workers = [*config.tap.upstreams, *config.tap.workers]
        assert config.tap.slots is not None
        self.live = LiveLanes(
            workers=workers,
            slots=config.tap.slots,
            policies=config.policies,
            lag_s=config.lag_s,
            step=StepTimeModel(config.step_a, config.step_b),
            step_source=config.step_source,
            br=config.br,
            queue_size=config.live_queue_size,
            window_s=config.step_window_s,
            clock=self.tap.clock,
        )
        self.tap.mirror.listeners.append(self.live.listener)
        self.tap.registry.register(LiveCollector(self.live))
        self.tap.app.add_api_route("/v1/report", self._report, methods=["GET"])
        self.mode_control = self._mode_control(config)
        # the mode source the active proxy asks per request: the mode controller when there is one
        self.modes: ModeSource = (
            self.mode_control.controller
            if self.mode_control is not None
            else StaticModeSource("active", config.active.policy if config.active is not None else "br0")
        )
        self.proxy: ActiveProxy | None = None
        self._proxy_server: AppServer | None = None
        self.spans: RoutingSpans | None = None  # the proxy's round/admission spans (trace_serve)

    def _mode_control(self, config: ServeConfig) -> ModeControl | None:
        """The mode controller, its health poll, flag file, admin API and metrics (issue 10)."""
        if config.mode_config is None:
            return None
        return ModeControl(config.mode_config, self.tap, self.live, br=config.br)

    async def _report(self, drain: bool = Query(False)) -> Response:
        if drain:
            await self.tap.drain()
            await asyncio.to_thread(self.live.drain)
        report = self.live.report()
        if self.mode_control is not None:
            report = {**report, "mode": self.mode_control.report()}
        return JSONResponse(report)

    async def start(self) -> dict[str, Any]:
        ready = await self.tap.start()
        self.live.start()
        if self.mode_control is not None:
            self.mode_control.start()
        if self.config.active is not None:
            ready["active"] = await self._start_active(ready["taps"])
        return ready

    def _active_config(self, taps: dict[str, str]) -> ActiveConfig:
        """Legs go to the taps (so mirroring goes on); shadow mode goes to the front tap."""
        a, t = self.config.active, self.config.tap
        assert a is not None and t.slots is not None
        front = next(iter(t.front), None)
        decode = {n: taps[n] for n in t.upstreams} or dict(t.workers)
        return ActiveConfig(
            decode=decode,
            slots=t.slots,
            prefill={n: taps[n] for n in t.prefill},
            prefill_metrics={n: u.rstrip("/") + "/metrics" for n, u in t.prefill.items()},
            router_url=taps[front] if front is not None else None,
            transfer_cap=a.transfer_cap,
            dispatch_ahead=a.dispatch_ahead,
            pool_ttl_s=a.pool_ttl_s,
            tick_s=a.tick_s,
            bypass=a.bypass,
            br=self.config.br,
            kv_pause=a.kv_pause,
            kv_resume=a.kv_resume,
            kv_poll_s=a.kv_poll_s,
            retries=a.retries,
            max_body_bytes=t.max_body,
        )

    async def _start_active(self, taps: dict[str, str]) -> str:
        a = self.config.active
        assert a is not None
        cfg = self._active_config(taps)
        source = MirrorSource(self.tap.state, list(cfg.decode))
        self.proxy = ActiveProxy(cfg, modes=self.modes, source=source, registry=self.tap.registry,
                                 clock=self.tap.clock, router_factory=a.router_factory)
        if self.spans is not None:
            self.proxy.dispatcher.spans = self.spans
        self._proxy_server = AppServer(self.proxy.app, a.host, a.port)
        return await self._proxy_server.start()

    async def stop(self) -> None:
        if self._proxy_server is not None:
            await self._proxy_server.stop()
        if self.mode_control is not None:
            await self.mode_control.stop()
        await self.tap.stop()
        await asyncio.to_thread(self.live.stop)
