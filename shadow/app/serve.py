"""`shadow serve` in one process: the mirror of `shadow tap` with the live lanes, the mode
controller, the active proxy and tracing, each given what it reads and feeds at construction.

    svc = ServeService(ServeConfig(tap=MirrorConfig(upstreams={...}, slots=64)))
    ready = await svc.start()      # {"taps": {name: url}, "api": url[, "active": url]}
    ...                            # GET {api}/v1/report[?drain=1], {api}/metrics
    await svc.stop()

The lanes listen to the mirror through a bounded queue and run on their own thread; the health
poll, the flag-file watcher and the oracle replay run on the mirror's analysis loop.
`GET /v1/report?drain=1` first processes everything received and runs the lanes as far as known
ends allow (the final report of a session).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer
from prometheus_client.registry import Collector

from shadow.active.control import ModeControl
from shadow.active.etcdlease import EtcdLease
from shadow.active.health import UNREACHABLE, HealthPoll, HealthReader
from shadow.active.leader import LeaderElector
from shadow.active.lease import DEFAULT_CALL_TIMEOUT_S, LeaseConfig
from shadow.active.ledger import MirrorSource
from shadow.active.modes import ModeConfig
from shadow.active.oraclegap import OracleGap
from shadow.active.proxy import ActiveConfig, ActiveProxy
from shadow.app.process import announce, stop_event
from shadow.base.knobs import (
    AT_LEAST_ONE,
    PORT,
    Bound,
    check_knobs,
    knob,
)
from shadow.base.listener import AsgiListener, ListenerLimits
from shadow.base.loopthread import LoopThread
from shadow.base.runtime import ANALYSIS_YOUNG, loop_runner, raise_fd_limit
from shadow.contracts.modes import ModeSource, StaticModeSource
from shadow.contracts.report import report_schema
from shadow.core.cost import RouteCost
from shadow.core.params import BRParams
from shadow.core.routers import Router
from shadow.core.stepmodel import DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S, StepTimeModel
from shadow.engine.config import LaneClock, LaneSpec
from shadow.engine.settings import LaneSettings
from shadow.live.config import LanesConfig
from shadow.live.lanes import DEFAULT_POLICIES, LiveLanes
from shadow.live.metrics import LiveCollector
from shadow.live.shards import ProcessShards, RayShards, ShardedLanes, Shards
from shadow.mirror.config import MirrorConfig
from shadow.mirror.hub import Listener
from shadow.mirror.service import MirrorService
from shadow.replay.sweep_ray import connect, import_ray
from shadow.telemetry.httpspans import TapSpans
from shadow.telemetry.tracing import MirrorSpans, RoutingSpans, get_tracer, otlp_provider

Job = Callable[[], Coroutine[Any, Any, None]]
#: How often a recording is told the live lanes' clock when it changed (and once more at stop).
CLOCK_RECORD_S = 1.0
PROG = "shadow serve"


def ray_shards(address: str | None) -> Callable[[list[dict[str, Any]]], Shards]:
    """Lane shards as Ray actors on the cluster at `address` (Ray's own lookup when None), joined as
    `shadow sweep --ray` joins it."""

    def start(settings: list[dict[str, Any]]) -> Shards:
        ray = import_ray()
        return RayShards(settings, ray, lambda: connect(ray, address))

    return start


def shard_lanes(settings: dict[str, Any], shards: int, ray: str | None = None) -> ShardedLanes:
    """`ShardedLanes` in `shards` processes, or Ray actors on the cluster at `ray`."""
    return ShardedLanes(settings, shards, ray_shards(ray) if ray is not None else ProcessShards)


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

    host: str = knob("127.0.0.1", "--active-host", "the proxy's bind address")
    port: int = knob(0, "--active-port", "the proxy's port (0 = a free port)", PORT)
    policy: str = "br0"
    max_connections: int = knob(1024, "--active-max-connections", "client connections to the proxy; beyond "
                                "it the oldest idle one is closed, else 503", AT_LEAST_ONE)
    #: the proxy's settings given (`ActiveConfig`'s knobs, by field name); the rest at its defaults
    settings: dict[str, Any] = field(default_factory=dict)
    router_factory: Callable[[str], Router] | None = None  # tests: the decode router per policy


#: etcd grants a lease of at least its minimum TTL (ceil(1.5 election timeouts): 2 s at its
#: defaults) whatever is asked, and takes whole seconds.
LEASE_SECONDS = Bound(lambda v: math.isfinite(v) and v >= 2 and v == int(v),
                      "a whole number of seconds >= 2 (etcd's minimum lease at its defaults)")


@dataclass
class LeaseSettings:
    """Replicas of `shadow serve --active`: the leader lease on etcd (`--lease-etcd`)."""

    endpoint: str
    key: str = knob("/shadow/leader", "--lease-key", "the lease's etcd key, one per fleet")
    holder: str = ""
    ttl_s: float = knob(2.0, "--lease-ttl", "lease TTL in whole seconds (>= 2: etcd's minimum); renewed "
                        "without waiting for answers, often enough that renewals answered within etcd's "
                        f"{DEFAULT_CALL_TIMEOUT_S:g} s call timeout keep it, and a replica stops routing "
                        "TTL/4 before its lease can lapse", LEASE_SECONDS, metavar="SECONDS")


@dataclass
class ServeConfig(LanesConfig):
    """What `shadow serve` is told: the tap configuration plus the live lanes' (`LanesConfig`: their
    settings are declared there)."""

    tap: MirrorConfig
    policies: tuple[str, ...] = DEFAULT_POLICIES
    br: BRParams = field(default_factory=BRParams)
    mode_config: ModeConfig | None = None  # the mode controller (active routing); None: none
    active: ActiveSettings | None = None  # --active: the front listener is shadow's own proxy
    drain_timeout_s: float = 30.0  # on a stop signal: how long requests in flight may take to finish
    lease: LeaseSettings | None = None  # replicas: only the lease holder routes, standbys pass on

    def validate(self) -> None:
        check_policies(self.policies)
        if self.tap.slots is None or self.tap.slots < 1:
            raise ValueError(
                "give the decode slots per worker (--slots B): the lanes simulate B slots per worker"
            )
        check_knobs(self)
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout must be >= 0 s, got {self.drain_timeout_s}")
        StepTimeModel(self.step_a, self.step_b)
        if self.lane_ray is not None and not self.lane_shards:
            raise ValueError("--ray runs lane shards: give --lane-shards N")
        if self.active is not None and self.tap.capture is not None:
            raise ValueError("--active routes through taps; --capture only reads the traffic: not both")

    @property
    def workers(self) -> list[str]:
        """The decode workers the lanes simulate (tapped, then named behind a front)."""
        return [*self.tap.upstreams, *self.tap.workers]


class ServeService:
    """See module docstring. `tracing`: the provider every span goes to (None: no spans)."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        tracing: TracerProvider | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        assert config.tap.slots is not None
        self.config = config
        self.clock = clock
        tracer = get_tracer(tracing) if tracing is not None else None
        self.spans = RoutingSpans(tracer) if tracer is not None else None
        step = StepTimeModel(config.step_a, config.step_b)
        lanes: dict[str, Any] = dict(
            workers=config.workers, slots=config.tap.slots, policies=config.policies, lag_s=config.lag_s,
            step=step, step_source=config.step_source, lane_clock=config.lane_clock, br=config.br,
            queue_size=config.live_queue_size, window_s=config.step_window_s,
            compare_window_s=config.compare_window_s,
            rolling_s=config.compare_window_s if config.rolling else None, clock=clock,
            token_interval_s=config.tap.token_interval_s,
        )
        # --lane-shards: the policies' lanes in other processes (or Ray actors), one report
        self.sharded = shard_lanes(lanes, config.lane_shards, config.lane_ray) if config.lane_shards else None
        self.live = self.sharded.live if self.sharded is not None else LiveLanes(**lanes)
        mc = config.mode_config
        if mc is not None:  # only an active proxy carries out canary, active and fallback
            mc = dataclasses.replace(mc, active_available=config.active is not None)
        self.mode_control = (
            ModeControl(mc, clock=clock, br=config.br, spans=self.spans) if mc is not None else None
        )
        self.oracle = (
            OracleGap(len(config.workers), config.tap.slots, step, config.br)
            if mc is not None and mc.oracle_interval_s > 0
            else None
        )
        self._schema: dict[str, Any] | None = None
        self.tap = self._mirror(mc, tracer)
        if self.tap.recorder is not None:  # the recording carries the seeds: a replay starts windows alike
            self.live.seed_sink = self.tap.recorder.seed
        self.live.on_error = self.tap.mirror.count_error  # a failed tick of the lanes: counted, logged
        self.health = (
            HealthPoll(HealthReader(self.tap.reconciler, self.live, self.mode_control.calibration),
                       self.mode_control.controller, mc.check_interval_s, oracle=self.oracle,
                       oracle_interval_s=mc.oracle_interval_s)
            if self.mode_control is not None and mc is not None else None
        )
        # the mode source the active proxy asks per request: the mode controller when there is one
        self.modes: ModeSource = (
            self.mode_control.controller
            if self.mode_control is not None
            else StaticModeSource("active", config.active.policy if config.active is not None else "br0")
        )
        self.elector = self._elector(config)
        # the lease on a loop of its own: a busy analysis loop must not delay the renewals
        self._lease_loop = LoopThread("shadow-lease") if self.elector is not None else None
        self._lease_task: asyncio.Task[None] | None = None
        if self.elector is not None and self.mode_control is not None:
            self.mode_control.controller.gate = self.elector.leader
        self.proxy: ActiveProxy | None = None
        self._route_cost: tuple[object, RouteCost] | None = None  # (lanes' clock, its cost)
        self._recorded_clock: object = None  # the lanes' clock last written to the recording
        self._proxy_server: AsgiListener | None = None
        self._jobs: list[asyncio.Task[None]] = []

    def _mirror(self, mc: ModeConfig | None, tracer: Tracer | None) -> MirrorService:
        """The analysis's mirror, told of the lanes, the modes, the oracle and the spans (its
        listeners), serving the report and the modes' routes, exporting their collectors."""
        report = APIRouter()
        report.add_api_route("/v1/report", self._report, methods=["GET"])
        report.add_api_route("/v1/report/schema", self._report_schema, methods=["GET"])
        listeners: list[Listener] = [self.live.listener]
        routers = [report]
        collectors: list[Collector] = [LiveCollector(self.sharded or self.live)]  # (shards: merged)
        if self.mode_control is not None:
            listeners.append(self.mode_control.calibration)
            routers.append(self.mode_control.router)
            collectors.append(self.mode_control.collector)
        if self.oracle is not None:
            listeners.append(self.oracle)
        if tracer is not None:
            listeners.append(MirrorSpans(tracer))
        tap_config = self.config.tap
        if mc is not None and mc.admin_token is not None:  # events can trip the mode: theirs too
            tap_config = dataclasses.replace(tap_config, events_token_required=True)
        if tap_config.record:
            tap_config = dataclasses.replace(tap_config, record_lanes=self.lane_settings().to_json())
        return MirrorService(tap_config, clock=self.clock, listeners=listeners, collectors=collectors,
                             routers=routers, spans=TapSpans(tracer) if tracer is not None else None)

    def route_cost(self) -> RouteCost:
        """What a running sequence costs the fleet's step as the lanes step on it (their models, refits
        included; the configured model until measured): the active policy balances the lanes' cost.
        Called per routing round (plain reads of the lanes' current clock, cached per clock)."""
        live = self.live
        clock = live.lane_clock
        cached = self._route_cost
        if cached is None or cached[0] is not clock:
            models = clock.models if live.measured_clock and clock.models else (live.step,)
            cached = self._route_cost = (clock, RouteCost.fleet(models))
        return cached[1]

    def lane_settings(self) -> LaneSettings:
        """What the live lanes run with (the recording's header carries it)."""
        c, live = self.config, self.live
        default = (c.step_a, c.step_b) == (DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S)
        return LaneSettings(
            policies=tuple(c.policies), step=live.step, slots=live.slots,
            step_origin="default" if default else "configured", lag_s=c.lag_s, br=live.config.br,
            seed=live.config.seed, rolling_s=live.rolling_s, clock=c.lane_clock,
        )

    def _elector(self, config: ServeConfig) -> LeaderElector | None:
        ls = config.lease
        if ls is None:
            return None
        if config.active is None or not config.tap.front or self.mode_control is None:
            raise ValueError("--lease-etcd needs --active and a --front router: a standby replica passes "
                             "requests to the existing router")
        lc = LeaseConfig(ttl_s=ls.ttl_s)
        lc.validate()
        return LeaderElector(EtcdLease(ls.endpoint, ls.key), ls.holder, lc)

    def _analysis_jobs(self) -> list[Job]:
        """What runs on the mirror's analysis loop beside it (where the reconciler lives)."""
        jobs: list[Job] = []
        if self.health is not None:
            jobs.append(self.health.run)
            if self.oracle is not None:
                jobs.append(self.health.replay_oracle)
        if self.mode_control is not None and self.mode_control.watcher is not None:
            jobs.append(self.mode_control.watcher.run)
        if self.tap.recorder is not None and self.live.measured_clock:
            jobs.append(self._record_clocks)
        return jobs

    def _note_clock(self) -> None:
        """Record the lanes' clock (their step models: what they step on, what their policies
        weigh) when it changed since last recorded; not while it is still the configured model on
        one barrier (what a replay runs on without a clock line)."""
        live, last = self.live, self._recorded_clock
        clock = live.lane_clock
        if self.tap.recorder is None or clock is last:
            return
        if last is None and clock == LaneClock.barrier(len(live.workers), [live.step] * len(live.workers)):
            return
        self.tap.recorder.clock(self.clock(), clock)
        self._recorded_clock = clock

    async def _record_clocks(self) -> None:
        while True:
            self._note_clock()
            await asyncio.sleep(CLOCK_RECORD_S)

    async def _report_schema(self) -> Response:
        """The report's JSON Schema (`shadow.contracts.report`), derived once on first ask."""
        if self._schema is None:
            self._schema = report_schema()
        return JSONResponse(self._schema, media_type="application/schema+json")

    async def _report(self, drain: bool = Query(False)) -> Response:
        if drain:
            await self.tap.drain()
            await asyncio.to_thread(self.live.drain)
        sharded = self.sharded
        report = await asyncio.to_thread(sharded.report) if sharded is not None else self.live.report()
        outputs = self.tap.analyzer.output_summary()
        report = {**report, "output_counts": outputs}
        if "warning" in outputs:
            report["warnings"] = [*report.get("warnings", []), outputs["warning"]]
        if self.mode_control is not None:
            report = {**report, "mode": self.mode_control.report()}
        if self.elector is not None:
            report = {**report, "leader": self.elector.report()}
        return JSONResponse(report)

    async def start(self) -> dict[str, Any]:
        ready = await self.tap.start()
        self.live.start()
        jobs = self._analysis_jobs()
        if jobs:
            await asyncio.wrap_future(self.tap.analysis.submit(self._spawn(jobs)))
        if self.config.active is not None:
            ready["active"] = await self._start_active(ready["taps"])
        if self._lease_loop is not None:
            self._lease_loop.start()
            await asyncio.wrap_future(self._lease_loop.submit(self._lease_start()))
        return ready

    async def _lease_start(self) -> None:  # on the lease loop
        assert self.elector is not None
        self._lease_task = asyncio.create_task(self.elector.run())

    async def _lease_stop(self) -> None:  # on the lease loop: stop leading, release the lease
        if self._lease_task is not None:
            self._lease_task.cancel()
            await asyncio.gather(self._lease_task, return_exceptions=True)

    async def _spawn(self, jobs: list[Job]) -> None:
        self._jobs += [asyncio.create_task(job()) for job in jobs]

    async def _cancel_jobs(self) -> None:
        for t in self._jobs:
            t.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        self._jobs.clear()

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
            br=self.config.br,
            max_body_bytes=t.max_body,
            **a.settings,
        )

    async def _start_active(self, taps: dict[str, str]) -> str:
        a = self.config.active
        assert a is not None
        cfg = self._active_config(taps)
        rec = self.tap.reconciler

        def unreachable() -> list[str]:  # the reconciler's view (read across threads: plain reads)
            return [n for n, w in rec.workers.items() if w.last_error in UNREACHABLE] if rec else []

        source = MirrorSource(self.tap.state, list(cfg.decode), unreachable)
        self.proxy = ActiveProxy(cfg, modes=self.modes, source=source, registry=self.tap.registry,
                                 clock=self.clock, router_factory=a.router_factory, spans=self.spans,
                                 metrics_route=False,  # (served on the API listener, not to clients)
                                 cost=self.route_cost)
        t = self.config.tap
        limits = ListenerLimits(max_head=t.max_head, header_timeout_s=t.header_timeout_s,
                                body_timeout_s=t.header_timeout_s, idle_timeout_s=t.idle_timeout_s,
                                max_connections=a.max_connections)
        self._proxy_server = AsgiListener(self.proxy.app, a.host, a.port, limits=limits, name="shadow proxy")
        self.tap.listeners["active"] = self._proxy_server
        return await self._proxy_server.start()

    @property
    def drain_cut(self) -> int:
        """Proxy requests cut at the drain deadline (so far)."""
        return self._proxy_server.rejected["drain_cut"] if self._proxy_server is not None else 0

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting and let requests in flight finish for up to `drain_timeout_s` (the
        proxy's first: its legs run through the taps, which serve them meanwhile; then the taps'
        with what is left), cut the rest, then end everything."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        if self._lease_loop is not None and self._lease_loop.running:  # no new requests routed here
            await asyncio.wrap_future(self._lease_loop.submit(self._lease_stop()))
            await asyncio.to_thread(self._lease_loop.stop)
        if self._proxy_server is not None:
            await self._proxy_server.stop(grace_s=drain_timeout_s)
        if self._jobs and self.tap.analysis.running:
            await asyncio.wrap_future(self.tap.analysis.submit(self._cancel_jobs()))
        if self.live.measured_clock:
            self._note_clock()  # the lanes' last clock, before the recording closes
        await self.tap.stop(drain_timeout_s=max(0.0, deadline - loop.time()))
        await asyncio.to_thread(self.live.stop)
        if self.sharded is not None:
            await asyncio.to_thread(self.sharded.close)


async def serve(config: ServeConfig) -> None:
    """Run until SIGINT/SIGTERM/SIGHUP, then drain for up to `config.drain_timeout_s` (a second
    signal exits at once; one while starting — waiting for a tap group to attach, say — stops it
    there); spans go to OTLP when OTEL_EXPORTER_OTLP_* is set."""
    raise_fd_limit()
    drain = config.drain_timeout_s
    stop = stop_event(hard_exit=PROG, says=f"draining (up to {drain:g} s; a second signal exits now)")
    tracing = otlp_provider()
    svc = ServeService(config, tracing=tracing)
    starting, stopping = asyncio.ensure_future(svc.start()), asyncio.ensure_future(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await svc.stop()
        logging.getLogger("shadow").warning("%s: stopped while starting", PROG)
        if tracing is not None:
            tracing.shutdown()
        return
    announce(starting.result(), latency=True, young=ANALYSIS_YOUNG)
    try:
        await stop.wait()
    finally:
        t0 = time.monotonic()
        await svc.stop(drain_timeout_s=drain)
        cut = svc.drain_cut
        took = time.monotonic() - t0
        logging.getLogger("shadow").log(
            logging.WARNING if cut else logging.INFO, "%s: stopped after %.1f s%s", PROG, took,
            f" ({cut} requests cut at the drain deadline)" if cut else "")
        if tracing is not None:
            tracing.shutdown()


def run(config: ServeConfig) -> None:
    """`serve` on the configured event loop (ValueError: bad configuration; OSError: ports, files)."""
    loop_runner(config.tap.loop)(serve(config))
