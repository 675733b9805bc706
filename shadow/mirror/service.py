"""Assembly of a running mirror: taps (or an attachment to them), analysis, state, reconciliation,
the event API, housekeeping.

`MirrorService(config)`: `await start()` binds everything and returns the ready document
`{"taps": {name: url}, "api": url}`; `await stop(drain_timeout_s=0)` ends everything (with
in-process taps: stops accepting and lets in-flight requests finish first). The relay only relays:

- `relay="process"` (what `shadow serve` runs): the taps relay in a tap group of their own — a
  `shadow tap` process (`shadow.dataplane.supervisor`) this service starts detached, or adopts after
  its own restart (found through the state directory), or the groups named by `attach` — and the
  analysis attaches to them (`shadow.mirror.attach`): a snapshot of the requests they keep, then
  their live copies; full = dropped and counted. Nothing done in this process, including dying,
  can stop or delay the relay; `stop_taps` says whether `stop()` also ends a group it started.
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
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from fastapi import APIRouter
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from shadow import __version__
from shadow.base.knobs import (
    AT_LEAST_ONE,
    NICENESS,
    NON_NEGATIVE,
    NON_NEGATIVE_S,
    PORT,
    POSITIVE_S,
    Bound,
    check_knobs,
    knob,
    knob_argv,
)
from shadow.base.listener import AsgiListener, ListenerLimits
from shadow.base.listener_metrics import ListenerCollector
from shadow.base.loopthread import LoopThread
from shadow.base.net import bind_listen
from shadow.base.pidlock import PidLock
from shadow.base.procinfo import ProcessInfo
from shadow.base.security import Untrusted
from shadow.base.statedir import state_dir
from shadow.capture.passive import Capture, capture_targets
from shadow.contracts.events import MAX_REQUEST_TOKENS
from shadow.contracts.tapwire import TapContext
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.http1 import DEFAULT_ALLOW_PATHS, TapLimits
from shadow.dataplane.relay import RelayBounds, boot_id
from shadow.dataplane.rundir import GROUPS, digest, hold_analysis_lock, prepare_state_dir
from shadow.dataplane.tap import Tap
from shadow.mirror.analyzer import Analyzer, RequestSpans
from shadow.mirror.api import create_app
from shadow.mirror.attach import Attachment
from shadow.mirror.bounds import EventBounds
from shadow.mirror.channel_reader import ChannelReader
from shadow.mirror.emitter import Emitter
from shadow.mirror.groups import ManagedGroup
from shadow.mirror.hub import Listener, Mirror
from shadow.mirror.keys import KeySecret
from shadow.mirror.metrics import CaptureCollector, MirrorCollector
from shadow.mirror.reconcile import Reconciler
from shadow.mirror.recording import CompactRecorder
from shadow.mirror.rejectlog import RejectionLog
from shadow.mirror.relayview import RemoteQueue, RemoteTap
from shadow.mirror.state import MirrorState

log = logging.getLogger("shadow.mirror")


#: the recording's smallest rotation size (`shadow.mirror.recording`)
ROTATION_SIZE = Bound(lambda v: v >= 4096, ">= 4096 bytes")
RECONCILE_S = Bound(NON_NEGATIVE_S.ok, ">= 0 s (0 = reconciliation off)")


@dataclass(kw_only=True)
class MirrorBounds:
    """What the mirror keeps, reaps and serves: the settings `shadow serve` and `shadow capture` share
    (declared here once: `shadow.base.knobs`)."""

    record_max_bytes: int | None = knob(None, "--record-max-bytes", "rotate the recording at about this "
                                        "size (FILE.1, FILE.2, ...; none: never)", ROTATION_SIZE, type=int,
                                        metavar="BYTES")
    ttl_s: float = knob(300.0, "--ttl", "reap requests silent this long (s)", POSITIVE_S)
    phantom_age_s: float = knob(120.0, "--phantom-age", "count as phantom when silent this long (s)",
                                POSITIVE_S)
    scrape_interval_s: float = knob(5.0, "--scrape-interval", "reconciliation period (s); 0 = off",
                                    RECONCILE_S)
    api_max_connections: int = knob(256, "--api-max-connections", "connections to the API/admin listener; "
                                    "beyond it the oldest idle one is closed, else 503", AT_LEAST_ONE)
    max_live: int = knob(1_000_000, "--max-live", "mirrored requests alive at once; new ones beyond it are "
                         "dropped and counted", AT_LEAST_ONE)
    max_id_len: int = knob(256, "--max-id-len", "longest request id / worker / prompt key accepted by the "
                           "event API", AT_LEAST_ONE)
    ring_bytes: int = knob(16 << 20, "--ring-bytes", "recent-events buffer served by GET /v1/events, "
                           "approximate bytes", NON_NEGATIVE, metavar="BYTES")


@dataclass
class MirrorConfig(MirrorBounds):
    """What the analysis side of `shadow serve` is told about the taps it runs or attaches to (the
    data plane process itself is configured by `shadow.dataplane.relay.RelaySpec`). Upstreams are
    {name: base URL}; prefill ones get taps too.

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
    port: int = knob(0, "--port", "API port; taps this process starts take the following ports (0: all "
                     "ephemeral)", PORT)
    record: str | None = None
    record_lanes: dict[str, Any] | None = None  # what live lanes run with, for the recording's header
    max_body: int = RelayBounds.max_body
    queue_size: int = RelayBounds.queue_size
    slots: int | None = None
    tick_s: float = 0.25
    forward_to: str | None = None  # post every event to another shadow's /v1/events
    hook: Callable[[TapContext, bytes], None] | None = None  # tests: analysis fault injection
    pace_s: float = 0.0  # tests: slow analysis consumer
    # ask workers for continuous usage; strip what the client did not ask for
    inject_usage: bool = RelayBounds.inject_usage
    events_token: str | None = None  # bearer token for POST /v1/events (required off loopback)
    events_token_required: bool = False  # another token guards the process: no events without theirs
    probe_token: str | None = None  # bearer token admitting `step` lines only (the engine probe's)
    forward_token: str | None = None  # bearer token sent with --forward posts
    # caps and timeouts of the in-path taps (declared on TapLimits) and of the mirror
    max_connections: int = TapLimits.max_connections
    header_timeout_s: float = TapLimits.header_timeout_s
    idle_timeout_s: float = TapLimits.idle_timeout_s
    max_head: int = TapLimits.max_head
    allow_paths: tuple[str, ...] = ()  # relayed in addition to DEFAULT_ALLOW_PATHS
    queue_bytes: int = RelayBounds.queue_bytes
    event_skew_s: float = 60.0  # an event's time must be within this of the clock (else dropped)
    max_request_tokens: int = MAX_REQUEST_TOKENS  # token counts one event may claim (else dropped)
    key_secret: bytes | None = None  # HMAC key of prompt keys; None = a fresh random one
    switch_interval_s: float | None = 0.0005  # GIL hand-over bound between relay and analysis threads
    # "process": the taps relay in a tap group of their own (a `shadow tap` process that outlives
    # this one); "thread": on the caller's loop, analysis on a thread (tests, embedding)
    relay: str = "thread"
    loop: str = RelayBounds.loop  # the relay process's event loop (auto: uvloop when installed)
    # With a relay process: niceness added to the analysis thread (0 = none), so that when both
    # share a core the kernel runs the relay first and the analysis falls behind (and drops) instead
    analysis_nice: int = knob(0, "--analysis-nice", "lower the analysis thread's priority by N, so that a "
                              "core shared with the relay serves the relay first (the analysis drops and "
                              "counts instead)", NICENESS, metavar="N")
    # relay="process": the tap groups to attach to (a group directory, unix:PATH or tcp://HOST:PORT);
    # none = start (or adopt) one group for the configured taps in STATE_DIR/taps/
    attach: tuple[str, ...] = ()
    attach_token: str | None = None  # presented to relays attached over TCP
    # the name this analysis attaches under: one of the same name replaces it, others attach beside
    # it (replicas behind the same taps each give theirs); "" = the default, anonymous one
    analysis_name: str = ""
    state_dir: str | None = None  # where groups are found (default: as for the prompt key)
    group: str | None = None  # the started group's name (default serve-<configuration digest>)
    stop_taps: bool = True  # stop() also stops a group this service started (the CLI: False)
    drain_timeout_s: float = 30.0  # a started group drains this long when it is stopped
    admin_port: int = knob(0, "--tap-metrics-port", "/metrics and /health port of the tap group this "
                           "process starts (0: a free one)", PORT)
    # a started group keeps this much of live requests for a snapshot
    retain_bytes: int = RelayBounds.retain_bytes
    retain_ended: int = RelayBounds.retain_ended
    # passive capture: read the traffic to the configured servers off this interface (AF_PACKET,
    # needs root) instead of relaying it; nothing is in the path
    capture: str | None = None


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
        check_knobs(c)
        if c.attach and c.relay != "process":
            raise ValueError("attaching to tap groups needs relay='process'")
        if c.capture is not None and (c.relay != "thread" or c.attach):
            raise ValueError("--capture reads the traffic off an interface: no taps to run or attach to")
        self.registry = CollectorRegistry(auto_describe=True)
        self.processed = 0  # items the analysis has consumed (the watermark)
        self.attachments: list[Attachment] = []
        self.group: ManagedGroup | None = None
        self._sync_token = 0
        self._groups_dir: Path | None = None
        self._temporary = False  # the state directory is a temporary one (`_state_dir`)
        self._lock: PidLock | None = None  # this analysis's (`hold_analysis_lock`)
        self._recovery: asyncio.Task[None] | None = None  # starting a lost group again
        self._closing = False  # `stop` began: a group lost now is not started again
        self.queue: DropQueue | RemoteQueue = (
            DropQueue(c.queue_size, max_bytes=c.queue_bytes)
            if c.relay == "thread"
            else RemoteQueue(self._readers, c.queue_size)
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
            spans=spans,
        )
        self.limits = TapLimits(
            max_head=c.max_head,
            header_timeout_s=c.header_timeout_s,
            idle_timeout_s=c.idle_timeout_s,
            max_connections=c.max_connections,
            allow_paths=DEFAULT_ALLOW_PATHS + tuple(c.allow_paths),
        )
        self.capture = (
            Capture(c.capture, capture_targets({**c.upstreams, **c.prefill, **c.front}), self.queue,
                    max_body=c.max_body)
            if c.capture is not None and isinstance(self.queue, DropQueue)
            else None
        )
        self.taps: list[Tap] | list[RemoteTap] = (
            []
            if self.capture is not None
            else [
                Tap(n, u, self.queue, max_body=c.max_body, inject_usage=c.inject_usage, limits=self.limits)
                for n, u in {**c.upstreams, **c.prefill, **c.front}.items()
            ]
            if isinstance(self.queue, DropQueue)
            else [
                RemoteTap(n, u, lambda n=n: self._reader_of(n))  # type: ignore[misc]
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
        if self.capture is not None:
            self.registry.register(CaptureCollector(self.capture))
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
            probe_token=c.probe_token,
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
        if self.capture is not None:
            out["capture"] = self.capture.snapshot()
        if self.config.relay == "process":
            out["attached"] = [a.snapshot() for a in self.attachments]
            if self.group is not None:
                out["tap_group"] = {"name": self.group.run_dir.name, "dir": str(self.group.run_dir.path),
                                    "adopted": self.group.adopted, "recovered": self.group.recovered}
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
            self._sync_token += 1
            token = self._sync_token
            fut = self.analysis.submit(self._sync_all(token))
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

    async def _sync_all(self, token: int) -> list[ChannelReader]:
        return [r for a in self.attachments for r in a.sync(token)]

    def _readers(self) -> list[ChannelReader]:
        return [r for a in self.attachments for r in a.readers]

    def _reader_of(self, tap: str) -> ChannelReader | None:
        """The reader of the relay serving `tap` now (the newest that named it in its hello)."""
        found = None
        for a in self.attachments:
            for r in a.readers:
                if any(t.get("name") == tap for t in r.hello.get("taps", [])):
                    found = r
        return found

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

    def group_spec(self) -> tuple[list[str], str]:
        """The `shadow tap` command line of the group this service starts, and its digest."""
        from shadow.base.procs import shadow_argv

        c, lim = self.config, self.limits
        data_plane: dict[str, Any] = {
            "upstreams": c.upstreams, "prefill": c.prefill, "front": c.front, "host": c.host,
            "port": c.port + 1 if c.port else 0, "admin_port": c.admin_port, "max_body": c.max_body,
            "inject_usage": c.inject_usage, "queue_size": c.queue_size, "queue_bytes": c.queue_bytes,
            "retain_bytes": c.retain_bytes, "retain_ended": c.retain_ended, "loop": c.loop,
            "limits": {k: getattr(lim, k) for k in lim.__dataclass_fields__},
        }
        dig = digest(data_plane)
        name = c.group or f"serve-{dig[:12]}"
        argv = ["tap", "--name", name, "--state-dir", str(self._state_dir()), "--digest", dig,
                "--host", c.host, "--port", str(data_plane["port"]), "--metrics-port", str(c.admin_port),
                "--drain-timeout", str(c.drain_timeout_s),
                *RelayBounds(**{k: getattr(c, k) for k in RelayBounds.__dataclass_fields__}).argv(),
                *knob_argv(lim)]
        for flag, pairs in (("--upstream", c.upstreams), ("--prefill", c.prefill), ("--front", c.front)):
            for n, u in pairs.items():
                argv += [flag, f"{n}={u}"]
        for path in c.allow_paths:
            argv += ["--allow-path", path]
        return shadow_argv(*argv), dig

    def _state_dir(self) -> Path:
        """Where this service's tap group lives: the state directory (made or checked: one another
        user could change is refused), or, when only the default was not writable, a private
        temporary one, with a warning; a group started there is bound to this process (it stops
        when this process ends, however: nothing else could find and adopt it)."""
        if self._groups_dir is not None:
            return self._groups_dir
        base, explicit = state_dir(self.config.state_dir, os.environ)
        try:
            prepare_state_dir(base)
        except Untrusted:
            raise
        except OSError as exc:
            if explicit:
                raise
            tmp = Path(tempfile.mkdtemp(prefix="shadow-state-"))
            log.warning("tap group: %s; using %s instead: a restart of this process will not find the "
                        "running tap group, so it stops when this process exits", exc.strerror or exc, tmp)
            base, self._temporary = tmp, True
        self._groups_dir = base
        return base

    async def _start_attached(self, api_sock: socket.socket, ready_timeout_s: float = 60.0) -> dict[str, Any]:
        """Attach to the tap groups (starting or adopting ours first), then serve the API."""
        c = self.config
        addresses = list(c.attach)
        if not addresses and self.taps:  # no taps (workers fed by the event API only): no group
            argv, dig = self.group_spec()
            name = argv[argv.index("--name") + 1]
            self._lock = hold_analysis_lock(self._state_dir(), [f"tap group {name!r}"], c.analysis_name)
            self.group = ManagedGroup(self._state_dir(), name, argv, dig, bound=self._temporary)
            rec = await asyncio.to_thread(self.group.ensure, ready_timeout_s)
            addresses = [str(self.group.run_dir.path)]
            for t in self.taps:
                assert isinstance(t, RemoteTap)
                t._url = rec.get("taps", {}).get(t.name, "")
        elif addresses:
            self._lock = hold_analysis_lock(self._state_dir(), addresses, c.analysis_name)
        me = boot_id()
        for address in addresses:
            self.attachments.append(Attachment(address, self._on_items, token=c.attach_token, boot_id=me,
                                               name=c.analysis_name,
                                               clock=self.clock, check=self._check_hello,
                                               oldest_s=max(1.0, c.event_skew_s - 5.0), max_body=c.max_body))
        self.analysis.start()
        await asyncio.wrap_future(self.analysis.submit(self._start_analysis(api_sock)))
        h, p = api_sock.getsockname()[:2]
        self.api_url = f"http://{h}:{p}"
        ok = await asyncio.wrap_future(self.analysis.submit(self._wait_attached(ready_timeout_s)))
        if not ok:
            errors = "; ".join(f"{a.address}: {a.last_error or 'no snapshot'}" for a in self.attachments
                               if not (a.conn is not None and a.conn.reader.snapshot_done))
            await self.stop()
            raise OSError(f"could not attach to the tap group(s): {errors}")
        return {"taps": {t.name: t.url for t in self.taps}, "api": self.api_url}

    async def _wait_attached(self, timeout_s: float) -> bool:
        got = await asyncio.gather(*(a.wait_attached(timeout_s) for a in self.attachments))
        return all(got)

    def _check_hello(self, hello: dict[str, Any]) -> str | None:
        """A relay must serve taps of this configuration, each in the role configured."""
        c = self.config
        roles = {**dict.fromkeys(c.upstreams, "decode"), **dict.fromkeys(c.prefill, "prefill"),
                 **dict.fromkeys(c.front, "front")}
        for t in hello.get("taps", []):
            name, role = t.get("name"), t.get("role", "decode")
            if name not in roles:
                return (f"the relay serves a tap {name!r} this analysis is not configured for "
                        f"(configured: {', '.join(roles) or 'none'})")
            if roles[name] != role:
                return f"tap {name!r} is a {role} tap there, {roles[name]} here"
        return None

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
            for a in self.attachments:
                a.start()
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
                for a in self.attachments:  # ends processed and recorded: the relays may forget them
                    a.ack()
                if self.group is not None:
                    self.group.poll()
                    if self._recovery is None and not self._closing and self.group.lost():
                        self._recovery = asyncio.create_task(self._recover(self.group))
                        self._tasks.append(self._recovery)
            except Exception:
                self.mirror.count_error("housekeeping")

    async def _recover(self, group: ManagedGroup, backoff_s: float = 5.0) -> None:
        """Start this service's tap group again after its supervisor was lost (its relays ended
        with it): on the ports it had, so the router needs no change; the attachments find it."""
        try:
            log.warning("tap group %r lost its supervisor: starting it again", group.run_dir.name)
            await asyncio.to_thread(group.ensure, 60.0)
            group.recovered += 1
        except OSError as exc:
            log.warning("tap group %r: could not start it again: %s", group.run_dir.name, exc)
            await asyncio.sleep(backoff_s)
        finally:
            self._recovery = None

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
        self._closing = True
        group = self.group
        if group is not None and (self.config.stop_taps or group.bound):
            await asyncio.to_thread(group.stop, self.config.drain_timeout_s + 15.0)
            with contextlib.suppress(Exception):
                await self.settle(2.0)  # the last ends the relay sent
            if group.bound and self._groups_dir is not None:  # the temporary state directory, if empty
                for d in (self._groups_dir / GROUPS, self._groups_dir):
                    with contextlib.suppress(OSError):
                        d.rmdir()
        if self.analysis.running:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.analysis.submit(self._stop_analysis()))
            self.analysis.stop()

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
        for a in self.attachments:  # what was recorded may be forgotten by the relays
            a.ack()
            with contextlib.suppress(Exception):
                await a.aclose()
