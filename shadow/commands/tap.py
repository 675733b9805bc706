"""`shadow tap`: in-path taps in front of upstream workers, mirroring the router's decisions.

Point the existing router at the printed tap URLs instead of the workers — or, in front mode
(`--front`), point clients at a tap in front of the router and name the decode workers behind it
with `--worker`; decisions are read from what the router exposes. When ready, one JSON
line `{"taps": {NAME: url}, "api": url}` is printed on stdout; the API serves /v1/state,
/v1/events (GET recent, POST NDJSON), /v1/events/schema and /metrics.

Taps relay the inference API only (/v1/*, /health, /metrics, /version, /tokenize, ...; extend
with --allow-path); malformed or ambiguous HTTP/1.1 gets 400 and is never forwarded. SIGTERM,
SIGINT or SIGHUP: stop accepting, let in-flight streams finish (up to --drain-timeout), exit; a
second signal exits at once. The taps relay in a child process of their own (`--relay process`, the
default): the analysis, the API, reaping and scraping run in this one and can never take the
relay's interpreter; copies cross over a bounded socket (full: dropped and counted). If the relay
process dies, `shadow tap` stops and exits 1.

Example:
  shadow tap --upstream d0=http://10.0.0.5:8000 --upstream d1=http://10.0.0.6:8000 --slots 256
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any

from shadow.app import tap as tap_app
from shadow.base.runtime import LOOPS
from shadow.commands._flags import Flag, add_flags, fields, flag
from shadow.commands._service import add_log_arguments, run_reporting, start_logging
from shadow.mirror.http1 import DEFAULT_ALLOW_PATHS
from shadow.mirror.keys import key_location, open_secret
from shadow.mirror.service import TapConfig

PROG = "shadow tap"
log = logging.getLogger("shadow.tap")


def _pairs(values: Sequence[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values or ():
        name, sep, url = v.partition("=")
        if not sep or not name or not url:
            raise SystemExit(f"{PROG}: {what} must be NAME=URL, got {v!r}")
        if name in out:
            raise SystemExit(f"{PROG}: {what} name {name!r} given twice")
        out[name] = url
    return out


def tap_flags() -> tuple[Flag, ...]:
    """`shadow tap`'s options in `--help` order (built per call: two defaults come from the environment)."""
    pair = {"action": "append", "metavar": "NAME=URL"}
    return (
        flag("--upstream", None, "a decode (or plain) worker to put a tap in front of; repeatable", **pair),
        flag("--front", None, "front mode: a pass-through tap in front of the router itself (point "
             "clients at it); the decode worker is read from the decision the router exposes (vllm-router "
             "P/D request ids)", **pair),
        flag("--worker", None, "front mode: a decode worker behind the router (named in its decisions; "
             "/metrics reconciled)", **pair),
        flag("--prefill", None, "a prefill worker (P/D) to put a tap in front of; repeatable", **pair),
        flag("--metrics-of", None,
             "where NAME's Prometheus metrics are (default: its upstream URL + /metrics)", **pair),
        flag("--host", "host", "bind address for taps and API (default 127.0.0.1)", default="127.0.0.1"),
        flag("--port", "port", "API port; taps take the following ports (default 0: all ephemeral)", type=int,
             default=0),
        flag("--record", "record", "record the session compactly (one line per request, step aggregates; "
             "gzip if FILE ends in .gz); `shadow replay FILE` replays it", metavar="FILE"),
        flag("--record-max-bytes", "record_max_bytes", "rotate the recording at about this size (FILE.1, "
             "FILE.2, ...; default: never)", type=int, default=None, metavar="BYTES"),
        flag("--max-body", "max_body", "largest request/response body the analysis parses (traffic is never "
             "limited)", type=int, default=4 << 20, metavar="BYTES"),
        flag("--queue-size", "queue_size", "tap-to-analysis queue capacity (items)", type=int, default=65536),
        flag("--slots", "slots", "decode slots per worker, if known", type=int, default=None),
        flag("--ttl", "ttl_s", "reap requests silent this long (s)", type=float, default=300.0),
        flag("--phantom-age", "phantom_age_s", "count as phantom when silent this long (s)", type=float,
             default=120.0),
        flag("--scrape-interval", "scrape_interval_s", "reconciliation period (s); 0 = off", type=float,
             default=5.0),
        flag("--loop", "loop", "event loop: uvloop roughly halves the relay's CPU per chunk; auto = uvloop "
             "when installed", choices=LOOPS, default="auto"),
        flag("--relay", "relay", "where the taps relay: 'process' = a child process of their own, so "
             "analysis, the API, reaping and scraping can never take the interpreter from them (default); "
             "'thread' = in this process, analysis on a second thread (one process, but their GIL is shared)",
             choices=("process", "thread"), default="process"),
        flag("--analysis-nice", "analysis_nice", "with --relay process: lower the analysis thread's priority "
             "by N (0-19; default 0), so a core shared with the relay serves the relay first (the analysis "
             "drops and counts instead)", type=int, default=0, metavar="N"),
        flag("--inject-usage", "inject_usage", "ask workers for continuous usage stats (exact token counts) "
             "and strip them from what clients receive unless they asked; changes the wire bytes, off by "
             "default", action="store_true"),
        flag("--forward", "forward_to", "also POST every event to another shadow's event API",
             metavar="URL"),
        flag("--forward-token", "forward_token", "bearer token for --forward posts (env "
             "SHADOW_FORWARD_TOKEN); failures are counted in shadow_mirror_forward_errors_total",
             default=os.environ.get("SHADOW_FORWARD_TOKEN")),
        flag("--allow-path", None, "relay this path too (a trailing / makes it a prefix); repeatable. "
             "Default list: " + " ".join(DEFAULT_ALLOW_PATHS), action="append", metavar="PATH", default=[]),
        flag("--drain-timeout", None, "on SIGTERM/SIGINT/SIGHUP, wait this long for in-flight requests to "
             "finish, then cut what is left (default 30)", type=float, default=30.0, metavar="S"),
        flag("--max-connections", "max_connections", "client connections per tap; beyond it the oldest idle "
             "one is closed, else 503 (default 4096)", type=int, default=4096),
        flag("--api-max-connections", "api_max_connections", "connections to the API/admin listener; beyond "
             "it the oldest idle one is closed, else 503 (default 256)", type=int, default=256),
        flag("--header-timeout", "header_timeout_s", "request head deadline on every listener (default 10)",
             type=float, default=10.0, metavar="S"),
        flag("--idle-timeout", "idle_timeout_s", "idle keep-alive close (default 60)", type=float,
             default=60.0, metavar="S"),
        flag("--max-live", "max_live", "mirrored requests alive at once; new ones beyond it are dropped and "
             "counted (default 1e6)", type=int, default=1_000_000),
        flag("--max-head", "max_head", "request head size cap, 431 beyond (65536)", type=int,
             default=64 << 10, metavar="BYTES"),
        flag("--max-id-len", "max_id_len", "longest request id / worker / prompt key accepted by the event "
             "API (default 256)", type=int, default=256),
        flag("--ring-bytes", "ring_bytes", "recent-events buffer served by GET /v1/events, approximate bytes "
             "(default 16 MiB)", type=int, default=16 << 20, metavar="BYTES"),
        flag("--queue-bytes", "queue_bytes", "payload bytes the tap-to-analysis hand-off may hold; beyond it "
             "copies are dropped and counted, traffic is never affected (default 256 MiB)", type=int,
             default=256 << 20, metavar="BYTES"),
        flag("--state-dir", None, "where state is kept (the prompt-key secret); default $SHADOW_STATE_DIR, "
             "systemd's $STATE_DIRECTORY, else $XDG_STATE_HOME/shadow or ~/.local/state/shadow",
             metavar="DIR"),
        flag("--key-file", None, "secret for prompt keys (HMAC, hex), created when missing, or a mounted "
             "Secret; default $SHADOW_KEY_FILE, else STATE_DIR/prompt-key. Named (flag, env, state dir) and "
             "not creatable: exit 1; the default location not writable: a fresh in-memory secret and a "
             "warning", metavar="FILE"),
        flag("--events-token", "events_token", "bearer token required by POST /v1/events (env "
             "SHADOW_EVENTS_TOKEN); without one, event ingestion is refused unless the API listens on "
             "loopback, and everywhere in a serve with an admin token (events can trip its mode)",
             default=os.environ.get("SHADOW_EVENTS_TOKEN")),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, tap_flags())
    add_log_arguments(p)


EPILOG = """examples:
  # taps in front of two decode workers and a prefill server; point the router at the printed URLs
  shadow tap --upstream d0=http://127.0.0.1:18100 --upstream d1=http://127.0.0.1:18101 \\
             --prefill p0=http://127.0.0.1:18000 --record session.ndjson
  # front mode: one tap in front of vllm-router (P/D), decisions read from its request ids
  shadow tap --front router=http://127.0.0.1:8000 --worker d0=http://127.0.0.1:18100 \\
             --worker d1=http://127.0.0.1:18101
  curl -s http://127.0.0.1:PORT/v1/state          # PORT: the "api" URL of the ready line
  shadow replay session.ndjson                    # the recorded session through every policy
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tap", help="mirror an existing router through in-path taps", description=__doc__, epilog=EPILOG
    )
    add_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TapConfig:
    if not args.upstream and not args.front and not getattr(args, "worker", None):
        raise SystemExit(
            f"{PROG}: give --upstream NAME=URL (in-path taps) or --front NAME=URL (front mode)"
        )
    return TapConfig(
        **fields(args, tap_flags()),
        upstreams=_pairs(args.upstream, "--upstream"),
        prefill=_pairs(args.prefill, "--prefill"),
        front=_pairs(args.front, "--front"),
        workers=_pairs(args.worker, "--worker"),
        metrics_of=_pairs(args.metrics_of, "--metrics-of"),
        allow_paths=tuple(args.allow_path),
        key_secret=open_secret(key_location(args.key_file, args.state_dir, os.environ), log.warning),
    )


def run(args: argparse.Namespace) -> int:
    def body() -> None:
        config = config_from_args(args)
        start_logging(PROG, args)
        tap_app.run(config, args.drain_timeout)

    return run_reporting(PROG, body)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
