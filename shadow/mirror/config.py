"""What the analysis (`MirrorService`) is told: `MirrorConfig`, and the `MirrorBounds` it shares with
`shadow capture`. Each setting is declared once here (`shadow.base.knobs`); `check()` validates a
config as a whole, once, before a service is built from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
)
from shadow.contracts.events import MAX_REQUEST_TOKENS
from shadow.contracts.tapwire import TapContext
from shadow.dataplane.http1 import DEFAULT_ALLOW_PATHS, TapLimits
from shadow.dataplane.relay import RelayBounds

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
    token_interval_s: float = knob(0.0, "--token-interval", "pass on one Token per stream per interval of "
                                   "this many seconds of event time, not one per chunk (what a node forwards "
                                   "to the centre of a large fleet: docs/scale.md); 0 = every chunk",
                                   NON_NEGATIVE_S, metavar="S")
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

    def check(self) -> None:
        """Raise ValueError naming what is wrong: a name used twice, nothing to mirror, an unknown
        relay kind, a setting out of its bounds, attaching without a relay process, capture with
        taps."""
        c = self
        names = [*c.upstreams, *c.prefill, *c.front, *c.workers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"names used twice: {sorted(dup)}")
        if not c.upstreams and not c.front and not c.workers:
            raise ValueError("nothing to mirror: give upstream workers to tap, or a router to front")
        if c.relay not in ("thread", "process"):
            raise ValueError(f"relay must be 'thread' or 'process', got {c.relay!r}")
        check_knobs(c)
        if c.attach and c.relay != "process":
            raise ValueError("attaching to tap groups needs relay='process'")
        if c.capture is not None and (c.relay != "thread" or c.attach):
            raise ValueError("--capture reads the traffic off an interface: no taps to run or attach to")

    def tap_limits(self) -> TapLimits:
        """The limits of the taps this config runs (or of the group it starts)."""
        return TapLimits(
            max_head=self.max_head,
            header_timeout_s=self.header_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            max_connections=self.max_connections,
            allow_paths=DEFAULT_ALLOW_PATHS + tuple(self.allow_paths),
        )
