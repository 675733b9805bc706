"""Assembly of a running mirror: taps, analysis, state, reconciliation, the event API, housekeeping.

`TapService(config)`: `await start()` binds everything and returns the ready document
`{"taps": {name: url}, "api": url}`; `await stop(drain_timeout_s=0)` stops accepting, lets
in-flight requests finish for up to `drain_timeout_s`, then ends everything. The relay only relays:

- `relay="process"` (what `shadow tap`/`shadow serve` run): the taps relay in a child process
  (`relayproc`) and hand copies over a bounded socket (`channel`; full = dropped and counted); the
  analysis reads them on its loop thread here. Nothing done in this process can delay the relay.
- `relay="thread"` (the default for embedding and most tests): taps on the caller's loop, copies
  through a bounded `DropQueue` to the analysis loop thread (same process: they share the GIL).

`Mirror` listeners and the API's handlers run on the analysis thread (`self.analysis.call/sync`).
`watermark()` tells how far the analysis got (`await settle()` waits for it; with a relay process
it first asks the relay for a mark, so it covers what the relay had offered when asked).
Everything is created per instance (own CollectorRegistry, own state); nothing global.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import APIRouter
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from shadow import __version__
from shadow.base.listener import AsgiListener, ListenerLimits
from shadow.base.listener_metrics import ListenerCollector
from shadow.base.loopthread import LoopThread
from shadow.base.net import bind_listen
from shadow.base.procinfo import ProcessInfo
from shadow.mirror.analyzer import Analyzer
from shadow.mirror.api import create_app
from shadow.mirror.bounds import EventBounds
from shadow.mirror.channel import ChannelReader
from shadow.mirror.dropqueue import DropQueue
from shadow.mirror.emitter import Emitter
from shadow.mirror.http1 import DEFAULT_ALLOW_PATHS, TapLimits
from shadow.mirror.hub import Listener, Mirror
from shadow.mirror.keys import KeySecret
from shadow.mirror.metrics import MirrorCollector
from shadow.mirror.proxy import Tap, TapContext
from shadow.mirror.reconcile import Reconciler
from shadow.mirror.recording import CompactRecorder
from shadow.mirror.rejectlog import RejectionLog
from shadow.mirror.relayproc import RelayProcess
from shadow.mirror.relayview import RemoteQueue, RemoteTap
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
    record_max_bytes: int | None = None  # rotate the recording at this size (None: never)
    record_lanes: dict[str, Any] | None = None  # what live lanes run with, for the recording's header
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
    events_token_required: bool = False  # another token guards the process: no events without theirs
    forward_token: str | None = None  # bearer token sent with --forward posts
    # caps and timeouts of the in-path taps (see TapLimits) and of the mirror
    max_connections: int = 4096
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    max_head: int = 64 << 10
    api_max_connections: int = 256  # the API/admin listener's connection cap (oldest idle closed first)
    allow_paths: tuple[str, ...] = ()  # relayed in addition to DEFAULT_ALLOW_PATHS
    queue_bytes: int = 256 << 20
    max_live: int = 1_000_000  # mirrored requests alive at once; beyond it new ones are dropped and counted
    max_id_len: int = 256  # request ids, worker names and prompt keys longer than this are rejected
    event_skew_s: float = 60.0  # an event's time must be within this of the clock (else dropped)
    max_request_tokens: int = 1 << 21  # token counts an event may claim for one request (else dropped)
    ring_bytes: int = 16 << 20  # the recent-events buffer (GET /v1/events), approximate bytes
    key_secret: bytes | None = None  # HMAC key of prompt keys; None = a fresh random one
    switch_interval_s: float | None = 0.0005  # GIL hand-over bound between relay and analysis threads
    # "process": the taps relay in a child process of their own (nothing here can take its GIL);
    # "thread": on the caller's loop, analysis on a thread (tests, embedding)
    relay: str = "thread"
    loop: str = "auto"  # the relay process's event loop: auto (uvloop when installed), uvloop, asyncio
    # With a relay process: niceness added to the analysis thread (0 = none), so that when both
    # share a core the kernel runs the relay first and the analysis falls behind (and drops) instead
    analysis_nice: int = 0


def _host_port(url: str) -> str:
    """ "http://h:p/..." → "h:p" (how vllm-router names workers in its request ids)."""
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0]


def _bind(host: str, port: int) -> socket.socket:
    return bind_listen(host, port)  # errors name host:port


class TapService:
    """See module docstring."""

    def __init__(
        self,
        config: TapConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        listeners: Sequence[Listener] = (),
        collectors: Sequence[Collector] = (),
        routers: Sequence[APIRouter] = (),
    ) -> None:
        """`listeners` are told of every mirrored event (after the --forward emitter), `collectors`
        join the mirror's on /metrics, `routers` add routes to the API."""
        c = config
        names = [*c.upstreams, *c.prefill, *c.front, *c.workers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"names used twice: {sorted(dup)}")
        if not c.upstreams and not c.front and not c.workers:
            raise ValueError("nothing to mirror: give upstream workers to tap, or a router to front")
        self.config = c
        self.clock = clock
        if c.relay not in ("thread", "process"):
            raise ValueError(f"relay must be 'thread' or 'process', got {c.relay!r}")
        if not 0 <= c.analysis_nice <= 19:
            raise ValueError(f"--analysis-nice must be in 0..19, got {c.analysis_nice}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.processed = 0  # items the analysis has consumed (the watermark)
        self.channel = ChannelReader()
        self.relay: RelayProcess | None = None
        self._synced = 0  # the last relay sync token whose items the analysis has processed
        self.queue: DropQueue | RemoteQueue = (
            DropQueue(c.queue_size, max_bytes=c.queue_bytes)
            if c.relay == "thread"
            else RemoteQueue(self.channel, c.queue_size, lambda: self.processed)
        )
        decode_workers = {**c.upstreams, **c.workers}
        self.state = MirrorState(decode_workers, slots=c.slots, ttl_s=c.ttl_s, phantom_age_s=c.phantom_age_s)
        self.recorder = (
            CompactRecorder(
                c.record, workers=list(decode_workers), slots=c.slots, lanes=c.record_lanes,
                max_bytes=c.record_max_bytes,
            )
            if c.record
            else None
        )
        self.emitter = (
            Emitter(
                c.forward_to,
                headers={"authorization": f"Bearer {c.forward_token}"} if c.forward_token else None,
            )
            if c.forward_to
            else None
        )
        self.mirror = Mirror(
            self.state,
            recorder=self.recorder,
            max_live=c.max_live,
            ring_bytes=c.ring_bytes,
            listeners=[*([self.emitter] if self.emitter is not None else []), *listeners],
            bounds=EventBounds(c.event_skew_s, c.max_request_tokens),
        )
        self.keys = KeySecret(c.key_secret)
        self.analyzer = Analyzer(
            self.mirror,
            prefill_taps=c.prefill,
            max_body=c.max_body,
            hook=c.hook,
            clock=clock,
            front_taps=c.front,
            worker_by_addr={_host_port(u): n for n, u in decode_workers.items()},
            prompt_key_fn=self.keys.prompt_key,
        )
        self.limits = TapLimits(
            max_head=c.max_head,
            header_timeout_s=c.header_timeout_s,
            idle_timeout_s=c.idle_timeout_s,
            max_connections=c.max_connections,
            allow_paths=DEFAULT_ALLOW_PATHS + tuple(c.allow_paths),
        )
        self.taps: list[Tap] | list[RemoteTap] = (
            [
                Tap(n, u, self.queue, max_body=c.max_body, inject_usage=c.inject_usage, limits=self.limits)
                for n, u in {**c.upstreams, **c.prefill, **c.front}.items()
            ]
            if isinstance(self.queue, DropQueue)
            else [
                RemoteTap(n, u, "", 0, self.channel)
                for n, u in {**c.upstreams, **c.prefill, **c.front}.items()
            ]
        )
        targets = {n: c.metrics_of.get(n, u.rstrip("/") + "/metrics") for n, u in decode_workers.items()}
        self.reconciler = (
            Reconciler(targets, self.state, interval_s=c.scrape_interval_s, slots=c.slots, clock=clock)
            if c.scrape_interval_s > 0
            else None
        )
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
                emitter=self.emitter,
            )
        )
        log = logging.getLogger("shadow.mirror")
        self.refusals = [RejectionLog("tap", lambda: [(t.name, t.rejected) for t in self.taps], log)]
        if self.reconciler is not None:
            rec = self.reconciler
            pages = RejectionLog("worker /metrics", lambda: [("scrape", rec.scrape_rejected)], log)
            self.refusals.append(pages)
        self.registry.register(ProcessInfo(__version__))
        for collector in collectors:
            self.registry.register(collector)
        self.app = create_app(
            self.mirror,
            self.registry,
            rejected=self.rejected,
            extra_state=self._extra_state,
            clock=clock,
            host=c.host,
            ingest_token=c.events_token,
            max_id_len=c.max_id_len,
            routers=routers,
            token_required=c.events_token_required,
        )
        self.analysis = LoopThread("shadow-analysis")
        self._tasks: list[asyncio.Task[Any]] = []
        self._server = AsgiListener(
            self.app,
            c.host,
            c.port,
            lifespan="off",
            name="shadow api",
            limits=ListenerLimits(
                max_head=c.max_head,
                header_timeout_s=c.header_timeout_s,
                body_timeout_s=c.header_timeout_s,
                idle_timeout_s=5.0,
                max_connections=c.api_max_connections,
            ),
        )
        self.listeners: dict[str, AsgiListener] = {"api": self._server}  # in /v1/state and /metrics
        self.registry.register(ListenerCollector(self.listeners))
        self.api_url = ""

    def output_counts(self) -> dict[str, Any]:
        """Finished decode responses by what their output count came from (`output_count`), with a
        warning when some were only counted in chunks (a lower bound of their tokens)."""
        by: dict[str, int] = {}
        for (_, source), n in list(self.analyzer.output_counts.items()):
            by[source] = by.get(source, 0) + n
        out: dict[str, Any] = {"by_source": by}
        total, chunks = sum(by.values()), by.get("chunks", 0)
        if chunks:
            out["warning"] = (
                f"{chunks} of {total} finished responses carried no usage or token_ids and did not end "
                "for length: their output tokens are counted in chunks, a lower bound (vLLM merges "
                "tokens into one chunk under load); clients asking stream_options.include_usage, or "
                "the taps with --inject-usage, make them exact")
        return out

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
            "watermark": self.watermark(),
            "connections": {t.name: t.connections for t in self.taps},
            "listeners": {
                name: {"url": ln.url, "connections": ln.connections, "requests": ln.requests,
                       "rejected": dict(ln.rejected)}
                for name, ln in self.listeners.items()
            },
        }
        if self.reconciler is not None:
            rec = self.reconciler.snapshot(now)
            out["reconcile"] = rec
            for name, r in rec.items():
                w = out.setdefault("drift", {})
                w[name] = r["drift_requests"]
        return out

    def watermark(self) -> dict[str, int]:
        """How far the analysis got: `offered` items went into the hand-off, `processed` were
        consumed, `dropped` were refused (full); settled when processed + dropped == offered.
        `scrapes` counts finished reconciliation rounds."""
        q = self.queue
        return {
            "offered": q.offered,
            "processed": self.processed,
            "dropped": q.dropped,
            "scrapes": self.reconciler.scrapes if self.reconciler is not None else 0,
        }

    def settled(self, mark: int | None = None) -> bool:
        """True once everything offered up to `mark` (default: now) has been processed or dropped."""
        q = self.queue
        target = q.offered if mark is None else mark
        return self.processed + q.dropped >= target

    async def settle(self, timeout_s: float = 10.0) -> bool:
        """Wait (on any loop) until the analysis has consumed what was offered when called (with a
        relay process: what it had offered when it answered a sync sent now)."""
        deadline = time.monotonic() + timeout_s
        relay = self.relay
        if relay is not None:
            if self.channel.eof:
                return True
            token = relay.next_token()
            relay.send("sync", token)
            while self._synced < token and not self.channel.eof:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.002)
            return True
        mark = self.queue.offered
        while not self.settled(mark):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    async def start(self) -> dict[str, Any]:
        c = self.config
        if c.switch_interval_s is not None and sys.getswitchinterval() > c.switch_interval_s:
            sys.setswitchinterval(c.switch_interval_s)  # the relay thread waits at most this for the GIL
        api_sock = _bind(c.host, c.port)
        taps: dict[str, str] = {}
        if c.relay == "process":
            return await self._start_process(api_sock)
        try:
            for i, tap in enumerate(self.taps):
                assert isinstance(tap, Tap)
                taps[tap.name] = await tap.start(c.host, c.port + 1 + i if c.port else 0)
        except BaseException:
            api_sock.close()
            for tap in self.taps:
                with contextlib.suppress(Exception):
                    await tap.close()  # type: ignore[union-attr]
            raise
        self.analysis.start()
        await asyncio.wrap_future(self.analysis.submit(self._start_analysis(api_sock)))
        h, p = api_sock.getsockname()[:2]
        self.api_url = f"http://{h}:{p}"
        return {"taps": taps, "api": self.api_url}

    async def _start_process(self, api_sock: socket.socket, ready_timeout_s: float = 30.0) -> dict[str, Any]:
        """Relay in a child process: bind the taps' listeners here, hand them over, read its frames."""
        c = self.config
        listeners: list[socket.socket] = []
        try:
            for i, tap in enumerate(self.taps):
                sock = _bind(c.host, c.port + 1 + i if c.port else 0)
                listeners.append(sock)
                assert isinstance(tap, RemoteTap)
                tap.host, tap.port = sock.getsockname()[:2]
        except BaseException:
            for sock in [api_sock, *listeners]:
                sock.close()
            raise
        lim = self.limits
        spec = {
            "taps": [{"name": t.name, "upstream": t.upstream} for t in self.taps],
            "queue_size": c.queue_size,
            "queue_bytes": c.queue_bytes,
            "max_body": c.max_body,
            "inject_usage": c.inject_usage,
            "loop": c.loop,
            "limits": {k: getattr(lim, k) for k in lim.__dataclass_fields__},
        }
        self.relay = RelayProcess(spec, listeners, buffer_bytes=min(4 << 20, c.queue_bytes))
        self.relay.start()
        self.analysis.start()
        await asyncio.wrap_future(self.analysis.submit(self._start_analysis(api_sock)))
        h, p = api_sock.getsockname()[:2]
        self.api_url = f"http://{h}:{p}"
        deadline = time.monotonic() + ready_timeout_s
        while not self.channel.marks:  # the relay's first mark: it serves the listeners
            if not self.relay.alive or self.channel.eof or time.monotonic() > deadline:
                await self.stop()
                raise OSError("shadow tap: the relay process did not start (see its error above)")
            await asyncio.sleep(0.005)
        return {"taps": {t.name: t.url for t in self.taps}, "api": self.api_url}

    def _on_channel(self) -> None:
        """Analysis loop: frames from the relay process, processed in order as they come."""
        relay = self.relay
        assert relay is not None and relay.data is not None
        try:
            chunk = relay.data.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.channel.eof = True
            asyncio.get_running_loop().remove_reader(relay.data.fileno())
            return
        try:
            items = self.channel.feed(chunk)
        except Exception:
            self.mirror.count_error("channel")
            return
        if items:
            try:
                self.analyzer.process(items)
            except Exception:
                self.mirror.count_error("analysis")
            self.processed += len(items)
        self._synced = self.channel.token
        pace = self.config.pace_s
        if pace and items:  # tests: a slow consumer (the relay's hand-off fills and drops)
            loop = asyncio.get_running_loop()
            loop.remove_reader(relay.data.fileno())
            loop.call_later(pace, loop.add_reader, relay.data.fileno(), self._on_channel)

    async def _start_analysis(self, api_sock: socket.socket) -> None:
        """On the analysis loop: consumer, housekeeping, reconciliation, forwarding, the API."""
        c = self.config
        if self.relay is not None and c.analysis_nice > 0:
            with contextlib.suppress(OSError):  # this thread only (Linux: per-thread niceness)
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + c.analysis_nice)
        if self.relay is not None:
            assert self.relay.data is not None
            asyncio.get_running_loop().add_reader(self.relay.data.fileno(), self._on_channel)
        else:
            self._tasks.append(asyncio.create_task(self._consume(c.pace_s)))
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        if self.reconciler is not None:
            self._tasks.append(asyncio.create_task(self.reconciler.run()))
        if self.emitter is not None:
            self.emitter.start()
        await self._server.start(api_sock)

    async def _consume(self, pace: float, settle_s: float = 0.01) -> None:
        """The analysis side of the hand-off: batches from the queue, processed in order."""
        q = self.queue
        assert isinstance(q, DropQueue)
        analyzer = self.analyzer
        while True:
            items = await q.get_batch(1, timeout=0.5)
            if not items:
                continue
            if settle_s:
                await asyncio.sleep(settle_s)  # let a burst accumulate: fewer wake-ups of this thread
            while items:
                try:
                    analyzer.process(items)
                except Exception:
                    self.mirror.count_error("analysis")
                self.processed += len(items)
                if pace:
                    await asyncio.sleep(pace)
                items = q.get_nowait_batch(4096)
                if items:
                    await asyncio.sleep(0)  # the API and the housekeeping get their turn

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                now = self.clock()
                self.mirror.reap(now)
                self.analyzer.tick(now)
                for refusals in self.refusals:
                    refusals.check()
                if self.recorder is not None:
                    self.recorder.flush()
            except Exception:
                self.mirror.count_error("housekeeping")

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until the analysis has consumed everything offered so far (tests, shutdown)."""
        await self.settle(timeout_s)

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish (up to `drain_timeout_s`); end everything."""
        if self.relay is not None:
            await self._stop_process(drain_timeout_s)
            return
        taps = cast(list[Tap], self.taps)
        for tap in taps:
            tap.begin_drain()
        if drain_timeout_s > 0:
            await asyncio.gather(*(tap.drained(drain_timeout_s) for tap in taps))
        for tap in taps:
            with contextlib.suppress(Exception):
                await tap.close()
        with contextlib.suppress(Exception):
            await self.settle(2.0)
        if self.analysis.running:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.analysis.submit(self._stop_analysis()))
            self.analysis.stop()

    async def relay_exited(self, poll_s: float = 0.5) -> int:
        """Return the relay process's exit code once it is gone (never returns without one)."""
        while True:
            relay = self.relay
            if relay is not None and relay.proc is not None and relay.proc.poll() is not None:
                return int(relay.proc.returncode)
            await asyncio.sleep(poll_s)

    async def _stop_process(self, drain_timeout_s: float) -> None:
        """Drain the relay process (it stops accepting and lets in-flight requests finish), stop it,
        read its last frames, then end the analysis."""
        relay = self.relay
        assert relay is not None
        if relay.alive and not self.channel.eof:
            token = relay.next_token()
            relay.send("drain", (token, max(0.0, drain_timeout_s)))
            deadline = time.monotonic() + drain_timeout_s + 5
            while self._synced < token and not self.channel.eof and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        relay.send("stop", 0)
        await asyncio.to_thread(relay.wait, 10.0)
        deadline = time.monotonic() + 5
        while not self.channel.eof and self.analysis.running and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # its last frames (ends, the final mark)
        relay.close_control()
        if self.analysis.running:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.analysis.submit(self._stop_analysis()))
            self.analysis.stop()
        if relay.data is not None:
            relay.data.close()

    async def _stop_analysis(self) -> None:
        await self._server.stop(grace_s=5.0)
        for t in self._tasks:
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
