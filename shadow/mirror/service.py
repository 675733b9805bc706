"""Assembly of a running mirror: taps (or an attachment to them), analysis, state, reconciliation,
the event API, housekeeping.

`MirrorService(config)`: `await start()` binds everything and returns the ready document
`{"taps": {name: url}, "api": url}`; `await stop(drain_timeout_s=0)` ends everything (with
in-process taps: stops accepting and lets in-flight requests finish first). The relay only relays:

- `relay="process"` (what `shadow serve` runs): the taps relay in a tap group of their own — a
  `shadow tap` process (`shadow.dataplane.supervisor`) this service starts detached, or adopts after
  its own restart (found through the state directory), or the groups named by `attach` — and the
  analysis attaches to them (`shadow.mirror.link`, `shadow.mirror.attach`): a snapshot of the
  requests they keep, then their live copies; full = dropped and counted. Nothing done in this
  process, including dying, can stop or delay the relay; `stop_taps` says whether `stop()` also
  ends a group it started.
- `relay="thread"` (the default for embedding and most tests): taps on the caller's loop, copies
  through a bounded `DropQueue` to the analysis loop thread (same process: they share the GIL).

`Mirror` listeners and the API's handlers run on the analysis thread (`self.analysis.call/sync`).
`watermark()` tells how far the analysis got (`await settle()` waits for it; attached to relays it
first asks each for a mark, so it covers what they had offered when asked).
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
from shadow.capture.passive import Capture, capture_targets
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.tap import Tap
from shadow.mirror.analyzer import Analyzer, RequestSpans
from shadow.mirror.api import create_app
from shadow.mirror.bounds import EventBounds
from shadow.mirror.channel_reader import ChannelReader
from shadow.mirror.config import MirrorConfig
from shadow.mirror.emitter import Emitter
from shadow.mirror.hub import Listener, Mirror
from shadow.mirror.keys import KeySecret
from shadow.mirror.link import RelayLink
from shadow.mirror.metrics import CaptureCollector, MirrorCollector
from shadow.mirror.reconcile import Reconciler
from shadow.mirror.recording import CompactRecorder
from shadow.mirror.rejectlog import RejectionLog
from shadow.mirror.relayview import RemoteQueue, RemoteTap
from shadow.mirror.state import MirrorState

log = logging.getLogger("shadow.mirror")


def _host_port(url: str) -> str:
    """ "http://h:p/..." → "h:p" (how vllm-router names workers in its request ids)."""
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0]


def _bind(host: str, port: int) -> socket.socket:
    return bind_listen(host, port)  # errors name host:port


class MirrorService:
    """The analysis process's mirror (see module docstring): it runs in `shadow serve`, never in the
    data plane (`shadow tap`), which it starts, adopts or attaches to."""

    def __init__(
        self,
        config: MirrorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        listeners: Sequence[Listener] = (),
        collectors: Sequence[Collector] = (),
        routers: Sequence[APIRouter] = (),
        spans: RequestSpans | None = None,
    ) -> None:
        """`listeners` are told of every mirrored event (after the --forward emitter), `collectors`
        join the mirror's on /metrics, `routers` add routes to the API, `spans` hears of every
        relayed generation request's start and end (the taps' spans)."""
        config.check()
        c = self.config = config
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        self.processed = 0  # items the analysis has consumed (the watermark)
        self.limits = c.tap_limits()
        self.link = RelayLink(c, self.limits, clock, self._on_items)  # used with relay="process"
        self.queue: DropQueue | RemoteQueue = (
            DropQueue(c.queue_size, max_bytes=c.queue_bytes)
            if c.relay == "thread"
            else RemoteQueue(self.link.readers, c.queue_size)
        )
        decode_workers = {**c.upstreams, **c.workers}
        self.state = MirrorState(decode_workers, slots=c.slots, ttl_s=c.ttl_s, phantom_age_s=c.phantom_age_s)
        self.recorder = (
            CompactRecorder(c.record, workers=list(decode_workers), slots=c.slots, lanes=c.record_lanes,
                            max_bytes=c.record_max_bytes)
            if c.record else None
        )
        forward_headers = {"authorization": f"Bearer {c.forward_token}"} if c.forward_token else None
        self.emitter = Emitter(c.forward_to, headers=forward_headers) if c.forward_to else None
        self.mirror = Mirror(
            self.state,
            recorder=self.recorder,
            max_live=c.max_live,
            ring_bytes=c.ring_bytes,
            listeners=[*([self.emitter] if self.emitter is not None else []), *listeners],
            bounds=EventBounds(c.event_skew_s, c.max_request_tokens),
            token_interval_s=c.token_interval_s,
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
            spans=spans,
        )
        self.capture, self.taps = self._sources()
        targets = {n: c.metrics_of.get(n, u.rstrip("/") + "/metrics") for n, u in decode_workers.items()}
        self.reconciler = (
            Reconciler(targets, self.state, interval_s=c.scrape_interval_s, slots=c.slots, clock=clock,
                       settle=lambda: self.settle(timeout_s=min(1.0, c.scrape_interval_s)))
            if c.scrape_interval_s > 0
            else None
        )
        self.rejected: dict[str, int] = {}
        self._register(collectors)
        self.analysis = LoopThread("shadow-analysis")
        self._tasks: list[asyncio.Task[Any]] = []
        self.app, self._server = self._api(routers)
        self.listeners: dict[str, AsgiListener] = {"api": self._server}  # in /v1/state and /metrics
        self.registry.register(ListenerCollector(self.listeners))
        self.api_url = ""

    def _sources(self) -> tuple[Capture | None, list[Tap] | list[RemoteTap]]:
        """Where the copies come from: passive capture (no taps), taps on this process's loop
        (relay="thread", through the `DropQueue`), or views of the taps of relay processes."""
        c = self.config
        capture = (
            Capture(c.capture, capture_targets({**c.upstreams, **c.prefill, **c.front}), self.queue,
                    max_body=c.max_body)
            if c.capture is not None and isinstance(self.queue, DropQueue)
            else None
        )
        taps: list[Tap] | list[RemoteTap] = (
            []
            if capture is not None
            else [
                Tap(n, u, self.queue, max_body=c.max_body, inject_usage=c.inject_usage, limits=self.limits)
                for n, u in {**c.upstreams, **c.prefill, **c.front}.items()
            ]
            if isinstance(self.queue, DropQueue)
            else [
                RemoteTap(n, u, lambda n=n: self.link.reader_of(n))  # type: ignore[misc]
                for n, u in {**c.upstreams, **c.prefill, **c.front}.items()
            ]
        )
        return capture, taps

    def _register(self, collectors: Sequence[Collector]) -> None:
        """The mirror's collectors on its registry (and the callers'), and the refusal logs."""
        self.registry.register(MirrorCollector(
            self.mirror, analyzer=self.analyzer, queue=self.queue, taps=self.taps, reconciler=self.reconciler,
            rejected=self.rejected, clock=self.clock, emitter=self.emitter))
        self.refusals = [RejectionLog("tap", lambda: [(t.name, t.rejected) for t in self.taps], log)]
        if self.reconciler is not None:
            rec = self.reconciler
            pages = RejectionLog("worker /metrics", lambda: [("scrape", rec.scrape_rejected)], log)
            self.refusals.append(pages)
        self.registry.register(ProcessInfo(__version__))
        if self.capture is not None:
            self.registry.register(CaptureCollector(self.capture))
        for collector in collectors:
            self.registry.register(collector)

    def _api(self, routers: Sequence[APIRouter]) -> tuple[Any, AsgiListener]:
        """The event/state API (its FastAPI app) and the listener serving it."""
        c = self.config
        app = create_app(
            self.mirror,
            self.registry,
            rejected=self.rejected,
            extra_state=self._extra_state,
            clock=self.clock,
            host=c.host,
            ingest_token=c.events_token,
            max_id_len=c.max_id_len,
            routers=routers,
            token_required=c.events_token_required,
            probe_token=c.probe_token,
        )
        server = AsgiListener(
            app,
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
        return app, server

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
        if self.capture is not None:
            out["capture"] = self.capture.snapshot()
        if self.config.relay == "process":
            out.update(self.link.snapshot())
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
        """Wait (on any loop) until the analysis has consumed what was offered when called (attached
        to relays: what each had offered when it answered a sync sent now)."""
        deadline = time.monotonic() + timeout_s
        if self.config.relay == "process":
            token = self.link.next_token()
            fut = self.analysis.submit(self.link.sync_all(token))
            readers = await asyncio.wrap_future(fut)
            while any(r.token < token and not r.eof for r in readers):
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
            try:
                return await self._start_attached(api_sock)
            except BaseException:
                api_sock.close()
                raise
        try:
            for i, tap in enumerate(self.taps):
                assert isinstance(tap, Tap)
                taps[tap.name] = await tap.start(c.host, c.port + 1 + i if c.port else 0)
            if self.capture is not None:
                self.capture.start()
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
        if self.capture is not None:
            return {"api": self.api_url, "capture": {"interface": self.capture.interface,
                                                     "targets": self.capture.snapshot()["targets"]}}
        return {"taps": taps, "api": self.api_url}

    async def _start_attached(self, api_sock: socket.socket, ready_timeout_s: float = 60.0) -> dict[str, Any]:
        """Attach to the tap groups (starting or adopting ours first), then serve the API."""
        await self.link.open(cast(list[RemoteTap], self.taps), ready_timeout_s)
        self.analysis.start()
        await asyncio.wrap_future(self.analysis.submit(self._start_analysis(api_sock)))
        h, p = api_sock.getsockname()[:2]
        self.api_url = f"http://{h}:{p}"
        ok = await asyncio.wrap_future(self.analysis.submit(self.link.wait_attached(ready_timeout_s)))
        if not ok:
            errors = self.link.not_attached()
            await self.stop()
            raise OSError(f"could not attach to the tap group(s): {errors}")
        return {"taps": {t.name: t.url for t in self.taps}, "api": self.api_url}

    def _on_items(self, reader: ChannelReader, items: list[tuple[Any, int, float, Any]]) -> None:
        """Analysis loop: a relay's items, processed in order as they come."""
        try:
            self.analyzer.process(items)
        except Exception:
            self.mirror.count_error("analysis")
        self.processed += len(items)
        reader.processed += len(items)

    async def _start_analysis(self, api_sock: socket.socket) -> None:
        """On the analysis loop: consumer, housekeeping, reconciliation, forwarding, the API."""
        c = self.config
        if c.relay == "process" and c.analysis_nice > 0:
            with contextlib.suppress(OSError):  # this thread only (Linux: per-thread niceness)
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + c.analysis_nice)
        if c.relay == "process":
            self.link.start()
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
                recovery = self.link.housekeep()  # acks what was processed; restarts a lost group
                if recovery is not None:
                    self._tasks.append(recovery)
            except Exception:
                self.mirror.count_error("housekeeping")

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until the analysis has consumed everything offered so far (tests, shutdown)."""
        await self.settle(timeout_s)

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish (up to `drain_timeout_s`); end everything.
        Attached to tap groups: detach (a group this service started is stopped when `stop_taps`;
        it drains for its own --drain-timeout)."""
        if self.config.relay == "process":
            await self._stop_attached()
            return
        if self.capture is not None:
            self.capture.stop()
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

    async def _stop_attached(self) -> None:
        await self.link.close_group(lambda: self.settle(2.0))
        if self.analysis.running:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.analysis.submit(self._stop_analysis()))
            self.analysis.stop()

    async def _stop_analysis(self) -> None:
        with contextlib.suppress(Exception):
            self.mirror.release_held()  # the input has ended: held Tokens go out before the end
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
        await self.link.aclose()
