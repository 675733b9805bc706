"""`shadow capture`: mirror the router↔worker traffic without being in its path.

Reads the TCP traffic to and from the named servers off a network interface (an AF_PACKET socket:
run as root or with CAP_NET_RAW), reassembles each connection, parses it with the taps' HTTP/1.1
parser and analysis, and serves the same mirror: /v1/state (with a `capture` block: what it saw,
what it could not reassemble, the kernel's drops), /v1/events, /metrics, a recording. Nothing it
does, suffers or fails at can touch the traffic; what it missed is counted, never guessed. IPv4.

Prints one JSON line `{"api": url, "capture": {"interface": ..., "targets": {...}}}` when ready;
SIGINT/SIGTERM stop it. `shadow serve --capture IFACE` runs the live lanes on captured traffic.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any

from shadow.app import capture as capture_app
from shadow.base.knobs import add_knobs, knob_values
from shadow.commands._flags import Flag, add_flags, fields, flag
from shadow.commands._help import add_command, run_alone
from shadow.commands._service import run_reporting
from shadow.commands.serve import mirror_flags
from shadow.commands.tap import pairs
from shadow.mirror.config import MirrorBounds, MirrorConfig
from shadow.mirror.keys import key_location, open_secret

PROG = "shadow capture"
SUMMARY = "mirror the router's traffic passively, off an interface"
log = logging.getLogger("shadow.capture")

EPILOG = """examples:
  # the decode and prefill workers' traffic on this host's loopback (the router runs here too)
  sudo shadow capture --interface lo --upstream d0=http://127.0.0.1:18100 \\
       --upstream d1=http://127.0.0.1:18101 --prefill p0=http://127.0.0.1:18000 --slots 16
  # on a worker node: its pod's veth, the worker's address
  sudo shadow capture --interface veth1234 --upstream d0=http://10.0.3.7:8000
  curl -s http://127.0.0.1:PORT/v1/state | jq .capture     # seen_ratio, gaps, kernel drops
"""


def capture_flags() -> tuple[Flag, ...]:
    """What to capture and where the API listens; the mirror's options are `shadow serve`'s."""
    pair = {"action": "append", "metavar": "NAME=URL"}
    return (
        flag("--interface", "capture", "the interface to read (lo, a pod's veth, a bond ...)", required=True,
             metavar="IFACE"),
        flag("--upstream", None, "a decode (or plain) worker whose traffic to capture; repeatable", **pair),
        flag("--prefill", None, "a prefill worker (P/D) whose traffic to capture; repeatable", **pair),
        flag("--front", None, "front mode: the router's own traffic (decisions read from vllm-router's "
             "request ids)", **pair),
        flag("--host", "host", "the API's bind address (default 127.0.0.1)", default="127.0.0.1"),
        flag("--port", "port", "the API's port (default 0: a free one)", type=int, default=0),
        flag("--max-body", "max_body", "largest request/response body the analysis parses", type=int,
             default=4 << 20, metavar="BYTES"),
        flag("--queue-size", "queue_size", "capture-to-analysis queue capacity (items)", type=int,
             default=65536),
        flag("--queue-bytes", "queue_bytes", "payload bytes the capture-to-analysis queue may hold; beyond "
             "it dropped and counted", type=int, default=256 << 20, metavar="BYTES"),
        flag("--state-dir", "state_dir", "where the prompt-key secret is kept (as for shadow serve)",
             metavar="DIR"),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, capture_flags())
    mirror = p.add_argument_group("the mirror")
    add_flags(mirror, mirror_flags())
    add_knobs(mirror, MirrorBounds)


def register(subparsers: Any) -> None:
    add_command(subparsers, "capture", SUMMARY, __doc__, EPILOG, run, add_arguments)


def config_from_args(args: argparse.Namespace) -> MirrorConfig:
    if not args.upstream and not args.prefill and not args.front:
        raise SystemExit(f"{PROG}: give the servers to watch: --upstream NAME=URL (and --prefill, --front)")
    return MirrorConfig(
        **fields(args, capture_flags()),
        **fields(args, mirror_flags()),
        **knob_values(args, MirrorBounds),
        upstreams=pairs(args.upstream, "--upstream", PROG),
        prefill=pairs(args.prefill, "--prefill", PROG),
        front=pairs(args.front, "--front", PROG),
        workers=pairs(args.worker, "--worker", PROG),
        metrics_of=pairs(args.metrics_of, "--metrics-of", PROG),
        key_secret=open_secret(key_location(args.key_file, args.state_dir, os.environ), log.warning),
        relay="thread",
    )


def run(args: argparse.Namespace) -> int:
    return run_reporting(PROG, lambda: capture_app.run(config_from_args(args)))


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone(PROG, __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
